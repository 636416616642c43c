"""Tests for jaxdev.train._metrics: on-device accumulators, collections, DeviceLog."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import MetricError, count_transfers
from jaxdev.metrics import (
    Accuracy,
    Collection,
    DeviceLog,
    Last,
    Max,
    Mean,
    Min,
    NonFinite,
    Sum,
    fetch_metrics,
)

N = 8
RNG = np.random.default_rng(0)
SPEC = {
    "loss": Mean,
    "total": Sum,
    "low": Min,
    "high": Max,
    "acc": Accuracy,
    "bad": NonFinite,
}


def _batch(rows: int = 32, seed: int = 0):
    """Values with NaN/Inf hidden in some rows, a mask, a correctness vector."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=rows).astype(np.float32)
    mask = rng.random(rows) < 0.7
    values[~mask & (rng.random(rows) < 0.5)] = np.nan  # padding may be garbage
    values[3], mask[3] = np.inf, True  # one real non-finite value
    correct = rng.random(rows) < 0.5
    return values, mask, correct


def _expected(values, mask, correct):
    """The numpy answer over the unmasked rows only."""
    v = values[mask]
    return {
        "loss": float(np.mean(v)),
        "total": float(np.sum(v)),
        "low": float(np.min(v)),
        "high": float(np.max(v)),
        "acc": float(np.mean(correct[mask])),
        "bad": int(np.sum(~np.isfinite(v))),
    }


def _collection(values, mask, correct) -> Collection:
    batch = {k: values for k in SPEC}
    batch["acc"] = correct
    return Collection.from_values(SPEC, batch, mask)


def _finite_batch(rows: int = 32, seed: int = 0):
    values, mask, correct = _batch(rows, seed)
    values[3] = 0.5  # keep Mean/Sum finite so they can be compared
    return values, mask, correct


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


# ------------------------------------------------------------ single metrics


def test_masked_rows_never_count():
    values, mask, correct = _finite_batch()
    got = _collection(values, mask, correct).fetch()
    _assert_close(got, _expected(values, mask, correct))


def test_masked_nan_rows_do_not_poison_any_metric():
    values = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    mask = np.array([True, False, False, False, True])
    got = _collection(values, mask, mask).fetch()
    assert got == {"loss": 1.5, "total": 3.0, "low": 1.0, "high": 2.0, "acc": 1.0, "bad": 0}


def test_non_finite_counts_nan_pos_inf_neg_inf():
    x = jnp.array([0.0, jnp.nan, jnp.inf, -jnp.inf, 1.0, jnp.nan])
    assert NonFinite.from_value(x).fetch() == 4
    assert NonFinite.from_value(jnp.arange(5)).fetch() == 0
    two_d = jnp.array([[jnp.nan, 1.0], [jnp.inf, -jnp.inf]])
    assert NonFinite.from_value(two_d, mask=jnp.array([False, True])).fetch() == 2


def test_mean_of_empty_is_nan_not_an_error():
    assert math.isnan(Mean.empty().fetch())
    assert math.isnan(float(Mean.empty().compute()))
    assert math.isnan(Mean.from_value(jnp.ones(3), mask=jnp.zeros(3, bool)).fetch())
    assert math.isnan(Accuracy.empty().fetch())


def test_identities_of_min_max_sum_last():
    assert Min.empty().fetch() == math.inf
    assert Max.empty().fetch() == -math.inf
    assert Sum.empty().fetch() == 0.0
    assert NonFinite.empty().fetch() == 0
    assert math.isnan(Last.empty().fetch())
    for kind in (Mean, Sum, Min, Max, NonFinite):
        m = kind.from_value(jnp.array([2.0, -1.0]))
        assert kind.empty().merge(m).fetch() == m.fetch() == m.merge(kind.empty()).fetch()
    last = Last.from_value(jnp.array([2.0, -1.0]))
    both = Last.empty(shape=(2,)).merge(last)
    np.testing.assert_array_equal(both.fetch(), [2.0, -1.0])
    np.testing.assert_array_equal(last.merge(Last.empty(shape=(2,))).fetch(), [2.0, -1.0])


