"""The largest batch that fits (issue 20), found by compiling, never by running.

For every result: the configuration returned compiles with a peak within the
limit, the next larger batch (one more row per device, ``accumulate`` more
under gradient accumulation) compiles above it, and the batch found really
trains under ``memory_limit``.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdev
from jaxdev.memory._explain import batch_for, batch_rows

TX = optax.adam(1e-3)
MiB = 2**20


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w0"])
    return jnp.mean((h @ params["w1"] - batch["y"]) ** 2, axis=-1)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w0": jnp.asarray(rng.normal(0, 0.05, (64, 256)), jnp.float32),
        "w1": jnp.asarray(rng.normal(0, 0.05, (256, 4)), jnp.float32),
    }


def _state():
    return jax.eval_shape(lambda: jaxdev.TrainState.create(_params(), TX))


def _example(rows: int = 16, lead: tuple[int, ...] = ()) -> dict:
    return {
        "x": jax.ShapeDtypeStruct(lead + (rows, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct(lead + (rows, 4), jnp.float32),
    }


def _peak(step, rows_of, per_device: int) -> int:
    batch = batch_for(step.spec, rows_of, per_device * step.strategy.n_devices)
    return jaxdev.memory.plan(_state(), step=step, batch=batch).peak


def _host(rows: int) -> dict:
    rng = np.random.default_rng(rows)
    return {
        "x": rng.normal(size=(rows, 64)).astype(np.float32),
        "y": rng.normal(size=(rows, 4)).astype(np.float32),
    }


@pytest.mark.parametrize(
    "strategy, options, example",
    [
        (lambda: jaxdev.Strategy.sharded(), {}, _example()),
        (lambda: jaxdev.Strategy.single(), {}, _example()),
        (lambda: jaxdev.Strategy.pmap(), {}, _example(2, (8,))),
        (lambda: jaxdev.Strategy.sharded(), {"accumulate": 2}, _example(8, (2,))),
    ],
    ids=["sharded", "single", "pmap", "accumulate2"],
)
def test_the_batch_found_fits_and_the_next_larger_does_not(strategy, options, example):
    step = jaxdev.make_train_step(loss_fn, TX, strategy(), **options)
    limit = 2 * MiB
    fit = jaxdev.memory.fit_memory(step, _state(), example, limit=limit)
    assert fit.change is None and fit.step is step and not fit.capped
    unit = step.accumulate
    assert fit.batch_size % unit == 0 and fit.batch_size > unit
    assert fit.rows == fit.batch_size * step.strategy.n_devices
    rows_of = batch_rows(step.spec, example)
    assert _peak(step, rows_of, fit.batch_size) == fit.peak <= limit
    assert _peak(step, rows_of, fit.batch_size + unit) > limit
    assert jaxdev.memory.plan(_state(), step=step, batch=fit.batch).peak == fit.peak
    trials = {(t.batch_size, t.fits) for t in fit.tried}
    assert (fit.batch_size, True) in trials and (fit.batch_size + unit, False) in trials
    assert len(fit.tried) <= 12  # lines, each prediction with its neighbour (doubling: ~20)
    text = str(fit)
    assert text.startswith(f"largest batch that fits: {fit.batch_size} rows per device")
    assert "change  batch/device  rows/step  peak/device  fits" in text
    # it really trains at that size under the limit (the step checks before it runs)
    run = jaxdev.make_train_step(loss_fn, TX, strategy(), memory_limit=limit, **options)
    state, metrics = run(run.init_state(_params(), TX), run.put_batch(_host(fit.rows)))
    assert int(state.step) == 1 and np.isfinite(metrics.fetch()["loss"])


def test_when_even_one_row_does_not_fit_the_cheapest_change_is_searched():
    mesh = jaxdev.data_mesh()
    big = {"w0": jnp.zeros((64, 2048)), "w1": jnp.zeros((2048, 4))}  # adam: 1.5 MiB replicated
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(big, TX))
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(mesh))
    limit = MiB
    fit = jaxdev.memory.fit_memory(step, state, _example(), limit=limit)
    assert fit.tried[0].change == "as is" and not fit.tried[0].fits
    assert fit.tried[0].batch_size == 1
    assert fit.change == "Strategy.sharded(mesh, rules='fsdp')"
    assert fit.step.strategy.rules == "fsdp" and fit.step.strategy.mesh == mesh
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    rows_of = batch_rows(step.spec, _example())

    def at(b):
        return jaxdev.memory.plan(
            shapes, step=fit.step, batch=batch_for(fit.step.spec, rows_of, b * 8)
        ).peak

    assert at(fit.batch_size) == fit.peak <= limit < at(fit.batch_size + 1)
    assert str(fit).startswith(
        f"largest batch that fits with Strategy.sharded(mesh, rules='fsdp'): {fit.batch_size} "
    )


def test_the_users_own_rules_are_kept_in_the_change_found():
    """Tensor parallelism by flax's logical rules on data x tensor: fit_memory proposed
    ``rules='fsdp'`` (over 'data' only), silently dropping the rules and tensor parallelism."""
    import flax.linen as nn

    rules = [("embed", None), ("mlp", "tensor")]
    mesh = jaxdev.make_mesh({"data": 4, "tensor": 2})
    strategy = jaxdev.Strategy.sharded(mesh, rules="flax", logical_axis_rules=rules)
    step = jaxdev.make_train_step(loss_fn, TX, strategy)
    boxed = {
        "w0": nn.LogicallyPartitioned(jnp.zeros((64, 2048)), ("embed", "mlp")),
        "w1": nn.LogicallyPartitioned(jnp.zeros((2048, 4)), ("mlp", None)),
    }
    state = step.init_state(boxed, TX)
    assert state.params["w0"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    fit = jaxdev.memory.fit_memory(step, state, _example(), limit=900 * 1024)
    assert fit.tried[0].change == "as is" and not fit.tried[0].fits
    assert "rules=" not in fit.change, fit.change  # offloading fits and keeps the rules
    assert fit.step.strategy.rules == "flax" and fit.step.strategy.mesh == mesh
    assert fit.step.strategy.options == strategy.options  # logical_axis_rules kept
    batch = batch_for(step.spec, batch_rows(step.spec, _example()), 16 * 8)
    why = step.explain_memory(state, batch, limit=900 * 1024)
    assert not [o.change for o in why.options if "rules=" in o.change]
    assert "fsdp" not in why.headline()


def test_nothing_fits_and_the_search_stops_at_max_batch_size():
    """Nothing fitting is an error with the table, never a result whose ``rows`` is None."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single())
    with pytest.raises(jaxdev.MemoryPlanError) as err:
        jaxdev.memory.fit_memory(step, _state(), _example(), limit=1024)
    text = str(err.value)
    assert text.startswith("nothing fits in 1.0 KiB (limit): not even 1 row per device")
    assert re.search(r"\nchange +batch/device +rows/step +peak/device +fits\n", text)
    assert re.search(r"\nas is +1 +1 +[\d.]+ KiB +no\n", text) and "yes" not in text
    capped = jaxdev.memory.fit_memory(step, _state(), _example(), limit=2**30, max_batch_size=40)
    assert capped.batch_size == 40 and capped.capped
    assert [t.batch_size for t in capped.tried] == [1, 2, 40]  # the line predicts past 40
    assert "larger batches may fit too" in str(capped)


