"""Inputs that passed silently or failed with raw JAX errors (issue 19), on every strategy."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev

SGD = optax.sgd(0.1)
STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(8),
    "sharded": lambda: jaxdev.Strategy.sharded(),
    "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
}


def loss(params, batch):
    return (batch["x"] @ params["w"] - batch["y"]) ** 2


def _params():
    return {"w": np.linspace(-1, 1, 4).astype(np.float32)}


def _batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 4)).astype(np.float32),
        "y": rng.normal(size=rows).astype(np.float32),
    }


@pytest.mark.parametrize("door", ["call", "lower", "eval"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_params_dict_or_other_metrics_are_named_not_attribute_errors(name, door):
    """``step(params, batch)`` raised jit's ``AttributeError: 'dict' object has no attribute
    'params'`` from inside the trace, ``step(state, batch, 3)`` (and ``lower``, an eval
    step's call) ``... has no attribute merge``."""
    strategy = STRATEGIES[name]()
    step = jaxdev.make_train_step(loss, SGD, strategy)
    state, batch = step.init_state(_params(), SGD), step.put_batch(_batch())
    state, metrics = step(state, batch)
    call = step.lower if door == "lower" else step
    if door == "eval":
        call = jaxdev.make_eval_step(loss, strategy)
    else:
        for bad in (_params(), None, "abc"):
            with pytest.raises(jaxdev.UsageError, match="`state` must be a train state"):
                call(bad, batch)
    for bad in (3, {"loss": 1.0}):
        with pytest.raises(jaxdev.UsageError, match="`metrics` must be the step's running"):
            call(state, batch, bad)
    state, _ = step(state, batch, metrics)  # the state and metrics it returned still run


@pytest.mark.parametrize("door", ["call", "lower", "eval"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_running_metrics_of_other_names_or_kinds_are_named(name, door):
    """Before: a running Collection with a name the step does not make, or a kind it does not
    make, raised from inside the trace "`Collection.merge` expects `other` to have the names
    ['acc', 'loss']; missing ['acc']" / "`Sum.merge` expects `other` to be a Sum, got Mean":
    neither the argument (`metrics`) nor, for a kind, the metric's name."""
    from jaxdev.metrics import Collection, Mean, Sum

    strategy = STRATEGIES[name]()
    step = jaxdev.make_train_step(loss, SGD, strategy)
    state, batch = step.init_state(_params(), SGD), step.put_batch(_batch())
    call = {"call": step, "lower": step.lower, "eval": jaxdev.make_eval_step(loss, strategy)}
    for bad, got in [({"loss": Mean, "acc": Mean}, "{acc: Mean, loss: Mean}"),
                     ({"loss": Sum}, "{loss: Sum}")]:
        with pytest.raises(jaxdev.MetricError) as err:
            call[door](state, batch, Collection.empty(bad))
        assert "`metrics` must be running metrics of this step" in str(err.value)
        assert f"the step makes {{loss: Mean}}, the `metrics` given hold {got}" in str(err.value)
    state, metrics = step(state, batch, Collection.empty({"loss": Mean}))  # its own: trains
    assert metrics.fetch()["loss"] > 0


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_integer_and_key_leaves_in_the_params_are_named(name):
    """Before: JAX's bare "TypeError: grad requires real- or complex-valued inputs ... but got
    int32" from inside the trace, naming no leaf (a step counter or a PRNG key kept in the
    params)."""
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name]())
    params = {**_params(), "count": np.int32(0), "key": jax.random.key(0)}
    state = step.init_state(params, SGD)
    with pytest.raises(jaxdev.LeafTypeError) as err:
        step(state, step.put_batch(_batch()))
    msg = str(err.value)
    assert "`state.params` has leaves the step cannot differentiate" in msg
    assert "state.params['count']: int32" in msg and "state.params['key']: key<fry>" in msg
    assert "['w']" not in msg and "has_state=True" in msg
    state = step.init_state(_params(), SGD)  # float params: the same step trains
    state, metrics = step(state, step.put_batch(_batch()))
    assert metrics.fetch()["loss"] > 0


@pytest.mark.parametrize("door", ["call", "lower", "eval"])
@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"pmap"}))
def test_a_padded_batch_placed_by_a_pmap_step_is_named_on_the_others(name, door):
    """Before: a pmap step's `put_batch` of 13 rows (a Padded with an (8, 2) mask) given to a
    sharded step raised JAX's bare "ValueError: Incompatible shapes for broadcasting:
    shapes=[(8, 2), (8,), ()]", to a shard_map step a MetricError about `Mean.from_value`'s
    mask, to a single one "reads two ways"; a grouped step's Padded likewise."""
    pmap_step = jaxdev.make_train_step(loss, SGD, STRATEGIES["pmap"]())
    padded = pmap_step.put_batch(_batch(13))
    assert padded.mask.shape == (8, 2)
    strategy = STRATEGIES[name]()
    step = jaxdev.make_train_step(loss, SGD, strategy)
    state = step.init_state(_params(), SGD)
    call = {"call": step, "lower": step.lower, "eval": jaxdev.make_eval_step(loss, strategy)}
    with pytest.raises(jaxdev.UsageError, match=r"`batch` is a Padded whose mask has shape "
                       r"\(8, 2\).*with this step's `put_batch`"):
        call[door](state, padded)
    state, metrics = step(state, step.put_batch(_batch(13)))  # its own put_batch: trains
    assert metrics.fetch()["loss"] > 0


