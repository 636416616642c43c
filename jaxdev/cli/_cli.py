"""The ``jaxdev`` command: ``info``, ``demo``, ``bench``, ``memory``, ``launch``.

Exit codes and the fake-device rule (:func:`configure_devices`): README's "Command line".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pkgutil
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from rich.console import Console
from rich.table import Table

import jaxdev
from jaxdev import UsageError

from .._devices import backend_started
from .._report import check_suffix, human_bytes
from ..distributed import UsageParser

DEFAULT_FAKE_DEVICES = 8
_ACCEL_PLATFORMS = ("cuda", "gpu", "rocm", "tpu")
_PLUGINS = "jax_cuda12_plugin jax_cuda13_plugin jax_rocm60_plugin jax_rocm7_plugin libtpu".split()


# ---------------------------------------------------------------- devices


def _requested_platforms() -> list[str]:
    """Platforms asked for by ``JAX_PLATFORMS`` / ``jax_platforms`` (``[]``: not set)."""
    raw = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    return [p.strip().lower() for p in raw.split(",") if p.strip()]


def installed_plugins() -> list[str]:
    """Return the JAX accelerator plugins importable here, without importing them."""
    found = [name for name in _PLUGINS if importlib.util.find_spec(name) is not None]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        found += [
            f"jax_plugins.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)
        ]
    return found


def accelerator_expected() -> tuple[bool, str]:
    """Return whether JAX is expected to start an accelerator, and why (no backend start)."""
    platforms = _requested_platforms()
    if platforms:
        return any(p in _ACCEL_PLATFORMS for p in platforms), f"JAX_PLATFORMS={','.join(platforms)}"
    plugins = installed_plugins()
    if plugins:
        return True, f"accelerator plugin installed: {', '.join(plugins)}"
    return False, "no JAX_PLATFORMS and no accelerator plugin installed"


def requested_cpu_count() -> int | None:
    """Return the CPU device count the environment asks for, if any."""
    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if match:
        return int(match.group(1))
    env = os.environ.get("JAX_NUM_CPU_DEVICES")
    return int(env) if env and env.isdigit() else None


def configure_devices(devices: int | None) -> tuple[str, bool]:
    """Apply the fake-device rule (``--devices``) before JAX starts; ``(note, accel expected)``."""
    if backend_started():
        return "JAX already started in this process: using the devices it has", False
    accel, why = accelerator_expected()
    platforms = _requested_platforms()
    count = devices or requested_cpu_count() or DEFAULT_FAKE_DEVICES
    if not platforms or "cpu" in platforms:
        jaxdev.testing.use_fake_cpu_devices(count)
    if accel:
        return f"accelerator expected ({why}); CPU fallback set to {count} device(s)", True
    return f"no accelerator ({why}): {count} fake CPU devices (`--devices N` to change)", False


def started_ui(devices: int | None, quiet: bool = False) -> Ui:
    """Apply the fake-device rule, start JAX; a :class:`Ui` that said both."""
    note, expected_accel = configure_devices(devices)
    ui = Ui(quiet=quiet)
    ui.print(note)
    note = f"JAX started {len(jax.local_devices())} {jax.default_backend()} device(s)"
    if expected_accel and jax.default_backend() == "cpu":
        note += " -- an accelerator was expected but JAX fell back to CPU (see `jaxdev info`)"
    ui.print(note)
    return ui


# ---------------------------------------------------------------- output


class Ui(Console):
    """Human output: stdout as rich prints it (nothing when quiet), a progress bar on stderr."""

    def __init__(self, quiet: bool = False):
        wide = None if sys.stdout.isatty() else 160  # rich assumes 80 columns in a pipe
        super().__init__(highlight=False, markup=False, soft_wrap=True, width=wide, quiet=quiet)

    @contextlib.contextmanager
    def progress(self, total: int) -> Iterator[Callable[[int, str], None]]:
        """Show a transient bar of ``total`` units; yield its ``advance(n, description)``."""
        from rich import progress as rp

        columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn())
        columns += (rp.TimeElapsedColumn(),)
        err = Console(stderr=True)
        with rp.Progress(*columns, console=err, transient=True, disable=self.quiet) as p:
            task = p.add_task("starting", total=total)
            yield lambda n, description: p.update(task, advance=n, description=description)


# ---------------------------------------------------------------- commands


def _memory(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "n/a on CPU"
    used, limit = stats.get("bytes_in_use"), stats.get("bytes_limit")
    if used is None or limit is None:
        return ", ".join(f"{k}={v}" for k, v in list(stats.items())[:3])
    return f"{used / 2**30:.2f} / {limit / 2**30:.2f} GiB in use"


def cmd_info(args: argparse.Namespace) -> int:
    """``jaxdev info [--json]``: ``jaxdev.describe()`` plus the accelerator detection."""
    accel, why = accelerator_expected()
    data = jaxdev.describe()
    data["accelerator_expected"] = {"expected": accel, "why": why}
    data["plugins"] = installed_plugins()
    if accel and data["platforms"] == ["cpu"] and not data["warnings"]:
        data["warnings"].append(
            f"An accelerator was expected ({why}) but JAX started only the CPU: check the "
            "driver (nvidia-smi) and that the plugin matches your jax version."
        )
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    ui = Ui()
    head = Table(title="jaxdev info", show_header=False)
    head.add_row("jax", data["jax_version"])
    head.add_row("default backend", data["default_backend"])
    head.add_row("platforms started", ", ".join(data["platforms"]))
    head.add_row("processes", f"index {data['process_index']} of {data['process_count']}")
    head.add_row("devices", f"{data['local_device_count']} local / {data['device_count']} global")
    for key, value in data["requested"].items():
        head.add_row(f"requested {key}", "(not set)" if value in (None, "") else str(value))
    head.add_row("accelerator expected", f"{accel} ({why})")
    ui.print(head)
    table = Table("id", "platform", "kind", "process", "memory", title="devices")
    for d in data["devices"]:
        table.add_row(
            str(d["id"]), d["platform"], d["kind"], str(d["process_index"]), _memory(d["memory"])
        )
    ui.print(table)
    for warning in data["warnings"]:
        ui.print(f"warning: {warning}", style="bold yellow")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    """``jaxdev memory [--plot PATH.png]``: the live memory ledger of a demo training loop;
    with ``--model``: the plan, fit and options of a model's step (:func:`plan_memory`)."""
    _check_memory_flags(args)
    if args.model is not None:
        return plan_memory(args)
    _check_outputs(args)
    note, _ = configure_devices(args.devices)
    from ._demo import DemoConfig, memory_demo

    ledger = memory_demo(DemoConfig(strategy=args.strategy or "sharded", devices=args.devices))
    print(note)
    print(ledger)
    if args.plot:
        print(f"wrote {ledger.plot(args.plot)}")
    return 0


