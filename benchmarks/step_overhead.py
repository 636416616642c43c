"""Per-call cost of jaxdev's train step against its own compiled program and a hand step.

Run: ``python benchmarks/step_overhead.py [--leaves 2,100,500,1000] [--models mlp,transformer]
[--strategies single,sharded,pmap] [--rounds 7] [--calls 64] [--loop-s 0.15] [--json PATH]
[--profile PATH]``;
``--quick`` is a short smoke run (CI); ``--h100-mlp`` times BENCHMARKS.md's "One real GPU"
MLP (1024-4096-10, batch 1024) on ``Strategy.single`` only (meant for a GPU host).

Per case (a model, a strategy) four loops of N calls each (N: a multiple of 8 making
``--loop-s`` seconds of hand calls, at most ``--calls``), state donated:

- ``step``: ``state, metrics = step(state, batch, metrics)`` (jaxdev, running metrics).
- ``program``: the compiled program that step holds, called directly with the same
  arguments (the running metrics as the program takes them, ``dict(metrics)``): today
  ``step._jitted`` (private; the jax.jit / pmap object under jaxdev's wrappers); if that is
  absent or fails, the public ``step.lower(...).compile()``. The JSON says which
  (``program_source``). ``step - program`` is jaxdev's own Python per call.
- ``hand``: a hand-written step, SGD, state donated, returning the new state and the loss:
  ``jax.jit`` (single), ``jax.jit`` with ``NamedSharding`` in/out shardings (sharded, state
  replicated, batch split on the data axis), ``jax.pmap`` with ``lax.pmean`` (pmap). The
  goals are read against it.
- ``hand+mean``: the same hand step doing the same work as jaxdev's: it also keeps the
  running mean of the loss on the device (a dict ``{"total": f32, "count": i32}`` in and
  out, not donated, as jaxdev's metrics). ``step/hand+mean`` is what jaxdev's wrapper and
  its program's own outputs (a token, its pytrees) cost over a hand step with the same
  on-device metric; ``hand+mean/hand`` what that metric costs a hand step.

The loops are timed interleaved in ``--rounds`` rounds (the order rotating each round, after
one untimed warm-up round); a figure is the median over rounds of the per-call time, a ratio
the median of per-round ratios (``_timing.py``). On multi-device CPU every loop waits for its
last output every 8 calls: XLA:CPU deadlocks with ~100 queued collective programs.
``host us``: the loop thread's CPU time per call (``time.thread_time``, the final wait left
out), what dispatching costs the host; on a CPU backend the programs run on the same cores.

Models: an MLP of 16x16 ``tanh`` layers (kernel + bias: ``leaves / 2`` layers; batch 64) so
dispatch dominates, and a Flax linen transformer of 101 leaves (6 blocks, d=32, seq 16).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdev  # noqa: E402

jaxdev.testing.use_fake_cpu_devices(8)  # CPU only: a GPU host keeps its GPU as the default

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import time_side_by_side  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SYNC_EVERY = 8  # multi-device CPU: wait every 8 calls (XLA:CPU deadlocks with ~100 queued)
TX = optax.sgd(1e-3)
N_DEVICES = 8


# ---------------------------------------------------------------- models


def mlp(leaves: int, width: int = 16, rows: int = 64) -> tuple:
    """An MLP of ``leaves // 2`` tanh layers ``width x width`` (kernel + bias each)."""
    layers = max(1, leaves // 2)
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(width)
    params = {
        f"l{i:03d}": {
            "w": (rng.normal(size=(width, width)) * scale).astype(np.float32),
            "b": np.zeros(width, np.float32),
        }
        for i in range(layers)
    }

    def loss(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i:03d}"]["w"] + p[f"l{i:03d}"]["b"])
        return optax.softmax_cross_entropy_with_integer_labels(h, b["y"])

    batch = {
        "x": rng.normal(size=(rows, width)).astype(np.float32),
        "y": rng.integers(0, width, rows).astype(np.int32),
    }
    return f"mlp {layers}x{width}x{width}", params, loss, batch


def h100_mlp() -> tuple:
    """BENCHMARKS.md "One real GPU": 1024-4096-10, batch 1024, no biases (gpu_bench.py)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": np.asarray(jax.random.normal(k1, (1024, 4096)) * 0.02),
        "w2": np.asarray(jax.random.normal(k2, (4096, 10)) * 0.02),
    }

    def loss(p, b):
        h = jax.nn.relu(b["x"] @ p["w1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], b["y"])

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(1024, 1024)).astype(np.float32),
        "y": rng.integers(0, 10, 1024).astype(np.int32),
    }
    return "mlp 1024-4096-10 (H100 case)", params, loss, batch


def transformer(d: int = 32, heads: int = 4, blocks: int = 6, seq: int = 16, vocab: int = 64):
    """A Flax linen transformer LM: 1 + 16 * blocks + 4 leaves (101 for 6 blocks)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(h, h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(h)))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, d)(tokens)
            for _ in range(blocks):
                x = Block()(x)
            return nn.Dense(vocab)(nn.LayerNorm()(x))

    model = LM()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (16, seq + 1)).astype(np.int32)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), tokens[:, :-1])["params"])

    def loss(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(-1)

    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    return f"linen transformer {blocks}x{d}", params, loss, batch


# ---------------------------------------------------------------- the loops


def hand_body(loss_fn, axis=None, mean=False):
    """The hand step: ``(step, params, opt_state), batch -> (new state, mean loss)``; with
    ``mean``, ``(state, batch, running) -> (new state, running)``: ``running`` the sum of
    the losses and their count so far (``{"total": f32, "count": i32}``)."""

    def body(state, batch, running=None):
        n, params, opt = state
        if not mean:  # as in every round before
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch).mean())(params)
        else:
            losses_of = lambda p: (lambda ls: (ls.mean(), ls))(loss_fn(p, batch))  # noqa: E731
            (loss, losses), grads = jax.value_and_grad(losses_of, has_aux=True)(params)
            total, count = jnp.sum(losses), jnp.int32(losses.size)
        if axis is not None:
            loss, grads = jax.lax.pmean((loss, grads), axis)
            if mean:
                total, count = jax.lax.psum((total, count), axis)
        updates, opt = TX.update(grads, opt, params)
        new = (n + 1, optax.apply_updates(params, updates), opt)
        if not mean:
            return new, loss
        return new, {"total": running["total"] + total, "count": running["count"] + count}

    return body


