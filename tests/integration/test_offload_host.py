"""Offload features inside a real ComfyUI (in-process, CPU): H3 AdaLN schedule cache, text-encoder streaming.

Oracles: the same ComfyUI model sampled without ditkit (bit equality), ComfyUI's own text encoder without
streaming (bit equality), and counts derived from the schedule (steps x projections)."""
from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(scope="module")
def ckpts(comfy, tmp_path_factory):
    from ditkit.testing.checkpoints import generate_all

    out = tmp_path_factory.mktemp("offload_ckpts")
    generate_all(out, only=["h3_dit", "h3_dit_curve", "h3_te", "ltx_te"])
    return out


@pytest.fixture
def reports(monkeypatch):
    import ditkit.nodes.adaln_cache as ac

    got = []
    real = ac.send_report

    def capture(node_id, node_type, kind, summary, data=None):
        got.append({"summary": summary, "data": data or {}})
        return real(node_id, node_type, kind, summary, data)

    monkeypatch.setattr(ac, "send_report", capture)
    return got


def _sample(comfy, model, steps, cfg=1.0, sampler="euler", sigmas=None, ctx_seed=0):
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
    return comfy.sample.sample(model, noise, steps, cfg, sampler, "simple", pos, neg, lat, seed=1, disable_pbar=True)


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
