"""Checkpoints that know their placement, on orbax-checkpoint.

:func:`save` writes any pytree of arrays (one device, replicated, batch- or
rule-sharded, pmap-stacked, multi-process global arrays) with orbax's
``PyTreeCheckpointHandler``; :func:`restore` reads it back onto any target.
:class:`Checkpointer` is a thin layer over orbax's ``CheckpointManager`` for
training loops (numbered steps, ``keep`` newest, asynchronous saves).

A checkpoint is one orbax composite directory with up to three items:

* ``state``: the tree's arrays as a nested dict of strings (each key-path
  entry written as a string), so plain orbax can read it too;
* ``jaxdev``: JSON metadata: the format version, the step, the tree's
  structure (to rebuild it without a target), per leaf its key path, shape,
  dtype, saved sharding, a checksum, and Python scalars by value;
* ``running_metrics`` (``Checkpointer.save(..., metrics=...)``): a second tree saved
  like ``state``.

Orbax writes into a temporary directory and renames it when every item is
complete, so an interrupted save never becomes a checkpoint.

Decisions:

* **pmap-stacked leaves** (a leaf whose leading size ``n`` equals the size of
  the one-axis mesh it is split over, ``P(axis)``, as :func:`stack_for_pmap`
  and ``jax.pmap`` make) whose ``n`` rows are bitwise equal are written once
  (row 0) and recorded as stacked over their devices. Restoring them onto a
  device, mesh, sharding or rules target gives the one copy; onto a target
  leaf of shape ``(n, ...)`` (a stacked tree) they are stacked again.
  Stacked-looking leaves whose rows differ (a batch) are saved whole.
* **checksums**: every array leaf's checksum (a position-weighted sum of its
  bits, computed on device, the same for every layout) is stored at save
  time and verified after every restore: a flipped byte in a data file is a
  :class:`CheckpointError` naming the checkpoint and the leaf, never silent
  garbage.
* **Python scalars** (``int``, ``float``, ``bool``, ``complex``) are stored
  by value in the metadata and come back as the same Python type; ``None``
  is an empty subtree.
* ``target=None`` rebuilds the saved structure: dicts, lists, tuples,
  ``None``, NamedTuples (``TrainState``, optax states) and jax-registered
  dataclasses (jaxdev metrics) whose class is already imported, and
  :class:`jaxdev.Collection`; any other node comes back as a dict of its
  children. Arrays come back with their saved sharding when every saved
  device exists here, else on ``jax.devices()[0]`` (replicated over every
  device when several processes run). Numpy leaves come back as numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import gc
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ._errors import CheckpointError, join_failures
from ._leaves import PY_SCALARS, is_tracer, keystr
from ._placement import as_sharding

FORMAT = "jaxdev-checkpoint"
VERSION = 1
_STATE, _META, _METRICS = "state", "jaxdev", "running_metrics"  # orbax reserves "metrics"


def _ocp():
    import orbax.checkpoint as ocp  # imported on first use: ~0.5 s

    return ocp


# ---------------------------------------------------------------- keys and structure


def _entry(k: Any) -> str:
    """One key-path entry as orbax's string key."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _key(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_entry(k) for k in path) or ("<root>",)


def _one_level(node: Any) -> list[tuple[Any, Any]]:
    """``(key entry, child)`` pairs of one pytree node, in jax's flatten order."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    return [(path[0], child) for path, child in pairs]


def _cls_name(obj: Any) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def _skeleton(node: Any, counter: list[int]) -> Any:
    """The structure of ``node`` as JSON; leaves numbered in jax's flatten order."""
    if node is None:
        return {"t": "none"}
    leaves = jax.tree_util.tree_leaves(node)
    if len(leaves) == 1 and leaves[0] is node:
        counter[0] += 1
        return {"t": "leaf", "i": counter[0] - 1}
    children = _one_level(node)
    kids = [[_entry(k), type(_entry_raw(k)).__name__, _skeleton(c, counter)] for k, c in children]
    if type(node) is dict:
        kind = "dict"
    elif type(node) in (list, tuple):
        kind = type(node).__name__
    elif isinstance(node, tuple) and hasattr(node, "_fields"):
        kind = "namedtuple"
    else:
        kind = "node"
    return {"t": kind, "cls": _cls_name(node), "c": kids}


def _entry_raw(k: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _imported_class(name: str) -> type | None:
    """The class ``module:qualname`` if its module is already imported (nothing is imported)."""
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _rebuild(sk: Any, leaves: Sequence[Any]) -> Any:
    """Undo :func:`_skeleton` with ``leaves`` in place of its numbered leaves."""
    t = sk["t"]
    if t == "none":
        return None
    if t == "leaf":
        return leaves[sk["i"]]
    kids = [(_typed_key(k, kt), _rebuild(c, leaves)) for k, kt, c in sk["c"]]
    values = [v for _, v in kids]
    if t == "list":
        return values
    if t == "tuple":
        return tuple(values)
    as_dict = {k: v for k, v in kids}
    if t == "dict":
        return as_dict
    cls = _imported_class(sk["cls"])
    if cls is None:
        return as_dict
    if t == "namedtuple":
        return cls(*values)
    return _rebuild_node(cls, as_dict)


def _typed_key(k: str, kind: str) -> Any:
    return int(k) if kind == "int" else k


def _rebuild_node(cls: type, children: dict) -> Any:
    """A registered node of an imported class from its named children, else the dict."""
    if cls.__name__ == "Collection" and cls.__module__.startswith("jaxdev"):
        return cls(children)
    if cls.__name__ == "FrozenDict":
        return cls(children)
    if dataclasses.is_dataclass(cls):
        try:
            return cls(**children)
        except TypeError:
            return children
    return children


# ---------------------------------------------------------------- leaf kinds and checksums


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of ``x`` as uint32, one or more per element (flattened)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], -1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


