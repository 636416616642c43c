"""Run ``hang.py`` scenarios as 2 processes x 4 CPU devices, all at once, and collect them.

Shared by ``tests/test_hang.py`` (S = 6 s) and ``benchmarks/hang_faults.py``
(S = 10 s). A scenario runs under ``jaxdev launch --hang-timeout S`` or, with
``how="plain"``, as processes started by hand with the ``JAXDEV_*``
environment (as under Slurm). Every process still alive at the deadline is
ended by its own pid.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from jaxdev.distributed import _launch

from .child_env import REPO, clean_env

HANG = os.path.join(REPO, "tests", "mp_scripts", "hang.py")
PY = sys.executable


class Scenario(NamedTuple):
    how: str  # "launch" or "plain"
    script: str  # hang.py's scenario
    process: int  # the process that stalls
    timeout_s: float  # the hang timeout S


class Run(NamedTuple):
    returncodes: list[int]
    output: str
    started: float  # time.time() when it started
    ended: float  # time.time() when its last process ended

    def after_stall(self) -> float:
        """Seconds from the stalled process's ``STALL`` line to the end of the run."""
        stall = float(re.search(r"STALL ([\d.]+)", self.output).group(1))
        return self.ended - stall


def _commands(s: Scenario, deadline_s: float) -> list[tuple[list[str], dict[str, str]]]:
    script = [PY, HANG, s.script, str(s.process)]
    if s.how == "launch":
        options = ["-n", "2", "--devices-per-process", "4", "--timeout", str(deadline_s - 10)]
        options += ["--hang-timeout", f"{s.timeout_s:g}", "--"]
        return [([PY, "-m", "jaxdev", "launch", *options, *script], clean_env())]
    port = _launch.free_port()
    base = clean_env(JAXDEV_HANG_TIMEOUT=f"{s.timeout_s:g}")
    return [(script, _launch.process_env(i, 2, 4, port, base)) for i in range(2)]


def run_all(scenarios: dict[str, Scenario], deadline_s: float) -> dict[str, Run]:
    """Start every scenario at once; wait for all (at most ``deadline_s``); collect them."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.time()
        started: dict[str, list] = {}
        for name, s in scenarios.items():
            started[name] = []
            for i, (cmd, env) in enumerate(_commands(s, deadline_s)):
                out = open(os.path.join(folder, f"{name}-{i}.txt"), "w+")
                p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
                started[name].append((p, out))
        ended: dict[str, float] = {}
        deadline = time.monotonic() + deadline_s
        try:
            while len(ended) < len(started) and time.monotonic() < deadline:
                for name, procs in started.items():
                    if name not in ended and all(p.poll() is not None for p, _ in procs):
                        ended[name] = time.time()
                time.sleep(0.1)
        finally:
            for procs in started.values():
                for proc, _ in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(timeout=30)
        result = {}
        for name, procs in started.items():
            text = []
            for _, out in procs:
                out.seek(0)
                text.append(out.read())
                out.close()
            codes = [p.returncode for p, _ in procs]
            result[name] = Run(codes, "\n".join(text), start, ended.get(name, time.time()))
        return result
