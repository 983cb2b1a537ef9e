"""The tiny Z-Image / FLUX.2 VAEs (``tiny/ckpt_image_vae.py``) and the tiny LTX-2 video VAE
(``tiny/ckpt_ltx_vae.py``) load through ComfyUI's stock VAE code.

Oracle: ComfyUI itself (``comfy.sd.VAE`` = what the stock VAELoader builds): its config detection from the state
dict, its ``load_state_dict`` (a shape that does not fit the module it derived raises), the keys it reports
missing / leftover, and the stock empty-latent nodes' latent sizes. Expected values are ComfyUI's documented
family constants (16 / 128 latent channels, 8x / 16x), written here.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from ditkit.tiny.checkpoints import generate_all

# generator -> (file, latent channels ComfyUI must derive, spatial ratio, latent shape of the stock empty latent
# node for 64 x 64, ComfyUI model class)
CASES = {
    "zimage_vae": ("vae/zimage_vae_tiny.safetensors", 16, 8, (1, 16, 8, 8), "AutoencodingEngine"),
    "flux2_vae": ("vae/flux2_vae_tiny.safetensors", 128, 16, (1, 128, 4, 4), "AutoencoderKL"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return generate_all(tmp_path_factory.mktemp("img_vae"), only=list(CASES))


def _load(comfy, path):
    import comfy.sd
    import comfy.utils

    sd, meta = comfy.utils.load_torch_file(str(path), return_metadata=True)
    vae = comfy.sd.VAE(sd=sd, metadata=meta)
    missing, leftover = vae.first_stage_model.load_state_dict(sd if "bn.running_mean" not in sd else {
        ("post_quant_conv." + k[len("decoder.post_quant_conv."):] if k.startswith("decoder.post_quant_conv.") else k): v
        for k, v in sd.items()}, strict=False)
    return vae, missing, leftover


@pytest.mark.parametrize("gen", sorted(CASES))
def test_stock_vae_loads_and_decodes_the_stock_latent(comfy, files, gen, tmp_path):
    rel, channels, ratio, latent_shape, cls = CASES[gen]
    path = files[gen][0]
    assert path.as_posix().endswith(rel)
    vae, missing, leftover = _load(comfy, path)
    assert type(vae.first_stage_model).__name__ == cls
    assert vae.latent_channels == channels and vae.upscale_ratio == ratio
    assert not leftover, leftover                       # every tensor of the file has its place in the stock model
    # only the encoder side is absent (on purpose: ComfyUI builds it at the fixed stock width)
    assert missing and all(k.startswith(("encoder.", "quant_conv.")) for k in missing), missing
    img = vae.decode(torch.randn(latent_shape, generator=torch.Generator().manual_seed(0)))
    assert img.shape == (1, 64, 64, 3)
    assert torch.isfinite(img).all() and 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    assert float(img.std()) > 0.01                      # an image with content, not a constant


def test_byte_identical_across_runs(files, tmp_path):
    again = generate_all(tmp_path, only=list(CASES))
    for gen in CASES:
        assert hashlib.sha256(files[gen][0].read_bytes()).digest() == \
            hashlib.sha256(again[gen][0].read_bytes()).digest(), gen


def test_ltx_video_vae_is_the_stock_module_layout(comfy, tmp_path):
    """Every tensor of the tiny LTX-2 VAE has the name and shape of ComfyUI's own ``VideoVAE`` built from the config
    the file declares, none is missing; the stock wrapper derives 128 channels, 32x spatial, 8x temporal."""
    import json

    import comfy.sd
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    from ditkit.loaders.safetensors_io import load_file, read_header

    path = generate_all(tmp_path, only=["ltx_vae"])["ltx_vae"][0]
    assert path.as_posix().endswith("vae/ltx2_video_vae_tiny.safetensors")
    meta = read_header(path).metadata
    cfg = json.loads(meta["config"])["vae"]
    ref = {k: tuple(v.shape) for k, v in VideoVAE(config=cfg).state_dict().items()}
    sd = load_file(path)
    assert {k: tuple(v.shape) for k, v in sd.items()} == ref
    vae = comfy.sd.VAE(sd=sd, metadata=meta)
    assert type(vae.first_stage_model).__name__ == "VideoVAE" and vae.latent_channels == 128
    assert vae.upscale_ratio[1:] == (32, 32) and vae.upscale_ratio[0](3) == 17
    img = vae.decode(torch.randn((1, 128, 3, 2, 2), generator=torch.Generator().manual_seed(0)))
    assert img.shape == (1, 17, 64, 64, 3) and torch.isfinite(img).all() and float(img.std()) > 0.01
