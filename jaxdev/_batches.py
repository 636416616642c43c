"""Batches split over a mesh: padding with a validity mask, never a dropped row."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ._errors import ShardingError, format_devices
from ._leaves import checked_leaves, host_problem, key_strings, raise_leaf, raise_leaves
from ._mesh import AxisName, batch_layout, check_mesh, outside_mesh
from ._placement import aligned_copy, detach_host, detached, to_device


class Padded(NamedTuple):
    """A batch padded to a multiple of the device count, with its validity mask.

    Attributes:
      batch: the placed batch; every leaf has ``mask.shape`` as leading shape.
      mask: boolean ``jax.Array``, ``True`` for real rows (``shard_batch``: laid out like the
        rows; ``put_batch``: as the strategy's ``mask_spec``, replicated for a jit step).
      size: the real rows this process brought.
    """

    batch: Any
    mask: jax.Array
    size: int


def rows_of(batch: Any, arg: str = "batch") -> int:
    """The rows of ``batch``: the leading size its leaves share (checked, leaves named)."""
    return batch_rows(batch, [np.shape(x) for x in jax.tree.leaves(batch)], arg)


def batch_rows(tree: Any, shapes: Sequence[tuple[int, ...]], arg: str) -> int:
    """Return the common leading size of ``tree``'s leaf ``shapes``; raise naming offenders."""
    if not shapes:
        raise ShardingError(f"`{arg}` has no array leaves: there is nothing to shard.")
    raise_leaves(
        tree,
        [i for i, s in enumerate(shapes) if not s],
        f"`{arg}` has scalar leaves where a leading batch axis is needed (every leaf is split "
        "along its first axis). Give them a batch axis (e.g. `x[None]` repeated per row), or "
        "pass them separately, replicated with `jaxdev.replicate`. Leaves:",
        lambda i: "shape ()",
    )
    rows = shapes[0][0]
    if any(s[0] != rows for s in shapes):
        raise_leaves(
            tree,
            range(len(shapes)),
            f"`{arg}` leaves have different leading (batch) sizes; every leaf must have the "
            "same number of rows so row i of each belongs together. Leaves and their leading "
            "sizes:",
            lambda i: f"{shapes[i][0]} (shape {shapes[i]})",
        )
    if rows == 0:
        raise ShardingError(
            f"`{arg}` is empty: leaf {key_strings(tree)[0]} has 0 rows (shape {tuple(shapes[0])}). "
            "An empty batch cannot be split or padded (there is no row to pad with); skip "
            "the step, or check the data loader's last batch."
        )
    raise_leaves(
        tree,
        [i for i, s in enumerate(shapes) if 0 in s],
        f"`{arg}` has leaves with no elements although the batch has {rows} rows. JAX builds "
        "split zero-size arrays whose per-device pieces it cannot read back (e.g. the output "
        "of `jax.pmap` over one fails with a numpy broadcast error), so they are refused here. "
        "Drop these leaves from the batch (they carry no data) or pass them to the step "
        "separately. Leaves:",
        lambda i: f"shape {shapes[i]}",
    )
    return rows


def pad_rows(x: Any, extra: int, axis: int = 0) -> Any:
    """Append ``extra`` copies of the last row (along ``axis``): the one last-row padding.

    Device arrays stay on device; host arrays come back as one private aligned
    copy (see :func:`detach_host`).
    """
    if axis:  # rows behind group axes: pad along the row axis, as a view of the padded copy
        xp = jnp if isinstance(x, jax.Array) else np
        return xp.moveaxis(pad_rows(xp.moveaxis(xp.asarray(x), axis, 0), extra), 0, axis)
    if isinstance(x, jax.Array):
        return x if extra == 0 else jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)])
    return detached(x) if extra == 0 else aligned_copy(np.asarray(x), extra)


def lead_spec(axis: AxisName, lead: int = 0, ndim: int | None = None) -> P:
    """The spec of a batch leaf: rows (axis ``lead``) split over ``axis``; ``P()`` without rows."""
    return P() if ndim is not None and ndim <= lead else P(*([None] * lead), axis)


