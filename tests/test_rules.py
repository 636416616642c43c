"""Tests of make_mesh and rules -> shardings (param_shardings, shard_params, state_shardings)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import DeletedArrayError, LeafTypeError, LeafValueError, ShardingError
from jaxdev._rules import follow_params, unbox


def sds(*shape, dtype="float32"):
    return jax.ShapeDtypeStruct(shape, dtype)


def specs(tree):
    return jax.tree.map(lambda s: s.spec, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def mlp_params():
    return {
        "params": {
            "Dense_0": {"kernel": jnp.ones((784, 256)), "bias": jnp.ones(256)},
            "Dense_1": {"kernel": jnp.ones((256, 10)), "bias": jnp.ones(10)},
        }
    }


# ---------------------------------------------------------------- make_mesh


def test_make_mesh_dict_and_pairs_are_the_same_cached_mesh(devices):
    a = jaxdev.make_mesh({"data": 2, "model": 4})
    b = jaxdev.make_mesh([("data", 2), ("model", 4)])
    assert a is b
    assert dict(a.shape) == {"data": 2, "model": 4}
    assert a.axis_types == (AxisType.Auto, AxisType.Auto)
    assert list(a.devices.flat) == devices  # CPU: the order given


def test_make_mesh_minus_one_fills_the_rest(devices):
    assert dict(jaxdev.make_mesh({"data": -1, "fsdp": 2}).shape) == {"data": 4, "fsdp": 2}
    assert dict(jaxdev.make_mesh({"a": 2, "b": -1, "c": 2}).shape) == {"a": 2, "b": 2, "c": 2}


def test_make_mesh_devices_and_axis_types(devices):
    m = jaxdev.make_mesh({"x": 2, "y": 2}, devices=4, axis_type="explicit")
    assert list(m.devices.flat) == devices[:4]
    assert m.axis_types == (AxisType.Explicit,) * 2
    m = jaxdev.make_mesh({"x": 2, "y": 1}, devices=[devices[3], devices[5]])
    assert list(m.devices.flat) == [devices[3], devices[5]]
    m = jaxdev.make_mesh({"x": 2, "y": 4}, axis_type=("auto", AxisType.Explicit))
    assert m.axis_types == (AxisType.Auto, AxisType.Explicit)
    one = jaxdev.make_mesh({"data": 8})
    assert one is jaxdev.data_mesh()  # the 1-D case shares data_mesh's cache


def test_make_mesh_size_mismatch_names_sizes_and_devices(devices):
    with pytest.raises(ShardingError) as e:
        jaxdev.make_mesh({"data": 3, "model": 2})
    msg = str(e.value)
    assert "data=3, model=2" in msg and "multiply to 6" in msg and "8 were given" in msg
    assert "cpu:0" in msg and "cpu:7" in msg and "devices=6" in msg
    with pytest.raises(ShardingError, match="multiply to 16 devices but 8"):
        jaxdev.make_mesh({"data": 4, "model": 4})
    with pytest.raises(ShardingError, match=r"fixed sizes multiply to 3, which does not divide 8"):
        jaxdev.make_mesh({"data": 3, "model": -1})


@pytest.mark.parametrize(
    "axes, match",
    [
        ("data", "must be a dict"),
        ([], "no axes"),
        ({}, "no axes"),
        ([("a", 2, 1)], "must be a dict"),
        ({"a": 0, "b": 8}, "axis 'a' has size 0"),
        ({"a": True}, "axis 'a' has size True"),
        ({"a": 2.0, "b": 4}, "axis 'a' has size 2.0"),
        ({"a": -1, "b": -1}, "only one size may be -1"),
        ([("a", 2), ("a", 4)], r"\['a'\] appear twice"),
        ({"": 8}, "non-empty strings"),
        ([(1, 8)], "non-empty strings"),
    ],
)
def test_make_mesh_bad_axes(axes, match):
    with pytest.raises(ShardingError, match=match):
        jaxdev.make_mesh(axes)


def test_make_mesh_bad_axis_type():
    with pytest.raises(ShardingError, match="`axis_type` must be"):
        jaxdev.make_mesh({"a": 8}, axis_type="manual")
    with pytest.raises(ShardingError, match="`axis_type` must be .* got 3"):
        jaxdev.make_mesh({"a": 8}, axis_type=3)  # was a bare TypeError (not iterable)
    with pytest.raises(ShardingError, match="lists 3 types for 2 axes"):
        jaxdev.make_mesh({"a": 2, "b": 4}, axis_type=("auto",) * 3)


# ---------------------------------------------------------------- replicate / fsdp


def test_replicate_gives_p_everywhere(dm):
    s = jaxdev.param_shardings(mlp_params(), dm)
    assert all(x.spec == P() and x.mesh is dm for x in jax.tree.leaves(s))
    assert jax.tree.structure(s) == jax.tree.structure(mlp_params())


def test_fsdp_largest_divisible_dim_ties_last_tiny_and_uneven(fsdp8):
    tree = {
        "tall": sds(4096, 16),  # both divisible: largest (dim 0)
        "wide": sds(16, 4096),
        "tie": sds(64, 64),  # tie -> last
        "three": sds(8, 3, 64),  # 8 and 64 divisible, 3 not: 64
        "uneven": sds(1001, 1003),  # nothing divisible by 8 -> replicated
        "one_div": sds(1001, 24),  # only dim 1 divisible even though smaller
        "tiny": sds(8, 8),  # 64 < 1024 elements
        "edge": sds(1024),  # exactly min_size: sharded
        "scalar": sds(),
        "vector": sds(4096),
    }
    got = specs(jaxdev.param_shardings(tree, fsdp8, "fsdp"))
    assert got == {
        "tall": P("fsdp", None),
        "wide": P(None, "fsdp"),
        "tie": P(None, "fsdp"),
        "three": P(None, None, "fsdp"),
        "uneven": P(),
        "one_div": P(None, "fsdp"),
        "tiny": P(),
        "edge": P("fsdp"),
        "scalar": P(),
        "vector": P("fsdp"),
    }


def test_fsdp_min_size_option(fsdp8):
    tree = {"a": sds(8, 8), "b": sds(8, 16)}
    assert specs(jaxdev.param_shardings(tree, fsdp8, "fsdp", min_size=0)) == {
        "a": P(None, "fsdp"),
        "b": P(None, "fsdp"),
    }
    assert specs(jaxdev.param_shardings(tree, fsdp8, "fsdp", min_size=100)) == {
        "a": P(),
        "b": P(None, "fsdp"),
    }
    for bad in (-1, 1.5, True, "big"):
        with pytest.raises(ShardingError, match="`min_size` must be an int >= 0"):
            jaxdev.param_shardings(tree, fsdp8, "fsdp", min_size=bad)


def test_fsdp_axis_choice(df, dm):
    tree = {"w": sds(1024, 12)}
    # a data x fsdp mesh: params shard over fsdp only (size 4 divides 12 and 1024: largest)
    assert specs(jaxdev.param_shardings(tree, df, "fsdp")) == {"w": P("fsdp", None)}
    # 1-D mesh over "data": ZeRO-3 style over its only axis
    assert specs(jaxdev.param_shardings(tree, jaxdev.data_mesh(), "fsdp")) == {"w": P("data", None)}
    # explicit axis, and a tuple of axes (size 8 does not divide 12)
    assert specs(jaxdev.param_shardings(tree, dm, "fsdp", fsdp_axis="model")) == {
        "w": P("model", None)
    }
    got = specs(
        jaxdev.param_shardings({"w": sds(12, 1024)}, df, "fsdp", fsdp_axis=("data", "fsdp"))
    )
    assert got == {"w": P(None, ("data", "fsdp"))}
    # no 'fsdp' axis: the batch axes (data x model -> 'data'), as Strategy.sharded splits rows
    assert specs(jaxdev.param_shardings(tree, dm, "fsdp")) == {"w": P("data", None)}
    only_model = jaxdev.make_mesh({"model": 2, "tensor": 4})
    with pytest.raises(
        ShardingError, match="every axis of the mesh .* is a model axis.*`fsdp_axis=`"
    ):
        jaxdev.param_shardings(tree, only_model, "fsdp")
    with pytest.raises(ShardingError, match=r"`fsdp_axis`='x' is not an axis.*data=2 x model=4"):
        jaxdev.param_shardings(tree, dm, "fsdp", fsdp_axis="x")


# ---------------------------------------------------------------- regex


def test_regex_rules_first_match_wins_pad_and_default(dm):
    rules = [
        (r"Dense_0/kernel$", P(None, "model")),
        (re.compile(r"kernel"), ("model",)),  # tuples and compiled patterns are accepted
        (r"bias", None),
    ]
    got = specs(jaxdev.param_shardings(mlp_params(), dm, rules))
    assert got == {
        "params": {
            "Dense_0": {"kernel": P(None, "model"), "bias": P()},
            "Dense_1": {"kernel": P("model", None), "bias": P()},  # padded with None
        }
    }
    # rules of which no pattern matches any param: an error, not a silent full replication
    for rules in ([("nothing_matches", P("model"))], []):
        with pytest.raises(ShardingError, match="no pattern of `rules` matches any leaf") as e:
            jaxdev.param_shardings(mlp_params(), dm, rules)
        assert "'params/Dense_0/bias'" in str(e.value)
    with pytest.raises(ShardingError, match="no pattern of `rules` matches any leaf of `params`"):
        jaxdev.param_shardings(jaxdev.TrainState.create(mlp_params(), optax.sgd(0.1)), dm, [])
    # a train state whose model_state no pattern matches is fine (rules are for the params)
    state = jaxdev.TrainState.create(
        mlp_params(), optax.sgd(0.1), model_state={"batch_stats": {"mean": jnp.zeros(8)}}
    )
    got = jaxdev.param_shardings(state, dm, [("Dense_0/kernel", P(None, "model"))])
    assert got.model_state["batch_stats"]["mean"].spec == P()


def test_regex_paths_of_sequences_attributes_and_nnx(dm):
    tree = {"layers": [{"w": sds(8, 8)}, {"w": sds(8, 8)}]}
    got = specs(jaxdev.param_shardings(tree, dm, [("^layers/1/w$", P("model"))]))
    assert got == {"layers": [{"w": P()}, {"w": P("model", None)}]}
    with jax.set_mesh(dm):
        model = nnx.Sequential(
            nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 8, rngs=nnx.Rngs(1))
        )
    state = nnx.state(model, nnx.Param)
    got = jaxdev.param_shardings(state, dm, [("^layers/1/kernel$", P("model"))])
    assert got["layers"][1]["kernel"].get_value().spec == P("model", None)
    assert got["layers"][0]["kernel"].get_value().spec == P()


def test_regex_rule_errors(dm):
    with pytest.raises(ShardingError, match=r"pattern '\(' is not a valid regular expression"):
        jaxdev.param_shardings(mlp_params(), dm, [("(", P())])
    with pytest.raises(ShardingError, match="maps to 'model', which is not a PartitionSpec"):
        jaxdev.param_shardings(mlp_params(), dm, [("kernel", "model")])


# ---------------------------------------------------------------- spec errors


def test_indivisible_error_names_path_shape_spec_mesh(dm):
    with pytest.raises(ShardingError) as e:
        jaxdev.param_shardings(mlp_params(), dm, [("Dense_1/kernel", P(None, "model"))])
    msg = str(e.value)
    assert "P(None, 'model')" in msg
    assert "['params']['Dense_1']['kernel'] of shape (256, 10)" in msg
    assert "dimension 1 (10) is not divisible by mesh axis 'model' of size 4" in msg
    assert "mesh data=2 x model=4" in msg
    assert "'Dense_1/kernel'" in msg and "params/Dense_1/kernel" in msg  # which rule matched
    with pytest.raises(ShardingError, match=r"mesh axes \('data', 'model'\) of total size 8"):
        jaxdev.param_shardings({"w": sds(12)}, dm, [("w", P(("data", "model")))])


def test_missing_axis_too_long_and_reused_axis(dm):
    with pytest.raises(ShardingError) as e:
        jaxdev.param_shardings({"w": sds(8, 8)}, dm, [("w", P("fsdp"))])
    assert "mesh axis 'fsdp' does not exist; the mesh has axes ('data', 'model')" in str(e.value)
    assert "['w'] of shape (8, 8)" in str(e.value)
    with pytest.raises(ShardingError, match=r"has 3 entries but the leaf has 2 dimension"):
        jaxdev.param_shardings({"w": sds(8, 8)}, dm, [("w", P(None, None, "model"))])
    with pytest.raises(ShardingError, match=r"has 1 entries but the leaf has 0 dimension"):
        jaxdev.param_shardings({"w": 3.0}, dm, [("w", P("model"))])
    with pytest.raises(ShardingError, match="'model' is used for two dimensions"):
        jaxdev.param_shardings({"w": sds(8, 8)}, dm, [("w", P("model", "model"))])


@pytest.mark.parametrize("rules", ["fdsp", "FSDP", 3, None, object(), {"params": "model"}])
def test_unknown_rules_list_the_accepted_forms(dm, rules):
    with pytest.raises(ShardingError) as e:
        jaxdev.param_shardings(mlp_params(), dm, rules)
    msg = str(e.value)
    assert "'replicate', 'fsdp', 'flax'" in msg and "(regex, PartitionSpec)" in msg


def test_non_array_leaves_raise_leaf_type_error(dm):
    with pytest.raises(LeafTypeError, match=r"`tree` leaf \['a'\]\['name'\]: a builtins.str"):
        jaxdev.param_shardings({"a": {"name": "relu", "w": sds(2)}}, dm)
    with pytest.raises(LeafTypeError, match="builtins.object"):
        jaxdev.param_shardings([object()], dm)


def test_bad_mesh_is_rejected():
    with pytest.raises(ShardingError, match="`mesh` must be a jax.sharding.Mesh"):
        jaxdev.param_shardings({"w": sds(2)}, "mesh")


def test_none_leaves_and_empty_trees(dm):
    s = jaxdev.param_shardings({"a": None, "b": sds(4)}, dm, "fsdp", fsdp_axis="model", min_size=0)
    assert s["a"] is None and s["b"].spec == P("model")
    assert jaxdev.param_shardings({}, dm) == {}


# ---------------------------------------------------------------- explicit layout


def test_layout_trees_full_prefix_and_named_shardings(dm):
    params = {"a": {"w": sds(8, 4), "b": sds(4)}, "c": np.ones(4, np.float32)}
    got = specs(jaxdev.param_shardings(params, dm, {"a": P("model"), "c": None}))
    assert got == {"a": {"w": P("model", None), "b": P("model")}, "c": P()}
    full = {"a": {"w": NamedSharding(dm, P(None, "model")), "b": P()}, "c": P("data")}
    assert specs(jaxdev.param_shardings(params, dm, full)) == {
        "a": {"w": P(None, "model"), "b": P()},
        "c": P("data"),
    }
    assert all(s == P() for s in jax.tree.leaves(specs(jaxdev.param_shardings(params, dm, P()))))


def test_layout_errors(dm, fsdp8):
    params = {"a": sds(8), "c": sds(4)}
    with pytest.raises(ShardingError, match="not the params' structure"):
        jaxdev.param_shardings(params, dm, {"a": P()})
    with pytest.raises(ShardingError, match="NamedSharding on another mesh"):
        jaxdev.param_shardings(params, dm, {"a": NamedSharding(fsdp8, P()), "c": P()})
    with pytest.raises(ShardingError, match=r"the `rules` layout put P\(\('data', 'model'\),\) on"):
        jaxdev.param_shardings({"a": sds(4)}, dm, {"a": P(("data", "model"))})


# ---------------------------------------------------------------- flax metadata


class BoxedMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        x = nn.Dense(32, kernel_init=nn.with_partitioning(init, ("model", None)))(x)
        return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)


@pytest.fixture(scope="module")
def boxed_shapes():
    return jax.eval_shape(BoxedMLP().init, jax.random.key(0), jnp.ones((1, 16)))


def test_flax_linen_partitioned_and_logical(dm, boxed_shapes):
    rules = [("embed", None), ("mlp", "model")]
    got = specs(jaxdev.param_shardings(boxed_shapes, dm, "flax", logical_axis_rules=rules))
    assert got == {
        "params": {
            "Dense_0": {"kernel": P(None, "model"), "bias": P()},
            "Dense_1": {"kernel": P("model", None), "bias": P()},
            "Dense_2": {"kernel": P(None, "model"), "bias": P()},
        }
    }
    # unboxed structure: what the step trains
    assert jax.tree.structure(got) == jax.tree.structure(unbox(boxed_shapes))
    # flax's context manager works too
    with nn.logical_axis_rules(rules):
        assert specs(jaxdev.param_shardings(boxed_shapes, dm, "flax")) == got


def test_flax_logical_without_rules_and_unknown_axis(dm, boxed_shapes):
    with pytest.raises(ShardingError) as e:
        jaxdev.param_shardings(boxed_shapes, dm, "flax")
    msg = str(e.value)
    assert "['params']['Dense_2']['kernel'] of shape (32, 8)" in msg
    assert "logical names ('embed', 'mlp')" in msg and "logical_axis_rules=" in msg
    with pytest.raises(ShardingError, match="mesh axis 'model' does not exist"):
        jaxdev.param_shardings(
            boxed_shapes,
            jaxdev.make_mesh({"fsdp": 8}),
            "flax",
            logical_axis_rules=[("mlp", "fsdp")],
        )


def test_other_rules_on_boxed_trees_ignore_annotations(dm, boxed_shapes):
    got = specs(jaxdev.param_shardings(boxed_shapes, dm, "fsdp", fsdp_axis="model", min_size=0))
    assert got["params"]["Dense_0"]["kernel"] == P(None, "model")  # 16 x 64: largest
    assert got["params"]["Dense_2"]["kernel"] == P("model", None)  # 32 x 8: largest


class AnnotatedNNX(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16, 64, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.down = nnx.Linear(
            64, 16, kernel_init=nnx.with_partitioning(init, ("hidden", None)), rngs=rngs
        )
        self.norm = nnx.BatchNorm(16, rngs=rngs)


def test_flax_nnx_out_sharding_metadata(dm):
    with jax.set_mesh(dm), nn.logical_axis_rules([("hidden", "model")]):
        abstract = nnx.eval_shape(lambda: AnnotatedNNX(nnx.Rngs(0)))
    state = nnx.state(abstract)
    got = jaxdev.param_shardings(state, dm, "flax", logical_axis_rules=[("hidden", "model")])
    assert isinstance(got, nnx.State)
    assert got["up"]["kernel"].get_value().spec == P(None, "model")
    assert got["down"]["kernel"].get_value().spec == P("model", None)
    assert got["norm"]["mean"].get_value().spec == P()
    assert jax.tree.structure(got) == jax.tree.structure(state)
    with nn.logical_axis_rules([("hidden", "model")]):  # what flax itself reads
        flax_specs = nnx.get_partition_spec(state)
    assert jax.tree.leaves(jax.tree.map(lambda s: s.spec, got)) == jax.tree.leaves(flax_specs)
    # without the logical rule, 'hidden' is not a mesh axis: a clear error naming the leaf
    with pytest.raises(ShardingError) as e:
        jaxdev.param_shardings(state, dm, "flax")
    assert "NNX out_sharding ('hidden', None)" in str(e.value)
    assert "['down']['kernel'] of shape (64, 16)" in str(e.value)
    assert "mesh axis 'hidden' does not exist" in str(e.value)


@pytest.mark.parametrize("field", ["unreduced", "reduced"])
def test_flax_nnx_out_sharding_a_sharding_with_reduced_axes_is_kept(field):
    """An NNX out_sharding that is a NamedSharding was rebuilt ``P(*spec)``: JAX's raw
    ValueError for a spec with unreduced/reduced axes; now kept as given."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    spec = P("model", **{field: {"data"}})
    make = lambda: nnx.Param(jnp.ones((8,)), out_sharding=NamedSharding(mesh, spec))  # noqa: E731
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: nnx.Dict(w=make())))
    assert jaxdev.param_shardings(state, mesh, "flax")["w"].get_value().spec == spec