def hand_step(kind: str, loss_fn, params, batch, devices, mean=False):
    """The hand-written step for ``kind`` and its placed state and batch (with ``mean``, and
    its running sums, zero: ``fn(state, batch, running)``)."""
    state = (np.int32(0), params, TX.init(params))
    running = {"total": np.float32(0), "count": np.int32(0)}
    body = hand_body(loss_fn, "d" if kind == "pmap" else None, mean)
    more = (running,) if mean else ()
    if kind == "single":
        dev = devices[0]
        fn = jax.jit(body, donate_argnums=0)
        return (
            fn,
            jax.device_put(state, dev),
            jax.device_put(batch, dev),
            *jax.device_put(more, dev),
        )
    if kind == "sharded":
        mesh = jax.sharding.Mesh(np.array(devices), ("data",))
        rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        ins = (rep, rows, rep)[: 2 + mean]
        fn = jax.jit(body, in_shardings=ins, out_shardings=(rep, rep), donate_argnums=0)
        return (
            fn,
            jax.device_put(state, rep),
            jax.device_put(batch, rows),
            *jax.device_put(more, rep),
        )
    n = len(devices)  # pmap: state stacked on a device axis, batch split (n, rows / n, ...)
    place = jax.pmap(lambda x: x, devices=devices)
    stack = lambda t: place(jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), t))  # noqa: E731
    split = place(jax.tree.map(lambda x: np.reshape(x, (n, -1, *np.shape(x)[1:])), batch))
    fn = jax.pmap(body, axis_name="d", devices=devices, donate_argnums=0)
    return fn, stack(state), split, *(stack(more) if mean else ())


def strategy_of(kind: str, devices):
    if kind == "single":
        return jaxdev.Strategy.single(devices[0])
    if kind == "sharded":
        return jaxdev.Strategy.sharded(jaxdev.data_mesh(list(devices)))
    return jaxdev.Strategy.pmap(list(devices))


def program_of(step, state, batch, metrics):
    """The compiled program ``step`` runs, and where it came from.

    ``step._jitted`` (private): the jax.jit / pmap object under jaxdev's wrappers (``.fn``);
    else the public ``step.lower(state, batch, metrics).compile()``.
    """
    jitted = getattr(step, "_jitted", None)
    key = next((k for k in (jitted or {}) if len(k) > 1 and k[1] is True), None)
    if key is not None:
        fn, names = jitted[key], []
        while type(fn).__module__.startswith("jaxdev") and callable(getattr(fn, "fn", None)):
            names.append(type(fn).__name__)
            fn = fn.fn
        return fn, f"step._jitted[{key[:2]}] under {'/'.join(names) or 'nothing'}"
    return step.lower(state, batch, metrics).compile(), "step.lower(...).compile()"


