"""The uneven-batch step, mask replicated (now) vs mask split like the rows (before 9f01686).

Run: ``python benchmarks/uneven_bench.py [--repeats N]`` (8 fake CPU devices). The loops
of ``train_bench.py``'s data-parallel rows (global batch 256, 100 steps, metrics on
device), timed side by side in this one run: the hand-written ``jax.jit`` step on even
batches, jaxdev's step on the same even batches, and jaxdev's step on batches 6 rows
short (padded + masked by ``put_batch``) with the mask replicated (``Strategy.mask_spec``
of a jit step) and, as it was, split like the rows. Each compiled program's all-reduce
count is printed too. The client loop (issue 35) places each short batch inside the loop:
``put_batch`` + step + one ``fetch`` at the end, against numpy padding, a mask,
``jax.device_put`` and a hand-written masked ``jax.jit`` step (its own ratio column).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import train_bench as tb  # sets up 8 fake CPU devices
from _timing import time_side_by_side
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev


def _rows_mask(strategy):
    """``strategy`` with the mask laid out like the rows (jaxdev before 9f01686)."""
    cls = type(strategy)
    old = type("RowsMask", (cls,), {"mask_spec": lambda self, k=1, m=1: self.batch_spec(k, m)})
    return old(**{f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)})


def _hand_masked_step(params, opt, batch):
    """The hand-written step on a padded batch: the mean loss of the rows under ``mask``."""

    def obj(p):
        per = tb.per_example_loss(p, batch)
        return jnp.sum(jnp.where(batch["mask"], per, 0.0)) / jnp.maximum(batch["mask"].sum(), 1)

    loss, grads = jax.value_and_grad(obj)(params)
    updates, opt = tb.TX.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss


def client_loops(x, y, short: int = 6) -> dict:
    """Placing each batch inside the loop: ``put_batch`` + step + metrics fetched at the end,
    against numpy padding + a mask + ``jax.device_put`` + the hand-written masked step."""
    mesh = jaxdev.data_mesh()
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rows = x.shape[1]
    layout = {"x": data, "y": data, "mask": rep}
    hstep = jax.jit(_hand_masked_step, in_shardings=(rep, rep, layout), donate_argnums=(0, 1))
    mask = np.arange(rows) < rows - short

    def run_hand(s):
        p, o = s
        for i, (a, b) in enumerate(zip(x, y)):
            a, b = a[:-short], b[:-short]  # the loader's short batch, padded by hand
            a, b = (np.concatenate([v, np.repeat(v[-1:], short, 0)]) for v in (a, b))
            p, o, loss = hstep(p, o, jax.device_put({"x": a, "y": b, "mask": mask}, layout))
            if i % tb.INFLIGHT == tb.INFLIGHT - 1:  # as the other hand-written loops
                loss.block_until_ready()
        jax.device_get(loss)
        return (p, o), p

    step = jaxdev.make_train_step(tb.per_example_loss, tb.TX, jaxdev.Strategy.sharded(mesh))

    def run_jaxdev(state):
        metrics = None
        for a, b in zip(x, y):
            batch = step.put_batch({"x": a[:-short], "y": b[:-short]})
            state, metrics = step(state, batch, metrics)
        metrics.fetch()
        return state, state.params

    params = tb.init_params()
    return {
        "client loop, hand: pad + mask + device_put + jit": tb.Loop(
            jaxdev.copy_to((params, tb.TX.init(params)), rep), run_hand
        ),
        "client loop, jaxdev: put_batch + step + fetch": tb.Loop(
            step.init_state(params, tb.TX), run_jaxdev
        ),
    }


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
    client = client_loops(x, y)
    t = time_side_by_side(loops | client, args.repeats, warmup=1)
    base = {name: hand for name in loops} | {name: next(iter(client)) for name in client}
    for name, ref in base.items():
        print(f"| {name} | {t.median(name) * 1e3:.1f} ms | {t.ratio(name, ref):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
