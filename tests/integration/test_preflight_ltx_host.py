"""DitKitPreflight on LTX-2 in the real ComfyUI 0.33 host (in process, CPU, the tiny LTX-2 checkpoint): the token
count is the latent's T x H x W (patch 1; counted here from the latent ComfyUI's own EmptyLTXVLatentVideo makes),
plus one row per audio latent frame for an audio-video latent; the model's dimensions and weights come from the
loaded model; a job made to exceed ``limit_gib`` is refused before sampling with the settings that fit, following
the suggestion passes the node and the sampler-time check and samples. A video latent given with a FLUX.2 model
is refused by name."""
from __future__ import annotations

import re

import pytest
import torch

from ditkit.tiny import ckpt_ltx


@pytest.fixture(scope="module")
def ltx(comfy, tiny_ckpts):
    import folder_paths

    from ditkit.nodes.dit_loaders import DitKitLTX2ModelLoader

    torch.set_num_threads(1)
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    return DitKitLTX2ModelLoader.execute(unet_name="ltx2_tiny.safetensors").args[0]


def video_latent(w=512, h=512, length=97, batch=1):
    from comfy_extras.nodes_lt import EmptyLTXVLatentVideo

    out = EmptyLTXVLatentVideo.execute(w, h, length, batch)
    return out.result[0] if hasattr(out, "result") else out[0]


def plan(m, lat, limit=1000.0):
    from ditkit.bridge.preflight import latent_shapes_of, run_plan

    v, a = latent_shapes_of(lat["samples"], "ltx2")
    return run_plan(m, v, a, 0, limit)


def test_tokens_dims_and_weights_from_the_model(ltx):
    from ditkit.bridge.preflight import family_of, model_facts

    assert family_of(ltx) == "ltx2"

    lat = video_latent()
    t = lat["samples"].shape            # [1, 128, (97 - 1) / 8 + 1 = 13, 512 / 32 = 16, 16]
    assert tuple(t) == (1, 128, 13, 16, 16)
    p = plan(ltx, lat)
    assert p.tokens.as_dict() == {"video": 13 * 16 * 16, "audio": 0, "text": 0, "refs": 0, "keyframes": 0,
                                  "total": 13 * 16 * 16}
    dims, weights, current, compute = model_facts(ltx)
    c = ckpt_ltx.CONFIG
    inner = c["num_attention_heads"] * c["attention_head_dim"]
    assert (dims.family, dims.hidden, dims.heads, dims.head_dim, dims.ffn, dims.layers, dims.ffn_kind,
            dims.extra_cols) == ("ltx2", inner, c["num_attention_heads"], c["attention_head_dim"], 4 * inner,
                                 c["num_layers"], "gelu", c["audio_cross_attention_dim"])
    sd = ltx.model.diffusion_model.state_dict()
    total = sum(v.numel() * v.element_size() for v in sd.values())
    assert weights[current].total == total and len(weights[current].blocks) == c["num_layers"]
    assert set(weights) == {current, "float8_e4m3fn", "nvfp4"}
    assert weights["float8_e4m3fn"].total < total
    two = plan(ltx, video_latent(batch=2))
    assert two.tokens.total == p.tokens.total and two.options.batch == 2
    assert two.prediction.parts["feed_forward"] == 2 * p.prediction.parts["feed_forward"]


def test_audio_video_latent_counts_audio_rows(ltx):
    import comfy.nested_tensor

    v = torch.zeros(1, 128, 4, 6, 5)
    a = torch.zeros(1, 8, 21, 16)
    p = plan(ltx, {"samples": comfy.nested_tensor.NestedTensor((v, a))})
    assert (p.tokens.video, p.tokens.audio, p.tokens.total) == (4 * 6 * 5, 21, 4 * 6 * 5 + 21)


@pytest.fixture
def sdpa(monkeypatch):
    """ComfyUI's own SDPA attention selected in process (what --use-pytorch-cross-attention selects; no score
    matrix, as flash / sage on a GPU): LTX-2 calls comfy.ldm.modules.attention.optimized_attention at run time and
    the preflight reads the same attribute."""
    from comfy.ldm.modules import attention as a

    monkeypatch.setattr(a, "optimized_attention", a.attention_pytorch)


