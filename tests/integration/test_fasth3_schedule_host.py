"""DitKitFastH3Schedule in the real ComfyUI host (in-process, tiny H3).

Oracle for exactness: ComfyUI's own pieces. The same SamplerCustom run with ``MiniMaxH3SigmaShift`` (the shifts)
and ``ManualSigmas`` given the ladder computed *here* from the published rungs and the shift formula must be
bit-identical to the run with the node's MODEL + SIGMAS. Contract files are read from models/diffusion_models only.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ditkit.errors import ScheduleError, UnsupportedModelError

RECIPES = {"fasth3_8step_v2": ([999, 874, 749, 624, 500, 375, 250, 125], 10.0, 3.0),
           "fasth3_preview_4step": ([999, 749, 500, 250], 12.0, 3.0)}


def hand_sigmas(rungs, shift) -> str:
    """The ladder as a ManualSigmas string: b = rung/1000 (+ 0), sigma = s*b/(1+(s-1)*b), in float32 in the order
    vllm-omni's _time_shift_sigmas evaluates it; repr() of each float32 value parses back to the same float32."""
    base = torch.tensor([r / 1000.0 for r in rungs] + [0.0], dtype=torch.float32)
    sig = shift * base / (1 + (shift - 1) * base)
    return ", ".join(repr(float(v)) for v in sig)


@pytest.fixture(scope="module")
def h3(comfy, tiny_ckpts):
    import comfy.sd

    torch.set_num_threads(1)
    return comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))


def _cond():
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(1, 7, 48, generator=g), {}]]


def _sample_custom(model, sigmas, seed=11):
    from comfy_extras.nodes_custom_sampler import KSamplerSelect, SamplerCustom
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    lat = EmptyMiniMaxH3LatentAV.execute(64, 64, 5)[0]
    sampler = KSamplerSelect.execute("euler")[0]
    out, den = SamplerCustom.execute(model, True, seed, 1.0, _cond(), _cond(), sampler, sigmas, lat)[:2]
    return [t.clone() for t in out["samples"].unbind()] + [t.clone() for t in den["samples"].unbind()]


def _node(model, recipe, contract_file=""):
    from ditkit.nodes.fasth3 import DitKitFastH3Schedule

    out = DitKitFastH3Schedule.execute(model, recipe, contract_file)
    return out.args[0], out.args[1], out.ui["ditkit_report"][0]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_bit_identical_to_manual_sigmas_and_comfy_sigma_shift(h3, recipe):
    from comfy_extras.nodes_custom_sampler import ManualSigmas
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3SigmaShift

    rungs, sv, sa = RECIPES[recipe]
    m, sigmas, rep = _node(h3, recipe)
    manual = ManualSigmas.execute(hand_sigmas(rungs, sv))[0]
    assert sigmas.dtype == manual.dtype == torch.float32 and torch.equal(sigmas, manual)
    ref_model = MiniMaxH3SigmaShift.execute(h3, sv, sa)[0]
    ms, rms = m.get_model_object("model_sampling"), ref_model.get_model_object("model_sampling")
    assert (ms.shift, ms.audio_shift, ms.audio_scale) == (rms.shift, rms.audio_shift, rms.audio_scale) == (sv, sa, sv / sa)
    to = m.model_options["transformer_options"]
    assert (to["minimax_h3_sigma_shift_video"], to["minimax_h3_sigma_shift_audio"]) == (sv, sa)
    got, ref = _sample_custom(m, sigmas), _sample_custom(ref_model, manual)
    assert all(torch.isfinite(t).all() for t in got)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), "node route differs from ManualSigmas + MiniMaxH3SigmaShift"
    # the comparison can tell schedules apart: the same sigmas with the base shifts 12/3 (audio clock differs for
    # V2) or the rounded 5-digit values a user would type give another latent
    other = _sample_custom(h3 if sv != 12.0 else MiniMaxH3SigmaShift.execute(h3, 12.0, 2.0)[0], sigmas)
    assert not torch.equal(other[1], ref[1])
    typed = ManualSigmas.execute(", ".join(f"{float(v):.5f}" for v in sigmas))[0]
    assert not torch.equal(typed, sigmas)
    # report
    assert rep["node_type"] == "DitKitFastH3Schedule" and rep["kind"] == "schedule"
    assert rep["data"]["recipe"] == recipe and rep["data"]["dmd_denoising_steps"] == rungs
    assert rep["data"]["video_shift"] == sv and rep["data"]["audio_shift"] == sa
    assert rep["data"]["video_sigmas"] == sigmas.tolist()
    assert f"video {sv:g} / audio {sa:g}" in rep["summary"] and f"{len(rungs)} forwards" in rep["summary"]
    assert "model source unknown" in rep["summary"]  # stock-loaded model: no contract, and the report says why


def test_input_model_untouched_and_previous_shifts_reported(h3):
    before = (h3.get_model_object("model_sampling"), dict(h3.object_patches),
              json.dumps(sorted(h3.model_options.get("transformer_options", {}))))
    m, _, rep = _node(h3, "fasth3_8step_v2")
    assert m is not h3
    after = (h3.get_model_object("model_sampling"), dict(h3.object_patches),
             json.dumps(sorted(h3.model_options.get("transformer_options", {}))))
    assert before == after
    assert rep["data"]["previous_shifts"] == [12.0, 3.0] and "the model's shifts were 12 / 3" in rep["summary"]
    _, _, rep2 = _node(m, "fasth3_8step_v2")  # already on the recipe's shifts: nothing to mention
    assert "shifts were" not in rep2["summary"]


