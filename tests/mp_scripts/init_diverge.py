"""``init_sharded`` under several processes: the same program is checked (issue 19).

Run under ``jaxdev launch -n 2 --devices-per-process 4 -- python init_diverge.py MODE``.
``same``: a deterministic init from typed keys passed as arguments (the
README's ``init_sharded(init, jax.random.key(0), ...)``, threefry and rbg),
which passes and prints the sum of the params, after the keys went through
``assert_same_across_processes`` and ``shard_batch``'s shape check;
``numpy``: an ``init_fn`` that draws from ``np.random`` seeded per process,
so each process would hold other shards and replicas.
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
    keys = {"fry": jax.random.key(0), "rbg": jax.random.key(0, impl="rbg")}
    if mode == "numpy":
        rng = np.random.default_rng(int(os.environ["JAXDEV_PROCESS_ID"]))

        def init_fn(keys):
            return {"w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}

    else:
        jaxdev.distributed.assert_same_across_processes(keys)
        jaxdev.shard_batch({k: jax.random.split(v, 4) for k, v in keys.items()}, mesh)

        def init_fn(keys):
            return {"w": jax.random.normal(keys["fry"], (64, 8)) + jax.random.normal(keys["rbg"])}

    try:
        params = jaxdev.init_sharded(init_fn, keys, mesh=mesh, rules="fsdp", min_size=0)
    except jaxdev.DistributedError as e:
        print(f"REFUSED: {str(e).splitlines()[0]}", flush=True)
        return 7
    total = float(jax.jit(jnp.sum, out_shardings=jaxdev.as_sharding(mesh))(params["w"]))
    print(f"OK sum={total:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
