"""Multi-process JAX: ``jax.distributed`` with preflight checks and bounded failures.

The public surface of :mod:`jaxdev.distributed._distributed`, :mod:`jaxdev._multihost`
and :mod:`jaxdev.distributed._fingerprint`: call :func:`initialize` first thing in every
process, then use jaxdev as on one host (``shard_batch`` assembles global
batches from each process's rows; train and eval steps check at their first
call that every process compiled the same program; :func:`same_program`
does the same for your own jitted functions).
"""

# ruff: noqa: I001, F401 - the re-exports are listed in the README's order

from ._distributed import DistributedConfig as DistributedConfig
from ._distributed import initialize as initialize
from ._distributed import is_initialized as is_initialized
from ._distributed import shutdown as shutdown
from ._hang import heartbeat as heartbeat
from .._multihost import assert_same_across_processes as assert_same_across_processes
from ._fingerprint import check_same_program as check_same_program
from ._fingerprint import same_program as same_program
from ._launch import launch as launch

__all__ = [
    "DistributedConfig",
    "assert_same_across_processes",
    "check_same_program",
    "heartbeat",
    "initialize",
    "is_initialized",
    "launch",
    "same_program",
    "shutdown",
]

# for the train, checkpoint, cli and testing subsystems
from ._hang import beat, is_user_file, step_call
from ._launch import UsageParser, describe_returncode
from ._launch import main as launch_main
