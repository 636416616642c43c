"""``save`` and ``restore`` in README's format (README, Checkpoints).

Beside it: ``running_metrics`` (``Checkpointer.save(..., metrics=...)``) is saved like ``state``,
typed PRNG keys as their ``key_data``, zero-size arrays in the metadata only; the files' safety is
``_ckpt_files``'s. In file order: the tree's structure, pmap-stacked leaves, shardings as JSON;
a save (:func:`prepare`, :func:`composite`, :func:`save`); a restore (:func:`read_meta`,
``_resolve``, ``_plan``, ``_orbax_restore``, ``_finish``, :func:`restore_item`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import inspect
import itertools
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from .. import _timeline
from .._errors import CheckpointError, UsageError, join_failures, short
from .._leaves import PY_SCALARS, is_host_value, is_prng_key, is_tracer, keystr, x64
from .._mesh import DEFAULT_AXIS, data_mesh, mesh_of, replicated_sharding
from .._multihost import exchange
from .._placement import as_sharding, place_tree, refuse_unreduced
from .._pmap_layout import is_stacked, stacker, unstack_from_pmap
from .._report import human_bytes
from .._target import refuse
from ..distributed import beat
from ..memory import explained_oom, is_resource_exhausted
from . import _ckpt_files as files
from ._checksum import bits, checksums, legacy_checksums, per_group, without_reduced

FORMAT = "jaxdev-checkpoint"
VERSION = 2  # 2: 64-bit checksums, metadata digest, typed keys, zero-size leaves
STATE, META, METRICS = "state", files.META_ITEM, "running_metrics"  # orbax reserves "metrics"
MANAGER_LOCK = ".jaxdev-lock"  # a Checkpointer's lock file, inside its directory


class Damaged(CheckpointError):
    """A checkpoint's files are damaged (found reading it): a Checkpointer falls back."""


def orbax():
    import orbax.checkpoint as ocp  # imported on first use: ~0.5 s

    return ocp


def _key(path: Sequence[Any]) -> tuple[str, ...]:
    """A key path as orbax's string keys: each entry's own value as a string."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path) or ("<root>",)


def _skeleton(node: Any, counter: Iterator[int]) -> Any:
    """The structure of ``node`` as JSON; leaves numbered in jax's flatten order."""
    if node is None:
        return {"t": "none"}
    leaves = jax.tree.leaves(node)
    if len(leaves) == 1 and leaves[0] is node:
        return {"t": "leaf", "i": next(counter)}
    pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    raw = [getattr(p[0], "key", getattr(p[0], "idx", "")) for p, _ in pairs]  # int keys: ints
    kids = [[*_key(p), type(r).__name__, _skeleton(c, counter)] for (p, c), r in zip(pairs, raw)]
    kind = {dict: "dict", list: "list", tuple: "tuple"}.get(type(node), "node")
    if kind == "node" and isinstance(node, tuple) and hasattr(node, "_fields"):
        kind = "namedtuple"
    return {"t": kind, "cls": f"{type(node).__module__}:{type(node).__qualname__}", "c": kids}


def _rebuild(sk: Any, leaves: Sequence[Any]) -> Any:
    """Undo :func:`_skeleton` with ``leaves``: the classes README names, if imported; else dicts."""
    t = sk["t"]
    if t in ("none", "leaf"):
        return None if t == "none" else leaves[sk["i"]]
    kids = {
        int(k) if kt.startswith(("int", "uint")) else k: _rebuild(c, leaves)  # numpy ints too
        for k, kt, c in sk["c"]
    }
    if t in ("list", "tuple", "namedtuple"):
        values = list(kids.values())
        cls = {"list": list, "tuple": tuple}.get(t) or _imported_class(sk["cls"])
        return kids if cls is None else cls(values) if t != "namedtuple" else cls(*values)
    cls = None if t == "dict" else _imported_class(sk["cls"])
    ours = cls is not None and cls.__name__ == "Collection" and cls.__module__.startswith("jaxdev")
    if ours or (cls is not None and cls.__name__ == "FrozenDict"):
        return cls(kids)
    with contextlib.suppress(TypeError):
        if cls is not None and dataclasses.is_dataclass(cls):
            return cls(**kids)
    return kids


# the classes' modules in checkpoints written before 74c68ce (one folder per subsystem)
_MOVED = {"jaxdev._train": "jaxdev.train._train", "jaxdev._metrics": "jaxdev.train._metrics"}


def _imported_class(name: str) -> type | None:
    """The class ``module:qualname`` if its module is already imported (nothing is imported)."""
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(_MOVED.get(module, module))
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


@jax.jit
def _rows_equal(xs: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(bits(x).reshape(x.shape[0], -1) == bits(x[:1]).ravel()) for x in xs])


def _stacked_mesh(x: Any) -> Mesh | None:
    """The one-axis ``Auto`` mesh ``x`` is stacked over (``P(axis)``, pmap layout), else None."""
    if not (is_stacked(x) and x.is_fully_addressable and isinstance(x.sharding, NamedSharding)):
        return None
    mesh = x.sharding.mesh
    return mesh if mesh.axis_types == (AxisType.Auto,) else None


def _find_stacked(leaves: Sequence[Any]) -> dict[int, Mesh]:
    """Leaves in pmap layout whose rows are bitwise equal: index -> their mesh."""
    found = {i: m for i, x in enumerate(leaves) if (m := _stacked_mesh(x)) is not None}
    equal = per_group([leaves[i] for i in found], lambda _, group: _rows_equal(group))
    return {i: found[i] for i, ok in zip(found, equal) if ok}


