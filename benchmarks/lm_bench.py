"""Flax's lm1b TransformerLM: jaxdev's weighted step vs Flax's own lm1b train_step (issue 19).

Run: ``python benchmarks/lm_bench.py [--repeats N] [--steps N] [--json PATH]``.

Both sides train the same model (``tests/flax_lm1b_models.py``, Flax's lm1b
models.py as written; 2 layers) on the same token batches with padding, with
plain SGD, on 8 fake CPU devices, timed side by side (interleaved
repetitions, medians of per-repetition ratios). Flax's side is lm1b's
``train_step`` compiled as ``examples/lm1b/train.py`` compiles it: ``jax.jit``
with the state's logical-axis shardings in and out and the batch on
``P('data')``. jaxdev's side is ``make_train_step(token_loss, tx,
Strategy.sharded(mesh, rules="flax", logical_axis_rules=RULES),
weighted=True)``: with the batch split over every non-model axis (its
default, ``('data', 'fsdp')``) and with ``axis='data'`` (lm1b's batch layout).
Meshes: lm1b's ``data x fsdp x tensor`` as ``2 x 4 x 1``
and ``2 x 2 x 2``.
"""

from __future__ import annotations

import argparse
import os
import sys

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
from flax.training import common_utils, train_state  # noqa: E402
from flax_lm1b_models import TransformerConfig, TransformerLM  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

CFG = TransformerConfig(
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
RULES = [["mlp", "tensor"], ["vocab", "tensor"], ["embed", "fsdp"], ["heads", "tensor"]]
ROWS, LENGTH, LR = 32, 64, 0.1


def compute_weighted_cross_entropy(logits, targets, weights):
    """examples/lm1b/train.py (label_smoothing=0)."""
    soft_targets = common_utils.onehot(targets, logits.shape[-1])
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    return (loss * weights).sum(), weights.sum()


def flax_train_step(state, batch):
    """examples/lm1b/train.py's train_step (no packing, no dropout)."""
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)

    def loss_fn(params):
        logits = TransformerLM(CFG).apply({"params": params}, inputs)
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights)
        return loss / weight_sum, logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), None


def token_loss(params, batch):
    inputs = batch["inputs"]
    logits = TransformerLM(CFG).apply({"params": params}, inputs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, inputs)
    return losses, (inputs > 0).astype(jnp.float32)


def per_row_loss(params, batch):
    """The port before weighted=True: each row's mean token loss, one loss per example."""
    losses, weights = token_loss(params, batch)
    return jnp.sum(losses * weights, -1) / jnp.maximum(jnp.sum(weights, -1), 1.0)


def boxed_params():
    return TransformerLM(CFG).init(jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32))["params"]


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, CFG.vocab_size, size=(ROWS, LENGTH)).astype(np.int32)
        lengths = rng.integers(LENGTH // 4, LENGTH + 1, size=ROWS)
        tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
        out.append({"inputs": tokens})
    return out


def flax_side(mesh, data):
    tx = optax.sgd(LR)

    def init():
        return train_state.TrainState.create(apply_fn=None, params=boxed_params(), tx=tx)

    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        spec = nn.get_partition_spec(jax.eval_shape(init))
        shardings = nn.logical_to_mesh_sharding(spec, mesh, RULES)
        state = jax.jit(init, out_shardings=shardings)()
    state = nn.meta.unbox(state)
    data_sharding = NamedSharding(mesh, P("data"))
    step = jax.jit(
        flax_train_step,
        in_shardings=(shardings, data_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    placed = [jax.device_put(b, data_sharding) for b in data]
    box = {"state": state}

    def run():
        s = box["state"]
        for b in placed:
            s, _ = step(s, b)
        box["state"] = s
        return s.params

    return run


def jaxdev_side(mesh, data, axis=None, weighted=True):
    tx = optax.sgd(LR)
    strategy = jaxdev.Strategy.sharded(mesh, axis, rules="flax", logical_axis_rules=RULES)
    loss = token_loss if weighted else per_row_loss
    step = jaxdev.make_train_step(loss, tx, strategy, weighted=weighted)
    box = {"state": step.init_state(boxed_params(), tx), "metrics": None}
    placed = [step.put_batch(b) for b in data]

    def run():
        s, m = box["state"], box["metrics"]
        for b in placed:
            s, m = step(s, b, m)
        box["state"], box["metrics"] = s, m
        return s.params

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    data = batches(args.steps)
    rows = []
    for mesh_axes in ({"data": 2, "fsdp": 4, "tensor": 1}, {"data": 2, "fsdp": 2, "tensor": 2}):
        mesh = jaxdev.make_mesh(mesh_axes)
        fns = {
            "flax lm1b train_step": flax_side(mesh, data),
            "jaxdev weighted, batch over data x fsdp": jaxdev_side(mesh, data),
            "jaxdev weighted, batch over data": jaxdev_side(mesh, data, axis="data"),
            "jaxdev per-example row means (the earlier port)": jaxdev_side(
                mesh, data, weighted=False
            ),
        }
        t = time_side_by_side(fns, repeats=args.repeats)
        what = f"lm1b TransformerLM 2 layers, {ROWS}x{LENGTH} tokens, mesh {mesh_axes}"
        for name in list(fns)[1:]:
            ratio = t.ratio(name, "flax lm1b train_step")
            rows.append(
                {
                    "what": what,
                    "variant": name,
                    "ms": round(1000 * t.median(name) / args.steps, 2),
                    "ratio_vs": "flax lm1b train_step",
                    "ratio": round(ratio, 3),
                    "target": "<= 1.05",
                    "met": "yes" if ratio <= 1.05 else "NO",
                }
            )
        rows.append(
            {
                "what": what,
                "variant": "flax lm1b train_step",
                "ms": round(1000 * t.median("flax lm1b train_step") / args.steps, 2),
                "ratio_vs": "",
                "ratio": 1.0,
                "target": "",
                "met": "",
            }
        )
    report(rows, ("ms", "ms per step"), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
