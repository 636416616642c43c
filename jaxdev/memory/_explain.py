"""Why a step does not fit in device memory, and which change would: every figure compiled.

:func:`explain_memory` (``step.explain_memory(state, batch, limit=...)``)
returns a :class:`MemoryExplanation`: what the compiled step needs per device
(``memory_analysis()``: arguments, outputs, donated, temporaries; by
:func:`jaxdev.memory.plan`, the one owner of those figures), what is live on the
devices now by pytree path (:func:`jaxdev.memory`, with old copies of the
state marked), the device limit, and options, each a variant of the step
*compiled* for the same state and batch, never run: ``rules='fsdp'`` over
the mesh, ``accumulate=M``, ``remat=True``, the optimizer state (and params)
offloaded to host memory, half the batch. ``str()`` of it is the text the
step's memory errors carry: the ``memory_limit`` check before the first run
(:func:`jaxdev.memory._plan.check_fits`) and :class:`jaxdev.OutOfMemoryError` when
XLA runs out (``RESOURCE_EXHAUSTED``) during a call.

The batch of a variant is the same global batch laid out for the variant
(:func:`batch_rows` / :func:`batch_for`: steps-per-call and micro-batch group
axes, pmap's device axis), so :func:`jaxdev.memory.fit_memory` builds on the same
functions to search batch sizes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from .._batches import Padded
from .._errors import OutOfMemoryError, UsageError, short
from .._leaves import is_jax_array
from .._mesh import check_mesh
from .._report import human_bytes, text_table
from .._rules import fsdp_axis_of
from ._memory import MemoryLedger, ledger
from ._oom import first_line, is_resource_exhausted, limit_line, live_lines
from ._plan import MemoryPlan, check_fits, plan, resolve_limit, step_plan

_log = logging.getLogger("jaxdev")

OPTIONS = ("fsdp", "accumulate", "remat", "offload", "half_batch")
"""The options :func:`explain_memory` may compile, cheapest per step first."""

# ---------------------------------------------------------------- batches of a layout


class BatchRows(NamedTuple):
    """A batch as rows: what stays when the step's group axes are taken off.

    Attributes:
      treedef: the batch's structure.
      leaves: ``(trailing shape, dtype)`` per leaf (the shape of one row).
      rows: global rows per update (every device, every micro-batch).
      k: the ``steps_per_call`` axis (1: none).
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], Any], ...]
    rows: int
    k: int


def _lead(step: Any) -> tuple[int, int]:
    """``(steps_per_call, accumulate)`` of the batch a step takes (eval steps: 1, 1)."""
    return step.steps_per_call, step.accumulate


def batch_rows(step: Any, batch: Any, arg: str = "batch") -> BatchRows:
    """Read ``batch`` (as ``step`` takes it: placed, Padded, or shapes) as rows per update.

    Raises:
      UsageError: a leaf has too few axes for the step's layout, or the
        leaves disagree on the rows.

    Example:
      >>> import jax, optax, jaxdev
      >>> step = jaxdev.make_train_step(lambda p, b: b @ p, optax.sgd(0.1), accumulate=2)
      >>> batch_rows(step, jax.ShapeDtypeStruct((2, 8, 3), "float32")).rows
      16
    """
    inner = batch.batch if isinstance(batch, Padded) else batch
    leaves, treedef = jax.tree.flatten(inner)
    k, m = _lead(step)
    pmap = step.strategy.kind == "pmap"
    lead = (k > 1) + (m > 1) + pmap
    want = ("(devices, " if pmap else "(") + ("K, " if k > 1 else "") + ("M, " if m > 1 else "")
    out, rows = [], set()
    for x in leaves:
        shape = tuple(np.shape(x))
        if len(shape) <= lead:
            raise UsageError(
                f"`{arg}` leaf of shape {shape} has no row axis: this step takes leaves of "
                f"shape {want}rows, ...) (steps_per_call={k}, accumulate={m})."
            )
        n = shape[0] if pmap else 1
        rows.add(n * m * shape[lead])
        out.append((shape[lead + 1 :], _dtype(x)))
    if len(rows) != 1:
        raise UsageError(f"`{arg}` leaves disagree on their rows: {sorted(rows)}.")
    k_axis = shape[pmap] if k > 1 else 1
    return BatchRows(treedef, tuple(out), rows.pop(), k_axis)