@pytest.mark.parametrize("empty", [{}, [], ()], ids=["dict", "list", "tuple"])
@pytest.mark.parametrize("door", ["call", "lower", "eval"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_batch_with_no_leaves_is_named_on_every_strategy(name, door, empty):
    """Before: JAX's IndexError under single (every door), pmap's "cannot select an axis to
    squeeze" ValueError, a ShardingError "nothing to shard" under sharded (helper-75)."""
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name]())
    state = step.init_state(_params(), SGD)
    call = {"call": step, "lower": step.lower,
            "eval": jaxdev.make_eval_step(loss, STRATEGIES[name]())}
    with pytest.raises(jaxdev.UsageError, match=r"`batch` has no array leaves \(got"):
        call[door](state, empty)
    state, metrics = step(state, step.put_batch(_batch()))  # a batch: trains
    assert metrics.fetch()["loss"] > 0


@pytest.mark.parametrize("tx", [optax.adam, "sgd", 0.1], ids=["uncalled", "name", "number"])
def test_a_tx_that_is_no_transformation_is_named(tx):
    """Before: `AttributeError: 'function' object has no attribute 'init'` at init_state
    (helper-76)."""
    with pytest.raises(jaxdev.UsageError, match=r"`tx` must be an optax GradientTransformation"
                       + (r".*got adam: call it\." if callable(tx) else "")):
        jaxdev.make_train_step(loss, tx)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_flax_train_state_just_works_and_matches_flax(name):
    """Flax's TrainState goes in, the same type comes out, with apply_gradients' numbers."""
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name]())
    state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=SGD)
    want = state
    for i in range(3):
        batch = _batch(seed=i)
        grads = jax.grad(lambda p, b: loss(p, b).mean())(want.params, batch)
        want = want.apply_gradients(grads=grads)
        state, metrics = step(state, step.put_batch(_batch(seed=i)))
    assert type(state) is train_state.TrainState and int(state.step) == 3
    np.testing.assert_allclose(np.asarray(state.params["w"]), want.params["w"], rtol=1e-5)
    ev = jaxdev.make_eval_step(loss, STRATEGIES[name]())
    got = ev(state, ev.put_batch(_batch(rows=13))).fetch()["loss"]
    np.testing.assert_allclose(got, loss(want.params, _batch(rows=13)).mean(), rtol=1e-5)


@pytest.mark.parametrize("name", ["single", "fsdp"])
def test_a_state_the_step_cannot_return_is_refused_at_init_state(name):
    """A state with the state fields but no ``._replace``/``.replace`` is neither taken as
    params (the step would differentiate its step counter) nor copied as a state."""

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class MyState:
        step: jax.Array
        params: dict
        opt_state: object

    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    strategy = (
        jaxdev.Strategy.single()
        if name == "single"
        else jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=0)
    )
    step = jaxdev.make_train_step(loss, SGD, strategy)
    own = MyState(jnp.zeros((), jnp.int32), _params(), SGD.init(_params()))
    with pytest.raises(jaxdev.UsageError, match="`params` is a MyState with `step`"):
        step.init_state(own)


