"""MiniMax H3 DiT checkpoints in any published layout -> the ComfyUI state dict.

Layouts (h3.md §2.6–2.9, §9):

* ``comfy``      single ``.safetensors`` with original names and qkv rows ``[q_all; k_all; v_all]``
                 (Comfy-Org repacks, GGUF-derived files). Includes the AdaLN *curve* form (``adaln_t_table``)
                 and int8/fp8 repacks: quantized weights and their ``.comfy_quant`` / ``.weight_scale`` sidecars
                 pass through untouched.
* ``official``   folder with ``model.safetensors.index.json`` (+ shards, optional ``config.json``), original names,
                 qkv rows **per-head interleaved** ``[h0: q,k,v; h1: q,k,v; ...]`` (DiT and refiner blocks).
* ``diffusers``  folder with ``diffusion_pytorch_model.safetensors.index.json`` (+ shards) or a single
                 ``diffusion_pytorch_model.safetensors``, plus ``config.json``: diffusers names, ``to_q/to_k/to_v``,
                 ``ff.net.0.proj`` halves ``[value; gate]``, no ``rope.inv_freq``.

Conversion: per-head de-interleave -> ``[q;k;v]``; diffusers rename, merge ``to_q/to_k/to_v`` (shapes checked),
swap the fc1 halves back to ``[gate; value]``, re-add ``rope.inv_freq = 1/theta^(arange(0,2n,2)/2n)`` (fp32).

Everything is validated from the safetensors headers (and index/config JSON) **before** any tensor data is
read; tensors are then read one at a time through :class:`~ditkit.loaders.safetensors_io.SafeFile`, converted
and stored, with a progress callback. On any error the partial state dict is cleared before the
:class:`~ditkit.errors.CheckpointError` propagates.

Dtype rule (documented in the node docs): the *bulk* tensors -- every floating tensor that is not an fp32
island (``video_patch_proj``, ``audio_patch_proj``, ``time_embedder``, ``final_layer.video_out/audio_out``,
``rope.inv_freq``, ``adaln_t_table``), not a curve-form AdaLN projection (F16 in Comfy-Org pruned files), not a
quantized carrier (I8/F8/U8) and not a quantization sidecar -- must all have ONE dtype across every shard.
A shard saved in another dtype (e.g. one fp16 shard in a bf16 release) is reported naming the tensor and file.
Every 2-D I8 weight must carry a ``.comfy_quant`` marker.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Iterator

import torch

from ..errors import CheckpointError
from ..report import ProgressFn, Report
from . import host_memory
from .safe_fs import read_user_file
from .safetensors_io import SafeFile, TensorInfo, read_header, strict_json_loads

OFFICIAL_INDEX = "model.safetensors.index.json"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_SINGLE = "diffusion_pytorch_model.safetensors"
MAX_JSON_BYTES = 64 * 1024 * 1024

FP32_ISLANDS = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                "final_layer.audio_out.", "rope.inv_freq", "adaln_t_table")
QUANT_SIDECARS = (".comfy_quant", ".weight_scale", ".weight_scale_2", ".input_scale", ".scale_weight",
                  ".scale_input")
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
PREFIXES = ("model.diffusion_model.", "diffusion_model.")

BLOCK_KEYS = ("norm1.weight", "norm2.weight", "attn.qkv_proj.weight", "attn.q_norm.weight", "attn.k_norm.weight",
              "attn.out_proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")
DIT_EXTRA = ("adaln_proj.linear.weight", "adaln_proj.linear.bias")
TOP_KEYS = ("video_patch_proj.weight", "video_patch_proj.bias", "audio_patch_proj.weight", "audio_patch_proj.bias",
            "condition_proj.weight", "condition_proj.bias", "rope.inv_freq", "token_refiner.final_norm.weight",
            "final_layer.norm.weight", "final_layer.adaln_proj.linear.weight", "final_layer.adaln_proj.linear.bias",
            "final_layer.video_out.weight", "final_layer.video_out.bias", "final_layer.audio_out.weight",
            "final_layer.audio_out.bias")
TIME_KEYS = ("time_embedder.proj_in.weight", "time_embedder.proj_in.bias", "time_embedder.proj_out.weight",
             "time_embedder.proj_out.bias")

# diffusers -> original (h3.md §2.6 B)
_D_TOP = (("proj_in.", "video_patch_proj."), ("audio_proj_in.", "audio_patch_proj."),
          ("context_embedder.", "condition_proj."), ("time_embedder.linear_1.", "time_embedder.proj_in."),
          ("time_embedder.linear_2.", "time_embedder.proj_out."), ("norm_out.norm.", "final_layer.norm."),
          ("norm_out.linear.", "final_layer.adaln_proj.linear."), ("proj_out.", "final_layer.video_out."),
          ("audio_proj_out.", "final_layer.audio_out."), ("token_refiner.final_norm.", "token_refiner.final_norm."))
_D_BLOCK = {"attn.norm_q.weight": "attn.q_norm.weight", "attn.norm_k.weight": "attn.k_norm.weight",
            "attn.to_out.0.weight": "attn.out_proj.weight", "ff.net.0.proj.weight": "mlp.fc1.weight",
            "ff.net.2.weight": "mlp.fc2.weight", "norm1.weight": "norm1.weight", "norm2.weight": "norm2.weight",
            "adaln_proj.linear.weight": "adaln_proj.linear.weight",
            "adaln_proj.linear.bias": "adaln_proj.linear.bias",
            "attn.to_gate_compress.weight": "attn.to_gate_compress.weight"}

# other families (first match wins) -> what to use instead
_FAMILIES = (
    ("adaln_single.emb.timestep_embedder.linear_1.bias", "an LTX-Video / LTX-2 DiT",
     "load it with the stock 'Load Diffusion Model' (UNETLoader)"),
    ("double_stream_modulation_img.lin.weight", "a FLUX.2 DiT", "load it with UNETLoader"),
    ("double_blocks.0.img_attn.qkv.weight", "a FLUX DiT", "load it with UNETLoader"),
    ("cap_embedder.1.weight", "a Z-Image / Lumina2 DiT", "load it with UNETLoader"),
    ("head.modulation", "a Wan DiT", "load it with UNETLoader"),
    ("decoder.transformer_blocks.0.scale1", "the H3 video VAE", "load it with VAELoader"),
    ("encoder.down.0.block.0.conv1.weight", "a VAE", "load it with VAELoader"),
    ("model.layers.0.self_attn.q_proj.weight", "a text encoder", "load it with CLIPLoader"),
)


@dataclass
class H3Source:
    """Where the tensors of one H3 checkpoint live, and in which layout."""

    path: str
    layout: str                      # "comfy" | "official" | "diffusers"
    files: list[str]                 # safetensors files (shards in order)
    locations: dict[str, tuple[str, TensorInfo]]   # source key -> (file, info); prefix already stripped
    prefix: str = ""
    config: dict | None = None       # config.json next to the shards, if any
    metadata: dict[str, str] = field(default_factory=dict)  # single-file __metadata__ (passed to ComfyUI)


@dataclass
class H3LoadReport(Report):
    path: str
    layout: str
    variant: str
    shards: int
    tensors_read: int
    tensors_out: int
    converted: dict[str, int]
    bytes_read: int
    bulk_dtype: str | None
    config: dict
    passthrough: list[str]
    quantized: int
    quant: object = None     # loaders.quantize.QuantReport when quantized while loading

    def summary(self) -> str:
        conv = ", ".join(f"{v} {k}" for k, v in self.converted.items() if v) or "no conversion"
        c = self.config
        return (f"{self.layout} layout ({self.variant}, {self.shards} file{'s' if self.shards != 1 else ''}): "
                f"{self.tensors_out} tensors, {conv}; hidden {c.get('hidden_size')}, "
                f"{c.get('num_attention_heads')}x{c.get('attention_head_dim')} heads, {c.get('num_layers')} layers"
                + (f", {self.quantized} quantized weights passed through" if self.quantized else ""))


# ------------------------------------------------------------------ detection

def _read_json(path: Path) -> dict:
    raw = read_user_file(path, MAX_JSON_BYTES, "index/config JSON", CheckpointError)  # opened once, fstat-checked
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"'{path}': cannot read ({e})") from None
    obj = strict_json_loads(text, f"'{path}'", what="index/config JSON")
    if not isinstance(obj, dict):
        raise CheckpointError(f"'{path}': expected a JSON object")
    return obj


def _index_files(folder: Path, index_name: str) -> tuple[list[str], dict[str, str]]:
    idx_path = folder / index_name
    idx = _read_json(idx_path)
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"'{idx_path}': 'weight_map' must be a non-empty object mapping tensor names to shard files")
    for shard in set(wm.values()):
        if Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise CheckpointError(f"'{idx_path}': shard name {shard!r} must be a plain '*.safetensors' file name in the folder")
    files = sorted(set(wm.values()))
    for shard in files:
        if not (folder / shard).is_file():
            names = sorted(k for k, v in wm.items() if v == shard)
            raise CheckpointError(f"'{idx_path}': shard '{shard}' is missing from {folder} "
                                  f"({len(names)} tensors, e.g. {names[0]!r}); re-download it")
    meta = idx.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"'{idx_path}': 'metadata' must be an object")
    return files, wm


def _strip_prefix(keys) -> str:
    keys = list(keys)
    for p in PREFIXES:
        if any(k.startswith(p + "video_patch_proj.") or k.startswith(p + "proj_in.") for k in keys):
            return p
    return ""


def detect(path: str | os.PathLike) -> H3Source:
    """Detect the layout of ``path`` (file or folder) from names and headers only (no tensor data read)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"'{p}': no such file or folder")
    if p.is_dir():
        has_off, has_diff = (p / OFFICIAL_INDEX).is_file(), (p / DIFFUSERS_INDEX).is_file()
        if has_off and has_diff:
            raise CheckpointError(f"'{p}': holds both {OFFICIAL_INDEX} and {DIFFUSERS_INDEX}; keep one layout per folder")
        cfg = _read_json(p / "config.json") if (p / "config.json").is_file() else None
        if has_off or has_diff:
            index_name = OFFICIAL_INDEX if has_off else DIFFUSERS_INDEX
            files, wm = _index_files(p, index_name)
            locations: dict[str, tuple[str, TensorInfo]] = {}
            for shard in files:
                fpath = str(p / shard)
                hdr = read_header(fpath)
                want = {k for k, v in wm.items() if v == shard}
                missing = sorted(want - set(hdr.tensors))
                if missing:
                    raise CheckpointError(f"'{p / index_name}' names tensor {missing[0]!r} in shard '{shard}', but that "
                                          f"shard does not contain it ({len(missing)} missing); the index and shards "
                                          "do not match (partial download?)")
                extra = sorted(set(hdr.tensors) - want)
                if extra:
                    raise CheckpointError(f"shard '{fpath}' holds tensor {extra[0]!r} that the index "
                                          f"'{index_name}' does not list ({len(extra)} unlisted); index and shards do not match")
                for k in want:
                    locations[k] = (fpath, hdr.tensors[k])
            layout = "official" if has_off else "diffusers"
            return _finish(H3Source(str(p), layout, [str(p / f) for f in files], locations, config=cfg))
        if (p / DIFFUSERS_SINGLE).is_file():
            hdr = read_header(p / DIFFUSERS_SINGLE)
            loc = {k: (hdr.path, ti) for k, ti in hdr.tensors.items()}
            return _finish(H3Source(str(p), "diffusers", [hdr.path], loc, config=cfg, metadata=hdr.metadata))
        sts = sorted(x.name for x in p.glob("*.safetensors"))
        raise CheckpointError(f"'{p}': unknown folder layout: no {OFFICIAL_INDEX}, {DIFFUSERS_INDEX} or {DIFFUSERS_SINGLE} "
                              f"(found {len(sts)} .safetensors file(s){': ' + ', '.join(sts[:3]) if sts else ''}); "
                              "select a single-file checkpoint or an official/diffusers transformer folder")
    if not p.name.lower().endswith((".safetensors", ".sft")):
        raise CheckpointError(f"'{p}': not a .safetensors file (ditkit never unpickles .ckpt/.pt files)")
    m = re.search(r"-(\d{5})-of-(\d{5})\.safetensors$", p.name)
    if m and ((p.parent / OFFICIAL_INDEX).is_file() or (p.parent / DIFFUSERS_INDEX).is_file()):
        raise CheckpointError(f"'{p}' is shard {int(m.group(1))} of {int(m.group(2))} of a sharded checkpoint; "
                              f"select the folder '{p.parent.name}' instead")
    hdr = read_header(p)
    loc = {k: (hdr.path, ti) for k, ti in hdr.tensors.items()}
    cfg = None
    if p.name == DIFFUSERS_SINGLE and (p.parent / "config.json").is_file():
        cfg = _read_json(p.parent / "config.json")
    return _finish(H3Source(str(p), "comfy", [hdr.path], loc, config=cfg, metadata=hdr.metadata))


