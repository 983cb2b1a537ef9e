"""The sampling-time audio check (bridge/audio_watch.py) on every cache and schedule node, in the real ComfyUI host
(in process, CPU, tiny checkpoints).

Oracles: the denoised audio estimates recorded here by our own sampler callback (which must still be called: the
check wraps it, never replaces it), their spectral steps computed here with the rule written out in this file
(rFFT along the latent's time axis, power in dB floored 60 dB below the pair's peak, RMS over every row and bin),
and the sampled audio latent's NaN/Inf count read here.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.integration.test_teacache_host import inputs, load

STEPS = 6


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    from ditkit.tiny.checkpoints import generate_all

    torch.set_num_threads(1)
    ck = tmp_path_factory.mktemp("aw_ckpts")
    generate_all(ck, only=["h3_dit", "ltx_dit", "zimage_dit"])
    return {"ckpts": ck}


@pytest.fixture
def sent(monkeypatch):
    import ditkit.bridge.reports as B

    got = []
    real = B.send_report

    def rec(node_id, node_type, kind, summary, data=None):
        got.append({"node_type": node_type, "kind": kind, "summary": summary, "data": data})
        return real(node_id, node_type, kind, summary, data)

    monkeypatch.setattr(B, "send_report", rec)
    return got


def _sample(model, pos, neg, lat, sigmas=None):
    """Euler with our own callback: (audio estimates per step, final audio latent or None)."""
    import comfy.sample
    import comfy.samplers

    seen = []

    def cb(step, x0, x, total):
        parts = x0.unbind() if getattr(x0, "is_nested", False) else [x0]
        if len(parts) > 1:
            seen.append(parts[1].detach().double().clone())

    li = lat["samples"]
    noise = comfy.sample.prepare_noise(li, 5, None)
    if sigmas is None:
        out = comfy.sample.sample(model, noise, STEPS, 1.0, "euler", "simple", pos, neg, li, denoise=1.0,
                                  callback=cb, disable_pbar=True, seed=5)
    else:
        sampler = comfy.samplers.sampler_object("euler")
        out = comfy.sample.sample_custom(model, noise, 1.0, sampler, sigmas, pos, neg, li, callback=cb,
                                         disable_pbar=True, seed=5)
    parts = out.unbind() if getattr(out, "is_nested", False) else [out]
    return seen, (parts[1] if len(parts) > 1 else None)


def _steps_db(seen, time_dim):
    def spec(x):
        t = x.movedim(time_dim, -1).reshape(-1, x.shape[time_dim])
        f = torch.fft.rfft(t, dim=-1)
        return 10 * torch.log10((f.real ** 2 + f.imag ** 2).clamp_min(1e-30))

    out = []
    for a, b in zip(seen, seen[1:]):
        pa, pb = spec(a), spec(b)
        floor = max(float(pa.max()), float(pb.max())) - 60.0
        out.append(math.sqrt(float(((pb.clamp_min(floor) - pa.clamp_min(floor)) ** 2).mean())))
    return out


def _check(data, seen, audio, time_dim):
    al = data["audio_latent"]
    assert al["nonfinite"] == int((~torch.isfinite(audio)).sum()) == 0 and al["shape"] == list(audio.shape)
    tr = al["trajectory"]
    assert tr["steps"] == len(seen) == STEPS
    assert tr["jumps_db"] == pytest.approx([round(v, 3) for v in _steps_db(seen, time_dim)], abs=1.5e-3)
    want = _steps_db(seen, time_dim)
    assert tr["final_jump_ratio"] == pytest.approx(round(want[-1] / want[-2], 3), abs=1.5e-3)
    assert tr["clean"] == (want[-1] / want[-2] <= 3.0) == al["clean"]


def _stepcache(model, mode="first_block", thr=0.1):
    from ditkit.nodes.stepcache import DitKitStepCache

    return DitKitStepCache.execute(model=model, mode=mode, threshold=thr, audio_threshold=thr, start_percent=0.0,
                                   end_percent=1.0, cache_device="model").result[0]


@pytest.mark.parametrize("family,time_dim", [("h3", -1), ("ltx2", 2)])
def test_step_cache_reports_the_trajectory_check(env, sent, family, time_dim):
    model = load(env, family)
    pos, neg, lat = inputs(model, family, 1)
    seen, audio = _sample(_stepcache(model), pos, neg, lat)
    rep = [r for r in sent if r["kind"] == "stepcache"][-1]
    _check(rep["data"], seen, audio, time_dim)


def test_teacache_reports_the_trajectory_check(env, sent):
    from ditkit.nodes.teacache import DitKitTeaCache

    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 2)
    m = DitKitTeaCache.execute(model=model, coefficients="shipped:h3_tiny_calibrated", threshold=0.3,
                               audio_threshold=0.3, start_percent=0.0, end_percent=1.0, cache_device="model",
                               strict=False).result[0]
    seen, audio = _sample(m, pos, neg, lat)
    rep = [r for r in sent if r["kind"] == "teacache"][-1]
    _check(rep["data"], seen, audio, -1)


def test_adaln_cache_reports_the_trajectory_check(env, sent):
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 3)
    m = DitKitH3AdaLNCache.execute(model, False).args[0]
    seen, audio = _sample(m, pos, neg, lat)
    rep = [r for r in sent if r["kind"] == "adaln_cache"][-1]
    _check(rep["data"], seen, audio, -1)


def test_fasth3_schedule_reports_the_trajectory_check(env, sent):
    from ditkit.nodes.fasth3 import DitKitFastH3Schedule

    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 4)
    out = DitKitFastH3Schedule.execute(model, "fasth3_preview_4step", "")
    m, sigmas = out.args[0], out.args[1]
    seen, audio = _sample(m, pos, neg, lat, sigmas=sigmas)
    rep = [r for r in sent if r["kind"] == "audio_watch"][-1]
    assert rep["node_type"] == "DitKitFastH3Schedule"
    al = rep["data"]
    assert al["trajectory"]["steps"] == len(seen) == 4 and al["nonfinite"] == 0
    want = _steps_db(seen, -1)
    assert al["trajectory"]["jumps_db"] == pytest.approx([round(v, 3) for v in want], abs=1.5e-3)


def test_image_models_are_not_watched(env, sent):
    model = load(env, "zimage")
    pos, neg, lat = inputs(model, "zimage", 1)
    _sample(_stepcache(model, "sigma_schedule", 0.05), pos, neg, lat)
    rep = [r for r in sent if r["kind"] == "stepcache"][-1]
    assert "audio_latent" not in rep["data"]


def test_a_stale_estimate_is_flagged_on_the_node_and_reaches_the_save_node(env, sent, monkeypatch):
    """The monitor sees a stale audio estimate (the same estimate on every step but the last, as a cache reusing
    it would give): the step cache's report is amber with the figure, and the verdict is kept for the sampler
    node, where DitKitSaveVideo's upstream lookup finds it."""
    import ditkit.bridge.audio_watch as W

    real_wrap = W.AudioWatch.wrap

    def stale_wrap(self, callback):
        inner = real_wrap(self, callback)
        first = {}

        def cb(step, x0, x, total):
            if step < total - 1:   # every step but the last sees step 0's estimate
                x0 = first.setdefault("x0", x0.clone())
            return inner(step, x0, x, total)

        return cb

    graph = {"1": {"class_type": "KSampler", "inputs": {"model": ["2", 0]}},
             "2": {"class_type": "DitKitStepCache", "inputs": {"mode": "first_block"}},
             "3": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["1", 0]}},
             "4": {"class_type": "DitKitSaveVideo", "inputs": {"audio": ["3", 0]}},
             "5": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "seed": 9}}}
    monkeypatch.setattr(W.AudioWatch, "wrap", stale_wrap)
    monkeypatch.setattr(W, "_executing", lambda: ("p1", "1"))
    monkeypatch.setattr(W, "current_graph", lambda pid=None: (graph.get, list(graph)))
    monkeypatch.setattr(W, "_VERDICTS", type(W._VERDICTS)())
    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 5)
    _sample(_stepcache(model, "first_block", 0.0), pos, neg, lat)
    rep = [r for r in sent if r["kind"] == "stepcache"][-1]
    tr = rep["data"]["audio_latent"]["trajectory"]
    assert tr["final_jump_ratio"] == math.inf and not tr["clean"] and not rep["data"]["audio_latent"]["clean"]
    assert "WARNING: audio stream while sampling: final spectral jump" in rep["summary"]
    found = W.upstream_verdicts("4")
    assert [v["sampler"] for v in found] == ["1"] and not found[0]["clean"] and found[0]["node"] == "1"
    assert found[0]["by"].startswith("DitKitStepCache")
    assert W.upstream_verdicts("5") == [] and W.upstream_verdicts(None) == []   # no audio input / no node


