"""A power cut's damage, simulated file by file (issue 34; DESIGN.md section 6).

Every file of a committed checkpoint (a plain save, and a Checkpointer's step
with its metrics) is truncated to half and to zero length, one at a time, in a
fresh copy: restore never gives garbage (a CheckpointError, or the exact tree
when the file is one restore does not read: orbax's top-level files, the
per-process ocdbt files merged into the item's own), a Checkpointer falls back
to the step before and says so, refuses the damaged step by name, and its
next save's ``keep`` never deletes that last good step. The crash points
replayed as power cuts: tests/test_crash_points.py.
"""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest

import jaxdev
from jaxdev import Checkpointer, CheckpointError


def _tree(i: int) -> dict:
    return {"w": np.arange(64, dtype=np.float32) * i, "b": np.full(3, i, np.int32), "i": i}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), b[k]) for k in a)


def _files(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names
    )


def _cuts(path) -> list[tuple[str, str]]:
    return [(rel, how) for rel in _files(path) for how in ("half", "zero")]


def _truncate(path: str, how: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2 if how == "half" else 0)


def test_a_truncated_file_of_a_saved_checkpoint_never_restores_garbage(tmp_path):
    """Every file, half and zero: restore raises CheckpointError or gives the saved tree."""
    jaxdev.save(tmp_path / "c", _tree(1))
    cuts, failures = _cuts(tmp_path / "c"), []
    assert len(cuts) >= 16, cuts  # orbax's metadata, jaxdev's, the data files
    for k, (rel, how) in enumerate(cuts):
        copy = tmp_path / f"cut{k}"
        shutil.copytree(tmp_path / "c", copy)
        _truncate(os.path.join(copy, rel), how)
        try:
            back = jaxdev.restore(copy)
        except CheckpointError:
            continue
        except Exception as err:  # noqa: BLE001 - what the test looks for
            failures.append(f"{rel} ({how}): {type(err).__name__}: {err}")
            continue
        if not _same(back, _tree(1)):  # a file restore does not read: the exact tree
            failures.append(f"{rel} ({how}): garbage {back}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("async_", [False, True])
def test_a_checkpointer_skips_a_damaged_step_and_keep_spares_the_last_good_one(
    tmp_path, caplog, async_
):
    """Every file of step 2, half and zero, in a fresh copy of the directory (a restart):
    the latest step is 1 (said in a warning), restore() gives it, restore(step=2) raises
    naming the damage, and saving 3 with keep=2 keeps 1 (the damaged 2 is deleted)."""
    metrics = {"loss": np.float32(0.5), "seen": np.arange(4)}
    with Checkpointer(tmp_path / "run", keep=2, async_=async_) as ckpt:
        for s in (1, 2):
            ckpt.save(s, _tree(s), metrics=metrics)
    cuts, failures = _cuts(tmp_path / "run" / "2"), []
    for k, (rel, how) in enumerate(cuts):
        run = tmp_path / f"cut{k}"
        shutil.copytree(tmp_path / "run", run)
        _truncate(os.path.join(run, "2", rel), how)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "jaxdev"), Checkpointer(run, keep=2) as ckpt:
            if problem := _fell_back(ckpt, rel):
                failures.append(f"{rel} ({how}): {problem}")
                continue
            good = ckpt.latest_step()  # 2: a file restore does not read (exact, checked)
            said = [r.getMessage() for r in caplog.records]
            if good == 1 and not any("step 2" in m and "damaged" in m for m in said):
                failures.append(f"{rel} ({how}): skipped silently: {said}")
            ckpt.save(3, _tree(3))
            ckpt.wait()
            if ckpt.all_steps() != [good, 3] or not _same(ckpt.restore(step=good), _tree(good)):
                failures.append(f"{rel} ({how}): after saving 3, steps {ckpt.all_steps()}")
        if sorted(os.listdir(run)) != [str(good), "3"]:
            failures.append(f"{rel} ({how}): the folder holds {sorted(os.listdir(run))}")
    assert not failures, "\n".join(failures)


def _fell_back(ckpt: Checkpointer, rel: str) -> str:
    """'' if ``ckpt`` restores step 1 and refuses step 2 by name; else what it did."""
    if ckpt.latest_step() != 1:
        back = ckpt.restore()
        if ckpt.latest_step() == 2 and _same(back, _tree(2)):
            return "" if os.path.basename(rel) == "commit_success.txt" else "damage unseen"
        return f"latest step {ckpt.latest_step()}"
    if not _same(ckpt.restore(), _tree(1)):
        return "restore() did not give step 1"
    try:
        ckpt.restore(step=2)
    except CheckpointError as err:
        return "" if "damaged" in str(err) or "Could not read" in str(err) else str(err)
    return "restore(step=2) gave a tree"


@pytest.mark.parametrize("durable", [True, False])
def test_durable_is_one_switch_for_save_and_checkpointer(tmp_path, monkeypatch, durable):
    """durable=True fsyncs every file and folder jaxdev and orbax write in Python (tensorstore
    syncs its own) and the folder holding them, on every path; durable=False none of them."""
    real, synced = os.fsync, set()

    def fsync(fd):
        synced.add(os.fstat(fd)[1:3])  # (inode, device): paths change in the renames
        return real(fd)

    def check(*tops) -> None:
        written = {os.stat(p)[1:3] for top in tops for p in [os.path.dirname(top), top]}
        for top in tops:
            written |= {os.stat(os.path.join(top, rel))[1:3] for rel in _files(top)}
            written |= {os.stat(d)[1:3] for d, _, _ in os.walk(top)}
        assert written <= synced if durable else not written & synced, (tops, len(written))
        synced.clear()

    monkeypatch.setattr(os, "fsync", fsync)
    path = str(tmp_path / "c")
    jaxdev.save(path, _tree(1), durable=durable)
    check(path)
    for fallback in ("1", "0"):  # the two swaps of an overwrite
        monkeypatch.setenv("JAXDEV_CHECKPOINT_NO_EXCHANGE", fallback)
        jaxdev.save(path, _tree(2), durable=durable, overwrite=True)
        check(path)
    for async_ in (False, True):
        with Checkpointer(tmp_path / f"run{async_}", async_=async_, durable=durable) as ckpt:
            ckpt.save(1, _tree(1))
        check(str(tmp_path / f"run{async_}" / "1"))


