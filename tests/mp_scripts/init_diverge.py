"""``init_sharded`` under several processes: the same program is checked (issue 19).

Run under ``jaxdev launch -n 2 --devices-per-process 4 -- python init_diverge.py MODE``.
``same``: a deterministic init (``jax.random``), which passes and prints the
sum of the params; ``numpy``: an ``init_fn`` that draws from ``np.random``
seeded per process, so each process would hold other shards and replicas.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import jaxdev


def main(mode: str) -> int:
    jaxdev.distributed.initialize()
    import jax
    import jax.numpy as jnp

    mesh = jaxdev.make_mesh({"fsdp": 8})
    if mode == "numpy":
        rng = np.random.default_rng(int(os.environ["JAXDEV_PROCESS_ID"]))

        def init_fn():
            return {"w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}

    else:

        def init_fn():
            return {"w": jax.random.normal(jax.random.key(0), (64, 8))}

    try:
        params = jaxdev.init_sharded(init_fn, mesh=mesh, rules="fsdp", min_size=0)
    except jaxdev.DistributedError as e:
        print(f"REFUSED: {str(e).splitlines()[0]}", flush=True)
        return 7
    total = float(jax.jit(jnp.sum, out_shardings=jaxdev.as_sharding(mesh))(params["w"]))
    print(f"OK sum={total:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