def _describe(s: Any) -> dict | None:
    """A saved sharding as JSON (NamedSharding and one device); None for others."""
    if isinstance(s, NamedSharding):
        return {
            "kind": "named",
            "devices": s.mesh.device_ids.tolist(),
            "axes": list(s.mesh.axis_names),
            "types": [t.name for t in s.mesh.axis_types],  # Explicit axes type the arrays
            "spec": [list(e) if isinstance(e, tuple) else e for e in s.spec.partitions],
            **({"reduced": sorted(s.spec.reduced)} if s.spec.reduced else {}),
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
    spec = spec.update(reduced=frozenset(desc.get("reduced", ())))
    types = tuple(AxisType[t] for t in desc.get("types", ())) or None  # older saves: Auto
    return NamedSharding(Mesh(devs, tuple(desc["axes"]), axis_types=types), spec)


def _default_sharding() -> Sharding:
    if jax.process_count() > 1:
        return replicated_sharding(data_mesh())
    return SingleDeviceSharding(jax.devices()[0])


class _Prepared(NamedTuple):
    arrays: dict  # nested dict of strings -> arrays, what orbax writes (may be empty)
    meta: dict  # JSON


def _flat(tree: Any, arg: str) -> list[tuple[tuple[str, ...], str, Any]]:
    """``(orbax key, key path, leaf)`` per leaf; raises on key collisions."""
    out = [(_key(p), keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    seen: dict[tuple[str, ...], str] = {}
    for key, name, _ in out:
        if (first := seen.setdefault(key, name)) != name:
            raise CheckpointError(
                f"`{arg}` leaves {first} and {name} have the same key "
                f"{'/'.join(key)} once written as strings: rename one of them."
            )
    return out


_LONG_DOUBLES = {np.dtype(np.longdouble), np.dtype(np.clongdouble)} - {
    np.dtype(np.float64),
    np.dtype(np.complex128),
}  # float128 / complex256 where the platform has them: orbax writes neither


def _leaf_problem(x: Any) -> str | None:
    if is_tracer(x):
        return "a tracer (checkpoints are written outside jit)"
    if isinstance(x, jax.Array) and x.is_deleted():
        return "deleted or donated"
    if unreduced := getattr(getattr(getattr(x, "sharding", None), "spec", None), "unreduced", 0):
        return f"unreduced over {sorted(unreduced)} (the sum of its copies): reduce it in the step"
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, *PY_SCALARS)):
        return f"{type(x).__name__} (only arrays, Python numbers and None)"
    if isinstance(x, (np.ndarray, np.generic)) and not is_host_value(x):
        return f"numpy array of dtype {x.dtype} (only numeric and bool arrays)"
    if isinstance(x, (np.ndarray, np.generic)) and x.dtype in _LONG_DOUBLES:
        return f"dtype {x.dtype} (orbax cannot write long doubles: cast it to float64/complex128)"
    return None


def prepare(tree: Any, arg: str = "tree") -> _Prepared:
    """Check ``tree``'s leaves and build what orbax writes plus jaxdev's metadata."""
    beat("checkpoint")  # every save starts here: progress for the hang watchdog
    flat = _flat(tree, arg)
    bad = [f"{name}: {why}" for _, name, x in flat if (why := _leaf_problem(x))]
    if bad:
        raise CheckpointError(join_failures(f"`{arg}` has leaves that cannot be saved:", bad))
    leaves = [jax.random.key_data(x) if is_prng_key(x) else x for _, _, x in flat]
    local = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_fully_addressable]
    local = local if jax.process_count() > 1 else []
    for i in local:  # orbax writes global arrays: this process's copy, replicated
        leaves[i] = place_tree(leaves[i], replicated_sharding(data_mesh()), copy=True, arg=arg)
    stacked = _find_stacked(leaves)
    entries: list[dict] = []
    written: dict[tuple[str, ...], tuple[dict, Any]] = {}
    for i, ((key, name, leaf), x) in enumerate(zip(flat, leaves)):
        entry: dict[str, Any] = {"key": list(key), "path": name}
        entries.append(entry)
        if isinstance(leaf, PY_SCALARS) and not isinstance(leaf, np.generic):  # np.float64 too
            entry.update(kind="scalar", type=type(leaf).__name__, value=_scalar_json(leaf))
            continue
        if is_prng_key(leaf):
            entry.update(key_impl=str(jax.random.key_impl(leaf)), key_shape=list(leaf.shape))
        if i in stacked:
            entry["stacked"] = {"n": x.shape[0], "devices": [d.id for d in stacked[i].devices.flat]}
            x = unstack_from_pmap(x)
        if isinstance(x, np.generic):  # written as a 0-d array, read back as a numpy scalar
            x, entry["item"] = np.asarray(x), True
        entry.update(
            kind="jax" if isinstance(x, jax.Array) else "numpy",
            shape=list(np.shape(x)),
            dtype=str(np.dtype(x.dtype)),
            sharding=_describe(x.sharding) if isinstance(x, jax.Array) else None,
        )
        if np.size(x) == 0:
            entry["empty"] = True  # no bytes: the metadata says it all
        else:
            written[key] = (entry, without_reduced(x) if isinstance(x, jax.Array) else x)
    for (entry, _), s in zip(written.values(), checksums([x for _, x in written.values()])):
        entry["checksum"] = s
    mine = [entries[i] for i in local]  # saved when every process holds the same bits
    _agree(
        "local",
        {e["path"]: ((e["shape"], e.get("checksum")), hex(e.get("checksum", 0))) for e in mine},
        f"`{arg}` has leaves held by each process separately whose values differ across "
        "processes, so no single value can be saved (checksums):",
    )
    arrays = orbax().tree.from_flat_dict({k: x for k, (_, x) in written.items()})
    return _Prepared(arrays, {"leaves": entries, "skeleton": _skeleton(tree, itertools.count())})


def _scalar_json(x: Any) -> Any:
    if isinstance(x, complex):
        return [repr(x.real), repr(x.imag)]
    if isinstance(x, float):
        return repr(x)  # exact, and inf / nan survive
    return x


def _scalar_value(kind: str, value: Any) -> Any:
    """A saved Python scalar; kinds ``float64`` / ``complex128`` are numpy scalars that
    earlier jaxdev saved as Python ones, in numpy's repr (``np.float64(0.1)``)."""
    num = lambda v: float(v.removeprefix("np.float64(").removesuffix(")"))  # noqa: E731
    if kind in ("complex", "complex128"):
        value = complex(num(value[0]), num(value[1]))
    elif kind in ("float", "float64"):
        value = num(value)
    types = {"float64": np.float64, "complex128": np.complex128}
    return {"bool": bool, "int": int, "float": float, "complex": complex, **types}[kind](value)


