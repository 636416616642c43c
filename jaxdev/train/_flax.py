"""Flax NNX modules in jaxdev's step: split once, train the state, write it back.

:func:`nnx_split` gives a module's ``nnx.Param`` s and the rest (its ``model_state``);
:func:`nnx_loss` turns ``loss_fn(model, batch)`` into the step's ``has_state`` contract;
:func:`nnx_update` writes a trained :class:`TrainState` back. With an ``rng`` in the
state every RNG stream is reseeded from the step's key (per step, per device); without
one, a module's own streams draw with the device index folded in for the call only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .._errors import UsageError
from .._placement import as_sharding
from .._rules import unbox
from ._metrics import ambient_value
from ._train import TrainState


def _check_module(model: Any, name: str) -> None:
    if not isinstance(model, nnx.Module):
        raise UsageError(f"`{name}` must be a flax.nnx.Module, got {type(model).__name__}.")


def nnx_split(model: nnx.Module) -> tuple[nnx.State, nnx.State]:
    """Return ``(params, model_state)`` of an NNX module: its ``nnx.Param`` s and the rest.

    Example:
      >>> from flax import nnx
      >>> import jaxdev
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.BatchNorm(3, rngs=rngs))
      >>> params, model_state = jaxdev.nnx.split(model)
      >>> sorted(model_state["layers"][1].keys())
      ['mean', 'var']
    """
    _check_module(model, "model")
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return params, rest


def nnx_loss(model: nnx.Module, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``loss_fn(model, batch, **kw)`` for ``make_train_step(..., has_state=True)``.

    The result takes ``(params, model_state, batch[, rng], **kw)``, merges a module, calls
    ``loss_fn`` and returns its results followed by the module's new non-``Param`` state;
    the same wrapper serves :func:`jaxdev.make_eval_step`. A ``loss_fn`` with an ``rngs``
    parameter gets ``nnx.Rngs`` of the step's key (``None`` in eval steps).

    Raises:
      UsageError: (when the step runs) ``loss_fn`` takes ``rngs``, the state has no
        ``rng``, and flax's ``Dropout`` found no key.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxdev
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> loss = jaxdev.nnx.loss(model, lambda m, b: (m(b["x"])[:, 0] - b["y"]) ** 2)
      >>> step = jaxdev.make_train_step(loss, optax.sgd(0.1), has_state=True)
      >>> params, model_state = jaxdev.nnx.split(model)
      >>> state = step.init_state(params, optax.sgd(0.1), model_state=model_state)
      >>> batch = {"x": np.ones((4, 2), np.float32), "y": np.zeros(4, np.float32)}
      >>> state, metrics = step(state, step.put_batch(batch))
      >>> jaxdev.nnx.update(model, state)
      >>> bool(jnp.allclose(model.kernel[...], state.params["kernel"][...]))
      True
    """
    _check_module(model, "model")
    graphdef = nnx.graphdef(model)
    nodes = (node for _, node in nnx.iter_graph(model))
    streams = sorted({node.tag for node in nodes if isinstance(node, nnx.RngStream)})
    try:  # a parameter named `rngs`: the NNX tutorial's loss_fn takes keys at call time
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    takes_rngs = any(p.name == "rngs" and p.kind is not p.VAR_KEYWORD for p in params)

    def wrapped(params, model_state, batch, rng=None, **kwargs):
        # copy=True: fresh variables, so the forward pass may update them inside jax.grad.
        module = nnx.merge(graphdef, params, model_state, copy=True)
        saved = [  # every stream's key, put back after the call: the stored state stays
            (n.key, n.key[...]) for _, n in nnx.iter_graph(module) if isinstance(n, nnx.RngStream)
        ]
        if rng is not None and streams:  # replicated although each device drew its own keys
            keys = jax.random.split(rng, len(streams))
            # match_shape: a stream with a key per layer (nnx.vmap / scan over layers) gets
            # one key per layer split from the step's key (flax's default policy raises)
            nnx.reseed(module, policy="match_shape", **dict(zip(streams, keys)))
        if rng is not None and takes_rngs:
            kwargs["rngs"] = nnx.Rngs(jax.random.fold_in(rng, len(streams)))
        axis = ambient_value("axis")  # the device axis of the step's body
        if rng is None and axis is not None:  # this device's index in every key (one per layer)
            fold_in = jax.vmap(jax.random.fold_in, in_axes=(0, None))
            for key_var, key in saved:
                key_var[...] = fold_in(key.reshape(-1), jax.lax.axis_index(axis)).reshape(key.shape)
        try:
            out = loss_fn(module, batch, **kwargs)
        except ValueError as err:
            if takes_rngs and rng is None and "no `rngs`" in str(err):
                raise UsageError(_NO_KEY) from err
            raise
        for key_var, key in saved:  # the stored streams stay equal on every device
            key_var[...] = key
        _, _, new_state = nnx.split(module, nnx.Param, ...)
        return (*out, new_state) if isinstance(out, tuple) else (out, new_state)

    return wrapped


