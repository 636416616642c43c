"""jaxdev.meter.StepMeter: known answers (input waits, syncs, compute, compiles, saves, eval)."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdev
from jaxdev import _timeline
from jaxdev.meter import StepMeter
from jaxdev.meter._meter import peak_flops


def _loss(params, batch):
    h = batch["x"]
    for _ in range(3):
        h = jnp.tanh(h @ params["w"])
    return jnp.mean(h**2, axis=1)  # one loss per example


def _setup(strategy=None, width=8, rows=8):
    strategy = strategy or jaxdev.Strategy.single()
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(_loss, tx, strategy)
    state = step.init_state({"w": jnp.full((width, width), 0.01)}, tx)
    batch = step.put_batch({"x": np.ones((rows, width), np.float32)})
    for _ in range(2):  # compiled before any meter (the second: the step's own state)
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    return step, state, batch, metrics


def _until_done(tree, meter):
    """Wait for the device to finish ``tree`` without a sync the meter sees (``is_ready``),
    then for the meter's look in progress, if any: its watcher, under load late to run, would
    stamp the end it waited for after this returns."""
    while not all(x.is_ready() for x in jax.tree.leaves(tree)):
        time.sleep(1e-4)
    with meter._lock:  # a look that began after the device finished found it done: no stamp
        pass


def test_a_loader_sleeping_a_known_time_is_input_wait():
    """Each sleep begins once the step before it is done: on a loaded 2-core machine a tiny
    step takes up to ~50 ms to finish and be seen finishing (device time, not input: input
    was 10-20% short in 4 of 8 runs at load 10)."""
    step, state, batch, _ = _setup()
    slept = []

    def loader(n):
        for _ in range(n):
            t = time.perf_counter()
            time.sleep(0.02)
            slept.append(time.perf_counter() - t)
            yield batch

    with StepMeter(examples_per_step=8) as m:
        for b in m.inputs(loader(15)):
            state, _ = step(state, b)
            _until_done(state, m)
    r = m.report()
    assert r.steps == 15 and r.rates["examples/s"] == pytest.approx(8 * r.rates["steps/s"])
    assert r.seconds["input"] == pytest.approx(sum(slept), rel=0.1), r
    assert sum(r.seconds.values()) == pytest.approx(r.wall)


def test_an_eval_only_loop_counts_its_eval_steps():
    """Was: steps 0, steps/s and examples/s 0 for a block that ran only an eval step."""
    step, state, batch, _ = _setup()
    ev = jaxdev.make_eval_step(_loss, jaxdev.Strategy.single())
    jax.block_until_ready(ev(state, batch))  # compiled before the meter
    with StepMeter(examples_per_step=8) as m:
        for _ in range(6):
            metrics = ev(state, batch)
    r = m.report()
    assert r.steps == 6 and r.rates["steps/s"] == pytest.approx(6 / r.wall)
    assert r.rates["examples/s"] == pytest.approx(8 * r.rates["steps/s"])
    assert np.isfinite(metrics.fetch()["loss"])


def test_a_prefetchers_waits_are_input_without_wrapping():
    step, state, batch, _ = _setup()

    def loader(n):
        for _ in range(n):
            time.sleep(0.02)
            yield {"x": np.ones((8, 8), np.float32)}

    with StepMeter() as m:
        for b in jaxdev.prefetch_to_device(loader(10), 2, jax.devices()[0]):
            state, _ = step(state, b)
    assert m.report().seconds["input"] > 0.1, m.report()


def _sleep(seconds, into):
    t = time.perf_counter()
    time.sleep(seconds)
    into.append(time.perf_counter() - t)


@pytest.mark.parametrize("where", ["after_an_input_wait", "before_a_sync", "before_leaving"])
def test_host_work_the_meter_cannot_see_is_other(where):
    """The host's own work (a sleep here) while the device waits is "other". It went to input
    when it followed an input wait (the wait ended a switch interval before the step ended),
    to sync when a sync that found the step done came after it, and to the step when it came
    before leaving the block (leaving stamped a step done long before as ending then).

    Each sleep begins once the device is done and the meter saw it (``_until_done``): on a
    loaded 2-core machine a tiny step takes up to ~50 ms (rarely more) to finish and be seen
    finishing, device time that ran into the sleeps (3 in 4 runs failed at load 8). The
    block's time outside the sleeps and input waits (dispatch, that wait, reading the
    metrics: ~3 ms unloaded; the scheduler's pauses under load) may be the step's or other:
    it widens the bounds by itself."""
    step, state, batch, metrics = _setup()
    float(metrics.compute()["loss"])  # its eager ops compiled outside the meter
    inputs, work = [], []

    def loader(n):
        for _ in range(n):
            _sleep(0.01, inputs)
            yield batch

    with StepMeter() as m:
        for b in m.inputs(loader(8)) if where == "after_an_input_wait" else [batch] * 8:
            state, metrics = step(state, b)
            if where != "before_leaving":
                _until_done((state, metrics), m)
                _sleep(0.02, work)
                if where == "before_a_sync":
                    float(metrics.compute()["loss"])  # the step ended long ago: no wait
        if where == "before_leaving":
            _until_done((state, metrics), m)
            _sleep(0.06, work)
    r, slept = m.report(), sum(work)
    aside = r.wall - slept - sum(inputs)  # neither slept nor waiting for input
    assert 0.85 * slept <= r.seconds["other"] <= 1.15 * slept + aside, (r, aside)
    assert r.seconds["input"] == pytest.approx(sum(inputs), rel=0.15, abs=1e-3), r
    assert r.seconds["sync"] + r.seconds["step"] < 0.1 * slept + aside, (r, aside)
    assert sum(r.seconds.values()) == pytest.approx(r.wall)


def test_float_loss_each_step_is_a_host_sync_named_by_its_line():
    step, state, batch, metrics = _setup(width=512, rows=512)  # float() waits ~10 ms: sync-bound
    float(metrics.compute()["loss"])  # its eager ops compiled outside the meter
    with StepMeter() as m:
        for _ in range(10):
            state, metrics = step(state, batch)
            loss = float(metrics.compute()["loss"])  # the sync
    line = inspect.currentframe().f_lineno - 1
    r = m.report()
    assert loss > 0
    assert all(f" at test_meter.py:{line} " in where for where, _, _ in r.syncs), r.syncs
    assert ("float()", 10) in [(where.split()[0], n) for where, n, _ in r.syncs], r.syncs
    assert r.seconds["sync"] > 0 and r.seconds["sync"] >= r.seconds["other"], r


def test_a_compute_bound_loop_keeps_the_device_busy():
    step, state, batch, _ = _setup(width=512, rows=1024)  # ~50 ms a step, dispatch ~0.1 ms
    with StepMeter() as m:
        for _ in range(6):
            state, _ = step(state, batch)
    r = m.report()
    assert r.seconds["step"] >= 0.9 * r.wall, r
    assert r.seconds["compile"] == 0 and not r.syncs


def test_a_new_batch_shape_mid_loop_is_compile():
    step, state, batch, _ = _setup()
    wider = {"x": jnp.ones((16, 8))}
    with StepMeter() as m:
        for i in range(6):
            state, _ = step(state, wider if i == 3 else batch)
    r = m.report()
    assert r.seconds["compile"] > 0.5 * (r.wall - r.seconds["step"]), r  # most of the idle
    with StepMeter() as again:  # the no-alarm case: both shapes compiled
        for i in range(6):
            state, _ = step(state, wider if i == 3 else batch)
    assert again.report().seconds["compile"] == 0, again.report()


def test_a_checkpoint_save_and_an_eval_step_are_named(tmp_path):
    step, state, batch, _ = _setup()
    evaluate = jaxdev.make_eval_step(_loss, jaxdev.Strategy.single())
    jax.block_until_ready(evaluate(state, batch))
    with jaxdev.Checkpointer(str(tmp_path), async_=False) as ckpt, StepMeter() as m:
        for i in range(1, 7):
            state, _ = step(state, batch)
            if i % 3 == 0:
                ckpt.save(i, state)
                evaluate(state, batch)
    r = m.report()
    assert r.seconds["checkpoint"] > 0 and r.seconds["eval"] > 0, r


def test_a_checkpoint_saves_own_reads_are_not_listed_as_the_users_syncs(tmp_path):
    """Before: the reads inside `jaxdev.save` / `Checkpointer.save` (its checksum's
    `jax.device_get`, its writer's `np.asarray`) were listed as host-sync sites at the user's
    save line, often above their real syncs, while their seconds were the checkpoint share."""
    step, state, batch, metrics = _setup()
    float(metrics.compute()["loss"])  # its eager ops compiled outside the meter
    with jaxdev.Checkpointer(str(tmp_path / "c"), async_=False) as ckpt, StepMeter() as m:
        for i in range(1, 5):
            state, metrics = step(state, batch)
            if i == 2:
                jaxdev.save(str(tmp_path / "one"), state)
                ckpt.save(i, state)
        loss = float(metrics.compute()["loss"])  # the user's one sync
    line = inspect.currentframe().f_lineno - 1
    r = m.report()
    assert loss > 0 and r.seconds["checkpoint"] > 0, r
    assert ("float()", 1) in [(w.split()[0], n) for w, n, _ in r.syncs], r.syncs
    assert all(f" at test_meter.py:{line} " in w for w, _, _ in r.syncs), r.syncs  # float and
    # the wait of `compute()` when the step still runs: both the user's, at their line
    assert sum(r.seconds.values()) == pytest.approx(r.wall)


def test_the_meter_adds_no_host_sync():
    step, state, batch, _ = _setup()
    with jaxdev.no_host_sync(max_waits=0, max_compiles=0) as counter:
        with StepMeter() as m:
            for _ in range(10):
                state, _ = step(state, batch)
    r = m.report()  # after the block: its FLOPs may compile the step's cost analysis
    assert r.steps == 10 and counter.device_to_host == counter.waits == 0


def test_the_watcher_wakes_once_per_batch_of_steps_not_per_step():
    step, state, batch, _ = _setup()
    with StepMeter() as m:  # a dispatch-bound loop (~0.1 ms a step)
        for _ in range(300):
            state, _ = step(state, batch)
    r, looks = m.report(), [t for _, t in m._looks]  # no syncs: the watcher's looks only
    assert r.steps == 300 and len(looks) < 300 / 4, len(looks)
    assert all(b - a >= 1e-3 for a, b in zip(looks, looks[1:-1]))  # >= 1 ms apart (not exit's)
    assert 0 <= r.seconds["step"] <= r.wall  # a step seen done: ended by its dispatch at most


def test_a_metered_step_leaves_no_object_for_the_garbage_collector():
    step, state, batch, _ = _setup()

    def tracked(steps):  # objects the garbage collector walks, made by a metered loop
        nonlocal state
        gc.collect()
        gc.disable()  # nothing untracked or freed by a collection meanwhile
        try:
            before = len(gc.get_objects())
            with StepMeter() as m:
                for _ in range(steps):
                    state, _ = step(state, batch)
            made = len(gc.get_objects()) - before
            assert m.report().steps == steps  # the meter held its record until here
            return made
        finally:
            gc.enable()

    tracked(10)
    assert tracked(600) - tracked(100) < 50  # a record per step would be 500 more


def test_a_step_is_let_go_when_the_last_meter_leaves():
    """Before (issue-35 read-through): _timeline.runs kept every metered step (its compiled
    programs, its device buffers) alive until 2**20 more metered calls."""
    step, state, batch, _ = _setup()
    with StepMeter() as outer:
        with StepMeter() as inner:
            state, _ = step(state, batch)
        assert any(run[1] is step for run in _timeline.runs)  # the outer one still listens
        state, _ = step(state, batch)
    assert (inner.report().steps, outer.report().steps) == (1, 2)  # their own records
    assert not _timeline.runs and _timeline.newest[1] is None


def test_a_look_after_a_meter_left_adds_nothing_to_it():
    """The watcher looks at the meters it listed: one that left meanwhile was given a step of
    the next meter's, and its report raised ZeroDivisionError (CI, nested meters under load)."""
    step, state, batch, _ = _setup()
    with StepMeter() as outer:
        with StepMeter() as inner:
            state, _ = step(state, batch)
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        for _ in range(100):  # the watcher, with its list from before inner left, polling
            if not inner._look():  # until it takes the step (a ready one: within 50 ms)
                break
            time.sleep(0.002)
    assert (inner.report().steps, outer.report().steps) == (1, 2)


def test_one_watcher_thread_serves_every_meter():
    step, state, batch, _ = _setup()
    with StepMeter() as outer, StepMeter() as inner:
        for _ in range(5):
            state, _ = step(state, batch)
        names = [t.name for t in threading.enumerate()]
    assert names.count("jaxdev-meter") == 1, names
    assert outer.report().steps == inner.report().steps == 5


def test_a_report_compiles_nothing_and_shows_flops_per_device():
    flops = {}
    for name in ("single", "sharded"):
        strategy = getattr(jaxdev.Strategy, name)(jaxdev.data_mesh() if name == "sharded" else None)
        step, state, batch, _ = _setup(strategy, width=64, rows=64)
        with StepMeter() as m:
            for _ in range(3):
                state, _ = step(state, batch)
        with jaxdev.no_host_sync(max_compiles=0):  # lazy: XLA's cost of the lowered program
            r = m.report()
        flops[name] = r.flops_per_device * r.wall / r.steps  # one step's, per device
    assert flops["sharded"] == pytest.approx(flops["single"] / 8, rel=0.2), flops


@pytest.mark.parametrize("group", ["steps_per_call", "accumulate"])
def test_flops_count_every_step_and_micro_batch_of_a_call(group):
    """XLA's cost analysis counts a loop's body once: a call of 4 steps, or of 4 accumulated
    micro-batches, was counted as one plain call's FLOPs (FLOP/s and MFU 4x too low)."""
    tx, per_call = optax.sgd(0.1), {}
    for k in (1, 4):
        step = jaxdev.make_train_step(_loss, tx, jaxdev.Strategy.single(), **{group: k})
        state = step.init_state({"w": jnp.full((64, 64), 0.01)}, tx)
        shape = (k, 64, 64) if group == "steps_per_call" and k > 1 else (64 * k, 64)
        batch = step.put_batch({"x": np.ones(shape, np.float32)})
        state, _ = step(state, batch)
        with StepMeter() as m:
            for _ in range(3):
                state, _ = step(state, batch)
        r = m.report()
        per_call[k] = r.flops_per_device * r.wall / 3
    assert per_call[4] == pytest.approx(4 * per_call[1], rel=0.1), per_call


@pytest.mark.parametrize(
    "kwargs", [{"examples_per_step": -1}, {"tokens_per_step": True}, {"last": 0},
               {"examples_per_step": "8"}, {"tokens_per_step": float("nan")}]
)
def test_bad_arguments_are_named(kwargs):
    with pytest.raises(jaxdev.UsageError, match=f"`{next(iter(kwargs))}` must be a number > 0"):
        StepMeter(**kwargs)


@pytest.mark.parametrize("last", [None, 2.5, 0.5])
def test_last_is_a_whole_count_of_steps(last):
    # None raised a raw TypeError (int(None)); 2.5 was cut to 2 and 0.5 to 0 (every step drawn)
    with pytest.raises(jaxdev.UsageError, match="`last` must be a number > 0, a whole one"):
        StepMeter(last=last)


def test_numpy_numbers_are_numbers():  # np.int64(16) was refused as "not a number > 0"
    m = StepMeter(examples_per_step=np.int64(16), tokens_per_step=np.float32(160), last=np.int32(5))
    assert (m.examples, m.tokens, m.last) == (16, 160, 5)


def test_a_meter_in_a_second_thread_is_refused_and_its_steps_not_counted():
    """Meters in two threads counted each other's steps (5 and 7 calls reported as 10 and
    12): the record of step calls is one. A second thread's meter is refused by name, and a
    step called in another thread is not the metered loop's."""
    step, state, batch, _ = _setup()
    other, errors = _setup()[:3], []

    def elsewhere(n):
        st = other[1]
        for _ in range(n):
            st, _ = other[0](st, other[2])
        try:
            with StepMeter():
                pass
        except jaxdev.UsageError as err:
            errors.append(str(err))

    with StepMeter() as m:
        thread = threading.Thread(target=elsewhere, args=(7,))
        thread.start()
        for _ in range(5):
            state, _ = step(state, batch)
        thread.join()
    assert m.report().steps == 5
    assert len(errors) == 1 and "one thread's loop at a time" in errors[0], errors


@dataclasses.dataclass
class _Holder:
    loss: jax.Array


@pytest.mark.parametrize("how", ["logging", "dataclass_repr"])
def test_a_sync_in_a_library_or_generated_method_is_named_at_the_users_line(how, caplog):
    """``logging``'s ``str()`` of a device array was named at logging's own line, a
    dataclass's ``repr`` at ``<string>:3 (__repr__)`` (its generated method)."""
    step, state, batch, metrics = _setup()
    with StepMeter() as m:
        state, metrics = step(state, batch)
        loss = metrics["loss"].compute()
        line = inspect.currentframe().f_lineno + 2 + 2 * (how != "logging")
        if how == "logging":
            logging.getLogger("jaxdev-test").warning("loss %s", loss)
        else:
            repr(_Holder(loss))
    assert [w for w, _, _ in m.report().syncs if f"test_meter.py:{line} " in w], m.report().syncs


def test_an_interrupt_while_leaving_still_leaves(monkeypatch):
    """A Ctrl-C while leaving waited for the steps in flight: the meter stayed half-left (its
    wall kept growing, inputs() after it were timed) and the watcher thread died looking at
    it (``None.is_deleted``), so later meters saw no step end."""
    step, state, batch, _ = _setup()
    m = StepMeter()
    with pytest.raises(KeyboardInterrupt), m:
        state, _ = step(state, batch)
        look = m._look
        monkeypatch.setattr(m, "_look", lambda final=False: (
            (_ for _ in ()).throw(KeyboardInterrupt()) if final else look()))
    wall = m.report().wall
    assert m not in _timeline.listeners and m.report().wall == wall
    list(m.inputs(iter([time.sleep(0.01)])))
    assert m.report().seconds["input"] == 0
    time.sleep(0.1)  # the watcher looks at the left meter: it must not die
    with StepMeter() as again:
        for _ in range(3):
            state, _ = step(state, batch)
        time.sleep(0.1)  # the watcher sees them end
    assert again.report().steps == 3 and meter_watcher_alive()


def meter_watcher_alive():
    from jaxdev.meter import _meter

    return _meter._watcher is not None and _meter._watcher.is_alive()


def test_inputs_and_report_outside_the_block():
    """``inputs`` iterated before the block raised a raw AttributeError, after it kept
    adding to the finished report; ``report`` of a meter never entered measured from 0;
    ``inputs(None)`` raised a bare TypeError at the first item."""
    m = StepMeter()
    with pytest.raises(jaxdev.UsageError, match="enter the meter"):
        m.report()
    with pytest.raises(jaxdev.UsageError, match="expects an iterable of batches, got NoneType"):
        m.inputs(None)
    assert list(m.inputs(range(2))) == [0, 1]  # before: untimed
    with m:
        assert list(m.inputs(range(2))) == [0, 1]
    before = m.report()
    assert list(m.inputs(iter([time.sleep(0.01)]))) == [None]  # after: untimed
    assert m.report() == before


def test_a_meter_meters_one_block():
    m = StepMeter()
    with m:
        pass
    with pytest.raises(jaxdev.UsageError, match="one block"), m:
        pass


@pytest.mark.parametrize("name", ["sharded", "pmap"])
def test_eight_devices_table_and_picture(name, tmp_path):
    strategy = getattr(jaxdev.Strategy, name)(jaxdev.data_mesh() if name == "sharded" else None)
    step, state, batch, _ = _setup(strategy, rows=64)
    with StepMeter(examples_per_step=64, tokens_per_step=640, last=5) as m:
        for _ in range(12):
            state, _ = step(state, batch)
    r = m.report()
    assert r.steps == 12 and r.seconds["step"] > 0 and set(r.rates) == {
        "steps/s", "examples/s", "tokens/s"}
    assert "device computing train steps" in str(r) and "MFU unknown" in str(r)
    assert sum(lane[0] == "device step" for lane in r.lanes) == 5, (r.lanes, r.seconds)
    path = r.plot(str(tmp_path / "m.png"))
    with open(path, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_a_share_under_a_millisecond_is_not_printed_as_no_time():
    """Before: a loop's one quick ``float(loss)`` (0.2 ms of sync) printed "0.000" seconds
    beside its call site, as if the sync cost nothing."""
    from jaxdev.meter import MeterReport
    from jaxdev.meter._meter import SHARES

    shares = {"step": 1.5, "input": 0.0, "sync": 0.0002, "compile": 0.0, "checkpoint": 0.0,
              "eval": 0.0, "other": 0.4998}
    r = MeterReport(wall=2.0, seconds={**dict.fromkeys(SHARES, 0.0), **shares},
                    syncs=(("float() at loop.py:3", 1, 0.0002),), steps=10,
                    rates={"steps/s": 5.0}, flops_per_device=None, mfu=None, peak="unknown")
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in str(r).splitlines() if line.count("│") >= 4}
    assert rows["device computing train steps"] == "1.500" and "0.000" not in str(r)
    assert "1x float() at loop.py:3" in str(r)
    assert rows["device idle: host sync"] == "<0.001", rows


def test_the_picture_draws_each_of_the_last_steps_one_of_no_length_too():
    """Before: a last step whose estimated end was its start (the queue model spread one
    late end over the steps before it) was not drawn: 4 device lanes for ``last=5`` in 2 of
    12 loaded runs of test_eight_devices_table_and_picture[pmap]."""
    busy = [(0.0, 1.0, "step"), (1.0, 2.0, "step"), (2.0, 2.0, "step"), (2.0, 3.0, "step")]
    (lanes,) = StepMeter(last=3)._lanes(busy, [], 0.0)
    assert lanes == (("device step", 1.0, 2.0), ("device step", 2.0, 2.0),
                     ("device step", 2.0, 3.0))
    (lanes,) = StepMeter(last=2)._lanes([*busy[:2], (2.0, 2.0, "step")], [], 0.0)
    assert lanes == (("device step", 1.0, 2.0), ("device step", 2.0, 2.0))


def test_peaks_by_device_kind():
    assert peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert peak_flops("TPU v5 lite")[0] == 197e12 and peak_flops("TPU v5")[0] == 459e12
    assert peak_flops("cpu") is None


def _step_and_batch():
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(
        lambda p, b: (b @ p["w"])[:, 0] ** 2, tx, jaxdev.Strategy.single()
    )
    return step, step.init_state({"w": jnp.ones((4, 1))}, tx), step.put_batch(np.ones((8, 4)))


def _leave_if_left(meter):
    if meter in _timeline.listeners:  # a meter whose __exit__ failed: do not leak it
        _timeline.leave(meter)
        meter._guard.__exit__(None, None, None)


def test_a_meter_entered_after_the_record_was_cleared_looks_and_exits_cleanly(monkeypatch):
    """Before (issue-35 review): listen() empties _timeline.times past _KEEP doubles
    (2**20 metered calls) but keeps _timeline.newest = (calls before the clear, None). The
    next meter's first look
    (the watcher's, within 50 ms, before its first step) calls None.is_ready(): the shared
    watcher thread dies (AttributeError); a block that leaves before its first step (the
    loader failed) raises IndexError from __exit__ in place of the user's error, and the
    meter stays listening with count_transfers' wrappers installed for good.
    /tmp/attack35/item4_keep.py, item4_keep2.py."""
    monkeypatch.setattr(_timeline, "_KEEP", 8)  # as after 2**20 metered calls
    step, state, batch = _step_and_batch()
    with jaxdev.meter.StepMeter():
        for _ in range(10):
            state, _ = step(state, batch)
    meter = jaxdev.meter.StepMeter()
    try:
        with meter:
            meter._look()  # what the watcher does every 50 ms: must not raise
    finally:
        _leave_if_left(meter)
    meter = jaxdev.meter.StepMeter()
    try:
        with pytest.raises(KeyError, match="the loader failed"):
            with meter:
                raise KeyError("the loader failed")
        assert meter not in _timeline.listeners
    finally:
        _leave_if_left(meter)


def test_a_deleted_eval_output_is_a_step_that_ended():
    """The newest output an eval step returned, deleted (donated to a train step as its
    metrics) before the watcher looks: it ended. Before, jax 0.10.2 segfaulted on its
    is_ready (0.12 raised, which the look caught)."""
    step, state, batch, _ = _setup()
    ev = jaxdev.make_eval_step(_loss, jaxdev.Strategy.single())
    jax.block_until_ready(ev(state.params, batch))  # compiled outside the meter
    with StepMeter() as m:
        metrics = jax.block_until_ready(ev(state.params, batch))
        jax.tree.leaves(metrics)[0].delete()
        m._look()  # the watcher's look at the newest output
        m.on_host("sync", 0.0, 0.0, "float() at here.py:1")  # a sync's look at it
        state, _ = step(state, batch)
    r = m.report()
    assert r.steps == 1 and r.seconds["eval"] >= 0
