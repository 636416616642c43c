"""Instructions the host thread runs per step call: jaxdev's step vs its program vs a hand step.

Run: ``python benchmarks/step_instructions.py [--strategies single,sharded] [--leaves 2,100]
[--calls 200]`` (needs valgrind; ~40 s a variant on 2 cores).

A time on a shared 2-core VM moves by 2x between runs; an instruction count does not (the
same count to 0.1% run after run). Each variant of ``step_overhead.py`` (``step``,
``program``, ``hand``, ``hand+mean``; same models, placement and donation) runs in its own
process under ``valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes``: after
50 warm-up calls the process switches counting on (``callgrind_control -i on``), makes
``--calls`` calls, and switches it off. The figure is the main thread's count per call,
less that of an empty on/off window. Callgrind runs one thread at a time, so a count says
nothing about waits or XLA's worker threads; it is what the host executes to dispatch a
call: jaxdev's Python, JAX's C++ dispatch and the pytree work of the arguments and outputs.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

VARIANTS = ("empty", "step", "program", "hand", "hand+mean")


def count(kind: str, leaves: int, variant: str, calls: int) -> None:
    """In the process under callgrind: warm up, then count ``calls`` calls of ``variant``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import step_overhead as so

    devices = jax.devices()[: 1 if kind == "single" else so.N_DEVICES]
    fns, sync, _ = so.loops(kind, so.mlp(leaves), devices)
    call, carry = fns["step" if variant == "empty" else variant]
    c, out = carry[0], None
    for i in range(1, 51):  # every cache warm; multi-device CPU waits every 8 calls
        c, out = call(c)
        if sync and i % sync == 0:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    toggle = ["callgrind_control", "-i", "on", str(os.getpid())]
    subprocess.run(toggle, check=True, capture_output=True)
    for i in range(1, (0 if variant == "empty" else calls) + 1):
        c, out = call(c)
        if sync and i % sync == 0:
            jax.block_until_ready(out)
    subprocess.run(toggle[:2] + ["off", toggle[3]], check=True, capture_output=True)
    jax.block_until_ready(out)


def measure(kind: str, leaves: int, variant: str, calls: int) -> int:
    """The main thread's instruction count of one variant's counting window."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
            f"--callgrind-out-file={tmp}/cg.%p", sys.executable, os.path.abspath(__file__),
            "--count", kind, str(leaves), variant, str(calls),
        ]  # fmt: skip
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        main = glob.glob(f"{tmp}/cg.*-01")
        if proc.returncode or len(main) != 1:
            raise RuntimeError(f"{variant} ({kind}, {leaves} leaves): {proc.stderr[-2000:]}")
        with open(main[0]) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("totals:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="single,sharded")
    ap.add_argument("--leaves", default="2,100")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--count", nargs=4, help=argparse.SUPPRESS)  # the process under callgrind
    args = ap.parse_args()
    if args.count:
        kind, leaves, variant, calls = args.count
        return count(kind, int(leaves), variant, int(calls))
    print(
        "| leaves | strategy | step | program | hand | hand+mean | step/hand | program/hand "
        "| step/hand+mean | step-program |"
    )
    print("|---:|---|" + "---:|" * 8)
    for kind in args.strategies.split(","):
        for leaves in map(int, args.leaves.split(",")):
            n = {v: measure(kind, leaves, v, args.calls) for v in VARIANTS}
            k = {v: (n[v] - n["empty"]) / args.calls / 1000 for v in VARIANTS[1:]}
            print(
                f"| {leaves} | {kind} | {k['step']:.1f}k | {k['program']:.1f}k | {k['hand']:.1f}k "
                f"| {k['hand+mean']:.1f}k | {k['step'] / k['hand']:.2f}x "
                f"| {k['program'] / k['hand']:.2f}x | {k['step'] / k['hand+mean']:.2f}x "
                f"| {k['step'] - k['program']:+.1f}k |",
                flush=True,
            )


if __name__ == "__main__":
    main()
