"""Memory plans (issue 12): bytes per device from shapes, compiled figures, fits, errors."""

from __future__ import annotations

import gc
import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import MemoryPlanError, UsageError
from jaxdev.memory._offload import shard_bytes
from jaxdev.memory._plan import CompiledMemory, check_fits, fsdp_alternative, resolve_limit

MiB = 2**20


def _params(width: int = 512) -> dict:
    return {
        "Dense_0": {"kernel": jnp.ones((width, 256)), "bias": jnp.zeros(256)},
        "Dense_1": {"kernel": jnp.ones((256, 16)), "bias": jnp.zeros(16)},
    }


def _state(tx=None, width: int = 512):
    return jaxdev.TrainState.create(_params(width), tx or optax.adam(1e-3))


def _max(report) -> int:
    return max(report.bytes_by_device.values())


@pytest.fixture
def mesh24():
    return jaxdev.make_mesh({"data": 2, "fsdp": 4})


# ---------------------------------------------------------------- agreement with placement()


@pytest.mark.parametrize(
    "axes, rules",
    [
        ({"data": 2, "fsdp": 4}, "fsdp"),
        ({"data": 2, "fsdp": 4}, "replicate"),
        ({"fsdp": 8}, "fsdp"),
        ({"data": 2, "model": 4}, [("kernel", P(None, "model"))]),
    ],
)
def test_plan_agrees_with_the_placed_trees_report(axes, rules):
    mesh = jaxdev.make_mesh(axes)
    state = _state()
    placed = jax.device_put(state, jaxdev.param_shardings(state, mesh, rules))
    p = jaxdev.memory.plan(state, mesh, rules)
    for category in ("params", "opt_state"):
        got, want = p[category], _max(jaxdev.placement(getattr(placed, category)))
        assert abs(got - want) <= 0.01 * want, (category, got, want)
        assert got == want  # in fact exact
    assert p["other"] == _max(jaxdev.placement(placed.step)) == 4
    assert p.total == _max(jaxdev.placement(placed))
    assert p.by_device == jaxdev.placement(placed).bytes_by_device
    assert p.peak == p.total and p.compiled is None


