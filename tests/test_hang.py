"""The hang watchdog, stacks on demand (SIGUSR1), and the launcher's part in both.

Pure parts (options, the verdict, the report, a watchdog over an in-memory
key-value store) are tested in-process. The multi-process scenarios run
``tests/mp_scripts/hang.py`` as 2 processes x 4 fake CPU devices, all at
once (they mostly sleep), under ``jaxdev launch --hang-timeout S`` and as
plain processes started with the ``JAXDEV_*`` environment set by hand; every
process is ended by its own pid if it outlives its deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, clean_env
from mp_scripts.hang_runs import Run, Scenario, run_all

import jaxdev
from jaxdev.distributed import _distributed, _hang, _launch

MAIN = threading.main_thread().ident
HANG = os.path.join(REPO, "tests", "mp_scripts", "hang.py")
PY = sys.executable
S = 6  # hang timeout of every scenario
DEADLINE_S = 150  # backstop per scenario (processes killed by pid after it)


# --- options ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 0, "x", True, float("nan"), float("inf"), [5]])
def test_bad_hang_timeout_is_a_usage_error_naming_the_argument(bad):
    with pytest.raises(jaxdev.UsageError, match="`hang_timeout_s` must be a number of seconds > 0"):
        _distributed.resolve_config(hang_timeout_s=bad, env={})


def test_hang_options_come_from_the_environment_and_arguments_win():
    env = {"JAXDEV_HANG_TIMEOUT": "7.5", "JAXDEV_HANG_ACTION": "wait"}
    cfg = _distributed.resolve_config(env=env)
    assert (cfg.hang_timeout_s, cfg.hang_action) == (7.5, "wait")
    cfg = _distributed.resolve_config(env=env, hang_timeout_s=3, hang_action="exit")
    assert (cfg.hang_timeout_s, cfg.hang_action) == (3.0, "exit")
    assert _distributed.resolve_config(env={}).hang_timeout_s is None  # off by default
    with pytest.raises(jaxdev.UsageError, match=r"`\$JAXDEV_HANG_TIMEOUT` must be .* got 'soon'"):
        _distributed.resolve_config(env={"JAXDEV_HANG_TIMEOUT": "soon"})
    with pytest.raises(jaxdev.UsageError, match="`hang_action` must be 'exit' or 'wait'"):
        _distributed.resolve_config(env={}, hang_action="kill")


def test_bad_hang_timeout_is_refused_before_anything_starts():
    with pytest.raises(jaxdev.UsageError, match="`hang_timeout_s`"):
        jaxdev.distributed.initialize("127.0.0.1:1", 2, 1, hang_timeout_s=-1)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("",), "`label` must be a non-empty string"),
        ((3,), "`label` must be a non-empty string"),
        (("finished",), "other than 'start' and 'finished'"),
        (("data", -1), "`step` must be None or an int >= 0, got -1"),
        (("data", 2.5), "`step` must be None or an int >= 0"),
    ],
)
def test_heartbeat_refuses_bad_arguments_even_when_off(args, match):
    with pytest.raises(jaxdev.UsageError, match=match):
        jaxdev.distributed.heartbeat(*args)


def test_launcher_passes_the_hang_timeout_and_refuses_a_bad_one(capsys):
    code = "import os; print(os.environ['JAXDEV_HANG_TIMEOUT'])"
    assert _launch.main(["-n", "1", "--hang-timeout", "7", "--", PY, "-c", code]) == 0
    assert "[p0] 7" in capsys.readouterr().out
    assert _launch.main(["-n", "1", "--hang-timeout", "-1", "--", PY, "-c", "0"]) == 2
    assert "`hang_timeout_s` must be a number of seconds > 0" in capsys.readouterr().err


# --- the verdict ----------------------------------------------------------------------


def _rec(process, step, phase="step", idle=8.0, **kw):
    state = "step" if kw.get("in_step") or kw.get("waiting") else "host"
    return {"process": process, "step": step, "phase": phase, "state": state, "idle": idle, **kw}


def test_behind_is_not_in_a_step_then_the_lowest_step_then_silent_then_oldest():
    assert _hang.behind([_rec(0, 6), _rec(1, 5, idle=1.0), _rec(2, 6)])["process"] == 1
    both_at_4 = [_rec(0, 4, waiting=True, idle=9.0), _rec(1, 4, idle=8.0)]
    assert _hang.behind(both_at_4)["process"] == 1  # process 0 waits for the others
    uneven = [_rec(0, 9, in_step=True), _rec(1, 12)]  # 1 ran more steps on its own devices
    assert _hang.behind(uneven)["process"] == 1  # and is not in its step 13
    dead = [_rec(0, 5, idle=9.0), _rec(1, 5, idle=8.0, answers=False)]
    assert _hang.behind(dead)["process"] == 1
    assert _hang.behind([_rec(0, 5, idle=9.0), _rec(1, 5, idle=8.0)])["process"] == 0
    assert _hang.behind([_rec(0, 5, phase="finished"), _rec(1, 2)])["process"] == 1
    assert _hang.behind([_rec(0, 5, phase="finished")]) is None


def test_at_the_same_step_the_process_in_its_own_collective_is_behind():
    """Process 1 runs a collective process 0 never joins (a metric logged on one process);
    process 0 waits for it in jaxdev's batch check of step 5. Both are at step 4 in JAX
    code: the older heartbeat (process 0's 'data') decided, and named process 0."""
    odd = _rec(1, 4, state="step", where="t.py:9 in main: `float(jnp.sum(x))`", idle=6.3)
    recs = [_rec(0, 4, phase="data", waiting=True, idle=6.9), odd]  # both in JAX code
    assert _hang.behind(recs)["process"] == 1
    text = _hang.verdict(recs, 6)
    assert text.startswith("no progress for 6 s: process 1 has not started step 5: 6 s after")
    assert "process 0 waits after step 4 (data) in a jaxdev cross-process check" in text
    stuck = [_rec(0, 5, in_step=True, idle=9.0), _rec(1, 5, state="barrier", idle=8.0)]
    assert _hang.behind([*stuck, _rec(2, 5, state="step")])["process"] == 2  # a barrier too


def test_verdict_names_the_step_not_started_or_not_finished():
    stuck_in_step = [
        _rec(0, 5, in_step=True, where="a.py:3"),
        _rec(1, 5, in_step=True, where="b.py:4", idle=30.0),
        _rec(2, 5, in_step=True, where="a.py:3"),
    ]
    text = _hang.verdict(stuck_in_step, 10)
    assert text.startswith(
        "no progress for 10 s: process 1 has not finished step 5: 30 s in step 5"
    )
    assert "processes 0, 2 wait in step 5" in text
    loader = [
        _rec(0, 4, phase="data", waiting=True, where="t.py:9"),
        _rec(1, 4, phase="data", where="loader.py:41 in next: `q.get()`"),
    ]
    text = _hang.verdict(loader, 10)
    assert "process 1 has not started step 5: 8 s after step 4 (data), at loader.py:41" in text
    assert "process 0 waits after step 4 (data) in a jaxdev cross-process check" in text
    silent = [_rec(0, 5, in_step=True), _rec(1, 3, answers=False, where="t.py:2")]
    expected = (
        "process 1 does not answer (dead, or stuck in C code holding the GIL); its last "
        "heartbeat, 8 s ago: after step 3, at t.py:2"
    )
    assert expected in _hang.verdict(silent, 10)
    end = [_rec(0, 5, where="post.py:3"), _rec(1, 5, state="barrier", where="t.py:9")]
    text = _hang.verdict(end, 10)  # no step 6: process 1 waits in sync_global_devices
    assert "process 0 has not reached the barrier the others wait in: 8 s after step 5" in text
    assert "process 1 waits after step 5 in a barrier, at t.py:9" in text
    first = [_rec(0, None, "compile", in_step=True), _rec(1, None, waiting=True, idle=1.0)]
    text = _hang.verdict(first, 10)  # an eval call compiling before any train step
    assert "process 0 has not finished its first step: 8 s in its first step (compile)" in text


def test_report_puts_the_process_behind_first_and_says_which_stacks_are_missing():
    recs = [_rec(0, 6, where="t.py:9"), _rec(1, 5, answers=False), _rec(2, 6)]
    text = _hang.report(recs, {0: "Thread MainThread A", 2: "Thread MainThread C"}, 6)
    lines = text.splitlines()
    assert lines[0].startswith("jaxdev: hang watchdog: no progress for 6 s: process 1")
    assert "  process 1: after step 5, 8.0 s since its last heartbeat, at ?, its watchdog" in text
    order = [ln for ln in lines if ln.startswith("--- process")]
    assert order == [
        "--- process 1: no stacks (behind): its watchdog did not answer",
        "--- process 0: stacks ---",
        "--- process 2: stacks ---",
    ]


def test_where_names_the_innermost_user_frame_with_its_code(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("import sys\n\ndef load():\n    return sys._getframe()  # the loader\n")
    ns: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    assert _hang.where(ns["load"]()) == "loop.py:4 in load: `return sys._getframe()  # the loader`"


def test_where_and_inside_take_a_frame_without_a_line_number(tmp_path):
    """Python 3.12 gives ``f_lineno=None`` on some frames; ``linecache.getline`` then raised
    TypeError and the watchdog's report was lost."""
    script = tmp_path / "loop.py"
    script.write_text("wait_at_barrier()\n")
    code = SimpleNamespace(co_filename=str(script), co_name="load")
    frame = SimpleNamespace(f_code=code, f_lineno=None, f_back=None)
    assert _hang.where(frame) == "loop.py:? in load"
    assert _hang.inside(frame) == set()


def test_thread_stacks_list_every_thread_main_first():
    ready, done = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (ready.set(), done.wait(10)), name="loader-thread")
    t.start()
    ready.wait(10)
    try:
        text = _hang.thread_stacks()
    finally:
        done.set()
        t.join(10)
    assert text.startswith("Thread MainThread (most recent call last):")
    assert "Thread loader-thread (most recent call last):" in text and "done.wait(10)" in text


def test_beat_costs_nothing_when_the_watchdog_is_off():
    assert _hang._WATCH is None
    start = time.perf_counter()
    for _ in range(100_000):
        _hang.beat("data")
    assert (time.perf_counter() - start) / 100_000 < 2e-6  # one global check (~50 ns)


# --- a watchdog over an in-memory key-value store -------------------------------------


class FakeStore:
    """The three calls of the coordination client the watchdog uses."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.kv and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def _peer(store, process, step, phase="step", idle=0.0, pub=1, state="host", **kw):
    rec = {
        "process": process,
        "pub": pub,
        "seq": step,
        "phase": phase,
        "state": state,
        "step": step,
        "idle": idle,
        "quiet": idle,
        "where": "peer.py:1",
        "in_step": False,
        "waiting": False,
        **kw,
    }
    store.key_value_set(f"jaxdev/hang/beat/{process}", json.dumps(rec), True)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(_hang, "_GATHER_S", 0.3)
    monkeypatch.setattr(_hang, "_ACK_S", 0.3)


def test_watchdog_reports_and_exits_once_no_process_progressed(fast, capfd, caplog, monkeypatch):
    monkeypatch.setattr(_hang, "inside", lambda frame: frozenset({"step"}))  # in a step call
    store, exits = FakeStore(), []
    watch = _hang._Watchdog(store, 0, 5.0, "exit", exits.append)
    watch.record("data", 4)
    _peer(store, 1, 4, "data", idle=1.0)
    watch._tick()  # everyone recent: nothing happens
    assert exits == [] and "jaxdev/hang/beat/0" in store.kv
    watch.last = (7, "step", 5, time.monotonic() - 6.0, MAIN)  # process 0 waits in step 5 since 6 s
    _peer(store, 1, 4, "data", idle=6.5, pub=2)
    watch._tick()
    assert len(exits) == 1
    assert exits[0].startswith("jaxdev: hang watchdog: no progress for 5 s: process 1 has not")
    assert "started step 5" in exits[0] and exits[0].endswith(
        "(`hang_action`='exit'; 'wait' keeps it running)."
    )
    err = capfd.readouterr().err
    assert "jaxdev: hang watchdog: process 0 stacks (in step 5, 6 s since" in err
    assert "test_watchdog_reports_and_exits_once_no_process_progressed" in err  # its own stack
    assert "--- process 1: no stacks (behind): its watchdog did not answer" in err
    logged = caplog.text  # the report goes to the jaxdev logger too
    assert "process 0 stacks (in step 5" in logged and "--- process 1: no stacks" in logged
    assert {"jaxdev/hang/fired/0", "jaxdev/hang/reported/0", "jaxdev/hang/ack/0/0"} <= set(store.kv)


def _stack(*files):
    """A fake stack of frames in ``files`` (outermost first); returns the innermost."""
    frame = None
    for name in files:
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=name), f_lineno=1, f_back=frame)
    return frame


def test_inside_tags_jax_compiling_other_jax_code_and_jaxdev_files():
    jax_dir, own = _hang._JAX[0], _hang._PACKAGE
    compiling = _stack("train.py", own + "train/_step.py", jax_dir + "_src/compiler.py")
    assert _hang.inside(compiling) == {"step", "compile"}
    assert _hang.inside(_stack("train.py", jax_dir + "_src/interpreters/mlir.py")) == {"compile"}
    assert _hang.inside(_stack("train.py", jax_dir + "_src/api.py")) == {"jax"}  # a wait
    assert _hang.inside(_stack("train.py", own + "_multihost.py")) == {"check"}
    assert _hang.inside(_stack(own + "checkpoint/_checkpoint.py", "orbax.py")) == {"checkpoint"}
    assert _hang.inside(_stack("train.py", "loader.py")) == set()
    end = _stack("train.py", jax_dir + "experimental/multihost_utils.py", jax_dir + "_src/api.py")
    assert _hang.inside(end) == {"barrier", "jax"}  # sync_global_devices, process_allgather


def test_inside_tags_a_call_of_the_coordination_services_wait_at_barrier():
    class Client:
        def wait_at_barrier(self, name, timeout_ms):
            return _hang.inside(sys._getframe(1))  # the caller, blocked in this call

    assert Client().wait_at_barrier("end", 1000) == {"barrier"}
    assert _hang.inside(sys._getframe()) == set()  # the same function on another line


@pytest.mark.parametrize(
    ("phase", "tags", "state"),
    [
        ("start", {"jax"}, "start"),  # before the first heartbeat, whatever it does
        ("finished", {"check"}, "finished"),  # in the shutdown barrier
        ("compile", {"step"}, "compile"),  # a jaxdev step's first call
        ("compile", {"step", "check"}, "step"),  # ... waiting for the others' compile check
        ("step", {"step", "compile"}, "compile"),  # a later call compiles (a new shape)
        ("data", {"compile"}, "compile"),  # your own jitted function compiles
        ("checkpoint", {"checkpoint", "jax"}, "checkpoint"),
        ("step", {"step"}, "step"),
        ("eval", {"step"}, "step"),
        ("data", {"check"}, "step"),  # a cross-process check waits for the others
        ("data", {"jax"}, "step"),  # jax.block_until_ready, a fetch
        ("step", {"barrier", "jax"}, "barrier"),  # sync_global_devices after the last step
        ("step", {"barrier", "compile"}, "compile"),  # ... its first call compiles
        ("data", {"check", "barrier", "jax"}, "step"),  # a jaxdev check built on process_allgather
        ("step", set(), "host"),  # the step call returned: your code runs
        ("checkpoint", set(), "host"),  # the save returned
        ("data", set(), "host"),
    ],
)
def test_state_of_a_process(phase, tags, state):
    assert _hang.state_of(phase, frozenset(tags)) == state


def _in(state, quiet, **kw):
    return {"state": state, "quiet": quiet, **kw}


@pytest.mark.parametrize(
    ("records", "fires"),
    [  # S = 10: each state's allowance, the no-alarm case beside the alarm
        pytest.param([_in("start", 90), _in("step", 90)], False, id="start-up<10S"),
        pytest.param([_in("start", 101), _in("step", 101)], True, id="start-up>10S"),
        pytest.param([_in("compile", 90), _in("step", 90)], False, id="compile<10S"),
        pytest.param([_in("compile", 101), _in("compile", 101)], True, id="compile>10S"),
        pytest.param([_in("checkpoint", 90), _in("step", 90)], False, id="checkpoint<10S"),
        pytest.param([_in("checkpoint", 101), _in("step", 101)], True, id="checkpoint>10S"),
        pytest.param([_in("step", 9), _in("step", 30)], False, id="step<S"),
        pytest.param([_in("step", 11), _in("step", 11)], True, id="step>S"),
        pytest.param([_in("host", 11), _in("step", 11)], True, id="host>S-the-others-wait"),
        pytest.param([_in("host", 5), _in("step", 30)], False, id="host<S-the-others-wait"),
        pytest.param([_in("host", 25), _in("barrier", 25)], False, id="host<10S-at-a-barrier"),
        pytest.param([_in("host", 101), _in("barrier", 101)], True, id="host>10S-at-a-barrier"),
        pytest.param([_in("barrier", 101), _in("finished", 9)], True, id="barrier>10S-finished"),
        pytest.param([_in("host", 999), _in("host", 999)], False, id="host-everywhere"),
        pytest.param([_in("host", 999), _in("finished", 999)], False, id="host-after-finished"),
        pytest.param([_in("step", 11), _in("finished", 999)], True, id="step>S-after-finished"),
        pytest.param([_in("finished", 999), _in("finished", 999)], False, id="all-finished"),
        pytest.param([_in("host", 20, answers=False), _in("step", 11)], True, id="silent-host"),
        pytest.param([_in("step", 20, answers=False), _in("host", 20)], True, id="silent-step"),
        pytest.param([_in("compile", 11, answers=False), _in("step", 11)], True, id="dead>S"),
        pytest.param([_in("compile", 9, answers=False), _in("step", 11)], False, id="dead<S"),
    ],
)
def test_the_model_fires_only_when_no_state_is_within_its_allowance(records, fires):
    assert _hang.stalled(records, 10.0) is fires


A, B = object(), object()  # two frames of the main thread


@pytest.mark.parametrize(
    ("before", "now", "progress"),
    [  # samples (heartbeat seq, state, innermost frame, its instruction)
        pytest.param((1, "step", A, 8), (1, "step", A, 8), False, id="blocked-in-a-collective"),
        pytest.param((1, "barrier", A, 8), (1, "barrier", A, 8), False, id="blocked-at-a-barrier"),
        pytest.param((1, "step", A, 8), (1, "step", B, 8), True, id="a-new-call-own-jit-loop"),
        pytest.param((1, "step", A, 8), (1, "step", A, 12), True, id="another-instruction"),
        pytest.param((1, "compile", A, 8), (1, "compile", B, 8), True, id="tracing"),
        pytest.param((1, "host", A, 8), (1, "host", B, 12), False, id="host-work-moving"),
        pytest.param((1, "host", A, 8), (2, "host", A, 8), True, id="a-heartbeat"),
        pytest.param((1, "host", A, 8), (1, "step", A, 8), True, id="a-new-state"),
    ],
)
def test_progress_is_a_heartbeat_a_new_state_or_moving_in_jax_code(before, now, progress):
    assert _hang.progressed(before, now) is progress


def test_a_later_call_that_compiles_counts_as_compile():
    watch = _hang._Watchdog(FakeStore(), 0, 5.0, "exit", pytest.fail)
    watch.last = (4, "step", 3, time.monotonic() - 30.0, MAIN)  # step 3's call, not its first
    seen = []

    def traced(x):  # a new shape: the same step traces and compiles again
        seen.append(watch._heartbeat())
        return x

    jax.jit(traced)(jnp.ones(3))
    rec, waits = seen[0], {"state": "step", "quiet": 30.0}  # the other process waits in it
    assert rec["state"] == "compile" and rec["quiet"] == pytest.approx(30.0, abs=1.0)
    assert not _hang.stalled([rec, waits], 5.0)  # a compile has 10 * S
    assert _hang.stalled([{**rec, "quiet": 51.0}, waits], 5.0)
    after = watch._heartbeat()  # the compile ended: a new state is progress
    assert after["state"] == "host" and after["quiet"] < 1.0


def test_a_new_state_is_published_at_once_not_an_interval_later():
    """A process that holds the GIL in C right after some steps (a big pickle.dumps) can
    publish nothing more: it was reported from a publication up to an interval (S / 10, up
    to 5 s) older than its last steps ('in step 2 (compile)' after step 4)."""
    store = FakeStore()
    watch = _hang._Watchdog(store, 0, 50.0, "exit", pytest.fail)  # an interval of 5 s
    published = lambda: json.loads(store.kv.get("jaxdev/hang/beat/0", "{}"))  # noqa: E731
    watch.thread.start()
    try:
        deadline = time.monotonic() + 10
        while published().get("phase") != "start" and time.monotonic() < deadline:
            time.sleep(0.01)  # its first publication
        watch.record("step", 4)  # step 4's call, returned: host work now
        deadline = time.monotonic() + 2
        while published().get("step") != 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watch.stopped.set()
        watch.thread.join(10)
    assert (published().get("step"), published().get("state")) == (4, "host"), published()


def test_host_work_after_the_last_step_is_not_a_hang_while_the_others_finished(fast):
    store = FakeStore()
    watch = _hang._Watchdog(store, 0, 5.0, "exit", pytest.fail)
    watch.last = (9, "step", 8, time.monotonic() - 15.0, MAIN)  # 15 s of host work after step 8
    _peer(store, 1, 8, "finished", idle=15.0, state="finished")  # in its shutdown barrier
    watch._tick()
    _peer(store, 1, 8, "data", idle=15.0, pub=2)  # uneven: host work there too, nobody waits
    watch._tick()
    assert watch._heartbeat()["state"] == "host" and "jaxdev/hang/fired/0" not in store.kv


def test_wait_action_reports_then_rearms_after_progress(fast, capfd, monkeypatch):
    monkeypatch.setattr(_hang, "inside", lambda frame: frozenset({"step"}))  # in a step call
    store, exits = FakeStore(), []
    watch = _hang._Watchdog(store, 0, 5.0, "wait", exits.append)
    watch.last = (3, "step", 2, time.monotonic() - 6.0, MAIN)
    watch._tick()
    assert exits == [] and watch.resume_after == {0: 3}
    assert "(`hang_action`='wait': process 0 keeps waiting)" in capfd.readouterr().err
    watch._tick()  # no progress: no second report
    assert watch.incident == 0
    watch.record("step", 3)
    watch._tick()
    assert (watch.incident, watch.resume_after) == (1, None)


def test_a_finished_process_is_never_behind_and_all_finished_never_fires(fast):
    store = FakeStore()
    watch = _hang._Watchdog(store, 0, 5.0, "exit", pytest.fail)
    watch.last = (9, "finished", 8, time.monotonic() - 60.0, MAIN)
    _peer(store, 1, 8, "finished", idle=60.0, state="finished")
    watch._tick()
    assert "jaxdev/hang/fired/0" not in store.kv


@pytest.mark.parametrize("case", ["compile", "checkpoint", "input", "eval", "stalled input"])
def test_the_running_thread_fires_only_for_a_stall_while_the_other_waits_in_a_step(
    case, fast, monkeypatch, capfd
):
    """The thread as it runs (a look every 0.05 s, a new state published at once, a round
    every 0.5 s), S = 1 s, for 2.5 S while process 1 waits in a step all along: a slow
    compile, a long checkpoint save and input with a heartbeat every 0.2 S raise no alarm;
    input with no heartbeat does. An evaluation loop of your own jit on every process (host
    work there too, no heartbeat) raises none."""
    store, exits, stop = FakeStore(), [], threading.Event()
    watch = _hang._Watchdog(store, 0, 1.0, "wait", exits.append)
    monkeypatch.setattr(_hang, "_WATCH", watch)
    if case in ("compile", "checkpoint"):
        monkeypatch.setattr(_hang, "inside", lambda frame: frozenset({case}))
    start = time.monotonic()

    def peer():  # process 1: answering, waiting in step 5 (or in its own eval) since the start
        waits = dict(state="step", in_step=True) if case != "eval" else dict(state="host")
        for pub in range(1, 10**6):
            if stop.wait(0.05):
                return
            _peer(store, 1, 4, idle=time.monotonic() - start, pub=pub, **waits)

    threads = [threading.Thread(target=peer), watch.thread]
    watch.record("compile" if case == "compile" else "step", 4)
    for t in threads:
        t.start()
    try:
        f, x = jax.jit(lambda x: jnp.tanh(x @ x)), jnp.ones((64, 64))
        while time.monotonic() - start < 2.5 and not exits:
            if case == "input":
                _hang.beat("data", 4)
            elif case == "eval":
                x = f(x).block_until_ready()
                continue
            time.sleep(0.2)
    finally:
        stop.set(), watch.stopped.set()
        for t in threads:
            t.join(10)
    fired = "jaxdev/hang/fired/0" in store.kv
    assert fired is (case == "stalled input"), (case, capfd.readouterr().err[-2000:])


# --- stacks on demand ---------------------------------------------------------------


_SIGNALLED = """
    import signal, sys, time
    from jaxdev.distributed._hang import install_stack_dumps
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))  # yours: runs after the dump
    install_stack_dumps()
    def waiting_for_data():
        print("ready", flush=True)
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
    waiting_for_data()
    print("still running" if got else "no signal", flush=True)
