"""Placement: to_device / copy_to / to_host / placement report, and their bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import (
    DeletedArrayError,
    LeafTypeError,
    LeafValueError,
    PlacementError,
    ShardingError,
)

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint8, np.bool_]


def _mlp_params():
    return {
        "Dense_0": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)},
        "Dense_1": {"kernel": jnp.ones((8, 2)), "bias": jnp.zeros(2)},
    }


# ---------------------------------------------------------------- to_device


def test_already_placed_leaves_and_tree_come_back_as_same_objects(devices):
    params = jaxdev.to_device(_mlp_params(), devices[1])
    again = jaxdev.to_device(params, "cpu:1")
    assert again is params
    # Raw JAX returns new objects even when nothing moves.
    assert jax.device_put(params["Dense_0"]["bias"], devices[1]) is not params["Dense_0"]["bias"]


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_an_already_placed_tree_with_typed_keys_comes_back_as_the_same_object(impl):
    """Was: a new tree (the same leaves) whenever a typed PRNG key was among the leaves."""
    mesh = jaxdev.make_mesh({"data": 8})
    keys = jax.random.split(jax.random.key(0, impl=impl), 8)
    for target in (mesh, NamedSharding(mesh, P("data")), "cpu:1"):
        tree = jaxdev.to_device({"w": np.ones(8), "key": keys}, target)
        assert jaxdev.to_device(tree, target) is tree


def test_only_leaves_that_must_move_are_transferred(devices):
    tree = {"a": jaxdev.to_device(jnp.ones(3), devices[2]), "b": jnp.ones(3), "c": np.ones(2)}
    out = jaxdev.to_device(tree, devices[2])
    assert out is not tree
    assert out["a"] is tree["a"]
    assert jaxdev.device_of(out["b"]) == devices[2] and out["b"].committed
    assert jaxdev.device_of(out["c"]) == devices[2]


def test_uncommitted_arrays_get_committed(devices):
    x = jnp.ones(3)
    assert not x.committed
    y = jaxdev.to_device(x, devices[0])
    assert y.committed and jaxdev.to_device(y, devices[0]) is y


def test_moves_between_devices_and_to_shardings(devices):
    x = jaxdev.to_device(jnp.arange(16.0).reshape(8, 2), "cpu:3")
    y = jaxdev.to_device(x, "cpu:5")
    assert jaxdev.device_of(y) == devices[5]
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    s = NamedSharding(mesh, P("data"))
    z = jaxdev.to_device({"x": y}, s)
    assert z["x"].sharding == s
    assert jaxdev.to_device(z, s) is z
    np.testing.assert_array_equal(np.asarray(z["x"]), np.arange(16.0).reshape(8, 2))


def test_none_passes_through_and_numbers_are_placed(devices):
    tree = {"a": None, "b": 1.5, "c": 3, "d": True, "e": [None, np.float32(2)]}
    out = jaxdev.to_device(tree, "cpu:1")
    assert out["a"] is None and out["e"][0] is None
    assert jaxdev.devices_of(out) == {devices[1]}
    assert out["c"].dtype == jnp.int32 and out["d"].dtype == jnp.bool_


@pytest.mark.parametrize(
    "leaf, kind",
    [
        ("hello", "builtins.str is not an array"),
        (object(), "builtins.object is not an array"),
        (np.array([object()]), "dtype object cannot live on a device"),
        (np.array(["a", "b"]), "dtype <U1 cannot live on a device"),
    ],
)
def test_non_array_leaves_name_their_path(leaf, kind):
    tree = {"params": {"ok": jnp.ones(2), "bad": leaf}}
    for fn in (lambda t: jaxdev.to_device(t, "cpu:0"), lambda t: jaxdev.copy_to(t, "cpu:0")):
        with pytest.raises(LeafTypeError) as err:
            fn(tree)
        msg = str(err.value)
        assert "`tree` leaf ['params']['bad']" in msg and kind in msg and "Available devices" in msg


def test_int_values_that_do_not_fit_int32_are_refused():
    assert int(jnp.asarray(np.int64(2**40 + 5))) == 5  # JAX truncates silently
    with pytest.raises(LeafValueError, match=r"\['big'\]: the Python int 1099511627781"):
        jaxdev.to_device({"big": 2**40 + 5}, "cpu:0")
    with pytest.raises(LeafValueError, match=r"\['arr'\]: int64 values in \[0, 1099511627781\]"):
        jaxdev.to_device({"arr": np.array([0, 2**40 + 5])}, "cpu:0")
    with pytest.raises(LeafValueError, match="uint32"):
        jaxdev.to_device(np.array([2**33], np.uint64), "cpu:0")
    # In-range int64 values are fine.
    out = jaxdev.to_device({"arr": np.array([-(2**31), 2**31 - 1])}, "cpu:0")
    assert out["arr"].tolist() == [-(2**31), 2**31 - 1]


def test_deleted_and_donated_leaves_are_named(devices):
    x = jaxdev.to_device(jnp.ones(3), devices[0])
    x.delete()
    with pytest.raises(DeletedArrayError, match=r"deleted or donated leaf/leaves: \['w'\]"):
        jaxdev.to_device({"w": x}, devices[0])
    y = jaxdev.to_device(jnp.ones(3), devices[0])
    jax.jit(lambda a: a + 1, donate_argnums=0)(y)
    for fn in (
        lambda t: jaxdev.copy_to(t, "cpu:0"),
        jaxdev.to_host,
        jaxdev.devices_of,
    ):
        with pytest.raises(DeletedArrayError, match=r"\['opt'\]\[0\]"):
            fn({"opt": [y]})
    # The report shows it instead of raising.
    assert jaxdev.placement({"w": x}).leaves[0].sharding == "deleted"


def test_sharding_that_does_not_divide_names_leaf(devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    s = NamedSharding(mesh, P("data"))
    with pytest.raises(ShardingError) as err:
        jaxdev.to_device({"x": np.ones((8, 2)), "y": np.ones((5, 2))}, s)
    assert "leaf ['y'] with shape (5, 2)" in str(err.value)
    with pytest.raises(ShardingError, match=r"leaf \['s'\] with shape \(\)"):
        jaxdev.to_device({"s": np.float32(1.0)}, s)


def test_inside_jit_device_target_raises_and_sharding_constrains(devices):
    @jax.jit
    def bad(x):
        return jaxdev.to_device(x, devices[1]) * 2

    with pytest.raises(PlacementError, match="ignores placing on a single device inside jit"):
        bad(jnp.ones(8))

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    s = NamedSharding(mesh, P("data"))

    @jax.jit
    def good(x):
        return jaxdev.to_device(x * 2, s)

    out = good(jnp.ones(8))
    assert out.sharding.is_equivalent_to(s, 1)
    for fn in (lambda x: jaxdev.copy_to(x, s), jaxdev.to_host):
        with pytest.raises(PlacementError, match="inside a jax.jit trace"):
            jax.jit(fn)(jnp.ones(8))


# ---------------------------------------------------------------- copy_to / to_host


def test_copy_to_always_makes_new_buffers(devices):
    x = jaxdev.to_device(jnp.arange(4.0), devices[0])
    y = jaxdev.copy_to(x, devices[0])
    assert y is not x and y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    host = np.arange(4, dtype=np.float32)
    z = jaxdev.copy_to(host, devices[0])
    assert z.unsafe_buffer_pointer() != host.ctypes.data


def test_to_host_is_one_device_get(monkeypatch, devices):
    calls = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda t: calls.append(1) or real(t))
    out = jaxdev.to_host(jaxdev.to_device(_mlp_params(), devices[0]))
    assert len(calls) == 1
    assert isinstance(out["Dense_0"]["kernel"], np.ndarray)


# ---------------------------------------------------------------- where is it


def test_device_of(devices):
    assert jaxdev.device_of(np.ones(2)) is None
    a = jaxdev.to_device(jnp.ones(2), devices[0])
    assert jaxdev.device_of(a) == devices[0]
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    sharded = jaxdev.to_device(jnp.ones(8), NamedSharding(mesh, P("data")))
    with pytest.raises(PlacementError, match="spans 8 devices"):
        jaxdev.device_of(sharded)
    assert jaxdev.devices_of({"s": sharded, "a": a}) == set(devices)


def test_placement_counts_sub_byte_dtypes_packed(devices):
    """int4 is stored two to a byte (XLA packs it, as plan and the ledger count it); the
    report said one byte an element (JAX's nbytes)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    tree = {
        "one": jaxdev.to_device(jnp.ones((4, 8), jnp.int4), devices[0]),
        "split": jaxdev.to_device(jnp.ones((16, 3), jnp.int4), NamedSharding(mesh, P("data"))),
    }
    rows = {r.path: r.bytes_per_device for r in jaxdev.placement(tree).leaves}
    assert rows == {"['one']": 16, "['split']": 3}  # 32 / 2; 2 x 3 = 6 elements / 2


