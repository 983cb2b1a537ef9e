"""VSA / VSA-H3 tile selection and top-k count against FastVideo: its own Triton kernel (from the 0.3.5 sdist,
under TRITON_INTERPRET=1 on CPU), re-implementations of its rules written from its source
(``_fastvideo_rules.py``), and end-to-end attention on tied tiles in every backend.

Tied pooled scores are real (static frames, flat backgrounds, padding): CPU ``torch.topk`` breaks ties in no
fixed order, FastVideo does not. Tied inputs here are small integers / powers of two, so every pooled mean and
score is exact in fp32, fp16 and float64 alike and the ties survive any summation order.
"""
from __future__ import annotations

import math
from decimal import Decimal

import pytest
import torch

import _fastvideo_rules as fv
from _kernels_interp import DEVICE, ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.kernels import vsa, vsa_select  # noqa: E402
from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime  # noqa: E402
from ditkit.kernels.vsa_layout import build_h3_layout, compute_topk  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _tied_scores(seed, shape, levels=4, scale=0.25):
    """Scores on a coarse grid: many exact ties, at the k-th boundary too."""
    return torch.randint(-levels, levels + 1, shape, generator=_gen(seed)).float() * scale


def _diff(got, want):
    rows = (got != want).any(-1).nonzero().tolist()
    r = rows[0] if rows else None
    first = "" if r is None else (f"; row {r}: got {got[tuple(r)].nonzero().view(-1).tolist()}, "
                                  f"FastVideo {want[tuple(r)].nonzero().view(-1).tolist()}")
    return f"{len(rows)} rows differ{first}"


def _selection_cases():
    """(name, scores [B,H,T,Tk], topk): untied, tied, and the cases where FastVideo keeps more or fewer than k."""
    g = _gen(0)
    cases = [("random", torch.randn(1, 2, 5, 37, generator=g), 6),
             ("tied grid", _tied_scores(1, (2, 2, 6, 40)), 7),
             ("all equal", torch.zeros(1, 1, 3, 20), 4),
             ("all equal nonzero", torch.full((1, 1, 2, 33), 0.375), 5),
             ("bf16 scores", torch.randn(1, 2, 4, 64, generator=g).bfloat16().float(), 9)]
    near0 = torch.tensor([[-20.0, 0.5, 2**-7, 2**-7, 2**-7, -1.0]])      # k-th value tied and near 0, wide range
    cases.append(("near-zero tie, wide range", near0.view(1, 1, 1, 6).repeat(1, 1, 2, 1), 2))
    tiny = torch.tensor([[1e-30, 1e-30, 1e-30, 10.0, -10.0, 0.0]])
    cases.append(("tiny tie", tiny.view(1, 1, 1, 6), 2))
    ninf = torch.tensor([[0.5, float("-inf"), 0.25, float("-inf"), float("-inf")]])
    cases.append(("fewer finite than k", ninf.view(1, 1, 1, 5), 4))
    cases.append(("all -inf", torch.full((1, 1, 1, 7), float("-inf")), 3))
    top_tie = torch.tensor([[3.0, 3.0, 3.0, 3.0, 1.0, -2.0, 0.5]])        # k-th value tied at the row maximum
    cases.append(("tie at the maximum", top_tie.view(1, 1, 1, 7), 2))
    cases.append(("k > Tk", _tied_scores(2, (1, 1, 3, 9)), 20))
    return cases


CASES = _selection_cases()


@pytest.mark.parametrize("name,scores,topk", CASES, ids=[c[0] for c in CASES])
def test_vsa_selection_follows_fastvideo_rule_from_source(name, scores, topk):
    """ditkit's VSA selection (what every backend attends) == fused_topk_mask, re-implemented from its source."""
    idx, num = vsa.topk_index(scores, topk)
    got = fv.index_to_mask(idx, num, scores.shape[-1])
    want = fv.fused_topk_mask(scores, topk)
    assert torch.equal(got, want), f"{name}: {_diff(got, want)}"


