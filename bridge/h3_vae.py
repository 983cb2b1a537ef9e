"""The MiniMax H3 video / image VAE in ComfyUI: the strict loader's build (a stock ``comfy.sd.VAE``, or its
wrapper around a ``MiniMaxH3VideoVAE`` built at the file's size), the T=1-correct decode around ComfyUI's own
``VAE.decode`` / model loading, and the (video, audio) ``NestedTensor`` latent (DitKitH3VAELoader,
DitKitH3VAEDecode, DitKitH3EmptyImageLatent, DitKitH3EncodeImage; node classes in ``nodes/h3_vae.py``).
"""
from __future__ import annotations

import os

import torch

from .hostcompat import patcher_kwargs, vae_model_kwargs
from ..errors import CheckpointError, DitKitError, UnsupportedModelError
from ..loaders.read_progress import load_with_progress
from ..loaders.safetensors_io import read_header
from ..vae import preflight
from ..vae.h3_layout import (H3_VIDEO_KEYS, STOCK_VIDEO_CONFIG, classify_vae_keys, detect_video_config,
                             video_vae_plan)
from ..vae.metadata import check_whitening_matches, validate_image_vae_metadata
from .memory import check_memory_split
from .vae import direct_decode_t1, is_h3_vae, repeat_decode_t1

AUDIO_LATENT_FPS = 40
VIDEO_FPS = 24


FLOAT_DTYPES = {"F16", "BF16", "F32"}
AUDIO_LATENT_FPS = 40
VIDEO_FPS = 24


# ------------------------------------------------------------------------------------------------ loading

def _family_error(path: str, family: str) -> DitKitError:
    what = {"h3_audio": "an H3 AUDIO VAE (decode audio latents with VAEDecodeAudio)",
            "ltx_video": "an LTX video VAE (use the stock VAELoader)"}.get(family, "not a MiniMax H3 video VAE")
    return UnsupportedModelError(f"VAE file '{path}' is {what}; DitKitH3VAELoader loads H3 video VAEs and H3 "
                                 f"single-frame image VAEs (detected by the tensors {list(H3_VIDEO_KEYS)})")


def inspect_h3_vae_file(path: str) -> dict:
    """Header-only validation: family, inventory vs detected config, dtypes, image-VAE metadata."""
    header = read_header(path)
    where = f"VAE file '{os.path.basename(path)}'"
    family = classify_vae_keys(header.keys())
    if family != "h3_video":
        raise _family_error(os.path.basename(path), family)
    shapes = {k: t.shape for k, t in header.tensors.items()}
    cfg = detect_video_config(shapes, where)
    bad = [f"{k} ({t.dtype})" for k, t in header.tensors.items() if t.dtype not in FLOAT_DTYPES]
    if bad:
        raise CheckpointError(f"{where}: non-float tensors {bad[:3]} (quantized H3 VAEs are not supported here; "
                              "use the stock VAELoader)")
    info = validate_image_vae_metadata(header.metadata, where)
    return {"header": header, "config": cfg, "image": info, "where": where}


