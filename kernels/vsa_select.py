"""Top-k key-tile selection for VSA and VSA-H3: FastVideo's rules, implemented once (plain torch).

Every ditkit backend (``reference``, ``triton``, ``flex``, ``cpu_batched``, ``cpu_native``, ...) runs only the
*fine* stage on index lists; the lists come from the functions here, so all backends select the same tiles.

Rule VSA -- ``fastvideo_kernel.video_sparse_attn`` (fastvideo-kernel 0.3.5, ``python/fastvideo_kernel/ops.py::
video_sparse_attn`` calls ``triton_kernels/fused_compress_topk.py::fused_topk_mask``), per row of the pooled
scores ``s = q_c @ k_cᵀ / sqrt(D)`` (``q_c``/``k_c``: fp32 sum of each tile's rows / its true size, stored in the
input dtype; pad rows are zero, so a partial tile competes with the mean of its live rows; no tile is masked):

1. ``k = min(topk, n_kv_tiles)`` (the caller's ``topk`` is used as given; FastVideo's backends compute it with
   ``compute_topk``, below).
2. ``next_power_of_2(n_kv_tiles) > 4096`` (``MAX_KV_BLOCK_SIZE``): ``torch.topk(scores, k)`` on the GPU
   (``_pytorch_topk_mask_fallback``) -- the rule VSA-H3 below.
3. otherwise ``_fused_topk_mask_kernel``, one program per row, all arithmetic in fp32: ``x = fp32(s)``;
   ``lo = min`` of the finite ``x`` (``+inf`` if none), ``hi = max(x)``, ``lo = min(lo, hi)``; 32 times:
   ``mid = (lo + hi) * 0.5``, ``c = #{x >= mid}``, ``c >= k`` -> ``lo = mid`` else ``hi = mid``. With
   ``t = lo``: select every ``x > t`` plus the first (lowest-index) ``k - #{x > t}`` entries with ``x == t``
   (``tl.cumsum`` over ``x == t`` in index order). This is *not* "exactly k": when the bisection has not reached
   the k-th value (``t`` below it: range/2^32 coarser than the value's fp32 spacing, e.g. a k-th score near 0
   in a row spanning several units, or ties at the row maximum), every entry above ``t`` is selected, tied ones
   included -- more than ``k``; with fewer than ``k`` finite scores only the finite ones are selected (``-inf``
   never, unless the whole row is ``-inf``: then the first ``k``). NaN scores are outside the rule (they cannot
   arise from live tiles).

Rule VSA-H3 -- FastVideo ``fastvideo/attention/backends/video_sparse_attn_h3.py::_build_block_mask``
(hao-ai-lab/FastVideo @ 2f3d407), on fp32 scores (``_pool_tiles``: fp32 sum / true tile size, ``q̄ k̄ᵀ /
sqrt(D)``):

* ``k_vid = compute_topk(VSA_sparsity, num_video_tiles)``; ``k_vid == num_video_tiles`` -> every tile pair.
* exempt mode (default) or no prefix: ``topk(k_vid)`` over the video columns of every row, plus every prefix
  column; compete mode: ``topk(min(k_vid + num_prefix, n_tiles))`` over all columns. Prefix query rows: all.
* ``torch.topk`` runs on CUDA there. Its selected *set* (the mask only uses the set) is: every value strictly
  above the k-th largest, then the equal values in index order until k are taken ("choose the first seen set",
  ``pytorch aten/src/ATen/native/cuda/TensorTopK.cu::gatherTopK``, single-block and multi-block ``mbtopk``
  paths alike). Values compare as their radix keys (``TopKTypeConfig<float>::convert``): ``-0.0 < +0.0``, NaN
  above everything. So: exactly k, ties to the lowest index. CPU ``torch.topk`` breaks ties in no fixed order,
  which is why ditkit never calls it for a selection.

Count -- ``fastvideo/attention/backends/video_sparse_attn.py::compute_topk``:
``max(1, min(ceil((1 - sparsity) * num_blocks), num_blocks))`` on the double, unrounded: at sparsity 0.7
``(1 - 0.7) * 10 = 3.0000000000000004`` keeps 4 of 10, at 0.9 ``(1 - 0.9) * 30 = 2.9999999999999996`` keeps 3.
"""
from __future__ import annotations

import math

import torch

INT32_MAX = 2**31 - 1
FUSED_TOPK_MAX_BLOCKS = 4096          # fused_compress_topk.MAX_KV_BLOCK_SIZE
BISECTION_STEPS = 32


def compute_topk(sparsity: float, num_blocks: int) -> int:
    """FastVideo ``compute_topk``: ``clamp(ceil((1 - sparsity) * num_blocks), 1, num_blocks)``, no rounding
    (0 for no blocks, where FastVideo's clamp would give 1)."""
    if num_blocks <= 0:
        return 0
    return max(1, min(math.ceil((1 - float(sparsity)) * num_blocks), int(num_blocks)))


def sparsity_from_keep_percent(keep_percent: float) -> float:
    """FastVideo's ``VSA_sparsity`` for "keep P % of the video tiles": ``(100 - P) / 100``, on the node's 0.5 %
    grid the double nearest to that decimal (``0.85`` for 15 %, what a FastVideo user writes; ``1 - P/100`` is an ulp off for 80 of the 200 half-percent
    steps, which moves ``compute_topk`` at 489 (P, n <= 2000) points)."""
    return (100.0 - float(keep_percent)) / 100.0


