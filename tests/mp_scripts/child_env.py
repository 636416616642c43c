"""The environment of a child process started by the tests and the fault benchmarks.

Imported by ``tests/conftest.py``, ``hang_runs.py`` and ``matrix.py``; it
imports nothing from JAX, so a benchmark can use it without configuring a
backend.
"""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment, less JAX/XLA/jaxdev settings, for a child process.

    Drops every ``XLA_*``, ``JAX_*`` and ``JAXDEV_*`` variable (so the child
    neither inherits a device count nor believes it is a launched process),
    puts the repository on ``PYTHONPATH`` and adds ``extra``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "JAXDEV_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env
