"""Benchmarks of jaxdev's placement and assertions on 8 fake CPU devices (issue 2).

Run: ``python benchmarks/placement_bench.py [--repeats N] [--json PATH] [--before DIR]``.
``--before DIR`` also times, side by side, the ``jaxdev`` package found in ``DIR``
(an older checkout: ``git archive REV jaxdev | tar -x -C DIR``) against this one.

Every ratio compares two ways of doing the same thing, timed side by side in
this one run (interleaved repetitions, warm-up, medians; see ``_timing.py``).
Trees: a Flax-MLP-shaped tree of 50 leaves (25 Dense layers, kernel + bias,
~1M float32 params) and a 2000-leaf tree (1000 small layers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import chex  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import time_side_by_side  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def host_tree(layers: int, width: int) -> dict:
    """Flax-params-shaped numpy tree: ``layers`` Dense layers, 2 leaves each."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            f"Dense_{i}": {
                "kernel": rng.normal(size=(width, width)).astype(np.float32),
                "bias": rng.normal(size=(width,)).astype(np.float32),
            }
            for i in range(layers)
        }
    }


TREES = {"50 leaves": (25, 200), "2000 leaves": (1000, 16)}


def timed(fns: dict, repeats: int):
    """Medians (seconds) and a ratio function from one side-by-side run.

    ``ratio(a, b)`` is the median of per-repetition ratios when ``_timing``
    keeps the samples (pairs ran moments apart, so load cancels out), else
    the ratio of medians.
    """
    t = time_side_by_side(fns, repeats)
    if hasattr(t, "median"):
        return {k: t.median(k) for k in t}, t.ratio
    return dict(t), lambda a, b: t[a] / t[b]


def describe(tree) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    return f"{len(leaves)} leaves, {sum(x.size for x in leaves) / 1e6:.2f}M params"


def row(what, tree, ours, theirs, t_ours, t_theirs, ratio, target, ok) -> dict:
    return {
        "benchmark": what,
        "tree": tree,
        "jaxdev": ours,
        "baseline": theirs,
        "jaxdev_ms": t_ours * 1e3,
        "baseline_ms": None if t_theirs is None else t_theirs * 1e3,
        "ratio": ratio,
        "target": target,
        "met": ok,
    }


def _done(result) -> None:
    """Drop a result the timer need not wait on (its ``block_until_ready`` walks every leaf)."""
    del result


def bench_placed(name: str, dev, repeats: int) -> list[dict]:
    """to_device of an already placed tree vs raw device_put to the same device."""
    placed = jax.device_put(host_tree(*TREES[name]), dev)
    assert jaxdev.to_device(placed, dev) is placed
    # Nothing moves (device_put aliases a placed array's buffer), so both sides
    # drop their result: the timer's block_until_ready walk of every leaf
    # (~1 us a leaf, the same for both) would only dilute the ratio.
    t, ratio_of = timed(
        {
            "to_device": lambda: _done(jaxdev.to_device(placed, dev)),
            "device_put": lambda: _done(jax.device_put(placed, dev)),
        },
        repeats,
    )
    speedup = ratio_of("device_put", "to_device")
    return [
        row(
            "already placed: to_device vs device_put",
            describe(placed),
            "jaxdev.to_device(tree, d)",
            "jax.device_put(tree, d)",
            t["to_device"],
            t["device_put"],
            f"{speedup:.1f}x cheaper",
            ">= 10x (DESIGN: 20x)",
            speedup >= 10,
        )
    ]


def bench_host(name: str, dev, repeats: int) -> list[dict]:
    """to_device / copy_to of a numpy tree vs one raw device_put.

    On CPU, ``jax.device_put`` aliases 64-byte-aligned numpy buffers even with
    ``may_alias=False``, so it may copy nothing; ``to_device`` and ``copy_to`` copy a
    writeable numpy leaf (a refilled buffer must not change the placed array). Their
    fair raw equivalent is a device_put of copied numpy leaves.
    """
    host = host_tree(*TREES[name])
    t, ratio_of = timed(
        {
            "to_device": lambda: jaxdev.to_device(host, dev),
            "copy_to": lambda: jaxdev.copy_to(host, dev),
            "device_put": lambda: jax.device_put(host, dev),
            "device_put(may_alias=False)": lambda: jax.device_put(host, dev, may_alias=False),
            "device_put(copied leaves)": lambda: jax.device_put(jax.tree.map(np.copy, host), dev),
        },
        repeats,
    )
    raw_calls = {
        "device_put": "jax.device_put(tree, d)",
        "device_put(may_alias=False)": "jax.device_put(tree, d, may_alias=False)",
        "device_put(copied leaves)": "jax.device_put(jax.tree.map(np.copy, tree), d)",
    }
    pairs = [
        ("to_device", "device_put"),
        ("to_device", "device_put(may_alias=False)"),
        ("to_device", "device_put(copied leaves)"),
        ("copy_to", "device_put"),
        ("copy_to", "device_put(copied leaves)"),
    ]
    rows = []
    for ours, raw in pairs:
        ratio = ratio_of(ours, raw)
        rows.append(
            row(
                f"host tree: {ours} vs {raw}",
                describe(host),
                f"jaxdev.{ours}(tree, d)",
                raw_calls[raw],
                t[ours],
                t[raw],
                f"{ratio:.2f}x",
                "<= 1.10x",
                ratio <= 1.10,
            )
        )
    return rows


