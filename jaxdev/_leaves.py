"""The bottom floor: what a leaf is, where it lives, and how to name it (imports only _errors)."""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding, SingleDeviceSharding

from ._errors import (
    DeletedArrayError,
    LeafTypeError,
    LeafValueError,
    PlacementError,
    ShardingError,
    available_devices,
    device_name,
    join_failures,
)

PY_SCALARS = (bool, int, float, complex)

_INT32 = np.iinfo(np.int32)
_UINT32 = np.iinfo(np.uint32)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------- leaf kinds


@functools.cache
def array_type() -> type:
    """jaxlib's concrete array class, found once without a device (exact-type fast paths only)."""
    try:  # private: no public name of the concrete array class (only the abstract jax.Array)
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - a newer JAX moved it
        return type(jax.numpy.zeros(()))
    return ArrayImpl


def is_jax_array(x: Any) -> bool:
    """``isinstance(x, jax.Array)`` (tracers included), fast for the common leaf types."""
    t = type(x)
    if t is array_type():
        return True
    if t is np.ndarray or t in PY_SCALARS:
        return False
    return isinstance(x, jax.Array)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a tracer (inside ``jit``/``grad``/``vmap``)."""
    return isinstance(x, jax.core.Tracer)


def shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    """A leaf's shape and its dtype on a device (x64 rules for host values and shapes, as
    JAX lowers them; JAX's extended dtypes kept)."""
    if is_jax_array(x):
        return tuple(x.shape), x.dtype
    if isinstance(x, jax.ShapeDtypeStruct):
        return tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True)
    if isinstance(x, PY_SCALARS):
        return (), np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(type(x))))
    arr = np.asarray(x)  # numpy leaves (state_shardings has checked the types)
    return arr.shape, np.dtype(jax.dtypes.canonicalize_dtype(arr.dtype))


def packed_bytes(n: int, dtype: Any) -> int:
    """Bytes of ``n`` elements as XLA stores them: sub-byte dtypes packed (two int4 a byte)."""
    return -(-n * _bits(dtype) // 8)


@functools.lru_cache(maxsize=256)
def _bits(dtype: Any) -> int:
    """Bits an element of ``dtype`` takes (a PRNG key: its itemsize's)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return 8 * dtype.itemsize
    return jax.dtypes.itemsize_bits(dtype)


def inside_trace() -> bool:
    """Whether a JAX transformation (jit, grad, vmap, eval_shape, ...) is tracing here: the
    public ``jax.sharding.get_mesh`` refuses to run then."""
    try:
        jax.sharding.get_mesh()
    except ValueError:
        return True
    return False


def is_concrete(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` with buffers (not a tracer)."""
    return type(x) is array_type() or (is_jax_array(x) and not is_tracer(x))


def deleted(x: jax.Array) -> bool:
    """Whether array ``x`` was deleted or donated (tracers never are)."""
    try:
        return x.is_deleted()
    except Exception:  # tracers and exotic arrays have no buffers to delete
        return False


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``key<fry>``, ``key<rbg>``: no numpy dtype)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_host_value(x: Any) -> bool:
    """Whether ``x`` is a numeric numpy value or a Python number (lives on the host)."""
    if isinstance(x, PY_SCALARS):
        return True
    if isinstance(x, (np.ndarray, np.generic)):
        kind = x.dtype.kind  # bfloat16, float8_*, int4: numpy kind 'V' but real JAX dtypes
        return kind in "biufc" or kind == "V" and bool(jax.dtypes.issubdtype(x.dtype, np.number))
    return False


def x64() -> bool:
    """Whether ``jax_enable_x64`` is on."""
    return bool(jax.config.jax_enable_x64)