def test_vsa_selection_is_not_always_exactly_k():
    """Pin the cases where FastVideo keeps other than k tiles (these fail for any "exactly k" rule)."""
    by_name = {c[0]: c for c in CASES}
    _, s, k = by_name["near-zero tie, wide range"]
    m = fv.index_to_mask(*vsa.topk_index(s, k), 6)
    assert m[0, 0, 0].nonzero().view(-1).tolist() == [1, 2, 3, 4]        # 0.5 and all three 2^-7 ties
    _, s, k = by_name["tiny tie"]
    assert fv.index_to_mask(*vsa.topk_index(s, k), 6)[0, 0, 0].nonzero().view(-1).tolist() == [0, 1, 2, 3]
    _, s, k = by_name["fewer finite than k"]
    assert fv.index_to_mask(*vsa.topk_index(s, k), 5)[0, 0, 0].nonzero().view(-1).tolist() == [0, 2]
    _, s, k = by_name["all equal"]
    assert fv.index_to_mask(*vsa.topk_index(s, k), 20)[0, 0].nonzero()[:, 1].unique().tolist() == [0, 1, 2, 3]


def test_vsa_selection_over_4096_blocks_is_cuda_topk():
    """next_power_of_2(Tk) > 4096: FastVideo falls back to torch.topk on the GPU (ties to the lowest index)."""
    s = _tied_scores(3, (1, 1, 2, 4100), levels=2)
    idx, num = vsa.topk_index(s, 50)
    got = fv.index_to_mask(idx, num, 4100)
    want = fv.rows_to_mask(s, lambda r: fv.cuda_topk_row(r, 50))
    assert torch.equal(got, want) and bool((num == 50).all())


