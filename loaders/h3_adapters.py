"""MiniMax H3 adapters (LoRA, LoKr, LoHa, FastVideo full-rank deltas / assigned weights, curve-form AdaLN sets)
mapped exactly onto ComfyUI's H3 weights (plain torch; no ComfyUI imports).

Steps, all pure functions:

1. :func:`parse` groups the file's keys into modules by suffix (``lora_A``/``lora_B`` with or without PEFT's
   ``.default`` adapter infix, ``lora_down``/``lora_up``, ``alpha``; LyCORIS ``lokr_*`` (parsed by the shared
   LoKr core, ``loaders/lokr_apply.py``) and ``hada_*``; FastVideo ``.diff`` / ``.diff_b`` / ``.set_weight``; curve-form
   ``adaln_t_table`` and full ``adaln_proj.linear`` replacements). Every key ends up applied, unused (another
   component, with the reason) or refused (an error naming the key): there are no silent skips.
2. :func:`plan` maps every module onto the ComfyUI H3 key layout (``diffusion_model.blocks.N.attn.qkv_proj`` ...),
   through the names the H3 loader already converts (``loaders/h3.py`` ``_rename_diffusers``: diffusers names,
   ``token_refiner.refiner_blocks``), plus the two row maps of an adapter: diffusers ``to_q/to_k/to_v`` land on
   their row third of the fused qkv, ``ff.net.0.proj`` rows ``[value; gate]`` are swapped to ``[gate; value]``,
   and an adapter trained on the official per-head interleaved qkv ``[h0: q,k,v; h1: ...]`` has its ΔW rows
   de-interleaved onto ComfyUI's ``[q_all; k_all; v_all]``. It decides the qkv layout, the scale of every module,
   validates shapes / finiteness / alpha, and raises :class:`AdapterError` before anything is touched.
3. :func:`apply_item_` adds ``strength * ΔW`` of one plan item into the weight ComfyUI hands a patch, through the
   chunked fused kernel of ``kernels/delta_fuse.py`` (ΔW of a 21504 x 5376 qkv is never held whole).

qkv layout (a property of the adapter, not of the base: the base is always converted to ComfyUI's layout):

==================================================== ===============================================================
adapter                                              layout of its ``qkv_proj`` rows
==================================================== ===============================================================
diffusers names ``to_q`` / ``to_k`` / ``to_v``        per projection: no interleave question
node input ``qkv_layout`` interleaved / contiguous    as given (the file's own hint, if any, is reported)
metadata ``qkv_layout`` = interleaved / contiguous    as written
DiffSynth-Studio: original names, no prefix, PEFT's   interleaved: it trains on the raw checkpoint's per-head
``.default`` infix                                    interleaved qkv (diffusers' H3 LoRA converter de-interleaves
                                                      exactly these files)
original names with ``diffusion_model.``, no prefix   contiguous: ai-toolkit / ComfyUI, the reference generate.py and
(no ``.default``) or ``lora_unet_``                   musubi-tuner train on the ``[q_all; k_all; v_all]`` module tree
                                                      (``diffusers/loaders/lora_conversion_utils.py``
                                                      ``_convert_non_diffusers_minimax_h3_lora_to_diffusers``)
anything else on a fused ``qkv_proj`` (PEFT           refused: the message names the ambiguity and ``qkv_layout``
``base_model.model.*``, ``lycoris_*``, ...)
==================================================== ===============================================================

Scale (ΔW = scale * B @ A, per module; the report says which rule gave it):

* ``.alpha`` key: alpha / rank (rank = rows of A). alpha 0, NaN or Inf is refused.
* PEFT config (``adapter_config.json`` next to a PEFT-layout file, or diffusers ``lora_adapter_metadata`` in either
  layout, component-prefixed ``transformer.r`` / ``transformer.lora_alpha`` included): ``lora_alpha / r`` with
  ``rank_pattern`` / ``alpha_pattern``, ``lora_alpha / sqrt(r)`` with ``use_rslora``.
* FastVideo ``format = fastvideo-lora-v2``: 1.0 (``W = W_base + B @ A``, the format's own ``application``
  metadata; h3.md §9 [VO:fasth3.py]).
* DiffSynth-Studio (bare original names with ``.default`` infix, no config): alpha = rank -> 1.0
  (``modelscope/DiffSynth-Studio:diffsynth/trainers/utils.py`` ``add_lora_to_model``: ``lora_alpha`` defaults
  to ``lora_rank`` and the training scripts pass none).
* diffusers names without metadata: ``lora_alpha = r`` -> 1.0, as diffusers loads them
  (``huggingface/diffusers:src/diffusers/utils/peft_utils.py`` ``get_peft_kwargs``); not with PEFT's ``.default.``
  infix (lightx2v's Turbo LoRAs: their reference uses alpha 8 whatever the rank): refused, naming ``scale``.
* ``diffusion_model.*`` + ``lora_up``/``lora_down`` without ``.alpha``: 1.0, ComfyUI's own rule for such files
  (``comfy/weight_adapter/lora.py`` ``LoRAAdapter.calculate_weight``: no alpha -> 1.0).
* metadata ``alpha`` in a file without ``.alpha`` keys: alpha / rank (diffusers ``MiniMaxH3LoraLoaderMixin``).
* other alpha-less LoRAs on original names (no prefix, ``lora_unet_``): alpha = rank -> 1.0, as diffusers'
  ``MiniMaxH3LoraLoaderMixin.lora_state_dict`` loads them (the convention larryvrh/MiniMax-H3-Turbo-Lora states).
* LoKr: the shared LoKr core's rules (``loaders/lokr_apply.py``). LoHa: alpha / rank (LyCORIS ``LohaModule``).
* ``.diff`` / ``.diff_b``: 1.0 (full-rank deltas). ``.set_weight`` / curve-form full AdaLN weights: assigned, i.e.
  ``W = W_base + strength * (W_new - W_base)`` (ComfyUI's pruned-AdaLN merge rule, h3.md §9).
* otherwise: refused naming what is missing, unless the node's ``scale`` input sets it.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import AdapterError
from ..kernels import delta_fuse
from ..report import Report
from . import h3 as h3core
from . import h3_turbo_curve as turbo_curve
from . import lokr_apply as lokr_core
from .lokr_math import rebuild_w1, rebuild_w2

QKV_LAYOUTS = ("auto", "interleaved", "contiguous")
FASTVIDEO_FORMAT = "fastvideo-lora-v2"
PEFT_CONFIG_NAME = lokr_core.PEFT_CONFIG_NAME
TABLE_TOL = 1e-3          # ComfyUI's pruned-AdaLN loader warns above this table difference; ditkit refuses

# suffix -> (family, role)
_LORA_SUFFIXES = (
    ("lora_A.default.weight", "peft", "down"), ("lora_B.default.weight", "peft", "up"),
    ("lora_A.weight", "peft", "down"), ("lora_B.weight", "peft", "up"),
    ("lora_down.weight", "kohya", "down"), ("lora_up.weight", "kohya", "up"),
    ("lora.down.weight", "kohya", "down"), ("lora.up.weight", "kohya", "up"),
)
_AUX_SUFFIXES = ("alpha",)
_UNSUPPORTED = {
    "lora_mid.weight": "LoRA Tucker core (lora_mid) is for conv layers; H3 has none",
    "dora_scale": "DoRA (weight-decomposed) adapters are not supported",
    "hada_t1": "LoHa Tucker cores (hada_t1/hada_t2) are for conv layers; H3 has none",
    "hada_t2": "LoHa Tucker cores (hada_t1/hada_t2) are for conv layers; H3 has none",
    "diff_m": "'.diff_m' (magnitude delta of a DoRA export) is not supported",
    "lora_magnitude_vector": "PEFT DoRA magnitude vectors are not supported",
    "lora_magnitude_vector.default.weight": "PEFT DoRA magnitude vectors are not supported",
}
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LOKR = lokr_core.FACTOR_KEYS
# prefixes a writer puts before the module path (longest first)
_DOTTED = ("base_model.model.transformer.", "base_model.model.", "model.diffusion_model.", "diffusion_model.",
           "transformer.", "")
_UNDERSCORE = ("lora_unet_", "lycoris_", "lora_transformer_")
# keys of other components that may travel in the same file: reported unused, never applied
_OTHER_COMPONENTS = ("lora_te", "text_encoder", "text_encoders.", "te.", "te1.", "te2.", "vae.", "audio_vae.")


# ------------------------------------------------------------------------------------------------ geometry
@dataclass
class Geometry:
    shapes: dict[str, tuple[int, ...]]      # ComfyUI key (diffusion_model.*) -> shape
    heads: int
    head_dim: int
    hidden: int
    curve: bool
    gates: dict[int, tuple[int, ...]]       # block index -> gate shape (from the loader attachment), may be empty
    n_blocks: int
    n_refiner: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


def geometry(shapes: dict[str, tuple[int, ...]], gates: dict | None = None) -> Geometry:
    p = "diffusion_model."
    need = (p + "blocks.0.attn.qkv_proj.weight", p + "blocks.0.attn.q_norm.weight", p + "video_patch_proj.weight")
    for k in need:
        if k not in shapes:
            raise AdapterError(f"the model has no '{k}': not a MiniMax H3 model (H3 adapters need an H3 base)")
    hd = shapes[need[1]][0]
    rows = shapes[need[0]][0]
    nb = len({k.split(".")[2] for k in shapes if k.startswith(p + "blocks.")})
    nr = len({k.split(".")[3] for k in shapes if k.startswith(p + "token_refiner.blocks.")})
    g = {int(i): tuple(v) for i, v in (gates or {}).items()}
    return Geometry(dict(shapes), rows // (3 * hd), hd, shapes[need[2]][0], p + "adaln_t_table" in shapes, g, nb, nr)


def deinterleave_map(heads: int, head_dim: int) -> torch.Tensor:
    """Row map ComfyUI row -> official interleaved row: ComfyUI row ``j*inner + h*hd + d`` (j = q,k,v) holds
    official row ``h*3*hd + j*hd + d``."""
    j = torch.arange(3).view(3, 1, 1)
    h = torch.arange(heads).view(1, heads, 1)
    d = torch.arange(head_dim).view(1, 1, head_dim)
    return (h * 3 * head_dim + j * head_dim + d).reshape(-1).to(torch.int64)


def swap_map(rows: int) -> torch.Tensor:
    n = rows // 2
    return torch.cat([torch.arange(n, rows), torch.arange(0, n)]).to(torch.int64)


# ------------------------------------------------------------------------------------------------ targets
@dataclass(frozen=True)
class Target:
    key: str                         # ComfyUI state-dict key, or "gate:N" for a FastH3 gate (loader attachment)
    rows: Optional[tuple[int, int]]  # row slice of the weight; None = whole
    shape: tuple[int, ...]           # shape of the (slice of the) weight
    naming: str                      # "original" | "diffusers"
    swap: bool = False               # diffusers ff.net.0.proj: rows [value; gate]
    fused_qkv: bool = False          # a whole fused qkv_proj: the adapter's qkv layout matters

    def describe(self) -> str:
        if self.key.startswith("gate:"):
            return f"blocks.{self.key[5:]}.attn.to_gate_compress.weight (sparse-attention gate attachment)"
        k = self.key[len("diffusion_model."):]
        return k if self.rows is None else f"{k}[{self.rows[0]}:{self.rows[1]}]"


def _native_key(g: Geometry, name: str, param: str) -> str | None:
    k = f"diffusion_model.{name}.{param}"
    return k if k in g.shapes else None


def resolve(g: Geometry, module: str, param: str = "weight") -> Target | None:
    """Target of a module path with the writer's prefix removed (original or diffusers names), or None."""
    m = re.fullmatch(r"blocks\.(\d+)\.attn\.to_gate_compress|transformer_blocks\.(\d+)\.attn\.to_gate_compress", module)
    if m and param == "weight":
        i = int(m.group(1) or m.group(2))
        if i >= g.n_blocks:
            return None
        shape = g.gates.get(i, (g.inner, g.hidden))
        return Target(f"gate:{i}", None, shape, "original" if m.group(1) else "diffusers")
    k = _native_key(g, module, param)
    if k is not None:
        s = g.shapes[k]
        return Target(k, None, s, "original", fused_qkv=module.endswith("attn.qkv_proj") and param == "weight")
    m = re.fullmatch(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.attn\.to_([qkv])", module)
    if m and param == "weight":
        base = "blocks" if m.group(1) == "transformer_blocks" else "token_refiner.blocks"
        k = f"diffusion_model.{base}.{m.group(2)}.attn.qkv_proj.weight"
        if k not in g.shapes:
            return None
        j = "qkv".index(m.group(3))
        return Target(k, (j * g.inner, (j + 1) * g.inner), (g.inner, g.shapes[k][1]), "diffusers")
    new = h3core._rename_diffusers(f"{module}.{param}")
    if new is not None and "diffusion_model." + new in g.shapes:
        k = "diffusion_model." + new
        return Target(k, None, g.shapes[k], "diffusers", swap=new.endswith("mlp.fc1.weight"))
    return None


def _diffusers_modules(g: Geometry) -> list[str]:
    names = [a[:-1] for a, _ in h3core._D_TOP]
    for pre, n in (("transformer_blocks", g.n_blocks), ("token_refiner.refiner_blocks", g.n_refiner)):
        for i in range(n):
            for k in h3core._D_BLOCK:
                names.append(f"{pre}.{i}.{k.rsplit('.', 1)[0]}")
            names += [f"{pre}.{i}.attn.to_{p}" for p in "qkv"]
    return names


def underscored(g: Geometry) -> dict[str, str]:
    """``blocks_0_attn_qkv_proj`` -> ``blocks.0.attn.qkv_proj`` for every name :func:`resolve` knows (kohya /
    LyCORIS / OneTrainer underscore naming); names that collide once underscored are left out."""
    names = {k[len("diffusion_model."):].rsplit(".", 1)[0] for k in g.shapes if k.startswith("diffusion_model.")}
    names |= set(_diffusers_modules(g))
    names |= {f"blocks.{i}.attn.to_gate_compress" for i in range(g.n_blocks)}
    out: dict[str, str] = {}
    clash: set[str] = set()
    for n in names:
        u = n.replace(".", "_")
        if u in out and out[u] != n:
            clash.add(u)
        out[u] = n
    for u in clash:
        del out[u]
    return out


def strip_prefix(g: Geometry, prefix: str, under: dict[str, str]) -> tuple[str, str] | None:
    """(writer prefix, module path) of an adapter module prefix, or None."""
    for p in _UNDERSCORE:
        if prefix.startswith(p) and prefix[len(p):] in under:
            return p, under[prefix[len(p):]]
    for p in _DOTTED:
        if prefix.startswith(p):
            rest = prefix[len(p):]
            for param in ("weight", "bias"):
                if resolve(g, rest, param) is not None:
                    return p, rest
    return None


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class Module:
    prefix: str                       # as written in the file (before the suffix)
    kind: str                         # lowrank | lokr | loha | diff | diff_b | set | set_b | table
    keys: list[str]
    tensors: dict[str, torch.Tensor]
    family: str = ""                  # peft | kohya | lycoris | fastvideo | curve
    alpha: Optional[float] = None
    alpha_key: Optional[str] = None
    lokr: Optional[lokr_core.LoKrModule] = None


AdapterFile = lokr_core.AdapterFile   # one reader for both adapter paths: ``lokr_apply.read_adapter_file``


def read_adapter_file(path: str, g: Geometry | None = None, input_name: str | None = None) -> AdapterFile:
    """:func:`lokr_apply.read_adapter_file` naming the file "adapter" in its errors; with the model's geometry
    ``g``, every declared tensor size is bounded by the model's weights (and gates) before a byte is read."""
    shapes = None
    if g is not None:
        shapes = dict(g.shapes)
        shapes.update({f"gate:{i}": tuple(s) for i, s in g.gates.items()})
    return lokr_core.read_adapter_file(path, what="adapter", shapes=shapes, input_name=input_name)


def _split_key(k: str) -> tuple[str, str] | None:
    """(module prefix, suffix) for a known adapter suffix."""
    if k in ("adaln_t_table", "diffusion_model.adaln_t_table", "adaln_t_table.set_weight",
             "diffusion_model.adaln_t_table.set_weight"):
        return "", "table"
    for suf, _, _ in _LORA_SUFFIXES:
        if k.endswith("." + suf):
            return k[: -len(suf) - 1], suf
    for suf in sorted(list(_UNSUPPORTED) + list(_AUX_SUFFIXES) + list(_LOHA) + list(_LOKR) + ["lokr_t1"]
                      + ["diff", "diff_b", "set_weight", "weight.set_weight", "bias.set_weight"], key=len, reverse=True):
        if k.endswith("." + suf):
            return k[: -len(suf) - 1], suf
    if k.endswith(".adaln_proj.linear.weight") or k.endswith(".adaln_proj.linear.bias"):
        return k.rsplit(".", 1)[0], "curve_" + k.rsplit(".", 1)[1]
    return None


def parse(sd: dict[str, torch.Tensor], source: str) -> tuple[dict[str, Module], dict[str, str]]:
    """-> (modules by (prefix, kind), unused key -> why). Raises on any key it cannot place."""
    groups: dict[str, dict[str, str]] = {}
    unused: dict[str, str] = {}
    modules: dict[str, Module] = {}
    for k in sd:
        if k.startswith(_OTHER_COMPONENTS):
            unused[k] = "another component's adapter (text encoder / VAE), not the H3 transformer"
            continue
        sp = _split_key(k)
        if sp is None:
            raise AdapterError(f"{source}: key {k!r} is not an adapter tensor ditkit knows (no lora_A/lora_B, "
                               "lora_down/lora_up, alpha, lokr_*, hada_*, .diff, .diff_b or .set_weight suffix)")
        prefix, suf = sp
        if suf in _UNSUPPORTED:
            raise AdapterError(f"{source}: key {k!r}: {_UNSUPPORTED[suf]}; nothing was applied")
        if suf == "lokr_t1":
            raise AdapterError(f"{source}: key {k!r}: LoKr Tucker core on w1 is not supported; nothing was applied")
        if suf == "table":
            modules["adaln_t_table"] = Module(k, "table", [k], {"table": sd[k]}, family="curve")
            continue
        if suf in ("diff", "diff_b", "set_weight", "weight.set_weight", "bias.set_weight", "curve_weight", "curve_bias"):
            kind = {"diff": "diff", "diff_b": "diff_b", "set_weight": "set", "weight.set_weight": "set",
                    "bias.set_weight": "set_b", "curve_weight": "set", "curve_bias": "set_b"}[suf]
            fam = "curve" if suf.startswith("curve") or suf in ("weight.set_weight", "bias.set_weight") else "fastvideo"
            mk = f"{prefix}|{kind}"
            if mk in modules:
                raise AdapterError(f"{source}: key {k!r} and {modules[mk].keys[0]!r} both set module '{prefix}' "
                                   f"({kind}); duplicated names")
            modules[mk] = Module(prefix, kind, [k], {"value": sd[k]}, family=fam)
            continue
        groups.setdefault(prefix, {})[suf] = k
    for prefix, parts in groups.items():
        lora = [s for s, _, _ in _LORA_SUFFIXES if s in parts]
        loha = [s for s in _LOHA if s in parts]
        lokr = [s for s in _LOKR if s in parts]
        kinds = [n for n, v in (("LoRA", lora), ("LoHa", loha), ("LoKr", lokr)) if v]
        if len(kinds) > 1:
            raise AdapterError(f"{source}: module '{prefix}' mixes {' and '.join(kinds)} tensors "
                               f"({', '.join(sorted(parts.values())[:4])}); one adapter type per module")
        if not kinds:
            for s, k in parts.items():
                raise AdapterError(f"{source}: key {k!r} ('{s}') has no adapter factors for module '{prefix}'")
        keys = sorted(parts.values())
        m = Module(prefix, {"LoRA": "lowrank", "LoHa": "loha", "LoKr": "lokr"}[kinds[0]], keys, {})
        if "alpha" in parts:
            a = sd[parts["alpha"]]
            if a.numel() != 1:
                raise AdapterError(f"{source}: key {parts['alpha']!r} must be a scalar alpha, got shape {tuple(a.shape)}")
            m.alpha, m.alpha_key = float(a.float().item()), parts["alpha"]
            if not math.isfinite(m.alpha) or m.alpha == 0.0:
                raise AdapterError(f"{source}: key {parts['alpha']!r} is {m.alpha!r}; alpha must be finite and "
                                   "non-zero (the scale alpha / rank would be 0 or undefined)")
        if m.kind == "lowrank":
            fams = {f for s, f, _ in _LORA_SUFFIXES if s in parts}
            downs = [s for s, _, r in _LORA_SUFFIXES if s in parts and r == "down"]
            ups = [s for s, _, r in _LORA_SUFFIXES if s in parts and r == "up"]
            if len(downs) != 1 or len(ups) != 1 or len(fams) != 1:
                raise AdapterError(f"{source}: module '{prefix}' needs exactly one down (lora_A / lora_down) and one "
                                   f"up (lora_B / lora_up) matrix of one naming, has {sorted(lora)}")
            m.family = fams.pop()
            m.tensors = {"down": sd[parts[downs[0]]], "up": sd[parts[ups[0]]]}
            if ".default." in parts[downs[0]]:
                m.family = "peft-default"
        elif m.kind == "loha":
            missing = [s for s in _LOHA if s not in parts]
            if missing:
                raise AdapterError(f"{source}: LoHa module '{prefix}' lacks {missing} (needs hada_w1_a/b and hada_w2_a/b)")
            m.family = "lycoris"
            m.tensors = {s: sd[parts[s]] for s in _LOHA}
        else:
            m.family = "lycoris"
            m.tensors = {s: sd[parts[s]] for s in lokr}
        modules[f"{prefix}|{m.kind}"] = m
    return modules, unused


# ------------------------------------------------------------------------------------------------ plan
@dataclass
class Item:
    module: Module
    target: Target
    kind: str                          # lowrank | kron | hadamard | dense | gate
    parts: tuple                       # tensors for kernels/delta_fuse (fp32 on CPU)
    scale: float
    scale_rule: str
    row_map: Optional[torch.Tensor] = None
    layout: str = ""                   # for fused qkv: interleaved | contiguous

    def describe(self) -> str:
        return (f"{self.module.prefix} ({self.module.kind}) -> {self.target.describe()} (scale {self.scale:g}: "
                f"{self.scale_rule}" + (f"; qkv rows {self.layout}" if self.layout else "")
                + ("; rows [value; gate] swapped" if self.target.swap else "") + ")")


@dataclass
class Plan(Report):
    items: list[Item]
    unused: dict[str, str]
    refused: dict[str, str]
    layout: str                        # decided qkv layout for fused qkv modules ("n/a" when none)
    layout_reason: str
    writer: str
    notes: list[str]
    gates: dict[int, torch.Tensor] = field(default_factory=dict)   # assigned FastH3 gates (strength applied later)
    curve: list = field(default_factory=list)    # Turbo AdaLN pairs on a curve-form base (h3_turbo_curve.CurvePair)

    KEYS = ("writer", "qkv_layout=layout", "qkv_layout_reason=layout_reason", "applied", "unused", "refused", "notes",
            "gates", "curve")
    VALUES = {"applied": lambda p: [{"module": it.module.prefix, "kind": it.module.kind, "target": it.target.describe(),
                                     "scale": it.scale, "scale_rule": it.scale_rule, "layout": it.layout,
                                     "keys": list(it.module.keys)} for it in p.items],
              "gates": lambda p: sorted(p.gates),
              "curve": lambda p: [{"module": c.prefix, "target": c.target, "rank": int(c.down.shape[0]),
                                   "scale": c.scale, "scale_rule": c.rule, "keys": list(c.keys)} for c in p.curve]}

    def summary(self) -> str:
        return (f"H3 adapter ({self.writer}): {len(self.items)} modules applied, {len(self.unused)} keys unused, "
                f"{len(self.refused)} refused; qkv layout {self.layout}"
                + (f"; {len(self.gates)} sparse-attention gates assigned" if self.gates else "")
                + (f"; {len(self.curve)} Turbo AdaLN pairs as curve columns" if self.curve else ""))


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all().item()) if t.is_floating_point() else True


