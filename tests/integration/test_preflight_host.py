"""DitKitPreflight in the real ComfyUI 0.33 host (in process, CPU, tiny H3): a job made to exceed ``limit_gib`` is
refused before sampling (MemoryShortfallError, within 2 s, the model not loaded by ComfyUI), naming the shortfall and
settings; following the suggestion (DitKitActivationChunking with the suggested chunk) passes the node and the
sampler-time check and samples. Bad inputs are named errors with nothing allocated."""
from __future__ import annotations

import re
import time

import pytest
import torch

from ditkit.tiny import ckpt_h3 as c

# a shape whose feed-forward phase dominates the block (fc1 2F + F > attention 8I on the CPU backend)
WIDE = {"ffn_hidden_size": 4096}
W = H_PX = 256
LENGTH, TEXT = 22, 10


@pytest.fixture(scope="module")
def model(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.loaders.safetensors_io import save_file
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("preflight")
    (root / "diffusion_models").mkdir()
    cfg = dict(c.CONFIG, **WIDE)
    save_file(c.base_state_dict(cfg), root / "diffusion_models" / "h3_wide_ffn.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(root / "diffusion_models"))
    yield DitKitH3ModelLoader.execute(model_name="h3_wide_ffn.safetensors").args[0]
    paths = folder_paths.folder_names_and_paths["diffusion_models"][0]
    if str(root / "diffusion_models") in paths:
        paths.remove(str(root / "diffusion_models"))
    folder_paths.filename_list_cache.pop("diffusion_models", None)


def latent(length=LENGTH):
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    return EmptyMiniMaxH3LatentAV.execute(W, H_PX, length).result[0]


def sample(m, lat):
    import nodes

    cond = [[torch.randn(1, TEXT, c.CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    return nodes.common_ksampler(m, 7, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]


def predicted(m, lat, limit=1000.0, text=TEXT):
    from ditkit.bridge.preflight import latent_shapes_of, run_plan

    v, a = latent_shapes_of(lat["samples"])
    return run_plan(m, v, a, text, limit)


def test_refuses_then_suggestion_runs(model):
    import comfy.model_management as mm

    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.activation_chunking import DitKitActivationChunking
    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    full = predicted(model, lat).prediction.device
    chunked = predicted(DitKitActivationChunking.execute(model, chunk_tokens=256).args[0], lat).prediction.device
    assert chunked < full
    limit = (full + chunked) / 2 / 2**30
    loaded_before = [id(x.model) for x in mm.current_loaded_models]
    t0 = time.perf_counter()
    with pytest.raises(MemoryShortfallError) as e:
        DitKitPreflight.execute(model, lat, limit_gib=limit, text_tokens=TEXT)
    took = time.perf_counter() - t0
    assert took <= 2.0, took
    assert [id(x.model) for x in mm.current_loaded_models] == loaded_before     # nothing loaded by the refusal
    msg = str(e.value)
    assert "SHORT by" in msg and "GiB" in msg and "Nothing was loaded" in msg
    m = re.search(r"chunk_tokens (\d+): predicted ([\d.]+) GiB", msg)
    assert m, msg
    tokens = int(m.group(1))
    # follow the suggestion
    fixed = DitKitActivationChunking.execute(model, chunk_tokens=tokens).args[0]
    out = DitKitPreflight.execute(fixed, lat, limit_gib=limit, text_tokens=TEXT)
    p = predicted(fixed, lat)
    assert p.prediction.device <= limit * 2**30
    assert abs(p.prediction.device / 2**30 - float(m.group(2))) < 0.01
    s = sample(out.args[0], out.args[1])
    assert torch.isfinite(s.tensors[0]).all() if hasattr(s, "tensors") else torch.isfinite(s).all()


def test_sampler_check_refuses_before_sampling(model):
    from ditkit.bridge.preflight import WRAPPER_KEY
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    m = DitKitPreflight.execute(model, lat, limit_gib=0.0, text_tokens=0).args[0]
    sample(m, lat)                                        # fits the free RAM: runs
    m.model_options["transformer_options"][WRAPPER_KEY]["limit_gib"] = 1e-6
    calls = []
    import comfy.patcher_extension as pe

    m2 = m.clone()
    m2.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_count", lambda ex, *a, **k: calls.append(1) or ex(*a, **k))
    with pytest.raises(MemoryShortfallError, match="sampler check|SHORT by"):
        sample(m2, lat)
    assert not calls                                      # no forward ran


def test_bad_inputs_named_errors(model, monkeypatch):
    import comfy.model_management as mm
    import comfy.nested_tensor

    from ditkit.errors import DitKitError
    from ditkit.nodes.preflight import DitKitPreflight

    huge = {"samples": comfy.nested_tensor.NestedTensor((torch.empty(1, 24, 10**6, 48, 84, device="meta"),
                                                         torch.empty(1, 32, 2, 10**6, device="meta")))}
    with pytest.raises(DitKitError, match="absurd"):
        DitKitPreflight.execute(model, huge, limit_gib=0.0, text_tokens=0)
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(DitKitError):
            DitKitPreflight.execute(model, latent(), limit_gib=bad, text_tokens=0)
    with pytest.raises(DitKitError, match="text_tokens"):
        DitKitPreflight.execute(model, latent(), limit_gib=0.0, text_tokens=-1)
    with pytest.raises(DitKitError, match="not an H3 audio-video latent"):
        DitKitPreflight.execute(model, {"samples": torch.zeros(1, 4, 8, 8)}, limit_gib=0.0, text_tokens=0)
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: 0)
    with pytest.raises(DitKitError, match="no usable memory"):
        DitKitPreflight.execute(model, latent(), limit_gib=0.0, text_tokens=0)


def test_auto_chunking_is_predicted_as_an_upper_bound(model):
    from ditkit.nodes.activation_chunking import DitKitActivationChunking

    lat = latent()
    auto = predicted(DitKitActivationChunking.execute(model, chunk_tokens=0).args[0], lat)
    plain = predicted(model, lat)
    assert auto.prediction.device == plain.prediction.device
    assert "upper bound" in auto.summary() and "upper bound" not in plain.summary()


def _refs_and_keyframes(hw=16, odd=False):
    """H3 ref2va blocks and fl2va keyframes as ComfyUI's MiniMaxH3ReferenceToVideo / MiniMaxH3ImageToVideo put them
    on the conditioning (random latents of the right shapes)."""
    z = lambda *s: torch.randn(*s, generator=torch.Generator().manual_seed(sum(s)))  # noqa: E731
    h, w = (7, 9) if odd else (8, 12)
    refs = [{"kind": "image", "latent_h": h, "latent_w": w, "latent": z(1, 24, 1, h, w)},
            {"kind": "video_audio", "latent_t": 2, "latent_h": 6, "latent_w": 10, "ref_audio_t": 5,
             "latent": z(1, 24, 2, 6, 10), "audio_latent": z(1, 32, 2, 5)},
            {"kind": "audio", "ref_audio_t": 7, "audio_latent": z(1, 32, 2, 7)}]
    kfs = [{"latent": z(1, 24, 1, hw, hw), "audio_latent": z(1, 32, 2, 3), "resolved_frame_index": 0}]
    return refs, kfs


@pytest.mark.parametrize("odd", [False, True])
def test_refs_and_keyframes_counted_as_the_host_packs_them(model, odd):
    """The preflight's packed token count with reference blocks and keyframes on the positive conditioning equals
    ComfyUI's own PackedLayout.seq_len (the host's packing is the oracle) and a hand count."""
    import node_helpers
    from comfy.ldm.minimax.model import PackedLayout

    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    refs, kfs = _refs_and_keyframes(odd=odd)
    text = torch.randn(1, 13, c.CONFIG["text_dim"])
    cond = node_helpers.conditioning_set_values([[text, {}]], {"minimax_refs": refs, "minimax_keyframes": kfs})
    out = DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=512, positive=cond)
    tok = out.ui["ditkit_report"][0]["data"]["tokens"]
    v, a = lat["samples"].tensors
    layout = PackedLayout(13, v.shape[2], v.shape[3], v.shape[4], a.shape[-1], keyframes=kfs, refs=refs)
    assert tok["total"] == layout.seq_len
    img = (3 * 4) if odd else (4 * 6)
    assert tok["refs"] == img + (2 * 3 * 5 + 2 * 5) + 2 * 7
    assert tok["keyframes"] == 1 * 8 * 8 + 2 * 3 and tok["text"] == 13
    plain = DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=13).ui["ditkit_report"][0]["data"]
    assert plain["tokens"]["total"] == tok["total"] - tok["refs"] - tok["keyframes"]
    assert out.ui["ditkit_report"][0]["data"]["predicted_bytes"] > plain["predicted_bytes"]


def test_sampler_check_counts_the_refs_the_forward_packs(model):
    """Sampling with reference blocks and keyframes: the sampler-time check's token count equals the sequence the
    forward really packed (ComfyUI's layout in the payload the model got), not the node's text_tokens guess."""
    import comfy.patcher_extension as pe
    import node_helpers

    from ditkit.bridge.preflight import WRAPPER_KEY
    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    refs, kfs = _refs_and_keyframes()
    text = torch.randn(1, TEXT, c.CONFIG["text_dim"], generator=torch.Generator().manual_seed(0))
    cond = node_helpers.conditioning_set_values([[text, {}]], {"minimax_refs": refs, "minimax_keyframes": kfs})
    m = DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=512).args[0]
    got, seen = [], []
    target, _ = m.model_options["transformer_options"][WRAPPER_KEY]["report"]
    m.model_options["transformer_options"][WRAPPER_KEY]["report"] = (target, lambda *a: got.append(a[4]))

    def spy(ex, *a, **k):
        seen.append(k["minimax_payload"]["layout"].seq_len)
        return ex(*a, **k)

    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_seq", spy)
    import nodes

    s = nodes.common_ksampler(m, 7, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
    assert torch.isfinite(s.tensors[0]).all()
    assert got and seen and set(seen) == {got[-1]["tokens"]["total"]}, (seen, got[-1]["tokens"])
    assert got[-1]["tokens"]["refs"] > 0 and got[-1]["tokens"]["keyframes"] > 0 and got[-1]["tokens"]["text"] == TEXT


def test_bad_conditioning_named_errors(model):
    from ditkit.errors import DitKitError
    from ditkit.nodes.preflight import DitKitPreflight

    text = torch.zeros(1, 4, c.CONFIG["text_dim"])
    for bad in ([[text, {"minimax_refs": [{"kind": "image", "latent_h": 0, "latent_w": 8}]}]],
                [[text, {"minimax_refs": [{"kind": "hologram"}]}]],
                [[text, {"minimax_refs": "image"}]],
                [[text, {"minimax_refs": [{"kind": "audio", "ref_audio_t": float("nan")}]}]],
                [[text, {"minimax_refs": [{"kind": "audio", "ref_audio_t": 10**9}]}]],
                [[text, {"minimax_keyframes": [{"latent": "not a tensor"}]}]],
                [[text, {"minimax_keyframes": [{"latent": torch.zeros(24, 1)}]}]],
                [[text, {"minimax_keyframes": [{"latent": torch.empty(1, 24, 10**6, 16, 16, device="meta")}]}]],
                ["not conditioning"]):
        with pytest.raises(DitKitError, match="input 'positive'"):
            DitKitPreflight.execute(model, latent(), limit_gib=1000.0, text_tokens=0, positive=bad)


@pytest.fixture(scope="module")
def vae(comfy, tiny_ckpts):
    import folder_paths

    from ditkit.nodes.h3_vae import DitKitH3VAELoader
    from ditkit.tiny import ckpt_h3_vae as ck

    from comfy_api.latest import io

    folder_paths.add_model_folder_path("vae", str(tiny_ckpts / "vae"))
    before = DitKitH3VAELoader.__dict__.get("hidden")
    DitKitH3VAELoader.hidden = io.HiddenHolder.from_dict({io.Hidden.unique_id: "vae"})
    try:
        out = DitKitH3VAELoader.execute(ck.VIDEO_VAE_NAME)
    finally:
        DitKitH3VAELoader.hidden = before
    return out.args[0] if hasattr(out, "args") else out.result[0]


def test_vae_decode_joins_the_plan(model, vae):
    """With the video VAE connected the job's peak is max(step, decode); the decode's parts are the VAE's weights,
    ComfyUI's own working-set estimate for the H3 video VAE (its formula written out here from comfy/sd.py:
    (9.5 x frames x H x W + fixed) x dtype size x 1.03, frames capped at one temporal chunk) and, on this CPU host,
    the decoded float frames; the DiT's weights stay in RAM beside it."""
    import comfy.model_management as mm

    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    v = lat["samples"].tensors[0]
    t, h, w = v.shape[2], v.shape[3], v.shape[4]
    frames = (t - 2) // 5 * 17 + 5                        # 17k+5 frames <-> 5k+2 latents
    fsm = vae.first_stage_model
    chunk = (fsm.tokens_chunk_size + fsm.token_overlap) * fsm.vae_ratio_t
    working = (9.5 * min(frames, chunk + 2) * h * 16 * w * 16 + (110_000_000 if frames <= 22 else 270_000_000)) \
        * mm.dtype_size(vae.vae_dtype) * 1.03
    weights = sum(p.numel() * p.element_size() for p in fsm.state_dict().values())
    out_bytes = 3 * frames * h * 16 * w * 16 * torch.empty((), dtype=vae.vae_output_dtype()).element_size()
    d = DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=TEXT, vae=vae).ui["ditkit_report"][0]
    data = d["data"]
    assert data["decode_parts"]["VAE weights"] == weights
    assert abs(data["decode_parts"]["VAE working set (ComfyUI's estimate)"] - int(working)) <= 1
    assert data["decode_parts"]["decoded frames"] == out_bytes
    dit = data["parts"]["weights_device"]
    assert data["decode_bytes"] == sum(data["decode_parts"].values()) + dit
    assert data["predicted_bytes"] == max(data["step_bytes"], data["decode_bytes"])
    assert "VAE decode" in d["summary"] and "sampling step" in d["summary"]
    plain = DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=TEXT).ui["ditkit_report"][0]["data"]
    assert plain["step_bytes"] == data["step_bytes"] and plain["decode_bytes"] == 0
    from ditkit.bridge.preflight import decode_parts, family_of

    assert {k: int(x) for k, x in decode_parts(vae, tuple(v.shape)).items()} == data["decode_parts"]
    assert family_of(model) == "h3"