def _build_scaled_vae(sd: dict, cfg, metadata: dict) :
    """A stock ``comfy.sd.VAE`` wrapper around a ``MiniMaxH3VideoVAE`` built at the detected (scaled) size.

    The wrapper's H3 settings (ratios, memory estimates, tiling flags) come from ComfyUI's own constructor, run on
    the meta device on the stock key inventory (nothing allocated); its model is then replaced by the scaled one, a
    fresh patcher is made for it and the weights are assigned (the file's tensors, cast to the VAE dtype)."""
    import comfy.ldm.minimax.vae as h3vae
    import comfy.model_management as mm
    import comfy.sd

    probe_plan = video_vae_plan(STOCK_VIDEO_CONFIG)
    probe = {k: torch.empty(shape, device="meta") for k, shape in probe_plan.items()}
    if cfg.ffn_mult != 4:
        raise CheckpointError(f"decoder FFN width {cfg.ffn_mult}x is not buildable by ComfyUI's ViT3DDecoder (4x)")
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=probe, metadata=metadata)
        model = h3vae.MiniMaxH3VideoVAE(ch=cfg.ch, ch_mult=tuple(cfg.ch_mult), num_res_blocks=cfg.num_res_blocks,
                                        **vae_model_kwargs(h3vae.MiniMaxH3VideoVAE, cfg.dec_layers))
    model.decoder = h3vae.ViT3DDecoder(patch_size=model.vae_ratio, patch_size_t=model.vae_ratio_t,
                                       in_channels=cfg.z_channels, num_layers=cfg.dec_layers, heads=cfg.dec_heads,
                                       dim_head=cfg.dec_dim_head, num_register_tokens=cfg.num_register_tokens)
    model.pixel_mean = torch.tensor(h3vae.IMAGENET_MEAN).view(1, 3, 1, 1, 1)
    model.pixel_std = torch.tensor(h3vae.IMAGENET_STD).view(1, 3, 1, 1, 1)
    # same order as comfy.sd.VAE: cast, archive dtypes, make the patcher, then load the weights into the model
    model = model.eval().to(vae.vae_dtype)
    mm.archive_model_dtypes(model)
    vae.first_stage_model = model
    vae.patcher = type(vae.patcher)(model, load_device=vae.device, offload_device=mm.vae_offload_device(),
                                    **patcher_kwargs(type(vae.patcher), vae.patcher))
    model.load_state_dict({k: v.to(vae.vae_dtype) for k, v in sd.items()}, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"scaled H3 VAE: tensors {left[:3]} were not materialised")
    vae.size = None
    vae.model_size()
    return vae


def load_h3_vae(path: str, progress=None) -> tuple:
    """``progress(done, total)``: optional, called after each tensor read (total = tensors in the file)."""
    import comfy.sd

    facts = inspect_h3_vae_file(path)
    cfg, info, header = facts["config"], facts["image"], facts["header"]
    sd, _ = load_with_progress(path, progress)
    if info is not None:
        check_whitening_matches(info, sd["latents_mean"], sd["latents_std"], facts["where"])
    if cfg.is_stock:
        vae = comfy.sd.VAE(sd=sd, metadata=header.metadata)
        built = "stock comfy.sd.VAE"
    else:
        vae = _build_scaled_vae(sd, cfg, header.metadata)
        built = "scaled MiniMaxH3VideoVAE in a stock VAE wrapper"
    del sd
    data = {"file": os.path.basename(path), "kind": "image" if info is not None else "video",
            "config": cfg.describe(), "built": built, "tensors": len(header.tensors),
            "t1_output_slice": info.output_slice if info is not None else None,
            "t1_metadata": info.as_dict() if info is not None else None}
    vae.ditkit_h3 = data
    return vae, data


def _video_part(latent):
    if getattr(latent, "is_nested", False):
        return latent.unbind()[0]
    return latent


def _require_h3(vae):
    m = getattr(vae, "first_stage_model", None)
    if not is_h3_vae(m):
        audio = getattr(vae, "ditkit_h3", {}).get("kind") == "audio" or type(m).__name__ == "MiniMaxH3AudioVAE"
        raise UnsupportedModelError(f"DitKitH3VAEDecode needs a MiniMax H3 video or image VAE; got "
                                    f"{type(m).__name__ if m is not None else 'an invalid VAE'}"
                                    + (" (an H3 AUDIO VAE: decode audio latents with VAEDecodeAudio)" if audio else ""))
    return m


