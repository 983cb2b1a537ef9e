"""DitKitSaveVideo: decode a video latent in temporal chunks and stream uint8 frames into PyAV (vae/video_stream.py;
the decode through ComfyUI's chunked output IO is bridge/save_video.py).

Works for VAEs with ComfyUI's chunked output IO (``first_stage_model.comfy_has_chunked_io``: the H3 video VAE, the
LTX video VAE): the model writes each finished temporal chunk into the ``output_buffer`` we pass, which converts it
to uint8 on the decode device and encodes it. Peak host memory is one chunk, not the whole float video.
"""
from __future__ import annotations

from comfy_api.latest import io, ui

from ..bridge import audio_watch
from ..bridge.files import output_directory
from ..bridge.save_video import _video_latent, check_save_request, metadata_disabled, stream_save  # noqa: F401
from ..vae.video_stream import VideoOutput
from ._common import progress, send_report, ui_report
from ..cache.audio_guard import check_waveform
from ..errors import DitKitError


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
                                       "jumps) before writing, and takes the sampling-time audio verdict of any ditkit cache or schedule node "
                                       "upstream. report: the figures go on this node's badge (amber "
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
        # the sampling-time verdicts (cache / schedule nodes) of the samplers this audio descends from
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        sampled = audio_watch.upstream_verdicts(node_id) if audio is not None else []
        flags = (list(guard.flags) if guard is not None else []) + [
            f"{v['by']} (sampler #{v['sampler']}): {v['summary']}" for v in sampled if not v["clean"]]
        if flags and audio_guard == "refuse":
            raise DitKitError(f"DitKitSaveVideo: input 'audio' failed the audio guard ({'; '.join(flags)}); "
                              "nothing was written (set audio_guard to 'report' to save it anyway)")
        meta = None
        if not metadata_disabled():
            meta = {}
            if cls.hidden.extra_pnginfo is not None:
                meta.update(cls.hidden.extra_pnginfo)
            if cls.hidden.prompt is not None:
                meta["prompt"] = cls.hidden.prompt
            meta = meta or None
        total = shp[2] * latent.shape[0]
        out = VideoOutput.in_output(output_directory(), filename_prefix, shp[4], shp[3])
        pb = progress(total, cls.hidden.unique_id)
        try:
            data = stream_save(vae, latent, out, fps, codec=codec, crf=None if crf < 0 else crf, audio=audio,
                               metadata=meta, on_progress=pb)
        finally:
            out.close()
        file, subfolder = out.name, out.subfolder
        data["file"] = f"{subfolder}/{file}" if subfolder else file
        if guard is not None:
            data["audio_guard"] = dict(guard.as_dict(), flags=flags, clean=not flags, sampling=sampled)
        summary = (f"{data['frames']} frames {data['width']}x{data['height']} in {data['chunks']} chunks; peak chunk "
                   f"{data['peak_chunk_float_bytes'] / 2**20:.1f} MiB float vs "
                   f"{data['full_float_video_bytes'] / 2**20:.1f} MiB for the whole float video"
                   + (f"; {guard.summary()}" if guard is not None else "")
                   + "".join(f"; sampling: {v['by']}: {v['summary']}" for v in sampled if not v["clean"]))
        payload = send_report(cls.hidden.unique_id, "DitKitSaveVideo", "video_save", summary, data)
        ui_dict = ui.PreviewVideo([ui.SavedResult(file, subfolder, io.FolderType.output)]).as_dict()
        ui_dict.update(ui_report(payload))
        return io.NodeOutput(ui=ui_dict)


NODES = [DitKitSaveVideo]
