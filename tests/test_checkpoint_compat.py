"""Checkpoints written by earlier jaxdev versions still restore, bit for bit.

``tests/data/ckpt_v2/`` was written by jaxdev at commit 74c68ce (format
version 2) with ``python tests/test_checkpoint_compat.py tests/data/ckpt_v2``:
a plain ``save`` and a ``Checkpointer`` step with metrics, of a tree with
every kind of leaf and node the format records (NamedTuple and dataclass
nodes, int dict keys, typed keys, a pmap-stacked leaf, a sharded leaf,
numpy arrays and scalars, Python numbers, None, a zero-size array).

``tests/data/ckpt_v1/`` was written by jaxdev at commit 9b656cc (format version 1:
the last commit before 7b32b04 made version 2) on jax 0.12.0.1, orbax-checkpoint
0.12.8 (.venv) with ``git worktree add /tmp/v1wt 9b656cc`` and ``PYTHONPATH=/tmp/v1wt
python tests/test_checkpoint_compat.py tests/data/ckpt_v1 1``: the same two checkpoints
of ``_tree(1)``, the tree above less what version 1 could not save (typed keys: a raw
uint32 key instead; zero-size arrays), plus a random leaf that orbax stores
uncompressed, so a flipped byte there reaches the version-1 checksum. Version 1 wrote
numpy scalars as 0-d arrays (they come back so), and its classes by their module then
(``jaxdev._train``, ``jaxdev._metrics``).
"""

from __future__ import annotations

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev

metrics = getattr(jaxdev, "metrics", jaxdev)  # version 1's jaxdev had them on top (and pmap's)
DATA = os.path.join(os.path.dirname(__file__), "data")


def _tree(version=2):
    """The pinned tree (deterministic): every leaf and node kind a checkpoint of ``version``
    records."""
    mesh = jaxdev.data_mesh()
    params = {"dense": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.ones(4)}}
    rng = jax.random.key(3) if version >= 2 else jax.random.PRNGKey(3)
    state = jaxdev.TrainState.create(params, optax.adam(0.1), rng=rng)
    stack = getattr(jaxdev, "pmap", jaxdev).stack_for_pmap
    stacked = stack(jnp.arange(3, dtype=jnp.int32), jax.devices())
    tree = {
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
    if version == 1:
        del tree["empty"]
        tree["noise"] = jnp.asarray(np.random.default_rng(1).integers(0, 2**32, 512, np.uint32))
    return tree


def _restored(version):
    """What ``restore`` gives back of ``_tree(version)``: version 1 kept no numpy scalar type."""
    if version >= 2:
        return _tree(version)
    numpy = lambda x: isinstance(x, np.generic) and not isinstance(x, float)  # noqa: E731
    return jax.tree.map(lambda x: np.asarray(x) if numpy(x) else x, _tree(version))


def _metrics():
    spec = {"loss": metrics.Mean, "n": metrics.Sum}
    return metrics.Collection.from_values(spec, {"loss": jnp.arange(4.0), "n": 4})


def _write(directory: str, version: int) -> None:
    """Write the fixture (run once by hand with the jaxdev version it pins)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    jaxdev.save(f"{directory}/plain", _tree(version), step=11)
    with jaxdev.Checkpointer(f"{directory}/managed", async_=False) as ckpt:
        ckpt.save(5, _tree(version), metrics=_metrics())


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


def _copy(tmp_path, version, name):
    shutil.copytree(os.path.join(DATA, f"ckpt_v{version}", name), tmp_path / name)
    return tmp_path / name


VERSIONS = pytest.mark.parametrize("version", [1, 2])


@VERSIONS
def test_a_checkpoint_restores_its_own_structure(tmp_path, version):
    path = _copy(tmp_path, version, "plain")
    back = jaxdev.restore(path)
    want = _restored(version)
    _same(back, want)
    assert type(back["state"]) is jaxdev.TrainState
    assert type(back["state"].opt_state[0]).__name__ == "ScaleByAdamState"
    assert back["split"].sharding == want["split"].sharding
    assert back["stacked"].sharding == want["stacked"].sharding
    jaxdev.assert_on_host(back["host"])


@VERSIONS
def test_a_checkpoint_restores_onto_a_target_and_rules(tmp_path, version):
    path = _copy(tmp_path, version, "plain")
    want = _tree(version)
    _same(jaxdev.restore(path, want), want)
    one = jaxdev.restore(path, "cpu:1")
    assert one["split"].devices() == {jax.devices()[1]}
    state = jaxdev.restore(path, jaxdev.data_mesh(), rules="replicate")["state"]
    _same(state, want["state"])


@VERSIONS
def test_a_checkpointer_step_restores_with_its_metrics(tmp_path, version):
    path = _copy(tmp_path, version, "managed")
    with jaxdev.Checkpointer(path) as ckpt:
        assert ckpt.latest_step() == 5
        _same(ckpt.restore(), _restored(version))
        back = ckpt.restore_metrics()
        assert type(back) is metrics.Collection and type(back["loss"]) is metrics.Mean
        assert float(back["loss"].compute()) == 1.5 and int(back["n"].compute()) == 4
        _same(back, _metrics())
        ckpt.save(6, _tree())  # and goes on, in the current version
        ckpt.wait()
        assert ckpt.all_steps() == [5, 6]


def test_a_flipped_byte_of_a_version_1_checkpoint_is_named_by_its_checksum(tmp_path):
    path = _copy(tmp_path, 1, "plain")
    raw = np.asarray(_tree(1)["noise"]).tobytes()  # stored as written: find it, flip one bit
    hits = [f for f in path.rglob("*") if f.is_file() and raw in f.read_bytes()]
    assert len(hits) == 1, hits
    data = bytearray(hits[0].read_bytes())
    data[data.index(raw) + 1001] ^= 0x40
    hits[0].write_bytes(bytes(data))
    for target in (None, _tree(1)):
        with pytest.raises(jaxdev.CheckpointError) as e:
            jaxdev.restore(path, target)
        msg = str(e.value)
        assert f"Checkpoint {path} (state) is corrupted" in msg
        assert "['noise']: checksum" in msg and msg.count(": checksum") == 1, msg


@VERSIONS
def test_a_checkpoint_restores_under_a_users_mesh(tmp_path, version):
    """Before: version 1's checksum program ran under the user's `jax.set_mesh`, and JAX
    refused its leaves on other devices (a raw 'incompatible devices' ValueError)."""
    path = _copy(tmp_path, version, "plain")
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[4:6])
    with jax.set_mesh(mesh):
        _same(jaxdev.restore(path), _restored(version))

if __name__ == "__main__":  # python tests/test_checkpoint_compat.py DIRECTORY [VERSION]
    jax.config.update("jax_num_cpu_devices", 8)
    _write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
