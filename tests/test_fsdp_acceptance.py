"""Issue 12 acceptance on shapes alone: a ~25M-param transformer with adam, linen and NNX.

Under ``"fsdp"`` over 8 devices, params + optimizer state per device must be at
most total / 8 x 1.05 plus the leaves that stay replicated (small ones), and
under ``"replicate"`` the full total. Nothing is allocated: ``jax.eval_shape``
and :func:`jaxdev.memory.plan` only.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxdev

VOCAB, D, HEADS, FF, LAYERS = 8192, 512, 8, 2048, 6


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(FF)(h)))


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        for _ in range(LAYERS):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(D, FF, rngs=rngs), nnx.Linear(FF, D, rngs=rngs)


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def _linen_state():
    def build():
        params = LinenLM().init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        return jaxdev.TrainState.create(params, optax.adam(1e-3))

    return jax.eval_shape(build)


def _nnx_state():
    params = nnx.state(nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0))), nnx.Param)
    return jax.eval_shape(lambda p: jaxdev.TrainState.create(p, optax.adam(1e-3)), params)


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("make", [_linen_state, _nnx_state], ids=["linen", "nnx"])
def test_fsdp_bytes_per_device_of_a_25m_param_model(make):
    state = make()
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    assert 24e6 < n_params < 28e6, n_params  # about 27.3M
    total = _bytes((state.params, state.opt_state))
    mesh = jaxdev.data_mesh()

    full = jaxdev.memory.plan(state, mesh, "replicate")
    assert full["params"] + full["opt_state"] == total

    fsdp = jaxdev.memory.plan(state, mesh, "fsdp")
    shardings = jaxdev.param_shardings(state, mesh, "fsdp")
    pairs = zip(
        jax.tree.leaves((state.params, state.opt_state)),
        jax.tree.leaves((shardings.params, shardings.opt_state)),
    )
    small = sum(x.size * x.dtype.itemsize for x, s in pairs if s.is_fully_replicated)
    per_device = fsdp["params"] + fsdp["opt_state"]
    assert per_device <= total / 8 * 1.05 + small, (per_device, total, small)
    assert small < 0.01 * total  # only biases, LayerNorm scales and adam's count stay whole
    assert per_device < full["params"] + full["opt_state"]
