"""Move, copy and fetch pytrees; find the devices they live on.

Leaf policy: ``jax.Array``, numpy values and Python numbers are placed; ``None`` passes
through; anything else raises :class:`LeafTypeError` naming its key path. ``target`` is
a ``jax.Device``, a spec (``'gpu:1'``, an int), a ``Sharding``, or a ``Mesh`` (a full
copy on each device); :func:`as_sharding` is the one reader.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding

from ._devices import DeviceSpec, resolve_device
from ._errors import LeafTypeError, PlacementError, ShardingError, available_devices, format_devices
from ._leaves import (
    array_type,
    check_host_leaves,
    check_live,
    checked_leaves,
    deleted,
    describe_sharding,
    device_key,
    host_problem,
    is_host_value,
    is_jax_array,
    is_placed,
    is_tracer,
    key_strings,
    keystr,
    raise_leaf,
    same_layout,
    sharding_key,
    x64,
)
from ._mesh import outside_mesh, replicated_sharding
from ._pending import explained_reads

Target = DeviceSpec | Sharding | Mesh
"""Where to place: a ``jax.Device``, a spec (``'gpu:1'``, ``3``), a ``Sharding`` or a ``Mesh``."""


def _one_target(target: Any) -> bool:
    """A single target (device, spec, sharding, mesh), not a tree of shardings."""
    return target is None or isinstance(target, (jax.Device, int, str, Sharding, Mesh))


def as_sharding(target: Target) -> Sharding:
    """Return ``target`` (a ``Sharding``, a ``Mesh``: replicated, or one device) as a ``Sharding``.

    Raises:
      DeviceSpecError, DeviceNotFoundError: ``target`` names no device here.

    Example:
      >>> import jaxdev
      >>> jaxdev.as_sharding("cpu:0").device_set == {jaxdev.d2l.cpu(0)}
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
    """Raise ShardingError naming leaves whose shape ``s`` cannot split, or any leaf when
    ``s`` is unreduced (:func:`refuse_unreduced`)."""
    if isinstance(s, SingleDeviceSharding):
        return
    if idx:
        refuse_unreduced(s, arg, leaves[idx[0]], lambda: key_strings(tree)[idx[0]])
    for i in idx:
        shape = np.shape(leaves[i])
        try:
            s.shard_shape(shape)
        except Exception as err:  # JAX raises ValueError / IndexError / AssertionError
            raise ShardingError(
                f"`{arg}` leaf {key_strings(tree)[i]} with shape {shape} cannot be placed on "
                f"{describe_sharding(s)}: {err}. Pad the leaf or choose a spec that "
                f"divides its shape. {available_devices()}"
            ) from None


def refuse_unreduced(s: Any, arg: str, x: Any, name: Callable[[], str]) -> None:
    """Raise ShardingError when ``s`` is unreduced: an array unreduced over mesh axes is the
    sum of its copies, so a value placed (or restored) so would count once per copy; jax 0.12
    refuses it raw, 0.10.2 placed it wrongly. ``x``: the leaf (shape, dtype); ``name()``: its
    key path."""
    if unreduced := getattr(getattr(s, "spec", None), "unreduced", None):
        live = is_jax_array(x) and not is_tracer(x)  # a tracer has no sharding to show
        now = f", now on {describe_sharding(x.sharding)}" if live else ""
        raise ShardingError(
            f"`{arg}` leaf {name()} (shape {np.shape(x)}, dtype "
            f"{getattr(x, 'dtype', type(x).__name__)}{now}) cannot be placed on "
            f"{describe_sharding(s)}: an array unreduced over {sorted(unreduced)} is the sum of "
            "its copies there, so a placed value would count once per copy. Drop `unreduced` "
            "from the spec or rule that places it (unreduced values arise inside a step)."
        )


def refuse_unreduced_leaves(shardings: Any, leaves: Sequence[Any], arg: str) -> None:
    """:func:`refuse_unreduced` for each sharding of the tree ``shardings`` and its leaf."""
    for (path, s), x in zip(jax.tree_util.tree_flatten_with_path(shardings)[0], leaves):
        refuse_unreduced(s, arg, x, lambda p=path: keystr(p))


def _all_placed(leaves: Sequence[Any], s: Sharding) -> bool:
    """One cheap pass (no runtime, no key paths): is every leaf live, committed, on ``s``?"""
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


_ALIGN = 64  # bytes: JAX's CPU client uses a host buffer in place when aligned like this
_SMALL = 1 << 16  # bytes: host leaves smaller than this are copied into shared blocks
_BLOCK = 1 << 20  # bytes: the most one shared block holds (what one kept leaf keeps alive)


