"""Benchmarks of jaxdev's train step and on-device metrics (issue 4).

Run: ``python benchmarks/train_bench.py [--repeats N] [--json PATH]``.

Every ratio compares two ways of doing the same work, timed side by side in
this one run (interleaved repetitions, medians of per-repetition ratios; see
``_timing.py``). Batches are placed on the devices before timing, so the
figures are about dispatch, compute and host syncs, not host data loading.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import report, time_side_by_side  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_platforms", "cpu")

STEPS, BATCH, K = 200, 128, 50
INFLIGHT = 8  # hand-written multi-device loops wait every 8 steps, like jaxdev's TrainStep
TX = optax.adam(1e-3)


def init_params(seed: int = 0) -> dict:
    """A 784-128-10 MLP's parameters (Flax Dense naming)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "Dense_0": {"kernel": jax.random.normal(k1, (784, 128)) * 0.05, "bias": jnp.zeros(128)},
        "Dense_1": {"kernel": jax.random.normal(k2, (128, 10)) * 0.05, "bias": jnp.zeros(10)},
    }


def per_example_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    logits = h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def host_batches(steps: int, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=(steps, batch)).astype(np.int32)
    return x, y


def _hand_step(axis_name=None):
    """The hand-written step: mean loss, grad, (pmean), adam; returns the loss."""

    def step(params, opt, batch):
        def obj(p):
            return per_example_loss(p, batch).mean()

        loss, grads = jax.value_and_grad(obj)(params)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
            loss = jax.lax.pmean(loss, axis_name)
        updates, opt = TX.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    return step


class Loop:
    """A training loop whose state persists across timed repetitions (donation-safe)."""

    def __init__(self, state, run):
        self.state, self._run = state, run

    def __call__(self):
        self.state, out = self._run(self.state)
        return out


def single_device_loops(x, y) -> dict[str, Loop]:
    dev = jaxdev.d2l.cpu(0)
    batches = [jaxdev.to_device({"x": a, "y": b}, dev) for a, b in zip(x, y)]
    params = jaxdev.to_device(init_params(), dev)

    hand = jax.jit(_hand_step(), donate_argnums=(0, 1))

    def run_hand(s):
        p, o = s
        for b in batches:
            p, o, _ = hand(p, o, b)
        return (p, o), p

    def run_float(s):
        p, o = s
        losses = []
        for b in batches:
            p, o, loss = hand(p, o, b)
            losses.append(float(loss))  # the host sync per step d2l warns about
        return (p, o), p

    step = jaxdev.make_train_step(per_example_loss, TX, jaxdev.Strategy.single(dev))

    def run_jaxdev(state):
        metrics = None
        for b in batches:
            state, metrics = step(state, b, metrics)
        metrics.fetch()  # one device_get per loop, like a log every 200 steps
        return state, state.params

    stepk = jaxdev.make_train_step(
        per_example_loss, TX, jaxdev.Strategy.single(dev), steps_per_call=K
    )
    stacked = [stepk.put_batch({"x": x[i : i + K], "y": y[i : i + K]}) for i in range(0, len(x), K)]

    run_k = _k_loop(stepk, stacked)

    return {
        "hand jit, no metrics": Loop(jaxdev.copy_to((params, TX.init(params)), dev), run_hand),
        "hand jit + float(loss) per step": Loop(
            jaxdev.copy_to((params, TX.init(params)), dev), run_float
        ),
        "jaxdev step, metrics on device": Loop(step.init_state(params, TX), run_jaxdev),
        f"jaxdev step, steps_per_call={K}": Loop(stepk.init_state(params, TX), run_k),
    }


def _k_loop(step, batches):
    def run(state):
        metrics = None
        for b in batches:
            state, metrics = step(state, b, metrics)
        metrics.fetch()
        return state, state.params

    return run


def k_steps_loops(x, y) -> dict[str, Loop]:
    """1 step per dispatch vs K per dispatch, on a batch small enough to be dispatch-bound."""
    dev = jaxdev.d2l.cpu(0)
    params = init_params()
    step = jaxdev.make_train_step(per_example_loss, TX, jaxdev.Strategy.single(dev))
    stepk = jaxdev.make_train_step(
        per_example_loss, TX, jaxdev.Strategy.single(dev), steps_per_call=K
    )
    batches = [step.put_batch({"x": a, "y": b}) for a, b in zip(x, y)]
    stacked = [stepk.put_batch({"x": x[i : i + K], "y": y[i : i + K]}) for i in range(0, len(x), K)]
    return {
        "1 step per dispatch": Loop(step.init_state(params, TX), _k_loop(step, batches)),
        f"steps_per_call={K}": Loop(stepk.init_state(params, TX), _k_loop(stepk, stacked)),
        "1 step per dispatch, donation check off": Loop(
            step.init_state(params, TX), _unchecked(_k_loop(step, batches))
        ),
    }


