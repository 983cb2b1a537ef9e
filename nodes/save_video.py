"""DitKitSaveVideo: decode a video latent in temporal chunks and stream uint8 frames into PyAV (vae/video_stream.py).

Works for VAEs with ComfyUI's chunked output IO (``first_stage_model.comfy_has_chunked_io``: the H3 video VAE, the
LTX video VAE): the model writes each finished temporal chunk into the ``output_buffer`` we pass, which converts it
to uint8 on the decode device and encodes it. Peak host memory is one chunk, not the whole float video.
"""
from __future__ import annotations

import torch
from comfy_api.latest import io, ui

import comfy.model_management as mm
import folder_paths
from comfy.cli_args import args as comfy_args

from ..cache.audio_guard import check_waveform
from ..errors import DitKitError, UnsupportedModelError
from ..vae import preflight
from ..vae.video_stream import PyAVVideoWriter, Uint8FrameSink, VideoOutput, require_av
from ._common import check_memory_split, progress, send_report, ui_report


def _video_latent(samples: dict) -> torch.Tensor:
    lat = samples["samples"]
    if getattr(lat, "is_nested", False):
        lat = lat.unbind()[0]
    return lat


def check_save_request(vae, latent: torch.Tensor, fps: float, audio=None, node: str = "DitKitSaveVideo") -> tuple:
    """Everything that can be refused before any decode or file: VAE kind, latent shape (non-empty), audio (shape,
    length, encoder sample rates), output size and the memory one decoded chunk needs. Returns the per-item output
    shape [1, 3, F, H, W]."""
    m = getattr(vae, "first_stage_model", None)
    if m is None or not getattr(m, "comfy_has_chunked_io", False) or not hasattr(m, "decode_output_shape"):
        raise UnsupportedModelError(f"DitKitSaveVideo streams VAEs with chunked output (H3 video VAE, LTX video VAE); "
                                    f"{type(m).__name__ if m is not None else 'this VAE'} does not support it. "
                                    "Use VAEDecode + SaveVideo")
    if getattr(vae, "ditkit_h3", {}).get("kind") == "image":
        raise DitKitError("this is a single-frame H3 IMAGE VAE; it must not decode videos. Load the H3 video VAE")
    if latent.ndim != 5:
        raise DitKitError(f"DitKitSaveVideo needs a 5-D video latent [B, C, T, H, W]; got {tuple(latent.shape)}")
    preflight.check_latent_shape(latent.shape, node, "samples")
    if latent.shape[1] != vae.latent_channels:
        raise DitKitError(f"latent has {latent.shape[1]} channels, the VAE expects {vae.latent_channels} "
                          f"(shape {tuple(latent.shape)})")
    if latent.shape[2] < 2 and hasattr(m, "_decode_temporal_chunks"):
        raise DitKitError("latent has T=1 (a single image): use DitKitH3VAEDecode + SaveImage")
    av = require_av()
    if audio is not None:
        rates = getattr(av.codec.Codec("aac", "w"), "audio_rates", None)
        preflight.check_audio(audio, node, rates)
    shape = tuple(int(v) for v in m.decode_output_shape((1,) + tuple(latent.shape[1:])))
    frames, height, width = shape[2], shape[3], shape[4]
    if frames < 1:
        raise DitKitError(f"{node}: input 'samples' {tuple(latent.shape)} decodes to {frames} frames")
    if width % 2 or height % 2:
        raise DitKitError(f"yuv420p video needs even width and height; got {width}x{height}")
    if all(hasattr(m, a) for a in ("tokens_chunk_size", "token_overlap", "vae_ratio_t")):   # H3: one temporal chunk
        chunk = min(frames, (int(m.tokens_chunk_size) + int(m.token_overlap)) * int(m.vae_ratio_t))
    else:  # other chunked VAEs: at least one frame (their own estimate covers the rest)
        chunk = 1
    itemsize = torch.empty((), dtype=vae.vae_dtype).element_size()
    dev = {"VAE working set (ComfyUI's estimate)": float(vae.memory_used_decode((1,) + tuple(latent.shape[1:]),
                                                                                  vae.vae_dtype)),
           "one decoded chunk": chunk * 3 * height * width * max(itemsize, 4)}
    host = {"its uint8 frames": chunk * 3 * height * width}
    check_memory_split(node, "samples", latent.shape, vae.device, dev, host)
    return shape