_NO_KEY = (
    "`loss_fn` takes `rngs` (keys at call time, the NNX tutorial's style) but the state has "
    "no `rng`, so `nnx_loss` had no key to give it and flax's Dropout found none. Train "
    "with one: `step.init_state(params, tx, rng=jax.random.key(0), model_state=...)`; "
    "evaluate a deterministic view: `nnx.view(model, deterministic=True, "
    "use_running_average=True)`."
)


def nnx_update(model: nnx.Module, state: Any) -> None:
    """Write a trained state's ``params`` and ``model_state`` back into ``model`` (in place).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxdev
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> params, rest = jaxdev.nnx.split(model)
      >>> zeros = jax.tree.map(jnp.zeros_like, params)
      >>> state = jaxdev.TrainState.create(zeros, optax.sgd(0.1), model_state=rest)
      >>> jaxdev.nnx.update(model, state)
      >>> float(model.kernel[...].sum())
      0.0
    """
    _check_module(model, "model")
    parts = [state.params] + ([state.model_state] if state.model_state is not None else [])
    nnx.update(model, *parts)


def nnx_metrics_update(metrics: nnx.Metric, mask: Any, **values: Any) -> None:
    """``metrics.update(**values)`` counting only the real rows of a padded batch.

    For ``nnx.MultiMetric`` loops fed by ``jaxdev.shard_batch(..., pad=True)``; inside or
    outside ``nnx.jit``. Stricter than flax's ``mask=``: every value needs one entry per
    row (no ``.mean()``), the mask is broadcast to the values' per-element shape, and a
    metric other than ``Average`` / ``Accuracy`` is refused.

    Args:
      metrics: an ``nnx.MultiMetric``, or one ``Average`` / ``Accuracy``, updated in place.
      mask: a :class:`jaxdev.Padded`, a boolean array with one entry per row, or ``None``.
      **values: what ``metrics.update`` takes, one entry per row.

    Raises:
      UsageError: a value without one entry per row, mismatched per-element shapes, a
        mask not one per row, or a metric that cannot leave rows out.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jaxdev
      >>> from flax import nnx
      >>> metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
      ...                           loss=nnx.metrics.Average("loss"))
      >>> padded = jaxdev.shard_batch({"y": np.arange(5) % 2}, jaxdev.data_mesh(), pad=True)
      >>> logits = jnp.stack([jnp.zeros(8), jnp.ones(8)], -1)  # predicts 1 for every row
      >>> jaxdev.nnx.metrics_update(metrics, padded, loss=jnp.arange(8.0), logits=logits,
      ...                           labels=padded.batch["y"])
      >>> {k: round(float(v), 3) for k, v in metrics.compute().items()}  # rows 0..4 only
      {'accuracy': 0.4, 'loss': 2.0}
    """
    mask = getattr(mask, "mask", mask)  # a Padded
    if mask is None:
        metrics.update(**values)
        return
    if jnp.ndim(mask) != 1:
        raise UsageError(
            f"`mask` must have one entry per row, shape (rows,), got shape {jnp.shape(mask)} "
            "(the pmap layout?): give the batch laid out by `jaxdev.shard_batch`, or flatten "
            "both with `jaxdev.pmap.unshard_from_pmap`."
        )
    names = getattr(metrics, "_metric_names", None)  # nnx.MultiMetric's sub-metrics
    parts = {n: getattr(metrics, n) for n in names} if names is not None else {"": metrics}
    bad = [
        f"{n or 'metrics'}: {type(m).__name__}"
        for n, m in parts.items()
        if not isinstance(m, nnx.metrics.Average)
    ]
    if bad:
        raise UsageError(
            "`metrics` can leave padded rows out only through nnx.metrics.Average and its "
            f"subclasses (Accuracy); these would count them: {', '.join(bad)}. Update them "
            "with the real rows only (`jaxdev.unpad`), outside the masked call."
        )
    rows = jnp.shape(mask)[0]
    shapes = {name: jnp.shape(v) for name, v in values.items()}
    for name, s in shapes.items():
        if not s or s[0] != rows:
            raise UsageError(
                f"`{name}` has shape {s}; with a mask every value needs one entry per row, "
                f"shape ({rows}, ...). A scalar (a batch mean: `loss.mean()`) already counts "
                "the padded rows: pass per-example values (no `.mean()`)."
            )
    shape = min(shapes.values(), key=len)  # per element (logits may add one axis)
    odd = {n: s for n, s in shapes.items() if s != shape and s[:-1] != shape}
    if odd:
        raise UsageError(
            f"values of different per-element shapes: {shapes}; each must be {shape} (or, "
            "for logits, one more axis). Update the metrics of each shape in its own call."
        )
    row = jnp.reshape(jnp.asarray(mask, bool), (-1,) + (1,) * (len(shape) - 1))
    metrics.update(**values, mask=jnp.broadcast_to(row, shape))


