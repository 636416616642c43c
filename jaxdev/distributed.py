"""Multi-process JAX: ``jax.distributed`` with preflight checks and bounded failures.

The public surface of :mod:`jaxdev._distributed` and :mod:`jaxdev._multihost`:
call :func:`initialize` first thing in every process, then use jaxdev as on
one host (``shard_batch`` assembles global batches from each process's rows).
"""

# ruff: noqa: I001 - the re-exports are listed in the README's order

from ._distributed import DistributedConfig as DistributedConfig
from ._distributed import initialize as initialize
from ._distributed import is_initialized as is_initialized
from ._distributed import shutdown as shutdown
from ._multihost import assert_same_across_processes as assert_same_across_processes

__all__ = [
    "DistributedConfig",
    "assert_same_across_processes",
    "initialize",
    "is_initialized",
    "shutdown",
]
