"""Checkpoint edge cases found by an outside attack; each test failed before its fix."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, clean_env

import jaxdev
from jaxdev import CheckpointError, UsageError
from jaxdev.checkpoint import _checkpoint as ck
from jaxdev.checkpoint import _ckpt_files as files

# ---------------------------------------------------------------- numpy scalar leaves

_SCALARS = [np.float16(0.1), np.float32(0.1), np.float64(0.1)]
_SCALARS += [t(-3) for t in (np.int8, np.int16, np.int32, np.int64)]
_SCALARS += [t(3) for t in (np.uint8, np.uint16, np.uint32, np.uint64)]
_SCALARS += [np.bool_(True), np.complex64(0.1 + 2j), np.complex128(0.1 + 2j)]


def _same(got, want) -> bool:
    return type(got) is type(want) and got == want


@pytest.mark.parametrize("v", _SCALARS, ids=lambda v: v.dtype.name)
def test_a_numpy_scalar_round_trips_onto_every_target(tmp_path, v):
    """np.float64 / complex128 are Python float / complex subclasses: saved as Python
    scalars under the name 'float64', they failed every restore with KeyError."""
    jaxdev.save(tmp_path / "c", {"lr": v})
    assert _same(jaxdev.restore(tmp_path / "c")["lr"], v)
    assert _same(jaxdev.restore(tmp_path / "c", "cpu:1")["lr"], v)  # a host value stays one
    assert _same(jaxdev.restore(tmp_path / "c", {"lr": type(v)(0)})["lr"], v)
    python = v.item()
    assert _same(jaxdev.restore(tmp_path / "c", {"lr": type(python)(0)})["lr"], python)
    dtype = jax.dtypes.canonicalize_dtype(v.dtype)
    if dtype != v.dtype:  # float64 and friends with x64 off: as for numpy arrays
        with pytest.raises(CheckpointError, match=rf"\['lr'\]: saved dtype {v.dtype}, asked"):
            jaxdev.restore(tmp_path / "c", {"lr": jnp.zeros((), dtype)})
        return
    back = jaxdev.restore(tmp_path / "c", {"lr": jnp.zeros((), dtype)})["lr"]
    assert isinstance(back, jax.Array) and back.dtype == v.dtype and back == v


def test_a_python_target_refuses_a_numpy_scalar_it_cannot_hold(tmp_path):
    jaxdev.save(tmp_path / "c", {"lr": np.float64(2.5)})
    with pytest.raises(CheckpointError, match=r"\['lr'\]: saved float64 2.5, asked a Python int"):
        jaxdev.restore(tmp_path / "c", {"lr": 0})


def test_numpy_integer_dict_keys_come_back_as_integers(tmp_path):
    """They came back as the strings '0', '1' (only Python int keys were typed)."""
    jaxdev.save(tmp_path / "c", {np.int64(0): np.ones(2), np.uint8(1): np.zeros(2)})
    assert list(jaxdev.restore(tmp_path / "c")) == [0, 1]


def test_numpy_scalars_saved_before_the_fix_restore(tmp_path):
    """The old format named np.float64 / complex128 scalars 'float64' with numpy's repr."""
    path = tmp_path / "c"
    jaxdev.save(path, {"lr": 0.1, "z": 1j})
    meta_file = path / "jaxdev" / "metadata"
    meta = json.loads(meta_file.read_text())
    lr, z = meta["state"]["leaves"]
    lr.update(type="float64", value="np.float64(0.1)")
    z.update(type="complex128", value=["np.float64(0.0)", "np.float64(1.0)"])
    meta["digest"] = ck._digest(meta)
    meta_file.write_text(json.dumps(meta))
    back = jaxdev.restore(path)
    assert _same(back["lr"], np.float64(0.1)) and _same(back["z"], np.complex128(1j))


# ---------------------------------------------------------------- step numbers


_BAD_STEPS = [7.9, "9", True, -1, np.float32(3), None, np.array(True), jax.random.key(0)]


