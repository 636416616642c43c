"""Meshes and the two layouts data parallel code needs: replicated and batch-split."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._devices import DeviceSpec, device_list
from ._errors import ShardingError, UsageError, available_devices, format_devices
from ._target import is_target, load_target, not_here, target_devices, topology

DEFAULT_AXIS = "data"
"""The batch axis name: the default ``axis`` of every jaxdev function that takes one."""


_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


AxisName = str | tuple[str, ...]


def data_mesh(
    devices: int | DeviceSpec | Sequence[DeviceSpec] | None = None,
    axis: str = DEFAULT_AXIS,
    axis_type: AxisType | str = AxisType.Auto,
) -> Mesh:
    """Return a one-axis mesh over ``devices`` for data parallelism.

    Axes are ``Auto`` by default, on purpose: ``jax.make_mesh``'s ``Explicit`` axes put
    shardings into the traced types (some ops then refuse sharded operands, scalars against
    a sharded spec fail with a bare ``AssertionError``, ``jax.pmap`` fails with
    ``KeyError``). With ``Auto``, ``jit`` plus ``NamedSharding`` inputs is classic data
    parallelism and the arrays also feed ``jax.pmap``. ``axis_type='explicit'`` opts in.

    Args:
      devices: ``None`` for every device (every global device with several processes), an
        int ``n`` for the first ``n`` local devices, a platform name, or devices / specs.
      axis: the mesh axis name.
      axis_type: ``'auto'`` (default), ``'explicit'``, or an ``AxisType``.

    Raises:
      DeviceSpecError: a device is listed twice or a spec is malformed.
      DeviceNotFoundError: a device does not exist.
      ShardingError: ``axis`` is not a non-empty string or ``axis_type`` is unknown.

    Example:
      >>> import jax, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> mesh.axis_names, mesh.size == len(jax.local_devices())
      (('data',), True)
    """
    if not isinstance(axis, str) or not axis:
        raise ShardingError(f"`axis` must be a non-empty string such as 'data', got {axis!r}.")
    return make_mesh({axis: -1}, devices, axis_type)


@functools.lru_cache(maxsize=64)
def mesh_of(devices: tuple[jax.Device, ...], axis: str, kind: AxisType = AxisType.Auto) -> Mesh:
    """One cached one-axis ``Mesh`` per (devices, axis, axis type): same object, faster caches."""
    return Mesh(np.array(devices), (axis,), axis_types=(kind,))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Return ``NamedSharding(mesh, P())``: a full copy on every device of ``mesh``."""
    return named_sharding(check_mesh(mesh), P())


@functools.lru_cache(maxsize=256)
def named_sharding(mesh: Mesh, spec: P) -> NamedSharding:
    """One ``NamedSharding`` object per (mesh, spec): JAX's caches hit faster on the same object."""
    return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int | None = None, axis: AxisName | None = None):
    """Return the sharding that splits the leading (batch) axis over ``mesh``.

    Args:
      mesh: the mesh.
      ndim: if given, the spec lists every dimension (``P(axis, None, ...)``); else
        ``P(axis)``, for any rank >= 1.
      axis: the mesh axis (or axes) to split over; default: :func:`batch_axis`.

    Raises:
      ShardingError: ``axis`` is not an axis of ``mesh``, or ``ndim < 1``.

    Example:
      >>> import jaxdev
      >>> jaxdev.batch_sharding(jaxdev.data_mesh()).spec
      P('data',)
    """
    mesh = check_mesh(mesh)
    axis = batch_axis(mesh, axis)
    if ndim is None:
        return named_sharding(mesh, P(axis))
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
        raise ShardingError(f"`ndim` must be an int >= 1 (a batch needs an axis), got {ndim!r}.")
    return named_sharding(mesh, P(axis, *([None] * (ndim - 1))))


def check_mesh(mesh: Any) -> Mesh:
    """Return ``mesh`` (``data_mesh()`` for None); raise unless it is a mesh of distinct devices."""
    if mesh is None:
        return data_mesh()
    if not isinstance(mesh, Mesh):
        raise ShardingError(
            f"`mesh` must be a jax.sharding.Mesh (make one with `jaxdev.data_mesh()`), got "
            f"{type(mesh).__name__} {mesh!r}. {available_devices()}"
        )
    _check_distinct_devices(mesh)
    return mesh


