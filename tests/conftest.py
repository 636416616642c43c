"""Test set-up: 8 fake CPU devices, configured before JAX's backend starts.

Tests that need another device count run in a subprocess (see
``run_python`` below).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax

N_DEVICES = 8

# Must happen before anything asks JAX for a device. GPU runs opt in with
# JAXDEV_TEST_GPU=1 (then JAX picks the accelerator; CPU stays 8 fake devices).
GPU_RUN = os.environ.get("JAXDEV_TEST_GPU") == "1"
if not GPU_RUN:
    jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", N_DEVICES)

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    has_gpu = GPU_RUN and any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a GPU backend; this host has none (JAX runs on CPU)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120.0):
    """Run ``code`` in a fresh Python process; return the CompletedProcess.

    The child gets a clean JAX environment (no inherited device count) plus
    ``env``; it is killed after ``timeout`` seconds.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    child_env["PYTHONPATH"] = REPO + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
