"""Tests for jaxdev._guards: host-sync, transfer and compile counting."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl

import jaxdev
from jaxdev import (
    GuardArgumentError,
    GuardError,
    Mean,
    _guards,
    count_transfers,
    no_host_sync,
)


@pytest.fixture
def x():
    out = jnp.arange(4.0)
    jax.block_until_ready(out)
    return out


def _originals():
    return (
        {
            name: ArrayImpl.__dict__[name]
            for name in [*_guards._ARRAY_METHODS, "_value"]
            if name in ArrayImpl.__dict__
        },
        jax.device_get,
        jax.device_put,
        np.asarray,
        np.array,
    )


# ------------------------------------------------------- device to host


@pytest.mark.parametrize(
    "read, kind",
    [
        (lambda x: float(x[0]), "float()"),
        (lambda x: int(x[1]), "int()"),
        (lambda x: bool(x[1] > 0), "bool()"),
        (lambda x: x[2].item(), ".item()"),
        (lambda x: x.tolist(), ".tolist()"),
        (lambda x: np.asarray(x), "np.asarray"),
        (lambda x: np.array(x), "np.array"),
        (lambda x: np.asarray([x, x]), "np.asarray"),
        (lambda x: jax.device_get(x), "jax.device_get"),
        (lambda x: f"{x[0]:.3f}", "format()"),
        (lambda x: repr(x), "repr()"),
        (lambda x: pickle.dumps(x), "pickle"),
        (lambda x: range(10)[x.astype(int)[1]], "operator.index()"),
    ],
)
def test_each_host_read_counts_once(x, read, kind):
    with count_transfers() as c:
        read(x)
    assert c.device_to_host == 1, c.summary()
    (event,) = [e for e in c.events if e.direction == "device_to_host"]
    assert event.kind == kind
    assert event.where.startswith("test_guards.py:"), event


def test_device_get_of_a_tree_is_one_sync(x):
    tree = {"a": x, "b": [x * 2, x + 1], "c": 3}
    with count_transfers() as c:
        host = jax.device_get(tree)
    assert c.device_to_host == 1 and isinstance(host["b"][0], np.ndarray)
    with count_transfers() as c:
        jax.device_get({"only": np.ones(2), "n": 1})  # host values: nothing moves
    assert c.device_to_host == 0


def test_numpy_on_host_data_is_not_counted():
    with count_transfers() as c:
        np.asarray([1.0, 2.0])
        np.array(np.ones(3))
    assert c.device_to_host == 0 and c.host_to_device == 0


def test_repeated_reads_all_count(x):
    with count_transfers() as c:
        for i in range(5):
            float(x[i % 4])
    assert c.device_to_host == 5
    assert "device_to_host: float() at test_guards.py" in c.summary()
    assert "(x5)" in c.summary()


# ------------------------------------------------------- host to device


def test_device_put_of_host_data_counts_and_of_device_data_does_not(x):
    with count_transfers() as c:
        jax.device_put(np.ones(3))
        jax.device_put({"a": np.ones(2), "b": 1.0})
        jax.device_put(x, jax.devices()[1])  # device to device: not host
    assert c.host_to_device == 2, c.summary()
    assert {e.kind for e in c.events} == {"jax.device_put"}


def test_implicit_host_to_device_is_counted(x):
    step = jax.jit(lambda a, b: a * b)
    step(x, x)
    with count_transfers() as c:
        step(x, np.ones(4, np.float32))  # numpy argument: implicit transfer
        jnp.asarray(np.zeros(2, np.float32))
    assert c.host_to_device == 2, c.summary()
    kinds = [e.kind for e in c.events if e.direction == "host_to_device"]
    assert kinds == ["implicit float32[4]", "implicit float32[2]"], c.summary()


def test_indexing_with_a_python_int_is_an_implicit_transfer(x):
    x[0]  # compile outside
    with count_transfers() as c:
        x[0]
    assert c.host_to_device == 1 and c.device_to_host == 0, c.summary()


def test_implicit_counting_can_be_turned_off(x):
    with count_transfers(implicit=False) as c:
        jnp.asarray(np.zeros(2, np.float32))
    assert c.host_to_device == 0


def test_other_stderr_output_is_passed_on(capfd, x):
    import os

    with count_transfers() as c:
        os.write(2, b"unrelated line\n")
        jnp.asarray(np.zeros(3, np.float32))
    assert c.host_to_device == 1
    err = capfd.readouterr().err
    assert "unrelated line" in err and "host-to-device transfer" not in err


def test_a_stricter_transfer_guard_is_left_in_force(x):
    with jax.transfer_guard_host_to_device("disallow"):
        with count_transfers():
            with pytest.raises(Exception, match="Disallowed host-to-device"):
                jnp.asarray(np.zeros(2, np.float32))


# ------------------------------------------------------------- jitted loop


def test_pure_jitted_loop_on_device_has_zero_syncs(x):
    @jax.jit
    def step(carry, metrics):
        carry = carry * 0.9 + 0.1
        return carry, metrics.merge(Mean.from_value(carry))

    carry, metrics = step(x, Mean.empty())
    with no_host_sync(max_host_to_device=0, max_compiles=0, max_traces=0) as c:
        for _ in range(50):
            carry, metrics = step(carry, metrics)
    assert (c.device_to_host, c.host_to_device, c.compiles, c.traces) == (0, 0, 0, 0)
    with count_transfers() as c:
        value = metrics.fetch()
    assert c.device_to_host == 1 and value > 0


def test_float_loss_loop_is_caught_with_call_site(x):
    step = jax.jit(lambda a: (a * 0.5, jnp.sum(a)))
    step(x)
    with pytest.raises(GuardError) as info:
        with no_host_sync():
            for _ in range(3):
                x, loss = step(x)
                float(loss)
    msg = str(info.value)
    assert "3 device-to-host syncs in a block that allows 0 (`max_device_to_host=0`)" in msg
    assert "float() at test_guards.py:" in msg and "(x3)" in msg


# ------------------------------------------------------------ compiles


def test_compile_counter_sees_retrace_on_new_shape_only():
    f = jax.jit(lambda a: jnp.tanh(a) * 2)
    f(jnp.ones(3))
    with count_transfers() as same:
        f(jnp.ones(3))
        f(jnp.zeros(3))
    assert same.compiles == 0 and same.traces == 0
    new_shape = jnp.ones(5)
    with count_transfers() as changed:
        f(new_shape)
    assert changed.compiles == 1 and changed.traces == 1, changed.summary()
    assert any(e.kind == "jit(<lambda>)" for e in changed.events)


def test_compile_budget_raises():
    f = jax.jit(lambda a: a + 1)
    new_shape = jnp.ones(7)
    with pytest.raises(GuardError, match=r"1 compile in a block that allows 0 .*\n.*compile: jit"):
        with no_host_sync(max_compiles=0):
            f(new_shape)


# ------------------------------------------------- restore, nest, errors


def test_patches_are_restored_after_normal_exit_and_exceptions(x):
    before = _originals()
    with count_transfers():
        assert np.asarray is not before[3]
    assert _originals() == before
    with pytest.raises(ZeroDivisionError):
        with count_transfers():
            _ = 1 / 0
    assert _originals() == before
    with pytest.raises(GuardError):
        with no_host_sync():
            float(x[0])
    assert _originals() == before
    assert not _guards._active and not _guards._undo and _guards._tap.users == 0


def test_block_exception_is_not_masked_by_budget(x):
    with pytest.raises(KeyError):
        with no_host_sync():
            float(x[0])
            raise KeyError("boom")


def test_nested_counters_each_see_their_own_block(x):
    before = _originals()
    total = jnp.sum(x)  # (indexing `x[0]` would itself be an implicit transfer)
    with count_transfers() as outer:
        float(total)
        with count_transfers() as inner:
            x.tolist()
            jax.device_put(np.ones(1))
        assert _originals() != before  # outer still active
        np.asarray(x)
    assert (inner.device_to_host, inner.host_to_device) == (1, 1)
    assert (outer.device_to_host, outer.host_to_device) == (3, 1)
    assert _originals() == before


def test_counter_is_readable_during_the_block(x):
    total = jnp.sum(x)
    with count_transfers() as c:
        float(total)
        assert c.device_to_host == 1
        jnp.asarray(np.ones(2, np.float32))
        assert c.host_to_device == 1
    assert "TransferCounter(device_to_host=1, host_to_device=1" in repr(c)


def test_bad_budgets_name_the_argument():
    with pytest.raises(GuardArgumentError, match="`max_compiles` to be None .* got -1"):
        with no_host_sync(max_compiles=-1):
            pass
    with pytest.raises(GuardArgumentError, match="`max_device_to_host` .* got 'zero'"):
        with no_host_sync(max_device_to_host="zero"):
            pass
    assert issubclass(GuardError, jaxdev.JaxdevError) and issubclass(GuardError, AssertionError)