def test_mean_mask_broadcasts_over_trailing_axes():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    mask = np.array([True, False, True])
    m = Mean.from_value(x, mask)
    assert int(m.count) == 8
    assert m.fetch() == pytest.approx(x[mask].mean())


def test_accuracy_from_logits_matches_numpy():
    logits = RNG.normal(size=(20, 5)).astype(np.float32)
    labels = RNG.integers(0, 5, size=20)
    mask = RNG.random(20) < 0.6
    want = np.mean((logits.argmax(-1) == labels)[mask])
    assert Accuracy.from_logits(logits, labels, mask).fetch() == pytest.approx(want)


def test_last_keeps_latest_and_last_valid_row():
    a, b = Last.from_value(1.0), Last.from_value(2.0)
    assert a.merge(b).fetch() == 2.0 and b.merge(a).fetch() == 1.0
    assert a.merge(Last.empty()).fetch() == 1.0
    x = jnp.array([5.0, 6.0, 7.0, 8.0])
    assert Last.from_value(x, mask=jnp.array([True, True, True, False])).fetch() == 7.0
    none = Last.from_value(x, mask=jnp.zeros(4, bool))
    assert int(none.count) == 0 and a.merge(none).fetch() == 1.0


def test_sum_min_max_share_one_fold_and_keep_their_fields():
    values = jnp.array([[3.0, -2.0], [jnp.nan, jnp.inf], [-jnp.inf, 1e30], [5.0, 0.5]])
    mask = jnp.array([True, False, False, True])  # masked rows hold NaN and infinities
    for kind, field, want in ((Sum, "total", 6.5), (Min, "value", -2.0), (Max, "value", 5.0)):
        m = kind.from_value(values, mask)
        assert m.fetch() == want, kind
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(m)]
        assert paths == [f".{field}"]
        leaves, treedef = jax.tree.flatten(m)
        assert type(jax.tree.unflatten(treedef, leaves)) is kind
        assert kind(**{field: jnp.float32(1.0)}).merge(kind.empty()).fetch() == 1.0
        assert getattr(kind.empty(), field).dtype == jnp.float32
    assert Sum.from_value(jnp.array([-0.0])).fetch() == 0.0
    assert math.isnan(Min.from_value(jnp.array([1.0, jnp.nan])).fetch())


def test_accumulation_is_float32_and_counts_int32():
    m = Mean.from_value(jnp.arange(4))
    assert m.total.dtype == jnp.float32 and m.count.dtype == jnp.int32
    assert NonFinite.from_value(jnp.ones(2)).count.dtype == jnp.int32


# ---------------------------------------------------------- merge algebra


_jit_collection = jax.jit(_collection)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 16), min_size=3, max_size=3), st.integers(0, 10_000))
def test_merge_is_associative_and_commutative(valid_rows, seed):
    rng = np.random.default_rng(seed)
    parts = []
    for n in valid_rows:  # fixed shapes (one compile); the mask sets the batch size
        v = rng.integers(-8, 8, size=16).astype(np.float32)  # exact in float32
        mask = np.arange(16) < n
        parts.append(_jit_collection(v, mask, rng.random(16) < 0.5))
    a, b, c = parts
    left, right = a.merge(b).merge(c), a.merge(b.merge(c))
    swapped = c.merge(a).merge(b)
    leaves = jax.tree.leaves
    for x, y, z in zip(leaves(left), leaves(right), leaves(swapped), strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)


def test_last_merge_is_associative():
    a, b, c = (Last.from_value(v) for v in (1.0, 2.0, 3.0))
    assert a.merge(b).merge(c).fetch() == a.merge(b.merge(c)).fetch() == 3.0


# -------------------------------------------------------- jit, pmap, sharding


