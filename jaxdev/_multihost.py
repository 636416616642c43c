"""Cross-process checks for multi-process JAX: global batches, same values.

Each process's description of its data goes through the coordinator's key-value store,
so every wait has a deadline and a process that never arrives is named (a collective
would block forever); without a coordinator client a digest goes through
``process_allgather``. With one process nothing is exchanged.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from ._errors import DistributedError, PlacementAssertionError, UsageError, join_failures
from ._leaves import asserts_disabled, is_prng_key, keystr

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "JAXDEV_SYNC_TIMEOUT"
_KEY_PREFIX = "jaxdev/exchange"
_ROUNDS: dict[str, itertools.count] = {}


def default_timeout_s() -> float:
    """Return the cross-process wait limit: ``$JAXDEV_SYNC_TIMEOUT`` or 300 s."""
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        value = DEFAULT_TIMEOUT_S if raw is None else float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):  # NaN too
        raise DistributedError(
            f"`{TIMEOUT_ENV}` must be a positive number of seconds, got {raw!r}. "
            f"Fix: set it to e.g. 60, or unset it for the default {DEFAULT_TIMEOUT_S:g}."
        )
    return value


def kv_client():
    """Return the coordinator client of ``jax.distributed`` (its key-value store), or ``None``."""
    # private: no public accessor of jax.distributed's coordination key-value client
    # (jax.experimental.multihost_utils reads the same global_state.client)
    from jax._src import distributed

    return distributed.global_state.client


def _publish_and_read(client, tag: str, value: str, timeout_s: float):
    """Publish ``value`` in ``tag``'s next round; return ``(values read, processes missing)``."""
    me, n = jax.process_index(), jax.process_count()
    rnd = next(_ROUNDS.setdefault(tag, itertools.count()))  # this call's number for `tag`
    key = f"{_KEY_PREFIX}/{tag}/{rnd}/"
    client.key_value_set(f"{key}{me}", value)
    deadline = time.monotonic() + timeout_s
    out = []
    for p in range(n):
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            out.append(client.blocking_key_value_get(f"{key}{p}", remaining_ms))
        except Exception:  # noqa: BLE001 - XlaRuntimeError: DEADLINE_EXCEEDED
            arrived = {k.rsplit("/", 1)[1] for k, _ in client.key_value_dir_get(key)}
            return out, [q for q in range(n) if str(q) not in arrived]
    if rnd > 0:  # everyone published round `rnd`, so all have read `rnd - 1`
        client.key_value_delete(f"{_KEY_PREFIX}/{tag}/{rnd - 1}/{me}")
    return out, []


def barrier(tag: str, timeout_s: float) -> list[int]:
    """Mark this process as arrived at ``tag``; wait up to ``timeout_s``; return the late ones.

    Never raises for a missing process: the caller says what it is likely doing.
    """
    client = kv_client() if jax.process_count() > 1 else None
    if client is None:
        return []
    return _publish_and_read(client, f"barrier/{tag}", "arrived", timeout_s)[1]


def exchange(tag: str, payload: str, timeout_s: float | None = None) -> list[str]:
    """Return every process's ``payload`` string, indexed by process id.

    Every process calls it with the same ``tag`` in the same order. Without a coordinator
    client each entry is a digest of the payload instead.

    Raises:
      DistributedError: a process did not publish within ``timeout_s``; names it.
      UsageError: ``timeout_s`` is not a number of seconds > 0.
    """
    number = isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool)
    if timeout_s is not None and not (number and 0 < timeout_s < math.inf):  # NaN too
        raise UsageError(f"`timeout_s` must be a number of seconds > 0, got {timeout_s!r}.")
    if jax.process_count() == 1:
        return [payload]
    timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
    client = kv_client()
    if client is None:  # a fixed-size digest through process_allgather
        digest = np.frombuffer(hashlib.sha256(payload.encode()).digest(), np.uint8)
        gathered = np.asarray(multihost_utils.process_allgather(digest))
        return [row.tobytes().hex()[:16] for row in gathered]
    out, missing = _publish_and_read(client, tag, payload, timeout_s)
    if len(out) == (n := jax.process_count()):
        return out
    names = ", ".join(map(str, missing)) or "?"
    raise DistributedError(
        f"`{tag}`: process {jax.process_index()} waited {timeout_s:g} s for every process to "
        f"reach this check, but process(es) {names} of {n} never arrived. They are hung "
        "(e.g. in the data loader), dead, or calling a different sequence of checks. "
        f"Fix: find what process {names} is doing; raise `timeout_s` (or `{TIMEOUT_ENV}`) "
        "if it is merely slow."
    )