@pytest.mark.parametrize("bad", [*_BAD_STEPS, jnp.asarray(2.0), jnp.asarray(-1), jnp.ones(1, int)])
def test_a_step_must_be_a_non_negative_int(tmp_path, bad):
    """save(7.9) saved step 7, save('9') step 9, save(True) step 1; restore(step=True) step 1."""
    got = rf"got {re.escape(repr(bad))} \({type(bad).__name__}\)"
    with jaxdev.Checkpointer(tmp_path / "m", async_=False) as ckpt:
        with pytest.raises(UsageError, match=rf"`step` must be a non-negative int .*, {got}"):
            ckpt.save(bad, {"w": np.ones(2)})
        assert ckpt.save(np.int64(1), {"w": np.ones(2)}) and ckpt.all_steps() == [1]
        if bad is not None:  # restore(step=None): the latest
            with pytest.raises(UsageError, match=got):
                ckpt.restore(step=bad)
            with pytest.raises(UsageError, match=got):
                jaxdev.save(tmp_path / "c", {"w": np.ones(2)}, step=bad)
    jaxdev.save(tmp_path / "d", {"w": np.ones(2)}, step=np.int64(5))  # was TypeError from json
    assert type(ck.checkpoint_step(tmp_path / "d")) is int


def test_a_0d_integer_array_step_is_a_step_like_flax_state_step(tmp_path):
    """ckpt.save(state.step, state), the Flax idiom, was refused with a UsageError."""
    state = jaxdev.TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1))  # step: Array(0)
    with jaxdev.Checkpointer(tmp_path / "m", async_=False) as ckpt:
        assert ckpt.save(state.step, state) and ckpt.save(np.array(4, np.uint8), state)
        assert ckpt.all_steps() == [0, 4] and ckpt.restore(step=jnp.asarray(4)).step == 0
    jaxdev.save(tmp_path / "c", {"w": np.ones(2)}, step=jnp.asarray(5))
    assert type(ck.checkpoint_step(tmp_path / "c")) is int


def test_a_missing_checkpoint_beside_a_folder_named_with_a_digit_sign_is_named(tmp_path):
    """A folder such as '²' (str.isdigit, but not an int) beside the missing path made
    restore's hint raise a raw ValueError instead of 'No checkpoint at'."""
    (tmp_path / "²").mkdir()
    jaxdev.save(tmp_path / "3", {"w": np.ones(2)})
    with pytest.raises(CheckpointError, match=r"No checkpoint at .*\(steps \[3\]\)"):
        jaxdev.restore(tmp_path / "c")


# ---------------------------------------------------------------- a step that exists


def test_saving_a_step_that_exists_is_an_error_not_a_silent_skip(tmp_path):
    """A second run in the same folder 'saved' every step (False) and kept none of them."""
    with jaxdev.Checkpointer(tmp_path, async_=False) as first:
        for step in (1, 2):
            first.save(step, {"w": np.full(2, step)})
        assert first.save(2, {"w": np.full(2, 2)}) is False  # this run's own step: the same state
    with jaxdev.Checkpointer(tmp_path) as second:  # a new run that did not restore
        with pytest.raises(CheckpointError) as err:
            second.save(1, {"w": np.zeros(2)})
    msg = str(err.value)
    assert f"Cannot save step 1 in {tmp_path}: a checkpoint of step 1 is already there" in msg
    assert "restore()" in msg and "new directory" in msg
    assert np.array_equal(jaxdev.Checkpointer(tmp_path).restore()["w"], [2, 2])


# ---------------------------------------------------------------- protected folders


def test_overwrite_never_replaces_the_working_directory_its_parents_or_home(tmp_path, monkeypatch):
    """save('.', overwrite=True) in an empty working directory deleted it."""
    here, home = tmp_path / "a" / "work", tmp_path / "home"
    here.mkdir(parents=True)
    home.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(home))
    for path, what in [(".", "the working directory"), ("..", "a parent of the working")]:
        with pytest.raises(CheckpointError, match=f"is {what}"):
            jaxdev.save(path, {"w": np.ones(2)}, overwrite=True)
    with pytest.raises(CheckpointError, match=f"{home} is the home directory"):
        jaxdev.save(home, {"w": np.ones(2)}, overwrite=True)
    assert (
        here.is_dir()
        and home.is_dir()
        and sorted(p.name for p in tmp_path.iterdir())
        == [
            "a",
            "home",
        ]
    )
    jaxdev.save("ckpt", {"w": np.ones(2)})  # a subfolder is fine
    jaxdev.save("ckpt", {"w": np.zeros(2)}, overwrite=True)
    assert jaxdev.restore("ckpt")["w"].tolist() == [0, 0] and os.getcwd() == str(here)


def test_overwrite_of_an_absolute_path_works_when_the_working_directory_was_deleted(
    tmp_path, monkeypatch
):
    """check_replaceable raised a raw FileNotFoundError from os.getcwd()."""
    jaxdev.save(tmp_path / "ckpt", {"w": np.ones(2)})
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    jaxdev.save(tmp_path / "ckpt", {"w": np.zeros(2)}, overwrite=True)
    assert jaxdev.restore(tmp_path / "ckpt")["w"].tolist() == [0, 0]


