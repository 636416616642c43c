"""Placement assertions over pytrees, in the style of chex's tree assertions.

Every assertion checks all leaves, then raises one
:class:`~jaxdev.PlacementAssertionError` (an ``AssertionError``) whose message
is a header line plus one line per failing leaf: its key path, what was found
and what was expected, followed by the fix and the available devices.

What they get right that chex 0.1.92 does not:

* they work on a CPU-only host without naming a platform;
* a fully replicated array is not "sharded", and a stacked (pmap-layout)
  array, one slice per device, is not "replicated";
* memory kind (``'device'`` vs ``'pinned_host'``) and committed-ness are
  checked; a jax array on the CPU device is not "on host";
* a deleted or donated leaf is listed as such instead of raising
  ``RuntimeError``; a tracer (inside ``jax.jit``) is listed with a clear note.

The success path never computes key paths or reads values (paths are built
only for failing leaves; values only with ``check_values=True``), so a
2000-leaf tree is checked in about a millisecond. Like every chex assertion,
they do nothing after ``chex.disable_asserts()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._devices import DeviceSpec, device, device_list
from ._errors import (
    PlacementAssertionError,
    PlacementError,
    available_devices,
    format_devices,
    join_failures,
    keystr,
)
from ._placement import _deleted, _describe_sharding

DevicesLike = Mesh | int | DeviceSpec | Sequence[DeviceSpec] | None
"""A ``Mesh``, a device count, a platform or spec, or a list of device specs."""

_Check = Callable[[Any], str | None]
_PY_SCALARS = (bool, int, float, complex)
_ARRAY_TYPES: set[type] = set()  # concrete jax.Array types seen (not tracers)
_DELETED = "deleted or donated"
_TRACER = "a tracer (inside jax.jit/vmap/grad)"
_NOTES = {
    _DELETED: (
        "Deleted or donated leaves had their buffers freed by `x.delete()` or by a jit with "
        "`donate_argnums`; use the arrays the donating call returned."
    ),
    _TRACER: (
        "Tracers have no placement while tracing: call the assertion on the concrete arrays, "
        "outside the jitted function."
    ),
}


# ---------------------------------------------------------------- leaf kinds


def _disabled() -> bool:
    """Whether ``chex.disable_asserts()`` switched assertions off."""
    return bool(getattr(chex._src.asserts_internal, "DISABLE_ASSERTIONS", False))


def _is_concrete(x: Any) -> bool:
    """Whether ``x`` is a concrete (not traced) ``jax.Array``; caches its type."""
    t = type(x)
    if t in _ARRAY_TYPES:
        return True
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        _ARRAY_TYPES.add(t)
        return True
    return False


def _is_host_value(x: Any) -> bool:
    """Whether ``x`` is a numeric numpy value or Python number (lives on host)."""
    if isinstance(x, _PY_SCALARS):
        return True
    if isinstance(x, (np.ndarray, np.generic)):
        dt = x.dtype
        ml = dt.kind == "V" and dt.names is None and dt.type.__module__.startswith("ml_dtypes")
        return dt.kind in "biufc" or ml
    return False


def _default_kind(s: Sharding) -> str | None:
    """Default memory kind of the devices ``s`` spans (``'device'`` on CPU/GPU)."""
    try:
        return next(iter(s.device_set)).default_memory().kind
    except Exception:  # backends without memories API
        return None


def _where(x: Any) -> str:
    """Describe where a leaf lives, for a failure line."""
    if isinstance(x, jax.core.Tracer):
        return _TRACER
    if isinstance(x, jax.Array):
        if _deleted(x):
            return _DELETED
        s = x.sharding
        out = _describe_sharding(s)
        if not isinstance(s, SingleDeviceSharding) and s.is_fully_replicated:
            out += f" (fully replicated on {len(s.device_set)} devices)"
        if s.memory_kind != _default_kind(s):
            out += f" in {s.memory_kind!r} memory"
        return out if x.committed else out + " (uncommitted)"
    if _is_host_value(x):
        what = f"numpy {x.dtype}{list(np.shape(x))}" if hasattr(x, "dtype") else type(x).__name__
        return f"host ({what})"
    t = type(x)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"a {name} (not an array)"


def _kind_note(x: jax.Array, kind: str | None) -> str:
    """`` in 'device' memory`` when ``x`` sits in another memory kind than ``kind``."""
    have = x.sharding.memory_kind
    return "" if kind is None or have == kind else f" in {kind!r} memory"


def _expected_str(s: Sharding, kind: str | None = None) -> str:
    out = _describe_sharding(s)
    kind = kind if kind is not None else s.memory_kind
    return out if kind in (None, _default_kind(s)) else f"{out} in {kind!r} memory"


# ---------------------------------------------------------------- the engine


def _scan(
    leaves: list[Any],
    fast: Callable[[Sharding], bool],
    check: _Check,
    committed: bool | None = None,
) -> list[tuple[int, str]]:
    """Return ``(index, why)`` for every failing leaf.

    ``fast(sharding)`` is a per-sharding verdict; ``True`` passes the leaf
    without further work. A sharding equal to the last one that passed
    passes too, which skips ``fast`` for the usual tree whose leaves share
    one placement. Otherwise ``check(leaf)`` returns the reason it fails, or
    ``None`` when a finer, per-leaf test (``is_equivalent_to`` for its rank)
    passes it.
    """
    bad = []
    ok_s = None  # the last sharding that passed
    for i, x in enumerate(leaves):
        if type(x) in _ARRAY_TYPES and not x.is_deleted():
            s = x.sharding
            passed = s is ok_s or (ok_s is not None and s == ok_s)
            if not passed and fast(s):
                passed, ok_s = True, s
            if passed and (committed is None or x.committed == committed):
                continue
        why = check(x)
        if why is None and committed is not None and _is_concrete(x) and x.committed != committed:
            state = "committed" if x.committed else "uncommitted"
            why = f"found {state} on {_describe_sharding(x.sharding)}, expected " + (
                "committed" if committed else "uncommitted"
            )
        if why is not None:
            bad.append((i, why))
    return bad


def _live_array_problem(x: Any, expected: str) -> str | None:
    """Reason ``x`` is not a live concrete array (found vs expected), else None."""
    if _is_concrete(x) and not _deleted(x):
        return None
    return f"found {_where(x)}, expected {expected}"


def _fail(
    name: str, tree: Any, arg: str, n: int, bad: list[tuple[int, str]], rule: str, fix: str
) -> None:
    """Raise PlacementAssertionError listing every failing leaf with its path."""
    if not bad:
        return
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    lines = [f"{paths[i]}: {why}" for i, why in bad]
    header = f"`{name}` failed: {len(bad)} of {n} leaves of `{arg}` {rule}:"
    raise PlacementAssertionError(_message(header, lines, fix))


def _message(header: str, lines: list[str], fix: str) -> str:
    """Header, one line per failing leaf, notes for deleted/traced leaves, fix, devices."""
    notes = [note for key, note in _NOTES.items() if any(key in line for line in lines)]
    return "\n".join([join_failures(header, lines), *notes, f"{fix} {available_devices()}"])


# ---------------------------------------------------------------- targets


def _target_sharding(target: Any, memory_kind: str | None) -> Sharding:
    """``target`` (Device, spec, Sharding) as a Sharding with the wanted memory kind."""
    s = target if isinstance(target, Sharding) else SingleDeviceSharding(device(target))
    if memory_kind is None:
        return s
    _check_memory_kind(s.device_set, memory_kind)
    return s.with_memory_kind(memory_kind)


def _check_memory_kind(devices: set, kind: str) -> None:
    d = next(iter(devices))
    kinds = [m.kind for m in d.addressable_memories()]
    if kind not in kinds:
        raise PlacementError(
            f"`memory_kind`={kind!r} does not exist on {d.platform}:{d.id}: it offers "
            f"{kinds}. {available_devices()}"
        )


def _equivalent(have: Sharding, want: Sharding, ndim: int) -> bool:
    if have == want:
        return True
    try:
        return have.is_equivalent_to(want, ndim)
    except Exception:  # JAX raises ValueError/IndexError for a spec longer than ndim
        return False


def _expected_devices(mesh_or_devices: DevicesLike) -> frozenset:
    if isinstance(mesh_or_devices, Mesh):
        return frozenset(mesh_or_devices.devices.flat)
    if mesh_or_devices is None:
        return frozenset(jax.devices())
    return frozenset(device_list(mesh_or_devices))


# ---------------------------------------------------------------- assertions


def assert_on_device(
    tree: chex.ArrayTree,
    device_or_sharding: DeviceSpec | Sharding | None = None,
    *,
    memory_kind: str | None = None,
    committed: bool | None = None,
) -> None:
    """Assert every leaf of ``tree`` is a live ``jax.Array`` on the given device(s).

    Unlike ``chex.assert_tree_is_on_device``, no platform needs naming: with
    ``device_or_sharding=None`` a leaf passes when it lives on devices of the
    default backend (``jax.default_backend()``: the GPU/TPU when there is
    one, else the CPU), so the same test works on a laptop and on a GPU host.
    Host values (numpy, Python numbers) fail, as do leaves in host memory
    kinds unless ``memory_kind`` asks for them. ``None`` leaves are empty
    subtrees.

    Args:
      tree: any pytree (Flax params, NNX state, optax state, a batch).
      device_or_sharding: ``None`` (any device of the default backend), a
        ``jax.Device``, a spec such as ``'cpu:0'`` or ``'gpu:1'``, or a
        ``Sharding`` (compared with ``is_equivalent_to``, so an equivalent
        spec passes).
      memory_kind: required memory kind; ``None`` means the target's (by
        default the device's own memory, ``'device'``).
      committed: if not ``None``, also require ``x.committed == committed``.

    Raises:
      PlacementAssertionError: listing every leaf elsewhere, on the host,
        in another memory kind, deleted/donated, traced, or not an array.
      PlacementError: ``memory_kind`` does not exist on the target device.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones(2), "b": jnp.zeros(2)}, "cpu:0")
      >>> jaxdev.assert_on_device(params)
      >>> jaxdev.assert_on_device(params, "cpu:0", committed=True)
      >>> try:
      ...     jaxdev.assert_on_device({"w": params["w"], "n": 1.0})
      ... except AssertionError as e:
      ...     print(str(e).splitlines()[1])
        ['n']: found host (float), expected a jax.Array on cpu devices
    """
    if _disabled():
        return
    leaves = jax.tree_util.tree_leaves(tree)
    if device_or_sharding is None:
        platform = jax.default_backend()
        kinds: dict[int, str | None] = {}

        def fast(s: Sharding) -> bool:
            if any(d.platform != platform for d in s.device_set):
                return False
            key = id(next(iter(s.device_set)))
            if key not in kinds:
                kinds[key] = memory_kind or _default_kind(s)
            return s.memory_kind == kinds[key]

        expected = f"a jax.Array on {platform} devices"
        rule = f"are not on {platform} devices in " + (
            f"{memory_kind!r} memory" if memory_kind else "their default memory"
        )

        def check(x: Any) -> str | None:
            problem = _live_array_problem(x, expected)
            if problem is not None or fast(x.sharding):
                return problem
            kind = kinds.get(id(next(iter(x.sharding.device_set))))
            return f"found {_where(x)}, expected {expected}" + _kind_note(x, kind)

        fix = f"Fix: `tree = jaxdev.to_device(tree, {platform!r})`."
    else:
        want = _target_sharding(device_or_sharding, memory_kind)
        expected = _expected_str(want)
        rule = f"are not on {expected}"

        def fast(s: Sharding) -> bool:
            return s is want or s == want

        def check(x: Any) -> str | None:
            problem = _live_array_problem(x, expected)
            if problem is not None or _equivalent(x.sharding, want, x.ndim):
                return problem
            note = "" if " memory" in expected else _kind_note(x, want.memory_kind)
            return f"found {_where(x)}, expected {expected}{note}"

        fix = "Fix: `tree = jaxdev.to_device(tree, target)` with the expected target."
    bad = _scan(leaves, fast, check, committed)
    _fail("assert_on_device", tree, "tree", len(leaves), bad, rule, fix)


def assert_on_host(tree: chex.ArrayTree) -> None:
    """Assert every leaf of ``tree`` lives in host memory.

    A leaf passes when it is a numeric numpy array or scalar, a Python
    number, or a ``jax.Array`` in a host memory kind (``'pinned_host'``,
    ``'unpinned_host'``). A ``jax.Array`` on the CPU *device* fails, unlike
    ``chex.assert_tree_is_on_host``: a forgotten ``device_get`` is then
    caught by tests on a CPU-only machine too.

    Args:
      tree: any pytree; ``None`` leaves are empty subtrees.

    Raises:
      PlacementAssertionError: listing every leaf on a device, deleted or
        donated, traced, or not a numeric array (str, object dtype, ...).

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.assert_on_host(jaxdev.to_host({"loss": jnp.float32(0.5), "step": 3}))
      >>> try:
      ...     jaxdev.assert_on_host({"loss": jnp.ones(2)})
      ... except AssertionError as e:
      ...     print(str(e).splitlines()[1])
        ['loss']: found cpu:0 (uncommitted), expected host memory
    """
    if _disabled():
        return
    leaves = jax.tree_util.tree_leaves(tree)
    expected = "host memory"
    bad = []
    for i, x in enumerate(leaves):
        if _is_host_value(x):
            continue
        if _is_concrete(x) and not _deleted(x) and x.sharding.memory_kind in _HOST_KINDS:
            continue
        bad.append((i, f"found {_where(x)}, expected {expected}"))
    fix = "Fix: `tree = jaxdev.to_host(tree)` (one `jax.device_get`)."
    rule = (
        "are not in host memory (numpy, a Python number, or a jax.Array in "
        "'pinned_host'/'unpinned_host' memory)"
    )
    _fail("assert_on_host", tree, "tree", len(leaves), bad, rule, fix)


_HOST_KINDS = ("pinned_host", "unpinned_host")


def assert_replicated(
    tree: chex.ArrayTree,
    mesh_or_devices: DevicesLike = None,
    *,
    check_values: bool = False,
    memory_kind: str | None = None,
) -> None:
    """Assert every leaf of ``tree`` is fully replicated over the given devices.

    True replication: each device holds the whole array
    (``sharding.is_fully_replicated``, e.g. ``NamedSharding(mesh, P())``) and
    the array spans exactly those devices. A stacked (pmap-layout) array,
    whose leading axis has one different slice per device, fails; so does a
    sharded one. With ``check_values=True`` every replica must also be
    bitwise identical to the first (drift detection; NaN payloads and -0.0
    compare by bits); this reads every replica, so it costs a transfer per
    shard. Only this process's addressable replicas are compared.

    Args:
      tree: any pytree.
      mesh_or_devices: a ``Mesh``, a device count ``n`` (the first ``n``
        local devices), a platform name, a list of device specs, or ``None``
        for every device (``jax.devices()``).
      check_values: also require identical replicas.
      memory_kind: required memory kind; ``None`` means the devices' own.

    Raises:
      PlacementAssertionError: listing every leaf that is sharded or
        stacked, on other devices, on the host, deleted/donated, traced,
        or (``check_values``) whose replicas differ, naming which.
      DeviceSpecError, DeviceNotFoundError: ``mesh_or_devices`` is invalid.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> params = jax.device_put({"w": jnp.ones(4)}, NamedSharding(mesh, P()))
      >>> jaxdev.assert_replicated(params, mesh, check_values=True)
    """
    if _disabled():
        return
    devices = _expected_devices(mesh_or_devices)
    if memory_kind is not None:
        _check_memory_kind(devices, memory_kind)
    kind = memory_kind or next(iter(devices)).default_memory().kind
    listed = format_devices(sorted(devices, key=_dev_key))
    expected = f"fully replicated on {len(devices)} device(s)" + (
        f" in {kind!r} memory" if memory_kind else ""
    )

    def fast(s: Sharding) -> bool:
        return s.is_fully_replicated and s.memory_kind == kind and s.device_set == devices

    def check(x: Any) -> str | None:
        problem = _live_array_problem(x, expected)
        if problem is not None or fast(x.sharding):
            return problem
        return f"found {_where(x)}{_stacked_note(x)}, expected {expected}"

    leaves = jax.tree_util.tree_leaves(tree)
    bad = _scan(leaves, fast, check)
    if check_values:
        failed = {i for i, _ in bad}
        bad = sorted(bad + _replica_drift(leaves, skip=failed))
    fix = (
        "Fix: replicate with `jax.device_put(tree, NamedSharding(mesh, P()))`; for a stacked "
        "(pmap) tree take one copy first (`jax.tree.map(lambda x: x[0], tree)`)."
    )
    rule = f"are not replicated on [{listed}]" + (
        " with bitwise identical replicas" if check_values else ""
    )
    _fail("assert_replicated", tree, "tree", len(leaves), bad, rule, fix)


def _dev_key(d: jax.Device) -> tuple[str, int]:
    return (d.platform, d.id)


def _stacked_note(x: jax.Array) -> str:
    s = x.sharding
    n = len(s.device_set)
    if x.ndim and x.shape[0] == n and n > 1 and not s.is_fully_replicated:
        return (
            f": a stacked (pmap-layout) array, leading axis {n} = one different slice per "
            "device, not one replicated copy"
        )
    return ""


def _replica_drift(leaves: list[Any], skip: set[int]) -> list[tuple[int, str]]:
    """``(index, why)`` for every leaf (not in ``skip``) whose replicas differ bitwise."""
    idx = [i for i, x in enumerate(leaves) if i not in skip]
    shards = [leaves[i].addressable_shards for i in idx]
    host = jax.device_get([[sh.data for sh in ss] for ss in shards])
    bad = []
    for i, ss, copies in zip(idx, shards, host):
        ref = copies[0].tobytes()
        diff = [sh.device for sh, c in zip(ss, copies) if c.tobytes() != ref]
        if diff:
            bad.append((i, _drift_line(ss[0].device, diff, copies, ss)))
    return bad


def _drift_line(ref: jax.Device, diff: list, copies: list[np.ndarray], shards: list) -> str:
    devs = [sh.device for sh in shards]
    other = copies[devs.index(diff[0])]
    n_el = int(np.sum(np.any(_bytes(other) != _bytes(copies[0]), axis=1)))
    return (
        f"replicas differ: {format_devices(diff)} differ bitwise from {ref.platform}:{ref.id} "
        f"({n_el} of {other.size} elements differ on {diff[0].platform}:{diff[0].id}), "
        "expected identical replicas"
    )


def _bytes(a: np.ndarray) -> np.ndarray:
    """Each element's raw bytes as one row, for an element-wise bitwise compare."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1)


