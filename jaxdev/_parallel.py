"""Data parallelism: meshes, true replication, batch sharding with padding, pmap layout.

The JAX answer to PyTorch's ``nn.DataParallel`` ("split the batch over the
devices, replicate the module, gather the outputs") and to flax's
``jax_utils``, as pure functions over pytrees:

* :func:`data_mesh` builds a one-axis mesh with ``Auto`` axes (see its
  docstring for why), :func:`replicated_sharding` / :func:`batch_sharding`
  name the two layouts data parallel code needs.
* :func:`replicate` / :func:`unreplicate` move a tree to and from true
  replication (``NamedSharding(mesh, P())``: one logical copy).
* :func:`shard_batch` splits the leading axis over the mesh; with
  ``pad=True`` it pads to a multiple and returns a :class:`Padded` with a
  validity mask. :func:`unpad` (on device) and :func:`gather` (to host) give
  back exactly the original rows.
* :func:`stack_for_pmap`, :func:`unstack_from_pmap`, :func:`shard_for_pmap`,
  :func:`unshard_from_pmap`: the stacked layout ``jax.pmap`` expects.
* :func:`prefetch_to_device`: a background thread placing the next batches
  while the current one computes.
* :func:`data_parallel`: Fleuret's DataParallel as a function transform.

Every global batch is built by one function (``_to_global``), which hands
over to ``jaxdev._multihost.make_global_batch`` when several processes run.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from ._devices import DeviceSpec, device_list
from ._errors import (
    PlacementError,
    ShardingError,
    available_devices,
    format_devices,
    join_failures,
    keystr,
)
from ._placement import (
    _check_host_leaves,
    _check_live,
    _is_placed,
    _is_tracer,
    as_sharding,
    to_device,
    to_host,
)

DEFAULT_AXIS = "data"
"""Name of the batch axis of :func:`data_mesh`."""

_PMAP_AXIS = "pmap"
_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}

AxisName = str | tuple[str, ...]


class Padded(NamedTuple):
    """A batch padded to a multiple of the device count, with its validity mask.

    Attributes:
      batch: the placed batch; every leaf has ``mask.shape[0]`` rows (for the
        pmap layout, leading shape ``mask.shape``).
      mask: boolean ``jax.Array``, ``True`` for real rows, laid out like the
        batch's leading axis (or axes).
      size: the number of real rows this process brought (the rows before
        padding).
    """

    batch: Any
    mask: jax.Array
    size: int


# ---------------------------------------------------------------- meshes


def data_mesh(
    devices: int | DeviceSpec | Sequence[DeviceSpec] | None = None,
    axis: str = DEFAULT_AXIS,
    axis_type: AxisType | str = AxisType.Auto,
) -> Mesh:
    """Return a one-axis mesh over ``devices`` for data parallelism.

    The axis type is ``Auto`` by default, on purpose. JAX 0.10's
    ``jax.make_mesh`` defaults to ``Explicit`` axes, which put shardings into
    the types that ``jit`` traces: reductions and matmuls over a sharded batch
    then carry the sharding in their result types, some ops refuse sharded
    operands, scalars against a sharded spec fail with a bare
    ``AssertionError``, and arrays on an Explicit mesh passed to ``jax.pmap``
    fail with ``KeyError``. With ``Auto`` axes, ``jit`` plus ``NamedSharding``
    inputs behaves as classic data parallel code (XLA propagates the layout)
    and the same arrays also feed ``jax.pmap``. Pass
    ``axis_type='explicit'`` to opt into sharding-in-types.

    Args:
      devices: ``None`` for every device (every local device in a single
        process, every global device when several processes run), an int
        ``n`` for the first ``n`` local devices, a platform name, or a list
        of devices / specs.
      axis: the mesh axis name.
      axis_type: ``AxisType.Auto`` (default) or ``AxisType.Explicit``, or
        the strings ``'auto'`` / ``'explicit'``.

    Returns:
      A ``jax.sharding.Mesh`` with the single axis ``axis``.

    Raises:
      DeviceSpecError: a device is listed twice or a spec is malformed.
      DeviceNotFoundError: a device does not exist.
      ShardingError: ``axis`` is not a non-empty string or ``axis_type`` is
        unknown.

    Example:
      >>> import jax, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> mesh.axis_names, mesh.size == len(jax.local_devices())
      (('data',), True)
    """
    if not isinstance(axis, str) or not axis:
        raise ShardingError(f"`axis` must be a non-empty string such as 'data', got {axis!r}.")
    kind = _axis_type(axis_type)
    if devices is None and jax.process_count() > 1:
        devs = list(jax.devices())
    else:
        devs = device_list(devices)
    return Mesh(np.array(devs), (axis,), axis_types=(kind,))


def _axis_type(axis_type: AxisType | str) -> AxisType:
    if isinstance(axis_type, AxisType):
        return axis_type
    if isinstance(axis_type, str) and axis_type.lower() in _AXIS_TYPES:
        return _AXIS_TYPES[axis_type.lower()]
    raise ShardingError(
        f"`axis_type` must be AxisType.Auto, AxisType.Explicit, 'auto' or 'explicit', "
        f"got {axis_type!r}."
    )


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Return ``NamedSharding(mesh, P())``: a full copy on every device of ``mesh``.

    Example:
      >>> import jaxdev
      >>> jaxdev.replicated_sharding(jaxdev.data_mesh()).is_fully_replicated
      True
    """
    return _named(_check_mesh(mesh), P())