def detach_host(tree: Any) -> Any:
    """Replace every host array of ``tree`` that could still change by a private copy.

    Placing a numpy array may read it after the call returns (CPU uses aligned
    buffers in place, GPU transfers late), so a loader refilling one buffer would
    change batches handed over. A numpy array is copied when it (or what it views)
    is writeable or over writeable memory; the copies are read-only and 64-byte
    aligned, so CPU uses them in place. Returns ``tree`` itself when nothing needed it.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    todo = [i for i, x in enumerate(leaves) if _must_copy(x)]
    if not todo:
        return tree
    out = list(leaves)
    small = [i for i in todo if leaves[i].nbytes < _SMALL]
    for i in sorted(set(todo) - set(small)):
        out[i] = aligned_copy(leaves[i], 0)
    sizes = [-(-leaves[i].nbytes // _ALIGN) * _ALIGN for i in small]
    left, block, at = sum(sizes), _aligned_empty(0), 0  # small leaves share blocks: ~4 us a
    for i, size in zip(small, sizes):  # leaf, not 12; a kept leaf keeps its block alive, so
        if at + size > block.size:  # a block holds at most _BLOCK bytes
            block.base.flags.writeable = False
            block, at = _aligned_empty(min(left, _BLOCK)), 0
        x, left = leaves[i], left - size
        out[i] = block[at : at + x.nbytes].view(x.dtype).reshape(x.shape)
        np.copyto(out[i], x, casting="no")
        out[i].flags.writeable, at = False, at + size
    block.base.flags.writeable = False
    return jax.tree_util.tree_unflatten(treedef, out)


def detached(x: Any) -> Any:
    """``x``, or a private read-only copy when ``x`` is host memory that may change."""
    return aligned_copy(x, 0) if _must_copy(x) else x


def _must_copy(x: Any) -> bool:
    """A numeric numpy array that may change (others: left to the placement checks)."""
    return isinstance(x, np.ndarray) and is_host_value(x) and _may_change(x)


def _may_change(x: Any) -> bool:
    """Whether someone may still write the memory of ``x``: no only for a read-only numpy
    owner (frozen with ``flags.writeable = False``) or ``bytes``. A read-only view says nothing
    of its owner: a ``memoryview.toreadonly()`` of a bytearray, a ``mode='r'`` memmap of a
    file another handle writes."""
    if isinstance(x, np.ndarray):
        return x.flags.writeable or (x.base is not None and _may_change(x.base))
    if isinstance(x, memoryview):
        return _may_change(x.obj)
    return not isinstance(x, bytes)


def aligned_copy(x: np.ndarray, extra: int) -> np.ndarray:
    """A read-only C-order copy of ``x`` starting on an ``_ALIGN`` boundary, with ``extra``
    copies of its last row appended."""
    shape = (x.shape[0] + extra, *x.shape[1:]) if extra else x.shape
    out = _aligned_empty(math.prod(shape) * x.dtype.itemsize).view(x.dtype).reshape(shape)
    np.copyto(out[: x.shape[0]] if extra else out, x, casting="no")
    if extra:
        out[x.shape[0] :] = x[-1:]
    out.base.flags.writeable = False
    out.flags.writeable = False
    return out


def _aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes starting on an ``_ALIGN`` boundary (a view of its owner)."""
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]


