"""The fast quantize path (issue #34): same bits as the host's operations written here, the error measured while
quantizing (sampled or full), non-finite weights seen from the amax, and the stream's progress / error modes.

Oracles: the host's layout-quantize operations written in the test (fp8: ``clamp((w * bf16(1/s)), -lp, lp)`` cast;
int8: ``round(w / s).clamp(-128, 127)``), over every finite bf16 / fp16 bit pattern; the reconstruction error as
``sum((dequantize(...) - w)^2)`` over the rows the sample names (``dequantize`` is checked against the host in
tests/integration/test_quant_host.py)."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import CheckpointError
from ditkit.kernels import quant as Q
from ditkit.loaders import quantize as QC

FORMATS = list(Q.FORMATS)
FP8 = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}


def _all_finite(dtype) -> torch.Tensor:
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


def _host_ops(w, fmt):
    """The host's deterministic layout quantize, written out (scale from the amax as in the module doc)."""
    amax = w.abs().amax().float()
    if fmt == "int8_tensorwise":
        s = (amax / 127.0).clamp(min=1e-30)
        return (w / s.to(w.dtype)).round().clamp(-128, 127).to(torch.int8), s
    dt, lp = FP8[fmt]
    s = amax / lp
    if w.dtype == torch.float16:
        s = 1.0 / torch.clamp(1.0 / s, min=-65504.0, max=65504.0)
    return torch.clamp(w * (1.0 / s).to(w.dtype), -lp, lp).to(dt), s


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amax", [1.0, 0.3, 1234.5, 3.0e-3])
def test_every_source_value_gets_the_host_code(fmt, dtype, amax):
    vals = _all_finite(dtype)
    vals = vals[vals.float().abs() <= amax]
    w = torch.cat([vals, torch.tensor([amax, -amax], dtype=dtype)])
    w = torch.nn.functional.pad(w, (0, -w.numel() % 256)).reshape(-1, 256)
    want, s = _host_ops(w, fmt)
    data, scales = Q.quantize(w, fmt)
    assert torch.equal(scales["weight_scale"], s)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
