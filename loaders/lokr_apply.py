"""LoKr adapters for ComfyUI's Z-Image and FLUX.2 layouts (plain torch; no ComfyUI imports).

Steps, all pure functions:

1. :func:`read_adapter_file` reads the tensors, the safetensors metadata and the PEFT ``LoKrConfig`` wherever
   a writer puts it (see *Scale* below) and says where it came from.
2. :func:`parse_lokr` groups a state dict into LoKr modules (LyCORIS ``lycoris_*``, kohya / musubi-tuner
   ``lora_unet_*``, PEFT ``base_model.model.*``, ai-toolkit ``diffusion_model.*``, OneTrainer
   ``lora_transformer_*``, diffusers / SimpleTuner ``transformer.*``, bare diffusers paths) and gives every
   module its scale by the rules of the writer that made it (table below). Keys that are not LoKr weights
   are reported with the reason.
3. :func:`build_targets` lists every name an adapter may use for a weight of the ComfyUI model (native
   ComfyUI/BFL module paths, diffusers paths incl. FLUX.2 global modulation / time+guidance embedders and
   FLUX.2's 6h single-block MLP, underscored forms) and where it lands: the whole weight or a row range of a
   fused weight (``attention.qkv``, ``img_attn.qkv``/``txt_attn.qkv``, ``linear1``), plus diffusers'
   ``norm_out.linear`` [scale; shift] -> ComfyUI's [shift; scale] row swap.
4. :func:`plan` maps modules onto targets and validates everything before any model is touched (shapes,
   NaN/Inf, alpha 0, factor consistency, a scale the file does not determine); :func:`module_delta`
   materialises one module's ΔW (fp32) for its target slice and :func:`apply_patch_` adds
   ``strength * ΔW`` in place (the function the ComfyUI patch calls). Nothing is re-factorised: a row-slice
   adapter is materialised into its own rows, a fused adapter onto the whole fused weight, so the result is
   exact whatever the Kronecker alignment.

Scale (ΔW = scale · kron(w1, w2)): where each writer keeps rank and alpha, and what fixes the scale when the
file does not carry them. "Refused" means :func:`plan` raises :class:`AdapterError` naming what is missing;
the node's ``scale`` input (``scale_override`` here) then sets the scale explicitly. Whatever rule was used
is in every module's ``scale_rule`` and in the plan's notes.

=========================== ============================================ ================================= ==========================================
writer (detected by)        rank / alpha in the file                     scale                             no alpha / no config in the file
=========================== ============================================ ================================= ==========================================
LyCORIS ``lycoris_*``;      ``<module>.alpha``, saved as                 decomposed factor: alpha / rank;  refused: LyCORIS' own loader
SimpleTuner saves through   ``alpha * lora_dim / r_factor`` so           both factors full: 1.0 (alpha     (``LokrModule.make_module_from_state_dict``)
it (``simpletuner/helpers/  rs_lora is folded in                         is set to lora_dim)               needs the alpha (``float(alpha)``)
training/save_hooks.py::    (``KohakuBlueleaf/LyCORIS:lycoris/modules/
_save_lycoris``)            lokr.py`` ``LokrModule.__init__``,
                            ``custom_state_dict``)
ai-toolkit                  ``.alpha`` always saved; full rank stores    as LyCORIS                        refused: ai-toolkit takes alpha from the
``diffusion_model.*``       the 9999999999 placeholder                                                     job config, not the file
                            (``ostris/ai-toolkit:toolkit/models/
                            lokr.py`` ``LokrModule.__init__``,
                            ``toolkit/config_modules.py``
                            ``NetworkConfig``)
OneTrainer                  ``.alpha`` buffer, scale alpha / dim         as LyCORIS (alpha filled with     refused: its ``load_state_dict`` is strict
``lora_transformer_*``      (``Nerogar/OneTrainer:modules/module/        dim when both factors are full)
                            LoRAModule.py`` ``LoKrModule``)
musubi-tuner (#900) /       ``.alpha`` (``kohya-ss/musubi-tuner:src/     decomposed w2: alpha / rank;      convention: alpha = dim, scale 1.0
kohya ``lora_unet_*``       musubi_tuner/networks/lokr.py``              full w2: 1.0                      (``merge_weights_to_tensor``)
                            ``LoKrModule.__init__``)
musubi-tuner PR #901        ``.alpha`` = network_alpha as given          decomposed w2: alpha / rank;      convention: alpha = dim, scale 1.0
(``lokr_factor`` key)       (``networks/lokr.py`` of refs/pull/901,      full w2: alpha / max(w2.shape)    (same ``merge_weights_to_tensor``)
                            ``LoKrModule.get_weight``,
                            ``merge_weights_to_tensor``)
PEFT ``base_model.model.*`` no alpha key; ``r``, ``alpha``,              alpha / r for every module, also  refused (PEFT itself cannot load the file
                            ``rank_pattern``, ``alpha_pattern`` in       full-rank ones                    without its config)
                            ``adapter_config.json`` next to the file     (``LoKrLayer.update_layer``; keys
                            (``huggingface/peft:src/peft/tuners/lokr/    matched as ``get_pattern_key``)
                            layer.py``, ``PeftModel.save_pretrained``)
diffusers model-level       LoKrConfig as JSON in metadata               alpha / r (PEFT)                  —
``save_lora_adapter``       ``lora_adapter_metadata``
(bare module paths)         (``src/diffusers/loaders/peft.py``)
diffusers pipeline-level    ``lora_adapter_metadata`` with component-    alpha / r (PEFT)                  convention: alpha = r, scale 1.0: diffusers
``save_lora_weights``       prefixed fields ``transformer.r``,                                             loads such files that way ("alpha baked
(``transformer.*``, also    ``transformer.alpha``, ...                                                     into the weights",
bare paths)                 (``loaders/lora_base.py::_save_lora_weights``                                  ``src/diffusers/utils/peft_utils.py::
                            -> ``_pack_dict_with_prefix``)                                                 _create_lokr_config``); a module with an
                                                                                                           ``.alpha`` key follows LyCORIS, as
                                                                                                           ``_bake_lokr_alpha_`` does
=========================== ============================================ ================================= ==========================================

A LyCORIS ``scalar`` key multiplies the scale. A decomposed module whose two factors have different ranks is
refused (LyCORIS reads the rank from ``w1_a``, ComfyUI from ``w2_b``; no writer produces such a file).
"""
from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, field

import torch

