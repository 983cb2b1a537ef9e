"""The design card's layout: the repository root *is* the package ``ditkit`` (``nodes/``, ``kernels/``, ``vae/``,
``loaders/``, ``offload/``, ``web/`` at the top), and shadowing stays impossible:

* ``pip install -e .`` / a wheel installs the name ``ditkit`` only (never ``tests``, ``benchmarks``, ``nodes``);
* no top-level ``nodes`` / ``kernels`` / ``vae`` module is ever importable, even with the checkout's folder on
  ``sys.path`` (each subpackage refuses with an ImportError naming ``ditkit.<name>``);
* the pack loads under any folder name, the way ComfyUI loads a custom-node folder;
* pytest run from the root never puts the root on ``sys.path``, so ComfyUI's ``nodes`` is never shadowed.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.pack_scan import NON_PACK_DIRS, REPO_ROOT

CARD_TOP_LEVEL = ("__init__.py", "nodes", "kernels", "vae", "loaders", "offload", "web", "tests", "pyproject.toml")
SUBPACKAGES = sorted(p.parent.name for p in REPO_ROOT.glob("*/__init__.py")
                     if p.parent.name not in NON_PACK_DIRS)


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}


def test_the_cards_top_level_exists():
    missing = [n for n in CARD_TOP_LEVEL if not (REPO_ROOT / n).exists()]
    assert not missing, missing
    assert not (REPO_ROOT / "ditkit").exists(), "the inner ditkit/ folder is gone: the root is the package"


def test_setuptools_installs_the_root_as_ditkit_and_lists_every_subpackage():
    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert cfg["package-dir"] == {"ditkit": "."}
    assert cfg["packages"] == ["ditkit"] + [f"ditkit.{d}" for d in SUBPACKAGES]
    assert {"nodes", "kernels", "vae", "loaders", "offload"} <= set(SUBPACKAGES)
    assert not {"tests", "benchmarks"} & set(SUBPACKAGES)


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_no_subpackage_imports_as_a_top_level_module(name):
    """With the checkout's folder first on ``sys.path`` (``python -c`` from the root, a stray PYTHONPATH) every
    subpackage refuses to be ``nodes`` / ``kernels`` / ... and names the right import."""
    code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
            f"try:\n    import {name}\nexcept ImportError as e:\n    print('REFUSED', e)\nelse:\n    print('IMPORTED')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr[-2000:]
    assert f"import ditkit.{name}" in out.stdout


def test_the_pack_loads_under_any_folder_name(tmp_path):
    """ComfyUI imports a custom-node folder from its ``__init__.py`` under the folder's name; the relative imports
    must work for a clone named ``ComfyUI-ditkit`` (not an identifier) as for ``ditkit``."""
    clone = tmp_path / "ComfyUI-ditkit"
    shutil.copytree(REPO_ROOT, clone, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.so", "tests",
                                                                    "benchmarks", "example_workflows", "docs"))
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('ComfyUI-ditkit', {str(clone / '__init__.py')!r},\n"
            f"    submodule_search_locations=[{str(clone)!r}])\n"
            "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)\n"
            "k = importlib.import_module('ComfyUI-ditkit.kernels.vsa_layout')\n"
            "g = importlib.import_module('ComfyUI-ditkit.guards')\n"
            "print(m.WEB_DIRECTORY, m.__version__, k.__name__, g.__name__, 'nodes' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["./web", "0.1.0", "ComfyUI-ditkit.kernels.vsa_layout", "ComfyUI-ditkit.guards",
                                  "False"]


def test_this_pytest_session_never_has_the_root_on_sys_path():
    """``python -m pytest`` puts the current folder first on ``sys.path``; the conftest removes it, so ComfyUI's
    ``nodes`` (in-process host tests) can never be shadowed by ``nodes/``."""
    roots = [p for p in sys.path if Path(os.path.abspath(p or ".")) == REPO_ROOT]
    assert not roots, sys.path[:5]
    spec = importlib.util.find_spec("nodes")
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(REPO_ROOT), spec
    import ditkit

    assert Path(ditkit.__file__).resolve().parent == REPO_ROOT


def test_the_suite_runs_from_a_folder_whose_name_is_not_an_identifier(tmp_path):
    """A cloned pack is usually named like ``ComfyUI-ditkit``: pytest from that root imports this checkout as
    ``ditkit``, and neither ``nodes`` nor ``kernels`` is a top-level name inside the session."""
    clone = tmp_path / "ComfyUI-ditkit"
    shutil.copytree(REPO_ROOT, clone, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.so", "benchmarks",
                                                                    "example_workflows", "docs", "web"))
    for p in (clone / "tests").iterdir():
        if p.name not in ("__init__.py", "conftest.py", "support"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    (clone / "tests" / "unit").mkdir()
    (clone / "tests" / "unit" / "test_probe.py").write_text(
        "import importlib.util\nfrom pathlib import Path\n\nimport ditkit\n\n\n"
        "def test_probe():\n"
        "    root = Path(__file__).resolve().parents[2]\n"
        "    assert Path(ditkit.__file__).resolve().parent == root\n"
        "    for name in ('nodes', 'kernels', 'vae'):\n"
        "        spec = importlib.util.find_spec(name)\n"
        "        assert spec is None or not Path(spec.origin or '').resolve().is_relative_to(root), name\n",
        encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/unit/test_probe.py", "-q", "-p", "no:cacheprovider"],
                          cwd=clone, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]


def test_the_wheel_holds_the_package_ditkit_only(tmp_path):
    """What ``pip install .`` installs: every file under ``ditkit/`` (no ``tests``, ``benchmarks``, ``nodes`` at the
    top of site-packages), the package data included."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO_ROOT)], capture_output=True, text=True, env=_env(),
                          timeout=600, cwd=tmp_path)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"cannot build a wheel here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("ditkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ditkit"}, tops
    assert not [n for n in names if n.startswith(("ditkit/tests/", "ditkit/benchmarks/"))]
    assert "ditkit/nodes/__init__.py" in names and "ditkit/kernels/csrc/tile_attn.cpp" in names
    assert any(n.startswith("ditkit/cache/defaults/") and n.endswith(".json") for n in names)