def padded_shapes(batch: Any, n: int, n_lead: int = 0) -> tuple[Any, Any]:
    """``(batch, mask)`` shapes of a batch padded as ``put_batch`` pads it (rows at ``n_lead``).

    ``(batch, None)`` when ``n`` devices divide the rows.
    """
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves or any(np.ndim(x) <= n_lead for x in leaves):
        return batch, None
    rows = {np.shape(x)[n_lead] for x in leaves}
    if len(rows) != 1 or rows.pop() % n == 0:
        return batch, None

    def pad(shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:n_lead] + (shape[n_lead] + -shape[n_lead] % n,) + shape[n_lead + 1 :]

    out = [jax.ShapeDtypeStruct(pad(np.shape(x)), x.dtype) for x in leaves]
    mask = jax.ShapeDtypeStruct(pad(np.shape(leaves[0]))[: n_lead + 1], np.bool_)
    return treedef.unflatten(out), mask


def row_multiple(sharding: NamedSharding, n: int) -> int:
    """Rows this process's batch must be a multiple of (the batch shards it holds)."""
    if jax.process_count() == 1:
        return n
    index_map = sharding.addressable_devices_indices_map((n,))
    return len({idx[0].start for idx in index_map.values()})


def to_global(tree: Any, sharding: NamedSharding, timeout_s: float | None) -> Any:
    """Global arrays from this process's batch (several processes: shapes checked to agree)."""
    tree = detach_host(tree)
    if jax.process_count() > 1:
        from ._multihost import global_batch

        return global_batch(tree, sharding, timeout_s)
    return to_device(tree, sharding)


