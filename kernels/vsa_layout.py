"""VSA-H3 tile geometry for H3's packed sequence ``[prefix segments | video]``.

Plain torch, no ComfyUI. Semantics follow FastVideo's ``video_sparse_attn_h3`` (tile 64):

* every prefix segment (text, cond keyframes, cond/ref audio, target audio ...) is cut into 64-row tiles with
  a remainder tile, never crossing a segment boundary;
* the video grid ``(T, H, W)`` (post-patch tokens, rows in t,h,w raster order) is cut into (4,4,4) cubes in
  (t,h,w) raster order, tokens inside a cube in raster order, edge cubes truncated;
* inside the padded tile buffer the live rows of tile ``i`` sit at ``i*64 + j`` for ``j < sizes[i]``; the
  other rows are padding and must be zero (pooling sums them).

``H3TileLayout.tile_src[p]`` is the packed row stored at padded position ``p`` (or -1 for a pad row) and
``untile_index[r]`` is the padded position of packed row ``r`` (FastVideo's ``untile_combined_index``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..errors import DitKitError
from .vsa_select import compute_topk  # noqa: F401  (FastVideo's count; re-exported)

TILE = 64
VIDEO_CUBE = (4, 4, 4)


class LayoutError(DitKitError):
    """A packed-sequence geometry that VSA-H3 cannot tile (sizes, lengths, metadata drift)."""


@dataclass(frozen=True)
class H3TileLayout:
    prefix_segments: tuple[int, ...]
    video_shape: tuple[int, int, int]
    tile: int
    sizes: torch.Tensor            # [n_tiles] int64, live rows per tile
    tile_src: torch.Tensor         # [n_tiles*tile] int64, packed row or -1
    untile_index: torch.Tensor     # [seq_len] int64, padded position of each packed row
    num_prefix_tiles: int
    num_video_tiles: int
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def seq_len(self) -> int:
        return sum(self.prefix_segments) + math.prod(self.video_shape)

    @property
    def prefix_len(self) -> int:
        return sum(self.prefix_segments)

    @property
    def n_tiles(self) -> int:
        return int(self.sizes.numel())

    @property
    def padded_len(self) -> int:
        return self.n_tiles * self.tile

    def to(self, device) -> "H3TileLayout":
        device = torch.device(device)
        if self.sizes.device == device:
            return self
        return _layout_on(self, device)

    def topk(self, keep: float) -> int:
        """Video tiles kept at fraction ``keep``: FastVideo ``compute_topk(1 - keep, n_video_tiles)``."""
        return compute_topk(1.0 - keep, self.num_video_tiles)

    def topk_sparsity(self, sparsity: float) -> int:
        """Video tiles kept at FastVideo ``VSA_sparsity``: ``compute_topk(sparsity, n_video_tiles)``."""
        return compute_topk(sparsity, self.num_video_tiles)

    def describe(self) -> str:
        return (f"prefix={self.prefix_segments} video={self.video_shape} tiles={self.num_prefix_tiles}+"
                f"{self.num_video_tiles} padded={self.padded_len} rows for {self.seq_len}")


def video_tile_partition(video_shape: tuple[int, int, int], cube=VIDEO_CUBE) -> tuple[torch.Tensor, torch.Tensor]:
    """(raster indices in tile-major order, live tokens per cube) for a (T,H,W) grid."""
    t, h, w = video_shape
    ct, ch, cw = cube
    idx = torch.arange(t * h * w, dtype=torch.int64).view(t, h, w)
    order, sizes = [], []
    for ti in range(0, t, ct):
        for hi in range(0, h, ch):
            for wi in range(0, w, cw):
                blk = idx[ti:ti + ct, hi:hi + ch, wi:wi + cw].reshape(-1)
                order.append(blk)
                sizes.append(blk.numel())
    if not order:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(order), torch.tensor(sizes, dtype=torch.int64)


@lru_cache(maxsize=16)
def build_h3_layout(prefix_segments: tuple[int, ...], video_shape: tuple[int, int, int],
                    tile: int = TILE) -> H3TileLayout:
    """Tile geometry of a packed ``[prefix | video]`` sequence (CPU tensors; cached per geometry)."""
    if tile != TILE:
        raise LayoutError(f"VSA-H3 tile must be {TILE} (FastH3 trains (4,4,4) cubes); got {tile}")
    prefix_segments = tuple(int(s) for s in prefix_segments if int(s) > 0)
    video_shape = tuple(int(x) for x in video_shape)
    if len(video_shape) != 3 or min(video_shape) <= 0:
        raise LayoutError(f"VSA-H3 needs a non-empty (T, H, W) video grid, got {video_shape}")
    prefix_len = sum(prefix_segments)
    sizes: list[int] = []
    for seg in prefix_segments:
        full, rem = divmod(seg, tile)
        sizes.extend([tile] * full)
        if rem:
            sizes.append(rem)
    n_prefix = len(sizes)
    vorder, vsizes = video_tile_partition(video_shape)
    sizes_t = torch.cat([torch.tensor(sizes, dtype=torch.int64), vsizes])
    n_tiles = sizes_t.numel()
    # packed rows in tile-major order
    order = torch.cat([torch.arange(prefix_len, dtype=torch.int64), vorder + prefix_len])
    # padded positions of the live rows: tile*64 + j for j < size
    live = (torch.arange(tile)[None, :] < sizes_t[:, None]).reshape(-1)
    non_pad = torch.nonzero(live).view(-1)
    tile_src = torch.full((n_tiles * tile,), -1, dtype=torch.int64)
    tile_src[non_pad] = order
    untile = torch.empty(order.numel(), dtype=torch.int64)
    untile[order] = non_pad
    layout = H3TileLayout(prefix_segments, video_shape, tile, sizes_t, tile_src, untile, n_prefix,
                          int(vsizes.numel()))
    validate_layout(layout)
    return layout


def validate_layout(layout: H3TileLayout) -> None:
    """Synchronous geometry guard (FastVideo ``_validate_h3_tile_geometry``): never let a bad index reach a kernel."""
    s = layout.sizes
    total = layout.seq_len
    if s.numel() == 0 or int(s.min()) < 1 or int(s.max()) > layout.tile or int(s.sum()) != total:
        raise LayoutError(f"VSA-H3 tile sizes out of bounds for {layout.describe()}: "
                          f"min={int(s.min()) if s.numel() else None} max={int(s.max()) if s.numel() else None} "
                          f"sum={int(s.sum())} expected {total}")
    u = layout.untile_index
    if u.numel() != total or int(u.min()) < 0 or int(u.max()) >= layout.padded_len:
        raise LayoutError(f"VSA-H3 untile index is not a map into the padded buffer ({layout.describe()})")
    if bool(((u % layout.tile) >= s[u // layout.tile]).any()) or torch.unique(u).numel() != total:
        raise LayoutError(f"VSA-H3 untile index is not injective into live slots ({layout.describe()})")


_DEVICE_CACHE: dict = {}


def _layout_on(layout: H3TileLayout, device: torch.device) -> H3TileLayout:
    key = (layout.prefix_segments, layout.video_shape, layout.tile, str(device))
    hit = _DEVICE_CACHE.get(key)
    if hit is None:
        hit = H3TileLayout(layout.prefix_segments, layout.video_shape, layout.tile, layout.sizes.to(device),
                           layout.tile_src.to(device), layout.untile_index.to(device), layout.num_prefix_tiles,
                           layout.num_video_tiles)
        if len(_DEVICE_CACHE) > 32:
            _DEVICE_CACHE.clear()
        _DEVICE_CACHE[key] = hit
    return hit


@dataclass(frozen=True)
class LayoutBuffers:
    """Index buffers derived from one layout on one device, identical for every attention call of that geometry
    (every block of every step): the pack gather index with pad slots pointing at row 0, the pad slots, the tile
    sizes in fp32 (pooling divisor) and the tile of each untile position (coarse-branch gather)."""

    gather: torch.Tensor      # [n_tiles*tile] int64, tile_src clamped at 0
    pad: torch.Tensor         # [n_pad] int64, padded positions with tile_src == -1
    sizes_f32: torch.Tensor   # [n_tiles] fp32
    untile_tiles: torch.Tensor  # [seq_len] int64, untile_index // tile


def layout_buffers(layout: H3TileLayout) -> LayoutBuffers:
    """The :class:`LayoutBuffers` of ``layout`` (on its device), built on first use and kept in ``layout.extra``.

    Layouts are cached per (prefix segments, video grid, tile) and per device (:func:`build_h3_layout`,
    :meth:`H3TileLayout.to`), so this is a cache keyed by (geometry, tile, device): exact, nothing depends on the
    activations."""
    buf = layout.extra.get("buffers")
    if buf is None:
        src = layout.tile_src
        buf = LayoutBuffers(src.clamp(min=0), torch.nonzero(src < 0).view(-1), layout.sizes.to(torch.float32),
                            layout.untile_index // layout.tile)
        layout.extra["buffers"] = buf
    return buf


def check_seq_len(layout: H3TileLayout, n: int) -> None:
    if n != layout.seq_len:
        raise LayoutError(f"VSA-H3 metadata was built for {layout.seq_len} packed rows, got {n} "
                          f"({layout.describe()}); a non-packed sequence (e.g. the token refiner) must stay dense")


def merge_prefix_segments(spans, classify) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """FastVideo's prefix segments from a packed span list ``[(start, stop, kind)]``.

    ``classify(kind)`` names the FastVideo class of a span kind (``"text"``, ``"visual"``, ``"audio"``,
    ``"video"``; None = unknown); the host's kind names live with the host (``bridge/attention.py``). FastVideo
    tiles ``[text | cond video rows | audio rows]`` as three segments, so adjacent spans of the same class are
    merged into one segment; the last span must be the target video. Returns (lengths, classes) of the prefix
    segments.
    """
    spans = [(int(a), int(b), str(k)) for a, b, k in spans]
    if not spans or classify(spans[-1][2]) != "video":
        raise LayoutError(f"VSA-H3 needs the target video as the last packed segment; got {spans}")
    pos = 0
    lengths: list[int] = []
    classes: list[str] = []
    for a, b, kind in spans[:-1]:
        if a != pos or b < a:
            raise LayoutError(f"VSA-H3 packed segments are not contiguous: {spans}")
        pos = b
        cls = classify(kind)
        if cls is None or cls == "video":
            raise LayoutError(f"VSA-H3 cannot place segment kind {kind!r} in the prefix ({spans})")
        if b == a:
            continue
        if classes and classes[-1] == cls:
            lengths[-1] += b - a
        else:
            lengths.append(b - a)
            classes.append(cls)
    if spans[-1][0] != pos:
        raise LayoutError(f"VSA-H3 packed segments are not contiguous: {spans}")
    return tuple(lengths), tuple(classes)
