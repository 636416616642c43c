"""Test set-up: 8 fake CPU devices, configured before JAX's backend starts.

Tests that need another device count are marked ``@pytest.mark.devices(n)``
or ``@pytest.mark.processes(n, devices=m)`` (jaxdev's pytest plugin, which
re-applies its own count after this file). ``run_python`` and ``launch``
below, both with ``clean_env()``, run code that needs a process of its own
(environment variables, crashes, the launcher itself).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax

N_DEVICES = 8

# Must happen before anything asks JAX for a device. GPU runs opt in with
# JAXDEV_TEST_GPU=1 (then JAX picks the accelerator; CPU stays 8 fake devices).
GPU_RUN = os.environ.get("JAXDEV_TEST_GPU") == "1"
if not GPU_RUN:
    jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", N_DEVICES)

import pytest  # noqa: E402
from mp_scripts.child_env import REPO, clean_env  # noqa: E402, F401 - re-exported to the tests


def pytest_collection_modifyitems(config, items):
    has_gpu = GPU_RUN and any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a GPU backend; this host has none (JAX runs on CPU)")
    plugin = has_cuda_plugin()
    no_plugin = pytest.mark.skip(reason="compiles for a GPU target: needs jaxdev[cuda12]")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
        if item.get_closest_marker("target") and not plugin:
            item.add_marker(no_plugin)


def has_cuda_plugin() -> bool:
    """Whether JAX's CUDA 12 plugin is installed (``jaxdev[cuda12]``): GPU targets compile."""
    return bool(importlib.util.find_spec("jax_plugins")) and bool(
        importlib.util.find_spec("jax_plugins.xla_cuda12")
    )


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120.0):
    """Run ``code`` in a fresh Python process; return the CompletedProcess.

    The child gets ``clean_env()`` plus ``env``; it is killed after
    ``timeout`` seconds.
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch(
    n: int, devices_per_process: int, cmd: list[str], timeout: float = 150.0
) -> subprocess.CompletedProcess:
    """Run ``cmd`` under ``python -m jaxdev launch`` as ``n`` x ``devices_per_process``.

    The launcher ends the processes after ``timeout`` seconds (``--timeout``);
    the launcher itself is killed 50 s later. The environment is
    ``clean_env()``; stdout holds the ``[p<id>]``-prefixed lines.
    """
    launcher = [sys.executable, "-m", "jaxdev", "launch", "-n", str(n)]
    options = ["--devices-per-process", str(devices_per_process), "--timeout", f"{timeout:g}"]
    return subprocess.run(
        [*launcher, *options, "--", *cmd],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout + 50,
    )


def kill_when_ready(cmd: list[str], env: dict[str, str], ready: str, delay: float) -> None:
    """Start ``cmd``; once a stdout line starts with ``ready``, wait ``delay`` s, SIGKILL it.

    The child is killed by its own pid and always reaped (bounded waits);
    its stderr is dropped.
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in proc.stdout:
            if line.startswith(ready.encode()):
                break
        else:
            raise AssertionError(f"{cmd[1:3]} exited before printing {ready!r}")
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)  # this child, by its own pid
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()


@pytest.fixture
def devices():
    """The 8 fake CPU devices."""
    devs = jax.devices("cpu")
    assert len(devs) == N_DEVICES, f"expected {N_DEVICES} fake devices, got {devs}"
    return devs


@pytest.fixture
def mesh():
    """A one-axis ``data`` mesh over the 8 fake CPU devices (``jaxdev.data_mesh()``)."""
    import jaxdev

    return jaxdev.data_mesh()


@pytest.fixture
def disk_full(monkeypatch):
    """Every array write of orbax fails with ENOSPC, as a full disk makes tensorstore fail.

    (Patches orbax's array handler: the one place a test reaches into orbax's
    ``_src``; ``monkeypatch.undo()`` gives the space back.)
    """
    import errno

    from orbax.checkpoint._src.serialization import jax_array_handlers

    async def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jax_array_handlers.ArrayHandler, "serialize", no_space)


@pytest.fixture(scope="session")
def fsdp8():
    """A one-axis ``fsdp`` mesh over the 8 fake CPU devices."""
    import jaxdev

    return jaxdev.make_mesh({"fsdp": 8})


@pytest.fixture(scope="session")
def dm():
    """A ``data=2 x model=4`` mesh."""
    import jaxdev

    return jaxdev.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="session")
def df():
    """A ``data=2 x fsdp=4`` mesh."""
    import jaxdev

    return jaxdev.make_mesh({"data": 2, "fsdp": 4})
