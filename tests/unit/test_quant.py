"""kernels/quant.py against math written here (the host's own quantize is the oracle in
tests/integration/test_quant_host.py).

Oracles: the fp8 / e2m1 encodings are checked by enumerating every code of the format (torch decodes the
codes, the test picks the nearest with ties to the even code); int8 by round-half-even written out; the cuBLAS
block-scale layout by NVIDIA's documented offset formula; requantize_add by quantizing the whole updated weight.
"""
from __future__ import annotations

import math

import pytest
import torch

from _kernels_interp import ensure_interpreted, interpreter_ok  # noqa: E402  (tests/unit on sys.path)

from ditkit.kernels import quant as Q

PER_TENSOR = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise")
FP8 = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 2)
    w = w.to(dtype)
    w.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-7, -3e-8]).to(dtype)
    return w


def _nearest_code(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest finite table entry, ties to the even index, sign kept for zero results."""
    finite = torch.isfinite(table)
    t = torch.where(finite, table, torch.full_like(table, float("inf")))
    d = (values.double().unsqueeze(-1) - t.double()).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    idx = torch.arange(len(table))
    even = cand & (idx % 2 == 0)
    pick = torch.where(even.any(-1), (even * (idx + 1)).argmax(-1), (cand * (idx + 1)).argmax(-1))
    return pick


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_is_nearest_code_of_the_rounded_scaled_value(fmt, dtype):
    dt, lp = FP8[fmt]
    w = _weights((16, 40), dtype)
    data, s = Q.quantize(w, fmt)
    scale = s["weight_scale"]
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == pytest.approx(w.abs().max().float().item() / lp, rel=1e-6)
    # the value the host encodes: x * (1/scale) rounded to the source dtype, clamped
    v = torch.clamp((w.float() * (1.0 / scale).to(dtype).float()).to(dtype).float(), -lp, lp)
    codes = torch.arange(128, dtype=torch.uint8)          # non-negative half of the table
    table = codes.view(dt).float()
    mag = _nearest_code(v.abs().flatten(), table).to(torch.uint8)
    expect = mag | (torch.signbit(v.flatten()).to(torch.uint8) << 7)
    assert torch.equal(data.view(torch.uint8).flatten(), expect)


def test_fp16_fp8_scale_follows_the_fp16_clamp():
    w = torch.full((2, 4), 1e-3, dtype=torch.float16)
    w[0, 0] = 6e-6                                        # amax stays 1e-3
    s = Q.per_tensor_scale(w, "float8_e4m3fn")
    fi = torch.finfo(torch.float16)
    raw = torch.tensor(1e-3, dtype=torch.float16).float() / 448.0
    assert s.item() == (1.0 / torch.clamp(1.0 / raw, min=fi.min, max=fi.max)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_is_round_half_even_of_the_quotient(dtype):
    w = _weights((8, 64), dtype)
    w[1, :6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5]).to(dtype)
    data, s = Q.quantize(w, "int8_tensorwise")
    amax = w.abs().max().float().item()
    assert s["weight_scale"].item() == pytest.approx(amax / 127.0, rel=1e-7)
    q = (w.float() / s["weight_scale"].to(dtype).float()).to(dtype).double()
    f = torch.floor(q)
    frac = q - f
    rne = torch.where(frac > 0.5, f + 1, torch.where(frac < 0.5, f, f + (f % 2)))
    assert torch.equal(data.to(torch.float64), rne.clamp(-128, 127))


def test_e2m1_codes_are_nearest_with_ties_to_even():
    table = torch.tensor(Q.E2M1_VALUES)
    v = torch.linspace(0, 6, 601)
    v = torch.cat([v, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    got = Q.e2m1_codes(v)
    assert torch.equal(got, _nearest_code(v, table).to(torch.uint8))
    neg = Q.e2m1_codes(-v)
    assert torch.equal(neg, got | 8)


@pytest.mark.parametrize("rows,cols", [(1, 1), (130, 7), (256, 8), (300, 13)])
def test_blocked_layout_matches_the_cublas_offset_formula(rows, cols):
    m = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols) + 1
    b = Q.to_blocked(m)
    pr, pc = math.ceil(rows / 128) * 128, math.ceil(cols / 4) * 4
    assert b.shape == (pr, pc)
    flat = b.flatten()
    ncb = pc // 4
    for r in range(rows):
        for c in range(cols):
            off = (r // 128) * ncb * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert flat[off] == m[r, c]
    assert int((flat != 0).sum()) == rows * cols                # padding is zero
    assert torch.equal(Q.from_blocked(b, rows, cols), m)


def test_mxfp8_block_scale_is_the_smallest_power_of_two_that_fits():
    w = _weights((40, 96), torch.bfloat16)
    data, s = Q.quantize(w, "mxfp8")
    assert data.shape == (64, 96) and s["weight_scale"].dtype == torch.float8_e8m0fnu
    e = Q.from_blocked(s["weight_scale"].view(torch.uint8), 64, 3).to(torch.int64)
    amax = w.float().reshape(40, 3, 32).abs().amax(-1)
    for r in range(40):
        for b in range(3):
            if amax[r, b] == 0:
                assert e[r, b] == 0
                continue
            k = int(e[r, b]) - 127
            assert 2.0 ** k * 448.0 >= amax[r, b] > 2.0 ** (k - 1) * 448.0 * (1 - 1e-6)
    assert (e[40:] == 0).all()                                  # padded rows: zero blocks
    rec = Q.dequantize(data, s, "mxfp8", (40, 96))
    assert rec.shape == (40, 96)
    err = (rec - w.float()).abs()
    half_ulp = (2.0 ** (e[:40] - 127).float()).repeat_interleave(32, dim=1) * 16.0   # e4m3 ulp is 32 at 448
    assert (err <= half_ulp).all()


def test_nvfp4_reconstruction_and_layout():
    w = _weights((20, 48), torch.bfloat16)
    data, s = Q.quantize(w, "nvfp4")
    assert data.shape == (32, 24) and data.dtype == torch.uint8
    assert s["weight_scale"].shape == (128, 4) and s["weight_scale"].dtype == torch.float8_e4m3fn
    s2 = s["weight_scale_2"]
    assert s2.dtype == torch.float32 and s2.dim() == 0
    assert s2.item() == (w.abs().max() / (448.0 * 6.0)).float().item()
    rec = Q.dequantize(data, s, "nvfp4", (20, 48))
    bs = Q.from_blocked(s["weight_scale"], 32, 3).float()[:20].repeat_interleave(16, dim=1) * s2
    assert ((rec - w.float()).abs() <= bs * 1.0 + 1e-6).all()  # e2m1 spacing is at most 2 -> error <= 1 step unit
    assert torch.equal(Q.dequantize(data, s, "nvfp4")[20:], torch.zeros(12, 48))


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_all_zero_weight_stays_finite_and_exact(fmt):
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    data, s = Q.quantize(w, fmt)
    for v in s.values():
        assert torch.isfinite(v.float()).all()
    assert torch.equal(Q.dequantize(data, s, fmt, (32, 64)), torch.zeros(32, 64))


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
@pytest.mark.parametrize("shape", [(16, 64), (33, 17), (130, 100)])
def test_storage_layout_is_what_quantize_returns(fmt, shape):
    data, s = Q.quantize(_weights(shape, torch.bfloat16), fmt)
    lay = Q.storage_layout(shape, fmt)
    got = {"weight": data, **s}
    assert set(lay) == set(got)
    for k, (sh, dt) in lay.items():
        assert tuple(got[k].shape) == sh and got[k].dtype == dt
    assert Q.quantized_nbytes(shape, fmt) == sum(t.numel() * t.element_size() for t in got.values())


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_requantize_add_in_chunks_equals_one_shot(fmt, dtype):
    shape = (300, 70)
    w = _weights(shape, dtype)
    data, s = Q.quantize(w, fmt)
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(*shape, generator=g) * w.float().abs().max() * 0.05
    want = Q.quantize((Q.dequantize(data, s, fmt, shape) + delta).to(dtype), fmt)
    got = Q.requantize_add(data, s, fmt, shape, lambda a, b: delta[a:b], dtype=dtype, chunk_rows=100)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert set(got[1]) == set(want[1])
    for k in want[1]:
        assert got[1][k].dtype == want[1][k].dtype
        assert torch.equal(got[1][k].reshape(-1).view(torch.uint8), want[1][k].reshape(-1).view(torch.uint8))


def test_refusals():
    with pytest.raises(ValueError, match="unknown quantization format"):
        Q.quantize(torch.ones(2, 2), "float4_magic")
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize(torch.ones(4), "float8_e4m3fn")
    with pytest.raises(ValueError, match="float32 / bfloat16 / float16"):
        Q.quantize(torch.ones(2, 2, dtype=torch.float64), "float8_e4m3fn")
    # an empty weight: named, before any reduction (torch's amax of nothing was the message); one element is fine
    for fmt in Q.FORMATS:
        for shape in ((0, 16), (3, 0), (0, 0)):
            with pytest.raises(ValueError, match=rf"{fmt}: an empty weight \(shape \[{shape[0]}, {shape[1]}\]\)"):
                Q.quantize(torch.ones(shape), fmt)
        Q.quantize(torch.ones(1, 1), fmt)


# ------------------------------------------------------------------------------------------ Triton kernel

@pytest.fixture(scope="module")
def interp():
    ensure_interpreted()
    why = interpreter_ok()
    if why:
        pytest.skip(why)
    import importlib

    from ditkit.kernels import quant
    return importlib.reload(quant) if not quant.HAS_TRITON or not _interpreted(quant) else quant


def _interpreted(mod) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(mod._per_tensor_quant_kernel, InterpretedFunction)


@pytest.mark.parametrize("fmt", PER_TENSOR)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_cols", [1, 37, 300])
def test_triton_kernel_equals_reference(interp, fmt, dtype, n_cols):
    w = _weights((9, n_cols), dtype, seed=n_cols)
    w[-1, :1] = 1e-30 if dtype != torch.float16 else 1e-7     # subnormal results
    ref, sr = interp.quantize(w, fmt)
    got, sg = interp.quantize(w, fmt, backend="triton")
    assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(sg["weight_scale"], sr["weight_scale"])


def test_triton_kernel_covers_every_fp8_code(interp):
    # every e4m3fn magnitude and the midpoints between neighbours (ties) through the kernel with scale 1
    vals = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    w = torch.cat([vals, mids, -vals, -mids]).reshape(1, -1)
    got = interp.quantize_per_tensor_triton(w, torch.tensor(1.0), "float8_e4m3fn", block=64)
    assert torch.equal(got.view(torch.uint8), w.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
@pytest.mark.parametrize("shape", [(300, 70), (129, 33), (256, 16)])
def test_row_sliced_quantize_equals_one_slice(fmt, shape, monkeypatch):
    w = _weights(shape, torch.bfloat16, seed=shape[0])
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1 << 40)
    one = Q.quantize(w, fmt)
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)          # 128-row slices
    assert Q._row_step(shape[1]) == 128
    sliced = Q.quantize(w, fmt)
    assert torch.equal(sliced[0].view(torch.uint8), one[0].view(torch.uint8))
    for k in one[1]:
        assert torch.equal(sliced[1][k].reshape(-1).view(torch.uint8), one[1][k].reshape(-1).view(torch.uint8))
    e2, r2 = Q.reconstruction_error(w, *sliced, fmt)
    rec = Q.dequantize(*one, fmt, shape)
    assert e2 == pytest.approx(float(((rec - w.float()) ** 2).sum()), rel=1e-5)
    assert r2 == pytest.approx(float((w.float() ** 2).sum()), rel=1e-5)


def test_triton_backend_measures_the_same_error_and_sees_non_finite(interp, monkeypatch):
    monkeypatch.setattr(interp, "CHUNK_ELEMS", 1)
    w = (torch.randn(300, 64, generator=torch.Generator().manual_seed(6)) * 0.02).to(torch.bfloat16)
    ref, tri = interp.ErrorSample(2), interp.ErrorSample(2)
    a = interp.quantize(w, "float8_e4m3fn", error=ref)
    b = interp.quantize(w, "float8_e4m3fn", backend="triton", error=tri)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    assert (ref.e2, ref.r2, ref.rows, ref.total_rows) == (tri.e2, tri.r2, tri.rows, tri.total_rows) == \
        (ref.e2, ref.r2, 128 + 44, 300)
    w[299, 0] = float("nan")
    with pytest.raises(interp.NonFiniteWeight):
        interp.quantize(w, "int8_tensorwise", backend="triton", finite=True)