@pytest.mark.parametrize("most", [1, 3])
def test_a_max_batch_size_under_accumulate_is_named_not_nothing_fits(most):
    step, example = jaxdev.make_train_step(loss_fn, TX, accumulate=4), _example(8, (4,))
    with pytest.raises(jaxdev.UsageError, match=f"`max_batch_size`={most} is under the step's"):
        jaxdev.memory.fit_memory(step, _state(), example, limit=2**30, max_batch_size=most)
    assert jaxdev.memory.fit_memory(step, _state(), example, limit=2**30, max_batch_size=4)


def test_bad_inputs_are_named():
    step = jaxdev.make_train_step(loss_fn, TX)
    with pytest.raises(
        jaxdev.UsageError, match=r"pass `limit=` .* `jaxdev.memory.fit_memory\(step"
    ):
        jaxdev.memory.fit_memory(step, _state(), _example())
    with pytest.raises(jaxdev.UsageError, match="`limit` must be a number of bytes"):
        jaxdev.memory.fit_memory(step, _state(), _example(), limit="1GB")
    for bad in (0, 2.5, True):
        with pytest.raises(jaxdev.UsageError, match="`max_batch_size` must be an int >= 1"):
            jaxdev.memory.fit_memory(step, _state(), _example(), limit=MiB, max_batch_size=bad)
    with pytest.raises(jaxdev.UsageError, match="`step` must be a jaxdev step"):
        jaxdev.memory.fit_memory(loss_fn, _state(), _example(), limit=MiB)
    with pytest.raises(jaxdev.UsageError, match="`example_batch` leaf of shape \\(\\) has no row"):
        jaxdev.memory.fit_memory(step, _state(), {"x": jnp.float32(1)}, limit=MiB)