@functools.lru_cache(maxsize=64)
def _check_distinct_devices(mesh: Mesh) -> None:
    devices = list(mesh.devices.flat)
    if not devices:
        raise ShardingError(f"`mesh` has no devices. {available_devices()}")
    seen: set[jax.Device] = set()
    if twice := [d for d in devices if d in seen or seen.add(d)]:
        raise ShardingError(
            f"`mesh` lists {format_devices(twice)} more than once: "
            f"[{format_devices(devices)}]. Each device may appear once in a mesh; build it "
            "with `jaxdev.data_mesh(devices)`, which checks this."
        )


def under_mesh(mesh: Mesh) -> contextlib.AbstractContextManager:
    """The context jaxdev traces and runs user code in for ``mesh``: ``jax.set_mesh(mesh)``.

    Sharding-in-types model code needs a mesh in context. A mesh already set is kept when
    it is ``mesh``; another is refused. Use it in a ``with`` statement; ``reshard`` /
    ``out_sharding=`` over an Auto axis of ``mesh`` inside it raises a named UsageError.

    Raises:
      ShardingError: another mesh is already set with ``jax.set_mesh``.
      UsageError: (on leaving) code inside asked ``reshard`` / ``out_sharding=`` for an Auto axis.

    Example:
      >>> import jax, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> with under_mesh(mesh):
      ...     jax.sharding.get_mesh() == mesh
      True
    """
    current = jax.sharding.get_mesh()
    if current.empty:
        return _Named(jax.set_mesh(mesh), mesh)
    if current == mesh:  # kept, unless a use_abstract_mesh of another mesh is inside it
        kept = jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
        return _Named(None if kept else jax.set_mesh(mesh), mesh)
    raise ShardingError(
        f"a mesh is already set with `jax.set_mesh`: {_describe(current)}, but the strategy's "
        f"mesh is {_describe(mesh)}. Call jaxdev under the strategy's own mesh "
        "(`with jax.set_mesh(strategy.mesh):`) or build the strategy on the mesh you set."
    )


class _Named:
    """``ctx`` (None: nothing to enter), naming JAX's error on the way out: under ``mesh``,
    the raw ValueError for ``reshard`` / ``out_sharding=`` over an Auto axis
    (:func:`auto_axes_error`); outside any mesh (``mesh`` None), a transfer onto a target."""

    __slots__ = ("ctx", "mesh")

    def __init__(self, ctx: Any, mesh: Mesh | None) -> None:
        self.ctx, self.mesh = ctx, mesh

    def __enter__(self) -> Any:
        return None if self.ctx is None else self.ctx.__enter__()

    def __exit__(self, kind: Any, err: Any, tb: Any) -> bool:
        if self.ctx is not None and self.ctx.__exit__(kind, err, tb):
            return True
        if err is None:  # the common case, first
            return False
        if isinstance(err, ValueError) and (named := auto_axes_error(err, self.mesh)):
            raise named from err
        target = isinstance(err, jax.errors.JaxRuntimeError) and "compile-only client" in str(err)
        if target and self.mesh is None:
            raise not_here("placing arrays (to_device, put_batch, init_state...)") from err
        return False


def outside_mesh() -> contextlib.AbstractContextManager:
    """No mesh in context (``jax.set_mesh(None)``), for jaxdev's own programs (checksums,
    re-layouts, ``jax.device_put`` of arrays) over arrays that carry their meshes: a user's
    ``jax.set_mesh`` of another mesh would make JAX refuse them. Call it in a ``with``
    statement, as :func:`under_mesh`; nothing to leave when no mesh is set (1 us, not 3).
    Placing arrays on a target's devices (JAX: 'compile-only client') raises PlacementError."""
    return _OUTSIDE if no_mesh() else _Named(jax.set_mesh(None), None)


def no_mesh() -> bool:
    """Whether no mesh is set: neither ``jax.set_mesh`` nor ``use_abstract_mesh`` (where a
    one-device program runs as it is). Inside a trace ``get_mesh`` raises ``ValueError``."""
    return jax.sharding.get_mesh().empty and jax.sharding.get_abstract_mesh().empty


