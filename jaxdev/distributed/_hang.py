"""The hang watchdog: when a multi-process run stops making progress, say who and where.

Every process's daemon thread publishes its heartbeat (step, phase, state, seconds since
progress, where its main thread is) to the coordinator's key-value store, reads the others',
and when :func:`stalled` says so, dumps every stack and names the process that is behind.
The states, their allowances (:data:`ALLOWANCE`) and the options are in the README's "Hang
watchdog"; the store is reached through :func:`jaxdev._multihost.kv_client`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import linecache
import logging
import math
import numbers
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax

from .._errors import DistributedError, UsageError
from .._multihost import kv_client

_log = logging.getLogger("jaxdev")
ENV_HANG_TIMEOUT = "JAXDEV_HANG_TIMEOUT"
ENV_HANG_ACTION = "JAXDEV_HANG_ACTION"
# state: how long (x S) it counts as progress; "finished" never stalls
ALLOWANCE = dict.fromkeys(("start", "compile", "checkpoint", "barrier"), 10)
ALLOWANCE |= {"step": 1, "host": 1}
_OWN_FILES = {  # jaxdev's files: what the main thread does while inside them
    os.path.join("train", "_step.py"): "step",
    "_multihost.py": "check",
    os.path.join("checkpoint", "_checkpoint.py"): "checkpoint",
    os.path.join("checkpoint", "_checkpointer.py"): "checkpoint",
    os.path.join("checkpoint", "_ckpt_files.py"): "checkpoint",
}
# JAX's tracing, lowering and compiling: any compile, a step's first or a later one (a new shape)
_JAX_COMPILE = (
    os.path.join("_src", "compiler.py"),
    os.path.join("_src", "interpreters", "partial_eval.py"),
    os.path.join("_src", "interpreters", "mlir.py"),
)
_JAX_BARRIER = os.path.join("experimental", "multihost_utils.py")  # sync_global_devices, ...
_KEY = "jaxdev/hang/"
_STACK_CHARS = 60_000  # per process, in the key-value store
_NOTICE_S = 0.05  # how often the thread looks for a new state (publishing it at once)
_GATHER_S = 5.0  # the reporter waits this long for every answering process's stacks
_ACK_S = 3.0  # process 0 waits this long for the others to exit first
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # jaxdev/
# JAX's own files (importing jax imports jaxlib)
_JAX = tuple(os.path.dirname(sys.modules[m].__file__) + os.sep for m in ("jax", "jaxlib"))


def check_timeout(value: Any, name: str = "hang_timeout_s") -> float | None:
    """Return ``value`` as seconds (``None``/``""``: watchdog off) or raise naming ``name``."""
    if value is None or value == "":
        return None
    seconds = value
    with contextlib.suppress(ValueError):  # a number in a string (the environment's)
        seconds = float(value) if isinstance(value, str) else value
    number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    if not number or not 0 < seconds < math.inf:  # NaN too
        raise UsageError(
            f"`{name}` must be a number of seconds > 0 (or None: no hang watchdog), got {value!r}."
        )
    return float(seconds)


def check_action(value: Any, name: str = "hang_action") -> str:
    """Return ``value`` (``"exit"``, ``"wait"``; ``None``/``""``: ``"exit"``) or raise."""
    if value is None or value == "":
        return "exit"
    if value not in ("exit", "wait"):
        raise UsageError(f"`{name}` must be 'exit' or 'wait', got {value!r}.")
    return value


_WATCH: _Watchdog | None = None  # the running watchdog of this process


def beat(phase: str, step: int | None = None) -> None:
    """Record progress of this process in ``phase`` (``step=None`` keeps the last step)."""
    if (watch := _WATCH) is not None:  # read once: stop() may clear it meanwhile
        watch.record(phase, step)


def step_call(train: bool, compiling: bool) -> None:
    """Record a jaxdev step call: a train call is the next step (1, 2, ...), an eval call is not."""
    if (watch := _WATCH) is not None:
        step = (watch.last[2] or 0) + 1 if train else None
        watch.record("compile" if compiling else "step" if train else "eval", step)


_LIBRARY = (_PACKAGE,) + tuple(  # Python's own and installed packages' files, and jaxdev's
    os.path.abspath(d) + os.sep
    for k, d in sysconfig.get_paths().items()
    if k in ("stdlib", "platstdlib", "purelib", "platlib")
)


def is_user_file(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_LIBRARY)


def where(frame: Any) -> str:
    """Describe the innermost user frame (else the innermost): ``file:line in func: `code```."""
    innermost, f = frame, frame
    while f is not None and not is_user_file(f.f_code.co_filename):
        f = f.f_back
    f = f or innermost
    code = linecache.getline(f.f_code.co_filename, f.f_lineno or 0).strip()  # None: no line
    site = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno or '?'} in {f.f_code.co_name}"
    return f"{site}: `{code}`" if code else site


def inside(frame: Any) -> frozenset[str]:
    """Tags: ``compile``, ``barrier``, ``jax``; jaxdev's ``step``, ``check``, ``checkpoint``."""
    tags = set()
    if frame is not None and "wait_at_barrier" in linecache.getline(
        frame.f_code.co_filename, frame.f_lineno or 0
    ):
        tags.add("barrier")
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and name[len(_PACKAGE) :] in _OWN_FILES:
            tags.add(_OWN_FILES[name[len(_PACKAGE) :]])
        elif name.startswith(_JAX):
            jax_tag = "barrier" if name.endswith(_JAX_BARRIER) else "jax"
            tags.add("compile" if name.endswith(_JAX_COMPILE) else jax_tag)
        frame = frame.f_back
    return frozenset(tags)