def test_merge_inside_jit_scan_matches_numpy():
    values, mask, correct = _finite_batch(rows=64)
    spec = {k: v for k, v in SPEC.items() if k != "bad"}

    @jax.jit
    def run(v, m, c):
        def body(acc, xs):
            vals = {k: xs[0] for k in spec}
            vals["acc"] = xs[2]
            return acc.merge(Collection.from_values(spec, vals, xs[1])), None

        xs = (v.reshape(8, 8), m.reshape(8, 8), c.reshape(8, 8))
        return jax.lax.scan(body, Collection.empty(spec), xs)[0]

    got = run(values, mask, correct).fetch()
    want = _expected(values, mask, correct)
    del want["bad"]
    _assert_close(got, want)


def test_pmap_reduce_equals_global_computation(devices):
    values, mask, correct = _batch(rows=N * 16, seed=1)
    shard = lambda x: x.reshape(N, -1)  # noqa: E731

    def step(v, m, c):
        return _collection(v, m, c).reduce("batch")

    out = jax.pmap(step, axis_name="batch")(shard(values), shard(mask), shard(correct))
    per_device = out.fetch()
    for k, want in _expected(values, mask, correct).items():
        np.testing.assert_allclose(per_device[k], np.full(N, want), rtol=1e-5, err_msg=k)


def test_pmap_last_takes_highest_device_that_saw_a_value(devices):
    x = jnp.arange(N * 2, dtype=jnp.float32).reshape(N, 2)
    mask = jnp.zeros((N, 2), bool).at[2, 0].set(True).at[5, 1].set(True)
    out = jax.pmap(lambda v, m: Last.from_value(v, m).reduce("i"), axis_name="i")(x, mask)
    np.testing.assert_array_equal(out.fetch(), np.full(N, 11.0))
    np.testing.assert_array_equal(np.asarray(out.count), np.full(N, 2))


def test_sharded_jit_gives_the_global_number(devices):
    values, mask, correct = _finite_batch(rows=N * 8, seed=2)
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    args = jax.device_put((values, mask, correct), sharding)
    out = jax.jit(_collection)(*args)
    assert out["loss"].total.sharding.is_fully_replicated
    _assert_close(out.fetch(), _expected(values, mask, correct))


def test_shard_map_reduce_equals_global(devices):
    values, mask, correct = _finite_batch(rows=N * 4, seed=3)
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))

    def local(v, m, c):
        return _collection(v, m, c).reduce()  # the default axis is "data"

    fn = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P())
    _assert_close(jax.jit(fn)(values, mask, correct).fetch(), _expected(values, mask, correct))


# ---------------------------------------------------------------- fetching


def test_collection_fetch_is_one_device_get():
    values, mask, correct = _finite_batch()
    c = jax.jit(_collection)(values, mask, correct)
    jax.block_until_ready(c)
    with count_transfers() as counter:
        host = c.fetch()
    assert counter.device_to_host == 1, counter.summary()
    assert counter.events[0].kind == "jax.device_get"
    assert counter.events[0].where.startswith("test_metrics.py:"), counter.events[0]
    assert "via _metrics.py:" in counter.events[0].where
    assert counter.host_to_device == 0 and counter.compiles == 0, counter.summary()
    assert all(isinstance(v, (float, int)) for v in host.values())


def test_fetch_metrics_of_a_nested_tree_is_one_device_get():
    tree = {"train": Collection.empty({"loss": Mean}), "lr": Last.from_value(0.1), "step": 3}
    with count_transfers() as counter:
        host = fetch_metrics(tree)
    assert counter.device_to_host == 1
    assert math.isnan(host["train"]["loss"])
    assert host["lr"] == pytest.approx(0.1) and host["step"] == 3


@pytest.mark.parametrize(
    "path, leaf",
    [
        ("['train']['loss'].count", lambda t: t["train"]["loss"].count),
        ("['lr'].value", lambda t: t["lr"].value),
    ],
)
def test_fetch_names_a_deleted_leaf_after_good_fetches_of_the_same_tree(path, leaf):
    """fetch looks for deleted leaves on its error path only: that check fires after good calls."""
    loss = Collection.from_values({"loss": Mean}, {"loss": jnp.ones(3)})
    tree = {"train": loss, "lr": Last.empty()}
    assert fetch_metrics(tree)["train"]["loss"] == fetch_metrics(tree)["train"]["loss"] == 1.0
    leaf(tree).delete()
    with pytest.raises(jaxdev.DeletedArrayError, match=rf"has 1 deleted.*: {re.escape(path)}\."):
        fetch_metrics(tree)


