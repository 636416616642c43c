"""Flax code as people write it: frictions that used to end in bare errors (issue 26)."""

from __future__ import annotations

import gc

import flax.linen as nn
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
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    return {"x": x, "y": x @ np.float32([1, -2, 0.5, 0.25])}


def _flax_state(tx=SGD):  # as Flax's examples build it (seq2seq's create_train_state)
    return train_state.TrainState.create(
        apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.zeros(4)}, tx=tx
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
        step.init_state({"w": jnp.zeros(4)}, optax.adam(0.1))  # was: trained adam's state by sgd
    with pytest.raises(jaxdev.UsageError, match="the state's `opt_state` does not match"):
        step.init_state(_flax_state(optax.adam(0.1)))
    with pytest.raises(jaxdev.UsageError, match="`rng` was given with a whole TrainState"):
        step.init_state(_flax_state(), rng=jax.random.key(0))
    state = step.init_state({"w": jnp.zeros(4)})  # no tx: the step's own
    assert isinstance(state, jaxdev.TrainState) and state.opt_state is not None
    assert step.init_state({"w": jnp.zeros(4)}, optax.sgd(0.5)).opt_state is not None  # same shape


def _loss_rng(p, b, rng):
    return _loss(p, b) * jax.random.bernoulli(rng, 0.9, (b["x"].shape[0],))


def test_an_rng_loss_with_a_state_without_a_key_says_where_the_key_goes():
    step = jaxdev.make_train_step(_loss_rng, SGD)
    with pytest.raises(jaxdev.UsageError, match="takes an `rng` argument.*subclass it"):
        step(step.init_state(_flax_state()), step.put_batch(_batch()))  # was: missing 'rng'

    class RngState(train_state.TrainState):
        rng: jax.Array

    state = RngState.create(
        apply_fn=None, params={"w": jnp.zeros(4)}, tx=SGD, rng=jax.random.key(0)
    )
    state, metrics = step(step.init_state(state), step.put_batch(_batch()))
    assert isinstance(state, RngState) and np.isfinite(metrics.fetch()["loss"])


def test_metrics_passed_to_the_next_step_stay_readable_and_deleted_ones_are_named():
    """The step donates the state, never the metrics: a step late, the last call's metrics
    are read while the next call runs (was: donated, `first.fetch()` DeletedArrayError)."""
    step = jaxdev.make_train_step(_loss, SGD)
    state = step.init_state({"w": jnp.zeros(4)})
    state, first = step(state, step.put_batch(_batch()))
    before = first.fetch()
    state, running = step(state, step.put_batch(_batch()), first)
    assert first.fetch() == before  # untouched by the call that merged it
    assert jax.tree.leaves(running)[1] == 2 * jax.tree.leaves(first)[1]  # counted twice
    jax.tree.leaves(first)[0].delete()
    with pytest.raises(jaxdev.DeletedArrayError, match="`metrics` has .* deleted or donated"):
        first.fetch()  # was: bare RuntimeError 'Array has been deleted'


class _BatchNormed(nn.Module):
    axis_name: str | None = "batch"  # as Flax's imagenet writes it, for its pmap axis 'batch'

    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x).sum(-1)


@pytest.mark.parametrize("name", ["pmap", "sharded"])
def test_a_collective_axis_the_step_does_not_have_is_named_with_the_axes(name):
    model = _BatchNormed()
    x = _batch()["x"]
    variables = model.init(jax.random.key(0), x)

    def loss_fn(p, ms, b):
        y, new = model.apply({"params": p, **ms}, b["x"], mutable=["batch_stats"])
        return (y - b["y"]) ** 2, new

    step = jaxdev.make_train_step(loss_fn, SGD, STRATEGIES[name](), has_state=True)
    state = step.init_state(
        variables.get("params", {}), model_state={"batch_stats": variables["batch_stats"]}
    )
    axis = step.strategy.collective_axis
    with pytest.raises(
        jaxdev.UsageError, match=f"unbound axis name: batch.*device axis is {axis!r}"
    ):
        step(state, step.put_batch(_batch()))  # was: flax's bare NameError


@pytest.mark.parametrize("name", ["pmap", "sharded", "accumulate"])
def test_the_step_says_once_when_its_keys_are_not_a_plain_jit_steps(name, caplog):
    strategy = STRATEGIES["single" if name == "accumulate" else name]()
    kw = {"accumulate": 2} if name == "accumulate" else {}
    step = jaxdev.make_train_step(_loss_rng, SGD, strategy, **kw)
    state = step.init_state({"w": jnp.zeros(4)}, rng=jax.random.key(0))
    with caplog.at_level("WARNING", logger="jaxdev"):
        for _ in range(2):
            state, _ = step(state, step.put_batch(_batch()))
    told = [r.getMessage() for r in caplog.records if "keys differ" in r.getMessage()]
    if name == "sharded":  # jit over the whole batch: Flax's keys, nothing to say
        assert told == []
    else:
        assert len(told) == 1 and ("device index" in told[0] or "accumulate=2" in told[0])
        assert "Strategy.single()" in told[0]


def test_a_step_built_from_another_steps_spec_says_so_too(caplog):
    """A step made by ``spec.replace(...)`` (what fit_memory's ``fit.step`` and the memory
    options are) shared its parent's once-a-step flag (a field copied by
    ``dataclasses.replace``): after its parent warned, it said nothing (attack on 8198f46).
    And ``explain_memory(remat=<a step that warned>)`` raised TypeError (the flag, kept in
    the config's ``__dict__``, was passed back as an option)."""
    step = jaxdev.make_train_step(_loss_rng, SGD, accumulate=2)
    with caplog.at_level("WARNING", logger="jaxdev"):
        for made in (step, step.spec.replace(accumulate=4).step()):
            state = made.init_state({"w": jnp.zeros(4)}, rng=jax.random.key(0))
            made(state, made.put_batch(_batch()))
    told = [r.getMessage() for r in caplog.records if "keys differ" in r.getMessage()]
    assert len(told) == 2 and "accumulate=4" in told[1], told
    fresh = jaxdev.make_train_step(_loss_rng, SGD)  # the model's own remat: the step above
    batch = fresh.put_batch(_batch())
    got = jaxdev.memory.explain_memory(fresh, state, batch, options=("remat",), remat=step)
    assert "the model's own remat" in str(got)


def test_each_new_step_says_so_even_at_a_freed_steps_address(caplog):
    seen, told = set(), 0  # a freed step's config address given to a new one skipped its warning
    gc.collect()
    gc.freeze()  # the suite's objects: each collect below walks only this loop's steps
    try:
        with caplog.at_level("WARNING", logger="jaxdev"):
            for _ in range(200):  # an address is reused within a few steps, as a rule
                step = jaxdev.make_train_step(_loss_rng, SGD, accumulate=2)
                state = step.init_state({"w": jnp.zeros(4)}, rng=jax.random.key(0))
                # the warning is given when jax traces the step's body: lowering traces it
                # as a call does, without XLA's compile (a call's cost, ~5x, each new step)
                step.lower(state, step.put_batch(_batch()))
                told += 1
                if (reused := id(step.config) in seen):
                    break
                seen.add(id(step.config))
                del step, state
                gc.collect()
    finally:
        gc.unfreeze()
    assert reused, "no address was reused: the test shows nothing"
    assert sum("keys differ" in r.getMessage() for r in caplog.records) == told
