"""The step meter: where a training loop's wall time went, with no host sync of its own.

jaxdev's steps tell it what they dispatched (:mod:`jaxdev._timeline`); a daemon thread notes
when the device finished them (:class:`StepMeter` says how often). The device was busy from a
step's dispatch (or the previous step's end) to its end; in the gaps it waited for the host,
and the host's own record (input waits, host syncs, compiles, checkpoint saves, eval
dispatches) says what for. A gap's part no record covers is the host's own work ("other"),
but after a sync that drained the device: up to the device time it could have overlapped.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
import numbers
import sys
import threading
import time
from collections import Counter
from typing import Any

import jax

from .. import _guards, _timeline
from .._errors import UsageError
from . import _render

PEAKS = (  # (device_kind contains, dense bf16 FLOP/s per device, source)
    ("H100 PCIe", 756e12, "NVIDIA H100 datasheet, PCIe, bf16 dense"),
    ("H100", 989e12, "NVIDIA H100 datasheet, SXM, bf16 dense"),
    ("H200", 989e12, "NVIDIA H200 datasheet, bf16 dense"),
    ("A100", 312e12, "NVIDIA A100 datasheet, bf16 dense"),
    ("TPU v4", 275e12, "Google Cloud TPU v4 docs, bf16 per chip"),
    ("TPU v5 lite", 197e12, "Google Cloud TPU v5e docs, bf16 per chip"),
    ("TPU v5", 459e12, "Google Cloud TPU v5p docs, bf16 per chip"),
    ("TPU v6", 918e12, "Google Cloud TPU v6e (Trillium) docs, bf16 per chip"),
)
SHARES = ("step", "eval", "input", "sync", "compile", "checkpoint", "other")
_RANK = {"input": 1, "sync": 2, "eval": 3, "checkpoint": 4, "compile": 5}  # overlaps: higher wins
_EVERY, _POLL = 0.05, 2e-3  # the watcher looks 50 ms after it saw a step end; 2 ms apart
_CATCH = 64  # steps found done, one after another, before the newest is taken as it is


_watcher: threading.Thread | None = None
_wake = threading.Event()  # set while meters are on
_entering = threading.Lock()  # a meter's thread check and listen, one meter at a time


def _watch() -> None:
    """One thread for all meters: each looks at its newest step; after a step seen ending
    it sleeps ``_EVERY``, else it waits for the next dispatch (or ``_EVERY``; ``_POLL`` at
    least while the newest steps are found done: tiny steps wake it no more)."""
    with _guards._outermost("host"):  # its waits are not the user's: never counted
        while _wake.wait():
            _timeline.dispatch.clear()
            _timeline.waiting = True  # the next dispatch sets it
            meters = [m for m in _timeline.listeners if isinstance(m, StepMeter)]
            soon = [m._look() for m in meters]  # a list: every meter looks
            if any(soon):
                if 2 in soon:  # catching
                    time.sleep(_POLL)
                _timeline.dispatch.wait(_EVERY)
                continue
            _timeline.waiting = False
            if not meters:
                _wake.clear()
                if _timeline.listeners:  # one came in meanwhile
                    _wake.set()
            time.sleep(_EVERY)


def peak_flops(kind: str) -> tuple[float, str] | None:
    """``(FLOP/s, source)`` of a device kind (``jax.Device.device_kind``), or ``None``."""
    return next(((f, src) for name, f, src in PEAKS if name in kind), None)


@dataclasses.dataclass(frozen=True)
class MeterReport:
    """Where a metered block's wall time went: see :class:`StepMeter`.

    Attributes:
      wall: seconds from entering the block to its last step's end.
      seconds: per share (:data:`SHARES`): the device computing train steps (``step``) or
        eval steps, else idle while the host waited for input, synced, compiled, saved a
        checkpoint, or did ``other`` work; they add up to ``wall``.
      syncs: ``(what at file:line, count, seconds the host waited)`` per call site (the
        reads a checkpoint save makes are the save's time, not listed).
      steps: train steps run (a call of ``steps_per_call=K`` counts K); in a block that
        ran no train step, the eval steps (an eval loop's rates are its own).
      rates: ``steps/s``, ``examples/s``, ``tokens/s`` (those known).
      flops_per_device: FLOP/s per device from XLA's cost analysis, or ``None``.
      mfu: its share of the device's peak, or ``None``; ``peak``: what that peak is.
      lanes: the last steps' ``(lane, start, end)`` (seconds into the block) for :meth:`plot`.
    """

    wall: float
    seconds: dict[str, float]
    syncs: tuple[tuple[str, int, float], ...]
    steps: int
    rates: dict[str, float]
    flops_per_device: float | None
    mfu: float | None
    peak: str
    lanes: tuple[tuple[str, float, float], ...] = ()

    def table(self) -> Any:
        """The shares as a rich table, over a line of rates (``console.print(r.table())``)."""
        return _render.table(self)

    def plot(self, path: str) -> str:
        """Draw the last steps' timeline and the shares into ``path`` (``.png`` added without a
        suffix; needs matplotlib, leaves pyplot alone); return the file written."""
        return _render.plot(self, path)

    def __str__(self) -> str:
        return _render.text(self)


class StepMeter:
    """Meter a training loop: ``with StepMeter(...) as m:`` around it, ``m.report()`` after.

    jaxdev's train and eval steps, ``prefetch_to_device``, checkpoint saves and host syncs
    (``float(loss)``, ``jax.device_get``, ``np.asarray`` of device arrays) are seen as they
    are; wrap any other loader in :meth:`inputs`. The meter adds no sync, and a step pays
    two clock reads, a readiness check and two appends: one thread for all meters waits for
    the newest step while it runs, so a step's end is exact there; 50 ms after a step it saw
    end it looks again, and waits for the next dispatch while the newest is done already
    (after 64 such, or at leaving, one done counts as ending at its dispatch, or where a sync
    that waited for it ended). Between exact ends the device runs its programs in order, and
    a queue model (each step of the batch took the same time, from its dispatch or the
    previous one's end) places them, bounded by the syncs that found them done. A call that
    returned its step done ran it (XLA:CPU runs some programs inline): its time beyond the
    program's quickest call is the device's. Leaving the block waits for the steps in flight.
    One thread's loop at a time.

    Args:
      examples_per_step: examples in one step's batch (global), for ``examples/s``.
      tokens_per_step: tokens in one step's batch, for ``tokens/s``.
      last: how many of the last steps :meth:`MeterReport.plot` draws.

    Raises:
      UsageError: an argument is not a number > 0 (or ``None``); the meter is entered twice.

    Example:
      >>> import jax.numpy as jnp, optax, jaxdev
      >>> loss = lambda p, b: ((b["x"] @ p["w"]) ** 2)[:, 0]  # one loss per example
      >>> step = jaxdev.make_train_step(loss, optax.sgd(0.1), jaxdev.Strategy.single())
      >>> state = step.init_state({"w": jnp.ones((4, 1))}, optax.sgd(0.1))
      >>> batches = (step.put_batch({"x": jnp.ones((16, 4))}) for _ in range(3))
      >>> with jaxdev.meter.StepMeter(examples_per_step=16) as m:
      ...     for batch in m.inputs(batches):
      ...         state, _ = step(state, batch)
      >>> m.report().steps
      3
    """

    def __init__(
        self, examples_per_step: float | None = None, tokens_per_step: float | None = None,
        last: int = 20,
    ):
        for name, value in (("examples_per_step", examples_per_step),
                            ("tokens_per_step", tokens_per_step), ("last", last)):
            count = name == "last"  # a count of steps: whole, never None
            if (value is not None or count) and (isinstance(value, bool) or not (
                    isinstance(value, numbers.Integral if count else numbers.Real)
                    and 0 < value < math.inf)):
                kind = "number > 0, a whole one" if count else "number > 0 (or None)"
                raise UsageError(f"`{name}` must be a {kind}, got {value!r}.")
        self.examples, self.tokens, self.last = examples_per_step, tokens_per_step, int(last)
        self._t0 = self._t1 = 0.0
        self._tid: int | None = None  # the loop's thread, while in the block
        self._first, self._kept = 0, None  # its first call in _timeline.times; its record
        self._looks: list[tuple[int, float]] = []  # (step, when the watcher saw it end)
        self._synced: list[tuple[int, float, bool]] = []  # (step, ended by, a sync waited)
        self._host: list[tuple[str, float, float, str]] = []  # (label, start, end, where)
        self._lock = threading.Lock()  # one look at a time (the watcher's, leaving's)
        self._catch = 0  # the step count when its newest steps began to be found done

    def __enter__(self) -> StepMeter:
        global _watcher
        if self._t0:
            raise UsageError("A StepMeter meters one block: make a new one for the next.")
        with _entering:
            if other := [m for m in _timeline.listeners if m._tid != threading.get_ident()]:
                raise UsageError(
                    f"A StepMeter is on in thread {other[0]._tid}, and this one would be in "
                    f"thread {threading.get_ident()}: jaxdev meters one thread's loop at a time "
                    "(each would count the other's steps). Meter one loop, or leave the other's "
                    "block first."
                )
            self._tid = threading.get_ident()
            self._guard = _guards.count_transfers(implicit=False)  # intercepts syncs, compiles
            self._guard.__enter__()
            self._t0 = time.perf_counter()
            self._first = _timeline.listen(self)
        if _watcher is None or not _watcher.is_alive():  # one for all meters (and a fork's)
            _watcher = threading.Thread(target=_watch, name="jaxdev-meter", daemon=True)
            _watcher.start()
        _wake.set()
        return self

    def __exit__(self, *exc: Any) -> None:
        now = time.perf_counter()
        try:
            with _guards._outermost("host"):  # waits for the steps in flight: not the user's
                self._look(final=True)
        finally:  # it leaves, and its counting wrappers go, whatever happened (a Ctrl-C too)
            self._kept = self._record()
            _timeline.leave(self)
            self._guard.__exit__(None, None, None)
            self._t1 = max([now, *[t for _, t in self._looks[-1:]]])  # or its last step's end
            self._tid = None  # its inputs() after the block are not its own

    def _look(self, final: bool = False) -> int:
        """Note when the newest step ended: wait for it while it runs. One found done is
        taken as ending at its dispatch (or at the end of a sync that waited for it) at
        leaving, or when ``_CATCH`` steps came done one after another; until then the watcher
        waits for the next dispatch to catch that one running. Returns whether to wait for
        the next dispatch: 1 (nothing new), 2 (catching), else 0."""
        with self._lock:
            if self._kept is not None:  # it left (the watcher took it before): later steps
                return 0  # are not its own
            (n, token), done = _timeline.newest, len(self._looks) and self._looks[-1][0] + 1
            n -= self._first
            if n <= done or token is None:
                return 1
            # deleted (never a step's own token; a guard): it ended (jax 0.10.2 segfaults
            ready = token.is_deleted() or token.is_ready()  # on is_ready)
            seen, g = self._catch or n, self._first + n  # g: its number in _timeline.times
            if ready and not final and n - seen < _CATCH:
                self._catch = seen
                self._synced.append((n - 1, time.perf_counter(), False))  # it ended by now
                return 2
            if not ready:
                with contextlib.suppress(Exception):  # a failed step: its reads raise
                    token.block_until_ready()
                _timeline.ended = (g, time.perf_counter())  # exact: every meter's (nested)
            if _timeline.ended[0] == g:
                end = _timeline.ended[1]
            else:  # done: by its dispatch, or when a sync that waited for it ended
                end = max([_timeline.times[2 * g - 1],
                           *[e for j, e, waited in self._synced if j == n - 1 and waited]])
            self._looks.append((n - 1, end))
            self._catch = 0
            return 0

    def inputs(self, iterable: Any) -> Any:
        """Yield ``iterable``'s items, timing each wait for the next as input (inside the
        block; outside it they pass untimed).

        Raises:
          UsageError: ``iterable`` is not iterable.
        """
        try:
            items = iter(iterable)
        except TypeError:
            raise UsageError(
                f"`StepMeter.inputs` expects an iterable of batches, got {type(iterable).__name__}."
            ) from None
        return self._timed(items)

    def _timed(self, items: Any) -> Any:
        start = time.perf_counter()
        for item in items:
            self.on_host("input", start, time.perf_counter(), "")
            yield item
            start = time.perf_counter()

    # -------------------------------------------------- what _timeline tells it

    def on_host(self, label: str, start: float, end: float, where: str, waited=False) -> None:
        """``waited``: a sync that began with the newest step running (``_timeline.host``)."""
        if threading.get_ident() == self._tid:  # the loop's thread only, inside the block
            self._host.append((label, start, end, where))
            n, token = _timeline.newest
            if label == "sync" and token is not None and n > self._first:
                if not token.is_deleted() and token.is_ready():  # it and all before it ended
                    self._synced.append((n - 1 - self._first, end, waited))  # by its end

    def _record(self) -> tuple[Any, Any, list[tuple]]:
        """Its step calls' starts and ends, whether each returned its step done, and
        ``(first call, step, key, compiled)`` runs."""
        if self._kept is not None:
            return self._kept
        first = self._first
        runs = [(i - first, *run) for i, *run in _timeline.runs if i >= first]
        return _timeline.times[2 * first:], _timeline.done[first:], runs

    # ------------------------------------------------------------ the report

    def report(self) -> MeterReport:
        """The summary of the block (inside it: of the steps seen ending so far, at the
        watcher's looks).

        Raises:
          UsageError: the meter was never entered.
        """
        if not self._t0:
            raise UsageError("`StepMeter.report` reports a block: enter the meter (`with`) first.")
        (times, ran, changes), t0 = self._record(), self._t0
        t1, n = self._t1 or time.perf_counter(), len(times) // 2
        starts, ends = times[::2], times[1::2]
        compiles = {a for a, _, _, compiled in changes if compiled}  # its dispatch compiled
        host, kinds, calls = list(self._host), [], []  # calls: each one's (step, program key)
        fastest: dict[tuple, float] = {}  # a program's quickest dispatch: the host's own part
        for (a, step, key, compiled), b in zip(changes, [a for a, *_ in changes[1:]] + [n]):
            if compiled:
                host.append(("compile", starts[a], ends[a], ""))
            if not step.is_train:
                host += [("eval", starts[i], ends[i], "") for i in range(a, b)]
            kinds += [step.is_train] * (b - a)
            calls += [(step, key)] * (b - a)
            for i in range(a + compiled, b):
                fastest[step, key] = min(fastest.get((step, key), math.inf), ends[i] - starts[i])
        flops = {c: c[0].cost(c[1]) for c in set(calls)}  # each program's, computed once
        done = self._finishes(times, [flops[c] for c in calls] if all(flops.values()) else None)
        runs = [(*c, k) for c, k in Counter(calls[: len(done)]).items()]  # (step, key, calls)
        busy, prev = [], t0  # each step's (a step done at once: from its dispatch, for 0 s)
        for i, (end, finish, train) in enumerate(zip(ends, done, kinds)):
            if ran[i] and i not in compiles:  # it ran in its call (past its quickest call)
                end, finish = min(starts[i] + fastest[calls[i]], end), min(finish, end)
            start = max(end, prev)
            busy.append((start, prev := max(finish, start), "step" if train else "eval"))
        seconds = dict.fromkeys(SHARES, 0.0)
        for s, e, label in busy:
            seconds[label] += e - s
        segments = _flatten([h[:3] for h in host])
        starts = [s for s, _, _ in segments]
        before = [(t0, t0)] + [(s, e) for s, e, _ in busy]  # the device's work before a gap
        for (given, a), b in zip(before, [s for s, _, _ in busy] + [t1]):
            if b > a:  # a gap between the device's busy spans
                _attribute(a, b, given, segments, starts, seconds)
        syncs: dict[str, list] = {}
        saves = [(s, e) for label, s, e, _ in host if label == "checkpoint"]
        for label, s, e, where in host:  # a save's own reads are its share, not a sync site
            if label == "sync" and not any(a <= s and e <= b for a, b in saves):
                n, secs = syncs.get(where, (0, 0.0))
                syncs[where] = [n + 1, secs + e - s]
        return MeterReport(
            t1 - t0, seconds, tuple((w, n, s) for w, (n, s) in syncs.items()),
            *self._rates(runs, t1 - t0), *self._lanes(busy, segments, t0),
        )

    def _finishes(self, times: Any, weights: list | None) -> list[float]:
        """When the device finished each step the watcher saw end, by the queue model: each
        call took ``c`` times its weight (its program's FLOPs, else 1)."""
        out, prev, lo = [], self._t0, 0
        for i, t in list(self._looks):
            ends = times[2 * lo + 1 : 2 * i + 2 : 2]  # each starts at max(end, prev)
            w = weights[lo : i + 1] if weights else [1.0] * len(ends)
            t = max(t, prev)  # a step seen done at a look: from its dispatch on
            rest = list(itertools.accumulate(reversed(w)))[::-1]  # the weight from each on
            chains = [(prev, rest[0]), *zip(ends, rest)]
            c = max(min((t - base) / m for base, m in chains), 0.0)  # the last ends at t
            for e, wk in zip(ends, w):
                out.append(prev := min(max(e, prev) + c * wk, t))
            out[-1] = prev = t
            lo = i + 1
        marks, bound = sorted(self._synced), math.inf  # in order: ended by a later one's sync
        for j in range(len(out) - 1, -1, -1):
            while marks and marks[-1][0] >= j:
                bound = min(bound, marks.pop()[1])
            out[j] = min(out[j], bound)
        return out

    def _rates(self, runs: list[tuple], wall: float) -> tuple:
        train = [r for r in runs if r[0].is_train] or runs  # an eval loop: its eval steps
        steps = sum(st.steps_per_call * n for st, _, n in train)
        rates = {"steps/s": steps / wall} if wall > 0 else {}
        for name, per in (("examples/s", self.examples), ("tokens/s", self.tokens)):
            if per is not None and wall > 0:
                rates[name] = steps * per / wall
        flops = [(st.cost(key), n) for st, key, n in runs]  # each program's, computed once
        total = None if not runs or any(f is None for f, _ in flops) else sum(
            f * n for f, n in flops)
        per_device = total / wall if total is not None and wall > 0 else None
        kind = jax.local_devices()[0].device_kind
        peak = peak_flops(kind)
        mfu = per_device / peak[0] if peak and per_device is not None else None
        where = f"{kind}: {peak[0] / 1e12:.0f} TFLOP/s ({peak[1]})" if peak else f"{kind}: unknown"
        return steps, rates, per_device, mfu, where

    def _lanes(self, busy: list, segments: list, t0: float) -> tuple:
        if not busy:
            return ((),)
        since = busy[-min(self.last, len(busy))][0]
        # each of the last steps, one whose estimated end is its start too (an end spread
        # over the steps before it), and earlier ones still running then
        lanes = [("device " + lb, s - t0, e - t0) for s, e, lb in busy if s >= since or e > since]
        lanes += [(lb, s - t0, e - t0) for s, e, lb in segments if e > since]
        return (tuple(lanes),)


def _flatten(intervals: list[tuple[str, float, float]]) -> list[tuple[float, float, str]]:
    """Non-overlapping ``(start, end, label)`` of the host's records, the higher rank on top."""
    edges = sorted((t, i, sign) for i, (_, s, e) in enumerate(intervals)
                   for t, sign in ((s, 1), (e, -1)))
    open_: Counter[str] = Counter()
    out, last = [], None
    for t, i, sign in edges:
        if last is not None and t > last and +open_:
            top = max(+open_, key=_RANK.__getitem__)
            if out and out[-1][2] == top and out[-1][1] == last:
                out[-1] = (out[-1][0], t, top)
            else:
                out.append((last, t, top))
        open_[intervals[i][0]] += sign
        last = t
    return out


def _attribute(a: float, b: float, given: float, segments: list, starts: list, seconds: dict):
    """Add the gap ``[a, b]`` to ``seconds``: the host's records over it; the rest is the
    host's own work ("other"), but for a sync under way when the device ran out of work at
    ``a`` (a switch interval either way: step ends are estimates between looks; not one that
    ended before the device was ``given`` that work): it drained the device, so the host's
    work after it is idle it caused, up to the device time it could have overlapped
    (``a - given``)."""
    tol, covered, drained = sys.getswitchinterval(), 0.0, 0.0
    for s, e, label in segments[max(bisect.bisect_right(starts, a) - 1, 0) :]:
        if s >= b:
            break
        if label == "sync" and e > given and s - tol <= a <= e + tol:
            drained = a - given
        if (ov := min(b, e) - max(a, s)) > 0:
            seconds[label] += ov
            covered += ov
    seconds["sync"] += min(drained, b - a - covered)
    seconds["other"] += b - a - covered - min(drained, b - a - covered)