def test_compute_stays_on_device():
    m = Mean.from_value(jnp.arange(4.0))
    with count_transfers() as counter:
        value = m.compute()
    assert isinstance(value, jax.Array) and counter.device_to_host == 0


def test_collection_is_a_mapping_and_pytree():
    c = Collection.empty({"b": Sum, "a": Mean})
    assert list(c) == ["a", "b"] and len(c) == 2 and isinstance(c["a"], Mean)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(c)]
    assert paths == ["['a'].total", "['a'].count", "['b'].total"]
    assert "Collection(" in repr(c)


# ------------------------------------------------------------------ errors


def test_bad_inputs_name_the_argument():
    with pytest.raises(MetricError, match="`mask` to be boolean"):
        Mean.from_value(jnp.ones(3), mask=jnp.ones(3))
    with pytest.raises(MetricError, match=r"`value` has shape \(3,\), `mask` has shape \(4,\)"):
        Sum.from_value(jnp.ones(3), mask=jnp.ones(4, bool))
    with pytest.raises(MetricError, match="`value` to be an array or number, got str"):
        Max.from_value("loss")
    with pytest.raises(MetricError, match="`Mean.merge` expects `other` to be a Mean, got Sum"):
        Mean.empty().merge(Sum.empty())
    with pytest.raises(MetricError, match="integer class indices"):
        Accuracy.from_logits(jnp.ones((2, 3)), jnp.ones(2))
    with pytest.raises(MetricError, match=r"labels` of shape logits.shape\[:-1\]"):
        Accuracy.from_logits(jnp.ones((2, 3)), jnp.ones(3, int))
    with pytest.raises(MetricError, match="1-D row `mask`"):
        Last.from_value(jnp.ones((2, 2)), mask=jnp.ones((2, 2), bool))


def test_collection_errors_list_missing_and_extra_names():
    a = Collection.empty({"loss": Mean})
    with pytest.raises(MetricError, match=r"missing \['loss'\], unexpected \['los'\]"):
        a.merge(Collection.empty({"los": Mean}))
    with pytest.raises(MetricError, match=r"missing \[\], unexpected \['x'\]"):
        Collection.from_values({"loss": Mean}, {"loss": 1.0, "x": 2.0})
    with pytest.raises(MetricError, match="got 'loss': float"):
        Collection({"loss": 1.0})
    with pytest.raises(MetricError, match=r"`spec\['loss'\]` must be a Metric class"):
        Collection.empty({"loss": "mean"})
    with pytest.raises(MetricError, match="to be a Collection, got dict"):
        a.merge({"loss": Mean.empty()})


def test_errors_are_jaxdev_errors():
    assert issubclass(MetricError, jaxdev.JaxdevError) and issubclass(MetricError, ValueError)


# --------------------------------------------------------------- DeviceLog


def test_device_log_keeps_values_in_order():
    log = DeviceLog.create(5)
    for v in (3.0, 1.0, 2.0):
        log = log.record(v)
    np.testing.assert_array_equal(log.fetch(), [3.0, 1.0, 2.0])
    steps, values = log.fetch(with_steps=True)
    np.testing.assert_array_equal(steps, [0, 1, 2])
    np.testing.assert_array_equal(log.values(), [3.0, 1.0, 2.0, 0.0, 0.0])


def test_device_log_wraps_around_keeping_the_latest():
    log = DeviceLog.create(4, shape=(2,), dtype=jnp.int32)
    for v in range(11):
        log = log.record(jnp.array([v, -v]))
    steps, values = log.fetch(with_steps=True)
    np.testing.assert_array_equal(steps, [7, 8, 9, 10])
    np.testing.assert_array_equal(values[:, 0], [7, 8, 9, 10])
    np.testing.assert_array_equal(values[:, 1], [-7, -8, -9, -10])
    assert values.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(log.values())[:, 0], [7, 8, 9, 10])


