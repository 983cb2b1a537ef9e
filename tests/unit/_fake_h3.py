"""The duck-typed stand-in for ComfyUI's H3 video VAE used by test_vae_t1 and test_progress_callbacks: the one in
benchmarks/_fakes.py (shared with gpu_check.py), at the unit tests' sizes (vae_ratio 2, 8-pixel tiles, overlap 2)."""
from __future__ import annotations

from benchmarks._fakes import FakeH3VideoVAE, full_tiled_decode


class FakeH3(FakeH3VideoVAE):
    def __init__(self, c=24, seed=0):
        super().__init__(c, seed)


__all__ = ["FakeH3", "full_tiled_decode"]
