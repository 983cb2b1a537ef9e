"""Audio guard (plain torch): checks a decoded waveform for the faults users report (NaN/Inf, DC offset, clipping,
silence, pops / spectral jumps between consecutive STFT frames) and says which figure crossed which threshold.

:func:`check_waveform` takes ``[N]``, ``[C, N]`` or ``[B, C, N]`` in any float dtype (values in full-scale units,
+-1.0 = 0 dBFS) and returns an :class:`AudioGuardReport` (``flags`` empty = clean). The checks, per batch item and
channel, worst case reported:

* ``nonfinite``: count of NaN / Inf samples (any is a fault; the other checks run on the finite samples);
* ``dc_offset``: ``|mean|`` of the channel (full-scale units);
* ``clipping``: fraction of samples with ``|x| >= clip_level``;
* ``silence``: RMS of the loudest channel in dBFS below ``silence_dbfs`` (the whole item is silent);
* ``spectral_jump``: the largest step between consecutive STFT frames (``n_fft`` 1024, hop 256, Hann) of the
  log-power spectrum, RMS over frequency bins within 60 dB of the item's peak, in dB, minus the median step of the
  item (a pop, a splice or a cache reusing a stale audio estimate shows as one frame unlike its neighbours).

During sampling, :class:`AudioTrajectoryMonitor` checks the audio stream itself: per step the sampler's denoised
audio estimate, its NaN / Inf values and the step-to-step spectral jump (the last step's jump over the step before:
a stale audio estimate corrected at the end). Every cache and schedule node of the pack runs it
(``bridge/audio_watch.py``) and reports it on its own node.

Thresholds (:data:`DEFAULT_THRESHOLDS`, :data:`DEFAULT_TRAJECTORY_THRESHOLDS`) with their provenance: ``benchmarks/lab/audio_guard_lab.py`` (figures in
``docs/stepcache.md``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..report import Report

CHECKS = ("nonfinite", "dc_offset", "clipping", "silence", "spectral_jump")


@dataclass(frozen=True)
class AudioGuardThresholds:
    dc_offset: float = 0.02          # |mean| full scale (-34 dBFS)
    clip_level: float = 0.999
    clipping: float = 0.001          # fraction of samples at or above clip_level
    silence_dbfs: float = -60.0
    spectral_jump_db: float = 6.0    # largest frame-to-frame log-spectral step above the item's median step
    n_fft: int = 1024
    hop: int = 256


# Provenance: benchmarks/lab/audio_guard_lab.py on 51 clean clips (48 lab clips through the lab codec + 3 lab DiT
# samples, 25 steps, CFG 3): worst clean figures dc 0.00025, clipping 0, loudest-channel RMS -21.2 dBFS (lowest),
# jump excess 1.77 dB; injected faults: DC +0.05, clipping (peak 2 clamped: >= 1 % of samples), x1e-4 (about
# -80 dBFS), one NaN, a 5 ms pop (jump excess >= 12.5 dB) each flagged 51/51 (docs/stepcache.md, "Audio guard").
DEFAULT_THRESHOLDS = AudioGuardThresholds()


@dataclass
class AudioGuardReport(Report):
    clean: bool
    flags: list[str]
    figures: dict[str, float]
    thresholds: dict[str, float]
    items: int
    channels: int
    samples: int
    worst_item: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        if self.clean:
            return (f"audio guard: clean ({self.items}x{self.channels}x{self.samples}; dc {self.figures['dc_offset']:.4f}, "
                    f"clip {self.figures['clipping']:.4f}, rms {self.figures['rms_dbfs']:.1f} dBFS, jump "
                    f"{self.figures['spectral_jump_db']:.1f} dB)")
        return "audio guard: " + "; ".join(self.flags)


def _spectral_jump(x: torch.Tensor, th: AudioGuardThresholds, chunk_frames: int = 2048) -> float:
    """Largest frame-to-frame log-power step (dB, RMS over bins within 60 dB of the peak) minus the median step.
    STFT frames are processed ``chunk_frames`` at a time (memory bounded for long tracks), in two passes: the peak,
    then the steps (each chunk repeats the previous chunk's last frame)."""
    n = x.shape[-1]
    if n < th.n_fft + th.hop:
        return 0.0
    frames = x.unfold(-1, th.n_fft, th.hop)                       # [F, n_fft] (a view)
    win = torch.hann_window(th.n_fft, periodic=True, dtype=torch.float64)

    def logpow(lo, hi):
        spec = torch.fft.rfft(frames[lo:hi] * win, dim=-1)
        return 10.0 * torch.log10((spec.real ** 2 + spec.imag ** 2).clamp_min(1e-20))

    nf = frames.shape[0]
    peak = max(float(logpow(i, min(i + chunk_frames, nf)).max()) for i in range(0, nf, chunk_frames))
    floor = peak - 60.0
    steps = []
    for i in range(0, nf - 1, chunk_frames):
        p = logpow(i, min(i + chunk_frames + 1, nf)).clamp_min(floor)
        steps.append(torch.sqrt(((p[1:] - p[:-1]) ** 2).mean(-1)))
    step = torch.cat(steps)
    return float(step.max() - step.median())


def check_waveform(wave: torch.Tensor, thresholds: AudioGuardThresholds = DEFAULT_THRESHOLDS) -> AudioGuardReport:
    """The guard's figures and flags for ``wave`` (see the module docstring)."""
    if not torch.is_tensor(wave) or not wave.is_floating_point():
        raise TypeError(f"audio guard: expected a float tensor, got {type(wave).__name__} "
                        f"{getattr(wave, 'dtype', '')}")
    if wave.dim() == 1:
        wave = wave[None, None]
    elif wave.dim() == 2:
        wave = wave[None]
    if wave.dim() != 3 or wave.shape[-1] == 0 or wave.shape[0] == 0 or wave.shape[1] == 0:
        raise ValueError(f"audio guard: expected [N], [C, N] or [B, C, N] with samples, got {tuple(wave.shape)}")
    th = thresholds
    x = wave.detach().to("cpu", torch.float64)
    finite = torch.isfinite(x)
    nonfinite = int((~finite).sum())
    x = torch.where(finite, x, torch.zeros((), dtype=x.dtype))
    b, c, n = x.shape
    dc = x.mean(-1).abs()                                           # [B, C]
    clip = (x.abs() >= th.clip_level).double().mean(-1)             # [B, C]
    rms = x.pow(2).mean(-1).sqrt()                                  # [B, C]
    rms_db = 20.0 * torch.log10(rms.clamp_min(1e-12))
    loudest = rms_db.amax(-1)                                       # [B]
    jumps = torch.tensor([[_spectral_jump(x[i, j], th) for j in range(c)] for i in range(b)], dtype=torch.float64)
    figures = {"nonfinite": float(nonfinite), "dc_offset": float(dc.max()), "clipping": float(clip.max()),
               "rms_dbfs": float(loudest.min()), "spectral_jump_db": float(jumps.max())}
    worst = {"dc_offset": int(dc.amax(-1).argmax()), "clipping": int(clip.amax(-1).argmax()),
             "silence": int(loudest.argmin()), "spectral_jump": int(jumps.amax(-1).argmax())}
    flags = []
    if nonfinite:
        flags.append(f"{nonfinite} NaN/Inf samples")
    if figures["dc_offset"] > th.dc_offset:
        flags.append(f"DC offset {figures['dc_offset']:.4f} > {th.dc_offset} (item {worst['dc_offset']})")
    if figures["clipping"] > th.clipping:
        flags.append(f"clipping {100 * figures['clipping']:.2f}% of samples > {100 * th.clipping:.2f}% "
                     f"(item {worst['clipping']})")
    if figures["rms_dbfs"] < th.silence_dbfs:
        r = figures["rms_dbfs"]
        flags.append(f"silent: {r:.1f} dBFS < {th.silence_dbfs} dBFS (item {worst['silence']})" if math.isfinite(r)
                     else f"silent (item {worst['silence']})")
    if figures["spectral_jump_db"] > th.spectral_jump_db:
        flags.append(f"spectral jump {figures['spectral_jump_db']:.1f} dB > {th.spectral_jump_db} dB "
                     f"(item {worst['spectral_jump']})")
    thr = {"dc_offset": th.dc_offset, "clipping": th.clipping, "clip_level": th.clip_level,
           "silence_dbfs": th.silence_dbfs, "spectral_jump_db": th.spectral_jump_db}
    return AudioGuardReport(clean=not flags, flags=flags, figures=figures, thresholds=thr, items=b, channels=c,
                            samples=n, worst_item=worst)


# ================================================================================================ sampling time

@dataclass(frozen=True)
class TrajectoryThresholds:
    final_jump_ratio: float = 3.0    # last step's spectral step over the step before it
    floor_db: float = 60.0           # log-power floor below the pair's peak (as the waveform check)


# Provenance: benchmarks/lab/audio_guard_lab.py --trajectory (lab H3, 25 steps CFG 3, 6 prompts x 6 seeds): ratio on
# 36 uncached runs 0.81-1.41; a stale audio residual (DitKitStepCache first_block, thresholds 10) 6.85-18.6 on the
# same 36 (docs/stepcache.md, "Sampling-time check").
DEFAULT_TRAJECTORY_THRESHOLDS = TrajectoryThresholds()


def latent_spectrum_db(x: torch.Tensor, time_dim: int = -1) -> torch.Tensor:
    """Log power (dB, float64) of an audio latent along its time axis: ``[rows, bins]``, one row per position of
    every other axis (batch, channels, ...)."""
    if not torch.is_tensor(x) or not x.is_floating_point() or x.dim() < 1 or x.shape[time_dim] < 2:
        raise ValueError(f"audio latent spectrum: expected a float tensor with >= 2 time positions on axis "
                         f"{time_dim}, got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t = x.detach().to("cpu", torch.float64).movedim(time_dim, -1)
    t = torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype)).reshape(-1, t.shape[-1])
    spec = torch.fft.rfft(t, dim=-1)
    return 10.0 * torch.log10((spec.real ** 2 + spec.imag ** 2).clamp_min(1e-30))


