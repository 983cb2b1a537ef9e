"""Weight quantization into ComfyUI's native ``comfy_quant`` formats: pure-torch references, a Triton kernel for
the per-tensor formats (the block formats' kernels are in :mod:`.quant_triton`), and the small dequantize /
requantize helpers LoRA-style adapters need.

Formats (the names are the keys of ComfyUI's ``comfy/quant_ops.py`` ``QUANT_ALGOS``; what one checkpoint layer
holds is what ComfyUI's ``comfy/ops.py`` ``_load_quantized_module`` reads and ``_quantized_weight_state_dict``
writes):

=================  ============================  ==========================================  =====================
format             ``<layer>.weight``            ``<layer>.weight_scale``                    ``.weight_scale_2``
=================  ============================  ==========================================  =====================
float8_e4m3fn      float8_e4m3fn ``[out, in]``   float32 0-d, ``amax / 448``                 -
float8_e5m2        float8_e5m2 ``[out, in]``     float32 0-d, ``amax / 57344``               -
int8_tensorwise    int8 ``[out, in]``            float32 0-d, ``max(amax / 127, 1e-30)``     -
mxfp8              float8_e4m3fn, rows/cols      float8_e8m0fnu per 32 columns, cuBLAS        -
                   padded to multiples of 32     "blocked" layout ``[roundup(R,128), roundup(C/32,4)]``
nvfp4              uint8 (two e2m1 per byte,     float8_e4m3fn per 16 columns, blocked        float32 0-d,
                   high nibble first), padded    ``[roundup(R,128), roundup(C/16,4)]``         ``amax / (448*6)``
                   to multiples of 16
=================  ============================  ==========================================  =====================

plus ``<layer>.comfy_quant``: uint8 bytes of ``json.dumps({"format": name})``.

Every reference below reproduces, operation for operation, the deterministic (``stochastic_rounding=0``) path
of the host's own layout ``quantize`` with ``scale="recalculate"`` (what ComfyUI itself uses when it requantizes
a patched weight, ``comfy/ops.py``), including the dtype each step runs in: the fp8 product ``x * (1/scale)`` and
the int8 quotient ``x / scale`` are rounded to the *source* dtype (bf16 / fp16) before clamping, the nvfp4
per-tensor scale is divided in the source dtype. ``tests/integration/test_quant_host.py`` checks this
bit-for-bit against ``QuantizedLayout.quantize`` of the real host; ``tests/unit/test_quant.py`` against math
written in the test.

One documented difference: an all-zero tensor. The host's "recalculate" scale is 0 there and its fp8 / nvfp4
paths divide by it (the stored weight becomes NaN). Here the scale is then 1.0, which is what the host's
``quantize`` does when called with ``scale=1.0`` (fp8: all-zero codes, nvfp4: zero blocks), so the file stays
finite and dequantizes to exact zeros; int8 and mxfp8 never divide by zero and match the host as is.

Activation scales (``input_scale``) are never produced: weight-only quantization (ComfyUI then computes in the
compute dtype, or quantizes activations dynamically where its kernels do).

Adapters (dequantize -> add a delta -> requantize with the same scheme) use :func:`quantize`,
:func:`dequantize` and :func:`requantize_add`; the latter works in row chunks and equals quantizing the whole
updated weight at once, bit for bit.
"""
from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ._triton import HAS_TRITON, tl, triton

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
FP4_E2M1_MAX = 6.0
INT8_MAX = 127.0


@dataclass(frozen=True)
class Format:
    name: str                  # the QUANT_ALGOS key
    storage: torch.dtype       # dtype of <layer>.weight in the file
    block: int                 # columns per scale (0 = one scale per tensor)
    pad: int                   # rows / cols padded to a multiple of this (0 = none)
    bits: int                  # bits per weight element (scales not counted)


