"""jaxdev's pytest plugin: one test on several device counts, or as several JAX processes.

What it does: README, "Testing your own code". A worker is a pytest session of its own
(as pytest-xdist's) that reports pytest's own reports back, over a pipe or, under
``jaxdev.distributed.launch``, in a file per process. Only the standard library and
pytest are imported at start-up (``_jaxdev_pytest`` loads this file without ``import jaxdev``).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import faulthandler
import functools
import gc
import importlib.util
import inspect
import io
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import pytest

ENV = "JAXDEV_TESTING"  # a worker's orders (JSON); read and removed at start-up
DEFAULT_TIMEOUT_S = 60.0
_WORKER = json.loads(os.environ.pop(ENV, "null"))
if _WORKER and "env" in _WORKER:  # a processes test (the launcher starts it from os.environ)
    for _name in _WORKER["env"]["unset"]:
        os.environ.pop(_name, None)
    os.environ.update(_WORKER["env"]["restore"])
# a worker starts from pytest's own environment: what a conftest or test module sets at
# import it sets again there, and what the modules it does not import set stays out
_START_ENV = dict(os.environ)
_STDERR = _WORKER and open(os.dup(2), "w", buffering=1)  # the real stderr (pytest captures fd 2)
_START_S = 120  # start-up allowance of a processes test (launch + initialize + collection)
_TAIL = 30  # output lines shown for a dead worker
_TEE = ["--capture=tee-sys"]  # a worker's output also reaches its log: a crash keeps its last lines
_PINS = None  # the JAX start-up settings this process asks for (a _Pins)
if _WORKER and sys.platform == "linux":  # die with the pytest that started it (SIGKILL, timeout)
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _WORKER.get("parent", os.getppid()):  # its pytest died before the prctl
        os._exit(1)


@pytest.fixture
def jaxdev_devices(request):
    """The device count of this run of a ``@pytest.mark.devices`` test (``None`` otherwise)."""
    return getattr(request, "param", None)


def pytest_addoption(parser, pluginmanager):
    # pytest rewrites the asserts of every module of a distribution with a pytest11 entry
    # point, meant for a plugin's helpers: jaxdev is a library, so its modules stay as they
    # are (rewriting them cost ~2 s per session where bytecode is not cached, and added
    # `@py_builtins` to `dir(jaxdev)`). pytest has no public way to unmark a name.
    getattr(getattr(pluginmanager, "rewrite_hook", None), "_must_rewrite", set()).discard("jaxdev")
    parser.addoption(
        "--jaxdev-devices",
        type=int,
        metavar="N",
        help="jaxdev: start JAX's backend in this process with N CPU devices (applied after "
        "every conftest, so a conftest's own count does not win).",
    )
    parser.addini("jaxdev_devices", "jaxdev: as --jaxdev-devices N", default="")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    global _PINS
    if _WORKER is not None:
        _PINS = _Pins(_WORKER["pins"], _WORKER["platform"], _WORKER["count"], _WORKER["what"])
        return
    n = early_config.known_args_namespace.jaxdev_devices
    try:
        n = early_config.getini("jaxdev_devices") if n is None else n
    except (TypeError, pytest.UsageError) as e:  # pytest 9's [tool.pytest]: a TOML int
        raise pytest.UsageError(f'{e}. Write it as a string: jaxdev_devices = "4".') from None
    if n != "":
        what = f"--jaxdev-devices {n}"
        if not str(n).isdigit() or int(n) < 1:
            raise pytest.UsageError(f"{what}: N must be an int >= 1.")
        _PINS = _Pins({"jax_num_cpu_devices": int(n)}, "cpu", int(n), what)


def pytest_plugin_registered(plugin):
    if _PINS is not None and os.path.basename(getattr(plugin, "__file__", "")) == "conftest.py":
        _PINS.apply(plugin.__file__)  # a conftest may have set its own count


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    for marker in (
        "devices(*counts, platform='cpu'): jaxdev: run the test once per count, each in a "
        "worker process whose JAX backend has that many devices",
        "processes(n, devices=m, timeout=60): jaxdev: run the test as n jax.distributed "
        "processes with m fake CPU devices each",
    ):
        config.addinivalue_line("markers", marker)
    session = _Worker(config) if _WORKER is not None else _Controller(config)
    config.pluginmanager.register(session, "jaxdev-session")
    if _WORKER and "run_dir" in _WORKER:  # a processes test: one tmp_path for them all
        config.pluginmanager.register(_SharedTmpPath(), "jaxdev-tmp-path")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if _WORKER is None:
        return None
    config.workerinput = {"workerid": _WORKER["id"]}  # pytest's plugins act as under xdist
    config.args = _WORKER["files"]
    base = _WORKER["basetemp"]
    pid = os.environ.get("JAXDEV_PROCESS_ID")
    overrides = dict(lf=False, failedfirst=False, newfirst=False, stepwise=False, maxfail=0)
    overrides.update(usepdb=False, keyword="", markexpr="", deselect=[])
    overrides.update(dist="no", distload=False, numprocesses=None, tx=[])  # no xdist in it
    overrides["basetemp"] = base and (f"{base}-p{pid}" if pid else base)
    for name, value in overrides.items():
        if hasattr(config.option, name):
            setattr(config.option, name, value)
    return None


_WHY = pytest.StashKey[str]()  # why a test's marks cannot be honoured


def pytest_itemcollected(item):
    """A mark written above a decorator that makes new test methods (absl's
    ``@parameterized.*``) is left on that decorator's object: read it from the ``def``
    ``item`` wraps and add ours it lacks, or stash why one cannot be read."""
    fn = getattr(item, "obj", None)
    inner = inspect.unwrap(fn) if callable(fn) else fn
    if inner is fn or not inspect.isfunction(inner):
        return
    source, decorators = _decorators(inner)
    # a class-scope name is found here (and the mark itself then fails by name, below)
    mro = getattr(getattr(item, "cls", None), "__mro__", ())
    names = collections.ChainMap(inner.__globals__, *map(vars, mro))  # its module's, its class's
    for node in decorators:
        head = node.func if isinstance(node, ast.Call) else node
        if not isinstance(head, (ast.Name, ast.Attribute)):
            continue
        try:  # a name's value (no call): is it one of ours?
            head = eval(ast.unparse(head), inner.__globals__, names)
        except Exception:  # not a name there: not a mark
            continue
        if not (isinstance(head, pytest.MarkDecorator) and head.name in ("devices", "processes")):
            continue
        try:  # the decorator's own expression, as Python evaluated it at import
            code = compile(ast.Expression(node), inner.__code__.co_filename, "eval")
            mark = eval(code, inner.__globals__)
        except Exception as e:
            item.stash[_WHY] = (
                f"@{ast.get_source_segment(source, node)} sits above a decorator that makes new "
                f"test methods (absl's @parameterized), and jaxdev could not read it again "
                f"({type(e).__name__}: {e}). Put the mark below that decorator."
            )
            return
        if isinstance(mark, pytest.MarkDecorator) and mark.mark not in item.own_markers:
            item.add_marker(mark)


@functools.cache  # absl makes many test methods of one def
def _decorators(fn) -> tuple[str, list]:
    """The source of ``fn``'s ``def`` and its decorators' AST nodes (none without source)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        return source, getattr(ast.parse(source).body[0], "decorator_list", [])
    except (OSError, TypeError, SyntaxError):  # no source of a def: nothing to read
        return "", []


