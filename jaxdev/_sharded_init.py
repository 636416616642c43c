"""STUB (issue 12): build params directly in their shardings."""

from __future__ import annotations

from typing import Any


def init_sharded(init_fn: Any, *args: Any, mesh: Any, rules: Any = "replicate", **options: Any):
    raise NotImplementedError
