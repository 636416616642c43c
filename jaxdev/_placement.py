"""Move, copy and fetch pytrees; report where every leaf lives.

Leaf policy (every public function here): ``jax.Array``, numpy arrays and
scalars, and Python ``bool``/``int``/``float``/``complex`` are placed;
``None`` is an empty subtree and passes through; anything else raises
:class:`LeafTypeError` naming its key path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from ._devices import DeviceSpec, device
from ._errors import (
    DeletedArrayError,
    LeafTypeError,
    LeafValueError,
    PlacementError,
    ShardingError,
    available_devices,
    format_devices,
    join_failures,
    keystr,
)

Target = DeviceSpec | Sharding
"""Where to place: a ``jax.Device``, a spec (``'gpu:1'``, ``3``) or a ``Sharding``."""

_PY_SCALARS = (bool, int, float, complex)

_INT32 = np.iinfo(np.int32)
_UINT32 = np.iinfo(np.uint32)


# ---------------------------------------------------------------- leaf checks


def as_sharding(target: Target) -> Sharding:
    """Return ``target`` as a ``jax.sharding.Sharding``.

    Args:
      target: a ``Sharding`` (returned as is), or a device spec.

    Example:
      >>> import jaxdev
      >>> jaxdev.as_sharding("cpu:0").device_set == {jaxdev.cpu(0)}
      True
    """
    if isinstance(target, Sharding):
        return target
    return SingleDeviceSharding(device(target))


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(tree)


def _path_of(tree: Any, index: int) -> str:
    """Key path of leaf ``index`` (computed only when an error needs it)."""
    return keystr(jax.tree_util.tree_flatten_with_path(tree)[0][index][0])


def _is_jax_array(x: Any) -> bool:
    """``isinstance(x, jax.Array)`` without the ABC check for the common leaf types.

    ``jax.Array``'s ``isinstance`` costs ~0.5 us; placement checks run it for
    every leaf several times.
    """
    t = type(x)
    if t is _array_type():
        return True
    if t is np.ndarray or t in _PY_SCALARS:
        return False
    return isinstance(x, jax.Array)


def _is_tracer(leaf: Any) -> bool:
    return isinstance(leaf, jax.core.Tracer)


def _host_problem(leaf: Any) -> tuple[type[Exception], str] | None:
    """Why a host leaf can't be placed without loss, or None if it can."""
    if isinstance(leaf, _PY_SCALARS):
        if isinstance(leaf, int) and not isinstance(leaf, bool) and not _x64():
            if not _INT32.min <= leaf <= _INT32.max:
                return LeafValueError, (
                    f"the Python int {leaf} does not fit int32 and x64 is disabled (JAX "
                    "refuses it, and truncates the same value silently once it is a numpy "
                    "int64); enable `jax_enable_x64` or pass a float"
                )
        return None
    if isinstance(leaf, (np.ndarray, np.generic)):
        kind = leaf.dtype.kind
        if kind in "OUSMm" or (kind == "V" and not _is_ml_dtype(leaf.dtype)):
            return LeafTypeError, (
                f"a numpy value of dtype {leaf.dtype} cannot live on a device; "
                "expected a numeric or bool dtype"
            )
        if leaf.dtype.itemsize == 8 and kind in "iu" and not _x64() and leaf.size:
            bounds = _INT32 if kind == "i" else _UINT32
            lo, hi = leaf.min(), leaf.max()
            if lo < bounds.min or hi > bounds.max:
                return LeafValueError, (
                    f"{leaf.dtype} values in [{lo}, {hi}] do not fit "
                    f"{'int32' if kind == 'i' else 'uint32'} and x64 is disabled, so JAX "
                    "would silently truncate them; enable `jax_enable_x64` or cast first"
                )
        return None
    return LeafTypeError, (
        f"a {type(leaf).__module__}.{type(leaf).__qualname__} is not an array; expected "
        "a jax.Array, numpy array or Python number (None passes through)"
    )


