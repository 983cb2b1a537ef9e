"""Every write the server side of the pack makes goes through loaders/safe_fs.py (issue #17 item 8, docs/security.md
"Writes and reads"). AST scan of the modules a node can reach (nodes/, the core packages, the root modules ComfyUI
imports): no file-creating call anywhere else, so a new write cannot bypass the rules unnoticed."""
from __future__ import annotations

import ast

import pytest

from tests.support.pack_scan import PACK_ROOT, call_name as _name, pack_python_files

SERVER_DIRS = ("nodes", "loaders", "vae", "cache", "offload", "kernels", "sampling")
SERVER_ROOT_MODULES = ("__init__.py", "errors.py", "guards.py", "_version_check.py", "report.py", "strict_json.py")
# CLI / developer tools that write where their operator says (not reachable from a prompt): run.py, host.py, tiny/
WRITE_CALLS = {"os.replace", "os.rename", "os.renames", "os.mkdir", "os.makedirs", "os.link", "os.symlink",
               "os.mkfifo", "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.move",
               "torch.save", "json.dump", "np.save", "numpy.save", "save_file", "_save"}
WRITE_ATTRS = {"write_bytes", "write_text", "mkdir", "touch", "symlink_to", "hardlink_to"}
ALLOWED = {"loaders/safe_fs.py": "the write module itself"}
ALLOWED_CALLS = {
    ("loaders/safetensors_io.py", "_save"): "save_file: a test/generator helper; test_no_server_module_calls_save_file",
    ("vae/video_stream.py", "av.open"): "PyAV gets the private /proc/self/fd path from safe_fs (checked below)",
}


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        name = _name(n.func)
        if name in WRITE_CALLS or name.startswith("tempfile."):
            out.append((n.lineno, name))
        elif isinstance(n.func, ast.Attribute) and n.func.attr in WRITE_ATTRS:
            out.append((n.lineno, name))
        elif name in ("open", "io.open", "os.fdopen", "av.open", "builtins.open"):
            mode = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg == "mode"), None)
            m = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else ("?" if mode else "r")
            if any(c in m for c in "wxa+?"):
                out.append((n.lineno, f"{name}(mode={m!r})"))
        elif name == "os.open":
            out.append((n.lineno, name))
    return out


def _server_files():
    for p in pack_python_files():
        rel = str(p.relative_to(PACK_ROOT))
        if rel.split("/")[0] in SERVER_DIRS or rel in SERVER_ROOT_MODULES:
            yield rel, p


SERVER = sorted(_server_files())


def test_scan_sees_the_server_side_and_detects_writes():
    rels = {r for r, _ in SERVER}
    assert {"nodes/save_video.py", "nodes/teacache.py", "cache/calibrate.py", "cache/coefficients.py",
            "vae/video_stream.py", "loaders/safe_fs.py", "guards.py", "sampling/fasth3.py", "report.py"} <= rels
    src = ("import os, json, tempfile\nopen('a', 'w')\nopen(p, mode='xb')\nopen(p)\nos.replace(a, b)\n"
           "json.dump(o, f)\ntempfile.mkstemp()\nPath(p).write_text('x')\nos.makedirs(d)\nopen(p, m)\n")
    got = [name for _, name in _writes(ast.parse(src))]
    assert got == ["open(mode='w')", "open(mode='xb')", "os.replace", "json.dump", "tempfile.mkstemp",
                   "write_text", "os.makedirs", "open(mode='?')"], got


@pytest.mark.parametrize("rel,path", SERVER, ids=[r for r, _ in SERVER])
def test_no_write_outside_safe_fs(rel, path):
    if rel in ALLOWED:
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = [(line, name) for line, name in _writes(tree)
           if (rel, name.split("(")[0]) not in ALLOWED_CALLS]
    assert not bad, (f"{rel} writes files directly {bad}; use loaders/safe_fs.py (validated name, no symlink "
                     "followed, temp file + no-replace publish)")


def test_pyav_only_gets_the_private_descriptor_path():
    tree = ast.parse((PACK_ROOT / "vae" / "video_stream.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func) == "av.open"]
    assert calls and all(isinstance(c.args[0], ast.Call) and _name(c.args[0].func).endswith(".fd_path")
                         for c in calls)


def test_no_server_module_calls_save_file():
    for rel, p in SERVER:
        if rel == "loaders/safetensors_io.py":
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func).endswith("save_file")], rel
