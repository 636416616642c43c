"""Local multi-process launcher: ``jaxdev launch -n N --devices-per-process M -- cmd``.

What each process gets, and how a failure ends the run, is in the README's "Multi-host".
A process that exits 0 without the join marker ``initialize`` leaves, while another left
one, is named as never having joined; ``SIGUSR1`` to the launcher goes to every process.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, NamedTuple

from .._errors import UsageError
from . import _hang
from ._distributed import (
    ENV_COORDINATOR,
    ENV_JOIN_MARKER,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

DEFAULT_GRACE_S = 2.0
_TAIL_LINES = 40
NEVER_JOINED_EXIT_CODE = 1
_FATAL = re.compile(r"(^jaxdev: .*|absl::Status: .*|\b\w*(Error|Exception)\b: .*|unhealthy.*)")
_DETAIL = re.compile(r"  (?!\s*(File |@))|Fix:")  # continues an error: indented (no frame), Fix:
_HINTS = {
    "ALREADY_EXISTS": "two processes registered with the same process id (duplicate id)",
    "RegisterTask": "a peer never registered with the coordinator in time",
    "stopped sending heartbeats": "a peer died or froze (missed heartbeats)",
}


class Outcome(NamedTuple):
    """How one launched process ended (``returncode`` ``-sig``: killed by a signal)."""

    process_id: int
    returncode: int
    ended_by_launcher: bool
    reason: str
    joined: bool | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(
    process_id: int,
    num_processes: int,
    devices_per_process: int,
    port: int,
    base: Mapping[str, str],
    join_dir: str | None = None,
) -> dict[str, str]:
    """Return ``base`` plus the ``JAXDEV_*`` / ``JAX_*`` variables of process ``process_id``.

    ``join_dir``: where ``initialize`` leaves the marker (``None``: no marker variable).
    """
    env = {
        **base,
        ENV_COORDINATOR: f"127.0.0.1:{port}",
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
        ENV_LOCAL_DEVICES: str(devices_per_process),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices_per_process),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop(ENV_JOIN_MARKER, None)
    if join_dir is not None:
        env[ENV_JOIN_MARKER] = os.path.join(join_dir, f"joined-{process_id}")
    return env


def describe_returncode(rc: int) -> str:
    """Return ``'exit code 1'`` or ``'signal SIGKILL'`` for a ``Popen.returncode``."""
    if rc >= 0:
        return f"exit code {rc}"
    with contextlib.suppress(ValueError):  # a signal without a name
        return f"signal {signal.Signals(-rc).name}"
    return f"signal {-rc}"


def failure_reason(lines: Sequence[str], max_lines: int = 6) -> str:
    """The last error-looking output line and its detail lines (with a hint for JAX aborts), or ''.

    Example:
      >>> print(failure_reason(["ok", "ValueError: bad", "  ['x']: shape (4,)"]))
      ValueError: bad
        ['x']: shape (4,)
    """
    for i in range(len(lines) - 1, -1, -1):
        match = _FATAL.search(lines[i])
        if match and not lines[i].lstrip().startswith("@"):
            details = list(itertools.takewhile(_DETAIL.match, lines[i + 1 :]))
            text = "\n".join([match.group(0).strip()[:600], *details][:max_lines])
            hints = [h for key, h in _HINTS.items() if key in "\n".join(lines)]
            return text + (f" [likely: {hints[0]}]" if hints else "")
    return ""


class _Proc:
    """One child process, its pump thread and its output tail."""

    def __init__(self, process_id: int, cmd: Sequence[str], env: dict, out: IO[str], lock):
        self.id = process_id
        self.marker = env[ENV_JOIN_MARKER]  # launch always gives one
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.popen = subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self.ended_by_launcher = False
        self.thread = threading.Thread(target=self._pump, args=(out, lock), daemon=True)
        self.thread.start()

    def _pump(self, out: IO[str], lock: threading.Lock) -> None:
        with self.popen.stdout:  # type: ignore[union-attr]
            for line in self.popen.stdout:  # type: ignore[union-attr]
                line = line.rstrip("\n")
                self.tail.append(line)
                with lock:
                    out.write(f"[p{self.id}] {line}\n")
                    out.flush()

    def joined(self) -> bool:
        """Whether it called ``jaxdev.distributed.initialize`` (it left its join marker)."""
        return os.path.exists(self.marker)

    def outcome(self) -> Outcome:
        self.thread.join(timeout=2.0)
        rc, reason = self.popen.returncode, failure_reason(list(self.tail))
        return Outcome(self.id, rc, self.ended_by_launcher, reason, self.joined())


def _end(procs: Sequence[_Proc], grace_s: float) -> None:
    """Terminate live processes by pid, then kill those still alive after ``grace_s``."""
    live = [p for p in procs if p.popen.poll() is None]
    for p in live:
        p.ended_by_launcher = True
        p.popen.terminate()
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def _supervise(procs: Sequence[_Proc], timeout_s: float | None) -> _Proc | None | bool:
    """Wait until all succeed (``True``), one fails or never joins (it), or time runs out."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.popen.poll() for p in procs]
        failed = [p for p, rc in zip(procs, codes) if rc not in (None, 0)]
        if any(p.joined() for p in procs):  # one exited 0 without joining, while another joined
            failed += [p for p, rc in zip(procs, codes) if rc == 0 and not p.joined()]
        if failed:
            return failed[0]
        if all(rc == 0 for rc in codes):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def never_joined(outcomes: Sequence[Outcome]) -> list[int]:
    """Return the processes that never called ``initialize`` while another did."""
    if not any(o.joined for o in outcomes):
        return []
    return [o.process_id for o in outcomes if o.joined is False]


