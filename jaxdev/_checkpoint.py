"""STUB (issue 13): checkpoints on orbax-checkpoint."""

from __future__ import annotations

from typing import Any


def save(path: Any, tree: Any, *, step: int | None = None) -> None:
    raise NotImplementedError


def restore(path: Any, target: Any = None) -> Any:
    raise NotImplementedError


class Checkpointer:
    pass
