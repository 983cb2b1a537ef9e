"""The import graph of the package, read from the source (AST; nothing is imported), and its cycles.

Every ``import`` / ``from ... import`` statement counts, wherever it is (module level, inside a function, under
``if TYPE_CHECKING``): a lazy import inside a function hides a cycle from the interpreter's import order, not
from the design. An edge goes to the module that defines the imported name: ``from .pkg import name`` points at
``pkg.name`` when that is a module of the package, else at ``pkg`` itself.
"""
from __future__ import annotations

import ast
from pathlib import Path

from .pack_scan import PACK_ROOT, pack_python_files

PACKAGE = "ditkit"


def module_name(path: Path, root: Path = PACK_ROOT, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _resolve(current: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in module ``current``."""
    base = current.split(".") if is_package else current.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph(root: Path = PACK_ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: {modules of the package it imports}}`` for every module under ``root``."""
    files = {module_name(p, root, package): p for p in pack_python_files(root)}
    graph: dict[str, set[str]] = {m: set() for m in files}

    def target(name: str) -> str | None:
        while name and name not in files:  # `from .pkg.mod import fn` -> pkg.mod; an unknown tail -> its parent
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name == package or a.name.startswith(package + ".")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    src = _resolve(mod, is_pkg, node.level, node.module)
                elif node.module and (node.module == package or node.module.startswith(package + ".")):
                    src = node.module
                else:
                    continue
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            for n in names:
                t = target(n)
                if t is not None and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each a set of modules that import each other,
    directly or through others), sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed import path through ``component`` (for the error message): a -> b -> ... -> a."""
    comp = set(component)
    start = component[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return component
