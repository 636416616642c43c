"""On-device metric accumulators and an on-device log (CLU-style pytrees).

A metric has ``empty()``, ``from_value(value, mask=None)``, ``merge(other)`` (pure, on
device, inside ``jit``) and ``compute()``; only :func:`fetch_metrics` / ``.fetch()`` move
data, with one ``jax.device_get`` of the raw accumulators. ``mask`` is a boolean mask over
the leading (row) axes of ``value``: rows where it is ``False`` never count (padding may be
NaN). Values accumulate in float32, counts in int32 (exact up to 2**31 - 1). ``reduce(axis)``
combines accumulators inside ``jax.pmap`` / ``shard_map``. The errors are listed where users
read them: :mod:`jaxdev.metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import MetricError
from .._leaves import check_live
from .._mesh import DEFAULT_AXIS
from .._pending import explained_reads, settle

_F32 = jnp.float32
_I32 = jnp.int32


# ----------------------------------------------------------------- helpers


def _as_array(value: Any, name: str, owner: str) -> jax.Array:
    """Return ``value`` as a jax array, or raise naming the argument."""
    if not isinstance(value, (str, bytes)) and value is not None:
        try:
            return jnp.asarray(value)
        except TypeError as err:
            why = f": {err}"
    else:  # repr() only here: of a device array it is a read (a sync at every record)
        why = f" {value!r}."
    raise MetricError(
        f"`{owner}` expects `{name}` to be an array or number, got {type(value).__name__}{why}"
    )


_AMBIENT = threading.local()


@contextlib.contextmanager
def ambient(name: str, value: Any) -> Iterator[None]:
    """Make ``value`` this thread's ``name`` in this block (see :func:`ambient_value`)."""
    stack = _AMBIENT.__dict__.setdefault(name, [])
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def ambient_value(name: str) -> Any:
    """The innermost enclosing :func:`ambient` value of ``name`` (``None`` outside one)."""
    stack = getattr(_AMBIENT, name, None)
    return stack[-1] if stack else None


def _checked_value(cls: type, value: Any, mask: Any, strict: bool = True) -> tuple[Any, Any]:
    """``(value as an array, mask broadcast to its shape or None)`` for ``cls.from_value``.

    Without ``mask``, the row mask of an enclosing jaxdev step applies; a value with no entry
    per row (a scalar) is refused there (``strict``), else taken whole.
    """
    owner = f"{cls.__name__}.from_value"
    value = _as_array(value, "value", owner)
    if mask is None and (mask := ambient_value("mask")) is not None:
        if not value.ndim or value.shape[0] != mask.shape[0]:
            if strict:
                raise MetricError(
                    f"`{owner}` got a value of shape {value.shape} inside a jaxdev step whose "
                    f"batch has {mask.shape[0]} rows here, some of which may be padding; a value "
                    "without one entry per row cannot leave them out. Pass per-example values "
                    "(one per row), or an explicit `mask=`."
                )
            mask = None
    if mask is None:
        return value, None
    mask = _as_array(mask, "mask", owner)
    if mask.dtype != jnp.bool_:
        raise MetricError(
            f"`{owner}` expects `mask` to be boolean (True = valid row), got "
            f"dtype {mask.dtype}. Pass `mask.astype(bool)` if 0/1 is meant."
        )
    if mask.ndim == 0 or mask.shape != value.shape[: mask.ndim]:
        raise MetricError(
            f"`{owner}` expects `mask` to cover the leading axes of `value`: "
            f"`value` has shape {value.shape}, `mask` has shape {mask.shape}. "
            "A per-row mask has shape (batch,)."
        )
    return value, jnp.reshape(mask, mask.shape + (1,) * (value.ndim - mask.ndim))


def _masked_fill(value: jax.Array, valid: jax.Array | None, fill: float) -> jax.Array:
    """Return float32 ``value`` with invalid rows replaced by ``fill``."""
    value = value.astype(_F32)
    return value if valid is None else jnp.where(valid, value, fill)


# ----------------------------------------------------------------- metrics


