"""Why a step does not fit in device memory, which change would, and the largest batch that does.

:func:`explain_memory` compiles the step and each option (fsdp, accumulate,
remat, offload, half the batch) for the same shapes, never runs them; its text
is what the step's memory errors carry. :func:`fit_memory` searches the
per-device batch size the same way. Both take a :class:`StepSpec` (or a step
that carries one) and ask its strategy for every layout.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from .._batches import Padded
from .._errors import MemoryPlanError, OutOfMemoryError, UsageError, short
from .._leaves import inside_trace, is_jax_array, shape_dtype
from .._mesh import axis_size, check_mesh
from .._report import human_bytes, text_table
from .._rules import fsdp_axis_of, is_train_state, unbox
from ._memory import MemoryLedger
from ._oom import first_line, is_resource_exhausted, limit_line, live_now
from ._plan import (
    MemoryPlan,
    check_fits,
    check_leaves,
    check_state,
    fsdp_applies,
    plan,
    resolve_limit,
    step_plan,
)
from ._spec import Described, StepSpec, spec_of

_log = logging.getLogger("jaxdev")

OPTIONS = ("fsdp", "accumulate", "remat", "offload", "half_batch")
"""The options :func:`explain_memory` may compile, cheapest per step first."""

# ---------------------------------------------------------------- batches of a layout


class BatchRows(NamedTuple):
    """A batch as rows: ``(trailing shape, dtype)`` per leaf, global rows per update, K."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], Any], ...]
    rows: int
    k: int


def batch_rows(spec: StepSpec, batch: Any, arg: str = "batch") -> BatchRows:
    """``batch`` (placed, Padded, or shapes) as rows per update, past the step's lead axes."""
    tree = batch.batch if isinstance(batch, Padded) else batch
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        raise UsageError(f"`{arg}` is empty (got {short(batch, 60)}): pass the step's batch.")
    check_leaves(tree, arg)
    k, m, strategy = spec.steps_per_call, spec.accumulate, spec.strategy
    lead = len(strategy.batch_shape(strategy.n_devices * m, k, m)) - 1  # axes before the rows
    lead = 0 if raw_rows(spec, batch) else lead  # pmap splits them itself
    k_at = lead - (m > 1) - 1  # the steps axis, when k > 1
    groups = ((k,) if k > 1 else ()) + ((m,) if m > 1 else ()) if spec.train else ()
    at = lead - len(groups)  # the group axes, after pmap's device axis
    out, rows = [], set()
    for x in leaves:
        shape = tuple(np.shape(x))
        if len(shape) <= lead:
            names = ["K"] * (k > 1) + ["M"] * (m > 1)
            want = ", ".join(["devices"] * (lead - len(names)) + names + ["rows, ...)"])
            raise UsageError(
                f"`{arg}` leaf of shape {shape} has no row axis: this step takes leaves of "
                f"shape ({want} (steps_per_call={k}, accumulate={m})."
            )
        if shape[at:lead] != groups:  # as the step's call refuses it, naming this leaf
            raise UsageError(
                f"`{arg}` has leaf shape {shape}, but this step (steps_per_call={k}, "
                f"accumulate={m}) takes its rows grouped as {groups} from axis {at}. Place it "
                "with `step.put_batch(batch)`: it groups (and pads) the rows."
            )
        rows.add(math.prod(shape[: lead + 1]) // (shape[k_at] if k > 1 else 1))
        out.append((shape[lead + 1 :], shape_dtype(x)[1]))
    if len(rows) != 1:
        raise UsageError(f"`{arg}` leaves disagree on their rows: {sorted(rows)}.")
    return BatchRows(treedef, tuple(out), rows.pop(), shape[k_at] if k > 1 else 1)


def raw_rows(spec: StepSpec, batch: Any) -> bool:
    """Whether the step reads ``batch``'s leading axis as rows it splits over its devices
    itself (:meth:`Strategy.splits_raw`: arrays under pmap not placed one row count per
    device), ungrouped, neither Padded nor shapes (lowered as the pmap program takes them)."""
    grouped = spec.train and (spec.steps_per_call > 1 or spec.accumulate > 1)
    if grouped or isinstance(batch, Padded):
        return False
    shapes = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch))
    return not shapes and spec.strategy.splits_raw(batch)


