"""A language model's loss: per-token losses, padding tokens weighted 0, one global mean.

Run: ``python examples/language_model.py``. A small causal transformer is trained
on token rows padded with 0 at the end (rows of different lengths), FSDP on a
``data=2 x fsdp=4`` mesh of 8 devices (8 fake CPUs without an accelerator).
``loss_fn`` returns ``(losses, weights)`` per token and the step uses
``weighted=True``: the objective is ``sum(loss * weight) / sum(weight)`` over
the whole global batch, as in Flax's lm1b example, on every strategy, with an
uneven last batch and with ``accumulate=``. The same model trained with the
per-row mean of its tokens (what a per-example step gives) ends elsewhere.
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

VOCAB, LENGTH, ROWS, STEPS, DIM = 64, 16, 30, 20, 64


class TinyLM(nn.Module):
    """Embedding, one causal self-attention block and an MLP: next-token logits."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM)(tokens)
        mask = nn.combine_masks(
            nn.make_causal_mask(tokens), nn.make_attention_mask(tokens > 0, tokens > 0)
        )
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=DIM)(
            nn.LayerNorm()(x), mask=mask
        )
        x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = TinyLM()


def token_loss(params, batch):
    """Predict token t+1 from tokens <= t; weight 1 on real targets, 0 on padding."""
    tokens = batch["tokens"]
    logits = MODEL.apply({"params": params}, tokens[:, :-1])
    targets = tokens[:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return (losses, (targets > 0).astype(jnp.float32)), {"token_accuracy": correct}


def per_row_mean(params, batch):
    """The naive port: each row's mean token loss, then the step's mean over rows."""
    (losses, weights), _ = token_loss(params, batch)
    return jnp.sum(losses * weights, -1) / jnp.maximum(jnp.sum(weights, -1), 1.0)


def make_batches(seed: int = 0) -> list[dict]:
    """Rows of a repeating pattern (learnable), each cut to a random length and 0-padded."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        start = rng.integers(1, VOCAB, size=(ROWS, 1))
        tokens = (start + 3 * np.arange(LENGTH)[None, :]) % (VOCAB - 1) + 1
        lengths = rng.integers(3, LENGTH + 1, size=ROWS)
        tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
        out.append({"tokens": tokens.astype(np.int32)})
    return out


def train(strategy, loss, batches, **kw):
    tx = optax.sgd(0.5)
    weighted = loss is token_loss
    step = jaxdev.make_train_step(loss, tx, strategy, has_aux=weighted, weighted=weighted, **kw)
    params = MODEL.init(jax.random.key(0), jnp.ones((1, LENGTH - 1), jnp.int32))["params"]
    state, metrics = step.init_state(params, tx), None
    for batch in batches:  # 30 rows: padded to 32 rows on 8 devices, padded rows masked
        state, metrics = step(state, step.put_batch(batch), metrics)
    return state, metrics


def hand_written_global_mean(batches):
    """The objective written out on one device: sum(loss * w) / sum(w) per step."""
    tx = optax.sgd(0.5)
    params = MODEL.init(jax.random.key(0), jnp.ones((1, LENGTH - 1), jnp.int32))["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def objective(p):
            (losses, weights), _ = token_loss(p, batch)
            return jnp.sum(losses * weights) / jnp.sum(weights)

        grads = jax.grad(objective)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params


def max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def main() -> None:
    batches = make_batches()
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    fsdp = jaxdev.Strategy.sharded(mesh, rules="fsdp")
    want = hand_written_global_mean(batches)
    state, metrics = train(fsdp, token_loss, batches)
    got = metrics.fetch()
    print(f"fsdp, weighted: loss {got['loss']:.4f}, token accuracy {got['token_accuracy']:.3f}")
    print(f"  max |params - hand-written global token mean| = {max_diff(state.params, want):.2e}")
    acc, _ = train(fsdp, token_loss, batches, accumulate=2)
    pmap, _ = train(jaxdev.Strategy.pmap(8), token_loss, batches)
    print(
        f"  accumulate=2: {max_diff(acc.params, want):.2e}; pmap: {max_diff(pmap.params, want):.2e}"
    )
    naive, _ = train(fsdp, per_row_mean, batches)
    print(f"per-row mean instead: max |params - global mean| = {max_diff(naive.params, want):.2e}")
    for s in (state, acc, pmap):
        assert max_diff(s.params, want) < 1e-4
    assert max_diff(naive.params, want) > 1e-3
    print("language model: ok")


if __name__ == "__main__":
    main()
