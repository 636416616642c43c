"""``jax.distributed`` with preflight checks and bounded, explained failures.

The README's "Multi-host" section tells the whole story: where :func:`initialize` takes
its arguments from, what it checks before and after connecting, and its timeouts.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

from .._devices import backend_started
from .._errors import DistributedError
from .._multihost import barrier
from . import _hang

_log = logging.getLogger("jaxdev")

ENV_COORDINATOR = "JAXDEV_COORDINATOR"
ENV_NUM_PROCESSES = "JAXDEV_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDEV_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXDEV_LOCAL_DEVICES"
ENV_SHUTDOWN_TIMEOUT = "JAXDEV_SHUTDOWN_TIMEOUT"
ENV_JOIN_MARKER = "JAXDEV_JOIN_MARKER"

DEFAULT_SHUTDOWN_TIMEOUT_S = 30
_JAX_GRACE_S = 5  # JAX's own init deadline, after ours, is only a backstop
_FINISH: dict[str, float | bool] = {}  # shutdown timeout; whether the finish check ran


class DistributedConfig(NamedTuple):
    """What :func:`initialize` asked JAX for (``None``: left to auto-detection).

    Example:
      >>> from jaxdev.distributed import DistributedConfig
      >>> DistributedConfig("127.0.0.1:1234", 2, 0, 4, 60, 30).num_processes
      2
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_count: int | None
    init_timeout_s: int
    heartbeat_timeout_s: int
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S
    hang_timeout_s: float | None = None
    hang_action: str = "exit"


def _setting(env: Mapping[str, str], arg: str, value: Any, var: str, low: int, default: Any):
    """An integer setting: the argument, else its variable, else ``default``; both checked."""
    raw = env.get(var) or None
    try:
        from_env = None if raw is None else int(raw)
    except ValueError:
        from_env = low - 1
    if from_env is not None and from_env < low:
        raise DistributedError(
            f"`{var}` must be an integer >= {low}, got {raw!r}. "
            f"Fix: set it correctly or unset it (`jaxdev launch` sets it for you)."
        )
    if value is None:
        return default if from_env is None else from_env
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DistributedError(f"`{arg}` must be an int >= {low}, got {value!r}.")
    return value


# argument, variable, smallest value, default: the integer settings, in DistributedConfig's order
_INTS = (
    ("num_processes", ENV_NUM_PROCESSES, 1, None),
    ("process_id", ENV_PROCESS_ID, 0, None),
    ("local_device_count", ENV_LOCAL_DEVICES, 1, None),
    ("timeout_s", "JAXDEV_INIT_TIMEOUT", 1, 60),
    ("heartbeat_timeout_s", "JAXDEV_HEARTBEAT_TIMEOUT", 1, 30),
    ("shutdown_timeout_s", ENV_SHUTDOWN_TIMEOUT, 1, DEFAULT_SHUTDOWN_TIMEOUT_S),
)
_ARGS = ("coordinator_address", *(a for a, *_ in _INTS), "hang_timeout_s", "hang_action")


def resolve_config(env: Mapping[str, str] | None = None, **given: Any) -> DistributedConfig:
    """Merge :func:`initialize`'s arguments with the ``JAXDEV_*`` environment; arguments win.

    ``env`` defaults to ``os.environ``; ``given`` takes the names in ``_ARGS``.
    """
    env = os.environ if env is None else env
    hang_timeout, hang_action = given.get("hang_timeout_s"), given.get("hang_action")
    cfg = DistributedConfig(
        given.get("coordinator_address") or env.get(ENV_COORDINATOR) or None,
        *(_setting(env, arg, given.get(arg), *rest) for arg, *rest in _INTS),
        _hang.check_timeout(hang_timeout)
        or _hang.check_timeout(env.get(_hang.ENV_HANG_TIMEOUT), f"${_hang.ENV_HANG_TIMEOUT}"),
        _hang.check_action(hang_action)
        if hang_action is not None
        else _hang.check_action(env.get(_hang.ENV_HANG_ACTION), f"${_hang.ENV_HANG_ACTION}"),
    )
    if None not in (n := cfg.num_processes, p := cfg.process_id) and not 0 <= p < n:
        raise DistributedError(
            f"`process_id` must be in [0, {n}) for `num_processes`={n}, got {p}. "
            "Fix: number processes 0..N-1, once each."
        )
    return cfg