def test_clamp_skip_boundary_both_sides(fmt, dtype, monkeypatch):
    """Weights whose amax's product lands exactly on the limit, just over it (the clamp must run) and under it."""
    seen = set()
    g = torch.Generator().manual_seed(1)
    for i in range(400):
        amax = float(torch.rand((), generator=g)) * 10 + 0.01
        w = (torch.rand(64, 64, generator=g) * 2 - 1).mul(amax).to(dtype)
        w[0, 0] = amax
        a = w.abs().amax()
        if fmt == "int8_tensorwise":
            s = Q._int8_scale_math(Q.per_tensor_scale(w, fmt), w)
            top = float((a / s).round())
            lim = 127.0
        else:
            top = float(a * (1.0 / Q.per_tensor_scale(w, fmt)).to(dtype))
            lim = 448.0
        seen.add("over" if top > lim else "equal" if top == lim else "under")
        want, _ = _host_ops(w, fmt)
        data, _ = Q.quantize(w, fmt)
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), (i, top)
    assert "equal" in seen or "under" in seen


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_two_step_path_when_the_fused_cast_is_not_proven(fmt, dtype, monkeypatch):
    w = (torch.randn(300, 96, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    fast = Q.quantize(w, fmt)[0]
    monkeypatch.setattr(Q, "_fused_cast_ok", lambda *a: False)
    slow = Q.quantize(w, fmt)[0]
    want, _ = _host_ops(w, fmt)
    assert torch.equal(fast.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(slow.view(torch.uint8), want.view(torch.uint8))


def test_fused_cast_probe_holds_on_this_torch():
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for out in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert Q._fused_cast_ok(dt, out) is True


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_every_slice_equals_reconstruction_error(fmt, dtype, monkeypatch):
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)                     # 128-row slices
    w = (torch.randn(300, 70, generator=torch.Generator().manual_seed(3)) * 0.02).to(dtype)
    err = Q.ErrorSample(1)
    data, scales = Q.quantize(w, fmt, error=err)
    e2, r2 = Q.reconstruction_error(w, data, scales, fmt)
    assert (err.e2, err.r2, err.rows, err.total_rows) == (e2, r2, 300, 300)
    rec = Q.dequantize(data, scales, fmt, (300, 70))
    assert err.e2 == pytest.approx(float(((rec.double() - w.double()) ** 2).sum()), rel=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sampled_error_measures_every_kth_slice_only(fmt, monkeypatch):
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)
    w = (torch.randn(1000, 48, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    w_t = w.t()                                                    # non-contiguous source
    err = Q.ErrorSample(3)
    data, scales = Q.quantize(w_t.t(), fmt, error=err)
    rec = Q.dequantize(data, scales, fmt, (1000, 48)).double()
    rows = [r for i, r0 in enumerate(range(0, 1000, 128)) if i % 3 == 0 for r in range(r0, min(1000, r0 + 128))]
    assert err.rows == len(rows) == 128 * 2 + 128 and err.total_rows == 1000
    sel = torch.tensor(rows)
    assert err.e2 == pytest.approx(float(((rec[sel] - w.double()[sel]) ** 2).sum()), rel=1e-6)
    assert err.r2 == pytest.approx(float((w.double()[sel] ** 2).sum()), rel=1e-6)


def test_error_sample_refuses_a_bad_stride():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="every"):
            Q.ErrorSample(bad)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_check_sees_nan_and_inf_from_the_amax(fmt, dtype, bad):
    w = (torch.randn(130, 64, generator=torch.Generator().manual_seed(5)) * 0.02).to(dtype)
    w[129, 63] = bad
    with pytest.raises(Q.NonFiniteWeight):
        Q.quantize(w, fmt, finite=True)
    Q.quantize(w, fmt)                                             # finite=False: no check (the host's behaviour)
    w[129, 63] = 0.0
    Q.quantize(w, fmt, finite=True)


def test_amax_abs_is_the_abs_max_for_every_dtype():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        w = torch.tensor([[-3.0, 2.0], [0.5, -0.0]], dtype=dt)
        assert Q._amax_abs(w).item() == 3.0 and Q._amax_abs(w).dtype == dt
        assert Q._amax_abs(w.t()).item() == 3.0
        assert Q._amax_abs(-w[:, :1]).item() == 3.0


# ---------------------------------------------------------------------------------------------- the stream

def _plan(shapes, fmt="float8_e4m3fn"):
    inv = {k: (s, "BF16") for k, s in shapes.items()}
    return QC.make_plan("h3", fmt, inv)


def test_stream_progress_counts_tensors_and_bytes():
    shapes = {"blocks.0.attn.qkv_proj.weight": (96, 32), "blocks.0.attn.qkv_proj.bias": (96,)}
    plan = _plan(shapes)
    items = [(k, torch.randn(s).to(torch.bfloat16)) for k, s in shapes.items()]
    seen = []
    rep = QC.QuantReport("h3", "float8_e4m3fn", "")
    out = dict(QC.quantize_stream(iter(items), plan, rep, "x", progress=lambda *a: seen.append(a)))
    assert seen == [(1, 2, 96 * 32 * 2), (2, 2, 96 * 32 * 2 + 96 * 2)]
    assert set(out) == {"blocks.0.attn.qkv_proj.weight", "blocks.0.attn.qkv_proj.weight_scale",
                        "blocks.0.attn.qkv_proj.comfy_quant", "blocks.0.attn.qkv_proj.bias"}


@pytest.mark.parametrize("mode,rows", [("full", 1000), (True, 1000), ("sampled", 128), ("off", 0), (False, 0)])
def test_stream_error_modes_report_the_rows_measured(mode, rows, monkeypatch):
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)
    plan = _plan({"blocks.0.mlp.fc1.weight": (1000, 32)})
    w = torch.randn(1000, 32).to(torch.bfloat16)
    rep = QC.QuantReport("h3", "float8_e4m3fn", "")
    dict(QC.quantize_stream(iter([("blocks.0.mlp.fc1.weight", w)]), plan, rep, "x", measure_error=mode))
    d = rep.classes["block MLP"].as_dict()
    if rows:
        assert d["error_rows"] == f"{rows}/1000" and math.isfinite(d["rel_rms_error"])
    else:
        assert "rel_rms_error" not in d and "error_rows" not in d


def test_stream_refuses_an_unknown_error_mode():
    plan = _plan({"blocks.0.mlp.fc1.weight": (32, 32)})
    rep = QC.QuantReport("h3", "float8_e4m3fn", "")
    with pytest.raises(ValueError, match="measure_error"):
        list(QC.quantize_stream(iter([("blocks.0.mlp.fc1.weight", torch.ones(32, 32))]), plan, rep, "x",
                                measure_error="most"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_names_a_nan_in_a_quantized_weight_with_counts(fmt):
    plan = _plan({"blocks.0.mlp.fc2.weight": (64, 64)}, fmt)
    w = torch.randn(64, 64)
    w[3, 3] = float("nan")
    w[4, 4] = float("-inf")
    w[5, 5] = float("nan")
    rep = QC.QuantReport("h3", fmt, "")
    with pytest.raises(CheckpointError, match=r"'blocks\.0\.mlp\.fc2\.weight' holds 2 NaN and 1 Inf"):
        list(QC.quantize_stream(iter([("blocks.0.mlp.fc2.weight", w)]), plan, rep, "src"))


def test_stream_checks_kept_tensors_too():
    plan = _plan({"blocks.0.attn.qkv_proj.bias": (8,)})
    b = torch.zeros(8, dtype=torch.bfloat16)
    b[7] = float("inf")
    with pytest.raises(CheckpointError, match="holds 0 NaN and 1 Inf"):
        list(QC.quantize_stream(iter([("blocks.0.attn.qkv_proj.bias", b)]), plan, QC.QuantReport("h3", "nvfp4", ""),
                                "src"))


def test_stream_device_must_be_cuda():
    plan = _plan({"blocks.0.mlp.fc1.weight": (32, 32)})
    with pytest.raises(ValueError, match="CUDA"):
        list(QC.quantize_stream(iter([("blocks.0.mlp.fc1.weight", torch.ones(32, 32))]), plan,
                                QC.QuantReport("h3", "float8_e4m3fn", ""), "x", device="cpu"))


def test_e2m1_table_equals_the_comparisons_on_every_threshold_and_neighbour():
    th = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 1e-30, 1e-45])
    near = [th]
    for _ in range(3):
        near += [torch.nextafter(near[-1], torch.full_like(th, 10.0))]
    lo = [th]
    for _ in range(3):
        lo += [torch.nextafter(lo[-1], torch.full_like(th, -10.0))]
    v = torch.cat(near + lo).clamp(0, 6)
    v = torch.cat([v, -v, torch.rand(1 << 16, generator=torch.Generator().manual_seed(7)) * 12 - 6])
    assert torch.equal(Q._e2m1_codes_finite(v), Q.e2m1_codes(v))
    assert torch.equal(Q._e2m1_codes_finite(v.reshape(-1, 2).t()), Q.e2m1_codes(v.reshape(-1, 2).t()))


def test_nvfp4_finite_path_equals_the_comparison_path():
    w = (torch.randn(260, 96, generator=torch.Generator().manual_seed(8)) * 0.05).to(torch.bfloat16)
    w[0, :16] = 0.0
    w[1, :16] = -0.0
    a = Q.quantize(w, "nvfp4")
    b = Q.quantize(w, "nvfp4", finite=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["weight_scale"].view(torch.uint8),
                                                   b[1]["weight_scale"].view(torch.uint8))


def test_stream_reports_where_it_quantized():
    plan = _plan({"blocks.0.mlp.fc1.weight": (32, 32)})
    rep = QC.QuantReport("h3", "float8_e4m3fn", "")
    assert rep.quantized_on == "" and "quantized on" not in rep.summary()     # a cache hit quantizes nowhere
    dict(QC.quantize_stream(iter([("blocks.0.mlp.fc1.weight", torch.ones(32, 32))]), plan, rep, "x"))
    assert rep.quantized_on == "cpu" and rep.as_dict()["quantized_on"] == "cpu"
    assert "; quantized on cpu" in rep.summary()
    rep.quantized_on = "cuda:0 (Triton kernels)"
    assert "; quantized on cuda:0 (Triton kernels)" in rep.summary()


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("cpu")])
def test_stream_refuses_a_device_that_is_not_cuda(device):
    plan = _plan({"blocks.0.mlp.fc1.weight": (32, 32)})
    rep = QC.QuantReport("h3", "float8_e4m3fn", "")
    with pytest.raises(ValueError, match="runs on the CPU .device=None. or a CUDA device"):
        list(QC.quantize_stream(iter([("blocks.0.mlp.fc1.weight", torch.ones(32, 32))]), plan, rep, "x",
                                device=device))
    assert rep.quantized_on == ""


