"""The placement report (:func:`placement`): where every leaf of a pytree lives, as a table.

A 2000-leaf tree takes a few ms: one cache entry per sharding, shape and dtype.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Sharding

from ._errors import LeafTypeError, UsageError, device_name
from ._leaves import (
    array_type,
    deleted,
    describe_sharding,
    device_key,
    host_problem,
    is_tracer,
    key_strings,
    packed_bytes,
    sharding_key,
)


class LeafPlacement(NamedTuple):
    """Where one leaf lives (one row of :class:`PlacementReport`)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    devices: tuple[str, ...]
    sharding: str
    memory_kind: str | None
    committed: bool | None
    bytes_per_device: int
    deleted: bool = False


class PlacementReport(NamedTuple):
    """Per-leaf placement of a pytree, with per-device byte totals (``str``: a table).

    Attributes:
      leaves: one :class:`LeafPlacement` per leaf.
      bytes_by_device: bytes per device name (this process's devices).
      replicated_by_device: the part held by leaves not split over devices.
      sharded_by_device: the part held by leaves split over several devices.
    """

    leaves: tuple[LeafPlacement, ...]
    bytes_by_device: dict[str, int]
    replicated_by_device: dict[str, int] | None = None
    sharded_by_device: dict[str, int] | None = None

    @property
    def replicated_bytes(self) -> int:
        """Most bytes of replicated (or single-device) leaves on any one device.

        Example:
          >>> import jax.numpy as jnp, jaxdev
          >>> mesh = jaxdev.make_mesh({"data": 8})
          >>> tree = {"r": jaxdev.to_device(jnp.ones(8), mesh),
          ...         "s": jaxdev.to_device(jnp.ones(8), jaxdev.batch_sharding(mesh))}
          >>> r = jaxdev.placement(tree)
          >>> r.replicated_bytes, r.sharded_bytes, f"{r.sharded_share:.0%}"
          (32, 4, '11%')
        """
        return max((self.replicated_by_device or {}).values(), default=0)

    @property
    def sharded_bytes(self) -> int:
        """Most bytes of sharded leaves (split over devices) on any one device."""
        return max((self.sharded_by_device or {}).values(), default=0)

    @property
    def sharded_share(self) -> float:
        """``sharded_bytes / (replicated_bytes + sharded_bytes)``; 0.0 with no device bytes."""
        both = self.replicated_bytes + self.sharded_bytes
        return self.sharded_bytes / both if both else 0.0

    def __str__(self) -> str:
        """The report as a fixed-width text table.

        Example:
          >>> import jax.numpy as jnp, jaxdev
          >>> print(jaxdev.placement({"w": jaxdev.to_device(jnp.ones((2, 3)), "cpu:0")}))
          path   shape  dtype    placement  memory  committed  bytes/device
          -----  -----  -------  ---------  ------  ---------  ------------
          ['w']  2x3    float32  cpu:0      device  yes        24 B
          1 leaves, 24 B on devices (cpu:0: 24 B); per device: 24 B replicated, 0 B sharded (0.0%)
        """
        head = ("path", "shape", "dtype", "placement", "memory", "committed", "bytes/device")
        body = [
            (
                r.path,
                "x".join(map(str, r.shape)) or "()",
                r.dtype,
                _shown(r.sharding, len(r.devices)),
                r.memory_kind or "-",
                "-" if r.committed is None else ("yes" if r.committed else "no"),
                human_bytes(r.bytes_per_device),
            )
            for r in self.leaves
        ]
        lines = text_table(head, body)
        total = sum(self.bytes_by_device.values())
        per = ", ".join(f"{k}: {human_bytes(v)}" for k, v in self.bytes_by_device.items())
        footer = f"{len(self.leaves)} leaves, {human_bytes(total)} on devices ({per or 'none'})"
        if total:
            footer += (
                f"; per device: {human_bytes(self.replicated_bytes)} replicated, "
                f"{human_bytes(self.sharded_bytes)} sharded ({self.sharded_share:.1%})"
            )
        lines.append(footer)
        return "\n".join(lines)

    def diff(self, other: PlacementReport) -> list[str]:
        """Return one line per leaf whose placement differs in ``other`` (or is in one tree only).

        Example:
          >>> import jax.numpy as jnp, jaxdev
          >>> a = jaxdev.placement({"w": jaxdev.to_device(jnp.ones(2), "cpu:0")})
          >>> b = jaxdev.placement({"w": jaxdev.to_device(jnp.ones(2), "cpu:1")})
          >>> a.diff(a), a.diff(b)
          ([], ["['w']: sharding 'cpu:0' != 'cpu:1'", "['w']: devices ('cpu:0',) != ('cpu:1',)"])
        """
        rows_a = {r.path: r for r in self.leaves}
        rows_b = {r.path: r for r in other.leaves}
        out = []
        for path in {**rows_a, **rows_b}:  # a's paths, then those only in b
            ra, rb = rows_a.get(path), rows_b.get(path)
            if ra is None or rb is None:
                out.append(f"{path}: only in {'first' if rb is None else 'second'} tree")
                continue
            for field in ("sharding", "devices", "memory_kind", "committed", "deleted"):
                if (va := getattr(ra, field)) != (vb := getattr(rb, field)):
                    out.append(f"{path}: {field} {va!r} != {vb!r}")
        return out


