"""Block-sparse flash attention over selected 64x64 tiles (the VSA fine stage).

Contract (FastVideo ``block_sparse_attn_from_indices`` semantics, tile-ordered ``[B, H, S, D]`` tensors):

* ``S`` is a multiple of 64; tile ``t`` holds rows ``t*64 .. t*64+63``; only the first
  ``variable_block_sizes[t]`` rows of a tile are live (keys beyond are masked out, pad rows must be zero);
* query tile ``i`` of (b, h) attends the key tiles ``q2k_index[b, h, i, :q2k_num[b, h, i]]`` (int32, order
  free: order only changes fp rounding);
* returns ``(out, lse)`` with ``lse`` FastVideo's log2-domain ``M = log2(sum_j 2^(s_j * log2 e))`` per row, fp32
  ``[B, H, S]`` (``-inf`` and a zero output for a query tile with no key tile).
* scale = ``D ** -0.5``.

Backends: ``triton`` (sm80+, int64 offsets, P cast to the value dtype), ``flex`` (FlexAttention with a
BlockMask *and* a matching ``mask_mod``), ``reference`` (gather + SDPA per query tile, batched by key-tile
count; the CPU default), ``flashinfer`` (CuTe-DSL blk64 forward, sm100/sm120, D=128, bf16; untested here),
``comfy_kitchen`` (registered for the report: 0.2.31 has no index-driven block-sparse op).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, tl, triton
from .registry import REGISTRY, Impl, Query, need_cuda, package_available, triton_check

TILE = 64
LOG2E = 1.4426950408889634
OP = "block_sparse_attn"


# ---------------------------------------------------------------------------------------------------------
# reference: gather the selected key tiles and run SDPA, one batch per distinct key-tile count
def block_sparse_attn_reference(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True,
                                max_chunk_elems: int = 1 << 22):
    B, H, S, D = q.shape
    T = S // TILE
    Tk = k.shape[2] // TILE
    scale = D ** -0.5
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device) if need_lse else None
    lse_t = lse.view(B, H, T, TILE) if need_lse else None
    qt = q.reshape(B, H, T, TILE, D)
    # flat [B*H*Tk, 64*D] views make the tile gather one index_select
    kf = k.reshape(B * H * Tk, TILE * D)
    vf = v.reshape(B * H * Tk, TILE * D)
    vbs = variable_block_sizes.to(device=q.device, dtype=torch.long)
    key_live = torch.arange(TILE, device=q.device)[None, :] < vbs[:, None]     # [Tk, 64]
    all_live = bool(key_live.all())
    num = q2k_num.to(device=q.device, dtype=torch.long)
    idx_all = q2k_index.to(device=q.device, dtype=torch.long)
    ot = out.view(B, H, T, TILE, D)

    def attend(qq, kk, vv, live):
        """qq [N, M, D], kk/vv [N, L, D], live [N, L] or None -> (out, lse_log2 or None)."""
        if need_lse:
            s = torch.matmul(qq.float(), kk.float().transpose(1, 2)) * scale
            if live is not None:
                s = s.masked_fill(~live[:, None, :], float("-inf"))
            m = torch.logsumexp(s, dim=-1)                                      # natural log
            o = torch.matmul(torch.exp(s - m[..., None]), vv.float()).to(q.dtype)
            return o, m * LOG2E
        mask = None if live is None else live[:, None, None, :]
        return F.scaled_dot_product_attention(qq[:, None], kk[:, None], vv[:, None], attn_mask=mask)[:, 0], None

    full = torch.arange(Tk, device=q.device)
    for count in torch.unique(num).tolist():
        if count <= 0:
            continue
        bi, hi, ti = torch.nonzero(num == count, as_tuple=True)
        if count == Tk:
            # dense query tiles (e.g. H3 prefix rows): one big-M call per (b, h) on the un-gathered keys
            dense_rows = (idx_all[bi, hi, ti, :Tk].sort(dim=-1).values == full).all(dim=-1)
            for b, h in {(int(b_), int(h_)) for b_, h_ in zip(bi[dense_rows], hi[dense_rows])}:
                sel = ti[dense_rows & (bi == b) & (hi == h)]
                qq = qt[b, h, sel].reshape(1, -1, D)
                live = None if all_live else key_live.reshape(1, -1)
                o, m = attend(qq, k[b, h][None], v[b, h][None], live)
                ot[b, h, sel] = o.view(-1, TILE, D)
                if need_lse:
                    lse_t[b, h, sel] = m.view(-1, TILE)
            keep = ~dense_rows
            bi, hi, ti = bi[keep], hi[keep], ti[keep]
        per = count * TILE * D * 2 + count * TILE * TILE
        step = max(1, min(bi.numel(), max_chunk_elems // per))
        # reused gather buffers: fresh multi-MB allocations per chunk cost more in page faults than the copy
        kbuf = k.new_empty(step * count, TILE * D)
        vbuf = v.new_empty(step * count, TILE * D)
        for s0 in range(0, bi.numel(), step):
            b_, h_, t_ = bi[s0:s0 + step], hi[s0:s0 + step], ti[s0:s0 + step]
            idx = idx_all[b_, h_, t_, :count]                                   # [N, c]
            flat = (((b_ * H + h_) * Tk)[:, None] + idx).reshape(-1)
            n = flat.numel()
            kk = torch.index_select(kf, 0, flat, out=kbuf[:n]).view(-1, count * TILE, D)
            vv = torch.index_select(vf, 0, flat, out=vbuf[:n]).view(-1, count * TILE, D)
            live = None
            if not all_live:
                live = key_live[idx].reshape(-1, count * TILE)
                if bool(live.all()):
                    live = None
            o, m = attend(qt[b_, h_, t_], kk, vv, live)
            ot[b_, h_, t_] = o
            if need_lse:
                lse_t[b_, h_, t_] = m
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# triton: one program per (query tile, b*h); loops over its key tiles with an exp2 online softmax
if HAS_TRITON:
    from ._triton import offs64

    @triton.jit
    def _bsa_fwd_kernel(Q, K, V, O, LSE, IDX, NUM, VBS, H, qk_scale,
                        s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_os,
                        s_lb, s_lh, s_ib, s_ih, s_it, s_nb, s_nh,
                        D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        rows = offs64(t, BLOCK) + offs_m
        q_ptr = Q + offs64(b, s_qb) + offs64(h, s_qh) + offs64(rows, s_qs)[:, None] + offs_d[None, :]
        q = tl.load(q_ptr)
        k_base = K + offs64(b, s_kb) + offs64(h, s_kh)
        v_base = V + offs64(b, s_vb) + offs64(h, s_vh)
        n = tl.load(NUM + offs64(b, s_nb) + offs64(h, s_nh) + t)
        idx_ptr = IDX + offs64(b, s_ib) + offs64(h, s_ih) + offs64(t, s_it)
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, D], dtype=tl.float32)
        for _ in range(0, n):
            kb = tl.load(idx_ptr)
            idx_ptr += 1
            vb = tl.load(VBS + kb)
            cols = offs64(kb, BLOCK) + offs_m
            kT = tl.load(k_base + offs64(cols, s_ks)[None, :] + offs_d[:, None])        # [D, BLOCK]
            if IEEE:
                s = tl.dot(q, kT, input_precision="ieee")
            else:
                s = tl.dot(q, kT)
            s = s * qk_scale
            s = tl.where(offs_m[None, :] < vb, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + offs64(cols, s_vs)[:, None] + offs_d[None, :])         # [BLOCK, D]
            acc = acc * alpha[:, None]
            if IEEE:
                acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(vt.dtype), vt, acc)
            m_i = m_new
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        o_ptr = O + offs64(b, s_ob) + offs64(h, s_oh) + offs64(rows, s_os)[:, None] + offs_d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty))
        tl.store(LSE + offs64(b, s_lb) + offs64(h, s_lh) + rows, lse)


def block_sparse_attn_triton(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True):
    B, H, S, D = q.shape
    T = S // TILE
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    idx = q2k_index.to(device=q.device, dtype=torch.int32)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    num = q2k_num.to(device=q.device, dtype=torch.int32).contiguous()
    vbs = variable_block_sizes.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    _bsa_fwd_kernel[(T, B * H)](
        q, k, v, out, lse, idx, num, vbs, H, (D ** -0.5) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), idx.stride(0), idx.stride(1), idx.stride(2), num.stride(0), num.stride(1),
        D=D, BLOCK=TILE, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=3)
    return out, lse


def _triton_check(q: Query, explicit: bool):
    bad_hd = None if q.head_dim in (16, 32, 64, 128, 256) else f"head_dim must be one of 16/32/64/128/256 (got {q.head_dim})"
    return triton_check(q, explicit, HAS_TRITON, bad_hd)


# ---------------------------------------------------------------------------------------------------------
# flex: BlockMask from the index lists + a mask_mod that encodes the same selection and the ragged tiles
# (eager flex with only a BlockMask silently computes DENSE attention).
def _allowed_tiles(q2k_index, q2k_num, Tk):
    B, H, T, cap = q2k_index.shape
    num = q2k_num.long()
    slot_ok = torch.arange(cap, device=q2k_index.device)[None, None, None, :] < num[..., None]
    allowed = torch.zeros(B, H, T, Tk + 1, dtype=torch.bool, device=q2k_index.device)
    idx = torch.where(slot_ok, q2k_index.long(), torch.full_like(q2k_index, Tk, dtype=torch.long))
    allowed.scatter_(-1, idx, True)
    return allowed[..., :Tk].contiguous()


_FLEX_COMPILED = {}


def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    fn = _FLEX_COMPILED.get(device_type)
    if fn is None:
        fn = _FLEX_COMPILED[device_type] = torch.compile(flex_attention, dynamic=False)
    return fn


def build_flex_block_mask(q2k_index, q2k_num, variable_block_sizes, S, Sk):
    from torch.nn.attention.flex_attention import BlockMask

    B, H, T, cap = q2k_index.shape
    Tk = Sk // TILE
    allowed = _allowed_tiles(q2k_index, q2k_num, Tk)
    vbs = variable_block_sizes.to(device=q2k_index.device, dtype=torch.long)

    def mask_mod(b, h, q_idx, kv_idx):
        kt = kv_idx // TILE
        return allowed[b, h, q_idx // TILE, kt] & ((kv_idx % TILE) < vbs[kt])

    num = q2k_num.to(torch.int32).contiguous()
    ind = q2k_index.to(torch.int32)
    if cap == 0:  # flex needs at least one index slot
        ind = torch.zeros(B, H, T, 1, dtype=torch.int32, device=q2k_index.device)
    return BlockMask.from_kv_blocks(num, ind.contiguous(), BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(S, Sk))


def block_sparse_attn_flex(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True):
    S, Sk = q.shape[2], k.shape[2]
    bm = build_flex_block_mask(q2k_index, q2k_num, variable_block_sizes, S, Sk)
    fn = _flex_fn(q.device.type)
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = fn(q, k, v, block_mask=bm, scale=q.shape[-1] ** -0.5, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    except ImportError:  # older torch
        out, lse = fn(q, k, v, block_mask=bm, scale=q.shape[-1] ** -0.5, return_lse=True)
    lse = lse.float() * LOG2E
    # rows with no visible key: flex returns 0 / -inf already; keep the contract explicit
    return out, lse


def _flex_check(q: Query, explicit: bool):
    try:
        import torch.nn.attention.flex_attention as fa  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch FlexAttention unavailable ({type(e).__name__})"
    if q.device_type == "cpu":
        if explicit:
            return None
        return "on CPU eager FlexAttention materializes all scores; use it on explicit request only"
    if q.device_type != "cuda":
        return f"needs CUDA or an explicit CPU request (got {q.device_type})"
    return need_cuda(q, (8, 0))


# ---------------------------------------------------------------------------------------------------------
# flashinfer CuTe-DSL blk64 (SM100/103 bf16, SM120/121 bf16/fp16, D = 128). Not exercised on this machine.
_FI_MODULES = {(10, 0): "flashinfer.cute_dsl.sparse.bsa_attn_sm100", (10, 3): "flashinfer.cute_dsl.sparse.bsa_attn_sm100",
               (12, 0): "flashinfer.cute_dsl.sparse.bsa_attn_sm120", (12, 1): "flashinfer.cute_dsl.sparse.bsa_attn_sm120"}


def _flashinfer_check(q: Query, explicit: bool):
    if q.device_type != "cuda":
        return f"needs a CUDA device (got {q.device_type})"
    mod = _FI_MODULES.get(tuple(q.capability or ()))
    if mod is None:
        return f"FlashInfer blk64 block-sparse kernels exist for sm100/103/120/121 only (got {q.capability})"
    if q.head_dim != 128:
        return f"needs head_dim 128 (got {q.head_dim})"
    ok = (torch.bfloat16,) if q.capability[0] == 10 else (torch.bfloat16, torch.float16)
    if q.dtype not in ok:
        return f"needs {[str(d).replace('torch.', '') for d in ok]} (got {q.dtype})"
    if not package_available("flashinfer"):
        return "flashinfer is not installed"
    if not package_available(mod):
        return f"{mod} is not importable in the installed flashinfer"
    return None


def block_sparse_attn_flashinfer(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True):
    import importlib

    cap = tuple(torch.cuda.get_device_capability(q.device))
    mod = importlib.import_module(_FI_MODULES[cap])
    fwd = getattr(mod, "bsa_attn_sm100_blk64_fwd" if cap[0] == 10 else "bsa_attn_sm120_blk64_fwd")
    B, H, S, D = q.shape
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))                 # BSHD
    num = q2k_num.to(torch.int32).contiguous()
    idx = q2k_index.to(torch.int32).contiguous()
    out = torch.empty_like(qs)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    fwd(qs, ks, vs, idx, num, variable_block_sizes.to(torch.int32).contiguous(), num,
        softmax_scale=D ** -0.5, return_lse=True, out=out, lse=lse)
    return out.transpose(1, 2), lse * LOG2E


# ---------------------------------------------------------------------------------------------------------
def _comfy_kitchen_check(q: Query, explicit: bool):
    if not package_available("comfy_kitchen"):
        return "comfy_kitchen is not installed"
    import comfy_kitchen as ck

    try:
        from importlib.metadata import version

        ver = version("comfy-kitchen")
    except Exception:  # noqa: BLE001
        ver = getattr(ck, "__version__", "?")
    if not hasattr(ck, "sol_attn"):
        return (f"comfy_kitchen {ver} has no block-sparse attention op "
                "(its dense flash/sage/int8 attention cannot take a tile selection)")
    return ("comfy_kitchen.sol_attn selects its own tiles from int8-quantized scores; it has no index-driven "
            "entry point, so it cannot reproduce FastVideo's fp32 top-k selection")


REGISTRY.op(OP, block_sparse_attn_reference)
REGISTRY.impl(OP, Impl("triton", block_sparse_attn_triton if HAS_TRITON else None, _triton_check, priority=10))
REGISTRY.impl(OP, Impl("flashinfer", block_sparse_attn_flashinfer, _flashinfer_check, priority=5,
                       note="CuTe-DSL blk64 forward, sm100/103/120/121",
                       unverified="no sm100/sm120 device was available; the launcher follows FlashInfer's source"))
REGISTRY.impl(OP, Impl("flex", block_sparse_attn_flex, _flex_check, priority=20))
REGISTRY.impl(OP, Impl("comfy_kitchen", None, _comfy_kitchen_check, priority=30))


def dense_tile_index(B: int, H: int, T: int, Tk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index lists selecting every key tile (dense attention in block-sparse form)."""
    idx = torch.arange(Tk, device=device, dtype=torch.int32).expand(B, H, T, Tk).contiguous()
    num = torch.full((B, H, T), Tk, device=device, dtype=torch.int32)
    return idx, num
