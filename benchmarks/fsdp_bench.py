"""FSDP vs replicated params: step time at equal global batch, and bytes per device (issue 12).

Run: ``python benchmarks/fsdp_bench.py [--repeats N] [--json PATH]``.

1. Step time: one MLP trained with adam by ``jaxdev.make_train_step`` under
   ``Strategy.sharded(data_mesh())`` (replicated params), ``rules="fsdp"`` on a
   ``data=2 x fsdp=4`` mesh and ``rules="fsdp"`` on the 1-D 8-device mesh
   (ZeRO-3 style), the same global batch split 8 ways in every case; timed side
   by side (interleaved repetitions, median of per-repetition ratios; see
   ``_timing.py``). Batches are placed before timing.
2. Bytes per device of params + adam state for a ~25M-parameter MLP (linen;
   the NNX twin from shapes): computed from shapes with
   :func:`jaxdev.param_shardings` of the state, and measured on the placed state
   (``TrainStep.init_state``) for replicated and fsdp over 8 devices.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import report, time_side_by_side  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_platforms", "cpu")

TX = optax.adam(1e-3)
STEPS, BATCH = 20, 256
SMALL = (512, 1024, 1024, 10)  # the timed model: ~1.6M params
BIG = (1024, 4096, 4096, 1024)  # the bytes model: ~25.2M params


class MLP(nn.Module):
    sizes: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.sizes[1:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.sizes[-1])(x)


class NNXMLP(nnx.Module):
    def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])


def make_loss(model: MLP):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    return loss_fn


class Loop:
    """A training loop whose state persists across timed repetitions (donation-safe)."""

    def __init__(self, step, state, batches):
        self.step, self.state, self.batches = step, state, batches

    def __call__(self):
        metrics = None
        for b in self.batches:
            self.state, metrics = self.step(self.state, b, metrics)
        metrics.fetch()
        return self.state.params


class _HandLoop:
    def __init__(self, step, state, batches):
        self.step, self.state, self.batches = step, state, batches

    def __call__(self):
        p, o = self.state
        for i, b in enumerate(self.batches):
            p, o, loss = self.step(p, o, b)
            if i % 8 == 7:  # bound the queue like TrainStep (XLA:CPU collectives)
                loss.block_until_ready()
        self.state = (p, o)
        return p


def _hand_loop(model: MLP, params, x, y) -> _HandLoop:
    """The Flax-example step (value_and_grad + tx.update) under jit, params replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jaxdev.data_mesh()
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    loss_fn = make_loss(model)

    def step(p, o, batch):
        loss, grads = jax.value_and_grad(lambda q: loss_fn(q, batch).mean())(p)
        updates, o = TX.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    jitted = jax.jit(
        step, in_shardings=(rep, rep, data), out_shardings=(rep, rep, rep), donate_argnums=(0, 1)
    )
    state = jaxdev.copy_to((params, TX.init(params)), mesh)
    batches = [jaxdev.shard_batch({"x": a, "y": b}, mesh) for a, b in zip(x, y)]
    return _HandLoop(jitted, state, batches)


def step_time_rows(repeats: int) -> list[dict]:
    model = MLP(SMALL)
    params = model.init(jax.random.key(0), jnp.zeros((1, SMALL[0])))["params"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, BATCH, SMALL[0])).astype(np.float32)
    y = rng.integers(0, SMALL[-1], size=(STEPS, BATCH)).astype(np.int32)
    strategies = {
        "replicated (data=8)": jaxdev.Strategy.sharded(jaxdev.data_mesh()),
        "fsdp (data=2 x fsdp=4)": jaxdev.Strategy.sharded(
            jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp"
        ),
        "fsdp (data=8, ZeRO-3)": jaxdev.Strategy.sharded(jaxdev.data_mesh(), rules="fsdp"),
    }
    loops = {}
    for name, strategy in strategies.items():
        step = jaxdev.make_train_step(make_loss(model), TX, strategy)
        batches = [step.put_batch({"x": a, "y": b}) for a, b in zip(x, y)]
        loops[name] = Loop(step, step.init_state(params, TX), batches)
    loops["hand-written jit, replicated"] = _hand_loop(model, params, x, y)
    t = time_side_by_side(loops, repeats=repeats)
    base = "replicated (data=8)"
    rows = []
    for name in loops:
        rows.append(
            {
                "what": f"{STEPS} steps, MLP {SMALL}, adam, global batch {BATCH}",
                "variant": name,
                "ms_per_step": round(1e3 * t.median(name) / STEPS, 2),
                "ratio_vs": base,
                "ratio": round(t.ratio(name, base), 2),
                "target": "report",
                "met": "-",
            }
        )
    return rows


