"""DitKitLoKrLoader: exact LoKr adapters on ComfyUI's fused Z-Image / FLUX.2 weights.

The core (``loaders/lokr_apply.py``) parses, maps and validates; this node clones the model and registers one
lazy patch per adapter module with ``ModelPatcher.add_patches`` (row offsets for slices of fused weights).
The patch is a ``WeightAdapterBase`` that ComfyUI's ``lora.calculate_weight`` calls when it patches the
weight: ΔW is materialised one layer at a time (fp32), so unloading, strength changes and dynamic VRAM
work as for ComfyUI's own adapters, and nothing the size of the model is held in memory.
"""
from __future__ import annotations

import os

import torch
from comfy.weight_adapter.base import WeightAdapterBase
from comfy_api.latest import io

from ..errors import AdapterError
from ..loaders import lokr_apply as core
from . import _families, _files
from ._common import adapter_report_lines, send_report, ui_report

NODE_ID = "DitKitLoKrLoader"
_SUPPORTED_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DitKitLoKrPatch(WeightAdapterBase):
    """Lazy LoKr patch: ``weights`` = :func:`core.patch_payload` (factors in FACTOR_KEYS order (None where
    absent), scale, shape, swap_halves). Constructor signature ``(loaded_keys, weights)`` as ComfyUI's prefetch
    path expects."""

    name = "ditkit_lokr"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys = loaded_keys
        self.weights = weights

    @classmethod
    def from_item(cls, item: core.PlanItem) -> "DitKitLoKrPatch":
        return cls(set(item.module.keys), core.patch_payload(item))

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32, original_weights=None):
        # fp32 products, added one Kronecker row block at a time (the full ΔW is never held)
        return core.apply_patch_(weight, self.weights, strength, function, key=key)


def model_shapes(model) -> dict[str, tuple[int, ...]]:
    sd = model.model_state_dict(filter_prefix="diffusion_model.")
    return {k: tuple(v.shape) for k, v in sd.items()}


# comfy_quant per-tensor schemes whose ComfyUI re-quantization is verified (tests/integration/test_lokr_host.py):
# dequantize -> fp32 add -> requantize_from_float(scale="recalculate") into the same layout
REQUANT_OK = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise")


def check_weight_formats(model, plan: core.LoKrPlan) -> dict[str, str]:
    """Quantized target layers -> format, for the per-tensor schemes ComfyUI re-quantizes with the same layout
    and a recomputed scale; any other quantized / packed layer is refused (layer + format) before anything
    is patched."""
    return check_weight_keys(model, [it.target.weight_key for it in plan.items], "LoKr")


def check_weight_keys(model, keys, what: str = "LoKr", node_id: str = NODE_ID) -> dict[str, str]:
    """:func:`check_weight_formats` on a list of weight keys (shared with DitKitAdapterLoader)."""
    import comfy.utils

    handled: dict[str, str] = {}
    for wk in keys:
        w = comfy.utils.get_attr(model.model, wk)
        mod = comfy.utils.get_attr(model.model, wk.rsplit(".", 1)[0])
        qfmt = getattr(mod, "quant_format", None)
        cls = type(w).__name__
        if qfmt is None and cls in ("Parameter", "Tensor") and w.dtype in _SUPPORTED_WEIGHT_DTYPES:
            continue
        convrot = bool(getattr(getattr(w, "_params", None), "convrot", False))
        if qfmt in REQUANT_OK and not convrot and cls == "QuantizedTensor":
            handled[wk] = qfmt
            continue
        fmt = (f"comfy_quant format {qfmt}{' (ConvRot)' if convrot else ''}, layout {getattr(mod, 'layout_type', None)}"
               if qfmt is not None else f"{cls}, dtype {w.dtype}")
        raise AdapterError(
            f"{node_id}: layer '{wk}' is stored quantized/packed ({fmt}); ditkit merges {what} only into "
            f"unquantized weights or the per-tensor comfy_quant schemes {', '.join(REQUANT_OK)} (dequantize -> "
            "fp32 add -> requantize, same layout, scale recomputed). Load the model unquantized, or quantize after "
            "merging.")
    return handled


