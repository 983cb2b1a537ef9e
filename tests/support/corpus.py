"""Bad-input corpus: deterministic malformed files and prompts, each with the exact error ditkit must raise.

``python -m tests.support.corpus OUTDIR`` writes every case file plus ``manifest.json``. The committed copy lives
in ``tests/corpus/`` and a test checks it equals a fresh generation (never hand-edit it: add a case here).

Every manifest entry::

    {"id": "st_header_len_past_eof", "file": "st_header_len_past_eof.safetensors",
     "consumer": "safetensors_header",           # which ditkit reader/node consumes it (see CONSUMERS)
     "error": "CheckpointError",                  # exact ditkit error class expected
     "words": ["exceeds the file size"],          # substrings the message must contain
     "host": {...}}                               # how the real-host test feeds it (node, model folder)

Consumers (in-process function / real-host node):

* ``safetensors_header``: ``loaders.safetensors_io.read_header`` / ``DitKitH3VAELoader`` (file in ``vae/``);
* ``vae_metadata``: ``vae.metadata.validate_image_vae_metadata`` on the file's ``__metadata__`` /
  ``DitKitH3VAELoader`` on the tiny image VAE's tensors re-saved with this metadata;
* ``lokr``: ``loaders.lokr_apply.parse_lokr`` + ``plan`` against the tiny FLUX.2 shapes / ``DitKitLoKrLoader`` on
  ``flux2_tiny.safetensors`` (file in ``loras/``);
* ``coefficients``: ``cache.coefficients.load`` / ``DitKitTeaCache`` on ``h3_tiny_comfy.safetensors`` (file in the
  output's ``ditkit/teacache/``);
* ``h3_latent``: the T=1 decode latent check (``vae.t1_decode``) / ``DitKitH3VAEDecode`` (host: an equivalent
  wrong latent made by a stock node, since the host's input folder is not ours to write);
* ``h3_checkpoint``: ``loaders.h3.load_h3_state_dict`` / ``DitKitH3ModelLoader`` (file in ``diffusion_models/``):
  a micro H3 DiT (all real keys, tiny widths) with one broken tensor each;
* ``h3_adapter``: ``loaders.h3_adapters.plan`` against the tiny H3 shapes with ``qkv_layout="contiguous"`` /
  ``DitKitAdapterLoader`` on ``h3_tiny_comfy.safetensors`` (file in ``loras/``);
* ``fasth3_contract``: ``sampling.fasth3.load_contract`` then ``sampling.fasth3_recipe.decide`` /
  ``DitKitFastH3Schedule`` (the file as ``diffusion_models/<name>/fastvideo_inference.json``, named in
  ``contract_file``; the VSA-field cases are in-process only: the schedule node does not read those fields);
* ``prompt``: an API-format prompt with wrong wiring, host only: ``/prompt`` answers 400 with node errors
  (``expect: "validation"``) or the run ends in a node execution error (``expect: "execution"``).
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

MANIFEST = "manifest.json"
FLUX2_MODEL = "flux2_tiny.safetensors"
H3_MODEL = "h3_tiny_comfy.safetensors"
H3_VIDEO_VAE = "h3_video_vae_tiny.safetensors"
H3_IMAGE_VAE = "h3_image_vae_tiny.safetensors"
# the one FLUX.2 tiny weight the LoKr cases target (double_blocks.0.img_attn.proj: 128 x 128)
LOKR_TARGET = "diffusion_model.double_blocks.0.img_attn.proj"
LOKR_SHAPE = (128, 128)


# ---------------------------------------------------------------------------------------------- raw writers
def _raw(header, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors-like file: 8-byte little-endian header length + header bytes + data."""
    hb = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(hb) if length is None else length) + hb + data


def _st(tensors: dict, metadata: dict | None = None) -> bytes:
    """A valid safetensors file as bytes, written here byte-deterministically (sorted keys, header padded with
    spaces to 8 bytes as the reference writer does; the reference writer's metadata order is not stable)."""
    from ditkit.loaders.safetensors_io import TORCH_TO_ST

    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    data = b""
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        raw = t.reshape(-1).view(torch_uint8()).numpy().tobytes() if t.numel() else b""
        header[k] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def torch_uint8():
    import torch

    return torch.uint8


def _f32(n: int) -> bytes:
    return struct.pack(f"<{n}f", *[float(i) * 0.25 for i in range(n)])


