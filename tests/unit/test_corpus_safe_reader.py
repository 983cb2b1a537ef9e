"""Every ditkit reader of untrusted files goes through ``loaders/safetensors_io.py`` (bounded header, strict JSON,
offset checks, lazy access). Extends tests/unit/test_layering.py (torch.load/pickle/eval) with the calls that would
bypass the safe reader: ``safetensors`` itself (``safe_open``, ``safetensors.torch.load_file``/``load``), ComfyUI's
``comfy.utils.load_torch_file`` (falls back to ``torch.load`` for non-safetensors files) and plain ``json.load(s)``
(accepts NaN, duplicate keys, unbounded nesting) in modules that parse user files."""
from __future__ import annotations

import ast

import pytest

from tests.support.pack_scan import PACK_ROOT, calls, imported_modules, pack_python_files

SAFE_READER = "loaders/safetensors_io.py"
# packages that read files a user downloaded (weights, adapters, metadata, coefficient files)
UNTRUSTED_READERS = ("loaders/", "vae/", "cache/", "offload/", "kernels/", "nodes/")
FORBIDDEN_CALLS = {"safe_open", "safetensors.safe_open", "safetensors.torch.load_file", "safetensors.torch.load",
                   "load_torch_file", "comfy.utils.load_torch_file", "torch.load", "numpy.load", "np.load"}
FORBIDDEN_FROM_IMPORTS = {("safetensors", "safe_open"), ("safetensors.torch", "load_file"),
                          ("safetensors.torch", "load"), ("comfy.utils", "load_torch_file"), ("torch", "load")}
JSON_CALLS = {"json.load", "json.loads"}
# known violations (strict xfail until fixed by their owner)
KNOWN: dict[str, str] = {}

FILES = [p for p in pack_python_files() if str(p.relative_to(PACK_ROOT)) != SAFE_READER]
IDS = [str(p.relative_to(PACK_ROOT)) for p in FILES]


def violations(path, rel: str | None = None) -> list[tuple[int, str]]:
    rel = rel or str(path.relative_to(PACK_ROOT))
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [(ln, name) for ln, name in calls(tree) if name in FORBIDDEN_CALLS]
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 0:
            bad += [(n.lineno, f"from {n.module} import {a.name}") for a in n.names
                    if (n.module, a.name) in FORBIDDEN_FROM_IMPORTS]
    if not rel.startswith("tiny/"):  # the tiny-checkpoint writers may use the reference library to WRITE
        bad += [(ln, f"import {m}") for ln, m in imported_modules(tree) if m == "safetensors"]
    if rel.startswith(UNTRUSTED_READERS):
        bad += [(ln, name) for ln, name in calls(tree) if name in JSON_CALLS]
    return bad


@pytest.mark.parametrize("path", [pytest.param(p, id=i, marks=pytest.mark.xfail(strict=True, reason=KNOWN[i]))
                                  if i in KNOWN else pytest.param(p, id=i) for p, i in zip(FILES, IDS)])
def test_untrusted_files_are_read_only_through_the_safe_reader(path):
    bad = violations(path)
    assert not bad, (f"{path.relative_to(PACK_ROOT)}: {bad}; read weights/metadata with "
                     "loaders/safetensors_io.py (read_header, SafeFile, load_file, strict_json_loads)")


def test_scan_flags_bypasses(tmp_path):
    """The scan must see what it forbids (so a clean pack means something)."""
    fake = tmp_path / "probe.py"
    src = ("import json\nfrom safetensors import safe_open\nimport safetensors.torch\nimport comfy.utils\n"
           "a = safetensors.torch.load_file('x')\nb = comfy.utils.load_torch_file('y')\nc = json.loads('{}')\n")
    fake.write_text(src, encoding="utf-8")
    names = {n for _, n in violations(fake, rel="loaders/probe.py")}
    assert {"from safetensors import safe_open", "import safetensors", "safetensors.torch.load_file",
            "comfy.utils.load_torch_file", "json.loads"} <= names, names


def test_safe_reader_is_used_by_every_weight_loading_node():
    """Each node module that loads a file from a model folder imports the safe reader."""
    users = []
    for p in sorted((PACK_ROOT / "nodes").glob("*.py")):
        text = p.read_text(encoding="utf-8")
        if "get_full_path" in text or "get_filename_list" in text:
            if "safetensors_io" not in text and "loaders" not in text:
                users.append(p.name)
    assert not users, f"node modules reading model files without loaders/: {users}"
