"""jaxdev.testing: the pytest plugin in inner pytest sessions (pytester), assert_strategies_agree.

Each inner session runs in its own process (``runpytest_subprocess``) with a
clean environment; its conftest lists the processes still children of that
pytest when it unconfigures, and its tests record the worker pids, so every
session also checks that no worker or process outlives it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdev
from jaxdev.testing import assert_strategies_agree

pytest_plugins = ["pytester"]

CONFTEST = """
import os, jax, pytest
jax.config.update("jax_num_cpu_devices", 8)  # the markers' counts must still win
if os.environ.get("BREAK_WORKERS"):  # a broken import, in the workers only
    import _jaxdev_pytest  # the plugin: its orders are set in a worker
    if _jaxdev_pytest._WORKER is not None:
        import a_module_that_does_not_exist
if os.environ.get("START_EARLY"):
    DEVICES = jax.devices()

@pytest.fixture
def answer():
    return 42

def record_pid():
    with open(os.path.join(os.environ["INNER_DIR"], "pids.txt"), "a") as f:
        f.write(f"{os.getpid()}\\n")

def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a jaxdev worker (or an xdist one) started
        with open(os.path.join(os.environ["INNER_DIR"], "workers.txt"), "a") as f:
            f.write(f"{os.getpid()}\\n")

def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller: who is still our child?
        me = str(os.getpid())
        kids = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == me]
        with open(os.path.join(os.environ["INNER_DIR"], "children.txt"), "w") as f:
            f.write(" ".join(kids))

