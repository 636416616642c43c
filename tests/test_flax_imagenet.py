"""jaxdev's step against flax's own imagenet ``train_step``, written the way flax writes it.

``examples/flax_imagenet_step.py`` holds the tiny ResNet (flax's block
structure, BatchNorm with momentum 0.9). The reference below is flax's
``examples/imagenet/train.py`` pattern: ``jax.pmap`` with ``axis_name='batch'``,
``lax.pmean`` of the gradients, the weight penalty added inside the loss,
``batch_stats`` from ``mutable=['batch_stats']`` and ``sync_batch_stats``
(a cross-replica mean) before reading them. Optimizer: SGD with Nesterov
momentum (scale-sensitive, as flax's example uses). After 10 steps params
and batch statistics agree to ``atol=rtol=1e-4`` (float32 convolutions
reduced in a different order on 8 devices).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO
from flax import jax_utils
from flax.training import common_utils, train_state
from jax import lax

import jaxdev

_spec = importlib.util.spec_from_file_location(
    "flax_imagenet_step", os.path.join(REPO, "examples", "flax_imagenet_step.py")
)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

STEPS, BATCH = 10, 32
TOL = dict(atol=1e-4, rtol=1e-4)


class TrainState(train_state.TrainState):
    batch_stats: Any


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=ex.NUM_CLASSES)
    xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
    return jnp.mean(xentropy)


def flax_train_step(state, batch, learning_rate_fn):
    """flax/examples/imagenet/train.py's train_step (dynamic scale off)."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = ex.WEIGHT_DECAY
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (new_model_state, logits)

    lr = learning_rate_fn(state.step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    aux, grads = grad_fn(state.params)
    grads = lax.pmean(grads, axis_name="batch")
    new_model_state, logits = aux[1]
    metrics = {"learning_rate": lr}
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


cross_replica_mean = jax.pmap(lambda x: lax.pmean(x, "x"), "x")


def sync_batch_stats(state):
    return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


def _tx():
    return optax.sgd(ex.learning_rate_fn, momentum=0.9, nesterov=True)


def _init():
    return ex.TinyResNet().init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)


def _batches():
    data = ex.make_data(STEPS * BATCH)
    return [{k: v[i : i + BATCH] for k, v in data.items()} for i in range(0, STEPS * BATCH, BATCH)]


def flax_reference(axis_name):
    model = ex.TinyResNet(axis_name=axis_name)
    variables = _init()
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=_tx(),
        batch_stats=variables["batch_stats"],
    )
    state = jax_utils.replicate(state)
    p_train_step = jax.pmap(
        functools.partial(flax_train_step, learning_rate_fn=ex.learning_rate_fn),
        axis_name="batch",
    )
    for batch in _batches():
        state, metrics = p_train_step(state, common_utils.shard(batch))
    state = sync_batch_stats(state)
    one = jax_utils.unreplicate(state)
    return one.params, one.batch_stats, float(jax_utils.unreplicate(metrics)["learning_rate"])


def jaxdev_run(strategy, axis_name):
    model = ex.TinyResNet(axis_name=axis_name)
    variables = _init()
    step = jaxdev.make_train_step(
        ex.make_loss(model),
        _tx(),
        strategy,
        has_aux=True,
        has_state=True,
        regularizer=ex.weight_penalty,
        lr_fn=ex.learning_rate_fn,
    )
    state = step.init_state(
        variables["params"], _tx(), model_state={"batch_stats": variables["batch_stats"]}
    )
    metrics = None
    for batch in _batches():
        state, metrics = step(state, step.put_batch(batch), metrics)
    return state.params, state.model_state["batch_stats"], metrics.fetch()["lr"]


def assert_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL), a, b)


@pytest.fixture(scope="module")
def per_device_bn_reference():
    return flax_reference(axis_name=None)


@pytest.fixture(scope="module")
def global_bn_reference():
    return flax_reference(axis_name="batch")


@pytest.mark.slow
@pytest.mark.parametrize("shard_map", [False, True], ids=["pmap", "shard_map"])
def test_flax_pattern_with_per_device_batchnorm(per_device_bn_reference, shard_map):
    """Flax's model as written (BatchNorm without axis_name): statistics per device."""
    strategy = jaxdev.Strategy.sharded(shard_map=True) if shard_map else jaxdev.Strategy.pmap()
    params, stats, lr = jaxdev_run(strategy, axis_name=None)
    ref_params, ref_stats, ref_lr = per_device_bn_reference
    assert_close(params, ref_params)
    assert_close(stats, ref_stats)
    np.testing.assert_allclose(lr, ref_lr, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["single", "pmap", "sharded", "shard_map"])
def test_one_model_definition_gives_global_batchnorm_on_every_strategy(global_bn_reference, name):
    """``axis_name=strategy.collective_axis``: global statistics everywhere, same numbers."""
    strategy = {
        "single": jaxdev.Strategy.single,
        "pmap": jaxdev.Strategy.pmap,
        "sharded": jaxdev.Strategy.sharded,
        "shard_map": functools.partial(jaxdev.Strategy.sharded, shard_map=True),
    }[name]()
    params, stats, _ = jaxdev_run(strategy, axis_name=strategy.collective_axis)
    ref_params, ref_stats, _ = global_bn_reference
    assert_close(params, ref_params)
    assert_close(stats, ref_stats)
