"""MiniMax H3 VAE nodes: strict loader (video or single-frame image VAE, any size), T=1-correct decode, image latents.

* ``DitKitH3VAELoader`` validates the file (safe header, family, key inventory vs its own detected config, image-VAE
  metadata, h3.md §4.6) and returns a stock ``VAE``. Stock-size files go through ``comfy.sd.VAE`` unchanged;
  scaled/tiny files get the same wrapper with a ``MiniMaxH3VideoVAE`` built at the file's size (the stock loader
  always builds the full-size model and cannot load them). The validated facts ride along as ``vae.ditkit_h3``.
* ``DitKitH3VAEDecode``: T > 1 is the native ``VAE.decode`` (identical output); T = 1 repeat-decodes on a video
  VAE (``vae/t1_decode.py`` through ``bridge/vae.py``) or decodes directly with the declared slice on an image VAE.
* ``DitKitH3EmptyImageLatent`` / ``DitKitH3EncodeImage``: single-frame (T = 1) H3 latents, optionally paired with an
  empty audio latent as the (video, audio) NestedTensor the H3 DiT consumes.
"""
from __future__ import annotations

import os

import torch
from comfy_api.latest import io

import comfy.ldm.minimax.vae as h3vae
import comfy.model_management as mm
import comfy.nested_tensor
import comfy.sd

from ..bridge.vae import direct_decode_t1, is_h3_vae, repeat_decode_t1
from ..errors import CheckpointError, DitKitError, UnsupportedModelError
from ..loaders.read_progress import load_with_progress
from ..loaders.safetensors_io import read_header
from ..vae.h3_layout import (H3_VIDEO_KEYS, STOCK_VIDEO_CONFIG, classify_vae_keys, detect_video_config,
                             video_vae_plan)
from ..vae import preflight
from ..vae.metadata import check_whitening_matches, validate_image_vae_metadata
from . import _families, _files, _h3_audio_vae
from ._bars import lazy_bar
from ._common import check_memory_split, device_budget, progress, send_report, ui_report

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


def _build_scaled_vae(sd: dict, cfg, metadata: dict) -> comfy.sd.VAE:
    """A stock ``comfy.sd.VAE`` wrapper around a ``MiniMaxH3VideoVAE`` built at the detected (scaled) size.

    The wrapper's H3 settings (ratios, memory estimates, tiling flags) come from ComfyUI's own constructor, run on
    the meta device on the stock key inventory (nothing allocated); its model is then replaced by the scaled one, a
    fresh patcher is made for it and the weights are assigned (the file's tensors, cast to the VAE dtype)."""
    probe_plan = video_vae_plan(STOCK_VIDEO_CONFIG)
    probe = {k: torch.empty(shape, device="meta") for k, shape in probe_plan.items()}
    if cfg.ffn_mult != 4:
        raise CheckpointError(f"decoder FFN width {cfg.ffn_mult}x is not buildable by ComfyUI's ViT3DDecoder (4x)")
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=probe, metadata=metadata)
        model = h3vae.MiniMaxH3VideoVAE(ch=cfg.ch, ch_mult=tuple(cfg.ch_mult), num_res_blocks=cfg.num_res_blocks)
    model.decoder = h3vae.ViT3DDecoder(patch_size=model.vae_ratio, patch_size_t=model.vae_ratio_t,
                                       in_channels=cfg.z_channels, num_layers=cfg.dec_layers, heads=cfg.dec_heads,
                                       dim_head=cfg.dec_dim_head, num_register_tokens=cfg.num_register_tokens)
    model.pixel_mean = torch.tensor(h3vae.IMAGENET_MEAN).view(1, 3, 1, 1, 1)
    model.pixel_std = torch.tensor(h3vae.IMAGENET_STD).view(1, 3, 1, 1, 1)
    # same order as comfy.sd.VAE: cast, archive dtypes, make the patcher, then load the weights into the model
    model = model.eval().to(vae.vae_dtype)
    mm.archive_model_dtypes(model)
    vae.first_stage_model = model
    vae.patcher = type(vae.patcher)(model, load_device=vae.device, offload_device=mm.vae_offload_device())
    model.load_state_dict({k: v.to(vae.vae_dtype) for k, v in sd.items()}, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"scaled H3 VAE: tensors {left[:3]} were not materialised")
    vae.size = None
    vae.model_size()
    return vae


def load_h3_vae(path: str, progress=None) -> tuple[comfy.sd.VAE, dict]:
    """``progress(done, total)``: optional, called after each tensor read (total = tensors in the file)."""
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