from ..errors import AdapterError, CheckpointError, UnsupportedModelError
from ..report import Report
from . import safe_fs
from .lokr_math import add_delta_, delta_weight
from .safetensors_io import SafeFile, check_declared_sizes, strict_json_loads

FACTOR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
AUX_KEYS = ("alpha", "dora_scale", "scalar", "lokr_t1", "lokr_factor")
_SUFFIXES = tuple(sorted(FACTOR_KEYS + AUX_KEYS, key=len, reverse=True))
NETWORK_KEYS = ("lokr_factor",)   # network-level buffer musubi-tuner PR #901 saves (no module prefix)

DOTTED_PREFIXES = ("base_model.model.transformer.", "base_model.model.", "model.diffusion_model.",
                   "diffusion_model.", "transformer.", "")
UNDERSCORE_PREFIXES = ("lycoris_", "lora_unet_", "lora_transformer_")

PEFT_CONFIG_NAME = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
METADATA_CONFIG_KEY = "lora_adapter_metadata"
DIFFUSERS_COMPONENT = "transformer"

# Writers whose own code fixes the scale of a module that has no alpha key (see the module docstring).
NO_ALPHA_CONVENTIONS = {
    "kohya/musubi-tuner": ("musubi-tuner: a module without '.alpha' merges with alpha = dim (scale 1.0)",
                           "kohya-ss/musubi-tuner:src/musubi_tuner/networks/lokr.py::merge_weights_to_tensor"),
    "musubi-tuner": ("musubi-tuner PR #901: a module without '.alpha' merges with alpha = dim (scale 1.0)",
                     "kohya-ss/musubi-tuner refs/pull/901 src/musubi_tuner/networks/lokr.py::merge_weights_to_tensor"),
    "simpletuner/diffusers": ("diffusers: a LoKr file without 'lora_adapter_metadata' is loaded with alpha = r "
                              "(scale 1.0; alpha expected baked into the factors)",
                              "huggingface/diffusers:src/diffusers/utils/peft_utils.py::_create_lokr_config"),
    "bare-diffusers": ("diffusers: a LoKr file without 'lora_adapter_metadata' is loaded with alpha = r "
                       "(scale 1.0; alpha expected baked into the factors)",
                       "huggingface/diffusers:src/diffusers/loaders/lora_pipeline.py::Flux2LoraLoaderMixin."
                       "lora_state_dict -> utils/peft_utils.py::_create_lokr_config"),
}
# Writers whose files cannot be read without their alpha keys: why (for the error message).
NO_ALPHA_UNDETERMINED = {
    "lycoris": "LyCORIS' own loader (LokrModule.make_module_from_state_dict) needs each module's alpha",
    "onetrainer": "OneTrainer loads its LoKr state dicts strictly, alpha included",
    "ai-toolkit/comfy": "ai-toolkit takes alpha from its job config (network.linear_alpha), not from the file",
}
DIFFUSERS_LAYOUTS = ("simpletuner/diffusers", "bare-diffusers")


# ---------------------------------------------------------------------------------------------- parsing
@dataclass
class LoKrModule:
    prefix: str                       # key prefix as written in the file, e.g. "diffusion_model.layers.0.attention.to_q"
    factors: dict[str, torch.Tensor]  # lokr_w1 / lokr_w1_a / lokr_w1_b / lokr_w2 / lokr_w2_a / lokr_w2_b / lokr_t2
    keys: list[str]                   # every file key consumed by this module
    alpha: float | None = None
    scalar: float = 1.0
    rank: int | None = None
    scale: float = 1.0
    scale_rule: str = ""
    scale_kind: str = ""              # "file" | "config" | "convention" | "input" | "undetermined"
    undetermined: str | None = None   # why the file does not determine the scale (refused by plan unless overridden)
    unsupported: str | None = None    # reason (DoRA, lokr_t1...) -> not applied, reported

    @property
    def decomposed(self) -> bool:
        return "lokr_w1_a" in self.factors or "lokr_w2_a" in self.factors

    def shape(self) -> tuple[int, ...]:
        """Shape of kron(w1, w2) from factor shapes (validated by :func:`validate_module`)."""
        f = self.factors
        w1 = tuple(f["lokr_w1"].shape) if "lokr_w1" in f else (f["lokr_w1_a"].shape[0], f["lokr_w1_b"].shape[1])
        if "lokr_w2" in f:
            w2 = tuple(f["lokr_w2"].shape)
        elif "lokr_t2" in f:
            t2 = f["lokr_t2"]
            w2 = (f["lokr_w2_a"].shape[1], f["lokr_w2_b"].shape[1], *t2.shape[2:])
        else:
            b = f["lokr_w2_b"]
            w2 = (f["lokr_w2_a"].shape[0], *b.shape[1:])
        out = (w1[0] * w2[0], w1[1] * w2[1])
        return out + tuple(w2[2:])


@dataclass
class ParsedLoKr:
    modules: dict[str, LoKrModule]
    unused: dict[str, str]            # key -> why it is not used
    writer: str                       # detected writer / naming convention
    notes: list[str] = field(default_factory=list)


@dataclass
class AdapterFile:
    """What :func:`read_adapter_file` found: tensors, safetensors metadata, the PEFT config and its source."""
    path: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    peft_config: dict | None = None
    config_source: str | None = None
    notes: list[str] = field(default_factory=list)


def detect_writer(keys) -> str:
    ks = list(keys)
    if any(k in NETWORK_KEYS or k.endswith(".lokr_factor") for k in ks):
        return "musubi-tuner"
    if any(k.startswith("base_model.model.") for k in ks):
        return "peft"
    if any(k.startswith("lycoris_") for k in ks):
        return "lycoris"
    if any(k.startswith("lora_transformer_") for k in ks):
        return "onetrainer"
    if any(k.startswith("lora_unet_") for k in ks):
        return "kohya/musubi-tuner"
    if any(k.startswith("diffusion_model.") for k in ks):
        return "ai-toolkit/comfy"
    if any(k.startswith("transformer.") for k in ks):
        return "simpletuner/diffusers"
    return "bare-diffusers"


