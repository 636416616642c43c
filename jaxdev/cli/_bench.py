"""``jaxdev bench``: the d2l "GPUs" exercises and placement figures, side by side.

Every figure is a ratio of two variants timed in the same run (:func:`sample_side_by_side`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev

from .._errors import JaxdevError, device_name
from .._report import figure


class Result(NamedTuple):
    """One benchmark: median seconds per variant and the ratios between them."""

    key: str  # e.g. 'ex3_log'
    title: str  # what was measured
    times: dict[str, float]  # {variant: median seconds}, in table order
    ratios: dict[str, float]  # {label: value}, e.g. {'host log / device log': 3.1}
    note: str = ""  # how to read the figure (or why it was skipped)


class BenchConfig(NamedTuple):
    """Sizes and repetitions; ``quick()`` is the fast variant used by tests."""

    big: int = 2048
    small: int = 64
    log_steps: int = 1000
    pair: int = 1024
    reps: int = 15
    inner: int = 200

    @classmethod
    def quick(cls) -> BenchConfig:
        """A run of a few seconds: smaller matrices, fewer repetitions."""
        return cls(big=512, small=32, log_steps=1000, pair=256, reps=5, inner=50)


# ---------------------------------------------------------------- timing


def _wall_seconds(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes, its output waited for with ``jax.block_until_ready``."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def sample_side_by_side(
    variants: dict[str, Callable[[], Any]],
    reps: int,
    *,
    warmup: int = 1,
    self_timed: bool = False,
    after: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds of every repetition of every variant, measured interleaved: the one timer.

    ``warmup`` untimed calls each, then ``reps`` rounds with the order rotating each round.
    ``self_timed`` callables return their own seconds; others are timed here up to
    ``jax.block_until_ready``. ``after`` runs untimed after every call.

    Example:
      >>> s = sample_side_by_side({"a": lambda: 1, "b": lambda: 2}, reps=3)
      >>> sorted(s), len(s["a"])
      (['a', 'b'], 3)
    """
    measure = (lambda fn: fn()) if self_timed else _wall_seconds
    names = list(variants)
    after = after or (lambda: None)
    for name in names:
        for _ in range(warmup):
            measure(variants[name])
            after()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(measure(variants[name]))
            after()
    return samples


def _compared(
    key: str,
    title: str,
    variants: dict[str, Callable[[], Any]],
    reps: int,
    ratios: dict[str, tuple[str, str]],
    note: str,
    *,
    calls: int = 1,
    self_timed: bool = False,
) -> Result:
    """The median seconds of ``variants`` timed side by side, and ``ratios`` of them.

    ``ratios``: label -> (numerator, denominator) variant. ``calls`` > 1 times that many
    calls per sample (microsecond-scale calls) and reports the seconds of one.
    """
    if calls > 1:
        variants = {k: lambda fn=fn: [fn() for _ in range(calls)] for k, fn in variants.items()}
    samples = sample_side_by_side(variants, reps, self_timed=self_timed)
    times = {k: float(np.median(v)) / calls for k, v in samples.items()}
    return Result(key, title, times, {k: times[a] / times[b] for k, (a, b) in ratios.items()}, note)


# ---------------------------------------------------------------- exercise 1


_MATMUL = jax.jit(jnp.matmul)


def _operands(size: int, where: Any) -> tuple[jax.Array, jax.Array]:
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32)
    b = jax.random.normal(key_b, (size, size), jnp.float32)
    return jaxdev.to_device((a, b), where)


def matmul_cpu_vs_accelerator(size: int, reps: int) -> Result:
    """Exercise 1 with an accelerator: the same matmul on ``cpu:0`` and on GPU/TPU 0."""
    accel = jax.local_devices()[0]
    on_cpu = _operands(size, jaxdev.d2l.cpu())
    on_accel = _operands(size, accel)
    name = device_name(accel)
    return _compared(
        f"ex1_matmul_{size}",
        f"d2l ex. 1: matmul {size}x{size}, CPU vs {accel.platform}",
        {"cpu:0": lambda: _MATMUL(*on_cpu), name: lambda: _MATMUL(*on_accel)},
        reps,
        {f"cpu / {accel.platform}": ("cpu:0", name)},
        "above 1: the accelerator is faster; small matrices mostly measure dispatch",
    )


