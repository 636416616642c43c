"""Language-model losses (issue 19): token-weighted means, exact on every strategy.

Flax's own lm1b TransformerLM (vendored as written in ``flax_lm1b_models.py``)
is trained with padding tokens by Flax's own lm1b ``train_step`` (copied
below as written: the loss is ``sum(loss * weights) / sum(weights)`` over the
global batch, compiled with ``jax.jit`` and the logical-axis shardings, as in
``examples/lm1b/train.py``) and by jaxdev's ``make_train_step(...,
weighted=True)`` on every strategy. Plain SGD, so a gradient N times too
large would show.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import common_utils, train_state
from flax_lm1b_models import TransformerConfig, TransformerLM
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev

CFG = TransformerConfig(
    vocab_size=64,
    output_vocab_size=64,
    emb_dim=32,
    num_heads=2,
    num_layers=2,
    qkv_dim=32,
    mlp_dim=64,
    max_len=16,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    deterministic=True,
)
RULES = [["mlp", "tensor"], ["vocab", "tensor"], ["embed", "fsdp"], ["heads", "tensor"]]
LR, STEPS, ROWS, LENGTH = 0.5, 10, 16, 12
TOL = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- Flax's lm1b, as written


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """examples/lm1b/train.py, unchanged but for formatting."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(
        targets, vocab_size, on_value=confidence, off_value=low_confidence
    )
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def flax_train_step(state, batch):
    """examples/lm1b/train.py's train_step (no packing, no dropout, no schedule)."""
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)

    def loss_fn(params):
        logits = TransformerLM(CFG).apply({"params": params}, inputs)
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights)
        return loss / weight_sum, logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), None


def flax_reference(params, batches, mesh):
    """Train as lm1b does: jit with the logical-axis shardings of the state."""
    tx = optax.sgd(LR)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        spec = nn.get_partition_spec(_boxed_state(tx))
        shardings = nn.logical_to_mesh_sharding(spec, mesh, RULES)
    data = NamedSharding(mesh, P("data"))
    step = jax.jit(flax_train_step, in_shardings=(shardings, data), out_shardings=(shardings, None))
    state = jax.device_put(state, shardings)
    for b in batches:
        state, _ = step(state, jax.device_put(b, data))
    return state.params


def _boxed_state(tx):
    def init():
        variables = TransformerLM(CFG).init(jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32))
        return train_state.TrainState.create(apply_fn=None, params=variables["params"], tx=tx)

    return jax.eval_shape(init)


# ---------------------------------------------------------------- jaxdev's side


def token_loss(params, batch):
    """Per-token losses and weights: what a language model hands the weighted step."""
    inputs = batch["inputs"]
    logits = TransformerLM(CFG).apply({"params": params}, inputs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, inputs)
    correct = (jnp.argmax(logits, -1) == inputs).astype(jnp.float32)
    return (losses, (inputs > 0).astype(jnp.float32)), {"accuracy": correct}


def _params(boxed=False):
    variables = TransformerLM(CFG).init(jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32))
    return variables["params"] if boxed else nn.unbox(variables["params"])


def _batches(rows=ROWS, n=STEPS, seed=0):
    """Token rows with trailing padding (0) of random lengths, some rows mostly padding."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, CFG.vocab_size, size=(rows, LENGTH)).astype(np.int32)
        lengths = rng.integers(1, LENGTH + 1, size=rows)
        tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
        out.append({"inputs": tokens})
    return out


def _mesh():
    return jaxdev.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})  # lm1b's mesh axes


STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(8),
    "sharded_fsdp": lambda: jaxdev.Strategy.sharded(
        jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp"
    ),
    "sharded_flax": lambda: jaxdev.Strategy.sharded(
        _mesh(), rules="flax", logical_axis_rules=RULES
    ),
    "shard_map": lambda: jaxdev.Strategy.sharded(jaxdev.data_mesh(), shard_map=True),
}


def _train(strategy, batches, **kw):
    tx = optax.sgd(LR)
    step = jaxdev.make_train_step(token_loss, tx, strategy, has_aux=True, weighted=True, **kw)
    state = step.init_state(_params(boxed=strategy.rules == "flax"), tx)
    metrics = None
    for b in batches:
        state, metrics = step(state, step.put_batch(b), metrics)
    return state, metrics


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


@pytest.fixture(scope="module")
def reference():
    batches = _batches()
    return batches, flax_reference(_params(), batches, _mesh())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_weighted_step_equals_flax_lm1b_on_every_strategy(name, reference):
    batches, want = reference
    state, metrics = _train(STRATEGIES[name](), batches)
    _close(state.params, want)
    # metrics: the token-weighted means of every step's tokens
    got = metrics.fetch()
    losses, accs, weights = [], [], []
    params = _params()
    tx = optax.sgd(LR)
    ref = jaxdev.make_train_step(token_loss, tx, has_aux=True, weighted=True)
    s = ref.init_state(params, tx)
    for b in batches:
        (token_losses, w), aux = token_loss(s.params, b)
        losses.append(np.sum(np.asarray(token_losses) * np.asarray(w)))
        accs.append(np.sum(np.asarray(aux["accuracy"]) * np.asarray(w)))
        weights.append(np.sum(np.asarray(w)))
        s, _ = ref(s, ref.put_batch(b))
    np.testing.assert_allclose(got["loss"], sum(losses) / sum(weights), rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], sum(accs) / sum(weights), rtol=1e-5)


def test_per_example_mean_of_token_losses_is_not_the_lm_objective(reference):
    """The naive port (mean over each row's tokens, then over rows) trains elsewhere."""
    batches, want = reference

    def per_row(params, batch):
        (losses, w), _ = token_loss(params, batch)
        return jnp.sum(losses * w, -1) / jnp.maximum(jnp.sum(w, -1), 1)

    tx = optax.sgd(LR)
    step = jaxdev.make_train_step(per_row, tx)
    state = step.init_state(_params(), tx)
    for b in batches:
        state, _ = step(state, step.put_batch(b))
    drift = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(want))
    )
    assert drift > 1e-3  # the weighted step is needed: this is what it fixes


