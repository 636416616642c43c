"""Flax linen params: place them, read the placement report, assert where they live.

Run: ``python examples/flax_linen_placement.py``. Uses every local device
(8 fake CPUs when there is no accelerator): params on one device, then truly
replicated over a mesh, a batch split over it, and the jaxdev assertions
that check each layout (and fail with every bad leaf listed).
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(10)(x)


def main() -> None:
    model = CNN()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    dev = jax.local_devices()[0]

    # One device: committed there, so JAX keeps every computation on it.
    on_one = jaxdev.to_device(params, dev)
    jaxdev.assert_on_device(on_one, dev)
    jaxdev.assert_committed(on_one)
    print(jaxdev.placement(on_one))

    # Data parallel layout: params replicated (one logical copy per device), batch split.
    mesh = jaxdev.data_mesh()
    replicated = jaxdev.replicate(on_one, mesh)
    jaxdev.assert_replicated(replicated, mesh, check_values=True)
    batch = np.random.default_rng(0).normal(size=(4 * mesh.size, 8, 8, 1)).astype(np.float32)
    x = jaxdev.shard_batch(batch, mesh)
    jaxdev.assert_sharded(x, jax.sharding.PartitionSpec("data"), mesh=mesh)
    logits = jax.jit(model.apply)({"params": replicated}, x)
    print("logits", logits.shape, "placed as", jaxdev.placement(logits).leaves[0].sharding)

    # A failing assertion names every wrong leaf: the one-device params are not replicated.
    if mesh.size > 1:
        try:
            jaxdev.assert_replicated(on_one, mesh)
        except AssertionError as err:
            print("assertion message:", str(err).splitlines()[0])
    print("flax linen placement: ok")


if __name__ == "__main__":
    main()
