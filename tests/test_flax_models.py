"""Real Flax training through the step: model state, masks, dropout keys, accumulation.

Equivalence tests use plain SGD (scale-sensitive: Adam would hide a gradient
that is N times too large). Tolerances: ``atol=rtol=2e-5`` for float32 sums
reassociated over 8 devices.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdev

TOL = dict(atol=2e-5, rtol=2e-5)
SGD = optax.sgd(0.5)

STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(),
    "sharded": lambda: jaxdev.Strategy.sharded(),
    "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
}


def assert_trees_close(a, b, **tol):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL)), a, b
    )


# ---------------------------------------------------------------- regression: shard_map


def _linear_loss(params, batch):
    return (batch["x"] @ params["w"] - batch["y"]) ** 2


def _linear_batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 3)).astype(np.float32),
        "y": rng.normal(size=(rows,)).astype(np.float32),
    }


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_one_sgd_step_moves_weights_as_far_on_every_strategy(name):
    # shard_map used to apply the gradient 8 times over (JAX's vma already summed it).
    batch = _linear_batch()
    params = {"w": jnp.zeros(3)}
    grads = jax.grad(lambda p: _linear_loss(p, batch).mean())(params)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    step = jaxdev.make_train_step(_linear_loss, SGD, STRATEGIES[name]())
    state, _ = step(step.init_state(params, SGD), step.put_batch(batch))
    assert_trees_close(state.params, want)


# ---------------------------------------------------------------- masks reach every metric


def _metric_loss(kind):
    def loss_fn(params, batch):
        logits = batch["x"] @ params["w"]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        value = batch["v"]
        aux = {
            "accuracy": lambda: jaxdev.metrics.Accuracy.from_logits(logits, batch["y"]),
            "sum": lambda: jaxdev.metrics.Sum.from_value(value),
            "mean": lambda: jaxdev.metrics.Mean.from_value(value),
            "min": lambda: jaxdev.metrics.Min.from_value(value),
            "max": lambda: jaxdev.metrics.Max.from_value(value),
            "nonfinite": lambda: jaxdev.metrics.NonFinite.from_value(
                jnp.where(value > 5, jnp.nan, value)
            ),
            "collection": lambda: jaxdev.metrics.Collection(
                {"s": jaxdev.metrics.Sum.from_value(value)}
            ),
            "array": lambda: value,
        }[kind]()
        return losses, {kind: aux}

    return loss_fn


def _metric_truth(kind, batch, params):
    v = batch["v"]
    logits = batch["x"] @ np.asarray(params["w"])
    return {
        "accuracy": float(np.mean(np.argmax(logits, -1) == batch["y"])),
        "sum": float(v.sum()),
        "mean": float(v.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
        "nonfinite": int(np.sum(v > 5)),
        "collection/s": float(v.sum()),
        "array": float(v.mean()),
    }


def _metric_batch(rows=13):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=rows).astype(np.int32)
    # The last row is the one repeated as padding: make it extreme so counting it shows.
    v = np.arange(rows, dtype=np.float32)
    v[-1] = 100.0
    v[0] = -50.0
    return {"x": x, "y": y, "v": v}


KINDS = ["accuracy", "sum", "mean", "min", "max", "nonfinite", "collection", "array"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_metrics_built_in_loss_fn_leave_padded_rows_out(name, kind):
    batch = _metric_batch(13)  # 13 rows over 8 devices: padded to 16
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)}
    truth = _metric_truth(kind, batch, params)
    key = "collection/s" if kind == "collection" else kind
    ev = jaxdev.make_eval_step(_metric_loss(kind), STRATEGIES[name](), has_aux=True)
    got = ev(ev.init_state(params), ev.put_batch(batch)).fetch()
    np.testing.assert_allclose(got[key], truth[key], rtol=1e-5)
    # The train step sees the same rows (metrics are computed before the update).
    step = jaxdev.make_train_step(_metric_loss(kind), SGD, STRATEGIES[name](), has_aux=True)
    _, metrics = step(step.init_state(params, SGD), step.put_batch(batch))
    np.testing.assert_allclose(metrics.fetch()[key], truth[key], rtol=1e-5)


@pytest.mark.parametrize("name", ["pmap", "sharded"])
def test_metrics_respect_the_mask_with_several_steps_per_call(name):
    batch = _metric_batch(13)
    params = {"w": jnp.zeros((4, 3))}
    loss = _metric_loss("sum")
    step = jaxdev.make_train_step(
        loss, optax.sgd(0.0), STRATEGIES[name](), has_aux=True, steps_per_call=2
    )
    two = jax.tree.map(lambda x: np.stack([x, x]), batch)
    placed = step.put_batch(two)
    assert isinstance(placed, jaxdev.Padded)
    _, metrics = step(step.init_state(params, optax.sgd(0.0)), placed)
    np.testing.assert_allclose(metrics.fetch()["sum"], 2 * batch["v"].sum(), rtol=1e-6)


def test_a_metric_that_cannot_be_masked_is_refused():
    def loss_fn(params, batch):
        losses = _linear_loss(params, batch)
        return losses, {"batch_mean": jaxdev.metrics.Mean.from_value(losses.mean())}

    step = jaxdev.make_train_step(loss_fn, SGD, jaxdev.Strategy.sharded(), has_aux=True)
    with pytest.raises(jaxdev.MetricError, match="cannot leave them out"):
        step(step.init_state({"w": jnp.zeros(3)}, SGD), step.put_batch(_linear_batch(13)))

    def scalar_aux(params, batch):
        return _linear_loss(params, batch), {"norm": jnp.sum(params["w"] ** 2)}

    step = jaxdev.make_train_step(scalar_aux, SGD, jaxdev.Strategy.single(), has_aux=True)
    with pytest.raises(jaxdev.MetricError, match=r"aux\['norm'\] has shape \(\)"):
        step(step.init_state({"w": jnp.zeros(3)}, SGD), step.put_batch(_linear_batch(8)))


# ---------------------------------------------------------------- pmap argument counts


@pytest.mark.parametrize("rows", [16, 13])  # without and with a mask argument
@pytest.mark.parametrize("running", [False, True])  # without and with running metrics
def test_pmap_gives_the_single_device_numbers_for_every_argument_combination(rows, running):
    batch = _linear_batch(rows, seed=rows)
    out = {}
    for name in ("single", "pmap"):
        step = jaxdev.make_train_step(_linear_loss, SGD, STRATEGIES[name]())
        state = step.init_state({"w": jnp.ones(3)}, SGD)
        metrics = jax.tree.map(jnp.zeros_like, step(state, step.put_batch(batch))[1])
        state = step.init_state({"w": jnp.ones(3)}, SGD)
        state, metrics = step(state, step.put_batch(batch), metrics if running else None)
        out[name] = (state.params, metrics.fetch())
    assert_trees_close(out["single"][0], out["pmap"][0])
    np.testing.assert_allclose(out["single"][1]["loss"], out["pmap"][1]["loss"], rtol=1e-5)


# ---------------------------------------------------------------- dropout keys


@pytest.mark.parametrize("name", ["pmap", "shard_map", "sharded", "single"])
def test_every_row_draws_its_own_random_number(name):
    # One weight per global row; with lr=-B the update writes each row's draw into w.
    rows = 64

    def loss_fn(params, batch, rng):
        u = jax.random.uniform(rng, batch["i"].shape)
        return params["w"][batch["i"]] * u

    step = jaxdev.make_train_step(loss_fn, optax.sgd(-float(rows)), STRATEGIES[name]())
    state = step.init_state({"w": jnp.zeros(rows)}, optax.sgd(1.0), rng=jax.random.key(0))
    state, _ = step(state, step.put_batch({"i": np.arange(rows, dtype=np.int32)}))
    draws = np.asarray(state.params["w"])
    assert len(np.unique(draws)) == rows, f"{len(np.unique(draws))} distinct draws of {rows}"


# ---------------------------------------------------------------- model state and masks


class ConvBN(nn.Module):
    """Conv -> BatchNorm (told which rows are real) -> Dense."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, mask=None, train=True):
        x = nn.Conv(4, (3, 3))(x)
        bn_mask = None if mask is None else mask[:, None, None, None]
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x, mask=bn_mask)
        return nn.Dense(3)(jnp.mean(nn.relu(x), axis=(1, 2)))


