"""Offloaded state and rematerialisation as step options (issue 20).

``Strategy.sharded(offload=...)`` keeps the optimizer state (and params) in
``pinned_host`` memory between steps and streams it to the devices inside
the step: the numbers are those of the run without offloading, bit for bit,
and ``plan`` / ``memory`` count those bytes on the host, 0 on the devices.
``make_train_step(remat=...)`` puts the loss under ``jax.checkpoint``: the
same parameters, temporaries no larger.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev

TX = optax.sgd(0.05, momentum=0.9)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w0"] + params["b0"])
    return jnp.mean((h @ params["w1"] - batch["y"]) ** 2, axis=-1)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w0": jnp.asarray(rng.normal(0, 0.1, (32, 256)), jnp.float32),
        "b0": jnp.zeros(256, jnp.float32),
        "w1": jnp.asarray(rng.normal(0, 0.1, (256, 4)), jnp.float32),
    }


def _batches(n=4, rows=64):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(rows, 32)).astype(np.float32),
            "y": rng.normal(size=(rows, 4)).astype(np.float32),
        }
        for _ in range(n)
    ]


def _train(strategy, **options):
    step = jaxdev.make_train_step(loss_fn, TX, strategy, **options)
    state, metrics = step.init_state(_params(), TX), None
    for b in _batches():
        state, metrics = step(state, step.put_batch(b), metrics)
    return step, state, metrics


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("rules", ["replicate", "fsdp"])
@pytest.mark.parametrize("offload", ["opt_state", ("params", "opt_state")])
def test_offloaded_training_equals_the_device_run_exactly(rules, offload):
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    _, want, want_metrics = _train(jaxdev.Strategy.sharded(mesh, rules=rules))
    strategy = jaxdev.Strategy.sharded(mesh, rules=rules, offload=offload)
    assert strategy.offload == tuple(sorted({offload} if isinstance(offload, str) else offload))
    step, got, metrics = _train(strategy)
    for a, b in zip(jax.tree.leaves(jaxdev.to_host(want)), jax.tree.leaves(jaxdev.to_host(got))):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert metrics.fetch() == want_metrics.fetch()
    assert _kinds(got.opt_state) == {"pinned_host"}
    assert _kinds(got.params) == ({"pinned_host"} if "params" in strategy.offload else {"device"})
    assert _kinds(got.step) == {"device"}
    # the layouts follow the rules as before, only the memory kind differs
    assert got.opt_state[0].trace["w0"].sharding.spec == want.opt_state[0].trace["w0"].sharding.spec


def test_plan_and_ledger_count_offloaded_bytes_on_the_host_not_the_devices():
    mesh = jaxdev.data_mesh()
    plain, state, _ = _train(jaxdev.Strategy.sharded(mesh))
    off, host_state, _ = _train(jaxdev.Strategy.sharded(mesh, offload="opt_state"))
    batch = off.put_batch(_batches(1)[0])
    shapes = jax.eval_shape(lambda: state)
    before = jaxdev.memory.plan(shapes, step=plain, batch=batch)
    after = jaxdev.memory.plan(shapes, step=off, batch=batch)
    opt_bytes = before["opt_state"]
    assert opt_bytes > 0 and after["opt_state"] == 0  # 0 on the devices
    assert after.host == opt_bytes and after.host_by_device["cpu:3"] == opt_bytes
    assert after.total == before.total - opt_bytes and not before.host
    assert after["params"] == before["params"]
    # the compiled figures: the offloaded arguments/outputs are host bytes, not the device's
    assert after.compiled.host == opt_bytes and before.compiled.host == 0
    assert after.compiled.argument == before.compiled.argument - opt_bytes
    assert after.peak < before.peak
    assert "offloaded to host memory (pinned_host): " in str(after)
    assert "in host memory: " in str(after)
    # the live ledger: the trace buffers are host bytes, 0 on the devices
    ledger = jaxdev.memory.ledger(state=host_state)
    device = jax.devices()[5]
    assert ledger.host_per_device[device] == opt_bytes
    paths = {e.path for e in ledger.offloaded}
    assert {"state.opt_state[0].trace['w0']", "state.opt_state[0].trace['w1']"} <= paths
    assert not any(e.path.startswith("state.opt_state") for e in ledger.entries)
    named = sum(e.bytes_per_device.get(device, 0) for e in ledger.entries)
    assert named == before["params"] + before["other"]
    assert "in host memory (offloaded, 0 on the devices)" in str(ledger)


def test_plan_of_an_offloaded_state_alone_counts_it_on_the_host():
    """``plan(state, mesh)`` without the step reads where the leaves are (was: on the devices)."""
    mesh = jaxdev.data_mesh()
    _, state, _ = _train(jaxdev.Strategy.sharded(mesh))
    _, host_state, _ = _train(jaxdev.Strategy.sharded(mesh, offload="opt_state"))
    before, after = jaxdev.memory.plan(state, mesh), jaxdev.memory.plan(host_state, mesh)
    assert before["opt_state"] > 0 and after["opt_state"] == 0
    assert after.host == before["opt_state"] and after["params"] == before["params"]


def test_an_eval_step_and_a_checkpoint_of_an_offloaded_state(tmp_path):
    step, state, _ = _train(jaxdev.Strategy.sharded(offload=("opt_state", "params")))
    ev = jaxdev.make_eval_step(loss_fn, jaxdev.Strategy.sharded(offload="params"))
    batch = ev.put_batch(_batches(1)[0])
    device_params = jax.device_put(
        jaxdev.to_host(state.params), NamedSharding(jaxdev.data_mesh(), P())
    )
    want = jaxdev.make_eval_step(loss_fn, jaxdev.Strategy.sharded())(device_params, batch)
    assert ev(state.params, batch).fetch() == want.fetch()
    jaxdev.save(tmp_path / "c", state)
    back = jaxdev.restore(tmp_path / "c", state)
    assert _kinds(back.opt_state) == {"pinned_host"} == _kinds(back.params)
    for a, b in zip(jax.tree.leaves(jaxdev.to_host(state)), jax.tree.leaves(jaxdev.to_host(back))):
        np.testing.assert_array_equal(a, b)
    # a state laid out on the devices is moved by the offloading step's first call, and back
    plain = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded())
    moved, _ = step(plain.init_state(_params(), TX), step.put_batch(_batches(1)[0]))
    assert _kinds(moved.opt_state) == {"pinned_host"}
    again, _ = plain(moved, plain.put_batch(_batches(1)[0]))
    assert _kinds(again.opt_state) == {"device"}


def test_offload_bad_inputs_are_named():
    for bad in ("grads", ("params", "rng"), 3, ()):
        with pytest.raises(jaxdev.UsageError, match="`offload` must be 'params', 'opt_state'"):
            jaxdev.Strategy.sharded(offload=bad)
    with pytest.raises(jaxdev.UsageError, match="runs under jax.jit only, not `shard_map`"):
        jaxdev.Strategy.sharded(offload="opt_state", shard_map=True)


def _deep_loss(params, batch):
    h = batch["x"]
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2, axis=-1)


@pytest.mark.parametrize(
    "remat", [True, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable]
)
def test_remat_gives_the_same_params_and_no_more_temporaries(remat):
    rng = np.random.default_rng(2)
    params = {f"w{i}": jnp.asarray(rng.normal(0, 0.1, (64, 64)), jnp.float32) for i in range(8)}
    tx = optax.sgd(0.1)
    host = {
        "x": rng.normal(size=(256, 64)).astype(np.float32),
        "y": rng.normal(size=(256, 64)).astype(np.float32),
    }
    out, temps = [], []
    for r in (False, remat):
        step = jaxdev.make_train_step(_deep_loss, tx, jaxdev.Strategy.single(), remat=r)
        state, batch = step.init_state(params, tx), step.put_batch(host)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        temps.append(jaxdev.memory.plan(shapes, step=step, batch=batch).compiled.temp)
        for _ in range(3):
            state, _ = step(state, batch)
        out.append(jaxdev.to_host(state.params))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_array_equal(a, b)
    assert temps[1] <= temps[0]
    why = jaxdev.make_train_step(_deep_loss, tx).explain_memory(
        jax.eval_shape(lambda: jaxdev.TrainState.create(params, tx)), batch, limit=2**30
    )
    shown = {o.change: o for o in why.options}["remat=True"]
    assert shown.temp == temps[1] or remat is not True  # the option is this compiled figure


def test_remat_bad_values_are_named():
    for bad in ("yes", 1, object):
        with pytest.raises(jaxdev.UsageError, match="`remat` must be True, False or a policy"):
            jaxdev.make_train_step(loss_fn, TX, remat=bad)


def test_plan_with_a_step_counts_the_steps_layout_not_where_the_state_is_now():
    """An offloaded state given to a step that does not offload is planned on the devices."""
    mesh = jaxdev.data_mesh()
    plain, state, _ = _train(jaxdev.Strategy.sharded(mesh))
    _, host_state, _ = _train(jaxdev.Strategy.sharded(mesh, offload="opt_state"))
    batch = plain.put_batch(_batches(1)[0])
    assert jaxdev.memory.plan(host_state, mesh)["opt_state"] == 0  # as it is
    p = jaxdev.memory.plan(host_state, step=plain, batch=batch)  # as the step would hold it
    assert p["opt_state"] == jaxdev.memory.plan(state, step=plain, batch=batch)["opt_state"] > 0
    assert not p.host
