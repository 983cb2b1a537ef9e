"""Host tensors for weights that outlive the loop that makes them: each in its own anonymous memory map.

Why (measured, ``benchmarks/bench_quantize.py`` and docs/quantize.md): a loader that reads, converts and quantizes
one tensor at a time mixes two kinds of allocation on the C heap: short-lived working copies (the bf16 bytes read,
float32 slices) and long-lived results (the quantized weights kept for the model). glibc serves a request below its
*dynamic* mmap threshold from the heap, and raises that threshold to the size of every mapped block it frees (up to
32 MiB on 64-bit): after the first freed tensor, every tensor below 32 MiB comes from the heap. A kept result then
lands in the hole a freed working copy left, the rest of the hole is split again by the next tensor, and the heap
ends up with as many free bytes as live ones, all still resident (a generated H3 of 312 MiB loaded as fp8:
164 MiB of weights, 318 MiB of free-but-resident heap at the end of the read, 475 MiB RSS growth). Placing each
kept tensor in its own mapping keeps the heap to the working copies of one tensor (reused from one tensor to
the next), and the mapping is returned to the system as soon as the tensor is freed.

:func:`empty` is ``torch.empty`` on the CPU for tensors of at least :data:`MIN_BYTES`; smaller ones (scales,
markers, norms) come from ``torch.empty`` as usual. The tensor owns its mapping (freed with the last view of it);
dtype, shape, strides and values are those of ``torch.empty``: what the tensor holds is unchanged, only where its
bytes live.
"""
from __future__ import annotations

import math
import mmap

import torch

MIN_BYTES = 256 << 10
# A private anonymous mapping (not ``mmap.mmap(-1, n)``'s default MAP_SHARED, which is shmem-backed: its page faults
# cost 1.6x more, measured 0.99 vs 1.63 GB/s filling 44 MB), its pages made at once where the system can
# (MAP_POPULATE: 1.89 GB/s; every byte of a tensor made here is written straight after, so nothing is wasted).
MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def _map(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=MAP_FLAGS)


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; of at least ``MIN_BYTES``: backed by its own anonymous mapping."""
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    buf = _map(nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


class Scratch:
    """One reused buffer for tensors that live until the next one is made (a streaming reader's source tensors that
    the quantizer consumes at once): :meth:`take` returns a view of it, grown (a new mapping) when a request is
    larger than any before. Reading a weight into memory that already has its pages costs no page faults: a fresh
    buffer per tensor was a third of a quantizing load (measured, docs/quantize.md "Speed"). A tensor taken here is
    overwritten by the next :meth:`take`: only for a consumer that is done with it before asking for the next."""

    def __init__(self):
        self._buf: torch.Tensor | None = None
        self.grown = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None                                   # the old mapping goes before the new one comes
            self._buf = torch.frombuffer(_map(nbytes), dtype=torch.uint8)
            self.grown += 1
        return self._buf[:nbytes].view(dtype).reshape(shape)

    def release(self) -> None:
        self._buf = None


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, t.dtype)


def adopt(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is small (or not on the CPU), else a mapped contiguous copy of it: for a kept result
    that a torch op allocated on the heap (the heap copy is freed with the caller's last reference)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES:
        return t
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


_TRIM = None


def _malloc_trim():
    global _TRIM
    if _TRIM is None:
        _TRIM = False
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim"):
                fn = libc.malloc_trim
                fn.argtypes = [ctypes.c_size_t]
                fn.restype = ctypes.c_int
                _TRIM = fn
        except OSError:  # pragma: no cover - no C library to load
            _TRIM = False
    return _TRIM


def release_free_heap() -> bool:
    """Give the free pages inside the C heap back to the system (glibc ``malloc_trim(0)``, which also releases
    free pages between live blocks); -> whether it ran (False where the C library is not glibc). Called by the
    streaming loaders after each converted tensor: the working copies of the tensor just done leave holes that
    later, smaller results and torch's own bookkeeping split, so without it the heap keeps growing by about one
    block's working copies per transformer block (measured: +20 MiB resident per block of a hidden-1024 H3)."""
    fn = _malloc_trim()
    if not fn:
        return False
    fn(0)
    return True
