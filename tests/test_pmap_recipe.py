"""Flax's pmap recipe, as flax's examples write it, trains exactly or is refused by name.

The recipe (flax's examples/imagenet/train.py at e60035116e99, google/flax, the
commit before it moved to ``in_axes=(None, 0)``; and examples/nlp_seq and wmt today):
``state = jax_utils.replicate(state)``, ``p_train_step = jax.pmap(train_step,
axis_name='batch')`` with ``grads = lax.pmean(grads, axis_name='batch')``, and each
batch ``common_utils.shard(batch)`` or ``jax_utils.prefetch_to_device(it, 2)``.
A stacked batch, stacked params or a replicated state given to jaxdev's step could
read two ways; each is refused naming the call that converts it (issue 34), and the
converted inputs train to flax's own pmap step's params under SGD.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax.training import common_utils, train_state
from jax import lax

import jaxdev

N = 8  # the fake CPU devices of tests/conftest.py
ROWS = 32  # 4 per device
LR = 0.1
STEPS = 4


class CNN(nn.Module):
    """Flax's mnist example CNN, narrower (conv, relu, avg_pool twice, then two Dense)."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(features=4, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        return nn.Dense(features=10)(nn.relu(nn.Dense(features=16)(x)))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(features=10)(nn.relu(nn.Dense(features=16)(x)))


def _classifier(model, shape):
    def per_example(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])

    def data(seed):
        rng = np.random.default_rng(seed)
        return {
            "image": rng.normal(size=(ROWS, *shape)).astype(np.float32),
            "label": rng.integers(0, 10, size=ROWS).astype(np.int32),
        }

    params = model.init(jax.random.key(0), jnp.zeros((1, *shape)))["params"]
    return per_example, params, data


def _generic(params, batch):
    """A per-example loss written for any trailing shape (it sums every axis but the first)."""
    err = batch["x"] * params["w"] - batch["y"]
    return jnp.sum(err**2, axis=tuple(range(1, err.ndim)))


def _centering(params, batch):
    """A model that works along the batch axis: inputs centred on the (device's) batch."""
    err = (batch["x"] - batch["x"].mean(axis=0)) @ params["w"] - batch["y"]
    return jnp.sum(err**2, axis=tuple(range(1, err.ndim)))  # any trailing shape, too


def _regression(loss, ydim):
    def data(seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(ROWS, 6)).astype(np.float32) + np.arange(6, dtype=np.float32)
        y = rng.normal(size=(ROWS, *ydim)).astype(np.float32)
        return {"x": x, "y": y}

    return loss, {"w": np.linspace(-1, 1, 6).astype(np.float32)}, data


MODELS = {
    "cnn": lambda: _classifier(CNN(), (8, 8, 1)),
    "mlp": lambda: _classifier(MLP(), (12,)),
    "generic": lambda: _regression(_generic, (6,)),
    "centering": lambda: _regression(_centering, ()),
}


def _flax_pmap_step(per_example):
    """Flax's imagenet ``train_step`` (no batch stats, no dynamic scale), pmapped as there."""

    def train_step(state, batch):
        def loss_fn(params):
            return jnp.mean(per_example(params, batch))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        # Re-use same axis_name as in the call to `pmap(...train_step...)` below.
        grads = lax.pmean(grads, axis_name="batch")
        metrics = lax.pmean({"loss": loss}, axis_name="batch")
        return state.apply_gradients(grads=grads), metrics

    return jax.pmap(train_step, axis_name="batch")


def _flax_run(per_example, params, data):
    tx = optax.sgd(LR)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = jax_utils.replicate(state)
    p_train_step = _flax_pmap_step(per_example)
    for i in range(STEPS):
        state, _ = p_train_step(state, common_utils.shard(data(i)))
    return jax_utils.unreplicate(state).params


