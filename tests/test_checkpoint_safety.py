"""Checkpoints never lose data and never return wrong values (issue 17).

Each test here failed before the fix it guards (the previous code deleted the
old checkpoint before writing, removed non-checkpoint folders, let a lower
step become "latest", let two writers mix their steps, used a linear 32-bit
checksum of float32-cast bytes, kept Python scalars unchecked and cast them
silently, and crashed on typed keys and scalar-only trees).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, clean_env, kill_when_ready, run_python
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdev
from jaxdev import CheckpointError
from jaxdev.checkpoint import _checkpoint as ck
from jaxdev.checkpoint._checksum import checksums

SCRIPTS = os.path.join(REPO, "tests", "mp_scripts")


def _state(scale: float = 1.0):
    return jaxdev.TrainState.create({"w": jnp.arange(6.0).reshape(2, 3) * scale}, optax.sgd(0.1))


# ---------------------------------------------------------------- atomic overwrite


def test_a_failed_overwrite_keeps_the_old_checkpoint(tmp_path, monkeypatch, request):
    path = tmp_path / "c"
    jaxdev.save(path, _state(1.0), step=1)
    request.getfixturevalue("disk_full")  # from now on every array write fails
    with pytest.raises(CheckpointError, match=f"the previous checkpoint at {path} is intact"):
        jaxdev.save(path, _state(2.0), step=2, overwrite=True)
    monkeypatch.undo()
    back = jaxdev.restore(path)
    assert ck.checkpoint_step(path) == 1
    assert np.array_equal(np.asarray(back.params["w"]), np.arange(6.0).reshape(2, 3))
    # the next overwrite succeeds, and leaves nothing of ours beside the path
    jaxdev.save(path, _state(3.0), step=3, overwrite=True)
    assert ck.checkpoint_step(path) == 3
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_failed_first_save_does_not_claim_a_previous_checkpoint(tmp_path, disk_full):
    with pytest.raises(CheckpointError, match="no checkpoint was created at"):
        jaxdev.save(tmp_path / "c", _state())


def test_overwrite_of_a_zero_size_or_scalar_tree_works(tmp_path):
    path = tmp_path / "c"
    jaxdev.save(path, {"empty": jnp.zeros((0, 3)), "epoch": 1})
    jaxdev.save(path, {"empty": np.zeros((4, 0), np.int8), "epoch": 2}, overwrite=True)
    back = jaxdev.restore(path)
    assert back["epoch"] == 2 and back["empty"].shape == (4, 0) and back["empty"].dtype == np.int8


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("seed", "exchange"), [(1, True), (2, True), (3, True), (4, False), (5, False), (6, False)]
)
def test_sigkill_at_a_random_moment_of_overwrites_leaves_a_checkpoint(tmp_path, seed, exchange):
    """A process overwrites one path in a loop; SIGKILL at a random moment; it still restores."""
    path = tmp_path / "c"
    env = clean_env(**({} if exchange else {"JAXDEV_CHECKPOINT_NO_EXCHANGE": "1"}))  # fallback
    script = os.path.join(SCRIPTS, "ckpt_overwrite_loop.py")
    delay = random.Random(seed).uniform(0.05, 1.5)
    kill_when_ready([sys.executable, script, str(path)], env, "saved 0", delay)
    back = jaxdev.restore(path)  # old or new, never none (recovers a cut swap)
    step = ck.checkpoint_step(path)
    assert np.array_equal(np.asarray(back["w"]), np.full((256, 256), step, np.float32))
    assert back["step"] == step
    jaxdev.save(path, {"w": jnp.zeros(1), "step": -1}, overwrite=True)  # and it goes on
    assert jaxdev.restore(path)["step"] == -1


def test_a_swap_cut_between_its_renames_is_recovered(tmp_path, caplog):
    path = str(tmp_path / "c")
    jaxdev.save(path, {"v": 1})
    jaxdev.save(path + "-new", {"v": 2})
    os.rename(path, os.path.join(tmp_path, ".c.jaxdev-old"))  # the fallback's first rename
    os.rename(path + "-new", os.path.join(tmp_path, ".c.jaxdev-new"))
    with caplog.at_level("WARNING", logger="jaxdev"):
        assert jaxdev.restore(path) == {"v": 2}  # the complete new one is put back
    assert os.path.isdir(path)
    [record] = [r for r in caplog.records if r.name == "jaxdev"]  # said once, on jaxdev's logger
    assert "put back .c.jaxdev-new" in record.getMessage()


# ---------------------------------------------------------------- never delete what is not ours


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "thesis.tex").write_text("years of work")
    with pytest.raises(CheckpointError, match=r"not a jaxdev checkpoint \(it holds thesis.tex\)"):
        jaxdev.save(results, _state(), overwrite=True)
    assert (results / "thesis.tex").read_text() == "years of work"
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint"):
        jaxdev.save(tmp_path / "notes.txt", _state(), overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()  # nothing to lose: replaced
    jaxdev.save(empty, {"v": 1}, overwrite=True)
    assert jaxdev.restore(empty) == {"v": 1}


# ---------------------------------------------------------------- Checkpointer steps


def test_checkpointer_latest_is_the_highest_step_and_keep_never_drops_it(tmp_path):
    with jaxdev.Checkpointer(tmp_path, keep=2, async_=False) as ckpt:
        assert ckpt.save(10, {"s": 10}) and ckpt.save(20, {"s": 20})
        with pytest.raises(CheckpointError, match="Cannot save step 15 .* step 20 is already"):
            ckpt.save(15, {"s": 15}, force=True)
        with pytest.raises(CheckpointError, match="Cannot save step 15"):
            ckpt.save(15, {"s": 15})
        assert ckpt.latest_step() == 20 and ckpt.restore() == {"s": 20}
        assert ckpt.save(30, {"s": 30})
        assert ckpt.all_steps() == [20, 30]
    again = jaxdev.Checkpointer(tmp_path, keep=2)
    assert again.latest_step() == 30 and again.restore() == {"s": 30}
    again.close()


# ---------------------------------------------------------------- one writer


def test_a_second_checkpointer_on_one_folder_is_refused(tmp_path):
    first = jaxdev.Checkpointer(tmp_path, async_=False)
    second = jaxdev.Checkpointer(tmp_path, async_=False)
    first.save(1, {"a": jnp.ones(2)})
    with pytest.raises(
        CheckpointError, match=rf"being written by another writer \(pid {os.getpid()}"
    ):
        second.save(2, {"b": jnp.ones(2)})
    assert np.array_equal(second.restore()["a"], first.restore()["a"])  # reading needs no lock
    first.close()
    assert second.save(2, {"a": jnp.zeros(2)})  # the first writer is gone
    second.close()
    assert jaxdev.Checkpointer(tmp_path).all_steps() == [1, 2]


def test_threads_saving_to_one_path_one_wins_the_others_are_refused(tmp_path):
    path = tmp_path / "c"
    jaxdev.save(path, {"w": jnp.zeros(4), "who": -1})
    outcome: dict[int, str] = {}
    start = threading.Barrier(4)

    def writer(i: int) -> None:
        start.wait()
        try:
            jaxdev.save(path, {"w": jnp.full(4, float(i)), "who": i}, overwrite=True)
            outcome[i] = "saved"
        except CheckpointError as err:
            outcome[i] = str(err)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert time.monotonic() - t0 < 60 and not any(t.is_alive() for t in threads)
    refused = [m for m in outcome.values() if m != "saved"]
    assert all("being written by another writer" in m for m in refused), refused
    back = jaxdev.restore(path)
    who = back["who"]  # one whole writer's data, never a mix
    assert who == -1 or outcome[who] == "saved"
    assert np.array_equal(np.asarray(back["w"]), np.full(4, float(who)))


@pytest.mark.timeout(120)
def test_a_writer_in_another_process_is_refused_until_it_dies(tmp_path):
    code = f"""
