"""Every process runs the same program: a fingerprint of each step, compared once.

JAX's multi-controller runtime pairs the collectives of the processes by
their order only. When the processes compile different programs with the
same collectives (process 0 sums where process 1 takes the max, one scales
its loss by 2), every process finishes with exit code 0 and wrong numbers
(measured on JAX 0.10.2); with one collective more or less the job hangs
until a timeout that names nobody.

:func:`check_same_program` lowers a function for its arguments (JAX caches
the trace, so the call that follows does not trace again), hashes the
StableHLO text, and compares the hash across processes in one small exchange
through the coordinator's key-value store, bounded by
``$JAXDEV_SYNC_TIMEOUT`` (see :func:`jaxdev._multihost.exchange`). On a
mismatch every process raises a :class:`~jaxdev.DistributedError` naming the
processes whose program differs, the operations whose counts differ and the
inputs whose shape, dtype or sharding differ. :func:`same_program` runs the
check at a function's first call only; jaxdev's train and eval steps do it
for each program they compile. Nothing is exchanged per step.

Only programs that span several processes are compared: a program on this
process's own devices meets no other process, and each process may run its
own. The hash is taken without debug information (no file names, line
numbers, process ids or host names). ``JAXDEV_SAME_PROGRAM=0`` (on every
process) turns the check off.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._errors import DistributedError, join_failures
from .._leaves import keystr
from .._multihost import (
    compare_leaf_tables,
    describe_groups,
    exchange,
    group_processes,
    shape_dtype,
)

ENV_SAME_PROGRAM = "JAXDEV_SAME_PROGRAM"
_TAG = "same_program"
# An operation, not an attribute: `%0 = stablehlo.add`, `applies stablehlo.add`,
# `"stablehlo.all_reduce"(`; attributes (`mhlo.sharding = ...`) are followed by `=`.
_OP = re.compile(r'(?:^|[\s="(])((?:stablehlo|mhlo|chlo|sdy)\.[a-z_]+)\b(?!\s*=)', re.M)
_CUSTOM_CALL = re.compile(r"custom_call @([\w.]+)")
_SCALAR = re.compile(r"stablehlo\.constant (dense<[^<>]{1,40}> : tensor<[^<>]{0,20}>)")
_SIZE = re.compile(r"mhlo\.num_(?:partitions|replicas) = (\d+)")


def enabled() -> bool:
    """Return whether the cross-process program check runs (``$JAXDEV_SAME_PROGRAM``).

    Returns:
      ``False`` when ``JAXDEV_SAME_PROGRAM`` is ``0``, ``false``, ``off`` or
      ``no``; ``True`` otherwise.

    Example:
      >>> enabled()
      True
    """
    return os.environ.get(ENV_SAME_PROGRAM, "1").strip().lower() not in ("0", "false", "off", "no")


def program_text(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """Return the StableHLO text of ``fn`` lowered for these arguments.

    Args:
      fn: a jitted (or pmapped) function, anything with ``.lower``; a plain
        traceable function is wrapped in ``jax.jit`` first.
      *args: the arguments of the call.
      **kwargs: its keyword arguments.

    Returns:
      The program text without debug information: no file names or line
      numbers, nothing that depends on the process.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> "stablehlo.multiply" in program_text(jax.jit(lambda x: 2 * x), jnp.ones(3))
      True
    """
    lower = getattr(fn, "lower", None)
    if lower is None:
        lower = jax.jit(fn).lower
    return lower(*args, **kwargs).as_text(debug_info=False)


def fingerprint(text: str) -> str:
    """Return the sha256 of a program text (hex).

    Args:
      text: e.g. :func:`program_text`.

    Returns:
      64 hex digits, equal on two processes iff their texts are equal.

    Example:
      >>> fingerprint("module {}") == fingerprint("module {}") != fingerprint("module { }")
      True
    """
    return hashlib.sha256(text.encode()).hexdigest()


def op_counts(text: str) -> dict[str, int]:
    """Count the operations of a StableHLO text, custom calls by target, small constants by value.

    Args:
      text: e.g. :func:`program_text`.

    Returns:
      ``{operation: count}``, sorted by name; custom calls appear as
      ``custom_call @target``, small constants also as ``constant dense<v> : type``.

    Example:
      >>> op_counts("%0 = stablehlo.add %a, %b {mhlo.sharding = \\"x\\"}\\nreturn %0")
      {'stablehlo.add': 1}
      >>> op_counts("%c = stablehlo.constant dense<2.0> : tensor<f32>")
      {'constant dense<2.0> : tensor<f32>': 1, 'stablehlo.constant': 1}
    """
    counts = collections.Counter(_OP.findall(text))
    counts.update(f"custom_call @{t}" for t in _CUSTOM_CALL.findall(text))
    counts.update(f"constant {c}" for c in _SCALAR.findall(text))
    counts.pop("stablehlo.custom_call", None)
    return dict(sorted(counts.items()))


def _describe_input(leaf: Any) -> str:
    """``'shape dtype sharding-spec'`` of one argument leaf (no device ids)."""
    sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
    if isinstance(sharding, NamedSharding):
        return f"{shape_dtype(leaf)} {sharding.spec}"
    return f"{shape_dtype(leaf)} {type(sharding).__name__ if sharding is not None else 'host'}"


def input_table(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> dict[str, str]:
    """Describe every argument leaf: ``{path: 'shape dtype sharding'}``.

    Args:
      args: the positional arguments of a call.
      kwargs: its keyword arguments.

    Returns:
      One entry per leaf, keyed ``args[i]...`` / ``kwargs['k']...``; the
      sharding is a ``PartitionSpec`` or a sharding type, never device ids.

    Example:
      >>> input_table(({"w": np.zeros((2, 3), np.float32)},))
      {"args[0]['w']": '(2, 3) float32 host'}
    """
    table = {}
    for root, tree in (("args", tuple(args)), ("kwargs", kwargs or {})):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            table[root + keystr(path)] = _describe_input(leaf)
    return table


def spans_processes(text: str, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether a program runs on devices of several processes.

    Args:
      text: its StableHLO text (for the number of partitions and replicas).
      args: its positional arguments.
      kwargs: its keyword arguments.

    Returns:
      ``True`` when it uses more devices than this process has, or an
      argument is a global array not fully addressable here.

    Example:
      >>> spans_processes("module @m attributes {mhlo.num_partitions = 1 : i32}", ())
      False
    """
    devices = int(np.prod([int(n) for n in _SIZE.findall(text)] or [1]))
    if devices > jax.local_device_count():
        return True
    leaves = jax.tree.leaves((tuple(args), kwargs or {}))
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves)


