"""Multi-process JAX: ``jax.distributed`` with preflight checks and bounded failures.

Call :func:`initialize` first thing in every process, then use jaxdev as on one host
(the README's "Multi-host"). Here: initialize, fingerprints, the launcher, the hang watchdog.
Imports the core only; the names after ``__all__`` are for the subsystems above it.
"""

# ruff: noqa: I001, F401 - the re-exports are listed in the README's order

from ._distributed import DistributedConfig as DistributedConfig
from ._distributed import initialize as initialize
from jax.distributed import is_initialized as is_initialized  # JAX's own, re-exported
from ._distributed import shutdown as shutdown
from ._hang import heartbeat as heartbeat
from .._multihost import assert_same_across_processes as assert_same_across_processes
from ._fingerprint import check_same_program as check_same_program
from ._fingerprint import same_program as same_program
from ._launch import launch as launch

__all__ = [n for n in dir() if not n.startswith("_")]  # the names imported above

# for the train, checkpoint, cli and testing subsystems
from ._hang import beat, is_user_file, step_call
from ._launch import UsageParser, describe_returncode
from ._launch import main as launch_main
