"""Count host syncs, host<->device transfers and compiles inside a block.

``jax.transfer_guard`` does not see device-to-host reads on CPU (a CPU
array is read through the buffer protocol), so this module counts them
itself, on every backend, by wrapping the Python entry points that read a
device array on the host while a counter is active:

* ``jax.Array`` methods: ``float()``, ``int()``, ``bool()``, ``complex()``,
  ``operator.index``, ``.item()``, ``.tolist()``, ``.tobytes()``,
  ``__array__``, ``format()``, ``repr()``, ``str()``, pickling,
  ``.copy_to_host_async()`` and, as a catch-all, the internal ``_value``;
* ``jax.device_get`` (one event per call, however many leaves);
* ``np.asarray``, ``np.array``, ``np.asanyarray``, ``np.ascontiguousarray``
  called on a ``jax.Array`` (or a list/tuple holding one).

Host-to-device: explicit ``jax.device_put`` of host data (numpy arrays,
Python numbers) is wrapped; implicit transfers (a numpy array or Python
scalar passed to a jitted function or a ``jnp`` operation) are seen through
``jax.transfer_guard_host_to_device("log")``, whose C++ log lines on stderr
are captured at the file-descriptor level and counted.

Compiles and traces are counted with ``jax.monitoring`` listeners on
``/jax/core/compile/backend_compile_duration`` and
``/jax/core/compile/jaxpr_trace_duration``.

One event is counted per outermost call: ``float(x)`` reads ``x._value``
inside, ``jax.device_get(tree)`` reads every leaf inside; each counts once.
A read counts even when JAX had already cached the value on the host, since
the code pattern is what costs on an accelerator.

Blind spots: numpy functions other than the four above (``np.sum(x)``,
``memoryview(x)``), references taken before the block
(``from jax import device_get``; ``from numpy import asarray``), DLPack,
and implicit host-to-device transfers when the C++ log is silenced
(``TF_CPP_MIN_LOG_LEVEL`` >= 2) or a stricter ``transfer_guard`` is already
set (then JAX itself raises on them). The wrappers are process-wide: other
threads' reads count too; implicit transfers count on the entering thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ._errors import JaxdevError

__all__ = [
    "GuardArgumentError",
    "GuardError",
    "TransferCounter",
    "TransferEvent",
    "count_transfers",
    "no_host_sync",
]

D2H = "device_to_host"
H2D = "host_to_device"
COMPILE = "compile"
TRACE = "trace"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_MAX_EVENTS = 1000  # events kept per counter; the counts are always exact


class GuardError(JaxdevError, AssertionError):
    """A guarded block made more host syncs, transfers or compiles than allowed."""


class GuardArgumentError(JaxdevError, ValueError):
    """A guard was given an invalid budget."""


@dataclasses.dataclass(frozen=True)
class TransferEvent:
    """One counted event.

    Attributes:
      direction: ``"device_to_host"``, ``"host_to_device"``, ``"compile"`` or
        ``"trace"``.
      kind: what did it, e.g. ``"float()"``, ``"jax.device_get"``,
        ``"implicit float32[3]"`` (the shape when JAX's log names it),
        ``"jit(step)"``.
      where: ``file:line (function)`` of the first caller outside jax, numpy
        and this module; empty when unknown (implicit transfers, compiles).
    """

    direction: str
    kind: str
    where: str = ""


class TransferCounter:
    """Counts read after (or during) a :func:`count_transfers` block.

    Attributes:
      events: the first 1000 events, in order.
    """

    def __init__(self, implicit: bool = True):
        self.events: list[TransferEvent] = []
        self._counts: Counter[str] = Counter()
        self._implicit = implicit

    def _add(self, event: TransferEvent, n: int = 1) -> None:
        self._counts[event.direction] += n
        room = _MAX_EVENTS - len(self.events)
        self.events.extend([event] * min(n, max(room, 0)))

    @property
    def device_to_host(self) -> int:
        """Device-to-host reads (syncs) counted so far."""
        return self._counts[D2H]

    @property
    def host_to_device(self) -> int:
        """Host-to-device transfers (explicit and implicit) counted so far."""
        _drain_implicit()
        return self._counts[H2D]

    @property
    def compiles(self) -> int:
        """XLA compilations counted so far (jit, pmap and eager ops)."""
        return self._counts[COMPILE]

    @property
    def traces(self) -> int:
        """Python traces (jaxpr tracing of a function) counted so far."""
        return self._counts[TRACE]

    def summary(self) -> str:
        """Return one line of counts plus one line per distinct event."""
        head = (
            f"{self.device_to_host} device-to-host, {self.host_to_device} host-to-device, "
            f"{self.compiles} compiles, {self.traces} traces"
        )
        return "\n".join([head] + [f"  {line}" for line in _describe(self.events)])

    def __repr__(self) -> str:
        return (
            f"TransferCounter(device_to_host={self.device_to_host}, "
            f"host_to_device={self.host_to_device}, compiles={self.compiles}, "
            f"traces={self.traces})"
        )


def _describe(events: list[TransferEvent], direction: str | None = None) -> list[str]:
    """Return ``direction: kind at where (xN)`` lines, grouped, first seen first."""
    groups = Counter(
        (e.direction, e.kind, e.where) for e in events if direction in (None, e.direction)
    )
    return [
        f"{d}: {k}" + (f" at {w}" if w else "") + (f" (x{n})" if n > 1 else "")
        for (d, k, w), n in groups.items()
    ]


# ------------------------------------------------------------ global state

_lock = threading.RLock()
_active: list[TransferCounter] = []
_undo: list[Callable[[], None]] = []
_tls = threading.local()
_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(_HERE) + os.sep
_SKIP = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, np))


def _emit(direction: str, kind: str, where: str = "", n: int = 1) -> None:
    """Add an event to every active counter."""
    event = TransferEvent(direction, kind, where)
    with _lock:
        for counter in _active:
            if direction != H2D or not kind.startswith("implicit") or counter._implicit:
                counter._add(event, n)


def _call_site() -> str:
    """Return ``file:line (function)`` of the first caller outside jax/numpy.

    When that caller is inside jaxdev, the first frame outside jaxdev is
    named too: ``train.py:12 (main) via _metrics.py:740 (fetch_metrics)``.
    """
    frame, inner = sys._getframe(2), ""
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _HERE and not name.startswith(_SKIP) and "jaxlib" not in name:
            site = f"{os.path.basename(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
            if not name.startswith(_PACKAGE):
                return f"{site} via {inner}" if inner else site
            inner = inner or site
        frame = frame.f_back
    return inner


@contextlib.contextmanager
def _outermost(direction: str) -> Iterator[bool]:
    """Yield True only for the outermost intercepted call in this thread."""
    depth = getattr(_tls, direction, 0)
    setattr(_tls, direction, depth + 1)
    try:
        yield depth == 0
    finally:
        setattr(_tls, direction, depth)


def _counted(fn: Callable, direction: str, kind: str, when: Callable[..., bool]) -> Callable:
    """Wrap ``fn`` so each outermost call with ``when(*args)`` true is counted."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _outermost(direction) as outer:
            if outer and _active and when(*args, **kwargs):
                _emit(direction, kind, _call_site())
            return fn(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------- patches

_ARRAY_METHODS = {
    "__float__": "float()",
    "__int__": "int()",
    "__complex__": "complex()",
    "__bool__": "bool()",
    "__index__": "operator.index()",
    "item": ".item()",
    "tolist": ".tolist()",
    "tobytes": ".tobytes()",
    "__array__": "__array__",
    "__format__": "format()",
    "__repr__": "repr()",
    "__str__": "str()",
    "__reduce__": "pickle",
    "copy_to_host_async": ".copy_to_host_async()",
}
_NUMPY_FUNCTIONS = ("asarray", "array", "asanyarray", "ascontiguousarray")


@functools.cache
def _array_type() -> type:
    """The concrete class of device arrays (imported lazily, once)."""
    from jax._src.array import ArrayImpl

    return ArrayImpl


def _always(*args, **kwargs) -> bool:
    return True


def _holds_device_array(x: Any = None, *args, **kwargs) -> bool:
    """True when ``x`` is a jax array or a list/tuple holding one."""
    array = _array_type()
    if isinstance(x, (list, tuple)):
        return any(isinstance(y, array) for y in x)
    return isinstance(x, array)


def _tree_has_device_array(x: Any = None, *args, **kwargs) -> bool:
    array = _array_type()
    return any(isinstance(y, array) for y in jax.tree_util.tree_leaves(x))


def _tree_has_host_data(x: Any = None, *args, **kwargs) -> bool:
    array = _array_type()
    return any(not isinstance(y, array) for y in jax.tree_util.tree_leaves(x))


def _set(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name = value`` and remember how to undo it."""
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    _undo.append(lambda: setattr(owner, name, old))


def _install() -> None:
    """Wrap every entry point listed in the module docstring."""
    from jax._src import api

    array = _array_type()
    for name, kind in _ARRAY_METHODS.items():
        if name in array.__dict__:
            _set(array, name, _counted(array.__dict__[name], D2H, kind, _always))
    value = array.__dict__["_value"]
    _set(array, "_value", property(_counted(value.fget, D2H, "host read (_value)", _always)))
    get = _counted(api.device_get, D2H, "jax.device_get", _tree_has_device_array)
    put = _counted(api.device_put, H2D, "jax.device_put", _tree_has_host_data)
    for owner in (jax, api):
        _set(owner, "device_get", get)
        _set(owner, "device_put", put)
    for name in _NUMPY_FUNCTIONS:
        _set(np, name, _counted(getattr(np, name), D2H, f"np.{name}", _holds_device_array))
    jax.monitoring.register_event_duration_secs_listener(_on_compile_event)
    _undo.append(lambda: jax.monitoring.unregister_event_duration_listener(_on_compile_event))


def _uninstall() -> None:
    """Undo every patch, newest first."""
    while _undo:
        _undo.pop()()


def _on_compile_event(event: str, duration: float, **kwargs: Any) -> None:
    if event == _COMPILE_EVENT:
        _emit(COMPILE, str(kwargs.get("fun_name", "?")))
    elif event == _TRACE_EVENT:
        _emit(TRACE, str(kwargs.get("fun_name", "?")))


# ------------------------------------------ implicit host-to-device (stderr)

_IMPLICIT_LINE = re.compile(rb"host-to-device transfer:(?: aval=(?:ShapedArray\()?([^,)\s]*))?")


class _StderrTap:
    """Capture fd 2 to count JAX's transfer-guard log lines; pass others on."""

    def __init__(self) -> None:
        self.users = 0
        self.saved: int | None = None
        self.file: Any = None
        self.pos = 0

    def start(self) -> None:
        if self.users == 0:
            sys.stderr.flush()
            self.file = tempfile.TemporaryFile()
            self.saved = os.dup(2)
            os.dup2(self.file.fileno(), 2)
            self.pos = 0
        self.users += 1

    def drain(self) -> list[str]:
        """Return one kind per new transfer line; forward every other line."""
        if self.users == 0:
            return []
        sys.stderr.flush()
        chunks = []
        while chunk := os.pread(self.file.fileno(), 1 << 16, self.pos):
            chunks.append(chunk)
            self.pos += len(chunk)
        kinds, other = [], []
        for line in b"".join(chunks).splitlines(keepends=True):
            found = _IMPLICIT_LINE.search(line)
            if found:
                aval = (found.group(1) or b"").decode(errors="replace")
                kinds.append(f"implicit {aval}".strip())
            else:
                other.append(line)
        if other:
            os.write(self.saved, b"".join(other))
        return kinds

    def stop(self) -> list[str]:
        kinds = self.drain()
        self.users -= 1
        if self.users == 0:
            sys.stderr.flush()
            os.dup2(self.saved, 2)
            os.close(self.saved)
            self.file.close()
            self.saved = self.file = None
        return kinds


_tap = _StderrTap()


def _drain_implicit() -> None:
    """Count the implicit transfers logged since the last drain."""
    with _lock:
        for kind in _tap.drain():
            _emit(H2D, kind)


def _guard_level() -> str | None:
    """The host-to-device transfer-guard level in force on this thread."""
    from jax._src import config

    level = config.transfer_guard_host_to_device.value
    return level if level is not None else config._transfer_guard.value


# ------------------------------------------------------------- public API


@contextlib.contextmanager
def count_transfers(implicit: bool = True) -> Iterator[TransferCounter]:
    """Count device-to-host reads, host-to-device transfers and compiles.

    Every wrapped entry point is restored on exit, also when the block
    raises; blocks nest (an inner block's events also count in the outer).

    Args:
      implicit: also count implicit host-to-device transfers (numpy or Python
        values handed to jitted functions and ``jnp`` ops) by capturing JAX's
        transfer-guard log on stderr for the duration of the block. Other
        stderr output in the block is passed on when the block ends.

    Yields:
      A :class:`TransferCounter`, readable during and after the block.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jaxdev import count_transfers
      >>> x = jnp.arange(3.0)
      >>> with count_transfers() as c:
      ...     total = float(x.sum())
      ...     host = jax.device_get({"a": x, "b": x})
      ...     y = jax.device_put(np.ones(3))
      >>> c.device_to_host, c.host_to_device
      (2, 1)
    """
    counter = TransferCounter(implicit=implicit)
    with contextlib.ExitStack() as stack:
        _activate(counter, stack)
        yield counter


def _activate(counter: TransferCounter, stack: contextlib.ExitStack) -> None:
    """Install the wrappers (first user) and register ``counter``."""
    with _lock:
        _drain_implicit()
        if not _active:
            _install()
        _active.append(counter)
    stack.callback(_deactivate, counter)
    if counter._implicit and _guard_level() in (None, "allow", "log"):
        try:
            _tap.start()
        except OSError:  # no usable fd 2: implicit transfers go uncounted
            return
        stack.callback(_stop_tap)
        stack.enter_context(jax.transfer_guard_host_to_device("log"))


def _stop_tap() -> None:
    with _lock:
        for kind in _tap.stop():
            _emit(H2D, kind)


def _deactivate(counter: TransferCounter) -> None:
    with _lock:
        _drain_implicit()
        _active.remove(counter)
        if not _active:
            _uninstall()


def _check_budget(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise GuardArgumentError(
            f"`no_host_sync` expects `{name}` to be None (no limit) or an int >= 0, got {value!r}."
        )


@contextlib.contextmanager
def no_host_sync(
    max_device_to_host: int | None = 0,
    max_host_to_device: int | None = None,
    max_compiles: int | None = None,
    max_traces: int | None = None,
) -> Iterator[TransferCounter]:
    """Assert a block stays within a budget of syncs, transfers and compiles.

    The block runs to its end; then, if any count is over its budget, a
    :class:`GuardError` lists each exceeded count with its budget and the
    events (kind and call site). If the block itself raises, that exception
    propagates unchanged. Typical use: run the train step once (compiles),
    then guard the loop with ``no_host_sync(max_compiles=0)``.

    Args:
      max_device_to_host: allowed device-to-host reads (``None``: no limit).
      max_host_to_device: allowed host-to-device transfers (``None``: no limit).
      max_compiles: allowed XLA compiles (``None``: no limit).
      max_traces: allowed function traces (``None``: no limit).

    Yields:
      The :class:`TransferCounter` of the block.

    Raises:
      GuardError: a count exceeded its budget.
      GuardArgumentError: a budget is not ``None`` or an int >= 0.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxdev import GuardError, no_host_sync
      >>> step = jax.jit(lambda x: x * 0.5 + 1.0)
      >>> x = step(jnp.ones(4))  # compiles here, outside the guard
      >>> with no_host_sync(max_compiles=0):
      ...     for _ in range(10):
      ...         x = step(x)
      >>> try:
      ...     with no_host_sync():
      ...         loss = float(x[0])
      ... except GuardError as err:
      ...     print(str(err).splitlines()[0])
      1 device-to-host sync in a block that allows 0 (`max_device_to_host=0`):
    """
    budgets = {
        D2H: ("max_device_to_host", max_device_to_host, "device-to-host sync"),
        H2D: ("max_host_to_device", max_host_to_device, "host-to-device transfer"),
        COMPILE: ("max_compiles", max_compiles, "compile"),
        TRACE: ("max_traces", max_traces, "trace"),
    }
    for name, value, _ in budgets.values():
        _check_budget(name, value)
    with count_transfers(implicit=max_host_to_device is not None) as counter:
        yield counter
    counts = {
        D2H: counter.device_to_host,
        H2D: counter.host_to_device,
        COMPILE: counter.compiles,
        TRACE: counter.traces,
    }
    failures = []
    for direction, (name, limit, noun) in budgets.items():
        if limit is not None and counts[direction] > limit:
            n = counts[direction]
            plural = "s" if n != 1 else ""
            failures.append(
                f"{n} {noun}{plural} in a block that allows {limit} (`{name}={limit}`):"
            )
            failures.extend(f"  {line}" for line in _describe(counter.events, direction))
    if failures:
        raise GuardError("\n".join(failures) + "\n" + _HINT)


_HINT = (
    "Keep values on device: merge jaxdev metrics in the step and read them with one "
    "`fetch()` every N steps; pass device arrays (not numpy) to jitted steps; keep "
    "shapes and dtypes fixed so the step compiles once."
)
