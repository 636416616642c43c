"""Sharding in types: jaxdev traces and runs user code under the strategy's mesh.

Model code written the way JAX's sharding guide and Flax's current examples
write it (``out_sharding=P(...)``, ``jax.sharding.reshard(x, P(...))``,
``with_sharding_constraint(x, P(...))`` with a bare ``PartitionSpec``) needs a
mesh in context; jaxdev enters ``jax.set_mesh(strategy.mesh)`` itself.
"""

from __future__ import annotations

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev.checkpoint._checksum import checksums


def _mesh(kind: AxisType):
    return jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(kind, kind))


def _loss(explicit: bool):
    def loss_fn(p, b):
        if explicit:
            h = jnp.einsum("bd,df->bf", b["x"], p["w"], out_sharding=P("fsdp", "tensor"))
            h = jax.sharding.reshard(h, P("fsdp", None))
        else:
            h = jax.lax.with_sharding_constraint(b["x"] @ p["w"], P("fsdp", "tensor"))
        return (h.sum(-1) - b["y"]) ** 2

    return loss_fn


def _batch():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    return {"x": x, "y": x.sum(-1)}


def _reference(batch, steps):  # plain jax.jit under the user's own set_mesh
    w = np.full((8, 4), 0.1, np.float32)
    for _ in range(steps):
        g = jax.grad(lambda w: ((batch["x"] @ w).sum(-1) - batch["y"]) ** 2 @ np.ones(16) / 16)(w)
        w = w - 0.01 * np.asarray(g)
    return w


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_bare_partition_specs_in_the_loss_work_without_user_set_mesh(kind):
    mesh = _mesh(kind)
    tx = optax.sgd(0.01)
    strategy = jaxdev.Strategy.sharded(mesh, axis="fsdp")
    step = jaxdev.make_train_step(_loss(kind == AxisType.Explicit), tx, strategy)
    state = step.init_state({"w": jnp.full((8, 4), 0.1)}, tx)
    batch = _batch()
    for _ in range(3):
        state, metrics = step(state, step.put_batch(batch))
    assert jax.sharding.get_mesh().empty  # nothing left set behind the user's back
    np.testing.assert_allclose(np.asarray(state.params["w"]), _reference(batch, 3), rtol=1e-5)
    assert np.isfinite(metrics.fetch()["loss"])


def test_the_users_own_set_mesh_same_mesh_works_other_mesh_is_named():
    mesh = _mesh(AxisType.Explicit)
    tx = optax.sgd(0.01)
    step = jaxdev.make_train_step(_loss(True), tx, jaxdev.Strategy.sharded(mesh, axis="fsdp"))
    with jax.set_mesh(mesh):
        state = step.init_state({"w": jnp.full((8, 4), 0.1)}, tx)
        state, _ = step(state, step.put_batch(_batch()))
    other = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(other), pytest.raises(jaxdev.ShardingError, match="already set") as err:
        step(state, step.put_batch(_batch()))
    assert "'fsdp': 4" in str(err.value) and "'fsdp': 2" in str(err.value)


def test_save_restore_arrays_split_over_two_explicit_axes(tmp_path):
    # the checksum flattened each leaf: a reshape JAX refuses for [4@tensor, 8, 32@fsdp]
    mesh = _mesh(AxisType.Explicit)
    sharding = jax.NamedSharding(mesh, P("tensor", None, "fsdp"))
    tree = {"w": jax.device_put(jnp.arange(1024.0).reshape(4, 8, 32), sharding), "n": jnp.ones(2)}
    jaxdev.save(tmp_path / "ckpt", tree)
    for target in (None, tree):  # no target: the saved sharding, its Explicit axes included
        back = jaxdev.restore(tmp_path / "ckpt", target)
        assert back["w"].sharding == sharding
        np.testing.assert_array_equal(back["w"], tree["w"])
    assert checksums([tree["w"]]) == checksums([np.asarray(tree["w"])])  # layout-free still


