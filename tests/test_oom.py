"""Memory errors that explain themselves (issue 20): compiled needs, live arrays, options.

Every option an explanation prints is followed here: the changed step is
built as the option says and compiled (its peak is the option's figure), and
each option marked as fitting runs one real step under ``memory_limit``.
On CPU a real ``RESOURCE_EXHAUSTED`` comes from a step whose temporaries
need 1 TiB (malloc refuses it at once; nothing is touched).
"""

from __future__ import annotations

import collections
import logging
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdev
from jaxdev import _pending
from jaxdev.memory._explain import batch_for, batch_rows

TX = optax.adam(1e-3)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w0"])
    h = jnp.tanh(h @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2, axis=-1)


def _params():
    rng = np.random.default_rng(0)
    shapes = {"w0": (128, 512), "w1": (512, 512), "w2": (512, 8)}
    return {k: jnp.asarray(rng.normal(0, 0.05, s), jnp.float32) for k, s in shapes.items()}


def _host_batch(rows: int = 1024) -> dict:
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(rows, 128)).astype(np.float32),
        "y": rng.normal(size=(rows, 8)).astype(np.float32),
    }


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _followed(change: str, mesh) -> tuple[jaxdev.Strategy, dict, int | None]:
    """The strategy, step options and batch rows an option's text asks for."""
    if change == "Strategy.sharded(mesh, rules='fsdp')":
        return jaxdev.Strategy.sharded(mesh, rules="fsdp"), {}, None
    if m := re.fullmatch(r"accumulate=(\d+)", change):
        return jaxdev.Strategy.sharded(mesh), {"accumulate": int(m.group(1))}, None
    if m := re.fullmatch(r"a batch of (\d+) rows", change):
        return jaxdev.Strategy.sharded(mesh), {}, int(m.group(1))
    if change == "remat=True":
        return jaxdev.Strategy.sharded(mesh), {"remat": True}, None
    if m := re.fullmatch(r"Strategy\.sharded\(mesh, offload=(.+)\)", change):
        offload = eval(m.group(1))  # the option's own repr: 'opt_state' or a tuple
        return jaxdev.Strategy.sharded(mesh, offload=offload), {}, None
    raise AssertionError(f"an option this test cannot follow: {change}")


def test_every_option_is_compiled_and_each_that_fits_runs_under_the_limit():
    mesh = jaxdev.data_mesh()
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))
    batch = _shapes(_host_batch())
    need = jaxdev.memory.plan(state, step=step, batch=batch).peak
    limit = need - 1
    why = step.explain_memory(state, batch, limit=limit)
    assert isinstance(why, jaxdev.memory.MemoryExplanation)
    assert why.needed == need and why.limit == limit and why.fits is False
    text = str(why)
    assert text.startswith(f"the train step needs {jaxdev._report.human_bytes(need)} per device")
    assert "compiled step (memory_analysis, per device): arguments" in text
    changes = [o.change for o in why.options]  # each compiled once, and the step itself
    n = len(changes) + 1
    assert f"options, each compiled for this state and batch (none run; {n} programs" in text
    assert changes[0] == "Strategy.sharded(mesh, rules='fsdp')" and "a batch of 512 rows" in changes
    fitting = [o for o in why.options if o.fits]
    assert len(fitting) >= 2, text
    for o in why.options:  # the figure is the followed change's compiled peak
        strategy, options, rows = _followed(o.change, mesh)
        followed = jaxdev.make_train_step(loss_fn, TX, strategy, **options)
        shapes = batch_for(followed.spec, batch_rows(step.spec, batch), rows or 1024)
        assert jaxdev.memory.plan(state, step=followed, batch=shapes).peak == o.peak, o
        assert o.fits == (o.peak <= limit)
    for o in fitting:  # and it runs under the limit (the step checks before running)
        strategy, options, rows = _followed(o.change, mesh)
        run = jaxdev.make_train_step(loss_fn, TX, strategy, memory_limit=limit, **options)
        new, metrics = run(run.init_state(_params(), TX), run.put_batch(_host_batch(rows or 1024)))
        assert int(new.step) == 1 and np.isfinite(metrics.fetch()["loss"]), o


def test_the_memory_limit_error_carries_the_same_explanation():
    mesh = jaxdev.data_mesh()
    loose = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    state = loose.init_state(_params(), TX)
    history = [jax.tree.map(jnp.copy, state.params) for _ in range(2)]  # a leak
    batch = loose.put_batch(_host_batch())
    need = jaxdev.memory.plan(jax.eval_shape(lambda: state), step=loose, batch=batch).peak
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh), memory_limit=need - 1)
    with pytest.raises(jaxdev.MemoryPlanError) as err:
        step(state, batch)
    text = str(err.value)
    # the check's own sentence first (one owner: _plan.check_fits), then the explanation
    assert text.startswith("the train step needs ") and "available (memory_limit)" in text
    assert "Nothing ran." in text
    why = err.value.explanation
    assert isinstance(why, jaxdev.memory.MemoryExplanation) and why.limit == need - 1
    assert why.source == "memory_limit" and why.details() in text
    assert "state.opt_state[0].mu['w1']" in text  # live now, by path
    assert "2 unattributed arrays shaped like state.params['w1'] (old copies" in text
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nothing ran
    assert [o.change for o in why.options] == [
        o.change for o in step.explain_memory(state, batch, limit=need - 1).options
    ]
    del history


