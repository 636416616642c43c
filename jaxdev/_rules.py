"""Rules -> shardings: where each parameter (and its optimizer state) lives on a mesh.

A rule set (:data:`Rules`) is ``"replicate"``; ``"fsdp"`` (each leaf of at least
``min_size`` elements split along its largest dimension the fsdp axis divides, ties: the
last); a list of ``(regex, PartitionSpec)`` pairs matched with ``re.search`` against the
leaf's ``/``-joined path (``"params/Dense_0/kernel"``; first match wins, unmatched leaves
replicated, short specs padded with ``None``); ``"flax"`` (the model's own linen / NNX
partitioning metadata); or a layout pytree of ``PartitionSpec`` / ``NamedSharding``.
Every spec is checked against its leaf and the mesh before anything is placed
(:class:`ShardingError` naming leaf, shape, spec, mesh); with ``indivisible="replicate"`` a
dimension its mesh axis does not divide is replicated instead (flax drops such a sharding
under ``jit``), logged once per leaf. The optimizer state follows the params
(:func:`follow_params`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core import meta as flax_meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import tree_flatten_with_path

from ._errors import LeafTypeError, ShardingError, available_devices, short
from ._leaves import PY_SCALARS, is_jax_array, keystr
from ._mesh import axis_size, batch_axis, check_mesh, named_sharding
from ._placement import place_tree

Rules = Any
"""``"replicate"`` | ``"fsdp"`` | ``"flax"`` | ``[(regex, PartitionSpec), ...]`` | a layout tree."""

_FORMS = (
    "'replicate', 'fsdp', 'flax', a list of (regex, PartitionSpec) pairs such as "
    "[('Dense_.*/kernel', P(None, 'model'))], or a pytree of PartitionSpec / NamedSharding "
    "matching the params"
)

_log = logging.getLogger("jaxdev")
_TOLD: set[Any] = set()  # (leaf, shape, spec, mesh) already logged as replicated

DEFAULT_MIN_SIZE = 1024
"""Leaves with fewer elements stay replicated under ``rules="fsdp"``."""


class _Leaf(NamedTuple):
    """One array leaf of an (unboxed) params tree, as the rules see it."""

    path: str  # "params/Dense_0/kernel": what regex rules match
    keys: str  # "['params']['Dense_0']['kernel']": what errors name
    shape: tuple[int, ...]
    annotation: Any  # the flax box / NNX variable holding it, or None


def _is_box(x: Any) -> bool:
    return isinstance(x, (flax_meta.AxisMetadata, nnx.Variable))


def _leaves_of(tree: Any, arg: str) -> list[_Leaf]:
    """Every array leaf of ``tree`` (linen boxes and NNX variables seen through)."""
    out: list[_Leaf] = []
    for path, node in tree_flatten_with_path(tree, is_leaf=_is_box)[0]:
        box = node if _is_box(node) else None
        for sub, leaf in tree_flatten_with_path(node)[0] if box is not None else [((), node)]:
            keys = (*path, *(sub[1:] if sub[:1] == (_VALUE,) else sub))  # a box's `.value`
            slashed = jax.tree_util.keystr(keys, simple=True, separator="/")
            out.append(_Leaf(slashed, keystr(keys), _shape_of(leaf, keys, arg), box))
    return out


_VALUE = jax.tree_util.GetAttrKey("value")


def _shape_of(leaf: Any, keys: tuple[Any, ...], arg: str) -> tuple[int, ...]:
    if isinstance(leaf, (jax.ShapeDtypeStruct, np.ndarray, np.generic)) or is_jax_array(leaf):
        return tuple(leaf.shape)
    if isinstance(leaf, PY_SCALARS):
        return ()
    raise LeafTypeError(
        f"`{arg}` leaf {keystr(keys)}: a "
        f"{type(leaf).__module__}.{type(leaf).__qualname__} is not an array; expected a "
        "jax.Array, numpy array, Python number or jax.ShapeDtypeStruct (None passes "
        f"through). {available_devices()}"
    )


def _unbox_one(box: Any) -> Any:
    """A flax box's value, without the sharding constraint ``Partitioned.unbox`` may add."""
    try:
        return box.unbox(apply_constraint=False)
    except TypeError:  # an AxisMetadata subclass without the argument
        return box.unbox()