# ---------------------------------------------------------------- shard_params


def test_shard_params_places_and_keeps_placed_objects(fsdp8):
    params = {"w": jnp.ones((4096, 8)), "b": np.ones(8, np.float32), "s": 2.0}
    placed = jaxdev.shard_params(params, fsdp8, "fsdp")
    assert placed["w"].sharding.spec == P("fsdp", None)
    assert placed["b"].sharding == NamedSharding(fsdp8, P())
    assert placed["s"].sharding.is_fully_replicated
    assert jaxdev.shard_params(placed, fsdp8, "fsdp") is placed
    # one leaf moved: the others are the same objects
    mixed = dict(placed, w=jnp.ones((4096, 8)))
    again = jaxdev.shard_params(mixed, fsdp8, "fsdp")
    assert again["b"] is placed["b"] and again["s"] is placed["s"]
    assert again["w"] is not mixed["w"] and again["w"].sharding.spec == P("fsdp", None)
    np.testing.assert_array_equal(np.asarray(again["w"]), np.ones((4096, 8)))


def test_shard_params_moves_equivalent_layouts_onto_the_asked_mesh(df, dm):
    # data=2 x fsdp=4 and data=2 x model=4 lay P(None, 'fsdp') and P(None, 'model') out alike;
    # the result must still live on the mesh asked for (one step never sees two meshes)
    on_df = jaxdev.shard_params({"w": jnp.ones((8, 1024))}, df, "fsdp")
    on_dm = jaxdev.shard_params(on_df, dm, [("w", P(None, "model"))])
    assert on_dm["w"].sharding == NamedSharding(dm, P(None, "model"))
    np.testing.assert_array_equal(np.asarray(on_dm["w"]), np.ones((8, 1024)))


