"""Tiny image VAEs for the Z-Image and FLUX.2 examples: decoder-only, real key names, stock loader.

Written into ``OUTDIR/vae/``; ComfyUI's stock ``VAELoader`` loads both (``comfy/sd.py`` ``VAE.__init__``: the
``decoder.conv_in.weight`` branch, SD/Flux ``AutoencoderKL`` layout, ``ch_mult [1, 2, 4, 4]``, 2 res blocks):

* ``zimage_vae_tiny.safetensors`` — the 16-channel Flux VAE Z-Image uses (``encoder.*``/``decoder.*`` only, no
  quant convs, like ``ae.safetensors``). ComfyUI reads ``z_channels`` from ``decoder.conv_in`` ``[4 ch, 16, 3, 3]``
  and the decoder width ``ch = conv_in rows / ch_mult[-1]``, so the decoder is scaled down to ``ch 32`` (widths
  32/64/128/128: the smallest that GroupNorm(32) allows). 8x spatial, like the real one.
* ``flux2_vae_tiny.safetensors`` — the FLUX.2 VAE: 32 latent channels (``decoder.conv_in`` ``[128, 32, 3, 3]``),
  ``decoder.post_quant_conv`` ``[32, 32, 1, 1]`` (ComfyUI renames it to ``post_quant_conv`` and builds the
  ``AutoencoderKL`` with ``embed_dim`` from its shape) and the latent batch-norm statistics ``bn.running_mean`` /
  ``bn.running_var`` ``[128]`` (+ ``bn.num_batches_tracked``) that make ComfyUI patchify 2x2: 128 latent channels
  at 16x, as ``EmptyFlux2LatentImage`` makes them.

Why no encoder: ComfyUI builds the encoder at the fixed stock width (``ch 128`` in its ddconfig, not read from the
file; a narrower encoder tensor is a shape error), so a file with an encoder would carry ~34 M parameters
(~68 MB in bf16). The files hold the decoder only; ComfyUI logs the encoder keys as missing ("Missing VAE keys")
and leaves them uninitialised, so ``VAEEncode`` with these files is meaningless (the examples only decode).

Plain torch (no ComfyUI imports); fixed seeds, so two runs write byte-identical files. bf16 like the releases.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoints import register
from .checkpoints import write_one as _write

ZIMAGE_VAE_FILE = "vae/zimage_vae_tiny.safetensors"
FLUX2_VAE_FILE = "vae/flux2_vae_tiny.safetensors"
SEED_ZIMAGE = 20261203
SEED_FLUX2 = 20261204
CH_MULT = (1, 2, 4, 4)     # ComfyUI's fixed ddconfig for this VAE family
NUM_RES_BLOCKS = 2         # the decoder has NUM_RES_BLOCKS + 1 blocks per level
TINY_CH = 32
ZIMAGE_Z = 16
FLUX2_Z = 32
FLUX2_PATCH = 2            # ComfyUI's ``ps`` for the latent batch-norm


def _conv(sd, name, cin, cout, k):
    sd[name + ".weight"] = ("conv", (cout, cin, k, k))
    sd[name + ".bias"] = ("zero", (cout,))


def _norm(sd, name, c):
    sd[name + ".weight"] = ("one", (c,))
    sd[name + ".bias"] = ("zero", (c,))


def _resnet(sd, name, cin, cout):
    _norm(sd, name + ".norm1", cin)
    _conv(sd, name + ".conv1", cin, cout, 3)
    _norm(sd, name + ".norm2", cout)
    _conv(sd, name + ".conv2", cout, cout, 3)
    if cin != cout:
        _conv(sd, name + ".nin_shortcut", cin, cout, 1)


def decoder_inventory(z: int, ch: int = TINY_CH) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``decoder.*`` key -> (role, shape) of the LDM ``Decoder`` (conv_in, mid block with one attention, up levels
    from the widest, upsample convs on all but level 0, norm_out, conv_out to RGB)."""
    sd: dict[str, tuple[str, tuple[int, ...]]] = {}
    block_in = ch * CH_MULT[-1]
    _conv(sd, "decoder.conv_in", z, block_in, 3)
    _resnet(sd, "decoder.mid.block_1", block_in, block_in)
    _norm(sd, "decoder.mid.attn_1.norm", block_in)
    for p in ("q", "k", "v", "proj_out"):
        _conv(sd, f"decoder.mid.attn_1.{p}", block_in, block_in, 1)
    _resnet(sd, "decoder.mid.block_2", block_in, block_in)
    for level in reversed(range(len(CH_MULT))):
        block_out = ch * CH_MULT[level]
        for j in range(NUM_RES_BLOCKS + 1):
            _resnet(sd, f"decoder.up.{level}.block.{j}", block_in, block_out)
            block_in = block_out
        if level != 0:
            _conv(sd, f"decoder.up.{level}.upsample.conv", block_in, block_in, 3)
    _norm(sd, "decoder.norm_out", block_in)
    _conv(sd, "decoder.conv_out", block_in, 3, 3)
    return sd


def _values(inv, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, (role, shape) in inv.items():
        if role == "conv":
            fan_in = shape[1] * shape[2] * shape[3]
            t = torch.randn(shape, generator=g) * fan_in ** -0.5
        elif role == "one":
            t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        else:
            t = 0.01 * torch.randn(shape, generator=g)
        out[k] = t.to(torch.bfloat16)
    return out


def zimage_vae_state_dict(seed: int = SEED_ZIMAGE) -> dict[str, torch.Tensor]:
    return _values(decoder_inventory(ZIMAGE_Z), seed)


def flux2_vae_state_dict(seed: int = SEED_FLUX2) -> dict[str, torch.Tensor]:
    inv = decoder_inventory(FLUX2_Z)
    _conv(inv, "decoder.post_quant_conv", FLUX2_Z, FLUX2_Z, 1)
    sd = _values(inv, seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = FLUX2_Z * FLUX2_PATCH ** 2
    sd["bn.running_mean"] = (0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)
    sd["bn.running_var"] = (1.0 + 0.1 * torch.rand(n, generator=g)).to(torch.bfloat16)
    sd["bn.num_batches_tracked"] = torch.tensor(0, dtype=torch.int64)
    return sd


@register("zimage_vae")
def gen_zimage_vae(out: Path) -> list[Path]:
    return _write(out, ZIMAGE_VAE_FILE, zimage_vae_state_dict())


@register("flux2_vae")
def gen_flux2_vae(out: Path) -> list[Path]:
    return _write(out, FLUX2_VAE_FILE, flux2_vae_state_dict())
