"""NNX code as NNX users write it (issue 19): keys at call time, per-device dropout, masks.

The first two tests check dropout masks row by row: the loss hands the mask it
drew to ``jax.debug.callback``, which runs per device under ``pmap`` /
``shard_map``; every row of the global batch must draw its own mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdev

ROWS, WIDTH = 64, 32
SGD = optax.sgd(0.1)
STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(8),
    "sharded": lambda: jaxdev.Strategy.sharded(),
    "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
}


class TutorialStyle(nnx.Module):
    """The NNX MNIST tutorial's pattern: Dropout without rngs, keys given at call time."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.5)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.dropout(self.linear(x), rngs=rngs)


class OwnRngs(nnx.Module):
    """A module that holds its own dropout stream (``nnx.Dropout(..., rngs=rngs)``)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def _recorder():
    seen: list[np.ndarray] = []

    def record(kept):
        seen.append(np.asarray(kept).reshape(-1, WIDTH))

    return seen, record


def _batch():
    return {"x": np.ones((ROWS, WIDTH), np.float32)}


def _distinct(seen: list[np.ndarray]) -> int:
    rows = np.concatenate(seen)
    assert rows.shape == (ROWS, WIDTH), rows.shape
    return len({r.tobytes() for r in rows})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_tutorial_loss_with_rngs_at_call_time_gets_the_steps_key(name):
    model = TutorialStyle(rngs=nnx.Rngs(0))
    seen, record = _recorder()

    def loss_fn(model, batch, rngs=None):  # as the tutorial writes it
        out = model(batch["x"], rngs=rngs)
        jax.debug.callback(record, out != 0)
        return jnp.mean(out**2, axis=-1)

    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(model, loss_fn), SGD, STRATEGIES[name](), has_state=True
    )
    params, rest = jaxdev.nnx.split(model)
    state = step.init_state(params, SGD, rng=jax.random.key(1), model_state=rest)
    state, metrics = step(state, step.put_batch(_batch()))
    jax.block_until_ready(metrics)
    jax.effects_barrier()
    assert _distinct(seen) == ROWS  # every row, on every device, its own mask


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_modules_own_rngs_draw_per_device_masks_and_stay_replicated(name):
    model = OwnRngs(rngs=nnx.Rngs(0))
    seen, record = _recorder()

    def loss_fn(model, batch):
        out = model(batch["x"])
        jax.debug.callback(record, out != 0)
        return jnp.mean(out**2, axis=-1)

    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(model, loss_fn), SGD, STRATEGIES[name](), has_state=True
    )
    params, rest = jaxdev.nnx.split(model)
    key_before = np.asarray(jax.random.key_data(rest["dropout"]["rngs"]["key"][...]))
    state = step.init_state(params, SGD, model_state=rest)  # no rng=: the module's own stream
    state, metrics = step(state, step.put_batch(_batch()))
    jax.block_until_ready(metrics)
    jax.effects_barrier()
    assert _distinct(seen) == ROWS  # 8 distinct masks over 64 rows before the fix
    stream = state.model_state["dropout"]["rngs"]
    key = stream["key"][...]
    assert key.sharding.is_fully_replicated
    for shard in key.addressable_shards:  # the stored key is the module's, on every device
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(shard.data)), key_before)
    assert int(stream["count"][...]) == 1


class Classifier(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_nnx_optimizer_multimetric_and_nnx_jit_with_jaxdev_padding_are_exact():
    """The user's own loop (nnx.Optimizer, nnx.MultiMetric, @nnx.jit), jaxdev for placement:
    pass the Padded mask to ``metrics.update(..., mask=)`` and padded rows never count."""
    mesh = jaxdev.data_mesh()
    model = Classifier(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(61, 8)).astype(np.float32)  # 61 rows: padded to 64 on 8 devices
    y = rng.integers(0, 4, size=61).astype(np.int32)

    def losses_of(model, x, y):
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), logits

    @nnx.jit
    def train_step(model, optimizer, x, y, mask):
        def loss_fn(model):
            losses, _ = losses_of(model, x, y)
            return jnp.sum(losses * mask) / jnp.sum(mask)  # the masked mean

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    @nnx.jit
    def eval_step(model, metrics, x, y, mask):
        losses, logits = losses_of(model, x, y)
        metrics.update(loss=losses, logits=logits, labels=y, mask=mask)

    padded = jaxdev.shard_batch({"x": x, "y": y}, mesh, pad=True)
    train_step(model, optimizer, padded.batch["x"], padded.batch["y"], padded.mask)

    def fresh():
        return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    metrics = fresh()
    eval_step(model, metrics, padded.batch["x"], padded.batch["y"], padded.mask)
    got = metrics.compute()
    # the unpadded truth, on the host
    want_losses, logits = losses_of(model, jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_allclose(float(got["loss"]), float(np.mean(want_losses)), rtol=1e-6)
    want_acc = float(np.mean(np.argmax(np.asarray(logits), -1) == y))
    np.testing.assert_allclose(float(got["accuracy"]), want_acc, rtol=1e-6)
    # and the one train step equals one step on the unpadded rows
    ref = Classifier(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean(losses_of(m, x, y)[0]))(ref)
    ref_opt.update(ref, grads)
    np.testing.assert_allclose(
        np.asarray(model.linear.kernel[...]), np.asarray(ref.linear.kernel[...]), rtol=1e-5
    )
    # the control: the same metrics without the mask count the 3 padded rows
    blind = fresh()
    blind.update(
        loss=losses_of(model, padded.batch["x"], padded.batch["y"])[0],
        logits=model(padded.batch["x"]),
        labels=padded.batch["y"],
    )
    assert abs(float(blind.compute()["loss"]) - float(np.mean(want_losses))) > 1e-4


def test_a_tutorial_loss_without_a_key_in_the_state_says_to_pass_rng():
    """flax's Dropout error ("no `rngs` argument") becomes one that says what to do."""
    model = TutorialStyle(rngs=nnx.Rngs(0))

    def loss_fn(model, batch, rngs=None):
        return jnp.mean(model(batch["x"], rngs=rngs) ** 2, axis=-1)

    step = jaxdev.make_train_step(jaxdev.nnx.loss(model, loss_fn), SGD, has_state=True)
    params, rest = jaxdev.nnx.split(model)
    state = step.init_state(params, SGD, model_state=rest)  # no rng=
    with pytest.raises(jaxdev.UsageError, match=r"rng=jax\.random\.key\(0\)"):
        step(state, step.put_batch(_batch()))
    # a deterministic view needs no key: the eval step runs
    evaluate = jaxdev.make_eval_step(
        jaxdev.nnx.loss(nnx.view(model, deterministic=True), loss_fn), has_state=True
    )
    assert np.isfinite(evaluate(state, evaluate.put_batch(_batch())).fetch()["loss"])


