"""jaxdev on one real GPU: transfers, the train step, memory seen, fitted and exhausted.

Run on a GPU host: ``python benchmarks/gpu_bench.py [--repeats N] [--json PATH]``.
Every ratio compares two ways of doing the same thing, timed side by side in
this one run (interleaved repetitions, medians; see ``_timing.py``):

1. Host to device, a 256 MiB tree of 32 float32 leaves: ``jax.device_put``
   (the floor) against ``jaxdev.to_device`` (which copies host arrays first, so
   a refilled loader buffer can never change a placed batch), and a loop of 16
   device_put + compute against ``jaxdev.prefetch_to_device`` (transfers in a
   thread, overlapped with the compute).
2. The train step on one GPU (an MLP of 4096 hidden units, batch 1024, SGD,
   200 steps): a hand-written ``jax.jit`` step against ``make_train_step`` with
   metrics kept on the device, and against the hand step reading
   ``float(loss)`` each step (the sync d2l warns about).
3. Memory on the real card: ``jaxdev.memory.plan`` of the state and batch
   against the bytes the device reports in use after one step, and
   ``fit_memory`` with the card's own limit (no ``limit=``); then a step whose
   temporaries cannot fit, run in an ordinary loop: the error must be jaxdev's
   ``OutOfMemoryError`` (where it surfaces is recorded), and a step that fits
   must run afterwards.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import time_side_by_side

import jaxdev

MiB = 2**20


def _transfers(repeats: int) -> list[dict]:
    dev = jaxdev.d2l.try_gpu()
    tree = {f"w{i}": np.random.default_rng(i).random(2 * MiB, np.float32) for i in range(32)}
    nbytes = sum(x.nbytes for x in tree.values())
    batches = [{"x": np.full((2048, 2048), i, np.float32)} for i in range(16)]  # 16 MiB each
    w = jax.device_put(jnp.eye(2048) * 0.5, dev)
    work = jax.jit(lambda b, w: jnp.tanh(b["x"] @ w @ w @ w).sum())

    def loop(batches_on_device):
        return float(sum(work(b, w) for b in batches_on_device))

    t = time_side_by_side(
        {
            "device_put": lambda: jax.block_until_ready(jax.device_put(tree, dev)),
            "to_device": lambda: jax.block_until_ready(jaxdev.to_device(tree, dev)),
            "loop of device_put": lambda: loop(jax.device_put(b, dev) for b in batches),
            "prefetch_to_device": lambda: loop(jaxdev.prefetch_to_device(iter(batches), 2, dev)),
        },
        repeats=repeats,
    )
    gbs = {k: nbytes / t.median(k) / 1e9 for k in ("device_put", "to_device")}
    return [
        {
            "what": "host->GPU, 256 MiB tree: to_device / device_put",
            "ratio": t.ratio("to_device", "device_put"),
            "GB/s": gbs,
        },
        {
            "what": "16 batches of 16 MiB + compute: prefetch_to_device / device_put loop",
            "ratio": t.ratio("prefetch_to_device", "loop of device_put"),
            "ms": {k: 1e3 * t.median(k) for k in ("prefetch_to_device", "loop of device_put")},
        },
    ]


def _init(width=4096, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (1024, width)) * 0.02,
        "w2": jax.random.normal(k2, (width, 10)) * 0.02,
    }


def _loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], batch["y"])


def _train(repeats: int, steps: int = 200) -> list[dict]:
    dev = jaxdev.d2l.try_gpu()
    tx = optax.sgd(0.01)
    rng = np.random.default_rng(0)
    batches = [
        jaxdev.to_device(
            {"x": rng.normal(size=(1024, 1024)).astype(np.float32), "y": rng.integers(0, 10, 1024)},
            dev,
        )
        for _ in range(8)
    ]

    @jax.jit
    def hand(params, opt, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(p, batch).mean())(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.single(dev), donate=False)
    params = jaxdev.to_device(_init(), dev)
    state = step.init_state(params, tx)
    opt = tx.init(params)

    def run_hand(read):
        p, o = params, opt
        for i in range(steps):
            p, o, loss = hand(p, o, batches[i % 8])
            if read:
                float(loss)
        return jax.block_until_ready(p)

    def run_jaxdev():
        st, m = state, None
        for i in range(steps):
            st, m = step(st, batches[i % 8], m)
        return m.fetch()

    t = time_side_by_side(
        {
            "hand jit": lambda: run_hand(False),
            "hand + float(loss)": lambda: run_hand(True),
            "jaxdev step": run_jaxdev,
        },
        repeats=repeats,
    )
    ms = {k: 1e3 * t.median(k) / steps for k in t}
    return [
        {
            "what": f"train step (1 GPU, {steps} steps): jaxdev metrics on device / hand jit",
            "ratio": t.ratio("jaxdev step", "hand jit"),
            "ms/step": ms,
        },
        {
            "what": "hand jit + float(loss) per step / hand jit",
            "ratio": t.ratio("hand + float(loss)", "hand jit"),
        },
    ]


def _memory() -> list[dict]:
    dev = jaxdev.d2l.try_gpu()
    tx = optax.sgd(0.01)
    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.single(dev))
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(4096, 1024)).astype(np.float32), "y": rng.integers(0, 10, 4096)}
    before = dev.memory_stats()["bytes_in_use"]
    state = step.init_state(_init(16384), tx)
    placed = step.put_batch(batch)
    state, metrics = step(state, placed)
    jax.block_until_ready((state, metrics))
    used = dev.memory_stats()["bytes_in_use"] - before
    planned = jaxdev.memory.plan(state, step=step, batch=batch)
    ledger = jaxdev.memory.ledger(state=state, batch=placed, metrics=metrics)
    fit = jaxdev.memory.fit_memory(step, state, batch)
    rows = [
        {
            "what": "memory.plan total / bytes the GPU reports in use after one step",
            "ratio": planned.total / used,
            "MiB": {"plan": planned.total / MiB, "in use": used / MiB},
            "ledger": str(ledger).splitlines()[:6],
        },
        {
            "what": "fit_memory with the card's own limit (no limit=)",
            "batch_size": fit.batch_size,
            "change": fit.change,
            "peak GiB": fit.peak / 2**30,
            "limit GiB": dev.memory_stats()["bytes_limit"] / 2**30,
        },
    ]
    del state, metrics, placed

    def huge(params, b):  # a (rows, 4096, 4096) temporary: 16 GiB per 256 rows
        h = b["x"][:, :, None] * params["w"][None, :, :]
        return jnp.sum((h @ params["v"]) ** 2, axis=(1, 2))

    big = jaxdev.make_train_step(huge, tx, jaxdev.Strategy.single(dev))
    params = {"w": jnp.ones((4096, 4096)) * 1e-3, "v": jnp.ones((4096, 8)) * 1e-3}
    st, m, where, err = big.init_state(params, tx), None, "no error", None
    t0 = time.perf_counter()
    try:
        for _ in range(3):  # the ordinary loop
            st, m = big(st, big.put_batch({"x": np.ones((4096, 4096), np.float32)}), m)
        where = "at fetch"
        m.fetch()
    except Exception as e:  # noqa: BLE001 - recorded: its type is what is measured
        err = e
        where = where if where == "at fetch" else "at the step call"
    ok = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.single(dev))
    after = ok(ok.init_state(_init(), tx), ok.put_batch(batch))[1].fetch()["loss"]
    rows.append(
        {
            "what": "a step that cannot fit, in an ordinary loop",
            "error": type(err).__name__,
            "is OutOfMemoryError": isinstance(err, jaxdev.OutOfMemoryError),
            "where": where,
            "seconds": time.perf_counter() - t0,
            "message": str(err).splitlines()[:8],
            "a step that fits afterwards, loss": float(after),
        }
    )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--parts", default="transfers,train,memory")
    args = parser.parse_args(argv)
    if not any(d.platform == "gpu" for d in jax.devices()):
        raise SystemExit("gpu_bench needs a GPU (jax.devices() has none)")
    info = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
    rows = []
    parts = {
        "transfers": lambda: _transfers(args.repeats),
        "train": lambda: _train(args.repeats),
        "memory": _memory,
    }
    for part in (parts[name] for name in args.parts.split(",")):
        try:  # one part's failure is a row; the others still run (one lease, one call)
            rows += part()
        except Exception as e:  # noqa: BLE001
            rows.append({"what": "a part failed", "error": f"{type(e).__name__}: {e}"[:2000]})
    for row in rows:
        print(json.dumps(row, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
