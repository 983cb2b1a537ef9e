"""Streaming weight quantization into ComfyUI's ``comfy_quant`` checkpoint layout (plain torch).

Per tensor: read -> convert (H3 official / diffusers layouts through :mod:`.h3`) -> quantize -> hand over, one
at a time; nothing of the full-precision model is kept. What a quantized layer becomes is exactly what ComfyUI
itself writes for a quantized ``Linear`` (``comfy/ops.py`` ``_quantized_weight_state_dict``):

* ``<layer>.weight``          the quantized data (:func:`ditkit.kernels.quant.quantize`);
* ``<layer>.weight_scale``    (and ``<layer>.weight_scale_2`` for nvfp4);
* ``<layer>.comfy_quant``     uint8 bytes of ``json.dumps({"format": <QUANT_ALGOS name>})``;

everything else passes through unchanged, so ``comfy.sd.load_diffusion_model_state_dict`` builds the model
with its mixed-precision ops and every native path (LoRA patching, dynamic VRAM, offload) works on it.

Which layers are quantized (``RECIPES``): only the linear weights inside the repeated transformer blocks
(attention projections, MLP, and for H3 the per-block AdaLN projection); embeddings / input projections, time
and text embedders, norms, modulation (except H3's per-block AdaLN, see below), final layers / output
projections, biases and every other tensor stay in their stored precision. A block linear with a side below
16 ("small layer": less than one nvfp4 block per row; the scale would cost as much as the saving) stays too.

* LTX-2: Lightricks' own fp8 recipe, ``ltx_core.quantization.fp8_cast`` (``_FP8_CAST_LINEAR_SUFFIXES``):
  Linears under ``transformer_blocks.`` whose names end with ``.to_q``, ``.to_k``, ``.to_v``, ``.to_out.0``,
  ``ff.net.0.proj`` or ``ff.net.2`` (video and audio attention / FF); ``adaln_single``, ``patchify_proj``,
  ``caption_projection``, the embedding connectors, ``proj_out`` and the scale-shift tables stay bf16.
* H3: the layer set of Comfy-Org's quantized repacks (``Comfy-Org/MiniMax-H3`` ``*_int8_convrot``: every 2-D
  block weight carries a ``comfy_quant`` marker, including ``blocks.N.adaln_proj.linear``; h3.md, "INT8
  ConvRot"): DiT and token-refiner blocks' ``attn.qkv_proj``, ``attn.out_proj``, ``mlp.fc1``, ``mlp.fc2`` and
  the DiT blocks' ``adaln_proj.linear``; the patch / condition projections, ``time_embedder``, ``final_layer``
  (incl. its AdaLN), norms, ``rope.inv_freq``, ``adaln_t_table`` and FastH3's ``to_gate_compress`` stay.
* Z-Image, FLUX.2: no published per-layer recipe was found; the same rule as LTX-2 is applied (block
  attention + MLP linears; Z-Image ``layers`` / ``noise_refiner`` / ``context_refiner`` ``attention.qkv``,
  ``attention.out``, ``feed_forward.w1/w2/w3``; FLUX.2 ``double_blocks`` ``img/txt_attn.qkv``, ``.proj``,
  ``img/txt_mlp.0/2`` and ``single_blocks`` ``linear1`` / ``linear2``); modulation (``adaLN_modulation``,
  ``*_modulation``), embedders and final layers stay.

Weight-only: no activation ``input_scale`` is written (no calibration is implemented; ComfyUI computes the
activations in its compute dtype, or quantizes them dynamically where its kernels do).

Refused before heavy work where the headers tell, else at the tensor (nothing is handed over after an error):
a source that is already quantized (any ``comfy_quant`` marker, ``_quantization_metadata``, ``scaled_fp8``,
``weight_scale`` sidecars, int8 / fp8 / uint8 weights: re-quantizing would stack two roundings; load it as
stored), a non-finite value in any floating tensor (named).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..errors import CheckpointError
from ..report import Report
from ..kernels import quant as Q
from . import h3 as h3core
from . import host_memory
from .safetensors_io import DTYPES, SafeFile, read_header

QUANT_SUFFIXES = h3core.QUANT_SIDECARS
SMALL_SIDE = 16


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    layer_class: str
    quantize: bool


def _r(rx: str, cls: str, q: bool) -> Rule:
    return Rule(re.compile(rx), cls, q)


_NORM = _r(r"(^|\.)([a-z_]*norm[a-z_0-9]*)(\.|$)", "norms", False)

RECIPES: dict[str, dict] = {
    "h3": {
        "source": "Comfy-Org/MiniMax-H3 quantized repacks (block linears incl. per-block AdaLN carry comfy_quant)",
        "rules": [
            _r(r"^(blocks|token_refiner\.blocks)\.\d+\.attn\.(qkv_proj|out_proj)\.weight$", "block attention", True),
            _r(r"^(blocks|token_refiner\.blocks)\.\d+\.mlp\.fc[12]\.weight$", "block MLP", True),
            _r(r"^blocks\.\d+\.adaln_proj\.linear\.weight$", "block AdaLN", True),
            _r(r"^blocks\.\d+\.adaln_proj\.", "block AdaLN", False),
            _r(r"^blocks\.\d+\.attn\.to_gate_compress\.", "FastH3 VSA gates", False),
            _r(r"^(video_patch_proj|audio_patch_proj|condition_proj|time_embedder)\.", "embeddings / input projections",
               False),
            _r(r"^final_layer\.", "final layer", False),
            _r(r"^(rope\.inv_freq|adaln_t_table)$", "rope / AdaLN curve table", False),
        ],
    },
    "ltx2": {
        "source": "Lightricks LTX-2 ltx_core.quantization.fp8_cast (_FP8_CAST_LINEAR_SUFFIXES)",
        "rules": [
            _r(r"transformer_blocks\.\d+\.[a-z_0-9]*attn[a-z_0-9]*\.(to_q|to_k|to_v|to_out\.0)\.weight$",
               "block attention", True),
            _r(r"transformer_blocks\.\d+\.[a-z_]*ff\.net\.(0\.proj|2)\.weight$", "block MLP", True),
            _r(r"scale_shift_table|adaln_single\.", "modulation / AdaLN", False),
            _r(r"(^|\.)(patchify_proj|audio_patchify_proj|caption_projection|audio_caption_projection)\.",
               "embeddings / input projections", False),
            _r(r"embeddings_connector\.", "text embedding connectors", False),
            _r(r"(^|\.)(proj_out|audio_proj_out)\.", "final layer", False),
        ],
    },
    "zimage": {
        "source": "LTX-2's block-linear rule applied to Z-Image (no published Z-Image recipe found)",
        "rules": [
            _r(r"(^|\.)(layers|noise_refiner|context_refiner)\.\d+\.attention\.(qkv|out)\.weight$", "block attention",
               True),
            _r(r"(^|\.)(layers|noise_refiner|context_refiner)\.\d+\.feed_forward\.w[123]\.weight$", "block MLP", True),
            _r(r"adaLN_modulation", "modulation / AdaLN", False),
            _r(r"(^|\.)(x_embedder|cap_embedder|t_embedder|x_pad_token|cap_pad_token)(\.|$)",
               "embeddings / input projections", False),
            _r(r"(^|\.)final_layer\.", "final layer", False),
        ],
    },
    "flux2": {
        "source": "LTX-2's block-linear rule applied to FLUX.2 (no published FLUX.2 per-layer recipe found)",
        "rules": [
            _r(r"(^|\.)double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)\.weight$", "block attention", True),
            _r(r"(^|\.)double_blocks\.\d+\.(img|txt)_mlp\.\d+\.weight$", "block MLP", True),
            _r(r"(^|\.)single_blocks\.\d+\.linear[12]\.weight$", "block attention + MLP (fused)", True),
            _r(r"modulation", "modulation / AdaLN", False),
            _r(r"(^|\.)(img_in|txt_in|time_in|guidance_in)\.", "embeddings / input projections", False),
            _r(r"(^|\.)final_layer\.", "final layer", False),
        ],
    },
}

# family markers (ComfyUI names; first match wins), see loaders/h3.py _FAMILIES
_MARKERS = (("adaln_single.emb.timestep_embedder.linear_1.bias", "ltx2"),
            ("double_stream_modulation_img.lin.weight", "flux2"),
            ("cap_embedder.1.weight", "zimage"))
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def model_prefix(keys) -> str:
    """The model prefix every key of a single file carries (one of :data:`PREFIXES`), else ``""``."""
    keys = list(keys)
    return next((pf for pf in PREFIXES if all(k.startswith(pf) for k in keys)), "")


def classify(family: str, key: str, shape: tuple[int, ...]) -> tuple[str, bool, str]:
    """-> (layer class, quantize?, why) for one tensor of ``family`` (key without the model prefix)."""
    rules = RECIPES[family]["rules"]
    for rule in rules:
        if rule.pattern.search(key):
            if rule.quantize:
                if len(shape) != 2:
                    return rule.layer_class, False, "not 2-D"
                if min(shape) < SMALL_SIDE:
                    return rule.layer_class, False, f"small layer (a side < {SMALL_SIDE})"
                return rule.layer_class, True, "recipe"
            return rule.layer_class, False, "recipe keeps it"
    if _NORM.pattern.search(key) or key.endswith(".scale"):
        return "norms", False, "recipe keeps it"
    if key.endswith(".bias") or len(shape) < 2:
        return "biases / 1-D", False, "not a linear weight"
    return "other", False, "not in the recipe"


def detect_family(keys) -> str | None:
    ks = set(keys)
    for marker, fam in _MARKERS:
        if any(k == marker or k.endswith("." + marker) for k in ks):
            return fam
    if any(k.endswith("video_patch_proj.weight") or k.endswith("audio_proj_in.weight") for k in ks):
        return "h3"
    return None


def marker_tensor(fmt: str) -> torch.Tensor:
    """The ``<layer>.comfy_quant`` tensor ComfyUI writes for a layer quantized in ``fmt``."""
    return torch.tensor(list(json.dumps({"format": fmt}).encode("utf-8")), dtype=torch.uint8)


def refuse_quantized_source(path: str, keys_dtypes: dict[str, str], metadata: dict[str, str] | None) -> None:
    """A source that is already quantized (any scheme) is refused, naming what says so."""
    meta = metadata or {}
    if "_quantization_metadata" in meta:
        raise CheckpointError(f"'{path}' is already quantized (__metadata__ '_quantization_metadata'); quantize from "
                              "the full-precision source, or load this file with weight_format 'as stored'")
    for k, dt in keys_dtypes.items():
        if k.endswith(".comfy_quant") or k.endswith("scaled_fp8") or k.endswith(QUANT_SUFFIXES):
            what = k.rsplit(".", 1)[-1]
            raise CheckpointError(f"'{path}' is already quantized (tensor {k!r}, a '{what}' entry); quantize from the "
                                  "full-precision source, or load this file with weight_format 'as stored'")
        if dt not in ("F64", "F32", "F16", "BF16"):
            raise CheckpointError(f"'{path}': tensor {k!r} is {dt}, not a float weight: the source is already "
                                  "quantized (or not a diffusion model); quantize from the full-precision source, or "
                                  "load it with weight_format 'as stored'")


# ------------------------------------------------------------------------------------------------- plan

@dataclass
class ClassStats(Report):
    KEYS = ("tensors", "params", "bytes_in", "bytes_out", "quantized", "kept_small", "**errors")

    tensors: int = 0
    params: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    quantized: int = 0
    kept_small: int = 0
    max_rel_err: float = 0.0        # max over the class's quantized tensors of ||W - deq(Q(W))|| / ||W|| (measured rows)
    err_sq: float = 0.0
    ref_sq: float = 0.0
    err_rows: int = 0               # rows of the quantized weights the error was measured on
    rows: int = 0                   # rows of the quantized weights

    @property
    def errors(self) -> dict:
        """The reconstruction errors, for a class with quantized tensors whose error was measured (none otherwise);
        ``error_rows`` says on how many of the rows (all of them, or a sample: see :data:`ERROR_MODES`)."""
        if not (self.quantized and self.ref_sq > 0):
            return {}
        return {"rel_rms_error": math.sqrt(self.err_sq / self.ref_sq), "max_tensor_rel_error": self.max_rel_err,
                "error_rows": f"{self.err_rows}/{self.rows}"}


# the reconstruction error the loaders / converter report, measured while quantizing (kernels/quant.py ErrorSample):
# "full" every row, "sampled" every ERROR_EVERY-th row slice (about 1/8 of the rows, each tensor's first slice
# included), "off" none. Reported with the rows measured, so a sampled figure never reads as a full one.
ERROR_MODES = ("sampled", "full", "off")
ERROR_EVERY = 8


def _error_every(mode) -> int:
    if mode is True or mode == "full":
        return 1
    if mode == "sampled":
        return ERROR_EVERY
    if mode is False or mode == "off" or mode is None:
        return 0
    raise ValueError(f"measure_error {mode!r}: one of {ERROR_MODES} (or True / False)")


@dataclass
class QuantPlan:
    """What each source tensor becomes (decided from shapes / dtypes only)."""

    family: str
    fmt: str
    source_inventory: "OrderedDict[str, tuple[tuple[int, ...], str]]"     # key -> (shape, safetensors dtype)
    decisions: dict[str, tuple[str, bool, str]]                            # key -> classify()
    prefix: str = ""

    def output_inventory(self) -> "OrderedDict[str, tuple[tuple[int, ...], str]]":
        """Every output key with its shape and safetensors dtype, in output order (for a header written first)."""
        out: OrderedDict[str, tuple[tuple[int, ...], str]] = OrderedDict()
        for k, (shape, dt) in self.source_inventory.items():
            cls, q, _ = self.decisions[k]
            if not q:
                out[k] = (shape, dt)
                continue
            layer = k[: -len(".weight")]
            for suffix, (s, tdt) in Q.storage_layout(shape, self.fmt).items():
                out[f"{layer}.{suffix}"] = (s, _st_dtype(tdt))
            out[f"{layer}.comfy_quant"] = ((len(marker_tensor(self.fmt)),), "U8")
        return out

    def quantized_layers(self) -> list[str]:
        return [k[: -len(".weight")] for k, (_, q, _) in self.decisions.items() if q]

    def quantized_keys(self) -> frozenset[str]:
        """The source keys :func:`quantize_stream` quantizes (and never keeps): a reader may read them into one
        reused buffer (``scratch_keys``)."""
        return frozenset(k for k, (_, q, _) in self.decisions.items() if q)


def _st_dtype(dt: torch.dtype) -> str:
    for name, (tdt, _) in DTYPES.items():
        if tdt == dt:
            return name
    raise CheckpointError(f"this safetensors reader has no dtype name for {dt}")


def make_plan(family: str, fmt: str, inventory: "OrderedDict[str, tuple[tuple[int, ...], str]]",
              prefix: str = "") -> QuantPlan:
    Q.get_format(fmt)
    if family not in RECIPES:
        raise CheckpointError(f"no quantization recipe for model family {family!r} (known: {sorted(RECIPES)})")
    dec = {k: classify(family, k[len(prefix):] if prefix and k.startswith(prefix) else k, shape)
           for k, (shape, _) in inventory.items()}
    return QuantPlan(family, fmt, inventory, dec, prefix)


@dataclass
class QuantReport(Report):
    KEYS = ("format=fmt", "family", "recipe", "activation_scales", "bytes_in", "bytes_out", "classes", "block_scales",
            "timing", "cache", "quantized_on")
    VALUES = {"activation_scales": lambda r: "none"}   # weight-only: no input_scale is ever written

    family: str
    fmt: str
    recipe: str
    classes: dict[str, ClassStats] = field(default_factory=dict)
    # block formats loaded into the host: {"layers_kept", "layers", "bytes_not_copied"} (bridge/quant_scales.py:
    # layers whose block scales are the loader's tensors, not the host's clone); empty otherwise
    block_scales: dict = field(default_factory=dict)
    # {"seconds", "source_bytes"} of the quantizing read (set by the loaders), empty otherwise
    timing: dict = field(default_factory=dict)
    # the write-once cache (loaders/quant_cache.py): {"state": "off" | "hit" | "written" | ..., ...}
    cache: dict = field(default_factory=dict)
    # where the quantize ran (set by quantize_stream): "cpu" or "<cuda device> (<backend>)"; "" when nothing was
    # quantized in this load (a cache hit)
    quantized_on: str = ""

    def totals(self) -> tuple[int, int]:
        return (sum(c.bytes_in for c in self.classes.values()), sum(c.bytes_out for c in self.classes.values()))

    @property
    def bytes_in(self) -> int:
        return self.totals()[0]

    @property
    def bytes_out(self) -> int:
        return self.totals()[1]

    def summary(self) -> str:
        bi, bo = self.totals()
        q = [f"{name} {c.quantized}/{c.tensors}" for name, c in self.classes.items() if c.quantized]
        kept = [name for name, c in self.classes.items() if not c.quantized]
        out = (f"{self.fmt} (weight-only): quantized {', '.join(q) or 'nothing'}; kept in stored precision: "
               f"{', '.join(kept) or 'nothing'}; {bi / 2**20:.1f} MiB -> {bo / 2**20:.1f} MiB")
        if self.quantized_on:
            out += f"; quantized on {self.quantized_on}"
        t = self.timing
        if t.get("seconds"):
            out += (f"; read + quantized {t['source_bytes'] / 1e9:.2f} GB in {t['seconds']:.1f} s "
                    f"({t['source_bytes'] / t['seconds'] / 1e6:.0f} MB/s)")
        c = self.cache
        if c:
            out += f"; cache {c['state']}: {os.path.basename(c['file'])}"
            if c.get("verified"):
                out += (" (verified: every byte hashed)" if c["verified"] == "digest" else
                        " (verified: unchanged since its full verification, stamp)")
            if c.get("why"):
                out += f" ({c['why']})"
            if c.get("stale"):
                out += f"; stale caches of this source left in place: {', '.join(c['stale'])}"
        b = self.block_scales
        if b:
            out += (f"; block scales not copied by the host: {b['layers_kept']}/{b['layers']} layers "
                    f"({b['bytes_not_copied'] / 2**20:.1f} MiB)")
        return out


def _check_finite(key: str, t: torch.Tensor, where: str) -> None:
    if not t.is_floating_point() or t.numel() == 0:
        return
    if bool(torch.isfinite(Q._amax_abs(t))):     # one aminmax pass, no copy; NaN / Inf propagate into it
        return
    _refuse_non_finite(key, t, where)


def _refuse_non_finite(key: str, t: torch.Tensor, where: str) -> None:
    flat = t.reshape(-1)
    step = Q.CHUNK_ELEMS
    n_nan = sum(int(torch.isnan(flat[i:i + step]).sum()) for i in range(0, flat.numel(), step))
    n_inf = sum(int(torch.isinf(flat[i:i + step]).sum()) for i in range(0, flat.numel(), step))
    raise CheckpointError(f"'{where}': tensor {key!r} holds {n_nan} NaN and {n_inf} Inf values; it cannot be "
                          "quantized (nor used); re-download or re-export the checkpoint")


class _Staging:
    """One page-locked host buffer, grown to the largest tensor, through which weights go to a CUDA device
    (``non_blocking`` copies need page-locked memory to overlap; one buffer, not one per tensor: pinning is slow)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self.buf is None or self.buf.numel() < n:
            self.buf = None
            self.buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        stage = self.buf[:n].view(t.dtype).view(t.shape)
        stage.copy_(t)
        out = stage.to(device, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()   # the staging buffer is reused by the next tensor
        return out


def _to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x
    out = host_memory.empty(x.shape, x.dtype)
    out.copy_(x)
    return out


def quantize_stream(items: Iterator[tuple[str, torch.Tensor]], plan: QuantPlan, report: QuantReport,
                    where: str, measure_error="sampled",
                    progress: Callable[[int, int, int], None] | None = None,
                    device: "torch.device | str | None" = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` in source order -> ``(key, tensor)`` in :meth:`QuantPlan.output_inventory` order.

    Each quantized weight (and its block scales) is made by :func:`host_memory.empty`, so the outputs a loader
    keeps do not fragment the heap the per-tensor working copies come from (docs/quantize.md, "Peak RSS"); the
    heap is trimmed once per tensor (not per slice: the slices' working copies are reused from one slice to the
    next). ``measure_error``: one of :data:`ERROR_MODES` (the error is measured while quantizing, no second
    pass). ``progress(done, total, bytes_in)`` after each source tensor (``bytes_in``: source bytes so far).
    ``device`` (a CUDA device): each weight to quantize goes there through one page-locked staging buffer, is
    quantized there by the Triton kernels of its format (``kernels/quant.py`` per-tensor, ``kernels/quant_triton.py``
    mxfp8 / nvfp4; the reference's torch operations where Triton is missing) and its results come back into host
    memory; the kept tensors stay on the host either way.
    ``benchmarks/gpu_check.py`` section ``quant_load`` checks it bit for bit against the CPU path (not yet run on a
    GPU)."""
    every = _error_every(measure_error)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        raise ValueError(f"device {device!r}: the streaming quantizer runs on the CPU (device=None) or a CUDA device")
    staging = _Staging() if dev is not None else None
    backend = "triton" if Q.HAS_TRITON else "reference"     # on a device: every format has its kernel
    report.quantized_on = "cpu" if dev is None else (
        f"{dev} ({'Triton kernels' if backend == 'triton' else 'torch operations, no Triton'})")
    total = len(plan.source_inventory)
    done = bytes_done = 0
    for key, t in items:
        cls, q, why = plan.decisions[key]
        st = report.classes.setdefault(cls, ClassStats())
        nbytes = t.numel() * t.element_size()
        st.tensors += 1
        st.params += t.numel()
        st.bytes_in += nbytes
        done += 1
        bytes_done += nbytes
        if not q:
            _check_finite(key, t, where)
            if why.startswith("small layer"):
                st.kept_small += 1
            st.bytes_out += nbytes
            if progress:
                progress(done, total, bytes_done)
            yield key, t
            continue
        err = Q.ErrorSample(every) if every else None
        try:
            if staging is not None:
                td = staging.to_device(t, dev)
                data, scales = Q.quantize(td, plan.fmt, backend=backend, error=err, finite=True)
                del td
                data, scales = _to_host(data), {k: _to_host(v) for k, v in scales.items()}
            else:
                data, scales = Q.quantize(t, plan.fmt, empty=host_memory.empty, error=err, finite=True)
        except Q.NonFiniteWeight:
            _refuse_non_finite(key, t, where)
            raise
        st.quantized += 1
        st.rows += t.shape[0]
        if err is not None:
            st.err_sq += err.e2
            st.ref_sq += err.r2
            st.err_rows += err.rows
            if err.r2 > 0:
                st.max_rel_err = max(st.max_rel_err, math.sqrt(err.e2 / err.r2))
        layer = key[: -len(".weight")]
        marker = marker_tensor(plan.fmt)
        st.bytes_out += sum(x.numel() * x.element_size() for x in (data, *scales.values(), marker))
        del t
        host_memory.release_free_heap()    # the working copies of this tensor are gone: return their pages
        if progress:
            progress(done, total, bytes_done)
        yield f"{layer}.weight", data
        for suffix in ("weight_scale", "weight_scale_2"):
            if suffix in scales:
                yield f"{layer}.{suffix}", scales[suffix]
        yield f"{layer}.comfy_quant", marker


# ------------------------------------------------------------------------------------------- sources

@dataclass
class Source:
    """A checkpoint to quantize: family, inventory (after layout conversion) and a one-at-a-time reader."""

    path: str
    family: str
    files: list[str]
    inventory: "OrderedDict[str, tuple[tuple[int, ...], str]]"
    metadata: dict[str, str]
    reader: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    h3_plan: h3core.H3Plan | None = None
    prefix: str = ""


def open_source(path: str) -> Source:
    """Headers only: detect the family and layout, refuse quantized sources, build the streaming reader."""
    p = os.fspath(path)
    if os.path.isdir(p) or _looks_h3(p):
        plan = h3core.plan_h3(p)
        src = plan.src
        refuse_quantized_source(src.path, {k: ti.dtype for k, (_, ti) in src.locations.items()}, src.metadata)
        inv = OrderedDict((k, v) for k, v in plan.inventory.items())

        def reader(progress=None, on_file=None, scratch_keys=()):
            return h3core.iter_h3_tensors(plan, progress, on_file, scratch_keys=scratch_keys)

        return Source(src.path, "h3", list(src.files), inv, dict(src.metadata or {}), reader, h3_plan=plan)
    hdr = read_header(p)
    family = detect_family(hdr.tensors)
    if family is None:
        sample = ", ".join(repr(k) for k in sorted(hdr.tensors)[:3])
        raise CheckpointError(f"'{p}': not a MiniMax H3, LTX-2, Z-Image or FLUX.2 diffusion model (first tensors: "
                              f"{sample})")
    refuse_quantized_source(p, {k: ti.dtype for k, ti in hdr.tensors.items()}, hdr.metadata)
    prefix = model_prefix(hdr.tensors)
    inv = OrderedDict((k, (tuple(ti.shape), ti.dtype)) for k, ti in sorted(hdr.tensors.items(),
                                                                           key=lambda kv: kv[1].begin))

    def reader(progress=None, on_file=None, scratch_keys=()):
        scratch = host_memory.Scratch() if scratch_keys else None
        with SafeFile(p) as f:
            if on_file:
                on_file(p, 1, 1)
            n = len(inv)
            keys = list(inv)
            for i, k in enumerate(keys, start=1):
                t = f.get(k, alloc=scratch.take if scratch is not None and k in scratch_keys else host_memory.empty)
                if i < n:                   # the disk reads the next tensor while this one is used (page cache)
                    f.prefetch(keys[i])
                yield k, t
                t = None
                if progress:
                    progress(i, n)

    return Source(p, family, [p], inv, dict(hdr.metadata), reader, prefix=prefix)


def _looks_h3(p: str) -> bool:
    try:
        hdr = read_header(p)
    except CheckpointError:
        return False
    return detect_family(hdr.tensors) == "h3"


def file_sha256(path: str, chunk: int = 8 << 20) -> str:
    from .safe_fs import open_model_file

    h = hashlib.sha256()
    fd = open_model_file(path)
    try:
        while True:
            b = os.read(fd, chunk)
            if not b:
                break
            h.update(b)
    finally:
        os.close(fd)
    return h.hexdigest()
