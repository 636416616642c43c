"""Checkpoint benchmarks on 8 fake CPU devices (issue 13).

Run: ``python benchmarks/checkpoint_bench.py [--repeats N] [--mb 100] [--json PATH]
[--restore-only] [--before DIR]`` (DIR: an older checkout, as ``placement_bench.py --before``).

* save / restore of a ~100 MB TrainState replicated over 8 devices:
  ``jaxdev.save`` / ``jaxdev.restore`` (which add a checksum per leaf and
  jaxdev's metadata; ``save`` fsyncs what it writes, and ``durable=False``
  does not, as orbax) against orbax's ``PyTreeCheckpointHandler`` used directly
  (the same synchronous ``Checkpointer``, the same abstract target with
  shardings), interleaved repetitions, medians; the checksum pass alone;
* the step-loop stall of an asynchronous ``Checkpointer.save`` (the time
  ``save`` blocks the loop) against one train step on the same state, and
  against orbax's ``CheckpointManager.save`` used directly;
* restore across layouts: 8 replicated -> 4 replicated, pmap-stacked ->
  sharded ``P('data')``, sharded -> 1 device.

Every directory is written under a fresh temporary folder and deleted after
its repetition (outside the timed part).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from _timing import Timings, time_side_by_side  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdev.checkpoint._checksum import checksums  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def make_state(mb: int, mesh) -> jaxdev.TrainState:
    """``mb`` MB of float32 params in 1000x1000 Dense kernels plus biases, replicated (SGD)."""
    rng = np.random.default_rng(0)
    layers = max(1, mb // 4)
    params = {
        f"Dense_{i}": {
            "kernel": rng.normal(size=(1000, 1000)).astype(np.float32),
            "bias": rng.normal(size=(1000,)).astype(np.float32),
        }
        for i in range(layers)
    }
    return jaxdev.replicate(jaxdev.TrainState.create(params, optax.sgd(0.01)), mesh)


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def time_interleaved(fns: dict, repeats: int, cleanup) -> Timings:
    """``_timing.time_side_by_side`` with ``cleanup()`` after each call, untimed."""
    return time_side_by_side(fns, repeats, warmup=1, after=cleanup)


def bench_save_restore(state, root: str, repeats: int, saves=True, before=None) -> list[dict]:
    """Save and restore rows; ``saves=False``: the restore rows only; ``before``: an older
    jaxdev package whose restore is timed beside (the same checkpoint)."""
    counter = itertools.count()
    fresh = lambda: os.path.join(root, f"c{next(counter)}")  # noqa: E731
    handler = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())

    def cleanup():
        for name in os.listdir(root):
            if name.startswith("c"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    saves = saves and time_interleaved(
        {
            "jaxdev.save": lambda: jaxdev.save(fresh(), state),
            "jaxdev.save durable=False": lambda: jaxdev.save(fresh(), state, durable=False),
            "orbax PyTreeCheckpointHandler save": lambda: handler.save(
                fresh(), args=ocp.args.PyTreeSave(state)
            ),
            # replacing an existing checkpoint: jaxdev writes beside it and swaps; orbax's
            # force=True deletes the old one first (not atomic)
            "jaxdev.save overwrite=True": lambda: jaxdev.save(
                os.path.join(root, "o_jaxdev"), state, overwrite=True
            ),
            "orbax save force=True": lambda: handler.save(
                os.path.join(root, "o_orbax"), args=ocp.args.PyTreeSave(state), force=True
            ),
        },
        repeats,
        cleanup,
    )
    jaxdev.save(os.path.join(root, "r_jaxdev"), state)
    handler.save(os.path.join(root, "r_orbax"), args=ocp.args.PyTreeSave(state))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    old = lambda: before.restore(os.path.join(root, "r_jaxdev"), abstract)  # noqa: E731
    fns = {"jaxdev.restore (before)": old} if before else {}
    restores = time_interleaved(
        fns
        | {
            "jaxdev.restore": lambda: jaxdev.restore(os.path.join(root, "r_jaxdev"), abstract),
            "orbax PyTreeCheckpointHandler restore": lambda: handler.restore(
                os.path.join(root, "r_orbax"),
                args=ocp.args.PyTreeRestore(abstract, restore_args=restore_args),
            ),
            "checksum pass alone": lambda: checksums(  # one copy, as restore checks it on CPU
                [x.addressable_data(0) for x in jax.tree.leaves(state)]
            ),
        },
        repeats,
        lambda: None,
    )
    handler.close()
    rows = [
        _row(
            restores,
            "restore (same layout)",
            "jaxdev.restore",
            "orbax PyTreeCheckpointHandler restore",
            "<= 1.05x",
        ),
        _row(restores, "checksum of every leaf", "checksum pass alone", "jaxdev.restore", "report"),
    ]
    if before:
        rows += [
            _row(
                restores,
                "restore (same layout), before",
                "jaxdev.restore (before)",
                "orbax PyTreeCheckpointHandler restore",
                "report",
            )
        ]
    if not saves:
        return rows
    return rows + [
        _row(saves, "save", "jaxdev.save", "orbax PyTreeCheckpointHandler save", "<= 1.10x"),
        _row(
            saves,
            "save without fsync",
            "jaxdev.save durable=False",
            "orbax PyTreeCheckpointHandler save",
            "<= 1.10x",
        ),
        _row(saves, "fsync (issue 34)", "jaxdev.save", "jaxdev.save durable=False", "report"),
        _row(
            saves,
            "save over an existing checkpoint",
            "jaxdev.save overwrite=True",
            "orbax save force=True",
            "<= 1.10x",
        ),
    ]


def _row(t: Timings, what: str, a: str, b: str, target: str) -> dict:
    ratio = t.ratio(a, b)
    met = "-" if target == "report" else ("yes" if ratio <= float(target[3:-1]) else "no")
    return {
        "what": what,
        "variant": a,
        "median_ms": round(t.median(a) * 1e3, 1),
        "ratio_vs": f"{b} ({t.median(b) * 1e3:.1f} ms)",
        "ratio": round(ratio, 3),
        "target": target,
        "met": met,
    }


def bench_async_stall(state, root: str, repeats: int) -> list[dict]:
    """Blocking time of an async save inside a step loop vs one step."""

    @jax.jit
    def step(s):
        return s._replace(step=s.step + 1, params=jax.tree.map(lambda p: p * 0.999, s.params))

    s = step(state)
    jax.block_until_ready(s)
    step_times, jaxdev_stall, orbax_stall = [], [], []
    with jaxdev.Checkpointer(os.path.join(root, "async_jaxdev"), keep=1) as ckpt:
        manager = ocp.CheckpointManager(
            os.path.join(root, "async_orbax"),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True),
        )
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            s = step(s)
            jax.block_until_ready(s)
            t1 = time.perf_counter()
            ckpt.save(2 * i, s)
            t2 = time.perf_counter()
            manager.save(2 * i, args=ocp.args.PyTreeSave(s))
            t3 = time.perf_counter()
            ckpt.wait()
            manager.wait_until_finished()
            if i:  # the first save compiles the checksum program
                step_times.append(t1 - t0)
                jaxdev_stall.append(t2 - t1)
                orbax_stall.append(t3 - t2)
        manager.close()
    step_ms = statistics.median(step_times) * 1e3
    j_ms = statistics.median(jaxdev_stall) * 1e3
    o_ms = statistics.median(orbax_stall) * 1e3
    return [
        {
            "what": "async save: time the step loop is blocked",
            "variant": "jaxdev.Checkpointer.save",
            "median_ms": round(j_ms, 1),
            "ratio_vs": f"one train step ({step_ms:.1f} ms)",
            "ratio": round(j_ms / step_ms, 2),
            "target": "report",
            "met": "-",
        },
        {
            "what": "async save: time the step loop is blocked",
            "variant": "jaxdev.Checkpointer.save",
            "median_ms": round(j_ms, 1),
            "ratio_vs": f"orbax CheckpointManager.save ({o_ms:.1f} ms)",
            "ratio": round(j_ms / o_ms, 2),
            "target": "report",
            "met": "-",
        },
    ]


def bench_layouts(state, mesh, root: str, repeats: int) -> list[dict]:
    """Restore across layouts, each against a same-layout restore of the same checkpoint."""
    devices = jax.devices()
    four = jaxdev.data_mesh(devices[:4])
    stacked = jaxdev.pmap.stack_for_pmap(state.params)
    split = NamedSharding(mesh, P("data"))
    sharded = jaxdev.to_device(state.params, split)
    jaxdev.save(os.path.join(root, "rep"), state)
    jaxdev.save(os.path.join(root, "stacked"), stacked)
    jaxdev.save(os.path.join(root, "sharded"), sharded)
    # the one copy of each stacked leaf, split P('data'): a target with the row shapes
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split), sharded)
    cases = {
        "8 replicated -> 4 replicated": lambda: jaxdev.restore(os.path.join(root, "rep"), four),
        "8 replicated -> 8 replicated (same layout)": lambda: jaxdev.restore(
            os.path.join(root, "rep"), mesh
        ),
        "stacked (8, ...) -> sharded P('data')": lambda: jaxdev.restore(
            os.path.join(root, "stacked"), rows
        ),
        "sharded -> 1 device": lambda: jaxdev.restore(os.path.join(root, "sharded"), "cpu:0"),
        "sharded -> sharded (same layout)": lambda: jaxdev.restore(
            os.path.join(root, "sharded"), split
        ),
    }
    t = time_interleaved(cases, repeats, lambda: None)
    same = {
        "8 replicated -> 4 replicated": "8 replicated -> 8 replicated (same layout)",
        "stacked (8, ...) -> sharded P('data')": "sharded -> sharded (same layout)",
        "sharded -> 1 device": "sharded -> sharded (same layout)",
    }
    return [
        {
            "what": "restore across layouts",
            "variant": name,
            "median_ms": round(t.median(name) * 1e3, 1),
            "ratio_vs": f"{ref} ({t.median(ref) * 1e3:.1f} ms)",
            "ratio": round(t.ratio(name, ref), 2),
            "target": "report",
            "met": "-",
        }
        for name, ref in same.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mb", type=int, default=100, help="size of the params (MB)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--restore-only", action="store_true", help="the same-layout restore only")
    parser.add_argument("--before", help="a folder holding an older jaxdev/: its restore beside")
    args = parser.parse_args()
    before = None
    if args.before:
        from placement_bench import load_before

        before = load_before(args.before)
    mesh = jaxdev.data_mesh()
    state = make_state(args.mb, mesh)
    print(
        f"state: {nbytes(state) / 1e6:.1f} MB, {len(jax.tree.leaves(state))} leaves, "
        f"replicated over {len(jax.devices())} fake CPU devices; repeats {args.repeats}\n"
    )
    root = tempfile.mkdtemp(prefix="jaxdev_ckpt_bench_")
    try:
        rows = bench_save_restore(state, root, args.repeats, not args.restore_only, before)
        if not args.restore_only:
            rows += bench_async_stall(state, root, args.repeats)
            rows += bench_layouts(state, mesh, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from _timing import report

    report(rows, ("median_ms", "median ms"), args.json)
    if args.json:
        with open(args.json) as f:
            json.load(f)


if __name__ == "__main__":
    main()