_PLAN_FLAGS = ("target", "topology", "mesh", "rules", "rows", "limit", "fit", "options", "remat")


def _check_memory_flags(args: argparse.Namespace) -> None:
    """Refuse the flags of the other ``jaxdev memory`` (were ignored: the ledger ran, exit 0)."""
    if args.model is None:
        if given := [f for f in _PLAN_FLAGS if getattr(args, f) not in (None, False)]:
            raise UsageError(
                f"`--{given[0]}` plans a model's step: it needs `--model FILE.py:FUNCTION` "
                "(see examples/llama_plan.py); without `--model`, `jaxdev memory` shows the "
                "demo's live memory ledger, which takes only --devices, --strategy and --plot."
            )
    elif given := [f for f in ("strategy", "plot") if getattr(args, f) is not None]:
        raise UsageError(
            f"`--{given[0]}` is for the demo's live memory ledger (`jaxdev memory` without "
            "`--model`); a `--model` plan runs sharded jit on `--mesh` and prints its figures."
        )


def _entry(text: str) -> Callable[..., dict]:
    """``FILE.py:FUNCTION`` or ``module:function``, loaded."""
    where, _, name = text.rpartition(":")
    try:
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location("_jaxdev_model", where)
            module = sys.modules["_jaxdev_model"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, name)
    except (ImportError, OSError, AttributeError, ValueError) as err:
        raise UsageError(
            f"`--model {text}`: expected FILE.py:FUNCTION or module:function returning "
            f"{{'model', 'loss', 'batch', 'tx'}} (see examples/llama_plan.py): {err}"
        ) from None