def _bn_loss(model):
    def loss_fn(params, model_state, batch, mask=None):
        logits, new_state = model.apply(
            {"params": params, **model_state}, batch["x"], mask=mask, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), new_state

    return loss_fn


def _bn_data(rows, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, 6, 6, 2)).astype(np.float32),
            "y": rng.integers(0, 3, size=rows).astype(np.int32),
        }
        for _ in range(steps)
    ]


def _bn_train(strategy, batches, axis_name=None, pass_mask=True, **kw):
    model = ConvBN(axis_name=axis_name)
    variables = ConvBN().init(jax.random.key(0), jnp.zeros((1, 6, 6, 2)), train=False)
    step = jaxdev.make_train_step(
        _bn_loss(model), SGD, strategy, has_state=True, pass_mask=pass_mask, **kw
    )
    state = step.init_state(variables["params"], SGD, model_state=dict(variables))
    state = state._replace(model_state={"batch_stats": variables["batch_stats"]})
    state = jaxdev.copy_to(state, step._target)
    metrics = None
    for batch in batches:
        state, metrics = step(state, step.put_batch(batch), metrics)
    return state, metrics.fetch()


@pytest.mark.parametrize("name", ["sharded", "single"])
def test_padded_rows_never_change_batchnorm_statistics(name):
    batches = _bn_data(13)  # 13 rows: the sharded step pads to 16
    exact, exact_metrics = _bn_train(jaxdev.Strategy.single(), batches, pass_mask=False)
    state, metrics = _bn_train(STRATEGIES[name](), batches)
    assert_trees_close(state.params, exact.params)
    assert_trees_close(state.model_state, exact.model_state)
    np.testing.assert_allclose(metrics["loss"], exact_metrics["loss"], **TOL)


