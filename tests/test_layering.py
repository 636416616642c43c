"""The import graph of jaxdev/: the core at the top, one folder per subsystem, layered.

Read from the source (every import, lazy ones inside functions included):
no cycle between modules, no module importing a subsystem above its own,
and no module importing another subsystem's private module (a subsystem
asks a sibling through the names its ``__init__`` exports).
"""

from __future__ import annotations

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "jaxdev")
# lowest first: a module may import its own layer and those below
LAYERS = ["", "distributed", "memory", "train", "checkpoint", "meter", "cli", "testing"]
# the top: modules that only re-export (jaxdev's namespaces over its subsystems)
TOP = {"jaxdev", "jaxdev.__main__", "jaxdev.metrics", "jaxdev.nnx"}


def _modules() -> dict[str, str]:
    """Dotted name (``jaxdev.train._step``) -> path, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), REPO)[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """The jaxdev modules ``name`` imports (a ``from pkg import x`` of a submodule counts it)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def test_the_graph_is_read():
    assert "jaxdev.train._step" in GRAPH and "jaxdev._errors" in GRAPH["jaxdev.train._step"]
    assert len(MODULES) > 40


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if nxt.startswith(node + "."):  # a package importing its own modules
                continue
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_upward_imports_and_no_sibling_private_modules():
    bad = []
    for name, targets in GRAPH.items():
        if name in TOP:
            continue  # the top re-exports
        mine = _layer(name)
        for t in sorted(targets):
            theirs = _layer(t)
            if LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{name} imports {t}: {theirs or 'core'} is above {mine or 'core'}")
            elif theirs and theirs != mine and t != f"jaxdev.{theirs}":
                bad.append(f"{name} imports {t}: a private module of the {theirs} subsystem")
    assert not bad, "\n".join(bad)


def test_namespaces_over_subsystems_only_re_export():
    for name in TOP - {"jaxdev.__main__"}:
        with open(MODULES[name], encoding="utf-8") as f:
            body = ast.parse(f.read()).body
        kinds = {type(n).__name__ for n in body[1:]}  # after the docstring
        assert kinds <= {"ImportFrom", "Assign"}, (name, kinds)
        assigned = [t.id for n in body if isinstance(n, ast.Assign) for t in n.targets]
        assert set(assigned) <= {"__all__", "__version__"}, (name, assigned)
