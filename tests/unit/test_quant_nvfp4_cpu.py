"""The in-place CPU nvfp4 path (issue #34): ``_nvfp4_rows_cpu``, ``_e2m1_codes_bits_``, ``_pack_nibbles_cpu``,
each called directly, against the nvfp4 math written here; the row groups of the CPU block-format rows (nvfp4 and
mxfp8: any group size gives the bits of one group).

Oracle (the host's deterministic nvfp4 layout quantize, operation for operation): per 16-column block the float32
amax of |x|; ``sbs = clamp((amax / 6) / s2, max=448)`` rounded to float8_e4m3fn (torch's conversion); the divisor
``s2 * float(sbs8)``; a block whose divisor is 0 gives zero codes; ``x.float() / divisor`` clamped to [-6, 6] and
rounded to the nearest e2m1 magnitude with ties to the even code (float64 distances), the sign bit kept; two codes
per byte, the even column in the high nibble."""
from __future__ import annotations

import pytest
import torch

from ditkit.kernels import quant as Q

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    a = v.double().abs().clamp(max=6.0)
    dist = (a.unsqueeze(-1) - GRID).abs()
    best = dist.min(-1, keepdim=True).values
    tie = dist == best
    idx = torch.arange(8)
    even = torch.where(tie & (idx % 2 == 0), idx, torch.full_like(idx, 99)).min(-1).values
    code = torch.where(tie.sum(-1) == 1, tie.to(torch.int64).argmax(-1), even)
    return (code | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


def _oracle(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    f = x.float().reshape(rows, cols // 16, 16)
    amax = f.abs().amax(-1)
    sbs8 = torch.clamp((amax / 6.0) / s2, max=448.0).to(torch.float8_e4m3fn)
    div = s2 * sbs8.float()
    d = f / torch.where(div == 0, torch.ones_like(div), div).unsqueeze(-1)
    d = torch.where((div == 0).unsqueeze(-1), torch.zeros_like(d), d)
    c = _e2m1(d.reshape(rows, cols)).to(torch.int64)
    return ((c[:, 0::2] << 4) | c[:, 1::2]).to(torch.uint8), sbs8


def _check(x, s2):
    want_d, want_s = _oracle(x, s2)
    out = torch.full((x.shape[0], x.shape[1] // 2), 0xAB, dtype=torch.uint8)
    got_d, got_s = Q._nvfp4_rows_cpu(x, s2, out)
    assert got_d is out
    assert torch.equal(got_d, want_d)
    assert torch.equal(got_s.view(torch.uint8), want_s.view(torch.uint8))
    fresh_d, _ = Q._nvfp4_rows_cpu(x, s2)                       # no out: a tensor of its own
    assert torch.equal(fresh_d, want_d) and fresh_d.data_ptr() != out.data_ptr()
    gen_d, gen_s = Q._nvfp4_rows(x, s2, finite=False)           # the clamp + comparisons path: the same bits
    assert torch.equal(gen_d, want_d) and torch.equal(gen_s.view(torch.uint8), want_s.view(torch.uint8))


def _ties_block(dtype) -> torch.Tensor:
    """Rows whose blocks have amax 6 (with s2 = 1 the divisor is 1.0, the codes are those of x itself): every e2m1
    threshold, its neighbours in ``dtype`` on both sides, both signs, -0.0 and +0.0."""
    th = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0], dtype=dtype)
    up = torch.nextafter(th, torch.full_like(th, 9))
    dn = torch.nextafter(th, torch.full_like(th, -9))
    vals = torch.cat([th, up, dn])
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0], dtype=dtype)])
    vals = torch.nn.functional.pad(vals, (0, -vals.numel() % 15))
    blocks = vals.reshape(-1, 15)
    six = torch.full((blocks.shape[0], 1), 6.0, dtype=dtype)
    six[1::2] = -6.0
    return torch.cat([blocks, six], 1).reshape(-1, 32)      # 2 blocks per row