def batch_for(spec: StepSpec, rows: BatchRows, n_rows: int) -> Any:
    """``ShapeDtypeStruct`` s of ``n_rows`` global rows per update laid out for the step."""
    lead = spec.strategy.batch_shape(n_rows, rows.k, spec.accumulate)
    leaves = [jax.ShapeDtypeStruct(lead + trailing, dtype) for trailing, dtype in rows.leaves]
    return rows.treedef.unflatten(leaves)


def state_shapes(tree: Any) -> Any:
    """``tree`` with each array (deleted ones too) as a ``ShapeDtypeStruct``; nothing is read."""

    def one(x: Any) -> Any:
        if isinstance(x, (jax.Array, np.ndarray)):  # numpy arrays have no sharding
            return jax.ShapeDtypeStruct(*shape_dtype(x), sharding=getattr(x, "sharding", None))
        return x

    return jax.tree.map(one, tree)


# ---------------------------------------------------------------- variants


class MemoryOption(NamedTuple):
    """One change (as code, in words), its compiled peak and temporaries per device, fits?

    ``peak`` is ``None`` when it does not compile (``note`` says why).
    """

    change: str
    what: str
    peak: int | None
    temp: int | None
    fits: bool | None
    note: str = ""


class Variant(NamedTuple):
    """A changed step, not yet compiled: ``change`` as code, ``what`` in words, its ``spec``."""

    change: str
    what: str
    spec: StepSpec


_UNTUNED = "its autotuned compile ran out of device memory (untuned figures)"


def option(v: Variant, state: Any, batch: Any, limit: int | None) -> MemoryOption:
    """Compile the variant ``v`` for ``(state, batch)`` shapes: its :class:`MemoryOption`."""
    change, what, spec = v
    start = time.perf_counter()
    try:
        p = plan(state, step=spec, batch=batch)
    except Exception as err:  # an option that does not compile is shown as such
        return MemoryOption(change, what, None, None, None, f"does not compile: {short(err, 160)}")
    finally:
        took = time.perf_counter() - start
        _log.info("explain_memory: compiled %s (%s) in %.1f s", change, what, took)
    fits = None if limit is None else p.peak <= limit and not p.compiled.untuned
    note = _UNTUNED if p.compiled.untuned else ""
    return MemoryOption(change, what, p.peak, p.compiled.temp, fits, note)


def fsdp_variant(spec: StepSpec) -> Variant | str:
    """``rules='fsdp'`` over the mesh, only for ``rules='replicate'`` (keeps a user's layout);
    else why not."""
    strategy = spec.strategy
    if strategy.mesh.size == 1:
        return "one device: nothing to shard over"
    if not fsdp_applies(strategy.mesh, strategy.rules):
        return f"the params are laid out by rules={strategy.rules!r}, which fsdp would replace"
    try:
        fsdp = strategy.replace(rules="fsdp", shard_map=False)
        n = axis_size(fsdp.mesh, fsdp_axis_of(fsdp.mesh, fsdp.options.get("fsdp_axis")))
    except Exception as err:  # a mesh fsdp cannot use: no option
        return f"fsdp does not apply to this mesh ({short(str(err), 120)})"
    change = "Strategy.sharded(mesh, rules='fsdp')"
    return Variant(change, f"fsdp over {n} devices", spec.replace(fsdp))


def remat_variant(spec: StepSpec, remat: Any = True) -> Variant | str:
    """``remat`` (``True``, a ``jax.checkpoint`` policy, or a step with the model's own remat,
    e.g. per block) for this step; else why not."""
    if not spec.train:
        return "an eval step keeps no activations for a backward pass"
    if isinstance(remat, (StepSpec, Described)):  # model code: its loss and options, our layout
        mine = spec_of(remat, "remat").config  # every option of its config (not its flags)
        options = {f.name: getattr(mine, f.name) for f in dataclasses.fields(mine) if f.init}
        own = spec.replace(**options)
        return Variant("your `remat` step", "the model's own remat", own)
    if remat is not True and not (callable(remat) and not isinstance(remat, type)):
        raise UsageError(
            "`remat` must be True, a `jax.checkpoint_policies` policy (the whole loss under "
            "jax.checkpoint) or a jaxdev train step whose model remats per block (e.g. "
            f"`nnx.remat`), got {remat!r}."
        )
    name = "True" if remat is True else getattr(remat, "__name__", repr(remat))
    if spec.config.remat is remat or (remat is True and spec.config.remat):
        return f"the step has remat={name} already"
    what = "loss rematerialised" if remat is True else f"loss under jax.checkpoint({name})"
    return Variant(f"remat={name}", what, spec.replace(remat=remat))


