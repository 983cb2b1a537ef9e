"""Streaming video save: decoded chunks -> uint8 on the decode device -> PyAV encoder, never the whole float video.

* :class:`Uint8FrameSink` is a duck-typed stand-in for the ``output_buffer`` that ComfyUI's chunked-IO video VAEs
  (H3 ``MiniMaxH3VideoVAE.decode``, LTX ``VideoVAE.decode``; ``comfy_has_chunked_io = True``) write their finished
  temporal chunks into, in order, with ``buf[:, :, a:b].copy_(chunk)``. Each chunk is cast to the dtype the native
  buffer would have, post-processed like the native wrapper (``process_output``), quantised exactly like ComfyUI's
  video save (``(x * 255).clamp(0, 255)`` truncated to uint8) on the decode device, and handed to the encoder. Only
  one chunk of float frames exists at a time.
* :class:`PyAVVideoWriter` encodes rgb24 frames with the same container/codec/pixel-format/colour settings as
  ComfyUI's ``SaveVideo`` (MP4 + H.264 yuv420p, BT.709 matrix, sRGB transfer, limited range, faststart) and muxes
  optional audio after the video like the native path.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import torch

from ..errors import BackendError, DitKitError


def require_av():
    try:
        import av  # noqa: F401
    except ImportError as e:
        raise BackendError(f"PyAV (the 'av' package) is needed to write video files but cannot be imported ({e}); "
                           "install it into ComfyUI's Python: pip install av") from None
    return av


def to_uint8_frames(x: torch.Tensor) -> torch.Tensor:
    """[B, 3, t, H, W] float in [0, 1] -> [B*t, H, W, 3] uint8, ComfyUI's quantisation (truncation)."""
    x = x.movedim(1, -1)  # [B, t, H, W, 3]
    x = (x * 255).clamp(0, 255).to(torch.uint8)
    return x.reshape(-1, *x.shape[-3:])


@dataclass
class SinkStats:
    chunks: int = 0
    frames: int = 0
    peak_chunk_float_bytes: int = 0
    uint8_bytes: int = 0
    chunk_frames: list = field(default_factory=list)


class _SinkWindow:
    def __init__(self, sink: "Uint8FrameSink", start: int, stop: int):
        self.sink, self.start, self.stop = sink, start, stop

    def copy_(self, src: torch.Tensor):
        self.sink._write(self.start, self.stop, src)
        return self


class Uint8FrameSink:
    """Write-only, sequential ``output_buffer`` for one video item ([1, C, T, H, W])."""

    def __init__(self, shape, on_frames: Callable[[torch.Tensor], None], out_dtype: torch.dtype = torch.float32,
                 process: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 on_chunk: Callable[[int, int], None] | None = None):
        self.shape = torch.Size(shape)
        self.dtype = out_dtype
        self._on_frames = on_frames
        self._process = process
        self._on_chunk = on_chunk
        self.written = 0
        self.stats = SinkStats()

    def __getitem__(self, idx):
        if not isinstance(idx, tuple) or len(idx) < 3 or any(
                not (isinstance(s, slice) and s.start is None and s.stop is None and s.step is None)
                for s in idx[:2] + idx[3:]) or not isinstance(idx[2], slice) or idx[2].step not in (None, 1):
            raise DitKitError(f"streaming video sink: unsupported write pattern {idx!r}; this VAE does not write "
                              "its output in temporal chunks the way ditkit streams them")
        start = 0 if idx[2].start is None else int(idx[2].start)
        stop = self.shape[2] if idx[2].stop is None else min(int(idx[2].stop), self.shape[2])
        return _SinkWindow(self, start, stop)

    def _write(self, start: int, stop: int, src: torch.Tensor) -> None:
        if start != self.written:
            raise DitKitError(f"streaming video sink: chunk written at frame {start}, expected {self.written} "
                              "(the VAE does not write frames in order; cannot stream)")
        n = stop - start
        if src.shape[2] != n or src.shape[0] != self.shape[0]:
            raise DitKitError(f"streaming video sink: chunk of shape {tuple(src.shape)} for frames {start}:{stop}")
        x = src.to(self.dtype)  # what the native preallocated buffer would hold
        if x.data_ptr() == src.data_ptr():
            x = x.clone()
        if self._process is not None:
            x = self._process(x)
        self.stats.peak_chunk_float_bytes = max(self.stats.peak_chunk_float_bytes, x.numel() * x.element_size())
        frames = to_uint8_frames(x)
        del x
        frames = frames.cpu()
        self.stats.uint8_bytes += frames.numel()
        self.written = stop
        self.stats.chunks += 1
        self.stats.frames += n
        self.stats.chunk_frames.append(n)
        self._on_frames(frames)
        if self._on_chunk is not None:
            self._on_chunk(self.written, self.shape[2])