def _family_error(src: H3Source, keys) -> CheckpointError:
    ks = set(keys)
    for marker, what, todo in _FAMILIES:
        if any(k == marker or k.endswith("." + marker) for k in ks):
            return CheckpointError(f"'{src.path}' is {what} (has tensor {marker!r}), not a MiniMax H3 DiT; {todo}")
    sample = ", ".join(repr(k) for k in sorted(ks)[:3])
    return CheckpointError(f"'{src.path}' is not a MiniMax H3 DiT: it has none of 'video_patch_proj.weight' (original/"
                           f"ComfyUI names) or 'proj_in.weight' + 'audio_proj_in.weight' (diffusers names); "
                           f"first tensors: {sample}")


def _finish(src: H3Source) -> H3Source:
    keys = list(src.locations)
    src.prefix = _strip_prefix(keys)
    if src.prefix:
        src.locations = {k[len(src.prefix):]: v for k, v in src.locations.items() if k.startswith(src.prefix)}
    keys = set(src.locations)
    orig = "video_patch_proj.weight" in keys and "audio_patch_proj.weight" in keys
    diff = "proj_in.weight" in keys and "audio_proj_in.weight" in keys
    if not orig and not diff:
        raise _family_error(src, keys)
    if orig and diff:
        raise CheckpointError(f"'{src.path}': inconsistent layout, holds both original names ('video_patch_proj.weight') "
                              "and diffusers names ('proj_in.weight')")
    if src.layout == "comfy" and diff:
        src.layout = "diffusers"
    if src.layout in ("official", "comfy") and not orig:
        raise CheckpointError(f"'{src.path}': inconsistent layout, an {OFFICIAL_INDEX} folder must use the original "
                              "names but these tensors use diffusers names")
    if src.layout == "diffusers" and not diff:
        raise CheckpointError(f"'{src.path}': inconsistent layout, a diffusers folder must use diffusers names but "
                              "these tensors use the original names ('video_patch_proj.weight')")
    bad = [k for k in keys if (k.startswith("blocks.") if diff else k.startswith("transformer_blocks."))]
    if bad:
        raise CheckpointError(f"'{src.path}': inconsistent layout, tensor {bad[0]!r} uses the other naming scheme")
    return src


