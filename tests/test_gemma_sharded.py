"""Flax's gemma example, sharded as gemma shards it, trained, saved and restored by jaxdev.

gemma's ``train.py``: ``jax.make_mesh`` over ``('fsdp', 'tensor')`` with
Explicit axes, ``ShardingConfig.fsdp_tp_sharding``, the model and optimizer
built under ``jax.set_mesh``, ``out_sharding=P(...)`` inside its embed and
einsums, and ``nnx_train_step`` (``nnx.jit``, ``nnx.value_and_grad``,
``nnx.Optimizer``) run under ``jax.set_mesh``. jaxdev trains the same model
with no ``jax.set_mesh`` in user code. The model is ``tests/flax_gemma``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_gemma import sow_lib
from flax_gemma import transformer as transformer_lib
from flax_gemma.transformer_cfg import ShardingConfig
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxdev

VOCAB, LR, STEPS = 64, 0.1, 10
TINY = {  # configs/tiny.py's transformer_params, smaller
    "num_layers": 2,
    "embed_dim": 32,
    "hidden_dim": 64,
    "num_heads": 4,
    "head_dim": 8,
    "num_kv_heads": 1,
    "use_post_attn_norm": False,
    "use_post_ffw_norm": False,
    "attention_types": (1, 1),
    "final_logit_softcap": None,
}


def _model() -> transformer_lib.Transformer:  # as train.py builds it
    shd_config = ShardingConfig.fsdp_tp_sharding(
        fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor"
    )
    config = transformer_lib.TransformerConfig.from_dict(
        **TINY, num_embed=VOCAB, dtype=jnp.float32, shd_config=shd_config
    )
    rngs = nnx.Rngs(params=0, dropout=0)
    return transformer_lib.Transformer(config, rngs=rngs, sow_config=sow_lib.SowConfig())


def loss_fn(model, batch, rngs=None):
    """train.py's nnx_train_step loss: compute_weighted_cross_entropy per sample."""
    inputs, targets = batch["inputs"], batch["targets"]
    input_mask = inputs > 0
    attention_mask = transformer_lib.make_causal_attn_mask(input_mask)
    logits, _ = model(
        inputs,
        positions=batch["inputs_position"],
        attention_mask=attention_mask,
        cache=None,
        rngs=rngs,
    )
    weights = input_mask.astype(jnp.float32)
    log_probs = nnx.log_softmax(logits)
    loss = -jnp.sum(jax.nn.one_hot(targets, VOCAB) * log_probs, axis=-1) * weights
    return loss.sum(axis=1) * len(loss) / weights.sum()  # jaxdev averages over rows


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        inputs = rng.integers(1, VOCAB, (8, 16)).astype(np.int32)
        inputs[:, 12:] = 0  # padding, masked by the weights
        positions = np.asarray(transformer_lib.build_positions_from_mask(inputs > 0))
        out.append(
            {"inputs": inputs, "targets": np.roll(inputs, -1, 1), "inputs_position": positions}
        )
    return out


def _gemma_train(mesh, batches):
    """gemma's own loop: model, optimizer and steps under the user's jax.set_mesh."""
    with jax.set_mesh(mesh):
        model = _model()
        optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
        rngs = nnx.Rngs(dropout=0)

        @nnx.jit
        def train_step(model, optimizer, rngs, batch):
            grad_fn = nnx.value_and_grad(lambda m, r: loss_fn(m, batch, r).mean())
            loss, grads = grad_fn(model, rngs.fork())
            optimizer.update(model, grads)
            return loss

        for batch in batches:
            loss = train_step(model, optimizer, rngs, jax.device_put(batch, P("fsdp")))
    return nnx.state(model, nnx.Param), float(loss)


def test_gemma_fsdp_tp_trains_saves_restores_through_jaxdev_like_gemmas_own_step(tmp_path):
    # Explicit axes as train.py makes them (gemma's einsums refuse Auto axes in out_sharding)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    batches = _batches(STEPS + 2)
    want, want_loss = _gemma_train(mesh, batches[:STEPS])

    # jaxdev, no jax.set_mesh anywhere: the model is built sharded by its own annotations
    model = jaxdev.init_sharded(_model, mesh=mesh, rules="flax")
    tx = optax.sgd(LR)
    strategy = jaxdev.Strategy.sharded(mesh, rules="flax")  # the batch splits over 'fsdp'
    step = jaxdev.make_train_step(jaxdev.nnx.loss(model, loss_fn), tx, strategy, has_state=True)
    params, model_state = jaxdev.nnx.split(model)
    state = step.init_state(params, tx, model_state=model_state)
    assert jaxdev.placement(state.params).diff(jaxdev.placement(want)) == []  # gemma's layout
    for batch in batches[:STEPS]:
        state, metrics = step(state, step.put_batch(batch))
    assert jax.sharding.get_mesh().empty
    assert metrics.fetch()["loss"] == pytest.approx(want_loss, rel=1e-5)
    got = jaxdev.placement(state.params)
    assert got.diff(jaxdev.placement(want)) == []
    assert got.bytes_by_device == jaxdev.placement(want).bytes_by_device
    for g, w in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    plan = jaxdev.memory.plan(
        state, step=step, batch=step.put_batch(batches[0])
    )  # compiled, not run
    assert plan["params"] == max(got.bytes_by_device.values()) and plan.peak > 0

    # save and restore the sharded state on the Explicit mesh, then train on bit-identically
    jaxdev.save(tmp_path / "ckpt", state, step=STEPS)
    like = jaxdev.restore(tmp_path / "ckpt", state)
    saved = jaxdev.restore(tmp_path / "ckpt")  # no target: the saved shardings, Explicit axes
    with jaxdev.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(STEPS, state)
        ckpt.wait()
        managed = ckpt.restore(state)
    for batch in batches[STEPS:]:
        state, _ = step(state, step.put_batch(batch))
    for restored in (like, managed):
        for batch in batches[STEPS:]:
            restored, _ = step(restored, step.put_batch(batch))
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shardings = [x.sharding for x in jax.tree.leaves(state)]
    assert [x.sharding for x in jax.tree.leaves(saved)] == shardings  # Explicit axes kept
