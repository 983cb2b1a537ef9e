"""The FastH3 example (example_workflows/api/h3_fasth3_tiny.json) on the real server: the tiny FastH3 V2 export ->
DitKitFastH3Schedule (from its contract) -> DitKitSparseAttention 'auto' -> SamplerCustom -> video + audio decode ->
DitKitSaveVideo writes an MP4 that plays: one H.264 video stream and one AAC audio stream (read back with PyAV)."""
from __future__ import annotations

import json

import pytest

from ditkit import workflows as wfm

EXAMPLE = next((p for p in wfm.api_workflows() if p.stem == "h3_fasth3_tiny"), None)


def test_fasth3_example_writes_a_playable_mp4_with_audio(comfy_server):
    av = pytest.importorskip("av")
    assert EXAMPLE is not None, "example_workflows/api/h3_fasth3_tiny.json is missing"
    graph = json.loads(EXAMPLE.read_text(encoding="utf-8"))
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    mp4 = [f for f in comfy_server.output_files(entry) if str(f).endswith(".mp4")]
    assert len(mp4) == 1, mp4
    frames = 0
    with av.open(str(mp4[0])) as c:
        kinds = sorted(s.type for s in c.streams)
        assert kinds == ["audio", "video"], kinds
        v, a = c.streams.video[0], c.streams.audio[0]
        assert v.codec_context.name == "h264" and (v.width, v.height) == (128, 128)
        assert a.codec_context.name == "aac" and a.codec_context.sample_rate == 32000 and a.codec_context.channels == 2
        for _ in c.decode(video=0):
            frames += 1
    assert frames == 22                       # EmptyMiniMaxH3LatentAV length 22 -> 22 frames
    log = comfy_server.log_text()
    assert "recipe auto -> FastH3 8-Step V2, sparsity 0.8" in log, "the VSA node must say which recipe auto chose"
    assert "steps sparse 8 / dense 0" in log, "eight FastH3 V2 forwards, all sparse"
