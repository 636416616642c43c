"""Where jaxdev tells the active step meters what its steps and the host did.

With no meter on, a step pays two truth tests of :data:`listeners` per call, a prefetcher's
``next`` one; with one on, two clock reads and an append. A meter (``jaxdev.meter``) adds
itself to :data:`listeners` while it is on.
"""

from __future__ import annotations

import time
from typing import Any

listeners: list[Any] = []  # the active meters: ``times`` (an ``array("d")`` of each call's start
# and end), ``step``, ``key``, ``switch(step, key, compiled)``, ``newest``, ``on_host(label,
# start, end, where)`` and ``on_mark(label, when)``


def start() -> float:
    """The time a step call starts, or ``0.0`` when no meter listens (nothing to time)."""
    return time.perf_counter() if listeners else 0.0


def dispatched(step: Any, key: tuple, start: float, compiled: bool, token: Any) -> None:
    """Tell each meter: ``step``'s program ``key`` was dispatched from ``start`` until now
    (``compiled``: this call traced and compiled it); ``token`` is an output to wait on."""
    end = time.perf_counter()
    for meter in listeners:  # a meter leaves (and the list changes) outside a step call
        times = meter.times  # C doubles: no object a garbage collection would walk
        times.extend((start, end))
        if compiled or key is not meter.key or step is not meter.step:  # a new program run
            meter.switch(step, key, compiled)
        meter.newest = (len(times) >> 1, token)  # one output, the newest only: kept ones cost


def host(label: str, start: float, where: str = "") -> None:
    """Tell each meter: the host spent ``start`` until now in ``label`` (``"input"``,
    ``"sync"``, ``"compile"``), at ``where`` (``file:line``, for syncs)."""
    end = time.perf_counter()
    for meter in list(listeners):
        meter.on_host(label, start, end, where)


def mark(label: str) -> None:
    """Tell each meter: the host starts ``label`` (``"checkpoint"``), until its next step
    call or input wait."""
    now = time.perf_counter()
    for meter in list(listeners):
        meter.on_mark(label, now)