def _check_tensor(source: str, key: str, t: torch.Tensor, ndim: int | None = 2) -> None:
    if not t.is_floating_point():
        raise AdapterError(f"{source}: key {key!r} has non-float dtype {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise AdapterError(f"{source}: key {key!r} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise AdapterError(f"{source}: key {key!r} is empty (shape {tuple(t.shape)})")
    if not _finite(t):
        raise AdapterError(f"{source}: key {key!r} contains NaN or Inf values")


def detect_writer(sd_keys, metadata: dict) -> str:
    keys = list(sd_keys)
    if (metadata or {}).get("format") == FASTVIDEO_FORMAT:
        return "fastvideo"
    if any(k.startswith("base_model.model.") for k in keys):
        return "peft"
    if any(".lora_A.default." in k or ".lora_B.default." in k for k in keys):
        return "diffsynth"
    if any(k.startswith("lycoris_") for k in keys):
        return "lycoris"
    if any(k.startswith("lora_unet_") for k in keys):
        return "kohya/musubi-tuner"
    if any(k.startswith("lora_transformer_") for k in keys):
        return "onetrainer"
    if any(k.startswith(("diffusion_model.", "model.diffusion_model.")) for k in keys):
        return "comfyui"
    if any(k.startswith("transformer.") for k in keys):
        return "diffusers-pipeline"
    return "bare"


def _peft_scale(cfg: dict, name: str, rank: int, source: str, where: str) -> tuple[float, str]:
    pt = cfg.get("peft_type")
    if pt is not None and pt != "LORA":
        raise AdapterError(f"{source}: the PEFT config from {where} is for peft_type {str(pt)[:32]!r}, not 'LORA'")
    r = lokr_core._pattern_lookup(cfg.get("rank_pattern"), name, "rank_pattern", source)
    r = cfg.get("r") if r is None else r
    a = lokr_core._pattern_lookup(cfg.get("alpha_pattern"), name, "alpha_pattern", source)
    a = cfg.get("lora_alpha") if a is None else a
    if r is None or a is None:
        raise AdapterError(f"{source}: the PEFT config from {where} has no "
                           + " / ".join(n for n, v in (("'r'", r), ("'lora_alpha'", a)) if v is None)
                           + " for module '" + name + "': the LoRA scale lora_alpha / r is not in the file (PEFT "
                           "would fill in its defaults; ditkit does not guess); set the node's 'scale' input")
    rf = lokr_core._peft_number(r, "r", name, source, integer=True)
    af = lokr_core._peft_number(a, "lora_alpha", name, source, integer=False)
    if int(rf) != rank:
        raise AdapterError(f"{source}: module '{name}' has rank {rank} but the PEFT config ({where}) gives r = "
                           f"{int(rf)}: the config belongs to another adapter? (set the node's 'scale' input)")
    if cfg.get("use_rslora") is True:
        return af / math.sqrt(rf), f"PEFT rsLoRA lora_alpha/sqrt(r) = {af:g}/sqrt({rf:g}) [{where}]"
    return af / rf, f"PEFT lora_alpha/r = {af:g}/{rf:g} [{where}]"


_CONVENTIONS = {
    "fastvideo": ("1.0: fastvideo-lora-v2 has no alpha, W = W_base + B @ A (the format's 'application' metadata; "
                  "hao-ai-lab/FastVideo, vllm-omni fasth3.py)"),
    "diffsynth": ("alpha = rank -> 1.0: DiffSynth-Studio convention (modelscope/DiffSynth-Studio "
                  "diffsynth/trainers/utils.py add_lora_to_model: lora_alpha defaults to lora_rank)"),
    "diffusers": ("alpha = r -> 1.0: diffusers loads a LoRA without lora_adapter_metadata with lora_alpha = r "
                  "(huggingface/diffusers src/diffusers/utils/peft_utils.py get_peft_kwargs)"),
    "comfyui": ("1.0: ComfyUI's rule for a lora_up/lora_down module without '.alpha' (comfy/weight_adapter/lora.py "
                "LoRAAdapter.calculate_weight)"),
    "h3": ("alpha = rank -> 1.0: diffusers loads alpha-less H3 LoRAs on the original names that way, the convention "
           "larryvrh/MiniMax-H3-Turbo-Lora states (huggingface/diffusers src/diffusers/loaders/lora_pipeline.py "
           "MiniMaxH3LoraLoaderMixin.lora_state_dict)"),
}


def plan(af: AdapterFile, g: Geometry, base_weight: Callable[[str], torch.Tensor], *, source: str,
         qkv_layout: str = "auto", scale_override: float | None = None) -> Plan:
    """Parse, map, decide layout and scales, validate. ``base_weight(key)`` returns the base model's tensor for a
    ComfyUI key (``gate:N`` for a gate attachment; None when absent): used for ``.set_weight`` (W_new - W_base)
    and the curve table check. Raises :class:`AdapterError` on anything it cannot apply exactly."""
    if qkv_layout not in QKV_LAYOUTS:
        raise AdapterError(f"{source}: qkv_layout {qkv_layout!r} is not one of {QKV_LAYOUTS}")
    if scale_override is not None and (not math.isfinite(scale_override) or scale_override == 0.0):
        raise AdapterError(f"{source}: scale override {scale_override!r} must be finite and non-zero")
    sd, meta = af.tensors, af.metadata or {}
    writer = detect_writer(sd, meta)
    modules, unused = parse(sd, source)
    notes = list(af.notes)
    under = underscored(g)
    items: list[Item] = []
    refused: dict[str, str] = {}
    namings: dict[str, str] = {}
    table_module = modules.pop("adaln_t_table", None)
    lowrank_prefixes = {m.prefix for m in modules.values() if m.kind == "lowrank"}
    for m in modules.values():   # ComfyUI pruned_lora.has_legacy_dora: checked before any name is mapped
        if m.kind == "diff_b" and (m.tensors["value"].dim() != 1 or (writer != "fastvideo" and m.prefix in lowrank_prefixes)):
            raise AdapterError(f"{source}: key {m.keys[0]!r} is a '.diff_b' "
                               + ("that is not 1-D" if m.tensors["value"].dim() != 1 else "next to LoRA factors of the "
                                  "same module outside a fastvideo-lora-v2 file")
                               + ": the legacy LyCORIS-DoRA convention (not a bias diff) is not supported")
    # ---- map every module
    mapped: list[tuple[Module, str, Target]] = []
    for m in modules.values():
        param = "bias" if m.kind in ("diff_b", "set_b") else "weight"
        hit = strip_prefix(g, m.prefix, under)
        tgt = resolve(g, hit[1], param) if hit else None
        if tgt is None:
            raise AdapterError(f"{source}: key {m.keys[0]!r}: module '{m.prefix}' matches no {param} of this MiniMax H3 "
                               "model (unknown prefix or module name, or an adapter for another model / size)"
                               + ("; the base has no FastH3 gates module" if "to_gate_compress" in m.prefix else ""))
        namings.setdefault(tgt.naming, m.keys[0])
        mapped.append((m, hit[0], tgt))
    if len(namings) > 1:
        raise AdapterError(f"{source}: mixed layouts in one file: {namings['original']!r} uses the original H3 names "
                           f"and {namings['diffusers']!r} the diffusers names; one adapter file has one naming "
                           "(two files can be stacked with two loader nodes)")
    for i, (m, _, tgt) in enumerate(mapped):   # an assigned weight excludes every other module on that weight
        for o, _, ot in mapped[i + 1:]:
            if ot.key == tgt.key and _overlap(ot.rows, tgt) and "set" in (m.kind[:3], o.kind[:3]):
                raise AdapterError(f"{source}: keys {m.keys[0]!r} and {o.keys[0]!r} both change "
                                   f"'{tgt.describe()}' and one of them assigns it; which one wins is ambiguous")
    # ---- qkv layout
    fused = [(m, pre, t) for m, pre, t in mapped if t.fused_qkv and m.kind not in ("set", "set_b")]
    layout, layout_reason = _decide_layout(fused, writer, meta, qkv_layout, source)
    # ---- scales + items
    ctx_cfg = af.peft_config if (af.peft_config or {}).get("peft_type", "LORA") == "LORA" else None
    lokr_sub = {k: sd[k] for m, _, _ in mapped if m.kind == "lokr" for k in m.keys}
    lokr_parsed = None
    if lokr_sub:
        lokr_cfg = af.peft_config if (af.peft_config or {}).get("peft_type") == "LOKR" else None
        lokr_parsed = lokr_core.parse_lokr(lokr_sub, peft_config=lokr_cfg, source=source,
                                           config_source=af.config_source, scale_override=scale_override,
                                           metadata=meta)
        notes.extend(lokr_parsed.notes)
    undetermined: list[tuple[Module, str]] = []
    gates: dict[int, torch.Tensor] = {}
    curve: list[turbo_curve.CurvePair] = []
    net_alpha = None
    if "alpha" in meta and not any(k.endswith(".alpha") for k in sd):
        try:
            net_alpha = float(meta["alpha"])
        except (TypeError, ValueError):
            net_alpha = float("nan")
        if not math.isfinite(net_alpha) or net_alpha == 0.0:
            raise AdapterError(f"{source}: metadata 'alpha' is {str(meta['alpha'])[:40]!r}; a network alpha must be a "
                               "finite non-zero number")
    for m, pre, tgt in mapped:
        row_map = None
        lay = ""
        if tgt.fused_qkv and m.kind not in ("set", "set_b"):
            lay = layout
            if layout == "interleaved":
                row_map = deinterleave_map(g.heads, g.head_dim)
        if tgt.swap:
            row_map = swap_map(tgt.shape[0])
        if m.kind == "lowrank":
            up, down = m.tensors["up"], m.tensors["down"]
            _check_tensor(source, m.keys[0], down)
            _check_tensor(source, m.keys[-1], up)
            if up.shape[1] != down.shape[0]:
                raise AdapterError(f"{source}: module '{m.prefix}': up {tuple(up.shape)} and down {tuple(down.shape)} "
                                   "have different ranks")
            turbo = (g.curve and tgt.key.endswith("adaln_proj.linear.weight") and up.shape[0] == tgt.shape[0]
                     and down.shape[1] != tgt.shape[1] and tgt.rows is None and row_map is None)
            if not turbo and (up.shape[0], down.shape[1]) != tuple(tgt.shape):
                raise AdapterError(f"{source}: module '{m.prefix}' builds ΔW of shape {(up.shape[0], down.shape[1])} but "
                                   f"its target '{tgt.describe()}' has shape {tuple(tgt.shape)} (key {m.keys[0]!r}; "
                                   "adapter for another model size?)")
            rank = int(down.shape[0])
            scale, rule = _lora_scale(m, pre, rank, writer, tgt, ctx_cfg, af.config_source, source, scale_override,
                                      net_alpha)
            if scale is None:
                undetermined.append((m, rule))
                continue
            if turbo:   # AdaLN pair on silu(t_emb) of a Turbo LoRA: carried as curve columns (h3_turbo_curve)
                dk = next((k for k in m.keys if "down" in k or "lora_A" in k), m.keys[0])
                curve.append(turbo_curve.CurvePair(m.prefix, [dk] + [k for k in m.keys if k != dk], tgt.key,
                                                   up.float(), down.float(), scale, rule))
                continue
            items.append(Item(m, tgt, "lowrank", (up.float(), down.float()), scale, rule, row_map, lay))
        elif m.kind == "loha":
            t = m.tensors
            for s in _LOHA:
                _check_tensor(source, f"{m.prefix}.{s}", t[s])
            r1, r2 = t["hada_w1_b"].shape[0], t["hada_w2_b"].shape[0]
            ok = (t["hada_w1_a"].shape[1] == r1 and t["hada_w2_a"].shape[1] == r2 and r1 == r2
                  and t["hada_w1_a"].shape[0] == t["hada_w2_a"].shape[0] == tgt.shape[0]
                  and t["hada_w1_b"].shape[1] == t["hada_w2_b"].shape[1] == tgt.shape[1])
            if not ok:
                raise AdapterError(f"{source}: LoHa module '{m.prefix}' factors {[tuple(t[s].shape) for s in _LOHA]} do not "
                                   f"build its target '{tgt.describe()}' {tuple(tgt.shape)}")
            if scale_override is not None:
                scale, rule = scale_override, "node 'scale' input"
            elif m.alpha is not None:
                scale, rule = m.alpha / r1, f"LyCORIS LoHa alpha/rank = {m.alpha:g}/{r1}"
            else:
                undetermined.append((m, "LoHa module without '.alpha' (LyCORIS LohaModule needs it)"))
                continue
            parts = tuple(t[s].float() for s in _LOHA)
            items.append(Item(m, tgt, "hadamard", parts, scale, rule, row_map, lay))
        elif m.kind == "lokr":
            lm = lokr_parsed.modules.get(m.prefix)
            if lm is None:
                raise AdapterError(f"{source}: LoKr module '{m.prefix}' was not parsed")  # pragma: no cover
            if lm.unsupported:
                raise AdapterError(f"{source}: module '{m.prefix}': {lm.unsupported}; nothing was applied")
            lokr_core.validate_module(lm, source)
            if tuple(lm.shape()) != tuple(tgt.shape):
                raise AdapterError(f"{source}: LoKr module '{m.prefix}' builds ΔW of shape {tuple(lm.shape())} but its "
                                   f"target '{tgt.describe()}' has shape {tuple(tgt.shape)}")
            if lm.undetermined is not None:
                undetermined.append((m, lm.undetermined))
                continue
            w1 = rebuild_w1(lm.factors, torch.float64).contiguous()   # float64: ΔW = kron(w1, w2_a @ w2_b) exact
            w2 = rebuild_w2(lm.factors, torch.float64).contiguous()
            items.append(Item(m, tgt, "kron", (w1, w2), lm.scale, lm.scale_rule, row_map, lay))
        elif m.kind in ("diff", "diff_b"):
            v = m.tensors["value"]
            want = 1 if m.kind == "diff_b" else len(tgt.shape)
            _check_tensor(source, m.keys[0], v, want)
            if tuple(v.shape) != tuple(tgt.shape):
                raise AdapterError(f"{source}: key {m.keys[0]!r} has shape {tuple(v.shape)}, its target "
                                   f"'{tgt.describe()}' {tuple(tgt.shape)}")
            if tgt.key.startswith("gate:"):
                raise AdapterError(f"{source}: key {m.keys[0]!r}: a '.diff' on a sparse-attention gate is not supported "
                                   "(gates are assigned with '.set_weight')")
            scale, rule = 1.0, "full-rank delta (.diff / .diff_b): 1.0"
            if scale_override is not None:
                rule += "; node 'scale' input not applied to full-rank deltas"
            items.append(Item(m, tgt, "dense", (v.float().reshape(tgt.shape[0], -1),), scale, rule, row_map, lay))
        else:  # set / set_b
            v = m.tensors["value"]
            if m.family == "curve" and not g.curve:
                raise AdapterError(f"{source}: key {m.keys[0]!r} is a curve-form (pruned) AdaLN weight but the base is "
                                   "not curve-form (no adaln_t_table); load the pruned checkpoint it was made for")
            _check_tensor(source, m.keys[0], v, None)
            if tuple(v.shape) != tuple(tgt.shape) or tgt.rows is not None:
                raise AdapterError(f"{source}: key {m.keys[0]!r} (assigned weight) has shape {tuple(v.shape)} but its "
                                   f"target '{tgt.describe()}' has shape {tuple(tgt.shape)}; nothing was applied")
            if tgt.key.startswith("gate:"):
                gates[int(tgt.key[5:])] = v
                continue
            base = base_weight(tgt.key)
            if base is None:
                raise AdapterError(f"{source}: key {m.keys[0]!r}: the base has no '{tgt.key}'")  # pragma: no cover
            d = v.double() - base.double()
            if tgt.swap:
                d = d[swap_map(d.shape[0])]
            rule = "assigned: W_base + strength * (W_new - W_base)"
            items.append(Item(m, tgt, "dense", (d.float().reshape(tgt.shape[0], -1),), 1.0, rule, None, lay))
    if undetermined:
        m, why = undetermined[0]
        raise AdapterError(f"{source}: the file does not determine the scale (alpha / rank) of {len(undetermined)} "
                           f"module(s) ({writer} naming; first: '{m.prefix}'): {why}. Nothing was applied. Set the "
                           "DitKitAdapterLoader 'scale' input to the adapter's alpha / rank (e.g. 1.0 when alpha == rank)")
    if table_module is not None:
        t = table_module.tensors["table"]
        base = base_weight("diffusion_model.adaln_t_table")
        k = table_module.keys[0]
        if base is None:
            raise AdapterError(f"{source}: key {k!r}: a curve-form (pruned AdaLN) adapter needs a curve-form base; this "
                               "model has no adaln_t_table (load the pruned checkpoint it was made for)")
        _check_tensor(source, k, t)
        if tuple(t.shape) != tuple(base.shape):
            raise AdapterError(f"{source}: key {k!r} has shape {tuple(t.shape)}, the base table {tuple(base.shape)}")
        diff = (t.double() - base.double()).abs().max().item()
        if diff > TABLE_TOL:
            raise AdapterError(f"{source}: key {k!r} differs from the base's adaln_t_table by {diff:.3g} (> {TABLE_TOL:g}): "
                               "the adapter's AdaLN weights were made for another curve basis, i.e. another pruned "
                               "base (the other partition, fl2va vs ref2va, or another pruning); nothing was applied. "
                               "Choose the adapter made for this base ('adapter_name') or load the base it was made "
                               "for (the model loader's file)")
        unused[k] = f"curve table kept from the base (equal within {diff:.3g} <= {TABLE_TOL:g})"
    curve_sets = [it for it in items if it.module.family == "curve"]
    if curve_sets and not g.curve:
        raise AdapterError(f"{source}: key {curve_sets[0].module.keys[0]!r} is a curve-form AdaLN weight but the base is "
                           "not curve-form (no adaln_t_table)")
    if not items and not gates and not curve:
        raise AdapterError(f"{source}: no adapter module in the file applies to this H3 model "
                           f"({len(unused)} keys unused" + (f", e.g. {next(iter(unused))!r}" if unused else "") + ")")
    if scale_override is not None:
        notes.append(f"scale: the node's 'scale' input {scale_override:g} replaces the file's alpha/rank scale of the "
                     "low-rank modules")
    return Plan(items, unused, refused, layout, layout_reason, writer, notes, gates, curve)


_PARTITION = re.compile(r"(?:^|[^a-z0-9])(fl2va?|ref2va?)(?=$|[^a-z0-9])")
PARTITION_FIELDS = ("base_model", "finetuned_model", "ss_base_model_version", "ss_sd_model_name",
                    "modelspec.architecture", "modelspec.title", "partition")


def partition_note(source: str, metadata: dict | None) -> tuple[str, str]:
    """-> (partition named by the adapter's file name / metadata: "fl2va", "ref2va", "both" or "unknown", report
    line). Not a check: FL2VA and Ref2VA checkpoints have the same keys, shapes and config (h3.md §2.1, §9; their
    files name the partition only in the file name), and a loaded model does not carry its file name, so nothing
    in the model says which partition it is. The line says what the adapter names and that it was not verified."""
    found: dict[str, str] = {}
    for where, text in [("file name", os.path.basename(str(source)))] + [
            (f"metadata '{f}'", str((metadata or {}).get(f))) for f in PARTITION_FIELDS if (metadata or {}).get(f)]:
        for tok in _PARTITION.findall(text.lower()[:4096]):
            found.setdefault("fl2va" if tok.startswith("fl2v") else "ref2va", f"{where} ({tok})")
    part = "both" if len(found) > 1 else next(iter(found), "unknown")
    said = ("names no partition (no fl2va / ref2va token in its file name or metadata)" if not found else
            "names " + " and ".join(f"{p.upper()} by its {w}" for p, w in found.items()))
    return part, (f"partition: not verified. The adapter {said}; FL2VA and Ref2VA checkpoints have the same keys and "
                  "shapes and the loaded model does not carry its file name, so ditkit cannot tell which partition "
                  "the model is. An adapter trained on the other partition applies without error and changes the "
                  "output: check that the model loader's file (minimax_h3_fl2va_* / minimax_h3_ref2va_*) matches")


def _overlap(rows, tgt: Target) -> bool:
    if rows is None or tgt.rows is None:
        return True
    return rows[0] < tgt.rows[1] and tgt.rows[0] < rows[1]


# prefixes of the producers diffusers' H3 converter lists as training on the [q_all; k_all; v_all] module tree
# (ai-toolkit / ComfyUI "diffusion_model.", the reference generate.py / ComfyUI checkpoints with no prefix,
# musubi-tuner "lora_unet_"); DiffSynth-Studio (no prefix, PEFT ".default." infix) runs the raw interleaved qkv
CONTIGUOUS_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "", "lora_unet_")
DIFFUSERS_CONVERTER = ("huggingface/diffusers src/diffusers/loaders/lora_conversion_utils.py "
                       "_convert_non_diffusers_minimax_h3_lora_to_diffusers")