# ---------------------------------------------------------------------------------------------- cases
def _header_cases():
    one = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    c = []

    def add(cid, blob, words):
        c.append((cid, ".safetensors", blob, "safetensors_header", "CheckpointError", words))

    add("st_empty_file", b"", ["too short to hold a header"])
    add("st_five_bytes", b"\x08\x00\x00\x00\x00", ["too short to hold a header"])
    add("st_header_len_zero", _raw(b"", length=0), ["header length 0 is not in"])
    add("st_header_len_huge", _raw(b"{}", length=1 << 40), ["is not in 1..", "not a safetensors file"])
    add("st_header_len_past_eof", _raw(one, _f32(2), length=4096), ["header length 4096 exceeds the file size"])
    add("st_header_not_utf8", _raw(b"\xff\xfe{\x00}"), ["header is not UTF-8"])
    add("st_header_bad_json", _raw(b'{"a": {"dtype": "F32", '), ["invalid JSON"])
    add("st_header_json_array", _raw(b"[1, 2, 3]"), ["header is not a JSON object"])
    add("st_header_deep_nesting", _raw(b"[" * 5000 + b"]" * 5000), ["invalid JSON"])
    add("st_duplicate_key", _raw(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                 b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', _f32(2)),
        ["duplicate JSON key 'a'"])
    add("st_nan_constant", _raw(b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', _f32(2)),
        ["non-finite JSON constant NaN"])
    add("st_unknown_dtype", _raw({"a": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}, _f32(2)),
        ["unknown dtype 'F128'"])
    add("st_dtype_size_mismatch", _raw({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}}, _f32(2)),
        ["do not match dtype F64"])
    add("st_negative_shape", _raw({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, _f32(2)),
        ["invalid shape [-2]"])
    add("st_bool_shape", _raw({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, _f32(2)),
        ["invalid shape [True, 2]"])
    add("st_offsets_reversed", _raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, _f32(2)),
        ["are not ordered"])
    add("st_offsets_float", _raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, _f32(2)),
        ["invalid data_offsets"])
    add("st_offsets_past_end", _raw({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, _f32(2)),
        ["past the data section", "truncated file"])
    add("st_overlap", _raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, _f32(3)),
        ["overlap"])
    add("st_hole", _raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, _f32(3)),
        ["data section not covered", "belong to no tensor"])
    add("st_trailing_bytes", _raw(one, _f32(2) + b"#!payload"), ["trailing bytes after the last tensor"])
    add("st_metadata_not_strings", _raw({"__metadata__": {"x": 1}, **one}, _f32(2)),
        ["__metadata__ must map strings to strings"])
    add("st_entry_not_object", _raw({"a": [0, 8]}, b""), ["entry is not an object"])
    add("st_header_is_pickle", b"\x80\x04\x95" + b"\x00" * 5 + b"cos\nsystem\n(S'true'\ntR.", ["exceeds the file size"])
    return c


def _truncated_lokr() -> bytes:
    import torch

    blob = _st({f"{LOKR_TARGET}.lokr_w1": torch.ones(8, 8), f"{LOKR_TARGET}.lokr_w2": torch.ones(16, 16),
                f"{LOKR_TARGET}.alpha": torch.tensor(1.0)})
    return blob[: len(blob) - 300]


def _vae_meta_cases():
    from ditkit.vae.h3_layout import STOCK_SOURCE_CONFIG

    def cfg(**over):
        c = {"latents_mean": [0.0] * 24, "latents_std": [1.0] * 24, "vae_clip_length": 17, "vae_token_drop": 3,
             "source_config": STOCK_SOURCE_CONFIG}
        c.update(over)
        return json.dumps(c, separators=(",", ":"))

    def meta(**over):
        m = {"h3_t1_direct": "true", "h3_t1_format": "full_decoder_v1", "h3_t1_output_slice": "3",
             "minimax_h3_video_vae": cfg()}
        for k, v in over.items():
            if v is None:
                m.pop(k)
            else:
                m[k] = v
        return m

    sc = dict(STOCK_SOURCE_CONFIG, ch=64)
    cases = [
        ("vae_meta_direct_false", meta(h3_t1_direct="false"), ["'h3_t1_direct'", "must be exactly"]),
        ("vae_meta_direct_yes", meta(h3_t1_direct="yes"), ["'h3_t1_direct'", "'yes'"]),
        ("vae_meta_format_v2", meta(h3_t1_format="full_decoder_v2"), ["'h3_t1_format'", "full_decoder_v1"]),
        ("vae_meta_slice_4", meta(h3_t1_output_slice="4"), ["'h3_t1_output_slice'", "one digit 0..3"]),
        ("vae_meta_slice_two_chars", meta(h3_t1_output_slice="03"), ["'h3_t1_output_slice'", "one digit 0..3"]),
        ("vae_meta_missing_config", meta(minimax_h3_video_vae=None), ["'minimax_h3_video_vae'", "missing"]),
        ("vae_meta_missing_format", meta(h3_t1_format=None), ["'h3_t1_format'", "missing"]),
        ("vae_meta_config_not_json", meta(minimax_h3_video_vae="{latents_mean: [0]"), ["not valid strict JSON"]),
        ("vae_meta_config_nan", meta(minimax_h3_video_vae=cfg().replace('"latents_mean":[0.0', '"latents_mean":[NaN', 1)),
         ["not valid strict JSON", "NaN"]),
        ("vae_meta_config_dup_key", meta(minimax_h3_video_vae=cfg()[:-1] + ',"vae_clip_length":17}'),
         ["duplicate JSON key 'vae_clip_length'"]),
        ("vae_meta_config_array", meta(minimax_h3_video_vae="[1, 2]"), ["must be a JSON object"]),
        ("vae_meta_std_zero", meta(minimax_h3_video_vae=cfg(latents_std=[1.0] * 23 + [0.0])),
         ["'latents_std[23]' = 0.0 must be > 0"]),
        ("vae_meta_mean_23", meta(minimax_h3_video_vae=cfg(latents_mean=[0.0] * 23)),
         ["'latents_mean' must be a list of exactly 24 numbers"]),
        ("vae_meta_mean_string", meta(minimax_h3_video_vae=cfg(latents_mean=["0"] * 24)),
         ["'latents_mean[0]' = '0' is not a finite number"]),
        ("vae_meta_clip_length_16", meta(minimax_h3_video_vae=cfg(vae_clip_length=16)),
         ["'vae_clip_length' = 16", "has 17"]),
        ("vae_meta_source_config_ch", meta(minimax_h3_video_vae=cfg(source_config=sc)),
         ["'source_config.ch' = 64 differs"]),
        ("vae_meta_unknown_field", meta(minimax_h3_video_vae=cfg(exec="import os")), ["unknown fields ['exec']"]),
        ("vae_meta_config_too_long", meta(minimax_h3_video_vae=" " * 70000 + cfg()), ["longer than 65536"]),
    ]
    import torch

    return [(cid, ".safetensors", _st({"placeholder": torch.zeros(1)}, m), "vae_metadata", "MetadataError", w)
            for cid, m, w in cases]


