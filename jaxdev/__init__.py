"""jaxdev: pure-JAX, functional device placement.

This module only re-exports; every name lives in a small private module.
"""

# --- errors ---
from ._errors import BackendStartedError as BackendStartedError
from ._errors import DeletedArrayError as DeletedArrayError
from ._errors import DeviceNotFoundError as DeviceNotFoundError
from ._errors import DeviceSpecError as DeviceSpecError
from ._errors import DistributedError as DistributedError
from ._errors import JaxdevError as JaxdevError
from ._errors import LeafTypeError as LeafTypeError
from ._errors import LeafValueError as LeafValueError
from ._errors import PlacementAssertionError as PlacementAssertionError
from ._errors import PlacementError as PlacementError
from ._errors import ShardingError as ShardingError

# --- devices ---

# --- placement ---

# --- parallel ---

# --- metrics ---

# --- train ---

# --- asserts ---

# --- guards ---

# --- distributed ---

__version__ = "0.1.0"
