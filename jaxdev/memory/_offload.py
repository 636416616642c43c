"""Params and optimizer state kept in host memory, streamed to the devices inside the step.

``Strategy.sharded(mesh, offload="opt_state")`` (or ``"params"``, or both) lays those
fields out in ``pinned_host`` memory; the compiled step moves them to the devices at its
start and back for its outputs, so the numbers are those without offloading, bit for
bit. :func:`offloaded` is the one place that turns a layout into its offloaded layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding

from .._asserts import HOST_KINDS
from .._errors import UsageError
from .._leaves import packed_bytes
from .._mesh import axis_size
from .._rules import has_state_fields
from .._target import is_target

HOST = "pinned_host"
"""The memory kind offloaded fields live in."""

FIELDS = ("params", "opt_state")
"""The train-state fields that can be offloaded."""


def check_offload(offload: Any, devices: Any = ()) -> tuple[str, ...]:
    """``offload`` as a sorted tuple of fields; ``()`` for ``None``.

    Raises:
      UsageError: a field other than ``'params'`` / ``'opt_state'``, or devices without
        ``pinned_host`` memory.
    """
    if offload is None:
        return ()
    fields = (offload,) if isinstance(offload, str) else offload
    if not isinstance(fields, (tuple, list)) or not all(f in FIELDS for f in fields) or not fields:
        raise UsageError(
            f"`offload` must be 'params', 'opt_state' or a tuple of them (the train-state "
            f"fields kept in host memory), got {offload!r}."
        )
    devices = list(devices)
    if is_target(devices):  # NamedSharding(..., memory_kind="pinned_host").memory_kind is None
        raise UsageError(
            f"`offload`={offload!r} cannot be planned on a target mesh: JAX drops memory kinds "
            "on compile-only devices, so XLA:GPU would plan the fields in device memory. Plan "
            "without offload (its saving: the fields' bytes in the plan's table)."
        )
    for d in devices:
        kinds = {m.kind for m in d.addressable_memories()}
        if HOST not in kinds:
            raise UsageError(
                f"`offload`={offload!r} needs '{HOST}' memory, which {d} does not have "
                f"(its memories: {sorted(kinds)})."
            )
    return tuple(sorted(set(fields)))


def is_host(s: Any) -> bool:
    """Whether sharding ``s`` puts its array in host memory."""
    return isinstance(s, Sharding) and s.memory_kind in HOST_KINDS


def offloaded(layout: Any, state: Any, fields: tuple[str, ...]) -> Any:
    """``layout`` (shardings of ``state``) with ``fields`` moved to ``pinned_host`` memory.

    A bare params tree (an eval step's) moves whole when ``'params'`` is offloaded.
    """
    if not fields or layout is None:
        return layout

    def to_host(tree: Any) -> Any:
        return jax.tree.map(lambda s: s.with_memory_kind(HOST), tree, is_leaf=_is_sharding)

    if not has_state_fields(state):
        return to_host(layout) if "params" in fields else layout
    changes = {f: to_host(getattr(layout, f)) for f in fields}
    return layout._replace(**changes) if isinstance(layout, tuple) else layout.replace(**changes)


def kept_host(layout: Any, state: Any) -> Any:
    """``layout`` with the leaves of ``state`` that already live in host memory kept there."""
    shardings, treedef = jax.tree.flatten(layout, is_leaf=_is_sharding)
    kinds = [getattr(x, "sharding", None) for x in jax.tree.leaves(state)]
    if len(shardings) != len(kinds):
        return layout
    out = [
        s.with_memory_kind(k.memory_kind) if is_host(k) and _is_sharding(s) else s
        for s, k in zip(shardings, kinds)
    ]
    return treedef.unflatten(out)


def streamed(run: Callable, layout: Any, train: bool) -> Callable:
    """``run(axis, state, ...)`` with the state's offloaded leaves streamed in and out.

    ``run`` itself when ``layout`` offloads nothing.
    """
    shardings = jax.tree.leaves(layout, is_leaf=_is_sharding)
    if not any(is_host(s) for s in shardings):
        return run

    def moved(tree: Any, back: bool) -> Any:  # inside jit: offloaded leaves in (or back)
        leaves, treedef = jax.tree.flatten(tree)
        if len(shardings) != len(leaves):  # another structure: jit will say so
            return tree
        to = lambda s: s if back else s.with_memory_kind("device")  # noqa: E731
        out = [jax.device_put(x, to(s)) if is_host(s) else x for x, s in zip(leaves, shardings)]
        return treedef.unflatten(out)

    def inner(axis: Any, state: Any, *rest: Any) -> Any:
        out = run(axis, moved(state, False), *rest)
        return (moved(out[0], True), *out[1:]) if train else out

    return inner


def _is_sharding(x: Any) -> bool:
    return isinstance(x, Sharding)


def host_bytes(lowered: Any, compiled: Any) -> tuple[int, int, int]:
    """``(arguments, outputs, donated)`` bytes per device a compiled program keeps in host memory.

    Donated host inputs are assumed to alias host outputs; ``(0, 0, 0)`` when none.
    """
    try:
        ins = jax.tree.leaves(compiled.input_shardings[0], is_leaf=_is_sharding)
        infos = jax.tree.leaves(lowered.args_info[0], is_leaf=lambda x: hasattr(x, "donated"))
        outs = jax.tree.leaves(compiled.output_shardings, is_leaf=_is_sharding)
        out_info = jax.tree.leaves(lowered.out_info)
    except Exception:  # pmap and other programs without per-leaf shardings
        return 0, 0, 0
    if len(ins) != len(infos) or len(outs) != len(out_info):
        return 0, 0, 0
    size = lambda s, i: shard_bytes(s, tuple(i.shape), i.dtype)  # noqa: E731
    host_in = [(size(s, i), i.donated) for s, i in zip(ins, infos) if is_host(s)]
    out = sum(size(s, i) for s, i in zip(outs, out_info) if is_host(s))
    return sum(n for n, _ in host_in), out, min(sum(n for n, d in host_in if d), out)


def shard_bytes(s: Sharding, shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of one shard of ``shape`` under ``s``; a dimension an axis does not divide is
    padded up (XLA's way)."""
    try:
        return packed_bytes(math.prod(s.shard_shape(shape)), dtype)
    except ValueError:
        if not isinstance(s, NamedSharding):
            raise
    spec = [*s.spec.partitions, *[None] * len(shape)]  # entries past the spec's: not split
    ns = [1 if entry is None else axis_size(s.mesh, entry) for entry in spec]
    return packed_bytes(math.prod(-(-n // k) for n, k in zip(shape, ns)), dtype)