def test_fsdp_divides_params_and_adam_state_by_the_axis_size(mesh24):
    p = jaxdev.memory.plan(_state(), mesh24, "fsdp")
    rows = {r.category: r for r in p.rows}
    assert [r.category for r in p.rows] == ["params", "opt_state", "other"]
    # Dense_0/kernel (512x256) and Dense_1/kernel (256x16 = 4096) shard over fsdp=4;
    # the biases (256, 16 elements < min_size 1024) stay whole.
    params = (512 * 256 // 4 + 256 * 16 // 4 + 256 + 16) * 4
    assert p["params"] == params and p["opt_state"] == 2 * params + 4
    assert rows["params"].total_bytes == (512 * 256 + 256 + 256 * 16 + 16) * 4
    assert rows["params"].sharded_bytes == (512 * 256 + 256 * 16) * 4
    assert rows["params"].leaves == 4 and rows["opt_state"].leaves == 9  # mu, nu, count
    assert rows["other"].sharded_share == 0.0


def test_shape_structs_and_real_arrays_give_equal_plans(mesh24):
    tx = optax.adam(1e-3)
    state = _state(tx)
    shapes = jax.eval_shape(lambda: _state(tx))
    assert isinstance(shapes.params["Dense_0"]["kernel"], jax.ShapeDtypeStruct)
    for rules in ("fsdp", "replicate"):
        a, b = jaxdev.memory.plan(state, mesh24, rules), jaxdev.memory.plan(shapes, mesh24, rules)
        assert a == b and str(a) == str(b)
    # Host values too (numpy and Python numbers, with x64's dtype rules).
    host = jax.tree.map(np.asarray, state)
    assert jaxdev.memory.plan(host, mesh24, "fsdp") == jaxdev.memory.plan(state, mesh24, "fsdp")
    numbers = jaxdev.memory.plan({"a": 1.0, "b": 3, "c": np.float64(2.0)}, mesh24)
    assert numbers["params"] == 12  # float32 + int32 + float32 (x64 off)
    # ShapeDtypeStructs of 64-bit dtypes too: JAX lowers them as 32-bit ones when x64 is off
    # (plan counted 8 bytes an element, twice what the program holds).
    wide = {"a": jax.ShapeDtypeStruct((4,), np.float64), "b": jax.ShapeDtypeStruct((2,), np.int64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # JAX warns that it truncates them
        narrow = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), wide)
        assert jaxdev.memory.plan(wide, mesh24)["params"] == 24 == numbers["params"] * 2
        assert jaxdev.memory.plan(narrow, mesh24)["params"] == 24


def test_nothing_is_allocated_for_huge_shapes(mesh24):
    # 1 TiB of float32 params: planned from shapes, never allocated.
    shapes = {"w": jax.ShapeDtypeStruct((2**20, 2**18), jnp.float32)}
    full, fsdp = jaxdev.memory.plan(shapes, mesh24), jaxdev.memory.plan(shapes, mesh24, "fsdp")
    assert full["params"] == 2**40 and fsdp["params"] == 2**38
    assert "1024.0 GiB" in str(full) and "256.0 GiB" in str(fsdp)


@pytest.mark.parametrize("dtype, itemsize", [(ml_dtypes.bfloat16, 2), (np.int8, 1)])
def test_small_dtypes(dtype, itemsize):
    mesh = jaxdev.make_mesh({"fsdp": 8})
    shapes = {
        "a": jax.ShapeDtypeStruct((1024, 8), dtype),
        "b": jax.ShapeDtypeStruct((4096,), dtype),
        "c": jax.ShapeDtypeStruct((7,), dtype),
    }
    p = jaxdev.memory.plan(shapes, mesh, "fsdp")
    assert p["params"] == (1024 * 8 // 8 + 4096 // 8 + 7) * itemsize
    placed = jaxdev.shard_params(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), mesh, "fsdp"
    )
    assert p["params"] == _max(jaxdev.placement(placed))


def test_indivisible_leaves_stay_whole_and_uneven_batches_are_padded(mesh24):
    shapes = {"odd": jax.ShapeDtypeStruct((1001, 3), jnp.float32)}  # no dim divisible by 4
    with pytest.raises(jaxdev.ShardingError, match="shards no leaf.*'odd', has shape"):
        jaxdev.memory.plan(shapes, mesh24, "fsdp", min_size=1)  # the whole model on every device
    even = {**shapes, "w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    p = jaxdev.memory.plan(even, mesh24, "fsdp", min_size=1)
    rows = {r.category: r for r in p.rows}
    assert p["params"] == 1001 * 3 * 4 + 8 * 4 * 4 // 4  # per device: 'w' over fsdp=4
    assert rows["params"].sharded_bytes == 8 * 4 * 4  # 'w' split, 'odd' whole
    # 13 rows over data x fsdp (8 devices): 2 rows per device, as shard_batch(pad=True) pads.
    batch = {
        "x": jax.ShapeDtypeStruct((13, 5), jnp.float32),
        "n": jax.ShapeDtypeStruct((), "int32"),
    }
    p = jaxdev.memory.plan(even, mesh24, "fsdp", min_size=1, batch=batch, pad=True)
    row = {r.category: r for r in p.rows}["batch"]
    assert row.bytes_per_device == 2 * 5 * 4 + 4 and row.total_bytes == 13 * 5 * 4 + 4
    assert row.sharded_bytes == 13 * 5 * 4  # the scalar is replicated
    # The padded shard shape is what XLA would use for an uneven layout.
    s = NamedSharding(mesh24, P(None, "fsdp"))
    f32 = np.dtype("float32")
    assert shard_bytes(s, (3, 6), f32) == shard_bytes(s, (3, 8), f32) == 3 * 2 * 4
    explicit = jaxdev.make_mesh({"data": 2, "fsdp": 4}, axis_type="explicit")
    reduced = NamedSharding(explicit, P(None, "fsdp", reduced={"data"}))  # [*spec]: ValueError
    assert shard_bytes(reduced, (3, 6), f32) == 3 * 2 * 4


@pytest.mark.parametrize("rows", [3, 13])
def test_uneven_rows_are_refused_as_shard_batch_refuses_them_unless_pad(rows):
    """plan counted 3 rows on 8 devices as padded where shard_batch raises."""
    mesh, x = jaxdev.data_mesh(), np.ones((rows, 1000), np.float32)
    with pytest.raises(jaxdev.ShardingError, match=f"`batch` leaf <root> has {rows} rows") as err:
        jaxdev.shard_batch(x, mesh)
    match = rf"`batch` leaf \['x'\] has {rows} rows, which do not split evenly over 8 devices"
    with pytest.raises(type(err.value), match=match + r" .* Pass `pad=True`"):
        jaxdev.memory.plan({}, mesh, batch={"x": x})
    assert jaxdev.memory.plan({}, mesh, batch={"x": x}, pad=True)["batch"] == 4000 * -(-rows // 8)


def test_the_batch_splits_over_every_axis_but_model_axes():
    batch = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    params = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    dp_tp = jaxdev.memory.plan(params, jaxdev.make_mesh({"data": 2, "model": 4}), batch=batch)
    dp_fsdp = jaxdev.memory.plan(params, jaxdev.make_mesh({"data": 2, "fsdp": 4}), batch=batch)
    one_d = jaxdev.memory.plan(params, jaxdev.data_mesh(), batch=batch)
    assert dp_tp["batch"] == 8 * 64 * 4  # split over data only
    assert dp_fsdp["batch"] == one_d["batch"] == 2 * 64 * 4
    assert dp_tp.total == 8 * 64 * 4 + 16


def test_tensor_parallel_regex_rules_on_a_2d_mesh():
    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    shapes = {
        "kernel": jax.ShapeDtypeStruct((64, 128), jnp.float32),
        "bias": jax.ShapeDtypeStruct((128,), jnp.float32),
    }
    p = jaxdev.memory.plan(shapes, mesh, [("kernel", P(None, "model"))])
    assert p["params"] == 64 * 32 * 4 + 128 * 4
    assert p.rows[0].sharded_bytes == 64 * 128 * 4


def test_linen_boxes_and_nnx_state():
    import flax.linen as nn
    from flax import nnx

    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    boxed = {"w": nn.Partitioned(jnp.ones((8, 64)), (None, "model")), "b": jnp.ones(64)}
    p = jaxdev.memory.plan(boxed, mesh, "flax")
    assert p["params"] == 8 * 16 * 4 + 64 * 4
    state = nnx.state(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
    placed = jaxdev.shard_params(state, mesh, "replicate")
    assert (
        jaxdev.memory.plan(state, mesh)["params"]
        == _max(jaxdev.placement(placed))
        == (64 * 32 + 32) * 4
    )


# ---------------------------------------------------------------- compiled step


def _loss(params, batch):
    h = batch["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
    out = jnp.tanh(h) @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]
    return jnp.mean((out - batch["y"]) ** 2, axis=-1)


def _batch(rows: int = 32, width: int = 512) -> dict:
    return {
        "x": jax.ShapeDtypeStruct((rows, width), jnp.float32),
        "y": jax.ShapeDtypeStruct((rows, 16), jnp.float32),
    }


@pytest.mark.parametrize("rules", ["fsdp", "replicate"])
def test_compiled_figures_come_from_memory_analysis_and_match_the_plan(mesh24, rules):
    tx = optax.adam(1e-3)
    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.sharded(mesh24, rules=rules))
    shapes = jax.eval_shape(lambda: _state(tx))
    p = jaxdev.memory.plan(shapes, step=step, batch=_batch())
    assert p.rules == rules and p.mesh is mesh24
    analysis = step.lower(shapes, _batch()).compile().memory_analysis()
    c = p.compiled
    assert c == CompiledMemory(
        analysis.argument_size_in_bytes,
        analysis.output_size_in_bytes,
        analysis.alias_size_in_bytes,
        analysis.temp_size_in_bytes,
        analysis.generated_code_size_in_bytes,
        xla_peak=getattr(analysis, "peak_memory_in_bytes", None) or None,  # XLA's own
    )
    # Arguments = state + batch per device: the plan agrees within 1%.
    assert abs(c.argument - p.total) <= 0.01 * p.total, (c.argument, p.total)
    assert p.peak == c.argument + c.output - c.alias + c.temp
    text = str(p)
    assert "compiled step (memory_analysis, per device): arguments" in text
    assert "peak per device ~" in text


def test_plan_rejects_a_mesh_or_rules_other_than_the_steps(mesh24):
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.sharded(mesh24, rules="fsdp"))
    state = _state(tx)
    assert jaxdev.memory.plan(state, mesh24, "fsdp", step=step).rules == "fsdp"
    with pytest.raises(UsageError, match=r"`mesh` \{'fsdp': 8\} is not the step's mesh"):
        jaxdev.memory.plan(state, jaxdev.make_mesh({"fsdp": 8}), step=step)
    with pytest.raises(UsageError, match=r"`rules`=\[\('kernel'.* differ from the step's"):
        jaxdev.memory.plan(state, rules=[("kernel", P(None, "fsdp"))], step=step)
    with pytest.raises(UsageError, match="`step` must be a jaxdev step"):
        jaxdev.memory.plan(state, step=lambda s, b: s)


@pytest.mark.parametrize("with_step", [False, True])
def test_plan_refuses_an_unknown_option_and_with_a_step_one_other_than_the_steps(with_step):
    tx, mesh = optax.sgd(0.1), jaxdev.make_mesh({"fsdp": 8})
    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.sharded(mesh, rules="fsdp"))
    kw = {"step": step, "batch": _batch()} if with_step else {"mesh": mesh, "rules": "fsdp"}
    shapes = jax.eval_shape(lambda: _state(tx))
    with pytest.raises(UsageError, match=r"`min_sizee` is no option .* takes `min_size`, `fsdp_"):
        jaxdev.memory.plan(shapes, min_sizee=1, **kw)
    same = jaxdev.memory.plan(shapes, min_size=1024, **kw)  # the default: the step's own
    if with_step:  # the step replicates the 256-element bias: the rows may not split it
        with pytest.raises(UsageError, match=r"`min_size`=1 differs from the step's 1024"):
            jaxdev.memory.plan(shapes, min_size=1, **kw)
    else:
        assert jaxdev.memory.plan(shapes, min_size=1, **kw)["params"] < same["params"]


@pytest.mark.parametrize(
    "tree, batch, match",
    [
        ({"w": np.array(["a", "b"])}, None, r"`state_or_shapes` leaf \['w'\] is a numpy array of"),
        ({"w": jax.ShapeDtypeStruct((-1, 4), jnp.float32)}, None, r"leaf \['w'\] has the shape"),
        ("params", {"x": "abc"}, r"`batch` leaf \['x'\] is a builtins.str; expected an array"),
        ("params", {"x": object()}, r"`batch` leaf \['x'\] is a builtins.object"),
        ("params", "batch", r"`state_or_shapes` must be a train state .* got dict"),
    ],
)
def test_plan_names_the_argument_and_leaf_it_cannot_read(tree, batch, match):
    """Were raw ValueErrors (str and object leaves), -16 bytes (a negative dimension), and the
    lowering's AttributeError (params for a train step's state)."""
    tree = _params() if tree == "params" else tree  # made here: arrays made at import stay
    batch = _batch() if batch == "batch" else batch  # live, and the ledger tests count them
    step = jaxdev.make_train_step(_loss, optax.sgd(0.1), jaxdev.Strategy.sharded())
    kw = {"step": step} if isinstance(batch, dict) and "y" in batch else {}
    with pytest.raises(jaxdev.JaxdevError, match=match):
        jaxdev.memory.plan(tree, batch=batch, **kw)


@pytest.mark.parametrize("batch", [{}, [], ()])
def test_plan_with_a_step_names_an_empty_batch(batch):
    """Was the lowering's raw IndexError ('list index out of range'); ``batch=None`` plans
    the state alone."""
    step = jaxdev.make_train_step(_loss, optax.sgd(0.1), jaxdev.Strategy.sharded())
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), optax.sgd(0.1)))
    with pytest.raises(UsageError, match=r"`batch` is empty \(got .*\): pass the step's batch"):
        jaxdev.memory.plan(state, step=step, batch=batch)
    assert jaxdev.memory.plan(state, step=step)["params"] > 0