import jaxdev, jax.numpy as jnp, sys, time
ckpt = jaxdev.Checkpointer({str(tmp_path)!r}, async_=False)
ckpt.save(1, {{"w": jnp.ones(2)}})
print("holding", flush=True)
time.sleep(300)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "holding"
        with jaxdev.Checkpointer(tmp_path, async_=False) as ckpt:
            with pytest.raises(CheckpointError, match=rf"another writer \(pid {proc.pid} on "):
                ckpt.save(2, {"w": jnp.zeros(2)})
            os.kill(proc.pid, signal.SIGKILL)  # killed: the kernel drops its lock
            proc.wait(timeout=30)
            assert ckpt.save(2, {"w": jnp.zeros(2)})
            assert ckpt.all_steps() == [1, 2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()


# ---------------------------------------------------------------- the checksum


def test_checksum_catches_sign_bits_of_two_elements_and_is_layout_free(mesh):
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    y = x.copy()
    y[[3, 40]] = -y[[3, 40]]  # two sign bits: the old linear sum did not move
    assert checksums([jnp.asarray(x)]) != checksums([jnp.asarray(y)])
    split = jax.device_put(x, NamedSharding(mesh, P("data")))
    rep = jax.device_put(x, NamedSharding(mesh, P()))
    assert checksums([jnp.asarray(x)]) == checksums([split]) == checksums([rep]) == checksums([x])


def _flip(words: np.ndarray, bits) -> np.ndarray:
    out = words.copy()
    for b in bits:
        out[b // 32] ^= np.uint32(1) << np.uint32(b % 32)
    return out


def test_checksum_catches_every_1_and_2_bit_change_and_random_3_bit_changes():
    from jaxdev.checkpoint._checksum import _checksums  # the jitted per-array function

    base = np.random.default_rng(0).integers(0, 2**32, 16, dtype=np.uint32)
    nbits = base.size * 32
    variants = [_flip(base, [i]) for i in range(nbits)]
    variants += [_flip(base, [i, j]) for i in range(nbits) for j in range(i + 1, nbits)]
    rng = random.Random(0)
    variants += [_flip(base, rng.sample(range(nbits), 3)) for _ in range(20000)]
    batch = jnp.asarray(np.stack(variants))
    sums = np.asarray(jax.jit(jax.vmap(lambda w: _checksums([w])[0]))(batch))
    ref = np.asarray(_checksums([jnp.asarray(base)])[0])
    same = np.all(sums == ref, axis=1)
    assert len(variants) == 512 + 512 * 511 // 2 + 20000
    assert not same.any(), f"{same.sum()} changes not caught"


@pytest.mark.parametrize(
    ("leaf", "changed"),
    [
        (np.array([1.0, 2.0], np.float64), np.array([1.0 + 2**-40, 2.0], np.float64)),
        (np.array([1, 2], np.int64), np.array([1 + 2**40, 2], np.int64)),
        (np.array([True, False]), np.array([True, True])),
        (np.array([1.5, -2.5], np.float16), np.array([1.5, 2.5], np.float16)),
        (np.array([1 + 2j], np.complex64), np.array([1 - 2j], np.complex64)),
    ],
)
def test_every_dtype_is_checked_on_its_saved_bytes(tmp_path, monkeypatch, leaf, changed):
    jaxdev.save(tmp_path / "c", {"x": leaf})
    assert np.array_equal(jaxdev.restore(tmp_path / "c")["x"], leaf)
    real = ck._orbax_restore

    def corrupted(*args, **kwargs):  # the file read back other bytes
        return [changed for _ in real(*args, **kwargs)]

    monkeypatch.setattr(ck, "_orbax_restore", corrupted)
    with pytest.raises(CheckpointError, match=r"(?s)corrupted.*\['x'\]: checksum"):
        jaxdev.restore(tmp_path / "c")


def test_a_float64_numpy_leaf_keeps_every_bit(tmp_path):
    x = np.array([np.pi, 1e-300, 2.0**60 + 1], np.float64)
    jaxdev.save(tmp_path / "c", {"x": x, "i": np.array([2**62 + 1], np.int64)})
    back = jaxdev.restore(tmp_path / "c")
    assert back["x"].dtype == np.float64 and np.array_equal(back["x"], x)
    assert back["i"][0] == 2**62 + 1


# ---------------------------------------------------------------- Python scalars


def test_a_changed_python_scalar_in_the_metadata_is_an_error(tmp_path):
    path = tmp_path / "c"
    jaxdev.save(path, {"epoch": 7, "w": jnp.ones(2)}, step=7)
    meta_file = path / "jaxdev" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["state"]["leaves"][0]["value"] = 6  # one flipped digit
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="metadata of checkpoint .* is damaged"):
        jaxdev.restore(path)


def test_python_scalars_onto_array_targets_refuse_lossy_casts(tmp_path):
    path = tmp_path / "c"
    jaxdev.save(path, {"lr": 2.5, "big": 2**40 + 1, "n": 3, "flag": True})
    with pytest.raises(CheckpointError) as e:
        jaxdev.restore(
            path,
            {
                "lr": jnp.zeros((), jnp.int32),
                "big": jnp.zeros((), jnp.float32),
                "n": jnp.zeros((), jnp.float32),
                "flag": jnp.zeros((), jnp.bool_),
            },
        )
    msg = str(e.value)
    assert "['lr']: saved the Python float 2.5, asked int32" in msg
    assert "['big']: saved the Python int 1099511627777, asked float32" in msg
    assert "['n']" not in msg and "['flag']" not in msg
    # onto a sharding: the default dtype must hold it (int32 cannot hold 2**40 + 1)
    with pytest.raises(CheckpointError, match=r"\['big'\]: saved the Python int .* asked int32"):
        jaxdev.restore(path, {"lr": 0.0, "big": jaxdev.d2l.cpu(0), "n": 0, "flag": False})
    ok = jaxdev.restore(
        path,
        {"lr": jnp.zeros((), jnp.float32), "big": 0, "n": jnp.zeros((), jnp.float32), "flag": 0},
    )
    assert float(ok["lr"]) == 2.5 and ok["big"] == 2**40 + 1 and float(ok["n"]) == 3.0
    assert ok["flag"] == 1 and isinstance(ok["flag"], int)
    with pytest.raises(CheckpointError, match=r"\['lr'\]: saved the Python float 2.5, asked int"):
        jaxdev.restore(path, {"lr": 0, "big": 0, "n": 0, "flag": False})


def test_a_tree_of_only_python_scalars_saves_and_restores(tmp_path):
    jaxdev.save(tmp_path / "c", {"epoch": 3, "lr": 0.5, "name": None})
    assert jaxdev.restore(tmp_path / "c") == {"epoch": 3, "lr": 0.5, "name": None}
    with jaxdev.Checkpointer(tmp_path / "m", async_=False) as ckpt:
        ckpt.save(1, {"epoch": 1}, metrics={"seen": 64})
        assert ckpt.restore() == {"epoch": 1} and ckpt.restore_metrics() == {"seen": 64}


@pytest.mark.timeout(120)
def test_a_failed_save_does_not_delay_the_exit():
    proc = run_python(
        """
        import errno, time
        import jaxdev
        jaxdev.testing.use_fake_cpu_devices(8)
        import jax.numpy as jnp, tempfile
        from orbax.checkpoint._src.serialization import jax_array_handlers
        async def fail(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        jax_array_handlers.ArrayHandler.serialize = fail
        try:
            tree = {"w": jaxdev.replicate(jnp.ones(8), jaxdev.data_mesh())}
            jaxdev.save(tempfile.mkdtemp() + "/c", tree)
        except jaxdev.CheckpointError as err:
            print("refused", "disk is full" in str(err))
        print("exiting", time.monotonic(), flush=True)
        """,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused True" in proc.stdout
    exited_at = float(proc.stdout.split("exiting ")[1].split()[0])
    # the process ended within 30 s of its last line (orbax's waiting threads held it 5 min)
    assert time.monotonic() - exited_at < 30


# ---------------------------------------------------------------- typed keys


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_round_trip_on_every_layout(tmp_path, mesh, impl):
    key = jax.random.key(0, impl=impl)
    keys = jax.device_put(jax.random.split(key, 8), NamedSharding(mesh, P("data")))
    tree = {"key": key, "keys": keys, "raw": jax.random.key_data(key)}
    jaxdev.save(tmp_path / "c", tree)

    def same(a, b):
        assert a.dtype == b.dtype
        assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))

    back = jaxdev.restore(tmp_path / "c")
    same(back["key"], key)
    same(back["keys"], keys)
    assert back["keys"].sharding.spec == P("data")
    assert np.array_equal(back["raw"], jax.random.key_data(key))
    on_mesh = jaxdev.restore(tmp_path / "c", mesh)
    same(on_mesh["keys"], keys)
    jaxdev.assert_replicated(on_mesh["keys"], mesh)
    like = jaxdev.restore(tmp_path / "c", tree)
    same(like["keys"], keys)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    same(jaxdev.restore(tmp_path / "c", abstract)["key"], key)
    # the restored key draws what the saved one drew
    assert np.array_equal(jax.random.normal(back["key"], (3,)), jax.random.normal(key, (3,)))


