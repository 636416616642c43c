"""The benchmarks the README and BENCHMARKS.md quote keep running (their ``--quick`` modes).

Each runs as ``python benchmarks/NAME.py`` in a fresh process with a clean JAX environment,
as the commands in BENCHMARKS.md are run; the figures are not asserted (a loaded CI machine
times nothing reliably), only that every case ran and reported.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO, clean_env


@pytest.mark.slow
def test_step_overhead_quick_runs_every_strategy(tmp_path):
    out = tmp_path / "step_overhead.json"
    script = os.path.join(REPO, "benchmarks", "step_overhead.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--leaves", "2", "--json", str(out)],
        env=clean_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert report["runs"][0]["machine"]["device_count"] == 8
    assert "backend cpu" in proc.stdout
    assert "| step/hand | program/hand | step/hand+mean | hand+mean/hand |" in proc.stdout
    rows = {(r["strategy"], r["leaves"]): r for r in report["rows"]}
    assert set(rows) == {("single", 2), ("sharded", 2), ("pmap", 2)}
    for row in rows.values():
        assert all(us > 0 for us in row["us"].values()), row
        assert row["host us"].keys() == row["us"].keys() and min(row["host us"].values()) > 0
        assert set(row["us"]) == {"step", "program", "hand", "hand+mean"}, row
        ratios = ("step/hand", "program/hand", "step/hand+mean", "hand+mean/hand")
        assert all(math.isfinite(row[k]) for k in ratios), row
        assert row["calls"] % 8 == 0 and row["program_source"], row