def load_before(folder: str):
    """The ``jaxdev`` package in ``folder`` imported as ``jaxdev_before`` (relative imports)."""
    import importlib.util

    init = os.path.join(folder, "jaxdev", "__init__.py")
    spec = importlib.util.spec_from_file_location("jaxdev_before", init)
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxdev_before"] = module
    spec.loader.exec_module(module)
    return module


def bench_before(name: str, dev, mesh, before, repeats: int) -> list[dict]:
    """to_device / copy_to / replicate of a numpy tree: this checkout vs ``before``, one run."""
    host = host_tree(*TREES[name])
    calls = {
        "to_device": lambda j: j.to_device(host, dev),
        "copy_to": lambda j: j.copy_to(host, dev),
        "replicate": lambda j: j.replicate(host, mesh),
    }
    sides = {"after": jaxdev, "before": before}
    fns = {f"{k} {s}": (lambda f=f, j=j: f(j)) for k, f in calls.items() for s, j in sides.items()}
    t, ratio_of = timed(fns, repeats)
    return [
        row(
            f"host tree: {k} after vs before",
            describe(host),
            f"jaxdev.{k} (this checkout)",
            f"jaxdev.{k} ({before.__file__.rsplit('/jaxdev/', 1)[0]})",
            t[f"{k} after"],
            t[f"{k} before"],
            f"{ratio_of(f'{k} after', f'{k} before'):.2f}x",
            "report",
            None,
        )
        for k in calls
    ]


def bench_replicate(name: str, mesh, repeats: int) -> list[dict]:
    """jaxdev.replicate vs raw device_put to NamedSharding(mesh, P()), if it exists yet."""
    host = host_tree(*TREES[name])
    if not hasattr(jaxdev, "replicate"):
        return [
            row(
                "replicate vs device_put(P())",
                describe(host),
                "jaxdev.replicate (missing)",
                "jax.device_put(tree, NamedSharding(mesh, P()))",
                float("nan"),
                None,
                "skipped: jaxdev.replicate does not exist yet",
                "<= 1.10x",
                None,
            )
        ]
    rep = NamedSharding(mesh, P())
    t, ratio_of = timed(
        {
            "replicate": lambda: jaxdev.replicate(host, mesh),
            "device_put": lambda: jax.device_put(host, rep),
        },
        repeats,
    )
    ratio = ratio_of("replicate", "device_put")
    return [
        row(
            "host tree: replicate vs device_put(P())",
            describe(host),
            "jaxdev.replicate(tree, mesh)",
            "jax.device_put(tree, NamedSharding(mesh, P()))",
            t["replicate"],
            t["device_put"],
            f"{ratio:.2f}x",
            "<= 1.10x",
            ratio <= 1.10,
        )
    ]


def bench_fetch(mesh, repeats: int, before=None) -> list[dict]:
    """Collection.fetch of 4 metrics vs one jax.device_get of the same leaves, and vs that
    device_get plus the same arithmetic by hand (what fetch returns); ``before``'s beside."""

    def make(j):
        def run(x):
            return j.metrics.Collection(
                {
                    "loss": j.metrics.Mean.from_value(x),
                    "acc": j.metrics.Accuracy.from_value(x > 0),
                    "bad": j.metrics.NonFinite.from_value(x),
                    "lr": j.metrics.Last.from_value(x[0]),
                }
            )

        return jax.block_until_ready(jax.jit(run)(jaxdev.replicate(np.arange(16.0), mesh)))

    m = make(jaxdev)
    leaves = jax.tree.leaves(m)  # acc (total, count), bad, loss (total, count), lr (value, count)

    def by_hand():
        acc_t, acc_n, bad, loss_t, loss_n, lr, lr_n = jax.device_get(leaves)
        mean = lambda t, n: float(np.float32(t / max(n, 1))) if n else math.nan  # noqa: E731
        return {"acc": mean(acc_t, acc_n), "bad": int(bad), "loss": mean(loss_t, loss_n),
                "lr": float(lr) if lr_n else math.nan}  # fmt: skip

    assert by_hand() == m.fetch(), (by_hand(), m.fetch())
    fns = {"fetch": m.fetch, "device_get": lambda: jax.device_get(leaves), "by hand": by_hand}
    fns |= {"fetch (before)": make(before).fetch} if before else {}
    t, ratio_of = timed(fns, repeats * 20)
    pairs = (("device_get", "jax.device_get(leaves)"),)
    pairs += (("by hand", "jax.device_get(leaves) + the arithmetic"),)
    pairs += (("fetch (before)", f"m.fetch() ({args_before(before)})"),) if before else ()
    return [
        row(
            f"Collection.fetch vs {raw}",
            "4 metrics, 7 leaves",
            "m.fetch()",
            call,
            t["fetch"],
            t[raw],
            f"{ratio_of('fetch', raw):.2f}x",
            "report (issue 35: near device_get)",
            None,
        )
        for raw, call in pairs
    ]


