"""Memory plans: how many bytes each device will hold, from shapes alone, before allocating.

A leaf of shape ``s`` under sharding ``S`` puts ``prod(S.shard_shape(s))`` elements on each
device of ``S`` (undivided dimensions padded up, sub-byte dtypes packed, as XLA does); a
category's figure is the fullest device's sum, and :attr:`MemoryPlan.total` the
fullest device's sum over every category. With a step and a batch the step is
compiled too and its ``memory_analysis()`` kept.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, Sharding
from jax.sharding import PartitionSpec as P

from .._batches import Padded, indivisible_error, lead_spec, padded_shapes
from .._errors import (
    JaxdevError,
    LeafTypeError,
    LeafValueError,
    MemoryPlanError,
    UsageError,
    device_name,
    short,
)
from .._leaves import device_key, is_host_value, keystr, packed_bytes, shape_dtype
from .._mesh import axis_size, batch_axis, check_mesh, named_sharding
from .._report import human_bytes, text_table
from .._rules import (
    fsdp_axis_of,
    is_train_state,
    param_shardings,
    state_shardings,
    step_shardings,
    unbox,
)
from .._target import target_of
from ._memory import check_bytes, memory_stats
from ._offload import host_bytes, is_host, kept_host, shard_bytes
from ._spec import Described, StepSpec, spec_of

CATEGORIES = ("params", "opt_state", "model_state", "batch", "other")
"""The rows of a plan, in table order."""
_OPTIONS = {  # param_shardings' options and their defaults: what plan(**options) takes
    k: p.default
    for k, p in inspect.signature(param_shardings).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}


class CompiledMemory(NamedTuple):
    """A compiled step's ``memory_analysis()``, per device, in bytes.

    ``alias``: output bytes reusing donated inputs. ``host``: arguments and outputs kept in
    host memory (offloaded state), net of donation, not in the other figures (XLA:CPU counts
    them with the device's: taken out). ``untuned``: the autotuned compile ran out of device
    memory; these are the untuned program's figures (as the device builds it, it does not
    fit). ``xla_peak``: XLA's ``peak_memory_in_bytes`` where given (XLA:GPU: 3-8% under
    :attr:`peak`, reusing buffers inside the temporaries, which a GPU allocates as one block).
    """

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    host: int = 0
    untuned: bool = False
    xla_peak: int | None = None

    @property
    def peak(self) -> int:
        """Peak bytes per device, the plan's: ``argument + output - alias + temp``."""
        return self.argument + self.output - self.alias + self.temp

    def terms(self) -> str:
        """``arguments 3.9 MiB + outputs 3.8 MiB - donated 3.8 MiB + temporaries 2.5 MiB``."""
        return (
            f"arguments {human_bytes(self.argument)} + outputs {human_bytes(self.output)} - "
            f"donated {human_bytes(self.alias)} + temporaries {human_bytes(self.temp)}"
        )


class PlanRow(NamedTuple):
    """One category of a :class:`MemoryPlan`: the fullest device's bytes, logical bytes,
    the logical bytes of leaves split over devices, and the leaf count."""

    category: str
    bytes_per_device: int
    total_bytes: int
    sharded_bytes: int
    leaves: int

    @property
    def sharded_share(self) -> float:
        """``sharded_bytes / total_bytes`` (1.0 for an empty category)."""
        return self.sharded_bytes / self.total_bytes if self.total_bytes else 1.0


