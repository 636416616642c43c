"""The largest batch that fits a device, found by compiling, never by running.

:func:`fit_memory` (``jaxdev.memory.fit_memory(step, state, example_batch,
limit=...)``) searches the per-device batch size: each candidate is the step
lowered for ``jax.ShapeDtypeStruct`` batches and compiled, and its peak is
:func:`jaxdev.memory.plan`'s (``memory_analysis()``: arguments + outputs - donated
+ temporaries; the one owner of that figure). Doubling from the smallest
batch, then bisecting, it returns the largest batch whose peak is within the
limit, with the table of what it compiled. When even the smallest batch does
not fit, it tries the changes of :mod:`jaxdev.memory._explain` in order of their
cost per step (``rules='fsdp'``: collectives only; ``remat=True``: the
forward pass again; offloading: host transfers every step; then all
together) and searches the batch of the first that fits. When nothing
fits, it raises :class:`jaxdev.MemoryPlanError` with the table.

Accelerate's ``find_executable_batch_size`` finds a batch by running and
catching out-of-memory errors; this never allocates anything but the
compiler's own memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .._errors import MemoryPlanError, UsageError
from .._mesh import check_mesh
from .._report import human_bytes, text_table
from ._explain import (
    BatchRows,
    Variant,
    all_variant,
    batch_for,
    batch_rows,
    fsdp_variant,
    offload_variants,
    remat_variant,
    state_shapes,
)
from ._plan import plan, resolve_limit

DEFAULT_MAX_BATCH = 1 << 16


class FitTrial(NamedTuple):
    """One compiled candidate of :func:`fit_memory`.

    Attributes:
      change: ``"as is"`` or the change (``"Strategy.sharded(mesh, rules='fsdp')"``).
      batch_size: rows per device per update.
      rows: global rows per update.
      peak: compiled bytes per device (``None``: it did not compile).
      fits: ``peak <= limit``.
      note: why it did not compile.
    """

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
      batch_size: the largest rows per device per update whose compiled
        peak is within ``limit``.
      rows: the global rows per update of that batch (what ``put_batch``
        takes per step).
      change: ``None`` when the step fits as it is, else the change that
        made the smallest batch fit (as code).
      step: the step to train with: ``step`` itself, or the changed step.
      batch: the batch's ``ShapeDtypeStruct`` s, laid out for ``step``.
      peak: its compiled peak per device.
      limit: the budget per device.
      source: where ``limit`` came from.
      tried: every compiled candidate, in order.
      capped: the search stopped at ``max_batch_size`` while still fitting
        (larger batches were not tried).
    """

    batch_size: int
    rows: int
    change: str | None
    step: Any
    batch: Any
    peak: int
    limit: int
    source: str
    tried: tuple[FitTrial, ...]
    capped: bool = False

    def __str__(self) -> str:
        """The result line and the table of trials.

        Example:
          >>> import jax, jax.numpy as jnp, optax, jaxdev
          >>> tx = optax.sgd(0.1)
          >>> step = jaxdev.make_train_step(lambda p, b: jnp.tanh(b @ p["w"]).sum(-1), tx)
          >>> state = jax.eval_shape(lambda: jaxdev.TrainState.create(
          ...     {"w": jnp.ones((256, 256))}, tx))
          >>> fit = jaxdev.memory.fit_memory(step, state, jax.ShapeDtypeStruct((8, 256), "float32"),
          ...                         limit=2**20)
          >>> print(str(fit).splitlines()[0])
          largest batch that fits: 255 rows per device (255 rows per step),
          peak 1022.1 KiB of 1.0 MiB (limit)
          >>> print(*str(fit).splitlines()[1:4], sep=chr(10))
          change  batch/device  rows/step  peak/device  fits
          ------  ------------  ---------  -----------  ----
          as is   1             1          259.1 KiB    yes
        """
        return "\n".join([self.headline(), *_table(self.tried)])

    def headline(self) -> str:
        """``largest batch that fits: ...``."""
        budget = f"{human_bytes(self.limit)} ({self.source})"
        how = "" if self.change is None else f" with {self.change}"
        more = " (the largest tried: larger batches may fit too)" if self.capped else ""
        return (
            f"largest batch that fits{how}: {self.batch_size} rows per device ({self.rows} rows "
            f"per step), peak {human_bytes(self.peak)} of {budget}{more}"
        )


def _table(tried: tuple[FitTrial, ...]) -> list[str]:
    """The trials as table lines."""
    head = ("change", "batch/device", "rows/step", "peak/device", "fits")
    body = [
        (
            t.change,
            t.batch_size,
            t.rows,
            "-" if t.peak is None else human_bytes(t.peak),
            t.note or ("yes" if t.fits else "no"),
        )
        for t in tried
    ]
    return text_table(head, body, rstrip=True)