def test_a_single_device_step_holds_the_whole_batch():
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.single("cpu:2"))
    p = jaxdev.memory.plan(jax.eval_shape(lambda: _state(tx, 64)), step=step, batch=_batch(8, 64))
    assert list(p.by_device) == ["cpu:2"]
    assert p["batch"] == (8 * 64 + 8 * 16) * 4 and p.compiled is not None
    assert abs(p.compiled.argument - p.total) <= 0.01 * p.total


# ---------------------------------------------------------------- table, fits, errors


def test_plan_table_is_exact():
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    tx = optax.sgd(0.1, momentum=0.9)
    shapes = jax.eval_shape(lambda: jaxdev.TrainState.create({"w": jnp.ones((4096, 64))}, tx))
    p = jaxdev.memory.plan(
        shapes, mesh, "fsdp", batch=jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    )
    assert str(p) == "\n".join(
        [
            "memory plan: mesh(data=2, fsdp=4), rules='fsdp'",
            "category   bytes/device  total bytes  sharded",
            "---------  ------------  -----------  -------",
            "params     256.0 KiB     1.0 MiB      100.0%",
            "opt_state  256.0 KiB     1.0 MiB      100.0%",
            "batch      16.0 KiB      128.0 KiB    100.0%",
            "other      4 B           4 B          0.0%",
            "total      528.0 KiB     2.1 MiB      >99.9%",
        ]
    )
    assert repr(p) == (
        "MemoryPlan(total=540676, params=262144, opt_state=262144, batch=16384, other=4)"
    )
    assert repr(jaxdev.memory.plan({})) == "MemoryPlan(total=0)"  # was 'total=0, )'
    with pytest.raises(KeyError, match="'grads' is not a plan category"):
        p["grads"]


