"""True replication: a full copy of every leaf on every device of a mesh (not a stacked axis)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ._leaves import checked_leaves, raise_drift, raise_leaves, replica_copies
from ._mesh import check_mesh, replicated_sharding
from ._placement import to_device
from ._pmap_layout import is_stacked


def replicate(tree: Any, mesh: Mesh | None = None) -> Any:
    """Replicate every leaf of ``tree`` on every device of ``mesh`` (``NamedSharding(mesh, P())``).

    Built on :func:`jaxdev.to_device`: an already replicated tree comes back as itself. A
    leaf already on one device of ``mesh`` lends its buffer to that replica, so donating
    the result deletes the source; use :func:`jaxdev.copy_to` when you will donate.

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
    return to_device(tree, replicated_sharding(check_mesh(mesh)))


def unreplicate(tree: Any, check: bool = False) -> Any:
    """Return one copy of every replicated leaf: the first addressable device's (no copy made).

    Single-device arrays and host values pass through. ``check=True`` also verifies every
    replica (this process's) is bitwise identical, with one batched fetch.

    Raises:
      ShardingError: a leaf is sharded, or (``check``) replicas differ; each leaf listed
        with its key path and the devices that drifted.
      DeletedArrayError: a leaf was deleted or donated.
      PlacementError: called on traced values inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.replicate({"w": jnp.arange(3.0)}, jaxdev.data_mesh())
      >>> one = jaxdev.unreplicate(params, check=True)
      >>> len(one["w"].devices()), one["w"].tolist()
      (1, [0.0, 1.0, 2.0])
    """
    leaves, treedef = checked_leaves(tree, "tree", "unreplicate", host=False)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    raise_leaves(
        tree,
        [i for i in arrays if not leaves[i].sharding.is_fully_replicated],
        "`tree` has leaves that are sharded, not replicated, so no single device holds a full "
        "copy. Fetch them with `jaxdev.to_host`, or replicate them first with "
        "`jaxdev.replicate`. Leaves:",
        lambda i: _not_replicated(leaves[i]),
    )
    multi = [i for i in arrays if len(leaves[i].sharding.device_set) > 1]
    if check:
        raise_drift(
            tree,
            replica_copies(leaves, multi),
            "`tree` has replicas that drifted apart: every device should hold bitwise "
            "identical values, but these differ from the majority. Something updated the "
            "copies differently (a missing `lax.pmean` over gradients, a per-device RNG, "
            "an in-place host write); re-replicate from a trusted copy. Leaves:",
        )
    out = list(leaves)
    for i in multi:
        out[i] = leaves[i].addressable_shards[0].data
    return jax.tree_util.tree_unflatten(treedef, out)


def _not_replicated(x: jax.Array) -> str:
    s = x.sharding
    spec = s.spec if isinstance(s, NamedSharding) else type(s).__name__
    hint = " (a stacked pmap copy? use `jaxdev.pmap.unstack_from_pmap`)" if is_stacked(x) else ""
    return f"shape {tuple(x.shape)}, sharding {spec}{hint}"
