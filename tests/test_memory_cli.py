"""``jaxdev memory --model`` (issue 36): a model's step planned, fitted and explained from the
command line, for this host's fake CPU devices or a GPU target (nothing allocated)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jaxdev.cli._cli import main


class Tiny(nnx.Module):
    def __init__(self, remat=None, *, rngs):
        self.up, self.down = nnx.Linear(32, 256, rngs=rngs), nnx.Linear(256, 32, rngs=rngs)
        self.remat = remat

    def __call__(self, x):
        block = lambda m, x: m.down(jnp.tanh(m.up(x)))  # noqa: E731
        return block(self, x) if self.remat is None else nnx.remat(block, policy=self.remat)(
            self, x
        )


def tiny(remat=None):
    """The entry point: what ``--model tests/test_memory_cli.py:tiny`` loads."""
    return {
        "model": lambda: Tiny(remat, rngs=nnx.Rngs(0)),
        "loss": lambda m, b: jnp.mean((m(b["x"]) - b["x"]) ** 2, axis=(-1, -2)),
        "batch": {"x": jax.ShapeDtypeStruct((1, 64, 32), jnp.float32)},
        "tx": optax.adam(1e-3),
    }


def test_memory_plans_fits_and_explains_a_models_step(capsys):
    code = main([
        "memory", "--model", f"{__file__}:tiny", "--mesh", "fsdp=8", "--limit", "0.002",
        "--fit", "--options", "accumulate,remat", "--remat", "nothing_saveable",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "memory plan: mesh(fsdp=8), rules='fsdp'" in out and "compiled by XLA:CPU" in out
    assert "it fits, nothing to fix" in out
    assert re.search(r"\n  accumulate +skipped .* 1 row per device: accumulate=2 needs", out)
    assert "your `remat` step" in out
    assert "largest batch that fits: " in out and "programs compiled in" in out


def test_remat_is_compiled_also_when_options_leave_it_out(capsys):
    """`--options fsdp --remat POLICY` compiled fsdp alone: the policy's step was built and
    silently never compiled (remat was an option only without `--options`)."""
    code = main([
        "memory", "--model", f"{__file__}:tiny", "--mesh", "data=8", "--rules", "replicate",
        "--limit", "0.002", "--options", "fsdp", "--remat", "nothing_saveable",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"\n  Strategy.sharded\(mesh, rules='fsdp'\) +fsdp over 8 devices", out)
    assert re.search(r"\n  your `remat` step +the model's own remat +[\d.]+ KiB", out), out


@pytest.mark.parametrize("gib, code, verdict", [
    ("1", 0, r"fits: the step needs [\d.]+ KiB per device, 1.0 GiB available \(--limit\)\n"),
    ("0.00001", 1, r"does not fit: the step needs [\d.]+ KiB per device, 10.5 KiB available "
     r"\(--limit\), [\d.]+ KiB over: exit 1\n"),
])
def test_a_limit_alone_gets_a_verdict_and_the_exit_code(capsys, gib, code, verdict):
    """--limit without --fit/--options/--remat was ignored: no verdict, exit 0."""
    assert main(["memory", "--model", T, "--mesh", "fsdp=8", "--limit", gib]) == code
    assert re.search(verdict, capsys.readouterr().out)


def not_a_dict():
    return (1, 2)


T = f"{__file__}:tiny"


@pytest.mark.parametrize("args, fragment", [
    (["--model", "nowhere.py:tiny"], "`--model nowhere.py:tiny`: expected FILE.py:FUNCTION"),
    (["--model", T, "--remat", "everything"],
     "`--remat everything` is not in jax.checkpoint_policies"),
    (["--model", f"{__file__}:not_a_dict"], "not_a_dict() must return a dict with 'model', "),
    (["--model", T, "--options", "bogus"], "`--options bogus`: expected some of fsdp,"),
    (["--model", T, "--limit", "-1"], "argument --limit: expected a positive number of GiB"),
    (["--model", T, "--limit", "-1", "--fit"], "argument --limit: expected a positive number"),
    (["--model", T, "--target", "h100", "--topology", "0"], "argument --topology: expected a"),
    (["--model", T, "--target", "h100", "--topology", "1x1x8"], "hosts x devices per host"),
    (["--model", T, "--target", "h100", "--topology", "3"],
     "`--topology 3` gives 3 target devices but `--mesh fsdp=8` needs 8"),
    (["--model", T, "--target", "h100", "--topology", "2x8"], "`--topology 2x8` gives 16"),
    (["--model", T, "--topology", "2x4"], "`--topology 2x4` (hosts x devices per host) needs"),
])
def test_bad_models_and_policies_are_usage_errors(capsys, args, fragment):
    """Each user mistake: exit 2, one line, no traceback, before anything is compiled."""
    assert main(["memory", "--mesh", "fsdp=8", *args]) == 2
    out, err = capsys.readouterr()
    assert fragment in err and "Traceback" not in err and "memory plan" not in out


@pytest.mark.parametrize("args, fragment", [
    (["--fit"], "`--fit` plans a model's step: it needs `--model FILE.py:FUNCTION`"),
    (["--limit", "0.001", "--mesh", "data=8"], "`--mesh` plans a model's step: it needs"),
    (["--rows", "4"], "`--rows` plans a model's step"),
    (["--rules", "replicate"], "`--rules` plans a model's step"),
    (["--model", T, "--strategy", "pmap"], "`--strategy` is for the demo's live memory ledger"),
    (["--model", T, "--plot", "out.png"], "`--plot` is for the demo's live memory ledger"),
])
def test_the_flags_of_the_other_memory_command_are_refused(capsys, args, fragment):
    """Before: ignored, exit 0. `jaxdev memory --limit 0.001 --mesh data=8` (no `--model`) ran
    the demo's ledger and gave no verdict; `--model ... --strategy pmap` planned sharded jit
    and `--model ... --plot p.png` drew nothing."""
    assert main(["memory", *args]) == 2
    out, err = capsys.readouterr()
    assert fragment in err and "Traceback" not in err and not out.strip(), (out, err)


@pytest.mark.target
def test_memory_plans_for_a_gpu_target(capsys):
    args = ["--target", "h100", "--topology", "8", "--mesh", "fsdp=8"]
    assert main(["memory", "--model", f"{__file__}:tiny", *args]) == 0
    out = capsys.readouterr().out
    assert "for 8 x NVIDIA H100 80GB HBM3 (target 'h100')" in out and "compiled by XLA:GPU" in out


@pytest.mark.target
@pytest.mark.parametrize("args, code, fragment", [
    (["--target", "h100"], 0, "mesh(data=8), rules='fsdp', for 8 x NVIDIA H100"),
    (["--target", "h100", "--topology", "2x8"], 0, "mesh(data=16)"),
    (["--target", "h300"], 2, "`target`='h300' is neither a GPU jaxdev knows"),
])
def test_a_target_without_a_mesh_plans_on_its_devices(capsys, args, code, fragment):
    assert main(["memory", "--model", T, *args]) == code
    out, err = capsys.readouterr()
    assert fragment in out + err and "Traceback" not in err


def test_a_plot_suffix_matplotlib_cannot_write_is_refused_before_the_run():
    """`jaxdev memory --plot m.xyz` (and `bench`) trained the demo, then raised matplotlib's
    bare ValueError (exit 1); refused first now, naming `--plot`."""
    import argparse

    from jaxdev import UsageError
    from jaxdev.cli import _cli

    with pytest.raises(UsageError, match=r"`--plot` 'm.xyz': matplotlib writes no '.xyz'"):
        _cli._check_outputs(argparse.Namespace(plot="m.xyz", json=None))
    _cli._check_outputs(argparse.Namespace(plot="m.svg", json=None))  # nothing drawn yet