def config_from_metadata(metadata: dict | None) -> tuple[dict, str] | None:
    """The PEFT LoKrConfig diffusers writes as JSON in ``lora_adapter_metadata``, and where it came from.

    Two layouts: ``save_lora_adapter`` (model level) writes the config's own fields (``r``, ``alpha``, ...);
    ``save_lora_weights`` (pipeline level: Z-Image, FLUX.2) prefixes every field with its component
    (``transformer.r``, ``transformer.alpha``, ...; ``_pack_dict_with_prefix``). Fields of other components
    are left out (their adapters are not Z-Image / FLUX.2 transformer weights)."""
    if not metadata:
        return None
    raw = metadata.get(METADATA_CONFIG_KEY)
    if raw is None:
        return None
    where = f"LoKr metadata '{METADATA_CONFIG_KEY}'"
    if not isinstance(raw, str):
        raise AdapterError(f"{where} must be a JSON string")
    try:
        cfg = strict_json_loads(raw, where, what="safetensors metadata value")
    except CheckpointError as e:
        raise AdapterError(f"{e} (re-export the adapter, or remove the metadata key and put the PEFT config in "
                           f"{PEFT_CONFIG_NAME} next to the file)") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where} must be a JSON object (a PEFT LoKrConfig), got a {type(cfg).__name__}")
    comp = DIFFUSERS_COMPONENT + "."
    prefixed = {k[len(comp):]: v for k, v in cfg.items() if k.startswith(comp)}
    plain = {k: v for k, v in cfg.items() if "." not in k}
    if prefixed and plain:
        raise AdapterError(f"{where} has both '{comp}*' fields (diffusers save_lora_weights) and plain LoKrConfig "
                           f"fields ({', '.join(sorted(plain)[:3])}): which one applies is ambiguous")
    if prefixed:
        return prefixed, (f"safetensors metadata '{METADATA_CONFIG_KEY}', '{comp}*' fields "
                          "(diffusers save_lora_weights)")
    if plain:
        return plain, f"safetensors metadata '{METADATA_CONFIG_KEY}' (diffusers save_lora_adapter)"
    return None


def peft_config_from_metadata(metadata: dict | None) -> dict | None:
    """The PEFT config in ``lora_adapter_metadata`` (either diffusers layout), or None."""
    found = config_from_metadata(metadata)
    return found[0] if found is not None else None


def read_peft_config_file(path: str) -> dict:
    """``adapter_config.json`` (PEFT ``save_pretrained``), bounded and strictly parsed."""
    try:  # opened once (non-blocking), the opened descriptor checked and read: no check-then-open window
        fd = safe_fs.open_model_file(path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise AdapterError(f"'{path}' is not a regular file; not a PEFT adapter config")
            if st.st_size > MAX_CONFIG_BYTES:
                raise AdapterError(f"'{path}' is {st.st_size} bytes (> {MAX_CONFIG_BYTES}); not a PEFT adapter config")
            raw = safe_fs.read_fd(fd, MAX_CONFIG_BYTES)
        finally:
            os.close(fd)
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterError(f"'{path}' is over {MAX_CONFIG_BYTES} bytes; not a PEFT adapter config")
        text = raw.decode("utf-8")
    except OSError as e:
        raise AdapterError(f"'{path}' cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise AdapterError(f"'{path}' is not UTF-8 text ({e})") from None
    try:
        cfg = strict_json_loads(text, f"'{path}'", what="PEFT adapter config")
    except CheckpointError as e:
        raise AdapterError(str(e)) from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"'{path}' must be a JSON object (a PEFT LoKrConfig), got a {type(cfg).__name__}")
    return cfg


def target_bounds(shapes: dict[str, tuple[int, ...]] | None) -> tuple[int | None, int | None]:
    """(largest dimension, largest element count) over the target model's weights: no adapter tensor (a factor,
    a rank, a full-rank delta, an assigned weight) can usefully exceed either."""
    if not shapes:
        return None, None
    dims = [int(d) for s in shapes.values() for d in s]
    numels = [math.prod(int(d) for d in s) for s in shapes.values()]
    return (max(dims) if dims else None), (max(numels) if numels else None)


# reading holds the file's bytes once and each factor's float32 copy once more (parse/plan cast to float32)
READ_EXPANSION = 3.0


def read_adapter_file(path: str, what: str = "LoKr", *, shapes: dict[str, tuple[int, ...]] | None = None,
                      input_name: str | None = None) -> AdapterFile:
    """Tensors + metadata of an adapter ``.safetensors`` file and the PEFT config that belongs to it: from the
    file's ``lora_adapter_metadata`` (diffusers), else, for a PEFT-layout file (``base_model.model.*``),
    from the ``adapter_config.json`` PEFT's ``save_pretrained`` writes next to it. ``what`` names the file
    in the error (``"LoKr"``; DitKitAdapterLoader: ``"adapter"``). Shared by the LoKr and the H3 adapter paths.

    Before any tensor is read, every size the header declares is bounded (:func:`safetensors_io.
    check_declared_sizes`) by the target model's ``shapes`` (its largest dimension and weight) and by free
    memory: a crafted (e.g. sparse) file declaring a rank or size absurd for the layer is refused naming the key
    and ``input_name``, instead of being read and expanded."""
    path = os.fspath(path)
    max_dim, max_numel = target_bounds(shapes)
    where = f"{what} file '{path}'" + (f" (input '{input_name}')" if input_name else "")
    try:
        with SafeFile(path) as f:
            check_declared_sizes(f.header, where, max_dim=max_dim, max_numel=max_numel, expand=READ_EXPANSION,
                                 error=AdapterError)
            tensors = {k: f.get(k) for k in f.keys()}
            metadata = dict(f.metadata)
    except (CheckpointError, AdapterError):
        raise
    except MemoryError:
        raise AdapterError(f"{where}: out of memory while reading its tensors; nothing was applied") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} file '{path}' cannot be read ({type(e).__name__}: {e}); truncated or not "
                              "safetensors?") from None
    out = AdapterFile(path, tensors, metadata)
    found = config_from_metadata(metadata)
    side = os.path.join(os.path.dirname(path), PEFT_CONFIG_NAME)
    if found is not None:
        out.peft_config, out.config_source = found
    elif any(k.startswith("base_model.model.") for k in tensors):
        if os.path.isfile(side):
            out.peft_config, out.config_source = read_peft_config_file(side), f"{PEFT_CONFIG_NAME} next to the file"
    elif os.path.isfile(side):
        out.notes.append(f"{PEFT_CONFIG_NAME} next to the file not used: only PEFT-layout files (base_model.model.* "
                         "keys) take their config from it")
    return out


# ---------------------------------------------------------------------------------------------- scale
_PATTERN_OK = re.compile(r"[A-Za-z0-9_.\-^]+")