@pytest.mark.parametrize("name", ["pmap", "sharded", "shard_map"])
def test_an_uneven_raw_batch_is_named_with_the_fix(name):
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name]())
    state = step.init_state(_params(), SGD)
    with pytest.raises(jaxdev.UsageError, match=r"13 rows .* 8 devices .* `step.put_batch"):
        step(state, _batch(rows=13))
    step(state, step.put_batch(_batch(rows=13)))  # the fix works


def test_pmap_lower_of_an_uneven_raw_batch_names_put_batch_as_the_call_does():
    """Was: shard_for_pmap's ShardingError, telling to pass `pad=True` (lower has none)."""
    step = jaxdev.make_train_step(loss, SGD, jaxdev.Strategy.pmap(8))
    ev = jaxdev.make_eval_step(loss, jaxdev.Strategy.pmap(8))
    state = step.init_state(_params(), SGD)
    for fn in (step, ev):
        with pytest.raises(jaxdev.UsageError, match=r"13 rows .* 8 devices .* `step.put_batch"):
            fn.lower(state, _batch(rows=13))
        fn.lower(state, fn.put_batch(_batch(rows=13)))  # the fix works


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("rows", [32, 8])
def test_an_even_raw_batch_trains_as_its_put_batch_on_every_strategy(name, rows):
    """Was, under pmap: 32 rows, a bare ValueError ('cannot select an axis to squeeze');
    8 rows, split as 8 devices of one 4-feature row each (the loss's shape refused).
    8 rows on 8 devices stay rows: `y` is 1-D, which `common_utils.shard`'s stacked layout
    never is (a batch that reads both ways is refused: test_pmap_recipe.py)."""
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name](), donate=False)
    ev = jaxdev.make_eval_step(loss, STRATEGIES[name]())
    state = step.init_state(_params(), SGD)
    raw = _batch(rows=rows)
    got, metrics = step(state, raw)
    want, expected = step(state, step.put_batch(raw))
    np.testing.assert_allclose(metrics.fetch()["loss"], expected.fetch()["loss"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.params["w"]), np.asarray(want.params["w"]))
    np.testing.assert_allclose(ev(state, raw).fetch()["loss"], expected.fetch()["loss"], rtol=1e-6)
    placed = step.put_batch(raw)
    assert step.strategy.place_raw(placed) is placed  # a placed batch is taken as it is
    raw_in, placed_in = (step.lower(state, b).args_info for b in (raw, placed))
    assert jax.tree.map(np.shape, raw_in) == jax.tree.map(np.shape, placed_in)  # lowered as run


def test_a_pmap_batch_split_on_a_mesh_with_explicit_axes_trains_as_its_put_batch():
    """Was: the split batch taken as it is, pmap's bare KeyError naming the user's axis."""
    step = jaxdev.make_train_step(loss, SGD, jaxdev.Strategy.pmap(8), donate=False)
    state = step.init_state(_params(), SGD)
    placed = step.put_batch(_batch(rows=24))
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    split = jax.device_put(jax.device_get(placed), NamedSharding(mesh, P("d")))
    _, got = step(state, split)
    _, want = step(state, placed)
    np.testing.assert_allclose(got.fetch()["loss"], want.fetch()["loss"], rtol=1e-6)
    assert step.strategy.place_raw(placed) is placed  # put_batch's layout: the same tree


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_eval_with_deleted_params_names_the_leaves(name):
    ev = jaxdev.make_eval_step(loss, STRATEGIES[name]())
    params = ev.init_state(_params())
    jax.tree.map(lambda x: x.delete(), params)
    with pytest.raises(jaxdev.DeletedArrayError, match=r"state\['w'\].*eval step never deletes"):
        ev(params, ev.put_batch(_batch()))


def test_a_train_step_without_donation_names_deleted_leaves_as_not_its_doing():
    """Before: 'An eval step never deletes its inputs' for a train step."""
    step = jaxdev.make_train_step(loss, SGD, donate=False)
    state = step.init_state(_params(), SGD)
    state.params["w"].delete()
    with pytest.raises(jaxdev.DeletedArrayError, match=r"\['w'\].*train step made with `donate="):
        step(state, step.put_batch(_batch()))

