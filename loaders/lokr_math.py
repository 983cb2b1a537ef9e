"""LoKr math (plain torch): factor shapes, ΔW materialisation, Kronecker row-slice structure.

ΔW = kron(w1, w2) with w1 [out_l, in_m], w2 [out_k, in_n] (Linear) or w2 [out_k, in_n, k...] (conv).
Factors may be stored decomposed (w = a @ b) and w2 may carry a Tucker core t2 (conv layers).
Everything is computed in float32 or float64 from tensor shapes; factors are never re-inferred.
"""
from __future__ import annotations

import torch


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS ``factorization``: (m, n) with m * n == dimension, m <= n.

    factor > 0 dividing ``dimension`` -> (factor, dimension // factor) sorted; otherwise the divisor pair
    closest to sqrt(dimension) whose first value does not exceed ``factor`` (factor -1: no bound).
    Only used to *create* adapters (test files); loading trusts shapes.
    """
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (m, n) if m <= n else (n, m)
    if factor < 0:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
        length = m + n
    if m > n:
        m, n = n, m
    return m, n


def rebuild_w1(f: dict, dtype=torch.float32) -> torch.Tensor:
    if "lokr_w1" in f:
        return f["lokr_w1"].to(dtype)
    return f["lokr_w1_a"].to(dtype) @ f["lokr_w1_b"].to(dtype)


def rebuild_w2(f: dict, dtype=torch.float32) -> torch.Tensor:
    if "lokr_w2" in f:
        return f["lokr_w2"].to(dtype)
    a, b = f["lokr_w2_a"].to(dtype), f["lokr_w2_b"].to(dtype)
    if "lokr_t2" in f:
        # Tucker: t2 [r, r, k...], w2_a [r, out_k], w2_b [r, in_n] -> [out_k, in_n, k...]
        t2 = f["lokr_t2"].to(dtype).contiguous()
        return torch.einsum("ij...,jr,ip->pr...", t2, b, a).contiguous()
    if b.dim() > 2:  # conv without Tucker: w2_b [r, in_n, k...]
        return (a @ b.flatten(1)).reshape(a.shape[0], *b.shape[1:])
    return a @ b


def delta_weight(f: dict, target_shape, scale: float, dtype=torch.float32) -> torch.Tensor:
    """ΔW = scale * kron(w1, w2), reshaped to ``target_shape`` (contiguous inputs: torch.kron on a
    non-contiguous tensor fails on recent torch)."""
    w1 = rebuild_w1(f, dtype).contiguous()
    w2 = rebuild_w2(f, dtype).contiguous()
    if w2.dim() > w1.dim():
        w1 = w1.reshape(*w1.shape, *([1] * (w2.dim() - w1.dim())))
    d = torch.kron(w1, w2)
    return (d * scale).reshape(tuple(target_shape))


def add_delta_(weight: torch.Tensor, f: dict, scale: float, swap_halves: bool = False,
               function=None, max_chunk_elems: int = 1 << 22) -> torch.Tensor:
    """``weight += function(scale * kron(w1, w2))`` in place, one block of w1 rows at a time.

    Rows of kron(w1, w2) come in blocks of ``w2.shape[0]`` rows per row of w1, so the product is built
    and added ``max_chunk_elems`` elements at a time (fp32): the full ΔW is never held. Same products,
    same fp32 arithmetic as materialising it. Falls back to the full ΔW when the Kronecker shape differs
    from the weight's (a reshape) or rows must be permuted (``swap_halves``).
    """
    fn = function if function is not None else (lambda a: a)
    w1 = rebuild_w1(f).contiguous()
    w2 = rebuild_w2(f).contiguous()
    if w2.dim() > w1.dim():
        w1 = w1.reshape(*w1.shape, *([1] * (w2.dim() - w1.dim())))
    kshape = (w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1], *w2.shape[2:])
    if swap_halves or tuple(kshape) != tuple(weight.shape):
        d = (torch.kron(w1, w2) * scale).reshape(tuple(weight.shape))
        if swap_halves:
            n = d.shape[0] // 2
            d = torch.cat([d[n:], d[:n]], dim=0)
        weight += fn(d.to(weight.dtype))
        return weight
    out_k = w2.shape[0]
    per_w1_row = max(1, weight[:out_k].numel())
    step = max(1, max_chunk_elems // per_w1_row)
    for i0 in range(0, w1.shape[0], step):
        i1 = min(i0 + step, w1.shape[0])
        blk = torch.kron(w1[i0:i1].contiguous(), w2)
        blk.mul_(scale)
        weight[i0 * out_k:i1 * out_k] += fn(blk.to(weight.dtype))
    return weight
