"""DitKitPreflight on FLUX.2 in the real ComfyUI 0.33 host (in process, CPU, the tiny FLUX.2 checkpoint loaded with
DitKitFlux2ModelLoader). The token count is the image rows of the [B, 128, H/16, W/16] latent (patch 1), the
reference latents' rows and the caption left-padded to 512 rows (``model_base.Flux2.extra_conds``), counted here
from the latent ComfyUI's EmptyFlux2LatentImage makes and checked against the joint sequence the single blocks
actually receive; the dims and weights come from the loaded model; predicted vs measured peak RSS of one step in a
fresh subprocess; a job made to exceed limit_gib is refused before anything loads naming the setting that fits
(on a CPU host: a lower-precision weight format; chunking does not lower FLUX.2's peak and is not offered);
following it passes and samples; the sampler-time check refuses before any forward; bad inputs are named."""
from __future__ import annotations

import re

import pytest
import torch

from ditkit.tiny import ckpt_image


def load(weight_format="as stored"):
    from ditkit.nodes.dit_loaders import DitKitFlux2ModelLoader

    kw = {} if weight_format == "as stored" else {"weight_format": weight_format}
    return DitKitFlux2ModelLoader.execute(unet_name="flux2_tiny.safetensors", **kw).args[0]


@pytest.fixture(scope="module")
def flux2(comfy, tiny_ckpts):
    import folder_paths

    torch.set_num_threads(1)
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    return load()


def latent(w=1024, h=1024, batch=1):
    from comfy_extras.nodes_flux import EmptyFlux2LatentImage

    return EmptyFlux2LatentImage.execute(w, h, batch).result[0]


def caption(rows=77):
    return [[torch.randn(1, rows, ckpt_image.FLUX2["context_dim"], generator=torch.Generator().manual_seed(0)), {}]]


def plan(m, lat, text=77, limit=1000.0, refs=()):
    from ditkit.bridge.preflight import latent_shapes_of, run_plan

    v, _ = latent_shapes_of(lat["samples"], "flux2")
    return run_plan(m, v, None, text, limit, refs)


def test_tokens_dims_and_weights_from_the_model(flux2):
    from ditkit.bridge.preflight import family_of, model_facts

    assert family_of(flux2) == "flux2"
    lat = latent()
    assert tuple(lat["samples"].shape) == (1, 128, 64, 64)
    dm = flux2.model.diffusion_model
    assert dm.patch_size == 1
    p = plan(flux2, lat, text=77)
    # 64 * 64 = 4096 image rows (patch 1); 77 caption rows left-padded to 512
    assert p.tokens.as_dict() == {"image": 4096, "text": 512, "total": 4608}
    assert plan(flux2, latent(200, 136), text=600).tokens.as_dict() == {"image": 8 * 12, "text": 600,
                                                                         "total": 96 + 600}
    dims, weights, current, compute = model_facts(flux2)
    c = ckpt_image.FLUX2
    b = {"float32": 4}.get(compute, 2)
    assert (dims.family, dims.hidden, dims.heads, dims.head_dim, dims.ffn, dims.layers, dims.single_layers,
            dims.extra_cols, dims.latent_row_bytes) == (
        "flux2", c["hidden"], c["hidden"] // 128, 128, c["mlp_ratio"] * c["hidden"], c["depth"], c["depth_single"],
        8 * 128 // b, 12 * 128 * 4)
    sd = dm.state_dict()
    total = sum(v.numel() * v.element_size() for v in sd.values())
    w = weights[current]
    assert w.total == total and len(w.blocks) == c["depth"] + c["depth_single"]
    assert w.blocks[0] == sum(v.numel() * v.element_size() for k, v in sd.items() if k.startswith("double_blocks.0."))
    assert w.blocks[-1] == sum(v.numel() * v.element_size() for k, v in sd.items()
                               if k.startswith(f"single_blocks.{c['depth_single'] - 1}."))
    assert weights["float8_e4m3fn"].total < total
    assert len(weights["float8_e4m3fn"].blocks) == len(w.blocks)
    two = plan(flux2, latent(batch=2))
    assert two.tokens.total == p.tokens.total and two.options.batch == 2
    assert two.prediction.parts["block_peak"] == 2 * p.prediction.parts["block_peak"]


def _seen_rows(m, lat, cond):
    """Rows the forward actually receives: the joint sequence handed to the first single block, and the text rows
    the model conditions on (``c_crossattn``)."""
    import nodes

    seen = []
    dm = m.model.diffusion_model
    h = dm.single_blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(int(args[0].shape[1])))
    try:
        nodes.common_ksampler(m, 3, 1, 1.0, "euler", "simple", cond, cond, lat)
    finally:
        h.remove()
    return seen


