"""cache/audio_guard.py: each check flags its fault exactly past its threshold and nothing on a clean tone.

Oracles written here: the mean / clip fraction / RMS of hand-built signals, a click spliced into a steady tone."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.cache.audio_guard import DEFAULT_THRESHOLDS, AudioGuardThresholds, check_waveform

SR = 32000


def tone(n=SR, f=440.0, amp=0.3, ch=2):
    t = torch.arange(n, dtype=torch.float64) / SR
    return (amp * torch.sin(2 * math.pi * f * t)).repeat(ch, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_clean_tone_is_clean_in_every_dtype(dtype):
    r = check_waveform(tone().to(dtype))
    assert r.clean and not r.flags, r.flags
    assert r.figures["rms_dbfs"] == pytest.approx(20 * math.log10(0.3 / math.sqrt(2)), abs=0.1)


def test_shapes_and_strided_input():
    w = tone()
    assert check_waveform(w[0]).items == 1 and check_waveform(w[0]).channels == 1
    assert check_waveform(w[None]).items == 1
    strided = tone(ch=4)[::2]            # non-contiguous rows
    assert check_waveform(strided).channels == 2 and check_waveform(strided).clean
    with pytest.raises(ValueError):
        check_waveform(torch.zeros(2, 2, 2, 0))
    with pytest.raises(TypeError):
        check_waveform(torch.zeros(2, 10, dtype=torch.int16))


def test_dc_offset_boundary_both_sides():
    th = AudioGuardThresholds(dc_offset=0.0625)
    w = torch.zeros(1, 1000, dtype=torch.float64) + 0.0625   # mean exactly the threshold: not above
    w = w + tone(1000, amp=0.1, ch=1) * 0 + 0.0
    assert not any("DC" in f for f in check_waveform(w, th).flags)
    assert any("DC" in f for f in check_waveform(w + 2 ** -20, th).flags)


def test_clipping_boundary_both_sides():
    th = AudioGuardThresholds(clipping=0.01, clip_level=0.999)
    w = tone(SR, amp=0.3, ch=1)
    w[0, :320] = 1.0      # exactly 1 % of the samples at full scale: not above
    assert not any("clipping" in f for f in check_waveform(w, th).flags)
    w[0, 320] = -1.0      # one more
    assert any("clipping" in f for f in check_waveform(w, th).flags)
    assert check_waveform(w, th).figures["clipping"] == pytest.approx(321 / SR)


def test_silence_boundary_both_sides():
    th = AudioGuardThresholds(silence_dbfs=-60.0)
    quiet = torch.full((1, 1000), 1e-3, dtype=torch.float64)   # RMS exactly -60 dBFS: not below
    r = check_waveform(quiet, AudioGuardThresholds(silence_dbfs=-60.0, dc_offset=1.0))
    assert r.figures["rms_dbfs"] == pytest.approx(-60.0, abs=1e-9)
    assert not any("silent" in f for f in r.flags)
    r = check_waveform(quiet * 0.999, AudioGuardThresholds(silence_dbfs=-60.0, dc_offset=1.0))
    assert any("silent" in f for f in r.flags)
    assert any("silent" in f for f in check_waveform(torch.zeros(2, 5000), th).flags)  # digital silence
    # a silent item among loud ones is found (the loudest channel of each item counts)
    batch = torch.stack([tone(), tone() * 0])
    r = check_waveform(batch)
    assert any("silent" in f and "item 1" in f for f in r.flags)


def test_one_loud_channel_is_not_silence():
    w = tone()
    w[1] = 0
    assert not any("silent" in f for f in check_waveform(w).flags)


def test_nonfinite_counted_and_other_checks_still_run():
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = tone()
        w[0, 100] = bad
        r = check_waveform(w)
        assert not r.clean and r.figures["nonfinite"] == 1 and "1 NaN/Inf samples" in r.flags
        assert math.isfinite(r.figures["rms_dbfs"])


def test_pop_is_a_spectral_jump_and_a_steady_tone_is_not():
    w = tone(2 * SR, ch=1)
    clean = check_waveform(w).figures["spectral_jump_db"]
    assert clean < DEFAULT_THRESHOLDS.spectral_jump_db
    w[0, SR:SR + 160] = 0.9
    r = check_waveform(w)
    assert r.figures["spectral_jump_db"] > DEFAULT_THRESHOLDS.spectral_jump_db
    assert any("spectral jump" in f for f in r.flags)


def test_spectral_jump_boundary_uses_strict_greater():
    w = tone(2 * SR, ch=1)
    w[0, SR:SR + 160] = 0.9
    fig = check_waveform(w).figures["spectral_jump_db"]
    assert not any("spectral" in f for f in check_waveform(w, AudioGuardThresholds(spectral_jump_db=fig)).flags)
    assert any("spectral" in f for f in check_waveform(w, AudioGuardThresholds(spectral_jump_db=fig - 1e-9)).flags)


def test_short_clip_has_no_jump_figure():
    assert check_waveform(tone(1000)).figures["spectral_jump_db"] == 0.0


def test_report_dict_and_summary():
    r = check_waveform(tone() + 0.1)
    d = r.as_dict()
    assert d["clean"] is False and d["flags"] and d["thresholds"]["dc_offset"] == DEFAULT_THRESHOLDS.dc_offset
    assert r.summary().startswith("audio guard: DC offset")
    assert check_waveform(tone()).summary().startswith("audio guard: clean")


def test_spectral_jump_is_the_same_in_chunks():
    """The chunked pass (memory bound for long tracks) gives the figure of one pass over all frames."""
    from ditkit.cache.audio_guard import _spectral_jump

    w = tone(3 * SR, ch=1)[0]
    w[SR + 77:SR + 237] = 0.9
    th = DEFAULT_THRESHOLDS
    one = _spectral_jump(w, th, chunk_frames=10_000)
    for c in (1, 2, 7, 64):
        assert _spectral_jump(w, th, chunk_frames=c) == pytest.approx(one, rel=1e-12, abs=1e-12)
