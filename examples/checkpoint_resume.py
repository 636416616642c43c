"""Train, checkpoint, "crash", resume: the resumed run ends with the same parameters.

Run: ``python examples/checkpoint_resume.py``. A linear classifier trained
data parallel on 8 fake CPU devices for 40 steps. The data of step ``t`` is
a pure function of ``t`` (so a resumed run sees the same batches). Run A
trains straight through. Run B saves a :class:`jaxdev.Checkpointer`
checkpoint every 10 steps (asynchronously, with the running metrics), and
"crashes" after step 25: everything in memory is dropped. Run C starts from
nothing, restores the latest checkpoint (step 20) onto a freshly initialised
state (same placement), trains steps 21..40 and ends bit-identical to A.
Finally the checkpoint is restored onto other layouts: one device, and the
pmap layout (a leading device axis).
"""

import tempfile

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

STEPS, EVERY, CRASH_AFTER, BATCH, FEATURES, CLASSES = 40, 10, 25, 64, 16, 4


def loss_fn(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def batch_of(step: int) -> dict:
    """The batch of step ``step``: a pure function of the step number."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "y": x[:, :CLASSES].argmax(-1).astype(np.int32)}


def fresh(step):
    params = {"w": jnp.zeros((FEATURES, CLASSES)), "b": jnp.zeros(CLASSES)}
    return step.init_state(params, optax.adam(0.05))


def train(step, state, start: int, stop: int, ckpt=None, metrics=None):
    """Steps ``start+1 .. stop``; a checkpoint (state and metrics) when ``ckpt`` says so."""
    for t in range(start + 1, stop + 1):
        state, metrics = step(state, step.put_batch(batch_of(t - 1)), metrics)
        if ckpt is not None:
            ckpt.save(t, state, metrics=metrics)  # every EVERY steps, in the background
    return state, metrics


def same_bits(a, b) -> bool:
    pairs = zip(jax.tree.leaves(jaxdev.to_host(a)), jax.tree.leaves(jaxdev.to_host(b)))
    return all(x.tobytes() == y.tobytes() for x, y in pairs)


def main() -> None:
    mesh = jaxdev.data_mesh()
    step = jaxdev.make_train_step(loss_fn, optax.adam(0.05), jaxdev.Strategy.sharded(mesh))
    a, _ = train(step, fresh(step), 0, STEPS)  # run A: no interruption

    directory = tempfile.mkdtemp(prefix="checkpoint_resume_")
    with jaxdev.Checkpointer(directory, keep=2, every=EVERY) as ckpt:  # run B
        train(step, fresh(step), 0, CRASH_AFTER, ckpt)
    print(f"run B crashed after step {CRASH_AFTER}; checkpoints on disk: {ckpt.all_steps()}")

    with jaxdev.Checkpointer(directory, keep=2, every=EVERY) as ckpt:  # run C
        last = ckpt.latest_step()
        state = ckpt.restore(fresh(step))  # like a fresh state: a TrainState, replicated
        metrics = ckpt.restore_metrics()
        jaxdev.assert_replicated(state, mesh)
        print(f"run C resumed at step {int(state.step)} (metrics over {last} steps restored)")
        c, metrics = train(step, state, last, STEPS, ckpt, metrics)
    assert int(c.step) == STEPS and same_bits(c.params, a.params)
    print(f"after {STEPS} steps, resumed params == uninterrupted params (bit for bit): True")
    print(f"loss over all {STEPS} steps: {float(metrics['loss'].compute()):.4f}")

    one = jaxdev.Checkpointer(directory).restore("cpu:0")  # e.g. for evaluation
    jaxdev.assert_on_device(one, "cpu:0")
    like_pmap = a._replace(params=jaxdev.pmap.stack_for_pmap(a.params))  # a leading device axis
    pmap_params = jaxdev.restore(f"{directory}/{STEPS}", like_pmap).params
    assert same_bits(jaxdev.pmap.unstack_from_pmap(pmap_params, check=True), a.params)
    print(f"restored on cpu:0, and in the pmap layout: w {pmap_params['w'].shape}")
    print("checkpoint resume: ok")


if __name__ == "__main__":
    main()
