"""jaxdev: pure-JAX, functional device placement.

This module only re-exports: the core lives in ``jaxdev/_*.py``, each subsystem in its
folder, and the namespaces (``jaxdev.memory``, ``jaxdev.metrics``, ...) are imported below.
"""

# ruff: noqa: I001 - imports are grouped by module, in the order the README lists them

# --- errors ---
from ._errors import BackendStartedError as BackendStartedError
from ._errors import CheckpointError as CheckpointError
from ._errors import DeletedArrayError as DeletedArrayError
from ._errors import DeviceNotFoundError as DeviceNotFoundError
from ._errors import DistributedError as DistributedError
from ._errors import GuardError as GuardError
from ._errors import JaxdevError as JaxdevError
from ._errors import LeafTypeError as LeafTypeError
from ._errors import LeafValueError as LeafValueError
from ._errors import MemoryPlanError as MemoryPlanError
from ._errors import MetricError as MetricError
from ._errors import OutOfMemoryError as OutOfMemoryError
from ._errors import PlacementAssertionError as PlacementAssertionError
from ._errors import PlacementError as PlacementError
from ._errors import ShardingError as ShardingError
from ._errors import UsageError as UsageError

# --- devices ---
from ._devices import describe as describe
from ._devices import device as device
from ._devices import device_list as device_list

# --- meshes ---
from ._mesh import batch_sharding as batch_sharding
from ._mesh import data_mesh as data_mesh
from ._mesh import make_mesh as make_mesh

# --- placement ---
from ._placement import as_sharding as as_sharding
from ._placement import copy_to as copy_to
from ._placement import device_of as device_of
from ._placement import devices_of as devices_of
from ._placement import to_device as to_device
from ._placement import to_host as to_host
from ._report import PlacementReport as PlacementReport
from ._report import placement as placement

# --- parallel ---
from ._replication import replicate as replicate
from ._replication import unreplicate as unreplicate
from ._batches import Padded as Padded
from ._batches import shard_batch as shard_batch
from ._batches import unpad as unpad
from ._prefetch import Prefetcher as Prefetcher
from ._prefetch import prefetch_to_device as prefetch_to_device
from ._data_parallel import data_parallel as data_parallel

# --- sharded parameters ---
from ._rules import Rules as Rules
from ._rules import param_shardings as param_shardings
from ._rules import shard_params as shard_params
from .train import init_sharded as init_sharded

# --- namespaces ---
from . import d2l as d2l
from . import memory as memory
from . import meter as meter
from . import metrics as metrics
from . import nnx as nnx
from . import pmap as pmap

# --- train ---
from .train import EvalStep as EvalStep
from .train import Strategy as Strategy
from .train import TrainState as TrainState
from .train import TrainStep as TrainStep
from .train import make_eval_step as make_eval_step
from .train import make_train_step as make_train_step

# --- asserts ---
from ._asserts import assert_committed as assert_committed
from ._asserts import assert_on_device as assert_on_device
from ._asserts import assert_on_host as assert_on_host
from ._asserts import assert_replicated as assert_replicated
from ._asserts import assert_same_placement as assert_same_placement
from ._asserts import assert_sharded as assert_sharded
from ._asserts import assert_sharded_fraction as assert_sharded_fraction

# --- checkpoints ---
from .checkpoint import Checkpointer as Checkpointer
from .checkpoint import restore as restore
from .checkpoint import save as save

# --- guards ---
from ._guards import count_transfers as count_transfers
from ._guards import no_host_sync as no_host_sync

# --- multi-process ---
from . import distributed as distributed
from . import testing as testing

from ._moved import __getattr__ as __getattr__  # names that moved to a namespace

__version__ = "0.1.0"