class Metric:
    """Base class: a mergeable accumulator, a frozen dataclass registered as a pytree.

    ``merge`` and ``reduce`` combine every field with ``_ops`` (sums by default).
    """

    # (two accumulators to one: a jnp ufunc, across devices, the empty accumulator)
    _ops: ClassVar[tuple[Any, Callable[..., jax.Array], float]] = (jnp.add, lax.psum, 0.0)
    _zeros: ClassVar[dict[str, Any]] = {}  # field -> dtype: the empty accumulator's scalar zeros

    @classmethod
    def empty(cls) -> Metric:
        """Return the identity accumulator (merging it changes nothing)."""
        if not cls._zeros:
            raise NotImplementedError
        return cls(**{name: jnp.zeros((), dtype) for name, dtype in cls._zeros.items()})

    @classmethod
    def from_value(cls, value: jax.typing.ArrayLike, mask: Any = None) -> Metric:
        """Return the accumulator of one batch ``value`` (rows under ``mask``)."""
        raise NotImplementedError

    def merge(self, other: Metric) -> Metric:
        """Return the accumulator of both ``self`` and ``other`` (pure, on device)."""
        if type(other) is not type(self):
            raise MetricError(
                f"`{type(self).__name__}.merge` expects `other` to be a "
                f"{type(self).__name__}, got {type(other).__name__}."
            )
        return jax.tree.map(self._ops[0], self, other)

    def reduce(self, axis: Any = DEFAULT_AXIS) -> Metric:
        """Return the accumulator combined over the named mesh or pmap axis ``axis``.

        Use inside ``jax.pmap`` or ``shard_map``; every device gets the result.
        """
        return jax.tree.map(lambda x: self._ops[1](x, axis), self)

    def _compute(self, xp: Any) -> Any:
        raise NotImplementedError

    def compute(self) -> jax.Array:
        """Return the metric's value as a device array (no host transfer).

        Outside ``jit`` it waits for the accumulators first: an error of the step that made
        them (an out-of-memory) is raised here, explained, not later by ``float()``.
        """
        settle(self, f"{type(self).__name__}.compute")
        return self._compute(jnp)

    def fetch(self) -> Any:
        """Return the value on the host with one ``jax.device_get``."""
        return fetch_metrics(self)


def _metric(cls: type) -> type:
    """Make ``cls`` a frozen dataclass registered as a pytree."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_metric
class Mean(Metric):
    """Mean of every valid element seen: ``total / count`` (NaN when nothing was seen).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Mean
      >>> m = Mean.from_value(jnp.array([1.0, 2.0, 9.0]),
      ...                     mask=jnp.array([True, True, False]))
      >>> m.merge(Mean.from_value(jnp.array([3.0]))).fetch()
      2.0
      >>> Mean.empty().fetch()
      nan
    """

    total: jax.Array
    count: jax.Array
    _zeros = {"total": _F32, "count": _I32}

    @classmethod
    def from_value(cls, value: jax.typing.ArrayLike, mask: Any = None) -> Mean:
        """Return the mean accumulator of ``value``'s valid elements (each element counts once)."""
        value, valid = _checked_value(cls, value, mask)
        count = value.size if valid is None else jnp.sum(jnp.broadcast_to(valid, value.shape))
        return cls(total=jnp.sum(_masked_fill(value, valid, 0.0)), count=jnp.asarray(count, _I32))

    def _compute(self, xp: Any) -> Any:
        mean = self.total / xp.maximum(self.count, 1)
        return xp.where(self.count > 0, mean, xp.nan).astype(xp.float32)


@_metric
class WeightedMean(Metric):
    """Weighted mean ``sum(value * weight) / sum(weight)`` of the valid elements (e.g. per token).

    Normalised by the total weight of everything merged (devices, micro-batches, steps).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import WeightedMean
      >>> tokens = jnp.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
      >>> weights = jnp.array([[1, 1, 0], [1, 0, 0]])
      >>> WeightedMean.from_value(tokens, weights).fetch()
      2.0
    """

    total: jax.Array
    weight: jax.Array
    _zeros = {"total": _F32, "weight": _F32}

    @classmethod
    def from_value(
        cls, value: jax.typing.ArrayLike, weights: Any = None, mask: Any = None
    ) -> WeightedMean:
        """Return the accumulator of ``value`` weighted by ``weights`` (same shape; ``None``: 1)."""
        value, valid = _checked_value(cls, value, mask)
        owner = f"{cls.__name__}.from_value"
        weights = jnp.ones(value.shape, _F32) if weights is None else weights
        weights = _as_array(weights, "weights", owner)
        if weights.shape != value.shape:
            raise MetricError(
                f"`{owner}` expects `weights` of `value`'s shape {value.shape}, got "
                f"{weights.shape}."
            )
        if not (jnp.issubdtype(weights.dtype, jnp.number) or weights.dtype == jnp.bool_):
            raise MetricError(f"`{owner}` expects numeric `weights`, got dtype {weights.dtype}.")
        weights = _masked_fill(weights, valid, 0.0)
        total = jnp.sum(jnp.where(weights != 0, _masked_fill(value, valid, 0.0) * weights, 0.0))
        return cls(total=total, weight=jnp.sum(weights))

    def _compute(self, xp: Any) -> Any:
        safe = xp.where(self.weight != 0, self.weight, 1.0)
        return xp.where(self.weight != 0, self.total / safe, xp.nan).astype(xp.float32)