def test_shard_params_unboxes_linen(dm):
    variables = BoxedMLP().init(jax.random.key(0), jnp.ones((1, 16)))
    placed = jaxdev.shard_params(
        variables, dm, "flax", logical_axis_rules=[("embed", None), ("mlp", "model")]
    )
    kernel = placed["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, jax.Array) and kernel.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(
        np.asarray(kernel), np.asarray(variables["params"]["Dense_0"]["kernel"].value)
    )


def test_shard_params_inside_jit_constrains(fsdp8):
    @jax.jit
    def f(p):
        return jaxdev.shard_params(p, fsdp8, "fsdp")

    out = f({"w": jnp.ones((2048, 4))})
    assert out["w"].sharding.is_equivalent_to(NamedSharding(fsdp8, P("fsdp", None)), 2)


def test_shard_params_bad_leaves(fsdp8):
    with pytest.raises(LeafTypeError, match=r"leaf \['w'\] is a ShapeDtypeStruct"):
        jaxdev.shard_params({"w": sds(8)}, fsdp8)
    with pytest.raises(LeafValueError, match=r"leaf \['big'\].*do not fit int32"):
        jaxdev.shard_params({"big": np.array([2**40], np.int64)}, fsdp8)
    x = jnp.ones(8) + 1
    x.delete()
    with pytest.raises(DeletedArrayError, match=r"\['x'\]"):
        jaxdev.shard_params({"x": x}, fsdp8)


