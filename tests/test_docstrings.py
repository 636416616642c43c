"""Every docstring example in jaxdev runs and prints what it shows (doctest, 8 fake CPUs)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jaxdev

MODULES = sorted(m.name for m in pkgutil.iter_modules(jaxdev.__path__))


def test_every_public_function_has_an_example():
    public = [getattr(jaxdev, n) for n in dir(jaxdev) if not n.startswith("_")]
    public += [getattr(jaxdev.distributed, n) for n in ("initialize", "is_initialized", "shutdown")]
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
    """README's "API at a glance" documents every name in ``dir(jaxdev)`` (and the removed
    names are gone from it)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    api = text.split("## API at a glance", 1)[1].split("\n## ", 1)[0]
    spans = re.findall(r"`([^`]+)`", api)
    mentioned = {w for span in spans for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}
    public = {n for n in dir(jaxdev) if not n.startswith("_")}
    assert not public - mentioned, (
        f"public names the API section does not document: {sorted(public - mentioned)}"
    )
    assert len(public) <= 88
    gone = {"replicated_sharding", "state_shardings", "common_device", "backend_started"}
    assert not gone & public
