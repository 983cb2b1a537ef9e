"""Cache consistency: ditkit's caches (H3 AdaLN schedule tables, TeaCache runtime state, LoKr patched weights) are
keyed by everything they depend on. Eviction mid-run, or changing one key component at a time (schedule, weight
patch values, patch strength, cond/uncond, step count, seed), always gives exactly what the uncached path computes
from the request's own data: never an error, never stale reuse. In-process on the tiny checkpoints (needs ComfyUI).

(Complements tests/integration/test_offload_host.py, which covers step-count changes, misses and a LoRA added after
the AdaLN node.)"""
from __future__ import annotations

import pytest
import torch


def _sample(model, steps, cfg=1.0, ctx_seed=0, noise_seed=1, callback=None, neg_seed=None):
    import comfy.sample
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent

    latent, _ = _empty_av_latent(64, 64, 22)
    g = torch.Generator().manual_seed(ctx_seed)
    pos = [[torch.randn(1, 6, 48, generator=g), {}]]
    gn = torch.Generator().manual_seed(ctx_seed + 1000 if neg_seed is None else neg_seed)
    neg = [[torch.randn(1, 5, 48, generator=gn), {}]]
    lat = latent["samples"]
    noise = comfy.sample.prepare_noise(lat, noise_seed)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg, lat, seed=noise_seed,
                               disable_pbar=True, callback=callback)


def _equal(a, b) -> bool:
    ta, tb = (a.unbind() if hasattr(a, "unbind") else [a]), (b.unbind() if hasattr(b, "unbind") else [b])
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.fixture(scope="module")
def h3(comfy, tiny_ckpts):
    import comfy.sd

    torch.set_num_threads(1)
    return comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))


def _adaln(model):
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache

    out = DitKitH3AdaLNCache.execute(model, True)
    m = out.args[0] if hasattr(out, "args") else out.result[0]
    cache = next(v for v in m.object_patches.values() if hasattr(v, "_cache"))._cache
    return m, cache


# ---------------------------------------------------------------------------------------------- AdaLN tables
def test_adaln_eviction_mid_run_recomputes_exactly(h3):
    ref = _sample(h3, 5, cfg=2.0)
    m, cache = _adaln(h3)
    evicted = []

    def evict(step, *a, **k):
        if step in (1, 3):
            cache.invalidate()
            evicted.append(step)

    got = _sample(m, 5, cfg=2.0, callback=evict)
    assert evicted == [1, 3]
    assert _equal(ref, got)
    assert cache.stats.misses > 0  # the evicted steps were recomputed from the weights, not served stale
    assert _equal(ref, _sample(m, 5, cfg=2.0))  # and the next run rebuilds cleanly


def test_adaln_eviction_of_entries_dict_mid_run(h3):
    """Entries dropped one by one (memory pressure-style) while sampling: same result."""
    ref = _sample(h3, 4)
    m, cache = _adaln(h3)

    def drop(step, *a, **k):
        for key in list(cache.entries)[:2]:
            cache.entries.pop(key, None)

    assert _equal(ref, _sample(m, 4, callback=drop))


@pytest.mark.parametrize("change", ["strength", "patch_values", "both_then_back"])
def test_adaln_patch_strength_and_values_are_keys(h3, change):
    key = "diffusion_model.blocks.0.adaln_proj.linear.weight"
    w = h3.get_model_object(key)
    d1 = (torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * 0.05).to(w.dtype)
    d2 = (torch.randn(w.shape, generator=torch.Generator().manual_seed(8)) * 0.05).to(w.dtype)
    m, cache = _adaln(h3)

    def patched(base, delta, strength):
        c = base.clone()
        c.add_patches({key: (delta,)}, strength)
        return c

    first = patched(m, d1, 1.0)
    assert _equal(_sample(patched(h3, d1, 1.0), 3), _sample(first, 3))
    if change == "strength":
        second, ref = patched(m, d1, 0.5), patched(h3, d1, 0.5)
    elif change == "patch_values":
        second, ref = patched(m, d2, 1.0), patched(h3, d2, 1.0)
    else:
        second, ref = m, h3
    assert _equal(_sample(ref, 3), _sample(second, 3)), f"stale AdaLN tables after a {change} change"


def test_adaln_cond_uncond_and_seed_changes(h3):
    m, _ = _adaln(h3)
    for kw in ({"cfg": 2.0}, {"cfg": 2.0, "neg_seed": 99}, {"cfg": 1.0, "noise_seed": 5}, {"cfg": 3.0, "ctx_seed": 4}):
        assert _equal(_sample(h3, 3, **kw), _sample(m, 3, **kw)), kw


