"""memory/preflight.zimage_tokens: Z-Image's joint sequence, against counts written out here from ComfyUI 0.33's
``NextDiT.patchify_and_embed`` (image rows of the 2x2-patched latent and the caption rows, each padded up to
``pad_tokens_multiple`` = 32 with pad tokens), and the bad inputs it refuses before anything exists."""
from __future__ import annotations

import math
import re
import tracemalloc

import pytest

from ditkit.memory.model import MAX_TOKENS, MemoryModelError
from ditkit.memory.preflight import zimage_tokens


def oracle(h, w, text, patch=2, multiple=32):
    rows = math.ceil(h / patch) * math.ceil(w / patch)
    cap = text if text else multiple
    up = lambda n: n if multiple is None else math.ceil(n / multiple) * multiple   # noqa: E731
    return up(rows), (up(cap) if multiple is not None else text)


@pytest.mark.parametrize("h,w,text", [(128, 128, 77), (128, 96, 512), (5, 7, 0), (2, 2, 1), (136, 240, 33),
                                      (64, 64, 32), (64, 64, 31)])
def test_counts_match_the_written_out_layout(h, w, text):
    t = zimage_tokens((1, 16, h, w), text)
    assert (t.video, t.text) == oracle(h, w, text)
    assert t.total == sum(oracle(h, w, text)) and t.audio == t.refs == t.keyframes == 0


def test_padding_boundaries_both_sides():
    # 1024x1024 -> latent 128x128 -> 64 * 64 = 4096 image rows (a multiple of 32: no pad rows)
    assert zimage_tokens((1, 16, 128, 128), 32).as_dict()["total"] == 4096 + 32
    assert zimage_tokens((1, 16, 128, 128), 33).text == 64
    assert zimage_tokens((1, 16, 128, 128), 64).text == 64
    assert zimage_tokens((1, 16, 128, 130), 1).video == 64 * 65 + (-(64 * 65)) % 32   # 4160 = 130 * 32
    assert zimage_tokens((1, 16, 127, 127), 1).video == 4096       # padded to the patch, then 4096 rows
    assert zimage_tokens((1, 16, 3, 3), 5, pad_multiple=None).as_dict() == {
        "image": 4, "text": 5, "total": 9}
    assert zimage_tokens((1, 16, 8, 8), 0, patch=1, pad_multiple=None).total == 64
    assert zimage_tokens((2, 16, 8, 8), 10).total == zimage_tokens((1, 16, 8, 8), 10).total   # per latent


@pytest.mark.parametrize("shape,text,kw,match", [
    ((1, 16, 64), 10, {}, r"\[B, C, H, W\]"),
    ((1, 16, 64, 64, 1), 10, {}, r"\[B, C, H, W\]"),
    ((1, 16, 0, 64), 10, {}, "empty or negative"),
    ((1, 16, -2, 64), 10, {}, "empty or negative"),
    ((1, 16, 64, 64), -1, {}, "text"),
    ((1, 16, 64, 64), 1.5, {}, "text"),
    ((1, 16, 64, 64), True, {}, "text"),
    ((1, 16, 64, 64), 10, {"patch": 0}, "patch"),
    ((1, 16, 64, 64), 10, {"pad_multiple": 0}, "pad_multiple"),
    ((1, 16, 64, 64), MAX_TOKENS + 1, {}, "absurd"),
])
def test_bad_input_named(shape, text, kw, match):
    with pytest.raises(MemoryModelError, match=match):
        zimage_tokens(shape, text, **kw)


