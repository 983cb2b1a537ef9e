"""vae/preflight.py (issue #17 item 10): requests that cannot work are refused before any heavy work, with the input,
the value and the limit in the message; the memory figures are shape x itemsize arithmetic written out here."""
from __future__ import annotations

import pytest

from ditkit.errors import DitKitError
from ditkit.vae import preflight as pf


@pytest.mark.parametrize("shape,word", [((0, 24, 1, 2, 2), "B=0"), ((1, 24, 0, 2, 2), "T=0"), ((1, 0, 1, 2, 2), "C=0"),
                                        ((1, 24, 1, 0, 2), "H=0"), ((1, 24, 1, 2, 0), "W=0")])
def test_empty_latents(shape, word):
    with pytest.raises(DitKitError) as ei:
        pf.check_latent_shape(shape, "Node", "samples")
    assert "input 'samples'" in str(ei.value) and "empty latent" in str(ei.value) and word in str(ei.value)


def test_latent_rank_and_valid_shape():
    with pytest.raises(DitKitError, match="5-D"):
        pf.check_latent_shape((1, 24, 2, 2), "Node")
    assert pf.check_latent_shape((1, 24, 1, 1, 1), "Node") == (1, 24, 1, 1, 1)


@pytest.mark.parametrize("shape,word", [((1, 1, 1, 3), "1x1"), ((1, 15, 15, 3), "15x15"), ((1, 31, 64, 3), "64x31"),
                                        ((0, 64, 64, 3), "no image"), ((1, 64, 64, 1), "1 channel")])
def test_small_or_empty_images(shape, word):
    with pytest.raises(DitKitError) as ei:
        pf.check_image_size(shape, "Enc", 32)
    assert "input 'image'" in str(ei.value) and word in str(ei.value)


def test_image_size_limit_is_inclusive():
    assert pf.check_image_size((2, 32, 32, 3), "Enc", 32) == (2, 32, 32, 3)
    assert pf.check_image_size((1, 32, 40, 4), "Enc", 32)[2] == 40


def test_memory_check_reports_the_figures():
    # a 16384 x 16384 T=1 decode: latent 1024 x 1024 at 16x; canvas fp32 3*16384^2*4 bytes = 3 GiB
    parts = pf.t1_decode_bytes((1, 24, 1, 1024, 1024), ratio=16, compute_itemsize=4, tokens=7)
    assert parts["canvas"] == 3 * 16384 * 16384 * 4 == 3 * 2 ** 30
    assert parts["output image"] == 3 * 2 ** 30
    with pytest.raises(DitKitError) as ei:
        pf.check_memory("DitKitH3VAEDecode", "samples", (1, 24, 1, 1024, 1024), parts, available=4 * 2 ** 30,
                        where="of RAM free")
    msg = str(ei.value)
    assert "input 'samples'" in msg and "(1, 24, 1, 1024, 1024)" in msg and "4.00 GiB of RAM free" in msg
    assert "canvas 3.00 GiB" in msg and "limit 3.60 GiB" in msg and "nothing was allocated" in msg
    need = pf.check_memory("N", "samples", (1,), {"a": 100, "b": 50}, available=1000, where="free")
    assert need == 150
    with pytest.raises(DitKitError):   # 901 > 90 % of 1000
        pf.check_memory("N", "samples", (1,), {"a": 901}, available=1000, where="free")


RATES = [96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350]


def _audio(shape, rate):
    import torch

    return {"waveform": torch.zeros(shape), "sample_rate": rate}


@pytest.mark.parametrize("shape,rate,word", [
    ((1, 2, 100), 7, "7 Hz is not supported"), ((1, 2, 100), 192000, "192000 Hz"), ((1, 2, 100), 0, "0 Hz"),
    ((1, 2, 100), -44100, "-44100 Hz"), ((1, 2, 100), float("nan"), "not a whole number"),
    ((1, 2, 100), 44100.5, "not a whole number"), ((1, 2, 100), True, "not a whole number"),
    ((1, 2, 100), "44100", "not a whole number"),
    ((1, 2, 0), 44100, "0 samples"), ((0, 2, 100), 44100, "empty"), ((1, 3, 100), 44100, "3 channels"),
    ((1, 100), 44100, "[batch, channels, samples]")])
def test_bad_audio(shape, rate, word):
    with pytest.raises(DitKitError) as ei:
        pf.check_audio(_audio(shape, rate), "DitKitSaveVideo", RATES)
    assert "input 'audio'" in str(ei.value) and word in str(ei.value), str(ei.value)


def test_good_audio():
    assert pf.check_audio(_audio((1, 2, 10), 44100), "S", RATES) == (44100, 2, 10)
    assert pf.check_audio(_audio((1, 1, 1), 7350.0), "S", RATES) == (7350, 1, 1)
    assert pf.check_audio(_audio((1, 6, 5), 48000), "S", None) == (48000, 6, 5)
    with pytest.raises(DitKitError, match="AUDIO dict"):
        pf.check_audio({"waveform": None}, "S", RATES)
