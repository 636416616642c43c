"""Time-to-failure of jaxdev's multi-process fault matrix (2 processes x 4 CPU devices).

Runs every scenario of ``tests/mp_scripts/matrix.py`` with real processes on
127.0.0.1 (init / heartbeat / cross-process-check / shutdown timeouts of 10 s,
a 40 s launcher backstop) and prints a markdown table: scenario, expected
outcome, exit code, seconds from launch to the launcher's exit, and the
summary line. The divergent-process scenarios: ``never_joined`` (a process
skips ``initialize``), ``extra_collective`` (one process runs one collective
more), ``different_program`` (a train step whose loss one process scales by
2) and ``different_reduction`` (3 processes; one takes the max, not the mean).

Usage::

    python benchmarks/multihost_faults.py [SCENARIO ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "mp_scripts"
    ),
)

import matrix  # noqa: E402


def row(result: matrix.Result) -> str:
    """One markdown table row for a scenario's result."""
    s = result.scenario
    ok = "ok" if not result.missing() else f"MISSING {result.missing()}"
    message = result.summary().replace("|", "\\|")[:220]
    return (
        f"| {s.name} | {s.expected} | {result.returncode} | {result.seconds:.1f} "
        f"(limit {s.limit_s:g}+10) | {message} ({ok}) |"
    )


def main(argv: list[str]) -> int:
    """Run the chosen (default: all) scenarios and print the table."""
    chosen = [s for s in matrix.SCENARIOS if not argv or s.name in argv]
    print("| scenario | expected | exit code | seconds | message |")
    print("|---|---|---|---|---|")
    for scenario in chosen:
        print(row(matrix.run(scenario)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
