"""Adapters fused onto the quantized layouts whose requantize ditkit does through the HOST's own layout quantize:
int8 per-channel with ConvRot (the Comfy-Org H3 repacks: ``{"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": g}``, one float32 scale per row, weights rotated by a group-wise regular Hadamard), int8
per-channel without rotation, ``mxfp8`` and ``nvfp4`` (block scales in cuBLAS' blocked layout).

For one layer and its deltas (``kernels/delta_fuse.Delta``), :func:`requantize_layer` walks the rows in chunks of
whole 128-row scale tiles (``kernels/quant.requantize_spans``):

1. ``base64(r0, r1)``: the exact float64 value of the stored rows (``kernels/quant.dequant_rows64``: codes x row
   scale, un-rotated with the Hadamard in float64 (its entries are ±2^-k, the sums exact); block codes x block
   scale x tensor scale),
2. plus the float64 ΔW rows (``delta_fuse.delta_sum_rows``), rounded once to float32 (the host's CPU compute
   dtype, the dtype the existing per-tensor path rounds to),
3. quantized by the host's ``QuantizedLayout.quantize`` of the layer's own layout class with the layer's own
   ``requantize_kwargs`` (``per_channel`` / ``convrot`` / group) and no stochastic rounding; nvfp4's per-tensor
   scale comes from a first pass over the updated chunks' amax, computed by the same host quantize on a 1x1
   tensor holding that amax, and is handed to every chunk.

The result equals the host's quantize of the whole updated float32 weight, code for code: every layout here is
row-independent (per-row scales, per-row blocks, 128-row scale tiles) once its one per-tensor scale is fixed;
``tests/integration/test_h3_adapters_host.py`` compares against the host's whole-tensor quantize. Refused by
layer name (never approximated): layouts the host cannot requantize (``convrot_w4a4``, ``asym_w4a8_int8``: their
``quantize`` takes calibration inputs ComfyUI does not store), a ConvRot group size that does not divide the
width or is not a power of 4, missing scale tensors, padded / transposed storage that does not match the shape.
"""
from __future__ import annotations

import dataclasses

import torch

from ..kernels import delta_fuse, quant
from .contract import Probe, entry

NODES = ("DitKitAdapterLoader", "DitKitLoKrLoader")
HOST_FORMATS = ("int8_rowwise", "int8_convrot", "mxfp8", "nvfp4")


