"""FSDP training under 2 processes x 4 devices equals 1 process x 8 devices.

Both runs execute ``tests/mp_scripts/fsdp_train.py`` (params sharded over the
``fsdp`` axis of a global ``data=2 x fsdp=4`` mesh; plain steps, an uneven
padded batch, ``steps_per_call=2`` and ``accumulate=2``). Tolerance:
``rtol=1e-5`` (the two runs sum the gradients over the devices in different
orders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, clean_env, launch

import jaxdev

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(REPO, "tests", "mp_scripts", "fsdp_train.py")


def _results(text: str) -> list[dict]:
    return [
        json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line
    ]


def _close(a: dict, b: dict) -> None:
    assert a["steps"] == b["steps"] == 10
    assert a["w1_shard_shape"] == b["w1_shard_shape"] == [32, 16]  # sharded 4 ways, not 8
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    for k in a["sums"]:
        np.testing.assert_allclose(a["sums"][k], b["sums"][k], rtol=1e-5)
    np.testing.assert_allclose(a["w1_head"], b["w1_head"], rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(240)
def test_fsdp_two_processes_match_one_process_with_eight_devices():
    one = subprocess.run(
        [sys.executable, SCRIPT], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert one.returncode == 0, one.stderr[-3000:]
    [single] = _results(one.stdout)
    assert (single["processes"], single["devices"]) == (1, 8)

    two = launch(2, 4, [sys.executable, SCRIPT])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    results = _results(two.stdout)
    assert len(results) == 2 and all(r["processes"] == 2 for r in results)
    assert results[0] == results[1]  # both processes hold the same gathered numbers
    _close(results[0], single)


@pytest.mark.processes(2, devices=4, timeout=120)
@pytest.mark.parametrize("mode", ["same", "numpy"])
def test_init_sharded_checks_every_process_built_the_same_program(mode):
    """``same``: a deterministic init from typed keys (threefry and rbg), checked across
    processes (``assert_same_across_processes``, ``shard_batch``'s shape check); ``numpy``:
    an ``init_fn`` drawing from ``np.random`` seeded per process is refused everywhere."""
    mesh = jaxdev.make_mesh({"fsdp": 8})
    keys = {"fry": jax.random.key(0), "rbg": jax.random.key(0, impl="rbg")}
    if mode == "numpy":
        rng = np.random.default_rng(jax.process_index())
        with pytest.raises(jaxdev.DistributedError, match="init_sharded's init_fn"):
            jaxdev.init_sharded(
                lambda keys: {"w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)},
                keys,
                mesh=mesh,
                rules="fsdp",
                min_size=0,
            )
        return
    jaxdev.distributed.assert_same_across_processes(keys)
    jaxdev.shard_batch({k: jax.random.split(v, 4) for k, v in keys.items()}, mesh)

    def init_fn(keys):
        return {"w": jax.random.normal(keys["fry"], (64, 8)) + jax.random.normal(keys["rbg"])}

    params = jaxdev.init_sharded(init_fn, keys, mesh=mesh, rules="fsdp", min_size=0)
    total = jax.jit(jnp.sum, out_shardings=jaxdev.as_sharding(mesh))(params["w"])
    jaxdev.distributed.assert_same_across_processes(total)
    assert np.isfinite(float(total)) and jax.process_count() == 2


@pytest.mark.processes(2, devices=4, timeout=120)
def test_init_state_places_a_typed_key_on_the_global_mesh():
    """A typed key (threefry, rbg) reaches the global mesh through its key data, replicated
    (copy_to) and under rules (place_tree); re-copying the global key keeps it. Before:
    device_put's raw ValueError (replicated), numpy's TypeError on the key (fsdp)."""
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    params = {"w": np.full((16, 8), 0.1, np.float32)}

    def loss(p, batch, rng):
        return jnp.mean((batch["x"] @ p["w"]) ** 2, axis=-1) + 0 * jax.random.uniform(rng)

    def data(key):  # the key's data on this process's first device
        return np.asarray(jax.random.key_data(key).addressable_data(0))

    fsdp = jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=0)
    for strategy in (jaxdev.Strategy.sharded(mesh), fsdp):
        for key in (jax.random.key(0), jax.random.key(0, impl="rbg")):
            step = jaxdev.make_train_step(loss, optax.sgd(0.1), strategy)
            state = step.init_state(params, rng=key)
            assert state.rng.sharding.mesh == mesh and state.rng.sharding.is_fully_replicated
            np.testing.assert_array_equal(data(state.rng), jax.random.key_data(key))
            again = jaxdev.copy_to(state.rng, mesh)
            assert again is not state.rng and again.dtype == key.dtype
            np.testing.assert_array_equal(data(again), jax.random.key_data(key))
            state, metrics = step(state, step.put_batch({"x": np.ones((8, 16), np.float32)}))
            np.testing.assert_allclose(metrics.fetch()["loss"], 2.56, rtol=1e-6)


@pytest.mark.processes(2, devices=4, timeout=120)
def test_pmap_over_two_processes_averages_over_every_process():
    """flax's multi-host pmap: each process feeds its own devices, the gradient's pmean
    spans all 8. Before: jax.pmap(devices=<this process's 4>) averaged each process's
    own rows, and the two processes trained apart, silently."""
    tx, lr = optax.sgd(0.1), 0.1

    def loss(params, batch):
        return (batch["x"] @ params["w"] - batch["y"]) ** 2

    def rows(p):  # each process's 8 rows (uneven ones too: 5 of them, padded)
        x = np.arange(24, dtype=np.float32).reshape(8, 3) / 10 + p
        return {"x": x, "y": np.arange(8, dtype=np.float32) - 3 * p}

    step = jaxdev.make_train_step(loss, tx, jaxdev.Strategy.pmap())
    state, metrics = step.init_state({"w": np.ones(3, np.float32)}), None
    w = np.ones(3, np.float64)
    mine = rows(jax.process_index())
    for n in (8, 5, 8):
        batch = {k: v[:n] for k, v in mine.items()}
        state, metrics = step(state, step.put_batch(batch), metrics)
        both = [{k: v[:n] for k, v in rows(p).items()} for p in (0, 1)]
        x = np.concatenate([b["x"] for b in both]).astype(np.float64)
        y = np.concatenate([b["y"] for b in both]).astype(np.float64)
        w = w - lr * (2 * (x @ w - y) @ x) / len(y)  # SGD on the mean over all 2n rows
    jaxdev.distributed.assert_same_across_processes(state.params)
    np.testing.assert_allclose(np.asarray(state.params["w"]), w, rtol=1e-5)
    assert int(state.step) == 3
    with pytest.raises(jaxdev.UsageError, match=r"`devices`: under 2 processes.*got 2 of"):
        jaxdev.Strategy.pmap(2)  # JAX needs the same devices in every process
