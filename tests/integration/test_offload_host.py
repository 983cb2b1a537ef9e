"""Offload features inside a real ComfyUI (in-process, CPU): H3 AdaLN schedule cache, text-encoder streaming.

Oracles: the same ComfyUI model sampled without ditkit (bit equality), ComfyUI's own text encoder without
streaming (bit equality), and counts derived from the schedule (steps x projections)."""
from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(scope="module")
def ckpts(comfy, tmp_path_factory):
    from ditkit.tiny.checkpoints import generate_all

    out = tmp_path_factory.mktemp("offload_ckpts")
    generate_all(out, only=["h3_dit", "h3_dit_curve", "h3_te", "ltx_te"])
    return out


@pytest.fixture
def reports(monkeypatch):
    import ditkit.bridge.reports as reports
    import ditkit.nodes.adaln_cache as ac

    got = []
    real = ac.send_report

    def capture(node_id, node_type, kind, summary, data=None):
        got.append({"summary": summary, "data": data or {}})
        return real(node_id, node_type, kind, summary, data)

    monkeypatch.setattr(ac, "send_report", capture)
    monkeypatch.setattr(reports, "send_report", capture)   # per-run reports: through the node's ReportTarget
    return got


def _sample(comfy, model, steps, cfg=1.0, sampler="euler", sigmas=None, ctx_seed=0, callback=None):
    import comfy.sample
    import comfy.samplers
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent

    latent, _ = _empty_av_latent(64, 64, 22)
    g = torch.Generator().manual_seed(ctx_seed)
    ctx = torch.randn(1, 6, 48, generator=g)
    pos, neg = [[ctx, {}]], [[torch.randn(1, 5, 48, generator=g), {}]]
    lat = latent["samples"]
    noise = comfy.sample.prepare_noise(lat, 1)
    if sigmas is not None:
        smp = comfy.samplers.sampler_object(sampler)
        return comfy.sample.sample_custom(model, noise, cfg, smp, sigmas, pos, neg, lat, seed=1, disable_pbar=True)
    return comfy.sample.sample(model, noise, steps, cfg, sampler, "simple", pos, neg, lat, seed=1, disable_pbar=True,
                               callback=callback)


def _equal(a, b) -> bool:
    ta, tb = (a.unbind() if hasattr(a, "unbind") else [a]), (b.unbind() if hasattr(b, "unbind") else [b])
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))


def _cached(comfy, model):
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    out = DitKitH3AdaLNCache.execute(model, True)
    m = out.args[0] if hasattr(out, "args") else out.result[0]
    cache = next(v for v in m.object_patches.values() if hasattr(v, "_cache"))._cache
    return m, cache


@pytest.mark.parametrize("fname", ["h3_tiny_comfy", "h3_tiny_curve"])
def test_adaln_cache_bit_identical_two_prompts_different_steps(comfy, ckpts, reports, fname):
    import comfy.sd

    model = comfy.sd.load_diffusion_model(str(ckpts / "diffusion_models" / f"{fname}.safetensors"))
    n_proj = len(model.model.diffusion_model.blocks) + 1
    ref4 = _sample(comfy, model, 4, cfg=2.0)
    ref6 = _sample(comfy, model, 6, cfg=2.0, ctx_seed=3)
    m, cache = _cached(comfy, model)
    assert "object_patches" in dir(m) and m is not model
    assert not any(hasattr(v, "_cache") for v in model.object_patches.values())  # input untouched
    got4 = _sample(comfy, m, 4, cfg=2.0)
    got4b = _sample(comfy, m, 4, cfg=2.0)
    got6 = _sample(comfy, m, 6, cfg=2.0, ctx_seed=3)
    assert _equal(ref4, got4) and _equal(ref4, got4b) and _equal(ref6, got6)
    runs = [r["data"]["run"] for r in reports if "run" in r["data"]]
    assert len(runs) == 3
    # cfg 2 -> cond + uncond forward per step, each forward asks every projection once
    assert runs[0] == {"hits": 4 * 2 * n_proj, "misses": 0, "rebuilds": 1, "hot_runs": 0}
    assert runs[1] == {"hits": 4 * 2 * n_proj, "misses": 0, "rebuilds": 0, "hot_runs": 1}
    assert runs[2] == {"hits": 6 * 2 * n_proj, "misses": 0, "rebuilds": 1, "hot_runs": 0}
    assert cache.stats.entries == 6  # one t_emb per step (t2va: t_v and t_a in one tensor)
    assert cache.stats.table_bytes > 0