# ---------------------------------------------------------------- optimizer state follows params


OPTIMIZERS = {
    "adam": lambda p: optax.adam(1e-3),
    "sgd_momentum": lambda p: optax.sgd(0.1, momentum=0.9),
    "chain_clip_adamw": lambda p: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "masked": lambda p: optax.masked(optax.adam(1e-3), jax.tree.map(lambda x: x.ndim > 1, p)),
    "inject": lambda p: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "multi_transform": lambda p: optax.multi_transform(
        {"a": optax.adam(1e-3), "b": optax.sgd(0.1)},
        jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", p),
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_shardings_optimizer_follows_params(df, name):
    params = mlp_params()
    tx = OPTIMIZERS[name](params)
    state = jaxdev.TrainState.create(params, tx, rng=jax.random.key(0))
    s = jaxdev.param_shardings(state, df, "fsdp")
    assert type(s) is jaxdev.TrainState
    assert s.step.spec == P() and s.rng.spec == P() and s.model_state is None
    want = s.params["params"]["Dense_0"]["kernel"]
    assert want.spec == P("fsdp", None)
    # every opt_state leaf shaped like that kernel is sharded like it; every other one replicated
    kernel_shape = (784, 256)
    for leaf, sh in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(s.opt_state)):
        if leaf.shape == kernel_shape:
            assert sh == want
        elif leaf.ndim == 0:
            assert sh.spec == P()
    sharded = [sh for sh in jax.tree.leaves(s.opt_state) if sh.spec != P()]
    assert sharded, "no optimizer leaf followed the params"
    # the shardings fit tx.init's output: init straight into them
    opt = jax.jit(tx.init, out_shardings=s.opt_state)(params)
    for leaf, sh in zip(jax.tree.leaves(opt), jax.tree.leaves(s.opt_state)):
        assert leaf.sharding == sh


def test_state_shardings_of_shapes_and_model_state(df):
    params = {"w": sds(1024, 8), "b": sds(8)}
    tx = optax.adam(1e-3)
    shapes = jax.eval_shape(
        lambda p: jaxdev.TrainState.create(p, tx, model_state={"stats": jnp.zeros((2048,))}),
        params,
    )
    s = jaxdev.param_shardings(shapes, df, "fsdp")
    assert s.params["w"].spec == P("fsdp", None) and s.params["b"].spec == P()
    assert s.opt_state[0].mu["w"].spec == P("fsdp", None)
    assert s.opt_state[0].nu["b"].spec == P()
    assert s.model_state["stats"].spec == P("fsdp")
    # a layout describes params only: model_state replicated
    s = jaxdev.param_shardings(shapes, df, {"w": P(None, "fsdp"), "b": P()})
    assert s.params["w"].spec == P(None, "fsdp") and s.opt_state[0].mu["w"].spec == P(None, "fsdp")
    assert s.model_state["stats"].spec == P()


def test_state_shardings_nnx_train_state(dm):
    with jax.set_mesh(dm), nn.logical_axis_rules([("hidden", "model")]):
        model = AnnotatedNNX(nnx.Rngs(0))
    params, rest = jaxdev.nnx.split(model)
    state = jaxdev.TrainState.create(params, optax.adam(1e-3), model_state=rest)
    s = jaxdev.param_shardings(state, dm, "flax", logical_axis_rules=[("hidden", "model")])
    assert s.params["up"]["kernel"].get_value().spec == P(None, "model")
    assert s.opt_state[0].mu["down"]["kernel"].get_value().spec == P("model", None)
    assert s.model_state["norm"]["mean"].get_value().spec == P()
    opt = jax.jit(optax.adam(1e-3).init, out_shardings=s.opt_state)(params)
    assert opt[0].nu["up"]["kernel"][...].sharding.spec == P(None, "model")


def test_state_shardings_flax_train_state(df):
    from flax.training import train_state

    params = {"w": jnp.ones((1024, 8)), "b": jnp.ones(8)}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    s = jaxdev.param_shardings(state, df, "fsdp")
    assert s.params["w"].spec == P("fsdp", None) and s.step.spec == P()
    assert s.opt_state[0].mu["w"].spec == P("fsdp", None) and s.opt_state[0].count.spec == P()
    placed = jax.device_put(state, s)
    assert placed.opt_state[0].nu["w"].sharding.spec == P("fsdp", None)


def test_state_shardings_of_any_other_tree_is_param_shardings(fsdp8):
    tree = {"w": sds(4096), "count": sds()}
    assert specs(jaxdev.param_shardings(tree, fsdp8, "fsdp")) == {"w": P("fsdp"), "count": P()}


def test_follow_params_no_false_matches(fsdp8):
    params = {"w": jnp.ones((2048, 2))}
    shardings = jaxdev.param_shardings(params, fsdp8, "fsdp")
    # same structure, different shape: replicated; a lone params-shaped leaf elsewhere too
    opt = {
        "a": {"w": jnp.ones((2048, 3))},
        "b": jnp.ones((2048, 2)),
        "c": {"w": jnp.ones((2048, 2))},
    }
    got = specs(follow_params(opt, params, shardings, fsdp8))
    assert got == {"a": {"w": P()}, "b": P(), "c": {"w": P("fsdp", None)}}
    # a single-leaf params tree matches leaves of its shape
    one = jnp.ones((2048,))
    got = specs(
        follow_params((jnp.zeros(()), one), one, jaxdev.param_shardings(one, fsdp8, "fsdp"), fsdp8)
    )
    assert got == (P(), P("fsdp"))
    # empty params: everything replicated
    assert specs(follow_params({"c": jnp.zeros(())}, {}, {}, fsdp8)) == {"c": P()}


def test_nnx_module_itself_is_a_tree(fsdp8):
    model = nnx.Linear(2048, 8, rngs=nnx.Rngs(0))
    s = jaxdev.param_shardings(model, fsdp8, "fsdp")
    assert s.kernel.get_value().spec == P("fsdp", None)
    placed = jaxdev.shard_params(model, fsdp8, "fsdp")
    assert isinstance(placed, nnx.Linear)
    assert placed.kernel[...].sharding.spec == P("fsdp", None)
    np.testing.assert_array_equal(np.asarray(placed.kernel[...]), np.asarray(model.kernel[...]))


def test_fsdp_that_would_shard_nothing_is_named_or_falls_back_to_the_batch_axes():
    lm1b = jaxdev.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})  # lm1b's data x tensor config
    big = {"w": sds(4096, 64), "b": sds(64)}
    got = specs(jaxdev.param_shardings(big, lm1b, "fsdp"))  # was: all P(), the whole model
    assert got == {"w": P(("data", "fsdp"), None), "b": P()}
    with pytest.raises(jaxdev.ShardingError, match="`fsdp_axis`='fsdp' has size 1"):
        jaxdev.Strategy.sharded(lm1b, rules="fsdp", fsdp_axis="fsdp")
    with pytest.raises(jaxdev.ShardingError, match="shards no leaf.*'w', has shape \\(8, 4\\)"):
        jaxdev.param_shardings({"w": sds(8, 4), "b": sds(4)}, lm1b, "fsdp")  # all < min_size
    small = jaxdev.param_shardings({"w": sds(8, 4)}, lm1b, "fsdp", min_size=0)
    assert small["w"].spec == P(("data", "fsdp"), None)