def split_address(address: str) -> tuple[str, int]:
    """Split ``'host:port'`` (or ``'[v6]:port'``) into host and port, or raise DistributedError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"`coordinator_address` must look like 'host:port', got {address!r}. "
            "Fix: e.g. '10.0.0.1:1234' (the address of process 0)."
        )
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float, process_id: int | None = None) -> float:
    """Retry a TCP connect to ``address`` for ``timeout_s``; return the seconds it took."""
    host, port = split_address(address)
    start = time.monotonic()
    deadline, last = start + timeout_s, "no attempt"
    while True:
        try:
            wait = max(0.05, min(1.0, deadline - time.monotonic()))
            with socket.create_connection((host, port), timeout=wait):
                return time.monotonic() - start
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() + 0.2 >= deadline:
            break
        time.sleep(0.2)
    raise DistributedError(
        f"process {process_id} could not reach the coordinator at `{address}` within "
        f"{timeout_s:.3g} s (last attempt: {last}). Process 0 never started, died, or listens "
        "elsewhere. Fix: start process 0 first with the same `coordinator_address`, check "
        "host/port/firewall, or raise `timeout_s`."
    )


def check_port_free(address: str) -> None:
    """Check process 0 can listen on the coordinator port (taken: most often a duplicate 0)."""
    _, port = split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise DistributedError(
                f"process 0 cannot listen on coordinator port {port} of `{address}`: {e}. "
                "Another process already runs as process 0 (duplicate `process_id` 0) or "
                "another program holds the port. Fix: give each process a distinct id "
                "0..N-1, or choose a free port."
            ) from None


def check_local_device_counts(process_indices: Sequence[int], num_processes: int) -> None:
    """Check every process contributes the same number of devices, naming each count."""
    per_process = {p: list(process_indices).count(p) for p in range(num_processes)}
    if len(set(per_process.values())) > 1:
        listing = ", ".join(f"process {p}: {c}" for p, c in per_process.items())
        raise DistributedError(
            "every process must have the same number of local devices (meshes and "
            f"global batches assume it); found {listing}. Fix: start every process with the "
            "same device count (`jaxdev launch --devices-per-process M`, the same "
            "`local_device_count`, or the same GPUs per host)."
        )


def _exit_now(message: str) -> None:
    """Write ``message`` on stderr and ``os._exit(1)`` (skipping JAX's shutdown barrier)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _prepare(cfg: DistributedConfig, cpu_collectives: str | None, deadline: float) -> None:
    """Before connecting: once, before the backend; CPU settings; port or reachability check."""
    if jax.distributed.is_initialized():
        raise DistributedError(
            "`initialize` was already called in this process. Fix: call it "
            "once; use `jaxdev.distributed.is_initialized()` to check."
        )
    if backend_started():
        raise DistributedError(
            "`initialize` must run before anything starts JAX's backend (jax.devices(), "
            "any computation, device_put, ...). Fix: call `jaxdev.distributed.initialize()` "
            "first thing in the script."
        )
    if cfg.local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", cfg.local_device_count)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if cfg.coordinator_address is None or cfg.process_id is None:
        return  # left to JAX's cluster auto-detection
    if cfg.process_id == 0:
        check_port_free(cfg.coordinator_address)
    else:
        wait_for_coordinator(cfg.coordinator_address, deadline - time.monotonic(), cfg.process_id)


def _connect(cfg: DistributedConfig, deadline: float) -> None:
    """``jax.distributed.initialize``; at ``deadline``, say why and exit with code 1."""
    n = cfg.num_processes
    diagnostic = (
        f"jaxdev: process {cfg.process_id} of {n} gave up after {cfg.init_timeout_s} s "
        f"(`timeout_s`) waiting for every process to register with the coordinator at "
        f"{cfg.coordinator_address}; exiting with code 1 (JAX would abort it with SIGABRT a "
        "little later). Likely causes: a peer never started or died during start-up, or two "
        f"processes share a `process_id` (duplicate process id; ids must be "
        f"{f'0..{n - 1}' if n else '0..N-1'}, each once)."
    )
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _exit_now, [diagnostic])
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            cfg.coordinator_address,
            cfg.num_processes,
            cfg.process_id,
            initialization_timeout=cfg.init_timeout_s + _JAX_GRACE_S,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
            shutdown_timeout_seconds=cfg.shutdown_timeout_s,
        )
    except ValueError as e:  # its "not defined" errors say what to set
        if "defined" not in str(e):
            raise
        raise DistributedError(
            f"`initialize` could not tell the job layout: {e} (found coordinator="
            f"{cfg.coordinator_address!r}, num_processes={cfg.num_processes!r}, process_id="
            f"{cfg.process_id!r}; no cluster was auto-detected). Fix: run under `jaxdev launch "
            f"-n N -- python ...`, set `{ENV_COORDINATOR}`, `{ENV_NUM_PROCESSES}` and "
            f"`{ENV_PROCESS_ID}`, or pass the arguments."
        ) from None
    finally:
        watchdog.cancel()