FORMATS: dict[str, Format] = {
    "float8_e4m3fn": Format("float8_e4m3fn", torch.float8_e4m3fn, 0, 0, 8),
    "float8_e5m2": Format("float8_e5m2", torch.float8_e5m2, 0, 0, 8),
    "int8_tensorwise": Format("int8_tensorwise", torch.int8, 0, 0, 8),
    "mxfp8": Format("mxfp8", torch.float8_e4m3fn, 32, 32, 8),
    "nvfp4": Format("nvfp4", torch.uint8, 16, 16, 4),
}
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown quantization format {name!r}; known: {sorted(FORMATS)}") from None


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def storage_layout(shape: tuple[int, ...], fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what a ``[out, in]`` weight becomes (key suffixes ``weight``, ``weight_scale``,
    ``weight_scale_2``), from the shape alone: a file header can be written before any tensor is quantized."""
    f = get_format(fmt)
    if len(shape) != 2:
        raise ValueError(f"{fmt}: quantized weights are 2-D, got shape {list(shape)}")
    r, c = shape
    if f.block == 0:
        return {"weight": ((r, c), f.storage), "weight_scale": ((), torch.float32)}
    pr, pc = _roundup(r, f.pad), _roundup(c, f.pad)
    scales = ((_roundup(pr, 128), _roundup(pc // f.block, 4)),
              torch.float8_e8m0fnu if fmt == "mxfp8" else torch.float8_e4m3fn)
    if fmt == "mxfp8":
        return {"weight": ((pr, pc), f.storage), "weight_scale": scales}
    return {"weight": ((pr, pc // 2), f.storage), "weight_scale": scales, "weight_scale_2": ((), torch.float32)}


def quantized_nbytes(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes of the weight and its scales in ``fmt`` (padding included)."""
    out = 0
    for s, dt in storage_layout(shape, fmt).values():
        out += math.prod(s) * torch.empty((), dtype=dt).element_size()
    return out


# ------------------------------------------------------------------------------------ cuBLAS block-scale layout

def to_blocked(m: torch.Tensor) -> torch.Tensor:
    """[R, C] scales -> cuBLAS 1D-block-scaling layout ``[roundup(R,128), roundup(C,4)]`` (zero padded): each
    128 x 4 tile is stored as 32 rows of 16, row ``i`` holding tile rows ``i, i+32, i+64, i+96`` (4 values each)."""
    r, c = m.shape
    pr, pc = _roundup(r, 128), _roundup(c, 4)
    p = m.new_zeros((pr, pc))
    p[:r, :c] = m
    if p.element_size() == 1:       # the 4 values of a tile row move together: as one int32, a quarter of the moves
        t = p.view(torch.int32).reshape(pr // 128, 4, 32, pc // 4).permute(0, 3, 2, 1)   # [rt, ct, 32, 4 groups]
        return t.reshape(pr, pc // 4).view(p.dtype)
    tiles = p.reshape(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)          # [rt, ct, 128, 4]
    tiles = tiles.reshape(pr // 128, pc // 4, 4, 32, 4).permute(0, 1, 3, 2, 4)  # [rt, ct, 32, 4(row group), 4]
    return tiles.reshape(pr, pc)


def from_blocked(b: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`, cropped to ``[rows, cols]``."""
    pr, pc = _roundup(rows, 128), _roundup(cols, 4)
    t = b.reshape(pr // 128, pc // 4, 32, 4, 4).permute(0, 1, 3, 2, 4)          # [rt, ct, 4, 32, 4]
    t = t.reshape(pr // 128, pc // 4, 128, 4).permute(0, 2, 1, 3).reshape(pr, pc)
    return t[:rows, :cols]


# ------------------------------------------------------------------------------------------------ references

def _check_source(w: torch.Tensor, fmt: str) -> None:
    if w.dtype not in SOURCE_DTYPES:
        raise ValueError(f"{fmt}: source weights must be float32 / bfloat16 / float16, got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"{fmt}: quantized weights are 2-D, got shape {list(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{fmt}: an empty weight (shape {list(w.shape)}) has no scale to quantize with")


def _amax_abs(w: torch.Tensor) -> torch.Tensor:
    """``torch.amax(w.abs())`` (a 0-d tensor of ``w``'s dtype) from one ``torch.aminmax`` pass: ``max(|min|, |max|)``
    is the same exact value, and no full-size ``abs`` copy is made (NaN propagates: a NaN anywhere gives NaN, an
    Inf gives Inf, which is how :func:`quantize` ``finite=True`` sees a non-finite weight)."""
    if w.numel() == 0:
        return torch.amax(w.abs())
    mn, mx = torch.aminmax(w)
    return torch.maximum(mn.abs(), mx.abs())


def per_tensor_scale(w: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 0-d ``weight_scale`` (``weight_scale_2`` for nvfp4) the host computes with "recalculate"
    (1.0 for an all-zero fp8 / nvfp4 tensor, see the module doc). ``amax``: ``w``'s :func:`_amax_abs` when the
    caller has it already."""
    if amax is None:
        amax = _amax_abs(w)
    if fmt in ("float8_e4m3fn", "float8_e5m2"):
        dt = torch.float8_e4m3fn if fmt == "float8_e4m3fn" else torch.float8_e5m2
        amax = amax.to(torch.float32)
        if amax == 0:
            return torch.ones((), dtype=torch.float32, device=w.device)
        scale = amax / torch.finfo(dt).max
        if w.dtype not in (torch.float32, torch.bfloat16):
            fi = torch.finfo(w.dtype)
            scale = 1.0 / torch.clamp(1.0 / scale, min=fi.min, max=fi.max)
        return scale
    if fmt == "int8_tensorwise":
        return (amax.float() / INT8_MAX).clamp(min=1e-30)
    if fmt == "nvfp4":
        s = (amax / (FP8_E4M3_MAX * FP4_E2M1_MAX)).to(torch.float32)
        return torch.ones((), dtype=torch.float32, device=w.device) if amax == 0 else s
    raise ValueError(f"{fmt} has no per-tensor weight scale")


def _fp8_ref(w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    dt, lp = (torch.float8_e4m3fn, FP8_E4M3_MAX) if fmt == "float8_e4m3fn" else (torch.float8_e5m2, FP8_E5M2_MAX)
    t = w * (1.0 / scale).to(w.dtype)
    return torch.clamp(t, -lp, lp).to(dt)


def _int8_scale_math(scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    s = scale.to(w.dtype)
    return torch.where(s == 0, torch.full_like(s, torch.finfo(w.dtype).tiny), s)


def _int8_ref(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / _int8_scale_math(scale, w)).round().clamp(-128.0, 127.0).to(torch.int8)


def _pad_to(w: torch.Tensor, m: int) -> torch.Tensor:
    r, c = w.shape
    pr, pc = _roundup(r, m), _roundup(c, m)
    if (pr, pc) == (r, c):
        return w
    return torch.nn.functional.pad(w, (0, pc - c, 0, pr - r))


def _blocks_f32(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x.float() as [rows, cols/block, block], the float32 amax of |x| per block)``: the same values as
    ``torch.amax(torch.abs(x_blocks), -1).float()`` (the conversion to float32 is monotonic and the maximum is a
    selection). On the CPU the amax is the integer maximum of the float32 copy's magnitude bits (the sign bit
    cleared): for non-negative floats the integer order is the value order, NaN above +Inf, so a NaN stays a NaN
    and -0.0 is 0. torch's int32 reduction over a 16-wide inner dimension runs at 2.7 G elements/s on this CPU,
    float32's at 0.7 G and bf16's at 1.2 G (measured). The float32 copy and the magnitudes are per-thread buffers
    reused from one slice to the next (no allocation, no page faults): the returned block view is overwritten by
    the next call."""
    rows, cols = x.shape
    if x.device.type != "cpu":
        f = x.to(torch.float32, copy=True)     # a copy even of a float32 x: it is divided in place
        return f.view(rows, cols // block, block), torch.amax(f.abs().view(rows, cols // block, block), dim=-1)
    f = _work_f32("blk", x)
    f.copy_(x)
    mag = _work_int("mag", x.numel())
    torch.bitwise_and(f.view(-1).view(torch.int32), 0x7FFFFFFF, out=mag)
    amax = torch.amax(mag.view(rows, cols // block, block), dim=-1).view(torch.float32)
    return f.view(rows, cols // block, block), amax


def _mxfp8_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded rows -> (fp8 data, written into ``out`` when given; unswizzled uint8 E8M0 exponents [rows, cols/32]).

    The zero-block ``where`` and the clamp run only where they can change a value (a block with amax 0; a block
    whose ``amax / scale`` exceeds 448, from the small per-block arrays: division by the positive scale and
    rounding are monotonic, so no element of a block exceeds its amax's quotient); the bits are the same. On the
    CPU in row groups (:data:`GROUP_ELEMS`), each group its own such decisions (a clamp that changes no value in a
    group changes no bit)."""
    rows, cols = x.shape
    if x.device.type != "cpu":
        return _mxfp8_group(x, out)
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    step = _group_rows(rows, cols)
    if step >= rows:
        return _mxfp8_group(x, out)
    e8 = torch.empty((rows, cols // 32), dtype=torch.uint8)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        e8[r0:r1] = _mxfp8_group(x[r0:r1], out[r0:r1])[1]
    return out, e8


def _mxfp8_group(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    f, amax = _blocks_f32(x, 32)
    e8, s, zero, any_zero = _mxfp8_block_scales(amax)
    d = f.div_(s.unsqueeze(-1))
    if any_zero:
        d.masked_fill_(zero.unsqueeze(-1), 0.0)
    if not bool((amax.float() / s).amax() <= FP8_E4M3_MAX):
        d.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    if out is None:
        out = d.reshape(rows, cols).to(torch.float8_e4m3fn)
    else:
        out.copy_(d.reshape(rows, cols))
    return out, e8


def _mxfp8_block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The host's mxfp8 scale step on the float32 block amaxes: ``(stored uint8 E8M0 exponents (0 for an all-zero
    block), the float32 divisor per block (1.0 for an all-zero block), the all-zero mask, whether any block is
    all zero)``. Shared by the reference and the Triton path, so both run the same torch operations (the
    ``ceil(log2(.))`` here is torch's ``log2``, which is not the exact ceiling near powers of two: the host's)."""
    need = torch.clamp(amax.float() / FP8_E4M3_MAX, min=2.0 ** -127)
    e = torch.clamp(torch.ceil(torch.log2(need)).to(torch.int32) + 127, 0, 254)
    e8 = e.to(torch.uint8)
    s = torch.where(e == 0, torch.zeros_like(e), e << 23).view(torch.float32)
    zero = amax == 0
    any_zero = bool(zero.any())
    if any_zero:
        s = torch.where(zero, torch.ones_like(s), s)
        e8 = torch.where(zero, torch.zeros_like(e8), e8)
    return e8, s, zero, any_zero


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 values in [-6, 6] -> 4-bit e2m1 codes (uint8), round to nearest, ties to the even code; the sign
    bit is kept (also for values that round to zero)."""
    a = v.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_bits_lut() -> torch.Tensor:
    """:func:`e2m1_codes` as a function of a float32's bits: entry ``2 * (bits >> 21) + (bits & 0x1FFFFF != 0)``
    (sign, exponent and the top two mantissa bits; whether any lower bit is set). Every threshold of e2m1_codes
    (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has a zero in the 21 low bits, so no threshold lies strictly between two
    floats with the same top 11 bits and a nonzero rest: the code is constant there, and is computed here by
    e2m1_codes itself on one representative of each of the 4096 classes (the sign bit, -0.0 included, comes with)."""
    hi = torch.arange(2048, dtype=torch.int64) << 21
    reps = torch.stack([hi, hi | 1], 1).reshape(-1)
    reps = torch.where(reps >= 1 << 31, reps - (1 << 32), reps).to(torch.int32).view(torch.float32)
    return e2m1_codes(reps)


_E2M1_BITS_LUT = _e2m1_bits_lut()


def _work_int(slot: str, n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A 1-D integer CPU tensor of ``n`` elements from a per-thread buffer (as :func:`_work_f32`; one per slot and
    dtype)."""
    key = f"{slot}_{dtype}"
    buf = getattr(_WORK, key, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        setattr(_WORK, key, buf)
    return buf[:n]


def _e2m1_codes_bits_(b: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`e2m1_codes` of the float32 values whose bits are the 1-D contiguous int32 CPU tensor ``b``, written
    into ``out`` (uint8, ``b``'s size) through the table of :func:`_e2m1_bits_lut`; ``idx`` (int32, same size) is
    a work buffer and ``b`` is overwritten (its low bits become the "any lower bit set" flag). Five int32 passes
    in place, then one lookup into ``out``: no allocation, two buffers live instead of three."""
    # 2 * (b >> 21) + (b & 0x1FFFFF != 0) == (b >> 20) | (b & 0xFFFFF != 0): bit 20 is the low bit of b >> 20;
    # the & 0xFFF maps the arithmetic shift of a negative b to the table's sign half
    torch.bitwise_right_shift(b, 20, out=idx)
    b.bitwise_and_(0xFFFFF).ne_(0)
    idx.bitwise_or_(b).bitwise_and_(0xFFF)
    return torch.index_select(_E2M1_BITS_LUT, 0, idx, out=out)


def _e2m1_codes_finite(v: torch.Tensor) -> torch.Tensor:
    """:func:`e2m1_codes` of float32 values in [-6, 6] from one lookup of their bits (:func:`_e2m1_bits_lut`): five
    int32 passes and a 4096-entry table instead of signbit, abs, seven comparisons and their copies (2.6 s of a
    1 GB nvfp4 load before, measured). The same codes: tested on every one of the 4096 classes at its ends and
    inside, and on every threshold and its neighbours. (The name is historical: NaN and out-of-range values get
    the code of their class too, that of e2m1_codes, but the callers clamp and check first.)"""
    shape = v.shape
    if v.device.type == "cpu":
        n = v.numel()
        b = _work_int("e2m1_low", n)
        b.view(torch.float32).view(shape).copy_(v)          # a copy in any layout: _e2m1_codes_bits_ overwrites it
        out = torch.empty(n, dtype=torch.uint8)
        return _e2m1_codes_bits_(b, _work_int("e2m1_idx", n), out).view(shape)
    b = v.contiguous().view(torch.int32).reshape(-1)
    idx, low = torch.bitwise_right_shift(b, 20), torch.bitwise_and(b, 0xFFFFF)
    idx.bitwise_or_(low.ne_(0)).bitwise_and_(0xFFF)
    return torch.index_select(_E2M1_BITS_LUT.to(v.device), 0, idx).reshape(shape)


def _nvfp4_rows(x: torch.Tensor, s2: torch.Tensor, finite: bool = False,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded rows -> (packed uint8 data [rows, cols/2], written into ``out`` when given; unswizzled fp8 block
    scales [rows, cols/16]); the zero-block ``where`` only where a block's scale is 0, the clamp in place (same bits
    as the one-shot ops). A finite CPU slice takes :func:`_nvfp4_rows_cpu` (the same operations on reused
    buffers)."""
    if finite and x.device.type == "cpu" and x.dtype in SOURCE_DTYPES:
        return _nvfp4_rows_cpu(x, s2, out)
    rows, cols = x.shape
    f, amax = _blocks_f32(x, 16)
    sbs8, total, zero, any_zero = _nvfp4_block_scales(amax, s2)
    d = f.div_((torch.where(zero, torch.ones_like(total), total) if any_zero else total).unsqueeze(-1))
    if any_zero:
        d.masked_fill_(zero.unsqueeze(-1), 0.0)
    if finite:      # no clamp: e2m1 saturates (every |v| > 5 is code 7) and the sign is kept, so the codes of the
        c = _e2m1_codes_finite(d.reshape(rows, cols))      # clamped and the unclamped values are the same (tested)
    else:
        c = e2m1_codes(d.clamp_(-FP4_E2M1_MAX, FP4_E2M1_MAX).reshape(rows, cols))
    return _pack_nibbles(c, out), sbs8


def _nvfp4_rows_cpu(x: torch.Tensor, s2: torch.Tensor, out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_nvfp4_rows` with ``finite=True`` of CPU rows (any strides), in row groups (:data:`GROUP_ELEMS`, see
    :func:`_nvfp4_group_cpu`), every full-size step in place on the per-thread buffers of :func:`_work_int`: one
    float32 copy; its magnitude bits into the index buffer and their
    integer block maximum (as :func:`_blocks_f32`); the host's scale step of :func:`_nvfp4_block_scales` on the
    block array, in place, with the all-zero test as one ``amin`` (a block's divisor is >= 0, and NaN only where
    the caller broke ``finite``, which the ``amin`` sends to the mask path too); the division in place; the codes
    by :func:`_e2m1_codes_bits_` over the division's own bits; the nibble pack of :func:`_pack_nibbles_cpu`. The
    same torch operations on the values as the general path, so the same bits (tested against it and the host;
    timed against the code before in benchmarks/bench_quant_cpu.py)."""
    rows, cols = x.shape
    nb = cols // 16
    sbs8 = torch.empty((rows, nb), dtype=torch.float8_e4m3fn)
    if out is None:
        out = torch.empty((rows, cols // 2), dtype=torch.uint8)
    step = _group_rows(rows, cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        _nvfp4_group_cpu(x[r0:r1], s2, out[r0:r1], sbs8[r0:r1])
    return out, sbs8


# the CPU block-format rows (_nvfp4_rows_cpu, _mxfp8_rows) work in groups of whole rows of at most about this many
# elements, the slice split evenly: the float32 copy, the index buffer and the codes of one group stay in the
# last-level cache between their passes (a 128-row slice of a 21504-column weight is 2.75 M elements, 11 MB per
# int32 buffer; 2.0x faster in 512 Ki groups there, measured: benchmarks/bench_quant_cpu.py). The rows are
# independent (a block is 16 / 32 columns of one row), so the bits are those of one pass over the slice.
GROUP_ELEMS = 1 << 19


def _group_rows(rows: int, cols: int) -> int:
    """Rows per group of a ``[rows, cols]`` slice: the slice split into ``ceil(rows * cols / GROUP_ELEMS)`` groups
    of equal row counts (the last one smaller), at least one row each."""
    groups = max(1, -(-(rows * cols) // GROUP_ELEMS))
    return max(1, -(-rows // groups))


def _nvfp4_group_cpu(x: torch.Tensor, s2: torch.Tensor, out: torch.Tensor, sbs8: torch.Tensor) -> None:
    """One row group of :func:`_nvfp4_rows_cpu`: packed codes into ``out`` (uint8 ``[rows, cols/2]``, unit column
    stride), the fp8 block scales into ``sbs8`` (contiguous ``[rows, cols/16]``)."""
    rows, cols = x.shape
    nb, n = cols // 16, rows * cols
    f = _work_f32("blk", x)
    f.copy_(x)
    b = f.view(-1).view(torch.int32)
    idx = _work_int("n4_idx", n)
    torch.bitwise_and(b, 0x7FFFFFFF, out=idx)
    sbs = torch.amax(idx.view(rows, nb, 16), dim=-1).view(torch.float32)       # the float32 block amaxes
    sbs.div_(FP4_E2M1_MAX).div_(s2).clamp_(max=FP8_E4M3_MAX)     # (amax / 6) / s2, clamped: _nvfp4_block_scales
    sbs8.copy_(sbs)                                              # the conversion of .to(torch.float8_e4m3fn)
    total = sbs                                                  # reused: the float32 divisor s2 * fp8(scale)
    _to_f32(sbs8, total)
    total.mul_(s2)
    any_zero = not bool(total.amin() > 0) if total.numel() else False
    if any_zero:
        zero = total == 0
        total.masked_fill_(zero, 1.0)
    d = f.view(rows, nb, 16).div_(total.unsqueeze(-1))
    if any_zero:
        d.masked_fill_(zero.unsqueeze(-1), 0.0)
    c = _e2m1_codes_bits_(b, idx, _work_int("n4_codes", n, torch.uint8))
    _pack_nibbles_cpu(c.view(rows, cols), out)


_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_nibbles(c: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(c[:, 0::2] << 4) | c[:, 1::2]`` for 4-bit codes (uint8 < 16), high nibble first, written into ``out``
    (uint8 ``[rows, cols/2]``) when given. A contiguous CPU ``c`` on a little-endian host takes
    :func:`_pack_nibbles_cpu`; elsewhere the int16 view of each pair (low byte the even code, high byte the odd
    one): ``(v << 4) | (v >> 8)`` has that byte as its low byte, and the conversion to uint8 keeps the low byte;
    3x faster than the strided form (measured); the same bytes (tested)."""
    if not (_LITTLE_ENDIAN and c.is_contiguous() and c.shape[-1] % 2 == 0):
        r = (c[:, 0::2] << 4) | c[:, 1::2]
    elif c.device.type == "cpu":
        return _pack_nibbles_cpu(c, out)
    else:
        v = c.view(torch.int16)
        r = (v << 4) | (v >> 8)
    if out is None:
        return r.to(torch.uint8)
    out.copy_(r)
    return out


def _pack_nibbles_cpu(c: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_pack_nibbles` of a contiguous CPU ``c`` (uint8 codes < 16, even row length) on a little-endian host,
    in two int16 passes on a per-thread buffer and the conversion into ``out``: each pair read as one int16
    ``v = even + 256 * odd``; ``v * 0x1001`` (wrapping in int16) has bits 8..15 equal to ``16 * even + odd``
    (``even * 4097 + 256 * odd``, whose bits 8..15 are ``(16 * even + odd + even // 256) mod 256`` and
    ``even < 16``), so ``(v * 0x1001) >> 8`` has that byte as its low byte, which the conversion to uint8 keeps.
    One pass fewer than the shift-or form (every one of the 256 pairs tested)."""
    if not _LITTLE_ENDIAN:
        raise AssertionError("_pack_nibbles_cpu reads each pair as a little-endian int16")
    v = c.view(torch.int16)
    t = torch.mul(v, 0x1001, out=_work_int("pack", v.numel(), torch.int16).view(v.shape))
    t.bitwise_right_shift_(8)
    if out is None:
        return t.to(torch.uint8)
    out.copy_(t)
    return out


# rows are quantized in slices of about this many elements (whole 128-row scale tiles, at least 128 rows): float32
# working copies of about 1 MiB, so a loader's peak stays near the tensor being quantized (docs/quantize.md, "Peak
# RSS"); per-tensor time on this CPU host within the run-to-run noise of 4 Mi-element slices
CHUNK_ELEMS = 1 << 18


def _row_step(cols: int) -> int:
    return max(128, (CHUNK_ELEMS // max(cols, 1)) // 128 * 128)


class NonFiniteWeight(ValueError):
    """:func:`quantize` with ``finite=True`` met a NaN or Inf in the weight (seen in its amax, no extra pass)."""


@dataclass
class ErrorSample:
    """The reconstruction error :func:`quantize` measures while it quantizes (no second pass over the weight, no
    dequantize of the stored layout): every ``every``-th row slice (1 = all rows) adds ``sum((deq(Q(w)) - w)^2)`` to
    ``e2`` and ``sum(w^2)`` to ``r2``, with the rows it covered in ``rows`` (``total_rows``: all rows seen). With
    ``every=1`` the sums are those of :func:`reconstruction_error` (same slices, same float32 operations)."""

    every: int = 1
    e2: float = 0.0
    r2: float = 0.0
    rows: int = 0
    total_rows: int = 0

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"ErrorSample.every must be an integer >= 1, got {self.every!r}")


_FUSED_CAST: dict[tuple[torch.dtype, torch.dtype], bool] = {}


def _fused_cast_ok(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``torch.mul(x, s, out=<dst tensor>)`` gives, on this torch, exactly ``(x * s).to(dst)`` (the product
    rounded to ``src`` first, then cast): checked once per process over every finite ``src`` bit pattern (fp16 /
    bf16; 2^16 values, a random 2^16 sample for float32) and two multipliers; else the two-step path is used."""
    key = (src, dst)
    if key not in _FUSED_CAST:
        if src == torch.float32:
            x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 37.0
        else:
            x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(src)
            x = x[torch.isfinite(x)]
        ok = True
        for m in (1.0 / 3.0, 1234.5678):
            sc = torch.tensor(m, dtype=src)
            lim = FP8_E4M3_MAX if dst == torch.float8_e4m3fn else FP8_E5M2_MAX
            xx = x[(x.float() * sc.float()).abs() < lim]
            got = torch.empty(xx.shape, dtype=dst)
            torch.mul(xx, sc, out=got)
            ok = ok and torch.equal(got.view(torch.uint8), (xx * sc).to(dst).view(torch.uint8))
        _FUSED_CAST[key] = bool(ok)
    return _FUSED_CAST[key]


def _nvfp4_block_scales(amax: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The host's nvfp4 scale step on the float32 block amaxes: ``(stored fp8 block scales, the float32 divisor
    per block ``s2 * scale``, the mask of blocks whose divisor is 0, whether any is)``; shared by the reference and
    the Triton path."""
    bs = amax / FP4_E2M1_MAX
    sbs = torch.clamp(bs / s2, max=FP8_E4M3_MAX)
    sbs8 = sbs.to(torch.float8_e4m3fn)         # once: the stored block scales and the divisor's factor
    if sbs8.device.type == "cpu":
        total = torch.empty(sbs8.shape, dtype=torch.float32)
        _to_f32(sbs8, total)
        total.mul_(s2)                          # s2 * x == x * s2 (float32 multiplication commutes)
    else:
        total = s2 * sbs8.to(torch.float32)
    zero = total == 0
    return sbs8, total, zero, bool(zero.any())


def quantize(w: torch.Tensor, fmt: str, backend: str = "reference",
             empty: Callable[..., torch.Tensor] | None = None,
             release: Callable[[], object] | None = None, error: ErrorSample | None = None,
             finite: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A 2-D float weight -> (``weight`` data, ``{"weight_scale": ..., ["weight_scale_2": ...]}``), exactly what
    ComfyUI's layout quantize produces (see the module doc). ``backend="triton"`` runs the per-tensor formats'
    elementwise step in the Triton kernel, and mxfp8 / nvfp4 run the block kernels of :mod:`.quant_triton` (same bits;
    the block kernels refuse a non-finite weight).

    Rows are processed in slices of about ``CHUNK_ELEMS`` elements (the per-tensor scale is taken over the whole
    weight first, from one ``aminmax`` pass; every later step is per element or per row block) and written into the
    output, so the working copies stay a few slices big whatever the weight; the bits are those of the one-shot
    computation. ``empty(shape, dtype)`` makes the outputs (the weight data and the block scales; default
    ``torch.empty`` on ``w``'s device): a loader that keeps them passes an allocator of its own
    (``loaders/host_memory.empty``); ``release()`` is called after each slice, once its working copies are freed.
    ``error``: an :class:`ErrorSample` the reconstruction error of the sampled slices is added to. ``finite``:
    raise :class:`NonFiniteWeight` (before any output is returned) when the weight holds a NaN or Inf.

    Fast paths with the same bits (tested against the reference operations and the host): the clamp of the fp8
    product / int8 quotient is skipped when the amax's own rounded product is within range (rounding is monotonic,
    so no element can exceed it), and the fp8 product is cast straight into the output where this torch is checked
    to round it to the source dtype first (:func:`_fused_cast_ok`)."""
    _check_source(w, fmt)
    if backend not in ("reference", "triton"):
        raise ValueError(f"unknown backend {backend!r}")
    get_format(fmt)
    rows, cols = w.shape
    if error is not None:
        error.total_rows += rows
    if backend == "triton" and fmt in ("mxfp8", "nvfp4"):
        return _quantize_blocks_triton(w, fmt, empty, error)
    if backend == "triton":
        amax = _amax_abs(w)
        if finite and not bool(torch.isfinite(amax)):
            raise NonFiniteWeight(f"{fmt}: the weight holds NaN or Inf values")
        scale = per_tensor_scale(w, fmt, amax)
        out = quantize_per_tensor_triton(w, scale, fmt)
        if error is not None:
            step = _row_step(cols)
            for i, r0 in enumerate(range(0, rows, step)):
                if i % error.every == 0:
                    _add_error(error, out[r0:r0 + step].float() * scale.float(), w[r0:r0 + step])
        return out, {"weight_scale": scale}
    make = empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=w.device))
    step = _row_step(cols)
    spans = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    amax = _amax_abs(w)
    if finite and not bool(torch.isfinite(amax)):
        raise NonFiniteWeight(f"{fmt}: the weight holds NaN or Inf values")
    if fmt in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise"):
        scale = per_tensor_scale(w, fmt, amax)
        out = make((rows, cols), get_format(fmt).storage)
        if fmt == "int8_tensorwise":
            div = _int8_scale_math(scale, w)
            clamp = not bool((amax / div).round() <= INT8_MAX)
        else:
            mul = (1.0 / scale).to(w.dtype)
            lp = FP8_E4M3_MAX if fmt == "float8_e4m3fn" else FP8_E5M2_MAX
            clamp = not bool((amax * mul) <= lp)
            fused = not clamp and _fused_cast_ok(w.dtype, out.dtype)
        buf = None
        for i, (r0, r1) in enumerate(spans):
            x = w[r0:r1]
            if clamp:
                out[r0:r1] = _int8_ref(x, scale) if fmt == "int8_tensorwise" else _fp8_ref(x, scale, fmt)
            elif fmt == "int8_tensorwise":
                buf = torch.div(x, div, out=buf if buf is not None and buf.shape == x.shape else None)
                out[r0:r1].copy_(buf.round_())
            elif fused:
                torch.mul(x, mul, out=out[r0:r1])
            else:
                buf = torch.mul(x, mul, out=buf if buf is not None and buf.shape == x.shape else None)
                out[r0:r1].copy_(buf)
            if error is not None and i % error.every == 0:
                if out.device.type == "cpu":        # the same values as ``out[r0:r1].float() * scale.float()``
                    rec = _work_f32("rec", x)
                    _to_f32(out[r0:r1], rec)
                    rec.mul_(scale.float())
                else:
                    rec = out[r0:r1].float() * scale.float()
                _add_error(error, rec, x)
            if release:
                release()
        return out, {"weight_scale": scale}
    pad = get_format(fmt).pad
    pr, pc = _roundup(rows, pad), _roundup(cols, pad)
    s2 = per_tensor_scale(w, fmt, amax) if fmt == "nvfp4" else None
    data = make((pr, pc if fmt == "mxfp8" else pc // 2), get_format(fmt).storage)
    sparts = []
    for i, (r0, r1) in enumerate(spans):
        x = w[r0:r1]
        xp = _pad_rows_cols(x, (pr - rows) if r1 == rows else 0, pc - cols)
        into = data[r0:r0 + xp.shape[0]]          # the results go straight into the output rows
        d, sc = _mxfp8_rows(xp, into) if fmt == "mxfp8" else _nvfp4_rows(xp, s2, finite, into)
        sparts.append(sc)
        if error is not None and i % error.every == 0:
            rec = _dequant_slice_work(fmt, d[: r1 - r0], sc[: r1 - r0], s2)[:, :cols]
            _add_error(error, rec, x)
        del x, xp, d
        if release:
            release()
    b = to_blocked(sparts[0] if len(sparts) == 1 else torch.cat(sparts))
    del sparts
    blocked = make(tuple(b.shape), b.dtype)
    blocked.copy_(b)
    del b
    if fmt == "mxfp8":
        return data, {"weight_scale": blocked.view(torch.float8_e8m0fnu)}
    return data, {"weight_scale": blocked, "weight_scale_2": s2}


def quantize_blocks_triton(w: torch.Tensor, fmt: str, s2: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, br: int = 16, bc: int = 128
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A finite 2-D weight (any strides, fp32 / bf16 / fp16) -> ``(padded data, unswizzled block scales)`` of
    ``fmt`` through the Triton kernels of :mod:`.quant_triton` (mxfp8: float8_e4m3fn data and uint8 E8M0
    exponents; nvfp4: packed uint8 data and fp8 block scales; ``s2`` nvfp4's per-tensor scale): block amax kernel,
    the reference's own scale step in torch, encode kernel. The same bits as :func:`_mxfp8_rows` /
    :func:`_nvfp4_rows` over the zero-padded weight. ``out``: the padded data tensor to write into; ``br`` x ``bc``
    the kernels' tile."""
    from . import quant_triton as T

    _check_source(w, fmt)
    if fmt not in ("mxfp8", "nvfp4"):
        raise ValueError(f"{fmt}: the block kernels cover mxfp8 and nvfp4")
    if fmt == "nvfp4" and (s2 is None or s2.numel() != 1):
        raise ValueError("nvfp4: the per-tensor scale s2 (one float32) is required")
    rows, cols = w.shape
    f = get_format(fmt)
    prows, pcols = _roundup(rows, f.pad), _roundup(cols, f.pad)
    shape = (prows, pcols if fmt == "mxfp8" else pcols // 2)
    if out is None:
        out = torch.empty(shape, dtype=f.storage, device=w.device)
    elif tuple(out.shape) != shape or out.dtype != f.storage or out.device != w.device or out.stride(1) != 1:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} on {out.device} (unit column stride), want {shape} "
                         f"{f.storage} on {w.device}")
    amax = T.block_amax(w, f.block, prows, pcols, br, bc)
    if fmt == "mxfp8":
        sc, s, zero, any_zero = _mxfp8_block_scales(amax)
        div = 1.0 / s                                # exact: s is a power of two (or 0: inf, as x / 0)
    else:
        s2 = s2.reshape(()).to(device=w.device, dtype=torch.float32)
        sc, div, zero, any_zero = _nvfp4_block_scales(amax, s2)
    if any_zero:
        div = torch.where(zero, torch.full_like(div, float("nan")), div)
    T.encode_blocks(w, f.block, div.contiguous(), out.view(torch.uint8), br, bc)
    return out, sc


def _quantize_blocks_triton(w: torch.Tensor, fmt: str, empty: Callable[..., torch.Tensor] | None,
                            error: ErrorSample | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`quantize` of a block format through the Triton kernels (:mod:`.quant_triton`): the whole weight in
    one launch pair, the same bits as the reference. Non-finite weights are refused (see that module)."""
    amax = _amax_abs(w)
    if not bool(torch.isfinite(amax)):
        raise NonFiniteWeight(f"{fmt}: the weight holds NaN or Inf values (the Triton path quantizes finite "
                              "weights only)")
    s2 = per_tensor_scale(w, fmt, amax) if fmt == "nvfp4" else None
    rows, cols = w.shape
    shape, dtype = storage_layout((rows, cols), fmt)["weight"]
    data = empty(shape, dtype) if empty is not None else None
    data, sc = quantize_blocks_triton(w, fmt, s2, out=data)
    if error is not None:
        step = _row_step(cols)
        for i, r0 in enumerate(range(0, rows, step)):
            if i % error.every == 0:
                r1 = min(rows, r0 + step)
                _add_error(error, _dequant_slice(fmt, data[r0:r1], sc[r0:r1], s2)[:, :cols], w[r0:r1])
    b = to_blocked(sc)
    blocked = empty(tuple(b.shape), b.dtype) if empty is not None else b
    if blocked is not b:
        blocked.copy_(b)
    if fmt == "mxfp8":
        return data, {"weight_scale": blocked.view(torch.float8_e8m0fnu)}
    return data, {"weight_scale": blocked, "weight_scale_2": s2}


def _pad_rows_cols(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``F.pad(x, (0, cols, 0, rows))`` (zeros), ``x`` itself when nothing is padded."""
    if rows == 0 and cols == 0:
        return x
    return torch.nn.functional.pad(x, (0, cols, 0, rows))


_WORK = threading.local()


def _work_f32(slot: str, like: torch.Tensor) -> torch.Tensor:
    """A float32 CPU tensor of ``like``'s shape from a per-thread buffer reused from one slice (and one weight) to
    the next: the error sample's working copies cost no allocation and no page faults (a fresh 1 MiB copy per
    sampled slice was 20 % of an fp8 load, measured). Values are whatever was there: the caller overwrites them."""
    n = like.numel()
    buf = getattr(_WORK, slot, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.float32)
        setattr(_WORK, slot, buf)
    return buf[:n].view(like.shape)


_FP8_F32: dict[torch.dtype, torch.Tensor] = {}


def _to_f32(q: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(q)`` for a contiguous CPU ``q``; an fp8 ``q`` through the table of its 256 codes' float32 values
    (made by torch's own conversion, so every bit pattern, NaN included, is the same): torch's fp8 -> float32 copy
    runs at 229 M elements/s on this CPU, the table lookup at 1046 M (measured)."""
    if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and q.is_contiguous():
        lut = _FP8_F32.get(q.dtype)
        if lut is None:
            lut = _FP8_F32[q.dtype] = torch.arange(256, dtype=torch.uint8).view(q.dtype).float()
        n = q.numel()
        idx = getattr(_WORK, "idx", None)
        if idx is None or idx.numel() < n:
            idx = _WORK.idx = torch.empty(n, dtype=torch.int32)
        idx = idx[:n]
        idx.copy_(q.view(torch.uint8).reshape(-1))
        torch.index_select(lut, 0, idx, out=out.view(-1))
    else:
        out.copy_(q)


def _add_error(error: ErrorSample, rec: torch.Tensor, x: torch.Tensor) -> None:
    """``rec``: float32 dequantized rows of ``x`` (the source rows): add their squared error and norm."""
    if x.device.type == "cpu":
        ref = _work_f32("ref", x)
        ref.copy_(x)
    else:
        ref = x.to(torch.float32, copy=True)
    error.e2 += float(rec.sub_(ref).pow_(2).sum())
    error.r2 += float(ref.pow_(2).sum())
    error.rows += x.shape[0]


_E2M1_SIGNED = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
_E2M1_PAIRS = torch.stack([_E2M1_SIGNED[torch.arange(256) >> 4], _E2M1_SIGNED[torch.arange(256) & 0x0F]], dim=1)
_E2M1_PAIRS64 = _E2M1_PAIRS.contiguous().view(torch.int64).reshape(256)


def _dequant_slice_work(fmt: str, d: torch.Tensor, sc: torch.Tensor, s2: torch.Tensor | None) -> torch.Tensor:
    """:func:`_dequant_slice` of contiguous CPU rows into this thread's work buffers (:func:`_work_int`), for the
    error sample of :func:`quantize` only: the result is overwritten by the next call. The same operations on the
    values (the table lookup, the fp8 block scales through :func:`_to_f32`, the per-tensor factor, one multiply per
    element; the multiplies in place), so the same bits; no fresh allocation per sampled slice (a new 1.4 MB result
    and product each time were 2.9 ms of a 128 x 2816 slice whose quantization takes 1.5 ms after the heap was
    trimmed, measured: the pages fault again). Elsewhere :func:`_dequant_slice`."""
    if d.device.type != "cpu" or not (d.is_contiguous() and sc.is_contiguous()):
        return _dequant_slice(fmt, d, sc, s2)
    n = d.shape[0]
    if fmt == "mxfp8":
        cols_p = d.shape[1]
        e = sc.view(torch.uint8).to(torch.int32)
        s = torch.where(e == 0, torch.zeros_like(e), e << 23).view(torch.float32)
        f = _work_int("dq_vals", d.numel()).view(torch.float32).view(d.shape)
        _to_f32(d, f)
        return f.view(n, cols_p // 32, 32).mul_(s.unsqueeze(-1)).view(n, cols_p)
    cols_p = 2 * d.shape[1]
    idx = _work_int("dq_idx", d.numel())
    idx.copy_(d.view(-1))
    vals = torch.index_select(_E2M1_PAIRS64, 0, idx, out=_work_int("dq_vals", d.numel(), torch.int64))
    b8 = sc.view(torch.float8_e4m3fn)
    bs = torch.empty(b8.shape, dtype=torch.float32)
    _to_f32(b8, bs)
    bs.mul_(s2.float())                 # s2 * bs == bs * s2 (float32 multiplication commutes)
    return vals.view(torch.float32).view(n, cols_p // 16, 16).mul_(bs.unsqueeze(-1)).view(n, cols_p)


def _dequant_slice(fmt: str, d: torch.Tensor, sc: torch.Tensor, s2: torch.Tensor | None) -> torch.Tensor:
    """float32 values of padded rows of a block format: ``d`` the stored data rows, ``sc`` their unswizzled block
    scales (uint8 E8M0 exponents for mxfp8, fp8 for nvfp4), ``s2`` nvfp4's per-tensor scale."""
    n = d.shape[0]
    if fmt == "mxfp8":
        cols_p = d.shape[1]
        e = sc.view(torch.uint8).to(torch.int32)
        s = torch.where(e == 0, torch.zeros_like(e), e << 23).view(torch.float32)
        f = torch.empty(d.shape, dtype=torch.float32, device=d.device)
        _to_f32(d, f) if d.device.type == "cpu" else f.copy_(d)
        return (f.reshape(n, cols_p // 32, 32) * s.unsqueeze(-1)).reshape(n, cols_p)
    cols_p = 2 * d.shape[1]
    # one lookup per byte of its two values (high nibble first): the values of lut[codes] for the nibble codes, the
    # pair's two float32s read as one int64 (a 1-D table: 4x faster than rows of a [256, 2] one, measured)
    pairs = _E2M1_PAIRS64 if d.device.type == "cpu" else _E2M1_PAIRS64.to(d.device)
    vals = torch.index_select(pairs, 0, d.contiguous().reshape(-1).to(torch.int32)).view(torch.float32)
    vals = vals.reshape(n, cols_p // 16, 16)
    b8 = sc.view(torch.float8_e4m3fn)
    bs = torch.empty(b8.shape, dtype=torch.float32, device=d.device)
    _to_f32(b8, bs) if d.device.type == "cpu" else bs.copy_(b8)
    return (vals * (s2.float() * bs).unsqueeze(-1)).reshape(n, cols_p)


def reconstruction_error(w: torch.Tensor, data: torch.Tensor, scales: dict[str, torch.Tensor],
                         fmt: str, release: Callable[[], object] | None = None) -> tuple[float, float]:
    """(sum of squared errors, sum of squares of ``w``) of ``dequantize`` vs ``w``, in row slices
    (``release()`` after each, as in :func:`quantize`)."""
    rows, cols = w.shape
    e2 = r2 = 0.0
    for r0 in range(0, rows, _row_step(cols)):
        r1 = min(rows, r0 + _row_step(cols))
        ref = w[r0:r1].to(torch.float32, copy=True)      # a copy even for float32 weights: squared in place below
        if fmt in ("mxfp8", "nvfp4"):
            rec = _dequant_rows(data, scales, fmt, r0, r1, cols)
        else:
            rec = data[r0:r1].float() * scales["weight_scale"].float()
        e2 += float(rec.sub_(ref).pow_(2).sum())    # in place: the same values as ((rec - ref) ** 2).sum()
        r2 += float(ref.pow_(2).sum())
        del ref, rec
        if release:
            release()
    return e2, r2


def dequantize(data: torch.Tensor, scales: dict[str, torch.Tensor], fmt: str, shape: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight a ``(data, scales)`` pair stands for, cropped to ``shape`` (the layer's ``[out, in]``;
    needed for the padded block formats), computed in float32 then cast to ``dtype``."""
    f = get_format(fmt)
    if fmt in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise"):
        out = data.float() * scales["weight_scale"].float()
    elif fmt == "mxfp8":
        rows, cols = data.shape
        e = from_blocked(scales["weight_scale"].view(torch.uint8), rows, cols // 32).to(torch.int32)
        s = torch.where(e == 0, torch.zeros_like(e), e << 23).view(torch.float32)
        out = (data.float().reshape(rows, cols // 32, 32) * s.unsqueeze(-1)).reshape(rows, cols)
    elif fmt == "nvfp4":
        rows, half = data.shape
        cols = 2 * half
        lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=data.device)
        codes = torch.stack([data >> 4, data & 0x0F], dim=-1).reshape(rows, cols).long()
        vals = lut[codes].reshape(rows, cols // 16, 16)
        bs = from_blocked(scales["weight_scale"].view(torch.float8_e4m3fn), rows, cols // 16).float()
        out = (vals * (scales["weight_scale_2"].float() * bs).unsqueeze(-1)).reshape(rows, cols)
    else:  # pragma: no cover - get_format refused it
        raise AssertionError(f.name)
    if shape is not None:
        out = out[: shape[0], : shape[1]]
    return out.to(dtype)


def requantize_spans(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The row chunks :func:`requantize_add` works in: ``chunk_rows`` rounded up to whole 128-row scale tiles."""
    step = max(128, _roundup(chunk_rows, 128))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def requantize_add(data: torch.Tensor, scales: dict[str, torch.Tensor], fmt: str, shape: tuple[int, int],
                   delta: Callable[[int, int], torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                   chunk_rows: int = 1024, work_dtype: torch.dtype = torch.float32, backend: str = "reference"
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dequantize -> add a delta -> requantize with the same scheme, ``chunk_rows`` rows at a time.

    ``delta(r0, r1)`` returns rows ``r0:r1`` of the float update ``[r1-r0, in]`` (e.g. ``B[r0:r1] @ A * scale``);
    the updated rows are formed as ``(dequantize(...) + delta).to(dtype)``, the sum in ``work_dtype`` (float64:
    the per-tensor dequantize ``data * scale`` and the add are then exact up to one float64 rounding, and ``dtype``
    rounds once). The result equals ``quantize((dequantize(data, scales, fmt, shape) + full_delta).to(dtype), fmt)``
    bit for bit: the per-tensor scales come from a first pass over the chunks (amax of the updated rows), the
    block formats' rows are independent. Peak extra memory: two chunks of ``[chunk_rows, in]`` in ``work_dtype``
    plus the new data. ``backend="triton"`` quantizes each chunk of the per-tensor formats with the Triton kernel
    (:func:`quantize_per_tensor_triton`, the same codes); the block formats have the reference only."""
    get_format(fmt)
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend {backend!r}: 'reference' or 'triton'")
    if backend == "triton" and fmt not in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise"):
        raise ValueError(f"{fmt}: the Triton requantize covers the per-tensor formats only")
    rows, cols = shape

    def updated(r0: int, r1: int) -> torch.Tensor:
        if fmt in ("mxfp8", "nvfp4"):
            base = _dequant_rows(data, scales, fmt, r0, r1, cols).to(work_dtype)
        else:
            base = data[r0:r1].to(work_dtype) * scales["weight_scale"].to(work_dtype)
        return (base + delta(r0, r1).to(work_dtype)).to(dtype)

    spans = requantize_spans(rows, chunk_rows)
    if fmt in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "nvfp4"):
        amax = None
        for r0, r1 in spans:
            m = torch.amax(updated(r0, r1).abs())
            amax = m if amax is None else torch.maximum(amax, m)
        probe = amax.reshape(1, 1).to(dtype)                  # the per-tensor scale depends only on amax
        scale = per_tensor_scale(probe, fmt)
    if fmt in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise"):
        out = torch.empty((rows, cols), dtype=get_format(fmt).storage, device=data.device)
        for r0, r1 in spans:
            u = updated(r0, r1)
            if backend == "triton":
                out[r0:r1] = quantize_per_tensor_triton(u, scale, fmt)
            else:
                out[r0:r1] = _int8_ref(u, scale) if fmt == "int8_tensorwise" else _fp8_ref(u, scale, fmt)
        return out, {"weight_scale": scale}
    pad = get_format(fmt).pad
    pc = _roundup(cols, pad)
    parts, sparts = [], []
    for r0, r1 in spans:
        u = updated(r0, r1)
        if r1 == rows:
            u = torch.nn.functional.pad(u, (0, 0, 0, _roundup(rows, pad) - rows))
        u = torch.nn.functional.pad(u, (0, pc - cols))
        if fmt == "mxfp8":
            d, s = _mxfp8_rows(u)
        else:
            d, s = _nvfp4_rows(u, scale)
        parts.append(d)
        sparts.append(s)
    new = torch.cat(parts)
    if fmt == "mxfp8":
        return new, {"weight_scale": to_blocked(torch.cat(sparts)).view(torch.float8_e8m0fnu)}
    return new, {"weight_scale": to_blocked(torch.cat(sparts)), "weight_scale_2": scale}


def dequant_rows64(data: torch.Tensor, scales: dict[str, torch.Tensor], fmt: str, r0: int, r1: int,
                   cols: int) -> torch.Tensor:
    """Rows ``r0:r1`` of a block-format weight (``mxfp8`` / ``nvfp4``, data and blocked scales as stored), cropped
    to ``cols``, as their exact float64 values: an fp8 code times its E8M0 power of two, or an e2m1 code times
    its fp8 block scale times the float32 tensor scale, are exact in float64 (not always in float32: subnormal
    products, 2 + 4 + 24 significant bits)."""
    rows_p = data.shape[0]
    if fmt == "mxfp8":
        cols_p = data.shape[1]
        e = from_blocked(scales["weight_scale"].view(torch.uint8), rows_p, cols_p // 32)[r0:r1].to(torch.float64)
        s = torch.where(e == 0, torch.zeros_like(e), torch.exp2(e - 127.0))
        out = (data[r0:r1].to(torch.float64).reshape(r1 - r0, cols_p // 32, 32) * s.unsqueeze(-1))
        return out.reshape(r1 - r0, cols_p)[:, :cols]
    if fmt != "nvfp4":
        raise ValueError(f"{fmt}: dequant_rows64 covers the block formats mxfp8 / nvfp4")
    cols_p = 2 * data.shape[1]
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64, device=data.device)
    d = data[r0:r1]
    codes = torch.stack([d >> 4, d & 0x0F], dim=-1).reshape(r1 - r0, cols_p).long()
    vals = lut[codes].reshape(r1 - r0, cols_p // 16, 16)
    bs = from_blocked(scales["weight_scale"].view(torch.float8_e4m3fn), rows_p, cols_p // 16)[r0:r1].to(torch.float64)
    out = vals * (scales["weight_scale_2"].to(torch.float64) * bs).unsqueeze(-1)
    return out.reshape(r1 - r0, cols_p)[:, :cols]


def _dequant_rows(data, scales, fmt, r0, r1, cols):
    rows_p = data.shape[0]
    if fmt == "mxfp8":
        sc = from_blocked(scales["weight_scale"].view(torch.uint8), rows_p, data.shape[1] // 32)[r0:r1]
        return _dequant_slice(fmt, data[r0:r1], sc, None)[:, :cols]
    sc = from_blocked(scales["weight_scale"].view(torch.float8_e4m3fn), rows_p, 2 * data.shape[1] // 16)[r0:r1]
    return _dequant_slice(fmt, data[r0:r1], sc, scales["weight_scale_2"])[:, :cols]


# ------------------------------------------------------------------------------------------------------ triton

_FP8_PARAMS = {"float8_e4m3fn": (3, 7, FP8_E4M3_MAX), "float8_e5m2": (2, 15, FP8_E5M2_MAX)}

if HAS_TRITON:
    from ._triton import offs64

    @triton.jit
    def _rne(v):
        # round half to even for float32 values, exact (no reliance on the backend's rint)
        f = tl.floor(v)
        d = v - f
        odd = f - 2.0 * tl.floor(f * 0.5)
        return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))

    @triton.jit
    def _round_to_source(y, ROUND: tl.constexpr):
        # the host rounds x*s (x/s) to the source dtype before clamping; float32 products of two bf16/fp16
        # values are exact, so this single rounding reproduces torch's result
        if ROUND == 1:   # bfloat16: round the float32 bits to the upper 16, ties to even
            b = y.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            y = b.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            y = y.to(tl.float16).to(tl.float32)
        return y

    @triton.jit
    def _per_tensor_quant_kernel(X, S, OUT, n, ROUND: tl.constexpr, INT8: tl.constexpr, MBITS: tl.constexpr,
                                 BIAS: tl.constexpr, LPMAX: tl.constexpr, BLOCK: tl.constexpr):
        offs = offs64(tl.program_id(0), BLOCK) + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        s = tl.load(S).to(tl.float32)
        if INT8:
            y = _round_to_source(x / s, ROUND)
            q = tl.minimum(tl.maximum(_rne(y), -128.0), 127.0)
            tl.store(OUT + offs, q.to(tl.int8), mask=m)
        else:
            y = _round_to_source(x * s, ROUND)
            y = tl.minimum(tl.maximum(y, -LPMAX), LPMAX)
            a = tl.abs(y)
            bits = a.to(tl.int32, bitcast=True)
            sh: tl.constexpr = 23 - MBITS
            normal = ((bits + ((1 << (sh - 1)) - 1) + ((bits >> sh) & 1)) >> sh) - ((127 - BIAS) << MBITS)
            sub = _rne(a * (2.0 ** (BIAS - 1 + MBITS))).to(tl.int32)
            code = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
            sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
            code = code | (sign << 7)
            tl.store(OUT + offs, code.to(tl.uint8), mask=m)


def quantize_per_tensor_triton(w: torch.Tensor, scale: torch.Tensor, fmt: str, block: int = 1024) -> torch.Tensor:
    """Launcher: the elementwise step of the fp8 / int8 per-tensor formats with a given float32 ``scale``
    (the multiplier ``(1/scale)`` resp. divisor ``scale`` is first cast to the source dtype, as the host does)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if fmt not in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise"):
        raise ValueError(f"{fmt}: the Triton kernel covers the per-tensor formats only")
    x = w.contiguous()
    rnd = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[x.dtype]
    n = x.numel()
    grid = (triton.cdiv(n, block),)
    if fmt == "int8_tensorwise":
        s = _int8_scale_math(scale.to(x.device), x).reshape(1)
        out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        _per_tensor_quant_kernel[grid](x, s, out, n, ROUND=rnd, INT8=True, MBITS=0, BIAS=0, LPMAX=0.0, BLOCK=block)
        return out
    mbits, bias, lp = _FP8_PARAMS[fmt]
    s = (1.0 / scale.to(x.device)).to(x.dtype).reshape(1)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _per_tensor_quant_kernel[grid](x, s, out, n, ROUND=rnd, INT8=False, MBITS=mbits, BIAS=bias, LPMAX=lp,
                                   BLOCK=block)
    return out.view(get_format(fmt).storage)
