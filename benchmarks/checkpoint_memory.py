"""Memory growth per checkpoint cycle: jaxdev vs orbax used directly (issue 17).

Run: ``python benchmarks/checkpoint_memory.py [--cycles 150]``.

A cycle is one ``save(..., overwrite=True)`` and one ``restore`` of a 0.26 MB
tree replicated over 8 fake CPU devices (jaxdev), or one ``save(force=True)``
and one ``restore`` through orbax's ``PyTreeCheckpointHandler`` (orbax). Blocks
of cycles alternate (jaxdev, orbax, jaxdev, orbax); the resident set size
after ``gc.collect()`` is compared before and after each block. Then
``tracemalloc`` lists where the Python allocations that outlive a jaxdev
cycle were made, to tell jaxdev's references from orbax's.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import tracemalloc

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=150)
    cycles = parser.parse_args().cycles
    mesh = jaxdev.data_mesh()
    state = jaxdev.replicate({"w": jnp.ones((256, 256)), "b": jnp.zeros(256), "n": 3}, mesh)
    arrays = {k: v for k, v in state.items() if k != "n"}
    root = tempfile.mkdtemp()
    handler = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), arrays
    )
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)

    def with_jaxdev() -> None:
        path = os.path.join(root, "j")
        jaxdev.save(path, state, overwrite=True)
        jaxdev.restore(path, state)

    def with_orbax() -> None:
        path = os.path.join(root, "o")
        handler.save(path, args=ocp.args.PyTreeSave(arrays), force=True)
        handler.restore(path, args=ocp.args.PyTreeRestore(abstract, restore_args=restore_args))

    for fn in (with_jaxdev, with_orbax):  # warm-up: compiles, orbax's first-use costs
        for _ in range(30):
            fn()
    print(f"KB of RSS growth per cycle ({cycles} cycles a block):")
    for name, fn in (("jaxdev", with_jaxdev), ("orbax", with_orbax)) * 2:
        gc.collect()
        before = rss()
        for _ in range(cycles):
            fn()
        gc.collect()
        print(f"  {name:7s} {(rss() - before) / cycles / 1024:6.1f}")
    tracemalloc.start(12)
    for _ in range(20):
        with_jaxdev()
    gc.collect()
    first = tracemalloc.take_snapshot()
    for _ in range(100):
        with_jaxdev()
    gc.collect()
    grown = tracemalloc.take_snapshot().compare_to(first, "traceback")
    print("Python allocations that outlive a jaxdev cycle, largest first (bytes per cycle):")
    for stat in grown[:6]:
        frames = [f for f in stat.traceback if "orbax" in f.filename or "jaxdev" in f.filename]
        where = frames[-1] if frames else stat.traceback[-1]
        owner = "jaxdev" if "/jaxdev/" in where.filename else "other"
        if "orbax" in where.filename:
            owner = "orbax"
        print(f"  {stat.size_diff / 100:7.0f}  {owner:6s} {where.filename}:{where.lineno}")


if __name__ == "__main__":
    main()