def _multimetric():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def test_nnx_metrics_update_counts_only_the_real_rows_inside_nnx_jit():
    """A Padded handed whole to an @nnx.jit eval step: exact on 61 rows padded to 64,
    per row and per token (a (B,) row mask over (B, T) values counts tokens)."""
    model = Classifier(rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(61, 3, 8)).astype(np.float32)  # 3 "tokens" per row
    y = rng.integers(0, 4, size=(61, 3)).astype(np.int32)

    @nnx.jit
    def eval_step(model, rows, tokens, padded):
        logits = model(padded.batch["x"])  # (B, 3, 4)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, padded.batch["y"])
        first = {"loss": losses[:, 0], "logits": logits[:, 0], "labels": padded.batch["y"][:, 0]}
        jaxdev.nnx.metrics_update(rows, padded, **first)
        jaxdev.nnx.metrics_update(
            tokens, padded, loss=losses, logits=logits, labels=padded.batch["y"]
        )

    rows, tokens = _multimetric(), _multimetric()
    padded = jaxdev.shard_batch({"x": x, "y": y}, jaxdev.data_mesh(), pad=True)
    assert padded.mask.shape == (64,)
    eval_step(model, rows, tokens, padded)
    logits = np.asarray(model(jnp.asarray(x)))
    losses = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    right = np.argmax(logits, -1) == y
    got_rows, got_tokens = rows.compute(), tokens.compute()
    assert float(got_rows["accuracy"]) == pytest.approx(np.mean(right[:, 0]), abs=1e-7)
    np.testing.assert_allclose(float(got_rows["loss"]), np.mean(losses[:, 0]), rtol=1e-6)
    assert float(got_tokens["accuracy"]) == pytest.approx(np.mean(right), abs=1e-7)
    np.testing.assert_allclose(float(got_tokens["loss"]), np.mean(losses), rtol=1e-6)
    assert int(tokens.loss.count[...]) == 61 * 3  # tokens, not rows