def _checksum(x: jax.Array) -> jax.Array:
    """A position-weighted uint32 sum of ``x``'s bits: one changed element always changes it.

    Each element's bits ``b_i`` are multiplied by an odd weight ``w_i``
    (invertible mod 2**32), so ``(b_i' - b_i) * w_i != 0``. Integer sums are
    exact, so every sharding of the same values gives the same number.
    """
    b = _bits(x)
    i = jnp.arange(b.size, dtype=jnp.uint32)
    w = (i * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
    return jnp.sum(b * w, dtype=jnp.uint32)


@jax.jit
def _checksums(xs: list[jax.Array]) -> jax.Array:
    if not xs:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.stack([_checksum(x) for x in xs])


@jax.jit
def _rows_equal(xs: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(_bits(x).reshape(x.shape[0], -1) == _bits(x[:1])) for x in xs])


def _stacked_mesh(x: Any) -> Mesh | None:
    """The one-axis mesh ``x`` is stacked over (pmap layout), else None."""
    if not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[0] < 2:
        return None
    if not x.is_fully_addressable:
        return None
    s = x.sharding
    if not isinstance(s, NamedSharding) or len(s.mesh.axis_names) != 1:
        return None
    axis = s.mesh.axis_names[0]
    spec = tuple(s.spec) + (None,) * (x.ndim - len(s.spec))
    if spec[0] != axis or any(e is not None for e in spec[1:]) or s.mesh.size != x.shape[0]:
        return None
    return s.mesh


def _row0(x: jax.Array) -> jax.Array:
    shard = min(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return shard.data[0]


# ---------------------------------------------------------------- describing shardings


def _describe(s: Any) -> dict | None:
    """A saved sharding as JSON (NamedSharding and one device); None for others."""
    if isinstance(s, NamedSharding):
        ids = np.vectorize(lambda d: d.id, otypes=[int])(s.mesh.devices)
        return {
            "kind": "named",
            "devices": ids.tolist(),
            "axes": list(s.mesh.axis_names),
            "spec": [list(e) if isinstance(e, tuple) else e for e in s.spec],
        }
    if isinstance(s, SingleDeviceSharding):
        return {"kind": "device", "device": next(iter(s.device_set)).id}
    return None


def _saved_sharding(desc: dict | None) -> Sharding | None:
    """Rebuild a described sharding if every device it names exists here."""
    if desc is None:
        return None
    by_id = {d.id: d for d in jax.devices()}
    if desc["kind"] == "device":
        d = by_id.get(desc["device"])
        return None if d is None else SingleDeviceSharding(d)
    ids = np.asarray(desc["devices"])
    if not all(int(i) in by_id for i in ids.ravel()):
        return None
    devs = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(ids)
    spec = P(*[tuple(e) if isinstance(e, list) else e for e in desc["spec"]])
    return NamedSharding(Mesh(devs, tuple(desc["axes"])), spec)


def _default_sharding() -> Sharding:
    if jax.process_count() > 1:
        return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())
    return SingleDeviceSharding(jax.devices()[0])


# ---------------------------------------------------------------- preparing a save


class _Prepared(NamedTuple):
    arrays: dict  # nested dict of strings -> arrays, what orbax writes
    meta: dict  # JSON


def _nest(keys: Sequence[tuple[str, ...]], values: Sequence[Any]) -> dict:
    out: dict = {}
    for key, value in zip(keys, values):
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = value
    return out


def _flat(tree: Any, arg: str) -> list[tuple[tuple[str, ...], str, Any]]:
    """``(orbax key, key path, leaf)`` per leaf; raises on key collisions."""
    out, seen = [], {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key, name = _key(path), keystr(path)
        if key in seen:
            raise CheckpointError(
                f"`{arg}` leaves {seen[key]} and {name} have the same key "
                f"{'/'.join(key)} once written as strings: rename one of them."
            )
        seen[key] = name
        out.append((key, name, leaf))
    return out


def _prepare(tree: Any, arg: str = "tree") -> _Prepared:
    """Check ``tree``'s leaves and build what orbax writes plus jaxdev's metadata."""
    flat = _flat(tree, arg)
    bad = []
    for _, name, x in flat:
        if is_tracer(x):
            bad.append(f"{name}: a tracer (checkpoints are written outside jit)")
        elif isinstance(x, jax.Array) and x.is_deleted():
            bad.append(f"{name}: deleted or donated")
        elif not (_is_array(x) or isinstance(x, PY_SCALARS)):
            bad.append(f"{name}: {type(x).__name__} (only arrays, Python numbers and None)")
        elif isinstance(x, np.ndarray) and x.dtype == object:
            bad.append(f"{name}: numpy array of dtype object")
    if bad:
        raise CheckpointError(join_failures(f"`{arg}` has leaves that cannot be saved:", bad))
    if jax.process_count() > 1:
        flat = _globalize(flat, arg)
    leaves = [x for _, _, x in flat]
    stacked = _find_stacked(leaves)
    entries, keys, arrays = [], [], []
    for i, (key, name, x) in enumerate(flat):
        entry: dict[str, Any] = {"key": list(key), "path": name}
        if isinstance(x, PY_SCALARS):
            entry.update(kind="scalar", type=type(x).__name__, value=_scalar_json(x))
        else:
            if i in stacked:
                mesh = stacked[i]
                entry["stacked"] = {"n": x.shape[0], "devices": [d.id for d in mesh.devices.flat]}
                x = _row0(x)
            if isinstance(x, np.generic):
                x = np.asarray(x)
            entry.update(
                kind="jax" if isinstance(x, jax.Array) else "numpy",
                shape=list(np.shape(x)),
                dtype=str(np.dtype(x.dtype)),
                sharding=_describe(x.sharding) if isinstance(x, jax.Array) else None,
            )
            keys.append(tuple(key))
            arrays.append(x)
        entries.append(entry)
    sums = _leaf_checksums(arrays)
    j = 0
    for entry in entries:
        if entry["kind"] != "scalar":
            entry["checksum"] = int(sums[j])
            j += 1
    meta = {"leaves": entries, "skeleton": _skeleton(tree, [0])}
    return _Prepared(_nest(keys, arrays), meta)


def _globalize(flat: list, arg: str) -> list:
    """Multi-process: leaves held by this process alone become replicated global arrays.

    Orbax writes global arrays only. A process-local leaf (e.g. an optimizer
    state made by an unconstrained ``jit``) is accepted when every process
    holds the same bits (checked by checksum across processes), and written
    once as a copy replicated over every device.
    """
    from ._multihost import assert_same_across_processes

    local = [
        i for i, (_, _, x) in enumerate(flat) if isinstance(x, jax.Array) and x.is_fully_addressable
    ]
    if not local:
        return flat
    try:
        assert_same_across_processes({flat[i][1]: flat[i][2] for i in local})
    except AssertionError as err:
        raise CheckpointError(
            f"`{arg}` has leaves held by each process separately whose values differ across "
            f"processes, so no single value can be saved: {err}"
        ) from err
    rep = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())
    out = list(flat)
    for i in local:
        key, name, x = flat[i]
        host = np.asarray(jax.device_get(x))
        out[i] = (
            key,
            name,
            jax.make_array_from_callback(host.shape, rep, lambda idx, h=host: h[idx]),
        )
    return out


