"""STUB (issue 12): memory plans."""

from __future__ import annotations

from typing import Any


class MemoryPlan:
    pass


def plan(state_or_shapes: Any, mesh: Any = None, rules: Any = "replicate", **options: Any):
    raise NotImplementedError