def test_a_train_state_with_a_typed_key_saves_like_the_nnx_example(tmp_path):
    state = {"params": {"w": jnp.ones(3)}, "rng": jax.random.key(42)}
    with jaxdev.Checkpointer(tmp_path, async_=False) as ckpt:
        ckpt.save(1, state)
        back = ckpt.restore(state)
    assert np.array_equal(jax.random.key_data(back["rng"]), jax.random.key_data(state["rng"]))


# ---------------------------------------------------------------- found by review (each failed)


def test_a_project_folder_holding_a_jaxdev_subfolder_is_not_a_checkpoint(tmp_path):
    proj = tmp_path / "proj"
    (proj / "jaxdev").mkdir(parents=True)
    (proj / "train.py").write_text("x")
    with pytest.raises(CheckpointError, match="not a jaxdev checkpoint"):
        jaxdev.save(proj, {"w": jnp.ones(2)}, overwrite=True)
    assert (proj / "train.py").read_text() == "x"
    ckpt = tmp_path / "c"
    jaxdev.save(ckpt, {"w": jnp.ones(2)})
    (ckpt / "notes.txt").write_text("mine")  # a user's file inside a real checkpoint
    with pytest.raises(CheckpointError, match=r"files jaxdev did not write \(notes.txt\)"):
        jaxdev.save(ckpt, {"w": jnp.zeros(2)}, overwrite=True)
    assert (ckpt / "notes.txt").read_text() == "mine"