# ------------------------------------------------------------------ planning

@dataclass
class _Op:
    out: str
    kind: str                  # copy | deinterleave | merge_qkv | swap_halves | inv_freq
    srcs: tuple[str, ...]
    arg: tuple = ()


def _block_indices(keys, prefix: str) -> list[int]:
    rx = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := rx.match(k))})


def _need(src: H3Source, key: str, note: str = "") -> TensorInfo:
    try:
        return src.locations[key][1]
    except KeyError:
        raise CheckpointError(f"'{src.path}' ({src.layout} layout): required tensor {key!r} is missing{note}") from None


def _rename_diffusers(k: str) -> str | None:
    for a, b in _D_TOP:
        if k.startswith(a):
            return b + k[len(a):]
    for a, b in (("transformer_blocks.", "blocks."), ("token_refiner.refiner_blocks.", "token_refiner.blocks.")):
        if k.startswith(a):
            idx, rest = k[len(a):].split(".", 1)
            if rest in _D_BLOCK:
                return f"{b}{idx}.{_D_BLOCK[rest]}"
            return None
    return None


_NORM_RX = re.compile(r"(^|\.)(norm\d*|[a-z]+_norm|norm_[a-z]+)\.weight$")
MARKER_KEYS = ("scaled_fp8",)   # ComfyUI's old fp8 marker: an empty float8 tensor, no weight