@pytest.mark.parametrize("name,scores,topk", CASES, ids=[c[0] for c in CASES])
def test_vsa_selection_matches_fastvideo_kernel(name, scores, topk):
    """ditkit's selection == FastVideo's own ``fused_topk_mask`` (fastvideo-kernel 0.3.5 sdist, one file loaded
    from the test cache; under TRITON_INTERPRET=1 on CPU)."""
    from _fastvideo_ref import load_fused_compress_topk

    try:
        ref = load_fused_compress_topk()
    except LookupError as e:
        pytest.skip(f"FastVideo's fused_topk_mask unavailable: {e}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    want = ref.fused_topk_mask(scores.to(dev), topk).cpu()
    idx, num = vsa.topk_index(scores, topk)
    got = fv.index_to_mask(idx, num, scores.shape[-1])
    assert torch.equal(got, want), f"{name} (vs FastVideo's kernel): {_diff(got, want)}"
    # and the test's re-implementation agrees with the kernel it was written from
    assert torch.equal(fv.fused_topk_mask(scores, topk), want)


# ------------------------------------------------------------------------------------------------- VSA-H3
@pytest.mark.parametrize("exempt", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_h3_selection_ties_lowest_index(exempt, seed):
    """select_h3 == _build_block_mask with CUDA topk's set (exactly k, ties to the lowest index) on tied scores,
    exempt and compete modes, prefix rows dense."""
    npre, nv = (3, 13) if seed != 2 else (0, 9)
    T = npre + nv
    s = _tied_scores(10 + seed, (2, 2, T, T), levels=2)
    if seed == 1:
        s[0, 0, 5] = torch.tensor([0.0, -0.0] * 8)[:T]                        # -0.0 ranks below +0.0 (radix keys)
    for sparsity in (0.5, 0.7, 0.85):
        k_vid = compute_topk(sparsity, nv)
        idx, num = vsa.select_h3(s, npre, nv, k_vid, exempt)
        got = fv.index_to_mask(idx, num, T)
        want = fv.h3_mask(s, npre, nv, sparsity, exempt)
        assert torch.equal(got, want), f"sparsity {sparsity}: {_diff(got, want)}"
        if k_vid < nv:
            budget = npre + k_vid if exempt else min(k_vid + npre, T)
            assert bool((num[:, :, npre:] == budget).all()) and bool((num[:, :, :npre] == T).all())


def test_h3_selection_is_device_independent_and_unaffected_by_cpu_topk_order():
    """All-tied rows: CPU torch.topk picks e.g. [12, 14, 13, 15] of 20; FastVideo (CUDA topk) the first k."""
    s = torch.zeros(1, 1, 21, 21)
    idx, num = vsa.select_h3(s, 1, 20, 4)
    assert idx[0, 0, 5, :5].tolist() == [0, 1, 2, 3, 4] and int(num[0, 0, 5]) == 5


# ------------------------------------------------------------------------------------------------- top-k count
SPARSITIES = [i / 100 for i in range(0, 101)] + [0.005, 0.125, 0.875, 0.955, 0.975, 0.999]


def test_compute_topk_matches_fastvideo_over_a_grid():
    """compute_topk == FastVideo's ceil((1 - sparsity) * n), unrounded, for n = 1..2000 and sparsities 0..1."""
    bad = [(s, n, compute_topk(s, n), fv.fv_compute_topk(s, n)) for s in SPARSITIES for n in range(1, 2001)
           if compute_topk(s, n) != fv.fv_compute_topk(s, n)]
    assert not bad, f"{len(bad)} (sparsity, n) points differ, e.g. {bad[:5]}"
    # the examples: FastVideo keeps 4 of 20 at 0.85; 0.9 of 30 is 3 (2.9999999999999996 -> 3)
    assert compute_topk(0.85, 20) == 4 and compute_topk(0.7, 10) == 4 and compute_topk(0.9, 30) == 3
    assert compute_topk(0.8, 660) == 132 and compute_topk(0.9, 660) == 66


def test_keep_percent_maps_to_fastvideo_sparsity_literal():
    """The node's keep_percent P gives FastVideo's VSA_sparsity as written, (100 - P) / 100 in decimal."""
    for i in range(1, 201):
        p = i / 2
        want = float((Decimal(100) - Decimal(str(p))) / Decimal(100))
        assert vsa_select.sparsity_from_keep_percent(p) == want, p
    assert vsa_select.sparsity_from_keep_percent(15.0) == 0.85


def test_runtime_count_uses_fastvideo_sparsity():
    """The H3 runtime's k: 20 video tiles at keep 15 % (sparsity 0.85) -> 4, as FastVideo."""
    prefix, grid = (10,), (4, 16, 20)                                   # 1 x 4 x 5 = 20 video tiles
    lay = build_h3_layout(prefix, grid)
    assert lay.num_video_tiles == 20
    rt = VSAH3Runtime(VSAH3Config(keep=0.15, sparsity=vsa_select.sparsity_from_keep_percent(15)))
    ctx = rt.begin_forward(prefix, grid, None)
    q = torch.zeros(1, 1, lay.seq_len, 16)
    rt.attention(q, q, q, ctx)
    assert rt.k_video == fv.fv_compute_topk(0.85, 20) == 4


# ------------------------------------------------------------------------------------------------- end to end
def _need(backend, dtype=torch.float32):
    need_triton(backend)
    if backend in ("cpu_batched", "cpu_native") and DEVICE != "cpu":
        pytest.skip(f"{backend} runs on CPU only")
    if backend == "cpu_native":
        from ditkit.kernels.block_sparse_cpu_native import load_extension

        try:
            load_extension()
        except RuntimeError as e:
            pytest.skip(f"cpu_native extension unavailable here: {e}")


def _tile_constant(rows_per_tile, vecs):
    """Token rows [sum(rows), D]: tile i repeats vecs[i] (so its pooled mean is vecs[i] exactly)."""
    return torch.cat([v.expand(r, -1) for r, v in zip(rows_per_tile, vecs)])


def _h3_tied_inputs(dtype):
    """Packed H3 q/k/v whose video key tiles fall in 3 groups of identical pooled keys: every query row has ties
    across the k-th boundary. Values are random, so picking another tied tile changes the output by O(1)."""
    prefix, grid = (20,), (8, 8, 8)                                     # 1 prefix tile + 8 video tiles
    lay = build_h3_layout(prefix, grid)
    B, H, D = 1, 2, 16
    g = _gen(7)
    tid = (lay.untile_index // 64).tolist()
    T = lay.n_tiles
    qv = torch.randint(-2, 3, (B, H, T, D), generator=g).float()
    groups = torch.randint(-2, 3, (B, H, 3, D), generator=g).float()
    kv = torch.randint(-2, 3, (B, H, T, D), generator=g).float()
    for t in range(lay.num_prefix_tiles, T):
        kv[:, :, t] = groups[:, :, t % 3]
    q = qv[:, :, tid]                                                  # each packed row = its tile's vector
    k = kv[:, :, tid]
    v = torch.randn(B, H, lay.seq_len, D, generator=g)
    return lay, q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def _h3_oracle(q, k, v, lay, sparsity):
    """float64 token-level SDPA with the mask of FastVideo's H3 rule (from-source re-implementation)."""
    B, H, S, D = q.shape
    tid = lay.untile_index // 64
    T = lay.n_tiles
    onehot = torch.zeros(T, S, dtype=torch.float64)
    onehot[tid, torch.arange(S)] = 1.0
    onehot /= onehot.sum(1, keepdim=True)
    qd, kd, vd = (x.double().cpu() for x in (q, k, v))
    sc = (onehot @ qd) @ (onehot @ kd).transpose(-1, -2) / math.sqrt(D)
    m = fv.h3_mask(sc, lay.num_prefix_tiles, lay.num_video_tiles, sparsity)
    return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=m[:, :, tid][:, :, :, tid]), m


H3_CASES = [(b, d) for b in ("reference", "cpu_batched", "cpu_native", "triton", "flex")
            for d in (torch.float32, torch.float16) if not (b == "cpu_native" and d != torch.float32)]


@pytest.mark.parametrize("backend,dtype", H3_CASES)
def test_vsa_h3_tied_tiles_end_to_end(backend, dtype):
    _need(backend, dtype)
    lay, q, k, v = _h3_tied_inputs(dtype)
    sparsity = 0.75                                                    # k = 2 of 8 video tiles
    out, st = vsa.vsa_h3_attention(q, k, v, lay, 0.25, backend=backend, sparsity=sparsity)
    want, m = _h3_oracle(q, k, v, lay, sparsity)
    assert st.backend == backend and st.k_video == 2
    torch.testing.assert_close(out.double().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


def _vsa_tied_inputs(dtype):
    """Tile-ordered q/k/v for video_sparse_attn: every query tile's pooled scores are
    [-20, 0.5, 2^-7, 2^-7, 2^-7, -1] (exact): FastVideo keeps 4 tiles at topk 2, torch.topk 2."""
    B, H, T, D = 1, 2, 6, 16
    vbs = torch.tensor([64, 64, 40, 64, 64, 17], dtype=torch.int32)
    rows = [64] * T
    e0 = torch.zeros(D)
    e0[0] = 1.0
    q = _tile_constant(rows, [e0] * T)
    kvecs = []
    for s in (-20.0, 0.5, 2**-7, 2**-7, 2**-7, -1.0):
        kv = torch.zeros(D)
        kv[0] = s * math.sqrt(D)
        kvecs.append(kv)
    k = _tile_constant(rows, kvecs)
    live = (torch.arange(64)[None] < vbs[:, None]).reshape(-1)
    q, k = q.expand(B, H, -1, -1).clone(), k.expand(B, H, -1, -1).clone()
    v = torch.randn(B, H, T * 64, D, generator=_gen(9))
    for x in (q, k, v):
        x[:, :, ~live] = 0
    return vbs, q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), live


VSA_CASES = [(b, d) for b in ("reference", "cpu_batched", "cpu_native", "triton", "flex")
             for d in (torch.float32, torch.float16) if not (b == "cpu_native" and d != torch.float32)]


@pytest.mark.parametrize("backend,dtype", VSA_CASES)
def test_video_sparse_attn_tied_tiles_end_to_end(backend, dtype):
    _need(backend, dtype)
    vbs, q, k, v, live = _vsa_tied_inputs(dtype)
    B, H, S, D = q.shape
    T = S // 64
    out = vsa.video_sparse_attn(q, k, v, vbs.to(DEVICE), vbs.to(DEVICE), 2, backend=backend)
    qd, kd, vd = (x.double().cpu().view(B, H, T, 64, D).sum(3) / vbs.double()[:, None] for x in (q, k, v))
    sc = (qd.to(q.dtype).double() @ kd.to(k.dtype).double().transpose(-1, -2)) / math.sqrt(D)
    m = fv.fused_topk_mask(sc.to(q.dtype), 2)
    assert m.sum(-1).unique().tolist() == [4], "the case must exercise FastVideo's more-than-k selection"
    mask = m.repeat_interleave(64, 2).repeat_interleave(64, 3) & live
    fine = torch.nn.functional.scaled_dot_product_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                                            attn_mask=mask)
    coarse = (torch.softmax(sc, -1) @ vd).repeat_interleave(64, 2)
    torch.testing.assert_close(out.double().cpu(), fine + coarse, atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)