@dataclasses.dataclass(frozen=True, repr=False)
class MemoryPlan:
    """Bytes per device of a train state (and batch, and compiled step), from shapes alone.

    ``print(plan)`` shows a table; :meth:`fits` compares with a budget.

    Attributes:
      rows: one :class:`PlanRow` per category present, in ``CATEGORIES`` order.
      total: bytes the fullest device holds, all categories together.
      by_device: bytes per device name (``'cpu:3'``), every mesh device listed.
      compiled: the compiled step's ``memory_analysis()`` (with ``step`` and ``batch``).
      host_by_device: bytes per device name kept in host memory (offloaded
        fields), not in ``rows`` nor ``total``.
      backend: the platform of the mesh's devices, whose compiler built ``compiled``
        (``'cpu'``, ``'gpu'``).
      target: the target the mesh was made for (``make_mesh(..., target='h100')``), or None.
      no_analysis: the step was compiled, but its backend gives no memory analysis
        (``compiled.memory_analysis()`` None or without figures): :attr:`peak` raises.
    """

    rows: tuple[PlanRow, ...]
    total: int
    by_device: Mapping[str, int]
    mesh: Mesh
    rules: Any
    compiled: CompiledMemory | None = None
    # for fsdp_alternative: the unboxed state's and batch's shapes (never their arrays, which a
    # kept plan or error would keep alive), a batch leaf's spec by its rank, the options
    _inputs: tuple | None = dataclasses.field(default=None, compare=False)
    host_by_device: Mapping[str, int] = dataclasses.field(default_factory=dict)
    backend: str = "cpu"
    target: str | None = None
    no_analysis: bool = False

    @property
    def overstates(self) -> bool:
        """Whether XLA:CPU compiled a step with sharded params: it forms no reduce-scatter,
        so each layer's whole gradient is live at once and the peak is too high (FSDP with
        remat: 1.8-2.8x XLA:GPU's for the same program)."""
        sharded = not _same_rules(self.rules, "replicate")  # any rules may split params
        return self.compiled is not None and self.backend == "cpu" and sharded

    @property
    def host(self) -> int:
        """Bytes the fullest device's host memory keeps of the offloaded fields (0: none)."""
        return max(self.host_by_device.values(), default=0)

    def __getitem__(self, category: str) -> int:
        """Bytes per device of ``category`` (0 when the plan has none of it)."""
        if category not in CATEGORIES:
            raise KeyError(f"{category!r} is not a plan category; expected one of {CATEGORIES}")
        return next((r.bytes_per_device for r in self.rows if r.category == category), 0)

    @property
    def peak(self) -> int:
        """Bytes per device needed: the compiled step's ``argument + output - alias + temp``
        if compiled (XLA's own ``peak_memory_in_bytes``: ``compiled.xla_peak``), else ``total``;
        :class:`MemoryPlanError` if :attr:`no_analysis` (``total`` has no temporaries)."""
        if self.no_analysis:
            raise MemoryPlanError(
                "the peak is XLA's memory analysis of the compiled step, but this backend "
                f"({self.backend}) gives none (`compiled.memory_analysis()` is None or has no "
                "figures): nothing can be called fitting (`plan.total` is the state and batch "
                "alone). Plan for the GPUs you will use: jaxdev.make_mesh(..., target='h100')."
            )
        return self.compiled.peak if self.compiled is not None else self.total

    def fits(self, limit: int | None = None) -> bool:
        """Whether :attr:`peak` fits in ``limit`` bytes per device (``None``: the devices' own,
        a target mesh's from its ``device_memory_size``: see :func:`resolve_limit`).

        Raises:
          UsageError: ``limit`` is not a number of bytes, or ``None`` on CPU (no limit).
          MemoryPlanError: the backend gives no memory analysis of the step (see :attr:`peak`).

        Example:
          >>> import jax, jaxdev
          >>> p = jaxdev.memory.plan({"w": jax.ShapeDtypeStruct((1024, 1024), "float32")})
          >>> p.fits(limit=8 * 2**20), p.fits(limit=2**20)
          (True, False)
        """
        return self.peak <= resolve_limit(limit, self.mesh)[0]

    def __str__(self) -> str:
        """The plan as a table (see :func:`plan`), with the compiled step's figures if any."""
        return _format(self)

    def __repr__(self) -> str:
        parts = [f"total={self.total}", *(f"{r.category}={r.bytes_per_device}" for r in self.rows)]
        parts += [f"compiled={tuple(self.compiled)}"] if self.compiled is not None else []
        return f"MemoryPlan({', '.join(parts)})"