def _check_tensors(src: H3Source) -> None:
    """Header-level shape sanity before anything divides by a dimension: no empty tensors (a zero-size dimension),
    norm weights 1-D and non-empty (the head dim comes from q_norm)."""
    for k, (fpath, ti) in src.locations.items():
        if k in MARKER_KEYS or k.endswith(".comfy_quant"):
            continue
        if ti.shape and 0 in ti.shape:
            raise CheckpointError(f"'{fpath}': tensor {k!r} has shape {list(ti.shape)}: an empty tensor (zero-size "
                                  "dimension); the checkpoint is broken or truncated")
        if _NORM_RX.search(k) and len(ti.shape) != 1:
            raise CheckpointError(f"'{fpath}': norm weight {k!r} has shape {list(ti.shape)}; a norm weight is 1-D "
                                  "[dim] with dim >= 1")


def _check_ndims(src: H3Source, shapes: dict[str, tuple[int, ...]]) -> None:
    """The converted inventory's weights have the ranks H3 uses (linear 2-D, bias / norm / rope 1-D)."""
    for k, s in shapes.items():
        if k.endswith(QUANT_SIDECARS) or k in MARKER_KEYS:
            continue
        if k.endswith(".bias") or _NORM_RX.search(k) or k == "rope.inv_freq":
            want = 1
        elif k == "adaln_t_table" or (k.endswith(".weight") and k.split(".")[-2] not in ("to_gate_compress",)):
            want = 2
        else:
            continue
        if len(s) != want:
            fpath = src.locations.get(k, (src.path,))[0]
            raise CheckpointError(f"'{fpath}': tensor {k!r} has shape {list(s)}; expected a {want}-D tensor")


def _plan(src: H3Source) -> tuple[list[_Op], dict, list[str]]:
    _check_tensors(src)
    keys = set(src.locations)
    ops: list[_Op] = []
    passthrough: list[str] = []
    if src.layout == "diffusers":
        if not isinstance(src.config, dict):
            raise CheckpointError(f"'{src.path}': diffusers H3 checkpoints need their config.json next to the weights "
                                  "(rope_freq_dim is required to rebuild 'rope.inv_freq', which diffusers drops)")
        if "rope.inv_freq" in keys:
            raise CheckpointError(f"'{src.path}': diffusers layout but holds 'rope.inv_freq'; inconsistent layout")
        handled = set()
        for pre_d, pre_o in (("transformer_blocks.", "blocks."), ("token_refiner.refiner_blocks.", "token_refiner.blocks.")):
            for i in _block_indices(keys, pre_d):
                b = f"{pre_d}{i}.attn."
                parts = [b + "to_q.weight", b + "to_k.weight", b + "to_v.weight"]
                infos = [_need(src, x) for x in parts]
                if len({ti.shape for ti in infos}) != 1 or len(infos[0].shape) != 2:
                    raise CheckpointError(f"'{src.path}': cannot merge {parts[0]!r}/{parts[1]!r}/{parts[2]!r}: shapes "
                                          f"{[list(ti.shape) for ti in infos]} differ (must be three equal [inner, hidden])")
                if len({ti.dtype for ti in infos}) != 1:
                    raise CheckpointError(f"'{src.path}': cannot merge {parts[0]!r}: to_q/to_k/to_v dtypes "
                                          f"{[ti.dtype for ti in infos]} differ")
                ops.append(_Op(f"{pre_o}{i}.attn.qkv_proj.weight", "merge_qkv", tuple(parts)))
                handled.update(parts)
                for sfx in ("to_q.bias", "to_k.bias", "to_v.bias"):
                    if b + sfx in keys:
                        raise CheckpointError(f"'{src.path}': tensor {b + sfx!r}: H3 qkv has no bias; not an H3 checkpoint?")
                fc = f"{pre_d}{i}.ff.net.0.proj.weight"
                ti = _need(src, fc)
                if len(ti.shape) != 2 or ti.shape[0] % 2:
                    raise CheckpointError(f"'{src.path}': tensor {fc!r} has shape {list(ti.shape)}; expected [2*ffn, hidden]")
                ops.append(_Op(f"{pre_o}{i}.mlp.fc1.weight", "swap_halves", (fc,)))
                handled.add(fc)
        for k in sorted(keys - handled):
            if k.endswith(QUANT_SIDECARS):
                raise CheckpointError(f"'{src.path}': tensor {k!r}: quantized diffusers-layout H3 checkpoints are not "
                                      "supported (their rows would need reordering); use a ComfyUI-layout repack")
            new = _rename_diffusers(k)
            if new is None:
                raise CheckpointError(f"'{src.path}': unknown diffusers tensor {k!r} (not in the H3 diffusers key map)")
            ops.append(_Op(new, "copy", (k,)))
        n = src.config.get("rope_freq_dim")
        # absent from config.json means diffusers' own class default, rope_theta=10000.0 (h3.md §config table)
        theta = src.config.get("rope_theta", 10000.0)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not isinstance(theta, (int, float)) or theta <= 0:
            raise CheckpointError(f"'{src.path}': config.json rope_freq_dim={n!r} / rope_theta={theta!r} are not a "
                                  "positive integer / positive number")
        ops.append(_Op("rope.inv_freq", "inv_freq", (), (n, float(theta))))
    else:
        heads = head_dim = None
        for k in sorted(keys):
            if src.layout == "official" and k.endswith("attn.qkv_proj.weight"):
                qn = k[: -len("qkv_proj.weight")] + "q_norm.weight"
                hd = _need(src, qn, f" (needed to de-interleave {k!r})").shape[0]
                rows = src.locations[k][1].shape[0]
                if rows % (3 * hd):
                    raise CheckpointError(f"'{src.path}': tensor {k!r} has {rows} rows, not a multiple of 3 x head_dim {hd}")
                if src.locations[k][1].dtype not in FLOAT_DTYPES or k[:-len("weight")] + "comfy_quant" in keys:
                    raise CheckpointError(f"'{src.path}': tensor {k!r} is quantized ({src.locations[k][1].dtype}); "
                                          "quantized official-layout shards are not supported (rows would need reordering)")
                heads, head_dim = rows // (3 * hd), hd
                ops.append(_Op(k, "deinterleave", (k,), (heads, hd)))
            else:
                ops.append(_Op(k, "copy", (k,)))
        if src.layout == "official" and isinstance(src.config, dict) and heads is not None:
            ch, cd = src.config.get("num_attention_heads"), src.config.get("attention_head_dim")
            if (ch is not None and ch != heads) or (cd is not None and cd != head_dim):
                raise CheckpointError(f"'{src.path}': config.json says {ch} heads x {cd} but the qkv/q_norm shapes give "
                                      f"{heads} x {head_dim}; config and weights do not match")
    return ops, _check_inventory(src, ops, passthrough), passthrough