"""


@pytest.mark.timeout(60)
def test_sigusr1_prints_every_stack_without_stopping():
    proc = subprocess.Popen(
        [PY, "-c", textwrap.dedent(_SIGNALLED)],
        env=clean_env(JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        os.kill(proc.pid, signal.SIGUSR1)  # this child, by its own pid
        out, err = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "still running\n", err
    assert "Current thread" in err and "in waiting_for_data" in err


@pytest.mark.timeout(60)
def test_launch_forwards_sigusr1_to_every_process():
    launcher = [PY, "-m", "jaxdev", "launch", "-n", "2", "--timeout", "50", "--"]
    proc = subprocess.Popen(
        [*launcher, PY, "-c", textwrap.dedent(_SIGNALLED)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, "the launcher ended before both processes were ready"
            ready += line.endswith("] ready\n")
        os.kill(proc.pid, signal.SIGUSR1)  # the launcher, by its own pid
        out, _ = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    for p in (0, 1):
        assert f"[p{p}] Current thread" in out and f"[p{p}] still running" in out


# --- real processes: 2 x 4 fake CPU devices, all scenarios at once ---------------------


SCENARIOS = {  # plain: JAXDEV_* set by hand, no launcher
    "step": Scenario("launch", "step", 1, S),
    "loader": Scenario("launch", "loader", 1, S),
    "coordinator": Scenario("launch", "step", 0, S),
    "healthy": Scenario("launch", "healthy", 1, S),
    "end": Scenario("launch", "end", 1, S),
    "kill": Scenario("launch", "kill", 1, S),
    "plain_step": Scenario("plain", "step", 1, S),
    "plain_kill": Scenario("plain", "kill", 1, S),
    "extra": Scenario("launch", "extra", 1, S),
    "gil": Scenario("launch", "gil", 1, S),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    """Every scenario, started at once; each process ended by its own pid after the deadline."""
    return run_all(SCENARIOS, DEADLINE_S)


def _show(runs: dict[str, Run], name: str) -> Run:
    """Print a run's timing (``-s`` shows it) and output (shown on failure); return it."""
    run = runs[name]
    stall = f", ended {run.after_stall():.1f} s after the stall" if "STALL" in run.output else ""
    print(f"TIMING {name}: {run.ended - run.started:.1f} s from start to end{stall}")
    print(run.output)
    return run