def test_checkpointer_never_takes_user_numbered_folders_for_steps(tmp_path):
    (tmp_path / "100").mkdir()
    (tmp_path / "100" / "notes.txt").write_text("mine")
    with jaxdev.Checkpointer(tmp_path, keep=1, async_=False) as ckpt:
        assert ckpt.all_steps() == []
        with pytest.raises(
            CheckpointError, match=r"numbered folders that jaxdev did not write \(\[100\]\)"
        ):
            ckpt.save(200, {"w": jnp.ones(2)})
    assert (tmp_path / "100" / "notes.txt").read_text() == "mine"


def test_checksum_catches_structured_two_bit_changes():
    zeros = np.zeros(8, np.int32)
    assert checksums([zeros]) != checksums([np.array([1, 1, 0, 0, 0, 0, 0, 0], np.int32)])
    assert checksums([np.zeros(2, bool)]) != checksums([np.ones(2, bool)])
    x = np.zeros(64, np.float32)
    y = x.copy()
    y[[0, 32]] = np.float32(2**-149)  # the same mantissa bit, 32 elements apart
    assert checksums([x]) != checksums([y])


def test_checksum_every_two_bit_change_of_a_zero_array():
    from jaxdev.checkpoint._checksum import _checksums

    base = np.zeros(16, np.uint32)  # equal words everywhere: the structured worst case
    nbits = base.size * 32
    variants = [_flip(base, [i, j]) for i in range(nbits) for j in range(i + 1, nbits)]
    sums = np.asarray(
        jax.jit(jax.vmap(lambda w: _checksums([w])[0]))(jnp.asarray(np.stack(variants)))
    )
    ref = np.asarray(_checksums([jnp.asarray(base)])[0])
    assert not np.all(sums == ref, axis=1).any()