def check_step(step: Any) -> int:
    """``step`` as an int: a non-negative int, numpy integer or 0-d integer array, not a bool."""
    value = step
    if isinstance(step, (jax.Array, np.ndarray)) and jnp.issubdtype(step.dtype, jnp.integer):
        value = int(step) if step.ndim == 0 else step
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise UsageError(
            f"`step` must be a non-negative int (a numpy integer or 0-d integer array too), "
            f"got {step!r} ({type(step).__name__})."
        )
    return int(value)


def check_durable(durable: Any) -> bool:
    """``durable`` as a bool; UsageError for anything else (None, 0, 'no' read as a choice)."""
    if not isinstance(durable, (bool, np.bool_)):
        got = f"{durable!r} ({type(durable).__name__})"
        raise UsageError(f"`durable` must be True or False, got {got}.")
    return bool(durable)


def _digest(meta: dict) -> str:
    """SHA-256 of the metadata without its digest (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def composite(prepared: _Prepared, step: int | None, metrics: _Prepared | None) -> Any:
    """The orbax args of one checkpoint: array items (if any) and the JSON metadata."""
    ocp = orbax()
    meta: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step}
    items = {}
    for name, part in ((STATE, prepared), (METRICS, metrics)):
        if part is None:
            continue
        meta[name] = part.meta
        if part.arrays:  # orbax refuses an empty item ("Found empty item")
            items[name] = ocp.args.PyTreeSave(part.arrays)
    meta = json.loads(json.dumps(meta))  # what JSON gives back, digested as such
    meta["digest"] = _digest(meta)
    items[META] = ocp.args.JsonSave(meta)
    return ocp.args.Composite(**items)


def write_error(
    path: Any, err: BaseException, *, previous: str, need: int | None = None
) -> CheckpointError:
    """A failed write as a CheckpointError; ``previous`` says what became of the old state. A
    full disk (ENOSPC, here or in an error it chains) is named with ``need`` and the free space."""
    why = f"{type(err).__name__}: {err}"
    hint = ""
    if _no_space(err):
        hint = f" The disk is full{_space(str(path), need)}: free space or write elsewhere."
    elif isinstance(err, PermissionError) or (
        isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EROFS, errno.EPERM)
    ):
        hint = " The directory is not writable: fix its permissions or write elsewhere."
    return CheckpointError(
        f"Could not write the checkpoint {path}: {why}.{hint} Nothing was committed: "
        f"{previous}, and the state in memory is unchanged."
    )


def _no_space(err: BaseException | None) -> bool:
    """ENOSPC in ``err`` or an error it chains: its errno, or tensorstore's message."""
    for _ in range(8):
        if err is None:
            return False
        if getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _space(path: str, need: int | None) -> str:
    """`` (the arrays take N before compression; M free in DIR)``: what is known."""
    known = [] if need is None else [f"the arrays take {human_bytes(need)} before compression"]
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    with contextlib.suppress(OSError):
        known.append(f"{human_bytes(shutil.disk_usage(path).free)} free in {path}")
    return f" ({'; '.join(known)})" if known else ""


def nbytes(*parts: _Prepared | None) -> int:
    """The bytes of the arrays that ``parts`` write (before orbax compresses them)."""
    return sum(x.nbytes for p in parts if p is not None for x in jax.tree.leaves(p.arrays))


def take_writer_lock(lock_path: str, what: str) -> files.WriterLock:
    """The one-writer lock of ``what``: process 0 takes it, every process raises if it failed."""
    lock = files.WriterLock(lock_path, what)
    problem = ""
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except CheckpointError as err:
            problem = str(err)
        except OSError as err:
            problem = str(write_error(what, err, previous="nothing was changed"))
    problem = exchange("checkpoint/lock", problem)[0]
    if problem:
        lock.release()
        raise CheckpointError(problem)
    return lock


@_timeline.span("checkpoint")  # a step meter's checkpoint share: the save's own time
def save(
    path: Any, tree: Any, *, step: int | None = None, overwrite: bool = False, durable: bool = True
) -> None:
    """Write ``tree`` to the checkpoint directory ``path`` (blocking), whatever its layout.

    Every process of a multi-process run calls it with the same tree (each
    writes its own shards). The directory appears only when complete; with
    ``overwrite=True`` the new checkpoint is written beside the old one and
    swapped in atomically: a failed or killed save leaves the old one at ``path``.
    With ``durable`` every file and folder is fsynced before the rename that
    commits it and before the old one is deleted: a power cut leaves the old
    checkpoint or the new one, complete.

    Args:
      path: a directory that does not exist yet (or, with ``overwrite``, a
        jaxdev checkpoint or an empty folder).
      tree: a pytree of ``jax.Array`` (typed PRNG keys included), numpy
        arrays, Python numbers and None.
      step: a step number to record, a non-negative int (read back with
        :func:`checkpoint_step`).
      overwrite: replace the jaxdev checkpoint at ``path``.
      durable: fsync what is written (``False``: faster, safe against a killed
        process but not a power cut).

    Raises:
      CheckpointError: as README's table says (the old checkpoint is unchanged).
      UsageError: ``step`` is not a non-negative int.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxdev
      >>> d = tempfile.mkdtemp()
      >>> jaxdev.save(f"{d}/ckpt", {"w": jnp.ones(3), "n": 7}, step=7)
      >>> jaxdev.save(f"{d}/ckpt", {"w": jnp.zeros(3), "n": 8}, step=8, overwrite=True)
      >>> jaxdev.restore(f"{d}/ckpt")
      {'n': 8, 'w': Array([0., 0., 0.], dtype=float32)}
    """
    path = os.path.realpath(os.fsdecode(path))  # a link: its target is what is replaced
    durable = check_durable(durable)
    prepared = prepare(tree)
    args = composite(prepared, None if step is None else check_step(step), None)
    lock = take_writer_lock(files.sibling(path, "lock"), f"Checkpoint {path}")  # process 0's
    try:
        refusal = ""
        if jax.process_index() == 0:
            if owner := files.holder(os.path.join(os.path.dirname(path), MANAGER_LOCK)):
                refusal = (
                    f"Cannot save {path}: its folder {os.path.dirname(path)} is being written by "
                    f"a jaxdev.Checkpointer ({owner}), which numbers and deletes the checkpoints "
                    "there. Save through that Checkpointer, or write elsewhere."
                )
            else:
                files.recover(path)
        if refusal and jax.process_count() == 1:
            raise CheckpointError(refusal)
        # every process hears process 0's refusal, and looks at `path` after its repair
        _agree("checked", {"refused": (bool(refusal), refusal or "no")}, f"Cannot save {path}:")
        exists = os.path.lexists(path)
        if exists and not overwrite:
            raise CheckpointError(
                f"Checkpoint path {path} already exists: pass `overwrite=True` or choose a new "
                "path (`jaxdev.Checkpointer` numbers its checkpoints by step)."
            )
        target, previous = path, f"no checkpoint was created at {path}"
        if exists:
            files.check_replaceable(path)
            target = files.sibling(path, "new")
            previous = f"the previous checkpoint at {path} is intact"
        if jax.process_index() == 0:
            files.remove_leftovers(path)
        _agree("cleaned", {}, "")  # a barrier: every process waits for the cleanup
        _write(target, args, previous, nbytes(prepared), durable)
        if exists:
            if jax.process_index() == 0:
                try:
                    files.replace(target, path, durable)
                except OSError as err:
                    raise write_error(path, err, previous=previous) from err
            _agree("replaced", {}, "")
    finally:
        lock.release()