def test_a_state_on_another_mesh_of_the_same_devices_moves_onto_the_explicit_mesh():
    # equivalent layouts, but jit types an array by its own mesh: was a bare ValueError
    # ('context mesh ... should match the aval mesh') from a replicated state on data_mesh()
    mesh, tx = _mesh(AxisType.Explicit), optax.sgd(0.01)
    step = jaxdev.make_train_step(_loss(True), tx, jaxdev.Strategy.sharded(mesh, axis="fsdp"))
    state = jaxdev.TrainState.create({"w": jnp.full((8, 4), 0.1)}, tx)
    state, _ = step(jaxdev.replicate(state, jaxdev.data_mesh()), step.put_batch(_batch()))
    assert state.params["w"].sharding.mesh == mesh
    np.testing.assert_allclose(np.asarray(state.params["w"]), _reference(_batch(), 1), rtol=1e-5)


class _Reshards(nnx.Module):  # init code that names a bare PartitionSpec
    def __init__(self, rngs):
        w = jax.random.normal(rngs.params(), (8, 4))
        self.w = nnx.Param(jax.sharding.reshard(w, P("fsdp", "tensor")))


def test_init_sharded_traces_init_code_under_the_mesh_and_linen_boxes_without():
    mesh = _mesh(AxisType.Explicit)  # was: 'Using PartitionSpec when you are not under a mesh'
    model = jaxdev.init_sharded(lambda: _Reshards(nnx.Rngs(0)), mesh=mesh, rules="fsdp", min_size=1)
    assert model.w[...].sharding.mesh == mesh and jax.sharding.get_mesh().empty
    # linen's boxes would apply their spec as a constraint under the mesh (Explicit refuses)
    dense = nn.Dense(4, kernel_init=nn.with_partitioning(nn.initializers.ones, (None, "tensor")))
    variables = jaxdev.init_sharded(
        dense.init, jax.random.key(0), jnp.ones((1, 8)), mesh=mesh, rules="flax"
    )
    assert variables["params"]["kernel"].sharding.spec == P(None, "tensor")


def test_init_state_and_init_sharded_under_another_users_mesh_are_named():
    mesh, tx = _mesh(AxisType.Explicit), optax.adam(0.01)
    other = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    step = jaxdev.make_train_step(
        _loss(True), tx, jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=1)
    )
    with jax.set_mesh(other):  # was: JAX's 'Context mesh ... should match the mesh of sharding'
        with pytest.raises(jaxdev.ShardingError, match="already set"):
            step.init_state({"w": jnp.ones((8, 4))}, tx)
        with pytest.raises(jaxdev.ShardingError, match="already set"):
            jaxdev.init_sharded(lambda: _Reshards(nnx.Rngs(0)), mesh=mesh)


def test_save_restore_under_another_users_mesh_of_a_tree_on_two_meshes(tmp_path):
    mesh, data = _mesh(AxisType.Explicit), jaxdev.data_mesh()
    other = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), jax.NamedSharding(mesh, P("fsdp", "tensor")))
    tree = {"w": w, "r": jaxdev.replicate(jnp.ones(8), data)}  # the same devices, two meshes
    # were: 'Mesh for all inputs should be equal' / 'context mesh ... should match the aval
    # mesh' from the checksum, which is jaxdev's own program
    with jax.set_mesh(other):
        jaxdev.save(tmp_path / "ckpt", tree)
        back = jaxdev.restore(tmp_path / "ckpt", tree)
    assert jax.tree.map(lambda x: x.sharding, back) == jax.tree.map(lambda x: x.sharding, tree)


def test_memory_calls_under_another_users_mesh_are_named():
    mesh, tx = _mesh(AxisType.Explicit), optax.sgd(0.01)
    other = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    step = jaxdev.make_train_step(_loss(True), tx, jaxdev.Strategy.sharded(mesh, axis="fsdp"))
    state = step.init_state({"w": jnp.full((8, 4), 0.1)}, tx)
    batch = step.put_batch(_batch())
    assert (
        jaxdev.memory.fit_memory(step, state, batch, limit=2**20, max_batch_size=2).batch_size > 0
    )
    with jax.set_mesh(other):  # fit_memory said 'nothing fits' (each candidate 'did not compile')
        for call in (
            lambda: jaxdev.memory.fit_memory(step, state, batch, limit=2**20, max_batch_size=2),
            lambda: step.explain_memory(state, batch, limit=2**20),
        ):
            with pytest.raises(jaxdev.ShardingError, match="already set"):
                call()


