"""The real-size dimensions behind the README "Quantized weights" table (``benchmarks/bench_quantize.py`` ``REAL``)
and the key inventories the tiny generators build from them, against the public configs and ComfyUI's own model
classes (real host, meta device: no weights are made).

* ``PUBLIC``: the published transformer configs, written out here from their sources (docs/quantize.md "Real-size
  dimensions"): LTX-2 — diffusers ``scripts/convert_ltx2_to_diffusers.py`` version "2.0" (transformer and
  connector configs); FLUX.2-dev — diffusers ``scripts/convert_flux2_to_diffusers.py`` "flux2-dev"
  (= black-forest-labs/FLUX.2-dev ``transformer/config.json``); Z-Image — Tongyi-MAI/Z-Image-Turbo
  ``transformer/config.json`` as ComfyUI's ``model_detection.py`` encodes it for dim 3840. ``REAL`` must say the same.
* ComfyUI's detection of the generated real-size inventory gives the public numbers, and the model ComfyUI builds
  from that config (``model_config_from_unet_config(...).get_model`` on the meta device) has exactly the
  inventory's keys and shapes (FLUX.2: ComfyUI names the BFL ``*_norm.scale`` gains ``*_norm.weight``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = {
    "ltx2": {"num_layers": 48, "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
             "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048,
             "caption_channels": 3840, "in_channels": 128, "audio_in_channels": 128,
             "connector_num_attention_heads": 30, "connector_attention_head_dim": 128, "connector_num_layers": 2},
    "flux2": {"num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48, "attention_head_dim": 128,
              "joint_attention_dim": 15360, "in_channels": 128, "mlp_ratio": 3.0, "timestep_guidance_channels": 256,
              "guidance_embeds": True},
    "zimage": {"dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "cap_feat_dim": 2560,
               "in_channels": 16, "patch_size": 2, "frequency_embedding_size": 256},
}


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_quantize
    finally:
        sys.path.pop(0)
    return bench_quantize


def test_real_dims_are_the_public_configs():
    real = _bench().REAL
    assert {k: real["ltx2"][k] for k in PUBLIC["ltx2"]} == PUBLIC["ltx2"]
    f, p = real["flux2"], PUBLIC["flux2"]
    assert (f["depth"], f["depth_single"], f["hidden"], f["context_dim"], f["in_channels"], f["mlp_ratio"]) == \
        (p["num_layers"], p["num_single_layers"], p["num_attention_heads"] * p["attention_head_dim"],
         p["joint_attention_dim"], p["in_channels"], p["mlp_ratio"])
    z, p = real["zimage"], PUBLIC["zimage"]
    assert (z["dim"], z["n_layers"], z["n_refiner_layers"], z["cap_feat_dim"], z["in_channels"], z["patch_size"],
            z["t_hidden"]) == (p["dim"], p["n_layers"], p["n_refiner_layers"], p["cap_feat_dim"], p["in_channels"],
                               p["patch_size"], p["frequency_embedding_size"])


def _built(family):
    import comfy.model_detection as md

    from ditkit.loaders.safetensors_io import DTYPES

    b = _bench()
    inv = b.inventory(family, b.REAL[family])
    sd = {k: torch.empty(s, dtype=DTYPES[dt][0], device="meta") for k, (s, dt) in inv.items()}
    meta = {"config": json.dumps({"transformer": b.REAL["ltx2"]})} if family == "ltx2" else None
    cfg = md.detect_unet_config(sd, "", metadata=meta)
    mc = md.model_config_from_unet_config(cfg, sd)
    with torch.device("meta"):
        model = mc.get_model(sd, "", device=torch.device("meta"))
    return cfg, {k: tuple(s) for k, (s, _) in inv.items()}, \
        {k: tuple(v.shape) for k, v in model.diffusion_model.state_dict().items()}


@pytest.mark.parametrize("family", ["ltx2", "flux2", "zimage"])
def test_comfyuis_model_at_the_public_config_has_the_inventorys_keys_and_shapes(comfy, family):
    cfg, inv, built = _built(family)
    p = PUBLIC[family]
    if family == "ltx2":
        assert cfg["image_model"] == "ltxav" and {k: cfg[k] for k in p} == p
    elif family == "flux2":
        assert cfg["image_model"] == "flux2" and (cfg["depth"], cfg["depth_single_blocks"], cfg["hidden_size"],
                                                   cfg["num_heads"], cfg["context_in_dim"], cfg["in_channels"],
                                                   cfg["guidance_embed"]) == \
            (p["num_layers"], p["num_single_layers"], p["num_attention_heads"] * p["attention_head_dim"],
             p["num_attention_heads"], p["joint_attention_dim"], p["in_channels"], p["guidance_embeds"])
        inv = {(k[: -len(".scale")] + ".weight" if k.endswith("_norm.scale") else k): s for k, s in inv.items()}
    else:
        assert cfg["image_model"] == "lumina2" and (cfg["dim"], cfg["n_layers"], cfg["n_heads"], cfg["cap_feat_dim"]) \
            == (p["dim"], p["n_layers"], p["n_heads"], p["cap_feat_dim"])
    assert set(built) == set(inv), (sorted(set(built) - set(inv))[:5], sorted(set(inv) - set(built))[:5])
    wrong = {k: (inv[k], built[k]) for k in built if inv[k] != built[k]}
    assert not wrong, wrong
