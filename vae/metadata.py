"""Strict validation of the H3 single-frame image-VAE safetensors metadata (h3.md §4.6).

A VAE file is an *image VAE* when its ``__metadata__`` carries any of the ``h3_t1_*`` keys or
``minimax_h3_video_vae``; then every rule below must hold, otherwise loading fails with a
:class:`~ditkit.errors.MetadataError` naming the key and the value. There is no silent fallback: a file that says
``h3_t1_direct: "false"`` is refused, not quietly treated as a video VAE.

* ``h3_t1_direct`` exactly ``"true"`` or ``"1"``;
* ``h3_t1_format`` exactly ``"full_decoder_v1"``;
* ``h3_t1_output_slice`` exactly one character ``0``..``3``;
* ``minimax_h3_video_vae``: at most 65536 characters of strict JSON (no duplicate keys, no NaN/Infinity), an
  object with ``latents_mean`` / ``latents_std`` (24 finite numbers each, std > 0), ``vae_clip_length`` 17,
  ``vae_token_drop`` 3 and ``source_config`` equal to the stock ``AutoencoderKLLegacy`` config field by field
  (``_diffusers_version`` not compared).

Tiny/scaled files: ``source_config`` names the architecture family and must be the stock one; the tensors are then
checked against the config detected from the file's own shapes (:func:`..vae.h3_layout.detect_video_config`), and
the metadata whitening stats must equal the file's ``latents_mean``/``latents_std`` tensors (within float16
rounding, as the released file stores them in F16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MetadataError
from ..loaders.safetensors_io import strict_json_loads
from ..report import Report
from .h3_layout import SOURCE_CONFIG_IGNORED, STOCK_SOURCE_CONFIG

IMAGE_VAE_KEYS = ("h3_t1_direct", "h3_t1_format", "h3_t1_output_slice", "minimax_h3_video_vae")
MAX_CONFIG_CHARS = 65536
LATENT_CHANNELS = 24


@dataclass(frozen=True)
class ImageVAEInfo(Report):
    direct: bool
    output_slice: int
    format: str
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    decoder_sha256: str | None = None
    base_sha256: str | None = None

    KEYS = ("h3_t1_direct=direct", "h3_t1_output_slice=output_slice", "h3_t1_format=format",
            "h3_t1_decoder_sha256=decoder_sha256", "h3_t1_base_sha256=base_sha256")


def _short(v, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + f"...' ({len(v) if isinstance(v, str) else '?'} chars)"


def is_image_vae_metadata(meta: dict[str, str]) -> bool:
    return any(k in meta for k in IMAGE_VAE_KEYS)


def validate_image_vae_metadata(meta: dict[str, str], where: str) -> ImageVAEInfo | None:
    """None for a plain video VAE (no image-VAE keys at all); else the validated info, or MetadataError."""
    if not is_image_vae_metadata(meta):
        return None

    def err(key: str, value, why: str) -> MetadataError:
        return MetadataError(f"{where}: __metadata__ {key!r} = {_short(value)}: {why}. This file declares the H3 "
                             "single-frame image-VAE capability but its metadata is invalid; fix or re-export the "
                             "file (ditkit never falls back to another decode path)")

    for k in IMAGE_VAE_KEYS:
        if k not in meta:
            raise err(k, None, "missing (an image VAE must carry all of " + ", ".join(IMAGE_VAE_KEYS) + ")")
    direct = meta["h3_t1_direct"]
    if direct not in ("true", "1"):
        raise err("h3_t1_direct", direct, 'must be exactly "true" or "1"')
    fmt = meta["h3_t1_format"]
    if fmt != "full_decoder_v1":
        raise err("h3_t1_format", fmt, 'must be exactly "full_decoder_v1"')
    sl = meta["h3_t1_output_slice"]
    if not (len(sl) == 1 and sl in "0123"):
        raise err("h3_t1_output_slice", sl, "must be exactly one digit 0..3 (one of the 4 frames a token decodes to)")
    raw = meta["minimax_h3_video_vae"]
    key = "minimax_h3_video_vae"
    if len(raw) > MAX_CONFIG_CHARS:
        raise err(key, raw, f"longer than {MAX_CONFIG_CHARS} characters")
    try:
        cfg = strict_json_loads(raw, f"{where}: __metadata__ {key!r}", what="safetensors metadata value")
    except Exception as e:  # noqa: BLE001 - re-raised as MetadataError with the key named
        raise err(key, raw, f"not valid strict JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise err(key, raw, "must be a JSON object")

    def floats(name: str, positive: bool) -> tuple[float, ...]:
        v = cfg.get(name)
        if not isinstance(v, list) or len(v) != LATENT_CHANNELS:
            raise err(key, raw, f"'{name}' must be a list of exactly {LATENT_CHANNELS} numbers "
                                f"(got {type(v).__name__}{' of ' + str(len(v)) if isinstance(v, list) else ''})")
        out = []
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
                raise err(key, raw, f"'{name}[{i}]' = {x!r} is not a finite number")
            if positive and not float(x) > 0:
                raise err(key, raw, f"'{name}[{i}]' = {x!r} must be > 0")
            out.append(float(x))
        return tuple(out)

    mean = floats("latents_mean", False)
    std = floats("latents_std", True)
    for name, want in (("vae_clip_length", 17), ("vae_token_drop", 3)):
        v = cfg.get(name)
        if isinstance(v, bool) or v != want:
            raise err(key, raw, f"'{name}' = {v!r}, the stock H3 video VAE has {want}")
    sc = cfg.get("source_config")
    if not isinstance(sc, dict):
        raise err(key, raw, f"'source_config' must be an object (got {type(sc).__name__})")
    _check_source_config(sc, lambda why: err(key, raw, why))
    extra = sorted(set(cfg) - {"latents_mean", "latents_std", "vae_clip_length", "vae_token_drop", "source_config"})
    if extra:
        raise err(key, raw, f"unknown fields {extra}")
    return ImageVAEInfo(direct=True, output_slice=int(sl), format=fmt, latents_mean=mean, latents_std=std,
                        decoder_sha256=meta.get("h3_t1_decoder_sha256"), base_sha256=meta.get("h3_t1_base_sha256"))


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _check_source_config(sc: dict, fail) -> None:
    stock = STOCK_SOURCE_CONFIG
    for k in sorted(set(stock) | set(sc)):
        if k in SOURCE_CONFIG_IGNORED:
            continue
        if k not in sc:
            raise fail(f"'source_config.{k}' is missing (stock: {stock[k]!r})")
        if k not in stock:
            raise fail(f"'source_config.{k}' = {sc[k]!r} is not a field of the stock architecture")
        if isinstance(stock[k], dict):
            if not isinstance(sc[k], dict):
                raise fail(f"'source_config.{k}' must be an object")
            for kk in sorted(set(stock[k]) | set(sc[k])):
                if kk not in sc[k] or kk not in stock[k] or not _same(sc[k][kk], stock[k][kk]):
                    raise fail(f"'source_config.{k}.{kk}' = {sc[k].get(kk, '<missing>')!r} differs from the stock "
                               f"architecture ({stock[k].get(kk, '<no such field>')!r})")
        elif not _same(sc[k], stock[k]):
            raise fail(f"'source_config.{k}' = {sc[k]!r} differs from the stock architecture ({stock[k]!r})")


def check_whitening_matches(info: ImageVAEInfo, file_mean, file_std, where: str) -> None:
    """The metadata whitening stats must be the file's own ``latents_mean``/``latents_std`` (float16 rounding)."""
    for name, meta_vals, tensor in (("latents_mean", info.latents_mean, file_mean),
                                    ("latents_std", info.latents_std, file_std)):
        vals = [float(x) for x in tensor.flatten().tolist()]
        for i, (a, b) in enumerate(zip(meta_vals, vals)):
            if abs(a - b) > 1e-3 * max(1.0, abs(a)):
                raise MetadataError(f"{where}: __metadata__ 'minimax_h3_video_vae' {name}[{i}] = {a!r} but the "
                                    f"file's tensor {name!r} holds {b!r}: the metadata does not describe these weights")