def test_a_program_whose_autotuning_runs_out_of_memory_is_still_checked(monkeypatch):
    """XLA:GPU autotunes on real buffers, so a step that cannot fit fails to *compile*
    (seen on an H100: ``NOT_FOUND: Failed to get configs ... RESOURCE_EXHAUSTED: Out of
    memory``, a raw JaxRuntimeError from the ordinary loop). The check compiles it untuned."""
    mesh = jaxdev.data_mesh()
    tuned = []
    compile_ = jax.stages.Lowered.compile

    def autotuning(self, compiler_options=None, **kwargs):
        if not (compiler_options or {}).get("xla_gpu_autotune_level") == 0:
            tuned.append(1)
            raise jax.errors.JaxRuntimeError(
                "NOT_FOUND: Failed to get configs for: 7 out of 14 instructions.\nFailures (1):"
                "\nEXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                "256.02GiB with allocator GPU_0_bfc on device 0."
            )
        return compile_(self, compiler_options, **kwargs)

    loose = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    state = loose.init_state(_params(), TX)
    batch = loose.put_batch(_host_batch())
    need = jaxdev.memory.plan(jax.eval_shape(lambda: state), step=loose, batch=batch).peak
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh), memory_limit=need - 1)
    monkeypatch.setattr(jax.stages.Lowered, "compile", autotuning)
    with pytest.raises(jaxdev.MemoryPlanError, match="the train step needs .* Nothing ran"):
        step(state, batch)
    assert tuned and not any(x.is_deleted() for x in jax.tree.leaves(state))
    # fit_memory: a candidate the device cannot build autotuned does not fit, however small
    shapes = jax.eval_shape(lambda: state)
    with pytest.raises(jaxdev.MemoryPlanError, match="(?s)nothing fits.*autotuned compile ran"):
        jaxdev.memory.fit_memory(loose, shapes, batch, limit=need * 4, max_batch_size=64)
    monkeypatch.undo()  # another error than an out-of-memory is not taken for one
    monkeypatch.setattr(
        jax.stages.Lowered,
        "compile",
        lambda *a, **k: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INTERNAL: boom")),
    )
    other = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh), memory_limit=need)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: boom"):
        other(state, batch)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: boom"):  # not 'nothing fits'
        jaxdev.memory.fit_memory(loose, shapes, batch, limit=need * 4)


def test_a_compile_out_of_memory_even_untuned_is_named_at_the_step_and_in_the_plan(monkeypatch):
    """Autotuned and untuned compiles both out of memory: never XLA's raw error."""

    def exhausted(self, compiler_options=None, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3.2GiB")

    mesh = jaxdev.data_mesh()
    loose = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    state = loose.init_state(_params(), TX)
    batch = loose.put_batch(_host_batch())
    shapes = jax.eval_shape(lambda: state)
    monkeypatch.setattr(jax.stages.Lowered, "compile", exhausted)
    with pytest.raises(jaxdev.MemoryPlanError, match="ran out of device memory, autotuned and"):
        jaxdev.memory.plan(shapes, step=loose, batch=batch)
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh), memory_limit=10**12)
    with pytest.raises(jaxdev.MemoryPlanError, match="out of device memory"):  # the check's
        step(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_the_memory_limit_holds_for_every_batch_shape_the_step_compiles():
    """Checked at a program's first call only, 16x the rows compiled a new program that ran
    over the limit without a word."""
    mesh = jaxdev.data_mesh()
    loose = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    shapes = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))
    small, big = (
        jaxdev.memory.plan(shapes, step=loose, batch=_shapes(_host_batch(n))).peak
        for n in (64, 1024)
    )
    limit = (small + big) // 2
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh), memory_limit=limit)
    state, metrics = step(step.init_state(_params(), TX), step.put_batch(_host_batch(64)))
    state, metrics = step(state, step.put_batch(_host_batch(64)), metrics)  # both programs
    with pytest.raises(jaxdev.MemoryPlanError) as err:
        step(state, step.put_batch(_host_batch(1024)), metrics)
    assert str(err.value).startswith(f"the train step needs {jaxdev._report.human_bytes(big)} ")
    assert "Nothing ran." in str(err.value)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, metrics)))  # not donated
    state, metrics = step(state, step.put_batch(_host_batch(64)), metrics)  # checked: runs
    assert int(state.step) == 3 and np.isfinite(metrics.fetch()["loss"])


