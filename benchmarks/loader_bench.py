"""What placing exactly the data of call time costs (issue 11), on 8 fake CPU devices.

Run: ``python benchmarks/loader_bench.py [--repeats N] [--baseline REF] [--json PATH]``.

A loader may refill one host buffer for every batch, so the batch-taking
functions copy host arrays that can still change (``jaxdev._batches.detach_host``)
before JAX places them. This compares, timed side by side in one run
(interleaved repetitions, medians of per-repetition ratios; see ``_timing.py``):

* ``raw device_put``: ``jax.device_put(x, sharding)``, the floor, and unsafe
  with a refilled buffer (JAX uses an aligned buffer in place, and copies an
  unaligned one in the background);
* ``copy + device_put``: a plain ``np.array(x)`` copy first (JAX then copies
  the unaligned copy once more);
* ``aligned copy + device_put``: ``detach_host`` alone (a 64-byte aligned copy
  JAX uses in place: one host copy in all);
* ``shard_batch`` / ``shard_for_pmap`` / ``to_device(detach_host)``: jaxdev's
  calls as shipped;
* with ``--baseline REF``, the same calls with the batch modules of git
  revision ``REF`` (e.g. ``c62a1ba``, the commit before the fix), imported
  side by side.

Each case is run on the two kinds of loader buffer: numpy's own allocation
(16 bytes past a 64-byte boundary for large arrays: JAX copies it) and a
page-aligned buffer (JAX uses it in place, so the raw put copies nothing).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import time_side_by_side  # noqa: E402

from jaxdev._batches import detach_host  # noqa: E402

jax.config.update("jax_platforms", "cpu")

SHAPES = {"mnist 128x784": (128, 784), "cifar 1024x3x32x32": (1024, 3, 32, 32)}


def numpy_buffer(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 buffer as numpy allocates it."""
    return np.random.default_rng(0).random(shape, dtype=np.float32)


def page_aligned_buffer(shape: tuple[int, ...]) -> np.ndarray:
    """The same values in a buffer starting on a 4096-byte boundary."""
    src = numpy_buffer(shape)
    raw = np.empty(src.nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    out = raw[start : start + src.nbytes].view(np.float32).reshape(shape)
    out[...] = src
    return out


BUFFERS = {"numpy buffer": numpy_buffer, "page-aligned buffer": page_aligned_buffer}


BASELINE_MODULES = ("_batches", "_pmap_layout", "_prefetch")
BASELINE_CALLS = ("shard_batch", "shard_for_pmap")


def load_baseline(ref: str):
    """This jaxdev with the batch modules of git revision ``ref``, imported as ``jaxdev_base``.

    Only ``BASELINE_MODULES`` come from ``ref`` (the rest of the package is
    the working tree's), so the two differ exactly in how batches are placed.
    """
    root = tempfile.mkdtemp(prefix="jaxdev_base_")
    repo = os.path.dirname(HERE)
    pkg = os.path.join(root, "jaxdev_base")
    shutil.copytree(os.path.join(repo, "jaxdev"), pkg)
    for name in BASELINE_MODULES:
        source = subprocess.run(
            ["git", "-C", repo, "show", f"{ref}:jaxdev/{name}.py"],
            check=True,
            capture_output=True,
        ).stdout
        with open(os.path.join(pkg, f"{name}.py"), "wb") as f:
            f.write(source)
    sys.path.insert(0, root)
    return importlib.import_module("jaxdev_base")


def bench_case(what: str, fns: dict, floor: str, repeats: int, pairs=()) -> dict:
    """Time ``fns`` side by side; print each against ``floor`` and each (new, old) pair."""
    t = time_side_by_side(fns, repeats)
    row = {
        "case": what,
        "median_us": {k: round(t.median(k) * 1e6, 1) for k in fns},
        f"ratio_vs_{floor}": {k: round(t.ratio(k, floor), 2) for k in fns if k != floor},
        "ratio_new_vs_old": {f"{a} / {b}": round(t.ratio(a, b), 2) for a, b in pairs},
    }
    print(f"\n{what}")
    for k in fns:
        ratio = "" if k == floor else f"  x{t.ratio(k, floor):.2f} vs {floor}"
        print(f"  {k:34s} {t.median(k) * 1e6:9.1f} us{ratio}")
    for a, b in pairs:
        print(f"  after / before: {a} x{t.ratio(a, b):.2f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--baseline", metavar="REF", help="git revision to compare with")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    base = load_baseline(args.baseline) if args.baseline else None
    mesh = jaxdev.data_mesh()
    sharding = jaxdev.batch_sharding(mesh)
    cpu0 = jax.devices()[0]
    rows = []
    print(f"jax {jax.__version__}, {len(jax.devices())} fake CPU devices, float32 batches")
    for shape_name, shape in SHAPES.items():
        for buf_name, make in BUFFERS.items():
            x = make(shape)
            floor = "raw device_put"
            fns = {
                floor: lambda x=x: jax.device_put(x, sharding),
                "copy + device_put": lambda x=x: jax.device_put(np.array(x), sharding),
                "aligned copy + device_put": lambda x=x: jax.device_put(detach_host(x), sharding),
                "jaxdev.shard_batch": lambda x=x: jaxdev.shard_batch(x, mesh),
                "jaxdev.pmap.shard_for_pmap": lambda x=x: jaxdev.pmap.shard_for_pmap(x),
            }
            pairs = []
            if base is not None:
                fns[f"{args.baseline}: shard_batch"] = lambda x=x: base.shard_batch(x, mesh)
                fns[f"{args.baseline}: shard_for_pmap"] = lambda x=x: base.shard_for_pmap(x)
                pairs = [(f"jaxdev.{f}", f"{args.baseline}: {f}") for f in BASELINE_CALLS]
            what = f"split over 8 devices, {shape_name}, {buf_name}"
            rows.append(bench_case(what, fns, floor, args.repeats, pairs))
            fns = {
                floor: lambda x=x: jax.device_put(x, cpu0),
                "jaxdev.to_device(detach_host)": lambda x=x: jaxdev.to_device(detach_host(x), cpu0),
            }
            what = f"one device (put_batch, single), {shape_name}, {buf_name}"
            rows.append(bench_case(what, fns, floor, args.repeats))
    frozen = numpy_buffer(SHAPES["cifar 1024x3x32x32"])
    frozen.flags.writeable = False
    fns = {
        "raw device_put": lambda: jax.device_put(frozen, sharding),
        "jaxdev.shard_batch": lambda: jaxdev.shard_batch(frozen, mesh),
    }
    rows.append(bench_case("read-only numpy (no copy needed), cifar", fns, "raw device_put", 30))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
