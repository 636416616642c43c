"""FSDP training across processes, for tests/test_multihost_sharded.py.

Run as 2 processes x 4 fake CPU devices::

    jaxdev launch -n 2 --devices-per-process 4 -- python tests/mp_scripts/fsdp_train.py

or as 1 process x 8 fake CPU devices (``python tests/mp_scripts/fsdp_train.py``); both
print one ``RESULT {...}`` JSON line per process with the loss and the gathered
parameters' checksums, which must agree to float tolerance.

The params are sharded over the ``fsdp`` axis of a global ``data=2 x fsdp=4`` mesh (with
2 processes each process holds half of every sharded leaf); every process brings only its
own rows of each global batch. The run mixes plain steps, an uneven batch (padded and
masked per process), ``steps_per_call=2`` and ``accumulate=2``.
"""

from __future__ import annotations

import json
import os

import jaxdev

MULTI = "JAXDEV_COORDINATOR" in os.environ
if MULTI:
    jaxdev.distributed.initialize()
else:
    jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

FEATURES, HIDDEN, CLASSES, ROWS = 32, 64, 16, 64
TX = optax.sgd(0.1)


def loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": np.asarray(jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.2),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": np.asarray(jax.random.normal(k2, (HIDDEN, CLASSES)) * 0.2),
        "b2": np.zeros(CLASSES, np.float32),
    }


def global_batch(i: int, rows: int = ROWS) -> dict:
    rng = np.random.default_rng(i)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return {"x": x, "y": (x[:, :CLASSES].argmax(-1)).astype(np.int32)}


def local(batch: dict, lead: int = 0) -> dict:
    """This process's contiguous slice of the rows (axis ``lead``)."""
    n, p = jax.process_count(), jax.process_index()
    rows = batch["x"].shape[lead]
    per = rows // n
    return {k: np.take(v, np.arange(p * per, (p + 1) * per), axis=lead) for k, v in batch.items()}


def main() -> int:
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})  # every device of every process
    strategy = jaxdev.Strategy.sharded(mesh, rules="fsdp")
    one = jaxdev.make_train_step(loss_fn, TX, strategy)
    two = jaxdev.make_train_step(loss_fn, TX, strategy, steps_per_call=2)
    acc = jaxdev.make_train_step(loss_fn, TX, strategy, accumulate=2)
    state = one.init_state(init_params(), TX)
    assert state.params["w1"].sharding.spec == P(None, "fsdp"), state.params["w1"].sharding
    metrics = None
    for i in range(6):
        state, metrics = one(state, one.put_batch(local(global_batch(i))), metrics)
    uneven = one.put_batch(local(global_batch(6, rows=58)))  # 29 rows per process
    assert isinstance(uneven, jaxdev.Padded)
    state, metrics = one(state, uneven, metrics)
    pair = [global_batch(i) for i in (7, 8)]
    stacked = {k: np.stack([b[k] for b in pair]) for k in pair[0]}
    state, metrics = two(state, two.put_batch(local(stacked, lead=1)), metrics)
    state, metrics = acc(state, acc.put_batch(local(global_batch(9))), metrics)
    out = metrics.fetch()
    gathered = jax.jit(lambda p: p, out_shardings=NamedSharding(mesh, P()))(state.params)
    host = {k: np.asarray(v.addressable_data(0)) for k, v in gathered.items()}
    result = {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "steps": int(np.asarray(state.step.addressable_data(0))),
        "loss": out["loss"],
        "sums": {k: float(np.abs(v).sum()) for k, v in sorted(host.items())},
        "w1_head": host["w1"][0, :4].tolist(),
        "w1_shard_shape": list(state.params["w1"].addressable_shards[0].data.shape),
    }
    print("RESULT " + json.dumps(result), flush=True)
    if MULTI:
        jaxdev.distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