def _is_ml_dtype(dtype: np.dtype) -> bool:
    """bfloat16, float8_*, int4: numpy kind 'V' but real JAX dtypes."""
    return dtype.names is None and dtype.type.__module__.startswith("ml_dtypes")


def _x64() -> bool:
    return bool(jax.config.jax_enable_x64)


def _raise_leaf(tree: Any, index: int, arg: str, exc: type[Exception], why: str) -> None:
    raise exc(f"`{arg}` leaf {_path_of(tree, index)}: {why}. {available_devices()}")


def _check_live(tree: Any, leaves: Sequence[Any], arg: str) -> None:
    """Raise DeletedArrayError naming every deleted or donated leaf."""
    dead = [i for i, x in enumerate(leaves) if _is_jax_array(x) and _deleted(x)]
    if dead:
        paths = [_path_of(tree, i) for i in dead]
        raise DeletedArrayError(
            f"`{arg}` has {len(dead)} deleted or donated leaf/leaves: {', '.join(paths)}. "
            "Their buffers were freed (`x.delete()` or passed to a jit with "
            "`donate_argnums`); use the arrays the donating call returned."
        )


def _deleted(x: jax.Array) -> bool:
    try:
        return x.is_deleted()
    except Exception:  # tracers and exotic arrays have no buffers to delete
        return False


def _check_host_leaves(tree: Any, leaves: Sequence[Any], arg: str) -> None:
    for i, leaf in enumerate(leaves):
        if not _is_jax_array(leaf):
            problem = _host_problem(leaf)
            if problem is not None:
                _raise_leaf(tree, i, arg, *problem)


def _check_fits(tree: Any, leaves: Sequence[Any], idx: Sequence[int], s: Sharding, arg: str):
    """Raise ShardingError naming leaves whose shape ``s`` cannot split."""
    if isinstance(s, SingleDeviceSharding):
        return
    for i in idx:
        shape = np.shape(leaves[i])
        try:
            s.shard_shape(shape)
        except Exception as err:  # JAX raises ValueError / IndexError / AssertionError
            raise ShardingError(
                f"`{arg}` leaf {_path_of(tree, i)} with shape {shape} cannot be placed on "
                f"{_describe_sharding(s)}: {err}. Pad the leaf or choose a spec that "
                f"divides its shape. {available_devices()}"
            ) from None


@functools.cache
def _array_type() -> type:
    """jaxlib's concrete array class, found once without touching a device.

    Only an exact-type fast path uses it; other ``jax.Array`` types take the
    general route, so a moved private name costs speed, not correctness.
    """
    try:
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - a newer JAX moved it
        return type(jax.numpy.zeros(()))
    return ArrayImpl


def _all_placed(leaves: Sequence[Any], s: Sharding) -> bool:
    """One cheap pass: is every leaf a live, committed array with sharding ``s``?

    The common no-op case touches no runtime and no key paths; anything
    unusual (host data, tracers, equivalent-but-unequal shardings, deleted
    buffers) falls through to the careful path.
    """
    array_type = _array_type()
    want = _sharding_key(s)
    ok = None
    for x in leaves:
        if type(x) is not array_type or not x.committed:
            return False
        have = x.sharding
        if have is not ok:
            if _sharding_key(have) != want:
                return False
            ok = have
        if x.is_deleted():
            return False
    return True


def _sharding_key(s: Sharding) -> Any:
    """A value equal exactly when the shardings are equal, cheap for single devices.

    JAX's ``SingleDeviceSharding.__eq__``/``__hash__`` run in Python (~1 us);
    every array put on its own gets its own sharding object, so a 2000-leaf
    tree pays that 2000 times. Its ``(device, memory kind)`` pair is the same
    test at a fraction of the cost. Other shardings are their own key.
    """
    if type(s) is SingleDeviceSharding:
        try:
            return s._device, s._memory_kind
        except AttributeError:  # pragma: no cover - a newer JAX renamed them
            pass
    return s


