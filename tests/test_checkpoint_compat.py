"""Checkpoints written by earlier jaxdev versions still restore, bit for bit.

``tests/data/ckpt_v2/`` was written by jaxdev at commit 74c68ce (format
version 2) with ``python tests/test_checkpoint_compat.py tests/data/ckpt_v2``:
a plain ``save`` and a ``Checkpointer`` step with metrics, of a tree with
every kind of leaf and node the format records (NamedTuple and dataclass
nodes, int dict keys, typed keys, a pmap-stacked leaf, a sharded leaf,
numpy arrays and scalars, Python numbers, None, a zero-size array).
"""

from __future__ import annotations

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev.metrics import Collection, Mean, Sum

DATA = os.path.join(os.path.dirname(__file__), "data", "ckpt_v2")


def _tree():
    """The pinned tree (deterministic): every leaf and node kind a checkpoint records."""
    mesh = jaxdev.data_mesh()
    params = {"dense": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.ones(4)}}
    state = jaxdev.TrainState.create(params, optax.adam(0.1), rng=jax.random.key(3))
    stacked = jaxdev.pmap.stack_for_pmap(jnp.arange(3, dtype=jnp.int32), jax.devices())
    return {
        "state": state,
        "split": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data"))),
        "stacked": stacked,
        "host": np.arange(6, dtype=np.float32).reshape(2, 3),
        "npscalar": np.float64(1e-3),
        "ints": {0: jnp.int32(7), 10: np.int8(-3)},
        "python": (3, 0.1, 1 + 2j, True, None),
        "empty": jnp.zeros((0, 2)),
        "list": [jnp.float32(2.5), np.bool_(True)],
    }


def _metrics():
    return Collection.from_values({"loss": Mean, "n": Sum}, {"loss": jnp.arange(4.0), "n": 4})


def _write(directory: str) -> None:
    """Write the fixture (run once by hand with the jaxdev version it pins)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    jaxdev.save(f"{directory}/plain", _tree(), step=11)
    with jaxdev.Checkpointer(f"{directory}/managed", async_=False) as ckpt:
        ckpt.save(5, _tree(), metrics=_metrics())


def _same(a, b):
    ta, tb = jax.tree.structure(a), jax.tree.structure(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert type(x) is type(y), (x, y)
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _copy(tmp_path, name):
    shutil.copytree(os.path.join(DATA, name), tmp_path / name)
    return tmp_path / name


def test_a_version_2_checkpoint_restores_its_own_structure(tmp_path):
    path = _copy(tmp_path, "plain")
    back = jaxdev.restore(path)
    want = _tree()
    _same(back, want)
    assert type(back["state"]) is jaxdev.TrainState
    assert type(back["state"].opt_state[0]).__name__ == "ScaleByAdamState"
    assert back["split"].sharding == want["split"].sharding
    assert back["stacked"].sharding == want["stacked"].sharding
    jaxdev.assert_on_host(back["host"])


def test_a_version_2_checkpoint_restores_onto_a_target_and_rules(tmp_path):
    path = _copy(tmp_path, "plain")
    want = _tree()
    _same(jaxdev.restore(path, want), want)
    one = jaxdev.restore(path, "cpu:1")
    assert one["split"].devices() == {jax.devices()[1]}
    state = jaxdev.restore(path, jaxdev.data_mesh(), rules="replicate")["state"]
    _same(state, want["state"])


def test_a_version_2_checkpointer_step_restores_with_its_metrics(tmp_path):
    path = _copy(tmp_path, "managed")
    with jaxdev.Checkpointer(path) as ckpt:
        assert ckpt.latest_step() == 5
        _same(ckpt.restore(), _tree())
        metrics = ckpt.restore_metrics()
        assert type(metrics) is Collection
        assert float(metrics["loss"].compute()) == 1.5 and int(metrics["n"].compute()) == 4
        ckpt.save(6, _tree())  # and goes on
        ckpt.wait()
        assert ckpt.all_steps() == [5, 6]


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    _write(sys.argv[1])
