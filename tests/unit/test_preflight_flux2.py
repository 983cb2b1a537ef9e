"""memory/preflight.flux2_tokens and memory/model.py's FLUX.2 activation formula, against counts and bytes written
out here from ComfyUI 0.33's ``comfy/ldm/flux`` (``Flux._forward`` / ``process_img``: patch 1 on the 128-channel
latent, reference latents concatenated after the image rows; ``model_base.Flux2.extra_conds``: the caption
left-padded to 512 rows; ``layers.py``: double blocks with per-stream qkv / gated SiLU MLP and joint attention,
single blocks with a fused ``linear1`` [3D + 2F] and ``linear2`` on concat(attn, mlp)), and the bad inputs they
refuse before anything exists."""
from __future__ import annotations

import math
import tracemalloc
from dataclasses import replace

import pytest

import torch

from ditkit.bridge.preflight import flux2_rows
from ditkit.memory.model import (MAX_TOKENS, DiTDims, MemoryModelError, Options, Tokens, Weights, activation_parts,
                                 flux2_activation_parts, predict, weights_from_inventory)
from ditkit.memory.preflight import flux2_tokens, plan


def oracle(h, w, text, refs=(), patch=1, min_text=512):
    image = math.ceil(h / patch) * math.ceil(w / patch)
    ref = sum(math.ceil(r[-2] / patch) * math.ceil(r[-1] / patch) for r in refs)
    return image, ref, max(text, min_text or 0)


@pytest.mark.parametrize("h,w,text,refs", [(64, 64, 77, ()), (80, 48, 512, ()), (5, 7, 0, ()), (1, 1, 513, ()),
                                           (64, 64, 77, ((1, 128, 64, 64),)),
                                           (32, 48, 600, ((1, 128, 3, 5), (1, 128, 40, 24)))])
def test_counts_match_the_written_out_layout(h, w, text, refs):
    t = flux2_tokens((1, 128, h, w), text, refs)
    image, ref, txt = oracle(h, w, text, refs)
    assert (t.video, t.refs, t.text) == (image, ref, txt)
    assert t.total == image + ref + txt and t.audio == t.keyframes == 0 and t.image is True


def test_text_padding_boundaries_both_sides():
    # 1024x1024 -> latent [1, 128, 64, 64] -> 4096 image rows; captions shorter than 512 rows padded to 512
    assert flux2_tokens((1, 128, 64, 64), 511).as_dict() == {"image": 4096, "text": 512, "total": 4608}
    assert flux2_tokens((1, 128, 64, 64), 512).text == 512
    assert flux2_tokens((1, 128, 64, 64), 513).text == 513
    assert flux2_tokens((1, 128, 64, 64), 0).text == 512
    assert flux2_tokens((1, 128, 64, 64), 0, min_text=None).text == 0
    assert flux2_tokens((1, 128, 64, 64), 77, min_text=None).total == 4096 + 77
    # patch 2 (a FLUX.1-style model): padded to the patch both ways
    assert flux2_tokens((1, 16, 7, 9), 1, patch=2, min_text=None).video == 4 * 5
    assert flux2_tokens((1, 16, 8, 10), 1, patch=2, min_text=None).video == 4 * 5
    odd_ref = flux2_tokens((1, 16, 8, 8), 1, [(1, 16, 3, 5)], patch=2, min_text=None)   # the ref padded too
    assert (odd_ref.video, odd_ref.refs) == (16, 2 * 3)
    assert flux2_tokens((1, 16, 8, 8), 1, [(1, 16, 4, 6)], patch=2, min_text=None).refs == 2 * 3
    assert flux2_tokens((2, 128, 8, 8), 10).total == flux2_tokens((1, 128, 8, 8), 10).total   # per latent


def test_reference_rows_and_names():
    t = flux2_tokens((1, 128, 8, 8), 10, [(1, 128, 4, 4), [1, 128, 2, 3]])
    assert (t.video, t.refs, t.text) == (64, 16 + 6, 512)
    assert t.as_dict() == {"image": 64, "text": 512, "refs": 22, "total": 64 + 22 + 512}
    assert "refs 22" in t.describe() and "image 64" in t.describe()
    assert "refs" not in flux2_tokens((1, 128, 8, 8), 10).as_dict()


