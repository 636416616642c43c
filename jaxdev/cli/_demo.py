"""``jaxdev demo`` (README's "Command line"): a Flax MLP trained data parallel on digits.

Epoch ``e``'s order comes from ``numpy.random.default_rng((seed, e))`` alone, so a run
resumed with ``--checkpoint-dir`` ends bit-identical (``params fingerprint`` shows it).
"""

from __future__ import annotations

import dataclasses
import hashlib
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

from .._errors import UsageError, format_devices

_METRICS = {"accuracy": jaxdev.metrics.Mean, "loss": jaxdev.metrics.Mean}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run: the ``jaxdev demo`` flags (see their ``--help``).

    ``seed`` draws the split, the shuffling and the initialisation; ``test_fraction`` (no
    flag) of the 1,797 digits is held out; ``mesh`` is e.g. ``(("data", 2), ("fsdp", 4))``.
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
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    params: str | None = None
    mesh: tuple[tuple[str, int], ...] | None = None
    meter_plot: str | None = None  # the step meter's picture (no flag: docs/meter.png)


class EpochStats(NamedTuple):
    """Metrics of one epoch, fetched from the devices at its end."""

    epoch: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float


class MLP(nn.Module):
    """A one-hidden-layer perceptron for 8x8 digits (64 inputs, 10 classes)."""

    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))  # Dense_0: the hidden layer
        return nn.Dense(10)(x)  # Dense_1: the output layer, one logit per class


# ---------------------------------------------------------------- data and model


