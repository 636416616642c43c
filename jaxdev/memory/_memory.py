"""What is using device memory, by pytree path: a live ledger of every array.

:func:`ledger` walks ``jax.live_arrays()`` once, counts every device buffer once, and
attributes the arrays reached from the named trees to their key path and category; the
rest is unattributed, largest first (old states never freed show up there). Where the
backend reports them, the allocator's bytes in use, peak and limit stand beside.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._asserts import HOST_KINDS
from .._devices import memory_stats
from .._errors import UsageError, device_name
from .._leaves import device_key, is_jax_array, is_prng_key
from .._report import figure, human_bytes, text_table
from .._rules import has_state_fields

CATEGORIES = ("params", "opt_state", "model_state", "batch", "other", "unattributed")
_LABELS = {
    "params": ("params", "tab:blue"),
    "opt_state": ("optimizer state", "tab:orange"),
    "model_state": ("model state", "tab:green"),
    "batch": ("batch", "tab:purple"),
    "other": ("other named trees", "tab:gray"),
    "unattributed": ("unattributed", "tab:red"),
    "free": ("free (up to the limit)", "whitesmoke"),
}


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One live array: where it is named, what it is, and its bytes on each device.

    Attributes:
      path: ``'state.params['Dense_0']['kernel']'``, or ``'<unattributed>'``.
      category: ``params``, ``opt_state``, ``model_state``, ``batch``, ``other`` or
        ``unattributed``.
      shape: the global shape (a typed PRNG key's as the user sees it).
      dtype: the dtype's name (an unattributed typed key shows its ``uint32`` data).
      bytes_per_device: ``{device: bytes}`` of its shards.
      like: for an unattributed array, a named leaf of its shape and dtype (``' (or 2
        others of that shape)'``): maybe an old copy of it; else None.
    """

    path: str
    category: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_device: Mapping[jax.Device, int]
    like: str | None = None

    @property
    def total(self) -> int:
        """Bytes over every device (replicas counted on each device)."""
        return sum(self.bytes_per_device.values())

    @property
    def fullest(self) -> int:
        """Bytes on the device holding the most of it (what ``print(ledger)`` shows)."""
        return max(self.bytes_per_device.values())


def check_bytes(limit: Any, arg: str) -> int:
    """``limit`` as whole bytes per device (``0.9 * 2**30`` floored): the one check of a
    budget's number."""
    number = isinstance(limit, (int, float, np.integer, np.floating)) and type(limit) is not bool
    if not (number and math.isfinite(limit) and limit >= 1):
        raise UsageError(
            f"`{arg}` must be a number of bytes per device, finite and >= 1 (e.g. 16 * 2**30), "
            f"or None for the devices' own limit, got {limit!r}."
        )
    return int(limit)


@dataclasses.dataclass(frozen=True)
class MemoryLedger:
    """Every live array's bytes per device, attributed to named pytree paths.

    Attributes:
      entries: the attributed arrays, largest first.
      unattributed: the other live arrays, largest first.
      per_device: ``{device: bytes}`` of every live array's shards, each buffer once.
      device_stats: ``{device: memory_stats() or None}`` as the backend reports them.
      host_per_device: ``{device: bytes}`` in the device's host memory (offloaded state).
      offloaded: the arrays in host memory, largest first.
    """

    entries: tuple[LedgerEntry, ...]
    unattributed: tuple[LedgerEntry, ...]
    per_device: Mapping[jax.Device, int]
    device_stats: Mapping[jax.Device, Any]
    host_per_device: Mapping[jax.Device, int] = dataclasses.field(default_factory=dict)
    offloaded: tuple[LedgerEntry, ...] = ()

    @property
    def attributed(self) -> float:
        """The share of live bytes attributed to a named tree (1.0 when nothing is live)."""
        total = sum(self.per_device.values())
        named = sum(e.total for e in self.entries)
        return 1.0 if total == 0 else named / total

    def by_category(self) -> dict[jax.Device, dict[str, int]]:
        """``{device: {category: bytes}}`` over every live array."""
        out = {d: dict.fromkeys(CATEGORIES, 0) for d in self.per_device}
        for e in self.entries + self.unattributed:
            for d, n in e.bytes_per_device.items():
                out.setdefault(d, dict.fromkeys(CATEGORIES, 0))[e.category] += n
        return out

    def __str__(self) -> str:
        return _format(self)

    def plot(self, path: str, limit: int | None = None) -> str:
        """Draw the ledger as a stacked bar chart per device into ``path``; return the path.

        Parts from the bottom: each category, then the free bytes up to ``limit`` (or the
        device's ``bytes_limit``). The format follows the suffix (none: ``.png``). Needs
        matplotlib (``jaxdev[plot]``); pyplot's state is left alone.

        Raises:
          UsageError: matplotlib is not installed, ``path``'s folder does not exist, or
            ``limit`` is not a finite number of bytes >= 1.

        Example:
          >>> import pathlib, tempfile, jax.numpy as jnp, jaxdev
          >>> ledger = jaxdev.memory.ledger(params={"w": jnp.ones((256, 256))})
          >>> path = ledger.plot(str(pathlib.Path(tempfile.mkdtemp()) / "memory.png"))
          >>> pathlib.Path(path).read_bytes()[:4] == b"\\x89PNG"
          True
        """
        cats, devices = self.by_category(), list(self.per_device)
        fig, path = figure(path, figsize=(max(6.0, 2 + 0.6 * len(devices)), 4.5))
        if limit is not None:
            limit = check_bytes(limit, "limit")
        parts = {c: [cats[d][c] for d in devices] for c in CATEGORIES}
        limits = [limit or (self.device_stats.get(d) or {}).get("bytes_limit") for d in devices]
        if any(limits):
            parts["free"] = [
                max((m or 0) - sum(cats[d].values()), 0) for d, m in zip(devices, limits)
            ]
        unit = human_bytes(max([sum(col) for col in zip(*parts.values())] + [1])).split()[1]
        scale = 1024 ** ("B", "KiB", "MiB", "GiB").index(unit)
        ax, x, bottom = fig.subplots(), np.arange(len(devices)), np.zeros(len(devices))
        for c, values in parts.items():
            if any(values):
                label, color = _LABELS[c]
                ax.bar(x, np.array(values) / scale, 0.6, bottom, label=label, color=color, ec="k")
                bottom += np.array(values) / scale
        ax.set_xticks(x, [device_name(d) for d in devices], rotation=90 if len(x) > 16 else 0)
        ax.set(xlabel="device", ylabel=f"bytes per device ({unit})")
        ax.set_title(f"live device memory (jaxdev.memory): {self.attributed:.1%} attributed")
        handles, labels = ax.get_legend_handles_labels()  # listed top-down, as stacked
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path