@_metric
class Accuracy(Mean):
    """Fraction of valid rows that are correct (a :class:`Mean` of 0/1).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Accuracy
      >>> logits = jnp.array([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0]])
      >>> labels = jnp.array([0, 0, 1])
      >>> Accuracy.from_logits(logits, labels).fetch()
      0.3333333432674408
      >>> Accuracy.from_value(jnp.array([True, False]), mask=jnp.array([True, False])).fetch()
      1.0
    """

    @classmethod
    def from_logits(
        cls, logits: jax.typing.ArrayLike, labels: jax.typing.ArrayLike, mask: Any = None
    ) -> Accuracy:
        """Return the accuracy of ``argmax(logits, -1) == labels`` (per row)."""
        owner = f"{cls.__name__}.from_logits"
        logits = _as_array(logits, "logits", owner)
        labels = _as_array(labels, "labels", owner)
        if logits.ndim == 0 or labels.shape != logits.shape[:-1]:
            raise MetricError(
                f"`{owner}` expects `labels` of shape logits.shape[:-1]: `logits` "
                f"has shape {logits.shape}, `labels` has shape {labels.shape}."
            )
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise MetricError(
                f"`{owner}` expects integer class indices in `labels`, got dtype "
                f"{labels.dtype}. For one-hot labels pass `labels.argmax(-1)`."
            )
        return cls.from_value(jnp.argmax(logits, axis=-1) == labels, mask)


class _Fold(Metric):
    """Base of Sum, Min, Max: one float32 field, a batch folded with ``_ops[0].reduce``.

    Masked-out rows are filled with the empty accumulator ``_ops[2]``.
    """

    @classmethod
    def empty(cls) -> _Fold:
        return cls(jnp.full((), cls._ops[2], _F32))

    @classmethod
    def from_value(cls, value: jax.typing.ArrayLike, mask: Any = None) -> _Fold:
        """Return the accumulator of ``value``'s valid elements."""
        value, valid = _checked_value(cls, value, mask)
        pair, _, identity = cls._ops
        return cls(pair.reduce(_masked_fill(value, valid, identity), axis=None, initial=identity))

    def _compute(self, xp: Any) -> Any:
        return jax.tree.leaves(self)[0]


@_metric
class Sum(_Fold):
    """Sum of every valid element seen (float32); ``0.0`` when nothing was seen.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Sum
      >>> Sum.from_value(jnp.array([1, 2, 3]), mask=jnp.array([True, False, True])).fetch()
      4.0
      >>> Sum.empty().merge(Sum.from_value(2.5)).fetch()
      2.5
    """

    total: jax.Array


@_metric
class Min(_Fold):
    """Smallest valid element seen (float32); ``+inf`` when nothing was seen; NaN propagates.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Min
      >>> Min.from_value(jnp.array([4.0, -1.0, 2.0]), mask=jnp.array([True, False, True])).fetch()
      2.0
      >>> Min.empty().fetch()
      inf
    """

    value: jax.Array
    _ops = (jnp.minimum, lax.pmin, math.inf)


@_metric
class Max(_Fold):
    """Largest valid element seen: :class:`Min` mirrored (``value``, ``-inf`` when empty).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Max
      >>> Max.from_value(3).merge(Max.from_value(jnp.array([1.0, 5.0]))).fetch()
      5.0
    """

    value: jax.Array
    _ops = (jnp.maximum, lax.pmax, -math.inf)


