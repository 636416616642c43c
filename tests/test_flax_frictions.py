"""Flax code as people write it: frictions that used to end in bare errors (issue 26)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxdev

SGD = optax.sgd(0.1)


def _loss(p, b):
    return (b["x"] @ p["w"] - b["y"]) ** 2


def _batch():
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.float32([1, -2, 0.5])}


def _flax_state(tx=SGD):  # as Flax's examples build it (seq2seq's create_train_state)
    return train_state.TrainState.create(
        apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.zeros(3)}, tx=tx
    )


def _reference(steps):  # flax's own step: apply_gradients of the mean loss
    state, batch = _flax_state(), _batch()
    for _ in range(steps):
        grads = jax.grad(lambda p: _loss(p, batch).mean())(state.params)
        state = state.apply_gradients(grads=grads)
    return state


STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(),
    "sharded": lambda: jaxdev.Strategy.sharded(jaxdev.data_mesh()),
    "fsdp": lambda: jaxdev.Strategy.sharded(
        jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp", min_size=0
    ),
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_init_state_takes_a_flax_train_state_as_the_state(name):
    step = jaxdev.make_train_step(_loss, SGD, STRATEGIES[name]())
    state = step.init_state(_flax_state(), SGD)  # was: the whole state became the params
    assert isinstance(state, train_state.TrainState)
    for _ in range(3):
        state, metrics = step(state, step.put_batch(_batch()))
    want = _reference(3)
    assert int(state.step) == 3
    np.testing.assert_allclose(np.asarray(state.params["w"]), want.params["w"], rtol=1e-6)
    assert np.isfinite(metrics.fetch()["loss"])


def test_a_state_or_tx_the_steps_optimizer_cannot_update_is_refused():
    step = jaxdev.make_train_step(_loss, SGD)
    with pytest.raises(jaxdev.UsageError, match="`tx` does not match the step's optimizer"):
        step.init_state({"w": jnp.zeros(3)}, optax.adam(0.1))  # was: trained adam's state by sgd
    with pytest.raises(jaxdev.UsageError, match="the state's `opt_state` does not match"):
        step.init_state(_flax_state(optax.adam(0.1)))
    with pytest.raises(jaxdev.UsageError, match="`rng` was given with a whole TrainState"):
        step.init_state(_flax_state(), rng=jax.random.key(0))
    state = step.init_state({"w": jnp.zeros(3)})  # no tx: the step's own
    assert isinstance(state, jaxdev.TrainState) and state.opt_state is not None
    assert step.init_state({"w": jnp.zeros(3)}, optax.sgd(0.5)).opt_state is not None  # same shape


def _loss_rng(p, b, rng):
    return _loss(p, b) * jax.random.bernoulli(rng, 0.9, (b["x"].shape[0],))


def test_an_rng_loss_with_a_state_without_a_key_says_where_the_key_goes():
    step = jaxdev.make_train_step(_loss_rng, SGD)
    with pytest.raises(jaxdev.UsageError, match="takes an `rng` argument.*subclass it"):
        step(step.init_state(_flax_state()), step.put_batch(_batch()))  # was: missing 'rng'

    class RngState(train_state.TrainState):
        rng: jax.Array

    state = RngState.create(
        apply_fn=None, params={"w": jnp.zeros(3)}, tx=SGD, rng=jax.random.key(0)
    )
    state, metrics = step(step.init_state(state), step.put_batch(_batch()))
    assert isinstance(state, RngState) and np.isfinite(metrics.fetch()["loss"])