# ---------------------------------------------------------------- the writer lock and fork

_FORKING_TRAINER = """
import os, sys, time
import numpy as np, jaxdev
ckpt = jaxdev.Checkpointer(sys.argv[1], async_=False)
ckpt.save(1, {"w": np.ones(2)})
child = os.fork()  # a data-loader worker
if child == 0:
    time.sleep(120)
    os._exit(0)
print("worker", child, flush=True)
time.sleep(120)
"""


def test_a_forked_worker_does_not_keep_a_killed_writers_lock(tmp_path):
    """The child shared the lock's open file description: after a SIGKILL of the trainer
    the restarted run was refused, naming the dead trainer's pid."""
    cmd = [sys.executable, "-c", _FORKING_TRAINER, str(tmp_path)]
    trainer = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(trainer.stdout.readline().split()[1])
        os.kill(trainer.pid, signal.SIGKILL)  # the trainer, by its own pid
        trainer.wait(timeout=30)
        with jaxdev.Checkpointer(tmp_path) as again:  # the restarted run
            assert again.save(2, {"w": np.zeros(2)})
        assert os.path.exists(f"/proc/{worker}")  # the worker lived on meanwhile
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGKILL)  # the worker, by its own pid
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=30)
        trainer.stdout.close()


# ---------------------------------------------------------------- a full disk

# What tensorstore raises on a full disk (measured on a 200 KiB tmpfs): no OSError, no errno.
_TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file "{}": Failed to '
    "write 1318669 bytes to file 15: No space left on device [os_error_code='28']"
)


@pytest.mark.parametrize("how", ["save", "sync", "async", "replace"])
def test_a_full_disk_says_so_with_the_path_and_the_bytes(tmp_path, monkeypatch, how):
    from orbax.checkpoint._src.serialization import jax_array_handlers

    async def full(self, *args, **kwargs):
        raise ValueError(_TENSORSTORE_ENOSPC.format(tmp_path))

    def no_room(new, path, durable=True):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    tree = {"w": jnp.ones((256, 4)), "n": np.zeros(64, np.int8)}  # 4 KiB + 64 B
    if how == "replace":  # jaxdev's own file operation
        jaxdev.save(tmp_path / "c", tree)
        monkeypatch.setattr(files, "replace", no_room)
    else:
        monkeypatch.setattr(jax_array_handlers.ArrayHandler, "serialize", full)
    with pytest.raises(CheckpointError) as err:
        if how in ("save", "replace"):
            jaxdev.save(tmp_path / "c", tree, overwrite=how == "replace")
        else:
            with jaxdev.Checkpointer(tmp_path / "m", async_=how == "async") as ckpt:
                ckpt.save(3, tree)
    msg = str(err.value)
    assert "The disk is full (" in msg and re.search(rf" free in {tmp_path}\b", msg), msg
    if how in ("save", "sync"):  # known when the save fails in the call
        assert "the arrays take 4.1 KiB before compression" in msg


# ---------------------------------------------------------------- a reader racing a writer


