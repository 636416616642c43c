"""Tests of init_sharded: linen, plain functions and NNX modules built in their shardings."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import ShardingError, UsageError


def specs(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


def assert_same_values(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if jnp.issubdtype(x.dtype, jnp.floating):  # the same bits; XLA may round the sharded
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)  # normal 1 ulp off
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(256)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(16)(x)


def test_linen_fsdp_values_equal_unsharded_init(fsdp8):
    model, key, x = MLP(), jax.random.key(0), jnp.ones((2, 64))
    variables = jaxdev.init_sharded(model.init, key, x, mesh=fsdp8, rules="fsdp")
    assert specs(variables) == {
        "params": {
            "Dense_0": {"kernel": P(None, "fsdp"), "bias": P()},
            "BatchNorm_0": {"scale": P(), "bias": P()},
            "Dense_1": {"kernel": P("fsdp", None), "bias": P()},
        },
        "batch_stats": {"BatchNorm_0": {"mean": P(), "var": P()}},
    }
    assert_same_values(variables, jax.jit(model.init)(key, x))
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(64, 32)}  # 1/8 each


def test_static_arguments_pass_as_constants(fsdp8):
    model, key, x = MLP(), jax.random.key(1), jnp.ones((2, 64))
    # a Python bool argument (train=True needs a dropout rng: a dict of keys)
    rngs = {"params": key, "dropout": jax.random.key(2)}
    variables = jaxdev.init_sharded(model.init, rngs, x, True, mesh=fsdp8, rules="fsdp")
    assert_same_values(variables, model.init(rngs, x, True))
    init = functools.partial(model.init, train=False)
    assert jaxdev.init_sharded(init, key, x, mesh=fsdp8)["params"]["Dense_0"][
        "kernel"
    ].sharding == (NamedSharding(fsdp8, P()))


def test_plain_function_returning_a_pytree(dm):
    def init(key, n):
        k1, k2 = jax.random.split(key)
        return {"emb": jax.random.normal(k1, (n, 64)), "head": [jax.random.normal(k2, (64, 8))]}

    rules = [("emb", P("model")), ("head/0", P(None, "data"))]
    out = jaxdev.init_sharded(init, jax.random.key(0), 1000, mesh=dm, rules=rules)
    assert specs(out) == {"emb": P("model", None), "head": [P(None, "data")]}
    assert_same_values(out, init(jax.random.key(0), 1000))


class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        return nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("hidden", "out")))(x)


def test_linen_boxed_flax_rules_come_back_unboxed(dm):
    model, key, x = Boxed(), jax.random.key(0), jnp.ones((1, 16))
    out = jaxdev.init_sharded(
        model.init, key, x, mesh=dm, rules="flax", logical_axis_rules=[("hidden", "model")]
    )
    kernel0 = out["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel0, jax.Array)  # unboxed
    assert kernel0.sharding.spec == P(None, "model")
    assert out["params"]["Dense_1"]["kernel"].sharding.spec == P("model", None)
    assert_same_values(out, nn.unbox(model.init(key, x)))


class Net(nnx.Module):
    def __init__(self, rngs, annotate=True):
        init = nnx.initializers.lecun_normal()
        if annotate:
            init = nnx.with_partitioning(init, (None, "model"))
        self.up = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(self.norm(self.up(x))))


def test_nnx_module_built_sharded_from_metadata(dm):
    model = jaxdev.init_sharded(lambda: Net(nnx.Rngs(0, dropout=1)), mesh=dm, rules="flax")
    assert isinstance(model, Net)
    assert model.up.kernel[...].sharding.spec == P(None, "model")
    assert model.down.kernel[...].sharding == NamedSharding(dm, P())
    with jax.set_mesh(dm):
        eager = Net(nnx.Rngs(0, dropout=1))
    assert_same_values(nnx.state(model), nnx.state(eager))
    assert model(jnp.ones((4, 16))).shape == (4, 8)  # a working module


def test_nnx_module_with_rngs_argument_and_regex(dm):
    rules = [("down/kernel", P("model")), ("norm/mean", P("model"))]
    model = jaxdev.init_sharded(Net, nnx.Rngs(0, dropout=1), False, mesh=dm, rules=rules)
    assert model.down.kernel[...].sharding.spec == P("model", None)
    assert model.norm.mean[...].sharding.spec == P("model")
    assert model.up.kernel[...].sharding.spec == P()  # not annotated, not matched
    params, _ = jaxdev.nnx.split(model)
    assert jaxdev.shard_params(params, dm, rules) is params  # already placed


def test_nnx_fsdp_and_train_state(fsdp8):
    import optax

    model = jaxdev.init_sharded(lambda: Net(nnx.Rngs(0), annotate=False), mesh=fsdp8, rules="fsdp")
    assert model.up.kernel[...].sharding.spec == P(None, "fsdp")  # 16 x 64 = min_size
    assert model.down.kernel[...].sharding.spec == P()  # 64 x 8 < 1024 elements
    params, rest = jaxdev.nnx.split(model)
    state = jaxdev.TrainState.create(params, optax.adam(1e-3), model_state=rest)
    s = jaxdev.param_shardings(state, fsdp8, "fsdp", min_size=0)
    assert s.opt_state[0].mu["up"]["kernel"].get_value().spec == P(None, "fsdp")


def test_errors_before_anything_is_built(dm):
    calls = []

    def init(key):
        calls.append(1)
        return {"w": jax.random.normal(key, (10, 10))}

    with pytest.raises(ShardingError) as e:
        jaxdev.init_sharded(init, jax.random.key(0), mesh=dm, rules=[("w", P("model"))])
    assert "['w'] of shape (10, 10)" in str(e.value) and "not divisible" in str(e.value)
    assert len(calls) == 1  # traced once by eval_shape; never run for real
    with pytest.raises(UsageError, match="`init_fn` must be callable"):
        jaxdev.init_sharded("model.init", mesh=dm)
    with pytest.raises(ShardingError, match="`mesh` must be a jax.sharding.Mesh"):
        jaxdev.init_sharded(init, jax.random.key(0), mesh="dm")
    with pytest.raises(TypeError):
        jaxdev.init_sharded(init, jax.random.key(0))  # mesh is keyword-only and required


def test_peak_rss_growth_stays_near_the_state_size():
    """A 25M-param MLP + adam (302 MB) built by init_sharded in a fresh process.

    The peak RSS growth (VmHWM after a reset, minus RSS before; compilation of
    the model included) stays <= 1.3x the state bytes; replicating first
    costs ~8.8x (benchmarks/init_bench.py).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    script = os.path.join(REPO, "benchmarks", "init_bench.py")
    out = subprocess.run(
        [sys.executable, script, "--child", "init_sharded"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["params"] == 25_175_040
    assert row["per_device_bytes"] <= row["state_bytes"] / 8 * 1.05
    assert row["ratio"] <= 1.3, row