def test_a_64_bit_numpy_leaf_onto_a_jax_target_is_refused_not_reported_corrupted(tmp_path):
    path = tmp_path / "c"
    jaxdev.save(path, {"i": np.arange(3), "x": np.arange(3.0)})
    with pytest.raises(
        CheckpointError, match=r"\['x'\]: saved dtype float64, and a jax.Array holds float32"
    ) as e:
        jaxdev.restore(path, "cpu:0")
    assert "corrupted" not in str(e.value) and "['i']: saved dtype int64" in str(e.value)
    back = jaxdev.restore(path, {"i": np.zeros(3, np.int64), "x": np.zeros(3)})
    assert back["x"].dtype == np.float64 and np.array_equal(back["x"], np.arange(3.0))


@pytest.mark.parametrize("bad", ["unreduced", "unreduced_sds", "unreduced_rules", "rank"])
def test_a_bad_target_is_the_callers_error_and_no_step_is_deleted(tmp_path, bad):
    """A target orbax could not read onto (unreduced: JAX's NotImplementedError; a spec longer
    than the leaf, UNCONSTRAINED past its rank: ValueError) was called damage: a Checkpointer
    marked every step damaged and its next save deleted them all. The caller's error now,
    before any read for unreduced; every step stays and restores."""
    mesh = jaxdev.make_mesh({"data": 2, "model": 4}, axis_type="explicit")
    u = NamedSharding(mesh, P("model", unreduced={"data"}))
    target, rules, error = {"w": u}, None, jaxdev.ShardingError
    if bad == "unreduced_sds":
        target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=u)}
    elif bad == "unreduced_rules":
        target, rules = mesh, [("w", u.spec)]
    elif bad == "rank":
        auto = jaxdev.make_mesh({"data": 2, "model": 4})
        target, error = {"w": NamedSharding(auto, P("model", P.UNCONSTRAINED))}, CheckpointError
    params = {"w": jnp.arange(8.0)}
    with jaxdev.Checkpointer(tmp_path, async_=False) as ckpt:
        ckpt.save(1, params)
        ckpt.save(2, params)
        for restore in (ckpt.restore, lambda *a, **k: jaxdev.restore(tmp_path / "2", *a, **k)):
            with pytest.raises(error, match=r"\['w'\]") as e:
                restore(target, rules=rules)
            assert not isinstance(e.value, ck.Damaged) and "damaged" not in str(e.value)
        ckpt.save(3, params)
        assert ckpt.all_steps() == [1, 2, 3]
        for step in (1, 2, 3):
            np.testing.assert_array_equal(ckpt.restore("cpu:0", step)["w"], np.arange(8.0))


