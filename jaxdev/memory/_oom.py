"""Out-of-memory errors that explain themselves.

:func:`explained_oom` turns XLA's ``RESOURCE_EXHAUSTED`` in jaxdev's allocating
calls into a :class:`jaxdev.OutOfMemoryError` naming what is live by pytree path
(:func:`live_lines`, which the step's explanation uses too) and the device limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from .._errors import OutOfMemoryError, device_name
from .._report import human_bytes, text_table
from ._memory import MemoryLedger, ledger, named_arrays
from ._plan import XLA_OOM, bytes_limit, fsdp_alternative, is_resource_exhausted, plan


def first_line(err: BaseException) -> str:
    """The XLA message's first line: ``RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes.``"""
    text = str(err).strip()
    at = text.find(XLA_OOM)
    return (text[at:] if at >= 0 else text).splitlines()[0][:300]


def live_lines(ledger: MemoryLedger, trees: Mapping[str, Any], top: int = 8) -> list[str]:
    """The "live now" section: the fullest device's largest arrays by path, and likely leaks.

    Unattributed arrays are grouped by shape and dtype; a group shaped like a leaf
    of ``trees`` is marked as an old copy of it (``LedgerEntry.like`` would also
    count the optimizer's look-alikes: "(or 2 others of that shape)").
    """
    if not ledger.per_device:
        return ["live now: no live arrays"]
    device = max(ledger.per_device, key=ledger.per_device.get)  # the fullest
    total = ledger.per_device[device]
    on = lambda e: e.bytes_per_device.get(device, 0)  # noqa: E731
    lines = [
        f"live now on {device_name(device)} (the fullest device; jaxdev.memory): "
        f"{human_bytes(total)}, {ledger.attributed:.1%} of live bytes named"
    ]
    rows = [
        (e.path, _shape(e.shape), e.dtype, human_bytes(on(e)))
        for e in sorted(ledger.entries, key=lambda e: -on(e))[:top]
        if on(e)
    ]
    shapes = named_arrays(trees)[1]  # the leaves an old copy may be of
    groups: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for e in ledger.unattributed:
        if on(e):
            g = groups.setdefault((e.shape, e.dtype), [0, 0])
            g[0], g[1] = g[0] + 1, g[1] + on(e)
    for (shape, dtype), (count, n) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        what = f"{count} unattributed array{'s' if count > 1 else ''}"
        if (shape, dtype) in shapes:
            what += f" shaped like {shapes[shape, dtype][0][0]} (old copies still referenced?)"
        rows.append((what, _shape(shape), dtype, human_bytes(n)))
    if rows:
        lines += [
            "  " + line for line in text_table(("array", "shape", "dtype", "bytes"), rows, True)
        ]
    return lines


def limit_line(devices: Any) -> str:
    """``device limit: 79.2 GiB (bytes_limit of gpu:0)``, or why there is none."""
    devices = list(devices)
    limits = [(n, d) for d in devices if (n := bytes_limit(d)) is not None]
    if not limits:
        platform = next(iter(devices)).platform if devices else "?"
        return f"device limit: not reported by the {platform} backend (memory_stats() has none)"
    n, d = min(limits, key=lambda t: t[0])
    return f"device limit: {human_bytes(n)} (bytes_limit of {device_name(d)})"


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "()"


def live_now(trees: Mapping[str, Any]) -> tuple[MemoryLedger | None, list[str]]:
    """The ledger naming ``trees`` and its "live now" lines; a failure is a line, not raised."""
    try:
        book = ledger(**{k: v for k, v in trees.items() if v is not None})
        return book, live_lines(book, trees)
    except Exception as e:  # never hide the out-of-memory behind a second error
        return None, [f"live now: could not read the ledger ({type(e).__name__}: {e})"]


@contextlib.contextmanager
def explained_oom(
    what: str,
    trees: Callable[[], Mapping[str, Any]] = dict,
    extra: Callable[[], list[str]] = list,
) -> Iterator[None]:
    """In this block, XLA's ``RESOURCE_EXHAUSTED`` becomes an explained :class:`OutOfMemoryError`.

    ``trees() -> {name: tree}`` (named in the ledger) and ``extra() -> [lines]``
    are called only on failure, and dropped if they fail (init_state, init_sharded, restore).
    """
    try:
        yield
    except Exception as err:
        if not is_resource_exhausted(err):
            raise
        head = f"{what} ran out of device memory ({first_line(err)})"
        lines = [head, *_safe(extra, []), *live_now(_safe(trees, {}))[1]]
        raise OutOfMemoryError("\n".join([*lines, limit_line(jax.local_devices())])) from err


def _safe(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:  # explanation only
        return default


def plan_lines(shapes: Any, mesh: Any, rules: Any, options: Mapping[str, Any]) -> list[str]:
    """``["<what> needs X per device (jaxdev.memory.plan); with rules='fsdp' ...: Y"]``."""
    p = plan(shapes, mesh, rules, **options)
    return [f"it needs {human_bytes(p.total)} per device (jaxdev.memory.plan){fsdp_alternative(p)}"]
