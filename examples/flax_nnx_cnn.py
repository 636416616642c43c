"""A Flax NNX CNN with BatchNorm and Dropout, trained by jaxdev on 8 devices, written back.

Run: ``python examples/flax_nnx_cnn.py``. sklearn's digits (8x8 grey
images, 10 classes), 8 fake CPU devices when there is no accelerator,
``Strategy.sharded()``. An ``nnx.Module`` keeps its parameters, its batch
statistics and its dropout RNG inside the object; jaxdev's step trains
pytrees, so:

* ``jaxdev.nnx.split(model)`` gives ``(params, model_state)``: the
  ``nnx.Param`` s for the optimizer, and the ``BatchStat`` s and RNG state
  that the forward pass updates;
* ``jaxdev.nnx.loss(model, loss_fn)`` turns ``loss_fn(model, batch)`` into the
  step's ``has_state`` contract; with ``rng=`` in ``init_state`` dropout draws
  new masks every step (and, under pmap / shard_map, on every device);
* ``jaxdev.nnx.update(model, state)`` writes the trained params and batch
  statistics back, and the module is then used as plain NNX.
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

NUM_CLASSES = 10


class CNN(nnx.Module):
    """Conv-BatchNorm-ReLU twice, 2x2 average pool, Dropout, Linear: 8x8x1 -> 10 logits.

    ``axis_name``: BatchNorm's statistics are averaged over this device axis
    (``strategy.collective_axis``: the global batch under every strategy).
    """

    def __init__(self, *, dropout: float = 0.3, axis_name: str | None = None, rngs: nnx.Rngs):
        def norm(n):
            return nnx.BatchNorm(n, momentum=0.9, axis_name=axis_name, rngs=rngs)

        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.bn1 = norm(16)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.bn2 = norm(32)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        return self.head(self.dropout(x.reshape(x.shape[0], -1)))


def load_data(seed: int = 0):
    """Digits as ``(N, 8, 8, 1)`` float32 in [0, 1]; a fixed 1437 / 360 train / test split."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    train, test = order[:1437], order[1437:]
    return {"image": x[train], "label": y[train]}, {"image": x[test], "label": y[test]}


def train_loss(model: CNN, batch):
    """Train mode: BatchNorm uses (and updates) batch statistics, Dropout draws masks."""
    logits = model(batch["image"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return losses, {"accuracy": jaxdev.metrics.Accuracy.from_logits(logits, batch["label"])}


def eval_loss(model: CNN, batch):
    """Eval mode on the merged copy: running averages, no dropout, nothing updated."""
    model.eval()
    return train_loss(model, batch)


def batches(data, batch_size: int, epochs: int, seed: int = 0):
    """Shuffled full batches (the last partial batch of each epoch is dropped)."""
    rng = np.random.default_rng(seed)
    n = len(data["label"])
    for _ in range(epochs):
        order = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            yield {k: v[order[i : i + batch_size]] for k, v in data.items()}


def train(strategy: jaxdev.Strategy, train_data, *, epochs: int = 8, batch_size: int = 64):
    """Train a fresh CNN; return the module (not yet updated), the state and the last metrics."""
    model = CNN(axis_name=strategy.collective_axis, rngs=nnx.Rngs(0))
    tx = optax.adam(3e-3)
    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(model, train_loss), tx, strategy, has_state=True, has_aux=True
    )
    params, model_state = jaxdev.nnx.split(model)
    state = step.init_state(params, tx, rng=jax.random.key(1), model_state=model_state)
    metrics = None
    with step.prefetch(batches(train_data, batch_size, epochs)) as placed:
        for batch in placed:
            state, metrics = step(state, batch, metrics)
    return model, state, metrics.fetch()


def accuracy(logits, labels) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), -1) == labels))


def main() -> None:
    strategy = jaxdev.Strategy.sharded()
    train_data, test = load_data()
    model, state, metrics = train(strategy, train_data)
    print(f"train ({strategy.n_devices} devices, all steps): {metrics}")
    jaxdev.assert_replicated((state.params, state.model_state), strategy.mesh)

    evaluate = jaxdev.make_eval_step(
        jaxdev.nnx.loss(model, eval_loss), strategy, has_state=True, has_aux=True
    )
    result = evaluate(state, evaluate.put_batch(test)).fetch()
    print(f"jaxdev eval on {len(test['label'])} held-out digits: {result}")

    before = nnx.clone(model)  # still the untrained module: the step never mutates it
    jaxdev.nnx.update(model, state)
    model.eval()
    logits = model(test["image"])  # plain NNX from here on
    test_acc = accuracy(logits, test["label"])
    print(f"updated nnx module, eval mode: test accuracy {test_acc:.3f}")

    # The module holds the trained params and the trained running statistics ...
    trained_stats = state.model_state["bn1"]["mean"][...]
    assert np.allclose(model.head.kernel[...], state.params["head"]["kernel"][...])
    assert np.allclose(model.bn1.mean[...], trained_stats)
    assert not np.allclose(before.bn1.mean[...], trained_stats)  # started at zeros
    assert abs(test_acc - result["accuracy"]) <= 1.0 / len(test["label"]), (test_acc, result)
    # ... and its eval output depends on those statistics: put the initial ones back.
    stale = nnx.clone(model)
    nnx.update(stale, nnx.state(before, nnx.BatchStat))
    stale_acc = accuracy(stale(test["image"]), test["label"])
    print(f"same params, initial batch statistics: test accuracy {stale_acc:.3f}")
    assert not np.allclose(stale(test["image"]), logits, atol=1e-3)
    assert test_acc >= 0.95, test_acc
    print("flax nnx cnn: ok")


if __name__ == "__main__":
    main()
