"""DitKitAdapterLoader: any MiniMax H3 adapter (LoRA / LoKr / LoHa in every trainer's naming, FastVideo
``fastvideo-lora-v2`` FastH3 adapters, curve-form AdaLN sets) exactly onto ComfyUI's H3 weights; Z-Image / FLUX.2
LoKr through the shared LoKr core (the same path as DitKitLoKrLoader).

The core (``loaders/h3_adapters.py``) parses, maps, decides the qkv layout and the scales and validates; this node
clones the model and registers one lazy patch per module with ``ModelPatcher.add_patches`` (row offsets for
``to_q/to_k/to_v`` thirds of the fused qkv). The patch is a ``WeightAdapterBase`` that ComfyUI's
``lora.calculate_weight`` calls when it patches a weight: ΔW is added chunk by chunk by ``kernels/delta_fuse.py``,
so strength changes, unpatching and dynamic VRAM work as for ComfyUI's own LoRAs. Assigned FastH3 gates
(``to_gate_compress.set_weight``) replace the clone's gate attachment, which DitKitSparseAttention reads.
"""
from __future__ import annotations

import os

import torch
from comfy.weight_adapter.base import WeightAdapterBase
from comfy_api.latest import io

from ..bridge import adapter_bypass, quant_requant
from ..bridge.models import is_h3
from ..errors import AdapterError
from ..kernels import delta_fuse
from ..loaders import h3_adapters as core
from . import _files
from ._common import adapter_report_lines, send_report, ui_report
from .h3_loaders import GATE_ATTACHMENT
from .lokr import apply_lokr, check_weight_keys, fuse_quantized, quantized_note
from .lokr import report_text as lokr_report_text

NODE_ID = "DitKitAdapterLoader"
MODES = ("fuse", "bypass")


class DitKitAdapterPatch(WeightAdapterBase):
    """Lazy patch of one plan item (``weights`` = the :class:`core.Item`)."""

    name = "ditkit_h3_adapter"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys = loaded_keys
        self.weights = weights

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32, original_weights=None):
        items = self.weights if isinstance(self.weights, tuple) else (self.weights,)
        for it in items:
            core.apply_item_(weight, it, strength, function)
        return weight


def apply_h3_adapter(model, path: str, strength: float, source: str | None = None, qkv_layout: str = "auto",
                     scale: float | None = None, mode: str = "fuse"):
    """-> (patched clone, plan). Raises a DitKitError before touching anything on bad input. ``mode`` "fuse"
    patches the weights; "bypass" runs the adapter beside the untouched weights (``bridge/adapter_bypass``)."""
    if mode not in MODES:
        raise AdapterError(f"{NODE_ID}: mode {mode!r} is not one of {list(MODES)}")
    source = source or os.path.basename(path)
    sd = model.model_state_dict(filter_prefix="diffusion_model.")
    shapes = quant_requant.logical_shapes(model, sd)
    base_gates = model.get_attachment(GATE_ATTACHMENT) or {}
    g = core.geometry(shapes, {int(i): tuple(w.shape) for i, w in dict(base_gates).items()})

    def base_weight(k: str):
        if k.startswith("gate:"):
            return dict(base_gates).get(int(k[5:]))
        if k not in sd:
            return None
        w = model.get_model_object(k)
        w = getattr(w, "data", w)
        if type(w).__name__ == "QuantizedTensor":   # the state dict holds its raw codes: use the values
            p = w._params
            if getattr(p, "scale", None) is not None and p.scale.numel() == 1:
                return w._qdata.double() * p.scale.double()   # per-tensor: exact
            exact = quant_requant.dequantize64(w, k)       # int8 ConvRot / per-channel, mxfp8, nvfp4: exact
            return exact if exact is not None else w.dequantize()
        return sd[k]

    af = core.read_adapter_file(path)
    plan = core.plan(af, g, base_weight, source=source, qkv_layout=qkv_layout, scale_override=scale)
    if mode == "bypass":
        return _apply_bypass(model, plan, strength, source), plan
    bypassed = set(adapter_bypass.current(model))
    for it in plan.items:
        if it.target.key.rsplit(".", 1)[0] in bypassed:
            raise AdapterError(f"{NODE_ID}: layer '{it.target.key}' already carries an adapter in bypass mode (an "
                               f"earlier loader); fusing '{source}' onto it as well mixes the two modes on one layer. "
                               "Set 'mode' to bypass on this loader too (or fuse on both)")
    quant = check_weight_keys(model, sorted({it.target.key for it in plan.items}), "H3 adapters", NODE_ID)
    qdeltas: dict[str, list] = {}
    for it in plan.items:
        if it.target.key in quant:
            qdeltas.setdefault(it.target.key, []).append(
                delta_fuse.Delta(it.kind, it.parts, float(it.scale) * float(strength), it.row_map, it.target.rows))
    qweights, qlines = fuse_quantized(model, qdeltas, quant, NODE_ID, "H3 adapter")
    plan.notes.extend(quantized_note(qlines, strength))
    gates = core.assigned_gates(plan, base_gates, float(strength), source) if plan.gates else None
    patches: dict = {}
    for it in plan.items:
        t = it.target
        if t.key in quant:
            continue
        key = t.key if t.rows is None else (t.key, (0, t.rows[0], t.rows[1] - t.rows[0]))
        prev = patches.get(key)
        items = (prev.weights if isinstance(prev.weights, tuple) else (prev.weights,)) + (it,) if prev else it
        patches[key] = DitKitAdapterPatch(set(it.module.keys) | (prev.loaded_keys if prev else set()), items)
    m = model.clone()
    added = set(m.add_patches(patches, strength_patch=float(strength)))
    missing = [k for k in patches if k not in added]
    if missing:
        raise AdapterError(f"{NODE_ID}: ComfyUI did not accept patches for {missing[:3]} (model keys changed?)")
    for k, w in qweights.items():
        m.add_object_patch(k, w)
    if gates is not None:
        m.set_attachments(GATE_ATTACHMENT, gates)
    return m, plan


