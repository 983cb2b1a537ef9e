"""Oracle helpers for comfy_quant (quantized) weights, shared by the host tests: what ModelSave writes, the host's
own layout quantize of a weight (the loader / converter tests) and of the float64 update (the LoKr and H3 adapter
tests), never ditkit's code."""
from __future__ import annotations

import json

import torch

from ditkit.loaders.safetensors_io import load_file


def saved_weights(m, tmp_path, names) -> dict[str, dict[str, torch.Tensor]]:
    """What ModelSave writes for ``names`` (``comfy.sd.save_checkpoint``, the function behind ModelSave):
    {name: {"weight", "weight_scale", "comfy_quant"}} read back from the file."""
    import comfy.sd

    out = tmp_path / f"saved_{len(list(tmp_path.iterdir()))}.safetensors"
    comfy.sd.save_checkpoint(str(out), m)
    sd = load_file(out)
    got = {}
    for n in names:
        pre = next(p for p in ("model.diffusion_model.", "diffusion_model.", "") if f"{p}{n}.weight" in sd)
        got[n] = {s: sd[f"{pre}{n}.{s}"] for s in ("weight", "weight_scale", "comfy_quant") if f"{pre}{n}.{s}" in sd}
    return got


def host_requant_oracle(qt, delta64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The host's own layout quantize (``QuantizedLayout.quantize`` of the base's layout class, scale="recalculate",
    no stochastic rounding) of (float64 dequant(base) + float64 ΔW) rounded once to float32. The float64 dequant
    is the raw codes times the scale: exact."""
    import comfy.quant_ops as q

    w64 = qt._qdata.double() * qt._params.scale.double() + delta64
    data, params = q.get_layout_class(qt._layout_cls).quantize(w64.float(), scale="recalculate")
    return data, params.scale


def host_formats() -> list[str]:
    """ditkit's formats that this ComfyUI's ``QUANT_ALGOS`` supports."""
    import comfy.quant_ops as q

    from ditkit.kernels.quant import FORMATS

    return [f for f in FORMATS if f in q.QUANT_ALGOS]


def host_quantize(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The host's own layout quantize of ``w`` (``QuantizedLayout.quantize(..., scale="recalculate")`` of the
    format's layout class) -> its state dict entries by suffix (``""``, ``"_scale"``, ...)."""
    import comfy.quant_ops as q

    conf = q.QUANT_ALGOS[fmt]
    cls = q.get_layout_class(conf["comfy_tensor_layout"])
    qd, params = cls.quantize(w.clone(), scale="recalculate")
    return q.QuantizedTensor(qd, conf["comfy_tensor_layout"], params).state_dict("")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def json_format(t: torch.Tensor) -> str:
    """The format name of a ``<layer>.comfy_quant`` tensor."""
    return json.loads(bytes(t.tolist()).decode())["format"]


LAYOUTS = {"int8_convrot": "TensorWiseINT8Layout", "mxfp8": "TensorCoreMXFP8Layout", "nvfp4": "TensorCoreNVFP4Layout"}


def host_quantize_layer(w: torch.Tensor, fmt: str, group: int = 0) -> dict[str, torch.Tensor]:
    """The host's own layout quantize of one layer for the tiny repacks (``tiny/ckpt_h3.comfy_quant_state_dict``):
    int8 ConvRot per-channel (``convrot_groupsize=group``), mxfp8, nvfp4 -> {suffix: tensor} as ComfyUI's state
    dict writes them (``""``, ``"_scale"``, ``"_scale_2"``)."""
    import comfy.quant_ops as q

    cls = q.get_layout_class(LAYOUTS[fmt])
    kw = dict(per_channel=True, convrot=True, convrot_groupsize=group) if fmt == "int8_convrot" else {}
    qd, params = cls.quantize(w.clone(), scale="recalculate", **kw)
    return q.QuantizedTensor(qd, LAYOUTS[fmt], params).state_dict("")


def host_requant_whole(qt, delta64: torch.Tensor) -> "object":
    """The host's layout quantize (its own ``requantize_kwargs``, no stochastic rounding) of the WHOLE updated
    weight: float64 dequant(base) (codes x scales, the ConvRot rotation undone in float64 with the host's Hadamard)
    + float64 ΔW, rounded once to float32 -> a QuantizedTensor."""
    import comfy.quant_ops as q
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    cls = q.get_layout_class(qt._layout_cls)
    p = qt._params
    rows, cols = qt.shape
    if qt._layout_cls == "TensorWiseINT8Layout":
        w = qt._qdata.double() * p.scale.double().reshape(-1, 1 if p.scale.numel() > 1 else 1)
        if p.convrot:
            h = _build_hadamard(p.convrot_groupsize, dtype=torch.float64)
            g = p.convrot_groupsize
            w = (w.reshape(rows, cols // g, g) @ h.T).reshape(rows, cols)
    elif qt._layout_cls == "TensorCoreNVFP4Layout":   # the host's eager decode, asked for float64: exact
        from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4
        w = dequantize_nvfp4(qt._qdata, p.scale, p.block_scale, torch.float64)[:rows, :cols]
    else:
        from comfy_kitchen.backends.eager.quantization import dequantize_mxfp8
        w = dequantize_mxfp8(qt._qdata, p.scale, torch.float64)[:rows, :cols]
    w = w + delta64
    kw = dict(cls.requantize_kwargs(qt))
    d, params = cls.quantize(w.float(), scale="recalculate", **kw)
    return q.QuantizedTensor(d, qt._layout_cls, params)