@pytest.mark.parametrize("target", [None, "cpu:0", "replicated"])
def test_a_damaged_array_metadata_file_is_damage_not_the_targets_fault(tmp_path, target):
    """A same-size corruption of orbax's array_metadatas read whole on the host (numpy reads
    skip it), so the test above's "the target's fault" verdict took it for intact: a plain
    CheckpointError that Checkpointer does not skip (every later restore stuck on it)."""
    params = {"w": jnp.arange(8.0)}
    with jaxdev.Checkpointer(tmp_path, async_=False) as ckpt:
        ckpt.save(1, params)
        ckpt.save(2, params)
        meta = next((tmp_path / "2").rglob("array_metadatas/process_0"))
        data = bytearray(meta.read_bytes())
        half = len(data) // 2
        meta.write_bytes(bytes(data[:half]) + bytes(b ^ 0xFF for b in data[half:]))
        if target == "replicated":
            target = jaxdev.as_sharding(jaxdev.data_mesh())
        with pytest.raises(ck.Damaged, match=r"leaves \['w'\]"):
            jaxdev.restore(tmp_path / "2", target)
        np.testing.assert_array_equal(ckpt.restore(target)["w"], np.arange(8.0))  # step 1
        assert ckpt.latest_step() == 1  # step 2 skipped as damaged


