"""The compiled step: one device, ``jax.pmap``, or sharded ``jit`` / ``shard_map``.

:func:`make_train_step` returns a :class:`TrainStep`, ``step(state, batch,
metrics=None) -> (state, metrics)``: every strategy runs the same per-example
arithmetic (:mod:`jaxdev.train._train`) and gives the same numbers. The step
also places what it needs (``init_state``, ``put_batch``); a committed input
laid out otherwise than its program (which ``jax.jit`` would refuse) is moved
on the devices, once: a train step returns its state in the program's layout.
A call that would donate a deleted or a shared buffer is refused, its leaves
named (JAX segfaults on several devices, or raises a bare INVALID_ARGUMENT).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Sharding

from .. import _timeline
from .._batches import Padded, padded_shapes
from .._errors import (
    DeletedArrayError,
    JaxdevError,
    MetricError,
    PlacementError,
    UsageError,
    short,
)
from .._leaves import (
    array_type,
    check_host_leaves,
    deleted,
    inside_trace,
    is_concrete,
    is_jax_array,
    is_tracer,
    key_strings,
    same_layout,
    shape_dtype,
)
from .._mesh import no_mesh
from .._pending import failed, look, record, wait
from .._placement import put_leaves, to_device
from .._prefetch import Prefetcher
from .._rules import has_state_fields, is_train_state, unbox
from .._target import refuse
from ..distributed import same_program, step_call
from ..memory import (
    OPTIONS,
    MemoryExplanation,
    StepSpec,
    check_state,
    check_step_memory,
    explain_memory,
    explained_oom,
    oom_error,
    plan_lines,
    resolve_limit,
    state_shapes,
)
from ._flax import abstract_state
from ._metrics import Collection, unchecked
from ._strategy import Strategy, as_strategy
from ._train import (
    LossFn,
    StepConfig,
    TrainState,
    eval_body,
    fold_steps,
    train_body,
    warn_padded_model_state,
)

_MAX_INFLIGHT = 8
_MAX_SEEN = 64  # batch signatures a step remembers as checked
_flatten = jax.tree_util.default_registry.flatten  # jax.tree.flatten, without its two frames
_AVAL = operator.attrgetter("aval")  # shape, dtype, sharding type, memory: read, hashed in C
_TRACER = itertools.repeat(jax.core.Tracer)


class _Step:
    """What a train and an eval step share: compiling, placing, lowering, bounding queues."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        self.strategy = strategy = spec.strategy
        k = self.steps_per_call = spec.steps_per_call
        self.accumulate = spec.accumulate
        self.n_lead = (k > 1) + (spec.accumulate > 1)  # group axes before a batch's rows
        self.config, self.donate, self.is_train = spec.config, spec.donate, spec.train
        self._compiled: dict[tuple, Callable] = {}
        self._jitted: dict[tuple, Any] = {}  # the jax.jit / pmap objects, for lower()
        self._in_shardings: dict[tuple, list[Any]] = {}  # sharded: what each argument expects
        self._by_rules = strategy.by_rules
        cpus = [d.platform == "cpu" for d in strategy.devices]
        self._bounded = len(cpus) > 1 and all(cpus)  # collectives across CPU devices
        self._target = strategy.state_target
        self._inflight: collections.deque = collections.deque()
        self._warned_padding = False
        # with a budget, each program (variant, batch shape) checked before it first runs
        self._budget = resolve_limit(spec.memory_limit, strategy.devices, required=False)[0]
        self._programs: dict[tuple, tuple] = {}  # (key, batch treedef, *shapes) -> _keep's
        self._seen: dict[tuple, tuple] = {}  # batch signature -> key, known, bound, bare, program
        self._last: tuple | None = None  # the state and metrics returned last: _remember
        self._flops: dict[tuple, float | None] = {}  # program -> cost()
        self._states: dict[tuple, int] = {}  # a state's structure, shapes, dtypes -> its number
        # jax < 0.12 with several devices segfaults on a deleted or one buffer donated twice
        self._shared_crashes = len(strategy.devices) > 1 and jax.__version_info__ < (0, 12)
        self._signature = _placed_shapes if strategy.kind == "pmap" else _shapes
        self._arg_shapes: dict[tuple, tuple[Any, Any]] = {}  # the state's and metrics', per key
        self._state_in: Any = None  # during a call: the state given, checked when jax traces
        self._tracing = False  # set while jax traces the step's body: its errors are no refusal

    def __call__(self, state: Any, batch: Any, metrics: Collection | None = None) -> Any:
        start = _timeline.start()
        explained = look("the next call of the step", self)  # the last call ran out of memory
        if explained is not None:
            raise explained
        last = self._last  # the state and metrics its last call returned (eval: took), key
        same = last is not None and id(state) == last[0] and self._is_last(state, last[1])
        try:
            if self._shared_crashes and _any_deleted(jax.tree.leaves(batch)):
                raise RuntimeError("a deleted batch leaf")  # it segfaults there: named below
            if same and (metrics is None or metrics is last[2]()):
                try:  # its leaves are fresh, distinct outputs placed by the program: no walk
                    return self._fast(state, batch, metrics, start, last[3])
                except _Refused:  # JAX refused the call before it ran: the checks name why
                    return self._call(state, batch, metrics, start, None, beat=False)
            return self._call(state, batch, metrics, start, None)
        except Exception as err:  # JAX's deleted-buffer errors name no batch path
            _raise_deleted_batch(batch, err)
            _raise_traced(err, state=state, batch=batch, metrics=metrics)
            raise

    def _fast(self, state: Any, batch: Any, metrics: Any, start: float, fresh: Any) -> Any:
        """A loop's call: the state (and metrics) it returned last, a batch of the structure
        and shapes of one that went in as given before (its placement: jit refuses a committed
        leaf laid out otherwise, then the checks move it). One flatten, a dict lookup, the
        program; any other call takes the checked path (:meth:`_call`), told the signature."""
        padded = type(batch) is Padded  # its rows and mask (its size is no part of a program)
        leaves, treedef = _flatten(batch[:2] if padded else batch)
        if (shapes := self._signature(leaves)) is None:  # host leaves: checked each call
            return self._call(state, batch, metrics, start, fresh)
        seen = (metrics is None, fresh, padded, treedef, *shapes)
        if (hit := self._seen.get(seen)) is None:
            return self._call(state, batch, metrics, start, fresh, seen=(seen, leaves))
        key, known, bound, bare, program, probe = hit
        if probe and not self.strategy.placed(leaves[0]):  # it reads two ways: check_layout
            return self._call(state, batch, metrics, start, fresh)
        args = [state, batch.batch, batch.mask] if key[0] else [state, batch]
        if key[1]:
            args.append(metrics._metrics)  # a dict crosses jit's boundary in C, no callback
        step_call(self.is_train, compiling=False)
        self._tracing = False  # (its program is traced: no state to check, _state_in)
        if self._shared_crashes:  # see _call; the checks may move the batch first
            try:
                _check_crashes(args, key[1], self.donate)
            except PlacementError:
                raise _Refused from None
        try:
            # a one-device program runs directly where no mesh is set (what outside_mesh
            # does, without its frames; inside a trace get_mesh refuses it)
            out = bare(*args) if bare is not None and no_mesh() else bound(*args)
            out, token = self._outputs(out)
            if self._bounded:
                self._queue(token)
        except Exception as err:
            self._failed_call(err, args, key, fresh)
        record(self, token, known[0])
        self._last = self._remember(state, out, known[1])
        if start:  # a step meter listens
            _timeline.dispatched(self, program, start, False, token)
        return out

    def _call(
        self,
        state: Any,
        batch: Any,
        metrics: Any,
        start: float,
        fresh: Any,
        beat: bool = True,
        seen: tuple | None = None,
    ) -> Any:
        """A call with its checks; ``fresh`` (the state's part of the key): the state is the
        one the step returned, so the walks over its leaves are skipped, and a refusal raises
        _Refused. ``seen``: the batch's signature and leaves, as :meth:`_fast` read them; when
        the batch went in as given (checked, nothing placed or moved), its next calls of that
        signature take :meth:`_fast`."""
        args, key, program, same = self._prepare(state, batch, metrics, fresh)
        known = self._programs.get(program)  # (OOM-later explainer, returned state's key)
        compiled = known is None
        if beat:  # the hang watchdog's heartbeat, once a call (a refused one: beat already)
            step_call(self.is_train, compiling=compiled)
        self._state_in, self._tracing = state, False
        try:  # XLA's RESOURCE_EXHAUSTED (its compile's, this call's, a queued one's) explained
            if compiled:
                args = self._new_program(key, args)
                fn = self._compiled[key]  # its first call checks every process compiled the same
            else:  # a one-device program called directly where no mesh is set (as _fast)
                bound = self._jitted[key]
                fn = bound.fn if bound.mesh is None and no_mesh() else bound
                if key in self._in_shardings:  # jit refuses committed leaves
                    only = None if fresh is None else range(1, 2 + key[0])  # laid out otherwise
                    moved = self._relayout(key, args, only=only)  # fresh: the batch
                    args, same = (args, same) if moved is None else (moved, False)
            if self._shared_crashes:  # it segfaults on a deleted, shared or donated-and-read leaf
                _check_crashes(args, key[1], self.donate)
            out, token = self._outputs(fn(*args))
            if compiled:
                known = self._programs[program] = self._keep(program, out)
            if self._bounded:
                self._queue(token)
        except Exception as err:
            self._failed_call(err, args, key, fresh)
        finally:
            self._state_in = None
        record(self, token, known[0])  # its error surfaces later, where its outputs are read
        self._last = self._remember(state, out, known[1], fresh is not None)
        if same and seen is not None and not compiled:  # its batch's checks passed as given
            if len(self._seen) >= _MAX_SEEN:
                self._seen.clear()
            (signature, leaves), bound = seen, self._jitted[key]  # its MeshBound, jit inside
            bare = bound.fn if bound.mesh is None else None
            probe = not signature[2] and self._two_ways(leaves)  # (padded: no layout to read)
            self._seen[signature] = (key, known, bound, bare, program, probe)
        if start:  # a step meter listens
            _timeline.dispatched(self, program, start, compiled, token)
        return out

    def _two_ways(self, leaves: list) -> bool:
        """Whether a batch of these shapes reads as rows and as pmap's stacked layout, so that
        :meth:`Strategy.check_layout` passed it by its first leaf's placement."""
        axis = self.strategy.row_axis(self.steps_per_call, self.accumulate)
        rows = self._reads_rows()
        if not leaves or not (rows or axis):  # as _check_layout reads it
            return False
        lead = np.shape(leaves[0])[0 if rows else axis :][:2]
        return len(lead) == 2 and lead[0] in self.strategy.stacked_sizes

    def _queue(self, token: Any) -> None:
        """At most _MAX_INFLIGHT queued calls: XLA deadlocks with ~100 queued collective
        programs on multi-device CPU (jax 0.10.2, 8 devices, 2 cores). A waited call's error
        is left to its reads (_pending)."""
        self._inflight.append(token)
        if len(self._inflight) > _MAX_INFLIGHT:
            wait(self._inflight.popleft())

    def _failed_call(self, err: Exception, args: list, key: tuple, fresh: Any) -> None:
        """Raise the named error of a call JAX refused or that failed (``fresh``: a call on
        the fast path, retaken with its checks when JAX refused it before it ran)."""
        eager = self._tracing and jax.config.jax_disable_jit  # a body run op by op: in it
        if fresh is not None and (eager or not self._tracing) and _refusal(err):
            raise _Refused from None  # (first: the checks may move a batch that is a state leaf)
        if self.donate and not self._tracing and not isinstance(err, JaxdevError):
            _raise_read_donated(args, key[1], err)  # JAX names no leaf donated and read
        explained = failed("the next call of the step", error=err)  # one it comes from
        explained = explained or oom_error(self.spec, _as_given(args, key[1]), err)
        if explained is None:
            raise err
        raise explained from err

    def _prepare(self, state: Any, batch: Any, metrics: Any, fresh: Any) -> tuple:
        """The checks of a call: its arguments (placed), key, program (variant, batch treedef
        and shapes), and whether the batch goes in as it was given."""
        inner, mask = (batch.batch, batch.mask) if isinstance(batch, Padded) else (batch, None)
        if fresh is None:
            check_state(self.spec, state, metrics=metrics)  # named, not jit's AttributeError
            refuse("running a step", self._target)  # a target mesh: named before its leaves
            check_donatable(state, metrics, self.donate)  # deleted or shared leaves: named
            check_host_leaves(state, jax.tree.leaves(state), "state")  # int64 past int32 ...
            if metrics is not None:  # e.g. a fresh Collection.empty(): place it like the state,
                metrics = to_device(metrics, self._target)  # or each placement compiles anew
        given = (inner, mask)
        check_host_leaves(inner, _batch_leaves(inner, batch), "batch")  # jit would truncate them
        if mask is None:
            inner = self._raw_batch(inner)
        else:
            self._check_mask(mask)
            if self._reads_rows():  # pmap splits padded rows laid out otherwise (shard_batch)
                inner, mask = self.strategy.place_padded(inner, mask)
            if self.is_train and not self._warned_padding:
                strategy, k = self.strategy, self.steps_per_call
                self._warned_padding = warn_padded_model_state(
                    self.config, strategy.collective_axis, strategy.shard_map, batch, k
                )
        args, key = self._args(state, inner, mask, metrics, fresh)
        leaves, treedef = jax.tree.flatten(args[1 : 2 + key[0]])  # the batch (and mask)
        shapes = [(getattr(x, "shape", ()), getattr(x, "dtype", None)) for x in leaves]
        same = inner is given[0] and mask is given[1]
        return args, key, (key, treedef, *shapes), same  # one program per shapes

    def _structure(self, state: Any) -> tuple:
        """The state's part of a program's key: a number per structure, shapes and dtypes
        seen (a model of another size is another program: its memory checked, under rules
        its layout), so that the fast path hashes a number, never the leaves."""
        leaves, treedef = jax.tree.flatten(state)
        impl = array_type()  # its attributes read directly (a 2000-leaf state: 5x faster)
        seen = [treedef]
        seen += [(x.shape, x.dtype) if type(x) is impl else shape_dtype(x) for x in leaves]
        try:
            hash(seen[0])
        except TypeError:  # a custom node with unhashable aux data
            seen[0] = str(treedef)
        return (self._states.setdefault(tuple(seen), len(self._states)),)

    def _keep(self, program: tuple, out: Any) -> tuple:
        """What later calls of a new ``program`` need: how to explain its OOM read later, and
        the key part of the state it returns."""
        key, treedef, *shapes = program
        explain = functools.partial(self._oom_later, key, treedef, shapes)
        returned = self._structure(out[0]) if self.is_train else key[2:]
        return explain, returned

    def _check_grouped(self, batch: Any) -> None:
        """Refuse a raw batch whose leading axes are not the step's groups (K steps, M micro)."""
        k, m = self.steps_per_call, self.accumulate
        groups = ((k,) if k > 1 else ()) + ((m,) if m > 1 else ()) if self.is_train else ()
        if not groups:  # the common case, at every call: nothing to read
            return
        at = 0 if self.strategy.row_axis(k, m) else 1  # pmap: the device axis leads
        leaves = jax.tree.leaves(batch)
        shape = np.shape(leaves[0]) if leaves else ()
        if tuple(shape[at : at + len(groups)]) != groups or len(shape) <= at + 1:
            raise UsageError(
                f"`batch` has leaf shape {shape}, but this step (steps_per_call={k}, "
                f"accumulate={m}) takes its rows grouped as {groups} from axis {at}. Place it "
                "with `step.put_batch(batch)`: it groups (and pads) the rows."
            )

    def _args(
        self, state: Any, batch: Any, mask: Any, metrics: Any, fresh: Any = None
    ) -> tuple[list[Any], tuple]:
        """The program's arguments (absent ones left out) and its key: one program per
        variant (padded, running metrics) and, under rules, per state structure."""
        args = [state, batch] + ([mask] if mask is not None else [])
        args += [dict(metrics)] if metrics is not None else []  # as _fast passes it
        key = (mask is not None, metrics is not None)
        return args, key + (self._structure(state) if fresh is None else fresh)

    def _outputs(self, out: Any) -> tuple[Any, jax.Array]:
        """What a call returns (its metrics' dict a Collection), and an output to wait on:
        the eval program's token, jaxdev's own (a metric leaf is the user's: one they donate
        or delete left the in-flight bound nothing to wait on, and on multi-device CPU ~100
        queued collective programs deadlocked XLA: a rendezvous abort)."""
        return unchecked(out[0]), out[1]

    def cost(self, key: tuple) -> float | None:
        """The FLOPs per device of one call of program ``key`` (as :mod:`jaxdev._timeline`
        names it) by XLA's cost analysis of its lowered program (no compile; a GSPMD
        program's split evenly over its devices; the analysis counts a loop's body once, so
        times ``steps_per_call * accumulate``: an accumulated step's one optimizer update
        then counts ``accumulate`` times); computed once, ``None`` when the backend gives
        none. For the step meter."""
        if key not in self._flops:
            self._flops[key] = None
            variant, treedef, *shapes = key
            state, metrics = self._arg_shapes[variant]
            args = [state, *_shaped(treedef, shapes), *([metrics] if variant[1] else [])]
            try:
                costs = self._jitted[variant].lower(*args).cost_analysis()
                costs = costs[0] if isinstance(costs, (list, tuple)) else costs  # jax 0.10.2
                spmd = self.strategy.kind == "sharded" and not self.strategy.shard_map
                group = self.steps_per_call * self.accumulate  # scan bodies, counted once
                devices = len(self.strategy.devices) ** spmd
                self._flops[key] = float(costs["flops"]) * group / devices
            except Exception:  # noqa: BLE001 - the meter says "unknown"
                pass
        return self._flops[key]

    def _oom_later(self, key: tuple, treedef: Any, shapes: list, err: Any, where: str) -> Any:
        """:func:`oom_error` of a call that failed after it returned, from shapes only
        (its arrays are not kept: they would outlive the loop as unnamed old copies)."""
        state, metrics = self._arg_shapes[key]
        args = [state, *_shaped(treedef, shapes), *([metrics] if key[1] else [])]
        return oom_error(self.spec, _as_given(args, key[1]), err, where)

    def _new_program(self, key: tuple, args: list[Any]) -> list[Any]:
        """Before a program's (variant ``key``, batch shapes) first run: compile the variant
        if new, place ``args`` in its layout, check its memory against the budget."""
        jitted = self._jit(key, args)
        args = self._relayout(key, args) or args
        if self._budget is not None:
            lower = functools.partial(jitted.lower, *args)
            check_step_memory(self.spec, lower, _as_given(args, key[1]))
        if key not in self._compiled:
            metrics = state_shapes(args[-1]) if key[1] else None
            self._arg_shapes[key] = (state_shapes(args[0]), metrics)
            kind = "train" if self.is_train else "eval"
            name = f"{kind} step (padded={key[0]}, metrics={key[1]})"
            # its first call checks every process compiled the same program
            self._compiled[key] = same_program(jitted, name=name)
        return args

    def _jit(self, key: tuple, args: list[Any]) -> Any:
        jitted = self._jitted.get(key)
        if jitted is None:
            layout = self.strategy.state_layout(args[0]) if self._by_rules else None
            jitted = self._jitted[key] = _compile(self, key[0], key[1], layout)
            group = (self.steps_per_call, self.accumulate)
            expected = self.strategy.input_shardings(group, key[0], key[1], layout)
            if expected is not None:
                self._in_shardings[key] = expected
        return jitted

    def _relayout(
        self, key: tuple, args: list[Any], lowering: bool = False, only: range | None = None
    ) -> list[Any] | None:
        """``args`` with committed leaves laid out otherwise than the program's inputs moved
        (``lowering``: their shapes in its layout; ``only``: of these arguments), or ``None``
        when nothing is misplaced."""
        expected = self._in_shardings.get(key)
        moves = [] if expected is None else _misplaced(args, expected, lowering, only)
        if not moves:
            return None
        leaves = [jax.tree.flatten(a) for a in args]
        old, targets = [leaves[a][0][i] for a, i, _ in moves], [s for _, _, s in moves]
        sds = lambda x, t: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=t)  # noqa: E731
        moved = list(map(sds, old, targets)) if lowering else put_leaves(old, targets)
        for (a, i, _), new in zip(moves, moved):
            leaves[a][0][i] = new
        return [treedef.unflatten(flat) for flat, treedef in leaves]

    def lower(self, state: Any, batch: Any, metrics: Collection | None = None) -> Any:
        """Return the ``jax`` lowering of the program ``step(state, batch, metrics)`` would run.

        Nothing runs: the arguments may be ``jax.ShapeDtypeStruct`` s (with their
        ``sharding``). Misplaced leaves are lowered in the program's layout, and
        a sharded step lowers uneven rows padded, with a mask, as the call would. The program
        takes the running metrics as a dict, ``dict(metrics)``, and returns ``(state,
        metrics_dict, token)`` (an eval step's: ``(metrics_dict, token)``): the token is the
        scalar the step waits on.

        Example:
          >>> import jax, jax.numpy as jnp, optax, jaxdev
          >>> mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
          >>> tx = optax.sgd(0.1)
          >>> step = jaxdev.make_train_step(lambda p, b: (b @ p["w"]) ** 2, tx,
          ...                               jaxdev.Strategy.sharded(mesh, rules="fsdp"))
          >>> state = jax.eval_shape(lambda: jaxdev.TrainState.create({"w": jnp.ones(4096)}, tx))
          >>> batch = jax.ShapeDtypeStruct((16, 4096), jnp.float32)
          >>> compiled = step.lower(state, batch).compile()
          >>> compiled.input_shardings[0][0].params["w"].spec
          P('fsdp',)
          >>> compiled.memory_analysis().argument_size_in_bytes  # w/4 + batch/8 + step
          36868
        """
        _refuse_traces("lower", ": it takes `jax.ShapeDtypeStruct` s (jax.eval_shape) as they are")
        check_state(self.spec, state, metrics=metrics)
        inner, mask = (batch.batch, batch.mask) if isinstance(batch, Padded) else (batch, None)
        leaves = _batch_leaves(inner, batch)
        if mask is not None:
            self._check_mask(mask)
        if mask is None:
            concrete = not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
            if concrete and not self.strategy.pads_shapes():  # as the call takes it
                inner = self._raw_batch(inner)
            else:
                self._check_grouped(inner)
                if concrete:  # arrays of a strategy that pads: their layout checked as a call does
                    self._check_layout(inner)
                else:
                    self.strategy.check_shapes(inner)
        if mask is None and self.strategy.pads_shapes():  # uneven: as put_batch pads it
            inner, mask = padded_shapes(inner, self.strategy.n_devices, self.n_lead)
        args, key = self._args(state, inner, mask, metrics)
        jitted = self._jit(key, args)
        self._state_in = state
        try:
            return jitted.lower(*(self._relayout(key, args, lowering=True) or args))
        finally:
            self._state_in = None

    def _check_mask(self, mask: Any) -> None:
        """Refuse a Padded laid out for another step: its mask has other axes than this step's
        ``put_batch`` gives (under pmap, also one row axis: ``shard_batch``'s padded rows)."""
        strategy, k, m = self.strategy, self.steps_per_call, self.accumulate
        want = strategy.batch_shape(strategy.n_devices, k, m)
        if np.ndim(mask) == len(want) or (np.ndim(mask) == 1 and self._reads_rows()):
            return
        raise UsageError(
            f"`batch` is a Padded whose mask has shape {np.shape(mask)}, but this step "
            f"({strategy.kind}{', shard_map' if strategy.shard_map else ''}, steps_per_call={k}, "
            f"accumulate={m}) takes a mask of {len(want)} axes, as its `put_batch` lays "
            f"{strategy.n_devices} rows out: {want}. It was placed for another step (a pmap "
            "step's `put_batch` gives (devices, rows per device)); place the rows with this "
            "step's `put_batch`."
        )

    def _reads_rows(self) -> bool:
        """Whether a raw batch's leading axis is its rows (not a group axis)."""
        return not self.n_lead or not self.is_train

    def _check_layout(self, inner: Any) -> int:
        """Refuse a raw batch :meth:`Strategy.check_layout` refuses, read from its rows (its
        leading axis, or after its group axes off pmap); returns the row axis."""
        axis = self.strategy.row_axis(self.steps_per_call, self.accumulate)
        rows = self._reads_rows()  # then common_utils.shard's layout is refused as well
        if rows or axis:
            self.strategy.check_layout(inner, 0 if rows else axis)
        return axis

    def _raw_batch(self, inner: Any) -> Any:
        """A raw (unpadded) batch as the step takes it: its groups, layout and even rows
        checked, then placed as the strategy takes raw rows (pmap splits them over its devices)."""
        self._check_grouped(inner)
        axis = self._check_layout(inner)
        self.strategy.check_even(inner, axis if self.is_train else 0)
        if self._reads_rows():
            inner = self.strategy.place_raw(inner)
        return inner

    def explain_memory(
        self,
        state: Any,
        batch: Any,
        limit: int | None = None,
        metrics: Any = None,
        options: Any = OPTIONS,
        remat: Any = True,
    ) -> MemoryExplanation:
        """What ``step(state, batch)`` needs per device, what is live, and which change fits.

        Nothing runs: the step and each of ``options`` (some of ``"fsdp"``,
        ``"accumulate"``, ``"remat"``, ``"offload"``, ``"half_batch"``) are
        compiled for the shapes given (:class:`jaxdev.memory.MemoryExplanation`);
        ``limit`` defaults to the devices' ``bytes_limit`` (none on CPU); ``remat``: ``True``,
        a ``jax.checkpoint`` policy or a step whose model remats per block.

        Example:
          >>> import jax, jax.numpy as jnp, optax, jaxdev
          >>> tx = optax.adam(1e-3)
          >>> step = jaxdev.make_train_step(lambda p, b: (b @ p["w"]).sum(-1), tx,
          ...                               jaxdev.Strategy.sharded())
          >>> state = jax.eval_shape(lambda: jaxdev.TrainState.create(
          ...     {"w": jnp.ones((1024, 512))}, tx))
          >>> why = step.explain_memory(state, jax.ShapeDtypeStruct((64, 1024), "float32"),
          ...                           limit=6 * 2**20)
          >>> why.fits, [o.change for o in why.options if o.fits][0]
          (False, "Strategy.sharded(mesh, rules='fsdp')")
        """
        _refuse_traces("explain_memory", ": it takes `jax.ShapeDtypeStruct` s as they are")
        return explain_memory(
            self.spec, state, batch, limit, metrics=metrics, options=options, remat=remat
        )

    def abstract_state(self, init_fn: Any, *args: Any, rng: Any = None) -> Any:
        """The :class:`TrainState` :meth:`init_state` would build from ``init_fn(*args)``
        (an NNX constructor or module, a linen ``model.init``, or params), as
        ``ShapeDtypeStruct`` s with this step's shardings: nothing is allocated (for
        ``jaxdev.memory.plan``, ``explain_memory`` and restores). ``rng``: a key (or its
        ``ShapeDtypeStruct``) when the loss takes one.

        Example:
          >>> import optax, jaxdev
          >>> from flax import nnx
          >>> fsdp = jaxdev.Strategy.sharded(jaxdev.make_mesh({"fsdp": 8}), rules="fsdp")
          >>> step = jaxdev.make_train_step(lambda p, b: b @ p["kernel"], optax.adam(0.1), fsdp)
          >>> state = step.abstract_state(lambda: nnx.Linear(512, 4, rngs=nnx.Rngs(0)))
          >>> state.opt_state[0].mu["kernel"].shape, state.params["kernel"].sharding.spec
          ((512, 4), P('fsdp', None))
        """
        return abstract_state(init_fn, *args, step=self, rng=rng)

    def init_state(
        self,
        params: Any,
        tx: optax.GradientTransformation | None = None,
        rng: jax.Array | None = None,
        model_state: Any = None,
    ) -> Any:
        """Return a :class:`TrainState` placed for this strategy (eval steps: ``params``).

        A fresh copy: donating it never deletes the caller's arrays. Under sharded
        params the optimizer state is built by ``jax.jit(tx.init)`` directly in
        the shardings following the params (no replicated copy of anything big).
        A whole train state (flax's or jaxdev's) given as ``params`` is taken as
        the state, its type kept.

        Args:
          tx: ``None`` uses the step's own (an eval step then gets ``params``); a
            ``tx`` whose state differs from the step's is refused.
          rng: a PRNG key for ``loss_fn``'s ``rng`` argument (dropout).
          model_state: state the forward pass updates (``batch_stats``).

        Example:
          >>> import jax.numpy as jnp, optax, jaxdev
          >>> fsdp = jaxdev.Strategy.sharded(jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
          >>> step = jaxdev.make_train_step(lambda p, b: b @ p["w"], optax.adam(0.1), fsdp)
          >>> state = step.init_state({"w": jnp.ones((4096, 2))})
          >>> state.params["w"].sharding.spec, state.opt_state[0].mu["w"].sharding.spec
          (P('fsdp', None), P('fsdp', None))
        """
        _refuse_traces("init_state", ": it places the state itself (make the params in a jit, "
                       "return them, then pass them in; for its shapes: `step.abstract_state`)")
        for name, value in (("params", params), ("rng", rng), ("model_state", model_state)):
            self.strategy.check_params(value, name)  # flax's jax_utils.replicate: refused
        if is_train_state(params):  # a whole state (flax's TrainState): laid out as the step does
            for name, value in (("rng", rng), ("model_state", model_state)):
                if value is not None:
                    raise UsageError(
                        f"`{name}` was given with a whole {type(params).__name__} as `params`: "
                        f"a state carries its own fields. Pass `state.params` with `{name}=`, or "
                        f"put `{name}` in the state."
                    )
            check_tx(self.config.tx, tx, unbox(params.params))
            check_tx(self.config.tx, None, unbox(params.params), params.opt_state)
            with explained_oom("init_state", lambda: {"state": params}, lambda: []):
                return jax.block_until_ready(self.strategy.place_state(params))
        if has_state_fields(params):  # a state it cannot return: not params either
            raise UsageError(
                f"`params` is a {type(params).__name__} with `step`, `params` and `opt_state`, "
                "but the step can only return a NamedTuple or a dataclass with `.replace` "
                "(`flax.struct.dataclass`, flax's TrainState). Pass its `.params`, or build the "
                "state as one of those."
            )
        tx = self.config.tx if tx is None and self.is_train else tx
        check_tx(self.config.tx, tx, unbox(params))

        def needs() -> list[str]:  # the plan of the state it builds, for its OOM message
            s, create = self.strategy, lambda: TrainState.create(params, tx, rng, model_state)
            shapes = state_shapes(params) if tx is None else jax.eval_shape(create)
            return plan_lines(shapes, s.mesh, s.rules, s.options)

        oom = explained_oom("init_state", lambda: {"params": params}, needs)
        with oom, self.strategy.mesh_context():  # tx.init traced under the strategy's mesh
            return jax.block_until_ready(self.strategy.new_state(params, tx, rng, model_state))

    def put_batch(self, batch: Any) -> Any:
        """Place a host batch (leading ``K`` axis with ``steps_per_call``); uneven rows: Padded.

        Example:
          >>> import numpy as np, optax, jaxdev
          >>> step = jaxdev.make_train_step(lambda p, b: b * p, optax.sgd(0.1),
          ...                               jaxdev.Strategy.sharded())
          >>> step.put_batch(np.arange(13.0)).size
          13
        """
        return self.strategy.put_batch(batch, self.steps_per_call, self.accumulate)

    def prefetch(self, iterator: Iterable[Any], size: int = 2) -> Prefetcher:
        """Place the next ``size`` batches of ``iterator`` with :meth:`put_batch` in a thread.

        Example:
          >>> import numpy as np, optax, jaxdev
          >>> step = jaxdev.make_train_step(lambda p, b: b * p, optax.sgd(0.1))
          >>> with step.prefetch(np.full(4, i, np.float32) for i in range(3)) as it:
          ...     [float(b[0]) for b in it]
          [0.0, 1.0, 2.0]
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UsageError(f"`size` must be an int >= 1 (batches to keep ready), got {size!r}.")
        return Prefetcher(iterator, size, self.put_batch)


class TrainStep(_Step):
    """A compiled train step: ``step(state, batch, metrics=None) -> (state, metrics)``.

    The state is donated by default (reusing an old ``state`` raises
    :class:`DeletedArrayError` naming its leaves). A running ``metrics``
    :class:`Collection` is merged inside the compiled step and never donated; read it with
    ``metrics.fetch()`` every N steps (the one a call returned before the last waits for
    nothing still running). ``spec`` is its :class:`StepSpec`;
    ``n_lead`` the group axes (``steps_per_call``, ``accumulate``) before a batch's rows.
    """

    def _outputs(self, out: Any) -> tuple[Any, jax.Array]:
        # the token: an undonated copy of the step counter, jaxdev's own (a metrics leaf is the
        # user's: one they donate or delete would leave nothing to wait on, nor to explain)
        return (out[0], unchecked(out[1])), out[2]

    # The state the step returned last, known by its id and its step counter (a weak
    # reference: a freed state's address given to another object is not taken for it)
    def _remember(self, state: Any, out: Any, key: Any, same: bool = True) -> tuple:
        return id(out[0]), weakref.ref(out[0].step), weakref.ref(out[1]), key

    def _is_last(self, state: Any, step: Any) -> bool:
        return (returned := step()) is not None and getattr(state, "step", None) is returned


class EvalStep(_Step):
    """A compiled eval step: ``step(params_or_state, batch, metrics=None) -> metrics``.

    Made by :func:`jaxdev.make_eval_step`; nothing is donated.
    """

    # The state it took last, known by its id and each of its leaves (weak references: a
    # params dict built per call, or changed in place, is checked again; host leaves always)
    def _remember(self, state: Any, out: Any, key: Any, same: bool = True) -> tuple:
        if same:  # the leaves it took last
            return id(state), self._last[1], weakref.ref(out), key
        leaves, treedef = jax.tree.flatten(state)  # a host leaf: checked at each call
        concrete = all(map(is_concrete, leaves))
        refs = (treedef, [weakref.ref(x) for x in leaves]) if concrete else None
        return id(state), refs, weakref.ref(out), key

    def _is_last(self, state: Any, refs: Any) -> bool:
        leaves, treedef = jax.tree.flatten(state)  # compared in C: no Python a leaf
        return (
            refs is not None and treedef == refs[0] and len(leaves) == len(refs[1])
            and all(map(operator.is_, map(operator.call, refs[1]), leaves))
        )


def _misplaced(
    args: list[Any], expected: list[Any], unplaced: bool = False, only: range | None = None
) -> list[tuple[int, int, Any]]:
    """``(argument, leaf, sharding)`` of each committed leaf (or sharded shape) the program
    would refuse; with ``unplaced`` (lowering) also host arrays and unsharded shapes."""
    out = []
    for a in range(len(args)) if only is None else only:
        arg, want = args[a], expected[a]
        leaves, treedef = jax.tree.flatten(arg)
        if isinstance(want, Sharding):
            targets = [want] * len(leaves)
        else:
            try:
                targets = treedef.flatten_up_to(want)
            except (ValueError, TypeError):  # another structure: jit will say so
                continue
        for i, (x, s) in enumerate(zip(leaves, targets)):
            if isinstance(x, jax.ShapeDtypeStruct):
                have = getattr(x, "sharding", None)
                laid = isinstance(have, jax.sharding.Sharding) and not same_layout(have, s, x.ndim)
                bad = laid or (have is None and unplaced)
            elif is_jax_array(x):  # deleted: left to the call's own error
                bad = not deleted(x) and x.committed and not same_layout(x.sharding, s, x.ndim)
            else:
                bad = unplaced and hasattr(x, "shape")
            if bad:
                out.append((a, i, s))
    return out


# ---------------------------------------------------------------- donation safety


def _batch_leaves(inner: Any, batch: Any) -> list:
    """The leaves of a batch's rows; none is a UsageError (it was JAX's IndexError or
    pmap's squeeze ValueError under single and pmap, a ShardingError under sharded)."""
    if not (leaves := jax.tree.leaves(inner)):
        raise UsageError(
            f"`batch` has no array leaves (got {short(batch, 60)}): the step reads its rows, "
            "and the loss its inputs, from them. Pass the batch the loss takes."
        )
    return leaves


