"""ComfyUI-free sampling of the lab H3 DiT, reproducing what the lab harness gets from ComfyUI's KSampler.

KSampler(``euler``, ``simple``) on an ``EmptyMiniMaxH3LatentAV`` latent with H3's model sampling amounts to:

* noise: one generator seeded with ``seed`` draws the video noise then the audio noise (``comfy.sample.prepare_noise``
  on the nested latent), standard normal, float32, CPU;
* schedule: H3's flow sampling (shift 12, multiplier 1000) tabulates ``sigma(i / 1000)`` for i = 1..1000 with
  ``sigma(t) = shift * t / (1 + (shift - 1) * t)``; ``simple`` takes every ``1000 / steps``-th entry from the top,
  then 0;
* the audio stream rides on the video schedule scaled by ``audio_scale = shift_video / shift_audio`` (the latent is
  multiplied in, divided out at the end; the DiT converts inside its forward);
* start ``x = sigma_0 * noise + (1 - sigma_0) * latent``; each step ``denoised = x - sigma * out`` per condition,
  ``cfg``-mixed with the null prompt (``uncond + (cond - uncond) * cfg``; cfg 1 runs the prompt only), Euler
  ``x += (x - denoised) / sigma * (sigma_next - sigma)``;
* the text context is refined once per sampling (``preprocess_text_embeds``), as ComfyUI's ``extra_conds`` does.

Hooks are passed as ``transformer_options`` (the DiT honours ``patches_replace``, ``optimized_attention_override``
and ``wrappers["diffusion_model"]``); every model call gets ComfyUI's per-call keys ``cond_or_uncond``, ``uuids``,
``sigmas`` and ``sample_sigmas``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .lab_ref_dit import SHIFT_AUDIO, SHIFT_VIDEO

FPS = 24
AUDIO_LATENT_FPS = 40
VIDEO_CHANNELS, AUDIO_CHANNELS = 24, 32


class FlowSampling:
    """H3's discrete flow model sampling: ``sigmas`` table, ``timestep``, ``percent_to_sigma``, ``audio_scale``."""

    def __init__(self, shift: float = SHIFT_VIDEO, audio_shift: float = SHIFT_AUDIO, timesteps: int = 1000,
                 multiplier: float = 1000):
        self.shift, self.audio_shift, self.multiplier = float(shift), float(audio_shift), multiplier
        t = (torch.arange(1, timesteps + 1, 1) / timesteps) * multiplier
        self.sigmas = self.sigma(t)

    def sigma(self, timestep):
        t = timestep / self.multiplier
        if self.shift == 1.0:
            return t
        return self.shift * t / (1 + (self.shift - 1) * t)

    def timestep(self, sigma):
        return sigma * self.multiplier

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        t = 1.0 - percent
        return self.shift * t / (1 + (self.shift - 1) * t)

    @property
    def audio_scale(self) -> float:
        return self.shift / self.audio_shift


def simple_sigmas(ms: FlowSampling, steps: int) -> torch.Tensor:
    stride = len(ms.sigmas) / steps
    return torch.FloatTensor([float(ms.sigmas[-(1 + int(i * stride))]) for i in range(steps)] + [0.0])


def av_latent_shapes(width: int, height: int, length: int) -> tuple[tuple, tuple]:
    """Shapes of H3's empty AV latent: frames snap up to 17k + 5 at 24 fps; audio latent at 40 Hz."""
    frames = max(5, length)
    while frames % 17 != 5:
        frames += 1
    latent_t = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
    audio_t = round(frames / FPS * AUDIO_LATENT_FPS)
    return (1, VIDEO_CHANNELS, latent_t, height // 16, width // 16), (1, AUDIO_CHANNELS, 2, audio_t)


def prepare_noise(shapes, seed: int) -> list[torch.Tensor]:
    """Standard normal noise for each stream from ONE generator seeded with ``seed``, in stream order."""
    g = torch.Generator("cpu").manual_seed(int(seed))
    return [torch.randn(tuple(s), dtype=torch.float32, generator=g) for s in shapes]


def pack(streams) -> torch.Tensor:
    return torch.cat([s.reshape(s.shape[0], 1, -1) for s in streams], dim=-1)


def unpack(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, off = [], 0
    for s in shapes:
        n = math.prod(s[1:])
        out.append(flat[:, :, off:off + n].reshape(flat.shape[0], *s[1:]))
        off += n
    return out


@dataclass
class SampleResult:
    video: torch.Tensor
    audio: torch.Tensor
    sigmas: torch.Tensor
    calls: int  # model calls (one per condition per step)


def sample(model, context: torch.Tensor, null_context: torch.Tensor | None, seed: int, steps: int, cfg: float,
           shapes, transformer_options: dict | None = None, ms: FlowSampling | None = None,
           latent=None) -> SampleResult:
    """Euler / simple sampling of ``model`` (a :class:`~.lab_ref_dit.LabH3DiT`) from ``latent`` (default zeros of
    ``shapes``) with CFG against ``null_context``; ``transformer_options`` carries the hooks."""
    ms = ms or FlowSampling(model.sigma_shift_video, model.sigma_shift_audio)
    scale = ms.audio_scale
    shapes = [tuple(s) for s in shapes]
    streams = [torch.zeros(s) for s in shapes] if latent is None else [t.float() for t in latent]
    latent_in = pack([streams[0], streams[1] * scale])
    noise = pack(prepare_noise(shapes, seed))
    sigmas = simple_sigmas(ms, steps)
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * latent_in
    base = dict(transformer_options or {})
    base["sample_sigmas"] = sigmas
    payload = {"audio_scale": scale}
    use_null = not math.isclose(cfg, 1.0)
    with torch.no_grad():
        conds = [("cond", 0, model.preprocess_text_embeds(context.float()))]
        if use_null:
            conds.append(("uncond", 1, model.preprocess_text_embeds(null_context.float())))
        calls = 0
        for i in range(len(sigmas) - 1):
            sigma = sigmas[i:i + 1]
            denoised = {}
            for uuid, which, ctx in conds:
                to = dict(base, cond_or_uncond=[which], uuids=[uuid], sigmas=sigma)
                out = model(unpack(x, shapes), ms.timestep(sigma).float(), ctx, transformer_options=to,
                            minimax_payload=payload)
                calls += 1
                denoised[which] = x - pack(out).float() * sigma
            d = denoised[0] if not use_null else denoised[1] + (denoised[0] - denoised[1]) * cfg
            x = x + (x - d) / sigma * (sigmas[i + 1] - sigma)
    x = x / (1.0 - sigmas[-1])
    video, audio = unpack(x, shapes)
    return SampleResult(video, audio / scale, sigmas, calls)