def _payload(name: str, text: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    return json.dumps(
        {
            "name": name,
            "sha": fingerprint(text),
            "ops": op_counts(text),
            "inputs": input_table(args, kwargs),
        },
        sort_keys=True,
    )


def _parse(payload: str) -> dict[str, Any]:
    """A process's payload; a bare digest when the exchange had no coordinator client."""
    try:
        return json.loads(payload)
    except ValueError:
        return {"name": "?", "sha": payload, "ops": {}, "inputs": {}}


def program_differences(payloads: Sequence[dict[str, Any]]) -> list[str]:
    """Return one line per difference between the processes' programs.

    Args:
      payloads: one ``{"name", "sha", "ops", "inputs"}`` dict per process.

    Returns:
      Lines for the function names, the program hashes, each operation
      whose count differs and each input that differs; empty when every
      hash is equal.

    Example:
      >>> a = {"name": "f", "sha": "aa", "ops": {"stablehlo.add": 1}, "inputs": {}}
      >>> b = {"name": "f", "sha": "bb", "ops": {"stablehlo.maximum": 1}, "inputs": {}}
      >>> for line in program_differences([a, b]): print(line)
      program sha256: process 0: aa; process 1: bb
      operation stablehlo.add: process 0: 1; process 1: 0
      operation stablehlo.maximum: process 0: 0; process 1: 1
    """
    shas = [p["sha"] for p in payloads]
    if len(set(shas)) == 1:
        return []
    lines = []
    names = [p["name"] for p in payloads]
    if len(set(names)) > 1:
        lines.append(f"function: {describe_groups(group_processes(names))}")
    lines.append(f"program sha256: {describe_groups(group_processes(shas), lambda s: s[:12])}")
    ops = set().union(*(p["ops"] for p in payloads))
    op_tables = [{op: str(p["ops"].get(op, 0)) for op in ops} for p in payloads]
    op_lines = sorted(compare_leaf_tables(op_tables), key=lambda ln: ln.startswith("constant"))
    lines += [f"operation {line}" for line in op_lines]  # operations first, then constants
    lines += [f"input {line}" for line in compare_leaf_tables([p["inputs"] for p in payloads])]
    if len(lines) == 1 + (len(set(names)) > 1):
        lines.append(
            "same operations and inputs: a constant, an attribute, a sharding or the order "
            "of operations differs"
        )
    return lines


def _who_differs(shas: Sequence[str]) -> str:
    """``'process 2 differs from process 0, 1'``, or the groups when there is no majority."""
    groups = group_processes(shas)
    largest = max(groups.values(), key=len)
    if 2 * len(largest) > len(shas):
        odd = sorted(p for ids in groups.values() if ids is not largest for p in ids)
        verb = "differs" if len(odd) == 1 else "differ"
        return (
            f"process{'es' if len(odd) > 1 else ''} {', '.join(map(str, odd))} {verb} from "
            f"process{'es' if len(largest) > 1 else ''} {', '.join(map(str, largest))}"
        )
    listing = " vs ".join(", ".join(map(str, ids)) for ids in groups.values())
    return f"processes {listing} differ (no majority to compare against)"


def _raise_different(name: str, payloads: Sequence[dict[str, Any]]) -> None:
    me = jax.process_index()
    raise DistributedError(
        join_failures(
            f"`{name}`: the processes compiled different programs for its first call; "
            f"{_who_differs([p['sha'] for p in payloads])} (seen from process {me}):",
            program_differences(payloads),
        )
        + "\nEvery process of a multi-process job must run the same program: JAX pairs "
        "their collectives by order only, so different programs give wrong numbers on "
        "every process (exit code 0) or hang. Fix: keep process-dependent choices "
        "(`jax.process_index()`, per-host flags, constants, shapes) out of the traced "
        f"function and pass them as data; if the difference is intended, set "
        f"{ENV_SAME_PROGRAM}=0 on every process."
    )


def check_same_program(
    fn: Callable,
    *args: Any,
    name: str | None = None,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> str | None:
    """Check every process compiles the same program for ``fn(*args, **kwargs)``.

    Call it on every process, before the first call of a jitted function
    (or use :func:`same_program`, which does it at the first call). The
    function is lowered for the arguments (the trace is cached and reused
    by the call), the StableHLO text is hashed, and the hashes are
    compared in one exchange through the coordinator. With one process, a
    program on this process's devices only, or ``JAXDEV_SAME_PROGRAM=0``,
    nothing is lowered or exchanged.

    Args:
      fn: a jitted or pmapped function (anything with ``.lower``), or a
        traceable function (wrapped in ``jax.jit`` to lower it).
      *args: the arguments of the call to check.
      name: how messages name the function (default: its ``__name__``).
      timeout_s: seconds to wait for the slowest process (``None``:
        ``$JAXDEV_SYNC_TIMEOUT`` or 300).
      **kwargs: keyword arguments of the call (``name`` and ``timeout_s``
        belong to the check).

    Returns:
      The program's sha256 when it was compared, else ``None``.

    Raises:
      DistributedError: the programs differ (names the processes, the
        operations whose counts differ and the inputs that differ; raised on
        every process), or a process did not arrive within ``timeout_s``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> step = jax.jit(lambda x: x.sum())
      >>> jaxdev.distributed.check_same_program(step, jnp.ones(4)) is None  # one process
      True
    """
    if jax.process_count() == 1 or not enabled():
        return None
    name = name or getattr(fn, "__name__", None) or type(fn).__name__
    text = program_text(fn, *args, **kwargs)
    if not spans_processes(text, args, kwargs):
        return None
    payloads = [_parse(p) for p in exchange(_TAG, _payload(name, text, args, kwargs), timeout_s)]
    if len({p["sha"] for p in payloads}) > 1:
        _raise_different(name, payloads)
    return payloads[0]["sha"]


class SameProgram:
    """A function whose first call first runs :func:`check_same_program`.

    Made by :func:`same_program`. Calls go to the wrapped function; other
    attributes (``lower``, ``trace``, ...) are the wrapped function's.

    Attributes:
      fn: the wrapped function.
      name: how messages name it.
      checked: whether the first call's check has run.
    """

    def __init__(self, fn: Callable, name: str | None = None, timeout_s: float | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.checked = False
        self._timeout_s = timeout_s

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.checked:
            check_same_program(self.fn, *args, name=self.name, timeout_s=self._timeout_s, **kwargs)
            self.checked = True
        return self.fn(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:  # no recursion while ``fn`` is unset (copy, pickle)
        return getattr(object.__getattribute__(self, "fn"), attr)

    def __repr__(self) -> str:
        return f"same_program({self.fn!r})"


def same_program(
    fn: Callable | None = None, *, name: str | None = None, timeout_s: float | None = None
) -> Any:
    """Wrap a jitted function so its first call checks every process runs the same program.

    Usable as ``same_program(jitted)`` or as a decorator (``@same_program``
    or ``@same_program(name="eval")``, above ``@jax.jit``). The first call
    runs :func:`check_same_program` with its arguments, then the function;
    later calls go straight to the function (one flag test, no exchange).
    Call it on every process, in the same order as the other processes.

    Args:
      fn: the function to wrap; ``None`` returns a decorator.
      name: how messages name it (default: its ``__name__``).
      timeout_s: seconds the check waits for the slowest process.

    Returns:
      A :class:`SameProgram` (or a decorator making one).

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> @jaxdev.distributed.same_program
      ... @jax.jit
      ... def total(x):
      ...     return x.sum()
      >>> float(total(jnp.ones(4)))  # one process: no check, no exchange
      4.0
    """
    if fn is None:
        return lambda f: SameProgram(f, name, timeout_s)
    return SameProgram(fn, name, timeout_s)
