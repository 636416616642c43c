"""On-device metrics: accumulate in the step, read once with ``fetch()``.

A namespace over :mod:`jaxdev.train._metrics` (the train subsystem owns them). Every
constructor (``from_value``, ``from_logits``, ``Collection``, ``from_values``,
``DeviceLog.create``) and every ``merge``/``record`` raises :class:`jaxdev.MetricError` naming
the argument: a value that is not numeric (``labels`` not integer), a mask or shape that does
not fit, a ``capacity`` that is not a positive int, a ``Collection`` entry that is not a str
name to a ``Metric``, or names or kinds that differ (the missing and unexpected names listed).
Every read (``fetch``, ``fetch_metrics``, ``compute()`` outside ``jit``) of metrics whose step
ran out of device memory raises :class:`jaxdev.OutOfMemoryError` with the step's explanation.

Example:
  >>> import jax.numpy as jnp, jaxdev
  >>> spec = {"loss": jaxdev.metrics.Mean}
  >>> m = jaxdev.metrics.Collection.from_values(spec, {"loss": jnp.array([1.0, 3.0])})
  >>> m.fetch()
  {'loss': 2.0}
"""

# ruff: noqa: F401 - re-exports

from .train._metrics import Accuracy as Accuracy
from .train._metrics import Collection as Collection
from .train._metrics import DeviceLog as DeviceLog
from .train._metrics import Last as Last
from .train._metrics import Max as Max
from .train._metrics import Mean as Mean
from .train._metrics import Metric as Metric
from .train._metrics import Min as Min
from .train._metrics import NonFinite as NonFinite
from .train._metrics import Sum as Sum
from .train._metrics import WeightedMean as WeightedMean
from .train._metrics import fetch_metrics as fetch_metrics

__all__ = [n for n in dir() if not n.startswith("_")]  # the names imported above