def _shapes(leaves: list) -> list | None:
    """A batch's signature on the fast path: each leaf's abstract value (shape, dtype, an
    Explicit mesh's sharding, memory space), read and hashed in C (no Python a leaf); ``None``
    for a batch with a host leaf (its values are checked at every call) or a tracer. Its
    devices are jit's to check: it refuses a committed leaf laid out otherwise (then the
    checks move it) and places an uncommitted one, as the checks leave it."""
    if any(map(isinstance, leaves, _TRACER)):
        return None
    try:
        return list(map(_AVAL, leaves))
    except AttributeError:  # a host leaf (numpy, a Python number)
        return None


def _placed_shapes(leaves: list) -> list | None:
    """:func:`_shapes` with each leaf's (committed) sharding, read in Python, for pmap: it
    places a committed leaf laid out otherwise itself, where the checks refuse or split it."""
    try:
        return [a for x in leaves for a in (x.shape, x.dtype, x.committed and x.sharding)]
    except AttributeError:  # a host leaf (numpy, a Python number), a tracer
        return None


def _shaped(treedef: Any, shapes: list) -> Any:
    """The batch (and mask) of a program as ``ShapeDtypeStruct`` s (a number: as it was)."""
    return treedef.unflatten([s if s[1] is None else jax.ShapeDtypeStruct(*s) for s in shapes])