def summarize(
    first: Outcome | None, outcomes: Sequence[Outcome], timeout_s: float | None, elapsed_s: float
) -> str:
    """Return the launcher's failure summary: the failed process, each other's end, the unjoined.

    Example:
      >>> print(summarize(Outcome(1, -9, False, ""), [Outcome(1, -9, False, "")], None, 2.0))
      jaxdev launch: process 1 failed (signal SIGKILL) after 2.0 s.
        p1: signal SIGKILL
    """
    unjoined = never_joined(outcomes)
    if first is not None and first.returncode == 0 and first.process_id in unjoined:
        joined = ", ".join(str(o.process_id) for o in outcomes if o.joined)
        head = (
            f"jaxdev launch: process {first.process_id} never called jaxdev.distributed."
            f"initialize: it exited 0 having run alone, while process(es) {joined} joined the "
            f"job and waited for it; stopped after {elapsed_s:.1f} s (exit code "
            f"{NEVER_JOINED_EXIT_CODE}). Fix: call `jaxdev.distributed.initialize()` first thing "
            "in every process (not only on some, e.g. not under `if process_id == 0`, and not "
            "after an early return)."
        )
    elif first is None:
        still = [o.process_id for o in outcomes if o.ended_by_launcher]
        head = (
            f"jaxdev launch: timed out after {timeout_s:g} s (`--timeout`); process(es) "
            f"{', '.join(map(str, still)) or 'none'} still running were ended."
        )
    else:
        reason = f": {first.reason}" if first.reason else "."
        head = (
            f"jaxdev launch: process {first.process_id} failed "
            f"({describe_returncode(first.returncode)}) after {elapsed_s:.1f} s{reason}"
        )
    lines = [head]
    for o in outcomes:
        how = "ended by launcher, " if o.ended_by_launcher else ""
        other = o.reason and (first is None or o.reason != first.reason)
        why = f" - {o.reason.splitlines()[0]}" if other else ""
        if o.process_id in unjoined:
            why += " - never called jaxdev.distributed.initialize"
        lines.append(f"  p{o.process_id}: {how}{describe_returncode(o.returncode)}{why}")
    if unjoined and (first is None or first.process_id not in unjoined):
        lines.append(
            f"  process(es) {', '.join(map(str, unjoined))} never called "
            "jaxdev.distributed.initialize; the others waited for them at start-up."
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _forward_stack_signal(procs: Sequence[_Proc]) -> Iterator[None]:
    """While supervising: a ``SIGUSR1`` to the launcher goes to every live child (by pid); a
    ``SIGTERM`` ends the launcher as ``SystemExit(143)`` after its children (``launch``'s end)."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        yield  # no such signal here, or not the main thread (handlers can't be set)
        return

    def forward(signum, frame):
        for p in list(procs):
            p.popen.send_signal(signum)  # does nothing once the child ended (Python >= 3.9)

    def end(signum, frame):
        sys.exit(128 + signum)  # SystemExit: the launcher's cleanup ends the processes

    previous = signal.signal(sig, forward), signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(sig, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def launch(
    cmd: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    port: int | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    out: IO[str] | None = None,
    hang_timeout_s: float | None = None,
) -> int:
    """Run ``cmd`` as ``num_processes`` local JAX processes; return an exit code.

    Args:
      cmd: the command every process runs, e.g. ``["python", "train.py"]``.
      num_processes: number of processes (ids 0..N-1).
      devices_per_process: fake CPU devices per process.
      port: the coordinator port on 127.0.0.1; ``None`` picks a free one.
      timeout_s: limit for the whole run; ``None`` means no limit.
      env: extra environment for every process (over ``os.environ``).
      grace_s: seconds between SIGTERM and SIGKILL when ending processes.
      out: where prefixed output and the summary go (default stdout/stderr).
      hang_timeout_s: sets ``JAXDEV_HANG_TIMEOUT``; ``None`` leaves the environment's.

    Returns:
      0 when every process exits 0; else the first failure's exit code, ``128 + signal``
      when a signal ended it, 124 on timeout, or 1 when a process exits 0 without joining
      while others did.

    Raises:
      UsageError: an argument is invalid (the CLI turns it into exit 2).
      OSError: the command cannot be started (processes already started are ended first).

    Example:
      >>> import sys, jaxdev
      >>> jaxdev.distributed.launch([sys.executable, "-c", "print('hi')"], 1, 1)
      [p0] hi
      0
    """
    if not cmd:
        raise UsageError("`cmd` is empty; give the command after `--`, e.g. `-- python script.py`.")
    args_ok = all(isinstance(a, (str, bytes, os.PathLike)) for a in cmd)  # as Popen takes them
    if isinstance(cmd, (str, bytes)) or not args_ok:
        raise UsageError(
            f"`cmd` must be a list of strings, e.g. ['python', 'train.py'], got {cmd!r} (a "
            "string would run its first character): split it with `shlex.split(cmd)`."
        )
    for name, n in (("num_processes", num_processes), ("devices_per_process", devices_per_process)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"`{name}` must be an int >= 1, got {n!r}.")
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"`port` must be in 1..65535, got {port!r}.")
    if timeout_s is not None and not timeout_s > 0:
        raise UsageError(f"`timeout_s` must be > 0 seconds, got {timeout_s!r}.")
    base = {**os.environ, **(env or {})}
    if hang_timeout_s is not None:
        base[_hang.ENV_HANG_TIMEOUT] = f"{_hang.check_timeout(hang_timeout_s):g}"
    port = free_port() if port is None else port
    lock, start = threading.Lock(), time.monotonic()
    procs: list[_Proc] = []
    with tempfile.TemporaryDirectory(prefix="jaxdev-launch-") as join_dir:
        try:  # processes already started are ended however this block is left
            with _forward_stack_signal(procs):
                for i in range(num_processes):
                    penv = process_env(i, num_processes, devices_per_process, port, base, join_dir)
                    procs.append(_Proc(i, cmd, penv, out or sys.stdout, lock))
                result = _supervise(procs, timeout_s)
        finally:
            _end(procs, grace_s)
        outcomes = [p.outcome() for p in procs]  # also drains every output pump
    if result is True:
        return 0
    first = None if result is None else outcomes[result.id]  # type: ignore[union-attr]
    summary = summarize(first, outcomes, timeout_s, time.monotonic() - start)
    with lock:
        print(summary, file=out or sys.stderr, flush=True)
    if first is None:
        return 124  # the whole run timed out
    rc = first.returncode  # killed by a signal: 128 + signal; exited 0: it never joined
    return 128 - rc if rc < 0 else rc or NEVER_JOINED_EXIT_CODE


class UsageParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one-line :class:`~jaxdev.UsageError` s (exit code 2)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry ``jaxdev launch ... -- cmd``: :func:`launch`'s code; 2: usage error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--") if "--" in argv else len(argv)
    opts, cmd = argv[:i], argv[i + 1 :]  # launcher options, then the command
    p = UsageParser(
        prog="jaxdev launch",
        description="Run a command as N local JAX processes with M fake CPU devices each, "
        "e.g. `jaxdev launch -n 2 --devices-per-process 4 -- python train.py`.",
    )
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=1)
    p.add_argument("--port", type=int, help="coordinator port (default: free)")
    p.add_argument("--timeout", type=float, dest="timeout_s", help="seconds for the whole run")
    p.add_argument(
        "--hang-timeout",
        type=float,
        dest="hang_timeout_s",
        help="start every process's hang watchdog: when no process makes progress for this "
        "many seconds, name the one behind, print every stack, and end the run "
        "(sets JAXDEV_HANG_TIMEOUT)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        dest="grace_s",
        help="seconds between SIGTERM and SIGKILL when ending processes",
    )
    try:
        if "--" not in argv and not {"-h", "--help"} & set(argv):
            raise UsageError(
                "missing `--` before the command, e.g. `jaxdev launch -n 2 -- python script.py`"
            )
        return launch(cmd, **vars(p.parse_args(opts)))  # each dest: an argument of launch
    except UsageError as e:
        print(f"jaxdev launch: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the command could not be started
        print(f"jaxdev launch: error: cannot start {' '.join(cmd)!r}: {e}", file=sys.stderr)
        return 127
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except KeyboardInterrupt:
        return 130