def state_of(phase: str, where_in: Collection[str]) -> str:
    """The model's state of a process from its last heartbeat's phase and :func:`inside` tags."""
    if phase in ("start", "finished"):
        return phase
    if "compile" in where_in or (
        phase == "compile" and "step" in where_in and "check" not in where_in
    ):
        return "compile"
    if "checkpoint" in where_in:
        return "checkpoint"
    if "step" in where_in or "check" in where_in:
        return "step"
    return "barrier" if "barrier" in where_in else "step" if "jax" in where_in else "host"


def progressed(before: tuple, now: tuple) -> bool:
    """Whether a process progressed between two samples ``(seq, state, frame, lasti)``."""
    moved = before[2] is not now[2] or before[3] != now[3]
    return before[:2] != now[:2] or (now[1] in ("compile", "step", "barrier") and moved)


def thread_stacks(skip: int | None = None, limit: int = _STACK_CHARS) -> str:
    """Every thread's Python stack but ``skip``'s, the main thread first, cut at ``limit``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sys._current_frames()
    parts = [
        f"Thread {names.get(ident, ident)} (most recent call last):\n"
        + "".join(traceback.format_stack(frames[ident])).rstrip("\n")
        for ident in sorted(frames, key=lambda i: (i != main, i))
        if ident != skip
    ]
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + "\n... (cut)"


def install_stack_dumps() -> None:
    """Make ``SIGUSR1`` print every thread's stack (chaining an older handler), and faulthandler."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        chain = callable(signal.getsignal(signal.SIGUSR1))  # a Python handler set before
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=chain)


def stalled(records: Sequence[Mapping[str, Any]], timeout_s: float) -> bool:
    """The verdict: every unfinished process is over its allowance, and one is not in host work.

    ``records`` carry ``state`` and ``quiet`` (seconds since progress); a process whose
    watchdog does not answer (dead, or holding the GIL in C) has ``S`` whatever its state.
    """
    running = [r for r in records if r["state"] != "finished"]
    over = [
        r
        for r in running
        if r["quiet"] >= (ALLOWANCE[r["state"]] if r.get("answers", True) else 1) * timeout_s
    ]
    return len(over) == len(running) and any(r["state"] != "host" for r in over)