@functools.lru_cache(maxsize=256)
def _named(mesh: Mesh, spec: P) -> NamedSharding:
    """One ``NamedSharding`` object per (mesh, spec).

    JAX's transfer caches hit faster on the same sharding object than on an
    equal new one (about 0.1 ms per ``device_put`` on 8 CPU devices).
    """
    return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int | None = None, axis: AxisName | None = None):
    """Return the sharding that splits the leading (batch) axis over ``mesh``.

    Args:
      mesh: the mesh.
      ndim: if given, the spec lists every dimension (``P(axis, None, ...)``);
        otherwise it is ``P(axis)``, which fits arrays of any rank >= 1.
      axis: the mesh axis (or tuple of axes) to split over; default: the
        mesh's only axis, or ``'data'``.

    Returns:
      A ``NamedSharding``.

    Raises:
      ShardingError: ``axis`` is not an axis of ``mesh``, or ``ndim < 1``.

    Example:
      >>> import jaxdev
      >>> jaxdev.batch_sharding(jaxdev.data_mesh()).spec
      P('data',)
    """
    mesh = _check_mesh(mesh)
    axis = _batch_axis(mesh, axis)
    if ndim is None:
        return _named(mesh, P(axis))
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
        raise ShardingError(f"`ndim` must be an int >= 1 (a batch needs an axis), got {ndim!r}.")
    return _named(mesh, P(axis, *([None] * (ndim - 1))))


def _check_mesh(mesh: Any) -> Mesh:
    if mesh is None:
        return data_mesh()
    if not isinstance(mesh, Mesh):
        raise ShardingError(
            f"`mesh` must be a jax.sharding.Mesh (make one with `jaxdev.data_mesh()`), got "
            f"{type(mesh).__name__} {mesh!r}. {available_devices()}"
        )
    return mesh


def _batch_axis(mesh: Mesh, axis: AxisName | None) -> AxisName:
    names = mesh.axis_names
    if axis is None:
        if len(names) == 1:
            return names[0]
        if DEFAULT_AXIS in names:
            return DEFAULT_AXIS
        raise ShardingError(
            f"`axis` is needed: the mesh has axes {names} and none is called "
            f"{DEFAULT_AXIS!r}. Pass `axis=` with the axis (or tuple of axes) the batch "
            "is split over."
        )
    wanted = (axis,) if isinstance(axis, str) else tuple(axis)
    missing = [a for a in wanted if a not in names]
    if missing or not wanted:
        raise ShardingError(f"`axis`={axis!r} is not an axis of the mesh; its axes are {names}.")
    return axis


@functools.lru_cache(maxsize=256)
def _batch_layout(mesh: Mesh, axis: AxisName | None) -> tuple[NamedSharding, int]:
    """The batch sharding of ``mesh`` and how many ways it splits the rows."""
    axis = _batch_axis(mesh, axis)
    return _named(mesh, P(axis)), _axis_size(mesh, axis)