def _lokr_cases():
    import torch

    g = torch.Generator().manual_seed(1234)
    T = LOKR_TARGET

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.01).float()

    def full(**over):
        sd = {f"{T}.lokr_w1": r(8, 8), f"{T}.lokr_w2": r(16, 16), f"{T}.alpha": torch.tensor(1.0)}
        for k, v in over.items():
            if v is None:
                sd.pop(f"{T}.{k}")
            else:
                sd[f"{T}.{k}"] = v
        return sd

    def decomposed(**over):
        sd = {f"{T}.lokr_w1": r(8, 8), f"{T}.lokr_w2_a": r(16, 4), f"{T}.lokr_w2_b": r(4, 16),
              f"{T}.alpha": torch.tensor(4.0)}
        for k, v in over.items():
            if v is None:
                sd.pop(f"{T}.{k}")
            else:
                sd[f"{T}.{k}"] = v
        return sd

    nan_w2 = r(16, 16)
    nan_w2[3, 5] = float("nan")
    inf_w1 = r(8, 8).to(torch.bfloat16)
    inf_w1[0, 0] = float("inf")
    zimage = {f"diffusion_model.layers.{i}.attention.to_q.{s}": r(*shape) for i in range(2)
              for s, shape in (("lokr_w1", (4, 4)), ("lokr_w2", (16, 16)))}
    cases = [
        ("lokr_shape_mismatch", full(lokr_w2=r(16, 8)), ["builds ΔW of shape (128, 64)", "(128, 128)"]),
        ("lokr_nan_factor", full(lokr_w2=nan_w2), ["lokr_w2'", "NaN or Inf"]),
        ("lokr_inf_factor_bf16", full(lokr_w1=inf_w1), ["lokr_w1'", "NaN or Inf"]),
        ("lokr_zero_alpha", decomposed(alpha=torch.tensor(0.0)), ["alpha' is 0.0", "finite and non-zero"]),
        ("lokr_nan_alpha", decomposed(alpha=torch.tensor(float("nan"))), ["alpha' is nan", "finite and non-zero"]),
        ("lokr_alpha_not_scalar", full(alpha=torch.ones(2)), ["must be a scalar alpha"]),
        ("lokr_rank_mismatch", decomposed(lokr_w2_b=r(5, 16)), ["w2 factors do not fit"]),
        ("lokr_int_factor", full(lokr_w1=torch.ones(8, 8, dtype=torch.int32)), ["non-float dtype torch.int32"]),
        ("lokr_incomplete", full(lokr_w2=None), ["is incomplete"]),
        ("lokr_wrong_family_zimage", zimage, ["no LoKr module applies to this flux2 model", "Z-Image"]),
        ("lokr_wrong_family_sdxl", {f"lora_unet_down_blocks_0_attentions_0_proj_in.{s}": r(*shape)
                                    for s, shape in (("lokr_w1", (4, 4)), ("lokr_w2", (8, 8)))},
         ["no LoKr module applies", "UNet"]),
        ("lokr_not_lokr", {"some.random.tensor": r(4, 4)}, ["no LoKr module applies", "not a LoKr tensor"]),
        # ai-toolkit naming, decomposed w2, no alpha: ai-toolkit takes alpha from its job config, so the file does
        # not say which scale to use (the node's 'scale' input sets it)
        ("lokr_no_alpha_undetermined", decomposed(alpha=None), ["does not determine the scale", "'scale' input"]),
    ]
    out = [(cid, ".safetensors", _st(sd), "lokr", "AdapterError", w) for cid, sd, w in cases]
    out.append(("lokr_truncated", ".safetensors", _truncated_lokr(), "lokr", "CheckpointError",
                ["past the data section", "truncated"]))
    return out


