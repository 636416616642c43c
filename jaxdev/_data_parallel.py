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

    ``data_parallel(fn, mesh)(params, *batch)`` replicates ``params`` (a no-op when they
    already are), splits every batch argument with :func:`shard_batch` (padding an uneven
    batch), runs ``jax.jit(fn)`` and returns exactly the original rows, in order, on the
    mesh. ``fn`` must work row by row (a mean over the batch would mix in padding).

    Raises:
      ShardingError: (at call time) empty or mismatched batch arguments, scalar leaves, or
        an output leaf without the batch axis; each names the leaf.

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
