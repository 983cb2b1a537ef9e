"""DitKitPreflight under classifier-free guidance in the real ComfyUI 0.33 host (in process, CPU, the tiny FLUX.2 and
H3 checkpoints). At cfg != 1 ComfyUI runs the negative conditioning too and, where the model's conditionings
concatenate (FLUX.2, Z-Image, LTX-2), batches positive and negative into ONE forward at twice the rows; at cfg 1
(``math.isclose``) it skips the negative. The oracle is the batch the host's own forward receives (a spy on
``BaseModel.apply_model``), not ditkit's rule: the sampler check must report that batch, refuse a CFG job whose
batch-2 peak exceeds ``limit_gib`` before any forward while the same job at cfg 1 passes, and refuse a NaN cfg by
name. H3 never batches its conditionings (one forward each), so its prediction does not change with cfg."""
from __future__ import annotations

import math
import re

import pytest
import torch

from ditkit.tiny import ckpt_h3, ckpt_image

STEPS = 1


@pytest.fixture(scope="module")
def flux2(comfy, tiny_ckpts):
    import folder_paths

    from ditkit.nodes.dit_loaders import DitKitFlux2ModelLoader

    torch.set_num_threads(1)
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    return DitKitFlux2ModelLoader.execute(unet_name="flux2_tiny.safetensors").args[0]


@pytest.fixture(scope="module")
def h3(comfy, tiny_ckpts):
    import folder_paths

    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    torch.set_num_threads(1)
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    return DitKitH3ModelLoader.execute(model_name="h3_tiny_comfy.safetensors").args[0]


def flux2_latent(w=512, h=512):
    from comfy_extras.nodes_flux import EmptyFlux2LatentImage

    return EmptyFlux2LatentImage.execute(w, h, 1).result[0]


def h3_latent():
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    return EmptyMiniMaxH3LatentAV.execute(128, 128, 5).result[0]


def caption(dim, rows=77, seed=0):
    return [[torch.randn(1, rows, dim, generator=torch.Generator().manual_seed(seed)), {}]]


@pytest.fixture
def forwards(monkeypatch):
    """The batch of every forward the host runs (the first dimension of the x ComfyUI hands apply_model)."""
    import comfy.model_base as mb

    seen = []
    orig = mb.BaseModel.apply_model

    def spy(self, x, t, **kw):
        seen.append(int(x.shape[0]))
        return orig(self, x, t, **kw)

    monkeypatch.setattr(mb.BaseModel, "apply_model", spy)
    return seen


@pytest.fixture
def reports(monkeypatch):
    import ditkit.nodes.preflight as node

    got = []
    real = node.send_report

    def send(target, node_id, kind, text, data):
        got.append((text, data))
        return real(target, node_id, kind, text, data)

    monkeypatch.setattr(node, "send_report", send)
    return got


def guarded(model, lat, limit=1000.0, cfg=1.0):
    from ditkit.nodes.preflight import DitKitPreflight

    return DitKitPreflight.execute(model, lat, limit_gib=limit, text_tokens=77, cfg=cfg).args[0]


def ksample(m, lat, cfg, dim):
    import nodes

    return nodes.common_ksampler(m, 0, STEPS, cfg, "euler", "simple", caption(dim), caption(dim, seed=1), lat)


def sampler_plan(model, lat, cfg):
    """What the sampler check plans for this job at ``cfg`` (the guider's positive and negative as captions)."""
    from ditkit.bridge.preflight import conditioning_batch, latent_shapes_of, run_plan

    v, _ = latent_shapes_of(lat["samples"], "flux2")
    cond = [{"cross_attn": caption(ckpt_image.FLUX2["context_dim"])[0][0]}]
    b = conditioning_batch(model, v, None, cfg, cond, cond, 77)
    return run_plan(model, v, None, 77, 1000.0, (), batch=b)