def to_device(tree: Any, target: Target) -> Any:
    """Place every leaf of ``tree`` on ``target``; already placed leaves stay as they are.

    d2l's ``as_in_ctx``, torch's ``.to``: a committed leaf already on ``target`` comes back
    as the same object, the others move in one batched ``jax.device_put``, and if nothing
    moves ``tree`` itself comes back. Values JAX would lose (truncated ints, floats
    overflowing to ``inf`` with x64 off) are refused. A numpy leaf that may still change
    is copied first (:func:`detach_host`): ``jax.device_put`` aliases it on CPU even with
    ``may_alias=False``, so a refilled buffer would change the placed array. Inside ``jit``
    a ``Sharding`` becomes a sharding constraint and a device raises (JAX ignores it).

    Args:
      tree: any pytree.
      target: see the module; or a tree of ``Sharding`` s matching ``tree`` (or a prefix).

    Raises:
      LeafTypeError: a leaf is not an array or number (its key path named).
      LeafValueError: a value would be truncated or overflow (x64 disabled).
      DeletedArrayError: a leaf was deleted or donated.
      ShardingError: a leaf's shape does not divide over ``target``.
      PlacementError: a device target inside ``jit``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones((2, 2))}, "cpu:0")
      >>> jaxdev.to_device(params, "cpu:0") is params
      True
      >>> mesh = jaxdev.data_mesh()
      >>> split = jaxdev.to_device({"w": jnp.ones((8, 2))}, {"w": jaxdev.batch_sharding(mesh)})
      >>> split["w"].sharding.spec, jaxdev.to_device(split, {"w": split["w"].sharding}) is split
      (P('data',), True)
    """
    if not _one_target(target):
        return place_tree(tree, target, copy=False)
    sharding = as_sharding(target)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if _all_placed(leaves, sharding):
        return tree
    moving = _plan_moves(tree, leaves, sharding)
    if moving is None:  # inside a trace: a sharding constraint; a device, refused
        if not isinstance(target, (Sharding, Mesh)):
            raise PlacementError(
                f"`to_device(tree, {target!r})` inside a jax.jit trace: JAX ignores placing on "
                "a single device inside jit, so this would silently do nothing. Place the inputs "
                "before calling the jitted function, or pass a Sharding (e.g. "
                "NamedSharding(mesh, P())) to constrain the layout inside jit."
            )
        _check_fits(tree, leaves, range(len(leaves)), sharding, "tree")
        return treedef.unflatten(jax.lax.with_sharding_constraint(leaves, sharding))
    if not moving:  # typed keys are not ArrayImpl: _all_placed's fast pass misses them
        return tree
    if not sharding.is_fully_addressable:  # several processes: global arrays, typed keys too
        return place_tree(tree, sharding, copy=False)
    _check_fits(tree, leaves, moving, sharding, "tree")
    sources = detach_host([leaves[i] for i in moving])  # a refilled buffer changes nothing
    with outside_mesh():  # a re-layout is a jitted program: never under a user's set_mesh
        moved = jax.device_put(sources, _put_target(target, sharding))
    out = list(leaves)
    for i, new in zip(moving, moved):
        out[i] = new
    return jax.tree_util.tree_unflatten(treedef, out)


def _put_target(target: Target, s: Sharding) -> Sharding | jax.Device:
    """What to hand ``jax.device_put``: the device itself when ``target`` named one (JAX's
    put of host arrays is faster given a device than its ``SingleDeviceSharding``)."""
    return s if isinstance(target, (Sharding, Mesh)) else next(iter(s.device_set))


_PLAIN_KINDS = frozenset("fcb")  # float, complex, bool numpy dtypes: only 64-bit ones to check


def _plan_moves(tree: Any, leaves: Sequence[Any], s: Sharding) -> list[int] | None:
    """The indexes that must move to ``s`` (None for a tracer); raises as check_live/host checks."""
    impl, want = array_type(), sharding_key(s)
    moving: list[int] = []
    dead: list[int] = []
    problem: tuple[int, tuple[type[Exception], str]] | None = None
    for i, x in enumerate(leaves):
        t = type(x)
        if t is impl:
            if x.is_deleted():
                dead.append(i)
            elif not (x.committed and sharding_key(x.sharding) == want) and not placed_on(x, s):
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
            elif not placed_on(x, s):
                moving.append(i)
            continue
        if problem is None and (found := host_problem(x)) is not None:
            problem = (i, found)
        moving.append(i)
    if dead:
        check_live(tree, leaves, "tree")
    if problem is not None:
        raise_leaf(tree, problem[0], "tree", *problem[1])
    return moving


def placed_on(x: Any, s: Sharding) -> bool:
    """Whether ``x`` is committed and laid out as ``s``, on ``s``'s own mesh when both name one:
    the mesh asked for wins over an equivalent one (a user's ``jax.set_mesh`` makes arrays)."""
    have = getattr(x, "sharding", None)
    if isinstance(have, NamedSharding) and isinstance(s, NamedSharding) and have.mesh != s.mesh:
        return False
    return is_placed(x, s)


