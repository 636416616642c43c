"""A functional train step that keeps metrics on device: one device, pmap, sharded jit.

``make_train_step(loss_fn, tx, strategy)`` returns a :class:`TrainStep`, a
callable ``step(state, batch, metrics=None) -> (state, metrics)``. The three
strategies run the same per-example arithmetic and give the same parameters
and metrics on the same data (to float32 reassociation):

* ``Strategy.single`` — ``jax.jit`` on one device (d2l: "the params live on the GPU");
* ``Strategy.pmap`` — ``jax.pmap`` over local devices; gradients and metrics are
  summed over the device axis, parameters stay truly replicated (``P()``);
* ``Strategy.sharded`` — ``jax.jit`` with ``NamedSharding``: parameters replicated,
  batch split over the mesh's data axis; optionally via ``jax.shard_map``.

The objective is the mean per-example loss over the *valid* rows of the whole
global batch: padded rows (``Padded.mask == False``) never count, so an uneven
last batch gives exactly the numbers of the unpadded data.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._batches import Padded, shard_batch
from ._devices import DeviceSpec, device_list
from ._devices import device as resolve_device
from ._errors import MetricError, ShardingError, UsageError, available_devices
from ._mesh import DEFAULT_AXIS, batch_axis, check_mesh, mesh_of, replicated_sharding
from ._metrics import Collection, Mean, Metric
from ._placement import copy_to, to_device
from ._pmap_layout import shard_for_pmap

LossFn = Callable[..., Any]
"""``loss_fn(params, batch[, rng]) -> per_example_loss`` or ``(per_example_loss, aux)``."""


class TrainState(NamedTuple):
    """What changes during training, as a pytree (optax style).

    ``apply_fn`` and the optimizer live in the step factory, not here, so the
    state can be placed, donated, checkpointed and compared leaf by leaf.

    Attributes:
      step: int32 scalar, number of updates applied.
      params: model parameters (a Flax linen dict or an NNX ``State``).
      opt_state: the optax state of ``params``.
      rng: optional PRNG key; step ``t`` passes ``fold_in(rng, t)`` to ``loss_fn``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array | None = None

    @classmethod
    def create(
        cls, params: Any, tx: optax.GradientTransformation, rng: jax.Array | None = None
    ) -> TrainState:
        """Return the state before the first step (``step == 0``).

        Example:
          >>> import jax.numpy as jnp, optax, jaxdev
          >>> s = jaxdev.TrainState.create({"w": jnp.zeros(2)}, optax.sgd(0.1))
          >>> int(s.step)
          0
        """
        return cls(jnp.zeros((), jnp.int32), params, tx.init(params), rng)