def _scalar_json(x: Any) -> Any:
    if isinstance(x, complex):
        return [repr(x.real), repr(x.imag)]
    if isinstance(x, float):
        return repr(x)  # exact, and inf / nan survive
    return x


def _scalar_value(kind: str, value: Any) -> Any:
    if kind == "complex":
        return complex(float(value[0]), float(value[1]))
    if kind == "float":
        return float(value)
    return {"bool": bool, "int": int}[kind](value)


def _find_stacked(leaves: Sequence[Any]) -> dict[int, Mesh]:
    """Leaves in pmap layout whose rows are bitwise equal: index -> their mesh."""
    found = {i: m for i, x in enumerate(leaves) if (m := _stacked_mesh(x)) is not None}
    if not found:
        return {}
    idx = list(found)
    equal = np.zeros(len(idx), bool)
    for group in _by_devices([leaves[i] for i in idx]).values():
        equal[group] = np.asarray(jax.device_get(_rows_equal([leaves[idx[g]] for g in group])))
    return {i: found[i] for i, ok in zip(idx, equal) if ok}


def _leaf_checksums(arrays: Sequence[Any]) -> np.ndarray:
    """One uint32 per array, computed where the array lives (numpy: on the host device).

    A fully replicated array on several devices of this process is summed in
    parts, one per device (each reads its slice of its own copy, then one
    all-reduce): the checksum is the same number, in 1/n of the time per
    device. Other replicated arrays (several processes) use their first
    local copy, so no process waits for another.
    """
    if not arrays:
        return np.zeros((0,), np.uint32)
    xs = [_one_copy(x) if isinstance(x, jax.Array) else jnp.asarray(x) for x in arrays]
    out = np.zeros(len(xs), np.uint32)
    for devices, idx in _by_devices(xs).items():  # one program per set of devices
        group = [xs[i] for i in idx]
        split = len(devices) > 1 and all(_split_here(x) for x in group)
        fn = _split_checksums(_checksum_mesh(devices)) if split else _checksums
        out[idx] = _fetch(fn(group))
    return out


def _split_here(x: jax.Array) -> bool:
    return x.sharding.is_fully_replicated and x.is_fully_addressable


def _one_copy(x: jax.Array) -> jax.Array:
    """A replicated array's first local copy, unless :func:`_split_checksums` can share it."""
    if len(x.sharding.device_set) > 1 and x.sharding.is_fully_replicated:
        return x if x.is_fully_addressable else x.addressable_shards[0].data
    return x


def _checksum_mesh(devices: frozenset) -> Mesh:
    return Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("checksum",))


@functools.lru_cache(maxsize=16)
def _split_checksums(mesh: Mesh) -> Callable[[list[jax.Array]], jax.Array]:
    """:func:`_checksums` of replicated arrays, each device summing one slice of its copy."""
    n, parts = mesh.size, NamedSharding(mesh, P("checksum"))

    def one(x: jax.Array) -> jax.Array:
        b = _bits(x)
        pad = -b.size % n  # zeros at the end add nothing
        b = jnp.pad(b, (0, pad)).reshape(n, -1)
        i = jax.lax.iota(jnp.uint32, b.size).reshape(n, -1)
        b, i = (jax.lax.with_sharding_constraint(a, parts) for a in (b, i))
        w = (i * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
        return jnp.sum(b * w, dtype=jnp.uint32)

    def run(xs: list[jax.Array]) -> jax.Array:
        return jnp.stack([one(x) for x in xs])

    return jax.jit(run, out_shardings=NamedSharding(mesh, P()))


def _by_devices(xs: Sequence[jax.Array]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    return groups


def _fetch(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))


# ---------------------------------------------------------------- orbax calls


def _composite(prepared: _Prepared, step: int | None, metrics: _Prepared | None) -> Any:
    ocp = _ocp()
    meta = {"format": FORMAT, "version": VERSION, "step": step, _STATE: prepared.meta}
    items = {_STATE: ocp.args.PyTreeSave(prepared.arrays)}
    if metrics is not None:
        meta[_METRICS] = metrics.meta
        items[_METRICS] = ocp.args.PyTreeSave(metrics.arrays)
    items[_META] = ocp.args.JsonSave(meta)
    return ocp.args.Composite(**items)


def _release_waiters() -> None:
    """Wake orbax's writer threads still waiting for a step directory a failed save never made.

    Orbax 0.12's asynchronous handlers start non-daemon threads that wait for
    a "step directory created" signal; when the save fails before that, they
    wait out the coordination timeout (5 minutes) and hold the interpreter's
    exit that long. Sending the signal lets them fail at once (their writes
    go to a directory that is never committed).
    """
    try:
        from orbax.checkpoint._src.futures import future, synchronization
    except ImportError:  # another orbax layout: nothing to release
        return
    try:
        current = synchronization.OperationIdGenerator.get_current_operation_id()
        signal = synchronization.HandlerAwaitableSignal.STEP_DIRECTORY_CREATION
        future.set_signals([signal], operation_id=current)
    except Exception:  # best effort: the error being reported matters more
        pass


def _write_error(path: Any, err: BaseException) -> CheckpointError:
    _release_waiters()
    why = f"{type(err).__name__}: {err}"
    hint = ""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        hint = " The disk is full: free space or write elsewhere."
    elif isinstance(err, PermissionError) or (
        isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EROFS, errno.EPERM)
    ):
        hint = " The directory is not writable: fix its permissions or write elsewhere."
    return CheckpointError(
        f"Could not write the checkpoint {path}: {why}.{hint} Nothing was committed: the "
        "previous checkpoint (if any) is intact, and the state in memory is unchanged."
    )