STALLS = [("step", 1), ("loader", 1), ("coordinator", 0), ("plain_step", 1)]


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize(("name", "culprit"), STALLS)
def test_a_stalled_process_is_named_with_its_step_and_stack(runs, name, culprit):
    run = _show(runs, name)
    assert all(code != 0 for code in run.returncodes), run.returncodes
    assert f"process {culprit} has not started step 5" in run.output
    stacks = run.output.split(f"--- process {culprit}: stacks (behind) ---", 1)[1]
    sleeping = "# the loader hangs" if name == "loader" else "# the stalled process"
    assert f"time.sleep(120)  {sleeping}" in stacks.split("--- process", 1)[0]
    other = 1 - culprit
    assert f"process {other} waits" in run.output
    assert f"jaxdev: hang watchdog: process {culprit} stacks" in run.output  # its own dump
    assert run.after_stall() < S + 20, f"{run.after_stall():.1f} s after the stall"
    assert "DONE" not in run.output
    if name != "plain_step":  # the launcher's summary quotes the watchdog's verdict
        summary = run.output.split("jaxdev launch: process", 1)[1]
        assert f"process {culprit} has not started step 5" in summary


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize(("name", "lasts"), [("healthy", 4.5), ("end", 3)])
def test_no_alarm_in_a_healthy_run(runs, name, lasts):
    """healthy: 1.25 S compiles, a recompile, uneven steps, 2 S of post-processing at the end;
    end: 1.5 S of your own jit in a loop, 1.5 S of post-processing before JAX's end barrier."""
    run = _show(runs, name)
    assert run.returncodes == [0], run.returncodes
    assert run.output.count("DONE") == 2 and "hang watchdog" not in run.output
    assert "[p0] step 5 done" in run.output and "[p1] step 5 done" in run.output
    assert run.ended - run.started > lasts * S  # the phases really lasted that long


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 60)
def test_a_killed_process_is_still_named_under_the_launcher(runs):
    run = _show(runs, "kill")
    assert run.returncodes == [137], run.returncodes
    assert "jaxdev launch: process 1 failed (signal SIGKILL)" in run.output
    assert run.after_stall() < 10


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 60)
def test_a_killed_process_is_named_by_the_watchdog_without_a_launcher(runs):
    run = _show(runs, "plain_kill")
    assert run.returncodes == [1, -signal.SIGKILL], run.returncodes
    assert "process 1 does not answer (dead, or stuck in C code holding the GIL)" in run.output
    assert run.after_stall() < S + 20, f"{run.after_stall():.1f} s after the stall"


