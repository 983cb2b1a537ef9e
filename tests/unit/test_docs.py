"""Every ditkit node (found by AST in nodes/*.py, no ComfyUI import) has a help page web/docs/<NodeId>/en.md that
names each of its inputs, a tooltip on every input and search aliases."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODES_DIR = ROOT / "nodes"
DOCS = ROOT / "web" / "docs"


def _consts(tree: ast.Module) -> dict[str, str]:
    out = {}
    for st in tree.body:
        if isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str):
            for t in st.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = st.value.value
    return out


def _input_calls(node: ast.AST, funcs: dict[str, ast.FunctionDef]) -> list[ast.Call]:
    """``io.<Type>.Input("name", ...)`` calls under ``node``, following calls of module-level helper functions."""
    calls, seen = [], set()

    def walk(n):
        for sub in ast.walk(n):
            if isinstance(sub, ast.Call):
                f = sub.func
                if isinstance(f, ast.Attribute) and f.attr == "Input" and sub.args \
                        and isinstance(sub.args[0], ast.Constant) and isinstance(sub.args[0].value, str):
                    calls.append(sub)
                elif isinstance(f, ast.Name) and f.id in funcs and f.id not in seen:
                    seen.add(f.id)
                    walk(funcs[f.id])

    walk(node)
    return calls


def _schemas() -> list[dict]:
    found = []
    for path in sorted(NODES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = _consts(tree)
        funcs = {st.name: st for st in tree.body if isinstance(st, ast.FunctionDef)}
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "Schema"):
                continue
            kw = {k.arg: k.value for k in call.keywords}
            nid = kw.get("node_id")
            if isinstance(nid, ast.Constant):
                node_id = nid.value
            elif isinstance(nid, ast.Name):
                node_id = consts.get(nid.id)
            else:
                node_id = None
            assert node_id, f"{path.name}:{call.lineno}: node_id is not a literal or module constant"
            inputs = []
            for c in _input_calls(kw["inputs"], funcs) if "inputs" in kw else []:
                tip = next((k.value for k in c.keywords if k.arg == "tooltip"), None)
                inputs.append((c.args[0].value, tip))
            aliases = kw.get("search_aliases")
            found.append({"id": node_id, "file": path.name, "inputs": inputs,
                          "aliases": len(aliases.elts) if isinstance(aliases, ast.List) else 0})
    return found


SCHEMAS = _schemas()


def test_found_every_node():
    ids = [s["id"] for s in SCHEMAS]
    assert len(ids) >= 14 and len(set(ids)) == len(ids), ids
    assert all(i.startswith("DitKit") for i in ids), ids
    assert {"DitKitSparseAttention", "DitKitTeaCache", "DitKitH3VAEDecode", "DitKitLoKrLoader"} <= set(ids)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[s["id"] for s in SCHEMAS])
def test_docs_page_mentions_every_input(schema):
    page = DOCS / schema["id"] / "en.md"
    assert page.is_file(), f"{schema['id']} ({schema['file']}) has no help page {page.relative_to(ROOT)}"
    text = page.read_text(encoding="utf-8")
    assert len(text) > 400, f"{page} is a stub ({len(text)} chars)"
    missing = [name for name, _ in schema["inputs"] if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text)]
    assert not missing, f"{page.relative_to(ROOT)} does not mention inputs {missing}"
    low = text.lower()
    assert "report" in low, f"{page}: no section on what the report means"
    assert "limit" in low, f"{page}: no known limits"


@pytest.mark.parametrize("schema", SCHEMAS, ids=[s["id"] for s in SCHEMAS])
def test_every_input_has_tooltip_and_node_has_aliases(schema):
    assert schema["inputs"], f"{schema['id']}: no inputs found by the AST scan"
    bad = [name for name, tip in schema["inputs"] if tip is None
           or (isinstance(tip, ast.Constant) and not str(tip.value).strip())]
    assert not bad, f"{schema['id']} ({schema['file']}): inputs without tooltip: {bad}"
    assert schema["aliases"] >= 2, f"{schema['id']}: search_aliases missing or too few"