def _loop(call, carry, calls, sync_every):
    """A zero-argument callable: ``calls`` calls threading ``carry[0]``; returns the last
    output to wait on (waited for every ``sync_every`` calls when set)."""

    def run():
        c, out = carry[0], None
        for i in range(1, calls + 1):
            c, out = call(c)
            if sync_every and i % sync_every == 0:
                jax.block_until_ready(out)
        carry[0] = c
        return out

    return run


def loops(kind, model, devices):
    """The four variants' per-call functions (each ``carry -> (carry, output)``) with their
    carries, compiled and run once; the wait interval; the source of the program variant."""
    _, params, loss_fn, batch = model
    sync = SYNC_EVERY if len(devices) > 1 and devices[0].platform == "cpu" else 0
    step = jaxdev.make_train_step(loss_fn, TX, strategy_of(kind, devices))
    placed = step.put_batch(batch)

    def first(params):  # both compiled variants: without, then with running metrics
        state, metrics = step(step.init_state(params), placed)
        return step(state, placed, metrics)

    def call_step(c):  # waited for (and flattened) only at a sync, as the others
        state, metrics = step(c[0], placed, c[1])
        return (state, metrics), metrics

    s_step, s_prog = first(params), first(params)
    try:
        prog, source = program_of(step, s_prog[0], placed, s_prog[1])
        out = jax.block_until_ready(prog(s_prog[0], placed, dict(s_prog[1])))
    except Exception as err:  # private attributes moved or the raw call failed: public API
        s_prog = first(params)
        prog = step.lower(s_prog[0], placed, s_prog[1]).compile()
        source = f"step.lower(...).compile() (private: {type(err).__name__})"
        out = prog(s_prog[0], placed, dict(s_prog[1]))

    def call_prog(c):
        out = prog(c[0], placed, c[1])
        return out[:2], out[-1]  # (state, metrics), the token the step waits on

    hand, h_state, h_batch = hand_step(kind, loss_fn, params, batch, devices)
    h_state, _ = jax.block_until_ready(hand(h_state, h_batch))
    mean, m_state, m_batch, running = hand_step(kind, loss_fn, params, batch, devices, True)
    for _ in range(2):  # as ``first``: the same work, checked (its mean is jaxdev's)
        m_state, running = jax.block_until_ready(mean(m_state, m_batch, running))
    want = float(s_step[1].fetch()["loss"])
    got = float(np.sum(running["total"]) / np.sum(running["count"]))  # pmap: n equal copies
    assert abs(got - want) <= 1e-5 * abs(want), f"hand+mean's running mean {got}, jaxdev's {want}"

    def call_mean(c):
        c = mean(c[0], m_batch, c[1])
        return c, c[1]

    calls = {
        "step": (call_step, [s_step]),
        "program": (call_prog, [(out[0], out[1])]),
        "hand": (lambda c: hand(c, h_batch), [h_state]),
        "hand+mean": (call_mean, [(m_state, running)]),
    }
    return calls, sync, source


def measure(kind, model, devices, rounds, max_calls, loop_s):
    """One row: per-call medians (us) and ratios of the four variants. A loop makes
    ``loop_s`` seconds of hand calls (a multiple of 8, at least 8, at most ``max_calls``)."""
    t0 = time.perf_counter()
    calls, sync, source = loops(kind, model, devices)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(_loop(*calls["hand"], 8, sync)())
    per_call = (time.perf_counter() - t0) / 8
    n = int(min(max_calls, max(8, 8 * round(loop_s / per_call / 8))))
    fns = {k: _loop(call, carry, n, sync) for k, (call, carry) in calls.items()}
    host = {k: [] for k in fns}  # the loop thread's CPU time, the final wait left out

    def on_host(name, fn):
        def run():
            t0 = time.thread_time()
            out = fn()
            host[name].append(time.thread_time() - t0)
            return out

        return run

    t = time_side_by_side({k: on_host(k, f) for k, f in fns.items()}, repeats=rounds, warmup=1)
    us = {k: 1e6 * t.median(k) / n for k in fns}
    py_calls = (python_calls(fns["step"]) - python_calls(fns["program"])) / n
    return {
        "model": model[0],
        "leaves": len(jax.tree.leaves(model[1])),
        "strategy": kind,
        "devices": len(devices),
        "calls": n,
        "rounds": rounds,
        "us": us,
        "step/hand": t.ratio("step", "hand"),
        "program/hand": t.ratio("program", "hand"),
        "step/program": t.ratio("step", "program"),
        "step/hand+mean": t.ratio("step", "hand+mean"),
        "hand+mean/hand": t.ratio("hand+mean", "hand"),
        "step-program us": statistics.median(
            1e6 * (a - b) / n for a, b in zip(t["step"], t["program"])
        ),
        "py calls step-program": py_calls,
        "host us": {k: 1e6 * statistics.median(v) / n for k, v in host.items()},
        "program_source": source,
        "setup_s": round(setup, 1),
    }, fns


