"""Flax CNNs through jaxdev's step, against flax's own hand-written steps.

(a) flax's ``examples/mnist`` linen ``CNN`` and its ``apply_model`` /
``update_model`` pair (``@jax.jit``, ``state.apply_gradients`` on a
``flax.training.train_state.TrainState``), against ``make_train_step`` with
the same loss returned per example, on sklearn digits padded to 28x28:
after 5 steps of SGD with momentum (flax's config: lr 0.1, momentum 0.9)
params agree to ``atol=rtol=1e-5`` and each step's loss to ``rtol=1e-5``
under ``Strategy.sharded`` and ``Strategy.pmap`` (8 devices sum per-device
gradients where flax takes one mean: float32 reassociation only).

(b) the NNX CNN of ``examples/flax_nnx_cnn.py`` (BatchNorm + Dropout) through
``jaxdev.nnx.split`` / ``nnx_loss`` / ``nnx_update``: with dropout 0,
``Strategy.sharded`` and ``Strategy.pmap`` give the params and batch
statistics of ``Strategy.single`` after 3 plain-SGD steps
(``atol=rtol=1e-5``) and ``nnx_update`` writes both into the module; with
dropout 0.5 and an ``rng`` the rows on different devices, and consecutive
steps, draw different masks.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO
from flax import nnx
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxdev

_spec = importlib.util.spec_from_file_location(
    "flax_nnx_cnn", os.path.join(REPO, "examples", "flax_nnx_cnn.py")
)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

TOL = dict(atol=1e-5, rtol=1e-5)
MNIST_STEPS, MNIST_BATCH = 5, 32
NNX_STEPS, NNX_BATCH = 3, 64

STRATEGIES = {
    "single": jaxdev.Strategy.single,
    "pmap": jaxdev.Strategy.pmap,
    "sharded": jaxdev.Strategy.sharded,
}


def assert_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL), a, b)


# ---------------------------------------------------------------- (a) flax's mnist CNN


class CNN(nn.Module):
    """A simple CNN model (flax examples/mnist/train.py)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


@jax.jit
def apply_model(state, images, labels):
    """Computes gradients, loss and accuracy for a single batch (flax's mnist)."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, loss, accuracy


@jax.jit
def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def mnist_tx():
    return optax.sgd(0.1, 0.9)  # flax's mnist config: learning_rate 0.1, momentum 0.9


def mnist_params():
    return CNN().init(jax.random.key(0), jnp.ones([1, 28, 28, 1]))["params"]


def mnist_batches():
    """Digits 8x8 scaled to [0, 1] and zero-padded to MNIST's 28x28x1."""
    digits = load_digits()
    n = MNIST_STEPS * MNIST_BATCH
    images = np.pad(digits.images[:n] / 16.0, ((0, 0), (10, 10), (10, 10)))
    images = images.astype(np.float32)[..., None]
    labels = digits.target[:n].astype(np.int32)
    return [
        {"image": images[i : i + MNIST_BATCH], "label": labels[i : i + MNIST_BATCH]}
        for i in range(0, n, MNIST_BATCH)
    ]


def mnist_loss(params, batch):
    """flax's loss_fn, per example (no mean): jaxdev averages over the valid rows."""
    logits = CNN().apply({"params": params}, batch["image"])
    one_hot = jax.nn.one_hot(batch["label"], 10)
    losses = optax.softmax_cross_entropy(logits=logits, labels=one_hot)
    return losses, {"accuracy": jaxdev.metrics.Accuracy.from_logits(logits, batch["label"])}


@pytest.fixture(scope="module")
def mnist_reference():
    state = train_state.TrainState.create(
        apply_fn=CNN().apply, params=mnist_params(), tx=mnist_tx()
    )
    losses, accuracies = [], []
    for batch in mnist_batches():
        grads, loss, accuracy = apply_model(state, batch["image"], batch["label"])
        state = update_model(state, grads)
        losses.append(float(loss))
        accuracies.append(float(accuracy))
    return state.params, losses, accuracies


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded", "pmap"])
def test_flax_mnist_cnn_matches_flax_train_step(mnist_reference, name):
    step = jaxdev.make_train_step(mnist_loss, mnist_tx(), STRATEGIES[name](), has_aux=True)
    state = step.init_state(mnist_params(), mnist_tx())
    losses, accuracies = [], []
    for batch in mnist_batches():
        state, metrics = step(state, step.put_batch(batch))
        fetched = metrics.fetch()
        losses.append(fetched["loss"])
        accuracies.append(fetched["accuracy"])
    ref_params, ref_losses, ref_accuracies = mnist_reference
    assert int(state.step) == MNIST_STEPS
    assert ref_losses[-1] < ref_losses[0]  # it learns: the comparison is not of a stuck run
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(accuracies, ref_accuracies, atol=1e-6)
    assert_close(state.params, ref_params)