@_metric
class Last(Metric):
    """The most recently merged value (e.g. the learning rate); NaN if none.

    ``a.merge(b)`` keeps ``b``'s value when ``b`` saw anything (associative, not
    commutative); with a mask, the last valid row; ``reduce``, the highest device that saw one.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Last
      >>> Last.from_value(0.1).merge(Last.from_value(0.05)).fetch()
      0.05000000074505806
      >>> Last.from_value(jnp.array([1.0, 2.0, 3.0]), mask=jnp.array([True, True, False])).fetch()
      2.0
    """

    value: jax.Array
    count: jax.Array

    @classmethod
    def empty(cls, shape: tuple[int, ...] = ()) -> Last:
        """Return a ``Last`` that saw nothing, holding values of ``shape``."""
        return cls(value=jnp.zeros(shape, _F32), count=jnp.zeros((), _I32))

    @classmethod
    def from_value(cls, value: jax.typing.ArrayLike, mask: Any = None) -> Last:
        """Return ``value`` itself, or with a 1-D ``mask`` its last valid row (count 0 if none)."""
        value, valid = _checked_value(cls, value, mask, strict=False)
        if valid is None:
            return cls(value=value.astype(_F32), count=jnp.ones((), _I32))
        if mask is not None and jnp.ndim(mask) != 1:
            owner = f"{cls.__name__}.from_value"
            raise MetricError(f"`{owner}` expects a 1-D row `mask`, got shape {jnp.shape(mask)}.")
        rows = valid.reshape(-1)
        last = rows.shape[0] - 1 - jnp.argmax(rows[::-1])
        return cls(value=value[last].astype(_F32), count=jnp.any(rows).astype(_I32))

    def merge(self, other: Last) -> Last:
        """Return ``other`` if it saw anything, else ``self`` (counts add)."""
        counted = super().merge(other)  # checks ``other``; the counts add
        value = jnp.where(other.count > 0, other.value, self.value)
        return dataclasses.replace(counted, value=value)

    def reduce(self, axis: Any = DEFAULT_AXIS) -> Last:
        """Return the value of the last device on ``axis`` that saw one."""
        rank = jnp.where(self.count > 0, lax.axis_index(axis), -1)
        mine = (rank == lax.pmax(rank, axis)) & (self.count > 0)
        value = lax.psum(jnp.where(mine, self.value, 0.0), axis)
        return type(self)(value=value, count=lax.psum(self.count, axis))

    def _compute(self, xp: Any) -> Any:
        return xp.where(self.count > 0, self.value, xp.nan).astype(xp.float32)


@_metric
class NonFinite(Metric):
    """Number of NaN, +Inf and -Inf elements in valid rows (int32, on device).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import NonFinite
      >>> x = jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf])
      >>> NonFinite.from_value(x).fetch()
      3
      >>> NonFinite.from_value(x, mask=jnp.array([True, False, True, False])).fetch()
      1
    """

    count: jax.Array
    _zeros = {"count": _I32}

    @classmethod
    def from_value(cls, value: jax.typing.ArrayLike, mask: Any = None) -> NonFinite:
        """Return the number of non-finite valid elements of ``value``."""
        value, valid = _checked_value(cls, value, mask)
        bad = ~jnp.isfinite(value)
        bad = bad if valid is None else bad & valid
        return cls(count=jnp.sum(bad, dtype=_I32))

    def _compute(self, xp: Any) -> Any:
        return self.count


# -------------------------------------------------------------- collection


