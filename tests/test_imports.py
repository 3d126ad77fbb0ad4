"""Import hygiene: the target package stays free of the hub, and no modules import each other.

Imports run one way (protocol <- transport <- hub / edge). A target machine runs ``edge/`` with
the shared modules only; pulling in the hub's authenticator, ROUTER, scheduler or drafters there
is a layering bug even while it happens to work, so it is checked in a fresh interpreter (this
test process has long imported everything).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("starsd", "edge")
TARGET_MODULES = ("edge.target", "edge.client", "edge.speculate", "edge.verifier")
# Prefixes, matched on module boundaries: everything hub-only lives under starsd.hub.
HUB_ONLY = ("starsd.hub",)

_PROBE = """
import importlib, sys
module = importlib.import_module(sys.argv[1])
print(module.__file__)
print("\\n".join(sorted(sys.modules)))
"""


def is_hub_only(module: str) -> bool:
    """True if ``module`` is one of :data:`HUB_ONLY` or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in HUB_ONLY)


def modules_after_import(module: str) -> tuple[Path, list[str]]:
    """Import ``module`` in a fresh interpreter; its file and every module then loaded."""
    # This checkout first on the path: the venv's editable install may point at another one.
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, module],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"importing {module} failed:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    return Path(lines[0]), lines[1:]


@pytest.mark.parametrize("module", TARGET_MODULES)
def test_target_modules_import_nothing_of_the_hub(module: str) -> None:
    path, loaded = modules_after_import(module)
    assert path.is_relative_to(REPO), f"{module} was imported from {path}, not this checkout"
    leaked = [m for m in loaded if is_hub_only(m)]
    assert not leaked, f"importing {module} also imported hub-only modules: {leaked}"


def test_hub_only_prefixes_match_on_module_boundaries() -> None:
    assert is_hub_only("starsd.hub") and is_hub_only("starsd.hub.router")
    assert is_hub_only("starsd.hub.auth") and is_hub_only("starsd.hub.drafters.llm")
    assert not is_hub_only("starsd.transport") and not is_hub_only("starsd.hubris")


# ------------------------------------------------------------------------------- import graph


def module_files() -> dict[str, Path]:
    """Every module of :data:`PACKAGES` by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The dotted name of every ``import`` anywhere in ``tree`` (function bodies included);
    ``from a import b`` gives ``a.b``, relative imports are made absolute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield from (f"{base}.{alias.name}" for alias in node.names)


def resolve(name: str, files: dict[str, Path]) -> str | None:
    """The deepest module of ours that ``name`` names or lies in: ``starsd.protocol`` for
    ``from starsd import protocol``, ``starsd.hub`` for ``from starsd.hub import Hub``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in files:
            return candidate
    return None


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of :data:`PACKAGES` it imports (anywhere in the module)."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = imported_names(tree, module, path.stem == "__init__")
        resolved = (resolve(name, files) for name in names)
        graph[module] = {r for r in resolved if r is not None and r != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is a few dozen modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(graph, component) for component in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return [*paths[node], start]
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_no_import_cycles() -> None:
    found = cycles(import_graph(module_files()))
    named = [" -> ".join(cycle) for cycle in found]
    assert not found, "modules import each other: " + "; ".join(named)


def test_the_graph_sees_function_level_and_from_imports() -> None:
    files = module_files()
    graph = import_graph(files)
    assert "starsd.protocol" in graph["starsd.transport"]  # from starsd import protocol
    assert "starsd.hub.auth" in graph["starsd.hub.server"]  # from starsd.hub import auth
    assert "starsd.hub" in graph["starsd.hub.__main__"]  # from starsd.hub import HubConfig
    assert "starsd.hub.drafters.llm" in graph["starsd.hub.build"]  # inside load_proposer()
