"""Lab metrics against independent numpy re-computations (explicit loops, no shared code)."""
import math

import numpy as np
import pytest
import torch

from benchmarks.lab.lab_metrics import log_spectral_distance, psnr, psnr_offset_free, snr, ssim


def _np_ssim(a, b, data_range=1.0, size=11, sigma=1.5):
    # explicit per-window weighted statistics (Wang et al. 2004), valid windows only
    r = np.arange(size) - (size - 1) / 2
    g1 = np.exp(-r ** 2 / (2 * sigma ** 2))
    w = np.outer(g1, g1)
    w /= w.sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    H, W = a.shape
    vals = []
    for i in range(H - size + 1):
        for j in range(W - size + 1):
            pa = a[i:i + size, j:j + size]
            pb = b[i:i + size, j:j + size]
            ma, mb = (w * pa).sum(), (w * pb).sum()
            va = (w * (pa - ma) ** 2).sum()
            vb = (w * (pb - mb) ** 2).sum()
            cov = (w * (pa - ma) * (pb - mb)).sum()
            vals.append(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2)))
    return float(np.mean(vals))


def test_psnr_offset_free_ignores_a_per_channel_offset_only():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(3, 12, 20, generator=g)
    noise = 0.04 * torch.randn(3, 12, 20, generator=g)
    shifted = a + torch.tensor([0.2, -0.1, 0.05]).view(3, 1, 1)
    assert psnr_offset_free(a, shifted) > 120  # a pure per-channel offset is no structural error (fp32 rounding)
    assert psnr(a, shifted) < 20
    # independent numpy: remove each channel's mean difference, then the PSNR formula
    an, bn = a.numpy().astype(np.float64), (shifted + noise).numpy().astype(np.float64)
    for c in range(3):
        bn[c] = bn[c] - bn[c].mean() + an[c].mean()
    expect = 10 * np.log10(1.0 / np.mean((an - bn) ** 2))
    assert psnr_offset_free(a, shifted + noise) == pytest.approx(expect, abs=1e-9)
    with pytest.raises(ValueError):
        psnr_offset_free(a[0], a[0])


def test_psnr_matches_formula():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 16, 16, generator=g)
    b = (a + 0.05 * torch.randn(3, 16, 16, generator=g)).clamp(0, 1)
    an, bn = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
    expect = 10 * np.log10(1.0 / np.mean((an - bn) ** 2))
    assert psnr(a, b) == pytest.approx(expect, abs=1e-9)
    assert psnr(a * 255, b * 255, data_range=255.0) == pytest.approx(expect, abs=1e-4)
    assert psnr(a, a) == math.inf


@pytest.mark.parametrize("noise", [0.02, 0.2])
def test_ssim_matches_explicit_windows(noise):
    g = torch.Generator().manual_seed(1)
    a = torch.rand(20, 23, generator=g)
    b = (a + noise * torch.randn(20, 23, generator=g)).clamp(0, 1)
    expect = _np_ssim(a.numpy().astype(np.float64), b.numpy().astype(np.float64))
    assert ssim(a, b) == pytest.approx(expect, abs=1e-9)


def test_ssim_averages_channels_and_frames():
    g = torch.Generator().manual_seed(2)
    a = torch.rand(2, 3, 14, 15, generator=g)
    b = (a + 0.1 * torch.randn(2, 3, 14, 15, generator=g)).clamp(0, 1)
    per = [_np_ssim(a[i, c].numpy().astype(np.float64), b[i, c].numpy().astype(np.float64))
           for i in range(2) for c in range(3)]
    assert ssim(a, b) == pytest.approx(float(np.mean(per)), abs=1e-9)
    assert ssim(a, a) == pytest.approx(1.0, abs=1e-12)


def test_ssim_rejects_small_images():
    with pytest.raises(ValueError, match="smaller"):
        ssim(torch.zeros(8, 8), torch.zeros(8, 8))


