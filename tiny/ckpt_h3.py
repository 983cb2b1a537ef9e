"""Tiny structural MiniMax H3 DiT checkpoints (real key names, layouts and dtypes, scaled down).

All variants derive from ONE seeded set of base weights (:func:`base_state_dict`, ComfyUI layout) so the
layouts are comparable tensor by tensor:

* ``h3_dit``           -> ``diffusion_models/h3_tiny_comfy.safetensors``: ComfyUI/Comfy-Org layout, qkv rows
  ``[q_all; k_all; v_all]`` (what the stock ``UNETLoader`` reads).
* ``h3_dit_official``  -> ``diffusion_models/h3_tiny_official/``: the official FL2VA ``transformer/`` layout,
  ``model.safetensors.index.json`` + 2 shards ``model-0000X-of-00002.safetensors`` + ``config.json``;
  qkv rows per-head interleaved ``[h0: q,k,v; h1: q,k,v; ...]`` (DiT blocks AND refiner blocks).
* ``h3_dit_diffusers`` -> ``diffusion_models/h3_tiny_diffusers/``: diffusers names, 3 shards
  ``diffusion_pytorch_model-0000X-of-00003.safetensors`` + index + ``config.json``; ``to_q/to_k/to_v`` split,
  ``ff.net.0.proj`` halves swapped to ``[value; gate]``, ``rope.inv_freq`` dropped.
* ``h3_dit_curve``     -> ``diffusion_models/h3_tiny_curve.safetensors``: Comfy-Org "pruned" AdaLN curve form
  (``adaln_t_table [GRID, K]`` F32, AdaLN weights ``[18*hidden, K]`` / ``[2*hidden, K]`` F16, no
  ``time_embedder``), built from the base weights as ``table = U_K*S_K`` of the centred ``silu(e(t))`` curve,
  ``W' = W V_K``, ``b' = b + W mean(silu(e))``.
* ``h3_dit_fasth3``    -> ``diffusion_models/h3_tiny_fasth3.safetensors``: ComfyUI layout + trained-gate stand-ins
  ``blocks.N.attn.to_gate_compress.weight [inner, hidden]`` (FastH3 VSA checkpoints).
* ``h3_dit_fasth3_v2`` -> ``diffusion_models/h3_tiny_fasth3_v2/``: a FastVideo FastH3 8-Step V2 export layout: the
  same gated weights in diffusers names under ``transformer/`` (2 shards + index + ``config.json``) and, at the export
  root, the release's ``fastvideo_inference.json`` (the fields vllm-omni ``FastH3CheckpointSpec.from_metadata``
  requires: V2 rungs, shifts 10 / 3, ``VIDEO_SPARSE_ATTN_H3`` at sparsity 0.8, tile 64) and a ``provenance.json``
  (``model_id``, ``base_model`` pinning an H3 revision). The weights are tiny stand-ins, not the release.

Dtypes follow the official bf16 release: fp32 islands ``video_patch_proj``, ``audio_patch_proj``,
``time_embedder``, ``final_layer.video_out``/``audio_out`` and ``rope.inv_freq``; bf16 everywhere else.
ComfyUI casts them to its compute dtype (fp32 on CPU) at load, so CPU sampling is unaffected.

``text_dim`` is 48 (the diffusers fixture's value) = the hidden width of the tiny H3 text encoder
(``text_encoders/qwen3vl_tiny_minimax_h3.safetensors``, loaded by ``DitKitH3TextEncoderLoader``). The stock
``LotusConditioning`` ([1, 2, 1024]) does NOT fit it; in-process tests build
``[[torch.randn(1, L, CONFIG["text_dim"]), {}]]``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..loaders.safetensors_io import save_file
from .checkpoints import register

SEED = 20261130

# tiny config (original/ComfyUI names). heads*head_dim (96) != hidden (64) like the real 7168 != 5376;
# 6*rope_inv_freq_len (24) <= head_dim (32).
CONFIG: dict = {
    "hidden_size": 64,
    "num_attention_heads": 3,
    "attention_head_dim": 32,
    "num_layers": 2,
    "token_refiner_num_layers": 2,
    "ffn_hidden_size": 128,
    "latents_dim": 24,
    "audio_latents_dim": 32,
    "patch_size": [1, 2, 2],
    "text_dim": 48,  # = the tiny H3 text encoder's width (tiny/ckpt_text.py: qwen3vl_tiny_minimax_h3)
    "timestep_input_dim": 16,
    "time_embed_hidden_size": 64,
    "time_embed_dim": 32,
    "rope_inv_freq_len": 4,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "qk_norm_eps": 1e-5,
    "final_norm_eps": 1e-5,
}
CURVE_GRID = 65
CURVE_RANK = 8

COMFY_FILE = "diffusion_models/h3_tiny_comfy.safetensors"
OFFICIAL_DIR = "diffusion_models/h3_tiny_official"
DIFFUSERS_DIR = "diffusion_models/h3_tiny_diffusers"
CURVE_FILE = "diffusion_models/h3_tiny_curve.safetensors"
FASTH3_FILE = "diffusion_models/h3_tiny_fasth3.safetensors"
FASTH3_V2_DIR = "diffusion_models/h3_tiny_fasth3_v2"     # load "h3_tiny_fasth3_v2/transformer"
FASTH3_V2_MODEL_ID = "FastVideo/FastVideo-FastH3-8-Step-V2"

FP32_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                 "final_layer.audio_out.", "rope.")


def inner_dim(cfg=CONFIG) -> int:
    return cfg["num_attention_heads"] * cfg["attention_head_dim"]


def rope_inv_freq(n: int, theta: float = 10000.0) -> torch.Tensor:
    """``1/theta^(arange(0, 2n, 2)/(2n))`` in fp32 (the real file: n = 16)."""
    return 1.0 / (theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


def _block_shapes(cfg, adaln: bool) -> dict[str, tuple[int, ...]]:
    h, hd, inner, ffn = cfg["hidden_size"], cfg["attention_head_dim"], inner_dim(cfg), cfg["ffn_hidden_size"]
    d = {
        "norm1.weight": (h,), "norm2.weight": (h,),
        "attn.qkv_proj.weight": (3 * inner, h),
        "attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,),
        "attn.out_proj.weight": (h, inner),
        "mlp.fc1.weight": (2 * ffn, h), "mlp.fc2.weight": (h, ffn),
    }
    if adaln:
        d["adaln_proj.linear.weight"] = (18 * h, cfg["time_embed_dim"])
        d["adaln_proj.linear.bias"] = (18 * h,)
    return d


def comfy_shapes(cfg=CONFIG) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the ComfyUI/original layout (h3.md §2.6 A), scaled by ``cfg``."""
    h = cfg["hidden_size"]
    vdim = cfg["latents_dim"] * math.prod(cfg["patch_size"])
    s: dict[str, tuple[int, ...]] = {
        "video_patch_proj.weight": (h, vdim), "video_patch_proj.bias": (h,),
        "audio_patch_proj.weight": (h, cfg["audio_latents_dim"]), "audio_patch_proj.bias": (h,),
        "condition_proj.weight": (h, cfg["text_dim"]), "condition_proj.bias": (h,),
        "time_embedder.proj_in.weight": (cfg["time_embed_hidden_size"], cfg["timestep_input_dim"]),
        "time_embedder.proj_in.bias": (cfg["time_embed_hidden_size"],),
        "time_embedder.proj_out.weight": (cfg["time_embed_dim"], cfg["time_embed_hidden_size"]),
        "time_embedder.proj_out.bias": (cfg["time_embed_dim"],),
        "rope.inv_freq": (cfg["rope_inv_freq_len"],),
        "token_refiner.final_norm.weight": (h,),
        "final_layer.norm.weight": (h,),
        "final_layer.adaln_proj.linear.weight": (2 * h, cfg["time_embed_dim"]),
        "final_layer.adaln_proj.linear.bias": (2 * h,),
        "final_layer.video_out.weight": (vdim, h), "final_layer.video_out.bias": (vdim,),
        "final_layer.audio_out.weight": (cfg["audio_latents_dim"], h),
        "final_layer.audio_out.bias": (cfg["audio_latents_dim"],),
    }
    for i in range(cfg["num_layers"]):
        for k, v in _block_shapes(cfg, True).items():
            s[f"blocks.{i}.{k}"] = v
    for j in range(cfg["token_refiner_num_layers"]):
        for k, v in _block_shapes(cfg, False).items():
            s[f"token_refiner.blocks.{j}.{k}"] = v
    return s