# ---------------------------------------------------------------- indivisible dimensions


@pytest.mark.filterwarnings("ignore:'.value' access is now deprecated:DeprecationWarning")  # flax's SGD
def test_flax_fsdp_toy_example_trains_with_indivisible_replicate_as_flax_does(caplog):
    """flax's nnx_toy_examples/10_fsdp_and_optimizer.py as written (tests/flax_nnx_fsdp_toy.py):
    w2 (32, 1) has out_sharding (None, 'model') on a 4-way 'model' axis; flax drops it under
    jit. Plain SGD (its SGD with decay=0) against jaxdev's rules='flax', indivisible='replicate'."""
    import flax_nnx_fsdp_toy as toy

    lr, steps = 0.01, 5

    @nnx.jit
    def create_plain_sgd():  # create_model, with flax's SGD at decay=0.0: plain SGD
        model = toy.MLP(1, 32, 1, rngs=nnx.Rngs(0))
        return model, toy.SGD(nnx.variables(model, nnx.Param), lr, decay=0.0)

    rng = np.random.default_rng(0)
    xs = np.linspace(-2, 2, 100, dtype=np.float32)[:, None]
    ys = (0.8 * xs**2 + 0.1 + rng.normal(0, 0.1, size=xs.shape)).astype(np.float32)
    batches = [(xs[i], ys[i]) for i in (rng.choice(len(xs), size=32) for _ in range(steps))]

    with jax.set_mesh(toy.mesh):  # flax's own loop, as the example writes it
        model, optimizer = create_plain_sgd()
        assert model.w2[...].sharding.spec == P()  # flax dropped (None, 'model') on (32, 1)
        init = nnx.split(model, nnx.Param)[1]
        init = jax.tree.map(np.asarray, init)  # host copy of the same initial values
        for x, y in batches:
            x, y = jax.device_put((x, y), toy.named_sharding("data"))
            toy.train_step(model, optimizer, x, y)

    with jax.set_mesh(toy.mesh):
        graphdef, params = nnx.split(create_plain_sgd()[0], nnx.Param)

    def loss_fn(params, batch):
        y_pred = nnx.merge(graphdef, params)(batch["x"])
        return ((batch["y"] - y_pred) ** 2)[:, 0]

    tx = optax.sgd(lr)
    refused = jaxdev.Strategy.sharded(toy.mesh, rules="flax")
    with pytest.raises(ShardingError, match=r"\['w2'\].*indivisible='replicate'"):
        jaxdev.make_train_step(loss_fn, tx, refused).init_state(params, tx)
    strategy = jaxdev.Strategy.sharded(toy.mesh, rules="flax", indivisible="replicate")
    step = jaxdev.make_train_step(loss_fn, tx, strategy)
    with caplog.at_level("WARNING", logger="jaxdev"):
        state = step.init_state(params, tx)
        for x, y in batches:
            state, _ = step(state, step.put_batch({"x": x, "y": y}))
    told = [r.getMessage() for r in caplog.records if "['w2']" in r.getMessage()]
    assert len(told) == 1, told  # once per leaf
    for part in ("shape (32, 1)", "dimension 1 (1)", "axis 'model' of size 4", "replicated"):
        assert part in told[0], told[0]
    assert not any("['w1']" in r.getMessage() for r in caplog.records)
    got = state.params
    assert got["w2"][...].sharding.spec == P() and got["w1"][...].sharding.spec == P(None, "model")
    assert got["b1"][...].sharding.spec == P("model")
    want = nnx.split(model, nnx.Param)[1]
    for k in ("w1", "b1", "w2"):
        assert not np.allclose(np.asarray(want[k][...]), init[k][...])  # they trained
        np.testing.assert_allclose(
            np.asarray(got[k][...]), np.asarray(want[k][...]), rtol=1e-5, atol=1e-6
        )


