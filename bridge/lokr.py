"""Exact LoKr adapters as ComfyUI weight patches (DitKitLoKrLoader, DitKitAdapterLoader).

The core (``loaders/lokr_apply.py``) parses, maps and validates; here the model is cloned and one lazy patch per
adapter module is registered with ``ModelPatcher.add_patches`` (row offsets for slices of fused weights). The patch
is a ``comfy.weight_adapter.base.WeightAdapterBase`` that ComfyUI's ``lora.calculate_weight`` calls when it patches
the weight: ΔW is materialised one layer at a time (fp32), so unloading, strength changes and dynamic VRAM work as
for ComfyUI's own adapters. Layers stored as a per-tensor comfy_quant ``QuantizedTensor`` (its private ``_qdata`` /
``_params`` / ``_layout_cls``, listed in ``comfy.quant_ops.QUANT_ALGOS``) are requantized by ditkit and held as
object patches.
"""
from __future__ import annotations

import os

import torch
from comfy.weight_adapter.base import WeightAdapterBase

from ..errors import AdapterError
from ..kernels import delta_fuse
from ..loaders import lokr_apply as core
from . import quant_requant
from .loaders import quant_algos

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
    return quant_requant.logical_shapes(model, model.model_state_dict(filter_prefix="diffusion_model."))


def requant_formats() -> tuple[str, ...]:
    """The comfy_quant per-tensor formats this host lists that ``kernels/delta_fuse.requantize_fuse`` requantizes
    bit-exactly (fp8 e4m3fn, fp8 e5m2, int8 tensorwise). Block formats (mxfp8, nvfp4) are refused by name."""
    return tuple(f for f in delta_fuse.PER_TENSOR_FORMATS if f in quant_algos())


def check_weight_formats(model, plan: core.LoKrPlan) -> dict[str, str]:
    """Quantized target layers -> format, for the per-tensor schemes ditkit requantizes itself (chunked, same
    layout); any other quantized / packed layer is refused (layer + format) before anything is patched."""
    return check_weight_keys(model, [it.target.weight_key for it in plan.items], "LoKr")


def check_weight_keys(model, keys, what: str = "LoKr", node_id: str = NODE_ID) -> dict[str, str]:
    """:func:`check_weight_formats` on a list of weight keys (shared with DitKitAdapterLoader). A plain float
    tensor (also the bias of a quantized layer) needs nothing; a comfy_quant QuantizedTensor of a per-tensor
    format in its own layout is returned with its format."""
    import comfy.utils

    QUANT_ALGOS = quant_algos()
    ok_formats = requant_formats()
    handled: dict[str, str] = {}
    for wk in keys:
        w = model.get_model_object(wk)
        mod = comfy.utils.get_attr(model.model, wk.rsplit(".", 1)[0])
        qfmt = getattr(mod, "quant_format", None)
        cls = type(w).__name__
        if cls in ("Parameter", "Tensor") and w.dtype in _SUPPORTED_WEIGHT_DTYPES:
            continue
        convrot = bool(getattr(getattr(w, "_params", None), "convrot", False))
        layout = getattr(w, "_layout_cls", None)
        qt = w.data if isinstance(w, torch.nn.Parameter) else w
        if (qfmt in ok_formats and not convrot and cls == "QuantizedTensor"
                and layout == QUANT_ALGOS[qfmt]["comfy_tensor_layout"]
                and getattr(qt._params, "scale", torch.ones(())).numel() == 1):
            handled[wk] = qfmt
            continue
        if cls == "QuantizedTensor" and layout == QUANT_ALGOS.get(qfmt, {}).get("comfy_tensor_layout"):
            # int8 ConvRot / per-channel, mxfp8, nvfp4: the host's own layout quantize
            try:
                lay = quant_requant.classify(qt, wk)
            except quant_requant.LayerRefused as e:
                raise AdapterError(f"{node_id}: {e}; nothing was applied") from None
            if lay is not None:
                handled[wk] = lay
                continue
        fmt = (f"comfy_quant format {qfmt}{' (ConvRot)' if convrot else ''}, layout {getattr(mod, 'layout_type', None)}"
               if qfmt is not None else f"{cls}, dtype {w.dtype}")
        raise AdapterError(
            f"{node_id}: layer '{wk}' is stored quantized/packed ({fmt}); ditkit merges {what} only into "
            f"unquantized weights, the per-tensor comfy_quant schemes {', '.join(ok_formats)} (chunked dequantize "
            "-> float64 add -> requantize, same layout, scale recomputed) and the host layouts int8 ConvRot / "
            "per-channel, mxfp8, nvfp4. Other packed layouts are refused, not approximated. Load the model "
            "unquantized, or quantize after merging.")
    return handled