def _pattern_lookup(pattern, name: str, key: str, source: str):
    """PEFT's ``get_pattern_key``: the first key of ``pattern`` (file order) for which
    ``re.match(rf"(.*\\.)?({key})$", name)`` matches. Keys are limited to module-name characters (plus ``^``),
    so matching stays linear; a key with other regular-expression syntax is refused."""
    if not pattern:
        return None
    if not isinstance(pattern, dict):
        raise AdapterError(f"{source}: PEFT config '{key}' must be an object mapping module name -> value, got a "
                           f"{type(pattern).__name__}")
    for i, (pat, val) in enumerate(pattern.items()):
        if not isinstance(pat, str) or len(pat) > 512 or not _PATTERN_OK.fullmatch(pat):
            raise AdapterError(f"{source}: PEFT config '{key}' entry {i} is not a plain module name (regular-"
                               "expression syntax is not evaluated from files); set the node's 'scale' input")
        if re.match(rf"(.*\.)?({pat})$", name):
            return val
    return None


def _dim0(t: torch.Tensor | None) -> int | None:
    return int(t.shape[0]) if t is not None and t.dim() >= 1 else None


def _peft_number(v, what: str, name: str, source: str, integer: bool) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    ok = ok and (float(v) > 0 if integer else float(v) != 0)
    if ok and integer and float(v) != int(v):
        ok = False
    if not ok:
        shown = repr(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"a {type(v).__name__}"
        raise AdapterError(f"{source}: PEFT config {what} for '{name}' is {shown}; it must be a "
                           + ("positive integer" if integer else "finite non-zero number")
                           + f" (fix 'r'/'alpha'/'rank_pattern'/'alpha_pattern' in {PEFT_CONFIG_NAME} or the "
                           f"'{METADATA_CONFIG_KEY}')")
    return float(v)


@dataclass
class _ScaleContext:
    writer: str
    config: dict | None               # PEFT LoKrConfig fields, when they apply to this file
    config_source: str
    config_strip: str                 # prefix removed from module prefixes before PEFT pattern matching
    override: float | None
    config_problem: str | None = None  # why the file's config is unusable (only kept when a scale is given)


def check_scale_input(value, what: str = "scale") -> float:
    """A finite number from a node input (ComfyUI's JSON parser lets NaN/Infinity through)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(float(value)):
        raise AdapterError(f"DitKitLoKrLoader input '{what}' is {value!r}; it must be a finite number")
    return float(value)


def _check_config(cfg: dict, source: str, where: str) -> None:
    pt = cfg.get("peft_type")
    if pt is not None and pt != "LOKR":
        raise AdapterError(f"{source}: the PEFT config from {where} is for peft_type {pt!r}, not 'LOKR' (config of "
                           "another adapter?)" if isinstance(pt, str) and len(pt) <= 32 else
                           f"{source}: the PEFT config from {where} has a peft_type that is not 'LOKR'")
    missing = [k for k in ("r", "alpha") if k not in cfg]
    if missing:
        raise AdapterError(f"{source}: the PEFT config from {where} has no {' / '.join(repr(k) for k in missing)}: "
                           "the LoKr scale alpha / r is not in the file (PEFT would fill in its own defaults; ditkit "
                           "does not guess); add the field, or set the node's 'scale' input")


def parse_lokr(sd: dict[str, torch.Tensor], peft_config: dict | None = None, source: str = "adapter", *,
               config_source: str | None = None, scale_override: float | None = None,
               metadata: dict | None = None) -> ParsedLoKr:
    """``peft_config``: the PEFT LoKrConfig of the file (see :func:`read_adapter_file`), ``config_source``:
    where it came from (for the report). ``scale_override``: an explicit scale (the node's ``scale`` input)
    that replaces every module's alpha/rank scale. ``metadata``: the safetensors metadata (names only, for
    hints in errors)."""
    writer = detect_writer(sd.keys())
    groups: dict[str, dict[str, str]] = {}
    unused: dict[str, str] = {}
    notes: list[str] = []
    for k in sd:
        if k in NETWORK_KEYS:
            t = sd[k]
            if t.numel() != 1 or t.is_floating_point() or t.is_complex():
                raise AdapterError(f"{source}: key '{k}' must be a single integer (musubi-tuner's LoKr factor), got "
                                   f"{t.dtype} of shape {tuple(t.shape)}")
            notes.append(f"'{k}' = {int(t.item())}: musubi-tuner PR #901 native LoKr (its scale rules are used)")
            continue
        for suf in _SUFFIXES:
            if k.endswith("." + suf):
                groups.setdefault(k[: -len(suf) - 1], {})[suf] = k
                break
        else:
            unused[k] = "not a LoKr tensor (no lokr_w1/lokr_w2/alpha/... suffix)"
    has_alpha = any(k.endswith(".alpha") for k in sd)
    if scale_override is not None:
        scale_override = check_scale_input(scale_override)
        if scale_override == 0.0:
            raise AdapterError("DitKitLoKrLoader input 'scale' is 0 here; 0 means 'from the file' and is not passed "
                               "as an override")
    # which PEFT config applies: PEFT files always use theirs; a diffusers export carries its config in the
    # metadata and no per-module alpha
    use_config = peft_config is not None and (writer == "peft" or not has_alpha)
    where = config_source or "the adapter config"
    config_problem = None
    if use_config:
        try:
            _check_config(peft_config, source, where)
        except AdapterError as e:
            if scale_override is None:
                raise
            config_problem, use_config = str(e), False  # the explicit scale replaces what the config would give
        if has_alpha and use_config:
            notes.append(f"per-module '.alpha' keys ignored: a PEFT-layout file is scaled by its config ({where})")
    elif peft_config is not None:
        notes.append(f"a PEFT config was found ({where}) but the file has per-module alpha keys: LyCORIS scaling used")
    strip = "base_model.model." if writer == "peft" else DIFFUSERS_COMPONENT + "."
    ctx = _ScaleContext(writer, peft_config if use_config else None, where, strip, scale_override, config_problem)
    modules: dict[str, LoKrModule] = {}
    for prefix, parts in groups.items():
        if not any(s in parts for s in ("lokr_w1", "lokr_w1_a", "lokr_w2", "lokr_w2_a")):
            for s, k in parts.items():
                unused[k] = f"'{s}' without LoKr factors for module '{prefix}'"
            continue
        m = LoKrModule(prefix=prefix, factors={s: sd[parts[s]] for s in FACTOR_KEYS if s in parts},
                       keys=sorted(parts.values()))
        if "alpha" in parts:
            a = sd[parts["alpha"]]
            if a.numel() != 1:
                raise AdapterError(f"{source}: key '{parts['alpha']}' must be a scalar alpha, got shape {tuple(a.shape)}")
            m.alpha = float(a.float().item())
        if "scalar" in parts:
            sc = sd[parts["scalar"]]
            if sc.numel() != 1:
                raise AdapterError(f"{source}: key '{parts['scalar']}' must be a single value (LyCORIS scalar), got "
                                   f"shape {tuple(sc.shape)}")
            if not sc.is_floating_point():
                raise AdapterError(f"{source}: key '{parts['scalar']}' has non-float dtype {sc.dtype}")
            m.scalar = float(sc.float().item())
            if not math.isfinite(m.scalar):
                raise AdapterError(f"{source}: key '{parts['scalar']}' is {m.scalar!r}; the LyCORIS scalar must be finite")
        if "dora_scale" in parts:
            m.unsupported = f"DoRA ('{parts['dora_scale']}'): weight-decomposed LoKr is not supported"
        if "lokr_t1" in parts:
            m.unsupported = f"'{parts['lokr_t1']}' (Tucker core on w1) is not supported"
        _set_scale(m, ctx, source)
        modules[prefix] = m
    notes.extend(_scale_notes(modules, ctx, metadata))
    return ParsedLoKr(modules=modules, unused=unused, writer=writer, notes=notes)


def _scale_notes(modules: dict[str, LoKrModule], ctx: _ScaleContext, metadata: dict | None) -> list[str]:
    out = []
    kinds: dict[str, int] = {}
    for m in modules.values():
        kinds[m.scale_kind] = kinds.get(m.scale_kind, 0) + 1
    if ctx.override is not None:
        out.append(f"scale: the node's 'scale' input {ctx.override:g} replaces the file's alpha/rank scale on all "
                   f"{len(modules)} modules")
    elif ctx.config is not None:
        cfg = ctx.config

        def _n(v) -> str:
            return str(len(v)) if isinstance(v, dict) else ("0" if not v else "?")

        def _v(v) -> str:
            return repr(v) if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) else f"<{type(v).__name__}>"

        out.append(f"scale: PEFT alpha / r from {ctx.config_source} (r={_v(cfg.get('r'))}, alpha={_v(cfg.get('alpha'))}, "
                   f"rank_pattern/alpha_pattern: {_n(cfg.get('rank_pattern'))}/{_n(cfg.get('alpha_pattern'))} entries)")
    if kinds.get("convention") and ctx.override is None:
        text, cite = NO_ALPHA_CONVENTIONS[ctx.writer]
        out.append(f"scale convention for {kinds['convention']} module(s) without alpha in the file: {text} [{cite}]")
    if kinds.get("undetermined") and metadata:
        hints = sorted(k for k in metadata if any(w in k.lower() for w in ("alpha", "network_dim", "rank", "lycoris")))
        if hints:
            out.append("metadata fields " + ", ".join(repr(h[:40]) for h in hints[:4]) + " are informational: the "
                       "writers do not read them when merging; if they give alpha and rank, set 'scale' = alpha / rank")
    return out


def _set_scale(m: LoKrModule, ctx: _ScaleContext, source: str) -> None:
    """Scale of one module. Never raises on factor shapes (a module that maps to no target is only reported);
    a module whose rank cannot be read gets scale NaN with the reason in ``scale_rule`` and :func:`validate_module`
    refuses it if it is used; a module whose scale the file does not determine is refused by :func:`plan`."""
    f = m.factors
    m.rank = _dim0(f.get("lokr_w2_b")) if "lokr_w2_b" in f else _dim0(f.get("lokr_w1_b"))
    if m.alpha is not None and (not math.isfinite(m.alpha) or m.alpha == 0.0):
        raise AdapterError(f"{source}: key '{m.prefix}.alpha' is {m.alpha!r}; alpha must be finite and non-zero "
                           "(LyCORIS would silently read 0 as 'alpha = rank'; re-export the adapter with its real alpha)")
    try:
        scale, rule, kind = _file_scale(m, ctx, source)
    except AdapterError as e:
        if ctx.override is None:
            raise
        scale, rule, kind = float("nan"), str(e), "undetermined"
    if ctx.override is not None:
        m.scale, m.scale_kind = ctx.override, "input"
        m.scale_rule = (f"node 'scale' input {ctx.override:g} (the file gives: "
                        + ("undetermined: " if kind == "undetermined" else "") + f"{rule})")
    elif kind == "undetermined":
        m.scale, m.scale_kind, m.scale_rule, m.undetermined = float("nan"), kind, f"undetermined: {rule}", rule
        return
    else:
        m.scale, m.scale_rule, m.scale_kind = scale, rule, kind
    if not math.isfinite(m.scale):
        return  # unusable rank: validate_module refuses the module if it is used
    if m.scalar != 1.0:
        m.scale *= m.scalar
        m.scale_rule += f" x scalar {m.scalar:g}"
    if not math.isfinite(m.scale):
        raise AdapterError(f"{source}: module '{m.prefix}' has a non-finite scale ({m.scale_rule}); the adapter's "
                           "alpha/rank/scalar values are unusable")


def _file_scale(m: LoKrModule, ctx: _ScaleContext, source: str) -> tuple[float, str, str]:
    """(scale, rule, kind) as the module's writer defines it; kind "undetermined" with the reason as rule."""
    f = m.factors
    if ctx.config_problem is not None:
        return float("nan"), ctx.config_problem, "undetermined"
    if ctx.config is not None:
        cfg = ctx.config
        name = m.prefix.removeprefix(ctx.config_strip)
        r = _pattern_lookup(cfg.get("rank_pattern"), name, "rank_pattern", source)
        r = cfg.get("r") if r is None else r
        alpha = _pattern_lookup(cfg.get("alpha_pattern"), name, "alpha_pattern", source)
        alpha = cfg.get("alpha") if alpha is None else alpha
        rf = _peft_number(r, "r", name, source, integer=True)
        af = _peft_number(alpha, "alpha", name, source, integer=False)
        if m.decomposed and m.rank is not None and m.rank != int(rf):
            raise AdapterError(f"{source}: module '{m.prefix}' has factors of rank {m.rank} but the PEFT config "
                               f"({ctx.config_source}) gives r = {int(rf)} for it: the config belongs to another "
                               "adapter? (set the node's 'scale' input to override)")
        return af / rf, f"PEFT alpha/r = {af:g}/{rf:g}", "config"
    if ctx.writer == "peft":
        return float("nan"), (f"PEFT-layout file (base_model.model.* keys) without its {PEFT_CONFIG_NAME} next to it "
                              f"and without '{METADATA_CONFIG_KEY}': PEFT scales every module by alpha / r from that "
                              "config"), "undetermined"
    full = "lokr_w1" in f and "lokr_w2" in f
    if ctx.writer == "musubi-tuner" and "lokr_w1" in f and "lokr_t2" not in f:
        # PR #901: dim = rank of w2 when decomposed, max(w2.shape) when w2 is full; scale alpha / dim
        dim = m.rank if "lokr_w2" not in f else max(int(s) for s in f["lokr_w2"].shape)
        if not dim:
            return float("nan"), "decomposed factor without a usable rank (lokr_w2_b)", "file"
        if m.alpha is None:
            return 1.0, f"no alpha: alpha = dim ({dim}) -> 1.0", "convention"
        what = "max(lokr_w2.shape)" if "lokr_w2" in f else "rank"
        return m.alpha / dim, f"musubi-tuner PR #901 alpha/dim = {m.alpha:g}/{dim} (dim = {what})", "file"
    if ctx.writer in DIFFUSERS_LAYOUTS and m.alpha is None:
        return 1.0, "no alpha, no lora_adapter_metadata: diffusers convention alpha = r -> 1.0", "convention"
    if full:
        return 1.0, ("full-rank factors -> 1.0 (LyCORIS" + (f"; saved alpha {m.alpha:g} not used)" if m.alpha is not None
                                                           else ")")), "file"
    if m.rank is None or m.rank == 0:
        return float("nan"), "decomposed factor without a usable rank (lokr_w1_b/lokr_w2_b)", "file"
    if m.alpha is not None:
        return m.alpha / float(m.rank), f"alpha/rank = {m.alpha:g}/{m.rank}", "file"
    if ctx.writer in NO_ALPHA_CONVENTIONS:
        return 1.0, f"no alpha: alpha = rank ({m.rank}) -> 1.0", "convention"
    why = NO_ALPHA_UNDETERMINED.get(ctx.writer, "no known writer defines a scale for it")
    return float("nan"), (f"decomposed factors without an '.alpha' key and no adapter config in the file ({why})"), \
        "undetermined"

# ---------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    weight_key: str                   # ComfyUI model state-dict key, e.g. "diffusion_model.layers.0.attention.qkv.weight"
    rows: tuple[int, int] | None      # row range of a fused weight, None = whole weight
    shape: tuple[int, ...]            # shape the adapter must produce
    via: str                          # naming convention that produced this name
    swap_halves: bool = False         # diffusers norm_out.linear [scale; shift] -> ComfyUI [shift; scale]

    def describe(self) -> str:
        w = self.weight_key.removeprefix("diffusion_model.").removesuffix(".weight")
        return w if self.rows is None else f"{w}[{self.rows[0]}:{self.rows[1]}]"


@dataclass
class TargetMap:
    family: str                       # "zimage" | "flux2"
    config: dict
    names: dict[str, Target]          # dotted name -> target
    underscored: dict[str, str]       # underscored name -> dotted name (unique only)


def detect_family(shapes: dict[str, tuple[int, ...]]) -> str:
    if "diffusion_model.double_stream_modulation_img.lin.weight" in shapes:
        return "flux2"
    if "diffusion_model.cap_embedder.1.weight" in shapes and "diffusion_model.layers.0.attention.qkv.weight" in shapes:
        return "zimage"
    raise UnsupportedModelError("LoKr loader supports ComfyUI Z-Image and FLUX.2 models only (no "
                                "'double_stream_modulation_img.lin' or fused 'layers.0.attention.qkv' weight found)")


def _count(shapes, prefix: str) -> int:
    n = 0
    while any(k.startswith(f"{prefix}{n}.") for k in shapes):
        n += 1
    return n


def build_targets(shapes: dict[str, tuple[int, ...]]) -> TargetMap:
    """``shapes``: the ComfyUI model's state-dict key -> shape (keys start with ``diffusion_model.``)."""
    fam = detect_family(shapes)
    names: dict[str, Target] = {}

    def full(name: str, comfy_mod: str, via: str, swap: bool = False) -> None:
        wk = f"diffusion_model.{comfy_mod}.weight"
        if wk in shapes:
            names[name] = Target(wk, None, tuple(shapes[wk]), via, swap)

    def rows(name: str, comfy_mod: str, r0: int, r1: int, via: str) -> None:
        wk = f"diffusion_model.{comfy_mod}.weight"
        if wk in shapes:
            s = tuple(shapes[wk])
            names[name] = Target(wk, (r0, r1), (r1 - r0, *s[1:]), via)

    for wk, s in shapes.items():  # native ComfyUI (== BFL for FLUX.2) module paths
        if wk.startswith("diffusion_model.") and wk.endswith(".weight") and len(s) >= 2:
            full(wk[len("diffusion_model."):-len(".weight")], wk[len("diffusion_model."):-len(".weight")], "comfy")

    if fam == "zimage":
        dim = shapes["diffusion_model.cap_embedder.1.weight"][0]
        cfg = {"dim": dim, "n_layers": _count(shapes, "diffusion_model.layers."),
               "n_refiner_layers": _count(shapes, "diffusion_model.noise_refiner.")}
        blocks = [f"layers.{i}" for i in range(cfg["n_layers"])] + \
                 [f"noise_refiner.{i}" for i in range(cfg["n_refiner_layers"])] + \
                 [f"context_refiner.{i}" for i in range(_count(shapes, "diffusion_model.context_refiner."))]
        for b in blocks:
            for j, p in enumerate("qkv"):
                rows(f"{b}.attention.to_{p}", f"{b}.attention.qkv", j * dim, (j + 1) * dim, "diffusers")
            full(f"{b}.attention.to_out.0", f"{b}.attention.out", "diffusers")
        full("all_x_embedder.2-1", "x_embedder", "diffusers")
        full("all_final_layer.2-1.linear", "final_layer.linear", "diffusers")
        full("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1", "diffusers")
    else:
        h = shapes["diffusion_model.img_in.weight"][0]
        nd = _count(shapes, "diffusion_model.double_blocks.")
        ns = _count(shapes, "diffusion_model.single_blocks.")
        l1 = shapes["diffusion_model.single_blocks.0.linear1.weight"][0] if ns else 9 * h
        mlp2 = l1 - 3 * h  # FLUX.2: 2 * 3h (SwiGLU gate + up) = 6h
        cfg = {"hidden": h, "depth": nd, "depth_single": ns, "linear1_rows": l1, "mlp_rows": mlp2}
        for i in range(nd):
            b, d = f"transformer_blocks.{i}", f"double_blocks.{i}"
            for j, p in enumerate("qkv"):
                rows(f"{b}.attn.to_{p}", f"{d}.img_attn.qkv", j * h, (j + 1) * h, "diffusers")
                rows(f"{b}.attn.add_{p}_proj", f"{d}.txt_attn.qkv", j * h, (j + 1) * h, "diffusers")
            full(f"{b}.attn.to_qkv", f"{d}.img_attn.qkv", "diffusers")
            full(f"{b}.attn.to_added_qkv", f"{d}.txt_attn.qkv", "diffusers")
            full(f"{b}.attn.to_out.0", f"{d}.img_attn.proj", "diffusers")
            full(f"{b}.attn.to_add_out", f"{d}.txt_attn.proj", "diffusers")
            full(f"{b}.ff.linear_in", f"{d}.img_mlp.0", "diffusers")
            full(f"{b}.ff.linear_out", f"{d}.img_mlp.2", "diffusers")
            full(f"{b}.ff_context.linear_in", f"{d}.txt_mlp.0", "diffusers")
            full(f"{b}.ff_context.linear_out", f"{d}.txt_mlp.2", "diffusers")
        for i in range(ns):
            b, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
            full(f"{b}.attn.to_qkv_mlp_proj", f"{s}.linear1", "diffusers")
            full(f"{b}.attn.to_out", f"{s}.linear2", "diffusers")
            for j, p in enumerate("qkv"):
                rows(f"{b}.attn.to_{p}", f"{s}.linear1", j * h, (j + 1) * h, "diffusers")
            rows(f"{b}.proj_mlp", f"{s}.linear1", 3 * h, 3 * h + mlp2, "diffusers")
            rows(f"{s}.linear1_qkv", f"{s}.linear1", 0, 3 * h, "comfy")
        full("double_stream_modulation_img.linear", "double_stream_modulation_img.lin", "diffusers")
        full("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin", "diffusers")
        full("single_stream_modulation.linear", "single_stream_modulation.lin", "diffusers")
        full("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer", "diffusers")
        full("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer", "diffusers")
        full("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer", "diffusers")
        full("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer", "diffusers")
        full("x_embedder", "img_in", "diffusers")
        full("context_embedder", "txt_in", "diffusers")
        full("proj_out", "final_layer.linear", "diffusers")
        full("norm_out.linear", "final_layer.adaLN_modulation.1", "diffusers", swap=True)

    under: dict[str, str] = {}
    clash: set[str] = set()
    for n in names:
        u = n.replace(".", "_")
        if u in under and under[u] != n:
            clash.add(u)
        under[u] = n
    for u in clash:
        del under[u]
    return TargetMap(fam, cfg, names, under)


def resolve(prefix: str, tm: TargetMap) -> tuple[str, Target] | None:
    """The target of an adapter module prefix, or None."""
    for p in UNDERSCORE_PREFIXES:
        if prefix.startswith(p):
            n = tm.underscored.get(prefix[len(p):])
            if n is not None:
                return n, tm.names[n]
    for p in DOTTED_PREFIXES:
        if prefix.startswith(p):
            n = prefix[len(p):]
            if n in tm.names:
                return n, tm.names[n]
    return None


# ---------------------------------------------------------------------------------------------- planning
@dataclass
class PlanItem:
    module: LoKrModule
    name: str
    target: Target


@dataclass
class LoKrPlan(Report):
    family: str
    writer: str
    items: list[PlanItem]
    unused: dict[str, str]            # file key -> why
    refused: dict[str, str]           # module prefix -> why (unsupported variant)
    notes: list[str]

    KEYS = ("family", "writer", "applied", "unused", "refused", "notes")
    VALUES = {"applied": lambda p: [{"module": it.module.prefix, "target": it.target.describe(), "via": it.target.via,
                                     "scale": it.module.scale, "scale_rule": it.module.scale_rule,
                                     "scale_kind": it.module.scale_kind} for it in p.items]}

    def summary(self) -> str:
        return (f"LoKr ({self.writer}) on {self.family}: {len(self.items)} modules applied, "
                f"{len(self.unused)} keys unused, {len(self.refused)} refused")


_EXP_MASK = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}