def test_shapes_without_a_sharding_are_lowered_as_put_batch_places_them_on_explicit_meshes():
    tx = optax.sgd(0.1)
    x = np.ones((256, 32), np.float32)
    batch = {"x": x, "y": x.sum(-1)}
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create({"w": jnp.full((32, 32), 0.1)}, tx))

    def loss_fn(p, b):
        h = jax.lax.with_sharding_constraint(jnp.tanh(b["x"] @ p["w"]), P("data"))
        return (h.sum(-1) - b["y"]) ** 2

    peaks = {}
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded(mesh))
        lowered = step.lower(state, shapes).compile()  # was: traced replicated, bare AssertionError
        assert lowered.input_shardings[0][1]["x"].spec == P("data")
        placed = jaxdev.memory.plan(state, step=step, batch=step.put_batch(batch)).peak
        assert jaxdev.memory.plan(state, step=step, batch=shapes).peak == placed
        peaks[kind] = placed
    assert peaks[AxisType.Auto] == peaks[AxisType.Explicit]


@pytest.mark.parametrize("name", ["single", "pmap"])
def test_single_and_pmap_steps_run_under_a_users_set_mesh(name):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    strategy = jaxdev.Strategy.single() if name == "single" else jaxdev.Strategy.pmap()
    tx = optax.sgd(0.01)
    with jax.set_mesh(mesh):  # the user's own mesh, for other code: not these strategies'
        plain = lambda p, b: ((b["x"] @ p["w"]).sum(-1) - b["y"]) ** 2  # noqa: E731
        step = jaxdev.make_train_step(plain, tx, strategy)
        state = step.init_state({"w": jnp.full((8, 4), 0.1)})
        for _ in range(3):
            state, metrics = step(state, step.put_batch(_batch()))  # was: raw ValueError
    np.testing.assert_allclose(np.asarray(state.params["w"]), _reference(_batch(), 3), rtol=1e-5)
    assert np.isfinite(metrics.fetch()["loss"])


@pytest.mark.parametrize("name", ["single", "pmap"])
def test_single_and_pmap_steps_run_under_a_users_abstract_mesh(name):
    """Under ``jax.sharding.use_abstract_mesh`` of another mesh (no concrete mesh set) a
    single or pmap step raised JAX's raw ValueError (incompatible devices; the context mesh
    should match shard_map's): jaxdev stepped outside a concrete mesh only. It trains as
    outside, in a loop (its fast path from the third call), each program traced once (the
    fast path ran the program bare: JAX traced the loss again, then refused it)."""
    other = jax.sharding.AbstractMesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    strategy = jaxdev.Strategy.single() if name == "single" else jaxdev.Strategy.pmap()
    traced = [0]

    def plain(p, b):
        traced[0] += 1
        return ((b["x"] @ p["w"]).sum(-1) - b["y"]) ** 2

    step = jaxdev.make_train_step(plain, optax.sgd(0.01), strategy)
    state, batch, metrics = step.init_state({"w": jnp.full((8, 4), 0.1)}), _batch(), None
    for _ in range(6):
        placed = step.put_batch(batch)
        with jax.sharding.use_abstract_mesh(other):  # was: raw ValueError
            state, metrics = step(state, placed, metrics)
    np.testing.assert_allclose(np.asarray(state.params["w"]), _reference(batch, 6), rtol=1e-5)
    assert traced[0] == 2  # two programs: without, then with running metrics


