"""Donation safety: refuse a call that would donate a deleted or a shared buffer.

JAX segfaults (several devices) or raises a bare INVALID_ARGUMENT (one device)
on a state already donated, or one array reached twice through the donated
arguments; :func:`check_donatable` names the leaves first, in one pass.
"""

from __future__ import annotations

from typing import Any

import jax

from .._errors import DeletedArrayError, PlacementError
from .._leaves import array_type, deleted, is_jax_array, key_strings


def check_donatable(state: Any, metrics: Any, donating: bool = True) -> None:
    """Raise before a call that would donate (or read) a deleted or a shared buffer.

    ``donating=False`` (an eval step): only deleted leaves are refused.
    """
    impl, ids, n = array_type(), set(), 0
    for x in jax.tree.leaves((state, metrics)):  # one pass: it runs before every call
        if type(x) is impl:
            if x.is_deleted():
                _raise_deleted(state, metrics, donating)
        elif not is_jax_array(x):
            continue
        elif deleted(x):
            _raise_deleted(state, metrics, donating)
        ids.add(id(x))
        n += 1
    if donating and len(ids) != n:
        _raise_shared(state, metrics)


def _named_leaves(state: Any, metrics: Any) -> list[tuple[str, Any]]:
    trees = {"state": state, "metrics": metrics}
    return [
        (name + p, x)
        for name, t in trees.items()
        for p, x in zip(key_strings(t), jax.tree.leaves(t))
    ]


def _raise_deleted(state: Any, metrics: Any, donating: bool = True) -> None:
    dead = [p for p, x in _named_leaves(state, metrics) if is_jax_array(x) and deleted(x)]
    fix = (
        "The step donates `state` and `metrics`: after `state, metrics = step(state, "
        "batch, metrics)` use the returned objects, not the ones passed in (or make the "
        "step with `donate=False`)."
        if donating
        else "An eval step never deletes its inputs: they were donated elsewhere (a train "
        "step's old state, `jax.jit(..., donate_argnums=...)`) or `.delete()`d. Pass the "
        "state (or params) a train step returned last."
    )
    raise DeletedArrayError(
        f"the step got {len(dead)} deleted or donated leaf/leaves: {', '.join(dead[:8])}"
        + (" ..." if len(dead) > 8 else "")
        + f". {fix}"
    )


def _raise_shared(state: Any, metrics: Any) -> None:
    seen: dict[int, str] = {}
    pairs = []
    for path, x in _named_leaves(state, metrics):
        if is_jax_array(x):
            if id(x) in seen:
                pairs.append(f"{seen[id(x)]} and {path}")
            seen.setdefault(id(x), path)
    raise PlacementError(
        "the step would donate one array twice (segfault in XLA): "
        + "; ".join(pairs[:8])
        + " are the same jax.Array. Give each leaf its own buffer (`jaxdev.copy_to`), or "
        "make the step with `donate=False`."
    )


__all__ = ["check_donatable"]
