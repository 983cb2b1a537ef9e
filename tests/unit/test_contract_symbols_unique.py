"""Every host-contract symbol is registered once across bridge/ (read from the source: no host needed). Two modules
registering the same symbol make ``contract.check_all`` raise at pack load, so the whole pack would refuse to
load; this caught two such collisions between branches before CI did."""
from __future__ import annotations

import ast
from collections import Counter

from tests.support.pack_scan import PACK_ROOT


def _symbols() -> list[tuple[str, str]]:
    out = []
    for path in sorted((PACK_ROOT / "bridge").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "entry" and n.args \
                    and isinstance(n.args[0], ast.Constant):
                out.append((n.args[0].value, path.name))
        if path.name == "contract_entries.py":   # the (symbol, nodes, names, doc) tables
            for n in ast.walk(tree):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.List):
                    for el in n.value.elts:
                        if isinstance(el, ast.Tuple) and el.elts and isinstance(el.elts[0], ast.Constant) \
                                and isinstance(el.elts[0].value, str) and "." in el.elts[0].value:
                            out.append((el.elts[0].value, path.name))
    return out


def test_every_contract_symbol_is_registered_once():
    syms = _symbols()
    assert len(syms) > 60, len(syms)
    dup = {s: [f for x, f in syms if x == s] for s, n in Counter(s for s, _ in syms).items() if n > 1}
    assert not dup, dup


def test_the_scan_sees_a_collision():
    src = '@entry("comfy.x.Y", nodes=(), what="symbol")\ndef a(): pass\n@entry("comfy.x.Y", nodes=(), what="b")\n' \
          'def b(): pass\n'
    found = [n.args[0].value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "entry"]
    assert Counter(found)["comfy.x.Y"] == 2
