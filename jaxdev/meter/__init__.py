"""A step-time meter: where a training loop's wall time went (README's "Step-time meter")."""

# ruff: noqa: F401

from ._meter import MeterReport as MeterReport
from ._meter import StepMeter as StepMeter

__all__ = ["MeterReport", "StepMeter"]
