"""``jaxdev demo``: a Flax MLP trained data parallel on scikit-learn's digits.

The whole d2l "GPUs" chapter in one run, on top of jaxdev's public API only:
every local device of the default backend (every GPU, or fake CPU devices),
parameters truly replicated (``init_state``), batches split over the devices
(``put_batch``; the uneven last batch of every epoch is padded and masked,
never dropped), metrics merged on device inside the step and fetched with one
``device_get`` per epoch, the placement report of the parameters and of one
batch, and the final test accuracy.

``--steps-per-call K`` folds K full batches into one dispatch (``lax.scan``).
When K does not divide an epoch's number of full batches, the remaining full
batches and the uneven last batch run through a one-step function: no batch
is ever dropped or repeated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdev

from ._errors import UsageError

N_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run.

    Attributes:
      strategy: ``'single'``, ``'pmap'`` or ``'sharded'``.
      devices: how many local devices to use (``None``: all of them).
      epochs: passes over the training set.
      batch_size: requested global batch; rounded up to a multiple of the
        device count so that only each epoch's last batch is uneven.
      learning_rate: Adam's initial learning rate (cosine decay to 0 over the run).
      hidden: width of the MLP's hidden layer.
      steps_per_call: full batches per dispatch (``lax.scan``).
      seed: seed of the split, the shuffling and the initialisation.
      test_fraction: share of the 1,797 digits held out for testing.
    """

    strategy: str = "sharded"
    devices: int | None = None
    epochs: int = 10
    batch_size: int = 128
    learning_rate: float = 1e-2
    hidden: int = 128
    steps_per_call: int = 1
    seed: int = 0
    test_fraction: float = 0.2


class EpochStats(NamedTuple):
    """Metrics of one epoch, fetched from the devices at its end."""

    epoch: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float


class DemoResult(NamedTuple):
    """What a demo run produced."""

    test_accuracy: float
    history: tuple[EpochStats, ...]
    n_devices: int
    strategy: str
    platform: str
    seconds: float
    steps: int


class MLP(nn.Module):
    """A one-hidden-layer perceptron for 8x8 digits (64 inputs, 10 classes)."""

    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))  # Dense_0: the hidden layer
        return nn.Dense(N_CLASSES)(x)  # Dense_1: the output layer


# ---------------------------------------------------------------- data