def _radix_key(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered like CUDA topk's radix keys of the fp32 values (-0.0 < +0.0, NaN largest)."""
    xf = x.float().contiguous()
    bits = xf.view(torch.int32)
    key = torch.where(bits < 0, bits ^ INT32_MAX, bits)
    return torch.where(torch.isnan(xf), torch.full_like(key, INT32_MAX), key)


def _above_plus_first_ties(x: torch.Tensor, t: torch.Tensor, k: int) -> torch.Tensor:
    """``x > t`` plus the lowest-index ``k - #{x > t}`` entries with ``x == t``, per row (``t``: ``[..., 1]``)."""
    above = x > t
    ge = above | (x == t)
    cnt = ge.sum(dim=-1, dtype=torch.int32)
    over = cnt > k                                   # rows with more ties than places: cut them in index order
    if not bool(over.any()):
        return ge
    rows = over.nonzero(as_tuple=True)
    at = x[rows] == t[rows]
    ab = above[rows]
    need = k - ab.sum(dim=-1, keepdim=True, dtype=torch.int32)
    ge[rows] = ab | (at & (at.cumsum(dim=-1, dtype=torch.int32) <= need))
    return ge


def exact_topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of CUDA ``torch.topk``'s set along the last dim: the k largest, ties to the lowest index."""
    n = scores.shape[-1]
    k = max(0, min(int(k), n))
    if k == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    x = scores.float()
    kth = x.topk(k, dim=-1).values[..., -1:]          # the k-th largest VALUE: unique, whatever the tie order
    if bool(torch.isnan(kth).any()) or bool((kth == 0).any()):
        # a zero k-th value (where -0.0 < +0.0 matters) or NaN: compare the radix keys themselves
        x = _radix_key(x)
        kth = x.topk(k, dim=-1).values[..., -1:]
    return _above_plus_first_ties(x, kth, k)


def fused_topk_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Bool mask of FastVideo ``fused_topk_mask(scores, topk)`` (rule VSA above), same shape as ``scores``.

    The kernel's 32-step bisection is replayed exactly (same fp32 ``lo``/``hi``/``mid`` sequence); the counts
    ``#{x >= mid}`` are read off each row sorted once instead of recounted per step."""
    shape = scores.shape
    n = shape[-1]
    k = min(int(topk), n)
    if 1 << max(0, (n - 1).bit_length()) > FUSED_TOPK_MAX_BLOCKS:
        return exact_topk_mask(scores, k)
    x = scores.float().reshape(-1, n)
    srt = x.sort(dim=-1).values                       # ascending; -inf first
    inf = torch.full((srt.shape[0], 1), float("inf"), device=x.device)
    first_finite = torch.searchsorted(srt, -inf, side="right")          # index of the first value > -inf
    lo = torch.cat([srt, inf], dim=-1).gather(-1, first_finite)[:, 0]   # min over x > -inf (+inf if none)
    hi = srt[:, -1]
    lo = torch.minimum(lo, hi)
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) * 0.5                         # fp32 tensors: fp32 add and multiply, as in the kernel
        c = n - torch.searchsorted(srt, mid[:, None], side="left")[:, 0]   # #{x >= mid}
        ge = c >= k
        lo = torch.where(ge, mid, lo)
        hi = torch.where(ge, hi, mid)
    return _above_plus_first_ties(x, lo[:, None], k).reshape(shape)


def h3_block_mask(scores: torch.Tensor, num_prefix_tiles: int, num_video_tiles: int, k_vid: int,
                  exempt: bool = True) -> torch.Tensor:
    """FastVideo ``_build_block_mask`` (rule VSA-H3) as a bool ``[B, H, T, T]`` map, for a given ``k_vid``."""
    T = scores.shape[-1]
    npre = int(num_prefix_tiles)
    if k_vid >= num_video_tiles:
        return torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if exempt or npre == 0:
        mask[..., npre:] = exact_topk_mask(scores[..., npre:], k_vid)
        mask[..., :npre] = True
    else:
        mask = exact_topk_mask(scores, min(k_vid + npre, T))
    mask[..., :npre, :] = True
    return mask


def mask_to_index(mask: torch.Tensor, chunk_elems: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[..., Tq, Tk]`` -> int32 key-tile lists ``[..., Tq, Tk]`` (the selected tiles ascending, then the
    others ascending) and int32 counts ``[..., Tq]``: the ``q2k_index`` / ``q2k_num`` contract of every fine-stage
    backend. Each row is a permutation written by one deterministic scatter, in row chunks of about
    ``chunk_elems`` entries (the int64 scatter index is 8 bytes an entry)."""
    Tk = mask.shape[-1]
    if mask.numel() == 0:
        return (torch.empty(mask.shape, dtype=torch.int32, device=mask.device),
                torch.zeros(mask.shape[:-1], dtype=torch.int32, device=mask.device))
    flat = mask.reshape(-1, Tk)
    idx = torch.empty(flat.shape, dtype=torch.int32, device=mask.device)
    num = torch.zeros(flat.shape[0], dtype=torch.int32, device=mask.device)
    j = torch.arange(Tk, dtype=torch.int32, device=mask.device)
    step = max(1, chunk_elems // Tk)
    for r0 in range(0, flat.shape[0], step):
        m = flat[r0:r0 + step]
        cs = m.cumsum(dim=-1, dtype=torch.int32)                # selected tiles up to and including j
        n = cs[:, -1:]
        slot = torch.where(m, cs - 1, n + j - cs)
        idx[r0:r0 + step].scatter_(-1, slot.long(), j.expand(m.shape))
        num[r0:r0 + step] = n[:, 0]
    return idx.view(mask.shape), num.view(mask.shape[:-1])
