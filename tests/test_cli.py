"""``jaxdev info | demo | bench | launch`` driven end to end through subprocesses.

Each command runs as ``python -m jaxdev`` in a fresh process with a clean
JAX environment, as a user's shell would start the ``jaxdev`` script.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO
from conftest import clean_env as _clean_env

from jaxdev.cli import _cli


def clean_env(**extra: str) -> dict[str, str]:
    return _clean_env(COLUMNS="160", **extra)


def jaxdev_cli(*args: str, timeout: float = 180.0, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxdev", *args],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def assert_usage_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 2, one line on stderr naming the problem, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---------------------------------------------------------------- info


def test_info_json_reports_what_jax_started():
    proc = jaxdev_cli("info", "--json", XLA_FLAGS="--xla_force_host_platform_device_count=3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["local_device_count"] == 3 == len(data["devices"])
    assert {d["platform"] for d in data["devices"]} == {"cpu"}
    assert all(d["memory"] is None for d in data["devices"])
    assert data["requested"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    assert data["accelerator_expected"]["expected"] is bool(_cli.installed_plugins())  # cuda12


def test_info_table_and_gpu_fallback_warning():
    proc = jaxdev_cli("info", JAX_PLATFORMS="cpu")
    assert proc.returncode == 0, proc.stderr
    assert "n/a on CPU" in proc.stdout and "default backend" in proc.stdout
    if not _cli.installed_plugins():
        # "cuda,cpu" on a host without CUDA: JAX falls back to the CPU and info warns.
        warned = jaxdev_cli("info", JAX_PLATFORMS="cuda,cpu")
        assert warned.returncode == 0, warned.stderr
        assert "warning: A GPU was requested ('cuda,cpu')" in warned.stdout
        # "cuda" alone: JAX can't start any backend; a usage error, not a traceback.
        failed = jaxdev_cli("info", JAX_PLATFORMS="cuda")
        assert_usage_error(failed, "JAX_PLATFORMS='cuda'", "jax[cuda12]")


# ---------------------------------------------------------------- demo


@pytest.mark.slow
def test_demo_trains_on_8_fake_devices_and_reaches_the_target():
    proc = jaxdev_cli("demo", "--epochs", "8", "--steps-per-call", "4", "--min-accuracy", "0.95")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "8 fake CPU devices" in out
    assert "placement of the parameters" in out and "P() on 8 devices" in out
    assert "last batch 29 rows, padded to a multiple of 8 and masked" in out
    assert "2 call(s) of 4 full batches, then 3 full batch(es) one step at a time" in out
    assert len(re.findall(r"^epoch +\d+/8 ", out, re.M)) == 8
    final = re.search(r"test accuracy: ([\d.]+) \(8 cpu devices, sharded, (\d+) steps", out)
    assert final, out[-500:]
    assert float(final.group(1)) >= 0.95
    assert int(final.group(2)) == 8 * 12  # 11 full batches + the padded one, every epoch


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "pmap"])
def test_demo_one_epoch_every_strategy(strategy):
    proc = jaxdev_cli("demo", "--epochs", "1", "--strategy", strategy, "--devices", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    n = "1 cpu device," if strategy == "single" else "2 cpu devices,"
    assert re.fullmatch(
        rf"test accuracy: [\d.]+ \({n} {strategy}, 12 steps, [\d.]+ s\)\n", proc.stdout
    )


@pytest.mark.slow
def test_demo_with_fsdp_params_prints_the_bytes_per_device_next_to_replicated():
    proc = jaxdev_cli("demo", "--epochs", "1", "--params", "fsdp", "--mesh", "data=2,fsdp=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = re.search(
        r"params \+ optimizer state per device: ([\d.]+) KiB with rules='fsdp' on mesh "
        r"data=2 x fsdp=4 \(replicated: ([\d.]+) KiB; \d+%\); batch split over "
        r"\('data', 'fsdp'\)",
        proc.stdout,
    )
    assert line, proc.stdout[-2000:]
    assert float(line.group(1)) < 0.3 * float(line.group(2))  # ~1/4: sharded 4 ways
    assert re.search(r"test accuracy: [\d.]+ \(8 cpu devices, sharded, 12 steps", proc.stdout)


def test_demo_exit_1_when_below_min_accuracy():
    proc = jaxdev_cli(
        "demo", "--epochs", "1", "--lr", "0", "--min-accuracy", "0.9", "--quiet", "--devices", "2"
    )
    assert proc.returncode == 1, proc.stderr
    assert "below --min-accuracy 0.9" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["demo", "--strategy", "dataparallel"], ["invalid choice: 'dataparallel'", "sharded"]),
        (["demo", "--devices", "0"], ["--devices", "positive int, got 0"]),
        (["demo", "--epochs", "x"], ["--epochs", "'x'"]),
        (["demo", "--min-accuracy", "2"], ["--min-accuracy", "[0, 1]"]),
        (["demo", "--mesh", "data=2,fsdp"], ["--mesh", "data=2,fsdp=4"]),
        (["demo", "--mesh", "data=3,fsdp=4"], ["`--mesh`", "multiply to 12 devices but 8"]),
        (["memory", "--model", "tests/test_memory_cli.py:tiny", "--mesh", "data=-1,fsdp=-1"],
         ["argument --mesh", "one may be -1", "got 'data=-1,fsdp=-1'"]),  # was: exit 1, 64 devices
        (["memory", "--model", "tests/test_memory_cli.py:tiny", "--mesh", "data=2,data=4"],
         ["argument --mesh", "distinct names", "got 'data=2,data=4'"]),  # was: data=4 planned
        (["demo", "--strategy", "pmap", "--params", "fsdp"], ["`--params`", "sharded"]),
        (["bench", "--json", "/no/such/folder/out.json"], ["/no/such/folder", "does not exist"]),
        # were: trained to noise (accuracy 0.1) and exit 0; a traceback from sklearn, exit 1;
        # nothing written and exit 0
        (["demo", "--lr", "nan"], ["argument --lr", "finite number >= 0", "got nan"]),
        (["demo", "--lr", "inf"], ["argument --lr", "finite number >= 0", "got inf"]),
        (["demo", "--lr", "-0.1"], ["argument --lr", "finite number >= 0", "got -0.1"]),
        (["demo", "--seed", "-1"], ["argument --seed", "[0, 2**32 - 1]", "got -1"]),
        (["demo", "--seed", str(2**32)], ["argument --seed", "got 4294967296"]),
        (["bench", "--json", ""], ["`--json`", "needs a file path, got ''"]),
        (["memory", "--plot", " "], ["`--plot`", "needs a file path, got ' '"]),
        (["memory", "--model", "tests/test_memory_cli.py:tiny", "--limit", "inf"],
         ["argument --limit", "got inf"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
        ([], ["required: command"]),
        (["launch", "-n", "2"], ["missing `--`"]),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, fragments):
    assert_usage_error(jaxdev_cli(*args, timeout=60), *fragments)


def test_more_devices_than_exist_on_an_accelerator_or_a_started_backend(capsys, devices):
    # In this test process JAX already runs with 8 CPU devices: asking for 16 is the
    # "more devices than exist" case a GPU host hits; the CLI names the count and the fix.
    code = _cli.main(["demo", "--devices", "16", "--epochs", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "this process has 8 cpu device(s)" in err[0]
    assert "JAX_PLATFORMS=cpu jaxdev demo --devices 16" in err[0]


def test_missing_optional_dependency_names_the_extra():
    blocker = "import sys; sys.modules['matplotlib'] = None; sys.modules['sklearn'] = None"
    code = "from jaxdev.cli._cli import main; import sys; sys.exit(main(sys.argv[1:]))"
    for args, extra in ((["bench", "--plot", "x.png"], "jaxdev[plot]"), (["demo"], "jaxdev[demo]")):
        proc = subprocess.run(
            [sys.executable, "-c", f"{blocker}; {code}", *args],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert_usage_error(proc, f"pip install '{extra}'")


# ---------------------------------------------------------------- bench


@pytest.mark.slow
def test_bench_quick_writes_json_and_png(tmp_path):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    proc = jaxdev_cli("bench", "--quick", "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out_json.read_text())
    assert data["quick"] is True and data["host"]["devices"] == 8
    keys = {r["key"] for r in data["results"]}
    assert {"ex3_log", "ex4_two_devices", "place_noop", "place_replicate", "place_shard"} <= keys
    assert any(k.startswith("ex1_matmul_") for k in keys)
    for r in data["results"]:
        assert all(v > 0 for v in r["median_seconds"].values()), r
        assert all(v > 0 for v in r["ratios"].values()), r
    log = next(r for r in data["results"] if r["key"] == "ex3_log")
    assert set(log["median_seconds"]) == {
        "float() per step",
        "DeviceLog, 1 fetch",
        "DeviceLog in lax.scan",
    }
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "jaxdev bench" in proc.stdout and "d2l ex. 3" in proc.stdout


def test_launch_delegates_to_the_launcher():
    proc = jaxdev_cli(
        "launch", "-n", "2", "--", sys.executable, "-c", "print('hello')", timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("hello") == 2


# ---------------------------------------------------------------- the rule, in-process


def test_fake_device_rule_without_starting_jax(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert _cli.accelerator_expected() == (True, "JAX_PLATFORMS=cuda")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert _cli.accelerator_expected()[0] is False
    monkeypatch.setenv("XLA_FLAGS", "--foo --xla_force_host_platform_device_count=5")
    assert _cli.requested_cpu_count() == 5
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "3")
    assert _cli.requested_cpu_count() == 3


def test_demo_group_steps_never_drops_or_repeats_a_row():
    import numpy as np

    from jaxdev.cli import _demo

    data = {"x": np.arange(1437 * 2).reshape(1437, 2), "y": np.arange(1437)}
    batches = _demo.epoch_batches(data, 128, np.random.default_rng(0))
    for k in (1, 2, 3, 4, 5, 11, 12):
        groups = list(_demo.group_steps(batches, k))
        rows = np.concatenate([g["y"].reshape(-1) for _, g in groups])
        assert sorted(rows.tolist()) == list(range(1437)), k
        assert sum(n for n, _ in groups) == 12
        assert all(g["y"].shape == (n, 128) for n, g in groups if n > 1)