@pytest.mark.parametrize(
    "options, example, shape",
    [
        ({"steps_per_call": 2}, _example(16, (3,)), r"\(3, 16, 64\)"),  # K=3, the step's 2
        ({"steps_per_call": 2}, _example(16), r"\(16, 64\)"),  # not grouped at all
        ({"accumulate": 2}, _example(8, (4,)), r"\(4, 8, 64\)"),
    ],
    ids=["other K", "no K", "other M"],
)
def test_an_example_batch_grouped_otherwise_than_the_step_is_named_as_given(
    options, example, shape
):
    """fit_memory named `batch` and a shape the user never passed (its own rebuilt one), or
    said the leaves disagree on their rows; accumulate read (4, 8, 64) as 32 rows."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded(), **options)
    match = rf"`example_batch` has leaf shape {shape}, but this step .* grouped as"
    with pytest.raises(jaxdev.UsageError, match=match):
        jaxdev.memory.fit_memory(step, _state(), example, limit=MiB, max_batch_size=8)


def test_a_numpy_max_batch_size_and_a_call_inside_jit():
    """``max_batch_size=np.int64(4)`` passed the check, then raised AttributeError
    (bit_length); inside ``jax.jit`` it was JAX's raw ValueError of ``get_mesh``."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.sharded())
    most = np.int64(4)
    fit = jaxdev.memory.fit_memory(step, _state(), _example(), limit=MiB, max_batch_size=most)
    assert fit.batch_size == 4 and fit.capped
    with pytest.raises(jaxdev.UsageError, match=r"`jaxdev.memory.fit_memory` was called inside"):
        jax.jit(lambda: jaxdev.memory.fit_memory(step, _state(), _example(), limit=MiB).rows)()


def test_the_search_fits_a_line_and_verifies_the_answer_in_a_few_compiles(caplog):
    """It compiled once per trial, doubling then bisecting (265 s at 1B, 4 compiles, where
    the peak grew linearly with the rows: 15.0, 26.5, 37.9, 49.4 GiB for 1-4 rows)."""
    import logging

    def wide(params, batch):  # rows of 256 tokens: activations dominate from one row on
        h = jnp.tanh(batch["x"] @ params["w0"])
        return jnp.mean((h @ params["w1"] - batch["y"]) ** 2, axis=(-1, -2))

    params = {"w0": jnp.zeros((64, 1024)), "w1": jnp.zeros((1024, 4))}
    tx = optax.sgd(0.1)
    state = jax.eval_shape(lambda: jaxdev.TrainState.create(params, tx))
    step = jaxdev.make_train_step(wide, tx, jaxdev.Strategy.sharded())
    example = {
        "x": jax.ShapeDtypeStruct((8, 256, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((8, 256, 4), jnp.float32),
    }
    with caplog.at_level(logging.INFO, logger="jaxdev"):
        fit = jaxdev.memory.fit_memory(step, state, example, limit=64 * MiB)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "fit_memory: as is at ")]
    assert len(compiled) == len(fit.tried) <= 4, compiled  # two sizes, the answer and the next
    assert [t.fits for t in fit.tried[-2:]] == [True, False]
    assert [t.batch_size for t in fit.tried[-2:]] == [fit.batch_size, fit.batch_size + 1]
    for b, fits in ((fit.batch_size, True), (fit.batch_size + 1, False)):  # compiled again
        batch = batch_for(step.spec, batch_rows(step.spec, example), b * 8)
        assert (jaxdev.memory.plan(state, step=step, batch=batch).peak <= 64 * MiB) is fits
    assert re.search(rf"; {len(fit.tried)} programs compiled in [\d.]+ s$", fit.headline())
    last = caplog.records[-1].getMessage()
    assert fit.seconds > 0
    assert re.fullmatch(r"fit_memory: \d+ rows per device; \d+ compiles in [\d.]+ s", last)


