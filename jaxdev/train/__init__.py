"""Training: strategies, the train and eval steps, their state, metrics, Flax/NNX helpers.

``make_train_step(loss_fn, tx, strategy)`` and ``make_eval_step`` build the
functional step; a :class:`Strategy` (single, pmap, sharded, shard_map) owns
where its state and batches live; :mod:`jaxdev.metrics` accumulates on
device. Every public name is re-exported at ``jaxdev``'s top or in its
``metrics`` and ``nnx`` namespaces.

Imports the core, ``jaxdev.distributed`` and ``jaxdev.memory`` (through
their ``__init__``).
"""

# ruff: noqa: I001, F401 - re-exports

from ._strategy import Strategy as Strategy
from ._train import TrainState as TrainState
from ._step import EvalStep as EvalStep
from ._step import TrainStep as TrainStep
from ._step import make_eval_step as make_eval_step
from ._step import make_train_step as make_train_step
from ._sharded_init import init_sharded as init_sharded
