"""Save step 1, start an asynchronous save of step 2, SIGKILL this process mid-write.

Usage: ``python ckpt_async_kill.py DIR``. Prints ``step 2 in flight`` just
before killing itself by its own pid while the background thread is still
writing step 2 (its temporary directory exists, no commit yet).
"""

from __future__ import annotations

import os
import signal
import sys

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402


def main(directory: str) -> None:
    small = jaxdev.TrainState.create({"w": jnp.ones((4, 4))}, optax.sgd(0.1))
    big = jaxdev.TrainState.create({"w": jnp.ones((4096, 4096))}, optax.sgd(0.1))  # 64 MiB
    ckpt = jaxdev.Checkpointer(directory, async_=True)
    ckpt.save(1, small)
    ckpt.wait()
    ckpt.save(2, big)
    tmp = [n for n in os.listdir(directory) if n.startswith("2.orbax-checkpoint-tmp")]
    print(f"step 2 in flight: {tmp}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
