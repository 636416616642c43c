"""Save or restore a sharded TrainState, as 1 process x 8 devices or under ``jaxdev launch``.

Usage: ``python ckpt_multihost.py save|restore|diverge|local DIR`` (alone: 8 fake CPU
devices; under ``jaxdev launch -n 2 --devices-per-process 4``: 2 processes).
The state's ``w`` is split over every device of every process (``P('data')``),
``b`` replicated. ``save`` writes ``DIR/plain`` with :func:`jaxdev.save` and
step 7 of a :class:`jaxdev.Checkpointer` in ``DIR/manager``. ``restore`` reads
both back onto this run's devices (like a freshly built state, and with
``rules='fsdp'``), checks every addressable shard against the expected
values, and prints ``restored ok processes=P devices=D``. ``diverge`` saves
steps 1 and 2 as ``DIR/a`` and ``DIR/b``, then process ``i`` restores the
``i``-th: every process must refuse (``refused ok: <message>``). ``local``
saves leaves each process holds alone: equal ones once, differing ones refused.
``locked`` saves into ``DIR/held``, a folder a Checkpointer holds: every process must refuse.
"""

from __future__ import annotations

import os
import sys

import jaxdev

if "JAXDEV_COORDINATOR" in os.environ:
    jaxdev.distributed.initialize()
else:
    jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000
B = np.arange(32, dtype=np.float32)


def global_array(host: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def make_state(mesh, scale: float = 1.0) -> jaxdev.TrainState:
    split, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params = {"w": global_array(W * scale, split), "b": global_array(B * scale, rep)}
    opt = jax.jit(optax.sgd(0.1, momentum=0.9).init)(params)
    step = global_array(np.asarray(7, np.int32), rep)
    return jaxdev.TrainState(step, params, opt)


def check(state: jaxdev.TrainState, mesh, label: str) -> None:
    jaxdev.assert_sharded(state.params["w"], P("data"), mesh=mesh)
    jaxdev.assert_replicated(state.params["b"], mesh)
    for shard in state.params["w"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), W[shard.index]), label
    for shard in state.params["b"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), B), label
    assert int(state.step.addressable_data(0)) == 7, label


def main(mode: str, directory: str) -> int:
    mesh = jaxdev.data_mesh()  # every device of every process
    if mode == "save":
        state = make_state(mesh)
        jaxdev.save(os.path.join(directory, "plain"), state, step=7)
        with jaxdev.Checkpointer(os.path.join(directory, "manager")) as ckpt:
            ckpt.save(7, state)
        print(f"saved ok processes={jax.process_count()} devices={jax.device_count()}")
        return 0
    if mode == "diverge":
        for name, step in (("a", 1), ("b", 2)):
            jaxdev.save(os.path.join(directory, name), make_state(mesh, step), step=step)
        mine = os.path.join(directory, "ab"[jax.process_index() % 2])
        try:
            jaxdev.restore(mine, make_state(mesh, scale=0.0))
        except jaxdev.CheckpointError as err:
            print("refused ok:", " ".join(str(err).split()))
            return 0
        print("restored different checkpoints without an error")
        return 1
    if mode == "local":
        return local(directory)
    if mode == "locked":  # DIR/held is a Checkpointer's (the test holds its lock)
        try:
            jaxdev.save(os.path.join(directory, "held", "x"), make_state(mesh))
        except jaxdev.CheckpointError as err:
            print("refused ok:", " ".join(str(err).split()))
            return 0
        print("saved into a Checkpointer's folder without an error")
        return 1
    like = make_state(mesh, scale=0.0)  # the layout to restore onto
    check(jaxdev.restore(os.path.join(directory, "plain"), like), mesh, "plain")
    check(jaxdev.restore(os.path.join(directory, "plain"), mesh, rules="fsdp"), mesh, "fsdp")
    with jaxdev.Checkpointer(os.path.join(directory, "manager")) as ckpt:
        assert ckpt.latest_step() == 7
        check(ckpt.restore(like), mesh, "manager")
    print(f"restored ok processes={jax.process_count()} devices={jax.device_count()}")
    return 0


def local(directory: str) -> int:
    """Leaves each process holds alone: saved once when equal, refused (named) when not."""
    same = jax.device_put(np.arange(4.0, dtype=np.float32), jax.local_devices()[0])
    jaxdev.save(os.path.join(directory, "local"), {"same": same})
    back = jaxdev.restore(os.path.join(directory, "local"))["same"]
    assert np.array_equal(np.asarray(back.addressable_data(0)), np.arange(4.0)), back
    mine = jax.device_put(np.full(2, jax.process_index(), np.int32), jax.local_devices()[0])
    try:
        jaxdev.save(os.path.join(directory, "differ"), {"same": same, "mine": mine})
    except jaxdev.CheckpointError as err:
        print("refused ok:", " ".join(str(err).split()))
        return 0
    print("saved leaves that differ across processes without an error")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
