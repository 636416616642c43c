"""A train state placed by rules, built where it lives (``TrainStep.init_state`` under
sharded params): params and model state copied into their shardings, the optimizer
state made by ``jax.jit(tx.init)`` directly in the shardings that follow the params.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._errors import UsageError
from .._leaves import is_jax_array
from .._mesh import named_sharding
from .._placement import place_tree
from .._rules import follow_params, param_shardings, state_shardings, unbox
from ..memory import offloaded, state_shapes
from ._strategy import Strategy
from ._train import TrainState


def init_by_rules(strategy: Strategy, params: Any, tx: Any, rng: Any, model_state: Any) -> Any:
    """``init_state`` under sharded params: every leaf built or copied in its sharding."""
    mesh, rules, options = strategy.mesh, strategy.rules, strategy.options
    # boxed linen params: as declared; unboxed ones under "flax": the layout they carry
    # (init_sharded's), never widened to replicated
    shardings = param_shardings(params, mesh, rules, **options)
    leaves = jax.tree.leaves(unbox(params))
    if rules == "flax" and all(
        getattr(getattr(x, "sharding", None), "mesh", None) == mesh for x in leaves
    ):
        shardings = jax.tree.map(lambda x: x.sharding, unbox(params))
    params = _copy(unbox(params), shardings)
    if tx is None and model_state is None and rng is None:
        return _to_host(params, strategy.offload)
    replicated = named_sharding(mesh, P())
    step = _copy(jnp.zeros((), jnp.int32), replicated)
    rng = None if rng is None else _copy(rng, replicated, "rng")
    if model_state is not None:
        shape = state_shapes(TrainState(step, params, None, None, model_state))
        model_state = _copy(
            model_state, state_shardings(shape, mesh, rules, **options).model_state, "model_state"
        )
    opt_state = None
    if tx is not None:
        follow = follow_params(jax.eval_shape(tx.init, params), params, shardings, mesh)
        opt_state = _own_buffers(jax.jit(tx.init, out_shardings=follow)(params), params)
    return _to_host(TrainState(step, params, opt_state, rng, model_state), strategy.offload)


def new_state(strategy: Strategy, params: Any, tx: Any, rng: Any, model_state: Any) -> Any:
    """A new train state (or params, without ``tx``, ``rng`` and ``model_state``), placed."""
    if strategy.by_rules:
        return init_by_rules(strategy, params, tx, rng, model_state)
    if tx is not None:
        state = TrainState.create(params, tx, rng, model_state)
    elif model_state is not None or rng is not None:
        state = TrainState(jnp.zeros((), jnp.int32), params, None, rng, model_state)
    else:
        state = params
    return strategy.place_state(state)


def is_state(tree: Any) -> bool:
    """A whole train state (jaxdev's or flax's ``TrainState``), not params."""
    return all(hasattr(tree, f) for f in ("step", "params", "opt_state"))


def check_tx(step_tx: Any, tx: Any, params: Any, opt_state: Any = None) -> None:
    """Refuse a ``tx`` or ``opt_state`` whose structure is not ``step_tx.init(params)``'s."""
    if step_tx is None or (tx is None and opt_state is None) or tx is step_tx:
        return
    want = jax.tree.structure(jax.eval_shape(step_tx.init, state_shapes(params)))
    got = opt_state if tx is None else jax.eval_shape(tx.init, state_shapes(params))
    if jax.tree.structure(got) != want:
        what = "the state's `opt_state`" if tx is None else "`tx`"
        raise UsageError(
            f"{what} does not match the step's optimizer: the step updates with the `tx` given "
            f"to `make_train_step`, whose state is {_describe(want)}, but {what} makes "
            f"{_describe(jax.tree.structure(got))}. Build the state with the step's own `tx` "
            "(`step.init_state(params)` uses it) or make the step with this one."
        )


def _describe(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 160 else text[:157] + "..."


def _to_host(state: Any, fields: tuple[str, ...]) -> Any:
    """``state`` with the offloaded ``fields`` moved to host memory (the device copies freed)."""
    if not fields:
        return state
    layout = offloaded(jax.tree.map(lambda x: x.sharding, state), state, fields)
    if not isinstance(state, TrainState):  # bare params
        return jax.device_put(state, layout)  # the device copies go with the last reference
    return state._replace(
        **{f: jax.device_put(getattr(state, f), getattr(layout, f)) for f in fields}
    )


def _copy(tree: Any, shardings: Any, arg: str = "params") -> Any:
    """``tree`` copied into new buffers laid out by ``shardings`` (the placement engine)."""
    return place_tree(tree, shardings, copy=True, arg=arg)


def _own_buffers(tree: Any, others: Any) -> Any:
    """``tree`` with leaves shared with ``others`` (or itself) copied: XLA crashes donating
    one buffer twice (``tx.init`` may return the params: lookahead's slow weights)."""
    seen = {id(x) for x in jax.tree.leaves(others)}

    def own(x: Any) -> Any:
        if is_jax_array(x) and id(x) in seen:
            x = jax.device_put(x, x.sharding, may_alias=False)
        seen.add(id(x))
        return x

    return jax.tree.map(own, tree)


__all__ = ["check_tx", "is_state", "new_state"]
