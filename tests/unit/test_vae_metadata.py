"""Strict image-VAE metadata validation (h3.md §4.6) and H3 VAE family/config detection; no ComfyUI."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from ditkit.errors import CheckpointError, MetadataError
from ditkit.tiny import ckpt_h3_vae as ck
from ditkit.vae.h3_layout import (STOCK_SOURCE_CONFIG, STOCK_VIDEO_CONFIG, audio_vae_plan, classify_vae_keys,
                                  detect_video_config, video_vae_plan)
from ditkit.vae.metadata import check_whitening_matches, validate_image_vae_metadata

W = "VAE file 'x.safetensors'"


def good_meta(**cfg_over):
    sd = {"latents_mean": torch.linspace(-1, 1, 24), "latents_std": torch.linspace(0.5, 3, 24)}
    meta = ck.image_vae_metadata(sd)
    if cfg_over:
        cfg = json.loads(meta["minimax_h3_video_vae"])
        cfg.update(cfg_over)
        meta["minimax_h3_video_vae"] = json.dumps(cfg)
    return meta


def test_valid_metadata_accepted():
    info = validate_image_vae_metadata(good_meta(), W)
    assert info.direct and info.output_slice == 3 and info.format == "full_decoder_v1"
    assert len(info.latents_mean) == 24 and info.latents_std[0] == pytest.approx(0.5)
    for direct in ("true", "1"):
        m = good_meta()
        m["h3_t1_direct"] = direct
        assert validate_image_vae_metadata(m, W).direct
    for s in "0123":
        m = good_meta()
        m["h3_t1_output_slice"] = s
        assert validate_image_vae_metadata(m, W).output_slice == int(s)


def test_plain_video_vae_has_no_image_info():
    assert validate_image_vae_metadata({}, W) is None
    assert validate_image_vae_metadata({"format": "pt"}, W) is None


@pytest.mark.parametrize("key,value", [
    ("h3_t1_direct", "false"), ("h3_t1_direct", "True"), ("h3_t1_direct", "yes"), ("h3_t1_direct", "0"),
    ("h3_t1_direct", ""), ("h3_t1_format", "full_decoder_v2"), ("h3_t1_format", ""),
    ("h3_t1_output_slice", "-1"), ("h3_t1_output_slice", "4"), ("h3_t1_output_slice", "3x"),
    ("h3_t1_output_slice", " 3"), ("h3_t1_output_slice", "3 "), ("h3_t1_output_slice", "3.0"),
    ("h3_t1_output_slice", "03"), ("h3_t1_output_slice", "9" * 40),
    ("minimax_h3_video_vae", "{}"), ("minimax_h3_video_vae", '{"source_config":null}'),
    ("minimax_h3_video_vae", '{"a":1,"a":2}'), ("minimax_h3_video_vae", "NaN"),
    ("minimax_h3_video_vae", "x" * 70000), ("minimax_h3_video_vae", "[1,2]"),
])
def test_reject_corpus_names_key_and_value(key, value):
    m = good_meta()
    m[key] = value
    with pytest.raises(MetadataError) as ei:
        validate_image_vae_metadata(m, W)
    msg = str(ei.value)
    assert repr(key) in msg and repr(value)[:30] in msg and "x.safetensors" in msg


@pytest.mark.parametrize("key", ["h3_t1_direct", "h3_t1_format", "h3_t1_output_slice", "minimax_h3_video_vae"])
def test_missing_key_rejected(key):
    m = good_meta()
    del m[key]
    with pytest.raises(MetadataError, match=key):
        validate_image_vae_metadata(m, W)


@pytest.mark.parametrize("over,needle", [
    ({"latents_mean": [0.0] * 23}, "latents_mean"),
    ({"latents_mean": [0.0] * 23 + ["x"]}, "latents_mean[23]"),
    ({"latents_mean": [0.0] * 23 + [True]}, "latents_mean[23]"),
    ({"latents_std": [1.0] * 23 + [0.0]}, "latents_std[23]"),
    ({"latents_std": [1.0] * 23 + [-1.0]}, "latents_std[23]"),
    ({"latents_std": [1.0] * 23 + [1e400]}, "latents_std"),
    ({"vae_clip_length": 16}, "vae_clip_length"),
    ({"vae_token_drop": 2}, "vae_token_drop"),
    ({"extra": 1}, "unknown fields"),
])
def test_config_content_rejects(over, needle):
    if any(isinstance(v, list) and any(isinstance(x, float) and x == 1e400 for x in v) for v in over.values()):
        m = good_meta()
        m["minimax_h3_video_vae"] = m["minimax_h3_video_vae"].replace('"latents_std":[', '"latents_std":[1e400,', 1)
    else:
        m = good_meta(**over)
    with pytest.raises(MetadataError) as ei:
        validate_image_vae_metadata(m, W)
    assert "minimax_h3_video_vae" in str(ei.value) and needle in str(ei.value)


@pytest.mark.parametrize("path,value", [
    (("ch",), 32), (("vit_decoder_kwargs", "num_layers"), 2), (("vit_decoder_kwargs", "heads"), 2),
    (("causal_encoder",), False), (("ch_mult",), [1, 2, 2, 3, 3, 4]), (("padding_mode",), "zeros"),
    (("scaling_factor",), 0.5), (("_class_name",), "AutoencoderKL"), (("num_res_blocks_decoder",), 2),
    (("vae_ratio",), True),
])
def test_source_config_must_be_stock(path, value):
    sc = copy.deepcopy(STOCK_SOURCE_CONFIG)
    tgt = sc
    for p in path[:-1]:
        tgt = tgt[p]
    tgt[path[-1]] = value
    m = good_meta(source_config=sc)
    with pytest.raises(MetadataError) as ei:
        validate_image_vae_metadata(m, W)
    assert "source_config." + ".".join(path) in str(ei.value)


def test_source_config_missing_and_extra_fields():
    sc = copy.deepcopy(STOCK_SOURCE_CONFIG)
    del sc["use_3d_conv"]
    with pytest.raises(MetadataError, match="use_3d_conv"):
        validate_image_vae_metadata(good_meta(source_config=sc), W)
    sc = copy.deepcopy(STOCK_SOURCE_CONFIG)
    sc["new_field"] = 1
    with pytest.raises(MetadataError, match="new_field"):
        validate_image_vae_metadata(good_meta(source_config=sc), W)
    sc = copy.deepcopy(STOCK_SOURCE_CONFIG)
    sc["_diffusers_version"] = "0.40.0"  # not compared
    assert validate_image_vae_metadata(good_meta(source_config=sc), W).direct


def test_whitening_must_match_file_tensors():
    info = validate_image_vae_metadata(good_meta(), W)
    mean, std = torch.linspace(-1, 1, 24), torch.linspace(0.5, 3, 24)
    check_whitening_matches(info, mean.half(), std.half(), W)  # F16 rounding tolerated
    bad = mean.clone()
    bad[5] += 0.1
    with pytest.raises(MetadataError, match=r"latents_mean\[5\]"):
        check_whitening_matches(info, bad, std, W)


def test_detect_config_roundtrip_and_inventory():
    stock = {k: v for k, v in video_vae_plan(STOCK_VIDEO_CONFIG).items()}
    assert len(stock) == 562  # h3.md §4.4
    cfg = detect_video_config(stock, W)
    assert cfg.is_stock and cfg.dec_heads == 32 and cfg.dec_layers == 36
    tiny = video_vae_plan(ck.TINY_VIDEO_CONFIG)
    cfg = detect_video_config(tiny, W)
    assert not cfg.is_stock and (cfg.ch, cfg.dec_layers, cfg.dec_heads) == (32, 2, 2)
    assert cfg.ch_mult == (1, 2, 2, 3, 3, 4)
    for mutate, needle in [
        (lambda s: s.pop("decoder.transformer_blocks.1.ff.w1.bias"), "missing"),
        (lambda s: s.__setitem__("decoder.foo.comfy_quant", (1,)), "unexpected"),
        (lambda s: s.__setitem__("encoder.down.2.block.1.conv2.weight", (64, 64, 3, 3, 1)), "inconsistent"),
        (lambda s: s.__setitem__("encoder.conv_out.weight", (32, 128, 3, 3, 3)), "24 latent channels"),
    ]:
        s = dict(tiny)
        mutate(s)
        with pytest.raises(CheckpointError, match=needle):
            detect_video_config(s, W)


def test_classify_families():
    assert classify_vae_keys(video_vae_plan(ck.TINY_VIDEO_CONFIG)) == "h3_video"
    assert classify_vae_keys(audio_vae_plan(ck.TINY_AUDIO_CONFIG)) == "h3_audio"
    assert classify_vae_keys(["decoder.up_blocks.0.res_blocks.0.conv1.conv.weight"]) == "ltx_video"
    assert classify_vae_keys(["first_stage_model.decoder.conv_in.weight"]) == "unknown"
