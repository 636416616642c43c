"""A step as the memory modules see it: a frozen :class:`StepSpec` and the strategy it names.

The train subsystem (above) builds specs and gives the factory back; the memory
modules change, lower and ask them for layouts without importing it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .._errors import UsageError


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """A train or eval step, described: what the memory modules take.

    ``strategy`` is a ``jaxdev.Strategy``: its methods give every layout (``state_layout``,
    ``batch_spec``, ``batch_shape``) and changed copies (``replace``). ``config`` holds
    the ``loss_fn`` contract and options (``accumulate``, ``remat``); ``build(spec)``
    gives the step back (the train subsystem's factory).
    """

    strategy: Any  # memory does not import train
    config: Any
    steps_per_call: int = 1
    donate: bool = False
    train: bool = True
    memory_limit: int | None = None
    build: Callable[[StepSpec], Any] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    warned: set[str] = dataclasses.field(  # what was logged once for this step
        default_factory=set, init=False, compare=False, repr=False
    )

    @property
    def accumulate(self) -> int:
        """Micro-batches per update (``M``)."""
        return self.config.accumulate

    @property
    def subject(self) -> str:
        """What needs the memory, for messages: ``'the train step'`` or ``'the eval step'``."""
        return f"the {'train' if self.train else 'eval'} step"

    def replace(self, strategy: Any = None, **config: Any) -> StepSpec:
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
    spec = step if isinstance(step, StepSpec) else getattr(step, "spec", None)
    if isinstance(spec, StepSpec):
        return spec
    raise UsageError(
        f"`{arg}` must be a jaxdev step (from `jaxdev.make_train_step` or `make_eval_step`), "
        f"got {type(step).__name__}."
    )