def _decide_layout(fused, writer: str, meta: dict, choice: str, source: str) -> tuple[str, str]:
    if not fused:
        return "n/a", "no module on a fused qkv_proj (split to_q/to_k/to_v or no attention modules)"
    hint = None
    raw = meta.get("qkv_layout")
    if raw is not None:
        if raw not in ("interleaved", "contiguous"):
            raise AdapterError(f"{source}: metadata 'qkv_layout' is {str(raw)[:40]!r}; expected 'interleaved' or "
                               "'contiguous'")
        hint = (raw, "the file's metadata 'qkv_layout'")
    else:
        kinds = set()
        for m, pre, _ in fused:
            if m.family == "peft-default" and pre == "":
                kinds.add("diffsynth")
            elif pre in CONTIGUOUS_PREFIXES and m.family != "peft-default":
                kinds.add("contiguous:" + (pre or "no prefix"))
            else:
                kinds.add("unknown")
        if "diffsynth" in kinds and len(kinds) > 1:
            raise AdapterError(f"{source}: mixed layouts in one file: DiffSynth-Studio '.default.' qkv_proj keys next to "
                               "other namings")
        if kinds == {"diffsynth"}:
            hint = ("interleaved", "DiffSynth-Studio naming (original names with PEFT's '.default.' infix): it trains on "
                                   f"the raw checkpoint's per-head interleaved qkv ({DIFFUSERS_CONVERTER} de-interleaves "
                                   "exactly these files)")
        elif "unknown" not in kinds:
            pres = ", ".join(sorted(k.split(":", 1)[1] for k in kinds))
            hint = ("contiguous", f"original names with prefix {pres}: ai-toolkit / ComfyUI (diffusion_model.), the "
                                  "reference generate.py (no prefix) and musubi-tuner (lora_unet_) train on the module "
                                  f"tree that holds qkv as [q_all; k_all; v_all] ({DIFFUSERS_CONVERTER})")
    if choice != "auto":
        why = f"node input qkv_layout = {choice}"
        if hint is not None and hint[0] != choice:
            why += f" (the file suggests {hint[0]}: {hint[1]})"
        return choice, why
    if hint is None:
        m, pre, _ = next((x for x in fused if not (x[1] in CONTIGUOUS_PREFIXES or x[0].family == "peft-default")),
                         fused[0])
        raise AdapterError(f"{source}: module '{m.prefix}' (key {m.keys[0]!r}) is an adapter on the fused qkv_proj, and "
                           f"nothing in the file says which qkv row layout it was trained on ({writer} naming, prefix "
                           f"{pre!r}, no 'qkv_layout' metadata): the raw official checkpoint holds per-head interleaved "
                           "rows [h0: q,k,v; h1: ...], ComfyUI and the reference code [q_all; k_all; v_all]. Nothing was "
                           "applied. Set the DitKitAdapterLoader input 'qkv_layout' to 'interleaved' or 'contiguous'")
    return hint