@pytest.mark.parametrize("shape", [(1, 16, 10**5, 10**5), (1, 16, 10**12, 10**12), (10**6, 16, 10**6, 10**6)])
def test_absurd_latent_refused_without_allocating(shape):
    tracemalloc.start()
    try:
        with pytest.raises(MemoryModelError, match="absurd"):
            zimage_tokens(shape, 77)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_token_boundary_at_max_tokens():
    side = 2 * math.isqrt(MAX_TOKENS)          # patched rows just under the limit, multiple of 32 below
    ok = zimage_tokens((1, 16, side, side), 1, pad_multiple=None)
    assert ok.total == (side // 2) ** 2 + 1 <= MAX_TOKENS
    with pytest.raises(MemoryModelError, match="absurd"):
        zimage_tokens((1, 16, side + 4, side + 4), 1, pad_multiple=None)


def test_zimage_text_rows_longest_caption_and_refusals():
    import torch

    from ditkit.bridge.preflight import latent_shapes_of, zimage_text_rows

    items = [[torch.zeros(1, 77, 8), {}], {"cross_attn": torch.zeros(2, 300, 8)[:, ::2]}, [None, {}]]
    assert zimage_text_rows(items, 5) == 150              # the longest; non-contiguous view counted by shape
    assert zimage_text_rows([[None, {}]], 5) == 5          # no cross_attn: the default
    assert zimage_text_rows([], 7) == 7 and zimage_text_rows(None, 7) == 7
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert zimage_text_rows([[torch.zeros(1, 33, 4, dtype=dt), {}]], 0) == 33
    # omni references are counted now (zimage_conds), the text rows stay the caption's
    assert zimage_text_rows([{"cross_attn": torch.zeros(1, 4, 8), "reference_latents": [torch.zeros(1, 16, 8, 8)]}],
                            5, "the sampler's conditioning") == 4
    with pytest.raises(MemoryModelError, match="input 'positive'.*not a CONDITIONING"):
        zimage_text_rows([torch.zeros(1, 4, 8)], 5)
    assert latent_shapes_of(torch.zeros(2, 16, 8, 6), "zimage") == ((2, 16, 8, 6), None)
    for bad in (torch.zeros(1, 16, 2, 8, 8), torch.zeros(16, 8)):
        with pytest.raises(MemoryModelError, match="not a Z-Image latent"):
            latent_shapes_of(bad, "zimage")


def omni_oracle(h, w, text, refs, ref_texts, siglip, siglip_model, p=2, m=32):
    """Rows of ComfyUI 0.33 NextDiT.patchify_and_embed with ref_latents, written out: per reference embed_all
    (caption: its text padded, or m pad rows; SigLIP when the model has it: its rows padded, or m pad rows; image
    (H/p)(W/p) padded), then the target (caption padded; SigLIP m pad rows; image ceil(H/p) ceil(W/p) padded), then
    the leftover captions padded."""
    up = lambda n: math.ceil(n / m) * m          # noqa: E731
    cap = img = sig = 0
    for i, (rh, rw) in enumerate(refs):
        cap += up(ref_texts[i]) if i < len(ref_texts) else m
        if siglip_model:
            sig += up(siglip[i]) if i < len(siglip) else m
        img += up((rh // p) * (rw // p))
    cap += up(text if text else m)
    sig += m if siglip_model else 0
    target = up(math.ceil(h / p) * math.ceil(w / p))
    cap += sum(up(t) for t in ref_texts[len(refs):])
    return target, cap, img + sig


@pytest.mark.parametrize("siglip_model", [False, True])
@pytest.mark.parametrize("refs,ref_texts,siglip", [
    ([(64, 64)], [], []),
    ([(64, 64)], [77], [729]),
    ([(64, 64), (32, 48)], [77], [729]),             # the second reference has neither caption nor SigLIP
    ([(64, 64)], [77, 20, 33], [729, 5]),            # leftover captions join the text; extra SigLIP is unused
    ([(2, 2)], [0], [0]),                            # an empty caption / SigLIP: 0 rows, not pad rows
    ([(64, 62)], [32, 31], [32, 33]),                # both sides of the padding
])
def test_omni_rows_match_the_written_out_layout(siglip_model, refs, ref_texts, siglip):
    t = zimage_tokens((1, 16, 65, 64), 77, refs=refs, ref_texts=ref_texts, siglip=siglip, siglip_model=siglip_model)
    target, cap, ref = omni_oracle(65, 64, 77, refs, ref_texts, siglip, siglip_model)
    assert (t.video, t.text, t.refs) == (target, cap, ref) and t.image and t.audio == t.keyframes == 0
    assert t.total == target + cap + ref
    assert t.as_dict() == {"image": target, "text": cap, "refs": ref, "total": t.total}
    assert t.describe() == f"{t.total:,} tokens (image {target:,}, text {cap:,}, refs {ref:,})"


def test_omni_by_hand_and_without_references():
    # 1 ref 64x64 (32*32 = 1024 rows), caption 77 -> 96, SigLIP 27*27 = 729 -> 736; target 128x128: 4096 rows,
    # caption 77 -> 96, SigLIP pad 32: 4096 + 192 + 1024 + 736 + 32
    t = zimage_tokens((1, 16, 128, 128), 77, refs=[(64, 64)], ref_texts=[77], siglip=[729], siglip_model=True)
    assert (t.video, t.text, t.refs, t.total) == (4096, 192, 1792, 6080)
    # no references: ref_texts / siglip are ignored (no omni), as the model ignores them
    plain = zimage_tokens((1, 16, 128, 128), 77, ref_texts=[77], siglip=[729], siglip_model=True)
    assert (plain.video, plain.text, plain.refs) == (4096, 96, 0) and "refs" not in plain.as_dict()


def test_omni_refusals_name_the_reference():
    for hw in ((63, 64), (64, 1), (0, 64)):
        with pytest.raises(MemoryModelError, match="reference latent 0 is .*multiples of the patch 2"):
            zimage_tokens((1, 16, 64, 64), 7, refs=[hw])
    with pytest.raises(MemoryModelError, match="reference latent 1 must be given as"):
        zimage_tokens((1, 16, 64, 64), 7, refs=[(8, 8), (8,)])
    with pytest.raises(MemoryModelError, match="pad_tokens_multiple"):
        zimage_tokens((1, 16, 64, 64), 7, pad_multiple=None, refs=[(8, 8)])
    with pytest.raises(MemoryModelError, match="reference caption rows"):
        zimage_tokens((1, 16, 64, 64), 7, refs=[(8, 8)], ref_texts=[-1])
    with pytest.raises(MemoryModelError, match="SigLIP rows"):
        zimage_tokens((1, 16, 64, 64), 7, refs=[(8, 8)], siglip=[1.5])
    with pytest.raises(MemoryModelError, match="absurd"):
        zimage_tokens((1, 16, 64, 64), 7, refs=[(1 << 16, 1 << 16)])


def test_zimage_conds_reads_what_extra_conds_reads():
    from types import SimpleNamespace

    import torch

    from ditkit.bridge.preflight import zimage_conds

    cvo = lambda h, w: SimpleNamespace(image_sizes=[(3, h, w)])   # noqa: E731
    ref = torch.zeros(1, 16, 40, 24)[:, :, ::2]                   # non-contiguous: 20 x 24
    items = [[torch.zeros(1, 77, 8), {"reference_latents": [ref, torch.zeros(1, 16, 8, 8, dtype=torch.bfloat16)],
                                      "reference_latents_text_embeds": [torch.zeros(1, 33, 8)],
                                      "unclip_conditioning": [{"clip_vision_output": cvo(384, 384)}, {},
                                                              {"clip_vision_output": cvo(17, 33)}]}],
             {"cross_attn": torch.zeros(1, 5, 8), "reference_latents": [torch.zeros(1, 16, 4, 4)],
              "clip_vision_outputs": [None, cvo(32, 16)]},
             [torch.zeros(1, 9, 8), {"unclip_conditioning": [{"clip_vision_output": cvo(64, 64)}]}]]
    got = zimage_conds(items, 3)
    assert got == [{"text": 77, "refs": [(20, 24), (8, 8)], "ref_texts": [33], "siglip": [24 * 24, 1 * 2]},
                   {"text": 5, "refs": [(4, 4)], "ref_texts": [], "siglip": [2 * 1]},
                   {"text": 9, "refs": [], "ref_texts": [], "siglip": []}]     # no references: SigLIP unused
    assert zimage_conds(None, 3) == [] and zimage_conds([[None, {}]], 3) == [
        {"text": 3, "refs": [], "ref_texts": [], "siglip": []}]
    bad = [({"reference_latents": torch.zeros(1, 16, 8, 8)}, "the conditioning's reference_latents is not a list of 4-D"),
           ({"reference_latents": [torch.zeros(16, 8, 8)]}, "the conditioning's reference_latents is not a list of 4-D"),
           ({"reference_latents": [torch.zeros(1, 16, 8, 8)], "reference_latents_text_embeds": [torch.zeros(3, 8)]},
            "the conditioning's reference_latents_text_embeds is not a list of 3-D"),
           ({"reference_latents": [torch.zeros(1, 16, 8, 8)], "unclip_conditioning": {"a": 1}},
            "the conditioning's unclip_conditioning is not a list of dicts"),
           ({"reference_latents": [torch.zeros(1, 16, 8, 8)], "clip_vision_outputs": 3},
            "the conditioning's clip_vision_outputs is not a list"),
           ({"reference_latents": [torch.zeros(1, 16, 8, 8)], "clip_vision_outputs": [SimpleNamespace()]},
            "a CLIP vision output without image_sizes [(C, H, W)]")]
    for d, msg in bad:
        with pytest.raises(MemoryModelError, match=re.escape(f"DitKitPreflight: input 'x': {msg}")):
            zimage_conds([[None, d]], 3, "input 'x'")
