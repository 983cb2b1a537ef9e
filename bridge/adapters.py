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
from .loaders import GATE_ATTACHMENT
from .lokr import check_weight_keys, fuse_quantized, quantized_note

NODE_ID = "DitKitAdapterLoader"


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
                     scale: float | None = None):
    """-> (patched clone, plan). Raises a DitKitError before touching anything on bad input."""
    source = source or os.path.basename(path)
    sd = model.model_state_dict(filter_prefix="diffusion_model.")
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
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
            return w.dequantize()
        return sd[k]

    af = core.read_adapter_file(path, g, input_name="adapter_name")
    plan = core.plan(af, g, base_weight, source=source, qkv_layout=qkv_layout, scale_override=scale)
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