def indivisible_error(
    tree: Any, rows: int, multiple: int, sharding: NamedSharding, pmap: bool, name: str = ""
) -> ShardingError:
    """``batch`` leaf ``name`` (else ``tree``'s first) has ``rows`` no ``multiple`` divides."""
    lo, hi = (rows // multiple) * multiple, -(-rows // multiple) * multiple
    sizes, what = f"{hi}" if lo == 0 else f"{lo} or {hi}", "pmap devices" if pmap else "devices"
    name = name or key_strings(tree)[0]
    return ShardingError(
        f"`batch` leaf {name} has {rows} rows, which do not split evenly over "
        f"{multiple} {what} [{format_devices(list(sharding.mesh.devices.flat))}] "
        f"({rows} % {multiple} = {rows % multiple}). Pass `pad=True` to pad to {hi} rows "
        f"and get a validity mask, or use a batch size that is a multiple of {multiple} "
        f"(e.g. {sizes})."
    )


def shard_batch(
    batch: Any,
    mesh: Mesh | None = None,
    *,
    pad: bool = False,
    axis: AxisName | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Split the leading axis of every leaf of ``batch`` across ``mesh`` (``P(axis)``).

    Nothing is dropped: rows that do not divide raise unless ``pad=True``, which
    pads by repeating the last row and always returns a :class:`Padded` (weight
    losses by its ``mask``; :func:`unpad` drops the padding). Placed leaves are
    not copied again; host arrays are copied first (:func:`detach_host`). With
    several processes ``batch`` is this process's part; the processes' shapes
    are compared (within ``timeout_s``) before the global batch is built.

    Args:
      axis: the mesh axis (or axes) to split over; default the mesh's only axis, or ``'data'``.
      timeout_s: the cross-process shape check's deadline (default
        ``$JAXDEV_SYNC_TIMEOUT`` or 300 s).

    Raises:
      ShardingError: the rows do not divide (without ``pad``), the batch is
        empty, or a leaf is a scalar, has no elements or other rows (named).
      DistributedError: processes brought different local shapes or dtypes.

    Example:
      >>> import numpy as np, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> out = jaxdev.shard_batch({"x": np.ones((10, 3)), "y": np.arange(10)}, mesh, pad=True)
      >>> out.size, int(out.mask.sum()), out.batch["x"].shape[0] % mesh.size
      (10, 10, 0)
    """
    sharding, n = batch_layout(check_mesh(mesh), axis)
    return place_rows(batch, sharding, n, pad, sharding, timeout_s)


_PLANS: dict[Any, tuple] = {}  # (treedef, leaf types/shapes/dtypes, layout, pad) -> plan


def place_rows(
    batch, sharding: Sharding, n: int, pad: bool | None, mask: Sharding, timeout_s=None, pmap=False
) -> Any:
    """:func:`shard_batch` with the mask placed on ``mask`` (``pad=None``: padded when the
    rows need it). A host batch is one ``jax.device_put`` of rows and mask, its checks run
    once per structure, shapes and dtypes (at every call: the values of 64-bit leaves).
    ``pmap``: rows and mask split ``(n, B // n, ...)`` over this process's devices."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    sig = tuple((type(x), getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves)
    key = (treedef, sig, sharding, n, pad, mask, pmap, jax.process_count())
    plan = _PLANS.get(key) or _rows_plan(batch, leaves, sharding, n, pad, mask, pmap)
    rows, extra, masked, wide, targets = plan
    valid = np.arange(rows + extra) < rows if masked else None  # per call: a user may donate it
    for i in wide:  # 64-bit values with x64 disabled: JAX would truncate them silently
        if (problem := host_problem(leaves[i])) is not None:
            raise_leaf(batch, i, "batch", *problem)
    if targets is None and valid is None and not pmap:  # device arrays, tracers, processes
        local = isinstance(sharding, SingleDeviceSharding)  # (Strategy.single's whole rows)
        return to_device(batch, sharding) if local else to_global(batch, sharding, timeout_s)
    out = detach_host(leaves) if targets and not extra else [pad_rows(x, extra) for x in leaves]
    if pmap:  # (B, ...) -> (n, B // n, ...): views of the private copies
        out = [x.reshape(n, -1, *x.shape[1:]) for x in out]
        valid = None if valid is None else valid.reshape(n, -1)
    if targets is None:
        padded = treedef.unflatten(out)
        if pmap:  # this process's devices: never a global array
            placed = to_device(padded if valid is None else (padded, valid), sharding)
            return placed if valid is None else Padded(*placed, rows)
        target = sharding if mask == sharding else (jax.tree.map(lambda _: sharding, padded), mask)
        return Padded(*to_global((padded, valid), target, timeout_s), rows)
    if len(_PLANS) < 256:  # checked: kept (bounded: a loader brings few shapes)
        _PLANS[key] = plan
    with outside_mesh():  # a re-layout is a jitted program: never under a user's set_mesh
        out = jax.device_put(out if valid is None else [*out, valid], targets)
    placed = treedef.unflatten(out[: len(leaves)])
    return placed if valid is None else Padded(placed, out[-1], rows)


def _rows_plan(batch, leaves, sharding, n, pad, mask, pmap) -> tuple:
    """``(rows, extra, masked, 64-bit leaves, device_put targets or None)``, checked."""
    checked_leaves(batch, "batch", "shard_for_pmap" if pmap else None)
    rows = batch_rows(batch, [np.shape(x) for x in leaves], "batch")
    multiple = row_multiple(sharding, n)
    extra = -rows % multiple
    if extra and pad is False:
        raise indivisible_error(batch, rows, multiple, sharding, pmap)
    masked = bool(extra or pad)
    wide = tuple(i for i, x in enumerate(leaves) if isinstance(x, np.ndarray) and x.itemsize == 8)
    several = jax.process_count() > 1 and not pmap  # pmap: this process's devices only
    if several or any(type(x) is not np.ndarray for x in leaves):
        return rows, extra, masked, wide, None
    single = isinstance(sharding, SingleDeviceSharding)  # JAX puts faster given the device
    put = next(iter(sharding.device_set)) if single else sharding
    targets = [put] * len(leaves) + ([mask] if masked else [])
    return rows, extra, masked, wide, targets


def _padding_rows(padding: Any) -> tuple[int | None, np.ndarray | None, int | None]:
    """``(size, indices or None for a prefix, expected rows)`` of a Padded, mask or int."""
    if isinstance(padding, Padded):
        if jax.process_count() == 1:
            return padding.size, None, int(padding.mask.size)
        padding = padding.mask
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        if padding < 0:
            raise ShardingError(f"`padding` as a row count must be >= 0, got {padding}.")
        return int(padding), None, None
    mask = np.asarray(jax.device_get(padding)).reshape(-1)
    if mask.dtype != np.bool_:
        raise ShardingError(
            f"`padding` must be a Padded, a boolean mask or a row count (int), got an array of "
            f"dtype {mask.dtype}. Use the `mask` that `shard_batch(..., pad=True)` returned."
        )
    count = int(mask.sum())
    if mask[:count].all():
        return count, None, mask.size
    return count, np.flatnonzero(mask), mask.size


def select_rows(
    x: Any, size: int | None, indices: np.ndarray | None = None, merge: bool = False
) -> Any:
    """Rows of ``x``, bit for bit: the first ``size`` (None: all), or those at ``indices``.

    ``merge`` merges the two leading axes first (pmap layout). On several devices
    XLA's slice is a masked sum (``-0.0`` -> ``0.0``), so floats move as uints.
    """
    if not isinstance(x, jax.Array):
        return _take_rows(np.asarray(x), indices, size, merge)
    if indices is None and size in (None, x.shape[0]) and not merge:
        return x
    dtype = np.dtype(x.dtype)
    exact = len(x.sharding.device_set) == 1 or _bits_dtype(dtype) is None
    s = x.sharding
    with outside_mesh():  # jaxdev's own programs: never under a user's jax.set_mesh
        if isinstance(s, NamedSharding) and AxisType.Explicit in s.mesh.axis_types:
            x = jax.device_put(x, NamedSharding(s.mesh, P()))  # Explicit: no uneven slice
        out = _rows_jit(x, indices, size, merge, not exact)
        return out if exact else _from_bits(out, dtype)


def _bits_dtype(dtype: np.dtype) -> np.dtype | None:
    """The unsigned integer a floating point element is moved as; None for exact kinds."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    width = dtype.itemsize * (4 if dtype.kind == "c" else 8)
    if dtype.kind != "c" and jnp.finfo(dtype).bits != width:  # float4: no byte-wide view
        return None
    return np.dtype(f"uint{width}")


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _rows_jit(x: jax.Array, indices: Any, size: int | None, merge: bool, as_bits: bool):
    if as_bits:
        bits = _bits_dtype(np.dtype(x.dtype))
        if jnp.iscomplexobj(x):  # (..., 2): real and imaginary parts
            parts = [jax.lax.real(x), jax.lax.imag(x)]
            x = jnp.stack([jax.lax.bitcast_convert_type(p, bits) for p in parts], axis=-1)
        else:
            x = jax.lax.bitcast_convert_type(x, bits)
    return _take_rows(x, indices, size, merge)


def _take_rows(x: Any, indices: Any, size: int | None, merge: bool) -> Any:
    """:func:`select_rows` on a numpy array, or traced in :func:`_rows_jit`."""
    if merge:
        x = x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))
    if indices is not None:
        return x[indices]
    return x if size in (None, x.shape[0]) else x[:size]


@functools.partial(jax.jit, static_argnums=1)
def _from_bits(bits: jax.Array, dtype: np.dtype) -> jax.Array:
    """Undo ``_rows_jit``'s bit view (a separate program: XLA would fold it away)."""
    if dtype.kind == "c":
        part = np.dtype(f"float{dtype.itemsize * 4}")
        re, im = (jax.lax.bitcast_convert_type(bits[..., k], part) for k in (0, 1))
        return jax.lax.complex(re, im)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _two_axes(padding: Any) -> str:
    """What to call for a mask with more than one row axis (pmap's layout, grouped rows)."""
    shape = np.shape(padding.mask if isinstance(padding, Padded) else padding)
    if len(shape) < 2:
        return ""
    return (
        f" `padding`'s mask has shape {shape}, not one row axis: in `jax.pmap`'s stacked "
        "layout (devices, rows per device; `put_batch` under `Strategy.pmap`, "
        "`jaxdev.pmap.shard_for_pmap`) merge and unpad with "
        "`jaxdev.pmap.unshard_from_pmap(tree, padding)`; grouped for `steps_per_call` or "
        "`accumulate`, unpad each group with its own part of the mask."
    )


def unpad(tree: Any, padding: Padded | jax.Array | np.ndarray | int) -> Any:
    """Remove the padded rows from every leaf of ``tree``, on device, bit for bit.

    ``tree`` holds per-row values with the padded batch as leading axis (the
    batch itself, or per-row outputs); device leaves stay on device (JAX picks
    the sharding), host leaves on the host.

    Args:
      padding: the :class:`Padded` from :func:`shard_batch`, its boolean ``mask``,
        or the number of real rows (keep the first).

    Raises:
      ShardingError: a leaf's leading size does not match, or a bad ``padding``.
      PlacementError: called on traced values inside ``jit``.

    Example:
      >>> import numpy as np, jaxdev
      >>> p = jaxdev.shard_batch(np.arange(5.0), jaxdev.data_mesh(), pad=True)
      >>> jaxdev.unpad(p.batch, p).tolist()
      [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    size, indices, expected = _padding_rows(padding)
    leaves, treedef = checked_leaves(tree, "tree", "unpad", host=False)
    rows = [np.shape(x)[0] if np.ndim(x) else -1 for x in leaves]
    want = f"{expected}" if expected is not None else f"at least {size}"
    raise_leaves(
        tree,
        [i for i, r in enumerate(rows) if r < size or (expected is not None and r != expected)],
        f"`tree` leaves must have {want} leading rows to remove the padding (outputs of a "
        "function applied per row keep the batch as their leading axis; a reduction over the "
        f"batch would have mixed in the padded rows).{_two_axes(padding)} Leaves:",
        lambda i: f"shape {np.shape(leaves[i])}",
    )
    out = [select_rows(x, size, indices) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)
