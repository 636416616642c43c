"""A crash at every point of every destructive checkpoint path (issue 25; DESIGN.md section 6).

The regression tests first: each failed before its fix (a deleted checkpoint
came back from a leftover beside it; a kill while ``keep`` deleted a step
blocked every later save; ``save`` deleted look-alike names).
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

import jaxdev
from jaxdev import CheckpointError
from jaxdev import _ckpt_files as files


class Killed(BaseException):
    """A simulated SIGKILL: no ``except Exception`` handler catches it."""


def _kill_at(monkeypatch, name: str, n: int) -> None:
    """The ``n``-th call of ``os.<name>`` from now on does its work, then the process 'dies'."""
    real, calls = getattr(os, name), []

    def call(*a, **kw):
        out = real(*a, **kw)
        calls.append(a)
        if len(calls) == n:
            raise Killed
        return out

    monkeypatch.setattr(os, name, call)


def _die(*_a, **_kw):
    raise Killed


@pytest.mark.parametrize("exchange", [True, False])
def test_a_deleted_checkpoint_is_never_brought_back(tmp_path, monkeypatch, exchange):
    """Killed right after an overwrite's swap, then the user deletes the path: it stays missing."""
    if not exchange:
        monkeypatch.setenv("JAXDEV_CHECKPOINT_NO_EXCHANGE", "1")
    path = tmp_path / "c"
    jaxdev.save(path, {"v": 1})
    monkeypatch.setattr(shutil, "rmtree", _die)  # killed as the old checkpoint's deletion starts
    with pytest.raises(Killed):
        jaxdev.save(path, {"v": 2}, overwrite=True)
    monkeypatch.undo()
    assert jaxdev.restore(path) == {"v": 2}
    shutil.rmtree(path)  # the user deletes the checkpoint
    [left] = [n for n in os.listdir(tmp_path) if "jaxdev-" in n and not n.endswith("lock")]
    said = rf"No checkpoint at {re.escape(str(path))}.*{re.escape(left)} .*is not restored"
    with pytest.raises(CheckpointError, match=said):
        jaxdev.restore(path)
    assert not path.exists()
    jaxdev.save(path, {"v": 3})  # a new first save cleans the leftover
    assert sorted(os.listdir(tmp_path)) == ["c"] and jaxdev.restore(path) == {"v": 3}


def test_a_kill_while_keep_deletes_a_step_blocks_no_later_save(tmp_path, monkeypatch):
    ckpt = jaxdev.Checkpointer(tmp_path, keep=1, async_=False)
    ckpt.save(1, {"w": np.ones(3)})
    _kill_at(monkeypatch, "unlink", 3)  # step 1 is being deleted
    with pytest.raises(Killed):
        ckpt.save(2, {"w": np.full(3, 2.0)})
    monkeypatch.undo()
    ckpt._lock.release()  # what the kernel does for a killed process
    with jaxdev.Checkpointer(tmp_path, keep=1, async_=False) as again:
        assert again.all_steps() == [2]
        assert again.save(3, {"w": np.full(3, 3.0)})
        assert again.restore()["w"].tolist() == [3.0] * 3
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_a_restart_removes_the_temporary_folder_of_a_killed_step(tmp_path, monkeypatch):
    ckpt = jaxdev.Checkpointer(tmp_path, keep=2, async_=False)
    ckpt.save(1, {"w": np.ones(3)})
    _kill_at(monkeypatch, "rename", 1)  # orbax is writing 2.orbax-checkpoint-tmp
    with pytest.raises(Killed):
        ckpt.save(2, {"w": np.full(3, 2.0)})
    monkeypatch.undo()
    ckpt._lock.release()  # what the kernel does for a killed process
    assert "2.orbax-checkpoint-tmp" in os.listdir(tmp_path)
    (tmp_path / "2.orbax-checkpoint-tmp-mine").mkdir()  # a look-alike name: not ours
    with jaxdev.Checkpointer(tmp_path, keep=2, async_=False) as again:
        assert again.save(3, {"w": np.full(3, 3.0)}) and again.all_steps() == [1, 3]
    assert sorted(os.listdir(tmp_path)) == ["1", "2.orbax-checkpoint-tmp-mine", "3"]


def test_save_removes_only_its_own_exact_leftover_names(tmp_path):
    path = tmp_path / "ckpt"
    jaxdev.save(path, {"v": 1})
    ours = [".ckpt.jaxdev-new", ".ckpt.jaxdev-old", "ckpt.orbax-checkpoint-tmp"]
    ours += ["ckpt.orbax-checkpoint-tmp-1712345678", ".ckpt.jaxdev-new.orbax-checkpoint-tmp"]
    theirs = [".ckpt.jaxdev-new-notes", ".ckpt.jaxdev-old.bak", "ckpt.orbax-checkpoint-tmp-mine"]
    theirs += ["ckpt.orbax-checkpoint-tmpx", ".ckpt.jaxdev-newer", "ckpt2.orbax-checkpoint-tmp"]
    for name in ours + theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text(name)
    jaxdev.save(path, {"v": 2}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *theirs])
    assert all((tmp_path / n / "notes.txt").read_text() == n for n in theirs)
    assert files.leftovers(str(path)) == []
