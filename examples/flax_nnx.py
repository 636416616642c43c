"""A Flax NNX model trained with jaxdev's sharded step: split, place, train, merge back.

Run: ``python examples/flax_nnx.py``. NNX modules are stateful objects;
``nnx.split`` turns them into a pure (graphdef, params) pair, which is what
jaxdev places and trains. Every local device is used (8 fake CPUs when
there is no accelerator).
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def make_data(n: int = 300, seed: int = 0):
    """Three Gaussian blobs in 4-D, labels 0..2."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n).astype(np.int32)
    x = (rng.normal(size=(n, 4)) + 3.0 * np.eye(3, 4)[y]).astype(np.float32)
    return {"x": x, "y": y}


def main() -> None:
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses, {"accuracy": (logits.argmax(-1) == batch["y"]).astype(np.float32)}

    tx = optax.adam(3e-2)
    step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded(), has_aux=True)
    state = step.init_state(params, tx)
    jaxdev.assert_replicated(state.params)
    data = make_data()
    batch = step.put_batch(data)  # 300 rows: padded to a multiple of the device count
    metrics = None
    for _ in range(30):
        state, metrics = step(state, batch)
    fetched = metrics.fetch()  # the last step's metrics, one device_get
    print(f"last step: loss {fetched['loss']:.3f}, accuracy {fetched['accuracy']:.3f}")
    assert fetched["accuracy"] > 0.9, fetched

    nnx.update(model, jaxdev.unreplicate(state.params))  # back into the stateful module
    print("model output", model(data["x"][:2]).shape, "on", jaxdev.device_of(model.out.kernel[...]))
    print("flax nnx: ok")


if __name__ == "__main__":
    main()