def dtype_for(key: str) -> torch.dtype:
    return torch.float32 if key.startswith(FP32_PREFIXES) else torch.bfloat16


def base_state_dict(cfg=CONFIG, seed: int = SEED) -> dict[str, torch.Tensor]:
    """The one seeded set of weights (ComfyUI layout, real dtypes). Deterministic on any machine (CPU RNG)."""
    g = torch.Generator("cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in sorted(comfy_shapes(cfg).items()):
        if key == "rope.inv_freq":
            t = rope_inv_freq(shape[0], cfg["rope_theta"])
        elif key.endswith("norm.weight") or key.endswith("norm1.weight") or key.endswith("norm2.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float32)
        elif key.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g, dtype=torch.float32)
        else:
            fan_in = shape[1]
            std = 0.5 / math.sqrt(fan_in) if "adaln_proj" in key else 1.0 / math.sqrt(fan_in)
            t = std * torch.randn(shape, generator=g, dtype=torch.float32)
        out[key] = t.to(dtype_for(key)).contiguous()
    return out


# ---------------------------------------------------------------- layout transforms (generator side)

def interleave_qkv(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """ComfyUI ``[q_all; k_all; v_all]`` rows -> official per-head interleaved ``[h0:q,k,v; h1:q,k,v; ...]``."""
    q, k, v = w.reshape(3, heads, head_dim, w.shape[-1]).unbind(0)
    return torch.stack([q, k, v], dim=1).reshape(3 * heads * head_dim, w.shape[-1]).contiguous()


def official_state_dict(base: dict[str, torch.Tensor], cfg=CONFIG) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in base.items():
        if k.endswith("attn.qkv_proj.weight"):
            v = interleave_qkv(v, cfg["num_attention_heads"], cfg["attention_head_dim"])
        out[k] = v
    return out


_DIFFUSERS_TOP = {
    "video_patch_proj.": "proj_in.",
    "audio_patch_proj.": "audio_proj_in.",
    "condition_proj.": "context_embedder.",
    "time_embedder.proj_in.": "time_embedder.linear_1.",
    "time_embedder.proj_out.": "time_embedder.linear_2.",
    "final_layer.norm.": "norm_out.norm.",
    "final_layer.adaln_proj.linear.": "norm_out.linear.",
    "final_layer.video_out.": "proj_out.",
    "final_layer.audio_out.": "audio_proj_out.",
    "token_refiner.final_norm.": "token_refiner.final_norm.",
}
_DIFFUSERS_BLOCK = {
    "attn.q_norm.weight": "attn.norm_q.weight",
    "attn.k_norm.weight": "attn.norm_k.weight",
    "attn.out_proj.weight": "attn.to_out.0.weight",
    "mlp.fc1.weight": "ff.net.0.proj.weight",
    "mlp.fc2.weight": "ff.net.2.weight",
    "attn.to_gate_compress.weight": "attn.to_gate_compress.weight",
    "norm1.weight": "norm1.weight",
    "norm2.weight": "norm2.weight",
    "adaln_proj.linear.weight": "adaln_proj.linear.weight",
    "adaln_proj.linear.bias": "adaln_proj.linear.bias",
}


def diffusers_state_dict(base: dict[str, torch.Tensor], cfg=CONFIG) -> dict[str, torch.Tensor]:
    """h3.md §2.6 B: rename, split qkv into to_q/to_k/to_v, swap fc1 halves, drop rope.inv_freq."""
    inner = inner_dim(cfg)
    out = {}
    for k, v in base.items():
        if k == "rope.inv_freq":
            continue
        if k.startswith("token_refiner.blocks."):
            j, rest = k[len("token_refiner.blocks."):].split(".", 1)
            prefix = f"token_refiner.refiner_blocks.{j}."
        elif k.startswith("blocks."):
            i, rest = k[len("blocks."):].split(".", 1)
            prefix = f"transformer_blocks.{i}."
        else:
            for a, b in _DIFFUSERS_TOP.items():
                if k.startswith(a):
                    out[b + k[len(a):]] = v
                    break
            else:
                raise KeyError(k)
            continue
        if rest == "attn.qkv_proj.weight":
            q, kk, vv = v.split(inner, dim=0)
            out[prefix + "attn.to_q.weight"] = q.contiguous()
            out[prefix + "attn.to_k.weight"] = kk.contiguous()
            out[prefix + "attn.to_v.weight"] = vv.contiguous()
        elif rest == "mlp.fc1.weight":
            gate, value = v.chunk(2, dim=0)
            out[prefix + _DIFFUSERS_BLOCK[rest]] = torch.cat([value, gate], dim=0).contiguous()
        else:
            out[prefix + _DIFFUSERS_BLOCK[rest]] = v
    return out


def _time_embed(base, t: torch.Tensor, cfg=CONFIG) -> torch.Tensor:
    """Float64 reference of the H3 time embedder (cos before sin, t in [0, 1], not x1000)."""
    half = cfg["timestep_input_dim"] // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    args = t.to(torch.float64)[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    w1, b1 = base["time_embedder.proj_in.weight"].double(), base["time_embedder.proj_in.bias"].double()
    w2, b2 = base["time_embedder.proj_out.weight"].double(), base["time_embedder.proj_out.bias"].double()
    return torch.nn.functional.silu(emb @ w1.T + b1) @ w2.T + b2


def curve_state_dict(base: dict[str, torch.Tensor], cfg=CONFIG, grid: int = CURVE_GRID,
                     rank: int = CURVE_RANK) -> dict[str, torch.Tensor]:
    """Comfy-Org "pruned" curve form (h3.md §2.9), computed in float64 from the base weights."""
    t = torch.linspace(0.0, 1.0, grid, dtype=torch.float64)
    s = torch.nn.functional.silu(_time_embed(base, t, cfg))          # [grid, time_embed_dim]
    mean = s.mean(dim=0)
    u, sv, vh = torch.linalg.svd(s - mean, full_matrices=False)
    table = u[:, :rank] * sv[:rank]                                   # [grid, rank]
    vk = vh[:rank].T                                                  # [time_embed_dim, rank]
    out = {k: v for k, v in base.items() if not k.startswith("time_embedder.")}
    out["adaln_t_table"] = table.to(torch.float32).contiguous()
    for k in [k for k in base if k.endswith("adaln_proj.linear.weight")]:
        w = base[k].double()
        b = base[k[:-len("weight")] + "bias"].double()
        out[k] = (w @ vk).to(torch.float16).contiguous()
        out[k[:-len("weight")] + "bias"] = (b + w @ mean).to(torch.float16).contiguous()
    return out


def fasth3_state_dict(base: dict[str, torch.Tensor], cfg=CONFIG, seed: int = SEED + 1) -> dict[str, torch.Tensor]:
    g = torch.Generator("cpu").manual_seed(seed)
    out = dict(base)
    h, inner = cfg["hidden_size"], inner_dim(cfg)
    for i in range(cfg["num_layers"]):
        w = torch.randn((inner, h), generator=g, dtype=torch.float32) / math.sqrt(h)
        out[f"blocks.{i}.attn.to_gate_compress.weight"] = w.to(torch.bfloat16)
    return out


def fasth3_v2_contract() -> dict:
    """The V2 release's ``fastvideo_inference.json`` fields (vllm-omni ``fasth3_checkpoint.py`` required set)."""
    return {"schema_version": "fasth3-inference-contract-v1", "model_id": FASTH3_V2_MODEL_ID,
            "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125], "num_inference_steps": 9,
            "transformer_forwards": 8, "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0,
            "guidance_scale": 1.0, "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8,
            "vsa_tile_size": 64, "task": "t2av"}


def fasth3_v2_provenance() -> dict:
    return {"model_id": FASTH3_V2_MODEL_ID, "base_model": "hf://MiniMaxAI/MiniMax-H3@ditkit-tiny",
            "note": "ditkit tiny stand-in with the release's layout, not its weights"}


def official_config(cfg=CONFIG) -> dict:
    """``config.json`` of the official original format (h3.md §2.1, original names)."""
    c = {k: v for k, v in cfg.items() if k != "rope_theta"}
    c["adaln_out_features"] = 18 * cfg["hidden_size"]
    c["final_adaln_out_features"] = 2 * cfg["hidden_size"]
    return c


def diffusers_config(cfg=CONFIG) -> dict:
    return {
        "_class_name": "MiniMaxH3Transformer3DModel",
        "_diffusers_version": "0.37.0.dev0",
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "attention_head_dim": cfg["attention_head_dim"],
        "num_layers": cfg["num_layers"],
        "num_refiner_layers": cfg["token_refiner_num_layers"],
        "ffn_dim": cfg["ffn_hidden_size"],
        "in_channels": cfg["latents_dim"],
        "audio_in_channels": cfg["audio_latents_dim"],
        "patch_size": list(cfg["patch_size"]),
        "text_dim": cfg["text_dim"],
        "freq_dim": cfg["timestep_input_dim"],
        "time_embed_hidden_dim": cfg["time_embed_hidden_size"],
        "time_embed_dim": cfg["time_embed_dim"],
        "rope_freq_dim": cfg["rope_inv_freq_len"],
        "rope_theta": cfg["rope_theta"],
        "norm_eps": cfg["norm_eps"],
        "qk_norm_eps": cfg["qk_norm_eps"],
        "final_norm_eps": cfg["final_norm_eps"],
    }


# ---------------------------------------------------------------- writers

def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _shard_plan(keys: list[str], n: int) -> list[list[str]]:
    """Deterministic split of sorted keys into ``n`` contiguous, non-empty groups."""
    keys = sorted(keys)
    size = math.ceil(len(keys) / n)
    return [keys[i * size:(i + 1) * size] for i in range(n)]


def write_sharded(sd: dict[str, torch.Tensor], folder: Path, stem: str, index_name: str, n_shards: int,
                  config: dict | None = None) -> list[Path]:
    """Write ``sd`` as ``<stem>-0000X-of-0000N.safetensors`` + ``index_name`` (+ ``config.json``)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    weight_map = {}
    total = 0
    for i, group in enumerate(_shard_plan(list(sd), n_shards), start=1):
        name = f"{stem}-{i:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: sd[k] for k in group}, folder / name, metadata={"format": "pt"})
        for k in group:
            weight_map[k] = name
            total += sd[k].numel() * sd[k].element_size()
        written.append(folder / name)
    _write_json(folder / index_name, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    written.append(folder / index_name)
    if config is not None:
        _write_json(folder / "config.json", config)
        written.append(folder / "config.json")
    return written


def _single(out: Path, rel: str, sd) -> list[Path]:
    p = Path(out) / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, p)
    return [p]


@register("h3_dit")
def gen_h3_dit(out: Path) -> list[Path]:
    return _single(out, COMFY_FILE, base_state_dict())


@register("h3_dit_official")
def gen_h3_dit_official(out: Path) -> list[Path]:
    sd = official_state_dict(base_state_dict())
    return write_sharded(sd, Path(out) / OFFICIAL_DIR, "model", "model.safetensors.index.json", 2, official_config())


@register("h3_dit_diffusers")
def gen_h3_dit_diffusers(out: Path) -> list[Path]:
    sd = diffusers_state_dict(base_state_dict())
    return write_sharded(sd, Path(out) / DIFFUSERS_DIR, "diffusion_pytorch_model",
                         "diffusion_pytorch_model.safetensors.index.json", 3, diffusers_config())


@register("h3_dit_curve")
def gen_h3_dit_curve(out: Path) -> list[Path]:
    return _single(out, CURVE_FILE, curve_state_dict(base_state_dict()))


@register("h3_dit_fasth3")
def gen_h3_dit_fasth3(out: Path) -> list[Path]:
    return _single(out, FASTH3_FILE, fasth3_state_dict(base_state_dict()))


# ---------------------------------------------------------------- adapters (DitKitAdapterLoader examples / tests)

DIFFSYNTH_LORA = "loras/h3_diffsynth_lora_tiny.safetensors"
FASTH3_ADAPTER = "loras/h3_fasth3_adapter_tiny.safetensors"
FASTH3_FUSED_FILE = "diffusion_models/h3_tiny_fasth3_fused.safetensors"
ADAPTER_RANK = 4


def dyadic(shape, g: torch.Generator, denom: int = 16) -> torch.Tensor:
    """Small multiples of 1/denom: B @ A of such factors is exact in fp32 and bf16 holds them exactly, so a
    fused checkpoint built in float64 and a patch built in fp32 agree bit for bit."""
    return torch.randint(-4, 5, tuple(shape), generator=g).to(torch.float32) / denom


def diffsynth_lora_state_dict(cfg=CONFIG, rank: int = ADAPTER_RANK, seed: int = SEED + 7) -> dict[str, torch.Tensor]:
    """DiffSynth-Studio's export of a PEFT LoRA on the official module tree: ``blocks.N.<module>.lora_A.default.weight``
    [rank, in] / ``lora_B.default.weight`` [out, rank], bf16, no alpha, no metadata. The qkv_proj factors act on the
    official per-head interleaved rows."""
    g = torch.Generator("cpu").manual_seed(seed)
    shapes = comfy_shapes(cfg)
    out = {}
    for i in range(cfg["num_layers"]):
        for mod in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            o, n = shapes[f"blocks.{i}.{mod}.weight"]
            out[f"blocks.{i}.{mod}.lora_A.default.weight"] = dyadic((rank, n), g).to(torch.bfloat16)
            out[f"blocks.{i}.{mod}.lora_B.default.weight"] = dyadic((o, rank), g).to(torch.bfloat16)
    return out


def fasth3_adapter_state_dict(base: dict[str, torch.Tensor] | None = None, cfg=CONFIG, rank: int = ADAPTER_RANK,
                              seed: int = SEED + 8) -> dict[str, torch.Tensor]:
    """A FastVideo ``fastvideo-lora-v2`` adapter in the diffusers namespace: rank-``rank`` factors without alpha on
    ``to_q/to_k/to_v``, ``to_out.0`` and ``ff.net.0.proj``; full-rank ``.diff`` (``norm1``) and ``.diff_b``
    (``proj_in``, ``norm_out.linear``); ``.set_weight`` of every block's ``to_gate_compress`` (the FastH3 gates of
    :func:`fasth3_state_dict`)."""
    base = base if base is not None else base_state_dict(cfg)
    g = torch.Generator("cpu").manual_seed(seed)
    h, inner, ffn = cfg["hidden_size"], inner_dim(cfg), cfg["ffn_hidden_size"]
    out: dict[str, torch.Tensor] = {}
    gates = fasth3_state_dict(base, cfg)
    for i in range(cfg["num_layers"]):
        b = f"transformer_blocks.{i}."
        for mod, (o, n) in (("attn.to_q", (inner, h)), ("attn.to_k", (inner, h)), ("attn.to_v", (inner, h)),
                            ("attn.to_out.0", (h, inner)), ("ff.net.0.proj", (2 * ffn, h))):
            out[f"{b}{mod}.lora_A.weight"] = dyadic((rank, n), g).to(torch.bfloat16)
            out[f"{b}{mod}.lora_B.weight"] = dyadic((o, rank), g).to(torch.bfloat16)
        out[f"{b}norm1.diff"] = dyadic((h,), g, 64).to(torch.bfloat16)
        out[f"{b}attn.to_gate_compress.set_weight"] = gates[f"blocks.{i}.attn.to_gate_compress.weight"]
    out["proj_in.diff_b"] = dyadic((h,), g, 64)
    out["norm_out.linear.diff_b"] = dyadic((2 * h,), g, 64).to(torch.bfloat16)
    return out


def fasth3_adapter_metadata(sd: dict[str, torch.Tensor], rank: int = ADAPTER_RANK) -> dict[str, str]:
    return {"format": "fastvideo-lora-v2", "finetuned_model": "FastVideo/FastVideo-FastH3-tiny-test",
            "base_model": "MiniMaxAI/MiniMax-H3", "rank": str(rank),
            "application": "W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned",
            "low_rank_tensors": str(sum(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in sd)),
            "diff_tensors": str(sum(k.endswith((".diff", ".diff_b")) for k in sd)),
            "set_weight_tensors": str(sum(k.endswith(".set_weight") for k in sd))}


def fasth3_fused_state_dict(base: dict[str, torch.Tensor] | None = None, cfg=CONFIG) -> dict[str, torch.Tensor]:
    """The fused FastH3 checkpoint of :func:`fasth3_adapter_state_dict` (ComfyUI layout, float64 math, every float
    tensor stored fp32 so the bulk keeps one dtype): ``W + B @ A`` (to_q/k/v onto their thirds of the contiguous
    qkv, ``ff.net.0.proj``'s ``[value; gate]`` rows onto fc1's ``[gate; value]``), ``+ diff``, gates assigned."""
    base = base if base is not None else base_state_dict(cfg)
    ad = fasth3_adapter_state_dict(base, cfg)
    inner, ffn = inner_dim(cfg), cfg["ffn_hidden_size"]
    out = {k: v.double() for k, v in base.items()}

    def ba(m):
        return ad[m + ".lora_B.weight"].double() @ ad[m + ".lora_A.weight"].double()

    for i in range(cfg["num_layers"]):
        b, n = f"transformer_blocks.{i}.", f"blocks.{i}."
        for j, p in enumerate("qkv"):
            out[n + "attn.qkv_proj.weight"][j * inner:(j + 1) * inner] += ba(f"{b}attn.to_{p}")
        out[n + "attn.out_proj.weight"] += ba(b + "attn.to_out.0")
        d = ba(b + "ff.net.0.proj")                      # [value; gate]
        out[n + "mlp.fc1.weight"] += torch.cat([d[ffn:], d[:ffn]])
        out[n + "norm1.weight"] += ad[b + "norm1.diff"].double()
        out[n + "attn.to_gate_compress.weight"] = ad[b + "attn.to_gate_compress.set_weight"].double()
    out["video_patch_proj.bias"] += ad["proj_in.diff_b"].double()
    out["final_layer.adaln_proj.linear.bias"] += ad["norm_out.linear.diff_b"].double()
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


@register("h3_adapters")
def gen_h3_adapters(out: Path) -> list[Path]:
    base = base_state_dict()
    files = []
    p = Path(out) / DIFFSYNTH_LORA
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(diffsynth_lora_state_dict(), p)
    files.append(p)
    ad = fasth3_adapter_state_dict(base)
    p = Path(out) / FASTH3_ADAPTER
    save_file(ad, p, metadata=fasth3_adapter_metadata(ad))
    files.append(p)
    files += _single(out, FASTH3_FUSED_FILE, fasth3_fused_state_dict(base))
    return files


@register("h3_dit_fasth3_v2")
def gen_h3_dit_fasth3_v2(out: Path) -> list[Path]:
    root = Path(out) / FASTH3_V2_DIR
    sd = diffusers_state_dict(fasth3_state_dict(base_state_dict()))
    written = write_sharded(sd, root / "transformer", "diffusion_pytorch_model",
                            "diffusion_pytorch_model.safetensors.index.json", 2, diffusers_config())
    for name, obj in (("fastvideo_inference.json", fasth3_v2_contract()), ("provenance.json", fasth3_v2_provenance())):
        _write_json(root / name, obj)
        written.append(root / name)
    return written


# ---------------------------------------------------------------- quantized repacks (Comfy-Org key set and markers)
QUANT_REPACK_FORMATS = ("int8_convrot", "mxfp8", "nvfp4")
CONVROT_GROUP = 256          # the Comfy-Org repacks' group (h3.md §9); AdaLN layers use 64
CONVROT_ADALN_GROUP = 64


def convrot_group_for(cols: int, want: int) -> int:
    """The largest power of 4 <= ``want`` dividing ``cols`` (the tiny widths 64 / 96 / 128 / 32 are not all
    multiples of 256; the real ones, 5376 / 7168 / 14336, and 2688 for AdaLN's 64, are)."""
    g = want
    while g > 4 and cols % g:
        g //= 4
    if cols % g:
        raise ValueError(f"no ConvRot group (power of 4) divides width {cols}")
    return g


def quantized_layer_keys(sd: dict[str, torch.Tensor]) -> list[str]:
    """The layers a Comfy-Org H3 repack stores quantized: every 2-D weight of the DiT and refiner blocks (qkv,
    out_proj, fc1, fc2, and the full-width AdaLN of an unpruned file); the pruned file's 8-wide curve AdaLN, the
    patch projections, condition_proj, time embedder and final layer stay as stored (h3.md §2.6 C, §9)."""
    out = []
    for k, v in sd.items():
        if not (k.startswith("blocks.") or k.startswith("token_refiner.blocks.")) or not k.endswith(".weight"):
            continue
        if v.dim() != 2 or "to_gate_compress" in k:
            continue
        if "adaln_proj" in k and "adaln_t_table" in sd:
            continue
        out.append(k)
    return out


def comfy_quant_state_dict(sd: dict[str, torch.Tensor], fmt: str, quantize) -> dict[str, torch.Tensor]:
    """A ComfyUI-layout H3 state dict as a Comfy-Org style repack in ``fmt`` (``int8_convrot``: ``{"format":
    "int8_tensorwise", "convrot": true, "convrot_groupsize": g}``, one float32 scale per row; ``mxfp8``,
    ``nvfp4``), every quantized layer with its ``weight`` / ``weight_scale`` (/ ``weight_scale_2``) /
    ``comfy_quant`` keys. ``quantize(w_float32, fmt, group) -> {suffix: tensor}`` is the caller's quantizer: the
    tests pass the host's own layout quantize (``tests/support/quant_oracle.host_quantize_layer``), so no scale
    here is invented."""
    if fmt not in QUANT_REPACK_FORMATS:
        raise ValueError(f"{fmt!r} is not one of {QUANT_REPACK_FORMATS}")
    out = dict(sd)
    for k in quantized_layer_keys(sd):
        w = sd[k].float()
        p = k[: -len("weight")]
        conf: dict = {"format": "int8_tensorwise" if fmt == "int8_convrot" else fmt}
        group = 0
        if fmt == "int8_convrot":
            group = convrot_group_for(w.shape[1], CONVROT_ADALN_GROUP if "adaln_proj" in k else CONVROT_GROUP)
            conf.update({"convrot": True, "convrot_groupsize": group})
        parts = quantize(w, fmt, group)
        del out[k]
        for suffix, t in parts.items():
            out[p + "weight" + suffix] = t
        out[p + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    return out


def turbo_lora_state_dict(cfg=CONFIG, rank: int = ADAPTER_RANK, seed: int = SEED + 9, adaln: bool = True
                          ) -> dict[str, torch.Tensor]:
    """A Turbo-style (step-distillation) LoRA in ComfyUI naming (``diffusion_model.<module>.lora_up/lora_down``,
    ``.alpha``, bf16): the block linears plus, with ``adaln``, AdaLN pairs on every ``blocks.N.adaln_proj.linear``
    and ``final_layer.adaln_proj.linear`` acting on the ``time_embed_dim``-wide ``silu(t_emb)`` space (the real
    files: 2688; h3.md §9 "Turbo LoRAs with AdaLN pairs")."""
    g = torch.Generator("cpu").manual_seed(seed)
    shapes = comfy_shapes(cfg)
    mods = [f"blocks.{i}.{m}" for i in range(cfg["num_layers"])
            for m in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]
    if adaln:
        mods += [f"blocks.{i}.adaln_proj.linear" for i in range(cfg["num_layers"])] + ["final_layer.adaln_proj.linear"]
    out = {}
    for m in mods:
        o, n = shapes[f"{m}.weight"]
        out[f"diffusion_model.{m}.lora_down.weight"] = dyadic((rank, n), g).to(torch.bfloat16)
        out[f"diffusion_model.{m}.lora_up.weight"] = dyadic((o, rank), g).to(torch.bfloat16)
        out[f"diffusion_model.{m}.alpha"] = torch.tensor(float(rank))
    return out


TURBO_LORA = "loras/h3_tiny_turbo.safetensors"
SILU_GRID_FILE = "loras/h3_tiny_silu_t_emb_grid.safetensors"


def silu_t_emb_grid_state_dict(base: dict[str, torch.Tensor] | None = None, cfg=CONFIG,
                               grid: int = CURVE_GRID) -> dict[str, torch.Tensor]:
    """The grid input a Turbo LoRA needs on the curve-form base (``h3_tiny_curve``): ``silu_t_emb_grid
    [grid, time_embed_dim]`` = silu(t_emb(t_i)) of the unpruned base at ``t_i = i / (grid - 1)`` (float64 rounded
    to float32) and ``t_grid [grid]``: the layout of the community ``h3_silu_temb_grid.safetensors`` (h3.md §9),
    stored float32 instead of bf16."""
    base = base_state_dict() if base is None else base
    t = torch.linspace(0.0, 1.0, grid, dtype=torch.float64)
    s = torch.nn.functional.silu(_time_embed(base, t, cfg))
    return {"silu_t_emb_grid": s.to(torch.float32).contiguous(), "t_grid": t.to(torch.float32).contiguous()}


PRUNED_INT8_CONVROT_FILE = "diffusion_models/h3_tiny_pruned_int8_convrot.safetensors"


def kitchen_quantize_layer(w: torch.Tensor, fmt: str, group: int = 0) -> dict[str, torch.Tensor]:
    """``comfy_quant_state_dict``'s quantizer from ``comfy_kitchen`` (the package ComfyUI's ``comfy.quant_ops``
    registers as its ``TensorWiseINT8Layout``): int8 ConvRot per-channel, no stochastic rounding. Only
    ``int8_convrot``; imported when called (``comfy_kitchen`` ships with the host, not with ditkit)."""
    if fmt != "int8_convrot":
        raise ValueError(f"kitchen_quantize_layer writes int8_convrot only, not {fmt!r}")
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    qd, params = TensorWiseINT8Layout.quantize(w.clone(), scale="recalculate", per_channel=True, convrot=True,
                                               convrot_groupsize=group)
    return TensorWiseINT8Layout.state_dict_tensors(qd, params)


@register("h3_turbo")
def gen_h3_turbo(out: Path) -> list[Path]:
    """The tiny Turbo-style LoRA (AdaLN pairs on silu(t_emb)), the silu(t_emb) grid of the curve-form base and the
    pruned (curve-form) base as a Comfy-Org style int8 ConvRot repack (``h3_turbo_bypass_tiny`` example). Without
    ``comfy_kitchen`` (no host installed) the repack is not written and a line on stderr says so."""
    import sys

    files = []
    base = base_state_dict()
    todo = [(TURBO_LORA, turbo_lora_state_dict()), (SILU_GRID_FILE, silu_t_emb_grid_state_dict(base))]
    try:
        todo.append((PRUNED_INT8_CONVROT_FILE, comfy_quant_state_dict(curve_state_dict(base), "int8_convrot",
                                                                      kitchen_quantize_layer)))
    except ImportError as e:
        print(f"h3_turbo: {PRUNED_INT8_CONVROT_FILE} not written: comfy_kitchen is not importable ({e})",
              file=sys.stderr)
    for rel, sd in todo:
        p = Path(out) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file(sd, p)
        files.append(p)
    return files
