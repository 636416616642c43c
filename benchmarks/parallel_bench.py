"""Benchmarks of jaxdev's parallel layer on 8 fake CPU devices (issue 3).

Run: ``python benchmarks/parallel_bench.py [--repeats N] [--json PATH]``.
Every ratio compares two ways of doing the same thing, timed side by side in
this one run (interleaved repetitions, medians; see ``_timing.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import time_side_by_side  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def params_tree(layers: int = 25, width: int = 200) -> dict:
    """50 leaves, ~1M float32 params, on the default device (like fresh Flax init)."""
    rng = np.random.default_rng(0)
    return {
        f"layer_{i}": {
            "kernel": jnp.asarray(rng.normal(size=(width, width)).astype(np.float32)),
            "bias": jnp.asarray(rng.normal(size=(width,)).astype(np.float32)),
        }
        for i in range(layers)
    }


def bench_replicate(mesh, repeats: int) -> list[dict]:
    tree = params_tree()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(tree))
    rep = NamedSharding(mesh, P())
    fns = {
        "jaxdev.replicate": lambda: jaxdev.replicate(tree, mesh),
        "jax.device_put(P())": lambda: jax.device_put(tree, rep),
    }
    try:
        from flax import jax_utils

        fns["flax.jax_utils.replicate"] = lambda: jax_utils.replicate(tree)
        flax_name = "flax.jax_utils.replicate"
    except ImportError:  # flax removed jax_utils: compare to the same stacked copy
        fns["stacked copy"] = lambda: jaxdev.pmap.stack_for_pmap(tree)
        flax_name = "stacked copy"
    t = time_side_by_side(fns, repeats)
    what = f"replicate {len(jax.tree_util.tree_leaves(tree))} leaves, {n_params / 1e6:.2f}M params"
    return [
        row(
            what,
            "jaxdev.replicate",
            "jax.device_put(tree, NamedSharding(mesh, P()))",
            t,
            "jaxdev.replicate",
            "jax.device_put(P())",
            "<= 1.10x",
            lambda r: r <= 1.10,
        ),
        row(
            what,
            "jaxdev.replicate",
            flax_name,
            t,
            "jaxdev.replicate",
            flax_name,
            ">= 2x faster",
            lambda r: r <= 0.5,
        ),
    ]


def bench_shard_batch(mesh, repeats: int) -> list[dict]:
    rng = np.random.default_rng(1)
    batch = (
        rng.normal(size=(1024, 784)).astype(np.float32),
        rng.integers(0, 10, size=(1024,)).astype(np.int32),
    )
    data = NamedSharding(mesh, P("data"))
    t = time_side_by_side(
        {
            "jaxdev.shard_batch": lambda: jaxdev.shard_batch(batch, mesh),
            "jax.device_put": lambda: jax.device_put(batch, data),
        },
        repeats,
    )
    return [
        row(
            "shard_batch 1024x784 f32 + labels",
            "jaxdev.shard_batch",
            "jax.device_put(batch, NamedSharding(mesh, P('data')))",
            t,
            "jaxdev.shard_batch",
            "jax.device_put",
            "<= 1.10x",
            lambda r: r <= 1.10,
        ),
    ]


def bench_prefetch(mesh, repeats: int, steps: int = 16) -> list[dict]:
    data = NamedSharding(mesh, P("data"))
    w = jaxdev.replicate(jnp.full((784, 784), 0.01, jnp.float32), mesh)

    @jax.jit
    def step(w, x):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return w + 1e-6 * (x.T @ x)

    def loader():
        rng = np.random.default_rng(2)
        for _ in range(steps):
            x = rng.normal(size=(512, 784)).astype(np.float32)  # real host work per batch
            yield np.clip(x * 0.5 + np.sin(x), -2, 2)

    def plain():
        v = w
        for x in loader():
            v = step(v, jax.device_put(x, data))
        return v

    def prefetched():
        v = w
        with jaxdev.prefetch_to_device(loader(), 2, jaxdev.batch_sharding(mesh)) as it:
            for x in it:
                v = step(v, x)
        return v

    t = time_side_by_side({"prefetch": prefetched, "plain": plain}, max(3, repeats // 4))
    return [
        row(
            f"loop of {steps} steps, loader with host work",
            "jaxdev.prefetch_to_device(size=2)",
            "jax.device_put in the loop",
            t,
            "prefetch",
            "plain",
            "report (CPU: ~1x)",
            lambda r: None,
        ),
    ]


def row(what, ours, theirs, t, a, b, target, ok) -> dict:
    """One table row; the ratio is the median of per-repetition ratios."""
    ratio = t.ratio(a, b)
    return {
        "benchmark": what,
        "jaxdev": ours,
        "baseline": theirs,
        "jaxdev_ms": t.median(a) * 1e3,
        "baseline_ms": t.median(b) * 1e3,
        "ratio": ratio,
        "target": target,
        "met": ok(ratio),
    }


def markdown(rows: list[dict]) -> str:
    head = "| benchmark | jaxdev | baseline | jaxdev ms | baseline ms | ratio | target | met |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(
            f"| {r['benchmark']} | `{r['jaxdev']}` | `{r['baseline']}` | {r['jaxdev_ms']:.2f} "
            f"| {r['baseline_ms']:.2f} | {r['ratio']:.2f}x | {r['target']} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    mesh = jaxdev.data_mesh()
    rows = bench_replicate(mesh, args.repeats)
    rows += bench_shard_batch(mesh, args.repeats)
    rows += bench_prefetch(mesh, args.repeats)
    print(
        f"jax {jax.__version__}, {len(jax.devices())} {jax.default_backend()} devices, "
        f"{os.cpu_count()} host cores; ratio = median over interleaved repetitions of "
        "jaxdev time / baseline time"
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"jax": jax.__version__, "devices": len(jax.devices()), "rows": rows}, f, indent=2
            )
    return rows


if __name__ == "__main__":
    main()