def unbox(tree: Any) -> Any:
    """``tree`` with linen ``nn.Partitioned`` boxes replaced by their values (no constraint)."""
    boxed = flax_meta.is_axis_metadata
    if not any(map(boxed, jax.tree.leaves(tree, is_leaf=boxed))):
        return tree  # the same object: nothing to unbox
    return flax_meta.map_axis_meta(_unbox_one, tree)


def _mesh_text(mesh: Mesh) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items())


def fsdp_axis_of(mesh: Mesh, fsdp_axis: Any = None) -> str | tuple[str, ...]:
    """The mesh axis (or axes) ``rules='fsdp'`` shards over: the one owner of that default.

    ``fsdp_axis`` when given; else a ``'fsdp'`` axis of size > 1; else the batch axes
    (every axis but ``'model'``/``'tensor'``).
    """
    if fsdp_axis is None and "fsdp" in mesh.axis_names and mesh.shape["fsdp"] > 1:
        return "fsdp"
    try:
        axis = batch_axis(mesh, fsdp_axis)
    except ShardingError:
        if fsdp_axis is not None:
            raise ShardingError(
                f"`fsdp_axis`={fsdp_axis!r} is not an axis of the mesh ({_mesh_text(mesh)}); "
                f"pick one of {mesh.axis_names}."
            ) from None
        raise ShardingError(
            f"`rules`='fsdp' needs an axis to shard over: every axis of the mesh "
            f"({_mesh_text(mesh)}) is a model axis. Pass `fsdp_axis=` (an axis name, or a "
            "tuple of names to shard over several), or build the mesh with an 'fsdp' axis: "
            "jaxdev.make_mesh({'data': 2, 'fsdp': -1})."
        ) from None
    if fsdp_axis is not None and axis_size(mesh, axis) == 1:
        raise ShardingError(
            f"`fsdp_axis`={fsdp_axis!r} has size 1 on the mesh ({_mesh_text(mesh)}): "
            "`rules`='fsdp' over it would shard nothing. Pick an axis of size > 1, or leave "
            "`fsdp_axis` out to shard over the batch axes."
        )
    return axis


def _fsdp_spec(shape: tuple[int, ...], axis: Any, n: int, min_size: int) -> P:
    """Shard the largest dim divisible by ``n`` (ties: the last one); else replicate."""
    dims = [d for d, size in enumerate(shape) if size > 0 and size % n == 0]
    if int(np.prod(shape, dtype=np.int64)) < min_size or not dims:
        return P()
    return P(*([None] * max(dims, key=lambda d: (shape[d], d))), axis)


def _regex_rules(rules: Any) -> list[tuple[re.Pattern[str], P, str]] | None:
    """The compiled ``(pattern, spec, source)`` list, or None when ``rules`` is not one."""
    pairs = isinstance(rules, (list, tuple)) and not isinstance(rules, P)
    if not pairs or not all(
        isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], (str, re.Pattern))
        for r in rules
    ):  # [] passes: no rules, every leaf unmatched, replicated
        return None
    out = []
    for pattern, spec in rules:
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise ShardingError(
                f"`rules` pattern {pattern!r} is not a valid regular expression: {err}."
            ) from None
        spec = P() if spec is None else spec
        if not isinstance(spec, P):
            if not isinstance(spec, (tuple, list)) or not all(
                s is None or isinstance(s, (str, tuple)) for s in spec
            ):
                raise ShardingError(
                    f"`rules` pattern {compiled.pattern!r} maps to {spec!r}, which is not a "
                    "PartitionSpec: write P(None, 'model') (from jax.sharding import "
                    "PartitionSpec as P), a tuple of axis names / None, or None to replicate."
                )
            spec = P(*spec)
        out.append((compiled, spec, pattern))
    return out


