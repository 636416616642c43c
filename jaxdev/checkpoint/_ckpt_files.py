"""The files of a checkpoint: one writer, atomic replacement, only our own deletions.

One writer: :class:`WriterLock`, a ``flock`` the kernel drops when its process
dies. Atomic overwrite: :func:`replace`; a crash between its fallback's two
renames is the one state :func:`recover` repairs. Only jaxdev's reserved
names and orbax's temporary folders are ever deleted. Durable (a power cut):
:func:`sync` before every rename that commits and every deletion; the file
sizes in :data:`MANIFEST`, for :func:`damage` to check cheaply.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import weakref
from typing import Any

from .._errors import CheckpointError

_log = logging.getLogger("jaxdev")

META_ITEM = "jaxdev"  # the metadata item every jaxdev checkpoint holds
ITEMS = (META_ITEM, "state", "running_metrics")  # the items jaxdev writes
_ORBAX_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")  # orbax's own, at the top
TOMBSTONES = ".jaxdev-deleted"  # a Checkpointer's steps being deleted, inside its directory
_ORBAX_TMP = r"\.orbax-checkpoint-tmp(-[0-9]+)?"  # orbax's temporary folder: <final name><this>
_STEP = "(0|[1-9][0-9]*)"  # orbax's step names (its standard format: no prefix, no padding)
MANIFEST = os.path.join(META_ITEM, "files")  # {relative path: size} of the files orbax wrote
META_FILE = os.path.join(META_ITEM, "metadata")  # jaxdev's JSON metadata, with its digest
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def sibling(path: str, role: str) -> str:
    """The reserved name beside ``path`` for ``role``: ``.<name>.jaxdev-<role>``."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.jaxdev-{role}")


def is_checkpoint(path: str) -> bool:
    """True if ``path`` holds orbax's ``_CHECKPOINT_METADATA`` and jaxdev's ``jaxdev/metadata``."""
    return all(os.path.isfile(os.path.join(path, f)) for f in (META_FILE, _ORBAX_FILES[0]))