# ---------------------------------------------------------------- (b) the NNX CNN


@functools.lru_cache(maxsize=1)
def digits_train():
    return ex.load_data()[0]


def nnx_data(n: int = NNX_BATCH * NNX_STEPS):
    return {k: v[:n] for k, v in digits_train().items()}


def nnx_sgd_run(name: str, dropout: float, lr: float, data, steps: int, rng=None, aux_fn=None):
    """Train a fresh NNX CNN for ``steps`` steps on consecutive rows of ``data``."""
    strategy = STRATEGIES[name]()
    model = ex.CNN(dropout=dropout, axis_name=strategy.collective_axis, rngs=nnx.Rngs(0))
    tx = optax.sgd(lr)
    loss = jaxdev.nnx.loss(model, aux_fn or ex.train_loss)
    step = jaxdev.make_train_step(loss, tx, strategy, has_state=True, has_aux=True)
    params, model_state = jaxdev.nnx.split(model)
    state = step.init_state(params, tx, rng=rng, model_state=model_state)
    rows = len(data["label"]) // steps
    history = []
    for i in range(steps):
        batch = {k: v[i * rows : (i + 1) * rows] for k, v in data.items()}
        state, metrics = step(state, step.put_batch(batch))
        history.append(metrics.fetch())
    return model, state, history


def batch_stats(tree):
    return {k: tree[k] for k in ("bn1", "bn2")}


@pytest.fixture(scope="module")
def nnx_single():
    return nnx_sgd_run("single", 0.0, 0.05, nnx_data(), NNX_STEPS, rng=jax.random.key(1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded", "pmap"])
def test_nnx_cnn_strategies_agree_without_dropout(nnx_single, name):
    _, ref, ref_history = nnx_single
    model, state, history = nnx_sgd_run(
        name, 0.0, 0.05, nnx_data(), NNX_STEPS, rng=jax.random.key(1)
    )
    assert int(state.step) == NNX_STEPS
    assert_close(state.params, ref.params)
    assert_close(batch_stats(state.model_state), batch_stats(ref.model_state))
    np.testing.assert_allclose(
        [h["loss"] for h in history], [h["loss"] for h in ref_history], rtol=1e-5
    )
    # The batch statistics moved off their initial values (zeros / ones) ...
    assert not np.allclose(state.model_state["bn1"]["mean"][...], 0.0)
    assert not np.allclose(state.model_state["bn2"]["var"][...], 1.0)
    # ... and nnx_update writes params and batch statistics into the module.
    assert np.allclose(model.bn1.mean[...], 0.0)  # untouched until then
    jaxdev.nnx.update(model, state)
    assert_close(nnx.state(model, nnx.Param), state.params)
    assert_close(batch_stats(nnx.state(model, nnx.BatchStat)), batch_stats(state.model_state))
    assert_close(model.bn2.var[...], ref.model_state["bn2"]["var"][...])


def loss_spread(model, batch):
    """ex.train_loss plus the smallest and largest per-example loss of the batch."""
    losses, aux = ex.train_loss(model, batch)
    spread = {
        "min": jaxdev.metrics.Min.from_value(losses),
        "max": jaxdev.metrics.Max.from_value(losses),
    }
    return losses, {**aux, **spread}


def identical_rows(n_rows: int, steps: int):
    """``steps`` batches of one digit repeated ``n_rows`` times (one row per device)."""
    one = {k: v[:1] for k, v in nnx_data().items()}
    return {k: np.repeat(v, n_rows * steps, axis=0) for k, v in one.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pmap", "sharded"])
def test_nnx_dropout_draws_per_device_and_per_step(name):
    """Learning rate 0: the loss varies only through the dropout masks.

    8 identical rows, one per device: different losses within a step mean
    the devices drew different masks; a different mean loss on the next step
    (same params, same rows) means a new mask per step.
    """
    n = jax.device_count()
    _, _, history = nnx_sgd_run(
        name, 0.5, 0.0, identical_rows(n, 2), 2, rng=jax.random.key(1), aux_fn=loss_spread
    )
    for h in history:
        assert h["max"] - h["min"] > 1e-3, history
    assert abs(history[0]["loss"] - history[1]["loss"]) > 1e-4, history


@pytest.mark.slow
def test_nnx_dropout_without_rng_draws_per_device_masks():
    """No ``rng`` in the state: the module's own key, with the device index folded in
    under pmap (issue 19; before, every device repeated one mask)."""
    n = jax.device_count()
    _, _, history = nnx_sgd_run("pmap", 0.5, 0.0, identical_rows(n, 1), 1, aux_fn=loss_spread)
    assert history[0]["max"] > history[0]["min"] * (1 + 1e-3)