def _flax_spec(leaf: _Leaf, logical_axis_rules: Any) -> tuple[P, str]:
    """The spec flax reads from a leaf's box (``logical_axis_rules=`` as flax's context; a
    linen box's own rules win), and where it came from (for errors)."""
    box, given = leaf.annotation, logical_axis_rules
    given = None if given is None else tuple(map(tuple, given))
    with contextlib.nullcontext() if given is None else nn.logical_axis_rules(given):
        if isinstance(box, nnx.Variable):
            names = box.get_metadata().get("out_sharding")
            if not names:
                return P(), ""
            if isinstance(names, NamedSharding):  # a sharding, not names: its spec as it is
                return _strip_unconstrained(names.spec), f"NNX out_sharding {names.spec}"
            spec = P(*nnx.get_partition_spec(box).get_value())
            return _strip_unconstrained(spec), f"NNX out_sharding {tuple(names)}"
        if not isinstance(box, flax_meta.Partitioned):  # bridge's NNXMeta: flax's own reading
            return P(), ""  # re-creates an NNX variable, which fails on abstract values
        spec = nn.get_partition_spec(box)
        if not isinstance(box, nn.LogicallyPartitioned):
            return _strip_unconstrained(spec), f"flax {type(box).__name__} names {tuple(spec)}"
        rules = tuple(map(tuple, box.rules or nn.get_logical_axis_rules()))
    source = f"flax logical names {tuple(spec)}"
    if not rules:
        raise ShardingError(
            f"`rules`='flax': {leaf.keys} of shape {leaf.shape} has {source} "
            "(nn.with_logical_partitioning) but no logical-axis rules map them to mesh "
            "axes. Pass `logical_axis_rules=[('batch', 'data'), ('mlp', 'model'), ...]` "
            "or call inside `with nn.logical_axis_rules(...)`."
        )
    spec = nn.logical_to_mesh_axes(tuple(spec), rules)
    return _strip_unconstrained(spec), f"{source} via rules {rules}"


def _strip_unconstrained(spec: P) -> P:
    return spec.update(partitions=[None if s is P.UNCONSTRAINED else s for s in spec.partitions])


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (P, NamedSharding))


def _layout_specs(tree: Any, layout: Any, mesh: Mesh) -> list[tuple[P, str]]:
    """Specs from an explicit layout tree (a prefix of the unboxed params)."""
    for s in jax.tree.leaves(layout, is_leaf=_is_spec):
        if isinstance(s, NamedSharding) and s.mesh != mesh:
            raise ShardingError(
                f"`rules` holds a NamedSharding on another mesh ({_mesh_text(s.mesh)}, "
                f"devices {list(s.mesh.device_ids.flat)}) than `mesh` ({_mesh_text(mesh)}, "
                f"devices {list(mesh.device_ids.flat)}); give PartitionSpecs or shardings on "
                "`mesh`."
            )
    layout = jax.tree.map(lambda s: P() if s is None else s, layout, is_leaf=_is_spec)
    try:  # None in the params passes through (no leaf); None in the layout replicates
        flat = jax.tree.leaves(jax.tree.broadcast(layout, unbox(tree), is_leaf=_is_spec))
    except (ValueError, TypeError) as err:
        raise ShardingError(
            "`rules` is a layout tree whose structure is not the params' structure (nor a "
            "prefix of it). Give a PartitionSpec / NamedSharding (None = replicate) for every "
            f"key, or use a list of (regex, PartitionSpec) pairs. JAX says: {err}"
        ) from None
    return [(s.spec if isinstance(s, NamedSharding) else s, "the `rules` layout") for s in flat]


def _specs(leaves: list[_Leaf], tree: Any, mesh: Mesh, rules: Rules, options: dict[str, Any]):
    """One ``(spec, source)`` per leaf under ``rules``."""
    form = _form(rules)
    if form == "replicate":
        return [(P(), "`rules`='replicate'")] * len(leaves)
    if form == "fsdp":
        axis = fsdp_axis_of(mesh, options.get("fsdp_axis"))
        n, min_size = axis_size(mesh, axis), options.get("min_size", DEFAULT_MIN_SIZE)
        return [(_fsdp_spec(x.shape, axis, n, min_size), "`rules`='fsdp'") for x in leaves]
    if form == "flax":
        return [_flax_spec(x, options.get("logical_axis_rules")) for x in leaves]
    if form == "layout":
        return _layout_specs(tree, rules, mesh)
    out = []
    for x in leaves:
        hit = next(((spec, src) for pat, spec, src in form if pat.search(x.path)), None)
        out.append((hit[0], f"`rules` pattern {hit[1]!r} (path {x.path!r})") if hit else (P(), ""))
    return out


