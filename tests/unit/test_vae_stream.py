"""Streaming uint8 sink and the PyAV writer (no ComfyUI)."""
from __future__ import annotations

import pytest
import torch

from ditkit.errors import DitKitError
from ditkit.vae.video_stream import PyAVVideoWriter, Uint8FrameSink, to_uint8_frames


def test_sink_streams_in_order_and_quantises_like_comfy():
    got, prog = [], []
    shape = (1, 3, 10, 4, 6)
    sink = Uint8FrameSink(shape, got.append, process=lambda x: x.add_(1.0).div_(2.0).clamp_(0, 1),
                          on_chunk=lambda a, b: prog.append((a, b)))
    full = torch.rand(*shape) * 2.4 - 1.2
    for a, b in [(0, 3), (3, 8), (8, 10)]:
        sink[:, :, a:b].copy_(full[:, :, a:b])
    ref = ((full + 1) / 2).clamp(0, 1)
    ref = (ref.movedim(1, -1) * 255).clamp(0, 255).byte().reshape(-1, 4, 6, 3)  # ComfyUI's float->uint8
    assert torch.equal(torch.cat(got), ref)
    assert prog == [(3, 10), (8, 10), (10, 10)] and sink.stats.chunks == 3 and sink.stats.frames == 10
    assert sink.stats.peak_chunk_float_bytes == 5 * 3 * 4 * 6 * 4
    assert full.min() < -1  # the source chunk was not modified in place by process
    with pytest.raises(DitKitError, match="expected 10"):
        sink[:, :, 2:4].copy_(full[:, :, 2:4])
    with pytest.raises(DitKitError, match="unsupported write pattern"):
        sink[0]


def test_to_uint8_truncates():
    x = torch.tensor([0.0, 0.5, 1.0, 1.5, -0.2, 254.9 / 255]).view(1, 1, 1, 1, 6).expand(1, 3, 1, 1, 6)
    assert to_uint8_frames(x)[0, 0, :, 0].tolist() == [0, 127, 255, 255, 0, 254]


def test_writer_roundtrip_and_abort(tmp_path):
    av = pytest.importorskip("av")
    frames = torch.zeros(12, 32, 48, 3, dtype=torch.uint8)
    frames[..., 0] = torch.arange(48, dtype=torch.uint8) * 5
    frames[..., 1] = 128
    w = PyAVVideoWriter(str(tmp_path / "a.mp4"), 24.0, 48, 32, crf=0)
    w.write(frames[:5])
    w.write(frames[5:])
    w.finish()
    with av.open(str(tmp_path / "a.mp4")) as c:
        s = c.streams.video[0]
        dec = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        assert (s.width, s.height, len(dec)) == (48, 32, 12)
    diff = (torch.from_numpy(dec[7]).int() - frames[7].int()).abs().float().mean().item()
    assert diff < 3  # crf 0 (lossless luma/chroma planes; only the RGB<->YUV420 conversion loses)
    w = PyAVVideoWriter(str(tmp_path / "b.mp4"), 24.0, 48, 32)
    w.write(frames[:2])
    w.abort()
    assert not (tmp_path / "b.mp4").exists()
    with pytest.raises(DitKitError, match="even"):
        PyAVVideoWriter(str(tmp_path / "c.mp4"), 24.0, 47, 32)
    with pytest.raises(DitKitError, match="uint8"):
        PyAVVideoWriter(str(tmp_path / "d.mp4"), 24.0, 48, 32).write(frames.float())


def test_missing_pyav_is_a_clear_error(monkeypatch, tmp_path):
    import sys

    from ditkit.errors import BackendError

    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` raise ImportError
    with pytest.raises(BackendError, match="pip install av"):
        PyAVVideoWriter(str(tmp_path / "x.mp4"), 24.0, 48, 32)
    assert not (tmp_path / "x.mp4").exists()