def offload_variants(spec: StepSpec, state: Any) -> list[Variant] | str:
    """The optimizer state, then params too, kept in host memory and streamed in by the step;
    else why not."""
    strategy, out = spec.strategy, []
    if not spec.train or not is_train_state(state) or state.opt_state is None:
        return "no optimizer state to offload"
    if strategy.shard_map:
        return "shard_map=True keeps the state on the devices"
    have = set(strategy.offload)
    for text in ("opt_state", ("params", "opt_state")):
        fields = {text} if isinstance(text, str) else set(text)
        if fields <= have:
            continue
        try:
            new = strategy.replace(offload=tuple(sorted(have | fields)))
        except Exception as err:  # a strategy offload does not apply to
            return out or f"offload does not apply ({short(str(err), 120)})"
        what = "params + opt_state in host" if "params" in fields else "opt_state in pinned_host"
        out.append(Variant(f"Strategy.sharded(mesh, offload={text!r})", what, spec.replace(new)))
    return out or "params and opt_state are offloaded already"


def memory_options(
    spec: StepSpec,
    state: Any,
    batch: Any,
    limit: int | None,
    names: tuple[str, ...] = OPTIONS,
    remat: Any = True,
) -> list[MemoryOption]:
    """The options ``names`` (of :data:`OPTIONS`) for the step on ``(state, batch)``, compiled.

    ``accumulate=M`` for M = 2, 4, 8, 16 times the step's until one fits, the offloads
    until one fits, and half the batch (rows the devices and micro-batches still split).
    An option that does not apply is listed with the reason, uncompiled.
    """
    rows, out = batch_rows(spec, batch), []
    m, n = spec.accumulate, spec.strategy.n_devices
    per = f"{rows.rows // n} row{'s' * (rows.rows // n != 1)} per device"

    def fits(v: Variant | str | list, name: str, n_rows: int = rows.rows) -> bool:
        if isinstance(v, str):  # why it does not apply, listed uncompiled
            out.append(MemoryOption(name, "skipped", None, None, None, v))
            return False
        for one in v if isinstance(v, list) else [v]:
            out.append(option(one, state, batch_for(one.spec, rows, n_rows), limit))
            if out[-1].fits:
                return True
        return False

    if "fsdp" in names:
        fits(fsdp_variant(spec), "fsdp")
    if "accumulate" in names:  # M the devices split evenly, until one fits
        bigs = [m * 2**i for i in range(1, 5) if spec.train and rows.rows % (m * 2**i * n) == 0]
        what = [f"{b} micro-batches of {rows.rows // b} row{'s' * (rows.rows > b)}" for b in bigs]
        v = [Variant(f"accumulate={b}", w, spec.replace(accumulate=b)) for b, w in zip(bigs, what)]
        why = f"{per}: accumulate={2 * m} needs a multiple of {2 * m} rows per device"
        eval_ = "an eval step has no gradients to accumulate"
        fits((v or why) if spec.train else eval_, "accumulate")
    if "remat" in names:
        fits(remat_variant(spec, remat), "remat")
    if "offload" in names:
        fits(offload_variants(spec, state), "offload")
    half = (rows.rows // 2) // (m * n) * (m * n)
    if "half_batch" in names:
        v = Variant(f"a batch of {half} rows", f"now {rows.rows} rows per step", spec)
        fits(v if m * n <= half != rows.rows else f"{per}: no smaller batch the devices split",
             "half_batch", half)
    return out


# ---------------------------------------------------------------- explanation


@dataclasses.dataclass(frozen=True)
class MemoryExplanation:
    """What a step needs in device memory, what is live, and which compiled change fits.

    ``str(explanation)`` is the text of the step's memory errors.

    Attributes:
      plan: the :class:`jaxdev.memory.MemoryPlan` of the step as it is, compiled.
      limit: bytes per device, ``None`` when neither given nor reported (CPU).
      ledger: the live arrays when it was made (:func:`jaxdev.memory.ledger`).
      live: the "live now" lines (largest arrays by path, old copies).
      error: XLA's message when a call ran out of memory.
      compiles: programs compiled to make it, in ``seconds``.
    """

    subject: str
    plan: MemoryPlan
    limit: int | None
    source: str
    ledger: MemoryLedger | None
    options: tuple[MemoryOption, ...]
    live: tuple[str, ...] = ()
    error: str | None = None
    compiles: int = 0
    seconds: float = 0.0

    @property
    def needed(self) -> int:
        """Bytes per device the step needs (the compiled peak)."""
        return self.plan.peak

    @property
    def fits(self) -> bool | None:
        """``needed <= limit`` (``None`` without a limit)."""
        return None if self.limit is None else self.needed <= self.limit

    def headline(self) -> str:
        """The first line: what ran out, or what is needed against what is available; the fix."""
        fix = f"; fix: {advice}" if (advice := self.advice()) else ""
        fits = ": it fits, nothing to fix" if self.fits and self.error is None else ""
        if self.error is not None:
            return f"{self.subject} ran out of device memory ({self.error}){fix}"
        if self.limit is None:
            return f"{self.subject} needs {human_bytes(self.needed)} per device ({self.source})"
        return (
            f"{self.subject} needs {human_bytes(self.needed)} per device, "
            f"{human_bytes(self.limit)} available ({self.source}){fits}{fix}"
        )

    def advice(self) -> str:
        """The first (cheapest per step) compiled option that fits, or that none does; nothing
        for a step that fits."""
        if self.limit is None or not self.options or (self.fits and self.error is None):
            return ""
        best = next((o for o in self.options if o.fits), None)
        if best is None:
            return (
                f"none of the changes compiled below fits in {human_bytes(self.limit)}: a "
                "smaller batch (`jaxdev.memory.fit_memory` finds the largest), more devices, or a "
                "larger limit if it is wrong"
            )
        return (
            f"{best.change} ({best.what}, {human_bytes(best.peak)} per device: the cheapest "
            "change compiled below that fits)"
        )

    def details(self) -> str:
        """Everything after the headline: compiled figures, live arrays, limit, options."""
        c, lines = self.plan.compiled, []
        if c is not None:
            lines.append(
                f"compiled step (memory_analysis, per device): {c.terms()} = {human_bytes(c.peak)}"
            )
        rows = ", ".join(f"{r.category} {human_bytes(r.bytes_per_device)}" for r in self.plan.rows)
        lines.append(f"state and batch per device (jaxdev.memory.plan): {rows}")
        lines += self.live
        if self.error is not None or self.limit is None:
            lines.append(limit_line(self.plan.mesh.devices.flat))
        if self.options:
            lines.append(
                "options, each compiled for this state and batch (none run; "
                f"{self.compiles} programs compiled in {self.seconds:.1f} s):"
            )
            fits = {None: "?", True: "yes", False: "no"}
            body = [
                (o.change, o.what, _bytes(o.peak), _bytes(o.temp), o.note or fits[o.fits])
                for o in self.options
            ]
            head = ("change", "what", "peak/device", "temporaries", "fits")
            lines += ["  " + line for line in text_table(head, body, rstrip=True)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.headline() + "\n" + self.details()


def explain_memory(
    step: StepSpec | Described,
    state: Any,
    batch: Any,
    limit: int | None = None,
    *,
    metrics: Any = None,
    options: Any = OPTIONS,
    remat: Any = True,
    source: str | None = None,
    plan_: MemoryPlan | None = None,
    error: str | None = None,
) -> MemoryExplanation:
    """What ``step(state, batch)`` needs, what is live, and which compiled change fits.

    Nothing runs: the step and each option are compiled for the shapes of
    ``state`` and ``batch`` (each compile logged at INFO). ``TrainStep.explain_memory``
    calls it.

    Args:
      limit: bytes per device; ``None``: the step's ``memory_limit``, else the devices'
        ``bytes_limit`` or the target's (none on CPU: the options are listed without a verdict).
      options: the changes to compile, some of :data:`OPTIONS` (``()``: none); one
        that does not apply is listed with the reason.
      remat: the ``"remat"`` option: ``True``, a ``jax.checkpoint_policies`` policy (both
        put the whole loss under ``jax.checkpoint``, as the step's ``remat=``), or a
        train step whose model remats per block (``nnx.remat``, ``nn.remat``: model code,
        where remat saves memory), compiled with this step's strategy.
      source: where ``limit`` came from; ``plan_``: the step's plan, when
        compiled already; ``error``: XLA's message after an out-of-memory.

    Raises:
      MemoryPlanError: the backend gives no memory analysis of the step (no peak to explain).
      UsageError, LeafTypeError: a ``state``, ``batch`` or ``metrics`` the step cannot take.
    """
    try:
        names = (options,) if isinstance(options, str) else tuple(options)
    except TypeError:  # not a sequence: refused below
        names = (options,)
    if any(n not in OPTIONS for n in names):
        raise UsageError(
            f"`options` must name some of {OPTIONS} (the changes to compile), got {options!r}."
        )
    spec = spec_of(step)
    limit, by = _limit(limit, spec, required=False)
    batch_rows(spec, batch)  # a batch the step cannot take is named before compiling
    check_state(spec, state, metrics=metrics)
    check_leaves(unbox(state), "state")
    subject = spec.subject
    what = f"{subject} and its options" if plan_ is None else f"the options of {subject}"
    _log.info("explain_memory: compiling %s: %s", what, ", ".join(names) or "none")
    start, compiles = time.perf_counter(), int(plan_ is None)
    shapes, batch_shapes = state_shapes(state), state_shapes(batch)
    if raw_rows(spec, batch):  # rows pmap splits itself: their shapes as it lays them out
        spec.strategy.check_layout(batch, 0)  # rows that read as pmap's layout too: named
        spec.strategy.check_even(batch, 0)
        batch_shapes = batch_for(spec, rows := batch_rows(spec, batch), rows.rows)
    if plan_ is None:
        lowered = spec.lower(shapes, batch_shapes, state_shapes(metrics))
        plan_ = step_plan(spec, shapes, batch_shapes, lowered)
    _log.info("explain_memory: %s needs %s per device", subject, human_bytes(plan_.peak))
    trees = {"state": state, "batch": batch}  # those holding arrays (shapes would flag copies)
    trees = {k: v for k, v in trees.items() if any(map(is_jax_array, jax.tree.leaves(v)))}
    book, live = live_now(trees)
    found = tuple(memory_options(spec, shapes, batch_shapes, limit, names, remat))
    compiles += sum(o.what != "skipped" for o in found)
    seconds = time.perf_counter() - start
    _log.info("explain_memory: %d programs compiled in %.1f s", compiles, seconds)
    return MemoryExplanation(
        subject, plan_, limit, source or by, book, found, tuple(live), error, compiles, seconds
    )


# ---------------------------------------------------------------- out of memory


def explain_args(spec: StepSpec, args: list[Any], **kwargs: Any) -> MemoryExplanation:
    """:func:`explain_memory` of a compiled step's ``[state, batch, (mask), (metrics)]``."""
    state, batch, rest = args[0], args[1], list(args[2:])
    if rest and isinstance(rest[0], jax.Array):
        batch = Padded(batch, rest.pop(0), 0)
    return explain_memory(spec, state, batch, metrics=rest[0] if rest else None, **kwargs)


def check_step_memory(spec: StepSpec, lower: Any, args: list[Any]) -> None:
    """Raise MemoryPlanError before a program's first call when it needs more than its budget
    (``lower()``: its lowering; ``args``: its arguments as the step took them)."""
    limit, source = _limit(None, spec, required=False)
    if limit is None:
        return
    plan_ = step_plan(spec, args[0], args[1], lower())
    if plan_.no_analysis:  # no peak to check: the user's own budget is said to go unchecked
        if spec.memory_limit is not None and "no analysis" not in spec.warned:
            spec.warned.add("no analysis")
            _log.warning("%s: memory_limit=%d is not checked: the %s backend gives no memory "
                         "analysis", spec.subject, spec.memory_limit, plan_.backend)
        return
    explain = functools.partial(explain_args, spec, args, plan_=plan_)  # when it does not fit
    check_fits(plan_, limit, source=source, subject=spec.subject, explain=explain)


def oom_error(
    spec: StepSpec, args: list[Any], err: BaseException, where: str | None = None
) -> OutOfMemoryError | None:
    """The explained :class:`OutOfMemoryError` of a step call's ``err`` (``None``: not an OOM).

    ``args`` may hold deleted (donated) arrays; ``where``: where an asynchronous
    error surfaced (a read, the next call).
    """
    if not is_resource_exhausted(err):
        return None
    try:
        explanation = explain_args(spec, args, error=first_line(err))
        text = str(explanation)
    except Exception as e:  # never hide the out-of-memory behind a second error
        explanation = None
        text = (
            f"the step ran out of device memory ({first_line(err)}); explaining it failed "
            f"({type(e).__name__}: {short(e, 200)})"
        )
    if where is not None:
        head, _, rest = text.partition("\n")
        text = (
            f"{head}\nit surfaced at {where}: JAX runs a step asynchronously, and its error "
            f"appears where its outputs are read\n{rest}"
        )
    exc = OutOfMemoryError(text)
    exc.explanation = explanation
    return exc


# ---------------------------------------------------------------- the largest batch that fits

DEFAULT_MAX_BATCH = 1 << 16


class FitTrial(NamedTuple):
    """One compiled candidate of :func:`fit_memory` (``peak`` None: did not compile)."""

    change: str
    batch_size: int
    rows: int
    peak: int | None
    fits: bool
    note: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """What :func:`fit_memory` found: the largest batch that fits, and how.

    ``print(fit)`` shows the result and the table of every compiled trial.

    Attributes:
      batch_size: the largest rows per device per update that fits; ``rows``: global.
      change: ``None`` when the step fits as it is, else the change (as code).
      step: the step to train with: ``step`` itself, or the changed step.
      batch: the batch's ``ShapeDtypeStruct`` s, laid out for ``step``.
      tried: every compiled candidate, in order.
      capped: stopped at ``max_batch_size`` while still fitting.
      seconds: how long the search took (``len(tried)`` programs compiled).
    """

    batch_size: int
    rows: int
    change: str | None
    step: Described | StepSpec  # a TrainStep or EvalStep (memory does not import train)
    batch: Any
    peak: int
    limit: int
    source: str
    tried: tuple[FitTrial, ...]
    capped: bool = False
    seconds: float = 0.0

    def __str__(self) -> str:
        """The result line and the table of trials (``change  batch/device  ...  fits``)."""
        return "\n".join([self.headline(), *_table(self.tried)])

    def headline(self) -> str:
        """``largest batch that fits: ...``."""
        budget = f"{human_bytes(self.limit)} ({self.source})"
        how = "" if self.change is None else f" with {self.change}"
        more = " (the largest tried: larger batches may fit too)" if self.capped else ""
        return (
            f"largest batch that fits{how}: {self.batch_size} rows per device ({self.rows} rows "
            f"per step), peak {human_bytes(self.peak)} of {budget}{more}; "
            f"{len(self.tried)} programs compiled in {self.seconds:.1f} s"
        )


def _table(tried: tuple[FitTrial, ...]) -> list[str]:
    """The trials as table lines."""
    head = ("change", "batch/device", "rows/step", "peak/device", "fits")
    fits = lambda t: t.note or ("yes" if t.fits else "no")  # noqa: E731
    body = [(t.change, t.batch_size, t.rows, _bytes(t.peak), fits(t)) for t in tried]
    return text_table(head, body, rstrip=True)


def _bytes(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


class _Search:
    """Compiles candidates of one step (cached), recording each as a trial."""

    def __init__(self, rows: BatchRows, state: Any, limit: int):
        self.rows, self.state, self.limit = rows, state, limit
        self.tried: dict[tuple[str, int], FitTrial] = {}
        self.errors: dict[tuple[str, int], Exception] = {}

    def trial(self, v: Variant, b: int) -> FitTrial:
        """``v`` with ``b`` rows per device, compiled once."""
        if (v.change, b) not in self.tried:
            n, note, peak, untuned = v.spec.strategy.n_devices, "", None, False
            batch, start = batch_for(v.spec, self.rows, b * n), time.perf_counter()
            try:
                p = plan(state_shapes(self.state), step=v.spec, batch=batch)
            except Exception as err:  # a candidate that does not compile does not fit
                note, self.errors[v.change, b] = f"does not compile: {type(err).__name__}", err
            else:  # no memory analysis: p.peak raises
                peak, untuned = p.peak, p.compiled.untuned
            fits = peak is not None and peak <= self.limit and not untuned
            note = _UNTUNED if untuned else note
            self.tried[v.change, b] = FitTrial(v.change, b, b * n, peak, fits, note)
            _log.info(
                "fit_memory: %s at %d rows per device: %s, %s (compiled in %.1f s)", v.change,
                b, _bytes(peak), "fits" if fits else note or "does not fit",
                time.perf_counter() - start,
            )
        return self.tried[v.change, b]

    def largest(self, v: Variant, unit: int, most: int) -> tuple[int, bool]:
        """The largest multiple of ``unit`` up to ``most`` that fits (``unit`` fits), capped?

        The peak grows about linearly with the rows: each size compiled is the one a line
        predicts (through the size nearest the limit and the farthest one), so the answer
        comes with the next size, compiled to verify it; after eight lines it bisects.
        """
        top = most // unit * unit
        lo, hi = unit, top + unit  # lo fits; hi does not (top + unit: the cap)
        for rounds in range(2 * most.bit_length() + 8):
            if hi - lo <= unit:
                break
            b = self._predict(v, lo, hi, unit) if rounds < 8 else (lo + hi) // 2 // unit * unit
            b = min(max(b, lo + unit), hi - unit)
            lo, hi = (b, hi) if self.trial(v, b).fits else (lo, b)
        return lo, hi > top

    def _predict(self, v: Variant, lo: int, hi: int, unit: int) -> int:
        """The largest size under the limit on the line through the compiled size nearest
        the limit and the one farthest from it; while the rows add under 1/32 of the peak, at
        most 16 times the largest size compiled (1 and 2 rows at 5.0 MiB projected to the
        cap); a flat line: double, or halve the gap."""
        peaks = [(b, t.peak) for (c, b), t in self.tried.items() if c == v.change and t.peak]
        if len(peaks) < 2:
            return 2 * unit
        b0, p0 = min(peaks, key=lambda bp: abs(self.limit - bp[1]))
        b1, p1 = max(peaks, key=lambda bp: abs(bp[0] - b0))
        slope = (p1 - p0) / (b1 - b0)
        if slope <= 0:
            return min(2 * lo, (lo + hi) // 2 // unit * unit)
        b, top = b0 + int((self.limit - p0) / slope / unit) * unit, max(peaks)[0]
        return min(b, 16 * top) if slope * top < p0 / 32 else b


def _limit(limit: int | None, spec: StepSpec, **kw: Any) -> tuple[int | None, str]:
    """``limit``, else the step's own ``memory_limit``, else the devices' or target's."""
    own = limit is None and spec.memory_limit is not None
    mesh = check_mesh(spec.strategy.mesh)
    arg = "memory_limit" if own else "limit"
    return resolve_limit(spec.memory_limit if own else limit, mesh, arg=arg, **kw)


def fit_memory(
    step: StepSpec | Described,
    state: Any,
    example_batch: Any,
    *,
    limit: int | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH,
) -> MemoryFit:
    """Find the largest per-device batch whose compiled step fits in ``limit``; nothing runs.

    The peak grows linearly with the rows: two sizes are compiled (``accumulate``
    rows per device and twice that), the line through them predicts the answer,
    and the answer and its neighbour are compiled to verify it (a miss redraws
    the line; a few compiles in all, each logged on the ``jaxdev`` logger). When
    even the smallest batch does not fit, the changes are tried cheapest per
    step first (fsdp, remat, offload, all together) and the batch of the first
    that fits is searched.

    Args:
      example_batch: a batch as the step takes it (arrays or shapes); only its
        row shape and dtypes are read.
      limit: bytes per device. Default: the step's ``memory_limit``, else the devices'
        ``bytes_limit`` or the target's; required on CPU.
      max_batch_size: the largest rows per device to try (at least the step's ``accumulate``).

    Raises:
      MemoryPlanError: nothing fits, as the step is or with any change (with the table).
      UsageError: a bad ``step``, ``state``, ``max_batch_size`` or ``example_batch``, or no
        ``limit`` on CPU.
      ShardingError: another mesh than the step's is set with ``jax.set_mesh``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxdev
      >>> tx = optax.adam(1e-3)
      >>> step = jaxdev.make_train_step(lambda p, b: jnp.tanh(b @ p["w"]).sum(-1), tx,
      ...                               jaxdev.Strategy.sharded())
      >>> state = jax.eval_shape(lambda: jaxdev.TrainState.create({"w": jnp.ones((512, 512))}, tx))
      >>> batch = jax.ShapeDtypeStruct((64, 512), "float32")
      >>> fit = jaxdev.memory.fit_memory(step, state, batch, limit=8 * 2**20)
      >>> fit.batch_size, fit.rows, fit.change, fit.peak <= 8 * 2**20
      (1023, 8184, None, True)
      >>> fit = jaxdev.memory.fit_memory(step, state, batch, limit=2 * 2**20)  # adam alone: 3 MiB
      >>> fit.change, fit.batch_size, fit.step.strategy.rules
      ("Strategy.sharded(mesh, rules='fsdp')", 63, 'fsdp')
    """
    if inside_trace():  # its mesh context and compiles: JAX's raw error inside a trace
        raise UsageError(
            "`jaxdev.memory.fit_memory` was called inside a JAX transformation (`jax.jit`, "
            "`jax.grad`, `jax.vmap`, ...), but it compiles the step itself: call it outside "
            "any transformation; it takes `jax.ShapeDtypeStruct` s as they are."
        )
    spec = spec_of(step)
    bad = isinstance(max_batch_size, bool) or not isinstance(max_batch_size, (int, np.integer))
    if bad or max_batch_size < 1:
        got = repr(max_batch_size) if bad else max_batch_size
        raise UsageError(f"`max_batch_size` must be an int >= 1, got {got}.")
    max_batch_size = int(max_batch_size)  # a numpy int has no bit_length
    if max_batch_size < spec.accumulate:  # a device's rows are split into micro-batches
        raise UsageError(
            f"`max_batch_size`={max_batch_size} is under the step's `accumulate`="
            f"{spec.accumulate}: each device needs at least one row per micro-batch; pass "
            f"`max_batch_size` >= {spec.accumulate}."
        )
    example = "jaxdev.memory.fit_memory(step, state, batch, limit=16 * 2**30)"
    limit_, source = _limit(limit, spec, example=example)
    start = time.perf_counter()
    _log.info("fit_memory: the largest batch under %s (%s)", human_bytes(limit_), source)
    with spec.strategy.mesh_context():  # another jax.set_mesh is named, not 'nothing fits'
        rows = batch_rows(spec, example_batch, "example_batch")
        check_state(spec, state)
        check_leaves(unbox(state), "state")
        search = _Search(rows, state, limit_)
        for v in _candidates(spec, state):
            unit = v.spec.accumulate  # 1 for an eval step
            if unit > max_batch_size or not search.trial(v, unit).fits:
                err = search.errors.get((v.change, unit))
                memory = isinstance(err, MemoryPlanError) or is_resource_exhausted(err)
                if v.spec is spec and err is not None and not memory:
                    raise err  # the step itself does not compile: not a question of memory
                continue
            b, capped = search.largest(v, unit, max_batch_size)
            t, tried = search.trial(v, b), tuple(search.tried.values())
            batch = batch_for(v.spec, rows, t.rows)
            change, found = (None, step) if v.spec is spec else (v.change, v.spec.step())
            took = time.perf_counter() - start
            _log.info("fit_memory: %d rows per device; %d compiles in %.1f s", b, len(tried), took)
            return MemoryFit(
                b, t.rows, change, found, batch, t.peak, limit_, source, tried, capped, took
            )
    unit = spec.accumulate
    head = (
        f"nothing fits in {human_bytes(limit_)} ({source}): not even {unit} "
        f"row{'s' if unit > 1 else ''} per device, as the step is or with any change "
        "below (each compiled, none run). Use more devices, a smaller model, or raise "
        "the limit if it is wrong."
    )
    raise MemoryPlanError("\n".join([head, *_table(tuple(search.tried.values()))]))


def _candidates(spec: StepSpec, state: Any) -> Iterator[Variant]:
    """The step as is, then each change in order of cost per step, then all that apply."""
    yield Variant("as is", "", spec)
    fsdp, remat, offload = fsdp_variant(spec), remat_variant(spec), offload_variants(spec, state)
    fsdp, remat, offload = [v if not isinstance(v, str) else None for v in (fsdp, remat, offload)]
    yield from (v for v in (fsdp, remat, *(offload or ())) if v is not None)
    changes = {"rules": "fsdp"} if fsdp else {}
    changes.update({"offload": ("opt_state", "params")} if offload else {})
    config = {"remat": True} if remat else {}
    if len(changes) + len(config) < 2:
        return
    try:
        changed = spec.strategy.replace(**changes, shard_map=False) if changes else None
    except Exception:  # advice only
        return
    parts = [f"{k}={v!r}" for k, v in changes.items()] + [f"{k}=True" for k in config]
    yield Variant(", ".join(parts), "all together", spec.replace(changed, **config))
