"""``flex`` block-sparse attention backend: torch FlexAttention with a BlockMask built from the index lists *and* a
``mask_mod`` that encodes the same selection and the ragged tiles (eager flex with only a BlockMask silently computes
DENSE attention). Contract and reference: :mod:`.block_sparse`. CUDA sm80+ (compiled), CPU on explicit request.
"""
from __future__ import annotations

import torch

from .block_sparse import LOG2E, OP, TILE, _allowed_tiles
from .registry import REGISTRY, Impl, Query, need_cuda

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


REGISTRY.impl(OP, Impl("flex", block_sparse_attn_flex, _flex_check, priority=20))
