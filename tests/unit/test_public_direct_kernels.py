"""Public functions of kernels/ that were only reached through their callers (issue 29: every public function is called
directly by a unit test). Each oracle is written here from the function's contract (python loops, float64), never
from the code under test; boundaries on both sides, every accepted dtype, non-contiguous inputs."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import BackendError
from ditkit.kernels import _triton, registry, vsa, vsa_layout, vsa_select
from ditkit.kernels.block_sparse_flex import build_flex_block_mask
from ditkit.kernels.registry import Query, need_cuda, triton_check, triton_interpreter

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


# ---- kernels/_triton.existing_custom_op
def test_existing_custom_op_finds_a_defined_op_and_none_otherwise():
    assert _triton.existing_custom_op("no_such_op_issue29") is None

    if _triton.existing_custom_op("issue29_probe_twice") is None:    # defined once per process
        @torch.library.custom_op("ditkit::issue29_probe_twice", mutates_args=())
        def probe(x: torch.Tensor) -> torch.Tensor:
            return x * 2

    op = _triton.existing_custom_op("issue29_probe_twice")
    assert op is not None
    assert torch.equal(op(torch.tensor([1.0, 3.0])), torch.tensor([2.0, 6.0]))   # the op itself, callable


# ---- kernels/registry: triton_interpreter, triton_check, need_cuda
def _q(device="cuda", cap=(8, 0), dtype=torch.float16, hd=64):
    return Query("op", device, 0 if device == "cuda" else None, cap, dtype, hd)


@pytest.mark.parametrize("flag", [True, False])
def test_triton_interpreter_reads_the_import_time_flag(monkeypatch, flag):
    monkeypatch.setattr(_triton, "INTERPRETED", flag)
    assert triton_interpreter() is flag


@pytest.mark.parametrize("cap,ok", [((7, 5), False), ((7, 9), False), ((8, 0), True), ((8, 6), True), ((9, 0), True),
                                    (None, False)])
def test_need_cuda_compute_capability_boundary(cap, ok):
    r = need_cuda(_q(cap=cap))
    assert (r is None) is ok
    if not ok:
        assert "sm80" in r and str(cap) in r


def test_need_cuda_other_minimum_and_device():
    assert need_cuda(_q(cap=(9, 0)), (9, 0)) is None
    assert "sm90" in need_cuda(_q(cap=(8, 9)), (9, 0))
    assert need_cuda(_q(cap=(10, 0)), (9, 0)) is None
    for dev in ("cpu", "mps"):
        r = need_cuda(_q(device=dev, cap=None))
        assert r is not None and dev in r


@pytest.mark.parametrize("dtype,ok", [(torch.float16, True), (torch.bfloat16, True), (torch.float32, True),
                                      (torch.float64, False), (torch.int8, False)])
def test_triton_check_dtypes_on_cuda(dtype, ok):
    r = triton_check(_q(dtype=dtype), False, True, None)
    assert (r is None) is ok
    if not ok:
        assert str(dtype) in r


def test_triton_check_order_and_cpu_rule(monkeypatch):
    assert triton_check(_q(dtype=torch.float64), True, False, "bad hd") == "triton is not installed"
    assert triton_check(_q(dtype=torch.float64), True, True, "bad hd") == "bad hd"
    assert "sm80" in triton_check(_q(cap=(7, 5)), True, True, None)
    cpu = _q(device="cpu", cap=None, dtype=torch.float32)
    monkeypatch.setattr(_triton, "INTERPRETED", True)
    assert triton_check(cpu, True, True, None) is None                 # interpreter + explicit request: allowed
    assert "TRITON_INTERPRET" in triton_check(cpu, False, True, None)  # never picked by auto
    monkeypatch.setattr(_triton, "INTERPRETED", False)
    assert "TRITON_INTERPRET" in triton_check(cpu, True, True, None)


# ---- kernels/vsa.pool_tiles
def _pool_oracle(x, sizes, tile):
    B, H, P, D = x.shape
    out = torch.zeros(B, H, P // tile, D, dtype=torch.float64)
    for t in range(P // tile):
        n = int(sizes[t])
        out[:, :, t] = x[:, :, t * tile:t * tile + n].double().sum(dim=2) / n
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [4, 64])
def test_pool_tiles_means_the_live_rows(dtype, tile):
    g = torch.Generator().manual_seed(5)
    B, H, T, D = 2, 3, 3, 8
    sizes = torch.tensor([tile, 1, tile - 1])
    base = torch.randn(B, T * tile, H, D, generator=g).to(dtype)
    for t, n in enumerate(sizes.tolist()):
        base[:, t * tile + n:(t + 1) * tile] = 0                      # pad rows are zero
    x = base.transpose(1, 2)                                          # [B,H,P,D], non-contiguous
    assert not x.is_contiguous()
    got = vsa.pool_tiles(x, sizes, tile)
    assert got.dtype == torch.float32 and got.shape == (B, H, T, D)
    assert torch.allclose(got.double(), _pool_oracle(x, sizes, tile), rtol=1e-6, atol=1e-6)


# ---- kernels/vsa.resolve_aux
def test_resolve_aux_follows_only_a_triton_request(monkeypatch):
    q = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16)
    want = registry.REGISTRY.resolve("vsa_pack", q.device, q.dtype, 32, None)
    for backend in (None, "auto", "reference", "flex", "cpu"):        # "flex" has no pack impl: must not reach resolve
        sel = vsa.resolve_aux("vsa_pack", q, backend)
        assert sel.backend == want.backend and sel.query.dtype == torch.bfloat16 and sel.query.head_dim == 32
    sel = vsa.resolve_aux("vsa_unpack_combine", q.float(), "flex")
    assert sel.op == "vsa_unpack_combine" and sel.query.dtype == torch.float32
    monkeypatch.setattr(_triton, "INTERPRETED", False)
    registry.REGISTRY._cache.clear()
    try:
        with pytest.raises(BackendError, match="triton"):               # an explicit triton request is kept
            vsa.resolve_aux("vsa_pack", q, "triton")
    finally:
        registry.REGISTRY._cache.clear()


# ---- kernels/vsa_layout.video_tile_partition
def _partition_oracle(shape, cube):
    t, h, w = shape
    keyed = []
    for i in range(t * h * w):
        ti, rem = divmod(i, h * w)
        hi, wi = divmod(rem, w)
        keyed.append(((ti // cube[0], hi // cube[1], wi // cube[2]), i))
    keyed.sort()
    order = [i for _, i in keyed]
    sizes = []
    for a in range(0, t, cube[0]):
        for b in range(0, h, cube[1]):
            for c in range(0, w, cube[2]):
                sizes.append(min(cube[0], t - a) * min(cube[1], h - b) * min(cube[2], w - c))
    return order, sizes


@pytest.mark.parametrize("shape,cube", [((4, 4, 4), (4, 4, 4)), ((5, 4, 9), (4, 4, 4)), ((3, 3, 3), (4, 4, 4)),
                                        ((1, 1, 1), (4, 4, 4)), ((4, 5, 3), (2, 3, 1)), ((8, 8, 8), (4, 4, 4))])
def test_video_tile_partition(shape, cube):
    order, sizes = vsa_layout.video_tile_partition(shape, cube) if cube != (4, 4, 4) else \
        vsa_layout.video_tile_partition(shape)
    want_order, want_sizes = _partition_oracle(shape, cube)
    assert order.dtype == torch.int64 and sizes.dtype == torch.int64
    assert order.tolist() == want_order and sizes.tolist() == want_sizes
    assert int(sizes.sum()) == math.prod(shape)


def test_video_tile_partition_empty():
    order, sizes = vsa_layout.video_tile_partition((0, 4, 4))
    assert order.shape == (0,) and sizes.shape == (0,) and order.dtype == sizes.dtype == torch.int64


# ---- kernels/vsa_layout.merge_prefix_segments
CLASSES = {"txt": "text", "img": "visual", "aud": "audio", "vid": "video", "cond": "video"}


@pytest.mark.parametrize("spans,want", [
    ([(0, 10, "vid")], ((), ())),
    ([(0, 5, "txt"), (5, 20, "vid")], ((5,), ("text",))),
    ([(0, 5, "txt"), (5, 8, "txt"), (8, 9, "aud"), (9, 30, "vid")], ((8, 1), ("text", "audio"))),
    ([(0, 5, "txt"), (5, 5, "aud"), (5, 8, "txt"), (8, 9, "vid")], ((8,), ("text",))),   # an empty span is skipped
    ([(0, 0, "txt"), (0, 4, "img"), (4, 4, "vid")], ((4,), ("visual",))),
    ([(0, 2, "txt"), (2, 3, "img"), (3, 5, "txt"), (5, 6, "vid")], ((2, 1, 2), ("text", "visual", "text"))),
])
def test_merge_prefix_segments(spans, want):
    assert vsa_layout.merge_prefix_segments(spans, CLASSES.get) == want


@pytest.mark.parametrize("spans,match", [
    ([], "last packed segment"),
    ([(0, 5, "vid"), (5, 9, "txt")], "last packed segment"),
    ([(0, 5, "txt"), (5, 9, "zzz")], "last packed segment"),
    ([(1, 5, "txt"), (5, 9, "vid")], "not contiguous"),                # starts after 0
    ([(0, 5, "txt"), (6, 9, "aud"), (9, 12, "vid")], "not contiguous"),   # a gap of one
    ([(0, 5, "txt"), (4, 9, "aud"), (9, 12, "vid")], "not contiguous"),   # an overlap of one
    ([(0, 5, "txt"), (5, 4, "aud"), (4, 12, "vid")], "not contiguous"),   # stop < start
    ([(0, 5, "txt"), (6, 12, "vid")], "not contiguous"),               # the video starts after a gap
    ([(0, 5, "txt"), (4, 12, "vid")], "not contiguous"),
    ([(0, 5, "cond"), (5, 12, "vid")], "cannot place"),
    ([(0, 5, "zzz"), (5, 12, "vid")], "cannot place"),
])
def test_merge_prefix_segments_refuses(spans, match):
    with pytest.raises(vsa_layout.LayoutError, match=match):
        vsa_layout.merge_prefix_segments(spans, CLASSES.get)


# ---- kernels/vsa_select: exact_topk_mask, h3_block_mask, mask_to_index
def _radix(v: float):
    """CUDA topk's order of fp32 values: NaN largest, -0.0 below +0.0."""
    if math.isnan(v):
        return (2, 0.0)
    return (1, v, math.copysign(1.0, v))


