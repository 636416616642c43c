"""The step's hot path (issue 35): after a program is compiled, a call passing the state and
metrics the step returned walks no tree. Each check the walks made still fires on the call
where it applies, after three good calls on that fast path: a deleted leaf, one buffer
donated twice, a misplaced committed leaf, a new batch shape, a wrong-layout batch, a new
state structure under rules, an out-of-memory explained where it is read."""

from __future__ import annotations

import re
import sys
import threading
from array import array

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import _pending, _timeline
from jaxdev.train import _step

SGD = optax.sgd(0.1)
STRATEGIES = {
    "single": lambda: jaxdev.Strategy.single(),
    "pmap": lambda: jaxdev.Strategy.pmap(),
    "sharded": lambda: jaxdev.Strategy.sharded(),
}


def loss(params, batch):
    return (batch @ params["a"] + batch @ params["b"]).sum(-1)


def _warm(strategy, **kw):
    """A step, its state and metrics after three calls on the fast path (walks counted)."""
    step = jaxdev.make_train_step(loss, SGD, strategy, **kw)
    state = step.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))})
    batch = step.put_batch(np.ones((8, 4), np.float32))
    state, metrics = step(state, batch)
    for _ in range(3):
        state, metrics = step(state, batch, metrics)
    return step, state, metrics, batch


@pytest.mark.parametrize("name", [*STRATEGIES, "shard_map"])
def test_running_metrics_are_never_donated_and_each_returned_one_stays_exact(name):
    """The step donates the state only: every metrics object a call returned is readable after
    later calls (fast path and checked path: a fresh state copy), with its own running mean
    (plain SGD: each call's loss differs). Was: donated, DeletedArrayError."""
    make = STRATEGIES.get(name, lambda: jaxdev.Strategy.sharded(shard_map=True))
    step = jaxdev.make_train_step(loss, SGD, make())
    batch = step.put_batch(np.arange(32, dtype=np.float32).reshape(8, 4) / 32)
    init = {"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))}
    state, kept, losses, metrics = step.init_state(init), [], [], None
    for i in range(5):
        if i == 3:  # the checked path: a state the step did not return
            state = jax.tree.map(jnp.copy, state)
        _, alone = step(jax.tree.map(jnp.copy, state), batch)  # this call's loss by itself
        losses.append(alone.fetch()["loss"])
        state, metrics = step(state, batch, metrics)
        kept.append(metrics)
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    assert len(set(losses)) == 5
    for i, m in enumerate(kept):
        assert m.fetch()["loss"] == pytest.approx(np.mean(losses[: i + 1]), rel=1e-5)
        assert int(m["loss"].count) == 8 * (i + 1)


@pytest.fixture
def walks(monkeypatch):
    """Count the donation walk (check_donatable) per call."""
    count = [0]
    check = _step.check_donatable

    def counted(*args, **kwargs):
        count[0] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(_step, "check_donatable", counted)
    return count


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_state_the_step_returned_is_not_walked(name, walks):
    """Before: check_donatable walked every leaf of state and metrics at every call."""
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    assert walks[0] == 1  # the first call's state came from init_state
    state, metrics = step(state, batch, metrics)
    assert walks[0] == 1
    step(state._replace(step=state.step), batch, metrics)  # a state it did not return: walked
    assert walks[0] == 2


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_deleted_leaf_is_named_on_the_fast_path(name):
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    state.params["b"].delete()
    with pytest.raises(jaxdev.DeletedArrayError, match=r"state\.params\['b'\]"):
        step(state, batch, metrics)
    assert not state.params["a"].is_deleted()  # refused before it ran: nothing donated
    ev = jaxdev.make_eval_step(loss, STRATEGIES[name]())
    params = ev.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))})
    m = ev(params, batch)
    for _ in range(3):
        m = ev(params, batch, m)
    params["a"].delete()
    with pytest.raises(jaxdev.DeletedArrayError, match=r"state\['a'\].*eval step never deletes"):
        ev(params, batch, m)