def _is_placed(leaf: Any, s: Sharding) -> bool:
    if not _is_jax_array(leaf) or not leaf.committed:
        return False
    have = leaf.sharding
    if have == s:
        return True
    if type(have) is type(s) and not isinstance(s, NamedSharding):
        return False
    try:
        return have.is_equivalent_to(s, leaf.ndim)
    except Exception:
        return False


# ---------------------------------------------------------------- move / copy


def to_device(tree: Any, target: Target) -> Any:
    """Place every leaf of ``tree`` on ``target``; already placed leaves stay as they are.

    d2l's ``as_in_ctx`` and torch's ``.to``: a committed leaf already on
    ``target`` comes back as the *same object* (raw ``jax.device_put`` returns
    a new one), the leaves that must move go in one batched
    ``jax.device_put``, and if nothing moves ``tree`` itself is returned.
    Uncommitted arrays (made without a device) are committed to ``target``.
    Host dtypes follow JAX's rules (with x64 off, ``float64`` becomes
    ``float32``), except that integers which would be truncated are refused.

    Like ``jax.device_put``, placing a numpy array on a CPU device may alias
    its buffer (JAX does so for aligned arrays even with ``may_alias=False``),
    so writing into that numpy array later changes the jax.Array. Use
    :func:`copy_to` when the host buffer will be reused.

    Inside ``jax.jit``, a ``Sharding`` target becomes
    ``jax.lax.with_sharding_constraint``; a single device target raises,
    because JAX silently ignores ``device_put`` to a device inside ``jit``.

    Args:
      tree: any pytree (Flax params, optax state, a batch).
      target: a ``jax.Device``, a spec such as ``'gpu:1'``, or a ``Sharding``.

    Returns:
      A pytree with the structure of ``tree`` whose leaves live on ``target``.

    Raises:
      LeafTypeError: a leaf is not an array or number (its key path named).
      LeafValueError: an int leaf would be truncated (x64 disabled).
      DeletedArrayError: a leaf was deleted or donated.
      ShardingError: a leaf's shape does not divide over ``target``.
      PlacementError: a device target inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones((2, 2))}, "cpu:0")
      >>> jaxdev.to_device(params, "cpu:0") is params
      True
    """
    sharding = as_sharding(target)
    leaves, treedef = _flatten(tree)
    if _all_placed(leaves, sharding):
        return tree
    moving = _plan_moves(tree, leaves, sharding)
    if moving is None:  # inside a trace
        return _constrain(tree, leaves, treedef, target, sharding)
    _check_fits(tree, leaves, moving, sharding, "tree")
    moved = jax.device_put([leaves[i] for i in moving], _put_target(target, sharding))
    out = list(leaves)
    for i, new in zip(moving, moved):
        out[i] = new
    return jax.tree_util.tree_unflatten(treedef, out)


def _put_target(target: Target, s: Sharding) -> Sharding | jax.Device:
    """What to hand ``jax.device_put``: the device itself when ``target`` named one.

    JAX's put is ~5% faster given a device than its ``SingleDeviceSharding``.
    """
    return s if isinstance(target, Sharding) else next(iter(s.device_set))


_PLAIN_KINDS = frozenset("fcb")  # float, complex, bool numpy dtypes: nothing to check


