"""Data parallel training with ``jax.jit`` + ``NamedSharding``: one program, a mesh of devices.

Run: ``python examples/sharded_data_parallel.py``. The modern JAX way: the
parameters are replicated (``P()``), the batch is split over the mesh's
``data`` axis (``P('data')``) and XLA inserts the gradient all-reduce.
Shown three ways: ``jaxdev.data_parallel`` for inference, a hand-written
jitted step, and ``jaxdev.make_train_step(..., sharded())`` with K steps per
call. Every local device is used (8 fake CPUs without an accelerator).
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

TX = optax.adam(0.05)


def predict(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def per_example_loss(params, batch):
    return (predict(params, batch["x"])[:, 0] - batch["y"]) ** 2


def make_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(n, 2)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, 0]) * np.cos(x[:, 1]).astype(np.float32)}


def init_params(seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (2, 32)) * 0.5, "w2": jax.random.normal(k2, (32, 1)) * 0.2}


def main() -> None:
    mesh = jaxdev.data_mesh()
    params = init_params()

    # 1. Inference on any number of rows: shard, run, gather exactly the original rows.
    dp = jaxdev.data_parallel(predict, mesh)
    out = dp(params, make_data(37)["x"])
    print(f"data_parallel: 37 rows in, {out.shape[0]} rows out, over {mesh.size} devices")

    # 2. A hand-written jitted step: the shardings say everything.
    rep = jaxdev.as_sharding(mesh)

    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: per_example_loss(p, batch).mean())(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step, out_shardings=(rep, rep))
    data = make_data(64 * mesh.size)
    p, opt = jaxdev.replicate((params, TX.init(params)), mesh)
    batch = jaxdev.shard_batch(data, mesh)
    jaxdev.assert_sharded(batch, P("data"), mesh=mesh)
    for _ in range(100):
        # Waiting each step: on a host with few cores, XLA's CPU all-reduce between fake
        # devices can deadlock when many such steps are queued (JAX 0.10.2, 2 cores).
        p, opt = jax.block_until_ready(step(p, opt, batch))
    jaxdev.assert_replicated(p, mesh)
    hand_loss = float(per_example_loss(p, batch).mean())

    # 3. jaxdev's step, 10 steps per dispatch (lax.scan), metrics kept on device.
    k = 10
    train = jaxdev.make_train_step(
        per_example_loss, TX, jaxdev.Strategy.sharded(mesh), steps_per_call=k
    )
    state = train.init_state(params, TX)
    stacked = train.put_batch({key: np.stack([v] * k) for key, v in data.items()})  # (K, B, ...)
    for _ in range(100 // k):
        state, metrics = train(state, stacked)
    ours = float(per_example_loss(state.params, batch).mean())
    print(f"loss after 100 steps: hand-written {hand_loss:.4f}, jaxdev {ours:.4f}")
    print(f"last call's mean loss (10 steps, on device until now): {metrics.fetch()['loss']:.4f}")
    np.testing.assert_allclose(hand_loss, ours, rtol=1e-3, atol=1e-5)
    print("sharded data parallel: ok")


if __name__ == "__main__":
    main()