@pytest.mark.parametrize("freed", [False, True], ids=["kept", "freed"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_one_buffer_donated_twice_is_refused_on_the_fast_path(name, freed, monkeypatch):
    """JAX 0.10.2 segfaults on several devices (0.12 raises a bare INVALID_ARGUMENT). jax 0.12
    on several devices may free the state's first leaves before it refuses (~1 call in 50
    under load), and on another device's thread even after its call returned (seen once in
    local CI, 2026-11-29): ``freed`` makes a freeing certain, and the leaves named deleted
    are those deleted when jaxdev looked, all deleted still. Before: the test looked for the
    message a453bc7 had changed, so it failed whenever JAX freed."""
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    state.params["b"] = state.params["a"]  # the returned state's dict changed in place
    check = _step.check_donatable

    def jax_freed(*args):  # what JAX frees (step, a and so b): gone before jaxdev looks
        if freed:
            state.step.delete()
            state.params["a"].delete()
        return check(*args)

    monkeypatch.setattr(_step, "check_donatable", jax_freed)
    pair = r"state\.params\['a'\] and state\.params"
    with pytest.raises(jaxdev.PlacementError, match=pair) as excinfo:
        step(state, batch, metrics)
    dead = [p for p, x in _step._named_leaves(state=state, metrics=metrics) if x.is_deleted()]
    told = re.search(r" (\d+) of its leaves are deleted \(([^)]*)\): ", str(excinfo.value))
    named = told.group(2).split(", ") if told else []
    assert len(named) >= 3 * freed and set(named) <= set(dead)  # step, a and b when freed
    assert int(told.group(1)) == len(named) if told else "deleted" not in str(excinfo.value)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_buffer_donated_twice_is_named_before_the_leaves_jax_freed(name):
    """JAX freeing the state before its refusal, made certain: a shared leaf and a deleted one.
    Before: DeletedArrayError (jax 0.12, CI under load), the shared leaf never named."""
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    state.params["b"] = state.params["a"]
    state.step.delete()
    gone = r"\['a'\] and .* 1 of its leaves are deleted \(state\.step\)"  # named: before, not
    with pytest.raises(jaxdev.PlacementError, match=gone):
        step(state, batch, metrics)


@pytest.mark.parametrize("returned", [True, False], ids=["fast", "walked"])
def test_a_state_leaf_passed_as_the_batch_is_named(returned):
    """The step donates the state and reads the batch: one buffer as both. Before: JAX's bare
    ValueError 'Attempt to use a buffer that was previously donated' (no leaf named)."""
    step = jaxdev.make_train_step(lambda p, b: (b @ p["w"]).sum(-1), SGD)
    state, metrics = step(step.init_state({"w": jnp.ones((4, 4))}), jnp.ones((4, 4)))
    state = state if returned else state._replace(step=state.step)
    with pytest.raises(jaxdev.PlacementError, match=r"state\.params\['w'\] and batch\b"):
        step(state, state.params["w"], metrics)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, metrics)))
    state, metrics = step(state, jnp.ones((4, 4)), metrics)  # the next call runs
    assert int(state.step) == 2


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_a_misplaced_committed_leaf_is_moved_on_the_fast_path(name):
    """Before, single: JAX's bare 'Received incompatible devices for jitted computation'."""
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    placed = state.params["a"].sharding
    state.params["a"] = jax.device_put(state.params["a"], jax.devices()[3])
    host = np.ones((8, 4), np.float32)
    for misplaced in (jax.device_put(host, jax.devices()[2]), batch):
        state, metrics = step(state, misplaced, metrics)
        assert state.params["a"].sharding == placed
    assert int(state.step) == 6
    assert float(metrics.fetch()["loss"]) == pytest.approx(float(metrics.fetch()["loss"]))
    moved = jax.device_put(state, jax.devices()[5])  # the whole state, not the one it returned
    state, metrics = step(moved, batch, metrics)
    assert state.params["b"].sharding == placed and int(state.step) == 7