def test_the_advice_is_the_cheapest_compiled_option_that_fits_or_that_none_does():
    """The first line advised ``rules='fsdp'`` where the compiled table showed it not fitting."""
    mesh = jaxdev.data_mesh()
    loose = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    state = loose.init_state(_params(), TX)
    batch = loose.put_batch(_host_batch())
    fitting = {}
    for limit in (3 * 2**20, 2 * 2**20):  # fsdp (3.1 MiB) fits neither
        strategy = jaxdev.Strategy.sharded(mesh)
        step = jaxdev.make_train_step(loss_fn, TX, strategy, memory_limit=limit)
        with pytest.raises(jaxdev.MemoryPlanError) as err:
            step(state, batch)
        head, why = str(err.value).splitlines()[0], err.value.explanation
        assert why.options[0].change == "Strategy.sharded(mesh, rules='fsdp')", why.options[0]
        assert why.options[0].fits is False and "fsdp" not in head, head
        fitting[limit] = [o for o in why.options if o.fits]
        if fitting[limit]:  # the first in the table: they are listed cheapest per step first
            best = fitting[limit][0]
            peak = jaxdev._report.human_bytes(best.peak)
            assert f"Fix: {best.change} ({best.what}, {peak} per device: the cheapest" in head
            assert f"; fix: {best.change} (" in why.headline()
        else:
            assert "Fix: none of the changes compiled below fits in 2.0 MiB" in head, head
            assert "; fix: none of the changes compiled below fits" in why.headline()
    assert fitting[3 * 2**20] and not fitting[2 * 2**20]


HUGE = """
import os, jax
jax.config.update("jax_num_cpu_devices", 8)
if os.environ.get("SYNC_DISPATCH"):  # the allocation fails in the call
    jax.config.update("jax_cpu_enable_async_dispatch", False)
import jax.numpy as jnp, numpy as np, optax, jaxdev

def huge_loss(params, batch):  # temporaries of 8 x 4 x 2**31 float32 (256 GiB): malloc refuses
    h = batch @ params["w"]  # (a cumsum: no axis of 2**31 or more, which jax 0.12 dies on)
    i, j = jnp.arange(2**15, dtype=jnp.float32), jnp.arange(2**16, dtype=jnp.float32)
    return jnp.cumsum(h[:, :, None, None] * i[:, None] * j, axis=-1).max((-1, -2, -3))

tx = optax.sgd(0.1)
step = jaxdev.make_train_step(huge_loss, tx, jaxdev.Strategy.single())
batch = step.put_batch(np.ones((8, 4), np.float32))
"""

REAL_OOM = (
    HUGE
    + """
state = step.init_state({"w": jnp.ones((4, 4))}, tx)
try:
    step(state, batch)
except jaxdev.OutOfMemoryError as e:
    assert isinstance(e, jaxdev.MemoryPlanError) and isinstance(e, MemoryError)
    assert isinstance(e.__cause__, jax.errors.JaxRuntimeError), repr(e.__cause__)
    assert e.explanation.error.startswith("RESOURCE_EXHAUSTED")
    print(e)
"""
)


def test_a_real_resource_exhausted_becomes_an_explained_out_of_memory_error():
    """A real XLA out-of-memory on CPU, raised in the call (synchronous dispatch, as a GPU's
    allocation at launch): the step raises OutOfMemoryError with the whole explanation."""
    from conftest import run_python

    proc = run_python(REAL_OOM, env={"SYNC_DISPATCH": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert text.startswith("the train step ran out of device memory (RESOURCE_EXHAUSTED: ")
    assert "temporaries 528.0 GiB" in text  # what the compiled step needed
    assert "live now on cpu:0" in text and "batch  8x4" in text  # the donated state is gone
    assert "device limit: not reported by the cpu backend" in text
    assert "a batch of 4 rows" in text and "264.0 GiB" in text  # an option, compiled


ASYNC_OOM = (
    HUGE
    + """
import jaxdev.memory._explain as X

_real = X.explain_args  # no options compiled (REAL_OOM checks them): the reads are the test
X.explain_args = lambda spec, args, **kw: _real(spec, args, options=(), **kw)

def step_once():  # returns at once (asynchronous dispatch): the error is raised later
    return step(step.init_state({"w": jnp.ones((4, 4))}, tx), batch)

def named(read, where):
    try:
        read()
    except jaxdev.OutOfMemoryError as e:
        assert isinstance(e.__cause__, jax.errors.JaxRuntimeError), repr(e.__cause__)
        assert "Out of memory" in e.explanation.error, e.explanation.error
        print(where, "|", " | ".join(str(e).splitlines()[:2]))
    else:
        raise AssertionError(f"{where}: no OutOfMemoryError")

state, metrics = step_once()
named(metrics.fetch, "fetch")
state, metrics = step_once()
named(lambda: jaxdev.to_host(state.params), "to_host")
state, metrics = step_once()
try:
    jax.block_until_ready(metrics)  # JAX's own wait raises JAX's own error,
except jax.errors.JaxRuntimeError:
    pass
named(lambda: step(state, batch, metrics), "next call")  # and the step's next call names it
"""
)


def test_an_out_of_memory_raised_later_is_the_same_explained_error():
    """JAX dispatches asynchronously: a step's real out-of-memory surfaced as a bare
    ``JaxRuntimeError`` where its outputs were read. Each jaxdev read raises the step's
    explanation, saying where it surfaced."""
    from conftest import run_python

    proc = run_python(ASYNC_OOM, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["fetch", "to_host", "next call"], lines
    for line, where in zip(lines, ("Collection.fetch", "to_host", "the next call of the step")):
        assert " | the train step ran out of device memory (" in line, line
        assert f" | it surfaced at {where}: " in line, line


def test_init_sharded_runs_out_of_memory_with_an_explanation():
    mesh = jaxdev.make_mesh({"fsdp": 8})

    def init(key):  # 2 TiB of params, 256 GiB per device once sharded: malloc refuses
        return {"w": jax.random.normal(key, (2**39,), jnp.float32)}

    with pytest.raises(jaxdev.OutOfMemoryError) as err:
        jaxdev.init_sharded(init, jax.random.key(0), mesh=mesh, rules="fsdp")
    text = str(err.value)
    assert text.startswith("init_sharded ran out of device memory (RESOURCE_EXHAUSTED")
    assert "it needs 256.0 GiB per device (jaxdev.memory.plan)" in text
    assert "device limit: not reported by the cpu backend" in text


def test_init_state_and_restore_name_what_they_needed(monkeypatch, tmp_path):
    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4194304 bytes.")

    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded())
    monkeypatch.setattr(jaxdev.train._strategy, "copy_to", exhausted)  # place_state
    with pytest.raises(jaxdev.OutOfMemoryError) as err:
        step.init_state(_params(), TX)
    text = str(err.value)
    assert text.startswith("init_state ran out of device memory (RESOURCE_EXHAUSTED: Out of ")
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))
    full = jaxdev.memory.plan(state, jaxdev.data_mesh()).total
    assert f"it needs {jaxdev._report.human_bytes(full)} per device (jaxdev.memory.plan); " in text
    assert "with rules='fsdp' over 8 devices: " in text
    monkeypatch.undo()

    jaxdev.save(tmp_path / "c", {"w": jnp.ones(8)})
    monkeypatch.setattr(jaxdev.checkpoint._checkpoint, "_orbax_restore", exhausted)
    with pytest.raises(jaxdev.OutOfMemoryError, match=r"^restore of .* ran out of device memory"):
        jaxdev.restore(tmp_path / "c", "cpu:0")
    # anything else is still the checkpoint's own error
    monkeypatch.setattr(
        jaxdev.checkpoint._checkpoint,
        "_orbax_restore",
        lambda *a: (_ for _ in ()).throw(OSError("gone")),
    )
    with pytest.raises(OSError, match="gone"):
        jaxdev.restore(tmp_path / "c", "cpu:0")