# ---------------------------------------------------------------- strategies


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Where and how a step runs. Make one with a constructor, not ``Strategy(...)``:

    * :meth:`Strategy.single` — ``jax.jit`` on one device;
    * :meth:`Strategy.pmap` — ``jax.pmap`` over local devices;
    * :meth:`Strategy.sharded` — ``jax.jit`` with ``NamedSharding`` on a mesh
      (optionally through ``jax.shard_map``).

    Attributes:
      kind: ``'single'``, ``'pmap'`` or ``'sharded'``.
      devices: the devices the step runs on, in order.
      mesh: the mesh of the state and batch (one device's worth for
        ``single``, the pmap devices along ``axis`` for ``pmap``).
      axis: the mesh axis the batch is split over (``DEFAULT_AXIS``).
      shard_map: whether the sharded step runs under ``jax.shard_map``.
    """

    kind: str
    devices: tuple[jax.Device, ...]
    mesh: Mesh
    axis: str = DEFAULT_AXIS
    shard_map: bool = False

    @classmethod
    def single(cls, device: DeviceSpec | None = None) -> Strategy:
        """Run on one device with ``jax.jit`` (default: the first local device).

        Args:
          device: a ``jax.Device`` or spec; an int is a device index.

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.single("cpu:0").devices == (jaxdev.cpu(0),)
          True
        """
        dev = resolve_device(0 if device is None else device)
        return cls("single", (dev,), mesh_of((dev,), DEFAULT_AXIS))

    @classmethod
    def pmap(cls, devices: Any = None, axis: str = DEFAULT_AXIS) -> Strategy:
        """Run on several local devices with ``jax.pmap``; gradients summed over ``axis``.

        Args:
          devices: ``None`` for every local device, an int ``n`` for the
            first ``n``, a platform name, or a list of devices / specs.
          axis: the pmap axis name (what ``lax.pmean`` and BatchNorm's
            ``axis_name`` refer to).

        Example:
          >>> import jaxdev
          >>> len(jaxdev.Strategy.pmap(2).devices)
          2
        """
        devs = tuple(device_list(devices))
        _check_axis_name(axis)
        return cls("pmap", devs, mesh_of(devs, axis), axis)

    @classmethod
    def sharded(
        cls, mesh: Mesh | None = None, axis: str | None = None, *, shard_map: bool = False
    ) -> Strategy:
        """Run with ``jax.jit`` + ``NamedSharding``: params replicated, batch split over ``axis``.

        Args:
          mesh: the mesh; default :func:`jaxdev.data_mesh`.
          axis: the mesh axis the batch is split over; default the mesh's
            only axis, or ``'data'``.
          shard_map: run the per-device step under ``jax.shard_map`` with
            explicit collectives instead of letting the compiler partition it.

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.sharded(jaxdev.data_mesh(1)).axis
          'data'
        """
        mesh = check_mesh(mesh)
        axis = batch_axis(mesh, axis)
        if not isinstance(axis, str):
            raise UsageError(f"`axis` must be one mesh axis name for a strategy, got {axis!r}.")
        return cls("sharded", tuple(mesh.devices.flat), mesh, axis, bool(shard_map))

    @property
    def n_devices(self) -> int:
        """How many ways the batch is split."""
        return 1 if self.kind == "single" else self.mesh.shape[self.axis]


def _check_axis_name(axis: Any) -> None:
    if not isinstance(axis, str) or not axis:
        raise UsageError(f"`axis` must be a non-empty string such as 'data', got {axis!r}.")


def _as_strategy(strategy: Any) -> Strategy:
    if strategy is None:
        return Strategy.single()
    if isinstance(strategy, Strategy):
        return strategy
    raise UsageError(
        "`strategy` must be made by jaxdev.Strategy.single(...), Strategy.pmap(...) or "
        f"Strategy.sharded(...) (or None for one device), got {strategy!r}."
    )


# ---------------------------------------------------------------- the math


def _batch_and_mask(batch: Any) -> tuple[Any, jax.Array | None]:
    if isinstance(batch, Padded):
        return batch.batch, batch.mask
    return batch, None


def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.ndim(leaves[0]):
        raise ShardingError(
            "`batch` needs at least one array leaf with a leading batch axis; got "
            f"{jax.tree.structure(batch)}."
        )
    return np.shape(leaves[0])[0]


def _per_example(loss_fn, has_aux, params, batch, rng):
    out = loss_fn(params, batch) if rng is None else loss_fn(params, batch, rng)
    losses, aux = out if has_aux else (out, {})
    rows = _rows(batch)
    if jnp.shape(losses) != (rows,):
        raise ShardingError(
            f"`loss_fn` must return one loss per example, shape ({rows},), got shape "
            f"{jnp.shape(losses)}. Return per-example losses (no .mean()): jaxdev averages "
            "over the valid rows so padded rows never count."
        )
    return losses, aux


def _metrics_of(losses: jax.Array, aux: Any, mask: jax.Array) -> Collection:
    """Loss mean plus aux: per-example arrays become masked Means; Metrics stay."""
    if not isinstance(aux, dict):
        raise MetricError(
            f"`loss_fn`'s aux must be a dict of per-example arrays or Metric objects, "
            f"got {type(aux).__name__}."
        )
    items = {"loss": Mean.from_value(losses, mask)}
    for name, value in aux.items():
        items[name] = value if isinstance(value, Metric) else Mean.from_value(value, mask)
    return Collection(items)


def _step_body(loss_fn, tx, has_aux, axis_name, state, batch, mask):
    """One update on this device's rows; sums cross devices when ``axis_name``."""
    rows = _rows(batch)
    mask = jnp.ones((rows,), bool) if mask is None else mask
    count = jnp.sum(mask, dtype=jnp.int32)
    if axis_name is not None:
        count = jax.lax.psum(count, axis_name)
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    rng = None if state.rng is None else jax.random.fold_in(state.rng, state.step)

    def objective(params):
        losses, aux = _per_example(loss_fn, has_aux, params, batch, rng)
        return jnp.sum(jnp.where(mask, losses, 0.0)) / denom, (losses, aux)

    grads, (losses, aux) = jax.grad(objective, has_aux=True)(state.params)
    metrics = _metrics_of(losses, aux, mask)
    if axis_name is not None:
        grads = jax.lax.psum(grads, axis_name)
        metrics = metrics.reduce(axis_name)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def _eval_body(loss_fn, has_aux, axis_name, state, batch, mask):
    rows = _rows(batch)
    mask = jnp.ones((rows,), bool) if mask is None else mask
    params = state.params if isinstance(state, TrainState) else state
    losses, aux = _per_example(loss_fn, has_aux, params, batch, None)
    metrics = _metrics_of(losses, aux, mask)
    return metrics.reduce(axis_name) if axis_name is not None else metrics


