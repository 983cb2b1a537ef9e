"""Tiny LTX-2 AV DiT checkpoint: determinism, detection keys, metadata config, dtypes."""
from __future__ import annotations

import hashlib
import json

from ditkit.loaders.safetensors_io import read_header
from ditkit.tiny import ckpt_ltx as L
from ditkit.tiny.checkpoints import generate_all


def test_ltx_tiny_deterministic_and_detectable(tmp_path):
    a = generate_all(tmp_path / "a", only=["ltx_dit"])["ltx_dit"]
    b = generate_all(tmp_path / "b", only=["ltx_dit"])["ltx_dit"]
    assert [p.relative_to(tmp_path / "a") for p in a] == [p.relative_to(tmp_path / "b") for p in b]
    assert str(a[0].relative_to(tmp_path / "a")) == "diffusion_models/ltx2_tiny.safetensors"
    assert hashlib.sha256(a[0].read_bytes()).hexdigest() == hashlib.sha256(b[0].read_bytes()).hexdigest()
    h = read_header(a[0])
    t = h.tensors
    # the keys ComfyUI's detector keys on (ltxav = LTX-2 audio-video)
    assert "adaln_single.emb.timestep_embedder.linear_1.bias" in t
    assert "audio_adaln_single.linear.weight" in t
    assert "keyframes_abs_pos_embedding" not in t
    assert sum(1 for k in t if k.startswith("transformer_blocks.") and k.endswith(".attn1.to_q.weight")) == 2
    assert t["transformer_blocks.0.attn2.to_k.weight"].shape == (32, 32)
    assert t["patchify_proj.weight"].shape == (32, 128) and t["audio_patchify_proj.weight"].shape == (16, 128)
    assert t["proj_out.weight"].shape == (128, 32) and t["audio_proj_out.weight"].shape == (128, 16)
    assert t["adaln_single.linear.weight"].shape == (6 * 32, 32)
    assert all(ti.dtype == "BF16" for ti in t.values())
    assert len(t) == 228
    cfg = json.loads(h.metadata["config"])["transformer"]
    assert cfg["num_attention_heads"] * cfg["attention_head_dim"] == t["transformer_blocks.0.attn1.to_q.weight"].shape[0]
    assert cfg == L.CONFIG
