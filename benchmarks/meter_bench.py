"""What the step meter costs: the same training loop with and without ``jaxdev.meter.StepMeter``.

Interleaved repetitions (plain, metered, plain, ...), medians of the wall, CPU (all threads,
XLA's too) and loop-thread CPU time per step (CPU time is steadier on a loaded machine; the
meter's own cost is on the loop's thread); each repetition enters and leaves a meter, so its
fixed cost is spread over ``--steps``. A small MLP step (dispatch-bound on CPU) and larger
ones. The issue's goal: at most 2% of step time.

    python benchmarks/meter_bench.py [--reps 15] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdev


def make_loop(width: int, rows: int):
    """``run(metered, steps) -> (wall, CPU) seconds per step`` of a single-device SGD loop."""

    def loss(p, b):
        h = b["x"]
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2, axis=1)

    tx = optax.sgd(1e-3)
    step = jaxdev.make_train_step(loss, tx, jaxdev.Strategy.single())
    state = step.init_state([jnp.full((width, width), 0.01) for _ in range(3)], tx)
    batch = step.put_batch({"x": np.ones((rows, width), np.float32)})
    for _ in range(3):
        state, _ = step(state, batch)
    box = [state]

    def run(metered: bool, steps: int) -> tuple[float, float, float]:
        state = box[0]
        t, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        if metered:
            with jaxdev.meter.StepMeter(examples_per_step=rows):
                for _ in range(steps):
                    state, _ = step(state, batch)
        else:
            for _ in range(steps):
                state, _ = step(state, batch)
            jax.block_until_ready(state)
        box[0] = state
        done = time.perf_counter() - t, time.process_time() - cpu, time.thread_time() - main
        return tuple(x / steps for x in done)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.reps} reps, "
          f"load {os.getloadavg()[0]:.1f}")
    for width, scale in ((32, 1), (256, 4), (512, 20)):  # fewer steps per rep when larger
        name, run, steps = f"MLP 3x{width}, {width} rows", make_loop(width, width), args.steps
        times = {False: [], True: []}
        for _ in range(args.reps):
            for metered in (False, True):
                times[metered].append(run(metered, max(steps // scale, 5)))
        step_time = statistics.median(t[0] for t in times[False])  # plain wall: the base
        for i, what in enumerate(("wall", "CPU time", "loop-thread CPU")):
            plain, metered = (statistics.median(t[i] for t in times[k]) for k in (False, True))
            print(
                f"{name}, {what}: plain {plain * 1e6:,.1f} us/step, metered "
                f"{metered * 1e6:,.1f} us/step, overhead {100 * (metered / plain - 1):+.1f}%"
                + (f" ({100 * (metered - plain) / step_time:+.2f}% of step time)" if i else "")
            )
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