class DitKitH3VAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="DitKitH3VAELoader",
            display_name="H3 VAE Loader (ditkit)",
            category="ditkit/loaders",
            description="Loads a MiniMax H3 video VAE, a single-frame image VAE (h3_t1_* metadata) or an H3 audio "
                        "VAE with strict validation, at the size the file's shapes give (the stock VAELoader always "
                        "builds the full-size model).",
            search_aliases=["h3 vae", "minimax vae", "image vae", "still vae", "h3 image vae loader"],
            inputs=[
                io.Combo.Input("vae_name", options=_families.family_files("vae", "h3_vae"),
                               tooltip="An H3 video VAE, H3 single-frame image VAE or H3 audio VAE "
                                       "(.safetensors) from models/vae. LTX VAEs are refused."),
            ],
            outputs=[io.Vae.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, vae_name=None):
        return _families.check_listed("DitKitH3VAELoader", "vae_name", "vae", "h3_vae", vae_name)

    @classmethod
    def execute(cls, vae_name) -> io.NodeOutput:
        path = _files.safetensors_path("vae", vae_name, "DitKitH3VAELoader")
        if _h3_audio_vae.is_h3_audio_file(path):   # H3 audio VAE at file size (nodes/_h3_audio_vae.py)
            vae, data = _h3_audio_vae.load_h3_audio_vae(path, progress=lazy_bar(cls.hidden.unique_id))
            c = data["config"]
            summary = (f"audio VAE {data['file']}: encoder {c['encoder_dim']}, latent {c['latent_dim']}, BigVGAN "
                       f"{c['decoder_dim']}" + ("" if data["built"].startswith("stock") else " (scaled)"))
            payload = send_report(cls.hidden.unique_id, "DitKitH3VAELoader", "vae_load", summary, data)
            return io.NodeOutput(vae, ui=ui_report(payload))
        vae, data = load_h3_vae(path, progress=lazy_bar(cls.hidden.unique_id))
        summary = (f"{data['kind']} VAE {data['file']}: {data['config']}"
                   + (f", T=1 direct, output slice {data['t1_output_slice']}" if data["kind"] == "image" else ""))
        payload = send_report(cls.hidden.unique_id, "DitKitH3VAELoader", "vae_load", summary, data)
        return io.NodeOutput(vae, ui=ui_report(payload))


# ------------------------------------------------------------------------------------------------ decoding

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


class DitKitH3VAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="DitKitH3VAEDecode",
            display_name="H3 VAE Decode (ditkit)",
            category="ditkit/vae",
            description="Decodes MiniMax H3 latents. Single-frame latents (T=1) are decoded correctly (repeat-decode "
                        "on the video VAE, direct with the declared slice on an image VAE); T>1 is the native decode.",
            search_aliases=["h3 decode", "minimax decode", "single frame decode", "t=1 decode", "h3 image decode"],
            inputs=[
                io.Latent.Input("samples", tooltip="H3 latent [B, 24, T, H/16, W/16], plain or the (video, audio) "
                                                   "NestedTensor; only the video part is decoded."),
                io.Vae.Input("vae", tooltip="The H3 video VAE, or an H3 single-frame image VAE from "
                                            "DitKitH3VAELoader (image VAEs only decode T=1)."),
            ],
            outputs=[io.Image.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae) -> io.NodeOutput:
        latent = _video_part(samples["samples"])
        images, data = h3_decode(vae, latent, progress=lazy_bar(cls.hidden.unique_id))
        summary = data.get("summary") or f"T={latent.shape[2]}: native decode, {images.shape[0]} frames"
        payload = send_report(cls.hidden.unique_id, "DitKitH3VAEDecode", "vae_decode", summary, data)
        return io.NodeOutput(images, ui=ui_report(payload))


# ------------------------------------------------------------------------------------------------ latents

def _pack(video: torch.Tensor, layout: str) -> dict:
    if layout == "video":
        return {"samples": video}
    audio_t = round(AUDIO_LATENT_FPS / VIDEO_FPS)
    audio = torch.zeros([video.shape[0], 32, 2, audio_t], device=video.device)
    return {"samples": comfy.nested_tensor.NestedTensor((video, audio))}


_LAYOUT_TIP = ("'av': the (video, audio) NestedTensor the H3 DiT samples (audio = an empty 1-frame-long audio "
               "latent); 'video': the plain video latent.")


