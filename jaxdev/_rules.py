"""STUB (issue 12): rules -> shardings."""

from __future__ import annotations

from typing import Any

Rules = Any


def param_shardings(tree: Any, mesh: Any, rules: Rules = "replicate", **options: Any) -> Any:
    raise NotImplementedError


def shard_params(tree: Any, mesh: Any, rules: Rules = "replicate", **options: Any) -> Any:
    raise NotImplementedError


def state_shardings(state: Any, mesh: Any, rules: Rules = "replicate", **options: Any) -> Any:
    raise NotImplementedError