def test_without_the_mask_padding_would_show_in_the_statistics():
    # The control for the test above: the same run, BatchNorm not told, differs.
    batches = _bn_data(13)
    exact, _ = _bn_train(jaxdev.Strategy.single(), batches, pass_mask=False)
    with pytest.warns(UserWarning, match="padded rows reach the model"):  # and it says so
        blind, _ = _bn_train(jaxdev.Strategy.sharded(), batches, pass_mask=False)
    mean = blind.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    ref = exact.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    assert not np.allclose(np.asarray(mean), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_model_state_is_carried_through_steps_per_call(name):
    batches = _bn_data(16, steps=4)
    strategy = STRATEGIES[name]()
    one, _ = _bn_train(strategy, batches, axis_name=strategy.collective_axis)
    grouped = [jax.tree.map(lambda *xs: np.stack(xs), *batches[i : i + 2]) for i in (0, 2)]
    k, _ = _bn_train(strategy, grouped, axis_name=strategy.collective_axis, steps_per_call=2)
    assert_trees_close(k.params, one.params)
    assert_trees_close(k.model_state, one.model_state)
    assert int(k.step) == 4


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("rows", [32, 29])  # 29: the padded rows of the micro-batches are masked
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_accumulate_equals_one_update_on_the_whole_batch(name, rows):
    batches = [_linear_batch(rows, seed=s) for s in range(3)]
    out = {}
    for m in (1, 4):
        step = jaxdev.make_train_step(_linear_loss, SGD, STRATEGIES[name](), accumulate=m)
        state, metrics = step.init_state({"w": jnp.ones(3)}, SGD), None
        for batch in batches:
            state, metrics = step(state, step.put_batch(batch), metrics)
        out[m] = (state.params, metrics.fetch()["loss"])
    ref = jaxdev.make_train_step(_linear_loss, SGD)
    state, metrics = ref.init_state({"w": jnp.ones(3)}, SGD), None
    for batch in batches:
        state, metrics = ref(state, ref.put_batch(batch), metrics)
    for m in (1, 4):
        assert_trees_close(out[m][0], state.params)
        np.testing.assert_allclose(out[m][1], metrics.fetch()["loss"], **TOL)


def test_accumulate_composes_with_steps_per_call():
    batches = [_linear_batch(32, seed=s) for s in range(4)]
    ref = jaxdev.make_train_step(_linear_loss, SGD)
    state = ref.init_state({"w": jnp.ones(3)}, SGD)
    for batch in batches:
        state, _ = ref(state, ref.put_batch(batch))
    step = jaxdev.make_train_step(
        _linear_loss, SGD, jaxdev.Strategy.sharded(), accumulate=2, steps_per_call=2
    )
    got = step.init_state({"w": jnp.ones(3)}, SGD)
    for i in (0, 2):
        grouped = jax.tree.map(lambda *x: np.stack(x), *batches[i : i + 2])
        got, _ = step(got, step.put_batch(grouped))
    assert_trees_close(got.params, state.params)
    assert int(got.step) == 4


# ---------------------------------------------------------------- hooks


def test_regularizer_is_added_once_and_lr_is_reported():
    batch = _linear_batch(16)
    params = {"w": jnp.asarray([1.0, -2.0, 0.5])}

    def reg(p):
        return 0.1 * jnp.sum(p["w"] ** 2)

    grads = jax.grad(lambda p: _linear_loss(p, batch).mean() + reg(p))(params)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    for name in ("single", "pmap", "sharded", "shard_map"):
        step = jaxdev.make_train_step(
            _linear_loss, SGD, STRATEGIES[name](), regularizer=reg, lr_fn=lambda s: 0.5 + 0 * s
        )
        state, metrics = step(step.init_state(params, SGD), step.put_batch(batch))
        assert_trees_close(state.params, want)
        out = metrics.fetch()
        np.testing.assert_allclose(out["regularizer"], float(reg(params)), rtol=1e-6)
        assert out["lr"] == 0.5


def test_non_finite_updates_are_skipped_with_optax_apply_if_finite():
    tx = optax.apply_if_finite(SGD, max_consecutive_errors=5)

    def loss_fn(params, batch):
        return _linear_loss(params, batch) * jnp.where(batch["bad"], jnp.inf, 1.0)

    step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded())
    state = step.init_state({"w": jnp.ones(3)}, tx)
    bad = {**_linear_batch(8), "bad": np.ones(8, bool)}
    state, _ = step(state, step.put_batch(bad))
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.ones(3))
    good = {**_linear_batch(8), "bad": np.zeros(8, bool)}
    state, _ = step(state, step.put_batch(good))
    assert not np.allclose(np.asarray(state.params["w"]), 1.0)