def _check_inventory(src: H3Source, ops: list[_Op], passthrough: list[str]) -> dict:
    """Full structural check on the converted names/shapes; returns the detected config."""
    shapes: dict[str, tuple[int, ...]] = {}
    for op in ops:
        if op.kind == "merge_qkv":
            s = src.locations[op.srcs[0]][1].shape
            shapes[op.out] = (3 * s[0], s[1])
        elif op.kind == "inv_freq":
            shapes[op.out] = (op.arg[0],)
        else:
            shapes[op.out] = src.locations[op.srcs[0]][1].shape
    out = set(shapes)
    _check_ndims(src, {k: v for k, v in shapes.items() if k not in passthrough})
    curve = "adaln_t_table" in out
    for k in TOP_KEYS + (() if curve else TIME_KEYS):
        if k not in out:
            raise CheckpointError(f"'{src.path}' ({src.layout} layout): required tensor {k!r} is missing "
                                  "(truncated or partial checkpoint?)")
    nb = _block_indices(out, "blocks.")
    nr = _block_indices(out, "token_refiner.blocks.")
    if not nb:
        raise CheckpointError(f"'{src.path}': no DiT blocks ('blocks.N.*') found")
    for name, idx, req in (("blocks.", nb, BLOCK_KEYS + DIT_EXTRA), ("token_refiner.blocks.", nr, BLOCK_KEYS)):
        if idx and idx != list(range(len(idx))):
            gap = next(i for i in range(len(idx) + 1) if i not in idx)
            raise CheckpointError(f"'{src.path}': block numbering has a gap: '{name}{gap}.*' is missing "
                                  f"(found {len(idx)} blocks up to {idx[-1]})")
        for i in idx:
            for r in req:
                if f"{name}{i}.{r}" not in out:
                    raise CheckpointError(f"'{src.path}' ({src.layout} layout): required tensor '{name}{i}.{r}' is missing")
    hidden = shapes["video_patch_proj.weight"][0]
    hd = shapes["blocks.0.attn.q_norm.weight"][0]
    for name in ("blocks.", "token_refiner.blocks."):
        for i in (nb if name == "blocks." else nr):
            q, k = shapes[f"{name}{i}.attn.q_norm.weight"], shapes[f"{name}{i}.attn.k_norm.weight"]
            if q != (hd,) or k != (hd,):
                raise CheckpointError(f"'{src.path}': '{name}{i}.attn.q_norm.weight' / 'k_norm.weight' have shapes "
                                      f"{list(q)} / {list(k)}; block 0's q_norm gives head_dim {hd}")
    cfg = {"hidden_size": hidden, "attention_head_dim": hd,
           "num_attention_heads": shapes["blocks.0.attn.qkv_proj.weight"][0] // (3 * hd),
           "num_layers": len(nb), "token_refiner_num_layers": len(nr),
           "ffn_hidden_size": shapes["blocks.0.mlp.fc1.weight"][0] // 2,
           "text_dim": shapes["condition_proj.weight"][1],
           "latents_dim": shapes["final_layer.video_out.weight"][0] // 4,
           "audio_latents_dim": shapes["final_layer.audio_out.weight"][0],
           "rope_inv_freq_len": shapes["rope.inv_freq"][0],
           "adaln_curve": curve,
           "gate_compress": "blocks.0.attn.to_gate_compress.weight" in out}
    if curve:
        cfg["adaln_curve_grid"], cfg["time_embed_dim"] = shapes["adaln_t_table"]
    else:
        cfg["time_embed_dim"] = shapes["time_embedder.proj_out.weight"][0]
    inner = cfg["num_attention_heads"] * hd
    for i in nb:
        q = shapes[f"blocks.{i}.attn.qkv_proj.weight"]
        if len(q) == 2 and q[0] != 3 * inner and f"blocks.{i}.attn.qkv_proj.comfy_quant" not in out:
            raise CheckpointError(f"'{src.path}': tensor 'blocks.{i}.attn.qkv_proj.weight' has {q[0]} rows, "
                                  f"block 0 has {3 * inner}; inconsistent blocks")
        a = shapes[f"blocks.{i}.adaln_proj.linear.weight"]
        if a[0] != 18 * hidden:
            raise CheckpointError(f"'{src.path}': tensor 'blocks.{i}.adaln_proj.linear.weight' has {a[0]} rows; "
                                  f"expected 18 x hidden = {18 * hidden}")
    if 6 * cfg["rope_inv_freq_len"] > hd:
        raise CheckpointError(f"'{src.path}': rope.inv_freq has {cfg['rope_inv_freq_len']} values; 6 x that exceeds "
                              f"head_dim {hd}")
    known = re.compile(r"^(blocks\.\d+\.(" + "|".join(re.escape(x) for x in BLOCK_KEYS + DIT_EXTRA)
                       + r"|attn\.to_gate_compress\.weight)|token_refiner\.blocks\.\d+\.("
                       + "|".join(re.escape(x) for x in BLOCK_KEYS) + r")|adaln_t_table)$")
    for k in sorted(out):
        if k in TOP_KEYS or k in TIME_KEYS or known.match(k) or k.endswith(QUANT_SIDECARS):
            continue
        passthrough.append(k)
    return cfg


