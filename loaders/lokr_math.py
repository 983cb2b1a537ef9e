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


def kron_rows_aligned(w1_rows: int, w2_rows: int, start: int, stop: int) -> bool:
    """Is row range [start, stop) of kron(w1, w2) itself one Kronecker product kron(w1[a:b], w2)?"""
    del w1_rows
    return start % w2_rows == 0 and stop % w2_rows == 0