_OUTSIDE = _Named(None, None)


def _describe(mesh: Mesh) -> str:
    types = ", ".join(t.name for t in mesh.axis_types)
    devices = format_devices(list(mesh.devices.flat))
    return f"Mesh({dict(mesh.shape)}, axis types {types}, devices {devices})"


class MeshBound:
    """A jitted function whose calls and ``lower`` run :func:`under_mesh` of its mesh
    (``mesh=None``: :func:`outside_mesh`, for one device and ``pmap``, which take no
    mesh of the user's: under one, JAX refuses their committed inputs)."""

    def __init__(self, fn: Any, mesh: Mesh | None) -> None:
        self.fn, self.mesh = fn, mesh
        self.call = fn if mesh is None or not is_target(mesh) else functools.partial(_refused, mesh)

    def __call__(self, *args: Any) -> Any:
        return self._run(self.call, args)

    def lower(self, *args: Any) -> Any:
        target = self.call is not self.fn
        if target and any(isinstance(x, jax.Array) for x in jax.tree.leaves(args)):
            raise not_here("running a step (or lowering it with arrays)", self.mesh)  # target
        return self._run(self.fn.lower, args)

    def _run(self, fn: Any, args: tuple[Any, ...]) -> Any:
        # under_mesh names reshard / out_sharding= on Auto axes
        with outside_mesh() if self.mesh is None else under_mesh(self.mesh):
            return fn(*args)


def _refused(mesh: Mesh, *args: Any) -> Any:
    raise not_here("running a step", mesh)


_AUTO_SPEC = re.compile(r"PartitionSpec passed to ([\w.]+) cannot contain axis names that are of")


def auto_axes_error(err: Exception, mesh: Mesh | None) -> UsageError | None:
    """A UsageError when user code asked ``reshard`` / ``out_sharding=`` for an Auto axis of
    ``mesh``, or a Manual one inside ``shard_map=True`` (JAX takes only Explicit axes there;
    its own message names neither fix); None for any other error."""
    text = str(err)
    found, manual = _AUTO_SPEC.search(text), "AxisType.Manual" in text
    if mesh is None or found is None or not (manual or "AxisType.Auto" in text):
        return None
    call = "jax.sharding.reshard" if found[1] == "reshard" else f"{found[1]}(out_sharding=...)"
    explicit = f"`jaxdev.make_mesh({dict(mesh.shape)}, axis_type='explicit')`"
    if manual:
        return UsageError(
            f"your loss or model calls `{call}` with a PartitionSpec inside "
            "`Strategy.sharded(..., shard_map=True)`, where it runs on each device's shard (the "
            f"mesh axes are Manual there) and JAX takes no such spec. Drop the `{call}` there, "
            f"or use shard_map=False on a mesh with Explicit axes ({explicit}). JAX said: {err}"
        )
    return UsageError(
        f"your loss, model or init calls `{call}` with a PartitionSpec over the mesh jaxdev "
        f"runs it under, whose axes are Auto ({_describe(mesh)}); JAX takes such specs only "
        f"on Explicit axes. Build the mesh with Explicit axes: {explicit} "
        "(or jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))), or on Auto axes use "
        f"`jax.lax.with_sharding_constraint(x, P(...))` instead. JAX said: {err}"
    )


MODEL_AXES = ("model", "tensor")
"""Mesh axes the batch is never split over by default (they split the params)."""


