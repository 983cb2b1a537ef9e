"""DitKitPreflight on Z-Image in the real ComfyUI 0.33 host (in process, CPU, the tiny Z-Image checkpoint loaded with
DitKitZImageLoader: the stock UNETLoader only knows Z-Image at dim 3840 and cannot load it). The token count is
the 2x2-patched image rows plus the caption rows, each padded to the model's pad_tokens_multiple (counted here from
the latent ComfyUI's EmptySD3LatentImage makes and the LotusConditioning caption); the dims and weights come from
the loaded model; a job made to exceed limit_gib is refused before sampling naming the setting that fits; following
it samples; the sampler-time check refuses before any forward; a Z-Image latent given with a FLUX.2 model is refused
by name (test_preflight_flux2_host.py plans FLUX.2)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from ditkit.tiny import ckpt_image


def latent(w=1024, h=1024, batch=1):
    from comfy_extras.nodes_sd3 import EmptySD3LatentImage

    return EmptySD3LatentImage.execute(w, h, batch).result[0]


def caption():
    from comfy_extras.nodes_lotus import LotusConditioning

    return LotusConditioning.execute().result[0]          # [1, 77, 1024]


def plan(m, lat, text=77, limit=1000.0):
    from ditkit.bridge.preflight import latent_shapes_of, run_plan

    v, _ = latent_shapes_of(lat["samples"], "zimage")
    return run_plan(m, v, None, text, limit)


def test_tokens_dims_and_weights_from_the_model(zimage):
    from ditkit.bridge.preflight import family_of, model_facts

    assert family_of(zimage) == "zimage"
    lat = latent()
    assert tuple(lat["samples"].shape) == (1, 16, 128, 128)
    dm = zimage.model.diffusion_model
    assert dm.pad_tokens_multiple == 32 and dm.patch_size == 2
    p = plan(zimage, lat, text=77)
    # 64 * 64 = 4096 image rows (a multiple of 32); 77 caption rows padded to 96
    assert p.tokens.as_dict() == {"image": 4096, "text": 96, "total": 4192}
    odd = plan(zimage, latent(200, 136), text=0)     # latent 17 x 25 -> 9 * 13 = 117 rows -> 128; no caption: 32 pad
    assert (odd.tokens.video, odd.tokens.text) == (math.ceil(9 * 13 / 32) * 32, 32)
    dims, weights, current, compute = model_facts(zimage)
    c = ckpt_image.ZIMAGE
    ffn = ckpt_image._zimage_ffn_hidden(c["dim"], c["ffn_multiple_of"])
    b = {"float32": 4}.get(compute, 2)
    assert (dims.family, dims.hidden, dims.heads, dims.head_dim, dims.ffn, dims.layers, dims.ffn_kind,
            dims.extra_cols) == ("zimage", c["dim"], c["dim"] // 128, 128, ffn, c["n_layers"], "swiglu", 8 * 128 // b)
    sd = dm.state_dict()
    total = sum(v.numel() * v.element_size() for v in sd.values())
    assert weights[current].total == total and len(weights[current].blocks) == c["n_layers"]
    assert weights["float8_e4m3fn"].total < total
    two = plan(zimage, latent(batch=2))
    assert two.tokens.total == p.tokens.total and two.options.batch == 2
    assert two.prediction.parts["feed_forward"] == 2 * p.prediction.parts["feed_forward"]


def test_positive_caption_is_counted(zimage):
    from ditkit.nodes.preflight import DitKitPreflight

    cond = [[torch.zeros(1, 300, 1024), {}]]
    out = DitKitPreflight.execute(zimage, latent(512, 512), limit_gib=1000.0, text_tokens=5, positive=cond)
    tok = out.ui["ditkit_report"][0]["data"]["tokens"]
    assert (tok["image"], tok["text"]) == (1024, 320) and "video" not in tok
    out = DitKitPreflight.execute(zimage, latent(512, 512), limit_gib=1000.0, text_tokens=5)
    assert out.ui["ditkit_report"][0]["data"]["tokens"]["text"] == 32


@pytest.fixture
def sdpa(monkeypatch):
    from comfy.ldm.modules import attention as a

    monkeypatch.setattr(a, "optimized_attention", a.attention_pytorch)
    monkeypatch.setattr(a, "optimized_attention_masked", a.attention_pytorch)


def test_refuses_then_suggestion_runs(zimage, sdpa):
    import comfy.model_management as mm
    import nodes

    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.activation_chunking import DitKitActivationChunking
    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    full = plan(zimage, lat).prediction.device
    chunked = plan(DitKitActivationChunking.execute(zimage, chunk_tokens=256).args[0], lat).prediction.device
    assert chunked < full
    limit = (full + chunked) / 2 / 2**30
    loaded_before = [id(x.model) for x in mm.current_loaded_models]
    with pytest.raises(MemoryShortfallError) as e:
        DitKitPreflight.execute(zimage, lat, limit_gib=limit, text_tokens=77)
    assert [id(x.model) for x in mm.current_loaded_models] == loaded_before
    msg = str(e.value)
    assert "SHORT by" in msg and "4,192 tokens (image 4,096, text 96)" in msg and "video" not in msg.split(";")[0], msg
    m = re.search(r"chunk_tokens (\d+): predicted ([\d.]+) GiB", msg)
    assert m, msg
    fixed = DitKitActivationChunking.execute(zimage, chunk_tokens=int(m.group(1))).args[0]
    out = DitKitPreflight.execute(fixed, lat, limit_gib=limit, text_tokens=77)
    assert abs(plan(fixed, lat, limit=limit).prediction.device / 2**30 - float(m.group(2))) < 0.01
    assert out.ui["ditkit_report"][0]["data"]["fits"] is True
    small = latent(64, 64)
    out = DitKitPreflight.execute(fixed, small, limit_gib=limit, text_tokens=77)
    cond = caption()
    res = nodes.common_ksampler(out.args[0], 3, 1, 1.0, "euler", "simple", cond, cond, out.args[1])[0]["samples"]
    assert torch.isfinite(res).all()


def test_sampler_check_refuses_before_any_forward(zimage):
    import comfy.patcher_extension as pe
    import nodes

    from ditkit.bridge.preflight import WRAPPER_KEY
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.preflight import DitKitPreflight

    small = latent(64, 64)
    m = DitKitPreflight.execute(zimage, small, limit_gib=0.0, text_tokens=77).args[0]
    m.model_options["transformer_options"][WRAPPER_KEY]["limit_gib"] = 1e-6
    calls = []
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_count", lambda ex, *a, **k: calls.append(1) or ex(*a, **k))
    cond = caption()
    with pytest.raises(MemoryShortfallError, match="sampler check|SHORT by"):
        nodes.common_ksampler(m, 3, 1, 1.0, "euler", "simple", cond, cond, small)
    assert not calls


def test_bad_inputs_named_before_any_allocation(zimage, comfy, tiny_ckpts):
    import nodes

    from ditkit.errors import DitKitError
    from ditkit.memory.model import MemoryModelError
    from ditkit.nodes.dit_loaders import DitKitFlux2ModelLoader
    from ditkit.nodes.preflight import DitKitPreflight

    with pytest.raises(MemoryModelError, match="not a Z-Image latent"):
        DitKitPreflight.execute(zimage, {"samples": torch.zeros(1, 16, 2, 8, 8)}, limit_gib=1.0)
    with pytest.raises(MemoryModelError, match="absurd"):
        plan(zimage, {"samples": torch.zeros(1, 16, 1, 1).expand(1, 16, 10**6, 10**6)})
    for bad in (float("nan"), float("inf"), -1.0):
        # NaN / Inf: refused by the pack's FLOAT guard when the node is registered (DitKitError), else by the node
        with pytest.raises(DitKitError, match="'?limit_gib'?"):
            DitKitPreflight.execute(zimage, latent(64, 64), limit_gib=bad)
    # omni references are counted (test_preflight_zimage_omni_host.py); one the model cannot take is named
    ref = [[torch.zeros(1, 77, 1024), {"reference_latents": [torch.zeros(1, 16, 9, 8)]}]]
    with pytest.raises(MemoryModelError, match="reference latent 0 is 9 x 8"):
        DitKitPreflight.execute(zimage, latent(64, 64), limit_gib=1.0, positive=ref)
    ref = [[torch.zeros(1, 77, 1024), {"reference_latents": torch.zeros(1, 16, 8, 8)}]]
    with pytest.raises(MemoryModelError, match="input 'positive'.*reference_latents is not a list"):
        DitKitPreflight.execute(zimage, latent(64, 64), limit_gib=1.0, positive=ref)
    flux = DitKitFlux2ModelLoader.execute(unet_name="flux2_tiny.safetensors").args[0]
    with pytest.raises(MemoryModelError, match="FLUX.2 latent has 16 channels"):   # a Z-Image latent
        DitKitPreflight.execute(flux, latent(64, 64), limit_gib=1.0)
    # the stock loader cannot load the tiny Z-Image (it knows Z-Image at dim 3840 only): why the fixture uses ours
    with pytest.raises(AssertionError):      # ComfyUI 0.33: a bare assert in its Z-Image model config
        nodes.UNETLoader().load_unet("zimage_tiny.safetensors", "default")
    stock = nodes.UNETLoader().load_unet("flux2_tiny.safetensors", "default")[0]   # the tiny FLUX.2 does load
    with pytest.raises(MemoryModelError, match="FLUX.2 latent has 16 channels"):
        DitKitPreflight.execute(stock, latent(64, 64), limit_gib=1.0)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_predicted_vs_measured_peak_on_cpu(comfyui_path):
    """One Z-Image sampling step (dim 512, 4 heads, 768x768: 2,304 + 96 rows) in a fresh subprocess, measured as
    ``benchmarks/bench_memory.py`` measures it (RSS growth from before the load to the step's peak): the preflight's
    prediction within +-15 %."""
    from benchmarks import bench_memory

    spec = {"name": "zimage-d512-768x768", "width": 768, "height": 768, "chunk": None, "dim": 512,
            "comfyui": str(comfyui_path), "threads": 1}
    res = bench_memory.run_child(spec, kind="--zimage-child")
    assert res["tokens"] == 48 * 48 + 96
    err = res["predicted"] / res["total_growth"] - 1
    print(f"zimage-d512-768x768: measured {res['total_growth'] / 2**20:.1f} MiB, predicted "
          f"{res['predicted'] / 2**20:.1f} MiB, {err:+.1%}")
    assert abs(err) <= 0.15, res


def test_image_vae_decode_joins_the_plan(zimage, tiny_ckpts):
    """An image VAE (the tiny 16-channel Flux VAE Z-Image uses, stock loader) on a 4-D latent: its weights,
    ComfyUI's own working-set estimate for that shape and, on a CPU host, the decoded image (B x 3 x 8H x 8W in the
    VAE's output dtype) join the plan."""
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    from ditkit.bridge.preflight import decode_parts
    from ditkit.nodes.preflight import DitKitPreflight

    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(tiny_ckpts / "vae" / "zimage_vae_tiny.safetensors")))
    lat = latent(512, 384)
    shape = tuple(lat["samples"].shape)                      # [1, 16, 48, 64]
    parts = decode_parts(vae, shape)
    item = torch.empty((), dtype=vae.vae_output_dtype()).element_size()
    assert parts["decoded frames"] == 1 * 3 * 384 * 512 * item
    assert parts["VAE weights"] == mm.module_size(vae.first_stage_model)
    assert parts["VAE working set (ComfyUI's estimate)"] == vae.memory_used_decode(shape, vae.vae_dtype)
    out = DitKitPreflight.execute(zimage, lat, limit_gib=1000.0, text_tokens=77, vae=vae)
    data = out.ui["ditkit_report"][0]["data"]
    assert data["decode_parts"] == {k: int(v) for k, v in parts.items()} and data["decode_bytes"] > 0
