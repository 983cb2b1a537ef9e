"""``triton`` block-sparse attention backend: private ``@triton.jit`` kernel, launcher, ``torch.library`` custom op.

One program per (query tile, b*h); it loops over its key tiles with an exp2 online softmax (FastVideo's
log2-domain lse). Contract and reference: :mod:`.block_sparse`. sm80+ CUDA; on CPU only under ``TRITON_INTERPRET=1``
on explicit request (tests). Every ``index * stride`` product is int64 (:func:`._triton.offs64`). The registry
entry calls the custom op ``ditkit::bsa_fwd_triton`` (its fake implementation lets ``torch.compile`` trace it).
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, existing_custom_op, tl, triton
from .block_sparse import LOG2E, OP, TILE
from .registry import REGISTRY, Impl, Query, triton_check

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


def _define_op():
    op = existing_custom_op("bsa_fwd_triton")
    if op is not None:   # defined by an earlier import of the pack (ComfyUI's folder name vs ``ditkit``)
        return op

    @torch.library.custom_op("ditkit::bsa_fwd_triton", mutates_args=())
    def bsa_fwd_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q2k_index: torch.Tensor,
                       q2k_num: torch.Tensor, variable_block_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = block_sparse_attn_triton(q, k, v, q2k_index, q2k_num, variable_block_sizes)
        return o, lse

    @bsa_fwd_triton.register_fake
    def _(q, k, v, q2k_index, q2k_num, variable_block_sizes):
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    return torch.ops.ditkit.bsa_fwd_triton


CUSTOM_OP = _define_op() if HAS_TRITON else None


def block_sparse_attn_triton_op(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True):
    """The registry's ``triton`` entry: the launcher through the custom op."""
    return CUSTOM_OP(q, k, v, q2k_index, q2k_num, variable_block_sizes)


REGISTRY.impl(OP, Impl("triton", block_sparse_attn_triton_op if HAS_TRITON else None, _triton_check, priority=10))