@pytest.mark.timeout(300)
def test_a_reader_racing_a_writer_gets_a_whole_checkpoint_or_a_named_error(tmp_path):
    """Reads racing save(overwrite=True) said 'corrupted' of a healthy checkpoint (4 in 100),
    and racing a Checkpointer's `keep` raised a raw FileNotFoundError (1 in 100)."""
    script = os.path.join(REPO, "tests", "mp_scripts", "ckpt_race.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path), "60"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for way, seen in json.loads(proc.stdout.splitlines()[-1]).items():
        assert set(seen) <= {"complete", "being written"}, (way, seen)
        assert seen["complete"] >= 30, (way, seen)


def test_a_reader_that_sees_only_the_step_keep_deletes_looks_again(tmp_path, monkeypatch):
    """The race made certain: the reader lists step 1 as `keep` deletes it, the writer's step 2
    committed but not yet listed. Before: 'every step is damaged: step 2: None' (CI, 1 read in
    60), though step 2 was whole."""
    with jaxdev.Checkpointer(tmp_path, keep=1) as writer:
        writer.save(1, {"w": jnp.ones(4)})
        writer.wait()
        reader = jaxdev.Checkpointer(tmp_path)
        damage = reader._damage

        def racing(step):  # the first look at step 1: the writer commits 2, keep drops 1
            if step == 1 and not os.path.isdir(tmp_path / "2"):
                writer.save(2, {"w": jnp.full(4, 2.0)})
                writer.wait()
                return "jaxdev/files: a file is missing"
            return damage(step)

        monkeypatch.setattr(reader, "_damage", racing)
        assert float(reader.restore()["w"][0]) == 2.0


# ---------------------------------------------------------------- exit after a failed save

_FAILED_SAVE_THEN_EXIT = """
import atexit, errno, sys, tempfile, threading
def no_thread_left():  # registered first: runs after every other atexit handler
    if any(t.name == "jaxdev-release-waiters" for t in threading.enumerate()):
        sys.stdout.flush()
        import os; os._exit(3)
atexit.register(no_thread_left)
import jax.numpy as jnp, jaxdev
from orbax.checkpoint._src.serialization import jax_array_handlers
async def no_space(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
jax_array_handlers.ArrayHandler.serialize = no_space
d = tempfile.mkdtemp()
for save in (lambda: jaxdev.save(d + "/c", {"w": jnp.ones(4)}),
             lambda: jaxdev.Checkpointer(d + "/m", async_=False).save(1, {"w": jnp.ones(4)})):
    try:
        save()
    except jaxdev.CheckpointError:
        print("caught", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_process_that_caught_a_failed_save_exits_cleanly(tmp_path):
    """The daemon thread re-signalling orbax's waiters for 20 s still ran, calling into jax,
    while the interpreter finalized: SIGABRT at a normal exit, 1 run in 6."""
    cmd = [sys.executable, "-c", _FAILED_SAVE_THEN_EXIT]
    env = clean_env()
    runs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(6)]
    try:
        results = [(p.wait(timeout=150), p.stdout.read()) for p in runs]
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            p.stdout.close()
    assert results == [(0, "caught\ncaught\n")] * 6, results


# ---------------------------------------------------------------- which background save failed


def test_a_failed_background_save_names_only_the_step_that_failed(tmp_path, monkeypatch):
    """On a full disk, wait() blamed 'the background save of step(s) [1, 3]': step 1 had been
    saved and then deleted by `keep`."""
    from orbax.checkpoint._src.serialization import jax_array_handlers

    class NoSpace:  # the write fails in orbax's background thread, as on a full tmpfs
        def result(self, timeout=None):
            raise OSError(errno.ENOSPC, "No space left on device")

    async def full_later(self, *args, **kwargs):
        return [NoSpace()]

    with jaxdev.Checkpointer(tmp_path, keep=1) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.full(2, step)})
            ckpt.wait()
        monkeypatch.setattr(jax_array_handlers.ArrayHandler, "serialize", full_later)
        with pytest.raises(CheckpointError) as err:
            ckpt.save(3, {"w": jnp.full(2, 3)})
            ckpt.wait()
        msg = str(err.value)
        assert "(the failure was in the background save of step(s) [3])" in msg, msg
        assert "the checkpoints of steps [2] are intact" in msg, msg
        assert ckpt.all_steps() == [2]


# ---------------------------------------------------------------- exact names only


def test_only_orbax_step_names_count_as_tombstones_and_leftovers(tmp_path):
    """remove_tombstones' `\\d` matched Arabic-Indic digits (.jaxdev-deleted/٣,
    ٣.orbax-checkpoint-tmp) and deleted 01.orbax-checkpoint-tmp, which orbax never writes."""
    theirs = [".jaxdev-deleted/٣", "٣.orbax-checkpoint-tmp", "01.orbax-checkpoint-tmp"]
    for name in theirs:
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "notes.txt").write_text("mine")
    with jaxdev.Checkpointer(tmp_path, keep=1, async_=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": np.full(2, step)})
    assert all((tmp_path / n / "notes.txt").read_text() == "mine" for n in theirs)
    assert sorted(os.listdir(tmp_path)) == sorted([".jaxdev-deleted", "2", *theirs[1:]])


def test_keep_never_deletes_a_look_alike_of_a_steps_temporary_folder(tmp_path):
    """keep=1 deleted the user's 1.orbax-checkpoint-tmp.bak (orbax took it for step 1's
    unfinished save) and left the real 1/ on disk, unlisted."""
    theirs = ["1.orbax-checkpoint-tmp.bak", "1.orbax-checkpoint-tmp-x"]
    for name in theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    with jaxdev.Checkpointer(tmp_path, keep=1, async_=False) as ckpt:
        with pytest.raises(CheckpointError, match=re.escape(f"holds {theirs[::-1]}, which orbax")):
            ckpt.save(1, {"w": np.ones(2)})
        assert ckpt.save(2, {"w": np.ones(2)}) and ckpt.save(3, {"w": np.ones(2)})
    assert sorted(os.listdir(tmp_path)) == sorted(["3", *theirs])
    assert all((tmp_path / n / "notes.txt").read_text() == "mine" for n in theirs)


def test_bytes_paths_save_and_restore(tmp_path):
    """save(b"/tmp/x", ...) raised TypeError: Can't mix strings and bytes in path components."""
    path = os.fsencode(tmp_path / "c")
    jaxdev.save(path, {"w": np.ones(2)}, step=4)
    jaxdev.save(path, {"w": np.zeros(2)}, step=5, overwrite=True)
    assert jaxdev.restore(path)["w"].tolist() == [0, 0] and ck.checkpoint_step(path) == 5
    with jaxdev.Checkpointer(os.fsencode(tmp_path / "m"), async_=False) as ckpt:
        assert ckpt.save(1, {"w": np.ones(2)}) and ckpt.restore()["w"].tolist() == [1, 1]


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="long double is float64 here")
def test_long_double_leaves_are_refused_before_writing_naming_the_leaf(tmp_path):
    """orbax's thread logged a traceback, then 'Could not write the checkpoint ...: Unsupported
    data type float128', naming no leaf."""
    tree = {"a": {"x": np.longdouble(1.1)}, "y": np.ones(2, np.clongdouble), "ok": np.ones(2)}
    with pytest.raises(CheckpointError) as err:
        jaxdev.save(tmp_path / "c", tree)
    msg = str(err.value)
    assert "leaves that cannot be saved" in msg, msg
    for leaf in (f"['a']['x']: dtype {np.dtype(np.longdouble)}", "['y']: dtype complex"):
        assert leaf in msg, msg
    assert "['ok']" not in msg and os.listdir(tmp_path) == []