def _form(rules: Rules) -> Any:
    """``rules``' form: ``'replicate'``, ``'fsdp'``, ``'flax'``, ``'layout'`` or the compiled
    ``(pattern, spec, source)`` list; raise ``ShardingError`` for anything else."""
    if isinstance(rules, str):
        if rules not in ("replicate", "flax", "fsdp"):
            raise ShardingError(f"`rules` must be {_FORMS}; got the string {rules!r}.")
        return rules
    if (regex := _regex_rules(rules)) is not None:
        return regex
    # a pytree node (an NNX State, a dataclass registered with JAX, ...) may be a layout
    node = not jax.tree_util.treedef_is_leaf(jax.tree.structure(rules))
    layout = node or isinstance(rules, (dict, list, tuple, P, NamedSharding))
    if not layout or not all(_is_spec(x) for x in jax.tree.leaves(rules, is_leaf=_is_spec)):
        raise ShardingError(
            f"`rules` must be {_FORMS}; got {type(rules).__name__} {short(rules, 200)}."
        )
    return "layout"


def _check_exists(where: str, axes: Any, mesh: Mesh, what: str = "") -> None:
    """Raise naming the first of ``axes`` that ``mesh`` lacks (``what``: e.g. 'unreduced ')."""
    if missing := [a for a in axes if a not in mesh.axis_names]:
        raise ShardingError(
            f"{where}: {what}mesh axis {missing[0]!r} does not exist; the mesh has axes "
            f"{tuple(mesh.axis_names)}. Rename the axis in the rule, or build a mesh with "
            "it: jaxdev.make_mesh({...})."
        )


def _check_spec(leaf: _Leaf, spec: P, source: str, mesh: Mesh, indivisible: str = "error") -> P:
    """Pad ``spec`` to the leaf's rank (``P()`` if it splits nothing); raise if it cannot apply
    (``indivisible="replicate"``: a dimension its axes do not divide is replicated, logged)."""
    shape, ndim = leaf.shape, len(leaf.shape)
    where = (
        f"{source or '`rules`'} put {spec} on {leaf.keys} of shape {shape} "
        f"(mesh {_mesh_text(mesh)})"
    )
    if len(spec) > ndim:
        raise ShardingError(
            f"{where}: the spec has {len(spec)} entries but the leaf has {ndim} "
            f"dimension(s). Give at most {ndim} entries (missing ones mean 'not split')."
        )
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    for kind in ("unreduced", "reduced"):  # kept (spec.update), so named here as a split's
        names = sorted(getattr(spec, kind, ()))
        _check_exists(where, names, mesh, f"{kind} ")
        if auto := [a for a in names if types[a] != jax.sharding.AxisType.Explicit]:
            raise ShardingError(
                f"{where}: {kind} mesh axis {auto[0]!r} is {types[auto[0]].name}, and JAX takes "
                f"{kind} axes of Explicit mesh axes only. Make it Explicit "
                "(`jaxdev.make_mesh(..., axis_type='explicit')`), or drop it."
            )
    used: list[str] = []
    parts = spec.partitions
    for d, entry in enumerate(parts):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        _check_exists(where, axes, mesh)
        if twice := [a for a in axes if a in used]:
            raise ShardingError(
                f"{where}: mesh axis {twice[0]!r} is used for two dimensions; each mesh axis "
                "may split at most one dimension of a leaf."
            )
        n = axis_size(mesh, axes)
        if shape[d] % n:
            what = f"axis {axes[0]!r} of" if len(axes) == 1 else f"axes {axes} of total"
            why = f"dimension {d} ({shape[d]}) is not divisible by mesh {what} size {n}"
            if indivisible == "error":
                raise ShardingError(
                    f"{where}: {why}. Pad the dimension to a multiple, split another dimension, "
                    "use a smaller axis, or pass `indivisible='replicate'` to replicate it."
                )
            if (key := (leaf.keys, shape, spec, mesh)) not in _TOLD:
                _TOLD.add(key)
                _log.warning("%s: %s, so it is replicated (indivisible='replicate')", where, why)
            parts = (*parts[:d], None, *parts[d + 1 :])
            continue
        used.extend(axes)
    return spec.update(partitions=(*parts, *[None] * (ndim - len(parts))) if used else ())


