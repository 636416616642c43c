"""jaxdev: pure-JAX, functional device placement.

This module only re-exports; every name lives in a small private module.
``jaxdev.distributed`` is the multi-process surface.
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
from ._devices import cpu as cpu
from ._devices import describe as describe
from ._devices import device as device
from ._devices import device_list as device_list
from ._devices import gpu as gpu
from ._devices import num_gpus as num_gpus
from ._devices import try_all_gpus as try_all_gpus
from ._devices import try_gpu as try_gpu
from ._devices import use_fake_cpu_devices as use_fake_cpu_devices

# --- meshes ---
from ._mesh import DEFAULT_AXIS as DEFAULT_AXIS
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
from ._pmap_layout import shard_for_pmap as shard_for_pmap
from ._pmap_layout import stack_for_pmap as stack_for_pmap
from ._pmap_layout import unshard_from_pmap as unshard_from_pmap
from ._pmap_layout import unstack_from_pmap as unstack_from_pmap
from ._prefetch import Prefetcher as Prefetcher
from ._prefetch import prefetch_to_device as prefetch_to_device
from ._data_parallel import data_parallel as data_parallel

# --- sharded parameters ---
from ._rules import Rules as Rules
from ._rules import param_shardings as param_shardings
from ._rules import shard_params as shard_params
from ._sharded_init import init_sharded as init_sharded
from ._plan import MemoryPlan as MemoryPlan
from ._plan import plan as plan

# --- metrics ---
from ._memory import LedgerEntry as LedgerEntry
from ._memory import MemoryLedger as MemoryLedger
from ._memory import memory as memory
from ._explain import MemoryExplanation as MemoryExplanation
from ._fit import MemoryFit as MemoryFit
from ._fit import fit_memory as fit_memory
from ._metrics import Accuracy as Accuracy
from ._metrics import Collection as Collection
from ._metrics import DeviceLog as DeviceLog
from ._metrics import Last as Last
from ._metrics import Max as Max
from ._metrics import Mean as Mean
from ._metrics import Metric as Metric
from ._metrics import Min as Min
from ._metrics import NonFinite as NonFinite
from ._metrics import Sum as Sum
from ._metrics import WeightedMean as WeightedMean
from ._metrics import fetch_metrics as fetch_metrics

# --- train ---
from ._strategy import Strategy as Strategy
from ._train import TrainState as TrainState
from ._step import EvalStep as EvalStep
from ._step import TrainStep as TrainStep
from ._step import make_eval_step as make_eval_step
from ._step import make_train_step as make_train_step
from ._flax import nnx_loss as nnx_loss
from ._flax import nnx_metrics_update as nnx_metrics_update
from ._flax import nnx_split as nnx_split
from ._flax import nnx_update as nnx_update

# --- asserts ---
from ._asserts import assert_committed as assert_committed
from ._asserts import assert_on_device as assert_on_device
from ._asserts import assert_on_host as assert_on_host
from ._asserts import assert_replicated as assert_replicated
from ._asserts import assert_same_placement as assert_same_placement
from ._asserts import assert_sharded as assert_sharded
from ._asserts import assert_sharded_fraction as assert_sharded_fraction

# --- checkpoints ---
from ._checkpointer import Checkpointer as Checkpointer
from ._checkpoint import restore as restore
from ._checkpoint import save as save

# --- guards ---
from ._guards import TransferCounter as TransferCounter
from ._guards import count_transfers as count_transfers
from ._guards import no_host_sync as no_host_sync

# --- multi-process ---
from . import distributed as distributed
from . import testing as testing

__version__ = "0.1.0"
