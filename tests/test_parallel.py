"""Tests of meshes, replication, batches, pmap layout, prefetch, data_parallel (8 fake CPUs)."""

from __future__ import annotations

import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import DeletedArrayError, LeafTypeError, ShardingError, UsageError

N = 8
SETTINGS = settings(max_examples=25, deadline=None)


@pytest.fixture(scope="module")
def mesh():
    return jaxdev.data_mesh()


def params_tree():
    return {
        "dense": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "bias": np.ones(4)},
        "scale": 2.5,
        "count": np.int32(7),
        "none": None,
    }


def bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, np.ascontiguousarray(x).tobytes()


def assert_bit_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert bits(x) == bits(y)


# ---------------------------------------------------------------- meshes


def test_data_mesh_is_auto_over_all_devices(devices):
    mesh = jaxdev.data_mesh()
    assert mesh.axis_names == ("data",)
    assert list(mesh.devices.flat) == devices
    assert mesh.axis_types == (AxisType.Auto,)


def test_data_mesh_options(devices):
    mesh = jaxdev.data_mesh(4, axis="batch", axis_type="explicit")
    assert mesh.shape == {"batch": 4}
    assert mesh.axis_types == (AxisType.Explicit,)
    mesh = jaxdev.data_mesh([devices[3], "cpu:1"])
    assert list(mesh.devices.flat) == [devices[3], devices[1]]


def test_data_mesh_rejects_duplicate_devices(devices):
    with pytest.raises(UsageError, match="cpu:2 twice"):
        jaxdev.data_mesh([devices[2], devices[0], devices[2]])


@pytest.mark.parametrize("kwargs", [{"axis": ""}, {"axis": 3}, {"axis_type": "manual-ish"}])
def test_data_mesh_bad_arguments(kwargs):
    with pytest.raises(ShardingError, match="`axis"):
        jaxdev.data_mesh(**kwargs)


def test_sharding_helpers(mesh):
    assert jaxdev.as_sharding(mesh).spec == P()
    assert jaxdev.batch_sharding(mesh).spec == P("data")
    assert jaxdev.batch_sharding(mesh, ndim=3).spec == P("data", None, None)
    with pytest.raises(ShardingError, match="`axis`='model'.*axes"):
        jaxdev.batch_sharding(mesh, axis="model")
    with pytest.raises(ShardingError, match="`ndim`"):
        jaxdev.batch_sharding(mesh, ndim=0)
    with pytest.raises(UsageError, match="`target`"):
        jaxdev.as_sharding(["cpu:0"])


def test_two_axis_mesh_splits_the_batch_over_every_non_model_axis(devices):
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    out = jaxdev.shard_batch(np.ones((8, 2)), mesh)
    assert out.sharding.spec == P(("x", "y"))
    assert len({s.index[0].start for s in out.addressable_shards}) == 8
    model = jax.make_mesh((2, 4), ("model", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ShardingError, match="`axis` is needed: every axis of the mesh"):
        jaxdev.shard_batch(np.ones((8, 2)), model)
    out = jaxdev.shard_batch(np.ones((8, 2)), model, axis="model")
    assert out.sharding.spec == P("model")


@pytest.mark.parametrize(
    "axes", [{"data": 8}, {"data": 2, "fsdp": 4}, {"data": 2, "model": 4}, {"batch": 8}]
)
def test_one_batch_axis_default_everywhere(axes):
    """shard_batch, batch_sharding, Strategy.sharded and plan split the rows the same way."""
    mesh = jaxdev.make_mesh(axes)
    batch = {"x": np.ones((16, 3), np.float32)}
    placed = jaxdev.shard_batch(batch, mesh)["x"].sharding.spec
    spec = jaxdev.batch_sharding(mesh).spec
    strategy = jaxdev.Strategy.sharded(mesh)
    state = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    plan = jaxdev.memory.plan(state, mesh, batch=batch)
    rows = 16 // jaxdev.Strategy.sharded(mesh).n_devices
    assert placed == spec == P(strategy.axis)
    assert plan["batch"] == rows * 3 * 4


# ---------------------------------------------------------------- replicate


def test_replicate_is_true_replication(mesh):
    out = jaxdev.replicate(params_tree(), mesh)
    for leaf in jax.tree_util.tree_leaves(out):
        assert leaf.sharding == NamedSharding(mesh, P())
        assert leaf.is_fully_replicated
        assert len(leaf.addressable_shards) == N
    assert out["dense"]["kernel"].shape == (3, 4)  # no stacked device axis
    assert out["none"] is None


def test_replicate_twice_is_a_noop(mesh):
    once = jaxdev.replicate(params_tree(), mesh)
    assert jaxdev.replicate(once, mesh) is once
    partial = dict(once, extra=np.zeros(2))
    again = jaxdev.replicate(partial, mesh)
    assert again["dense"]["kernel"] is once["dense"]["kernel"]


def test_replicate_default_mesh():
    out = jaxdev.replicate({"w": np.ones(2)})
    assert out["w"].is_fully_replicated and len(out["w"].devices()) == N


@SETTINGS
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.int32, np.bool_, np.uint8, np.float16]),
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
    )
)
def test_unreplicate_replicate_round_trip(x):
    mesh = jaxdev.data_mesh()
    tree = {"a": x, "b": [x, None]}
    back = jaxdev.unreplicate(jaxdev.replicate(tree, mesh), check=True)
    assert_bit_equal(back, tree)
    assert len(back["a"].devices()) == 1