def _verdict_line(run: Run) -> str:
    return next(ln for ln in run.output.splitlines() if "jaxdev: hang watchdog: no progress" in ln)


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 60)
def test_a_collective_only_one_process_runs_names_that_process(runs):
    """Process 1 logs a metric of the global batch after step 4 (a collective process 0
    never joins); process 0 waits in its batch check for step 5. It named process 0."""
    run = _show(runs, "extra")
    line = _verdict_line(run)
    assert "no progress for 6 s: process 1 has not started step 5: " in line, line
    assert "# a collective no other joins`; process 0 waits after step 4 (data) in a " in line
    assert run.after_stall() < S + 20, f"{run.after_stall():.1f} s after the stall"


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 60)
def test_a_process_holding_the_gil_is_reported_in_the_state_it_is_in(runs):
    """After step 4 and 0.3 s of host work, process 1 holds the GIL in C: its watchdog cannot
    answer, and its last publication is its state. It said 'in step 1 (compile)'."""
    run = _show(runs, "gil")
    line = _verdict_line(run)
    said = re.search(r"process 1 does not answer \(dead, or stuck in C code holding the GIL\); "
                     r"its last heartbeat, \d+ s ago: (.+?), at hang\.py:\d+ in (\w+)", line)
    assert said and said.groups() == ("after step 4", "hold_gil"), line
    assert run.after_stall() < S + 20, f"{run.after_stall():.1f} s after the stall"


def test_starting_the_watchdog_without_a_coordination_client_is_refused():
    """A watchdog with no client would log an AttributeError once and never fire."""
    with pytest.raises(jaxdev.DistributedError, match="has no client"):
        _hang.start(5.0, "exit", lambda why: None)
    assert _hang._WATCH is None