def host_problem(leaf: Any) -> tuple[type[Exception], str] | None:
    """Why a host leaf can't be placed without loss (str, object, 64-bit overflow), or None."""
    if isinstance(leaf, PY_SCALARS):
        if isinstance(leaf, int) and not x64() and not _INT32.min <= leaf <= _INT32.max:
            return LeafValueError, (
                f"the Python int {leaf} does not fit int32 and x64 is disabled (JAX "
                "refuses it, and truncates the same value silently once it is a numpy "
                "int64); enable `jax_enable_x64` or pass a float"
            )
        if isinstance(leaf, float) and not x64() and abs(leaf) > _FLOAT32_MAX and np.isfinite(leaf):
            return LeafValueError, _overflow_why(leaf, leaf)
        return None
    if isinstance(leaf, (np.ndarray, np.generic)):
        kind = leaf.dtype.kind
        if not is_host_value(leaf):  # str, bytes, object, datetime, void
            return LeafTypeError, (
                f"a numpy value of dtype {leaf.dtype} cannot live on a device; "
                "expected a numeric or bool dtype"
            )
        if leaf.dtype.itemsize == 8 and not x64() and leaf.size and kind in "iuf":
            return _wide_problem(leaf, kind)
        return None
    return LeafTypeError, (
        f"a {type(leaf).__module__}.{type(leaf).__qualname__} is not an array; expected "
        "a jax.Array, numpy array or Python number (None passes through)"
    )


def _wide_problem(leaf: np.ndarray, kind: str) -> tuple[type[Exception], str] | None:
    """Why 64-bit values do not fit int32 / uint32 / float32 (x64 disabled), or None."""
    if kind == "f":
        big = np.max(np.abs(leaf), where=np.isfinite(leaf), initial=0.0)
        return (LeafValueError, _overflow_why(big, leaf.dtype)) if big > _FLOAT32_MAX else None
    bounds = _INT32 if kind == "i" else _UINT32
    lo, hi = leaf.min(), leaf.max()
    if lo < bounds.min or hi > bounds.max:
        return LeafValueError, (
            f"{leaf.dtype} values in [{lo}, {hi}] do not fit "
            f"{bounds.dtype} and x64 is disabled, so JAX "
            "would silently truncate them; enable `jax_enable_x64` or cast first"
        )
    return None


def _overflow_why(value: Any, what: Any) -> str:
    return (
        f"the finite value {value:g} ({what}) overflows float32 (max {_FLOAT32_MAX:g}) and "
        "x64 is disabled, so JAX would silently turn it into inf; enable `jax_enable_x64`, "
        "rescale, or cast to float32 yourself if inf is what you want"
    )


def asserts_disabled() -> bool:
    """Whether ``chex.disable_asserts()`` switched assertions off (asks a failing chex assertion).

    Example:
      >>> asserts_disabled()
      False
    """
    import chex

    try:
        chex.assert_not_both_none(None, None)
    except AssertionError:
        return False
    return True


# ---------------------------------------------------------------- key paths


