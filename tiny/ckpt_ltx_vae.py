"""Tiny LTX-2 video VAE: the real key layout and block structure, small widths declared in the file's metadata.

``ltx_vae`` -> ``vae/ltx2_video_vae_tiny.safetensors``. ComfyUI's stock VAELoader recognises an LTX video VAE by
``decoder.up_blocks.0.res_blocks.0.conv1.conv.weight`` and builds ``CausalVideoAutoencoder`` (``comfy/ldm/
lightricks/vae/causal_video_autoencoder.py`` ``VideoVAE``) from the ``config`` JSON in the safetensors
``__metadata__`` (its ``vae`` entry), as the released LTX-2 files carry it. The tiny file uses that mechanism: the
structure of the LTX-2 VAE (ComfyUI's version-2 default: patch 4, pixel norm, causal 3-D convs, encoder
``res_x`` / ``compress_space_res`` / ``compress_time_res`` / ``compress_all_res`` space-to-depth stages, decoder
``res_x`` + residual ``compress_all`` depth-to-space stages, ``uniform`` log-variance, per-channel latent
statistics) with one layer per ``res_x`` and base widths 8 (encoder 8 -> 128, decoder 64 -> 8) instead of 128.
Ratios and latent width stay real: 128 latent channels, 32x spatial, 8x temporal (``1 + 8k`` frames), so the
stock ``EmptyLTXVLatentVideo`` latent and the tiny LTX-2 DiT (``tiny/ckpt_ltx.py``) fit. No timestep
conditioning (a config flag; the tiny decoder has no time embedder).

Plain torch (no ComfyUI imports); fixed seed, so two runs write byte-identical files. bf16 like the release.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..loaders.safetensors_io import save_file
from .checkpoints import register

LTX_VAE_FILE = "vae/ltx2_video_vae_tiny.safetensors"
SEED = 20261205
LATENT = 128        # processor() statistics are fixed at 128 channels in ComfyUI
PATCH = 4
ENC_BASE = 8
DEC_BASE = 8

CONFIG: dict = {
    "_class_name": "CausalVideoAutoencoder",
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": LATENT,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_time_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}]],
    "encoder_base_channels": ENC_BASE, "decoder_base_channels": DEC_BASE,
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": PATCH, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
}
STRIDES = {"compress_space_res": (1, 2, 2), "compress_time_res": (2, 1, 1), "compress_all_res": (2, 2, 2),
           "compress_all": (2, 2, 2)}


def _conv(inv, name, cin, cout, k=3):
    inv[name + ".conv.weight"] = (cout, cin, k, k, k)     # CausalConv3d wraps its Conv3d as ``.conv``
    inv[name + ".conv.bias"] = (cout,)


def _res_x(inv, name, c, layers):
    for i in range(layers):          # pixel norm: no norm parameters; in == out: no shortcut
        _conv(inv, f"{name}.res_blocks.{i}.conv1", c, c)
        _conv(inv, f"{name}.res_blocks.{i}.conv2", c, c)


def inventory(cfg: dict = CONFIG) -> dict[str, tuple[int, ...]]:
    """Key -> shape for ``cfg`` (the subset of block kinds the tiny config uses)."""
    inv: dict[str, tuple[int, ...]] = {}
    c = cfg["encoder_base_channels"]
    _conv(inv, "encoder.conv_in", 3 * PATCH ** 2, c)
    for i, (kind, p) in enumerate(cfg["encoder_blocks"]):
        if kind == "res_x":
            _res_x(inv, f"encoder.down_blocks.{i}", c, p["num_layers"])
        else:                         # space-to-depth: conv to out / prod(stride), then rearranged
            out = c * p["multiplier"]
            st = STRIDES[kind]
            _conv(inv, f"encoder.down_blocks.{i}.conv", c, out // (st[0] * st[1] * st[2]))
            c = out
    _conv(inv, "encoder.conv_out", c, LATENT + 1)          # uniform log-variance: one extra channel
    c = cfg["decoder_base_channels"]
    for kind, p in cfg["decoder_blocks"]:
        if kind == "compress_all":
            c *= p["multiplier"]
    _conv(inv, "decoder.conv_in", LATENT, c)
    for i, (kind, p) in enumerate(reversed(cfg["decoder_blocks"])):
        if kind == "res_x":
            _res_x(inv, f"decoder.up_blocks.{i}", c, p["num_layers"])
        else:                         # depth-to-space: conv to prod(stride) * in / multiplier, then rearranged
            _conv(inv, f"decoder.up_blocks.{i}.conv", c, 8 * c // p["multiplier"])
            c //= p["multiplier"]
    _conv(inv, "decoder.conv_out", c, 3 * PATCH ** 2)
    inv["per_channel_statistics.std-of-means"] = (LATENT,)
    inv["per_channel_statistics.mean-of-means"] = (LATENT,)
    return inv


def state_dict(seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in inventory().items():
        if k.endswith("std-of-means"):
            t = 1.0 + 0.1 * torch.rand(shape, generator=g)
        elif k.endswith("mean-of-means"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif k.endswith(".bias"):
            t = 0.01 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[1] * shape[2] * shape[3] * shape[4]
            t = torch.randn(shape, generator=g) * (0.5 * fan_in ** -0.5 if ".res_blocks." in k else fan_in ** -0.5)
        sd[k] = t.to(torch.bfloat16)
    return sd


def metadata() -> dict[str, str]:
    return {"config": json.dumps({"vae": CONFIG}, sort_keys=True)}


@register("ltx_vae")
def gen_ltx_vae(out: Path) -> list[Path]:
    path = Path(out) / LTX_VAE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state_dict(), path, metadata=metadata())
    return [path]