def _after_connect(cfg: DistributedConfig, fail_fast: bool) -> None:
    """Arm the finish barrier, fail-fast, stack dumps and the watchdog; check the job."""
    _FINISH.update(timeout_s=cfg.shutdown_timeout_s, done=False)
    atexit.register(_finish_at_exit)  # runs before JAX's own exit hook (registered earlier)
    if fail_fast:  # an uncaught exception ends this process now, not at JAX's shutdown barrier
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            previous(exc_type, exc, tb)
            if jax.process_count() > 1 and not issubclass(exc_type, KeyboardInterrupt):
                _exit_now(
                    f"jaxdev fail-fast: process {jax.process_index()} failed with "
                    f"{exc_type.__name__}; exiting now instead of waiting at JAX's shutdown "
                    "barrier for peers that may never arrive."
                )

        sys.excepthook = hook
    found = jax.process_count()
    if cfg.num_processes is not None and found != cfg.num_processes:
        raise DistributedError(
            f"`num_processes`={cfg.num_processes} but JAX connected {found} process(es). "
            "Fix: pass the same `num_processes` to every process."
        )
    check_local_device_counts([d.process_index for d in jax.devices()], found)
    _hang.install_stack_dumps()
    if cfg.hang_timeout_s is not None:
        _hang.start(cfg.hang_timeout_s, cfg.hang_action, _exit_now)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
    shutdown_timeout_s: int | None = None,
    cpu_collectives: str | None = "gloo",
    fail_fast: bool = True,
    hang_timeout_s: float | None = None,
    hang_action: str | None = None,
) -> DistributedConfig:
    """Start ``jax.distributed`` after preflight checks; check the job afterwards.

    Call it first, before anything touches a device. An argument left ``None`` comes
    from the ``JAXDEV_*`` variables (:func:`resolve_config`), else JAX's auto-detection.

    Args:
      coordinator_address: ``host:port`` of process 0.
      num_processes: number of processes.
      process_id: this process's id in ``[0, num_processes)``.
      local_device_count: fake CPU devices for this process (``jax_num_cpu_devices``).
      timeout_s: seconds to reach the coordinator and for every process to register
        (default 60); past them the process prints a diagnostic and exits with code 1.
      heartbeat_timeout_s: seconds after which a silent peer is dead (default 30).
      shutdown_timeout_s: seconds a finishing process waits for the others (default 30).
      cpu_collectives: ``jax_cpu_collectives_implementation`` (``"gloo"`` on CPU).
      fail_fast: after an uncaught exception's traceback exit with code 1 at once, not
        wait at JAX's shutdown barrier for peers that may hang (then SIGABRT).
      hang_timeout_s: ``S``: start the hang watchdog (``None``: none).
      hang_action: after its report ``"exit"`` (default) or ``"wait"``.

    Raises:
      DistributedError: called twice or after the backend started; a malformed value; the
        coordinator unreachable or its port taken; process or local device counts differ.
      UsageError: ``hang_timeout_s`` or ``hang_action`` is invalid.

    Example:
      >>> import jaxdev
      >>> jaxdev.distributed.initialize()  # doctest: +SKIP
      DistributedConfig(coordinator_address='127.0.0.1:...', num_processes=2, ...)
    """
    given = {k: v for k, v in locals().items() if k in _ARGS}  # the arguments, by name
    leave_join_marker()
    cfg = resolve_config(**given)
    deadline = time.monotonic() + cfg.init_timeout_s
    _prepare(cfg, cpu_collectives, deadline)
    _connect(cfg, deadline)
    _after_connect(cfg, fail_fast)
    where = (jax.process_index(), jax.process_count(), cfg.coordinator_address)
    _log.info("process %d of %d joined the coordinator at %s", *where)
    return cfg


