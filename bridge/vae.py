"""The H3 video / image VAE of ComfyUI (``VAE.first_stage_model``, a ``MiniMaxH3VideoVAE``) as the T=1 core's
:class:`~ditkit.vae.t1_decode.H3VaeOps`.

ComfyUI's object has no public single-frame path: the core needs its pixel decode (``_decode_pixels``: post_quant_conv
+ ViT decoder), pixel finalisation (``_finalize_pixels``) and temporal chunk plan (``_decode_temporal_chunks``),
which are private methods; they are read here, once per decode, and nowhere in the core. Works on anything with
those names (the reference VAE of ``benchmarks/lab`` and the unit tests' fakes mirror ComfyUI's object), so no
ComfyUI import is needed.
"""
from __future__ import annotations

import functools

from ..errors import DitKitError
from ..vae import t1_decode as core
from ..vae.t1_decode import H3VaeOps, T1DecodeReport
from .hostcompat import host_t1_path, host_tiled_decode_frame

# what a VAE object must have to be decoded here (checked by the decode node before any work)
REQUIRED = ("_decode_temporal_chunks", "_decode_pixels", "latents_mean", "split_tiles", "frame_pre_padding")


def is_h3_vae(m) -> bool:
    return m is not None and all(hasattr(m, a) for a in REQUIRED)


def h3_vae_ops(m) -> H3VaeOps:
    """The decode steps of ComfyUI's ``MiniMaxH3VideoVAE`` ``m`` (bound methods, read now)."""
    return H3VaeOps(
        decode_pixels=m._decode_pixels, finalize_pixels=m._finalize_pixels,
        temporal_chunks=m._decode_temporal_chunks, split_tiles=m.split_tiles, blend=m.blend,
        latents_mean=m.latents_mean, latents_std=m.latents_std, vae_ratio=int(m.vae_ratio),
        tiling=bool(getattr(m, "tiling", True)), frame_pre_padding=int(m.frame_pre_padding),
        tokens_chunk_size=int(m.tokens_chunk_size), token_overlap=int(m.token_overlap),
        patch_size_t=int(getattr(getattr(m, "decoder", None), "patch_size_t", 4)),
        # the host's own tiled decode (its blending: 0.33 raw neighbours, 0.38 already-blended ones), per frame
        tiled_frame=(functools.partial(host_tiled_decode_frame, m)
                     if callable(getattr(type(m), "tiled_decode", None)) else None))


@functools.lru_cache(maxsize=8)
def _t1_path(cls) -> str:
    return host_t1_path(cls)


def repeat_decode_t1(m, z, progress=None, *, checked: bool = False):
    """:func:`ditkit.vae.t1_decode.repeat_decode_t1` on ComfyUI's H3 video VAE ``m``; when the host has its own
    single-image path (detected on the class's ``decode``, ``hostcompat.host_t1_path``; announced for 0.40), that
    path runs instead and the report says so."""
    ops = h3_vae_ops(m)
    if callable(getattr(type(m), "decode", None)) and _t1_path(type(m)) == "host_single_image":
        if not checked:
            core._check_latent(ops, z)
        out = m.decode(z)
        b, h, w = z.shape[0], z.shape[-2] * ops.vae_ratio, z.shape[-1] * ops.vae_ratio
        if tuple(out.shape) != (b, 3, 1, h, w):
            raise DitKitError(f"the host's own T=1 decode returned shape {tuple(out.shape)}, expected "
                              f"{(b, 3, 1, h, w)}; see docs/compat.md")
        if progress is not None:
            progress(1, 1)
        rep = T1DecodeReport("host_single_image", b, (z.shape[-2], z.shape[-1]), 1, -1, tiles=0,
                             canvas_bytes=out.numel() * out.element_size())
        rep.extra["blending"] = "host decode"
        return out, rep
    return core.repeat_decode_t1(ops, z, progress, checked=checked)


def direct_decode_t1(m, z, output_slice: int, progress=None, *, checked: bool = False):
    """:func:`ditkit.vae.t1_decode.direct_decode_t1` on ComfyUI's H3 image VAE ``m``."""
    return core.direct_decode_t1(h3_vae_ops(m), z, output_slice, progress, checked=checked)


def tiled_decode_frame(m, z, frame: int, report=None, progress=None):
    """:func:`ditkit.vae.t1_decode.tiled_decode_frame` on ComfyUI's H3 VAE ``m``."""
    return core.tiled_decode_frame(h3_vae_ops(m), z, frame, report, progress)


unwhiten = core.unwhiten  # reads latents_mean / latents_std only