def handler_options() -> Any:
    """Orbax's options for jaxdev: item folders made before any array is written (else orbax
    0.12.8's writer threads wait for a "directory created" signal that a save failing first
    never sends, holding the exit for 5 minutes)."""
    return orbax().AsyncOptions(create_directories_asynchronously=False)


def _write(path: str, args: Any, previous: str, need: int, durable: bool) -> None:
    ocp = orbax()
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(async_options=handler_options())
    )
    try:
        with ocp.Checkpointer(handler, temporary_path_class=files.path_class(ocp, durable)) as c:
            c.save(path, args=args)
    except (OSError, ValueError, RuntimeError) as err:
        raise write_error(path, err, previous=previous, need=need) from err


def read_meta(path: str, reader: Callable[[Any], Any]) -> dict:
    beat("checkpoint")  # every restore starts here: progress for the hang watchdog
    ocp = orbax()
    if not os.path.isdir(path):
        left = ", ".join(files.leftovers(path))
        note = (
            f"{left} beside it was left by an interrupted save and is not restored: it may hold "
            f"a checkpoint that was deleted from {path} (move it there yourself to restore it). "
            if left
            else ""
        )
        raise CheckpointError(
            f"No checkpoint at {path}: the directory does not exist. {note}" + _steps_hint(path)
        )
    if not os.path.isdir(os.path.join(path, META)):
        raise CheckpointError(
            f"{path} is not a jaxdev checkpoint (no `{META}` item inside). " + _steps_hint(path)
        )
    try:
        meta = reader(args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as err:  # orbax raises many types on a damaged file
        raise Damaged(
            f"Could not read the metadata of checkpoint {path} ({type(err).__name__}: {err}): "
            "the checkpoint is damaged or was written by something else."
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a jaxdev checkpoint (unknown metadata format).")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise Damaged(_damaged(path, f"its format version is {version!r}"))
    if version > VERSION:
        raise CheckpointError(
            f"Checkpoint {path} has format version {version}, newer than this "
            f"jaxdev reads ({VERSION}): upgrade jaxdev."
        )
    if problem := digest_problem(meta):
        raise Damaged(_damaged(path, problem))
    item = meta.get(STATE)
    if not isinstance(item, dict) or not isinstance(item.get("leaves"), list):
        raise Damaged(_damaged(path, f"it has no `{STATE}` leaf table"))
    return meta


def digest_problem(meta: Any) -> str | None:
    """Why the jaxdev metadata ``meta`` is damaged (its digest), None if it is not."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return "it is not jaxdev's metadata"
    version = meta.get("version")
    if isinstance(version, int) and version > VERSION:
        return None  # a newer jaxdev's: restore says to upgrade
    if (version != 1 or "digest" in meta) and meta.get("digest") != _digest(meta):
        return (
            "its SHA-256 digest does not match its contents (a changed step, Python value, "
            "shape or checksum)"
        )
    return None


def _damaged(path: str, why: str) -> str:
    return f"The metadata of checkpoint {path} is damaged: {why}. Restore an earlier checkpoint."


def _agree(tag: str, table: dict[str, tuple[Any, str]], header: str) -> None:
    """Several processes: raise ``header`` and, per entry ``name: (value, shown)`` of ``table``
    whose value differs between them, every process's ``shown`` (an empty table: a barrier)."""
    if jax.process_count() == 1:
        return
    sent = exchange(f"checkpoint/{tag}", json.dumps(table, sort_keys=True))
    seen = [json.loads(t) if t[:1] == "{" else {"digest": [t, t]} for t in sent]  # t: a digest
    gone = [None, "<missing>"]
    bad = [
        f"{name}: " + ", ".join(f"process {p}: {t.get(name, gone)[1]}" for p, t in enumerate(seen))
        for name in sorted(set().union(*seen))
        if len({json.dumps(t.get(name, gone)[0]) for t in seen}) > 1
    ]
    if bad:
        raise CheckpointError(join_failures(header, bad))


def _steps_hint(path: str) -> str:
    parent = path if os.path.isdir(path) else os.path.dirname(path)
    if steps := sorted(int(n) for n in files.matching(parent, "[0-9]+")):
        return (
            f"{parent} holds numbered checkpoints (steps {steps[:10]}): restore one of "
            f"those (e.g. {os.path.join(parent, str(steps[-1]))}) or use "
            "`jaxdev.Checkpointer(directory).restore()`."
        )
    return "Check the path."


class _Want(NamedTuple):
    """What one leaf should become."""

    kind: str  # "jax" | "numpy" | "pytype" (target is a Python number)
    sharding: Sharding | None
    shape: tuple[int, ...] | None  # None: as saved
    dtype: Any  # None: as saved
    key_impl: str | None = None  # wrap the read uint32 data as typed PRNG keys of this impl
    item: bool = False  # a numpy scalar (the 0-d array's item), not a 0-d array


def _resolve(path: str, entries: list[dict], skeleton: Any, target: Any, rules: Any, what: str):
    """Per saved leaf a :class:`_Want`, and how to build the tree from the leaves: every target
    becomes a tree like the saved one (a sharding per array: where saved, the target's, or the
    rules'; scalars as saved), then read leaf by leaf."""
    if rules is not None:
        ruled = iter(_ruled(path, entries, skeleton, target, *rules))
        leaves = [_as_saved(e, None) if _on_host(e) else next(ruled) for e in entries]
        target = _rebuild(skeleton, leaves)
    elif target is None or isinstance(target, (Sharding, Mesh, jax.Device, str, int)):
        try:
            common = None if target is None else as_sharding(target)
        except Exception as err:
            raise CheckpointError(
                f"Cannot restore checkpoint {path} onto `target` {target!r}: {err}"
            ) from err
        target = _rebuild(skeleton, [_as_saved(e, common) for e in entries])
    kinds = (Sharding, Mesh, jax.Device, jax.ShapeDtypeStruct)
    is_leaf = lambda x: isinstance(x, kinds)  # noqa: E731
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
    saved = {tuple(e["key"]): i for i, e in enumerate(entries)}
    asked = {_key(p): (keystr(p), leaf) for p, leaf in pairs}
    missing = [(name, leaf) for k, (name, leaf) in asked.items() if k not in saved]
    extra = [e for e in entries if tuple(e["key"]) not in asked]
    if missing or extra:
        lines = [f"{n}: in `target` ({_asked_text(x)}), not in the checkpoint" for n, x in missing]
        lines += [
            f"{e['path']}: in the checkpoint ({_saved_text(e)}), not in `target`" for e in extra
        ]
        head = (
            f"Checkpoint {path} ({what}) and `target` have different leaves "
            "(restore with `target=None` to see what was saved, or fix the target):"
        )
        raise CheckpointError(join_failures(head, lines))
    order = [saved[k] for k in asked]
    wants = [_want_of(e, asked[tuple(e["key"])][1]) for e in entries]
    return wants, lambda leaves: jax.tree_util.tree_unflatten(treedef, [leaves[i] for i in order])


def _on_host(e: dict) -> bool:
    """A Python or numpy scalar: restored as saved, whatever the target."""
    return e["kind"] == "scalar" or e.get("item", False)


def _as_saved(e: dict, common: Sharding | None) -> Any:
    """A target leaf asking ``e`` as saved, its arrays on ``common`` (None: where saved)."""
    if e["kind"] == "scalar":
        return _scalar_value(e["type"], e["value"])
    if e.get("item"):
        return np.zeros((), e["dtype"])[()]
    if common is not None:
        return common
    return _where_saved(e) or np.broadcast_to(np.zeros((), e["dtype"]), e["shape"])  # no copy


def _where_saved(e: dict) -> Sharding | None:
    """A saved jax.Array's sharding here: where it was (a stacked leaf: in the pmap layout)
    if those devices exist, else the default."""
    if e["kind"] != "jax":
        return None
    desc = e.get("sharding")
    if e.get("stacked") and desc is not None:  # its rows split over the devices it was on
        devices, axes = e["stacked"]["devices"], [DEFAULT_AXIS]
        desc = {"kind": "named", "devices": devices, "axes": axes, "spec": axes}
    return _saved_sharding(desc) or _default_sharding()


def _full_shape(e: dict) -> tuple[int, ...]:
    """The shape the leaf had when saved (a stacked leaf was written as one row)."""
    rows = (e["stacked"]["n"],) if e.get("stacked") else ()
    return (*rows, *e["shape"])


RULE_OPTIONS = ("min_size", "fsdp_axis", "logical_axis_rules", "indivisible")


def rule_set(rules: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """``(rules, options)`` for :func:`_ruled` (None: no rules); options named as
    :func:`jaxdev.param_shardings` names them, and only with ``rules``."""
    for name in options:
        if name not in RULE_OPTIONS:
            raise UsageError(
                f"`{name}` is not an option of restore: it takes the rule options of "
                f"jaxdev.param_shardings ({', '.join(RULE_OPTIONS)}), with `rules`."
            )
    if rules is None and options:
        raise UsageError(
            f"`{next(iter(options))}` applies with `rules` only (restore onto a Mesh with "
            "rules=...): pass the rules the state was placed with, or drop the option."
        )
    return None if rules is None else (rules, options)


def _ruled(path: str, entries: list[dict], skeleton: Any, mesh: Any, rules: Any, options) -> list:
    """The shardings ``rules`` (with ``options``) give the saved arrays on ``mesh``."""
    from .._rules import state_shardings

    if not isinstance(mesh, Mesh):
        raise CheckpointError(
            f"Restoring checkpoint {path} with `rules={rules!r}` needs `target` to be the "
            f"Mesh the rules refer to, got {type(mesh).__name__}."
        )
    shapes = [
        None if _on_host(e) else jax.ShapeDtypeStruct(_full_shape(e), np.dtype(e["dtype"]))
        for e in entries
    ]  # typed keys are ruled as their uint32 data
    try:
        shardings = state_shardings(_rebuild(skeleton, shapes), mesh, rules, **options)
    except Exception as err:
        raise CheckpointError(
            f"Cannot restore checkpoint {path} with rules {rules!r} on {mesh}: {err}"
        ) from err
    return jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))


def _saved_text(e: dict) -> str:
    return f"Python {e['type']}" if e["kind"] == "scalar" else f"{e['dtype']}{e['shape']}"


def _asked_text(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype)}{list(x.shape)}"
    return type(x).__name__