# ---------------------------------------------------------------------- the error sample's work buffers, to_blocked

def _slice_rows(fmt, rows, cols, dtype, seed):
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)
    if fmt == "nvfp4":
        s2 = Q.per_tensor_scale(w, fmt)
        d, sc = Q._nvfp4_rows(w, s2, True)
        return d, sc, s2
    d, sc = Q._mxfp8_rows(w)
    return d, sc, None


def _dequant_oracle(fmt, d, sc, s2):
    """The stored rows' float32 values from the formats' definitions: each product formed exactly in float64 (an
    e2m1 / fp8 value, an fp8 / power-of-two block scale and a float32 s2 have few enough bits) and rounded once to
    float32, which is what one float32 multiplication gives; nvfp4's factor ``s2 * block scale`` is rounded first."""
    if fmt == "mxfp8":
        vals = d.view(torch.uint8).view(torch.float8_e4m3fn).double()
        e = sc.view(torch.uint8).to(torch.int64)
        s = torch.where(e == 0, torch.zeros_like(e, dtype=torch.float64), torch.pow(2.0, (e - 127).double()))
        out = vals.reshape(d.shape[0], -1, 32) * s.unsqueeze(-1)
        return out.float().double().reshape(d.shape[0], -1)
    table = torch.tensor(Q.E2M1_VALUES + tuple(-v for v in Q.E2M1_VALUES), dtype=torch.float64)
    d = d.to(torch.int64)
    codes = torch.stack([d >> 4, d & 0x0F], dim=-1).reshape(d.shape[0], -1)     # high nibble first
    bs = (sc.view(torch.float8_e4m3fn).double() * float(s2)).float().double()
    return (table[codes].reshape(d.shape[0], -1, 16) * bs.unsqueeze(-1)).float().double().reshape(d.shape[0], -1)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dequant_slice_work_is_the_stored_values_bit_for_bit(fmt, dtype):
    d, sc, s2 = _slice_rows(fmt, 130, 96, dtype if dtype != torch.float64 else torch.float32, 11)
    got = Q._dequant_slice_work(fmt, d, sc, s2)
    want = _dequant_oracle(fmt, d, sc, s2)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.double(), want)
    assert torch.equal(got, Q._dequant_slice(fmt, d, sc, s2))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_dequant_slice_work_reuses_its_buffer_and_falls_back_on_strided_rows(fmt):
    d, sc, s2 = _slice_rows(fmt, 128, 64, torch.bfloat16, 12)
    d2, sc2, s22 = _slice_rows(fmt, 128, 64, torch.bfloat16, 13)
    first = Q._dequant_slice_work(fmt, d, sc, s2)
    keep = first.clone()
    second = Q._dequant_slice_work(fmt, d2, sc2, s22)
    # the work buffer: the second call's values are written where the first's were (the caller uses it at once)
    assert second.data_ptr() == first.data_ptr() and torch.equal(first, second)
    assert torch.equal(second.double(), _dequant_oracle(fmt, d2, sc2, s22))
    assert torch.equal(keep.double(), _dequant_oracle(fmt, d, sc, s2))
    # strided rows (every other row) take the allocating path: a fresh tensor with the same values
    ds, scs = d[::2], sc[::2]
    assert not ds.is_contiguous()
    got = Q._dequant_slice_work(fmt, ds, scs, s2)
    assert got.data_ptr() != second.data_ptr()
    assert torch.equal(got.double(), _dequant_oracle(fmt, ds, scs, s2))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_error_sample_leaves_an_earlier_dequantize_alone(fmt, monkeypatch):
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)
    w = (torch.randn(256, 64, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    data, scales = Q.quantize(w, fmt, error=Q.ErrorSample(1))
    rec = Q.dequantize(data, scales, fmt, (256, 64))
    keep = rec.clone()
    Q.quantize(w.flip(0).contiguous(), fmt, error=Q.ErrorSample(1))   # the work buffers written again
    assert torch.equal(rec, keep)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu])