@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_typed_keys_drive_dropout_on_every_strategy(name):
    def noisy(params, batch, rng):
        keep = jax.random.bernoulli(rng, 0.5, batch["y"].shape)
        return loss(params, batch) * keep

    step = jaxdev.make_train_step(noisy, SGD, STRATEGIES[name]())
    state = step.init_state(_params(), SGD, rng=jax.random.key(0))
    assert jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
    state, _ = step(state, step.put_batch(_batch()))
    again = step.init_state(_params(), SGD, rng=jax.random.key(1))
    again, _ = step(again, step.put_batch(_batch()))
    assert jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
    assert not np.allclose(np.asarray(state.params["w"]), np.asarray(again.params["w"]))


class BNModel(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, mask=None):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x, mask=mask)
        return x.sum(-1)


def _bn_step(strategy, pass_mask):
    model = BNModel(axis_name=strategy.collective_axis)

    def bn_loss(params, model_state, batch, **kw):
        mask = kw.get("mask")
        out, new = model.apply(
            {"params": params, **model_state},
            batch["x"],
            mask=None if mask is None else mask[:, None],
            mutable=["batch_stats"],
        )
        return (out - batch["y"]) ** 2, new

    variables = model.init(jax.random.key(0), jnp.zeros((1, 4)))
    step = jaxdev.make_train_step(bn_loss, SGD, strategy, has_state=True, pass_mask=pass_mask)
    state = step.init_state(
        variables["params"], SGD, model_state={"batch_stats": variables["batch_stats"]}
    )
    return step, state


