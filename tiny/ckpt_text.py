"""Tiny text-encoder checkpoints with ComfyUI's real key names.

``h3_te`` -> ``text_encoders/qwen3vl_tiny_minimax_h3.safetensors``: a Qwen3-VL-style decoder truncated like the
release (50 layers, no final norm, no lm_head) at hidden width 48 = the tiny H3 DiT's ``text_dim``
(``tiny/ckpt_h3.py``). Keys: ``model.embed_tokens.weight``, ``model.layers.N.{input_layernorm,
post_attention_layernorm}.weight``, ``model.layers.N.self_attn.{q,k,v,o}_proj.weight``,
``model.layers.N.self_attn.{q,k}_norm.weight``, ``model.layers.N.mlp.{gate,up,down}_proj.weight`` and the
DeepStack merger norms ``visual.deepstack_merger_list.{0,1,2}.norm.{weight,bias}`` (``[4608]``, the real
merge width, which ComfyUI's fixed-size vision tower expects). ComfyUI's detector needs exactly
``visual.deepstack_merger_list.0.norm.weight`` + ``model.layers.49.self_attn.q_proj.weight`` (=> QWEN3VL_32B,
CLIPLoader type ``minimax``). Choices, and why:

* 50 layers: detection keys on layer 49, and the release is truncated at 50.
* head_dim stays 128 (a class constant of ComfyUI's Qwen3 config, not overridable), 1 query and 1 KV head.
* vocab stays the real 151,936 rows: the stock ``qwen25_tokenizer`` (ids up to 151,668 incl. special
  tokens) must index it. At width 48 in bf16 the table is 151936*48*2 = 14.6 MB, the largest tensor; the
  layers total < 1 MB. That table is also what the layerwise streamer's host-resident embedding is about.
* the vision tower is NOT included (ComfyUI's Qwen3-VL-32B vision config is fixed at 27 x 1152 wide; only the
  detection norms are stored), so image/video prompts through this tiny encoder are not meaningful.

The stock CLIPLoader builds the fixed 5120-wide Qwen3-VL-32B config and cannot load this file; ditkit's
``DitKitH3TextEncoderLoader`` reads the widths from the file and builds the same stock ComfyUI CLIP object with
them (``model_options["qwen3vl_32b_model_config"]``).

``ltx_te`` -> ``text_encoders/gemma_tiny_ltx.safetensors``: a Gemma-3-12B-style decoder (48 layers — ComfyUI
keys GEMMA_3_12B on ``model.layers.47.self_attn.q_norm.weight`` + ``post_feedforward_layernorm``, and on
``v_proj`` being present, which rules out Gemma 4), hidden 32, head_dim 256 (fixed in ComfyUI's config), final
``model.norm``, the LTX-2 text projection ``text_embedding_projection.aggregate_embed.weight``
``[40, 49*32]`` (40 = the tiny LTX DiT's ``caption_channels``, ``tiny/ckpt_ltx.py``) and a SentencePiece
tokenizer stored under the ``spiece_model`` key as uint8 bytes (how ComfyUI reads Gemma's tokenizer). The
tokenizer is a tiny BPE model (320 pieces, byte fallback, Gemma's special ids pad 0 / eos 1 / bos 2 / unk 3)
trained deterministically on a fixed corpus, so the vocab (and the embedding) has 320 rows.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

from .checkpoints import register
from .checkpoints import write_one as _write

H3_TE_FILE = "text_encoders/qwen3vl_tiny_minimax_h3.safetensors"
LTX_TE_FILE = "text_encoders/gemma_tiny_ltx.safetensors"
SEED_H3 = 20261201
SEED_LTX = 20261202

H3_TE_CONFIG = {"hidden_size": 48, "num_hidden_layers": 50, "num_attention_heads": 1, "num_key_value_heads": 1,
                "intermediate_size": 96, "vocab_size": 151936, "head_dim": 128}
DEEPSTACK_MERGE_DIM = 1152 * 4     # ComfyUI's fixed Qwen3-VL-32B vision width x spatial_merge**2
LTX_TE_CONFIG = {"hidden_size": 32, "num_hidden_layers": 48, "num_attention_heads": 1, "num_key_value_heads": 1,
                 "intermediate_size": 64, "vocab_size": 320, "head_dim": 256}
LTX_CAPTION_CHANNELS = 40

_CORPUS = [
    "a red fox jumps over the lazy dog in the snow",
    "the quick brown cat sleeps in the warm afternoon sun",
    "video of a city street at night with rain, neon lights and reflections",
    "a woman says hello and waves at the camera, birds sing in the background",
    "close-up of a steaming cup of coffee on a wooden table, soft morning light",
    "an astronaut walks slowly on the moon; dust rises around the boots",
] * 8


def _randn(g, shape, std):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(torch.bfloat16)


def _norm(g, n):
    return (1.0 + 0.05 * torch.randn(n, generator=g, dtype=torch.float32)).to(torch.bfloat16)


def _layers(g, cfg, gemma: bool) -> dict[str, torch.Tensor]:
    h, hd, nh, nkv, ff = (cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"],
                          cfg["num_key_value_heads"], cfg["intermediate_size"])
    sd = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm(g, h) if not gemma else _randn(g, (h,), 0.05)
        sd[p + "post_attention_layernorm.weight"] = _norm(g, h) if not gemma else _randn(g, (h,), 0.05)
        if gemma:
            sd[p + "pre_feedforward_layernorm.weight"] = _randn(g, (h,), 0.05)
            sd[p + "post_feedforward_layernorm.weight"] = _randn(g, (h,), 0.05)
        sd[p + "self_attn.q_proj.weight"] = _randn(g, (nh * hd, h), h ** -0.5)
        sd[p + "self_attn.k_proj.weight"] = _randn(g, (nkv * hd, h), h ** -0.5)
        sd[p + "self_attn.v_proj.weight"] = _randn(g, (nkv * hd, h), h ** -0.5)
        sd[p + "self_attn.o_proj.weight"] = _randn(g, (h, nh * hd), 0.3 * (nh * hd) ** -0.5)
        sd[p + "self_attn.q_norm.weight"] = _norm(g, hd) if not gemma else _randn(g, (hd,), 0.05)
        sd[p + "self_attn.k_norm.weight"] = _norm(g, hd) if not gemma else _randn(g, (hd,), 0.05)
        sd[p + "mlp.gate_proj.weight"] = _randn(g, (ff, h), h ** -0.5)
        sd[p + "mlp.up_proj.weight"] = _randn(g, (ff, h), h ** -0.5)
        sd[p + "mlp.down_proj.weight"] = _randn(g, (h, ff), 0.3 * ff ** -0.5)
    return sd


def h3_te_state_dict(cfg=H3_TE_CONFIG, seed: int = SEED_H3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": _randn(g, (cfg["vocab_size"], cfg["hidden_size"]), 1.0)}
    sd.update(_layers(g, cfg, gemma=False))
    for j in range(3):
        sd[f"visual.deepstack_merger_list.{j}.norm.weight"] = _norm(g, DEEPSTACK_MERGE_DIM)
        sd[f"visual.deepstack_merger_list.{j}.norm.bias"] = _randn(g, (DEEPSTACK_MERGE_DIM,), 0.01)
    return sd


def spiece_model_bytes(vocab: int = LTX_TE_CONFIG["vocab_size"]) -> bytes:
    """A tiny deterministic SentencePiece BPE model (Gemma special ids) trained on a fixed corpus."""
    import sentencepiece as spm

    f = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_CORPUS), model_writer=f, vocab_size=vocab,
                                   model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3, byte_fallback=True,
                                   num_threads=1, character_coverage=1.0, minloglevel=2, hard_vocab_limit=False)
    return f.getvalue()


def ltx_te_state_dict(cfg=LTX_TE_CONFIG, seed: int = SEED_LTX) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    sd = {"model.embed_tokens.weight": _randn(g, (cfg["vocab_size"], h), 0.5)}
    sd.update(_layers(g, cfg, gemma=True))
    sd["model.norm.weight"] = _randn(g, (h,), 0.05)
    sd["text_embedding_projection.aggregate_embed.weight"] = _randn(
        g, (LTX_CAPTION_CHANNELS, h * (cfg["num_hidden_layers"] + 1)), (h * (cfg["num_hidden_layers"] + 1)) ** -0.5)
    sd["spiece_model"] = torch.frombuffer(bytearray(spiece_model_bytes(cfg["vocab_size"])), dtype=torch.uint8)
    return sd


@register("h3_te")
def gen_h3_te(out: Path) -> list[Path]:
    return _write(out, H3_TE_FILE, h3_te_state_dict())


@register("ltx_te")
def gen_ltx_te(out: Path) -> list[Path]:
    return _write(out, LTX_TE_FILE, ltx_te_state_dict())