class _Refused(Exception):
    """A call on the fast path that JAX refused before it ran: taken again with the checks."""


def _refusal(err: BaseException) -> bool:
    """Whether JAX refused a call before running it: a deleted leaf (RuntimeError), one
    buffer donated twice, a misplaced committed leaf, another structure (ValueError,
    TypeError); not XLA's errors of a run (``JaxRuntimeError``, e.g. out of memory)."""
    if isinstance(err, JaxdevError):  # a check that named it already
        return False
    return type(err) is RuntimeError or isinstance(err, (ValueError, TypeError))


def _raise_deleted_batch(batch: Any, err: Exception) -> None:
    """Name the batch's deleted leaves, if any (the error path of a call)."""
    fix = "Their buffers were freed (`x.delete()` or a jit with `donate_argnums`): pass a "
    fix += "batch nothing donated (`step.put_batch` it again)."
    _raise_dead("batch ", _named_leaves(batch=batch), fix, err)


_TRACED = (
    " was called inside a JAX transformation (`jax.jit`, `jax.grad`, `jax.vmap`, `lax.scan`, "
    "...), but a jaxdev step places, checks and compiles its programs itself: call it outside "
    "any transformation"
)


def _refuse_traces(what: str, fix: str) -> None:
    """Raise UsageError when ``step.<what>`` runs inside a JAX transformation."""
    if inside_trace():
        raise UsageError(f"`step.{what}`{_TRACED}{fix}")