def stream_save(vae, latent: torch.Tensor, path, fps: float, codec: str = "h264", crf=None, audio=None,
                metadata=None, on_progress=None) -> dict:
    """``path``: a file path (never replaced) or a ``VideoOutput`` (ComfyUI's counter naming in the output folder)."""
    m = getattr(vae, "first_stage_model", None)
    shape = check_save_request(vae, latent, fps, audio)
    frames_per_item, height, width = shape[2], shape[3], shape[4]
    total = frames_per_item * latent.shape[0]
    vae.throw_exception_if_invalid()
    mem = vae.memory_used_decode((1,) + tuple(latent.shape[1:]), vae.vae_dtype)
    mm.load_models_gpu([vae.patcher], memory_required=mem, force_full_load=vae.disable_offload)
    writer = PyAVVideoWriter(path, fps, width, height, codec=codec, crf=crf, metadata=metadata, audio=audio)
    done = [0]
    stats = []

    def on_chunk(written, _n):
        if on_progress is not None:
            on_progress(done[0] + written, total)

    try:
        with torch.inference_mode():
            for b in range(latent.shape[0]):
                sink = Uint8FrameSink(shape, writer.write, out_dtype=vae.vae_output_dtype(),
                                      process=vae.process_output, on_chunk=on_chunk)
                z = latent[b:b + 1].to(device=vae.device, dtype=vae.vae_dtype)
                m.decode(z, output_buffer=sink)
                if sink.written != frames_per_item:
                    raise DitKitError(f"the VAE wrote {sink.written} of {frames_per_item} frames")
                stats.append(sink.stats)
                done[0] += frames_per_item
        published = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"frames": total, "width": width, "height": height, "fps": fps, "codec": codec,
            "chunks": sum(s.chunks for s in stats),
            "peak_chunk_float_bytes": max(s.peak_chunk_float_bytes for s in stats),
            "uint8_bytes": sum(s.uint8_bytes for s in stats),
            "full_float_video_bytes": total * 3 * height * width * 4, "audio": audio is not None,
            "path": published}


class DitKitSaveVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="DitKitSaveVideo",
            display_name="Save Video (ditkit)",
            category="ditkit/vae",
            description="Decodes a video latent chunk by chunk and streams the frames into an MP4, never holding the "
                        "whole decoded float video in memory. Same encoder settings as SaveVideo.",
            search_aliases=["streaming save video", "decode and save video", "vae decode video save", "low memory "
                            "video save"],
            inputs=[
                io.Vae.Input("vae", tooltip="A video VAE with chunked output: the H3 video VAE or the LTX video VAE."),
                io.Latent.Input("samples", tooltip="Video latent [B, C, T, H, W] (an H3 (video, audio) NestedTensor "
                                                   "uses its video part). Batch items are written one after another."),
                io.Float.Input("fps", default=24.0, min=1.0, max=120.0, step=1.0, tooltip="Frame rate of the file."),
                io.String.Input("filename_prefix", default="video/ditkit", tooltip="Prefix of the file in ComfyUI's "
                                                                                   "output directory."),
                io.Combo.Input("codec", options=["h264", "av1"], default="h264", tooltip="Video codec (MP4 container)."),
                io.Int.Input("crf", default=-1, min=-1, max=63, tooltip="Constant rate factor; -1 keeps the encoder "
                                                                        "default (like SaveVideo)."),
                io.Audio.Input("audio", optional=True, tooltip="Optional audio muxed after the video (AAC), trimmed "
                                                               "to the video length like CreateVideo/SaveVideo."),
                io.Combo.Input("audio_guard", options=["report", "refuse"], default="report", optional=True,
                               tooltip="Checks the audio for NaN/Inf, DC offset, clipping, silence and pops (spectral "
                                       "jumps) before writing. report: the figures go on this node's badge (amber "
                                       "when a check fails). refuse: a failed check stops the node before any file "
                                       "is written."),
            ],
            outputs=[],
            is_output_node=True,
            hidden=[io.Hidden.unique_id, io.Hidden.prompt, io.Hidden.extra_pnginfo],
        )

    @classmethod
    def execute(cls, vae, samples, fps, filename_prefix, codec, crf, audio=None, audio_guard="report") -> io.NodeOutput:
        latent = _video_latent(samples)
        shp = check_save_request(vae, latent, fps, audio)   # before any file or decode
        guard = check_waveform(audio["waveform"]) if audio is not None else None
        if guard is not None and not guard.clean and audio_guard == "refuse":
            raise DitKitError(f"DitKitSaveVideo: input 'audio' failed the audio guard ({'; '.join(guard.flags)}); "
                              "nothing was written (set audio_guard to 'report' to save it anyway)")
        meta = None
        if not comfy_args.disable_metadata:
            meta = {}
            if cls.hidden.extra_pnginfo is not None:
                meta.update(cls.hidden.extra_pnginfo)
            if cls.hidden.prompt is not None:
                meta["prompt"] = cls.hidden.prompt
            meta = meta or None
        total = shp[2] * latent.shape[0]
        out = VideoOutput.in_output(folder_paths.get_output_directory(), filename_prefix, shp[4], shp[3])
        pb = progress(total, cls.hidden.unique_id)
        try:
            data = stream_save(vae, latent, out, fps, codec=codec, crf=None if crf < 0 else crf, audio=audio,
                               metadata=meta, on_progress=pb)
        finally:
            out.close()
        file, subfolder = out.name, out.subfolder
        data["file"] = f"{subfolder}/{file}" if subfolder else file
        if guard is not None:
            data["audio_guard"] = guard.as_dict()
        summary = (f"{data['frames']} frames {data['width']}x{data['height']} in {data['chunks']} chunks; peak chunk "
                   f"{data['peak_chunk_float_bytes'] / 2**20:.1f} MiB float vs "
                   f"{data['full_float_video_bytes'] / 2**20:.1f} MiB for the whole float video"
                   + (f"; {guard.summary()}" if guard is not None else ""))
        payload = send_report(cls.hidden.unique_id, "DitKitSaveVideo", "video_save", summary, data)
        ui_dict = ui.PreviewVideo([ui.SavedResult(file, subfolder, io.FolderType.output)]).as_dict()
        ui_dict.update(ui_report(payload))
        return io.NodeOutput(ui=ui_dict)


NODES = [DitKitSaveVideo]