def test_unreplicate_returns_one_device_copy(mesh, devices):
    rep = jaxdev.replicate({"w": np.arange(4.0), "h": 3.0}, mesh)
    one = jaxdev.unreplicate(rep)
    assert one["w"].devices() == {devices[0]}
    assert one["w"].shape == (4,)
    assert jaxdev.unreplicate({"n": np.ones(2), "f": 1.0}) is not None  # host passes through
    host = {"n": np.ones(2)}
    assert jaxdev.unreplicate(host)["n"] is host["n"]


def _drifted(mesh, devices, bad):
    values = [np.full((3,), 1.5, np.float32) for _ in devices]
    for i in bad:
        values[i] = values[i] + np.float32(0.25)
    arrays = [jax.device_put(v, d) for v, d in zip(values, devices)]
    return jax.make_array_from_single_device_arrays((3,), NamedSharding(mesh, P()), arrays)


def test_unreplicate_detects_drift(mesh, devices):
    drifted = _drifted(mesh, devices, bad=[5])
    tree = {"ok": jaxdev.replicate(np.ones(2), mesh), "layer": {"w": drifted}}
    with pytest.raises(ShardingError, match="drifted") as err:
        jaxdev.unreplicate(tree, check=True)
    msg = str(err.value)
    want = "['layer']['w']: cpu:5 differ bitwise from cpu:0, cpu:1, cpu:2, cpu:3, cpu:4, cpu:6"
    assert want in msg
    assert "max |difference| 0.25" in msg
    assert "['ok']" not in msg
    # Without `check`, no fetch happens and the first replica comes back.
    assert jaxdev.unreplicate(tree)["layer"]["w"].tolist() == [1.5] * 3


def test_unreplicate_checks_typed_keys_by_their_data(mesh, devices):
    """A TrainState's typed rng: before, a raw TypeError from fetching its replicas."""
    key = jax.random.key(1)
    back = jaxdev.unreplicate({"rng": jaxdev.replicate(key, mesh)}, check=True)["rng"]
    assert (jax.random.key_data(back) == jax.random.key_data(key)).all()
    data = (_drifted(mesh, devices, bad=[2]) * 4).astype(jnp.uint32)[:2]  # 6 and 7 on cpu:2
    bumped = jax.random.wrap_key_data(data)
    with pytest.raises(ShardingError, match=r"<root>: cpu:2 differ bitwise from cpu:0"):
        jaxdev.unreplicate(bumped, check=True)

def test_drift_detection_is_bitwise(mesh, devices):
    arrays = [
        jax.device_put(np.array([0.0 if i else -0.0], np.float32), d) for i, d in enumerate(devices)
    ]
    signed_zero = jax.make_array_from_single_device_arrays((1,), NamedSharding(mesh, P()), arrays)
    with pytest.raises(ShardingError, match=r"<root>: cpu:0 differ bitwise from cpu:1"):
        jaxdev.unreplicate(signed_zero, check=True)