def save(path: Any, tree: Any, *, step: int | None = None, overwrite: bool = False) -> None:
    """Write ``tree`` to the checkpoint directory ``path`` (blocking), whatever its layout.

    Every process of a multi-process run calls it with the same tree: each
    writes its own shards (orbax). pmap-stacked leaves with equal rows are
    written once (see the module notes); a checksum per leaf is stored and
    verified by :func:`restore`. The directory appears only when complete.

    Args:
      path: a directory that does not exist yet.
      tree: a pytree of ``jax.Array``, numpy arrays, Python numbers and None.
      step: a step number to record (read back with :func:`checkpoint_step`).
      overwrite: replace an existing checkpoint at ``path``.

    Raises:
      CheckpointError: ``path`` exists (and not ``overwrite``); a leaf cannot
        be saved (its key path named); the write failed (disk full, not
        writable): nothing was committed and ``tree`` is unchanged.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxdev
      >>> d = tempfile.mkdtemp()
      >>> jaxdev.save(f"{d}/ckpt", {"w": jnp.ones(3), "n": 7}, step=7)
      >>> jaxdev.restore(f"{d}/ckpt")
      {'n': 7, 'w': Array([1., 1., 1.], dtype=float32)}
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise CheckpointError(
            f"Checkpoint path {path} already exists: pass `overwrite=True` or choose a new "
            "path (`jaxdev.Checkpointer` numbers its checkpoints by step)."
        )
    prepared = _prepare(tree)
    for attempt in (1, 2):
        _remove_unfinished(path)
        try:
            _write(path, prepared, step, overwrite)
            return
        except FileExistsError:  # an earlier failed save's tmp dir appeared late
            if attempt == 2:
                raise
        except (OSError, ValueError, RuntimeError) as err:
            raise _write_error(path, err) from err


def _write(path: str, prepared: _Prepared, step: int | None, overwrite: bool) -> None:
    ocp = _ocp()
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(path, args=_composite(prepared, step, None), force=overwrite)
    except FileExistsError:
        raise
    except (OSError, ValueError, RuntimeError) as err:
        raise _write_error(path, err) from err


def _remove_unfinished(path: str) -> None:
    """Delete what an earlier failed save of ``path`` left: orbax's uncommitted tmp dir."""
    if jax.process_index() != 0:
        return
    parent, name = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        if n.startswith(name + ".orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


# ---------------------------------------------------------------- reading


def _read_meta(path: str, reader: Callable[[Any], Any]) -> dict:
    ocp = _ocp()
    if not os.path.isdir(path):
        raise CheckpointError(_missing_message(path))
    if not os.path.isdir(os.path.join(path, _META)):
        raise CheckpointError(
            f"{path} is not a jaxdev checkpoint (no `{_META}` item inside). " + _steps_hint(path)
        )
    try:
        meta = reader(ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
    except Exception as err:  # orbax raises many types on a damaged file
        raise CheckpointError(
            f"Could not read the metadata of checkpoint {path} ({type(err).__name__}: {err}): "
            "the checkpoint is damaged or was written by something else."
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a jaxdev checkpoint (unknown metadata format).")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"Checkpoint {path} has format version {meta['version']}, newer than this "
            f"jaxdev reads ({VERSION}): upgrade jaxdev."
        )
    return meta


def _missing_message(path: str) -> str:
    return f"No checkpoint at {path}: the directory does not exist. " + _steps_hint(path)


def _steps_hint(path: str) -> str:
    parent = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        steps = sorted(int(n) for n in os.listdir(parent) if n.isdigit())
    except OSError:
        steps = []
    if steps:
        return (
            f"{parent} holds numbered checkpoints (steps {steps[:10]}): restore one of "
            f"those (e.g. {os.path.join(parent, str(steps[-1]))}) or use "
            "`jaxdev.Checkpointer(directory).restore()`."
        )
    return "Check the path."


class _Want(NamedTuple):
    """What one leaf should become."""

    kind: str  # "jax" | "numpy" | "scalar" | "pytype" (target is a Python number)
    sharding: Sharding | None
    shape: tuple[int, ...] | None  # None: as saved
    dtype: Any  # None: as saved


def _is_target_leaf(x: Any) -> bool:
    return isinstance(x, (Sharding, Mesh, jax.Device, jax.ShapeDtypeStruct))


def _resolve(path: str, entries: list[dict], skeleton: Any, target: Any, rules: Any, what: str):
    """Per saved leaf a :class:`_Want`, and how to rebuild the tree from the leaves."""
    if rules is not None:
        return _resolve_rules(path, entries, skeleton, target, rules)
    if target is None or isinstance(target, (Sharding, Mesh, jax.Device, str, int)):
        common = None if target is None else _as_target_sharding(path, target)
        wants = [_want_common(e, common) for e in entries]
        return wants, lambda leaves: _rebuild(skeleton, leaves)
    return _resolve_tree(path, entries, target, what)


def _as_target_sharding(path: str, target: Any) -> Sharding:
    try:
        return as_sharding(target)
    except Exception as err:
        raise CheckpointError(
            f"Cannot restore checkpoint {path} onto `target` {target!r}: {err}"
        ) from err


def _want_common(e: dict, common: Sharding | None) -> _Want:
    if e["kind"] == "scalar":
        return _Want("scalar", None, None, None)
    if common is None:
        if e["kind"] == "numpy":
            return _Want("numpy", None, None, None)
        s = _saved_sharding(e.get("sharding"))
        if s is not None and e.get("stacked"):
            s = None  # written unstacked: see below
        if e.get("stacked"):
            return _Want("jax", _restack_sharding(e), (e["stacked"]["n"], *e["shape"]), None)
        return _Want("jax", s or _default_sharding(), None, None)
    return _Want("jax", common, None, None)


def _restack_sharding(e: dict) -> Sharding:
    """Where a stacked leaf goes with no target: its devices again, else the default."""
    by_id = {d.id: d for d in jax.devices()}
    ids = e["stacked"]["devices"]
    if all(i in by_id for i in ids) and e["sharding"] is not None:
        axis = "data"
        return NamedSharding(Mesh(np.array([by_id[i] for i in ids]), (axis,)), P(axis))
    return _default_sharding()


def _resolve_rules(path, entries, skeleton, mesh, rules):
    from ._rules import state_shardings

    if not isinstance(mesh, Mesh):
        raise CheckpointError(
            f"Restoring checkpoint {path} with `rules={rules!r}` needs `target` to be the "
            f"Mesh the rules refer to, got {type(mesh).__name__}."
        )
    shapes = [
        None
        if e["kind"] == "scalar"
        else jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]))
        for e in entries
    ]
    abstract = _rebuild(skeleton, shapes)
    try:
        shardings = state_shardings(abstract, mesh, rules)
    except Exception as err:
        raise CheckpointError(
            f"Cannot restore checkpoint {path} with rules {rules!r} on {mesh}: {err}"
        ) from err
    flat = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    it = iter(flat)
    wants = [
        _Want("scalar", None, None, None)
        if e["kind"] == "scalar"
        else _Want("jax", next(it), None, None)
        for e in entries
    ]
    return wants, lambda leaves: _rebuild(skeleton, leaves)