def _apply_bypass(model, plan: core.Plan, strength: float, source: str):
    """The plan's items as bypass entries on a clone; fused / bypassed on one layer and the host's own bypass
    injection are refused before anything is registered."""
    if model.get_injections("bypass_lora"):
        raise AdapterError(f"{NODE_ID}: the model carries ComfyUI's own bypass LoRA (LoraLoaderBypass); its hooks and "
                           "ditkit's would eject in the wrong order. Put this loader before LoraLoaderBypass, or use "
                           "mode fuse")
    new: dict[str, list] = {}
    regular: dict = {}
    for it in plan.items:
        k = it.target.key
        if k.startswith("gate:"):
            continue
        if not k.endswith(".bias") and len(it.target.shape) != 2:   # norms' .diff: not a Linear; patched as the
            regular[k] = DitKitAdapterPatch(set(it.module.keys), it)  # host's own bypass loader does
            continue
        if k in model.patches or k in model.object_patches:
            raise AdapterError(f"{NODE_ID}: layer '{k}' already carries a fused adapter (an earlier loader in mode "
                               f"fuse or ComfyUI's LoraLoader); bypassing '{source}' on it as well mixes the two "
                               "modes on one layer. Set 'mode' to fuse on this loader too (or bypass on both)")
        param = "bias" if k.endswith(".bias") else "weight"
        new.setdefault(k, []).append(adapter_bypass.Entry(
            param, it.kind, it.parts, float(it.scale) * float(strength), it.row_map, it.target.rows,
            f"{source}: {it.module.prefix}"))
    gates = core.assigned_gates(plan, model.get_attachment(GATE_ATTACHMENT) or {}, float(strength), source) \
        if plan.gates else None
    m = model.clone()
    if regular:
        m.add_patches(regular, strength_patch=float(strength))
        plan.notes.append(f"mode bypass: {len(regular)} non-Linear weights (norm .diff) patched as regular weight "
                          "patches, as ComfyUI's own bypass loader does: " + ", ".join(sorted(regular)))
    lines = adapter_bypass.install(m, new)
    if gates is not None:
        m.set_attachments(GATE_ATTACHMENT, gates)
    plan.notes.append(f"mode bypass: {len(lines)} layers run the adapter beside their untouched weights "
                      "(y = base(x) + s·ΔW x each call; no requantization, no weight copy)")
    plan.notes.extend(lines)
    return m


def report_text(plan: core.Plan, file: str, strength: float, scale: float | None, qkv_layout: str) -> str:
    lines = [f"{plan.summary()} | file {file}, strength {strength:g}, qkv_layout input {qkv_layout}"
             + (f", scale {scale:g} (node input)" if scale is not None else ", scale from the file"),
             f"qkv layout: {plan.layout} ({plan.layout_reason})"]
    for it in plan.items:
        lines.append("applied " + it.describe())
    for i in sorted(plan.gates):
        lines.append(f"assigned sparse-attention gate of block {i} (to_gate_compress.set_weight)")
    return "\n".join(lines + adapter_report_lines(plan))


class DitKitAdapterLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="Adapter Loader (ditkit)",
            category="ditkit/loaders",
            description=("Applies a MiniMax H3 adapter exactly onto ComfyUI's H3 weights, whatever layout the base was "
                         "loaded from: ComfyUI, PEFT / DiffSynth-Studio, diffusers, kohya / musubi-tuner, LyCORIS LoKr / "
                         "LoHa naming, FastVideo fastvideo-lora-v2 (FastH3: .diff, .set_weight, VSA gates) and "
                         "curve-form AdaLN adapters. Decides the qkv row layout the adapter was trained on, reports "
                         "every key. On Z-Image / FLUX.2 it applies LoKr files like DitKitLoKrLoader."),
            search_aliases=["h3 lora", "minimax h3 lora", "fasth3 adapter", "diffsynth lora", "lora loader h3",
                            "h3 lokr", "adapter loader"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 model (any layout DitKitH3ModelLoader or UNETLoader "
                                                "loads), or a Z-Image / FLUX.2 model for LoKr files."),
                io.Combo.Input("adapter_name", options=_files.safetensors_files("loras"),
                               tooltip="Adapter file (.safetensors) in models/loras. A PEFT adapter_model.safetensors "
                                       "takes its adapter_config.json from the same folder."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="Multiplier on ΔW (after the adapter's own alpha/rank scale). Assigned weights "
                                       "(.set_weight) become W_base + strength * (W_new - W_base)."),
                io.Combo.Input("qkv_layout", options=list(core.QKV_LAYOUTS), default="auto", optional=True,
                               tooltip="Row layout of the fused qkv_proj the adapter was trained on. auto: decided from "
                                       "the file as diffusers' H3 converter does (to_q/to_k/to_v: no question; "
                                       "DiffSynth '.default.' naming: interleaved; diffusion_model.* / no prefix / "
                                       "lora_unet_*: contiguous); PEFT base_model.model.* and lycoris_* files are "
                                       "refused until you choose. interleaved = official per-head [h0: q,k,v; ...], "
                                       "contiguous = ComfyUI [q_all; k_all; v_all]."),
                io.Float.Input("scale", default=0.0, min=-1000.0, max=1000.0, step=0.001, round=0.000001,
                               optional=True,
                               tooltip="0 = from the file (alpha/rank, PEFT lora_alpha/r, or the trainer's documented "
                                       "convention; the report names which). Any other value replaces the alpha/rank "
                                       "scale of every low-rank module: set it when the loader says the file does "
                                       "not determine the scale."),
                io.Combo.Input("mode", options=list(MODES), default="fuse", optional=True,
                               tooltip="fuse: the adapter is added into the weights (quantized layers requantized "
                                       "exactly in their own format). bypass: the weights stay untouched and the "
                                       "adapter runs beside each layer at run time, y = base(x) + s·ΔW x (no "
                                       "requantization error, no weight copy: for nvfp4 and stacks of LoRAs). H3 only."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with the adapter patches registered."),
                     io.String.Output(display_name="report",
                                      tooltip="Modules applied (target, scale, layout), keys unused, with why.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, adapter_name: str, strength: float, qkv_layout: str = "auto",
                scale: float = 0.0, mode: str = "fuse") -> io.NodeOutput:
        from ..loaders import lokr_apply as lokr_core

        override = None if lokr_core.check_scale_input(scale, "scale") == 0.0 else float(scale)
        lokr_core.check_scale_input(strength, "strength")
        if qkv_layout not in core.QKV_LAYOUTS:
            raise AdapterError(f"{NODE_ID}: qkv_layout {qkv_layout!r} is not one of {list(core.QKV_LAYOUTS)}")
        path = _files.safetensors_path("loras", adapter_name, NODE_ID)
        uid = cls.hidden.unique_id if cls.hidden is not None else None
        if mode not in MODES:
            raise AdapterError(f"{NODE_ID}: mode {mode!r} is not one of {list(MODES)}")
        if not is_h3(model):
            if mode != "fuse":
                raise AdapterError(f"{NODE_ID}: mode {mode!r} applies to MiniMax H3 models only; this model is not H3 "
                                   "(use mode fuse for Z-Image / FLUX.2 LoKr)")
            if qkv_layout != "auto":
                raise AdapterError(f"{NODE_ID}: qkv_layout {qkv_layout!r} applies to MiniMax H3 models only; this model "
                                   "is not H3 (leave it on auto for Z-Image / FLUX.2 LoKr)")
            patched, lplan = apply_lokr(model, path, strength, source=adapter_name, scale=override)
            text = lokr_report_text(lplan, adapter_name, strength, override)
            payload = send_report(uid, NODE_ID, "adapter", lplan.summary(),
                                  {**lplan.as_dict(), "file": adapter_name, "strength": strength, "scale_input": override})
            return io.NodeOutput(patched, text, ui=ui_report(payload))
        patched, plan = apply_h3_adapter(model, path, strength, adapter_name, qkv_layout, override, mode)
        text = report_text(plan, adapter_name, strength, override, qkv_layout)
        payload = send_report(uid, NODE_ID, "adapter", plan.summary(),
                              {**plan.as_dict(), "file": adapter_name, "strength": strength, "scale_input": override,
                               "qkv_layout_input": qkv_layout, "mode": mode})
        return io.NodeOutput(patched, text, ui=ui_report(payload))


NODES = [DitKitAdapterLoader]
