"""``assert_strategies_agree``: one training run on every strategy the devices allow."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from .._errors import DisagreementError, ShardingError, UsageError
from .._mesh import data_mesh
from ..train import Strategy, make_train_step

_SPLIT = ("pmap", "shard_map")  # the strategies whose loss sees one device's rows
_PER_DEVICE = (
    " A loss that depends on how many rows one call sees (e.g. divided by a hard-coded global "
    "batch size) is right on one device and wrong per device under pmap and shard_map."
)
_KEYS = (
    " With `rng`, each device draws its own keys under pmap and shard_map: a loss that samples "
    "(dropout) differs there by design; compare it deterministic."
)


def _first_difference(got: Any, want: Any, rtol: float, atol: float) -> str | None:
    """``path[index]: got vs want`` for the first leaf element beyond the tolerance."""
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        bad = ~np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            i = tuple(int(k) for k in np.argwhere(bad)[0])
            with np.errstate(invalid="ignore"):  # inf - inf; fmax skips NaN without a warning
                worst = float(np.fmax.reduce(np.abs(a - b).ravel()))
            return (
                f"params{jax.tree_util.keystr(path)}{list(i) if i else ''} = {a[i]:.7g} vs "
                f"{b[i]:.7g} on 'single' (largest difference in this leaf {worst:.3g})"
            )
    return None


def _refuse_diverged(ref: Any, i: int, n: int) -> None:
    """Raise where the reference itself turned non-finite: NaN agrees with NaN, so every
    strategy would pass, a per-device bug included."""
    for path, x in jax.tree.leaves_with_path(ref):
        if not np.isfinite(x := np.asarray(x, np.float64)).all():
            at = [int(k) for k in np.argwhere(~np.isfinite(x))[0]]
            raise DisagreementError(
                f"'single', the reference, has non-finite params after step {i + 1} of {n}: "
                f"params{jax.tree_util.keystr(path)}{at or ''} = {x[tuple(at)]}. A diverged run "
                "compares nothing (NaN agrees with NaN on every strategy): lower the learning "
                "rate, or give batches the loss is finite on."
            )


def assert_strategies_agree(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation | None,
    params: Any,
    batches: Sequence[Any],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    rng: Any = None,
    model_state: Any = None,
    **step_options: Any,
) -> tuple[str, ...]:
    """Train a few steps on every strategy the devices allow; raise where one differs.

    The same ``params`` train on ``batches`` (one step each) under ``Strategy.single()``
    (the reference) and, with several devices, ``pmap``, sharded ``jit``, ``shard_map`` and
    ``fsdp``; after every step each one's params must match within ``atol + rtol * |ref|``.
    It catches a loss that depends on how many rows one call sees.

    Args:
      loss_fn: per-example losses, as for :func:`jaxdev.make_train_step`.
      tx: the optimizer; ``None`` is ``optax.sgd(0.1)`` (prefer SGD: adam hides a
        constant factor).
      params: the initial params.
      batches: host batches, one per step.
      rtol: relative tolerance.
      atol: absolute tolerance.
      rng: a PRNG key for ``loss_fn``'s ``rng`` argument, as for ``step.init_state``. Under
        ``pmap`` and ``shard_map`` each device draws its own keys: a loss that samples
        (dropout) differs there by design, so compare it deterministic.
      model_state: state the forward pass updates (``has_state=True``; an NNX module's
        non-``Param`` state from :func:`jaxdev.nnx.split`), as for ``step.init_state``.
      **step_options: passed to :func:`jaxdev.make_train_step`.

    Returns:
      The names of the strategies compared, reference first.

    Raises:
      DisagreementError: (an AssertionError) a strategy's params differ: the strategy, the
        step, the first differing leaf and both values named.
      UsageError: ``batches`` is empty or one batch (a dict or an array), a tolerance is
        not a number >= 0, or ``tx`` is no optax transformation.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jaxdev
      >>> def loss_fn(params, batch):
      ...     return (batch["x"] @ params["w"] - batch["y"]) ** 2
      >>> batch = {"x": np.ones((16, 8), np.float32), "y": np.ones(16, np.float32)}
      >>> jaxdev.testing.assert_strategies_agree(loss_fn, None, {"w": jnp.zeros(8)}, [batch] * 2)
      ('single', 'pmap', 'sharded', 'shard_map', 'fsdp')
    """
    if isinstance(batches, Mapping) or hasattr(batches, "shape"):
        raise UsageError(
            f"`batches` is one batch (a {type(batches).__name__}), not a list of batches: "
            "give a list, one batch per step, e.g. `[batch]` or `[batch] * 2`."
        )
    batches = list(batches)
    if not batches:
        raise UsageError("`batches` is empty: give at least one batch (one step each).")
    if not all(isinstance(t, numbers.Real) for t in (rtol, atol)) or not (rtol >= 0 and atol >= 0):
        raise UsageError(f"`rtol` and `atol` must be >= 0, got rtol={rtol!r}, atol={atol!r}.")
    tx = optax.sgd(0.1) if tx is None else tx  # make_train_step names a tx of another type
    strategies = {"single": Strategy.single()}  # the reference, then what the devices allow
    if jax.local_device_count() > 1:
        mesh = data_mesh()
        strategies["pmap"] = Strategy.pmap()
        strategies["sharded"] = Strategy.sharded(mesh)
        strategies["shard_map"] = Strategy.sharded(mesh, shard_map=True)
        strategies["fsdp"] = Strategy.sharded(mesh, rules="fsdp", min_size=0)
    trails = {}  # strategy: the params after each step, on the host
    for name, strategy in strategies.items():
        trail = []
        try:
            step = make_train_step(loss_fn, tx, strategy, donate=False, **step_options)
            state = step.init_state(params, tx, rng=rng, model_state=model_state)
            for batch in batches:
                state, _ = step(state, step.put_batch(batch))
                trail.append(jax.device_get(state.params))
            trails[name] = trail
        except Exception as e:
            if name == "fsdp" and isinstance(e, ShardingError):
                continue  # fsdp over params none of whose leaves it can split
            step_i = f"step {len(trail) + 1} of {len(batches)}"
            e.add_note(f"assert_strategies_agree: raised under strategy '{name}' ({step_i}).")
            raise
    for i, ref in enumerate(trails["single"]):
        _refuse_diverged(ref, i, len(batches))
        for name, trail in trails.items():
            if where := _first_difference(trail[i], ref, rtol, atol):
                raise DisagreementError(
                    f"strategy '{name}' disagrees with 'single' after step {i + 1} of "
                    f"{len(batches)} ({jax.local_device_count()} devices): {where}; tolerance "
                    f"atol={atol:g} + rtol={rtol:g} * |single|.{_PER_DEVICE * (name in _SPLIT)}"
                    f"{_KEYS * (name in _SPLIT and rng is not None)}"
                )
    return tuple(trails)
