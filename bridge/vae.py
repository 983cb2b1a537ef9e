"""The H3 video / image VAE of ComfyUI (``VAE.first_stage_model``, a ``MiniMaxH3VideoVAE``) as the T=1 core's
:class:`~ditkit.vae.t1_decode.H3VaeOps`.

ComfyUI's object has no public single-frame path: the core needs its pixel decode (``_decode_pixels``: post_quant_conv
+ ViT decoder), pixel finalisation (``_finalize_pixels``) and temporal chunk plan (``_decode_temporal_chunks``),
which are private methods; they are read here, once per decode, and nowhere in the core. Works on anything with
those names (the reference VAE of ``benchmarks/lab`` and the unit tests' fakes mirror ComfyUI's object), so no
ComfyUI import is needed.
"""
from __future__ import annotations

from ..vae import t1_decode as core
from ..vae.t1_decode import H3VaeOps

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
        patch_size_t=int(getattr(getattr(m, "decoder", None), "patch_size_t", 4)))


def repeat_decode_t1(m, z, progress=None, *, checked: bool = False):
    """:func:`ditkit.vae.t1_decode.repeat_decode_t1` on ComfyUI's H3 video VAE ``m``."""
    return core.repeat_decode_t1(h3_vae_ops(m), z, progress, checked=checked)


def direct_decode_t1(m, z, output_slice: int, progress=None, *, checked: bool = False):
    """:func:`ditkit.vae.t1_decode.direct_decode_t1` on ComfyUI's H3 image VAE ``m``."""
    return core.direct_decode_t1(h3_vae_ops(m), z, output_slice, progress, checked=checked)


def tiled_decode_frame(m, z, frame: int, report=None, progress=None):
    """:func:`ditkit.vae.t1_decode.tiled_decode_frame` on ComfyUI's H3 VAE ``m``."""
    return core.tiled_decode_frame(h3_vae_ops(m), z, frame, report, progress)


unwhiten = core.unwhiten  # reads latents_mean / latents_std only
