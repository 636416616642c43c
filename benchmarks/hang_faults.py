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
  watchdog must stay silent and the run exit 0);
* ``healthy``: no stall: a 12.5 s first compile, a 12.5 s recompile at
  step 4 (a new batch shape), 3 more steps on process 1 alone (it finishes
  first), 20 s of post-processing on process 0 after its last step (the
  watchdog must stay silent and the run exit 0).

Every process is ended by its own pid after 180 s.

Usage::

    python benchmarks/hang_faults.py [SCENARIO ...]
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from mp_scripts.hang_runs import Scenario, run_all  # noqa: E402

S = 10
DEADLINE_S = 180

SCENARIOS = {  # name: (the scenario, what it must end with)
    "step": (Scenario("launch", "step", 1, S), "exit 1, names process 1 and step 5"),
    "loader": (Scenario("launch", "loader", 1, S), "exit 1, names process 1 in its loader"),
    "coordinator": (Scenario("launch", "step", 0, S), "exit 1, names process 0"),
    "plain_step": (Scenario("plain", "step", 1, S), "both exit 1, process 1 named"),
    "kill": (Scenario("launch", "kill", 1, S), "137, the launcher names process 1"),
    "plain_kill": (Scenario("plain", "kill", 1, S), "process 0 exits 1, names process 1"),
    "slow30": (Scenario("launch", "slow30", 1, S), "exit 0, no report"),
    "healthy": (Scenario("launch", "healthy", 1, S), "exit 0, no report"),
}


def _verdict(output: str) -> str:
    verdicts = (r"process \d has not (?:started|finished) step \d+[^\n]*", r"jaxdev launch: [^\n]*")
    for pattern in verdicts:
        if m := re.search(pattern, output):
            return m.group(0).replace("|", "\\|")[:150]
    if "does not answer" in output:
        return re.search(r"[^\n]*does not answer[^\n]*", output).group(0)[:150]
    return "no report" if "hang watchdog" not in output else "a report (unexpected)"


def main(argv: list[str]) -> int:
    chosen = {n: s for n, (s, _) in SCENARIOS.items() if not argv or n in argv}
    runs = run_all(chosen, DEADLINE_S)
    print(f"S = {S} s, 2 processes x 4 CPU devices, {len(chosen)} scenarios at once\n")
    print("| scenario | expected | exit codes | s from launch | s after the stall | verdict |")
    print("|---|---|---|---|---|---|")
    for name, run in runs.items():
        after = f"{run.after_stall():.1f}" if "STALL" in run.output else "-"
        codes = ", ".join(str(c) for c in run.returncodes)
        print(
            f"| {name} | {SCENARIOS[name][1]} | {codes} | {run.ended - run.started:.1f} "
            f"| {after} | {_verdict(run.output)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