@pytest.mark.parametrize("shape,text,kw,match", [
    ((1, 128, 64), 10, {}, r"\[B, C, H, W\]"),
    ((1, 128, 64, 64, 1), 10, {}, r"\[B, C, H, W\]"),
    ((1, 128, 0, 64), 10, {}, "empty or negative"),
    ((1, 128, 64, -1), 10, {}, "empty or negative"),
    ((1, 128, 64, 64), -1, {}, "text"),
    ((1, 128, 64, 64), 1.5, {}, "text"),
    ((1, 128, 64, 64), True, {}, "text"),
    ((1, 128, 64, 64), 10, {"patch": 0}, "patch"),
    ((1, 128, 64, 64), 10, {"patch": True}, "patch"),
    ((1, 128, 64, 64), 10, {"min_text": -5}, "min_text"),
    ((1, 128, 64, 64), 10, {"refs": "x"}, "refs must be a list"),
    ((1, 128, 64, 64), 10, {"refs": [(1, 128, 0, 4)]}, "reference latent 0"),
    ((1, 128, 64, 64), 10, {"refs": [(1, 128, 4, 4), (5,)]}, "reference latent 1"),
    ((1, 128, 64, 64), 10, {"refs": [7]}, "reference latent 0"),
    ((1, 128, 64, 64), MAX_TOKENS + 1, {}, "absurd"),
])
def test_bad_input_named(shape, text, kw, match):
    with pytest.raises(MemoryModelError, match=match):
        flux2_tokens(shape, text, **kw)


@pytest.mark.parametrize("shape,refs", [((1, 128, 10**5, 10**5), ()), ((1, 128, 10**12, 10**12), ()),
                                        ((1, 128, 8, 8), ((1, 128, 10**12, 10**12),))])