def _run_k(body, k, state, batch, mask, acc):
    """``k`` steps in one call: peel the first (gives the metric structure), scan the rest."""

    def one(i):
        return jax.tree.map(lambda x: x[i], (batch, mask))

    b0, m0 = one(0)
    state, metrics = body(state, b0, m0)
    if k > 1:

        def scan_fn(carry, xs):
            st, mt = carry
            st, new = body(st, *xs)
            return (st, mt.merge(new)), None

        rest = jax.tree.map(lambda x: x[1:], (batch, mask))
        (state, metrics), _ = jax.lax.scan(scan_fn, (state, metrics), rest)
    if acc is not None:
        metrics = acc.merge(metrics)
    return state, metrics


# ---------------------------------------------------------------- the step


class TrainStep:
    """A compiled step: ``step(state, batch, metrics=None) -> (state, metrics)``.

    Calling it is functional: the new state and metrics are returned, the
    inputs are not mutated (they are donated by default, so do not reuse
    them). The object itself is not a pure function, though: on several CPU
    devices it keeps a short queue of in-flight results and waits on the
    oldest to bound XLA's dispatch depth (see ``_bound_inflight``).

    ``metrics`` is an optional running :class:`Collection`; when given, this
    call's metrics are merged into it inside the compiled step (no extra
    dispatch, no host sync). Read values with ``metrics.fetch()`` (one
    ``device_get``) every N steps, never per step.

    Helpers place things where the strategy wants them: :meth:`init_state`
    (params on the device, or truly replicated) and :meth:`put_batch`
    (batch on the device, or split over devices with padding + mask).
    """

    def __init__(self, strategy: Strategy, fn: Callable, steps_per_call: int, eval_only: bool):
        self.strategy = strategy
        self.steps_per_call = steps_per_call
        self._fn = fn
        self._eval = eval_only
        self._bounded = _cpu_collectives(strategy)
        self._target = _state_target(strategy)
        self._inflight: collections.deque = collections.deque()

    def __call__(self, state: Any, batch: Any, metrics: Collection | None = None):
        inner, mask = _batch_and_mask(batch)
        if metrics is not None:  # e.g. a fresh Collection.empty(): place it like the state,
            metrics = to_device(metrics, self._target)  # or each placement compiles anew
        out = self._fn(state, inner, mask, metrics)
        if self._eval:
            self._bound_inflight(out)
            return out
        state, metrics, token = out
        self._bound_inflight(token)
        return state, metrics

    def _bound_inflight(self, token: Any) -> None:
        """Keep at most ``_MAX_INFLIGHT`` calls queued on multi-device CPU.

        XLA's CPU runtime deadlocks (rendezvous timeout, then abort) when
        dozens of collective programs are queued on fake CPU devices with
        few cores (measured: jax 0.10.2, 8 devices, 2 cores, ~100 queued
        steps). Waiting for the call ``_MAX_INFLIGHT`` back is not a host
        transfer and keeps the queue deep enough to overlap dispatch.
        """
        if not self._bounded:
            return
        self._inflight.append(token)
        if len(self._inflight) > _MAX_INFLIGHT:
            jax.block_until_ready(self._inflight.popleft())

    def init_state(
        self, params: Any, tx: optax.GradientTransformation | None = None, rng=None
    ) -> Any:
        """Return a :class:`TrainState` (or, for eval steps, ``params``) placed for this strategy.

        The state is a fresh copy (``copy_to``): donating it in later steps
        never deletes the caller's ``params`` arrays.
        """
        state = params if tx is None else TrainState.create(params, tx, rng)
        return copy_to(state, _state_target(self.strategy))

    def put_batch(self, batch: Any) -> Any:
        """Place a host batch for this strategy; uneven sizes are padded and masked.

        With ``steps_per_call=K`` every leaf has a leading axis of ``K`` steps.
        Returns the batch, or a :class:`Padded` when rows were added.
        """
        return _put_batch(self.strategy, batch, self.steps_per_call)