class _Executor:
    """What ComfyUI hands an OUTER_SAMPLE wrapper: the guider as ``class_obj``, and the rest of the run as a call."""

    def __init__(self, guider, inner):
        self.class_obj = guider
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_adaln_cache_runs_and_clones_do_not_share_run_state(comfy, ckpts, reports):
    """Each sampling run has its own run state (a holder cloned per run, restored in ``finally``, as EasyCache does).
    A 6-step run of a clone going on while a 4-step run of the cached model is in progress (the second run's
    OUTER_SAMPLE wrapper called from inside the first's) must leave the first run its own schedule: its report says
    4 steps. With one runtime object shared by every clone and every run, the inner run overwrote the outer run's
    schedule (the outer report said 6). Afterwards the installed holder is untouched and model_options restored."""
    import types

    import comfy.sd
    from comfy.patcher_extension import WrappersMP

    model = comfy.sd.load_diffusion_model(str(ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    m, cache = _cached(comfy, model)
    m2 = m.clone()
    key = "ditkit_h3_adaln_cache"
    wrap = {id(p): p.wrappers[WrappersMP.OUTER_SAMPLE][key][0] for p in (m, m2)}
    guiders = {id(p): types.SimpleNamespace(model_options=p.model_options, model_patcher=p) for p in (m, m2)}
    s4, s6 = torch.linspace(1, 0, 5), torch.linspace(1, 0, 7)
    seen = {}

    def run(p, sigmas, inner):
        g = guiders[id(p)]
        return wrap[id(p)](_Executor(g, lambda *a, **k: inner(g)), None, None, None, sigmas)

    def inner_run(g):
        seen["outer_options"] = g.model_options
        return run(m2, s6, lambda g2: "inner")

    run(m, s4, inner_run)
    steps = [r["data"]["steps"] for r in reports if "run" in r["data"]]
    assert steps == [6, 4]                                  # inner run reports first; each its own schedule
    assert guiders[id(m)].model_options is m.model_options  # restored after the run
    holders = [p.model_options["transformer_options"].get(key) for p in (m, m2)]
    assert holders[0] is not None and holders[0] is holders[1]          # the clones share the installed holder...
    assert seen["outer_options"]["transformer_options"][key] is not holders[0]   # ...each run works on its own
    assert holders[0].sigmas is None and holders[0].built_for is None        # ...and no run wrote to the shared one


def test_adaln_cache_misses_are_computed_and_reported(comfy, ckpts, reports):
    import comfy.sd

    model = comfy.sd.load_diffusion_model(str(ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    ref = _sample(comfy, model, 4, sampler="dpm_2")     # evaluates between schedule sigmas
    m, cache = _cached(comfy, model)
    got = _sample(comfy, m, 4, sampler="dpm_2")
    assert _equal(ref, got)
    run = [r["data"]["run"] for r in reports if "run" in r["data"]][-1]
    assert run["misses"] > 0 and run["hits"] > 0
    assert "MISSES" in [r["summary"] for r in reports if "run" in r["data"]][-1]


def test_adaln_lora_after_node_rebuilds_and_matches(comfy, ckpts, reports):
    import comfy.sd

    model = comfy.sd.load_diffusion_model(str(ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    m, cache = _cached(comfy, model)
    _sample(comfy, m, 4)
    key = "diffusion_model.blocks.1.adaln_proj.linear.weight"
    w = model.get_model_object(key)
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(5)).to(w.dtype) * 0.05
    ref_p = model.clone()
    ref_p.add_patches({key: (delta,)}, 1.0)
    ref = _sample(comfy, ref_p, 4)
    lora = m.clone()
    lora.add_patches({key: (delta,)}, 1.0)
    got = _sample(comfy, lora, 4)
    assert _equal(ref, got)
    run = [r["data"]["run"] for r in reports if "run" in r["data"]][-1]
    assert run["rebuilds"] == 1 and run["misses"] == 0
    # and back to the unpatched clone: rebuilt again, equal to the plain model
    plain = _sample(comfy, model, 4)
    assert _equal(plain, _sample(comfy, m, 4))
    assert [r["data"]["run"] for r in reports if "run" in r["data"]][-1]["rebuilds"] == 1


def test_adaln_bad_inputs(comfy, ckpts, reports):
    import comfy.sd

    from ditkit.errors import DitKitError, UnsupportedModelError
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    fake = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=torch.nn.Linear(2, 2)))
    with pytest.raises(UnsupportedModelError, match="not a MiniMax H3"):
        DitKitH3AdaLNCache.execute(fake, True)
    model = comfy.sd.load_diffusion_model(str(ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    m, cache = _cached(comfy, model)
    with pytest.raises(UnsupportedModelError, match="already"):
        DitKitH3AdaLNCache.execute(m, True)
    sig = torch.tensor([1.0, float("nan"), 0.0])
    with pytest.raises(DitKitError, match="nan"):
        _sample(comfy, m, 0, sigmas=sig)
    assert cache.signature is None and cache.entries == {}
    # still usable afterwards
    assert _equal(_sample(comfy, model, 3), _sample(comfy, m, 3))


# --------------------------------------------------------------------------------------------------------------
# text encoders: stock CLIP objects, layerwise streaming
# --------------------------------------------------------------------------------------------------------------
def _encode(clip, text="a red fox jumps over the lazy dog"):
    tok = clip.tokenize(text)
    return clip.encode_from_tokens_scheduled(tok)


def _te_reports(monkeypatch):
    import ditkit.bridge.reports as reports
    import ditkit.nodes.text_encoders as te

    got = []
    real = te.send_report

    def capture(node_id, node_type, kind, summary, data=None):
        got.append({"kind": kind, "summary": summary, "data": data or {}})
        return real(node_id, node_type, kind, summary, data)

    monkeypatch.setattr(te, "send_report", capture)
    monkeypatch.setattr(reports, "send_report", capture)   # streaming reports: through the node's ReportTarget
    return got


def _cond_equal(a, b):
    assert len(a) == len(b)
    for (ta, da), (tb, db) in zip(a, b):
        assert ta.dtype == tb.dtype and torch.equal(ta, tb)
        assert set(da) == set(db)
        for k in da:
            if isinstance(da[k], torch.Tensor):
                assert torch.equal(da[k], db[k]), k


@pytest.fixture(scope="module")
def plain_te(comfy, ckpts):
    """Non-streamed encoders and their conditioning, built once per module (CLIP construction is slow)."""
    import comfy.sd

    import ditkit.nodes.text_encoders as te

    out = {}
    for kind, fname, build in (("h3", "qwen3vl_tiny_minimax_h3.safetensors", te.build_h3_clip),
                               ("ltx", "gemma_tiny_ltx.safetensors", te.build_ltx_clip)):
        path = ckpts / "text_encoders" / fname
        plain, cfg, info = build(path)
        assert info == {"streaming": "off"}
        ref = _encode(plain)
        ref2 = _encode(plain, "a second, different prompt")
        out[kind] = (path, build, plain, cfg, ref, ref2)
    # independent oracle for the loader itself: ComfyUI's own load_clip with the same widths
    path, _, _, cfg, ref, _ = out["h3"]
    stock = comfy.sd.load_clip([str(path)], clip_type=comfy.sd.CLIPType.MINIMAX,
                               model_options={"qwen3vl_32b_model_config": dict(cfg)})
    _cond_equal(_encode(stock), ref)
    return out


@pytest.mark.parametrize("kind,prefetch", [("h3", 0), ("h3", 1), ("h3", 2), ("ltx", 1)])
def test_te_streaming_equals_plain_and_bounds_peak(plain_te, monkeypatch, kind, prefetch):
    reps = _te_reports(monkeypatch)
    path, build, plain, cfg, ref, ref2 = plain_te[kind]
    if kind == "h3":
        assert ref[0][0].shape[-1] == 48 and "minimax_token_tags" in ref[0][1]
    else:
        assert ref[0][0].shape[-1] == 40 and ref[0][1].get("unprocessed_ltxav_embeds") is True
    streamed, _, sinfo = build(path, streaming=True, prefetch=prefetch, force=True)
    assert sinfo["streaming"] == "layerwise" and sinfo["layers"] == cfg["num_hidden_layers"]
    # ComfyUI's VRAM budget for the streamed CLIP excludes streamed layers and the host embedding
    assert streamed.patcher.model_size() == sinfo["budgeted_device_bytes"] < plain.patcher.model_size()
    assert streamed.clone().patcher.model_size() == sinfo["budgeted_device_bytes"]
    got = _encode(streamed)
    got2 = _encode(streamed, "a second, different prompt")
    _cond_equal(got, ref)
    _cond_equal(got2, ref2)
    passes = [r for r in reps if r["kind"] == "te_streaming"]
    assert len(passes) == 2
    d = passes[0]["data"]
    st = streamed.ditkit_streaming.streamers[0]
    n_tensors = len(list(st.layers[0].parameters())) + len(list(st.layers[0].buffers()))
    bound = (prefetch + 1) * (st.max_layer_bytes + n_tensors * 256)
    assert 0 < d["peak_device_bytes"] <= bound
    assert d["bytes_h2d"] == st.host_bytes and d["layers_streamed"] == cfg["num_hidden_layers"]
    assert d["host_embedding_bytes_read"] > 0 and d["live_device_bytes"] == 0
    # the embedding table is not part of what streams (host-resident), and it is the big tensor for H3
    emb = sinfo["embedding_bytes_on_host"]
    if kind == "h3":
        assert emb == 151936 * 48 * 2 and emb > st.host_bytes


def test_te_streaming_is_noop_on_cpu_and_says_so(comfy, ckpts, monkeypatch):
    import ditkit.nodes.text_encoders as te

    reps = _te_reports(monkeypatch)
    path = ckpts / "text_encoders" / "qwen3vl_tiny_minimax_h3.safetensors"
    clip, _, info = te.build_h3_clip(path, streaming=True, prefetch=1, force=False)
    assert info["streaming"] == "noop_cpu"
    assert any("no-op" in r["summary"] for r in reps)
    assert not any(k.endswith("embed_tokens") for k in clip.patcher.object_patches)


def test_te_lora_on_streamed_layer_refused(comfy, ckpts):
    import ditkit.nodes.text_encoders as te

    path = ckpts / "text_encoders" / "qwen3vl_tiny_minimax_h3.safetensors"
    clip, _, _ = te.build_h3_clip(path, streaming=True, prefetch=1, force=True)
    lora = clip.clone()
    key = "qwen3vl_32b.transformer.model.layers.3.mlp.up_proj.weight"
    w = lora.patcher.get_model_object(key)
    lora.add_patches({key: (torch.zeros_like(w),)}, 1.0)
    with pytest.raises(te.StreamingError, match="CLIP LoRA"):
        _encode(lora)
    # the un-patched clip still works after the refusal
    _encode(clip)


def test_te_bad_files(comfy, ckpts, monkeypatch):
    import ditkit.nodes.text_encoders as te
    from ditkit.errors import CheckpointError

    def no_read(*a, **k):
        raise AssertionError("weights were read before the family check")

    import ditkit.bridge.text_encoders as bte   # where the file is read (the host layer)

    monkeypatch.setattr(bte, "load_with_progress", no_read)
    with pytest.raises(CheckpointError, match="not a MiniMax H3.*Gemma"):
        te.build_h3_clip(ckpts / "text_encoders" / "gemma_tiny_ltx.safetensors")
    with pytest.raises(CheckpointError, match="not a MiniMax H3.*diffusion model"):
        te.build_h3_clip(ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors")
    with pytest.raises(CheckpointError, match="not a Gemma.*Qwen3-VL"):
        te.build_ltx_clip(ckpts / "text_encoders" / "qwen3vl_tiny_minimax_h3.safetensors")
    with pytest.raises(CheckpointError, match="was not found"):
        te._run("h3", te.H3_NODE, "no_such_file.safetensors", "off", 1, None)
    junk = ckpts / "text_encoders" / "junk.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(CheckpointError):
        te.build_h3_clip(junk)


# --------------------------------------------------------------------------------------------------------------
# real host (headless ComfyUI over /prompt)
# --------------------------------------------------------------------------------------------------------------
def test_real_host_adaln_cache_workflow(comfy_server):
    """The test graph (tests/data/workflows): cached samplers (3 steps cold, 3 steps hot, 5 steps rebuild) and an uncached
    5-step sampler on the same input latent; cached == uncached bit for bit; the per-run reports are right.
    Then a second prompt with other step counts (4, 4, 7)."""
    import json
    import re
    from pathlib import Path

    from ditkit.loaders.safetensors_io import load_file

    wf = Path(__file__).resolve().parents[2] / "tests" / "data" / "workflows" / "api" / "h3_adaln_cache_steps.json"
    n_proj = 2 + 1  # tiny H3: 2 blocks + final layer; cfg 1 -> one forward per step
    pattern = r"DitKitH3AdaLNCache #5 adaln_cache: run: (\d+) hits, (\d+) misses, (\d+) rebuilds \((\w+)\)"
    for steps_a, steps_b, tag in ((3, 5, "p1"), (4, 7, "p2")):
        graph = json.loads(wf.read_text())
        for nid in ("6", "7"):
            graph[nid]["inputs"]["steps"] = steps_a
        for nid in ("8", "9"):
            graph[nid]["inputs"]["steps"] = steps_b
        for nid in ("12", "13", "14", "15"):
            graph[nid]["inputs"]["filename_prefix"] += f"_{tag}"
        before = len(re.findall(pattern, comfy_server.log_text()))
        entry = comfy_server.run(graph)
        assert entry["status"]["status_str"] == "success"
        files = {p.name: p for p in comfy_server.output_files(entry)}

        def latent(prefix):
            (name,) = [n for n in files if n.startswith(prefix)]
            return load_file(files[name])["latent_tensor"]

        for part in ("video", "audio"):
            a, b = latent(f"h3_adaln_cached_{part}_{tag}"), latent(f"h3_adaln_plain_{part}_{tag}")
            assert a.shape == b.shape and torch.equal(a, b), (tag, part)
        runs = [tuple(r) for r in re.findall(pattern, comfy_server.log_text())][before:]
        assert runs == [(str(steps_a * n_proj), "0", "1", "cold"), (str(steps_a * n_proj), "0", "0", "hot"),
                        (str(steps_b * n_proj), "0", "1", "cold")], (tag, runs)
    # the text encoder streaming request is a reported no-op on the CPU host
    assert re.search(r"DitKitH3TextEncoderLoader #3 \w+: .*no-op", comfy_server.log_text())


def test_te_loader_nodes_execute_and_report(plain_te, ckpts, monkeypatch):
    import folder_paths

    import ditkit.nodes.text_encoders as te

    reps = _te_reports(monkeypatch)
    folder_paths.add_model_folder_path("text_encoders", str(ckpts / "text_encoders"))
    for node, fname, kind in ((te.DitKitH3TextEncoderLoader, "qwen3vl_tiny_minimax_h3.safetensors", "h3"),
                              (te.DitKitLTXTextEncoderLoader, "gemma_tiny_ltx.safetensors", "ltx")):
        schema = node.GET_SCHEMA()
        assert all(getattr(i, "tooltip", None) for i in schema.inputs)
        out = node.execute(fname, "layerwise", 1)
        clip = out.args[0] if hasattr(out, "args") else out.result[0]
        _cond_equal(_encode(clip), plain_te[kind][4])     # CPU host: streaming is a no-op, output unchanged
        last = [r for r in reps if r["kind"] == "te_loader"][-1]
        assert "no-op" in last["summary"] and last["data"]["streaming"] == "noop_cpu"
        assert last["data"]["config"]["num_hidden_layers"] == (50 if kind == "h3" else 48)


@pytest.mark.parametrize("keyframes,cond_aug", [(1, None), (2, 0.98)])
def test_adaln_cache_keyframe_variant_hits(comfy, ckpts, reports, keyframes, cond_aug):
    """fl2va-style keyframe rows add the cond timestep max(t_v, aug) to each forward's unique timesteps: the
    predicted tables must cover it (no misses) and stay bit-identical."""
    import comfy.sample
    import comfy.sd
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent

    model = comfy.sd.load_diffusion_model(str(ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    latent, _ = _empty_av_latent(64, 64, 22)
    lat = latent["samples"]
    g = torch.Generator().manual_seed(7)
    kfs = [{"latent": torch.randn(1, 24, 1, 4, 4, generator=g), "resolved_frame_index": 0 if i == 0 else 21}
           for i in range(keyframes)]
    extra = {"minimax_keyframes": kfs}
    if cond_aug is not None:
        extra["minimax_visual_cond_noise_aug"] = cond_aug
    ctx = torch.randn(1, 6, 48, generator=g)
    pos, neg = [[ctx, dict(extra)]], [[torch.randn(1, 4, 48, generator=g), dict(extra)]]
    noise = comfy.sample.prepare_noise(lat, 1)

    def run(m):
        return comfy.sample.sample(m, noise, 4, 2.0, "euler", "simple", pos, neg, lat, seed=1, disable_pbar=True)

    ref = run(model)
    m, cache = _cached(comfy, model)
    assert _equal(ref, run(m))
    run_stats = [r["data"]["run"] for r in reports if "run" in r["data"]][-1]
    assert run_stats["misses"] == 0 and run_stats["hits"] == 4 * 2 * 3
    # the forwards really carried a third (cond) timestep row: t_v, t_a and max(t_v, aug)
    assert max(v[0].shape[0] for v in cache.entries.values()) == 3  # M = 3 time-embedding rows per forward