def test_unreplicate_rejects_sharded_leaf(mesh):
    tree = {"batch": jaxdev.shard_batch(np.ones((8, 2)), mesh), "w": jaxdev.replicate(1.0, mesh)}
    with pytest.raises(ShardingError, match=r"\['batch'\]: shape \(8, 2\), sharding P\('data',\)"):
        jaxdev.unreplicate(tree)


def test_unreplicate_hints_at_stacked_copy():
    with pytest.raises(ShardingError, match="unstack_from_pmap"):
        jaxdev.unreplicate(jaxdev.pmap.stack_for_pmap({"w": np.ones(3)}))


def test_unreplicate_deleted_leaf(mesh):
    rep = jaxdev.replicate({"w": np.ones(3)}, mesh)
    rep["w"].delete()
    with pytest.raises(DeletedArrayError, match=r"\['w'\]"):
        jaxdev.unreplicate(rep)


def test_unreplicate_inside_jit_raises(mesh):
    rep = jaxdev.replicate(np.ones(3), mesh)
    with pytest.raises(jaxdev.PlacementError, match="inside a jax.jit trace"):
        jax.jit(jaxdev.unreplicate)(rep)


# ---------------------------------------------------------------- shard_batch


def test_shard_batch_places_leading_axis(mesh):
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    batch = {"x": x, "y": np.arange(16, dtype=np.int32)}
    out = jaxdev.shard_batch(batch, mesh)
    for leaf in jax.tree_util.tree_leaves(out):
        assert leaf.sharding == NamedSharding(mesh, P("data"))
        assert leaf.addressable_shards[0].data.shape[0] == 2
    assert_bit_equal(jaxdev.to_host(out), batch)
    assert jaxdev.shard_batch(out, mesh) is out  # already placed: no copy


@pytest.mark.parametrize("rows", range(0, 3 * N + 2))
def test_pad_unpad_every_size(mesh, rows):
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    batch = {"x": x, "y": np.arange(rows, dtype=np.int32)}
    if rows == 0:
        with pytest.raises(ShardingError, match=r"`batch` is empty: leaf \['x'\] has 0 rows"):
            jaxdev.shard_batch(batch, mesh, pad=True)
        return
    out = jaxdev.shard_batch(batch, mesh, pad=True)
    padded_rows = -(-rows // N) * N
    assert isinstance(out, jaxdev.Padded)
    assert out.size == rows
    assert out.mask.shape == (padded_rows,) and out.mask.dtype == jnp.bool_
    assert out.mask.sharding == NamedSharding(mesh, P("data"))
    assert int(out.mask.sum()) == rows
    assert np.asarray(out.mask)[:rows].all()
    assert out.batch["x"].shape == (padded_rows, 3)
    assert_bit_equal(jaxdev.unpad(out.batch, out), batch)
    assert_bit_equal(jaxdev.to_host(jaxdev.unpad(out.batch, out)), batch)
    assert_bit_equal(jaxdev.unpad(out.batch, out.mask), batch)
    assert_bit_equal(jaxdev.unpad(out.batch, rows), batch)


@SETTINGS
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.int32, np.bool_, np.int8]),
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=19),
    )
)
def test_shard_pad_unpad_round_trip(x):
    mesh = jaxdev.data_mesh()
    tree = (x, {"twice": x})
    out = jaxdev.shard_batch(tree, mesh, pad=True)
    assert_bit_equal(jaxdev.unpad(out.batch, out), tree)


def test_padding_repeats_last_row(mesh):
    out = jaxdev.shard_batch(np.array([[1.0], [2.0], [3.0]]), mesh, pad=True)
    assert np.asarray(out.batch)[:, 0].tolist() == [1, 2, 3, 3, 3, 3, 3, 3]


def test_pad_device_arrays_stay_on_device(mesh, devices):
    x = jax.device_put(jnp.arange(10.0), devices[3])
    out = jaxdev.shard_batch(x, mesh, pad=True)
    assert out.batch.sharding == NamedSharding(mesh, P("data"))
    assert jaxdev.unpad(out.batch, out).tolist() == list(range(10))


def test_unpad_from_non_prefix_mask():
    x = np.arange(8)
    mask = np.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
    assert jaxdev.unpad({"x": jnp.asarray(x)}, mask)["x"].tolist() == [0, 2, 3, 6]
    assert jaxdev.unpad({"x": x}, jnp.asarray(mask))["x"].tolist() == [0, 2, 3, 6]


