"""A 64-bit checksum of an array's raw bytes, computed where the array lives (README's scheme).

The input is the raw bytes as uint32 words: 1- and 2-byte dtypes widen, 8-
and 16-byte ones split into two or four words, sub-byte ones (int4, float4)
are widened exactly first; numpy leaves are viewed on the host, never cast.
Lane ``L`` sums ``fmix32(b + i*K_L + C_L)`` mod 2**32 (murmur3's finaliser)
over the words ``b`` at global positions ``i``: integer sums, so every
sharding of the same values gives the same number.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._leaves import typed_mesh
from .._mesh import mesh_of, outside_mesh

# (position multiplier K, offset C) per lane; K_0 - K_1 = 2 (mod 4): see the module notes.
_LANES = ((0x9E3779B1, 0x85EBCA77), (0xC2B2AE3F, 0x27D4EB2F))
assert (_LANES[0][0] - _LANES[1][0]) % 4 == 2
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _widened(dtype: Any) -> Any:
    """The exact wider dtype a sub-byte dtype (int4, float4) is checked as; None for others."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu" or (dtype.kind == "V" and "int" in dtype.name):
        return np.int8 if jnp.iinfo(dtype).bits < 8 else None
    if jnp.issubdtype(dtype, jnp.floating):
        return np.float32 if jnp.finfo(dtype).bits < 8 else None
    return None


def host_words(x: np.ndarray | np.generic) -> np.ndarray:
    """A numpy leaf's bytes as a flat unsigned array (no copy when contiguous)."""
    wide = _widened(x.dtype)
    flat = np.ascontiguousarray(x if wide is None else np.asarray(x).astype(wide)).reshape(-1)
    size = flat.dtype.itemsize
    return flat.view(_UNSIGNED[size] if size in _UNSIGNED else np.uint32)


