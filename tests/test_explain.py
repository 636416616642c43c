"""explain_memory as a planner (issue 36): no fix for a step that fits, every option it
considered listed (the skipped ones with the reason), a user's remat as an option."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxdev

TX = optax.sgd(0.1)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w0"])
    return jnp.mean((h @ params["w1"] - batch["y"]) ** 2, axis=-1)


def _state(tx=TX):
    params = {"w0": jnp.zeros((64, 256)), "w1": jnp.zeros((256, 4))}
    return jax.eval_shape(lambda: jaxdev.TrainState.create(params, tx))


def _batch(rows: int) -> dict:
    return {
        "x": jax.ShapeDtypeStruct((rows, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((rows, 4), jnp.float32),
    }


def test_a_step_that_fits_gets_no_fix():
    """It proposed remat=True at 15.5 GiB for a step needing 15.0 under a 40 GiB limit."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded())
    why = step.explain_memory(_state(), _batch(64), limit=2**30)
    assert why.fits and any(o.fits for o in why.options)
    assert why.advice() == "" and "fix:" not in why.headline()
    assert why.headline().endswith("available (limit): it fits, nothing to fix")


def test_every_option_considered_is_listed_the_skipped_ones_with_the_reason():
    """accumulate and half_batch were dropped without a word at 1 row per device."""
    one_row = _batch(8)  # 1 row per device
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(), remat=True)
    why = step.explain_memory(_state(optax.adam(0.1)), one_row, limit=2**30)
    skipped = {o.change: o.note for o in why.options if o.what == "skipped"}
    assert skipped == {
        "accumulate": "1 row per device: accumulate=2 needs a multiple of 2 rows per device",
        "remat": "the step has remat=True already",
        "half_batch": "1 row per device: no smaller batch the devices split",
    }
    compiled = [o.change for o in why.options if o.what != "skipped"]
    assert compiled[0] == "Strategy.sharded(mesh, rules='fsdp')" and len(compiled) == 2
    assert why.compiles == 1 + len(compiled)
    text = str(why)
    for change, note in skipped.items():
        assert any(line.split()[:2] == [change, "skipped"] and line.endswith(note)
                   for line in text.splitlines()), (change, text)
    single = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single())
    notes = {o.change: o.note for o in single.explain_memory(_state(), one_row).options}
    assert notes["fsdp"] == "one device: nothing to shard over"
    params = jax.eval_shape(lambda: _state().params)
    ev = jaxdev.make_eval_step(loss_fn).explain_memory(params, one_row, limit=2**30)
    assert {o.change: o.note for o in ev.options if o.what == "skipped"} == {
        "fsdp": "one device: nothing to shard over",  # an eval step runs on one by default
        "accumulate": "an eval step has no gradients to accumulate",
        "remat": "an eval step keeps no activations for a backward pass",
        "offload": "no optimizer state to offload",
    }


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(64, 512, rngs=rngs), nnx.Linear(512, 64, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Deep(nnx.Module):
    def __init__(self, remat=None, rngs=None):
        self.blocks = nnx.List([Block(rngs) for _ in range(6)])
        self.remat = remat

    def __call__(self, x):
        for block in self.blocks:
            x = block(x) if self.remat is None else nnx.remat(block, policy=self.remat)(x)
        return x


def _nnx_step(blocks=None, **options):
    model = nnx.eval_shape(lambda: Deep(blocks, rngs=nnx.Rngs(0)))
    loss = jaxdev.nnx.loss(model, lambda m, b: jnp.mean((m(b["x"]) - b["x"]) ** 2, -1))
    step = jaxdev.make_train_step(loss, TX, jaxdev.Strategy.single(), has_state=True, **options)
    params, rest = jaxdev.nnx.split(model)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(params, TX, model_state=rest))
    return step, state


def test_a_users_remat_is_an_option_per_block_or_as_a_policy():
    """Only remat=True of the whole loss was offered (it adds memory); per-block remat,
    the real saver, lives in model code and could not be offered."""
    step, state = _nnx_step()
    batch = {"x": jax.ShapeDtypeStruct((2048, 64), jnp.float32)}
    policy = jax.checkpoint_policies.nothing_saveable
    per_block, _ = _nnx_step(blocks=policy)
    peaks = {}
    for remat in (per_block, policy):
        why = step.explain_memory(state, batch, limit=2**30, options=("remat",), remat=remat)
        (o,) = why.options
        peaks[o.change] = o.peak
    by_policy = _nnx_step(None, remat=policy)[0]
    followed = {"your `remat` step": per_block, "remat=nothing_saveable": by_policy}
    for change, s in followed.items():  # the figure is the followed change's compiled peak
        assert jaxdev.memory.plan(state, step=s, batch=batch).peak == peaks[change]
    need = why.needed
    assert peaks["your `remat` step"] <= need <= peaks["remat=nothing_saveable"]  # 0.6x on jax 0.12
    with pytest.raises(jaxdev.UsageError, match="`remat` must be True, a `jax.checkpoint_pol"):
        step.explain_memory(state, batch, limit=2**30, options=("remat",), remat="blocks")