def _finite(t: torch.Tensor) -> bool:
    """No NaN/Inf: an all-ones exponent field (integer view: ~5x faster than isfinite on CPU bf16)."""
    if not t.is_floating_point():
        return True
    if t.dtype in _EXP_MASK and t.is_contiguous():
        idt, mask = _EXP_MASK[t.dtype]
        return not bool(((t.view(idt) & mask) == mask).any().item())
    return bool(torch.isfinite(t).all().item())


def validate_module(m: LoKrModule, source: str) -> None:
    f = m.factors
    for s, t in f.items():
        if not t.is_floating_point():
            raise AdapterError(f"{source}: key '{m.prefix}.{s}' has non-float dtype {t.dtype}")
        if not _finite(t):
            raise AdapterError(f"{source}: key '{m.prefix}.{s}' contains NaN or Inf values")
    has_w1 = "lokr_w1" in f or ("lokr_w1_a" in f and "lokr_w1_b" in f)
    has_w2 = "lokr_w2" in f or ("lokr_w2_a" in f and "lokr_w2_b" in f)
    if not (has_w1 and has_w2):
        raise AdapterError(f"{source}: module '{m.prefix}' is incomplete (has {sorted(f)}; needs lokr_w1 or "
                           "lokr_w1_a+lokr_w1_b, and lokr_w2 or lokr_w2_a+lokr_w2_b)")
    for s, t in f.items():
        want = None if s in ("lokr_w2", "lokr_t2") else 2  # conv-shaped w2/t2 keep their kernel dims
        if (want is not None and t.dim() != want) or (want is None and t.dim() < 2):
            raise AdapterError(f"{source}: '{m.prefix}.{s}' must be " + ("2-D" if want else "at least 2-D")
                               + f", got shape {tuple(t.shape)} (corrupt or non-LoKr tensor)")
        if t.numel() == 0:
            raise AdapterError(f"{source}: '{m.prefix}.{s}' is empty (shape {tuple(t.shape)}; rank 0?)")
    if "lokr_w1" not in f and f["lokr_w1_a"].shape[1] != f["lokr_w1_b"].shape[0]:
        raise AdapterError(f"{source}: '{m.prefix}.lokr_w1_a' {tuple(f['lokr_w1_a'].shape)} and '.lokr_w1_b' "
                           f"{tuple(f['lokr_w1_b'].shape)} have different ranks")
    if "lokr_w2" not in f:
        a, b = f["lokr_w2_a"], f["lokr_w2_b"]
        if "lokr_t2" in f:
            t2 = f["lokr_t2"]
            ok = t2.dim() >= 2 and t2.shape[0] == a.shape[0] and t2.shape[1] == b.shape[0] and a.dim() == 2 and b.dim() == 2
        else:
            ok = a.dim() == 2 and a.shape[1] == b.shape[0]
        if not ok:
            raise AdapterError(f"{source}: '{m.prefix}' w2 factors do not fit: lokr_w2_a {tuple(a.shape)}, lokr_w2_b "
                               f"{tuple(b.shape)}" + (f", lokr_t2 {tuple(f['lokr_t2'].shape)}" if "lokr_t2" in f else ""))
    if "lokr_w1_b" in f and "lokr_w2_b" in f and f["lokr_w1_b"].shape[0] != f["lokr_w2_b"].shape[0]:
        raise AdapterError(f"{source}: module '{m.prefix}' has two decomposed factors of different ranks "
                           f"(lokr_w1_b {f['lokr_w1_b'].shape[0]}, lokr_w2_b {f['lokr_w2_b'].shape[0]}): which one the "
                           "alpha divides is ambiguous (LyCORIS takes w1's, ComfyUI w2's); no writer produces this")
    if m.undetermined is None and not math.isfinite(m.scale):
        raise AdapterError(f"{source}: module '{m.prefix}' has no usable scale ({m.scale_rule})")