def _lora_scale(m: Module, pre: str, rank: int, writer: str, tgt: Target, cfg: dict | None, cfg_src: str | None,
                source: str, override: float | None, net_alpha: float | None = None) -> tuple[float | None, str]:
    if override is not None:
        return override, "node 'scale' input"
    if m.alpha is not None:
        return m.alpha / rank, f"alpha/rank = {m.alpha:g}/{rank} ('{m.alpha_key}')"
    if writer == "fastvideo":
        return 1.0, _CONVENTIONS["fastvideo"]
    if cfg is not None:
        name = m.prefix.removeprefix("base_model.model.").removeprefix("transformer.")
        return _peft_scale(cfg, name, rank, source, cfg_src or "the adapter config")
    if writer == "peft":
        return None, (f"PEFT-layout file (base_model.model.* keys) without its {PEFT_CONFIG_NAME} next to it and "
                      "without 'lora_adapter_metadata': PEFT scales by lora_alpha / r from that config")
    if m.family == "peft-default" and tgt.naming == "original":
        return 1.0, _CONVENTIONS["diffsynth"]
    if m.family == "peft" and tgt.naming == "diffusers":
        return 1.0, _CONVENTIONS["diffusers"]
    if m.family == "peft-default" and tgt.naming == "diffusers" and net_alpha is None:
        return None, ("diffusers names with PEFT's '.default.' infix and no alpha: the layout of lightx2v's H3 Turbo "
                      "LoRAs, whose reference loads them with lora_alpha 8 whatever the rank (ModelTC/Minimax-H3-Turbo "
                      "inference_minimax_h3.py DEFAULT_LORA_ALPHA; alpha = rank would be 16x too strong at rank 128)")
    if net_alpha is not None:
        return net_alpha / rank, (f"metadata 'alpha' = {net_alpha:g} / rank {rank} (network alpha of an alpha-less file, "
                                  "as diffusers' MiniMaxH3LoraLoaderMixin honors it)")
    if m.family == "kohya" and pre in ("diffusion_model.", "model.diffusion_model."):
        return 1.0, _CONVENTIONS["comfyui"]
    if tgt.naming == "original" and pre in CONTIGUOUS_PREFIXES:
        return 1.0, _CONVENTIONS["h3"]
    return None, f"no '.alpha' key, no PEFT config and no trainer convention for {writer} files (prefix {pre!r})"


