"""Training: the same numbers on one device, pmap and sharded jit; metrics stay on device.

Tolerance: parameters and metrics agree to ``atol=1e-5, rtol=1e-5`` (float32
sums reassociated across 8 devices); the single-device step equals a
hand-written optax loop to the same tolerance.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdev

TOL = dict(atol=1e-5, rtol=1e-5)
STEPS, BATCH, FEATURES, CLASSES = 20, 32, 12, 5


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(x)))


MODEL = MLP()


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


def _data(steps=STEPS, batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, batch, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(steps, batch)).astype(np.int32)
    return x, y


def _params():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]


TX = optax.sgd(0.1)  # scale-sensitive: Adam would hide a gradient N times too large


def _reference(x, y):
    """Hand-written optax loop on one device: params and mean loss per step."""
    params, opt = _params(), TX.init(_params())

    @jax.jit
    def step(params, opt, xb, yb):
        def obj(p):
            losses, _ = loss_fn(p, {"x": xb, "y": yb})
            return losses.mean()

        loss, g = jax.value_and_grad(obj)(params)
        updates, opt = TX.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for xb, yb in zip(x, y):
        params, opt, loss = step(params, opt, xb, yb)
        losses.append(float(loss))
    return params, losses


def _train(strategy, x, y, k=1):
    step = jaxdev.make_train_step(loss_fn, TX, strategy, has_aux=True, steps_per_call=k)
    state = step.init_state(_params(), TX)
    metrics = None
    for i in range(0, len(x), k):
        xb, yb = (x[i], y[i]) if k == 1 else (x[i : i + k], y[i : i + k])
        state, metrics = step(state, step.put_batch({"x": xb, "y": yb}), metrics)
    return state, metrics.fetch()


STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single("cpu:0"),
    "pmap": lambda: jaxdev.Strategy.pmap(),
    "sharded": lambda: jaxdev.Strategy.sharded(),
    "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_last_metric_of_rows_is_the_last_real_row_with_accumulate_and_padding(name, k):
    """Before: under pmap and shard_map with `accumulate=2` and 13 rows (padded to 16),
    `Last.from_value(batch["i"])` gave row 7, not 12: each device merged its micro-batches
    first, devices 5-7 kept their first micro-batch's row (the second was padding), and the
    reduce took the highest device. Rows run micro-batch first, then device."""
    from jaxdev.metrics import Last, Sum

    def loss(p, b):
        aux = {"last": Last.from_value(b["i"]), "sum": Sum.from_value(b["i"])}
        return (b["x"] @ p["w"]) ** 2, aux

    step = jaxdev.make_train_step(loss, optax.sgd(0.0), STRATEGIES[name](), has_aux=True,
                                  accumulate=2, steps_per_call=k)
    state = step.init_state({"w": jnp.ones(3)}, optax.sgd(0.0))
    rows = np.arange(13, dtype=np.float32)
    i = rows if k == 1 else np.stack([rows, rows + 100])
    batch = {"x": np.ones(i.shape + (3,), np.float32), "i": i}
    _, metrics = step(state, step.put_batch(batch))
    got = metrics.fetch()
    assert (got["last"], got["sum"]) == (i.reshape(-1)[-1], i.sum()), got


@pytest.fixture(scope="module")
def reference():
    return _reference(*_data())


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_matches_hand_written_optax_loop(reference, name, k):
    ref_params, ref_losses = reference
    state, metrics = _train(STRATEGIES[name](), *_data(), k=k)
    assert int(state.step) == STEPS
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
        state.params,
        ref_params,
    )
    np.testing.assert_allclose(metrics["loss"], np.mean(ref_losses), **TOL)
    assert 0.0 <= metrics["accuracy"] <= 1.0
    if name != "single":  # truly replicated, not stacked
        leaf = jax.tree.leaves(state.params)[0]
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8


@pytest.mark.parametrize("name", ["pmap", "sharded", "shard_map"])
def test_uneven_batch_is_padded_and_counted_exactly(name):
    x, y = _data(steps=1, batch=29, seed=3)  # 29 rows on 8 devices
    exact, _ = _train(STRATEGIES["single"](), x, y)
    step = jaxdev.make_train_step(loss_fn, TX, STRATEGIES[name](), has_aux=True)
    batch = step.put_batch({"x": x[0], "y": y[0]})
    assert isinstance(batch, jaxdev.Padded) and batch.size == 29
    state, metrics = step(step.init_state(_params(), TX), batch)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
        state.params,
        exact.params,
    )
    losses, aux = loss_fn(_params(), {"x": x[0], "y": y[0]})
    fetched = metrics.fetch()
    np.testing.assert_allclose(fetched["loss"], float(losses.mean()), **TOL)
    np.testing.assert_allclose(fetched["accuracy"], float(aux["accuracy"].mean()), **TOL)


def test_an_uneven_batch_adds_no_collective_and_a_shard_batch_mask_still_works(mesh):
    """put_batch replicates the mask of a jit step, so each device counts the real rows:
    the loss's denominator needs no all-reduce before the backward pass (it had one)."""
    x, y = _data(steps=1, batch=29, seed=3)
    sharded = jaxdev.Strategy.sharded(mesh)
    step = jaxdev.make_train_step(loss_fn, TX, sharded, has_aux=True, donate=False)
    state = step.init_state(_params(), TX)
    even = step.put_batch({"x": x[0][:24], "y": y[0][:24]})
    uneven = step.put_batch({"x": x[0], "y": y[0]})
    assert uneven.mask.sharding.is_fully_replicated
    assert step.strategy.mask_spec() == jax.sharding.PartitionSpec()
    texts = [step.lower(state, b).compile().as_text() for b in (even, uneven)]
    assert [len(re.findall(r"\ball-reduce(?:-start)?\(", t)) for t in texts] == [1, 1]
    # shard_batch's Padded keeps its mask split like the rows; the step moves it
    own = jaxdev.shard_batch({"x": x[0], "y": y[0]}, mesh, pad=True)
    assert not own.mask.sharding.is_fully_replicated
    for a, b in zip(jax.tree.leaves(step(state, own)), jax.tree.leaves(step(state, uneven))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert step.strategy.replace(shard_map=True).mask_spec() == jax.sharding.PartitionSpec("data")


def test_eval_step_matches_direct_computation():
    x, y = _data(steps=1, batch=21, seed=5)
    params = _params()
    losses, aux = loss_fn(params, {"x": x[0], "y": y[0]})
    for name in ("single", "pmap", "sharded"):
        ev = jaxdev.make_eval_step(loss_fn, STRATEGIES[name](), has_aux=True)
        metrics = ev(ev.init_state(params), ev.put_batch({"x": x[0], "y": y[0]}))
        out = metrics.fetch()
        np.testing.assert_allclose(out["loss"], float(losses.mean()), **TOL)
        np.testing.assert_allclose(out["accuracy"], float(aux["accuracy"].mean()), **TOL)


def test_fifty_steps_make_no_host_sync_and_compile_once_per_signature():
    x, y = _data(steps=50)
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(), has_aux=True)
    state = step.init_state(_params(), TX)
    batches = [step.put_batch({"x": xb, "y": yb}) for xb, yb in zip(x, y)]
    metrics = None
    with jaxdev.count_transfers() as counter:
        for i, batch in enumerate(batches):
            state, metrics = step(state, batch, metrics)
            if i == 1:  # step 1 has no running metrics, step 2 has: one compile each
                assert counter.compiles == 2
    assert counter.device_to_host == 0 and counter.host_to_device == 0
    assert counter.compiles == 2, counter.summary()
    assert int(state.step) == 50
    assert np.isfinite(metrics.fetch()["loss"])