@pytest.mark.parametrize("dtype", DTYPES)
def test_e2m1_ties_neighbours_and_signed_zero_through_the_rows(dtype):
    x = _ties_block(dtype)
    _check(x, torch.tensor(1.0))
    got, _ = Q._nvfp4_rows_cpu(x, torch.tensor(1.0))
    codes = torch.stack([got >> 4, got & 0xF], -1).reshape(x.shape)
    assert int(codes[x.float() == 0.25].max()) == 0 and int(codes[x.float() == -0.25].min()) == 8   # ties: down
    assert bool((codes[x.float() == 1.25] == 2).all()) and bool((codes[x.float() == 1.75] == 4).all())
    neg0 = (x.float() == 0) & torch.signbit(x.float())
    assert bool(neg0.any()) and bool((codes[neg0] == 8).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_scale_boundaries_both_sides(dtype):
    """With s2 = 1: a block amax whose scale 1.0625 is an fp8 tie (rounds to 1.0) and its neighbours; the clamp
    at 448 (amax 2688) and just over; the smallest nonzero scale: amax 6 * 2^-10 is a tie to zero (the block is all
    zero codes), just above it the scale 2^-9."""
    g = torch.Generator().manual_seed(2)
    amaxes = []
    for a in (6.375, 2688.0, 6.0 * 2.0 ** -10):
        t = torch.tensor([a], dtype=dtype)
        amaxes += [t, torch.nextafter(t, t * 2), torch.nextafter(t, t * 0)]
    amaxes = torch.cat(amaxes)
    body = (torch.rand(amaxes.numel(), 16, generator=g) * 2 - 1).to(dtype) * amaxes.unsqueeze(1)
    body[:, 3] = amaxes
    body[:, 7] = -amaxes * 0.5
    x = body.reshape(-1, 32) if body.shape[0] % 2 == 0 else torch.cat([body, torch.zeros(1, 16, dtype=dtype)]
                                                                       ).reshape(-1, 32)
    _check(x, torch.tensor(1.0))
    _, sc = Q._nvfp4_rows_cpu(x, torch.tensor(1.0))
    flat = sc.reshape(-1).float()[: amaxes.numel()]
    assert float(flat[0]) == 1.0 and float(flat[1]) == 1.125 and float(flat[2]) == 1.0   # the tie, both sides
    assert float(flat[3]) == 448.0 and float(flat[4]) == 448.0                          # at the clamp, over it
    assert float(flat[6]) == 0.0 and float(flat[7]) == 2.0 ** -9       # the tie to zero, just above it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_rows_of_random_weights_any_layout(dtype, layout):
    g = torch.Generator().manual_seed(11)
    base = (torch.randn(96, 160, generator=g) * 0.05).to(dtype)
    base[0, :16] = 0.0
    base[1, 16:32] = -0.0
    base[2, 5] = 0.4                               # one large value: the rest of its block rounds toward zero
    x = {"contiguous": base[:, :64], "transposed": base.t().contiguous().t()[:, :64],
         "strided": base[::2, ::2][:, :64]}[layout]
    assert x.shape == (48 if layout == "strided" else 96, 64)
    s2 = (x.float().abs().amax() / 2688.0).to(torch.float32)
    keep = x.clone()
    _check(x, s2)
    assert torch.equal(x, keep)                    # the source is never written


def test_e2m1_codes_bits_on_every_class_end_and_inside():
    hi = torch.arange(2048, dtype=torch.int64) << 21
    ends = [hi, hi | 0x1FFFFF, hi | 0x0FFFFF] + [hi | (1 << k) for k in range(21)]   # every single low bit
    pts = torch.stack(ends, 1).reshape(-1)
    v = torch.where(pts >= 1 << 31, pts - (1 << 32), pts).to(torch.int32).view(torch.float32)
    v = v[~torch.isnan(v)]
    b = v.view(torch.int32).clone()
    out = torch.empty(v.numel(), dtype=torch.uint8)
    got = Q._e2m1_codes_bits_(b, torch.empty(v.numel(), dtype=torch.int32), out)
    assert got is out
    assert torch.equal(got, _e2m1(v))                  # beyond 6 (and Inf): the clamped value's code


@pytest.mark.parametrize("dtype", DTYPES)
def test_e2m1_codes_finite_of_every_source_dtype_and_layout(dtype):
    g = torch.Generator().manual_seed(4)
    v = (torch.rand(40, 64, generator=g) * 14 - 7).to(dtype).float()
    v[0, :4] = torch.tensor([0.25, -0.25, 2.5, -0.0])
    for t in (v, v.t(), v[::2, 1::3]):
        assert torch.equal(Q._e2m1_codes_finite(t), _e2m1(t))


def test_pack_nibbles_cpu_every_pair_and_its_refusal(monkeypatch):
    hi, lo = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    c = torch.stack([hi.reshape(-1), lo.reshape(-1)], 1).to(torch.uint8).reshape(16, 32)
    want = torch.tensor([(h << 4) | l for h in range(16) for l in range(16)], dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(Q._pack_nibbles_cpu(c), want)
    out = torch.zeros(16, 16, dtype=torch.uint8)
    assert Q._pack_nibbles_cpu(c, out) is out and torch.equal(out, want)
    assert torch.equal(Q._pack_nibbles(c), want)       # the general entry takes it for a contiguous CPU c
    monkeypatch.setattr(Q, "_LITTLE_ENDIAN", False)
    with pytest.raises(AssertionError, match="little-endian"):
        Q._pack_nibbles_cpu(c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_finite_equals_the_general_path_for_every_dtype(dtype):
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(300, 200, generator=g) * 0.03).to(dtype)     # padded rows and columns
    w[3, :16] = -0.0
    for src in (w, w.t().contiguous().t()):
        a = Q.quantize(src, "nvfp4")
        b = Q.quantize(src, "nvfp4", finite=True)
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[1]["weight_scale"].view(torch.uint8), b[1]["weight_scale"].view(torch.uint8))
        assert torch.equal(a[1]["weight_scale_2"], b[1]["weight_scale_2"])


@pytest.mark.parametrize("rows,cols,elems,want", [
    (128, 1024, 1 << 19, 128),          # fits: one group
    (128, 4096, 1 << 19, 128),          # exactly GROUP_ELEMS: one group
    (128, 4097, 1 << 19, 64),           # one element over: two groups of 64 rows
    (128, 21504, 1 << 19, 22),          # 2.75 M elements: 6 groups, 22 rows (the last one 18)
    (3, 100, 1, 1),                     # at least one row
    (0, 16, 1 << 19, 1),
])
def test_group_rows_boundaries(rows, cols, elems, want, monkeypatch):
    monkeypatch.setattr(Q, "GROUP_ELEMS", elems)
    step = Q._group_rows(rows, cols)
    assert step == want
    if rows:
        groups = -(-rows // step)
        assert step * cols <= max(elems, cols) or groups == 1
        assert groups == max(1, -(-(rows * cols) // elems)) or step == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elems", [1, 40 * 32, 1 << 40])
def test_row_groups_give_the_bits_of_one_group(fmt, dtype, elems, monkeypatch):
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(300, 200, generator=g) * 0.03).to(dtype)
    w[5, :32] = 0.0                                   # a zero block in one group
    w[7, 40] = 3.0 if dtype != torch.float16 else 300.0   # a group whose clamp decision differs from the others
    monkeypatch.setattr(Q, "GROUP_ELEMS", 1 << 40)
    want = [Q.quantize(src, fmt, finite=True) for src in (w, w.t().contiguous().t())]
    monkeypatch.setattr(Q, "GROUP_ELEMS", elems)
    for (wd, ws), src in zip(want, (w, w.t().contiguous().t())):
        d, s = Q.quantize(src, fmt, finite=True)
        assert torch.equal(d.view(torch.uint8), wd.view(torch.uint8))
        for k in ws:
            assert torch.equal(s[k].reshape(-1).view(torch.uint8), ws[k].reshape(-1).view(torch.uint8)), k
    xp = torch.nn.functional.pad(w.float(), (0, 24, 0, 4)).to(dtype)   # _mxfp8_rows / _nvfp4_rows_cpu directly
    if fmt == "mxfp8":
        monkeypatch.setattr(Q, "GROUP_ELEMS", 1 << 40)
        d1, e1 = Q._mxfp8_rows(xp)
        monkeypatch.setattr(Q, "GROUP_ELEMS", elems)
        d2, e2 = Q._mxfp8_rows(xp)
        out = torch.empty_like(d1)
        d3, e3 = Q._mxfp8_rows(xp, out)
        assert d3 is out and torch.equal(e3, e1)
    else:
        s2 = torch.tensor(0.03 / 448.0)
        monkeypatch.setattr(Q, "GROUP_ELEMS", 1 << 40)
        d1, e1 = Q._nvfp4_rows_cpu(xp, s2)
        monkeypatch.setattr(Q, "GROUP_ELEMS", elems)
        d2, e2 = Q._nvfp4_rows_cpu(xp, s2)
        _check(xp, s2)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8))
    assert torch.equal(e1.view(torch.uint8), e2.view(torch.uint8))