class Collection(Mapping):
    """An immutable, mergeable dict of named metrics (itself a pytree).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxdev.metrics import Collection, Mean, NonFinite
      >>> spec = {"loss": Mean, "bad": NonFinite}
      >>> @jax.jit
      ... def step(metrics, loss, mask):
      ...     batch = Collection.from_values(spec, {"loss": loss, "bad": loss}, mask)
      ...     return metrics.merge(batch)
      >>> m = Collection.empty(spec)
      >>> m = step(m, jnp.array([1.0, 3.0]), jnp.array([True, True]))
      >>> m = step(m, jnp.array([5.0, jnp.nan]), jnp.array([True, False]))
      >>> m.fetch()
      {'bad': 0, 'loss': 3.0}
    """

    def __init__(self, metrics: Mapping[str, Metric]):
        """Wrap ``metrics``, a mapping from names to :class:`Metric` objects."""
        bad = [
            f"{k!r}: {type(v).__name__}"
            for k, v in metrics.items()
            if not isinstance(k, str) or not isinstance(v, Metric)
        ]
        if bad:
            raise MetricError(
                "`Collection` expects `metrics` to map str names to Metric objects "
                f"(Mean, Sum, ...); got {', '.join(bad)}."
            )
        self._metrics = dict(sorted(metrics.items()))

    @classmethod
    def empty(cls, spec: Mapping[str, type[Metric]]) -> Collection:
        """Return empty metrics of the classes named in ``spec``."""
        return cls({name: _metric_class(name, kind).empty() for name, kind in spec.items()})

    @classmethod
    def from_values(
        cls,
        spec: Mapping[str, type[Metric]],
        values: Mapping[str, jax.typing.ArrayLike],
        mask: Any = None,
    ) -> Collection:
        """Return ``spec[k].from_value(values[k], mask)`` for every name ``k``."""
        _check_keys("Collection.from_values", "values", set(spec), set(values))
        return cls(
            {k: _metric_class(k, kind).from_value(values[k], mask) for k, kind in spec.items()}
        )

    def merge(self, other: Collection) -> Collection:
        """Return every metric merged with the same-named one in ``other``."""
        if not isinstance(other, Collection):
            raise MetricError(
                f"`Collection.merge` expects `other` to be a Collection, got "
                f"{type(other).__name__}."
            )
        _check_keys("Collection.merge", "other", set(self), set(other))
        return Collection({k: m.merge(other[k]) for k, m in self.items()})

    def reduce(self, axis: Any = DEFAULT_AXIS) -> Collection:
        """Return every metric reduced over the named axis ``axis`` (inside pmap/shard_map)."""
        return Collection({k: m.reduce(axis) for k, m in self.items()})

    def compute(self) -> dict[str, jax.Array]:
        """Return ``{name: value}`` as device arrays (no host transfer; waits as ``Metric``'s)."""
        settle(self, "Collection.compute")
        return {k: m._compute(jnp) for k, m in self.items()}

    def fetch(self) -> dict[str, Any]:
        """Return ``{name: value}`` on the host with one ``jax.device_get``."""
        return fetch_metrics(self)

    def __getitem__(self, name: str) -> Metric:
        return self._metrics[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __repr__(self) -> str:
        return f"Collection({self._metrics!r})"


def _metric_class(name: str, kind: Any) -> type[Metric]:
    """Return ``kind`` if it is a Metric subclass, else raise naming ``name``."""
    if not (isinstance(kind, type) and issubclass(kind, Metric)):
        raise MetricError(f"`spec[{name!r}]` must be a Metric class such as Mean, got {kind!r}.")
    return kind


def _check_keys(owner: str, arg: str, expected: set, got: set) -> None:
    """Raise naming the missing and extra keys when ``got != expected``."""
    if got != expected:
        raise MetricError(
            f"`{owner}` expects `{arg}` to have the names {sorted(expected)}; "
            f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}."
        )


def unchecked(metrics: dict[str, Any]) -> Collection:
    """A Collection of ``metrics`` as they are (tree ops and a step's outputs: any leaves)."""
    out = object.__new__(Collection)
    out._metrics = metrics
    return out


jax.tree_util.register_pytree_with_keys(
    Collection,
    lambda c: ([(jax.tree_util.DictKey(k), m) for k, m in c._metrics.items()], tuple(c._metrics)),
    lambda keys, children: unchecked(dict(zip(keys, children, strict=True))),
    flatten_func=lambda c: (list(c._metrics.values()), tuple(c._metrics)),
)


# ------------------------------------------------------------------ fetch


def fetch_metrics(tree: Any) -> Any:
    """Return the host value of every metric in ``tree`` with ONE device_get.

    ``tree`` is a :class:`Metric`, a :class:`Collection` or any pytree holding them (other
    leaves come back as they are); the final arithmetic runs in numpy. Scalars come back
    as Python numbers, a Collection as a dict.

    Raises:
      DeletedArrayError: a leaf was deleted or donated, naming each leaf.
      OutOfMemoryError: the jaxdev step that made them ran out of device memory, explained.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxdev.metrics import Max, Mean, fetch_metrics
      >>> fetch_metrics({"loss": Mean.from_value(jnp.array([1.0, 2.0])), "top": Max.from_value(3)})
      {'loss': 1.5, 'top': 3.0}
    """

    def one(node: Any) -> Any:  # on the host: compute finished with numpy
        if isinstance(node, Collection):
            return {k: one(m) for k, m in node.items()}
        if isinstance(node, Metric):
            node = np.asarray(node._compute(np))
        return node.item() if isinstance(node, np.ndarray) and node.ndim == 0 else node

    leaves, treedef = jax.tree.flatten(tree)
    named = isinstance(tree, (Metric, Collection))
    try:
        with explained_reads(f"{type(tree).__name__}.fetch" if named else "fetch_metrics"):
            host = treedef.unflatten(jax.device_get(leaves))
    except RuntimeError:  # JAX's bare 'Array has been deleted': a donated leaf named instead
        check_live(tree, leaves, "metrics")
        raise
    return jax.tree.map(one, host, is_leaf=lambda x: isinstance(x, (Metric, Collection)))


