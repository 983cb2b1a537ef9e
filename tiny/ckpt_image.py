"""Tiny Z-Image and FLUX.2 DiT checkpoints (real ComfyUI key names and layouts, scaled down) + tiny LoKr files.

* ``zimage_dit`` -> ``diffusion_models/zimage_tiny.safetensors``: ComfyUI Z-Image layout (``lumina2`` family,
  fused ``attention.qkv``, ``attention.out``, ``q_norm/k_norm``, SwiGLU ``feed_forward.w1/w2/w3``,
  ``adaLN_modulation.0``, 2 ``noise_refiner`` + 2 ``context_refiner`` blocks, pad tokens). dim 256 = 2 heads of
  128 (Z-Image's head size; ``axes_dims`` [32, 48, 48] as in the real model; ComfyUI's Z-Image modulation
  needs dim >= 256), 2 layers, ``cap_feat_dim`` 1024 so
  the stock ``LotusConditioning`` ([1, 77, 1024]) drives it without a text encoder. The stock ``UNETLoader``
  only knows Z-Image settings for dim 3840, so load it with ``DitKitZImageLoader``.
* ``flux2_dit`` -> ``diffusion_models/flux2_tiny.safetensors``: ComfyUI/BFL FLUX.2 layout (double blocks with
  fused ``img_attn.qkv`` / ``txt_attn.qkv``, SwiGLU ``img_mlp.0`` [2*3h, h], single blocks ``linear1``
  [3h + 6h, h] (q, k, v, mlp = 1:1:1:6), ``linear2`` [h, h + 3h], global modulation layers
  ``double_stream_modulation_img/txt.lin`` and ``single_stream_modulation.lin``, ``time_in`` + ``guidance_in``
  (dev), no biases, ``*_norm.scale``). hidden 128 (one head of FLUX.2's fixed 128), 2 double + 2 single blocks,
  ``txt_in`` [128, 1024] (LotusConditioning-sized context). The stock ``UNETLoader`` detects it from shapes.
* ``zimage_lokr`` -> ``loras/zimage_lokr_tiny.safetensors``: ai-toolkit style LoKr (``diffusion_model.`` +
  diffusers module paths: split ``attention.to_q/to_k/to_v``, ``to_out.0``, ``feed_forward.w1/w2/w3``,
  ``adaLN_modulation.0``), full-rank factors (factor 8) with the ~1e10 placeholder ``alpha`` ai-toolkit writes.
* ``flux2_lokr`` -> ``loras/flux2_lokr_tiny.safetensors``: ai-toolkit BFL-named FLUX.2 LoKr (fused
  ``img_attn.qkv`` / ``txt_attn.qkv`` / ``linear1`` with factor 16, decomposed ``w2`` of rank 4 with alpha 2,
  plus global modulation and time embedder modules).

Weights are bf16 like the public releases (ComfyUI computes in fp32 on CPU). Seeds are fixed.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..loaders.lokr_math import factorization
from ..loaders.safetensors_io import save_file
from .checkpoints import register

SEED = 20261130

ZIMAGE = {"dim": 256, "n_layers": 2, "n_refiner_layers": 2, "cap_feat_dim": 1024, "in_channels": 16,
          "patch_size": 2, "ffn_multiple_of": 256, "t_hidden": 256}
FLUX2 = {"hidden": 128, "depth": 2, "depth_single": 2, "in_channels": 128, "context_dim": 1024,
         "mlp_ratio": 3}


def _zimage_ffn_hidden(dim: int, multiple_of: int = 256) -> int:
    h = int(dim * 8.0 / 3.0)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def zimage_shapes(cfg: dict = ZIMAGE) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the ComfyUI Z-Image state dict for ``cfg`` (also the oracle for the LoKr mapper tests)."""
    d, cap, tmod = cfg["dim"], cfg["cap_feat_dim"], min(cfg["dim"], 256)
    ffn = _zimage_ffn_hidden(d, cfg["ffn_multiple_of"])
    head = 128
    p = cfg["patch_size"] ** 2 * cfg["in_channels"]
    s: dict[str, tuple[int, ...]] = {
        "x_pad_token": (1, d), "cap_pad_token": (1, d),
        "x_embedder.weight": (d, p), "x_embedder.bias": (d,),
        "t_embedder.mlp.0.weight": (min(d, 1024), cfg["t_hidden"]), "t_embedder.mlp.0.bias": (min(d, 1024),),
        "t_embedder.mlp.2.weight": (256, min(d, 1024)), "t_embedder.mlp.2.bias": (256,),
        "cap_embedder.0.weight": (cap,), "cap_embedder.1.weight": (d, cap), "cap_embedder.1.bias": (d,),
        "final_layer.linear.weight": (p, d), "final_layer.linear.bias": (p,),
        "final_layer.adaLN_modulation.1.weight": (d, tmod), "final_layer.adaLN_modulation.1.bias": (d,),
    }

    def block(prefix: str, modulation: bool) -> None:
        s[f"{prefix}.attention.qkv.weight"] = (3 * d, d)
        s[f"{prefix}.attention.out.weight"] = (d, d)
        s[f"{prefix}.attention.q_norm.weight"] = (head,)
        s[f"{prefix}.attention.k_norm.weight"] = (head,)
        s[f"{prefix}.feed_forward.w1.weight"] = (ffn, d)
        s[f"{prefix}.feed_forward.w2.weight"] = (d, ffn)
        s[f"{prefix}.feed_forward.w3.weight"] = (ffn, d)
        for n in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"):
            s[f"{prefix}.{n}.weight"] = (d,)
        if modulation:
            s[f"{prefix}.adaLN_modulation.0.weight"] = (4 * d, tmod)
            s[f"{prefix}.adaLN_modulation.0.bias"] = (4 * d,)

    for i in range(cfg["n_refiner_layers"]):
        block(f"noise_refiner.{i}", True)
        block(f"context_refiner.{i}", False)
    for i in range(cfg["n_layers"]):
        block(f"layers.{i}", True)
    return s


