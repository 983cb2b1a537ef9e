"""benchmarks/gpu_check.py's bit-level expectation of delta_fuse's in-kernel rounding step (issue 29: a difference
that only shows on a GPU is written down as an explicit check). On CPU (Triton interpreter) the fp16 rows must PASS
and the bf16 rows PASS or SKIP (the interpreter's bf16 cast); the kernel without its rounding step must FAIL the fp16
rows: the check can tell."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from _kernels_interp import ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc_mod():
    spec = importlib.util.spec_from_file_location("gpu_check_rounding_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(gc_mod):
    ctx = gc_mod.Ctx(torch.device("cpu"), "tiny", 240)
    gc_mod.delta_fuse_rounding(ctx, "kernels")
    return ctx.rows


def test_rounding_rows_pass_on_the_interpreter(gc_mod):
    need_triton()
    rows = _rows(gc_mod)
    assert len(rows) == 4, rows
    for r in rows:
        assert r["figures"]["differs_without_rounding"] > 0, r          # the data can tell the step
        if r["dtype"] == "fp16":
            assert r["result"] == "PASS" and r["figures"]["mismatches"] == 0, r
        else:
            assert r["result"] in ("PASS", "SKIP"), r


def test_dropping_the_rounding_step_fails(gc_mod, monkeypatch):
    """The kernel without its rounding step, emulated by the launcher adding the unrounded fp32 product (what
    ``(acc * scale).to(tl.float32)`` without the ``.to(W.dtype)`` computes)."""
    need_triton()
    from ditkit.kernels import delta_fuse

    def unrounded(weight, kind, parts, scale, row_map=None, **kw):
        d = delta_fuse.delta_rows(kind, parts, torch.arange(weight.shape[0]))
        weight.copy_((weight.float() + d * torch.tensor(scale, dtype=torch.float32)).to(weight.dtype))
        return weight

    monkeypatch.setattr(delta_fuse, "fuse_triton_", unrounded)
    rows = _rows(gc_mod)
    fp16 = [r for r in rows if r["dtype"] == "fp16"]
    assert fp16 and all(r["result"] == "FAIL" and r["figures"]["equals_unrounded"] for r in fp16), rows


def _quant_rows(gc_mod):
    ctx = gc_mod.Ctx(torch.device("cpu"), "tiny", 240)
    gc_mod.quant_block_bits(ctx, "kernels")
    return ctx.rows


def test_block_quant_rows_pass_on_the_interpreter(gc_mod):
    need_triton()
    rows = _quant_rows(gc_mod)
    bits = [r for r in rows if "block kernels" in r["check"]]
    assert len(bits) == 6 and {r["dtype"] for r in bits} == {"fp16", "bf16", "fp32"}, rows
    assert all(r["result"] == "PASS" and r["figures"]["data_mismatches"] == 0 for r in bits), bits
    log2 = [r for r in rows if "log2" in r["check"]]
    assert len(log2) == 1 and log2[0]["result"] == "SKIP" and log2[0]["figures"]["differing_values"] == 0


def test_a_wrong_block_kernel_fails_the_row(gc_mod, monkeypatch):
    """A kernel whose nvfp4 division rounds differently, emulated by flipping the low bit of one data byte."""
    need_triton()
    from ditkit.kernels import quant

    real = quant.quantize_blocks_triton

    def off_by_one(w, fmt, s2=None, out=None, **kw):
        d, s = real(w, fmt, s2, out=out, **kw)
        if fmt == "nvfp4":
            d.view(torch.uint8)[5, 3] ^= 1
        return d, s

    monkeypatch.setattr(quant, "quantize_blocks_triton", off_by_one)
    rows = [r for r in _quant_rows(gc_mod) if "block kernels" in r["check"]]
    assert all(r["result"] == ("FAIL" if r["check"].startswith("nvfp4") else "PASS") for r in rows), rows
    assert all(r["figures"]["data_mismatches"] == 1 for r in rows if r["check"].startswith("nvfp4"))