def _plan_moves(tree: Any, leaves: Sequence[Any], s: Sharding) -> list[int] | None:
    """One pass over the leaves: the indexes that must move to ``s``.

    Returns None when a leaf is a tracer (the caller constrains instead).
    Raises like ``_check_live`` then ``_check_host_leaves`` would: every
    deleted leaf named first, else the first host leaf that can't be placed.
    The common leaf types (jaxlib arrays, float numpy arrays) skip the
    generic checks, which cost ~1 us a leaf.
    """
    array_type, want = _array_type(), _sharding_key(s)
    moving: list[int] = []
    dead: list[int] = []
    problem: tuple[int, tuple[type[Exception], str]] | None = None
    for i, x in enumerate(leaves):
        t = type(x)
        if t is array_type:
            if x.is_deleted():
                dead.append(i)
            elif not (x.committed and _sharding_key(x.sharding) == want) and not _is_placed(x, s):
                moving.append(i)
            continue
        if t is np.ndarray and x.dtype.kind in _PLAIN_KINDS:
            moving.append(i)
            continue
        if _is_tracer(x):
            return None
        if isinstance(x, jax.Array):
            if _deleted(x):
                dead.append(i)
            elif not _is_placed(x, s):
                moving.append(i)
            continue
        if problem is None:
            found = _host_problem(x)
            if found is not None:
                problem = (i, found)
        moving.append(i)
    if dead:
        _check_live(tree, leaves, "tree")
    if problem is not None:
        _raise_leaf(tree, problem[0], "tree", *problem[1])
    return moving


def _constrain(tree: Any, leaves: list[Any], treedef: Any, target: Target, s: Sharding):
    if not isinstance(target, Sharding):
        raise PlacementError(
            f"`to_device(tree, {target!r})` inside a jax.jit trace: JAX ignores placing on "
            "a single device inside jit, so this would silently do nothing. Place the inputs "
            "before calling the jitted function, or pass a Sharding (e.g. "
            "NamedSharding(mesh, P())) to constrain the layout inside jit."
        )
    _check_fits(tree, leaves, range(len(leaves)), s, "tree")
    return jax.tree_util.tree_unflatten(treedef, jax.lax.with_sharding_constraint(leaves, s))


def copy_to(tree: Any, target: Target) -> Any:
    """Copy every leaf of ``tree`` to ``target`` into new buffers (d2l's ``copyto``).

    Unlike :func:`to_device`, nothing is reused: the result never shares a
    buffer with the input, even when a leaf already lives on ``target``.
    One batched ``jax.device_put`` does the copies.

    Args:
      tree: any pytree.
      target: a ``jax.Device``, a spec, or a ``Sharding``.

    Returns:
      A new pytree of committed arrays on ``target``.

    Raises:
      Same as :func:`to_device`; inside ``jit`` it raises ``PlacementError``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> x = jaxdev.to_device(jnp.arange(3), "cpu:0")
      >>> y = jaxdev.copy_to(x, "cpu:0")
      >>> y is x, y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
      (False, False)
    """
    sharding = as_sharding(target)
    leaves, treedef = _flatten(tree)
    if _plan_moves(tree, leaves, sharding) is None:  # validates every leaf in one pass
        raise PlacementError(
            "`copy_to` inside a jax.jit trace: buffers do not exist while tracing. "
            "Copy before or after the jitted call."
        )
    _check_fits(tree, leaves, range(len(leaves)), sharding, "tree")
    # On CPU, JAX aliases aligned numpy buffers even with may_alias=False
    # (measured on jax 0.10.2), so host leaves are copied first.
    leaves = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in leaves]
    # The fresh numpy copies may be aliased; device arrays must be copied.
    may_alias = [None if isinstance(x, np.ndarray) else False for x in leaves]
    copied = jax.device_put(leaves, _put_target(target, sharding), may_alias=may_alias)
    return jax.tree_util.tree_unflatten(treedef, _unalias(leaves, copied))


def _unalias(sources: Sequence[Any], outs: list[Any]) -> list[Any]:
    """Re-copy output shards that still share a buffer with their source.

    jax 0.10.2 keeps the source's buffer as one shard when a single-device
    array is put on a multi-device sharding, even with ``may_alias=False``;
    donating that copy would then delete the source.
    """
    for i, (src, out) in enumerate(zip(sources, outs)):
        if not _is_jax_array(src) or len(out.sharding.device_set) == 1:
            continue
        mine = {_pointer(sh.data) for sh in src.addressable_shards}
        shards = [sh.data for sh in out.addressable_shards]
        if mine.isdisjoint(_pointer(a) for a in shards):
            continue
        fresh = [
            jax.device_put(a, a.sharding, may_alias=False) if _pointer(a) in mine else a
            for a in shards
        ]
        outs[i] = jax.make_array_from_single_device_arrays(out.shape, out.sharding, fresh)
    return outs


