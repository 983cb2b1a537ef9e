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


# ------------------------------------------------------------------------------------------------ sampling time
# Oracles written here: the spectrum of a latent whose rows are pure tones (power in one bin), and the RMS of a
# known dB difference; the trajectory figure is the last spectral step over the one before it.

from ditkit.cache.audio_guard import (DEFAULT_TRAJECTORY_THRESHOLDS, AudioTrajectoryMonitor,  # noqa: E402
                                      TrajectoryThresholds, latent_spectrum_db, spectral_step_db)


def _latent(amps, t=32, ch=4):
    """[1, ch, t]: row c is amps[c] * cos(2 pi k t / T) with k = c + 1 (one bin each)."""
    n = torch.arange(t, dtype=torch.float64)
    rows = [a * torch.cos(2 * math.pi * (c + 1) * n / t) for c, a in enumerate(amps)]
    return torch.stack(rows)[None]


def test_latent_spectrum_is_the_power_along_time():
    x = _latent([1.0, 2.0, 0.5, 1.0])
    s = latent_spectrum_db(x)
    assert s.shape == (4, 17) and s.dtype == torch.float64
    # a cosine of amplitude a over T samples: |X_k| = a T / 2 -> 20 log10(a T / 2) dB in bin k
    for c, a in enumerate([1.0, 2.0, 0.5, 1.0]):
        assert float(s[c, c + 1]) == pytest.approx(20 * math.log10(a * 32 / 2), abs=1e-9)
    # the time axis is chosen: [1, T, C] with time_dim=1 gives the same rows
    assert torch.allclose(latent_spectrum_db(x.transpose(1, 2), time_dim=1), s)
    with pytest.raises(ValueError):
        latent_spectrum_db(torch.zeros(3, 1))
    with pytest.raises(ValueError):
        latent_spectrum_db(torch.zeros(3, 8, dtype=torch.int32))


def test_spectral_step_is_the_rms_db_difference_and_floors_the_noise():
    a = torch.tensor([[0.0, -10.0], [0.0, -10.0]], dtype=torch.float64)
    b = a + torch.tensor([[3.0, 0.0], [-3.0, 0.0]], dtype=torch.float64)
    assert spectral_step_db(a, b) == pytest.approx(math.sqrt((9 + 0 + 9 + 0) / 4))
    # below the floor (peak - floor_db) nothing counts: -200 vs -100 dB are both at the floor -57 dB
    c = torch.tensor([[3.0, -200.0]], dtype=torch.float64)
    d = torch.tensor([[3.0, -100.0]], dtype=torch.float64)
    assert spectral_step_db(c, d) == 0.0
    # floor 3 - 150 = -147 dB: -200 counts as -147, the step is 47 dB in one of two bins
    assert spectral_step_db(c, d, floor_db=150.0) == pytest.approx(math.sqrt((0 + 47 ** 2) / 2))
    with pytest.raises(ValueError):
        spectral_step_db(a, torch.zeros(3, 2, dtype=torch.float64))


def _run(scales, dtype=torch.float64, thresholds=DEFAULT_TRAJECTORY_THRESHOLDS):
    """Steps whose row 0 amplitude is scales[i]: a known dB step between consecutive estimates."""
    m = AudioTrajectoryMonitor(thresholds)
    for s in scales:
        m.observe(_latent([s, 1.0, 1.0, 1.0]).to(dtype))
    return m.report()


def _ratio_for(last_db, before_db=1.0):
    """Amplitudes whose last two steps change row 0 by before_db and last_db (RMS over 4 rows x 17 bins: one bin
    of 68 moves, so a per-bin change of d dB is an RMS of d / sqrt(68))."""
    k = math.sqrt(68)
    a1 = 1.0
    a2 = a1 * 10 ** (before_db * k / 20)
    a3 = a2 * 10 ** (last_db * k / 20)
    return [a1, a2, a3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_converging_trajectory_is_clean_in_every_dtype(dtype):
    r = _run([1.0, 1.5, 1.9, 2.0, 2.05, 2.07], dtype)
    assert r.clean and r.steps == 6 and len(r.jumps_db) == 5 and r.final_jump_ratio < 1.0


def test_final_jump_ratio_boundary_both_sides():
    th = DEFAULT_TRAJECTORY_THRESHOLDS.final_jump_ratio
    at = _run(_ratio_for(th * 0.999))
    assert at.final_jump_ratio == pytest.approx(th * 0.999, rel=1e-6) and at.clean
    above = _run(_ratio_for(th * 1.001))
    assert above.final_jump_ratio == pytest.approx(th * 1.001, rel=1e-6) and not above.clean
    assert "final spectral jump" in above.flags[0]
    # exactly at the threshold is not above (strict)
    m = AudioTrajectoryMonitor(TrajectoryThresholds(final_jump_ratio=2.0))
    m.jumps_db, m.steps = [1.0, 2.0], 3
    assert m.report().clean
    m.jumps_db = [1.0, 2.0000001]
    assert not m.report().clean


def test_stale_estimate_corrected_at_the_end_is_flagged():
    # the estimate hardly moves while a cache reuses it, then the computed last step jumps
    r = _run([1.0, 1.01, 1.02, 1.03, 3.0])
    assert not r.clean and r.final_jump_ratio > 10


def test_zero_change_before_a_change_is_an_infinite_ratio_and_no_change_is_zero():
    r = _run([1.0, 1.0, 2.0])
    assert r.final_jump_ratio == math.inf and not r.clean
    r0 = _run([1.0, 1.0, 1.0])
    assert r0.final_jump_ratio == 0.0 and r0.clean


def test_fewer_than_three_steps_have_no_ratio():
    r = _run([1.0, 5.0])
    assert r.final_jump_ratio is None and r.clean and "n/a" in r.summary()
    assert AudioTrajectoryMonitor().report().steps == 0


def test_nonfinite_estimates_are_counted_per_step_and_flagged():
    m = AudioTrajectoryMonitor()
    m.observe(_latent([1.0, 1.0, 1.0, 1.0]))
    bad = _latent([1.0, 1.0, 1.0, 1.0])
    bad[0, 1, 3] = float("nan")
    bad[0, 2, 4] = float("inf")
    m.observe(bad)
    r = m.report()
    assert r.nonfinite == 2 and r.nonfinite_steps == [1] and not r.clean and "2 NaN/Inf" in r.flags[0]


def test_non_contiguous_estimates_and_shape_changes():
    m = AudioTrajectoryMonitor(time_dim=1)
    for s in (1.0, 1.1, 1.2):
        m.observe(_latent([s, 1.0, 1.0, 1.0]).transpose(1, 2))   # [1, T, C] view: not contiguous
    assert m.report().clean and m.report().steps == 3
    with pytest.raises(ValueError):
        m.observe(torch.zeros(1, 16, 4, dtype=torch.float64))


def test_trajectory_report_dict_and_summary():
    r = _run([1.0, 1.01, 1.02, 3.0])
    d = r.as_dict()
    assert list(d) == ["clean", "flags", "steps", "nonfinite", "nonfinite_steps", "final_jump_ratio", "jumps_db",
                       "thresholds"]
    assert d["thresholds"] == {"final_jump_ratio": 3.0, "floor_db": 60.0}
    assert d["final_jump_ratio"] == round(r.final_jump_ratio, 3)
    assert r.summary().startswith("audio stream while sampling: final spectral jump")
    assert _run([1.0, 1.5, 1.7]).summary().startswith("audio stream while sampling: clean (3 steps")