class PyAVVideoWriter:
    """Incremental H.264/AV1 writer with ComfyUI SaveVideo's settings."""

    CONTAINERS = {"mp4": "mp4", "mkv": "matroska", "webm": "webm"}
    ENCODERS = {"h264": "h264", "av1": "libsvtav1"}

    def __init__(self, path: str, fps: float, width: int, height: int, container: str = "mp4",
                 codec: str = "h264", crf: float | None = None, metadata: dict | None = None,
                 audio: dict | None = None):
        av = require_av()
        from av.video.reformatter import ColorPrimaries, ColorRange, ColorTrc

        if container not in self.CONTAINERS:
            raise DitKitError(f"unsupported container {container!r} (choose from {sorted(self.CONTAINERS)})")
        if codec == "auto":
            codec = "av1" if container == "webm" else "h264"
        if codec not in self.ENCODERS:
            raise DitKitError(f"unsupported codec {codec!r} (choose from {sorted(self.ENCODERS)})")
        if container == "webm" and codec != "av1":
            raise DitKitError("WebM output requires the AV1 codec")
        if width % 2 or height % 2:
            raise DitKitError(f"yuv420p video needs even width and height; got {width}x{height}")
        self._av = av
        self.path = os.fspath(path)
        self.container_name = container
        opts = {"movflags": "use_metadata_tags+faststart"} if container == "mp4" else {}
        self.out = av.open(self.path, mode="w", format=self.CONTAINERS[container], options=opts)
        try:
            import json

            for k, v in (metadata or {}).items():
                self.out.metadata[k] = json.dumps(v)
            self.frame_rate = Fraction(round(fps * 1000), 1000)
            self.stream = self.out.add_stream(self.ENCODERS[codec], rate=self.frame_rate)
            self.stream.width, self.stream.height = width, height
            self.stream.pix_fmt = "yuv420p"
            if crf is not None:
                self.stream.options = {"svtav1-params": "lossless=1"} if (codec == "av1" and crf == 0) \
                    else {"crf": str(crf)}
            self._color = (ColorPrimaries.BT709, ColorTrc.IEC61966_2_1, 1, ColorRange.MPEG)
            self._set_color(self.stream.codec_context)
            self.audio = audio
            self.audio_stream = None
            if audio is not None:
                src_rate = int(audio["sample_rate"])
                self.audio_rate = 48000 if container == "webm" else src_rate
                chans = int(audio["waveform"].shape[1])
                self.audio_layout = {1: "mono", 2: "stereo", 6: "5.1"}.get(chans, "stereo")
                self.audio_stream = self.out.add_stream("libopus" if container == "webm" else "aac",
                                                        rate=self.audio_rate, layout=self.audio_layout)
        except BaseException:
            self.abort()
            raise
        self.frames = 0
        self.width, self.height = width, height

    def _set_color(self, target) -> None:
        target.color_primaries, target.color_trc, target.colorspace, target.color_range = self._color

    def write(self, frames_u8: torch.Tensor) -> None:
        """frames [N, H, W, 3] uint8 (CPU)."""
        if frames_u8.dtype != torch.uint8 or frames_u8.ndim != 4 or frames_u8.shape[-1] != 3:
            raise DitKitError(f"writer expects [N, H, W, 3] uint8 frames; got {tuple(frames_u8.shape)} {frames_u8.dtype}")
        arr = frames_u8.numpy()
        for img in arr:
            f = self._av.VideoFrame.from_ndarray(img, format="rgb24")
            f = f.reformat(format="yuv420p", dst_colorspace=1)
            self._set_color(f)
            self.out.mux(self.stream.encode(f))
            self.frames += 1

    def finish(self) -> None:
        self.out.mux(self.stream.encode(None))
        if self.audio_stream is not None:
            self._mux_audio()
        self.out.close()
        self.out = None

    def _mux_audio(self) -> None:
        av = self._av
        audio = self.audio
        src_rate = int(audio["sample_rate"])
        wave = audio["waveform"][0, :, :math.ceil((src_rate / self.frame_rate) * self.frames)]
        layout = self.audio_layout
        frame = av.AudioFrame.from_ndarray(wave.float().cpu().contiguous().numpy(), format="fltp", layout=layout)
        frame.sample_rate = src_rate
        frame.pts = 0
        frames = [frame]
        resampler = None
        if self.audio_rate != src_rate:
            resampler = av.audio.resampler.AudioResampler(format="fltp", layout=layout, rate=self.audio_rate)
            frames = resampler.resample(frame)
        for fr in frames:
            self.out.mux(self.audio_stream.encode(fr))
        if resampler is not None:
            for fr in resampler.resample(None):
                self.out.mux(self.audio_stream.encode(fr))
        self.out.mux(self.audio_stream.encode(None))

    def abort(self) -> None:
        """Close and delete a partial file (on any error)."""
        try:
            if self.out is not None:
                self.out.close()
        except Exception:  # noqa: BLE001 - the file is removed below either way
            pass
        self.out = None
        if os.path.exists(self.path):
            os.remove(self.path)