@pytest.mark.parametrize("name", ["pmap", "sharded", "shard_map"])  # one device pads nothing
def test_padded_rows_reaching_batchnorm_warn_once_with_the_choices(name):
    step, state = _bn_step(STRATEGIES[name](), pass_mask=False)
    padded = step.put_batch(_batch(rows=13))
    with pytest.warns(UserWarning, match=r"padded from 13 to 16 rows.*`pass_mask=True`"):
        state, _ = step(state, padded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per step
        state, _ = step(state, step.put_batch(_batch(rows=13)))
        step(state, step.put_batch(_batch(rows=16)))  # an even batch never warns


@pytest.mark.parametrize("name", ["pmap", "shard_map"])
def test_masked_batchnorm_under_per_device_strategies_is_loud(name):
    step, state = _bn_step(STRATEGIES[name](), pass_mask=True)
    with pytest.warns(UserWarning, match="masked BatchNorm averages each device's masked mean"):
        step(state, step.put_batch(_batch(rows=13)))


def test_masked_batchnorm_under_jit_is_exact_and_silent():
    step, state = _bn_step(jaxdev.Strategy.sharded(), pass_mask=True)
    single, ref = _bn_step(jaxdev.Strategy.single(), pass_mask=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = step(state, step.put_batch(_batch(rows=13)))
    ref, _ = single(ref, single.put_batch(_batch(rows=13)))  # one device: nothing padded
    for a, b in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(ref.model_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["sharded", "pmap"])
@pytest.mark.parametrize("groups", [{"accumulate": 2}, {"steps_per_call": 2}])
@pytest.mark.parametrize("rows", [32, 29])
def test_a_batch_not_grouped_for_k_steps_or_micro_batches_is_named_at_call_and_lower(
    strategy, groups, rows
):
    """Was: '`batch` has 3 rows (leaf shape (32, 3))' at the call, and a bare ValueError
    from `lax.scan` in `lower`."""
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[strategy](), donate=False, **groups)
    state = step.init_state(_params(), SGD)
    raw = {"x": np.ones((rows, 4), np.float32), "y": np.ones((rows,), np.float32)}
    for call in (step, step.lower):
        with pytest.raises(jaxdev.UsageError, match=r"takes its rows grouped as \(2,\).*put_batch"):
            call(state, raw)
    if "steps_per_call" in groups:  # K batches stacked by the caller, as put_batch takes them
        raw = {k: np.stack([v, v]) for k, v in raw.items()}
    step(state, step.put_batch(raw))  # grouped (and padded) by put_batch: runs


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_the_two_readings_check_takes_any_tree_order_and_node(name):
    """The check reads one leaf per call (in insertion order, not jax's sorted one): a batch
    reads two ways only if every leaf does, and then the first leaf in jax's order is named."""
    strategy = getattr(jaxdev.Strategy, name)()
    two, one = np.zeros((8, 4, 6), np.float32), np.zeros((8,), np.float32)
    refused = [
        {"z": np.zeros((8, 4)), "a": {"b": [two]}},
        {"a": None, "b": two, "c": (two, two)},
        train_state.TrainState(step=two, apply_fn=None, params=two, tx=None, opt_state=[two]),
        [{}, two],
    ]
    for batch in refused:
        with pytest.raises(jaxdev.ShardingError, match=r"reads two ways.*: shape \(8, 4"):
            strategy.check_layout(batch)
    for batch in ({"z": one, "a": two}, {"a": two, "z": one}, [None, {"y": one}, two], {}):
        strategy.check_layout(batch)  # a 1-D leaf anywhere: rows


@pytest.mark.parametrize("placed_by", ["shard_batch", "sharded put_batch"])
def test_pmap_takes_rows_placed_one_per_device_with_a_1d_leaf_as_rows(placed_by):
    """Was: 8 rows placed one per device (jaxdev.shard_batch, a sharded step's put_batch)
    read as pmap's split layout, every label a scalar: ShardingError 'scalar leaves'. A leaf
    with no second axis, or two per-device row counts, cannot be that layout: rows."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 6)).astype(np.float32), "y": rng.normal(size=8)}
    batch["y"] = batch["y"].astype(np.float32)
    step = jaxdev.make_train_step(
        lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2,
        optax.sgd(0.1),
        jaxdev.Strategy.pmap(),
        donate=False,
    )
    state = step.init_state({"w": np.ones(6, np.float32)})
    want, _ = step(state, step.put_batch(batch))
    place = {
        "shard_batch": lambda b: jaxdev.shard_batch(b, jaxdev.data_mesh()),
        "sharded put_batch": jaxdev.Strategy.sharded().put_batch,
    }[placed_by]
    got, metrics = step(state, place(batch))
    assert int(metrics["loss"].count) == 8
    np.testing.assert_allclose(got.params["w"], want.params["w"], rtol=1e-6)


@pytest.mark.parametrize("n", [8, 4])
def test_pmap_lower_of_shapes_not_split_over_its_devices_is_named(n):
    """Was JAX's raw ValueError 'cannot select an axis to squeeze out which has size not
    equal to one' for rows (32, 6), and for common_utils.shard's (8, 4, 6) under pmap(4)."""
    step = jaxdev.make_train_step(
        lambda p, b: jnp.sum((b["x"] * p["w"] - b["y"]) ** 2, axis=-1),
        optax.sgd(0.1),
        jaxdev.Strategy.pmap(n),
    )
    state = step.init_state({"w": np.ones(6, np.float32)})

    def shapes(*shape):
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32) for k in "xy"}

    bad = [(32, 6)] + ([(8, 4, 6)] if n == 4 else [])
    for shape in bad:
        with pytest.raises(jaxdev.ShardingError, match=rf"(?s)split over its {n} devices.*"
                           rf"ShapeDtypeStruct\(\({n}, B // {n}, \.\.\.\).*\['x'\]: shape"):
            step.lower(state, shapes(*shape))
    step.lower(state, shapes(n, 32 // n, 6)).compile()  # the split shapes, as before


@pytest.mark.parametrize("kind", ["train", "eval"])
def test_a_one_device_step_runs_outside_a_set_mesh_whose_abstract_mesh_is_emptied(kind):
    """Under ``jax.set_mesh(mesh)`` with ``use_abstract_mesh(AbstractMesh((), ()))`` inside
    (a mesh set, its abstract mesh emptied), a one-device step's later calls ran under the
    8-device mesh since 72167d3 (the bare call asks get_abstract_mesh, not get_mesh): JAX's
    raw ValueError 'Received incompatible devices for jitted computation' from the second
    call on. Its first call, and every call before 72167d3, ran outside the mesh."""

    def make():
        if kind == "train":
            return jaxdev.make_train_step(loss, SGD, jaxdev.Strategy.single(3))
        return jaxdev.make_eval_step(loss, jaxdev.Strategy.single(3))

    def run(ctx):
        step = make()
        state = step.init_state(_params(), SGD) if kind == "train" else step.init_state(_params())
        losses = []
        for i in range(3):
            with ctx():
                out = step(state, _batch(seed=i))
            state, metrics = out if kind == "train" else (state, out)
            losses.append(float(metrics.fetch()["loss"]))
        return losses, state

    def emptied():
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(jaxdev.data_mesh()))
        stack.enter_context(jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())))
        return stack

    want, _ = run(contextlib.nullcontext)
    got, state = run(emptied)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert {d.id for x in jax.tree.leaves(state) for d in x.devices()} == {3}


@pytest.mark.parametrize("placed_by", ["shard_batch pad", "sharded put_batch", "mask on device 2"])
def test_a_padded_batch_placed_otherwise_trains_under_pmap_or_is_named(placed_by):
    """A Padded batch laid out otherwise than pmap's put_batch -- jaxdev.shard_batch(pad=True)
    or a sharded step's put_batch (13 rows padded to 16, placed one per device), or pmap's own
    put_batch with its mask committed to one device -- was JAX's raw ValueError ('cannot
    select an axis to squeeze out', 'Sharding passed to jit does not match'), where the same
    rows unpadded train (test_pmap_takes_rows_placed_one_per_device_with_a_1d_leaf_as_rows).
    It trains as pmap's put_batch of the rows, or a named error says what to do."""
    step = jaxdev.make_train_step(loss, SGD, jaxdev.Strategy.pmap(), donate=False)
    state = step.init_state(_params())
    rows = _batch(rows=13)
    want, _ = step(state, step.put_batch(rows))
    place = {
        "shard_batch pad": lambda: jaxdev.shard_batch(rows, jaxdev.data_mesh(), pad=True),
        "sharded put_batch": lambda: jaxdev.Strategy.sharded().put_batch(rows),
        "mask on device 2": lambda: (
            lambda p: p._replace(mask=jax.device_put(np.asarray(p.mask), jax.devices()[2]))
        )(step.put_batch(rows)),
    }[placed_by]
    try:
        got, metrics = step(state, place())
    except jaxdev.JaxdevError as err:  # named: the fix is in the message
        assert "put_batch" in str(err)
        return
    assert int(metrics["loss"].count) == 13
    np.testing.assert_allclose(got.params["w"], want.params["w"], rtol=1e-6)


TRANSFORMS = {
    "jit": lambda call, state, batch: jax.jit(call)(state, batch),
    "jit of a closure": lambda call, state, batch: jax.jit(lambda: call(state, batch))(),
    "grad": lambda call, state, batch: jax.grad(
        lambda w: jnp.sum(jax.tree.leaves(call(state.replace(params={"w": w}), batch))[-1])
    )(state.params["w"]),
    "vmap": lambda call, state, batch: jax.vmap(lambda b: call(state, b))(
        jax.tree.map(lambda x: jnp.stack([x, x]), batch)
    ),
}


@pytest.mark.parametrize("kind", ["train", "eval"])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_step_called_inside_a_jax_transformation_is_named_and_keeps_working(
    name, transform, kind
):
    """A step called inside jax.jit / grad / vmap raised JAX's raw ConcretizationTypeError
    (its tracers reached the step's placement and checks). It names the traced leaves and
    the fix; the step then trains on concrete arrays as a fresh step does (SGD)."""
    make = jaxdev.make_train_step if kind == "train" else jaxdev.make_eval_step
    args = (loss, SGD) if kind == "train" else (loss,)
    step, fresh = make(*args, STRATEGIES[name]()), make(*args, STRATEGIES[name]())
    state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=SGD)
    batch = _batch()
    with pytest.raises(jaxdev.UsageError) as err:
        TRANSFORMS[transform](step, state, batch)
    message = str(err.value)
    assert "call it outside any transformation" in message
    if transform != "jit of a closure":  # nothing traced reaches the step: no leaf to name
        assert "traced leaf/leaves: " in message
        assert ("state.params['w']" if transform == "grad" else "batch['x']") in message
    got = step(state, step.put_batch(batch))
    want = fresh(state, fresh.put_batch(batch))
    for a, b in zip(jax.tree.leaves(jaxdev.to_host(got)), jax.tree.leaves(jaxdev.to_host(want))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("where", ["batch", "a later batch", "state"])
@pytest.mark.parametrize("kind", ["train", "eval"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_host_values_jax_would_truncate_are_named_in_a_raw_batch_or_state(name, kind, where):
    """A raw numpy batch (not put_batch'ed) or a state of numpy leaves with int64 values past
    int32 (x64 off) trained on the truncated values without a word under single, sharded
    and shard_map (jit's implicit transfer), and a batch signature seen before skipped the
    check on later calls. Each is a LeafValueError naming the leaf, as put_batch's is."""
    args = (loss, SGD) if kind == "train" else (loss,)
    step = (jaxdev.make_train_step if kind == "train" else jaxdev.make_eval_step)(
        *args, STRATEGIES[name]()
    )
    state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=SGD)
    batch = {**_batch(), "i": np.arange(16, dtype=np.int64)}  # int64 values that fit: fine
    if where == "a later batch":  # then the same signature on the fast path
        for _ in range(2):
            out = step(state, batch)
            state = out[0] if kind == "train" else state
    huge = np.arange(2**40, 2**40 + 16, dtype=np.int64)
    if where == "state":
        state, arg, leaf = state.replace(params={**state.params, "i": huge[:4]}), "state", "['i']"
    else:
        batch, arg, leaf = {**batch, "i": huge}, "batch", "['i']"
    with pytest.raises(jaxdev.LeafValueError, match=rf"`{arg}` leaf .*{re.escape(leaf)}: int64"):
        step(state, batch)


@pytest.mark.parametrize("kind", ["train", "eval"])
def test_a_tracer_leaked_into_the_state_is_named_as_leaked(kind):
    """A tracer kept from an earlier jax.jit and passed at top level was told it was called
    inside a transformation (and before that, JAX's raw ConcretizationTypeError)."""
    args = (loss, SGD) if kind == "train" else (loss,)
    step = (jaxdev.make_train_step if kind == "train" else jaxdev.make_eval_step)(*args)
    leaked = []
    jax.jit(lambda w: leaked.append(w) or w)(jnp.ones(4))
    state = train_state.TrainState.create(apply_fn=None, params={"w": leaked[0]}, tx=SGD)
    leak = r"state\.params\['w'\], but no JAX transformation is"
    with pytest.raises(jaxdev.UsageError, match=leak):
        step(state, _batch())


@pytest.mark.parametrize("method", ["init_state", "lower", "explain_memory"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_step_method_inside_jax_jit_is_named(name, method):
    """flax's `jax.jit(create_train_state)` with `step.init_state` inside raised JAX's raw
    "`get_mesh` can only be used outside of `jax.jit`" ValueError; `lower` and
    `explain_memory` raw ConcretizationTypeError / AttributeError."""
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name]())
    state = step.init_state(_params())
    calls = {
        "init_state": lambda w: step.init_state({"w": w}),
        "lower": lambda w: step.lower(state, _batch()),
        "explain_memory": lambda w: step.explain_memory(state, _batch(), limit=2**30),
    }
    with pytest.raises(jaxdev.UsageError, match=rf"`step.{method}` was called inside a JAX"):
        jax.jit(calls[method])(jnp.ones(4))


@pytest.mark.parametrize("strategy", ["single", "pmap", "sharded"])
def test_a_new_state_at_a_freed_states_address_is_checked(strategy):
    """The step knows the state it saw last by its id: a params dict built per call
    (``ev({"w": w}, b)``) is freed after the call, and CPython gives the next dict its
    address. A state of other leaves there skipped its checks: an int64 past int32 was
    truncated silently (5.0, not a LeafValueError)."""
    ev = jaxdev.make_eval_step(lambda p, b: b["x"][:, 0] * p["w"].sum(),
                               getattr(jaxdev.Strategy, strategy)())
    batch = ev.put_batch({"x": np.ones((16, 4), np.float32)})
    given = {"w": jnp.ones((4,))}
    ev(given, batch)
    ev(given, batch)
    address = id(given)
    del given
    kept = []
    for _ in range(10_000):  # bounded: CPython hands a freed address out again at once
        kept.append({"w": np.array([2**40 + 5, 0, 0, 0])})
        if id(kept[-1]) == address:  # (none when the step keeps what it saw alive)
            break
    with pytest.raises(jaxdev.LeafValueError, match=r"\['w'\]"):
        ev(kept[-1], batch)


@pytest.mark.parametrize("strategy", ["single", "pmap", "sharded"])
def test_a_train_state_at_a_freed_states_address_is_checked(strategy):
    """Another state object at the address of the state the step returned (freed): it was
    taken for it, its checks skipped (a host int64 step counter past int32 truncated). Now
    the returned state is also known by its step counter (a weak reference)."""
    step = jaxdev.make_train_step(
        lambda p, b: b["x"] @ p["w"], optax.sgd(0.1), getattr(jaxdev.Strategy, strategy)()
    )
    batch = step.put_batch({"x": np.ones((16, 4), np.float32)})
    state, metrics = step(step.init_state({"w": jnp.ones((4,))}), batch)
    fake = state._replace(step=np.int64(2**40 + 5))
    step._last = (id(fake), *step._last[1:])  # private: as if fake sat at its freed address
    with pytest.raises(jaxdev.LeafValueError, match="step"):
        step(fake, batch, metrics)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
@pytest.mark.parametrize("strategy", ["single", "pmap", "sharded"])
def test_a_loops_call_closed_over_inside_an_eager_transformation_is_named(strategy, transform):
    """A step called (its state and batch closed over) inside eager ``jax.vmap``/``grad`` on
    a call the fast path takes: it ran for real and donated the state under single and pmap
    (review of the fast path); named as inside a transformation, as on the checked path."""
    step = jaxdev.make_train_step(
        lambda p, b: b["x"] @ p["w"], optax.sgd(0.1), getattr(jaxdev.Strategy, strategy)()
    )
    batch = step.put_batch({"x": np.ones((16, 4), np.float32)})
    state, metrics = step(step.init_state({"w": jnp.ones((4,))}), batch)
    for _ in range(2):
        state, metrics = step(state, batch, metrics)

    def inside(x):
        step(state, batch, metrics)
        return x.sum()

    with pytest.raises(jaxdev.UsageError, match="inside a JAX transformation"):
        getattr(jax, transform)(inside)(jnp.ones(3))
    state, metrics = step(state, batch, metrics)  # not donated: it trains on
    assert int(state.step) == 4


def test_a_loop_under_the_users_set_mesh_takes_the_fast_path(monkeypatch):
    """A one-device step in a loop under the user's ``jax.set_mesh`` (the current JAX idiom)
    ran its checks at every call (review of the fast path: 1.7-2x slower a call)."""
    from jaxdev.train import _step

    step = jaxdev.make_train_step(lambda p, b: b["x"] @ p["w"], optax.sgd(0.1))
    batch = step.put_batch({"x": np.ones((16, 4), np.float32)})
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    state, metrics = step(step.init_state({"w": jnp.ones((4,))}), batch)
    with jax.set_mesh(mesh):
        for _ in range(2):
            state, metrics = step(state, batch, metrics)
        checked, prepare = [], _step._Step._prepare
        spy = lambda s, *a: checked.append(1) or prepare(s, *a)  # noqa: E731
        monkeypatch.setattr(_step._Step, "_prepare", spy)
        for _ in range(3):
            state, metrics = step(state, batch, metrics)
    assert checked == [] and int(state.step) == 6


def test_an_eval_state_is_known_by_its_structure_and_any_concrete_leaf():
    """An eval step's state of the same leaves: a typed PRNG key leaf is a concrete array (it
    was never taken as known: checked at every call); a dict renamed in place, the same
    leaves, is another structure (it was taken as known: jit retraced it unchecked)."""

    ev = jaxdev.make_eval_step(lambda p, b: b["x"] @ p["w"])
    batch = ev.put_batch({"x": np.ones((16, 4), np.float32)})
    params = {"w": jnp.ones((4,)), "key": jax.random.key(0)}
    ev(params, batch)
    assert ev._is_last(params, ev._last[1])
    params["v"] = params.pop("w")  # the same leaves under another name
    assert not ev._is_last(params, ev._last[1])


def test_a_freed_returned_state_is_not_matched_by_an_object_without_a_step():
    """Once the state a train step returned is freed, its weak reference is dead: an object
    without ``.step`` at its address read ``None is None`` (review of the fast path)."""
    step = jaxdev.make_train_step(lambda p, b: b["x"] @ p["w"], optax.sgd(0.1))
    batch = step.put_batch({"x": np.ones((16, 4), np.float32)})
    state, _ = step(step.init_state({"w": jnp.ones((4,))}), batch)
    last = step._last
    del state
    assert not step._is_last(({"w": jnp.ones(4)}, 1, 2), last[1])