def _resolve_tree(path: str, entries: list[dict], target: Any, what: str):
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_target_leaf)
    saved = {tuple(e["key"]): i for i, e in enumerate(entries)}
    asked = {}
    for p, leaf in pairs:
        asked[_key(p)] = (keystr(p), leaf)
    missing = [(name, leaf) for k, (name, leaf) in asked.items() if k not in saved]
    extra = [e for e in entries if tuple(e["key"]) not in asked]
    if missing or extra:
        lines = [f"{n}: in `target` ({_asked_text(x)}), not in the checkpoint" for n, x in missing]
        lines += [
            f"{e['path']}: in the checkpoint ({_saved_text(e)}), not in `target`" for e in extra
        ]
        raise CheckpointError(
            join_failures(
                f"Checkpoint {path} ({what}) and `target` have different leaves "
                "(restore with `target=None` to see what was saved, or fix the target):",
                lines,
            )
        )
    wants: list[_Want | None] = [None] * len(entries)
    order = []
    for k, (_, leaf) in asked.items():
        i = saved[k]
        wants[i] = _want_of(entries[i], leaf)
        order.append(i)

    def build(leaves: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [leaves[i] for i in order])

    return wants, build


def _saved_text(e: dict) -> str:
    if e["kind"] == "scalar":
        return f"Python {e['type']}"
    return f"{e['dtype']}{e['shape']}"


def _asked_text(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype)}{list(x.shape)}"
    return type(x).__name__


def _want_of(e: dict, leaf: Any) -> _Want:
    if isinstance(leaf, PY_SCALARS):
        return _Want("pytype", None, None, type(leaf))
    if isinstance(leaf, Sharding):
        return _Want("jax", leaf, None, None)
    if isinstance(leaf, (jax.Device, Mesh)):
        return _Want("jax", as_sharding(leaf), None, None)
    if isinstance(leaf, np.ndarray | np.generic):
        return _Want("numpy", None, np.shape(leaf), np.dtype(leaf.dtype))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        s = leaf.sharding if isinstance(leaf.sharding, Sharding) else None
        return _Want("jax", s or _want_common(e, None).sharding, leaf.shape, np.dtype(leaf.dtype))
    if isinstance(leaf, jax.Array):
        return _Want("jax", leaf.sharding, leaf.shape, np.dtype(leaf.dtype))
    raise CheckpointError(
        f"`target` leaf {e['path']} is a {type(leaf).__name__}: give an array, a "
        "ShapeDtypeStruct, a Sharding, a Mesh, a Device or a Python number."
    )


# ---------------------------------------------------------------- planning the read


class _Read(NamedTuple):
    """How one array leaf is read and then turned into what was asked."""

    sharding: Sharding | None  # None: numpy
    post: str  # "none" | "stack" (broadcast onto a leading device axis)
    final: Sharding | None


