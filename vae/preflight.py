"""Pre-flight checks of decode / encode / save requests: refuse what cannot work BEFORE any heavy work.

Every check raises :class:`~ditkit.errors.DitKitError` naming the node input, the value and the limit:

* :func:`check_latent_shape`: a 5-D latent whose every dimension is >= 1 (a T=0 or batch-0 latent otherwise fails
  deep in the decoder, e.g. ``max() arg is an empty sequence``);
* :func:`check_image_size`: at least ``min_px`` per side (the H3 encoder's last level pads by reflection, which
  needs 2 latent cells: 32 px at 16x; smaller images fail with a raw padding error after the crop to 16 px);
* :func:`check_memory`: an estimate of the bytes a request must allocate (from shapes and dtypes only), against
  the memory the device can offer, with the figures in the message;
* :func:`check_audio`: the audio a video save muxes (waveform shape, length, channels, sample rate supported by the
  encoder) before the video is decoded.

Plain Python + torch (no ComfyUI): the node passes the numbers it gets from the host (free memory, the VAE's own
working-memory estimate, the encoder's supported rates).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

from ..errors import DitKitError

GIB = 1 << 30
MEMORY_FRACTION = 0.9   # at most this share of the memory the device can offer


def fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def check_latent_shape(shape: Iterable[int], node: str, input_name: str = "samples", ndim: int = 5,
                       dims: str = "[B, C, T, H, W]") -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != ndim:
        raise DitKitError(f"{node}: input '{input_name}' must be a {ndim}-D latent {dims}; got shape {shape}")
    names = dims.strip("[]").split(", ")
    empty = [f"{n}={s}" for n, s in zip(names, shape) if s < 1]
    if empty:
        raise DitKitError(f"{node}: input '{input_name}' is an empty latent (shape {shape}: {', '.join(empty)}); every "
                          "dimension must be at least 1")
    return shape


def check_image_size(shape: Iterable[int], node: str, min_px: int, input_name: str = "image",
                     why: str = "") -> tuple[int, ...]:
    """``shape`` = ComfyUI IMAGE [N, H, W, C]."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4:
        raise DitKitError(f"{node}: input '{input_name}' must be an IMAGE batch [N, H, W, C]; got shape {shape}")
    n, h, w, c = shape
    if n < 1:
        raise DitKitError(f"{node}: input '{input_name}' holds no image (batch {n})")
    if c < 3:
        raise DitKitError(f"{node}: input '{input_name}' has {c} channel(s); RGB (3) is needed")
    if h < min_px or w < min_px:
        raise DitKitError(f"{node}: input '{input_name}' is {w}x{h} pixels; this VAE needs at least {min_px}x{min_px}"
                          + (f" ({why})" if why else ""))
    return shape


def check_memory(node: str, input_name: str, shape, parts: Mapping[str, float], available: float, where: str,
                 fraction: float = MEMORY_FRACTION) -> int:
    """Refuse when the estimated bytes (``parts``: name -> bytes, summed) exceed ``fraction`` of ``available``."""
    need = int(sum(max(0.0, float(v)) for v in parts.values()))
    limit = int(max(0.0, float(available)) * fraction)
    if need > limit:
        detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
        raise DitKitError(f"{node}: input '{input_name}' of shape {tuple(shape)} needs about {fmt_bytes(need)} "
                          f"({detail}), more than {fraction:.0%} of the {fmt_bytes(available)} {where} "
                          f"(limit {fmt_bytes(limit)}); nothing was allocated. Use a smaller size or batch")
    return need


def t1_decode_bytes(latent_shape, ratio: int, compute_itemsize: int, tokens: int) -> dict[str, int]:
    """Memory the T=1 decode must hold beyond the VAE's working set: the pixel canvas ([B, 3, 1, H, W] in the
    compute dtype), the largest raw tile (all ``tokens`` x 4 frames of one tile; the canvas size bounds it), and the
    float32 IMAGE it returns."""
    b, _, _, h, w = (int(s) for s in latent_shape)
    px = b * 3 * (h * ratio) * (w * ratio)
    return {"canvas": px * compute_itemsize, "output image": px * 4,
            "largest tile": min(px, b * 3 * 256 * 256) * 4 * tokens * compute_itemsize}


def check_audio(audio, node: str, supported_rates: Iterable[int] | None, input_name: str = "audio",
                channels: Iterable[int] = (1, 2, 6)) -> tuple[int, int, int]:
    """``audio`` = ComfyUI AUDIO dict ``{"waveform": [B, C, N], "sample_rate": int}``; returns (rate, C, N)."""
    if not isinstance(audio, Mapping) or "waveform" not in audio or "sample_rate" not in audio:
        raise DitKitError(f"{node}: input '{input_name}' must be an AUDIO dict with 'waveform' and 'sample_rate'")
    wave = audio["waveform"]
    shape = tuple(getattr(wave, "shape", ()))
    if len(shape) != 3:
        raise DitKitError(f"{node}: input '{input_name}' waveform must be [batch, channels, samples]; got shape {shape}")
    b, c, n = shape
    rate = audio["sample_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate != int(rate):
        raise DitKitError(f"{node}: input '{input_name}' sample_rate {rate!r} is not a whole number of Hz")
    rate = int(rate)
    rates = sorted(int(r) for r in supported_rates) if supported_rates else None
    if rate <= 0 or (rates is not None and rate not in rates):
        raise DitKitError(f"{node}: input '{input_name}' sample_rate {rate} Hz is not supported by the audio encoder"
                          + (f" (supported: {', '.join(map(str, rates))} Hz); resample it first" if rates else ""))
    if b < 1 or n < 1:
        raise DitKitError(f"{node}: input '{input_name}' is empty (shape {shape}: {n} samples = "
                          f"{n / rate:.3g} s); give at least one sample or leave the input unconnected")
    channels = sorted(channels)
    if c not in channels:
        raise DitKitError(f"{node}: input '{input_name}' has {c} channels; the encoder is given "
                          f"{', '.join(map(str, channels))} (mono, stereo, 5.1)")
    return rate, c, n
