"""Architecture rules, checked on the source (AST) so they hold without ComfyUI installed.

* only ``nodes/``, ``bridge/`` and the root ``__init__.py`` import ComfyUI (``comfy*``, ``comfy_api``, ``folder_paths``,
  ``server``, ``nodes``, ``execution``, ``latent_preview``, ``node_helpers``);
* the core (everything outside ``nodes/`` and ``bridge/``, CLI tools included) touches no ComfyUI object either:
  no attribute of a host object (:data:`HOST_ATTRS`: ComfyUI's private VAE methods, ModelPatcher / BaseModel /
  executor members), no host dict key (:data:`HOST_KEYS`: ``transformer_options`` / ``patches_replace`` / block-
  replace argument names) and no ``transformer_options`` parameter (ComfyUI's calling conventions);
* no ``torch.load`` / pickle / ``eval`` / ``exec`` anywhere in the pack;
* every node id is a literal starting with ``DitKit``, unique, and inside the pack every import is relative.
"""
from __future__ import annotations

import ast

import pytest

from tests.support.pack_scan import PACK_ROOT, calls, imported_modules, node_declarations, pack_python_files

# ComfyUI's own top-level modules. (comfy_kitchen / comfy_aimdo are separate pip packages usable without the
# host, so an optional kernel backend may probe them.)
HOST_MODULES = {"comfy", "comfy_api", "comfy_api_nodes", "comfy_extras", "comfy_execution", "comfy_config",
                "folder_paths", "server", "nodes", "execution", "latent_preview", "node_helpers", "cuda_malloc",
                "hook_breaker_ac10a0", "comfyui_version", "protocol"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve"}
FORBIDDEN_CALLS = {"torch.load", "eval", "exec", "pickle.load", "pickle.loads", "torch.jit.load", "numpy.load",
                   "np.load", "torch.serialization.load"}

FILES = pack_python_files()
IDS = [str(p.relative_to(PACK_ROOT)) for p in FILES]


def _may_import_host(rel: str) -> bool:
    # nodes/ (the V3 node classes) and bridge/ (what they install on / call of ComfyUI's objects) are the host layer
    return rel.startswith(("nodes/", "bridge/"))


def _tree(p):
    return ast.parse(p.read_text(encoding="utf-8"), filename=str(p))


def test_scan_covers_the_pack():
    rel = set(IDS)
    # the scan must see the core packages and skip tests/benchmarks (else the checks below prove nothing)
    for must in ("run.py", "errors.py", "loaders/safetensors_io.py", "tiny/checkpoints.py", "nodes/__init__.py"):
        assert must in rel, f"{must} missing from the scanned files"
    assert not any(r.startswith(("tests/", "benchmarks/")) for r in rel)


CORE_FILES = [p for p, i in zip(FILES, IDS) if not _may_import_host(i)]


@pytest.mark.parametrize("path", CORE_FILES, ids=[str(p.relative_to(PACK_ROOT)) for p in CORE_FILES])
def test_only_nodes_import_comfyui(path):
    rel = str(path.relative_to(PACK_ROOT))
    bad = [(line, mod) for line, mod in imported_modules(_tree(path)) if mod in HOST_MODULES]
    assert not bad, f"{rel} imports ComfyUI modules {bad}; only nodes/, bridge/ and the root __init__.py may"


# What the host layer knows and the core must not (collected from what moved to bridge/): attribute names on
# ComfyUI objects (``self.x`` of the core's own classes is not checked), keys of ComfyUI's option / argument dicts,
# and parameter / keyword names of ComfyUI's calling conventions. ``set_model_*`` (ModelPatcher setters) by prefix.
HOST_ATTRS = {
    "_decode_pixels", "_finalize_pixels", "_decode_temporal_chunks",            # MiniMaxH3VideoVAE (private)
    "first_stage_model",                                                        # comfy.sd.VAE
    "model_options", "add_wrapper_with_key", "add_object_patch", "get_model_object", "add_patches",
    "object_patches", "weight_wrapper_patches", "model_patcher",                # ModelPatcher / guider
    "diffusion_model", "model_sampling", "load_device",                         # BaseModel
    "class_obj",                                                                # wrapper executors
    "transformer_options", "patches_replace", "optimized_attention_override",
}
HOST_ATTR_PREFIXES = ("set_model_",)
HOST_KEYS = {"transformer_options", "patches_replace", "model_options", "optimized_attention_override",
             "original_block", "cond_or_uncond", "uuids", "sample_sigmas"}
HOST_PARAMS = {"transformer_options"}
# core files that still hold a host convention while its move to bridge/ is under way elsewhere (strict xfail:
# the lead removes the entry at merge; a file that becomes clean makes its xfail fail)
HOST_CONVENTION_PENDING: dict[str, str] = {}


def host_uses(tree) -> list[tuple[int, str]]:
    """``(line, what)`` of every use of a host name (see HOST_ATTRS / HOST_KEYS / HOST_PARAMS) in ``tree``."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and (n.attr in HOST_ATTRS or n.attr.startswith(HOST_ATTR_PREFIXES)) \
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            out.append((n.lineno, f"attribute .{n.attr}"))
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in HOST_KEYS:
            out.append((n.lineno, f"key [{n.slice.value!r}]"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "setdefault", "pop") \
                and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value in HOST_KEYS:
            out.append((n.lineno, f"key .{n.func.attr}({n.args[0].value!r})"))
        elif isinstance(n, ast.Dict):
            out += [(n.lineno, f"dict key {k.value!r}") for k in n.keys
                    if isinstance(k, ast.Constant) and k.value in HOST_KEYS]
        elif isinstance(n, ast.arg) and n.arg in HOST_PARAMS:
            out.append((n.lineno, f"parameter {n.arg}"))
        elif isinstance(n, ast.keyword) and n.arg in HOST_PARAMS:
            out.append((n.lineno, f"keyword {n.arg}="))
    return sorted(out)


def _core_param(p):
    rel = str(p.relative_to(PACK_ROOT))
    reason = HOST_CONVENTION_PENDING.get(rel)
    return pytest.param(p, id=rel, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize("path", [_core_param(p) for p in CORE_FILES])
def test_core_touches_no_host_objects(path):
    rel = str(path.relative_to(PACK_ROOT))
    bad = host_uses(_tree(path))
    assert not bad, f"{rel} uses ComfyUI's objects or calling conventions {bad}; that belongs in bridge/"


def test_host_scan_detects_violations():
    src = ("def f(vae, m, executor, to):\n"
           "    vae._decode_pixels(1)\n    m.model_options['x'] = 1\n    m.set_model_patch_replace(1)\n"
           "    executor.class_obj\n    to['patches_replace']\n    to.get('transformer_options')\n"
           "    d = {'original_block': 1}\n    self.diffusion_model\n"
           "def g(x, transformer_options=None):\n    return h(x, transformer_options=transformer_options)\n")
    lines = {line for line, _ in host_uses(ast.parse(src))}
    assert lines == {2, 3, 4, 5, 6, 7, 8, 10, 11}      # line 9: self.<name> of the core's own class is allowed


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_no_pickle_torch_load_or_eval(path):
    rel = str(path.relative_to(PACK_ROOT))
    tree = _tree(path)
    bad_mods = [(line, mod) for line, mod in imported_modules(tree) if mod in FORBIDDEN_MODULES]
    bad_calls = [(line, name) for line, name in calls(tree) if name in FORBIDDEN_CALLS]
    assert not bad_mods, f"{rel} imports {bad_mods}: weights go through loaders/safetensors_io.py only"
    assert not bad_calls, f"{rel} calls {bad_calls}: never torch.load/pickle/eval/exec"


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_no_absolute_self_import(path):
    rel = str(path.relative_to(PACK_ROOT))
    bad = [(line, mod) for line, mod in imported_modules(_tree(path)) if mod == "ditkit"]
    assert not bad, f"{rel} imports 'ditkit' absolutely {bad}; ComfyUI loads the pack under another name, " \
                    "use relative imports"


def _aliased_loads(tree) -> list[tuple[int, str]]:
    """``from torch import load`` / ``from torch.serialization import load`` (an alias the call scan can't see)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module in ("torch", "torch.serialization", "numpy") and n.level == 0:
            out += [(n.lineno, f"{n.module}.{a.name}") for a in n.names if a.name in ("load", "loads")]
    return out


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_no_aliased_torch_load(path):
    bad = _aliased_loads(_tree(path))
    assert not bad, f"{path.relative_to(PACK_ROOT)} imports {bad}"


def test_scanner_detects_violations(tmp_path):
    """The AST helpers must flag what the rules forbid (so a passing scan means something)."""
    src = ("import comfy.sd\nfrom folder_paths import get_filename_list\nimport pickle\nimport torch\n"
           "x = torch.load('a')\ny = eval('1')\nimport importlib\nm = importlib.import_module('server')\n"
           "from torch import load\n")
    tree = ast.parse(src)
    mods = {m for _, m in imported_modules(tree)}
    assert {"comfy", "folder_paths", "pickle", "server"} <= mods
    names = {n for _, n in calls(tree)}
    assert {"torch.load", "eval"} <= names
    assert _aliased_loads(tree) == [(9, "torch.load")]


def test_node_ids_start_with_ditkit_and_are_unique():
    decls = node_declarations()
    ids = [d.node_id for d in decls]
    unresolved = [f"nodes/{d.module}.py:{d.class_name}" for d in decls if d.node_id is None]
    assert not unresolved, f"node_id is not a string literal/module constant in {unresolved}"
    bad = [i for i in ids if not i.startswith("DitKit")]
    assert not bad, f"node ids must start with 'DitKit': {bad}"
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, f"duplicate node ids {dupes}"


def test_node_modules_export_nodes_list():
    for p in sorted((PACK_ROOT / "nodes").glob("*.py")):
        if p.name.startswith("_"):
            continue
        tree = _tree(p)
        has = any(isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == "NODES"
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])) for n in tree.body)
        assert has, f"nodes/{p.name} has no module-level NODES list"


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_package_does_not_import_test_code(path):
    """tests/ and benchmarks/ are not installed: the package must run without them."""
    bad = [(line, mod) for line, mod in imported_modules(_tree(path)) if mod in ("tests", "benchmarks")]
    assert not bad, f"{path.relative_to(PACK_ROOT)} imports test/benchmark code {bad}"