def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[1]
    except OSError:
        return None
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    """A pytester directory with the conftest above and a clean environment."""
    for name in list(os.environ):
        if name.startswith(("XLA_", "JAX_", "JAXDEV_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("INNER_DIR", str(pytester.path))
    pytester.makeconftest(CONFTEST)
    return pytester


def run(pytester, *args, timeout=240):
    """``runpytest_subprocess``; then check no child outlived it and the workers are gone."""
    result = pytester.runpytest_subprocess(*args, timeout=timeout)
    assert (pytester.path / "children.txt").read_text() == "", "a child outlived the session"
    pids = pytester.path / "pids.txt"
    for pid in set(pids.read_text().split()) if pids.exists() else ():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
    return result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_markers_workers_processes_and_faults(inner):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    example = readme.split("<!-- testing-example -->\n```python\n", 1)[1].split("```", 1)[0]
    inner.makepyfile(test_readme=example)
    inner.makepyfile(
        test_dev="""
        import ctypes, os, signal, threading
        import jax, jax.numpy as jnp, numpy as np, pytest
        from conftest import record_pid

        KEPT = []

        @pytest.mark.devices(1, 2, 8)
        @pytest.mark.parametrize("k", [1, 2])
        def test_count(jaxdev_devices, k, answer, tmp_path):
            record_pid()
            assert len(jax.devices()) == jaxdev_devices and answer == 42
            doubled = jax.jit(lambda x: x * k)(jnp.ones(jaxdev_devices))
            assert int(doubled.sum()) == k * jaxdev_devices
            (tmp_path / "f").write_text("ok")

        @pytest.mark.devices(2)
        def test_wrong():
            assert int(jnp.arange(4).sum()) == 7

        @pytest.mark.devices(2)
        @pytest.mark.parametrize("how", ["segv", "abort", "exit", "kill"])
        def test_dies(how):
            record_pid()
            print(f"last words before {how}", file=__import__("sys").stderr)
            if how == "segv":
                ctypes.string_at(0)
            if how == "abort":
                os.abort()
            if how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does

        @pytest.mark.devices(2)
        def test_threads_left():
            record_pid()
            threading.Thread(target=threading.Event().wait, name="left-behind", daemon=True).start()
            import jaxdev
            KEPT.append(jaxdev.prefetch_to_device(iter([np.ones(2)] * 50), size=2))

        @pytest.mark.devices(2)
        def test_after_faults():
            record_pid()
            assert len(jax.devices()) == 2

        @pytest.mark.devices(0)
        def test_zero(): pass

        @pytest.mark.devices(-1)
        def test_negative(): pass

        @pytest.mark.devices(2.0)
        def test_float(): pass

        @pytest.mark.devices(2, 2)
        def test_twice(): pass

        @pytest.mark.processes(2, devices=1, foo=3)
        def test_unknown(): pass

        @pytest.mark.processes(2)
        def test_no_devices(): pass

        @pytest.mark.processes(3)
        @pytest.mark.devices(8)
        def test_not_dividing(): pass

        @pytest.mark.devices(1, platform="gpu")
        def test_gpu(): pass

        def test_not_selected():
            assert False
        """
    )
    inner.makepyfile(
        test_proc="""
        import time, jax, pytest
        from conftest import record_pid

        @pytest.mark.processes(2, devices=1)
        def test_fails_on_1():
            record_pid()
            print(f"hello from {jax.process_index()}")
            assert jax.process_index() == 0, "only process 0 passes"

        @pytest.mark.processes(2, devices=1, timeout=4)
        def test_hangs_on_1():
            record_pid()
            if jax.process_index() == 1:
                time.sleep(600)
        """
    )
    result = run(inner, "-v", "-k", "not not_selected")
    gpu = any(d.platform == "gpu" for d in jax.devices())
    # 1 passed, then left threads behind; the README example: 3 + 1
    result.assert_outcomes(passed=8 + 4, failed=5 + 2, errors=9 - gpu)
    out = result.stdout.str()
    assert "test_dev.py::test_count[devices=8-2] PASSED" in out
    assert "assert 6 == 7" in out and re.search(r"test_dev.py:\d+: AssertionError", out)
    for how, why in [
        ("segv", "signal SIGSEGV"),
        ("abort", "signal SIGABRT"),
        ("exit", "exit code 3"),
    ]:
        assert re.search(rf"test_dies\[devices=2-{how}\] _+\n.*died running this test: {why}", out)
    assert "signal SIGKILL (the kernel's OOM killer sends SIGKILL)" in out
    for how in ("segv", "abort", "exit", "kill"):  # its own last words, though pytest captures
        assert f"last words before {how}" in out, how
    assert "Fatal Python error: Segmentation fault" in out
    assert re.search(r'test_dev.py", line \d+ in test_dies', out)  # the dead worker's stack
    assert (
        "test_threads_left[devices=2] left 2 thread(s) running after its teardown: "
        "'left-behind', 'jaxdev-prefetch' ('jaxdev-prefetch' is an open jaxdev Prefetcher"
    ) in out
    for name, why in [
        ("test_zero", "devices(0): device counts must be ints >= 1"),
        ("test_negative", "devices(-1): device counts must be ints >= 1"),
        ("test_float", "devices(2.0): device counts must be ints >= 1"),
        ("test_twice", "devices(2, 2): each device count once, got [2, 2]"),
        ("test_unknown", "processes(2, devices=1, foo=3): give one process count >= 1"),
        ("test_no_devices", "processes(2): `devices=` is missing"),
        ("test_not_dividing[devices=8]", "processes(3): devices(8) in all do not divide over 3"),
    ]:
        assert f"test_dev.py::{name}: @pytest.mark.{why}" in out, name
    if not gpu:
        assert "test_gpu[devices=1]: the worker for devices=1, platform='gpu' asks for 1 gpu" in out
    # one worker per count (1, 2, 8), a fresh one after each of 5 faults, 2 x 2 processes
    assert len(set((inner.path / "pids.txt").read_text().split())) == 3 + 5 + 4

    assert "FAILED test_proc.py::test_fails_on_1 - process 1 of 2: AssertionError" in out
    assert "AssertionError: only process 0 passes" in out  # its traceback
    assert "(unknown ['foo']): processes(2, devices=4)." in out
    assert "[p0] hello from 0" in out and "[p1] hello from 1" in out  # every process's output
    assert "process 1 of 2 failed; the processes' output" in out
    # the hang: every process prints its stacks at the timeout, then all end
    assert "process(es) [1] did not finish the call" in out
    assert re.search(r'\[p1\]   File ".*test_proc.py", line \d+ in test_hangs_on_1', out)
    assert re.search(r"test_hangs_on_1 in process \d did not finish within timeout=4 s", out)

    # --lf re-runs only the failures, -x stops at the first
    result = run(inner, "--lf", "-x", "-q", "-k", "not not_selected", timeout=120)
    assert "stopping after 1 failures" in result.stdout.str()
    result.assert_outcomes(failed=1)


UNITTEST_SUITE = """
import os, unittest
import jax, pytest
from absl.testing import absltest, parameterized
from conftest import record_pid

COUNT = 3  # a mark's argument read from the module

class Plain(unittest.TestCase):
    @pytest.mark.devices(2)
    def test_method(self):
        record_pid()
        self.assertEqual(jax.device_count(), 2)
        self.assertNotIn("SET_BY_ANOTHER_MODULE", os.environ)  # its worker does not import it

    def test_unmarked(self):
        self.assertEqual(jax.device_count(), 8)


@pytest.mark.devices(3)
class Absl(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.count = jax.device_count()

    def test_class(self):
        record_pid()
        self.assertEqual(self.count, 3)

    @pytest.mark.devices(2)  # the method's mark wins
    def test_method_over_class(self):
        self.assertEqual(jax.device_count(), 2)


class Param(parameterized.TestCase):
    @pytest.mark.devices(2)
    @parameterized.parameters(1, 2)
    def test_above(self, k):
        self.assertEqual(jax.device_count(), 2)

    @parameterized.named_parameters(("one", 1), ("two", 2))
    @pytest.mark.devices(3)
    def test_below(self, k):
        self.assertEqual(jax.device_count(), 3)

    @pytest.mark.devices(COUNT)
    @parameterized.product(k=[1, 2], j=[3])
    def test_product_above(self, k, j):
        self.assertEqual(jax.device_count(), COUNT)

    @pytest.mark.devices(2, 3)
    def test_two_counts(self):
        pass

    K = 2

    @pytest.mark.devices(K)
    @parameterized.parameters(1, 2)
    def test_class_scope(self, k):
        pass

    THREE = pytest.mark.devices(3)

    @THREE  # a mark by a class-scope name: refused by name (before: dropped, ran on 8)
    @parameterized.parameters(1, 2)
    def test_class_scope_alias(self, k):
        pass


@pytest.mark.devices(4)
@pytest.mark.skip(reason="skipped here: no worker starts for it")
def test_skipped():
    pass


@pytest.mark.devices(2)
class Base(unittest.TestCase):
    COUNT = 2

    def test_inherited(self):
        self.assertEqual(jax.device_count(), self.COUNT)


@pytest.mark.devices(3)  # a subclass's own mark wins over its base's
class Child(Base):
    COUNT = 3


TWO = pytest.mark.devices(2)


class Aliased(parameterized.TestCase):
    @TWO  # a mark by another name, above absl's decorator
    @parameterized.parameters(1, 2)
    def test_alias_above(self, k):
        self.assertEqual(jax.device_count(), 2)


@pytest.mark.devices(2)
class TestBaseFunctions:
    N = 2

    def test_count(self, jaxdev_devices):
        assert jax.device_count() == jaxdev_devices == self.N


@pytest.mark.devices(3)
class TestChildFunctions(TestBaseFunctions):
    N = 3
"""


def test_unittest_absltest_and_parameterized_markers(inner):
    """Marks on unittest/absltest/parameterized methods and classes, above or below absl's
    decorators (by any name), run on their count; a subclass's own mark wins over its base's;
    none is dropped: what cannot be read fails saying why.
    Before: every marked test errored (a worker for devices=None) and a mark above
    @parameterized.parameters was dropped (the test ran on the session's 8 devices)."""
    inner.makepyfile(test_ut=UNITTEST_SUITE)
    inner.makepyfile(  # before: its variable reached every worker (chex's setUpModule failed)
        test_env="import os\nos.environ['SET_BY_ANOTHER_MODULE'] = '1'\ndef test_env(): pass\n"
    )
    result = run(inner, "-q")
    # before: Child and TestChildFunctions ran on their base's 2 devices, the alias on 8
    result.assert_outcomes(
        passed=1 + 1 + 2 + 2 + 2 + 2 + 1 + 2 + 2 + 2, errors=1 + 2 + 2, skipped=1
    )
    out = result.stdout.str()
    assert (
        "test_ut.py::Param::test_two_counts: @pytest.mark.devices(2, 3): a unittest.TestCase "
        "test runs on one device count (pytest parametrizes test functions only): give one, "
        "e.g. devices(3)."
    ) in out
    assert (
        "test_ut.py::Param::test_class_scope0: @pytest.mark.devices(K) sits above a decorator "
        "that makes new test methods (absl's @parameterized), and jaxdev could not read it "
        "again (NameError: name 'K' is not defined). Put the mark below that decorator."
    ) in out
    assert (
        "test_ut.py::Param::test_class_scope_alias1: @THREE sits above a decorator that makes "
        "new test methods (absl's @parameterized), and jaxdev could not read it again "
        "(NameError: name 'THREE' is not defined)."
    ) in out
    assert len(set((inner.path / "pids.txt").read_text().split())) == 2  # one worker per count
    assert len((inner.path / "workers.txt").read_text().split()) == 2  # none for test_skipped


def test_under_xdist(inner):
    """``-n 2``: each xdist worker starts the jaxdev workers its tests need, and tells them
    the next test they run as that xdist worker sends it. Before: every marked test errored
    (the jaxdev worker, given ``-n 2`` too, ran xdist and collected none)."""
    pytest.importorskip("xdist")
    inner.makepyfile(
        test_x="""
        import jax, pytest
        from conftest import record_pid

        @pytest.mark.devices(2)
        @pytest.mark.parametrize("k", range(4))
        def test_marked(jaxdev_devices, k, tmp_path):
            record_pid()
            assert jax.device_count() == jaxdev_devices == 2

        def test_here():
            assert jax.device_count() == 8
        """
    )
    inner.makepyfile(  # one xdist worker runs test_first, then test_third (group "one")
        test_y="""
        import jax, pytest

        @pytest.fixture(scope="module")
        def here():
            return "y"

        @pytest.mark.devices(2)
        @pytest.mark.xdist_group("one")
        def test_first(here):
            assert jax.device_count() == 2

        @pytest.mark.devices(2)
        @pytest.mark.xdist_group("two")
        def test_second(here):
            assert jax.device_count() == 2
        """,
        test_z="""
        import jax, pytest

        @pytest.mark.devices(2)
        @pytest.mark.xdist_group("one")
        def test_third():
            assert jax.device_count() == 2
        """,
    )
    # before: test_third errored "previous item was not torn down properly" (its jaxdev worker
    # was told test_second came next, in the whole session's order, so kept test_y's module)
    result = run(inner, "-n", "2", "--dist", "loadgroup", "-q")
    result.assert_outcomes(passed=5 + 3)
    assert 1 <= len(set((inner.path / "pids.txt").read_text().split())) <= 2


@pytest.mark.multiprocess
def test_processes_share_one_tmp_path_and_stay_warm(inner):
    """The processes of a ``processes`` test get one ``tmp_path`` (an orbax save into it
    needs that), and serve the next test of the same shape unless a test shut
    ``jax.distributed`` down; every report of a test (unittest subtests) comes back. Before:
    one folder per process, so neither saw the other's file; fresh processes for every test."""
    inner.makepyfile(
        test_t="""
        import os, jax, pytest
        from jax.experimental import multihost_utils
        from conftest import record_pid

        @pytest.mark.processes(2, devices=1)
        @pytest.mark.parametrize("i", range(2))
        def test_shared(tmp_path, i):
            record_pid()
            assert "SET_BY_ANOTHER_MODULE" not in os.environ  # as in a devices worker
            (tmp_path / f"from-{jax.process_index()}").write_text("x")
            multihost_utils.sync_global_devices("written")
            assert sorted(p.name for p in tmp_path.iterdir()) == ["from-0", "from-1"]

        @pytest.mark.processes(2, devices=1)
        def test_shuts_down():
            record_pid()
            jax.distributed.shutdown()

        @pytest.mark.processes(2, devices=1)
        def test_after():
            record_pid()
            assert jax.process_count() == 2
        """
    )
    inner.makepyfile(  # before: its variable reached the processes (not the devices workers)
        test_env="import os\nos.environ['SET_BY_ANOTHER_MODULE'] = '1'\ndef test_env(): pass\n"
    )
    inner.makepyfile(
        test_u="""
        import unittest, jax, pytest

        class Sub(unittest.TestCase):
            @pytest.mark.processes(2, devices=1)
            def test_subtests_fail(self):
                for i in range(3):
                    with self.subTest(i=i):
                        self.assertLess(i, 2)

            @pytest.mark.processes(2, devices=1)
            def test_subtests_pass(self):
                for i in range(2):
                    with self.subTest(i=i):
                        self.assertEqual(jax.process_count(), 2)
        """
    )
    # pytest 9 reports each subtest, then the test (which passes when only subtests fail);
    # before: only the first subtest's report came back, so test_subtests_pass had no outcome
    # and test_subtests_fail read "every process passed, but the launcher returned 1"
    result = run(inner, "-q", "-p", "no:randomly")
    subtests = int(pytest.__version__.split(".")[0]) >= 9
    result.assert_outcomes(passed=1 + 4 + 1 + subtests, failed=1)
    out = result.stdout.str()
    assert re.search(r"process [01] of 2 failed; the processes' output", out)  # the first
    assert "AssertionError: 2 not less than 2" in out
    assert "every process passed" not in out
    if subtests:
        assert "4 subtests passed" in out
    pids = (inner.path / "pids.txt").read_text().split()
    assert len(set(pids[:6])) == 2 and len(set(pids)) == 4  # fresh ones after the shutdown


@pytest.mark.multiprocess
def test_each_failed_process_is_named_first_failed_first(inner):
    """Process 1 fails first, process 0 after it (each waits, bounded, for the other's report
    in the plugin's run folder, so the order is certain). Before: only process 0's failure
    was in the report (the lowest id), process 1's exception nowhere."""
    inner.makepyfile(
        test_two="""
        import pathlib, time, jax, pytest
        import _jaxdev_pytest  # the plugin: its orders name the run folder
        from conftest import record_pid

        def wait_for_failure_of(i):
            run, deadline = pathlib.Path(_jaxdev_pytest._WORKER["run_dir"]), time.monotonic() + 60
            while not any('"when": "call"' in p.read_text() for p in run.glob(f"p{i}-*.jsonl")):
                assert time.monotonic() < deadline, f"process {i} did not fail"
                time.sleep(0.01)

        @pytest.fixture
        def process_1_outlives_process_0s_failure():
            yield
            if jax.process_index() == 1:
                wait_for_failure_of(0)

        @pytest.mark.processes(2, devices=1)
        def test_both_fail(process_1_outlives_process_0s_failure):
            record_pid()
            if jax.process_index() == 1:
                raise ValueError("process 1 fails first")
            wait_for_failure_of(1)
            raise KeyError("process 0 fails second")
        """
    )
    result = run(inner, "-q", "-rf")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "FAILED test_two.py::test_both_fail - process 1 of 2: ValueError" in out
    assert "ValueError: process 1 fails first" in out.split("process 1 of 2 failed;")[0]  # trace
    assert (
        "failed, first to last:\n"
        "process 1 of 2: ValueError: process 1 fails first\n"
        "process 0 of 2: KeyError: 'process 0 fails second'\n"
    ) in out


def test_inert_unless_asked(pytester):
    """Installed, the plugin imports neither jax nor jaxdev into a session that does not ask."""
    pytester.makepyfile(
        "import sys\ndef test_no_jax():\n    assert not {'jax', 'jaxdev'} & set(sys.modules)\n"
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_jaxdev_devices_option(inner, monkeypatch):
    inner.makepyfile(test_n="import jax\ndef test_n():\n    assert len(jax.devices()) == 3\n")
    run(inner, "--jaxdev-devices", "3").assert_outcomes(passed=1)  # over the conftest's 8
    inner.makeini("[pytest]\njaxdev_devices = 3\n")
    monkeypatch.setenv("START_EARLY", "1")  # the conftest starts the backend (8 devices)
    result = run(inner)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--jaxdev-devices 3 asks JAX for 3 cpu device(s), but its backend already started" in (
        result.stderr.str()
    )
    assert re.search(r"conftest.py:\d+: `DEVICES = jax.devices\(\)`", result.stderr.str())


def test_processes_after_a_conftest_started_jax_and_a_toml_int(inner, monkeypatch):
    inner.makepyfile(
        test_p="import pytest\n@pytest.mark.processes(2, devices=2)\ndef test_p(): pass\n"
    )
    monkeypatch.setenv("START_EARLY", "1")  # the conftest starts the backend (8 devices)
    result = run(inner, "-q")
    result.assert_outcomes(errors=1)
    assert "test_p.py::test_p as 2 processes x 2 devices" in result.stdout.str()
    assert re.search(
        r"jaxdev: processes\(2, devices=2\) asks JAX for 2 cpu device\(s\), but its "
        r"backend already started with 8 at .*conftest.py:\d+: `DEVICES = jax.devices\(\)`",
        result.stdout.str(),
    )
    if int(pytest.__version__.split(".")[0]) >= 9:  # its [tool.pytest] table is native TOML
        inner.makefile(".toml", pyproject="[tool.pytest]\njaxdev_devices = 4\n")
        result = run(inner, "-q")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert 'Write it as a string: jaxdev_devices = "4".' in result.stderr.str()


def test_a_worker_that_never_starts(inner, monkeypatch):
    monkeypatch.setenv("BREAK_WORKERS", "1")
    inner.makepyfile(
        test_w="""
        import pytest

        @pytest.mark.devices(2)
        @pytest.mark.parametrize("k", [1, 2])
        def test_w(k): pass

        def test_here(): pass
        """
    )
    result = run(inner, "-q")
    result.assert_outcomes(passed=1, errors=2)
    out = result.stdout.str()
    assert "test_w.py::test_w[devices=2-1]: the jaxdev worker for devices=2 never started" in out
    assert "No module named 'a_module_that_does_not_exist'" in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_worker_ends_with_its_pytest(inner, sig):
    inner.makepyfile(
        test_s="""
        import time, pytest
        from conftest import record_pid

        @pytest.mark.devices(2)
        def test_sleeps():
            record_pid()
            time.sleep(600)  # far past the waits below: a pytest that waits for it fails
        """
    )
    pids, parent = inner.path / "pids.txt", None
    try:
        # Ctrl-C as in a terminal: a shell's background job (CI's second leg) ignores SIGINT,
        # and a Python started so never raises KeyboardInterrupt (no preexec_fn: threads)
        main = (
            "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler)"
        )
        cmd, out = (
            [sys.executable, "-c", main + "; sys.exit(pytest.main(['-q']))"],
            subprocess.DEVNULL,
        )
        parent = inner.popen(cmd, stdout=out, stderr=out)
        deadline = time.monotonic() + 120
        while not pids.exists() and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = int(pids.read_text())  # it runs its test
        os.kill(parent.pid, sig)  # Ctrl-C, or what `timeout -s KILL` and a CI cancel send
        parent.wait(60)  # SIGINT: pytest ends now, not when the test returns (15 s: under
        # load 10 the worker's 5 s grace, pytest's exit and JAX's teardown took longer)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.1)
        assert not _alive(worker), f"worker {worker} outlived its pytest"
    finally:
        if parent is not None:
            parent.kill()
            parent.wait()
        for pid in pids.read_text().split() if pids.exists() else ():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:  # a zombie is dead, whoever reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _loss(params, batch):
    return (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2


def _per_call_mean(params, batch):  # the classic bug: a hard-coded global batch size
    err = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2
    return jnp.full(err.shape, jnp.sum(err) / 64)


def test_assert_strategies_agree():
    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}  # fsdp splits w over 8 devices
    batches = [
        {
            "x": rng.normal(size=(64, 8)).astype(np.float32),
            "y": rng.normal(size=64).astype(np.float32),
        }
        for _ in range(2)
    ]
    names = assert_strategies_agree(_loss, None, params, batches)
    assert names == ("single", "pmap", "sharded", "shard_map", "fsdp")
    with pytest.raises(AssertionError) as err:
        assert_strategies_agree(_per_call_mean, None, params, batches)
    assert re.search(
        r"strategy 'pmap' disagrees with 'single' after step 1 of 2 \(8 devices\): "
        r"params\['b'\] = (\S+) vs (\S+) on 'single'",
        str(err.value),
    )
    got, want = map(float, re.search(r"= (\S+) vs (\S+) on", str(err.value)).groups())
    assert want == pytest.approx(8 * got, rel=1e-3)  # 8x too small per device
    assert "hard-coded global batch size" in str(err.value)
    with pytest.raises(jaxdev.UsageError, match="`batches` is empty"):
        assert_strategies_agree(_loss, None, params, [])


def test_a_reference_run_that_turns_nan_is_refused_not_passed():
    """Before: a loss that is NaN on every strategy (the single-device run diverged) passed,
    NaN agreeing with NaN, and hid any per-device bug (helper-76)."""
    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
    batch = {"x": np.ones((64, 8), np.float32), "y": np.ones(64, np.float32)}
    with pytest.raises(AssertionError, match=r"'single', the reference, has non-finite params "
                       r"after step 1 of 2: params\['b'\] = nan\. A diverged run"):
        assert_strategies_agree(lambda p, b: _loss(p, b) * jnp.nan, None, params, [batch] * 2)


def _nan_when_split(params, batch):  # log of a negative number on a device's 8 rows
    return _loss(params, batch) * jnp.log(batch["x"].shape[0] - 10.0)


def test_a_strategy_whose_params_turn_nan_is_named_not_a_numpy_warning():
    """Before: where every difference in a leaf involved NaN, numpy's ``nanmax`` warned
    "All-NaN slice encountered", which under ``-W error`` (this suite's filterwarnings)
    was raised instead of the disagreement."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
    batch = {"x": rng.normal(size=(64, 8)).astype(np.float32), "y": np.ones(64, np.float32)}
    with pytest.raises(AssertionError) as err:
        assert_strategies_agree(_nan_when_split, None, params, [batch])
    assert re.search(
        r"strategy 'pmap' disagrees with 'single' after step 1 of 1 \(8 devices\): "
        r"params\['b'\] = nan vs \S+ on 'single' \(largest difference in this leaf nan\)",
        str(err.value),
    ), str(err.value)


def test_assert_strategies_agree_takes_model_state_and_rng():
    """Before: no way to give ``model_state`` or ``rng`` (``step_options`` go to
    ``make_train_step``): an NNX loss (``jaxdev.nnx.loss``, ``has_state=True``) failed in
    flax's ``nnx.merge`` ("Incorrect number of leaves"), ``rng=`` was a TypeError."""
    from flax import nnx

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": np.ones(16, np.float32)}
    model = nnx.Linear(8, 1, rngs=nnx.Rngs(0))
    loss = jaxdev.nnx.loss(model, lambda m, b: (m(b["x"])[:, 0] - b["y"]) ** 2)
    params, model_state = jaxdev.nnx.split(model)
    names = assert_strategies_agree(
        loss, None, params, [batch] * 2, model_state=model_state, has_state=True
    )
    assert names == ("single", "pmap", "sharded", "shard_map", "fsdp")

    def keyed(params, batch, rng):  # takes the key, samples nothing: agrees everywhere
        return _loss(params, batch)

    def dropout(params, batch, rng):
        return _loss(params, batch) * jax.random.bernoulli(rng, 0.5, batch["y"].shape)

    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
    assert len(assert_strategies_agree(keyed, None, params, [batch], rng=jax.random.key(0))) == 5
    with pytest.raises(AssertionError, match="each device draws its own keys"):
        assert_strategies_agree(dropout, None, params, [batch], rng=jax.random.key(0))


def test_assert_strategies_agree_names_one_batch_and_a_bad_tolerance():
    """Before: one dict for ``batches`` was read as a list of its keys (a ``LeafTypeError``
    on a ``str`` leaf), one array as a list of its rows, ``rtol="1e-3"`` a bare TypeError."""
    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
    batch = {"x": np.ones((16, 8), np.float32), "y": np.ones(16, np.float32)}
    for one in (batch, batch["x"], jnp.ones((16, 8))):
        with pytest.raises(jaxdev.UsageError, match="`batches` is one batch"):
            assert_strategies_agree(_loss, None, params, one)
    with pytest.raises(jaxdev.UsageError, match="`rtol` and `atol` must be >= 0"):
        assert_strategies_agree(_loss, None, params, [batch], rtol="1e-3")


def test_assert_strategies_agree_names_the_strategy_a_loss_fails_under():
    """Before: a loss that raised only under one strategy (a Python assert on its rows, 2
    per device under pmap) escaped as a bare AssertionError naming no strategy."""

    def sixteen_rows(params, batch):
        assert batch["x"].shape[0] == 16, f"rows {batch['x'].shape}"
        return _loss(params, batch)

    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
    batch = {"x": np.ones((16, 8), np.float32), "y": np.ones(16, np.float32)}
    with pytest.raises(AssertionError, match=r"rows \(2, 8\)") as err:
        assert_strategies_agree(sixteen_rows, None, params, [batch, batch])
    note = "assert_strategies_agree: raised under strategy 'pmap' (step 1 of 2)."
    assert note in err.value.__notes__  # after JAX's own note on its filtered frames


def test_assert_strategies_agree_names_a_tx_that_is_no_transformation():
    """Before: ``optax.adam`` (not called) or a string was a bare AttributeError ('init')."""
    params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
    batch = {"x": np.ones((16, 8), np.float32), "y": np.ones(16, np.float32)}
    with pytest.raises(jaxdev.UsageError, match=r"`tx` must be an optax .* got adam: call it\."):
        assert_strategies_agree(_loss, optax.adam, params, [batch])
    with pytest.raises(jaxdev.UsageError, match=r"`tx` must be an optax .* got str\."):
        assert_strategies_agree(_loss, "sgd", params, [batch])
