"""Procedural audio-video clips for the quality lab (plain torch, deterministic from a seed).

A clip is one coloured shape (circle / square / triangle) moving across a textured background while it
scales and slowly recolours, with a stereo tone track tied to the motion:

* pitch follows the shape's height (higher on screen = higher pitch), the waveform follows the shape kind
  (circle: sine, square: odd harmonics, triangle: upward chirp on top of the height pitch);
* loudness follows the shape's size; stereo pan follows its horizontal position.

Geometry follows H3's contracts: pixel frames ``17k+5`` at 24 fps, audio at 32 kHz, audio latent frames
``round(frames / 24 * 40)`` (800-sample hop). Video is returned in ``[-1, 1]`` as ``[3, F, H, W]``; audio in
``[-1, 1]`` as ``[2, samples]``.

The text vocabulary is tiny (colour, shape, direction words); :func:`tokenize` maps a prompt to ids for a
learned embedding table fed through the DiT's text path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FPS = 24
SAMPLE_RATE = 32000
AUDIO_HOP = 800  # 32 kHz / 40 Hz latent rate

COLOURS = {
    "red": (0.90, 0.15, 0.12),
    "green": (0.15, 0.80, 0.25),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.85, 0.10),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
VOCAB = ("<pad>",) + tuple(COLOURS) + SHAPES + DIRECTIONS
WORD_TO_ID = {w: i for i, w in enumerate(VOCAB)}
PROMPT_LEN = 3  # colour, shape, direction


def audio_latent_frames(frames: int) -> int:
    """H3's audio latent length for ``frames`` pixel frames at 24 fps (40 Hz latents)."""
    return int(round(frames / FPS * 40))


def audio_samples(frames: int) -> int:
    """Waveform length covering the audio latents exactly (a whole number of 800-sample hops)."""
    return audio_latent_frames(frames) * AUDIO_HOP


def check_frames(frames: int) -> None:
    if frames < 5 or (frames - 5) % 17 != 0:
        raise ValueError(f"H3 pixel frame counts are 17k+5 (5, 22, 39, ...), got {frames}")


def tokenize(prompt: str) -> torch.Tensor:
    """``"red circle right"`` -> LongTensor [PROMPT_LEN]; unknown words raise ValueError naming the word."""
    words = prompt.lower().split()
    ids = []
    for w in words:
        if w not in WORD_TO_ID:
            raise ValueError(f"word {w!r} is not in the lab vocabulary {VOCAB[1:]}")
        ids.append(WORD_TO_ID[w])
    if len(ids) > PROMPT_LEN:
        raise ValueError(f"prompt {prompt!r} has {len(ids)} words, at most {PROMPT_LEN}")
    ids += [0] * (PROMPT_LEN - len(ids))
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class ClipSpec:
    colour: str
    shape: str
    direction: str
    x0: float  # start centre, fraction of width
    y0: float  # start centre, fraction of height
    speed: float  # fraction of the frame per second along `direction`
    size0: float  # start radius, fraction of min(H, W)
    size1: float  # end radius
    hue_drift: float  # colour blend toward the next palette colour over the clip (0..1)
    bg_colour: tuple = field(default=(0.5, 0.5, 0.5))
    bg_freq: tuple = field(default=(2.0, 3.0))
    bg_phase: float = 0.0
    bg_drift: float = 0.0
    bounce: bool = False  # reflect the centre off the frame edges (fast-motion clips stay in frame)

    @property
    def prompt(self) -> str:
        return f"{self.colour} {self.shape} {self.direction}"


def random_spec(seed: int) -> ClipSpec:
    g = torch.Generator().manual_seed(int(seed))

    def u(a=0.0, b=1.0):
        return float(a + (b - a) * torch.rand((), generator=g))

    def pick(seq):
        return seq[int(torch.randint(len(seq), (), generator=g))]

    colour = pick(tuple(COLOURS))
    shape = pick(SHAPES)
    direction = pick(DIRECTIONS)
    # start on the side opposite the motion so the shape stays mostly in frame
    x0, y0 = u(0.3, 0.7), u(0.3, 0.7)
    if direction == "left":
        x0 = u(0.6, 0.8)
    elif direction == "right":
        x0 = u(0.2, 0.4)
    elif direction == "up":
        y0 = u(0.6, 0.8)
    else:
        y0 = u(0.2, 0.4)
    bg = (u(0.25, 0.6), u(0.25, 0.6), u(0.25, 0.6))
    return ClipSpec(colour=colour, shape=shape, direction=direction, x0=x0, y0=y0, speed=u(0.25, 0.45),
                    size0=u(0.15, 0.25), size1=u(0.15, 0.3), hue_drift=u(0.0, 0.5), bg_colour=bg,
                    bg_freq=(u(1.0, 3.0), u(1.0, 3.0)), bg_phase=u(0, 2 * math.pi), bg_drift=u(-1.0, 1.0))


