"""The block formats' Triton kernels (kernels/quant_triton.py, issue #34) under the Triton interpreter: the same
bits as the reference (kernels/quant.py, itself checked bit for bit against the host's layout quantize in
tests/integration/test_quant_host.py), and the reference checked here once more against the format's math
written in this test (the oracle: OCP MX / NVFP4 rounding written out, not our code)."""
from __future__ import annotations

import math

import pytest
import torch

from _kernels_interp import DEVICE, ensure_interpreted, interpreter_ok  # noqa: E402  (tests/unit on sys.path)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FMTS = ["mxfp8", "nvfp4"]


@pytest.fixture(scope="module")
def K():
    ensure_interpreted()
    why = interpreter_ok()
    if why:
        pytest.skip(why)
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    from ditkit.kernels import quant, quant_triton
    if not isinstance(quant_triton._block_amax_kernel, InterpretedFunction):
        quant_triton = importlib.reload(quant_triton)
    return quant, quant_triton


def _w(shape, dtype, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _tri(Q, w, fmt, **kw):
    """The Triton path on the kernels' device (the interpreter: the CPU), results back on the CPU."""
    d, s = Q.quantize(w.to(DEVICE), fmt, backend="triton", **kw)
    return d.cpu(), {k: v.cpu() for k, v in s.items()}


def _check(Q, w, fmt, **kw):
    ref, rs = Q.quantize(w, fmt)
    got, gs = _tri(Q, w, fmt, **kw)
    assert _same(got, ref)
    assert set(gs) == set(rs)
    for k in rs:
        assert _same(gs[k].reshape(-1), rs[k].reshape(-1)), k
    return got, gs


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (40, 160), (130, 48)])
def test_block_kernels_equal_the_reference(K, fmt, dtype, shape):
    Q, _ = K
    w = _w(shape, dtype, seed=shape[0] * 7 + shape[1])
    _check(Q, w, fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp64_is_refused_as_by_the_reference(K, fmt):
    Q, _ = K
    w = _w((4, 32), torch.float64, 1)
    with pytest.raises(ValueError):
        Q.quantize(w, fmt)
    with pytest.raises(ValueError):
        Q.quantize(w, fmt, backend="triton")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layout", ["transposed", "column_slice", "row_step"])
def test_strided_weights(K, fmt, layout):
    Q, _ = K
    base = _w((96, 80), torch.bfloat16, 3)
    w = {"transposed": base.t(), "column_slice": base[:, 5:70], "row_step": base[::3]}[layout]
    assert not w.is_contiguous()
    got, gs = _tri(Q, w, fmt)
    ref, rs = Q.quantize(w.contiguous(), fmt)
    assert _same(got, ref)
    for k in rs:
        assert _same(gs[k].reshape(-1), rs[k].reshape(-1))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("br,bc", [(1, 32), (2, 64), (16, 128), (4, 256)])
def test_every_tile_shape_gives_the_same_bits(K, fmt, br, bc):
    Q, T = K
    w = _w((37, 200), torch.float16, 5)
    s2 = Q.per_tensor_scale(w, fmt) if fmt == "nvfp4" else None
    d0, s0 = Q.quantize_blocks_triton(w, fmt, s2)
    d1, s1 = Q.quantize_blocks_triton(w, fmt, s2, br=br, bc=bc)
    assert _same(d0, d1) and _same(s0, s1)


def test_mxfp8_zero_blocks_clamp_and_tiny_blocks(K):
    Q, _ = K
    w = _w((64, 128), torch.float32, 9)
    w[0, :32] = 0.0                          # an all-zero block: exponent 0, +0 codes
    w[1, :32] = -0.0                         # all negative zeros: still +0 codes (the reference's masked_fill)
    w[2, :32] = 1e-37                        # amax / 448 below 2**-127: exponent 0, divisor 0 -> +-448 / NaN
    w[2, 5] = 0.0
    w[3, :32] = torch.linspace(-1.0, 1.0, 32) * 3e38   # huge block: the largest exponent a finite amax reaches
    w[4, 0] = 448.0 * 2.0 ** 3                 # exactly a power of two times 448: no clamp needed
    w[5, :32] = 2.0 ** -126 * (1 + 2.0 ** -20)  # just above a power of two: torch's log2 ceiling, not exact math
    got, gs = _check(Q, w, "mxfp8")
    assert got[0, :32].view(torch.uint8).eq(0).all() and got[1, :32].view(torch.uint8).eq(0).all()
    e = Q.from_blocked(gs["weight_scale"].view(torch.uint8), 64, 4)
    assert int(e[0, 0]) == 0 and int(e[2, 0]) == 0
    assert int(e[3, 0]) == math.ceil(math.log2(float(torch.tensor(3e38)) / 448.0)) + 127 == 247


def test_nvfp4_zero_blocks_ties_and_saturation(K):
    Q, _ = K
    w = _w((32, 64), torch.float32, 11)
    w[0, :16] = 0.0
    w[1, :16] = -0.0
    # one block whose values divided by its scale hit every e2m1 threshold exactly (ties to even) and both signs
    w[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                              -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    w[3, :16] = torch.tensor([1e-30] * 15 + [6.0])   # tiny values in a block: codes 0 with their sign
    w[3, 1] = -1e-30
    got, gs = _check(Q, w, "nvfp4")
    assert got[0, :8].eq(0).all() and got[1, :8].eq(0).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_non_finite_weights_are_refused_before_any_launch(K, fmt, monkeypatch):
    Q, T = K
    launched = []
    monkeypatch.setattr(Q, "quantize_blocks_triton", lambda *a, **k: launched.append(1))
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = _w((8, 32), torch.bfloat16, 2)
        w[7, 31] = bad
        with pytest.raises(Q.NonFiniteWeight, match=fmt):
            Q.quantize(w, fmt, backend="triton")
    assert not launched


@pytest.mark.parametrize("fmt", FMTS)
def test_error_sample_and_allocator_as_the_reference(K, fmt, monkeypatch):
    Q, _ = K
    monkeypatch.setattr(Q, "CHUNK_ELEMS", 1)            # 128-row sample spans
    w = _w((300, 64), torch.bfloat16, 6)
    ref, tri = Q.ErrorSample(2), Q.ErrorSample(2)
    Q.quantize(w, fmt, error=ref)
    made = []

    def alloc(shape, dtype):
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]

    d, s = Q.quantize(w, fmt, backend="triton", error=tri, empty=alloc)
    assert (ref.e2, ref.r2, ref.rows, ref.total_rows) == (tri.e2, tri.r2, tri.rows, tri.total_rows)
    assert tri.rows == 128 + 44 and tri.total_rows == 300
    assert d.data_ptr() == made[0].data_ptr() and s["weight_scale"].data_ptr() == made[1].data_ptr()


def test_block_amax_directly(K):
    _, T = K
    w = _w((5, 40), torch.bfloat16, 8)
    a = T.block_amax(w, 16, 16, 48)
    want = torch.zeros(16, 48)
    want[:5, :40] = w.float().abs()
    assert torch.equal(a, want.reshape(16, 3, 16).amax(-1))
    a32 = T.block_amax(w.t(), 32, 64, 32)                 # transposed: [40, 5] padded to [64, 32]
    want = torch.zeros(64, 32)
    want[:40, :5] = w.t().float().abs()
    assert torch.equal(a32, want.reshape(64, 1, 32).amax(-1))
    for bad in ((8, 5, 48), (16, 16, 40), (16, 4, 48), (32, 16, 32)):   # block, padded rows, padded cols
        with pytest.raises(ValueError):
            T.block_amax(w, *bad)


def test_encode_blocks_directly_and_its_arguments(K):
    """The encode launcher on its own: the divisor a caller gives is what divides (here 1.0 everywhere for mxfp8:
    the fp8 codes of the values themselves; 2.0 for nvfp4: the e2m1 codes of the halves), NaN marks a zero
    block; wrong shapes and dtypes are refused before any launch."""
    _, T = K
    w = torch.tensor([[0.5, -1.5, 3.0, 448.0] * 8, [1e-3] * 31 + [-6.0]], dtype=torch.float32)
    out = torch.empty(32, 32, dtype=torch.uint8)
    div = torch.ones(32, 1)
    div[1, 0] = float("nan")
    T.encode_blocks(w, 32, div, out)
    assert torch.equal(out[0], w[0].to(torch.float8_e4m3fn).view(torch.uint8))
    assert out[1:].eq(0).all()                                    # the NaN-marked row and the padding
    w4 = torch.tensor([[1.0, -3.0] * 8], dtype=torch.float32)     # / 2: 0.5 (code 1), -1.5 (code 8 | 3)
    out4 = torch.empty(16, 8, dtype=torch.uint8)
    T.encode_blocks(w4, 16, torch.full((16, 1), 2.0), out4)
    assert out4[0].eq(0x1B).all() and out4[1:].eq(0).all()
    for bad in (dict(block=8), dict(divisor=torch.ones(32, 1, dtype=torch.float64)),
                dict(out=torch.empty(32, 16, dtype=torch.uint8)), dict(out=torch.empty(32, 32, dtype=torch.int8)),
                dict(divisor=torch.ones(1, 1)), dict(out=torch.empty(32, 64, dtype=torch.uint8)[:, ::2])):
        kw = dict(block=32, divisor=torch.ones(32, 1), out=torch.empty(32, 32, dtype=torch.uint8)) | bad
        with pytest.raises(ValueError, match="encode_blocks"):
            T.encode_blocks(w, kw["block"], kw["divisor"], kw["out"])
    with pytest.raises(ValueError, match="tile"):
        T.encode_blocks(w, 32, torch.ones(32, 1), out, br=3)


def test_quantize_blocks_arguments(K):
    Q, T = K
    w = _w((20, 40), torch.float32, 4)
    with pytest.raises(ValueError, match="mxfp8 and nvfp4"):
        Q.quantize_blocks_triton(w, "float8_e4m3fn")
    with pytest.raises(ValueError, match="s2"):
        Q.quantize_blocks_triton(w, "nvfp4")
    with pytest.raises(ValueError, match="s2"):
        Q.quantize_blocks_triton(w, "nvfp4", torch.ones(2))
    for br, bc in ((3, 32), (4, 48), (4, 16), (0, 32)):
        with pytest.raises(ValueError, match="tile"):
            Q.quantize_blocks_triton(w, "mxfp8", br=br, bc=bc)
    with pytest.raises(ValueError, match="out"):
        Q.quantize_blocks_triton(w, "mxfp8", out=torch.empty(32, 32, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="out"):
        Q.quantize_blocks_triton(w, "mxfp8", out=torch.empty(32, 64, dtype=torch.uint8))
    out = torch.empty(32, 64, dtype=torch.float8_e4m3fn)
    d, _ = Q.quantize_blocks_triton(w, "mxfp8", out=out)
    assert d is out and _same(out, Q.quantize(w, "mxfp8")[0])


# ------------------------------------------------------------------ the oracle: the formats' math written here

def _e4m3_round(v: float) -> float:
    """Round a real to float8_e4m3fn, nearest, ties to even (|v| <= 448 here)."""
    a = abs(v)
    if a == 0:
        return math.copysign(0.0, v)
    ex = max(math.floor(math.log2(a)), -6)
    q = 2.0 ** (ex - 3)
    m = a / q
    r = math.floor(m)
    r = r + 1 if (m - r > 0.5 or (m - r == 0.5 and r % 2 == 1)) else r
    return math.copysign(r * q, v)


def _e2m1_round(v: float) -> float:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(grid[i] - a), i % 2))   # nearest, ties to the even code
    return math.copysign(grid[best], v)


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_values_equal_the_formats_math(K, fmt):
    Q, _ = K
    w = _w((4, 64), torch.float32, 21, scale=1.0)
    d, s = _tri(Q, w, fmt)
    deq = Q.dequantize(d, s, fmt, (4, 64)).double()
    amax = w.abs().reshape(4, -1, 32 if fmt == "mxfp8" else 16).amax(-1).double()
    for r in range(4):
        for c in range(64):
            b = c // (32 if fmt == "mxfp8" else 16)
            x = float(w[r, c])
            if fmt == "mxfp8":
                k = math.ceil(math.log2(float(amax[r, b]) / 448.0))     # power-of-two scale covering the block
                sc = 2.0 ** k
                want = _e4m3_round(x / sc) * sc
            else:
                s2 = float(w.abs().amax()) / (448.0 * 6.0)
                bs = _e4m3_round(float(amax[r, b]) / 6.0 / s2)             # the fp8 block scale
                tot = float(torch.tensor(s2, dtype=torch.float32) * torch.tensor(bs, dtype=torch.float32))
                want = _e2m1_round(float(torch.tensor(x) / torch.tensor(tot))) * tot
            assert float(deq[r, c]) == pytest.approx(want, rel=1e-6, abs=1e-12), (r, c)


def test_mxfp8_every_fp8_code_and_tie_through_the_kernel(K):
    """Blocks whose scale is 1 (each holds 448, so the exponent is 127): every e4m3fn magnitude and every midpoint
    between neighbours (the ties, subnormal ones included) goes through the kernel's encoder unscaled; the codes
    must be torch's own float32 -> float8_e4m3fn cast (round half to even)."""
    Q, _ = K
    vals = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    xs = torch.cat([vals, mids, -vals, -mids])
    per = 31
    n = -(-xs.numel() // per)
    xs = torch.cat([xs, torch.zeros(n * per - xs.numel())]).reshape(n, per)
    w = torch.cat([torch.full((n, 1), 448.0), xs], dim=1)              # [n, 32]: one block per row
    got, gs = _check(Q, w, "mxfp8")
    assert Q.from_blocked(gs["weight_scale"].view(torch.uint8), n, 1).eq(127).all()
    assert torch.equal(got[:n].view(torch.uint8), w.to(torch.float8_e4m3fn).view(torch.uint8))