class LayerRefused(ValueError):
    """A quantized layer ditkit cannot requantize exactly (the message names the layout and why)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    fmt: str              # one of HOST_FORMATS
    layout_cls: str       # comfy_kitchen layout class name
    group: int = 0        # ConvRot group size (0: none)

    def describe(self) -> str:
        if self.fmt == "int8_convrot":
            return f"int8_tensorwise ConvRot (per-channel, group {self.group})"
        if self.fmt == "int8_rowwise":
            return "int8_tensorwise (per-channel)"
        return self.fmt


def _is_power_of_4(n: int) -> bool:
    return n >= 4 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def classify(qt, key: str) -> Layout | None:
    """The host-requantized layout of a QuantizedTensor, None for the per-tensor schemes ditkit requantizes itself
    (fp8 / int8 with one scale, no rotation). Raises :class:`LayerRefused` naming ``key`` otherwise."""
    p = qt._params
    name = qt._layout_cls
    shape = tuple(qt.shape)
    if len(shape) != 2:
        raise LayerRefused(f"layer '{key}' ({name}) has shape {list(shape)}; only 2-D weights are requantized")
    if getattr(p, "transposed", False):
        raise LayerRefused(f"layer '{key}' ({name}) is stored transposed")
    rows, cols = shape
    if name == "TensorWiseINT8Layout":
        s = getattr(p, "scale", None)
        if s is None:
            raise LayerRefused(f"layer '{key}' (int8_tensorwise) has no weight_scale (re-download the base; "
                               "DitKitH3ModelLoader 'model_name' refuses such a file when it loads it)")
        convrot = bool(getattr(p, "convrot", False))
        if s.numel() == 1 and not convrot:
            return None
        if s.numel() not in (1, rows):
            raise LayerRefused(f"layer '{key}' (int8_tensorwise) has {s.numel()} scales for {rows} rows")
        if not convrot:
            return Layout("int8_rowwise", name)
        g = int(getattr(p, "convrot_groupsize", 256))
        if not _is_power_of_4(g):
            raise LayerRefused(f"layer '{key}' (int8_tensorwise ConvRot): convrot_groupsize {g} is not a power of 4 "
                               "(the host's regular Hadamard exists only for 4, 16, 64, 256, ...)")
        if cols % g:
            raise LayerRefused(f"layer '{key}' (int8_tensorwise ConvRot): convrot_groupsize {g} does not divide its "
                               f"width {cols} (the comfy_quant marker and the weight disagree: a damaged or "
                               "mislabelled checkpoint; re-download or re-export the base the model loader reads, "
                               "DitKitH3ModelLoader 'model_name' refuses such a file when it loads it)")
        return Layout("int8_convrot", name, g)
    if name in ("TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout"):
        fmt = "mxfp8" if "MXFP8" in name else "nvfp4"
        need = ("scale",) if fmt == "mxfp8" else ("scale", "block_scale")
        for f in need:
            if getattr(p, f, None) is None:
                raise LayerRefused(f"layer '{key}' ({fmt}) has no {'weight_scale_2' if f == 'scale' and fmt == 'nvfp4' else 'weight_scale'}")
        lay = quant.storage_layout(shape, fmt)
        want_data = lay["weight"][0]
        want_scales = lay["weight_scale"][0]
        got_scales = tuple((p.scale if fmt == "mxfp8" else p.block_scale).shape)
        if tuple(qt._qdata.shape) != want_data or got_scales != want_scales:
            raise LayerRefused(f"layer '{key}' ({fmt}): stored data {list(qt._qdata.shape)} / block scales "
                               f"{list(got_scales)} do not match the layout of a {list(shape)} weight "
                               f"({list(want_data)} / {list(want_scales)})")
        return Layout(fmt, name)
    raise LayerRefused(f"layer '{key}' is stored in the host layout {name}; ComfyUI itself cannot requantize it "
                       "from a float weight without its calibration data, so ditkit does not fuse into it (use "
                       "mode 'bypass', which leaves the weight untouched)")


def logical_shapes(model, sd: dict) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a ModelPatcher's state dict with each quantized weight's LOGICAL ``[out, in]`` (the state
    dict holds nvfp4's packed ``[out, in/2]`` bytes and the padded block layouts)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dim() == 2:
            w = model.get_model_object(k)
            w = w.data if isinstance(w, torch.nn.Parameter) else w
            if type(w).__name__ == "QuantizedTensor":
                out[k] = tuple(w.shape)
                continue
        out[k] = tuple(v.shape)
    return out


def hadamard64(group: int) -> torch.Tensor:
    """The host's ConvRot rotation (comfy_kitchen ``_build_hadamard``) in float64 (its entries are ±1/sqrt(g),
    exact powers of two for powers of 4)."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    return _build_hadamard(group, device="cpu", dtype=torch.float64).clone()