# ---------------------------------------------------------------- rule options on restore


def test_restore_through_rules_takes_the_options_param_shardings_takes(tmp_path):
    """A state placed with indivisible='replicate' (w2 (6, 1): 6 rows on a 4-way model axis),
    min_size= or fsdp_axis= restores through the same rules and options onto the same
    shardings, by jaxdev.restore and Checkpointer.restore: before, restore had no such
    options (the ShardingError it wrapped said to pass `indivisible='replicate'`) and fsdp's
    min_size / fsdp_axis fell back to their defaults; an unknown option or one without
    `rules` is refused by name."""
    from jax.sharding import PartitionSpec as P

    mesh = jaxdev.make_mesh({"data": 2, "model": 4})
    tree = {"w1": np.ones((8, 6), np.float32), "w2": np.arange(6.0, dtype=np.float32)[:, None]}
    rules = [("w1", P("model", None)), ("w2", P("model", None))]
    cases = [
        (rules, {"indivisible": "replicate"}),
        ("fsdp", {"min_size": 0, "fsdp_axis": "model"}),
    ]
    for k, (r, options) in enumerate(cases):
        placed = jaxdev.shard_params(tree, mesh, r, **options)
        want = jaxdev.param_shardings(tree, mesh, r, **options)
        jaxdev.save(tmp_path / f"c{k}", placed)
        with jaxdev.Checkpointer(tmp_path / f"run{k}", async_=False) as ckpt:
            ckpt.save(1, placed)
            for back in (
                jaxdev.restore(tmp_path / f"c{k}", mesh, rules=r, **options),
                ckpt.restore(mesh, rules=r, **options),
            ):
                for name in tree:
                    assert back[name].sharding == want[name], (r, name, back[name].sharding)
                    np.testing.assert_array_equal(np.asarray(back[name]), tree[name])
    with pytest.raises(CheckpointError, match="indivisible='replicate'"):
        jaxdev.restore(tmp_path / "c0", mesh, rules=rules)
    with pytest.raises(CheckpointError, match="`indivisible` must be 'error' or 'replicate'"):
        jaxdev.restore(tmp_path / "c0", mesh, rules=rules, indivisible="Replicate")
    with pytest.raises(UsageError, match="`min_sise`"):
        jaxdev.restore(tmp_path / "c0", mesh, rules=rules, min_sise=0)
    with pytest.raises(UsageError, match="`indivisible` .*with `rules`"):
        jaxdev.restore(tmp_path / "c0", mesh, indivisible="replicate")
