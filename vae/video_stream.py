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
* :class:`VideoOutput`: where the finished file goes. PyAV needs a path, so it writes into a private folder made by
  ``loaders/safe_fs.py`` inside the target folder (reached through the folder's descriptor, ``/proc/self/fd/N``);
  the finished file is published under the first free name with a rename that never replaces an existing file, and
  the private folder is removed on success and on any error (no partial file, no clobbered file).
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable, Iterator

import torch

from ..errors import BackendError, DitKitError
from ..loaders import safe_fs


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


class VideoOutput:
    """A folder opened without following symlinks (``safe_fs.SafeDir``) plus the file names to try, in order."""

    def __init__(self, folder: safe_fs.SafeDir, names: Iterable[str] | Callable[[], Iterator[str]],
                 subfolder: str = ""):
        self.folder = folder
        self._names = names
        self.subfolder = subfolder
        self.name: str | None = None      # the name it was published under

    @classmethod
    def at_path(cls, path: str | os.PathLike) -> "VideoOutput":
        path = os.path.abspath(os.fspath(path))
        name = os.path.basename(path)
        safe_fs.validate_name(name, f"video file name {name!r}")
        return cls(safe_fs.SafeDir.open_root(os.path.dirname(path), create=True, what="video folder"), [name])

    @classmethod
    def in_output(cls, output_dir: str, filename_prefix: str, width: int, height: int, ext: str = "mp4",
                  node: str = "DitKitSaveVideo") -> "VideoOutput":
        """ComfyUI's ``<subfolders>/<name>_<counter:05>_.<ext>`` naming (``%width%``, ``%date%``-style variables
        too), below ``output_dir``: the prefix is validated (no NUL/control characters, no ``..``, no absolute path,
        <= 255 bytes per name), sub-folders are created/opened without following symlinks, and the counter starts
        after the highest existing one; a name taken meanwhile is skipped, never replaced."""
        prefix = expand_prefix(filename_prefix, width, height)
        what = f"{node}: input 'filename_prefix'"
        parts = safe_fs.validate_name(prefix, what, allow_subdirs=True,
                                      max_component_bytes=safe_fs.MAX_COMPONENT_BYTES)
        base = parts[-1]
        longest = f"{base}_{99999:05}_.{ext}"
        if len(longest.encode("utf-8")) > safe_fs.MAX_COMPONENT_BYTES:
            raise DitKitError(f"{what}: the file name {base[:40]!r}... gives names of {len(longest.encode())} bytes "
                              f"('<name>_00001_.{ext}'); file systems allow {safe_fs.MAX_COMPONENT_BYTES}")
        folder = safe_fs.SafeDir.open_root(output_dir, parts[:-1], create=True, what=f"{what} (output folder)")
        try:
            start = next_counter(folder.listdir(), base)
        except BaseException:
            folder.close()
            raise

        def names():
            for c in range(start, start + 100000):
                yield f"{base}_{c:05}_.{ext}"
        return cls(folder, names, "/".join(parts[:-1]))

    def names(self) -> Iterator[str]:
        return iter(self._names() if callable(self._names) else self._names)

    @property
    def path(self) -> str | None:
        return os.path.join(self.folder.path, self.name) if self.name else None

    def publish(self, private: safe_fs.SafeDir, tmp: str, ident: tuple[int, int]) -> str:
        for name in self.names():
            try:
                safe_fs.publish_path_file(private, tmp, ident, self.folder, name)
            except FileExistsError:
                continue
            self.name = name
            return name
        raise DitKitError(f"every candidate file name in '{self.folder.path}' is taken; nothing was replaced")

    def close(self) -> None:
        self.folder.close()


_VARS = ("%width%", "%height%", "%year%", "%month%", "%day%", "%hour%", "%minute%", "%second%")


def expand_prefix(prefix, width: int, height: int) -> str:
    """ComfyUI's ``filename_prefix`` variables (``folder_paths.get_save_image_path``)."""
    if not isinstance(prefix, str):
        raise DitKitError(f"filename_prefix must be a string, got {type(prefix).__name__}")
    if "%" not in prefix:
        return prefix
    now = time.localtime()
    vals = (str(width), str(height), str(now.tm_year), str(now.tm_mon).zfill(2), str(now.tm_mday).zfill(2),
            str(now.tm_hour).zfill(2), str(now.tm_min).zfill(2), str(now.tm_sec).zfill(2))
    for k, v in zip(_VARS, vals):
        prefix = prefix.replace(k, v)
    return prefix


def next_counter(names: Iterable[str], base: str) -> int:
    """1 + the highest ``<base>_<digits>...`` counter among ``names`` (ComfyUI's rule), 1 if none."""
    rx = re.compile(re.escape(os.path.normcase(base)) + r"_(\d+)")
    best = 0
    for n in names:
        m = rx.match(os.path.normcase(n))
        if m:
            best = max(best, int(m.group(1)))
    return best + 1


class PyAVVideoWriter:
    """Incremental H.264/AV1 writer with ComfyUI SaveVideo's settings. ``path`` is a file path (never replaced if
    it exists) or a :class:`VideoOutput`; the file appears under its final name only after :meth:`finish`."""

    CONTAINERS = {"mp4": "mp4", "mkv": "matroska", "webm": "webm"}
    ENCODERS = {"h264": "h264", "av1": "libsvtav1"}

    def __init__(self, path, fps: float, width: int, height: int, container: str = "mp4",
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
        if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
            raise DitKitError(f"fps must be a finite number > 0; got {fps!r}")
        self._av = av
        self.container_name = container
        self.audio = audio
        self.audio_stream = None
        if audio is not None:
            src_rate = int(audio["sample_rate"])
            self.audio_rate = 48000 if container == "webm" else src_rate
            chans = int(audio["waveform"].shape[1])
            self.audio_layout = {1: "mono", 2: "stereo", 6: "5.1"}.get(chans, "stereo")
            self._audio_codec = "libopus" if container == "webm" else "aac"
            probe_audio_encoder(av, self._audio_codec, self.audio_rate, self.audio_layout)
        self.output = path if isinstance(path, VideoOutput) else VideoOutput.at_path(path)
        self.out = None
        self._private = None
        try:
            self._private = self.output.folder.private_dir()
            self._tmp = "video." + container
            fd = self._private.open_new(self._tmp)
            st = os.fstat(fd)
            os.close(fd)
            self._ident = (st.st_dev, st.st_ino)
            opts = {"movflags": "use_metadata_tags+faststart"} if container == "mp4" else {}
            self.out = av.open(self._private.fd_path(self._tmp), mode="w", format=self.CONTAINERS[container],
                               options=opts)
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
            if audio is not None:
                self.audio_stream = self.out.add_stream(self._audio_codec, rate=self.audio_rate,
                                                        layout=self.audio_layout)
        except BaseException:
            self.abort()
            raise
        self.frames = 0
        self.width, self.height = width, height

    @property
    def path(self) -> str | None:
        """The published file (after :meth:`finish`)."""
        return self.output.path

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

    def finish(self) -> str:
        """Flush, close and publish; returns the published path."""
        try:
            self.out.mux(self.stream.encode(None))
            if self.audio_stream is not None:
                self._mux_audio()
            self.out.close()
            self.out = None
            self.output.publish(self._private, self._tmp, self._ident)
        except BaseException:
            self.abort()
            raise
        self._cleanup()
        return self.path

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

    def _cleanup(self) -> None:
        if self._private is not None:
            self._private.remove_private()
            self._private = None
        self.output.close()

    def abort(self) -> None:
        """Close and delete the partial file (on any error); nothing is published."""
        try:
            if self.out is not None:
                self.out.close()
        except Exception:  # noqa: BLE001 - the private folder is removed below either way
            pass
        self.out = None
        self._cleanup()


def probe_audio_encoder(av, codec: str, rate: int, layout: str) -> None:
    """Open (and discard) an encoder context with these settings, so an unsupported sample rate or layout fails
    here, before any video is decoded, instead of in the encoder after the whole decode."""
    try:
        cc = av.CodecContext.create(codec, "w")
        cc.sample_rate = int(rate)
        cc.layout = layout
        cc.format = "fltp"
        cc.open()
    except Exception as e:  # noqa: BLE001 - turned into a DitKitError naming the input
        raise DitKitError(f"input 'audio': the {codec} encoder cannot encode {rate} Hz {layout} audio "
                          f"({type(e).__name__}: {e})") from None