def group_processes(values: Sequence[Any]) -> dict[Any, list[int]]:
    """Group process ids by their value: ``{value: [process ids]}`` in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for p, v in enumerate(values):
        groups.setdefault(v, []).append(p)
    return groups


def compare_leaf_tables(tables: Sequence[dict[str, str]]) -> list[str]:
    """One line per leaf whose value differs between the per-process ``{path: value}`` tables.

    Example:
      >>> compare_leaf_tables([{"['x']": "(4,)"}, {"['x']": "(6,)"}, {"['x']": "(4,)"}])
      ["['x']: process 0, 2: (4,); process 1: (6,)"]
    """
    lines = []
    for path in sorted(set().union(*tables)):
        groups = group_processes([t.get(path, "<missing>") for t in tables]).items()
        if len(groups) > 1:
            by_value = (f"process {', '.join(map(str, ids))}: {v}" for v, ids in groups)
            lines.append(f"{path}: {'; '.join(by_value)}")
    return lines


def _differences(tag: str, tree: Any, describe: Callable, timeout_s: float | None) -> list[str]:
    """Exchange ``{path: describe(leaf)}``; one line per leaf that differs (digests: fallback)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    table = json.dumps({keystr(path): describe(leaf) for path, leaf in leaves}, sort_keys=True)
    payloads = exchange(tag, table, timeout_s)
    digests = kv_client() is None  # then each payload is the whole tree's digest
    return compare_leaf_tables([{"<tree>": p} if digests else json.loads(p) for p in payloads])


def shape_dtype(leaf: Any) -> str:
    """``'(4, 3) float32'``: a leaf's shape and dtype (typed PRNG keys keep their JAX dtype).

    Example:
      >>> shape_dtype(np.zeros((4, 3), np.float32)), shape_dtype(2.0)
      ('(4, 3) float32', '() float64')
      >>> shape_dtype(jax.random.split(jax.random.key(0), 4))
      '(4,) key<fry>'
    """
    dtype = getattr(leaf, "dtype", None)
    return f"{tuple(np.shape(leaf))} {np.asarray(leaf).dtype if dtype is None else dtype}"


def global_batch(local_batch: Any, sharding: Sharding, timeout_s: float | None = None) -> Any:
    """``jax.make_array_from_process_local_data`` after checking every process's shapes match.

    Raises:
      DistributedError: processes brought different local shapes, dtypes or structure
        (each leaf and process named), or one never arrived.
    """
    n = jax.process_count()
    failures = _differences("shard_batch", local_batch, shape_dtype, timeout_s) if n > 1 else []
    if failures:
        raise DistributedError(
            join_failures(
                "`shard_batch`: every process must bring the same local shape and dtype "
                "for every leaf (JAX would silently build a wrong global array). "
                f"{len(failures)} leaf/leaves differ:",
                failures,
            )
            + "\nFix: give every process the same local batch size and dtypes (drop or pad "
            "the remainder, e.g. pad and carry a validity mask)."
        )
    return jax.make_array_from_process_local_data(sharding, local_batch)


def leaf_checksum(leaf: Any) -> str:
    """``'shape dtype sha256[:16]'`` of a leaf's value (spread over processes: ``global``)."""
    value = jax.random.key_data(leaf) if is_prng_key(leaf) else leaf
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if not value.is_fully_replicated:
            return f"{shape_dtype(leaf)} global"  # one value spread over processes
        value = value.addressable_data(0)
    value = np.asarray(jax.device_get(value))
    digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
    return f"{shape_dtype(leaf)} {digest}"


def assert_same_across_processes(tree: Any, *, timeout_s: float | None = None) -> None:
    """Check every process holds the same values (params, step counters, ...).

    Only a checksum per leaf crosses the network; arrays sharded across processes compare
    by shape and dtype. Off after ``chex.disable_asserts()``.

    Raises:
      PlacementAssertionError: values differ; lists every leaf with the processes holding
        each distinct value.
      DistributedError: a process never arrived; names it.

    Example:
      >>> import jaxdev
      >>> jaxdev.distributed.assert_same_across_processes({"step": np.int32(3)})  # one process
    """
    if jax.process_count() == 1 or asserts_disabled():
        return
    if failures := _differences("assert_same_across_processes", tree, leaf_checksum, timeout_s):
        raise PlacementAssertionError(
            join_failures(
                "`assert_same_across_processes` failed: every process must hold the same values; "
                f"{len(failures)} leaf/leaves differ (shape dtype sha256):",
                failures,
            )
            + "\nFix: replicate from one source (e.g. broadcast process 0's values) and make "
            "every update deterministic and identical on all processes."
        )