def _close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "name", [pytest.param("cnn", marks=pytest.mark.slow), "centering", "generic", "mlp"]
)  # the cnn: ~15 s on 2 cores, flax's replicate and its pmap step compiled twice
def test_the_recipe_converted_trains_as_flaxs_own_pmap_step(name):
    """``unshard_from_pmap(common_utils.shard(b))`` and ``prefetch_to_device``'s arrays give
    flax's params after several SGD steps: the device split is common_utils.shard's."""
    per_example, params, data = MODELS[name]()
    want = _flax_run(per_example, params, data)
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), want, params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # flax's step moved the params
    step = jaxdev.make_train_step(per_example, optax.sgd(LR), jaxdev.Strategy.pmap())
    state = step.init_state(params)
    for i in range(STEPS):
        state, _ = step(state, jaxdev.pmap.unshard_from_pmap(common_utils.shard(data(i))))
    _close(state.params, want)
    state = step.init_state(params)
    batches = jax_utils.prefetch_to_device((common_utils.shard(data(i)) for i in range(STEPS)), 2)
    for batch in batches:
        state, _ = step(state, batch)
    _close(state.params, want)
    assert int(state.step) == STEPS


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_recipes_stacked_batch_is_refused_by_name(name):
    """Was: read as 8 rows of shape (4, ...); 'generic' and 'centering' trained silently
    wrong, the others failed blaming the loss or flax's ScopeParamShapeError."""
    per_example, params, data = MODELS[name]()
    step = jaxdev.make_train_step(per_example, optax.sgd(LR), jaxdev.Strategy.pmap())
    ev = jaxdev.make_eval_step(per_example, jaxdev.Strategy.pmap())
    state = step.init_state(params)
    stacked = common_utils.shard(data(0))
    leaf = "batch['image']" if "image" in stacked else "batch['x']"
    shape = np.shape(stacked["image" if "image" in stacked else "x"])
    for call in (step, step.lower, ev, ev.lower):
        with pytest.raises(jaxdev.ShardingError) as err:
            call(state, stacked)
        text = str(err.value)
        for part in (
            f"{leaf}: shape {shape}",
            f"As rows it is 8 examples of shape {shape[1:]}",
            f"8 devices x 4 rows of shape {shape[2:]}",
            "`flax.training.common_utils.shard`",
            "`step.put_batch(batch)`",
            "`jaxdev.pmap.unshard_from_pmap(batch)` gives the 32 rows",
            "`jax_utils.prefetch_to_device(iterator, 2)`",
        ):
            assert part in text, (part, text)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replicated_params_and_states_are_refused_at_init_state_and_at_the_step(name):
    """Was: init_state took params of shape (8, ...) (a broadcasting model trained them),
    and a replicated flax TrainState died in flax with ScopeParamShapeError."""
    per_example, params, data = MODELS[name]()
    tx = optax.sgd(LR)
    step = jaxdev.make_train_step(per_example, tx, jaxdev.Strategy.pmap(), donate=False)
    flax_state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    batch = data(0)
    fix = r"`flax.jax_utils.unreplicate\(params\)` or `jaxdev.pmap.unstack_from_pmap\(params\)`"
    for stacked in (jax_utils.replicate(params), jaxdev.pmap.stack_for_pmap(params)):
        with pytest.raises(jaxdev.ShardingError, match=rf"(?s)`params` is in `jax.pmap`'s.*{fix}"):
            step.init_state(stacked)
    with pytest.raises(jaxdev.ShardingError, match=r"(?s)stacked layout.*\.step: shape \(8,\)"):
        step.init_state(jax_utils.replicate(flax_state))
    fix = fix.replace("params", "state")
    for first in (False, True):  # the state's first program, or a program traced anew
        if first:
            step(step.init_state(flax_state), batch)
        for state in (jax_utils.replicate(flax_state), jaxdev.pmap.stack_for_pmap(flax_state)):
            with pytest.raises(jaxdev.ShardingError, match=rf"(?s)`state` is in .*{fix}"):
                step(state, batch)
    state, _ = step(step.init_state(jax_utils.unreplicate(jax_utils.replicate(flax_state))), batch)
    assert type(state) is train_state.TrainState  # the fix works


FSDP = jaxdev.make_mesh({"fsdp": 8})
STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(),
    "pmap2": lambda: jaxdev.Strategy.pmap(2),
    "sharded": lambda: jaxdev.Strategy.sharded(),
    "fsdp": lambda: jaxdev.Strategy.sharded(FSDP, rules="fsdp", min_size=0),
}


@pytest.mark.parametrize("strategy", ["pmap", "pmap2", "sharded", "single"])
def test_a_stacked_batch_is_refused_on_every_strategy_and_its_fixes_train(strategy):
    """Was, on single and sharded too: 8 rows of shape (4, 6), a shape-generic loss 4x the
    gradient, silently. Pmap(2): the host's 8 (common_utils.shard's count) read as 8 rows."""
    per_example, params, data = MODELS["generic"]()
    step = jaxdev.make_train_step(per_example, optax.sgd(LR), STRATEGIES[strategy](), donate=False)
    state = step.init_state(params)
    stacked = common_utils.shard(data(0))
    for call in (step, step.lower):
        with pytest.raises(jaxdev.ShardingError, match=r"two ways.*\['x'\]: shape \(8, 4, 6\)"):
            call(state, stacked)
    want, _ = step(state, step.put_batch(data(0)))
    got, _ = step(state, jaxdev.pmap.unshard_from_pmap(stacked))  # stacked: its 32 rows
    _close(got.params, want.params)
    eight = {k: v[:8] for k, v in data(0).items()}  # (8, 6) and (8, 6): either reading
    with pytest.raises(jaxdev.ShardingError, match="reads two ways"):
        step(state, eight)
    step(state, step.put_batch(eight))  # the rows fix: taken as placed
    x, y = eight["x"], eight["y"]
    for rows in ({"x": x, "y": y[:, 0]}, {"x": x, "y": y[:, :1]}):
        step.strategy.check_layout(rows)  # a 1-D leaf, two row counts per device: rows


