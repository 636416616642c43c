"""jaxdev.save / restore / Checkpointer: any layout onto any target, on 8 fake CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import CheckpointError
from jaxdev.checkpoint._checkpoint import checkpoint_step


def _params():
    return {
        "dense": {"kernel": jnp.arange(64.0).reshape(16, 4), "bias": jnp.linspace(-1, 1, 4)},
        "scale": jnp.array(3.0),
    }


def _state(tx=None):
    return jaxdev.TrainState.create(_params(), tx or optax.adam(0.1))


def _bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.fixture
def mesh():
    return jaxdev.data_mesh()


# ---------------------------------------------------------------- layouts and targets


def test_one_device_round_trip_keeps_structure_device_and_bits(tmp_path):
    state = jaxdev.to_device(_state(), "cpu:2")
    jaxdev.save(tmp_path / "c", state, step=5)
    back = jaxdev.restore(tmp_path / "c")
    assert type(back) is jaxdev.TrainState and back.rng is None and back.model_state is None
    assert type(back.opt_state[0]).__name__ == "ScaleByAdamState"
    jaxdev.assert_on_device(back, "cpu:2")
    _bits_equal(back, state)
    assert checkpoint_step(tmp_path / "c") == 5


def test_replicated_onto_fewer_devices_and_one_device(tmp_path, mesh, devices):
    state = jaxdev.replicate(_state(), mesh)
    jaxdev.save(tmp_path / "c", state)
    back = jaxdev.restore(tmp_path / "c")
    jaxdev.assert_replicated(back, mesh)
    four = jaxdev.data_mesh(devices[:4])
    on4 = jaxdev.restore(tmp_path / "c", four)
    jaxdev.assert_replicated(on4, four)
    one = jaxdev.restore(tmp_path / "c", "cpu:5")
    jaxdev.assert_on_device(one, "cpu:5")
    _bits_equal(on4, state)
    _bits_equal(one, state)


def test_batch_sharded_onto_replicated_and_back(tmp_path, mesh):
    batch = jaxdev.shard_batch({"x": np.arange(32.0).reshape(16, 2), "y": np.arange(16)}, mesh)
    jaxdev.save(tmp_path / "c", batch)
    back = jaxdev.restore(tmp_path / "c")
    jaxdev.assert_sharded(back, P("data"), mesh=mesh)
    rep = jaxdev.restore(tmp_path / "c", mesh)
    jaxdev.assert_replicated(rep, mesh)
    _bits_equal(rep, batch)


def test_stacked_is_written_once_and_restores_stacked_replicated_or_sharded(tmp_path, mesh):
    params = _params()
    stacked = jaxdev.pmap.stack_for_pmap(params)
    jaxdev.save(tmp_path / "c", stacked)
    jaxdev.save(tmp_path / "plain", params)
    size = {
        name: sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())
        for name in ("c", "plain")
    }
    assert size["c"] < size["plain"] + 7 * 64 * 4  # one copy of the kernel, not 8
    again = jaxdev.restore(tmp_path / "c")  # as saved: stacked over the same devices
    _bits_equal(again, stacked)
    assert again["dense"]["kernel"].sharding.spec == P("data")
    # Onto a device, mesh or sharding: the saved shape (n, ...), never silently one row.
    rep = jaxdev.restore(tmp_path / "c", mesh)
    jaxdev.assert_replicated(rep, mesh)
    _bits_equal(rep, stacked)
    split = jaxdev.restore(tmp_path / "c", jaxdev.batch_sharding(mesh))
    _bits_equal(split, stacked)
    # A target whose leaves have the row shape asks for the one copy (pmap state -> jit state).
    rows = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        params,
        {
            "dense": {"kernel": jaxdev.batch_sharding(mesh), "bias": NamedSharding(mesh, P())},
            "scale": NamedSharding(mesh, P()),
        },
    )
    one = jaxdev.restore(tmp_path / "c", rows)
    jaxdev.assert_sharded(one["dense"]["kernel"], P("data"), mesh=mesh)
    _bits_equal(one, params)
    like = jaxdev.restore(tmp_path / "c", stacked)  # like a stacked tree: stacked again
    _bits_equal(like, stacked)


def test_replicated_restores_into_a_stacked_target(tmp_path, mesh):
    params = _params()
    jaxdev.save(tmp_path / "c", params)
    stacked = jaxdev.restore(tmp_path / "c", jaxdev.pmap.stack_for_pmap(params))
    _bits_equal(stacked, jaxdev.pmap.stack_for_pmap(params))
    _bits_equal(jaxdev.pmap.unstack_from_pmap(stacked, check=True), params)


def test_stacked_looking_leaf_with_different_rows_is_saved_whole(tmp_path, mesh):
    batch = jaxdev.pmap.shard_for_pmap(np.arange(8.0 * 3).reshape(8, 3))  # (8, 1, 3): rows differ
    jaxdev.save(tmp_path / "c", {"b": batch})
    back = jaxdev.restore(tmp_path / "c", "cpu:0")
    assert back["b"].shape == (8, 1, 3)
    _bits_equal(back, {"b": batch})


def test_tree_of_shapedtypestructs_and_shardings(tmp_path, mesh):
    state = _state()
    jaxdev.save(tmp_path / "c", state)
    rep = NamedSharding(mesh, P())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    back = jaxdev.restore(tmp_path / "c", abstract)
    assert type(back) is jaxdev.TrainState
    jaxdev.assert_replicated(back, mesh)
    shardings = jax.tree.map(lambda x: SingleDeviceSharding(jaxdev.d2l.cpu(3)), state)
    on3 = jaxdev.restore(tmp_path / "c", shardings)
    jaxdev.assert_on_device(on3, "cpu:3")
    _bits_equal(on3, state)


def test_restore_like_an_existing_sharded_state(tmp_path, mesh):
    state = _state()
    jaxdev.save(tmp_path / "c", state)
    kernel = NamedSharding(mesh, P("data"))
    target = jaxdev.replicate(state, mesh)
    target = target._replace(
        params={
            **target.params,
            "dense": {
                **target.params["dense"],
                "kernel": jax.device_put(target.params["dense"]["kernel"], kernel),
            },
        }
    )
    back = jaxdev.restore(tmp_path / "c", target)
    jaxdev.assert_same_placement(back, target)
    _bits_equal(back, state)


def test_reduced_arrays_round_trip_bit_identical_and_unreduced_ones_are_refused(tmp_path):
    """A tree placed with ``reduced`` axes could not be saved (JAX's raw ValueError iterating
    its spec, in jaxdev's and orbax's writers) nor restored onto a reduced target (the
    checksum's bitcast has no reduced rule: raw NotImplementedError). Both are written and
    checked as the same buffers without the reduced set, which the metadata keeps. An
    unreduced leaf (a step's output) is refused by name: its value is the sum of its copies."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    rules = [("w", P("model", reduced={"data"})), ("b", P(None, "model", reduced={"data"}))]
    tree = {"w": jnp.arange(8.0), "b": jnp.arange(16, dtype=jnp.bfloat16).reshape(2, 8)}
    placed = jaxdev.shard_params(tree, mesh, rules)
    jaxdev.save(tmp_path / "reduced", placed)
    jaxdev.save(tmp_path / "plain", tree)
    layout = {k: x.sharding for k, x in placed.items()}
    for path, target in [("reduced", None), ("reduced", layout), ("plain", layout)]:
        back = jaxdev.restore(tmp_path / path, target)
        assert {k: x.sharding for k, x in back.items()} == layout
        _bits_equal(back, tree)
    _bits_equal(jaxdev.restore(tmp_path / "reduced", "cpu:0"), tree)
    u = NamedSharding(mesh, P("model", unreduced={"data"}))
    summed = jax.jit(lambda x: x * 2, out_shardings=u)(placed["w"])
    with pytest.raises(CheckpointError, match=r"\['w'\]: unreduced over \['data'\]"):
        jaxdev.save(tmp_path / "unreduced", {"w": summed})


def test_rules_fsdp_on_a_mesh(tmp_path, mesh):
    state = jaxdev.TrainState.create({"w": jnp.ones((64, 32)), "b": jnp.ones(32)}, optax.sgd(0.1))
    jaxdev.save(tmp_path / "c", jaxdev.replicate(state, mesh))
    back = jaxdev.restore(tmp_path / "c", mesh, rules="fsdp")
    assert type(back) is jaxdev.TrainState
    jaxdev.assert_sharded(back.params["w"], P("data"), mesh=mesh)
    jaxdev.assert_replicated(back.params["b"], mesh)
    _bits_equal(back, state)
    # ... and an FSDP checkpoint back onto one device for evaluation.
    jaxdev.save(tmp_path / "f", back)
    one = jaxdev.restore(tmp_path / "f", "cpu:0")
    jaxdev.assert_on_device(one, "cpu:0")
    _bits_equal(one, state)


def test_python_scalars_none_and_numpy_leaves_round_trip(tmp_path):
    tree = {
        "i": 2**40 + 5,
        "f": 0.1,
        "inf": float("-inf"),
        "b": True,
        "c": 1 + 2j,
        "none": None,
        "np": np.arange(3, dtype=np.int16),
        "list": [1, (2.5, None)],
    }
    jaxdev.save(tmp_path / "c", tree)
    back = jaxdev.restore(tmp_path / "c")
    assert back["i"] == 2**40 + 5 and type(back["i"]) is int
    assert back["f"] == 0.1 and back["inf"] == float("-inf") and back["b"] is True
    assert back["c"] == 1 + 2j and back["none"] is None and back["list"] == [1, (2.5, None)]
    assert isinstance(back["np"], np.ndarray) and back["np"].dtype == np.int16
    assert back["np"].tolist() == [0, 1, 2]


def test_special_float_bits_survive(tmp_path):
    x = jnp.array([np.nan, -0.0, np.float32(1e-45), -np.inf], jnp.float32)
    x = x.at[0].set(jax.lax.bitcast_convert_type(jnp.uint32(0x7FC00123), jnp.float32))
    jaxdev.save(tmp_path / "c", {"x": x, "h": x.astype(jnp.bfloat16)})
    _bits_equal(jaxdev.restore(tmp_path / "c"), {"h": x.astype(jnp.bfloat16), "x": x})


def test_metrics_and_device_log_round_trip(tmp_path):
    m = jaxdev.metrics.Collection.from_values(
        {"loss": jaxdev.metrics.Mean}, {"loss": jnp.arange(4.0)}
    )
    log = jaxdev.metrics.DeviceLog.create(4).record(1.5).record(2.5)
    jaxdev.save(tmp_path / "c", {"m": m, "log": log})
    back = jaxdev.restore(tmp_path / "c")
    assert isinstance(back["m"], jaxdev.metrics.Collection) and isinstance(
        back["log"], jaxdev.metrics.DeviceLog
    )
    assert float(back["m"]["loss"].compute()) == 1.5
    assert back["log"].fetch().tolist() == [1.5, 2.5]


# ---------------------------------------------------------------- errors


def test_missing_and_extra_leaves_are_named(tmp_path):
    jaxdev.save(tmp_path / "c", _params())
    target = {"dense": {"kernel": jnp.zeros((16, 4))}, "scale": jnp.zeros(()), "new": jnp.zeros(2)}
    with pytest.raises(CheckpointError) as e:
        jaxdev.restore(tmp_path / "c", target)
    msg = str(e.value)
    assert str(tmp_path / "c") in msg
    assert "['new']: in `target` (float32[2]), not in the checkpoint" in msg
    assert "['dense']['bias']: in the checkpoint" in msg and "float32[4]" in msg


def test_shape_dtype_and_indivisible_are_named(tmp_path, mesh):
    jaxdev.save(tmp_path / "c", _params())
    target = jax.tree.map(lambda x: x, _params())
    target["dense"]["kernel"] = jnp.zeros((16, 5))
    target["dense"]["bias"] = jnp.zeros(4, jnp.int32)
    with pytest.raises(CheckpointError) as e:
        jaxdev.restore(tmp_path / "c", target)
    msg = str(e.value)
    assert "['dense']['kernel']: saved shape (16, 4) (float32), asked (16, 5)" in msg
    assert "['dense']['bias']: saved dtype float32, asked int32" in msg
    with pytest.raises(CheckpointError, match=r"\['scale'\]: shape \(\) cannot be split"):
        jaxdev.restore(tmp_path / "c", jaxdev.batch_sharding(mesh))
    with pytest.raises(CheckpointError, match=r"\['dense'\]\['bias'\]: shape \(4,\) cannot"):
        jaxdev.restore(
            tmp_path / "c",
            {"dense": {"kernel": mesh, "bias": NamedSharding(mesh, P("data"))}, "scale": mesh},
        )


def test_missing_checkpoint_existing_path_and_bad_leaves(tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint at .*nope: the directory does not"):
        jaxdev.restore(tmp_path / "nope")
    jaxdev.save(tmp_path / "c", {"w": jnp.ones(2)})
    with pytest.raises(CheckpointError, match="already exists: pass `overwrite=True`"):
        jaxdev.save(tmp_path / "c", {"w": jnp.ones(2)})
    jaxdev.save(tmp_path / "c", {"w": jnp.zeros(2)}, overwrite=True)
    assert jaxdev.restore(tmp_path / "c")["w"].tolist() == [0.0, 0.0]
    with pytest.raises(CheckpointError, match=r"\['name'\]: str"):
        jaxdev.save(tmp_path / "d", {"name": "x", "w": jnp.ones(2)})
    x = jnp.ones(3)
    x.delete()
    with pytest.raises(CheckpointError, match=r"\['w'\]: deleted or donated"):
        jaxdev.save(tmp_path / "d", {"w": x})
    assert not (tmp_path / "d").exists()


def test_numbered_directory_hint(tmp_path):
    with jaxdev.Checkpointer(tmp_path, async_=False) as ckpt:
        ckpt.save(4, {"w": jnp.ones(2)})
    with pytest.raises(CheckpointError, match=r"numbered checkpoints \(steps \[4\]\)"):
        jaxdev.restore(tmp_path)


# ---------------------------------------------------------------- Checkpointer


def test_checkpointer_every_keep_latest_and_no_overwrite(tmp_path):
    state = _state()
    with jaxdev.Checkpointer(tmp_path, keep=2, every=5) as ckpt:
        saved = [s for s in range(5, 21) if ckpt.save(s, state._replace(step=jnp.int32(s)))]
        assert saved == [5, 10, 15, 20]
        assert ckpt.save(20, state) is False  # never overwritten
        assert ckpt.save(21, state, force=True) is True
        ckpt.wait()
        assert ckpt.all_steps() == [20, 21] and ckpt.latest_step() == 21
        assert int(ckpt.restore(state, step=20).step) == 20
        with pytest.raises(CheckpointError, match=r"No checkpoint for step 5 .*\[20, 21\]"):
            ckpt.restore(step=5)
    again = jaxdev.Checkpointer(tmp_path)
    assert again.latest_step() == 21
    _bits_equal(again.restore(state), state)
    again.close()


def test_checkpointer_metrics_and_empty_directory(tmp_path, mesh):
    state = jaxdev.replicate(_state(), mesh)
    metrics = jaxdev.metrics.Collection.from_values(
        {"loss": jaxdev.metrics.Mean}, {"loss": jnp.ones(8)}
    )
    with jaxdev.Checkpointer(tmp_path / "a") as ckpt:
        with pytest.raises(CheckpointError, match="No checkpoint in .*nothing has been saved"):
            ckpt.restore()
        ckpt.save(1, state, metrics={"train": metrics, "log": jaxdev.metrics.DeviceLog.create(2)})
        ckpt.save(2, state)
        back = ckpt.restore(state)
        jaxdev.assert_replicated(back, mesh)
        assert ckpt.restore_metrics() is None  # step 2 has none
        got = ckpt.restore_metrics(step=1)
        assert float(got["train"]["loss"].compute()) == 1.0
        assert isinstance(got["log"], jaxdev.metrics.DeviceLog)


def test_checkpointer_arguments_are_checked(tmp_path):
    with pytest.raises(CheckpointError, match="`keep` must be a positive int"):
        jaxdev.Checkpointer(tmp_path, keep=0)
    with pytest.raises(CheckpointError, match="`every` must be a positive int"):
        jaxdev.Checkpointer(tmp_path, every=0)
