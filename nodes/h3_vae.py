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

import torch
from comfy_api.latest import io

from ..bridge import h3_audio_vae as _h3_audio_vae
from ..bridge.h3_vae import (_pack, _require_h3, _video_part, h3_decode, inspect_h3_vae_file,  # noqa: F401
                             load_h3_vae)
from ..bridge.memory import intermediate_device
from ..errors import DitKitError
from ..vae import preflight
from . import _families, _files
from ._bars import lazy_bar
from ._common import check_memory_split, device_budget, progress, send_report, ui_report

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
        if _h3_audio_vae.is_h3_audio_file(path):   # H3 audio VAE at file size (bridge/h3_audio_vae.py)
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
        budget, where = device_budget(intermediate_device())
        preflight.check_memory("DitKitH3EmptyImageLatent", "width/height/batch_size", shape,
                               {"latent": 4 * batch_size * 24 * (height // 16) * (width // 16)}, budget, where)
        video = torch.zeros([batch_size, 24, 1, height // 16, width // 16], device=intermediate_device())
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
