"""Devices: d2l's cpu/gpu/try_gpu, spec strings, fake CPU devices, describe()."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import N_DEVICES, run_python

import jaxdev
from jaxdev import DeviceNotFoundError, UsageError


def test_cpu_indexes_local_cpu_devices(devices):
    assert jaxdev.d2l.cpu() == devices[0]
    assert jaxdev.d2l.cpu(3) == devices[3]
    assert jaxdev.d2l.cpu(np.int64(2)) == devices[2]


def test_negative_index_refused_where_jax_returns_last_device(devices):
    assert jax.devices()[-1] == devices[-1]  # what JAX silently does
    with pytest.raises(UsageError, match=r"`i` must be >= 0, got -1.*Available devices"):
        jaxdev.d2l.cpu(-1)
    with pytest.raises(UsageError, match="got -2"):
        jaxdev.d2l.try_gpu(-2)


def test_index_past_end_names_count_and_devices():
    with pytest.raises(DeviceNotFoundError) as err:
        jaxdev.d2l.cpu(N_DEVICES)
    msg = str(err.value)
    assert f"has {N_DEVICES} cpu device(s)" in msg
    assert "valid indexes 0..7" in msg and "cpu:7" in msg
    assert isinstance(err.value, LookupError)


@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_index_of_wrong_type(bad):
    with pytest.raises(UsageError, match="`i` must be a device index"):
        jaxdev.d2l.cpu(bad)


def test_gpu_strict_on_cpu_host():
    with pytest.raises(DeviceNotFoundError) as err:
        jaxdev.d2l.gpu()
    msg = str(err.value)
    assert "No gpu device" in msg and "[cpu]" in msg and "try_gpu" in msg and "cpu:0" in msg


def test_d2l_fallbacks_on_cpu_host():
    assert jaxdev.d2l.num_gpus() == 0
    assert jaxdev.d2l.try_gpu() == jaxdev.d2l.cpu()
    assert jaxdev.d2l.try_gpu(10) == jaxdev.d2l.cpu()
    assert jaxdev.d2l.try_all_gpus() == [jaxdev.d2l.cpu()]


@pytest.mark.parametrize(
    "spec, index",
    [("cpu", 0), ("cpu:3", 3), ("CPU:5", 5), (" cpu : 1 ", 1), (4, 4), (np.int32(6), 6)],
)
def test_device_specs(devices, spec, index):
    assert jaxdev.device(spec) == devices[index]


def test_device_passes_device_objects_through(devices):
    assert jaxdev.device(devices[2]) is devices[2]


@pytest.mark.parametrize("spec", ["gpu:1", "cuda:1", "rocm", "tpu:0"])
def test_absent_platform_specs(spec):
    with pytest.raises(DeviceNotFoundError, match="Available devices: \\[cpu:0"):
        jaxdev.device(spec)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "not a device spec"),
        ("cpu:", "not a device spec"),
        ("cpu:1:2", "not a device spec"),
        ("gpu1", "expected 'platform\\[:index\\]'"),
        ("metal:0", "unknown platform 'metal'"),
        ("cpu:-1", "must be >= 0"),
        ("cpu:x", "not a device spec"),
    ],
)
def test_malformed_specs(spec, match):
    with pytest.raises(UsageError, match=match):
        jaxdev.device(spec)


@pytest.mark.parametrize("spec", [1.5, None, [0], object()])
def test_spec_of_wrong_type(spec):
    with pytest.raises(UsageError, match="`spec` must be a jax.Device, an int or a string"):
        jaxdev.device(spec)


def test_int_spec_out_of_range():
    with pytest.raises(DeviceNotFoundError, match="`spec`=8 is out of range"):
        jaxdev.device(8)


def test_device_list(devices):
    assert jaxdev.device_list() == devices
    assert jaxdev.device_list(3) == devices[:3]
    assert jaxdev.device_list("cpu") == devices
    assert jaxdev.device_list(["cpu:1", 0]) == [devices[1], devices[0]]
    with pytest.raises(UsageError, match="lists cpu:1 twice"):
        jaxdev.device_list(["cpu:1", 1])
    with pytest.raises(DeviceNotFoundError, match="use_fake_cpu_devices\\(9\\)"):
        jaxdev.device_list(9)
    with pytest.raises(UsageError, match="at least 1"):
        jaxdev.device_list(0)
    with pytest.raises(DeviceNotFoundError):
        jaxdev.device_list("gpu")


@pytest.mark.parametrize(
    "devices, error, match",
    [
        ("cpu:99", DeviceNotFoundError, "`devices`=99 is out of range"),
        (["cpu:0", 99], DeviceNotFoundError, "`devices\\[1\\]`=99 is out of range"),
        ([0, 1.5], UsageError, "`devices\\[1\\]` must be a jax.Device, an int or a string"),
        (1.5, UsageError, "`devices` must be None, a count, a platform name"),
    ],
)
def test_device_list_errors_name_devices(devices, error, match):
    """The errors name `devices` (and the list item), not `device`'s `spec`; a value that is
    no spec and no list is refused by name, not with Python's "not iterable" TypeError."""
    with pytest.raises(error, match=match):
        jaxdev.device_list(devices)