def assert_sharded(
    tree: chex.ArrayTree,
    sharding_or_spec: Sharding | PartitionSpec,
    mesh: Mesh | None = None,
    *,
    memory_kind: str | None = None,
) -> None:
    """Assert every leaf of ``tree`` is laid out as ``sharding_or_spec``.

    Layouts are compared with ``Sharding.is_equivalent_to`` for each leaf's
    rank, so ``P('data')`` and ``P('data', None)`` on the same mesh match,
    while a fully replicated array (``P()``) does *not* pass for
    ``P('data')`` on a mesh with more than one device along ``'data'``
    (``chex.assert_tree_is_sharded`` accepts any multi-device array).

    Args:
      tree: any pytree.
      sharding_or_spec: a ``Sharding``, or a ``PartitionSpec``. A spec is
        taken on ``mesh`` when given, otherwise on each leaf's own mesh
        (the leaf must then carry a ``NamedSharding``).
      mesh: the ``Mesh`` for a spec; ignored for a ``Sharding``.
      memory_kind: required memory kind; ``None`` means the sharding's
        (by default the devices' own memory).

    Raises:
      PlacementAssertionError: listing every leaf laid out otherwise
        (found vs expected), on the host, deleted/donated or traced.
      PlacementError: ``sharding_or_spec`` is neither a ``Sharding`` nor a
        ``PartitionSpec``, names axes ``mesh`` lacks, or ``memory_kind``
        does not exist.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> batch = jax.device_put({"x": jnp.ones((8, 3))}, NamedSharding(mesh, P("data")))
      >>> jaxdev.assert_sharded(batch, P("data"))
      >>> jaxdev.assert_sharded(batch, P("data", None), mesh)
    """
    if _disabled():
        return
    if isinstance(sharding_or_spec, Sharding):
        want = _target_sharding(sharding_or_spec, memory_kind)
    elif isinstance(sharding_or_spec, PartitionSpec):
        want = None if mesh is None else _named(mesh, sharding_or_spec, memory_kind)
    else:
        raise PlacementError(
            f"`sharding_or_spec` must be a jax.sharding.Sharding or a PartitionSpec, got "
            f"{type(sharding_or_spec).__name__} {sharding_or_spec!r}. For a single device "
            "use `assert_on_device`."
        )
    if want is None:
        fast, check, expected = _spec_checks(sharding_or_spec, memory_kind)
    else:
        expected = _expected_str(want)

        def fast(s: Sharding) -> bool:
            return s is want or s == want

        def check(x: Any) -> str | None:
            return _live_array_problem(x, expected) or (
                None
                if _equivalent(x.sharding, want, x.ndim)
                else f"found {_where(x)}, expected {expected}"
            )

    leaves = jax.tree_util.tree_leaves(tree)
    bad = _scan(leaves, fast, check)
    fix = "Fix: `tree = jaxdev.to_device(tree, NamedSharding(mesh, spec))`."
    _fail("assert_sharded", tree, "tree", len(leaves), bad, f"are not sharded as {expected}", fix)


