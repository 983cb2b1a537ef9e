"""One host layer (issue #28, Build 1): only ``bridge/`` touches ComfyUI's internals.

Checked on the source (AST), so it holds without ComfyUI installed:

* ``nodes/`` imports from ComfyUI only the public V3 API ``comfy_api.latest`` (every other ComfyUI module, at any
  depth, inside functions too, through ``importlib.import_module`` too, is refused), reads no private attribute of
  another object (``x._name``; ``self`` / ``cls`` and ditkit's own ``_ditkit*`` markers excepted) and uses none of
  ComfyUI's calling conventions (the host names of ``test_layering.host_uses``: ModelPatcher / BaseModel members,
  ``transformer_options`` keys);
* ``bridge/`` never imports ``nodes/`` (the import graph of the whole package, lazy imports included);
* one report sink: ``bridge/reports.py`` alone defines ``send_report``; every other bridge module reports through
  the :class:`ReportTarget` its node hands over and never names ``send_report``.

Each scanner is run on a planted violation first (a scan that finds nothing must mean something).
"""
from __future__ import annotations

import ast

import pytest

from tests.support.import_graph import import_graph
from tests.support.pack_scan import PACK_ROOT, call_name
from tests.unit.test_layering import HOST_MODULES, host_uses

NODE_FILES = sorted((PACK_ROOT / "nodes").glob("*.py"))
BRIDGE_FILES = sorted((PACK_ROOT / "bridge").glob("*.py"))
PUBLIC_API = "comfy_api.latest"


def host_imports(tree) -> list[tuple[int, str]]:
    """``(line, full module name)`` of every absolute import of a ComfyUI module (``from m import x`` -> ``m``;
    ``import a.b`` -> ``a.b``; ``importlib.import_module("a.b")`` -> ``a.b``)."""
    out = []
    for n in ast.walk(tree):
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names = [n.module]
        elif isinstance(n, ast.Call) and call_name(n.func) in ("importlib.import_module", "import_module",
                                                                "__import__"):
            if n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                names = [n.args[0].value]
        out += [(n.lineno, m) for m in names if m.split(".")[0] in HOST_MODULES]
    return out


def forbidden_node_imports(tree) -> list[tuple[int, str]]:
    """What a node module may not import: any ComfyUI module but ``comfy_api.latest`` itself."""
    return [(line, m) for line, m in host_imports(tree) if m != PUBLIC_API]


