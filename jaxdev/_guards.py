"""Count host syncs, waits, host<->device transfers and compiles inside a block.

While a counter is active, the Python entry points that read a device array on the host or
wait for it are wrapped (``jax.transfer_guard`` misses device-to-host reads on CPU), one
event per outermost call; implicit host-to-device transfers are JAX's ``transfer_guard("log")``
lines, read from fd 2 through a relay process (:mod:`jaxdev._stderr_relay`) that passes every
other byte on, even after a crash; compiles and traces come from ``jax.monitoring``. What it
sees and misses: the README's "Design notes".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import site
import subprocess
import sys
import sysconfig
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from . import _stderr_relay, _timeline
from ._errors import GuardArgumentError, GuardError
from ._leaves import array_type, is_concrete

D2H = "device_to_host"
H2D = "host_to_device"
WAIT = "wait"
COMPILE = "compile"
TRACE = "trace"
_MONITORED = {  # jax.monitoring's duration events -> the direction they count as
    "/jax/core/compile/backend_compile_duration": COMPILE,
    "/jax/core/compile/jaxpr_trace_duration": TRACE,
}
_MAX_EVENTS = 1000  # events kept per counter; the counts are always exact


@dataclasses.dataclass(frozen=True)
class TransferEvent:
    """One counted event: ``direction``, ``kind`` (``"float()"``, ``"jit(step)"``...), ``where``.

    Attributes:
      direction: ``"device_to_host"``, ``"host_to_device"``, ``"wait"``, ``"compile"``
        or ``"trace"``.
      kind: what did it, e.g. ``"jax.device_get"``, ``"implicit float32[3]"``.
      where: ``file:line (function)`` of the first caller outside jax, numpy and
        jaxdev; empty when unknown (implicit transfers, compiles).
    """

    direction: str
    kind: str
    where: str = ""


def _tally(direction: str, doc: str) -> property:
    """A read-only count of one direction (``_count`` drains JAX's log first)."""
    return property(lambda self: self._count(direction), doc=doc)


class TransferCounter:
    """Counts read after (or during) a :func:`count_transfers` block; ``events``: the first 1000."""

    def __init__(self, implicit: bool = True):
        self.events: list[TransferEvent] = []
        self._counts: Counter[str] = Counter()
        self._implicit = implicit

    def _add(self, event: TransferEvent) -> None:
        self._counts[event.direction] += 1
        if len(self.events) < _MAX_EVENTS:
            self.events.append(event)

    def _count(self, direction: str) -> int:
        if direction == H2D:
            _drain_implicit()
        return self._counts[direction]

    device_to_host = _tally(D2H, "Device-to-host reads (syncs) counted so far.")
    host_to_device = _tally(H2D, "Host-to-device transfers (explicit and implicit) so far.")
    waits = _tally(WAIT, "Waits for the device (``block_until_ready``) counted so far.")
    compiles = _tally(COMPILE, "XLA compilations counted so far (jit, pmap and eager ops).")
    traces = _tally(TRACE, "Python traces (jaxpr tracing of a function) counted so far.")

    def summary(self) -> str:
        """Return one line of counts plus one line per distinct event."""
        head = (
            f"{self.device_to_host} device-to-host, {self.host_to_device} host-to-device, "
            f"{self.waits} waits, {self.compiles} compiles, {self.traces} traces"
        )
        return "\n".join([head] + [f"  {line}" for line in _describe(self.events)])

    def __repr__(self) -> str:
        names = ("device_to_host", "host_to_device", "waits", "compiles", "traces")
        return f"TransferCounter({', '.join(f'{n}={getattr(self, n)}' for n in names)})"


def _describe(events: list[TransferEvent], direction: str | None = None) -> list[str]:
    """Return ``direction: kind at where (xN)`` lines, grouped, first seen first."""
    groups = Counter(dataclasses.astuple(e) for e in events if direction in (None, e.direction))
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
_JAX = tuple(  # jaxlib: loaded by jax (a dependency of jax's, not declared as jaxdev's)
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, sys.modules["jaxlib"], np)
)
# libraries' code (the standard library, site-packages): a call site is the first frame
# outside them, the user's (a ``logging`` call's ``str()``, orbax's reads), else theirs
_LIBRARIES = (*{
    os.path.abspath(d) + os.sep
    for d in (os.path.dirname(os.__file__), site.getusersitepackages(),
              *getattr(site, "getsitepackages", list)(),
              *(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
}, "<frozen ")


def _emit(direction: str, kind: str, where: str = "") -> None:
    """Add an event to every active counter."""
    event = TransferEvent(direction, kind, where)
    with _lock:
        for counter in _active:
            if direction != H2D or not kind.startswith("implicit") or counter._implicit:
                counter._add(event)


def _call_site() -> str:
    """``file:line (function)`` of the first caller outside jaxdev, jax, numpy and the
    libraries (then jaxdev's first frame, ``via``); with none, the first library's (user code
    installed in site-packages), else jaxdev's own (``python -m jaxdev``)."""
    frame, inner, library = sys._getframe(2), "", ""
    while frame is not None:
        code = frame.f_code
        name, here = code.co_filename, f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        here += f" ({code.co_name})"
        if name.startswith(_PACKAGE):
            inner = inner or (here if name != _HERE else "")
        elif not name.startswith(_JAX) and "__create_fn__" not in code.co_qualname:
            if not name.startswith(_LIBRARIES):  # (a dataclass's own __repr__: "<string>")
                return f"{here} via {inner}" if inner else here
            library = library or ("" if name.startswith("<frozen ") else here)
        frame = frame.f_back
    return f"{library} via {inner}" if library and inner else library or inner


class _outermost:  # noqa: N801 - used as the context manager function it was
    """Mark this thread inside an intercepted call of ``key``: its inner calls count nothing."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key

    def __enter__(self) -> None:
        setattr(_tls, self.key, getattr(_tls, self.key, 0) + 1)

    def __exit__(self, *exc: Any) -> None:
        setattr(_tls, self.key, getattr(_tls, self.key) - 1)


_QUIET, _NULL = _outermost("host"), contextlib.nullcontext()  # reused: the state is per thread
# quiet_wait(x): wait for array ``x`` past every counting wrapper (JAX's own method, whatever
# count_transfers patches later): jaxdev's own look at a ready array (its error), which a
# counter or a step meter must neither count nor pay for.
quiet_wait = array_type().block_until_ready


def not_counted() -> contextlib.AbstractContextManager[Any]:
    """jaxdev's own look at a ready array's status (no transfer, no wait): not counted here."""
    return _QUIET if _active else _NULL


def _counted(fn: Callable, direction: str, kind: str, when: Callable | None = None) -> Callable:
    """Wrap ``fn`` so each outermost call (reads and waits share one depth) with ``when`` counts."""
    key = "host" if direction in (D2H, WAIT) else direction

    def wrapper(*args, **kwargs):
        if getattr(_tls, key, 0):  # an inner call (or not_counted): never counted
            return fn(*args, **kwargs)
        with _outermost(key):  # the outermost call: its inner calls return above
            if _active and (when is None or when(*args, **kwargs)):
                _emit(direction, kind, site := _call_site())
                if _timeline.listeners and key == "host":  # a step meter times the sync
                    waited, start = _timeline.running(), time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        _timeline.host("sync", start, f"{kind} at {site}", waited)
            return fn(*args, **kwargs)

    try:
        functools.update_wrapper(wrapper, fn)
    except TypeError:  # a nanobind method's __qualname__ is None
        wrapper.__wrapped__ = fn
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
_ARRAY_WAITS = {"block_until_ready": ".block_until_ready()"}
_NUMPY_FUNCTIONS = (
    "asarray array asanyarray ascontiguousarray copy concatenate stack vstack hstack".split()
)
_NUMPY_UFUNCS = ("isfinite", "isnan", "isinf")


def _holds_device_array(x: Any = None, *args, **kwargs) -> bool:
    """True when ``x`` is a jax array or a list/tuple holding one."""
    array = array_type()
    if isinstance(x, (list, tuple)):
        return any(isinstance(y, array) for y in x)
    return isinstance(x, array)


def _tree_has_device_array(x: Any = None, *args, **kwargs) -> bool:
    return any(isinstance(y, array_type()) for y in jax.tree_util.tree_leaves(x))


def _tree_has_host_data(x: Any = None, *args, **kwargs) -> bool:
    return not all(map(is_concrete, jax.tree_util.tree_leaves(x)))  # typed keys: on devices


class _CountedUfunc:
    """Stands in for a numpy ufunc: calls on a device array count; attributes pass through."""

    def __init__(self, ufunc: np.ufunc):
        functools.update_wrapper(self, ufunc)  # its __module__: pickles by name, as the ufunc
        self._call = _counted(ufunc, D2H, f"np.{ufunc.__name__}", _holds_device_array)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __reduce__(self) -> str:
        return self.__wrapped__.__name__

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


_WRAPPERS: dict[tuple[int, str], tuple[Any, Any]] = {}  # (owner, name): (original, wrapper)


def _set(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """Set ``owner.name`` to ``wrap`` of it (made once per original) and remember the undo."""
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    made = _WRAPPERS.get((id(owner), name))
    if made is None or made[0] is not old:
        made = _WRAPPERS[id(owner), name] = (old, wrap(old))
    setattr(owner, name, made[1])
    _undo.append(lambda: setattr(owner, name, old))


def _install() -> None:
    """Wrap every entry point listed in the module docstring."""
    # private: no public hook on device_get/device_put; JAX's own modules call
    # `jax._src.api.device_get/put` directly, so wrapping only `jax.device_get` misses them.
    from jax._src import api

    array, counted = array_type(), functools.partial(functools.partial, _counted)
    for direction, methods in ((D2H, _ARRAY_METHODS), (WAIT, _ARRAY_WAITS)):
        for name, kind in methods.items():
            if name in array.__dict__:
                _set(array, name, counted(direction=direction, kind=kind))
    _set(array, "_value", lambda v: property(_counted(v.fget, D2H, "host read (_value)")))
    for owner in (jax, api):
        _set(owner, "device_get", counted(direction=D2H, kind="jax.device_get",
                                          when=_tree_has_device_array))
        _set(owner, "device_put", counted(direction=H2D, kind="jax.device_put",
                                          when=_tree_has_host_data))
        _set(owner, "block_until_ready", counted(direction=WAIT, kind="jax.block_until_ready",
                                                 when=_tree_has_device_array))
    for name in _NUMPY_FUNCTIONS:
        _set(np, name, counted(direction=D2H, kind=f"np.{name}", when=_holds_device_array))
    for name in _NUMPY_UFUNCS:
        _set(np, name, _CountedUfunc)
    jax.monitoring.register_event_duration_secs_listener(_on_compile_event)
    _undo.append(lambda: jax.monitoring.unregister_event_duration_listener(_on_compile_event))


def _on_compile_event(event: str, duration: float, **kwargs: Any) -> None:
    if event in _MONITORED:
        _emit(_MONITORED[event], str(kwargs.get("fun_name", "?")))
        if _timeline.listeners:  # a step meter: the host compiled (or traced) until now
            _timeline.host("compile", time.perf_counter() - duration)


# ------------------------------------------ implicit host-to-device (stderr)


def _flush_stderr() -> None:
    """Push Python's buffered ``sys.stderr`` text to fd 2 (if there is one)."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()


class _StderrTap:
    """Points fd 2 at a relay (a process, else a thread) while a counter reads JAX's
    transfer-guard log, and reads the relay's reports. Used under ``_lock``."""

    def __init__(self) -> None:
        self.users, self.process, self.done = 0, None, True
        self.saved = self.write_fd = -1
        self.reports: Any = None  # the relay's reports, a raw binary file

    def start(self, swallow: bool) -> bool:
        """Route fd 2 through a new relay (first user); ``False`` without a usable fd 2."""
        if self.users == 0:
            _flush_stderr()
            try:
                saved = os.dup(2)
                (read_fd, write_fd), (report_r, report_w) = os.pipe(), os.pipe()
                fds = (read_fd, os.dup(saved), report_w)
            except OSError:  # no usable fd 2: implicit transfers go uncounted
                return False
            with contextlib.suppress(ImportError, AttributeError, OSError):
                import fcntl  # a larger pipe: writers rarely wait for the relay

                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, _stderr_relay.READ_SIZE)
            try:  # its own session: a Ctrl-C in the terminal never reaches it
                self.process = subprocess.Popen(
                    [sys.executable, "-I", "-S", _stderr_relay.__file__, "1" if swallow else "0"],
                    stdin=fds[0],
                    stdout=fds[2],
                    stderr=fds[1],
                    start_new_session=True,
                )
            except (OSError, ValueError):  # e.g. no sys.executable: a thread relays
                self.process = None
                target, args, name = _stderr_relay.relay, (*fds, swallow), "jaxdev-stderr"
            else:  # the reaper: a relay gone early gives fd 2 back (no EPIPE)
                target, args, name = self._reap, (self.process,), "jaxdev-stderr-reaper"
                for fd in fds:
                    os.close(fd)
            threading.Thread(target=target, args=args, name=name, daemon=True).start()
            # unbuffered: a buffered reader's lock, held by a parent's drain, hangs a fork
            self.reports, self.done = os.fdopen(report_r, "rb", buffering=0), False
            self.saved, self.write_fd = saved, write_fd
            os.dup2(write_fd, 2)
        self.users += 1
        return True

    def _reap(self, process: subprocess.Popen) -> None:
        process.wait()
        with _lock:
            if process is self.process and self.users:
                os.dup2(self.saved, 2)

    def drain(self, stop: bool = False) -> list[str]:
        """The kinds of the guard lines logged since the last drain; ``stop`` drops a user,
        and the last one gives fd 2 back and lets the relay end."""
        if not self.users:
            return []
        self.users -= stop
        _flush_stderr()
        if not self.users:
            os.dup2(self.saved, 2)
            os.close(self.saved)
        kinds = []
        if not self.done and not _stderr_relay.write_all(self.write_fd, _stderr_relay.SYNC):
            self.done = True  # the relay is gone; what it passed on is all there is
        while not self.done and (line := self.reports.readline()) != b"S\n":
            self.done = not line.endswith(b"\n")  # the relay ended
            if line.startswith(b"K"):
                kinds.append(f"implicit {line[2:].decode(errors='replace')}".strip())
        if not self.users:  # the relay ends once no child process holds the pipe
            os.close(self.write_fd)
            self.reports.close()
            self.process, self.done = None, True
        return kinds

    def forget(self) -> None:
        """In a forked child: the relay is the parent's; fd 2 stays the parent's pipe; a
        ``_lock`` held by another thread of the parent (a drain) is not held here."""
        global _lock
        _lock = threading.RLock()
        if self.reports is not None:  # the child's copy of the parent's reports (no warning)
            self.reports.close()
        self.users, self.process, self.reports, self.done = 0, None, None, True


_tap = _StderrTap()
os.register_at_fork(after_in_child=_tap.forget)


def _drain_implicit(stop: bool = False) -> None:
    """Count the implicit transfers logged since the last drain (``stop``: and drop a user)."""
    with _lock:
        for kind in _tap.drain(stop):
            _emit(H2D, kind)


# ------------------------------------------------------------- public API


@contextlib.contextmanager
def count_transfers(implicit: bool = True) -> Iterator[TransferCounter]:
    """Count device-to-host reads, waits, host-to-device transfers and compiles.

    Wrapped entry points are restored on exit, also when the block raises; blocks nest.

    Args:
      implicit: also count implicit host-to-device transfers by reading JAX's
        transfer-guard log on stderr (the log lines themselves are left out unless a
        ``"log"`` guard was already on; output before a crash still arrives). ``False``
        leaves fd 2 alone.

    Yields:
      A :class:`TransferCounter`, readable during and after the block.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jaxdev import count_transfers
      >>> x = jnp.arange(3.0)
      >>> with count_transfers() as c:
      ...     total = float(x.sum())
      ...     host = jax.device_get({"a": x, "b": x})
      ...     y = jax.device_put(np.ones(3)).block_until_ready()
      >>> c.device_to_host, c.host_to_device, c.waits
      (2, 1, 1)
    """
    counter = TransferCounter(implicit=implicit)
    with contextlib.ExitStack() as stack:
        with _lock:
            _drain_implicit()
            if not _active:
                _install()
            _active.append(counter)
            stack.callback(_deactivate, counter)
            level = jax.config.jax_transfer_guard_host_to_device  # a context manager's included
            level = level if level is not None else jax.config.jax_transfer_guard
            if implicit and level in (None, "allow", "log") and _tap.start(level != "log"):
                stack.callback(_drain_implicit, stop=True)
                stack.enter_context(jax.transfer_guard_host_to_device("log"))
        yield counter


def _deactivate(counter: TransferCounter) -> None:
    with _lock:
        _drain_implicit()
        _active.remove(counter)
        while not _active and _undo:  # the last counter: undo every patch, newest first
            _undo.pop()()


_BUDGETS = {  # direction: (its no_host_sync parameter, its noun in a GuardError)
    D2H: ("max_device_to_host", "device-to-host sync"),
    H2D: ("max_host_to_device", "host-to-device transfer"),
    WAIT: ("max_waits", "wait"),
    COMPILE: ("max_compiles", "compile"),
    TRACE: ("max_traces", "trace"),
}


@contextlib.contextmanager
def no_host_sync(
    max_device_to_host: int | None = 0,
    max_host_to_device: int | None = None,
    max_compiles: int | None = None,
    max_traces: int | None = None,
    max_waits: int | None = None,
) -> Iterator[TransferCounter]:
    """Assert a block stays within a budget (``max_*``; ``None``: no limit) of syncs and compiles.

    The block runs to its end (its own exception propagates unchanged); then every count over
    its budget is listed with its events. Typical use: run the step once (compiles), then
    guard the loop with ``no_host_sync(max_compiles=0)``.

    Raises:
      GuardError: a count exceeded its budget.
      GuardArgumentError: a budget is not ``None`` or an int >= 0.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxdev import GuardError, no_host_sync
      >>> step = jax.jit(lambda x: x * 0.5 + 1.0)
      >>> x = step(jnp.ones(4))  # compiles here, outside the guard
      >>> with no_host_sync(max_compiles=0, max_waits=1) as c:
      ...     for _ in range(10):
      ...         x = step(x)
      ...     x = x.block_until_ready()
      >>> c.waits
      1
      >>> try:
      ...     with no_host_sync():
      ...         loss = float(x[0])
      ... except GuardError as err:
      ...     print(str(err).splitlines()[0])
      1 device-to-host sync in a block that allows 0 (`max_device_to_host=0`):
    """
    budgets = (max_device_to_host, max_host_to_device, max_waits, max_compiles, max_traces)
    limits = dict(zip(_BUDGETS, budgets))
    for direction, n in limits.items():
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise GuardArgumentError(
                f"`no_host_sync` expects `{_BUDGETS[direction][0]}` to be None (no limit) or an "
                f"int >= 0, got {n!r}."
            )
    with count_transfers(implicit=max_host_to_device is not None) as counter:
        yield counter
    failures = []  # per exceeded count: a head line, then its events
    for direction, limit in limits.items():
        if limit is not None and (n := counter._count(direction)) > limit:
            name, noun = _BUDGETS[direction]
            head = f"{n} {noun}{'s' if n != 1 else ''} in a block that allows {limit}"
            failures.append(f"{head} (`{name}={limit}`):")
            failures += [f"  {line}" for line in _describe(counter.events, direction)]
    if failures:
        raise GuardError("\n".join(failures) + "\n" + _HINT)


_HINT = (
    "Keep values on device: merge jaxdev metrics in the step and read them with one "
    "`fetch()` every N steps; pass device arrays (not numpy) to jitted steps; keep "
    "shapes and dtypes fixed so the step compiles once; let JAX's async dispatch run "
    "instead of waiting with `block_until_ready`."
)
