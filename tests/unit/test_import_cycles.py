"""The package has no import cycle (issue #18: ``run.py`` and ``workflows.py`` imported each other through a lazy
import). The graph is read from the source (tests/support/import_graph.py): every import statement counts,
including those inside functions, so a cycle cannot hide behind a lazy import. Each module of the runner package
also imports on its own in a fresh interpreter, without torch or ComfyUI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.import_graph import cycle_path, cycles, import_graph, module_name
from tests.support.pack_scan import PACK_ROOT, REPO_ROOT

RUNNER_MODULES = sorted(module_name(p) for p in (PACK_ROOT / "runner").glob("*.py"))
GRAPH = import_graph()


def test_the_package_has_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles: " + "; ".join(" -> ".join(cycle_path(GRAPH, c)) for c in found)


def test_the_graph_sees_the_runner_layers():
    # without these edges the cycle check would prove nothing
    assert "ditkit.runner.client" in GRAPH["ditkit.runner.server"]
    assert "ditkit.runner.workflows" in GRAPH["ditkit.runner.workflow_file"]
    assert {"ditkit.runner.client", "ditkit.runner.server"} <= GRAPH["ditkit.runner.workflows"]
    assert "ditkit.runner.cli" in GRAPH["ditkit.run"] and "ditkit.runner.workflows" in GRAPH["ditkit.workflows"]
    assert "ditkit.loaders.safe_fs" in GRAPH["ditkit.runner.client"]  # `from ..loaders import safe_fs`


def _write(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_finder_sees_a_cycle_behind_a_lazy_import(tmp_path):
    """The shape of the cycle on main before the split: module-level import one way, an import inside a function
    the other way; plus a three-module ring through a package and an absolute import, and an acyclic control."""
    _write(tmp_path, {
        "__init__.py": "",
        "run.py": "from .errors import E\n\ndef f():\n    from .workflows import g\n    return g\n",
        "workflows.py": "from . import errors\n\ndef h():\n    from .run import f\n    return f\n",
        "errors.py": "class E(Exception):\n    pass\n",
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import x\n",
        "pkg/b.py": "from ..c import y\nx = 1\n",
        "c.py": "import ditkit.pkg.a\ny = 2\n",
        "tail.py": "from .pkg import a\nfrom .errors import E\n",
    })
    g = import_graph(tmp_path)
    assert g["ditkit.workflows"] == {"ditkit.errors", "ditkit.run"}
    assert g["ditkit.tail"] == {"ditkit.pkg.a", "ditkit.errors"}
    found = cycles(g)
    assert found == [["ditkit.c", "ditkit.pkg.a", "ditkit.pkg.b"], ["ditkit.run", "ditkit.workflows"]]
    path = cycle_path(g, found[0])
    assert path[0] == path[-1] and len(path) == 4 and all(b in g[a] for a, b in zip(path, path[1:]))


@pytest.mark.parametrize("mod", RUNNER_MODULES + ["ditkit.run", "ditkit.workflows"])
def test_runner_module_imports_alone_without_torch_or_comfyui(mod):
    code = (f"import sys, {mod}\n"
            "heavy = sorted(m for m in ('torch', 'comfy', 'folder_paths', 'nodes') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
