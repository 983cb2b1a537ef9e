"""H3 video-VAE decode of a single latent frame (T = 1): repeat-decode, per-frame tile slicing, image-VAE direct.

Works on an :class:`H3VaeOps`: the VAE's decode steps as plain callables and numbers. ``bridge/vae.py`` builds it
from ComfyUI's ``MiniMaxH3VideoVAE`` (``VAE.first_stage_model``: its own pixel decode = post_quant_conv + ViT
decoder, tile split, blend, pixel finalisation and temporal chunk plan); nothing here knows that object.

* :func:`repeat_decode_t1` — stock video VAE: the single token is duplicated to T = 2, which the temporal decoder
  pads (repeating the last token) to one chunk of ``tokens_chunk_size + token_overlap`` = 7 tokens; that chunk is
  decoded tile by tile exactly like the native temporal decode, and only the first valid output frame is kept
  (raw frame ``frame_pre_padding`` = 3 of token 0, i.e. output frame 0 of the 5 frames T = 2 decodes to).
* :func:`direct_decode_t1` — image VAE (``h3_t1_direct``): the single token is decoded directly and the declared
  ``h3_t1_output_slice`` frame is kept.
* Both slice every decoded tile to the kept frame BEFORE blending, so the canvas and the blend tails hold one frame
  (memory independent of the 28 frames the decoder produced internally per tile).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import DitKitError
from ..report import ProgressFn, Report
from .preflight import check_latent_shape


@dataclass
class T1DecodeReport(Report):
    path: str                  # "repeat_decode" | "direct_image_vae" | "host_single_image"
    batch: int
    latent_hw: tuple[int, int]
    tokens_decoded: int        # temporal tokens the decoder ran on per tile
    kept_raw_frame: int        # index of the decoder frame kept per tile
    tiles: int = 0
    tiled: bool = True
    canvas_bytes: int = 0
    max_tile_bytes: int = 0    # largest raw decoder output of one tile (transient)
    extra: dict = field(default_factory=dict)

    KEYS = ("path", "batch", "latent_hw", "tokens_decoded", "kept_raw_frame", "tiles", "tiled", "canvas_bytes",
            "max_tile_bytes", "**extra")

    def summary(self) -> str:
        if self.path == "host_single_image":
            return (f"T=1 decode: ComfyUI's own single-image path (the host has one; ditkit deferred to it), batch "
                    f"{self.batch}")
        how = "duplicated to a 7-token clip, kept first valid frame" if self.path == "repeat_decode" else \
            f"image VAE direct, h3_t1_output_slice {self.kept_raw_frame}"
        return (f"T=1 decode ({how}): batch {self.batch}, {self.tiles} tile(s)"
                f"{'' if self.tiled else ' (untiled)'}, canvas {self.canvas_bytes / 2**20:.2f} MiB")


@dataclass(frozen=True)
class H3VaeOps:
    """What the T=1 decode needs from an H3 video / image VAE (built by ``bridge/vae.h3_vae_ops``)."""
    decode_pixels: Callable[[torch.Tensor], torch.Tensor]    # raw latents [B, C, t, h, w] -> raw decoder pixels
    finalize_pixels: Callable[[torch.Tensor], torch.Tensor]  # raw decoder pixels -> float pixels in [0, 1]
    temporal_chunks: Callable[[int], tuple[int, int]]         # latent tokens -> (pad tokens, chunks) of the native plan
    split_tiles: Callable[[int], tuple]                      # pixel length -> (starts, lengths, overlaps)
    blend: Callable[..., torch.Tensor]                       # blend(a, b, extent, dim=...)
    latents_mean: torch.Tensor
    latents_std: torch.Tensor
    vae_ratio: int
    tiling: bool
    frame_pre_padding: int
    tokens_chunk_size: int
    token_overlap: int
    patch_size_t: int                                        # decoder frames one latent token decodes to
    # the VAE's own tiled decode, run one decoder frame per tile: tiled_frame(z, frame, on_tile) -> raw pixels
    # [B, 3, 1, H, W]; on_tile(raw) sees every decoder output. None: a duck-typed VAE without one (this module's
    # blending loop runs, and the report says so)
    tiled_frame: Callable[..., torch.Tensor] | None = None


def _check_latent(vae: H3VaeOps, z: torch.Tensor) -> None:
    if z.ndim != 5:
        raise DitKitError(f"H3 video latent must be 5-D [B, C, T, H, W]; got shape {tuple(z.shape)}")
    c = int(vae.latents_mean.numel())
    if z.shape[1] != c:
        raise DitKitError(f"latent has {z.shape[1]} channels but this H3 VAE expects {c} "
                          f"(shape {tuple(z.shape)}); is it a latent of another model?")
    check_latent_shape(z.shape, "H3 T=1 decode", "samples")   # no empty batch / frame / width / height
    if z.shape[2] != 1:
        raise DitKitError(f"T=1 decode got a latent with T={z.shape[2]} (shape {tuple(z.shape)})")


def unwhiten(vae, z: torch.Tensor) -> torch.Tensor:
    """Normalised latents -> raw latents (same arithmetic as the native decode)."""
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(z)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(z)
    return z * std + mean


def tiled_decode_frame(vae: H3VaeOps, z: torch.Tensor, frame: int, report: T1DecodeReport | None = None,
                       progress: ProgressFn | None = None) -> torch.Tensor:
    """Decode raw latents ``z`` [B, C, t, h, w] with the VAE's spatial tiling, keeping only decoder frame ``frame``
    of every tile before blending. Returns raw decoder pixels [B, 3, 1, H, W] (not yet de-normalised).

    ``progress(done, total)`` is called after each tile is decoded and placed, in units of tile x batch item (one
    decoder call decodes one tile of every batch item): ``total`` = tiles x B, ``done`` = B, 2B, ..., total."""
    b = int(z.shape[0])
    if not vae.tiling:
        out = vae.decode_pixels(z)
        if report is not None:
            report.tiled = False
            report.tiles = 1
            report.max_tile_bytes = out.numel() * out.element_size()
        out = out[:, :, frame:frame + 1].clone()
        if report is not None:
            report.canvas_bytes = out.numel() * out.element_size()
        if progress is not None:
            progress(b, b)
        return out
    r = int(vae.vae_ratio)
    height, width = z.shape[-2] * r, z.shape[-1] * r
    y_idx, y_len, y_ov = vae.split_tiles(height)
    x_idx, x_len, x_ov = vae.split_tiles(width)
    total = len(y_idx) * len(x_idx) * b
    done = 0
    if vae.tiled_frame is not None:
        return _host_tiled_frame(vae, z, frame, b, total, report, progress)
    if report is not None:
        report.extra["blending"] = "ditkit loop (this VAE has no tiled_decode of its own)"
    canvas = None
    above: list[torch.Tensor] = []  # bottom strips of the previous row's raw tiles
    oy = 0
    tile = None
    for i, (y0, yl) in enumerate(zip(y_idx, y_len)):
        below: list[torch.Tensor] = []
        left = None
        ox = 0
        for j, (x0, xl) in enumerate(zip(x_idx, x_len)):
            raw = vae.decode_pixels(z[..., y0 // r:y0 // r + yl // r, x0 // r:x0 // r + xl // r])
            if report is not None:
                report.tiles += 1
                report.max_tile_bytes = max(report.max_tile_bytes, raw.numel() * raw.element_size())
            tile = raw[:, :, frame:frame + 1]
            del raw
            last_row, last_col = i == len(y_idx) - 1, j == len(x_idx) - 1
            if not last_row:
                below.append(tile[..., -y_ov[i]:, :].clone())
            right = tile[..., :, -x_ov[j]:].clone() if not last_col else None
            if i > 0:
                tile = vae.blend(above[j], tile, y_ov[i - 1], dim=-2)
            if j > 0:
                tile = vae.blend(left, tile, x_ov[j - 1], dim=-1)
            left = right
            if not last_row:
                tile = tile[..., :-y_ov[i], :]
            if not last_col:
                tile = tile[..., :, :-x_ov[j]]
            if canvas is None:
                canvas = torch.empty(*tile.shape[:-2], height, width, dtype=tile.dtype, device=tile.device)
                if report is not None:
                    report.canvas_bytes = canvas.numel() * canvas.element_size()
            canvas[..., oy:oy + tile.shape[-2], ox:ox + tile.shape[-1]].copy_(tile)
            ox += tile.shape[-1]
            done += b
            if progress is not None:
                progress(done, total)
        above = below
        oy += tile.shape[-2]
    return canvas


def _host_tiled_frame(vae: H3VaeOps, z, frame, b, total, report, progress):
    """The VAE's own tiled decode (its tiles, tile batching and blending), one decoder frame per tile."""
    done = 0

    def on_tile(raw):
        nonlocal done
        if report is not None:
            report.tiles += max(1, raw.shape[0] // b)
            report.max_tile_bytes = max(report.max_tile_bytes, raw.numel() * raw.element_size())
        done = min(total, done + raw.shape[0])
        if progress is not None:
            progress(done, total)

    canvas = vae.tiled_frame(z, frame, on_tile)
    if report is not None:
        report.canvas_bytes = canvas.numel() * canvas.element_size()
        report.extra["blending"] = "host tiled_decode"
    return canvas


def repeat_clip_tokens(vae: H3VaeOps) -> tuple[int, int]:
    """(tokens of the first temporal chunk the native decoder runs for a 2-token latent, kept raw frame)."""
    pad, chunks = vae.temporal_chunks(2)
    tokens = min(2 + int(pad), int(vae.tokens_chunk_size) + int(vae.token_overlap))
    if chunks < 1 or tokens < 2:
        raise DitKitError(f"unexpected H3 temporal chunk plan for T=2: pad {pad}, chunks {chunks}")
    return tokens, int(vae.frame_pre_padding)


def repeat_decode_t1(vae: H3VaeOps, z: torch.Tensor, progress: ProgressFn | None = None, *,
                     checked: bool = False) -> tuple[torch.Tensor, T1DecodeReport]:
    """Stock video VAE, T = 1: float32 pixels [B, 3, 1, H, W] in [0, 1] equal to frame 0 of the native decode of
    the latent duplicated to T = 2. ``checked``: the caller (the decode node) already ran the latent checks."""
    if not checked:
        _check_latent(vae, z)
    tokens, kept = repeat_clip_tokens(vae)
    rep = T1DecodeReport("repeat_decode", z.shape[0], (z.shape[-2], z.shape[-1]), tokens, kept)
    raw = unwhiten(vae, z).repeat(1, 1, tokens, 1, 1)
    pix = tiled_decode_frame(vae, raw, kept, rep, progress)
    return vae.finalize_pixels(pix), rep


def direct_decode_t1(vae: H3VaeOps, z: torch.Tensor, output_slice: int, progress: ProgressFn | None = None, *,
                     checked: bool = False) -> tuple[torch.Tensor, T1DecodeReport]:
    """Image VAE, T = 1: decode the single token directly and keep decoder frame ``output_slice``.
    ``checked``: as for :func:`repeat_decode_t1`."""
    if not checked:
        _check_latent(vae, z)
    pt = int(vae.patch_size_t)
    if not 0 <= int(output_slice) < pt:
        raise DitKitError(f"h3_t1_output_slice {output_slice} is outside the {pt} frames one token decodes to")
    rep = T1DecodeReport("direct_image_vae", z.shape[0], (z.shape[-2], z.shape[-1]), 1, int(output_slice))
    pix = tiled_decode_frame(vae, unwhiten(vae, z), int(output_slice), rep, progress)
    return vae.finalize_pixels(pix), rep