def test_unpad_bad_inputs(mesh):
    out = jaxdev.shard_batch(np.ones((5, 2)), mesh, pad=True)
    with pytest.raises(ShardingError, match=r"(?s)8 leading rows.*\['loss'\]: shape \(\)"):
        jaxdev.unpad({"logits": out.batch, "loss": out.batch.mean()}, out)
    with pytest.raises(ShardingError, match="dtype float32"):
        jaxdev.unpad(out.batch, np.ones(8, np.float32))
    with pytest.raises(ShardingError, match="at least 9"):
        jaxdev.unpad(out.batch, 9)


@pytest.mark.parametrize("make", ["put_batch", "shard_for_pmap"])
def test_unpad_of_a_stacked_padded_batch_names_unshard_from_pmap(make):
    """Before: a Padded in pmap's stacked layout (`put_batch` under `Strategy.pmap`,
    `shard_for_pmap(pad=True)`) given to `unpad`, README's one way to gather real rows, said
    "leaves must have 16 leading rows" of leaves that lead with the mask's own shape (8, 2),
    and named no way out; `unshard_from_pmap(tree, padding)` is the call."""
    batch = {"x": np.arange(26.0).reshape(13, 2), "y": np.arange(13)}
    if make == "put_batch":
        step = jaxdev.make_train_step(lambda p, b: b["x"][:, 0] * p, optax.sgd(0.1),
                                      jaxdev.Strategy.pmap())
        padded = step.put_batch(batch)
    else:
        padded = jaxdev.pmap.shard_for_pmap(batch, pad=True)
    assert padded.mask.shape == (8, 2) and padded.size == 13
    fix = r"unshard_from_pmap\(tree, padding\)"
    with pytest.raises(ShardingError, match=rf"(?s)16 leading rows.*shape \(8, 2\).*{fix}"):
        jaxdev.unpad(padded.batch, padded)
    with pytest.raises(ShardingError, match=fix):  # its mask alone: the same advice
        jaxdev.unpad(padded.batch, padded.mask)
    rows = jaxdev.to_host(jaxdev.pmap.unshard_from_pmap(padded.batch, padded))
    assert rows["y"].tolist() == list(range(13)) and rows["x"].shape == (13, 2)


def test_indivisible_batch_names_leaf_sizes_and_fix(mesh):
    batch = {"images": np.ones((10, 4)), "labels": np.ones(10)}
    with pytest.raises(ShardingError) as err:
        jaxdev.shard_batch(batch, mesh)
    msg = str(err.value)
    assert "`batch` leaf ['images'] has 10 rows" in msg
    assert "8 devices [cpu:0, cpu:1" in msg
    assert "10 % 8 = 2" in msg
    assert "`pad=True`" in msg and "16 rows" in msg and "8 or 16" in msg


def test_mixed_leading_sizes_name_every_leaf(mesh):
    batch = {"x": np.ones((16, 3)), "y": np.ones(8)}
    with pytest.raises(ShardingError, match="different leading") as err:
        jaxdev.shard_batch(batch, mesh, pad=True)
    assert "['x']: 16 (shape (16, 3))" in str(err.value)
    assert "['y']: 8 (shape (8,))" in str(err.value)


@pytest.mark.parametrize("mesh_type", ["auto", "explicit"])
def test_scalar_leaf_names_leaf(mesh_type):
    mesh = jaxdev.data_mesh(axis_type=mesh_type)
    with pytest.raises(ShardingError, match=r"scalar leaves.*\n  \['lr'\]: shape \(\)"):
        jaxdev.shard_batch({"x": np.ones((8, 2)), "lr": np.float32(0.1)}, mesh)


def test_empty_batch_without_pad(mesh):
    with pytest.raises(ShardingError, match=r"`batch` is empty: leaf \[0\] has 0 rows"):
        jaxdev.shard_batch((np.ones((0, 3)), np.ones(0)), mesh)
    with pytest.raises(ShardingError, match="no array leaves"):
        jaxdev.shard_batch({"a": None}, mesh)


def test_shard_batch_leaf_policy(mesh):
    with pytest.raises(LeafTypeError, match=r"\['names'\]"):
        jaxdev.shard_batch({"names": np.array(["a"] * 8)}, mesh)
    x = jaxdev.shard_batch(np.ones((8, 2)), mesh)
    x.delete()
    with pytest.raises(DeletedArrayError, match="<root>"):
        jaxdev.shard_batch(x, mesh)


