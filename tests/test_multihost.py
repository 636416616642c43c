"""Multi-process: distributed initialize, checked global batches, the launcher,
divergent processes (never joined, extra collective, different programs).

Pure helpers and the launcher's process handling are tested in-process; the
multi-host scenarios start REAL processes on 127.0.0.1 (2 processes x 4 fake
CPU devices, see ``tests/mp_scripts``) with 10 s timeouts, and each must end
within its configured timeout + 10 s, non-zero, with a message naming what
failed and which process.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxdev
from jaxdev import _multihost
from jaxdev.distributed import _distributed, _fingerprint, _launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_scripts"))
import matrix  # noqa: E402

pytestmark = pytest.mark.multiprocess

SCENARIOS = {s.name: s for s in matrix.SCENARIOS}


# --- configuration and pure checks -------------------------------------------------


def test_resolve_config_reads_launcher_env_and_arguments_win():
    env = {
        "JAXDEV_COORDINATOR": "127.0.0.1:1234",
        "JAXDEV_NUM_PROCESSES": "2",
        "JAXDEV_PROCESS_ID": "1",
        "JAXDEV_LOCAL_DEVICES": "4",
        "JAXDEV_INIT_TIMEOUT": "7",
    }
    cfg = _distributed.resolve_config(env=env)
    assert cfg == _distributed.DistributedConfig("127.0.0.1:1234", 2, 1, 4, 7, 30, 30)
    cfg = _distributed.resolve_config(process_id=0, local_device_count=2, env=env)
    assert (cfg.process_id, cfg.local_device_count) == (0, 2)
    env["JAXDEV_SHUTDOWN_TIMEOUT"] = "9"
    assert _distributed.resolve_config(env=env).shutdown_timeout_s == 9
    assert _distributed.resolve_config(env=env, shutdown_timeout_s=3).shutdown_timeout_s == 3


def test_resolve_config_leaves_unknowns_to_cluster_auto_detection():
    cfg = _distributed.resolve_config(env={})
    assert cfg[:4] == (None, None, None, None)
    assert (cfg.init_timeout_s, cfg.heartbeat_timeout_s) == (60, 30)


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        ({}, {"JAXDEV_PROCESS_ID": "one"}, "`JAXDEV_PROCESS_ID` must be an integer >= 0"),
        ({}, {"JAXDEV_NUM_PROCESSES": "0"}, "`JAXDEV_NUM_PROCESSES` must be an integer >= 1"),
        ({"num_processes": 2, "process_id": 2}, {}, r"`process_id` must be in \[0, 2\)"),
        ({"process_id": -1}, {}, "`process_id` must be an int >= 0"),
        ({"timeout_s": 0}, {}, "`timeout_s` must be an int >= 1"),
    ],
)
def test_resolve_config_rejects_bad_values(kwargs, env, match):
    with pytest.raises(jaxdev.DistributedError, match=match):
        _distributed.resolve_config(env=env, **kwargs)


def test_public_module_exposes_only_the_multi_process_api():
    public = set(jaxdev.distributed.__all__)  # the names after it are for sibling subsystems
    assert public == {
        "DistributedConfig",
        "assert_same_across_processes",
        "check_same_program",
        "heartbeat",
        "initialize",
        "is_initialized",
        "launch",
        "same_program",
        "shutdown",
    }


def test_split_address_requires_host_and_port():
    assert _distributed.split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(jaxdev.DistributedError, match="`coordinator_address` must look like"):
        _distributed.split_address("localhost")


def test_check_local_device_counts_names_every_process():
    _distributed.check_local_device_counts([0] * 4 + [1] * 4, 2)
    with pytest.raises(jaxdev.DistributedError, match="process 0: 4, process 1: 2, process 2: 0"):
        _distributed.check_local_device_counts([0] * 4 + [1] * 2, 3)


def test_initialize_refuses_after_the_backend_started():
    jax.devices()  # conftest's 8 CPU devices: the backend is up
    with pytest.raises(jaxdev.DistributedError, match="must run before anything starts"):
        jaxdev.distributed.initialize("127.0.0.1:1", 2, 1)
    assert not jaxdev.distributed.is_initialized()


@pytest.mark.timeout(20)
def test_wait_for_coordinator_gives_up_in_bounded_time():
    address = f"127.0.0.1:{_launch.free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(jaxdev.DistributedError, match=r"process 1 could not reach .* within 1 s"):
        _distributed.wait_for_coordinator(address, 1.0, process_id=1)
    assert time.monotonic() - start < 3.0


def test_wait_for_coordinator_connects_to_a_listener():
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert _distributed.wait_for_coordinator(address, 5.0) < 5.0


def test_check_port_free_reports_a_duplicate_process_zero():
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(jaxdev.DistributedError, match="duplicate `process_id` 0"):
            _distributed.check_port_free(address)


def test_compare_leaf_tables_names_leaves_and_processes():
    tables = [
        {"['x']": "(4,)", "['y']": "(4,)"},
        {"['x']": "(6,)", "['y']": "(4,)"},
        {"['x']": "(4,)"},
    ]
    assert _multihost.compare_leaf_tables(tables) == [
        "['x']: process 0, 2: (4,); process 1: (6,)",
        "['y']: process 0, 1: (4,); process 2: <missing>",
    ]
    assert _multihost.compare_leaf_tables([{"a": "1"}, {"a": "1"}]) == []


def test_leaf_checksum_changes_with_value_not_with_placement(devices):
    x = np.arange(6, dtype=np.float32)
    assert _multihost.leaf_checksum(x) == _multihost.leaf_checksum(jax.device_put(x, devices[3]))
    assert _multihost.leaf_checksum(x) != _multihost.leaf_checksum(x + 1)
    assert _multihost.leaf_checksum(x) != _multihost.leaf_checksum(x.astype(np.float64))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_pass_every_cross_process_description(monkeypatch, impl):
    keys = jax.random.split(jax.random.key(0, impl=impl), 8)
    kind = str(keys.dtype)  # key<fry> / key<rbg>: no numpy dtype
    sent = []

    def echo(tag, payload, timeout_s=None):  # two processes that agree
        sent.append(payload)
        return [payload, payload]

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_multihost, "kv_client", lambda: object())
    monkeypatch.setattr(_multihost, "exchange", echo)
    monkeypatch.setattr(_fingerprint, "exchange", echo)
    monkeypatch.setattr(_fingerprint, "spans_processes", lambda *a: True)
    assert _multihost._differences("b", {"k": keys}, _multihost.shape_dtype, None) == []  # batch
    jaxdev.distributed.assert_same_across_processes({"k": keys, "one": keys[0]})
    assert jaxdev.distributed.check_same_program(jax.jit(jax.random.key_data), keys)
    assert len(sent) == 3 and all(f"(8,) {kind}" in p for p in sent)
    other = jax.random.split(jax.random.key(1, impl=impl), 8)
    assert _multihost.leaf_checksum(keys) != _multihost.leaf_checksum(other)  # by key_data


# --- single process: cheap, no communication ----------------------------------------


def test_single_process_checks_skip_the_exchange(monkeypatch, devices):
    def no_client():
        raise AssertionError("a single process must not talk to a coordinator")

    monkeypatch.setattr(_multihost, "kv_client", no_client)
    assert _multihost.exchange("t", "payload") == ["payload"]
    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    assert _multihost.global_batch(np.zeros((8, 3)), sharding).shape == (8, 3)
    jaxdev.distributed.assert_same_across_processes({"w": np.zeros(3), "step": 1})
    mesh = Mesh(np.array(devices), ("data",))
    batch = {"x": np.arange(16.0).reshape(16, 1), "y": np.arange(16)}
    out = jaxdev.shard_batch(batch, mesh, timeout_s=1.0)
    assert out["x"].sharding == NamedSharding(mesh, PartitionSpec("data"))
    np.testing.assert_array_equal(np.asarray(out["y"]), batch["y"])
    assert out["x"].addressable_shards[3].data.shape == (2, 1)


def test_global_batch_builds_arrays_with_the_given_sharding(devices):
    sharding = NamedSharding(Mesh(np.array(devices), ("batch",)), PartitionSpec("batch"))
    out = _multihost.global_batch(np.ones((8, 3), np.float32), sharding)
    assert out.sharding == sharding and float(out.sum()) == 24.0


def test_single_process_barrier_and_shutdown_do_nothing(monkeypatch):
    monkeypatch.setattr(_multihost, "kv_client", lambda: 1 / 0)  # never asked
    assert _multihost.barrier("finished", 1.0) == []
    jaxdev.distributed.shutdown()  # not initialized


def test_join_marker_is_left_where_the_launcher_says(tmp_path):
    marker = tmp_path / "joined-1"
    assert _distributed.leave_join_marker({"JAXDEV_JOIN_MARKER": str(marker)}) == str(marker)
    assert marker.exists()
    assert _distributed.leave_join_marker({}) is None
    assert _distributed.leave_join_marker({"JAXDEV_JOIN_MARKER": str(tmp_path / "no/dir")}) is None


def test_default_timeout_reads_the_environment(monkeypatch):
    monkeypatch.setenv("JAXDEV_SYNC_TIMEOUT", "12.5")
    assert _multihost.default_timeout_s() == 12.5
    for bad in ("soon", "0", "nan", "inf"):  # nan, inf: int() of the deadline raised later
        monkeypatch.setenv("JAXDEV_SYNC_TIMEOUT", bad)
        with pytest.raises(jaxdev.DistributedError, match="`JAXDEV_SYNC_TIMEOUT` must be"):
            _multihost.default_timeout_s()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1.0, True, np.bool_(True), "60"])
def test_a_timeout_passed_to_the_cross_process_checks_is_checked(bad):
    """``assert_same_across_processes(timeout_s=nan)`` (and every check through exchange)
    was taken as it came: under several processes its deadline raised a raw ValueError or
    OverflowError at int()."""
    with pytest.raises(jaxdev.UsageError, match=r"`timeout_s` must be a number of seconds > 0"):
        _multihost.exchange("t", "x", bad)
    for good in (2.5, 30, np.int64(30), np.float32(2.5), None):  # numpy numbers too
        assert _multihost.exchange("t", "x", good) == ["x"]


def test_initialize_logs_the_job_left_to_auto_detection(monkeypatch, caplog):
    for step in ("leave_join_marker", "_prepare", "_connect", "_after_connect"):
        monkeypatch.setattr(_distributed, step, lambda *a: None)  # no JAX runtime started
    for var in ("JAXDEV_COORDINATOR", "JAXDEV_NUM_PROCESSES", "JAXDEV_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    with caplog.at_level("INFO", logger="jaxdev"):  # num_processes None: `%d` failed to log
        assert _distributed.initialize().num_processes is None
    assert "process 0 of 1 joined the coordinator" in caplog.text


# --- launcher (plain Python children, no JAX) ---------------------------------------

PY = sys.executable


@pytest.mark.timeout(30)
def test_launch_prefixes_output_and_sets_the_environment():
    out = io.StringIO()
    code = (
        "import os; print(os.environ['JAXDEV_PROCESS_ID'], os.environ['JAXDEV_NUM_PROCESSES'],"
        " os.environ['JAX_NUM_CPU_DEVICES'], os.environ['JAXDEV_COORDINATOR'])"
    )
    assert jaxdev.distributed.launch([PY, "-c", code], 2, 3, port=4567, out=out) == 0
    lines = sorted(out.getvalue().splitlines())
    assert lines == ["[p0] 0 2 3 127.0.0.1:4567", "[p1] 1 2 3 127.0.0.1:4567"]


@pytest.mark.timeout(30)
def test_launch_ends_the_others_by_pid_when_one_fails():
    out = io.StringIO()
    code = (
        "import os, sys, time\n"
        "if os.environ['JAXDEV_PROCESS_ID'] == '1':\n"
        "    time.sleep(1.0)\n"
        "    sys.exit('ValueError: bad data in shard 1')\n"
        "print('pid', os.getpid(), flush=True); time.sleep(60)"
    )
    start = time.monotonic()
    rc = jaxdev.distributed.launch([PY, "-c", code], 2, 1, out=out, grace_s=1.0)
    text = out.getvalue()
    assert rc == 1 and time.monotonic() - start < 15
    assert "process 1 failed (exit code 1)" in text
    assert "ValueError: bad data in shard 1" in text
    assert "p0: ended by launcher, signal SIGTERM" in text
    pid = int(next(ln for ln in text.splitlines() if ln.startswith("[p0] pid")).split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # really gone


@pytest.mark.timeout(30)
def test_launch_kills_processes_that_ignore_sigterm_after_the_timeout():
    out = io.StringIO()
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True); time.sleep(60)"
    )
    start = time.monotonic()
    rc = jaxdev.distributed.launch([PY, "-c", code], 2, 1, timeout_s=2.0, out=out, grace_s=1.0)
    assert rc == 124 and time.monotonic() - start < 10
    text = out.getvalue()
    assert "timed out after 2 s (`--timeout`); process(es) 0, 1 still running" in text
    assert "p1: ended by launcher, signal SIGKILL" in text


@pytest.mark.timeout(60)
def test_a_sigterm_to_the_launcher_ends_its_processes_first():
    # a job scheduler stops `jaxdev launch` with SIGTERM: its processes must not run on
    code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    cmd = [PY, "-m", "jaxdev", "launch", "-n", "2", "--grace", "1", "--", PY, "-c", code]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as launcher:
        pids = []
        while len(pids) < 2 and (line := launcher.stdout.readline()):
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 143
    deadline = time.monotonic() + 10
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert len(pids) == 2 and not alive, (pids, alive)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_JOIN_OR_NOT = (
    "import os, sys, time\n"
    "if os.environ['JAXDEV_PROCESS_ID'] == '1':\n"
    "    time.sleep(0.5); print('trained alone'); sys.exit(0)\n"
    "open(os.environ['JAXDEV_JOIN_MARKER'], 'w').close()  # what initialize() does\n"
    "print('pid', os.getpid(), flush=True); time.sleep(60)"
)


@pytest.mark.timeout(30)
def test_launch_names_a_process_that_never_called_initialize():
    out = io.StringIO()
    start = time.monotonic()
    rc = jaxdev.distributed.launch([PY, "-c", _JOIN_OR_NOT], 2, 1, out=out, grace_s=1.0)
    text = out.getvalue()
    assert rc == 1 and time.monotonic() - start < 15, text
    assert "process 1 never called jaxdev.distributed.initialize: it exited 0" in text
    assert "while process(es) 0 joined the job and waited for it" in text
    assert "p0: ended by launcher, signal SIGTERM" in text
    assert "p1: exit code 0 - never called jaxdev.distributed.initialize" in text
    pid = int(next(ln for ln in text.splitlines() if ln.startswith("[p0] pid")).split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_summary_names_unjoined_processes_when_another_failed():
    outcomes = [
        _launch.Outcome(0, 1, False, "jaxdev: process 0 gave up", True),
        _launch.Outcome(1, -15, True, "", False),
    ]
    assert _launch.never_joined(outcomes) == [1]
    text = _launch.summarize(outcomes[0], outcomes, None, 3.0)
    assert text.startswith("jaxdev launch: process 0 failed (exit code 1)")
    assert "p1: ended by launcher, signal SIGTERM - never called" in text
    assert text.endswith(
        "process(es) 1 never called jaxdev.distributed.initialize; the others "
        "waited for them at start-up."
    )
    unknown = [_launch.Outcome(0, 0, False, ""), _launch.Outcome(1, 0, False, "", False)]
    assert _launch.never_joined(unknown) == []  # nobody joined: a command without JAX


def test_launch_reports_signals_with_shell_exit_codes():
    out = io.StringIO()
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert jaxdev.distributed.launch([PY, "-c", code], 1, 1, out=out) == 137
    assert "process 0 failed (signal SIGKILL)" in out.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "python", "x.py"], "missing `--` before the command"),
        (["-n", "0", "--", "python"], "`num_processes` must be an int >= 1"),
        (["-n", "2", "--devices-per-process", "0", "--", "python"], "`devices_per_process`"),
        (["-n", "2", "--"], "`cmd` is empty"),
        (["--devices-per-process", "2", "--", "python"], "required: -n/--num-processes"),
        (["-n", "2", "--timeout", "-1", "--", "python"], "`timeout_s` must be > 0"),
        (["-n", "two", "--", "python"], "invalid int value: 'two'"),
    ],
)
def test_main_usage_errors_exit_2_with_one_line(argv, message, capsys):
    assert _launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdev launch: error: ") and message in err
    assert err.count("\n") == 1


def test_main_cannot_start_command_exits_127(capsys):
    assert _launch.main(["-n", "1", "--", "/nonexistent/python"]) == 127
    assert "cannot start" in capsys.readouterr().err


def test_failure_reason_keeps_details_and_adds_hints():
    tail = [
        "step 1",
        "jaxdev._errors.DistributedError: shapes differ:",
        "  ['x']: process 0: (4,); process 1: (6,)",
        "Fix: same batch size",
        "[Gloo] x",
    ]
    assert _launch.failure_reason(tail) == (
        "DistributedError: shapes differ:\n  ['x']: process 0: (4,); process 1: (6,)\n"
        "Fix: same batch size"
    )
    abort = [
        "F1122 client.h:80] ... absl::Status: ALREADY_EXISTS: Aborted connect attempt",
        "    @     0x7f  xla::CoordinationServiceAgent::Connect()",
    ]
    assert _launch.failure_reason(abort).endswith(
        "[likely: two processes registered with the same process id (duplicate id)]"
    )


# --- program fingerprints (in-process; the exchange is faked) ------------------------


def _payload(fn, *args, name="step"):
    return _fingerprint.payload(name, _fingerprint.program_text(fn, *args), args, {})


def test_fingerprint_is_stable_and_sees_a_different_reduction():
    x = jnp.arange(8.0)
    mean, same, biggest = (jax.jit(f) for f in (jnp.mean, jnp.mean, jnp.max))
    a, b, c = _payload(mean, x), _payload(same, x), _payload(biggest, x)
    assert a == b  # a fresh jit of the same function: the same program
    assert "example" not in _fingerprint.program_text(mean, x)  # no file names
    lines = _fingerprint.program_differences([a, a, c])
    assert lines[0].startswith("program sha256: process 0, 1: ")
    assert "operation stablehlo.maximum: process 0, 1: 0; process 2: 1" in lines
    assert _fingerprint.program_differences([a, b]) == []
    assert _fingerprint._who_differs(["x", "x", "y"]) == "process 2 differs from processes 0, 1"
    assert _fingerprint._who_differs(["x", "y"]).startswith("processes 0 vs 1 differ")


def test_program_differences_name_inputs_functions_and_constants():
    x = jnp.arange(8.0)
    a = _payload(jax.jit(lambda v: v * 1.0), x)
    b = _payload(jax.jit(lambda v: v * 2.0), x)
    assert _fingerprint.program_differences([a, b])[1:] == [
        "operation constant dense<1.000000e+00> : tensor<f32>: process 0: 1; process 1: 0",
        "operation constant dense<2.000000e+00> : tensor<f32>: process 0: 0; process 1: 1",
    ]
    c = _payload(jax.jit(lambda v: v * 1.0), jnp.arange(4.0), name="eval")
    lines = _fingerprint.program_differences([a, c])
    assert lines[0] == "function: process 0: step; process 1: eval"
    assert "input args[0]: process 0: (8,) float32 SingleDeviceSharding; process 1: (4,)" in (
        "\n".join(lines)
    )


def test_spans_processes_only_for_programs_beyond_this_process(devices):
    mesh = Mesh(np.array(devices), ("data",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("data")))
    text = _fingerprint.program_text(jax.jit(jnp.sum), x)
    assert "mhlo.num_partitions = 8" in text
    assert not _fingerprint.spans_processes(text, (x,))  # 8 devices, all local


def test_check_same_program_raises_naming_the_odd_process(monkeypatch):
    x = jnp.arange(8.0)
    odd = json.dumps(_payload(jax.jit(jnp.max), x, name="stats"))
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(_fingerprint, "spans_processes", lambda *a: True)
    monkeypatch.setattr(_fingerprint, "exchange", lambda tag, own, t: [own, own, odd])
    with pytest.raises(jaxdev.DistributedError) as info:
        jaxdev.distributed.check_same_program(jax.jit(jnp.mean), x, name="stats")
    message = str(info.value)
    assert "`stats`: the processes compiled different programs" in message
    assert "process 2 differs from processes 0, 1" in message
    assert "operation stablehlo.maximum: process 0, 1: 0; process 2: 1" in message
    assert "JAXDEV_SAME_PROGRAM=0" in message
    monkeypatch.setattr(_fingerprint, "exchange", lambda tag, own, t: [own] * 3)
    sha = jaxdev.distributed.check_same_program(jax.jit(jnp.mean), x)
    assert len(sha) == 64
    monkeypatch.setenv("JAXDEV_SAME_PROGRAM", "0")
    assert jaxdev.distributed.check_same_program(jax.jit(jnp.max), x) is None


def test_check_same_program_compares_the_digests_of_an_exchange_without_a_client(monkeypatch):
    x = jnp.arange(8.0)  # without a coordinator client each process sends 16 hex digits
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_fingerprint, "spans_processes", lambda *a: True)
    same = ["1234567890123456"] * 2  # all digits: json read it as an int (TypeError)
    monkeypatch.setattr(_fingerprint, "exchange", lambda tag, own, t: same)
    assert jaxdev.distributed.check_same_program(jax.jit(jnp.sum), x) == same[0]
    monkeypatch.setattr(_fingerprint, "exchange", lambda tag, own, t: [same[0], "12e4567890abcdef"])
    with pytest.raises(jaxdev.DistributedError, match="processes 0 vs 1 differ"):
        jaxdev.distributed.check_same_program(jax.jit(jnp.sum), x)


def test_a_string_leaf_is_described_by_its_own_dtype_not_read_as_a_dtype_name(monkeypatch):
    assert _multihost.shape_dtype("float32") == "() <U7"  # was '() float32'; 'train': TypeError
    step = jax.jit(lambda x, mode: x * 2 if mode == "train" else x, static_argnames="mode")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_fingerprint, "spans_processes", lambda *a: True)
    monkeypatch.setattr(_fingerprint, "exchange", lambda tag, own, t: [own, own])
    assert jaxdev.distributed.check_same_program(step, jnp.ones(2), mode="train")


def test_single_process_check_lowers_and_exchanges_nothing(monkeypatch):
    monkeypatch.setattr(_fingerprint, "program_text", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(_fingerprint, "exchange", lambda *a: 1 / 0)
    step = jaxdev.distributed.same_program(jax.jit(jnp.sum))
    assert jaxdev.distributed.check_same_program(step, jnp.ones(3)) is None
    assert float(step(jnp.ones(3))) == 3.0 and step.checked
    assert "stablehlo" in step.lower(jnp.ones(3)).as_text()  # attributes pass through


def test_same_program_checks_at_the_first_call_only(monkeypatch):
    calls = []
    monkeypatch.setattr(
        _fingerprint, "check_same_program", lambda fn, *a, name, **k: calls.append(name)
    )

    @jaxdev.distributed.same_program(name="double")
    @jax.jit
    def double(x):
        return 2 * x

    for _ in range(3):
        double(jnp.ones(2))
    assert calls == ["double"]


def test_train_step_checks_each_compiled_program_once(monkeypatch):
    calls = []
    monkeypatch.setattr(
        _fingerprint, "check_same_program", lambda fn, *a, name, **k: calls.append(name)
    )
    step = jaxdev.make_train_step(lambda p, b: (b * p) ** 2, optax.sgd(0.1))
    state = step.init_state(jnp.ones(()), optax.sgd(0.1))
    metrics = None
    for _ in range(3):
        state, metrics = step(state, step.put_batch(np.ones(4, np.float32)), metrics)
    assert calls == [
        "train step (padded=False, metrics=False)",
        "train step (padded=False, metrics=True)",
    ]


# --- real processes: 2 x 4 fake CPU devices on 127.0.0.1 ----------------------------


def _run(name: str) -> matrix.Result:
    result = matrix.run(SCENARIOS[name])
    print(result.output)  # shown by pytest on failure
    return result


@pytest.mark.timeout(90)
def test_two_processes_global_batch_and_same_values():
    result = _run("happy")
    assert result.returncode == 0, result.output
    assert result.missing() == []
    for p in (0, 1):  # the same right answer on both processes, both steps
        assert f"[p{p}] step 1: global shape (8,) mean 3.5 y-sum 16" in result.output
        assert f"[p{p}] step 2: global shape (8,) mean 7.0 y-sum 16" in result.output
    assert "1 leaf/leaves differ" in result.output  # only ['w'] drifted, not ['step']
    assert "['w']: process 0: (5,) float32" in result.output


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "name",
    [
        "no_coordinator",
        "never_starts",
        "sigkill",
        "sigkill_unsupervised",
        "loader_hang",
        "batch_shapes",
        "device_counts",
        "duplicate_id",
    ],
)
def test_fault_ends_bounded_non_zero_and_names_the_process(name):
    scenario = SCENARIOS[name]
    result = _run(name)
    assert result.returncode != 0, result.output
    assert result.seconds < scenario.limit_s + 10, f"took {result.seconds:.1f} s"
    assert result.missing() == [], result.output
    assert "WRONG RESULT" not in result.output  # never a wrong result...
    assert "step 2:" not in result.output  # ...nor a step finished without every process


@pytest.mark.timeout(60)
def test_python_dash_m_launch_usage_error_exits_2():
    proc = subprocess.run(
        [PY, "-m", "jaxdev", "launch", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=matrix.REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("jaxdev launch: error: missing `--`")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "name", ["never_joined", "extra_collective", "different_program", "different_reduction"]
)
def test_divergent_process_is_named_in_bounded_time(name):
    scenario = SCENARIOS[name]
    result = _run(name)
    assert result.returncode == 1, result.output
    assert result.seconds < scenario.limit_s + 10, f"took {result.seconds:.1f} s"
    assert result.missing() == [], result.output
    assert "WRONG RESULT" not in result.output
    if name.startswith("different"):  # caught before the first step ran
        assert "step 1:" not in result.output
        assert "compiled different programs" in result.output.split("jaxdev launch:")[-1]
    if name == "never_joined":
        assert "gave up after" not in result.output  # named before process 0's init timeout


@pytest.mark.parametrize("cmd", ["python train.py", b"python", [PY, 3], [PY, None]])
def test_launch_refuses_a_command_that_is_not_a_list_of_strings(cmd):
    """``launch("python train.py")`` ran the string's first character as the command
    (subprocess took it as a sequence); other leaves failed inside subprocess."""
    with pytest.raises(jaxdev.UsageError, match=r"`cmd` must be a list of strings.*shlex\.split"):
        jaxdev.distributed.launch(cmd, 1, 1, out=io.StringIO())


def test_launch_runs_a_command_with_bytes_arguments_as_posix_popen_does():
    """``os.fsencode``'d arguments (a path in no encoding) were refused as not strings."""
    out = io.StringIO()
    assert jaxdev.distributed.launch([os.fsencode(PY), b"-c", "print('hi')"], 1, 1, out=out) == 0
    assert "[p0] hi" in out.getvalue()
