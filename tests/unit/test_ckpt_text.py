"""Tiny text-encoder checkpoints: names, determinism, key inventory, detection keys, sizes (no ComfyUI)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from ditkit.loaders.safetensors_io import load_file, read_header
from ditkit.tiny import ckpt_text
from ditkit.tiny.checkpoints import GENERATORS, generate_all


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    a = generate_all(tmp_path_factory.mktemp("te_a"), only=["h3_te", "ltx_te"])
    b = generate_all(tmp_path_factory.mktemp("te_b"), only=["h3_te", "ltx_te"])
    return a, b


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_registered_named_and_byte_identical(two_runs):
    a, b = two_runs
    assert {"h3_te", "ltx_te"} <= set(GENERATORS)
    assert a["h3_te"][0].as_posix().endswith("text_encoders/qwen3vl_tiny_minimax_h3.safetensors")
    assert a["ltx_te"][0].as_posix().endswith("text_encoders/gemma_tiny_ltx.safetensors")
    for k in ("h3_te", "ltx_te"):
        assert _sha(a[k][0]) == _sha(b[k][0])


def test_h3_te_inventory(two_runs):
    h = read_header(two_runs[0]["h3_te"][0])
    t = h.tensors
    # ComfyUI detection keys (comfy/sd.py detect_te_model -> QWEN3VL_32B)
    assert "visual.deepstack_merger_list.0.norm.weight" in t
    assert "model.layers.49.self_attn.q_proj.weight" in t
    assert "model.layers.50.self_attn.q_proj.weight" not in t
    assert "model.norm.weight" not in t and "lm_head.weight" not in t  # truncated at layer 50, no final norm
    assert t["model.embed_tokens.weight"].shape == (151936, 48)      # real vocab x tiny DiT text_dim
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (128, 48)
    assert t["model.layers.0.self_attn.k_norm.weight"].shape == (128,)
    assert t["model.layers.7.mlp.down_proj.weight"].shape == (48, 96)
    assert t["visual.deepstack_merger_list.2.norm.bias"].shape == (4608,)
    per_layer = {k.split(".", 3)[3] for k in t if k.startswith("model.layers.0.")}
    assert per_layer == {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                         "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert {v.dtype for v in t.values()} == {"BF16"}
    assert t["model.embed_tokens.weight"].nbytes == 151936 * 48 * 2 <= 20 * 2**20


def test_h3_te_text_dim_matches_tiny_dit():
    from ditkit.tiny import ckpt_h3

    assert ckpt_text.H3_TE_CONFIG["hidden_size"] == ckpt_h3.CONFIG["text_dim"]


def test_ltx_te_inventory_and_tokenizer(two_runs):
    path = two_runs[0]["ltx_te"][0]
    t = read_header(path).tensors
    assert "model.layers.47.self_attn.q_norm.weight" in t and "model.layers.48.self_attn.q_norm.weight" not in t
    assert "model.layers.0.post_feedforward_layernorm.weight" in t
    assert "model.layers.5.self_attn.v_proj.weight" in t     # rules out ComfyUI's Gemma-4-12B branch
    assert t["text_embedding_projection.aggregate_embed.weight"].shape == (40, 49 * 32)
    assert t["spiece_model"].dtype == "U8"
    from ditkit.tiny import ckpt_ltx

    assert ckpt_ltx.CONFIG["caption_channels"] == 40
    spm = pytest.importorskip("sentencepiece")
    raw = load_file(path, keys=["spiece_model"])["spiece_model"]
    sp = spm.SentencePieceProcessor(model_proto=raw.numpy().tobytes())
    assert sp.get_piece_size() == t["model.embed_tokens.weight"].shape[0] == 320
    assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (0, 1, 2, 3)
    ids = sp.encode("a red fox in Tokyo! 東京")
    assert ids and max(ids) < 320 and sp.decode(ids) == "a red fox in Tokyo! 東京"  # byte fallback round-trips


def test_weights_finite_and_not_degenerate(two_runs):
    sd = load_file(two_runs[0]["h3_te"][0], keys=["model.layers.3.self_attn.q_proj.weight",
                                                  "model.embed_tokens.weight"])
    for v in sd.values():
        f = v.float()
        assert torch.isfinite(f).all() and f.std() > 0
