"""GPU targets: meshes of GPUs that are not here, planned by XLA:GPU (``make_mesh(target=)``).

Tests marked ``target`` compile for a GPU through ``jax.experimental.topologies`` and need
the CUDA plugin (``jaxdev[cuda12]``), no GPU; the others run everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import has_cuda_plugin
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev._target import load_target

H100_MEMORY = 84978434048  # device_memory_size of jaxdev/targets/h100_sxm.txtpb
AXES = {"data": 2, "fsdp": 4}
D = 256


def _params():
    shapes = {"w1": (D, 4 * D), "w2": (4 * D, 4 * D), "w3": (4 * D, 4 * D), "w4": (4 * D, D)}
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


def _loss(p, b):
    layer = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))  # per-layer remat
    h = b
    for k in ("w1", "w2", "w3"):
        h = layer(h, p[k])
    return ((h @ p["w4"]) ** 2).sum(-1)


TX = optax.sgd(0.1)
BATCH = jax.ShapeDtypeStruct((256, D), jnp.float32)


def _state():
    return jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))


def _step(mesh, rules="fsdp"):
    return jaxdev.make_train_step(_loss, TX, jaxdev.Strategy.sharded(mesh, rules=rules))


@pytest.fixture(scope="module")
def h100():
    return jaxdev.make_mesh(AXES, target="h100")


def _direct_analysis():
    """XLA:GPU's memory_analysis() of the same SGD step, built with topologies and jax.jit
    alone: the fsdp specs jaxdev's rules give, the batch split over both axes, donated."""
    from jax.experimental import topologies

    text = load_target("h100").config
    topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x8")
    mesh = topologies.make_mesh(topo, tuple(AXES.values()), tuple(AXES))
    specs = jax.tree.map(lambda s: s.spec, jaxdev.param_shardings(_params(), mesh, "fsdp"))
    ps = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    rows, one = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())

    def train(params, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(p, batch).mean())(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    jitted = jax.jit(train, in_shardings=(ps, rows), out_shardings=(ps, one), donate_argnums=0)
    return jitted.lower(_params(), BATCH).compile().memory_analysis()


@pytest.mark.target
def test_planned_peak_is_xla_gpus_own_and_fits_without_a_limit(h100):
    plan = jaxdev.memory.plan(_state(), step=_step(h100), batch=BATCH)
    m = _direct_analysis()  # the plan's peak is the same formula; XLA's own peak recorded
    direct = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + (
        m.temp_size_in_bytes
    )
    assert abs(plan.peak - direct) <= 0.02 * direct, (plan.peak, direct)
    xla = m.peak_memory_in_bytes  # jaxdev's step adds the step count and the loss: 40 B
    assert abs(plan.compiled.xla_peak - xla) <= 0.02 * xla and xla <= plan.peak
    assert "XLA's own peak_memory_in_bytes: " in str(plan)
    assert (plan.backend, plan.target, plan.overstates) == ("gpu", "h100", False)
    assert plan.fits()  # no limit: the target's
    limit, source = jaxdev.memory.resolve_limit(None, h100)
    assert limit == int(H100_MEMORY * 0.75) and "'h100'" in source
    text = str(plan)
    assert "for 8 x NVIDIA H100 80GB HBM3 (target 'h100')" in text
    assert "compiled by XLA:GPU" in text and "overstated" not in text


@pytest.mark.target
def test_every_planning_path_takes_the_targets_limit(h100, monkeypatch):
    step = _step(h100)
    lowered = step.lower(_state(), BATCH)
    assert lowered.compile().memory_analysis() is not None
    assert jaxdev.memory.plan(_state(), h100, "fsdp").fits()  # state only, no step
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert jaxdev.memory.resolve_limit(None, h100)[0] == H100_MEMORY // 2
    plan = jaxdev.memory.plan(_state(), step=step, batch=BATCH)
    assert not plan.fits(plan.peak - 1) and plan.fits(plan.peak)


@pytest.mark.target
def test_nothing_is_allocated_or_run_on_a_target(h100):
    step, params = _step(h100), jax.tree.map(lambda s: jnp.zeros(s.shape), _params())
    batch = np.ones(BATCH.shape, np.float32)
    attempts = {
        "step(state, batch)": lambda: step(_state(), batch),
        "step(real state, batch)": lambda: step(jaxdev.TrainState.create(params, TX), batch),
        "init_state": lambda: step.init_state(params),
        "put_batch": lambda: step.put_batch(batch),
        "to_device": lambda: jaxdev.to_device(params, NamedSharding(h100, P())),
        "shard_batch": lambda: jaxdev.shard_batch(batch, h100),
    }
    replicated = _step(h100, "replicate")
    attempts["init_state (replicate)"] = lambda: replicated.init_state(params)
    init = lambda: {"w": jnp.ones((8, 8))}  # noqa: E731
    for r in ("fsdp", "replicate"):
        attempts[f"init_sharded {r}"] = lambda r=r: jaxdev.init_sharded(init, mesh=h100, rules=r)
    for name, attempt in attempts.items():
        with pytest.raises(jaxdev.PlacementError, match="compiling and planning only") as e:
            attempt()
        assert "without `target=`" in str(e.value), name
    with pytest.raises(jaxdev.PlacementError, match="running a step on target 'h100'"):
        step(_state(), batch)


@pytest.mark.target
@pytest.mark.parametrize(
    "target, devices, axes, n",
    [("h200", None, {"data": 8}, 8), ("a100-80gb", "2x8", {"data": 2, "fsdp": -1}, 16)],
)
def test_targets_by_name_and_topology(target, devices, axes, n):
    mesh = jaxdev.make_mesh(axes, devices, target=target)
    assert mesh.size == n and mesh.devices.flat[0].platform == "gpu"
    assert mesh.devices.flat[0].device_kind == load_target(target).kind
    assert jaxdev.memory.resolve_limit(None, mesh)[0] == int(load_target(target).memory * 0.75)


def test_a_target_text_by_path_and_the_shipped_texts(tmp_path):
    assert load_target("h100").memory == H100_MEMORY
    assert load_target("h200").kind == "NVIDIA H200" and load_target("h200").memory > 140 * 2**30
    assert load_target("a100-80gb").kind == "NVIDIA A100-SXM4-80GB"
    path = tmp_path / "mine.txtpb"
    path.write_text(load_target("a100-80gb").config)
    assert load_target(str(path)).memory == load_target("a100-80gb").memory
    (tmp_path / "bad.txtpb").write_text("platform_name: 'CUDA'\n")
    with pytest.raises(jaxdev.UsageError, match="not an XLA GpuTargetConfig text"):
        load_target(str(tmp_path / "bad.txtpb"))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"target": "h300"}, jaxdev.UsageError, "`target`='h300' is neither a GPU jaxdev knows"),
        ({"target": ["h100"]}, jaxdev.UsageError, "`target` must be a GPU name or a path"),
        ({"target": "h100", "devices": "2x8"}, jaxdev.ShardingError, "gives 16 target devices"),
        ({"target": "h100", "devices": 16}, jaxdev.ShardingError, "axes multiply to 8"),
        ({"target": "h100", "devices": "2x"}, jaxdev.ShardingError, "hosts x devices per host"),
    ],
)
def test_a_bad_target_or_topology_is_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        jaxdev.make_mesh(AXES, **kwargs)


