"""Every script in examples/ runs as ``python examples/NAME.py`` and says it finished.

Each runs in a fresh process with a clean JAX environment (no inherited
``JAX_*``/``XLA_*`` variables), so each script's own fake-device set-up is
what gets tested.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, clean_env

EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "*.py")))

# The line each example prints last when every check inside it passed.
KEY_LINES = {
    "device_basics.py": "device basics: ok",
    "flax_linen_placement.py": "flax linen placement: ok",
    "flax_nnx.py": "flax nnx: ok",
    "flax_imagenet_step.py": "flax imagenet step: ok",
    "flax_nnx_cnn.py": "flax nnx cnn: ok",
    "flax_nnx_tutorial.py": "flax nnx tutorial: ok",
    "pmap_data_parallel.py": "pmap data parallel: ok",
    "sharded_data_parallel.py": "sharded data parallel: ok",
    "metrics_on_device.py": "metrics on device: ok",
    "multihost_train.py": "processes=1 devices=8",
    "checkpoint_resume.py": "checkpoint resume: ok",
    "fsdp_train.py": "fsdp train: ok",
    "language_model.py": "language model: ok",
    "llama_plan.py": "llama plan: ok",
}


def run_script(path: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, path],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_every_example_has_a_key_line():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert set(KEY_LINES) <= names, f"missing examples: {set(KEY_LINES) - names}"
    assert names <= set(KEY_LINES), f"add a key line for: {names - set(KEY_LINES)}"


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path):
    proc = run_script(path)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"{os.path.basename(path)} exited {proc.returncode}:\n{tail}"
    assert KEY_LINES[os.path.basename(path)] in proc.stdout, tail


@pytest.mark.slow
def test_readme_tour_runs_as_written(tmp_path):
    """The README's 30-second tour is the first ```python block; it must run as printed."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        tour = re.findall(r"```python\n(.*?)```", f.read(), re.S)[0]
    script = tmp_path / "tour.py"
    script.write_text(tour)
    proc = run_script(str(script))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(" cpu:3")  # "0 cpu:0 cpu:3" without a GPU
    # 13 rows padded to a multiple of the device count (16 on 8 fake CPUs), 13 counted.
    assert any(re.fullmatch(r"\(\d+,\) 13 13", line) for line in lines), lines
    assert any(line.startswith("22 {'loss': ") for line in lines)
    assert "  ['w']: found cpu:0, expected cpu:1" in lines