def _pointer(x: jax.Array) -> int | None:
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # some backends/layouts expose no pointer; then nothing aliases
        return None


def to_host(tree: Any) -> Any:
    """Fetch every leaf of ``tree`` to host numpy with one ``jax.device_get``.

    Args:
      tree: any pytree; host leaves pass through unchanged.

    Returns:
      The same structure with ``numpy.ndarray`` leaves (numbers stay numbers).

    Raises:
      DeletedArrayError: a leaf was deleted or donated.
      LeafTypeError: a leaf is not an array or number.
      PlacementError: called inside ``jit`` on traced values.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.to_host({"x": jnp.arange(3)})["x"].tolist()
      [0, 1, 2]
    """
    leaves, _ = _flatten(tree)
    if any(_is_tracer(x) for x in leaves):
        raise PlacementError(
            "`to_host` inside a jax.jit trace: values are not computed yet. Return them "
            "from the jitted function and fetch afterwards (or use jax.debug.callback)."
        )
    _check_live(tree, leaves, "tree")
    _check_host_leaves(tree, leaves, "tree")
    return jax.device_get(tree)


# ---------------------------------------------------------------- where is it


def device_of(x: Any) -> jax.Device | None:
    """Return the one device holding array ``x``; ``None`` for host values.

    Args:
      x: a ``jax.Array``, numpy array or Python number.

    Raises:
      PlacementError: ``x`` spans several devices (use :func:`devices_of`).
      DeletedArrayError: ``x`` was deleted or donated.
      LeafTypeError: ``x`` is not an array or number.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.device_of(jaxdev.to_device(jnp.ones(2), "cpu:0")) == jaxdev.cpu(0)
      True
    """
    found = devices_of(x)
    if not found:
        return None
    if len(found) > 1:
        raise PlacementError(
            f"`x` spans {len(found)} devices [{format_devices(sorted(found, key=_dev_key))}] "
            f"(sharding {_describe_sharding(x.sharding)}); use `devices_of(x)` for all of them."
        )
    return next(iter(found))


def devices_of(tree: Any) -> set[jax.Device]:
    """Return the set of devices holding any leaf of ``tree`` (host leaves add none).

    Raises:
      DeletedArrayError: a leaf was deleted or donated.
      LeafTypeError: a leaf is not an array or number.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.devices_of({"a": jaxdev.to_device(jnp.ones(2), "cpu:0"), "b": 1.0})
      {CpuDevice(id=0)}
    """
    leaves, _ = _flatten(tree)
    _check_live(tree, leaves, "tree")
    _check_host_leaves(tree, leaves, "tree")
    out: set[jax.Device] = set()
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not _is_tracer(leaf):
            out |= leaf.sharding.device_set
    return out


def common_device(tree: Any) -> jax.Device | None:
    """Return the one device every committed leaf of ``tree`` lives on.

    Call it before combining leaves in one computation: JAX refuses arrays
    committed to different devices with a message that names positional
    arguments, not leaves. Uncommitted and host leaves follow the others.

    Returns:
      The device, or ``None`` when no leaf is committed.

    Raises:
      PlacementError: leaves are committed to different devices or span
        several; every leaf is listed with its devices.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> t = jaxdev.to_device({"a": jnp.ones(2), "b": jnp.zeros(2)}, "cpu:0")
      >>> jaxdev.common_device(t) == jaxdev.cpu(0)
      True
    """
    leaves, _ = _flatten(tree)
    _check_live(tree, leaves, "tree")
    _check_host_leaves(tree, leaves, "tree")
    committed = [(i, x) for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.committed]
    sets = {frozenset(x.sharding.device_set) for _, x in committed}
    if not sets:
        return None
    if len(sets) == 1 and len(next(iter(sets))) == 1:
        return next(iter(next(iter(sets))))
    lines = [
        f"{_path_of(tree, i)}: {format_devices(sorted(x.sharding.device_set, key=_dev_key))}"
        for i, x in committed
    ]
    raise PlacementError(
        join_failures(
            "`tree` has leaves committed to different devices, so they cannot be combined "
            "in one computation without a copy. Move them first with "
            "`jaxdev.to_device(tree, device)`. Leaves and their devices:",
            lines,
        )
    )