# ---------------------------------------------------------------- counting bytes


def _build(
    state: Any,
    shardings: Any,
    batch: Any,
    batch_spec: Callable[[int], P],
    mesh: Mesh,
    mask: Any = None,
    mask_spec: P | None = None,
) -> tuple[tuple[PlanRow, ...], int, dict[str, int], dict[str, int]]:
    """``(rows, total, bytes by device, host bytes by device)``; one shard shape per layout."""
    names = [device_name(d) for d in sorted(mesh.devices.flat, key=device_key)]
    per_device = {c: dict.fromkeys(names, 0) for c in (*CATEGORIES, "host")}  # host: offloaded
    totals = {c: [0, 0, 0] for c in CATEGORIES}  # logical bytes, of them split, leaves
    leaves, is_state, cache = [], is_train_state(state), {}
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    targets = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    for (path, leaf), s in zip(flat, targets, strict=True):  # state_shardings keeps the tree
        field = getattr(path[0], "name", None) if is_state else "params"
        leaves.append((field if field in CATEGORIES[:3] else "other", shape_dtype(leaf), s))
    for shape, dtype in map(shape_dtype, jax.tree.leaves(batch)):
        leaves.append(("batch", (shape, dtype), named_sharding(mesh, batch_spec(len(shape)))))
    if mask is not None:  # a padded batch's row mask, laid out as the step takes it
        leaves.append(("batch", shape_dtype(mask), named_sharding(mesh, mask_spec)))
    for category, (shape, dtype), s in leaves:
        if (s, shape, dtype) not in cache:
            per = shard_bytes(s, shape, dtype)
            split = len(s.device_set) > 1 and not s.is_fully_replicated  # over several devices
            cache[s, shape, dtype] = per, [device_name(d) for d in s.device_set], split
        per, on, split = cache[s, shape, dtype]
        row = per_device["host" if is_host(s) else category]
        for name in on:  # the mesh's devices: every layout here is on the mesh
            row[name] += per
        logical, t = packed_bytes(math.prod(shape), dtype), totals[category]
        t[0], t[1], t[2] = t[0] + logical, t[1] + logical * split, t[2] + 1
    by_device = {name: sum(per_device[c][name] for c in CATEGORIES) for name in names}
    rows = [PlanRow(c, max(per_device[c].values()), *totals[c]) for c in CATEGORIES]
    rows = tuple(r for r in rows if r.leaves)
    return rows, max(by_device.values(), default=0), by_device, per_device["host"]


# ---------------------------------------------------------------- plan


