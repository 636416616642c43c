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


@pytest.mark.parametrize("args, fragment", [
    (["--model", "nowhere.py:tiny"], "`--model nowhere.py:tiny`: expected FILE.py:FUNCTION"),
    (["--model", f"{__file__}:tiny", "--remat", "everything"],
     "`--remat everything` is not in jax.checkpoint_policies"),
])
def test_bad_models_and_policies_are_usage_errors(capsys, args, fragment):
    assert main(["memory", "--mesh", "fsdp=8", *args]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.target
def test_memory_plans_for_a_gpu_target(capsys):
    args = ["--target", "h100", "--topology", "8", "--mesh", "fsdp=8"]
    assert main(["memory", "--model", f"{__file__}:tiny", *args]) == 0
    out = capsys.readouterr().out
    assert "for 8 x NVIDIA H100 80GB HBM3 (target 'h100')" in out and "compiled by XLA:GPU" in out