def batch_axis(mesh: Mesh, axis: AxisName | None) -> AxisName:
    """The mesh axis (or axes) the batch splits over: the one owner of the default.

    ``axis`` when given; else every mesh axis but the model axes ``'model'`` and
    ``'tensor'`` (a 1-D mesh: its one axis, whatever its name).

    Raises:
      ShardingError: ``axis`` is not an axis of the mesh, or every axis of a multi-axis
        mesh is a model axis.

    Example:
      >>> import jaxdev
      >>> batch_axis(jaxdev.make_mesh({"data": 2, "fsdp": 4}), None)
      ('data', 'fsdp')
    """
    names = mesh.axis_names
    if axis is None:
        axis = tuple(a for a in names if a not in MODEL_AXES) or (names if len(names) == 1 else ())
        if not axis:
            raise ShardingError(
                f"`axis` is needed: every axis of the mesh {dict(mesh.shape)} is a model axis "
                f"{MODEL_AXES}, so there is none to split the batch over. Pass `axis=` with "
                "the axis (or tuple of axes) the batch is split over, or add a 'data' axis."
            )
    wanted = (axis,) if isinstance(axis, str) else tuple(axis)
    missing = [a for a in wanted if a not in names]
    if missing or not wanted:
        raise ShardingError(f"`axis`={axis!r} is not an axis of the mesh; its axes are {names}.")
    return wanted[0] if len(wanted) == 1 else wanted


@functools.lru_cache(maxsize=256)
def batch_layout(mesh: Mesh, axis: AxisName | None) -> tuple[NamedSharding, int]:
    """The batch sharding of ``mesh`` and how many ways it splits the rows."""
    axis = batch_axis(mesh, axis)
    return named_sharding(mesh, P(axis)), axis_size(mesh, axis)