def spectral_step_db(prev: torch.Tensor, cur: torch.Tensor, floor_db: float = 60.0) -> float:
    """RMS over every (row, bin) of the dB difference between two spectra of :func:`latent_spectrum_db`, both
    floored ``floor_db`` below the pair's peak (bins lost in the noise floor do not count as a change)."""
    if prev.shape != cur.shape:
        raise ValueError(f"spectral step: shapes differ {tuple(prev.shape)} vs {tuple(cur.shape)}")
    floor = float(torch.maximum(prev.max(), cur.max())) - floor_db
    return float(((cur.clamp_min(floor) - prev.clamp_min(floor)) ** 2).mean().sqrt())


@dataclass
class AudioTrajectoryReport(Report):
    clean: bool
    flags: list[str]
    steps: int
    nonfinite: int
    nonfinite_steps: list[int]
    jumps_db: list[float]
    final_jump_ratio: float | None
    thresholds: dict[str, float]

    KEYS = ("clean", "flags", "steps", "nonfinite", "nonfinite_steps", "final_jump_ratio", "jumps_db", "thresholds")
    VALUES = {"final_jump_ratio": lambda r: None if r.final_jump_ratio is None else round(r.final_jump_ratio, 3),
              "jumps_db": lambda r: [round(v, 3) for v in r.jumps_db]}

    def summary(self) -> str:
        if not self.clean:
            return "audio stream while sampling: " + "; ".join(self.flags)
        ratio = "n/a (< 3 steps)" if self.final_jump_ratio is None else f"{self.final_jump_ratio:.2f}"
        return f"audio stream while sampling: clean ({self.steps} steps, final spectral jump ratio {ratio})"