def test_shard_batch_on_sub_mesh(devices):
    mesh = jaxdev.data_mesh(devices[2:5])
    out = jaxdev.shard_batch(np.arange(7), mesh, pad=True)
    assert out.batch.shape == (9,) and out.batch.devices() == set(devices[2:5])


# ---------------------------------------------------------------- pmap layout


@SETTINGS
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.int32, np.bool_]),
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    )
)
def test_stack_unstack_round_trip(x):
    tree = {"p": x, "q": [x]}
    stacked = jaxdev.pmap.stack_for_pmap(tree)
    assert stacked["p"].shape == (N, *np.shape(x))
    assert_bit_equal(jaxdev.pmap.unstack_from_pmap(stacked, check=True), tree)


def test_stack_layout_row_per_device(devices):
    stacked = jaxdev.pmap.stack_for_pmap(np.arange(3.0), devices[:4])
    assert stacked.shape == (4, 3)
    assert sorted((s.device.id, s.index[0].start) for s in stacked.addressable_shards) == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
    ]


def test_unstack_detects_drift(devices):
    stacked = jaxdev.pmap.stack_for_pmap({"w": np.zeros(2, np.float32)})
    bumped = jax.pmap(lambda w: w + jax.lax.axis_index("i").astype(w.dtype) * (w == 0), "i")
    with pytest.raises(ShardingError, match=r"\['w'\]: cpu:1, cpu:2.*differ bitwise from cpu:0"):
        jaxdev.pmap.unstack_from_pmap({"w": bumped(stacked["w"])}, check=True)
    host = {"w": np.array([[1, 1], [1, 1], [2, 1]])}
    with pytest.raises(ShardingError, match="row 2 differ bitwise from row 0, row 1"):
        jaxdev.pmap.unstack_from_pmap(host, check=True)


def test_unstack_checks_typed_keys_by_their_data():
    """flax's jax_utils.replicate of a state with a typed rng: before, a raw TypeError from
    fetching the rows ('PRNGKey dtype cannot be converted to a NumPy array')."""
    key = jax.random.key(0)
    stacked = jaxdev.pmap.stack_for_pmap({"rng": key})
    back = jaxdev.pmap.unstack_from_pmap(stacked, check=True)["rng"]
    assert (jax.random.key_data(back) == jax.random.key_data(key)).all()
    split = jax.pmap(lambda k: jax.random.fold_in(k, jax.lax.axis_index("i")), "i")
    with pytest.raises(ShardingError, match=r"\['rng'\]: cpu:1.*differ bitwise from cpu:0"):
        jaxdev.pmap.unstack_from_pmap({"rng": split(stacked["rng"])}, check=True)

def test_unstack_scalar_leaf():
    with pytest.raises(ShardingError, match=r"(?s)scalar leaves.*\['lr'\]"):
        jaxdev.pmap.unstack_from_pmap({"lr": jnp.float32(1.0)})


def test_shard_for_pmap_layout_and_errors(devices):
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    out = jaxdev.pmap.shard_for_pmap({"x": x})
    assert out["x"].shape == (8, 2, 3)
    assert np.array_equal(np.asarray(out["x"]).reshape(16, 3), x)
    assert {s.device for s in out["x"].addressable_shards} == set(devices)
    with pytest.raises(ShardingError, match=r"\['x'\] has 12 rows.*8 pmap devices.*`pad=True`"):
        jaxdev.pmap.shard_for_pmap({"x": x[:12]})
    with pytest.raises(ShardingError, match="different leading"):
        jaxdev.pmap.shard_for_pmap({"x": x, "y": x[:8]})
    with pytest.raises(jaxdev.DeviceNotFoundError, match="more devices than exist"):
        jaxdev.pmap.shard_for_pmap(x, devices=9)


def test_shard_for_pmap_pad_round_trip():
    x = jnp.arange(13 * 2).reshape(13, 2)
    out = jaxdev.pmap.shard_for_pmap(x, pad=True)
    assert out.batch.shape == (8, 2, 2) and out.mask.shape == (8, 2)
    assert int(out.mask.sum()) == 13
    assert_bit_equal(jaxdev.pmap.unshard_from_pmap(out.batch, out), x)
    with pytest.raises(ShardingError, match="two leading axes"):
        jaxdev.pmap.unshard_from_pmap({"v": jnp.ones(3)})


