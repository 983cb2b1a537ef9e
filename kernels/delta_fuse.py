"""Fused ``weight[rows] += scale * ΔW[row_map]`` for low-rank, Kronecker (LoKr), Hadamard (LoHa) and dense deltas.

ΔW is never materialised whole: the reference builds and adds it ``max_chunk_elems`` elements at a time (fp32
products, one rounding into the weight's dtype per chunk, the same arithmetic as building ΔW whole and adding it);
the Triton kernel forms each output tile in registers (fp32 accumulation) and adds it in place.

``row_map`` (optional, int64, one entry per row of ``weight``) says which row of ΔW lands on each row of the
weight: ``weight[i] += scale * ΔW[row_map[i]]``. It expresses the H3 qkv per-head de-interleave and the
diffusers SwiGLU half swap without a permuted copy of ΔW. Without it, row ``i`` gets ``ΔW[i]``.

Deltas (``weight`` is ``[n, cols]``, 2-D, rows contiguous):

* ``lowrank``: ``ΔW = up @ down`` (``up [m, r]``, ``down [r, cols]``)
* ``kron``:    ``ΔW = kron(w1, w2)`` (``w1 [a, b]``, ``w2 [p, q]``, ``b * q == cols``)
* ``hadamard``:``ΔW = (a1 @ b1) * (a2 @ b2)`` (LoHa)
* ``dense``:   ``ΔW = d`` (``.diff`` tensors)

Every ``index * stride`` product in the kernel is int64 (``_triton.offs64``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._triton import HAS_TRITON, tl, triton

DEFAULT_CHUNK_ELEMS = 1 << 22   # 4 Mi fp32 elements = 16 MiB per chunk
KINDS = ("lowrank", "kron", "hadamard", "dense")


def _rows_of(kind: str, parts: tuple) -> int:
    if kind == "lowrank":
        return parts[0].shape[0]
    if kind == "kron":
        return parts[0].shape[0] * parts[1].shape[0]
    if kind == "hadamard":
        return parts[0].shape[0]
    return parts[0].shape[0]


def _cols_of(kind: str, parts: tuple) -> int:
    if kind == "lowrank":
        return parts[1].shape[1]
    if kind == "kron":
        return parts[0].shape[1] * parts[1].shape[1]
    if kind == "hadamard":
        return parts[1].shape[1]
    return parts[0].shape[1]


def check(weight: torch.Tensor, kind: str, parts: tuple, row_map: Optional[torch.Tensor]) -> None:
    if kind not in KINDS:
        raise ValueError(f"delta kind {kind!r} is not one of {KINDS}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got {tuple(weight.shape)}")
    n, cols = weight.shape
    if _cols_of(kind, parts) != cols:
        raise ValueError(f"{kind} delta has {_cols_of(kind, parts)} columns, weight {cols}")
    m = _rows_of(kind, parts)
    if row_map is None:
        if m != n:
            raise ValueError(f"{kind} delta has {m} rows, weight {n} (no row map)")
    else:
        if row_map.dim() != 1 or row_map.numel() != n:
            raise ValueError(f"row map must hold one entry per weight row ({n}), got {tuple(row_map.shape)}")
        if n and (int(row_map.min()) < 0 or int(row_map.max()) >= m):
            raise ValueError(f"row map points outside the {m} delta rows")


def delta_rows(kind: str, parts: tuple, idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Rows ``idx`` of ΔW, in ``dtype`` (the only place ΔW values are formed in the reference)."""
    if kind == "lowrank":
        up, down = parts
        return up.index_select(0, idx).to(dtype) @ down.to(dtype)
    if kind == "kron":
        w1, w2 = parts
        p = w2.shape[0]
        a = w1.index_select(0, idx // p).to(dtype)
        b = w2.index_select(0, idx % p).to(dtype)
        return (a[:, :, None] * b[:, None, :]).reshape(idx.numel(), -1)
    if kind == "hadamard":
        a1, b1, a2, b2 = parts
        return (a1.index_select(0, idx).to(dtype) @ b1.to(dtype)) * (a2.index_select(0, idx).to(dtype) @ b2.to(dtype))
    return parts[0].index_select(0, idx).to(dtype)


def fuse_reference_(weight: torch.Tensor, kind: str, parts: tuple, scale: float,
                    row_map: Optional[torch.Tensor] = None, max_chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                    function=None) -> torch.Tensor:
    """``weight += function(scale * ΔW[row_map])`` in place, ``max_chunk_elems`` elements of ΔW at a time."""
    check(weight, kind, parts, row_map)
    n, cols = weight.shape
    dev = weight.device
    parts = tuple(p.to(dev) for p in parts)
    rmap = None if row_map is None else row_map.to(device=dev, dtype=torch.long)
    step = max(1, int(max_chunk_elems) // max(1, cols))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        idx = rmap[r0:r1] if rmap is not None else torch.arange(r0, r1, device=dev, dtype=torch.long)
        d = delta_rows(kind, parts, idx)
        d.mul_(float(scale))
        if function is not None:
            d = function(d)
        weight[r0:r1] += d.to(weight.dtype)
        del d
    return weight


# ---------------------------------------------------------------------------------------------------------
# triton
if HAS_TRITON:
    from ._triton import offs64

    @triton.jit
    def _fuse_kernel(W, P0, P1, P2, P3, MAP, n_rows, n_cols, rank, kp, kq, scale,
                     stride_w, stride_p0, stride_p1, stride_p2, stride_p3,
                     KIND: tl.constexpr, HAS_MAP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = offs64(pid_m, BM) + tl.arange(0, BM)
        cols = offs64(pid_n, BN) + tl.arange(0, BN)
        rmask = rows < n_rows
        cmask = cols < n_cols
        if HAS_MAP:
            src = tl.load(MAP + rows, mask=rmask, other=0)
        else:
            src = rows
        src = src.to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if KIND == 0:      # lowrank: up[src] @ down
            for k0 in range(0, rank, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < rank
                u = tl.load(P0 + offs64(src, stride_p0)[:, None] + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                d = tl.load(P1 + offs64(ks, stride_p1)[:, None] + cols[None, :],
                            mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(u[:, :, None] * d[None, :, :], axis=1)
        elif KIND == 1:    # kron: w1[src // p, c // q] * w2[src % p, c % q]
            r1 = src // kp
            r2 = src % kp
            c1 = cols // kq
            c2 = cols % kq
            m2 = rmask[:, None] & cmask[None, :]
            a = tl.load(P0 + offs64(r1, stride_p0)[:, None] + c1[None, :], mask=m2, other=0.0).to(tl.float32)
            b = tl.load(P1 + offs64(r2, stride_p1)[:, None] + c2[None, :], mask=m2, other=0.0).to(tl.float32)
            acc = a * b
        elif KIND == 2:    # hadamard: (a1[src] @ b1) * (a2[src] @ b2), both factors of the same rank
            acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, rank, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < rank
                mk = rmask[:, None] & kmask[None, :]
                mn = kmask[:, None] & cmask[None, :]
                u1 = tl.load(P0 + offs64(src, stride_p0)[:, None] + ks[None, :], mask=mk, other=0.0).to(tl.float32)
                d1 = tl.load(P1 + offs64(ks, stride_p1)[:, None] + cols[None, :], mask=mn, other=0.0).to(tl.float32)
                u2 = tl.load(P2 + offs64(src, stride_p2)[:, None] + ks[None, :], mask=mk, other=0.0).to(tl.float32)
                d2 = tl.load(P3 + offs64(ks, stride_p3)[:, None] + cols[None, :], mask=mn, other=0.0).to(tl.float32)
                acc += tl.sum(u1[:, :, None] * d1[None, :, :], axis=1)
                acc2 += tl.sum(u2[:, :, None] * d2[None, :, :], axis=1)
            acc = acc * acc2
        else:              # dense
            acc = tl.load(P0 + offs64(src, stride_p0)[:, None] + cols[None, :],
                          mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        wptr = W + offs64(rows, stride_w)[:, None] + cols[None, :]
        m = rmask[:, None] & cmask[None, :]
        w = tl.load(wptr, mask=m, other=0.0).to(tl.float32)
        # one rounding into the weight dtype, as the reference: round(scale*delta) first, then the add
        dd = (acc * scale).to(W.dtype.element_ty).to(tl.float32)
        tl.store(wptr, (w + dd).to(W.dtype.element_ty), mask=m)


_KIND_ID = {"lowrank": 0, "kron": 1, "hadamard": 2, "dense": 3}


def fuse_triton_(weight: torch.Tensor, kind: str, parts: tuple, scale: float,
                 row_map: Optional[torch.Tensor] = None, block_m: int = 32, block_n: int = 32,
                 block_k: int = 16) -> torch.Tensor:
    """Same contract as :func:`fuse_reference_` (no ``function``): one pass over the weight, no ΔW buffer."""
    if not HAS_TRITON:  # pragma: no cover - guarded by callers
        raise RuntimeError("triton is not installed")
    check(weight, kind, parts, row_map)
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous (stride(1) == 1)")
    n, cols = weight.shape
    dev = weight.device
    ps = [p.to(dev).contiguous() for p in parts]
    while len(ps) < 4:
        ps.append(ps[0])
    rank = ps[0].shape[1] if kind in ("lowrank", "hadamard") else 0
    if kind == "hadamard" and (ps[2].shape[1] != rank or ps[3].shape[0] != rank):
        raise ValueError("hadamard factors of different ranks")
    kp = ps[1].shape[0] if kind == "kron" else 1
    kq = ps[1].shape[1] if kind == "kron" else 1
    rmap = row_map.to(device=dev, dtype=torch.int64).contiguous() if row_map is not None else ps[0]
    grid = (triton.cdiv(n, block_m), triton.cdiv(cols, block_n))
    _fuse_kernel[grid](weight, ps[0], ps[1], ps[2], ps[3], rmap, n, cols, rank, kp, kq, float(scale),
                       weight.stride(0), ps[0].stride(0), ps[1].stride(0), ps[2].stride(0), ps[3].stride(0),
                       KIND=_KIND_ID[kind], HAS_MAP=row_map is not None, BM=block_m, BN=block_n, BK=block_k)
    return weight


def fuse_(weight: torch.Tensor, kind: str, parts: tuple, scale: float, row_map: Optional[torch.Tensor] = None,
          function=None, max_chunk_elems: int = DEFAULT_CHUNK_ELEMS, backend: str = "auto") -> str:
    """Dispatch: Triton on CUDA weights (when installed, no ``function``), else the chunked reference.
    Returns the backend that ran (for reports)."""
    use_triton = backend == "triton" or (backend == "auto" and HAS_TRITON and weight.is_cuda and function is None
                                         and weight.stride(1) == 1)
    if use_triton:
        fuse_triton_(weight, kind, parts, scale, row_map)
        return "triton"
    fuse_reference_(weight, kind, parts, scale, row_map, max_chunk_elems, function)
    return "reference"


# ---------------------------------------------------------------------------------------------------------
# quantized weights: dequantize -> add -> requantize with the same scheme, in row chunks
PER_TENSOR_FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise")


@dataclass(frozen=True)
class Delta:
    """One delta onto a (quantized) weight: ``weight[rows] += scale * ΔW[row_map]`` (``rows`` None: the whole
    weight; ``kind`` / ``parts`` / ``row_map`` as for :func:`fuse_`)."""
    kind: str
    parts: tuple
    scale: float
    row_map: Optional[torch.Tensor] = None
    rows: Optional[tuple[int, int]] = None


def delta_sum_rows(deltas, r0: int, r1: int, cols: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Rows ``r0:r1`` of ``sum(delta.scale * ΔW)`` over ``deltas``, each placed at its own row slice, in ``dtype``
    (only the rows asked for are formed)."""
    out = torch.zeros((r1 - r0, cols), dtype=dtype, device=device)
    for d in deltas:
        a, b = d.rows if d.rows is not None else (0, None)
        n = _rows_of(d.kind, d.parts) if d.row_map is None else d.row_map.numel()
        b = a + n if b is None else b
        o0, o1 = max(r0, a), min(r1, b)
        if o0 >= o1:
            continue
        parts = tuple(p.to(device) if device is not None else p for p in d.parts)
        idx = torch.arange(o0 - a, o1 - a, dtype=torch.long, device=device)
        if d.row_map is not None:
            idx = d.row_map.to(device=idx.device, dtype=torch.long)[idx]
        rows = delta_rows(d.kind, parts, idx, dtype).reshape(o1 - o0, -1)
        out[o0 - r0:o1 - r0] += rows.mul_(float(d.scale))
        del rows
    return out


def check_deltas(deltas, rows: int, cols: int) -> None:
    """Every delta fits a ``[rows, cols]`` weight at its row slice (``ValueError`` naming the first that does not)."""
    for d in deltas:
        if d.kind not in KINDS:
            raise ValueError(f"delta kind {d.kind!r} is not one of {KINDS}")
        n = _rows_of(d.kind, d.parts) if d.row_map is None else d.row_map.numel()
        a, b = d.rows if d.rows is not None else (0, rows)
        if _cols_of(d.kind, d.parts) != cols or b - a != n or not 0 <= a < b <= rows:
            raise ValueError(f"{d.kind} delta [{n}, {_cols_of(d.kind, d.parts)}] does not fit rows {a}:{b} of a "
                             f"[{rows}, {cols}] weight")


def requantize_fuse(data: torch.Tensor, scales: dict, fmt: str, shape: tuple[int, int], deltas,
                    max_chunk_elems: int = DEFAULT_CHUNK_ELEMS, source_dtype=torch.float32, backend: str = "auto"
                    ) -> tuple[torch.Tensor, dict, int, str]:
    """A per-tensor quantized weight ``(data, scales)`` plus ``deltas`` -> ``(new data, new scales, chunks)``: the
    weight is dequantized, the deltas added and the result requantized with the same scheme, one row chunk at a
    time (two passes: the new per-tensor amax first, then the codes), with ``kernels/quant.requantize_add``.

    Each chunk is formed in float64 (``data * scale`` is exact there, ΔW rows are float64 products) and rounded
    once to ``source_dtype`` before the deterministic round-to-nearest quantize, so the result equals quantizing
    ``(float64 dequantize + float64 ΔW).to(source_dtype)`` whole, bit for bit, without the whole ΔW or the whole
    float weight ever existing. Block formats (mxfp8, nvfp4) are refused (``ValueError``). The codes pass runs the
    Triton quantize kernel where :func:`fuse` would run its kernel (``backend="auto"``: triton installed and the
    weight on CUDA), else the reference; returns ``(new data, new scales, chunks, backend that ran)``."""
    from . import quant

    if backend not in ("auto", "reference", "triton"):
        raise ValueError(f"backend {backend!r}: 'auto', 'reference' or 'triton'")
    if backend == "auto":
        backend = "triton" if HAS_TRITON and data.is_cuda else "reference"
    if fmt not in PER_TENSOR_FORMATS:
        raise ValueError(f"{fmt}: the chunked requantize covers the per-tensor formats {PER_TENSOR_FORMATS} only")
    rows, cols = shape
    check_deltas(deltas, rows, cols)
    chunk_rows = max(1, int(max_chunk_elems) // max(1, cols))
    new, new_scales = quant.requantize_add(
        data, scales, fmt, (rows, cols),
        lambda r0, r1: delta_sum_rows(deltas, r0, r1, cols, torch.float64, data.device),
        dtype=source_dtype, chunk_rows=chunk_rows, work_dtype=torch.float64, backend=backend)
    return new, new_scales, len(quant.requantize_spans(rows, chunk_rows)), backend
