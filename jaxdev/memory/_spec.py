"""A step as the memory modules see it: a frozen :class:`StepSpec` and the strategy it names.

The train subsystem (above) builds specs and gives the factory back; the memory
modules change, lower and ask them for layouts without importing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._errors import UsageError


class StrategyLike(Protocol):
    """What the memory modules ask of a strategy (``jaxdev.Strategy`` is one)."""

    devices: tuple[Any, ...]
    mesh: Mesh
    rules: Any
    shard_map: bool
    offload: tuple[str, ...]
    options: dict[str, Any]  # a property of jaxdev.Strategy, as is n_devices
    n_devices: int

    def replace(self, **changes: Any) -> StrategyLike: ...
    def state_layout(self, state: Any, **options: Any) -> Any: ...
    def batch_spec(self, k: int = 1, m: int = 1, ndim: int | None = None) -> P: ...
    def batch_shape(self, rows: int, k: int = 1, m: int = 1) -> tuple[int, ...]: ...
    def mesh_context(self) -> contextlib.AbstractContextManager: ...


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """A train or eval step, described: what the memory modules take.

    ``config`` holds the ``loss_fn`` contract and options (``accumulate``, ``remat``);
    ``build(spec)`` gives the step back (the train subsystem's factory).
    """

    strategy: StrategyLike
    config: Any
    steps_per_call: int = 1
    donate: bool = False
    train: bool = True
    memory_limit: int | None = None
    build: Callable[[StepSpec], Any] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def accumulate(self) -> int:
        """Micro-batches per update (``M``)."""
        return self.config.accumulate

    @property
    def subject(self) -> str:
        """What needs the memory, for messages: ``'the train step'`` or ``'the eval step'``."""
        return f"the {'train' if self.train else 'eval'} step"

    def replace(self, strategy: StrategyLike | None = None, **config: Any) -> StepSpec:
        """This step with another strategy or options (``accumulate``, ``remat``), no budget."""
        cfg = dataclasses.replace(self.config, **config) if config else self.config
        return dataclasses.replace(
            self, strategy=strategy or self.strategy, config=cfg, memory_limit=None
        )

    def step(self) -> Any:
        """The step this describes (a new one: the caller's step is never changed)."""
        return self.build(self)

    def lower(self, state: Any, batch: Any, metrics: Any = None) -> Any:
        """The ``jax`` lowering of one call of the described step (see ``TrainStep.lower``)."""
        return self.step().lower(state, batch, metrics)


@runtime_checkable
class Described(Protocol):
    """A step that carries its description (``jaxdev.TrainStep``, ``jaxdev.EvalStep``)."""

    spec: StepSpec


def spec_of(step: object, arg: str = "step") -> StepSpec:
    """The description of ``step`` (a jaxdev step or a :class:`StepSpec`)."""
    if isinstance(step, StepSpec):
        return step
    if isinstance(step, Described) and isinstance(step.spec, StepSpec):
        return step.spec
    raise UsageError(
        f"`{arg}` must be a jaxdev step (from `jaxdev.make_train_step` or `make_eval_step`), "
        f"got {type(step).__name__}."
    )