def test_explain_memory_says_what_it_compiles_and_takes_the_options_to_try(caplog):
    """It compiled 8 variants of a transformer for minutes without a word, and all of them."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded())
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))
    batch = _shapes(_host_batch())
    with caplog.at_level(logging.INFO, logger="jaxdev"):
        why = step.explain_memory(state, batch, limit=2**20, options=("remat", "half_batch"))
    assert [o.change for o in why.options] == ["remat=True", "a batch of 512 rows"]
    logs = [r.getMessage() for r in caplog.records if r.name == "jaxdev"]
    assert logs[0].startswith("explain_memory: compiling the train step and its options: remat, ")
    assert re.fullmatch(r"explain_memory: the train step needs [\d.]+ MiB per device", logs[1])
    assert re.fullmatch(
        r"explain_memory: compiled remat=True \(loss rematerialised\) in [\d.]+ s", logs[2]
    )
    assert re.fullmatch(r"explain_memory: 3 programs compiled in [\d.]+ s", logs[-1]), logs
    assert re.search(
        r"options, each compiled for this state and batch \(none run; 3 programs "
        r"compiled in [\d.]+ s\):",
        str(why),
    )
    with pytest.raises(jaxdev.UsageError, match=r"`options` must name some of \('fsdp', "):
        step.explain_memory(state, batch, limit=2**20, options=("fsdp", "shard"))


def test_explain_memory_bad_inputs_are_named():
    step = jaxdev.make_train_step(loss_fn, TX)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))
    with pytest.raises(jaxdev.UsageError, match="`limit` must be a number of bytes"):
        step.explain_memory(state, _shapes(_host_batch(8)), limit="16GB")
    with pytest.raises(jaxdev.UsageError, match="`batch` leaf of shape \\(\\) has no row axis"):
        step.explain_memory(state, {"x": jax.ShapeDtypeStruct((), jnp.float32)}, limit=2**30)


def test_accumulation_lowers_the_temporaries_where_activations_dominate():
    """``accumulate=M`` runs a rolled scan: one micro-batch's activations at a time.

    Unrolled (as before), XLA scheduled the M forward passes together and
    ``accumulate=8`` needed 4.3x the temporaries of one big batch; with the
    first micro-batch peeled out of the scan, ``accumulate=2`` needed more
    than no accumulation.
    """
    rng = np.random.default_rng(0)
    shapes = {"w0": (64, 1024), "w1": (1024, 1024), "w2": (1024, 8)}
    params = {k: jnp.asarray(rng.normal(0, 0.05, s), jnp.float32) for k, s in shapes.items()}

    def deep(params, batch):
        h = jnp.tanh(jnp.tanh(batch["x"] @ params["w0"]) @ params["w1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2, axis=-1)

    tx = optax.sgd(1e-3)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(params, tx))
    temps = {}
    for m in (1, 2, 8):
        step = jaxdev.make_train_step(deep, tx, jaxdev.Strategy.single(), accumulate=m)
        lead = () if m == 1 else (m,)
        batch = {
            "x": jax.ShapeDtypeStruct(lead + (1024 // m, 64), jnp.float32),
            "y": jax.ShapeDtypeStruct(lead + (1024 // m, 8), jnp.float32),
        }
        temps[m] = jaxdev.memory.plan(state, step=step, batch=batch).compiled.temp
    assert temps[8] < temps[1] and temps[2] < temps[1], temps  # M=2 too: nothing peeled


def test_an_eval_step_explains_itself_as_the_eval_step():
    """The explanation names the step it is about (it said "the train step" for both)."""
    ev = jaxdev.make_eval_step(loss_fn)
    params = _shapes(_params())
    # options=(): the subject is the step's own, whatever options are compiled with it
    why = ev.explain_memory(params, _shapes(_host_batch(64)), limit=2**30, options=())
    assert why.subject == "the eval step" and str(why).startswith("the eval step needs")
    train = jaxdev.make_train_step(loss_fn, TX)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))
    batch = _shapes(_host_batch(64))
    assert train.explain_memory(state, batch, limit=2**30, options=()).subject == "the train step"


@pytest.mark.gpu
def test_a_step_that_cannot_fit_on_the_gpu_is_named_in_the_ordinary_loop():
    """On a real card (XLA:GPU autotunes on real buffers), in the loop as users write it."""
    dev = jaxdev.d2l.gpu(0)

    def huge(params, batch):  # a (rows, 4096, 4096) float32 temporary: 256 GiB
        h = batch["x"][:, :, None] * params["w"][None]
        return jnp.sum((h @ params["v"]) ** 2, axis=(1, 2))

    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(huge, tx, jaxdev.Strategy.single(dev))
    params = {"w": jnp.full((4096, 4096), 1e-3), "v": jnp.full((4096, 8), 1e-3)}
    state, metrics = step.init_state(params, tx), None
    with pytest.raises(jaxdev.MemoryPlanError, match=r"(?s)the train step needs .*Nothing ran"):
        for _ in range(3):
            state, metrics = step(
                state, step.put_batch({"x": np.ones((4096, 4096), "f4")}), metrics
            )
    small = step.put_batch({"x": np.ones((2, 4096), "f4")})  # 2 rows fit: the step still runs
    assert np.isfinite(step(state, small)[1].fetch()["loss"])


LATER = HUGE + """
import functools
import jaxdev.memory._explain as X
from jaxdev.metrics import fetch_metrics

