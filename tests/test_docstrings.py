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
