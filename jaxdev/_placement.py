"""Move, copy and fetch pytrees; find the devices they live on.

Leaf policy (every public function here): ``jax.Array``, numpy arrays and
scalars, and Python ``bool``/``int``/``float``/``complex`` are placed;
``None`` is an empty subtree and passes through; anything else raises
:class:`LeafTypeError` naming its key path.

Every function that places takes ``target`` in one of four forms: a
``jax.Device``; a device spec (``'gpu:1'``, ``'cpu'``, an int index); a
``jax.sharding.Sharding``; or a ``Mesh``, meaning a full copy on each of its
devices (``NamedSharding(mesh, P())``). :func:`as_sharding` is the one
function that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from ._devices import DeviceSpec, resolve_device
from ._errors import PlacementError, ShardingError, available_devices, format_devices, join_failures
from ._leaves import (
    array_type,
    check_concrete,
    check_host_leaves,
    check_live,
    deleted,
    describe_sharding,
    device_key,
    host_problem,
    is_jax_array,
    is_placed,
    is_tracer,
    path_of,
    raise_leaf,
    sharding_key,
    x64,
)
from ._mesh import replicated_sharding

Target = DeviceSpec | Sharding | Mesh
"""Where to place: a ``jax.Device``, a spec (``'gpu:1'``, ``3``), a ``Sharding`` or a ``Mesh``."""


def as_sharding(target: Target) -> Sharding:
    """Return ``target`` as a ``jax.sharding.Sharding``.

    Args:
      target: a ``Sharding`` (returned as is); a ``Mesh``, meaning a full copy
        on each of its devices (``NamedSharding(mesh, P())``); or one device:
        a ``jax.Device`` or a spec (``'gpu:1'``, ``'cpu'`` for cpu:0, an int
        index).

    Raises:
      DeviceSpecError, DeviceNotFoundError: ``target`` names no device here.

    Example:
      >>> import jaxdev
      >>> jaxdev.as_sharding("cpu:0").device_set == {jaxdev.cpu(0)}
      True
      >>> jaxdev.as_sharding(jaxdev.data_mesh()).is_fully_replicated
      True
    """
    if isinstance(target, Sharding):
        return target
    if isinstance(target, Mesh):
        return replicated_sharding(target)
    return SingleDeviceSharding(resolve_device(target, "target"))


def _check_fits(tree: Any, leaves: Sequence[Any], idx: Sequence[int], s: Sharding, arg: str):
    """Raise ShardingError naming leaves whose shape ``s`` cannot split."""
    if isinstance(s, SingleDeviceSharding):
        return
    for i in idx:
        shape = np.shape(leaves[i])
        try:
            s.shard_shape(shape)
        except Exception as err:  # JAX raises ValueError / IndexError / AssertionError
            raise ShardingError(
                f"`{arg}` leaf {path_of(tree, i)} with shape {shape} cannot be placed on "
                f"{describe_sharding(s)}: {err}. Pad the leaf or choose a spec that "
                f"divides its shape. {available_devices()}"
            ) from None


def _all_placed(leaves: Sequence[Any], s: Sharding) -> bool:
    """One cheap pass: is every leaf a live, committed array with sharding ``s``?

    The common no-op case touches no runtime and no key paths; anything
    unusual (host data, tracers, equivalent-but-unequal shardings, deleted
    buffers) falls through to the careful path.
    """
    impl = array_type()
    want = sharding_key(s)
    ok = None
    for x in leaves:
        if type(x) is not impl or not x.committed:
            return False
        have = x.sharding
        if have is not ok:
            if sharding_key(have) != want:
                return False
            ok = have
        if x.is_deleted():
            return False
    return True


def to_device(tree: Any, target: Target) -> Any:
    """Place every leaf of ``tree`` on ``target``; already placed leaves stay as they are.

    d2l's ``as_in_ctx`` and torch's ``.to``: a committed leaf already on
    ``target`` comes back as the *same object* (raw ``jax.device_put`` returns
    a new one), the leaves that must move go in one batched
    ``jax.device_put``, and if nothing moves ``tree`` itself is returned.
    Uncommitted arrays (made without a device) are committed to ``target``.
    Host dtypes follow JAX's rules (with x64 off, ``float64`` becomes
    ``float32``), except that values which would be lost are refused:
    integers that would be truncated and finite floats that would overflow
    to ``inf``.

    Like ``jax.device_put``, placing a numpy array on a CPU device may alias
    its buffer (JAX does so for aligned arrays even with ``may_alias=False``),
    so writing into that numpy array later changes the jax.Array. Use
    :func:`copy_to` when the host buffer will be reused.

    Inside ``jax.jit``, a ``Sharding`` target becomes
    ``jax.lax.with_sharding_constraint``; a single device target raises,
    because JAX silently ignores ``device_put`` to a device inside ``jit``.

    Args:
      tree: any pytree (Flax params, optax state, a batch).
      target: a ``jax.Device``, a spec such as ``'gpu:1'``, a ``Sharding``,
        or a ``Mesh`` (a full copy on each of its devices).

    Returns:
      A pytree with the structure of ``tree`` whose leaves live on ``target``.

    Raises:
      LeafTypeError: a leaf is not an array or number (its key path named).
      LeafValueError: an int leaf would be truncated or a float leaf would
        overflow to ``inf`` (x64 disabled).
      DeletedArrayError: a leaf was deleted or donated.
      ShardingError: a leaf's shape does not divide over ``target``.
      PlacementError: a device target inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones((2, 2))}, "cpu:0")
      >>> jaxdev.to_device(params, "cpu:0") is params
      True
    """
    sharding = as_sharding(target)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if _all_placed(leaves, sharding):
        return tree
    moving = _plan_moves(tree, leaves, sharding)
    if moving is None:  # inside a trace
        return _constrain(tree, leaves, treedef, target, sharding)
    _check_fits(tree, leaves, moving, sharding, "tree")
    moved = jax.device_put([leaves[i] for i in moving], _put_target(target, sharding))
    out = list(leaves)
    for i, new in zip(moving, moved):
        out[i] = new
    return jax.tree_util.tree_unflatten(treedef, out)


def _put_target(target: Target, s: Sharding) -> Sharding | jax.Device:
    """What to hand ``jax.device_put``: the device itself when ``target`` named one.

    JAX's put is ~5% faster given a device than its ``SingleDeviceSharding``.
    """
    return s if isinstance(target, (Sharding, Mesh)) else next(iter(s.device_set))


_PLAIN_KINDS = frozenset("fcb")  # float, complex, bool numpy dtypes: only 64-bit ones to check


def _plan_moves(tree: Any, leaves: Sequence[Any], s: Sharding) -> list[int] | None:
    """One pass over the leaves: the indexes that must move to ``s``.

    Returns None when a leaf is a tracer (the caller constrains instead).
    Raises like ``check_live`` then ``check_host_leaves`` would: every
    deleted leaf named first, else the first host leaf that can't be placed.
    The common leaf types (jaxlib arrays, float numpy arrays) skip the
    generic checks, which cost ~1 us a leaf.
    """
    impl, want = array_type(), sharding_key(s)
    moving: list[int] = []
    dead: list[int] = []
    problem: tuple[int, tuple[type[Exception], str]] | None = None
    for i, x in enumerate(leaves):
        t = type(x)
        if t is impl:
            if x.is_deleted():
                dead.append(i)
            elif not (x.committed and sharding_key(x.sharding) == want) and not is_placed(x, s):
                moving.append(i)
            continue
        if t is np.ndarray and x.dtype.kind in _PLAIN_KINDS and (x.dtype.itemsize < 8 or x64()):
            moving.append(i)
            continue
        if is_tracer(x):
            return None
        if isinstance(x, jax.Array):
            if deleted(x):
                dead.append(i)
            elif not is_placed(x, s):
                moving.append(i)
            continue
        if problem is None:
            found = host_problem(x)
            if found is not None:
                problem = (i, found)
        moving.append(i)
    if dead:
        check_live(tree, leaves, "tree")
    if problem is not None:
        raise_leaf(tree, problem[0], "tree", *problem[1])
    return moving


def _constrain(tree: Any, leaves: list[Any], treedef: Any, target: Target, s: Sharding):
    if not isinstance(target, (Sharding, Mesh)):
        raise PlacementError(
            f"`to_device(tree, {target!r})` inside a jax.jit trace: JAX ignores placing on "
            "a single device inside jit, so this would silently do nothing. Place the inputs "
            "before calling the jitted function, or pass a Sharding (e.g. "
            "NamedSharding(mesh, P())) to constrain the layout inside jit."
        )
    _check_fits(tree, leaves, range(len(leaves)), s, "tree")
    return jax.tree_util.tree_unflatten(treedef, jax.lax.with_sharding_constraint(leaves, s))


def copy_to(tree: Any, target: Target) -> Any:
    """Copy every leaf of ``tree`` to ``target`` into new buffers (d2l's ``copyto``).

    Unlike :func:`to_device`, nothing is reused: the result never shares a
    buffer with the input, even when a leaf already lives on ``target``.
    One batched ``jax.device_put`` does the copies.

    Args:
      tree: any pytree.
      target: a ``jax.Device``, a spec, a ``Sharding`` or a ``Mesh``.

    Returns:
      A new pytree of committed arrays on ``target``.

    Raises:
      Same as :func:`to_device`; inside ``jit`` it raises ``PlacementError``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> x = jaxdev.to_device(jnp.arange(3), "cpu:0")
      >>> y = jaxdev.copy_to(x, "cpu:0")
      >>> y is x, y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
      (False, False)
    """
    sharding = as_sharding(target)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if _plan_moves(tree, leaves, sharding) is None:  # validates every leaf in one pass
        raise PlacementError(
            "`copy_to` inside a jax.jit trace: buffers do not exist while tracing. "
            "Copy before or after the jitted call."
        )
    _check_fits(tree, leaves, range(len(leaves)), sharding, "tree")
    # On CPU, JAX aliases aligned numpy buffers even with may_alias=False
    # (measured on jax 0.10.2), so host leaves are copied first.
    leaves = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in leaves]
    # The fresh numpy copies may be aliased; device arrays must be copied.
    may_alias = [None if isinstance(x, np.ndarray) else False for x in leaves]
    copied = jax.device_put(leaves, _put_target(target, sharding), may_alias=may_alias)
    return jax.tree_util.tree_unflatten(treedef, unalias(leaves, copied))


def unalias(sources: Sequence[Any], outs: list[Any]) -> list[Any]:
    """Re-copy output shards that still share a buffer with their source.

    jax 0.10.2 keeps the source's buffer as one shard when a single-device
    array is put on a multi-device sharding, even with ``may_alias=False``;
    donating that copy would then delete the source.
    """
    for i, (src, out) in enumerate(zip(sources, outs)):
        if not is_jax_array(src) or len(out.sharding.device_set) == 1:
            continue
        mine = {_pointer(sh.data) for sh in src.addressable_shards}
        shards = [sh.data for sh in out.addressable_shards]
        if mine.isdisjoint(_pointer(a) for a in shards):
            continue
        fresh = [
            jax.device_put(a, a.sharding, may_alias=False) if _pointer(a) in mine else a
            for a in shards
        ]
        outs[i] = jax.make_array_from_single_device_arrays(out.shape, out.sharding, fresh)
    return outs


def _pointer(x: jax.Array) -> int | None:
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # some backends/layouts expose no pointer; then nothing aliases
        return None


def to_host(tree: Any) -> Any:
    """Fetch every leaf of ``tree`` to host numpy with one ``jax.device_get``.

    Args:
      tree: any pytree; host leaves pass through unchanged.

    Returns:
      The same structure with ``numpy.ndarray`` leaves (numbers stay numbers).

    Raises:
      DeletedArrayError: a leaf was deleted or donated.
      LeafTypeError: a leaf is not an array or number.
      PlacementError: called inside ``jit`` on traced values.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.to_host({"x": jnp.arange(3)})["x"].tolist()
      [0, 1, 2]
    """
    leaves, _ = jax.tree_util.tree_flatten(tree)
    check_concrete(leaves, "to_host")
    check_live(tree, leaves, "tree")
    check_host_leaves(tree, leaves, "tree")
    return jax.device_get(tree)


def device_of(x: Any) -> jax.Device | None:
    """Return the one device holding array ``x``; ``None`` for host values.

    Args:
      x: a ``jax.Array``, numpy array or Python number.

    Raises:
      PlacementError: ``x`` spans several devices (use :func:`devices_of`),
        or is a tracer (inside ``jit``).
      DeletedArrayError: ``x`` was deleted or donated.
      LeafTypeError: ``x`` is not an array or number.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.device_of(jaxdev.to_device(jnp.ones(2), "cpu:0")) == jaxdev.cpu(0)
      True
    """
    found = devices_of(x)
    if not found:
        return None
    if len(found) > 1:
        raise PlacementError(
            f"`x` spans {len(found)} devices [{format_devices(sorted(found, key=device_key))}] "
            f"(sharding {describe_sharding(x.sharding)}); use `devices_of(x)` for all of them."
        )
    return next(iter(found))


def devices_of(tree: Any) -> set[jax.Device]:
    """Return the set of devices holding any leaf of ``tree`` (host leaves add none).

    Raises:
      DeletedArrayError: a leaf was deleted or donated.
      LeafTypeError: a leaf is not an array or number.
      PlacementError: a leaf is a tracer (inside ``jit`` placement is not
        known yet; an empty set would mean "on the host").

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.devices_of({"a": jaxdev.to_device(jnp.ones(2), "cpu:0"), "b": 1.0})
      {CpuDevice(id=0)}
    """
    leaves, _ = jax.tree_util.tree_flatten(tree)
    check_concrete(leaves, "devices_of")
    check_live(tree, leaves, "tree")
    check_host_leaves(tree, leaves, "tree")
    out: set[jax.Device] = set()
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            out |= leaf.sharding.device_set
    return out


def common_device(tree: Any) -> jax.Device | None:
    """Return the one device every committed leaf of ``tree`` lives on.

    Call it before combining leaves in one computation: JAX refuses arrays
    committed to different devices with a message that names positional
    arguments, not leaves. Uncommitted and host leaves follow the others.

    Returns:
      The device, or ``None`` when no leaf is committed.

    Raises:
      PlacementError: leaves are committed to different devices or span
        several; every leaf is listed with its devices.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> t = jaxdev.to_device({"a": jnp.ones(2), "b": jnp.zeros(2)}, "cpu:0")
      >>> jaxdev.common_device(t) == jaxdev.cpu(0)
      True
    """
    leaves, _ = jax.tree_util.tree_flatten(tree)
    check_live(tree, leaves, "tree")
    check_host_leaves(tree, leaves, "tree")
    committed = [(i, x) for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.committed]
    sets = {frozenset(x.sharding.device_set) for _, x in committed}
    if not sets:
        return None
    if len(sets) == 1 and len(next(iter(sets))) == 1:
        return next(iter(next(iter(sets))))
    lines = [
        f"{path_of(tree, i)}: {format_devices(sorted(x.sharding.device_set, key=device_key))}"
        for i, x in committed
    ]
    raise PlacementError(
        join_failures(
            "`tree` has leaves committed to different devices, so they cannot be combined "
            "in one computation without a copy. Move them first with "
            "`jaxdev.to_device(tree, device)`. Leaves and their devices:",
            lines,
        )
    )