def _closest(node, name: str):
    """``node``'s closest ``name`` mark; a subclass's own before its bases' (pytest's: base's)."""
    owner, mark = next(node.iter_markers_with_node(name), (None, None))
    for cls in getattr(owner.obj, "__mro__", ()) if isinstance(owner, pytest.Class) else ():
        own = cls.__dict__.get("pytestmark", [])
        own = own if isinstance(own, list) else [own]
        if found := [getattr(m, "mark", m) for m in own if m.name == name]:
            return found[0]
    return mark


def pytest_generate_tests(metafunc):
    mark = _closest(metafunc.definition, "devices")
    if mark is not None and isinstance(counts := _counts(mark), list):
        if "jaxdev_devices" not in metafunc.fixturenames:
            metafunc.fixturenames.append("jaxdev_devices")
        ids = [f"devices={n}" for n in counts]
        metafunc.parametrize("jaxdev_devices", counts, indirect=True, ids=ids)


def _counts(mark) -> list[int] | str:
    """The counts of a ``devices`` marker, or what is wrong with it."""
    bad = [a for a in mark.args if not _is_count(a)]
    extra = set(mark.kwargs) - {"platform"}
    if not mark.args or bad or extra:
        why = f"got {bad[0]!r}" if bad else f"unknown {sorted(extra)}" if extra else "got none"
        return f"device counts must be ints >= 1 and `platform=`, {why}. E.g. devices(1, 2, 8)."
    if len(set(mark.args)) < len(mark.args):
        return f"each device count once, got {list(mark.args)}. E.g. devices(1, 2, 8)."
    if mark.kwargs.get("platform", "cpu") not in ("cpu", "gpu"):
        return f"`platform` must be 'cpu' or 'gpu', got {mark.kwargs['platform']!r}."
    return list(mark.args)