def test_use_fake_cpu_devices_after_start(devices):
    jaxdev.testing.use_fake_cpu_devices(N_DEVICES)  # same count: no-op
    with pytest.raises(jaxdev.BackendStartedError, match="already started with 8 CPU device"):
        jaxdev.testing.use_fake_cpu_devices(4)


def test_describe_is_plain_data(devices):
    info = jaxdev.describe()
    json.dumps(info)  # plain data only
    assert info["device_count"] == info["local_device_count"] == N_DEVICES
    assert info["platforms"] == ["cpu"] and info["process_count"] == 1
    assert [d["id"] for d in info["devices"]] == list(range(N_DEVICES))
    assert all(d["memory"] is None for d in info["devices"])  # CPU has no memory stats
    assert info["warnings"] == []


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_use_fake_cpu_devices_refuses_what_is_not_a_count(bad):
    with pytest.raises(jaxdev.UsageError, match=r"`n` must be a device count \(an int >= 1\)"):
        jaxdev.testing.use_fake_cpu_devices(bad)


def test_use_fake_cpu_devices_before_start_in_subprocess():
    proc = run_python(
        """
        import os, jaxdev
        jaxdev.testing.use_fake_cpu_devices(3)
        import jax
        print(len(jax.devices()), os.environ["XLA_FLAGS"])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "--xla_force_host_platform_device_count=3"]


def test_use_fake_cpu_devices_reaches_subprocesses_despite_jax_num_cpu_devices():
    """Before: with ``JAX_NUM_CPU_DEVICES=2`` in the environment a subprocess started with 2
    devices, not the count asked for (JAX reads the variable before ``XLA_FLAGS``)."""
    proc = run_python(
        """
        import subprocess, sys, jaxdev
        jaxdev.testing.use_fake_cpu_devices(3)
        child = "import jax; print(len(jax.devices()))"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout)
        """,
        env={"JAX_NUM_CPU_DEVICES": "2"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3"]


def test_xla_flags_two_devices_in_subprocess():
    proc = run_python(
        """
        import jax.numpy as jnp, jaxdev
        print(len(jaxdev.device_list()), jaxdev.d2l.cpu(1))
        x = jaxdev.to_device(jnp.ones(3), "cpu:1")
        print(jaxdev.device_of(x))
        try:
            jaxdev.d2l.cpu(2)
        except jaxdev.DeviceNotFoundError as e:
            print("refused", "has 2 cpu" in str(e))
        """,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["2 cpu:1", "cpu:1", "refused True"]


@pytest.mark.devices(1)
def test_single_cpu_d2l_case():
    assert jaxdev.d2l.num_gpus() == 0 and jaxdev.d2l.try_all_gpus() == [jaxdev.d2l.cpu(0)]
    y = jaxdev.to_device(np.ones((2, 3), np.float32), jaxdev.d2l.try_gpu())
    assert jaxdev.device_of(y) == jaxdev.d2l.cpu(0) and jaxdev.to_device(y, "cpu") is y
    info = jaxdev.describe()
    assert (info["device_count"], info["warnings"]) == (1, [])


def test_describe_warns_when_gpu_requested_but_cpu_started():
    proc = run_python(
        """
        import jax, jaxdev
        jax.config.update("jax_platforms", "cpu")
        import os; os.environ["JAX_PLATFORMS"] = "cuda,cpu"
        print(jaxdev.describe()["warnings"])
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert "A GPU was requested ('cuda,cpu')" in proc.stdout  # named once, not twice


def test_platform_that_cannot_start_is_a_clear_lookup_error():
    # JAX 0.10.2 raises a bare AssertionError from its backend start for this.
    proc = run_python(
        """
        import jaxdev
        for fn in (jaxdev.d2l.cpu, jaxdev.describe, lambda: jaxdev.device_list(2)):
            try:
                fn()
            except LookupError as e:
                print(type(e).__name__, "|", e)
        """,
        env={"JAX_PLATFORMS": "rocm"},  # no ROCm here, nor on the lent CUDA machines
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout + proc.stderr
    for line in lines:
        assert line.startswith("DeviceNotFoundError | ")
        assert "JAX_PLATFORMS='rocm'" in line and "JAX_PLATFORMS=cpu" in line


@pytest.mark.gpu
def test_gpu_present_when_lent():
    assert jaxdev.d2l.num_gpus() >= 1
    assert jaxdev.d2l.gpu(0).platform == "gpu"
    assert jaxdev.device("cuda:0") == jaxdev.d2l.gpu(0)
    assert jaxdev.describe()["devices"][0]["memory"] is not None


def test_empty_device_lists_and_duplicate_meshes_are_refused_where_given(devices):
    with pytest.raises(UsageError, match="`devices` is empty"):
        jaxdev.device_list([])
    with pytest.raises(UsageError, match="`devices` is empty"):
        jaxdev.data_mesh([])
    twice = jax.sharding.Mesh(np.array([devices[0], devices[0]]), ("data",))
    for call in (
        lambda: jaxdev.shard_batch(np.ones((2, 1)), twice),
        lambda: jaxdev.replicate({"w": np.ones(2)}, twice),
        lambda: jaxdev.to_device({"w": np.ones(2)}, twice),
        lambda: jaxdev.Strategy.sharded(twice),
    ):
        with pytest.raises(jaxdev.ShardingError, match="`mesh` lists cpu:0 more than once"):
            call()