@pytest.mark.parametrize("shard_map", [False, True], ids=["jit", "shard_map"])
def test_a_sharded_step_under_its_own_set_mesh_and_another_abstract_mesh_trains(shard_map):
    """Under ``jax.set_mesh(strategy.mesh)`` with ``use_abstract_mesh`` of another mesh inside,
    a sharded step raised JAX's raw ValueError: jaxdev saw its own concrete mesh set and
    entered nothing (helper-56's attack). It trains as outside."""
    other = jax.sharding.AbstractMesh((8,), ("zz",), axis_types=(AxisType.Explicit,))
    plain = lambda p, b: ((b["x"] @ p["w"]).sum(-1) - b["y"]) ** 2  # noqa: E731
    params = {}
    for inside in (False, True):
        strategy = jaxdev.Strategy.sharded(jaxdev.data_mesh(), shard_map=shard_map)
        step = jaxdev.make_train_step(plain, optax.sgd(0.01), strategy)
        state, metrics = step.init_state({"w": jnp.full((8, 4), 0.1)}), None
        with contextlib.ExitStack() as ctx:
            if inside:
                ctx.enter_context(jax.set_mesh(strategy.mesh))
                ctx.enter_context(jax.sharding.use_abstract_mesh(other))
            for _ in range(4):
                state, metrics = step(state, step.put_batch(_batch()), metrics)
        params[inside] = np.asarray(state.params["w"])
    np.testing.assert_array_equal(params[True], params[False])


# ---------------------------------------------------------------- explicit mesh= wins


def _placements(mine):
    """Every core call that names a mesh (or a sharding on one), with what it must give."""
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(lambda p, b: b * p, tx, jaxdev.Strategy.sharded(mine))
    rep = jaxdev.replicate(np.arange(16.0, dtype=np.float32), mine)  # made outside any mesh
    padded = jaxdev.shard_batch(np.arange(13.0, dtype=np.float32), mine, pad=True)
    split = jaxdev.batch_sharding(mine)
    return {
        "replicate": lambda x: jaxdev.replicate(x, mine),
        "to_device(mesh)": lambda x: jaxdev.to_device(x, mine),
        "to_device(P())": lambda x: jaxdev.to_device(x, jax.NamedSharding(mine, P())),
        "to_device(batch_sharding)": lambda x: jaxdev.to_device(x, split),
        "to_device(tree)": lambda x: jaxdev.to_device({"x": x}, {"x": split})["x"],
        "copy_to(mesh)": lambda x: jaxdev.copy_to(x, mine),
        "shard_batch": lambda x: jaxdev.shard_batch(x, mine),
        "put_batch": lambda x: step.put_batch(x),
        "to_device(replicated, tree)": lambda x: jaxdev.to_device({"x": rep}, {"x": split})["x"],
        "unpad": lambda x: jaxdev.unpad(padded.batch, padded),
        "stack_for_pmap": lambda x: jaxdev.pmap.stack_for_pmap(rep),
    }


