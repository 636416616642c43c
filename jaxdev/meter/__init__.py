"""A step-time meter: where a training loop's wall time went (README's "Step-time meter")."""

# ruff: noqa: F401

from ._meter import MeterReport as MeterReport
from ._meter import StepMeter as StepMeter
from ._meter import peak_flops as peak_flops

__all__ = ["MeterReport", "StepMeter", "peak_flops"]