_MAX_INFLIGHT = 8


def _cpu_collectives(strategy: Strategy) -> bool:
    """Whether steps run collectives across several CPU devices."""
    devices = strategy.devices
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


def _state_target(strategy: Strategy):
    if strategy.kind == "single":
        return strategy.devices[0]
    return replicated_sharding(strategy.mesh)


def _put_batch(strategy: Strategy, batch: Any, k: int) -> Any:
    if strategy.kind == "single":
        return to_device(batch, strategy.devices[0])
    mesh, axis = strategy.mesh, strategy.axis
    if k > 1:
        return _put_steps(batch, mesh, axis, k, strategy.kind == "pmap")
    pad = _rows(batch) % mesh.shape[axis] != 0
    if strategy.kind == "pmap":
        return shard_for_pmap(batch, list(strategy.devices), pad=pad)
    return shard_batch(batch, mesh, pad=pad, axis=axis)


def _put_steps(batch: Any, mesh: Mesh, axis: str, k: int, stacked: bool) -> Any:
    """Place a ``(K, B, ...)`` batch: rows split over ``axis``, steps kept whole."""
    leaves = jax.tree.leaves(batch)
    if not leaves or np.ndim(leaves[0]) < 2 or np.shape(leaves[0])[0] != k:
        raise ShardingError(
            f"with `steps_per_call`={k} every batch leaf needs shape (K={k}, B, ...); got "
            f"{[np.shape(x) for x in leaves[:3]]}."
        )
    n = mesh.shape[axis]
    rows = np.shape(leaves[0])[1]
    if rows % n:
        raise ShardingError(
            f"with `steps_per_call`={k} the per-step batch of {rows} rows must divide over "
            f"{n} devices; pad each step's batch or drop to steps_per_call=1 for the last "
            f"steps. {available_devices()}"
        )
    if stacked:  # (K, B, ...) -> (n, K, B/n, ...)
        batch = jax.tree.map(
            lambda x: np.swapaxes(np.reshape(x, (k, n, rows // n) + np.shape(x)[2:]), 0, 1),
            jax.device_get(batch),
        )
        return to_device(batch, NamedSharding(mesh, P(axis)))
    return to_device(batch, NamedSharding(mesh, P(None, axis)))


def _compile(strategy: Strategy, body: Callable, k: int, donate: bool, eval_only: bool):
    """Wrap ``body(state, batch, mask)`` for ``strategy`` and ``k`` steps per call."""
    if eval_only:

        def run(state, batch, mask, acc, axis_name):
            metrics = body(axis_name, state, batch, mask)
            return metrics if acc is None else acc.merge(metrics)

    else:

        def run(state, batch, mask, acc, axis_name):
            step = functools.partial(body, axis_name)
            if k == 1:
                state, metrics = step(state, batch, mask)
                metrics = metrics if acc is None else acc.merge(metrics)
            else:
                state, metrics = _run_k(step, k, state, batch, mask, acc)
            return state, metrics, state.step + 0  # an undonated token to wait on

    donate_argnums = () if eval_only or not donate else (0, 3)
    if strategy.kind == "single":
        return jax.jit(functools.partial(run, axis_name=None), donate_argnums=donate_argnums)
    if strategy.kind == "pmap":
        out_axes = None if eval_only else (None, None, None)
        return jax.pmap(
            functools.partial(run, axis_name=strategy.axis),
            axis_name=strategy.axis,
            devices=list(strategy.devices),
            in_axes=(None, 0, 0, None),
            out_axes=out_axes,
            donate_argnums=donate_argnums,
        )
    return _compile_sharded(strategy, run, k, donate_argnums, eval_only)


def _compile_sharded(strategy: Strategy, run, k, donate_argnums, eval_only):
    mesh, axis = strategy.mesh, strategy.axis
    rep = NamedSharding(mesh, P())
    spec = P(axis) if k == 1 else P(None, axis)
    data = NamedSharding(mesh, spec)
    out = rep if eval_only else (rep, rep, rep)
    if strategy.shard_map:
        inner = jax.shard_map(
            functools.partial(run, axis_name=axis),
            mesh=mesh,
            in_specs=(P(), spec, spec, P()),
            out_specs=P() if eval_only else (P(), P(), P()),
        )
    else:
        inner = functools.partial(run, axis_name=None)
    return jax.jit(
        inner,
        in_shardings=(rep, data, data, rep),
        out_shardings=out,
        donate_argnums=donate_argnums,
    )


def _check_k(steps_per_call: Any) -> int:
    if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int):
        raise UsageError(f"`steps_per_call` must be an int >= 1, got {steps_per_call!r}.")
    if steps_per_call < 1:
        raise UsageError(f"`steps_per_call` must be >= 1, got {steps_per_call}.")
    return steps_per_call


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    strategy: Strategy | None = None,
    *,
    has_aux: bool = False,
    steps_per_call: int = 1,
    donate: bool = True,
) -> TrainStep:
    """Return a pure, compiled train step for ``strategy``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> per_example_loss`` of shape ``(B,)``
        (with ``has_aux``: ``-> (per_example_loss, aux)``, ``aux`` a dict of
        per-example arrays, averaged over valid rows, or of :class:`Metric`
        objects, merged as they are). If the state holds an ``rng``, it is
        called as ``loss_fn(params, batch, rng)``.
      tx: any optax ``GradientTransformation``.
      strategy: a :class:`Strategy` (``Strategy.single(device)``,
        ``Strategy.pmap(devices)``, ``Strategy.sharded(mesh)``); ``None`` is
        ``Strategy.single()``.
      has_aux: whether ``loss_fn`` returns ``(losses, aux)``.
      steps_per_call: run K steps per dispatch with ``lax.scan`` over a batch
        whose leaves have a leading axis of K.
      donate: donate the state and running metrics buffers (default True).

    Returns:
      A :class:`TrainStep`: ``state, metrics = step(state, batch, metrics)``.

    Raises:
      UsageError: ``strategy`` is not a :class:`Strategy`, or ``steps_per_call < 1``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxdev
      >>> def loss_fn(params, batch):
      ...     return (batch["x"] @ params["w"] - batch["y"]) ** 2
      >>> step = jaxdev.make_train_step(loss_fn, optax.sgd(0.1), jaxdev.Strategy.single())
      >>> state = step.init_state({"w": jnp.zeros(2)}, optax.sgd(0.1))
      >>> batch = step.put_batch({"x": np.eye(2, dtype=np.float32), "y": np.ones(2, np.float32)})
      >>> state, metrics = step(state, batch)
      >>> state, metrics = step(state, batch, metrics)
      >>> int(state.step), round(metrics.fetch()["loss"], 3)
      (2, 0.905)
    """
    strategy = _as_strategy(strategy)
    k = _check_k(steps_per_call)
    body = functools.partial(_train_body, loss_fn, tx, has_aux)
    return TrainStep(strategy, _compile(strategy, body, k, donate, False), k, False)


def _train_body(loss_fn, tx, has_aux, axis_name, state, batch, mask):
    return _step_body(loss_fn, tx, has_aux, axis_name, state, batch, mask)


def make_eval_step(loss_fn: LossFn, strategy: Strategy | None = None, *, has_aux: bool = False):
    """Return a compiled ``eval(params_or_state, batch, metrics=None) -> metrics``.

    Same ``loss_fn`` contract and strategies as :func:`make_train_step`; no
    gradient, nothing donated. Padded rows never count.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jaxdev
      >>> ev = jaxdev.make_eval_step(lambda p, b: (b["x"] * p["w"]).sum(-1))
      >>> params = ev.init_state({"w": jnp.ones(2)})
      >>> ev(params, ev.put_batch({"x": np.ones((4, 2), np.float32)})).fetch()
      {'loss': 2.0}
    """
    strategy = _as_strategy(strategy)

    def body(axis_name, state, batch, mask):
        return _eval_body(loss_fn, has_aux, axis_name, state, batch, mask)

    return TrainStep(strategy, _compile(strategy, body, 1, False, True), 1, True)
