"""The train state and the per-device math of one update.

One body serves every strategy: ``axis`` is ``None`` when the step sees the whole batch
(one device, sharded ``jit``) and the device axis under ``jax.pmap`` / ``shard_map``,
where gradients and counts are summed and the model state averaged explicitly. The
objective is the mean loss over the valid rows of the whole global batch (padded rows
never count; ``accumulate=M`` gives the M-times-larger batch's gradient); with
``weighted=True`` it is ``sum(loss * weight) / sum(weight)`` over the same batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._batches import rows_of
from .._errors import LeafTypeError, MetricError, UsageError
from .._leaves import raise_leaves
from ._metrics import Collection, Last, Mean, Metric, WeightedMean, ambient, ambient_value

LossFn = Callable[..., Any]
"""``loss_fn(params[, model_state], batch[, rng][, mask=]) -> losses[, aux][, new_state]``."""


class TrainState(NamedTuple):
    """What changes during training, as a pytree (optax style; ``tx`` lives in the step).

    Attributes:
      step: int32 scalar, number of updates applied.
      params: model parameters (a Flax linen dict or an NNX ``State``).
      opt_state: the optax state of ``params``.
      rng: optional PRNG key; step ``t`` passes ``fold_in(rng, t)`` (and the device index
        under pmap/shard_map) to ``loss_fn``.
      model_state: optional state the forward pass updates (``batch_stats``, NNX ``BatchStat``).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array | None = None
    model_state: Any = None

    @classmethod
    def create(
        cls,
        params: Any,
        tx: optax.GradientTransformation,
        rng: jax.Array | None = None,
        model_state: Any = None,
    ) -> TrainState:
        """Return the state before the first step (``step == 0``).

        Example:
          >>> import jax.numpy as jnp, optax, jaxdev
          >>> s = jaxdev.TrainState.create({"w": jnp.zeros(2)}, optax.sgd(0.1))
          >>> int(s.step), s.model_state is None
          (0, True)
        """
        return cls(jnp.zeros((), jnp.int32), params, tx.init(params), rng, model_state)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step factory captured: the user's functions and options."""

    loss_fn: LossFn
    tx: optax.GradientTransformation | None = None
    has_aux: bool = False
    has_state: bool = False
    pass_mask: bool = False
    accumulate: int = 1
    regularizer: Callable[[Any], jax.Array] | None = None
    lr_fn: Callable[[jax.Array], jax.Array] | None = None
    weighted: bool = False
    remat: Any = False  # True, or a jax.checkpoint policy: the loss under jax.checkpoint
    told: list = dataclasses.field(  # the keys-differ warning given: once a step, each its own
        default_factory=list, init=False, compare=False, repr=False
    )


# ---------------------------------------------------------------- calling loss_fn


_log = logging.getLogger("jaxdev")


def _call_loss(cfg: StepConfig, params, model_state, batch, rng, mask):
    """Call ``loss_fn`` by its contract; ``(losses, weights, aux, new_model_state)``."""
    args = (params, model_state, batch) if cfg.has_state else (params, batch)
    if rng is not None:
        args += (rng,)
    kwargs = {"mask": mask} if cfg.pass_mask else {}
    if rng is None and _wants_one_more(cfg.loss_fn, args, kwargs):
        raise UsageError(
            "`loss_fn` takes an `rng` argument, but the state holds no key. jaxdev's "
            "TrainState gets one from `step.init_state(params, rng=jax.random.key(0))`; "
            "flax's `train_state.TrainState` has no `rng` field: subclass it with "
            "`rng: jax.Array` (the step folds in the step number, as Flax's examples do), "
            "or build jaxdev's state from `state.params`."
        )
    with ambient("mask", mask):  # Metric.from_value inside loss_fn skips padded rows
        try:
            out = cfg.loss_fn(*args, **kwargs)
        except NameError as err:  # a collective (BatchNorm's axis_name) over an axis not here
            if "unbound axis name" not in str(err):
                raise
            mesh = jax.sharding.get_abstract_mesh()
            axes = f"; the mesh's axes are {tuple(mesh.axis_names)}" if not mesh.empty else ""
            raise UsageError(
                f"`loss_fn` runs a collective over an axis this step does not have ({err}). The "
                f"step's device axis is {ambient_value('axis')!r}{axes}. Build the model with "
                "`axis_name=strategy.collective_axis` (a BatchNorm's `axis_name`): None under "
                "`single` and sharded `jit`, where the step sees the whole batch; the device "
                "axis under `pmap` and `shard_map`."
            ) from err
    want = 1 + cfg.has_aux + cfg.has_state
    if want == 1 and cfg.weighted:
        out = (out,)  # (losses, weights) is the one thing returned
    out = out if isinstance(out, tuple) else (out,)
    if len(out) != want:
        raise UsageError(
            f"`loss_fn` must return {_contract(cfg)}, got a tuple of {len(out)}: check "
            "`has_aux` and `has_state`."
        )
    losses, weights = out[0], None
    if cfg.weighted:
        if not (isinstance(losses, (tuple, list)) and len(losses) == 2):
            raise UsageError(
                f"with `weighted=True`, `loss_fn` must return {_contract(cfg)} where "
                f"`losses` is `(losses, weights)`, both of shape (batch, ...); got "
                f"{type(losses).__name__} {_shape_text(losses)}."
            )
        losses, weights = losses
    aux = out[1] if cfg.has_aux else {}
    new_state = out[-1] if cfg.has_state else None
    _check_losses(losses, weights, rows_of(batch))
    return losses, weights, aux, new_state


