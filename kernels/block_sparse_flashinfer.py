"""``flashinfer`` block-sparse attention backend: FlashInfer's CuTe-DSL blk64 forward (SM100/103 bf16, SM120/121
bf16/fp16, D = 128). Contract and reference: :mod:`.block_sparse`. Never run on any hardware (no such device was
available): registered ``unverified``, so ``auto`` never picks it and an explicit choice is reported as such.
"""
from __future__ import annotations

import torch

from .block_sparse import LOG2E, OP
from .registry import REGISTRY, Impl, Query, package_available

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


REGISTRY.impl(OP, Impl("flashinfer", block_sparse_attn_flashinfer, _flashinfer_check, priority=5,
                       note="CuTe-DSL blk64 forward, sm100/103/120/121",
                       unverified="no sm100/sm120 device was available; the launcher follows FlashInfer's source"))
