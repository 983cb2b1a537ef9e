"""Every public function of the core modules is referenced by name in some unit test (issue 29: several were only
reached through other functions, or not at all). A static scan: top-level ``def`` without a leading underscore in
kernels/, loaders/, cache/, vae/, sampling/, offload/, guards.py and strict_json.py, against the identifiers of
tests/unit/*.py. ``ALLOWED`` lists the exceptions, each with its reason; an entry that a test now names, or whose
function no longer exists, fails the scan too (the list only shrinks)."""
from __future__ import annotations

import ast
import re

from tests.support.pack_scan import PACK_ROOT

CORE_DIRS = ("kernels", "loaders", "cache", "vae", "sampling", "offload")
CORE_FILES = ("guards.py", "strict_json.py")

_REGISTRY = "a backend registered in kernels/registry and called by the tests through REGISTRY.resolve(...).fn"
ALLOWED = {
    "kernels/block_sparse.py:block_sparse_attn_reference": _REGISTRY,
    "kernels/block_sparse_cpu.py:block_sparse_attn_cpu": _REGISTRY,
    "kernels/block_sparse_cpu_native.py:block_sparse_attn_cpu_native": _REGISTRY,
    "kernels/block_sparse_flashinfer.py:block_sparse_attn_flashinfer": _REGISTRY + " (CUDA + flashinfer only)",
    "kernels/block_sparse_flex.py:block_sparse_attn_flex": _REGISTRY,
    "kernels/block_sparse_triton.py:block_sparse_attn_triton_op": _REGISTRY + " (torch.library custom op)",
    "kernels/tile_pack.py:pack_triton_op": _REGISTRY + " (torch.library custom op)",
    "kernels/tile_pack.py:unpack_combine_triton_op": _REGISTRY + " (torch.library custom op)",
}


def core_files():
    files = [PACK_ROOT / f for f in CORE_FILES]
    for d in CORE_DIRS:
        files += sorted((PACK_ROOT / d).glob("*.py"))
    return files


def public_functions():
    out = {}
    for p in core_files():
        for node in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                out[f"{p.relative_to(PACK_ROOT).as_posix()}:{node.name}"] = node.name
    return out


def test_identifiers():
    words = _test_words()
    assert "guard_node" in words and "public_functions" in words    # the scan reads the unit tests (this one too)
    funcs = public_functions()
    assert "guards.py:guard_node" in funcs and "loaders/safe_fs.py:write_file" in funcs
    assert not any(k.split(":")[1].startswith("_") for k in funcs)


def _test_words():
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((PACK_ROOT / "tests" / "unit").glob("*.py"))
                     if p.name != "test_public_functions_tested.py")
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)) | {"public_functions"}


def test_every_public_core_function_is_named_by_a_unit_test():
    words = _test_words()
    funcs = public_functions()
    missing = sorted(k for k, name in funcs.items() if name not in words and k not in ALLOWED)
    assert not missing, "public functions no unit test calls by name (test them directly, or add to ALLOWED with " \
                        "the reason):\n" + "\n".join(missing)
    stale = sorted(k for k in ALLOWED if k not in funcs or funcs[k] in words)
    assert not stale, "ALLOWED entries that are now tested or gone (remove them):\n" + "\n".join(stale)