def test_a_new_batch_shape_is_checked_against_the_budget_before_it_runs(monkeypatch):
    checked = []
    monkeypatch.setattr(_step, "check_step_memory", lambda spec, j, args: checked.append(args))
    step, state, metrics, batch = _warm(jaxdev.Strategy.single(), memory_limit=2**30)
    assert len(checked) == 2  # the programs without and with running metrics
    state, metrics = step(state, step.put_batch(np.ones((16, 4), np.float32)), metrics)
    assert len(checked) == 3 and checked[-1][1].shape == (16, 4)
    state, metrics = step(state, batch, metrics)
    assert len(checked) == 3


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_state_of_new_shapes_is_a_new_program_checked_against_the_budget(name):
    """A program's key held the batch's shapes but not the state's: after a small model, a
    state 4096x larger (the same structure: a notebook's next model size) ran with no check
    against `memory_limit` (jax.jit retraced it silently), and its later out-of-memory was
    explained with the old shapes. Now it is refused before it runs, as a fresh step does."""
    limit = 2**20  # 1 MiB a device
    step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name](), memory_limit=limit)
    batch = step.put_batch(np.ones((8, 4), np.float32))
    state, metrics = step(step.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))}), batch)
    state, metrics = step(state, batch, metrics)  # the fast path's programs are known
    big = step.init_state({"a": jnp.ones((4, 2**16)), "b": jnp.ones((4, 2**16))})
    with pytest.raises(jaxdev.MemoryPlanError, match=r"needs .* MiB per device"):
        step(big, step.put_batch(np.ones((8, 4), np.float32)), metrics)
    state, metrics = step(state, batch, metrics)  # the small model trains on
    assert int(state.step) == 3


def test_a_wrong_layout_batch_is_refused_on_the_fast_path():
    step, state, metrics, batch = _warm(jaxdev.Strategy.sharded())
    stacked = np.ones((8, 2, 4), np.float32)  # rows of (2, 4), or 8 devices x 2 rows?
    with pytest.raises(jaxdev.ShardingError, match="reads two ways"):
        step(state, stacked, metrics)


def test_a_new_state_structure_under_rules_compiles_its_own_layout():
    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    step, state, metrics, batch = _warm(jaxdev.Strategy.sharded(mesh, rules="fsdp", min_size=8))
    state.params["c"] = jnp.zeros((4096,))  # changed in place: the key's structure is stale
    state, metrics = step(state, batch, metrics)
    assert state.params["c"].sharding.spec == P("fsdp")
    assert int(state.step) == 5


def test_an_out_of_memory_read_later_names_the_fast_path_call():
    """The explanation recorded for a call on the fast path is its program's: its batch."""
    step, state, metrics, batch = _warm(jaxdev.Strategy.single())
    wide = step.put_batch(np.ones((24, 4), np.float32))
    state, metrics = step(state, wide, metrics)
    for _ in range(2):
        state, metrics = step(state, wide, metrics)
    assert _pending._PENDING[step][1] is step._programs[_last_program(step)][0]
    err = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes.")
    text = str(step._programs[_last_program(step)][0](err, "fetch"))
    assert "the train step ran out of device memory" in text and "24 rows" in text


def _last_program(step):
    return [p for p in step._programs if p[0][1] and p[2][0] == (24, 4)][0]


def test_the_step_meter_hears_each_dispatch_and_can_ask_its_flops(monkeypatch):
    for name, value in (("listeners", [object()]), ("times", array("d")), ("runs", []),
                        ("newest", (0, None)), ("_run", (None, None)),
                        ("_thread", threading.get_ident()), ("done", array("b"))):
        monkeypatch.setattr(_timeline, name, value)  # a step meter listens
    step, state, metrics, batch = _warm(jaxdev.Strategy.single())
    runs, times = _timeline.runs, list(_timeline.times)
    assert [(i, c) for i, _, _, c in runs if c] == [(0, True), (1, True)]  # no metrics, metrics
    assert all(r[1] is step for r in runs) and len(times) == 8 and times == sorted(times)
    assert _timeline.newest[0] == 4 and int(_timeline.newest[1]) == 4  # the step counter
    flops = step.cost(runs[-1][2])
    assert flops is None or flops > 0
    assert step.cost(runs[-1][2]) == flops  # computed once