def _want_of(e: dict, leaf: Any) -> _Want:
    if is_prng_key(leaf):  # a typed key target: read its uint32 data, then wrap
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        s = getattr(leaf, "sharding", None)
        s = s if isinstance(s, Sharding) else _where_saved(e)
        impl = str(jax.random.key_impl(leaf)) if isinstance(leaf, jax.Array) else _sds_impl(e, leaf)
        return _Want("jax", s, data.shape, np.dtype(data.dtype), impl)
    if isinstance(leaf, np.ndarray | np.generic):  # first: np.float64 is a Python float too
        item = isinstance(leaf, np.generic)
        return _Want("numpy", None, np.shape(leaf), np.dtype(leaf.dtype), item=item)
    if isinstance(leaf, PY_SCALARS):
        return _Want("pytype", None, None, type(leaf))
    if isinstance(leaf, (Sharding, jax.Device, Mesh)):
        shape = _full_shape(e) if e.get("stacked") else None
        return _Want("jax", as_sharding(leaf), shape, None, e.get("key_impl"))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        s = leaf.sharding if isinstance(leaf.sharding, Sharding) else None
        return _Want("jax", s or _where_saved(e), leaf.shape, np.dtype(leaf.dtype))
    if isinstance(leaf, jax.Array):
        return _Want("jax", leaf.sharding, leaf.shape, np.dtype(leaf.dtype))
    raise CheckpointError(
        f"`target` leaf {e['path']} is a {type(leaf).__name__}: give an array, a "
        "ShapeDtypeStruct, a Sharding, a Mesh, a Device or a Python number."
    )