def _apply(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


def _params():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(5, 3)).astype(np.float32), "b": np.float32([0.1, -0.2, 0.3])}


def test_pmap_and_sharded_jit_agree(mesh):
    x = np.random.default_rng(1).normal(size=(21, 5)).astype(np.float32)
    padded = jaxdev.pmap.shard_for_pmap(x, pad=True)
    pmapped = jax.pmap(_apply)(jaxdev.pmap.stack_for_pmap(_params()), padded.batch)
    from_pmap = jaxdev.pmap.unshard_from_pmap(pmapped, padded)

    sharded = jaxdev.shard_batch(x, mesh, pad=True)
    outputs = jax.jit(_apply)(jaxdev.replicate(_params(), mesh), sharded.batch)
    from_jit = jaxdev.unpad(outputs, sharded)

    assert from_pmap.shape == from_jit.shape == (21, 3)
    np.testing.assert_allclose(np.asarray(from_pmap), np.asarray(from_jit), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(from_jit), np.asarray(_apply(_params(), x)), rtol=1e-5)


# ---------------------------------------------------------------- data_parallel


@pytest.mark.parametrize("rows", [1, 7, 8, 13, 30])
def test_data_parallel_matches_single_device(mesh, rows):
    x = np.random.default_rng(rows).normal(size=(rows, 5)).astype(np.float32)
    labels = np.arange(rows)

    def fn(params, x, labels):
        return {"y": _apply(params, x), "label": labels * 2}

    out = jaxdev.data_parallel(fn, mesh)(_params(), x, labels)
    single = jax.jit(fn)(jaxdev.to_device(_params(), "cpu:0"), x, labels)
    assert out["y"].shape == (rows, 3)
    np.testing.assert_allclose(np.asarray(out["y"]), np.asarray(single["y"]), rtol=1e-6, atol=1e-6)
    assert np.asarray(out["label"]).tolist() == (labels * 2).tolist()
    assert out["y"].devices() <= set(mesh.devices.flat)


def test_data_parallel_rejects_batch_reduction(mesh):
    dp = jaxdev.data_parallel(lambda p, x: jnp.mean(x @ p["w"]), mesh)
    with pytest.raises(ShardingError, match=r"(?s)leading rows.*<root>: shape \(\)"):
        dp(_params(), np.ones((5, 5), np.float32))


def test_data_parallel_bad_batch_names_argument(mesh):
    dp = jaxdev.data_parallel(lambda p, x, y: x, mesh)
    with pytest.raises(ShardingError, match=r"\[0\]: 6.*\n  \[1\]: 5"):
        dp(_params(), np.ones((6, 2)), np.ones(5))


# ---------------------------------------------------------------- prefetch


def _batches(n, rows=8):
    for i in range(n):
        yield {"x": np.full((rows, 2), i, np.float32), "i": np.full(rows, i)}


def test_prefetch_order_and_sharding(mesh):
    want = NamedSharding(mesh, P("data"))
    with jaxdev.prefetch_to_device(_batches(7), 2, jaxdev.batch_sharding(mesh)) as it:
        got = list(it)
    assert [int(b["i"][0]) for b in got] == list(range(7))  # nothing dropped, in order
    assert all(leaf.sharding == want for b in got for leaf in jax.tree_util.tree_leaves(b))
    assert not it.thread.is_alive()


def test_prefetch_any_sharding(mesh, devices):
    rep = NamedSharding(mesh, P())
    got = list(jaxdev.prefetch_to_device(_batches(3, rows=3), 1, rep))
    assert all(b["x"].sharding == rep for b in got)
    got = list(jaxdev.prefetch_to_device(_batches(3, rows=3), 3, "cpu:5"))
    assert all(b["x"].devices() == {devices[5]} for b in got)


def test_prefetch_pad(mesh):
    got = list(
        jaxdev.prefetch_to_device(_batches(2, rows=5), 2, jaxdev.batch_sharding(mesh), pad=True)
    )
    assert all(isinstance(b, jaxdev.Padded) and b.size == 5 for b in got)
    with pytest.raises(ShardingError, match="`pad=True` needs a `target` that splits"):
        jaxdev.prefetch_to_device(_batches(2), 2, "cpu:0", pad=True)
    with pytest.raises(ShardingError, match="`size` must be an int >= 1"):
        jaxdev.prefetch_to_device(_batches(2), 0)


