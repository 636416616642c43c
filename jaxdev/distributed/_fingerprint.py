"""Every process runs the same program: a fingerprint of each step, compared once.

:func:`check_same_program` hashes the StableHLO text of a program spanning several
processes and compares it in one bounded exchange, naming the processes, operations and
inputs that differ.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from .._errors import DistributedError, join_failures
from .._leaves import keystr
from .._multihost import compare_leaf_tables, exchange, group_processes, shape_dtype

ENV_SAME_PROGRAM = "JAXDEV_SAME_PROGRAM"
_TAG = "same_program"
# An operation, not an attribute: `%0 = stablehlo.add`, `applies stablehlo.add`,
# `"stablehlo.all_reduce"(`; attributes (`mhlo.sharding = ...`) are followed by `=`.
_OP = re.compile(r'(?:^|[\s="(])((?:stablehlo|mhlo|chlo|sdy)\.[a-z_]+)\b(?!\s*=)', re.M)
_CUSTOM_CALL = re.compile(r"custom_call @([\w.]+)")
_SCALAR = re.compile(r"stablehlo\.constant (dense<[^<>]{1,40}> : tensor<[^<>]{0,20}>)")
_SIZE = re.compile(r"mhlo\.num_(?:partitions|replicas) = (\d+)")


def program_text(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The StableHLO text of ``fn`` (jitted if not) for the args, without debug information."""
    lower = getattr(fn, "lower", None) or jax.jit(fn).lower
    return lower(*args, **kwargs).as_text(debug_info=False)


def op_counts(text: str) -> dict[str, int]:
    """Count the operations of a StableHLO text, custom calls by target, small constants by value.

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


def input_table(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> dict[str, str]:
    """Describe every argument leaf: ``{path: 'shape dtype sharding'}`` (specs, no device ids)."""
    table = {}
    for root, tree in (("args", tuple(args)), ("kwargs", kwargs or {})):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
            where = type(sharding).__name__ if sharding is not None else "host"
            if isinstance(sharding, NamedSharding):
                where = str(sharding.spec)
            table[root + keystr(path)] = f"{shape_dtype(leaf)} {where}"
    return table


def spans_processes(text: str, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether a program uses more devices than this process has, or a non-addressable argument."""
    if math.prod(int(n) for n in _SIZE.findall(text)) > jax.local_device_count():
        return True
    leaves = jax.tree.leaves((tuple(args), kwargs or {}))
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves)


