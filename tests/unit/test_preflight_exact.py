"""vae/preflight.py, written from the survivors of a mutation run (issue #29): every refusal's whole message (the
node, the input, the value and the limit, spelled out here), every limit on both sides, the defaults."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import DitKitError
from ditkit.vae import preflight as pf

MIB, GIB = 1 << 20, 1 << 30


def _msg(fn, *a, **kw) -> str:
    with pytest.raises(DitKitError) as ei:
        fn(*a, **kw)
    return str(ei.value)


def test_fmt_bytes_exact_text():
    assert pf.GIB == 1073741824 and pf.MEMORY_FRACTION == 0.9
    assert pf.fmt_bytes(GIB - 1) == "1024.0 MiB" and pf.fmt_bytes(GIB) == "1.00 GiB"
    assert pf.fmt_bytes(MIB) == "1.0 MiB" and pf.fmt_bytes(5 * GIB / 4) == "1.25 GiB"


def test_latent_shape_messages_and_defaults():
    assert _msg(pf.check_latent_shape, (1, 2, 3, 4), "N") == \
        "N: input 'samples' must be a 5-D latent [B, C, T, H, W]; got shape (1, 2, 3, 4)"
    assert _msg(pf.check_latent_shape, (1, 2, 3), "N", "lat", 4, "[B, C, H, W]") == \
        "N: input 'lat' must be a 4-D latent [B, C, H, W]; got shape (1, 2, 3)"
    assert _msg(pf.check_latent_shape, (1, 0, 2, 0, 1), "N") == \
        ("N: input 'samples' is an empty latent (shape (1, 0, 2, 0, 1): C=0, H=0); every dimension must be at "
         "least 1")
    assert _msg(pf.check_latent_shape, (1, -1, 2, 1), "N", "x", 4, "[B, C, H, W]") == \
        "N: input 'x' is an empty latent (shape (1, -1, 2, 1): C=-1); every dimension must be at least 1"
    got = pf.check_latent_shape([1.0, 2, 3, 4], "N", ndim=4)
    assert got == (1, 2, 3, 4) and [type(x) for x in got] == [int] * 4      # ints back
    assert pf.check_latent_shape(torch.Size([1, 1, 1, 1, 1]), "N") == (1, 1, 1, 1, 1)


def test_image_size_messages_both_sides_of_each_limit():
    assert _msg(pf.check_image_size, (1, 2, 3), "E", 32) == \
        "E: input 'image' must be an IMAGE batch [N, H, W, C]; got shape (1, 2, 3)"
    assert _msg(pf.check_image_size, (0, 64, 64, 3), "E", 32, "img") == "E: input 'img' holds no image (batch 0)"
    assert _msg(pf.check_image_size, (1, 64, 64, 2), "E", 32) == \
        "E: input 'image' has 2 channel(s); RGB (3) is needed"
    assert pf.check_image_size((1, 64, 64, 3), "E", 32) == (1, 64, 64, 3)          # 3 channels: accepted
    assert _msg(pf.check_image_size, (1, 31, 32, 3), "E", 32) == \
        "E: input 'image' is 32x31 pixels; this VAE needs at least 32x32"
    assert _msg(pf.check_image_size, (1, 32, 31, 3), "E", 32, why="reflection pad") == \
        "E: input 'image' is 31x32 pixels; this VAE needs at least 32x32 (reflection pad)"
    assert pf.check_image_size((1, 32, 32, 3), "E", 32, why="w") == (1, 32, 32, 3)
    got = pf.check_image_size([1.0, 33, 34, 3.0], "E", 33)
    assert got == (1, 33, 34, 3) and [type(x) for x in got] == [int] * 4


def test_memory_limit_on_both_sides_and_the_whole_message():
    # limit = int(available * fraction): 900 of 1000; need = sum of the parts, negatives counted as 0
    assert pf.check_memory("N", "s", (1,), {"a": 899.9, "b": 0.1}, 1000, "free") == 900
    assert pf.check_memory("N", "s", (1,), {"a": 900, "b": -500}, 1000, "free") == 900      # -500 counts 0
    msg = _msg(pf.check_memory, "N", "s", (2, 3), {"a": 901, "b": -5}, 1000, "of RAM free")
    assert msg == ("N: input 's' of shape (2, 3) needs about 0.0 MiB (a 0.0 MiB, b -0.0 MiB), more than 90% of the "
                   "0.0 MiB of RAM free (limit 0.0 MiB); nothing was allocated. Use a smaller size or batch")
    assert pf.check_memory("N", "s", (1,), {"a": 500}, 1000, "free", fraction=0.5) == 500
    assert "more than 50% of" in _msg(pf.check_memory, "N", "s", (1,), {"a": 501}, 1000, "free", fraction=0.5)
    assert pf.check_memory("N", "s", (1,), {}, 0, "free") == 0                         # nothing needed, nothing free
    assert pf.check_memory("N", "s", (1,), {"a": 0}, -GIB, "free") == 0                # negative free counts as 0
    assert "(limit 0.0 MiB)" in _msg(pf.check_memory, "N", "s", (1,), {"a": 1}, -GIB, "free")
    # nothing free is a limit of 0 bytes at any fraction: one byte needed is refused even with fraction 1 (or 2)
    for frac in (1.0, 2.0):
        for free in (0, -GIB, 0.4):
            assert "needs about" in _msg(pf.check_memory, "N", "s", (1,), {"a": 1}, free, "free", fraction=frac)
    assert pf.check_memory("N", "s", (1,), {"a": 2}, 1, "free", fraction=2.0) == 2      # 1 byte free x 2 = 2: fits
    big = _msg(pf.check_memory, "N", "s", [1], {"x": 2 * GIB, "y": GIB}, 2 * GIB, "on cuda:0")
    assert big == ("N: input 's' of shape (1,) needs about 3.00 GiB (x 2.00 GiB, y 1.00 GiB), more than 90% of the "
                   "2.00 GiB on cuda:0 (limit 1.80 GiB); nothing was allocated. Use a smaller size or batch")


@pytest.mark.parametrize("b,h,w", [(1, 16, 16), (2, 1, 1), (1, 17, 16), (3, 40, 8)])
def test_t1_decode_bytes_written_out(b, h, w):
    ratio, item, tokens = 16, 2, 7
    px = b * 3 * h * ratio * w * ratio
    got = pf.t1_decode_bytes((b, 24, 1, h, w), ratio, item, tokens)
    assert got == {"canvas": px * item, "output image": px * 4,
                   "largest tile": min(px, b * 3 * 65536) * 4 * tokens * item}
    # the tile bound: below 256x256 px per image the canvas bounds the tile, above it the 256x256 tile does
    assert (px <= b * 3 * 65536) == (h * w * 256 <= 65536)


def test_t1_tile_bound_both_sides():
    at = pf.t1_decode_bytes((1, 24, 1, 16, 16), 16, 4, 1)["largest tile"]      # exactly 256x256 px
    assert at == 3 * 256 * 256 * 4 * 4
    over = pf.t1_decode_bytes((1, 24, 1, 17, 16), 16, 4, 1)["largest tile"]    # one latent row more: capped
    assert over == at
    under = pf.t1_decode_bytes((1, 24, 1, 15, 16), 16, 4, 1)["largest tile"]
    assert under == 3 * 240 * 256 * 4 * 4


def _audio(shape, rate):
    return {"waveform": torch.zeros(shape), "sample_rate": rate}


def test_audio_messages_exact():
    rates = [48000, 44100, 8000]
    assert _msg(pf.check_audio, [], "S", rates) == \
        "S: input 'audio' must be an AUDIO dict with 'waveform' and 'sample_rate'"
    assert _msg(pf.check_audio, {"sample_rate": 1}, "S", rates, "a2").startswith("S: input 'a2' must be an AUDIO")
    assert _msg(pf.check_audio, {"waveform": torch.zeros(1, 1, 1)}, "S", rates).endswith("and 'sample_rate'")
    assert _msg(pf.check_audio, {"waveform": [1, 2], "sample_rate": 8000}, "S", rates) == \
        "S: input 'audio' waveform must be [batch, channels, samples]; got shape ()"
    assert _msg(pf.check_audio, _audio((1, 2, 3), math.inf), "S", rates) == \
        "S: input 'audio' sample_rate inf is not a whole number of Hz"
    assert _msg(pf.check_audio, _audio((1, 2, 3), 22050), "S", rates) == \
        ("S: input 'audio' sample_rate 22050 Hz is not supported by the audio encoder (supported: 8000, 44100, 48000 "
         "Hz); resample it first")
    assert _msg(pf.check_audio, _audio((1, 2, 3), 0), "S", None) == \
        "S: input 'audio' sample_rate 0 Hz is not supported by the audio encoder"
    assert _msg(pf.check_audio, _audio((1, 2, 3), -1), "S", []) == \
        "S: input 'audio' sample_rate -1 Hz is not supported by the audio encoder"
    assert _msg(pf.check_audio, _audio((1, 2, 0), 8000), "S", rates) == \
        ("S: input 'audio' is empty (shape (1, 2, 0): 0 samples = 0 s); give at least one sample or leave the input "
         "unconnected")
    assert _msg(pf.check_audio, _audio((0, 2, 12000), 8000), "S", rates) == \
        ("S: input 'audio' is empty (shape (0, 2, 12000): 12000 samples = 1.5 s); give at least one sample or leave "
         "the input unconnected")
    assert _msg(pf.check_audio, _audio((1, 4, 3), 8000), "S", rates) == \
        "S: input 'audio' has 4 channels; the encoder is given 1, 2, 6 (mono, stereo, 5.1)"
    assert _msg(pf.check_audio, _audio((1, 1, 3), 8000), "S", rates, channels=(6, 2)) == \
        "S: input 'audio' has 1 channels; the encoder is given 2, 6 (mono, stereo, 5.1)"


def test_audio_accepts_on_the_other_side():
    assert pf.check_audio(_audio((1, 1, 1), 1), "S", None) == (1, 1, 1)                  # 1 Hz, no rate list
    assert pf.check_audio(_audio((1, 6, 1), 1), "S", []) == (1, 6, 1)                    # empty list: no list
    assert pf.check_audio(_audio((2, 2, 3), 8000.0), "S", (8000.0,)) == (8000, 2, 3)
    assert pf.check_audio(_audio((1, 3, 2), 8000), "S", [8000], channels=(3,)) == (8000, 3, 2)
    r = pf.check_audio(_audio((1, 2, 2), 44100.0), "S", [44100])
    assert r == (44100, 2, 2) and type(r[0]) is int