def _topk_oracle(scores, k):
    x = scores.float()
    n = x.shape[-1]
    k = max(0, min(int(k), n))
    flat = x.reshape(-1, n)
    out = torch.zeros(flat.shape, dtype=torch.bool)
    for r in range(flat.shape[0]):
        vals = flat[r].tolist()
        order = sorted(range(n), key=lambda j: (tuple(-c for c in _radix(vals[j])), j))
        out[r, order[:k]] = True
    return out.view(scores.shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_topk_mask_matches_a_stable_sort(dtype):
    g = torch.Generator().manual_seed(7)
    s = torch.randint(-3, 4, (3, 11, 9), generator=g).to(dtype) / 2   # many ties
    s = s.transpose(1, 2)                                               # non-contiguous, last dim 11
    for k in (-1, 0, 1, 4, 10, 11, 12):
        got = vsa_select.exact_topk_mask(s, k)
        assert got.dtype == torch.bool and got.shape == s.shape
        assert torch.equal(got, _topk_oracle(s, k)), (dtype, k)


def test_exact_topk_mask_signed_zero_and_nan():
    s = torch.tensor([[0.0, -0.0, -1.0, 0.0, -0.0],
                      [-0.0, float("nan"), 1.0, float("nan"), 0.0],
                      [-0.0, -0.0, -0.0, 0.0, -2.0]])
    for k in range(6):
        assert torch.equal(vsa_select.exact_topk_mask(s, k), _topk_oracle(s, k)), k
    assert vsa_select.exact_topk_mask(s, 2)[0].tolist() == [True, False, False, True, False]   # +0.0 above -0.0
    assert vsa_select.exact_topk_mask(s, 2)[1].tolist() == [False, True, False, True, False]   # NaN largest
    assert vsa_select.exact_topk_mask(s, 2)[2].tolist() == [True, False, False, True, False]


def _h3_oracle(scores, npre, nvid, k_vid, exempt):
    T = scores.shape[-1]
    if k_vid >= nvid:
        return torch.ones(scores.shape, dtype=torch.bool)
    m = torch.zeros(scores.shape, dtype=torch.bool)
    if exempt or npre == 0:
        m[..., :npre] = True
        m[..., npre:] = _topk_oracle(scores[..., npre:], k_vid)
    else:
        m = _topk_oracle(scores, min(k_vid + npre, T))
    m[..., :npre, :] = True
    return m


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("npre", [0, 1, 2])
@pytest.mark.parametrize("exempt", [True, False])
def test_h3_block_mask(dtype, npre, exempt):
    g = torch.Generator().manual_seed(11 + npre)
    nvid = 5
    T = npre + nvid
    s = torch.randn(2, 1, T, T, generator=g).to(dtype)
    for k_vid in (0, 1, 3, nvid - 1, nvid, nvid + 1):
        got = vsa_select.h3_block_mask(s, npre, nvid, k_vid, exempt)
        assert got.dtype == torch.bool
        assert torch.equal(got, _h3_oracle(s, npre, nvid, k_vid, exempt)), (k_vid, npre, exempt)
    assert not vsa_select.h3_block_mask(s, npre, nvid, nvid - 1, exempt).all()
    assert vsa_select.h3_block_mask(s, npre, nvid, nvid, exempt).all()


def _index_oracle(mask):
    Tk = mask.shape[-1]
    flat = mask.reshape(-1, Tk)
    idx, num = [], []
    for r in range(flat.shape[0]):
        row = flat[r].tolist()
        sel = [j for j in range(Tk) if row[j]]
        idx.append(sel + [j for j in range(Tk) if not row[j]])
        num.append(len(sel))
    return (torch.tensor(idx, dtype=torch.int32).view(mask.shape),
            torch.tensor(num, dtype=torch.int32).view(mask.shape[:-1]))


@pytest.mark.parametrize("chunk", [1, 6, 7, 13, 1 << 24])
def test_mask_to_index(chunk):
    g = torch.Generator().manual_seed(13)
    mask = (torch.rand(2, 3, 7, 5, generator=g) < 0.4).transpose(-1, -2)   # [...,5,7], non-contiguous
    mask[0, 0, 0] = True
    mask[0, 0, 1] = False
    idx, num = vsa_select.mask_to_index(mask, chunk)
    want_idx, want_num = _index_oracle(mask)
    assert idx.dtype == num.dtype == torch.int32
    assert torch.equal(idx, want_idx) and torch.equal(num, want_num)


def test_mask_to_index_empty():
    idx, num = vsa_select.mask_to_index(torch.zeros(2, 0, 4, dtype=torch.bool))
    assert idx.shape == (2, 0, 4) and num.shape == (2, 0) and idx.dtype == num.dtype == torch.int32


# ---- kernels/block_sparse_flex.build_flex_block_mask
def _flex_oracle(index, num, vbs, S, Sk):
    B, H, T, _ = index.shape
    out = torch.zeros(B, H, S, Sk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for qi in range(S):
                tiles = set(index[b, h, qi // 64, :int(num[b, h, qi // 64])].tolist())
                for kv in range(Sk):
                    out[b, h, qi, kv] = (kv // 64) in tiles and (kv % 64) < int(vbs[kv // 64])
    return out


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_build_flex_block_mask_encodes_the_selection_and_ragged_tiles(idx_dtype):
    B, H, T, Tk = 1, 2, 2, 3
    S, Sk = 64 * T, 64 * Tk
    full = torch.tensor([[[[2, 0, 1], [1, 2, 0]], [[0, 1, 2], [2, 1, 0]]]], dtype=idx_dtype)
    index = full.transpose(-1, -2).contiguous().transpose(-1, -2)      # non-contiguous view of the same lists
    assert not index.is_contiguous()
    num = torch.tensor([[[2, 1], [0, 3]]], dtype=idx_dtype)
    vbs = torch.tensor([64, 1, 63])
    bm = build_flex_block_mask(index, num, vbs, S, Sk)
    assert tuple(bm.seq_lengths) == (S, Sk)
    assert bm.kv_num_blocks.dtype == torch.int32 and bm.kv_num_blocks.tolist() == num.tolist()
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    qi = torch.arange(S)[None, None, :, None]
    kv = torch.arange(Sk)[None, None, None, :]
    dense = bm.mask_mod(b, h, qi, kv)
    assert torch.equal(dense.expand(B, H, S, Sk), _flex_oracle(full, num, vbs, S, Sk))


def test_build_flex_block_mask_with_no_index_slot():
    index = torch.zeros(1, 1, 2, 0, dtype=torch.int32)
    num = torch.zeros(1, 1, 2, dtype=torch.int32)
    bm = build_flex_block_mask(index, num, torch.tensor([64, 64]), 128, 128)
    assert bm.kv_num_blocks.tolist() == [[[0, 0]]]
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    assert not bm.mask_mod(b, b, torch.arange(128)[:, None], torch.arange(128)[None, :]).any()
