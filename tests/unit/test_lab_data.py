"""Procedural lab data: determinism, H3 geometry, audio tied to motion, codec, prompt read-back."""
import math

import pytest
import torch

from benchmarks.lab import lab_data as D
from benchmarks.lab.lab_metrics import log_spectral_distance


def test_clip_is_deterministic_and_seed_dependent():
    a, b, c = D.make_clip(5), D.make_clip(5), D.make_clip(6)
    assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio) and a.prompt == b.prompt
    assert not torch.equal(a.video, c.video)


def test_clip_geometry_matches_h3_contracts():
    c = D.make_clip(1, frames=22, height=64, width=96)
    assert c.video.shape == (3, 22, 64, 96)
    assert float(c.video.min()) >= -1 and float(c.video.max()) <= 1
    # 22 frames at 24 fps -> round(22/24*40) = 37 audio latents of 800 samples at 32 kHz
    assert D.audio_latent_frames(22) == 37 == round(22 / 24 * 40)
    assert c.audio.shape == (2, 37 * 800)
    assert D.audio_latent_frames(124) == 207  # h3.md table
    with pytest.raises(ValueError, match="17k\\+5"):
        D.make_clip(1, frames=20)
    with pytest.raises(ValueError, match="multiples of 16"):
        D.make_clip(1, height=60)


def test_tokenize_and_vocab():
    ids = D.tokenize("red circle left")
    assert ids.tolist() == [D.VOCAB.index("red"), D.VOCAB.index("circle"), D.VOCAB.index("left")]
    assert D.tokenize("blue").tolist() == [D.VOCAB.index("blue"), 0, 0]
    with pytest.raises(ValueError, match="purple"):
        D.tokenize("purple circle")
    c = D.make_clip(3, prompt="green square up")
    assert c.prompt == "green square up" and c.spec.shape == "square"


def _dominant_freq(x, sr=D.SAMPLE_RATE):
    spec = torch.fft.rfft(x.double() * torch.hann_window(x.shape[-1], dtype=torch.float64)).abs()
    return float(spec.argmax()) * sr / x.shape[-1]


def test_audio_pitch_follows_height_and_pan_follows_x():
    up = D.make_clip(11, prompt="red circle up")
    # circle: pure sine at 220 * 4**(1 - y); rising shape -> rising pitch
    n = up.audio.shape[1]
    f_start = _dominant_freq(up.audio[0, : n // 4] + up.audio[1, : n // 4])
    f_end = _dominant_freq(up.audio[0, -n // 4:] + up.audio[1, -n // 4:])
    assert f_end > f_start * 1.1
    # independent oracle: the expected pitch at the middle of the first quarter from the trajectory
    t_mid = torch.tensor([(n // 8) / D.SAMPLE_RATE])
    _, y, _, _ = D.trajectory(up.spec, t_mid)
    expect = 220.0 * 4 ** (1 - float(y))
    assert abs(f_start - expect) < 0.08 * expect
    right = D.make_clip(12, prompt="blue circle right")
    e_l0 = right.audio[0, : n // 4].pow(2).sum()
    e_r0 = right.audio[1, : n // 4].pow(2).sum()
    e_l1 = right.audio[0, -n // 4:].pow(2).sum()
    e_r1 = right.audio[1, -n // 4:].pow(2).sum()
    assert float(e_r1 / e_l1) > float(e_r0 / e_l0)  # moving right pans right


def test_video_shape_colour_at_centre():
    c = D.make_clip(21, prompt="yellow square down")
    x, y, _, col = D.trajectory(c.spec, torch.tensor([0.0]))
    px = (c.video[:, 0, int(float(y) * 64), int(float(x) * 96)] + 1) / 2
    assert torch.allclose(px, col[0], atol=0.05)


def test_audio_codec_round_trip_on_band_centre_tone():
    fc = float(D.band_centres()[12])
    t = torch.arange(37 * 800, dtype=torch.float64) / D.SAMPLE_RATE
    tone = (0.3 * torch.sin(2 * math.pi * fc * t)).float()
    wave = torch.stack([tone, 0.5 * tone])
    lat = D.audio_encode(wave)
    assert lat.shape == (1, 32, 2, 37)
    assert int(lat[0, :, 0, 10].argmax()) == 12
    rec = D.audio_decode(lat)
    assert rec.shape == wave.shape
    # amplitude recovered within 15 %, and the spectrum is close (interior frames, away from the edges)
    mid = slice(4000, 25000)
    assert float(rec[0, mid].abs().max()) == pytest.approx(0.3, rel=0.15)
    assert float(rec[1, mid].abs().max()) == pytest.approx(0.15, rel=0.15)
    noise = torch.randn(wave.shape, generator=torch.Generator().manual_seed(0)) * 0.3
    assert log_spectral_distance(wave[:, mid], rec[:, mid]) < log_spectral_distance(wave[:, mid], noise[:, mid])


def test_describe_video_reads_back_prompts():
    ok_c = ok_d = 0
    n = 16
    for s in range(n):
        c = D.make_clip(100 + s)
        colour, direction = D.describe_video((c.video + 1) / 2)
        ok_c += colour == c.spec.colour
        ok_d += direction == c.spec.direction
    assert ok_c >= n - 1 and ok_d >= n - 1
    assert D.describe_video(torch.full((3, 22, 64, 96), 0.5)) == (None, None)