@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 4), (130, 7), (256, 8), (300, 13), (128, 64)])
def test_blocked_layout_of_byte_scales_matches_the_cublas_offset_formula(rows, cols, dtype):
    codes = (torch.arange(rows * cols, dtype=torch.int64) % 250 + 1).to(torch.uint8).reshape(rows, cols)
    m = codes.view(dtype)
    b = Q.to_blocked(m)
    pr, pc = math.ceil(rows / 128) * 128, math.ceil(cols / 4) * 4
    assert b.shape == (pr, pc) and b.dtype == dtype
    flat = b.view(torch.uint8).flatten()
    ncb = pc // 4
    want = torch.zeros(pr * pc, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            want[(r // 128) * ncb * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = codes[r, c]
    assert torch.equal(flat, want)                                  # padding is zero
    assert torch.equal(Q.from_blocked(b, rows, cols).view(torch.uint8), codes)
    mt = codes.t().contiguous().t().view(dtype)                     # a transposed (column-major) input
    assert not mt.is_contiguous() or rows == 1 or cols == 1
    assert torch.equal(Q.to_blocked(mt).view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows,cols", [(1, 1), (130, 7), (256, 8)])
def test_blocked_layout_of_wider_values_matches_the_cublas_offset_formula(rows, cols, dtype):
    """Not only byte scales: 2-, 4- and 8-byte values land where the same offset formula says (the int32 move is
    for 1-byte values only)."""
    m = (torch.arange(rows * cols, dtype=torch.int64) % 250 + 1).to(dtype).reshape(rows, cols)
    b = Q.to_blocked(m)
    pr, pc = math.ceil(rows / 128) * 128, math.ceil(cols / 4) * 4
    assert b.shape == (pr, pc) and b.dtype == dtype
    ncb = pc // 4
    want = torch.zeros(pr * pc, dtype=dtype)
    for r in range(rows):
        for c in range(cols):
            want[(r // 128) * ncb * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = m[r, c]
    assert torch.equal(b.flatten(), want)
