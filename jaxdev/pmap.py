"""The layout ``jax.pmap`` takes: a leading device axis, stacked or sharded, and back.

``Strategy.pmap`` uses it for you; these are for your own ``jax.pmap`` code
(flax's ``jax_utils.replicate`` / ``common_utils.shard`` and their inverses).

Example:
  >>> import numpy as np, jaxdev
  >>> jaxdev.pmap.shard_for_pmap(np.zeros((8, 3)), 2).shape
  (2, 4, 3)
"""

# ruff: noqa: F401 - re-exports

from ._pmap_layout import shard_for_pmap as shard_for_pmap
from ._pmap_layout import stack_for_pmap as stack_for_pmap
from ._pmap_layout import unshard_from_pmap as unshard_from_pmap
from ._pmap_layout import unstack_from_pmap as unstack_from_pmap

__all__ = ["shard_for_pmap", "stack_for_pmap", "unshard_from_pmap", "unstack_from_pmap"]
