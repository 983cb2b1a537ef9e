"""memory/model.py and memory/preflight.py: exact boundaries of every comparison, named errors on bad input before
anything is allocated, and the suggestion search (fewest changes first, each suggestion really fits)."""
from __future__ import annotations

import math
import tracemalloc

import pytest

from ditkit.errors import DitKitError
from ditkit.memory.model import (GIB, MAX_TOKENS, DiTDims, MemoryModelError, Options, Tokens, Weights,
                                 activation_parts, predict, sub_quad_chunk, weights_from_inventory)
from ditkit.memory.preflight import (MemoryShortfallError, check_available, check_limit, h3_keyframe_rows,
                                    h3_ref_rows, h3_tokens, ltx2_tokens, plan)

D = DiTDims("h3", 5376, 56, 128, 14336, 50)
W = Weights(tuple([1_000_000_000] * 50), 2_000_000_000, 28672 * 5376)


def test_tokens_h3_layout():
    t = h3_tokens((1, 24, 32, 48, 84), (1, 32, 2, 207), text=300)
    assert (t.video, t.audio, t.text, t.total) == (32 * 24 * 42, 414, 300, 32 * 24 * 42 + 414 + 300)
    odd = h3_tokens((1, 24, 3, 5, 7), (1, 32, 2, 1))      # padded to the 2x2 patch
    assert odd.video == 3 * 3 * 4


def test_ref_and_keyframe_rows_by_hand():
    # ComfyUI's PackedLayout (written out): a reference frame has one row per whole 2x2 patch (h // 2 * w // 2, the
    # odd row / column dropped), stereo audio two rows per latent frame; a keyframe sits on the target's grid
    assert h3_ref_rows("image", latent_h=48, latent_w=84) == 24 * 42
    assert h3_ref_rows("image", latent_h=7, latent_w=9) == 3 * 4
    assert h3_ref_rows("image", latent_h=2, latent_w=2) == 1
    assert h3_ref_rows("audio", ref_audio_t=207) == 414
    assert h3_ref_rows("audio", ref_audio_t=0) == 0
    assert h3_ref_rows("video", latent_t=7, latent_h=6, latent_w=10, ref_audio_t=0) == 7 * 15
    assert h3_ref_rows("video_audio", latent_t=2, latent_h=5, latent_w=5, ref_audio_t=5) == 2 * 4 + 10
    assert h3_keyframe_rows(1, 0, 1008) == 1008
    assert h3_keyframe_rows(2, 3, 64) == 128 + 6
    assert h3_keyframe_rows(0, 0, 64) == 0
    t = h3_tokens((1, 24, 7, 16, 16), (1, 32, 2, 37), text=10, refs=24, keyframes=70)
    assert (t.refs, t.keyframes, t.total) == (24, 70, 7 * 64 + 74 + 10 + 24 + 70)


@pytest.mark.parametrize("args", [("image", 0, 1, 8, 0), ("image", 0, 8, 1, 0), ("sound", 0, 8, 8, 0),
                                  ("video", -1, 8, 8, 0), ("video", 1.0, 8, 8, 0), ("audio", 0, 0, 0, True),
                                  ("audio", 0, 0, 0, MAX_TOKENS + 1), ("video", MAX_TOKENS, 4, 4, 0)])
def test_bad_ref_rows(args):
    with pytest.raises(MemoryModelError):
        h3_ref_rows(*args)