def _unchecked(run):
    """``run`` with the step's per-call donation check (deleted/shared leaves) switched off."""
    import jaxdev.train._step as step_module

    def go(state):
        check, step_module.check_donatable = step_module.check_donatable, lambda *a: None
        try:
            return run(state)
        finally:
            step_module.check_donatable = check

    return go


def data_parallel_loops(x, y) -> dict[str, Loop]:
    devices = jax.devices()
    n = len(devices)
    mesh = jaxdev.data_mesh()
    params = init_params()

    # Hand-written jax.pmap, classic stacked params.
    pstep = jax.pmap(_hand_step("i"), axis_name="i", donate_argnums=(0, 1))
    stacked_batches = [jaxdev.pmap.shard_for_pmap({"x": a, "y": b}) for a, b in zip(x, y)]

    def run_pmap(s):
        p, o = s
        for i, b in enumerate(stacked_batches):
            p, o, loss = pstep(p, o, b)
            if i % INFLIGHT == INFLIGHT - 1:  # XLA:CPU deadlocks on deep collective queues
                loss.block_until_ready()
        return (p, o), p

    # Hand-written jit + NamedSharding.
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    jstep = jax.jit(
        _hand_step(),
        in_shardings=(rep, rep, data),
        out_shardings=(rep, rep, rep),
        donate_argnums=(0, 1),
    )
    sharded_batches = [jaxdev.shard_batch({"x": a, "y": b}, mesh) for a, b in zip(x, y)]

    def run_jit(s):
        p, o = s
        for i, b in enumerate(sharded_batches):
            p, o, loss = jstep(p, o, b)
            if i % INFLIGHT == INFLIGHT - 1:  # as jaxdev's TrainStep does on CPU meshes
                loss.block_until_ready()
        return (p, o), p

    def jaxdev_loop(strategy, batches):
        step = jaxdev.make_train_step(per_example_loss, TX, strategy)

        def run(state):
            metrics = None
            for b in batches:
                state, metrics = step(state, b, metrics)
            metrics.fetch()
            return state, state.params

        return Loop(step.init_state(params, TX), run)

    # The last batch of an epoch: 6 rows short of the device multiple, padded and masked
    sharded = jaxdev.Strategy.sharded(mesh)
    uneven_step = jaxdev.make_train_step(per_example_loss, TX, sharded)
    uneven = [uneven_step.put_batch({"x": a[:-6], "y": b[:-6]}) for a, b in zip(x, y)]

    stacked_params = jaxdev.pmap.stack_for_pmap(params)
    return {
        f"hand jax.pmap ({n} dev)": Loop(
            (stacked_params, jax.pmap(TX.init)(stacked_params)), run_pmap
        ),
        f"jaxdev pmap ({n} dev)": jaxdev_loop(jaxdev.Strategy.pmap(), stacked_batches),
        f"hand jit+NamedSharding ({n} dev)": Loop(
            jaxdev.copy_to((params, TX.init(params)), rep),
            run_jit,  # fresh buffers to donate
        ),
        f"jaxdev sharded ({n} dev)": jaxdev_loop(jaxdev.Strategy.sharded(mesh), sharded_batches),
        f"jaxdev sharded ({n} dev), uneven batch (6 rows short, padded + masked)": jaxdev_loop(
            sharded, uneven
        ),
    }


def _norm_step(x, w):
    """One step of the chain: ``y = x @ w``, its Frobenius norm, ``y`` rescaled.

    Each step depends on the previous one, so XLA cannot hoist the matmul out
    of the scanned loop (1000 copies of ``a @ b`` with fixed operands would be
    computed once, and the scan would look ~250x faster than it is).
    """
    y = x @ w
    norm = jnp.linalg.norm(y)
    return y / norm, norm