def param_shardings(
    tree: Any,
    mesh: Mesh,
    rules: Rules = "replicate",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    fsdp_axis: str | tuple[str, ...] | None = None,
    logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
    indivisible: str = "error",
) -> Any:
    """Return a ``NamedSharding`` on ``mesh`` for every leaf of ``tree`` under ``rules``.

    Nothing is allocated: ``tree`` may hold ``jax.ShapeDtypeStruct`` s, linen boxes or an
    NNX ``State``; the result has the unboxed structure. A whole train state works too
    (see :func:`state_shardings`).

    Args:
      tree: a pytree of arrays, numbers or ``ShapeDtypeStruct`` s.
      mesh: the mesh (:func:`jaxdev.make_mesh`).
      rules: see :data:`Rules` (the module docstring).
      min_size: under ``"fsdp"``, leaves with fewer elements are replicated.
      fsdp_axis: under ``"fsdp"``, the mesh axis (or axes) to shard over
        (default: :func:`fsdp_axis_of`).
      logical_axis_rules: under ``"flax"``, ``(logical name, mesh axis)`` pairs; default:
        flax's ``nn.logical_axis_rules`` context. Rules stored in a box win.
      indivisible: ``"error"`` (default) raises for a dimension its mesh axis does not
        divide; ``"replicate"`` replicates that dimension (as flax does under ``jit``) and
        logs it once per leaf on the ``"jaxdev"`` logger.

    Raises:
      ShardingError: a spec that cannot apply (the leaf path, shape, spec and mesh named),
        or ``rules`` of no accepted form.
      LeafTypeError: a leaf is not an array, number or ``ShapeDtypeStruct``.

    Example:
      >>> import jax, jaxdev
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jaxdev.make_mesh({"data": 2, "model": 4})
      >>> shapes = {"params": {"Dense_0": {"kernel": jax.ShapeDtypeStruct((784, 256), "float32"),
      ...                                  "bias": jax.ShapeDtypeStruct((256,), "float32")}}}
      >>> s = jaxdev.param_shardings(shapes, mesh, [("Dense_.*/kernel", P(None, "model"))])
      >>> s["params"]["Dense_0"]["kernel"].spec, s["params"]["Dense_0"]["bias"].spec
      (P(None, 'model'), P())
      >>> fsdp = jaxdev.param_shardings(shapes, jaxdev.make_mesh({"fsdp": 8}), "fsdp")
      >>> fsdp["params"]["Dense_0"]["kernel"].spec
      P('fsdp', None)
    """
    options = dict(min_size=min_size, fsdp_axis=fsdp_axis, logical_axis_rules=logical_axis_rules)
    options["indivisible"] = indivisible
    if is_train_state(tree):  # the whole state: the optimizer state follows the params
        return state_shardings(tree, mesh, rules, **options)
    return _shardings(tree, check_mesh(mesh), rules, options, "tree")


def check_rules(rules: Rules, mesh: Mesh, **options: Any) -> None:
    """Raise ``ShardingError`` now for rules that can apply to no params on ``mesh``: their
    form, options and unreduced specs, without the params (``Strategy.sharded``: a typo fails
    where it is written; specs are checked per leaf later)."""
    if options.get("min_size") is not None:
        _check_min_size(options["min_size"])
    _check_indivisible(options.get("indivisible", "error"))
    if options.get("fsdp_axis") is not None or (isinstance(rules, str) and rules == "fsdp"):
        fsdp_axis_of(mesh, options.get("fsdp_axis"))
    form = _form(rules)
    given = [(f"pattern {p!r}", s) for _, s, p in form] if isinstance(form, list) else []
    if form == "layout":
        flat = jax.tree_util.tree_flatten_with_path(rules, is_leaf=_is_spec)[0]
        given = [(f"leaf {jax.tree_util.keystr(k)}", getattr(s, "spec", s)) for k, s in flat]
    for where, spec in given:
        if unreduced := getattr(spec, "unreduced", None):
            raise ShardingError(
                f"`rules` {where} gives {spec}: a Strategy places params and optimizer state by "
                f"its rules, and an array unreduced over {sorted(unreduced)} is the sum of its "
                "copies, so each placed value would count once per copy. Drop `unreduced` from "
                "the rule (jaxdev.param_shardings keeps it, for shardings inside a step)."
            )


def _check_indivisible(indivisible: Any) -> str:
    if indivisible not in ("error", "replicate"):
        raise ShardingError(f"`indivisible` must be 'error' or 'replicate', got {indivisible!r}.")
    return indivisible


