"""Where and how a train step runs: one device, ``jax.pmap``, or sharded ``jit``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from ._devices import DeviceSpec, device_list
from ._devices import device as resolve_device
from ._errors import UsageError
from ._mesh import DEFAULT_AXIS, batch_axis, check_mesh, mesh_of


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

    @property
    def collective_axis(self) -> str | None:
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