def _raise_traced(err: Exception, **trees: Any) -> None:
    """Name a call inside a JAX transformation, or tracers leaked into its arguments (the
    error path of a call: JAX's own error names neither)."""
    traced = [p for p, x in _named_leaves(**trees) if is_tracer(x)]
    inside = inside_trace()
    if not (traced or inside):
        return
    got = _got(traced, "traced ")
    if not inside:
        raise UsageError(
            f"{got}, but no JAX transformation is tracing here: tracers leaked out of an "
            "earlier `jax.jit` / `grad` / `vmap` (kept in the state or batch). Return the "
            "values from the transformed function instead of keeping its tracers."
        ) from err
    who = f"{got}. It" if traced else "The step"
    raise UsageError(
        f"{who}{_TRACED} (it is a compiled program already); to transform the loss, "
        "transform `loss_fn`."
    ) from err


def _as_given(args: list, has_acc: bool) -> list:
    """A program's arguments as a step takes them: its metrics' dict a Collection again."""
    return [*args[:-1], unchecked(args[-1])] if has_acc else args


def _check_crashes(args: list, has_acc: bool, donating: bool) -> None:
    """Where JAX crashes on a deleted, a twice-donated or a donated-and-read buffer: refuse it
    before the call (flattened and tested in C; the walks name it)."""
    state, metrics = args[0], args[-1] if has_acc else None
    donated, read = jax.tree.leaves(state), jax.tree.leaves(args[1:])  # batch, mask, metrics
    ids = set(map(id, donated))
    if (donating and len(ids) != len(donated)) or _any_deleted(donated + read):
        check_donatable(state, metrics, donating)
    if donating and not ids.isdisjoint(map(id, read)):
        _raise_read_donated(args, has_acc, None)


