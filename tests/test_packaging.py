"""Packaging hygiene: every third-party package jaxdev imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import functools
import glob
import importlib.metadata
import os
import re
import sys
import tomllib

from conftest import REPO
from packaging.version import Version

SOURCES = sorted(  # the pytest plugin is loaded by pytest only: pytest is there
    p
    for p in glob.glob(os.path.join(REPO, "jaxdev", "**", "*.py"), recursive=True)
    if not p.endswith(os.path.join("testing", "_plugin.py"))
)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _imports(path: str) -> tuple[set[str], set[str]]:
    """Top-level names of the absolute imports in ``path``: (run on import, inside functions)."""
    top: set[str] = set()
    inner: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            names = []
        (inner if in_function else top).update(n.split(".")[0] for n in names)
        function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or function)

    visit(ast.parse(_read(path)), False)
    return top, inner


def _third_party(names: set[str]) -> set[str]:
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("jaxdev",)}


@functools.cache  # reads every installed distribution's file list: once a session, not a module
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    """Normalized names of the distributions that provide ``module``."""
    dists = _packages_distributions().get(module, [module])
    return {re.sub(r"[-_.]+", "-", d).lower() for d in dists}


def _declared(requirements: list[str]) -> set[str]:
    names = (re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0] for r in requirements)
    return {re.sub(r"[-_.]+", "-", n).lower() for n in names}


def _project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_every_imported_package_is_declared():
    project = _project()
    required = _declared(project["dependencies"])
    optional = _declared([r for reqs in project["optional-dependencies"].values() for r in reqs])
    undeclared = []
    for path in SOURCES:
        top, inner = _imports(path)
        name = os.path.basename(path)
        for module in sorted(_third_party(top)):  # imported when jaxdev is: a hard dependency
            if not _distributions(module) & required:
                undeclared.append(f"{name}: {module} (module level, not in `dependencies`)")
        for module in sorted(_third_party(inner) - _third_party(top)):
            if not _distributions(module) & (required | optional):
                undeclared.append(f"{name}: {module} (in a function, declared nowhere)")
    assert not undeclared, undeclared


def test_no_private_chex_imports():
    offenders = [p for p in SOURCES if "chex._src" in _read(p)]
    assert not offenders, offenders


def test_every_floor_is_the_version_ci_tests():
    """pyproject's `>=` floors are .ci/minimum.txt's pins, the versions CI's second venv tests."""
    project = _project()
    floors = {}
    for r in project["dependencies"] + project["optional-dependencies"]["test"]:
        name, _, version = r.partition(">=")
        floors[_declared([name]).pop()] = Version(version)
    pins = [line.split("==") for line in _read(os.path.join(REPO, ".ci", "minimum.txt")).split()]
    pinned = {_declared([p[0]]).pop(): Version(p[1]) for p in pins if len(p) == 2}
    assert floors == {n: v for n, v in pinned.items() if n in floors}, (floors, pinned)
