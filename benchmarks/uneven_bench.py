"""The uneven-batch step, mask replicated (now) vs mask split like the rows (before 9f01686).

Run: ``python benchmarks/uneven_bench.py [--repeats N]`` (8 fake CPU devices). The loops
of ``train_bench.py``'s data-parallel rows (global batch 256, 100 steps, metrics on
device), timed side by side in this one run: the hand-written ``jax.jit`` step on even
batches, jaxdev's step on the same even batches, and jaxdev's step on batches 6 rows
short (padded + masked by ``put_batch``) with the mask replicated (``Strategy.mask_spec``
of a jit step) and, as it was, split like the rows. Each compiled program's all-reduce
count is printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import train_bench as tb  # sets up 8 fake CPU devices
from _timing import time_side_by_side

import jaxdev


def _rows_mask(strategy):
    """``strategy`` with the mask laid out like the rows (jaxdev before 9f01686)."""
    cls = type(strategy)
    old = type("RowsMask", (cls,), {"mask_spec": lambda self, k=1, m=1: self.batch_spec(k, m)})
    return old(**{f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    x, y = tb.host_batches(tb.STEPS // 2, 256, seed=1)
    loops = tb.data_parallel_loops(x, y)
    names = list(loops)
    hand, even, uneven = names[2], names[3], names[4]
    old = _rows_mask(jaxdev.Strategy.sharded(jaxdev.data_mesh()))
    step = jaxdev.make_train_step(tb.per_example_loss, tb.TX, old)
    batches = [step.put_batch({"x": a[:-6], "y": b[:-6]}) for a, b in zip(x, y)]

    loops = {
        hand: loops[hand],
        even: loops[even],
        uneven: loops[uneven],
        "uneven, mask split like the rows (before)": tb.Loop(
            step.init_state(tb.init_params(), tb.TX), tb._k_loop(step, batches)
        ),
    }
    state = step.init_state(tb.init_params(), tb.TX)
    text = step.lower(state, batches[0]).compile().as_text()
    print(
        "all-reduces, mask split like the rows:",
        len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
    )
    t = time_side_by_side(loops, args.repeats, warmup=1)
    for name in loops:
        print(f"| {name} | {t.median(name) * 1e3:.1f} ms | {t.ratio(name, hand):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
