"""Review of sharded params (issue 12): user paths that failed, each with its fix.

* a state or batch laid out otherwise than the step's program (a replicated
  state given to the fsdp step, fsdp params given to a replicated eval, a
  batch split over ``"data"`` only) is moved on the devices, not refused
  with JAX's "Sharding passed to jit does not match";
* such moves (and ``shard_params`` / ``init_state`` of multi-device arrays)
  never go through the host, as ``jax.device_put`` does between two layouts
  of the same devices;
* ``init_sharded`` of a model annotated with an axis the mesh lacks raises
  ``ShardingError`` naming it, and rules that ignore annotations still work;
* ``TrainStep.lower`` / ``plan(step=, batch=)`` accept the shapes of an uneven
  raw batch (padded as ``put_batch`` would);
* ``Strategy.sharded`` refuses bad ``params`` rules when it is built.
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

SGD = optax.sgd(0.1)
TOL = dict(rtol=1e-5, atol=1e-6)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(16)(x)


MODEL = MLP()


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


def _params():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]


def _batch(rows=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 32)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, 16, size=rows).astype(np.int32)}


@pytest.fixture(scope="module")
def mesh():
    return jaxdev.make_mesh({"data": 2, "fsdp": 4})


def _step(mesh, params="fsdp", **kw):
    strategy = jaxdev.Strategy.sharded(mesh, rules=params)
    return jaxdev.make_train_step(loss_fn, SGD, strategy, has_aux=True, **kw)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


# ---------------------------------------------------------------- states laid out otherwise


def test_fsdp_step_moves_a_replicated_state_once_on_device(mesh):
    fsdp, rep = _step(mesh), _step(mesh, "replicate")
    batches = [rep.put_batch(_batch(seed=i)) for i in range(4)]
    want = rep.init_state(_params(), SGD)
    for b in batches:
        want, _ = rep(want, b)
    state = rep.init_state(_params(), SGD)  # replicated, committed: jit alone refuses it
    with jaxdev.count_transfers() as first:
        state, metrics = fsdp(state, batches[0])
    assert first.device_to_host == 0  # moved on the devices, not through the host
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")
    state, metrics = fsdp(state, batches[1], metrics)  # the running-metrics variant
    with jaxdev.no_host_sync(max_compiles=0, max_traces=0):  # laid out now: nothing moves
        for b in batches[2:]:
            state, metrics = fsdp(state, b, metrics)
    _close(state.params, want.params)
    # and back: the fsdp state into the replicated step
    back, _ = rep(state, batches[0])
    assert back.params["Dense_0"]["kernel"].sharding.is_fully_replicated


def test_single_device_and_host_states_and_a_batch_split_over_data_only(mesh):
    fsdp = _step(mesh)
    single = jaxdev.make_train_step(loss_fn, SGD, jaxdev.Strategy.single(), has_aux=True)
    batch = _batch()
    ref, ref_m = fsdp(fsdp.init_state(_params(), SGD), fsdp.put_batch(batch))
    for make in (
        lambda: single.init_state(_params(), SGD),  # committed to one device
        lambda: jaxdev.TrainState.create(_params(), SGD),  # uncommitted
    ):
        for placed in (fsdp.put_batch(batch), jaxdev.shard_batch(batch, mesh)):  # P('data')
            out, m = fsdp(make(), placed)
            _close(out.params, ref.params)
            np.testing.assert_allclose(m.fetch()["loss"], ref_m.fetch()["loss"], rtol=1e-6)


def test_a_batch_laid_out_otherwise_on_a_later_call_is_moved_and_user_errors_pass(mesh):
    fsdp = _step(mesh)
    batch = _batch()
    state, _ = fsdp(fsdp.init_state(_params(), SGD), fsdp.put_batch(batch))  # compiled
    ref, _ = fsdp(state, fsdp.put_batch(batch))
    state, _ = fsdp(fsdp.init_state(_params(), SGD), fsdp.put_batch(batch))
    with jaxdev.count_transfers() as c:  # the second call: P('data') rows, moved on device
        out, _ = fsdp(state, jaxdev.shard_batch(batch, mesh, axis="data"))
    assert c.device_to_host == 0
    _close(out.params, ref.params)

    def bad_loss(params, batch):
        raise ValueError("the user's own ValueError")

    step = jaxdev.make_train_step(bad_loss, SGD, jaxdev.Strategy.sharded(mesh, rules="fsdp"))
    for _ in range(2):  # the step decides what to move without catching jit's errors
        with pytest.raises(ValueError, match="the user's own ValueError"):
            step(step.init_state(_params(), SGD), step.put_batch(batch))


def test_eval_steps_on_params_laid_out_by_other_rules(mesh):
    batch = _batch(rows=21, seed=3)
    want = float(loss_fn(_params(), batch)[0].mean())
    fsdp_params = jaxdev.shard_params(_params(), mesh, "fsdp")
    replicated = jaxdev.to_device(_params(), mesh)
    for rules, params in (("replicate", fsdp_params), ("fsdp", replicated)):
        ev = jaxdev.make_eval_step(
            loss_fn, jaxdev.Strategy.sharded(mesh, rules=rules), has_aux=True
        )
        placed = ev.put_batch(batch)
        for _ in range(2):
            with jaxdev.count_transfers() as c:
                got = ev(params, placed)
            assert c.device_to_host == 0
            np.testing.assert_allclose(got.fetch()["loss"], want, rtol=1e-5)
        assert not any(x.is_deleted() for x in jax.tree.leaves(params))  # eval never donates


def test_lower_and_plan_of_a_misplaced_state_move_nothing(mesh):
    fsdp, rep = _step(mesh), _step(mesh, "replicate")
    state, batch = rep.init_state(_params(), SGD), fsdp.put_batch(_batch())
    # JAX/flax alone, once per process and mesh: flax's apply checks each param's shape by
    # tracing its init (jax.eval_shape), whose jax.random trace calls jax.device_put on a
    # host constant, which count_transfers counts (2 when this test ran first). Trace it here.
    with jax.set_mesh(mesh):
        jax.eval_shape(loss_fn, state.params, batch)
    with jaxdev.count_transfers() as c:
        compiled = fsdp.lower(state, batch).compile()
        plan = jaxdev.memory.plan(state, step=fsdp, batch=batch)
    assert c.device_to_host == 0 and c.host_to_device == 0
    assert compiled.input_shardings[0][0].params["Dense_0"]["kernel"].spec == P(None, "fsdp")
    assert plan.compiled.argument == compiled.memory_analysis().argument_size_in_bytes
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))


def test_a_state_on_other_devices_is_moved_onto_the_steps_devices():
    first = jaxdev.make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    other = jaxdev.make_mesh({"fsdp": 4}, devices=jax.devices()[4:])
    step = _step(first)
    state = _step(other).init_state(_params(), SGD)
    out, _ = step(state, step.put_batch(_batch()))
    assert out.params["Dense_0"]["kernel"].sharding.mesh == first
    ref, _ = step(step.init_state(_params(), SGD), step.put_batch(_batch()))
    _close(out.params, ref.params)


# ---------------------------------------------------------------- placing without the host


def test_shard_params_and_init_state_of_replicated_params_stay_on_device(mesh):
    replicated = jaxdev.to_device(_params(), mesh)
    with jaxdev.count_transfers() as c:
        sharded = jaxdev.shard_params(replicated, mesh, "fsdp")
        adam = optax.adam(1e-3)  # the step's own tx (another is refused)
        strategy = jaxdev.Strategy.sharded(mesh, rules="fsdp")
        state = jaxdev.make_train_step(loss_fn, adam, strategy, has_aux=True).init_state(
            replicated, adam
        )
    assert c.device_to_host == 0
    assert sharded["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")
    assert state.opt_state[0].mu["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")
    _close(sharded, _params())
    _close(state.params, _params())
    assert jaxdev.shard_params(sharded, mesh, "fsdp") is sharded
    # init_state copies: the caller's replicated arrays survive a donating step
    step = _step(mesh)
    step(step.init_state(replicated, SGD), step.put_batch(_batch()))
    assert not any(x.is_deleted() for x in jax.tree.leaves(replicated))


# ---------------------------------------------------------------- init_sharded annotations


class Annotated(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        x = nn.Dense(64, kernel_init=kernel)(x)
        return nn.Dropout(0.5, deterministic=not train)(x)


def test_init_sharded_annotation_on_an_axis_the_mesh_lacks(mesh):
    x = jnp.zeros((1, 64))
    with pytest.raises(
        jaxdev.ShardingError,
        match=r"\['Dense_0'\]\['kernel'\] of shape \(64, 64\).*'model' does not exist",
    ):
        jaxdev.init_sharded(Annotated().init, jax.random.key(0), x, False, mesh=mesh, rules="flax")
    # rules that ignore annotations work on that mesh, with the unsharded values
    got = jaxdev.init_sharded(
        Annotated().init, jax.random.key(0), x, False, mesh=mesh, rules="fsdp"
    )
    assert got["params"]["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")
    want = nn.unbox(Annotated().init(jax.random.key(0), x, False))
    _close(got, want)

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.linear = nnx.Linear(64, 128, kernel_init=init, rngs=rngs)

    with pytest.raises(
        jaxdev.ShardingError,
        match=r"\['linear'\]\['kernel'\] of shape \(64, 128\) \(mesh data=2 x fsdp=4\): "
        r"mesh axis 'model' does not exist",
    ):
        jaxdev.init_sharded(lambda: Nnx(nnx.Rngs(0)), mesh=mesh, rules="flax")
    # and NNX under rules that ignore annotations works there too, with flax's values
    layer = jaxdev.init_sharded(lambda: Nnx(nnx.Rngs(0)), mesh=mesh, rules="fsdp")
    assert layer.linear.kernel[...].sharding.spec == P(None, "fsdp")  # the largest dim
    with nnx.use_eager_sharding(False):
        want = Nnx(nnx.Rngs(0)).linear.kernel[...]
    np.testing.assert_array_equal(np.asarray(layer.linear.kernel[...]), np.asarray(want))


# ---------------------------------------------------------------- lower / plan of raw shapes


@pytest.mark.parametrize("k", [1, 2])
def test_lower_and_plan_accept_an_uneven_raw_batch(mesh, k):
    step = _step(mesh, steps_per_call=k)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), SGD))
    lead = (k,) if k > 1 else ()
    raw = {
        "x": jax.ShapeDtypeStruct(lead + (30, 32), jnp.float32),
        "y": jax.ShapeDtypeStruct(lead + (30,), jnp.int32),
    }
    plan = jaxdev.memory.plan(state, step=step, batch=raw)
    rng = np.random.default_rng(0)
    real = {
        "x": rng.normal(size=lead + (30, 32)).astype(np.float32),
        "y": rng.integers(0, 16, size=lead + (30,)).astype(np.int32),
    }
    placed = step.put_batch(real)
    assert isinstance(placed, jaxdev.Padded)
    want = step.lower(state, placed).compile().memory_analysis()
    assert plan.compiled.argument == want.argument_size_in_bytes
    assert plan.compiled.temp == want.temp_size_in_bytes


# ---------------------------------------------------------------- rules checked when built


@pytest.mark.parametrize(
    "rules, match",
    [
        ("fsdpp", r"`rules` must be .*got the string 'fsdpp'"),
        ([("Dense_0/kernel", "model")], r"pattern 'Dense_0/kernel' maps to 'model'"),
        ({"Dense_0": {"kernel": "model"}}, r"`rules` must be .*got dict"),
        (3, r"`rules` must be .*got int 3"),
    ],
)
def test_strategy_refuses_bad_rules_when_built(mesh, rules, match):
    with pytest.raises(jaxdev.ShardingError, match=match):
        jaxdev.Strategy.sharded(mesh, rules=rules)


def test_fsdp_shards_over_the_batch_axes_without_an_fsdp_axis():
    s = jaxdev.Strategy.sharded(jaxdev.make_mesh({"data": 2, "model": 4}), rules="fsdp")
    assert s.axis == "data"  # the rules shard over the same default axis (_rules.fsdp_axis_of)
    with pytest.raises(jaxdev.ShardingError, match="fsdp_axis"):
        jaxdev.Strategy.sharded(
            jaxdev.make_mesh({"model": 2, "tensor": 4}), axis="model", rules="fsdp"
        )


# ---------------------------------------------------------------- plans under "flax"


class TensorParallel(nn.Module):
    @nn.compact
    def __call__(self, x):
        k0 = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        k1 = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))
        x = nn.relu(nn.Dense(256, kernel_init=k0)(x))
        return nn.Dense(16, kernel_init=k1)(x)


def test_flax_plans_count_what_the_step_holds():
    """Boxed adam moments follow the params; a placed (unboxed) state keeps its layout."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    model, tx = TensorParallel(), optax.adam(1e-3)
    boxed = model.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    shapes = jax.eval_shape(lambda: jaxdev.TrainState.create(boxed, tx))  # boxed mu / nu
    plan = jaxdev.memory.plan(shapes, mesh, "flax")
    assert plan["opt_state"] < 2 * plan["params"] + 64  # sharded like the params
    step = jaxdev.make_train_step(loss, tx, jaxdev.Strategy.sharded(mesh, rules="flax"))
    state = step.init_state(boxed, tx)
    batch = step.put_batch(_batch())
    placed = jaxdev.memory.plan(state, step=step, batch=batch)
    assert placed["params"] == plan["params"] and placed["opt_state"] == plan["opt_state"]
    state_and_batch = placed["params"] + placed["opt_state"] + placed["batch"] + placed["other"]
    assert placed.compiled.argument == state_and_batch


def test_flax_params_from_init_sharded_keep_their_layout_in_init_state():
    """init_state never widens params that init_sharded laid out (was: copied to P())."""

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(512, kernel_init=init)(x)

    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    model = M()
    params = jaxdev.init_sharded(
        model.init, jax.random.key(0), jnp.ones((1, 256)), mesh=mesh, rules="flax"
    )["params"]
    step = jaxdev.make_train_step(
        lambda p, b: (model.apply({"params": p}, b) ** 2).sum(1),
        optax.sgd(0.1),
        jaxdev.Strategy.sharded(mesh, rules="flax"),
    )
    state = step.init_state(params, optax.sgd(0.1))
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    before = max(jaxdev.placement(params).bytes_by_device.values())
    assert max(jaxdev.placement(state.params).bytes_by_device.values()) == before
