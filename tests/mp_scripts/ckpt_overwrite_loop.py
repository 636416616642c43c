"""Overwrite one checkpoint path in a loop until killed (tests/test_checkpoint_safety.py).

Usage: ``python ckpt_overwrite_loop.py PATH``. Save ``i`` writes
``{"w": full((256, 256), i), "step": i}`` with ``step=i``; after the first
save it prints ``saved 0`` so the test knows a checkpoint exists before it
kills this process at a random moment.
"""

from __future__ import annotations

import sys

import jaxdev

jaxdev.testing.use_fake_cpu_devices(2)

import jax.numpy as jnp  # noqa: E402


def main(path: str) -> None:
    i = 0
    while True:
        tree = {"w": jnp.full((256, 256), float(i)), "step": i}
        jaxdev.save(path, tree, step=i, overwrite=i > 0)
        if i == 0:
            print("saved 0", flush=True)
        i += 1


if __name__ == "__main__":
    main(sys.argv[1])