@pytest.mark.skipif(has_cuda_plugin(), reason="the CUDA plugin is installed here")
def test_a_target_without_the_cuda_plugin_says_what_to_install():
    with pytest.raises(jaxdev.UsageError, match=r"pip install 'jaxdev\[cuda12\]'"):
        jaxdev.make_mesh(AXES, target="h100")


def test_a_cpu_plan_of_sharded_params_says_it_overstates():
    mesh = jaxdev.make_mesh(AXES)
    fsdp = jaxdev.memory.plan(_state(), step=_step(mesh), batch=BATCH)
    assert fsdp.overstates and (fsdp.backend, fsdp.target) == ("cpu", None)
    assert "target='h100'" in str(fsdp) and "compiled by XLA:CPU" in str(fsdp)
    replicated = jaxdev.memory.plan(_state(), step=_step(mesh, "replicate"), batch=BATCH)
    assert not replicated.overstates and "overstated" not in str(replicated)
    assert not jaxdev.memory.plan(_state(), mesh, "fsdp").overstates  # nothing compiled


@pytest.mark.target
def test_restoring_onto_a_target_is_named_not_damage(h100, tmp_path):
    real = jaxdev.TrainState.create({"w": jnp.ones((64, 64))}, TX)
    jaxdev.save(tmp_path / "c", real)
    ckpt = jaxdev.Checkpointer(tmp_path / "steps")
    ckpt.save(1, real)
    ckpt.wait()
    on = NamedSharding(h100, P())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), real)
    targets = [h100, on, h100.devices.flat[0], abstract]
    attempts = [lambda t=t: jaxdev.restore(tmp_path / "c", t) for t in targets]
    attempts += [lambda: jaxdev.restore(tmp_path / "c", h100, rules="fsdp")]
    attempts += [lambda: ckpt.restore(h100, rules="fsdp"), lambda: ckpt.restore(abstract)]
    for attempt in attempts:
        with pytest.raises(jaxdev.PlacementError, match="restoring checkpoint .* on target 'h100'"):
            attempt()
    assert ckpt.restore().params["w"].shape == (64, 64)  # nothing was marked damaged


