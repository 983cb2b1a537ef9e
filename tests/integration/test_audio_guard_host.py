"""The audio guard on DitKitSaveVideo in the real ComfyUI 0.33 host (tiny H3 video VAE, CPU): a faulty AUDIO input
is reported on the node (figures in the report's data) and, with audio_guard 'refuse', stops the node before any
decode or file; clean audio is reported clean and written. Oracles: the files in the output folder, a decoder that
fails the test if it runs, and the fault values written here."""
from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

from ditkit.errors import DitKitError


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.tiny import ckpt_h3_vae as ck
    from ditkit.tiny.checkpoints import generate_all

    out = tmp_path_factory.mktemp("ag_vae")
    generate_all(out, only=["h3_video_vae_tiny"])
    video, _ = importlib.import_module("ditkit.nodes.h3_vae").load_h3_vae(str(out / "vae" / ck.VIDEO_VAE_NAME))
    dest = tmp_path_factory.mktemp("ag_out")
    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(dest))
    yield {"vae": video, "out": dest}
    folder_paths.set_output_directory(old)


def _node(monkeypatch):
    from comfy_api.latest._io import HiddenHolder

    from ditkit.nodes.save_video import DitKitSaveVideo

    monkeypatch.setattr(DitKitSaveVideo, "hidden", HiddenHolder("5", None, None, None, None, None), raising=False)
    return DitKitSaveVideo


def _audio(kind: str):
    t = torch.arange(48000, dtype=torch.float32) / 48000
    w = (0.3 * torch.sin(2 * math.pi * 440 * t)).repeat(2, 1)
    if kind == "dc":
        w = w + 0.1
    elif kind == "silent":
        w = w * 0
    elif kind == "nan":
        w[0, 10] = float("nan")
    return {"waveform": w[None], "sample_rate": 48000}


def _files(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


@pytest.mark.parametrize("kind,needle", [("dc", "DC offset"), ("silent", "silent"), ("nan", "NaN/Inf")])
def test_refuse_stops_before_decode_and_file(env, monkeypatch, kind, needle):
    node = _node(monkeypatch)
    m = env["vae"].first_stage_model

    def boom(*a, **k):
        raise AssertionError("decode started before the refusal")

    monkeypatch.setattr(m, "decode", boom)
    before = _files(env["out"])
    with pytest.raises(DitKitError, match=needle) as e:
        node.execute(vae=env["vae"], samples={"samples": torch.zeros(1, 24, 2, 4, 4)}, fps=24.0,
                     filename_prefix=f"guard_{kind}", codec="h264", crf=-1, audio=_audio(kind), audio_guard="refuse")
    assert "input 'audio'" in str(e.value) and "nothing was written" in str(e.value)
    assert _files(env["out"]) == before


def test_report_mode_writes_and_reports_figures(env, monkeypatch):
    import ditkit.nodes.save_video as sv

    node = _node(monkeypatch)
    got = []
    monkeypatch.setattr(sv, "send_report", lambda *a, **k: got.append(a) or {"summary": a[3], "data": a[4]})
    res = node.execute(vae=env["vae"], samples={"samples": torch.zeros(1, 24, 2, 4, 4)}, fps=24.0,
                       filename_prefix="guard_dc_report", codec="h264", crf=-1, audio=_audio("dc"))
    data = got[-1][4]
    assert data["audio_guard"]["clean"] is False
    assert data["audio_guard"]["figures"]["dc_offset"] == pytest.approx(0.1, abs=1e-3)
    assert "DC offset" in got[-1][3]
    assert any(f.startswith("guard_dc_report") for f in _files(env["out"]))
    assert res is not None

    got.clear()
    node.execute(vae=env["vae"], samples={"samples": torch.zeros(1, 24, 2, 4, 4)}, fps=24.0,
                 filename_prefix="guard_clean", codec="h264", crf=-1, audio=_audio("clean"), audio_guard="refuse")
    assert got[-1][4]["audio_guard"]["clean"] is True and "audio guard: clean" in got[-1][3]