def behind(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The heartbeat of the unfinished process most behind (``None`` when all finished)."""
    running = [r for r in records if r.get("phase") != "finished"]
    return min(
        running,
        key=lambda r: (
            r.get("state") in ("step", "barrier"),  # waits on the others (or computes)
            -1 if r.get("step") is None else r["step"],
            # at the same step, one waiting where every process meets (a jaxdev step or
            # check, a barrier) is not the odd one: one in its own collective is
            bool(r.get("in_step") or r.get("waiting") or r.get("state") == "barrier"),
            bool(r.get("answers", True)),
            -float(r.get("idle", 0.0)),
            r["process"],
        ),
        default=None,
    )


def _state(rec: Mapping[str, Any]) -> str:
    """``in step 5`` / ``in step 1 (compile)`` / ``after step 4 (data)``: where a process is."""
    step, phase = rec.get("step"), rec.get("phase", "")
    label = "compile" if rec.get("state") == "compile" else phase  # any compile
    if rec.get("in_step") and phase in ("compile", "step", "eval"):  # in a jaxdev step call
        name = f"in step {step}" if step is not None else "in its first step"
        return name if label == "step" else f"{name} ({label})"
    after = f"after step {step}" if step is not None else "before step 1"
    return after if label in ("step", "start", "") else f"{after} ({label})"


def _others(records: Sequence[Mapping[str, Any]], late: Mapping[str, Any]) -> list[str]:
    """``process 0 waits in step 5, at ...`` / ``processes 0, 2 wait in step 5``."""
    groups: dict[str, list] = {}
    for r in sorted(records, key=lambda r: r["process"]):
        if r is not late:
            finished = r.get("phase") == "finished"
            groups.setdefault("finished" if finished else _state(r), []).append(r)
    out = []
    for state, recs in groups.items():
        one = len(recs) == 1
        ids = f"process{'' if one else 'es'} {', '.join(str(r['process']) for r in recs)}"
        if state == "finished":
            out.append(f"{ids} {'has' if one else 'have'} finished")
            continue
        text = f"{ids} wait{'s' if one else ''} {state}"
        if one and recs[0].get("waiting"):
            text += " in a jaxdev cross-process check"
        elif one and recs[0].get("state") == "barrier":
            text += " in a barrier"
        out.append(text + (f", at {recs[0].get('where')}" if one and recs[0].get("where") else ""))
    return out


def verdict(records: Sequence[Mapping[str, Any]], timeout_s: float) -> str:
    """One line naming the process that is behind, its step, and where every process is.

    Example:
      >>> recs = [
      ...     {"process": 0, "step": 5, "phase": "step", "in_step": True, "idle": 8.2,
      ...      "where": "t.py:9"},
      ...     {"process": 1, "step": 4, "phase": "data", "idle": 9.4, "where": "t.py:3"},
      ... ]
      >>> print(verdict(recs, 8))
      no progress for 8 s: process 1 has not started step 5: 9 s after step 4 (data),
      at t.py:3; process 0 waits in step 5, at t.py:9
    """
    late = behind(records)
    head = f"no progress for {timeout_s:g} s"
    if late is None:
        return head + ": every process finished"
    where, idle, step = late.get("where") or "?", float(late.get("idle", 0.0)), late.get("step")
    others = {r.get("state") for r in records if r is not late and r.get("phase") != "finished"}
    if late.get("in_step") and late.get("phase") in ("compile", "step"):  # stuck inside it
        blame = "has not finished " + (f"step {step}" if step is not None else "its first step")
    elif late.get("state") == "barrier":
        blame = "waits in a barrier outside any step"
    elif others == {"barrier"}:
        blame = "has not reached the barrier the others wait in"
    else:
        blame = f"has not started step {(step or 0) + 1}"
    text = f"{head}: process {late['process']} {blame}: {idle:.0f} s {_state(late)}"
    if not late.get("answers", True):  # what it published last may be older than its last step
        text = (
            f"{head}: process {late['process']} does not answer (dead, or stuck in C code "
            f"holding the GIL); its last heartbeat, {idle:.0f} s ago: {_state(late)}"
        )
    text += f", at {where}"
    return "; ".join([text, *_others(records, late)])


def report(
    records: Sequence[Mapping[str, Any]], stacks: Mapping[int, str], timeout_s: float
) -> str:
    """The watchdog's summary: the verdict, one line per process, then every stack.

    Example:
      >>> recs = [{"process": 0, "step": 2, "phase": "step", "idle": 6.0, "where": "t.py:9"}]
      >>> print(report(recs, {0: "Thread MainThread ..."}, 5))
      jaxdev: hang watchdog: no progress for 5 s: process 0 has not started step 3:
      6 s after step 2, at t.py:9
        process 0: after step 2, 6.0 s since its last heartbeat, at t.py:9
      --- process 0: stacks (behind) ---
      Thread MainThread ...
    """
    late = behind(records)
    lines = [f"jaxdev: hang watchdog: {verdict(records, timeout_s)}"]
    ordered = sorted(records, key=lambda r: r["process"])
    for r in ordered:
        silent = "" if r.get("answers", True) else ", its watchdog does not answer"
        state = "finished" if r.get("phase") == "finished" else _state(r)
        lines.append(
            f"  process {r['process']}: {state}, {float(r.get('idle', 0.0)):.1f} s since its "
            f"last heartbeat, at {r.get('where') or '?'}{silent}"
        )
    for r in sorted(ordered, key=lambda r: r is not late):  # the one behind first
        tag = " (behind)" if r is late else ""
        text = stacks.get(r["process"])
        if text is None:
            lines.append(f"--- process {r['process']}: no stacks{tag}: its watchdog did not answer")
        else:
            lines.append(f"--- process {r['process']}: stacks{tag} ---\n{text}")
    return "\n".join(lines)


class _Watchdog:
    """This process's heartbeat and the daemon thread that publishes and compares them."""

    def __init__(self, client, process: int, timeout_s: float, action: str, exit_fn: Callable):
        self.client, self.process = client, process
        self.timeout_s, self.action, self.exit_fn = timeout_s, action, exit_fn
        self.interval = min(5.0, max(0.5, timeout_s / 10))  # between two publications
        # (seq, phase, step, when, thread): the latest heartbeat, replaced whole (no lock)
        self.last: tuple = (0, "start", None, time.monotonic(), threading.main_thread().ident)
        # the last sample (seq, state, frame, lasti; holding the frame, no new one takes its id)
        self.sample: tuple = (0, "start", None, None)
        self.since = self.last[3]  # the last progress
        self.published = 0
        self.seen: dict[int, tuple[Any, float]] = {}  # process: (its publication, seen at)
        self.incident, self.resume_after = 0, None  # resume_after: seqs at a reported stall
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxdev-hang-watchdog", daemon=True)

    # -- the hot path: called by the training loop
    def record(self, phase: str, step: int | None) -> None:
        seq, _, old = self.last[:3]
        step = old if step is None else step
        self.last = (seq + 1, phase, step, time.monotonic(), threading.get_ident())

    # -- the thread
    def _run(self) -> None:
        failures: set[str] = set()
        due, shown = 0.0, None
        while not self.stopped.is_set():
            try:  # a new heartbeat or state is published at once, not an interval later:
                beat = self._heartbeat()  # a process that then holds the GIL in C is
                now, seen = time.monotonic(), (beat["seq"], beat["state"], beat["in_step"])
                if now >= due:  # reported in the state it is in, not in an older one
                    due, shown = now + self.interval, seen
                    self._tick(beat)
                elif seen != shown:
                    shown = seen
                    self._publish(beat)
            except Exception as err:  # noqa: BLE001 - e.g. the coordinator is gone (JAX ends us)
                if type(err).__name__ not in failures:  # once per kind: never a flood
                    failures.add(type(err).__name__)
                    _log.warning("jaxdev hang watchdog: %s: %s", type(err).__name__, err)
            self.stopped.wait(min(_NOTICE_S, self.interval))

    def _heartbeat(self) -> dict[str, Any]:
        """This process's heartbeat now: its state, and where its main thread is."""
        now = time.monotonic()
        seq, phase, step, t, thread = self.last
        frames = sys._current_frames()
        main = threading.main_thread().ident
        frame = frames.get(main)
        tags = inside(frame) | (inside(frames.get(thread)) if thread != main else frozenset())
        state = state_of(phase, tags)
        sample = (seq, state, frame, getattr(frame, "f_lasti", None))
        if progressed(self.sample, sample):  # a heartbeat (at t), or seen now
            self.since = t if seq != self.sample[0] else now
        self.sample = sample
        return {
            "process": self.process,
            "seq": seq,
            "phase": phase,
            "state": state,
            "step": step,
            "idle": round(now - t, 3),
            "quiet": round(now - self.since, 3),  # seconds since its last progress
            "where": where(frame) if frame is not None else "",
            "in_step": "step" in tags,
            "waiting": "check" in tags,
        }

    def _set(self, key: str, value: str, overwrite: bool = True) -> None:
        self.client.key_value_set(_KEY + key, value, allow_overwrite=overwrite)

    def _publish(self, beat: dict[str, Any]) -> None:
        self.published += 1
        self._set(f"beat/{self.process}", json.dumps({**beat, "pub": self.published}))

    def _round(self, beat: dict | None = None) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Publish this process's heartbeat; read the store's entries and every heartbeat."""
        self._publish(beat or self._heartbeat())
        entries = {k[len(_KEY) :]: v for k, v in self.client.key_value_dir_get(_KEY)}
        return entries, self._records(entries)

    def _records(self, entries: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every published heartbeat, aged by how long it has not changed here."""
        now, out = time.monotonic(), []
        for key, value in entries.items():
            if not key.startswith("beat/"):
                continue
            rec = json.loads(value)
            p = rec["process"]
            if self.seen.get(p, (None,))[0] != rec["pub"]:
                self.seen[p] = (rec["pub"], now)
            age = 0.0 if p == self.process else now - self.seen[p][1]
            answers = age < max(3 * self.interval, 3.0)
            out.append(
                {**rec, "idle": rec["idle"] + age, "quiet": rec["quiet"] + age, "answers": answers}
            )
        return out

    def _tick(self, beat: dict | None = None) -> None:
        entries, records = self._round(beat)
        if self.resume_after is not None:  # reported; progress re-arms it
            if {r["process"]: r["seq"] for r in records} != self.resume_after:
                self.resume_after, self.incident = None, self.incident + 1
            return
        if f"fired/{self.incident}" in entries or stalled(records, self.timeout_s):
            self._handle(records)

    def _handle(self, records: list[dict[str, Any]]) -> None:
        """Dump and publish this process's stacks, get the verdict, then exit or wait."""
        n, me = self.incident, self.process
        with contextlib.suppress(Exception):  # ALREADY_EXISTS: another process noticed first
            self._set(f"fired/{n}", str(me), overwrite=False)
        mine = self._heartbeat()
        stacks = thread_stacks(skip=threading.get_ident())
        _say(
            f"jaxdev: hang watchdog: process {me} stacks ({_state(mine)}, {mine['idle']:.0f} s "
            f"since its last heartbeat):\n{stacks}"
        )
        self._set(f"stack/{n}/{me}", json.dumps({"record": mine, "stacks": stacks}))
        text = self._verdict(n)
        if self.action == "wait":
            _say(
                f"jaxdev: hang watchdog: {text} (`hang_action`='wait': process {me} keeps waiting)"
            )
            self.resume_after = {r["process"]: r["seq"] for r in records}
            return
        self._set(f"ack/{n}/{me}", "1")
        if me == 0:  # the coordination service lives here: the others exit first
            self._wait_for(lambda e, live: all(f"ack/{n}/{p}" in e for p in live), _ACK_S)
        self.exit_fn(
            f"jaxdev: hang watchdog: {text}. Process {me} exits with code 1 "
            "(`hang_action`='exit'; 'wait' keeps it running)."
        )

    def _wait_for(self, done: Callable[[dict, list[int]], Any], seconds: float) -> Any:
        """Poll the store until ``done(entries, answering processes)`` is truthy or time is up."""
        deadline = time.monotonic() + seconds
        while True:
            entries, records = self._round()  # keep answering while waiting
            live = [r["process"] for r in records if r["answers"]]
            result = done(entries, live)
            if result or time.monotonic() >= deadline:
                return result
            time.sleep(0.2)

    def _verdict(self, n: int) -> str:
        """The verdict of stall ``n``: the reporter's, or this process's once it is the reporter."""
        start = time.monotonic()

        def ready(entries: dict, live: list[int]) -> str | None:
            if reported := entries.get(f"reported/{n}"):
                return reported
            stacks = {
                int(k.rsplit("/", 1)[1]): json.loads(v)
                for k, v in entries.items()
                if k.startswith(f"stack/{n}/")
            }
            waited = time.monotonic() - start
            reporter = min([*live, self.process])
            all_in = set(live) <= set(stacks)
            if (reporter == self.process and (all_in or waited > _GATHER_S)) or (
                waited > 2 * _GATHER_S  # the reporter went silent: report here
            ):
                return self._report(n, entries, stacks)
            return None

        return self._wait_for(ready, 3 * _GATHER_S) or "no verdict (the store did not answer)"

    def _report(self, n: int, entries: Mapping[str, str], stacks: Mapping[int, Any]) -> str:
        records = [  # a dumped heartbeat is newer than the published one
            {**s["record"], "answers": True} if (s := stacks.get(r["process"])) else r
            for r in self._records(entries)
        ]
        text = verdict(records, self.timeout_s)
        summary = report(records, {p: s["stacks"] for p, s in stacks.items()}, self.timeout_s)
        _say(summary)
        self._set(f"reported/{n}", text)
        return text


def _say(text: str) -> None:
    """Write ``text`` on stderr and the ``jaxdev`` logger; a closed stderr never stops it."""
    if _log.hasHandlers():  # else logging's last resort would print it on stderr twice
        _log.error("%s", text)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(text, file=sys.stderr, flush=True)


def start(timeout_s: float, action: str, exit_fn: Callable[[str], None]) -> None:
    """Start this process's hang watchdog (``initialize`` does, once connected)."""
    global _WATCH
    client = kv_client()
    if client is None:  # JAX's private client unset: refused, not a thread that never fires
        raise DistributedError(
            "the hang watchdog needs jax.distributed's coordination service, and this process "
            "has no client. Fix: call `jaxdev.distributed.initialize(hang_timeout_s=...)` "
            "(not jax.distributed directly), or leave `hang_timeout_s` unset."
        )
    _WATCH = _Watchdog(client, jax.process_index(), timeout_s, action, exit_fn)
    _WATCH.thread.start()


def stop() -> None:
    """Stop this process's watchdog (heartbeats become no-ops again)."""
    global _WATCH
    watch, _WATCH = _WATCH, None
    if watch is not None:
        watch.stopped.set()


def heartbeat(label: str, step: int | None = None) -> None:
    """Tell the hang watchdog this process makes progress (a no-op, ~0.1 us, when it is off).

    jaxdev's steps and checkpoints beat by themselves; call this in your own loop (e.g.
    before fetching a batch) so a stall reads ``process 1 has not started step 5: 62 s
    after step 4 (data), at loader.py:41 ...``.

    Args:
      label: what this process does now (``"data"``, ``"log"``, ...); not ``"start"`` or
        ``"finished"`` (the watchdog's own).
      step: your step number; ``None`` keeps the last one.

    Raises:
      UsageError: a bad ``label`` or a ``step`` that is not ``None`` or an int >= 0.

    Example:
      >>> import jaxdev
      >>> for i, batch in enumerate([[1.0], [2.0]]):
      ...     jaxdev.distributed.heartbeat("data", step=i)
    """
    if not isinstance(label, str) or not label.strip() or label in ("start", "finished"):
        raise UsageError(
            f"`label` must be a non-empty string naming what the process does (e.g. 'data'), "
            f"other than 'start' and 'finished' (the watchdog's own), got {label!r}."
        )
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0
    ):
        raise UsageError(f"`step` must be None or an int >= 0, got {step!r}.")
    beat(label, None if step is None else int(step))