def base_rows64(qt, lay: Layout, r0: int, r1: int, h: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``r0:r1`` of the exact float64 value the layer's codes stand for."""
    p = qt._params
    cols = qt.shape[1]
    if lay.fmt in ("int8_rowwise", "int8_convrot"):
        s = p.scale.double().reshape(-1)
        s = s[r0:r1].reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1)
        x = qt._qdata[r0:r1].double() * s
        if lay.fmt == "int8_convrot":
            g = lay.group
            h = hadamard64(g) if h is None else h
            x = torch.matmul(x.reshape(r1 - r0, cols // g, g), h.T).reshape(r1 - r0, cols)
        return x
    scales = {"weight_scale": p.scale} if lay.fmt == "mxfp8" else {"weight_scale": p.block_scale,
                                                                     "weight_scale_2": p.scale}
    return quant.dequant_rows64(qt._qdata, scales, lay.fmt, r0, r1, cols)


def _host_layout(lay: Layout):
    import comfy.quant_ops as q

    return q.get_layout_class(lay.layout_cls)


def requantize_layer(qt, lay: Layout, deltas, max_chunk_elems: int = delta_fuse.DEFAULT_CHUNK_ELEMS,
                     dtype: torch.dtype = torch.float32):
    """-> (new QuantizedTensor of the same layout class and params kinds, number of row chunks). See the module
    doc; nothing of ``qt`` is modified."""
    from comfy.quant_ops import QuantizedTensor

    cls = _host_layout(lay)
    rows, cols = tuple(qt.shape)
    delta_fuse.check_deltas(deltas, rows, cols)
    spans = quant.requantize_spans(rows, max(1, int(max_chunk_elems) // max(1, cols)))
    h = hadamard64(lay.group) if lay.fmt == "int8_convrot" else None
    kwargs = dict(cls.requantize_kwargs(qt))

    def updated(r0, r1):
        u = base_rows64(qt, lay, r0, r1, h)
        u += delta_fuse.delta_sum_rows(deltas, r0, r1, cols, torch.float64, u.device)
        return u.to(dtype)

    tensor_scale = None
    if lay.fmt == "nvfp4":
        amax = None
        for r0, r1 in spans:
            m = torch.amax(updated(r0, r1).abs())
            amax = m if amax is None else torch.maximum(amax, m)
        if float(amax) == 0.0:
            raise LayerRefused("the updated weight is all zeros: the host's nvfp4 quantize divides by its zero "
                               "per-tensor scale (NaN weights)")
        _, probe = cls.quantize(amax.reshape(1, 1), scale="recalculate")
        tensor_scale = probe.scale
    datas, scales = [], []
    for r0, r1 in spans:
        u = updated(r0, r1)
        if lay.fmt == "nvfp4":
            d, prm = cls.quantize(u, scale=tensor_scale, **kwargs)
            scales.append(prm.block_scale)
        else:
            d, prm = cls.quantize(u, scale="recalculate", **kwargs)
            scales.append(prm.scale)
        datas.append(d)
        del u
    data = torch.cat(datas) if len(datas) > 1 else datas[0]
    sc = torch.cat(scales) if len(scales) > 1 else scales[0]
    old = qt._params
    if lay.fmt == "nvfp4":
        params = dataclasses.replace(old, scale=tensor_scale.to(old.scale.dtype).reshape(old.scale.shape),
                                     block_scale=sc.to(old.block_scale.dtype))
    elif lay.fmt == "mxfp8":
        params = dataclasses.replace(old, scale=sc.to(old.scale.dtype))
    else:
        params = dataclasses.replace(old, scale=sc.to(old.scale.dtype).reshape(rows, -1)
                                     if old.scale.numel() > 1 else sc.to(old.scale.dtype))
        if prm.convrot != old.convrot or prm.convrot_groupsize != old.convrot_groupsize:
            raise LayerRefused("the host quantize changed the ConvRot parameters")  # pragma: no cover
    if tuple(data.shape) != tuple(qt._qdata.shape):
        raise LayerRefused(f"the host quantize returned data {list(data.shape)} for stored {list(qt._qdata.shape)}")
    return QuantizedTensor(data.to(qt._qdata.device), qt._layout_cls, params), len(spans)


def dequantize64(qt, key: str = "layer") -> torch.Tensor | None:
    """The whole layer's exact float64 value for the host-requantized layouts (None for others)."""
    try:
        lay = classify(qt, key)
    except LayerRefused:
        return None
    if lay is None:
        return None
    return base_rows64(qt, lay, 0, qt.shape[0])


# ------------------------------------------------------------------------------------------------ contract
@entry("comfy_kitchen.tensor.QuantizedLayout.quantize/dequantize (int8 ConvRot, mxfp8, nvfp4)", nodes=NODES,
       what="behaviour")
def _host_layouts():
    """The host's int8 ConvRot / mxfp8 / nvfp4 layouts: ditkit's float64 reading of the codes, rounded to float32,
    is the host's own dequantize (within float32 rounding of the rotation), and the host's quantize of row chunks
    concatenates to its quantize of the whole weight."""
    import comfy.quant_ops as q

    g = torch.Generator().manual_seed(0)
    w = torch.randn(160, 64, generator=g)
    notes = []
    for name, fmt, kw in (("TensorWiseINT8Layout", "int8_convrot", dict(per_channel=True, convrot=True,
                                                                         convrot_groupsize=16)),
                          ("TensorCoreMXFP8Layout", "mxfp8", {}), ("TensorCoreNVFP4Layout", "nvfp4", {})):
        cls = q.get_layout_class(name)
        if cls is None:
            notes.append(f"{name} missing")
            continue
        d, p = cls.quantize(w.clone(), scale="recalculate", **kw)
        qt = q.QuantizedTensor(d, name, p)
        lay = classify(qt, "probe")
        if lay is None or lay.fmt != fmt:
            return Probe.broken(f"{name}: classified {lay}")
        mine = base_rows64(qt, lay, 0, 160)
        host = qt.dequantize().double()
        err = float((mine - host).abs().max()) / max(float(mine.abs().max()), 1e-30)
        if err > 2.0 ** -20:
            return Probe.broken(f"{name}: host dequantize differs from ditkit's reading by {err:.3g} (relative)")
        new, _ = requantize_layer(qt, lay, [], max_chunk_elems=128 * 64)
        d2, p2 = cls.quantize((mine + 0.0).float(), scale="recalculate", **kw)   # + 0.0: -0 -> +0, as the add
        if not torch.equal(new._qdata.view(torch.uint8), d2.view(torch.uint8)):
            return Probe.broken(f"{name}: quantize of row chunks differs from the whole-weight quantize")
    return Probe.adapted("; ".join(notes)) if notes else Probe.holds()