def _plan(item) -> tuple | str | None:
    """``('devices', platform, n)``, ``('processes', n, m, timeout)``, an error, or None."""
    if item.get_closest_marker("skip"):  # it skips here: no worker or process starts for it
        return None
    dev, proc = _closest(item, "devices"), _closest(item, "processes")
    if why := item.stash.get(_WHY, None):
        return f"{item.nodeid}: {why}"
    if dev is None and proc is None:
        return None
    count = getattr(item, "callspec", None) and item.callspec.params.get("jaxdev_devices")
    if dev is not None and isinstance(why := _counts(dev), str):
        return f"{item.nodeid}: @pytest.mark.{_shown(dev)}: {why}"
    if dev is not None and count is None:  # not parametrized by pytest: a unittest method
        if len(dev.args) > 1:
            why = "a unittest.TestCase test runs on one device count (pytest parametrizes "
            why += f"test functions only): give one, e.g. devices({dev.args[-1]})."
            return f"{item.nodeid}: @pytest.mark.{_shown(dev)}: {why}"
        count = dev.args[0]
    if proc is None:
        return ("devices", dev.kwargs.get("platform", "cpu"), count)
    why = _processes(proc, count)
    if isinstance(why, str):
        return f"{item.nodeid}: @pytest.mark.{_shown(proc)}: {why}"
    return ("processes", *why)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _processes(mark, total: int | None) -> tuple | str:
    n, m = (mark.args or (None,))[0], mark.kwargs.get("devices")
    timeout = mark.kwargs.get("timeout", DEFAULT_TIMEOUT_S)
    extra = sorted(set(mark.kwargs) - {"devices", "timeout"})
    if len(mark.args) != 1 or not _is_count(n) or extra:
        got = f"unknown {extra}" if extra else f"got {list(mark.args)}"
        return (
            f"give one process count >= 1, `devices=`, `timeout=` ({got}): processes(2, devices=4)."
        )
    if total is not None and m is not None:
        return "give the devices once: `devices=` per process, or a devices(...) marker in all."
    if total is not None and total % n:
        return f"devices({total}) in all do not divide over {n} processes; use a multiple of {n}."
    m = total // n if total is not None else m
    if m is None:
        return "`devices=` is missing: the fake CPU devices per process, e.g. devices=4."
    if not _is_count(m):
        return f"`devices=` must be an int >= 1 (devices per process), got {m!r}."
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        return f"`timeout=` must be a number of seconds > 0, got {timeout!r}."
    return n, m, float(timeout)


