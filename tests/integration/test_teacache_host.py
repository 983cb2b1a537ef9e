"""DitKitTeaCache / DitKitTeaCacheCalibrate in the real ComfyUI 0.33 host (in process, CPU, tiny checkpoints).

Oracles: the plain model's sampling (threshold 0 must be bit-identical: the hooks compute exactly what the
model computes), block evaluations counted independently by forward pre-hooks on the block modules, the
coefficient file re-read from disk, and ComfyUI's own EasyCache node for the stacking checks.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

STEPS = 8
FAMILIES = {"h3": "h3_dit", "ltx2": "ltx_dit", "zimage": "zimage_dit", "flux2": "flux2_dit"}


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.tiny.checkpoints import generate_all

    torch.set_num_threads(1)
    ck = tmp_path_factory.mktemp("tc_ckpts")
    generate_all(ck, only=list(FAMILIES.values()))
    out = tmp_path_factory.mktemp("tc_out")
    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(out))
    yield {"ckpts": ck, "out": out}
    folder_paths.set_output_directory(old)


@pytest.fixture
def reports(monkeypatch):
    import ditkit.bridge.reports as B    # per-run reports (sample wrappers, through the node's ReportTarget)
    import ditkit.nodes.teacache as T    # install reports (nodes)

    got = []
    real = T.send_report

    def rec(node_id, node_type, kind, summary, data=None):
        got.append({"node_type": node_type, "kind": kind, "summary": summary, "data": data})
        return real(node_id, node_type, kind, summary, data)

    monkeypatch.setattr(T, "send_report", rec)
    monkeypatch.setattr(B, "send_report", rec)
    return got


_MODELS = {}


def load(env, family):
    if family not in _MODELS:
        import comfy.sd

        names = {"h3": "h3_tiny_comfy", "ltx2": "ltx2_tiny", "zimage": "zimage_tiny", "flux2": "flux2_tiny"}
        path = os.path.join(env["ckpts"], "diffusion_models", names[family] + ".safetensors")
        if family == "zimage":
            from ditkit.nodes.image_loaders import load_zimage

            _MODELS[family] = load_zimage(path)[0]
        else:
            _MODELS[family] = comfy.sd.load_diffusion_model(path)
    return _MODELS[family]


def inputs(model, family, prompt):
    g = torch.Generator().manual_seed(500 + prompt)
    dm = model.model.diffusion_model
    if family == "h3":
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

        w = dm.condition_proj.weight.shape[1]
        lat = EmptyMiniMaxH3LatentAV.execute(width=64, height=64, length=22).result[0]
    elif family == "ltx2":
        from comfy_extras.nodes_lt import EmptyLTXVLatentVideo, LTXVConcatAVLatent

        w = dm.caption_channels
        v = EmptyLTXVLatentVideo.execute(width=64, height=64, length=9, batch_size=1).result[0]
        lat = LTXVConcatAVLatent.execute(video_latent=v, audio_latent={"samples": torch.zeros(1, 8, 10, 16), "type": "audio"}).result[0]
    elif family == "zimage":
        w = dm.cap_embedder[-1].weight.shape[1]
        lat = {"samples": torch.zeros(1, 16, 16, 16)}
    else:
        w = dm.txt_in.weight.shape[1]
        lat = {"samples": torch.zeros(1, 128, 8, 8)}
    pos = [[torch.randn(1, 8, w, generator=g), {}]]
    neg = [[torch.randn(1, 8, w, generator=g) * 0.5, {}]]
    return pos, neg, lat


def sample(model, pos, neg, lat, steps=STEPS, cfg=1.0):
    import nodes

    s = nodes.common_ksampler(model, 3, steps, cfg, "euler", "simple", pos, neg, lat, denoise=1.0)[0]["samples"]
    return [t.clone() for t in s.unbind()] if getattr(s, "is_nested", False) else [s.clone()]


class Counter:
    def __init__(self, model):
        dm = model.model.diffusion_model
        blocks = []
        for name in ("blocks", "transformer_blocks", "layers"):
            if isinstance(getattr(dm, name, None), torch.nn.ModuleList):
                blocks = list(getattr(dm, name)._modules.values())
                break
        else:
            blocks = list(dm.double_blocks) + list(dm.single_blocks)
        self.n = 0
        self.per_stack = len(blocks)
        self.h = [b.register_forward_pre_hook(self._hook) for b in blocks]

    def _hook(self, *_):
        self.n += 1

    def close(self):
        for h in self.h:
            h.remove()


def _teacache(model, spec, thr, strict=False, audio_thr=None):
    from ditkit.nodes.teacache import DitKitTeaCache

    return DitKitTeaCache.execute(model=model, coefficients=spec, threshold=thr,
                                  audio_threshold=thr if audio_thr is None else audio_thr, start_percent=0.0,
                                  end_percent=1.0, cache_device="model", strict=strict).result[0]


def _calibrate(env, family, name, prompts=3, steps=STEPS, cfg=1.0):
    from ditkit.nodes.teacache import DitKitTeaCacheCalibrate

    model = load(env, family)
    cal = DitKitTeaCacheCalibrate.execute(model=model, name=name, degree=4, min_prompts=3).result[0]
    for p in range(prompts):
        ref = sample(model, *inputs(model, family, p), steps=steps, cfg=cfg)
        got = sample(cal, *inputs(model, family, p), steps=steps, cfg=cfg)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), "calibration recording changed the sampling output"
    return os.path.join(env["out"], "ditkit", "teacache", f"{name}.json")


def test_h3_calibrate_skip_report_and_guard(env, reports):
    from ditkit.cache import coefficients as coef
    from ditkit.errors import CoefficientError
    from ditkit.nodes.teacache import model_fingerprint

    model = load(env, "h3")
    path = _calibrate(env, "h3", "h3_host")
    assert os.path.isfile(path)
    raw = json.loads(open(path).read())
    assert raw["format"] == coef.FORMAT and raw["version"] == 1 and raw["family"] == "h3"
    assert raw["calibration"]["n_prompts"] == 3 and raw["calibration"]["n_runs"] == 3
    assert raw["fingerprint"]["model"]["weights_sha256"] == model_fingerprint(model)["weights_sha256"]
    assert raw["fingerprint"]["steps"] == STEPS and len(raw["fingerprint"]["sigmas"]) == STEPS + 1
    assert raw["fingerprint"]["sampler"] == "euler"
    for s in ("video", "audio"):
        st = raw["streams"][s]
        assert len(st["coefficients"]) == 5 and "r2" in st["fit"] and st["fit"]["n_pairs"] == 3 * (STEPS - 1)
    cal_reps = [r for r in reports if r["kind"] == "teacache_calibration"]
    assert len(cal_reps) == 3 and "wrote" in cal_reps[-1]["summary"]

    pos, neg, lat = inputs(model, "h3", 9)
    ref = sample(model, pos, neg, lat)
    # threshold 0: hooks active, nothing skipped, bit-identical to the plain model
    out0 = sample(_teacache(model, "h3_host.json", 0.0), pos, neg, lat)
    assert all(torch.equal(a, b) for a, b in zip(out0, ref))

    reports.clear()
    cnt = Counter(model)
    out = sample(_teacache(model, "h3_host.json", 10.0), pos, neg, lat)
    cnt.close()
    rep = [r for r in reports if r["kind"] == "teacache"][-1]["data"]
    assert rep["skipped"] >= 1 and rep["computed"] + rep["skipped"] == STEPS
    assert cnt.n == rep["computed"] * cnt.per_stack  # independent count of block evaluations
    assert set(rep["streams"]) == {"video", "audio"}
    for s in ("video", "audio"):
        assert rep["streams"][s]["skipped"] == rep["skipped"] and rep["streams"][s]["computed"] == rep["computed"]
    assert rep["forced"]["first step"] == 1 and rep["forced"]["last step"] == 1
    assert not rep["warnings"]
    assert any(not torch.equal(a, b) for a, b in zip(out, ref))

    # audio veto: audio threshold 0 blocks every skip
    reports.clear()
    sample(_teacache(model, "h3_host.json", 10.0, audio_thr=0.0), pos, neg, lat)
    rep = [r for r in reports if r["kind"] == "teacache"][-1]["data"]
    assert rep["skipped"] == 0 and rep["streams"]["audio"]["vetoes"] >= 1

    # guard: another step count / schedule -> warning in the report, strict -> error, model untouched
    reports.clear()
    sample(_teacache(model, "h3_host.json", 0.3), pos, neg, lat, steps=12)
    rep = [r for r in reports if r["kind"] == "teacache"][-1]["data"]
    assert any(w.startswith("steps") for w in rep["warnings"])
    with pytest.raises(CoefficientError, match="strict"):
        sample(_teacache(model, "h3_host.json", 0.3, strict=True), pos, neg, lat, steps=12)
    assert "ditkit_teacache" not in model.model_options["transformer_options"]


def test_stacking_is_refused(env):
    from comfy_extras.nodes_easycache import EasyCacheNode

    from ditkit.errors import CacheStackError
    from ditkit.nodes.teacache import DitKitTeaCacheCalibrate

    model = load(env, "h3")
    spec = "shipped:flux2_borrowed_flux1_dev"  # never reached: the stacking check comes first
    ez = EasyCacheNode.execute(model=model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False).result[0]
    before = (dict(ez.model_options["transformer_options"]), {k: dict(v) for k, v in ez.wrappers.items()})
    with pytest.raises(CacheStackError, match="EasyCache"):
        _teacache(ez, spec, 0.2)
    assert before == (dict(ez.model_options["transformer_options"]), {k: dict(v) for k, v in ez.wrappers.items()})
    cal = DitKitTeaCacheCalibrate.execute(model=model, name="stack", degree=4, min_prompts=3).result[0]
    with pytest.raises(CacheStackError, match="ditkit cache"):
        _teacache(cal, spec, 0.2)
    # EasyCache put on top of a ditkit cache: refused when sampling starts
    top = EasyCacheNode.execute(model=cal, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False).result[0]
    with pytest.raises(CacheStackError):
        sample(top, *inputs(model, "h3", 0), steps=3)


def test_bad_coefficient_files_leave_model_unchanged(env, tmp_path):
    from ditkit.errors import CoefficientError, UnsupportedModelError

    model = load(env, "h3")
    to_before = dict(model.model_options["transformer_options"])
    with pytest.raises(CoefficientError, match="Z-Image.*MiniMax H3"):
        _teacache(model, "shipped:zimage_borrowed_qwen_image", 0.2)
    bad = env["out"] / "ditkit" / "teacache" / "bad.json"  # coefficient files are read from this folder only
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"format": "ditkit.teacache.coefficients", "version": 1, "family": "h3", "streams": {"video": '
                   '{"coefficients": [1.0, NaN]}}}')
    with pytest.raises(CoefficientError, match="NaN"):
        _teacache(model, str(bad), 0.2)
    bad.write_text(json.dumps({"format": "ditkit.teacache.coefficients", "version": 99}))
    with pytest.raises(CoefficientError, match="version"):
        _teacache(model, str(bad), 0.2)
    with pytest.raises(CoefficientError, match="does not exist"):
        _teacache(model, str(bad.parent / "missing.json"), 0.2)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"format": "TOPSECRET"}))
    with pytest.raises(CoefficientError, match="must live in") as ei:
        _teacache(model, str(outside), 0.2)
    assert "TOPSECRET" not in str(ei.value)
    with pytest.raises(CoefficientError, match="leaves"):
        _teacache(model, "../../etc/passwd", 0.2)
    assert dict(model.model_options["transformer_options"]) == to_before
    assert not model.get_all_wrappers("diffusion_model")
    # a model family TeaCache does not support
    fake = model.clone()
    fake.model = type("M", (), {"diffusion_model": torch.nn.Linear(1, 1)})()
    with pytest.raises(UnsupportedModelError):
        _teacache(fake, "x.json", 0.2)


def _in_prompt(graph: dict, node_id: str, fn):
    """Run ``fn`` as ComfyUI runs a node of ``graph``: its DynamicPrompt in the progress registry, the executing
    context set (ComfyUI's own classes)."""
    from comfy_execution.graph import DynamicPrompt
    from comfy_execution.progress import reset_progress_state
    from comfy_execution.utils import CurrentNodeContext

    reset_progress_state("tc-prompt", DynamicPrompt(graph))
    with CurrentNodeContext("tc-prompt", node_id):
        return fn()


def test_missing_coefficient_file_fails_on_the_teacache_node(env):
    """No DitKitTeaCacheCalibrate in the prompt writes the file: the TeaCache node itself fails, before sampling."""
    from ditkit.errors import CoefficientError

    model = load(env, "h3")
    with pytest.raises(CoefficientError, match="does not exist and no DitKitTeaCacheCalibrate in this workflow"):
        _teacache(model, "h3_never_written.json", 0.3)          # outside any prompt
    graph = {"12": {"class_type": "DitKitTeaCache", "inputs": {"model": ["1", 0], "coefficients": "h3_never_written"}},
             "7": {"class_type": "DitKitTeaCacheCalibrate", "inputs": {"model": ["1", 0], "name": "other_name"}}}
    with pytest.raises(CoefficientError, match="does not exist and no DitKitTeaCacheCalibrate"):
        _in_prompt(graph, "12", lambda: _teacache(model, "h3_never_written", 0.3))


def test_deferred_coefficient_file_is_loaded_at_sampling(env, reports):
    """A DitKitTeaCacheCalibrate of the same prompt writes the file (it may run first): loading waits for sampling,
    and a file still missing then names the calibration node."""
    from ditkit.errors import CoefficientError

    model = load(env, "h3")
    graph = {"12": {"class_type": "DitKitTeaCache", "inputs": {"model": ["1", 0], "coefficients": "h3_later.json"}},
             "7": {"class_type": "DitKitTeaCacheCalibrate", "inputs": {"model": ["1", 0], "name": " h3_later.json"}}}
    tc = _in_prompt(graph, "12", lambda: _teacache(model, "h3_later.json", 0.3))
    inst = [r for r in reports if r["kind"] == "teacache_install"][-1]
    assert inst["data"]["deferred"] and inst["data"]["writers"] == ["7"], inst["data"]
    with pytest.raises(CoefficientError, match=r"does not exist.*expected from DitKitTeaCacheCalibrate #7"):
        sample(tc, *inputs(model, "h3", 0), steps=4)


@pytest.mark.parametrize("family,cfg", [("ltx2", 3.0), ("zimage", 3.0), ("flux2", 1.0)])
def test_other_families_calibrate_and_skip(env, reports, family, cfg):
    model = load(env, family)
    path = _calibrate(env, family, f"{family}_host", steps=6, cfg=cfg)
    raw = json.loads(open(path).read())
    want_streams = {"ltx2": {"video", "audio"}, "zimage": {"image"}, "flux2": {"image"}}[family]
    assert set(raw["streams"]) == want_streams
    pos, neg, lat = inputs(model, family, 9)
    ref = sample(model, pos, neg, lat, steps=6, cfg=cfg)
    out0 = sample(_teacache(model, f"{family}_host.json", 0.0), pos, neg, lat, steps=6, cfg=cfg)
    assert all(torch.equal(a, b) for a, b in zip(out0, ref))
    reports.clear()
    cnt = Counter(model)
    sample(_teacache(model, f"{family}_host.json", 50.0), pos, neg, lat, steps=6, cfg=cfg)
    cnt.close()
    rep = [r for r in reports if r["kind"] == "teacache"][-1]["data"]
    assert rep["skipped"] >= 1 and set(rep["streams"]) == want_streams
    assert cnt.n == rep["computed"] * cnt.per_stack
    if cfg != 1.0:  # cond and uncond batched together: two condition states, decided jointly
        assert len(rep["per_condition"]) == 2
        assert {d["skipped"] for d in rep["per_condition"]} == {rep["skipped"]}


# ------------------------------------------------------------------------------------------------ real server

def _api(name):
    from ditkit.run import REPO

    return json.loads((REPO / "tests" / "data" / "workflows" / "api" / name).read_text(encoding="utf-8"))


def test_server_calibrate_then_teacache_workflow(comfy_server):
    """Real headless ComfyUI: the test graph calibrates on 3 prompts, writes the coefficient file, and the
    TeaCache sampler in the same workflow skips steps and reports per-stream counts; a 12-step run warns."""
    import re

    graph = _api("teacache_calibrate_then_use.json")
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    path = comfy_server.output_dir / "ditkit" / "teacache" / "h3_teacache_tiny.json"
    raw = json.loads(path.read_text())
    assert raw["calibration"]["n_prompts"] >= 3 and raw["fingerprint"]["steps"] == 8
    assert raw["fingerprint"]["model"]["weights_sha256"] and raw["streams"]["video"]["fit"]["r2"] is not None
    log = comfy_server.log_text()
    m = re.findall(r"TeaCache h3: computed (\d+)/(\d+) calls, skipped (\d+).*?\| video: skipped (\d+).*?\| audio: skipped (\d+)", log)
    assert m, log[-3000:]
    computed, calls, skipped, v_skip, a_skip = map(int, m[-1])
    assert calls == 8 and skipped >= 1 and computed + skipped == calls and v_skip == a_skip == skipped
    # same file, another step count -> the guard warns in the report and the log
    graph["13"]["inputs"]["steps"] = 12
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    log = comfy_server.log_text()
    assert re.search(r"coefficient fingerprint mismatch: steps: file has 8, this run has 12", log)
    assert re.search(r"TeaCache h3: computed \d+/12 calls.*WARNING: \d+ fingerprint mismatch", log)


def test_missing_coefficient_file_is_reported_on_the_teacache_node(comfy_server):
    """On a real server the failing node is DitKitTeaCache (before: the KSampler, when sampling started)."""
    graph = _api("teacache_calibrate_then_use.json")
    graph = {k: v for k, v in graph.items() if v["class_type"] != "DitKitTeaCacheCalibrate"
             and not (v["class_type"] == "KSampler" and v["inputs"]["model"][0] != "12")
             and v["class_type"] not in ("LTXVSeparateAVLatent", "SaveLatent")}
    graph["12"]["inputs"]["model"] = ["1", 0]
    graph["12"]["inputs"]["coefficients"] = "no_such_file_anywhere.json"
    graph["13"]["inputs"]["latent_image"] = ["2", 0]
    graph["20"] = {"class_type": "PreviewAny", "inputs": {"source": ["13", 0]}}
    err = comfy_server.run_expect_failure(graph)
    errors = [m[1] for m in (err.entry or {}).get("status", {}).get("messages", []) if m[0] == "execution_error"]
    assert errors, err
    assert errors[0]["node_type"] == "DitKitTeaCache" and errors[0]["node_id"] == "12", errors[0]
    assert "no_such_file_anywhere.json' does not exist" in errors[0]["exception_message"], errors[0]


def test_composes_with_h3_adaln_schedule_cache(env, reports):
    """The AdaLN schedule cache is not a step cache: TeaCache stacks on it, and with threshold 0 the output is
    exactly the AdaLN-cache-only output."""
    pytest.importorskip("ditkit.nodes.adaln_cache")
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    model = load(env, "h3")
    if not os.path.isfile(os.path.join(env["out"], "ditkit", "teacache", "h3_host.json")):
        _calibrate(env, "h3", "h3_host")
    ad = DitKitH3AdaLNCache.execute(model=model, offload_weights=False).result[0]
    pos, neg, lat = inputs(model, "h3", 4)
    ref = sample(ad, pos, neg, lat)
    out = sample(_teacache(ad, "h3_host.json", 0.0), pos, neg, lat)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    reports.clear()
    sample(_teacache(ad, "h3_host.json", 10.0), pos, neg, lat)
    assert [r for r in reports if r["kind"] == "teacache"][-1]["data"]["skipped"] >= 1


def test_state_is_reset_between_samplings_and_kept_per_condition(env, reports):
    """Same TeaCache model, same inputs, with another prompt sampled in between: identical outputs (no residual
    leaks across samplings). With cfg > 1 on H3 (batch 1: cond and uncond are separate calls) both conditions
    keep their own state and counts."""
    model = load(env, "h3")
    if not os.path.isfile(os.path.join(env["out"], "ditkit", "teacache", "h3_host.json")):
        _calibrate(env, "h3", "h3_host")
    tc = _teacache(model, "h3_host.json", 0.5)
    a = inputs(model, "h3", 11)
    b = inputs(model, "h3", 12)
    first = sample(tc, *a, cfg=3.0)
    sample(tc, *b, cfg=3.0)
    again = sample(tc, *a, cfg=3.0)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    rep = [r for r in reports if r["kind"] == "teacache"][-1]["data"]
    assert rep["calls"] == 2 * STEPS and len(rep["per_condition"]) == 2
    for c in rep["per_condition"]:
        assert c["computed"] + c["skipped"] == STEPS
