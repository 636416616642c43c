"""Predicted vs measured memory, and the cost of offloading, side by side (issue 20).

Run: ``python benchmarks/memory_bench.py [--repeats N] [--json PATH]`` (8 fake CPU devices).

1. Prediction vs measurement, three models (the demo's MLP on digits,
   replicated; an MLP of ~1.6M params under ``rules='fsdp'`` on ``data=2 x
   fsdp=4``; Flax's lm1b ``TransformerLM``, small, under ``rules='fsdp'``):
   :func:`jaxdev.memory.plan` of the state and batch (``total``: from shapes) and
   of the compiled step (``peak``: ``memory_analysis()``'s arguments +
   outputs - donated + temporaries) against :func:`jaxdev.memory` after one
   step (state, batch and running metrics named): the live bytes on the
   fullest device. ``total / live`` should be 1 (the plan counts what is
   held between steps); ``peak / live`` is the transient headroom a step
   needs on top (outputs before donation, temporaries).
2. Offloading: the same adam MLP trained with ``Strategy.sharded(mesh)``
   and ``Strategy.sharded(mesh, offload="opt_state")`` (and params too),
   timed side by side (interleaved repetitions, median of per-repetition
   ratios). On CPU "host" and "device" memory are the same RAM, so the
   ratio measures the extra copies and program structure, not a PCIe link.
3. ``fit_memory`` on the fsdp MLP: how many compiles, how long, what batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import report, time_side_by_side  # noqa: E402
from flax_lm1b_models import TransformerConfig, TransformerLM  # noqa: E402

from jaxdev._report import human_bytes  # noqa: E402
from jaxdev.cli._demo import MLP as DemoMLP  # noqa: E402
from jaxdev.cli._demo import make_loss  # noqa: E402

jax.config.update("jax_platforms", "cpu")
TX = optax.adam(1e-3)


class MLP(nn.Module):
    sizes: tuple[int, ...] = (512, 1024, 1024, 10)

    @nn.compact
    def __call__(self, x):
        for width in self.sizes[1:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.sizes[-1])(x)


def _classifier_loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    return loss_fn


LM = TransformerConfig(
    vocab_size=256,
    output_vocab_size=256,
    emb_dim=128,
    num_heads=4,
    num_layers=2,
    qkv_dim=128,
    mlp_dim=512,
    max_len=64,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    deterministic=True,
)


def _lm_loss(params, batch):
    logits = TransformerLM(LM).apply({"params": params}, batch["t"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"])
    return losses.mean(-1)


def _models():
    """``(name, step, params, host batch)`` of the three models."""
    rng = np.random.default_rng(0)
    demo = DemoMLP(128)
    yield (
        "demo MLP (digits), replicated x8",
        jaxdev.make_train_step(make_loss(demo), TX, jaxdev.Strategy.sharded(), has_aux=True),
        demo.init(jax.random.key(0), jnp.zeros((1, 64)))["params"],
        {"x": rng.random((128, 64), np.float32), "y": rng.integers(0, 10, 128).astype(np.int32)},
    )
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    mlp = MLP()
    yield (
        "MLP 1.6M params, fsdp on data=2 x fsdp=4",
        jaxdev.make_train_step(
            _classifier_loss(mlp), TX, jaxdev.Strategy.sharded(mesh, rules="fsdp")
        ),
        mlp.init(jax.random.key(1), jnp.zeros((1, 512)))["params"],
        {"x": rng.random((256, 512), np.float32), "y": rng.integers(0, 10, 256).astype(np.int32)},
    )
    yield (
        "lm1b TransformerLM (2 layers, 128 wide), fsdp",
        jaxdev.make_train_step(_lm_loss, TX, jaxdev.Strategy.sharded(mesh, rules="fsdp")),
        TransformerLM(LM).init(jax.random.key(2), jnp.ones((1, 64), jnp.int32))["params"],
        {"t": rng.integers(1, 256, (64, 64)).astype(np.int32)},
    )


def prediction_rows() -> list[dict]:
    rows = []
    for name, step, params, host in _models():
        state = step.init_state(params, TX)
        del params
        batch = step.put_batch(host)
        shapes = jax.eval_shape(lambda s=state: s)
        p = jaxdev.memory.plan(shapes, step=step, batch=batch)
        state, metrics = step(state, batch)
        jax.block_until_ready(state)
        ledger = jaxdev.memory.ledger(state=state, batch=batch, metrics=metrics)
        live = max(ledger.per_device.values())
        rows.append(
            {
                "model": name,
                "plan_total": p.total,
                "plan_peak": p.peak,
                "ledger_live": live,
                "attributed": round(ledger.attributed, 4),
                "total_over_live": round(p.total / live, 4),
                "peak_over_live": round(p.peak / live, 3),
            }
        )
        del state, metrics, batch, ledger
    return rows


def print_prediction(rows: list[dict]) -> None:
    print(
        "| model | plan total | plan peak (compiled) | ledger live (fullest device) "
        "| total/live | peak/live | attributed |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {human_bytes(r['plan_total'])} | {human_bytes(r['plan_peak'])} "
            f"| {human_bytes(r['ledger_live'])} | {r['total_over_live']} "
            f"| {r['peak_over_live']} | {r['attributed']:.1%} |"
        )


def offload_rows(repeats: int) -> list[dict]:
    mesh = jaxdev.data_mesh()
    mlp = MLP()
    params = mlp.init(jax.random.key(1), jnp.zeros((1, 512)))["params"]
    rng = np.random.default_rng(3)
    host = {"x": rng.random((256, 512), np.float32), "y": rng.integers(0, 10, 256).astype(np.int32)}
    variants = {
        "device": jaxdev.Strategy.sharded(mesh),
        "offload opt_state": jaxdev.Strategy.sharded(mesh, offload="opt_state"),
        "offload params+opt_state": jaxdev.Strategy.sharded(mesh, offload=("params", "opt_state")),
    }
    held, fns, peaks = {}, {}, {}
    for name, strategy in variants.items():
        step = jaxdev.make_train_step(_classifier_loss(mlp), TX, strategy)
        held[name] = step.init_state(params, TX)
        batch = step.put_batch(host)
        peaks[name] = jaxdev.memory.plan(
            jax.eval_shape(lambda n=name: held[n]), step=step, batch=batch
        )

        def run(name=name, step=step, batch=batch):
            held[name], metrics = step(held[name], batch)
            return held[name]

        fns[name] = run
    timings = time_side_by_side(fns, repeats=repeats, warmup=3)
    rows = []
    for name in variants:
        p = peaks[name]
        rows.append(
            {
                "what": "adam MLP 1.6M params, 8 devices, batch 256",
                "variant": name,
                "ms_per_step": round(timings.median(name) * 1e3, 3),
                "ratio_vs": "device",
                "ratio": round(timings.ratio(name, "device"), 3),
                "target": "recorded",
                "met": "-",
                "device_peak": p.peak,
                "host_bytes": p.host,
            }
        )
    return rows


def fit_row() -> dict:
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    mlp = MLP()
    step = jaxdev.make_train_step(
        _classifier_loss(mlp), TX, jaxdev.Strategy.sharded(mesh, rules="fsdp")
    )
    shapes = jax.eval_shape(
        lambda: jaxdev.TrainState.create(
            mlp.init(jax.random.key(1), jnp.zeros((1, 512)))["params"], TX
        )
    )
    example = {
        "x": jax.ShapeDtypeStruct((8, 512), jnp.float32),
        "y": jax.ShapeDtypeStruct((8,), jnp.int32),
    }
    t0 = time.perf_counter()
    fit = jaxdev.memory.fit_memory(step, shapes, example, limit=32 * 2**20)
    seconds = time.perf_counter() - t0
    return {
        "limit": 32 * 2**20,
        "batch_per_device": fit.batch_size,
        "rows_per_step": fit.rows,
        "peak": fit.peak,
        "compiles": len(fit.tried),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    prediction = prediction_rows()
    print_prediction(prediction)
    print()
    offload = offload_rows(args.repeats)
    report(offload, ("ms_per_step", "ms/step"))
    for r in offload:
        print(
            f"  {r['variant']}: compiled device peak {human_bytes(r['device_peak'])}, "
            f"host {human_bytes(r['host_bytes'])} per device"
        )
    print()
    fit = fit_row()
    print(
        f"fit_memory (fsdp MLP, limit {human_bytes(fit['limit'])}): {fit['batch_per_device']} rows "
        f"per device ({fit['rows_per_step']} per step), peak {human_bytes(fit['peak'])}, "
        f"{fit['compiles']} compiles in {fit['seconds']} s, nothing run"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prediction": prediction, "offload": offload, "fit": fit}, f, indent=2)


if __name__ == "__main__":
    main()