def _raise_read_donated(args: list, has_acc: bool, err: Exception | None) -> None:
    """Name the state leaves the call's batch or metrics also hold (the error path of a call:
    JAX refuses to donate a buffer it reads, naming a 'flattened argument')."""
    read = _named_leaves(batch=args[1], metrics=args[-1] if has_acc else None)
    _refuse_read(_named_leaves(state=args[0]), read, err)


def _refuse_read(donated: list, read: list, err: Exception | None = None) -> None:
    if pairs := _pairs(donated, read):
        raise PlacementError(
            "the step would donate an array it also reads: "
            + "; ".join(pairs[:8])
            + " are the same jax.Array. Pass each its own buffer (`jaxdev.copy_to`), or "
            "make the step with `donate=False`."
        ) from err


def _any_deleted(leaves: list) -> bool:
    """Whether a leaf is a deleted array (one C-level map over jax.Arrays)."""
    try:
        return any(map(array_type().is_deleted, leaves))
    except Exception:  # not all of them jax.Arrays
        return any(map(deleted, leaves))


def check_donatable(state: Any, metrics: Any, donating: bool = True) -> None:
    """Raise before a call that would donate (or read) a deleted or a shared buffer.

    ``donating=False`` (an eval step): only deleted leaves are refused. The state is donated,
    never the metrics. A shared buffer is named first: JAX on several devices may free the
    donated buffers before it refuses one donated twice, and then the deleted leaves are its
    doing.
    """
    arrays = [x for x in jax.tree.leaves(state) if is_jax_array(x)]
    if donating and len(set(map(id, arrays))) != len(arrays):  # one array reached twice
        named = _named_leaves(state=state)
        gone = [p for p, x in named if is_jax_array(x) and deleted(x)]
        raise PlacementError(
            "the step would donate one array twice (segfault in XLA): "
            + "; ".join(_pairs(named, named)[:8])
            + " are the same jax.Array. Give each leaf its own buffer (`jaxdev.copy_to`), or "
            "make the step with `donate=False`."
            + (
                f" {len(gone)} of its leaves are deleted ({', '.join(gone[:8])}): before this "
                "call, or by JAX, which frees a call's donated buffers on some devices before it "
                "refuses one given twice. Restore the state from a checkpoint."
                if gone
                else ""
            )
        )
    read = jax.tree.leaves(metrics)
    if donating and not set(map(id, arrays)).isdisjoint(map(id, read)):  # then the walks
        _refuse_read(_named_leaves(state=state), _named_leaves(metrics=metrics))
    if _any_deleted(arrays + read):
        _raise_deleted(state, metrics, donating)