def test_fits_with_a_limit_and_without_one_on_cpu():
    p = jaxdev.memory.plan({"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)})
    assert p.fits(limit=4 * MiB) and p.fits(4 * MiB + 0.5) and not p.fits(limit=4 * MiB - 1)
    assert resolve_limit(None, jax.devices(), required=False) == (None, "no limit known")
    with pytest.raises(UsageError, match=r"reports no memory limit .* pass `limit=`"):
        p.fits()
    for bad in (-1, "16GB", True, float("nan"), float("inf"), [1], 0.5):
        with pytest.raises(UsageError, match="`limit` must be a number of bytes"):
            p.fits(limit=bad)


def test_check_fits_message_names_need_budget_and_the_fsdp_alternative(mesh24):
    shapes = jax.eval_shape(lambda: _state(width=4096))
    p = jaxdev.memory.plan(shapes, jaxdev.data_mesh())
    check_fits(p, limit=p.total)  # exactly enough
    with pytest.raises(MemoryPlanError) as err:
        check_fits(p, limit=2 * MiB)
    assert isinstance(err.value, MemoryError)
    fsdp = jaxdev.memory.plan(shapes, jaxdev.data_mesh(), "fsdp")
    msg = str(err.value)
    need, alt = f"{p.total / MiB:.1f} MiB", f"{fsdp.total / MiB:.1f} MiB"
    assert msg.startswith(f"needs {need} per device, 2.0 MiB available (limit); ")
    assert f"with rules='fsdp' over 8 devices: {alt}. Fix: shard the params" in msg
    # On data x fsdp, 'fsdp' shards over the fsdp axis (4 devices).
    with pytest.raises(MemoryPlanError, match="with rules='fsdp' over 4 devices: "):
        check_fits(jaxdev.memory.plan(shapes, mesh24), limit=MiB)
    # Already fsdp, or one device: no alternative offered.
    for q in (fsdp, jaxdev.memory.plan(shapes, jaxdev.data_mesh(1))):
        with pytest.raises(MemoryPlanError) as err:
            check_fits(q, limit=MiB)
        assert "with rules='fsdp'" not in str(err.value)
    assert "Fix: use more devices" in str(err.value)  # one device: nothing to shard over
    with pytest.raises(MemoryPlanError, match=r"MiB available \(limit\)\. Fix: use more devices"):
        check_fits(fsdp, limit=MiB)
    with pytest.raises(UsageError, match="pass `limit=`"):
        check_fits(p)


def test_check_fits_with_compiled_figures_explains_the_peak(mesh24):
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.sharded(mesh24))
    p = jaxdev.memory.plan(jax.eval_shape(lambda: _state(tx)), step=step, batch=_batch())
    with pytest.raises(MemoryPlanError) as err:
        check_fits(p, limit=1024)
    msg = str(err.value)
    assert f"needs {p.peak / MiB:.1f} MiB per device (compiled step: arguments " in msg
    assert "+ temporaries" in msg and "1.0 KiB available (limit)" in msg
    assert "before the step's temporaries" in msg and "over 4 devices" in msg
    assert math.isclose(
        p.peak, sum((p.compiled.argument, p.compiled.output, p.compiled.temp)) - p.compiled.alias
    )


def test_model_state_rng_and_step_rows(mesh24):
    tx = optax.sgd(0.1)
    state = jaxdev.TrainState.create(
        {"w": jnp.ones((4096, 4))},
        tx,
        rng=jax.random.key(0),  # a typed key: dtype key<fry>, 8 bytes
        model_state={"batch_stats": {"mean": jnp.zeros((8192,))}},
    )
    p = jaxdev.memory.plan(state, mesh24, "fsdp")
    # plain sgd has an empty optimizer state: no opt_state row, 0 bytes.
    assert [r.category for r in p.rows] == ["params", "model_state", "other"]
    assert p["params"] == 4096 * 4 * 4 // 4 and p["opt_state"] == 0
    assert p["model_state"] == 8192 * 4 // 4  # model state follows the same rules
    assert p["other"] == 4 + 8
    assert p == jaxdev.memory.plan(jax.eval_shape(lambda: state), mesh24, "fsdp")
    placed = jax.device_put(state, jaxdev.param_shardings(state, mesh24, "fsdp"))
    assert p.total == _max(jaxdev.placement(placed))


@pytest.mark.parametrize("kind", ["steps_per_call", "pmap"])
def test_grouped_and_pmap_batches_match_the_compiled_arguments(mesh24, kind):
    tx = optax.adam(1e-3)
    if kind == "pmap":  # the batch in pmap layout: (devices, rows per device, ...)
        step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.pmap())
        lead = (8, 4)
    else:  # steps_per_call=2: (steps, rows, ...), rows split behind the steps axis
        strategy = jaxdev.Strategy.sharded(mesh24, rules="fsdp")
        step = jaxdev.make_train_step(_loss, tx, strategy, steps_per_call=2)
        lead = (2, 32)
    batch = {
        "x": jax.ShapeDtypeStruct((*lead, 512), jnp.float32),
        "y": jax.ShapeDtypeStruct((*lead, 16), jnp.float32),
    }
    p = jaxdev.memory.plan(jax.eval_shape(lambda: _state(tx)), step=step, batch=batch)
    assert p["batch"] == math.prod(lead) * (512 + 16) * 4 // 8
    assert abs(p.compiled.argument - p.total) <= 0.01 * p.total, (p.compiled.argument, p.total)



