"""Per-call time of the train step, piece by piece: hand jit, step(), its compiled program.

Run: ``python benchmarks/step_overhead.py`` (any backend; on a GPU host it times the GPU).
Uses private attributes of TrainStep (``_jitted``, ``_compiled``) to time the program alone.
"""

import cProfile
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdev

tx = optax.sgd(0.01)


def loss(p, b):
    h = jax.nn.relu(b["x"] @ p["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], b["y"])


dev = jax.devices()[0]
params = jax.device_put({"w1": jnp.ones((256, 512)) * 0.01, "w2": jnp.ones((512, 10)) * 0.01}, dev)
b = jax.device_put({"x": np.ones((128, 256), np.float32), "y": np.zeros(128, np.int32)}, dev)


@jax.jit
def hand(p, o, b):
    loss_, g = jax.value_and_grad(lambda p: loss(p, b).mean())(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss_


step = jaxdev.make_train_step(loss, tx, jaxdev.Strategy.single(dev), donate=False)
s0 = step.init_state(params, tx)
s, m = step(s0, b)
s, m = step(s, b, m)
key = [k for k in step._jitted if k[1]][0]
mb = step._jitted[key]
jf = mb.fn
comp = step._compiled[key]
ident = jax.jit(
    lambda s, b, m: (jax.tree.map(lambda x: x + 0, s), jax.tree.map(lambda x: x + 0, m))
)
o0 = tx.init(params)


def t(fn, n=3000):
    out = fn()
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e6


rows = {
    "hand jit": lambda: hand(params, o0, b),
    "step()": lambda: step(s, b, m),
    "compiled (same_program)": lambda: comp(s, b, m),
    "MeshBound": lambda: mb(s, b, m),
    "raw jitted": lambda: jf(s, b, m),
    "identity, same trees": lambda: ident(s, b, m),
}
for _ in range(3):
    print("  ".join(f"{k} {t(f):.1f}" for k, f in rows.items()))
pr = cProfile.Profile()
pr.enable()
t(lambda: step(s, b, m), 2000)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