@pytest.mark.parametrize("strategy", ["single", "sharded"])
def test_a_fresh_host_collection_reuses_the_compiled_step(strategy):
    x, y = _data(steps=3)
    strat = jaxdev.Strategy.single() if strategy == "single" else jaxdev.Strategy.sharded()
    step = jaxdev.make_train_step(loss_fn, TX, strat, has_aux=True)
    state = step.init_state(_params(), TX)
    batches = [step.put_batch({"x": xb, "y": yb}) for xb, yb in zip(x, y)]
    state, metrics = step(state, batches[0])
    state, metrics = step(state, batches[1], metrics)  # compiles the running-metrics version
    fresh = jax.tree.map(jnp.zeros_like, jaxdev.to_host(metrics))  # a host-built collection
    with jaxdev.count_transfers() as counter:
        state, again = step(state, batches[2], fresh)
    assert counter.compiles == 0, counter.summary()
    out = again.fetch()  # zeros merged with one step: that step's metrics
    assert set(out) == {"loss", "accuracy"} and np.isfinite(out["loss"])


def test_state_is_donated_by_default():
    x, y = _data(steps=1)
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single(), has_aux=True)
    state = step.init_state(_params(), TX)
    new, _ = step(state, step.put_batch({"x": x[0], "y": y[0]}))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))
    kept = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single(), has_aux=True, donate=False)
    state = kept.init_state(_params(), TX)
    kept(state, kept.put_batch({"x": x[0], "y": y[0]}))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))