def private_reads(tree) -> list[tuple[int, str]]:
    """``(line, ".name")`` of every ``<expr>._name`` (not a dunder) on anything but ``self`` / ``cls``; ditkit's own
    ``_ditkit*`` markers are allowed."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                and not n.attr.startswith("_ditkit") \
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            out.append((n.lineno, "." + n.attr))
    return out


def _tree(p):
    return ast.parse(p.read_text(encoding="utf-8"), filename=str(p))


def _rel(p) -> str:
    return str(p.relative_to(PACK_ROOT))


# -------------------------------------------------------------------------------------------- the scanners

def test_scanners_find_planted_violations():
    src = ("from comfy_api.latest import io\n"            # 1 allowed
           "import comfy.sd\n"                            # 2
           "from comfy_api.latest._io import Schema\n"    # 3 a private module of the public package
           "def f(model, vae):\n"
           "    import folder_paths\n"                    # 5 lazy
           "    from comfy_execution.utils import x\n"    # 6
           "    m = importlib.import_module('server')\n"  # 7
           "    vae._decode_pixels(1)\n"                  # 8 private attribute
           "    self._x = 1\n"                            # 9 own attribute: allowed
           "    f._ditkit_replay = True\n"                # 10 ditkit marker: allowed
           "    model.model_options['transformer_options']\n"  # 11 host convention
           "    return type(vae).__name__\n")             # 12 dunder: allowed
    tree = ast.parse(src)
    assert forbidden_node_imports(tree) == [(2, "comfy.sd"), (3, "comfy_api.latest._io"), (5, "folder_paths"),
                                            (6, "comfy_execution.utils"), (7, "server")]
    assert private_reads(tree) == [(8, "._decode_pixels")]
    assert {line for line, _ in host_uses(tree)} == {8, 11}   # a private VAE method, a host option key


def test_the_scan_sees_the_layers():
    names = {p.name for p in NODE_FILES}
    assert {"__init__.py", "_common.py", "h3_vae.py", "text_encoders.py", "teacache.py"} <= names
    assert {"reports.py", "files.py", "contract.py", "teacache.py"} <= {p.name for p in BRIDGE_FILES}
    # the allowed import is seen as what it is (else the node check below would pass on an empty scan)
    assert [m for _, m in host_imports(_tree(PACK_ROOT / "nodes" / "teacache.py"))] == [PUBLIC_API]


# ------------------------------------------------------------------------------------------------ nodes/

@pytest.mark.parametrize("path", NODE_FILES, ids=_rel)
def test_nodes_import_only_the_public_api(path):
    bad = forbidden_node_imports(_tree(path))
    assert not bad, f"{_rel(path)} imports ComfyUI internals {bad}; only {PUBLIC_API} (move the host code to bridge/)"


@pytest.mark.parametrize("path", NODE_FILES, ids=_rel)
def test_nodes_read_no_private_attributes(path):
    bad = private_reads(_tree(path))
    assert not bad, f"{_rel(path)} reads private attributes {bad}; that belongs in bridge/"


@pytest.mark.parametrize("path", NODE_FILES, ids=_rel)
def test_nodes_use_no_host_calling_conventions(path):
    bad = host_uses(_tree(path))
    assert not bad, f"{_rel(path)} uses ComfyUI's objects or calling conventions {bad}; that belongs in bridge/"


# ------------------------------------------------------------------------------------------------ bridge/

def bridge_to_nodes(graph) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() if a.startswith("ditkit.bridge")
                  for b in targets if b == "ditkit.nodes" or b.startswith("ditkit.nodes."))


def test_bridge_never_imports_nodes():
    bad = bridge_to_nodes(import_graph())
    assert not bad, f"bridge/ imports nodes/: {bad}"


def test_bridge_import_scan_sees_a_planted_edge(tmp_path):
    for rel, text in {"__init__.py": "", "nodes/__init__.py": "", "nodes/_common.py": "x = 1\n",
                      "bridge/__init__.py": "", "bridge/a.py": "def f():\n    from ..nodes._common import x\n",
                      "bridge/b.py": "from . import a\n"}.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    assert bridge_to_nodes(import_graph(tmp_path)) == [("ditkit.bridge.a", "ditkit.nodes._common")]


def send_report_names(tree) -> list[int]:
    """Lines naming ``send_report`` (a name, an attribute, an imported name or a definition)."""
    out = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Name) and n.id == "send_report") or (isinstance(n, ast.Attribute)
                                                                   and n.attr == "send_report"):
            out.append(n.lineno)
        elif isinstance(n, ast.ImportFrom) and any(a.name == "send_report" for a in n.names):
            out.append(n.lineno)
        elif isinstance(n, ast.FunctionDef) and n.name == "send_report":
            out.append(n.lineno)
    return out


@pytest.mark.parametrize("path", [p for p in BRIDGE_FILES if p.name != "reports.py"], ids=_rel)
def test_bridge_features_report_through_the_handed_sink(path):
    lines = send_report_names(_tree(path))
    assert not lines, (f"{_rel(path)} names send_report (lines {lines}); a bridge feature reports through the "
                       "ReportTarget its node hands over (target.send(kind, summary, data))")


def test_sink_scan_sees_planted_uses():
    src = ("from ..nodes._common import send_report\n"
           "def f(t):\n    send_report(t, 'X', 'k', 's')\n    t.send('k', 's')\n    m.send_report(1)\n")
    assert send_report_names(ast.parse(src)) == [1, 3, 5]
    defined = send_report_names(_tree(PACK_ROOT / "bridge" / "reports.py"))
    assert defined, "bridge/reports.py defines the one sink"