def python_calls(loop) -> int:
    """Python function calls of one ``loop()`` (cProfile's count: load does not change it)."""
    pr = cProfile.Profile()
    pr.enable()
    jax.block_until_ready(loop())
    pr.disable()
    return pstats.Stats(pr).total_calls


def profile_step(fns, calls, rounds, top=20) -> str:
    """cProfile of the ``step`` loop (``rounds`` loops): the top functions by cumulative and
    by own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(rounds):
        jax.block_until_ready(fns["step"]())
    pr.disable()
    out = io.StringIO()
    for order in ("cumulative", "tottime"):
        pstats.Stats(pr, stream=out).sort_stats(order).print_stats(top)
    return f"per loop: {calls} step() calls x {rounds} loops\n" + out.getvalue()


# ---------------------------------------------------------------- report


def machine() -> dict:
    devs = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "jaxdev": os.path.dirname(jaxdev.__file__),
        "loadavg_start": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _calls(row) -> str:
    calls = row.get("py calls step-program")
    return "-" if calls is None else f"{calls:.0f}"


def _ratio(row, name) -> str:
    return "-" if row.get(name) is None else f"{row[name]:.2f}x"  # absent in older JSON files


def _host(row) -> str:
    host = row.get("host us")  # absent in JSON files of older runs
    return "-" if host is None else f"{host['step']:.0f} / {host['hand']:.0f}"


def table(rows, info) -> str:
    head = (
        (f"{info['label']}: " if info.get("label") else "")
        + f"backend {info['backend']} ({info['device_kind']}), {info['device_count']} devices, "
        f"{info['cpu_count']} CPUs, jax {info['jax']}, Python {info['python']}, "
        f"load {info['loadavg_start'][0]:.2f} -> {info.get('loadavg_end', [0])[0]:.2f}"
    )
    cols = "| model | leaves | strategy | calls | step us | program us | hand us | step/hand "
    cols += "| program/hand | step/hand+mean | hand+mean/hand | step-program us "
    cols += "| step-program Python calls | host us step/hand |"
    lines = [
        head,
        "",
        cols,
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        us = r["us"]
        lines.append(
            f"| {r['model']} | {r['leaves']} | {r['strategy']} | {r['calls']} | {us['step']:.0f} "
            f"| {us['program']:.0f} | {us['hand']:.0f} | {r['step/hand']:.2f}x "
            f"| {r['program/hand']:.2f}x | {_ratio(r, 'step/hand+mean')} "
            f"| {_ratio(r, 'hand+mean/hand')} | {r['step-program us']:+.0f} "
            f"| {_calls(r)} | {_host(r)} |"
        )
    return "\n".join(lines)


def compare(before: str, after: str) -> str:
    """A side-by-side table of two ``--json`` files (rows matched by model and strategy)."""
    runs, rows = [], []
    for path in (before, after):
        with open(path) as f:
            data = json.load(f)
        runs.append(data["runs"])
        rows.append({(r["model"], r["strategy"]): r for r in data["rows"]})
    lines = []
    for name, rs in zip(("before", "after"), runs):
        loads = ", ".join(f"{r['machine']['loadavg_start'][0]:.1f}" for r in rs)
        m = rs[0]["machine"]
        lines.append(
            f"{m.get('label') or name} ({m['backend']}, {m['device_count']} devices, "
            f"{m['cpu_count']} CPUs, jax {m['jax']}; {m['time']}; load at each run's start {loads})"
        )
    lines += ["", "| model | leaves | strategy | step/hand before | after | step-program us before"]
    lines[-1] += " | after | hand us before | after | Python calls before | after |"
    lines.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, b in rows[0].items():
        a = rows[1].get(key)
        cell = lambda r, k, f: "-" if r is None else format(r[k], f)  # noqa: E731
        hand = lambda r: "-" if r is None else f"{r['us']['hand']:.0f}"  # noqa: E731
        lines.append(
            f"| {key[0]} | {b['leaves']} | {key[1]} | {cell(b, 'step/hand', '.2f')} "
            f"| {cell(a, 'step/hand', '.2f')} | {cell(b, 'step-program us', '+.0f')} "
            f"| {cell(a, 'step-program us', '+.0f')} | {hand(b)} | {hand(a)} "
            f"| {_calls(b)} | {'-' if a is None else _calls(a)} |"
        )
    return "\n".join(lines)


def write_json(path, info, args, rows, append) -> None:
    """``{"runs": [{"machine", "args"}], "rows": [... "run": index]}``; ``append`` keeps the
    runs and rows already in ``path`` (one short run per strategy, one file)."""
    old = {"runs": [], "rows": []}
    if append and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    run = len(old["runs"])
    old["runs"].append({"machine": info, "args": args})
    old["rows"] += [r | {"run": run} for r in rows]
    with open(path, "w") as f:
        json.dump(old, f, indent=2)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", help="MLP leaf counts, comma-separated (2,100,500,1000)")
    ap.add_argument("--models", help="mlp and/or transformer (both)")
    ap.add_argument("--strategies", default="single,sharded,pmap")
    ap.add_argument("--rounds", type=int, help="timed rounds (7)")
    ap.add_argument("--calls", type=int, help="at most this many calls a loop (64)")
    ap.add_argument("--loop-s", type=float, default=0.15, help="seconds of hand calls a loop")
    ap.add_argument("--json", help="write the machine and rows here")
    ap.add_argument("--append", action="store_true", help="add to --json's runs and rows")
    ap.add_argument("--label", default="", help="what was measured (e.g. a commit), kept")
    ap.add_argument("--profile", help="write cProfile of step() at the largest MLP here")
    ap.add_argument("--quick", action="store_true", help="defaults 2,100 leaves, mlp, 3 x 16")
    ap.add_argument("--h100-mlp", action="store_true", help="only the GPU MLP, single")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print two --json")
    args = ap.parse_args(argv)
    quick = {"leaves": "2,100", "models": "mlp", "rounds": 3, "calls": 16}
    full = {"leaves": "2,100,500,1000", "models": "mlp,transformer", "rounds": 7, "calls": 64}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.h100_mlp:
        args.strategies = "single"
    return args


def cases(args):
    if args.h100_mlp:
        return [h100_mlp()]
    models = args.models.split(",")
    out = [mlp(int(n)) for n in args.leaves.split(",") if n] if "mlp" in models else []
    return out + ([transformer()] if "transformer" in models else [])


def main(argv=None) -> list[dict]:
    args = parse(argv)
    if args.compare:
        print(compare(*args.compare))
        return []
    info = machine() | {"label": args.label}
    devices = jax.devices()[:N_DEVICES]
    rows, profiles = [], []
    models = cases(args)
    biggest = max((len(jax.tree.leaves(m[1])) for m in models if m[0].startswith("mlp")), default=0)
    for kind in args.strategies.split(","):
        devs = devices[:1] if kind == "single" else devices
        if kind != "single" and len(devs) < 2:
            print(f"skipped {kind}: {len(devs)} device(s) on {info['backend']}", flush=True)
            continue
        for model in models:
            row, fns = measure(kind, model, devs, args.rounds, args.calls, args.loop_s)
            rows.append(row)
            print(table([row], info).splitlines()[-1], f"(setup {row['setup_s']} s)", flush=True)
            if args.profile and row["leaves"] == biggest and model[0].startswith("mlp"):
                profiles.append(f"== {kind}, {row['model']} ({row['leaves']} leaves)\n")
                profiles[-1] += profile_step(fns, row["calls"], args.rounds)
    info["loadavg_end"] = os.getloadavg()
    print()
    print(table(rows, info))
    if args.json:
        write_json(args.json, info, vars(args), rows, args.append)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write("\n".join(profiles))
    return rows


if __name__ == "__main__":
    main()