def load_data(seed: int, test_fraction: float = 0.2) -> tuple[dict, dict]:
    """Return ``(train, test)`` dicts of numpy ``x`` (N, 64) in [0, 1] and ``y`` (N,).

    The split is stratified and fixed by ``seed``. scikit-learn ships the
    digits inside the package, so nothing is downloaded.

    Raises:
      UsageError: scikit-learn is missing (name of the extra to install).
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise UsageError(
            "`jaxdev demo` needs scikit-learn for its dataset (load_digits): "
            "pip install 'jaxdev[demo]'"
        ) from None
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(
        x, y.astype(np.int32), test_size=test_fraction, random_state=seed, stratify=y
    )
    return {"x": xtr, "y": ytr}, {"x": xte, "y": yte}


def round_batch(batch_size: int, n_devices: int) -> int:
    """Return ``batch_size`` rounded up to a multiple of ``n_devices``."""
    return math.ceil(batch_size / n_devices) * n_devices


def epoch_batches(data: dict, batch_size: int, rng: np.random.Generator) -> list[dict]:
    """Shuffle ``data`` and cut it into batches; the last one keeps the remainder."""
    order = rng.permutation(len(data["y"]))
    return [
        {k: v[order[i : i + batch_size]] for k, v in data.items()}
        for i in range(0, len(order), batch_size)
    ]


def group_steps(batches: list[dict], k: int) -> Iterator[tuple[int, dict]]:
    """Yield ``(steps, batch)``: full batches stacked K at a time, then the rest one by one.

    A batch is full when it has as many rows as the first one. Stacked
    groups have leaves of shape ``(K, B, ...)``; the leftover full batches
    (when K does not divide their number) and the uneven last batch come out
    as single steps. Every row of every batch is yielded exactly once.
    """
    rows = len(batches[0]["y"])
    full = [b for b in batches if len(b["y"]) == rows]
    rest = batches[len(full) :]
    n_groups = len(full) // k if k > 1 else 0
    for g in range(n_groups):
        group = full[g * k : (g + 1) * k]
        yield k, {key: np.stack([b[key] for b in group]) for key in group[0]}
    for b in full[n_groups * k :] + rest:
        yield 1, b


# ---------------------------------------------------------------- model and steps


def make_loss(model: MLP) -> Callable:
    """Return ``loss_fn(params, batch) -> (per-example loss, {"accuracy": ...})``."""

    def loss_fn(params: Any, batch: dict) -> tuple[jax.Array, dict]:
        logits = model.apply({"params": params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return losses, {"accuracy": correct}

    return loss_fn


def select_devices(n: int | None) -> list[jax.Device]:
    """Return :func:`jaxdev.device_list` ``(n)``: the first ``n`` local devices (all: ``None``).

    Raises:
      UsageError: ``n`` is more than exist; says how many exist and how to
        get fake CPU devices from the command line.
      DeviceSpecError: ``n`` < 1.
    """
    try:
        return jaxdev.device_list(n)
    except jaxdev.DeviceNotFoundError:
        local = jaxdev.device_list()
        raise UsageError(
            f"`--devices {n}` asks for more devices than exist: this process has "
            f"{len(local)} {local[0].platform} device(s). For fake CPU devices run "
            f"`JAX_PLATFORMS=cpu jaxdev demo --devices {n}` (from a fresh process: the "
            "device count is fixed once JAX has started)."
        ) from None


_MAKE_STRATEGY: dict[str, Callable[[list[jax.Device]], jaxdev.Strategy]] = {
    "single": lambda devices: jaxdev.Strategy.single(devices[0]),
    "pmap": lambda devices: jaxdev.Strategy.pmap(devices),
    "sharded": lambda devices: jaxdev.Strategy.sharded(jaxdev.data_mesh(devices)),
}
STRATEGIES = tuple(_MAKE_STRATEGY)


def make_strategy(name: str, devices: list[jax.Device]) -> jaxdev.Strategy:
    """Return the :class:`jaxdev.Strategy` ``name`` over ``devices`` (``single``: the first).

    Raises:
      UsageError: ``name`` is not one of ``STRATEGIES``.
    """
    if name not in _MAKE_STRATEGY:
        raise UsageError(f"`--strategy {name}` is unknown: choose one of {', '.join(STRATEGIES)}.")
    return _MAKE_STRATEGY[name](devices)


def check_config(config: DemoConfig) -> None:
    """Raise :class:`UsageError` for settings no run can use."""
    for name in ("epochs", "batch_size", "steps_per_call", "hidden"):
        value = getattr(config, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"`{flag}` must be >= 1, got {value}.")
    if not 0.0 < config.test_fraction < 1.0:
        raise UsageError(f"`test_fraction` must be in (0, 1), got {config.test_fraction}.")


# ---------------------------------------------------------------- the run


class _Steps(NamedTuple):
    one: jaxdev.TrainStep
    many: jaxdev.TrainStep | None
    eval: jaxdev.TrainStep


def _make_steps(loss_fn: Callable, tx: Any, strategy: jaxdev.Strategy, k: int) -> _Steps:
    one = jaxdev.make_train_step(loss_fn, tx, strategy, has_aux=True)
    many = (
        jaxdev.make_train_step(loss_fn, tx, strategy, has_aux=True, steps_per_call=k)
        if k > 1
        else None
    )
    return _Steps(one, many, jaxdev.make_eval_step(loss_fn, strategy, has_aux=True))


def _empty_metrics() -> jaxdev.Collection:
    return jaxdev.Collection.empty({"accuracy": jaxdev.Mean, "loss": jaxdev.Mean})


def _epoch_stats(epoch: int, train: Any, test: Any, seconds: float) -> EpochStats:
    """Fetch the epoch's train and test metrics with one ``device_get``."""
    got = jaxdev.fetch_metrics({"train": train, "test": test})
    return EpochStats(
        epoch,
        got["train"]["loss"],
        got["train"]["accuracy"],
        got["test"]["loss"],
        got["test"]["accuracy"],
        seconds,
    )


def _train_epoch(
    steps: _Steps,
    state: jaxdev.TrainState,
    groups: list[tuple[int, dict]],
    bar: Any,
    label: str,
    show: Callable[[Any, Any], None] | None = None,
) -> tuple[jaxdev.TrainState, jaxdev.Collection]:
    """Run one epoch's steps; return the state and the epoch's metrics (on device).

    ``bar.advance(steps, label)`` follows every call. ``show(state, batch)``,
    if given, sees the epoch's last batch (the uneven one, padded and
    masked) placed, before the step that consumes both.
    """
    metrics = _empty_metrics()
    for i, (count, host_batch) in enumerate(groups):
        step = steps.one if count == 1 else steps.many
        batch = step.put_batch(host_batch)
        if show is not None and i == len(groups) - 1:
            show(state, batch)
        state, metrics = step(state, batch, metrics)
        bar.advance(count, label)
    return state, metrics


