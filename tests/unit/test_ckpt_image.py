"""Tiny Z-Image / FLUX.2 checkpoints and LoKr files: deterministic, real key names, shapes consistent."""
from __future__ import annotations

import hashlib

from ditkit.loaders.safetensors_io import load_file
from ditkit.tiny import ckpt_image as ci
from ditkit.tiny.checkpoints import generate_all


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_deterministic_and_registered(tmp_path):
    names = ["zimage_dit", "flux2_dit", "zimage_lokr", "flux2_lokr"]
    a = generate_all(tmp_path / "a", only=names)
    b = generate_all(tmp_path / "b", only=names)
    assert sorted(a) == sorted(names)
    for n in names:
        assert [_sha(p) for p in a[n]] == [_sha(p) for p in b[n]]
    assert a["zimage_dit"][0].name == "zimage_tiny.safetensors"
    assert a["flux2_dit"][0].name == "flux2_tiny.safetensors"


def test_zimage_layout(tmp_path):
    (p,) = generate_all(tmp_path, only=["zimage_dit"])["zimage_dit"]
    sd = load_file(p)
    d = ci.ZIMAGE["dim"]
    assert tuple(sd["layers.0.attention.qkv.weight"].shape) == (3 * d, d)  # fused, ComfyUI layout
    assert "layers.0.attention.to_q.weight" not in sd
    assert tuple(sd["cap_embedder.1.weight"].shape) == (d, 1024)
    assert tuple(sd["layers.1.adaLN_modulation.0.weight"].shape) == (4 * d, 256)
    assert "noise_refiner.1.attention.k_norm.weight" in sd and "context_refiner.1.attention.qkv.weight" in sd
    assert "layers.2.attention.qkv.weight" not in sd


def test_flux2_layout(tmp_path):
    (p,) = generate_all(tmp_path, only=["flux2_dit"])["flux2_dit"]
    sd = load_file(p)
    h = ci.FLUX2["hidden"]
    assert h % 128 == 0
    assert tuple(sd["double_blocks.0.img_attn.qkv.weight"].shape) == (3 * h, h)
    assert tuple(sd["single_blocks.1.linear1.weight"].shape) == (9 * h, h)  # q,k,v,mlp = 1:1:1:6
    assert tuple(sd["single_blocks.1.linear2.weight"].shape) == (h, 4 * h)
    assert tuple(sd["double_blocks.0.img_mlp.0.weight"].shape) == (6 * h, h)
    for k in ("double_stream_modulation_img.lin.weight", "double_stream_modulation_txt.lin.weight",
              "single_stream_modulation.lin.weight", "double_blocks.0.img_attn.norm.key_norm.scale"):
        assert k in sd
    assert not any(k.endswith(".bias") for k in sd)


def test_lokr_files_match_model_shapes(tmp_path):
    out = generate_all(tmp_path, only=["zimage_lokr", "flux2_lokr"])
    f = load_file(out["flux2_lokr"][0])
    shapes = ci.flux2_shapes()
    mods = {k.rsplit(".", 1)[0] for k in f}
    assert mods and all(m.startswith("diffusion_model.") for m in mods)
    for m in mods:
        o, i = shapes[m[len("diffusion_model."):] + ".weight"]
        w1 = f[m + ".lokr_w1"]
        w2 = f[m + ".lokr_w2_a"] @ f[m + ".lokr_w2_b"]
        assert w1.shape[0] * w2.shape[0] == o and w1.shape[1] * w2.shape[1] == i
    z = load_file(out["zimage_lokr"][0])
    assert "diffusion_model.layers.0.attention.to_q.lokr_w1" in z
    assert float(z["diffusion_model.layers.0.attention.to_q.alpha"]) > 1e9  # ai-toolkit placeholder
