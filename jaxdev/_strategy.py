"""Where and how a train step runs: one device, ``jax.pmap``, or sharded ``jit``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from ._devices import DeviceSpec, device_list
from ._devices import device as resolve_device
from ._errors import ShardingError, UsageError
from ._mesh import (
    DEFAULT_AXIS,
    MODEL_AXES,
    AxisName,
    axis_size,
    batch_axis,
    check_mesh,
    mesh_of,
)
from ._rules import check_rules


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Where and how a step runs. Make one with a constructor, not ``Strategy(...)``:

    * :meth:`Strategy.single` — ``jax.jit`` on one device;
    * :meth:`Strategy.pmap` — ``jax.pmap`` over local devices;
    * :meth:`Strategy.sharded` — ``jax.jit`` with ``NamedSharding`` on a mesh
      (optionally through ``jax.shard_map``), params replicated or placed by
      rules (FSDP, tensor parallel, flax metadata).

    Attributes:
      kind: ``'single'``, ``'pmap'`` or ``'sharded'``.
      devices: the devices the step runs on, in order.
      mesh: the mesh of the state and batch (one device's worth for
        ``single``, the pmap devices along ``axis`` for ``pmap``).
      axis: the mesh axis the batch is split over (``DEFAULT_AXIS``), or a
        tuple of axes (``('data', 'fsdp')``) for a sharded step.
      shard_map: whether the sharded step runs under ``jax.shard_map``.
      params: the rules that place the params and optimizer state
        (:data:`jaxdev.Rules`; ``'replicate'`` unless ``sharded(params=...)``).
        A list of ``(regex, spec)`` pairs is stored as a tuple of pairs; the
        field takes no part in hashing (a layout pytree is not hashable).
    """

    kind: str
    devices: tuple[jax.Device, ...]
    mesh: Mesh
    axis: AxisName = DEFAULT_AXIS
    shard_map: bool = False
    params: Any = dataclasses.field(default="replicate", hash=False)

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
        cls,
        mesh: Mesh | None = None,
        axis: AxisName | None = None,
        *,
        params: Any = "replicate",
        shard_map: bool = False,
    ) -> Strategy:
        """Run with ``jax.jit`` + ``NamedSharding``: batch split, params placed by ``params``.

        With ``params="replicate"`` every device holds the whole state (data
        parallel). Any other :data:`jaxdev.Rules` (``"fsdp"``, ``"flax"``, a
        list of ``(regex, PartitionSpec)`` pairs, a layout pytree) shards the
        params, and the optimizer state follows them
        (:func:`jaxdev.state_shardings`); XLA inserts the gathers and
        reduce-scatters. Every rule set gives the replicated run's numbers.

        Args:
          mesh: the mesh (:func:`jaxdev.make_mesh`); default
            :func:`jaxdev.data_mesh`.
          axis: the mesh axis, or tuple of axes, the batch is split over.
            Default: every axis of the mesh except ``'model'`` and
            ``'tensor'`` (which split the params), e.g. ``('data', 'fsdp')``
            on a ``data`` x ``fsdp`` mesh and ``'data'`` on a ``data`` x
            ``model`` mesh.
          params: the rules for the params (default ``"replicate"``).
          shard_map: run the per-device step under ``jax.shard_map`` with
            explicit collectives instead of letting the compiler partition it
            (replicated params only).

        Raises:
          UsageError: ``shard_map=True`` with params that are not replicated.
          ShardingError: ``axis`` names an axis the mesh lacks, or every mesh
            axis is a model axis and ``axis`` is not given.

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.sharded(jaxdev.data_mesh(1)).axis
          'data'
          >>> s = jaxdev.Strategy.sharded(jaxdev.make_mesh({"data": 2, "fsdp": 4}), params="fsdp")
          >>> s.axis, s.n_devices
          (('data', 'fsdp'), 8)
        """
        mesh = check_mesh(mesh)
        params = _hashable_rules(params)
        check_rules(params, mesh)  # a typo fails here, not at the first init_state
        if shard_map and not (isinstance(params, str) and params == "replicate"):
            raise UsageError(
                f"`shard_map`=True trains replicated params only, got `params`={_short(params)}. "
                "Sharded params run under jax.jit, where XLA inserts the gathers: drop "
                "`shard_map=True` (the numbers are the same)."
            )
        if axis is None and not _replicates(params) and set(mesh.axis_names) <= set(MODEL_AXES):
            raise ShardingError(
                f"`axis` is needed: every axis of the mesh {dict(mesh.shape)} is a model axis "
                f"{MODEL_AXES} that `params` may split, so the batch would split over the same "
                "devices by default. Pass `axis=` with the axis the batch is split over, or add a "
                "'data' axis."
            )
        axis = batch_axis(mesh, axis)
        return cls("sharded", tuple(mesh.devices.flat), mesh, axis, bool(shard_map), params)

    @property
    def replicated(self) -> bool:
        """Whether every device holds the whole state (``params="replicate"``)."""
        return _replicates(self.params)

    @property
    def n_devices(self) -> int:
        """How many ways the batch is split."""
        return 1 if self.kind == "single" else axis_size(self.mesh, self.axis)

    @property
    def collective_axis(self) -> AxisName | None:
        """The axis name bound inside the step, for ``lax.pmean`` and BatchNorm's ``axis_name``.

        ``axis`` under ``pmap`` and ``sharded(shard_map=True)``, where each
        device runs the step on its own rows; ``None`` under ``single`` and
        sharded ``jit``, where the step sees the whole batch. Build the model
        with it (``nn.BatchNorm(axis_name=strategy.collective_axis)``) and one
        model definition computes batch statistics over the global batch
        under every strategy.

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.pmap(2).collective_axis, jaxdev.Strategy.sharded().collective_axis
          ('data', None)
        """
        return self.axis if self.kind == "pmap" or self.shard_map else None


def _replicates(rules: Any) -> bool:
    return isinstance(rules, str) and rules == "replicate"


def _hashable_rules(rules: Any) -> Any:
    """A list of ``(regex, spec)`` pairs as a tuple of tuples; anything else as given."""
    if isinstance(rules, list) and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rules):
        return tuple((pattern, spec) for pattern, spec in rules)
    return rules


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:120] + "..."


def _check_axis_name(axis: Any) -> None:
    if not isinstance(axis, str) or not axis:
        raise UsageError(f"`axis` must be a non-empty string such as 'data', got {axis!r}.")


def as_strategy(strategy: Any) -> Strategy:
    if strategy is None:
        return Strategy.single()
    if isinstance(strategy, Strategy):
        return strategy
    raise UsageError(
        "`strategy` must be made by jaxdev.Strategy.single(...), Strategy.pmap(...) or "
        f"Strategy.sharded(...) (or None for one device), got {strategy!r}."
    )