def _named_leaves(**trees: Any) -> list[tuple[str, Any]]:
    """Each leaf of ``trees`` with its path, the tree's name first (``state.params['a']``)."""
    return [
        (f"{name}{p}".replace("<root>", ""), x)
        for name, t in trees.items()
        for p, x in zip(key_strings(t), jax.tree.leaves(t))
    ]


def _pairs(named: list, then: list) -> list[str]:
    """'X and Y' for each array of ``then`` at path Y first met at path X in ``named``."""
    first = {id(x): p for p, x in reversed(named) if is_jax_array(x)}  # its first path wins
    return [f"{first[id(x)]} and {p}" for p, x in then if first.get(id(x), p) != p]


def _raise_deleted(state: Any, metrics: Any, donating: bool = True) -> None:
    fix = (
        "The step donates `state`: after `state, metrics = step(state, batch, metrics)` use "
        "the returned state, not the one passed in (or make the step with `donate=False`)."
        if donating and _any_deleted(jax.tree.leaves(state))
        else "An eval step never deletes its inputs, a train step its metrics, nor a train "
        "step made with `donate=False` its state: they were donated elsewhere (a train step's "
        "old state, `jax.jit(..., donate_argnums=...)`) or `.delete()`d. Pass the state (or "
        "params) and metrics a step returned last."
    )
    _raise_dead("", _named_leaves(state=state, metrics=metrics), fix)