def _axis_size(mesh: Mesh, axis: AxisName) -> int:
    wanted = (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(mesh.shape[a] for a in wanted)


def _mesh_devices(mesh: Mesh) -> str:
    return format_devices(list(mesh.devices.flat))


# ---------------------------------------------------------------- replicate


def replicate(tree: Any, mesh: Mesh | None = None) -> Any:
    """Replicate every leaf of ``tree`` on every device of ``mesh`` (true replication).

    Each leaf becomes one logical array with ``NamedSharding(mesh, P())``
    (``is_fully_replicated`` is true), not flax's stacked copy with a new
    leading axis. Built on :func:`jaxdev.to_device`: leaves already
    replicated on ``mesh`` come back as the same objects, and an already
    replicated tree comes back as itself (a no-op).

    Like ``jax.device_put``, a leaf already on one device of ``mesh`` lends
    its buffer to that device's replica (no copy there). Donating the result
    (``jit(..., donate_argnums=...)``) then deletes the source leaf too; use
    :func:`jaxdev.copy_to` with :func:`replicated_sharding` when you will
    donate and still need the source (``TrainStep.init_state`` does).

    Args:
      tree: any pytree (Flax params, optax state).
      mesh: the mesh; default :func:`data_mesh`.

    Returns:
      The tree with replicated leaves.

    Raises:
      LeafTypeError, LeafValueError, DeletedArrayError: as :func:`jaxdev.to_device`.
      ShardingError: ``mesh`` is not a ``Mesh``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> params = jaxdev.replicate({"w": jnp.ones((2, 3))}, mesh)
      >>> params["w"].is_fully_replicated, jaxdev.replicate(params, mesh) is params
      (True, True)
    """
    return to_device(tree, replicated_sharding(_check_mesh(mesh)))


def unreplicate(tree: Any, check: bool = False) -> Any:
    """Return one copy of every replicated leaf of ``tree``.

    A fully replicated array becomes the single-device ``jax.Array`` held by
    its first addressable device (the buffer is shared, nothing is copied):
    it prints, converts with ``numpy.asarray`` and serialises like any array;
    ``jaxdev.to_host`` makes it numpy. Single-device arrays and host values
    (numpy, Python numbers) are already one copy and pass through.

    Args:
      tree: a pytree, typically made by :func:`replicate`.
      check: also verify that every replica holds bitwise identical values
        (drift detection; one batched device-to-host copy of all replicas).
        With several processes, only this process's replicas are compared.

    Returns:
      The tree with one copy per leaf.

    Raises:
      ShardingError: a leaf is sharded rather than replicated, or (with
        ``check``) replicas differ; each failing leaf is listed with its key
        path and the devices that drifted.
      DeletedArrayError: a leaf was deleted or donated.
      PlacementError: called on traced values inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.replicate({"w": jnp.arange(3.0)}, jaxdev.data_mesh())
      >>> one = jaxdev.unreplicate(params, check=True)
      >>> len(one["w"].devices()), one["w"].tolist()
      (1, [0.0, 1.0, 2.0])
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    _check_concrete(leaves, "unreplicate")
    _check_live(tree, leaves, "tree")
    sharded = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not _one_copy(x)]
    if sharded:
        _raise_not_replicated(tree, leaves, sharded)
    if check:
        _check_replicas(tree, leaves)
    out = [_first_replica(x) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_concrete(leaves: Sequence[Any], name: str) -> None:
    if any(_is_tracer(x) for x in leaves):
        raise PlacementError(
            f"`{name}` inside a jax.jit trace: replicas and shards exist only on concrete "
            "arrays. Call it outside the jitted function."
        )


def _one_copy(x: jax.Array) -> bool:
    return x.sharding.is_fully_replicated


def _spans(x: jax.Array) -> bool:
    return len(x.sharding.device_set) > 1


def _first_replica(x: Any) -> Any:
    if isinstance(x, jax.Array) and _spans(x):
        return x.addressable_shards[0].data
    return x


def _raise_not_replicated(tree: Any, leaves: Sequence[Any], idx: Sequence[int]) -> None:
    paths = _paths(tree)
    lines = []
    for i in idx:
        x = leaves[i]
        hint = ""
        if x.ndim and x.shape[0] == len(x.sharding.device_set):
            hint = " (a stacked pmap copy? use `jaxdev.unstack_from_pmap`)"
        lines.append(f"{paths[i]}: shape {tuple(x.shape)}, sharding {_spec_of(x)}{hint}")
    raise ShardingError(
        join_failures(
            "`tree` has leaves that are sharded, not replicated, so no single device holds "
            "a full copy. Gather them with `jaxdev.to_host` or `jaxdev.gather`, or replicate "
            "them first with `jaxdev.replicate`. Leaves:",
            lines,
        )
    )


def _spec_of(x: jax.Array) -> str:
    s = x.sharding
    return f"{s.spec}" if isinstance(s, NamedSharding) else type(s).__name__


def _paths(tree: Any) -> list[str]:
    return [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _check_replicas(tree: Any, leaves: Sequence[Any]) -> None:
    multi = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and _spans(x)]
    shards = [leaves[i].addressable_shards for i in multi]
    hosts = jax.device_get([[s.data for s in ss] for ss in shards])
    failures = []
    for i, ss, values in zip(multi, shards, hosts):
        labels = [_dev_name(s.device) for s in ss]
        line = _drift(labels, values)
        if line:
            failures.append((i, line))
    if failures:
        paths = _paths(tree)
        raise ShardingError(
            join_failures(
                "`tree` has replicas that drifted apart: every device should hold bitwise "
                "identical values, but these differ from the majority. Something updated the "
                "copies differently (a missing `lax.pmean` over gradients, a per-device RNG, "
                "an in-place host write); re-replicate from a trusted copy. Leaves:",
                [f"{paths[i]}: {line}" for i, line in failures],
            )
        )


def _dev_name(d: jax.Device) -> str:
    return f"{d.platform}:{d.id}"


def _drift(labels: Sequence[str], values: Sequence[np.ndarray]) -> str | None:
    """Describe which copies differ from the majority, bitwise; None if all agree."""
    keys = [np.ascontiguousarray(v).tobytes() for v in values]
    if len(set(keys)) == 1:
        return None
    counts: dict[bytes, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    ref = max(counts, key=counts.get)
    ref_value = values[keys.index(ref)]
    bad = [j for j, k in enumerate(keys) if k != ref]
    good = [labels[j] for j, k in enumerate(keys) if k == ref]
    diff = _max_abs_diff(ref_value, [values[j] for j in bad])
    return f"{', '.join(labels[j] for j in bad)} differ from {', '.join(good)}" + (
        f" (max |difference| {diff:g})" if diff is not None else ""
    )


def _max_abs_diff(ref: np.ndarray, others: Sequence[np.ndarray]) -> float | None:
    if np.asarray(ref).dtype.kind not in "fiuc":
        return None
    ref64 = np.asarray(ref, dtype=np.complex128 if ref.dtype.kind == "c" else np.float64)
    return max(float(np.max(np.abs(np.asarray(o, ref64.dtype) - ref64), initial=0)) for o in others)


# ---------------------------------------------------------------- batches


def _batch_rows(tree: Any, leaves: Sequence[Any], arg: str) -> int:
    """Return the common leading size of ``leaves``; raise naming offending leaves."""
    shapes = [np.shape(x) for x in leaves]
    if not leaves:
        raise ShardingError(f"`{arg}` has no array leaves: there is nothing to shard.")
    scalars = [i for i, s in enumerate(shapes) if not s]
    if scalars:
        paths = _paths(tree)
        raise ShardingError(
            join_failures(
                f"`{arg}` has scalar leaves where a leading batch axis is needed (every leaf "
                "is split along its first axis). Give them a batch axis (e.g. `x[None]` "
                "repeated per row), or pass them separately, replicated with "
                "`jaxdev.replicate`. Leaves:",
                [f"{paths[i]}: shape ()" for i in scalars],
            )
        )
    rows = shapes[0][0]
    if any(s[0] != rows for s in shapes):
        paths = _paths(tree)
        raise ShardingError(
            join_failures(
                f"`{arg}` leaves have different leading (batch) sizes; every leaf must have "
                "the same number of rows so row i of each belongs together. Leaves and "
                "their leading sizes:",
                [f"{paths[i]}: {s[0]} (shape {tuple(s)})" for i, s in enumerate(shapes)],
            )
        )
    if rows == 0:
        raise ShardingError(
            f"`{arg}` is empty: leaf {_paths(tree)[0]} has 0 rows (shape {tuple(shapes[0])}). "
            "An empty batch cannot be split or padded (there is no row to pad with); skip "
            "the step, or check the data loader's last batch."
        )
    return rows


def _pad_rows(x: Any, extra: int) -> Any:
    """Append ``extra`` copies of the last row (device arrays stay on device)."""
    if extra == 0:
        return x
    if isinstance(x, jax.Array):
        return jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)])
    x = np.asarray(x)
    return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])


def _row_multiple(sharding: NamedSharding, n: int) -> int:
    """Rows this process's batch must be a multiple of (the batch shards it holds)."""
    if jax.process_count() == 1:
        return n
    index_map = sharding.addressable_devices_indices_map((n,))
    return len({idx[0].start for idx in index_map.values()})


def _to_global(tree: Any, sharding: NamedSharding) -> Any:
    """Build global arrays from this process's batch: the one place that does it.

    In a single process this is :func:`jaxdev.to_device`. With several
    processes each one brings its local rows, and
    ``jaxdev._multihost.make_global_batch`` checks that the processes agree
    on the local shapes before building the global arrays.
    """
    if jax.process_count() > 1:
        from ._multihost import make_global_batch

        return make_global_batch(tree, sharding)
    return to_device(tree, sharding)


def _put_checked(leaves: list[Any], treedef: Any, sharding: NamedSharding) -> Any:
    """Place leaves already checked (live, placeable, divisible) in one ``device_put``.

    :func:`jaxdev.to_device` without its checks, which :func:`shard_batch`
    has done: the per-call overhead matters for small batches. Returns None
    when every leaf is already placed.
    """
    moving = [i for i, x in enumerate(leaves) if not _is_placed(x, sharding)]
    if not moving:
        return None
    out = list(leaves)
    for i, new in zip(moving, jax.device_put([leaves[i] for i in moving], sharding)):
        out[i] = new
    return jax.tree_util.tree_unflatten(treedef, out)


def _indivisible(tree: Any, rows: int, multiple: int, sharding: NamedSharding, what: str):
    lo, hi = (rows // multiple) * multiple, -(-rows // multiple) * multiple
    sizes = f"{hi}" if lo == 0 else f"{lo} or {hi}"
    return ShardingError(
        f"`batch` leaf {_paths(tree)[0]} has {rows} rows, which do not split evenly over "
        f"{multiple} {what} [{format_devices(_ordered(sharding))}] "
        f"({rows} % {multiple} = {rows % multiple}). Pass `pad=True` to pad to {hi} rows "
        f"and get a validity mask, or use a batch size that is a multiple of {multiple} "
        f"(e.g. {sizes})."
    )


def _ordered(sharding: NamedSharding) -> list[jax.Device]:
    return list(sharding.mesh.devices.flat)


def shard_batch(
    batch: Any, mesh: Mesh | None = None, pad: bool = False, axis: AxisName | None = None
) -> Any:
    """Split the leading axis of every leaf of ``batch`` across ``mesh``.

    Row ``i`` of every leaf goes to the same device, with the sharding
    ``NamedSharding(mesh, P(axis))``. Nothing is ever dropped: a row count
    that does not divide evenly raises unless ``pad=True``. Already placed
    leaves are not copied again (built on :func:`jaxdev.to_device`).

    With ``pad=True`` the batch is padded to the next multiple of the device
    count by repeating its last row (padded rows stay numerically sensible
    inputs: no zero rows to divide by), and the result is always a
    :class:`Padded` ``(batch, mask, size)`` whose boolean ``mask`` of shape
    ``(rows_padded,)`` is sharded like the batch; ``mask`` is all ``True``
    when no padding was needed. The return type depends only on ``pad``.
    Weight per-row losses and metrics by ``mask``; :func:`unpad` or
    :func:`gather` remove the padding from per-row outputs.

    With several processes, ``batch`` is this process's local part, and the
    global batch concatenates the processes' parts in process order.

    Args:
      batch: a pytree of arrays (numpy or jax) sharing their leading size.
      mesh: the mesh; default :func:`data_mesh`.
      pad: pad to a multiple of the device count and return a :class:`Padded`.
      axis: the mesh axis (or axes) to split over; default the mesh's only
        axis, or ``'data'``.

    Returns:
      The placed batch (same structure), or a :class:`Padded` when ``pad``.

    Raises:
      ShardingError: the row count does not divide (without ``pad``), the
        batch is empty, leaves have different leading sizes, or a leaf is a
        scalar; each names the leaf path and the sizes.
      LeafTypeError, LeafValueError, DeletedArrayError: as :func:`jaxdev.to_device`.

    Example:
      >>> import numpy as np, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> out = jaxdev.shard_batch({"x": np.ones((10, 3)), "y": np.arange(10)}, mesh, pad=True)
      >>> out.size, int(out.mask.sum()), out.batch["x"].shape[0] % mesh.size
      (10, 10, 0)
      >>> jaxdev.unpad(out.batch, out)["y"].tolist() == list(range(10))
      True
    """
    sharding, n = _batch_layout(_check_mesh(mesh), axis)
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    _check_live(batch, leaves, "batch")
    _check_host_leaves(batch, leaves, "batch")
    rows = _batch_rows(batch, leaves, "batch")
    multiple = _row_multiple(sharding, n)
    extra = -rows % multiple
    if not pad:
        if extra:
            raise _indivisible(batch, rows, multiple, sharding, "devices")
        if jax.process_count() > 1 or any(_is_tracer(x) for x in leaves):
            return _to_global(batch, sharding)
        placed = _put_checked(leaves, treedef, sharding)
        return batch if placed is None else placed
    padded = jax.tree_util.tree_unflatten(treedef, [_pad_rows(x, extra) for x in leaves])
    mask = np.arange(rows + extra) < rows
    placed, mask = _to_global((padded, mask), sharding)
    return Padded(placed, mask, rows)


def _padding_rows(padding: Any) -> tuple[int | None, np.ndarray | None, int | None]:
    """Return ``(size, indices, expected_rows)`` from a Padded, mask or int.

    ``indices`` is None when the real rows are a prefix of length ``size``.
    """
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


def _check_rows(tree: Any, leaves: Sequence[Any], size: int, expected: int | None, lead: int):
    bad = []
    for i, x in enumerate(leaves):
        shape = np.shape(x)
        have = math.prod(shape[:lead]) if len(shape) >= lead else None
        if have is None or (have != expected if expected is not None else have < size):
            bad.append(i)
    if bad:
        paths = _paths(tree)
        want = f"{expected}" if expected is not None else f"at least {size}"
        raise ShardingError(
            join_failures(
                f"`tree` leaves must have {want} leading rows to remove the padding (outputs of "
                "a function applied per row keep the batch as their leading axis; a reduction "
                "over the batch would have mixed in the padded rows). Leaves:",
                [f"{paths[i]}: shape {tuple(np.shape(leaves[i]))}" for i in bad],
            )
        )


def _take_rows(x: Any, size: int, indices: np.ndarray | None) -> Any:
    if indices is not None:
        return jnp.take(x, indices, axis=0) if isinstance(x, jax.Array) else np.asarray(x)[indices]
    if np.shape(x)[0] == size:
        return x
    return x[:size]


def unpad(tree: Any, padding: Padded | jax.Array | np.ndarray | int) -> Any:
    """Remove the padded rows from every leaf of ``tree``, on device.

    ``tree`` holds per-row values with the padded batch as leading axis (the
    padded batch itself, or the outputs of a function applied row by row).
    The real rows come back in their original order; ``jax.Array`` leaves stay
    ``jax.Array`` (sliced where they live; the result's sharding is JAX's
    choice, since the real row count need not divide), host leaves stay on
    the host. Use :func:`gather` to fetch to host numpy instead.

    Args:
      tree: a pytree whose leaves all have the padded leading size.
      padding: the :class:`Padded` from :func:`shard_batch`, its boolean
        ``mask``, or the number of real rows (an int: keep the first rows).

    Returns:
      The tree with exactly the real rows.

    Raises:
      ShardingError: a leaf's leading size does not match the padding, or
        ``padding`` is not a Padded, bool mask or int.
      PlacementError: called on traced values inside ``jit``.

    Example:
      >>> import numpy as np, jaxdev
      >>> p = jaxdev.shard_batch(np.arange(5.0), jaxdev.data_mesh(), pad=True)
      >>> jaxdev.unpad(p.batch, p).tolist()
      [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    size, indices, expected = _padding_rows(padding)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    _check_concrete(leaves, "unpad")
    _check_live(tree, leaves, "tree")
    _check_rows(tree, leaves, size, expected, 1)
    out = [_take_rows(x, size, indices) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def gather(tree: Any, padding: Padded | jax.Array | np.ndarray | int | None = None) -> Any:
    """Fetch ``tree`` to host numpy in one transfer and drop the padded rows.

    torch's ``DataParallel`` gather, for final results and logs: one
    ``jax.device_get`` of the whole tree, then the padding is removed on the
    host (cheaper than slicing on device first).

    Args:
      tree: a pytree of per-row values (sharded or not).
      padding: as :func:`unpad`; ``None`` keeps every row.

    Returns:
      The tree with ``numpy.ndarray`` leaves holding exactly the real rows.

    Raises:
      ShardingError: a leaf's leading size does not match the padding.
      DeletedArrayError, LeafTypeError, PlacementError: as :func:`jaxdev.to_host`.

    Example:
      >>> import numpy as np, jaxdev
      >>> p = jaxdev.shard_batch({"y": np.arange(3)}, jaxdev.data_mesh(), pad=True)
      >>> jaxdev.gather(p.batch, p)["y"].tolist()
      [0, 1, 2]
    """
    host = to_host(tree)
    if padding is None:
        return host
    return unpad(host, padding)


# ---------------------------------------------------------------- pmap layout


def _pmap_mesh(devices: Any) -> tuple[list[jax.Device], Mesh]:
    devs = device_list(devices)
    return devs, _pmap_mesh_of(tuple(devs))


@functools.lru_cache(maxsize=64)
def _pmap_mesh_of(devs: tuple[jax.Device, ...]) -> Mesh:
    return Mesh(np.array(devs), (_PMAP_AXIS,), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=64)
def _broadcaster(n: int, stacked: NamedSharding) -> Callable[[list[jax.Array]], list[jax.Array]]:
    def stack(xs: list[jax.Array]) -> list[jax.Array]:
        return [jnp.broadcast_to(x, (n, *x.shape)) for x in xs]

    return jax.jit(stack, out_shardings=stacked)


def stack_for_pmap(tree: Any, devices: Any = None) -> Any:
    """Copy every leaf onto a new leading device axis, the layout ``jax.pmap`` expects.

    What flax's ``jax_utils.replicate`` does: leaf ``x`` becomes an array of
    shape ``(n, *x.shape)`` whose row ``i`` lives on device ``i``. Only for
    ``jax.pmap`` code; for ``jit`` use :func:`replicate` (one logical copy,
    no extra axis). The copies are made by one replicating
    ``jax.device_put`` and one jitted broadcast that stays on each device.

    Args:
      tree: any pytree.
      devices: the devices, in pmap order; default every local device (the
        order ``jax.pmap`` uses).

    Returns:
      The stacked tree.

    Raises:
      LeafTypeError, LeafValueError, DeletedArrayError: as :func:`jaxdev.to_device`.
      DeviceSpecError: a device is listed twice.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> s = jaxdev.stack_for_pmap({"w": jnp.ones(3)})
      >>> s["w"].shape == (jax.local_device_count(), 3)
      True
    """
    devs, mesh = _pmap_mesh(devices)
    replicated = to_device(tree, _named(mesh, P()))
    leaves, treedef = jax.tree_util.tree_flatten(replicated)
    if not leaves:
        return tree
    stacked = _broadcaster(len(devs), _named(mesh, P(_PMAP_AXIS)))(leaves)
    return jax.tree_util.tree_unflatten(treedef, stacked)


def unstack_from_pmap(tree: Any, check: bool = False) -> Any:
    """Return row 0 of every leaf of a stacked (pmap layout) tree: flax's ``unreplicate``.

    ``jax.Array`` leaves come back as the single-device array on the device
    that holds row 0; host leaves as numpy row 0.

    Args:
      tree: a tree made by :func:`stack_for_pmap` or returned by ``jax.pmap``.
      check: also verify that all rows are bitwise identical (drift
        detection: e.g. parameters after a pmapped step that forgot
        ``lax.pmean``); fetches the whole tree to host once.

    Returns:
      The tree without its leading device axis.

    Raises:
      ShardingError: a leaf is a scalar (no device axis), or (with ``check``)
        rows differ; the leaf path and the devices (or rows) are named.
      DeletedArrayError: a leaf was deleted or donated.
      PlacementError: called on traced values inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> s = jaxdev.stack_for_pmap({"w": jnp.arange(3)})
      >>> jaxdev.unstack_from_pmap(s, check=True)["w"].tolist()
      [0, 1, 2]
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    _check_concrete(leaves, "unstack_from_pmap")
    _check_live(tree, leaves, "tree")
    _check_host_leaves(tree, leaves, "tree")
    scalars = [i for i, x in enumerate(leaves) if np.ndim(x) == 0]
    if scalars:
        paths = _paths(tree)
        raise ShardingError(
            join_failures(
                "`tree` has scalar leaves, so there is no leading device axis to unstack "
                "(was it replicated with `jaxdev.replicate` rather than stacked? then use "
                "`jaxdev.unreplicate`). Leaves:",
                [f"{paths[i]}: shape ()" for i in scalars],
            )
        )
    if check:
        _check_rows_equal(tree, leaves)
    out = [_row0(x) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def _row0(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return np.asarray(x)[0]
    shard = min(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return shard.data[0]


def _row_labels(x: Any) -> list[str]:
    n = np.shape(x)[0]
    labels = [f"row {i}" for i in range(n)]
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        for d, idx in x.sharding.devices_indices_map(x.shape).items():
            lo, hi, _ = idx[0].indices(n)
            for r in range(lo, hi):
                labels[r] = f"{_dev_name(d)} (row {r})" if hi - lo > 1 else _dev_name(d)
    return labels


def _check_rows_equal(tree: Any, leaves: Sequence[Any]) -> None:
    hosts = jax.device_get(list(leaves))
    failures = []
    for i, (x, h) in enumerate(zip(leaves, hosts)):
        h = np.asarray(h)
        line = _drift(_row_labels(x), list(h))
        if line:
            failures.append((i, line))
    if failures:
        paths = _paths(tree)
        raise ShardingError(
            join_failures(
                "`tree` has per-device copies that drifted apart: every row of a stacked "
                "leaf should be bitwise identical, but these differ from the majority "
                "(a pmapped update without `lax.pmean`?). Leaves:",
                [f"{paths[i]}: {line}" for i, line in failures],
            )
        )


def shard_for_pmap(batch: Any, devices: Any = None, pad: bool = False) -> Any:
    """Reshape every leaf ``(B, ...) -> (n, B // n, ...)`` and place row ``i`` on device ``i``.

    The layout ``jax.pmap`` expects for a batch (flax's ``shard`` plus the
    transfer). The row count is checked here, naming the leaf, before
    ``jax.pmap`` would fail with a message about its internal axes.

    Args:
      batch: a pytree of arrays sharing their leading size ``B``.
      devices: the devices, in pmap order; default every local device.
      pad: pad ``B`` to a multiple of ``n`` (repeating the last row) and
        return a :class:`Padded` whose mask has shape ``(n, B_padded // n)``.

    Returns:
      The placed batch, or a :class:`Padded` when ``pad``.

    Raises:
      ShardingError: as :func:`shard_batch` (size not divisible without
        ``pad``, empty batch, mixed leading sizes, scalar leaves).
      DeviceSpecError, DeviceNotFoundError: bad ``devices``.

    Example:
      >>> import jax, numpy as np, jaxdev
      >>> n = jax.local_device_count()
      >>> x = jaxdev.shard_for_pmap(np.zeros((2 * n, 3)))
      >>> x.shape == (n, 2, 3)
      True
    """
    devs, mesh = _pmap_mesh(devices)
    n = len(devs)
    stacked = _named(mesh, P(_PMAP_AXIS))
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    _check_concrete(leaves, "shard_for_pmap")
    _check_live(batch, leaves, "batch")
    _check_host_leaves(batch, leaves, "batch")
    rows = _batch_rows(batch, leaves, "batch")
    extra = -rows % n
    if extra and not pad:
        raise _indivisible(batch, rows, n, stacked, "pmap devices")
    per = (rows + extra) // n
    out = [_split_leading(_pad_rows(x, extra), n, per) for x in leaves]
    if not pad:
        return to_device(jax.tree_util.tree_unflatten(treedef, out), stacked)
    mask = (np.arange(rows + extra) < rows).reshape(n, per)
    placed, mask = to_device((jax.tree_util.tree_unflatten(treedef, out), mask), stacked)
    return Padded(placed, mask, rows)


def _split_leading(x: Any, n: int, per: int) -> Any:
    shape = (n, per, *np.shape(x)[1:])
    if isinstance(x, jax.Array):
        return x.reshape(shape)
    return np.asarray(x).reshape(shape)


def unshard_from_pmap(tree: Any, padding: Padded | jax.Array | np.ndarray | int | None = None):
    """Merge the two leading axes ``(n, m, ...) -> (n * m, ...)`` and drop padding.

    The inverse of :func:`shard_for_pmap` for per-row outputs of a pmapped
    function; leaves stay ``jax.Array`` (see :func:`unpad`).

    Args:
      tree: a pytree whose leaves have at least two leading axes.
      padding: as :func:`unpad` (a :class:`Padded` from :func:`shard_for_pmap`
        or its mask, or a row count); ``None`` keeps every row.

    Returns:
      The tree with one leading batch axis and exactly the real rows.

    Raises:
      ShardingError: a leaf has fewer than two axes or the wrong row count.

    Example:
      >>> import jax, numpy as np, jaxdev
      >>> n = jax.local_device_count()
      >>> p = jaxdev.shard_for_pmap(np.arange(2 * n + 1), pad=True)
      >>> jaxdev.unshard_from_pmap(p.batch, p).tolist() == list(range(2 * n + 1))
      True
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    _check_concrete(leaves, "unshard_from_pmap")
    _check_live(tree, leaves, "tree")
    bad = [i for i, x in enumerate(leaves) if np.ndim(x) < 2]
    if bad:
        paths = _paths(tree)
        raise ShardingError(
            join_failures(
                "`tree` leaves need two leading axes (devices, rows per device) to merge. Leaves:",
                [f"{paths[i]}: shape {tuple(np.shape(leaves[i]))}" for i in bad],
            )
        )
    flat = [x.reshape((-1, *np.shape(x)[2:])) for x in leaves]
    merged = jax.tree_util.tree_unflatten(treedef, flat)
    return merged if padding is None else unpad(merged, padding)


# ---------------------------------------------------------------- prefetch


class _Failure(NamedTuple):
    error: BaseException


_END = object()


class Prefetcher(Iterator[Any]):
    """Iterator over placed elements, filled by a background thread.

    Made by :func:`prefetch_to_device`. Use it as a context manager (or call
    :meth:`close`) to stop the thread when leaving a loop early.
    """

    def __init__(self, iterator: Iterable[Any], size: int, place: Callable[[Any], Any]):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self.thread = threading.Thread(
            target=self._produce,
            args=(iter(iterator), place),
            name="jaxdev-prefetch",
            daemon=True,
        )
        self.thread.start()

    def _produce(self, it: Iterator[Any], place: Callable[[Any], Any]) -> None:
        try:
            for item in it:
                if self._stop.is_set() or not self._put(place(item)):
                    return
        except BaseException as err:  # handed to the consumer, re-raised there
            if hasattr(err, "add_note"):
                err.add_note("(raised in the background thread of jaxdev.prefetch_to_device)")
            self._put(_Failure(err))
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread and drop the elements still queued.

        Waits up to ``timeout`` seconds for the thread; a thread stuck inside
        the source iterator's ``next`` cannot be interrupted and finishes
        that call in the background (it is a daemon thread). The source
        iterator itself is not closed.
        """
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()


def prefetch_to_device(
    iterator: Iterable[Any],
    size: int = 2,
    sharding: Sharding | Mesh | DeviceSpec | None = None,
    pad: bool = False,
) -> Prefetcher:
    """Place the next ``size`` elements of ``iterator`` on device in a background thread.

    Host-to-device transfers (and the loader's own host work) overlap with
    the computation on the current element. Unlike flax's
    ``jax_utils.prefetch_to_device``, which only does the pmap layout, any
    placement works: a ``Mesh`` (each element goes through
    :func:`shard_batch`, so the batch checks and multi-process construction
    apply), any ``Sharding``, or a device.

    Order is preserved and no element is dropped; an exception raised by the
    source iterator (or while placing) is re-raised in the consumer with its
    original traceback. At most ``size`` placed elements wait in the queue
    (plus one being placed), so device memory stays bounded.

    Args:
      iterator: an iterable of pytrees (batches).
      size: how many placed elements may wait; 2 overlaps one transfer with
        one step.
      sharding: a ``Mesh`` (batch split over it), a ``Sharding``, a device or
        spec; default :func:`data_mesh`.
      pad: with a mesh, pad each batch (elements become :class:`Padded`).

    Returns:
      A :class:`Prefetcher`: an iterator and context manager with ``close()``.

    Raises:
      ShardingError: ``size`` is not a positive int, or ``pad`` with a
        target that is not a mesh.

    Example:
      >>> import numpy as np, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> batches = (np.full((mesh.size, 2), i) for i in range(3))
      >>> with jaxdev.prefetch_to_device(batches, 2, mesh) as it:
      ...     [int(b[0, 0]) for b in it]
      [0, 1, 2]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ShardingError(f"`size` must be an int >= 1 (elements to keep ready), got {size!r}.")
    if sharding is None or isinstance(sharding, Mesh):
        mesh = _check_mesh(sharding)

        def place(item: Any) -> Any:
            return shard_batch(item, mesh, pad=pad)

    else:
        if pad:
            raise ShardingError(
                "`pad=True` needs a Mesh as `sharding` (padding splits the batch over a mesh), "
                f"got {sharding!r}."
            )
        target = as_sharding(sharding)

        def place(item: Any) -> Any:
            return to_device(item, target)

    return Prefetcher(iterator, size, place)


# ---------------------------------------------------------------- data_parallel


def data_parallel(fn: Callable[..., Any], mesh: Mesh | None = None) -> Callable[..., Any]:
    """Turn a per-row function into a data parallel one (Fleuret's DataParallel).

    ``dp = data_parallel(apply_fn, mesh)``; then ``dp(params, *batch)``
    replicates ``params`` (a no-op when already replicated: replicate them
    once with :func:`replicate` to avoid a copy per call), splits every
    batch argument over the mesh with :func:`shard_batch` (padding an uneven
    batch by repeating its last row), runs ``jax.jit(fn)`` and returns the
    outputs with exactly the original rows, in order, as ``jax.Array`` on
    the mesh devices (see :func:`unpad`; :func:`gather` or
    :func:`jaxdev.to_host` fetch them).

    ``fn`` must work row by row: every output leaf keeps the batch as its
    leading axis (like ``model.apply(params, x)``). A reduction over the
    batch (a mean loss) would mix in the padded rows; compute it from the
    outputs instead, or use ``shard_batch(pad=True)`` and weight by the mask.

    Args:
      fn: ``fn(params, *batch) -> outputs`` with per-row outputs.
      mesh: the mesh; default :func:`data_mesh` (made at the first call).

    Returns:
      ``dp(params, *batch)`` with the semantics above.

    Raises:
      ShardingError: (at call time) the batch arguments are empty, have
        different leading sizes or scalar leaves, or an output leaf lost its
        batch axis; each names the leaf.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jaxdev
      >>> dp = jaxdev.data_parallel(lambda w, x: x @ w, jaxdev.data_mesh())
      >>> dp(jnp.ones((3, 2)), np.ones((5, 3))).shape
      (5, 2)
    """
    jitted = jax.jit(fn)

    @functools.wraps(fn)
    def dp(params: Any, *batch: Any) -> Any:
        m = _check_mesh(mesh)
        padded = shard_batch(batch, m, pad=True)
        out = jitted(replicate(params, m), *padded.batch)
        return unpad(out, padded)

    return dp