_real, _once = X.explain_args, {}
def explain_once(spec, args, **kw):  # compiled (1-2 s) once per step: the reads are the test
    if id(spec) not in _once:
        _once[id(spec)] = _real(spec, args, options=(), **kw)
    return _once[id(spec)]
X.explain_args = explain_once

READS = {  # path -> (read, where the explanation says it surfaced)
    "fetch": (lambda s, m: m.fetch(), "Collection.fetch"),
    "fetch_metrics": (lambda s, m: fetch_metrics({"m": m}), "fetch_metrics"),
    "Metric.fetch": (lambda s, m: m["loss"].fetch(), "Mean.fetch"),
    "float(Metric.compute())": (lambda s, m: float(m["loss"].compute()), "Mean.compute"),
    "np.asarray(Collection.compute())": (
        lambda s, m: np.asarray(m.compute()["loss"]), "Collection.compute"),
    "to_host": (lambda s, m: jaxdev.to_host(s), "to_host"),
}
STRATEGIES = {
    "single": jaxdev.Strategy.single,
    "pmap": jaxdev.Strategy.pmap,
    "sharded": jaxdev.Strategy.sharded,
    "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True),
}

def verdict(read, where):
    try:
        read()
    except jaxdev.OutOfMemoryError as e:
        head, at = str(e).splitlines()[:2]
        ok = head.startswith("the train step ran out of device memory (RESOURCE_EXHAUSTED: ")
        ok &= at.startswith(f"it surfaced at {where}: ")
        return "named" if ok and e.explanation is not None else f"text: {head} | {at}"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return "no error"

def next_call(step, batch, state, metrics):
    try:
        jax.block_until_ready(metrics)
    except jax.errors.JaxRuntimeError:
        return step(state, batch, metrics)
    raise AssertionError("the step did not fail")

for name, strategy in STRATEGIES.items():
    step = jaxdev.make_train_step(huge_loss, tx, strategy())
    batch = step.put_batch(np.ones((8, 4), np.float32))
    for first in [*READS, "next call"]:  # each path read first after n failed calls
        for _ in range(12):
            reads = {first: READS.get(first), **READS}  # then every other path, read again
            if first == "next call":  # once JAX's own wait raised JAX's own error
                reads[first] = (functools.partial(next_call, step, batch), "the next call of the step")
            try:  # a call that raises leaves nothing to read
                state, metrics = step(step.init_state({"w": jnp.ones((4, 4))}, tx), batch)
            except Exception as e:
                state = metrics = e
            for path, (read, where) in reads.items():
                got = verdict(functools.partial(read, state, metrics), where)
                if isinstance(state, Exception):
                    got = f"the call raised {type(state).__name__}"
                print(f"{name}|{path}|{'first' if path == first else 'later'}|{got}")
"""


DONATED_METRICS = HUGE + """
import jaxdev.memory._explain as X

_real = X.explain_args
X.explain_args = lambda spec, args, **kw: _real(spec, args, options=(), **kw)  # no options
post = jax.jit(lambda m: jax.tree.map(lambda x: x + 0, m), donate_argnums=0)  # an EMA, a reset