def spec_for_prompt(prompt: str, seed: int) -> ClipSpec:
    """A random clip whose colour/shape/direction follow ``prompt`` (missing words stay random)."""
    spec = random_spec(seed)
    for w in prompt.lower().split():
        if w in COLOURS:
            spec.colour = w
        elif w in SHAPES:
            spec.shape = w
        elif w in DIRECTIONS:
            if w != spec.direction:
                # re-seat the start point for the new direction
                fix = random_spec(seed + 7919)
                spec.x0, spec.y0 = 0.5, 0.5
                if w == "left":
                    spec.x0 = 0.5 + abs(fix.x0 - 0.5) * 0.5 + 0.15
                elif w == "right":
                    spec.x0 = 0.5 - abs(fix.x0 - 0.5) * 0.5 - 0.15
                elif w == "up":
                    spec.y0 = 0.5 + abs(fix.y0 - 0.5) * 0.5 + 0.15
                else:
                    spec.y0 = 0.5 - abs(fix.y0 - 0.5) * 0.5 - 0.15
            spec.direction = w
        else:
            raise ValueError(f"word {w!r} is not in the lab vocabulary {VOCAB[1:]}")
    return spec


_DIR = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}


def trajectory(spec: ClipSpec, times: torch.Tensor):
    """Centre (x, y as fractions), radius (fraction of min side) and colour [.., 3] at ``times`` seconds."""
    dx, dy = _DIR[spec.direction]
    dur = max(float(times.max()), 1e-6) if times.numel() else 1.0
    x = spec.x0 + dx * spec.speed * times
    y = spec.y0 + dy * spec.speed * times
    if spec.bounce:
        x, y = _reflect(x), _reflect(y)
    frac = (times / dur).clamp(0, 1)
    r = spec.size0 + (spec.size1 - spec.size0) * frac
    names = tuple(COLOURS)
    c0 = torch.tensor(COLOURS[spec.colour])
    c1 = torch.tensor(COLOURS[names[(names.index(spec.colour) + 1) % len(names)]])
    w = (spec.hue_drift * frac)[..., None]
    col = c0 * (1 - w) + c1 * w
    return x, y, r, col


def _reflect(p: torch.Tensor, lo: float = 0.15, hi: float = 0.85) -> torch.Tensor:
    """Fold a coordinate into ``[lo, hi]`` as if it bounced off the edges (triangle wave)."""
    span = hi - lo
    q = torch.remainder(p - lo, 2 * span)
    return lo + span - (q - span).abs()


def _shape_mask(shape: str, xx, yy, cx, cy, r, soft: float):
    if shape == "circle":
        d = torch.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) - r
    elif shape == "square":
        d = torch.maximum((xx - cx).abs(), (yy - cy).abs()) - r * 0.85
    else:  # upward-pointing triangle: intersection of three half-planes
        px, py = xx - cx, yy - cy
        s3 = math.sqrt(3.0)
        d1 = py - r * 0.5  # bottom edge
        d2 = (-s3 * px - py) / 2 - r * 0.5
        d3 = (s3 * px - py) / 2 - r * 0.5
        d = torch.maximum(torch.maximum(d1, d2), d3)
    return torch.sigmoid(-d / soft)


def render_video(spec: ClipSpec, frames: int, height: int, width: int) -> torch.Tensor:
    """[3, frames, height, width] in [-1, 1]."""
    times = torch.arange(frames, dtype=torch.float32) / FPS
    x, y, r, col = trajectory(spec, times)
    ys = (torch.arange(height, dtype=torch.float32) + 0.5) / height
    xs = (torch.arange(width, dtype=torch.float32) + 0.5) / width
    yy, xx = torch.meshgrid(ys * height, xs * width, indexing="ij")  # pixel units
    side = float(min(height, width))
    fx, fy = spec.bg_freq
    bgc = torch.tensor(spec.bg_colour).view(3, 1, 1)
    out = torch.empty(3, frames, height, width)
    for f in range(frames):
        ph = spec.bg_phase + spec.bg_drift * float(times[f]) * 2.0
        tex = 0.5 + 0.5 * torch.sin(2 * math.pi * (fx * xx / width + ph)) * torch.cos(2 * math.pi * fy * yy / height)
        stripes = 0.5 + 0.5 * torch.sign(torch.sin(2 * math.pi * (xx + yy) / (side / 3.0)))
        bg = bgc * (0.75 + 0.35 * tex) + 0.08 * (stripes - 0.5)
        m = _shape_mask(spec.shape, xx, yy, float(x[f]) * width, float(y[f]) * height,
                        float(r[f]) * side, soft=0.8)
        img = bg * (1 - m) + col[f].view(3, 1, 1) * m
        out[:, f] = img
    return out.clamp(0, 1) * 2 - 1


