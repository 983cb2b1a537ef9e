"""Tiny H3 DiT checkpoints: determinism, key inventory vs the real layout tables, layout relations.

Oracles are independent of the generator: the real-size inventory is checked against the byte totals of the
official / diffusers index files (h3.md §2.1: 535 tensors = 66,280,430,144 B; 638 tensors = 66,280,430,080 B),
and the per-head de-interleave is re-done here with explicit loops.
"""
from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from ditkit.loaders.safetensors_io import load_file, read_header
from ditkit.tiny import ckpt_h3 as C
from ditkit.tiny.checkpoints import generate_all

NAMES = ["h3_dit", "h3_dit_official", "h3_dit_diffusers", "h3_dit_curve", "h3_dit_fasth3", "h3_dit_fasth3_v2"]

REAL = dict(C.CONFIG, hidden_size=5376, num_attention_heads=56, attention_head_dim=128, num_layers=50,
            ffn_hidden_size=14336, text_dim=5120, timestep_input_dim=256, time_embed_hidden_size=5376,
            time_embed_dim=2688, rope_inv_freq_len=16)

FP32_KEYS_TOP = {"video_patch_proj.weight", "video_patch_proj.bias", "audio_patch_proj.weight",
                 "audio_patch_proj.bias", "time_embedder.proj_in.weight", "time_embedder.proj_in.bias",
                 "time_embedder.proj_out.weight", "time_embedder.proj_out.bias", "rope.inv_freq",
                 "final_layer.video_out.weight", "final_layer.video_out.bias",
                 "final_layer.audio_out.weight", "final_layer.audio_out.bias"}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    a = tmp_path_factory.mktemp("h3a")
    b = tmp_path_factory.mktemp("h3b")
    wa = generate_all(a, only=NAMES)
    wb = generate_all(b, only=NAMES)
    return a, b, wa, wb


