"""Flax's NNX MNIST tutorial, as it is written, on jaxdev: two styles, 8 devices.

Run: ``python examples/flax_nnx_tutorial.py``. The tutorial's CNN (Conv,
BatchNorm, Dropout given its keys at call time, ``nnx.view`` for train and
eval), scaled to sklearn's 8x8 digits, 8 fake CPU devices when there is no
accelerator. A 357-row test set: the 8 devices do not divide it, so it is
padded to 360 rows, and the 3 padded rows must never count.

1. **jaxdev's step.** The tutorial's ``loss_fn(model, batch, rngs=None)``
   (per-example losses: no ``.mean()``) through ``jaxdev.nnx.loss``: it sees
   the ``rngs`` parameter and passes the step's key as ``nnx.Rngs``, per step
   and, under pmap / shard_map, per device.
2. **The tutorial's own loop.** ``nnx.Optimizer``, ``nnx.MultiMetric`` and
   ``@nnx.jit`` as written; jaxdev only places (``replicate`` the model and
   optimizer, ``shard_batch`` the batches) and, for the padded test set,
   ``jaxdev.nnx.metrics_update(metrics, mask, ...)`` stands in for
   ``metrics.update(...)`` so the padded rows are not counted.

Both are checked against the unpadded truth: the eval-mode module run on the
357 unpadded test rows in one call.
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

BATCH, EPOCHS, TEST_ROWS = 64, 4, 357


class CNN(nnx.Module):
    """The tutorial's CNN, for 8x8 images: its Dropouts get their keys at call time.

    BatchNorm's ``momentum`` is 0.9 (the tutorial keeps the default 0.99 over 1200
    steps): the running statistics must settle within this example's 88 steps.
    """

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 32, 64, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def load_data(seed: int = 0):
    """Digits as ``(N, 8, 8, 1)`` float32 in [0, 1]; 1440 train rows, 357 test rows."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    train, test = order[:-TEST_ROWS], order[-TEST_ROWS:]
    return {"image": x[train], "label": y[train]}, {"image": x[test], "label": y[test]}


def make_batches(data, batch_size: int, epochs: int, seed: int = 0):
    """Shuffled full batches; the incomplete final batch is dropped, as in the tutorial."""
    rng = np.random.default_rng(seed)
    n = len(data["label"])
    for _ in range(epochs):
        order = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            yield {k: v[order[i : i + batch_size]] for k, v in data.items()}


def truth(model: CNN, test) -> tuple[float, float]:
    """(loss, accuracy) of the eval-mode module on the 357 unpadded test rows, in one call."""
    logits = nnx.view(model, deterministic=True, use_running_average=True)(test["image"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, test["label"])
    return float(jnp.mean(losses)), float(np.mean(np.argmax(logits, -1) == test["label"]))


# ---------------------------------------------------------------- 1. jaxdev's step


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    """The tutorial's loss_fn: per-example losses (no ``.mean()``), accuracy as aux."""
    logits = model(batch["image"], rngs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"])
    return losses, {"accuracy": jaxdev.metrics.Accuracy.from_logits(logits, batch["label"])}


def with_jaxdev_step(train_data, test):
    model = CNN(rngs=nnx.Rngs(0))
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    strategy = jaxdev.Strategy.sharded()
    tx = optax.adamw(0.005, 0.9)
    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(train_model, loss_fn), tx, strategy, has_state=True, has_aux=True
    )
    params, model_state = jaxdev.nnx.split(model)
    # rng=: the key nnx_loss hands to loss_fn as nnx.Rngs (new every step, every device)
    state = step.init_state(params, tx, rng=jax.random.key(0), model_state=model_state)
    metrics = None
    with step.prefetch(make_batches(train_data, BATCH, EPOCHS)) as placed:
        for batch in placed:
            state, metrics = step(state, batch, metrics)
    print(f"1. jaxdev step, train (all steps): {metrics.fetch()}")

    evaluate = jaxdev.make_eval_step(
        jaxdev.nnx.loss(eval_model, loss_fn), strategy, has_state=True, has_aux=True
    )
    padded = evaluate.put_batch(test)  # 357 rows -> 360, with a mask: padded rows never count
    result = evaluate(state, padded).fetch()
    jaxdev.nnx.update(model, state)  # the views share the module's variables
    want_loss, want_acc = truth(model, test)
    print(f"1. jaxdev eval on {padded.size} of {padded.mask.shape[0]} rows: {result}")
    np.testing.assert_allclose(result["loss"], want_loss, rtol=1e-5)
    assert abs(result["accuracy"] - want_acc) < 1e-6, (result, want_acc)
    return want_acc


# ---------------------------------------------------------------- 2. the tutorial's loop


def tutorial_loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    """The tutorial's loss_fn as written: a mean over the (unpadded) batch, and the logits."""
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"])
    return loss.mean(), logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs, batch):
    """The tutorial's train_step, unchanged."""
    grad_fn = nnx.value_and_grad(tutorial_loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch, mask=None):
    """The tutorial's eval_step, with per-example losses and the padded batch's mask."""
    logits = model(batch["image"], None)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    # metrics.update(loss=..., logits=..., labels=...) counting only the real rows
    jaxdev.nnx.metrics_update(metrics, mask, loss=losses, logits=logits, labels=batch["label"])


def with_own_loop(train_data, test):
    mesh = jaxdev.data_mesh()
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    # jaxdev's lines: model, optimizer and metrics replicated on every device ...
    nnx.update(
        (model, optimizer, metrics), jaxdev.replicate(nnx.state((model, optimizer, metrics)), mesh)
    )
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    rngs = nnx.Rngs(0)
    for batch in make_batches(train_data, BATCH, EPOCHS):
        # ... and each batch split over them (64 rows: even)
        train_step(train_model, optimizer, metrics, rngs, jaxdev.shard_batch(batch, mesh))
    print(f"2. own loop, train (all steps): {jax.tree.map(float, metrics.compute())}")
    jaxdev.assert_replicated(nnx.state(model), mesh)

    metrics.reset()
    padded = jaxdev.shard_batch(test, mesh, pad=True)  # 357 rows -> 360, and the mask
    eval_step(eval_model, metrics, padded.batch, padded.mask)
    got = {k: float(v) for k, v in metrics.compute().items()}
    want_loss, want_acc = truth(model, test)
    print(f"2. own loop, eval with jaxdev.nnx.metrics_update: {got}")
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-5)
    assert abs(got["accuracy"] - want_acc) < 1e-6, (got, want_acc)

    metrics.reset()  # what the tutorial's eval_step counts without the mask
    eval_step(eval_model, metrics, padded.batch)
    blind = {k: float(v) for k, v in metrics.compute().items()}
    print(f"   without the mask (3 copies of the last row counted): {blind}")
    return want_acc


def main() -> None:
    train_data, test = load_data()
    acc1 = with_jaxdev_step(train_data, test)
    acc2 = with_own_loop(train_data, test)
    print(f"test accuracy: jaxdev step {acc1:.3f}, own loop {acc2:.3f}")
    assert acc1 > 0.9 and acc2 > 0.9, (acc1, acc2)
    print("flax nnx tutorial: ok")


if __name__ == "__main__":
    main()