def load_data(seed: int, test_fraction: float) -> tuple[dict, dict]:
    """``(train, test)`` dicts of ``x`` (N, 64) in [0, 1] and ``y`` (N,), split by ``seed``.

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


def epoch_batches(data: dict, batch_size: int, rng: np.random.Generator) -> list[dict]:
    """Shuffle ``data`` and cut it into batches; the last one keeps the remainder."""
    order = rng.permutation(len(data["y"]))
    return [
        {k: v[order[i : i + batch_size]] for k, v in data.items()}
        for i in range(0, len(order), batch_size)
    ]


def group_steps(batches: list[dict], k: int) -> Iterator[tuple[int, dict]]:
    """Yield ``(steps, batch)``: full batches stacked K at a time, then the rest one by one."""
    full = sum(len(b["y"]) == len(batches[0]["y"]) for b in batches)  # only the last is short
    stacked = full // k * k if k > 1 else 0
    for g in range(0, stacked, k):
        yield k, {key: np.stack([b[key] for b in batches[g : g + k]]) for key in batches[g]}
    yield from ((1, b) for b in batches[stacked:])


def make_loss(model: MLP) -> Callable:
    """Return ``loss_fn(params, batch) -> (per-example loss, {"accuracy": ...})``."""

    def loss_fn(params: Any, batch: dict) -> tuple[jax.Array, dict]:
        logits = model.apply({"params": params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return losses, {"accuracy": correct}

    return loss_fn


# ---------------------------------------------------------------- the run


def _setup(config: DemoConfig) -> tuple[jaxdev.Strategy, dict, dict, int, MLP, Any]:
    """``(strategy, train, test, global batch, model, params)`` of a run.

    Raises:
      UsageError: ``--devices`` asks for more devices than exist (says how to get fake CPU
        devices); ``--params`` or ``--mesh`` without ``sharded``; a mesh whose sizes do not
        multiply to the device count.
    """
    n, name = config.devices, config.strategy
    try:
        devices = jaxdev.device_list(n)
    except jaxdev.DeviceNotFoundError:
        local = jaxdev.device_list()
        raise UsageError(
            f"`--devices {n}` asks for more devices than exist: this process has "
            f"{len(local)} {local[0].platform} device(s). For fake CPU devices run "
            f"`JAX_PLATFORMS=cpu jaxdev demo --devices {n}` (from a fresh process: the "
            "device count is fixed once JAX has started)."
        ) from None
    if name != "sharded" and (config.params is not None or config.mesh is not None):
        raise UsageError(
            f"`--params` and `--mesh` need `--strategy sharded` (got `--strategy {name}`): "
            "only the sharded step places params by rules."
        )
    if name == "single":
        strategy = jaxdev.Strategy.single(devices[0])
    elif name == "pmap":
        strategy = jaxdev.Strategy.pmap(devices)
    else:
        try:
            mesh = jaxdev.make_mesh(dict(config.mesh), devices) if config.mesh else None
        except jaxdev.ShardingError as err:
            raise UsageError(f"`--mesh`: {err}") from None
        mesh = mesh if mesh is not None else jaxdev.data_mesh(devices)
        params = config.params or ("fsdp" if "fsdp" in mesh.axis_names else "replicate")
        strategy = jaxdev.Strategy.sharded(mesh, rules=params)
    train, test = load_data(config.seed, config.test_fraction)
    batch_size = math.ceil(config.batch_size / strategy.n_devices) * strategy.n_devices
    model = MLP(config.hidden)
    params = model.init(jax.random.key(config.seed), jnp.zeros((1, 64)))["params"]
    return strategy, train, test, batch_size, model, params


def state_bytes_line(state: Any, strategy: jaxdev.Strategy) -> str:
    """``params + optimizer state per device: 31.0 KiB (replicated: 125.5 KiB; ...)``."""
    tree = (state.params, state.opt_state)
    replicated = sum(x.nbytes for x in jax.tree.leaves(tree))
    mine = max(jaxdev.placement(tree).bytes_by_device.values())
    mesh = " x ".join(f"{k}={v}" for k, v in strategy.mesh.shape.items())
    return (
        f"params + optimizer state per device: {mine / 1024:.1f} KiB with "
        f"rules={strategy.rules!r} on mesh {mesh} (replicated: {replicated / 1024:.1f} KiB; "
        f"{mine / replicated:.0%}); batch split over {strategy.axis}"
    )


def run_demo(config: DemoConfig, ui: Any) -> tuple[jaxdev.Strategy, jaxdev.TrainState, list]:
    """Train the MLP as ``config`` says; return the strategy, the final state, the history.

    ``ui`` is the command's ``Ui``: a rich ``Console`` with ``progress(total)``. With
    ``checkpoint_dir``, the run resumes from the latest checkpoint there, mid-epoch too.

    Raises:
      UsageError: a strategy its options do not fit, too many devices, scikit-learn missing.
    """
    strategy, train, test, batch_size, model, params = _setup(config)
    per_epoch = math.ceil(len(train["y"]) / batch_size)
    total, k = config.epochs * per_epoch, config.steps_per_call
    ui.print(_describe_setup(config, strategy, batch_size, train, test, per_epoch))
    tx = optax.adam(optax.cosine_decay_schedule(config.learning_rate, total))
    loss_fn = make_loss(model)
    steps = {  # by the steps a call runs: 1, and K full batches stacked
        n: jaxdev.make_train_step(loss_fn, tx, strategy, has_aux=True, steps_per_call=n)
        for n in {1, k}
    }
    evaluate = jaxdev.make_eval_step(loss_fn, strategy, has_aux=True)
    state = steps[1].init_state(params, tx)
    if not strategy.replicated:
        ui.print(state_bytes_line(state, strategy))
    test_batch = evaluate.put_batch(test)
    ckpt, history, resumed, metrics = None, [], 0, None
    if config.checkpoint_dir is not None:
        every = config.checkpoint_every or per_epoch
        ckpt = jaxdev.Checkpointer(config.checkpoint_dir, keep=2, every=every)
        resumed = ckpt.latest_step() or 0
        if resumed:
            state = ckpt.restore(state, resumed)  # like the fresh state: same placement
            saved = ckpt.restore_metrics(step=resumed)
            history, metrics = list(saved["history"]), saved["epoch"]
            ui.print(f"resumed from the checkpoint of step {resumed} in {ckpt.directory}")
    meter = jaxdev.meter.StepMeter(examples_per_step=batch_size)
    with ui.progress(total) as advance, meter:
        if resumed:
            advance(min(resumed, total), "resumed")
        for epoch in range(resumed // per_epoch + 1, config.epochs + 1):
            t0, pos = time.perf_counter(), (epoch - 1) * per_epoch  # steps behind us
            rng = np.random.default_rng((config.seed, epoch))
            groups = list(group_steps(epoch_batches(train, batch_size, rng), k))
            if pos >= resumed:  # else: resumed inside this epoch, with its saved metrics
                metrics = jaxdev.metrics.Collection.empty(_METRICS)
            for i, (count, host_batch) in enumerate(groups):
                pos += count
                if pos <= resumed:
                    continue
                batch = steps[count].put_batch(host_batch)
                if epoch == 1 and not resumed and i == len(groups) - 1:
                    ui.rule("placement of the parameters")
                    ui.print(str(jaxdev.placement(state.params)))
                    ui.rule("placement of the last batch of epoch 1")
                    ui.print(str(jaxdev.placement(batch)))
                state, metrics = steps[count](state, batch, metrics)
                advance(count, f"epoch {epoch}/{config.epochs}")
                if ckpt is not None and i < len(groups) - 1:
                    ckpt.save(pos, state, {"epoch": metrics, "history": history})
            got = jaxdev.metrics.fetch_metrics(
                {"train": metrics, "test": evaluate(state, test_batch)}
            )
            losses = (got[s][m] for s in ("train", "test") for m in ("loss", "accuracy"))
            s = EpochStats(epoch, *losses, time.perf_counter() - t0)
            history.append(s)
            ui.print(
                f"epoch {s.epoch:>3}/{config.epochs}  train loss {s.train_loss:.4f}  "
                f"train acc {s.train_accuracy:.4f}  test loss {s.test_loss:.4f}  "
                f"test acc {s.test_accuracy:.4f}  ({s.seconds:.2f} s)"
            )
            if ckpt is not None:  # the end is saved whatever `every` says
                ckpt.save(pos, state, {"epoch": metrics, "history": history}, force=pos == total)
    if ckpt is not None:
        ckpt.close()
    report = meter.report()
    ui.print(report.table())
    if config.meter_plot:
        ui.print(f"wrote {report.plot(config.meter_plot)}")
    return strategy, state, history


def memory_demo(config: DemoConfig, steps: int = 3) -> jaxdev.memory.MemoryLedger:
    """Train the demo's MLP for ``steps`` steps and return the live memory ledger.

    Raises:
      UsageError: as :func:`run_demo`.
    """
    strategy, train, _, batch_size, model, params = _setup(config)
    tx = optax.adam(config.learning_rate)
    step = jaxdev.make_train_step(make_loss(model), tx, strategy, has_aux=True)
    state, metrics = step.init_state(params, tx), None
    del params  # init_state copied them: the init output would show as unattributed
    batches = epoch_batches(train, batch_size, np.random.default_rng((config.seed, 1)))[:steps]
    for host in batches:
        batch = step.put_batch(host)
        state, metrics = step(state, batch, metrics)
    jax.block_until_ready(state)
    return jaxdev.memory.ledger(state=state, batch=batch, metrics=metrics)


def params_fingerprint(params: Any) -> str:
    """SHA-256 (first 16 hex digits) of the parameters' paths, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(jaxdev.to_host(params))[0]:
        a = np.ascontiguousarray(x)
        h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _describe_setup(config, strategy, batch_size, train, test, per_epoch) -> str:
    n, k, last = strategy.n_devices, config.steps_per_call, len(train["y"]) % batch_size
    uneven = f"last batch {last} rows, padded to a multiple of {n} and masked" if last else ""
    full, folded = per_epoch - (1 if last else 0), ""
    if k > 1:
        folded = (
            f"; {k} steps per call: {full // k} call(s) of {k} full batches"
            + (f", then {full % k} full batch(es) one step at a time" if full % k else "")
            + (", then the last batch one step" if last else "")
        )
    return (
        f"digits: {len(train['y'])} train / {len(test['y'])} test images (8x8, 10 classes)\n"
        f"strategy {config.strategy} on {n} device(s) [{format_devices(strategy.devices)}]\n"
        f"global batch {batch_size} ({batch_size // n} per device), {per_epoch} steps per "
        f"epoch ({uneven or 'every batch full'}){folded}"
    )