def _digest(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_generators_registered_and_byte_identical(two_runs):
    a, b, wa, wb = two_runs
    assert sorted(wa) == sorted(NAMES)
    for name in NAMES:
        ra = sorted(p.relative_to(a) for p in wa[name])
        rb = sorted(p.relative_to(b) for p in wb[name])
        assert ra == rb and ra
        for rel in ra:
            assert _digest(a / rel) == _digest(b / rel), f"{name}: {rel} differs between two runs"


def test_file_names(two_runs):
    a, _, wa, _ = two_runs
    rel = {n: sorted(str(p.relative_to(a)) for p in ps) for n, ps in wa.items()}
    assert rel["h3_dit"] == ["diffusion_models/h3_tiny_comfy.safetensors"]
    assert rel["h3_dit_curve"] == ["diffusion_models/h3_tiny_curve.safetensors"]
    assert rel["h3_dit_fasth3"] == ["diffusion_models/h3_tiny_fasth3.safetensors"]
    assert rel["h3_dit_official"] == [
        "diffusion_models/h3_tiny_official/config.json",
        "diffusion_models/h3_tiny_official/model-00001-of-00002.safetensors",
        "diffusion_models/h3_tiny_official/model-00002-of-00002.safetensors",
        "diffusion_models/h3_tiny_official/model.safetensors.index.json"]
    assert rel["h3_dit_diffusers"] == [
        "diffusion_models/h3_tiny_diffusers/config.json",
        *[f"diffusion_models/h3_tiny_diffusers/diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)],
        "diffusion_models/h3_tiny_diffusers/diffusion_pytorch_model.safetensors.index.json"]
    v2 = "diffusion_models/h3_tiny_fasth3_v2/"
    assert rel["h3_dit_fasth3_v2"] == sorted([
        v2 + "fastvideo_inference.json", v2 + "provenance.json", v2 + "transformer/config.json",
        *[f"{v2}transformer/diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)],
        v2 + "transformer/diffusion_pytorch_model.safetensors.index.json"])


def test_fasth3_v2_export_is_the_gated_fasth3_weights_in_diffusers_names(two_runs):
    """Same tensors as h3_tiny_fasth3 (the loader converts them back), and a contract the schedule parser accepts."""
    from ditkit.loaders import h3 as L
    from ditkit.sampling import fasth3 as sched

    a, *_ = two_runs
    sd, rep = L.load_h3_state_dict(a / C.FASTH3_V2_DIR / "transformer")
    ref = load_file(a / C.FASTH3_FILE)
    assert rep.layout == "diffusers" and "fasth3-gates" in rep.variant
    assert sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref if k != "rope.inv_freq")
    c = sched.load_contract(a / C.FASTH3_V2_DIR / "fastvideo_inference.json")
    assert c.rungs == (999, 874, 749, 624, 500, 375, 250, 125) and (c.video_shift, c.audio_shift) == (10.0, 3.0)
    assert c.extra["vsa_sparsity"] == 0.8 and c.extra["vsa_tile_size"] == 64


def _meta_sd(cfg):
    return {k: torch.empty(s, dtype=C.dtype_for(k), device="meta") for k, s in C.comfy_shapes(cfg).items()}


def _nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


def test_real_size_inventory_matches_official_index_totals():
    sd = _meta_sd(REAL)
    assert len(sd) == 535
    assert _nbytes(sd) == 66_280_430_144
    d = C.diffusers_state_dict(sd, REAL)
    assert len(d) == 638
    assert _nbytes(d) == 66_280_430_080


def _expected_comfy_keys(cfg):
    top = set(FP32_KEYS_TOP) | {"condition_proj.weight", "condition_proj.bias", "token_refiner.final_norm.weight",
                                "final_layer.norm.weight", "final_layer.adaln_proj.linear.weight",
                                "final_layer.adaln_proj.linear.bias"}
    blk = ["norm1.weight", "norm2.weight", "attn.qkv_proj.weight", "attn.q_norm.weight", "attn.k_norm.weight",
           "attn.out_proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"]
    keys = set(top)
    for i in range(cfg["num_layers"]):
        keys |= {f"blocks.{i}.{s}" for s in blk + ["adaln_proj.linear.weight", "adaln_proj.linear.bias"]}
    for j in range(cfg["token_refiner_num_layers"]):
        keys |= {f"token_refiner.blocks.{j}.{s}" for s in blk}
    return keys


def test_comfy_file_inventory_shapes_dtypes(two_runs):
    a, *_ = two_runs
    h = read_header(a / C.COMFY_FILE)
    cfg = C.CONFIG
    assert set(h.tensors) == _expected_comfy_keys(cfg)
    hid, inner = 64, 96
    t = h.tensors
    assert t["blocks.0.attn.qkv_proj.weight"].shape == (3 * inner, hid)
    assert t["blocks.1.attn.out_proj.weight"].shape == (hid, inner)
    assert t["blocks.0.adaln_proj.linear.weight"].shape == (18 * hid, 32)
    assert t["final_layer.adaln_proj.linear.weight"].shape == (2 * hid, 32)
    assert t["video_patch_proj.weight"].shape == (hid, 96)
    assert t["final_layer.video_out.weight"].shape == (96, hid)
    assert t["final_layer.audio_out.weight"].shape == (32, hid)
    assert t["condition_proj.weight"].shape == (hid, 48)
    assert t["blocks.0.mlp.fc1.weight"].shape == (256, hid)
    assert t["rope.inv_freq"].shape == (4,)
    assert 6 * t["rope.inv_freq"].shape[0] <= t["blocks.0.attn.q_norm.weight"].shape[0]
    for k, ti in t.items():
        assert ti.dtype == ("F32" if k in FP32_KEYS_TOP else "BF16"), k
    inv = load_file(a / C.COMFY_FILE, keys=["rope.inv_freq"])["rope.inv_freq"]
    ref = torch.tensor([1.0 / 10000.0 ** (2 * i / 8) for i in range(4)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), ref, rtol=1e-6, atol=0)


def _read_sharded(folder, index_name):
    idx = json.loads((folder / index_name).read_text())
    sd = {}
    for shard in sorted(set(idx["weight_map"].values())):
        part = load_file(folder / shard)
        assert {k for k, v in idx["weight_map"].items() if v == shard} == set(part)
        sd.update(part)
    assert idx["metadata"]["total_size"] == _nbytes(sd)
    return sd


def test_official_deinterleaves_to_comfy_exactly(two_runs):
    a, *_ = two_runs
    comfy = load_file(a / C.COMFY_FILE)
    folder = a / C.OFFICIAL_DIR
    off = _read_sharded(folder, "model.safetensors.index.json")
    assert len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 2
    assert set(off) == set(comfy)
    cfg = json.loads((folder / "config.json").read_text())
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    assert (heads, hd, cfg["hidden_size"]) == (3, 32, 64)
    n_qkv = 0
    for k, v in off.items():
        assert v.dtype == comfy[k].dtype, k
        if k.endswith("attn.qkv_proj.weight"):
            n_qkv += 1
            q, kk, vv = [], [], []
            for h in range(heads):
                base = h * 3 * hd
                q.append(v[base:base + hd])
                kk.append(v[base + hd:base + 2 * hd])
                vv.append(v[base + 2 * hd:base + 3 * hd])
            deint = torch.cat(q + kk + vv, dim=0)
            assert torch.equal(deint, comfy[k]), k
            assert not torch.equal(v, comfy[k]), f"{k}: interleave must be visible with {heads} heads"
        else:
            assert torch.equal(v, comfy[k]), k
    assert n_qkv == 4  # 2 DiT blocks + 2 refiner blocks


def test_diffusers_layout_maps_back_to_comfy(two_runs):
    a, *_ = two_runs
    comfy = load_file(a / C.COMFY_FILE)
    d = _read_sharded(a / C.DIFFUSERS_DIR, "diffusion_pytorch_model.safetensors.index.json")
    assert "rope.inv_freq" not in d and not any(k.startswith(("blocks.", "video_patch_proj")) for k in d)
    assert len(d) == len(comfy) - 1 + 2 * 4
    torch.testing.assert_close(d["proj_in.weight"], comfy["video_patch_proj.weight"], rtol=0, atol=0)
    assert torch.equal(d["audio_proj_out.bias"], comfy["final_layer.audio_out.bias"])
    assert torch.equal(d["norm_out.linear.weight"], comfy["final_layer.adaln_proj.linear.weight"])
    assert torch.equal(d["time_embedder.linear_2.weight"], comfy["time_embedder.proj_out.weight"])
    for pre_d, pre_c in (("transformer_blocks.1.", "blocks.1."), ("token_refiner.refiner_blocks.0.", "token_refiner.blocks.0.")):
        qkv = torch.cat([d[pre_d + f"attn.to_{x}.weight"] for x in "qkv"], dim=0)
        assert torch.equal(qkv, comfy[pre_c + "attn.qkv_proj.weight"])
        fc = d[pre_d + "ff.net.0.proj.weight"]
        n = fc.shape[0] // 2
        assert torch.equal(torch.cat([fc[n:], fc[:n]]), comfy[pre_c + "mlp.fc1.weight"])
        assert torch.equal(d[pre_d + "attn.norm_q.weight"], comfy[pre_c + "attn.q_norm.weight"])
        assert torch.equal(d[pre_d + "attn.to_out.0.weight"], comfy[pre_c + "attn.out_proj.weight"])
        assert torch.equal(d[pre_d + "ff.net.2.weight"], comfy[pre_c + "mlp.fc2.weight"])
    cfg = json.loads((a / C.DIFFUSERS_DIR / "config.json").read_text())
    assert cfg["num_refiner_layers"] == 2 and cfg["in_channels"] == 24 and cfg["rope_freq_dim"] == 4


def test_curve_form(two_runs):
    a, *_ = two_runs
    comfy = load_file(a / C.COMFY_FILE)
    h = read_header(a / C.CURVE_FILE)
    t = h.tensors
    assert not any(k.startswith("time_embedder.") for k in t)
    assert t["adaln_t_table"].shape == (C.CURVE_GRID, C.CURVE_RANK) and t["adaln_t_table"].dtype == "F32"
    assert t["blocks.0.adaln_proj.linear.weight"].shape == (18 * 64, C.CURVE_RANK)
    assert t["blocks.0.adaln_proj.linear.weight"].dtype == "F16"
    assert t["final_layer.adaln_proj.linear.weight"].shape == (2 * 64, C.CURVE_RANK)
    assert t["final_layer.adaln_proj.linear.bias"].dtype == "F16"
    curve = load_file(a / C.CURVE_FILE)
    for k, v in curve.items():  # every non-AdaLN tensor byte-identical to the unpruned file
        if "adaln" not in k:
            assert torch.equal(v, comfy[k]), k


def test_curve_full_rank_reconstructs_adaln_exactly():
    """With rank = time_embed_dim the fold is exact: W' table(t) + b' == W silu(e(t)) + b (float64 oracle)."""
    base = C.base_state_dict()
    full = C.curve_state_dict(base, rank=32)
    tgrid = torch.linspace(0, 1, C.CURVE_GRID, dtype=torch.float64)
    half = 8
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    emb = torch.cat([torch.cos(tgrid[:, None] * freqs), torch.sin(tgrid[:, None] * freqs)], dim=-1)
    e = (torch.nn.functional.silu(emb @ base["time_embedder.proj_in.weight"].double().T
                                  + base["time_embedder.proj_in.bias"].double())
         @ base["time_embedder.proj_out.weight"].double().T + base["time_embedder.proj_out.bias"].double())
    for key in ("blocks.0.adaln_proj.linear", "final_layer.adaln_proj.linear"):
        ref = torch.nn.functional.silu(e) @ base[key + ".weight"].double().T + base[key + ".bias"].double()
        got = full["adaln_t_table"].double() @ full[key + ".weight"].double().T + full[key + ".bias"].double()
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 2e-3, (key, float(err))  # fp16 storage of W', b'


def test_fasth3_adds_only_gates(two_runs):
    a, *_ = two_runs
    h = read_header(a / C.FASTH3_FILE)
    base = read_header(a / C.COMFY_FILE)
    extra = set(h.tensors) - set(base.tensors)
    assert extra == {"blocks.0.attn.to_gate_compress.weight", "blocks.1.attn.to_gate_compress.weight"}
    assert h.tensors["blocks.0.attn.to_gate_compress.weight"].shape == (96, 64)
    assert h.tensors["blocks.0.attn.to_gate_compress.weight"].dtype == "BF16"