def _plan(path: str, entries: list[dict], wants: list[_Want], what: str) -> list[_Read | None]:
    reads: list[_Read | None] = []
    bad = []
    for e, w in zip(entries, wants):
        if e["kind"] == "scalar":
            reads.append(None)
            if w.kind in ("jax", "numpy") and w.shape not in (None, ()):
                bad.append(f"{e['path']}: saved a Python {e['type']}, asked shape {w.shape}")
            continue
        saved_shape, saved_dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        if w.kind == "pytype":
            bad.append(
                f"{e['path']}: saved an array {saved_dtype}{list(saved_shape)}, asked a "
                f"Python {w.dtype.__name__}"
            )
            reads.append(None)
            continue
        if w.dtype is not None and np.dtype(w.dtype) != saved_dtype:
            bad.append(f"{e['path']}: saved dtype {saved_dtype}, asked {np.dtype(w.dtype)}")
        post = "none"
        if w.shape is not None and tuple(w.shape) != saved_shape:
            if tuple(w.shape[1:]) == saved_shape and len(w.shape) == len(saved_shape) + 1:
                post = "stack"
            else:
                bad.append(
                    f"{e['path']}: saved shape {saved_shape} ({saved_dtype}), asked "
                    f"{tuple(w.shape)}"
                )
        if w.kind == "numpy":
            reads.append(_Read(None, post, None))
            continue
        shape = tuple(w.shape) if post == "stack" else saved_shape
        problem = _indivisible(w.sharding, shape)
        if problem:
            bad.append(f"{e['path']}: shape {shape} cannot be split by {problem}")
        read = _stack_source(w.sharding) if post == "stack" else w.sharding
        reads.append(_Read(read, post, w.sharding))
    if bad:
        raise CheckpointError(
            join_failures(f"Checkpoint {path} ({what}) cannot be restored onto `target`:", bad)
        )
    return reads


def _indivisible(s: Sharding | None, shape: tuple[int, ...]) -> str | None:
    if s is None or isinstance(s, SingleDeviceSharding):
        return None
    try:
        s.shard_shape(shape)
    except Exception as err:  # jax raises ValueError / IndexError / AssertionError
        spec = getattr(s, "spec", s)
        mesh = getattr(s, "mesh", None)
        where = f" on mesh {dict(mesh.shape)}" if mesh is not None else ""
        return f"{spec}{where} ({err}); pick a spec that divides it or pad the leaf"
    return None


def _stack_source(s: Sharding) -> Sharding:
    """Read a stacked leaf's one copy replicated over the devices it will be stacked on."""
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, P())
    devs = list(s.device_set)
    return NamedSharding(Mesh(np.array(devs), ("data",)), P())


def _orbax_restore(path, reader, item, entries, reads, what):
    ocp = _ocp()
    keys, abstract, args = [], [], []
    for e, r in zip(entries, reads):
        if r is None:
            continue
        shape, dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        keys.append(tuple(e["key"]))
        if r.sharding is None:
            abstract.append(
                np.zeros(shape, dtype) if not shape else jax.ShapeDtypeStruct(shape, dtype)
            )
            args.append(ocp.RestoreArgs(restore_type=np.ndarray))
        else:
            abstract.append(jax.ShapeDtypeStruct(shape, dtype, sharding=r.sharding))
            args.append(ocp.ArrayRestoreArgs(sharding=r.sharding, global_shape=shape, dtype=dtype))
    if not keys:
        return []
    item_args = ocp.args.PyTreeRestore(_nest(keys, abstract), restore_args=_nest(keys, args))
    failure = None
    try:
        out = reader(ocp.args.Composite(**{item: item_args}))[item]
    except Exception as err:  # a damaged or truncated data file
        failure = f"{type(err).__name__}: {_short(err)}"
    if failure is not None:
        with _quiet_leftovers():
            broken = _broken_leaves(reader, item, keys, abstract, args, entries)
        raise CheckpointError(
            f"Could not read checkpoint {path} ({what}){broken}: {failure}. The checkpoint "
            "is damaged or incomplete: restore an earlier one."
        )
    got = []
    for key in keys:
        node = out
        for k in key:
            node = node[k]
        got.append(node)
    return got


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) < 400 else text[:400] + " ..."


@contextlib.contextmanager
def _quiet_leftovers() -> Iterator[None]:
    """Collect the read coroutines orbax abandoned after a failed read, without noise.

    When one array read fails, orbax leaves the other reads' coroutines to the
    garbage collector, which reports each as an unraisable exception (and
    pytest turns those into errors). The failure itself is reported by the
    caller, so they are collected here with the report switched off.
    """
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _broken_leaves(reader, item, keys, abstract, args, entries) -> str:
    """Read the leaves one by one after a failed read: name the ones that fail."""
    ocp = _ocp()
    names = {tuple(e["key"]): e["path"] for e in entries}
    broken = []
    for key, a, r in zip(keys, abstract, args):
        one = ocp.args.PyTreeRestore(
            _nest([key], [a]), restore_args=_nest([key], [r]), partial_restore=True
        )
        try:
            reader(ocp.args.Composite(**{item: one}))
        except Exception:
            broken.append(names[key])
    if not broken:
        return ""
    return f", leaves {', '.join(broken[:10])}" + (" ..." if len(broken) > 10 else "")