def copy_to(tree: Any, target: Target) -> Any:
    """Copy every leaf of ``tree`` to ``target`` into new buffers (d2l's ``copyto``), batched.

    Raises:
      Same as :func:`to_device`; inside ``jit`` it raises ``PlacementError``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> x = jaxdev.to_device(jnp.arange(3), "cpu:0")
      >>> y = jaxdev.copy_to(x, "cpu:0")
      >>> y is x, y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
      (False, False)
    """
    if not _one_target(target):
        return place_tree(tree, target, copy=True)
    sharding = as_sharding(target)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if _plan_moves(tree, leaves, sharding) is None:  # validates every leaf in one pass
        raise PlacementError(
            "`copy_to` inside a jax.jit trace: buffers do not exist while tracing. "
            "Copy before or after the jitted call."
        )
    if not sharding.is_fully_addressable:  # several processes: global arrays, typed keys too
        return place_tree(tree, sharding, copy=True)
    _check_fits(tree, leaves, range(len(leaves)), sharding, "tree")
    # Host leaves copied first: on CPU, JAX aliases aligned numpy buffers even with
    # may_alias=False (jax 0.10.2); the fresh copies may be aliased, device arrays not.
    leaves = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in leaves]
    may_alias = [None if isinstance(x, np.ndarray) else False for x in leaves]
    with outside_mesh():  # a re-layout is a jitted program: never under a user's set_mesh
        copied = jax.device_put(leaves, _put_target(target, sharding), may_alias=may_alias)
        return jax.tree_util.tree_unflatten(treedef, unalias(leaves, copied))


def unalias(sources: Sequence[Any], outs: list[Any]) -> list[Any]:
    """Re-copy output shards that still share a buffer with their source (jax 0.10.2 keeps one)."""
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

    Raises:
      DeletedArrayError: a leaf was deleted or donated.
      LeafTypeError: a leaf is not an array or number.
      PlacementError: called inside ``jit`` on traced values.
      OutOfMemoryError: the jaxdev step that made a leaf ran out of device memory, explained.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.to_host({"x": jnp.arange(3)})["x"].tolist()
      [0, 1, 2]
    """
    checked_leaves(tree, "tree", "to_host")
    with explained_reads("to_host"):  # a step's out-of-memory, named
        return jax.device_get(tree)


def device_of(x: Any) -> jax.Device | None:
    """Return the one device holding array ``x``; ``None`` for host values.

    Raises:
      PlacementError: ``x`` spans several devices (use :func:`devices_of`) or is a tracer.
      DeletedArrayError: ``x`` was deleted or donated.
      LeafTypeError: ``x`` is not an array or number.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.device_of(jaxdev.to_device(jnp.ones(2), "cpu:0")) == jaxdev.d2l.cpu(0)
      True
    """
    found = devices_of(x)
    if len(found) > 1:
        raise PlacementError(
            f"`x` spans {len(found)} devices [{format_devices(sorted(found, key=device_key))}] "
            f"(sharding {describe_sharding(x.sharding)}); use `devices_of(x)` for all of them."
        )
    return next(iter(found), None)  # None: a host value


def devices_of(tree: Any) -> set[jax.Device]:
    """Return the set of devices holding any leaf of ``tree`` (host leaves add none).

    Raises:
      DeletedArrayError: a leaf was deleted or donated.
      LeafTypeError: a leaf is not an array or number.
      PlacementError: a leaf is a tracer.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.devices_of({"a": jaxdev.to_device(jnp.ones(2), "cpu:0"), "b": 1.0})
      {CpuDevice(id=0)}
    """
    leaves, _ = checked_leaves(tree, "tree", "devices_of")
    return set().union(*(x.sharding.device_set for x in leaves if isinstance(x, jax.Array)))


# ---------------------------------------------------------------- trees of shardings


def place_tree(tree: Any, shardings: Any, *, copy: bool, arg: str = "tree") -> Any:
    """Place ``tree`` by a tree of ``shardings``: the one engine for per-leaf layouts.

    Without ``copy`` a leaf already laid out so (on that sharding's mesh) is kept and
    ``tree`` comes back when nothing moves; with ``copy`` every leaf gets new buffers.

    Raises:
      LeafTypeError, LeafValueError: a ShapeDtypeStruct leaf, or a host value JAX would
        truncate (its key path and ``arg`` named).
      DeletedArrayError: a leaf was deleted or donated.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> t = place_tree({"w": jnp.ones(8)}, {"w": jaxdev.batch_sharding(mesh)}, copy=False)
      >>> place_tree(t, {"w": t["w"].sharding}, copy=False) is t
      True
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    one = isinstance(shardings, Sharding)
    targets = [shardings] * len(leaves) if one else treedef.flatten_up_to(shardings)
    if not copy and any(is_tracer(x) for x in leaves):
        for i, s in enumerate(targets):  # named, not JAX's raw error inside the trace
            if isinstance(s, Sharding):
                _check_fits(tree, leaves, [i], s, arg)
        return treedef.unflatten(jax.lax.with_sharding_constraint(leaves, targets))
    check_live(tree, leaves, arg)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.ShapeDtypeStruct):
            raise LeafTypeError(
                f"`{arg}` leaf {key_strings(tree)[i]} is a ShapeDtypeStruct: there is nothing "
                "to place. Use `jaxdev.param_shardings` for shapes, or `jaxdev.init_sharded` "
                "to build the values directly in their shardings."
            )
    check_host_leaves(tree, leaves, arg)  # JAX would truncate int64 / overflow float64 silently
    moving = [i for i, (x, s) in enumerate(zip(leaves, targets)) if copy or not _on(x, s)]
    if not moving:
        return tree
    for i in moving:
        _check_fits(tree, leaves, [i], targets[i], arg)
    out, local = list(leaves), []  # local: on this process's devices, by put_leaves
    for i in moving:
        x, s = leaves[i], targets[i]
        if s.is_fully_addressable:
            local.append(i)
        elif is_jax_array(x) and not x.is_fully_addressable:
            with outside_mesh():  # a global array: on the devices
                out[i] = jax.jit(jnp.copy, out_shardings=s)(x)
        else:  # several processes: each builds its own shards
            out[i] = _from_host(x, s)
    placed = put_leaves([leaves[i] for i in local], [targets[i] for i in local], copy)
    for i, new in zip(local, placed):
        out[i] = new
    return treedef.unflatten(out)


