"""Build parameters directly in their shardings: no full copy on any device or host.

``model.init`` then sharding materialises every parameter whole first (jax#19893,
flax#3701); :func:`init_sharded` takes the shapes (``jax.eval_shape``), their
shardings by the rules, and runs the init under ``jax.jit`` with those
``out_shardings``: each device computes only its shard, the same values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib
from jax.sharding import Mesh

from .._errors import UsageError
from .._mesh import auto_axes_error, check_mesh, under_mesh
from .._placement import refuse_unreduced_leaves
from .._rules import Rules, param_shardings, unbox
from .._target import refuse
from ..distributed import same_program
from ..memory import explained_oom, plan_lines


def init_sharded(
    init_fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh,
    rules: Rules = "replicate",
    **options: Any,
) -> Any:
    """Call ``init_fn(*args)`` so that its result is born sharded on ``mesh`` by ``rules``.

    A linen ``model.init`` (or any function returning arrays) gives its
    variables back unboxed; a function returning an NNX module gives the module,
    its whole state built sharded. Array arguments are traced, the others are
    constants; the init is traced under ``jax.set_mesh(mesh)``. ``rules`` and
    ``**options`` are as in :func:`jaxdev.param_shardings`.

    Raises:
      ShardingError: a rule cannot apply to a leaf (named), or another mesh is set.
      UsageError: ``init_fn`` is not callable.
      DistributedError: the processes built different programs (one named).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxdev
      >>> mesh = jaxdev.make_mesh({"fsdp": 8})
      >>> model = nn.Dense(512)
      >>> variables = jaxdev.init_sharded(model.init, jax.random.key(0), jnp.ones((1, 256)),
      ...                                 mesh=mesh, rules="fsdp")
      >>> variables["params"]["kernel"].sharding.spec
      P(None, 'fsdp')
      >>> from flax import nnx
      >>> layer = jaxdev.init_sharded(lambda: nnx.Linear(256, 512, rngs=nnx.Rngs(0)),
      ...                             mesh=mesh, rules="fsdp")
      >>> layer.kernel[...].sharding.spec
      P(None, 'fsdp')
    """
    if not callable(init_fn):
        raise UsageError(
            f"`init_fn` must be callable (e.g. `model.init` or `lambda: Model(nnx.Rngs(0))`), "
            f"got {type(init_fn).__name__} {init_fn!r}."
        )
    mesh = check_mesh(mesh)
    refuse("init_sharded", mesh)  # a target mesh: named, not JAX's bare error mid-init
    call, dynamic = _split_args(init_fn, args)
    # Shapes first, NNX's annotations kept as metadata only (eager sharding off).
    needs = lambda: plan_lines(abstract, mesh, rules, options)  # noqa: E731
    with nnx.use_eager_sharding(False), explained_oom("init_sharded", extra=needs):
        in_mesh, abstract = _shapes(call, dynamic, mesh)
        with under_mesh(mesh) if in_mesh else contextlib.nullcontext():
            graphdef, tree = None, abstract
            if graphlib.is_graph_node(abstract):  # an NNX module: its state built, then merged
                graphdef, tree = nnx.split(abstract)
            shardings = param_shardings(tree, mesh, rules, **options)
            shapes = jax.tree.leaves(tree if graphdef is not None else unbox(tree))
            refuse_unreduced_leaves(shardings, shapes, "init_fn")
            part = unbox if graphdef is None else nnx.state
            init = jax.jit(lambda *a: part(call(*a)), out_shardings=shardings)
            out = same_program(init, name="init_sharded's init_fn")(*dynamic)
        out = jax.block_until_ready(out)  # an out-of-memory is raised (and explained) here
        return out if graphdef is None else nnx.merge(graphdef, out)


def _shapes(call: Callable[..., Any], dynamic: tuple[Any, ...], mesh: Mesh) -> tuple[bool, Any]:
    """``(under the mesh?, shapes)`` of the init: under the mesh (bare PartitionSpecs), else
    without it (linen boxes constrain under a mesh; the rules name a missing axis better)."""
    with under_mesh(mesh):
        try:
            return True, nnx.eval_shape(call, *dynamic)
        except (ValueError, AssertionError) as err:
            under = err
    try:
        return False, nnx.eval_shape(call, *dynamic)
    except Exception:  # reshard / out_sharding= on an Auto axis: named
        raise auto_axes_error(under, mesh) or under from None


def _split_args(init_fn: Callable[..., Any], args: tuple[Any, ...]):
    """``(call, dynamic)``: array leaves of ``args`` are traced, the rest are constants."""
    leaves, treedef = jax.tree.flatten(args)
    where = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
    if len(where) == len(leaves):
        return init_fn, args

    def call(*dynamic: Any) -> Any:
        full = list(leaves)
        for i, x in zip(where, dynamic):
            full[i] = x
        return init_fn(*jax.tree.unflatten(treedef, full))

    return call, tuple(leaves[i] for i in where)