def settle(tree):  # the user's own wait on every device's part of the call: its failure is seen
    for shard in (s for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards):
        try:
            shard.data.block_until_ready()
        except jax.errors.JaxRuntimeError:
            pass

for name in ("single", "sharded", "pmap"):
    step = jaxdev.make_train_step(huge_loss, tx, getattr(jaxdev.Strategy, name)())
    batch = step.put_batch(np.ones((8, 4), np.float32))
    state, metrics = step.init_state({"w": jnp.ones((4, 4))}, tx), None
    try:
        for i in range(3):
            state, metrics = step(state, batch, metrics)
            metrics = post(metrics)  # the returned metrics, donated by the user's own jit
            settle(state)  # (else the next call may come before the device failed: no error yet)
        print(name, "no error")
    except jaxdev.OutOfMemoryError as e:
        print(name, i, str(e).splitlines()[1].split(":")[0])
"""


def test_an_out_of_memory_is_named_at_the_next_call_when_the_user_donates_the_metrics():
    """The step waits on an output of its own, not on the metrics it returns: the user's, which
    they may donate or delete. Was (c976ae0, a metrics leaf the token): no error at any call,
    then a bare INTERNAL 'Error dispatching computation' at fetch (helper-65). The loop waits
    on the state each call: without it, CI's pmap calls 1 and 2 came before the device failed
    and the loop ended with no error to name yet (stop 47)."""
    from conftest import run_python

    proc = run_python(DONATED_METRICS, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [tuple(line.split(" ", 2)) for line in proc.stdout.splitlines()]
    assert got == [
        (n, "1", "it surfaced at the next call of the step") for n in ("single", "sharded", "pmap")
    ], proc.stdout


@pytest.fixture(scope="module")
def later_reads():
    """Every read path x strategy of a step's real out-of-memory, each path read first 12
    times (it surfaced bare under pmap/sharded in 3 of 12) and after every other read."""
    from conftest import run_python

    proc = run_python(LATER, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = collections.defaultdict(collections.Counter)
    for line in proc.stdout.splitlines():
        strategy, path, when, got = line.split("|", 3)
        table[strategy, path][when, got] += 1
    return table


@pytest.mark.parametrize("strategy", ["single", "pmap", "sharded", "shard_map"])
@pytest.mark.parametrize(
    "path",
    [
        "fetch",
        "fetch_metrics",
        "Metric.fetch",
        "float(Metric.compute())",
        "np.asarray(Collection.compute())",
        "to_host",
        "next call",
    ],
)
def test_an_out_of_memory_read_later_is_named_on_every_path_and_strategy(
    later_reads, strategy, path
):
    """Before: bare RESOURCE_EXHAUSTED at a second read (the first consumed the error), at
    every call from the 9th on under pmap/sharded (the bounded queue re-raised old calls'
    errors), and INTERNAL 'Error dispatching computation' at float(compute())."""
    want = {("first", "named"): 12}
    if path != "next call":  # and read again after each of the 6 other paths went first
        want["later", "named"] = 6 * 12
    got = dict(later_reads[strategy, path])
    assert got == want, got


OTHERS = HUGE + """
import jaxdev.memory._explain as X
from jaxdev.metrics import fetch_metrics

_real, _once = X.explain_args, {}
def explain_once(spec, args, **kw):  # compiled once per step: the reads are the test
    if id(spec) not in _once:
        _once[id(spec)] = _real(spec, args, options=(), **kw)
    return _once[id(spec)]
X.explain_args = explain_once

def loss(params, batch):  # 4 features: the train step needs 528 GiB, the eval step 512 GiB
    fits = jnp.sum(batch[..., :4] @ params["w"], -1)  # 5 features: it fits
    return huge_loss(params, batch) if batch.shape[-1] == 4 else fits

def buggy(params, batch):
    return jnp.sum(batch @ params["w"], -1) + "a bug"  # a TypeError when traced

def got(read):
    try:
        out = read()
    except jaxdev.OutOfMemoryError as e:
        return " ".join(str(e).split()[:2])
    except Exception as e:
        return type(e).__name__
    return "value" if np.isfinite(np.asarray(jax.tree.leaves(out)[0])).all() else "bad value"

def failed(outputs):  # read the way JAX raises: the next reads are jaxdev's
    try:
        jax.block_until_ready(outputs)
    except jax.errors.JaxRuntimeError:
        return outputs
    raise AssertionError("it did not fail")

strategies = {"single": jaxdev.Strategy.single, "pmap": jaxdev.Strategy.pmap,
              "sharded": jaxdev.Strategy.sharded,
              "shard_map": lambda: jaxdev.Strategy.sharded(shard_map=True)}