def _quant_layers(src: H3Source) -> set[str]:
    """Layers ComfyUI will load as quantized: ``<layer>.comfy_quant`` tensors, the ``_quantization_metadata``
    safetensors metadata, or the old ``scaled_fp8`` marker with ``<layer>.scale_weight``."""
    keys = src.locations
    layers = {k[:-len(".comfy_quant")] for k in keys if k.endswith(".comfy_quant")}
    meta = (src.metadata or {}).get("_quantization_metadata")
    if meta:
        try:
            obj = strict_json_loads(meta, f"'{src.path}' __metadata__ '_quantization_metadata'",
                                  what="safetensors metadata value")
        except CheckpointError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
            raise CheckpointError(f"'{src.path}': __metadata__ '_quantization_metadata' must be a JSON object with a "
                                  "'layers' object")
        layers |= {k[len(src.prefix):] if src.prefix and k.startswith(src.prefix) else k for k in obj["layers"]}
    if "scaled_fp8" in keys:
        layers |= {k[:-len(".scale_weight")] for k in keys if k.endswith(".scale_weight")}
    return layers


def _check_scale_sidecars(src: H3Source, k: str, ti: TensorInfo) -> None:
    """A quantized (non-float) weight of a marked layer needs its scale tensors, decided from the headers: every
    comfy_quant format has ``.weight_scale`` (``asym_w4a8_int8``: ``.weight_s_rel``); packed nvfp4 (U8 codes with
    fp8 e4m3 block scales) also ``.weight_scale_2``. ComfyUI's loader otherwise stops after the whole file was
    read (``Missing INT8 weight scale``; for fp8 an AttributeError in comfy_kitchen)."""
    keys = src.locations
    base = k[: -len("weight")]
    scale = keys.get(base + "weight_scale")
    missing = None
    if scale is None and base + "weight_s_rel" not in keys:
        missing = base + "weight_scale"
    elif (scale is not None and ti.dtype == "U8" and scale[1].dtype == "F8_E4M3" and len(scale[1].shape) == 2
          and base + "weight_scale_2" not in keys):
        missing = base + "weight_scale_2"
    if missing:
        raise CheckpointError(f"'{keys[k][0]}': quantized weight {k!r} ({ti.dtype}) has no {missing!r} (its scale "
                              "tensor): the layer cannot be dequantized. The file is damaged or was cut short; "
                              "re-download or re-export it (DitKitH3ModelLoader 'model_name')")


def _check_dtypes(src: H3Source, cfg: dict) -> tuple[str | None, int]:
    keys = src.locations
    bulk: dict[str, list[str]] = {}
    quantized = 0
    qlayers = _quant_layers(src)
    for k, (fpath, ti) in keys.items():
        base = k.rsplit(".", 1)[0]
        if k.endswith(".comfy_quant") or k in MARKER_KEYS:
            continue
        marked = base in qlayers
        if ti.dtype not in FLOAT_DTYPES and not k.endswith(QUANT_SIDECARS) and not (marked and k.endswith(".weight")):
            what = "an integer" if ti.dtype.startswith(("I", "U")) else ("an fp8" if ti.dtype.startswith("F8") else "a non-float")
            raise CheckpointError(f"'{fpath}': tensor {k!r} is {what} tensor ({ti.dtype}) without a quantization marker "
                                  f"('{base}.comfy_quant'); ComfyUI would use its raw values as float weights (the "
                                  "model samples NaN or noise). Quantized layers need their comfy_quant marker; "
                                  "re-export the checkpoint")
        if marked and k.endswith(".weight"):
            quantized += 1
            if ti.dtype not in FLOAT_DTYPES:
                _check_scale_sidecars(src, k, ti)
            continue
        if k.endswith(QUANT_SIDECARS) or ti.dtype not in FLOAT_DTYPES:
            continue
        name = (_rename_diffusers(k) or k) if src.layout == "diffusers" else k
        if name.startswith(FP32_ISLANDS) or (cfg.get("adaln_curve") and "adaln_proj.linear." in name):
            continue
        bulk.setdefault(ti.dtype, []).append(k)
    if len(bulk) > 1:
        major = max(bulk, key=lambda d: len(bulk[d]))
        minor = sorted((d for d in bulk if d != major), key=lambda d: len(bulk[d]))[0]
        k = sorted(bulk[minor])[0]
        raise CheckpointError(f"'{src.locations[k][0]}': tensor {k!r} is {minor} while {len(bulk[major])} other "
                              f"non-fp32-island tensors are {major}; mixed-dtype shards (the bulk of an H3 checkpoint "
                              "must share one dtype; re-download or re-save the odd shard)")
    return (next(iter(bulk)) if bulk else None), quantized


