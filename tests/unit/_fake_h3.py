"""A duck-typed stand-in for ComfyUI's H3 video VAE with the attributes and methods ditkit's T=1 decode core uses
(shared by test_vae_t1 and test_progress_callbacks; no ComfyUI needed)."""
from __future__ import annotations

import math

import torch


class FakeH3:
    """Minimal stand-in with the attributes/methods the core uses; the decoder mixes information across all
    tokens it is given (like attention), so the result depends on the temporal extent."""

    vae_ratio, tile_size, tile_overlap_min = 2, 8, 2
    tokens_chunk_size, token_overlap, frame_pre_padding = 5, 2, 3
    tiling = True

    def __init__(self, c=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.latents_mean = torch.randn(c, generator=g)
        self.latents_std = torch.rand(c, generator=g) + 0.5
        self.w = torch.randn(3, c, generator=g) / c ** 0.5
        self.wt = torch.randn(4, generator=g)
        self.decoder = type("D", (), {"patch_size_t": 4})()

    def _decode_temporal_chunks(self, t):
        return (5, 1) if t == 2 else (0, 1)

    def _decode_pixels(self, z):
        b, c, t, h, w = z.shape
        base = torch.einsum("bcthw,kc->bkthw", z, self.w)
        ctx = base.mean(dim=(2, 3, 4), keepdim=True)
        pos = ((torch.arange(0.5, t) / t) * 2 - 1).view(1, 1, t, 1, 1)  # extent-normalised, like the RoPE
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
        wgt = torch.arange(e, dtype=b.dtype) / e
        shape = [1] * a.ndim
        shape[dim] = e
        wgt = wgt.view(shape)
        blended = a.narrow(dim, a.shape[dim] - e, e) * (1 - wgt) + b.narrow(dim, 0, e) * wgt
        return torch.cat([blended, b.narrow(dim, e, b.shape[dim] - e)], dim=dim)

    def _finalize_pixels(self, x):
        return (x.float() * 0.5 + 0.5).clamp(0, 1)