def _shown(mark) -> str:
    args = [repr(a) for a in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
    return f"{mark.name}({', '.join(args)})"


def _failed(item, when: str, text: str) -> pytest.TestReport:
    keywords = {k: 1 for k in item.keywords}
    return pytest.TestReport(item.nodeid, item.location, keywords, "failed", text, when)


def _crash(report) -> str:
    """A failed report's exception line (its crash message, else its text's last line)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = str(report.longrepr).strip().splitlines() or [""]
    return crash.message if crash is not None else lines[-1]


def _describe(rc: int) -> str:
    from jaxdev.distributed import describe_returncode

    oom = " (the kernel's OOM killer sends SIGKILL)" if rc == -9 else ""
    return describe_returncode(rc) + oom


class _Pins:
    """JAX settings this process asks for, applied until the backend starts, then checked."""

    def __init__(self, settings: dict, platform: str, n: int, what: str):
        self.settings, self.platform, self.n, self.what = settings, platform, n, what
        self.started_by, self.hooked = None, False
        for name, value in settings.items():  # JAX_PLATFORMS...: read when jax is imported
            os.environ[name.upper()] = str(value)
        if "jax" in sys.modules:
            self.apply(None)
        else:  # hook the backend's start as soon as jax is imported, to name who starts it
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path, target=None):
        """Import hook: once ``jax._src.xla_bridge`` runs, record who starts the backend."""
        if name != "jax._src.xla_bridge":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (run(module), self._hook(module))
        return spec

    def _hook(self, xla_bridge) -> None:
        """Record who starts the backend: its first ``backends()`` call (jax has no public
        hook on it; 0.10's private one is gone in 0.12)."""
        if self.hooked:
            return
        self.hooked, backends = True, xla_bridge.backends

        def first_call():
            if self.started_by is None and not xla_bridge.backends_are_initialized():
                self.started_by = traceback.extract_stack()
            return backends()

        xla_bridge.backends = first_call

    def apply(self, where: str | None) -> bool:
        """Apply the settings if JAX is imported; ``True``: too late, its backend started."""
        if "jax" not in sys.modules:
            return False
        import jax
        from jax._src import xla_bridge  # no public API tells whether the backend started

        if xla_bridge.backends_are_initialized():
            if self.started_by is None:
                self.started_by = f"while pytest imported {where}" if where else "before pytest ran"
            return True
        for name, value in self.settings.items():
            jax.config.update(name, value)
        self._hook(xla_bridge)
        return False

    def check(self) -> str | None:
        """Start the backend; return what is wrong with its devices, or None."""
        self.apply(None)
        import jax

        try:
            have = len(jax.devices(self.platform))
        except (RuntimeError, AssertionError) as e:  # JAX could not start that platform
            why = f"{type(e).__name__}: {e}" if str(e) else "no device visible"
            return f"{self.what} asks for {self.n} {self.platform} device(s); JAX has none ({why})."
        if have == self.n:
            return None
        at = self.started_by or ""
        if isinstance(at, list):  # a stack: the innermost user frame
            from jaxdev.distributed import is_user_file

            user = [f for f in at if is_user_file(f.filename) and f.filename != __file__]
            at = f"at {user[-1].filename}:{user[-1].lineno}: `{user[-1].line}`" if user else ""
        return (
            f"{self.what} asks JAX for {self.n} {self.platform} device(s), but its backend "
            f"already started with {have} {at}. Fix: nothing may touch a "
            "device (jax.devices(), an array, device_put) at import of a conftest or test "
            "module: move that call into a fixture or the test."
        )


class _Controller:
    """In the pytest process: sends marked tests to workers or processes, logs their reports."""

    def __init__(self, config):
        self.config = config
        self.files: dict[tuple, set[str]] = {}  # worker key: the files of its tests
        self.next: dict[str, str | None] = {}  # nodeid: the next test of the same worker
        self.workers: dict[tuple, _Handle] = {}
        self.pools: dict[tuple, _Pool] = {}  # (n, m): processes kept for the next test
        self.ending: list[_Handle] = []  # told to end, not yet waited for
        self.broken: dict[tuple, str] = {}  # worker key: why it never started
        self.started = 0

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        last: dict[tuple, str] = {}
        for item in session.items:
            if isinstance(key := _plan(item), tuple):
                key = key[:3]  # processes: one pool per shape
                self.files.setdefault(key, set()).add(str(item.path))
                self.next[last.get(key, "")] = _base_id(item)
                last[key] = item.nodeid
        if _PINS is not None and _PINS.apply(None) and (why := _PINS.check()):
            raise pytest.UsageError(why)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        plan = _plan(item)
        if plan is None:
            return None
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        if isinstance(plan, str):
            reports = [_failed(item, "setup", plan)]
        elif plan[0] == "devices":
            reports = self._on_worker(item, plan, self._next(item, nextitem, plan))
        else:
            reports = _as_processes(self, item, *plan[1:], self._next(item, nextitem, plan[:3]))
        for report in reports:
            report.nodeid = item.nodeid  # with xdist's "@group" if it gave one
            item.ihook.pytest_runtest_logreport(report=report)
        # what pytest's own protocol does after each item: tear down the in-process
        # collectors (module, class) the next item does not share (pytest has no public API)
        item.session._setupstate.teardown_exact(nextitem)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def pytest_sessionfinish(self):
        for key in list(self.workers):
            self._close(key)
        for pool in self.pools.values():
            pool.close()
        for worker in self.ending:  # they tear down and exit in parallel
            worker.wait(30)

    def _next(self, item, nextitem, key: tuple) -> str | None:
        """The next test ``key``'s worker runs (for its teardown); under xdist: only if ours."""
        if not hasattr(self.config, "workerinput"):
            return self.next.get(item.nodeid)
        plan = nextitem and _plan(nextitem)
        return _base_id(nextitem) if isinstance(plan, tuple) and plan[:3] == key else None

    def _on_worker(self, item, key: tuple, nextid: str | None) -> list:
        if key in self.broken:
            return [_failed(item, "setup", f"{item.nodeid}: {self.broken[key]}")]
        if not self.started and not hasattr(self.config, "workerinput"):  # not under xdist:
            # start every worker this session needs at once (xdist shares the tests out)
            self.workers = {k: self._start(k) for k in self.files if k[0] == "devices"}
        worker = self.workers.get(key) or self.workers.setdefault(key, self._start(key))
        reports, msg = [], None
        try:
            if not worker.ready and (why := worker.wait_ready()):
                self.broken[key] = why
                self._close(key)
                return [_failed(item, "setup", f"{item.nodeid}: {why}")]
            _send(worker.cmd, run=_base_id(item), next=nextid)
            while (msg := worker.recv()) is not None and "report" in msg:
                reports.append(_report(self.config, msg["report"]))
            if msg is not None and "missing" in msg:
                reports.append(_failed(item, "setup", msg["missing"]))
        except KeyboardInterrupt:  # Ctrl-C ends its test now, not when the test returns
            worker.proc.send_signal(signal.SIGINT)
            worker.wait(5)
            raise
        except (Exception, pytest.fail.Exception) as e:  # pytest-timeout's alarm; a dead pipe
            msg = None
            if worker.proc.poll() is None:
                worker.proc.kill()
                msg, why = {"restart": True}, f"stopped waiting for its worker ({worker.what}): {e}"
                reports.append(_failed(item, _next_phase(reports), why + "; it was killed."))
        if msg is None:
            rc = worker.proc.wait()
            why = f"the jaxdev worker for {worker.what} (pid {worker.proc.pid}) died running "
            why += f"this test: {_describe(rc)}. Its last output lines:\n{worker.tail()}\n"
            why += "The next test gets a new worker."
            reports.append(_failed(item, _next_phase(reports), why))
        if msg is None or msg.get("restart"):
            self._close(key)
            worker.wait(5)
        elif self.next.get(item.nodeid) is None:  # its last test: it ends while others run
            self._close(key)
        return reports

    def _start(self, key: tuple) -> _Handle:
        self.started += 1
        return _Handle(self.config, key, sorted(self.files.get(key, ())), self.started)

    def _close(self, key: tuple) -> None:
        worker = self.workers.pop(key, None)
        if worker is not None:  # EOF on its commands: it tears its fixtures down and exits
            with contextlib.suppress(OSError):  # it died: the pipe is broken
                worker.cmd.close()
            self.ending.append(worker)


def _base_id(item) -> str:
    """``item``'s node id without the ``@group`` xdist's ``--dist loadgroup`` appends."""
    if item.get_closest_marker("xdist_group") is None:
        return item.nodeid
    return re.sub(r"@[^\]/:]*$", "", item.nodeid)


def _send(pipe, **msg) -> None:
    """One message, a JSON line (the worker protocol both ways)."""
    pipe.write(json.dumps(msg, default=repr) + "\n")
    pipe.flush()


def _next_phase(reports: list) -> str:
    return ("setup", "call", "teardown")[min(len(reports), 2)]


def _report(config, data: dict):
    data["location"] = tuple(data["location"])
    if isinstance(data.get("longrepr"), list):
        data["longrepr"] = tuple(data["longrepr"])
    return config.hook.pytest_report_from_serializable(config=config, data=data)


class _Handle:
    """A worker process of one device count and the pipes to it."""

    def __init__(self, config, key: tuple, files: list[str], number: int):
        _, platform, n = key
        self.what, self.ready = f"devices={n}" + (", platform='gpu'" * (platform == "gpu")), False
        (cmd_r, cmd_w), (res_r, res_w) = os.pipe(), os.pipe()
        what, name = f"the worker for {self.what}", f"{platform}{n}-{number}"
        orders = dict(files=files, fds=[cmd_r, res_w], id=f"jaxdev-{platform}{n}")
        env = {**_START_ENV, ENV: _orders(config, name, platform, n, what, orders)}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *config.invocation_params.args, *_TEE],
            cwd=config.invocation_params.dir,
            env=env,
            pass_fds=(cmd_r, res_w),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        os.close(cmd_r)
        os.close(res_w)
        self.cmd, self.res = os.fdopen(cmd_w, "w"), os.fdopen(res_r, "r")

    def recv(self) -> dict | None:
        line = self.res.readline()
        return json.loads(line) if line else None

    def wait_ready(self) -> str | None:
        """Wait until the worker collected its files; return why it did not start, or None."""
        if (msg := self.recv()) is not None:
            self.ready = "ready" in msg
            return msg.get("error")
        rc = self.proc.wait()
        return f"the jaxdev worker for {self.what} never started ({_describe(rc)}):\n{self.tail()}"

    def tail(self) -> str:
        self.log.seek(0)
        return _quiet(self.log.read().decode(errors="replace"), _TAIL) or "(none)"

    def wait(self, wait_s: float) -> None:
        """Wait for its exit; kill it after ``wait_s``."""
        if self.res.closed:
            return
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.res.close()
        self.log.close()


def _quiet(text: str, limit: int) -> str:
    """The last ``limit`` lines of ``text`` without pytest's, pluggy's and runpy's stack frames."""
    noise = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", "<frozen runpy>", __file__)
    noise += (os.path.join("pytest", "__main__.py"),)
    kept, dropped = [], False
    for line in text.splitlines():
        code = re.sub(r"^\[p\d+\] ", "", line).startswith("    ")  # a frame's source line
        dropped = any(n in line for n in noise) or (dropped and code)
        if not dropped:
            kept.append(line)
    return "\n".join(kept[-limit:])


def _orders(config, name: str, platform: str, n: int, what: str, orders: dict) -> str:
    """A worker's orders (JSON): JAX settings for ``n`` ``platform`` devices, parent, basetemp."""
    pins = {"jax_platforms": "cpu", "jax_num_cpu_devices": n}
    if platform == "gpu":  # the first n GPUs
        pins = {"jax_platforms": "cuda", "jax_cuda_visible_devices": ",".join(map(str, range(n)))}
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's own (as xdist uses it)
    base = None if factory is None else str(factory.getbasetemp() / f"jaxdev-{name}")
    orders.update(pins=pins, platform=platform, count=n, what=what)
    return json.dumps({**orders, "parent": os.getpid(), "basetemp": base})


class _Pool:
    """``n`` processes x ``m`` devices under the launcher (a thread) running the tests sent
    (``cmd-K.json``) until one fails, dies, times out or leaves them unsafe."""

    def __init__(self, config, n: int, m: int, files: list[str], timeout: float):
        from jaxdev.distributed import launch

        self.n, self.k, self.out, self.rc = n, 0, io.StringIO(), None
        self.dir = tempfile.mkdtemp(prefix="jaxdev-processes-")
        # from pytest's own environment, as a devices worker: os.environ as it started
        restore = {k: v for k, v in _START_ENV.items() if os.environ.get(k) != v}
        start = dict(unset=sorted(set(os.environ) - set(_START_ENV)), restore=restore)
        orders = dict(id="jaxdev-p", run_dir=self.dir, files=files, env=start)
        what = f"processes({n}, devices={m})"
        env = {ENV: _orders(config, os.path.basename(self.dir), "cpu", m, what, orders)}
        env["JAXDEV_SHUTDOWN_TIMEOUT"] = f"{timeout + 30:g}"  # a process waits for the others
        cmd = [sys.executable, "-m", "pytest", *config.invocation_params.args, *_TEE]

        def run():
            try:
                self.rc = launch(cmd, n, m, env=env, out=self.out)
            except Exception as e:  # the processes were ended
                self.rc = f"stopped: {type(e).__name__}: {e}"

        self.thread = threading.Thread(target=run, name="jaxdev-launch", daemon=True)
        self.thread.start()

    def send(self, **cmd) -> int:
        k, self.k = self.k, self.k + 1
        pathlib.Path(self.dir, "cmd.tmp").write_text(json.dumps(cmd))
        os.replace(os.path.join(self.dir, "cmd.tmp"), os.path.join(self.dir, f"cmd-{k}.json"))
        return k

    def wait(self, k: int, wait_s: float) -> list | None:
        """Each process's ``done`` message for test ``k``; None if one ended or ran over."""
        paths = [os.path.join(self.dir, f"p{i}-{k}.done") for i in range(self.n)]
        deadline = time.monotonic() + wait_s
        while not all(map(os.path.exists, paths)) and self.thread.is_alive():
            if time.monotonic() > deadline:  # one is stuck where its own timer cannot run
                self.rc = f"stopped waiting after {wait_s:g} s; the processes were killed"
                return self.kill()
            time.sleep(0.02)
        with contextlib.suppress(FileNotFoundError):
            return [json.loads(pathlib.Path(p).read_text()) for p in paths]
        return None

    def kill(self) -> None:
        for i in range(self.n):  # each by its own pid (the launcher then ends)
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pathlib.Path(self.dir, f"p{i}.pid").read_text()), signal.SIGKILL)

    def close(self) -> None:
        """Tell the processes to end; wait for the launcher (kill them after 60 s)."""
        self.send(end=True)
        self.thread.join(60)
        if self.thread.is_alive():
            self.kill()
            self.thread.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _as_processes(ctrl, item, n: int, m: int, timeout: float, nextid: str | None) -> list:
    """Run ``item`` as ``n`` processes x ``m`` devices, on warm ones of that shape; its reports."""
    head = f"{item.nodeid} as {n} processes x {m} devices (timeout={timeout:g} s)"
    pool = ctrl.pools.get((n, m))
    if pool is None:
        files = sorted(ctrl.files.get(("processes", n, m), {str(item.path)}))
        pool = ctrl.pools[n, m] = _Pool(ctrl.config, n, m, files, timeout)
    factory = getattr(ctrl.config, "_tmp_path_factory", None)  # pytest's own (as xdist's)
    shared = factory and str(factory.mktemp(re.sub(r"\W", "_", item.name)[:30], numbered=True))
    start = len(pool.out.getvalue())
    k = pool.send(run=_base_id(item), next=nextid, timeout=timeout, tmp_path=shared)
    try:
        done = pool.wait(k, _START_S * (k == 0) + timeout + 30)
    except (Exception, pytest.fail.Exception, KeyboardInterrupt) as e:  # Ctrl-C, pytest-timeout
        pool.kill()
        if isinstance(e, KeyboardInterrupt):
            raise
        done, pool.rc = None, f"stopped: {type(e).__name__}: {e}"
    if done is None or any(d["restart"] for d in done) or not pool.thread.is_alive():
        del ctrl.pools[n, m]
        pool.thread.join(0 if done else 60)  # the launcher ends the others, then summarizes
    per = [_read(ctrl.config, os.path.join(pool.dir, f"p{i}-{k}.jsonl")) for i in range(n)]
    if (n, m) not in ctrl.pools:
        pool.close()
    rc, tail = 0 if pool.rc is None else pool.rc, _quiet(pool.out.getvalue()[start:], 200)
    done = []
    for when in ("setup", "call", "teardown"):  # a phase may report more than once: subtests
        got = [[r for r in reports if r.when == when] for reports in per]
        failed = [(i, r) for i, rs in enumerate(got) for r in rs if r.failed]
        if failed := sorted(failed, key=lambda f: f[1].stop):  # the first to fail first
            i, report = failed[0]  # named in its crash line, with every process's output
            who, longrepr = f"process {i} of {n}", report.longrepr
            crashes: dict[int, str] = {}  # each failed process's first crash line
            for j, r in failed:
                crashes.setdefault(j, f"process {j} of {n}: {_crash(r)}")
            if len(crashes) > 1:
                tail = "\n".join(["failed, first to last:", *crashes.values(), "", tail])
            if hasattr(longrepr, "addsection"):
                if getattr(longrepr, "reprcrash", None) is not None:
                    longrepr.reprcrash.message = f"{who}: {longrepr.reprcrash.message}"
                longrepr.addsection(f"{who} failed; the processes' output", tail)
            else:
                report.longrepr = f"{who} failed:\n{longrepr}\n\nThe processes' output:\n{tail}"
            return [*done, *got[i]]
        if all(got):
            done.extend(got[0])
        elif rc != 0 or any(got):
            missing = [i for i, rs in enumerate(got) if not rs]
            why = f"{head}: process(es) {missing} did not finish the {when} (launcher: {rc})"
            return [*done, _failed(item, when, f"{why}. The processes' output:\n{tail}")]
    if rc != 0:
        why = f"{head}: every process passed, but the launcher returned {rc}:\n{tail}"
        done.append(_failed(item, "teardown", why))
    return done