def plan(
    state_or_shapes: Any,
    mesh: Mesh | None = None,
    rules: Any = "replicate",
    *,
    step: StepSpec | Described | None = None,
    batch: Any = None,
    pad: bool = False,
    **options: Any,
) -> MemoryPlan:
    """Plan the bytes per device of a state (and batch, and step) before allocating anything.

    Only shapes and dtypes are read (arrays or ``ShapeDtypeStruct`` s from
    ``jax.eval_shape``); shardings come from :func:`jaxdev.param_shardings`. A
    :class:`jaxdev.TrainState` gives rows ``params``, ``opt_state``,
    ``model_state`` and ``other``; any other tree counts as ``params``. The batch
    (as the step receives it) is split the way ``step`` splits it (uneven rows padded
    up, as its ``put_batch`` does), else as :func:`jaxdev.shard_batch` does. With ``step`` and
    ``batch`` the step is compiled too (nothing runs): ``plan.peak`` is then
    its ``argument + output - alias + temp``.

    Args:
      mesh: default: the step's mesh, else :func:`jaxdev.data_mesh`.
      rules: the :data:`jaxdev.Rules` for the params; with ``step``, the step's
        (the default stands for them; another value is an error).
      step: a :class:`jaxdev.TrainStep` or :class:`jaxdev.EvalStep` (or its ``.spec``).
      pad: without ``step``, as :func:`jaxdev.shard_batch`'s: rows the batch axis does not
        divide are a ``ShardingError`` unless ``True`` (then padded up).
      **options: ``min_size``, ``fsdp_axis``, ``logical_axis_rules``, ``indivisible`` as in
        :func:`jaxdev.param_shardings`; with ``step``, the step's (another value is an error).

    Raises:
      UsageError: ``mesh`` / ``rules`` / an option disagree with the step's; an unknown option.
      ShardingError, LeafTypeError: as in :func:`jaxdev.param_shardings`; uneven rows
        without ``pad``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxdev
      >>> tx = optax.adam(1e-3)
      >>> params = {"w": jnp.ones((2048, 512))}
      >>> shapes = jax.eval_shape(lambda: jaxdev.TrainState.create(params, tx))
      >>> mesh = jaxdev.make_mesh({"data": 2, "fsdp": 4})
      >>> full, fsdp = jaxdev.memory.plan(shapes, mesh), jaxdev.memory.plan(shapes, mesh, "fsdp")
      >>> full["params"] // fsdp["params"], fsdp["opt_state"] - 2 * fsdp["params"]  # + count
      (4, 4)
      >>> print(fsdp)
      memory plan: mesh(data=2, fsdp=4), rules='fsdp'
      category   bytes/device  total bytes  sharded
      ---------  ------------  -----------  -------
      params     1.0 MiB       4.0 MiB      100.0%
      opt_state  2.0 MiB       8.0 MiB      >99.9%
      other      4 B           4 B          0.0%
      total      3.0 MiB       12.0 MiB     >99.9%
    """
    spec = None if step is None else spec_of(step)
    _check_options(options, spec)
    check_leaves(unbox(state_or_shapes), "state_or_shapes")
    check_leaves(batch, "batch")
    if spec is not None and batch is not None:
        check_state(spec, state_or_shapes, "state_or_shapes")
        if not jax.tree.leaves(batch.batch if isinstance(batch, Padded) else batch):
            raise UsageError(
                f"`batch` is empty (got {short(batch, 60)}): pass the step's batch, or leave "
                "it out to plan the state alone."
            )
    lowered = None if spec is None or batch is None else step.lower(state_or_shapes, batch)
    return _plan(state_or_shapes, mesh, rules, spec, batch, lowered, options, pad)


def step_plan(spec: StepSpec, state: Any, batch: Any, lowered: Any) -> MemoryPlan:
    """:func:`plan` of one call of the step ``spec`` with the program it lowered already."""
    return _plan(state, None, "replicate", spec, batch, lowered, {})