# ---------------------------------------------------------------- the log


@_metric
class DeviceLog:
    """A preallocated ring buffer on device recording one value per step (jit- and scan-safe).

    It keeps the LAST ``capacity`` records; ``fetch`` returns them oldest-first and, with
    ``with_steps=True``, their step numbers, so a gap is visible.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxdev.metrics import DeviceLog
      >>> def body(log, x):
      ...     return log.record(jnp.linalg.norm(x)), None
      >>> xs = jnp.ones((5, 2, 2))
      >>> log, _ = jax.jit(lambda l, xs: jax.lax.scan(body, l, xs))(DeviceLog.create(8), xs)
      >>> log.fetch().tolist()
      [2.0, 2.0, 2.0, 2.0, 2.0]
      >>> small = DeviceLog.create(3)
      >>> for v in range(5):
      ...     small = small.record(v)
      >>> small.fetch(with_steps=True)
      (array([2, 3, 4]), array([2., 3., 4.], dtype=float32))
    """

    buffer: jax.Array
    count: jax.Array

    @classmethod
    def create(
        cls, capacity: int, shape: tuple[int, ...] = (), dtype: Any = jnp.float32
    ) -> DeviceLog:
        """Return an empty log of ``capacity`` slots, each of ``shape``/``dtype``."""
        is_int = lambda x: isinstance(x, (int, np.integer)) and type(x) is not bool  # noqa: E731
        if not is_int(capacity) or capacity <= 0:
            got = capacity if is_int(capacity) else f"{type(capacity).__name__} {capacity!r}"
            raise MetricError(
                f"`DeviceLog.create` expects `capacity` to be a positive int, got {got}."
            )
        dims = tuple(shape) if isinstance(shape, (tuple, list)) else (-1,)
        if not all(is_int(d) and d >= 0 for d in dims):
            raise MetricError(
                f"`DeviceLog.create` expects `shape` to be a tuple of non-negative ints, got "
                f"{shape!r}."
            )
        buffer = jnp.zeros((int(capacity), *map(int, dims)), dtype)
        return cls(buffer=buffer, count=jnp.zeros((), _I32))

    @property
    def capacity(self) -> int:
        """Number of records the buffer keeps."""
        return self.buffer.shape[0]

    def record(self, value: jax.typing.ArrayLike) -> DeviceLog:
        """Return the log with ``value`` recorded (jit-safe; when full, the oldest is dropped)."""
        value = _as_array(value, "value", "DeviceLog.record")
        if value.shape != self.buffer.shape[1:]:
            raise MetricError(
                f"`DeviceLog.record` expects `value` of shape {self.buffer.shape[1:]} "
                f"(the shape given to `DeviceLog.create`), got {value.shape}."
            )
        slot = self.count % self.capacity
        row = value.astype(self.buffer.dtype)[None]
        buffer = lax.dynamic_update_slice_in_dim(self.buffer, row, slot, axis=0)
        return DeviceLog(buffer=buffer, count=self.count + 1)

    def values(self) -> jax.Array:
        """Return the buffer rotated oldest-first, on device (unfilled slots last)."""
        start = jnp.where(self.count > self.capacity, self.count % self.capacity, 0)
        return jnp.roll(self.buffer, -start, axis=0)

    def fetch(self, with_steps: bool = False) -> Any:
        """Return the recorded values oldest-first (with ``with_steps``: ``(steps, values)``)."""
        with explained_reads("DeviceLog.fetch"):
            buffer, count = jax.device_get((self.buffer, self.count))
        count, cap = int(count), self.capacity
        start, kept = (count % cap, cap) if count > cap else (0, count)
        values = np.roll(buffer, -start, axis=0)[:kept]  # a copy: writable
        return (np.arange(count - kept, count), values) if with_steps else values
