"""vae/t1_decode (issue 29, mutation survivors): the temporal plan's bounds (repeat_clip_tokens), what the report says
for each of the three decode loops (ditkit's blending loop, the VAE's own tiled decode, untiled), and the progress
counts. Oracles: the tile plan recomputed here from the fake VAE's split_tiles, sizes from the shapes."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from ditkit.bridge.vae import h3_vae_ops
from ditkit.errors import DitKitError
from ditkit.vae.t1_decode import T1DecodeReport, repeat_clip_tokens, tiled_decode_frame

from _fake_h3 import FakeH3  # noqa: E402  (tests/unit on sys.path)


def _ops(**kw):
    return dataclasses.replace(h3_vae_ops(FakeH3(seed=2)), **kw)


@pytest.mark.parametrize("pad,chunks,chunk,overlap,want", [
    (5, 1, 5, 2, 7), (0, 1, 5, 2, 2), (4, 1, 5, 2, 6), (6, 1, 5, 2, 7), (10, 3, 5, 2, 7), (5, 1, 4, 1, 5),
    (5, 1, 0, 2, 2),
])
def test_repeat_clip_tokens(pad, chunks, chunk, overlap, want):
    seen = []
    ops = _ops(temporal_chunks=lambda t: seen.append(t) or (pad, chunks), tokens_chunk_size=chunk,
               token_overlap=overlap, frame_pre_padding=3)
    assert repeat_clip_tokens(ops) == (want, 3) and seen == [2]
    assert repeat_clip_tokens(_ops(temporal_chunks=lambda t: (pad, chunks), frame_pre_padding=0))[1] == 0


@pytest.mark.parametrize("pad,chunks,chunk,overlap", [(5, 0, 5, 2), (-1, 1, 5, 2), (5, 1, 1, 0), (5, -1, 5, 2)])
def test_repeat_clip_tokens_refuses_an_unexpected_plan(pad, chunks, chunk, overlap):
    ops = _ops(temporal_chunks=lambda t: (pad, chunks), tokens_chunk_size=chunk, token_overlap=overlap)
    with pytest.raises(DitKitError, match=f"unexpected H3 temporal chunk plan for T=2: pad {pad}, chunks {chunks}"):
        repeat_clip_tokens(ops)


def _plan(m, n):
    starts, lens, _ = m.split_tiles(n)
    return len(starts), lens


@pytest.mark.parametrize("hw,batch", [((3, 3), 1), ((9, 6), 2), ((11, 7), 3)])
def test_ditkit_loop_report_and_progress(hw, batch):
    ops = _ops()
    assert ops.tiled_frame is None
    fake = FakeH3(seed=2)
    z = torch.randn(batch, 24, 7, *hw, generator=torch.Generator().manual_seed(1))
    rep = T1DecodeReport("repeat_decode", batch, hw, 7, 3)
    calls = []
    out = tiled_decode_frame(ops, z, 3, rep, lambda d, t: calls.append((d, t)))
    r = fake.vae_ratio
    ny, ylen = _plan(fake, hw[0] * r)
    nx, xlen = _plan(fake, hw[1] * r)
    assert rep.tiles == ny * nx and rep.tiled is True
    assert rep.max_tile_bytes == batch * 3 * 4 * 7 * max(ylen) * max(xlen) * 4     # raw fp32, 4 frames per token
    assert out.shape == (batch, 3, 1, hw[0] * r, hw[1] * r)
    assert rep.canvas_bytes == out.numel() * 4
    assert rep.extra["blending"] == "ditkit loop (this VAE has no tiled_decode of its own)"
    total = ny * nx * batch
    assert calls == [(batch * (i + 1), total) for i in range(ny * nx)]


def test_untiled_report_and_progress():
    ops = _ops(tiling=False)
    z = torch.randn(2, 24, 7, 5, 4, generator=torch.Generator().manual_seed(2))
    rep = T1DecodeReport("repeat_decode", 2, (5, 4), 7, 3)
    calls = []
    out = tiled_decode_frame(ops, z, 3, rep, lambda d, t: calls.append((d, t)))
    raw = ops.decode_pixels(z)
    assert torch.equal(out, raw[:, :, 3:4]) and out.is_contiguous()
    assert rep.tiled is False and rep.tiles == 1
    assert rep.max_tile_bytes == raw.numel() * 4 and rep.canvas_bytes == out.numel() * 4 == raw.numel() * 4 // 28
    assert calls == [(2, 2)] and "blending" not in rep.extra
    assert torch.equal(tiled_decode_frame(ops, z, 0), raw[:, :, 0:1])               # report and progress optional


def test_host_tiled_decode_report_and_progress():
    seen = []

    def tiled_frame(z, frame, on_tile):
        seen.append(frame)
        b = z.shape[0]
        for n in (b, 2 * b, b // 2 or 1, b):                  # the host batches tiles: 1, 2, <1 and 1 tile(s)
            on_tile(torch.zeros(n, 3, 1, 4, 6))
        return torch.ones(b, 3, 1, 8, 8)

    ops = _ops(tiled_frame=tiled_frame)
    z = torch.randn(2, 24, 1, 4, 4)
    rep = T1DecodeReport("direct_image_vae", 2, (4, 4), 1, 1)
    calls = []
    out = tiled_decode_frame(ops, z, 1, rep, lambda d, t: calls.append((d, t)))
    assert seen == [1] and torch.equal(out, torch.ones(2, 3, 1, 8, 8))
    assert rep.tiles == 1 + 2 + 1 + 1 and rep.max_tile_bytes == 4 * 3 * 4 * 6 * 4
    assert rep.canvas_bytes == out.numel() * 4 and rep.extra["blending"] == "host tiled_decode"
    ny, _ = _plan(FakeH3(), 8)
    total = ny * ny * 2
    want, done = [], 0
    for n in (2, 4, 1, 2):
        done = min(total, done + n)
        want.append((done, total))
    assert calls == want
    assert torch.equal(tiled_decode_frame(ops, z, 0), torch.ones(2, 3, 1, 8, 8))   # without report / progress


def test_summary_of_the_host_single_image_path():
    r = T1DecodeReport("host_single_image", 3, (4, 4), 1, 0)
    assert r.summary() == "T=1 decode: ComfyUI's own single-image path (the host has one; ditkit deferred to it), " \
                          "batch 3"


@pytest.mark.parametrize("shape,empty", [((0, 24, 1, 4, 4), "B=0"), ((1, 24, 1, 0, 4), "H=0"),
                                         ((1, 24, 1, 4, 0), "W=0")])
def test_an_empty_latent_is_refused_naming_the_node_and_input(shape, empty):
    from ditkit.vae.t1_decode import direct_decode_t1, repeat_decode_t1

    ops = _ops()
    for run in (lambda: repeat_decode_t1(ops, torch.zeros(shape)), lambda: direct_decode_t1(ops, torch.zeros(shape), 0)):
        with pytest.raises(DitKitError, match=re.escape(f"H3 T=1 decode: input 'samples' is an empty latent (shape "
                                                        f"{shape}: {empty})")):
            run()


def test_the_latent_checks_run_unless_the_caller_says_it_ran_them():
    from ditkit.vae.t1_decode import direct_decode_t1, repeat_decode_t1

    ops = _ops()
    two = torch.randn(1, 24, 2, 4, 4)
    with pytest.raises(DitKitError, match="T=1 decode got a latent with T=2"):
        repeat_decode_t1(ops, two)
    with pytest.raises(DitKitError, match="T=1 decode got a latent with T=2"):
        direct_decode_t1(ops, two, 0)
    out, _ = repeat_decode_t1(ops, torch.randn(1, 24, 1, 4, 4), checked=True)
    assert out.shape == (1, 3, 1, 8, 8)


def test_host_tiled_decode_counts_with_many_tiles():
    sizes = [5, 4, 1, 2]                                    # items per on_tile call (b = 2): 2, 2, 1 and 1 tile(s)

    def tiled_frame(z, frame, on_tile):
        for n in sizes:
            on_tile(torch.zeros(n, 3, 1, 2, 2))
        return torch.zeros(z.shape[0], 3, 1, 22, 14)

    ops = _ops(tiled_frame=tiled_frame)
    z = torch.randn(2, 24, 1, 11, 7)
    fake = FakeH3()
    ny, _ = _plan(fake, 22)
    nx, _ = _plan(fake, 14)
    total = ny * nx * 2
    assert total > sum(sizes)
    rep = T1DecodeReport("direct_image_vae", 2, (11, 7), 1, 0)
    calls = []
    tiled_decode_frame(ops, z, 0, rep, lambda d, t: calls.append((d, t)))
    assert calls == [(5, total), (9, total), (10, total), (12, total)]
    assert rep.tiles == 2 + 2 + 1 + 1 and type(rep.tiles) is int


class _UnevenTiles(FakeH3):
    """Tiles 0-8, 6-14 and 10-20 of 20 pixels: overlaps 2 then 4 (a plan where every overlap index matters)."""

    def split_tiles(self, n):
        if n == 20:
            return [0, 6, 10], [8, 8, 10], [2, 4]
        return super().split_tiles(n)


@pytest.mark.parametrize("hw", [(10, 10), (10, 3), (3, 10), (4, 11)])
def test_ditkit_loop_equals_the_full_decode_on_uneven_and_wide_plans(hw):
    from _fake_h3 import full_tiled_decode

    fake = _UnevenTiles(seed=4)
    strips = []

    def blend(a, b, e, dim):
        strips.append((a.shape[dim], e))
        return fake.blend(a, b, e, dim)

    ops = dataclasses.replace(h3_vae_ops(fake), blend=blend)
    z = torch.randn(2, 24, 1, *hw, generator=torch.Generator().manual_seed(9))
    out = tiled_decode_frame(ops, z, 2)
    assert torch.equal(out, full_tiled_decode(fake, z)[:, :, 2:3])
    assert strips and all(kept == e for kept, e in strips)             # only the overlap is kept between tiles


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_ditkit_loop_keeps_the_decoder_dtype(dtype):
    fake = FakeH3(seed=5)
    ops = _ops(decode_pixels=lambda z: fake._decode_pixels(z.float()).to(dtype))
    z = torch.randn(1, 24, 1, 9, 6, generator=torch.Generator().manual_seed(3))
    rep = T1DecodeReport("direct_image_vae", 1, (9, 6), 1, 0)
    out = tiled_decode_frame(ops, z, 0, rep)
    assert out.dtype == dtype and rep.canvas_bytes == out.numel() * out.element_size()


def test_ditkit_loop_makes_the_canvas_on_the_decoder_device():
    def decode(z):
        b, _, t, h, w = z.shape
        return torch.zeros(b, 3, 4 * t, 2 * h, 2 * w, device=z.device)

    ops = _ops(decode_pixels=decode)
    out = tiled_decode_frame(ops, torch.zeros(1, 24, 1, 9, 6, device="meta"), 0)
    assert out.device.type == "meta" and out.shape == (1, 3, 1, 18, 12)
