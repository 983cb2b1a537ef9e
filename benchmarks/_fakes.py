"""Duck-typed stand-ins shared by ``gpu_check.py`` and the unit tests (one copy, no ComfyUI needed).

* :class:`FakeH3VideoVAE`: ComfyUI's H3 video VAE as ``bridge/vae.py`` reads it for the T=1 decode core, on
  any device. The decoder mixes every token it is given (context matters, like attention), 4 frames per token,
  ``vae_ratio`` x spatial upsampling.
* :func:`full_tiled_decode`: the T=1 oracle: decode every frame of every tile, blend the whole tiles, then crop
  (what slicing a frame before blending must reproduce exactly).

Importing this module imports torch.
"""
from __future__ import annotations

import math

import torch


class FakeH3VideoVAE:
    tokens_chunk_size, token_overlap, frame_pre_padding = 5, 2, 3
    tiling = True

    def __init__(self, c: int = 24, seed: int = 0, *, device="cpu", vae_ratio: int = 2, tile_size: int = 8,
                 tile_overlap_min: int = 2):
        g = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.vae_ratio, self.tile_size, self.tile_overlap_min = vae_ratio, tile_size, tile_overlap_min
        self.latents_mean = torch.randn(c, generator=g, device=device)
        self.latents_std = torch.rand(c, generator=g, device=device) + 0.5
        self.w = torch.randn(3, c, generator=g, device=device) / c ** 0.5
        self.wt = torch.randn(4, generator=g, device=device)
        self.decoder = type("D", (), {"patch_size_t": 4})()

    def _decode_temporal_chunks(self, t):
        return (5, 1) if t == 2 else (0, 1)

    def _decode_pixels(self, z):
        b, c, t, h, w = z.shape
        base = torch.einsum("bcthw,kc->bkthw", z, self.w)
        ctx = base.mean(dim=(2, 3, 4), keepdim=True)
        pos = ((torch.arange(0.5, t, device=z.device) / t) * 2 - 1).view(1, 1, t, 1, 1)  # extent-normalised, like RoPE
        frames = [torch.tanh(base * (p + 1) / 4 + ctx * self.wt[p] + 0.1 * pos * p) for p in range(4)]
        out = torch.stack(frames, dim=3).reshape(b, 3, 4 * t, h, w)
        return out.repeat_interleave(self.vae_ratio, -2).repeat_interleave(self.vae_ratio, -1)

    def split_tiles(self, n):
        if self.tile_size >= n:
            return [0], [n], []
        k = math.ceil((n - self.tile_overlap_min) / (self.tile_size - self.tile_overlap_min))
        step = (n - self.tile_size) // (k - 1)
        step -= step % self.vae_ratio
        starts = [i * step for i in range(k - 1)] + [n - self.tile_size]
        ov = [starts[i] + self.tile_size - starts[i + 1] for i in range(k - 1)]
        return starts, [self.tile_size] * k, ov

    def blend(self, a, b, e, dim):
        e = min(a.shape[dim], b.shape[dim], e)
        shape = [1] * a.ndim
        shape[dim] = e
        wgt = (torch.arange(e, dtype=b.dtype, device=b.device) / e).view(shape)
        blended = a.narrow(dim, a.shape[dim] - e, e) * (1 - wgt) + b.narrow(dim, 0, e) * wgt
        return torch.cat([blended, b.narrow(dim, e, b.shape[dim] - e)], dim=dim)

    def _finalize_pixels(self, x):
        return (x.float() * 0.5 + 0.5).clamp(0, 1)


def full_tiled_decode(m, z):
    """All frames, tiles blended (previous row's raw bottom strip, then the left raw strip), then cropped."""
    r = m.vae_ratio
    H, W = z.shape[-2] * r, z.shape[-1] * r
    ys, yl, yo = m.split_tiles(H)
    xs, xl, xo = m.split_tiles(W)
    raw = [[m._decode_pixels(z[..., y // r:(y + a) // r, x // r:(x + b) // r]) for x, b in zip(xs, xl)]
           for y, a in zip(ys, yl)]
    rows = []
    for i in range(len(ys)):
        row = []
        for j in range(len(xs)):
            t = raw[i][j]
            if i > 0:
                t = m.blend(raw[i - 1][j][..., -yo[i - 1]:, :], t, yo[i - 1], -2)
            if j > 0:
                t = m.blend(raw[i][j - 1][..., :, -xo[j - 1]:], t, xo[j - 1], -1)
            if i < len(ys) - 1:
                t = t[..., :-yo[i], :]
            if j < len(xs) - 1:
                t = t[..., :, :-xo[j]]
            row.append(t)
        rows.append(torch.cat(row, -1))
    return torch.cat(rows, -2)