def test_refuses_then_suggestion_runs(ltx, sdpa):
    """With a backend that holds no scores the feed-forward (GELU, 2D + 2F per token) is LTX-2's peak: a job made to
    exceed limit_gib is refused before anything loads, naming the chunk size that fits; following it passes the node
    and samples. Head groups are never suggested for LTX-2 (they split H3's packed self-attention only)."""
    import comfy.model_management as mm
    import nodes

    from ditkit.bridge.preflight import attention_class
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.activation_chunking import DitKitActivationChunking
    from ditkit.nodes.preflight import DitKitPreflight

    assert attention_class() == "flash"
    lat = video_latent()
    full = plan(ltx, lat).prediction.device
    chunked = plan(DitKitActivationChunking.execute(ltx, chunk_tokens=256).args[0], lat).prediction.device
    assert chunked < full
    limit = (full + chunked) / 2 / 2**30
    loaded_before = [id(x.model) for x in mm.current_loaded_models]
    with pytest.raises(MemoryShortfallError) as e:
        DitKitPreflight.execute(ltx, lat, limit_gib=limit, text_tokens=0)
    assert [id(x.model) for x in mm.current_loaded_models] == loaded_before
    msg = str(e.value)
    assert "SHORT by" in msg and "3,328 tokens (video 3,328" in msg and "attention_heads_per_call" not in msg, msg
    m = re.search(r"chunk_tokens (\d+): predicted ([\d.]+) GiB", msg)
    assert m, msg
    fixed = DitKitActivationChunking.execute(ltx, chunk_tokens=int(m.group(1))).args[0]
    out = DitKitPreflight.execute(fixed, lat, limit_gib=limit, text_tokens=0)
    assert abs(plan(fixed, lat, limit).prediction.device / 2**30 - float(m.group(2))) < 0.01
    assert out.ui["ditkit_report"][0]["data"]["fits"] is True
    cond = [[torch.randn(1, 8, ckpt_ltx.CONFIG["caption_channels"], generator=torch.Generator().manual_seed(0)), {}]]
    small = video_latent(64, 64, 17)
    out = DitKitPreflight.execute(fixed, small, limit_gib=limit, text_tokens=0)
    res = nodes.common_ksampler(out.args[0], 3, 1, 1.0, "euler", "simple", cond, cond, out.args[1])[0]["samples"]
    assert torch.isfinite(res).all()


def test_head_groups_are_not_counted_or_suggested_for_ltx(ltx):
    """On the CPU default (sub_quad) the score workspace is the tiny LTX-2's peak, but LTX-2's attention calls pass
    through the head-group override (measured: bench_memory ltx2-h1024-512x512x97-heads1, peak unchanged), so the
    preflight neither counts an installed head group nor suggests one."""
    from ditkit.bridge.preflight import attention_class
    from ditkit.nodes.activation_chunking import DitKitActivationChunking

    assert attention_class() == "sub_quad"
    lat = video_latent()
    one = DitKitActivationChunking.execute(ltx, chunk_tokens=0, attention_heads_per_call=1).args[0]
    assert plan(one, lat).prediction.device == plan(ltx, lat).prediction.device
    assert plan(one, lat).options.head_group is None
    p = plan(ltx, lat, 0.02)
    assert not p.fits and not any("attention_heads_per_call" in s.settings for s in p.suggestions), p.summary()


def test_sampler_check_refuses_ltx_before_any_forward(ltx):
    import comfy.patcher_extension as pe
    import nodes

    from ditkit.bridge.preflight import WRAPPER_KEY
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.preflight import DitKitPreflight

    small = video_latent(64, 64, 17)
    m = DitKitPreflight.execute(ltx, small, limit_gib=0.0, text_tokens=0).args[0]
    m.model_options["transformer_options"][WRAPPER_KEY]["limit_gib"] = 1e-6
    calls = []
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_count", lambda ex, *a, **k: calls.append(1) or ex(*a, **k))
    cond = [[torch.randn(1, 8, ckpt_ltx.CONFIG["caption_channels"]), {}]]
    with pytest.raises(MemoryShortfallError, match="sampler check|SHORT by"):
        nodes.common_ksampler(m, 3, 1, 1.0, "euler", "simple", cond, cond, small)
    assert not calls


def test_ltx_bad_latents_and_other_families(ltx, comfy, tiny_ckpts):
    import folder_paths

    from ditkit.errors import DitKitError
    from ditkit.memory.model import MemoryModelError
    from ditkit.nodes.dit_loaders import DitKitFlux2ModelLoader
    from ditkit.nodes.preflight import DitKitPreflight

    meta = {"samples": torch.empty(1, 128, 10**6, 68, 120, device="meta")}
    with pytest.raises(DitKitError, match="absurd"):
        DitKitPreflight.execute(ltx, meta, limit_gib=0.0, text_tokens=0)
    for bad in ({"samples": torch.zeros(1, 128, 4, 4)}, {"samples": torch.zeros(1, 128, 0, 4, 4)}):
        with pytest.raises(DitKitError, match="LTX-2 latent|empty"):
            DitKitPreflight.execute(ltx, bad, limit_gib=0.0, text_tokens=0)
    with pytest.raises(DitKitError):
        DitKitPreflight.execute(ltx, video_latent(64, 64, 17), limit_gib=float("nan"), text_tokens=0)
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    flux = DitKitFlux2ModelLoader.execute(unet_name="flux2_tiny.safetensors").args[0]
    with pytest.raises(MemoryModelError, match="not a FLUX.2 latent"):   # FLUX.2 is planned; a video latent is not
        DitKitPreflight.execute(flux, video_latent(64, 64, 17), limit_gib=0.0, text_tokens=0)