def _finish(path, entries, wants, reads, arrays, what) -> list[Any]:
    """Verify checksums, stack where asked, make scalars; one value per saved leaf."""
    it = iter(arrays)
    got = [None if r is None else next(it) for r in reads]
    live = [(i, x) for i, x in enumerate(got) if x is not None]
    if live and all("checksum" in entries[i] for i, _ in live):
        sums = _leaf_checksums([x for _, x in live])
        bad = [
            f"{entries[i]['path']}: checksum {int(s)} read, {entries[i]['checksum']} written"
            for (i, _), s in zip(live, sums)
            if int(s) != entries[i]["checksum"]
        ]
        if bad:
            raise CheckpointError(
                join_failures(
                    f"Checkpoint {path} ({what}) is corrupted: these leaves read back "
                    "different bits than were written (a damaged or overwritten data file). "
                    "Restore an earlier checkpoint. Leaves:",
                    bad,
                )
            )
    out = []
    for e, w, r, x in zip(entries, wants, reads, got):
        if e["kind"] == "scalar":
            value = _scalar_value(e["type"], e["value"])
            if w.kind == "jax":
                value = (
                    jax.device_put(np.asarray(value, w.dtype), w.sharding) if w.sharding else value
                )
            out.append(value)
        elif r.post == "stack":
            out.append(_stack(x, w.shape[0], r.final))
        else:
            out.append(x)
    return out


def _stack(x: Any, n: int, s: Sharding | None) -> Any:
    if s is None:
        return np.broadcast_to(x, (n, *np.shape(x))).copy()
    return jax.jit(lambda y: jnp.broadcast_to(y, (n, *y.shape)), out_shardings=s)(x)


def _restore_item(path, reader, meta, item, target, rules, what):
    entries, skeleton = meta[item]["leaves"], meta[item]["skeleton"]
    wants, build = _resolve(path, entries, skeleton, target, rules, what)
    reads = _plan(path, entries, wants, what)
    arrays = _orbax_restore(path, reader, item, entries, reads, what)
    return build(_finish(path, entries, wants, reads, arrays, what))


def restore(path: Any, target: Any = None, *, rules: Any = None) -> Any:
    """Read the checkpoint at ``path`` onto ``target``, whatever layout it was saved in.

    Args:
      path: a checkpoint written by :func:`save` (or one step directory of a
        :class:`Checkpointer`).
      target: where and what to restore:

        * ``None``: the saved structure (see the module notes), arrays with
          their saved sharding when its devices exist here, else on
          ``jax.devices()[0]``; stacked leaves stacked again;
        * a device or spec (``'cpu:0'``), a ``Sharding``, or a ``Mesh``
          (replicated): every array leaf there (stacked leaves as one copy);
        * a ``Mesh`` with ``rules`` (``"fsdp"``, ``"replicate"``, regex
          list, ...): :func:`jaxdev.state_shardings` of the saved shapes;
        * a tree like the saved one whose leaves are arrays (restore like
          this state), ``ShapeDtypeStruct`` s with shardings, ``Sharding``
          or ``Device`` objects, numpy arrays (read to host) or Python
          numbers. The result has the target's structure (a ``TrainState``
          target gives a ``TrainState``). A target leaf of shape
          ``(n, *saved)`` gets the saved leaf stacked ``n`` times (pmap).
      rules: sharding rules, with a ``Mesh`` target.

    Returns:
      The restored tree.

    Raises:
      CheckpointError: no checkpoint at ``path``; the target has missing or
        extra leaves, or asks another shape or dtype, or a sharding that
        cannot split a leaf (each naming the leaf path, what was saved and
        what was asked); the checkpoint is damaged (its checksum or orbax
        read fails).

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, jaxdev
      >>> d = tempfile.mkdtemp()
      >>> mesh = jaxdev.data_mesh()
      >>> jaxdev.save(f"{d}/c", {"w": jaxdev.replicate(jnp.arange(8.0), mesh)})
      >>> one = jaxdev.restore(f"{d}/c", "cpu:0")
      >>> jaxdev.assert_on_device(one, "cpu:0")
      >>> split = jaxdev.restore(f"{d}/c", {"w": jaxdev.batch_sharding(mesh)})
      >>> split["w"].sharding.spec
      P('data',)
    """
    path = os.path.abspath(os.fspath(path))
    ocp = _ocp()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:

        def reader(args: Any) -> Any:
            return ckptr.restore(path, args=args)

        meta = _read_meta(path, reader)
        return _restore_item(path, reader, meta, _STATE, target, rules, "state")


def checkpoint_step(path: Any) -> int | None:
    """Return the step recorded by :func:`save` at ``path`` (None if none was given).

    Raises:
      CheckpointError: no jaxdev checkpoint at ``path``.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxdev
      >>> from jaxdev._checkpoint import checkpoint_step
      >>> d = tempfile.mkdtemp()
      >>> jaxdev.save(f"{d}/c", {"w": jnp.ones(2)}, step=12)
      >>> checkpoint_step(f"{d}/c")
      12
    """
    path = os.path.abspath(os.fspath(path))
    ocp = _ocp()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        return _read_meta(path, lambda args: ckptr.restore(path, args=args)).get("step")


# ---------------------------------------------------------------- the manager