@pytest.mark.target
def test_offload_on_a_target_is_refused_with_the_reason(h100):
    from jax.sharding import NamedSharding

    # JAX keeps no memory kind on compile-only devices: an offload plan would be a wrong one
    assert NamedSharding(h100, P(), memory_kind="pinned_host").memory_kind is None
    with pytest.raises(jaxdev.UsageError, match="JAX drops memory kinds on compile-only"):
        jaxdev.Strategy.sharded(h100, rules="fsdp", offload="opt_state")


@pytest.mark.parametrize(
    "env, fraction, var",
    [
        ({"XLA_CLIENT_MEM_FRACTION": "0.9"}, 0.9, "XLA_CLIENT_MEM_FRACTION"),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 0.5, "XLA_PYTHON_CLIENT_MEM_FRACTION"),
        (  # JAX reads the new name first; the old one is its deprecated alias
            {"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"},
            0.9,
            "XLA_CLIENT_MEM_FRACTION",
        ),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "PLATFORM"}, 1.0, "platform allocator"),
        ({}, 0.75, "JAX default"),
    ],
)
def test_a_targets_limit_reads_the_variables_jax_reads(env, fraction, var, monkeypatch):
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    limit, source = load_target("h100").limit()
    assert limit == int(H100_MEMORY * fraction) and var in source


@pytest.mark.parametrize("value", ["abc", "0", "1.5"])
def test_a_bad_mem_fraction_is_named(value, monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", value)
    with pytest.raises(jaxdev.UsageError, match=f"XLA_CLIENT_MEM_FRACTION='{value}' is not a"):
        load_target("h100").limit()


def test_an_unreadable_target_file_is_named(tmp_path):
    (tmp_path / "bin.txtpb").write_bytes(b"gpu_device_info {\x80\xff")
    with pytest.raises(jaxdev.UsageError, match="bin.txtpb'.*cannot read the file"):
        load_target(str(tmp_path / "bin.txtpb"))
    with pytest.raises(jaxdev.UsageError, match="is a directory"):
        load_target(str(tmp_path))


@pytest.mark.target
def test_a_target_text_xla_cannot_parse_is_named(tmp_path):
    path = tmp_path / "fake.txtpb"
    path.write_text("gpu_device_info { device_memory_size: 1 this: 2 }\n")
    with pytest.raises(jaxdev.UsageError, match="fake.txtpb'.*XLA cannot read the file"):
        jaxdev.make_mesh(AXES, target=str(path))


@pytest.mark.parametrize(
    "devices, want",
    [(8, "1x1x8"), ("8", "1x1x8"), (" 8 ", "1x1x8"), ("1x1x8", "1x1x8"), ("1x2x8", "1x2x8")]
    + [(16, "1x2x8"), (12, "1x1x12"), ("2x8", "1x2x8")],
)
def test_topology_spellings(devices, want):
    from jaxdev._target import topology

    assert topology(devices, None) == want


@pytest.mark.target
def test_explain_memory_on_a_target_skips_offload_with_the_message(h100):
    why = _step(h100).explain_memory(_state(), BATCH, limit=1, options=("offload",))
    note = {o.change: o.note for o in why.options}["offload"]
    assert note.startswith("offload does not apply (`offload`=") and "UsageError(" not in note