def ledger(**trees: Any) -> MemoryLedger:
    """Return the live device memory, per device, attributed to the named trees by key path.

    A train state's fields become params / opt_state / model_state (``step``, ``rng``:
    other); a tree named ``batch`` is the batch; other names are other. An array reached
    from two trees counts once, under the first.

    Raises:
      UsageError: a named tree is a tracer (inside ``jit``).

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = {"w": jnp.ones((1024, 256))}
      >>> ledger = jaxdev.memory.ledger(params=params)
      >>> ledger.entries[0].path, ledger.entries[0].total
      ("params['w']", 1048576)
    """
    names, shapes = named_arrays(trees)
    live = [(x, _buffers(x)) for x in jax.live_arrays() if not x.is_deleted()]
    # named arrays first, then multi-device ones: a view or alias of their buffers adds nothing
    live.sort(key=lambda xb: (not any(k in names for k in xb[1]), len(xb[1]) == 1))
    seen: set[tuple[jax.Device, int]] = set()
    like = functools.cache(lambda shape, dtype, s: _like(s, shapes.get((shape, dtype))))
    per_device, host = Counter(), Counter()  # host: offloaded arrays, 0 on the device
    entries, others, offloaded = [], [], []
    for x, keys in live:
        fresh = [d for d, p in keys if (d, p) not in seen or not p]
        seen.update(keys)
        if not fresh:
            continue
        counts = dict.fromkeys(fresh, x.on_device_size_in_bytes() // x.sharding.num_devices)
        in_host = x.sharding.memory_kind in HOST_KINDS
        (host if in_host else per_device).update(counts)
        named = [names[k] for k in keys if k in names]
        if named:
            entry = LedgerEntry(*named[0], counts)
        else:
            shape, dtype = tuple(x.shape), str(x.dtype)
            old = like(shape, dtype, x.sharding)  # one look-up per kind of array
            entry = LedgerEntry("<unattributed>", "unattributed", shape, dtype, counts, old)
        (offloaded if in_host else entries if named else others).append(entry)
    for rows in (entries, others, offloaded):
        rows.sort(key=lambda e: (-e.fullest, -e.total))
    devices = sorted({*per_device, *host}, key=device_key)  # offloaded only: 0
    stats = {d: memory_stats(d) for d in devices}
    per_device = {d: per_device[d] for d in stats}
    host = {d: host[d] for d in stats if d in host}
    return MemoryLedger(tuple(entries), tuple(others), per_device, stats, host, tuple(offloaded))


def named_arrays(trees: Mapping[str, Any]) -> tuple[dict, dict]:
    """``{buffer: (path, category, shape, dtype)}`` of the named trees' arrays, and
    ``{(stored shape, dtype name): [(path, sharding), ...]}`` of their leaves (look-alikes)."""
    names: dict[tuple[jax.Device, int], tuple[str, str, tuple, str]] = {}
    shapes: dict[tuple[tuple[int, ...], str], list] = {}
    for name, tree in trees.items():
        for path, leaf, category in _named_leaves(name, tree):
            if isinstance(leaf, jax.core.Tracer):
                raise UsageError(
                    f"`{name}` leaf {path} is a tracer: call `jaxdev.memory` outside `jit`."
                )
            if getattr(leaf, "ndim", 0) > 0 and hasattr(leaf, "dtype"):
                like = (path, getattr(leaf, "sharding", None))  # numpy leaves have none
                # a typed PRNG key lives as its uint32 data (what JAX lists live)
                stored = jax.eval_shape(jax.random.key_data, leaf) if is_prng_key(leaf) else leaf
                shapes.setdefault((tuple(stored.shape), str(stored.dtype)), []).append(like)
            if is_jax_array(leaf) and not leaf.is_deleted():
                for key in _buffers(leaf):
                    names.setdefault(key, (path, category, tuple(leaf.shape), str(leaf.dtype)))
    return names, shapes


def _like(sharding: Any, leaves: list | None) -> str | None:
    """The named leaf an array on ``sharding`` may be an old copy of: device arrays on it first."""
    if not leaves:
        return None
    path, _ = min(leaves, key=lambda pl: (pl[1] is None, pl[1] != sharding))
    more = len(leaves) - 1
    return f"{path} (or {more} other{'s' * (more > 1)} of that shape)" if more else path


def _named_leaves(name: str, tree: Any):
    """``(path, leaf, category)`` of every leaf of a named tree (a train state's by field)."""
    state = has_state_fields(tree)  # a registered dataclass too: params, opt_state, model_state
    own = CATEGORIES[:3] if state else ("params", "batch")  # a tree named so: that category
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        part = getattr(keys[0], "name", None) if state and keys else name
        yield f"{name}{jax.tree_util.keystr(keys)}", leaf, part if part in own else "other"


def _buffers(x: jax.Array) -> list[tuple[jax.Device, int]]:
    """``(device, buffer pointer)`` of each addressable shard (a failed array: none)."""
    try:
        x.block_until_ready()
    except jax.errors.JaxRuntimeError:
        return []
    if isinstance(x.sharding, jax.sharding.SingleDeviceSharding):  # no Shard to build
        return [(x.device, x.unsafe_buffer_pointer())]
    return [(s.device, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards]


# ---------------------------------------------------------------- text


def _format(ledger: MemoryLedger, top: int = 12) -> str:
    head = ("device", "live", "attributed", "allocator in use", "peak", "limit")
    cats, body = ledger.by_category(), []
    for d, total in ledger.per_device.items():
        stats = ledger.device_stats.get(d) or {}
        named = human_bytes(total - cats[d]["unattributed"])
        shown = [stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")]
        shown = ["-" if n is None else human_bytes(n) for n in shown]
        body.append((device_name(d), human_bytes(total), named, *shown))
    lines = [f"live device memory: {ledger.attributed:.1%} attributed to named trees"]
    lines += text_table(head, body, rstrip=True)
    most = lambda e: human_bytes(e.fullest)  # noqa: E731
    rows = [(e.path, e.category, str(e.shape), e.dtype, most(e)) for e in ledger.entries]
    head = ("path", "category", "shape", "dtype", "bytes")
    lines += _largest("largest arrays (bytes on the device holding the most):", head, rows, top)
    old = lambda e: f"looks like an old copy of {e.like}" if e.like else ""  # noqa: E731
    rows = [(str(e.shape), e.dtype, most(e), _where(e), old(e)) for e in ledger.unattributed]
    title = f"unattributed arrays (the other {1 - ledger.attributed:.1%} of live bytes), largest"
    lines += _largest(title + " first:", ("shape", "dtype", "bytes", "device", "note"), rows, top)
    if ledger.host_per_device:
        n, fullest = len(ledger.offloaded), max(ledger.host_per_device.values())
        lines.append(
            f"in host memory (offloaded, 0 on the devices): {n} array{'s' if n > 1 else ''}, "
            f"{human_bytes(fullest)} on the fullest device's host memory"
        )
    return "\n".join(lines)


def _largest(title: str, head: tuple[str, ...], rows: list[tuple], top: int) -> list[str]:
    """``title``, then a table of the first ``top`` rows and how many were left out."""
    if not rows:
        return []
    left = len(rows) - top
    more = [f"... and {left} smaller array{'s' if left > 1 else ''}"] if left > 0 else []
    return [title, *text_table(head, rows[:top], rstrip=True), *more]


def _where(e: LedgerEntry) -> str:
    """``cpu:3`` for an array on one device, ``8 devices`` for one on several."""
    devices = list(e.bytes_per_device)
    return device_name(devices[0]) if len(devices) == 1 else f"{len(devices)} devices"
