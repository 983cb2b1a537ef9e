"""Fuzzing (hypothesis) of ditkit's parsers of untrusted files: nothing but ditkit's own error types escapes, and
every example finishes within the deadline (no hang). Derandomized, 200 examples each, so CI is deterministic."""
from __future__ import annotations

import json
import os
import struct
import tempfile

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ditkit.errors import DitKitError  # noqa: E402

FUZZ = settings(max_examples=200, derandomize=True, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_TMP = tempfile.mkdtemp(prefix="ditkit_fuzz_")

json_scalars = st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
                           max_leaves=20)


def _file(data: bytes, name="f.safetensors") -> str:
    p = os.path.join(_TMP, name)
    with open(p, "wb") as f:
        f.write(data)
    return p


def _only_ditkit_errors(fn, *a, **k):
    try:
        return fn(*a, **k)
    except DitKitError:
        return None


# ---------------------------------------------------------------------------------------------- safetensors header
DTYPE_NAMES = ["F32", "F16", "BF16", "I8", "U8", "BOOL", "F64", "I64", "F8_E4M3", "X", 7, None]
entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPE_NAMES),
    "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-4, 64), min_size=0, max_size=3) | json_values,
})
headers = st.dictionaries(st.text(max_size=6), entry | json_values, max_size=4)


@FUZZ
@given(st.binary(max_size=256))
def test_fuzz_header_raw_bytes(data):
    _only_ditkit_errors(_read_header, _file(data))


@FUZZ
@given(headers, st.binary(max_size=96), st.integers(-8, 8), st.sampled_from([None, {"a": "b"}, {"a": 1}, [], "x"]))
def test_fuzz_header_structured(header, data, len_delta, meta):
    if meta is not None:
        header = dict(header, __metadata__=meta)
    hb = json.dumps(header).encode()
    n = max(0, len(hb) + len_delta)
    h = _only_ditkit_errors(_read_header, _file(struct.pack("<Q", n) + hb + data))
    if h is not None:  # accepted: then every tensor lies inside the data section, without overlap
        spans = sorted((t.begin, t.end) for t in h.tensors.values())
        assert all(0 <= b <= e <= len(data) for b, e in spans)
        assert all(e0 <= b1 for (_, e0), (b1, _) in zip(spans, spans[1:]))


def _read_header(path):
    from ditkit.loaders.safetensors_io import SafeFile, read_header

    h = read_header(path)
    with SafeFile(path) as f:  # every accepted tensor is also readable
        for k in f.keys():
            f.get(k)
    return h


# ---------------------------------------------------------------------------------------------- image-VAE metadata
def _good_meta_cfg():
    from ditkit.vae.h3_layout import STOCK_SOURCE_CONFIG

    return {"latents_mean": [0.0] * 24, "latents_std": [1.0] * 24, "vae_clip_length": 17, "vae_token_drop": 3,
            "source_config": STOCK_SOURCE_CONFIG}


meta_keys = st.sampled_from(["h3_t1_direct", "h3_t1_format", "h3_t1_output_slice", "minimax_h3_video_vae",
                             "h3_t1_decoder_sha256", "other"])


@FUZZ
@given(st.dictionaries(meta_keys, st.text(max_size=40), max_size=6))
def test_fuzz_vae_metadata_text(meta):
    from ditkit.vae.metadata import validate_image_vae_metadata

    _only_ditkit_errors(validate_image_vae_metadata, meta, "fuzz")


@FUZZ
@given(st.sampled_from(["latents_mean", "latents_std", "vae_clip_length", "vae_token_drop", "source_config", "extra"]),
       json_values | st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=24, max_size=24),
       st.sampled_from(["true", "1", "false"]), st.sampled_from(["0", "3", "4", "", "00"]))
def test_fuzz_vae_metadata_config(field, value, direct, sl):
    from ditkit.vae.metadata import validate_image_vae_metadata

    cfg = _good_meta_cfg()
    cfg[field] = value
    meta = {"h3_t1_direct": direct, "h3_t1_format": "full_decoder_v1", "h3_t1_output_slice": sl,
            "minimax_h3_video_vae": json.dumps(cfg)}
    _only_ditkit_errors(validate_image_vae_metadata, meta, "fuzz")