def _check_min_size(min_size: Any) -> None:
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ShardingError(f"`min_size` must be an int >= 0 (elements), got {min_size!r}.")


def _shardings(
    tree: Any, mesh: Mesh, rules: Rules, options: dict[str, Any], arg: str, params: bool = True
) -> Any:
    _check_min_size(min_size := options.get("min_size", DEFAULT_MIN_SIZE))
    leaves = _leaves_of(tree, arg)
    specs = _specs(leaves, tree, mesh, rules, options)
    if params and leaves and isinstance(_form(rules), list) and not any(s for _, s in specs):
        paths = ", ".join(repr(x.path) for x in leaves[:4]) + (" ..." if len(leaves) > 4 else "")
        raise ShardingError(
            f"no pattern of `rules` matches any leaf of `{arg}`, so every leaf would be "
            f"replicated: patterns {[p for p, _ in rules]}; leaf paths {paths}. Patterns are "
            "`re.search`-ed against the path with '/' between keys (e.g. "
            "'params/Dense_0/kernel'); write `rules='replicate'` if replication is meant."
        )
    if params and leaves and rules == "fsdp" and all(s == P() for s, _ in specs):
        big = max(leaves, key=lambda x: int(np.prod(x.shape, dtype=np.int64)))
        n = axis_size(mesh, fsdp_axis_of(mesh, options.get("fsdp_axis")))
        raise ShardingError(
            f"`rules`='fsdp' shards no leaf of `{arg}` over {n} devices, so every device would "
            f"hold the whole model: each leaf has fewer than `min_size`={min_size} "
            f"elements or no dimension divisible by {n} (the largest, {big.path!r}, has shape "
            f"{big.shape}). Lower `min_size=`, or write `rules='replicate'` if replication is "
            "meant."
        )
    how = _check_indivisible(options.get("indivisible", "error"))
    out = [_check_spec(x, s, src, mesh, how) for x, (s, src) in zip(leaves, specs)]
    return jax.tree.structure(unbox(tree)).unflatten([named_sharding(mesh, s) for s in out])


def shard_params(tree: Any, mesh: Mesh, rules: Rules = "replicate", **options: Any) -> Any:
    """Place ``tree`` on ``mesh`` by ``rules``; already placed leaves stay the same objects.

    One batched ``jax.device_put`` (:func:`jaxdev.to_device` semantics; linen boxes unboxed;
    inside ``jit``, sharding constraints). With several processes a host leaf must hold the
    full global value on every process; build big models with :func:`jaxdev.init_sharded`.

    Raises:
      ShardingError, LeafTypeError: as in :func:`param_shardings`; also for a
        ``ShapeDtypeStruct`` leaf (nothing to place).
      LeafValueError: a host leaf would lose values (64-bit with x64 disabled).
      DeletedArrayError: a leaf was deleted or donated.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> mesh = jaxdev.make_mesh({"fsdp": 8})
      >>> params = jaxdev.shard_params({"w": jnp.ones((4096, 8)), "b": jnp.ones(8)}, mesh, "fsdp")
      >>> params["w"].sharding.spec, params["b"].sharding.spec
      (P('fsdp', None), P())
      >>> jaxdev.shard_params(params, mesh, "fsdp") is params
      True
    """
    shardings = param_shardings(tree, mesh, rules, **options)
    return place_tree(unbox(tree), shardings, copy=False)


def has_state_fields(tree: Any) -> bool:
    """Whether ``tree`` has a train state's fields (``step``, ``params``, ``opt_state``)."""
    return all(hasattr(tree, f) for f in ("step", "params", "opt_state"))


def is_train_state(state: Any) -> bool:
    """A NamedTuple (jaxdev's) or a ``.replace``-able dataclass (flax's) with the state fields."""
    if not has_state_fields(state):
        return False
    is_named_tuple = isinstance(state, tuple) and hasattr(type(state), "_fields")
    return is_named_tuple or callable(getattr(state, "replace", None))