@pytest.mark.parametrize("users", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("mine", ["auto", "explicit"])
@pytest.mark.parametrize("n_users", [8, 4], ids=["same-devices", "four-devices"])
def test_an_explicit_mesh_argument_wins_over_the_users_set_mesh(users, mine, n_users):
    mine = jaxdev.data_mesh(axis_type=mine)
    other = jax.make_mesh((n_users,), ("o",), axis_types=(users,), devices=jax.devices()[:n_users])
    values = np.arange(16.0, dtype=np.float32)
    wrong = []
    with jax.set_mesh(other):
        inputs = {"numpy": values, "made under the mesh": jnp.arange(16.0)}
        for name, place in _placements(mine).items():
            for kind, x in inputs.items():
                try:
                    out = place(x)
                except Exception as err:  # listed below with the others
                    wrong.append(f"{name}({kind}): {type(err).__name__}: {str(err)[:120]}")
                    continue
                if out is None:
                    continue
                got = out.batch if isinstance(out, jaxdev.Padded) else out
                if name == "stack_for_pmap":
                    ok = got.shape == (8, 16) and (np.asarray(got) == values).all()
                elif name == "unpad":
                    ok = np.asarray(got).tolist() == values[:13].tolist()
                else:
                    ok = got.sharding.mesh == mine and (np.asarray(got) == values).all()
                if not ok:
                    wrong.append(f"{name}({kind}): on {got.sharding}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- reshard on Auto axes


def _reshard_loss(p, b):
    h = jax.sharding.reshard(b["x"] @ p["w"], P("fsdp", None))
    return (h.sum(-1) - b["y"]) ** 2


def _out_sharding_loss(p, b):
    h = jnp.einsum("bd,df->bf", b["x"], p["w"], out_sharding=P("fsdp", "tensor"))
    return (h.sum(-1) - b["y"]) ** 2


@pytest.mark.parametrize(
    "loss_fn, call",
    [(_reshard_loss, "jax.sharding.reshard"), (_out_sharding_loss, "einsum(out_sharding=...)")],
)
@pytest.mark.parametrize("how", ["call", "lower"])
def test_reshard_and_out_sharding_on_auto_axes_are_named_and_the_fix_trains(loss_fn, call, how):
    tx = optax.sgd(0.01)
    auto = jaxdev.Strategy.sharded(_mesh(AxisType.Auto), axis="fsdp")
    step = jaxdev.make_train_step(loss_fn, tx, auto)
    state = step.init_state({"w": jnp.full((8, 4), 0.1)}, tx)
    batch = step.put_batch(_batch())
    with pytest.raises(jaxdev.UsageError, match=re.escape(f"calls `{call}`")) as err:
        step(state, batch) if how == "call" else step.lower(state, batch)
    fix = "jaxdev.make_mesh({'fsdp': 2, 'tensor': 4}, axis_type='explicit')"
    assert fix in str(err.value) and "with_sharding_constraint" in str(err.value)
    mesh = jaxdev.make_mesh({"fsdp": 2, "tensor": 4}, axis_type="explicit")  # the fix, as named
    step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded(mesh, axis="fsdp"))
    state = step.init_state({"w": jnp.full((8, 4), 0.1)}, tx)
    for _ in range(3):
        state, _ = step(state, step.put_batch(_batch()))
    np.testing.assert_allclose(np.asarray(state.params["w"]), _reference(_batch(), 3), rtol=1e-5)


@pytest.mark.parametrize("users", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_placements_under_a_users_mesh_of_the_same_devices_in_another_order(users):
    # jax.device_put re-lays such an array out with a jitted program, which the user's mesh
    # refused: raw 'Received incompatible devices for jitted computation'
    mine = jaxdev.data_mesh()
    other = jax.make_mesh((8,), ("o",), axis_types=(users,), devices=jax.devices()[::-1])
    values = np.arange(16.0, dtype=np.float32)
    split = jaxdev.batch_sharding(mine)
    calls = {
        "to_device(batch_sharding)": lambda x: jaxdev.to_device(x, split),
        "to_device(tree)": lambda x: jaxdev.to_device({"x": x}, {"x": split})["x"],
        "copy_to(mesh)": lambda x: jaxdev.copy_to(x, mine),
        "copy_to(tree)": lambda x: jaxdev.copy_to({"x": x}, {"x": split})["x"],
        "replicate": lambda x: jaxdev.replicate(x, mine),
        "shard_batch(pad)": lambda x: jaxdev.shard_batch(x, mine, pad=True).batch,
    }
    wrong = []
    with jax.set_mesh(other):
        made = jnp.arange(16.0)  # on the user's mesh
        for name, place in calls.items():
            try:
                out = place(made)
            except Exception as err:  # listed below with the others
                wrong.append(f"{name}: {type(err).__name__}: {str(err)[:120]}")
                continue
            if out.sharding.mesh != mine or np.asarray(out).tolist() != values.tolist():
                wrong.append(f"{name}: on {out.sharding}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("users", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_unstack_from_pmap_under_a_users_set_mesh(users):
    # row 0 of a stacked leaf is a slice (a jitted program): was refused by the user's mesh
    other = jax.make_mesh((8,), ("o",), axis_types=(users,))
    stacked = jaxdev.pmap.stack_for_pmap({"w": np.arange(3.0, dtype=np.float32)})
    with jax.set_mesh(other):
        one = jaxdev.pmap.unstack_from_pmap(stacked, check=True)
    assert one["w"].tolist() == [0.0, 1.0, 2.0] and one["w"].devices() == {jax.devices()[0]}


class _OutSharding(nnx.Module):  # init code asking out_sharding= of a bare PartitionSpec
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4), out_sharding=P("fsdp", None)))