def _sds_impl(e: dict, leaf: Any) -> str:
    """The PRNG implementation of a ShapeDtypeStruct of typed keys: the saved one, if it matches."""
    impl = e.get("key_impl")
    if impl is None or str(jax.random.key(0, impl=impl).dtype) != str(leaf.dtype):
        saved = f"typed keys {impl}" if impl else f"{e['dtype']}{e['shape']} (raw key data?)"
        raise CheckpointError(
            f"`target` leaf {e['path']} asks typed keys {leaf.dtype}, the checkpoint holds "
            f"{saved}: give a key array of the implementation you want as the target leaf."
        )
    return impl


class _Read(NamedTuple):
    """How one array leaf is read: onto ``sharding`` (None: numpy), then stacked or not."""

    sharding: Sharding | None
    stack: bool = False  # broadcast onto the target's leading device axis (its sharding)
    empty: bool = False  # a zero-size array: nothing to read, built from the metadata


def _plan(path: str, entries: list[dict], wants: list[_Want], what: str) -> list[_Read | None]:
    reads: list[_Read | None] = []
    bad = []
    for e, w in zip(entries, wants):
        reads.append(None)
        if e["kind"] == "scalar":
            if w.kind in ("jax", "numpy") and w.shape not in (None, ()):
                bad.append(f"{e['path']}: saved a Python {e['type']}, asked shape {w.shape}")
                continue
            value = _scalar_value(e["type"], e["value"])
            try:
                _cast(value, w)
            except CheckpointError as err:
                bad.append(
                    f"{e['path']}: saved the Python {e['type']} {value!r}, {err}; restore it onto "
                    "a Python number or a wider dtype"
                )
            continue
        saved_shape, saved_dtype, empty = tuple(e["shape"]), np.dtype(e["dtype"]), "empty" in e
        if w.kind == "pytype":
            if saved_shape == ():  # cast exactly once read (_finish)
                reads[-1] = _Read(None)
            else:
                bad.append(
                    f"{e['path']}: saved an array {saved_dtype}{list(saved_shape)}, asked a "
                    f"Python {w.dtype.__name__}"
                )
            continue
        if w.dtype is not None and np.dtype(w.dtype) != saved_dtype:
            bad.append(f"{e['path']}: saved dtype {saved_dtype}, asked {np.dtype(w.dtype)}")
        elif w.kind == "jax" and jax.dtypes.canonicalize_dtype(saved_dtype) != saved_dtype:
            bad.append(
                f"{e['path']}: saved dtype {saved_dtype}, and a jax.Array holds "
                f"{jax.dtypes.canonicalize_dtype(saved_dtype)} with jax_enable_x64 off (x64 "
                f"{'on' if x64() else 'off'}): restore it onto a numpy target leaf (np.ndarray "
                "or numpy dtype), or enable x64"
            )
        shape = saved_shape if w.shape is None else tuple(w.shape)
        stack = shape[1:] == saved_shape and len(shape) == len(saved_shape) + 1
        if shape != saved_shape and not stack:
            bad.append(f"{e['path']}: saved shape {saved_shape} ({saved_dtype}), asked {shape}")
        if w.kind == "numpy":
            reads[-1] = _Read(None, stack, empty)
            continue
        shape = shape if stack else saved_shape
        if problem := _indivisible(w.sharding, shape):
            bad.append(f"{e['path']}: shape {shape} cannot be split by {problem}")
        reads[-1] = _Read(_stack_source(w.sharding) if stack else w.sharding, stack, empty)
    if bad:
        head = f"Checkpoint {path} ({what}) cannot be restored onto `target`:"
        raise CheckpointError(join_failures(head, bad))
    return reads


def _cast(value: Any, w: _Want, python: str = "") -> Any:
    """A scalar ``value`` as ``w`` asks, exactly; CheckpointError saying what it asked if not."""
    to = w.dtype if w.kind == "pytype" or w.dtype is None else np.dtype(w.dtype)
    to = jax.dtypes.canonicalize_dtype(np.asarray(value).dtype) if to is None else to
    name = f"{python}{to.__name__}" if isinstance(to, type) else str(to)
    head = f"asked {name}, which cannot hold it exactly"
    try:
        with np.errstate(all="ignore"):
            cast = to(value) if isinstance(to, type) else np.asarray(value, to)
    except (OverflowError, TypeError, ValueError) as err:
        raise CheckpointError(f"{head} ({err})") from err
    back = cast.item() if isinstance(cast, np.ndarray) else cast
    same = back == value or (back != back and value != value)  # nan stays nan
    if not same or (isinstance(value, complex) and not isinstance(back, complex) and value.imag):
        raise CheckpointError(f"{head} (it would become {back!r})")
    return cast


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
        return replicated_sharding(s.mesh)
    devs = tuple(sorted(s.device_set, key=lambda d: d.id))
    return replicated_sharding(mesh_of(devs, DEFAULT_AXIS))


