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

# The stock AutoencoderKLLegacy source config (h3.md §4.1/§4.6): what `minimax_h3_video_vae.source_config` must say.
STOCK_SOURCE_CONFIG = {
    "embed_dim": 24, "z_channels": 24, "vae_ratio": 16, "vae_ratio_t": 4, "ch": 128, "ch_mult": [1, 2, 2, 4, 4, 8],
    "space_down": [2, 2, 2, 2, 1, 1], "time_down": [1, 2, 2, 1, 1, 1], "space_up": [2, 2, 2, 2, 1, 1],
    "num_res_blocks": 2, "scaling_factor": 1.0, "shift_factor": 0.0, "attn_resolutions": None, "dropout": None,
    "pixel_norm_type": "imagenet", "padding_mode": "reflect", "causal_encoder": True, "causal_decoder": False,
    "use_vit_decoder": True, "use_3d_conv": True, "use_t_isolated_gn": True,
    "vit_decoder_kwargs": {"num_layers": 36, "heads": 32, "dim_head": 64, "rope_dim_ratio": 0.75,
                           "rope_theta": 100.0, "norm_type": "rms_norm", "norm_affine": True,
                           "qk_norm_type": "rms_norm", "qk_norm_affine": False, "ffn_type": "silu_gated"},
}


# ---------------------------------------------------------------------------------------------- key plans

