"""VSA / VSA-H3 kernels against independent oracles (float64 token-level SDPA, brute-force geometry).

Triton kernels run under TRITON_INTERPRET=1 on CPU (fp32/fp16 only: the interpreter's bf16 tl.dot is wrong).
Sizes are tiny on purpose: the interpreter costs ~ms per tile pair.
"""
from __future__ import annotations

import math

import pytest
import torch

import _fastvideo_rules as fv
from _kernels_interp import DEVICE, ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.kernels import block_sparse, tile_pack, vsa  # noqa: E402
from ditkit.kernels.registry import REGISTRY  # noqa: E402
from ditkit.kernels.vsa_layout import LayoutError, build_h3_layout, compute_topk, validate_layout  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# (prefix segments, video grid): ragged last tiles, prefixes not multiples of 64, empty cond segment
SHAPES = [((70, 0, 100), (5, 6, 10)), ((10, 14), (2, 4, 6)), ((64, 3), (4, 4, 8)), ((1,), (3, 5, 7))]


def need_cpu(backend, dtype=torch.float32):
    if backend in ("cpu_batched", "cpu_native") and DEVICE != "cpu":
        pytest.skip(f"{backend} runs on CPU only")
    if backend == "cpu_native":
        assert dtype == torch.float32, "cpu_native is fp32 only (its refusal is tested in test_kernels_cpu_native.py)"
        need_native()


def need_native():
    from ditkit.kernels.block_sparse_cpu_native import load_extension

    try:
        load_extension()
    except RuntimeError as e:
        pytest.skip(f"cpu_native extension unavailable here: {e}")


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