def payload(name: str, text: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a process sends: the function's name, the program's sha256, its ops, its inputs."""
    sha = hashlib.sha256(text.encode()).hexdigest()
    return {"name": name, "sha": sha, "ops": op_counts(text), "inputs": input_table(args, kwargs)}


def _parse(payload: str) -> dict[str, Any]:
    """A process's payload; a bare digest when the exchange had no coordinator client."""
    if payload.startswith("{"):  # a digest is hex digits, and all digits read as a JSON int
        return json.loads(payload)
    return {"name": "?", "sha": payload, "ops": {}, "inputs": {}}


def program_differences(payloads: Sequence[dict[str, Any]]) -> list[str]:
    """One line per difference between the processes' ``{"name", "sha", "ops", "inputs"}``.

    Example:
      >>> a = {"name": "f", "sha": "aa", "ops": {"stablehlo.add": 1}, "inputs": {}}
      >>> b = {"name": "f", "sha": "bb", "ops": {"stablehlo.maximum": 1}, "inputs": {}}
      >>> for line in program_differences([a, b]): print(line)
      program sha256: process 0: aa; process 1: bb
      operation stablehlo.add: process 0: 1; process 1: 0
      operation stablehlo.maximum: process 0: 0; process 1: 1
    """
    if len({p["sha"] for p in payloads}) == 1:
        return []
    heads = [{"function": p["name"], "program sha256": p["sha"][:12]} for p in payloads]
    ops = set().union(*(p["ops"] for p in payloads))
    op_tables = [{op: str(p["ops"].get(op, 0)) for op in ops} for p in payloads]
    op_lines = sorted(compare_leaf_tables(op_tables), key=lambda ln: ln.startswith("constant"))
    lines = [f"operation {line}" for line in op_lines]  # operations first, then constants
    lines += [f"input {line}" for line in compare_leaf_tables([p["inputs"] for p in payloads])]
    if not lines:
        lines.append(
            "same operations and inputs: a constant, an attribute, a sharding or the order "
            "of operations differs"
        )
    return compare_leaf_tables(heads) + lines


def _who_differs(shas: Sequence[str]) -> str:
    """``'process 2 differs from process 0, 1'``, or the groups when there is no majority."""
    def who(ids: list[int]) -> str:
        return f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"

    groups = group_processes(shas)
    largest = max(groups.values(), key=len)
    if 2 * len(largest) > len(shas):
        odd = sorted(p for ids in groups.values() if ids is not largest for p in ids)
        return f"{who(odd)} {'differs' if len(odd) == 1 else 'differ'} from {who(largest)}"
    listing = " vs ".join(", ".join(map(str, ids)) for ids in groups.values())
    return f"processes {listing} differ (no majority to compare against)"


def check_same_program(
    fn: Callable,
    *args: Any,
    name: str | None = None,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> str | None:
    """Check every process compiles the same program for ``fn(*args, **kwargs)``.

    Call it on every process before the first call (or use :func:`same_program`). With one
    process, a program on this process's devices only, or ``JAXDEV_SAME_PROGRAM=0``,
    nothing is lowered or exchanged.

    Args:
      fn: a jitted or pmapped function, or a traceable one.
      *args: the arguments of the call to check.
      name: how messages name the function (default: its ``__name__``).
      timeout_s: seconds to wait for the slowest process (``None``: the default).
      **kwargs: keyword arguments of the call.

    Returns:
      The program's sha256 when it was compared, else ``None``.

    Raises:
      DistributedError: the programs differ (on every process), or a process did not
        arrive within ``timeout_s``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> step = jax.jit(lambda x: x.sum())
      >>> jaxdev.distributed.check_same_program(step, jnp.ones(4)) is None  # one process
      True
    """
    off = os.environ.get(ENV_SAME_PROGRAM, "1").strip().lower() in ("0", "false", "off", "no")
    if jax.process_count() == 1 or off:
        return None
    name = name or getattr(fn, "__name__", None) or type(fn).__name__
    text = program_text(fn, *args, **kwargs)
    if not spans_processes(text, args, kwargs):
        return None
    own = json.dumps(payload(name, text, args, kwargs), sort_keys=True)
    payloads = [_parse(p) for p in exchange(_TAG, own, timeout_s)]
    if len({p["sha"] for p in payloads}) == 1:
        return payloads[0]["sha"]
    who = _who_differs([p["sha"] for p in payloads])
    raise DistributedError(
        join_failures(
            f"`{name}`: the processes compiled different programs for its first call; "
            f"{who} (seen from process {jax.process_index()}):",
            program_differences(payloads),
        )
        + "\nEvery process of a multi-process job must run the same program: JAX pairs "
        "their collectives by order only, so different programs give wrong numbers on "
        "every process (exit code 0) or hang. Fix: keep process-dependent choices "
        "(`jax.process_index()`, per-host flags, constants, shapes) out of the traced "
        f"function and pass them as data; if the difference is intended, set "
        f"{ENV_SAME_PROGRAM}=0 on every process."
    )


class SameProgram:
    """A function whose first call first runs :func:`check_same_program` (:func:`same_program`)."""

    def __init__(self, fn: Callable, name: str | None = None, timeout_s: float | None = None):
        self.fn, self.checked, self.name, self._timeout_s = fn, False, name, timeout_s

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

    ``same_program(jitted)``, ``@same_program`` or ``@same_program(name="eval")`` above
    ``@jax.jit``; later calls go straight to the function. Call it on every process.

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