def _orbax_restore(path, reader, item, entries, reads, what):
    ocp = orbax()
    todo = {tuple(e["key"]): (e, r.sharding) for e, r in zip(entries, reads) if r and not r.empty}
    if not todo:
        return []

    def args(e: dict, sharding: Sharding | None) -> tuple[Any, Any]:
        shape, dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        if sharding is None:
            abstract = jax.ShapeDtypeStruct(shape, dtype) if shape else np.zeros((), dtype)
            return abstract, ocp.RestoreArgs(restore_type=np.ndarray)
        abstract = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return abstract, ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)

    def read(keys: Sequence[tuple[str, ...]], on: Any = _TARGET, **options: Any) -> Any:
        got = {k: args(todo[k][0], todo[k][1] if on is _TARGET else on) for k in keys}
        one = ocp.args.PyTreeRestore(
            ocp.tree.from_flat_dict({k: a for k, (a, _) in got.items()}),
            restore_args=ocp.tree.from_flat_dict({k: r for k, (_, r) in got.items()}),
            **options,
        )
        return ocp.tree.to_flat_dict(reader(args=ocp.args.Composite(**{item: one}))[item])

    try:
        out = read(list(todo))
    except Exception as err:  # a damaged or truncated data file
        if is_resource_exhausted(err):  # not damage: explained by restore_item
            raise
        failure = f"{type(err).__name__}: {short(str(err), 400)}"
        _quiet_abandoned_reads()  # its frames hold orbax's abandoned reads, let go on leaving
    else:
        return [out[k] for k in todo]
    broken = [e for e, _ in todo.values() if _fails(read, e)]
    names = [e["path"] for e in broken[:10]]
    shown = f", leaves {', '.join(names)}" + (" ..." if len(broken) > 10 else "")
    one = SingleDeviceSharding(jax.local_devices()[0])  # orbax reads its array metadata then
    if broken and not any(_fails(read, e, None) or _fails(read, e, one) for e in broken):
        raise CheckpointError(  # they read whole on the host and on a device: the target's fault
            f"Could not read checkpoint {path} ({what}){shown} onto `target`: {failure}. The "
            "checkpoint is intact (these leaves read whole on the host and on one device): fix "
            "the target's shardings."
        )
    raise Damaged(
        f"Could not read checkpoint {path} ({what}){shown if broken else ''}: {failure}. The "
        "checkpoint is damaged or incomplete: restore an earlier one."
    )


_ABANDONED = ("_get_array_metadatas", "_read_array_index_and_device_put")  # orbax 0.12


def _quiet_abandoned_reads() -> None:
    """Keep orbax's abandoned reads of a damaged checkpoint out of ``sys.unraisablehook``: orbax
    0.12.8 cannot cancel the reads it abandons when one fails, so a coroutine of orbax's
    collected with its error, and a tensorstore read completing on a loop orbax has closed
    ("Event loop is closed", from tensorstore's thread, at any later moment: 1 restore in 3 here)
    are reported as unraisable. The Damaged error reports that failure; only these two shapes are
    dropped, every other report goes to the hook in place before."""
    hook = sys.unraisablehook
    if getattr(hook, "jaxdev_quiet", False):
        return

    def quiet(u: Any) -> None:
        if not _abandoned_read(u):
            hook(u)

    quiet.jaxdev_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = quiet


def _abandoned_read(u: Any) -> bool:
    code = getattr(u.object, "cr_code", None)
    if code is not None:  # a coroutine of orbax's reads: run and left (its error), or never
        ocp = sys.modules.get("orbax.checkpoint")  # awaited (a read gathered with it failed)
        ran = inspect.getcoroutinestate(u.object) != inspect.CORO_CREATED
        return (
            ocp is not None
            and code.co_filename.startswith(os.path.dirname(ocp.__file__) + os.sep)
            and (ran or code.co_name in _ABANDONED)
        )
    closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
    return closed and any(  # tensorstore's read done after orbax closed the loop
        f.f_code.co_name == "call_soon_threadsafe"
        and any(type(a).__module__ == "tensorstore" for a in f.f_locals.get("args", ()))
        for f, _ in traceback.walk_tb(u.exc_value.__traceback__)
    )


_TARGET = object()  # _orbax_restore's read: each leaf on its target's sharding


def _fails(read: Callable[..., Any], e: dict, on: Any = _TARGET) -> bool:
    """Whether reading leaf ``e`` alone fails (to name the broken leaves after a failed read;
    ``on``: a sharding instead of the target's, ``None``: as numpy)."""
    try:
        read([tuple(e["key"])], on=on, partial_restore=True)
    except Exception:
        return True
    return False


def _verify(path: str, entries: list[dict], got: list[Any], version: int, what: str) -> None:
    """Compare each read array's checksum with the one written; raise naming the leaves."""
    live = [(i, x) for i, x in enumerate(got) if x is not None]
    if not live or not all("checksum" in entries[i] for i, _ in live):
        return
    fn = checksums if version >= 2 else legacy_checksums
    sums = fn([x.addressable_data(0) if _cpu_replicated(x) else x for _, x in live])
    bad = [
        f"{entries[i]['path']}: checksum {s:#x} read, {entries[i]['checksum']:#x} written"
        for (i, _), s in zip(live, sums)
        if s != entries[i]["checksum"]
    ]
    if bad:
        head = (
            f"Checkpoint {path} ({what}) is corrupted: these leaves read back different bits "
            "than were written (a damaged or overwritten data file). Restore an earlier "
            "checkpoint. Leaves:"
        )
        raise Damaged(join_failures(head, bad))


def _cpu_replicated(x: Any) -> bool:
    """A replicated array on several CPU devices: checked as its first copy, whole. Fake
    devices share the host's cores; a slice per device and an all-reduce took 2x as long."""
    s = getattr(x, "sharding", None)
    devices = s.device_set if s is not None and s.is_fully_replicated else ()
    return len(devices) > 1 and next(iter(devices)).platform == "cpu"