def test_indivisible_replicate_drops_only_the_dimension_its_axis_does_not_divide():
    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    shapes = {"a": sds(6, 8), "b": sds(8, 6), "c": sds(32, 1)}
    rules = [("a|b", P("data", "model")), ("c", P(None, "model"))]
    with pytest.raises(ShardingError, match=r"\['b'\].*dimension 1 \(6\).*indivisible="):
        jaxdev.param_shardings(shapes, mesh, rules)
    got = specs(jaxdev.param_shardings(shapes, mesh, rules, indivisible="replicate"))
    assert got == {"a": P("data", "model"), "b": P("data", None), "c": P()}
    with pytest.raises(ShardingError, match="`indivisible` must be 'error' or 'replicate'"):
        jaxdev.param_shardings(shapes, mesh, rules, indivisible="pad")
    with pytest.raises(ShardingError, match="`indivisible` must be 'error' or 'replicate'"):
        jaxdev.Strategy.sharded(mesh, rules=rules, indivisible="pad")


def test_indivisible_is_checked_by_name_at_every_door_and_plans_as_it_places():
    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    params = {"k": jnp.ones((16, 8)), "v": jnp.ones((8, 3))}
    rules = [("k|v", P(None, "model"))]
    doors = {
        "param_shardings": lambda how: jaxdev.param_shardings(params, mesh, rules, indivisible=how),
        "shard_params": lambda how: jaxdev.shard_params(params, mesh, rules, indivisible=how),
        "Strategy.sharded": lambda how: jaxdev.Strategy.sharded(mesh, rules=rules, indivisible=how),
        "memory.plan": lambda how: jaxdev.memory.plan(params, mesh, rules, indivisible=how),
        "init_sharded": lambda how: jaxdev.init_sharded(
            lambda: params, mesh=mesh, rules=rules, indivisible=how
        ),
    }
    for name, door in doors.items():
        for bad in ("Replicate", "pad", True, ["replicate"]):
            with pytest.raises(ShardingError, match="`indivisible` must be 'error' or 'replicate'"):
                door(bad)
        with pytest.raises(ShardingError, match=r"\['v'\].*indivisible='replicate'"):
            step = door("error")  # the default: named, the option in the message
            if name == "Strategy.sharded":
                jaxdev.make_train_step(lambda p, b: b, optax.sgd(0.1), step).init_state(params)
    placed = jaxdev.shard_params(params, mesh, rules, indivisible="replicate")
    assert {k: x.sharding.spec for k, x in placed.items()} == {"k": P(None, "model"), "v": P()}
    plan = jaxdev.memory.plan(params, mesh, rules, indivisible="replicate")
    assert plan["params"] == 16 * 8 * 4 // 4 + 8 * 3 * 4  # k split 4 ways, v replicated


