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
* ``extra``: after step 4, ``PROCESS`` runs a collective no other process
  joins (a metric of the global batch logged on one process only);
* ``gil``: after step 4 and 0.3 s of host work, ``PROCESS`` holds the GIL in
  C code for ``4 S`` (its watchdog cannot answer);
* ``healthy``: no stall, none of the watchdog's phases over its allowance
  (``S`` is ``$JAXDEV_HANG_TIMEOUT``): the first call traces for ``1.25 S``
  (a slow compile); step 4 brings a batch of another shape, whose trace
  takes ``1.25 S`` too (a recompile mid-run); after the last shared step 5,
  process 1 runs 3 more steps on its own device (uneven step counts) and
  finishes first, while process 0 does ``2 S`` of host work
  (post-processing, no heartbeat);
* ``end``: no stall, the end of a run: after 5 steps, an evaluation loop of
  your own ``jax.jit`` (a cross-process mean) on both processes for about
  ``1.5 S`` (the same number of calls) with no heartbeat, then ``1.5 S`` of
  post-processing on process 0 while process 1 waits in JAX's
  ``multihost_utils.sync_global_devices``;
* ``slow30``: no stall: the first call traces for 15 s, then 30 steps of
  3 s (issue 21's case, ~105 s: ``benchmarks/hang_faults.py`` runs it).

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


def load(i: int, pid: int, stall: bool = False, rows: int = ROWS) -> dict:
    """The data loader: ``rows`` rows per process, under a ``data`` heartbeat."""
    jaxdev.distributed.heartbeat("data")
    if stall:
        print(f"STALL {time.time()}", flush=True)
        time.sleep(120)  # the loader hangs
    x = np.arange(rows, dtype=np.float32) + rows * pid + i
    return {"x": x, "y": 2 * x}


def end_of_run(jax, pid: int, s: float, w, x) -> None:
    """Your own jit's evaluation loop for ``1.5 S``, then post-processing and JAX's end barrier."""
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    @jax.jit
    def evaluate(w, x):  # ~1 GFLOP per device (the wait dominates), then a mean over both
        y, m = x[:, None, None] * w * jnp.ones((1, 256, 64)), jnp.full((64, 64), 1 / 64)
        return jnp.mean(jax.lax.fori_loop(0, 500, lambda _, y: jnp.tanh(y @ m), y))

    float(evaluate(w, x))  # compiles
    start = time.monotonic()
    for _ in range(10):
        float(evaluate(w, x))
    calls = 1.5 * s * 10 / (time.monotonic() - start)  # ~1.5 S of calls, process 0's count
    calls = int(multihost_utils.broadcast_one_to_all(np.int32(calls)))  # one count for all
    for _ in range(calls):  # (a loop by each one's clock can call once more: a real hang)
        float(evaluate(w, x))
    print(f"evaluated {calls + 10} times in {time.monotonic() - start:.1f} s", flush=True)
    if pid == 0:
        time.sleep(1.5 * s)  # post-processing: host work, no heartbeat
    multihost_utils.sync_global_devices("end")  # process 1 waits here for 1.5 S


def hold_gil(seconds: float) -> None:
    """0.3 s of host work after a step, then C code holding the GIL (a big ``pickle.dumps``)."""
    start = time.monotonic()
    while time.monotonic() < start + 0.3:  # the watchdog's thread runs between bytecodes
        pass
    took = []
    for _ in range(3):  # the fastest of 3: a busy machine's slower runs make it longer
        start = time.monotonic()
        sum(range(10**6))
        took.append(time.monotonic() - start)
    print(f"STALL {time.time()}", flush=True)
    sum(range(int(10**6 * seconds / min(took))))  # one C call: the GIL is never released


def main(scenario: str, stalled: int) -> int:
    jaxdev.distributed.initialize()  # JAXDEV_HANG_TIMEOUT starts the watchdog
    import jax
    import optax

    pid = jax.process_index()
    s = float(os.environ.get("JAXDEV_HANG_TIMEOUT", "10"))
    healthy, slow = scenario == "healthy", scenario == "slow30"
    trace_s = [1.25 * s if healthy else 15.0 if slow else 0.0]  # the next trace's time

    def loss_fn(w, batch):
        time.sleep(trace_s[0])  # tracing is part of a call that compiles: a slow compile
        trace_s[0] = 0.0
        return (batch["x"] * w - batch["y"]) ** 2

    tx = optax.sgd(0.01)
    step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded())
    state, metrics = step.init_state(np.float32(0.0), tx), None
    steps = {"healthy": 5, "end": 5, "slow30": 31}.get(scenario, 8)  # slow30: 1 + 30 steps of 3 s
    for i in range(1, steps + 1):
        stall = pid == stalled and i == STALL_STEP
        if healthy and i == 4:  # a batch of another shape: the same step recompiles
            trace_s[0] = 1.25 * s
        rows = 2 * ROWS if healthy and i == 4 else ROWS
        batch = step.put_batch(load(i, pid, stall and scenario == "loader", rows))
        if stall and scenario == "step":
            print(f"STALL {time.time()}", flush=True)
            time.sleep(120)  # the stalled process, before its step 5
        if stall and scenario == "kill":
            print(f"STALL {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = step(state, batch, metrics)
        jax.block_until_ready(state)
        print(f"step {i} done", flush=True)
        if scenario == "extra" and pid == stalled and i == STALL_STEP - 1:
            print(f"STALL {time.time()}", flush=True)  # a metric logged on one process only:
            print(f"extra {float(jax.numpy.sum(batch['x']))}")  # a collective no other joins
        if scenario == "gil" and pid == stalled and i == STALL_STEP - 1:
            hold_gil(4 * s)
        if slow and i > 1:
            time.sleep(3)  # a slow step: 3 s of host work, no heartbeat
    print(f"loss {float(metrics.fetch()['loss']):.4f}")
    if scenario == "end":
        end_of_run(jax, pid, s, state.params, batch["x"])
    if healthy and pid == 1:  # 3 more steps on its own device, then it finishes first
        mine = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.single(jax.local_devices()[0]))
        own = mine.init_state(np.float32(0.0), tx)
        for i in range(3):
            own, _ = mine(own, mine.put_batch(load(i, pid)))
        jax.block_until_ready(own)
    if healthy and pid == 0:
        time.sleep(2 * s)  # post-processing after its last step: host work, no heartbeat
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