def _np_lsd(x, y, n_fft, hop, eps=1e-8):
    win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    out = []
    for c in range(x.shape[0]):
        for s in range(0, x.shape[1] - n_fft + 1, hop):
            px = np.abs(np.fft.rfft(x[c, s:s + n_fft] * win)) ** 2
            py = np.abs(np.fft.rfft(y[c, s:s + n_fft] * win)) ** 2
            d = 10 * np.log10(np.maximum(px, eps) / np.maximum(py, eps))
            out.append(np.sqrt(np.mean(d ** 2)))
    return float(np.mean(out))


def test_lsd_matches_numpy_stft():
    g = torch.Generator().manual_seed(3)
    t = torch.arange(4096, dtype=torch.float64) / 32000
    x = torch.stack([torch.sin(2 * math.pi * 440 * t), 0.5 * torch.sin(2 * math.pi * 660 * t)]).float()
    y = x + 0.01 * torch.randn(x.shape, generator=g)
    expect = _np_lsd(x.numpy().astype(np.float64), y.numpy().astype(np.float64), 512, 128)
    assert log_spectral_distance(x, y, n_fft=512, hop=128) == pytest.approx(expect, rel=1e-9)
    assert log_spectral_distance(x, x, n_fft=512, hop=128) == 0.0


def test_lsd_grows_with_spectral_change():
    t = torch.arange(8192, dtype=torch.float64) / 32000
    x = torch.sin(2 * math.pi * 440 * t)[None].float()
    near = torch.sin(2 * math.pi * 445 * t)[None].float()
    far = torch.sin(2 * math.pi * 1500 * t)[None].float()
    assert log_spectral_distance(x, near) < log_spectral_distance(x, far)


def test_snr_matches_formula():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1000, generator=g)
    n = 0.1 * torch.randn(2, 1000, generator=g)
    xn, nn_ = x.numpy().astype(np.float64), n.numpy().astype(np.float64)
    expect = 10 * np.log10((xn ** 2).sum() / (nn_ ** 2).sum())
    assert snr(x, x + n) == pytest.approx(expect, abs=1e-6)
    assert snr(x, x) == math.inf


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        psnr(torch.zeros(2, 2), torch.zeros(2, 3))


def test_paired_gain_ci_mean_and_interval():
    from benchmarks.lab.lab_metrics import paired_gain_ci

    # 3 frames per clip, 20 clips; the gain is 1.0 plus a per-clip effect and frame noise
    g = np.random.default_rng(3)
    clip_eff = g.normal(0, 0.5, 20)
    groups = [c for c in range(20) for _ in range(3)]
    b = list(g.normal(17, 1, 60))
    a = [b[i] + 1.0 + clip_eff[groups[i]] + g.normal(0, 0.2) for i in range(60)]
    mean, lo, hi = paired_gain_ci(a, b, groups, n_boot=4000, seed=1)
    assert mean == pytest.approx(np.mean(np.array(a) - np.array(b)), abs=1e-12)
    assert lo < mean < hi
    # the clip-level standard error (not the frame-level one) sets the width: about 2 x 1.96 x sd(clip means)/sqrt(20)
    d = (np.array(a) - np.array(b)).reshape(20, 3).mean(1)
    se = d.std(ddof=1) / np.sqrt(20)
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.25)
    # no difference at all: a zero-width interval at 0; a sign flip mirrors the interval
    assert paired_gain_ci(b, b, groups) == (0.0, 0.0, 0.0)
    m2, lo2, hi2 = paired_gain_ci(b, a, groups, n_boot=4000, seed=1)
    assert m2 == pytest.approx(-mean) and lo2 == pytest.approx(-hi, abs=0.05) and hi2 == pytest.approx(-lo, abs=0.05)
    with pytest.raises(ValueError):
        paired_gain_ci([1.0], [1.0, 2.0], [0, 0])
    with pytest.raises(ValueError):
        paired_gain_ci([1.0], [1.0], [0], level=1.0)