class DitKitH3EmptyImageLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="DitKitH3EmptyImageLatent",
            display_name="H3 Empty Image Latent (ditkit)",
            category="ditkit/latent",
            description="An empty single-frame MiniMax H3 latent (T=1); the native EmptyMiniMaxH3LatentAV has a "
                        "5-frame minimum.",
            search_aliases=["h3 empty image latent", "h3 single frame latent", "minimax image latent"],
            inputs=[
                io.Int.Input("width", default=1024, min=16, max=16384, step=16, tooltip="Image width in pixels "
                                                                                        "(multiple of 16)."),
                io.Int.Input("height", default=1024, min=16, max=16384, step=16, tooltip="Image height in pixels "
                                                                                         "(multiple of 16)."),
                io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="Number of images."),
                io.Combo.Input("layout", options=["av", "video"], default="av", tooltip=_LAYOUT_TIP),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, width, height, batch_size, layout) -> io.NodeOutput:
        shape = (batch_size, 24, 1, height // 16, width // 16)
        preflight.check_latent_shape(shape, "DitKitH3EmptyImageLatent", "width/height/batch_size")
        budget, where = device_budget(mm.intermediate_device())
        preflight.check_memory("DitKitH3EmptyImageLatent", "width/height/batch_size", shape,
                               {"latent": 4 * batch_size * 24 * (height // 16) * (width // 16)}, budget, where)
        video = torch.zeros([batch_size, 24, 1, height // 16, width // 16], device=mm.intermediate_device())
        payload = send_report(cls.hidden.unique_id, "DitKitH3EmptyImageLatent", "latent",
                              f"T=1 latent {tuple(video.shape)} ({layout})", {"shape": list(video.shape), "layout": layout})
        return io.NodeOutput(_pack(video, layout), ui=ui_report(payload))


class DitKitH3EncodeImage(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="DitKitH3EncodeImage",
            display_name="H3 Encode Image (ditkit)",
            category="ditkit/vae",
            description="Encodes each image of a batch as its own single-frame H3 latent (T=1). The native VAEEncode "
                        "turns an image batch into ONE video of that many frames.",
            search_aliases=["h3 encode image", "h3 single frame encode", "minimax image encode"],
            inputs=[
                io.Image.Input("image", tooltip="Images [N, H, W, 3]; each becomes one T=1 latent (batch N)."),
                io.Vae.Input("vae", tooltip="The H3 video VAE (its encoder; image VAEs share it)."),
                io.Combo.Input("layout", options=["av", "video"], default="av", tooltip=_LAYOUT_TIP),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, image, vae, layout) -> io.NodeOutput:
        m = _require_h3(vae)
        ratio = int(getattr(m, "vae_ratio", 16))
        preflight.check_image_size(tuple(image.shape), "DitKitH3EncodeImage", 2 * ratio, "image",
                                   why=f"each side is cropped to a multiple of {ratio} px and the encoder's last level "
                                       f"pads by reflection, which needs 2 latent cells ({2 * ratio} px)")
        n, h, w = int(image.shape[0]), int(image.shape[1]), int(image.shape[2])
        check_memory_split("DitKitH3EncodeImage", "image", tuple(image.shape), vae.device,
                           {"VAE working set per image (ComfyUI's estimate)":
                                float(vae.memory_used_encode((1, 3, 1, h, w), vae.vae_dtype))},
                           {"latents": n * 24 * (h // ratio) * (w // ratio) * 4})
        bar = progress(n, cls.hidden.unique_id)
        outs = []
        for i in range(n):   # one T=1 latent per image (ComfyUI's encode drives no bar for this VAE)
            outs.append(vae.encode(image[i:i + 1, :, :, :3]))
            bar(i + 1, n)
        video = torch.cat(outs, dim=0)
        if video.ndim != 5 or video.shape[2] != 1:
            raise DitKitError(f"encoding one image gave latent shape {tuple(video.shape)}, expected T=1")
        payload = send_report(cls.hidden.unique_id, "DitKitH3EncodeImage", "latent",
                              f"{image.shape[0]} image(s) -> T=1 latent {tuple(video.shape)} ({layout})",
                              {"shape": list(video.shape), "layout": layout})
        return io.NodeOutput(_pack(video, layout), ui=ui_report(payload))  # replayed when served from the cache


NODES = [DitKitH3VAELoader, DitKitH3VAEDecode, DitKitH3EmptyImageLatent, DitKitH3EncodeImage]
