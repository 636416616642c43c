"""A multi-process training loop that stalls on purpose, for tests/test_hang.py.

Run as 2 processes x 4 fake CPU devices, under
``jaxdev launch -n 2 --devices-per-process 4 --hang-timeout S -- python hang.py ...``
or started by hand with the ``JAXDEV_*`` environment (``JAXDEV_HANG_TIMEOUT=S``)::

    python hang.py SCENARIO [PROCESS]

Scenarios (``PROCESS``: the one that stalls, default 1):

* ``step``: ``PROCESS`` sleeps 120 s before its step 5 (its batch is built);
* ``loader``: ``PROCESS`` sleeps 120 s in its data loader for step 5, after
  ``heartbeat("data")``;
* ``kill``: ``PROCESS`` is SIGKILLed before its step 5 (its batch is built);
* ``slow``: no stall: the first call traces for 15 s (a slow compile), then
  5 steps of 3 s each; ``slow30``: the same with 30 steps of 3 s (the
  issue's case, ~105 s: ``benchmarks/hang_faults.py`` runs it).

Each process prints ``STALL <time.time()>`` just before it stalls and
``DONE`` at the end.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import jaxdev

STALL_STEP = 5
ROWS = 4  # local rows per process: one per local device


def load(i: int, pid: int, stall: bool) -> dict:
    """The data loader: 4 rows per process, under a ``data`` heartbeat."""
    jaxdev.distributed.heartbeat("data")
    if stall:
        print(f"STALL {time.time()}", flush=True)
        time.sleep(120)  # the loader hangs
    x = np.arange(ROWS, dtype=np.float32) + ROWS * pid + i
    return {"x": x, "y": 2 * x}


def main(scenario: str, stalled: int) -> int:
    jaxdev.distributed.initialize()  # JAXDEV_HANG_TIMEOUT starts the watchdog
    import jax
    import optax

    pid = jax.process_index()
    slow = scenario in ("slow", "slow30")
    slow_compile = [slow]

    def loss_fn(w, batch):
        if slow_compile[0]:  # tracing is part of the first call: a 15 s compile
            slow_compile[0] = False
            time.sleep(15)
        return (batch["x"] * w - batch["y"]) ** 2

    tx = optax.sgd(0.01)
    step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded())
    state, metrics = step.init_state(np.float32(0.0), tx), None
    steps = {"slow": 6, "slow30": 31}.get(scenario, 8)  # slow: the first call, then 3 s steps
    for i in range(1, steps + 1):
        stall = pid == stalled and i == STALL_STEP
        batch = step.put_batch(load(i, pid, stall and scenario == "loader"))
        if stall and scenario == "step":
            print(f"STALL {time.time()}", flush=True)
            time.sleep(120)  # the stalled process, before its step 5
        if stall and scenario == "kill":
            print(f"STALL {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = step(state, batch, metrics)
        jax.block_until_ready(state)
        print(f"step {i} done", flush=True)
        if slow and i > 1:
            time.sleep(3)  # a slow step: 3 s of host work, no heartbeat
    print(f"loss {float(metrics.fetch()['loss']):.4f}")
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
