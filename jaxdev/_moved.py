"""Names that left ``jaxdev``'s top for a namespace (issue 27): where each one went."""

from __future__ import annotations

_NAMESPACES = {
    "d2l": "cpu gpu num_gpus try_gpu try_all_gpus",
    "pmap": "stack_for_pmap unstack_from_pmap shard_for_pmap unshard_from_pmap",
    "memory": "plan MemoryPlan fit_memory MemoryFit MemoryExplanation MemoryLedger LedgerEntry",
    "metrics": "Accuracy Collection DeviceLog Last Max Mean Metric Min NonFinite Sum WeightedMean "
    "fetch_metrics",
    "testing": "use_fake_cpu_devices",
}
MOVED = {name: f"{ns}.{name}" for ns, names in _NAMESPACES.items() for name in names.split()}
MOVED |= {f"nnx_{n}": f"nnx.{n}" for n in ("split", "loss", "update", "metrics_update")}
GONE = {
    "DEFAULT_AXIS": "write the axis name, 'data'",
    "TransferCounter": "it is what `count_transfers()` yields",
}


def __getattr__(name: str):
    """Module ``__getattr__`` of ``jaxdev``: name where a moved name went.

    Example:
      >>> import jaxdev
      >>> jaxdev.try_gpu
      Traceback (most recent call last):
      AttributeError: jaxdev.try_gpu moved to jaxdev.d2l.try_gpu (README: Changes)
    """
    why = f"moved to jaxdev.{MOVED[name]}" if name in MOVED else f"is gone: {GONE.get(name)}"
    if name in MOVED or name in GONE:
        raise AttributeError(f"jaxdev.{name} {why} (README: Changes)")
    raise AttributeError(f"module 'jaxdev' has no attribute {name!r}")