def _from_host(x: Any, s: Sharding) -> jax.Array:
    """A global array on ``s`` from the value every process holds (a typed key: its data)."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        data = _from_host(jax.random.key_data(x), s)  # s lays out the key's leading axes
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    value = np.asarray(jax.device_get(x)) if is_jax_array(x) else detached(np.asarray(x))
    return jax.make_array_from_callback(value.shape, s, value.__getitem__)  # CPU: in place


def _on(x: Any, s: Sharding) -> bool:
    """Whether ``x`` is laid out as ``s`` on ``s``'s own mesh (one jitted step sees one mesh)."""
    return is_placed(x, s) and getattr(x.sharding, "mesh", None) == getattr(s, "mesh", None)


def put_leaves(leaves: list[Any], targets: list[Any], copy: bool = False) -> list[Any]:
    """``jax.device_put(leaves, targets)``, re-laying out multi-device arrays on the devices.

    ``jax.device_put`` re-lays such an array through the host (jax 0.10.2); a jitted
    identity with ``out_shardings`` does it on the devices. Host leaves are copied first:
    on CPU, JAX aliases aligned numpy buffers even with ``may_alias=False`` (jax 0.10.2).
    ``copy``: no output shares a buffer with its leaf.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> rep = jaxdev.replicate(jnp.ones(8), mesh)
      >>> put_leaves([rep], [jaxdev.batch_sharding(mesh)])[0].sharding.spec
      P('data',)
    """
    out: list[Any] = list(leaves)
    on_device = [
        i
        for i, (x, s) in enumerate(zip(leaves, targets))
        if is_jax_array(x)
        and len(x.sharding.device_set) > 1
        and _mesh_order(x.sharding) == _mesh_order(s) is not None  # jit takes no other order
        and x.sharding.memory_kind == s.memory_kind
        and not same_layout(x.sharding, s, x.ndim)
    ]
    if on_device:
        relayout = jax.jit(_identity, out_shardings=tuple(targets[i] for i in on_device))
        with outside_mesh():  # jaxdev's own program: never under a user's jax.set_mesh
            moved = relayout(*[leaves[i] for i in on_device])
        for i, new in zip(on_device, moved):
            out[i] = new
    rest = sorted(set(range(len(leaves))) - set(on_device))
    if rest:
        sources = [leaves[i] for i in rest]
        sources = [x if is_jax_array(x) else np.array(x, copy=True) for x in sources]
        may_alias = [None if isinstance(x, np.ndarray) else not copy for x in sources]
        with outside_mesh():  # a re-layout is a jitted program: never under a user's set_mesh
            placed = jax.device_put(sources, [targets[i] for i in rest], may_alias=may_alias)
            for i, new in zip(rest, unalias(sources, list(placed)) if copy else placed):
                out[i] = new
    return out


def _identity(*xs: Any) -> tuple[Any, ...]:
    return xs


def _mesh_order(s: Sharding) -> tuple[jax.Device, ...] | None:
    """The devices of ``s``'s mesh in its order (None: no mesh; ``jax.device_put`` moves it)."""
    mesh = getattr(s, "mesh", None)
    return tuple(mesh.devices.flat) if isinstance(mesh, Mesh) else None
