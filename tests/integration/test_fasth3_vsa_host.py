"""DitKitSparseAttention recipe 'auto' on tiny FastH3 checkpoints in the real ComfyUI host (in process, CPU).

The tiny FastH3 V2 export (``h3_tiny_fasth3_v2/transformer`` + ``fastvideo_inference.json`` + ``provenance.json``)
must run at the contract's sparsity 0.8: the video tiles kept per query tile are FastVideo's ``compute_topk`` for 0.8,
computed here, and sampling is bit-identical to the explicit V2 preset. A file that states its release id in its
safetensors metadata is identified through the loader's record; a gated file that states nothing is refused.
"""
from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch

from ditkit.errors import BackendError

AUTO = "auto (from the checkpoint)"
W, H, LENGTH, TEXT = 256, 256, 22, 10           # video grid (7, 8, 8) -> 2 x 2 x 2 = 8 cubes


def compute_topk(sparsity, n):      # FastVideo video_sparse_attn.py compute_topk
    return max(1, min(math.ceil((1 - sparsity) * n), n))


@pytest.fixture(scope="module")
def dm(comfy, tiny_ckpts, tmp_path_factory):
    """models/diffusion_models with the tiny V2 export, the gated single file, and a copy of it whose metadata names
    the Preview VSA release."""
    import folder_paths

    from ditkit.loaders.safetensors_io import load_file, save_file

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fasth3_vsa_dm")
    src = tiny_ckpts / "diffusion_models"
    shutil.copytree(src / "h3_tiny_fasth3_v2", root / "h3_tiny_fasth3_v2")
    shutil.copy(src / "h3_tiny_fasth3.safetensors", root / "gated.safetensors")
    save_file(load_file(src / "h3_tiny_fasth3.safetensors"), root / "preview_meta.safetensors",
              metadata={"model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree"})
    folder_paths.add_model_folder_path("diffusion_models", str(root))
    yield root
    paths = folder_paths.folder_names_and_paths["diffusion_models"][0]
    if str(root) in paths:
        paths.remove(str(root))


def _load(name):
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    return DitKitH3ModelLoader.execute(model_name=name).args[0]


def _vsa(model, recipe, **kw):
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    out = DitKitSparseAttention.execute(model, recipe=recipe, backend="reference", **kw)
    return out.args[0], out.ui["ditkit_report"][0]


def _sample(model, steps=2):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.tiny.ckpt_h3 import CONFIG

    latent = EmptyMiniMaxH3LatentAV.execute(W, H, LENGTH).result[0]
    cond = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    r = nodes.common_ksampler(model, 7, steps, 1.0, "euler", "simple", cond, cond, latent)[0]
    return [t.clone() for t in r["samples"].unbind()]


def _run_report(caplog):
    run = [r.getMessage() for r in caplog.records if "DitKitSparseAttention" in r.getMessage()
           and " run:" in r.getMessage()]
    assert run, "the run report must be logged"
    return run[-1]


def test_auto_on_the_v2_export_runs_the_contract_sparsity(dm, caplog):
    m = _load("h3_tiny_fasth3_v2/transformer")
    with caplog.at_level(logging.INFO, logger="ditkit"):
        auto, rep = _vsa(m, AUTO)
        rc = rep["data"]["recipe_choice"]
        assert rc["mode"] == "auto" and rc["sparsity"] == 0.8 and rc["keep_percent"] == 20.0
        assert rep["data"]["vsa_sparsity"] == 0.8
        why = " ".join(rc["checkpoint"]["reasons"])
        assert "fastvideo_inference.json vsa_sparsity 0.8" in why and "provenance.json model_id" in why
        assert "FastH3 8-Step V2" in rep["summary"] and "OVERRIDE" not in rep["summary"]
        a = _sample(auto)
        msg = _run_report(caplog)
    assert f"k={compute_topk(0.8, 8)})" in msg and "gate to_gate_compress (loader attachment)" in msg
    explicit, rep2 = _vsa(m, "FastH3 8-step V2 (keep 20%)")
    assert rep2["data"]["recipe_choice"]["override"] is None
    b = _sample(explicit)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "auto must run exactly the V2 preset on this checkpoint"


def test_explicit_choice_against_the_checkpoint_runs_and_is_reported(dm, caplog):
    m = _load("h3_tiny_fasth3_v2/transformer")
    with caplog.at_level(logging.INFO, logger="ditkit"):
        pv, rep = _vsa(m, "FastH3 Preview v1 (keep 10%)")
        _sample(pv)
        msg = _run_report(caplog)
    assert "OVERRIDE" in rep["summary"] and "states sparsity 0.8" in rep["summary"]
    assert rep["data"]["vsa_sparsity"] == 0.9 and f"k={compute_topk(0.9, 8)})" in msg


def test_metadata_release_id_identifies_a_single_file(dm):
    _, rep = _vsa(_load("preview_meta.safetensors"), AUTO)
    rc = rep["data"]["recipe_choice"]
    assert rc["sparsity"] == 0.9 and "file metadata model_id" in " ".join(rc["checkpoint"]["reasons"])


def test_unidentified_checkpoints_are_refused(dm, tiny_ckpts):
    import comfy.sd

    with pytest.raises(BackendError, match=r"trained to_gate_compress in 2/2 blocks.*choose the recipe explicitly"):
        _vsa(_load("gated.safetensors"), AUTO)
    stock = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    with pytest.raises(BackendError, match="does not say which VSA recipe"):
        _vsa(stock, AUTO)
    # the explicit presets still work there, and say the checkpoint was not identified
    _, rep = _vsa(stock, "custom", keep_percent=25.0)
    assert "not identified" in rep["summary"] and rep["data"]["recipe_choice"]["override"] is None


def test_audio_vae_loader_decodes_like_comfyuis_own_model_at_the_files_size(comfy, tiny_ckpts):
    """Oracle: ComfyUI's MiniMaxH3AudioVAE built here at the tiny file's dimensions, weights loaded strictly."""
    import comfy.ldm.minimax.audio_vae as h3audio
    from comfy_extras.nodes_audio import VAEDecodeAudio

    from ditkit.loaders.safetensors_io import load_file
    from ditkit.bridge.h3_audio_vae import load_h3_audio_vae
    from ditkit.tiny.ckpt_h3_vae import TINY_AUDIO_CONFIG as T

    path = tiny_ckpts / "vae" / "h3_audio_vae_tiny.safetensors"
    vae, data = load_h3_audio_vae(str(path))
    assert data["config"]["decoder_dim"] == T["decoder_dim"] and data["built"].startswith("scaled")
    ref = h3audio.MiniMaxH3AudioVAE(encoder_dim=T["encoder_dim"], latent_dim=T["latent_dim"],
                                    decoder_dim=T["decoder_dim"]).eval()
    ref.load_state_dict(load_file(path), strict=True)
    z = torch.randn(1, 32, 2, 6, generator=torch.Generator().manual_seed(3))
    out = VAEDecodeAudio.execute(vae, {"samples": z}).result[0]
    with torch.no_grad():
        want = ref.decode(z)
        std = (torch.std(want, dim=[1, 2], keepdim=True) * 5.0).clamp(min=1.0)   # VAEDecodeAudio's loudness rule
        want = want / std
    got = out["waveform"].detach().float()
    assert out["sample_rate"] == 32000 and got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
