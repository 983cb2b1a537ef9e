"""kernels/delta_fuse (issue 29 gap classes): every dtype the weight may have (fp16, bf16, fp32, fp64), factors that
are transposed / strided views (what a loader hands over after ``.t()`` or a slice), a strided weight, and the
dispatch boundaries, through the reference and the Triton launcher (interpreter on CPU).

Oracle: ΔW built whole in float64 here from the *values* of the factors (``B @ A``, an explicit Kronecker product,
the Hadamard product); a kernel that reads a transposed factor as if it were contiguous is off by O(1) (the audit's
planted ``.contiguous()`` removal fused a transposed factor with an error of 16.9).
"""
from __future__ import annotations

import pytest
import torch

from _kernels_interp import DEVICE, ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.kernels import delta_fuse  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# one rounding of scale*ΔW into the dtype and one of the sum; the interpreter's casts are not always round-to-nearest
# (a full ulp each); fp32/fp64: ΔW is accumulated in fp32 on both paths
REL = {torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6, torch.float32: 1e-6, torch.float64: 1e-6}


def _t(x):
    """The same values as ``x``, as a transposed (non-contiguous) view."""
    return x.t().contiguous().t()


def _strided(x):
    """The same values as ``x``, as every other column of a wider tensor (stride(1) == 2)."""
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, ::2] = x
    return wide[:, ::2]


def _kron64(a, b):
    a, b = a.double(), b.double()
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def _parts(kind, rows, cols, rank, g):
    if kind == "lowrank":
        p = (torch.randn(rows, rank, generator=g), torch.randn(rank, cols, generator=g))
        return p, p[0].double() @ p[1].double()
    if kind == "kron":
        p = (torch.randn(3, 2, generator=g), torch.randn(rows // 3, cols // 2, generator=g))
        return p, _kron64(*p)
    if kind == "hadamard":
        p = tuple(torch.randn(*s, generator=g) for s in ((rows, rank), (rank, cols), (rows, rank), (rank, cols)))
        return p, (p[0].double() @ p[1].double()) * (p[2].double() @ p[3].double())
    p = (torch.randn(rows, cols, generator=g),)
    return p, p[0].double()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", list(delta_fuse.KINDS))
@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_factors_every_dtype(backend, kind, layout, dtype):
    need_triton(backend)
    g = torch.Generator().manual_seed(7)
    rows, cols, rank = 36, 10, 5
    parts, d64 = _parts(kind, rows, cols, rank, g)
    view = _t if layout == "transposed" else _strided
    parts = tuple(view(p.to(dtype)) for p in parts)
    assert not all(p.is_contiguous() for p in parts)
    d64 = _parts(kind, rows, cols, rank, torch.Generator().manual_seed(7))[0]
    d64 = {"lowrank": lambda p: p[0].to(dtype).double() @ p[1].to(dtype).double(),
           "kron": lambda p: _kron64(p[0].to(dtype), p[1].to(dtype)),
           "hadamard": lambda p: (p[0].to(dtype).double() @ p[1].to(dtype).double())
           * (p[2].to(dtype).double() @ p[3].to(dtype).double()),
           "dense": lambda p: p[0].to(dtype).double()}[kind](d64)
    w0 = torch.randn(rows, cols, generator=g).to(dtype)
    w = w0.clone().to(DEVICE)
    scale = 0.75
    if backend == "reference":
        delta_fuse.fuse_reference_(w, kind, parts, scale, max_chunk_elems=4 * cols)
    else:
        delta_fuse.fuse_triton_(w, kind, tuple(p.to(DEVICE) for p in parts), scale)
    assert w.dtype == dtype
    want = w0.double() + scale * d64
    err = (w.cpu().double() - want).abs()
    if dtype in (torch.float16, torch.bfloat16):             # rounding into the dtype dominates: per element
        bound = REL[dtype] * (w0.double().abs() + (scale * d64).abs()) + 1e-30
    else:                                                     # fp32 accumulation (cancellation in a product):
        bound = REL[dtype] * (w0.double().abs().max() + (scale * d64).abs().max())   # relative to the largest
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_weight_rows_reference_and_dispatch(dtype):
    """A weight whose rows are not contiguous (a transposed view) is fused by the reference (the kernel needs
    stride(1) == 1 and refuses it); every element lands where its values say."""
    g = torch.Generator().manual_seed(3)
    up, down = torch.randn(8, 2, generator=g).to(dtype), torch.randn(2, 6, generator=g).to(dtype)
    base = torch.randn(6, 8, generator=g).to(dtype)
    w = base.clone().t()                                  # [8, 6], stride (1, 8)
    assert w.stride(1) != 1
    ran = delta_fuse.fuse_(w, "lowrank", (up, down), 1.0)
    assert ran == "reference"
    want = base.t().double() + up.double() @ down.double()
    assert ((w.double() - want).abs() <= REL[dtype] * (want.abs() + 1)).all()
    if delta_fuse.HAS_TRITON:
        with pytest.raises(ValueError, match="stride"):
            delta_fuse.fuse_triton_(base.clone().t(), "lowrank", (up, down), 1.0)


def test_dispatch_reports_the_backend_and_a_function_forces_the_reference():
    w = torch.zeros(4, 3)
    up, down = torch.ones(4, 1), torch.ones(1, 3)
    assert delta_fuse.fuse_(w, "lowrank", (up, down), 2.0, backend="reference") == "reference"
    assert torch.equal(w, torch.full((4, 3), 2.0))
    assert delta_fuse.fuse_(w, "lowrank", (up, down), 1.0, function=lambda d: -d) == "reference"
    assert torch.equal(w, torch.full((4, 3), 1.0))


@pytest.mark.parametrize("n,ok", [(0, False), (5, True), (6, False)])
def test_row_map_range_boundary(n, ok):
    """row_map values must lie in [0, m): m - 1 is accepted, m and -1 refused (both sides of each bound)."""
    w = torch.zeros(3, 2)
    up, down = torch.arange(6.0).reshape(6, 1), torch.ones(1, 2)
    if ok:
        rm = torch.tensor([0, n, 2])
        delta_fuse.fuse_reference_(w, "lowrank", (up, down), 1.0, rm)
        assert torch.equal(w[:, 0], torch.tensor([0.0, 5.0, 2.0]))
    else:
        rm = torch.tensor([-1 if n == 0 else 0, n if n else 1, 2])
        with pytest.raises(ValueError, match="outside"):
            delta_fuse.fuse_reference_(w, "lowrank", (up, down), 1.0, rm)


@pytest.mark.parametrize("chunk", [1, 5, 6, 7, 10 ** 9])
def test_reference_chunk_boundaries(chunk):
    """max_chunk_elems below one row, exactly one row, one element more, and everything: same result."""
    g = torch.Generator().manual_seed(4)
    up, down = torch.randn(7, 2, generator=g), torch.randn(2, 6, generator=g)
    w = torch.zeros(7, 6)
    delta_fuse.fuse_reference_(w, "lowrank", (up, down), 1.0, max_chunk_elems=chunk)
    assert torch.allclose(w.double(), up.double() @ down.double(), atol=1e-6)