mine = jax.jit(lambda x: huge_loss({"w": jnp.ones((4, 4))}, jnp.concatenate([x, x])))
for name, strategy in strategies.items():
    train = jaxdev.make_train_step(loss, tx, strategy(), donate=False)
    ev = jaxdev.make_eval_step(loss, strategy())
    state = train.init_state({"w": jnp.ones((4, 4))}, tx)
    big, small = train.put_batch(np.ones((8, 4), "f4")), train.put_batch(np.ones((8, 5), "f4"))
    for order in ("eval first", "train first"):
        _, m_train = failed(train(state, big))
        m_eval = failed(ev(state.params, big))
        # a bug in another step's loss is that bug, not the pending out-of-memory
        bug = lambda: jaxdev.make_eval_step(buggy, strategy())(state.params, big)
        print(f"{name}|{order}: bug at a call|{got(bug)}")
        # a user's own computation that ran out of memory is not the step's
        print(f"{name}|{order}: own OOM|{got(lambda: jaxdev.to_host(mine(np.ones((8, 4), 'f4'))))}")
        reads = {"train": m_train.fetch, "eval": lambda: float(m_eval["loss"].compute())}
        for who in reads if order == "train first" else reversed(reads):
            print(f"{name}|{order}: {who}|{got(reads[who])}")
        _, good = train(state, small)  # recovered: its metrics are read as values
        print(f"{name}|{order}: recovered|{got(good.fetch)}")
        print(f"{name}|{order}: failed, read after|{got(m_train.fetch)}")  # still poisoned
        print(f"{name}|{order}: eval recovered|{got(lambda: ev(state.params, small).fetch())}")