def test_placement_report(devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    tree = {
        "w": jaxdev.to_device(jnp.ones((4, 8), jnp.float32), devices[0]),
        "b": jaxdev.to_device(jnp.ones((16,), jnp.bfloat16), NamedSharding(mesh, P("data"))),
        "r": jaxdev.to_device(jnp.ones((2,), jnp.int8), NamedSharding(mesh, P())),
        "h": np.ones(3, np.float32),
        "u": jnp.ones(1),
    }
    report = jaxdev.placement(tree)
    rows = {r.path: r for r in report.leaves}
    assert rows["['w']"].devices == ("cpu:0",) and rows["['w']"].bytes_per_device == 128
    assert rows["['b']"].bytes_per_device == 4 and len(rows["['b']"].devices) == 8
    assert rows["['b']"].sharding == "mesh(data=8) P('data',)"
    assert rows["['r']"].bytes_per_device == 2 and rows["['r']"].memory_kind == "device"
    assert rows["['h']"].sharding == "host" and rows["['h']"].committed is None
    assert rows["['u']"].committed is False and rows["['w']"].committed is True
    assert report.bytes_by_device["cpu:0"] == 128 + 4 + 2 + 4
    assert report.bytes_by_device["cpu:7"] == 4 + 2
    text = str(report)
    assert "['b']" in text and "bytes/device" in text and "5 leaves" in text
    moved = dict(tree, w=jaxdev.to_device(tree["w"], devices[1]))
    assert report.diff(jaxdev.placement(moved)) == [
        "['w']: sharding 'cpu:0' != 'cpu:1'",
        "['w']: devices ('cpu:0',) != ('cpu:1',)",
    ]
    assert report.diff(report) == []
    assert jaxdev.placement({"x": np.ones(1)}).diff(jaxdev.placement({})) == [
        "['x']: only in first tree"
    ]


# ---------------------------------------------------------------- model pytrees


def test_flax_linen_nnx_and_optax_trees(devices):
    frozen = FrozenDict({"params": _mlp_params()})
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    opt = optax.adam(1e-3).init(_mlp_params())
    for tree in (frozen, state, opt):
        placed = jaxdev.to_device(tree, devices[3])
        assert type(placed) is type(tree)
        assert jaxdev.devices_of(placed) == {devices[3]}
        assert jaxdev.to_device(placed, devices[3]) is placed
        assert len(jaxdev.placement(placed).leaves) == len(jax.tree.leaves(tree))


# ---------------------------------------------------------------- properties


def _arrays(dtype):
    """Arrays of ``dtype`` built from raw bytes: NaN payloads, -0.0, inf included."""
    itemsize = np.dtype(dtype).itemsize
    shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)

    def build(shape_and_bytes):
        shape, raw = shape_and_bytes
        n = int(np.prod(shape, dtype=np.int64))
        buf = (raw * (n * itemsize // max(len(raw), 1) + 1))[: n * itemsize]
        if dtype is np.bool_:
            return np.frombuffer(buf, np.uint8).astype(bool).reshape(shape)
        return np.frombuffer(buf, dtype).reshape(shape).copy()

    return st.tuples(shapes, st.binary(min_size=1, max_size=64)).map(build)


def _trees(dtype):
    leaf = _arrays(dtype)
    return st.one_of(
        st.dictionaries(st.sampled_from("abc"), leaf, max_size=3),
        st.lists(leaf, max_size=3),
        st.tuples(leaf, leaf),
        st.dictionaries(st.sampled_from("xy"), leaf, max_size=2).map(FrozenDict),
        st.dictionaries(st.sampled_from("pq"), leaf, min_size=1, max_size=2).map(nnx.State),
    )


def _bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, x.tobytes()


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), index=st.integers(0, 7))
def test_round_trip_is_bit_exact(data, dtype, index):
    tree = data.draw(_trees(dtype))
    target = jaxdev.d2l.cpu(index)
    placed = jaxdev.to_device(tree, target)
    back = jaxdev.to_host(placed)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert [_bits(a) for a in jax.tree.leaves(back)] == [_bits(a) for a in jax.tree.leaves(tree)]
    # Twice: the same objects.
    again = jaxdev.to_device(placed, target)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed)))
    # copy_to never shares a buffer with its input.
    copied = jaxdev.copy_to(placed, target)
    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(placed)):
        if a.size:
            assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        assert _bits(a) == _bits(b)