def test_ref_rows_at_the_absurd_boundary():
    assert h3_ref_rows("audio", ref_audio_t=MAX_TOKENS // 2) == MAX_TOKENS
    with pytest.raises(MemoryModelError, match="absurd"):
        h3_ref_rows("audio", ref_audio_t=MAX_TOKENS // 2 + 1)


@pytest.mark.parametrize("args", [(-1, 0, 64), (1, -1, 64), (1, 0, -64), (1.5, 0, 64), (1, None, 64),
                                  (MAX_TOKENS, 0, 2)])
def test_bad_keyframe_rows(args):
    with pytest.raises(MemoryModelError):
        h3_keyframe_rows(*args)


@pytest.mark.parametrize("video", [(1, 24, 10**6, 48, 84), (1, 24, 10**12, 10**6, 10**6)])
def test_absurd_latent_is_refused_without_allocating(video):
    tracemalloc.start()
    try:
        with pytest.raises(MemoryModelError, match="absurd"):
            h3_tokens(video, (1, 32, 2, 10))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_token_boundaries():
    check = Tokens(video=MAX_TOKENS)
    activation_parts(D, check, Options())            # exactly the maximum: accepted
    with pytest.raises(MemoryModelError, match="absurd"):
        activation_parts(D, Tokens(video=MAX_TOKENS + 1), Options())
    with pytest.raises(MemoryModelError, match="empty"):
        activation_parts(D, Tokens(video=0), Options())
    for bad in (-1, 1.5, True):
        with pytest.raises(MemoryModelError):
            activation_parts(D, Tokens(video=10, audio=bad), Options())
    with pytest.raises(MemoryModelError):
        h3_tokens((1, 24, 0, 4, 4), (1, 32, 2, 1))
    with pytest.raises(MemoryModelError):
        h3_tokens((1, 24, 4, 4), (1, 32, 2, 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -0.5, True, "4", None])
def test_bad_limits(bad):
    with pytest.raises(MemoryModelError, match="limit_gib"):
        check_limit(bad)


def test_limit_boundaries():
    assert check_limit(0) == 0.0 and check_limit(0.0) == 0.0 and check_limit(24) == 24.0


@pytest.mark.parametrize("bad", [0, -1, None, 0.5, True])
def test_device_without_memory(bad):
    with pytest.raises(MemoryModelError, match="no usable memory"):
        check_available(bad, "cuda:0")
    assert check_available(1, "x") == 1


@pytest.mark.parametrize("bad", [0, -16, True, 2.5])
def test_bad_chunk_option(bad):
    with pytest.raises(MemoryModelError, match="chunk"):
        activation_parts(D, Tokens(video=1000), Options(chunk=bad))


def test_unknown_options():
    with pytest.raises(MemoryModelError):
        activation_parts(D, Tokens(video=10), Options(attention="magic"))
    with pytest.raises(MemoryModelError):
        activation_parts(D, Tokens(video=10), Options(compute="float8"))


def test_activation_terms_by_hand():
    s, b = 1000, 2
    p = activation_parts(D, Tokens(video=s), Options(compute="bfloat16"))
    assert p["persistent"] == s * (2 * 5376 + 192) * b
    assert p["attention"] == s * (2 * 5376 + 6 * 7168) * b
    assert p["feed_forward"] == s * (2 * 5376 + 3 * 14336) * b
    assert p["block_peak"] == p["persistent"] + max(p["attention"], p["feed_forward"])
    # chunk >= tokens: unchunked; one below: chunked (rounded down to 16: 992, tail 8 folded -> 1000)
    assert activation_parts(D, Tokens(video=s), Options(chunk=1000))["feed_forward"] == p["feed_forward"]
    c = activation_parts(D, Tokens(video=s), Options(chunk=256))["feed_forward"]
    assert c == (s * 2 * 5376 + 256 * (3 * 14336 + 5376)) * b
    # fp32 doubles everything
    assert activation_parts(D, Tokens(video=s), Options(compute="float32"))["feed_forward"] == 2 * p["feed_forward"]


def test_sub_quad_chunk_rule_boundaries():
    # ComfyUI: free / (bh * bytes * x * 4) >= k_tokens
    bh, sb, k = 3, 4, 1000
    edge = bh * sb * 4096 * 4.0 * k
    assert sub_quad_chunk(bh, sb, k, int(edge)) == 4096
    assert sub_quad_chunk(bh, sb, k, int(edge) - 1) == 2048
    assert sub_quad_chunk(bh, sb, k, 0) == 512
    a = activation_parts(D, Tokens(video=k), Options(attention="sub_quad", free_bytes=int(edge) * 1000))
    assert a["attention"] == k * (5376 + 8 * 7168) * 2 + 2 * 56 * 1000 * k * 2     # chunk 4096 >= k: k rows


def test_math_backend_scores():
    a = activation_parts(D, Tokens(video=100), Options(attention="math"))
    assert a["attention"] == 100 * (2 * 5376 + 6 * 7168) * 2 + 2 * 56 * 100 * 100 * 2


def test_weights_and_streaming():
    p = predict(D, W, Tokens(video=1000), Options())
    assert p.parts["weights_device"] == W.total and p.parts["cast_workspace"] == 0
    s = predict(D, W, Tokens(video=1000), Options(streaming=True))
    assert s.parts["weights_device"] == W.other + 2 * 1_000_000_000 and s.host == W.total
    q = predict(D, W, Tokens(video=1000), Options(weight_format="float8_e4m3fn"))
    assert q.parts["cast_workspace"] == 28672 * 5376 * 2


def test_weights_from_inventory_formats():
    inv = {"blocks.0.mlp.fc1.weight": ((256, 128), "BF16"), "blocks.0.norm1.weight": ((128,), "BF16"),
           "video_patch_proj.weight": ((128, 96), "F32")}
    w = weights_from_inventory("h3", inv, "bf16", "blocks.")
    assert w.blocks == (256 * 128 * 2 + 128 * 2,) and w.other == 128 * 96 * 4 and w.largest_linear == 256 * 128
    q = weights_from_inventory("h3", inv, "float8_e4m3fn", "blocks.")
    assert q.blocks[0] < w.blocks[0]
    with pytest.raises(MemoryModelError):
        weights_from_inventory("h3", inv, "fp3", "blocks.")


# a shape whose feed-forward phase is the larger one (H3's real ratios make both phases equal: 2D + 6I == 2D + 3F)
D2 = DiTDims("h3", 1024, 8, 128, 2816, 50)
W2 = Weights(tuple([40_000_000] * 50), 100_000_000, 5632 * 1024)


def _weights():
    return {"bf16": W2, "float8_e4m3fn": Weights(tuple([20_000_000] * 50), 100_000_000, W2.largest_linear)}


def test_real_h3_phases_are_equal():
    a = activation_parts(D, Tokens(video=1000), Options())
    assert a["attention"] == a["feed_forward"]      # so chunking the feed-forward alone cannot lower H3's peak


def test_plan_fit_boundary_and_suggestions():
    tok = Tokens(video=40_000, audio=400, text=300)
    opts = Options(compute="bfloat16")
    pred = predict(D2, W2, tok, opts).device
    assert plan(D2, _weights(), tok, opts, pred, "x", False).fits                 # exactly equal: fits
    p = plan(D2, _weights(), tok, opts, pred - 1, "x", False)
    assert not p.fits and p.shortfall == 1
    assert p.suggestions and all(len(s.settings) == 1 for s in p.suggestions)   # one change is enough
    assert list(p.suggestions[0].settings) == ["chunk_tokens"]                   # the cheapest kind first
    for s in p.suggestions:
        assert s.prediction.device <= pred - 1
    assert "SHORT by 0.00 GiB" in p.summary() and "chunk_tokens" in p.summary()
    assert isinstance(MemoryShortfallError("x"), DitKitError)


def test_plan_needs_two_changes_then_length():
    tok = Tokens(video=40_000, audio=400, text=300)
    opts = Options(compute="bfloat16")
    w = _weights()
    chunked = predict(D2, w["bf16"], tok, Options(chunk=256)).device
    fp8 = predict(D2, w["float8_e4m3fn"], tok, Options(weight_format="float8_e4m3fn")).device
    both = predict(D2, w["float8_e4m3fn"], tok, Options(chunk=4096, weight_format="float8_e4m3fn")).device
    p = plan(D2, w, tok, opts, both, "x", False)
    assert min(chunked, fp8) > both and p.suggestions and len(p.suggestions[0].settings) == 2
    assert p.suggestions[0].prediction.device <= both
    # nothing settable fits 1.5 GiB: the length/area that does, with every saving on
    small = plan(D2, w, tok, opts, 3 * GIB // 2, "x", False, video_scale=lambda f: f"x{f:.2f}")
    assert not small.fits and "video_tokens" in small.suggestions[0].settings
    assert small.suggestions[0].prediction.device <= 3 * GIB // 2
    assert small.suggestions[0].settings["resolution_or_length"].startswith("x0.")
    none = plan(D2, w, tok, opts, 1, "x", False)
    assert not none.suggestions and "nothing ditkit can set fits" in none.summary()
    assert math.isfinite(none.prediction.gib())


def test_fits_table_real_h3_weights_match_the_official_size():
    from ditkit.memory import fits

    dims, weights = fits._h3_model()
    # metadata.total_size of the official FL2VA transformer index (h3.md): 66,280,430,144 bytes; ComfyUI's keys
    # drop the rope buffer and keep the same tensors
    assert abs(weights["bf16"].total - 66_280_430_144) / 66_280_430_144 < 0.01
    assert weights["nvfp4"].total < weights["float8_e4m3fn"].total < weights["bf16"].total
    rows = fits.fits_rows()
    assert len(rows) == 8 * len(fits.CARDS_GB)
    for r in rows:
        for kind in ("resident", "streamed"):
            setting, gib = r[kind]
            assert gib is None or gib <= r["card_gb"] * 1e9 * 0.95 / GIB
    h3_5s = [r for r in rows if r["job"] == "H3 T2VA 5 s 1344x768"]
    assert h3_5s[-1]["resident"][0] == "bf16 as is"          # 141 GB holds it
    assert "| H3 T2VA 10 s 1920x1088 |" in fits.fits_table()


def test_head_groups_shrink_score_workspace():
    k = 4000
    full = activation_parts(D, Tokens(video=k), Options(attention="math"))["attention"]
    one = activation_parts(D, Tokens(video=k), Options(attention="math", head_group=1))["attention"]
    assert full - one == 2 * 55 * k * k * 2
    same = activation_parts(D, Tokens(video=k), Options(attention="math", head_group=56))["attention"]
    assert same == full
    sq = activation_parts(D, Tokens(video=k), Options(attention="sub_quad", free_bytes=1 << 40))["attention"]
    sq1 = activation_parts(D, Tokens(video=k), Options(attention="sub_quad", free_bytes=1 << 40, head_group=8))
    assert sq1["attention"] < sq
    with pytest.raises(MemoryModelError, match="head_group"):
        activation_parts(D, Tokens(video=k), Options(head_group=0))


def test_ltx2_tokens_by_hand():
    # LTX-2 (ComfyUI's SymmetricPatchifier patch 1, AudioPatchifier(1)): one row per latent voxel, one per audio
    # latent frame; text is cross-attention context
    t = ltx2_tokens((1, 128, 13, 16, 16))
    assert (t.video, t.audio, t.text, t.total) == (13 * 16 * 16, 0, 0, 3328)
    t = ltx2_tokens((2, 128, 4, 6, 5), (2, 8, 21, 16))
    assert (t.video, t.audio, t.total) == (120, 21, 141)
    assert ltx2_tokens((1, 128, 1, 1, 1)).total == 1
    assert ltx2_tokens((1, 128, 1, 1, 1), (1, 8, 0, 16)).audio == 0          # an empty audio stream
    assert ltx2_tokens((1, 128, MAX_TOKENS, 1, 1)).total == MAX_TOKENS
    with pytest.raises(MemoryModelError, match="absurd"):
        ltx2_tokens((1, 128, MAX_TOKENS + 1, 1, 1))


@pytest.mark.parametrize("video,audio", [((1, 128, 4, 4), None), ((1, 128, 0, 4, 4), None), ((1, 128, 2, -4, 4), None),
                                         ((1, 128, 2, 4, 4), (1, 8, 16)), ((1, 128, 2, 4, 4), (1, 8, -1, 16)),
                                         ((1, 128, 10**6, 10**4, 10**4), None)])
def test_ltx2_bad_latents(video, audio):
    tracemalloc.start()
    try:
        with pytest.raises(MemoryModelError):
            ltx2_tokens(video, audio)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_ltx2_persistent_columns_and_gelu_feed_forward():
    d = DiTDims("ltx2", 4096, 32, 128, 16384, 48, ffn_kind="gelu", extra_cols=2048)
    a = activation_parts(d, Tokens(video=1000), Options(compute="bfloat16"))
    assert a["persistent"] == 1000 * (2 * 4096 + 2048) * 2
    assert a["feed_forward"] == 1000 * (2 * 4096 + 2 * 16384) * 2
    assert a["attention"] == 1000 * (2 * 4096 + 6 * 4096) * 2


def test_head_groups_are_suggested_only_for_backends_that_hold_scores():
    tok = Tokens(video=20_000)
    w = {"bf16": W2}
    sq = Options(compute="bfloat16", attention="sub_quad", free_bytes=64 * GIB)
    full = predict(D2, W2, tok, sq).device
    g1 = predict(D2, W2, tok, Options(compute="bfloat16", attention="sub_quad", free_bytes=64 * GIB, head_group=1))
    assert g1.device < full
    p = plan(D2, w, tok, sq, full - 1, "x", False)
    groups = [s.settings.get("attention_heads_per_call") for s in p.suggestions]
    assert any(groups) and all(g in (None, 4, 2, 1) for g in groups), p.summary()
    assert all(s.prediction.device <= full - 1 for s in p.suggestions)
    fl = Options(compute="bfloat16", attention="flash")
    pf = plan(D2, w, tok, fl, predict(D2, W2, tok, fl).device - 1, "x", False)
    assert pf.suggestions and not any("attention_heads_per_call" in s.settings for s in pf.suggestions)
    already = Options(compute="bfloat16", attention="math", head_group=2)
    pm = plan(D2, w, tok, already, predict(D2, W2, tok, already).device - 1, "x", False)
    assert all(s.settings.get("attention_heads_per_call", 1) < 2 for s in pm.suggestions)
    assert "attention 2 heads per call" in already.describe() and "heads per call" not in fl.describe()
    off = plan(D2, w, tok, sq, full - 1, "x", False, head_groups=False)       # a model they do not apply to
    assert not any("attention_heads_per_call" in s.settings for s in off.suggestions)


def test_image_rows_are_named_image_in_every_text():
    """Z-Image / FLUX.2 rows are an image's, never "video": the summary, as_dict and the no-fit suggestion."""
    img = Tokens(video=40_000, text=300, image=True)
    vid = Tokens(video=40_000, text=300)
    assert img.latent_name == "image" and vid.latent_name == "video"
    assert img.total == vid.total == 40_300
    assert img.describe() == "40,300 tokens (image 40,000, text 300)"
    assert vid.describe() == "40,300 tokens (video 40,000, audio 0, text 300, refs 0, keyframes 0)"
    assert img.as_dict() == {"image": 40_000, "text": 300, "total": 40_300}
    assert vid.as_dict() == {"video": 40_000, "audio": 0, "text": 300, "refs": 0, "keyframes": 0, "total": 40_300}
    w = _weights()
    for tok, key, other in ((img, "image_tokens", "video_tokens"), (vid, "video_tokens", "image_tokens")):
        p = plan(D2, w, tok, Options(compute="bfloat16"), 3 * GIB // 2, "x", False, video_scale=lambda f: f"x{f:.2f}")
        s = p.suggestions[0].settings
        assert not p.fits and key in s and other not in s, s
        assert ("of the area)" in s[key]) is tok.image and ("length x area" in s[key]) is not tok.image
        text = p.summary()
        assert text.startswith(tok.describe() + "; predicted peak"), text
        assert ("video" in text.split(";")[0]) is not tok.image
        assert p.as_dict()["tokens"] == tok.as_dict()