class _Kind:
    """What every leaf with one (sharding, shape, dtype) shares in the report."""

    __slots__ = ("row_head", "local", "sharded", "nbytes", "count")

    def __init__(self, leaf: jax.Array, described: tuple[str, tuple, tuple, bool]):
        description, devices, self.local, self.sharded = described  # local: for the totals
        s, shape = leaf.sharding, tuple(leaf.shape)
        self.row_head = (shape, str(leaf.dtype), devices, description, s.memory_kind)
        self.nbytes, self.count = packed_bytes(math.prod(s.shard_shape(shape)), leaf.dtype), 0


class _ReportBuilder:
    """Rows with one cache per (sharding, shape, dtype); totals summed per kind at the end."""

    def __init__(self) -> None:
        self.rows: list[LeafPlacement] = []
        self._kinds: dict[tuple[Any, tuple[int, ...], Any], _Kind] = {}
        self._described: dict[Sharding, tuple[str, tuple, tuple, bool]] = {}  # per sharding

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(replicated, sharded)`` bytes per device name, both over every device, in order."""
        names = {n for kind in self._kinds.values() for n in kind.local}
        names = sorted(names, key=lambda n: (n.split(":")[0], int(n.split(":")[1])))
        out = {False: dict.fromkeys(names, 0), True: dict.fromkeys(names, 0)}  # by kind.sharded
        for kind in self._kinds.values():
            for name in kind.local:
                out[kind.sharded][name] += kind.nbytes * kind.count
        return out[False], out[True]

    def _kind(self, leaf: jax.Array) -> _Kind:
        """The kind of ``leaf`` (made on its first leaf; the caller counts the leaf)."""
        s = leaf.sharding
        key = (sharding_key(s), leaf.shape, leaf.dtype)
        if key not in self._kinds:
            if s not in self._described:
                names = tuple(device_name(d) for d in sorted(s.device_set, key=device_key))
                local = tuple(device_name(d) for d in sorted(s.addressable_devices, key=device_key))
                sharded = len(names) > 1 and not s.is_fully_replicated
                self._described[s] = (describe_sharding(s), names, local, sharded)
            self._kinds[key] = _Kind(leaf, self._described[s])
        return self._kinds[key]

    def add_all(self, paths: Sequence[str], leaves: Sequence[Any]) -> None:
        """Add leaves with their key-path strings; the common array case is inlined (hot loop)."""
        impl, kinds, append = array_type(), self._kinds, self.rows.append
        new_row, row_type = tuple.__new__, LeafPlacement  # skips the NamedTuple's __new__
        for path, leaf in zip(paths, leaves):
            if type(leaf) is not impl or leaf.is_deleted():
                self._add_unusual(path, leaf)
                continue
            kind = kinds.get((sharding_key(leaf.sharding), leaf.shape, leaf.dtype))
            kind = kind or self._kind(leaf)
            kind.count += 1
            append(new_row(row_type, (path, *kind.row_head, leaf.committed, kind.nbytes, False)))

    def _add_unusual(self, path: str, leaf: Any) -> None:
        if not isinstance(leaf, jax.Array):
            problem = host_problem(leaf)
            if problem is not None and problem[0] is LeafTypeError:
                raise LeafTypeError(f"`tree` leaf {path}: {problem[1]}.")
            a = np.asarray(leaf)
            row = (path, a.shape, str(a.dtype), (), "host", None, None, a.nbytes)
            self.rows.append(LeafPlacement(*row))
            return
        if is_tracer(leaf) or deleted(leaf):
            gone = not is_tracer(leaf)
            row = (path, tuple(leaf.shape), str(leaf.dtype), (), "deleted" if gone else "traced")
            self.rows.append(LeafPlacement(*row, None, None, 0, gone))
            return
        kind = self._kind(leaf)  # another jax.Array implementation
        kind.count += 1
        self.rows.append(LeafPlacement(path, *kind.row_head, leaf.committed, kind.nbytes))


def placement(tree: Any) -> PlacementReport:
    """Report where every leaf of ``tree`` lives (deleted and traced leaves shown, not raised).

    Raises:
      LeafTypeError: a leaf is not an array or number.

    Example:
      >>> import jax.numpy as jnp, jaxdev
      >>> r = jaxdev.placement({"w": jaxdev.to_device(jnp.ones((2, 3)), "cpu:0")})
      >>> r.leaves[0].path, r.leaves[0].devices, r.bytes_by_device
      ("['w']", ('cpu:0',), {'cpu:0': 24})
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    builder = _ReportBuilder()
    builder.add_all(key_strings(tree, treedef), leaves)
    rep, shd = builder.totals()
    return PlacementReport(tuple(builder.rows), {n: rep[n] + shd[n] for n in rep}, rep, shd)


