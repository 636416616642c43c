"""Flax NNX with jaxdev's steps: split a module, write its loss, update it back.

A namespace over :mod:`jaxdev.train._flax` (``loss`` is ``nnx_loss``, and so on).

Example:
  >>> import jaxdev
  >>> sorted(jaxdev.nnx.__all__)
  ['loss', 'metrics_update', 'split', 'update']
"""

# ruff: noqa: F401 - re-exports

from .train._flax import nnx_loss as loss
from .train._flax import nnx_metrics_update as metrics_update
from .train._flax import nnx_split as split
from .train._flax import nnx_update as update

__all__ = ["loss", "metrics_update", "split", "update"]