# ---------------------------------------------------------------- donation (issue 11)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_reusing_a_donated_state_names_the_leaves_instead_of_crashing(name):
    step = jaxdev.make_train_step(_linear_loss, SGD, STRATEGIES[name]())
    batch = step.put_batch(_linear_batch(16))
    state = step.init_state({"w": jnp.ones(3)}, SGD)
    new, metrics = step(state, batch)
    with pytest.raises(jaxdev.DeletedArrayError, match=r"state\.params\['w'\].*use the returned"):
        step(state, batch)
    old_metrics = metrics
    new, metrics = step(new, batch, metrics)  # metrics are never donated
    new, _ = step(new, batch, old_metrics)
    jax.tree.leaves(old_metrics)[0].delete()
    with pytest.raises(jaxdev.DeletedArrayError, match=r"metrics\['loss'\].*never deletes"):
        step(new, batch, old_metrics)


@pytest.mark.parametrize("name", ["single", "sharded", "pmap"])
def test_one_buffer_in_state_and_metrics_is_refused(name):
    step = jaxdev.make_train_step(_linear_loss, SGD, STRATEGIES[name]())
    batch = step.put_batch(_linear_batch(16))
    state, metrics = step(step.init_state({"w": jnp.ones(3)}, SGD), batch)
    shared = jaxdev.metrics.Collection(
        {"loss": jaxdev.metrics.Mean(total=state.step, count=state.step)}
    )
    with pytest.raises(jaxdev.PlacementError, match=r"donate an array it also reads: state\.step"):
        step(state, batch, shared)
    step(state, batch, metrics)  # the state was not consumed by the refused call


def test_a_warm_loop_with_model_state_and_accumulation_makes_no_host_sync():
    batches = _bn_data(16, steps=5)
    model = ConvBN()
    variables = ConvBN().init(jax.random.key(0), jnp.zeros((1, 6, 6, 2)), train=False)
    step = jaxdev.make_train_step(
        _bn_loss(model),
        SGD,
        jaxdev.Strategy.sharded(),
        has_state=True,
        pass_mask=True,
        accumulate=2,
    )
    state = step.init_state(
        variables["params"], SGD, model_state={"batch_stats": variables["batch_stats"]}
    )
    placed = [step.put_batch(b) for b in batches]
    state, metrics = step(state, placed[0])
    state, metrics = step(state, placed[1], metrics)
    with jaxdev.no_host_sync(max_compiles=0, max_host_to_device=0):
        for batch in placed[2:]:
            state, metrics = step(state, batch, metrics)
    assert int(state.step) == 5 and np.isfinite(metrics.fetch()["loss"])


def test_step_prefetch_places_like_put_batch():
    step = jaxdev.make_train_step(_linear_loss, SGD, jaxdev.Strategy.pmap())
    batches = [_linear_batch(13, seed=s) for s in range(3)]
    with step.prefetch(iter(batches)) as it:
        got = list(it)
    assert len(got) == 3 and all(isinstance(b, jaxdev.Padded) for b in got)
    assert got[0].mask.shape == (8, 2)
    state = step.init_state({"w": jnp.ones(3)}, SGD)
    for b in got:
        state, _ = step(state, b)
    assert int(state.step) == 3