def video_vae_plan(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a ComfyUI H3 video VAE state dict for the given (possibly scaled) config."""
    ch, mult, nrb = cfg["ch"], cfg["ch_mult"], cfg["num_res_blocks"]
    z, emb = cfg["z_channels"], cfg["embed_dim"]
    mid = [ch * m for m in mult]
    cin = [mid[0]] + mid[:-1]
    p: dict[str, tuple[int, ...]] = {}
    p["encoder.conv_in.weight"] = (mid[0], 3, 3, 3, 3)
    p["encoder.conv_in.bias"] = (mid[0],)
    for lvl in range(len(mult)):
        for i in range(nrb):
            ci = cin[lvl] if i == 0 else mid[lvl]
            co = mid[lvl]
            pre = f"encoder.down.{lvl}.block.{i}."
            p[pre + "norm1.weight"] = (ci,)
            p[pre + "norm1.bias"] = (ci,)
            p[pre + "conv1.weight"] = (co, ci, 3, 3, 3)
            p[pre + "conv1.bias"] = (co,)
            p[pre + "norm2.weight"] = (co,)
            p[pre + "norm2.bias"] = (co,)
            p[pre + "conv2.weight"] = (co, co, 3, 3, 3)
            p[pre + "conv2.bias"] = (co,)
            if ci != co:
                p[pre + "nin_shortcut.weight"] = (co, ci, 1, 1, 1)
                p[pre + "nin_shortcut.bias"] = (co,)
        if cfg["space_down"][lvl] * cfg["time_down"][lvl] > 1:
            p[f"encoder.down.{lvl}.downsample.conv.weight"] = (mid[lvl], mid[lvl], 3, 3, 3)
            p[f"encoder.down.{lvl}.downsample.conv.bias"] = (mid[lvl],)
    p["encoder.norm_out.weight"] = (mid[-1],)
    p["encoder.norm_out.bias"] = (mid[-1],)
    p["encoder.conv_out.weight"] = (2 * z, mid[-1], 3, 3, 3)
    p["encoder.conv_out.bias"] = (2 * z,)
    p["quant_conv.weight"] = (2 * emb, 2 * z, 1, 1, 1)
    p["quant_conv.bias"] = (2 * emb,)
    p["post_quant_conv.weight"] = (z, emb, 1, 1, 1)
    p["post_quant_conv.bias"] = (z,)
    dim = cfg["dec_heads"] * cfg["dec_dim_head"]
    inner = dim * cfg["ffn_mult"]
    p["decoder.x_embedder.weight"] = (dim, z)
    p["decoder.x_embedder.bias"] = (dim,)
    p["decoder.register_tokens"] = (1, cfg["num_register_tokens"], dim)
    p["decoder.mask_token"] = (1, 1, dim)
    for k in range(cfg["dec_layers"]):
        pre = f"decoder.transformer_blocks.{k}."
        p[pre + "norm1.weight"] = (dim,)
        p[pre + "attn.to_qkv.weight"] = (3 * dim, dim)
        p[pre + "attn.to_qkv.bias"] = (3 * dim,)
        p[pre + "attn.to_out.weight"] = (dim, dim)
        p[pre + "attn.to_out.bias"] = (dim,)
        p[pre + "scale1"] = (dim,)
        p[pre + "norm2.weight"] = (dim,)
        p[pre + "ff.w1.weight"] = (2 * inner, dim)
        p[pre + "ff.w1.bias"] = (2 * inner,)
        p[pre + "ff.w2.weight"] = (dim, inner)
        p[pre + "ff.w2.bias"] = (dim,)
        p[pre + "scale2"] = (dim,)
    p["decoder.norm_out.weight"] = (dim,)
    p["decoder.norm_out.bias"] = (dim,)
    npix = cfg["out_channels"] * cfg["patch_size_t"] * cfg["patch_size"] ** 2
    p["decoder.proj_out.weight"] = (npix, dim)
    p["decoder.proj_out.bias"] = (npix,)
    p["latents_mean"] = (z,)
    p["latents_std"] = (z,)
    return p


def audio_vae_plan(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a ComfyUI H3 audio VAE state dict (weight-norm folded) for the given config."""
    p: dict[str, tuple[int, ...]] = {}
    c = cfg["latent_channels"]
    lat = cfg["latent_dim"]
    p["latents_mean"] = (c,)
    p["latents_std"] = (c,)
    d = cfg["encoder_dim"]
    p["encoder.block.0.weight"] = (d, 1, 7)
    p["encoder.block.0.bias"] = (d,)
    for bi, stride in enumerate(cfg["encoder_rates"], start=1):
        half, d = d, d * 2
        pre = f"encoder.block.{bi}.block."
        for r in range(3):
            p[f"{pre}{r}.block.0.alpha"] = (1, half, 1)
            p[f"{pre}{r}.block.1.weight"] = (half, half, 7)
            p[f"{pre}{r}.block.1.bias"] = (half,)
            p[f"{pre}{r}.block.2.alpha"] = (1, half, 1)
            p[f"{pre}{r}.block.3.weight"] = (half, half, 1)
            p[f"{pre}{r}.block.3.bias"] = (half,)
        p[f"{pre}3.alpha"] = (1, half, 1)
        p[f"{pre}4.weight"] = (d, half, 2 * stride)
        p[f"{pre}4.bias"] = (d,)
    nb = len(cfg["encoder_rates"]) + 1
    p[f"encoder.block.{nb}.alpha"] = (1, d, 1)
    p[f"encoder.block.{nb + 1}.weight"] = (lat, d, 3)
    p[f"encoder.block.{nb + 1}.bias"] = (lat,)
    pb = "pre_block."
    p[pb + "norm1.weight"] = (lat,)
    p[pb + "norm1.bias"] = (lat,)
    p[pb + "attn.q_bias"] = (lat,)
    p[pb + "attn.v_bias"] = (lat,)
    p[pb + "attn.zero_k_bias"] = (lat,)
    p[pb + "attn.qkv.weight"] = (3 * lat, lat)
    p[pb + "attn.proj.weight"] = (c, c)
    p[pb + "attn.proj.bias"] = (c,)
    p[pb + "proj.weight"] = (c, lat)
    p[pb + "proj.bias"] = (c,)
    p[pb + "norm3.weight"] = (lat,)
    p[pb + "norm3.bias"] = (lat,)
    p[pb + "norm2.weight"] = (c,)
    p[pb + "norm2.bias"] = (c,)
    p[pb + "mlp.norm.weight"] = (c,)
    p[pb + "mlp.norm.bias"] = (c,)
    p[pb + "mlp.w0.weight"] = (2 * c, c)
    p[pb + "mlp.w0.bias"] = (2 * c,)
    p[pb + "mlp.w1.weight"] = (2 * c, c)
    p[pb + "mlp.w1.bias"] = (2 * c,)
    p[pb + "mlp.w2.weight"] = (c, 2 * c)
    p[pb + "mlp.w2.bias"] = (c,)
    for n in ("mean_proj", "logs_proj"):
        p[n + ".weight"] = (c, c, 1)
        p[n + ".bias"] = (c,)
    p["dec_in_proj.weight"] = (lat, c, 1)
    p["dec_in_proj.bias"] = (lat,)
    dd = cfg["decoder_dim"]
    p["decoder.conv_pre.weight"] = (dd, lat, 7)
    p["decoder.conv_pre.bias"] = (dd,)
    for i, k in enumerate(cfg["upsample_kernel_sizes"]):
        ci, co = dd // 2 ** i, dd // 2 ** (i + 1)
        p[f"decoder.ups.{i}.0.weight"] = (ci, co, k)
        p[f"decoder.ups.{i}.0.bias"] = (co,)
    rb = 0
    nd = len(cfg["resblock_dilations"])
    for i in range(len(cfg["upsample_rates"])):
        chn = dd // 2 ** (i + 1)
        for k in cfg["resblock_kernel_sizes"]:
            pre = f"decoder.resblocks.{rb}."
            for j in range(nd):
                for conv in ("convs1", "convs2"):
                    p[f"{pre}{conv}.{j}.weight"] = (chn, chn, k)
                    p[f"{pre}{conv}.{j}.bias"] = (chn,)
            for a in range(2 * nd):
                _snake_beta_act(p, f"{pre}activations.{a}.", chn)
            rb += 1
    chn = dd // 2 ** len(cfg["upsample_rates"])
    _snake_beta_act(p, "decoder.activation_post.", chn)
    p["decoder.conv_post.weight"] = (1, chn, 7)
    return p


def _snake_beta_act(p: dict, pre: str, chn: int) -> None:
    p[pre + "act.alpha"] = (chn,)
    p[pre + "act.beta"] = (chn,)
    p[pre + "upsample.filter"] = (1, 1, 12)
    p[pre + "downsample.lowpass.filter"] = (1, 1, 12)


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
