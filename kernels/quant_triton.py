"""Triton kernels of the block formats (mxfp8, nvfp4): the same bits as the references in :mod:`.quant`.

Two kernels per weight, with the host's small per-block scale step between them in torch:

1. ``_block_amax_kernel``: the float32 amax of ``|x|`` of every 32 (mxfp8) / 16 (nvfp4) columns of every row,
   over the padded shape (rows and columns past the weight's read as 0, as the reference's zero padding);
2. the scale step (:func:`.quant._mxfp8_block_scales` / :func:`.quant._nvfp4_block_scales`, run by
   :func:`.quant.quantize_blocks_triton`, which drives the two launchers here): the very torch operations the
   reference runs, on the weight's device, on arrays 1/32 resp. 1/16 of the weight's size. The
   mxfp8 exponent is ``ceil(log2(.))`` of torch's ``log2``, which is *not* the exact ceiling for some values just
   above a power of two (3,676 float32 values of 16.6 M checked on this CPU): computing it in the kernel would be
   exact arithmetic, not the host's;
3. ``_mxfp8_encode_kernel`` / ``_nvfp4_encode_kernel``: divide each block by its scale, clamp, encode, and (nvfp4)
   pack two codes per byte, high nibble first; written straight into the padded output.

Exactness on every backend, the way the per-tensor kernel does it (:mod:`.quant`): the mxfp8 divisor is a power
of two ``2**k``, so the kernel multiplies by its exact reciprocal (``x * 2**-k`` and ``x / 2**k`` are the same
correctly rounded value); the nvfp4 divisor is arbitrary, so the kernel divides with ``tl.div_rn`` (IEEE round to
nearest; Triton's ``/`` on float32 may be approximate on a GPU); the fp8 code is formed from the float32 bits in
integer arithmetic with round-half-to-even; the e2m1 code from the same seven comparisons as
:func:`.quant.e2m1_codes` (no clamp first: the codes saturate). An all-zero block is marked by a NaN divisor
(a real one is never NaN) and gives +0.0 codes, as the reference's ``masked_fill``. Every ``index * stride`` is
int64 (:func:`._triton.offs64`).

Hand-made mutants of the kernels (``tests/unit/test_quant_block_triton.py``; mutmut cannot mutate inside
``@triton.jit``): 31 over the rounding, the thresholds, the masks, the padding, the packing and the scale
loads; 26 killed (two of them by the every-code test written for them), 5 equivalent: ``a <= 2**-6`` for
``a < 2**-6`` (both branches give code 8 there), the fp8 clamp to 447 (rounds to 448), ``-0.0`` for ``0.0`` in
the NaN-divisor ``where`` and dropping that ``where`` (``x / NaN`` is a +NaN, code 0), and dropping the clamp to
-6 before e2m1 (the clamp has since been removed).

This module imports nothing of :mod:`.quant` (which calls it). Non-finite weights are refused before the first
kernel (:class:`.quant.NonFiniteWeight`): the reference turns
them into NaN blocks that depend on the backend's NaN sign, which no loader wants; the streaming loaders pass
``finite=True`` anyway.
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, tl, triton

BLOCK_ROWS = 16
BLOCK_COLS = 128


if HAS_TRITON:
    from ._triton import offs64

    @triton.jit
    def _rne32(v):
        # round half to even of float32 values (exact; no reliance on the backend's rint)
        f = tl.floor(v)
        d = v - f
        odd = f - 2.0 * tl.floor(f * 0.5)
        return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))

    @triton.jit
    def _fp8_e4m3_code(y):
        # float32 values in [-448, 448] or NaN -> e4m3fn codes (int32), as torch's float32 -> float8_e4m3fn cast
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
        sub = _rne32(a * 512.0).to(tl.int32)            # below 2**-6: multiples of 2**-9
        code = tl.where(a < 0.015625, sub, normal)
        code = tl.where(y != y, 0x7F, code)
        sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
        return code | (sign << 7)

    @triton.jit
    def _e2m1_code(d):
        # float32 values in [-6, 6] -> e2m1 codes (int32) with the sign bit, as quant.e2m1_codes
        a = tl.abs(d)
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))
        sign = (d.to(tl.int32, bitcast=True) >> 31) & 1
        return code | (sign << 3)

    @triton.jit
    def _block_amax_kernel(X, A, rows, cols, prows, nblocks, sxr, sxc, sar,
                           BLK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(X + offs64(r, sxr)[:, None] + offs64(c, sxc)[None, :], mask=m, other=0.0).to(tl.float32)
        a = tl.max(tl.reshape(tl.abs(x), (BR, BC // BLK, BLK)), axis=2)
        b = tl.program_id(1) * (BC // BLK) + tl.arange(0, BC // BLK)
        tl.store(A + offs64(r, sar)[:, None] + b[None, :].to(tl.int64), a,
                 mask=(r[:, None] < prows) & (b[None, :] < nblocks))

    @triton.jit
    def _mxfp8_encode_kernel(X, M, OUT, rows, cols, prows, pcols, sxr, sxc, smr, sor,
                             BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        b = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
        x = tl.load(X + offs64(r, sxr)[:, None] + offs64(c, sxc)[None, :],
                    mask=(r[:, None] < rows) & (c[None, :] < cols), other=0.0).to(tl.float32)
        mult = tl.load(M + offs64(r, smr)[:, None] + b[None, :].to(tl.int64),
                       mask=(r[:, None] < prows) & (b[None, :] < pcols // 32), other=1.0)
        y = tl.reshape(x, (BR, BC // 32, 32)) * mult[:, :, None]
        y = tl.where((mult != mult)[:, :, None], 0.0, y)
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))     # NaN stays NaN, as torch.clamp
        code = tl.reshape(_fp8_e4m3_code(y), (BR, BC))
        tl.store(OUT + offs64(r, sor)[:, None] + c[None, :].to(tl.int64), code.to(tl.uint8),
                 mask=(r[:, None] < prows) & (c[None, :] < pcols))

    @triton.jit
    def _nvfp4_encode_kernel(X, T, OUT, rows, cols, prows, pcols, sxr, sxc, str_, sor,
                             BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        b = tl.program_id(1) * (BC // 16) + tl.arange(0, BC // 16)
        x = tl.load(X + offs64(r, sxr)[:, None] + offs64(c, sxc)[None, :],
                    mask=(r[:, None] < rows) & (c[None, :] < cols), other=0.0).to(tl.float32)
        t = tl.load(T + offs64(r, str_)[:, None] + b[None, :].to(tl.int64),
                    mask=(r[:, None] < prows) & (b[None, :] < pcols // 16), other=1.0)
        x3 = tl.reshape(x, (BR, BC // 16, 16))
        d = tl.div_rn(x3, tl.broadcast_to(t[:, :, None], (BR, BC // 16, 16)))
        d = tl.where((t != t)[:, :, None], 0.0, d)     # (x / NaN is a +NaN, code 0, too: explicit all the same)
        # no clamp to +-6: e2m1 saturates (every |d| > 5 is code 7) and keeps the sign, as the reference's finite path
        code = tl.reshape(_e2m1_code(d), (BR, BC // 2, 2))
        hi, lo = tl.split(code)
        byte = (hi << 4) | lo
        p = tl.program_id(1) * (BC // 2) + tl.arange(0, BC // 2)
        tl.store(OUT + offs64(r, sor)[:, None] + p[None, :].to(tl.int64), byte.to(tl.uint8),
                 mask=(r[:, None] < prows) & (p[None, :] < pcols // 2))


def _grid(prows: int, pcols: int, br: int, bc: int) -> tuple[int, int]:
    return (triton.cdiv(prows, br), triton.cdiv(pcols, bc))


def _check_tile(br: int, bc: int) -> None:
    if bc % 32 or br <= 0 or bc & (bc - 1) or br & (br - 1):
        raise ValueError(f"tile {br} x {bc}: powers of two, columns a multiple of 32")


def block_amax(w: torch.Tensor, block: int, prows: int, pcols: int,
               br: int = BLOCK_ROWS, bc: int = BLOCK_COLS) -> torch.Tensor:
    """Launcher: float32 ``[prows, pcols // block]`` amax of ``|w|`` per ``block`` columns over the zero-padded
    ``[prows, pcols]`` (``w`` 2-D, any strides; ``block`` 16 or 32)."""
    _need_triton()
    _check_tile(br, bc)
    rows, cols = w.shape
    if block not in (16, 32) or prows % block or pcols % block or prows < rows or pcols < cols:
        raise ValueError(f"block_amax: block {block}, padded shape {(prows, pcols)} for a {tuple(w.shape)} weight")
    a = torch.empty((prows, pcols // block), dtype=torch.float32, device=w.device)
    _block_amax_kernel[_grid(prows, pcols, br, bc)](w, a, rows, cols, prows, pcols // block, w.stride(0),
                                                  w.stride(1), a.stride(0), BLK=block, BR=br, BC=bc)
    return a


def encode_blocks(w: torch.Tensor, block: int, divisor: torch.Tensor, out: torch.Tensor,
                  br: int = BLOCK_ROWS, bc: int = BLOCK_COLS) -> torch.Tensor:
    """Launcher: encode ``w`` (2-D, any strides) into the padded ``out`` (uint8 view; unit column stride), each
    ``block`` columns of a row by its float32 ``divisor`` entry (``[prows, pcols // block]``; NaN marks an all-zero
    block). ``block`` 32: mxfp8, ``divisor`` holds the exact reciprocal of the power-of-two scale (multiplied),
    ``out`` ``[prows, pcols]`` fp8 codes; 16: nvfp4, ``divisor`` the block's divisor (``div_rn``), ``out``
    ``[prows, pcols // 2]`` packed e2m1 codes, high nibble first. -> ``out``."""
    _need_triton()
    _check_tile(br, bc)
    rows, cols = w.shape
    prows, nb = divisor.shape
    pcols = nb * block
    width = pcols if block == 32 else pcols // 2
    if block not in (16, 32) or prows < rows or pcols < cols or out.shape != (prows, width) \
            or out.dtype != torch.uint8 or out.stride(1) != 1 or divisor.dtype != torch.float32 \
            or divisor.stride(1) != 1:
        raise ValueError(f"encode_blocks: block {block}, divisor {tuple(divisor.shape)} {divisor.dtype}, out "
                         f"{tuple(out.shape)} {out.dtype} for a {tuple(w.shape)} weight")
    kernel = _mxfp8_encode_kernel if block == 32 else _nvfp4_encode_kernel
    kernel[_grid(prows, pcols, br, bc)](w, divisor, out, rows, cols, prows, pcols, w.stride(0), w.stride(1),
                                        divisor.stride(0), out.stride(0), BR=br, BC=bc)
    return out


def _need_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