# ------------------------------------------------------------------------------------------------ apply
def apply_item_(weight: torch.Tensor, item: Item, strength: float, function=None, backend: str = "auto") -> str:
    """``weight += function(strength * scale * ΔW)`` in place; ``weight`` is the target (slice) ComfyUI hands the
    patch. Returns the fuse backend that ran."""
    if tuple(weight.shape) != tuple(item.target.shape):
        raise AdapterError(f"DitKitAdapterLoader: patch for '{item.target.describe()}' expects shape "
                           f"{tuple(item.target.shape)}, weight is {tuple(weight.shape)}")
    w2 = weight if weight.dim() == 2 else weight.view(weight.shape[0], -1)
    return delta_fuse.fuse_(w2, item.kind, item.parts, float(item.scale) * float(strength), item.row_map,
                            function=function, backend=backend)


def assigned_gates(plan_: Plan, base_gates: dict[int, torch.Tensor] | None, strength: float,
                   source: str) -> dict[int, torch.Tensor]:
    """The FastH3 gates after this adapter: assigned at strength 1; ``base + strength * (new - base)`` otherwise
    (needs the base's gates)."""
    out = {int(i): w for i, w in (base_gates or {}).items()}
    for i, new in plan_.gates.items():
        if strength == 1.0:
            out[i] = new
        elif i in out:
            b = out[i]
            out[i] = (b.double() + strength * (new.double() - b.double())).to(new.dtype)
        else:
            raise AdapterError(f"{source}: block {i} gate (to_gate_compress.set_weight) at strength {strength:g}: the base "
                               "has no gate to blend with; use strength 1.0 (assign) or a base with FastH3 gates")
    return out