@pytest.fixture(scope="module")
def padded_reference():
    """Flax's numbers on 4 batches of 13 rows, one device: the same for every strategy."""
    batches = _batches(rows=13, n=4, seed=1)
    return batches, flax_reference_single(_params(), batches)


@pytest.mark.parametrize("name", ["pmap", "sharded_flax"])
def test_padded_rows_accumulate_and_steps_per_call_keep_the_global_normaliser(
    name, padded_reference
):
    """13 rows (padded to 16), M=2 micro-batches, K=2 steps per call: Flax's numbers
    on the unpadded 13 rows, normalised by each step's whole weight."""
    batches, want = padded_reference
    for kw in ({}, {"accumulate": 2}):
        state, _ = _train(STRATEGIES[name](), batches, **kw)
        _close(state.params, want)
    tx = optax.sgd(LR)
    step = jaxdev.make_train_step(
        token_loss, tx, STRATEGIES[name](), has_aux=True, weighted=True, steps_per_call=2
    )
    state = step.init_state(_params(boxed=name == "sharded_flax"), tx)
    for i in (0, 2):
        grouped = {"inputs": np.stack([batches[i]["inputs"], batches[i + 1]["inputs"]])}
        state, _ = step(state, step.put_batch(grouped))
    _close(state.params, want)


def flax_reference_single(params, batches):
    """Flax's lm1b step on one device (row counts the mesh does not divide)."""
    tx = optax.sgd(LR)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(flax_train_step)
    for b in batches:
        state, _ = step(state, b)
    return state.params


def test_weighted_eval_step_gives_the_token_weighted_loss():
    batches = _batches(rows=13, n=2, seed=2)
    params = _params()
    total = weight = 0.0
    for b in batches:
        logits = TransformerLM(CFG).apply({"params": params}, b["inputs"])
        w = (b["inputs"] > 0).astype(np.float32)
        loss, ws = compute_weighted_cross_entropy(logits, b["inputs"], w)
        total, weight = total + float(loss), weight + float(ws)
    for name in ("single", "pmap", "sharded_flax"):
        ev = jaxdev.make_eval_step(token_loss, STRATEGIES[name](), has_aux=True, weighted=True)
        placed = ev.init_state(_params(boxed=name == "sharded_flax"))
        metrics = None
        for b in batches:
            metrics = ev(placed, ev.put_batch(b), metrics)
        np.testing.assert_allclose(metrics.fetch()["loss"], total / weight, rtol=1e-5)


def test_bad_weighted_returns_and_integer_losses_are_named():
    tx = optax.sgd(LR)
    batch = {"inputs": np.ones((8, 4), np.int32)}

    def cases():
        yield (
            lambda p, b: (b["inputs"].sum(-1) * p["w"]).astype(jnp.int32),
            False,
            "dtype int32; they must be floating",
        )
        yield (lambda p, b: jnp.ones((8, 4)) * p["w"], True, r"`\(losses, weights\)`")
        yield (
            lambda p, b: (jnp.ones((8, 4)) * p["w"], jnp.ones((8, 3))),
            True,
            r"losses of shape \(8, 4\) and weights of shape \(8, 3\)",
        )
        yield (lambda p, b: jnp.ones((8, 4)) * p["w"], False, r"one loss per example")

    for loss, weighted, match in cases():
        step = jaxdev.make_train_step(loss, tx, weighted=weighted)
        w = jnp.ones(())
        with pytest.raises(jaxdev.UsageError, match=match):
            step(step.init_state({"w": w}, tx), step.put_batch(batch))


def test_weighted_mean_metric_merges_and_reduces_exactly():
    values = jnp.array([[1.0, 2.0, jnp.nan], [3.0, jnp.nan, jnp.nan]])
    weights = jnp.array([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    m = jaxdev.metrics.WeightedMean.from_value(values, weights)  # NaN under weight 0 never counts
    assert m.fetch() == pytest.approx((1 + 2 + 6) / 4)
    both = m.merge(jaxdev.metrics.WeightedMean.from_value(jnp.array([[5.0]]), jnp.array([[4.0]])))
    assert both.fetch() == pytest.approx((9 + 20) / 8)
    masked = jaxdev.metrics.WeightedMean.from_value(values, weights, mask=jnp.array([True, False]))
    assert masked.fetch() == pytest.approx(1.5)
    assert np.isnan(jaxdev.metrics.WeightedMean.empty().fetch())
    with pytest.raises(jaxdev.MetricError, match="`weights` of `value`'s shape"):
        jaxdev.metrics.WeightedMean.from_value(values, weights[:, :2])