def state_shardings(state: Any, mesh: Mesh, rules: Rules = "replicate", **options: Any) -> Any:
    """Return shardings for a whole train state: optimizer state follows the params.

    For a state with ``step``, ``params`` and ``opt_state`` (jaxdev's or flax's
    ``TrainState``): ``params`` and ``model_state`` by ``rules`` (a layout tree: model state
    replicated), ``opt_state`` by :func:`follow_params`, anything else replicated. Any other
    tree: as :func:`param_shardings`.
    """
    mesh = check_mesh(mesh)
    if not is_train_state(state):
        return param_shardings(state, mesh, rules, **options)
    params = _shardings(state.params, mesh, rules, options, "params")
    opt_state = follow_params(state.opt_state, state.params, params, mesh)
    fields = {"params": params, "opt_state": opt_state}
    model_state = getattr(state, "model_state", None)
    if model_state is not None:  # the rules are written for the params: no match is fine here
        layout = _form(rules) == "layout"
        fields["model_state"] = _shardings(
            model_state, mesh, "replicate" if layout else rules, options, "model_state", False
        )
    everywhere = named_sharding(mesh, P())
    return _with_fields(jax.tree.map(lambda _: everywhere, unbox(state)), fields)  # step, rng


def step_shardings(state: Any, mesh: Mesh, rules: Rules = "replicate", **options: Any) -> Any:
    """The shardings a sharded step gives ``state``: :func:`state_shardings`, except that under
    ``"flax"`` params already laid out on ``mesh`` keep their layout (their unboxed declaration).
    """
    mesh = check_mesh(mesh)
    shapes = jax.tree.map(_as_shape, state)  # never arrays: a failed match repr()s its input
    layout = state_shardings(shapes, mesh, rules, **options)
    train, carried = is_train_state(state), None
    if isinstance(rules, str) and rules == "flax":  # kept when every leaf is on `mesh`
        tree = unbox(state.params if train else state)
        have = [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]
        if have and all(isinstance(s, NamedSharding) and s.mesh == mesh for s in have):
            carried = jax.tree.map(lambda x: x.sharding, tree)
    if carried is None or not train:
        return layout if carried is None else carried
    follow = follow_params(shapes.opt_state, shapes.params, carried, mesh)
    return _with_fields(layout, {"params": carried, "opt_state": follow})


def _with_fields(state: Any, fields: dict[str, Any]) -> Any:
    """``state`` (a NamedTuple or a ``.replace``-able dataclass) with ``fields`` replaced."""
    return state._replace(**fields) if isinstance(state, tuple) else state.replace(**fields)


def follow_params(opt_state: Any, params: Any, shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state: subtrees mirroring ``params`` get ``shardings``.

    A subtree mirrors the params when it has their structure (``MaskedNode`` allowed) and
    each leaf its parameter's shape: adam's ``mu``/``nu``, momentum, the inner states of
    ``chain``/``masked``/``inject_hyperparams``. Other leaves are replicated on ``mesh``.
    No ``tx`` needed: it works on ``jax.eval_shape(tx.init, params)``; boxes are unboxed.
    """
    mesh = check_mesh(mesh)
    leaves, treedef = jax.tree.flatten(unbox(params))
    shapes = [np.shape(x) for x in leaves]
    targets, replicated = treedef.flatten_up_to(shardings), named_sharding(mesh, P())
    # Match on shapes only: a failed `flatten_up_to` builds its message from the
    # node's repr, which would copy every array of a real state to the host.
    # Boxed params give boxed moments (tx.init maps over the boxes): unbox them too.
    opt_state = jax.tree.map(_as_shape, unbox(opt_state))

    def mirror(node: Any) -> Any:
        """``node``'s shardings if it mirrors the params (structure + shapes), else None."""
        if node is None or _is_leafish(node) and treedef.num_leaves != 1:
            return None
        try:
            subtrees = treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            return None
        out = []
        for sub, shape, target in zip(subtrees, shapes, targets):
            if _is_leafish(sub):
                if tuple(sub.shape) != shape:
                    return None
                out.append(target)
            elif not jax.tree.leaves(sub):  # MaskedNode / empty: masked out
                out.append(sub)
            else:
                return None
        return treedef.unflatten(out) if any(map(_is_leafish, subtrees)) else None

    return jax.tree.map(
        lambda node: replicated if (found := mirror(node)) is None else found,
        opt_state,
        is_leaf=lambda node: mirror(node) is not None,
    )


def _as_shape(x: Any) -> Any:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if _is_leafish(x) else x


def _is_leafish(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "shape") and hasattr(x, "dtype")
