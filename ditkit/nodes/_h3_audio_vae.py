"""MiniMax H3 audio VAEs at the size of the file (DitKitH3VAELoader, audio files).

ComfyUI's VAE wrapper builds the stock audio VAE (DAC encoder 64, latent 2048, BigVGAN 1024) whatever the file
holds, so a smaller file of the same structure (ditkit's tiny audio VAE, a distilled one) fails with size
mismatches. Here the widths are read from the file's shapes (header only), the stock wrapper is made on the meta
device from the stock key inventory (its audio settings: 32 latent channels, 800-sample hop, 32 kHz, memory
estimates) and its model is replaced by one built at the detected widths, like the scaled video VAE in h3_vae.py.
The structure (encoder rates, BigVGAN upsampling, kernel sizes) must be the stock one: ``load_state_dict`` is
strict, so any other inventory is refused with the keys named.
"""
from __future__ import annotations

import os

import comfy.ldm.minimax.audio_vae as h3audio
import comfy.model_management as mm
import comfy.sd
import torch

from ..errors import CheckpointError
from ..loaders.safetensors_io import read_header
from ..vae.h3_layout import H3_AUDIO_KEY, audio_vae_plan

STOCK_AUDIO_CONFIG = {"encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "decoder_dim": 1024,
                      "latent_channels": 32, "upsample_rates": [5, 5, 2, 2, 2, 2, 2],
                      "upsample_kernel_sizes": [9, 9, 4, 4, 4, 4, 4], "resblock_kernel_sizes": [3, 7, 11],
                      "resblock_dilations": [1, 3, 5], "num_heads": 8}
SHAPE_KEYS = {"encoder_dim": ("encoder.block.0.weight", 0), "latent_dim": ("dec_in_proj.weight", 0),
              "decoder_dim": ("decoder.conv_pre.weight", 0), "latent_channels": ("mean_proj.weight", 0)}


def is_h3_audio_file(path: str) -> bool:
    return H3_AUDIO_KEY in read_header(path).keys()


def detect_audio_config(shapes: dict, where: str) -> dict:
    cfg = dict(STOCK_AUDIO_CONFIG)
    for name, (key, dim) in SHAPE_KEYS.items():
        if key not in shapes:
            raise CheckpointError(f"{where}: H3 audio VAE without '{key}' (cannot read its {name})")
        cfg[name] = int(shapes[key][dim])
    if cfg["latent_channels"] != 32:
        raise CheckpointError(f"{where}: {cfg['latent_channels']} latent channels; the H3 DiT samples 32")
    return cfg


def load_h3_audio_vae(path: str) -> tuple[comfy.sd.VAE, dict]:
    where = f"VAE file '{os.path.basename(path)}'"
    header = read_header(path)
    cfg = detect_audio_config({k: t.shape for k, t in header.tensors.items()}, where)
    from ..loaders.safetensors_io import load_file

    sd = load_file(path)
    stock = all(cfg[k] == STOCK_AUDIO_CONFIG[k] for k in SHAPE_KEYS)
    if stock:
        vae = comfy.sd.VAE(sd=sd, metadata=header.metadata)
        built = "stock comfy.sd.VAE"
    else:
        probe = {k: torch.empty(s, device="meta") for k, s in audio_vae_plan(STOCK_AUDIO_CONFIG).items()}
        with torch.device("meta"):
            vae = comfy.sd.VAE(sd=probe, metadata=header.metadata)
            model = h3audio.MiniMaxH3AudioVAE(encoder_dim=cfg["encoder_dim"], latent_dim=cfg["latent_dim"],
                                              decoder_dim=cfg["decoder_dim"], vae_latent_channels=cfg["latent_channels"])
        model = model.eval().to(vae.vae_dtype)
        mm.archive_model_dtypes(model)
        vae.first_stage_model = model
        vae.patcher = type(vae.patcher)(model, load_device=vae.device, offload_device=mm.vae_offload_device())
        try:
            model.load_state_dict({k: v.to(vae.vae_dtype) for k, v in sd.items()}, strict=True, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{where}: not the stock H3 audio VAE structure at widths {cfg}: "
                                  f"{str(e).splitlines()[0][:300]}") from e
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise CheckpointError(f"{where}: tensors {left[:3]} were not materialised")
        vae.size = None
        vae.model_size()
        built = "scaled MiniMaxH3AudioVAE in a stock VAE wrapper"
    del sd
    data = {"file": os.path.basename(path), "kind": "audio", "built": built, "tensors": len(header.tensors),
            "config": (f"encoder {cfg['encoder_dim']}, latent {cfg['latent_dim']}, BigVGAN {cfg['decoder_dim']}"
                       + ("" if stock else " (scaled)"))}
    vae.ditkit_h3 = data
    return vae, data