def check_leaves(tree: Any, arg: str) -> None:
    """Raise naming ``arg`` and the leaf that is no array, shape or number, or has a negative
    dimension: a plan reads nothing else."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and not is_host_value(x):
            what = f"{type(x).__module__}.{type(x).__qualname__}"
            what = f"numpy array of dtype {x.dtype}" if isinstance(x, np.ndarray) else what
            raise LeafTypeError(
                f"`{arg}` leaf {keystr(path)} is a {what}; "
                "expected an array, a jax.ShapeDtypeStruct or a number (of a numeric dtype)."
            )
        if any(d < 0 for d in np.shape(x)):
            raise LeafValueError(
                f"`{arg}` leaf {keystr(path)} has the shape {np.shape(x)}; expected "
                "dimensions >= 0."
            )


def check_state(spec: StepSpec, state: Any, arg: str = "state", metrics: Any = None) -> None:
    """Raise naming ``arg`` unless a train step gets a train state (or its shapes), and
    ``metrics`` unless it is running metrics (a ``Collection``: it merges) or ``None``."""
    if spec.train and not is_train_state(unbox(state)):
        raise UsageError(
            f"`{arg}` must be a train state for {spec.subject} (`params`, `opt_state`, ...: "
            f"`step.init_state(params, tx)`, or `step.abstract_state(params)` for its shapes), "
            f"got {repr(state)[:60] if isinstance(state, str) else type(state).__name__}."
        )
    if metrics is not None and not callable(getattr(metrics, "merge", None)):
        raise UsageError(
            f"`metrics` must be the step's running metrics (a jaxdev.metrics Collection, as "
            f"the step returns them) or None, got {short(metrics, 60)}."
        )


def _check_options(options: dict[str, Any], spec: StepSpec | None) -> None:
    """Refuse an option ``param_shardings`` does not take, or, with a step, not the step's."""
    own = _OPTIONS if spec is None else {**_OPTIONS, **spec.strategy.options}
    for name, value in options.items():
        if name not in _OPTIONS:
            raise UsageError(
                f"`{name}` is no option of jaxdev.memory.plan: it takes "
                f"{', '.join(f'`{k}`' for k in _OPTIONS)} (as jaxdev.param_shardings)."
            )
        if spec is not None and not _same_rules(value, own[name]):
            raise UsageError(
                f"`{name}`={short(value, 80)} differs from the step's {short(own[name], 80)}, "
                f"which lays out the state it compiles; leave `{name}` out when passing `step` "
                f"(the plan uses the step's), or make the step with it (Strategy.sharded)."
            )


def _check_rows(batch: Any, mesh: Mesh) -> None:
    """Refuse, with :func:`jaxdev.shard_batch`'s error, a batch leaf whose rows the batch axis
    does not divide."""
    n = axis_size(mesh, batch_axis(mesh, None))
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if np.ndim(x) and (rows := np.shape(x)[0]) % n:
            raise indivisible_error(batch, rows, n, named_sharding(mesh, P()), False, keystr(path))


def _plan(state_or_shapes, mesh, rules, spec, batch, lowered, options, pad=True) -> MemoryPlan:
    if spec is None:  # boxes read; the state as it is: leaves already offloaded count there
        mesh = check_mesh(mesh)
        shardings = step_shardings(state_or_shapes, mesh, rules, **options)
        shardings = kept_host(shardings, state_or_shapes)
        # the rows split as jaxdev.shard_batch splits them
        batch_spec = functools.partial(lead_spec, batch_axis(mesh, None), 0)
        mask_spec = batch_spec(1)  # shard_batch's mask: split as the rows
        if not pad:
            _check_rows(batch, mesh)
    else:  # the step's layout: the fields it keeps in host memory count there
        strategy, leave = spec.strategy, "when passing `step` (the plan uses the step's)."
        if mesh is not None and check_mesh(mesh) != strategy.mesh:
            raise UsageError(
                f"`mesh` {dict(mesh.shape)} is not the step's mesh {dict(strategy.mesh.shape)}; "
                f"leave `mesh` out {leave}"
            )
        if not _same_rules(rules, strategy.rules) and not _same_rules(rules, "replicate"):
            raise UsageError(
                f"`rules`={short(rules, 80)} differ from the step's params rules "
                f"{short(strategy.rules, 80)}; leave `rules` out {leave}"
            )
        mesh, rules = strategy.mesh, strategy.rules
        shardings, options = strategy.state_layout(state_or_shapes), strategy.options
        k, m = spec.steps_per_call, spec.accumulate
        batch_spec = functools.partial(strategy.batch_spec, k, m)
        if batch is not None and not isinstance(batch, Padded) and strategy.pads_shapes():
            n_lead = ((k > 1) + (m > 1)) * spec.train  # uneven rows: padded, masked, as lower
            batch = Padded(*padded_shapes(batch, strategy.n_devices, n_lead), 0)
        mask_spec = strategy.mask_spec(k, m)
    mask = batch.mask if isinstance(batch, Padded) else None  # its `size` is no argument
    batch = batch.batch if isinstance(batch, Padded) else batch
    state = unbox(state_or_shapes)
    layout = (shardings, batch, batch_spec, mesh, mask, mask_spec)
    rows, total, by_device, host = _build(state, *layout)
    compiled = None if lowered is None else _compiled_memory(lowered)
    inputs = (_shapes(state), _shapes(batch), batch_spec, dict(options))
    host = host if any(host.values()) else {}
    backend, target = mesh.devices.flat[0].platform, getattr(target_of(mesh), "name", None)
    flags = (backend, target, lowered is not None and compiled is None)  # the last: no analysis
    return MemoryPlan(rows, total, by_device, mesh, rules, compiled, inputs, host, *flags)


