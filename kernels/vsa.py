"""VSA and VSA-H3 on top of the registry ops (plain torch; no ComfyUI).

Public entry points (FastVideo fastvideo-kernel 0.3.5 argument semantics, tile-ordered ``[B, H, S, D]``):

* :func:`video_sparse_attn` -- ``ops.video_sparse_attn``: coarse pooled attention, top-k key tiles per query
  tile, block-sparse fine stage, ``out = out_s + w * out_c`` (``w = compress_attn_weight`` or 1).
* :func:`block_sparse_attn` -- ``block_sparse_attn_from_indices``: ``(out, lse)``, lse in FastVideo's log2
  domain.

VSA-H3 (FastVideo ``video_sparse_attn_h3``, tile 64, "exempt" prefix): :func:`vsa_h3_attention` takes the
*packed* H3 sequence ``[B, H, S, D]`` plus its :class:`H3TileLayout`; pooled fp32 scores ``q̄·k̄ᵀ/√D``; prefix
query tiles dense; video query tiles see every prefix key tile plus the top ``k = ceil(keep·n_video)`` video
tiles; ``out = fine + gate ⊙ softmax(scores)·v̄`` where the gate is the checkpoint's ``to_gate_compress``
output (packed order) and the branch is skipped without one (FastVideo H3: "untrained inference is exactly
pure-sparse").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import DitKitError
from . import (block_sparse, block_sparse_comfy_kitchen, block_sparse_cpu, block_sparse_cpu_native,  # noqa: F401
               block_sparse_flashinfer, block_sparse_flex, block_sparse_triton, tile_pack)  # (register the backends)
from ._triton import HAS_TRITON
from .registry import REGISTRY, Selection
from .vsa_layout import TILE, H3TileLayout, check_seq_len, layout_buffers
from .vsa_select import fused_topk_mask, h3_block_mask, mask_to_index

LOG2E = block_sparse.LOG2E


# every backend registers itself on import; the Triton ones call their torch.library custom op (defined beside
# the launcher). CUSTOM_OPS: those ops by role (torch.compile tests).
CUSTOM_OPS = ({"bsa": block_sparse_triton.CUSTOM_OP, "pack": tile_pack.PACK_OP, "unpack": tile_pack.UNPACK_OP}
              if HAS_TRITON else {})


def _check_qkv(q, k, v):
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise DitKitError(f"expected q/k/v [B, H, S, D] with matching B, H, D; got {tuple(q.shape)}, "
                          f"{tuple(k.shape)}, {tuple(v.shape)}")


# ---------------------------------------------------------------------------------------------------------
def block_sparse_attn(q, k, v, q2k_index, q2k_num, variable_block_sizes, backend: Optional[str] = None):
    """Block-sparse attention over 64x64 tiles -> ``(out, lse_log2)`` (see ``block_sparse.py``)."""
    _check_qkv(q, k, v)
    if q.shape[2] % TILE or k.shape[2] % TILE:
        raise DitKitError(f"sequence lengths must be multiples of {TILE} (got {q.shape[2]}, {k.shape[2]}); "
                          "pad to whole tiles with zero rows")
    sel = REGISTRY.resolve("block_sparse_attn", q.device, q.dtype, q.shape[-1], backend)
    return sel.fn(q, k, v, q2k_index, q2k_num, variable_block_sizes)


def pool_tiles(x: torch.Tensor, sizes: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """fp32 mean of each tile's live rows (pad rows are zero): ``[B,H,P,D] -> [B,H,P/tile,D]`` fp32."""
    B, H, P, D = x.shape
    s = x.view(B, H, P // tile, tile, D).sum(dim=3, dtype=torch.float32)
    return s / sizes.to(device=x.device, dtype=torch.float32).view(1, 1, -1, 1)


def topk_index(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FastVideo ``fused_topk_mask(scores, k)`` (``vsa_select``; not always exactly k on ties) as ascending int32
    key-tile lists ``[B,H,T,Tk]`` and their counts."""
    return mask_to_index(fused_topk_mask(scores, k))


def video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                      compress_attn_weight: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """FastVideo ``video_sparse_attn`` on tile-ordered ``[B,H,S,D]`` (pad rows zero)."""
    _check_qkv(q, k, v)
    if isinstance(block_size, int):
        block_size = (block_size,) if block_size == TILE else (block_size,) * 3
    if math.prod(block_size) != TILE:
        raise DitKitError(f"only 64-element tiles are supported (got block_size={block_size})")
    B, H, S, D = q.shape
    T, Tk = S // TILE, k.shape[2] // TILE
    if S % TILE or k.shape[2] % TILE:
        raise DitKitError(f"q_seq_len and kv_seq_len must be divisible by {TILE}, got {S}, {k.shape[2]}")
    if variable_block_sizes.numel() != Tk or q_variable_block_sizes.numel() != T:
        raise DitKitError(f"variable_block_sizes needs {Tk} entries and q_variable_block_sizes {T}; got "
                          f"{variable_block_sizes.numel()} and {q_variable_block_sizes.numel()}")
    if int(topk) < 1:
        raise DitKitError(f"topk must be >= 1 key tile per query tile, got {topk}")
    topk = min(int(topk), Tk)                                      # fused_topk_mask: min(topk, kv_blocks)
    for name, vbs in (("variable_block_sizes", variable_block_sizes), ("q_variable_block_sizes", q_variable_block_sizes)):
        if vbs.numel() and (int(vbs.min()) < 1 or int(vbs.max()) > TILE):
            raise DitKitError(f"{name} must hold live rows per tile in 1..{TILE} (a 0 would make the pooled mean "
                              f"NaN); got min {int(vbs.min())}, max {int(vbs.max())}")
    qc = pool_tiles(q, q_variable_block_sizes).to(q.dtype)
    kc = pool_tiles(k, variable_block_sizes).to(k.dtype)
    vc = pool_tiles(v, variable_block_sizes).to(v.dtype)
    scores = torch.matmul(qc, kc.transpose(-2, -1)) / (D ** 0.5)
    out_c = torch.matmul(torch.softmax(scores, dim=-1), vc)                              # [B,H,T,D]
    idx, num = topk_index(scores.float(), topk)
    out_s, _ = block_sparse_attn(q, k, v, idx, num, variable_block_sizes, backend=backend)
    out_c = out_c.repeat_interleave(TILE, dim=2)
    if compress_attn_weight is not None:
        return out_c * compress_attn_weight + out_s
    return out_c + out_s


# ---------------------------------------------------------------------------------------------------------
# VSA-H3
def select_h3(scores: torch.Tensor, num_prefix_tiles: int, num_video_tiles: int, k_vid: int,
              exempt: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FastVideo ``_build_block_mask`` (``vsa_select.h3_block_mask``: exactly ``k_vid`` video tiles, ties to the
    lowest index) as ascending int32 index lists ``(q2k_index [B,H,T,T], q2k_num)``."""
    return mask_to_index(h3_block_mask(scores, num_prefix_tiles, num_video_tiles, k_vid, exempt))


REGISTRY.op("vsa_select", select_h3)   # pooled-score top-k: one implementation for every fine-stage backend


REUSE_LAYOUT_BUFFERS = True


@dataclass
class VSAStats:
    backend: str
    pack_backend: str
    block_pairs: int
    block_pairs_dense: int
    k_video: int
    n_tiles: int

    @property
    def density(self) -> float:
        return self.block_pairs / max(1, self.block_pairs_dense)


@dataclass(frozen=True)
class H3Kernels:
    """The registry selections one VSA-H3 call dispatches to (pack, pooled-score top-k, fine stage, unpack),
    resolved together for one (device, dtype, head_dim, requested backend): resolve once per forward with
    :func:`resolve_h3_kernels` and hand it to every :func:`vsa_h3_attention` call of that forward."""
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    request: Optional[str]
    pack: Selection
    select: Selection
    fine: Selection
    unpack: Selection

    def matches(self, q: torch.Tensor) -> bool:
        return q.dtype == self.dtype and q.shape[-1] == self.head_dim and q.device == self.device

    def describe(self) -> str:
        return (f"fine {self.fine.backend}, pack {self.pack.backend}, select {self.select.backend}, "
                f"unpack {self.unpack.backend} ({self.device.type} {str(self.dtype).replace('torch.', '')} "
                f"D={self.head_dim})")


def resolve_h3_kernels(device, dtype: torch.dtype, head_dim: int, backend: Optional[str] = None) -> H3Kernels:
    """The four selections of a VSA-H3 call (:class:`BackendError` for an explicit backend that cannot run)."""
    dev = torch.device(device)
    aux = "triton" if backend == "triton" else None   # pack/unpack follow the fine-stage request (see resolve_aux)
    return H3Kernels(dev, dtype, int(head_dim), backend,
                     pack=REGISTRY.resolve("vsa_pack", dev, dtype, head_dim, aux),
                     unpack=REGISTRY.resolve("vsa_unpack_combine", dev, dtype, head_dim, aux),
                     select=REGISTRY.resolve("vsa_select", dev, torch.float32, head_dim),
                     fine=REGISTRY.resolve("block_sparse_attn", dev, dtype, head_dim, backend))


def vsa_h3_attention(q, k, v, layout: H3TileLayout, keep: float, gate: Optional[torch.Tensor] = None,
                     exempt: bool = True, backend: Optional[str] = None,
                     sparsity: Optional[float] = None,
                     kernels: Optional[H3Kernels] = None) -> tuple[torch.Tensor, VSAStats]:
    """VSA-H3 over the packed sequence ``[B,H,S,D]`` -> (output in packed order, stats).

    The video tiles kept per query tile are FastVideo's ``compute_topk(sparsity, n_video)``; ``sparsity`` is
    FastVideo's ``VSA_sparsity`` (give it when known, e.g. from :func:`.vsa_select.sparsity_from_keep_percent`),
    else ``1 - keep``. ``kernels`` (from :func:`resolve_h3_kernels` for q's device, dtype and head dim) skips the
    per-call registry look-ups; without it they are resolved here for ``backend``."""
    _check_qkv(q, k, v)
    check_seq_len(layout, q.shape[2])
    if gate is not None and gate.shape != q.shape:
        raise DitKitError(f"gate must match q {tuple(q.shape)} (packed order); got {tuple(gate.shape)}")
    B, H, S, D = q.shape
    if kernels is None:
        kernels = resolve_h3_kernels(q.device, q.dtype, D, backend)
    elif not kernels.matches(q):
        raise DitKitError(f"VSA-H3 kernels were resolved for {kernels.describe()}, got q {q.device.type} "
                          f"{str(q.dtype).replace('torch.', '')} D={D}")
    lay = layout.to(q.device)
    pk, un, sel = kernels.pack, kernels.unpack, kernels.fine
    # per-geometry index buffers, built once per (geometry, device) and reused by every call (exact);
    # REUSE_LAYOUT_BUFFERS = False recomputes them in every call (the A side of bench_vsa_cpu.py --reuse)
    buf = layout_buffers(lay) if REUSE_LAYOUT_BUFFERS else None
    if buf is not None and pk.backend == "reference":
        qt, kt, vt = (pk.fn(x, lay.tile_src, buf.gather, buf.pad) for x in (q, k, v))
    else:
        qt, kt, vt = (pk.fn(x, lay.tile_src) for x in (q, k, v))
    sizes = buf.sizes_f32 if buf is not None else lay.sizes
    qp = pool_tiles(qt, sizes)
    kp = pool_tiles(kt, sizes)
    scores = torch.matmul(qp, kp.transpose(-2, -1)) / (D ** 0.5)
    k_vid = layout.topk_sparsity(sparsity) if sparsity is not None else layout.topk(keep)
    idx, num = kernels.select.fn(scores, lay.num_prefix_tiles, lay.num_video_tiles, k_vid, exempt)
    fine, _ = sel.fn(qt, kt, vt, idx, num, lay.sizes, need_lse=False)
    coarse = None
    if gate is not None:
        vp = pool_tiles(vt, sizes)
        coarse = torch.matmul(torch.softmax(scores, dim=-1), vp)
    if buf is not None and un.backend == "reference" and coarse is not None:
        out = un.fn(fine, lay.untile_index, coarse, gate, untile_tiles=buf.untile_tiles)
    else:
        out = un.fn(fine, lay.untile_index, coarse, gate)
    T = lay.n_tiles
    stats = VSAStats(sel.backend, pk.backend, int(num.long().sum()), B * H * T * T, k_vid, T)
    return out, stats


def resolve_aux(op: str, q: torch.Tensor, backend: Optional[str]) -> Selection:
    """Pack/unpack follow the fine-stage request: 'triton' -> triton, anything else -> auto."""
    req = "triton" if backend == "triton" else None
    return REGISTRY.resolve(op, q.device, q.dtype, q.shape[-1], req)