def _dev_key(d: jax.Device) -> tuple[str, int]:
    return (d.platform, d.id)


# ---------------------------------------------------------------- report


class LeafPlacement(NamedTuple):
    """Where one leaf lives (one row of :class:`PlacementReport`)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    devices: tuple[str, ...]
    sharding: str
    memory_kind: str | None
    committed: bool | None
    bytes_per_device: int
    deleted: bool = False


class PlacementReport(NamedTuple):
    """Per-leaf placement of a pytree, with per-device byte totals.

    ``str(report)`` is a table; ``report.diff(other)`` lists the leaves whose
    placement differs between two trees.
    """

    leaves: tuple[LeafPlacement, ...]
    bytes_by_device: dict[str, int]

    def __str__(self) -> str:
        return format_report(self)

    def diff(self, other: PlacementReport) -> list[str]:
        """Return one line per leaf placed differently in ``other`` ([] when equal)."""
        return diff_reports(self, other)


def _describe_sharding(s: Sharding) -> str:
    if isinstance(s, SingleDeviceSharding):
        d = next(iter(s.device_set))
        return f"{d.platform}:{d.id}"
    if isinstance(s, NamedSharding):
        axes = ",".join(f"{k}={v}" for k, v in s.mesh.shape.items())
        return f"mesh({axes}) {s.spec}"
    return type(s).__name__


class _ShardingInfo(NamedTuple):
    description: str
    devices: tuple[str, ...]
    memory_kind: str | None
    local: tuple[str, ...]  # this process's devices, for the per-device totals


def _sharding_info(s: Sharding) -> _ShardingInfo:
    names = tuple(_dev_name(d) for d in sorted(s.device_set, key=_dev_key))
    local = tuple(_dev_name(d) for d in sorted(s.addressable_devices, key=_dev_key))
    return _ShardingInfo(_describe_sharding(s), names, s.memory_kind, local)


def _dev_name(d: jax.Device) -> str:
    return f"{d.platform}:{d.id}"


class _Kind:
    """What every leaf with one (sharding, shape, dtype) shares in the report."""

    __slots__ = ("row_head", "info", "nbytes", "count")

    def __init__(self, shape: tuple[int, ...], dtype: str, info: _ShardingInfo, nbytes: int):
        # The row fields after the path: shape, dtype, devices, sharding, memory kind.
        self.row_head = (shape, dtype, info.devices, info.description, info.memory_kind)
        self.info, self.nbytes, self.count = info, nbytes, 0


class _ReportBuilder:
    """Builds rows with one cache per (sharding, shape, dtype) (2000 leaves < 10 ms).

    Per-device totals are summed per kind at the end, not per leaf.
    """

    def __init__(self) -> None:
        self.rows: list[LeafPlacement] = []
        self._kinds: dict[tuple[Any, tuple[int, ...], Any], _Kind] = {}
        self._infos: dict[Sharding, _ShardingInfo] = {}
        self._extra: dict[str, int] = {}  # totals of leaves outside the fast path

    @property
    def totals(self) -> dict[str, int]:
        out = dict(self._extra)
        for kind in self._kinds.values():
            for name in kind.info.local:
                out[name] = out.get(name, 0) + kind.nbytes * kind.count
        return out

    def _kind(self, key: tuple[Any, tuple[int, ...], Any], s: Sharding) -> _Kind:
        _, shape, dtype = key
        info = self._infos.get(s)
        if info is None:
            info = self._infos[s] = _sharding_info(s)
        nbytes = math.prod(s.shard_shape(shape)) * dtype.itemsize
        kind = self._kinds[key] = _Kind(shape, str(dtype), info, nbytes)
        return kind

    def add_all(self, paths: Sequence[str], leaves: Sequence[Any]) -> None:
        """Add leaves with their key-path strings; the common array case is inlined (hot loop)."""
        array_type, kinds, append = _array_type(), self._kinds, self.rows.append
        new_row, row_type = tuple.__new__, LeafPlacement  # skips the NamedTuple's __new__
        for path, leaf in zip(paths, leaves):
            if type(leaf) is not array_type or leaf.is_deleted():
                self._add_unusual(path, leaf)
                continue
            s = leaf.sharding
            key = (_sharding_key(s), leaf.shape, leaf.dtype)
            kind = kinds.get(key)
            if kind is None:
                kind = self._kind(key, s)
            kind.count += 1
            append(new_row(row_type, (path, *kind.row_head, leaf.committed, kind.nbytes, False)))

    def _add_unusual(self, path: str, leaf: Any) -> None:
        if type(leaf) is _array_type():  # deleted
            shape, dtype = leaf.shape, str(leaf.dtype)
            self.rows.append(LeafPlacement(path, shape, dtype, (), "deleted", None, None, 0, True))
        elif not isinstance(leaf, jax.Array):
            self.rows.append(_host_row(path, leaf))
        elif _is_tracer(leaf):
            shape, dtype = tuple(leaf.shape), str(leaf.dtype)
            self.rows.append(LeafPlacement(path, shape, dtype, (), "traced", None, None, 0))
        else:  # another jax.Array implementation: take the general route
            shape, dtype = tuple(leaf.shape), str(leaf.dtype)
            if _deleted(leaf):
                self.rows.append(
                    LeafPlacement(path, shape, dtype, (), "deleted", None, None, 0, True)
                )
                return
            info = _sharding_info(leaf.sharding)
            nbytes = math.prod(leaf.sharding.shard_shape(shape)) * leaf.dtype.itemsize
            self.rows.append(
                LeafPlacement(
                    path,
                    shape,
                    dtype,
                    info.devices,
                    info.description,
                    info.memory_kind,
                    leaf.committed,
                    nbytes,
                )
            )
            for name in info.local:
                self._extra[name] = self._extra.get(name, 0) + nbytes


def _host_row(path: str, leaf: Any) -> LeafPlacement:
    problem = _host_problem(leaf)
    if problem is not None and problem[0] is LeafTypeError:
        raise LeafTypeError(f"`tree` leaf {path}: {problem[1]}.")
    arr = np.asarray(leaf)
    return LeafPlacement(path, arr.shape, str(arr.dtype), (), "host", None, None, arr.nbytes)


def placement(tree: Any) -> PlacementReport:
    """Report where every leaf of ``tree`` lives.

    Each row has the key path, shape, dtype, devices, sharding (device, or
    mesh and spec), memory kind, committed, and bytes held on each of its
    devices. Deleted or donated leaves are shown as such, not raised; traced
    leaves (inside ``jit``) are shown as ``traced``. Byte totals count this
    process's devices.

    Args:
      tree: any pytree.

    Returns:
      A :class:`PlacementReport`; ``print`` it for a table.

    Raises:
      LeafTypeError: a leaf is not an array or number.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> r = jaxdev.placement({"w": jaxdev.to_device(jnp.ones((2, 3)), "cpu:0")})
      >>> r.leaves[0].path, r.leaves[0].devices, r.bytes_by_device
      ("['w']", ('cpu:0',), {'cpu:0': 24})
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    builder = _ReportBuilder()
    builder.add_all(_key_strings(tree, treedef), leaves)
    totals = dict(sorted(builder.totals.items(), key=lambda kv: _name_key(kv[0])))
    return PlacementReport(tuple(builder.rows), totals)