def _wants_one_more(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """``fn`` cannot be called with ``args`` but could with one more positional argument."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return False

    def binds(*a: Any) -> bool:
        try:
            sig.bind(*a, **kwargs)
        except TypeError:
            return False
        return True

    return not binds(*args) and binds(*args, None)


def _shape_text(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"of {len(x)} items"
    return f"of shape {jnp.shape(x)}" if hasattr(x, "shape") else repr(x)[:80]


def _check_losses(losses: Any, weights: Any, rows: int) -> None:
    """Per-example (or, weighted, per-element) float losses; weights of the same shape."""
    shape = jnp.shape(losses)
    if weights is None and shape != (rows,):
        raise UsageError(
            f"`loss_fn` must return one loss per example, shape ({rows},), got shape "
            f"{shape}. Return per-example losses (no .mean()): jaxdev averages over the "
            "valid rows so padded rows never count. Per-token losses with weights: "
            "`weighted=True` and return `(losses, weights)`."
        )
    if weights is not None:
        wshape = jnp.shape(weights)
        if not shape or shape[0] != rows or wshape != shape:
            raise UsageError(
                f"with `weighted=True`, `loss_fn` must return `(losses, weights)` of one "
                f"shape (batch={rows}, ...); got losses of shape {shape} and weights of "
                f"shape {wshape}."
            )
        wdtype = jnp.result_type(weights)
        if not (jnp.issubdtype(wdtype, jnp.number) or wdtype == jnp.bool_):
            raise UsageError(f"`loss_fn`'s weights must be numbers or bools, got {wdtype}.")
    dtype = jnp.result_type(losses)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UsageError(
            f"`loss_fn` returned losses of dtype {dtype}; they must be floating point "
            "(jax.grad refuses integer outputs: an integer loss has zero gradient, so the "
            "params would never change). Compute the loss in float, e.g. "
            "`optax.softmax_cross_entropy_with_integer_labels(logits, labels)`."
        )


def _contract(cfg: StepConfig) -> str:
    parts = ["losses"] + (["aux"] if cfg.has_aux else []) + (["new_state"] if cfg.has_state else [])
    return parts[0] if len(parts) == 1 else f"({', '.join(parts)})"


def metrics_of(losses: jax.Array, aux: Any, mask: jax.Array, weights: Any = None) -> Collection:
    """Loss mean plus aux: per-example arrays become masked Means (weighted: WeightedMeans).

    Metrics built inside ``loss_fn`` already skipped the padded rows (the mask is ambient).
    """
    if not isinstance(aux, dict):
        raise MetricError(
            "`loss_fn`'s aux must be a dict of per-example arrays, Metric objects or "
            f"Collections, got {type(aux).__name__}."
        )
    if weights is None:
        items = {"loss": Mean.from_value(losses, mask)}
    else:
        items = {"loss": WeightedMean.from_value(losses, weights, mask)}
    for name, value in aux.items():
        if isinstance(value, Collection):
            items.update({f"{name}/{k}": v for k, v in value.items()})
        elif isinstance(value, Metric):
            items[name] = value
        elif weights is not None and jnp.shape(value) == jnp.shape(weights):
            items[name] = WeightedMean.from_value(value, weights, mask)
        else:
            value = jnp.asarray(value)
            if value.ndim == 0 or value.shape[0] != mask.shape[0]:
                raise MetricError(
                    f"`loss_fn`'s aux[{name!r}] has shape {value.shape}; an aux array needs one "
                    f"value per example, shape ({mask.shape[0]}, ...), so padded rows can be "
                    "left out. A per-batch scalar cannot be masked: compute it per example, or "
                    "return `jaxdev.metrics.Last.from_value(x)` if the last value is what you "
                    "want."
                )
            items[name] = Mean.from_value(value, mask)
    return Collection(items)


# ---------------------------------------------------------------- one update


def _check_differentiable(params: Any) -> None:
    """Refuse params leaves ``jax.grad`` refuses (its TypeError names no leaf), at trace time."""
    leaves = jax.tree.leaves(params)
    raise_leaves(
        params,
        [i for i, x in enumerate(leaves) if not jnp.issubdtype(x.dtype, jnp.inexact)],
        "`state.params` has leaves the step cannot differentiate: it trains every leaf of "
        "the params, and `jax.grad` needs float or complex ones. Keep integer, boolean "
        "and PRNG key leaves (counters, indices, keys) out of the params: in the model "
        "state (`has_state=True`), in the state's `rng`, in the batch, or closed over by "
        "`loss_fn`. Leaves:",
        lambda i: leaves[i].dtype,
        LeafTypeError,
        "state.params",
    )


def _micro_grads(cfg, params, model_state, batch, mask, rng, denom):
    """Gradient of ``sum(valid losses) / denom`` on one (micro-)batch, its metrics and weight."""

    def objective(p):
        losses, weights, aux, new_state = _call_loss(cfg, p, model_state, batch, rng, mask)
        if weights is None:
            total = jnp.sum(jnp.where(mask, losses, 0.0)) / denom
            return total, (losses, weights, aux, new_state, None)
        summed = WeightedMean.from_value(losses, jax.lax.stop_gradient(weights), mask)
        return summed.total, (losses, weights, aux, new_state, summed.weight)

    if cfg.remat:  # the forward pass is recomputed in the backward one, as the policy says
        objective = jax.checkpoint(objective, policy=None if cfg.remat is True else cfg.remat)
    _check_differentiable(params)
    grads, (losses, weights, aux, new_state, weight) = jax.grad(objective, has_aux=True)(params)
    new_state = model_state if not cfg.has_state else new_state
    return grads, new_state, metrics_of(losses, aux, mask, weights), weight


def fold_steps(fn: Callable, carry: Any, xs: Any, n: int) -> tuple[Any, Collection]:
    """Run ``fn(carry, x_i) -> (carry, metrics_i)`` for ``i < n`` and merge the metrics in order.

    One rolled ``lax.scan`` (K steps per call and M micro-batches both use it): one
    iteration's temporaries live at a time (unrolled, ``accumulate=8`` needed 4.3x the
    temporaries of one big batch).
    """
    carry, stacked = jax.lax.scan(fn, carry, xs)
    metrics = jax.tree.map(lambda x: x[0], stacked)
    if n > 1:
        rest = jax.tree.map(lambda x: x[1:], stacked)
        metrics, _ = jax.lax.scan(lambda m, new: (m.merge(new), None), metrics, rest)
    return carry, metrics


def _reduce(metrics: Collection, axis: str, which: Callable[[Metric], bool]) -> Collection:
    """``metrics`` with those ``which`` picks reduced over ``axis``. Under ``accumulate`` a
    ``Last`` is reduced per micro-batch (its rows come micro-batch first, then device: merged
    per device first, a device whose last micro-batch was padding kept an earlier row)."""
    return Collection({k: m.reduce(axis) if which(m) else m for k, m in metrics.items()})


def _grads(cfg: StepConfig, state: TrainState, batch, mask, rng, axis):
    """Gradients over every micro-batch, the new model state, metrics, and the total weight.

    Unweighted, divided by the global valid-row count; weighted, sums (divided later).
    """
    count = jnp.sum(mask, dtype=jnp.int32)
    count = count if axis is None else jax.lax.psum(count, axis)
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    model_state = getattr(state, "model_state", None)  # flax's TrainState has none
    if cfg.accumulate == 1:
        return _micro_grads(cfg, state.params, model_state, batch, mask, rng, denom)

    def micro(carry, xs):
        total, model_state, weight = carry
        b, m, i = xs
        key = None if rng is None else jax.random.fold_in(rng, i)
        g, model_state, metrics, w = _micro_grads(cfg, state.params, model_state, b, m, key, denom)
        if axis is not None:  # a Last's rows are ordered micro-batch first, then device
            metrics = _reduce(metrics, axis, lambda x: isinstance(x, Last))
        weight = weight if w is None else weight + w
        return (jax.tree.map(jnp.add, total, g), model_state, weight), metrics

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    init = (zeros, model_state, jnp.zeros((), jnp.float32))
    xs = (batch, mask, jnp.arange(cfg.accumulate))
    (grads, model_state, weight), metrics = fold_steps(micro, init, xs, cfg.accumulate)
    return grads, model_state, metrics, (weight if cfg.weighted else None)


def train_body(cfg: StepConfig, axis: str | None, state: TrainState, batch, mask):
    """One update of ``state`` on this device's rows (all rows when ``axis`` is None)."""
    rng = getattr(state, "rng", None)
    if rng is not None:  # fold_in(rng, step), then the device index: each device its own rows
        rng = jax.random.fold_in(rng, state.step)
        if axis is not None:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        if (axis is not None or cfg.accumulate > 1) and not cfg.told:
            cfg.told.append(True)  # once a step (README: Dropout keys); an id can be reused
            folds = [] if axis is None else [f"the device index over {axis!r}"]
            if cfg.accumulate > 1:
                folds.append(f"the micro-batch index (accumulate={cfg.accumulate})")
            _log.warning(
                "the train step's keys differ from a plain `jax.jit` step's: step t draws from "
                "fold_in(rng, t) and then folds in %s, so a model that samples follows another "
                "trajectory than Flax's own step (statistically equivalent). For Flax's exact "
                "keys use Strategy.single() or Strategy.sharded(mesh) (jit, no shard_map) "
                "without accumulate.",
                " and ".join(folds),
            )
    with ambient("axis", axis):
        grads, model_state, metrics, weight = _grads(cfg, state, batch, mask, rng, axis)
    if axis is not None:
        grads = jax.lax.psum(grads, axis)
        weight = None if weight is None else jax.lax.psum(weight, axis)
        metrics = _reduce(metrics, axis, lambda x: cfg.accumulate == 1 or not isinstance(x, Last))
        if cfg.has_state:  # float leaves averaged (flax's sync_batch_stats); others stay
            inexact = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.inexact)  # noqa: E731
            model_state = jax.tree.map(
                lambda x: jax.lax.pmean(x, axis) if inexact(x) else x, model_state
            )
    if weight is not None:  # sum(loss * w) / sum(w) over the whole step's global batch
        safe = jnp.where(weight > 0, weight, 1.0)
        grads = jax.tree.map(lambda g: (g / safe).astype(g.dtype), grads)
    extra = {}
    if cfg.regularizer is not None:  # once per batch, not once per device
        reg, reg_grads = jax.value_and_grad(cfg.regularizer)(state.params)
        grads = jax.tree.map(jnp.add, grads, reg_grads)
        extra["regularizer"] = Last.from_value(reg)
    if cfg.lr_fn is not None:
        extra["lr"] = Last.from_value(cfg.lr_fn(state.step))
    updates, opt_state = cfg.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if isinstance(state, TrainState):
        new = TrainState(state.step + 1, params, opt_state, state.rng, model_state)
    else:  # flax's train_state.TrainState (or a subclass): its own type back
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new, Collection({**metrics, **extra}) if extra else metrics