def flat_loss(params, batch):
    """Any batch shape: each example's values summed."""
    return batch.reshape(batch.shape[0], -1).sum(-1) * params["a"].sum()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_batch_like_one_checked_before_skips_the_batch_checks(name, monkeypatch):
    """Before: _raw_batch (layout probe, even rows, groups) and the program's signature ran
    at every call; now once per batch structure, shapes and placement."""
    raw = []
    check = _step._Step._raw_batch
    monkeypatch.setattr(_step._Step, "_raw_batch", lambda s, b: raw.append(b) or check(s, b))
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    before = len(raw)
    for i in range(3):  # new objects, the same structure, shapes and placement
        state, metrics = step(state, step.put_batch(np.full((8, 4), i, np.float32)), metrics)
    assert len(raw) == before and int(state.step) == 7


def _placed_stacked(strategy):
    """A batch (8, 2, 4) placed as the strategy takes it (pmap: its stacked layout)."""
    host = np.ones((8, 2, 4), np.float32)
    if strategy == "pmap":
        return jaxdev.Strategy.pmap().put_batch(host.reshape(16, 4))
    return jax.device_put(host, jax.devices()[0])


CASES = {  # (strategy, step options, a good batch, a bad one of the same shapes, error)
    "single, stacked layout from the host": (
        "single", {}, lambda: _placed_stacked("single"), np.ones((8, 2, 4), np.float32),
        jaxdev.ShardingError, "reads two ways",
    ),
    "pmap, stacked layout from the host": (
        "pmap", {}, lambda: _placed_stacked("pmap"), np.ones((8, 2, 4), np.float32),
        jaxdev.ShardingError, "reads two ways",
    ),
    "sharded, uneven rows": (
        "sharded", {}, lambda: np.ones((16, 4), np.float32), np.ones((12, 4), np.float32),
        jaxdev.UsageError, "do not divide",
    ),
    "single, groups of another size": (
        "single", {"steps_per_call": 2}, lambda: np.ones((2, 16, 4), np.float32),
        np.ones((3, 16, 4), np.float32), jaxdev.UsageError, "grouped as",
    ),
    "sharded, groups of another size": (
        "sharded", {"steps_per_call": 2}, lambda: np.ones((2, 16, 4), np.float32),
        np.ones((3, 16, 4), np.float32), jaxdev.UsageError, "grouped as",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_batch_check_fires_after_good_calls_on_the_fast_path(case):
    name, kw, good, bad, error, match = CASES[case]
    step = jaxdev.make_train_step(flat_loss, SGD, STRATEGIES[name](), **kw)
    state = step.init_state({"a": jnp.ones(())})
    state, metrics = step(state, good())
    for _ in range(3):  # the signature of the good batch remembered as checked
        state, metrics = step(state, good(), metrics)
    with pytest.raises(error, match=match):
        step(state, bad, metrics)
    state, metrics = step(state, good(), metrics)  # the step goes on
    assert int(state.step) == 5 * kw.get("steps_per_call", 1)


_DONATED_ELSEWHERE = """
import jaxdev
jaxdev.testing.use_fake_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np, optax
def loss(params, batch):
    return (batch @ params["a"] + batch @ params["b"]).sum(-1)
def named(label, fn):
    try:
        fn()
        print(label, "ran")
    except jaxdev.DeletedArrayError as e:
        print(label, str(e).split("leaves: ")[1].split(". ")[0])
bump = jax.jit(lambda t: jax.tree.map(lambda x: x * 1, t), donate_argnums=0)
for name in ("single", "pmap", "sharded"):
    make = getattr(jaxdev.Strategy, name)
    step = jaxdev.make_train_step(loss, optax.sgd(0.1), make())
    ev = jaxdev.make_eval_step(loss, make())
    state = step.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))})
    batch = step.put_batch(np.ones((8, 4), np.float32))
    for _ in range(4):
        state, metrics = step(state, batch)
    params = state.params
    m = ev(params, batch)
    m = ev(params, batch, m)
    state, metrics = step(state, batch, metrics)  # (b) donates the params ev took
    named(name + " eval", lambda: ev(params, batch, m))
    state, metrics = step(state, batch, metrics)
    saved = jax.tree.map(jnp.copy, state)
    bump(state.params)  # (a) the user's jit donates the params the step returned
    named(name + " state", lambda: step(state, batch, metrics))
    state, metrics = step(saved, batch)
    state, metrics = step(state, batch, metrics)
    other = step.put_batch(np.ones((8, 4), np.float32))
    bump(other)  # (c) a batch like the last ones, donated by the user's jit
    named(name + " batch", lambda: step(state, other, metrics))
"""


def test_a_leaf_another_jit_donated_is_named_not_a_segfault():
    """Before (jax 0.10.2, pmap and sharded): segfault on the fast path, a leaf another
    ``jax.jit(..., donate_argnums=0)`` donated; a deleted batch leaf named no batch path."""
    from conftest import run_python

    proc = run_python(_DONATED_ELSEWHERE, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = []
    for name in ("single", "pmap", "sharded"):
        expected += [
            f"{name} eval state['a'], state['b']",
            f"{name} state state.params['a'], state.params['b']",
            f"{name} batch batch",
        ]
    assert proc.stdout.splitlines() == expected


_STATE_AS_BATCH = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np, optax, jaxdev

def loss(params, batch):
    return (batch @ params["a"]).sum(-1) + 0 * params["c"].sum()

step = jaxdev.make_train_step(loss, optax.sgd(0.1), jaxdev.Strategy.sharded(rules="fsdp"))
state = step.init_state({"a": jnp.ones((4, 2)), "c": jnp.ones((512, 4))})
batch = step.put_batch(np.ones((512, 4), np.float32))  # laid out as the fsdp leaf 'c'
state, metrics = step(state, batch)
state, metrics = step(state, batch, metrics)
for given in (state, state._replace(step=state.step)):  # the fast path, then walked
    try:
        step(given, given.params["c"], metrics)
    except jaxdev.PlacementError as err:
        print(str(err).split(": ")[1].split(" are ")[0])
"""


def test_an_fsdp_leaf_passed_as_the_batch_is_named_not_a_segfault():
    """A state leaf laid out as the batch goes in as it is, donated and read at once. Before
    (jax 0.10.2, several devices): segfault; jax 0.12: named on the error path."""
    from conftest import run_python

    proc = run_python(_STATE_AS_BATCH, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["state.params['c'] and batch"] * 2

def test_a_refused_fast_call_beats_the_watchdog_once(monkeypatch):
    """Before: a fast-path call JAX refused (a leaf laid out otherwise) and its rerun each
    counted a step on the hang watchdog: 2 for one call."""
    from jax.sharding import NamedSharding

    mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
    step = jaxdev.make_train_step(
        lambda p, b: (b @ p["w"]).sum(-1), SGD, jaxdev.Strategy.sharded(mesh, rules="fsdp")
    )
    state = step.init_state({"w": jnp.ones((4096, 2))})
    batch = step.put_batch(np.ones((8, 4096), np.float32))
    state, metrics = step(state, batch)
    state, metrics = step(state, batch, metrics)
    beats = []
    monkeypatch.setattr(_step, "step_call", lambda *a, **k: beats.append(a))
    state.params["w"] = jax.device_put(jnp.ones((4096, 2)), NamedSharding(mesh, P()))
    state, _ = step(state, batch, metrics)
    assert state.params["w"].sharding.spec == P("fsdp", None)
    assert len(beats) == 1


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_users_trace_error_on_the_fast_path_traces_once(name):
    """Before: the user's TypeError raised while tracing a new batch shape was taken for
    JAX's refusal, and the rerun traced ``loss_fn`` a second time."""
    traces = []

    def traced_loss(params, batch):
        traces.append(batch.shape)
        return (batch @ params["a"]).sum(-1)

    step = jaxdev.make_train_step(traced_loss, SGD, STRATEGIES[name]())
    state = step.init_state({"a": jnp.ones((4, 2))})
    batch = step.put_batch(np.ones((8, 4), np.float32))
    state, metrics = step(state, batch)
    state, metrics = step(state, batch, metrics)
    traces.clear()
    with pytest.raises(TypeError, match="dot_general"):
        step(state, step.put_batch(np.ones((8, 5), np.float32)), metrics)
    assert len(traces) == 1


def test_a_deleted_eval_output_breaks_no_later_call(monkeypatch):
    """Before (issue-35 review): an eval step's token is its metrics' first leaf, which the user
    holds. Once it is deleted (donated as `metrics` to a train step, or `.delete()`d),
    _pending asks it is_ready(): every later call of the eval step raises a bare
    "INVALID_ARGUMENT: Array has been deleted" at its entry, and any other step's call
    raises it from record() AFTER it ran: a train step has donated the state and its new
    state is lost. /tmp/attack35/item3_deleted_token.py."""
    monkeypatch.setattr(_pending, "_PENDING", {})  # nothing left behind for other tests
    tx = optax.sgd(0.1)
    loss = lambda p, b: (b @ p["w"])[:, 0] ** 2  # noqa: E731
    train = jaxdev.make_train_step(loss, tx, jaxdev.Strategy.single())
    ev = jaxdev.make_eval_step(loss, jaxdev.Strategy.single())
    state = train.init_state({"w": jnp.ones((4, 1))}, tx)
    batch = train.put_batch(np.ones((8, 4), np.float32))
    metrics = jax.block_until_ready(ev(state, batch))
    jax.tree.leaves(metrics)[0].delete()  # or: train(state, batch, metrics) donates it
    state, _ = train(state, batch)  # ran, donated the state: must return the new one
    assert int(state.step) == 1
    ev(state, batch)  # the eval step still works


def _python_calls(step, state, batch, metrics) -> int:
    """The Python functions one call of ``step`` runs (sys.setprofile's "call" events)."""
    calls = [0]

    def count(frame, event, arg):
        calls[0] += event == "call"

    sys.setprofile(count)
    try:
        step(state, batch, metrics)
    finally:
        sys.setprofile(None)
    return calls[0]


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_a_loops_call_runs_no_python_per_leaf(name):
    """Before: the fast path read four Python properties of each batch leaf (and hashed its
    sharding in Python). Now a call of 2 or 40 batch leaves, of a state of 2 or 100 leaves,
    runs the same Python (pmap still reads each batch leaf's placement)."""

    def tree_loss(params, batch):
        x = sum(batch.values())
        return sum((x @ w).sum(-1) for w in params.values())

    counts = {}
    for n_params, n_batch in ((2, 2), (2, 40), (100, 2)):
        step = jaxdev.make_train_step(tree_loss, SGD, STRATEGIES[name]())
        state = step.init_state({f"w{i}": jnp.ones((4, 2)) for i in range(n_params)})
        batch = step.put_batch({f"x{i}": np.ones((8, 4), np.float32) for i in range(n_batch)})
        state, metrics = step(state, batch)
        for _ in range(3):
            state, metrics = step(state, batch, metrics)
        counts[n_params, n_batch] = _python_calls(step, state, batch, metrics)
    assert len(set(counts.values())) == 1, counts


def _odd_batches():
    """Batches of a loop's shapes (16, 4) (or (8, 4): rows = the device count) and dtype,
    laid out otherwise than its put_batch'ed ones (helper-53's attack on 14909e6)."""
    from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding

    devs, x = jax.devices(), np.arange(64, dtype=np.float32).reshape(16, 4)
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    other, host = NamedSharding(jax.sharding.Mesh(np.array(devs), ("b",)), P("b")), "pinned_host"
    return {
        "device 3": lambda: jax.device_put(x, devs[3]),
        "replicated": lambda: jax.device_put(x, NamedSharding(mesh, P())),
        "explicit mesh": lambda: jax.device_put(x, NamedSharding(explicit, P("data"))),
        "pinned host": lambda: jax.device_put(x, SingleDeviceSharding(devs[0], memory_kind=host)),
        "uncommitted, reads two ways": lambda: jnp.ones((8, 4)),
        "another mesh's stacked rows": lambda: jax.device_put(np.ones((8, 4), np.float32), other),
    }


@pytest.mark.parametrize("odd", sorted(_odd_batches()))
@pytest.mark.parametrize("name", ["single", "sharded"])
@pytest.mark.parametrize("disable_jit", [False, True])
def test_a_batch_laid_out_otherwise_after_a_loop_is_taken_as_a_fresh_step_takes_it(
    name, odd, disable_jit
):
    """The fast path keys a batch by its abstract values and leaves its devices to jit. Before
    (14909e6): an Explicit-mesh or pinned-host batch of the loop's shapes got JAX's raw
    error, a batch that reads two ways trained silently, one jit refused was traced again
    (the user's loss re-run), and under jax.disable_jit a misplaced one raised."""
    rows = (8, 4) if "rows" in odd or "two ways" in odd else (16, 4)

    traced = [0]

    def counted(params, batch):
        traced[0] += 1
        return loss(params, batch)

    def outcome(calls, place=False):
        step = jaxdev.make_train_step(counted, SGD, STRATEGIES[name]())
        state = step.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))})
        loop, metrics = step.put_batch(np.ones(rows, np.float32)), None
        for _ in range(calls):
            state, metrics = step(state, loop, metrics)
        batch = _odd_batches()[odd]()
        batch = step.put_batch(np.asarray(batch)) if place else batch  # placed as the loop's
        traced[0] = 0
        try:
            with jax.disable_jit(disable_jit):
                _, metrics = step(state, batch, metrics)
            return float(metrics.fetch()["loss"]), traced[0]
        except Exception as err:  # noqa: BLE001 - under disable_jit an Explicit mesh's: JAX's
            return type(err).__name__, 0

    got, fresh = outcome(4), outcome(0)
    assert type(got[0]) is type(fresh[0]) and (isinstance(got[0], float) or got == fresh)
    if isinstance(got[0], float):  # the numbers of the batch placed as the loop's; the loss
        assert got[0] == outcome(4, place=True)[0]  # not traced again (a refusing jit did)
        assert got[1] == 0 or disable_jit  # (then the loss runs at each call, once)