@pytest.mark.parametrize("cfg, rows", [(1.0, 1), (1 + 1e-10, 1), (1.0000001, 2), (0.9999999, 2), (7.0, 2)])
def test_flux2_sampler_check_reports_the_batch_the_forward_gets(flux2, forwards, reports, cfg, rows):
    lat = flux2_latent()
    ksample(guarded(flux2, lat), lat, cfg, ckpt_image.FLUX2["context_dim"])
    assert forwards == [rows] * STEPS                     # the host's own decision
    text, data = [r for r in reports if r[1]["phase"] == "sampler"][-1]
    assert data["batch"] == rows
    assert f"batch {rows} = {rows} conditioning" in text, text


def test_cfg_job_refused_at_sampling_while_cfg1_passes(flux2, forwards, reports):
    from ditkit.memory.preflight import MemoryShortfallError

    dim = ckpt_image.FLUX2["context_dim"]
    lat = flux2_latent()
    one, two = sampler_plan(flux2, lat, 1.0), sampler_plan(flux2, lat, 7.0)
    assert (one.options.batch, two.options.batch) == (1, 2)
    assert two.prediction.parts["block_peak"] > one.prediction.parts["block_peak"]
    limit = (one.peak() + two.peak()) / 2 / 2**30
    # the node, cfg not given: passes as at cfg 1 and says what it assumed and the CFG figure
    m = guarded(flux2, lat, limit)
    text = reports[-1][0]
    assert "batch 1 = 1 conditioning (cfg 1: ComfyUI skips the uncond)" in text, text
    assert re.search(r"at cfg != 1: batch 2, predicted [0-9.]+ GiB, does not fit", text), text
    with pytest.raises(MemoryShortfallError) as e:
        ksample(m, lat, 7.0, dim)
    assert forwards == []                                # refused before any forward
    msg = str(e.value)
    assert "batch 2 = 2 conditionings (cfg 7: the uncond runs; ComfyUI batches 2 into one forward)" in msg, msg
    assert "SHORT by" in msg
    ksample(m, lat, 1.0, dim)                            # the same job at cfg 1 passes and samples
    assert forwards == [1] * STEPS
    # the node told the cfg refuses there already
    from ditkit.nodes.preflight import DitKitPreflight

    with pytest.raises(MemoryShortfallError, match="batch 2 = 2 conditionings"):
        DitKitPreflight.execute(flux2, lat, limit_gib=limit, text_tokens=77, cfg=7.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_cfg_refused_by_name(flux2, forwards, bad):
    from ditkit.memory.model import MemoryModelError
    from ditkit.nodes.preflight import DitKitPreflight

    lat = flux2_latent(256, 256)
    with pytest.raises(MemoryModelError, match=r"DitKitPreflight: the sampler's cfg must be finite"):
        ksample(guarded(flux2, lat), lat, bad, ckpt_image.FLUX2["context_dim"])
    assert forwards == []
    from ditkit.bridge.preflight import conditioning_batch, latent_shapes_of
    from ditkit.errors import DitKitError

    # the pack's float guard refuses first once the extension has registered the node ('cfg' is nan: ...); called
    # before that (this test alone), the node's own check does (cfg must be finite): both name the input
    with pytest.raises(DitKitError, match=rf"^DitKitPreflight: input (cfg must be finite, got {bad!r}$|'cfg' is "
                                          rf"{bad!r}; it must be a finite number)"):
        DitKitPreflight.execute(flux2, lat, limit_gib=1000.0, text_tokens=77, cfg=bad)
    with pytest.raises(MemoryModelError, match=r"DitKitPreflight: input cfg must be finite"):
        conditioning_batch(flux2, latent_shapes_of(lat["samples"], "flux2")[0], None, bad, None, None, 77, "input")
    assert forwards == []


def test_h3_never_batches_its_conditionings(h3, forwards, reports):
    lat = h3_latent()
    ksample(guarded(h3, lat, cfg=7.0), lat, 7.0, ckpt_h3.CONFIG["text_dim"])
    assert forwards == [1, 1] * STEPS                    # one forward each, cond and uncond
    texts = [r[0] for r in reports]
    node, sampler = reports[0][1], reports[-1][1]
    assert node["batch"] == sampler["batch"] == 1
    assert "this model never batches conditionings: one forward each" in texts[-1], texts[-1]
    assert "at cfg" not in texts[0]                       # the same figure at either cfg: no second one


def test_cfg_rule_probe_sees_a_host_with_another_tolerance(comfy, monkeypatch):
    """The mirrored cfg rule is checked against the host's own sampling_function: a host whose isclose tolerance
    differs (1e-6) makes the probe broken, naming the cfg where they differ."""
    import math
    import types

    import comfy.samplers as s

    from ditkit.bridge.preflight import _cfg_rule_probe

    assert _cfg_rule_probe().state == "holds"
    loose = types.SimpleNamespace(isclose=lambda a, b: math.isclose(a, b, rel_tol=1e-6))
    monkeypatch.setattr(s, "math", loose)
    probe = _cfg_rule_probe()
    assert probe.state == "broken" and "(1.0000001, None)" in probe.note, probe


def test_cond_constant_probe_sees_h3_layouts_that_concatenate(comfy, monkeypatch):
    from comfy.ldm.minimax.model import PackedLayout

    from ditkit.bridge.preflight import _cond_batch_probe, _cond_constant_probe

    assert _cond_constant_probe().state == "holds"
    monkeypatch.setattr(PackedLayout, "__eq__", lambda a, b: True, raising=False)
    probe = _cond_constant_probe()
    assert probe.state == "broken" and probe.note == "two H3 payloads with equal layouts concatenate", probe
    assert _cond_batch_probe().state == "holds"                # the batching code itself did not change


def test_cond_constant_probe_sees_constants_that_never_concatenate(comfy, monkeypatch):
    import comfy.conds

    from ditkit.bridge.preflight import _cond_constant_probe

    monkeypatch.setattr(comfy.conds.CONDConstant, "can_concat", lambda self, other: False)
    probe = _cond_constant_probe()
    assert probe.state == "broken" and probe.note == "two equal plain constants do not concatenate", probe


@pytest.mark.parametrize("cfg, flag, want", [
    (1.0, None, 2.0), (1 + 1e-10, None, 2.0), (1.0000001, None, 1.0), (0.9999999, None, 1.0), (7.0, None, 1.0),
    (0.0, None, 1.0), (1.0, False, 2.0), (1.0, 0, 2.0), (1.0, True, 1.0), (1.0, 1, 1.0), (7.0, True, 1.0)])
def test_other_case_cfg_is_the_case_comfyui_does_not_run(flux2, cfg, flag, want):
    """ComfyUI skips the negative when isclose(cfg, 1, rel_tol 1e-9) and disable_cfg1_optimization == False (the
    host's rule written here): the other case of a cfg that skips it is 2.0, of one that runs it 1.0."""
    from ditkit.bridge.preflight import other_case_cfg

    m = flux2.clone()
    if flag is not None:
        m.model_options["disable_cfg1_optimization"] = flag
    skips = math.isclose(cfg, 1.0, rel_tol=1e-9) and not flag
    assert want == (2.0 if skips else 1.0)
    assert other_case_cfg(m, cfg) == want


@pytest.mark.parametrize("neg_rows, batches", [(77, [2]), (20, [1, 1])])
def test_zimage_batches_only_captions_of_equal_length(zimage, forwards, reports, neg_rows, batches):
    """Z-Image's caption length is a CONDConstant (num_tokens): positive and negative join only when equal."""
    import nodes
    from comfy_extras.nodes_sd3 import EmptySD3LatentImage

    dim = zimage.model.diffusion_model.cap_embedder[-1].in_features
    lat = EmptySD3LatentImage.execute(256, 256, 1).result[0]
    nodes.common_ksampler(guarded(zimage, lat), 0, 1, 4.0, "euler", "simple", caption(dim, 77),
                          caption(dim, neg_rows, seed=1), lat)
    assert forwards == batches
    text, data = [r for r in reports if r[1]["phase"] == "sampler"][-1]
    assert data["batch"] == max(batches)
    if max(batches) == 1:
        assert "their shapes differ: one forward each" in text, text
