"""Quality metrics for the lab (plain torch, float64 internally).

* :func:`psnr` — peak signal-to-noise ratio in dB for images/videos in ``[0, data_range]``.
* :func:`psnr_offset_free` — PSNR after removing each channel's mean difference (a global colour offset): the
  structural part of the error. For ``[C, H, W]`` images (or ``[..., C, H, W]``, per leading index).
* :func:`ssim` — structural similarity (Wang et al. 2004): 11x11 Gaussian window (sigma 1.5), K1 = 0.01,
  K2 = 0.03, 'valid' windows only, averaged over channels and frames. Inputs ``[..., C, H, W]`` or ``[H, W]``.
* :func:`log_spectral_distance` — LSD in dB between two waveforms: per STFT frame
  ``sqrt(mean_f (10 log10(P_ref / P_est))^2)``, averaged over frames (and channels), power floored at
  ``eps`` so silence does not blow up.
* :func:`snr` — signal-to-noise ratio in dB of ``est`` against ``ref``.
"""
from __future__ import annotations

import math

import torch


def psnr(ref: torch.Tensor, est: torch.Tensor, data_range: float = 1.0) -> float:
    if ref.shape != est.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(est.shape)}")
    mse = torch.mean((ref.double() - est.double()) ** 2).item()
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(data_range ** 2 / mse)


def psnr_offset_free(ref: torch.Tensor, est: torch.Tensor, data_range: float = 1.0) -> float:
    if ref.shape != est.shape or ref.dim() < 3:
        raise ValueError(f"need two [..., C, H, W] tensors of one shape, got {tuple(ref.shape)} vs {tuple(est.shape)}")
    r, e = ref.double(), est.double()
    e = e - e.mean(dim=(-2, -1), keepdim=True) + r.mean(dim=(-2, -1), keepdim=True)
    return psnr(r, e, data_range)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(ref: torch.Tensor, est: torch.Tensor, data_range: float = 1.0, win_size: int = 11,
         sigma: float = 1.5) -> float:
    """Mean SSIM over all 'valid' window positions, channels and leading dims."""
    if ref.shape != est.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(est.shape)}")
    if ref.ndim < 2:
        raise ValueError("ssim needs at least [H, W]")
    H, W = ref.shape[-2:]
    if H < win_size or W < win_size:
        raise ValueError(f"images {H}x{W} are smaller than the {win_size}x{win_size} SSIM window")
    x = ref.double().reshape(-1, 1, H, W)
    y = est.double().reshape(-1, 1, H, W)
    w = _gaussian_window(win_size, sigma)[None, None]
    conv = torch.nn.functional.conv2d
    mx, my = conv(x, w), conv(y, w)
    sxx = conv(x * x, w) - mx * mx
    syy = conv(y * y, w) - my * my
    sxy = conv(x * y, w) - mx * my
    c1 = (0.01 * data_range) ** 2
    c2 = (0.03 * data_range) ** 2
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return s.mean().item()


def _power_spectrogram(wave: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    x = wave.double().reshape(-1, wave.shape[-1])
    if x.shape[-1] < n_fft:
        x = torch.nn.functional.pad(x, (0, n_fft - x.shape[-1]))
    frames = x.unfold(-1, n_fft, hop)  # [C, T, n_fft]
    win = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    spec = torch.fft.rfft(frames * win, dim=-1)
    return spec.real ** 2 + spec.imag ** 2


def log_spectral_distance(ref: torch.Tensor, est: torch.Tensor, n_fft: int = 1024, hop: int = 256,
                          eps: float = 1e-8) -> float:
    if ref.shape != est.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(est.shape)}")
    p = _power_spectrogram(ref, n_fft, hop).clamp(min=eps)
    q = _power_spectrogram(est, n_fft, hop).clamp(min=eps)
    d = 10.0 * torch.log10(p / q)
    return torch.sqrt((d ** 2).mean(-1)).mean().item()


def snr(ref: torch.Tensor, est: torch.Tensor) -> float:
    if ref.shape != est.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(est.shape)}")
    num = torch.sum(ref.double() ** 2).item()
    den = torch.sum((ref.double() - est.double()) ** 2).item()
    if den == 0.0:
        return math.inf
    if num == 0.0:
        return -math.inf
    return 10.0 * math.log10(num / den)


def paired_gain_ci(a: list[float], b: list[float], groups: list[int], n_boot: int = 2000, level: float = 0.95,
                   seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a[i] - b[i]`` and its ``level`` confidence interval from a cluster bootstrap.

    Items sharing a ``groups`` value (frames of one clip) are resampled together, since their differences are
    correlated; returns ``(mean, low, high)`` with the percentile interval of the resampled means.
    """
    if not (len(a) == len(b) == len(groups)) or not a:
        raise ValueError(f"need equal, non-empty lists (got {len(a)}, {len(b)}, {len(groups)})")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ids = sorted(set(groups))
    per = {g: [] for g in ids}
    for x, y, g in zip(a, b, groups):
        per[g].append(float(x) - float(y))
    sums = torch.tensor([sum(per[g]) for g in ids], dtype=torch.float64)
    counts = torch.tensor([len(per[g]) for g in ids], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(ids), (n_boot, len(ids)), generator=gen)
    means = (sums[pick].sum(1) / counts[pick].sum(1)).sort().values
    lo = means[int(math.floor((1 - level) / 2 * (n_boot - 1)))].item()
    hi = means[int(math.ceil((1 + level) / 2 * (n_boot - 1)))].item()
    return float(sums.sum() / counts.sum()), lo, hi


def audio_ssim(ref: torch.Tensor, est: torch.Tensor, n_fft: int = 256, hop: int = 64, range_db: float = 80.0) -> float:
    """SSIM of the log-power spectrograms (dB, clipped to ``range_db`` below the reference's peak, scaled to [0, 1]
    by the reference's range) of two waveforms ``[..., T]``; channels are averaged like SSIM's channels."""
    if ref.shape != est.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(est.shape)}")
    p = 10.0 * torch.log10(_power_spectrogram(ref, n_fft, hop).clamp(min=1e-12))
    q = 10.0 * torch.log10(_power_spectrogram(est, n_fft, hop).clamp(min=1e-12))
    top = p.amax()
    lo = top - range_db
    p = ((p.clamp(lo, top) - lo) / range_db).transpose(-1, -2)  # [C, F, T]
    q = ((q.clamp(lo, top) - lo) / range_db).transpose(-1, -2)
    return ssim(p, q)