def flux2_shapes(cfg: dict = FLUX2) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the BFL/ComfyUI FLUX.2 state dict for ``cfg`` (``*_norm.scale`` as in BFL files)."""
    h, mr = cfg["hidden"], cfg["mlp_ratio"]
    mlp = h * mr
    s: dict[str, tuple[int, ...]] = {
        "img_in.weight": (h, cfg["in_channels"]),
        "txt_in.weight": (h, cfg["context_dim"]),
        "time_in.in_layer.weight": (h, 256), "time_in.out_layer.weight": (h, h),
        "guidance_in.in_layer.weight": (h, 256), "guidance_in.out_layer.weight": (h, h),
        "double_stream_modulation_img.lin.weight": (6 * h, h),
        "double_stream_modulation_txt.lin.weight": (6 * h, h),
        "single_stream_modulation.lin.weight": (3 * h, h),
        "final_layer.linear.weight": (cfg["in_channels"], h),
        "final_layer.adaLN_modulation.1.weight": (2 * h, h),
    }
    for i in range(cfg["depth"]):
        for st in ("img", "txt"):
            p = f"double_blocks.{i}.{st}"
            s[f"{p}_attn.qkv.weight"] = (3 * h, h)
            s[f"{p}_attn.norm.query_norm.scale"] = (128,)
            s[f"{p}_attn.norm.key_norm.scale"] = (128,)
            s[f"{p}_attn.proj.weight"] = (h, h)
            s[f"{p}_mlp.0.weight"] = (2 * mlp, h)
            s[f"{p}_mlp.2.weight"] = (h, mlp)
    for i in range(cfg["depth_single"]):
        p = f"single_blocks.{i}"
        s[f"{p}.linear1.weight"] = (3 * h + 2 * mlp, h)
        s[f"{p}.linear2.weight"] = (h, h + mlp)
        s[f"{p}.norm.query_norm.scale"] = (128,)
        s[f"{p}.norm.key_norm.scale"] = (128,)
    return s


def _fill(shapes: dict[str, tuple[int, ...]], seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(shapes):
        shp = shapes[k]
        if k.endswith((".scale",)) or (k.endswith(".weight") and len(shp) == 1):
            t = torch.ones(shp)  # RMSNorm gains
        elif k.endswith(".bias"):
            t = torch.zeros(shp)
        elif k.endswith("pad_token"):
            t = torch.randn(shp, generator=g) * 0.02
        else:
            t = torch.randn(shp, generator=g) / math.sqrt(shp[-1])
        out[k] = t.to(dtype)
    return out


def zimage_state_dict(cfg: dict = ZIMAGE) -> dict[str, torch.Tensor]:
    return _fill(zimage_shapes(cfg), SEED)


def flux2_state_dict(cfg: dict = FLUX2) -> dict[str, torch.Tensor]:
    return _fill(flux2_shapes(cfg), SEED + 1)


def make_lokr_module(out_f: int, in_f: int, factor: int, g: torch.Generator, rank: int | None = None,
                     alpha: float | None = None, decompose_both: bool = False, scale: float = 0.05) -> dict:
    """One LyCORIS-layout LoKr module (suffix -> tensor) for a Linear [out_f, in_f]. ``rank`` None: full-rank
    factors (w1, w2); else w2 (and with ``decompose_both`` w1) as a_(out x r) @ b_(r x in)."""
    out_l, out_k = factorization(out_f, factor)
    in_m, in_n = factorization(in_f, factor)
    m: dict[str, torch.Tensor] = {}
    if rank is not None and decompose_both:
        m["lokr_w1_a"] = torch.randn(out_l, rank, generator=g) * 0.5
        m["lokr_w1_b"] = torch.randn(rank, in_m, generator=g) * 0.5
    else:
        m["lokr_w1"] = torch.randn(out_l, in_m, generator=g)
    if rank is not None:
        m["lokr_w2_a"] = torch.randn(out_k, rank, generator=g) * scale
        m["lokr_w2_b"] = torch.randn(rank, in_n, generator=g) * scale
    else:
        m["lokr_w2"] = torch.randn(out_k, in_n, generator=g) * scale
    if alpha is not None:
        m["alpha"] = torch.tensor(float(alpha))
    return m


def zimage_lokr_state_dict(cfg: dict = ZIMAGE) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 10)
    d = cfg["dim"]
    ffn = _zimage_ffn_hidden(d, cfg["ffn_multiple_of"])
    tmod = min(d, 256)
    sd: dict[str, torch.Tensor] = {}
    blocks = [f"layers.{i}" for i in range(cfg["n_layers"])] + \
             [f"noise_refiner.{i}" for i in range(cfg["n_refiner_layers"])]
    for b in blocks:
        mods = {"attention.to_q": (d, d), "attention.to_k": (d, d), "attention.to_v": (d, d),
                "attention.to_out.0": (d, d), "feed_forward.w1": (ffn, d), "feed_forward.w2": (d, ffn),
                "feed_forward.w3": (ffn, d), "adaLN_modulation.0": (4 * d, tmod)}
        for name, (o, i) in mods.items():
            for suf, t in make_lokr_module(o, i, 8, g, alpha=1e10, scale=0.02).items():
                sd[f"diffusion_model.{b}.{name}.{suf}"] = t.to(torch.bfloat16) if suf != "alpha" else t
    return sd


def flux2_lokr_state_dict(cfg: dict = FLUX2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 11)
    shapes = flux2_shapes(cfg)
    sd: dict[str, torch.Tensor] = {}
    targets = [k[: -len(".weight")] for k in shapes if k.endswith(".weight") and len(shapes[k]) == 2
               and (k.startswith(("double_blocks", "single_blocks", "double_stream", "single_stream",
                                  "time_in", "guidance_in")))]
    for mod in sorted(targets):
        o, i = shapes[mod + ".weight"]
        for suf, t in make_lokr_module(o, i, 16, g, rank=4, alpha=2.0, scale=0.05).items():
            sd[f"diffusion_model.{mod}.{suf}"] = t.to(torch.bfloat16) if suf != "alpha" else t
    return sd


@register("zimage_dit")
def gen_zimage(outdir: Path) -> list[Path]:
    p = Path(outdir) / "diffusion_models" / "zimage_tiny.safetensors"
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(zimage_state_dict(), p)
    return [p]


@register("flux2_dit")
def gen_flux2(outdir: Path) -> list[Path]:
    p = Path(outdir) / "diffusion_models" / "flux2_tiny.safetensors"
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(flux2_state_dict(), p)
    return [p]


@register("zimage_lokr")
def gen_zimage_lokr(outdir: Path) -> list[Path]:
    p = Path(outdir) / "loras" / "zimage_lokr_tiny.safetensors"
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(zimage_lokr_state_dict(), p, metadata={"trainer": "ai-toolkit-style"})
    return [p]


@register("flux2_lokr")
def gen_flux2_lokr(outdir: Path) -> list[Path]:
    p = Path(outdir) / "loras" / "flux2_lokr_tiny.safetensors"
    p.parent.mkdir(parents=True, exist_ok=True)
    save_file(flux2_lokr_state_dict(), p, metadata={"trainer": "ai-toolkit-style"})
    return [p]
