"""Placement assertions over pytrees, in the style of chex's tree assertions.

Each checks every leaf, then raises one :class:`~jaxdev.PlacementAssertionError` (an
``AssertionError``): a header plus one line per failing leaf (key path, found, expected),
the fix and the available devices. Unlike chex they work on a CPU-only host without a
platform, tell replicated from sharded from stacked, check memory kind and committed-ness,
and list deleted/donated leaves and tracers instead of raising. ``target`` is what
:func:`jaxdev.as_sharding` reads. Key paths are built only for failing leaves, so a
2000-leaf tree takes milliseconds. ``chex.disable_asserts()`` turns them off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._errors import (
    PlacementAssertionError,
    PlacementError,
    UsageError,
    available_devices,
    device_name,
    format_devices,
    join_failures,
)
from ._leaves import (
    array_type,
    asserts_disabled,
    deleted,
    describe_sharding,
    device_key,
    is_concrete,
    is_host_value,
    is_jax_array,
    is_tracer,
    key_strings,
    packed_bytes,
    replica_copies,
    replica_drift,
    same_layout,
    sharding_key,
)
from ._mesh import check_mesh, named_sharding
from ._placement import Target, as_sharding
from ._pmap_layout import is_stacked
from ._report import human_bytes

_DELETED = "deleted or donated"
_TRACER = "a tracer (inside jax.jit/vmap/grad)"
_NOTES = {
    _DELETED: "Deleted or donated leaves had their buffers freed by `x.delete()` or by a jit "
    "with `donate_argnums`; use the arrays the donating call returned.",
    _TRACER: "Tracers have no placement while tracing: call the assertion on the concrete "
    "arrays, outside the jitted function.",
}
HOST_KINDS = ("pinned_host", "unpinned_host")
"""Memory kinds in host memory (not counted on the devices)."""
_MAX_LISTED = 10  # leaves listed by assert_sharded_fraction


class _Checks(NamedTuple):
    """How one assertion judges leaves (see :func:`_scan`)."""

    fast: Callable[[Sharding], bool]  # per sharding: True passes the leaf, no more work
    check: Callable[[Any], str | None]  # per live array `fast` failed: why it fails, or None
    expected: str  # what a passing leaf is, for the failure lines


def _default_kind(s: Sharding) -> str | None:
    """Default memory kind of the devices ``s`` spans (``'device'`` on CPU/GPU)."""
    try:
        return next(iter(s.device_set)).default_memory().kind
    except Exception:  # backends without memories API
        return None


def _where(x: Any) -> str:
    """Describe where a leaf lives, for a failure line."""
    if is_tracer(x):
        return _TRACER
    if is_jax_array(x):
        if deleted(x):
            return _DELETED
        s = x.sharding
        out = describe_sharding(s)
        if not isinstance(s, SingleDeviceSharding) and s.is_fully_replicated:
            out += f" (fully replicated on {len(s.device_set)} devices)"
        out += _kind_note(s.memory_kind, _default_kind(s))
        return out if x.committed else out + " (uncommitted)"
    if is_host_value(x):
        what = f"numpy {x.dtype}{list(np.shape(x))}" if hasattr(x, "dtype") else type(x).__name__
        return f"host ({what})"
    t = type(x)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"a {name} (not an array)"


def _kind_note(kind: str | None, usual: str | None = None) -> str:
    """`` in 'pinned_host' memory`` for a ``kind`` that is not None and not ``usual``."""
    return "" if kind in (None, usual) else f" in {kind!r} memory"


def _live_array_problem(x: Any, expected: str) -> str | None:
    """Reason ``x`` is not a live concrete array (found vs expected), else None."""
    if is_concrete(x) and not deleted(x):
        return None
    return f"found {_where(x)}, expected {expected}"


def _scan(leaves: list[Any], checks: _Checks, committed: bool | None = None) -> list:
    """Return ``(index, why)`` for every failing leaf (a sharding that passed passes again)."""
    impl, fast, check = array_type(), checks.fast, checks.check
    bad = []
    ok_s = ok_key = None  # the last sharding that passed, and its sharding_key
    for i, x in enumerate(leaves):
        if type(x) is impl and not x.is_deleted():
            s = x.sharding
            passed = s is ok_s or (ok_s is not None and sharding_key(s) == ok_key)
            if not passed and fast(s):
                passed, ok_s, ok_key = True, s, sharding_key(s)
            if passed and (committed is None or x.committed == committed):
                continue
        why = _live_array_problem(x, checks.expected) or (None if fast(x.sharding) else check(x))
        if why is None and committed is not None and x.committed != committed:
            state = "committed" if x.committed else "uncommitted"
            why = f"found {state} on {describe_sharding(x.sharding)}, expected " + (
                "committed to a device" if committed else "uncommitted"
            )
        if why is not None:
            bad.append((i, why))
    return bad


def _fail(name: str, tree: Any, arg: str, n: int, bad: list, rule: str, fix: str) -> None:
    """Raise PlacementAssertionError listing every failing leaf with its path."""
    if not bad:
        return
    paths = key_strings(tree)
    lines = [f"{paths[i]}: {why}" for i, why in bad]
    header = f"`{name}` failed: {len(bad)} of {n} leaves of `{arg}` {rule}:"
    raise PlacementAssertionError(_message(header, lines, fix))


def _message(header: str, lines: list[str], fix: str) -> str:
    """Header, one line per failing leaf, notes for deleted/traced leaves, fix, devices."""
    notes = [note for key, note in _NOTES.items() if any(key in line for line in lines)]
    return "\n".join([join_failures(header, lines), *notes, f"{fix} {available_devices()}"])


def _check_memory_kind(devices: Any, kind: str | None) -> None:
    d = next(iter(devices))
    if kind is not None and kind not in (kinds := [m.kind for m in d.addressable_memories()]):
        raise PlacementError(
            f"`memory_kind`={kind!r} does not exist on {device_name(d)}: it offers "
            f"{kinds}. {available_devices()}"
        )


def _sharding_checks(want: Sharding, memory_kind: str | None) -> _Checks:
    """Checks for ``want`` in ``memory_kind``: equal passes fast, an equivalent one per leaf."""
    if memory_kind is not None:
        _check_memory_kind(want.device_set, memory_kind)
        want = want.with_memory_kind(memory_kind)
    expected = describe_sharding(want) + _kind_note(want.memory_kind, _default_kind(want))

    def check(x: Any) -> str | None:
        if same_layout(x.sharding, want, x.ndim):
            return None
        note = "" if " memory" in expected else _kind_note(want.memory_kind, x.sharding.memory_kind)
        return f"found {_where(x)}, expected {expected}{note}"

    return _Checks(lambda s: s is want or s == want, check, expected)


def _backend_checks(memory_kind: str | None) -> tuple[_Checks, str, str]:
    """Checks, rule, fix for ``target=None``: the default backend, ``memory_kind`` or default."""
    platform = jax.default_backend()
    _check_memory_kind(jax.devices(), memory_kind)
    kinds: dict[int, str | None] = {}  # id(first device) -> the memory kind wanted there
    expected = f"a jax.Array on {platform} devices"

    def fast(s: Sharding) -> bool:
        if any(d.platform != platform for d in s.device_set):
            return False
        key = id(next(iter(s.device_set)))
        if key not in kinds:
            kinds[key] = memory_kind or _default_kind(s)
        return s.memory_kind == kinds[key]

    def check(x: Any) -> str:
        kind = kinds.get(id(next(iter(x.sharding.device_set))))  # None: wrong platform
        return f"found {_where(x)}, expected {expected}" + _kind_note(kind, x.sharding.memory_kind)

    rule = f"are not on {platform} devices in " + (
        f"{memory_kind!r} memory" if memory_kind else "their default memory"
    )
    fix = f"Fix: `tree = jaxdev.to_device(tree, {platform!r})`."
    return _Checks(fast, check, expected), rule, fix


def assert_on_device(
    tree: chex.ArrayTree,
    target: Target | None = None,
    *,
    memory_kind: str | None = None,
    committed: bool | None = None,
) -> None:
    """Assert every leaf of ``tree`` is a live ``jax.Array`` on ``target``.

    Args:
      tree: any pytree; ``None`` leaves are empty subtrees.
      target: ``None`` (any device of the default backend: no platform to name), a
        ``jax.Device``, a spec (``'gpu:1'``, an int), a ``Sharding`` (compared with
        ``is_equivalent_to``) or a ``Mesh`` (a full copy on each of its devices).
      memory_kind: required memory kind; ``None``: the target's (``'device'``).
      committed: if not ``None``, also require ``x.committed == committed``.

    Raises:
      PlacementAssertionError: listing every leaf elsewhere, on the host, in another
        memory kind, deleted/donated, traced, or not an array.
      DeviceSpecError, DeviceNotFoundError: ``target`` names no device here.
      ShardingError: a ``Mesh`` target lists a device twice.
      PlacementError: ``memory_kind`` does not exist on the target device.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones(2), "b": jnp.zeros(2)}, "cpu:0")
      >>> jaxdev.assert_on_device(params)
      >>> jaxdev.assert_on_device(params, target="cpu:0", committed=True)
      >>> try:
      ...     jaxdev.assert_on_device({"w": params["w"], "n": 1.0})
      ... except AssertionError as e:
      ...     print(str(e).splitlines()[1])
        ['n']: found host (float), expected a jax.Array on cpu devices
    """
    if asserts_disabled():
        return
    if target is None:
        checks, rule, fix = _backend_checks(memory_kind)
    else:
        checks = _sharding_checks(as_sharding(target), memory_kind)
        rule = f"are not on {checks.expected}"
        fix = "Fix: `tree = jaxdev.to_device(tree, target)` with the expected target."
    leaves = jax.tree_util.tree_leaves(tree)
    bad = _scan(leaves, checks, committed)
    _fail("assert_on_device", tree, "tree", len(leaves), bad, rule, fix)


def assert_on_host(tree: chex.ArrayTree) -> None:
    """Assert every leaf of ``tree`` lives in host memory.

    numpy values, Python numbers and ``jax.Array`` in a host memory kind pass; a
    ``jax.Array`` on the CPU *device* fails (unlike chex), so a forgotten ``device_get``
    is caught on a CPU-only machine too.

    Raises:
      PlacementAssertionError: listing every leaf on a device, deleted or donated,
        traced, or not a numeric array.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.assert_on_host(jaxdev.to_host({"loss": jnp.float32(0.5), "step": 3}))
      >>> try:
      ...     jaxdev.assert_on_host({"loss": jnp.ones(2)})
      ... except AssertionError as e:
      ...     print(str(e).splitlines()[1])
        ['loss']: found cpu:0 (uncommitted), expected host memory
    """
    if asserts_disabled():
        return
    leaves = jax.tree_util.tree_leaves(tree)
    bad = [  # numpy, Python numbers, or live jax.Arrays in a host memory kind pass
        (i, f"found {_where(x)}, expected host memory")
        for i, x in enumerate(leaves)
        if not is_host_value(x)
        and not (is_concrete(x) and not deleted(x) and x.sharding.memory_kind in HOST_KINDS)
    ]
    fix = "Fix: `tree = jaxdev.to_host(tree)` (one `jax.device_get`)."
    rule = (
        "are not in host memory (numpy, a Python number, or a jax.Array in "
        "'pinned_host'/'unpinned_host' memory)"
    )
    _fail("assert_on_host", tree, "tree", len(leaves), bad, rule, fix)


def assert_replicated(
    tree: chex.ArrayTree,
    target: Target | None = None,
    *,
    check_values: bool = False,
    memory_kind: str | None = None,
) -> None:
    """Assert every leaf of ``tree`` is fully replicated over ``target``'s devices.

    Each device holds the whole array and the array spans exactly those devices; a
    stacked (pmap-layout) or sharded array fails. ``check_values=True`` also requires
    bitwise identical replicas (this process's), naming the copies that differ.

    Args:
      tree: any pytree.
      target: a ``Mesh``, a ``Sharding``, or one device; ``None``: ``jax.devices()``.
      check_values: also require bitwise identical replicas (a transfer per shard).
      memory_kind: required memory kind; ``None`` means the target's.

    Raises:
      PlacementAssertionError: listing every leaf sharded or stacked, elsewhere, on the
        host, deleted/donated, traced, or whose replicas differ.
      DeviceSpecError, DeviceNotFoundError: ``target`` names no device here.
      ShardingError: a ``Mesh`` target lists a device twice.
      PlacementError: ``memory_kind`` does not exist on the devices.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> params = jaxdev.to_device({"w": jnp.ones(4)}, mesh)
      >>> jaxdev.assert_replicated(params, mesh, check_values=True)
      >>> try:
      ...     jaxdev.assert_replicated(params, target="cpu:0")
      ... except AssertionError as e:
      ...     print(str(e).splitlines()[0])
      `assert_replicated` failed: 1 of 1 leaves of `tree` are not replicated on [cpu:0]:
    """
    if asserts_disabled():
        return
    checks, devices = _replica_checks(target, memory_kind)
    leaves = jax.tree_util.tree_leaves(tree)
    bad = _scan(leaves, checks)
    if check_values:  # the leaves that passed: are their replicas bitwise identical?
        passed = sorted(set(range(len(leaves))) - {i for i, _ in bad})
        for i, labels, values in replica_copies(leaves, passed):
            if (line := replica_drift(labels, values)) is not None:
                bad.append((i, f"replicas differ: {line}, expected identical replicas"))
        bad.sort()
    rule = f"are not replicated on [{format_devices(sorted(devices, key=device_key))}]"
    rule += " with bitwise identical replicas" if check_values else ""
    fix = (
        "Fix: replicate with `jaxdev.to_device(tree, mesh)` (a full copy on each device); for a "
        "stacked (pmap) tree take one copy first (`jaxdev.pmap.unstack_from_pmap(tree)`)."
    )
    _fail("assert_replicated", tree, "tree", len(leaves), bad, rule, fix)


def _replica_checks(target: Target | None, memory_kind: str | None) -> tuple[_Checks, frozenset]:
    """Checks for full copies on ``target``'s devices in one memory kind, and those devices."""
    s = None if target is None else as_sharding(target)
    devices = frozenset(jax.devices() if s is None else s.device_set)
    _check_memory_kind(devices, memory_kind)
    default = next(iter(devices)).default_memory().kind
    kind = memory_kind or (None if s is None else s.memory_kind) or default
    expected = f"fully replicated on {len(devices)} device(s)"
    expected += _kind_note(kind, None if memory_kind else default)  # named when asked for

    def fast(s: Sharding) -> bool:
        return s.is_fully_replicated and s.memory_kind == kind and s.device_set == devices

    def check(x: Any) -> str:
        note = ""
        if is_stacked(x):
            note = (
                f": a stacked (pmap-layout) array, leading axis {x.shape[0]} = one different "
                "slice per device, not one replicated copy"
            )
        return f"found {_where(x)}{note}, expected {expected}"

    return _Checks(fast, check, expected), devices


def assert_sharded(
    tree: chex.ArrayTree,
    target: Sharding | PartitionSpec,
    *,
    mesh: Mesh | None = None,
    memory_kind: str | None = None,
) -> None:
    """Assert every leaf of ``tree`` is laid out as ``target`` (``is_equivalent_to`` per rank).

    ``P('data')`` and ``P('data', None)`` match; a fully replicated array does not pass
    for ``P('data')`` (chex accepts any multi-device array).

    Args:
      tree: any pytree.
      target: a ``Sharding``, or a ``PartitionSpec`` on ``mesh`` (else on each leaf's own
        ``NamedSharding`` mesh).
      mesh: the ``Mesh`` for a spec; ignored for a ``Sharding``.
      memory_kind: required memory kind; ``None`` means the sharding's.

    Raises:
      PlacementAssertionError: listing every leaf laid out otherwise, on the host,
        deleted/donated or traced.
      PlacementError: a bad ``target``, axes ``mesh`` lacks, or an unknown ``memory_kind``.
      ShardingError: ``mesh`` is not a mesh of distinct devices.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(jax.devices(), ("data",))
      >>> batch = jax.device_put({"x": jnp.ones((8, 3))}, NamedSharding(mesh, P("data")))
      >>> jaxdev.assert_sharded(batch, P("data"))
      >>> jaxdev.assert_sharded(batch, P("data", None), mesh=mesh)
    """
    if asserts_disabled():
        return
    if not isinstance(target, (Sharding, PartitionSpec)):
        raise PlacementError(
            f"`target` must be a jax.sharding.Sharding or a PartitionSpec, got "
            f"{type(target).__name__} {target!r}. For a single device use `assert_on_device`; "
            "for a full copy on each device of a mesh use `assert_replicated`."
        )
    if isinstance(target, PartitionSpec) and mesh is not None:  # the spec on `mesh`
        mesh = check_mesh(mesh)
        try:
            target = named_sharding(mesh, target)
        except Exception as err:  # JAX: ValueError naming the unknown axis
            raise PlacementError(
                f"`target`={target} does not fit `mesh` with axes {dict(mesh.shape)}: {err}"
            ) from None
    spec = isinstance(target, PartitionSpec)  # still a spec: taken on each leaf's own mesh
    checks = (_spec_checks if spec else _sharding_checks)(target, memory_kind)
    leaves = jax.tree_util.tree_leaves(tree)
    bad = _scan(leaves, checks)
    fix = "Fix: `tree = jaxdev.to_device(tree, NamedSharding(mesh, spec))`."
    rule = f"are not sharded as {checks.expected}"
    _fail("assert_sharded", tree, "tree", len(leaves), bad, rule, fix)


def _spec_checks(spec: PartitionSpec, memory_kind: str | None) -> _Checks:
    """Checks for a spec taken on each leaf's own mesh (a memory kind of the default backend)."""
    _check_memory_kind(jax.devices(), memory_kind)
    expected = f"{spec} on the leaf's mesh" + _kind_note(memory_kind)

    def kind_ok(s: Sharding) -> bool:
        return s.memory_kind == (memory_kind or _default_kind(s))

    def fast(s: Sharding) -> bool:
        return isinstance(s, NamedSharding) and s.spec == spec and kind_ok(s)

    def check(x: Any) -> str | None:
        s = x.sharding
        if isinstance(s, NamedSharding) and kind_ok(s):
            try:
                want = NamedSharding(s.mesh, spec, memory_kind=s.memory_kind)
            except Exception as err:
                return f"found {_where(x)}, expected {expected}, but {err}"
            if same_layout(s, want, x.ndim):
                return None
        return f"found {_where(x)}, expected {expected}"

    return _Checks(fast, check, expected)


def assert_committed(tree: chex.ArrayTree, committed: bool = True) -> None:
    """Assert every leaf of ``tree`` is a ``jax.Array`` committed (or not) to its devices.

    Raises:
      PlacementAssertionError: listing every leaf with the other committed-ness, on the
        host (neither), deleted/donated or traced.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> jaxdev.assert_committed(jaxdev.to_device({"w": jnp.ones(2)}, "cpu:0"))
      >>> jaxdev.assert_committed({"w": jnp.ones(2)}, committed=False)
    """
    if asserts_disabled():
        return
    leaves = jax.tree_util.tree_leaves(tree)
    want = "committed to a device" if committed else "uncommitted"
    checks = _Checks(lambda s: True, lambda x: None, f"a jax.Array {want}")
    bad = _scan(leaves, checks, committed)
    fix = (
        "Fix: `tree = jaxdev.to_device(tree, device)` commits every leaf."
        if committed
        else "Fix: create the leaves without a device (e.g. `jnp.asarray`) to leave them "
        "uncommitted."
    )
    _fail("assert_committed", tree, "tree", len(leaves), bad, f"are not {want}", fix)


def assert_same_placement(a: chex.ArrayTree, b: chex.ArrayTree) -> None:
    """Assert two trees' leaves, matched by key path, are placed alike.

    A pair matches when both are host values, or both live ``jax.Array`` with equivalent
    shardings (devices, layout, memory kind) and the same committed-ness.

    Raises:
      PlacementAssertionError: listing every leaf placed differently (both shown), missing
        from one tree, deleted/donated or traced.

    Example:
      >>> import jax, jax.numpy as jnp, jaxdev
      >>> params = jaxdev.to_device({"w": jnp.ones(2)}, "cpu:0")
      >>> jaxdev.assert_same_placement(params, jax.tree.map(jnp.zeros_like, params))
    """
    if asserts_disabled():
        return
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    fix = "Fix: `b = jaxdev.to_device(b, a_sharding)` (or move `a`) so both live together."
    if ta == tb:
        pairs = enumerate(zip(la, lb))
        bad = [(i, why) for i, (x, y) in pairs if (why := _pair_problem(x, y)) is not None]
        _fail("assert_same_placement", a, "a` and `b", len(la), bad, "are placed differently", fix)
        return
    pa = dict(zip(key_strings(a, ta), la))
    pb = dict(zip(key_strings(b, tb), lb))
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


def _pair_problem(x: Any, y: Any) -> str | None:
    """Why ``x`` and ``y`` are placed differently, or None (same sharding key first: cheap)."""
    if type(x) is type(y) is array_type() and not (x.is_deleted() or y.is_deleted()):
        sx, sy = x.sharding, y.sharding
        if x.committed == y.committed and (sx is sy or sharding_key(sx) == sharding_key(sy)):
            return None
    if is_concrete(x) and is_concrete(y):
        if not (deleted(x) or deleted(y)) and x.committed == y.committed:
            sx, sy = x.sharding, y.sharding
            if x.ndim == y.ndim and same_layout(sx, sy, x.ndim):
                return None
    elif is_host_value(x) and is_host_value(y):
        return None
    return f"`a` {_where(x)}, `b` {_where(y)}"


def assert_sharded_fraction(tree: chex.ArrayTree, at_least: float = 0.9) -> None:
    """Assert at least ``at_least`` (0..1) of ``tree``'s logical bytes are in sharded leaves.

    A leaf is sharded when split over several devices; replicated leaves, single-device
    leaves and host values count against it. A tree with no bytes passes.

    Raises:
      PlacementAssertionError: the fraction is too low (listing the largest leaves not
        sharded), or a leaf is deleted/donated, traced or not an array.
      UsageError: ``at_least`` is not a number in ``[0, 1]``.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> mesh = jaxdev.make_mesh({"fsdp": 8})
      >>> params = jaxdev.shard_params({"w": jnp.ones((4096, 64)), "b": jnp.ones(64)}, mesh, "fsdp")
      >>> jaxdev.assert_sharded_fraction(params, at_least=0.99)
      >>> try:
      ...     jaxdev.assert_sharded_fraction(jaxdev.to_device(params, mesh))
      ... except AssertionError as e:
      ...     lines = str(e).splitlines()
      >>> print(lines[0])
      `assert_sharded_fraction` failed: 0.00% of the 1.0 MiB of `tree` (logical bytes) is in ...
      >>> print(lines[1])
        ['w']: float32[4096, 64], 1.0 MiB, found mesh(fsdp=8) P() (fully replicated on 8 devices)
    """
    if asserts_disabled():
        return
    if (
        isinstance(at_least, bool)
        or not isinstance(at_least, (int, float, np.integer, np.floating))
        or not 0 <= at_least <= 1  # NaN fails too
    ):
        raise UsageError(
            f"`at_least` must be a fraction in [0, 1] (0.9: 90% of the bytes in sharded "
            f"leaves), got {at_least!r}."
        )
    leaves = jax.tree_util.tree_leaves(tree)
    total, sharded, whole, bad = _sharded_bytes(leaves)
    if bad:
        rule = "cannot be measured (every leaf must be a live jax.Array or a host value)"
        fix = "Fix: pass the live arrays (outside jax.jit, not donated)."
        _fail("assert_sharded_fraction", tree, "tree", len(leaves), bad, rule, fix)
    if total == 0 or sharded >= at_least * total:
        return
    whole.sort(key=lambda t: (-t[0], t[1]))
    paths = key_strings(tree)
    lines = []
    for n, i in whole[:_MAX_LISTED]:
        x = leaves[i]
        dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else type(x).__name__
        lines.append(f"{paths[i]}: {dtype}{list(np.shape(x))}, {human_bytes(n)}, found {_where(x)}")
    if len(whole) > _MAX_LISTED:
        rest = sum(n for n, _ in whole[_MAX_LISTED:])
        lines.append(f"... and {len(whole) - _MAX_LISTED} smaller leaves ({human_bytes(rest)})")
    header = (
        f"`assert_sharded_fraction` failed: {sharded / total:.2%} of the {human_bytes(total)} "
        f"of `tree` (logical bytes) is in sharded leaves, expected at least {at_least:.2%}. "
        f"The largest of the {len(whole)} leaves that are not sharded:"
    )
    fix = (
        "Fix: shard the large leaves (`jaxdev.shard_params(tree, mesh, 'fsdp')`, or a "
        "(regex, PartitionSpec) rule naming them), or lower `at_least`."
    )
    raise PlacementAssertionError(_message(header, lines, fix))


def _sharded_bytes(leaves: list[Any]) -> tuple[int, int, list, list]:
    """``(total bytes, sharded bytes, [(bytes, index)] not sharded, [(index, why)] unusable)``."""
    total, sharded, whole, bad = 0, 0, [], []  # whole: (bytes, index); bad: (index, why)
    for i, x in enumerate(leaves):
        if is_host_value(x):
            x, split = np.asarray(x), False
        elif (problem := _live_array_problem(x, "a live jax.Array")) is not None:
            bad.append((i, problem))
            continue
        else:
            split = len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
        n = packed_bytes(x.size, x.dtype)  # sub-byte dtypes packed, as XLA stores them
        total += n
        if split:
            sharded += n
        else:
            whole.append((n, i))
    return total, sharded, whole, bad