@pytest.mark.parametrize("kind", ["reduced", "unreduced"])
def test_prefetch_onto_a_spec_with_reduced_or_unreduced_axes(kind):
    """prefetch_to_device read ``spec[0]``, which JAX refuses for a spec with a reduced or
    unreduced set (raw ValueError). A reduced target splits the rows as any batch sharding
    does; an unreduced one is the placement's named refusal, in the consumer."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    target = NamedSharding(mesh, P("data", **{kind: {"model"}}))
    it = jaxdev.prefetch_to_device(_batches(2), 1, target)
    if kind == "unreduced":
        with pytest.raises(ShardingError, match=r"leaf \['i'\] .* unreduced over \['model'\]"):
            next(it)
        return
    got = list(it)
    assert [int(np.asarray(b["i"])[0]) for b in got] == [0, 1]
    assert got[0]["x"].sharding.spec == P("data")


def _failing_source():
    yield from _batches(2)
    raise KeyError("corrupt record 17")


@pytest.mark.parametrize("how", ["prefetch_to_device", "step.prefetch"])
def test_prefetch_of_a_non_iterable_names_the_argument(how):
    """Before: a bare TypeError "'int' object is not iterable" (StepMeter.inputs named it)."""
    step = jaxdev.make_train_step(lambda p, b: b * p, optax.sgd(0.1))
    fn = jaxdev.prefetch_to_device if how == "prefetch_to_device" else step.prefetch
    with pytest.raises(UsageError, match=r"`iterator` must be an iterable of batches.*got int"):
        fn(5)


def test_prefetch_reraises_source_exception(mesh):
    it = jaxdev.prefetch_to_device(_failing_source(), 2, jaxdev.batch_sharding(mesh))
    assert int(next(it)["i"][0]) == 0
    assert int(next(it)["i"][0]) == 1
    with pytest.raises(KeyError, match="corrupt record 17") as err:
        next(it)
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "_failing_source" in frames  # original traceback kept
    with pytest.raises(StopIteration):
        next(it)
    assert not it.thread.is_alive()


def test_prefetch_reraises_placement_error(mesh):
    bad = iter([{"x": np.ones((8, 2))}, {"x": np.ones((5, 2))}])
    it = jaxdev.prefetch_to_device(bad, 2, jaxdev.batch_sharding(mesh))
    next(it)
    with pytest.raises(ShardingError, match=r"\['x'\] has 5 rows"):
        next(it)


def _endless():
    i = 0
    while True:
        yield {"x": np.full((8,), i, np.float32)}
        i += 1


def test_prefetch_close_stops_thread_and_bounds_queue(mesh):
    before = threading.active_count()
    pulled = []

    def counting():
        for b in _endless():
            pulled.append(1)
            yield b

    with jaxdev.prefetch_to_device(counting(), 3, jaxdev.batch_sharding(mesh)) as it:
        assert int(next(it)["x"][0]) == 0
        time.sleep(0.3)
        # 1 consumed + 3 queued + at most 1 being placed / waiting to be queued.
        assert len(pulled) <= 5
        assert it.thread.is_alive()
    assert not it.thread.is_alive()
    assert threading.active_count() == before
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_break_then_close(mesh):
    it = jaxdev.prefetch_to_device(_endless(), 2, jaxdev.batch_sharding(mesh))
    for i, batch in enumerate(it):
        assert int(batch["x"][0]) == i
        if i == 3:
            break
    it.close()
    assert not it.thread.is_alive()


def test_copy_to_replicated_survives_donation_of_the_copy():
    # replicate() may lend the source's buffer to one replica (as device_put does);
    # copy_to is the documented way to donate a replica and keep the source.
    mesh = jaxdev.data_mesh()
    x = jaxdev.to_device(jnp.arange(1024.0), "cpu:0")
    r = jaxdev.copy_to(x, jaxdev.as_sharding(mesh))
    double = jax.jit(lambda a: a * 2, donate_argnums=0, out_shardings=r.sharding)
    y = double(r)
    assert r.is_deleted() and not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(x), np.arange(1024.0))
    np.testing.assert_array_equal(np.asarray(y), 2 * np.arange(1024.0))
