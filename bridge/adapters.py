"""Any MiniMax H3 adapter exactly onto ComfyUI's H3 weights, as ComfyUI weight patches (DitKitAdapterLoader).

The core (``loaders/h3_adapters.py``) parses, maps, decides the qkv layout and the scales and validates; here the
model is cloned and one lazy patch per module is registered with ``ModelPatcher.add_patches`` (row offsets for
``to_q/to_k/to_v`` thirds of the fused qkv). The patch is a ``WeightAdapterBase`` that ComfyUI's
``lora.calculate_weight`` calls when it patches a weight: ΔW is added chunk by chunk by ``kernels/delta_fuse.py``.
Base weights stored as a comfy_quant ``QuantizedTensor`` are read through its private ``_qdata`` / ``_params``.
Assigned FastH3 gates replace the clone's gate attachment (:data:`~ditkit.bridge.loaders.GATE_ATTACHMENT`).
"""
from __future__ import annotations

import os

import torch
from comfy.weight_adapter.base import WeightAdapterBase

from ..errors import AdapterError
from ..kernels import delta_fuse
from ..loaders import h3_adapters as core
from . import adapter_bypass, quant_requant, turbo_curve
from .loaders import GATE_ATTACHMENT
from .lokr import check_weight_keys, fuse_quantized, quantized_note

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
                     scale: float | None = None, mode: str = "fuse", silu_grid: str | None = None,
                     time_embedder: str | None = None, grid_name: str | None = None, ckpt_name: str | None = None):
    """-> (patched clone, plan). Raises a DitKitError before touching anything on bad input. ``mode`` "fuse"
    patches the weights; "bypass" runs the adapter beside the untouched weights (``bridge/adapter_bypass``).
    ``silu_grid`` (a grid file) or ``time_embedder`` (an unpruned checkpoint) gives silu(t_emb) on the grid of a
    curve-form base for a Turbo LoRA's AdaLN pairs (``bridge/turbo_curve``)."""
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

    af = core.read_adapter_file(path, g, input_name="adapter_name")
    plan = core.plan(af, g, base_weight, source=source, qkv_layout=qkv_layout, scale_override=scale)
    carry = widened = None
    if plan.curve:
        carry = turbo_curve.make_carry(model, plan, float(strength), source, silu_grid, time_embedder, grid_name,
                                       ckpt_name, mode)
        widened = turbo_curve.check_fuse(model, carry, source) if mode == "fuse" else None
    elif silu_grid or time_embedder:
        plan.notes.append(f"silu(t_emb) source {grid_name or ckpt_name or silu_grid or time_embedder} unused: the file "
                          "has no Turbo AdaLN pair on a curve-form base")
    carried = turbo_curve.carried_keys(model)
    for it in plan.items:
        if mode == "fuse" and it.target.key in carried:
            raise AdapterError(f"{NODE_ID}: '{it.target.key}' carries Turbo curve columns (an earlier loader); fusing "
                               f"'{source}' onto it is not supported. Put this loader first, or use mode bypass")
    plan.notes.append(core.partition_note(source, af.metadata)[1])
    if mode == "bypass":
        divert = {k[: -len(".weight")] for k in (carry.columns if carry is not None else ())}
        m, diverted = _apply_bypass(model, plan, strength, source, divert)
        if carry is not None:
            plan.notes.extend(turbo_curve.install(m, carry, mode, entries=diverted))
        return m, plan
    bypassed = set(adapter_bypass.current(model))
    host_bypassed = adapter_bypass.host_bypass_modules(model)
    if host_bypassed is None:
        raise AdapterError(f"{NODE_ID}: the model carries ComfyUI's own bypass LoRA (LoraLoaderBypass) and ditkit "
                           "cannot read which layers it hooks; fusing could mix fused and bypassed adapters on one "
                           "layer. Set 'mode' to bypass on this loader and put it before LoraLoaderBypass, or load "
                           "the other LoRA with LoraLoader")
    for it in plan.items:
        if it.target.key.rsplit(".", 1)[0] in bypassed:
            raise AdapterError(f"{NODE_ID}: layer '{it.target.key}' already carries an adapter in bypass mode (an "
                               f"earlier loader); fusing '{source}' onto it as well mixes the two modes on one layer. "
                               "Set 'mode' to bypass on this loader too (or fuse on both)")
        if it.target.key.rsplit(".", 1)[0] in host_bypassed:
            raise AdapterError(f"{NODE_ID}: layer '{it.target.key}' already carries an adapter of ComfyUI's "
                               f"LoraLoaderBypass (bypass mode); fusing '{source}' onto it as well mixes the two modes "
                               "on one layer. Set 'mode' to bypass on this loader and put it before "
                               "LoraLoaderBypass, or load the other LoRA with LoraLoader (fused)")
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
    if carry is not None:
        plan.notes.extend(turbo_curve.install(m, carry, mode, widened))
    return m, plan


def _apply_bypass(model, plan: core.Plan, strength: float, source: str, divert: set | None = None):
    """The plan's items as bypass entries on a clone; fused / bypassed on one layer and the host's own bypass
    injection are refused before anything is registered. Entries on a module in ``divert`` (AdaLN linears this
    loader carries Turbo curve columns on) are returned, not installed: they run in the curve hook.
    -> (clone, {module key: entries})."""
    if model.get_injections("bypass_lora"):
        raise AdapterError(f"{NODE_ID}: the model carries ComfyUI's own bypass LoRA (LoraLoaderBypass); its hooks and "
                           "ditkit's would eject in the wrong order. Put this loader before LoraLoaderBypass, or use "
                           "mode fuse")
    new: dict[str, list] = {}
    regular: dict = {}
    carried = {k[: -len(".weight")] for k in turbo_curve.carried_keys(model)}
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
        if k.rsplit(".", 1)[0] in carried and k.rsplit(".", 1)[0] not in (divert or ()):
            raise AdapterError(f"{NODE_ID}: layer '{k}' carries Turbo curve columns in bypass mode (an earlier "
                               f"loader); a second bypass adapter on it is not supported. Put '{source}' before "
                               "the Turbo LoRA's loader, or use mode fuse")
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
    diverted = {mod: [e for k, es in new.items() if k.rsplit(".", 1)[0] == mod for e in es] for mod in divert or ()}
    new = {k: es for k, es in new.items() if k.rsplit(".", 1)[0] not in (divert or ())}
    lines = adapter_bypass.install(m, new)
    if gates is not None:
        m.set_attachments(GATE_ATTACHMENT, gates)
    plan.notes.append(f"mode bypass: {len(lines)} layers run the adapter beside their untouched weights "
                      "(y = base(x) + s·ΔW x each call; no requantization, no weight copy)")
    plan.notes.extend(lines)
    return m, diverted