@pytest.mark.parametrize("strategy", ["single", "sharded"])
def test_flaxs_prefetched_stacked_arrays_are_refused_off_pmap(strategy):
    """Was, sharded: prefetch_to_device's (8, 4, 6) arrays taken as 8 placed rows."""
    per_example, params, data = MODELS["centering"]()
    step = jaxdev.make_train_step(per_example, optax.sgd(LR), STRATEGIES[strategy](), donate=False)
    state = step.init_state(params)
    batch = next(jax_utils.prefetch_to_device(iter([common_utils.shard(data(0))]), 1))
    with pytest.raises(jaxdev.ShardingError, match=r"reads two ways.*unshard_from_pmap"):
        step(state, batch)
    want, _ = step(state, step.put_batch(data(0)))
    got, _ = step(state, step.put_batch(jaxdev.pmap.unshard_from_pmap(batch)))
    _close(got.params, want.params)


@pytest.mark.parametrize("strategy", ["single", "sharded", "fsdp"])
def test_stacked_params_are_refused_on_every_strategy_but_a_rules_own_layout_is_taken(strategy):
    per_example, params, data = MODELS["generic"]()
    step = jaxdev.make_train_step(per_example, optax.sgd(LR), STRATEGIES[strategy]())
    with pytest.raises(jaxdev.ShardingError, match=r"`params` is in `jax.pmap`'s stacked"):
        step.init_state(jax_utils.replicate(params))
    own = {"w": np.ones((8, 6), np.float32)}  # fsdp splits it one row per device
    state = step.init_state(own)
    again = step.init_state(state.params)  # its own layout: taken, as before
    assert again.params["w"].sharding == state.params["w"].sharding
    step(again, {"x": np.ones((16, 8, 6), np.float32), "y": np.ones((16, 8, 6), np.float32)})


@pytest.mark.parametrize("strategy", ["single", "sharded"])
@pytest.mark.parametrize("group", [{"steps_per_call": 2}, {"accumulate": 2}])
def test_stacked_batches_grouped_for_steps_per_call_or_accumulate_are_refused(strategy, group):
    """Was: ``np.stack`` of two ``common_utils.shard`` batches, (2, 8, 4, 6), trained as two
    groups of 8 rows of shape (4, 6), silently (a shape-generic loss). Pmap's grouped raw
    batches lead with the device axis already: nothing to read two ways there."""
    per_example, params, data = MODELS["generic"]()
    step = jaxdev.make_train_step(
        per_example, optax.sgd(LR), STRATEGIES[strategy](), donate=False, **group
    )
    state = step.init_state(params)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[common_utils.shard(data(i)) for i in (0, 1)])
    why = r"(?s)two ways.*\['x'\]: shape \(2, 8, 4, 6\).*from_pmap` to each batch before grouping"
    for call in (step, step.lower):
        with pytest.raises(jaxdev.ShardingError, match=why):
            call(state, stacked)
    rows = jax.tree.map(lambda *xs: np.stack(xs), *[data(i) for i in (0, 1)])  # (2, 32, 6)
    want, _ = step(state, rows)
    fixed = jax.tree.map(lambda *xs: np.stack(xs), *[
        jaxdev.pmap.unshard_from_pmap(common_utils.shard(data(i))) for i in (0, 1)
    ])  # the fix the message names: unshard each batch, then group
    got, _ = step(state, fixed)
    _close(got.params, want.params)


@pytest.mark.parametrize("strategy", ["pmap", "single"])
def test_a_partly_stacked_state_names_a_fix_that_works_and_init_state_checks_every_field(
    strategy,
):
    """Was: a state whose opt_state alone was replicated was told to apply
    `flax.jax_utils.unreplicate(state)`, which cuts the unstacked params to their row 0 and
    fails on the scalar step (IndexError); init_state took a replicated `model_state` (flax's
    batch_stats) or `rng` without a word (the step refused the state it had made)."""
    per_example, params, data = MODELS["generic"]()
    tx = optax.sgd(LR, momentum=0.9)
    step = jaxdev.make_train_step(per_example, tx, STRATEGIES[strategy](), donate=False)
    flax_state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    half = flax_state.replace(opt_state=jax_utils.replicate(flax_state.opt_state))
    for arg, call in (("params", step.init_state), ("state", lambda s: step(s, data(0)))):
        with pytest.raises(jaxdev.ShardingError) as err:
            call(half)
        text = str(err.value)
        assert f"`{arg}` is in `jax.pmap`'s stacked layout" in text, text
        assert "unreplicate(" not in text and "only the leaves below are stacked" in text, text
        assert ".opt_state[0].trace['w']: shape (8, 6)" in text, text
        assert ".params" not in text and ".step" not in text, text
    fixed = half.replace(opt_state=jaxdev.pmap.unstack_from_pmap(half.opt_state))  # as named
    state, _ = step(step.init_state(fixed), data(0))
    assert int(state.step) == 1
    stats = {"mean": np.zeros(3, np.float32)}
    for name, kw in (
        ("model_state", {"model_state": jax_utils.replicate(stats)}),
        ("rng", {"rng": jax_utils.replicate(jax.random.key(0))}),
    ):
        with pytest.raises(jaxdev.ShardingError, match=rf"`{name}` is in `jax.pmap`'s stacked"):
            step.init_state(params, **kw)
