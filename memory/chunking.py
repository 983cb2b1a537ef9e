"""Exact activation chunking: a row-independent function (a DiT feed-forward: fc1 -> SwiGLU/GELU -> fc2) applied to
token chunks, written into one preallocated output.

Every output row of a feed-forward depends on its own input row only, so running it on row chunks gives the same
numbers when each chunk's GEMMs reduce in the same order as the whole call's. Measured on CPU (MKL / oneDNN,
``tests/unit/test_memory_chunking.py``): bf16 and fp16 are bit-identical for every chunk; fp32 is bit-identical
single-threaded when every chunk has >= 16 rows (MKL takes a different kernel for a handful of rows), so the plan
rounds the chunk down to a multiple of :data:`ROW_ALIGN` and folds a short tail into the previous chunk. Multi-
threaded fp32 GEMM may split the whole call differently from a chunk (measured difference in docs/memory.md).

The peak of a chunked call is ``input + output + chunk intermediates`` instead of ``input + output + whole
intermediates`` (:mod:`ditkit.memory.model` counts both).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import DitKitError

ROW_ALIGN = 16          # chunk sizes are multiples of this; no chunk (the tail included) is shorter


class ChunkSizeError(DitKitError):
    """A chunk size that is not a positive whole number of tokens."""


def check_chunk(chunk, name: str = "chunk_tokens") -> int:
    """``chunk`` as a positive int, or a :class:`ChunkSizeError` naming ``name`` (bools, floats, zero, negatives)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise ChunkSizeError(f"{name} must be a whole number of tokens, got {chunk!r} ({type(chunk).__name__})")
    if chunk <= 0:
        raise ChunkSizeError(f"{name} must be > 0 tokens, got {chunk} (0 / negative sizes have no chunking meaning; "
                             "to switch chunking off do not install it)")
    return chunk


def plan_chunks(rows: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` covering ``range(rows)``: chunks of ``chunk`` rounded down to a multiple of
    :data:`ROW_ALIGN` (at least ROW_ALIGN); a tail shorter than ROW_ALIGN joins the chunk before it. One span when
    the whole fits one chunk."""
    chunk = check_chunk(chunk)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ChunkSizeError(f"rows must be an int >= 0, got {rows!r}")
    step = max(ROW_ALIGN, chunk - chunk % ROW_ALIGN)
    if rows <= step:
        return [(0, rows)]
    spans = [(a, min(a + step, rows)) for a in range(0, rows, step)]
    if spans[-1][1] - spans[-1][0] < ROW_ALIGN:
        tail = spans.pop()
        spans[-1] = (spans[-1][0], tail[1])
    return spans


def apply_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int, dim: int | None = None
               ) -> torch.Tensor:
    """``fn(x)`` computed on token chunks along ``dim`` (default: the second-to-last axis, the token axis of
    ``[S, D]`` and ``[B, S, D]``), each chunk's result written into one output allocated once."""
    if x.dim() < 2:
        raise ChunkSizeError(f"apply_rows needs a [.., tokens, features] tensor, got shape {tuple(x.shape)}")
    d = x.dim() - 2 if dim is None else dim % x.dim()
    spans = plan_chunks(int(x.shape[d]), chunk)
    if len(spans) == 1:
        return fn(x)
    a, b = spans[0]
    first = fn(x.narrow(d, a, b - a))
    shape = list(first.shape)
    shape[d] = x.shape[d]
    out = first.new_empty(shape)
    out.narrow(d, a, b - a).copy_(first)
    del first
    for a, b in spans[1:]:
        out.narrow(d, a, b - a).copy_(fn(x.narrow(d, a, b - a)))
    return out


def auto_chunk(rows: int, inter_bytes_per_row: int, budget_bytes: int) -> int:
    """The largest chunk (a multiple of ROW_ALIGN, at most ``rows`` rounded up) whose intermediates
    (``inter_bytes_per_row`` per token) fit ``budget_bytes``; ROW_ALIGN when even that does not fit (the caller's
    memory check then refuses)."""
    if inter_bytes_per_row <= 0:
        raise ChunkSizeError(f"inter_bytes_per_row must be > 0, got {inter_bytes_per_row}")
    fit = int(max(0, budget_bytes) // inter_bytes_per_row)
    fit -= fit % ROW_ALIGN
    whole = -(-max(int(rows), 1) // ROW_ALIGN) * ROW_ALIGN
    return max(ROW_ALIGN, min(fit, whole))