_KEY_STRINGS: dict[Any, tuple[str, ...]] = {}  # treedef -> its leaves' key paths
_KEY_STRINGS_MAX = 64


def _key_strings(tree: Any, treedef: Any) -> tuple[str, ...]:
    """Key-path strings of ``tree``'s leaves (``jax.tree_util.keystr``), cached per treedef.

    Key paths are a function of the structure alone, and a tree is usually
    reported many times (every epoch, every step of a debug loop): the cache
    saves ``tree_flatten_with_path`` and 2000 string joins on a 2000-leaf tree.
    """
    try:
        cached = _KEY_STRINGS.get(treedef)
    except TypeError:  # a custom node with unhashable aux data
        cached, treedef = None, None
    if cached is not None:
        return cached
    names: dict[Any, str] = {}  # key -> str(key): upper levels repeat on every leaf
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            name = names.get(k)
            if name is None:
                name = names[k] = str(k)
            parts.append(name)
        paths.append("".join(parts) or "<root>")
    out = tuple(paths)
    if treedef is not None:
        if len(_KEY_STRINGS) >= _KEY_STRINGS_MAX:
            try:  # drop the oldest; another thread may be doing the same
                _KEY_STRINGS.pop(next(iter(_KEY_STRINGS)), None)
            except (RuntimeError, StopIteration):
                pass
        _KEY_STRINGS[treedef] = out
    return out