def leave_join_marker(env: Mapping[str, str] | None = None) -> str | None:
    """Create the file ``$JAXDEV_JOIN_MARKER`` names; its path, or ``None`` (unset, unwritable)."""
    path = (os.environ if env is None else env).get(ENV_JOIN_MARKER)
    if not path:
        return None
    try:
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")
    except OSError:
        return None
    return path


def _unfinished() -> str | None:
    """Mark this process finished; name the processes not finished within the timeout."""
    if _FINISH.get("done", True) or not jax.distributed.is_initialized():
        return None
    _FINISH["done"] = True
    _hang.beat("finished")  # waiting for the others is not being behind
    try:
        missing = barrier("finished", float(_FINISH["timeout_s"]))
    except Exception:  # noqa: BLE001 - coordinator gone: JAX's own shutdown reports it
        missing = []
    if not missing:
        _hang.stop()  # before JAX shuts its client down
        return None
    return (
        f"jaxdev: process(es) {', '.join(map(str, missing))} of {jax.process_count()} never "
        f"finished: process {jax.process_index()} finished and waited {_FINISH['timeout_s']:g} "
        "s (`shutdown_timeout_s`) for them. They are most likely stuck in a collective the "
        "other processes never ran (an extra or a different jitted computation over the "
        "devices of several processes, e.g. a metric computed only `if jax.process_index() == "
        "0`), or hung or slow. Fix: make every process run the same sequence of multi-process "
        "computations (wrap jitted functions with `jaxdev.distributed.same_program` to find "
        "the first that differs); raise `shutdown_timeout_s` "
        f"(`{ENV_SHUTDOWN_TIMEOUT}`) if they are merely slow."
    )


def _finish_at_exit() -> None:
    """At interpreter exit: name the processes that never finished and exit 1."""
    if message := _unfinished():
        _exit_now(message)


def shutdown() -> None:
    """Leave the distributed job after every process has finished (also run at exit; else a no-op).

    Raises:
      DistributedError: some processes did not finish within the shutdown timeout, named;
        JAX's runtime is left running (with ``fail_fast`` the process exits with code 1).

    Example:
      >>> import jaxdev
      >>> jaxdev.distributed.shutdown()  # not initialized: does nothing
    """
    if not jax.distributed.is_initialized():
        return
    if message := _unfinished():
        raise DistributedError(message.removeprefix("jaxdev: "))
    _hang.stop()
    jax.distributed.shutdown()
