"""Tile-major pack / unpack(+gate-compress combine) of the packed H3 sequence.

* ``pack(x, tile_src)``: ``[B,H,S,D]`` packed rows -> ``[B,H,P,D]`` tile buffer, ``out[..., p, :] =
  x[..., tile_src[p], :]`` for live slots and exactly zero for pad slots (``tile_src[p] == -1``).
* ``unpack_combine(fine, coarse, untile_index, gate)``: tile buffer -> packed rows, folding the
  compression branch: ``out[..., r, :] = fine[..., u, :] + g[..., r, :] * coarse[..., u // 64, :]`` with
  ``u = untile_index[r]``; ``g`` = gate (packed order) or 1 when ``gate`` is None and ``coarse`` is given;
  without ``coarse`` it is a plain gather. The sum is formed in fp32 and rounded once.

Each op: pure-torch reference, a private ``@triton.jit`` kernel + launcher (int64 offsets), its ``torch.library``
custom op (``ditkit::vsa_pack_triton``, ``ditkit::vsa_unpack_combine_triton``; fake implementations let
``torch.compile`` trace them) and registry entries that call the custom ops.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import HAS_TRITON, existing_custom_op, tl, triton
from .registry import REGISTRY, Impl, triton_check

TILE = 64


# ---------------------------------------------------------------------------------------------------------
# references
def pack_reference(x: torch.Tensor, tile_src: torch.Tensor, gather: Optional[torch.Tensor] = None,
                   pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gather`` / ``pad``: ``tile_src.clamp(min=0)`` and the pad slots, when the caller already has them (the
    layout's cached :class:`~.vsa_layout.LayoutBuffers`)."""
    if gather is None or pad is None:
        src = tile_src.to(device=x.device, dtype=torch.long)
        gather, pad = src.clamp(min=0), torch.nonzero(src < 0).view(-1)
    # one index_select (pad slots read row 0), then the few pad slots are zeroed: no full-size concat copy
    out = x.index_select(-2, gather)
    if pad.numel():
        out.index_fill_(-2, pad, 0)
    return out


