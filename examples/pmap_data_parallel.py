"""Data parallel training with ``jax.pmap``: by hand with jaxdev's helpers, then jaxdev's step.

Run: ``python examples/pmap_data_parallel.py``. PyTorch's ``nn.DataParallel``
idea (split the batch, replicate the model, combine the gradients) in the
layout ``jax.pmap`` wants: a leading device axis. Both versions reach the
same parameters. Every local device is used (8 fake CPUs without an
accelerator).
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

TX = optax.sgd(0.1)


def per_example_loss(params, batch):
    return (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2


def make_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3).astype(np.float32)
    return {"x": x, "y": y}


def by_hand(params, data, steps):
    """Hand-written pmap step on a batch that divides evenly over the devices."""

    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: per_example_loss(p, batch).mean())(params)
        grads = jax.lax.pmean(grads, "batch")  # forget this and the replicas drift apart
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    pstep = jax.pmap(step, axis_name="batch")
    params = jaxdev.pmap.stack_for_pmap(params)  # flax's replicate: (n, ...) with row i on device i
    opt_state = jaxdev.pmap.stack_for_pmap(TX.init(jaxdev.pmap.unstack_from_pmap(params)))
    batch = jaxdev.pmap.shard_for_pmap(data)  # (B, ...) -> (n, B/n, ...)
    for _ in range(steps):
        # Waiting each step: on a host with few cores, XLA's CPU all-reduce between fake
        # devices can deadlock when several pmap steps are queued (JAX 0.10.2, 2 cores).
        params, opt_state = jax.block_until_ready(pstep(params, opt_state, batch))
    return jaxdev.pmap.unstack_from_pmap(params, check=True)  # check: every replica identical


def with_jaxdev(params, data, steps):
    """The same with jaxdev's pmap strategy: params truly replicated, any batch size."""
    step = jaxdev.make_train_step(per_example_loss, TX, jaxdev.Strategy.pmap())
    state = step.init_state(params, TX)
    batch = step.put_batch(data)
    metrics = None
    for _ in range(steps):
        state, metrics = step(state, batch, metrics)
    print(f"jaxdev pmap: mean loss over {steps} steps {metrics.fetch()['loss']:.4f}")
    return jaxdev.unreplicate(state.params, check=True)


def main() -> None:
    n = jax.local_device_count()
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    data = make_data(16 * n)
    hand = by_hand(params, data, steps=50)
    ours = with_jaxdev(params, data, steps=50)
    for k in params:
        np.testing.assert_allclose(np.asarray(hand[k]), np.asarray(ours[k]), atol=1e-5)
    print(f"{n} devices, w = {np.round(np.asarray(ours['w']), 3)}, b = {float(ours['b']):.3f}")

    # An uneven batch is padded and masked, never dropped: 16n + 3 rows.
    uneven = make_data(16 * n + 3, seed=1)
    step = jaxdev.make_train_step(per_example_loss, TX, jaxdev.Strategy.pmap())
    batch = step.put_batch(uneven)
    print(f"uneven batch: {batch.size} rows padded to {batch.mask.size}, mask {batch.mask.shape}")
    print("pmap data parallel: ok")


if __name__ == "__main__":
    main()
