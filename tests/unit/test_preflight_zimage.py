"""memory/preflight.zimage_tokens: Z-Image's joint sequence, against counts written out here from ComfyUI 0.33's
``NextDiT.patchify_and_embed`` (image rows of the 2x2-patched latent and the caption rows, each padded up to
``pad_tokens_multiple`` = 32 with pad tokens), and the bad inputs it refuses before anything exists."""
from __future__ import annotations

import math
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
    with pytest.raises(MemoryModelError, match="the sampler's conditioning.*reference latents"):
        zimage_text_rows([{"cross_attn": torch.zeros(1, 4, 8), "reference_latents": [torch.zeros(1, 16, 8, 8)]}],
                         5, "the sampler's conditioning")
    with pytest.raises(MemoryModelError, match="input 'positive'.*not a CONDITIONING"):
        zimage_text_rows([torch.zeros(1, 4, 8)], 5)
    assert latent_shapes_of(torch.zeros(2, 16, 8, 6), "zimage") == ((2, 16, 8, 6), None)
    for bad in (torch.zeros(1, 16, 2, 8, 8), torch.zeros(16, 8)):
        with pytest.raises(MemoryModelError, match="not a Z-Image latent"):
            latent_shapes_of(bad, "zimage")