# ComfyUI's attention calling convention and H3 packed-layout class: names of the host layer (bridge/attention.py)
HOST_ATTENTION_NAMES = ("transformer_options", "skip_reshape", "optimized_attention", "PackedLayout")


def _host_attention_names(tree) -> list[tuple[int, str]]:
    """(line, text) of every string constant, name, attribute, argument or keyword that mentions a host name."""
    out = []
    for n in ast.walk(tree):
        texts = []
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            texts.append(n.value)
        elif isinstance(n, ast.Name):
            texts.append(n.id)
        elif isinstance(n, ast.Attribute):
            texts.append(n.attr)
        elif isinstance(n, ast.arg):
            texts.append(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            texts.append(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts.append(n.name)
        out += [(getattr(n, "lineno", 0), t) for t in texts if any(h in t for h in HOST_ATTENTION_NAMES)]
    return out


KERNEL_FILES = sorted((PACK_ROOT / "kernels").glob("*.py"))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_kernels_hold_no_comfyui_attention_names(path):
    """kernels/ is plain tensors: ComfyUI's override protocol and transformer_options live in bridge/."""
    bad = _host_attention_names(_tree(path))
    assert not bad, f"kernels/{path.name} mentions ComfyUI's attention convention {bad}; move it to bridge/attention.py"


def test_host_attention_name_scan_detects_violations():
    src = ('"""Docs may say transformer_options."""\nKEY = "ditkit"\ndef f(func, q, *, skip_reshape=False):\n'
           '    return q\nf(None, 1, skip_reshape=True)\nx = opts.optimized_attention_override\n')
    found = {t for _, t in _host_attention_names(ast.parse(src))}
    assert found == {"Docs may say transformer_options.", "skip_reshape", "optimized_attention_override"}
    assert len(KERNEL_FILES) >= 8   # the scan sees the kernel modules


BENCH_FILES = sorted((PACK_ROOT / "benchmarks").rglob("*.py"))
PICKLE_CALLS = {"torch.save", "torch.load", "torch.jit.load", "torch.serialization.load", "pickle.load",
                "pickle.loads", "pickle.dump", "pickle.dumps", "np.save", "numpy.save", "np.load", "numpy.load"}


def pickle_writes(tree) -> list[tuple[int, str]]:
    """``(line, what)`` of every pickle-format save/load (``torch.save`` / ``torch.load`` / ``pickle`` / numpy
    object files) and every ``.pt`` / ``.pth`` / ``.pkl`` / ``.ckpt`` / ``.bin`` file name in a string."""
    out = [(line, name) for line, name in calls(tree) if name in PICKLE_CALLS]
    out += [(line, mod) for line, mod in imported_modules(tree) if mod in FORBIDDEN_MODULES]
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) \
                and n.value.lower().endswith((".pt", ".pth", ".pkl", ".ckpt", ".bin")):
            out.append((n.lineno, repr(n.value)))
    return sorted(out)


@pytest.mark.parametrize("path", BENCH_FILES, ids=[str(p.relative_to(PACK_ROOT)) for p in BENCH_FILES])
def test_benchmarks_write_safetensors_only(path):
    """Benchmarks too: results and tensors go to safetensors / JSON, never a pickle (issue #28, house items)."""
    bad = pickle_writes(_tree(path))
    assert not bad, f"{path.relative_to(PACK_ROOT)} writes or reads pickle files {bad}; use safetensors"


def test_pickle_write_scan_detects_violations():
    src = ("import torch\ntorch.save(x, out)\nout = td / f'{m}.pt'\nd = torch.load('a.pt')\n"
           "name = 'model.safetensors'\nimport pickle\n")
    assert [line for line, _ in pickle_writes(ast.parse(src))] == [2, 3, 4, 4, 6]
    assert len(BENCH_FILES) >= 10
