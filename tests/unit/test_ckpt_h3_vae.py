"""The tiny H3 VAE checkpoints: deterministic, real inventories, valid image-VAE metadata."""
from __future__ import annotations

import hashlib

from ditkit.loaders.safetensors_io import SafeFile, read_header
from ditkit.tiny import ckpt_h3_vae as ck
from ditkit.vae.h3_layout import audio_vae_plan, detect_video_config
from ditkit.vae.metadata import check_whitening_matches, validate_image_vae_metadata


def _gen(tmp):
    out = {}
    for fn in (ck.gen_video_vae, ck.gen_image_vae, ck.gen_audio_vae):
        for p in fn(tmp):
            out[p.name] = p
    return out


def test_deterministic_and_valid(tmp_path):
    a = _gen(tmp_path / "a")
    b = _gen(tmp_path / "b")
    assert set(a) == {ck.VIDEO_VAE_NAME, ck.IMAGE_VAE_NAME, ck.AUDIO_VAE_NAME}
    for n in a:
        assert hashlib.sha256(a[n].read_bytes()).digest() == hashlib.sha256(b[n].read_bytes()).digest(), n
    hv, hi, ha = (read_header(a[n]) for n in (ck.VIDEO_VAE_NAME, ck.IMAGE_VAE_NAME, ck.AUDIO_VAE_NAME))
    for h in (hv, hi):
        cfg = detect_video_config({k: t.shape for k, t in h.tensors.items()}, h.path)
        assert (cfg.ch, cfg.dec_layers, cfg.dec_heads, cfg.z_channels) == (32, 2, 2, 24)
        assert all(t.dtype == "F16" for k, t in h.tensors.items() if not k.startswith("latents_"))
    assert validate_image_vae_metadata(hv.metadata, "video") is None
    info = validate_image_vae_metadata(hi.metadata, "image")
    assert info.output_slice == 3
    with SafeFile(a[ck.IMAGE_VAE_NAME]) as f:
        check_whitening_matches(info, f.get("latents_mean"), f.get("latents_std"), "image")
    assert {k: t.shape for k, t in ha.tensors.items()} == audio_vae_plan(ck.TINY_AUDIO_CONFIG)


def test_image_vae_is_a_pure_decoder_swap(tmp_path):
    a = _gen(tmp_path)
    with SafeFile(a[ck.VIDEO_VAE_NAME]) as v, SafeFile(a[ck.IMAGE_VAE_NAME]) as i:
        same = [k for k in v.keys() if v.get(k).equal(i.get(k))]
    assert all(not k.startswith("decoder.") or k == "decoder.mask_token" for k in same)
    assert "post_quant_conv.weight" not in same and "encoder.conv_in.weight" in same and "latents_std" in same