class AudioTrajectoryMonitor:
    """The step-to-step spectral jump check on the audio stream during sampling.

    :meth:`observe` takes, at every sampling step, the sampler's denoised estimate of the audio latent (what the
    step's model evaluation predicts the final audio to be). Per step it keeps the spectral step
    (:func:`spectral_step_db`) between consecutive estimates and counts NaN / Inf values.

    The figure is the **final jump ratio**: the last step's spectral step over the step before it. On an honest
    trajectory the estimate converges, so the last two steps change it alike (lab: 0.81-1.41); a cache that
    reused a stale audio estimate and is corrected by the computed last step shows a jump no later step can
    absorb (a first-order sampler's output is the last estimate). A previous step of exactly zero change (an
    estimate reused unchanged) with a non-zero last step gives an infinite ratio: flagged. Fewer than 3
    observed steps: no ratio (reported, not flagged)."""

    def __init__(self, thresholds: TrajectoryThresholds = DEFAULT_TRAJECTORY_THRESHOLDS, time_dim: int = -1):
        self.thresholds = thresholds
        self.time_dim = time_dim
        self.steps = 0
        self.nonfinite = 0
        self.nonfinite_steps: list[int] = []
        self.jumps_db: list[float] = []
        self._prev: torch.Tensor | None = None

    def observe(self, x0: torch.Tensor) -> None:
        bad = int((~torch.isfinite(x0.detach())).sum())
        if bad:
            self.nonfinite += bad
            self.nonfinite_steps.append(self.steps)
        spec = latent_spectrum_db(x0, self.time_dim)
        if self._prev is not None:
            if spec.shape != self._prev.shape:
                raise ValueError(f"audio trajectory: the audio latent changed shape at step {self.steps}")
            self.jumps_db.append(spectral_step_db(self._prev, spec, self.thresholds.floor_db))
        self._prev = spec
        self.steps += 1

    def report(self) -> AudioTrajectoryReport:
        th = self.thresholds
        ratio = None
        if len(self.jumps_db) >= 2:
            last, before = self.jumps_db[-1], self.jumps_db[-2]
            ratio = last / before if before > 0 else (0.0 if last == 0 else math.inf)
        flags = []
        if self.nonfinite:
            flags.append(f"{self.nonfinite} NaN/Inf values in the audio estimate (steps {self.nonfinite_steps[:5]})")
        if ratio is not None and ratio > th.final_jump_ratio:
            flags.append(f"final spectral jump {self.jumps_db[-1]:.2f} dB = {ratio:.1f}x the step before "
                         f"> {th.final_jump_ratio:g}x (a stale audio estimate corrected at the last step)")
        return AudioTrajectoryReport(clean=not flags, flags=flags, steps=self.steps, nonfinite=self.nonfinite,
                                     nonfinite_steps=list(self.nonfinite_steps), jumps_db=list(self.jumps_db),
                                     final_jump_ratio=ratio,
                                     thresholds={"final_jump_ratio": th.final_jump_ratio, "floor_db": th.floor_db})
