"""Static (AST) facts about the pack's own source, for the layering and host tests.

Nothing here imports the scanned modules: node ids are read from ``NODES = [...]`` and the
``io.Schema(node_id="...")`` call inside each listed class, so the checks work without ComfyUI.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACK_ROOT = REPO_ROOT  # the package (the repo root holds only the ComfyUI entry __init__.py)
# directories that are not part of the installed pack (tests, benchmarks and docs may import ComfyUI)
NON_PACK_DIRS = {"tests", "benchmarks", "docs", "web", "example_workflows", ".git", ".ci", "build", "dist",
                 "__pycache__", "_out", ".tiny", ".whl", ".gl", "tools", "mutants"}


def pack_python_files(root: Path = PACK_ROOT) -> list[Path]:
    """Every .py file of the pack (root modules and package dirs), excluding tests/benchmarks/docs."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in NON_PACK_DIRS or part.startswith(".") or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        out.append(p)
    return out


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, top-level module)`` of every absolute import (relative imports are the pack's own)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and call_name(node.func) in ("importlib.import_module", "import_module",
                                                                        "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                name = node.args[0].value
                if not name.startswith("."):
                    out.append((node.lineno, name.split(".")[0]))
    return out


def call_name(func: ast.AST) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def calls(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, call_name(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call)]


@dataclass(frozen=True)
class NodeDecl:
    module: str
    class_name: str
    node_id: str | None
    line: int


def node_declarations(nodes_dir: Path = PACK_ROOT / "nodes") -> list[NodeDecl]:
    """Every class listed in a ``nodes/<module>.py`` ``NODES`` list, with the ``node_id`` of its schema."""
    out = []
    for p in sorted(nodes_dir.glob("*.py")):
        if p.name.startswith("_"):
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
        classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        listed: list[tuple[str, int]] = []
        for n in tree.body:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "NODES" for t in targets) and \
                    isinstance(n.value, (ast.List, ast.Tuple)):
                listed += [(e.id, e.lineno) for e in n.value.elts if isinstance(e, ast.Name)]
        for cname, line in listed:
            out.append(NodeDecl(p.stem, cname, schema_node_id(classes.get(cname), consts), line))
    return out


def schema_node_id(cls: ast.ClassDef | None, consts: dict[str, str] | None = None) -> str | None:
    """The ``node_id=`` of the ``Schema(...)`` call in the class body: a string constant, or a module-level
    string constant's name (None when it is anything else)."""
    if cls is None:
        return None
    for n in ast.walk(cls):
        if isinstance(n, ast.Call) and call_name(n.func).split(".")[-1] == "Schema":
            for kw in n.keywords:
                if kw.arg != "node_id":
                    continue
                if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
                if isinstance(kw.value, ast.Name):
                    return (consts or {}).get(kw.value.id)
    return None