def test_token_count_equals_what_the_forward_receives(flux2):
    from ditkit.bridge.preflight import flux2_rows

    for w, h, rows in ((256, 256, 77), (272, 208, 600), (64, 48, 512)):
        lat, cond = latent(w, h), caption(rows)
        text, refs = flux2_rows(cond, 5)
        assert (text, refs) == (rows, ())
        p = plan(flux2, lat, text=text, refs=refs)
        assert _seen_rows(flux2, lat, cond) == [p.tokens.total], (w, h, rows)
    # a reference image (ReferenceLatent's key): its rows join the image's
    ref = torch.zeros(1, 128, 6, 5)
    cond = [[caption()[0][0], {"reference_latents": [ref]}]]
    lat = latent(128, 128)
    text, refs = flux2_rows(cond, 5)
    assert refs == ((1, 128, 6, 5),)
    p = plan(flux2, lat, text=text, refs=refs)
    assert (p.tokens.video, p.tokens.refs, p.tokens.text) == (64, 30, 512)
    assert _seen_rows(flux2, lat, cond) == [p.tokens.total] == [606]


def test_positive_caption_and_references_are_counted(flux2):
    from ditkit.nodes.preflight import DitKitPreflight

    cond = [[torch.zeros(1, 700, 1024), {"reference_latents": [torch.zeros(1, 128, 16, 16)]}]]
    out = DitKitPreflight.execute(flux2, latent(512, 512), limit_gib=1000.0, text_tokens=5, positive=cond)
    tok = out.ui["ditkit_report"][0]["data"]["tokens"]
    assert (tok["image"], tok["text"], tok["refs"], tok["total"]) == (1024, 700, 256, 1980)
    out = DitKitPreflight.execute(flux2, latent(512, 512), limit_gib=1000.0, text_tokens=5)
    assert out.ui["ditkit_report"][0]["data"]["tokens"] == {"image": 1024, "text": 512, "total": 1536}


@pytest.fixture
def sdpa(monkeypatch):
    """ComfyUI's SDPA attention (no score matrix, as on a GPU): the prediction does not depend on the limit (the
    CPU default sub_quad sizes its query chunk from the free memory, which the limit sets)."""
    import comfy.ldm.flux.math as fm
    from comfy.ldm.modules import attention as a

    monkeypatch.setattr(a, "optimized_attention", a.attention_pytorch)
    monkeypatch.setattr(a, "optimized_attention_masked", a.attention_pytorch)
    monkeypatch.setattr(fm, "optimized_attention", a.attention_pytorch)   # flux/math.py imported it by name


def test_refuses_then_suggestion_runs(flux2, sdpa):
    import comfy.model_management as mm
    import nodes

    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.activation_chunking import DitKitActivationChunking
    from ditkit.nodes.preflight import DitKitPreflight

    lat = latent(512, 512)
    p = plan(flux2, lat)
    full = p.prediction.device
    # chunking the double blocks' MLPs does not lower FLUX.2's peak (the single blocks' fused MLP dominates)
    chunked = plan(DitKitActivationChunking.execute(flux2, chunk_tokens=256).args[0], lat).prediction.device
    assert chunked == full
    fp8 = p.prediction.parts["weights_device"] - plan(load("float8_e4m3fn"), lat).prediction.parts["weights_device"]
    assert fp8 > 0
    limit = (full - fp8 / 4) / 2**30
    loaded_before = [id(x.model) for x in mm.current_loaded_models]
    with pytest.raises(MemoryShortfallError) as e:
        DitKitPreflight.execute(flux2, lat, limit_gib=limit, text_tokens=77)
    assert [id(x.model) for x in mm.current_loaded_models] == loaded_before
    msg = str(e.value)
    assert "SHORT by" in msg and "1,536 tokens" in msg and "chunk_tokens" not in msg, msg
    m = re.search(r"weight_format (\w+): predicted ([\d.]+) GiB", msg)
    assert m, msg
    fixed = load(m.group(1))
    out = DitKitPreflight.execute(fixed, lat, limit_gib=limit, text_tokens=77)
    assert out.ui["ditkit_report"][0]["data"]["fits"] is True
    assert abs(plan(fixed, lat, limit=limit).prediction.device / 2**30 - float(m.group(2))) < 0.01
    res = nodes.common_ksampler(out.args[0], 3, 1, 1.0, "euler", "simple", caption(), caption(), out.args[1])
    assert torch.isfinite(res[0]["samples"]).all()


