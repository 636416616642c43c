"""The data-parallel train step under 2 processes x 4 devices equals 1 process x 8 devices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, clean_env, launch

pytestmark = pytest.mark.multiprocess

EXAMPLE = os.path.join(REPO, "examples", "multihost_train.py")


def _result_lines(text: str) -> list[str]:
    return [line.split("] ", 1)[-1] for line in text.splitlines() if "processes=" in line]


@pytest.mark.timeout(240)
def test_two_processes_match_one_process_with_eight_devices():
    one = subprocess.run(
        [sys.executable, EXAMPLE], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert one.returncode == 0, one.stderr
    [single] = _result_lines(one.stdout)
    assert single.startswith("processes=1 devices=8 steps=20")

    two = launch(2, 4, [sys.executable, EXAMPLE])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    lines = _result_lines(two.stdout)
    assert len(lines) == 2
    expected = single.replace("processes=1", "processes=2")
    assert lines == [expected, expected]
