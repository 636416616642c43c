"""A multi-process worker for tests/test_multihost.py and benchmarks/multihost_faults.py.

Run under ``jaxdev launch -n 2 --devices-per-process 4 -- python worker.py SCENARIO``.
Scenarios: ``happy`` and the faults ``never_starts``, ``sigkill``, ``loader_hang``,
``batch_shapes``, ``device_counts``, ``duplicate_id``, ``never_joined``,
``extra_collective``, ``different_program`` (a train step whose loss process 1
scales by 2) and ``different_reduction`` (3 processes; process 2 takes the max
where the others take the mean). Timeouts come from the ``JAXDEV_*_TIMEOUT``
environment the test sets.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import jaxdev

ROWS = 4  # local rows per process


def init_kwargs(scenario: str, pid: int) -> dict:
    """Arguments that inject the start-up faults."""
    if scenario == "device_counts" and pid == 1:
        return {"local_device_count": 2}
    if scenario == "duplicate_id" and pid == 1:
        return {"process_id": 0}
    return {}


def load_batch(scenario: str, pid: int) -> dict:
    """The data loader: process p holds rows [4p, 4p + 4) of arange(8).

    In ``batch_shapes`` process 1 brings 8 rows: a size each process could
    split over its own 4 devices, but not the same as process 0's.
    """
    if scenario == "loader_hang" and pid == 1:
        time.sleep(3600)
    rows = 2 * ROWS if scenario == "batch_shapes" and pid == 1 else ROWS
    x = np.arange(rows, dtype=np.float32) + ROWS * pid
    return {"x": x, "y": np.ones((rows, 2), np.int32)}


def make_step(pid: int, scenario: str):
    """A jitted global step: mean of x over every device of every process.

    Wrapped in ``same_program``: its first call checks every process compiled
    the same program (process 2 of ``different_reduction`` takes the max).
    """
    import jax

    def die_mid_step(x):
        if scenario == "sigkill" and pid == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    reduce = "max" if scenario == "different_reduction" and pid == 2 else "mean"

    @jaxdev.distributed.same_program
    @jax.jit
    def step(batch, k):
        jax.debug.callback(die_mid_step, batch["x"], partitioned=True)  # runs per shard
        return getattr(batch["x"], reduce)() * k, batch["y"].sum()

    return step


def train_alone(pid: int) -> int:
    """``never_joined``: train on this process's devices only, as if single-process."""
    import jax
    import jax.numpy as jnp

    mean = float(jnp.mean(jaxdev.shard_batch(load_batch("happy", pid), jaxdev.data_mesh())["x"]))
    print(f"process {pid} trained alone on {jax.device_count()} devices: mean {mean}")
    return 0


def train_step_program(pid: int) -> int:
    """``different_program``: a jaxdev train step; process 1 scales its loss by 2."""
    import jax.numpy as jnp
    import optax

    scale = 2.0 if pid == 1 else 1.0

    def loss_fn(params, batch):
        return scale * (batch["x"] * params["w"]) ** 2

    step = jaxdev.make_train_step(loss_fn, optax.sgd(0.1), jaxdev.Strategy.sharded())
    state = step.init_state({"w": jnp.ones(())}, optax.sgd(0.1))
    state, metrics = step(state, step.put_batch(load_batch("happy", pid)))
    print(f"step 1: loss {metrics.fetch()['loss']}")
    return 0


def main(scenario: str) -> int:
    pid = int(os.environ["JAXDEV_PROCESS_ID"])
    if scenario == "never_starts" and pid == 1:
        time.sleep(3600)  # never reaches initialize
    if scenario == "never_joined" and pid == 1:
        return train_alone(pid)  # forgot initialize: runs alone, exits 0
    jaxdev.distributed.initialize(**init_kwargs(scenario, pid))
    if scenario == "different_program":
        return train_step_program(pid)
    mesh = jaxdev.data_mesh()  # every device of every process
    step = make_step(pid, scenario if scenario == "different_reduction" else "")
    for k in (1.0, 2.0):
        batch = jaxdev.shard_batch(load_batch(scenario, pid), mesh)
        if k == 2.0:
            step = make_step(pid, scenario)
        mean, total = step(batch, k)
        mean, total = float(mean), int(total)
        print(f"step {k:g}: global shape {batch['x'].shape} mean {mean} y-sum {total}")
        if (mean, total) != (3.5 * k, 16):
            print(f"WRONG RESULT: mean {mean} (expected {3.5 * k}), y-sum {total} (expected 16)")
            return 3
    params = {"w": np.linspace(0, 1, 5, dtype=np.float32), "step": np.int32(2)}
    jaxdev.distributed.assert_same_across_processes(params)
    print("assert_same_across_processes: equal params pass")
    drifted = {"w": params["w"] + pid, "step": params["step"]}
    try:
        jaxdev.distributed.assert_same_across_processes(drifted)
    except jaxdev.PlacementAssertionError as e:
        print(f"assert_same_across_processes caught drift: {e}")
    else:
        print("assert_same_across_processes MISSED a difference")
        return 4
    if scenario == "extra_collective" and pid == 1:  # e.g. a metric logged on one host only
        import jax.numpy as jnp

        print(f"extra: {float(jnp.sum(batch['x']))}")  # a collective no other process runs
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
