"""MiniMax H3 audio VAEs at the size of the file (DitKitH3VAELoader, audio files).

ComfyUI's VAE wrapper builds the stock audio VAE (DAC encoder 64, latent 2048, BigVGAN 1024) whatever the file
holds, so a smaller file of the same structure (ditkit's tiny audio VAE, a distilled one) fails with size
mismatches. Here the widths are read from the file's shapes (header only) and the whole key inventory must equal
ComfyUI's layout at those widths (``vae.h3_layout.audio_vae_plan``: every missing, unexpected or mis-shaped tensor is
refused by name, before any tensor is read); the stock wrapper is made on the meta device from the stock key
inventory (its audio settings: 32 latent channels, 800-sample hop, 32 kHz, memory estimates) and its model is
replaced by one built at the detected widths, like the scaled video VAE in h3_vae.py. A stock-size file goes
through ``comfy.sd.VAE`` unchanged.
"""
from __future__ import annotations

import os

import comfy.ldm.minimax.audio_vae as h3audio
import comfy.model_management as mm
import comfy.sd
import torch

from .hostcompat import patcher_kwargs
from ..errors import CheckpointError, UnsupportedModelError
from ..loaders.read_progress import load_with_progress
from ..loaders.safetensors_io import read_header
from ..vae.h3_layout import H3_AUDIO_KEY, audio_vae_plan, classify_vae_keys

# ComfyUI's MiniMaxH3AudioVAE defaults and BigVGAN's fixed decoder schedule (comfy/ldm/minimax/audio_vae.py)
STOCK = {"encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "decoder_dim": 1024,
         "latent_channels": 32, "upsample_rates": [5, 5, 2, 2, 2, 2, 2], "upsample_kernel_sizes": [9, 9, 4, 4, 4, 4, 4],
         "resblock_kernel_sizes": [3, 7, 11], "resblock_dilations": [1, 3, 5], "num_heads": 8}
FLOAT_DTYPES = {"F16", "BF16", "F32"}


def is_h3_audio_file(path: str) -> bool:
    return H3_AUDIO_KEY in read_header(path).keys()


def detect_audio_config(shapes: dict, where: str) -> dict:
    """The buildable dimensions from the shapes; the whole inventory must then equal ComfyUI's layout for them."""
    try:
        enc = int(shapes["encoder.block.0.weight"][0])
        lat = int(shapes["dec_in_proj.weight"][0])
        ch = int(shapes["latents_mean"][0])
        dd = int(shapes["decoder.conv_pre.weight"][0])
        rates = [int(shapes[f"encoder.block.{i}.block.4.weight"][2]) // 2 for i in range(1, len(STOCK["encoder_rates"]) + 1)]
    except (KeyError, IndexError) as e:
        raise CheckpointError(f"{where}: not a complete H3 audio VAE (missing or malformed tensor {e})") from None
    cfg = dict(STOCK, encoder_dim=enc, latent_dim=lat, latent_channels=ch, decoder_dim=dd, encoder_rates=rates)
    if dd % 2 ** len(STOCK["upsample_rates"]):
        raise CheckpointError(f"{where}: decoder width {dd} is not divisible by 2^{len(STOCK['upsample_rates'])} "
                              "(BigVGAN halves it at every upsample)")
    plan = audio_vae_plan(cfg)
    missing = sorted(set(plan) - set(shapes))
    extra = sorted(set(shapes) - set(plan))
    wrong = sorted(k for k in plan if k in shapes and tuple(shapes[k]) != tuple(plan[k]))
    if missing or extra or wrong:
        k = (missing or extra or wrong)[0]
        why = ("missing" if missing else "unexpected" if extra else
               f"shape {tuple(shapes[k])}, expected {tuple(plan[k])} for the detected dimensions")
        raise CheckpointError(f"{where}: tensor {k!r} {why} ({len(missing)} missing, {len(extra)} unexpected, "
                              f"{len(wrong)} mis-shaped vs ComfyUI's H3 audio VAE layout at encoder_dim {enc}, "
                              f"latent_dim {lat}, decoder_dim {dd})")
    return cfg


def load_h3_audio_vae(path: str, progress=None) -> tuple[comfy.sd.VAE, dict]:
    header = read_header(path)
    name = os.path.basename(path)
    where = f"VAE file '{name}'"
    family = classify_vae_keys(header.keys())
    if family != "h3_audio":
        raise UnsupportedModelError(f"{where} is not a MiniMax H3 audio VAE (detected {family}); this loader reads H3 "
                                    "audio VAEs only")
    bad = sorted(k for k, t in header.tensors.items() if t.dtype not in FLOAT_DTYPES)
    if bad:
        raise CheckpointError(f"{where}: non-float tensors {bad[:3]}; quantized audio VAEs are not supported here")
    cfg = detect_audio_config({k: t.shape for k, t in header.tensors.items()}, where)
    sd, _ = load_with_progress(path, progress)
    stock = all(cfg[k] == STOCK[k] for k in ("encoder_dim", "latent_dim", "decoder_dim", "latent_channels"))
    if stock:
        vae = comfy.sd.VAE(sd=sd, metadata=header.metadata)
        built = "stock comfy.sd.VAE"
    else:
        probe = {k: torch.empty(s, device="meta") for k, s in audio_vae_plan(STOCK).items()}
        with torch.device("meta"):
            vae = comfy.sd.VAE(sd=probe, metadata=header.metadata)
            model = h3audio.MiniMaxH3AudioVAE(encoder_dim=cfg["encoder_dim"], encoder_rates=tuple(cfg["encoder_rates"]),
                                              latent_dim=cfg["latent_dim"], decoder_dim=cfg["decoder_dim"],
                                              vae_latent_channels=cfg["latent_channels"])
        # same order as comfy.sd.VAE: cast, archive dtypes, make the patcher, then assign the file's weights
        model = model.eval().to(vae.vae_dtype)
        mm.archive_model_dtypes(model)
        vae.first_stage_model = model
        vae.patcher = type(vae.patcher)(model, load_device=vae.device, offload_device=mm.vae_offload_device(),
                                        **patcher_kwargs(type(vae.patcher), vae.patcher))
        missing, unexpected = model.load_state_dict({k: v.to(vae.vae_dtype) for k, v in sd.items()}, strict=False,
                                                    assign=True)
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if unexpected or left:
            raise CheckpointError(f"{where}: scaled H3 audio VAE did not take the file's tensors "
                                  f"(unexpected {unexpected[:3]}, not materialised {left[:3]})")
        vae.size = None
        vae.model_size()
        built = "scaled MiniMaxH3AudioVAE in a stock VAE wrapper"
    del sd
    data = {"file": name, "kind": "audio", "built": built, "tensors": len(header.tensors),
            "config": {k: cfg[k] for k in ("encoder_dim", "encoder_rates", "latent_dim", "decoder_dim",
                                           "latent_channels")},
            "sample_rate": int(getattr(vae, "audio_sample_rate", 0)) or None}
    vae.ditkit_h3 = data
    return vae, data