def _raise_dead(what: str, named: Any, fix: str, cause: Exception | None = None) -> None:
    """Raise DeletedArrayError naming the deleted leaves of ``named`` ((path, leaf) pairs)."""
    dead = [p for p, x in named if is_jax_array(x) and deleted(x)]
    if dead:
        raise DeletedArrayError(f"{_got(dead, f'deleted or donated {what}')}. {fix}") from cause


def _got(paths: list[str], what: str) -> str:
    """``the step got N <what>leaf/leaves: a, b, ...`` (the first 8 paths)."""
    more = " ..." if len(paths) > 8 else ""
    return f"the step got {len(paths)} {what}leaf/leaves: {', '.join(paths[:8])}{more}"


# ---------------------------------------------------------------- compiling


def _compile(step: TrainStep, has_mask: bool, has_acc: bool, layout: Any = None) -> Any:
    """Compile ``run(state, batch[, mask][, acc])`` (absent arguments left out: jax 0.10.2's
    pmap mis-splits ``None`` ones)."""
    strategy, cfg, k, train = step.strategy, step.config, step.steps_per_call, step.is_train
    lead = step.n_lead + 1  # an unpadded batch's mask covers the group axes and the rows

    def run(axis, *args):
        # runs when jax traces a new program (shapes, shardings), never per call: a stacked
        # state (flax's jax_utils.replicate) always has new shapes, so it is refused here
        strategy.check_params(step._state_in, "state")
        state, batch = args[0], args[1]
        mask = args[2] if has_mask else jnp.ones(jnp.shape(jax.tree.leaves(batch)[0])[:lead], bool)
        acc = unchecked(args[-1]) if has_acc else None  # a dict in, a dict out: see _fast
        if not train:  # with its token: jaxdev's own output to wait on (the metrics are the user's)
            metrics = eval_body(cfg, axis, state, batch, mask)
            metrics = dict(metrics if acc is None else _merge_running(acc, metrics))
            return metrics, jnp.sum(mask, dtype=jnp.int32)  # the rows it read: jaxdev's own
        body = functools.partial(train_body, cfg, axis)
        if k == 1:
            state, metrics = body(state, batch, mask)
        else:
            state, metrics = fold_steps(lambda st, xs: body(st, *xs), state, (batch, mask), k)
        return state, dict(metrics if acc is None else _merge_running(acc, metrics)), state.step + 0

    def traced(axis, *args):  # an error raised in here is the user's or a check's
        step._tracing = True
        out = run(axis, *args)
        step._tracing = False
        return out

    donate = (0,) if step.donate else ()  # the state; metrics are a few scalars, never donated
    return strategy.compile(traced, (k, cfg.accumulate), has_mask, has_acc, train, donate, layout)


