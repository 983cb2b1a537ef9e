"""Tiny MiniMax H3 VAE checkpoints (video VAE, single-frame image VAE, audio VAE) with the real key layout.

Written into ``OUTDIR/vae/``:

* ``h3_video_vae_tiny.safetensors`` — the ComfyUI video-VAE inventory of h3.md §4.4 (encoder 6 levels x 2
  ResnetBlock3D, nin_shortcut at levels 1/3/5, downsample at levels 0-3, quant/post_quant convs, ViT decoder with
  register tokens + mask_token, ``latents_mean``/``latents_std``), scaled down: ``ch 32, ch_mult [1,2,2,3,3,4]``
  (GroupNorm(32)-compatible widths), 24 latent channels, a 2-layer ViT decoder of 2 heads x 64 (dim_head kept at the
  stock 64, so ``heads = dim / 64`` is what a loader reads back from the shapes; RoPE uses 48 of 64 dims, divisible
  by 6). Ratios stay stock: 16x spatial, 4x temporal, patch 3x4x16x16 = 3072 outputs per token. F16 like the
  Comfy-Org repack.
* ``h3_image_vae_tiny.safetensors`` — the same structure with the single-frame image-VAE ``__metadata__`` of h3.md
  §4.6 (``h3_t1_direct "true"``, ``h3_t1_format "full_decoder_v1"``, ``h3_t1_output_slice "3"``,
  ``minimax_h3_video_vae`` JSON carrying the file's own whitening stats and the STOCK ``source_config``). As in the
  released fine-tune the encoder, ``quant_conv``, ``latents_mean/std`` and ``mask_token`` are byte-identical to the
  video VAE; the decoder and ``post_quant_conv`` differ ("pure decoder swap").
  How a tiny file carries valid metadata: ``source_config`` describes the architecture FAMILY and must equal the
  stock config field by field (the strict rule); the file's tensor shapes are then checked against the config
  DETECTED from the file's own shapes (the same key inventory, ratios, latent width and dim_head as stock; only the
  widths ch / ch_mult values / decoder layers / heads may be scaled down). See ``vae/metadata.py``.
* ``h3_audio_vae_tiny.safetensors`` — the ComfyUI H3 audio VAE layout of h3.md §5 (DAC encoder, AttnProjection
  ``pre_block`` with ``zero_k_bias``, ``mean_proj``/``logs_proj``, ``dec_in_proj``, BigVGAN with 7 upsamples and 21
  AMP blocks with Kaiser-sinc filter buffers, weight-norm folded), scaled down: encoder_dim 2, latent_dim 64,
  decoder_dim 256; 32 latent channels and hop 800 kept. F32 like ComfyUI's converted file.

Plain torch (no ComfyUI imports); deterministic seeds, so two runs write byte-identical files.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from ..loaders.safetensors_io import save_file
from ..vae.h3_layout import STOCK_SOURCE_CONFIG, audio_vae_plan, video_vae_plan
from .checkpoints import register

VIDEO_VAE_NAME = "h3_video_vae_tiny.safetensors"
IMAGE_VAE_NAME = "h3_image_vae_tiny.safetensors"
AUDIO_VAE_NAME = "h3_audio_vae_tiny.safetensors"

# the tiny video VAE config (what a loader detects back from the shapes)
TINY_VIDEO_CONFIG = {
    "ch": 32, "ch_mult": [1, 2, 2, 3, 3, 4], "num_res_blocks": 2, "z_channels": 24, "embed_dim": 24,
    "space_down": [2, 2, 2, 2, 1, 1], "time_down": [1, 2, 2, 1, 1, 1],
    "dec_layers": 2, "dec_heads": 2, "dec_dim_head": 64, "num_register_tokens": 4, "ffn_mult": 4,
    "patch_size": 16, "patch_size_t": 4, "out_channels": 3,
}

TINY_AUDIO_CONFIG = {"encoder_dim": 2, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 64, "decoder_dim": 256,
                     "latent_channels": 32, "upsample_rates": [5, 5, 2, 2, 2, 2, 2],
                     "upsample_kernel_sizes": [9, 9, 4, 4, 4, 4, 4], "resblock_kernel_sizes": [3, 7, 11],
                     "resblock_dilations": [1, 3, 5], "num_heads": 8}

# ---------------------------------------------------------------------------------------------- values

def _kaiser_sinc(cutoff: float, half_width: float, size: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass (the standard anti-aliasing filter design), normalised to unit DC gain."""
    half = size // 2
    atten = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    beta = 0.1102 * (atten - 8.7) if atten > 50 else (0.5842 * (atten - 21) ** 0.4 + 0.07886 * (atten - 21)
                                                      if atten >= 21 else 0.0)
    win = torch.kaiser_window(size, periodic=False, beta=beta, dtype=torch.float64)
    t = (torch.arange(-half, half, dtype=torch.float64) + 0.5) if size % 2 == 0 else \
        (torch.arange(size, dtype=torch.float64) - half)
    f = 2 * cutoff * win * torch.sinc(2 * cutoff * t)
    return (f / f.sum()).float().view(1, 1, size)


