"""step.abstract_state (issue 36): the train state init_state would build, as shapes with
its shardings, nothing allocated; linen and NNX."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxdev

TX = optax.adam(1e-3)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=True)(nn.Dense(256)(x))
        return nn.Dense(4)(x)


def _nnx():
    return nnx.Sequential(
        nnx.Linear(64, 256, rngs=nnx.Rngs(0)), nnx.BatchNorm(256, rngs=nnx.Rngs(0))
    )


def _linen_init():
    return LinenMLP().init(jax.random.key(0), jnp.ones((1, 64)))


STRATEGIES = {
    "fsdp": lambda: jaxdev.Strategy.sharded(jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp"),
    "replicate": lambda: jaxdev.Strategy.sharded(),
    "single": lambda: jaxdev.Strategy.single(),
}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_abstract_state_is_what_init_state_builds_and_nothing_is_allocated(kind, strategy):
    step = jaxdev.make_train_step(lambda *a: 0.0, TX, STRATEGIES[strategy](), has_state=True)
    live = {id(x) for x in jax.live_arrays()}
    abstract = step.abstract_state(_nnx if kind == "nnx" else _linen_init)
    assert {id(x) for x in jax.live_arrays()} <= live  # nothing allocated
    if kind == "nnx":
        params, rest = jaxdev.nnx.split(_nnx())
    else:
        variables = _linen_init()
        params, rest = variables["params"], {"batch_stats": variables["batch_stats"]}
    real = step.init_state(params, model_state=rest)
    got, want = jax.tree.leaves(abstract), jax.tree.leaves(real)
    assert jax.tree.structure(abstract) == jax.tree.structure(jax.eval_shape(lambda: real))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in got) and len(got) == len(want) > 6
    for a, r in zip(got, want):
        assert (a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding), (a, r)
    if strategy == "fsdp":
        assert any("fsdp" in str(x.sharding.spec) for x in got)
    plan = jaxdev.memory.plan(abstract, step=step)  # it plans as the real state does
    assert plan.total == jaxdev.memory.plan(real, step=step).total


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_params_as_a_pytree_and_an_eval_step_give_what_init_state_gives(kind, strategy):
    """A params dict gave "'dict' object is not callable"; an eval step gave a TrainState
    where its init_state gives the params."""
    loss = lambda p, b: b.sum(-1)  # noqa: E731
    s = STRATEGIES[strategy]()
    step = (jaxdev.make_train_step(loss, optax.sgd(0.1), s) if kind == "train"
            else jaxdev.make_eval_step(loss, s))
    params = {"w": jnp.ones((512, 64)), "b": jnp.zeros((64,))}
    real = step.init_state(params)
    for init in (lambda: params, params, jax.eval_shape(lambda: params)):
        abstract = step.abstract_state(init)
        assert jax.tree.structure(abstract) == jax.tree.structure(jax.eval_shape(lambda: real))
        for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
            assert (a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding), (a, r)
    with pytest.raises(jaxdev.UsageError, match="`init_fn` must be a function returning"):
        step.abstract_state({"w": "not an array"})