@pytest.mark.parametrize("form", ["regex", "pytree"])
@pytest.mark.parametrize("field", ["unreduced", "reduced"])
def test_a_rule_specs_unreduced_and_reduced_axes_are_kept(form, field):
    """``_check_spec`` rebuilt ``P(*spec)``, which JAX refuses (ValueError) for a spec with
    unreduced/reduced axes; a split leaf and an indivisible (replicated) one keep them."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    shapes = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in [("w", (8, 16)), ("v", (8, 6))]}
    rule = {"w": P(None, "model", **{field: {"data"}}), "v": P(None, "model", **{field: {"data"}})}
    rules = list(rule.items()) if form == "regex" else rule
    out = jaxdev.param_shardings(shapes, mesh, rules, indivisible="replicate")
    assert out["w"].spec == P(None, "model", **{field: {"data"}})
    assert out["v"].spec == P(**{field: {"data"}})  # 6 is not divisible by 4: replicated


@pytest.mark.parametrize("axis", ["missing", "auto"])
@pytest.mark.parametrize("field", ["unreduced", "reduced"])
@pytest.mark.parametrize("door", ["param_shardings", "init_state"])
def test_a_rule_specs_unreduced_or_reduced_axis_jax_refuses_is_named(field, door, axis):
    """An unreduced/reduced axis the mesh lacks, or one of an Auto mesh axis (make_mesh's
    default), raised JAX's raw ValueError (`_check_spec` checked the split axes only). Each
    is a ShardingError naming the rule and the leaf, as a split axis's is."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    name, why = ("nope", "does not exist") if axis == "missing" else ("data", "is Auto")
    rules = [("w", P("model", **{field: {name}}))]
    match = f"{field} mesh axis '{name}' {why}"
    if (door, field) == ("init_state", "unreduced"):  # a Strategy refuses unreduced rules first
        match = rf"`rules` pattern 'w' gives P\('model', unreduced={{'{name}'}}"
    with pytest.raises(jaxdev.ShardingError, match=match):
        if door == "param_shardings":
            jaxdev.param_shardings({"w": jax.ShapeDtypeStruct((8,), jnp.float32)}, mesh, rules)
        else:
            strategy = jaxdev.Strategy.sharded(mesh, rules=rules)
            step = jaxdev.make_train_step(lambda p, b: b["x"] @ p["w"], optax.sgd(0.1), strategy)
            step.init_state({"w": jnp.ones((8,))})