def args_before(before) -> str:
    return before.__file__.rsplit("/jaxdev/", 1)[0]


def bench_assert_vs_chex(name: str, dev, repeats: int) -> list[dict]:
    """assert_on_device vs chex.assert_tree_is_on_device (chex must be told the device)."""
    placed = jax.device_put(host_tree(*TREES[name]), dev)
    t, ratio_of = timed(
        {
            "jaxdev(d)": lambda: jaxdev.assert_on_device(placed, dev),
            "jaxdev(None)": lambda: jaxdev.assert_on_device(placed),
            "chex(device=d)": lambda: chex.assert_tree_is_on_device(placed, device=dev),
        },
        repeats,
    )
    rows = []
    for ours, call in (
        ("jaxdev(d)", "assert_on_device(tree, d)"),
        ("jaxdev(None)", "assert_on_device(tree)"),
    ):
        speedup = ratio_of("chex(device=d)", ours)
        rows.append(
            row(
                f"{call} vs chex",
                describe(placed),
                f"jaxdev.{call}",
                "chex.assert_tree_is_on_device(tree, device=d)",
                t[ours],
                t["chex(device=d)"],
                f"{speedup:.1f}x faster",
                ">= 8x",
                speedup >= 8,
            )
        )
    return rows


def bench_2000(dev, mesh, repeats: int) -> list[dict]:
    """Each assertion and placement() on the 2000-leaf tree, absolute time (< 10 ms)."""
    host = host_tree(*TREES["2000 leaves"])
    one = jax.device_put(host, dev)
    rep = jax.device_put(host, NamedSharding(mesh, P()))
    shd = jax.device_put(host, NamedSharding(mesh, P("data")))
    fns = {
        "assert_on_device(tree, d)": lambda: jaxdev.assert_on_device(one, dev),
        "assert_on_device(tree)": lambda: jaxdev.assert_on_device(one),
        "assert_on_host(numpy tree)": lambda: jaxdev.assert_on_host(host),
        "assert_replicated(tree, mesh)": lambda: jaxdev.assert_replicated(rep, mesh),
        "assert_sharded(tree, P('data'))": lambda: jaxdev.assert_sharded(shd, P("data")),
        "assert_committed(tree)": lambda: jaxdev.assert_committed(one),
        "assert_same_placement(tree, tree)": lambda: jaxdev.assert_same_placement(one, one),
        "placement(tree)": lambda: _done(jaxdev.placement(one)),
        "placement(sharded tree)": lambda: _done(jaxdev.placement(shd)),
    }
    t, ratio_of = timed(fns, repeats)
    return [
        row(
            name,
            describe(one),
            f"jaxdev.{name}",
            None,
            sec,
            None,
            f"{sec * 1e3:.2f} ms",
            "< 10 ms",
            sec < 0.010,
        )
        for name, sec in t.items()
    ]


def markdown(rows: list[dict]) -> str:
    head = "| benchmark | tree | jaxdev ms | baseline ms | result | target | met |"
    lines = [head, "|---|---|---:|---:|---|---|---|"]
    for r in rows:
        base = "-" if r["baseline_ms"] is None else f"{r['baseline_ms']:.3f}"
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        lines.append(
            f"| {r['benchmark']} | {r['tree']} | {r['jaxdev_ms']:.3f} | {base} | {r['ratio']} "
            f"| {r['target']} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repetitions")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    parser.add_argument("--before", help="a folder holding an older jaxdev/ to compare with")
    args = parser.parse_args(argv)
    before = load_before(args.before) if args.before else None
    devices = jax.devices()
    dev = devices[0]
    mesh = Mesh(np.array(devices), ("data",))
    rows = []
    for name in TREES:
        rows += bench_placed(name, dev, args.repeats)
        rows += bench_host(name, dev, args.repeats)
        rows += bench_replicate(name, mesh, args.repeats)
        if before is not None:
            rows += bench_before(name, dev, mesh, before, args.repeats)
        rows += bench_assert_vs_chex(name, dev, args.repeats)
    rows += bench_2000(dev, mesh, args.repeats)
    rows += bench_fetch(mesh, args.repeats, before)
    print(
        f"jax {jax.__version__}, chex {chex.__version__}, {len(devices)} "
        f"{jax.default_backend()} devices, {args.repeats} interleaved repetitions, medians\n"
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            meta = {"jax": jax.__version__, "chex": chex.__version__, "devices": len(devices)}
            json.dump({**meta, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