def _name_key(name: str) -> tuple[str, int]:
    platform, _, index = name.partition(":")
    return platform, int(index)


def format_report(report: PlacementReport) -> str:
    """Return a placement report as a fixed-width text table (what ``print(report)`` shows).

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> tree = {"w": jaxdev.to_device(jnp.ones((2, 3)), "cpu:0")}
      >>> print(jaxdev.format_report(jaxdev.placement(tree)))
      path   shape  dtype    placement  memory  committed  bytes/device
      -----  -----  -------  ---------  ------  ---------  ------------
      ['w']  2x3    float32  cpu:0      device  yes        24 B
      1 leaves, 24 B on devices (cpu:0: 24 B)
    """
    head = ("path", "shape", "dtype", "placement", "memory", "committed", "bytes/device")
    body = [
        (
            r.path,
            "x".join(map(str, r.shape)) or "()",
            r.dtype,
            r.sharding if len(r.devices) <= 1 else f"{r.sharding} on {len(r.devices)} devices",
            r.memory_kind or "-",
            "-" if r.committed is None else ("yes" if r.committed else "no"),
            _human(r.bytes_per_device),
        )
        for r in report.leaves
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in body]
    total = sum(report.bytes_by_device.values())
    per = ", ".join(f"{k}: {_human(v)}" for k, v in report.bytes_by_device.items())
    lines.append(f"{len(report.leaves)} leaves, {_human(total)} on devices ({per or 'none'})")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def diff_reports(a: PlacementReport, b: PlacementReport) -> list[str]:
    """Return one line per leaf whose placement differs between ``a`` and ``b``.

    Compares devices, sharding, memory kind and committed-ness; leaves present
    in only one tree are listed too.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> a = jaxdev.placement({"w": jaxdev.to_device(jnp.ones(2), "cpu:0")})
      >>> a.diff(a)
      []
    """
    rows_a = {r.path: r for r in a.leaves}
    rows_b = {r.path: r for r in b.leaves}
    out = []
    for path in list(rows_a) + [p for p in rows_b if p not in rows_a]:
        ra, rb = rows_a.get(path), rows_b.get(path)
        if ra is None or rb is None:
            out.append(f"{path}: only in {'first' if rb is None else 'second'} tree")
            continue
        for field in ("sharding", "devices", "memory_kind", "committed", "deleted"):
            va, vb = getattr(ra, field), getattr(rb, field)
            if va != vb:
                out.append(f"{path}: {field} {va!r} != {vb!r}")
    return out
