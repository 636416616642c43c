"""Peak host memory of building a sharded model: init_sharded vs replicate-then-shard (issue 12).

Run: ``python benchmarks/init_bench.py [--widths 1024,4096,4096,1024] [--md PATH] [--json PATH]``.

A linen MLP (default widths 1024-4096-4096-1024: 25.2M float32 params,
100.7 MB) with its adam state (mu, nu: 2 x params), placed with
``rules="fsdp"`` on 8 fake CPU devices. Fake CPU devices keep their buffers
in this process's memory, so the process's resident set size *is* the memory
of all 8 devices plus the host.

Each method runs in its own fresh subprocess:

1. warm-up: the same method on a tiny MLP (widths 64-64), so the runtime,
   thread pools and the compiler are loaded before measuring;
2. ``rss0`` = ``VmRSS``; then ``echo 5 > /proc/self/clear_refs`` resets the
   kernel's peak counter ``VmHWM`` to the current RSS;
3. the method builds the big model's params and adam state (compilation of
   the big model included) and blocks until they are ready;
4. growth = ``VmHWM`` - ``rss0``: the peak extra memory the method needed,
   while the state it built is still alive.

Methods:

* ``init_sharded``: ``jaxdev.init_sharded(model.init, key, x, mesh=mesh,
  rules="fsdp")``, then ``jax.jit(tx.init, out_shardings=follow_params(...))``:
  no device and no host holds a full copy; growth ~ 1x the state.
* ``init_then_shard``: ``model.init`` and ``tx.init`` jitted on one device
  (one full copy of the state), then ``jaxdev.shard_params`` onto the fsdp
  shardings: ~2x.
* ``replicate_then_shard``: ``model.init`` on one device, ``jax.device_put``
  of the full params (then the full adam state) replicated on all 8 devices,
  then ``jax.device_put`` onto the fsdp shardings: ~8x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
METHODS = ("init_sharded", "init_then_shard", "replicate_then_shard")


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS


def child(method: str, widths: list[int]) -> dict:
    """Measure one method in this (fresh) process; return its figures."""
    sys.path.insert(0, REPO)
    import jaxdev

    jaxdev.testing.use_fake_cpu_devices(8)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdev._rules import follow_params

    jax.config.update("jax_platforms", "cpu")
    mesh = jaxdev.make_mesh({"fsdp": 8})
    tx = optax.adam(1e-3)

    class MLP(nn.Module):
        widths: tuple[int, ...]

        @nn.compact
        def __call__(self, x):
            for w in self.widths[1:]:
                x = nn.relu(nn.Dense(w)(x))
            return x

    def build(ws: list[int]):
        model = MLP(tuple(ws))
        key, x = jax.random.key(0), jnp.ones((1, ws[0]), jnp.float32)
        if method == "init_sharded":
            params = jaxdev.init_sharded(model.init, key, x, mesh=mesh, rules="fsdp")
            shardings = jaxdev.param_shardings(params, mesh, "fsdp")
            follow = follow_params(jax.eval_shape(tx.init, params), params, shardings, mesh)
            opt = jax.jit(tx.init, out_shardings=follow)(params)
        elif method == "init_then_shard":
            full = jax.jit(model.init)(key, x)  # params and adam state whole, on one device
            full_opt = jax.jit(tx.init)(full)
            shardings = jaxdev.param_shardings(full, mesh, "fsdp")
            follow = follow_params(full_opt, full, shardings, mesh)
            params, opt = jaxdev.shard_params((full, full_opt), mesh, (shardings, follow))
            del full, full_opt
        elif method == "replicate_then_shard":
            replicated = NamedSharding(mesh, P())
            full = jax.jit(model.init)(key, x)
            rep = jax.device_put(full, replicated)
            del full
            rep_opt = jax.jit(tx.init, out_shardings=replicated)(rep)
            shardings = jaxdev.param_shardings(rep, mesh, "fsdp")
            follow = follow_params(rep_opt, rep, shardings, mesh)
            params, opt = jax.device_put((rep, rep_opt), (shardings, follow))
            del rep, rep_opt
        else:
            raise SystemExit(f"unknown method {method!r}; pick one of {METHODS}")
        jax.block_until_ready((params, opt))
        return params, opt

    warm = build([64, 64])  # load the runtime and compiler
    del warm
    gc.collect()
    rss0 = _status("VmRSS")
    _reset_peak()
    params, opt = build(widths)
    peak = _status("VmHWM")
    leaves = jax.tree.leaves((params, opt))
    state_bytes = sum(x.nbytes for x in leaves)
    per_device: dict[int, int] = {}
    for x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {
        "method": method,
        "params": n_params,
        "state_bytes": state_bytes,
        "per_device_bytes": max(per_device.values()),
        "rss_before": rss0,
        "peak_rss": peak,
        "growth": peak - rss0,
        "ratio": (peak - rss0) / state_bytes,
    }


def run_child(method: str, widths: list[int], timeout: float = 600.0) -> dict:
    """Run :func:`child` in a fresh Python process (clean JAX environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", method, "--widths"]
        + [",".join(map(str, widths))],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode:
        raise RuntimeError(f"{method} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def table(rows: list[dict]) -> str:
    lines = [
        "| method | params | state (params + adam) | per device | peak RSS growth "
        "| growth / state |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['params'] / 1e6:.1f}M | {_mb(r['state_bytes'])} | "
            f"{_mb(r['per_device_bytes'])} | {_mb(r['growth'])} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1024,4096,4096,1024")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--md", help="write the table (markdown) here")
    ap.add_argument("--json", help="write the rows (JSON) here")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        print(json.dumps(child(args.child, widths)))
        return
    rows = [run_child(m, widths) for m in args.methods.split(",")]
    text = table(rows)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