def test_decode_that_alone_does_not_fit_is_refused_with_its_own_advice(model, vae):
    from ditkit.memory.model import MemoryModelError
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent()
    d = DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=TEXT, vae=vae).ui["ditkit_report"][0]["data"]
    assert d["decode_bytes"] > d["step_bytes"]             # ComfyUI's fixed 110 MB term dominates the tiny H3
    alone = sum(d["decode_parts"].values())
    with pytest.raises(MemoryShortfallError, match="VAE decode alone needs more") as e:
        DitKitPreflight.execute(model, lat, limit_gib=(alone - 1) / 2**30, text_tokens=TEXT, vae=vae)
    assert "Nothing was loaded" in str(e.value)
    # between the step and the decode: refused (the job's peak is the decode), the step alone would fit
    mid = (d["step_bytes"] + d["decode_bytes"]) / 2 / 2**30
    DitKitPreflight.execute(model, lat, limit_gib=mid, text_tokens=TEXT)
    with pytest.raises(MemoryShortfallError):
        DitKitPreflight.execute(model, lat, limit_gib=mid, text_tokens=TEXT, vae=vae)
    DitKitPreflight.execute(model, lat, limit_gib=d["decode_bytes"] / 2**30, text_tokens=TEXT, vae=vae)   # boundary
    with pytest.raises(MemoryModelError, match="input 'vae' is not a VAE"):
        DitKitPreflight.execute(model, lat, limit_gib=1000.0, text_tokens=TEXT, vae=object())
