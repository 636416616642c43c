"""Flax's imagenet train step, as jaxdev runs it: BatchNorm state, weight decay, lr schedule.

Run: ``python examples/flax_imagenet_step.py``. A tiny ResNet (the block
structure of flax's ``examples/imagenet/models.py``, stage sizes [1, 1], 8
filters) on synthetic 32x32x3 images, 8 fake CPU devices when there is no
accelerator. Flax's example writes ``train_step`` by hand for ``jax.pmap``:
``lax.pmean`` of the gradients, a weight-decay term in the loss, the learning
rate as a metric, and ``batch_stats`` carried as a mutable collection and
averaged across devices. With jaxdev that is one ``make_train_step`` call
that runs unchanged on one device, with ``jax.pmap`` or with sharded ``jit``.

The model takes ``axis_name``: ``strategy.collective_axis`` makes BatchNorm
compute its statistics over the global batch under every strategy.
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import functools  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

NUM_CLASSES = 4
WEIGHT_DECAY = 1e-4


class ResNetBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a projected shortcut."""

    filters: int
    norm: Callable[..., Any]
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False)
        y = nn.relu(self.norm()(conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides)(x))
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    """ResNet V1 with ``stage_sizes`` blocks per stage; BatchNorm synced over ``axis_name``."""

    stage_sizes: tuple[int, ...] = (1, 1)
    num_filters: int = 8
    num_classes: int = NUM_CLASSES
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, norm, strides)(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def make_data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Images whose class shifts the mean of one colour channel: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, NUM_CLASSES, size=n).astype(np.int32)
    image = rng.normal(size=(n, 32, 32, 3)).astype(np.float32)
    image[..., 0] += label[:, None, None] * 0.5
    return {"image": image, "label": label}


def weight_penalty(params) -> jax.Array:
    """Flax imagenet's L2 term on every kernel (leaves with ndim > 1)."""
    l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return WEIGHT_DECAY * 0.5 * l2


def learning_rate_fn(step):
    return 0.1 * jnp.minimum(1.0, (step + 1) / 5.0)  # a short warm-up


def make_loss(model: TinyResNet):
    def loss_fn(params, model_state, batch):
        logits, new_state = model.apply(
            {"params": params, **model_state}, batch["image"], mutable=["batch_stats"]
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return (
            losses,
            {"accuracy": jaxdev.metrics.Accuracy.from_logits(logits, batch["label"])},
            new_state,
        )

    return loss_fn


def make_eval_loss(model: TinyResNet):
    def eval_loss(params, model_state, batch):
        logits = model.apply({"params": params, **model_state}, batch["image"], train=False)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        acc = jaxdev.metrics.Accuracy.from_logits(logits, batch["label"])
        return losses, {"accuracy": acc}, model_state

    return eval_loss


def train(strategy: jaxdev.Strategy, steps: int = 10, batch_size: int = 64):
    """Train the tiny ResNet for ``steps`` steps; return the state and the last metrics."""
    model = TinyResNet(axis_name=strategy.collective_axis)
    variables = TinyResNet().init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    tx = optax.sgd(learning_rate_fn, momentum=0.9, nesterov=True)
    step = jaxdev.make_train_step(
        make_loss(model),
        tx,
        strategy,
        has_aux=True,
        has_state=True,
        regularizer=weight_penalty,
        lr_fn=learning_rate_fn,
    )
    state = step.init_state(
        variables["params"], tx, model_state={"batch_stats": variables["batch_stats"]}
    )
    data = make_data(steps * batch_size)
    metrics = None
    for i in range(0, steps * batch_size, batch_size):
        batch = {k: v[i : i + batch_size] for k, v in data.items()}
        state, metrics = step(state, step.put_batch(batch), metrics)
    return state, metrics.fetch(), model


def main() -> None:
    strategy = jaxdev.Strategy.sharded()
    state, metrics, model = train(strategy, steps=20)
    print(f"train ({strategy.n_devices} devices): {metrics}")
    evaluate = jaxdev.make_eval_step(make_eval_loss(model), strategy, has_aux=True, has_state=True)
    test = make_data(200, seed=1)  # 200 rows: padded to a multiple of the devices, masked
    result = evaluate(state, evaluate.put_batch(test)).fetch()
    print(f"eval on 200 held-out images: {result}")
    jaxdev.assert_replicated(state.model_state, strategy.mesh)
    assert result["accuracy"] > 0.5, result
    print("flax imagenet step: ok")


if __name__ == "__main__":
    main()