@pytest.fixture(scope="module")
def flux2_4heads(comfy, tmp_path_factory):
    """The tiny FLUX.2's layout at hidden 512 (4 heads of 128: the tiny one has a single head), ComfyUI's loader."""
    import comfy.sd

    from ditkit.loaders.safetensors_io import save_file

    path = tmp_path_factory.mktemp("flux2_4heads") / "flux2_h512.safetensors"
    save_file(ckpt_image.flux2_state_dict({**ckpt_image.FLUX2, "hidden": 512}), path)
    return comfy.sd.load_diffusion_model(str(path))


def test_head_groups_reach_flux2_and_the_suggestion_runs(flux2_4heads):
    """DitKitActivationChunking's head groups reach FLUX.2's [B, H, S, hd] attention calls (every call grouped, the
    same samples), so on ComfyUI's CPU sub_quad the preflight counts and suggests them; following the suggestion
    passes the node and samples."""
    import nodes

    from ditkit.bridge.preflight import attention_class
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.activation_chunking import DitKitActivationChunking
    from ditkit.nodes.preflight import DitKitPreflight

    m = flux2_4heads
    assert attention_class() == "sub_quad" and m.model.diffusion_model.num_heads == 4
    small, cond = latent(64, 64), caption()
    one = DitKitActivationChunking.execute(m, chunk_tokens=0, attention_heads_per_call=1).args[0]
    ov = one.model_options["transformer_options"]["optimized_attention_override"]
    grouped = nodes.common_ksampler(one, 3, 1, 1.0, "euler", "simple", cond, cond, small)[0]["samples"]
    whole = nodes.common_ksampler(m, 3, 1, 1.0, "euler", "simple", cond, cond, small)[0]["samples"]
    assert ov.calls == ov.grouped == 4 and torch.equal(grouped, whole)      # 2 double + 2 single blocks, 1 step
    lat = latent(512, 512)
    assert plan(one, lat).prediction.parts["attention"] < plan(m, lat).prediction.parts["attention"]
    # sub_quad sizes its query chunk from the free memory (= the limit): a limit where the whole model is short and
    # one head per call fits
    limit = next(g for g in (x / 64 for x in range(1, 640))
                 if plan(one, lat, limit=g).prediction.device <= g * 2**30 < plan(m, lat, limit=g).prediction.device)
    with pytest.raises(MemoryShortfallError) as e:
        DitKitPreflight.execute(m, lat, limit_gib=limit, text_tokens=77)
    msg = str(e.value)
    found = re.search(r"attention_heads_per_call (\d+): predicted ([\d.]+) GiB", msg)
    assert found and "chunk_tokens" not in msg, msg
    fixed = DitKitActivationChunking.execute(m, chunk_tokens=0,
                                             attention_heads_per_call=int(found.group(1))).args[0]
    out = DitKitPreflight.execute(fixed, lat, limit_gib=limit, text_tokens=77)
    assert out.ui["ditkit_report"][0]["data"]["fits"] is True
    assert abs(plan(fixed, lat, limit=limit).prediction.device / 2**30 - float(found.group(2))) < 0.01
    res = nodes.common_ksampler(out.args[0], 3, 1, 1.0, "euler", "simple", cond, cond, small)
    assert torch.isfinite(res[0]["samples"]).all()