def test_overwrite_through_a_symlink_replaces_its_target(tmp_path):
    jaxdev.save(tmp_path / "real", {"v": 1})
    os.symlink(tmp_path / "real", tmp_path / "link")
    for v in (2, 3):
        jaxdev.save(f"{tmp_path}/link/", {"v": v}, overwrite=True)
        assert jaxdev.restore(tmp_path / "link") == {"v": v}
    assert os.path.islink(tmp_path / "link")
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_a_leaf_whose_rows_happen_to_be_equal_keeps_its_shape(tmp_path, mesh):
    key = jax.random.key(0)
    same = jax.random.wrap_key_data(jnp.tile(jax.random.key_data(key)[None], (8, 1)))
    keys = jax.device_put(same, NamedSharding(mesh, P("data")))
    zeros = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("data")))
    jaxdev.save(tmp_path / "c", {"k": keys, "z": zeros})
    for target in (None, mesh, "cpu:0", {"k": keys.sharding, "z": zeros.sharding}):
        back = jaxdev.restore(tmp_path / "c", target)
        assert back["k"].shape == (8,) and back["z"].shape == (8, 4), target
        assert np.array_equal(jax.random.key_data(back["k"]), jax.random.key_data(keys))


def test_arrays_on_an_explicit_axis_mesh_save(tmp_path):
    m = jax.make_mesh((8,), ("data",))  # Explicit axes, jax's default
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(m, P("data")))
    jaxdev.save(tmp_path / "c", {"x": x})
    assert np.array_equal(jaxdev.restore(tmp_path / "c", "cpu:0")["x"], np.asarray(x))


def test_a_dropped_checkpointer_frees_its_folder(tmp_path):
    import gc

    first = jaxdev.Checkpointer(tmp_path, async_=False)
    first.save(1, {"w": jnp.ones(2)})
    del first  # a notebook cell run again, without close()
    gc.collect()
    with jaxdev.Checkpointer(tmp_path, async_=False) as again:
        assert again.save(2, {"w": jnp.ones(2)})


def test_an_async_save_that_failed_can_be_saved_again(tmp_path, monkeypatch, request):
    with jaxdev.Checkpointer(tmp_path) as ckpt:
        request.getfixturevalue("disk_full")
        with pytest.raises(CheckpointError, match="No space left"):
            ckpt.save(1, {"w": jnp.ones(2)})  # reported here or by wait(), as orbax fails
            ckpt.wait()
        monkeypatch.undo()
        assert ckpt.save(1, {"w": jnp.ones(2)})  # not skipped as "already saved"
        ckpt.wait()
        assert ckpt.all_steps() == [1]


def test_odd_dtypes_and_damaged_metadata_get_clear_errors(tmp_path):
    import ml_dtypes

    four = np.array([1, -2, 7, -8], ml_dtypes.int4)
    jaxdev.save(tmp_path / "i4", {"q": four, "j": jnp.asarray(four)})
    back = jaxdev.restore(tmp_path / "i4", {"q": four, "j": jnp.asarray(four)})
    assert np.array_equal(back["q"], four) and np.array_equal(np.asarray(back["j"]), four)
    with pytest.raises(CheckpointError, match=r"\['s'\]: numpy array of dtype \|S3"):
        jaxdev.save(tmp_path / "s", {"s": np.array([b"abc"])})
    path = tmp_path / "m"
    jaxdev.save(path, {"n": 7})
    meta_file = path / "jaxdev" / "metadata"
    good = meta_file.read_text()
    for edit in ({"version": "2"}, {"state": None}, {"version": 1}):
        meta_file.write_text(json.dumps({**json.loads(good), **edit}))
        with pytest.raises(CheckpointError, match="metadata of checkpoint .* is damaged"):
            jaxdev.restore(path)


def test_a_plain_save_into_a_checkpointer_folder_is_refused(tmp_path):
    with jaxdev.Checkpointer(tmp_path, async_=False) as ckpt:
        ckpt.save(1, {"w": jnp.ones(2)})
        with pytest.raises(CheckpointError, match="being written by a jaxdev.Checkpointer"):
            jaxdev.save(tmp_path / "9", {"w": jnp.ones(2)})
    jaxdev.save(tmp_path / "9", {"w": jnp.ones(2)})  # once it is closed, a plain save is fine
