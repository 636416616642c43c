"""Where jaxdev tells the active step meters what its steps and the host did.

With no meter on, a step pays two truth tests of :data:`listeners` per call, a prefetcher's
``next`` one; with meters on, a thread id, two clock reads, a readiness check and appends to
two arrays they share. A meter (``jaxdev.meter``) listens (:func:`listen`) while it is on, in
one thread.
"""

from __future__ import annotations

import functools
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

listeners: list[Any] = []  # the active meters: ``on_host(label, start, end, where, waited)``
times = array("d")  # each metered step call's start and end: no object the GC would walk
done = array("b")  # each call's: 1 when it returned its step done (XLA:CPU runs some inline)
runs: list[tuple] = []  # (first call, step, key, compiled) of each program run in ``times``
newest: tuple = (0, None)  # (calls in ``times``, an output of the last): kept outputs cost
_run: tuple = (None, None)  # the step and program key of the last run
_thread: int | None = None  # the meters' loop thread: another thread's steps are not theirs
ended: tuple = (0, 0.0)  # (call, when): the last call a meter saw end (the others take it)
dispatch = threading.Event()  # set by a step call while the meters' watcher is ``waiting``
waiting = False
_KEEP = 1 << 21  # doubles kept when no meter listens (16 MiB): a new meter then starts afresh


def start() -> float:
    """The time a step call starts, or ``0.0`` when no meter listens (nothing to time)."""
    return time.perf_counter() if listeners else 0.0


def dispatched(step: Any, key: tuple, start: float, compiled: bool, token: Any) -> None:
    """Record for the meters: ``step``'s program ``key`` was dispatched from ``start`` until
    now (``compiled``: this call traced and compiled it); ``token`` is an output to wait on."""
    global newest, _run, waiting
    if threading.get_ident() != _thread:
        return
    times.extend((start, time.perf_counter()))
    done.append(token.is_ready())
    if compiled or key is not _run[1] or step is not _run[0]:  # a new program run
        _run = (step, key)
        runs.append((len(times) // 2 - 1, step, key, compiled))
    newest = (len(times) >> 1, token)
    if waiting:  # once a wait
        waiting = False
        dispatch.set()


def listen(meter: Any) -> int:
    """Add ``meter`` (of the thread calling); return the index its first step call will have
    in :data:`times`."""
    global _run, newest, _thread, ended
    if not listeners and len(times) > _KEEP:
        del times[:], runs[:], done[:]
        newest, ended = (0, None), (0, 0.0)  # their counts indexed the cleared record
    listeners.append(meter)
    _run, _thread = (None, None), threading.get_ident()  # its first call starts a run
    return len(times) // 2


def leave(meter: Any) -> None:
    """Remove ``meter``; when none listens, the newest output and the runs' steps are let go
    (each meter kept its own record as it left)."""
    global newest, _run
    listeners.remove(meter)
    if not listeners:
        newest, _run = (newest[0], None), (None, None)
        del runs[:]


def host(label: str, start: float, where: str = "", waited: bool = False) -> None:
    """Tell each meter: the host spent ``start`` until now in ``label`` (``"input"``,
    ``"sync"``, ``"compile"``), at ``where`` (``file:line``, for syncs); ``waited``: a sync
    that began while the newest step ran (:func:`running`)."""
    end = time.perf_counter()
    for meter in list(listeners):
        meter.on_host(label, start, end, where, waited)


def running() -> bool:
    """Whether the newest metered step is still running (a sync beginning now waits for it)."""
    token = newest[1]
    return token is not None and not token.is_deleted() and not token.is_ready()


def span(label: str) -> Callable:
    """Decorate a function: while meters listen, each call's time is told them as the host's
    ``label`` (``"checkpoint"``: a save)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter() if listeners else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                if start:
                    host(label, start)

        return timed

    return wrap