"""


def test_a_read_names_the_failure_it_comes_from_and_nothing_else():
    """Two steps ran out of memory (train 528 GiB, eval 512 GiB): each read names its own
    step, in either order. Before: the oldest failure not raised yet explained any read, so
    eval's metrics named the train step and then train's the eval step; a user's own
    out-of-memory was "the train step"; a TypeError in another step's loss (at its call)
    was the train step's out-of-memory "surfaced at the next call of the step"; and a failed
    call's metrics read after the step's next (good) call were JAX's bare error."""
    from conftest import run_python

    proc = run_python(OTHERS, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {"train": "the train", "eval": "the eval", "bug at a call": "TypeError",
            "own OOM": "JaxRuntimeError", "recovered": "value", "eval recovered": "value",
            "failed, read after": "the train"}
    orders = ("eval first", "train first")
    want = {f"{order}: {case}": v for order in orders for case, v in want.items()}
    lines = collections.defaultdict(dict)
    for line in proc.stdout.splitlines():
        strategy, case, result = line.split("|")
        lines[strategy][case] = result
    assert dict(lines) == {s: want for s in ("single", "pmap", "sharded", "shard_map")}


def test_a_step_called_while_another_thread_records_a_call_never_breaks():
    """A step's entry check (``_pending.failed``) while another thread's step records its call
    (an eval loop in a thread): it raised "RuntimeError: dictionary changed size during
    iteration" from the step call (4 in 21,743 calls at a 1 us switch interval)."""
    import sys
    import threading
    import time

    from jaxdev import _pending

    class InFlight:  # a call's output, not ready yet
        def is_ready(self):
            return False

    stop, errors = threading.Event(), []

    def other_thread():
        owners = [object() for _ in range(12)]  # more than the 8 remembered: some are dropped
        for i in range(10**9):
            if stop.is_set():
                return
            _pending.record(owners[i % 12], InFlight(), lambda err, where: None)

    interval, me = sys.getswitchinterval(), object()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not errors:
            try:
                _pending.failed("the next call of the step", me)
                _pending.look("the next call of the step", me)
            except RuntimeError as err:
                errors.append(err)
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
        _pending._PENDING.clear()
    assert errors == []


# ---------------------------------------------------- calls running at their next call


class _Token:
    """A call's output: running until ``fail``/``finish``, then ready (failed or fine)."""

    def __init__(self):
        self.ready, self.error = False, None

    def is_ready(self):
        return self.ready

    def block_until_ready(self):
        if self.error is not None:
            raise self.error
        return self

    def fail(self, error):
        self.ready, self.error = True, error

    def finish(self):
        self.ready = True


class _Ask(_Token):
    """A token that counts the times it is asked whether it is ready."""

    def __init__(self, deleted=False):
        super().__init__()
        self.asked, self.deleted = 0, deleted

    def is_ready(self):
        self.asked += 1
        return self.ready

    def is_deleted(self):
        return self.deleted


def test_the_look_at_a_steps_next_call_asks_each_queued_call_once_and_names_a_failure(pending):
    """``look`` (a step's next call): a loop runs ahead of the device, and asking each new
    queued output whether it is ready cost ~2-4 us a call on CPU. It watches one queued call
    until it ends, then asks the newest; every state of the last call and the watched one."""
    step, err = object(), jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory A")
    where = "the next call of the step"
    assert pending.look(where, step) is None  # no call recorded
    calls = [_Ask() for _ in range(4)]
    pending.record(step, calls[0], _explain)
    assert pending.look(where, step) is None and calls[0].asked == 1  # queued: now watched
    for token in calls[1:3]:  # the next calls, while the watched one is queued: not asked
        pending.record(step, token, _explain)
        assert pending.look(where, step) is None
    assert [t.asked for t in calls[:3]] == [3, 0, 0]  # the watched one: again, cheaply
    calls[0].finish()  # it ended fine: the newest is asked, queued, watched now
    assert pending.look(where, step) is None and calls[2].asked == 1
    pending.record(step, calls[3], _explain)
    calls[2].finish()
    calls[3].finish()  # the newest ended fine: forgotten
    assert pending.look(where, step) is None and step not in pending._PENDING
    failing = _Ask()
    pending.record(step, failing, _explain)
    failing.fail(err)  # ended with an error (the user waited on it): named at the next call
    explained = pending.look(where, step)
    assert isinstance(explained, jaxdev.OutOfMemoryError) and where in str(explained)
    assert explained.__cause__ is err
    assert pending.look(where, step) is None  # raised once: its reads stay explained
    gone = _Ask(deleted=True)  # deleted (an eval step's metrics donated by the user)
    pending.record(step, gone, _explain)
    assert pending.look(where, step) is None and gone.asked == 0 and step not in pending._PENDING
    watched, newest = _Ask(), _Ask()
    pending.record(step, watched, _explain)
    assert pending.look(where, step) is None  # watched
    pending.record(step, newest, _explain)
    watched.deleted = True  # the watched one deleted since: the newest is asked
    newest.fail(err)
    assert isinstance(pending.look(where, step), jaxdev.OutOfMemoryError)


def _explain(err, where):
    return jaxdev.OutOfMemoryError(f"the eval step ran out of memory; it surfaced at {where}")


@pytest.fixture
def pending(monkeypatch):
    monkeypatch.setattr(_pending, "_PENDING", {})
    monkeypatch.setattr(_pending, "_UNSEEN", collections.deque(maxlen=_pending._KEEP))
    # the fake tokens are waited on as they are (quiet_wait takes only a jax.Array)
    monkeypatch.setattr(_pending, "quiet_wait", lambda t: t.block_until_ready(), raising=False)
    return _pending


def test_a_call_that_fails_while_its_next_call_compiles_is_named_where_it_is_read(pending):
    """A call still running at
    its next call's entry check that fails before the next call records itself (while it
    traces/compiles a new batch shape: 0.1-5 s) is dropped unseen: a read of its outputs
    raised JAX's bare RESOURCE_EXHAUSTED (issue-35 review). End to end (eval step, single/pmap; old: named, new: bare):
    /tmp/attack35/item3_window.py single eval."""
    step, err = object(), jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory A")
    first = _Token()
    pending.record(step, first, _explain)
    assert pending.failed("the next call of the step", step) is None  # still running
    first.fail(err)  # ... and fails while the next call compiles
    second = _Token()
    second.finish()  # an eval step's next call: its outputs do not carry the error
    pending.record(step, second, _explain)
    explained = pending.failed("Collection.fetch", again=True, error=err)  # first's metrics
    assert explained is not None, "a read of the failed call's outputs raises JAX's bare error"
    assert "Collection.fetch" in str(explained)


def test_a_call_still_running_at_its_next_call_is_named_where_its_outputs_are_read(pending):
    """Before (issue-35 review): a failed call's outputs are explained only if it had ended by
    its next call's start. The usual loop runs ahead of the device, so a call is still
    running when the next begins; reading its own outputs later (metrics of call N after
    call N+1, an eval step's metrics without chaining) raises JAX's bare error (train and
    eval, single: /tmp/attack35/item3_race.py single eval|train, SLOW=1500)."""
    step, err = object(), jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory A")
    first = _Token()
    pending.record(step, first, _explain)
    assert pending.failed("the next call of the step", step) is None  # still running
    second = _Token()
    pending.record(step, second, _explain)  # the next call is dispatched ...
    first.fail(err)  # ... then the first fails
    second.finish()
    explained = pending.failed("Collection.fetch", again=True, error=err)
    assert explained is not None, "a read of the failed call's outputs raises JAX's bare error"


@pytest.mark.parametrize("analysis", ["None", "all zero"])
@pytest.mark.parametrize("budget", ["memory_limit", "default"])
def test_a_budget_the_backend_cannot_check_is_skipped_not_failed(
    monkeypatch, caplog, analysis, budget
):
    """Without a compiled analysis a step's budget cannot be checked: the user's own
    `memory_limit` was skipped without a word (an all-zero analysis passed it as 0 B); now
    skipped with one warning per step. The default budget (a GPU's) is skipped silently:
    training goes on either way."""
    none = {"None": None, "all zero": types.SimpleNamespace(argument_size_in_bytes=0)}[analysis]
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: none)
    if budget == "default":  # a backend that reports a bytes_limit, as a GPU does
        monkeypatch.setattr(jaxdev.memory._plan, "bytes_limit", lambda device: 1024)
    limit = 1024 if budget == "memory_limit" else None
    step = jaxdev.make_train_step(
        loss_fn, TX, jaxdev.Strategy.sharded(jaxdev.data_mesh()), memory_limit=limit
    )
    state, metrics = step.init_state(_params(), TX), None
    with caplog.at_level(logging.WARNING, "jaxdev"):
        for rows in (64, 128, 64):  # two programs, each checked before its first call
            state, metrics = step(state, step.put_batch(_host_batch(rows)), metrics)
    said = [r.getMessage() for r in caplog.records if "memory analysis" in r.getMessage()]
    assert int(state.step) == 3 and np.isfinite(metrics.fetch()["loss"])
    if budget == "default":
        assert said == []
    else:
        assert len(said) == 1 and "memory_limit=1024 is not checked" in said[0], said