def test_non_h3_model_refused(comfy, tiny_ckpts):
    import comfy.sd

    flux = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"))
    patches = dict(flux.object_patches)
    with pytest.raises(UnsupportedModelError, match="MiniMax H3"):
        _node(flux, "fasth3_8step_v2")
    assert dict(flux.object_patches) == patches


# ---------------------------------------------------------------------------------------------- contracts
def _contract(rungs, sv=None, sa=None):
    c = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": rungs,
         "num_inference_steps": len(rungs) + 1, "transformer_forwards": len(rungs), "task": "t2av"}
    if sv is not None:
        c.update(video_scheduler_shift=sv, audio_scheduler_shift=sa)
    return json.dumps(c)


@pytest.fixture(scope="module")
def dm_root(comfy, tiny_ckpts, tmp_path_factory):
    """A models/diffusion_models folder holding FastVideo-style exports: <name>/transformer (the tiny diffusers
    H3) + <name>/fastvideo_inference.json; plus a symlink leading out of the folder."""
    import folder_paths

    root = tmp_path_factory.mktemp("fasth3_dm")
    src = tiny_ckpts / "diffusion_models" / "h3_tiny_diffusers"
    for name, text in (("FastH3-V2", _contract(RECIPES["fasth3_8step_v2"][0], 10.0, 3.0)),
                       ("FastH3-Preview", _contract(RECIPES["fasth3_preview_4step"][0]))):
        shutil.copytree(src, root / name / "transformer")
        (root / name / "fastvideo_inference.json").write_text(text)
    shutil.copytree(src, root / "NoContract")
    shutil.copy(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors", root / "single.safetensors")
    outside = tmp_path_factory.mktemp("fasth3_outside")
    (outside / "fastvideo_inference.json").write_text(_contract(RECIPES["fasth3_8step_v2"][0], 10.0, 3.0))
    os.symlink(outside, root / "escape")
    folder_paths.add_model_folder_path("diffusion_models", str(root))
    yield root
    paths = folder_paths.folder_names_and_paths["diffusion_models"][0]
    if str(root) in paths:
        paths.remove(str(root))


def _load(name):
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    return DitKitH3ModelLoader.execute(model_name=name).args[0]


def test_contract_found_next_to_the_loaded_checkpoint(dm_root):
    m = _load("FastH3-V2/transformer")
    out, sigmas, rep = _node(m, "fasth3_8step_v2")
    c = rep["data"]["contract"]
    assert c["path"].endswith(os.path.join("FastH3-V2", "fastvideo_inference.json"))
    assert c["dmd_denoising_steps"] == RECIPES["fasth3_8step_v2"][0] and c["video_scheduler_shift"] == 10.0
    assert "agrees" in rep["summary"] and "found next to the loaded checkpoint" in rep["summary"]
    fc = _node(m, "from_contract")
    assert torch.equal(fc[1], sigmas) and fc[2]["data"]["video_shift"] == 10.0
    with pytest.raises(ScheduleError, match="disagree with recipe fasth3_preview_4step"):
        _node(m, "fasth3_preview_4step")


def test_preview_contract_checks_the_ladder_and_needs_named_shifts(dm_root):
    m = _load("FastH3-Preview/transformer")
    _, sigmas, rep = _node(m, "fasth3_preview_4step")
    assert sigmas.numel() == 5 and rep["data"]["contract"]["video_scheduler_shift"] is None
    with pytest.raises(ScheduleError, match="disagree with recipe fasth3_8step_v2"):
        _node(m, "fasth3_8step_v2")
    with pytest.raises(ScheduleError, match="has no video_scheduler_shift"):
        _node(m, "from_contract")


def test_no_contract_cases_are_reported(dm_root):
    _, _, rep = _node(_load("NoContract"), "fasth3_8step_v2")
    assert rep["data"]["contract"] is None and "none next to the loaded checkpoint folder" in rep["summary"]
    _, _, rep = _node(_load("single.safetensors"), "fasth3_8step_v2")
    assert "single-file checkpoint" in rep["summary"]
    with pytest.raises(ScheduleError, match="needs the checkpoint's fastvideo_inference.json"):
        _node(_load("NoContract"), "from_contract")


@pytest.mark.parametrize("name", ["FastH3-V2", "FastH3-V2/fastvideo_inference.json", "./FastH3-V2/",
                                  "FastH3-V2\\fastvideo_inference.json"])
def test_contract_file_named_inside_the_folder(dm_root, h3, name):
    _, _, rep = _node(h3, "fasth3_8step_v2", name)
    assert rep["data"]["contract"]["path"] == os.path.realpath(dm_root / "FastH3-V2" / "fastvideo_inference.json")
    assert rep["data"]["contract_source"] == "named in contract_file"


@pytest.mark.parametrize("name,words", [
    ("/etc/passwd", "absolute path"),
    ("\\\\server\\share", "absolute path"),
    ("C:\\models\\x", "absolute path"),
    ("../fasth3_outside", r"leaves models/diffusion_models \('\.\.'\)"),
    ("FastH3-V2/../../x", r"'\.\.'"),
    ("escape", "resolves \\(through a symlink\\) outside"),
    ("NoContract", "no fastvideo_inference.json there"),
    ("FastH3-V2/transformer/config.json", "no fastvideo_inference.json there"),
    ("x\x00y", "not a usable file name"),
])
def test_contract_file_outside_or_missing_refused(dm_root, h3, name, words):
    patches = dict(h3.object_patches)
    with pytest.raises(ScheduleError, match=words):
        _node(h3, "fasth3_8step_v2", name)
    assert dict(h3.object_patches) == patches