def d2l_exercise_3(steps: int = 1000) -> dict[str, Loop]:
    """1000 chained 100x100 matmuls, Frobenius norm logged each step: host vs device log."""
    dev = jaxdev.d2l.cpu(0)
    x0 = jaxdev.to_device(jax.random.normal(jax.random.key(0), (100, 100)) / 10, dev)
    w = jaxdev.to_device(jax.random.normal(jax.random.key(1), (100, 100)) / 10, dev)
    step = jax.jit(_norm_step)

    @jax.jit
    def step_log(x, w, log):
        x, norm = _norm_step(x, w)
        return x, log.record(norm)

    @jax.jit
    def scanned(x, w, log):
        def body(carry, _):
            x, log = carry
            x, norm = _norm_step(x, w)
            return (x, log.record(norm)), None

        return jax.lax.scan(body, (x, log), None, length=steps)[0][1]

    def no_log(_):
        x = x0
        for _ in range(steps):
            x, _norm = step(x, w)  # the norm is computed but never read
        return None, x.block_until_ready()

    def host_log(_):
        x, norms = x0, []
        for _ in range(steps):
            x, norm = step(x, w)
            norms.append(float(norm))  # one device->host transfer per step
        return None, norms[-1]

    def device_log(_):
        x, log = x0, jaxdev.metrics.DeviceLog.create(steps)
        for _ in range(steps):
            x, log = step_log(x, w, log)
        return None, log.fetch()  # one transfer at the end

    def device_scan(_):
        return None, scanned(x0, w, jaxdev.metrics.DeviceLog.create(steps)).fetch()

    np.testing.assert_allclose(host_log(None)[1], device_log(None)[1][-1], rtol=1e-4)
    np.testing.assert_allclose(device_log(None)[1], device_scan(None)[1], rtol=1e-4)
    return {
        "ex3: float(norm) per step": Loop(None, host_log),
        "ex3: DeviceLog, 1 transfer": Loop(None, device_log),
        "ex3: DeviceLog in lax.scan": Loop(None, device_scan),
        "ex3: no log at all (floor)": Loop(None, no_log),
    }


def _row(what, name, t, base, target=None, ok=None) -> dict:
    return {
        "what": what,
        "variant": name,
        "median_ms": round(t.median(name) * 1e3, 2),
        "ratio_vs": base,
        "ratio": round(t.ratio(name, base), 3),
        "target": target or "",
        "met": "" if ok is None else ("yes" if ok(t.ratio(name, base)) else "NO"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    x, y = host_batches(STEPS, BATCH)
    rows = []

    loops = single_device_loops(x, y)
    t = time_side_by_side(loops, args.repeats, warmup=1)
    what = f"MLP 784-128-10, adam, batch {BATCH}, {STEPS} steps, 1 CPU device"
    base = "hand jit, no metrics"
    rows.append(_row(what, base, t, base))
    rows.append(
        _row(what, "jaxdev step, metrics on device", t, base, "<= 1.05", lambda r: r <= 1.05)
    )
    rows.append(_row(what, "hand jit + float(loss) per step", t, base))
    rows.append(
        _row(
            what,
            "hand jit + float(loss) per step",
            t,
            "jaxdev step, metrics on device",
            "> 1 (jaxdev faster)",
            lambda r: r > 1.0,
        )
    )
    rows.append(
        _row(
            what,
            "jaxdev step, metrics on device",
            t,
            f"jaxdev step, steps_per_call={K}",
            ">= 1.3 (K steps faster)",
            lambda r: r >= 1.3,
        )
    )

    xs, ys = host_batches(STEPS, 8, seed=2)
    loops = k_steps_loops(xs, ys)
    t = time_side_by_side(loops, args.repeats, warmup=1)
    what = f"same MLP, batch 8 (dispatch-bound), {STEPS} steps, 1 CPU device"
    names = list(loops)
    rows.append(_row(what, names[1], t, names[1]))
    rows.append(_row(what, names[0], t, names[1], ">= 1.3 (K steps faster)", lambda r: r >= 1.3))
    rows.append(_row(what, names[0], t, names[2], "<= 1.02 (donation check)", lambda r: r <= 1.02))

    xg, yg = host_batches(STEPS // 2, 256, seed=1)
    loops = data_parallel_loops(xg, yg)
    t = time_side_by_side(loops, args.repeats, warmup=1)
    what = f"same MLP, global batch 256, {STEPS // 2} steps, 8 fake CPU devices"
    names = list(loops)
    rows.append(_row(what, names[1], t, names[0], "<= 1.10", lambda r: r <= 1.10))
    rows.append(_row(what, names[3], t, names[2], "<= 1.10", lambda r: r <= 1.10))
    rows.append(_row(what, names[4], t, names[2], "<= 1.10 (issue 27)", lambda r: r <= 1.10))

    loops = d2l_exercise_3()
    t = time_side_by_side(loops, args.repeats, warmup=1)
    what = "d2l ex. 3: 1000 chained matmuls 100x100 + Frobenius norm log, 1 CPU device"
    names = list(loops)
    rows.append(_row(what, names[0], t, names[1], ">= 1.7 (device log faster)", lambda r: r >= 1.7))
    rows.append(_row(what, names[0], t, names[2], "report"))
    rows.append(_row(what, names[0], t, names[3], "report: the most any per-step log can gain"))
    rows.append(_row(what, names[1], t, names[3], "report: DeviceLog vs no log"))

    report(rows, ("median_ms", "median ms"), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
