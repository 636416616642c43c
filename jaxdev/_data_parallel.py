"""Fleuret's DataParallel as a function transform: split, replicate, run, gather."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from ._batches import shard_batch, unpad
from ._mesh import check_mesh
from ._replication import replicate


def data_parallel(fn: Callable[..., Any], mesh: Mesh | None = None) -> Callable[..., Any]:
    """Turn a per-row function into a data parallel one (Fleuret's DataParallel).

    ``dp = data_parallel(apply_fn, mesh)``; then ``dp(params, *batch)``
    replicates ``params`` (a no-op when already replicated: replicate them
    once with :func:`replicate` to avoid a copy per call), splits every
    batch argument over the mesh with :func:`shard_batch` (padding an uneven
    batch by repeating its last row), runs ``jax.jit(fn)`` and returns the
    outputs with exactly the original rows, in order, as ``jax.Array`` on
    the mesh devices (see :func:`unpad`; :func:`jaxdev.to_host` fetches them).

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
        m = check_mesh(mesh)
        padded = shard_batch(batch, m, pad=True)
        out = jitted(replicate(params, m), *padded.batch)
        return unpad(out, padded)

    return dp