def plan(parsed: ParsedLoKr, shapes: dict[str, tuple[int, ...]], source: str = "adapter") -> LoKrPlan:
    """Map and validate. Raises :class:`AdapterError` on any bad module (nothing is applied then)."""
    tm = build_targets(shapes)
    items: list[PlanItem] = []
    unused = dict(parsed.unused)
    refused: dict[str, str] = {}
    undetermined: list[LoKrModule] = []
    for prefix, m in parsed.modules.items():
        hit = resolve(prefix, tm)
        if hit is None:
            for k in m.keys:
                unused[k] = f"module '{prefix}' matches no {tm.family} weight (naming not recognised or other model)"
            continue
        name, tgt = hit
        if m.unsupported:
            refused[prefix] = m.unsupported
            continue
        validate_module(m, source)
        if m.undetermined is not None:
            undetermined.append(m)
        got = m.shape()
        if tuple(got) != tuple(tgt.shape):
            raise AdapterError(f"{source}: module '{prefix}' builds ΔW of shape {tuple(got)} but its target "
                               f"'{tgt.describe()}' ({tm.family}) has shape {tuple(tgt.shape)}: adapter for another "
                               "model size/family?")
        items.append(PlanItem(m, name, tgt))
    if undetermined:
        m = undetermined[0]
        raise AdapterError(f"{source}: the file does not determine the scale (alpha / rank) of {len(undetermined)} "
                           f"LoKr module(s) ({parsed.writer} naming; first: '{m.prefix}'): {m.undetermined}. Nothing was "
                           "applied. Set the DitKitLoKrLoader 'scale' input to the adapter's alpha / rank (what its "
                           "trainer used, e.g. 1.0 when alpha == rank)")
    notes = list(parsed.notes)
    if not items:
        fams = _guess_family(parsed)
        raise AdapterError(f"{source}: no LoKr module applies to this {tm.family} model "
                           f"({len(parsed.modules)} modules, {len(unused)} unused keys, {len(refused)} refused"
                           + (f"; the key names look like {fams}" if fams else "") + ")"
                           + (f"; first unused: {next(iter(unused))!r} ({next(iter(unused.values()))})" if unused else "")
                           + (f"; refused: {next(iter(refused.items()))}" if refused else ""))
    return LoKrPlan(tm.family, parsed.writer, items, unused, refused, notes)