# ------------------------------------------------------------------ execution

def _deinterleave(w: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    cols = w.shape[1:]
    return w.reshape(heads, 3, hd, *cols).transpose(0, 1).reshape(3 * heads * hd, *cols).contiguous()


def rope_inv_freq(n: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


def _validate_marker(src: H3Source, k: str, t: torch.Tensor) -> None:
    try:
        obj = strict_json_loads(bytes(t.to(torch.uint8).flatten().tolist()).decode("utf-8"),
                                f"'{src.path}', tensor {k!r}", what="JSON stored in a tensor")
    except UnicodeDecodeError:
        raise CheckpointError(f"'{src.path}': tensor {k!r} is not a UTF-8 JSON quantization marker") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("format"), str):
        raise CheckpointError(f"'{src.path}': quantization marker {k!r} must be a JSON object with a string 'format'")
    if obj.get("convrot"):   # ComfyUI loads it, then its int8 ConvRot matmul and any requantize cannot run it
        g = obj.get("convrot_groupsize", (obj.get("params") or {}).get("convrot_groupsize", 256)
                    if isinstance(obj.get("params"), dict) else 256)
        w = src.locations.get(k[: -len("comfy_quant")] + "weight")
        cols = w[1].shape[-1] if w is not None and len(w[1].shape) == 2 else None
        if (not isinstance(g, int) or isinstance(g, bool) or g < 4 or g & (g - 1) or (g.bit_length() - 1) % 2
                or (cols is not None and cols % g)):
            raise CheckpointError(f"'{src.path}': quantization marker {k!r} says convrot_groupsize {g!r}, which "
                                  + (f"does not divide the weight's width {cols}" if isinstance(g, int) and cols
                                     and g >= 4 and cols % g else "is not a power of 4 (4, 16, 64, 256, ...)")
                                  + ": the marker and the weight disagree (a damaged or mislabelled file). "
                                  "Re-download or re-export it (DitKitH3ModelLoader 'model_name')")


@dataclass
class H3Plan:
    """Everything decided from the headers (nothing read yet): the ordered conversion ops and the converted
    inventory (``out key -> (shape, safetensors dtype)``), so a writer can lay out a file before reading."""

    src: H3Source
    ops: list[_Op]
    cfg: dict
    passthrough: list[str]
    bulk: str | None
    quantized: int
    inventory: dict[str, tuple[tuple[int, ...], str]]
    converted: Counter = field(default_factory=Counter)
    tensors_read: int = 0
    bytes_read: int = 0

    def report(self, tensors_out: int) -> H3LoadReport:
        cfg = self.cfg
        variant = ("curve" if cfg["adaln_curve"] else "full") + ("+fasth3-gates" if cfg["gate_compress"] else "") \
            + ("+quantized" if self.quantized else "")
        return H3LoadReport(path=self.src.path, layout=self.src.layout, variant=variant, shards=len(self.src.files),
                            tensors_read=self.tensors_read, tensors_out=tensors_out, converted=dict(self.converted),
                            bytes_read=self.bytes_read, bulk_dtype=self.bulk, config=cfg,
                            passthrough=self.passthrough, quantized=self.quantized)


def plan_h3(path: str | os.PathLike) -> H3Plan:
    """Detect and validate (headers, index and config JSON only) -> the conversion plan."""
    src = detect(path)
    ops, cfg, passthrough = _plan(src)
    bulk, quantized = _check_dtypes(src, cfg)
    outs = [o.out for o in ops]
    if len(set(outs)) != len(outs):
        dup = next(o for o in outs if outs.count(o) > 1)
        raise CheckpointError(f"'{src.path}': two source tensors map to {dup!r}; inconsistent layout")
    # group by file so each shard is opened once, in shard order
    order = {f: i for i, f in enumerate(src.files)}
    ops.sort(key=lambda o: (min((order[src.locations[s][0]] for s in o.srcs), default=len(order)), o.out))
    inventory: dict[str, tuple[tuple[int, ...], str]] = {}
    for op in ops:
        if op.kind == "inv_freq":
            inventory[op.out] = ((op.arg[0],), "F32")
            continue
        ti = src.locations[op.srcs[0]][1]
        shape = (3 * ti.shape[0], ti.shape[1]) if op.kind == "merge_qkv" else tuple(ti.shape)
        inventory[op.out] = (shape, ti.dtype)
    return H3Plan(src, ops, cfg, passthrough, bulk, quantized, inventory)


def _row_blocks(op: _Op, rows: tuple[int, ...]) -> list[list[tuple[int, int, int]]]:
    """Per source of a row-permuting op: ``[(src_row, rows, dst_row), ...]`` of the converted tensor (the qkv
    de-interleave ``reshape(heads, 3, hd, ...).transpose(0, 1)``, the qkv merge ``cat(q, k, v)``, the fc1 halves
    swap ``cat(x[n:], x[:n])``)."""
    if op.kind == "deinterleave":
        heads, hd = op.arg
        return [[((h * 3 + j) * hd, hd, (j * heads + h) * hd) for j in range(3) for h in range(heads)]]
    if op.kind == "merge_qkv":
        return [[(0, r, sum(rows[:i]))] for i, r in enumerate(rows)]
    if op.kind == "swap_halves":
        n = rows[0] // 2
        return [[(n, n, 0), (0, n, n)]]
    raise AssertionError(op.kind)  # pragma: no cover - plan kinds are closed


def iter_h3_tensors(plan: H3Plan, progress: ProgressFn | None = None,
                    on_file: Callable[[str, int, int], None] | None = None,
                    alloc: Callable[..., torch.Tensor] | None = host_memory.empty,
                    scratch_keys: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Read + convert one tensor at a time, in plan order: yields ``(ComfyUI key, tensor)``; nothing is kept.

    The bytes go from the file straight into the output tensor, rows in their converted order (the qkv
    de-interleave, the diffusers qkv merge and fc1 swap are row permutations read in place, no second copy);
    ``alloc(shape, dtype)`` makes each output (default :func:`host_memory.empty`: a tensor the caller keeps does
    not fragment the heap). ``progress(done, total)`` is called after each output tensor; ``on_file(path, i, n)``
    when a new file is opened. Counters (conversions, bytes read) accumulate on ``plan``. The tensors of
    ``scratch_keys`` (ComfyUI keys) are read into one reused :class:`host_memory.Scratch` buffer instead: each is
    valid only until the next item is asked for (for a consumer that uses it at once, the streaming quantizer)."""
    src, ops = plan.src, plan.ops
    scratch = host_memory.Scratch() if scratch_keys else None
    order = {f: i for i, f in enumerate(src.files)}
    last_use = {src.locations[s][0]: i for i, o in enumerate(ops) for s in o.srcs}
    conv = plan.converted
    handles: dict[str, SafeFile] = {}
    t = None
    make = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    try:
        for done, op in enumerate(ops, start=1):
            fhs = []
            for s in op.srcs:
                fpath, ti = src.locations[s]
                fh = handles.get(fpath)
                if fh is None:
                    fh = handles[fpath] = SafeFile(fpath).__enter__()
                    if on_file:
                        on_file(fpath, order[fpath] + 1, len(src.files))
                fhs.append((fh, ti))
                plan.tensors_read += 1
                plan.bytes_read += ti.nbytes
            into = scratch.take if scratch is not None and op.out in scratch_keys else alloc
            if op.kind == "copy":
                t = fhs[0][0].get(src.prefix + op.srcs[0], alloc=into)
                if op.out.endswith(".comfy_quant"):
                    _validate_marker(src, op.out, t)
            elif op.kind in ("deinterleave", "merge_qkv", "swap_halves"):
                infos = [ti for _, ti in fhs]
                rows = tuple(ti.shape[0] for ti in infos)
                t = (into or make)((sum(rows),) + tuple(infos[0].shape[1:]), infos[0].torch_dtype)
                for (fh, _), name, blocks in zip(fhs, op.srcs, _row_blocks(op, rows)):
                    fh.read_rows_into(src.prefix + name, t, blocks)
                conv[{"deinterleave": "qkv de-interleaved", "merge_qkv": "qkv merged",
                      "swap_halves": "fc1 halves swapped"}[op.kind]] += 1
            elif op.kind == "inv_freq":
                t = rope_inv_freq(*op.arg)
                conv["rope.inv_freq rebuilt"] += 1
            else:  # pragma: no cover - plan kinds are closed
                raise AssertionError(op.kind)
            if op.kind == "copy" and op.out != op.srcs[0]:
                conv["renamed"] += 1
            fhs.clear()
            for f in [f for f in handles if last_use[f] == done - 1]:   # close a shard after its last tensor
                handles.pop(f).close()
            if done < len(ops):       # the disk reads the next tensor while this one is quantized (page cache)
                for nxt in ops[done].srcs:
                    fh = handles.get(src.locations[nxt][0])
                    if fh is not None:
                        fh.prefetch(src.prefix + nxt)
            yield op.out, t
            t = None
            if progress:
                progress(done, len(ops))
    except BaseException:
        t = None  # noqa: F841 - a traceback that keeps this frame must not keep the tensor alive
        raise
    finally:
        for fh in handles.values():
            fh.close()


def load_h3_state_dict(path: str | os.PathLike, progress: ProgressFn | None = None,
                       on_file: Callable[[str, int, int], None] | None = None) -> tuple[dict[str, torch.Tensor], H3LoadReport]:
    """Detect, validate (headers only), then read + convert one tensor at a time -> (ComfyUI state dict, report).

    ``progress(done, total)`` is called after each output tensor; ``on_file(path, i, n)`` when a new file is opened.
    """
    plan = plan_h3(path)
    sd: dict[str, torch.Tensor] = {}
    t = None
    try:
        for k, t in iter_h3_tensors(plan, progress, on_file):
            sd[k] = t
    except BaseException:
        sd.clear()
        t = None
        raise
    return sd, plan.report(len(sd))


def comfy_metadata(path: str | os.PathLike | H3Source) -> dict[str, str] | None:
    """The safetensors ``__metadata__`` ComfyUI should see (single files only; its ``config`` JSON overrides), of
    ``path`` or of an already detected source (a plan's ``src``: no second read of the headers)."""
    src = path if isinstance(path, H3Source) else detect(path)
    return dict(src.metadata) if src.layout == "comfy" and src.metadata else None
