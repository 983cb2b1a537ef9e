"""DitKitStepCache (first_block, sigma_schedule) in the real ComfyUI 0.33 host (in process, CPU, tiny checkpoints).

Oracles: the plain model's sampling (threshold 0 must be bit-identical), block evaluations counted independently by
forward pre-hooks on the block modules, the sigma plan recomputed here from the sampler's sigmas with the rule
written out in this file, and ComfyUI's own EasyCache node for the stacking check.
"""
from __future__ import annotations

import pytest
import torch

from tests.integration.test_teacache_host import FAMILIES, Counter, inputs, load, sample

STEPS = 8
STREAMS = {"h3": {"video", "audio"}, "ltx2": {"video", "audio"}, "zimage": {"image"}, "flux2": {"image"}}


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    from ditkit.tiny.checkpoints import generate_all

    torch.set_num_threads(1)
    ck = tmp_path_factory.mktemp("sc_ckpts")
    generate_all(ck, only=list(FAMILIES.values()))
    return {"ckpts": ck}


@pytest.fixture
def reports(monkeypatch):
    import ditkit.bridge.reports as B    # per-run reports (sample wrappers, through the node's ReportTarget)
    import ditkit.nodes.stepcache as N   # install reports (nodes)

    got = []
    real = N.send_report

    def rec(node_id, node_type, kind, summary, data=None):
        got.append({"node_type": node_type, "kind": kind, "summary": summary, "data": data})
        return real(node_id, node_type, kind, summary, data)

    monkeypatch.setattr(N, "send_report", rec)
    monkeypatch.setattr(B, "send_report", rec)
    return got


def _stepcache(model, mode, thr, audio_thr=None, start=0.0, end=1.0):
    from ditkit.nodes.stepcache import DitKitStepCache

    return DitKitStepCache.execute(model=model, mode=mode, threshold=thr,
                                   audio_threshold=thr if audio_thr is None else audio_thr, start_percent=start,
                                   end_percent=end, cache_device="model").result[0]


def _last(reports, kind="stepcache"):
    return [r for r in reports if r["kind"] == kind][-1]["data"]


@pytest.mark.parametrize("family", ["h3", "ltx2", "zimage", "flux2"])
@pytest.mark.parametrize("mode", ["first_block", "sigma_schedule"])
def test_modes_on_every_family(env, reports, family, mode):
    model = load(env, family)
    pos, neg, lat = inputs(model, family, 3)
    ref = sample(model, pos, neg, lat)
    # threshold 0: hooks active, nothing skipped, bit-identical to the plain model
    out0 = sample(_stepcache(model, mode, 0.0), pos, neg, lat)
    assert all(torch.equal(a, b) for a, b in zip(out0, ref))
    rep = _last(reports)
    assert rep["skipped"] == 0 and rep["computed"] == STEPS and rep["mode"] == mode

    reports.clear()
    cnt = Counter(model)
    out = sample(_stepcache(model, mode, 10.0), pos, neg, lat)
    cnt.close()
    rep = _last(reports)
    assert rep["family"] == family and set(rep["streams"]) == STREAMS[family]
    assert rep["computed"] + rep["skipped"] == STEPS == rep["calls"]
    assert rep["skipped"] == STEPS - 2  # threshold 10: everything but the forced first and last step reuses
    assert rep["forced"]["first step"] == 1 and rep["forced"]["last step"] == 1
    per_skip = 1 if mode == "first_block" else 0   # block 0 still runs on a first-block skip
    assert cnt.n == rep["computed"] * cnt.per_stack + rep["skipped"] * per_skip
    for s in STREAMS[family]:
        assert rep["streams"][s]["skipped"] == rep["skipped"]
    if family in ("h3", "ltx2"):   # the audio stream's NaN/Inf check at the end of sampling
        assert rep["audio_latent"]["nonfinite"] == 0 and len(rep["audio_latent"]["shape"]) >= 3
    else:
        assert "audio_latent" not in rep
    assert any(not torch.equal(a, b) for a, b in zip(out, ref))
    assert "ditkit_teacache" not in model.model_options["transformer_options"]


@pytest.mark.parametrize("family", ["h3", "ltx2"])
@pytest.mark.parametrize("mode", ["first_block", "sigma_schedule"])
def test_audio_vetoes(env, reports, family, mode):
    model = load(env, family)
    pos, neg, lat = inputs(model, family, 4)
    sample(_stepcache(model, mode, 10.0, audio_thr=0.0), pos, neg, lat)
    rep = _last(reports)
    assert rep["skipped"] == 0
    assert rep["streams"]["audio"]["vetoes"] == STEPS - 2 and rep["streams"]["video"]["vetoes"] == 0


