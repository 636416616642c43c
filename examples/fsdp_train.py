"""FSDP: parameters and Adam state sharded over devices, the batch split over all of them.

Run: ``python examples/fsdp_train.py``. A ``data=2 x fsdp=4`` mesh over 8
devices (8 fake CPUs without an accelerator): ``rules="fsdp"`` splits each big
leaf along its largest dimension over the 4 ``fsdp`` devices (small leaves stay
replicated), the optimizer state follows the params, and the batch is split 8
ways over ``("data", "fsdp")``. XLA gathers each layer's weights for the
forward and backward pass and reduce-scatters the gradients. The replicated run
on the same data gives the same loss.
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

STEPS, BATCH, FEATURES, CLASSES = 40, 64, 64, 10


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(CLASSES)(x)


MODEL = MLP()


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def make_batches(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    out = []
    for _ in range(STEPS):
        y = rng.integers(0, CLASSES, size=BATCH).astype(np.int32)
        x = centers[y] + rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        out.append({"x": x, "y": y})
    return out


def per_device_bytes(tree) -> int:
    """Bytes the first device holds (every device holds as much here)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def train(strategy: jaxdev.Strategy, batches: list[dict]):
    tx = optax.adam(1e-3)
    step = jaxdev.make_train_step(loss_fn, tx, strategy)
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]
    state, metrics = step.init_state(params, tx), None
    for batch in batches:
        state, metrics = step(state, step.put_batch(batch), metrics)
    return state, metrics.fetch()["loss"]


def main() -> None:
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    batches = make_batches()
    fsdp = jaxdev.Strategy.sharded(mesh, rules="fsdp")
    print(f"mesh {dict(mesh.shape)}; batch split over {fsdp.axis} ({fsdp.n_devices} ways)")
    state, loss = train(fsdp, batches)
    replicated, rep_loss = train(jaxdev.Strategy.sharded(mesh), batches)

    kernel = state.params["Dense_0"]["kernel"]
    print(
        f"Dense_0/kernel {kernel.shape}: spec {kernel.sharding.spec}, "
        f"{kernel.addressable_shards[0].data.shape} per device"
    )
    n = sum(x.size for x in jax.tree.leaves(state.params))
    print(f"{n:,} params; per-device bytes of params + adam state:")
    for name, s in (("replicated", replicated), ("fsdp", state)):
        p, o = per_device_bytes(s.params), per_device_bytes(s.opt_state)
        print(
            f"  {name:>10}: params {p / 2**20:6.2f} MiB + opt state {o / 2**20:6.2f} MiB "
            f"= {(p + o) / 2**20:6.2f} MiB"
        )
    ratio = (per_device_bytes(state.params) + per_device_bytes(state.opt_state)) / (
        per_device_bytes(replicated.params) + per_device_bytes(replicated.opt_state)
    )
    print(f"fsdp holds {ratio:.1%} of the replicated bytes per device (ideal: 1/4 = 25%)")
    print(f"final loss (mean over the {STEPS} steps): fsdp {loss:.5f}, replicated {rep_loss:.5f}")
    assert ratio < 0.27, ratio
    np.testing.assert_allclose(loss, rep_loss, rtol=1e-4)
    np.testing.assert_allclose(
        np.asarray(state.params["Dense_2"]["kernel"]),
        np.asarray(replicated.params["Dense_2"]["kernel"]),
        rtol=1e-4,
        atol=1e-5,
    )
    print("fsdp train: ok")


if __name__ == "__main__":
    main()
