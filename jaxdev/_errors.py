"""Exception types and message helpers shared by every jaxdev module.

Each error subclasses the built-in a user would catch and :class:`JaxdevError`; messages
state the rule, the value that broke it, and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax


class JaxdevError(Exception):
    """Base class of every error raised by jaxdev."""


class DeviceNotFoundError(JaxdevError, LookupError):
    """A requested device or platform does not exist on this host."""


class LeafTypeError(JaxdevError, TypeError):
    """A pytree leaf has a type jaxdev cannot place (str, object, ...)."""


class LeafValueError(JaxdevError, ValueError):
    """A pytree leaf holds a value that cannot be placed without loss."""


class DeletedArrayError(JaxdevError, ValueError):
    """A pytree leaf was deleted or donated and can no longer be read."""


class PlacementError(JaxdevError, ValueError):
    """A placement request is inconsistent (mixed devices, Device in jit, ...)."""


class ShardingError(JaxdevError, ValueError):
    """A batch or tree cannot be sharded, replicated or gathered as asked."""


class BackendStartedError(JaxdevError, RuntimeError):
    """JAX's backend already started, so a start-up setting can't change."""


class DistributedError(JaxdevError, RuntimeError):
    """A multi-process run failed a check or lost a peer."""


class MemoryPlanError(JaxdevError, MemoryError):
    """A state or step would not fit in device memory (raised before allocating).

    ``explanation``: the :class:`jaxdev.memory.MemoryExplanation` behind it, or ``None``.
    """

    explanation: Any = None


class OutOfMemoryError(MemoryPlanError):
    """A device ran out of memory (``RESOURCE_EXHAUSTED``) in a jaxdev call, explained.

    The message names what the call needed, what was live by pytree path, the limit and, for
    a train step, the changes that fit; XLA's error is the ``__cause__``.
    """


class CheckpointError(JaxdevError, RuntimeError):
    """A checkpoint cannot be written, found, read, or restored onto the target asked."""


class PlacementAssertionError(JaxdevError, AssertionError):
    """A placement assertion failed; the message lists every failing leaf."""


class DisagreementError(JaxdevError, AssertionError):
    """Two strategies trained the same model to different results (``assert_strategies_agree``)."""


class MetricError(JaxdevError, ValueError):
    """A metric got a value, mask or partner of the wrong shape, dtype or kind."""


class GuardError(JaxdevError, AssertionError):
    """A guarded block made more host syncs, transfers or compiles than allowed."""


class UsageError(JaxdevError, ValueError):
    """An argument of a function or command is invalid (the CLI exits with code 2)."""


def format_devices(devices: Iterable[jax.Device]) -> str:
    """Return a short, readable list of devices, e.g. ``'cpu:0, cpu:1'``."""
    devices = list(devices)
    names = [device_name(d) for d in devices[:16]]
    if len(devices) > 16:
        names.append(f"... ({len(devices)} in all)")
    return ", ".join(names) if names else "none"


def device_name(d: jax.Device) -> str:
    """Return the short name of a device, ``'platform:id'`` (``'cpu:3'``, ``'gpu:0'``)."""
    return f"{d.platform}:{d.id}"


def available_devices() -> str:
    """Return the sentence ending every device error: what exists here."""
    try:
        return f"Available devices: [{format_devices(jax.devices())}]."
    except (AssertionError, RuntimeError):  # the backend failed to start
        return "Available devices: [none: JAX could not start a backend]."


def short(x: Any, limit: int = 120) -> str:
    """``repr(x)`` (a string: as is) on one line, cut to ``limit`` characters for messages."""
    text = " ".join((x if isinstance(x, str) else repr(x)).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def join_failures(header: str, failures: list[str]) -> str:
    """Join a header and one indented line per failing leaf."""
    return header + "\n" + "\n".join(f"  {line}" for line in failures)


class DeviceSpecError(UsageError):
    """A device spec (string, int, object) is malformed."""


class GuardArgumentError(UsageError):
    """A guard was given an invalid budget."""
