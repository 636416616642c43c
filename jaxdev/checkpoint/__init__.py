"""Checkpoints that never lose data: ``save``, ``restore`` and ``Checkpointer``.

Orbax writes the arrays; jaxdev adds the atomic overwrite, the writer lock,
exact-name cleanup and per-leaf checksums, and restores onto any layout.

Imports the core, ``jaxdev.distributed`` and ``jaxdev.memory`` (through
their ``__init__``).
"""

# ruff: noqa: I001, F401 - re-exports

from ._checkpoint import restore as restore
from ._checkpoint import save as save
from ._checkpointer import Checkpointer as Checkpointer
