"""Time from a stall to the end of the run, with the hang watchdog on (issue 21).

Runs ``tests/mp_scripts/hang.py`` as 2 processes x 4 fake CPU devices on
127.0.0.1 with ``S = 10`` s (the issue's figures; the test suite uses 6 s),
every scenario at once (they mostly sleep), and prints a markdown table:
scenario, exit codes, seconds from launch to the last exit, seconds from the
stall to the last exit, and the watchdog's (or the launcher's) verdict.

* ``step`` / ``loader`` / ``coordinator``: process 1 (0 for ``coordinator``)
  sleeps 120 s before its step 5 / in its ``heartbeat("data")`` loader,
  under ``jaxdev launch --hang-timeout 10``;
* ``plain_step``: the same stall, processes started by hand with the
  ``JAXDEV_*`` environment (no launcher: as under Slurm);
* ``kill`` / ``plain_kill``: process 1 is SIGKILLed before its step 5;
* ``slow30``: no stall: a 15 s first compile, then 30 steps of 3 s (the
  watchdog must stay silent and the run exit 0).

Every process is ended by its own pid after 180 s.

Usage::

    python benchmarks/hang_faults.py [SCENARIO ...]
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG = os.path.join(REPO, "tests", "mp_scripts", "hang.py")
PY = sys.executable
S = 10
DEADLINE_S = 180

# name: (how, hang.py scenario, the process that stalls, what it must end with)
SCENARIOS = {
    "step": ("launch", "step", 1, "exit 1, names process 1 and step 5"),
    "loader": ("launch", "loader", 1, "exit 1, names process 1 in its loader"),
    "coordinator": ("launch", "step", 0, "exit 1, names process 0"),
    "plain_step": ("plain", "step", 1, "both exit 1, process 1 named"),
    "kill": ("launch", "kill", 1, "137, the launcher names process 1"),
    "plain_kill": ("plain", "kill", 1, "process 0 exits 1, names process 1"),
    "slow30": ("launch", "slow30", 1, "exit 0, no report"),
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "JAXDEV_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(name: str) -> list[tuple[list[str], dict[str, str]]]:
    how, scenario, process, _ = SCENARIOS[name]
    args = [HANG, scenario, str(process)]
    if how == "launch":
        launch = ["-m", "jaxdev", "launch", "-n", "2", "--devices-per-process", "4"]
        launch += ["--timeout", str(DEADLINE_S - 10), "--hang-timeout", str(S), "--"]
        return [([PY, *launch, PY, *args], _env())]
    port = _port()
    base = {
        "JAXDEV_COORDINATOR": f"127.0.0.1:{port}",
        "JAXDEV_NUM_PROCESSES": "2",
        "JAXDEV_LOCAL_DEVICES": "4",
        "JAX_NUM_CPU_DEVICES": "4",
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONUNBUFFERED": "1",
        "JAXDEV_HANG_TIMEOUT": str(S),
    }
    return [([PY, *args], _env(**base, JAXDEV_PROCESS_ID=str(i))) for i in range(2)]


def _verdict(output: str) -> str:
    verdicts = (r"process \d has not (?:started|finished) step \d+[^\n]*", r"jaxdev launch: [^\n]*")
    for pattern in verdicts:
        if m := re.search(pattern, output):
            return m.group(0).replace("|", "\\|")[:150]
    if "does not answer" in output:
        return re.search(r"[^\n]*does not answer[^\n]*", output).group(0)[:150]
    return "no report" if "hang watchdog" not in output else "a report (unexpected)"


def main(argv: list[str]) -> int:
    chosen = [n for n in SCENARIOS if not argv or n in argv]
    with tempfile.TemporaryDirectory() as folder:
        started, procs = time.time(), {}
        for name in chosen:
            procs[name] = []
            for i, (cmd, env) in enumerate(_commands(name)):
                out = open(os.path.join(folder, f"{name}-{i}.txt"), "w+")
                p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
                procs[name].append((p, out))
        ended: dict[str, float] = {}
        deadline = time.monotonic() + DEADLINE_S
        try:
            while len(ended) < len(procs) and time.monotonic() < deadline:
                for name, ps in procs.items():
                    if name not in ended and all(p.poll() is not None for p, _ in ps):
                        ended[name] = time.time()
                time.sleep(0.1)
        finally:
            for ps in procs.values():
                for p, _ in ps:
                    if p.poll() is None:
                        p.kill()
                        p.wait(timeout=30)
        print(f"S = {S} s, 2 processes x 4 CPU devices, {len(chosen)} scenarios at once\n")
        print("| scenario | expected | exit codes | s from launch | s after the stall | verdict |")
        print("|---|---|---|---|---|---|")
        for name, ps in procs.items():
            text = ""
            for _, out in ps:
                out.seek(0)
                text += out.read()
                out.close()
            end = ended.get(name, time.time())
            stall = re.search(r"STALL ([\d.]+)", text)
            after = f"{end - float(stall.group(1)):.1f}" if stall else "-"
            codes = ", ".join(str(p.returncode) for p, _ in ps)
            print(
                f"| {name} | {SCENARIOS[name][3]} | {codes} | {end - started:.1f} | {after} "
                f"| {_verdict(text)} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
