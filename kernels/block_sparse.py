"""Block-sparse flash attention over selected 64x64 tiles (the VSA fine stage).

Contract (FastVideo ``block_sparse_attn_from_indices`` semantics, tile-ordered ``[B, H, S, D]`` tensors):

* ``S`` is a multiple of 64; tile ``t`` holds rows ``t*64 .. t*64+63``; only the first
  ``variable_block_sizes[t]`` rows of a tile are live (keys beyond are masked out, pad rows must be zero);
* query tile ``i`` of (b, h) attends the key tiles ``q2k_index[b, h, i, :q2k_num[b, h, i]]`` (int32, order
  free: order only changes fp rounding);
* returns ``(out, lse)`` with ``lse`` FastVideo's log2-domain ``M = log2(sum_j 2^(s_j * log2 e))`` per row, fp32
  ``[B, H, S]`` (``-inf`` and a zero output for a query tile with no key tile).
* scale = ``D ** -0.5``.

This module: the contract, the pure-torch ``reference`` (gather + SDPA per query tile, batched by key-tile count)
and the op's registration. One backend per file beside it, each with its capability check, launcher and (for
Triton) its ``torch.library`` custom op: ``block_sparse_triton.py`` (sm80+, int64 offsets, P cast to the value
dtype), ``block_sparse_flex.py`` (FlexAttention with a BlockMask *and* a matching ``mask_mod``),
``block_sparse_flashinfer.py`` (CuTe-DSL blk64 forward, sm100/sm120, D=128, bf16; never run),
``block_sparse_comfy_kitchen.py`` (registered for the report: 0.2.31 has no index-driven block-sparse op),
``block_sparse_cpu.py`` (``cpu_batched``) and ``block_sparse_cpu_native.py`` (``cpu_native``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import REGISTRY

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


def _allowed_tiles(q2k_index, q2k_num, Tk):
    B, H, T, cap = q2k_index.shape
    num = q2k_num.long()
    slot_ok = torch.arange(cap, device=q2k_index.device)[None, None, None, :] < num[..., None]
    allowed = torch.zeros(B, H, T, Tk + 1, dtype=torch.bool, device=q2k_index.device)
    idx = torch.where(slot_ok, q2k_index.long(), torch.full_like(q2k_index, Tk, dtype=torch.long))
    allowed.scatter_(-1, idx, True)
    return allowed[..., :Tk].contiguous()


REGISTRY.op(OP, block_sparse_attn_reference)


def dense_tile_index(B: int, H: int, T: int, Tk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index lists selecting every key tile (dense attention in block-sparse form)."""
    idx = torch.arange(Tk, device=device, dtype=torch.int32).expand(B, H, T, Tk).contiguous()
    num = torch.full((B, H, T), Tk, device=device, dtype=torch.int32)
    return idx, num
