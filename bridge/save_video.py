"""DitKitSaveVideo's decode: a video latent decoded in temporal chunks through ComfyUI's chunked output IO
(``first_stage_model.comfy_has_chunked_io``: the H3 video VAE, the LTX video VAE) streamed as uint8 frames into
PyAV (``vae/video_stream.py``). The model writes each finished temporal chunk into the ``output_buffer`` passed
here, which converts it to uint8 on the decode device and encodes it. Peak host memory is one chunk, not the whole
float video. The node (``nodes/save_video.py``) names the file and reports.
"""
from __future__ import annotations

import torch

from ..errors import DitKitError, UnsupportedModelError
from ..vae import preflight
from ..vae.video_stream import PyAVVideoWriter, Uint8FrameSink, require_av
from .memory import check_memory_split


def metadata_disabled() -> bool:
    """ComfyUI's ``--disable-metadata`` flag (no prompt / workflow written into saved files)."""
    from comfy.cli_args import args

    return bool(args.disable_metadata)


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
    import comfy.model_management as mm

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
