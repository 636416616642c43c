"""d2l's device helpers, as the "GPUs" chapter writes them: ``cpu()``, ``gpu(i)``, ``try_gpu()``.

Example:
  >>> import jaxdev
  >>> jaxdev.d2l.cpu().platform, jaxdev.d2l.num_gpus()
  ('cpu', 0)
"""

# ruff: noqa: F401 - re-exports

from ._devices import cpu as cpu
from ._devices import gpu as gpu
from ._devices import num_gpus as num_gpus
from ._devices import try_all_gpus as try_all_gpus
from ._devices import try_gpu as try_gpu

__all__ = ["cpu", "gpu", "num_gpus", "try_all_gpus", "try_gpu"]
