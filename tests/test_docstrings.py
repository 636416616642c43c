"""Every docstring example in jaxdev runs and prints what it shows (doctest, 8 fake CPUs)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jaxdev

MODULES = sorted(
    m.name[len("jaxdev.") :]
    for m in pkgutil.walk_packages(jaxdev.__path__, "jaxdev.")
    if not m.name.endswith("._plugin")  # loaded by pytest only (tests/test_testing_plugin.py)
)
NAMESPACES = ("d2l", "distributed", "memory", "meter", "metrics", "nnx", "pmap", "testing")


def test_every_public_function_has_an_example():
    public = [getattr(jaxdev, n) for n in dir(jaxdev) if not n.startswith("_")]
    public += [
        getattr(getattr(jaxdev, ns), n) for ns in NAMESPACES for n in getattr(jaxdev, ns).__all__
    ]
    functions = [f for f in public if inspect.isfunction(f) and f.__module__.startswith("jaxdev")]
    missing = [f.__qualname__ for f in functions if ">>>" not in (f.__doc__ or "")]
    assert len(functions) > 40
    assert not missing, f"public functions without a runnable example: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"jaxdev.{name}")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_the_readme_api_section_names_every_public_name():
    """README's "API at a glance" tables have one row per name in ``dir(jaxdev)``: no
    public name undocumented, no row for a name that is not public, each row linking
    to the file that defines it."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    text = (root / "README.md").read_text()
    api = text.split("## API at a glance", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| `([A-Za-z_][A-Za-z0-9_.]*)` \| (.+?) \| \[[^\]]+\]\(([^)]+)\) \|$", api, re.M
    )
    names = [n for n, _, _ in rows]
    public = {n for n in dir(jaxdev) if not n.startswith("_")} - {"train", "checkpoint", "cli"}
    public |= {
        f"{ns}.{n}" for ns in NAMESPACES if ns != "distributed" for n in getattr(jaxdev, ns).__all__
    }
    assert len(names) == len(set(names)), "a name has two rows"
    assert not public - set(names), f"public names without a row: {sorted(public - set(names))}"
    assert not set(names) - public, (
        f"rows for names that are not public: {sorted(set(names) - public)}"
    )
    for name, line, link in rows:
        assert line.strip() and (root / link).is_file(), (name, link)
    top = {n for n in public if "." not in n} | {"train", "checkpoint"}  # subsystem folders count
    assert len(top) <= 70  # issue 27: 98 -> 70, the rest in namespaces
    gone = {"replicated_sharding", "state_shardings", "common_device", "backend_started"}
    assert not gone & public


def test_a_name_that_moved_to_a_namespace_says_where():
    from jaxdev._moved import GONE, MOVED

    assert len(MOVED) == 33 and not (set(MOVED) | set(GONE)) & set(dir(jaxdev))
    for old, new in MOVED.items():
        ns, name = new.split(".")
        assert name in getattr(jaxdev, ns).__all__, new  # the new place exists
        with pytest.raises(AttributeError, match=rf"^jaxdev\.{old} moved to jaxdev\.{new} "):
            getattr(jaxdev, old)
    with pytest.raises(AttributeError, match="jaxdev.DEFAULT_AXIS is gone: write the axis name"):
        jaxdev.DEFAULT_AXIS  # noqa: B018
    assert not hasattr(jaxdev, "no_such_name")