def text_table(head: tuple[str, ...], body: list[tuple], rstrip: bool = False) -> list[str]:
    """Lines of a plain left-aligned table: header, dashes, rows (the one table formatter).

    Example:
      >>> text_table(("a", "bb"), [("xyz", 1)])
      ['a    bb', '---  --', 'xyz  1 ']
    """
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    rows = [fmt.format(*row) for row in body]
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + (
        [r.rstrip() for r in rows] if rstrip else rows
    )


_NAMED = re.compile(r"mesh\((.*?)\) (P\(.*\))$")


@functools.lru_cache(maxsize=1024)
def _shown(description: str, n: int) -> str:
    """A row's placement column: ``P(None, 'fsdp') on 8 devices (data=2 x fsdp=4)``."""
    named = _NAMED.match(description)
    if named is None:
        return description if n <= 1 else f"{description} on {n} devices"
    axes, spec = named.groups()
    if spec.endswith(",)"):  # P('data',) -> P('data')
        spec = spec[:-2] + ")"
    return f"{spec} on {n} device{'s' if n != 1 else ''} ({axes.replace(',', ' x ')})"


def human_bytes(n: float) -> str:
    """``24 B``, ``1.5 KiB``, ``61.2 GiB``: bytes in binary units, one decimal."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def figure(path: str, **kwargs: Any) -> tuple[Any, str]:
    """A matplotlib ``Figure(**kwargs)`` (no pyplot: the user's backend is untouched) and the
    file ``path`` names (``.png`` added when it has no suffix: what matplotlib writes).

    Raises:
      UsageError: matplotlib is not installed, ``path`` is no path, its folder does not
        exist, or matplotlib writes no file of its suffix.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).strip():
        raise UsageError(f"`path` must be a file path (str or os.PathLike), got {path!r}.")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("`plot` needs matplotlib: pip install 'jaxdev[plot]'") from None
    folder = pathlib.Path(path).parent
    if not folder.is_dir():
        raise UsageError(f"`path` {path!r}: the folder '{folder}' does not exist.")
    check_suffix(path)
    return Figure(**kwargs), str(path) if pathlib.Path(path).suffix else f"{path}.png"


def check_suffix(path: str, arg: str = "path") -> None:
    """Raise :class:`UsageError` naming ``arg`` when matplotlib writes no file of ``path``'s
    suffix (was its bare ValueError, after drawing); needs matplotlib."""
    from matplotlib.figure import Figure

    suffix, kinds = pathlib.Path(path).suffix, Figure().canvas.get_supported_filetypes()
    if suffix and suffix[1:].lower() not in kinds:
        raise UsageError(
            f"`{arg}` {os.fspath(path)!r}: matplotlib writes no '{suffix}' files; end it in one "
            f"of {', '.join('.' + k for k in sorted(kinds))}, or in none for .png."
        )