def _named(mesh: Mesh, spec: PartitionSpec, memory_kind: str | None) -> NamedSharding:
    try:
        s = NamedSharding(mesh, spec)
    except Exception as err:  # JAX: ValueError naming the unknown axis
        raise PlacementError(
            f"`sharding_or_spec`={spec} does not fit `mesh` with axes {dict(mesh.shape)}: {err}"
        ) from None
    return _target_sharding(s, memory_kind)


def _spec_checks(spec: PartitionSpec, memory_kind: str | None):
    """``fast``/``check``/description for a spec taken on each leaf's own mesh."""
    expected = f"{spec} on the leaf's mesh" + (f" in {memory_kind!r} memory" if memory_kind else "")

    def kind_ok(s: Sharding) -> bool:
        return s.memory_kind == (memory_kind or _default_kind(s))

    def fast(s: Sharding) -> bool:
        return isinstance(s, NamedSharding) and s.spec == spec and kind_ok(s)

    def check(x: Any) -> str | None:
        problem = _live_array_problem(x, expected)
        if problem is not None:
            return problem
        s = x.sharding
        if isinstance(s, NamedSharding) and kind_ok(s):
            try:
                want = NamedSharding(s.mesh, spec, memory_kind=s.memory_kind)
            except Exception as err:
                return f"found {_where(x)}, expected {expected}, but {err}"
            if _equivalent(s, want, x.ndim):
                return None
        return f"found {_where(x)}, expected {expected}"

    return fast, check, expected