@pytest.mark.parametrize(
    "door", ["shard_params", "to_device", "init_sharded", "jit_to_device", "jit_shard_params"]
)
def test_placing_a_value_unreduced_is_named(door):
    """An unreduced array is the sum of its copies: a value placed so counts once per copy.
    jax 0.12's device_put raised its raw NotImplementedError; 0.10.2 placed it (and its
    device_get raised). Each door refuses it by name, saying what arrived (init_sharded
    returned an array nothing could read; inside jit, JAX's raw ValueError); a reduced axis
    still places."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    spec = P("model", unreduced={"data"})
    params = {"w": jaxdev.to_device(jnp.ones((8,)), "cpu:1")}
    got = r"leaf \['w'\] \(shape \(8,\), dtype float32(, now on cpu:1)?\) cannot be placed"
    with pytest.raises(jaxdev.ShardingError, match=rf"{got} .* unreduced over \['data'\]"):
        if door == "shard_params":
            jaxdev.shard_params(params, mesh, [("w", spec)])
        elif door == "to_device":
            jaxdev.to_device(params, NamedSharding(mesh, spec))
        elif door == "init_sharded":
            jaxdev.init_sharded(lambda: {"w": jnp.ones((8,))}, mesh=mesh, rules=[("w", spec)])
        elif door == "jit_to_device":
            jax.jit(lambda t: jaxdev.to_device(t, {"w": NamedSharding(mesh, spec)}))(params)
        else:
            jax.jit(lambda t: jaxdev.shard_params(t, mesh, [("w", spec)]))(params)
    if door in ("shard_params", "to_device"):
        with pytest.raises(jaxdev.ShardingError, match="now on cpu:1"):
            jaxdev.shard_params(params, mesh, [("w", spec)])
    placed = jaxdev.shard_params(params, mesh, [("w", P("model", reduced={"data"}))])
    assert placed["w"].sharding.spec == P("model", reduced={"data"})
    np.testing.assert_array_equal(jax.device_get(placed["w"]), np.ones(8))


@pytest.mark.parametrize("form", ["regex", "pytree", "sharding"])
@pytest.mark.parametrize("state", ["one device", "replicated", "init_state"])
def test_a_strategy_with_unreduced_rules_is_refused_where_built(form, state):
    """``Strategy.sharded`` took unreduced rules; a step given a state not from init_state
    then raised JAX's raw errors. The Strategy refuses them where it is built, naming the
    rule; param_shardings still keeps them (test above)."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    spec = P("model", unreduced={"data"})
    rules = {"regex": [("w", spec)], "pytree": {"w": spec}}.get(form)
    rules = rules or {"w": NamedSharding(mesh, spec)}
    where = "pattern 'w'" if form == "regex" else r"leaf \['w'\]"
    with pytest.raises(ShardingError, match=rf"`rules` {where} gives .* unreduced over \['data'\]"):
        strategy = jaxdev.Strategy.sharded(mesh, rules=rules)
        loss = lambda p, b: jnp.sum(p["w"]) * jnp.ones(b["x"].shape[0])  # noqa: E731
        step = jaxdev.make_train_step(loss, optax.sgd(0.1), strategy)
        tstate = jaxdev.TrainState.create({"w": jnp.arange(8.0)}, optax.sgd(0.1))
        if state == "init_state":
            tstate = step.init_state({"w": jnp.arange(8.0)})
        elif state == "one device":
            tstate = jaxdev.to_device(tstate, "cpu:0")
        else:
            tstate = jaxdev.replicate(tstate, mesh)
        step(tstate, {"x": np.ones((4, 3), np.float32)})


@pytest.mark.parametrize("state", ["one device", "init_state"])
def test_a_strategy_refuses_an_unreduced_nnx_out_sharding_where_it_lays_out_the_state(state):
    """Under ``rules="flax"`` the specs are the leaves' own (an NNX out_sharding), known only
    per state: a step given a state not from init_state raised JAX's raw ValueError. The
    Strategy's state_layout (the step's, once per compile) names the leaf."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    u = NamedSharding(mesh, P("model", unreduced={"data"}))
    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(lambda: nnx.Dict(w=nnx.Param(jnp.ones(8), out_sharding=u)))
    shapes = nnx.state(module)
    params = jax.tree.map(lambda _: jnp.arange(8.0), shapes)
    loss = lambda p, b: jnp.sum(p["w"][...]) * jnp.ones(b["x"].shape[0])  # noqa: E731
    step = jaxdev.make_train_step(loss, optax.sgd(0.1), jaxdev.Strategy.sharded(mesh, rules="flax"))
    with pytest.raises(ShardingError, match=r"leaf .*\['w'\].* unreduced over \['data'\]"):
        if state == "init_state":
            step.init_state(params)
        tstate = jaxdev.to_device(jaxdev.TrainState.create(params, optax.sgd(0.1)), "cpu:0")
        step(tstate, {"x": np.ones((4, 3), np.float32)})
