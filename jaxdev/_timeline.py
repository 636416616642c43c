"""Where jaxdev's steps tell the active step meters what they dispatched.

With no meter on, a step pays two truth tests of :data:`listeners` per call. A meter
(``jaxdev.meter``) adds itself to :data:`listeners` while it is on.
"""

from __future__ import annotations

import time
from typing import Any

listeners: list[Any] = []  # the active meters: each has ``on_step(step, key, start, end, token)``


def start() -> float:
    """The time a step call starts, or ``0.0`` when no meter listens (nothing to time)."""
    return time.perf_counter() if listeners else 0.0


def dispatched(step: Any, key: tuple, start: float, compiled: bool, token: Any) -> None:
    """Tell each meter: ``step``'s program ``key`` was dispatched from ``start`` until now
    (``compiled``: this call traced and compiled it); ``token`` is an output to wait on."""
    end = time.perf_counter()
    for meter in list(listeners):
        meter.on_step(step, key, start, end, compiled, token)
