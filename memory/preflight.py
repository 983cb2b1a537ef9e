"""The preflight plan: the packed token count of a job, its predicted peak against the memory available, and when it
does not fit, the smallest set of ditkit settings that does (each with its predicted peak). Plain python; the host
side (which device, how much is free, the model's dimensions and weights) is ``bridge/preflight.py``."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .model import GIB, MAX_TOKENS, DiTDims, MemoryModelError, Options, Prediction, Tokens, Weights, predict

CHUNKS = (4096, 1024, 256)
SUGGEST_FORMATS = ("float8_e4m3fn", "nvfp4")
MAX_LATENT_ELEMENTS = 1 << 40
CFG_REL_TOL = 1e-9   # math.isclose's default: ComfyUI 0.33 sampling_function skips the uncond when isclose(cfg, 1.0)


class MemoryShortfallError(MemoryModelError):
    """The job does not fit the memory available (the message names the shortfall and the settings that fit)."""


def check_limit(limit_gib, name: str = "limit_gib") -> float:
    """A memory limit in GiB: finite and >= 0 (0 = the device's free memory)."""
    if isinstance(limit_gib, bool) or not isinstance(limit_gib, (int, float)):
        raise MemoryModelError(f"{name} must be a number of GiB, got {limit_gib!r}")
    v = float(limit_gib)
    if not math.isfinite(v):
        raise MemoryModelError(f"{name} must be finite, got {limit_gib!r}")
    if v < 0:
        raise MemoryModelError(f"{name} must be >= 0 GiB (0 = the free memory of the device), got {v}")
    return v


def check_available(available: int, where: str) -> int:
    if isinstance(available, bool) or not isinstance(available, int) or available <= 0:
        raise MemoryModelError(f"{where} reports no usable memory ({available!r} bytes free): cannot plan the job; "
                               "set limit_gib to the memory you want the job to fit")
    return available


def h3_tokens(video_shape, audio_shape, text: int = 0, refs: int = 0, keyframes: int = 0,
              patch=(1, 2, 2)) -> Tokens:
    """The packed rows of one H3 forward: video ``T * ceil(H/2) * ceil(W/2)`` (ComfyUI pads to the patch), stereo
    audio ``2 * T_a``, text, reference and keyframe rows. Sizes checked with python ints before anything exists."""
    if len(video_shape) != 5 or len(audio_shape) != 4:
        raise MemoryModelError(f"H3 latent must be video [B, 24, T, H, W] + audio [B, 32, 2, T_a], got "
                               f"{tuple(video_shape)} + {tuple(audio_shape)}")
    dims = [int(x) for x in video_shape] + [int(x) for x in audio_shape]
    if any(x <= 0 for x in dims):
        raise MemoryModelError(f"latent has an empty or negative dimension: {tuple(video_shape)} + {tuple(audio_shape)}")
    if math.prod(dims[:5]) > MAX_LATENT_ELEMENTS or math.prod(dims[5:]) > MAX_LATENT_ELEMENTS:
        raise MemoryModelError(f"latent {tuple(video_shape)} is absurdly large ({math.prod(dims[:5]):.3g} elements)")
    b, _, t, h, w = dims[:5]
    pt, ph, pw = patch
    video = -(-t // pt) * -(-h // ph) * -(-w // pw)
    tok = Tokens(video=video, audio=2 * dims[8], text=int(text), refs=int(refs), keyframes=int(keyframes))
    if tok.total > MAX_TOKENS:
        raise MemoryModelError(f"latent {tuple(video_shape)} packs {tok.total:,} tokens (> {MAX_TOKENS:,}): absurd for "
                               "any device; check the latent's frames / width / height")
    return tok


def ltx2_tokens(video_shape, audio_shape=None) -> Tokens:
    """The self-attention rows of one LTX-2 forward per latent: video ``T * H * W`` (patch 1x1x1 on the
    [B, 128, T, H, W] latent), audio ``T_a`` (one row per latent frame of [B, C, T_a, F]; none for a video-only
    latent). Text is cross-attention context, not in the sequence. Checked with python ints before anything
    exists."""
    if len(video_shape) != 5 or (audio_shape is not None and len(audio_shape) != 4):
        raise MemoryModelError(f"LTX-2 latent must be video [B, C, T, H, W] (+ audio [B, C, T_a, F]), got "
                               f"{tuple(video_shape)}" + (f" + {tuple(audio_shape)}" if audio_shape is not None else ""))
    dims = [int(x) for x in video_shape] + [int(x) for x in (audio_shape or (1, 1, 1, 1))]
    if any(x <= 0 for x in dims[:5]) or any(x < 0 for x in dims[5:]):
        raise MemoryModelError(f"latent has an empty or negative dimension: {tuple(video_shape)}"
                               + (f" + {tuple(audio_shape)}" if audio_shape is not None else ""))
    if math.prod(dims[:5]) > MAX_LATENT_ELEMENTS or math.prod(dims[5:]) > MAX_LATENT_ELEMENTS:
        raise MemoryModelError(f"latent {tuple(video_shape)} is absurdly large ({math.prod(dims[:5]):.3g} elements)")
    tok = Tokens(video=dims[2] * dims[3] * dims[4], audio=dims[7] if audio_shape is not None else 0)
    if tok.total > MAX_TOKENS:
        raise MemoryModelError(f"latent {tuple(video_shape)} packs {tok.total:,} tokens (> {MAX_TOKENS:,}): absurd for "
                               "any device; check the latent's frames / width / height")
    return tok


def zimage_tokens(latent_shape, text: int = 0, patch: int = 2, pad_multiple: int | None = 32, refs=(),
                  ref_texts=(), siglip=(), siglip_model: bool = False) -> Tokens:
    """The joint sequence of one Z-Image forward per latent (ComfyUI 0.33 ``NextDiT.patchify_and_embed``): image
    rows ``ceil(H/p) * ceil(W/p)`` of the [B, C, H, W] latent (padded to the patch), text rows the caption length;
    each part padded up to ``pad_multiple`` rows (pad tokens; an empty caption is ``pad_multiple`` pad rows).
    Checked with python ints before anything exists.

    Omni editing (``refs``: the (H, W) of each reference latent, non-empty): each reference adds its caption
    (``ref_texts[i]`` rows, ``pad_multiple`` pad rows when it has none), its SigLIP rows when the model has a SigLIP
    embedder (``siglip_model``; ``siglip[i]`` rows, ``pad_multiple`` pad rows when it has none) and its image rows
    ``(H/p) * (W/p)`` (a reference is not padded to the patch: a size that is not a multiple is refused, as the
    model cannot take it); the target then has ``pad_multiple`` SigLIP pad rows, and the captions in ``ref_texts``
    past the references join the text. Every part is padded to ``pad_multiple``. Reference image and SigLIP rows
    are counted as ``refs``."""
    if len(latent_shape) != 4:
        raise MemoryModelError(f"Z-Image latent must be [B, C, H, W], got {tuple(latent_shape)}")
    dims = [int(x) for x in latent_shape]
    if any(x <= 0 for x in dims):
        raise MemoryModelError(f"latent has an empty or negative dimension: {tuple(latent_shape)}")
    if math.prod(dims) > MAX_LATENT_ELEMENTS:
        raise MemoryModelError(f"latent {tuple(latent_shape)} is absurdly large ({math.prod(dims):.3g} elements)")
    p = _count(patch, "patch")
    m = 1 if pad_multiple is None else _count(pad_multiple, "pad_multiple")
    if p <= 0 or m <= 0:
        raise MemoryModelError(f"patch and pad_multiple must be >= 1, got {patch!r}, {pad_multiple!r}")
    t = _count(text, "text")
    refs, ref_texts, siglip = list(refs), [_count(x, "reference caption rows") for x in ref_texts], \
        [_count(x, "SigLIP rows") for x in siglip]
    if refs and pad_multiple is None:
        raise MemoryModelError("Z-Image omni references need the model's pad_tokens_multiple (this model has none)")

    def up(n: int) -> int:
        return -(-n // m) * m

    image = -(-dims[2] // p) * -(-dims[3] // p)
    cap = m if (t == 0 and pad_multiple is not None) else t
    text_rows, ref_rows = up(cap), 0
    for i, hw in enumerate(refs):
        if not isinstance(hw, (tuple, list)) or len(hw) != 2:
            raise MemoryModelError(f"reference latent {i} must be given as (H, W), got {hw!r}")
        h, w = (_count(v, f"reference latent {i} size") for v in hw)
        if h <= 0 or w <= 0 or h % p or w % p:
            raise MemoryModelError(f"reference latent {i} is {h} x {w}: Z-Image takes a reference whose height and "
                                   f"width are multiples of the patch {p} (> 0)")
        text_rows += up(ref_texts[i]) if i < len(ref_texts) else m
        if siglip_model:
            ref_rows += up(siglip[i]) if i < len(siglip) else m
        ref_rows += up((h // p) * (w // p))
    if refs:
        ref_rows += m if siglip_model else 0
        text_rows += sum(up(x) for x in ref_texts[len(refs):])
    tok = Tokens(video=up(image), text=text_rows, refs=ref_rows, image=True)
    if tok.total > MAX_TOKENS:
        raise MemoryModelError(f"latent {tuple(latent_shape)} packs {tok.total:,} tokens (> {MAX_TOKENS:,}): absurd "
                               "for any device; check the latent's width / height")
    return tok


FLUX2_TEXT_ROWS = 512   # ComfyUI 0.33 model_base.Flux2.extra_conds left-pads a shorter cross_attn to 512 rows


def flux2_tokens(latent_shape, text: int = 0, refs=(), patch: int = 1, min_text: int | None = FLUX2_TEXT_ROWS
                 ) -> Tokens:
    """The joint sequence of one FLUX.2 forward per latent (ComfyUI 0.33 ``Flux._forward`` / ``process_img``):
    image rows ``ceil(H/p) * ceil(W/p)`` of the [B, 128, H, W] latent (padded to the patch; FLUX.2's patch is 1:
    the 2x2 patching is in the latent's 128 channels), each reference latent ``[.., h, w]`` in ``refs`` (the
    conditioning's ``reference_latents``, concatenated after the image rows) ``ceil(h/p) * ceil(w/p)`` rows, and the
    text rows: the caption length, left-padded up to ``min_text`` (``model_base.Flux2.extra_conds``: 512; None: no
    padding). Checked with python ints before anything exists."""
    if len(latent_shape) != 4:
        raise MemoryModelError(f"FLUX.2 latent must be [B, C, H, W], got {tuple(latent_shape)}")
    dims = [int(x) for x in latent_shape]
    if any(x <= 0 for x in dims):
        raise MemoryModelError(f"latent has an empty or negative dimension: {tuple(latent_shape)}")
    if math.prod(dims) > MAX_LATENT_ELEMENTS:
        raise MemoryModelError(f"latent {tuple(latent_shape)} is absurdly large ({math.prod(dims):.3g} elements)")
    p = _count(patch, "patch")
    if p <= 0:
        raise MemoryModelError(f"patch must be >= 1, got {patch!r}")
    t = _count(text, "text")
    m = 0 if min_text is None else _count(min_text, "min_text")
    if not isinstance(refs, (list, tuple)):
        raise MemoryModelError(f"refs must be a list of reference latent shapes, got {type(refs).__name__}")
    ref_rows = 0
    for i, r in enumerate(refs):
        r = tuple(int(x) for x in r) if isinstance(r, (list, tuple)) else r
        if not isinstance(r, tuple) or len(r) < 2 or any(x <= 0 for x in r):
            raise MemoryModelError(f"reference latent {i} must be a shape [.., h, w] with h, w >= 1, got {r!r}")
        if math.prod(r) > MAX_LATENT_ELEMENTS:
            raise MemoryModelError(f"reference latent {i} {r} is absurdly large ({math.prod(r):.3g} elements)")
        ref_rows += -(-r[-2] // p) * -(-r[-1] // p)
    image = -(-dims[2] // p) * -(-dims[3] // p)
    tok = Tokens(video=image, text=max(t, m), refs=ref_rows, image=True)
    if tok.total > MAX_TOKENS:
        raise MemoryModelError(f"latent {tuple(latent_shape)} packs {tok.total:,} tokens (> {MAX_TOKENS:,}): absurd "
                               "for any device; check the latent's width / height and the reference images")
    return tok


def check_cfg(cfg, name: str = "cfg") -> float:
    """A guidance scale: a finite number (a NaN or infinite cfg would sample NaNs; refused naming ``name``)."""
    if isinstance(cfg, bool) or not isinstance(cfg, (int, float)):
        raise MemoryModelError(f"{name} must be a number, got {cfg!r}")
    v = float(cfg)
    if not math.isfinite(v):
        raise MemoryModelError(f"{name} must be finite, got {cfg!r}")
    return v


def uncond_runs(cfg, disable_cfg1_optimization=False) -> bool:
    """Whether ComfyUI runs the negative conditioning at all: ComfyUI 0.33 ``sampling_function`` drops it when
    ``math.isclose(cfg, 1.0)`` (relative tolerance 1e-9: 1.0 and 1 + 1e-10 skip it, 1.0000001 runs it) and the
    model options' ``disable_cfg1_optimization == False`` (the host's own comparison). A NaN / infinite cfg is
    refused (:func:`check_cfg`)."""
    v = check_cfg(cfg)
    optimized = disable_cfg1_optimization == False   # noqa: E712 (ComfyUI's own test: 0 and 0.0 count as False)
    return not (math.isclose(v, 1.0, rel_tol=CFG_REL_TOL) and optimized)


@dataclass(frozen=True)
class CondBatch:
    """The rows of one forward: ``groups`` conditioning items ComfyUI concatenates into one forward (cond + uncond
    under CFG) times the latent's own batch, and why (said in every report)."""
    groups: int
    latent: int = 1
    reason: str = "cond only"

    @property
    def total(self) -> int:
        return self.groups * self.latent

    def describe(self) -> str:
        lat = f" x latent batch {self.latent}" if self.latent != 1 else ""
        return f"batch {self.total} = {self.groups} conditioning{'s' if self.groups != 1 else ''}{lat} ({self.reason})"


def cond_batch(cfg, cond_keys, uncond_keys, latent_batch: int = 1, concatenates: bool = True,
               disable_cfg1_optimization=False, fits=None, uncond_assumed: bool = False,
               guider: str = "") -> CondBatch:
    """How many conditioning items ComfyUI 0.33 runs in one forward of a sampling step (``sampling_function`` +
    ``_calc_cond_batch``): the cond items always, the uncond items unless :func:`uncond_runs` says ComfyUI skips
    them; among those, items with equal concat keys (``cond_keys`` / ``uncond_keys``: one hashable per conditioning
    item, equal when ComfyUI's ``can_concat_cond`` joins them; ``None`` joins nothing) go into one forward, unless
    the model never concatenates (``concatenates`` False: MiniMax H3's per-item packed layout). ComfyUI then tries
    ``n``, ``n // 2``, ``n // 3`` ... items and keeps the first that its own memory estimate says fits (``fits(k)``;
    None: every size fits), else one. ``latent_batch`` multiplies the rows; ``uncond_assumed``: the uncond's keys
    are a guess (the node, before the sampler's conditioning exists), said in the reason. ``guider``: the name of a
    guider with its own guidance rule (not ComfyUI's CFGGuider): every item of both lists is taken to run."""
    v = check_cfg(cfg)
    if isinstance(latent_batch, bool) or not isinstance(latent_batch, int) or latent_batch < 1:
        raise MemoryModelError(f"latent batch must be an int >= 1, got {latent_batch!r}")
    runs = True if guider else uncond_runs(v, disable_cfg1_optimization)
    items = list(cond_keys) + (list(uncond_keys) if runs else [])
    if not items:
        items = [()]
    why = f"cfg {v:g}"
    if guider:
        why = f"{guider}: its own guidance rule, every conditioning taken to run"
    elif not runs:
        why += ": ComfyUI skips the uncond"
    elif not math.isclose(v, 1.0, rel_tol=CFG_REL_TOL):
        why += ": the uncond runs" + (" (its shape assumed the cond's)" if uncond_assumed else "")
    else:
        why += ": the uncond runs (disable_cfg1_optimization)"
    if not concatenates:
        n = 1
        if len(items) > 1:
            why += "; this model never batches conditionings: one forward each"
    else:
        counts: dict = {}
        for k in items:
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        n = max(counts.values(), default=1)
        if n > 1:
            why += f"; ComfyUI batches {n} into one forward"
        elif len(items) > 1:
            why += "; their shapes differ: one forward each"
    chosen = 1
    for i in range(1, n + 1):
        if fits is None or fits(n // i):
            chosen = n // i
            break
    if chosen < n:
        why += f", but ComfyUI's own memory estimate for {n} does not fit the free memory: {chosen} per forward"
    return CondBatch(chosen, latent_batch, why)


REF_KINDS = ("image", "audio", "video", "video_audio")


def _count(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MemoryModelError(f"{name} must be an int >= 0, got {v!r}")
    if v > MAX_TOKENS:
        raise MemoryModelError(f"{name} = {v:,} is absurd (> {MAX_TOKENS:,})")
    return v


def h3_ref_rows(kind: str, latent_t: int = 0, latent_h: int = 0, latent_w: int = 0, ref_audio_t: int = 0) -> int:
    """Packed rows of one H3 ref2va reference block (ComfyUI's layout: each 2x2 patch of a reference frame is one
    row, ``(h // 2) * (w // 2)`` per frame; stereo audio two rows per latent frame): ``image`` one frame;
    ``audio`` ``2 * ref_audio_t``; ``video`` / ``video_audio`` ``2 * ref_audio_t + latent_t`` frames."""
    if kind not in REF_KINDS:
        raise MemoryModelError(f"unknown H3 reference kind {kind!r} (one of {REF_KINDS})")
    t, h, w, a = (_count(v, f"reference {n}") for v, n in ((latent_t, "latent_t"), (latent_h, "latent_h"),
                                                           (latent_w, "latent_w"), (ref_audio_t, "ref_audio_t")))
    frame = (h // 2) * (w // 2)
    if kind == "image":
        if frame <= 0:
            raise MemoryModelError(f"image reference of latent {h}x{w} has no 2x2 patch")
        rows = frame
    elif kind == "audio":
        rows = 2 * a
    else:
        rows = 2 * a + t * frame
    return _count(rows, f"{kind} reference rows")


def h3_keyframe_rows(latent_t: int, audio_t: int, frame_rows: int) -> int:
    """Packed rows of one H3 fl2va keyframe: ``latent_t`` frames on the target's patch grid (``frame_rows`` rows per
    frame) plus ``2 * audio_t`` rows of keyframe audio."""
    t, a, f = (_count(v, n) for v, n in ((latent_t, "keyframe latent_t"), (audio_t, "keyframe audio_t"),
                                         (frame_rows, "frame_rows")))
    return _count(t * f + 2 * a, "keyframe rows")


@dataclass
class Suggestion:
    settings: dict
    prediction: Prediction
    job_peak: int = 0      # the larger of the step and the VAE decode with these settings (0: the step's)

    @property
    def peak(self) -> int:
        return max(self.prediction.device, self.job_peak)

    def line(self) -> str:
        s = ", ".join(f"{k} {v}" for k, v in self.settings.items())
        return f"{s}: predicted {self.peak / GIB:.2f} GiB"


@dataclass
class Plan:
    tokens: Tokens
    prediction: Prediction
    available: int
    where: str
    options: Options
    suggestions: list[Suggestion] = field(default_factory=list)
    decode_parts: dict = field(default_factory=dict)   # the VAE decode's bytes by part (empty: not planned)
    decode_keeps_weights: bool = False                 # the DiT's weights stay beside the decode (CPU host)
    batch: CondBatch | None = None                     # the rows of one forward and why (None: not said)
    note: str = ""                                     # said after the prediction (the node: the other cfg case)

    def decode_bytes(self, pred: Prediction | None = None) -> int:
        """Peak of the VAE decode after sampling (0 when no VAE was given)."""
        if not self.decode_parts:
            return 0
        pred = pred or self.prediction
        return int(sum(self.decode_parts.values())) + (pred.parts["weights_device"] if self.decode_keeps_weights
                                                       else 0)

    def peak(self, pred: Prediction | None = None) -> int:
        """The job's peak: the larger of one sampling step and the VAE decode."""
        pred = pred or self.prediction
        return max(pred.device, self.decode_bytes(pred))

    @property
    def fits(self) -> bool:
        return self.peak() <= self.available

    @property
    def shortfall(self) -> int:
        return max(0, self.peak() - self.available)

    def summary(self) -> str:
        t = self.tokens
        batch = f", {self.batch.describe()}" if self.batch is not None else ""
        head = (f"{t.describe()}{batch}; predicted peak {self.peak() / GIB:.2f} GiB vs "
                f"{self.available / GIB:.2f} GiB {self.where} [{self.options.describe()}]")
        if self.note:
            head += f" ({self.note})"
        if self.decode_parts:
            head += (f"; sampling step {self.prediction.device / GIB:.2f} GiB, VAE decode "
                     f"{self.decode_bytes() / GIB:.2f} GiB")
        if self.fits:
            return head + ": fits"
        if self.decode_parts and self.decode_bytes() > self.available and not self.suggestions:
            tail = ("none: the VAE decode alone needs more; decode tiled (VAE Decode (Tiled)) or lower the "
                    "resolution / length")
        else:
            tail = "; ".join(s.line() for s in self.suggestions) or "nothing ditkit can set fits"
        return head + f": SHORT by {self.shortfall / GIB:.2f} GiB. Settings that fit: {tail}"

    def as_dict(self) -> dict:
        return {"tokens": self.tokens.as_dict(), "predicted_bytes": self.peak(),
                "step_bytes": self.prediction.device, "decode_bytes": self.decode_bytes(),
                "decode_parts": dict(self.decode_parts),
                "available_bytes": self.available, "where": self.where, "fits": self.fits,
                "shortfall_bytes": self.shortfall, "parts": self.prediction.parts,
                "batch": self.options.batch,
                **({"batch_reason": self.batch.reason} if self.batch is not None else {}),
                "suggestions": [{"settings": s.settings, "predicted_bytes": s.peak}
                                for s in self.suggestions]}


def plan(dims: DiTDims, weights: dict[str, Weights], tokens: Tokens, opts: Options, available: int, where: str,
         streaming_possible: bool, video_scale=None, max_suggestions: int = 3, decode_parts: dict | None = None,
         decode_keeps_weights: bool = False, head_groups: bool = True) -> Plan:
    """The job's prediction and, when it does not fit, the fitting settings with the fewest changes (then the
    cheapest: chunking before streaming before a lower-precision format), at most ``max_suggestions``; when no
    setting fits, the longest video (fraction of the video tokens; for an image model the largest image area, named
    ``image_tokens``) that fits with every saving on.

    ``weights``: the model's weights per format name (``opts.weight_format`` must be one of them; formats not
    present are not suggested).

    ``decode_parts``: the VAE decode's bytes by part (the job's peak is the larger of the step and the decode; a
    decode that alone exceeds ``available`` gets no DiT suggestion); ``decode_keeps_weights``: the DiT's weights
    stay in the same memory during the decode (a CPU host), so each setting's weights count there too;
    ``head_groups``: whether attention head groups apply to this model (suggested only then)."""
    if opts.weight_format not in weights:
        raise MemoryModelError(f"no weight inventory for the model's format {opts.weight_format!r}")
    parts = {}
    for k, v in (decode_parts or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise MemoryModelError(f"VAE decode part {k!r} must be a finite number of bytes >= 0, got {v!r}")
        parts[str(k)] = int(v)
    pred = predict(dims, weights[opts.weight_format], tokens, opts)
    p = Plan(tokens, pred, available, where, opts, decode_parts=parts, decode_keeps_weights=decode_keeps_weights)
    if p.fits or (parts and sum(parts.values()) > available):
        return p
    group = dims.heads if opts.head_group is None else opts.head_group
    knobs = {"chunk_tokens": [c for c in CHUNKS if opts.chunk is None or c < opts.chunk],
             "attention_heads_per_call": (sorted({max(1, dims.heads // k) for k in (2, 4, 8)} | {1}, reverse=True)
                                          if opts.attention != "flash" and head_groups else []),
             "streaming": [True] if streaming_possible and not opts.streaming else [],
             "weight_format": [f for f in SUGGEST_FORMATS if f in weights and f != opts.weight_format]}
    knobs["attention_heads_per_call"] = [g for g in knobs["attention_heads_per_call"] if g < group]
    cost = {"chunk_tokens": 0, "attention_heads_per_call": 0, "streaming": 1, "weight_format": 2}
    names = [k for k in knobs if knobs[k]]
    found: list[tuple[int, int, Suggestion]] = []
    for r in range(1, len(names) + 1):
        for combo in itertools.combinations(names, r):
            for values in itertools.product(*(knobs[k] for k in combo)):
                s = dict(zip(combo, values))
                o = _apply(opts, s)
                pr = predict(dims, weights[o.weight_format], tokens, o)
                if p.peak(pr) <= available:
                    found.append((sum(cost[k] for k in combo), -_gentleness(s), Suggestion(s, pr, p.peak(pr))))
        if found:
            break
    found.sort(key=lambda x: (x[0], x[1]))
    seen = set()
    for _, _, sug in found:
        key = tuple(sorted(sug.settings))
        if key in seen:
            continue
        seen.add(key)
        p.suggestions.append(sug)
        if len(p.suggestions) >= max_suggestions:
            break
    if not p.suggestions:
        best = {"chunk_tokens": CHUNKS[-1],
                **({"attention_heads_per_call": 1} if knobs["attention_heads_per_call"] else {}),
                **({"streaming": True} if knobs["streaming"] else {}),
                **({"weight_format": knobs["weight_format"][-1]} if knobs["weight_format"] else {})}
        o = _apply(opts, best)
        w = weights[o.weight_format]
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            t = replace(tokens, video=max(1, int(tokens.video * mid)))
            if p.peak(predict(dims, w, t, o)) <= available:
                lo = mid
            else:
                hi = mid
        if lo > 0:
            t = replace(tokens, video=max(1, int(tokens.video * lo)))
            if tokens.image:
                s = dict(best, image_tokens=f"<= {t.video:,} ({lo:.0%} of the area)")
            else:
                s = dict(best, video_tokens=f"<= {t.video:,} ({lo:.0%} of the length x area)")
            if video_scale is not None:
                s["resolution_or_length"] = video_scale(lo)
            pr = predict(dims, w, t, o)
            p.suggestions.append(Suggestion(s, pr, p.peak(pr)))
    return p


def _gentleness(s: dict) -> int:
    """Among fitting settings of equal cost prefer the largest chunk, the largest head group and the
    higher-precision format."""
    g = 0
    if "chunk_tokens" in s:
        g += s["chunk_tokens"]
    if "attention_heads_per_call" in s:
        g += s["attention_heads_per_call"]
    if s.get("weight_format") == "float8_e4m3fn":
        g += 10 ** 6
    return g


def _apply(opts: Options, s: dict) -> Options:
    o = opts
    if "chunk_tokens" in s:
        o = replace(o, chunk=s["chunk_tokens"])
    if "attention_heads_per_call" in s:
        o = replace(o, head_group=s["attention_heads_per_call"])
    if "streaming" in s:
        o = replace(o, streaming=bool(s["streaming"]))
    if "weight_format" in s:
        o = replace(o, weight_format=s["weight_format"])
    return o