def test_explain_and_fit_take_the_steps_own_memory_limit():
    """They ignored `make_train_step(memory_limit=)`: 'no limit known', and fit_memory asked
    for `limit=` on CPU; an explicit `limit=` still wins."""
    tx = optax.sgd(0.1)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create({"w": jnp.ones((256, 256))}, tx))
    batch = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    strategy = jaxdev.Strategy.sharded(jaxdev.make_mesh({"fsdp": 8}))
    loss = lambda p, b: (b @ p["w"]).sum(-1)  # noqa: E731
    step = jaxdev.make_train_step(loss, tx, strategy, memory_limit=2**30)
    why = step.explain_memory(state, batch, options=())
    assert why.limit == 2**30 and "(memory_limit)" in why.headline()
    assert step.explain_memory(state, batch, 2**20, options=()).limit == 2**20
    fit = jaxdev.memory.fit_memory(step, state, batch, max_batch_size=2)
    assert fit.limit == 2**30 and fit.batch_size == 2


PARAMS = {"w0": jax.ShapeDtypeStruct((64, 256), jnp.float32)}


@pytest.mark.parametrize(
    "state, batch, kw, match",
    [
        (None, _batch(8), {}, r"`state` must be a train state for the train step .* got NoneType"),
        ("abc", _batch(8), {}, r"`state` must be a train state .* got 'abc'"),
        (PARAMS, _batch(8), {}, r"`state` must be a train state .* got dict"),
        (_state(), {"x": "abc", "y": 1.0}, {}, r"`batch` leaf \['x'\] is a builtins.str"),
        (_state(), None, {}, r"`batch` is empty \(got None\)"),
        (_state(), _batch(8), {"metrics": 3}, r"`metrics` must be the step's running metrics"),
    ],
)
def test_explain_and_fit_name_the_argument_they_cannot_read(state, batch, kw, match):
    """Each was a raw AttributeError / TypeError / ValueError of the lowering, or (batch None)
    '`batch` leaves disagree on their rows: []'."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded())
    with pytest.raises(jaxdev.JaxdevError, match=match):
        step.explain_memory(state, batch, limit=2**30, options=(), **kw)
    if not kw:  # fit_memory's batch is `example_batch`
        with pytest.raises(jaxdev.JaxdevError, match=match.replace("`batch`", "`example_batch`")):
            jaxdev.memory.fit_memory(step, state, batch, limit=2**30)


def test_a_pmap_step_explains_and_fits_host_rows_as_its_call_takes_them():
    """A pmap step's call (and ``memory.plan``) takes host rows ``(B, ...)`` and splits them
    over its devices; explain_memory and fit_memory read them in pmap's layout
    ``(devices, rows, ...)`` and said '`batch` leaves disagree on their rows: [256, 1024]'."""
    import numpy as np

    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.pmap())
    rows = {"x": np.ones((64, 64), np.float32), "y": np.ones((64, 4), np.float32)}
    why = step.explain_memory(_state(), rows, limit=2**30, options=("half_batch",))
    assert why.needed == jaxdev.memory.plan(_state(), step=step, batch=rows).peak
    assert why.plan["batch"] == 8 * 68 * 4  # 8 rows of 64 + 4 floats per device
    assert [o.change for o in why.options] == ["a batch of 32 rows"] and why.options[0].fits
    fit = jaxdev.memory.fit_memory(step, _state(), rows, limit=2**30, max_batch_size=4)
    assert (fit.batch_size, fit.rows) == (4, 32)
    assert fit.batch["x"].shape == (8, 4, 64) and fit.batch["y"].shape == (8, 4, 4)
    uneven = {"x": np.ones((60, 64), np.float32), "y": np.ones((60, 4), np.float32)}
    with pytest.raises(jaxdev.UsageError, match=r"`batch` has 60 rows .* do not divide"):
        step.explain_memory(_state(), uneven, limit=2**30, options=())
    both = {"x": np.ones((8, 8, 64), np.float32), "y": np.ones((8, 8, 4), np.float32)}
    with pytest.raises(jaxdev.ShardingError, match=r"`batch` reads two ways"):  # as the call
        step.explain_memory(_state(), both, limit=2**30, options=())
