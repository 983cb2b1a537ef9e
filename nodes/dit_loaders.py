"""DitKitLTX2ModelLoader / DitKitFlux2ModelLoader: load an LTX-2 or FLUX.2 DiT (a ComfyUI / BFL / Lightricks
single file) into the stock ComfyUI MODEL, as stored or quantized while loading (``weight_format``).

The family is decided from the safetensors header alone (no tensor read; ``loaders/quantize.detect_family``,
the same markers ComfyUI's ``model_detection.py`` uses: ``adaln_single.emb.timestep_embedder.linear_1.bias``
for LTX-2, ``double_stream_modulation_img.lin.weight`` for FLUX.2); a file of another family is refused by name
before anything is read. With a ``weight_format`` each tensor is read, checked (NaN / Inf refused, naming it),
quantized by the family's recipe (``loaders/quantize.RECIPES``) and kept, one at a time: the state dict is what
a comfy_quant file of the same weights gives ComfyUI. The model is built by ComfyUI's own
``comfy.sd.load_diffusion_model_state_dict`` with the file's metadata (LTX-2 files declare their config there),
so every stock node (LoRA, offload, dynamic VRAM, samplers) works on it as with UNETLoader.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge.loaders import image_model_of, load_diffusion_model, unet_config
from ..bridge.quant_scales import share_block_scales
from ..errors import CheckpointError, UnsupportedModelError
from ..loaders import host_memory
from ..loaders import quantize as qcore
from ..loaders.read_progress import load_with_progress
from ..loaders.safetensors_io import read_header
from . import _families, _files
from ._bars import lazy_bar
from ._common import send_report, ui_report
from ._quantizing import (AS_STORED, CACHE_TOOLTIP, QUANTIZE_ON, QUANTIZE_ON_TOOLTIP, WEIGHT_FORMAT_TOOLTIP,
                           check_quantize_on, check_weight_format, quantized_state_dict, weight_formats)

FOLDER = "diffusion_models"
LTX2_NODE_ID = "DitKitLTX2ModelLoader"
FLUX2_NODE_ID = "DitKitFlux2ModelLoader"

# family (loaders/quantize.py names) -> (what it is called, the loader that loads it)
FAMILY_NAMES = {"h3": ("a MiniMax H3 DiT", "DitKitH3ModelLoader"), "zimage": ("a Z-Image DiT", "DitKitZImageLoader"),
                "ltx2": ("an LTX-2 DiT", LTX2_NODE_ID), "flux2": ("a FLUX.2 DiT", FLUX2_NODE_ID)}
# ComfyUI's image_model for each family (what the host must detect from the state dict)
IMAGE_MODELS = {"ltx2": ("ltxav", "ltxv"), "flux2": ("flux2",)}


def check_family(node_id: str, family: str, path: str, name: str) -> dict[str, str]:
    """The header says ``family`` (no tensor read) -> the file's metadata; else UnsupportedModelError naming what
    the file is and which loader takes it."""
    try:
        hdr = read_header(path)
    except CheckpointError as e:
        raise CheckpointError(f"{node_id}: unet_name {name!r}: {e}") from e
    found = qcore.detect_family(hdr.tensors)
    if found != family:
        want = FAMILY_NAMES[family][0]
        if found is None:
            sample = ", ".join(repr(k) for k in sorted(hdr.tensors)[:3])
            raise UnsupportedModelError(f"{node_id}: unet_name {name!r} is not {want} (none of the H3, LTX-2, Z-Image, "
                                        f"FLUX.2 markers; first tensors: {sample or 'none'}); use UNETLoader")
        what, loader = FAMILY_NAMES[found]
        raise UnsupportedModelError(f"{node_id}: unet_name {name!r} is {what}, not {want}; load it with {loader}")
    return dict(hdr.metadata)


def load_dit(node_id: str, family: str, path: str, name: str, weight_format: str = AS_STORED, progress=None,
             quantized_cache: bool = False, quantize_on: str = "cpu"):
    """-> (ModelPatcher, QuantReport or None). Bad input raises a DitKitError before the model is built (a
    NaN / Inf tensor: when it is read, before anything is handed to ComfyUI)."""
    fmt = check_weight_format(node_id, weight_format)
    device = check_quantize_on(node_id, quantize_on, fmt)
    meta = check_family(node_id, family, path, name)
    quant = None
    if fmt is None:
        sd, meta = load_with_progress(path, progress)
    else:
        try:
            src = qcore.open_source(path)      # headers only: refuses an already quantized source, by tensor
        except CheckpointError as e:
            raise CheckpointError(f"{node_id}: unet_name {name!r}: {e}") from e
        sd, quant = quantized_state_dict(family, fmt, src.inventory, lambda keys: src.reader(progress, scratch_keys=keys), path,
                                         cache=(path, src.files) if quantized_cache else None, device=device)
        meta = src.metadata
    try:
        with share_block_scales(sd) as sharing:       # no second copy of the block scales (bridge/quant_scales.py)
            model = load_diffusion_model(sd, metadata=meta or None)
        sharing.record(quant)
    finally:
        sd.clear()
        host_memory.release_free_heap()
    detected = None if model is None else image_model_of(model)
    if detected not in IMAGE_MODELS[family]:
        raise UnsupportedModelError(f"{node_id}: ComfyUI detected {detected!r} for unet_name {name!r}, expected "
                                    f"{' or '.join(map(repr, IMAGE_MODELS[family]))} (this ComfyUI may predate it)")
    return model, quant


def _config_text(model, family: str) -> tuple[str, dict]:
    cfg = unet_config(model)
    if family == "ltx2":
        keys = ("image_model", "num_layers", "num_attention_heads", "attention_head_dim", "cross_attention_dim",
                "audio_num_attention_heads", "audio_attention_head_dim")
    else:
        keys = ("image_model", "hidden_size", "num_heads", "depth", "depth_single_blocks", "in_channels",
                "context_in_dim", "guidance_embed")
    picked = {k: cfg[k] for k in keys if k in cfg}
    return ", ".join(f"{k} {v}" for k, v in picked.items() if k != "image_model"), picked


def _execute(cls, node_id: str, family: str, label: str, unet_name: str, weight_format: str,
             quantized_cache: bool = False, quantize_on: str = "cpu") -> io.NodeOutput:
    check_quantize_on(node_id, quantize_on, check_weight_format(node_id, weight_format))
    path = _files.safetensors_path(FOLDER, unet_name, node_id)
    uid = cls.hidden.unique_id if cls.hidden is not None else None
    model, quant = load_dit(node_id, family, path, unet_name, weight_format, progress=lazy_bar(uid),
                            quantized_cache=quantized_cache, quantize_on=quantize_on)
    text, cfg = _config_text(model, family)
    summary = f"{label} ({cfg.get('image_model')}): {text}; loaded by ComfyUI's loader"
    data = {"file": unet_name, "family": family, "config": cfg, "weight_format": weight_format,
            "quantized_cache": quantized_cache, "quantize_on": quantize_on}
    if quant is not None:
        summary += "; quantized " + quant.summary()
        data["quantization"] = quant.as_dict()
    else:
        summary += "; weights as stored"
    payload = send_report(uid, node_id, "load", summary, data)
    return io.NodeOutput(model, summary, ui=ui_report(payload))


def _inputs(family: str, what: str) -> list:
    return [
        io.Combo.Input("unet_name", options=_families.family_files(FOLDER, family),
                       tooltip=(f"{what} single .safetensors file in models/diffusion_models (only files whose header "
                                "has this family's tensors are listed).")),
        io.Combo.Input("weight_format", options=weight_formats(), default=AS_STORED, optional=True,
                       tooltip=WEIGHT_FORMAT_TOOLTIP),
        io.Boolean.Input("quantized_cache", default=False, optional=True, advanced=True, tooltip=CACHE_TOOLTIP),
        io.Combo.Input("quantize_on", options=QUANTIZE_ON, default="cpu", optional=True, advanced=True,
                       tooltip=QUANTIZE_ON_TOOLTIP),
    ]


def _outputs(what: str) -> list:
    return [io.Model.Output(tooltip=f"The stock ComfyUI model ({what})."),
            io.String.Output(display_name="report", tooltip="Detected config, load path, quantization.")]


def _description(what: str) -> str:
    return (f"Loads {what} from models/diffusion_models with ComfyUI's own loader, as stored or quantized while "
            "loading into a native comfy_quant format (weight_format: the block linears per the family recipe, one "
            f"tensor at a time; the rest as stored). Lists only files whose header says {what}; reports the "
            "detected config and what was quantized.")


class DitKitLTX2ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=LTX2_NODE_ID,
            display_name="LTX-2 Model Loader (ditkit)",
            category="ditkit/loaders",
            description=_description("an LTX-2 DiT"),
            search_aliases=["ltx-2 loader", "ltx2 loader", "ltxav loader", "ltx-2 quantize", "ltx-2 fp8"],
            inputs=_inputs("ltx2", "an LTX-2 DiT"),
            outputs=_outputs("an LTX-2 DiT"),
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, unet_name=None):
        return _families.check_listed(LTX2_NODE_ID, "unet_name", FOLDER, "ltx2", unet_name)

    @classmethod
    def execute(cls, unet_name: str, weight_format: str = AS_STORED, quantized_cache: bool = False,
                quantize_on: str = "cpu") -> io.NodeOutput:
        return _execute(cls, LTX2_NODE_ID, "ltx2", "LTX-2", unet_name, weight_format, quantized_cache, quantize_on)


class DitKitFlux2ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=FLUX2_NODE_ID,
            display_name="FLUX.2 Model Loader (ditkit)",
            category="ditkit/loaders",
            description=_description("a FLUX.2 DiT"),
            search_aliases=["flux.2 loader", "flux2 loader", "flux.2 quantize", "flux.2 fp8", "flux.2 nvfp4"],
            inputs=_inputs("flux2", "a FLUX.2 DiT"),
            outputs=_outputs("a FLUX.2 DiT"),
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, unet_name=None):
        return _families.check_listed(FLUX2_NODE_ID, "unet_name", FOLDER, "flux2", unet_name)

    @classmethod
    def execute(cls, unet_name: str, weight_format: str = AS_STORED, quantized_cache: bool = False,
                quantize_on: str = "cpu") -> io.NodeOutput:
        return _execute(cls, FLUX2_NODE_ID, "flux2", "FLUX.2", unet_name, weight_format, quantized_cache,
                        quantize_on)


NODES = [DitKitLTX2ModelLoader, DitKitFlux2ModelLoader]
