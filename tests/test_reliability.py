"""Nothing silently wrong (issue 11): refilled loader buffers, the prefetch thread's
life, bit-exact unpadding, zero-size leaves (8 fake CPU devices)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import jaxdev
from jaxdev import _multihost
from jaxdev._batches import detach_host


@pytest.fixture
def mesh(devices):
    return jaxdev.data_mesh(devices)


def aligned(shape, dtype=np.float32, align=4096):
    """An array starting on a page boundary: JAX's CPU client uses such memory in place."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def unaligned(shape, dtype=np.float32):
    """An array 16 bytes past a 64-byte boundary: JAX's CPU client copies it later."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + 16
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# JAX uses a page-aligned buffer in place (every time); it copies a large unaligned one
# in the background, racing the refill (about every other time on 8 fake CPUs).
BUFFERS = {"page-aligned": aligned, "unaligned": unaligned}
COLUMNS = {aligned: 4, unaligned: 256}
TRIES = {aligned: 1, unaligned: 8}


def refilling(buf, n):
    """A loader that refills one buffer: batch i is all i."""
    for i in range(n):
        buf[...] = i
        yield buf


def assert_batches(got, n):
    """Batch i holds only the value i (read after every batch was taken)."""
    values = [np.unique(np.asarray(jax.device_get(b))).tolist() for b in got]
    assert values == [[float(i)] for i in range(n)]


# ---------------------------------------------------------------- 1. refilled buffers


@pytest.mark.parametrize("make", BUFFERS.values(), ids=BUFFERS.keys())
@pytest.mark.parametrize("rows, pad", [(16, False), (16, True), (13, True)])
def test_shard_batch_places_the_values_of_call_time(mesh, make, rows, pad):
    for _ in range(TRIES[make]):
        buf = make((rows * (64 if make is unaligned else 1), COLUMNS[make]))
        got = [jaxdev.shard_batch(b, mesh, pad=pad) for b in refilling(buf, 6)]
        assert_batches([p.batch if pad else p for p in got], 6)


@pytest.mark.parametrize("make", BUFFERS.values(), ids=BUFFERS.keys())
@pytest.mark.parametrize("rows, pad", [(16, False), (16, True), (13, True)])
def test_shard_for_pmap_places_the_values_of_call_time(make, rows, pad):
    for _ in range(TRIES[make]):
        buf = make((rows * (64 if make is unaligned else 1), COLUMNS[make]))
        got = [jaxdev.pmap.shard_for_pmap(b, pad=pad) for b in refilling(buf, 6)]
        assert_batches([p.batch if pad else p for p in got], 6)


@pytest.mark.parametrize("make", BUFFERS.values(), ids=BUFFERS.keys())
@pytest.mark.parametrize("target", ["batch", "cpu:0", "replicated"])
def test_prefetch_places_the_values_the_source_yielded(mesh, make, target):
    target = {
        "batch": jaxdev.batch_sharding(mesh),
        "cpu:0": "cpu:0",
        "replicated": jaxdev.as_sharding(mesh),
    }[target]
    for _ in range(TRIES[make]):
        buf = make((1024 if make is unaligned else 16, COLUMNS[make]))
        with jaxdev.prefetch_to_device(refilling(buf, 6), 2, target) as it:
            got = []
            for b in it:
                time.sleep(0.01)  # a slow step: the thread refills ahead
                got.append(b)
        assert_batches(got, 6)


def test_multi_process_global_batch_gets_the_values_of_call_time(mesh, monkeypatch):
    # The path of several processes, in one: jax.make_array_from_process_local_data
    # aliases an aligned local buffer just like device_put.
    calls = []

    def global_batch(local, sharding, timeout_s=None):
        calls.append(sharding)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, x, np.shape(x)), local
        )

    monkeypatch.setattr(_multihost, "global_batch", global_batch)
    monkeypatch.setattr(jax, "process_count", lambda backend=None: 2)
    got = [jaxdev.shard_batch(b, mesh) for b in refilling(aligned((16, 4)), 4)]
    assert len(calls) == 4
    assert_batches(got, 4)


@pytest.mark.parametrize(
    "strategy, kwargs",
    [
        pytest.param("sharded", {}, id="sharded"),
        pytest.param("pmap", {}, id="pmap"),
        pytest.param("single", {}, id="single"),
        pytest.param("sharded", {"accumulate": 2}, id="accumulate"),
        pytest.param("sharded", {"steps_per_call": 2}, id="steps-sharded"),
        pytest.param("pmap", {"steps_per_call": 2}, id="steps-pmap"),
    ],
)
def test_train_step_put_batch_places_the_values_of_call_time(strategy, kwargs):
    import optax

    strategy = getattr(jaxdev.Strategy, strategy)()
    step = jaxdev.make_train_step(lambda p, b: b["x"] @ p, optax.sgd(0.1), strategy, **kwargs)
    shape = (2, 16, 4) if "steps_per_call" in kwargs else (16, 4)
    got = [step.put_batch({"x": b}) for b in refilling(aligned(shape), 4)]
    assert_batches([jax.tree.leaves(b)[0] for b in got], 4)


def test_detach_host_copies_only_what_may_change():
    buf = aligned((8, 3))
    buf[...] = 1.0
    frozen = np.ones((8, 3), np.float32)
    frozen.flags.writeable = False
    device = jnp.ones((8, 3))
    from_bytes = np.frombuffer(np.ones(8, np.float32).tobytes(), np.float32)
    view = buf[:4]
    view.flags.writeable = False  # read-only, but its base is refilled
    tree = {"buf": buf, "frozen": frozen, "device": device, "bytes": from_bytes, "view": view}
    out = detach_host(tree)
    assert out["frozen"] is frozen and out["device"] is device and out["bytes"] is from_bytes
    for k in ("buf", "view"):
        assert not np.shares_memory(out[k], buf)
        assert not out[k].flags.writeable and out[k].ctypes.data % 64 == 0
    buf[...] = 7.0
    assert out["buf"].tolist() == np.ones((8, 3)).tolist()
    assert out["view"].tolist() == np.ones((4, 3)).tolist()
    assert detach_host(out) is out  # private copies are not copied again
    assert detach_host(np.float32(3.0)) == 3.0 and detach_host(2) == 2
    strings = np.array(["a", "b"])
    assert detach_host(strings) is strings  # left for the placement checks to name


def test_detach_host_keeps_dtype_and_layout():
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    strided = np.arange(20, dtype=np.int32)[::2]
    bf16 = np.arange(6, dtype=jnp.bfloat16)
    big = np.arange(20000.0).reshape(100, 200)  # 160 kB: its own copy; the others share one
    xs = [fortran, strided, bf16, np.zeros((0, 3)), np.array(5.0), big]
    for y, x in zip(detach_host(xs) + [detach_host(x) for x in xs], xs + xs):
        assert y.dtype == x.dtype and y.shape == x.shape and (not y.size or y.ctypes.data % 64 == 0)
        assert np.array_equal(y, x) and not np.shares_memory(y, x) and not y.flags.writeable



def test_a_kept_small_leaf_keeps_at_most_one_block_alive():
    # small leaves share blocks; keeping one (a batch's labels) must not keep a whole
    # 60 MB batch alive: each block holds at most 1 MiB (was: one block per call)
    xs = [np.full(15000, i, np.float32) for i in range(1000)]  # 60 kB each, 60 MB in all
    ys = detach_host(xs)
    owners = {id(y.base): y.base.nbytes for y in ys}  # numpy: a view's base is the owner
    assert max(owners.values()) <= (1 << 20) + 64 and len(owners) >= 58
    assert all(np.array_equal(y, x) for y, x in zip(ys, xs))


# ---------------------------------------------------------------- 2. the prefetch thread


def test_leaving_the_loop_without_close_exits_cleanly():
    # flax's `for step, batch in zip(range(n), train_iter)`: the iterator is
    # never closed; the interpreter used to abort at exit (code 134).
    code = """
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        import numpy as np, jaxdev

        def forever():
            i = 0
            while True:
                yield np.full((8, 4), i, np.float32)
                i += 1

        train_iter = jaxdev.prefetch_to_device(forever(), 2)
        for step, batch in zip(range(3), train_iter):
            pass
        print("left at", step)
    """
    for _ in range(3):
        res = run_python(code)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "left at 2" in res.stdout


def _forever(rows=8):
    i = 0
    while True:
        yield np.full((rows, 4), i, np.float32)
        i += 1


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_dropped_prefetchers_are_collected_and_their_threads_end(mesh):
    gc.collect()
    base = threading.active_count()
    refs = []
    for _ in range(20):
        it = jaxdev.prefetch_to_device(_forever(), 2, jaxdev.batch_sharding(mesh))
        next(it)
        refs.append(weakref.ref(it))
        threads = [it.thread]
        del it
    gc.collect()
    assert all(r() is None for r in refs), "a dropped Prefetcher is still referenced"
    assert _wait_for(lambda: threading.active_count() <= base), (
        f"{threading.active_count() - base} prefetch threads still running"
    )
    assert not threads[0].is_alive()


def test_close_from_another_thread_wakes_a_waiting_consumer(mesh):
    release = threading.Event()

    def slow():
        yield np.zeros((8, 2), np.float32)
        release.wait(30)  # the loader has nothing more for now
        yield np.ones((8, 2), np.float32)

    it = jaxdev.prefetch_to_device(slow(), 2, jaxdev.batch_sharding(mesh))
    next(it)
    got = []

    def consume():
        try:
            got.append(next(it))
        except StopIteration:
            got.append("stopped")

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.2)  # the consumer now waits in next()
    assert consumer.is_alive()
    closer = threading.Thread(target=it.close, kwargs={"timeout": 0.5})
    closer.start()
    consumer.join(5)
    closing_blocked = consumer.is_alive()
    release.set()  # let the source (and a stuck consumer) finish either way
    closer.join(5)
    consumer.join(5)
    assert not closing_blocked, "close() from another thread left the consumer waiting"
    assert got == ["stopped"]
    with pytest.raises(StopIteration):
        next(it)


def test_close_wakes_every_waiting_consumer(mesh):
    release = threading.Event()

    def stalled():
        release.wait(30)
        yield np.zeros((8, 2), np.float32)

    it = jaxdev.prefetch_to_device(stalled(), 1, jaxdev.batch_sharding(mesh))
    got = []
    consumers = [
        threading.Thread(target=lambda: got.append(next(it, "end")), daemon=True) for _ in range(3)
    ]
    for t in consumers:
        t.start()
    time.sleep(0.2)
    it.close(timeout=0.1)
    for t in consumers:
        t.join(5)
    release.set()
    assert got == ["end"] * 3


def test_prefetch_still_delivers_everything_in_order(mesh):
    batches = [np.full((16, 2), i, np.float32) for i in range(25)]
    with jaxdev.prefetch_to_device(iter(batches), 1, jaxdev.batch_sharding(mesh)) as it:
        assert [int(b[0, 0]) for b in it] == list(range(25))


# ---------------------------------------------------------------- 3. bit-exact round trips


SPECIAL_BITS = {
    np.float32: [0x80000000, 0x00000000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0x00000001,
                 0x80000001, 0x007FFFFF, 0x7F800000, 0xFF800000, 0x3F800000],
    np.float16: [0x8000, 0x0000, 0x7E01, 0xFE23, 0x0001, 0x8001, 0x03FF, 0x7C00, 0x3C00],
    jnp.bfloat16: [0x8000, 0x0000, 0x7FC1, 0xFFC3, 0x0001, 0x8001, 0x007F, 0x7F80, 0x3F80],
}  # fmt: skip
UINT = {2: np.uint16, 4: np.uint32}


def special_values(rng, dtype, shape):
    itemsize = np.dtype(dtype).itemsize
    bits = rng.choice(np.array(SPECIAL_BITS[dtype], UINT[itemsize]), size=shape)
    return bits.view(dtype)


def same_bits(a, b):
    a, b = np.ascontiguousarray(np.asarray(a)), np.ascontiguousarray(np.asarray(b))
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", list(SPECIAL_BITS), ids=lambda d: np.dtype(d).name)
def test_unpad_and_unshard_are_bit_exact(mesh, dtype):
    rng = np.random.default_rng(11)
    for rows in [1, 1, 5, 8, 9, 15, 16, 23] * 2:  # few shapes (each compiles), random values
        x = special_values(rng, dtype, (rows, 3))
        if rows == 1:
            x[:] = np.array(-0.0, dtype)
        p = jaxdev.shard_batch(x, mesh, pad=True)
        for padding in (p, p.mask, rows):
            assert same_bits(jaxdev.unpad(p.batch, padding), x), (rows, padding)
        keep = rng.random(p.mask.shape[0]) < 0.5
        assert same_bits(jaxdev.unpad(p.batch, jnp.asarray(keep)), np.asarray(p.batch)[keep])
        q = jaxdev.pmap.shard_for_pmap(x, pad=True)
        for padding in (q, q.mask, rows):
            assert same_bits(jaxdev.pmap.unshard_from_pmap(q.batch, padding), x), (rows, padding)
        if rows % 8 == 0:
            assert same_bits(jaxdev.pmap.unshard_from_pmap(jaxdev.pmap.shard_for_pmap(x)), x)


def test_unpad_keeps_complex_and_integer_bits(mesh):
    rng = np.random.default_rng(3)
    re = special_values(rng, np.float32, (9, 2))
    im = special_values(rng, np.float32, (9, 2))
    z = np.empty((9, 2), np.complex64)  # parts set directly: arithmetic would lose -0.0
    z.real, z.imag = re, im
    ints = rng.integers(-(2**31), 2**31 - 1, size=(9, 3), dtype=np.int32)
    p = jaxdev.shard_batch({"z": z, "i": ints, "b": ints > 0}, mesh, pad=True)
    out = jaxdev.unpad(p.batch, p)
    assert same_bits(out["z"], z) and same_bits(out["i"], ints) and same_bits(out["b"], ints > 0)


def test_pmap_outputs_unshard_bit_exact():
    n = jax.local_device_count()
    x = np.full((n + 1, 2), -0.0, np.float32)
    p = jaxdev.pmap.shard_for_pmap(x, pad=True)
    out = jax.pmap(lambda b: b * 1.0)(p.batch)  # per-row outputs keep -0.0
    assert same_bits(jaxdev.pmap.unshard_from_pmap(out, p), x)


# ---------------------------------------------------------------- 4. zero-size leaves


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4)])
def test_zero_size_stack_for_pmap_reads_back(shape):
    stacked = jaxdev.pmap.stack_for_pmap(jnp.zeros(shape))
    n = jax.local_device_count()
    assert np.asarray(stacked).shape == (n, *shape)
    assert [s.data.shape for s in stacked.addressable_shards] == [(1, *shape)] * n
    assert np.asarray(jaxdev.pmap.unstack_from_pmap(stacked, check=True)).shape == shape
    mixed = jaxdev.pmap.stack_for_pmap({"e": np.zeros(shape, np.float32), "w": np.ones(2)})
    assert jaxdev.to_host(mixed)["e"].shape == (n, *shape)


@pytest.mark.parametrize("leaf", [np.zeros((8, 0)), np.zeros((16, 3, 0)), jnp.zeros((8, 0))])
def test_zero_size_batch_leaves_are_refused_at_the_call(mesh, leaf):
    batch = {"x": np.ones((leaf.shape[0], 2), np.float32), "empty": leaf}
    for call in (
        lambda: jaxdev.shard_batch(batch, mesh),
        lambda: jaxdev.shard_batch(batch, mesh, pad=True),
        lambda: jaxdev.pmap.shard_for_pmap(batch),
        lambda: jaxdev.pmap.shard_for_pmap(batch, pad=True),
    ):
        with pytest.raises(jaxdev.ShardingError, match=r"\['empty'\].*shape \("):
            call()
    with jaxdev.prefetch_to_device([batch], 1, jaxdev.batch_sharding(mesh)) as it:
        with pytest.raises(jaxdev.ShardingError, match="no elements"):
            next(it)


def test_unshard_zero_size_host_leaves():
    assert jaxdev.pmap.unshard_from_pmap(np.zeros((8, 1, 0))).shape == (8, 0)
    assert jaxdev.pmap.unshard_from_pmap(np.zeros((8, 0, 3)), 0).shape == (0, 3)