class WriterLock:
    """The one writer's exclusive, non-blocking lock: ``lock_path`` (removed on release);
    ``what`` is written, for the error message."""

    def __init__(self, lock_path: str, what: str) -> None:
        self.lock_path, self.what, self._fd = lock_path, what, None

    def acquire(self) -> WriterLock:
        os.makedirs(os.path.dirname(self.lock_path) or ".", exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise CheckpointError(
                    f"{self.what} is being written by another writer ({owner}; lock file "
                    f"{self.lock_path}). Two writers would mix their steps or destroy each "
                    "other's files, so this one is refused: wait for the other to finish "
                    "(close its Checkpointer), or write to another path."
                ) from None
            with contextlib.suppress(FileNotFoundError):  # the last holder removed it: retry
                if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        owner = (
            f"pid {os.getpid()} on {socket.gethostname()}, thread "
            f"{threading.current_thread().name!r}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        os.ftruncate(fd, 0)
        os.write(fd, owner.encode())
        self._fd = fd
        _HELD.add(self)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # remove, then unlock: a waiter re-checks the inode
            os.unlink(self.lock_path)
        os.close(self._fd)
        self._fd = None
        _HELD.discard(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()  # the locks this process holds


def _drop_in_child() -> None:
    """A forked child closes its copies of our lock fds, unlocking nothing (a ``flock`` belongs
    to the file description ``fork`` shares: kept, it outlived a SIGKILLed parent)."""
    for lock in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(lock._fd)
        lock._fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def holder(lock_path: str) -> str | None:
    """Who holds the writer lock ``lock_path`` now (its owner text), or None if nobody."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_owner(fd)
    finally:
        os.close(fd)  # also drops the shared lock, if taken
    return None


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "owner not yet recorded"


def check_replaceable(path: str) -> None:
    """Refuse to overwrite ``path`` unless it is a jaxdev checkpoint or an empty folder; never
    the working directory, one of its parents, the home directory or ``/``."""
    try:
        here = os.path.realpath(os.getcwd())
    except FileNotFoundError:  # the working directory was deleted: nothing of it to protect
        here = None
    home = os.path.realpath(os.path.expanduser("~"))
    what = {home: "the home directory", here: "the working directory"}.get(path)
    if what is None and here and os.path.commonpath([path, here]) == path:  # "/" among them
        what = "a parent of the working directory"
    if what is not None:
        raise CheckpointError(
            f"`path` {path} is {what}: `overwrite=True` would delete it and put a checkpoint "
            "in its place, so it is never replaced. Save into a subfolder (e.g. "
            f"{os.path.join(path, 'ckpt')})."
        )
    if not os.path.isdir(path):
        raise CheckpointError(
            f"`path` {path} exists and is a file, not a checkpoint: jaxdev never deletes "
            "what it did not write. Choose another path or remove it yourself."
        )
    names = sorted(os.listdir(path))
    ours = is_checkpoint(path)
    foreign = [n for n in names if n not in ITEMS and n not in _ORBAX_FILES]
    if not names or (ours and not foreign):
        return
    shown = foreign if ours else names
    listed = ", ".join(shown[:8]) + (f", ... ({len(shown)} entries)" if len(shown) > 8 else "")
    what = (
        f"is a jaxdev checkpoint that also holds files jaxdev did not write ({listed})"
        if ours
        else f"is a folder that is not a jaxdev checkpoint (it holds {listed})"
    )
    raise CheckpointError(
        f"`path` {path} {what}: `overwrite=True` replaces only a checkpoint that jaxdev "
        "wrote, never other files. Choose another path (e.g. a subfolder), or move those "
        "files yourself."
    )


def leftovers(path: str) -> list[str]:
    """What an interrupted save of ``path`` left beside it: ``.<name>.jaxdev-new``, ``-old``,
    and ``<name>`` or ``.<name>.jaxdev-new`` + ``.orbax-checkpoint-tmp[-<timestamp>]``."""
    parent, name = os.path.split(path)
    new, old = (re.escape(os.path.basename(sibling(path, r))) for r in ("new", "old"))
    return matching(parent, rf"{new}|{old}|({re.escape(name)}|{new}){_ORBAX_TMP}")


def lookalikes(directory: str, steps: set[int]) -> list[str]:
    """Names in ``directory`` that orbax's ``keep`` would delete instead of one of ``steps``:
    any ``<step>.orbax-checkpoint-tmp...`` but orbax's exact names."""
    names = matching(directory, rf"{_STEP}\.orbax-checkpoint-tmp(?s:.+)")
    own = rf"{_STEP}{_ORBAX_TMP}"
    return [n for n in names if int(n.split(".")[0]) in steps and not re.fullmatch(own, n)]


def matching(folder: str, pattern: str) -> list[str]:
    """The entries of ``folder`` whose whole name matches ``pattern`` ([] if unreadable)."""
    try:
        return sorted(n for n in os.listdir(folder or ".") if re.fullmatch(pattern, n))
    except OSError:
        return []


def remove_leftovers(path: str) -> None:
    """Delete what an interrupted save of ``path`` left beside it (:func:`leftovers` only)."""
    for n in leftovers(path):
        _log.info("removing %s, left by an interrupted save of %s", n, path)
        _remove(os.path.join(os.path.dirname(path), n))


def remove_tombstones(directory: str, folder: bool = True, durable: bool = True) -> None:
    """Finish deleting the steps ``keep`` dropped: orbax renamed them into ``.jaxdev-deleted``
    (with ``durable``, those renames are synced first: a power cut never brings one back cut).
    Only orbax's step names there are deleted; with ``folder`` (no save running) also
    ``.jaxdev-deleted`` if empty and killed saves' ``<step>.orbax-checkpoint-tmp``."""
    graves = os.path.join(directory, TOMBSTONES)
    if (steps := matching(graves, _STEP)) and durable:
        _fsync(graves)
        _fsync(directory)
    for n in steps:
        _remove(os.path.join(graves, n))
    if folder:
        with contextlib.suppress(OSError):
            os.rmdir(graves)
        for n in matching(directory, rf"{_STEP}{_ORBAX_TMP}"):
            _remove(os.path.join(directory, n))


def _remove(path: str) -> None:
    """Delete a folder of ours, or a link or file left under one of our names."""
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories atomically; False where the kernel or libc cannot, or it failed
    (then nothing changed: :func:`replace` goes on with two renames)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if os.environ.get("JAXDEV_CHECKPOINT_NO_EXCHANGE") == "1":  # tests of the fallback
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace(new: str, path: str, durable: bool = True) -> None:
    """Make the complete checkpoint ``new`` the one at ``path``; the old one is deleted last,
    after (``durable``) the swap is on disk. An ``OSError`` is raised only before ``new`` is at
    ``path``, the old one still there."""
    old = sibling(path, "old")
    if _exchange(new, path):
        old = new  # it now holds the old checkpoint
    else:
        os.rename(path, old)
        try:
            os.rename(new, path)  # a crash between the two renames: recover() puts one back
        except OSError:
            os.rename(old, path)
            raise
    if durable:
        _fsync(os.path.dirname(path))
    _remove(old)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync(path: str, parent: bool = False, deep: bool = True) -> None:
    """fsync every file and folder under ``path`` (each folder after its entries; not ``deep``:
    only its own files) and ``path``; with ``parent`` the folder holding it too."""
    for folder, _, names in os.walk(path, topdown=False):
        if deep or folder == path:
            for n in names:
                _fsync(os.path.join(folder, n))
            _fsync(folder)
    if parent:
        _fsync(os.path.dirname(path))


@functools.cache
def path_class(ocp: Any, durable: bool) -> type:
    """Orbax's atomic-rename temporary folder of a step, with the sizes of what orbax wrote in
    :data:`MANIFEST`; ``durable``: every file and folder synced before the rename that commits
    it, and the final folder (orbax writes ``commit_success.txt`` between) and its parent after."""

    class Checked(ocp.path.atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args: Any, **kwargs: Any) -> None:
            tmp = os.fspath(self.get())
            step = os.path.isdir(os.path.join(tmp, META_ITEM))  # not one item's folder
            if step:
                await asyncio.to_thread(_manifest, tmp, durable)
            await super().finalize(*args, **kwargs)
            if step and durable:  # below its top, nothing changed since _manifest's sync
                await asyncio.to_thread(sync, os.fspath(self.get_final()), True, False)

    return Checked


def _manifest(tmp: str, durable: bool) -> None:
    sizes = {
        os.path.relpath(p, tmp): os.path.getsize(p)
        for folder, _, names in os.walk(tmp)
        for p in [os.path.join(folder, n) for n in names]
        if folder != tmp  # orbax rewrites its top-level files in finalize
    }
    sizes.pop(META_FILE, None)  # its digest checks it (tests edit it)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(sizes, f)
    if durable:
        sync(tmp)


def damage(path: str) -> str | None:
    """What is damaged in the checkpoint at ``path``, None if nothing is. Cheap (no array data
    read): ``_CHECKPOINT_METADATA`` is JSON, each file the size :data:`MANIFEST` says (if any)."""
    loaded = {}
    for rel in (_ORBAX_FILES[0], MANIFEST):
        try:
            with open(os.path.join(path, rel), "rb") as f:
                loaded[rel] = json.loads(f.read())
        except FileNotFoundError:  # a checkpoint written before the manifest: none
            loaded[rel] = {}
        except (OSError, ValueError) as err:
            return f"{rel} does not parse ({type(err).__name__}: {err})"
    for rel, size in loaded[MANIFEST].items():
        try:
            got = f"{os.path.getsize(os.path.join(path, rel))} bytes"
        except OSError:
            got = "missing"
        if got != f"{size} bytes":
            return f"{rel} is {got}, {size} bytes written"
    return None


def was_cut(path: str) -> bool:
    """True in the one state :func:`recover` repairs, the fallback swap cut between its renames:
    ``path`` missing, ``.<name>.jaxdev-old`` there and a complete checkpoint at
    ``.<name>.jaxdev-new`` (only :func:`replace`'s first rename makes it; a save removes every
    leftover first). Any other leftover beside a missing ``path`` may be a checkpoint its user
    deleted after a crash: it is never put back."""
    return (
        not os.path.lexists(path)
        and os.path.lexists(sibling(path, "old"))
        and is_checkpoint(sibling(path, "new"))
    )


def recover(path: str) -> None:
    """If :func:`was_cut`, put the new checkpoint at ``path``; the old is the next save's."""
    if was_cut(path):
        os.rename(new := sibling(path, "new"), path)
        put = "a save of %s was cut between its two renames; put back %s (the new checkpoint)"
        _log.warning(put, path, os.path.basename(new))
