"""The stacked layout ``jax.pmap`` expects: a leading device axis (flax's ``jax_utils``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding
from jax.sharding import PartitionSpec as P

from ._batches import Padded, place_rows, select_rows, unpad
from ._devices import device_list
from ._errors import device_name
from ._leaves import checked_leaves, is_concrete, is_prng_key, raise_drift, raise_leaves
from ._mesh import DEFAULT_AXIS, MeshBound, mesh_of, named_sharding, outside_mesh
from ._placement import to_device


def is_stacked(x: Any) -> bool:
    """Whether ``x`` is in ``jax.pmap``'s stacked layout: a ``jax.Array`` whose leading axis
    holds one row on each of its (more than one) devices.

    What ``flax.jax_utils.replicate``, :func:`stack_for_pmap`, :func:`shard_for_pmap` and
    the outputs of ``jax.pmap`` are; never a fully replicated array.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> from jaxdev._pmap_layout import is_stacked
      >>> is_stacked(jaxdev.pmap.stack_for_pmap(jnp.ones(3), 2)), is_stacked(jnp.ones((2, 3)))
      (True, False)
    """
    if not is_concrete(x) or not x.ndim:
        return False
    s, n = x.sharding, x.shape[0]
    return n > 1 and len(s.device_set) == n and s.shard_shape(x.shape) == (1, *x.shape[1:])


def _pmap_mesh(devices: Any) -> tuple[int, Mesh, Sharding]:
    devs = device_list(devices)
    mesh = mesh_of(tuple(devs), DEFAULT_AXIS)
    return len(devs), mesh, named_sharding(mesh, P(DEFAULT_AXIS))  # rows on the devices


@functools.lru_cache(maxsize=64)
def stacker(n: int, s: Sharding) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """One compiled broadcast of each array onto ``(n, ...)`` laid out by ``s``, per (n, s):
    a new function each call recompiled it (a restore took 1.6 s instead of 0.3 s for 100 MB)."""
    fn = jax.jit(lambda xs: [jnp.broadcast_to(x, (n, *x.shape)) for x in xs], out_shardings=s)
    return MeshBound(fn, None)  # jaxdev's own program: never under a user's jax.set_mesh


def stack_for_pmap(tree: Any, devices: Any = None) -> Any:
    """Copy every leaf onto a new leading device axis (flax's ``jax_utils.replicate``).

    Leaf ``x`` becomes ``(n, *x.shape)`` with row ``i`` on device ``i`` (default: every
    local device, in pmap order). Only for ``jax.pmap`` code; ``jit`` code uses
    :func:`replicate`.

    Raises:
      LeafTypeError, LeafValueError, DeletedArrayError: as :func:`jaxdev.to_device`.
      DeviceSpecError: a device is listed twice.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> s = jaxdev.pmap.stack_for_pmap({"w": jnp.ones(3)})
      >>> s["w"].shape == (jax.local_device_count(), 3)
      True
    """
    n, mesh, stacked = _pmap_mesh(devices)
    replicated = to_device(tree, named_sharding(mesh, P()))
    leaves, treedef = jax.tree_util.tree_flatten(replicated)
    if not leaves:
        return tree
    # When every output of a jitted program is zero-size, jax 0.10.2 gives each
    # shard the full shape and reading the array fails. Zero-size leaves carry
    # no data: they are made by a device_put instead.
    full = [i for i, x in enumerate(leaves) if x.size]
    out = [jax.device_put(np.empty((n, *x.shape), x.dtype), stacked) for x in leaves if not x.size]
    for i, new in zip(full, stacker(n, stacked)([leaves[i] for i in full]) if full else []):
        out.insert(i, new)
    return jax.tree_util.tree_unflatten(treedef, out)


def unstack_from_pmap(tree: Any, check: bool = False) -> Any:
    """Return row 0 of every leaf of a stacked tree (flax's ``unreplicate``), on row 0's device.

    ``check=True`` also verifies every row is bitwise identical (e.g. a pmapped step that
    forgot ``lax.pmean``), fetching the tree once.

    Raises:
      ShardingError: a scalar leaf, or (``check``) rows differ; the leaf and rows named.
      DeletedArrayError: a leaf was deleted or donated.
      PlacementError: called on traced values inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> s = jaxdev.pmap.stack_for_pmap({"w": jnp.arange(3)})
      >>> jaxdev.pmap.unstack_from_pmap(s, check=True)["w"].tolist()
      [0, 1, 2]
    """
    leaves, treedef = checked_leaves(tree, "tree", "unstack_from_pmap")
    raise_leaves(
        tree,
        [i for i, x in enumerate(leaves) if np.ndim(x) == 0],
        "`tree` has scalar leaves, so there is no leading device axis to unstack (was it "
        "replicated with `jaxdev.replicate` rather than stacked? then use "
        "`jaxdev.unreplicate`). Leaves:",
        lambda i: "shape ()",
    )
    if check:
        data = [jax.random.key_data(x) if is_prng_key(x) else x for x in leaves]  # numpy: no keys
        hosts = [list(np.asarray(h)) for h in jax.device_get(data)]
        raise_drift(
            tree,
            [(i, _row_labels(x), hosts[i]) for i, x in enumerate(leaves)],
            "`tree` has per-device copies that drifted apart: every row of a stacked "
            "leaf should be bitwise identical, but these differ from the majority "
            "(a pmapped update without `lax.pmean`?). Leaves:",
        )
    with outside_mesh():  # row 0 is a slice, a jitted program: never under a user's set_mesh
        out = [_row0(x) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def _row0(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return np.asarray(x)[0]
    return min(x.addressable_shards, key=lambda s: s.index[0].start or 0).data[0]


def _row_labels(x: Any) -> list[str]:
    n = np.shape(x)[0]
    labels = [f"row {i}" for i in range(n)]
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        for d, idx in x.sharding.devices_indices_map(x.shape).items():
            lo, hi, _ = idx[0].indices(n)
            for r in range(lo, hi):
                labels[r] = f"{device_name(d)} (row {r})" if hi - lo > 1 else device_name(d)
    return labels


def shard_for_pmap(batch: Any, devices: Any = None, pad: bool = False) -> Any:
    """Reshape every leaf ``(B, ...) -> (n, B // n, ...)`` and place row ``i`` on device ``i``.

    The row count is checked here, naming the leaf; ``pad=True`` pads to a multiple of
    ``n`` and returns a :class:`Padded` with an ``(n, B_padded // n)`` mask.

    Raises:
      ShardingError: as :func:`shard_batch`.
      DeviceSpecError, DeviceNotFoundError: bad ``devices``.

    Example:
      >>> import jax, numpy as np, jaxdev
      >>> n = jax.local_device_count()
      >>> x = jaxdev.pmap.shard_for_pmap(np.zeros((2 * n, 3)))
      >>> x.shape == (n, 2, 3)
      True
    """
    n, _, stacked = _pmap_mesh(devices)
    return place_rows(batch, stacked, n, pad, stacked, pmap=True)


def unshard_from_pmap(tree: Any, padding: Padded | jax.Array | np.ndarray | int | None = None):
    """Merge the two leading axes ``(n, m, ...) -> (n * m, ...)`` and drop padding, bit for bit.

    ``padding`` is as :func:`unpad` takes it (``None`` keeps every row).

    Raises:
      ShardingError: a leaf has fewer than two axes or the wrong row count.

    Example:
      >>> import jax, numpy as np, jaxdev
      >>> n = jax.local_device_count()
      >>> p = jaxdev.pmap.shard_for_pmap(np.arange(2 * n + 1), pad=True)
      >>> jaxdev.pmap.unshard_from_pmap(p.batch, p).tolist() == list(range(2 * n + 1))
      True
    """
    leaves, treedef = checked_leaves(tree, "tree", "unshard_from_pmap", host=False)
    raise_leaves(
        tree,
        [i for i, x in enumerate(leaves) if np.ndim(x) < 2],
        "`tree` leaves need two leading axes (devices, rows per device) to merge. Leaves:",
        lambda i: f"shape {np.shape(leaves[i])}",
    )
    flat = [select_rows(x, None, merge=True) for x in leaves]
    merged = jax.tree_util.tree_unflatten(treedef, flat)
    return merged if padding is None else unpad(merged, padding)