def assert_committed(tree: chex.ArrayTree, committed: bool = True) -> None:
    """Assert every leaf of ``tree`` is a ``jax.Array`` committed (or not) to its devices.

    A committed array was placed explicitly (``jax.device_put`` to a device
    or sharding, ``jaxdev.to_device``); JAX keeps computations on it where it
    is and refuses to mix it with arrays committed elsewhere. An uncommitted
    one (``jnp.ones(3)``) may be moved silently. Host values fail: they are
    neither.

    Args:
      tree: any pytree.
      committed: the expected committed-ness.

    Raises:
      PlacementAssertionError: listing every leaf with the other
        committed-ness, on the host, deleted/donated or traced.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.assert_committed(jaxdev.to_device({"w": jnp.ones(2)}, "cpu:0"))
      >>> jaxdev.assert_committed({"w": jnp.ones(2)}, committed=False)
    """
    if _disabled():
        return
    leaves = jax.tree_util.tree_leaves(tree)
    want = "committed to a device" if committed else "uncommitted"
    bad = []
    for i, x in enumerate(leaves):
        if type(x) in _ARRAY_TYPES and not x.is_deleted() and x.committed == committed:
            continue
        problem = _live_array_problem(x, f"a jax.Array {want}")
        if problem is None and x.committed == committed:
            continue
        if problem is None:
            state = "committed" if x.committed else "uncommitted"
            problem = f"found {state} on {_describe_sharding(x.sharding)}, expected {want}"
        bad.append((i, problem))
    fix = (
        "Fix: `tree = jaxdev.to_device(tree, device)` commits every leaf."
        if committed
        else "Fix: create the leaves without a device (e.g. `jnp.asarray`) to leave them "
        "uncommitted."
    )
    _fail("assert_committed", tree, "tree", len(leaves), bad, f"are not {want}", fix)


