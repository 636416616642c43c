"""Training with sharded params: FSDP, tensor parallel rules and flax metadata.

Every rule set must give the replicated run's parameters, and the
replicated run must give a hand-written optax loop's (jax.jit +
value_and_grad + tx.update on one device, the way Flax's examples write it).
Plain SGD (scale-sensitive: Adam would hide a gradient N times too large).

Tolerance: ``rtol=1e-5, atol=1e-6`` on parameters after 20 steps (float32
sums reassociated across 8 devices and across the gathered shards).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev._report import human_bytes

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS, BATCH, FEATURES, HIDDEN, CLASSES = 20, 32, 32, 64, 16
SGD = optax.sgd(0.1)


def assert_trees_close(a, b, **tol):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL))


def _mesh(axes):
    return jaxdev.make_mesh(axes)


# ---------------------------------------------------------------- models


def _partitioned(names):
    return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class MLP(nn.Module):
    """Dense(32 -> 64) -> relu -> Dense(64 -> 16); both kernels >= 1024 elements."""

    annotate: bool = False

    @nn.compact
    def __call__(self, x):
        k0 = _partitioned((None, "model")) if self.annotate else nn.initializers.lecun_normal()
        k1 = _partitioned(("model", None)) if self.annotate else nn.initializers.lecun_normal()
        x = nn.relu(nn.Dense(HIDDEN, kernel_init=k0)(x))
        return nn.Dense(CLASSES, kernel_init=k1)(x)


MODEL = MLP()


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


def _params(annotate=False):
    return MLP(annotate).init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]


def _data(steps=STEPS, rows=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, rows, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(steps, rows)).astype(np.int32)
    return [{"x": x[i], "y": y[i]} for i in range(steps)]


def _hand_written(params, batches, loss=loss_fn):
    """Flax-example style: jax.jit + value_and_grad + tx.update, on one device."""
    opt = SGD.init(params)

    @jax.jit
    def step(params, opt, batch):
        def obj(p):
            return loss(p, batch)[0].mean()

        _, grads = jax.value_and_grad(obj)(params)
        updates, opt = SGD.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    for batch in batches:
        params, opt = step(params, opt, batch)
    return params


def _train(strategy, params, batches, tx=SGD, loss=loss_fn, **kw):
    step = jaxdev.make_train_step(loss, tx, strategy, has_aux=True, **kw)
    state, metrics = step.init_state(params, tx), None
    for batch in batches:
        state, metrics = step(state, step.put_batch(batch), metrics)
    return state, metrics.fetch()


TP_RULES = [("Dense_0/kernel", P(None, "model")), ("Dense_1/kernel", P("model", None))]

SHARDED = {
    "fsdp_data2_fsdp4": lambda: jaxdev.Strategy.sharded(
        _mesh({"data": 2, "fsdp": 4}), rules="fsdp"
    ),
    "fsdp_1d": lambda: jaxdev.Strategy.sharded(jaxdev.data_mesh(), rules="fsdp"),
    "tensor_parallel_regex": lambda: jaxdev.Strategy.sharded(
        _mesh({"data": 2, "model": 4}), rules=TP_RULES
    ),
    "flax_linen": lambda: jaxdev.Strategy.sharded(_mesh({"data": 2, "model": 4}), rules="flax"),
}


@pytest.fixture(scope="module")
def replicated():
    batches = _data()
    hand = _hand_written(_params(), batches)
    state, metrics = _train(jaxdev.Strategy.sharded(), _params(), batches)
    assert_trees_close(state.params, hand)
    return state.params, metrics


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_params_give_the_replicated_parameters(replicated, name):
    ref_params, ref_metrics = replicated
    strategy = SHARDED[name]()
    state, metrics = _train(strategy, _params(annotate=name == "flax_linen"), _data())
    assert int(state.step) == STEPS
    assert_trees_close(state.params, ref_params)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    kernel = state.params["Dense_0"]["kernel"]
    want = P(None, "fsdp") if name == "fsdp_data2_fsdp4" else P(None, "data")
    if name in ("tensor_parallel_regex", "flax_linen"):
        want = P(None, "model")
    assert kernel.sharding.spec == want, kernel.sharding


class NNXMLP(nnx.Module):
    def __init__(self, rngs, annotate=True):
        init = nnx.initializers.lecun_normal()
        k0 = nnx.with_partitioning(init, (None, "model")) if annotate else init
        k1 = nnx.with_partitioning(init, ("model", None)) if annotate else init
        self.up = nnx.Linear(FEATURES, HIDDEN, kernel_init=k0, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, CLASSES, kernel_init=k1, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def test_nnx_sharding_metadata_gives_the_replicated_parameters():
    mesh = _mesh({"data": 2, "model": 4})
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param)

    def nnx_loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses, {}

    batches = _data(steps=8)
    plain = jax.tree.map(lambda x: np.asarray(x), params)  # host copy, no mesh
    hand = _hand_written(plain, batches, nnx_loss)
    rep, _ = _train(jaxdev.Strategy.sharded(), params, batches, loss=nnx_loss)
    flax, _ = _train(jaxdev.Strategy.sharded(mesh, rules="flax"), params, batches, loss=nnx_loss)
    assert isinstance(flax.params, nnx.State)
    assert flax.params["up"]["kernel"][...].sharding.spec == P(None, "model")
    assert flax.params["down"]["kernel"][...].sharding.spec == P("model", None)
    assert_trees_close(rep.params, hand)
    assert_trees_close(flax.params, rep.params)


# ---------------------------------------------------------------- placement and donation


def _per_device_bytes(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_params_and_adam_state_really_are_sharded():
    tx = optax.adam(1e-3)
    strategy = jaxdev.Strategy.sharded(jaxdev.data_mesh(), rules="fsdp")
    state, _ = _train(strategy, _params(), _data(steps=2), tx=tx)
    kernels = [state.params["Dense_0"]["kernel"], state.params["Dense_1"]["kernel"]]
    adam = state.opt_state[0]
    for tree in (state.params, adam.mu, adam.nu):
        assert tree["Dense_0"]["kernel"].sharding.spec == P(None, "data")
        assert tree["Dense_1"]["kernel"].sharding.spec == P("data", None)
        assert tree["Dense_0"]["bias"].sharding.is_fully_replicated  # 64 < min_size
    assert adam.count.sharding.is_fully_replicated and state.step.sharding.is_fully_replicated
    big = sum(k.nbytes for k in kernels)
    per_device = sum(k.addressable_shards[0].data.nbytes for k in kernels)
    assert per_device == big // 8
    small = sum(x.nbytes for x in jax.tree.leaves(state.params)) - big
    assert _per_device_bytes(state.params) == big // 8 + small
    assert _per_device_bytes(adam.mu) == big // 8 + small


def test_donation_deletes_the_old_state_not_the_callers_params():
    params = jax.device_put(_params(), jax.devices()[0])
    strategy = jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
    step = jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True)
    state = step.init_state(params, SGD)
    batch = step.put_batch(_data(steps=1)[0])
    new, _ = step(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    with pytest.raises(jaxdev.DeletedArrayError, match=r"state\.params\['Dense_0'\]"):
        step(state, batch)
    step(new, batch)


def test_uneven_batch_is_padded_and_padded_rows_never_count():
    [batch] = _data(steps=1, rows=29, seed=3)  # 29 rows over data x fsdp = 8 ways
    exact, _ = _train(jaxdev.Strategy.single(), _params(), [batch])
    strategy = jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
    step = jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True)
    placed = step.put_batch(batch)
    assert isinstance(placed, jaxdev.Padded) and placed.size == 29 and placed.mask.shape == (32,)
    assert placed.batch["x"].sharding.spec == P(("data", "fsdp"))
    state, metrics = step(step.init_state(_params(), SGD), placed)
    assert_trees_close(state.params, exact.params)
    losses, aux = loss_fn(_params(), batch)
    out = metrics.fetch()
    np.testing.assert_allclose(out["loss"], float(losses.mean()), rtol=1e-5)
    np.testing.assert_allclose(out["accuracy"], float(aux["accuracy"].mean()), rtol=1e-5)


@pytest.mark.parametrize("rows", [32, 29])
def test_steps_per_call_and_accumulate_under_fsdp(replicated, rows):
    batches = _data(steps=4, rows=rows, seed=1)
    ref, _ = _train(jaxdev.Strategy.sharded(), _params(), batches)
    strategy = jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
    grouped = [jax.tree.map(lambda *xs: np.stack(xs), *batches[i : i + 2]) for i in (0, 2)]
    k, _ = _train(strategy, _params(), grouped, steps_per_call=2)
    assert int(k.step) == 4
    assert_trees_close(k.params, ref.params)
    acc, _ = _train(strategy, _params(), batches, accumulate=2)
    assert_trees_close(acc.params, ref.params)
    assert acc.params["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")


class WideBN(nn.Module):
    """Dense -> BatchNorm over 1024 features (statistics big enough to shard) -> Dense."""

    @nn.compact
    def __call__(self, x, mask=None):
        x = nn.Dense(1024)(x)
        x = nn.BatchNorm(use_running_average=False)(x, mask=None if mask is None else mask[:, None])
        return nn.Dense(CLASSES)(nn.relu(x))


def _bn_loss(params, model_state, batch, mask=None):
    logits, new_state = WideBN().apply(
        {"params": params, **model_state}, batch["x"], mask=mask, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), new_state


def test_model_state_batchnorm_under_fsdp():
    variables = WideBN().init(jax.random.key(0), jnp.zeros((2, FEATURES)))
    batches = _data(steps=3, rows=29, seed=2)
    out = {}
    for name, strategy in (
        ("replicated", jaxdev.Strategy.sharded()),
        ("fsdp", jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp")),
    ):
        step = jaxdev.make_train_step(_bn_loss, SGD, strategy, has_state=True, pass_mask=True)
        state = step.init_state(
            variables["params"], SGD, model_state={"batch_stats": variables["batch_stats"]}
        )
        for batch in batches:
            state, _ = step(state, step.put_batch(batch))
        out[name] = state
    stats = out["fsdp"].model_state["batch_stats"]["BatchNorm_0"]
    assert stats["mean"].sharding.spec == P("fsdp")
    assert_trees_close(out["fsdp"].params, out["replicated"].params)
    assert_trees_close(out["fsdp"].model_state, out["replicated"].model_state)


# ---------------------------------------------------------------- lower and memory


def test_lower_accepts_shapes_and_matches_the_call():
    strategy = jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
    step = jaxdev.make_train_step(loss_fn, optax.adam(1e-3), strategy, has_aux=True)
    state = step.init_state(_params(), optax.adam(1e-3))
    batch = step.put_batch(_data(steps=1)[0])
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    analysis = step.lower(shapes, batch).compile().memory_analysis()
    kernels = _per_device_bytes(state.params) + _per_device_bytes(state.opt_state)
    assert analysis.argument_size_in_bytes >= kernels
    with jaxdev.count_transfers() as counter:
        step(state, batch)
    assert counter.compiles == 0  # lower().compile() built the very program the call runs


def test_memory_limit_raises_before_anything_runs():
    strategy = jaxdev.Strategy.sharded(jaxdev.data_mesh())
    step = jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True, memory_limit=100)
    state = step.init_state(_params(), SGD)
    with pytest.raises(jaxdev.MemoryPlanError) as err:
        step(state, step.put_batch(_data(steps=1)[0]))
    text = str(err.value)
    assert "the train step needs" in text and "per device" in text
    assert "100 B available (memory_limit)" in text
    assert "Fix: none of the changes compiled below fits in 100 B" in text  # the table's verdict
    assert "Nothing ran" in text
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nothing ran
    assert isinstance(err.value, MemoryError)
    roomy = jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True, memory_limit=2**30)
    new, _ = roomy(state, roomy.put_batch(_data(steps=1)[0]))
    assert int(new.step) == 1
    with pytest.raises(jaxdev.UsageError, match="`memory_limit` must be a number of bytes per"):
        jaxdev.make_train_step(loss_fn, SGD, memory_limit=-1)


# ---------------------------------------------------------------- errors


def test_bad_inputs():
    mesh = _mesh({"data": 2, "fsdp": 4})
    with pytest.raises(jaxdev.UsageError, match="`shard_map`=True trains replicated params only"):
        jaxdev.Strategy.sharded(mesh, rules="fsdp", shard_map=True)
    with pytest.raises(jaxdev.ShardingError, match="`axis`='batch' is not an axis of the mesh"):
        jaxdev.Strategy.sharded(mesh, axis="batch", rules="fsdp")
    with pytest.raises(jaxdev.ShardingError, match="every axis of the mesh"):
        jaxdev.Strategy.sharded(_mesh({"model": 8}), rules=TP_RULES)
    rules = [("Dense_0/kernel", P(None, "tensor"))]
    strategy = jaxdev.Strategy.sharded(mesh, rules=rules)
    assert strategy.rules == (("Dense_0/kernel", P(None, "tensor")),)  # stored hashably
    hash(strategy)
    step = jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True)
    with pytest.raises(jaxdev.ShardingError, match=r"Dense_0.*kernel.*\(32, 64\)"):
        step.init_state(_params(), SGD)
    # a bad leaf is named as the `params` it came in (the step's init_state argument)
    step = jaxdev.make_train_step(
        lambda p, b: jnp.sum(p["w"]), SGD, jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=0)
    )
    with pytest.raises(jaxdev.LeafValueError, match=r"^`params` leaf \['n'\]: int64"):
        step.init_state({"w": jnp.ones((8, 4)), "n": np.array(2**40)})
    dead = jnp.ones((8, 4))
    dead.delete()
    with pytest.raises(jaxdev.DeletedArrayError, match="^`params` has 1 deleted"):
        step.init_state({"w": dead})


def test_strategy_takes_the_rules_keyword_and_options_of_param_shardings():
    mesh = _mesh({"data": 2, "fsdp": 4})
    params = _params()
    # replication is 'replicate'; the leaves named are the params' (was "`tree`")
    with pytest.raises(jaxdev.ShardingError, match="shards no leaf of `params`.*=1000000000 "):
        jaxdev.make_train_step(
            loss_fn, SGD, jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=10**9), has_aux=True
        ).init_state(params, SGD)
    for options in ({"min_size": 0}, {"min_size": 64}, {"fsdp_axis": "data"}):
        strategy = jaxdev.Strategy.sharded(mesh, rules="fsdp", **options)
        assert strategy.options == options
        state = jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True).init_state(params, SGD)
        want = jaxdev.param_shardings(params, mesh, "fsdp", **options)
        got = jax.tree.map(lambda x: x.sharding, state.params)
        assert jax.tree.leaves(got) == jax.tree.leaves(want), options  # the step obeys them
        p = jaxdev.memory.plan(
            state, step=jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True)
        )
        assert (
            p.total == jaxdev.memory.plan(state, mesh, "fsdp", **options).total
        )  # and so does plan
    with pytest.raises(jaxdev.ShardingError, match="`min_size` must be an int >= 0"):
        jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=-1)
    with pytest.raises(jaxdev.ShardingError, match="`fsdp_axis`='model' is not an axis"):
        jaxdev.Strategy.sharded(mesh, rules="fsdp", fsdp_axis="model")
    with pytest.warns(DeprecationWarning, match="is now `rules="):
        old = jaxdev.Strategy.sharded(mesh, params="fsdp")
    assert old.rules == "fsdp"
    with pytest.raises(jaxdev.UsageError, match="pass the params rules once"):
        jaxdev.Strategy.sharded(mesh, rules="fsdp", params="fsdp")


def test_batch_axes_default_to_every_non_model_axis():
    assert jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp").axis == (
        "data",
        "fsdp",
    )
    tp = jaxdev.Strategy.sharded(_mesh({"data": 2, "model": 4}), rules=TP_RULES)
    assert tp.axis == "data" and tp.n_devices == 2
    assert jaxdev.Strategy.sharded(jaxdev.data_mesh(), rules="fsdp").n_devices == 8


def test_rng_and_eval_step_under_fsdp():
    def noisy_loss(params, batch, rng):
        noise = 0.0 * jax.random.normal(rng, (batch["x"].shape[0], CLASSES))
        logits = MODEL.apply({"params": params}, batch["x"]) + noise
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    strategy = jaxdev.Strategy.sharded(_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
    step = jaxdev.make_train_step(noisy_loss, SGD, strategy)
    state = step.init_state(_params(), SGD, rng=jax.random.key(1))
    assert state.rng.sharding.is_fully_replicated
    for batch in _data(steps=2):
        state, _ = step(state, step.put_batch(batch))
    ev = jaxdev.make_eval_step(lambda p, b: loss_fn(p, b)[0], strategy)
    [batch] = _data(steps=1, rows=21, seed=9)
    got = ev(state.params, ev.put_batch(batch)).fetch()["loss"]
    want = float(loss_fn(jaxdev.to_host(state.params), batch)[0].mean())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")


def test_memory_advice_works_when_followed_on_a_data_x_model_mesh():
    """The step's advice is its compiled fsdp option, and Strategy.sharded(mesh, rules='fsdp')
    runs it."""
    mesh = _mesh({"data": 2, "model": 4})
    followed = jaxdev.make_train_step(
        loss_fn, SGD, jaxdev.Strategy.sharded(mesh, rules="fsdp"), has_aux=True
    )
    loose = jaxdev.make_train_step(loss_fn, SGD, jaxdev.Strategy.sharded(mesh), has_aux=True)
    state = loose.init_state(_params(), SGD)
    batch = loose.put_batch(_data(steps=1)[0])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    fits = jaxdev.memory.plan(
        shapes[0], step=followed, batch=shapes[1]
    ).peak  # what fsdp compiles to
    tight = jaxdev.make_train_step(
        loss_fn, SGD, jaxdev.Strategy.sharded(mesh), has_aux=True, memory_limit=fits
    )
    with pytest.raises(jaxdev.MemoryPlanError) as err:
        tight(state, batch)
    advice = f"Fix: Strategy.sharded(mesh, rules='fsdp') (fsdp over 2 devices, {human_bytes(fits)}"
    assert advice in str(err.value)
    new, _ = followed(followed.init_state(_params(), SGD), followed.put_batch(_data(steps=1)[0]))
    assert int(new.step) == 1
    assert (
        jaxdev.memory.plan(shapes, mesh, "fsdp")["params"]
        < jaxdev.memory.plan(shapes, mesh)["params"]
    )