def fuse_quantized(model, deltas: dict[str, list], handled: dict[str, str], node_id: str = NODE_ID,
                   what: str = "LoKr") -> tuple[dict, list[str]]:
    """For every quantized weight key in ``deltas`` (``handled``: key -> format, from :func:`check_weight_keys`):
    the base QuantizedTensor dequantized, its deltas (``kernels/delta_fuse.Delta``) added and requantized in the
    same format and layout, one row chunk at a time (``delta_fuse.requantize_fuse``). Returns ({key: new weight
    Parameter}, one report line per layer). Nothing is registered here: the caller adds the weights to its clone
    as object patches once every layer has succeeded, so a failure leaves no partial patch."""
    import dataclasses

    from comfy.quant_ops import QuantizedTensor

    out, lines = {}, []
    for wk, ds in deltas.items():
        fmt = handled[wk]
        w = model.get_model_object(wk)
        qt = w.data if isinstance(w, torch.nn.Parameter) else w
        if isinstance(fmt, quant_requant.Layout):
            try:
                new_qt, chunks = quant_requant.requantize_layer(qt, fmt, ds)
            except ValueError as e:
                raise AdapterError(f"{node_id}: {what} onto quantized layer '{wk}' ({fmt.describe()}): {e}") from None
            out[wk] = torch.nn.Parameter(new_qt, requires_grad=False)
            lines.append(f"{wk[len('diffusion_model.'):] if wk.startswith('diffusion_model.') else wk}: requantized "
                         f"{fmt.describe()} in {chunks} row chunks, host layout quantize ({len(ds)} "
                         f"delta{'s' if len(ds) != 1 else ''})")
            continue
        data, params = qt._qdata, qt._params
        shape = tuple(qt.shape)
        if len(shape) != 2:
            raise AdapterError(f"{node_id}: quantized layer '{wk}' has shape {list(shape)}; only 2-D weights are "
                               "requantized")
        try:
            new, scales, chunks, backend = delta_fuse.requantize_fuse(data, {"weight_scale": params.scale.float()},
                                                                      fmt, shape, ds)
        except ValueError as e:
            raise AdapterError(f"{node_id}: {what} onto quantized layer '{wk}' ({fmt}): {e}") from None
        scale = scales["weight_scale"].to(device=params.scale.device, dtype=params.scale.dtype)
        new_qt = QuantizedTensor(new.to(data.device), qt._layout_cls,
                                 dataclasses.replace(params, scale=scale.reshape(params.scale.shape)))
        out[wk] = torch.nn.Parameter(new_qt, requires_grad=False)
        lines.append(f"{wk[len('diffusion_model.'):] if wk.startswith('diffusion_model.') else wk}: requantized {fmt} "
                     f"in {chunks} row chunks, {backend} quantize ({len(ds)} delta{'s' if len(ds) != 1 else ''}; scale "
                     f"{float(params.scale):.6g} -> {float(scale):.6g})")
        earlier = len(model.patches.get(wk, ()))
        if earlier:
            lines.append(f"{wk}: {earlier} patch(es) of an earlier loader stay registered on this quantized layer; "
                         "ComfyUI applies them on top of this requantized weight when it loads the model")
    return out, lines


def quantized_note(lines: list[str], strength: float) -> list[str]:
    """The report notes for the quantized layers :func:`fuse_quantized` produced."""
    if not lines:
        return []
    return ([f"{sum(1 for ln in lines if ': requantized ' in ln)} quantized layers fused by ditkit at strength "
             f"{strength:g}: dequantize -> float64 add -> round to float32 -> requantize into the same comfy_quant "
             "layout (scale recomputed, deterministic round-to-nearest), in row chunks (no whole-layer float copy, "
             "no whole ΔW); held by this clone as object patches, so ModelSave writes the same scheme"]
            + [f"quantized layer {ln}" for ln in lines])


def apply_lokr(model, path: str, strength: float, source: str | None = None, scale: float | None = None):
    """Returns (patched clone, plan). ``scale``: explicit alpha/rank scale for every module (None: from the
    file). Raises a DitKitError before touching anything on bad input."""
    source = source or os.path.basename(path)
    strength = core.check_scale_input(strength, "strength")
    if scale is not None:
        scale = core.check_scale_input(scale, "scale")
    shapes = model_shapes(model)
    f = core.read_adapter_file(path, shapes=shapes, input_name="lokr_name")
    parsed = core.parse_lokr(f.tensors, peft_config=f.peft_config, source=source, config_source=f.config_source,
                             scale_override=scale, metadata=f.metadata)
    parsed.notes[:0] = f.notes
    plan = core.plan(parsed, shapes, source=source)
    quant = check_weight_formats(model, plan)
    qdeltas: dict[str, list] = {}
    for it in plan.items:
        if it.target.weight_key in quant:
            qdeltas.setdefault(it.target.weight_key, []).append(_kron_delta(it, strength))
    qweights, qlines = fuse_quantized(model, qdeltas, quant)
    plan.notes.extend(quantized_note(qlines, strength))
    patches = {}
    for it in plan.items:
        t = it.target
        if t.weight_key in quant:
            continue
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
    for k, w in qweights.items():
        m.add_object_patch(k, w)
    return m, plan


def _kron_delta(it: core.PlanItem, strength: float) -> delta_fuse.Delta:
    """One LoKr plan item as a row-chunkable Kronecker delta (``strength`` and the module scale applied)."""
    from ..loaders.h3_adapters import swap_map
    from ..loaders.lokr_math import rebuild_w1, rebuild_w2

    f = it.module.factors
    w1, w2 = rebuild_w1(f, torch.float64).contiguous(), rebuild_w2(f, torch.float64).contiguous()
    t = it.target
    if w2.dim() != 2 or (w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1]) != tuple(t.shape):
        raise AdapterError(f"{NODE_ID}: module '{it.module.prefix}' onto quantized layer '{t.weight_key}': its "
                           f"Kronecker shape does not equal the 2-D target {tuple(t.shape)}")
    rmap = swap_map(t.shape[0]) if t.swap_halves else None
    return delta_fuse.Delta("kron", (w1, w2), float(it.module.scale) * float(strength), rmap, t.rows)


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