def _coef_cases():
    def doc(**over):
        d = {"format": "ditkit.teacache.coefficients", "version": 1, "family": "h3",
             "streams": {"video": {"coefficients": [1.0, -2.0, 3.0, 0.5, 0.01], "x_range": [0.0, 0.5], "fit": None},
                         "audio": {"coefficients": [0.5, 0.01], "x_range": None, "fit": None}},
             "calibration": None,
             "fingerprint": {"family": "h3", "model": None, "sampler": "euler", "steps": 8, "sigmas": None,
                             "shifts": {}, "cfg": 1.0, "guidance": None},
             "provenance": {"source": "ditkit bad-input corpus", "kind": "calibrated", "created": "2026-11-30"}}
        for k, v in over.items():
            if v is None:
                d.pop(k)
            else:
                d[k] = v
        return (json.dumps(d, indent=1, sort_keys=True) + "\n").encode()

    def js(d):
        return d

    good_streams = json.loads(doc())["streams"]
    cases = [
        ("coef_wrong_version", doc(version=2), ["version: is 2", "version 1 only"]),
        ("coef_version_string", doc(version="1"), ["version: is a string"]),
        ("coef_wrong_format", doc(format="teacache"), ["not a ditkit TeaCache coefficient file"]),
        ("coef_nan_literal", doc().replace(b"-2.0", b"NaN"), ["non-finite JSON constant NaN"]),
        ("coef_infinity_literal", doc().replace(b"0.01", b"-Infinity", 1), ["non-finite JSON constant -Infinity"]),
        ("coef_string_coefficient", doc(streams={**good_streams, "video": {**good_streams["video"],
                                                                          "coefficients": [1.0, "2"]}}),
         ["streams.video.coefficients[1]", "must be finite numbers"]),
        ("coef_too_many_coefficients", doc(streams={"video": {"coefficients": [0.1] * 12}}),
         ["streams.video.coefficients", "1..11 numbers"]),
        ("coef_wrong_fingerprint_family", doc(fingerprint={"family": "zimage", "steps": 8}),
         ["fingerprint.family: is 'zimage'", "family is 'h3'"]),
        ("coef_fingerprint_not_object", doc(fingerprint=["h3"]), ["fingerprint: must be an object"]),
        ("coef_fingerprint_sigmas_bad", doc(fingerprint={"family": "h3", "sigmas": [1.0, "x"]}),
         ["fingerprint.sigmas"]),
        ("coef_unknown_family", doc(family="sdxl"), ["family: is a string, expected one of"]),
        ("coef_foreign_stream", doc(streams={"video": good_streams["video"], "image": good_streams["audio"]}),
         ["streams.image: is not a stream of family 'h3'"]),
        ("coef_x_range_reversed", doc(streams={"video": {"coefficients": [1.0], "x_range": [0.5, 0.1]}}),
         ["streams.video.x_range"]),
        ("coef_no_provenance", doc(provenance=None), ["provenance.source"]),
        ("coef_duplicate_key", doc()[:-2] + b',"version":1}\n', ["duplicate JSON key 'version'"]),
        ("coef_not_utf8", b'{"format": "\xff\xfe"}', ["is not UTF-8"]),
        # polynomials negative where the runtime evaluates them (a negative rescaled change skips steps)
        ("coef_negative_inside_x_range", doc(streams={**good_streams, "video": {"coefficients": [4.0, -2.0, 0.2],
                                                                               "x_range": [0.0, 0.5]}}),
         ["streams.video", "negative inside its x_range"]),
        ("coef_negative_at_range_end", doc(streams={**good_streams, "video": {"coefficients": [-1.0, 0.3],
                                                                             "x_range": [0.1, 0.5]}}),
         ["streams.video", "at x = 0.5", "negative"]),
        ("coef_negative_constant", doc(streams={**good_streams, "audio": {"coefficients": [-0.01], "x_range": None}}),
         ["streams.audio", "negative"]),
        ("coef_negative_unbounded", doc(streams={**good_streams, "video": {"coefficients": [-450.0, 280.0, -45.0, 3.2,
                                                                                           0.02], "x_range": None}}),
         ["streams.video", "x_range is null", "negative"]),
        ("coef_root_array", b"[1, 2]", ["expected a JSON object"]),
    ]
    return [(cid, ".json", js(b), "coefficients", "CoefficientError", w) for cid, b, w in cases]


MICRO_H3 = {"hidden_size": 8, "num_attention_heads": 1, "attention_head_dim": 6, "num_layers": 1,
            "token_refiner_num_layers": 1, "ffn_hidden_size": 8, "latents_dim": 24, "audio_latents_dim": 4,
            "patch_size": [1, 2, 2], "text_dim": 4, "timestep_input_dim": 4, "time_embed_hidden_size": 4,
            "time_embed_dim": 4, "rope_inv_freq_len": 1, "rope_theta": 10000.0}


def micro_h3() -> dict:
    """A valid H3 DiT state dict (ComfyUI layout, every real key) at micro widths, ~15 KB."""
    from ditkit.tiny.ckpt_h3 import base_state_dict

    return base_state_dict(MICRO_H3, seed=17)


def _h3_cases():
    import torch

    def broken(**over):
        sd = micro_h3()
        for k, v in over.items():
            sd[k.replace("__", ".")] = v
        return _st(sd)

    b0 = "blocks.0."
    cases = [
        ("h3_q_norm_empty", broken(**{"blocks__0__attn__q_norm__weight": torch.ones(0, dtype=torch.bfloat16)}),
         [f"'{b0}attn.q_norm.weight'", "empty tensor"]),
        ("h3_k_norm_other_width", broken(**{"blocks__0__attn__k_norm__weight": torch.ones(5, dtype=torch.bfloat16)}),
         ["k_norm.weight", "head_dim 6"]),
        ("h3_norm_2d", broken(**{"blocks__0__norm1__weight": torch.ones(8, 1, dtype=torch.bfloat16)}),
         [f"norm weight '{b0}norm1.weight'", "1-D"]),
        ("h3_norm_int32", broken(**{"blocks__0__norm2__weight": torch.ones(8, dtype=torch.int32)}),
         [f"'{b0}norm2.weight'", "integer tensor (I32)", "quantization marker"]),
        ("h3_linear_fp8_no_marker", broken(**{"blocks__0__mlp__fc1__weight": torch.zeros(16, 8).to(torch.float8_e4m3fn)}),
         [f"'{b0}mlp.fc1.weight'", "fp8 tensor (F8_E4M3)", "quantization marker"]),
        ("h3_bias_int8_no_marker", broken(**{"final_layer__video_out__bias": torch.zeros(96, dtype=torch.int8)}),
         ["'final_layer.video_out.bias'", "integer tensor (I8)"]),
        ("h3_weight_scalar", broken(**{"video_patch_proj__weight": torch.tensor(1.0)}),
         ["'video_patch_proj.weight'", "expected a 2-D tensor"]),
    ]
    return [(cid, ".safetensors", blob, "h3_checkpoint", "CheckpointError", w) for cid, blob, w in cases]