class Checkpointer:
    """Numbered checkpoints for a training loop: a thin layer over orbax's ``CheckpointManager``.

    ``save(step, state)`` writes ``directory/<step>`` every ``every`` steps,
    keeps the ``keep`` newest, and (``async_``) returns once the arrays are
    copied off the devices while a background thread writes them; the step
    loop goes on meanwhile. A checkpoint appears (and ``latest_step`` sees
    it) only once complete: orbax writes into a temporary directory and
    renames it, so a process killed mid-save leaves the previous checkpoint
    as the latest one.

    Args:
      directory: where the numbered checkpoints go (created if missing).
      keep: how many newest checkpoints to keep (``None``: all).
      every: save only steps that are multiples of ``every``, as orbax
        decides it: the first save into an empty directory always happens,
        and a step not above the latest checkpoint is skipped
        (``force=True`` saves any step that has no checkpoint yet).
      async_: write in the background (``wait()`` blocks until done).

    Raises:
      CheckpointError: ``directory`` cannot be created or written.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, jaxdev
      >>> state = jaxdev.TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1))
      >>> with jaxdev.Checkpointer(tempfile.mkdtemp(), every=10) as ckpt:
      ...     ckpt.save(10, state), ckpt.save(15, state)
      ...     ckpt.wait()
      ...     back = ckpt.restore(state)
      (True, False)
      >>> type(back).__name__, ckpt.latest_step()
      ('TrainState', 10)
    """

    def __init__(
        self, directory: Any, keep: int | None = 3, every: int = 1, async_: bool = True
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or keep < 1):
            raise CheckpointError(f"`keep` must be a positive int or None, got {keep!r}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CheckpointError(f"`every` must be a positive int, got {every!r}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self._started: set[int] = set()
        ocp = _ocp()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=every,
            enable_async_checkpointing=async_,
            create=True,
        )
        try:  # item handlers follow the args of each save / restore (Composite)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as err:
            raise _write_error(self.directory, err) from err

    def save(self, step: int, state: Any, metrics: Any = None, force: bool = False) -> bool:
        """Save ``state`` (and ``metrics``: a ``Collection``, ``DeviceLog``, any tree) as ``step``.

        Args:
          step: the step number (the directory name).
          state: the tree to save (e.g. a ``TrainState``).
          metrics: an optional second tree saved alongside.
          force: save even when ``step`` is not a multiple of ``every``.

        Returns:
          True if a save started; False when ``step`` was skipped (not a
          multiple of ``every``, or a checkpoint of that step exists: one is
          never overwritten).

        Raises:
          CheckpointError: a leaf cannot be saved, or the write failed (disk
            full, not writable; an asynchronous write that failed earlier is
            reported by the next ``save``, ``wait`` or ``close``). ``state``
            is never changed.

        Example:
          >>> import tempfile, jax.numpy as jnp, jaxdev
          >>> with jaxdev.Checkpointer(tempfile.mkdtemp(), async_=False) as ckpt:
          ...     ckpt.save(1, {"w": jnp.ones(2)})
          True
        """
        step = int(step)
        if step in self._started or step in self._manager.all_steps():
            return False  # never overwrite a checkpoint
        if not force and not self._manager.should_save(step):
            return False
        prepared = _prepare(state, "state")
        extra = None if metrics is None else _prepare(metrics, "metrics")
        try:
            started = self._manager.save(step, args=_composite(prepared, step, extra), force=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise _write_error(os.path.join(self.directory, str(step)), err) from err
        if started:
            self._started.add(step)
        return bool(started)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None when there is none).

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).latest_step() is None
          True
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint, oldest first.

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).all_steps()
          []
        """
        return sorted(self._manager.all_steps())

    def _step(self, step: int | None) -> int:
        if step is None:
            self.wait()
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"No checkpoint in {self.directory}: nothing has been saved there yet "
                    "(check the directory; `latest_step()` is None)."
                )
        elif step not in self._manager.all_steps():
            raise CheckpointError(
                f"No checkpoint for step {step} in {self.directory}; complete steps: "
                f"{self.all_steps()}."
            )
        return int(step)

    def _read(self, step: int, item: str, target: Any, rules: Any) -> Any:
        path = os.path.join(self.directory, str(step))

        def reader(args: Any) -> Any:
            return self._manager.restore(step, args=args)

        meta = _read_meta(path, reader)
        if item not in meta:
            return None
        return _restore_item(path, reader, meta, item, target, rules, item)

    def restore(self, target: Any = None, step: int | None = None, *, rules: Any = None) -> Any:
        """Restore the state of ``step`` (default: the latest) onto ``target``.

        Args:
          target: as :func:`jaxdev.restore` (``None``, a device, mesh,
            sharding, a mesh with ``rules``, or a tree like the state).
          step: which checkpoint; default :meth:`latest_step` (after
            :meth:`wait`).
          rules: sharding rules, with a ``Mesh`` target.

        Returns:
          The state only; see :meth:`restore_metrics` for the metrics.

        Raises:
          CheckpointError: no checkpoint (or not that step), or as
            :func:`jaxdev.restore`.

        Example:
          >>> import tempfile, jax.numpy as jnp, jaxdev
          >>> with jaxdev.Checkpointer(tempfile.mkdtemp()) as ckpt:
          ...     _ = ckpt.save(3, {"w": jnp.ones(2)})
          ...     ckpt.restore("cpu:1")["w"].devices() == {jaxdev.cpu(1)}
          True
        """
        return self._read(self._step(step), _STATE, target, rules)

    def restore_metrics(self, target: Any = None, step: int | None = None) -> Any:
        """Restore the metrics saved with ``step`` (default: the latest); None if none were.

        Example:
          >>> import tempfile, jax.numpy as jnp, jaxdev
          >>> m = jaxdev.Collection.from_values({"loss": jaxdev.Mean}, {"loss": jnp.ones(4)})
          >>> with jaxdev.Checkpointer(tempfile.mkdtemp()) as ckpt:
          ...     _ = ckpt.save(1, {"w": jnp.ones(2)}, metrics=m)
          ...     float(ckpt.restore_metrics()["loss"].compute())
          1.0
        """
        return self._read(self._step(step), _METRICS, target, None)

    def wait(self) -> None:
        """Block until every asynchronous save has finished (and report its failure).

        Raises:
          CheckpointError: a background write failed.

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).wait()
        """
        try:
            self._manager.wait_until_finished()
        except (OSError, ValueError, RuntimeError) as err:
            raise _write_error(self.directory, err) from err

    def close(self) -> None:
        """Wait for pending saves and release orbax's resources.

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).close()
        """
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"


__all__ = ["Checkpointer", "checkpoint_step", "restore", "save"]