def bits(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words, in ``x``'s shape (+ a trailing axis for wide dtypes).
    Not flattened: on a mesh with ``Explicit`` axes, flattening an array split over two axes is
    a reshape JAX refuses (``ShardingTypeError``)."""
    if jax.typeof(x).memory_space == jax.memory.Space.Host:  # offloaded state: read on device
        x = jax.device_put(x, jax.memory.Space.Device)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if (wide := _widened(x.dtype)) is not None:
        x = x.astype(wide)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], -1)
    size = x.dtype.itemsize
    if size >= 4:  # 8-byte elements become two words (a trailing axis)
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major (flat) index mod 2**32, in ``shape``: no reshape needed."""
    i = jnp.zeros((), jnp.uint32)
    for d, n in enumerate(shape):
        i = i * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    return i


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _lanes(b: jax.Array, i: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The two uint32 lanes of words ``b`` at global positions ``i`` (only where ``valid``)."""
    mixed = [_fmix(b + i * jnp.uint32(k) + jnp.uint32(c)) for k, c in _LANES]
    if valid is not None:
        mixed = [jnp.where(valid, m, 0) for m in mixed]
    # One variadic reduction: both lanes in one pass over the data. Two jnp.sum calls
    # read it twice, and cost twice as much on XLA:CPU (25 vs 14 ms per 100 MB).
    zero = jnp.zeros((), jnp.uint32)
    lanes = jax.lax.reduce(
        tuple(mixed), (zero, zero), lambda a, c: (a[0] + c[0], a[1] + c[1]), tuple(range(b.ndim))
    )
    return jnp.stack(lanes)


@jax.jit
def _checksums(xs: list[jax.Array]) -> jax.Array:
    return jnp.stack([_lanes(b, _positions(b.shape)) for b in map(bits, xs)])


@functools.lru_cache(maxsize=16)
def _split_checksums(mesh: Mesh) -> Callable[[list[jax.Array]], jax.Array]:
    """:func:`_checksums` of replicated arrays, each device mixing one slice of its copy."""
    n, parts = mesh.size, NamedSharding(mesh, P("checksum"))

    def one(x: jax.Array) -> jax.Array:
        b = bits(x).ravel()
        size = b.size
        b = jnp.pad(b, (0, -size % n)).reshape(n, -1)
        i = jax.lax.iota(jnp.uint32, b.size).reshape(n, -1)
        b, i = (jax.lax.with_sharding_constraint(a, parts) for a in (b, i))
        return _lanes(b, i, valid=None if size % n == 0 else i < jnp.uint32(size))

    return jax.jit(lambda xs: jnp.stack(list(map(one, xs))), out_shardings=NamedSharding(mesh, P()))


def without_reduced(x: jax.Array) -> jax.Array:
    """``x`` with reduced axes as the same buffers without them (each device holds the same
    data either way): JAX's bitcasts have no reduced rule, orbax's writer cannot iterate it."""
    if not getattr(getattr(x.sharding, "spec", None), "reduced", None):
        return x
    s = x.sharding.update(spec=x.sharding.spec.update(reduced=frozenset()))
    shards = [a.data for a in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, s, shards)


def _one_copy(x: jax.Array) -> jax.Array:
    """A replicated array's first local copy, unless it can be split over its devices."""
    x = without_reduced(x)
    if len(x.sharding.device_set) > 1 and x.sharding.is_fully_replicated:
        return x if x.is_fully_addressable else x.addressable_shards[0].data
    return x


def per_group(arrays: Sequence[Any], program: Callable, host: Callable = jnp.asarray) -> list:
    """``program(devices, group)``'s row for each of ``arrays``: one program per group on the
    same devices and ``Explicit`` mesh (one program cannot take two), replicated arrays as
    :func:`_one_copy`, numpy ones as ``host(x)``; outside a user's ``jax.set_mesh``."""
    with outside_mesh():  # jaxdev's own programs
        xs = [_one_copy(x) if isinstance(x, jax.Array) else host(x) for x in arrays]
        groups: dict[Any, list[int]] = {}
        for i, x in enumerate(xs):
            key = (frozenset(x.sharding.device_set), typed_mesh(x.sharding))
            groups.setdefault(key, []).append(i)
        rows: dict[int, np.ndarray] = {}
        for (devices, _), idx in groups.items():
            got = program(devices, [xs[i] for i in idx])
            got = got if got.is_fully_addressable else got.addressable_data(0)
            rows.update(zip(idx, np.asarray(jax.device_get(got))))
    return [rows[i] for i in range(len(xs))]


def _program(devices: frozenset, group: list[jax.Array]) -> jax.Array:
    """A group's checksums: split over its devices when every array is replicated on them."""
    split = all(x.sharding.is_fully_replicated and x.is_fully_addressable for x in group)
    if split and len(devices) > 1:
        mesh = mesh_of(tuple(sorted(devices, key=lambda d: d.id)), "checksum")
        return _split_checksums(mesh)(group)
    return _checksums(group)


def checksums(arrays: Sequence[Any]) -> list[int]:
    """One int in ``[0, 2**64)`` per ``jax.Array`` (typed keys: their ``key_data``) or numpy
    array, computed where it lives: a fully replicated array on several devices of this process
    is mixed one slice per device (then one all-reduce), other replicated arrays from their first
    local copy (no process waits for another), numpy leaves on the default device from their raw
    bytes."""
    sums = per_group(arrays, _program, lambda x: jnp.asarray(host_words(x)))
    return [(int(hi) << 32) | int(lo) for hi, lo in sums]


@jax.jit
def _legacy(xs: list[jax.Array]) -> jax.Array:
    out = []
    for b in map(bits, xs):
        w = (_positions(b.shape) * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
        out.append(jnp.sum(b * w, dtype=jnp.uint32))
    return jnp.stack(out)


def legacy_checksums(arrays: Sequence[Any]) -> list[int]:
    """Format 1's checksum: a position-weighted uint32 sum, numpy leaves cast by jnp.asarray."""
    return [int(v) for v in per_group(arrays, lambda _, group: _legacy(group))]