def test_init_state_copies_so_donation_never_deletes_the_callers_params():
    x, y = _data(steps=1)
    params = _params()
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single(), has_aux=True)
    state = step.init_state(params, TX)
    step(state, step.put_batch({"x": x[0], "y": y[0]}))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))


def test_flax_nnx_model_and_rng():
    model = nnx.Sequential(
        nnx.Linear(FEATURES, 16, rngs=nnx.Rngs(0)),
        nnx.Dropout(0.1, rngs=nnx.Rngs(1)),
        nnx.Linear(16, CLASSES, rngs=nnx.Rngs(2)),
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def nnx_loss(params, batch, rng):
        m = nnx.merge(graphdef, params, rest)
        m.eval() if rng is None else m.train()
        logits = m.layers[2](nnx.relu(m.layers[0](batch["x"])))
        logits = logits + 0.0 * jax.random.normal(rng, logits.shape)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    x, y = _data(steps=3)
    tx = optax.sgd(0.1)
    results = []
    for name in ("single", "sharded"):
        step = jaxdev.make_train_step(nnx_loss, tx, STRATEGIES[name]())
        state = step.init_state(params, tx, rng=jax.random.key(7))
        for xb, yb in zip(x, y):
            state, metrics = step(state, step.put_batch({"x": xb, "y": yb}))
        assert isinstance(state.params, nnx.State)
        results.append((state.params, metrics.fetch()["loss"]))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
        results[0][0],
        results[1][0],
    )
    np.testing.assert_allclose(results[0][1], results[1][1], **TOL)


def test_bad_inputs():
    with pytest.raises(jaxdev.UsageError, match=r"`strategy` must be made by jaxdev.Strategy"):
        jaxdev.make_train_step(loss_fn, TX, "pmap")
    with pytest.raises(jaxdev.UsageError, match="`steps_per_call` must be >= 1, got 0"):
        jaxdev.make_train_step(loss_fn, TX, steps_per_call=0)
    with pytest.raises(jaxdev.UsageError, match="`steps_per_call` must be an int"):
        jaxdev.make_train_step(loss_fn, TX, steps_per_call=2.0)

    def mean_loss(params, batch):
        return loss_fn(params, batch)[0].mean()

    step = jaxdev.make_train_step(mean_loss, TX, jaxdev.Strategy.single())
    x, y = _data(steps=1)
    with pytest.raises(jaxdev.UsageError, match=r"one loss per example, shape \(32,\)"):
        step(step.init_state(_params(), TX), step.put_batch({"x": x[0], "y": y[0]}))
    k_step = jaxdev.make_train_step(
        loss_fn, TX, jaxdev.Strategy.sharded(), has_aux=True, steps_per_call=4
    )
    with pytest.raises(jaxdev.ShardingError, match=r"shape \(K=4, B, ...\)"):
        k_step.put_batch({"x": x[0], "y": y[0]})
    with pytest.raises(jaxdev.ShardingError, match="`axis`='model' is not an axis"):
        jaxdev.Strategy.sharded(jaxdev.data_mesh(), axis="model")


@pytest.mark.parametrize("kind", ["train", "train donate=False", "eval"])
@pytest.mark.parametrize("name", ["single", "pmap", "sharded", "sharded 1 device", "shard_map"])
def test_a_scalar_batch_leaf_is_named_by_every_strategy(name, kind):
    """Was, sharded: JAX's ValueError 'pjit arguments ... args[1]['t'] ... incompatible with
    its sharding annotation' (jit's in_shardings split every batch leaf, before the step's own
    check in the loss's trace): single and pmap named it."""
    strategy = {
        "single": lambda: jaxdev.Strategy.single(),
        "pmap": lambda: jaxdev.Strategy.pmap(),
        "sharded": lambda: jaxdev.Strategy.sharded(),
        "sharded 1 device": lambda: jaxdev.Strategy.sharded(jaxdev.data_mesh(jax.devices()[:1])),
        "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
    }[name]()
    loss = lambda p, b: (b["x"] @ p["w"] * b["t"]) ** 2  # noqa: E731
    if kind == "eval":
        step, state = jaxdev.make_eval_step(loss, strategy), {"w": jnp.ones(4)}
    else:
        step = jaxdev.make_train_step(loss, optax.sgd(0.1), strategy, donate=kind == "train")
        state = step.init_state({"w": jnp.ones(4)})
    batch = {"x": np.ones((8, 4), np.float32), "t": jnp.float32(2)}
    with pytest.raises(jaxdev.ShardingError, match=r"scalar leaves.*\n  \['t'\]: shape \(\)"):
        step(state, batch)
    with pytest.raises(jaxdev.ShardingError, match=r"scalar leaves.*\n  \['t'\]: shape \(\)"):
        step.put_batch(batch)
