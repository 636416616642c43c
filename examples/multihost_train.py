"""Data-parallel training across processes with JAX's multi-controller runtime.

Two local processes with 4 fake CPU devices each (the same script runs
unchanged on a cluster: as a Slurm or Open MPI job of several tasks JAX finds
the coordinator itself; elsewhere export ``JAXDEV_COORDINATOR``,
``JAXDEV_NUM_PROCESSES`` and ``JAXDEV_PROCESS_ID`` on each host)::

    jaxdev launch -n 2 --devices-per-process 4 -- python examples/multihost_train.py

One process with 8 fake CPU devices, for comparison (same final numbers)::

    python examples/multihost_train.py

Every process builds the same global batches from a fixed seed and brings
only its own rows (process ``p`` of ``P`` takes the ``p``-th slice), as a
real per-host data loader would; ``put_batch`` turns those local rows into
one global array after checking every process brought the same shapes.
"""

from __future__ import annotations

import os

import jaxdev

# Multi-process under `jaxdev launch` (or JAXDEV_* set by hand), or as a task of
# a Slurm / Open MPI job of more than one task: initialize() then lets JAX's
# cluster detection fill in the coordinator and the process id.
_JOB_SIZE = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
MULTI = "JAXDEV_COORDINATOR" in os.environ or any(
    os.environ.get(v, "1").isdigit() and int(os.environ[v]) > 1
    for v in _JOB_SIZE
    if v in os.environ
)
if MULTI:
    jaxdev.distributed.initialize()
elif not os.environ.get("JAX_PLATFORMS", "").replace("cpu", "").strip(","):
    jaxdev.testing.use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 20, 64, 16, 4


def loss_fn(params, batch):
    """Per-example softmax cross-entropy of a linear classifier."""
    logits = batch["x"] @ params["w"] + params["b"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


def local_rows(step: int) -> dict:
    """This process's slice of global batch ``step`` (identical data on every process)."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES].argmax(-1)).astype(np.int32)
    per = GLOBAL_BATCH // jax.process_count()
    lo = jax.process_index() * per
    return {"x": x[lo : lo + per], "y": y[lo : lo + per]}


def main() -> int:
    mesh = jaxdev.data_mesh()  # every device of every process
    tx = optax.adam(0.05)
    step = jaxdev.make_train_step(loss_fn, tx, jaxdev.Strategy.sharded(mesh), has_aux=True)
    params = {"w": jnp.zeros((FEATURES, CLASSES)), "b": jnp.zeros(CLASSES)}
    state = step.init_state(params, tx)
    metrics = None
    for i in range(STEPS):
        state, metrics = step(state, step.put_batch(local_rows(i)), metrics)
    jaxdev.distributed.assert_same_across_processes(state.params)  # replicas agree everywhere
    out = metrics.fetch()
    checksum = float(np.sum(np.abs(jaxdev.to_host(jaxdev.unreplicate(state.params)["w"]))))
    print(
        f"processes={jax.process_count()} devices={jax.device_count()} steps={int(state.step)} "
        f"loss={out['loss']:.5f} accuracy={out['accuracy']:.4f} |w|={checksum:.4f}"
    )
    if MULTI:
        jaxdev.distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