def _read(config, path: str) -> list:
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [_report(config, json.loads(line)["report"]) for line in f]
    return []


class _Worker:
    """In a worker: runs the tests it is sent and reports back; flags threads left behind."""

    def __init__(self, config):
        self.config, self.tainted, self.before, self.errors = config, False, None, {}
        self.out = None
        config.pluginmanager.unregister(name="terminalreporter")  # the controller prints
        config.pluginmanager.register(_Quiet(config, open(os.devnull, "w")), "terminalreporter")

    def pytest_sessionstart(self, session):
        if "run_dir" in _WORKER:
            from jaxdev.distributed import initialize

            try:
                initialize()
            except Exception as e:  # e.g. a conftest started JAX's backend at import
                why = _PINS.check() or f"jaxdev.distributed.initialize(): {type(e).__name__}: {e}"
                print(f"jaxdev: {why}", file=_STDERR)
                os._exit(3)

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors[report.nodeid] = report.longreprtext

    def pytest_runtest_logreport(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        _send(self.out, report=data)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        items = {_base_id(item): item for item in session.items}
        if "run_dir" in _WORKER:
            return self._run_processes(session, items)
        commands, self.out = os.fdopen(_WORKER["fds"][0]), os.fdopen(_WORKER["fds"][1], "w")
        why = _PINS.check()
        _send(self.out, **({"error": why} if why else {"ready": len(items)}))
        for line in () if why else commands:
            msg = json.loads(line)
            item = items.get(msg["run"])
            if item is None:
                _send(self.out, missing=self._missing(msg["run"]))
                continue
            item.ihook.pytest_runtest_protocol(item=item, nextitem=items.get(msg["next"]))
            _send(self.out, done=True, restart=self.tainted)
        return True

    def _run_processes(self, session, items: dict) -> bool:
        """Run the tests sent (``cmd-K.json``) until told to end; exit at a failure."""
        import jax

        me, folder = jax.process_index(), pathlib.Path(_WORKER["run_dir"])
        (folder / f"p{me}.pid").write_text(str(os.getpid()))
        for k in itertools.count():
            path = folder / f"cmd-{k}.json"
            while not path.exists():  # the next test, or the end
                time.sleep(0.01)
            if (cmd := json.loads(path.read_text())).get("end"):
                return True
            _WORKER["tmp_path"], failed = cmd["tmp_path"], session.testsfailed
            with open(folder / f"p{me}-{k}.jsonl", "w") as self.out:
                self._run_one(items.get(cmd["run"]), cmd, items.get(cmd["next"]))
            failed = cmd["run"] not in items or session.testsfailed > failed
            restart = failed or self.tainted or not jax.distributed.is_initialized()
            (folder / f"p{me}.tmp").write_text(json.dumps({"restart": restart}))
            os.replace(folder / f"p{me}.tmp", folder / f"p{me}-{k}.done")
            if failed:  # the others may wait for this one forever
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)  # now: the launcher ends them (JAX's shutdown would wait)

    def _run_one(self, item, cmd: dict, nextitem) -> None:
        import jax

        if item is None:
            print(self._missing(cmd["run"]), file=_STDERR)
            return
        # at the timeout each process still running prints its stacks (faulthandler: even
        # with the GIL held; all at about the same time), and ends 2 s later
        seconds = cmd["timeout"]
        why = f"jaxdev: {item.nodeid} in process {jax.process_index()} did not finish within "
        why += f"timeout={seconds:g} s (its stacks are above); ending it."
        faulthandler.dump_traceback_later(seconds, file=_STDERR)
        end = threading.Timer(seconds + 2, lambda: (print(why, file=_STDERR), os._exit(1)))
        end.daemon = True
        end.start()
        item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        faulthandler.cancel_dump_traceback_later()
        end.cancel()

    def _missing(self, nodeid: str) -> str:
        why = [text for prefix, text in self.errors.items() if prefix and nodeid.startswith(prefix)]
        return f"{nodeid}: {_WORKER['what']} did not collect this test" + (
            f":\n{why[0]}" if why else " (its collection differs from this session's)."
        )

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        self.before = set(threading.enumerate())
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        result = yield
        before, self.before = self.before, None
        new = [] if before is None else [t for t in threading.enumerate() if t not in before]
        if new:  # still alive after a collection (a Prefetcher nobody holds closes) and 1 s
            gc.collect()
            deadline = time.monotonic() + 1.0
            for t in new:
                t.join(max(0.0, deadline - time.monotonic()))
        if left := [t for t in new if t.is_alive()]:
            self.tainted = True
            names = ", ".join(repr(t.name) for t in left)
            hint = " ('jaxdev-prefetch' is an open jaxdev Prefetcher: close it, or use `with "
            hint += "jaxdev.prefetch_to_device(...) as batches:`)"
            hint *= any(t.name == "jaxdev-prefetch" for t in left)
            then = f"; {_WORKER['what']} {'are' if 'run_dir' in _WORKER else 'is'} replaced"
            pytest.fail(
                f"{item.nodeid} left {len(left)} thread(s) running after its teardown: {names}"
                f"{hint}. Stop and join them in the test or its fixtures{then}.",
                pytrace=False,
            )
        return result


class _SharedTmpPath:
    """In a ``processes`` test: ``tmp_path`` is the one folder the launching pytest made."""

    @pytest.fixture
    def tmp_path(self):
        return pathlib.Path(_WORKER["tmp_path"])


class _Quiet(pytest.TerminalReporter):
    """A worker's terminal: nothing shown, no summary (hypothesis's imports hypothesis: slow)."""

    pytest_sessionfinish = None