# ---------------------------------------------------------------------------------------------- LoKr key parser
@pytest.fixture(scope="module")
def flux2_shapes():
    from ditkit.loaders.safetensors_io import read_header
    from ditkit.tiny.checkpoints import generate_all

    out = tempfile.mkdtemp(prefix="ditkit_fuzz_flux2_")
    generate_all(out, only=["flux2_dit"])
    h = read_header(os.path.join(out, "diffusion_models", "flux2_tiny.safetensors"))
    return {"diffusion_model." + k: tuple(t.shape) for k, t in h.tensors.items()}


PREFIXES = ["diffusion_model.double_blocks.0.img_attn.proj", "lycoris_double_blocks_0_img_attn_qkv",
            "transformer.transformer_blocks.0.attn.to_q", "base_model.model.single_transformer_blocks.0.proj_mlp",
            "lora_unet_single_blocks_0_linear1", "x.y"]
SUFFIXES = ["lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "alpha", "scalar",
            "dora_scale", "lokr_t1", "lokr_factor", "weird"]
# 2-D factors of any small shape (what real, even broken, trainers write) plus wrong-rank and empty tensors.
factor = st.tuples(st.integers(0, 8), st.integers(0, 8)).map(lambda s: torch.full(s, 0.01)) | \
    st.sampled_from([torch.full((8, 8), float("nan")), torch.ones(8, 8, dtype=torch.int8), torch.ones(16, 16),
                     torch.ones(8, 8, dtype=torch.bfloat16), torch.ones(128, 1), torch.ones(4, 128),
                     torch.tensor(1.0), torch.ones(8), torch.ones(0), torch.ones(2, 2, 2)])
scalar = st.sampled_from([torch.tensor(1.0), torch.tensor(0.0), torch.tensor(float("inf")), torch.tensor(4.0),
                          torch.ones(0), torch.ones(2), torch.tensor(float("nan"))])


@FUZZ
@given(keys=st.dictionaries(st.tuples(st.sampled_from(PREFIXES), st.sampled_from(SUFFIXES)), st.none(), max_size=8),
       data=st.data())
def test_fuzz_lokr_parser(keys, data, flux2_shapes):
    from ditkit.loaders import lokr_apply as lokr

    sd = {}
    for (p, s) in keys:
        sd[f"{p}.{s}"] = data.draw(scalar) if s in ("alpha", "scalar", "lokr_factor") else data.draw(factor)
    try:
        parsed = lokr.parse_lokr(sd, source="fuzz")
        plan = lokr.plan(parsed, flux2_shapes, source="fuzz")
    except DitKitError:
        return
    for it in plan.items:  # accepted: ΔW has the target's shape and is finite
        d = lokr.module_delta(it)
        assert tuple(d.shape) == tuple(it.target.shape)
        assert torch.isfinite(d).all()


# ---------------------------------------------------------------------------------------------- coefficient files
def _coef_doc():
    return {"format": "ditkit.teacache.coefficients", "version": 1, "family": "h3",
            "streams": {"video": {"coefficients": [1.0, 0.0], "x_range": None, "fit": None}},
            "calibration": None, "fingerprint": {"family": "h3"}, "provenance": {"source": "fuzz", "kind": "calibrated"}}


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_coefficients_raw_bytes(data):
    from ditkit.cache import coefficients

    _only_ditkit_errors(coefficients.load, _file(data, "c.json"))


@FUZZ
@given(st.lists(st.sampled_from(["format", "version", "family", "streams", "streams.video", "streams.video.coefficients",
                                 "streams.video.x_range", "streams.audio", "fingerprint", "fingerprint.family",
                                 "fingerprint.sigmas", "provenance", "provenance.kind", "calibration"]),
                min_size=1, max_size=3), st.lists(json_values, min_size=3, max_size=3))
def test_fuzz_coefficients_structured(paths, values):
    from ditkit.cache import coefficients

    doc = _coef_doc()
    for path, v in zip(paths, values):
        node = doc
        parts = path.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = v
    cf = _only_ditkit_errors(coefficients.load, _file(json.dumps(doc).encode(), "c.json"))
    if cf is not None:  # accepted: the rescale polynomial is usable
        for s in cf.streams.values():
            y, _ = s.rescale(0.1)
            assert isinstance(y, float)
