"""Memory you can see and fit: the ledger, the plan, explanations, fitting, offload.

``jaxdev.memory``: :func:`ledger` (what is live on each device, by tree and
leaf), :func:`plan` (the bytes per device of a state, batch and step, from
shapes alone), :func:`fit_memory` (the cheapest compiled option that fits),
their result types, and the explanation of an out-of-memory error.

Imports the core only (``jaxdev._*``). The names after ``__all__`` are the
interface the train and checkpoint subsystems use: a step is taken as its
description (:class:`StepSpec`, which train builds), its strategy asked for
every layout.

Example:
  >>> import jax.numpy as jnp, jaxdev
  >>> jaxdev.memory.plan({"w": jnp.zeros((1024, 1024))})["params"]  # bytes per device
  4194304
"""

# ruff: noqa: I001, F401 - re-exports, public first

from ._memory import LedgerEntry, MemoryLedger, ledger
from ._plan import MemoryPlan, plan
from ._explain import MemoryExplanation, MemoryFit, fit_memory

__all__ = [n for n in dir() if not n.startswith("_")]  # the names imported above

# for the train and checkpoint subsystems
from ._explain import OPTIONS, check_step_memory, explain_memory, oom_error, state_shapes
from ._offload import check_offload, offloaded, streamed
from ._oom import explained_oom, is_resource_exhausted, plan_lines
from ._plan import check_state, resolve_limit
from ._spec import StepSpec