def _merge_running(acc: Collection, metrics: Collection) -> Collection:
    """``acc.merge(metrics)``; running metrics ``acc`` not of the step's names and kinds are
    refused naming ``metrics`` and both (``Collection.merge`` would name neither)."""
    kinds = [", ".join(f"{k}: {type(c[k]).__name__}" for k in sorted(c)) for c in (metrics, acc)]
    if kinds[0] != kinds[1]:
        raise MetricError(
            f"`metrics` must be running metrics of this step, by name and kind: the step makes "
            f"{{{kinds[0]}}}, the `metrics` given hold {{{kinds[1]}}}. Pass `None` to start "
            "afresh, the metrics a call of this step returned, or a `Collection.empty(...)` "
            "of these names and kinds."
        )
    return acc.merge(metrics)


# ---------------------------------------------------------------- factories


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"`{name}` must be an int >= 1, got {value!r}.")
    if value < 1:
        raise UsageError(f"`{name}` must be >= 1, got {value}.")
    return value


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    strategy: Strategy | None = None,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    pass_mask: bool = False,
    steps_per_call: int = 1,
    accumulate: int = 1,
    donate: bool = True,
    regularizer: Callable[[Any], jax.Array] | None = None,
    lr_fn: Callable[[jax.Array], jax.Array] | None = None,
    memory_limit: int | None = None,
    weighted: bool = False,
    remat: bool | Callable[..., Any] = False,
) -> TrainStep:
    """Return a compiled train step for ``strategy`` (``None``: ``Strategy.single()``).

    Args:
      loss_fn: ``loss_fn(params, batch) -> per_example_loss`` of shape ``(B,)``;
        with ``has_aux`` ``(losses, aux)`` (per-example arrays, ``Metric`` s or
        ``Collection`` s). With ``has_state`` it is ``loss_fn(params,
        model_state, batch)`` returning the new model state last (averaged over
        devices under pmap / shard_map). A state with an ``rng`` passes a
        per-step, per-device key after ``batch``; ``pass_mask`` passes ``mask=``.
      tx: any optax ``GradientTransformation``.
      steps_per_call: K updates per dispatch over leaves with a leading K axis.
      accumulate: M micro-batches per update.
      regularizer: ``regularizer(params) -> scalar`` added once per update.
      lr_fn: ``lr_fn(step) -> learning rate``, reported as the metric ``lr``.
      memory_limit: bytes per device; each program's compiled peak is checked
        before its first call (``None``: the device's ``bytes_limit``, none on CPU).
      weighted: ``loss_fn`` returns ``(losses, weights)``: means are
        ``sum(x * weight) / sum(weight)`` over the global batch.
      remat: ``True`` or a ``jax.checkpoint_policies`` policy: the loss runs
        under ``jax.checkpoint``.

    Raises:
      UsageError: a bad ``strategy``, count (< 1), ``memory_limit`` or ``remat``.
      MemoryPlanError: at a program's first call, it needs more than the budget.
      OutOfMemoryError: XLA ran out of memory, at the call or where its outputs are read.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxdev
      >>> def loss_fn(params, batch):
      ...     return (batch["x"] @ params["w"] - batch["y"]) ** 2
      >>> step = jaxdev.make_train_step(loss_fn, optax.sgd(0.1), jaxdev.Strategy.single())
      >>> state = step.init_state({"w": jnp.zeros(2)})
      >>> batch = step.put_batch({"x": np.eye(2, dtype=np.float32), "y": np.ones(2, np.float32)})
      >>> state, metrics = step(state, batch)
      >>> state, metrics = step(state, batch, metrics)
      >>> int(state.step), round(metrics.fetch()["loss"], 3)
      (2, 0.905)
    """
    check_transformation(tx)
    m, remat = _check_count("accumulate", accumulate), False if remat is None else remat
    if not (remat is True or remat is False or callable(remat) and not isinstance(remat, type)):
        raise UsageError(
            "`remat` must be True, False or a policy from `jax.checkpoint_policies` (e.g. "
            f"`jax.checkpoint_policies.dots_saveable`), got {remat!r}."
        )
    flags = bool(has_aux), bool(has_state), bool(pass_mask)
    cfg = StepConfig(loss_fn, tx, *flags, m, regularizer, lr_fn, bool(weighted), remat)
    k = _check_count("steps_per_call", steps_per_call)
    limit = None if memory_limit is None else resolve_limit(memory_limit, (), arg="memory_limit")[0]
    return TrainStep(StepSpec(as_strategy(strategy), cfg, k, bool(donate), True, limit, _build))


def make_eval_step(
    loss_fn: LossFn,
    strategy: Strategy | None = None,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    pass_mask: bool = False,
    weighted: bool = False,
) -> EvalStep:
    """Return a compiled ``eval(state_or_params, batch, metrics=None) -> metrics``.

    The ``loss_fn`` contract of :func:`make_train_step`; no gradient, nothing
    donated, no rng; with ``has_state`` the returned model state is dropped.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jaxdev
      >>> ev = jaxdev.make_eval_step(lambda p, b: (b["x"] * p["w"]).sum(-1))
      >>> params = ev.init_state({"w": jnp.ones(2)})
      >>> ev(params, ev.put_batch({"x": np.ones((4, 2), np.float32)})).fetch()
      {'loss': 2.0}
    """
    cfg = StepConfig(
        loss_fn, None, bool(has_aux), bool(has_state), bool(pass_mask), weighted=bool(weighted)
    )
    return EvalStep(StepSpec(as_strategy(strategy), cfg, train=False, build=_build))


def check_transformation(tx: Any) -> None:
    """Refuse a ``tx`` that is no optax transformation (``optax.adam`` uncalled, a name): it
    was ``AttributeError: 'function' object has no attribute 'init'`` at ``init_state``."""
    if tx is not None and not all(callable(getattr(tx, f, None)) for f in ("init", "update")):
        raise UsageError(
            f"`tx` must be an optax GradientTransformation (e.g. `optax.sgd(0.1)`) or None, got "
            f"{getattr(tx, '__qualname__', None) or type(tx).__name__}"
            f"{': call it' if callable(tx) else ''}."
        )


def check_tx(step_tx: Any, tx: Any, params: Any, opt_state: Any = None) -> None:
    """Refuse a ``tx`` or ``opt_state`` whose structure is not ``step_tx.init(params)``'s."""
    if step_tx is None or (tx is None and opt_state is None) or tx is step_tx:
        return
    want = jax.tree.structure(jax.eval_shape(step_tx.init, state_shapes(params)))
    got = opt_state if tx is None else jax.eval_shape(tx.init, state_shapes(params))
    if jax.tree.structure(got) != want:
        what = "the state's `opt_state`" if tx is None else "`tx`"
        raise UsageError(
            f"{what} does not match the step's optimizer: the step updates with the `tx` given "
            f"to `make_train_step`, whose state is {_describe(want)}, but {what} makes "
            f"{_describe(jax.tree.structure(got))}. Build the state with the step's own `tx` "
            "(`step.init_state(params)` uses it) or make the step with this one."
        )


def _describe(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 160 else text[:157] + "..."


def _build(spec: StepSpec) -> _Step:
    """The step ``spec`` describes (the memory modules build their variants this way)."""
    return (TrainStep if spec.train else EvalStep)(spec)