def _shard_bytes(shapes, shardings) -> int:
    """Bytes of the largest shard of every leaf, summed: what one device holds."""
    leaves, treedef = jax.tree.flatten(shapes)
    return sum(
        int(np.prod(s.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize
        for x, s in zip(leaves, treedef.flatten_up_to(shardings))
    )


def _placed_bytes(tree) -> int:
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def bytes_rows() -> list[dict]:
    model = MLP(BIG)
    x0 = jnp.zeros((1, BIG[0]))
    shapes = jax.eval_shape(lambda: TrainState(model.init(jax.random.key(0), x0)["params"]))
    nnx_shapes = jax.eval_shape(lambda: TrainState(nnx.state(NNXMLP(BIG, nnx.Rngs(0)), nnx.Param)))
    n_params = sum(x.size for x in jax.tree.leaves(shapes.params))
    total = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves((shapes.params, shapes.opt_state))
    )
    meshes = {
        "replicate": (jaxdev.data_mesh(), "replicate"),
        "fsdp over 8 (data=8)": (jaxdev.data_mesh(), "fsdp"),
        "fsdp over 8 (fsdp=8)": (jaxdev.make_mesh({"fsdp": 8}), "fsdp"),
        "fsdp over 4 (data=2 x fsdp=4)": (jaxdev.make_mesh({"data": 2, "fsdp": 4}), "fsdp"),
    }
    rows = []
    for flavour, tree in (("linen", shapes), ("nnx", nnx_shapes)):
        for name, (mesh, rules) in meshes.items():
            s = jaxdev.param_shardings(tree, mesh, rules)
            per = _shard_bytes((tree.params, tree.opt_state), (s.params, s.opt_state))
            small = sum(
                x.size * x.dtype.itemsize
                for x, sh in zip(jax.tree.leaves(tree.params), jax.tree.leaves(s.params))
                if sh.is_fully_replicated
            )
            ways = 1 if rules == "replicate" else (8 if "over 8" in name else 4)
            rows.append(
                {
                    "model": f"{flavour} MLP {BIG}, {n_params / 1e6:.1f}M params, adam",
                    "rules": name,
                    "per_device_MiB": round(per / 2**20, 2),
                    "total_MiB": round(total / 2**20, 2),
                    "fraction": round(per / total, 4),
                    "bound_MiB": "-"
                    if ways == 1
                    else round((total / ways * 1.05 + 3 * small) / 2**20, 2),
                    "replicated_small_leaves_KiB": "-"
                    if ways == 1
                    else round(3 * small / 2**10, 1),
                    "source": "shapes",
                }
            )
    # measured on placed states (linen): replicate and fsdp over 8
    params = model.init(jax.random.key(0), x0)["params"]
    for name, strategy in (
        ("replicate", jaxdev.Strategy.sharded(jaxdev.data_mesh())),
        ("fsdp over 8 (data=8)", jaxdev.Strategy.sharded(jaxdev.data_mesh(), rules="fsdp")),
    ):
        step = jaxdev.make_train_step(make_loss(model), TX, strategy)
        state = step.init_state(params, TX)
        per = _placed_bytes((state.params, state.opt_state))
        rows.append(
            {
                "model": f"linen MLP {BIG}, {n_params / 1e6:.1f}M params, adam",
                "rules": name,
                "per_device_MiB": round(per / 2**20, 2),
                "total_MiB": round(total / 2**20, 2),
                "fraction": round(per / total, 4),
                "bound_MiB": "-",
                "replicated_small_leaves_KiB": "-",
                "source": "placed (init_state)",
            }
        )
        del state
        gc.collect()
    return rows


def TrainState(params):  # noqa: N802 - shapes of jaxdev.TrainState.create
    return jaxdev.TrainState.create(params, TX)


def print_bytes(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    rows = step_time_rows(args.repeats)
    report(rows, ("ms_per_step", "ms/step"))
    print()
    brows = bytes_rows()
    print_bytes(brows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_time": rows, "bytes": brows}, f, indent=2)


if __name__ == "__main__":
    main()
