"""What ``put_batch`` costs per call (issue 35, the client loop): one ``jax.device_put`` of
rows and mask together on every strategy, even or uneven, grouped or not; the batch checks
once per structure, shapes and dtypes; and every named error still raised after a batch of
the same structure was placed (the values of 64-bit leaves are read at every call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdev
from jaxdev import _batches

STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(),
    "sharded": lambda: jaxdev.Strategy.sharded(),
    "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
}
GROUPS = {"rows": (1, 1), "steps_per_call=2": (2, 1), "accumulate=2": (1, 2)}


def _batch(rows: int, k: int = 1, fill: float = 1.0) -> dict:
    lead = (k,) if k > 1 else ()
    x = np.full(lead + (rows, 3), fill, np.float32)
    return {"x": x, "y": np.arange(np.prod(lead + (rows,)), dtype=np.int32).reshape(lead + (rows,))}


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("rows", [16, 13])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_put_batch_is_one_device_put(name, rows, group):
    """Before: an uneven batch under `sharded` was two transfers (the rows with a mask split
    like them, then the replicated mask), and a grouped batch placed its mask apart from the
    rows (two transfers, even rows too, where no mask comes back)."""
    strategy, (k, m) = STRATEGIES[name](), GROUPS[group]
    strategy.put_batch(_batch(rows, k), k, m)  # the first call: checked
    for fill in (2.0, 3.0):  # the same shapes again: no check, the values of this batch
        with jaxdev.count_transfers(implicit=False) as counted:
            out = strategy.put_batch(_batch(rows, k, fill), k, m)
        assert counted.host_to_device == 1, counted.summary()
        placed = out.batch if isinstance(out, jaxdev.Padded) else out
        assert float(jnp.max(placed["x"])) == fill
    if isinstance(out, jaxdev.Padded):
        assert out.size == rows and int(out.mask.sum()) == rows * k


def test_an_uneven_batch_with_a_device_leaf_is_one_device_put():
    """The path of device (and mixed) leaves: before, two transfers under `sharded`."""
    strategy = jaxdev.Strategy.sharded()
    batch = {"x": jnp.ones((13, 3)), "y": np.arange(13, dtype=np.int32)}
    with jaxdev.count_transfers(implicit=False) as counted:
        out = strategy.put_batch(batch)
    assert counted.host_to_device == 1, counted.summary()
    assert out.mask.sharding.spec == jax.sharding.PartitionSpec() and out.size == 13
    assert out.batch["y"].tolist() == list(range(13)) + [12, 12, 12]


@pytest.mark.parametrize("name", ["single", "pmap", "sharded"])
def test_a_batch_like_one_placed_before_is_not_checked_again(name, monkeypatch):
    """Before: the rows of every leaf (`batch_rows`) were read and checked at every call
    (pmap: twice, the strategy's row count then `shard_for_pmap`'s checks)."""
    checked = []
    rows_of = _batches.batch_rows
    monkeypatch.setattr(_batches, "batch_rows", lambda *a: checked.append(1) or rows_of(*a))
    strategy = STRATEGIES[name]()
    strategy.put_batch(_batch(13))
    before = len(checked)
    for fill in range(3):  # new arrays, the same structure, shapes and dtypes
        strategy.put_batch(_batch(13, fill=fill))
    assert len(checked) == before
    strategy.put_batch(_batch(12))  # another shape: checked
    assert len(checked) == before + 1


BAD = {  # a batch of the good one's structure, the error it gets, its message
    "leading axes differ": (
        {"x": np.ones((13, 3), np.float32), "y": np.ones(12, np.int32)},
        jaxdev.ShardingError, "different leading",
    ),
    "a scalar leaf": (
        {"x": np.ones((13, 3), np.float32), "y": np.int32(1)}, jaxdev.ShardingError, "scalar",
    ),
    "empty": (
        {"x": np.ones((0, 3), np.float32), "y": np.ones(0, np.int32)},
        jaxdev.ShardingError, "is empty",
    ),
    "a leaf with no elements": (
        {"x": np.ones((13, 0), np.float32), "y": np.ones(13, np.int32)},
        jaxdev.ShardingError, "no elements",
    ),
    "strings": (
        {"x": np.ones((13, 3), np.float32), "y": np.array(["a"] * 13)},
        jaxdev.LeafTypeError, "dtype",
    ),
    "int64 past int32, as the good batch's dtype": (
        {"x": np.ones((13, 3), np.float32), "y": np.arange(13) + 2**40},
        jaxdev.LeafValueError, "do not fit int32",
    ),
    "float64 past float32": (
        {"x": np.full((13, 3), 1e300), "y": np.arange(13)}, jaxdev.LeafValueError, "overflows",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_batch_error_fires_after_good_batches(name, case):
    """The checks skipped for a batch like one placed before still fire where they apply:
    64-bit values on every call (the good batches are int64 and float64 too)."""
    strategy = STRATEGIES[name]()
    good = {"x": np.ones((13, 3)), "y": np.arange(13)}
    for _ in range(2):
        strategy.put_batch(good)
    bad, error, match = BAD[case]
    with pytest.raises(error, match=match):
        strategy.put_batch(bad)
    assert strategy.put_batch(good) is not None  # and it goes on


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("group", [(2, 1), (1, 2)], ids=["steps_per_call=2", "accumulate=2"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_grouped_batch_gets_each_error_an_ungrouped_one_gets(name, group, case):
    """Before (issue-35 read-through): grouped batches had checks of their own; a leaf with no
    elements passed under accumulate, and the errors named no leaf ("every batch leaf needs
    the same non-zero number of rows B")."""
    strategy = STRATEGIES[name]()
    k, m = group
    bad, error, match = BAD[case]
    if k > 1:  # the rows of k steps, stacked
        bad = jax.tree.map(lambda x: np.stack([x] * k), bad)
    with pytest.raises(error, match=match):
        strategy.put_batch(bad, k, m)
    if k > 1:
        with pytest.raises(jaxdev.ShardingError, match=r"\(K=2, B, ...\).*\n  \['x'\]: shape \(3"):
            strategy.put_batch({"x": np.ones((3, 16)), "y": np.ones((2, 16))}, k, m)


@pytest.mark.parametrize("group", [(2, 1), (1, 2)], ids=["steps_per_call=2", "accumulate=2"])
@pytest.mark.parametrize("name", ["sharded", "pmap"])
def test_a_grouped_batch_error_names_the_users_leaf_path(name, group):
    """Before (issue-35 review): place_grouped puts (rows, mask) in one to_device, so a bad leaf is named by
    jaxdev's own tuple: "`tree` leaf [0]['y']" (was "`tree` leaf ['y']"; `batch` would be
    the argument's name)."""
    strategy = getattr(jaxdev.Strategy, name)()
    k, m = group
    lead = (k,) if k > 1 else ()
    bad = {"x": np.ones(lead + (16, 3), np.float32), "y": np.full(lead + (16,), 2**40 + 5)}
    with pytest.raises(jaxdev.JaxdevError) as err:
        strategy.put_batch(bad, k, m)
    assert "leaf ['y']" in str(err.value), str(err.value)[:200]