def _model_step(entry: Callable[..., dict], strategy: Any, rows: int, **kw: Any):
    """``(step, abstract state, batch shapes of `rows` per device)`` of an entry point."""
    from flax import nnx

    got = entry(**kw)
    if not isinstance(got, dict) or not {"model", "loss", "batch", "tx"} <= got.keys():
        raise UsageError(
            f"`--model`: {getattr(entry, '__name__', entry)}() must return a dict with 'model', "
            f"'loss', 'batch', 'tx' (see examples/llama_plan.py), got {type(got).__name__} "
            f"{sorted(got) if isinstance(got, dict) else ''}".rstrip()
        )
    model = nnx.eval_shape(got["model"])
    loss = jaxdev.nnx.loss(model, got["loss"])
    step = jaxdev.make_train_step(loss, got["tx"], strategy, has_state=True)
    state = step.abstract_state(model)
    n = rows * strategy.n_devices
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype), got["batch"])
    return step, state, batch


def _plan_mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    """``--mesh`` (default ``data=-1``) on ``--topology`` devices of ``--target`` (default 8)."""
    axes = dict(args.mesh or {"data": -1})
    if args.target is None:
        if isinstance(args.topology, str):  # hosts x devices: a target's, not this host's
            raise UsageError(
                f"`--topology {args.topology}` (hosts x devices per host) needs `--target`; "
                "on this host's devices give a device count (`--topology 8`)."
            )
        return jaxdev.make_mesh(axes, args.topology)
    topo = args.topology or (8 if -1 in axes.values() else None)
    if topo is not None:
        n, fixed = math.prod(map(int, str(topo).split("x"))), abs(math.prod(axes.values()))
        if n % fixed or (-1 not in axes.values() and fixed != n):
            mesh = ",".join(f"{k}={v}" for k, v in axes.items())
            raise UsageError(
                f"`--topology {topo}` gives {n} target devices but `--mesh {mesh}` needs "
                f"{fixed}{' x k' if -1 in axes.values() else ''}: make them agree, e.g. "
                f"`--topology {fixed}`."
            )
        axes = {k: n // fixed if v == -1 else v for k, v in axes.items()}
    return jaxdev.make_mesh(axes, topo, target=args.target)  # a bad text: _target's UsageError


def plan_memory(args: argparse.Namespace) -> int:
    """``jaxdev memory --model ENTRY [--target h100 --topology 8] [--mesh AXES] [--fit]
    [--options ...] [--remat POLICY] [--limit GiB]``: what the step needs per device, compiled
    for the target (XLA:GPU, no GPU needed) or for this host's (fake) devices; nothing is
    allocated. ``--limit`` alone: whether it fits, exit 1 when it does not."""
    import logging

    if args.target is not None and not backend_started() and not _requested_platforms():
        jax.config.update("jax_platforms", "cpu")  # a target needs the plugin, not a GPU
    print(configure_devices(args.devices)[0])
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jaxdev").setLevel(logging.INFO)
    entry, start = _entry(args.model), time.perf_counter()
    if set(args.options or ()) - set(jaxdev.memory.OPTIONS):
        raise UsageError(f"`--options {','.join(args.options)}`: expected some of "
                         f"{','.join(jaxdev.memory.OPTIONS)}.")
    policy = getattr(jax.checkpoint_policies, args.remat or "", None)
    if args.remat and policy is None:
        raise UsageError(f"`--remat {args.remat}` is not in jax.checkpoint_policies.")
    strategy = jaxdev.Strategy.sharded(_plan_mesh(args), rules=args.rules or "fsdp")
    rows = args.rows or 1
    step, state, batch = _model_step(entry, strategy, rows)
    limit = None if args.limit is None else int(args.limit * 2**30)
    plan = jaxdev.memory.plan(state, step=step, batch=batch)
    print(plan)
    print(f"planned in {time.perf_counter() - start:.1f} s")
    if args.options or args.remat:
        remat = _model_step(entry, strategy, rows, remat=policy)[0] if args.remat else True
        options = tuple(args.options or ())
        options += ("remat",) if args.remat and "remat" not in options else ()  # never dropped
        why = jaxdev.memory.explain_memory(
            step, state, batch, limit, options=options, remat=remat, plan_=plan
        )
        print(why.headline(), *why.details().splitlines()[-len(why.options) - 3 :], sep="\n")
    if args.fit:
        print(jaxdev.memory.fit_memory(step, state, batch, limit=limit))
    if limit is None or args.fit or args.options or args.remat:  # those print their verdict
        return 0
    over = f", {human_bytes(plan.peak - limit)} over: exit 1" if plan.peak > limit else ""
    print(f"{'does not fit' if over else 'fits'}: the step needs {human_bytes(plan.peak)} per "
          f"device, {human_bytes(limit)} available (--limit){over}")
    return 1 if over else 0


def cmd_demo(args: argparse.Namespace) -> int:
    """``jaxdev demo``: train on digits; exit 1 if ``--min-accuracy`` is missed."""
    ui = started_ui(vars(args).get("devices"), args.quiet)
    from ._demo import DemoConfig, params_fingerprint, run_demo

    fields = {f.name for f in dataclasses.fields(DemoConfig)}  # every flag has a field's name
    config = DemoConfig(**{k: v for k, v in vars(args).items() if k in fields})
    start = time.perf_counter()
    strategy, state, history = run_demo(config, ui)
    n, accuracy = strategy.n_devices, history[-1].test_accuracy
    print(
        f"test accuracy: {accuracy:.4f} ({n} {strategy.devices[0].platform} "
        f"device{'s' if n > 1 else ''}, {config.strategy}, {int(state.step)} steps, "
        f"{time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    if config.checkpoint_dir is not None:  # resumed or not, the same run gives the same bits
        print(f"params fingerprint: {params_fingerprint(state.params)}", flush=True)
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        print(
            f"jaxdev demo: test accuracy {accuracy:.4f} is below "
            f"--min-accuracy {args.min_accuracy}",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Before the run, not after it: the folders of ``--json``/``--plot``, matplotlib."""
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if path is not None and not path.strip():  # was: nothing written, exit 0
            raise UsageError(f"`--{flag}` needs a file path, got {path!r}.")
        folder = os.path.dirname(os.path.abspath(path or "."))
        if path is not None and not os.path.isdir(folder):
            raise UsageError(f"`--{flag} {path}`: the folder {folder} does not exist.")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("`--plot` needs matplotlib: pip install 'jaxdev[plot]'")
    if args.plot:  # a suffix matplotlib cannot write, before the run
        check_suffix(args.plot, "--plot")


def cmd_bench(args: argparse.Namespace) -> int:
    """``jaxdev bench [--quick] [--json PATH] [--plot PATH.png]``."""
    _check_outputs(args)
    from ._bench import BenchConfig, run_bench, write_json, write_plot

    ui = started_ui(args.devices)
    config = BenchConfig.quick() if args.quick else BenchConfig()
    results = run_bench(config, ui)
    table = Table(title="jaxdev bench (medians, interleaved repetitions)", show_lines=True)
    for col in ("benchmark", "median time per variant", "ratio", "note"):
        table.add_column(col, overflow="fold")
    for r in results:
        times = "\n".join(f"{k}: {_seconds(v)}" for k, v in r.times.items()) or "-"
        ratios = "\n".join(f"{k} = {v:.2f}x" for k, v in r.ratios.items()) or "-"
        table.add_row(r.title, times, ratios, r.note)
    ui.print(table)
    if args.json:
        write_json(args.json, results, args.quick)
        ui.print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, results)
        ui.print(f"wrote {args.plot}")
    return 0


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


# ---------------------------------------------------------------- parser


def _number(cast: type, low: float, high: float, what: str):
    """An argparse type: ``cast(text)`` within ``[low, high]``, else ``expected {what}``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high or value in (math.inf, -math.inf):  # nan fails low <= value
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive = _number(int, 1, float("inf"), "a positive int")
_fraction = _number(float, 0.0, 1.0, "a number in [0, 1]")
_rate = _number(float, 0.0, math.inf, "a finite number >= 0")  # nan, inf: trained to noise, exit 0
_seed = _number(int, 0, 2**32 - 1, "an int in [0, 2**32 - 1]")  # numpy's and sklearn's range


def _mesh_axes(text: str) -> tuple[tuple[str, int], ...]:
    """``'data=2,fsdp=4'`` -> ``(('data', 2), ('fsdp', 4))``; one size may be -1."""
    axes = [(n.strip(), int(s) if n.strip() and re.fullmatch(r"\s*(-1|\+?\d+)\s*", s) else 0)
            for n, _, s in (part.partition("=") for part in text.split(","))]
    names, sizes = [n for n, _ in axes], [v for _, v in axes]
    if sizes.count(-1) > 1 or 0 in sizes or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(
            "expected axes such as data=2,fsdp=4 (distinct names, sizes >= 1, one may be -1), "
            f"got {text!r}"
        )
    return tuple(axes)


def _topology(text: str) -> int | str:
    """``'8'`` -> 8, ``'2x8'`` (hosts x devices per host) as is."""
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)?", text):
        raise argparse.ArgumentTypeError(
            f"expected a device count (8) or hosts x devices per host (2x8), got {text!r}"
        )
    return int(text) if text.isdigit() else text


_gib = _number(float, 2**-30, float("inf"), "a positive number of GiB")


def build_parser() -> argparse.ArgumentParser:
    """Return the ``jaxdev`` argument parser."""
    p = UsageParser(prog="jaxdev", description="Devices, data parallel training and benchmarks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    info = sub.add_parser("info", help="what devices JAX started here (like nvidia-smi)")
    info.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_demo(sub)
    bench = sub.add_parser("bench", help="the d2l GPU exercises as side-by-side benchmarks")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH.png", help="draw the ratios (needs matplotlib)")
    bench.add_argument("--devices", type=_positive, help="fake CPU devices when no accelerator")
    mem = sub.add_parser(
        "memory", help="what uses device memory, by pytree path, in a demo training loop"
    )
    mem.add_argument("--devices", type=_positive, help="fake CPU devices when no accelerator")
    mem.add_argument("--strategy", choices=["single", "pmap", "sharded"],
                     help="the demo's strategy (default sharded)")
    mem.add_argument("--plot", metavar="PATH.png", help="also draw the ledger (needs matplotlib)")
    plan = mem.add_argument_group("planning a model's step (nothing is allocated)")
    plan.add_argument("--model", metavar="ENTRY", help="FILE.py:FUNCTION or module:function "
                      "(examples/llama_plan.py): plan its train step instead of the demo")
    plan.add_argument("--target", help="compile for GPUs that need not be here: h100, h200, "
                      "a100-80gb or a GpuTargetConfig path (needs the CUDA plugin)")
    plan.add_argument("--topology", type=_topology,
                      help="target devices: 8, or hosts x devices: 2x8")
    plan.add_argument("--mesh", type=_mesh_axes, metavar="AXES", help="e.g. data=2,fsdp=4")
    plan.add_argument("--rules", choices=["fsdp", "replicate"], help="(default fsdp)")
    plan.add_argument("--rows", type=_positive, help="rows per device (default 1)")
    plan.add_argument("--limit", type=_gib, metavar="GiB", help="per device (default: the "
                      "target's or the devices' own)")
    plan.add_argument("--fit", action="store_true", help="the largest batch that fits")
    plan.add_argument("--options", type=lambda t: t.split(","), metavar="A,B",
                      help=f"changes to compile, some of {','.join(jaxdev.memory.OPTIONS)}")
    plan.add_argument("--remat", metavar="POLICY", help="per-block remat option: a "
                      "jax.checkpoint_policies name the model's blocks take (nothing_saveable)")
    sub.add_parser(
        "launch",
        help="run a command as N local JAX processes: launch -n N -- cmd ...",
        add_help=False,
    )
    return p


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a Flax MLP on digits over every local device",
        description="Train a Flax MLP on scikit-learn's digits, data parallel over every "
        "local device (8 fake CPU devices when there is no accelerator).",
        argument_default=argparse.SUPPRESS,  # only the flags given: the defaults are DemoConfig's
    )
    demo.add_argument("--devices", type=_positive, help="number of devices (default: all)")
    demo.add_argument("--strategy", choices=["single", "pmap", "sharded"])
    demo.add_argument("--epochs", type=_positive)
    demo.add_argument("--batch-size", type=_positive,
                      help="global batch, rounded up to a multiple of the device count")
    demo.add_argument("--lr", dest="learning_rate", type=_rate,
                      help="Adam's initial learning rate (cosine decay)")
    demo.add_argument("--hidden", type=_positive, help="hidden layer width")
    demo.add_argument("--steps-per-call", type=_positive, metavar="K",
                      help="full batches per dispatch (lax.scan); when K does not divide an "
                      "epoch's full batches, the rest and the uneven last batch run one step at "
                      "a time (nothing dropped)")
    demo.add_argument("--seed", type=_seed)
    demo.add_argument("--params", choices=["replicate", "fsdp", "flax"],
                      help="how the sharded step places the params and optimizer state (default: "
                      "fsdp when --mesh has an fsdp axis, else replicate); prints the bytes per "
                      "device")
    demo.add_argument("--mesh", type=_mesh_axes, metavar="AXES",
                      help="the device mesh of the sharded step, e.g. data=2,fsdp=4 (the batch "
                      "splits over every axis but model/tensor)")
    demo.add_argument("--checkpoint-dir", metavar="DIR",
                      help="save checkpoints in DIR and resume from the latest one there (run "
                      "again with the same flags after a crash: the final parameters are "
                      "bit-identical)")
    demo.add_argument("--checkpoint-every", type=_positive, metavar="N",
                      help="save every N steps (default: at each epoch's end) and at the end")
    demo.add_argument("--min-accuracy", type=_fraction, default=None,
                      help="exit 1 when the final test accuracy is lower")
    demo.add_argument("--quiet", action="store_true", default=False,
                      help="print only the final line")


_COMMANDS = {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench, "memory": cmd_memory}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``jaxdev`` command line on ``argv``; return the exit code (0, 2 usage, 1 failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from ..distributed import launch_main

        return launch_main(argv[1:])
    prog = f"jaxdev {argv[0]}" if argv and argv[0] in _COMMANDS else "jaxdev"
    try:
        args = build_parser().parse_args(argv)
        return _COMMANDS[args.command](args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `jaxdev info --json | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, jaxdev.DeviceNotFoundError, jaxdev.BackendStartedError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a failure: jaxdev's named ones explain themselves, others keep
        if not isinstance(e, jaxdev.JaxdevError):  # their traceback
            traceback.print_exc()
        print(f"{prog}: failed: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