class _Search:
    """Compiles candidates of one step (cached), recording each as a trial."""

    def __init__(self, rows: BatchRows, state: Any, limit: int, tried: list[FitTrial]):
        self.rows, self.state, self.limit, self.tried = rows, state, limit, tried
        self._peaks: dict[tuple[str, int], int | None] = {}

    def peak(self, v: Variant, b: int) -> int | None:
        key = (v.change, b)
        if key not in self._peaks:
            n = v.step.strategy.n_devices
            batch = batch_for(v.step, self.rows, b * n)
            note, peak = "", None
            try:
                shapes = state_shapes(self.state, v.keep_sharding)
                peak = plan(shapes, step=v.step, batch=batch).peak
            except Exception as err:  # a candidate that does not compile does not fit
                note = f"does not compile: {type(err).__name__}"
            fits = peak is not None and peak <= self.limit
            self.tried.append(FitTrial(v.change, b, b * n, peak, fits, note))
            self._peaks[key] = peak
        return self._peaks[key]

    def fits(self, v: Variant, b: int) -> bool:
        peak = self.peak(v, b)
        return peak is not None and peak <= self.limit

    def largest(self, v: Variant, unit: int, most: int) -> tuple[int, bool]:
        """The largest multiple of ``unit`` up to ``most`` that fits (``unit`` fits), capped?"""
        lo, hi = unit, None
        while hi is None:
            nxt = lo * 2
            if nxt > most:
                top = most // unit * unit
                if top <= lo or self.fits(v, top):
                    return max(lo, top), True
                hi = top
            elif self.fits(v, nxt):
                lo = nxt
            else:
                hi = nxt
        while hi - lo > unit:
            mid = lo + (hi - lo) // unit // 2 * unit
            lo, hi = (mid, hi) if self.fits(v, mid) else (lo, mid)
        return lo, False


def fit_memory(
    step: Any,
    state: Any,
    example_batch: Any,
    *,
    limit: int | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH,
) -> MemoryFit:
    """Find the largest per-device batch whose compiled step fits in ``limit``; nothing runs.

    Every candidate batch is a ``jax.ShapeDtypeStruct`` batch with the rows
    of ``example_batch`` (its trailing shapes and dtypes, laid out for the
    step: ``steps_per_call`` and ``accumulate`` group axes, pmap's device
    axis) for which ``step`` is lowered and compiled; its peak is
    :func:`jaxdev.memory.plan`'s (``memory_analysis()``: arguments + outputs -
    donated + temporaries). The search doubles from the smallest batch (one
    row per device, times ``accumulate``), then bisects, so the batch found
    fits and the next larger one (one more row per device, or
    ``accumulate`` more) does not; bisection assumes the peak grows with
    the batch (XLA may lay a larger batch out otherwise, so a batch beyond
    the one found could fit again). When even the smallest batch does not
    fit, the changes are tried in order of their cost per step:
    ``rules='fsdp'`` (collectives only), ``remat=True`` (the forward pass
    again), the optimizer state and then the params offloaded to host memory
    (transfers every step), then all of them together; the batch of the
    first that fits is searched.

    Named ``fit_memory`` rather than ``fit``: in Keras and most trainers
    ``fit`` trains; this compiles only.

    Args:
      step: a :class:`jaxdev.TrainStep` (or :class:`jaxdev.EvalStep`).
      state: the state (arrays or ``ShapeDtypeStruct`` s from ``jax.eval_shape``).
      example_batch: a batch as the step takes it (arrays or shapes); only
        its row shape and dtypes are read.
      limit: bytes per device. Default: the devices' ``bytes_limit`` (GPU,
        TPU); required on CPU, which reports none.
      max_batch_size: the largest rows per device to try.

    Returns:
      A :class:`MemoryFit`; ``print`` it for the table of trials.

    Raises:
      MemoryPlanError: nothing fits: not even the smallest batch, as the
        step is or with any change; the message has the table of trials.
      UsageError: ``step`` is not a jaxdev step; ``limit`` is missing on a
        backend without a limit, or not a number of bytes;
        ``max_batch_size`` is not an int >= 1; ``example_batch`` has no row
        axis where the step needs one.
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
    if not (callable(getattr(step, "lower", None)) and hasattr(step, "config")):
        raise UsageError(
            f"`step` must be a jaxdev step (from `jaxdev.make_train_step` or "
            f"`make_eval_step`), got {type(step).__name__}."
        )
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, (int, np.integer)):
        raise UsageError(f"`max_batch_size` must be an int >= 1, got {max_batch_size!r}.")
    if max_batch_size < 1:
        raise UsageError(f"`max_batch_size` must be an int >= 1, got {max_batch_size}.")
    example = "jaxdev.memory.fit_memory(step, state, batch, limit=16 * 2**30)"
    limit_, source = resolve_limit(limit, check_mesh(step.strategy.mesh), example)
    # under the strategy's mesh: a user's jax.set_mesh of another mesh is named here
    # (ShardingError), not taken for candidates that do not compile ('nothing fits')
    with step.strategy.mesh_context():
        rows = batch_rows(step, example_batch, "example_batch")
        tried: list[FitTrial] = []
        search = _Search(rows, state, limit_, tried)
        for v in _candidates(step, state):
            unit = v.step.accumulate  # 1 for an eval step
            if unit > max_batch_size or not search.fits(v, unit):
                continue
            b, capped = search.largest(v, unit, max_batch_size)
            batch = batch_for(v.step, rows, b * v.step.strategy.n_devices)
            change = None if v.change == "as is" else v.change
            rows_found = b * v.step.strategy.n_devices
            peak = search.peak(v, b)
            return MemoryFit(
                b, rows_found, change, v.step, batch, peak, limit_, source, tuple(tried), capped
            )
    unit = step.accumulate
    raise MemoryPlanError(
        "\n".join(
            [
                f"nothing fits in {human_bytes(limit_)} ({source}): not even {unit} "
                f"row{'s' if unit > 1 else ''} per device, as the step is or with any change "
                "below (each compiled, none run). Use more devices, a smaller model, or raise "
                "the limit if it is wrong.",
                *_table(tuple(tried)),
            ]
        )
    )


def _candidates(step: Any, state: Any):
    """The step as is, then each change in order of cost per step (lazily)."""
    yield Variant("as is", "", step, True)
    for make in (fsdp_variant, remat_variant):
        v = make(step)
        if v is not None:
            yield v
    yield from offload_variants(step, state)
    v = all_variant(step, state)
    if v is not None:
        yield v