def _finish(path, entries, wants, reads, arrays, version, what) -> list[Any]:
    """Verify checksums, stack where asked, make scalars and keys; one value per saved leaf."""
    it = iter(arrays)
    got = [None if r is None or r.empty else next(it) for r in reads]
    _verify(path, entries, got, version, what)
    out = []
    for e, w, r, x in zip(entries, wants, reads, got):
        if e["kind"] == "scalar":
            value = _cast(_scalar_value(e["type"], e["value"]), w)
            if w.kind == "jax":
                value = jax.device_put(value, w.sharding)
            out.append(value[()] if w.item else value)
            continue
        if w.kind == "pytype":
            try:
                x = _cast(x.item(), w, "a Python ")
            except CheckpointError as err:
                raise CheckpointError(
                    f"Checkpoint {path} ({what}) cannot be restored onto `target`: {e['path']}: "
                    f"saved {e['dtype']} {x.item()!r}, {err}; restore it onto a numpy or wider "
                    "target leaf"
                ) from err
        if w.item:
            x = x[()]
        if r.empty:
            x = np.zeros(e["shape"], e["dtype"])
            x = x if r.sharding is None else jax.device_put(x, r.sharding)
        if r.stack and w.sharding is None:
            x = np.broadcast_to(x, (w.shape[0], *np.shape(x))).copy()
        elif r.stack:
            x = stacker(w.shape[0], w.sharding)([x])[0]
        if w.key_impl is not None and isinstance(x, jax.Array):
            x = jax.random.wrap_key_data(x, impl=w.key_impl)
        out.append(x)
    return out


def restore_item(path, reader, item, target, rules, what):
    """Restore the item ``item`` of the checkpoint at ``path`` (None if it was not saved)."""
    meta = read_meta(path, reader)
    if item not in meta:
        return None
    entries, skeleton = meta[item]["leaves"], meta[item]["skeleton"]
    wants, build = _resolve(path, entries, skeleton, target, rules, what)
    for w in {w.sharding for w in wants}:  # a target (mesh, sharding, tree on it): named
        refuse(f"restoring checkpoint {path} ({what})", w)
    for e, w in zip(entries, wants):  # the caller's error, before any read: never damage
        if e["kind"] == "scalar":
            saved = _scalar_value(e["type"], e["value"])
        else:
            saved = jax.ShapeDtypeStruct(e["shape"], e["dtype"])
        refuse_unreduced(w.sharding, "target", saved, lambda p=e["path"]: p)
    reads = _plan(path, entries, wants, what)
    step, digest = meta.get("step"), str(meta.get("digest"))
    _agree(
        "restore",
        {"restored": ((step, digest), f"step {step} of {path} (digest {digest[:12]})")},
        "The processes restore different checkpoints, so the replicas of one array would "
        "disagree: every process must restore the same step of the same checkpoint (same "
        "directory and step on a shared file system):",
    )
    with explained_oom(f"restore of {path} ({what})", lambda: {"target": target}):
        arrays = _orbax_restore(path, reader, item, entries, reads, what)
        return build(_finish(path, entries, wants, reads, arrays, meta.get("version", 1), what))


def restore(path: Any, target: Any = None, *, rules: Any = None, **rule_options: Any) -> Any:
    """Read the checkpoint at ``path`` onto ``target``, whatever layout it was saved in.

    Args:
      path: a checkpoint written by :func:`save` (or one step directory of a
        :class:`Checkpointer`).
      target: ``None`` (where saved), a device, spec, ``Sharding`` or ``Mesh``, a
        ``Mesh`` with ``rules``, or a tree like the saved one (README's table).
      rules: sharding rules, with a ``Mesh`` target.
      **rule_options: with ``rules``, :func:`jaxdev.param_shardings`'s ``min_size``,
        ``fsdp_axis``, ``logical_axis_rules`` and ``indivisible`` (a state placed with
        ``indivisible="replicate"`` restores with it).

    Returns:
      The restored tree.

    Raises:
      CheckpointError: no checkpoint at ``path``, a target it cannot fill (each leaf
        named, saved and asked) or a damaged checkpoint.

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
    path = os.path.realpath(os.fsdecode(path))
    ocp = orbax()
    rules = rule_set(rules, rule_options)

    def read(path: str) -> Any:
        if jax.process_index() == 0 and files.was_cut(path):  # a replacement cut between renames
            with (
                contextlib.suppress(CheckpointError),  # another writer: it recovers
                files.WriterLock(files.sibling(path, "lock"), f"Checkpoint {path}"),
            ):
                files.recover(path)
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            reader = functools.partial(ckptr.restore, path)
            return restore_item(path, reader, STATE, target, rules, "state")

    return read_unchanged(lambda: path, read)


def _identity(path: str) -> tuple[int, int, int] | None:
    """What tells the folder at ``path`` from one put there later (None: nothing there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def read_unchanged(locate: Callable[[], str], read: Callable[[str], Any], tries: int = 5) -> Any:
    """``read(locate())``, again while a writer replaced or deleted that checkpoint meanwhile: a
    reader racing a writer (``overwrite=True``, ``keep``) can mix old metadata and new arrays,
    so a failed read is repeated when the folder changed (or is missing while a writer holds
    its lock), never reported as damage."""
    for attempt in range(tries):
        path = locate()
        seen = _identity(path)
        try:
            return read(path)
        except (CheckpointError, OSError) as err:
            now = _identity(path)
            if now == seen and (now or not files.holder(files.sibling(path, "lock"))):
                raise
            last = err
        time.sleep(0.02 * attempt)
    raise CheckpointError(
        f"Checkpoint {path} changed while it was read, {tries} times in a row: a writer is "
        "saving over it (`overwrite=True`) or deleting it (a Checkpointer's `keep`). The "
        "checkpoint is not damaged: read it again when the writer pauses."
    ) from last


def checkpoint_step(path: Any) -> int | None:
    """Return the step recorded by :func:`save` at ``path`` (None if none was given).

    Raises:
      CheckpointError: no jaxdev checkpoint at ``path``.
    """
    path = os.path.realpath(os.fsdecode(path))
    ocp = orbax()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        return read_meta(path, functools.partial(ckptr.restore, path)).get("step")
