"""cache/audio_guard.py, exactly: every flag's whole text, the worst item of each check, both sides of each bound,
the spectral-jump figure against a frame-by-frame STFT written here, and the trajectory monitor's texts.

Oracles written here: means / clip fractions / RMS by plain Python sums, the Hann window as 0.5 - 0.5 cos(2 pi k / N),
numpy's rfft per frame, torch.median's lower middle value, the ratio of two given steps."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditkit.cache.audio_guard import (CHECKS, DEFAULT_THRESHOLDS, DEFAULT_TRAJECTORY_THRESHOLDS, AudioGuardThresholds,
                                      AudioTrajectoryMonitor, AudioTrajectoryReport, TrajectoryThresholds,
                                      _spectral_jump, check_waveform, latent_spectrum_db, spectral_step_db)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _tone(n, f=440.0, amp=0.3, sr=32000):
    t = torch.arange(n, dtype=torch.float64) / sr
    return amp * torch.sin(2 * math.pi * f * t)


def _jump_oracle(x, n_fft=1024, hop=256, clamp=1e-20):
    """Largest frame-to-frame step (RMS over bins of the log power floored 60 dB below the item's peak) minus the
    lower median step (torch.median of an even count is the lower middle value)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < n_fft + hop:
        return 0.0
    k = np.arange(n_fft)
    win = 0.5 - 0.5 * np.cos(2 * np.pi * k / n_fft)
    nf = (len(x) - n_fft) // hop + 1
    p = []
    for f in range(nf):
        s = np.fft.rfft(x[f * hop:f * hop + n_fft] * win)
        p.append(10.0 * np.log10(np.maximum(s.real ** 2 + s.imag ** 2, clamp)))
    p = np.array(p)
    p = np.maximum(p, p.max() - 60.0)
    steps = sorted(float(np.sqrt(np.mean((p[f + 1] - p[f]) ** 2))) for f in range(nf - 1))
    return steps[-1] - steps[(len(steps) - 1) // 2]


# ------------------------------------------------------------------------------------------------ defaults

def test_default_thresholds_are_the_documented_ones():
    th = AudioGuardThresholds()
    assert (th.dc_offset, th.clip_level, th.clipping, th.silence_dbfs, th.spectral_jump_db, th.n_fft, th.hop) == \
        (0.02, 0.999, 0.001, -60.0, 6.0, 1024, 256)
    assert DEFAULT_THRESHOLDS == th
    assert CHECKS == ("nonfinite", "dc_offset", "clipping", "silence", "spectral_jump")
    tt = TrajectoryThresholds()
    assert (tt.final_jump_ratio, tt.floor_db) == (3.0, 60.0) and DEFAULT_TRAJECTORY_THRESHOLDS == tt


# ------------------------------------------------------------------------------------------------ refusals

def test_refusal_texts():
    with pytest.raises(TypeError) as e:
        check_waveform(torch.zeros(2, 10, dtype=torch.int16))
    assert str(e.value) == "audio guard: expected a float tensor, got Tensor torch.int16"
    with pytest.raises(TypeError) as e:
        check_waveform([0.0, 1.0])
    assert str(e.value) == "audio guard: expected a float tensor, got list "
    # the shape named is the [B, C, N] view of the input
    for shape, shown in [((2, 2, 2, 4), (2, 2, 2, 4)), ((0,), (1, 1, 0)), ((3, 0), (1, 3, 0)), ((0, 8), (1, 0, 8)),
                         ((2, 3, 0), (2, 3, 0)), ((0, 2, 8), (0, 2, 8)), ((2, 0, 8), (2, 0, 8))]:
        with pytest.raises(ValueError) as e:
            check_waveform(torch.zeros(shape))
        assert str(e.value) == f"audio guard: expected [N], [C, N] or [B, C, N] with samples, got {shown}"
    with pytest.raises(ValueError) as e:
        check_waveform(torch.zeros(()))
    assert str(e.value) == "audio guard: expected [N], [C, N] or [B, C, N] with samples, got ()"


def test_smallest_accepted_shapes():
    for shape, dims in [((1,), (1, 1, 1)), ((1, 1), (1, 1, 1)), ((1, 1, 1), (1, 1, 1)), ((3, 5), (1, 3, 5)),
                        ((2, 3, 5), (2, 3, 5))]:
        r = check_waveform(torch.full(shape, 0.5))
        assert (r.items, r.channels, r.samples) == dims


# ------------------------------------------------------------------------------------------------ figures, flags

def _batch(n=4096):
    """[3, 2, n]: item 0 a quiet clean tone, item 1 a DC offset on channel 1, item 2 clipped on channel 0."""
    w = torch.zeros(3, 2, n, dtype=torch.float64)
    w[0, 0] = _tone(n, amp=0.1)
    w[0, 1] = _tone(n, f=550.0, amp=0.05)
    w[1, 0] = _tone(n, amp=0.3)
    w[1, 1] = _tone(n, amp=0.3) + 0.0625
    w[2, 0] = _tone(n, amp=0.3)
    w[2, 0, :64] = 1.0
    w[2, 0, 64:96] = -1.0
    w[2, 1] = _tone(n, f=660.0, amp=0.3)
    return w


def _py_figures(w, clip_level=0.999):
    """dc / clip / rms per (item, channel) by plain Python sums."""
    dc, clip, rms = {}, {}, {}
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            v = [float(a) for a in w[i, j]]
            dc[i, j] = abs(sum(v) / len(v))
            clip[i, j] = sum(1 for a in v if abs(a) >= clip_level) / len(v)
            rms[i, j] = math.sqrt(sum(a * a for a in v) / len(v))
    return dc, clip, rms


def test_figures_worst_items_and_flag_texts_of_a_batch():
    w = _batch()
    th = AudioGuardThresholds(dc_offset=0.05, clipping=0.01, silence_dbfs=-20.0, spectral_jump_db=100.0)
    r = check_waveform(w, th)
    dc, clip, rms = _py_figures(w)
    loud = [max(20 * math.log10(rms[i, 0]), 20 * math.log10(rms[i, 1])) for i in range(3)]
    assert r.figures["nonfinite"] == 0.0
    assert r.figures["dc_offset"] == pytest.approx(max(dc.values()), abs=1e-12)
    assert r.figures["clipping"] == pytest.approx(96 / 4096, abs=1e-15) == pytest.approx(max(clip.values()))
    assert r.figures["rms_dbfs"] == pytest.approx(min(loud), abs=1e-9)
    jumps = [[_jump_oracle(w[i, j]) for j in range(2)] for i in range(3)]
    assert r.figures["spectral_jump_db"] == pytest.approx(max(max(j) for j in jumps), abs=1e-9)
    worst_jump = max(range(3), key=lambda i: max(jumps[i]))
    assert r.worst_item == {"dc_offset": 1, "clipping": 2, "silence": 0, "spectral_jump": worst_jump}
    assert list(r.figures) == ["nonfinite", "dc_offset", "clipping", "rms_dbfs", "spectral_jump_db"]
    f = r.figures
    assert r.flags == [
        f"DC offset {f['dc_offset']:.4f} > 0.05 (item 1)",
        f"clipping {100 * f['clipping']:.2f}% of samples > 1.00% (item 2)",
        f"silent: {f['rms_dbfs']:.1f} dBFS < -20.0 dBFS (item 0)",
    ]
    assert r.flags[1] == "clipping 2.34% of samples > 1.00% (item 2)"
    assert not r.clean
    assert r.thresholds == {"dc_offset": 0.05, "clipping": 0.01, "clip_level": 0.999, "silence_dbfs": -20.0,
                            "spectral_jump_db": 100.0}
    assert (r.items, r.channels, r.samples) == (3, 2, 4096)
    assert r.summary() == "audio guard: " + "; ".join(r.flags)


def test_worst_item_is_the_last_item_and_the_first_item():
    n = 2048
    w = torch.zeros(3, 2, n, dtype=torch.float64)
    for i in range(3):
        w[i, 0] = _tone(n, amp=0.2)
        w[i, 1] = _tone(n, amp=0.2)
    w[2, 1] += 0.1                       # dc: the last item, its last channel
    w[0, 0, :10] = 1.0                   # clipping: the first item
    w[1] *= 1e-4                         # silence: the middle item (both channels quiet)
    r = check_waveform(w)
    assert r.worst_item["dc_offset"] == 2 and r.worst_item["clipping"] == 0 and r.worst_item["silence"] == 1
    assert r.figures["clipping"] == pytest.approx(10 / n)
    # the loudest channel counts per item, the quietest item is reported
    assert r.figures["rms_dbfs"] == pytest.approx(20 * math.log10(0.2e-4 / math.sqrt(2)), abs=0.05)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_flag_alone_in_every_dtype(dtype):
    n = 8192
    base = _tone(n, amp=0.25)
    # DC only
    r = check_waveform((base + 0.125).to(dtype)[None])
    dc = float((base + 0.125).to(dtype).double().mean())
    assert r.flags == [f"DC offset {dc:.4f} > 0.02 (item 0)"]
    # clipping only (a symmetric clip keeps the mean at 0)
    c = base.clone()
    c[:40] = 1.0
    c[40:80] = -1.0
    r = check_waveform(c.to(dtype))
    assert r.flags == [f"clipping {100 * 80 / n:.2f}% of samples > 0.10% (item 0)"] == ["clipping 0.98% of samples > "
                                                                                       "0.10% (item 0)"]
    # silence only, finite
    q = (base * 1e-3).to(dtype)
    r = check_waveform(q)
    rms = math.sqrt(float((q.double() ** 2).mean()))
    assert r.flags == [f"silent: {20 * math.log10(rms):.1f} dBFS < -60.0 dBFS (item 0)"]
    # digital silence: -240 dBFS from the 1e-12 floor (finite), still the dBFS text
    r = check_waveform(torch.zeros(2, n, dtype=dtype))
    assert r.figures["rms_dbfs"] == pytest.approx(-240.0)
    assert r.flags == ["silent: -240.0 dBFS < -60.0 dBFS (item 0)"]


def test_silence_floor_is_1e_12():
    r = check_waveform(torch.full((1, 64), 1e-13, dtype=torch.float64), AudioGuardThresholds(dc_offset=1.0))
    assert r.figures["rms_dbfs"] == pytest.approx(-240.0, abs=1e-9)
    r = check_waveform(torch.full((1, 64), 2e-12, dtype=torch.float64), AudioGuardThresholds(dc_offset=1.0))
    assert r.figures["rms_dbfs"] == pytest.approx(20 * math.log10(2e-12), abs=1e-9)


def test_silent_text_without_a_finite_level():
    # a threshold below the floor never flags; an infinite threshold flags every finite level with its number
    th = AudioGuardThresholds(silence_dbfs=math.inf, dc_offset=1.0)
    r = check_waveform(torch.full((1, 64), 0.5, dtype=torch.float64), th)
    assert r.flags == [f"silent: {20 * math.log10(0.5):.1f} dBFS < inf dBFS (item 0)"]


def test_nonfinite_flag_text_counts_and_figures_on_the_finite_samples():
    w = torch.zeros(2, 2, 4096, dtype=torch.float64)
    w[:, :] = _tone(4096, amp=0.3)
    w[1, 0, 5] = float("nan")
    w[1, 1, 7] = float("inf")
    w[0, 1, 9] = -float("inf")
    r = check_waveform(w)
    assert r.figures["nonfinite"] == 3.0
    assert r.flags == ["3 NaN/Inf samples"]
    z = w.clone()
    z[1, 0, 5] = z[1, 1, 7] = z[0, 1, 9] = 0.0
    rz = check_waveform(z)
    assert r.figures["dc_offset"] == rz.figures["dc_offset"] and r.figures["rms_dbfs"] == rz.figures["rms_dbfs"]
    assert r.figures["spectral_jump_db"] == rz.figures["spectral_jump_db"]


def test_boundaries_both_sides_exact():
    w = torch.full((1, 1000), 0.0625, dtype=torch.float64)
    assert check_waveform(w, AudioGuardThresholds(dc_offset=0.0625)).flags == []
    assert check_waveform(w, AudioGuardThresholds(dc_offset=0.0625 - 2 ** -30)).flags == [
        f"DC offset 0.0625 > {0.0625 - 2 ** -30} (item 0)"]
    # clip level: |x| >= clip_level counts, just below does not
    c = torch.zeros(1, 1000, dtype=torch.float64)
    c[0, :5] = 0.5
    c[0, 5:10] = -0.5
    th = AudioGuardThresholds(clip_level=0.5, clipping=0.0, dc_offset=1.0, silence_dbfs=-400.0)
    assert check_waveform(c, th).figures["clipping"] == 0.01
    th2 = AudioGuardThresholds(clip_level=0.5 + 2 ** -40, clipping=0.0, dc_offset=1.0, silence_dbfs=-400.0)
    assert check_waveform(c, th2).figures["clipping"] == 0.0 and check_waveform(c, th2).flags == []
    # clipping fraction: equal is not above
    th3 = AudioGuardThresholds(clip_level=0.5, clipping=0.01, dc_offset=1.0, silence_dbfs=-400.0)
    assert check_waveform(c, th3).flags == []
    th4 = AudioGuardThresholds(clip_level=0.5, clipping=0.0099, dc_offset=1.0, silence_dbfs=-400.0)
    assert check_waveform(c, th4).flags == ["clipping 1.00% of samples > 0.99% (item 0)"]
    # silence: equal is not below
    s = torch.full((1, 100), 0.1, dtype=torch.float64)
    assert check_waveform(s, AudioGuardThresholds(silence_dbfs=-20.0, dc_offset=1.0)).flags == []
    assert check_waveform(s, AudioGuardThresholds(silence_dbfs=-19.999, dc_offset=1.0)).flags == [
        "silent: -20.0 dBFS < -19.999 dBFS (item 0)"]


def test_spectral_jump_flag_text_and_boundary():
    torch.manual_seed(0)
    n = 16384
    w = _tone(n, amp=0.3) + 0.001 * torch.randn(n, dtype=torch.float64)
    w[8000:8040] = 0.9
    fig = _jump_oracle(w)
    r = check_waveform(w)
    assert r.figures["spectral_jump_db"] == pytest.approx(fig, abs=1e-9) and fig > 6.0
    assert r.flags == [f"spectral jump {fig:.1f} dB > 6.0 dB (item 0)"]
    at = check_waveform(w, AudioGuardThresholds(spectral_jump_db=r.figures["spectral_jump_db"]))
    assert at.flags == [] and at.clean


def test_clean_summary_text():
    n = 8192
    w = torch.stack([_tone(n, amp=0.3), _tone(n, f=330.0, amp=0.2)])
    r = check_waveform(w)
    f = r.figures
    assert r.clean and r.flags == []
    assert r.summary() == (f"audio guard: clean (1x2x{n}; dc {f['dc_offset']:.4f}, clip {f['clipping']:.4f}, "
                           f"rms {f['rms_dbfs']:.1f} dBFS, jump {f['spectral_jump_db']:.1f} dB)")
    assert r.summary().startswith("audio guard: clean (1x2x8192; dc 0.00")
    assert f"rms {20 * math.log10(0.3 / math.sqrt(2)):.1f} dBFS" in r.summary()


def test_the_input_is_not_changed_and_gradients_are_not_needed():
    w = _tone(4096)[None].clone().requires_grad_(True)
    w2 = w.detach().clone()
    check_waveform(w)
    assert torch.equal(w.detach(), w2)


# ------------------------------------------------------------------------------------------------ spectral jump

@pytest.mark.parametrize("dtype", DTYPES)
def test_spectral_jump_against_a_frame_by_frame_stft(dtype):
    torch.manual_seed(1)
    n = 20000
    w = (_tone(n, amp=0.2) + 0.02 * torch.randn(n, dtype=torch.float64)).to(dtype)
    w[11111:11200] = 0.7
    x = w.double()
    assert check_waveform(w).figures["spectral_jump_db"] == pytest.approx(_jump_oracle(x), abs=1e-9)
    assert _spectral_jump(x, DEFAULT_THRESHOLDS) == pytest.approx(_jump_oracle(x), abs=1e-9)


def test_spectral_jump_other_frame_sizes_and_non_contiguous():
    torch.manual_seed(2)
    n = 6000
    x = _tone(n, amp=0.2) + 0.05 * torch.randn(n, dtype=torch.float64)
    x[3000:3050] = 0.8
    th = AudioGuardThresholds(n_fft=256, hop=100)
    assert _spectral_jump(x, th) == pytest.approx(_jump_oracle(x, 256, 100), abs=1e-9)
    both = torch.stack([x, -x], dim=1)          # [n, 2]: column 0 is a strided view
    assert _spectral_jump(both[:, 0], th) == pytest.approx(_jump_oracle(x, 256, 100), abs=1e-9)
    r = check_waveform(both.T, th)              # [2, n] non-contiguous
    assert r.figures["spectral_jump_db"] == pytest.approx(_jump_oracle(x, 256, 100), abs=1e-9)


def test_spectral_jump_length_boundary():
    th = AudioGuardThresholds(n_fft=64, hop=16)
    torch.manual_seed(3)
    x = torch.randn(200, dtype=torch.float64)
    assert _spectral_jump(x[:79], th) == 0.0                      # one frame: no step
    assert _spectral_jump(x[:80], th) == 0.0                      # two frames: one step, max == median
    v = _spectral_jump(x[:96], th)                                # three frames
    assert v == pytest.approx(_jump_oracle(x[:96], 64, 16), abs=1e-9) and v > 0
    for m in (81, 95, 97, 143, 200):
        assert _spectral_jump(x[:m], th) == pytest.approx(_jump_oracle(x[:m], 64, 16), abs=1e-9)


def test_spectral_jump_power_floor_is_1e_20():
    # a tone far below -140 dB after silence: the floor 60 dB under its peak is under the 1e-20 clamp (-200 dB)
    n = 4096
    x = torch.zeros(n, dtype=torch.float64)
    x[2048:] = _tone(2048, amp=1e-11)
    th = AudioGuardThresholds(n_fft=256, hop=64)
    assert _spectral_jump(x, th) == pytest.approx(_jump_oracle(x, 256, 64), abs=1e-9)
    assert abs(_jump_oracle(x, 256, 64) - _jump_oracle(x, 256, 64, clamp=1e-19)) > 0.5   # the clamp matters here


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_spectral_jump_chunks_give_the_oracle(chunk):
    torch.manual_seed(4)
    x = torch.randn(2000, dtype=torch.float64)
    x[1000:1030] = 5.0
    th = AudioGuardThresholds(n_fft=128, hop=64)
    assert _spectral_jump(x, th, chunk_frames=chunk) == pytest.approx(_jump_oracle(x, 128, 64), abs=1e-9)


def test_spectral_jump_default_chunk_over_a_long_track():
    """More than 2048 frames: the default chunk boundary is crossed; a pop just past it is seen."""
    torch.manual_seed(5)
    th = AudioGuardThresholds(n_fft=64, hop=16)
    n = 64 + 16 * 2100
    x = 0.1 * torch.randn(n, dtype=torch.float64)
    x[16 * 2049:16 * 2049 + 8] = 3.0
    assert _spectral_jump(x, th) == pytest.approx(_jump_oracle(x, 64, 16), abs=1e-9)


# ------------------------------------------------------------------------------------------------ trajectory

def test_latent_spectrum_refusals_exact():
    with pytest.raises(ValueError) as e:
        latent_spectrum_db(torch.zeros(3, 1))
    assert str(e.value) == ("audio latent spectrum: expected a float tensor with >= 2 time positions on axis -1, "
                            "got torch.float32 (3, 1)")
    with pytest.raises(ValueError) as e:
        latent_spectrum_db(torch.zeros(3, 8, dtype=torch.int32), time_dim=0)
    assert str(e.value) == ("audio latent spectrum: expected a float tensor with >= 2 time positions on axis 0, "
                            "got torch.int32 (3, 8)")
    with pytest.raises(ValueError) as e:
        latent_spectrum_db([1.0, 2.0])
    assert str(e.value) == ("audio latent spectrum: expected a float tensor with >= 2 time positions on axis -1, "
                            "got list ()")
    with pytest.raises(ValueError) as e:
        latent_spectrum_db(torch.tensor(1.0))
    assert str(e.value) == ("audio latent spectrum: expected a float tensor with >= 2 time positions on axis -1, "
                            "got torch.float32 ()")
    # 2 positions is enough, on the axis asked
    assert latent_spectrum_db(torch.ones(2)).shape == (1, 2)
    assert latent_spectrum_db(torch.ones(2, 1), time_dim=0).shape == (1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_spectrum_values_floor_and_nonfinite(dtype):
    x = torch.tensor([[1.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    s = latent_spectrum_db(x)
    # row 0: a cosine at bin 1 of 4 samples: X_1 = 2 -> 10 log10(4); bins 0 and 2 are 0 -> the 1e-30 floor
    assert s.dtype == torch.float64 and s.shape == (2, 3)
    assert s[0].tolist() == pytest.approx([-300.0, 10 * math.log10(4.0), -300.0], abs=1e-9)
    assert s[1].tolist() == [-300.0, -300.0, -300.0]
    y = x.clone()
    y[1, 2] = float("nan")
    y[1, 3] = float("inf")
    assert torch.equal(latent_spectrum_db(y), s)
    # [C, T, B] with time_dim=1 (a strided view): the rows follow the other axes' order
    z = torch.stack([x, 2 * x], dim=-1)        # [2, 4, 2]
    got = latent_spectrum_db(z, time_dim=1)
    assert got.shape == (4, 3)
    assert torch.allclose(got[0], s[0]) and torch.allclose(got[1], s[0] + 20 * math.log10(2) * (s[0] > -300))


def test_spectral_step_exact():
    a = torch.tensor([[0.0, -10.0], [0.0, -10.0]], dtype=torch.float64)
    b = a + torch.tensor([[3.0, 0.0], [-3.0, 4.0]], dtype=torch.float64)
    assert spectral_step_db(a, b) == pytest.approx(math.sqrt((9 + 0 + 9 + 16) / 4), abs=1e-12)
    with pytest.raises(ValueError) as e:
        spectral_step_db(a, torch.zeros(3, 2, dtype=torch.float64))
    assert str(e.value) == "spectral step: shapes differ (2, 2) vs (3, 2)"
    # the floor is taken under the pair's peak: the peak of cur (10) here, default 60 dB
    c = torch.tensor([[0.0, -55.0]], dtype=torch.float64)
    d = torch.tensor([[10.0, -58.0]], dtype=torch.float64)
    assert spectral_step_db(c, d) == pytest.approx(math.sqrt(100 / 2), abs=1e-12)   # -55, -58 -> the floor -50
    assert spectral_step_db(d, c) == pytest.approx(math.sqrt(100 / 2), abs=1e-12)
    # exactly at the floor: not clamped further
    e1 = torch.tensor([[0.0, -60.0]], dtype=torch.float64)
    e2 = torch.tensor([[0.0, -61.0]], dtype=torch.float64)
    assert spectral_step_db(e1, e2) == 0.0
    assert spectral_step_db(e1, e2, floor_db=61.0) == pytest.approx(math.sqrt(1 / 2), abs=1e-12)


def _lat(a, t=16):
    n = torch.arange(t, dtype=torch.float64)
    return torch.stack([a * torch.cos(2 * math.pi * n / t), torch.cos(4 * math.pi * n / t)])[None]


def test_monitor_steps_jumps_and_floor_from_its_thresholds():
    m = AudioTrajectoryMonitor(TrajectoryThresholds(floor_db=5.0))
    xs = [_lat(1.0), _lat(2.0), _lat(8.0)]
    for x in xs:
        m.observe(x)
    specs = [latent_spectrum_db(x) for x in xs]
    assert m.jumps_db == [spectral_step_db(specs[0], specs[1], 5.0), spectral_step_db(specs[1], specs[2], 5.0)]
    assert m.jumps_db != [spectral_step_db(specs[0], specs[1]), spectral_step_db(specs[1], specs[2])]
    assert m.steps == 3 and m.nonfinite == 0 and m.nonfinite_steps == []
    r = m.report()
    assert r.final_jump_ratio == m.jumps_db[1] / m.jumps_db[0]
    assert r.thresholds == {"final_jump_ratio": 3.0, "floor_db": 5.0}


def test_monitor_time_dim():
    m = AudioTrajectoryMonitor(time_dim=0)
    assert m.time_dim == 0 and m.thresholds is DEFAULT_TRAJECTORY_THRESHOLDS
    m.observe(torch.ones(4, 3))
    assert m._prev.shape == (3, 3)          # 3 rows (the other axis), 4 // 2 + 1 bins
    assert AudioTrajectoryMonitor().time_dim == -1


def test_monitor_shape_change_text_and_nonfinite_steps_text():
    m = AudioTrajectoryMonitor()
    for i in range(7):
        x = _lat(1.0 + 0.01 * i)
        if i != 2:
            x[0, 0, 0] = float("nan")
        m.observe(x)
    assert m.nonfinite == 6 and m.nonfinite_steps == [0, 1, 3, 4, 5, 6]
    r = m.report()
    assert r.flags[0] == "6 NaN/Inf values in the audio estimate (steps [0, 1, 3, 4, 5])"
    assert r.nonfinite_steps == [0, 1, 3, 4, 5, 6] and r.nonfinite_steps is not m.nonfinite_steps
    assert r.jumps_db == m.jumps_db and r.jumps_db is not m.jumps_db
    with pytest.raises(ValueError) as e:
        m.observe(_lat(1.0, t=8))
    assert str(e.value) == "audio trajectory: the audio latent changed shape at step 7"
    assert m.steps == 7


def test_monitor_ratio_rules_and_final_jump_text():
    m = AudioTrajectoryMonitor()
    m.steps = 3
    m.jumps_db = [2.0, 7.0]
    r = m.report()
    assert r.final_jump_ratio == 3.5
    assert r.flags == ["final spectral jump 7.00 dB = 3.5x the step before > 3x (a stale audio estimate corrected at "
                       "the last step)"]
    assert r.summary() == "audio stream while sampling: " + r.flags[0]
    m.jumps_db = [5.0, 0.0, 1.0]       # the last two count; a zero step before a change is infinite
    assert m.report().final_jump_ratio == math.inf and not m.report().clean
    m.jumps_db = [5.0, 0.0, 0.0]
    assert m.report().final_jump_ratio == 0.0 and m.report().clean
    m.jumps_db = [1.0, 3.0]            # exactly at the threshold: clean
    assert m.report().clean and m.report().final_jump_ratio == 3.0
    m.jumps_db = [1.0, 3.0000001]
    assert not m.report().clean
    m.jumps_db = [4.0]                 # one step: no ratio
    assert m.report().final_jump_ratio is None and m.report().clean
    m2 = AudioTrajectoryMonitor(TrajectoryThresholds(final_jump_ratio=2.5))
    m2.jumps_db = [1.0, 2.6]
    assert m2.report().flags == ["final spectral jump 2.60 dB = 2.6x the step before > 2.5x (a stale audio estimate "
                                 "corrected at the last step)"]


def test_trajectory_report_texts_and_dict():
    m = AudioTrajectoryMonitor()
    m.steps, m.jumps_db = 4, [1.0, 1.23456, 1.5]
    r = m.report()
    assert r.summary() == "audio stream while sampling: clean (4 steps, final spectral jump ratio 1.22)"
    d = r.as_dict()
    assert d == {"clean": True, "flags": [], "steps": 4, "nonfinite": 0, "nonfinite_steps": [],
                 "final_jump_ratio": round(1.5 / 1.23456, 3), "jumps_db": [1.0, 1.235, 1.5],
                 "thresholds": {"final_jump_ratio": 3.0, "floor_db": 60.0}}
    m.jumps_db = [1.0]
    r = m.report()
    assert r.summary() == "audio stream while sampling: clean (4 steps, final spectral jump ratio n/a (< 3 steps))"
    assert r.as_dict()["final_jump_ratio"] is None
    both = AudioTrajectoryReport(clean=False, flags=["a", "b"], steps=1, nonfinite=1, nonfinite_steps=[0], jumps_db=[],
                                 final_jump_ratio=None, thresholds={})
    assert both.summary() == "audio stream while sampling: a; b"


# ------------------------------------------------------------------------------------------------ survivors (round 2)

def test_spectral_jump_peak_includes_the_first_frame():
    """The loudest frame is frame 0 (a burst in the samples no later frame covers): the floor hangs from its peak."""
    torch.manual_seed(6)
    th = AudioGuardThresholds(n_fft=128, hop=32)
    x = 1e-3 * torch.randn(2000, dtype=torch.float64)
    x[:32] = 50.0 * torch.randn(32, dtype=torch.float64)
    got = _spectral_jump(x, th)
    assert got == pytest.approx(_jump_oracle(x, 128, 32), abs=1e-9)
    # the premise: without frame 0 in the peak the figure differs
    assert abs(_jump_oracle(x, 128, 32) - _jump_oracle(torch.cat([x[:32] * 0, x[32:]]), 128, 32)) > 1e-3
    assert _spectral_jump(x, th, chunk_frames=4) == pytest.approx(got, abs=1e-9)


def test_spectral_jump_memory_bound_reads_chunk_frames_at_a_time(monkeypatch):
    """Every FFT call takes at most chunk_frames frames (the peak pass) or chunk_frames + 1 (the step pass, which
    repeats the previous chunk's last frame): memory stays bounded for a long track."""
    calls = []
    real = torch.fft.rfft

    def spy(t, *a, **k):
        calls.append(t.shape[0])
        return real(t, *a, **k)

    monkeypatch.setattr(torch.fft, "rfft", spy)
    th = AudioGuardThresholds(n_fft=16, hop=4)
    nf = 2048 + 100
    x = torch.randn(16 + 4 * (nf - 1), dtype=torch.float64)
    _spectral_jump(x, th)                            # the default chunk: 2048 frames
    assert calls == [2048, 100, 2049, 100]
    calls.clear()
    _spectral_jump(x[:16 + 4 * 9], th, chunk_frames=3)    # 10 frames
    assert calls == [3, 3, 3, 1, 4, 4, 4]


def test_the_guard_reads_on_the_host():
    """The figures are computed on a float64 host copy (a tensor without data cannot be copied out: refused there,
    before any device-side arithmetic)."""
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        check_waveform(torch.zeros(1, 2000, device="meta"))
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        latent_spectrum_db(torch.zeros(2, 8, device="meta"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_spectrum_of_a_sine_counts_the_imaginary_part(dtype):
    # a sine of amplitude a at bin k over T samples: X_k = -i a T / 2 (purely imaginary) -> 20 log10(a T / 2)
    t = 16
    n = torch.arange(t, dtype=torch.float64)
    x = torch.stack([0.5 * torch.sin(2 * math.pi * 3 * n / t), 2.0 * torch.sin(2 * math.pi * 5 * n / t)]).to(dtype)
    s = latent_spectrum_db(x)
    assert float(s[0, 3]) == pytest.approx(20 * math.log10(0.5 * t / 2), abs=0.05)
    assert float(s[1, 5]) == pytest.approx(20 * math.log10(2.0 * t / 2), abs=0.05)
    # and a phase-shifted cosine: power split between real and imaginary parts, the same total
    y = torch.cos(2 * math.pi * 2 * n / t + 0.7)[None]
    assert float(latent_spectrum_db(y)[0, 2]) == pytest.approx(20 * math.log10(t / 2), abs=1e-9)


def test_final_jump_text_names_the_last_step():
    m = AudioTrajectoryMonitor()
    m.jumps_db = [9.0, 0.5, 2.0]
    assert m.report().flags == ["final spectral jump 2.00 dB = 4.0x the step before > 3x (a stale audio estimate "
                                "corrected at the last step)"]