def render_audio(spec: ClipSpec, frames: int, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """[2, audio_samples(frames)] stereo tone track tied to the motion, in [-1, 1]."""
    n = audio_samples(frames) * sample_rate // SAMPLE_RATE
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    x, y, r, _ = trajectory(spec, t.float())
    x, y, r = x.double(), y.double(), r.double()
    # pitch: 220 Hz at the bottom .. 880 Hz at the top (log scale)
    height_frac = (1.0 - y).clamp(0, 1)
    f = 220.0 * torch.pow(torch.tensor(4.0, dtype=torch.float64), height_frac)
    if spec.shape == "triangle":
        f = f * (1.0 + 0.5 * (t / t[-1].clamp(min=1e-9)))  # chirp up by half an octave over the clip
    phase = 2 * math.pi * torch.cumsum(f, 0) / sample_rate
    if spec.shape == "square":
        wave = torch.sin(phase) + torch.sin(3 * phase) / 3 + torch.sin(5 * phase) / 5
        wave = wave * 0.8
    else:
        wave = torch.sin(phase)
    amp = 0.15 + 1.2 * r
    pan = x.clamp(0, 1)
    left = wave * amp * torch.sqrt(1 - pan)
    right = wave * amp * torch.sqrt(pan)
    return torch.stack([left, right]).float().clamp(-1, 1)


@dataclass
class Clip:
    video: torch.Tensor  # [3, F, H, W] in [-1, 1]
    audio: torch.Tensor  # [2, S] in [-1, 1]
    tokens: torch.Tensor  # [PROMPT_LEN] long
    prompt: str
    spec: ClipSpec


def make_clip(seed: int, frames: int = 22, height: int = 64, width: int = 96, prompt: str | None = None,
              speed_scale: float = 1.0, bounce: bool = False) -> Clip:
    """One deterministic clip. ``prompt`` (vocabulary words) pins colour/shape/direction.

    ``speed_scale`` multiplies the shape's speed (faster motion, e.g. for VAE training); ``bounce`` reflects the
    shape off the frame edges so fast clips keep it in frame. The defaults (1.0, False) give exactly the clips
    of earlier versions."""
    check_frames(frames)
    if height % 16 or width % 16:
        raise ValueError(f"height/width must be multiples of 16 (the VAE's spatial factor), got {height}x{width}")
    if not (math.isfinite(speed_scale) and speed_scale > 0):
        raise ValueError(f"speed_scale must be a finite number > 0, got {speed_scale!r}")
    spec = spec_for_prompt(prompt, seed) if prompt else random_spec(seed)
    if speed_scale != 1.0:
        spec.speed = spec.speed * speed_scale
    spec.bounce = bool(bounce)
    return Clip(video=render_video(spec, frames, height, width), audio=render_audio(spec, frames),
                tokens=tokenize(spec.prompt), prompt=spec.prompt, spec=spec)


# ------------------------------------------------------------------------------------------------------------
# Lab audio codec: waveform <-> [32, 2, T] latents at 40 Hz (stand-in for H3's DAC/BigVGAN audio VAE)
# ------------------------------------------------------------------------------------------------------------

AUDIO_LATENT_CHANNELS = 32
_BAND_LO, _BAND_HI = 150.0, 4000.0
_LOG_FLOOR = 1e-4
_LAT_SHIFT, _LAT_SCALE = 6.5, 2.5  # maps log-magnitudes (about -9.2 .. 0) to roughly [-1, 2.5]


def band_centres(n: int = AUDIO_LATENT_CHANNELS) -> torch.Tensor:
    return _BAND_LO * (_BAND_HI / _BAND_LO) ** (torch.arange(n, dtype=torch.float64) / (n - 1))


def _frame_bases(sample_rate: int = SAMPLE_RATE):
    n = 2 * AUDIO_HOP
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    fc = band_centres()
    win = torch.hann_window(n, periodic=True, dtype=torch.float64)
    # each band is a bank of three neighbouring tones so a band responds to a neighbourhood, not one bin
    spread = torch.tensor([-0.06, 0.0, 0.06], dtype=torch.float64)
    freqs = fc[:, None] * (1 + spread[None])  # [32, 3]
    cos = torch.cos(2 * math.pi * freqs[..., None] * t) * win
    sin = torch.sin(2 * math.pi * freqs[..., None] * t) * win
    return cos, sin, win


def audio_encode(wave: torch.Tensor) -> torch.Tensor:
    """[2, S] waveform -> [1, 32, 2, S // 800] normalised log band magnitudes (one frame per 800-sample hop)."""
    if wave.ndim != 2 or wave.shape[0] != 2:
        raise ValueError(f"expected stereo [2, samples], got {tuple(wave.shape)}")
    T = wave.shape[1] // AUDIO_HOP
    cos, sin, win = _frame_bases()
    n = 2 * AUDIO_HOP
    x = torch.nn.functional.pad(wave.double(), (AUDIO_HOP // 2, AUDIO_HOP // 2 + n))
    frames = x.unfold(1, n, AUDIO_HOP)[:, :T]  # [2, T, n]
    re = torch.einsum("ctn,bkn->ctbk", frames, cos)
    im = torch.einsum("ctn,bkn->ctbk", frames, sin)
    mag = torch.sqrt(re ** 2 + im ** 2).amax(-1) * (2.0 / win.sum())  # [2, T, 32] ~ sinusoid amplitude
    lat = (torch.log(mag + _LOG_FLOOR) + _LAT_SHIFT) / _LAT_SCALE
    return lat.permute(2, 0, 1).unsqueeze(0).float()


def audio_decode(latent: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """[1, 32, 2, T] latents -> [2, T * 800] waveform: phase-continuous sinusoids at the band centres with the
    decoded amplitudes (linear interpolation between frames). A tone on a band centre round-trips closely."""
    if latent.ndim != 4 or latent.shape[1] != AUDIO_LATENT_CHANNELS:
        raise ValueError(f"expected [1, 32, 2, T] audio latents, got {tuple(latent.shape)}")
    lat = latent[0].double()  # [32, 2, T]
    amp = (torch.exp(lat * _LAT_SCALE - _LAT_SHIFT) - _LOG_FLOOR).clamp(min=0)
    # suppress leakage: keep bands within 12 dB of the frame's strongest band
    peak = amp.amax(0, keepdim=True)
    amp = torch.where(amp >= peak * 0.25, amp, torch.zeros_like(amp))
    # spread a tone between adjacent bands: the band with the largest amplitude dominates
    T = lat.shape[-1]
    S = T * AUDIO_HOP
    pos = (torch.arange(S, dtype=torch.float64) + 0.5) / AUDIO_HOP - 0.5
    pos = pos.clamp(0, T - 1)
    i0 = pos.floor().long().clamp(max=max(T - 2, 0))
    fr = (pos - i0) if T > 1 else torch.zeros_like(pos)
    i1 = (i0 + 1).clamp(max=T - 1)
    a = amp[:, :, i0] * (1 - fr) + amp[:, :, i1] * fr  # [32, 2, S]
    # normalise so overlapping bands don't add up above the strongest one
    total = a.sum(0, keepdim=True).clamp(min=1e-9)
    a = a * (a.amax(0, keepdim=True) / total)
    fc = band_centres()
    t = torch.arange(S, dtype=torch.float64) / sample_rate
    out = (a * torch.sin(2 * math.pi * fc[:, None, None] * t)).sum(0)
    return out.float().clamp(-1, 1)


# ------------------------------------------------------------------------------------------------------------
# Prompt adherence: read colour and direction back from a video (for sampled clips)
# ------------------------------------------------------------------------------------------------------------

def describe_video(video01: torch.Tensor) -> tuple[str | None, str | None]:
    """(colour, direction) of the saturated moving shape in ``[3, F, H, W]`` pixels in ``[0, 1]``.

    Shape pixels are the strongly saturated ones (the backgrounds are greyish); colour = palette colour nearest
    the mean shape colour over the first third of the clip (before the recolouring drift); direction = dominant
    axis and sign of the shape centroid's displacement from the first to the last quarter. ``None`` when no
    shape is found."""
    v = video01.double().clamp(0, 1)
    _, F, H, W = v.shape
    sat = v.amax(0) - v.amin(0)  # [F, H, W]
    mask = sat > 0.42
    if mask.sum() < F * 6:
        return None, None
    first = max(1, F // 3)
    m0 = mask[:first]
    if m0.sum() == 0:
        return None, None
    mean_col = (v[:, :first] * m0).sum(dim=(1, 2, 3)) / m0.sum()
    names = tuple(COLOURS)
    pal = torch.tensor([COLOURS[n] for n in names], dtype=torch.float64)
    colour = names[int(((pal - mean_col) ** 2).sum(-1).argmin())]
    ys = torch.arange(H, dtype=torch.float64).view(1, H, 1)
    xs = torch.arange(W, dtype=torch.float64).view(1, 1, W)
    q = max(1, F // 4)

    def centroid(m):
        n = m.sum().clamp(min=1)
        return float((m * xs).sum() / n) / W, float((m * ys).sum() / n) / H

    (xa, ya), (xb, yb) = centroid(mask[:q]), centroid(mask[-q:])
    dx, dy = xb - xa, yb - ya
    if abs(dx) >= abs(dy):
        direction = "right" if dx > 0 else "left"
    else:
        direction = "down" if dy > 0 else "up"
    return colour, direction