_WORKER = """
import os, sys, time
if sys.argv[1] == "1":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import jax, jax.numpy as jnp
mm = jax.jit(lambda a, b: a @ b)
cache = {}
for line in sys.stdin:
    size = int(line)
    if size not in cache:
        a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
        cache[size] = (a, a + 1.0)
        mm(*cache[size]).block_until_ready()
    t0 = time.perf_counter()
    mm(*cache[size]).block_until_ready()
    print(time.perf_counter() - t0, flush=True)
"""


def _worker(one_core: bool) -> subprocess.Popen:
    """A child Python process timing matmuls on request (one size in, its seconds out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, "1" if one_core else "all"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )


def _ask(worker: subprocess.Popen, size: int) -> float:
    worker.stdin.write(f"{size}\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise JaxdevError(f"the benchmark worker exited (code {worker.poll()}).")
    return float(line)


def matmul_one_core_vs_all(sizes: Sequence[int], reps: int) -> list[Result]:
    """Exercise 1 on a CPU-only host: one core vs every core, in two worker processes."""
    if not hasattr(os, "sched_setaffinity"):  # Linux only, as sched_getaffinity
        why = "skipped: no accelerator, and pinning a worker to one core needs "
        why += "os.sched_setaffinity (Linux)"
        title = "d2l ex. 1: matmul {0}x{0}, no accelerator"
        return [Result(f"ex1_matmul_{s}", title.format(s), {}, {}, why) for s in sizes]
    cores = len(os.sched_getaffinity(0))
    every = f"all {cores} cores"
    with _worker(True) as one, _worker(False) as all_cores:  # exit: stdin closed, waited for
        workers = {"1 core": one, every: all_cores}
        return [
            _compared(
                f"ex1_matmul_{size}",
                f"d2l ex. 1: matmul {size}x{size}, no accelerator: CPU 1 core vs {cores} cores",
                {k: functools.partial(_ask, w, size) for k, w in workers.items()},
                reps,
                {f"1 core / {cores} cores": ("1 core", every)},
                f"no accelerator here; {cores} cores can give about {cores}x on a large "
                "matrix (cache effects add noise); small matrices barely use the extra cores",
                self_timed=True,
            )
            for size in sizes
        ]


# ---------------------------------------------------------------- exercise 3


def _norm_step(x: jax.Array, w: jax.Array, log: Any = None) -> tuple[jax.Array, Any]:
    """``x @ w`` normalised, and its norm: returned, or recorded into ``log`` (a DeviceLog)."""
    y = x @ w
    norm = jnp.linalg.norm(y)
    return y / norm, (norm if log is None else log.record(norm))


def log_on_host_vs_device(steps: int, reps: int, size: int = 100) -> Result:
    """Exercise 3: ``steps`` matmuls, the Frobenius norm logged each step."""
    dev = jax.local_devices()[0]
    x0, w = _operands(size, dev)
    step = jax.jit(_norm_step)

    @jax.jit
    def scan_log(x, w, log):  # a fori_loop of a static length is a lax.scan
        return jax.lax.fori_loop(0, steps, lambda _, c: _norm_step(c[0], w, c[1]), (x, log))

    def host_log():
        x, norms = x0, []
        for _ in range(steps):
            x, norm = step(x, w)
            norms.append(float(norm))
        return np.asarray(norms)

    def device_log():
        x, log = x0, jaxdev.to_device(jaxdev.metrics.DeviceLog.create(steps), dev)
        for _ in range(steps):
            x, log = step(x, w, log)
        return log.fetch()

    def device_scan():
        _, log = scan_log(x0, w, jaxdev.to_device(jaxdev.metrics.DeviceLog.create(steps), dev))
        return log.fetch()

    np.testing.assert_allclose(host_log(), device_log(), rtol=1e-4)
    host, dlog, scan = "float() per step", "DeviceLog, 1 fetch", "DeviceLog in lax.scan"
    return _compared(
        "ex3_log",
        f"d2l ex. 3: {steps} matmuls {size}x{size} on {dev.platform}, norm logged every step",
        {host: host_log, dlog: device_log, scan: device_scan},
        reps,
        {"host log / DeviceLog": (host, dlog), "host log / DeviceLog+scan": (host, scan)},
        "above 1: keeping the log on device is faster (one transfer instead of "
        f"{steps} syncs); the logged values are checked equal",
    )


# ---------------------------------------------------------------- exercise 4


def two_devices_at_once(size: int, reps: int) -> Result:
    """Exercise 4: two matmuls on two devices at once vs in sequence on one."""
    devs = jax.local_devices()
    if len(devs) < 2:
        why = f"skipped: needs 2 devices, this process has 1 ({devs[0].platform})"
        return Result("ex4_two_devices", f"d2l ex. 4: two matmuls {size}x{size}", {}, {}, why)
    a0, b0 = _operands(size, devs[0])
    a1, b1 = _operands(size, devs[1])
    c0, d0 = jaxdev.copy_to((a1, b1), devs[0])
    platform = devs[0].platform
    shared = (
        f"; these are fake CPU devices sharing the host's {os.cpu_count()} cores, so "
        "expect about 1x"
        if platform == "cpu"
        else ""
    )
    at_once, seq = "2 devices at once", "1 device, in sequence"
    return _compared(
        "ex4_two_devices",
        f"d2l ex. 4: two matmuls {size}x{size} on {platform}:0 and {platform}:1 vs on {platform}:0",
        {
            at_once: lambda: (_MATMUL(a0, b0), _MATMUL(a1, b1)),
            seq: lambda: (_MATMUL(a0, b0), _MATMUL(c0, d0)),
        },
        reps,
        {"sequence / at once": (seq, at_once)},
        f"ideal 2x (linear scaling){shared}",
    )


# ---------------------------------------------------------------- placement


def placement_figures(reps: int, inner: int) -> list[Result]:
    """No-op ``to_device``, ``replicate`` and ``shard_batch`` vs raw ``jax.device_put``."""
    dev = jax.local_devices()[0]
    rng = np.random.default_rng(0)
    host = {  # a Flax-like params dict: 25 dense layers, 50 leaves
        f"Dense_{i}": {
            "kernel": rng.normal(size=(64, 64)).astype(np.float32),
            "bias": np.zeros(64, np.float32),
        }
        for i in range(25)
    }
    placed = jax.device_put(host, dev)
    mesh = jaxdev.data_mesh()
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rows = 128 * mesh.size
    batch = {
        "x": np.random.default_rng(1).normal(size=(rows, 64)).astype(np.float32),
        "y": np.arange(rows, dtype=np.int32),
    }
    n_leaves = len(jax.tree.leaves(host))
    no_overhead = "1 = no overhead over the raw call (target <= 1.10)"
    return [
        _compared(
            "place_noop",
            f"placement: move a {n_leaves}-leaf params tree already on {device_name(dev)}",
            {
                "jax.device_put": lambda: jax.device_put(placed, dev),
                "jaxdev.to_device": lambda: jaxdev.to_device(placed, dev),
            },
            reps,
            {"device_put / to_device": ("jax.device_put", "jaxdev.to_device")},
            "above 1: to_device returns placed leaves as they are (target >= 20x)",
            calls=inner,
        ),
        _compared(
            "place_replicate",
            f"placement: replicate a {n_leaves}-leaf params tree on {mesh.size} devices",
            {
                "jax.device_put(P())": lambda: jax.device_put(host, rep),
                "jaxdev.replicate": lambda: jaxdev.replicate(host, mesh),
            },
            reps,
            {"replicate / device_put": ("jaxdev.replicate", "jax.device_put(P())")},
            no_overhead,
        ),
        _compared(
            "place_shard",
            f"placement: split a batch of {rows} rows over {mesh.size} devices",
            {
                "jax.device_put(P('data'))": lambda: jax.device_put(batch, split),
                "jaxdev.shard_batch": lambda: jaxdev.shard_batch(batch, mesh),
            },
            reps,
            {"shard_batch / device_put": ("jaxdev.shard_batch", "jax.device_put(P('data'))")},
            no_overhead,
        ),
    ]


def metered_loop(steps: int, reps: int) -> Result:
    """A train loop reading ``float(loss)`` each step, with and without a step meter: the
    meter's cost, and its answer (the shares, the sync's line) in the note."""
    tx, loss = optax.sgd(0.01), lambda p, b: jnp.tanh(b["x"] @ p["w"]).mean(axis=1)
    step = jaxdev.make_train_step(loss, tx, jaxdev.Strategy.single())
    box = [step.init_state({"w": jnp.full((256, 256), 0.01)}, tx)]
    batch, meters = step.put_batch({"x": np.ones((256, 256), np.float32)}), []

    def loop():
        for _ in range(steps):
            box[0], metrics = step(box[0], batch)
            float(metrics.compute()["loss"])

    def metered():
        with jaxdev.meter.StepMeter() as meter:
            loop()
        meters.append(meter)

    plain, on = "loop", "loop in a StepMeter"
    r = _compared("meter", f"step meter: {steps} train steps, float(loss) read each step",
                  {plain: loop, on: metered}, reps, {"metered / plain": (on, plain)}, "")
    got = meters[-1].report()
    share = {k: f"{v / got.wall:.0%}" for k, v in got.seconds.items()}
    site = max(got.syncs, key=lambda s: s[1])[0] if got.syncs else "-"
    return r._replace(note=(
        f"1 = free (goal <= 1.02). Its answer: device busy {share['step']}, idle in host "
        f"syncs {share['sync']}, other {share['other']}; the sync: {site}"))


# ---------------------------------------------------------------- the run


def run_bench(config: BenchConfig, ui: Any) -> list[Result]:
    """Run every benchmark with a progress bar; return the results in table order."""
    sizes, reps = (config.big, config.small), config.reps
    if jax.default_backend() != "cpu":
        ex1 = [
            (f"ex. 1 matmul {s}", lambda s=s: [matmul_cpu_vs_accelerator(s, reps)]) for s in sizes
        ]
    else:
        ex1 = [("ex. 1 matmul, 1 vs all cores", lambda: matmul_one_core_vs_all(sizes, reps))]
    todo = [
        *ex1,
        ("ex. 3 logging", lambda: [log_on_host_vs_device(config.log_steps, reps)]),
        ("ex. 4 two devices", lambda: [two_devices_at_once(config.pair, reps)]),
        ("placement", lambda: placement_figures(reps, config.inner)),
        ("step meter", lambda: [metered_loop(config.inner, reps)]),
    ]
    results: list[Result] = []
    with ui.progress(len(todo)) as advance:
        for label, thunk in todo:
            advance(0, label)
            results.extend(thunk())
            advance(1, label)
    return results


def host_summary() -> dict[str, Any]:
    """Plain data about where the benchmarks ran."""
    devs = jax.local_devices()
    return {
        "jaxdev": jaxdev.__version__,
        "jax": jax.__version__,
        "platform": jax.default_backend(),
        "devices": len(devs),
        "device_kind": devs[0].device_kind,
        "cpu_cores": os.cpu_count(),
    }


def write_json(path: str, results: Sequence[Result], quick: bool) -> None:
    """Write the results, where they ran and ``quick`` to ``path`` as JSON."""
    rows = [dict(zip(("key", "title", "median_seconds", "ratios", "note"), r)) for r in results]
    with open(path, "w") as f:
        json.dump({"host": host_summary(), "quick": quick, "results": rows}, f, indent=2)
        f.write("\n")


def write_plot(path: str, results: Sequence[Result]) -> None:
    """Draw every ratio as a horizontal bar (log scale, 1x marked) into ``path``."""
    ratios = {f"{r.key}: {label}": v for r in results for label, v in r.ratios.items()}
    host = host_summary()
    fig, path = figure(path, figsize=(9, 0.5 * len(ratios) + 1.5))  # no pyplot: nothing global
    ax = fig.subplots()
    bars = ax.barh(list(ratios), list(ratios.values()), color="tab:blue")
    ax.bar_label(bars, fmt=" {:.2f}x")
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("ratio (log scale; the label says which time is divided by which)")
    ax.set_title(
        f"jaxdev bench on {host['platform']} ({host['devices']} devices, "
        f"{host['cpu_cores']} CPU cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
