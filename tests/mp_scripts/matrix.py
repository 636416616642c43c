"""The multi-process fault matrix, shared by tests/test_multihost.py and
benchmarks/multihost_faults.py.

Each scenario runs ``tests/mp_scripts/worker.py`` as 2 processes x 4 fake CPU
devices (``different_reduction``: 3 x 1) under ``python -m jaxdev launch``
(or, for ``no_coordinator``, one lone process 1) with short timeouts, and
records exit code, seconds, and the launcher's summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import NamedTuple

from child_env import REPO, clean_env  # matrix is imported with mp_scripts/ on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")

INIT_TIMEOUT_S = 10
HEARTBEAT_TIMEOUT_S = 10
SYNC_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 10
RUN_TIMEOUT_S = 40  # launcher's whole-run backstop


class Scenario(NamedTuple):
    name: str
    expected: str
    must_contain: tuple[str, ...]  # every one appears in the output (case-insensitive)
    limit_s: float  # the configured timeout the failure is bounded by
    processes: int = 2
    devices_per_process: int = 4


SCENARIOS = [
    Scenario(
        "happy",
        "exit 0, mean 3.5 / 7.0 on both processes, drift caught",
        ("[p0] OK", "[p1] OK", "mean 3.5", "process 0: (5,) float32"),
        RUN_TIMEOUT_S,
    ),
    Scenario(
        "no_coordinator",
        "process 1 alone: DistributedError, coordinator unreachable",
        ("process 1 could not reach the coordinator",),
        INIT_TIMEOUT_S,
    ),
    Scenario(
        "never_starts",
        "process 0 gives up after the init timeout, with a diagnostic",
        ("process 0 failed (exit code 1)", "gave up after 10 s", "peer never started"),
        INIT_TIMEOUT_S,
    ),
    Scenario(
        "sigkill",
        "process 1 SIGKILLed mid-step; others ended",
        ("process 1 failed (signal SIGKILL)",),
        HEARTBEAT_TIMEOUT_S,
    ),
    Scenario(
        "sigkill_unsupervised",
        "same, no launcher: JAX's heartbeat ends process 0",
        ("stopped sending heartbeats", "process 0: signal SIGABRT"),
        HEARTBEAT_TIMEOUT_S,
    ),
    Scenario(
        "loader_hang",
        "process 1 hangs in the loader; process 0 names it",
        ("`shard_batch`", "process(es) 1 of 2 never arrived"),
        SYNC_TIMEOUT_S,
    ),
    Scenario(
        "batch_shapes",
        "DistributedError naming leaves and processes",
        ("['x']: process 0: (4,) float32; process 1: (8,) float32",),
        SYNC_TIMEOUT_S,
    ),
    Scenario(
        "device_counts",
        "DistributedError: process 0: 4, process 1: 2",
        ("same number of local devices", "process 0: 4, process 1: 2"),
        INIT_TIMEOUT_S,
    ),
    Scenario(
        "duplicate_id",
        "two processes claim id 0: port taken or init diagnostic",
        ("duplicate",),
        INIT_TIMEOUT_S,
    ),
    Scenario(
        "never_joined",
        "process 1 skips initialize, trains alone, exits 0: launcher names it, exit 1",
        ("process 1 never called jaxdev.distributed.initialize", "p0: ended by launcher"),
        INIT_TIMEOUT_S,
    ),
    Scenario(
        "extra_collective",
        "process 1 runs one collective more (a metric on one host): process 0 names it at exit",
        ("process(es) 1 of 2 never finished", "stuck in a collective"),
        SHUTDOWN_TIMEOUT_S,
    ),
    Scenario(
        "different_program",
        "train step, process 1 scales its loss by 2: DistributedError at the first call",
        (
            "compiled different programs",
            "processes 0 vs 1 differ",
            "operation constant dense<2.000000e+00> : tensor<f32>: process 0: 1; process 1: 3",
        ),
        SYNC_TIMEOUT_S,
    ),
    Scenario(
        "different_reduction",
        "3 processes, `same_program` step, process 2 takes max not mean: names process 2",
        ("process 2 differs from processes 0, 1", "operation stablehlo.maximum"),
        SYNC_TIMEOUT_S,
        processes=3,
        devices_per_process=1,
    ),
]


class Result(NamedTuple):
    scenario: Scenario
    returncode: int
    seconds: float
    output: str

    def missing(self) -> list[str]:
        """Expected fragments absent from the output."""
        low = self.output.lower()
        return [m for m in self.scenario.must_contain if m.lower() not in low]

    def summary(self) -> str:
        """The launcher's summary (or the lone process's error), one line."""
        lines = self.output.splitlines()
        for key in ("jaxdev launch:", "DistributedError:"):
            hits = [ln for ln in lines if key in ln]
            if hits:
                return hits[0].strip()
        for i, line in enumerate(lines):  # a JAX runtime abort: status and task list
            if "absl::Status:" in line:
                return f"{line[line.index('absl::Status:') :]} {lines[i + 1]}".strip()
        return lines[-1].strip() if lines else ""


def _env() -> dict[str, str]:
    return clean_env(
        JAXDEV_INIT_TIMEOUT=str(INIT_TIMEOUT_S),
        JAXDEV_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT_S),
        JAXDEV_SYNC_TIMEOUT=str(SYNC_TIMEOUT_S),
        JAXDEV_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S),
    )


def command(scenario: Scenario, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one scenario."""
    from jaxdev.distributed._launch import process_env

    env = _env()
    if scenario.name == "no_coordinator":  # process 1 of 2, as the launcher would start it
        return [sys.executable, WORKER, "happy"], process_env(1, 2, 4, port, env)
    launcher = [
        sys.executable,
        "-m",
        "jaxdev",
        "launch",
        "-n",
        str(scenario.processes),
        "--devices-per-process",
        str(scenario.devices_per_process),
        "--port",
        str(port),
        "--timeout",
        str(RUN_TIMEOUT_S),
        "--",
    ]
    return launcher + [sys.executable, WORKER, scenario.name], env


def _run_unsupervised(port: int) -> tuple[int, str]:
    """Start both processes of ``sigkill`` directly (no launcher); return p0's outcome."""
    from jaxdev.distributed._launch import describe_returncode, process_env

    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "sigkill"],
            cwd=REPO,
            text=True,
            env=process_env(i, 2, 4, port, _env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # each ended by its own pid
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = "\n".join(
        f"process {i}: {describe_returncode(p.returncode)}" for i, p in enumerate(procs)
    )
    return procs[0].returncode, "".join(outputs) + codes


def run(scenario: Scenario) -> Result:
    """Run one scenario; the subprocess timeout is only a backstop."""
    from jaxdev.distributed._launch import free_port

    if scenario.name == "sigkill_unsupervised":
        start = time.monotonic()
        rc, output = _run_unsupervised(free_port())
        return Result(scenario, rc, time.monotonic() - start, output)
    cmd, env = command(scenario, free_port())
    start = time.monotonic()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30, cwd=REPO
    )
    seconds = time.monotonic() - start
    return Result(scenario, proc.returncode, seconds, proc.stdout + proc.stderr)
