"""The pytest plugin's cost (issue 28): workers per device count vs in-process vs a fresh pytest.

Run: ``python benchmarks/testing_bench.py [--repeats 3] [--fresh 8] [--json PATH]``.

A temporary project whose conftest sets 8 CPU devices holds 20 small jitted
tests. Each variant is a whole ``python -m pytest -q -p no:cacheprovider``
run, timed from outside (wall clock), the variants interleaved, medians over
``--repeats``:

* ``in_process``: the 20 tests unmarked, on the 8 devices of the pytest
  process (20 items);
* ``plugin``: the same tests marked ``@pytest.mark.devices(2, 8)`` (40 items,
  one worker per count);
* ``trivial_plugin`` / ``trivial_in_process``: 40 empty tests marked
  ``devices(8)``, or not; ``one_2``: one empty test marked ``devices(2)``;
* ``fresh``: ``python -m pytest <nodeid>`` per item with
  ``JAX_NUM_CPU_DEVICES=n``, the pattern written by hand: ``--fresh`` items
  timed, the mean times 40.

The conftest also records, in the pytest process, each item's wall time
(``logstart`` to ``logfinish``) and the durations of its reports (setup,
call, teardown, as the worker measured them). A worker's start-up is the
wall time of its first item (``trivial_plugin``'s first item, ``one_2``'s
item); the cost per item is the median of wall minus durations over the
other items of ``trivial_plugin``, less the same for ``trivial_in_process``.

Targets: ``plugin <= 2 * (in_process + start-up(2) + start-up(8))`` and
``fresh >= 5 * plugin``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from mp_scripts.child_env import clean_env  # noqa: E402

CONFTEST = """
import json, os, time, jax
jax.config.update("jax_num_cpu_devices", 8)
ITEMS = {}  # nodeid: [logstart, sum of report durations, logfinish]

def pytest_runtest_logstart(nodeid):
    ITEMS[nodeid] = [time.perf_counter(), 0.0]

def pytest_runtest_logreport(report):
    ITEMS[report.nodeid][1] += report.duration

def pytest_runtest_logfinish(nodeid):
    ITEMS[nodeid].append(time.perf_counter())

def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the pytest process, not a worker
        with open(os.environ["BENCH_ITEMS"], "w") as f:
            json.dump(list(ITEMS.values()), f)
"""

TESTS = """
import jax, jax.numpy as jnp, pytest
{marker}
@pytest.mark.parametrize("i", range(20))
def test_jitted(i):
    x = jnp.arange(64.0).reshape(8, 8) + i
    f = jax.jit(lambda a: (a @ a.T).sum() * (i + 1))
    assert float(f(x)) == float(((x @ x.T).sum()) * (i + 1))
"""

TRIVIAL = """
import pytest
{marker}
@pytest.mark.parametrize("i", range({n}))
def test_empty(i):
    pass
"""


def _project() -> str:
    root = tempfile.mkdtemp(prefix="jaxdev-testing-bench-")
    files = {
        "conftest.py": CONFTEST,
        "test_in_process.py": TESTS.format(marker=""),
        "test_plugin.py": TESTS.format(marker="@pytest.mark.devices(2, 8)"),
        "test_trivial_in_process.py": TRIVIAL.format(marker="", n=40),
        "test_trivial_plugin.py": TRIVIAL.format(marker="@pytest.mark.devices(8)", n=40),
        "test_one_2.py": TRIVIAL.format(marker="@pytest.mark.devices(2)", n=1),
    }
    for name, text in files.items():
        with open(os.path.join(root, name), "w") as f:
            f.write(textwrap.dedent(text))
    return root


def _pytest(root: str, *args: str, **env: str) -> tuple[float, list]:
    """Wall seconds of one ``python -m pytest`` run (it must pass), and its items' timings."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    items = os.path.join(root, "items.json")
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=root, env=clean_env(BENCH_ITEMS=items, **env), capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(items) as f:
        return seconds, json.load(f)


def _overheads(items: list) -> list[float]:
    """Per item: wall time in the pytest process minus the durations it reported."""
    return [end - start - inside for start, inside, end in items]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fresh", type=int, default=8, help="items timed for `fresh`")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = _project()
    names = ["in_process", "plugin", "trivial_in_process", "trivial_plugin", "one_2"]
    _pytest(root, "test_plugin.py")  # warm-up: .pyc files, the OS file cache
    runs: dict[str, list] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            runs[name].append(_pytest(root, f"test_{name}.py"))
    fresh = []
    for i in range(args.fresh):  # every other item on 2, the others on 8 devices
        n = 2 if i % 2 else 8
        node = f"test_in_process.py::test_jitted[{i % 20}]"
        fresh.append(_pytest(root, node, JAX_NUM_CPU_DEVICES=str(n))[0])
    wall = {name: statistics.median(s for s, _ in r) for name, r in runs.items()}
    start_2 = statistics.median(items[0][2] - items[0][0] for _, items in runs["one_2"])
    start_8 = statistics.median(items[0][2] - items[0][0] for _, items in runs["trivial_plugin"])
    steady = [o for _, items in runs["trivial_plugin"] for o in _overheads(items)[1:]]
    local = [o for _, items in runs["trivial_in_process"] for o in _overheads(items)]
    per_item_ms = 1000 * (statistics.median(steady) - statistics.median(local))
    fresh_40 = statistics.mean(fresh) * 40
    budget = 2 * (wall["in_process"] + start_2 + start_8)
    rows = {
        "in_process: 20 items, 8 devices (s)": wall["in_process"],
        "plugin: 40 items, devices(2, 8) (s)": wall["plugin"],
        "worker start-up, devices=2 / devices=8 (s)": (start_2, start_8),
        "2 x (in_process + start-ups) (s); plugin within": (budget, wall["plugin"] <= budget),
        "cost per item, plugin - in-process (ms)": per_item_ms,
        "fresh python -m pytest per item, x40 (s)": fresh_40,
        "fresh / plugin; >= 5": (fresh_40 / wall["plugin"], fresh_40 >= 5 * wall["plugin"]),
    }
    for what, value in rows.items():
        shown = value if isinstance(value, tuple) else (value,)
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in shown]
        print(f"| {what} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall": wall, "fresh": fresh, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