def test_sampler_check_refuses_before_any_forward(flux2):
    import comfy.patcher_extension as pe
    import nodes

    from ditkit.bridge.preflight import WRAPPER_KEY
    from ditkit.memory.preflight import MemoryShortfallError
    from ditkit.nodes.preflight import DitKitPreflight

    small = latent(64, 64)
    m = DitKitPreflight.execute(flux2, small, limit_gib=0.0, text_tokens=77).args[0]
    m.model_options["transformer_options"][WRAPPER_KEY]["limit_gib"] = 1e-6
    calls = []
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_count", lambda ex, *a, **k: calls.append(1) or ex(*a, **k))
    with pytest.raises(MemoryShortfallError, match="sampler check|SHORT by"):
        nodes.common_ksampler(m, 3, 1, 1.0, "euler", "simple", caption(), caption(), small)
    assert not calls


def test_bad_inputs_named_before_any_allocation(flux2):
    from ditkit.errors import DitKitError
    from ditkit.memory.model import MemoryModelError
    from ditkit.nodes.preflight import DitKitPreflight

    with pytest.raises(MemoryModelError, match="not a FLUX.2 latent"):
        DitKitPreflight.execute(flux2, {"samples": torch.zeros(1, 128, 2, 8, 8)}, limit_gib=1.0)
    with pytest.raises(MemoryModelError, match="FLUX.2 latent has 16 channels.*takes 128"):
        DitKitPreflight.execute(flux2, {"samples": torch.zeros(1, 16, 8, 8)}, limit_gib=1.0)
    with pytest.raises(MemoryModelError, match="absurd"):
        plan(flux2, {"samples": torch.zeros(1, 128, 1, 1).expand(1, 128, 10**6, 10**6)})
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(DitKitError, match="'?limit_gib'?"):
            DitKitPreflight.execute(flux2, latent(64, 64), limit_gib=bad)
    bad_ref = [[torch.zeros(1, 77, 1024), {"reference_latents": "not a list"}]]
    with pytest.raises(MemoryModelError, match="positive.*reference latents"):
        DitKitPreflight.execute(flux2, latent(64, 64), limit_gib=1.0, positive=bad_ref)
    sd3_ref = [[torch.zeros(1, 77, 1024), {"reference_latents": [torch.zeros(1, 128, 4, 4), torch.zeros(1, 16, 8, 8)]}]]
    with pytest.raises(MemoryModelError, match="reference latent 1 has 16 channels.*takes 128"):
        DitKitPreflight.execute(flux2, latent(64, 64), limit_gib=1.0, positive=sd3_ref)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
@pytest.mark.parametrize("name,width,height,hidden", [
    ("flux2-h512-768x768", 768, 768, 512),                  # ComfyUI's CPU attention (sub_quad): scores dominate
    ("sdpa-flux2-h512-1024x1024", 1024, 1024, 512)])        # SDPA: the single blocks' fused MLP dominates
def test_predicted_vs_measured_peak_on_cpu(comfyui_path, name, width, height, hidden):
    """One FLUX.2 sampling step (hidden 512 = 4 heads of 128, 2 double + 2 single blocks) in a fresh subprocess,
    measured as ``benchmarks/bench_memory.py`` measures it (RSS growth from before the load to the step's peak):
    the preflight's prediction within +-15 %."""
    from benchmarks import bench_memory

    spec = {"name": name, "width": width, "height": height, "chunk": None, "hidden": hidden,
            "comfyui": str(comfyui_path), "threads": 1}
    res = bench_memory.run_child(spec, kind="--flux2-child")
    assert res["tokens"] == (width // 16) * (height // 16) + 512
    err = res["predicted"] / res["total_growth"] - 1
    print(f"{name}: measured {res['total_growth'] / 2**20:.1f} MiB, predicted {res['predicted'] / 2**20:.1f} MiB, "
          f"{err:+.1%}")
    assert abs(err) <= 0.15, res


def test_layout_probe_holds_and_sees_a_changed_constant(comfy, monkeypatch):
    """The contract entry for the FLUX.2 layout the preflight mirrors holds on the tested host, and names what no
    longer matches (here: a caption pad length that is not the host's 512)."""
    from ditkit.bridge import preflight as bp
    from ditkit.memory import preflight as mp

    assert bp._flux2_layout_probe().state == "holds"
    monkeypatch.setattr(mp, "FLUX2_TEXT_ROWS", 511)
    p = bp._flux2_layout_probe()
    assert p.state == "broken" and "target_text_len = 511" in p.note, p