def abstract_state(init_fn: Any, *args: Any, step: Any, rng: Any = None) -> Any:
    """``step.abstract_state(init_fn, *args, rng=rng)``: ``init_fn(*args)`` (or an NNX
    module) traced as :func:`jaxdev.init_sharded` traces it; an NNX module gives its
    ``nnx.Param`` s and the rest as ``model_state``, a linen ``model.init`` its ``"params"``
    and the other collections, anything else is the params (so is a pytree of arrays or
    ``ShapeDtypeStruct`` s in place of ``init_fn``); the optimizer state is the step's
    ``tx``'s. An eval step gives what its ``init_state`` gives: the params."""
    from ._sharded_init import _shapes, _split_args  # init_sharded's tracing, one owner

    strategy, tx = step.strategy, step.spec.config.tx
    if isinstance(init_fn, nnx.Module):
        abstract = nnx.eval_shape(lambda: init_fn)
    elif not callable(init_fn):
        try:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_fn)
        except AttributeError as err:
            raise UsageError(
                "`init_fn` must be a function returning the params, an NNX module, or a "
                f"pytree of arrays or ShapeDtypeStructs (the params), got {err}."
            ) from None
    else:
        abstract = _shapes(*_split_args(init_fn, args), strategy.mesh)[1]
    if isinstance(abstract, nnx.Module):
        params, model_state = nnx_split(abstract)  # an empty rest too: nnx.loss merges it
    elif isinstance(abstract, dict) and "params" in abstract:  # linen variables
        rest = {k: v for k, v in abstract.items() if k != "params"}
        params, model_state = abstract["params"], rest or None
    else:
        params, model_state = abstract, None
    unboxed = unbox(params)
    opt = None if tx is None else jax.eval_shape(tx.init, unboxed)
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt, rng, model_state)
    if strategy.by_rules:
        layout = strategy.state_layout(shapes)
    else:  # the device, or the mesh replicated
        where = as_sharding(strategy.state_target)
        layout = jax.tree.map(lambda _: where, shapes._replace(params=unboxed))
    shapes = jax.eval_shape(lambda s: s, shapes._replace(params=unboxed))
    out = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       shapes, layout)
    return out if tx is not None else out.params