def test_device_log_exactly_full_is_not_rotated():
    log = DeviceLog.create(3)
    for v in (1.0, 2.0, 3.0):
        log = log.record(v)
    np.testing.assert_array_equal(log.fetch(), [1.0, 2.0, 3.0])


def test_device_log_d2l_exercise_1000_matmuls_one_transfer():
    """d2l GPU exercise 3: log the Frobenius norm of 1000 matmuls on device."""
    a = jax.random.normal(jax.random.key(0), (100, 100)) / 10.0

    @jax.jit
    def run(log, a):
        def body(carry, _):
            log, x = carry
            x = a @ x
            x = x / jnp.linalg.norm(x)  # keep numbers finite; log the pre-scale norm
            return (log.record(jnp.linalg.norm(a @ x)), x), None

        (log, _), _ = jax.lax.scan(body, (log, jnp.eye(100)), None, length=1000)
        return log

    log = run(DeviceLog.create(1000), a)
    jax.block_until_ready(log)
    with count_transfers() as counter:
        norms = log.fetch()
    assert counter.device_to_host == 1, counter.summary()
    assert norms.shape == (1000,) and np.all(np.isfinite(norms)) and np.all(norms > 0)
    x = np.eye(100, dtype=np.float32)
    an = np.asarray(a)
    for i in range(3):  # the first steps agree with numpy
        x = an @ x
        x = x / np.linalg.norm(x)
        assert norms[i] == pytest.approx(np.linalg.norm(an @ x), rel=1e-4)


def test_device_log_errors():
    with pytest.raises(MetricError, match="`capacity` to be a positive int, got 0"):
        DeviceLog.create(0)
    with pytest.raises(MetricError, match="`capacity` to be a positive int, got float"):
        DeviceLog.create(2.5)
    with pytest.raises(MetricError, match=r"`value` of shape \(\)"):
        DeviceLog.create(2).record(jnp.ones(3))
    for shape in ((-1,), (2.5,), "ab", None, (True,)):  # was a raw TypeError or a silent int()
        with pytest.raises(MetricError, match="`shape` to be a tuple of non-negative ints"):
            DeviceLog.create(2, shape=shape)


def test_the_public_namespace_says_what_each_constructor_raises():
    # help(jaxdev.metrics) is where the errors are listed (the methods carry no Raises)
    doc = jaxdev.metrics.__doc__
    for name in ("MetricError", "from_value", "from_logits", "from_values", "DeviceLog.create"):
        assert name in doc, name
    for what in ("merge", "record", "not integer", "positive int", "not a str"):
        assert what in doc, what


def test_recording_and_building_metrics_outside_jit_never_reads_the_device():
    """d2l's "keep logs on the device" loop records outside ``jit``. ``_as_array`` built its
    error text ``repr(value)`` before checking anything: a device-to-host read at every
    ``DeviceLog.record`` and ``Metric.from_value`` (no_host_sync: 'repr() via _as_array')."""
    log, x, rows = DeviceLog.create(4, ()), jnp.float32(2.0), jnp.arange(6.0)
    labels, logits = jnp.array([0, 1]), jnp.eye(2)
    log.record(x), Mean.from_value(rows), Accuracy.from_logits(logits, labels)  # compiles
    with jaxdev.no_host_sync():
        for _ in range(3):
            log = log.record(x)
            mean = Mean.from_value(rows, mask=rows > 1)
            acc = Accuracy.from_logits(logits, labels)
            Collection({"loss": mean, "acc": acc}).merge(Collection({"loss": mean, "acc": acc}))
    assert log.fetch().tolist() == [2.0, 2.0, 2.0] and float(mean.compute()) == 3.5
    with pytest.raises(MetricError, match=r"expects `value` to be an array or number, got str"):
        log.record("2.0")  # the error path still names what arrived
