"""Whole-file safetensors reads with a progress callback (loaders whose files take long to read).

Same bytes, same key order and same tensors as :func:`~ditkit.loaders.safetensors_io.load_with_metadata` (it reads
through :class:`~ditkit.loaders.safetensors_io.SafeFile`); ``progress(done, total)`` is called after each tensor,
``done`` counting tensors read (1..total). The core never imports ComfyUI: nodes pass a callback that drives the bar.
"""
from __future__ import annotations

import os

import torch

from ..report import ProgressFn
from .safetensors_io import SafeFile


def load_with_progress(path: str | os.PathLike, progress: ProgressFn | None = None,
                       device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, metadata) of a validated safetensors file, read one tensor at a time."""
    with SafeFile(path) as f:
        names = f.keys()
        total = len(names)
        sd: dict[str, torch.Tensor] = {}
        for done, k in enumerate(names, start=1):
            sd[k] = f.get(k, device)
            if progress is not None:
                progress(done, total)
        return sd, dict(f.metadata)