def test_absurd_latent_refused_without_allocating(shape, refs):
    tracemalloc.start()
    try:
        with pytest.raises(MemoryModelError, match="absurd"):
            flux2_tokens(shape, 77, refs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_token_boundary_at_max_tokens():
    side = math.isqrt(MAX_TOKENS - 512)
    ok = flux2_tokens((1, 128, side, side), 1)
    assert ok.total == side * side + 512 <= MAX_TOKENS
    edge = flux2_tokens((1, 128, 1, MAX_TOKENS - 512), 1)
    assert edge.total == MAX_TOKENS                       # exactly the maximum: accepted
    with pytest.raises(MemoryModelError, match="absurd"):
        flux2_tokens((1, 128, 1, MAX_TOKENS - 511), 1)


# ---------------------------------------------------------------------------------------- activation formula

# FLUX.2 dev: hidden 6144 = 48 heads of 128, MLP 3 x 6144, 8 double + 48 single blocks; rope table 8 x 128 bytes
FD = DiTDims("flux2", 6144, 48, 128, 18432, 8, extra_cols=8 * 128 // 2, single_layers=48,
             latent_row_bytes=12 * 128 * 4)


def by_hand(tok: Tokens, compute="bfloat16", attention="flash", chunk=None, batch=1, free=1 << 50, group=None):
    """The live bytes of each phase, written out from comfy/ldm/flux/layers.py (see the module docstring)."""
    b = {"bfloat16": 2, "float16": 2, "float32": 4}[compute]
    D, F, H = 6144, 18432, 48
    S, St = tok.total * batch, tok.text * batch
    Si = S - St
    sb = 4 if b == 4 else b
    g = H if group is None or group >= H else group        # heads per attention call
    if attention == "flash":
        scores = 0
    elif attention == "math":
        scores = 2 * g * batch * tok.total ** 2 * sb
    else:
        q = next((x for x in (4096, 2048, 1024, 512, 256) if free / (g * batch * sb * x * 4) >= tok.total), 512)
        scores = 2 * g * batch * min(q, tok.total) * tok.total * sb
    scores += S * D * g // H * b if g < H else 0           # one group's output beside the full output
    outside = S * 1024 + tok.video * batch * 12 * 128 * 4            # fp32 rope 1 KiB a row; 12 latent copies
    # double: residual img + txt [S, D]
    qkv_both, normed, cat_one = 3 * S * D, 2 * S * D, S * D
    prep = qkv_both + normed + cat_one                                # 6 S D, below the attention's
    attn = (3 + 2 + 2) * S * D                                        # q k v, roped q k, out + merged copy
    rows = max(Si, St)
    # chunked (multiples of 32 here): input and output whole, one chunk's fc1 / silu / product / fc2 out
    ff = S * D + (rows * (D + 2 * F + F + F) if chunk is None or chunk >= rows // batch
                  else 2 * rows * D + chunk * batch * (2 * F + F + F + D))
    double = S * D * b + outside + max(prep * b, attn * b + scores, ff * b)
    # single: joint x [S, D] + the txt [St, D] the forward keeps; linear1 out [S, 3D + 2F]
    lin1 = S * (3 * D + 2 * F)
    s_attn = lin1 + 2 * S * D + 2 * S * D + 2 * S * D                 # + normed q k, roped q k, out + merged
    s_mlp = lin1 + S * D + S * F + S * F                              # + attn out, silu(gate), product
    single = (S + St) * D * b + outside + max(s_attn * b + scores, s_mlp * b)
    return double, single


@pytest.mark.parametrize("tok", [Tokens(video=4096, text=512, image=True), Tokens(video=64, text=2000, image=True),
                                 Tokens(video=16384, text=512, refs=4096, image=True)])
@pytest.mark.parametrize("compute", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("attention", ["flash", "sub_quad", "math"])
def test_activation_formula_written_out(tok, compute, attention):
    # the bridge sets the rope table's columns from the compute dtype: 1 KiB of fp32 a row whatever it is
    d = replace(FD, extra_cols=1024 // {"float32": 4}.get(compute, 2))
    a = activation_parts(d, tok, Options(compute=compute, attention=attention, free_bytes=1 << 36))
    assert flux2_activation_parts(d, tok, Options(compute=compute, attention=attention, free_bytes=1 << 36)) == a
    double, single = by_hand(tok, compute, attention, free=1 << 36)
    assert (a["double_block_peak"], a["single_block_peak"]) == (double, single)
    assert a["block_peak"] == max(double, single)


def test_single_blocks_dominate_and_chunking_lowers_only_the_double_mlp():
    tok = Tokens(video=4096, text=512, image=True)
    plain = activation_parts(FD, tok, Options())
    assert plain["single_block_peak"] > plain["double_block_peak"]      # 16 S D (+ persistent) vs <= 14 S D
    for c in (256, 1024, 2048):
        ch = activation_parts(FD, tok, Options(chunk=c))
        assert ch["double_block_peak"] == by_hand(tok, chunk=c)[0] < plain["double_block_peak"]
        assert ch["single_block_peak"] == plain["single_block_peak"] and ch["block_peak"] == plain["block_peak"]
    same = activation_parts(FD, tok, Options(chunk=4096))                # chunk >= the stream's rows: unchunked
    assert same["double_block_peak"] == plain["double_block_peak"]
    assert activation_parts(FD, tok, Options(batch=2))["block_peak"] == by_hand(tok, batch=2)[1]


def test_double_only_and_single_only_models():
    tok = Tokens(video=1024, text=512, image=True)
    d_only = DiTDims("flux2", 6144, 48, 128, 18432, 8, extra_cols=512, single_layers=0, latent_row_bytes=6144)
    s_only = DiTDims("flux2", 6144, 48, 128, 18432, 0, extra_cols=512, single_layers=48, latent_row_bytes=6144)
    double, single = by_hand(tok)
    assert activation_parts(d_only, tok, Options())["block_peak"] == double
    assert activation_parts(s_only, tok, Options())["block_peak"] == single


@pytest.mark.parametrize("attention", ["flash", "sub_quad", "math"])
@pytest.mark.parametrize("group", [1, 6, 24, 47, 48, 96])
def test_head_groups_written_out(attention, group):
    tok = Tokens(video=4096, text=512, image=True)
    free = 1 << 34          # sub_quad: a group of fewer heads gets a larger query chunk from the same free memory
    a = activation_parts(FD, tok, Options(attention=attention, head_group=group, free_bytes=free))
    assert (a["double_block_peak"], a["single_block_peak"]) == by_hand(tok, attention=attention, free=free,
                                                                       group=group)
    whole = activation_parts(FD, tok, Options(attention=attention, free_bytes=free))
    if group >= 48:
        assert a == whole
    elif attention != "flash":
        assert a["block_peak"] < whole["block_peak"]
    else:                   # no scores to save: only the group's output copy is added (below the single MLP's peak)
        assert a["attention"] == whole["attention"] + 4608 * 6144 * group // 48 * 2
        assert a["block_peak"] == whole["block_peak"]


def test_bad_options_named():
    tok = Tokens(video=4096, text=512, image=True)
    with pytest.raises(MemoryModelError, match="head_group"):
        activation_parts(FD, tok, Options(head_group=0))
    with pytest.raises(MemoryModelError, match="chunk"):
        activation_parts(FD, tok, Options(chunk=0))
    with pytest.raises(MemoryModelError, match="attention backend"):
        activation_parts(FD, tok, Options(attention="magic"))
    with pytest.raises(MemoryModelError, match="compute dtype"):
        activation_parts(FD, tok, Options(compute="float8"))
    with pytest.raises(MemoryModelError, match="empty"):
        activation_parts(FD, Tokens(video=0, image=True), Options())
    bad = DiTDims("flux2", 6144, 47, 128, 18432, 8, single_layers=48)
    with pytest.raises(MemoryModelError, match="heads x head_dim"):
        activation_parts(bad, tok, Options())


def test_predict_and_plan_with_double_and_single_block_weights():
    inv = {}
    for i in range(2):
        inv[f"double_blocks.{i}.img_attn.qkv.weight"] = ((3 * 64, 64), "BF16")
        inv[f"double_blocks.{i}.img_mlp.0.weight"] = ((2 * 192, 64), "BF16")
    for i in range(3):
        inv[f"single_blocks.{i}.linear1.weight"] = ((3 * 64 + 2 * 192, 64), "BF16")
        inv[f"single_blocks.{i}.norm.key_norm.scale"] = ((128,), "F32")
    inv["img_in.weight"] = ((64, 128), "BF16")
    w = weights_from_inventory("flux2", inv, "bf16", ("double_blocks.", "single_blocks."))
    dbl = (3 * 64 * 64 + 2 * 192 * 64) * 2
    sgl = (3 * 64 + 2 * 192) * 64 * 2 + 128 * 4
    assert w == Weights((dbl, dbl, sgl, sgl, sgl), 64 * 128 * 2, (3 * 64 + 2 * 192) * 64)
    fp8 = weights_from_inventory("flux2", inv, "float8_e4m3fn", ("double_blocks.", "single_blocks."))
    assert len(fp8.blocks) == 5 and fp8.total < w.total and fp8.other == w.other
    tok = Tokens(video=4096, text=512, image=True)
    p = predict(FD, w, tok, Options())
    assert p.device == w.total + max(by_hand(tok))
    stream = predict(FD, w, tok, Options(streaming=True, window=2))
    assert stream.parts["weights_device"] == w.other + 2 * sgl
    # the plan: chunking is never offered when it does not fit (the single blocks' MLP is not chunkable)
    pl = plan(FD, {"bf16": w, "float8_e4m3fn": fp8}, tok, Options(), p.device - 1, "x", True)
    assert not pl.fits and pl.suggestions
    assert all("chunk_tokens" not in s.settings for s in pl.suggestions)
    assert all(s.peak <= p.device - 1 for s in pl.suggestions)


# ---------------------------------------------------------------------------------------- the conditioning


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_flux2_rows_items_dicts_and_references(dtype):
    ca = torch.zeros(1, 77, 16, dtype=dtype)
    ref = torch.zeros(1, 128, 6, 5, dtype=dtype).transpose(2, 3).transpose(2, 3)     # non-contiguous is fine
    assert flux2_rows([[ca, {}]], 9) == (77, ())
    assert flux2_rows([[ca, {"reference_latents": [ref, ref[:, :, :2]]}]], 9) == (77, ((1, 128, 6, 5), (1, 128, 2, 5)))
    assert flux2_rows([{"cross_attn": ca, "reference_latents": [ref]}], 9) == (77, ((1, 128, 6, 5),))
    assert flux2_rows([{"cross_attn": ca, "ref_latents": [ref]}], 9) == (77, ((1, 128, 6, 5),))
    assert flux2_rows([[None, {}]], 9) == (9, ())                  # no cross_attn: the node's text_tokens
    assert flux2_rows([], 9) == flux2_rows(None, 9) == (9, ())


def test_flux2_rows_longest_item_counts_the_padded_caption():
    # ComfyUI pads a caption to 512 rows: 10 caption rows + a 20 x 20 reference (512 + 400 rows) beat 450 caption
    # rows (512); raw lengths (410 vs 450) would pick the wrong item
    a = [torch.zeros(1, 10, 4), {"reference_latents": [torch.zeros(1, 128, 20, 20)]}]
    b = [torch.zeros(1, 450, 4), {}]
    assert flux2_rows([b, a], 0) == (10, ((1, 128, 20, 20),))
    c = [torch.zeros(1, 913, 4), {}]                               # 913 > 912: the long caption wins
    assert flux2_rows([a, c], 0) == (913, ())
    d = [torch.zeros(1, 912, 4), {}]                               # a tie keeps the first
    assert flux2_rows([a, d], 0) == (10, ((1, 128, 20, 20),))


@pytest.mark.parametrize("refs,match", [("x", "reference latents"), ([torch.zeros(4)], "reference latents"),
                                        ([torch.zeros(1, 128, 4, 4), "y"], "reference latents")])
def test_flux2_rows_bad_references_named(refs, match):
    with pytest.raises(MemoryModelError, match=f"the sampler's conditioning: FLUX.2 {match}"):
        flux2_rows([[torch.zeros(1, 7, 4), {"reference_latents": refs}]], 0, "the sampler's conditioning")
    with pytest.raises(MemoryModelError, match="input 'positive'"):
        flux2_rows([[torch.zeros(1, 7, 4), {"reference_latents": refs}]], 0)
    with pytest.raises(MemoryModelError, match="not a CONDITIONING"):
        flux2_rows([42], 0)