def _show_placement(ui: Any) -> Callable[[Any, Any], None]:
    def show(state: Any, batch: Any) -> None:
        ui.section("placement of the parameters", str(jaxdev.placement(state.params)))
        ui.section("placement of the last batch of epoch 1", str(jaxdev.placement(batch)))

    return show


def run_demo(config: DemoConfig, ui: Any) -> DemoResult:
    """Train the MLP as ``config`` says and return the result.

    Args:
      config: the settings.
      ui: a :class:`jaxdev._cli.Ui`-like object with ``line(text)``,
        ``section(title, text)`` and ``progress(total)`` (a context manager
        whose value has ``advance(n, description)``).

    Returns:
      The :class:`DemoResult`.

    Raises:
      UsageError: bad settings, too many devices, scikit-learn missing.
    """
    check_config(config)
    start = time.perf_counter()
    strategy = make_strategy(config.strategy, select_devices(config.devices))
    train, test = load_data(config.seed, config.test_fraction)
    batch_size = round_batch(config.batch_size, strategy.n_devices)
    per_epoch = math.ceil(len(train["y"]) / batch_size)
    ui.line(_describe_setup(config, strategy, batch_size, train, test, per_epoch))
    model = MLP(config.hidden)
    tx = optax.adam(optax.cosine_decay_schedule(config.learning_rate, config.epochs * per_epoch))
    steps = _make_steps(make_loss(model), tx, strategy, config.steps_per_call)
    params = model.init(jax.random.key(config.seed), jnp.zeros((1, 64)))["params"]
    state = steps.one.init_state(params, tx)
    test_batch = steps.eval.put_batch(test)
    rng = np.random.default_rng(config.seed)
    history: list[EpochStats] = []
    with ui.progress(config.epochs * per_epoch) as bar:
        for epoch in range(1, config.epochs + 1):
            t0 = time.perf_counter()
            groups = list(group_steps(epoch_batches(train, batch_size, rng), config.steps_per_call))
            show = _show_placement(ui) if epoch == 1 else None
            label = f"epoch {epoch}/{config.epochs}"
            state, metrics = _train_epoch(steps, state, groups, bar, label, show)
            test_metrics = steps.eval(state, test_batch)
            history.append(_epoch_stats(epoch, metrics, test_metrics, time.perf_counter() - t0))
            ui.line(_format_epoch(history[-1], config.epochs))
    return DemoResult(
        history[-1].test_accuracy,
        tuple(history),
        strategy.n_devices,
        config.strategy,
        strategy.devices[0].platform,
        time.perf_counter() - start,
        int(jax.device_get(state.step)),
    )


def _describe_setup(config, strategy, batch_size, train, test, per_epoch) -> str:
    devices = strategy.devices
    n = strategy.n_devices
    last = len(train["y"]) % batch_size
    uneven = (
        f"last batch {last} rows, padded to a multiple of {n} and masked"
        if last
        else "every batch full"
    )
    k = config.steps_per_call
    if k > 1:
        full = per_epoch - (1 if last else 0)
        rest = full % k
        folded = (
            f"; {k} steps per call: {full // k} call(s) of {k} full batches"
            + (f", then {rest} full batch(es) one step at a time" if rest else "")
            + (", then the last batch one step" if last else "")
        )
    else:
        folded = ""
    devs = ", ".join(f"{d.platform}:{d.id}" for d in devices[:8]) + (" ..." if n > 8 else "")
    return (
        f"digits: {len(train['y'])} train / {len(test['y'])} test images (8x8, 10 classes)\n"
        f"strategy {config.strategy} on {n} device(s) [{devs}]\n"
        f"global batch {batch_size} ({batch_size // n} per device), {per_epoch} steps per "
        f"epoch ({uneven}){folded}"
    )


def _format_epoch(s: EpochStats, epochs: int) -> str:
    return (
        f"epoch {s.epoch:>3}/{epochs}  train loss {s.train_loss:.4f}  "
        f"train acc {s.train_accuracy:.4f}  test loss {s.test_loss:.4f}  "
        f"test acc {s.test_accuracy:.4f}  ({s.seconds:.2f} s)"
    )