def warn_padded_model_state(
    cfg: StepConfig, collective_axis: Any, shard_map: bool, batch: Any, k: int
) -> bool:
    """Warn (once per step) where padded rows reach a model state the mask cannot guard."""
    if not cfg.has_state or (cfg.pass_mask and collective_axis is None):
        return False
    rows, padded = batch.size, int(np.size(batch.mask)) // k  # per step
    if not cfg.pass_mask:
        message = (
            f"padded rows reach the model: the batch was padded from {rows} to {padded} rows "
            "(copies of the last row) and this step has model state (`has_state=True`, e.g. "
            "BatchNorm statistics) but does not give the model the mask (`pass_mask=False`), "
            "so the padded rows change that state (losses and metrics never count them). "
            "Choose: `pass_mask=True` and hand `mask` to `nn.BatchNorm(...)(x, mask=...)` "
            "(exact); or drop the remainder yourself (give a row count the devices divide); "
            "or silence this warning if the state ignores rows."
        )
    else:
        message = (
            f"a padded batch ({rows} real of {padded} rows) under "
            f"{'shard_map' if shard_map else 'pmap'}: flax's masked BatchNorm "
            "averages each device's masked mean (`lax.pmean`), which is the global mean only "
            "when every device holds as many real rows, so the statistics are slightly off "
            "(losses and metrics are exact). For exact statistics train with sharded jit "
            "(`Strategy.sharded(mesh)`, the step sees the whole batch), or give a row count "
            "the devices divide."
        )
    warnings.warn(message, UserWarning, stacklevel=3)
    return True


def eval_body(cfg: StepConfig, axis: str | None, state: Any, batch, mask):
    """Metrics of ``state`` (or bare params) on this device's rows; nothing updated."""
    if hasattr(state, "params") and hasattr(state, "opt_state"):  # jaxdev's or flax's
        params, model_state = state.params, getattr(state, "model_state", None)
    else:
        params, model_state = state, None
    with ambient("axis", axis):
        losses, weights, aux, _ = _call_loss(cfg, params, model_state, batch, None, mask)
    metrics = metrics_of(losses, aux, mask, weights)
    return metrics if axis is None else metrics.reduce(axis)