def keystr(path: Any) -> str:
    """Return a key path as a string; the root leaf is shown as ``<root>``."""
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def key_strings(tree: Any, treedef: Any = None) -> tuple[str, ...]:
    """Key-path strings of ``tree``'s leaves (``jax.tree_util.keystr``), cached per treedef."""
    if treedef is None:
        treedef = jax.tree_util.tree_structure(tree)
    try:
        cached = _KEY_STRINGS.get(treedef)
    except TypeError:  # a custom node with unhashable aux data
        cached, treedef = None, None
    if cached is not None:
        return cached
    names: dict[Any, str] = {}  # key -> str(key): upper levels repeat on every leaf
    out = tuple(
        "".join(names.get(k) or names.setdefault(k, str(k)) for k in path) or "<root>"
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
    if treedef is not None:
        if len(_KEY_STRINGS) >= _KEY_STRINGS_MAX:
            with contextlib.suppress(RuntimeError, StopIteration):  # another thread may evict too
                _KEY_STRINGS.pop(next(iter(_KEY_STRINGS)), None)  # the oldest
        _KEY_STRINGS[treedef] = out
    return out


_KEY_STRINGS: dict[Any, tuple[str, ...]] = {}  # treedef -> its leaves' key paths
_KEY_STRINGS_MAX = 64


# ---------------------------------------------------------------- checks that raise


def raise_leaf(tree: Any, index: int, arg: str, exc: type[Exception], why: str) -> None:
    """Raise ``exc`` naming argument ``arg``, the leaf's key path and why."""
    raise exc(f"`{arg}` leaf {key_strings(tree)[index]}: {why}. {available_devices()}")


def check_live(tree: Any, leaves: Sequence[Any], arg: str) -> None:
    """Raise DeletedArrayError naming every deleted or donated leaf of ``tree``."""
    dead = [i for i, x in enumerate(leaves) if is_jax_array(x) and deleted(x)]
    if dead:
        paths = [key_strings(tree)[i] for i in dead]
        raise DeletedArrayError(
            f"`{arg}` has {len(dead)} deleted or donated leaf/leaves: {', '.join(paths)}. "
            "Their buffers were freed (`x.delete()` or passed to a jit with "
            "`donate_argnums`); use the arrays the donating call returned."
        )


def check_host_leaves(tree: Any, leaves: Sequence[Any], arg: str) -> None:
    """Raise naming the first host leaf that cannot be placed without loss."""
    for i, leaf in enumerate(leaves):
        if not is_jax_array(leaf) and (problem := host_problem(leaf)) is not None:
            raise_leaf(tree, i, arg, *problem)


def checked_leaves(tree: Any, arg: str, caller: str | None = None, host: bool = True):
    """``tree``'s leaves and treedef, checked: not traced (when ``caller`` is named), not
    deleted, and (``host``) every host leaf placeable without loss."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if caller is not None and any(is_tracer(x) for x in leaves):
        raise PlacementError(
            f"`{caller}` inside a jax.jit trace: buffers, replicas and shards exist only on "
            "concrete arrays. Call it outside the jitted function (return the values "
            "from it first)."
        )
    check_live(tree, leaves, arg)
    if host:
        check_host_leaves(tree, leaves, arg)
    return leaves, treedef


def raise_leaves(
    tree: Any, idx: Sequence[int], header: str, line: Any, error: type = ShardingError, at: str = ""
) -> None:
    """Raise ``error``: ``header``, then ``{at}path: line(i)`` for each leaf ``i`` of ``idx``."""
    if idx:
        paths = key_strings(tree)
        raise error(join_failures(header, [f"{at}{paths[i]}: {line(i)}" for i in idx]))


# ---------------------------------------------------------------- shardings


def sharding_key(s: Sharding) -> Any:
    """A value equal exactly when the shardings are equal: cheap for one device."""
    if type(s) is SingleDeviceSharding:
        try:
            return s._device, s._memory_kind
        except AttributeError:  # pragma: no cover - a newer JAX renamed them
            pass
    return s


def same_layout(have: Sharding, want: Sharding, ndim: int) -> bool:
    """Whether an array of rank ``ndim`` laid out by ``have`` is laid out as ``want`` (equivalent).

    Example:
      >>> import jax
      >>> from jax.sharding import SingleDeviceSharding
      >>> d = SingleDeviceSharding(jax.devices()[0])
      >>> same_layout(d, d, 1)
      True
    """
    if have == want:
        return True
    if type(have) is type(want) and not isinstance(want, NamedSharding):
        return False
    named = isinstance(have, NamedSharding) and isinstance(want, NamedSharding)
    if named and typed_mesh(have) != typed_mesh(want):
        return False  # jit types them apart: an array keeps its own Explicit mesh in its type
    try:
        return bool(have.is_equivalent_to(want, ndim))
    except Exception:  # JAX raises ValueError/IndexError for a spec longer than ndim
        return False


def typed_mesh(s: Sharding) -> Any:
    """The abstract mesh ``jit`` types an array on ``s`` with (an ``Explicit`` axis), else None."""
    mesh = getattr(s, "mesh", None)
    explicit = isinstance(mesh, Mesh) and AxisType.Explicit in mesh.axis_types
    return mesh.abstract_mesh if explicit else None


def is_placed(leaf: Any, s: Sharding) -> bool:
    """Whether ``leaf`` is a committed array already laid out as ``s``."""
    if not is_jax_array(leaf) or not leaf.committed:
        return False
    return same_layout(leaf.sharding, s, leaf.ndim)


def describe_sharding(s: Sharding) -> str:
    """``'cpu:0'`` for one device, ``'mesh(data=8) P('data',)'`` for a named sharding."""
    if isinstance(s, SingleDeviceSharding):
        return device_name(next(iter(s.device_set)))
    if isinstance(s, NamedSharding):
        axes = ",".join(f"{k}={v}" for k, v in s.mesh.shape.items())
        return f"mesh({axes}) {s.spec}"
    return type(s).__name__


def device_key(d: jax.Device) -> tuple[str, int]:
    """Sort key of a device: ``(platform, id)``."""
    return (d.platform, d.id)


# ---------------------------------------------------------------- replicas


def replica_drift(labels: Sequence[str], values: Sequence[np.ndarray]) -> str | None:
    """Which copies differ bitwise from the majority (first on a tie), or None."""
    keys = [np.ascontiguousarray(v).tobytes() for v in values]
    if len(set(keys)) == 1:
        return None
    ref = collections.Counter(keys).most_common(1)[0][0]  # the first wins a tie
    ref_value = np.asarray(values[keys.index(ref)])
    bad = [j for j, k in enumerate(keys) if k != ref]
    good = [labels[j] for j, k in enumerate(keys) if k == ref]
    first = np.asarray(values[bad[0]])
    n_el = int(np.sum(np.any(_element_bytes(first) != _element_bytes(ref_value), axis=1)))
    diff = None  # the largest |difference| of a numeric leaf
    if ref_value.dtype.kind in "fiuc":
        wide = np.complex128 if ref_value.dtype.kind == "c" else np.float64
        ref64 = np.asarray(ref_value, wide)
        diff = max(
            float(np.max(np.abs(np.asarray(values[j], wide) - ref64), initial=0)) for j in bad
        )
    return (
        f"{', '.join(labels[j] for j in bad)} differ bitwise from {', '.join(good)} "
        f"({n_el} of {first.size} elements differ on {labels[bad[0]]}"
        + (f", max |difference| {diff:g})" if diff is not None else ")")
    )


def replica_copies(leaves: Sequence[Any], idx: Sequence[int]) -> list[tuple[int, list[str], Any]]:
    """``(i, device names, host values)`` of the addressable shards of each leaf ``i`` of ``idx``,
    fetched at once (typed PRNG keys: their ``key_data``, which numpy cannot hold as keys)."""
    data = [jax.random.key_data(x) if is_prng_key(x) else x for x in (leaves[i] for i in idx)]
    shards = [x.addressable_shards for x in data]
    values = jax.device_get([[sh.data for sh in ss] for ss in shards])
    return [(i, [device_name(sh.device) for sh in ss], v) for i, ss, v in zip(idx, shards, values)]


def raise_drift(tree: Any, copies: Sequence[tuple[int, Sequence[str], Sequence[Any]]], rule: str):
    """Raise ShardingError listing every leaf whose ``copies`` drifted apart."""
    drift = {i: line for i, labels, values in copies if (line := replica_drift(labels, values))}
    raise_leaves(tree, list(drift), rule, drift.get)


def _element_bytes(a: np.ndarray) -> np.ndarray:
    """Each element's raw bytes as one row, for an element-wise bitwise compare."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(max(a.size, 1), -1)