def _dtype(x: Any) -> Any:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    try:
        return jax.dtypes.canonicalize_dtype(dtype)
    except Exception:  # typed PRNG keys: no numpy dtype
        return dtype


def batch_for(step: Any, rows: BatchRows, n_rows: int) -> Any:
    """``ShapeDtypeStruct`` s of a batch of ``n_rows`` global rows per update laid out for ``step``.

    ``n_rows`` should divide by ``accumulate`` (and, under pmap, by
    ``accumulate`` times the devices); a sharded step pads uneven rows
    itself when lowered.

    Example:
      >>> import jax, optax, jaxdev
      >>> step = jaxdev.make_train_step(lambda p, b: b @ p, optax.sgd(0.1), accumulate=2)
      >>> r = batch_rows(step, jax.ShapeDtypeStruct((2, 4, 3), "float32"))
      >>> r.rows, batch_for(step, r, 32).shape
      (8, (2, 16, 3))
    """
    k, m = _lead(step)
    group = ((rows.k,) if k > 1 else ()) + ((m,) if m > 1 else ())
    if step.strategy.kind == "pmap":
        n = step.strategy.n_devices
        lead = (n,) + group + (n_rows // (m * n),)
    else:
        lead = group + (n_rows // m,)
    leaves = [jax.ShapeDtypeStruct(lead + trailing, dtype) for trailing, dtype in rows.leaves]
    return rows.treedef.unflatten(leaves)


def state_shapes(tree: Any, keep_sharding: bool = True) -> Any:
    """``tree`` with each array (deleted ones too) as a ``ShapeDtypeStruct``; nothing is read."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x if keep_sharding else jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, jax.Array):
            sharding = x.sharding if keep_sharding else None
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, _dtype(x))
        return x

    return jax.tree.map(one, tree)


# ---------------------------------------------------------------- variants


def variant(step: Any, strategy: Any = None, **config: Any) -> Any:
    """A step like ``step`` with another strategy or step options (``accumulate``, ``remat``).

    Never called: it is lowered and compiled to read its memory. It has no
    ``memory_limit`` (the figures are what is asked).
    """
    cfg = dataclasses.replace(step.config, **config) if config else step.config
    return type(step)(strategy or step.strategy, cfg, step.steps_per_call, step.donate)


class MemoryOption(NamedTuple):
    """One change of a step and what its compiled program needs per device.

    Attributes:
      change: the change, as code (``"Strategy.sharded(mesh, rules='fsdp')"``).
      what: a few words on it (``"fsdp over 8 devices"``).
      peak: compiled bytes per device (arguments + outputs - donated +
        temporaries), or ``None`` when the variant does not compile.
      temp: its temporaries.
      fits: ``peak <= limit`` (``None`` without a limit or a figure).
      note: why it has no figure, or a remark.
    """

    change: str
    what: str
    peak: int | None
    temp: int | None
    fits: bool | None
    note: str = ""


def _compiled(step: Any, state: Any, batch: Any) -> MemoryPlan:
    return plan(state, step=step, batch=batch)


def option(change: str, what: str, step: Any, state: Any, batch: Any, limit: int | None):
    """Compile ``step`` for ``(state, batch)`` shapes and return its :class:`MemoryOption`."""
    start = time.perf_counter()
    try:
        p = _compiled(step, state, batch)
    except Exception as err:  # an option that does not compile is shown as such
        return MemoryOption(change, what, None, None, None, f"does not compile: {short(err, 160)}")
    finally:
        _log.info("explain_memory: compiled %s (%s) in %.1f s", change, what, _since(start))
    if p.compiled is None:
        return MemoryOption(change, what, None, None, None, "the backend gives no memory analysis")
    fits = None if limit is None else p.peak <= limit
    return MemoryOption(change, what, p.peak, p.compiled.temp, fits)


class Variant(NamedTuple):
    """A changed step, not yet compiled.

    Attributes:
      change: the change, as code.
      what: a few words on it.
      step: the changed step.
      keep_sharding: whether the state's own shardings stay those of the
        changed step's inputs (``False``: lower it from plain shapes).
    """

    change: str
    what: str
    step: Any
    keep_sharding: bool


def fsdp_variant(step: Any) -> Variant | None:
    """``rules='fsdp'`` over the mesh (the same devices), or None when it does not apply.

    Only for replicated params (``rules='replicate'``): ``'fsdp'`` replaces the
    rules, so it would drop a user's own layout (tensor parallelism by flax's
    logical rules, regex rules, ``'fsdp'`` itself). The other options keep it.
    """
    strategy, rules = step.strategy, step.strategy.rules
    if strategy.mesh.size < 2 or not (isinstance(rules, str) and rules == "replicate"):
        return None
    try:
        fsdp = strategy.sharded_like(rules="fsdp")
        axis = fsdp_axis_of(fsdp.mesh, fsdp.options.get("fsdp_axis"))
    except Exception:  # a mesh fsdp cannot use: no option
        return None
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    n = math.prod(fsdp.mesh.shape[a] for a in names)
    change = "Strategy.sharded(mesh, rules='fsdp')"
    return Variant(change, f"fsdp over {n} devices", variant(step, fsdp), False)


def remat_variant(step: Any) -> Variant | None:
    """``remat=True`` (the loss under ``jax.checkpoint``), when the step has not got it."""
    if not step.is_train or step.config.remat:
        return None
    return Variant("remat=True", "loss rematerialised", variant(step, remat=True), True)


def offload_variants(step: Any, state: Any) -> list[Variant]:
    """The optimizer state, then params too, kept in host memory and streamed in by the step."""
    strategy = step.strategy
    if not hasattr(strategy, "offload") or strategy.shard_map:
        return []
    if not step.is_train or getattr(state, "opt_state", None) is None:
        return []
    have, out = set(strategy.offload), []
    for fields in (("opt_state",), ("params", "opt_state")):
        if set(fields) <= have:
            continue
        try:
            changed = strategy.sharded_like(offload=tuple(sorted(have | set(fields))))
        except Exception:  # a strategy offload does not apply to
            break
        text = fields[0] if len(fields) == 1 else fields
        what = "opt_state in pinned_host" if len(fields) == 1 else "params + opt_state in host"
        change = f"Strategy.sharded(mesh, offload={text!r})"
        out.append(Variant(change, what, variant(step, changed), strategy.kind == "sharded"))
    return out


def all_variant(step: Any, state: Any) -> Variant | None:
    """fsdp, remat and params + optimizer state offloaded, together (what can apply)."""
    strategy, changes, config = step.strategy, {}, {}
    if fsdp_variant(step) is not None:
        changes["rules"] = "fsdp"
    if offload_variants(step, state):
        changes["offload"] = ("opt_state", "params")
    if remat_variant(step) is not None:
        config["remat"] = True
    if len(changes) + len(config) < 2:
        return None
    try:
        changed = strategy.sharded_like(**changes) if changes else strategy
    except Exception:  # advice only
        return None
    parts = [f"{k}={v!r}" for k, v in changes.items()] + [f"{k}=True" for k in config]
    keep = not changes or ("rules" not in changes and strategy.kind == "sharded")
    return Variant(", ".join(parts), "all together", variant(step, changed, **config), keep)


def option_of(v: Variant, state: Any, batch: Any, limit: int | None) -> MemoryOption:
    """Compile the variant ``v`` for ``(state, batch)`` shapes: its :class:`MemoryOption`."""
    return option(v.change, v.what, v.step, state_shapes(state, v.keep_sharding), batch, limit)


def _same(step: Any, rows: BatchRows) -> Any:
    return batch_for(step, rows, rows.rows)


def accumulate_options(step, state, rows: BatchRows, limit: int | None) -> list[MemoryOption]:
    """``accumulate=M`` for M = 2, 4, ... times the step's, until one fits (4 compiles at most)."""
    m, n = step.accumulate, _row_devices(step)
    out = []
    for factor in (2, 4, 8, 16):
        big = m * factor
        if rows.rows % (big * n):  # micro-batches the devices split evenly
            break
        s = variant(step, accumulate=big)
        micro = rows.rows // big
        what = f"{big} micro-batches of {micro} row{'s' if micro != 1 else ''}"
        out.append(option(f"accumulate={big}", what, s, state, _same(s, rows), limit))
        if out[-1].fits:
            break
    return out


def _row_devices(step: Any) -> int:
    """How many ways a step splits the batch rows."""
    return step.strategy.n_devices


def half_batch_option(step, state, rows: BatchRows, limit: int | None) -> MemoryOption | None:
    """Half the global batch (rows that still split over the devices and micro-batches)."""
    k, m = _lead(step)
    unit = m * _row_devices(step)
    half = (rows.rows // 2) // unit * unit
    if half < unit or half == rows.rows:
        return None
    what = f"now {rows.rows} rows per step"
    return option(f"a batch of {half} rows", what, step, state, batch_for(step, rows, half), limit)


def memory_options(
    step: Any, state: Any, batch: Any, limit: int | None, names: tuple[str, ...] = OPTIONS
) -> list[MemoryOption]:
    """The options ``names`` (of :data:`OPTIONS`) for ``step`` on ``(state, batch)``, compiled."""
    rows = batch_rows(step, batch)
    shapes = state_shapes(state)
    out: list[MemoryOption | None] = []
    fsdp = fsdp_variant(step) if "fsdp" in names else None
    if fsdp is not None:
        out.append(option_of(fsdp, shapes, _same(fsdp.step, rows), limit))
    if step.is_train:
        if "accumulate" in names:
            out += accumulate_options(step, shapes, rows, limit)
        remat = remat_variant(step) if "remat" in names else None
        if remat is not None:
            out.append(option_of(remat, shapes, _same(remat.step, rows), limit))
        for v in offload_variants(step, shapes) if "offload" in names else ():
            out.append(option_of(v, shapes, _same(v.step, rows), limit))
            if out[-1].fits:
                break
    if "half_batch" in names:
        out.append(half_batch_option(step, shapes, rows, limit))
    return [o for o in out if o is not None]


def check_options(options: Any) -> tuple[str, ...]:
    """``options`` as a tuple of names of :data:`OPTIONS` (one name alone is allowed)."""
    names = (options,) if isinstance(options, str) else options
    try:
        names = tuple(names)
    except TypeError:
        names = (names,)
    if any(n not in OPTIONS for n in names):
        raise UsageError(
            f"`options` must name some of {OPTIONS} (the changes to compile), got {options!r}."
        )
    return names


def _since(start: float) -> float:
    return time.perf_counter() - start


# ---------------------------------------------------------------- explanation


@dataclasses.dataclass(frozen=True)
class MemoryExplanation:
    """What a step needs in device memory, what is live, and which compiled change fits.

    ``str(explanation)`` is the text of the step's memory errors.

    Attributes:
      subject: what needs the memory (``'the train step'``).
      plan: the :class:`jaxdev.memory.MemoryPlan` of the step as it is (compiled:
        ``plan.compiled`` holds ``memory_analysis()``'s figures).
      limit: bytes per device available, or ``None`` when neither given nor
        reported by the backend (CPU).
      source: where ``limit`` came from.
      ledger: the live arrays when it was made (:func:`jaxdev.memory`).
      options: one :class:`MemoryOption` per change, each compiled.
      live: the "live now" lines (largest arrays by path, old copies).
      error: XLA's message when a call ran out of memory.
      compiles: programs compiled to make it (the step, unless its plan was
        given, and each option).
      seconds: the time those compiles took.
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
        fix = f"; fix: {self.advice()}" if self.advice() else ""
        if self.error is not None:
            return f"{self.subject} ran out of device memory ({self.error}){fix}"
        if self.limit is None:
            return f"{self.subject} needs {human_bytes(self.needed)} per device ({self.source})"
        return (
            f"{self.subject} needs {human_bytes(self.needed)} per device, "
            f"{human_bytes(self.limit)} available ({self.source}){fix}"
        )

    def advice(self) -> str:
        """The cheapest compiled option that fits, or that none does (``""``: no limit or options).

        The options are listed cheapest per step first (fsdp: collectives;
        accumulation: smaller passes; remat: the forward pass again;
        offloading: host transfers; half the batch: another update), so the
        advice is the first that fits.
        """
        if self.limit is None or not self.options:
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
        lines = []
        c = self.plan.compiled
        if c is not None:
            lines.append(
                f"compiled step (memory_analysis, per device): arguments "
                f"{human_bytes(c.argument)} + outputs {human_bytes(c.output)} - donated "
                f"{human_bytes(c.alias)} + temporaries {human_bytes(c.temp)} = "
                f"{human_bytes(c.peak)}"
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
            lines += ["  " + line for line in self.option_table()]
        return "\n".join(lines)

    def option_table(self) -> list[str]:
        """The options as table lines."""
        head = ("change", "what", "peak/device", "temporaries", "fits")
        body = [
            (
                o.change,
                o.what,
                "-" if o.peak is None else human_bytes(o.peak),
                "-" if o.temp is None else human_bytes(o.temp),
                o.note or ("?" if o.fits is None else "yes" if o.fits else "no"),
            )
            for o in self.options
        ]
        return text_table(head, body, rstrip=True)

    def __str__(self) -> str:
        return self.headline() + "\n" + self.details()


def explain_memory(
    step: Any,
    state: Any,
    batch: Any,
    limit: int | None = None,
    *,
    metrics: Any = None,
    options: Any = OPTIONS,
    source: str | None = None,
    plan_: MemoryPlan | None = None,
    error: str | None = None,
) -> MemoryExplanation:
    """What ``step(state, batch)`` needs, what is live, and which compiled change fits.

    Nothing runs and nothing is allocated: the step and every option are
    lowered and compiled for the shapes of ``state`` and ``batch``, each
    compile logged (``logging.getLogger("jaxdev")``, INFO) and the count and
    time given in the text. ``TrainStep.explain_memory`` calls it.

    Args:
      step: a :class:`jaxdev.TrainStep` or :class:`jaxdev.EvalStep`.
      state: the state (arrays, deleted ones too, or ``ShapeDtypeStruct`` s).
      batch: the batch as the step takes it (placed, :class:`jaxdev.Padded`,
        or shapes).
      limit: bytes per device; ``None``: the devices' ``bytes_limit`` where
        the backend reports one (CPU reports none: the options are then
        listed without a verdict).
      metrics: the running metrics the call gets, if any.
      options: which changes to compile, some of :data:`OPTIONS`:
        ``"fsdp"``, ``"accumulate"`` (up to 4 compiles), ``"remat"``,
        ``"offload"`` (up to 2), ``"half_batch"``; ``()`` for none.
      source: where ``limit`` came from, for the text.
      plan_: the step's plan, when the caller compiled it already.
      error: XLA's message, when a call ran out of memory.

    Returns:
      A :class:`MemoryExplanation`.

    Raises:
      UsageError: ``options`` names another change, ``limit`` is not a
        number of bytes, or ``batch`` has no row axis where the step needs one.
    """
    names = check_options(options)
    limit, found = resolve_limit(limit, check_mesh(step.strategy.mesh), required=False)
    batch_rows(step, batch)  # a batch the step cannot take is named before compiling
    subject = _subject(step)
    what = f"{subject} and its options" if plan_ is None else f"the options of {subject}"
    _log.info("explain_memory: compiling %s: %s", what, ", ".join(names) or "none")
    start, compiles = time.perf_counter(), int(plan_ is None)
    shapes = state_shapes(state)
    batch_shapes = state_shapes(batch)
    if plan_ is None:
        lowered = step.lower(shapes, batch_shapes, state_shapes(metrics))
        plan_ = step_plan(step, shapes, batch_shapes, lowered)
    trees = {"state": state, "batch": batch}
    ledger, live = _live(trees)
    found_options = memory_options(step, shapes, batch_shapes, limit, names)
    compiles += len(found_options)
    seconds = _since(start)
    _log.info("explain_memory: %d programs compiled in %.1f s", compiles, seconds)
    return MemoryExplanation(
        subject,
        plan_,
        limit,
        source or found,
        ledger,
        tuple(found_options),
        live,
        error,
        compiles,
        seconds,
    )


def _live(trees: dict[str, Any]) -> tuple[MemoryLedger | None, tuple[str, ...]]:
    """The ledger and its "live now" lines, naming the trees that hold arrays.

    A tree of shapes names nothing: given to the ledger, every live array
    shaped like one of its leaves would be flagged as an old copy.
    """
    trees = {k: v for k, v in trees.items() if any(map(is_jax_array, jax.tree.leaves(v)))}
    try:
        book = ledger(**trees)
        return book, tuple(live_lines(book, trees))
    except Exception as e:  # the explanation never fails on the ledger
        return None, (f"live now: could not read the ledger ({type(e).__name__}: {e})",)


# ---------------------------------------------------------------- out of memory


def split_args(args: list[Any]) -> tuple[Any, Any, Any]:
    """``(state, batch, metrics)`` of a compiled step's ``[state, batch, (mask), (metrics)]``.

    A mask makes the batch a :class:`jaxdev.Padded` again.
    """
    state, batch, rest = args[0], args[1], list(args[2:])
    if rest and isinstance(rest[0], jax.Array):
        batch = Padded(batch, rest.pop(0), 0)
    return state, batch, (rest[0] if rest else None)


def _subject(step: Any) -> str:
    """What needs the memory, for the text: ``'the train step'`` or ``'the eval step'``."""
    return f"the {'train' if step.is_train else 'eval'} step"


def explain_args(step: Any, args: list[Any], **kwargs: Any) -> MemoryExplanation:
    """:func:`explain_memory` of a compiled step's arguments (see :func:`split_args`)."""
    state, batch, metrics = split_args(args)
    return explain_memory(step, state, batch, metrics=metrics, **kwargs)


def check_step_memory(step: Any, jitted: Any, args: list[Any]) -> None:
    """Raise MemoryPlanError when the compiled step needs more than its budget.

    Runs once per program (variant and batch shape), before its first
    call: lowers ``jitted`` for ``args`` (JAX caches the executable, so the
    call that follows does not compile again) and hands its plan to
    :func:`jaxdev.memory._plan.check_fits`, the one memory check (the same figures
    and advice as :func:`jaxdev.memory.plan`).
    The budget is ``memory_limit``, else the devices' own (none on CPU:
    nothing to check).
    """
    limit, source = resolve_limit(
        step.memory_limit, step.strategy.devices, required=False, arg="memory_limit"
    )
    if limit is None:
        return
    plan_ = step_plan(step, args[0], args[1], jitted.lower(*args))
    if plan_.compiled is None:  # the backend does not analyse memory
        return
    check_fits(
        plan_,
        limit,
        source=source,
        subject=_subject(step),
        explain=lambda lim, src: explain_args(step, args, limit=lim, source=src, plan_=plan_),
    )


def oom_error(
    step: Any, args: list[Any], err: BaseException, where: str | None = None
) -> OutOfMemoryError | None:
    """The explained :class:`OutOfMemoryError` of a step call's ``err`` (``None``: not an OOM).

    ``args`` are the call's ``[state, batch, (mask), (metrics)]``; donated
    arrays among them may be deleted (their shapes are all that is read).
    ``where``: where an error of an asynchronous call surfaced (a read, the
    next call), said on the second line.
    """
    if not is_resource_exhausted(err):
        return None
    try:
        explanation = explain_args(step, args, error=first_line(err))
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