def _shapes(tree: Any) -> Any:
    """``tree`` with a ``ShapeDtypeStruct`` (sharding kept) for each leaf: no array kept."""
    sds = lambda x: jax.ShapeDtypeStruct(*shape_dtype(x), sharding=getattr(x, "sharding", None))  # noqa: E731
    return jax.tree.map(sds, tree)


def _same_rules(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    pairs = lambda r: tuple(tuple(x) if isinstance(x, list) else x for x in r)  # noqa: E731
    a, b = (pairs(r) if isinstance(r, list) else r for r in (a, b))  # a list of rules
    try:
        return bool(a == b)
    except Exception:  # layout trees of arrays: no plain equality
        return a is b


XLA_OOM = "RESOURCE_EXHAUSTED"
XLA_OOM_WORDS = "Out of memory"  # also where the status is INTERNAL (a queued call's)


def is_resource_exhausted(err: BaseException) -> bool:
    """Whether ``err`` is XLA's out-of-memory (also ``INTERNAL: ... Out of memory``, read later)."""
    text = str(err)
    return not isinstance(err, JaxdevError) and (XLA_OOM in text or XLA_OOM_WORDS in text)


def _compiled_memory(lowered: Any) -> CompiledMemory | None:
    untuned = False
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA:GPU's autotuner runs candidate kernels on real buffers, so
        if not is_resource_exhausted(err):  # a program that cannot fit fails to compile
            raise  # (measured on an H100: NOT_FOUND of RESOURCE_EXHAUSTEDs): analyse it untuned
        try:
            compiled, untuned = lowered.compile({"xla_gpu_autotune_level": 0}), True
        except Exception as again:
            if not is_resource_exhausted(again):
                raise
            raise MemoryPlanError(
                "compiling the step for its memory analysis ran out of device memory, "
                f"autotuned and untuned ({short(again, 300)}): it needs more than this "
                "device has free. Free device memory (jaxdev.memory.ledger() lists what "
                "is live) or use fewer rows per device."
            ) from again
    analysis = compiled.memory_analysis()
    size = lambda k: int(getattr(analysis, f"{k}_size_in_bytes", 0) or 0)  # noqa: E731
    if not any(map(size, ("argument", "output", "temp"))):  # None, or no figures: no analysis
        return None
    argument, output, alias = size("argument"), size("output"), size("alias")
    h_arg, h_out, h_alias = host_bytes(lowered, compiled)
    reported = [size(f"host_{k}") for k in ("argument", "output", "alias")]
    if any(reported):  # the backend counts host memory apart
        host = reported[0] + reported[1] - reported[2]
    else:  # XLA:CPU counts offloaded arguments with the device's: take them out
        argument, output, alias = argument - h_arg, output - h_out, max(alias - h_alias, 0)
        host = h_arg + h_out - h_alias
    temp, code = size("temp"), size("generated_code")
    xla_peak = int(getattr(analysis, "peak_memory_in_bytes", 0) or 0) or None
    return CompiledMemory(argument, output, alias, temp, code, host, untuned, xla_peak)


# ---------------------------------------------------------------- budgets


def bytes_limit(device: jax.Device) -> int | None:
    """``device.memory_stats()["bytes_limit"]`` (``None``: not reported): the one reader."""
    limit = (memory_stats(device) or {}).get("bytes_limit")
    return int(limit) if limit else None


def resolve_limit(
    limit: Any,
    devices: Any,
    example: str = "plan.fits(limit=16 * 2**30)",
    *,
    required: bool = True,
    arg: str = "limit",
) -> tuple[int | None, str]:
    """``(bytes per device, source)`` of a memory budget: the one owner.

    ``None``: the smallest ``bytes_limit`` of this process's ``devices``; a backend
    reporting none (CPU) raises naming ``example`` when ``required``, else gives ``None``.
    On a target mesh (``jaxdev.make_mesh(..., target=)``): what JAX's allocator would take
    of the target's memory (:meth:`jaxdev._target.Target.limit`).
    """
    if limit is None and (target := target_of(devices)) is not None:
        return target.limit()
    if limit is None:
        flat = devices.devices.flat if isinstance(devices, Mesh) else devices
        local = [d for d in flat if d.process_index == jax.process_index()]
        limits = [bytes_limit(d) for d in local]
        if local and None not in limits:
            return min(limits), "bytes_limit of the devices"
        if not required:
            return None, "no limit known"
        platform = local[0].platform if local else "?"
        raise UsageError(
            f"the {platform} backend reports no memory limit (`memory_stats()` has no "
            f"'bytes_limit'), so there is nothing to compare with: pass `{arg}=` in bytes "
            f"per device, e.g. `{example}`."
        )
    return check_bytes(limit, arg), arg


def check_fits(
    plan_: MemoryPlan,
    limit: int | None = None,
    *,
    source: str | None = None,
    subject: str | None = None,
    explain: Callable[..., Any] | None = None,
) -> None:
    """Raise :class:`MemoryPlanError` unless ``plan_`` fits in ``limit`` bytes per device.

    The one memory check (the step's ``memory_limit`` too). The fix it names:
    with ``explain`` (``explain(limit=, source=)`` -> a ``MemoryExplanation``, called
    only when it does not fit, its details added), the cheapest compiled option
    that fits; without, what ``'fsdp'`` would need for replicated params.
    """
    limit_, found = resolve_limit(limit, plan_.mesh)
    source, need, c = source or found, plan_.peak, plan_.compiled
    if need <= limit_:
        return
    detail = "" if c is None else f" (compiled step: {c.terms()})"
    explanation, failed = None, ""
    if explain is not None:
        try:
            explanation = explain(limit=limit_, source=source)
        except Exception as e:  # advice only: the check's own message stands
            failed = f"\n(the explanation failed: {type(e).__name__}: {short(e, 200)})"
    advice = "" if explanation is None else explanation.advice()  # the compiled options' fix
    other = "use more devices, a smaller batch or `accumulate=`, or raise the limit if it is wrong."
    fix, alternative = (f"{advice}.", "") if advice else (other, fsdp_alternative(plan_))
    if not advice and fsdp_applies(plan_.mesh, plan_.rules):
        fix = "shard the params (`jaxdev.Strategy.sharded(mesh, rules='fsdp')`, or `rules='fsdp'`"
        fix += f" in `jaxdev.memory.plan`), {other}"
    lead = f"{subject} needs" if subject else "needs"
    message = (
        f"{lead} {human_bytes(need)} per device{detail}, {human_bytes(limit_)} available "
        f"({source}){alternative}.{' Nothing ran.' if subject else ''} Fix: {fix}{failed}"
    )
    if explanation is not None:
        message += "\n" + explanation.details()
    err = MemoryPlanError(message)
    err.explanation = explanation
    raise err


def fsdp_applies(mesh: Mesh, rules: Any) -> bool:
    """Whether to offer ``rules='fsdp'``: several devices and replicated params (not a user's
    own rules, which 'fsdp' would replace)."""
    return mesh.size > 1 and _same_rules(rules, "replicate")


def fsdp_alternative(plan_: MemoryPlan) -> str:
    """``"; with rules='fsdp' over 8 devices: 8.1 GiB"`` for replicated params, else ``""``."""
    mesh = plan_.mesh
    if plan_._inputs is None or not fsdp_applies(mesh, plan_.rules):
        return ""
    state, batch, batch_spec, options = plan_._inputs
    options = {k: v for k, v in options.items() if k != "fsdp_axis"}
    try:
        n = axis_size(mesh, fsdp_axis_of(mesh))
        shardings = state_shardings(state, mesh, "fsdp", **options)
    except Exception:  # the alternative is advice only
        return ""
    if n <= 1:
        return ""
    _, total, _, _ = _build(state, shardings, batch, batch_spec, mesh)
    note = " for the state and batch, before the step's temporaries" if plan_.compiled else ""
    return f"; with rules='fsdp' over {n} devices: {human_bytes(total)}{note}"


# ---------------------------------------------------------------- table


def _format(p: MemoryPlan) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in p.mesh.shape.items())
    rules = repr(p.rules) if isinstance(p.rules, str) else short(p.rules, 80)
    logical, sharded = sum(r.total_bytes for r in p.rows), sum(r.sharded_bytes for r in p.rows)
    body = [
        (r.category, human_bytes(r.bytes_per_device), human_bytes(r.total_bytes), _pct(r))
        for r in [*p.rows, PlanRow("total", p.total, logical, sharded, 0)]
    ]
    t = target_of(p.mesh)
    where = "" if t is None else f", for {p.mesh.size} x {t.kind} (target {t.name!r})"
    lines = [f"memory plan: mesh({mesh}), rules={rules}{where}"]
    lines += text_table(("category", "bytes/device", "total bytes", "sharded"), body, rstrip=True)
    if p.host:
        lines.append(
            f"offloaded to host memory (pinned_host): {human_bytes(p.host)} per device "
            "(0 on the devices: not in the rows above)"
        )
    if p.no_analysis:
        lines.append(f"compiled step: the {p.backend} backend gives no memory analysis (no peak)")
    if (c := p.compiled) is not None:
        host = f"; in host memory: {human_bytes(c.host)}" if c.host else ""
        lines += [
            f"compiled step (memory_analysis, per device): arguments {human_bytes(c.argument)}, "
            f"outputs {human_bytes(c.output)}, donated {human_bytes(c.alias)}, temporaries "
            f"{human_bytes(c.temp)}, code {human_bytes(c.generated_code)}{host}",
            f"peak per device ~ {human_bytes(c.peak)} (arguments + outputs - donated + temporaries)"
            f", compiled by XLA:{p.backend.upper()}",
        ]
        if c.xla_peak:
            lines.append(
                f"XLA's own peak_memory_in_bytes: {human_bytes(c.xla_peak)} (buffers reused "
                "inside the temporaries; the plan's peak counts the temporaries as one block)"
            )
        lines.append(
            "the temporaries hold the gradients, the gathered weights and the activations "
            "together: XLA's memory_analysis does not split them"
        )
    if p.overstates:
        lines.append(
            "overstated: XLA:CPU forms no reduce-scatter, so each sharded param's whole "
            "gradient is counted (FSDP with remat: 1.8-2.8x XLA:GPU's peak). Plan on the GPUs "
            "you will use: jaxdev.make_mesh(axes, devices, target='h100')."
        )
    return "\n".join(lines)


def _pct(r: PlanRow) -> str:
    """``'99.5%'``; never rounds to 0% or 100% unless exact (``'<0.1%'``, ``'>99.9%'``)."""
    share = r.sharded_share * 100
    text = f"{share:.1f}%"
    if 0 < share < 100 and text in ("0.0%", "100.0%"):
        return "<0.1%" if share < 50 else ">99.9%"
    return text
