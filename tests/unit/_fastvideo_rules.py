"""FastVideo's VSA tile-selection rules, re-written for the tests from FastVideo's source (not from ditkit's).

Deliberately plain and slow: one row at a time, Python loops, numpy float32 scalars for the kernel's fp32
arithmetic. Sources:

* ``fused_topk_row``: fastvideo-kernel 0.3.5 ``triton_kernels/fused_compress_topk.py`` (``fused_topk_mask``,
  ``_fused_topk_mask_kernel``), used by ``ops.py::video_sparse_attn``;
* ``cuda_topk_row``: the set ``torch.topk`` returns on CUDA (``aten/src/ATen/native/cuda/TensorTopK.cu``,
  ``gatherTopK``: values above the k-th, then equal ones in index order; radix-key comparison);
* ``h3_mask``: ``fastvideo/attention/backends/video_sparse_attn_h3.py::_build_block_mask`` (FastVideo 2f3d407);
* ``fv_compute_topk``: ``fastvideo/attention/backends/video_sparse_attn.py::compute_topk``.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import torch


def fv_compute_topk(sparsity: float, num_blocks: int) -> int:
    return max(1, min(math.ceil((1 - sparsity) * num_blocks), num_blocks))


def _radix(v: float) -> int:
    """TopKTypeConfig<float>::convert as a signed order: the fp32 bits, negatives mirrored (-0.0 < +0.0)."""
    if v != v:
        return 2**31
    b = struct.unpack("<i", struct.pack("<f", float(v)))[0]
    return b if b >= 0 else -(b & 0x7FFFFFFF) - 1


def cuda_topk_row(row, k: int) -> set:
    vals = [float(np.float32(x)) for x in row]
    order = sorted(range(len(vals)), key=lambda j: (-_radix(vals[j]), j))
    return set(order[:k])


def fused_topk_row(row, topk: int) -> set:
    x = [np.float32(v) for v in row]
    n = len(x)
    k = min(topk, n)
    kv_block = 1 << max(0, (n - 1).bit_length())        # triton.next_power_of_2
    if kv_block > 4096:
        return cuda_topk_row(row, k)                     # _pytorch_topk_mask_fallback (torch.topk on the GPU)
    finite = [v for v in x if v > -np.inf]
    lo = min(finite) if finite else np.float32(np.inf)
    hi = max(x)
    lo = min(lo, hi)
    half = np.float32(0.5)
    for _ in range(32):
        mid = np.float32((lo + hi) * half)
        if sum(1 for v in x if v >= mid) >= k:
            lo = mid
        else:
            hi = mid
    n_needed = k - sum(1 for v in x if v > lo)
    sel, at_seen = set(), 0
    for j, v in enumerate(x):
        if v > lo:
            sel.add(j)
        elif v == lo:
            at_seen += 1
            if at_seen <= n_needed:
                sel.add(j)
    return sel


def rows_to_mask(scores: torch.Tensor, row_fn) -> torch.Tensor:
    """Apply a per-row rule (-> set of selected columns) to every row of ``scores`` [..., Tk]."""
    flat = scores.detach().cpu().double().reshape(-1, scores.shape[-1])
    m = torch.zeros(flat.shape, dtype=torch.bool)
    for i in range(flat.shape[0]):
        for j in row_fn(flat[i].tolist()):
            m[i, j] = True
    return m.reshape(scores.shape)


def fused_topk_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    return rows_to_mask(scores, lambda r: fused_topk_row(r, topk))


def h3_mask(scores: torch.Tensor, num_prefix: int, num_video: int, sparsity: float, exempt: bool = True):
    T = scores.shape[-1]
    k_vid = fv_compute_topk(sparsity, num_video)
    if k_vid == num_video:
        return torch.ones(scores.shape, dtype=torch.bool)
    if exempt or num_prefix == 0:
        vid = rows_to_mask(scores[..., num_prefix:], lambda r: cuda_topk_row(r, k_vid))
        m = torch.cat([torch.ones(*scores.shape[:-1], num_prefix, dtype=torch.bool), vid], dim=-1)
    else:
        m = rows_to_mask(scores, lambda r: cuda_topk_row(r, min(k_vid + num_prefix, T)))
    m[..., :num_prefix, :] = True
    return m


def index_to_mask(idx: torch.Tensor, num: torch.Tensor, Tk: int) -> torch.Tensor:
    """Bool map of ``q2k_index`` / ``q2k_num`` lists (what a fine-stage backend will attend)."""
    idx, num = idx.cpu().long(), num.cpu().long()
    m = torch.zeros(*idx.shape[:-1], Tk, dtype=torch.bool)
    flat_i, flat_n, flat_m = idx.reshape(-1, idx.shape[-1]), num.reshape(-1), m.reshape(-1, Tk)
    for r in range(flat_i.shape[0]):
        sel = flat_i[r, : int(flat_n[r])]
        assert sel.unique().numel() == sel.numel(), "a key tile listed twice"
        flat_m[r, sel] = True
    return m