def test_nnx_metrics_update_refuses_what_flaxs_mask_gets_wrong_silently():
    mask = jnp.arange(8) < 5
    losses, labels = jnp.arange(8.0), jnp.zeros(8, jnp.int32)
    logits = jnp.zeros((8, 2))
    # the tutorial's scalar loss.mean(): flax's mask= counts it once per real row
    with pytest.raises(jaxdev.UsageError, match=r"`loss` has shape \(\); .*no `.mean\(\)`"):
        jaxdev.nnx.metrics_update(
            _multimetric(), mask, loss=losses.mean(), logits=logits, labels=labels
        )
    blind = _multimetric()
    blind.update(loss=losses.mean(), logits=logits, labels=labels, mask=mask)
    assert float(blind.compute()["loss"]) == 3.5  # all 8 rows: the silent case refused above
    with pytest.raises(jaxdev.UsageError, match="Welford"):
        jaxdev.nnx.metrics_update(nnx.metrics.Welford(), mask, values=losses)
    with pytest.raises(jaxdev.UsageError, match=r"shape \(2, 4\)"):
        jaxdev.nnx.metrics_update(nnx.metrics.Average(), mask.reshape(2, 4), values=losses)
    with pytest.raises(jaxdev.UsageError, match="different per-element shapes"):
        jaxdev.nnx.metrics_update(
            _multimetric(), mask, loss=losses, logits=jnp.zeros((8, 3, 2)), labels=jnp.zeros((8, 3))
        )
    one = nnx.metrics.Average()  # one metric, and no mask: every row counts
    jaxdev.nnx.metrics_update(one, None, values=losses)
    assert float(one.compute()) == 3.5
    jaxdev.nnx.metrics_update(one, mask, values=losses)
    assert float(one.compute()) == pytest.approx((28 + 10) / 13)


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


class ScanLayers(nnx.Module):
    """Flax's examples/nnx_toy_examples/06_scan_over_layers.py: a dropout key per layer."""

    def __init__(self, *, n_layers: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return Block(rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block):
            return block(x), None

        return scan_fn(x, self.layers)[0]


@pytest.mark.parametrize("with_rng", [False, True], ids=["own-keys", "rng"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_scan_over_layers_with_a_dropout_key_per_layer_trains_with_distinct_rows(name, with_rng):
    """Keys of shape (layers,): the device index is folded into each (was: fold_in's
    ValueError under pmap / shard_map), and ``rng=`` reseeds them all (was: flax's
    "Cannot reseed stream ... non-scalar key" on every strategy)."""
    model = ScanLayers(n_layers=3, rngs=nnx.Rngs(0))
    seen: list[np.ndarray] = []

    def loss_fn(model, batch):
        losses = jnp.mean(model(batch["x"]) ** 2, axis=-1)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), losses)
        return losses

    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(model, loss_fn), SGD, STRATEGIES[name](), has_state=True
    )
    params, rest = jaxdev.nnx.split(model)
    rng = jax.random.key(1) if with_rng else None
    state = step.init_state(params, SGD, rng=rng, model_state=rest)
    state, metrics = step(state, step.put_batch(_batch()))
    assert np.isfinite(metrics.fetch()["loss"])
    jax.effects_barrier()
    losses = np.concatenate(seen)
    assert losses.shape == (ROWS,)
    assert len(np.unique(losses)) == ROWS  # identical rows: every row its own masks
    key = state.model_state["layers"]["dropout"]["rngs"]["key"][...]
    assert key.shape == (3,)


@pytest.mark.parametrize("name", ["pmap", "shard_map"])
def test_with_rng_the_stored_streams_stay_replicated(name):
    """rng= reseeds the module's streams per device for the call; the stored keys are the
    module's own on every device (a replicated state must hold one value)."""
    model = OwnRngs(rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return jnp.mean(model(batch["x"]) ** 2, axis=-1)

    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(model, loss_fn), SGD, STRATEGIES[name](), has_state=True
    )
    params, rest = jaxdev.nnx.split(model)
    before = np.asarray(jax.random.key_data(rest["dropout"]["rngs"]["key"][...]))
    state = step.init_state(params, SGD, rng=jax.random.key(3), model_state=rest)
    state, _ = step(state, step.put_batch(_batch()))
    key = state.model_state["dropout"]["rngs"]["key"][...]
    for shard in key.addressable_shards:
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(shard.data)), before)
