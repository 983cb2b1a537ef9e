"""Backend dispatch rules, with mocked device capabilities and packages (no GPU needed)."""
from __future__ import annotations

import logging

import pytest
import torch

from _kernels_interp import ensure_interpreted  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.errors import BackendError  # noqa: E402
from ditkit.kernels import block_sparse, registry  # noqa: E402
from ditkit.kernels.registry import REGISTRY, Impl, Registry  # noqa: E402

OP = "block_sparse_attn"


@pytest.fixture
def gpu(monkeypatch):
    """Pretend a CUDA device with a chosen capability; real packages unless overridden."""
    state = {"cap": (9, 0), "pkgs": {}}
    monkeypatch.setattr(registry, "device_capability", lambda dev: state["cap"] if dev.type == "cuda" else None)
    real = block_sparse.package_available
    monkeypatch.setattr(block_sparse, "package_available", lambda n: state["pkgs"].get(n, real(n)))
    monkeypatch.setattr(block_sparse, "HAS_TRITON", True)
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
    gpu["cap"] = cap
    gpu["pkgs"] = {"flashinfer": True, "flashinfer.cute_dsl.sparse.bsa_attn_sm100": True,
                   "flashinfer.cute_dsl.sparse.bsa_attn_sm120": True}
    sel = REGISTRY.resolve(OP, "cuda:0", dtype, D)
    assert (sel.backend == "flashinfer") == ok
    if not ok:
        assert "flashinfer" in dict(sel.rejected)


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