def test_save_video_refuses_audio_whose_sampling_was_flagged(comfy, monkeypatch, tmp_path):
    import ditkit.nodes.save_video as S
    from ditkit.errors import DitKitError

    monkeypatch.setattr(S.audio_watch, "upstream_verdicts", lambda nid, input_name="audio": [
        {"by": "DitKitStepCache #2", "sampler": "1", "clean": False, "summary": "final spectral jump 9x",
         "node": "1", "nonfinite": 0}])
    monkeypatch.setattr(S, "check_save_request", lambda *a, **k: (1, 3, 2, 8, 8))
    monkeypatch.setattr(S, "_video_latent", lambda s: torch.zeros(1, 3, 2, 8, 8))
    t = torch.arange(32000, dtype=torch.float32) / 32000
    audio = {"waveform": (0.3 * torch.sin(2 * math.pi * 440 * t)).repeat(1, 2, 1), "sample_rate": 32000}
    with pytest.raises(DitKitError, match="DitKitStepCache #2 .*final spectral jump 9x"):
        S.DitKitSaveVideo.execute(vae=None, samples={}, fps=24.0, filename_prefix="x", codec="h264", crf=-1,
                                  audio=audio, audio_guard="refuse")


def test_the_callback_contract_holds_on_this_host(comfy):
    from ditkit.bridge.contract_entries import _outer_sample_callback

    p = _outer_sample_callback()
    assert p.state == "holds", p.note
