"""Tests for jaxdev._guards: host-sync, transfer and compile counting."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python
from jax._src.array import ArrayImpl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import (
    GuardError,
    UsageError,
    _guards,
    count_transfers,
    no_host_sync,
)
from jaxdev.metrics import Mean


@pytest.fixture
def x():
    out = jnp.arange(4.0)
    jax.block_until_ready(out)
    return out


def _originals():
    return (
        {
            name: ArrayImpl.__dict__[name]
            for name in [*_guards._ARRAY_METHODS, *_guards._ARRAY_WAITS, "_value"]
            if name in ArrayImpl.__dict__
        },
        jax.device_get,
        jax.device_put,
        jax.block_until_ready,
        np.asarray,
        {name: getattr(np, name) for name in (*_guards._NUMPY_FUNCTIONS, *_guards._NUMPY_UFUNCS)},
    )


@contextlib.contextmanager
def _stderr_pipe():
    """Make fd 2 a pipe (the "real stderr" of a block inside); yield its read end.

    Used inside a test body: pytest points fd 2 at its own capture file
    between fixture set-up and the test call.
    """
    read_fd, write_fd = os.pipe()
    saved = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield read_fd
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(read_fd)


def _read_until(fd: int, end: bytes, timeout: float = 10.0) -> bytes:
    """Read ``fd`` until ``end`` arrives, EOF, or ``timeout`` seconds without data."""
    got = b""
    while not got.endswith(end) and select.select([fd], [], [], timeout)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        got += chunk
    return got


# ------------------------------------------------------- device to host


@pytest.mark.parametrize(
    "read, kind",
    [
        (lambda x: float(x[0]), "float()"),
        (lambda x: int(x[1]), "int()"),
        (lambda x: bool(x[1] > 0), "bool()"),
        (lambda x: x[2].item(), ".item()"),
        (lambda x: x.tolist(), ".tolist()"),
        (lambda x: np.asarray(x), "np.asarray"),
        (lambda x: np.array(x), "np.array"),
        (lambda x: np.asarray([x, x]), "np.asarray"),
        (lambda x: jax.device_get(x), "jax.device_get"),
        (lambda x: f"{x[0]:.3f}", "format()"),
        (lambda x: repr(x), "repr()"),
        (lambda x: pickle.dumps(x), "pickle"),
        (lambda x: range(10)[x.astype(int)[1]], "operator.index()"),
        (lambda x: np.copy(x), "np.copy"),
        (lambda x: np.concatenate([x, x]), "np.concatenate"),
        (lambda x: np.stack((x, x)), "np.stack"),
        (lambda x: np.vstack([x, x]), "np.vstack"),
        (lambda x: np.hstack([x, x]), "np.hstack"),
        (lambda x: np.isfinite(x), "np.isfinite"),
        (lambda x: np.isnan(x).any(), "np.isnan"),
        (lambda x: np.isinf(x), "np.isinf"),
    ],
)
def test_each_host_read_counts_once(x, read, kind):
    with count_transfers() as c:
        read(x)
    assert c.device_to_host == 1, c.summary()
    (event,) = [e for e in c.events if e.direction == "device_to_host"]
    assert event.kind == kind
    assert event.where.startswith("test_guards.py:"), event


def test_device_get_of_a_tree_is_one_sync(x):
    tree = {"a": x, "b": [x * 2, x + 1], "c": 3}
    with count_transfers() as c:
        host = jax.device_get(tree)
    assert c.device_to_host == 1 and isinstance(host["b"][0], np.ndarray)
    with count_transfers() as c:
        jax.device_get({"only": np.ones(2), "n": 1})  # host values: nothing moves
    assert c.device_to_host == 0


def test_numpy_on_host_data_is_not_counted():
    with count_transfers() as c:
        np.asarray([1.0, 2.0])
        np.array(np.ones(3))
        np.isfinite(np.ones(2))
        np.concatenate([np.ones(2), np.zeros(1)])
    assert c.device_to_host == 0 and c.host_to_device == 0


def test_numpy_reductions_stay_on_device(x):
    for reduce in (np.sum, np.mean, np.max):
        reduce(x)  # compile outside
    with count_transfers() as c:
        results = [np.sum(x), np.mean(x), np.max(x)]
    assert c.device_to_host == 0 and all(isinstance(r, jax.Array) for r in results)


def test_any_numpy_call_on_a_multi_device_array_counts_through_array(devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    xs = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("data")))
    with count_transfers() as c:
        np.exp(xs)  # numpy converts anything but a single-device CPU array with __array__
        np.allclose(xs, xs)
    assert c.device_to_host == 3 and {e.kind for e in c.events} == {"__array__"}, c.summary()


def test_documented_blind_spots_on_single_device_cpu_arrays(x):
    if x.devices() != {jax.devices("cpu")[0]}:
        pytest.skip("the buffer protocol only reads single-device CPU arrays")
    with count_transfers() as c:
        np.exp(x)
        memoryview(x)
    assert c.device_to_host == 0, "a blind spot is gone: update the _guards docstring"


def test_counted_ufuncs_keep_their_attributes_and_pickle():
    with count_transfers():
        assert np.isfinite.nin == 1 and np.isnan.__name__ == "isnan"
        assert pickle.loads(pickle.dumps(np.isinf)) is np.isinf
        assert "f->?" in np.isnan.types
    assert isinstance(np.isfinite, np.ufunc)


# ----------------------------------------------------------------- waits


def test_waits_are_counted_apart_from_reads(x):
    with count_transfers() as c:
        x.block_until_ready()
        jax.block_until_ready({"a": x, "b": [x * 2, 1.0]})
        jax.block_until_ready(x)  # calls x.block_until_ready() inside: one wait
        jax.block_until_ready({"host": np.ones(2)})  # nothing on device to wait for
    assert (c.waits, c.device_to_host) == (3, 0), c.summary()
    assert [e.kind for e in c.events if e.direction == "wait"] == [
        ".block_until_ready()",
        "jax.block_until_ready",
        "jax.block_until_ready",
    ]
    assert all(e.where.startswith("test_guards.py:") for e in c.events if e.direction == "wait")


def test_wait_budget(x):
    with no_host_sync() as c:  # waits are unlimited by default
        x.block_until_ready()
    assert c.waits == 1
    with pytest.raises(GuardError) as info:
        with no_host_sync(max_waits=0):
            for _ in range(2):
                jax.block_until_ready(x + 1)
    msg = str(info.value)
    assert "2 waits in a block that allows 0 (`max_waits=0`):" in msg
    assert "wait: jax.block_until_ready at test_guards.py:" in msg and "(x2)" in msg


def test_repeated_reads_all_count(x):
    with count_transfers() as c:
        for i in range(5):
            float(x[i % 4])
    assert c.device_to_host == 5
    assert "device_to_host: float() at test_guards.py" in c.summary()
    assert "(x5)" in c.summary()


# ------------------------------------------------------- host to device


def test_device_put_of_host_data_counts_and_of_device_data_does_not(x):
    """A typed PRNG key array (no ``ArrayImpl``) moved between devices counted as a
    host-to-device transfer (helper-53's review)."""
    key = jax.random.key(0)
    with count_transfers() as c:
        jax.device_put(np.ones(3))
        jax.device_put({"a": np.ones(2), "b": 1.0})
        jax.device_put(x, jax.devices()[1])  # device to device: not host
        jax.device_put({"key": key, "x": x}, jax.devices()[2])  # a typed key too
    assert c.host_to_device == 2, c.summary()
    assert {e.kind for e in c.events} == {"jax.device_put"}


def test_implicit_host_to_device_is_counted(x):
    step = jax.jit(lambda a, b: a * b)
    step(x, x)
    with count_transfers() as c:
        step(x, np.ones(4, np.float32))  # numpy argument: implicit transfer
        jnp.asarray(np.zeros(2, np.float32))
    assert c.host_to_device == 2, c.summary()
    kinds = [e.kind for e in c.events if e.direction == "host_to_device"]
    assert kinds == ["implicit float32[4]", "implicit float32[2]"], c.summary()


def test_indexing_with_a_python_int_is_an_implicit_transfer(x):
    x[0]  # compile outside
    with count_transfers() as c:
        x[0]
    assert c.host_to_device == 1 and c.device_to_host == 0, c.summary()


def test_implicit_counting_can_be_turned_off(x):
    with count_transfers(implicit=False) as c:
        jnp.asarray(np.zeros(2, np.float32))
    assert c.host_to_device == 0


def test_other_stderr_output_is_passed_on(capfd, x):
    with count_transfers() as c:
        os.write(2, b"unrelated line\n")
        jnp.asarray(np.zeros(3, np.float32))
    assert c.host_to_device == 1
    err = capfd.readouterr().err
    assert "unrelated line" in err and "host-to-device transfer" not in err


def test_stderr_streams_through_while_the_block_runs(x):
    with _stderr_pipe() as stderr:
        with count_transfers() as c:
            os.write(2, b"epoch 1\n")
            os.write(2, b"\r 50%")  # a progress bar: no newline
            jnp.asarray(np.zeros(3, np.float32))  # its transfer-guard line is counted, not shown
            assert _read_until(stderr, b"50%") == b"epoch 1\n\r 50%"  # before the block ends
            assert c.host_to_device == 1
            os.write(2, b"\r100%\n")
        assert _read_until(stderr, b"\n") == b"\r100%\n"  # and no transfer-guard line


def test_transfer_log_asked_for_before_the_block_is_kept(x):
    with _stderr_pipe() as stderr, jax.transfer_guard_host_to_device("log"):
        with count_transfers() as c:
            jnp.asarray(np.zeros(2, np.float32))
            assert c.host_to_device == 1
        assert b"host-to-device transfer:" in _read_until(stderr, b"\n")


def test_stderr_written_before_a_hard_crash_in_the_block_is_not_lost():
    proc = run_python(
        """
        import os, signal, sys, time
        import jaxdev
        with jaxdev.count_transfers():
            sys.stderr.write("last words\\n")
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert proc.returncode == -signal.SIGKILL
    assert "last words" in proc.stderr


_CRASH_IN_BLOCK = """
    import ctypes, faulthandler, os, sys
    import jax.numpy as jnp, numpy as np
    import jaxdev
    faulthandler.enable()
    with jaxdev.count_transfers() as c:
        jnp.asarray(np.zeros(2, np.float32))  # its transfer-guard log line is left out
        print("last words 1", file=sys.stderr)
        os.write(2, b"last words 2, from C\\n")
        CRASH
"""


@pytest.mark.parametrize(
    ("crash", "returncode", "report"),
    [
        ("ctypes.string_at(0)", -signal.SIGSEGV, "Fatal Python error: Segmentation fault"),
        ("os.abort()", -signal.SIGABRT, "Fatal Python error: Aborted"),
        ("os._exit(3)", 3, None),
    ],
)
def test_a_crash_inside_the_block_keeps_its_last_words(crash, returncode, report):
    proc = run_python(_CRASH_IN_BLOCK.replace("CRASH", crash), {"JAX_PLATFORMS": "cpu"})
    assert proc.returncode == returncode, proc.stderr
    assert "last words 1\nlast words 2, from C\n" in proc.stderr
    if report:  # faulthandler's report, with the line that crashed
        assert report in proc.stderr and 'File "<string>", line 10 in <module>' in proc.stderr
    assert "host-to-device transfer" not in proc.stderr


def test_stderr_comes_back_when_the_relay_process_dies(x):
    with _stderr_pipe() as stderr:
        with count_transfers() as c:
            relay = _guards._tap.process
            assert relay is not None  # a relay process, not the thread fallback
            os.kill(relay.pid, signal.SIGKILL)  # the relay jaxdev started, by its own pid
            relay.wait(timeout=30)
            for _ in range(500):  # its reaper gives fd 2 back
                if os.path.samestat(os.fstat(2), os.fstat(_guards._tap.saved)):
                    break
                time.sleep(0.01)
            os.write(2, b"after the relay\n")
            assert _read_until(stderr, b"relay\n") == b"after the relay\n"
            float(x[0])
        assert c.device_to_host == 1


def test_a_thread_relays_where_no_process_can_start(monkeypatch, x):
    monkeypatch.setattr(sys, "executable", "")  # as in an embedded Python
    with _stderr_pipe() as stderr:
        with count_transfers() as c:
            assert _guards._tap.process is None  # the thread relays
            os.write(2, b"line\n")
            jnp.asarray(np.zeros(3, np.float32))
            assert _read_until(stderr, b"line\n") == b"line\n"
        assert c.host_to_device == 1
    assert _guards._tap.users == 0 and _guards._tap.reports.closed


def test_stderr_of_a_child_process_started_in_the_block_still_arrives():
    late = "import sys, time; time.sleep(0.3); sys.stderr.write('late\\n')"
    with _stderr_pipe() as stderr:
        with count_transfers():
            child = subprocess.Popen([sys.executable, "-c", late])
        assert child.wait(timeout=60) == 0
        assert _read_until(stderr, b"late\n") == b"late\n"


def test_a_stricter_transfer_guard_is_left_in_force(x):
    with jax.transfer_guard_host_to_device("disallow"):
        with count_transfers():
            with pytest.raises(Exception, match="Disallowed host-to-device"):
                jnp.asarray(np.zeros(2, np.float32))


# ------------------------------------------------------------- jitted loop


def test_pure_jitted_loop_on_device_has_zero_syncs(x):
    @jax.jit
    def step(carry, metrics):
        carry = carry * 0.9 + 0.1
        return carry, metrics.merge(Mean.from_value(carry))

    carry, metrics = step(x, Mean.empty())
    with no_host_sync(max_host_to_device=0, max_compiles=0, max_traces=0) as c:
        for _ in range(50):
            carry, metrics = step(carry, metrics)
    assert (c.device_to_host, c.host_to_device, c.compiles, c.traces) == (0, 0, 0, 0)
    with count_transfers() as c:
        value = metrics.fetch()
    assert c.device_to_host == 1 and value > 0


def test_float_loss_loop_is_caught_with_call_site(x):
    step = jax.jit(lambda a: (a * 0.5, jnp.sum(a)))
    step(x)
    with pytest.raises(GuardError) as info:
        with no_host_sync():
            for _ in range(3):
                x, loss = step(x)
                float(loss)
    msg = str(info.value)
    assert "3 device-to-host syncs in a block that allows 0 (`max_device_to_host=0`)" in msg
    assert "float() at test_guards.py:" in msg and "(x3)" in msg


# ------------------------------------------------------------ compiles


def test_compile_counter_sees_retrace_on_new_shape_only():
    f = jax.jit(lambda a: jnp.tanh(a) * 2)
    f(jnp.ones(3))
    with count_transfers() as same:
        f(jnp.ones(3))
        f(jnp.zeros(3))
    assert same.compiles == 0 and same.traces == 0
    new_shape = jnp.ones(5)
    with count_transfers() as changed:
        f(new_shape)
    assert changed.compiles == 1 and changed.traces == 1, changed.summary()
    assert any(e.kind == "jit(<lambda>)" for e in changed.events)


def test_compile_budget_raises():
    f = jax.jit(lambda a: a + 1)
    new_shape = jnp.ones(7)
    with pytest.raises(GuardError, match=r"1 compile in a block that allows 0 .*\n.*compile: jit"):
        with no_host_sync(max_compiles=0):
            f(new_shape)


# ------------------------------------------------- restore, nest, errors


def test_patches_are_restored_after_normal_exit_and_exceptions(x):
    before = _originals()
    with count_transfers():
        assert np.asarray is not before[4]
    assert _originals() == before
    with pytest.raises(ZeroDivisionError):
        with count_transfers():
            _ = 1 / 0
    assert _originals() == before
    with pytest.raises(GuardError):
        with no_host_sync():
            float(x[0])
    assert _originals() == before
    assert not _guards._active and not _guards._undo and _guards._tap.users == 0


def test_block_exception_is_not_masked_by_budget(x):
    with pytest.raises(KeyError):
        with no_host_sync():
            float(x[0])
            raise KeyError("boom")


def test_nested_counters_each_see_their_own_block(x):
    before = _originals()
    total = jnp.sum(x)  # (indexing `x[0]` would itself be an implicit transfer)
    with count_transfers() as outer:
        float(total)
        with count_transfers() as inner:
            x.tolist()
            jax.device_put(np.ones(1))
        assert _originals() != before  # outer still active
        np.asarray(x)
    assert (inner.device_to_host, inner.host_to_device) == (1, 1)
    assert (outer.device_to_host, outer.host_to_device) == (3, 1)
    assert _originals() == before


def test_counter_is_readable_during_the_block(x):
    total = jnp.sum(x)
    with count_transfers() as c:
        float(total)
        assert c.device_to_host == 1
        jnp.asarray(np.ones(2, np.float32))
        assert c.host_to_device == 1
    assert "TransferCounter(device_to_host=1, host_to_device=1, waits=0" in repr(c)


def test_bad_budgets_name_the_argument():
    with pytest.raises(UsageError, match="`max_compiles` to be None .* got -1"):
        with no_host_sync(max_compiles=-1):
            pass
    with pytest.raises(UsageError, match="`max_device_to_host` .* got 'zero'"):
        with no_host_sync(max_device_to_host="zero"):
            pass
    assert issubclass(GuardError, jaxdev.JaxdevError) and issubclass(GuardError, AssertionError)


_FORK_WHILE_HELD = """
import os, signal, threading, time, warnings
import jaxdev
from jaxdev import _guards

held, release = threading.Event(), threading.Event()

def hold_lock():  # a drain holding the guards' lock
    with _guards._lock:
        held.set()
        release.wait(30)

with jaxdev.count_transfers():
    relay = _guards._tap.process
    if HOLD == "lock":
        holder = threading.Thread(target=hold_lock)
        holder.start()
        held.wait(30)
    else:  # a drain waiting in the reports for the relay's answer (the relay stopped)
        os.kill(relay.pid, signal.SIGSTOP)
        holder = threading.Thread(target=_guards._drain_implicit)
        holder.start()
        time.sleep(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fork() in a threaded process
        pid = os.fork()
    if pid == 0:
        warnings.simplefilter("error")
        with jaxdev.count_transfers() as c:
            pass
        os._exit(0 if c.host_to_device == c.device_to_host == 0 else 3)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    if HOLD == "lock":
        release.set()
    else:
        os.kill(relay.pid, signal.SIGCONT)
    holder.join(30)
print("child", "hung" if done[0] == 0 else os.waitstatus_to_exitcode(done[1]))
"""


@pytest.mark.parametrize("hold", ["lock", "reports"])
def test_a_child_forked_while_a_thread_holds_the_guards_counts_on_its_own(hold):
    # a fork while another thread drains, holding _guards._lock ("lock") or waiting in the
    # relay's reports ("reports"): the child's counter (and its fork hook) must neither hang
    # on what the parent's thread holds nor warn about the parent's files
    proc = run_python(_FORK_WHILE_HELD.replace("HOLD", repr(hold)), {"JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "child 0" in proc.stdout, (proc.stdout, proc.stderr)