def _h3_adapter_cases():
    """Bad H3 adapters for the tiny H3 config (hidden 64, 3 heads x 32: qkv 288 x 64), each naming its key."""
    import torch

    g = torch.Generator().manual_seed(23)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).contiguous()

    q = "diffusion_model.blocks.0.attn.qkv_proj"
    o = "diffusion_model.blocks.0.attn.out_proj"

    def lora(p=q, rows=288, cols=64, **extra):
        sd = {f"{p}.lora_down.weight": r(4, cols), f"{p}.lora_up.weight": r(rows, 4)}
        sd.update(extra)
        return sd

    cases = [
        ("h3a_wrong_shape", lora(rows=287), {}, [f"'{q}'", "builds ΔW of shape (287, 64)", "(288, 64)"]),
        ("h3a_unknown_prefix", lora(p="diffusion_model.blocks.0.attn.nope"), {},
         ["'diffusion_model.blocks.0.attn.nope.lora_down.weight'", "matches no weight"]),
        ("h3a_other_model", lora(p="lora_unet_down_blocks_0_attentions_0_proj_in", rows=8, cols=8), {},
         ["lora_unet_down_blocks_0_attentions_0_proj_in", "matches no weight"]),
        ("h3a_mixed_layouts", {**lora(), "transformer_blocks.1.attn.to_q.lora_A.weight": r(4, 64),
                               "transformer_blocks.1.attn.to_q.lora_B.weight": r(96, 4)}, {},
         ["mixed layouts", "transformer_blocks.1.attn.to_q", "qkv_proj"]),
        ("h3a_alpha_zero", lora(**{f"{q}.alpha": torch.tensor(0.0)}), {}, [f"'{q}.alpha' is 0.0", "non-zero"]),
        ("h3a_alpha_nan", lora(**{f"{q}.alpha": torch.tensor(float("nan"))}), {}, [f"'{q}.alpha' is nan", "finite"]),
        ("h3a_nan_factor", {f"{q}.lora_down.weight": torch.full((4, 64), float("nan")), f"{q}.lora_up.weight": r(288, 4)},
         {}, [f"'{q}.lora_down.weight'", "NaN or Inf"]),
        ("h3a_set_weight_shape", {"transformer_blocks.0.attn.to_gate_compress.set_weight": r(96, 65)},
         {"format": "fastvideo-lora-v2"}, ["'transformer_blocks.0.attn.to_gate_compress.set_weight'", "(96, 65)",
                                           "(96, 64)"]),
        ("h3a_unknown_suffix", lora(**{f"{q}.lora_magic": r(2)}), {}, [f"'{q}.lora_magic'", "not an adapter tensor"]),
        ("h3a_dora", lora(**{f"{q}.dora_scale": r(288, 1)}), {}, [f"'{q}.dora_scale'", "DoRA"]),
        ("h3a_legacy_dora_diff_b", {"blocks.0.attn.out_proj.lora_A.weight": r(4, 96),
                                    "blocks.0.attn.out_proj.lora_B.weight": r(64, 4),
                                    "blocks.0.attn.out_proj.diff_b": r(64)}, {},
         ["'blocks.0.attn.out_proj.diff_b'", "legacy LyCORIS-DoRA"]),
        ("h3a_curve_on_full_base", {"diffusion_model.blocks.0.adaln_proj.linear.weight": r(1152, 8)}, {},
         ["'diffusion_model.blocks.0.adaln_proj.linear.weight'", "curve-form"]),
        ("h3a_undetermined_scale", {"lycoris_blocks_0_attn_out_proj.lora_down.weight": r(4, 96),
                                    "lycoris_blocks_0_attn_out_proj.lora_up.weight": r(64, 4)}, {},
         ["does not determine the scale", "'lycoris_blocks_0_attn_out_proj'", "'scale' input"]),
        ("h3a_bad_metadata_alpha", lora(p=o, rows=64, cols=96), {"alpha": "0"}, ["metadata 'alpha'", "non-zero"]),
        ("h3a_bad_qkv_metadata", lora(), {"qkv_layout": "rows"}, ["metadata 'qkv_layout'", "'rows'"]),
        ("h3a_two_assignments", {"transformer_blocks.0.attn.to_gate_compress.set_weight": r(96, 64),
                                 "blocks.0.attn.to_gate_compress.set_weight": r(96, 64)}, {},
         ["mixed layouts"]),
    ]
    return [(cid, ".safetensors", _st(sd, meta or None), "h3_adapter", "AdapterError", w) for cid, sd, meta, w in cases]


def _latent_cases():
    import torch

    return [
        ("latent_16_channels", ".latent", _st({"latent_tensor": torch.zeros(1, 16, 1, 2, 2),
                                               "latent_format_version_0": torch.zeros(0)}),
         "h3_latent", "DitKitError", ["16 channels", "expects 24"]),
        ("latent_4d", ".latent", _st({"latent_tensor": torch.zeros(1, 24, 2, 2),
                                      "latent_format_version_0": torch.zeros(0)}),
         "h3_latent", "DitKitError", ["must be 5-D", "(1, 24, 2, 2)"]),
        ("latent_batch_0", ".latent", _st({"latent_tensor": torch.zeros(0, 24, 1, 2, 2),
                                          "latent_format_version_0": torch.zeros(0)}),
         "h3_latent", "DitKitError", ["empty latent", "B=0"]),
        ("latent_t_0", ".latent", _st({"latent_tensor": torch.zeros(1, 24, 0, 2, 2),
                                      "latent_format_version_0": torch.zeros(0)}),
         "h3_latent", "DitKitError", ["empty latent", "T=0"]),
        ("latent_width_0", ".latent", _st({"latent_tensor": torch.zeros(1, 24, 1, 2, 0),
                                          "latent_format_version_0": torch.zeros(0)}),
         "h3_latent", "DitKitError", ["empty latent", "W=0"]),
    ]


