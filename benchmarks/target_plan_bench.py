"""Plan a 1B Llama-style NNX decoder for 8 x H100 without a GPU (issue 36).

Per-device peak of one train step (adamw, fsdp over 8, bf16 compute, seq 2048, blocks under
``nnx.remat(policy=nothing_saveable)``) four ways, each part in a process of its own (its
compile time and peak RSS):

  jaxdev  ``jaxdev.memory.plan`` on ``make_mesh({"fsdp": 8}, target="h100")`` (XLA:GPU)
  direct  the same program by hand: ``jax.experimental.topologies`` + ``jax.jit``, the
          shardings jaxdev gives, ``memory_analysis()`` (must equal jaxdev's, within 2%)
  cpu     ``jaxdev.memory.plan`` on 8 fake CPU devices (XLA:CPU: no reduce-scatter)
  hand    a hand estimate (the formula in ``hand_estimate``)

Run (needs the CUDA plugin, no GPU): ``.venv-cuda/bin/python benchmarks/target_plan_bench.py``
(``--parts jaxdev,direct`` to skip the CPU compile; ``--config tiny`` for a quick check).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS_PER_DEVICE, N = 1, 8


def _setup(config: str):
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", N)
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import llama_plan

    entry = {"1b": llama_plan.llama_1b, "tiny": llama_plan.llama_tiny}[config]
    return entry(remat=jax.checkpoint_policies.nothing_saveable), llama_plan


def _jaxdev_step(got, mesh):
    import jax
    from flax import nnx

    import jaxdev

    model = nnx.eval_shape(got["model"])
    step = jaxdev.make_train_step(
        jaxdev.nnx.loss(model, got["loss"]), got["tx"],
        jaxdev.Strategy.sharded(mesh, rules="fsdp"), has_state=True,
    )
    state = step.abstract_state(model)
    rows = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((ROWS_PER_DEVICE * N, *x.shape[1:]), x.dtype), got["batch"]
    )
    return model, step, state, rows


def part(name: str, config: str) -> dict:
    """One part, in this process: ``{"peak", "seconds", "rss"}``."""
    got, _ = _setup(config)

    import jaxdev

    start = time.perf_counter()
    if name in ("jaxdev", "cpu"):
        mesh = jaxdev.make_mesh({"fsdp": N}, target="h100" if name == "jaxdev" else None)
        _, step, state, rows = _jaxdev_step(got, mesh)
        plan = jaxdev.memory.plan(state, step=step, batch=rows)
        peak, extra = plan.peak, {"fits": bool(plan.fits()) if name == "jaxdev" else None}
        extra["backend"] = plan.backend
    else:
        peak, extra = _direct(got, _jaxdev_step(got, jaxdev.make_mesh({"fsdp": N}))), {}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": peak, "seconds": time.perf_counter() - start, "rss": rss, **extra}


def _direct(got, built) -> int:
    """XLA:GPU's memory_analysis() of the same step written with jax.jit and topologies."""
    import jax
    import optax
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdev._target import load_target

    model, _, state, rows = built
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=load_target("h100").config, topology=f"1x1x{N}"
    )
    mesh = topologies.make_mesh(topo, (N,), ("fsdp",))
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    tx, loss_fn = got["tx"], got["loss"]
    tree = (state.params, state.opt_state)
    shard = jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), tree)

    def train(tree, batch):
        params, opt = tree

        def loss(p):
            return loss_fn(nnx.merge(graphdef, p, rest), batch).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    jitted = jax.jit(
        train,
        in_shardings=(shard, NamedSharding(mesh, P("fsdp"))),
        out_shardings=(shard, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    m = jitted.lower(bare, rows).compile().memory_analysis()
    return (
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def hand_estimate(config: str) -> int:
    """Per device: f32 params, adam's two moments and the reduce-scattered f32 gradients,
    sharded 8 ways; one block's f32 weights gathered (twice: the next one prefetched); each
    block's bf16 input saved (remat); one block's recompute (q, kv, attention out, the
    2 x ffn MLP, bf16, and their gradients: x2); the f32 logits and their gradient."""
    _, llama_plan = _setup(config)
    c = {"1b": llama_plan.Config(), "tiny": llama_plan.Config(1000, 128, 2, 4, 2, 256, 128)}[
        config
    ]
    hd = c.dim // c.heads
    block = 2 * c.dim * c.dim + c.dim * 2 * c.kv_heads * hd + 3 * c.dim * c.ffn + 2 * c.dim
    params = c.layers * block + 2 * c.vocab * c.dim + c.dim
    state = 4 * params * 4 // N  # params, mu, nu, grads
    gathered = 2 * 4 * block
    s, b = c.seq, ROWS_PER_DEVICE
    saved = c.layers * b * s * c.dim * 2
    work = 2 * b * s * (2 * c.dim + 2 * c.kv_heads * hd + 4 * c.ffn) * 2
    logits = 2 * b * s * c.vocab * 4
    return state + gathered + saved + work + logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="jaxdev,direct,cpu")
    ap.add_argument("--config", default="1b", choices=["1b", "tiny"])
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        print(json.dumps(part(args.part, args.config)))
        return
    results = {}
    for name in args.parts.split(","):
        cmd = [sys.executable, __file__, "--part", name, "--config", args.config]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"part {name} failed")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(name, results[name], flush=True)
    results["hand"] = {"peak": hand_estimate(args.config)}
    gib = 2**30
    print(f"\n{args.config} Llama-style NNX decoder, fsdp={N}, {ROWS_PER_DEVICE} row per device "
          "(2048 tokens for 1b), adamw, per-block remat (nothing_saveable)")
    print(f"{'plan':8} {'peak/device':>12} {'compile+plan':>13} {'peak RSS':>9}")
    for name, r in results.items():
        secs = f"{r['seconds']:.1f} s" if "seconds" in r else "-"
        rss = f"{r['rss'] / 1e9:.2f} GB" if "rss" in r else "-"
        print(f"{name:8} {r['peak'] / gib:>8.3f} GiB {secs:>13} {rss:>9}")
    if "jaxdev" in results and "direct" in results:
        a, b = results["jaxdev"]["peak"], results["direct"]["peak"]
        print(f"jaxdev / direct = {a / b:.4f} (must be within 2%)")


if __name__ == "__main__":
    main()