def _guess_family(parsed: ParsedLoKr) -> str:
    ks = " ".join(parsed.modules)
    if "double_blocks" in ks or "single_blocks" in ks or "transformer_blocks" in ks:
        return "FLUX"
    if "attention" in ks and "layers" in ks:
        return "Z-Image/Lumina"
    if "down_blocks" in ks or "input_blocks" in ks:
        return "a UNet (SD/SDXL)"
    return ""


def module_delta(item: PlanItem, dtype=torch.float32, device=None) -> torch.Tensor:
    """ΔW (scale applied, strength not) for the item's target slice."""
    f = item.module.factors
    if device is not None:
        f = {k: v.to(device) for k, v in f.items()}
    d = delta_weight(f, item.target.shape, item.module.scale, dtype)
    if item.target.swap_halves:
        d = swap_halves(d)
    return d


def swap_halves(d: torch.Tensor) -> torch.Tensor:
    n = d.shape[0] // 2
    return torch.cat([d[n:], d[:n]], dim=0)


# ---------------------------------------------------------------------------------------------- patching
def patch_payload(item: PlanItem) -> tuple:
    """What a lazy ComfyUI patch keeps for one module: its factors in :data:`FACTOR_KEYS` order (None where
    absent), then scale, target shape, swap_halves."""
    f = item.module.factors
    return tuple(f.get(k) for k in FACTOR_KEYS) + (float(item.module.scale), tuple(item.target.shape),
                                                   bool(item.target.swap_halves))


def apply_patch_(weight: torch.Tensor, payload: tuple, strength: float, function=None,
                 key: str = "?") -> torch.Tensor:
    """``weight += function(strength * scale * kron(w1, w2))`` in place (fp32 products, one Kronecker row block
    at a time); ``weight`` is the target slice ComfyUI hands the patch. Signs of strength and scale are kept."""
    n = len(FACTOR_KEYS)
    factors = {k: t.to(weight.device) for k, t in zip(FACTOR_KEYS, payload[:n]) if t is not None}
    scale, shape, swap = payload[n:n + 3]
    if tuple(weight.shape) != tuple(shape):
        raise AdapterError(f"DitKitLoKrLoader: patch for '{key}' expects shape {tuple(shape)}, weight is "
                           f"{tuple(weight.shape)}")
    add_delta_(weight, factors, float(scale) * float(strength), swap_halves=swap, function=function)
    return weight
