"""Backend dispatch rules, with mocked device capabilities and packages (no GPU needed)."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from _kernels_interp import ensure_interpreted  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.errors import BackendError  # noqa: E402
from ditkit.kernels import block_sparse_comfy_kitchen, block_sparse_flashinfer, block_sparse_triton, registry  # noqa: E402,E501
from ditkit.kernels.registry import REGISTRY, Impl, Registry  # noqa: E402

OP = "block_sparse_attn"


@pytest.fixture
def gpu(monkeypatch):
    """Pretend a CUDA device with a chosen capability; real packages unless overridden."""
    state = {"cap": (9, 0), "pkgs": {}}
    monkeypatch.setattr(registry, "device_capability", lambda dev: state["cap"] if dev.type == "cuda" else None)
    real = registry.package_available
    for mod in (block_sparse_flashinfer, block_sparse_comfy_kitchen):     # the backends that probe packages
        monkeypatch.setattr(mod, "package_available", lambda n: state["pkgs"].get(n, real(n)))
    monkeypatch.setattr(block_sparse_triton, "HAS_TRITON", True)
    REGISTRY.clear_cache()
    yield state
    REGISTRY.clear_cache()


def test_cpu_auto_is_cpu_batched_and_reasons_are_recorded():
    REGISTRY.clear_cache()
    sel = REGISTRY.resolve(OP, "cpu", torch.float32, 128)
    assert sel.backend == "cpu_batched" and sel.exact
    rej = dict(sel.rejected)
    assert set(rej) == {"flashinfer", "triton", "flex", "comfy_kitchen", "cpu_native"}
    assert "CUDA" in rej["flashinfer"] and "explicit" in rej["flex"]
    assert "explicit only" in rej["cpu_native"]              # builds a C++ extension: never picked by auto
    assert "block-sparse" in rej["comfy_kitchen"] or "not installed" in rej["comfy_kitchen"]


def test_hopper_picks_triton(gpu):
    gpu["cap"] = (9, 0)
    sel = REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 128)
    assert sel.backend == "triton"
    assert "sm100/103/120/121" in dict(sel.rejected)["flashinfer"]


def test_turing_falls_to_reference_with_reasons(gpu):
    gpu["cap"] = (7, 5)
    sel = REGISTRY.resolve(OP, "cuda:0", torch.float16, 128)
    assert sel.backend == "reference"
    assert "sm80" in dict(sel.rejected)["triton"] and "sm80" in dict(sel.rejected)["flex"]
    assert "CPU only" in dict(sel.rejected)["cpu_batched"]


@pytest.mark.parametrize("cap,dtype,D,ok", [((10, 0), torch.bfloat16, 128, True), ((10, 0), torch.float16, 128, False),
                                            ((12, 0), torch.float16, 128, True), ((10, 3), torch.bfloat16, 64, False),
                                            ((9, 0), torch.bfloat16, 128, False)])
def test_flashinfer_gate(gpu, cap, dtype, D, ok):
    """Where FlashInfer's kernels exist it runs on explicit request only (it has never been run: unverified);
    auto keeps the tested triton kernel there."""
    gpu["cap"] = cap
    gpu["pkgs"] = {"flashinfer": True, "flashinfer.cute_dsl.sparse.bsa_attn_sm100": True,
                   "flashinfer.cute_dsl.sparse.bsa_attn_sm120": True}
    sel = REGISTRY.resolve(OP, "cuda:0", dtype, D)
    assert sel.backend != "flashinfer" and sel.verified
    assert "flashinfer" in dict(sel.rejected)
    if ok:
        assert sel.backend == "triton"
        assert "never run on any hardware" in dict(sel.rejected)["flashinfer"]
        ex = REGISTRY.resolve(OP, "cuda:0", dtype, D, backend="flashinfer")
        assert ex.backend == "flashinfer" and not ex.verified and ex.unverified
        assert "UNVERIFIED" in ex.summary() and ex.as_dict()["verified"] is False
        assert "UNVERIFIED" in REGISTRY.explain(OP, "cuda:0", dtype, D)["flashinfer"]
    else:
        with pytest.raises(BackendError, match="flashinfer"):
            REGISTRY.resolve(OP, "cuda:0", dtype, D, backend="flashinfer")


def test_auto_skips_an_unverified_backend_even_first_in_priority():
    r = Registry()
    r.op("x", lambda: "ref")
    ok = lambda q, explicit: None  # noqa: E731
    r.impl("x", Impl("new", lambda: "new", ok, priority=0, unverified="no device of this kind was available"))
    r.impl("x", Impl("tested", lambda: "tested", ok, priority=1))
    sel = r.resolve("x", "cpu", torch.float32, 64)
    assert sel.backend == "tested" and sel.verified
    assert "never run on any hardware (no device of this kind" in dict(sel.rejected)["new"]
    ex = r.resolve("x", "cpu", torch.float32, 64, backend="new")
    assert ex.backend == "new" and not ex.verified and "no device of this kind" in ex.unverified
    assert r.unverified("x", "new") and r.unverified("x", "tested") is None


def _backends_run_by_kernel_tests() -> set[str]:
    """Backend names the kernel tests run (string values of every ``parametrize`` whose names include
    'backend'), read by AST from tests/unit/test_kernels_*.py, this file excluded (it mocks capabilities)."""
    import ast
    from pathlib import Path

    names = set()
    for path in Path(__file__).parent.glob("test_kernels_*.py"):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "parametrize" and node.args
                    and isinstance(node.args[0], ast.Constant) and "backend" in str(node.args[0].value)):
                for sub in ast.walk(node.args[1]) if len(node.args) > 1 else ():
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        names.add(sub.value)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # _cases([...]) helper lists
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_cases":
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        names.add(sub.value)
    return names


def test_every_auto_eligible_backend_is_run_by_a_kernel_test():
    """auto only chooses code that has run: a backend with a launcher that no kernel test runs must be marked
    unverified (explicit only). FlashInfer (no sm100/sm120 device anywhere) is the known one."""
    ran = _backends_run_by_kernel_tests()
    assert {"triton", "flex", "cpu_batched", "reference"} <= ran, ran
    untested = []
    for op in REGISTRY.ops.values():
        for impl in op.impls.values():
            if impl.fn is not None and impl.exact and impl.unverified is None and impl.name not in ran:
                untested.append(f"{op.name}:{impl.name}")
    assert not untested, f"auto-eligible backends no kernel test runs (mark them unverified): {untested}"
    assert REGISTRY.unverified(OP, "flashinfer")


def test_flashinfer_needs_package(gpu):
    gpu["cap"] = (10, 0)
    gpu["pkgs"] = {"flashinfer": False}
    sel = REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 128)
    assert sel.backend == "triton" and "not installed" in dict(sel.rejected)["flashinfer"]


def test_head_dim_gate(gpu):
    sel = REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 96)
    assert sel.backend == "flex" and "head_dim" in dict(sel.rejected)["triton"]


def test_explicit_backend_refused_not_swapped(gpu):
    gpu["cap"] = (8, 6)
    with pytest.raises(BackendError, match="flashinfer"):
        REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 128, backend="flashinfer")
    with pytest.raises(BackendError, match="comfy_kitchen"):
        REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 128, backend="comfy_kitchen")
    with pytest.raises(BackendError, match="not known"):
        REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 128, backend="nope")
    assert REGISTRY.resolve(OP, "cuda:0", torch.bfloat16, 128, backend="reference").backend == "reference"


def test_cpu_triton_only_under_interpreter(monkeypatch):
    from ditkit.kernels import _triton

    REGISTRY.clear_cache()
    monkeypatch.setattr(_triton, "INTERPRETED", False)
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        REGISTRY.resolve(OP, "cpu", torch.float32, 64, backend="triton")
    REGISTRY.clear_cache()


def _toy(calls):
    r = Registry()
    r.op("x", lambda: "ref")
    checks = {"n": 0}

    def check_ok(q, explicit):
        checks["n"] += 1
        return None

    def boom():
        calls.append("fast")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    r.impl("x", Impl("fast", boom, check_ok, priority=1))
    r.impl("x", Impl("other", lambda: calls.append("other"), check_ok, priority=2))
    r.impl("x", Impl("sage", lambda: "approx", check_ok, exact=False, priority=0))
    return r, checks


def test_resolution_cached_and_logged_once(caplog):
    r, checks = _toy([])
    with caplog.at_level(logging.INFO, logger="ditkit.kernels"):
        a = r.resolve("x", "cpu", torch.float16, 64)
        b = r.resolve("x", "cpu", torch.float16, 64)
    assert a is b and checks["n"] == 1
    assert sum("kernel x -> fast" in m for m in caplog.messages) == 1
    r.resolve("x", "cpu", torch.float32, 64)      # another dtype -> resolved again
    assert checks["n"] == 2


def test_approximate_only_on_request():
    r, _ = _toy([])
    sel = r.resolve("x", "cpu", torch.float16, 64)
    assert sel.backend == "fast" and "approximate" in dict(sel.rejected)["sage"]
    ex = r.resolve("x", "cpu", torch.float16, 64, backend="sage")
    assert ex.backend == "sage" and not ex.exact


def test_device_error_is_not_retried():
    calls = []
    r, _ = _toy(calls)
    sel = r.resolve("x", "cpu", torch.float16, 64)
    with pytest.raises(RuntimeError, match="illegal memory"):
        sel.fn()
    assert calls == ["fast"], "no other kernel may run after a device error"
    assert r.resolve("x", "cpu", torch.float16, 64).backend == "fast"


def test_explain_lists_every_backend():
    ex = REGISTRY.explain(OP, "cpu", torch.float32, 128)
    assert set(ex) == set(REGISTRY.backends(OP))
    assert ex["reference"] == "ok"


# the backend values the node has shipped with (saved workflows carry them): built from the registry, unchanged
SHIPPED_BACKENDS = ["auto", "triton", "flex", "cpu_batched", "cpu_native", "reference", "flashinfer", "comfy_kitchen"]


def _node_backend_combo() -> tuple[list[str], str]:
    """DitKitSparseAttention's backend options and tooltip, read by AST (no ComfyUI needed); the options must be
    built from the registry (``["auto"] + REGISTRY.menu(OP)``), whose value is then computed here."""
    import ast
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "nodes" / "sparse_attention.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    consts = {t.id: st.value for st in tree.body if isinstance(st, ast.Assign) for t in st.targets
              if isinstance(t, ast.Name)}
    for call in ast.walk(tree):
        if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "Input" and call.args
                and isinstance(call.args[0], ast.Constant) and call.args[0].value == "backend"):
            kw = {k.arg: k.value for k in call.keywords}
            opts, tip = kw["options"], kw["tooltip"]
            opts = consts[opts.id] if isinstance(opts, ast.Name) else opts
            tip = consts[tip.id] if isinstance(tip, ast.Name) else tip
            assert ast.unparse(opts) == f"['auto'] + REGISTRY.menu('{OP}')", ast.unparse(opts)
            return ["auto"] + REGISTRY.menu(OP), ast.literal_eval(tip)
    raise AssertionError("no 'backend' combo in nodes/sparse_attention.py")


def test_node_combo_says_why_a_backend_never_runs_or_is_unverified():
    options, tip = _node_backend_combo()
    impls = REGISTRY.ops[OP].impls
    assert set(options) == {"auto", "reference"} | set(impls), options
    for name in options:
        impl = impls.get(name)
        if impl is None:
            continue
        if impl.fn is None:  # no launcher: refused on every machine
            assert re.search(rf"{name}\b[^.]*never runs", tip), (name, tip)
        if impl.unverified:
            assert re.search(rf"{name}\b[^.]*UNVERIFIED", tip), (name, tip)


def test_node_combo_is_built_from_the_registry_with_the_shipped_values():
    options, _ = _node_backend_combo()
    assert options == SHIPPED_BACKENDS
    # a registered backend appears in the combo without editing the node; placeholders and unverified ones last
    r = Registry()
    r.op("x", lambda *a: None)
    r.impl("x", Impl("late", None, lambda q, e: None, priority=1, placeholder=True))
    r.impl("x", Impl("new", lambda *a: None, lambda q, e: None, priority=50))
    r.impl("x", Impl("manual", lambda *a: None, lambda q, e: None, priority=2, explicit_only=True))
    r.impl("x", Impl("untried", lambda *a: None, lambda q, e: None, priority=3, unverified="no device"))
    assert r.menu("x") == ["new", "manual", "reference", "untried", "late"]


def test_one_backend_per_file_with_its_custom_op_beside_the_launcher():
    """Each block_sparse_attn backend lives in its own module; a Triton launcher's custom op is defined there."""
    import inspect

    impls = REGISTRY.ops[OP].impls
    mods = {name: inspect.getmodule(i.check).__name__.rsplit(".", 1)[-1] for name, i in impls.items()}
    assert len(set(mods.values())) == len(mods), mods
    assert mods["triton"] == "block_sparse_triton" and block_sparse_triton.CUSTOM_OP is not None or \
        not block_sparse_triton.HAS_TRITON