@pytest.mark.parametrize(
    "module, call", [(_Reshards, "jax.sharding.reshard"), (_OutSharding, "normal(out_sharding")]
)
def test_init_sharded_with_reshard_on_auto_axes_is_named(module, call):
    with pytest.raises(jaxdev.UsageError, match=re.escape(f"calls `{call}")) as err:
        jaxdev.init_sharded(lambda: module(nnx.Rngs(0)), mesh=_mesh(AxisType.Auto))
    assert "axis_type='explicit'" in str(err.value)  # was: JAX's raw ValueError
    model = jaxdev.init_sharded(lambda: module(nnx.Rngs(0)), mesh=_mesh(AxisType.Explicit))
    assert model.w[...].shape == (8, 4)


@pytest.mark.parametrize("users", [None, AxisType.Auto, AxisType.Explicit])
def test_unpad_of_a_batch_split_on_explicit_axes_is_bit_exact(users):
    # JAX types no slice of a split dimension to an uneven size on Explicit axes: unpad
    # raised its raw ShardingTypeError for any padded batch of data_mesh(axis_type='explicit')
    mine = jaxdev.data_mesh(axis_type="explicit")
    bits = np.array([0x80000000, 0x7FC00001, 0xFF800000, 0x3F800000, 0x00000001], np.uint32)
    x = np.resize(bits, (13, 3)).view(np.float32)  # -0.0, a NaN payload, -inf, 1.0, subnormal
    other = jax.make_mesh((8,), ("o",), axis_types=(users,)) if users else None
    p = jaxdev.shard_batch({"x": x}, mine, pad=True)
    keep = np.arange(16) % 3 == 0
    with jax.set_mesh(other) if other else contextlib.nullcontext():
        outs = [jaxdev.unpad(p.batch, padding)["x"] for padding in (p, p.mask, 13)]
        picked = jaxdev.unpad(p.batch, jnp.asarray(keep))["x"]
    for out in outs:
        assert np.asarray(out).tobytes() == x.tobytes() and out.sharding.mesh == mine
    assert np.asarray(picked).tobytes() == np.asarray(p.batch["x"])[keep].tobytes()


def _zeros_out_sharding_loss(p, b):  # JAX names this call `jnp.zeros` (with a dot)
    h = b["x"] @ p["w"] + jnp.zeros((16, 4), out_sharding=P("fsdp", None))
    return (h.sum(-1) - b["y"]) ** 2


@pytest.mark.parametrize(
    "loss_fn, call, shard_map",
    [
        (_zeros_out_sharding_loss, "jnp.zeros(out_sharding=...)", False),
        (_reshard_loss, "jax.sharding.reshard", True),
        (_out_sharding_loss, "einsum(out_sharding=...)", True),
        (_zeros_out_sharding_loss, "jnp.zeros(out_sharding=...)", True),
    ],
)
def test_reshard_with_a_dotted_name_or_inside_shard_map_is_named(loss_fn, call, shard_map):
    # were JAX's raw ValueError: the call's name has a dot; shard_map=True makes the axes Manual
    tx = optax.sgd(0.01)
    strategy = jaxdev.Strategy.sharded(_mesh(AxisType.Auto), axis="fsdp", shard_map=shard_map)
    step = jaxdev.make_train_step(loss_fn, tx, strategy)
    state = step.init_state({"w": jnp.full((8, 4), 0.1)}, tx)
    with pytest.raises(jaxdev.UsageError, match=re.escape(f"calls `{call.split('(')[0]}")) as err:
        step(state, step.put_batch(_batch()))
    assert call in str(err.value) and ("shard_map=False" in str(err.value)) == shard_map