def test_a_flat_start_goes_16x_out_instead_of_projecting_to_the_cap():
    """1 and 2 rows both ~5.0 MiB: the near-zero slope projected to the cap (a 65536-rows
    program compiled, 12 compiles in all); a prediction goes at most 16 times further out."""
    from jaxdev.memory._explain import FitTrial, _Search

    search = _Search(None, None, 48 * MiB)
    for b, peak in ((1, 5 * MiB), (2, 5 * MiB + 4096)):
        search.tried["as is", b] = FitTrial("as is", b, 8 * b, peak, True, "")
    assert search._predict(SimpleNamespace(change="as is"), 2, 65537, 1) == 32
    search.tried["as is", 4] = FitTrial("as is", 4, 32, 8 * MiB, True, "")  # a real line
    assert search._predict(SimpleNamespace(change="as is"), 4, 65537, 1) == 44


def test_a_backend_without_memory_analysis_is_named_not_called_fitting(monkeypatch):
    """Where ``compiled.memory_analysis()`` is None (a backend that does not analyse memory),
    the plan's peak is only the state's and batch's bytes: the search called a batch fitting
    from them (any size up to the cap 'fit'). It is refused by name instead."""
    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single())
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: None)
    with pytest.raises(jaxdev.MemoryPlanError, match=r"this backend \(cpu\) gives none"):
        jaxdev.memory.fit_memory(step, _state(), _example(), limit=2**30, max_batch_size=64)


NO_ANALYSIS = {  # what a backend's `compiled.memory_analysis()` may give that says nothing
    "None": lambda self: None,
    "no fields": lambda self: SimpleNamespace(),
    "all zero": lambda self: SimpleNamespace(
        **{f"{k}_size_in_bytes": 0 for k in ("argument", "output", "alias", "temp")}
    ),
}
CLI_MODEL = os.path.join(os.path.dirname(__file__), "test_memory_cli.py") + ":tiny"


@pytest.mark.parametrize("analysis", list(NO_ANALYSIS))
@pytest.mark.parametrize("question", ["plan.fits", "explain_memory", "fit_memory", "cli"])
def test_no_memory_analysis_is_never_called_fitting(monkeypatch, capsys, analysis, question):
    """Without a compiled analysis (None, or one without figures) plan.fits() and
    explain_memory said "fits" from the state's and batch's bytes alone (the CLI: "it fits,
    nothing to fix"); an empty analysis read as a peak of 0 B everywhere (fit_memory: 65536
    rows, peak 0 B). Each fit question is refused by name; the plan's rows still come."""
    from jaxdev.cli._cli import main

    step = jaxdev.make_train_step(loss_fn, TX, jaxdev.Strategy.single())
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", NO_ANALYSIS[analysis])
    p = jaxdev.memory.plan(_state(), step=step, batch=_example())  # its rows: still a plan
    assert p.compiled is None and p["params"] == 4 * (64 * 256 + 256 * 4)
    assert "compiled step: the cpu backend gives no memory analysis" in str(p)
    ask = {
        "plan.fits": lambda: p.fits(2**30),
        "explain_memory": lambda: step.explain_memory(_state(), _example(), limit=2**30),
        "fit_memory": lambda: jaxdev.memory.fit_memory(step, _state(), _example(), limit=2**30),
    }
    if question == "cli":
        args = ["memory", "--model", CLI_MODEL, "--limit", "1", "--options", "remat"]
        assert main(args) == 1
        out, err = capsys.readouterr()
        assert "fits" not in out and "MemoryPlanError" in err and "gives none" in err, (out, err)
        assert "Traceback" not in err  # a named error explains itself in one line
        return
    with pytest.raises(jaxdev.MemoryPlanError, match=r"this backend \(cpu\) gives none"):
        ask[question]()