def test_a_state_leaf_laid_out_otherwise_as_the_batch_after_a_loop_is_copied():
    """A fresh sharded step moves a batch that is a (replicated) state leaf into its own
    buffer; after a loop too (helper-53: a fast path keyed without placement raised
    PlacementError 'would donate an array it also reads')."""
    name = "sharded"

    def bloss(params, batch):
        return ((batch + 0 * params["b"]) @ params["a"]).sum(-1)

    def outcome(calls):
        step = jaxdev.make_train_step(bloss, SGD, STRATEGIES[name]())
        state = step.init_state({"a": jnp.ones((4, 2)), "b": jnp.full((16, 4), 3.0)})
        loop, metrics = step.put_batch(np.ones((16, 4), np.float32)), None
        for _ in range(calls):
            state, metrics = step(state, loop, metrics)
        try:
            _, metrics = step(state, state.params["b"], metrics)
            return float(metrics.fetch()["loss"])
        except jaxdev.JaxdevError as err:
            return type(err).__name__

    assert isinstance(outcome(0), float) and isinstance(outcome(4), float)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_loop_of_uneven_batches_takes_the_fast_path(name, monkeypatch):
    """Before: a Padded batch (put_batch of rows the devices do not divide) never took the
    fast path (its size, a Python int, is a leaf): every call of an uneven loop was checked.
    The numbers are the checked path's."""
    prepared = []
    prepare = _step._Step._prepare
    monkeypatch.setattr(_step._Step, "_prepare", lambda s, *a: prepared.append(1) or prepare(s, *a))

    def run(fast):
        step = jaxdev.make_train_step(loss, SGD, STRATEGIES[name]())
        state, metrics = step.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))}), None
        for i in range(6):
            batch = step.put_batch(np.full((12, 4), i, np.float32))  # 12 rows: padded to 16
            state = state if fast else jax.tree.map(jnp.copy, state)  # a copy: checked
            state, metrics = step(state, batch, metrics)
        return float(metrics.fetch()["loss"]), jax.device_get(state.params)

    fast = run(True)
    assert len(prepared) == 3  # two programs compiled (no metrics, metrics), one remembered
    assert fast[0] == run(False)[0] and len(prepared) == 9
    jax.tree.map(np.testing.assert_array_equal, fast[1], run(False)[1])


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_step_waits_on_its_own_output_not_the_users_metrics(name):
    """The metrics a call returns are the user's: donated to their own jit (or deleted), they
    must leave the step an output to wait on (the in-flight bound, a later error, the meter).
    Was (c976ae0): the token was the metrics' first leaf, deleted with them."""
    step, state, metrics, batch = _warm(STRATEGIES[name]())
    mine = jax.jit(lambda m: jax.tree.map(lambda x: x + 0, m), donate_argnums=0)
    for _ in range(3):
        state, metrics = step(state, batch, metrics)
        metrics = mine(metrics)  # the returned metrics, donated by the user
    entry = _pending._PENDING[step]
    assert not entry[0].is_deleted()  # what a failure of the last call is read from
    assert not any(t.is_deleted() for t in step._inflight)
    assert int(metrics["loss"].count) == 8 * 7


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_an_eval_step_waits_on_its_own_output_not_the_users_metrics(name, monkeypatch):
    """An eval step's metrics are the user's too: donated to their own jit at each call, they
    must leave the step an output to wait on. Was: its token was the metrics' first leaf, so
    the multi-device CPU in-flight bound waited on deleted arrays (its wait raised, nothing
    bounded): with the calls queued unbounded XLA's collectives deadlocked and the process
    aborted ('Termination timeout for all reduce', 1 run in 30 of 300 calls, jax 0.10.2;
    /tmp/crash311/evrace.py), and a later failure or the meter had nothing to look at."""
    monkeypatch.setattr(_pending, "_PENDING", {})  # nothing left behind for other tests
    strategy = STRATEGIES[name]()
    ev = jaxdev.make_eval_step(loss, strategy)
    params = ev.init_state({"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))})
    batch = ev.put_batch(np.ones((8, 4), np.float32))
    mine = jax.jit(lambda m: jax.tree.map(lambda x: x + 0, m), donate_argnums=0)
    metrics = None
    for _ in range(12):  # past the in-flight bound (8)
        metrics = mine(ev(params, batch, metrics))  # the returned metrics, donated at once
    assert not _pending._PENDING[ev][0].is_deleted()  # what a failure of the last call is read from
    assert len(ev._inflight) == (8 if ev._bounded else 0)
    assert not any(t.is_deleted() for t in ev._inflight)  # each wait of the bound a real one
    assert int(metrics["loss"].count) == 8 * 12


@pytest.mark.parametrize("first", ["minor axis sharded", "prng key", "python number"])
def test_an_eval_steps_token_takes_any_first_metric_leaf(first):
    """An eval step runs whatever the user put first in its metrics: its token is jaxdev's own
    (the count of the rows it read), never computed from a metric leaf. Was (4c93ef0):
    ``ravel(leaf)[:1]``, a reshape an Explicit mesh refuses for a leaf sharded along a minor
    axis (a ShardingTypeError from jaxdev's own code, for metrics that ran before), and a cast
    a PRNG key refuses (/tmp/attack47/e2.py, e1.py key); a Python number a custom Metric holds
    has no dtype (e4.py)."""
    import dataclasses

    from jax.sharding import AxisType

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Keep(jaxdev.metrics.Metric):  # the last batch's value, kept as it is
        v: jax.Array

        def merge(self, other):
            return other

        def reduce(self, axis=None):
            return self

        def _compute(self, xp):
            return self.v

    def kept(params, batch):
        h = batch @ params["a"]  # (8@data, 2)
        value = {"minor axis sharded": h.T, "prng key": jax.random.key(0)}.get(first, 1.5)
        return loss(params, batch), {"a_kept": Keep(value)}  # "a_kept" < "loss": first leaf

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    strategy = jaxdev.Strategy.sharded(mesh) if first == "minor axis sharded" else None
    ev = jaxdev.make_eval_step(kept, strategy, has_aux=True)
    params = {"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))}
    batch, metrics = ev.put_batch(np.ones((8, 4), np.float32)), None
    for _ in range(3):
        metrics = ev(params, batch, metrics)
    assert float(metrics["loss"].fetch()) == 16.0
    assert int(metrics["loss"].count) == 8 * 3
