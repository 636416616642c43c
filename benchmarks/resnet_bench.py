"""Benchmarks of jaxdev's step on flax's imagenet ResNet pattern (tiny ResNet, 8 devices).

Run: ``python benchmarks/resnet_bench.py [--repeats N] [--steps N] [--json PATH]``.

The model is ``TinyResNet`` of ``examples/flax_imagenet_step.py`` (flax's
block structure, BatchNorm with ``batch_stats``, weight penalty, lr schedule,
SGD with Nesterov momentum) on synthetic 32x32x3 images. Three comparisons,
each timed side by side in this one run (warm-up, interleaved repetitions,
medians of per-repetition ratios; see ``_timing.py``):

(i) ``Strategy.pmap`` against flax's hand-written pmap ``train_step``
    (flax's ``examples/imagenet/train.py``: ``lax.pmean`` of the gradients,
    BatchNorm over ``axis_name='batch'``, metrics ``pmean`` ed);
(ii) ``Strategy.sharded`` against a hand-written ``jax.jit`` with
    ``NamedSharding`` (state replicated, batch split, ``batch_stats`` as a
    mutable collection, the same math);
(iii) ``accumulate=4`` on a batch of B rows against 4 steps on B/4 rows
    (the same rows and forward/backward work, 1 update instead of 4).

Before timing, (i) and (ii) check that jaxdev and the hand-written step give
the same params after 3 steps (``atol=rtol=1e-4``). Batches are placed on the
devices before timing. The hand-written steps donate their state as jaxdev's
do, and wait on every 8th step like jaxdev's ``TrainStep`` on CPU meshes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import report, time_side_by_side  # noqa: E402
from flax import jax_utils  # noqa: E402
from flax.training import common_utils, train_state  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_platforms", "cpu")

_spec = importlib.util.spec_from_file_location(
    "flax_imagenet_step", os.path.join(HERE, "..", "examples", "flax_imagenet_step.py")
)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

BATCH, ACCUMULATE = 64, 4
INFLIGHT = 8  # hand-written multi-device loops wait every 8 steps, like jaxdev's TrainStep
TOL = dict(atol=1e-4, rtol=1e-4)


class FlaxState(train_state.TrainState):
    batch_stats: Any


def tx() -> optax.GradientTransformation:
    return optax.sgd(ex.learning_rate_fn, momentum=0.9, nesterov=True)


def init_variables() -> dict:
    return ex.TinyResNet().init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)


def host_batches(n: int, rows: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    data = ex.make_data(n * rows, seed)
    return [{k: v[i * rows : (i + 1) * rows] for k, v in data.items()} for i in range(n)]


# ---------------------------------------------------------------- hand-written steps


def flax_train_step(state, batch, axis_name=None):
    """flax/examples/imagenet/train.py's train_step (dynamic scale off).

    With ``axis_name`` (pmap) gradients and metrics are ``pmean`` ed; without
    it (sharded jit) the step sees the whole batch and XLA partitions it.
    """

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        one_hot = common_utils.onehot(batch["label"], num_classes=ex.NUM_CLASSES)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        loss = loss + ex.weight_penalty(params)
        return loss, (new_model_state, logits)

    lr = ex.learning_rate_fn(state.step)
    (loss, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params
    )
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
    if axis_name is not None:
        grads = lax.pmean(grads, axis_name=axis_name)
        metrics = lax.pmean(metrics, axis_name=axis_name)
    metrics["learning_rate"] = lr
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def flax_state(axis_name: str | None) -> FlaxState:
    variables = init_variables()
    return FlaxState.create(
        apply_fn=ex.TinyResNet(axis_name=axis_name).apply,
        params=variables["params"],
        tx=tx(),
        batch_stats=variables["batch_stats"],
    )


class Loop:
    """A training loop whose state persists across timed repetitions (donation-safe)."""

    def __init__(self, state, run):
        self.state, self._run = state, run

    def __call__(self):
        self.state, out = self._run(self.state)
        return out


def hand_loop(step_fn, state, batches, wait: bool = True) -> Loop:
    def run(s):
        for i, b in enumerate(batches):
            s, metrics = step_fn(s, b)
            if wait and i % INFLIGHT == INFLIGHT - 1:  # XLA:CPU deadlocks on deep queues
                jax.block_until_ready(metrics)
        return s, (s.params, metrics)

    return Loop(state, run)


def jaxdev_step(strategy: jaxdev.Strategy, accumulate: int = 1) -> jaxdev.TrainStep:
    return jaxdev.make_train_step(
        ex.make_loss(ex.TinyResNet(axis_name=strategy.collective_axis)),
        tx(),
        strategy,
        has_aux=True,
        has_state=True,
        regularizer=ex.weight_penalty,
        lr_fn=ex.learning_rate_fn,
        accumulate=accumulate,
    )


def jaxdev_state(step: jaxdev.TrainStep):
    variables = init_variables()
    return step.init_state(
        variables["params"], tx(), model_state={"batch_stats": variables["batch_stats"]}
    )


def jaxdev_loop(step: jaxdev.TrainStep, batches) -> Loop:
    def run(state):
        metrics = None
        for b in batches:
            state, metrics = step(state, b, metrics)
        metrics.fetch()  # one device_get per loop, like a log every N steps
        return state, state.params

    return Loop(jaxdev_state(step), run)


# ---------------------------------------------------------------- the comparisons


def check_same(name: str, a, b) -> None:
    def close(x, y):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL, err_msg=name)

    jax.tree.map(close, a, b)


def pmap_loops(host: list[dict]) -> dict[str, Loop]:
    """(i) jaxdev ``Strategy.pmap`` vs flax's pmap train_step, BatchNorm over the devices."""
    p_train_step = jax.pmap(
        functools.partial(flax_train_step, axis_name="batch"),
        axis_name="batch",
        donate_argnums=(0,),
    )
    step = jaxdev_step(jaxdev.Strategy.pmap())
    batches = [step.put_batch(b) for b in host]  # (devices, rows / devices, ...), as flax shards
    hand = hand_loop(p_train_step, jax_utils.replicate(flax_state("batch")), batches)
    ours = jaxdev_loop(step, batches)
    for _ in range(3 // len(batches) + 1):
        hand(), ours()
    check_same("pmap", jax_utils.unreplicate(hand.state.params), ours.state.params)
    n = step.strategy.n_devices
    # as flax's example writes the loop: no wait at all (safe for --steps <= ~50 on CPU)
    bare = hand_loop(p_train_step, jax_utils.replicate(flax_state("batch")), batches, wait=False)
    return {
        f"hand flax pmap train_step ({n} dev)": hand,
        f"jaxdev Strategy.pmap ({n} dev)": ours,
        f"hand flax pmap train_step, no waits ({n} dev)": bare,
    }


def sharded_loops(host: list[dict]) -> dict[str, Loop]:
    """(ii) jaxdev ``Strategy.sharded`` vs hand-written jit + NamedSharding."""
    strategy = jaxdev.Strategy.sharded()
    rep, data = NamedSharding(strategy.mesh, P()), NamedSharding(strategy.mesh, P(strategy.axis))
    j_train_step = jax.jit(
        flax_train_step, in_shardings=(rep, data), out_shardings=(rep, rep), donate_argnums=(0,)
    )
    step = jaxdev_step(strategy)
    batches = [step.put_batch(b) for b in host]  # NamedSharding(mesh, P('data')) rows
    hand = hand_loop(j_train_step, jaxdev.copy_to(flax_state(None), rep), batches)
    ours = jaxdev_loop(step, batches)
    for _ in range(3 // len(batches) + 1):
        hand(), ours()
    check_same("sharded", hand.state.params, ours.state.params)
    n = strategy.n_devices
    return {f"hand jit+NamedSharding ({n} dev)": hand, f"jaxdev Strategy.sharded ({n} dev)": ours}


def accumulate_loops(host: list[dict]) -> dict[str, Loop]:
    """(iii) one ``accumulate=4`` update on B rows vs 4 updates on B/4 rows (sharded)."""
    strategy = jaxdev.Strategy.sharded()
    acc = jaxdev_step(strategy, accumulate=ACCUMULATE)
    small = jaxdev_step(strategy)
    big = [acc.put_batch(b) for b in host]
    quarter = BATCH // ACCUMULATE
    pieces = [
        small.put_batch({k: v[j * quarter : (j + 1) * quarter] for k, v in b.items()})
        for b in host
        for j in range(ACCUMULATE)
    ]
    whole = [small.put_batch(b) for b in host]
    return {
        f"accumulate={ACCUMULATE}, batch {BATCH}": jaxdev_loop(acc, big),
        f"{ACCUMULATE} steps of batch {quarter}": jaxdev_loop(small, pieces),
        f"1 step of batch {BATCH} (no accumulation)": jaxdev_loop(small, whole),
    }


def _row(what, name, t, base, steps, target="report", ok=None) -> dict:
    return {
        "what": what,
        "variant": name,
        "median_ms_per_step": round(t.median(name) * 1e3 / steps, 2),
        "ratio_vs": base,
        "ratio": round(t.ratio(name, base), 3),
        "target": target,
        "met": "" if ok is None else ("yes" if ok(t.ratio(name, base)) else "NO"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed repetition")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    host = host_batches(args.steps, BATCH)
    model = f"tiny ResNet [1, 1] x 8 filters, 32x32x3, batch {BATCH}, {jax.device_count()} dev"
    rows = []
    within = ("<= 1.05", lambda r: r <= 1.05)  # issue 19 (was 1.10)

    loops = pmap_loops(host)
    t = time_side_by_side(loops, args.repeats, warmup=1)
    hand, ours, bare = list(loops)
    what = f"(i) {model}, pmap, BatchNorm synced"
    rows.append(_row(what, hand, t, hand, args.steps))
    rows.append(_row(what, ours, t, hand, args.steps, *within))
    rows.append(_row(what, ours, t, bare, args.steps, *within))

    loops = sharded_loops(host)
    t = time_side_by_side(loops, args.repeats, warmup=1)
    hand, ours = list(loops)
    what = f"(ii) {model}, sharded jit"
    rows.append(_row(what, hand, t, hand, args.steps))
    rows.append(_row(what, ours, t, hand, args.steps, *within))

    loops = accumulate_loops(host)
    t = time_side_by_side(loops, args.repeats, warmup=1)
    acc, split, whole = list(loops)
    what = f"(iii) {model}, sharded jit, per update of {BATCH} rows"
    rows.append(_row(what, split, t, split, args.steps))
    rows.append(_row(what, acc, t, split, args.steps))
    rows.append(_row(what, whole, t, split, args.steps))

    print(f"{args.steps} steps per repetition, {args.repeats} repetitions, ms per step")
    report(rows, ("median_ms_per_step", "median ms/step"), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