def unpack_combine_reference(fine: torch.Tensor, untile_index: torch.Tensor, coarse: Optional[torch.Tensor] = None,
                             gate: Optional[torch.Tensor] = None, tile: int = TILE,
                             untile_tiles: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``untile_tiles``: ``untile_index // tile`` when the caller already has it (cached per layout)."""
    u = untile_index.to(device=fine.device, dtype=torch.long)
    out = fine[..., u, :]
    if coarse is None:
        return out
    c = coarse[..., untile_tiles if untile_tiles is not None else u // tile, :].float()
    if gate is not None:
        c = c * gate.float()
    return (out.float() + c).to(fine.dtype)


# ---------------------------------------------------------------------------------------------------------
# triton
if HAS_TRITON:
    from ._triton import offs64

    @triton.jit
    def _pack_kernel(X, OUT, SRC, H, stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os,
                     D: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = offs64(t, BLOCK) + tl.arange(0, BLOCK)
        src = tl.load(SRC + rows)
        valid = src >= 0
        src = tl.where(valid, src, 0)
        d = tl.arange(0, D)
        x_base = X + offs64(b, stride_xb) + offs64(h, stride_xh)
        vals = tl.load(x_base + offs64(src, stride_xs)[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        o_base = OUT + offs64(b, stride_ob) + offs64(h, stride_oh)
        tl.store(o_base + offs64(rows, stride_os)[:, None] + d[None, :], vals)

    @triton.jit
    def _unpack_combine_kernel(F, C, G, OUT, U, S, H,
                               stride_fb, stride_fh, stride_fs, stride_cb, stride_ch, stride_ct,
                               stride_gb, stride_gh, stride_gs, stride_ob, stride_oh, stride_os,
                               D: tl.constexpr, BLOCK: tl.constexpr, TILE_ROWS: tl.constexpr,
                               HAS_C: tl.constexpr, HAS_G: tl.constexpr):
        r0 = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = offs64(r0, BLOCK) + tl.arange(0, BLOCK)
        rmask = rows < S
        u = tl.load(U + rows, mask=rmask, other=0)
        d = tl.arange(0, D)
        f_base = F + offs64(b, stride_fb) + offs64(h, stride_fh)
        acc = tl.load(f_base + offs64(u, stride_fs)[:, None] + d[None, :], mask=rmask[:, None], other=0.0)
        acc = acc.to(tl.float32)
        if HAS_C:
            c_base = C + offs64(b, stride_cb) + offs64(h, stride_ch)
            c = tl.load(c_base + offs64(u // TILE_ROWS, stride_ct)[:, None] + d[None, :], mask=rmask[:, None],
                        other=0.0).to(tl.float32)
            if HAS_G:
                g_base = G + offs64(b, stride_gb) + offs64(h, stride_gh)
                g = tl.load(g_base + offs64(rows, stride_gs)[:, None] + d[None, :], mask=rmask[:, None],
                            other=0.0).to(tl.float32)
                c = c * g
            acc = acc + c
        o_base = OUT + offs64(b, stride_ob) + offs64(h, stride_oh)
        tl.store(o_base + offs64(rows, stride_os)[:, None] + d[None, :], acc.to(OUT.dtype.element_ty),
                 mask=rmask[:, None])


def _lastdim_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def pack_triton(x: torch.Tensor, tile_src: torch.Tensor) -> torch.Tensor:
    B, H, S, D = x.shape
    x = _lastdim_contig(x)
    src = tile_src.to(device=x.device, dtype=torch.int64).contiguous()
    P = src.numel()
    out = torch.empty(B, H, P, D, device=x.device, dtype=x.dtype)
    _pack_kernel[(P // TILE, B * H)](x, out, src, H, x.stride(0), x.stride(1), x.stride(2),
                                     out.stride(0), out.stride(1), out.stride(2), D=D, BLOCK=TILE)
    return out


def unpack_combine_triton(fine: torch.Tensor, untile_index: torch.Tensor, coarse: Optional[torch.Tensor] = None,
                          gate: Optional[torch.Tensor] = None, tile: int = TILE) -> torch.Tensor:
    B, H, P, D = fine.shape
    fine = _lastdim_contig(fine)
    u = untile_index.to(device=fine.device, dtype=torch.int64).contiguous()
    S = u.numel()
    out = torch.empty(B, H, S, D, device=fine.device, dtype=fine.dtype)
    c = _lastdim_contig(coarse) if coarse is not None else fine
    g = _lastdim_contig(gate) if gate is not None else fine
    blk = 64
    _unpack_combine_kernel[(triton.cdiv(S, blk), B * H)](
        fine, c, g, out, u, S, H,
        fine.stride(0), fine.stride(1), fine.stride(2), c.stride(0), c.stride(1), c.stride(2),
        g.stride(0), g.stride(1), g.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=D, BLOCK=blk, TILE_ROWS=tile, HAS_C=coarse is not None, HAS_G=gate is not None)
    return out


def _triton_check(q, explicit: bool):
    hd = q.head_dim
    bad_hd = None if hd >= 16 and not hd & (hd - 1) else f"head_dim must be a power of two >= 16 (got {hd})"
    return triton_check(q, explicit, HAS_TRITON, bad_hd)


def _define_ops():
    pack_op, unpack_op = existing_custom_op("vsa_pack_triton"), existing_custom_op("vsa_unpack_combine_triton")
    if pack_op is not None and unpack_op is not None:   # defined by an earlier import of the pack
        return pack_op, unpack_op

    @torch.library.custom_op("ditkit::vsa_pack_triton", mutates_args=())
    def vsa_pack_triton(x: torch.Tensor, tile_src: torch.Tensor) -> torch.Tensor:
        return pack_triton(x, tile_src)

    @vsa_pack_triton.register_fake
    def _(x, tile_src):
        return x.new_empty(*x.shape[:-2], tile_src.shape[0], x.shape[-1])

    @torch.library.custom_op("ditkit::vsa_unpack_combine_triton", mutates_args=())
    def vsa_unpack_combine_triton(fine: torch.Tensor, untile_index: torch.Tensor, coarse: Optional[torch.Tensor],
                                  gate: Optional[torch.Tensor]) -> torch.Tensor:
        return unpack_combine_triton(fine, untile_index, coarse, gate)

    @vsa_unpack_combine_triton.register_fake
    def _(fine, untile_index, coarse, gate):
        return fine.new_empty(*fine.shape[:-2], untile_index.shape[0], fine.shape[-1])

    return torch.ops.ditkit.vsa_pack_triton, torch.ops.ditkit.vsa_unpack_combine_triton


PACK_OP, UNPACK_OP = _define_ops() if HAS_TRITON else (None, None)


def pack_triton_op(x: torch.Tensor, tile_src: torch.Tensor) -> torch.Tensor:
    return PACK_OP(x, tile_src)


def unpack_combine_triton_op(fine: torch.Tensor, untile_index: torch.Tensor, coarse: Optional[torch.Tensor] = None,
                             gate: Optional[torch.Tensor] = None, tile: int = TILE) -> torch.Tensor:
    return UNPACK_OP(fine, untile_index, coarse, gate)


REGISTRY.op("vsa_pack", pack_reference)
REGISTRY.op("vsa_unpack_combine", unpack_combine_reference)
REGISTRY.impl("vsa_pack", Impl("triton", pack_triton_op if HAS_TRITON else None, _triton_check, priority=10))
REGISTRY.impl("vsa_unpack_combine", Impl("triton", unpack_combine_triton_op if HAS_TRITON else None, _triton_check,
                                         priority=10))