def assert_same_placement(a: chex.ArrayTree, b: chex.ArrayTree) -> None:
    """Assert two trees' matching leaves are placed alike.

    Leaves are matched by key path. A pair matches when both are host
    values, or both are live ``jax.Array`` with equivalent shardings (same
    devices, layout and memory kind) and the same committed-ness. Leaves
    present in only one tree are listed too. Typical use: params and their
    gradients or optimizer state must live together.

    Args:
      a: a pytree.
      b: a pytree with the same key paths.

    Raises:
      PlacementAssertionError: listing every leaf placed differently (both
        placements shown), missing from one tree, deleted/donated or traced.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones(2)}, "cpu:0")
      >>> jaxdev.assert_same_placement(params, jax.tree.map(jnp.zeros_like, params))
    """
    if _disabled():
        return
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    fix = "Fix: `b = jaxdev.to_device(b, a_sharding)` (or move `a`) so both live together."
    if ta == tb:
        bad = [
            (i, why)
            for i, (x, y) in enumerate(zip(la, lb))
            if not _same_fast(x, y) and (why := _pair_problem(x, y)) is not None
        ]
        _fail("assert_same_placement", a, "a` and `b", len(la), bad, "are placed differently", fix)
        return
    pa = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(a)[0]}
    pb = {keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(b)[0]}
    lines = [
        f"{p}: only in `{'a' if p in pa else 'b'}`" for p in [*pa, *pb] if (p in pa) != (p in pb)
    ]
    lines += [
        f"{p}: {why}"
        for p, x in pa.items()
        if p in pb and (why := _pair_problem(x, pb[p])) is not None
    ]
    if lines:
        header = (
            f"`assert_same_placement` failed: {len(lines)} leaves of `a` ({len(pa)} leaves) "
            f"and `b` ({len(pb)} leaves) differ in key path or placement:"
        )
        raise PlacementAssertionError(_message(header, lines, fix))


def _same_fast(x: Any, y: Any) -> bool:
    """Whether two live arrays of known types share one placement (cheap test)."""
    if type(x) in _ARRAY_TYPES and type(y) in _ARRAY_TYPES:
        if x.is_deleted() or y.is_deleted() or x.committed != y.committed:
            return False
        sx, sy = x.sharding, y.sharding
        return sx is sy or sx == sy
    return False


def _pair_problem(x: Any, y: Any) -> str | None:
    """Why leaves ``x`` and ``y`` are placed differently, or None."""
    if _is_concrete(x) and _is_concrete(y):
        if not (_deleted(x) or _deleted(y)) and x.committed == y.committed:
            sx, sy = x.sharding, y.sharding
            if x.ndim == y.ndim and _equivalent(sx, sy, x.ndim):
                return None
    elif _is_host_value(x) and _is_host_value(y):
        return None
    return f"`a` {_where(x)}, `b` {_where(y)}"