@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.int2, jnp.float4_e2m1fn])
def test_sub_byte_dtypes_are_planned_packed_as_xla_stores_them(dtype):
    """XLA packs sub-byte elements (two int4 a byte, an odd count rounded up); the plan
    counted a byte each, as JAX's ``nbytes`` does."""
    mesh = jaxdev.make_mesh({"fsdp": 8})
    sizes = [(1024, 8), (4096,), (7,), (3, 5)]
    shapes = {str(s): jax.ShapeDtypeStruct(s, dtype) for s in sizes}
    p = jaxdev.memory.plan(shapes, mesh, "fsdp", min_size=0)
    shardings = jaxdev.param_shardings(shapes, mesh, "fsdp", min_size=0)
    compiled = jax.jit(lambda t: t, in_shardings=(shardings,)).lower(shapes).compile()
    assert p["params"] == compiled.memory_analysis().argument_size_in_bytes
    bits = jax.dtypes.itemsize_bits(dtype)
    assert p.rows[0].total_bytes == sum(-(-math.prod(s) * bits // 8) for s in sizes)


def test_a_plan_and_the_steps_memory_error_keep_shapes_never_the_arrays():
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(
        _loss, tx, jaxdev.Strategy.sharded(jaxdev.data_mesh()), memory_limit=MiB
    )
    params, state = _params(328), step.init_state(_params(328), tx)
    batch = step.put_batch({"x": jnp.ones((40, 328)), "y": jnp.ones((40, 16))})
    kept = jaxdev.memory.plan(params, batch=batch)
    try:
        step(state, batch)
    except MemoryPlanError as e:
        err = e.with_traceback(None)  # the frames' locals are Python's to keep, not the error's
    del params, state, batch
    gc.collect()
    assert not [x.shape for x in jax.live_arrays() if 328 in x.shape or 40 in x.shape]
    assert fsdp_alternative(kept).startswith("; with rules='fsdp' over 8 devices: ")  # from shapes
    assert err.explanation.plan.peak > MiB


@pytest.mark.parametrize("kind", ["sharded", "pmap", "single"])
@pytest.mark.parametrize("options", [{}, {"accumulate": 2}], ids=["plain", "accumulate2"])
def test_a_padded_batchs_mask_counts_as_the_step_takes_it(kind, options):
    """A padded batch's mask was counted split over the devices (a jit step takes it
    replicated: 4008 rows' bools on every device) and its `size`, no argument of the step,
    as 4 bytes; a raw uneven batch, which the step pads and masks, without its mask. The
    state and batch rows now add up to the compiled step's arguments exactly."""
    tx = optax.sgd(0.1)
    strategy = getattr(jaxdev.Strategy, kind)()
    step = jaxdev.make_train_step(lambda p, b: jnp.sum(b @ p["w"], -1), tx, strategy, **options)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create({"w": jnp.zeros((16, 4))}, tx))
    rows = np.ones((4001, 16), np.float32)
    batches = [step.put_batch(rows)] + ([rows] if kind != "pmap" and not options else [])
    for batch in batches:
        p = jaxdev.memory.plan(state, step=step, batch=batch)
        assert p.total == p.compiled.argument, (p, type(batch))
    padded = jaxdev.shard_batch(rows, pad=True)  # no step: as shard_batch lays it out
    assert jaxdev.memory.plan({"w": jnp.zeros(4)}, batch=padded)["batch"] == 501 * 64 + 501
