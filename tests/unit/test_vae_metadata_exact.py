"""Exact refusal messages and both sides of every comparison in vae/metadata.py (mutation survivors, #29)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from ditkit.errors import MetadataError
from ditkit.vae.h3_layout import STOCK_SOURCE_CONFIG
from ditkit.vae.metadata import (MAX_CONFIG_CHARS, _check_source_config, _same, _short, check_whitening_matches,
                                 validate_image_vae_metadata)

from ditkit.tiny import ckpt_h3_vae as ck



def good_meta():
    sd = {"latents_mean": torch.linspace(-1, 1, 24), "latents_std": torch.linspace(0.5, 3, 24)}
    return ck.image_vae_metadata(sd)


W = "VAE file 'x.safetensors'"
TAIL = (". This file declares the H3 single-frame image-VAE capability but its metadata is invalid; fix or "
        "re-export the file (ditkit never falls back to another decode path)")


def _msg(key, shown, why):
    return f"{W}: __metadata__ '{key}' = {shown}: {why}{TAIL}"


def _refuse(meta):
    with pytest.raises(MetadataError) as ei:
        validate_image_vae_metadata(meta, W)
    return str(ei.value)


def _cfg_meta(cfg):
    m = good_meta()
    m["minimax_h3_video_vae"] = json.dumps(cfg)
    return m


def _cfg():
    return json.loads(good_meta()["minimax_h3_video_vae"])


# ---- _short
def test_short_exact():
    assert _short("a" * 78) == "'" + "a" * 78 + "'"          # repr is exactly 80 chars: kept
    assert _short("a" * 79) == "'" + "a" * 79 + "...' (79 chars)"  # repr 81 chars: cut at 80
    assert _short(None) == "None"
    assert _short(list(range(40))) == repr(list(range(40)))[:80] + "...' (? chars)"
    assert _short("ab", n=3) == "'ab...' (2 chars)"
    assert _short("ab", n=4) == "'ab'"


# ---- _same
def test_same_type_rules():
    assert _same(True, True) and _same(False, False)
    assert not _same(True, 1) and not _same(1, True) and not _same(False, 0) and not _same(0, False)
    assert not _same(True, False)
    assert _same(1, 1.0) and _same(1.0, 1) and _same(2, 2)
    assert not _same(1, 2) and not _same(1.0, 1.5)
    assert _same([1, 2.0], [1.0, 2]) and not _same([1, 2], [1, 3]) and not _same([1], [1, 1])
    assert not _same([1, 1], [1]) and _same([], [])
    assert not _same([True], [1])
    assert _same({"a": [1, {"b": 2}]}, {"a": [1.0, {"b": 2.0}]})
    assert not _same({"a": 1}, {"a": 2}) and not _same({"a": 1}, {"b": 1}) and not _same({"a": 1}, {"a": 1, "b": 1})
    assert not _same({"a": True}, {"a": 1})
    assert not _same({"a": 1}, [("a", 1)]) and not _same([1], {0: 1})
    assert not _same({}, None) and not _same(None, {})
    assert _same("x", "x") and not _same("x", "y") and _same(None, None)
    assert not _same("1", 1) and not _same(1, "1") and not _same(None, 0) and not _same(0, None)
    assert not _same((1,), [1]) and not _same([1], (1,))
    assert not _same(complex(1, 0), 1) and not _same({1}, frozenset({1}))  # equal by ==, types differ


# ---- _check_source_config
def _fail(why):
    return ValueError(why)


def _sc_err(sc):
    with pytest.raises(ValueError) as ei:
        _check_source_config(sc, _fail)
    return str(ei.value)


def test_source_config_exact():
    stock = copy.deepcopy(STOCK_SOURCE_CONFIG)
    _check_source_config(copy.deepcopy(stock), _fail)
    sc = copy.deepcopy(stock)
    del sc["_diffusers_version"]
    _check_source_config(sc, _fail)           # the ignored key may be missing
    sc["_diffusers_version"] = "9.9"
    _check_source_config(sc, _fail)           # or differ
    sc = copy.deepcopy(stock)
    del sc["ch"]
    assert _sc_err(sc) == "'source_config.ch' is missing (stock: 128)"
    sc = copy.deepcopy(stock)
    sc["zz_extra"] = 5
    assert _sc_err(sc) == "'source_config.zz_extra' = 5 is not a field of the stock architecture"
    sc = copy.deepcopy(stock)
    sc["ch"] = 64
    assert _sc_err(sc) == "'source_config.ch' = 64 differs from the stock architecture (128)"
    sc["ch"] = 128.0
    _check_source_config(sc, _fail)
    sc = copy.deepcopy(stock)
    sc["causal_decoder"] = 0
    assert _sc_err(sc) == "'source_config.causal_decoder' = 0 differs from the stock architecture (False)"
    sc = copy.deepcopy(stock)
    sc["vit_decoder_kwargs"] = [1]
    assert _sc_err(sc) == "'source_config.vit_decoder_kwargs' must be an object"
    sub = sorted(stock["vit_decoder_kwargs"])
    k0 = sub[0]
    sc = copy.deepcopy(stock)
    del sc["vit_decoder_kwargs"][k0]
    assert _sc_err(sc) == (f"'source_config.vit_decoder_kwargs.{k0}' = '<missing>' differs from the stock "
                           f"architecture ({stock['vit_decoder_kwargs'][k0]!r})")
    sc = copy.deepcopy(stock)
    sc["vit_decoder_kwargs"]["zz"] = 1
    assert _sc_err(sc) == ("'source_config.vit_decoder_kwargs.zz' = 1 differs from the stock "
                           "architecture ('<no such field>')")
    sc = copy.deepcopy(stock)
    sc["vit_decoder_kwargs"][k0] = "changed"
    assert _sc_err(sc) == (f"'source_config.vit_decoder_kwargs.{k0}' = 'changed' differs from the stock "
                           f"architecture ({stock['vit_decoder_kwargs'][k0]!r})")


def test_source_config_first_bad_key_sorted():
    sc = copy.deepcopy(STOCK_SOURCE_CONFIG)
    sc["ch"] = 1
    sc["z_channels"] = 1
    assert _sc_err(sc) == "'source_config.ch' = 1 differs from the stock architecture (128)"


# ---- validate_image_vae_metadata
@pytest.mark.parametrize("key", ["h3_t1_direct", "h3_t1_format", "h3_t1_output_slice", "minimax_h3_video_vae"])
def test_missing_key_exact(key):
    m = good_meta()
    del m[key]
    assert _refuse(m) == _msg(key, "None", "missing (an image VAE must carry all of h3_t1_direct, h3_t1_format, "
                                           "h3_t1_output_slice, minimax_h3_video_vae)")


def test_only_one_key_is_image_vae():
    for k in ("h3_t1_direct", "h3_t1_format", "h3_t1_output_slice", "minimax_h3_video_vae"):
        with pytest.raises(MetadataError):
            validate_image_vae_metadata({k: "x"}, W)


def test_scalar_keys_exact():
    m = good_meta()
    m["h3_t1_direct"] = "yes"
    assert _refuse(m) == _msg("h3_t1_direct", "'yes'", 'must be exactly "true" or "1"')
    m = good_meta()
    m["h3_t1_format"] = "v2"
    assert _refuse(m) == _msg("h3_t1_format", "'v2'", 'must be exactly "full_decoder_v1"')
    why = "must be exactly one digit 0..3 (one of the 4 frames a token decodes to)"
    for s in ("4", "", "00", "01", "x", "X"):
        m = good_meta()
        m["h3_t1_output_slice"] = s
        assert _refuse(m) == _msg("h3_t1_output_slice", repr(s), why)
    for s in "0123":
        m = good_meta()
        m["h3_t1_output_slice"] = s
        assert validate_image_vae_metadata(m, W).output_slice == int(s)


def test_valid_info_fields():
    m = good_meta()
    m["h3_t1_decoder_sha256"] = "d" * 64
    m["h3_t1_base_sha256"] = "b" * 64
    info = validate_image_vae_metadata(m, W)
    assert info.direct is True and info.format == "full_decoder_v1" and info.output_slice == 3
    assert info.decoder_sha256 == "d" * 64 and info.base_sha256 == "b" * 64
    cfg = _cfg()
    assert info.latents_mean == tuple(float(x) for x in cfg["latents_mean"])
    assert info.latents_std == tuple(float(x) for x in cfg["latents_std"])
    del m["h3_t1_decoder_sha256"], m["h3_t1_base_sha256"]
    info = validate_image_vae_metadata(m, W)
    assert info.decoder_sha256 is None and info.base_sha256 is None


def test_config_length_boundary():
    cfg = _cfg()
    raw = json.dumps(cfg)
    pad = MAX_CONFIG_CHARS - len(raw)
    m = good_meta()
    m["minimax_h3_video_vae"] = raw[:-1] + " " * pad + "}"   # exactly MAX_CONFIG_CHARS: accepted
    assert len(m["minimax_h3_video_vae"]) == 65536
    validate_image_vae_metadata(m, W)
    m["minimax_h3_video_vae"] = raw[:-1] + " " * (pad + 1) + "}"
    v = m["minimax_h3_video_vae"]
    assert _refuse(m) == _msg("minimax_h3_video_vae", repr(v)[:80] + "...' (65537 chars)",
                              "longer than 65536 characters")


def test_config_json_and_object_exact():
    m = good_meta()
    m["minimax_h3_video_vae"] = "[1]"
    assert _refuse(m) == _msg("minimax_h3_video_vae", "'[1]'", "must be a JSON object")
    m["minimax_h3_video_vae"] = "{"
    m["minimax_h3_video_vae"] = '{"a":1,"a":2}'
    assert _refuse(m) == _msg("minimax_h3_video_vae", "'{\"a\":1,\"a\":2}'",
                              f"not valid strict JSON ({W}: __metadata__ 'minimax_h3_video_vae': duplicate JSON "
                              "key 'a' in the safetensors metadata value)")
    m["minimax_h3_video_vae"] = "{"
    msg = _refuse(m)
    assert msg.startswith(_msg("minimax_h3_video_vae", "'{'", "not valid strict JSON (")[:-len(TAIL)])
    assert msg.endswith(")" + TAIL)


def _cfg_refuse(cfg, why):
    m = _cfg_meta(cfg)
    assert _refuse(m) == _msg("minimax_h3_video_vae", _short(m["minimax_h3_video_vae"]), why)


def test_floats_exact():
    for name in ("latents_mean", "latents_std"):
        c = _cfg()
        c[name] = [1.0] * 23
        _cfg_refuse(c, f"'{name}' must be a list of exactly 24 numbers (got list of 23)")
        c[name] = [1.0] * 25
        _cfg_refuse(c, f"'{name}' must be a list of exactly 24 numbers (got list of 25)")
        c[name] = "x"
        _cfg_refuse(c, f"'{name}' must be a list of exactly 24 numbers (got str)")
        del c[name]
        _cfg_refuse(c, f"'{name}' must be a list of exactly 24 numbers (got NoneType)")
        for bad in (True, "1", None):
            c[name] = [1.0] * 23 + [bad]
            _cfg_refuse(c, f"'{name}[23]' = {bad!r} is not a finite number")
        c[name] = [bad_first := "a"] + [1.0] * 23
        _cfg_refuse(c, f"'{name}[0]' = {bad_first!r} is not a finite number")
    c = _cfg()
    c["latents_std"] = [1.0] * 23 + [0.0]
    _cfg_refuse(c, "'latents_std[23]' = 0.0 must be > 0")
    c["latents_std"] = [1.0] * 23 + [-2]
    _cfg_refuse(c, "'latents_std[23]' = -2 must be > 0")
    c["latents_std"] = [1] * 23 + [1e-30]
    info = validate_image_vae_metadata(_cfg_meta(c), W)
    assert info.latents_std[-1] == 1e-30 and info.latents_std[0] == 1.0 and isinstance(info.latents_std[0], float)
    c = _cfg()
    c["latents_mean"] = [0] * 23 + [-5]                   # mean may be zero / negative, ints accepted
    info = validate_image_vae_metadata(_cfg_meta(c), W)
    assert info.latents_mean == (0.0,) * 23 + (-5.0,)


def test_non_finite_exact():
    m = good_meta()
    c = _cfg()
    c["latents_mean"] = c["latents_mean"][:23]
    m["minimax_h3_video_vae"] = json.dumps(c).replace('"latents_mean": [', '"latents_mean": [1e999, ', 1)
    assert _refuse(m) == _msg("minimax_h3_video_vae", _short(m["minimax_h3_video_vae"]),
                              "'latents_mean[0]' = inf is not a finite number")


def test_clip_and_drop_exact():
    for name, want in (("vae_clip_length", 17), ("vae_token_drop", 3)):
        c = _cfg()
        c[name] = float(want)
        validate_image_vae_metadata(_cfg_meta(c), W)
        for bad in (want + 1, want - 1, True, None, str(want)):
            c[name] = bad
            _cfg_refuse(c, f"'{name}' = {bad!r}, the stock H3 video VAE has {want}")
        del c[name]
        _cfg_refuse(c, f"'{name}' = None, the stock H3 video VAE has {want}")
    c = _cfg()
    c["vae_token_drop"] = 1
    c["vae_clip_length"] = True
    _cfg_refuse(c, "'vae_clip_length' = True, the stock H3 video VAE has 17")


def test_source_config_and_extra_exact():
    c = _cfg()
    c["source_config"] = [1]
    _cfg_refuse(c, "'source_config' must be an object (got list)")
    del c["source_config"]
    _cfg_refuse(c, "'source_config' must be an object (got NoneType)")
    c = _cfg()
    c["source_config"]["ch"] = 7
    _cfg_refuse(c, "'source_config.ch' = 7 differs from the stock architecture (128)")
    c = _cfg()
    c["zz"] = 1
    c["aa"] = 2
    _cfg_refuse(c, "unknown fields ['aa', 'zz']")


# ---- check_whitening_matches
def test_whitening_exact():
    info = validate_image_vae_metadata(good_meta(), W)
    mean = torch.tensor(info.latents_mean, dtype=torch.float64)
    std = torch.tensor(info.latents_std, dtype=torch.float64)
    check_whitening_matches(info, mean, std, W)
    # |a| <= 1 -> tolerance 1e-3 absolute; > 1 -> relative
    a0 = info.latents_mean[0]
    assert abs(a0) == 1.0
    ok = mean.clone()
    ok[0] = a0 + 0.9e-3
    check_whitening_matches(info, ok, std, W)
    for bad_val in (a0 + 1.1e-3, a0 - 1.1e-3):
        bad = mean.clone()
        bad[0] = bad_val
        with pytest.raises(MetadataError) as ei:
            check_whitening_matches(info, bad, std, W)
        b = float(bad[0])
        assert str(ei.value) == (f"{W}: __metadata__ 'minimax_h3_video_vae' latents_mean[0] = {a0!r} but the file's "
                                 f"tensor 'latents_mean' holds {b!r}: the metadata does not describe these weights")
    s_last = info.latents_std[-1]
    assert s_last == 3.0
    ok = std.clone()
    ok[-1] = s_last * (1 + 0.9e-3)
    check_whitening_matches(info, mean, ok, W)
    bad = std.clone()
    bad[-1] = s_last + 3 * 1.1e-3
    with pytest.raises(MetadataError) as ei:
        check_whitening_matches(info, mean, bad, W)
    assert str(ei.value) == (f"{W}: __metadata__ 'minimax_h3_video_vae' latents_std[23] = {s_last!r} but the file's "
                             f"tensor 'latents_std' holds {float(bad[-1])!r}: the metadata does not describe these "
                             "weights")
    small = std.clone()
    i_small = 0
    small[i_small] = info.latents_std[0] + 0.9e-3        # 0.5: absolute tolerance 1e-3 applies
    check_whitening_matches(info, mean, small, W)
    check_whitening_matches(info, mean.reshape(2, 12), std.reshape(4, 6), W)


def test_whitening_tolerance_boundary_is_inclusive():
    """|a - b| equal to the tolerance is accepted (strict >): a = 0, b = 0.001 exactly (float64); 0.001 + 1 ulp not."""
    import dataclasses
    import math

    info = validate_image_vae_metadata(good_meta(), W)
    info = dataclasses.replace(info, latents_mean=(0.0,) + tuple(info.latents_mean[1:]))
    mean = torch.tensor(info.latents_mean, dtype=torch.float64)
    std = torch.tensor(info.latents_std, dtype=torch.float64)
    mean[0] = 1e-3
    assert abs(0.0 - float(mean[0])) == 1e-3 * max(1.0, 0.0)
    check_whitening_matches(info, mean, std, W)
    mean[0] = math.nextafter(1e-3, 1.0)
    with pytest.raises(MetadataError):
        check_whitening_matches(info, mean, std, W)