def test_sigma_plan_matches_the_schedule_rule(env, reports):
    import comfy.samplers

    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 5)
    thr = 0.12
    sample(_stepcache(model, "sigma_schedule", thr), pos, neg, lat)
    rep = _last(reports)
    sig = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", STEPS).tolist()
    plan, last = [], 0
    for i in range(STEPS):   # the rule, written out: compute first/last, else reuse while sigma_last - sigma_i < thr
        if i in (0, STEPS - 1) or not (sig[last] - sig[i] < thr):
            plan.append("C")
            last = i
        else:
            plan.append(".")
    assert rep["plan"] == "".join(plan)
    assert rep["skipped"] == plan.count(".")


def test_cfg_conditions_keep_their_own_state(env, reports):
    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 6)
    sample(_stepcache(model, "first_block", 10.0), pos, neg, lat, cfg=3.0)
    rep = _last(reports)
    assert len(rep["per_condition"]) == 2
    assert all(c["skipped"] == STEPS - 2 for c in rep["per_condition"])


def test_default_thresholds_are_named_in_the_report(env, reports):
    from ditkit.cache.stepcache import DEFAULT_THRESHOLDS

    model = load(env, "h3")
    _stepcache(model, "first_block", -1.0)
    inst = _last(reports, "stepcache_install")
    assert inst["thresholds"] == DEFAULT_THRESHOLDS["first_block"]
    assert len(inst["defaults_used"]) == 2


def test_nonfinite_audio_latent_is_reported(env, reports, monkeypatch):
    import ditkit.bridge.stepcache as B

    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 8)
    real = B.audio_latent_check

    def poisoned(out, shapes):   # what the check sees when sampling produced NaNs in the audio latent
        out = out.clone()
        out.view(-1)[-3:] = float("nan")   # the flat pack ends with the audio part
        return real(out, shapes)

    monkeypatch.setattr(B, "audio_latent_check", poisoned)
    sample(_stepcache(model, "sigma_schedule", 0.1), pos, neg, lat)
    hit = [r for r in reports if r["kind"] == "stepcache"][-1]
    assert hit["data"]["audio_latent"]["nonfinite"] == 3 and "3 NaN/Inf" in hit["summary"]


def test_stacking_is_refused(env):
    from comfy_extras.nodes_easycache import EasyCacheNode

    from ditkit.errors import CacheStackError

    model = load(env, "h3")
    cached = _stepcache(model, "first_block", 0.1)
    with pytest.raises(CacheStackError):
        _stepcache(cached, "sigma_schedule", 0.1)
    ec = EasyCacheNode.execute(model=model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95,
                           verbose=False).result[0]
    with pytest.raises(CacheStackError):
        _stepcache(ec, "first_block", 0.1)


def test_reducer_hook_sees_the_sums_and_decides(env, reports):
    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 7)
    m = _stepcache(model, "first_block", 10.0)
    seen = []

    def all_reduce_like(sums):   # a reducer that makes every distance huge: no skip may happen
        seen.append(tuple(sums.shape))
        out = sums.clone()
        out[:, 0] = out[:, 1] * 1e3 + 1.0
        return out

    m.model_options["transformer_options"]["ditkit_stepcache_reducer"] = all_reduce_like
    sample(m, pos, neg, lat)
    rep = _last(reports)
    assert rep["skipped"] == 0 and seen and all(s == (2, 2) for s in seen)  # 1 condition x (video, audio)
    assert rep["reducer"] == "all_reduce_like"


def test_teacache_reports_the_audio_latent_too(env, monkeypatch):
    """Every ditkit step cache feeds the audio-stream check: calibrated TeaCache's run report carries it too."""
    import ditkit.bridge.reports as BT
    from ditkit.nodes.teacache import DitKitTeaCache

    got = []
    real = BT.send_report
    monkeypatch.setattr(BT, "send_report", lambda *a, **k: got.append(a) or real(*a, **k))
    model = load(env, "h3")
    pos, neg, lat = inputs(model, "h3", 9)
    m = DitKitTeaCache.execute(model=model, coefficients="shipped:h3_tiny_calibrated", threshold=0.3,
                               audio_threshold=0.3, start_percent=0.0, end_percent=1.0, cache_device="model",
                               strict=False).result[0]
    sample(m, pos, neg, lat)
    rep = [a for a in got if a[2] == "teacache"][-1][4]
    assert rep["audio_latent"]["nonfinite"] == 0
