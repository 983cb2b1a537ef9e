"""kernels/delta_fuse: ``weight[i] += scale * ΔW[row_map[i]]`` for low-rank, Kronecker, Hadamard and dense deltas.

Oracle: ΔW built whole in float64 in the test (``B @ A``, an explicit Kronecker product, the Hadamard product)
and permuted with a row map written here. The chunked reference and the Triton kernel (interpreter on CPU) must
match it; the reference must never form more than ``max_chunk_elems`` elements of ΔW at once.
"""
from __future__ import annotations

import pytest
import torch

from _kernels_interp import DEVICE, ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.kernels import delta_fuse  # noqa: E402


def _kron64(a, b):
    a, b = a.double(), b.double()
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def _case(kind, rows, cols, rank, g):
    if kind == "lowrank":
        up, down = torch.randn(rows, rank, generator=g), torch.randn(rank, cols, generator=g)
        return (up, down), up.double() @ down.double()
    if kind == "kron":
        w1, w2 = torch.randn(3, 2, generator=g), torch.randn(rows // 3, cols // 2, generator=g)
        return (w1, w2), _kron64(w1, w2)
    if kind == "hadamard":
        p = [torch.randn(rows, rank, generator=g), torch.randn(rank, cols, generator=g),
             torch.randn(rows, rank, generator=g), torch.randn(rank, cols, generator=g)]
        return tuple(p), (p[0].double() @ p[1].double()) * (p[2].double() @ p[3].double())
    d = torch.randn(rows, cols, generator=g)
    return (d,), d.double()


def _interleave_map(heads, hd):
    """ComfyUI row j*inner + h*hd + d <- official row h*3*hd + j*hd + d, by loops."""
    out = []
    for j in range(3):
        for h in range(heads):
            for d in range(hd):
                out.append(h * 3 * hd + j * hd + d)
    return torch.tensor(out, dtype=torch.int64)


MAPS = ["none", "interleave", "swap"]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", list(delta_fuse.KINDS))
@pytest.mark.parametrize("rmap", MAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_oracle(backend, kind, rmap, dtype):
    need_triton(backend)
    g = torch.Generator().manual_seed(hash((kind, rmap)) % 1000)
    heads, hd, cols, rank = 3, 4, 10, 5
    rows = 3 * heads * hd                               # 36 rows, not a multiple of the 32-row tile
    parts, d64 = _case(kind, rows, cols, rank, g)
    m = None
    if rmap == "interleave":
        m = _interleave_map(heads, hd)
    elif rmap == "swap":
        m = torch.cat([torch.arange(rows // 2, rows), torch.arange(0, rows // 2)])
    w0 = torch.randn(rows, cols, generator=g).to(dtype)
    w = w0.clone().to(DEVICE)
    scale = -0.37
    if backend == "reference":
        delta_fuse.fuse_reference_(w, kind, parts, scale, m, max_chunk_elems=3 * cols)
    else:
        delta_fuse.fuse_triton_(w, kind, tuple(p.to(DEVICE) for p in parts), scale, m)
    dd = scale * (d64[m] if m is not None else d64)
    want = w0.double() + dd
    got = w.cpu().double()
    if dtype == torch.float32:
        err = (got - want).abs().max().item() / dd.abs().max().item()
        assert err <= 1e-6, err
    else:  # two bf16 roundings (scale*ΔW, then the sum), each < 1 bf16 ulp (2**-7 relative; the Triton
        # interpreter's fp32 -> bf16 conversion is not round-to-nearest, so a full ulp, not half)
        assert ((got - want).abs() <= 2.0 ** -6 * (w0.double().abs() + dd.abs()) + 1e-30).all()


def test_reference_never_forms_more_than_a_chunk(monkeypatch):
    g = torch.Generator().manual_seed(1)
    up, down = torch.randn(64, 4, generator=g), torch.randn(4, 48, generator=g)
    seen = []
    orig = delta_fuse.delta_rows

    def spy(kind, parts, idx, dtype=torch.float32):
        out = orig(kind, parts, idx, dtype)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(delta_fuse, "delta_rows", spy)
    w = torch.zeros(64, 48)
    delta_fuse.fuse_reference_(w, "lowrank", (up, down), 1.0, max_chunk_elems=48 * 5)
    assert max(seen) <= 48 * 5 and sum(seen) == 64 * 48
    assert torch.allclose(w.double(), up.double() @ down.double(), atol=1e-5)


def test_slice_of_a_bigger_weight_is_patched_in_place():
    """A row slice (what ComfyUI hands a patch with an offset) is updated in the parent tensor, rows outside
    untouched."""
    g = torch.Generator().manual_seed(2)
    parent = torch.randn(30, 8, generator=g)
    keep = parent.clone()
    up, down = torch.randn(10, 2, generator=g), torch.randn(2, 8, generator=g)
    delta_fuse.fuse_(parent[10:20], "lowrank", (up, down), 2.0)
    assert torch.equal(parent[:10], keep[:10]) and torch.equal(parent[20:], keep[20:])
    assert torch.allclose(parent[10:20].double(), keep[10:20].double() + 2.0 * (up.double() @ down.double()), atol=1e-5)


@pytest.mark.parametrize("bad", ["rows", "cols", "map_len", "map_range", "kind"])
def test_shape_errors(bad):
    w = torch.zeros(6, 4)
    up, down = torch.ones(6, 2), torch.ones(2, 4)
    kw = {"rows": dict(parts=(torch.ones(5, 2), down)), "cols": dict(parts=(up, torch.ones(2, 5))),
          "map_len": dict(parts=(up, down), row_map=torch.arange(5)),
          "map_range": dict(parts=(up, down), row_map=torch.arange(6) + 1),
          "kind": dict(parts=(up, down), kind="nope")}[bad]
    with pytest.raises(ValueError):
        delta_fuse.fuse_reference_(w, kw.pop("kind", "lowrank"), kw.pop("parts"), 1.0, kw.pop("row_map", None))


def test_kernel_uses_offs64_for_every_stride_product():
    import inspect
    import re

    need_triton()
    src = inspect.getsource(delta_fuse._fuse_kernel.fn if hasattr(delta_fuse._fuse_kernel, "fn")
                            else delta_fuse._fuse_kernel)
    body = src.split(":", 1)[1]
    assert not re.search(r"\*\s*stride_\w+", body), "raw stride product in _fuse_kernel"
    assert body.count("offs64(") >= 8


# ------------------------------------------------------------------ quantized weights (requantize_fuse)
def _quant_math(w32: torch.Tensor, fmt: str):
    """Per-tensor quantize written here: fp8 scale = amax / max, codes = clamp(w * (1/scale)) cast (round to
    nearest even); int8 scale = max(amax / 127, 1e-30), codes = clamp(round(w / scale), -128, 127)."""
    amax = w32.abs().max()
    if fmt == "int8_tensorwise":
        s = (amax / 127.0).clamp(min=1e-30)
        return torch.round(w32 / s).clamp(-128, 127).to(torch.int8), s
    dt = getattr(torch, fmt)
    s = amax / torch.finfo(dt).max
    return torch.clamp(w32 * (1.0 / s), -torch.finfo(dt).max, torch.finfo(dt).max).to(dt), s


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fmt", list(delta_fuse.PER_TENSOR_FORMATS))
@pytest.mark.parametrize("kind", list(delta_fuse.KINDS))
@pytest.mark.parametrize("chunk_elems", [1 << 22, 128 * 40])   # one chunk / three 128-row chunks
def test_requantize_fuse_equals_whole_float64_update(fmt, kind, chunk_elems, backend):
    """Base codes + a row-mapped delta on rows 30:330 + a whole-weight low-rank delta: the chunked fuse equals
    quantizing (codes * scale + ΣΔW, all float64, math here) rounded to float32, bit for bit."""
    g = torch.Generator().manual_seed(sum(map(ord, fmt + kind)))
    rows, cols = 384, 40
    w0 = torch.randn(rows, cols, generator=g) * 0.1
    data, s0 = _quant_math(w0, fmt)
    parts, d64 = _case(kind, 300, cols, 4, g)
    rmap = torch.randperm(300, generator=g)
    up, down = torch.randn(rows, 2, generator=g) * 0.01, torch.randn(2, cols, generator=g)
    need_triton(backend)
    dev = DEVICE if backend == "triton" else "cpu"
    deltas = [delta_fuse.Delta(kind, tuple(p.to(dev) for p in parts), 0.02, rmap.to(dev), (30, 330)),
              delta_fuse.Delta("lowrank", (up.to(dev), down.to(dev)), -0.5)]
    new, scales, chunks, ran = delta_fuse.requantize_fuse(data.to(dev), {"weight_scale": s0.to(dev)}, fmt,
                                                         (rows, cols), deltas, max_chunk_elems=chunk_elems,
                                                         backend=backend)
    assert ran == backend
    new, scales = new.cpu(), {k: v.cpu() for k, v in scales.items()}
    w64 = data.double() * s0.double()
    w64[30:330] += 0.02 * d64[rmap]
    w64 += -0.5 * (up.double() @ down.double())
    want, want_s = _quant_math(w64.float(), fmt)
    assert chunks == (1 if chunk_elems == 1 << 22 else 3)
    assert new.dtype == data.dtype and torch.equal(new.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scales["weight_scale"].reshape(()), want_s.reshape(()))


def test_requantize_fuse_never_forms_more_than_a_chunk(monkeypatch):
    seen = []
    real = delta_fuse.delta_rows

    def spy(kind, parts, idx, dtype=torch.float32):
        seen.append(idx.numel())
        return real(kind, parts, idx, dtype)

    monkeypatch.setattr(delta_fuse, "delta_rows", spy)
    rows, cols = 1024, 64
    data, s0 = _quant_math(torch.randn(rows, cols), "float8_e4m3fn")
    up, down = torch.randn(rows, 8), torch.randn(8, cols)
    _, _, chunks, ran = delta_fuse.requantize_fuse(data, {"weight_scale": s0}, "float8_e4m3fn", (rows, cols),
                                              [delta_fuse.Delta("lowrank", (up, down), 1.0)], max_chunk_elems=128 * cols)
    assert chunks == 8 and max(seen) == 128 and len(seen) == 16   # two passes (amax, codes) over 8 chunks
    assert ran == "reference"                                       # auto: a CPU weight


@pytest.mark.parametrize("bad", ["block_format", "rows", "cols"])
def test_requantize_fuse_refuses(bad):
    data, s0 = _quant_math(torch.randn(64, 16), "float8_e4m3fn")
    fmt, d = "float8_e4m3fn", delta_fuse.Delta("dense", (torch.randn(64, 16),), 1.0)
    if bad == "block_format":
        fmt = "nvfp4"
    elif bad == "rows":
        d = delta_fuse.Delta("dense", (torch.randn(10, 16),), 1.0, None, (60, 70))
    else:
        d = delta_fuse.Delta("dense", (torch.randn(64, 8),), 1.0)
    with pytest.raises(ValueError):
        delta_fuse.requantize_fuse(data, {"weight_scale": s0}, fmt, (64, 16), [d])