# ---------------------------------------------------------------------------------------------- TeaCache state
@pytest.fixture(scope="module")
def coef_file(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.cache import coefficients as coef

    cf = coef.CoefficientFile("h3", {"video": coef.StreamCoefficients("video", (1.0, 0.0)),
                                     "audio": coef.StreamCoefficients("audio", (1.0, 0.0))},
                              {"family": "h3"}, {"source": "cache consistency test", "kind": "calibrated"})
    out = tmp_path_factory.mktemp("tc_out")  # DitKitTeaCache reads <output>/ditkit/teacache only
    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(out))
    yield coef.save(cf, out / "ditkit" / "teacache" / "h3_test.json")
    folder_paths.set_output_directory(old)


def _teacache(model, path, threshold=0.5):
    from ditkit.nodes.teacache import DitKitTeaCache

    out = DitKitTeaCache.execute(model, str(path), threshold, threshold, 0.0, 1.0, "model", False)
    return out.args[0] if hasattr(out, "args") else out.result[0]


@pytest.mark.parametrize("second", [{"steps": 6, "noise_seed": 2}, {"steps": 8, "noise_seed": 1},
                                    {"steps": 6, "ctx_seed": 3}, {"steps": 6, "cfg": 2.0},
                                    {"steps": 6, "cfg": 2.0, "neg_seed": 77}])
def test_teacache_state_never_leaks_between_samplings(h3, coef_file, second):
    """A TeaCache model that already sampled once gives, for a changed request, exactly what a fresh TeaCache
    model gives for that request (residuals/accumulators of the first run are never reused)."""
    used = _teacache(h3, coef_file)
    _sample(used, 6, noise_seed=1)
    steps = second.pop("steps")
    got = _sample(used, steps, **second)
    fresh = _sample(_teacache(h3, coef_file), steps, **second)
    assert _equal(fresh, got), f"TeaCache state leaked into a sampling with {second}, {steps} steps"
    assert not _equal(fresh, _sample(h3, steps, **second)), "TeaCache skipped nothing: this test would prove nothing"


def test_teacache_patch_strength_change_is_not_served_from_cache(h3, coef_file):
    key = "diffusion_model.blocks.1.attn.proj_out.weight"
    if key not in h3.model.state_dict():
        key = next(k for k in h3.model.state_dict() if k.startswith("diffusion_model.blocks.1.") and k.endswith(".weight")
                   and h3.model.state_dict()[k].ndim == 2)
    w = h3.get_model_object(key)
    d = (torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * 0.05).to(w.dtype)
    tc = _teacache(h3, coef_file)
    outs = []
    for s in (1.0, 0.5):
        p = tc.clone()
        p.add_patches({key: (d,)}, s)
        outs.append(_sample(p, 6))
        q = _teacache(h3, coef_file).clone()
        q.add_patches({key: (d,)}, s)
        assert _equal(_sample(q, 6), outs[-1]), f"strength {s}"
    assert not _equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------- LoKr weights
def test_lokr_strength_change_rebuilds_weights_from_the_request(comfy, tiny_ckpts, tmp_path):
    """Two LoKr clones of one base (strength 1 then 0.5) patched one after the other: each weight equals the float64
    oracle base + strength * kron(w1, w2) for its own strength (no fused weight reused across clones)."""
    import comfy.sd

    from ditkit.loaders.safetensors_io import save_file
    from ditkit.nodes.lokr import apply_lokr

    base = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"))
    key = "diffusion_model.double_blocks.0.img_attn.proj.weight"
    w1 = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    w2 = torch.randn(16, 16, generator=torch.Generator().manual_seed(2)) * 0.1
    p = tmp_path / "l.safetensors"
    save_file({"diffusion_model.double_blocks.0.img_attn.proj.lokr_w1": w1,
               "diffusion_model.double_blocks.0.img_attn.proj.lokr_w2": w2}, p)
    orig = base.get_model_object(key).detach().clone()
    for s in (1.0, 0.5, 1.0, -2.0):
        m, _ = apply_lokr(base, str(p), s)
        got = m.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
        want = (orig.double() + s * torch.kron(w1.double(), w2.double())).to(orig.dtype)
        assert torch.equal(got, want) or (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max(), s
        assert torch.equal(base.get_model_object(key), orig)  # the shared base weight is untouched