# ------------------------------------------------------------------------------------------------- geometry
def _brute_tile_of_rows(prefix, video):
    """Tile id of each packed row, from the definition (not from the code under test)."""
    tiles, n = [], 0
    for seg in prefix:
        for j in range(seg):
            tiles.append(n + j // 64)
        n += math.ceil(seg / 64)
    T, Hh, W = video
    nh, nw = math.ceil(Hh / 4), math.ceil(W / 4)
    for t in range(T):
        for h in range(Hh):
            for w in range(W):
                tiles.append(n + (t // 4) * nh * nw + (h // 4) * nw + (w // 4))
    return torch.tensor(tiles)


@pytest.mark.parametrize("prefix,video", SHAPES)
def test_layout_matches_definition(prefix, video):
    lay = build_h3_layout(prefix, video)
    tid = lay.untile_index // 64
    assert torch.equal(tid, _brute_tile_of_rows([p for p in prefix if p], video))
    # rows keep raster order inside each tile and sit at the front of it
    for t in range(lay.n_tiles):
        rows = torch.nonzero(tid == t).view(-1)
        pos = lay.untile_index[rows] % 64
        assert torch.equal(pos, torch.arange(rows.numel()))
        assert int(lay.sizes[t]) == rows.numel()
    assert lay.num_video_tiles == math.prod(math.ceil(x / 4) for x in video)


def test_layout_guards_and_topk():
    assert compute_topk(0.9, 30) == 3 and compute_topk(0.9, 31) == 4 and compute_topk(0.8, 660) == 132
    assert compute_topk(1.0, 10) == 1 and compute_topk(0.0, 10) == 10
    lay = build_h3_layout((70,), (4, 4, 4))
    bad = lay.__class__(lay.prefix_segments, lay.video_shape, 64, lay.sizes.clone(), lay.tile_src,
                        lay.untile_index.clone(), lay.num_prefix_tiles, lay.num_video_tiles)
    bad.untile_index[0] = 63  # maps into a pad slot of tile 0? tile 0 is full -> collide with row 63
    with pytest.raises(LayoutError):
        validate_layout(bad)
    with pytest.raises(LayoutError, match="token refiner"):
        vsa.check_seq_len(lay, 70)


# ------------------------------------------------------------------------------------------------- pack / unpack
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefix,video", SHAPES[:3])
def test_pack_unpack_combine(backend, dtype, prefix, video):
    need_triton(backend)
    lay = build_h3_layout(prefix, video)
    x = _rand((1, 2, lay.seq_len, 16), dtype, 0)
    pack = REGISTRY.resolve("vsa_pack", DEVICE, dtype, 16, backend).fn
    unpack = REGISTRY.resolve("vsa_unpack_combine", DEVICE, dtype, 16, backend).fn
    xt = pack(x, lay.tile_src.to(DEVICE))
    live = (lay.tile_src >= 0).to(DEVICE)
    assert bool((xt[:, :, ~live] == 0).all()), "pad rows must be exactly zero"
    # oracle: explicit loop over padded positions
    src = lay.tile_src.tolist()
    exp = torch.zeros_like(xt)
    for p, s in enumerate(src):
        if s >= 0:
            exp[:, :, p] = x[:, :, s]
    assert torch.equal(xt, exp)
    back = unpack(xt, lay.untile_index.to(DEVICE))
    assert torch.equal(back, x)
    coarse = _rand((1, 2, lay.n_tiles, 16), dtype, 1)
    gate = _rand(tuple(x.shape), dtype, 2)
    tid = (lay.untile_index // 64).to(DEVICE)
    for g in (gate, None):
        got = unpack(xt, lay.untile_index.to(DEVICE), coarse, g)
        c = coarse.double()[:, :, tid]
        want = x.double() + (c * g.double() if g is not None else c)
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


# ------------------------------------------------------------------------------------------------- fine stage
def _random_selection(B, H, T, Tk, seed, allow_empty=False):
    g = torch.Generator().manual_seed(seed)
    num = torch.randint(0 if allow_empty else 1, Tk + 1, (B, H, T), generator=g)
    idx = torch.zeros(B, H, T, Tk, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                perm = torch.randperm(Tk, generator=g)[: int(num[b, h, t])]  # unsorted on purpose
                idx[b, h, t, : perm.numel()] = perm.to(torch.int32)
    return idx.to(DEVICE), num.to(torch.int32).to(DEVICE)


def _oracle_bsa(q, k, v, idx, num, vbs):
    """float64 token-level SDPA with the expanded mask, plus its log2 LSE."""
    B, H, S, D = q.shape
    T, Tk = S // 64, k.shape[2] // 64
    allowed = torch.zeros(B, H, T, Tk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                for j in idx[b, h, t, : int(num[b, h, t])].tolist():
                    allowed[b, h, t, j] = True
    keylive = (torch.arange(64)[None] < vbs.cpu()[:, None]).reshape(-1)
    mask = allowed.repeat_interleave(64, 2).repeat_interleave(64, 3) & keylive
    s = (q.double().cpu() @ k.double().cpu().transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    o = p @ v.double().cpu()
    return o, lse / math.log(2)


def _cases(backends):
    """backend x dtype, without cpu_native in half precision (fp32-only kernel; its refusal is tested apart)."""
    return [(b, d) for b in backends for d in (torch.float32, torch.float16) if not (b == "cpu_native" and d != torch.float32)]


@pytest.mark.parametrize("backend,dtype", _cases(["reference", "cpu_batched", "cpu_native", "triton", "flex"]))
@pytest.mark.parametrize("D,T,sizes", [(16, 3, (64, 17, 64, 5)), (32, 3, (64, 17, 64, 5)), (64, 2, (1, 64, 40))])
def test_block_sparse_attn_vs_oracle(backend, dtype, D, T, sizes):
    need_triton(backend)
    need_cpu(backend, dtype)
    B, H, Tk = 1, 2, len(sizes)
    vbs = torch.tensor(sizes, dtype=torch.int32).to(DEVICE)
    q = _rand((B, H, T * 64, D), dtype, 3)
    k = _rand((B, H, Tk * 64, D), dtype, 4)
    v = _rand((B, H, Tk * 64, D), dtype, 5)
    keylive = (torch.arange(64, device=DEVICE)[None] < vbs[:, None]).reshape(-1)
    k[:, :, ~keylive] = 0
    v[:, :, ~keylive] = 0
    idx, num = _random_selection(B, H, T, Tk, seed=D)
    out, lse = vsa.block_sparse_attn(q, k, v, idx, num, vbs, backend=backend)
    o_ref, lse_ref = _oracle_bsa(q, k, v, idx, num, vbs)
    torch.testing.assert_close(out.double().cpu(), o_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.double().cpu(), lse_ref, atol=TOL[dtype] * 10, rtol=TOL[dtype])


@pytest.mark.parametrize("backend", ["reference", "cpu_batched", "cpu_native", "triton"])
def test_block_sparse_empty_rows(backend):
    need_triton(backend)
    need_cpu(backend)
    B, H, T, D = 1, 1, 2, 16
    q = _rand((B, H, T * 64, D), torch.float32, 6)
    k = _rand((B, H, T * 64, D), torch.float32, 7)
    idx = torch.zeros(B, H, T, T, dtype=torch.int32, device=DEVICE)
    num = torch.tensor([[[0, 1]]], dtype=torch.int32, device=DEVICE)
    vbs = torch.full((T,), 64, dtype=torch.int32, device=DEVICE)
    out, lse = vsa.block_sparse_attn(q, k, k, idx, num, vbs, backend=backend)
    assert bool((out[:, :, :64] == 0).all()) and bool(torch.isinf(lse[:, :, :64]).all())
    assert bool(torch.isfinite(out[:, :, 64:]).all())


@pytest.mark.parametrize("backend,dtype", [("cpu_batched", torch.float32), ("cpu_batched", torch.float16),
                                           ("cpu_native", torch.float32)])
def test_cpu_batched_dense_common_rest_parts(backend, dtype):
    """Every path of cpu_batched at once: dense rows, key tiles common to all other rows (some ragged), per-row
    rest tiles of different counts (some ragged), rows with only the common tiles, an empty row, scattered rows,
    B=2 with different selections per (b, h); vs the float64 token-level oracle."""
    need_cpu(backend, dtype)
    sizes = (64, 17, 64, 64, 5, 64, 33)
    B, H, T, Tk, D = 2, 2, 6, len(sizes), 32
    vbs = torch.tensor(sizes, dtype=torch.int32)
    q = _rand((B, H, T * 64, D), dtype, 20)
    k = _rand((B, H, Tk * 64, D), dtype, 21)
    v = _rand((B, H, Tk * 64, D), dtype, 22)
    keylive = (torch.arange(64)[None] < vbs[:, None]).reshape(-1)
    k[:, :, ~keylive] = 0
    v[:, :, ~keylive] = 0
    g = torch.Generator().manual_seed(23)
    idx = torch.zeros(B, H, T, Tk, dtype=torch.int32)
    num = torch.zeros(B, H, T, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            common = [1, 3] if (b + h) % 2 == 0 else [0]
            for t in range(T):
                if t == 2:
                    sel = list(range(Tk))                                   # dense row (in the middle)
                elif t == 4 and b == 0:
                    sel = []                                                # empty row
                elif t == 5:
                    sel = list(common)                                      # common tiles only
                else:
                    others = [j for j in torch.randperm(Tk, generator=g).tolist() if j not in common]
                    sel = common + others[: 1 + (t + h) % 3]
                perm = torch.tensor(sel, dtype=torch.int32)[torch.randperm(len(sel), generator=g)]
                idx[b, h, t, : len(sel)] = perm
                num[b, h, t] = len(sel)
    out, lse = vsa.block_sparse_attn(q, k, v, idx, num, vbs, backend=backend)
    o_ref, lse_ref = _oracle_bsa(q, k, v, idx, num, vbs)
    torch.testing.assert_close(out.double(), o_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.double(), lse_ref, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    assert bool((out[0, :, 4 * 64:5 * 64] == 0).all()) and bool(torch.isinf(lse[0, :, 4 * 64:5 * 64]).all())


# ------------------------------------------------------------------------------------------------- VSA-H3
def _oracle_selection(q, k, lay, keep):
    """Pooled float64 scores straight from the packed rows + FastVideo's H3 rule (``_build_block_mask``, written
    from FastVideo's source in ``_fastvideo_rules``), as a bool tile map."""
    B, H, S, D = q.shape
    tid = (lay.untile_index // 64)
    T = lay.n_tiles
    onehot = torch.zeros(T, S, dtype=torch.float64)
    onehot[tid, torch.arange(S)] = 1.0
    onehot = onehot / onehot.sum(1, keepdim=True)
    qp = onehot @ q.double().cpu()
    kp = onehot @ k.double().cpu()
    sc = qp @ kp.transpose(-1, -2) / math.sqrt(D)
    m = fv.h3_mask(sc, lay.num_prefix_tiles, lay.num_video_tiles, 1 - keep)
    return m, sc, onehot


@pytest.mark.parametrize("prefix,video", SHAPES)
@pytest.mark.parametrize("backend,dtype", _cases(["reference", "cpu_batched", "cpu_native", "triton"]))
@pytest.mark.parametrize("with_gate", [False, True])
def test_vsa_h3_vs_token_oracle(prefix, video, dtype, backend, with_gate):
    need_triton(backend)
    need_cpu(backend, dtype)
    lay = build_h3_layout(prefix, video)
    B, H, D = 1, 2, 16
    S = lay.seq_len
    q, k, v = (_rand((B, H, S, D), dtype, s) for s in (10, 11, 12))
    gate = _rand((B, H, S, D), dtype, 13) if with_gate else None
    keep = 0.3
    out, st = vsa.vsa_h3_attention(q, k, v, lay, keep, gate=gate, backend=backend)
    m, sc, onehot = _oracle_selection(q, k, lay, keep)
    # selection: compare with the independently computed map
    idx, num = vsa.select_h3(sc.float(), lay.num_prefix_tiles, lay.num_video_tiles, lay.topk(keep))
    got = torch.zeros_like(m)
    for t in range(lay.n_tiles):
        for h in range(H):
            got[0, h, t, idx[0, h, t, : int(num[0, h, t])].long()] = True
    assert torch.equal(got, m)
    tid = lay.untile_index // 64
    mask = m[:, :, tid][:, :, :, tid]
    want = torch.nn.functional.scaled_dot_product_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                                            attn_mask=mask)
    if with_gate:
        vp = onehot @ v.double().cpu()
        coarse = torch.softmax(sc, -1) @ vp
        want = want + coarse[:, :, tid] * gate.double().cpu()
    torch.testing.assert_close(out.double().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert st.backend == backend and 0 < st.density <= 1


def test_vsa_h3_keep_all_is_dense():
    lay = build_h3_layout((10, 14), (2, 4, 6))
    q, k, v = (_rand((1, 2, lay.seq_len, 16), torch.float32, s) for s in (1, 2, 3))
    out, st = vsa.vsa_h3_attention(q, k, v, lay, 1.0)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert st.density == 1.0


@pytest.mark.parametrize("backend", ["reference", "triton", "flex"])
def test_video_sparse_attn_fastvideo_semantics(backend):
    """fastvideo_kernel.video_sparse_attn, recomputed densely in float64 from its documented steps."""
    need_triton(backend)
    B, H, T, D = 1, 2, 4, 16
    vbs = torch.tensor([64, 64, 30, 64], dtype=torch.int32)
    live = (torch.arange(64)[None] < vbs[:, None]).reshape(-1)
    q, k, v = (_rand((B, H, T * 64, D), torch.float32, s) for s in (20, 21, 22))
    for x in (q, k, v):
        x[:, :, ~live] = 0
    w = _rand((B, H, T * 64, D), torch.float32, 23)
    topk = 2
    for weight in (None, w):
        out = vsa.video_sparse_attn(q, k, v, vbs, vbs, topk, compress_attn_weight=weight, backend=backend)
        qd, kd, vd = (x.double().view(B, H, T, 64, D).sum(3) / vbs.double()[:, None] for x in (q, k, v))
        sc = qd @ kd.transpose(-1, -2) / math.sqrt(D)
        oc = (torch.softmax(sc, -1) @ vd).repeat_interleave(64, 2)
        m = fv.fused_topk_mask(sc, topk)                           # FastVideo fused_topk_mask, from its source
        mask = m.repeat_interleave(64, 2).repeat_interleave(64, 3) & live
        os_ = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        want = os_ + (oc * weight.double() if weight is not None else oc)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.skipif(not tile_pack.HAS_TRITON, reason="triton not installed")
def test_custom_ops_trace_under_torch_compile():
    need_triton()
    from ditkit.kernels.vsa import CUSTOM_OPS

    lay = build_h3_layout((10,), (2, 4, 4))
    src = lay.tile_src.to(DEVICE)

    def f(x, idx, num, vbs):
        xt = CUSTOM_OPS["pack"](x, src)
        o, lse = CUSTOM_OPS["bsa"](xt, xt, xt, idx, num, vbs)
        return o, lse

    x = _rand((1, 1, lay.seq_len, 16), torch.float32, 30)
    T = lay.n_tiles
    idx, num = block_sparse.dense_tile_index(1, 1, T, T, DEVICE)
    vbs = lay.sizes.to(torch.int32).to(DEVICE)
    cf = torch.compile(f, backend="eager", fullgraph=True)
    o1, l1 = cf(x, idx, num, vbs)
    o2, l2 = f(x, idx, num, vbs)
    torch.testing.assert_close(o1, o2)
    # fake (meta) implementations give the right shapes without running a kernel
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(1, 1, lay.seq_len, 16)
        fo = CUSTOM_OPS["pack"](fx, torch.empty(lay.padded_len, dtype=torch.int64))
        assert fo.shape == (1, 1, lay.padded_len, 16)
    assert tile_pack.TILE == 64


def test_prefix_segments_follow_fastvideo_grouping():
    from ditkit.bridge.attention import prefix_segments_from_spans  # ComfyUI's span names -> FastVideo segments

    # t2va: [text | audio | video]
    assert prefix_segments_from_spans([(0, 10, "text"), (10, 84, "audio"), (84, 532, "video")]) == \
        ((10, 74), ("text", "audio"))
    # fl2va, two keyframes: their cond rows form ONE segment (FastVideo's n_cond), empty spans dropped
    spans = [(0, 7, "text"), (7, 71, "cond"), (71, 135, "cond"), (135, 135, "cond_audio"), (135, 149, "audio"),
             (149, 200, "video")]
    assert prefix_segments_from_spans(spans) == ((7, 128, 14), ("text", "visual", "audio"))
    with pytest.raises(LayoutError):
        prefix_segments_from_spans([(0, 5, "text"), (5, 9, "video"), (9, 12, "audio")])
    with pytest.raises(LayoutError):
        prefix_segments_from_spans([(0, 5, "text"), (6, 9, "video")])