def apply_lokr(model, path: str, strength: float, source: str | None = None, scale: float | None = None):
    """Returns (patched clone, plan). ``scale``: explicit alpha/rank scale for every module (None: from the
    file). Raises a DitKitError before touching anything on bad input."""
    source = source or os.path.basename(path)
    strength = core.check_scale_input(strength, "strength")
    if scale is not None:
        scale = core.check_scale_input(scale, "scale")
    f = core.read_adapter_file(path)
    parsed = core.parse_lokr(f.tensors, peft_config=f.peft_config, source=source, config_source=f.config_source,
                             scale_override=scale, metadata=f.metadata)
    parsed.notes[:0] = f.notes
    plan = core.plan(parsed, model_shapes(model), source=source)
    quant = check_weight_formats(model, plan)
    if quant:
        counts: dict[str, int] = {}
        for f in quant.values():
            counts[f] = counts.get(f, 0) + 1
        plan.notes.append(f"{len(quant)} quantized layers ({', '.join(f'{n} {f}' for f, n in sorted(counts.items()))}) "
                          "patched by ComfyUI as dequantize -> fp32 add -> requantize into the same layout with the "
                          "scale recomputed (amax / qmax) and stochastic rounding seeded per key")
    patches = {}
    for it in plan.items:
        t = it.target
        key = t.weight_key if t.rows is None else (t.weight_key, (0, t.rows[0], t.rows[1] - t.rows[0]))
        if key in patches:  # two modules onto the same slice (e.g. duplicated names): chain them
            patches[key] = _Chain.of(patches[key], DitKitLoKrPatch.from_item(it))
        else:
            patches[key] = DitKitLoKrPatch.from_item(it)
    m = model.clone()
    added = set(m.add_patches(patches, strength_patch=float(strength)))
    missing = [k for k in patches if k not in added]
    if missing:
        raise AdapterError(f"{NODE_ID}: ComfyUI did not accept patches for {missing[:3]} (model keys changed?)")
    return m, plan


class _Chain(WeightAdapterBase):
    name = "ditkit_lokr_chain"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys = loaded_keys
        self.weights = weights

    @classmethod
    def of(cls, a, b):
        parts = (a.weights if isinstance(a, _Chain) else (a,)) + (b,)
        return cls(set().union(*(p.loaded_keys for p in parts)), parts)

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32, original_weights=None):
        for p in self.weights:
            weight = p.calculate_weight(weight, key, strength, strength_model, offset, function, intermediate_dtype)
        return weight


def report_text(plan: core.LoKrPlan, file: str, strength: float, scale: float | None = None) -> str:
    lines = [f"{plan.summary()} | file {file}, strength {strength:g}"
             + (f", scale {scale:g} (node input)" if scale is not None else ", scale from the file")]
    for it in plan.items:
        lines.append(f"applied {it.module.prefix} -> {it.target.describe()} ({it.target.via}; scale "
                     f"{it.module.scale:g}: {it.module.scale_rule})")
    return "\n".join(lines + adapter_report_lines(plan))


class DitKitLoKrLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="LoKr Loader (ditkit)",
            category="ditkit/loaders",
            description="Applies a LoKr adapter (LyCORIS, PEFT, ai-toolkit, musubi-tuner, OneTrainer, SimpleTuner) "
                        "exactly onto ComfyUI's fused Z-Image / FLUX.2 weights and reports every key.",
            search_aliases=["lokr", "lycoris", "kronecker lora", "lokr loader", "flux2 lokr", "z-image lokr"],
            inputs=[
                io.Model.Input("model", tooltip="A ComfyUI Z-Image or FLUX.2 model: bf16/fp16/fp32 weights, or comfy_quant "
                                               "per-tensor fp8 / int8 layers (re-quantized in the same layout)."),
                io.Combo.Input("lokr_name", options=_families.family_files("loras", "lokr"),
                               tooltip="LoKr adapter file (.safetensors) in models/loras."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="Multiplier on ΔW (after the adapter's own alpha/rank scale)."),
                io.Float.Input("scale", default=0.0, min=-1000.0, max=1000.0, step=0.001, round=0.000001,
                               optional=True,
                               tooltip="0 = from the file (alpha/rank, PEFT alpha/r from its config or metadata, "
                                       "or the writer's documented convention; the report names which). Any other "
                                       "value replaces every module's alpha/rank scale: set it when the loader "
                                       "says the file does not determine the scale."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with the LoKr patches registered."),
                     io.String.Output(display_name="report",
                                      tooltip="Modules applied (target, scale), keys unused and layers refused, with why.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, lokr_name: str, strength: float, scale: float = 0.0) -> io.NodeOutput:
        override = None if core.check_scale_input(scale, "scale") == 0.0 else float(scale)
        path = _files.safetensors_path("loras", lokr_name, NODE_ID)
        patched, plan = apply_lokr(model, path, strength, source=lokr_name, scale=override)
        text = report_text(plan, lokr_name, strength, override)
        payload = send_report(cls.hidden.unique_id if cls.hidden is not None else None, NODE_ID, "lokr", plan,
                              {"file": lokr_name, "strength": strength, "scale_input": override})
        return io.NodeOutput(patched, text, ui=ui_report(payload))


NODES = [DitKitLoKrLoader]