def _prompt_cases():
    vae = {"class_type": "DitKitH3VAELoader", "inputs": {"vae_name": H3_VIDEO_VAE}}
    img = {"class_type": "EmptyImage", "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": 0}}
    cases = [
        # (id, graph, expect, bad node, error, words)
        ("prompt_image_into_latent", {"1": vae, "2": img,
                                      "3": {"class_type": "DitKitH3VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
                                      "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}},
         "validation", "3", "return_type_mismatch", ["IMAGE", "LATENT"]),
        ("prompt_string_into_model", {"1": {"class_type": "PrimitiveString", "inputs": {"value": "flux2_tiny"}},
                                      "2": {"class_type": "DitKitLoKrLoader",
                                            "inputs": {"model": ["1", 0], "lokr_name": "flux2_lokr_tiny.safetensors",
                                                       "strength": 1.0}},
                                      "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}}},
         "validation", "2", "return_type_mismatch", ["STRING", "MODEL"]),
        ("prompt_missing_model", {"1": {"class_type": "DitKitTeaCache",
                                        "inputs": {"coefficients": "shipped:x", "threshold": 0.2, "audio_threshold": 0.2,
                                                   "start_percent": 0.0, "end_percent": 1.0, "cache_device": "model",
                                                   "strict": False}},
                                  "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}},
         "validation", "1", "required_input_missing", ["model"]),
        ("prompt_strength_not_number", {"1": {"class_type": "UNETLoader",
                                              "inputs": {"unet_name": FLUX2_MODEL, "weight_dtype": "default"}},
                                        "2": {"class_type": "DitKitLoKrLoader",
                                              "inputs": {"model": ["1", 0], "lokr_name": "flux2_lokr_tiny.safetensors",
                                                         "strength": "strong"}},
                                        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}}},
         "validation", "2", "invalid_input_type", ["strength"]),
        ("prompt_link_to_missing_output", {"1": vae,
                                           "2": {"class_type": "DitKitH3VAEDecode",
                                                 "inputs": {"samples": ["1", 5], "vae": ["1", 0]}},
                                           "3": {"class_type": "PreviewImage", "inputs": {"images": ["2", 0]}}},
         "validation", "2", "exception_during_inner_validation", ["Exception when validating inner node"]),
        ("prompt_sd_latent_into_h3_decode", {"1": vae,
                                             "2": {"class_type": "EmptyHunyuanLatentVideo",
                                                   "inputs": {"width": 32, "height": 32, "length": 1, "batch_size": 1}},
                                             "3": {"class_type": "DitKitH3VAEDecode",
                                                   "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
                                             "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}},
         "execution", "3", "DitKitError", ["16 channels", "expects 24"]),
        ("prompt_image_latent_4d_into_h3_decode", {"1": vae,
                                                   "2": {"class_type": "EmptyLatentImage",
                                                         "inputs": {"width": 32, "height": 32, "batch_size": 1}},
                                                   "3": {"class_type": "DitKitH3VAEDecode",
                                                         "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
                                                   "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}},
         "execution", "3", "DitKitError", ["must be 5-D"]),
        # DitKitH3VAELoader loads H3 audio VAEs (at the file's size); the video decode refuses one by name
        ("prompt_audio_vae_into_h3_decode", {"1": {"class_type": "EmptyMiniMaxH3LatentAV",
                                                   "inputs": {"width": 64, "height": 64, "length": 5}},
                                             "2": {"class_type": "DitKitH3VAELoader",
                                                   "inputs": {"vae_name": "h3_audio_vae_tiny.safetensors"}},
                                             "3": {"class_type": "DitKitH3VAEDecode",
                                                   "inputs": {"samples": ["1", 0], "vae": ["2", 0]}},
                                             "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}},
         "execution", "3", "UnsupportedModelError", ["H3 AUDIO VAE"]),
    ]
    # issue #17: hostile values that pass /prompt validation and must fail in the node, before any heavy work
    unet = {"class_type": "UNETLoader", "inputs": {"unet_name": H3_MODEL, "weight_dtype": "default"}}
    enc = {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["1", 0]}}
    clip5 = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 5, "color": 0}}

    def save(prefix="corpus/v", fps=24.0, samples=("3", 0), audio=None):
        i = {"vae": ["1", 0], "samples": list(samples), "fps": fps, "filename_prefix": prefix, "codec": "h264",
             "crf": -1}
        if audio is not None:
            i["audio"] = audio
        return {"class_type": "DitKitSaveVideo", "inputs": i}

    def audio(duration, rate):
        return {"class_type": "EmptyAudio", "inputs": {"duration": duration, "sample_rate": rate, "channels": 2}}

    trim = {"class_type": "TrimVideoLatent", "inputs": {"samples": ["3", 0], "trim_amount": 99}}
    cases += [
        ("prompt_nan_lokr_strength", {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX2_MODEL,
                                                                                   "weight_dtype": "default"}},
                                      "2": {"class_type": "DitKitLoKrLoader",
                                            "inputs": {"model": ["1", 0], "lokr_name": "flux2_lokr_tiny.safetensors",
                                                       "strength": float("nan")}},
                                      "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}}},
         "execution", "2", "DitKitError", ["input 'strength'", "finite"]),
        ("prompt_nan_teacache_threshold_linked", {"1": unet,
                                                  "2": {"class_type": "PrimitiveFloat", "inputs": {"value": float("nan")}},
                                                  "3": {"class_type": "DitKitTeaCache",
                                                        "inputs": {"model": ["1", 0], "coefficients": "shipped:x",
                                                                   "threshold": ["2", 0], "audio_threshold": 0.2,
                                                                   "start_percent": 0.0, "end_percent": 1.0,
                                                                   "cache_device": "model", "strict": False}},
                                                  "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}}},
         "execution", "3", "DitKitError", ["input 'threshold'", "finite"]),
        ("prompt_nan_save_video_fps", {"1": vae, "2": clip5, "3": enc, "4": save(fps=float("nan"))},
         "execution", "4", "DitKitError", ["input 'fps'", "finite"]),
        ("prompt_nul_in_filename_prefix", {"1": vae, "2": clip5, "3": enc, "4": save(prefix="corpus/v.mp4\x00")},
         "execution", "4", "DitKitError", ["input 'filename_prefix'", "U+0000"]),
        ("prompt_filename_prefix_too_long", {"1": vae, "2": clip5, "3": enc, "4": save(prefix="corpus/" + "n" * 256)},
         "execution", "4", "DitKitError", ["input 'filename_prefix'", "256 bytes"]),
        ("prompt_save_video_empty_latent", {"1": vae, "2": clip5, "3": enc, "5": trim, "4": save(samples=("5", 0))},
         "execution", "4", "DitKitError", ["input 'samples'", "empty latent", "T=0"]),
        ("prompt_h3_decode_empty_latent", {"1": vae, "2": clip5, "3": enc, "5": trim,
                                           "4": {"class_type": "DitKitH3VAEDecode", "inputs": {"samples": ["5", 0],
                                                                                              "vae": ["1", 0]}},
                                           "6": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}}},
         "execution", "4", "DitKitError", ["input 'samples'", "empty latent", "T=0"]),
        ("prompt_save_video_audio_7hz", {"1": vae, "2": clip5, "3": enc, "5": audio(1.0, 7),
                                         "4": save(audio=["5", 0])},
         "execution", "4", "DitKitError", ["input 'audio'", "7 Hz", "not supported"]),
        ("prompt_save_video_audio_0s", {"1": vae, "2": clip5, "3": enc, "5": audio(0.0, 44100),
                                        "4": save(audio=["5", 0])},
         "execution", "4", "DitKitError", ["input 'audio'", "empty", "0 samples"]),
        ("prompt_encode_image_15px", {"1": vae, "2": {"class_type": "EmptyImage",
                                                      "inputs": {"width": 15, "height": 15, "batch_size": 1, "color": 0}},
                                      "3": {"class_type": "DitKitH3EncodeImage",
                                            "inputs": {"image": ["2", 0], "vae": ["1", 0], "layout": "video"}},
                                      "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}}},
         "execution", "3", "DitKitError", ["input 'image'", "15x15", "at least 32x32"]),
        ("prompt_encode_image_1px", {"1": vae, "2": {"class_type": "EmptyImage",
                                                     "inputs": {"width": 1, "height": 1, "batch_size": 1, "color": 0}},
                                     "3": {"class_type": "DitKitH3EncodeImage",
                                           "inputs": {"image": ["2", 0], "vae": ["1", 0], "layout": "video"}},
                                     "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}}},
         "execution", "3", "DitKitError", ["input 'image'", "1x1", "at least 32x32"]),
        ("prompt_calibrate_name_too_long", {"1": unet,
                                            "2": {"class_type": "DitKitTeaCacheCalibrate",
                                                  "inputs": {"model": ["1", 0], "name": "n" * 251, "degree": 4,
                                                             "min_prompts": 3}},
                                            "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}},
         "execution", "2", "CoefficientError", ["input 'name'", "256 bytes"]),
    ]
    out = []
    for cid, graph, expect, node, err, words in cases:
        blob = (json.dumps(graph, indent=1, sort_keys=True) + "\n").encode()
        out.append((cid, ".json", blob, "prompt", err, words, {"expect": expect, "node": node}))
    return out


def _fasth3_contract_cases():
    """FastH3 ``fastvideo_inference.json`` files that break one rule each (FastVideo ``_load_checkpoint_schedule``'s
    schedule rules, read by ``sampling.fasth3.load_contract``; the VSA fields, read by
    ``sampling.fasth3_recipe.decide``). The valid base is the FastH3 8-Step V2 contract."""
    base = {"schema_version": "fasth3-inference-contract-v1", "model_id": "FastVideo/FastVideo-FastH3-8-Step-V2",
            "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125], "num_inference_steps": 9,
            "transformer_forwards": 8, "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0,
            "guidance_scale": 1.0, "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8,
            "vsa_tile_size": 64, "task": "t2av"}

    def doc(**over):
        d = dict(base)
        for k, v in over.items():
            if v is None:
                d.pop(k)
            else:
                d[k] = v
        return (json.dumps(d, indent=1, sort_keys=True) + "\n").encode()

    sched = [
        ("fasth3_contract_wrong_schema", doc(schema_version="fasth3-inference-contract-v2"),
         ["schema_version must be 'fasth3-inference-contract-v1'"]),
        ("fasth3_contract_pdd", doc(pdd_steps=32), ["PDD", "DMD contracts"]),
        ("fasth3_contract_rungs_not_decreasing", doc(dmd_denoising_steps=[999, 874, 874, 624, 500, 375, 250, 125]),
         ["dmd_denoising_steps must be strictly decreasing"]),
        ("fasth3_contract_rung_out_of_range", doc(dmd_denoising_steps=[1200, 874, 749, 624, 500, 375, 250, 125]),
         ["integers in (0, 1000]"]),
        ("fasth3_contract_rung_float", doc(dmd_denoising_steps=[999.0, 874, 749, 624, 500, 375, 250, 125]),
         ["integers in (0, 1000]"]),
        ("fasth3_contract_no_rungs", doc(dmd_denoising_steps=None), ["non-empty list of integers"]),
        ("fasth3_contract_steps_mismatch", doc(num_inference_steps=8), ["num_inference_steps must be the grid-point "
                                                                       "count 9"]),
        ("fasth3_contract_forwards_mismatch", doc(transformer_forwards=9), ["transformer_forwards must equal the rung "
                                                                           "count 8"]),
        ("fasth3_contract_shift_nan", doc().replace(b'"video_scheduler_shift": 10.0', b'"video_scheduler_shift": NaN'),
         ["non-finite JSON constant NaN"]),
        ("fasth3_contract_shift_negative", doc(video_scheduler_shift=-10.0),
         ["video_scheduler_shift must be a positive finite number"]),
        ("fasth3_contract_shift_out_of_range", doc(audio_scheduler_shift=1000.0),
         ["audio_scheduler_shift 1000 is outside 0.01..100"]),
        ("fasth3_contract_shift_string", doc(video_scheduler_shift="10"),
         ["video_scheduler_shift must be a positive finite number"]),
        ("fasth3_contract_duplicate_key", doc()[:-2] + b',"transformer_forwards":8}\n', ["duplicate JSON key"]),
        ("fasth3_contract_not_utf8", b'{"schema_version": "\xff\xfe"}', ["not UTF-8 text"]),
        ("fasth3_contract_root_array", b"[1, 2]", ["must hold a JSON object"]),
        ("fasth3_contract_too_large", b"{" + b" " * (64 * 1024) + b"}", ["larger than 65536 bytes"]),
    ]
    vsa = [
        ("fasth3_contract_vsa_tile_128", doc(vsa_tile_size=128), ["vsa_tile_size 128 is not 64"]),
        ("fasth3_contract_vsa_sparsity_1", doc(vsa_sparsity=1.0), ["vsa_sparsity 1 is outside [0, 1)"]),
        ("fasth3_contract_vsa_no_sparsity", doc(vsa_sparsity=None), ["VIDEO_SPARSE_ATTN_H3 without vsa_sparsity"]),
    ]
    return ([(cid, ".json", b, "fasth3_contract", "ScheduleError", w) for cid, b, w in sched]
            + [(cid, ".json", b, "fasth3_contract", "CheckpointError", w, None) for cid, b, w in vsa])


HOST = {
    "safetensors_header": {"node": "DitKitH3VAELoader", "input": "vae_name", "folder": "vae"},
    "vae_metadata": {"node": "DitKitH3VAELoader", "input": "vae_name", "folder": "vae", "tensors_from": H3_IMAGE_VAE},
    "lokr": {"node": "DitKitLoKrLoader", "input": "lokr_name", "folder": "loras", "model": FLUX2_MODEL},
    "coefficients": {"node": "DitKitTeaCache", "input": "coefficients", "folder": "output:ditkit/teacache",
                     "model": H3_MODEL},
    "h3_latent": None,  # covered on the host by the prompt_*_into_h3_decode cases (same check, same words)
    "h3_checkpoint": {"node": "DitKitH3ModelLoader", "input": "model_name", "folder": "diffusion_models"},
    "h3_adapter": {"node": "DitKitAdapterLoader", "input": "adapter_name", "folder": "loras", "model": H3_MODEL},
    # the file becomes diffusion_models/<name>/fastvideo_inference.json, named in the node's contract_file
    "fasth3_contract": {"node": "DitKitFastH3Schedule", "input": "contract_file", "folder": "diffusion_models",
                        "as": "fastvideo_inference.json", "model": H3_MODEL},
}


def build_cases() -> list[dict]:
    """All cases, as manifest entries plus their bytes under ``_bytes``."""
    rows = (_header_cases() + _vae_meta_cases() + _lokr_cases() + _coef_cases() + _h3_cases() + _latent_cases()
            + _h3_adapter_cases() + _prompt_cases() + _fasth3_contract_cases())
    out = []
    seen = set()
    for row in rows:
        cid, ext, blob, consumer, err, words = row[:6]
        assert cid not in seen, cid
        seen.add(cid)
        host = row[6] if len(row) > 6 else HOST[consumer]
        out.append({"id": cid, "file": cid + ext, "consumer": consumer, "error": err, "words": list(words),
                    "host": host, "_bytes": blob})
    return out


def generate(outdir) -> list[dict]:
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    cases = build_cases()
    for c in cases:
        (outdir / c["file"]).write_bytes(c["_bytes"])
    manifest = {"generator": "python -m tests.support.corpus", "n_cases": len(cases),
                "cases": [{k: v for k, v in c.items() if k != "_bytes"} for c in cases]}
    (outdir / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    a = ap.parse_args(argv)
    cases = generate(a.outdir)
    total = sum(len(c["_bytes"]) for c in cases)
    print(f"wrote {len(cases)} cases ({total} bytes) + {MANIFEST} to {a.outdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