@pytest.mark.parametrize("bad", ["no", None, 0, 2, 1.0, [True]], ids=repr)
def test_durable_takes_a_bool_only_at_every_door(tmp_path, bad):
    """save(durable=) and Checkpointer(durable=) refuse anything but a bool by name: before,
    'no', None, 0 and 2 were taken (truthy: fsync; falsy: none) and [True] died in
    functools.cache with a raw TypeError (unhashable type: 'list')."""
    with pytest.raises(jaxdev.UsageError, match=r"`durable` must be True or False"):
        jaxdev.save(tmp_path / "c", _tree(1), durable=bad)
    with pytest.raises(jaxdev.UsageError, match=r"`durable` must be True or False"):
        Checkpointer(tmp_path / "run", durable=bad)
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("async_", [False, True])
def test_a_folder_made_by_hand_while_a_checkpointer_writes_is_never_deleted(tmp_path, async_):
    """A numbered folder the user makes in the directory mid-run is refused by name at the next
    save, never counted by `keep`: before, the reload that dropping a damaged step needs
    listed it as a step and keep=2 deleted it with the user's file (and a failed save's
    reload did the same)."""
    run = tmp_path / "run"
    with Checkpointer(run, keep=2, async_=async_) as ckpt:
        ckpt.save(1, _tree(1))
        ckpt.save(2, _tree(2))
        ckpt.wait()
        os.makedirs(run / "0")
        (run / "0" / "mine.txt").write_text("the user's")
        os.truncate(run / "2" / "jaxdev" / "files", 0)  # damaged: the writer drops it
        with pytest.raises(CheckpointError, match=r"jaxdev did not write \(\[0\]\)"):
            ckpt.save(3, _tree(3))
        assert (run / "0" / "mine.txt").read_text() == "the user's"
        assert ckpt.all_steps() == [1]
        shutil.move(run / "0", tmp_path / "0")  # moved out: saving goes on
        assert ckpt.save(3, _tree(3))
        ckpt.wait()
        assert ckpt.all_steps() == [1, 3]
    assert (tmp_path / "0" / "mine.txt").read_text() == "the user's"


def test_a_save_skipped_by_every_reads_no_step(tmp_path, monkeypatch):
    """save() is called at every step of a loop: one skipped by `every` decides from what the
    Checkpointer knows and validates nothing (before: every step's files twice per call, 15 ms
    a call with 101 steps on a 2-core CPU, 0.0 before the validation); a save that writes
    validates, and still drops a damaged step before `keep` counts."""
    with Checkpointer(tmp_path / "run", keep=2, every=10, async_=False) as ckpt:
        for s in (10, 20):
            ckpt.save(s, _tree(s))
        seen = []
        real = jaxdev.checkpoint._ckpt_files.damage
        monkeypatch.setattr(jaxdev.checkpoint._ckpt_files, "damage", lambda p: seen.append(p))
        assert [ckpt.save(s, _tree(s)) for s in range(21, 30)] == [False] * 9
        assert seen == []
        with pytest.raises(CheckpointError, match="step 20 is already there"):
            ckpt.save(15, _tree(15))
        monkeypatch.setattr(jaxdev.checkpoint._ckpt_files, "damage", real)
        os.truncate(tmp_path / "run" / "20" / "jaxdev" / "files", 0)
        assert ckpt.save(30, _tree(30))
        assert ckpt.all_steps() == [10, 30]



@pytest.mark.parametrize("how", ["zeroed, same size", "truncated, manifest lost"])
def test_restore_falls_back_when_the_newest_step_fails_to_read(tmp_path, caplog, how):
    """Damage the cheap check cannot see (durable=False and a power cut: a data file of the
    same size but zeroed, as XFS or ext4 data=writeback leave it; or jaxdev/files lost with
    it) is found by the read: restore() falls back to step 1 and says so, latest_step and
    all_steps agree with it afterwards, restore(step=2) names the damage, and the writer's
    next save deletes step 2 before `keep` counts. Before: restore() raised for step 2."""
    run = tmp_path / "run"
    with Checkpointer(run, keep=2, async_=False, durable=False) as ckpt:
        for s in (1, 2):
            ckpt.save(s, _tree(s))
    data = [os.path.join(run, "2", r) for r in _files(run / "2") if r.startswith("state/")]
    big = max(data, key=os.path.getsize)
    if how.startswith("zeroed"):
        with open(big, "r+b") as f:
            f.write(bytes(os.path.getsize(big)))
    else:
        os.remove(run / "2" / "jaxdev" / "files")
        os.truncate(big, 0)
    with caplog.at_level(logging.WARNING, "jaxdev"), Checkpointer(run, keep=2) as ckpt:
        assert _same(ckpt.restore(), _tree(1))
        assert any("step 2" in r.getMessage() for r in caplog.records), caplog.records
        assert (ckpt.latest_step(), ckpt.all_steps()) == (1, [1])
        with pytest.raises(CheckpointError, match="step 2 .* is damaged: Could not read"):
            ckpt.restore(step=2)
        ckpt.save(3, _tree(3))
        ckpt.wait()
        assert ckpt.all_steps() == [1, 3]
    assert sorted(os.listdir(run)) == ["1", "3"]
