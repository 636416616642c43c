"""Reports on sharded trees (issue 12): N-D specs, replicated vs sharded bytes, sharded fraction."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import PlacementAssertionError, UsageError


@pytest.fixture
def mesh():
    return jaxdev.data_mesh()


def _on(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _half(mesh):
    """Per device: 512 B replicated ('r') + 512 B sharded ('s'); logically 512 B vs 4 KiB."""
    return {
        "s": _on(jnp.ones((64, 16), jnp.float32), mesh, P("data")),
        "r": _on(jnp.ones((128,), jnp.float32), mesh, P()),
    }


# ---------------------------------------------------------------- report: shares


def test_half_sharded_tree_report_numbers_are_exact(mesh):
    report = jaxdev.placement(_half(mesh))
    assert report.replicated_bytes == 512 and report.sharded_bytes == 512
    assert report.sharded_share == 0.5
    assert report.replicated_by_device == {f"cpu:{i}": 512 for i in range(8)}
    assert report.sharded_by_device == {f"cpu:{i}": 512 for i in range(8)}
    assert report.bytes_by_device == {f"cpu:{i}": 1024 for i in range(8)}
    footer = str(report).splitlines()[-1]
    per = ", ".join(f"cpu:{i}: 1.0 KiB" for i in range(8))
    assert footer == (
        f"2 leaves, 8.0 KiB on devices ({per}); per device: 512 B replicated, 512 B sharded (50.0%)"
    )


def test_single_device_and_host_leaves_count_as_not_sharded(mesh, devices):
    tree = dict(_half(mesh), one=jax.device_put(jnp.ones(64, jnp.int8), devices[3]), h=np.ones(9))
    report = jaxdev.placement(tree)
    assert report.replicated_by_device["cpu:3"] == 512 + 64
    assert report.replicated_by_device["cpu:0"] == 512
    assert report.replicated_bytes == 576 and report.sharded_bytes == 512
    assert str(report).endswith("per device: 576 B replicated, 512 B sharded (47.1%)")


def test_footer_without_device_bytes_is_unchanged():
    assert str(jaxdev.placement({"h": np.ones(3)})).splitlines()[-1] == (
        "1 leaves, 0 B on devices (none)"
    )
    empty = jaxdev.placement({})
    assert empty.replicated_bytes == empty.sharded_bytes == 0 and empty.sharded_share == 0.0


def test_deleted_leaves_do_not_count(mesh):
    tree = _half(mesh)
    tree["s"].delete()
    report = jaxdev.placement(tree)
    assert report.sharded_bytes == 0 and report.replicated_bytes == 512


# ---------------------------------------------------------------- report: N-D specs


def test_rows_show_spec_device_count_and_mesh_axes():
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    tree = {
        "a": _on(jnp.ones((4, 8)), mesh, P(None, "fsdp")),
        "b": _on(jnp.ones((8,)), mesh, P(("data", "fsdp"))),
        "c": _on(jnp.ones((2, 4)), mesh, P("data", "fsdp")),
        "d": _on(jnp.ones(3), mesh, P()),
        "e": _on(jnp.ones(3), jaxdev.data_mesh(), P()),
        "f": _on(jnp.ones(8), jaxdev.data_mesh(), P("data")),
    }
    report = jaxdev.placement(tree)
    rows = {r.path: r for r in report.leaves}
    assert rows["['a']"].sharding == "mesh(data=2,fsdp=4) P(None, 'fsdp')"  # the field: unchanged
    column = {line.split()[0]: line for line in str(report).splitlines()[2:-1]}
    assert "P(None, 'fsdp') on 8 devices (data=2 x fsdp=4)" in column["['a']"]
    assert "P(('data', 'fsdp')) on 8 devices (data=2 x fsdp=4)" in column["['b']"]
    assert "P('data', 'fsdp') on 8 devices (data=2 x fsdp=4)" in column["['c']"]
    assert "P() on 8 devices (data=2 x fsdp=4)" in column["['d']"]
    assert "P() on 8 devices (data=8)" in column["['e']"]
    assert "P('data') on 8 devices (data=8)" in column["['f']"]
    # Replicated leaves: 'd', 'e'; sharded: 'a' (4x2 floats), 'b' (1), 'c' (1x1), 'f' (1).
    assert report.replicated_bytes == 24 and report.sharded_bytes == 32 + 4 + 4 + 4


def test_a_one_device_mesh_is_replicated():
    tree = {"w": _on(jnp.ones(8), jaxdev.data_mesh(1), P("data"))}
    report = jaxdev.placement(tree)
    assert report.sharded_bytes == 0 and report.replicated_bytes == 32
    assert "P('data') on 1 device (data=1)" in str(report)


# ---------------------------------------------------------------- assert_sharded_fraction


def test_sharded_fraction_passes_and_fails_on_logical_bytes(mesh):
    tree = _half(mesh)  # 4096 of 4608 logical bytes sharded: 88.9%
    jaxdev.assert_sharded_fraction(tree, at_least=0.88)
    jaxdev.assert_sharded_fraction(tree, at_least=0)
    with pytest.raises(PlacementAssertionError) as err:
        jaxdev.assert_sharded_fraction(tree)
    lines = str(err.value).splitlines()
    assert lines[0] == (
        "`assert_sharded_fraction` failed: 88.89% of the 4.5 KiB of `tree` (logical bytes) is "
        "in sharded leaves, expected at least 90.00%. The largest of the 1 leaves that are not "
        "sharded:"
    )
    assert lines[1] == (
        "  ['r']: float32[128], 512 B, found mesh(data=8) P() (fully replicated on 8 devices)"
    )
    assert lines[2].startswith("Fix: shard the large leaves")
    assert isinstance(err.value, AssertionError)


def test_sharded_fraction_counts_sub_byte_dtypes_packed(mesh):
    tree = {  # 4 KiB of int4 sharded, 4 KiB float32 replicated, 1 KiB of int4 on the host
        "w": _on(jnp.zeros(8192, jnp.int4), mesh, P("data")),
        "b": _on(jnp.ones(1024, jnp.float32), mesh, P()),
        "h": np.zeros(2048, jnp.int4),
    }
    with pytest.raises(PlacementAssertionError) as err:  # was 57.14% of 14.0 KiB: passed
        jaxdev.assert_sharded_fraction(tree, at_least=0.5)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("`assert_sharded_fraction` failed: 44.44% of the 9.0 KiB ")
    assert lines[2].startswith("  ['h']: int4[2048], 1.0 KiB, found ")


def test_sharded_fraction_lists_largest_first_and_counts_the_rest(mesh, devices):
    tree = {f"w{i:02d}": _on(jnp.ones((i + 1) * 8, jnp.bfloat16), mesh, P()) for i in range(12)}
    tree["one"] = jax.device_put(jnp.ones((2, 1000), jnp.int8), devices[5])
    tree["host"] = np.ones(3, np.float32)
    tree["big"] = _on(jnp.ones((8, 4)), mesh, P("data"))
    with pytest.raises(PlacementAssertionError) as err:
        jaxdev.assert_sharded_fraction(tree, at_least=0.5)
    lines = str(err.value).splitlines()
    assert "The largest of the 14 leaves that are not sharded:" in lines[0]
    assert lines[1] == "  ['one']: int8[2, 1000], 2.0 KiB, found cpu:5"
    assert lines[2] == (
        "  ['w11']: bfloat16[96], 192 B, found mesh(data=8) P() (fully replicated on 8 devices)"
    )
    assert lines[10].startswith("  ['w03']")
    assert lines[11] == "  ... and 4 smaller leaves (108 B)"  # w02, w01, host, w00: 48+32+12+16


def test_sharded_fraction_edge_cases(mesh):
    jaxdev.assert_sharded_fraction({}, at_least=1.0)  # no bytes: passes
    jaxdev.assert_sharded_fraction({"s": _half(mesh)["s"]}, at_least=1.0)
    with pytest.raises(PlacementAssertionError, match=r"99\.61% .* at least 100\.00%"):
        jaxdev.assert_sharded_fraction(
            {"s": _half(mesh)["s"], "t": _on(jnp.ones(4), mesh, P())}, at_least=1.0
        )
    fsdp = jaxdev.shard_params(
        {"w": jnp.ones((4096, 64)), "b": jnp.ones(64)}, jaxdev.make_mesh({"fsdp": 8}), "fsdp"
    )
    jaxdev.assert_sharded_fraction(fsdp, at_least=0.99)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.9", True, None, 90])
def test_at_least_must_be_a_fraction(mesh, bad):
    with pytest.raises(UsageError, match=r"`at_least` must be a fraction in \[0, 1\]"):
        jaxdev.assert_sharded_fraction(_half(mesh), at_least=bad)


def test_dead_traced_and_non_array_leaves_are_listed(mesh):
    tree = _half(mesh)
    tree["s"].delete()
    with pytest.raises(PlacementAssertionError) as err:
        jaxdev.assert_sharded_fraction(dict(tree, bad="text"))
    msg = str(err.value)
    assert "2 of 3 leaves of `tree` cannot be measured" in msg
    assert "['s']: found deleted or donated" in msg and "['bad']: found a str" in msg

    @jax.jit
    def inside(x):
        with pytest.raises(PlacementAssertionError, match="a tracer"):
            jaxdev.assert_sharded_fraction({"x": x})
        return x

    inside(jnp.ones(2))


def test_chex_disable_asserts_switches_it_off(mesh):
    chex.disable_asserts()
    try:
        assert jaxdev.assert_sharded_fraction(_half(mesh), at_least=1.0) is None
    finally:
        chex.enable_asserts()
    with pytest.raises(PlacementAssertionError):
        jaxdev.assert_sharded_fraction(_half(mesh), at_least=1.0)
