"""Will it fit? A Llama-style NNX decoder planned for GPUs you don't have.

Run: ``jaxdev memory --model examples/llama_plan.py:llama_1b --target h100 --mesh fsdp=8``
(needs the CUDA plugin, ``pip install 'jaxdev[cuda12]'``, no GPU), or without ``--target``
for XLA:CPU's plan on fake CPU devices. ``python examples/llama_plan.py`` plans the tiny
config on 8 fake CPU devices.

The entry point contract of ``jaxdev memory --model FILE.py:FUNCTION`` (or
``module:function``): the function returns ``{"model": a constructor of the NNX module,
"loss": loss_fn(model, batch) -> per-row losses, "batch": one row of the batch as
ShapeDtypeStructs (rows first), "tx": the optax optimizer}``; with a ``remat`` keyword it is
called again with ``--remat``'s policy for the per-block remat option.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 8192
    seq: int = 2048


class Block(nnx.Module):
    """Pre-norm attention (grouped KV heads, causal) and a SwiGLU MLP; bf16 compute."""

    def __init__(self, c: Config, rngs: nnx.Rngs):
        dense = functools.partial(nnx.Linear, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
        self.c, hd = c, c.dim // c.heads
        self.norm1, self.norm2 = nnx.RMSNorm(c.dim, rngs=rngs), nnx.RMSNorm(c.dim, rngs=rngs)
        self.q, self.kv = dense(c.dim, c.dim), dense(c.dim, 2 * c.kv_heads * hd)
        self.o, self.down = dense(c.dim, c.dim), dense(c.ffn, c.dim)
        self.up = dense(c.dim, 2 * c.ffn)

    def __call__(self, x):
        b, s, _ = x.shape
        hd = self.c.dim // self.c.heads
        h = self.norm1(x)
        q = self.q(h).reshape(b, s, self.c.heads, hd)
        k, v = jnp.split(self.kv(h).reshape(b, s, 2 * self.c.kv_heads, hd), 2, axis=2)
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.reshape(b, s, -1))
        gate, up = jnp.split(self.up(self.norm2(x)), 2, axis=-1)
        return x + self.down(nnx.silu(gate) * up)


class Llama(nnx.Module):
    """Token embedding, ``layers`` blocks (each under ``nnx.remat(policy=remat)`` when given),
    a final norm and the output projection; f32 params."""

    def __init__(self, c: Config, remat=None, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.dim, dtype=jnp.bfloat16, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.dim, rngs=rngs)
        self.head = nnx.Linear(c.dim, c.vocab, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
        self.remat = remat

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x) if self.remat is None else nnx.remat(block, policy=self.remat)(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def next_token_loss(model, batch):
    """Per-row mean cross entropy of token t+1 given tokens <= t."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return losses.mean(-1)


def llama(c: Config, remat=None) -> dict:
    """The entry point ``jaxdev memory --model`` calls (see the module docstring)."""
    return {
        "model": lambda: Llama(c, remat, rngs=nnx.Rngs(0)),
        "loss": next_token_loss,
        "batch": {"tokens": jax.ShapeDtypeStruct((1, c.seq + 1), jnp.int32)},
        "tx": optax.adamw(1e-4),
    }


llama_1b = functools.partial(llama, Config())  # 1.10B params: 4.4 GB f32, 13.2 GB with adam
llama_tiny = functools.partial(llama, Config(1000, 128, 2, 4, 2, 256, 128))


if __name__ == "__main__":
    import sys

    from jaxdev.cli._cli import main

    code = main(["memory", "--model", f"{__file__}:llama_tiny", "--limit", "0.02", "--fit"])
    print("llama plan: ok" if code == 0 else f"llama plan: exit {code}")
    sys.exit(code)