def axis_size(mesh: Mesh, axis: AxisName) -> int:
    """How many ways ``axis`` (a name or tuple of names) splits an array."""
    wanted = (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(mesh.shape[a] for a in wanted)


def make_mesh(
    axes: Mapping[str, int] | Sequence[tuple[str, int]],
    devices: int | DeviceSpec | Sequence[DeviceSpec] | None = None,
    axis_type: AxisType | str | Sequence[AxisType | str] = AxisType.Auto,
    *,
    target: str | None = None,
) -> Mesh:
    """Return an N-D mesh such as ``{"data": 2, "fsdp": 4}`` over ``devices`` (cached).

    Axes are ``Auto`` by default (see :func:`data_mesh`); devices in ``jax.make_mesh`` order.
    With ``target``, the devices are GPUs that need not be here: XLA:GPU compiles for them
    (``step.lower``, ``jaxdev.memory.plan`` / ``fit_memory`` / ``explain_memory``, whose
    default limit is the target's) and nothing is allocated or run on them. That needs the
    CUDA plugin (``pip install 'jaxdev[cuda12]'``), not a GPU; without one, set
    ``JAX_PLATFORMS=cpu`` before JAX starts.

    Args:
      axes: names and sizes in mesh order, a dict or ``(name, size)`` pairs; one size may
        be ``-1`` (every device left over).
      devices: as in :func:`data_mesh`. With ``target``: the device count (``8``: one
        host of up to 8, or of any count not a multiple of 8; hosts of 8 past that), or
        hosts x devices per host (``'2x8'``, ``'32x8'``, XLA's ``'1x2x8'``); default the
        axes' product.
      axis_type: ``'auto'`` (default) or ``'explicit'`` (or ``AxisType``), for every
        axis, or one per axis.
      target: a GPU to plan for, ``'h100'`` (SXM, 80 GB), ``'h200'``, ``'a100-80gb'``, or
        the path of an XLA ``GpuTargetConfig`` text.

    Raises:
      ShardingError: the sizes do not multiply to the device count, a bad size, repeated or
        non-string names, or an unknown ``axis_type``.
      DeviceSpecError, DeviceNotFoundError: ``devices`` is malformed or names a missing device.
      UsageError: an unknown ``target``, or the CUDA plugin is missing.

    Example:
      >>> import jaxdev
      >>> mesh = jaxdev.make_mesh({"data": 2, "fsdp": -1})
      >>> dict(mesh.shape)
      {'data': 2, 'fsdp': 4}
      >>> jaxdev.make_mesh([("data", 2), ("model", 4)]) is jaxdev.make_mesh({"data": 2, "model": 4})
      True
    """
    names, sizes = _parse_axes(axes)
    kinds = _axis_types(axis_type, names)
    if target is not None:
        count = None if -1 in sizes else math.prod(sizes)
        if count is None and devices is None:
            axes_ = dict(zip(names, sizes))
            raise ShardingError(f"`axes` {axes_} has a -1 size with `target=`: pass `devices=`.")
        devs = target_devices(load_target(target), topology(devices, count))
    elif devices is None and jax.process_count() > 1:
        devs = tuple(jax.devices())
    else:
        devs = tuple(device_list(devices))
    shape = ", ".join(f"{n}={s}" for n, s in zip(names, sizes))
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devs) % known:
            raise ShardingError(
                f"`axes` ({shape}) cannot fill {len(devs)} devices: the fixed sizes multiply "
                f"to {known}, which does not divide {len(devs)}. Devices: "
                f"[{format_devices(devs)}]. Choose sizes whose product divides the device "
                "count, or pass `devices=`."
            )
        sizes = tuple(len(devs) // known if s == -1 else s for s in sizes)
    elif known != len(devs):
        raise ShardingError(
            f"`axes` ({shape}) multiply to {known} devices but {len(devs)} were given: "
            f"[{format_devices(devs)}]. Make the sizes multiply to {len(devs)} (one size may "
            "be -1 for the rest)"
            + (f", or pass `devices={known}` for the first {known}." if known < len(devs) else ".")
        )
    return _nd_mesh(devs, names, sizes, kinds)


def _parse_axes(axes: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``axes`` as (names, sizes); raise ShardingError on anything malformed."""
    form = (
        "`axes` must be a dict such as {'data': 2, 'fsdp': 4} or a sequence of "
        "(name, size) pairs such as [('data', 2), ('model', -1)]"
    )
    if isinstance(axes, Mapping):
        pairs = list(axes.items())
    elif isinstance(axes, Sequence) and not isinstance(axes, (str, bytes)):
        pairs = list(axes)
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise ShardingError(f"{form}, got {axes!r}.")
    else:
        raise ShardingError(f"{form}, got {type(axes).__name__} {axes!r}.")
    if not pairs:
        raise ShardingError(f"{form}, got no axes: a mesh needs at least one axis.")
    names, sizes = zip(*pairs)
    if bad := [n for n in names if not isinstance(n, str) or not n]:
        raise ShardingError(f"{form}; axis names must be non-empty strings, got {bad[0]!r}.")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ShardingError(f"{form}; axis names must differ, {twice} appear twice in {axes!r}.")
    for name, size in pairs:
        whole = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
        if not whole or (size < 1 and size != -1):
            raise ShardingError(
                f"{form}; axis {name!r} has size {size!r}, expected an int >= 1 or -1 "
                "(every device left over)."
            )
    if sizes.count(-1) > 1:
        raise ShardingError(f"{form}; only one size may be -1, got {axes!r}.")
    return names, tuple(int(s) for s in sizes)


def _axis_types(axis_type: Any, names: tuple[str, ...]) -> tuple[AxisType, ...]:
    one = isinstance(axis_type, (AxisType, str)) or not isinstance(axis_type, Sequence)
    kinds = (axis_type,) * len(names) if one else tuple(axis_type)
    for k in kinds:
        if not isinstance(k, AxisType) and not (isinstance(k, str) and k.lower() in _AXIS_TYPES):
            raise ShardingError(
                f"`axis_type` must be AxisType.Auto, AxisType.Explicit, 'auto' or 'explicit', "
                f"got {k!r}."
            )
    if len(kinds) != len(names):
        raise ShardingError(
            f"`axis_type` lists {len(kinds)} types for {len(names)} axes {names}; give one "
            "per axis or a single 'auto' / 'explicit' for all."
        )
    return tuple(k if isinstance(k, AxisType) else _AXIS_TYPES[k.lower()] for k in kinds)


@functools.lru_cache(maxsize=64)
def _nd_mesh(
    devs: tuple[jax.Device, ...],
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    kinds: tuple[AxisType, ...],
) -> Mesh:
    """One cached ``Mesh`` per (devices, names, sizes, axis types)."""
    if len(names) == 1:
        return mesh_of(devs, names[0], kinds[0])
    try:  # topology-aware order (neighbours together on GPU/TPU)
        return jax.make_mesh(sizes, names, axis_types=kinds, devices=list(devs))
    except Exception:  # a device subset mesh_utils cannot lay out: keep the order given
        return Mesh(np.array(devs).reshape(sizes), names, axis_types=kinds)