def _value(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Deterministic, numerically tame values by role (fan-in scaled weights, unit norms, small residual scales)."""
    leaf = key.rsplit(".", 1)[-1]
    if key.endswith("lowpass.filter"):
        return _kaiser_sinc(0.25, 0.3, shape[-1])
    if key.endswith("upsample.filter"):
        return _kaiser_sinc(0.25, 0.3, shape[-1])
    if key.endswith("zero_k_bias") or key.endswith("mask_token"):
        return torch.zeros(shape)
    if key == "latents_std":
        return 0.5 + 2.5 * torch.rand(shape, generator=g)
    if key == "latents_mean":
        return 0.6 * torch.randn(shape, generator=g)
    if leaf in ("scale1", "scale2"):
        return 0.2 + 0.05 * torch.randn(shape, generator=g)
    if leaf in ("alpha", "beta"):
        return 0.1 * torch.randn(shape, generator=g)  # Snake(Beta) log-scale parameters
    is_norm = any(s in key for s in (".norm", "norm_out", "norm1", "norm2", "norm3"))
    if leaf == "weight" and len(shape) == 1 and is_norm:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if leaf == "bias" and len(shape) == 1:
        return 0.02 * torch.randn(shape, generator=g)
    if leaf in ("q_bias", "v_bias"):
        return 0.02 * torch.randn(shape, generator=g)
    if key.endswith("register_tokens"):
        return 0.5 * torch.randn(shape, generator=g)
    fan_in = 1
    for s in shape[1:]:
        fan_in *= s
    if ".ups." in key:  # ConvTranspose1d weight is [in, out, k]
        fan_in = shape[0] * shape[-1] // 2
    return torch.randn(shape, generator=g) / math.sqrt(max(fan_in, 1))


def make_state_dict(plan: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(plan):
        v = _value(k, plan[k], g).to(dtype)
        if k in ("latents_mean", "latents_std"):
            v = v.float()  # ComfyUI files keep the whitening buffers; float32 keeps the JSON copy exact
        out[k] = v
    return out


def image_vae_metadata(sd: dict[str, torch.Tensor], output_slice: str = "3") -> dict[str, str]:
    """The §4.6 metadata for an image VAE whose whitening stats are those of ``sd``."""
    cfg = {
        "latents_mean": [float(x) for x in sd["latents_mean"].double().tolist()],
        "latents_std": [float(x) for x in sd["latents_std"].double().tolist()],
        "vae_clip_length": 17,
        "vae_token_drop": 3,
        "source_config": STOCK_SOURCE_CONFIG,
    }
    return {
        "h3_t1_direct": "true",
        "h3_t1_format": "full_decoder_v1",
        "h3_t1_output_slice": output_slice,
        "minimax_h3_video_vae": json.dumps(cfg, separators=(",", ":")),
        "h3_t1_decoder_sha256": "0" * 64,
        "h3_t1_base_sha256": "0" * 64,
    }


def video_vae_state_dict() -> dict[str, torch.Tensor]:
    return make_state_dict(video_vae_plan(TINY_VIDEO_CONFIG), seed=3101, dtype=torch.float16)


def image_vae_state_dict() -> dict[str, torch.Tensor]:
    base = video_vae_state_dict()
    swap = make_state_dict(video_vae_plan(TINY_VIDEO_CONFIG), seed=3102, dtype=torch.float16)
    out = {}
    for k, v in base.items():
        out[k] = swap[k] if (k.startswith("decoder.") and k != "decoder.mask_token") or k.startswith("post_quant_conv.") \
            else v
    return out


def _save(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``save_file`` + canonical metadata order (the writer serialises ``__metadata__`` from a hash map, whose
    order changes between runs); the header is rewritten in place at the same length, so the file stays valid."""
    save_file(sd, path, metadata=metadata)
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n).decode("utf-8"))
        head["__metadata__"] = dict(sorted(head["__metadata__"].items()))
        text = json.dumps(head, separators=(",", ":")).encode("utf-8")
        if len(text) > n:  # cannot happen (same content, compact form), but never write a corrupt header
            raise RuntimeError(f"{path}: canonical header longer than the written one")
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


@register("h3_video_vae_tiny")
def gen_video_vae(outdir: Path) -> list[Path]:
    d = Path(outdir) / "vae"
    d.mkdir(parents=True, exist_ok=True)
    path = d / VIDEO_VAE_NAME
    _save(video_vae_state_dict(), path, metadata={"ditkit_tiny": "h3_video_vae"})
    return [path]


@register("h3_image_vae_tiny")
def gen_image_vae(outdir: Path) -> list[Path]:
    d = Path(outdir) / "vae"
    d.mkdir(parents=True, exist_ok=True)
    path = d / IMAGE_VAE_NAME
    sd = image_vae_state_dict()
    _save(sd, path, metadata=image_vae_metadata(sd))
    return [path]


@register("h3_audio_vae_tiny")
def gen_audio_vae(outdir: Path) -> list[Path]:
    d = Path(outdir) / "vae"
    d.mkdir(parents=True, exist_ok=True)
    path = d / AUDIO_VAE_NAME
    _save(make_state_dict(audio_vae_plan(TINY_AUDIO_CONFIG), seed=3103, dtype=torch.float32), path,
              metadata={"ditkit_tiny": "h3_audio_vae"})
    return [path]