def test_special_float_values_round_trip_exactly():
    payload_nan = np.array([0x7FC00001, 0xFFC12345, 0x80000000], np.uint32).view(np.float32)
    tree = {"f32": payload_nan, "neg0": np.array([-0.0, np.inf, -np.inf], np.float16)}
    back = jaxdev.to_host(jaxdev.to_device(tree, "cpu:2"))
    for k in tree:
        assert back[k].tobytes() == tree[k].tobytes()


def test_copy_to_is_safe_from_later_writes_to_a_reused_host_buffer(devices):
    host = np.arange(100_000, dtype=np.float32)  # large enough for JAX to alias on CPU
    copied = jaxdev.copy_to(host, devices[0])
    host[0] = 7.0
    assert float(copied[0]) == 0.0


def test_copy_to_a_mesh_never_aliases_the_source_so_donation_is_safe(devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    src = jaxdev.to_device(jnp.arange(16.0), devices[0])
    rep = jaxdev.copy_to(src, NamedSharding(mesh, P()))
    pointers = {s.data.unsafe_buffer_pointer() for s in rep.addressable_shards}
    assert src.unsafe_buffer_pointer() not in pointers
    jax.jit(lambda a: a + 1, donate_argnums=0)(rep)
    assert not src.is_deleted() and float(src.sum()) == 120.0


def test_importing_jaxdev_starts_no_backend():
    from conftest import run_python

    proc = run_python("from jaxdev._devices import backend_started; print(backend_started())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_report_paths_follow_the_structure_across_calls():
    # Key-path strings are cached per treedef: equal structures share them,
    # any change of keys or nesting gives a new, correct set.
    a = {"w": jnp.ones(2), "b": {"c": jnp.ones(3)}}
    b = {"w": jnp.zeros(2), "b": {"d": jnp.ones(3)}}
    paths = [[r.path for r in jaxdev.placement(t).leaves] for t in (a, a, b, [a, b])]
    assert paths[0] == paths[1] == ["['b']['c']", "['w']"]
    assert paths[2] == ["['b']['d']", "['w']"]
    assert paths[3] == ["[0]['b']['c']", "[0]['w']", "[1]['b']['d']", "[1]['w']"]


# ---------------------------------------------------------------- issue 9 / 11 additions


@pytest.mark.parametrize(
    "leaf", [np.array([1.0, 1e300]), 1e300, np.float64(-3e39), np.array([[np.inf, 4e38]])]
)
def test_finite_floats_that_overflow_float32_are_refused(leaf):
    # JAX turns them into inf with only numpy's warning.
    with pytest.raises(LeafValueError, match=r"`tree` leaf \['x'\]: the finite value .*overflows"):
        jaxdev.to_device({"x": leaf}, "cpu:0")
    with pytest.raises(LeafValueError, match="overflows float32"):
        jaxdev.copy_to({"x": leaf}, "cpu:0")


def test_float64_that_fits_and_inf_nan_are_placed():
    out = jaxdev.to_device({"x": np.array([1.5, np.inf, -np.inf, np.nan, 3e38])}, "cpu:0")
    got = np.asarray(out["x"])
    assert got.dtype == np.float32 and np.isinf(got[1:3]).all() and np.isnan(got[3])


@pytest.mark.parametrize("leaf", [np.array(np.inf), np.array(-np.inf), np.array(np.nan)])
def test_zero_dim_float64_inf_nan_are_placed(leaf):
    """A 0-d float64 array holding inf or nan is placed like the same values in a 1-d array
    (was refused as "the finite value inf ... overflows float32")."""
    got = np.asarray(jaxdev.to_device({"x": leaf}, "cpu:0")["x"])
    assert got.dtype == np.float32 and np.array_equal(got, leaf, equal_nan=True)


def test_where_is_it_refuses_tracers_instead_of_saying_host():
    @jax.jit
    def f(x):
        with pytest.raises(PlacementError, match="`devices_of` inside a jax.jit trace"):
            jaxdev.devices_of({"x": x})
        with pytest.raises(PlacementError, match="inside a jax.jit trace"):
            jaxdev.device_of(x)
        return x

    f(jnp.ones(2))


def test_a_mesh_target_means_replicated(devices):
    mesh = jaxdev.data_mesh()
    out = jaxdev.to_device({"w": np.ones(3, np.float32)}, mesh)
    assert out["w"].sharding.is_fully_replicated and len(out["w"].sharding.device_set) == 8
    assert jaxdev.to_device(out, mesh) is out
    assert jaxdev.as_sharding(mesh) == jaxdev.as_sharding(mesh)


def test_a_bad_target_is_named_target_not_spec():
    with pytest.raises(jaxdev.DeviceNotFoundError, match="`target`=99 is out of range"):
        jaxdev.to_device(jnp.ones(2), 99)
    with pytest.raises(jaxdev.UsageError, match="`target`='xpu:1' names the unknown"):
        jaxdev.as_sharding("xpu:1")


# ---------------------------------------------------------------- refilled host buffers
# jax.device_put uses a 64-byte-aligned numpy buffer in place on CPU, even with
# may_alias=False (jax 0.10.2 and 0.12; jax-ml/jax#37830), and copies an unaligned large
# one after the call returns: a loader refilling one buffer would change placed batches.


def _host_buffer(shape, offset=0):
    """A float32 buffer ``offset`` bytes past a page boundary (0: JAX uses it in place)."""
    nbytes = int(np.prod(shape)) * 4
    raw = np.empty(nbytes + 8192, np.uint8)
    start = -raw.ctypes.data % 4096 + offset
    return raw[start : start + nbytes].view(np.float32).reshape(shape)


PLACEMENTS = {
    "to_device-cpu:0": lambda x, mesh: jaxdev.to_device(x, "cpu:0"),
    "to_device-NamedSharding": lambda x, mesh: jaxdev.to_device(x, jaxdev.batch_sharding(mesh)),
    "to_device-mesh": lambda x, mesh: jaxdev.to_device(x, mesh),
    "to_device-tree": lambda x, mesh: jaxdev.to_device(x, {"x": jaxdev.as_sharding(mesh)}),
    "copy_to-cpu:0": lambda x, mesh: jaxdev.copy_to(x, "cpu:0"),
    "copy_to-NamedSharding": lambda x, mesh: jaxdev.copy_to(x, jaxdev.batch_sharding(mesh)),
    "replicate": lambda x, mesh: jaxdev.replicate(x, mesh),
}


@pytest.mark.parametrize("place", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_a_placed_numpy_leaf_never_shares_its_host_buffer(place, mesh):
    host = _host_buffer((16, 64))
    host[...] = 1.0
    lo, hi = host.ctypes.data, host.ctypes.data + host.nbytes
    out = place({"x": host}, mesh)["x"]
    shared = [
        str(s.device) for s in out.addressable_shards if lo <= s.data.unsafe_buffer_pointer() < hi
    ]
    assert not shared, f"shards on {shared} alias the numpy buffer"
    host[...] = 2.0
    assert np.unique(np.asarray(out)).tolist() == [1.0]


@pytest.fixture
def busy_threads():
    """Two threads burning CPU (numpy releases the GIL) beside the test; stopped after it."""
    import threading

    stop = threading.Event()

    def burn():
        a = np.random.default_rng(0).normal(size=(256, 256))
        while not stop.is_set():
            a = np.tanh(a @ a)

    threads = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()


@pytest.mark.parametrize("offset", [0, 16], ids=["page-aligned", "unaligned"])
@pytest.mark.parametrize("place", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_a_refilled_buffer_placed_30_times_under_load_keeps_every_batch(
    place, offset, mesh, busy_threads
):
    buf = _host_buffer((64, 256), offset)
    got = []
    for i in range(30):
        buf[...] = i  # the loader refills its one buffer
        got.append(place({"x": buf}, mesh)["x"])
    values = [np.unique(np.asarray(jax.device_get(b))).tolist() for b in got]
    assert values == [[float(i)] for i in range(30)]


def _read_only_over_writeable(source, tmp_path, shape):
    """``(reader, writer)``: a read-only array, and a writeable handle on the same memory."""
    nbytes = int(np.prod(shape)) * 4
    if source == "memmap-r":  # a file another handle (a loader process) writes
        path = tmp_path / "batch.bin"
        np.zeros(shape, np.float32).tofile(path)
        writer = np.memmap(path, np.float32, "r+", shape=shape)
        return np.memmap(path, np.float32, "r", shape=shape), writer
    memory = bytearray(nbytes + 64)  # a read-only memoryview says nothing of its owner
    start = -np.frombuffer(memory, np.uint8).ctypes.data % 64  # aligned: JAX uses it in place
    writer = np.frombuffer(memory, np.uint8)[start : start + nbytes].view(np.float32)
    reader = np.frombuffer(memoryview(memory).toreadonly(), np.uint8)[start : start + nbytes]
    return reader.view(np.float32).reshape(shape), writer.reshape(shape)


@pytest.mark.parametrize("source", ["memmap-r", "readonly-memoryview"])
@pytest.mark.parametrize("place", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_a_read_only_array_over_memory_someone_writes_is_copied_when_placed(
    place, source, mesh, tmp_path
):
    reader, writer = _read_only_over_writeable(source, tmp_path, (16, 64))
    assert not reader.flags.writeable
    writer[...] = 1.0
    out = place({"x": reader}, mesh)["x"]
    writer[...] = 2.0  # was: the placed array read 2.0 (to_device, replicate: aliased)
    assert np.unique(np.asarray(out)).tolist() == [1.0]


@pytest.mark.parametrize("copy", [False, True], ids=["to_device", "copy_to"])
def test_a_tree_on_a_mesh_of_the_same_devices_in_another_order_moves(copy, mesh):
    # put_leaves re-laid it out with a jit, which takes no other device order: was a raw
    # ValueError 'Received incompatible devices for jitted computation'
    other = jax.make_mesh((8,), ("o",), devices=jax.devices()[::-1])
    x = jax.device_put(jnp.arange(16.0), NamedSharding(other, P()))
    place = jaxdev.copy_to if copy else jaxdev.to_device
    for spec in (P(), P("data")):
        out = place({"x": x}, {"x": NamedSharding(mesh, spec)})["x"]
        assert out.sharding == NamedSharding(mesh, spec)
        assert np.asarray(out).tolist() == list(range(16))


@pytest.mark.multiprocess
@pytest.mark.processes(2, devices=4, timeout=120)
def test_a_placed_numpy_leaf_never_shares_its_host_buffer_across_processes():
    # each process builds its shards of a global array from its host value (_from_host,
    # make_array_from_callback): every shard aliased the buffer, copy_to's too
    mesh = jaxdev.make_mesh({"data": 8})
    places = {
        "to_device(mesh)": lambda x: jaxdev.to_device(x, mesh),
        "to_device(batch_sharding)": lambda x: jaxdev.to_device(x, jaxdev.batch_sharding(mesh)),
        "to_device(tree)": lambda x: jaxdev.to_device({"x": x}, {"x": jaxdev.as_sharding(mesh)}),
        "replicate": lambda x: jaxdev.replicate(x, mesh),
        "copy_to(mesh)": lambda x: jaxdev.copy_to(x, mesh),
    }
    wrong = {}
    for name, place in places.items():
        host = _host_buffer((16, 64))
        host[...] = 1.0
        out = jax.tree.leaves(place(host))[0]
        host[...] = 2.0
        seen = {float(v) for s in out.addressable_shards for v in np.unique(np.asarray(s.data))}
        if seen != {1.0}:
            wrong[name] = sorted(seen)
    assert not wrong, f"placed arrays changed with their host buffer: {wrong}"
