"""Tiny structural LTX-2 audio-video DiT ("ltxav") checkpoint.

``ltx_dit`` -> ``diffusion_models/ltx2_tiny.safetensors``: the real LTX-2 transformer key names (video and audio
streams, a2v/v2a cross attention, AdaLN singles, text embedding connectors with learnable registers), bf16 like
the release, scaled down. ComfyUI's detector (``model_detection.py``: ``adaln_single.emb.timestep_embedder.
linear_1.bias`` + ``audio_adaln_single.linear.weight`` => ``ltxav``) only infers ``num_layers``,
``attention_head_dim`` (assuming 32 heads) and ``cross_attention_dim`` from shapes; the real files also carry
a ``config`` JSON in the safetensors ``__metadata__`` whose ``transformer`` entry overrides the detected
values. The tiny file uses that same mechanism to declare its small head counts/widths (:data:`CONFIG`).

Latent channels stay real (video 128, audio 8 channels x 16 mel bins = 128), so the stock
``EmptyLTXVLatentVideo`` / ``LTXVEmptyLatentAudio`` latents fit. Text conditioning: a raw
``[1, L, caption_channels]`` tensor (40 wide) goes through the connectors (``preprocess_text_embeds``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..loaders.safetensors_io import save_file
from .checkpoints import register

SEED = 20261131
LTX_FILE = "diffusion_models/ltx2_tiny.safetensors"

CONFIG: dict = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "cross_attention_dim": 32,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16,
    "caption_channels": 40,
    "connector_num_attention_heads": 2,
    "connector_attention_head_dim": 20,
    "connector_num_layers": 1,
    "in_channels": 128,
    "audio_in_channels": 128,
}
NUM_REGISTERS = 128   # Embeddings1DConnector learnable registers (ComfyUI default, kept real)
TIME_FREQ = 256       # sinusoid width of the timestep embedder (real)


def _lin(out, inp, bias=True, pfx=""):
    d = {pfx + "weight": (out, inp)}
    if bias:
        d[pfx + "bias"] = (out,)
    return d


def _attn(pfx, q_in, kv_in, inner, out_dim):
    d = {pfx + "q_norm.weight": (inner,), pfx + "k_norm.weight": (inner,)}
    d.update(_lin(inner, q_in, pfx=pfx + "to_q."))
    d.update(_lin(inner, kv_in, pfx=pfx + "to_k."))
    d.update(_lin(inner, kv_in, pfx=pfx + "to_v."))
    d.update(_lin(out_dim, inner, pfx=pfx + "to_out.0."))
    return d


def _ff(pfx, dim, mult=4):
    d = _lin(dim * mult, dim, pfx=pfx + "net.0.proj.")
    d.update(_lin(dim, dim * mult, pfx=pfx + "net.2."))
    return d


def _adaln_single(pfx, dim, coeff):
    d = _lin(dim, TIME_FREQ, pfx=pfx + "emb.timestep_embedder.linear_1.")
    d.update(_lin(dim, dim, pfx=pfx + "emb.timestep_embedder.linear_2."))
    d.update(_lin(coeff * dim, dim, pfx=pfx + "linear."))
    return d


def _connector(pfx, cfg):
    dim = cfg["connector_num_attention_heads"] * cfg["connector_attention_head_dim"]
    d = {pfx + "learnable_registers": (NUM_REGISTERS, dim)}
    for i in range(cfg["connector_num_layers"]):
        b = f"{pfx}transformer_1d_blocks.{i}."
        d.update(_attn(b + "attn1.", dim, dim, dim, dim))
        d.update(_ff(b + "ff.", dim))
    return d


def ltxav_shapes(cfg=CONFIG) -> dict[str, tuple[int, ...]]:
    """Key -> shape of an LTX-2 AV transformer (ComfyUI / release names, no ``model.diffusion_model.`` prefix)."""
    v = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    a = cfg["audio_num_attention_heads"] * cfg["audio_attention_head_dim"]
    cap = cfg["caption_channels"]
    s: dict[str, tuple[int, ...]] = {"scale_shift_table": (2, v), "audio_scale_shift_table": (2, a)}
    s.update(_lin(v, cfg["in_channels"], pfx="patchify_proj."))
    s.update(_adaln_single("adaln_single.", v, 6))
    s.update(_lin(v, cap, pfx="caption_projection.linear_1."))
    s.update(_lin(v, v, pfx="caption_projection.linear_2."))
    s.update(_lin(a, cfg["audio_in_channels"], pfx="audio_patchify_proj."))
    s.update(_adaln_single("audio_adaln_single.", a, 6))
    s.update(_adaln_single("av_ca_video_scale_shift_adaln_single.", v, 4))
    s.update(_adaln_single("av_ca_a2v_gate_adaln_single.", v, 1))
    s.update(_adaln_single("av_ca_audio_scale_shift_adaln_single.", a, 4))
    s.update(_adaln_single("av_ca_v2a_gate_adaln_single.", a, 1))
    s.update(_lin(a, cap, pfx="audio_caption_projection.linear_1."))
    s.update(_lin(a, a, pfx="audio_caption_projection.linear_2."))
    s.update(_connector("audio_embeddings_connector.", cfg))
    s.update(_connector("video_embeddings_connector.", cfg))
    for i in range(cfg["num_layers"]):
        b = f"transformer_blocks.{i}."
        s[b + "scale_shift_table"] = (6, v)
        s[b + "audio_scale_shift_table"] = (6, a)
        s[b + "scale_shift_table_a2v_ca_audio"] = (5, a)
        s[b + "scale_shift_table_a2v_ca_video"] = (5, v)
        s.update(_attn(b + "attn1.", v, v, v, v))
        s.update(_attn(b + "audio_attn1.", a, a, a, a))
        s.update(_attn(b + "attn2.", v, cfg["cross_attention_dim"], v, v))
        s.update(_attn(b + "audio_attn2.", a, cfg["audio_cross_attention_dim"], a, a))
        s.update(_attn(b + "audio_to_video_attn.", v, a, a, v))
        s.update(_attn(b + "video_to_audio_attn.", a, v, a, a))
        s.update(_ff(b + "ff.", v))
        s.update(_ff(b + "audio_ff.", a))
    s.update(_lin(cfg["in_channels"], v, pfx="proj_out."))
    s.update(_lin(cfg["audio_in_channels"], a, pfx="audio_proj_out."))
    return s


def ltxav_state_dict(cfg=CONFIG, seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator("cpu").manual_seed(seed)
    out = {}
    for key, shape in sorted(ltxav_shapes(cfg).items()):
        if key.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif key.endswith(".bias") or "scale_shift_table" in key:
            t = 0.02 * torch.randn(shape, generator=g)
        elif key.endswith("learnable_registers"):
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        out[key] = t.to(torch.bfloat16).contiguous()
    return out


@register("ltx_dit")
def gen_ltx_dit(out: Path) -> list[Path]:
    p = Path(out) / LTX_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(ltxav_state_dict(), p, metadata={"config": json.dumps({"transformer": CONFIG}, sort_keys=True)})
    return [p]