def _check_decode_memory(vae, m, latent: torch.Tensor) -> None:
    """Refuse a decode whose unavoidable allocations exceed the device budget, before anything is allocated."""
    b, c, t, h, w = (int(v) for v in latent.shape)
    ratio = int(getattr(m, "vae_ratio", 16))
    itemsize = torch.empty((), dtype=vae.vae_dtype).element_size()
    if t == 1:
        tokens = int(getattr(m, "tokens_chunk_size", 5)) + int(getattr(m, "token_overlap", 2))
        dev = {"VAE working set (ComfyUI's estimate)": float(vae.memory_used_decode((b, c, 2, h, w), vae.vae_dtype))}
        t1 = preflight.t1_decode_bytes(latent.shape, ratio, itemsize, tokens)
        host = {"output image": t1.pop("output image")}
        dev.update(t1)
    else:
        frames = int(m.decode_output_shape((1, c, t, h, w))[2]) if hasattr(m, "decode_output_shape") else 4 * t
        dev = {"VAE working set (ComfyUI's estimate)": float(vae.memory_used_decode(tuple(latent.shape), vae.vae_dtype))}
        host = {"decoded float video": b * 3 * frames * h * ratio * w * ratio * 4}
    check_memory_split("DitKitH3VAEDecode", "samples", latent.shape, vae.device, dev, host)


def h3_decode(vae, latent: torch.Tensor, progress=None) -> tuple[torch.Tensor, dict]:
    """IMAGE [N, H, W, 3] + report data. ``progress(done, total)`` (optional) follows the T=1 tile loop (tiles x
    batch); T > 1 is ComfyUI's own decode, which drives no bar for this VAE."""
    m = _require_h3(vae)
    if latent.ndim != 5:
        raise DitKitError(f"H3 video latent must be 5-D [B, 24, T, H, W]; got shape {tuple(latent.shape)}")
    c = int(m.latents_mean.numel())
    if latent.shape[1] != c:
        raise DitKitError(f"latent has {latent.shape[1]} channels but the H3 VAE expects {c} "
                          f"(shape {tuple(latent.shape)}): a latent of another model?")
    preflight.check_latent_shape(latent.shape, "DitKitH3VAEDecode", "samples")
    _check_decode_memory(vae, m, latent)
    info = getattr(vae, "ditkit_h3", None) or {}
    kind = info.get("kind", "video")
    source = "DitKitH3VAELoader" if info else "another loader (no h3_t1 metadata seen; treated as the video VAE)"
    t = latent.shape[2]
    if t > 1:
        if kind == "image":
            raise DitKitError(f"this is a single-frame IMAGE VAE ({info.get('file')}); it must not decode videos "
                              f"(latent T={t}). Load the H3 video VAE for T > 1")
        images = vae.decode(latent)
        data = {"path": "native", "frames": images.shape[1], "batch": latent.shape[0], "vae_kind": kind,
                "vae_source": source}
        return images.reshape(-1, *images.shape[-3:]), data
    import comfy.model_management as mm

    vae.throw_exception_if_invalid()
    mem = vae.memory_used_decode((latent.shape[0], c, 2) + tuple(latent.shape[3:]), vae.vae_dtype)
    mm.load_models_gpu([vae.patcher], memory_required=mem, force_full_load=vae.disable_offload)
    z = latent.to(device=vae.device, dtype=vae.vae_dtype)
    with torch.inference_mode():   # the latent was checked above (5-D, channels, no empty dimension; T = 1 here)
        if kind == "image":
            out, rep = direct_decode_t1(m, z, int(info["t1_output_slice"]), progress, checked=True)
        else:
            out, rep = repeat_decode_t1(m, z, progress, checked=True)
    images = out.to(device=vae.output_device, dtype=vae.vae_output_dtype()).movedim(1, -1)
    data = dict(rep.as_dict(), vae_kind=kind, vae_file=info.get("file"), vae_source=source, summary=rep.summary())
    return images.reshape(-1, *images.shape[-3:]), data


def _pack(video: torch.Tensor, layout: str) -> dict:
    if layout == "video":
        return {"samples": video}
    audio_t = round(AUDIO_LATENT_FPS / VIDEO_FPS)
    import comfy.nested_tensor

    audio = torch.zeros([video.shape[0], 32, 2, audio_t], device=video.device)
    return {"samples": comfy.nested_tensor.NestedTensor((video, audio))}
