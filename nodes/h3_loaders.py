"""DitKitH3ModelLoader: load a MiniMax H3 DiT from the official shard folder, a diffusers folder or a ComfyUI
single file (full, AdaLN-curve, FastH3, int8/fp8 repacks) into the stock ComfyUI MODEL.

The core (``loaders/h3.py``) detects the layout, validates every header, then reads and converts one tensor at a
time; the model is built by ComfyUI's own ``comfy.sd.load_diffusion_model_state_dict`` so dynamic VRAM, LoRA
and every stock node keep working exactly as with UNETLoader.
"""
from __future__ import annotations

import os
import re

from comfy_api.latest import io

from ..errors import CheckpointError
from ..loaders import h3 as core
from ..bridge.files import folder_roots
from ..bridge.loaders import GATE_ATTACHMENT, image_model_of, load_diffusion_model
from ..bridge.hostcompat import drop_model_gates, model_gates_equal, stock_keeps_gates
from ..bridge.quant_scales import share_block_scales
from ..loaders import host_memory
from ..loaders import quantize as qcore
from . import _families, _files
from ._common import progress, send_report, ui_report
from ._quantizing import (AS_STORED, CACHE_TOOLTIP, QUANTIZE_ON, QUANTIZE_ON_TOOLTIP, WEIGHT_FORMAT_TOOLTIP,  # noqa: F401
                          check_quantize_on, check_weight_format, quantized_state_dict, weight_formats)

NODE_ID = "DitKitH3ModelLoader"
FOLDER = "diffusion_models"
INDEX_NAMES = (core.OFFICIAL_INDEX, core.DIFFUSERS_INDEX)
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


def _is_checkpoint_folder(path: str) -> bool:
    return any(_files.is_regular_file(os.path.join(path, n)) for n in INDEX_NAMES + (core.DIFFUSERS_SINGLE,))


_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")


def _loadable_file(path: str) -> bool:
    """What ``resolve`` + the core accept as a single file: a regular .safetensors/.sft file (through symlinks)
    that is not a shard of an indexed folder (the core asks for the folder instead)."""
    if not (_files.is_safetensors_name(path) and _files.is_regular_file(path)):
        return False
    parent = os.path.dirname(path)
    return not (_SHARD.search(os.path.basename(path))
                and any(_files.is_regular_file(os.path.join(parent, n)) for n in INDEX_NAMES))


def _resolvable(path: str) -> bool:
    """A regular file (through symlinks) or an H3 folder. Wider than the listing on purpose: a shard or a .ckpt
    typed by hand reaches the core, which says what to select instead."""
    return _files.is_regular_file(path) or (os.path.isdir(path) and _is_checkpoint_folder(path))


def list_choices() -> list[str]:
    """Single ``.safetensors`` files plus folders holding an index json (or a diffusers single file).

    Files inside such folders (the shards) are not listed on their own. Symlinks inside the folders are followed,
    as the stock loader does; only what :func:`resolve` accepts is listed (no dangling links, FIFOs, shards).
    """
    out: set[str] = set()
    for root in folder_roots(FOLDER):
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            rel = os.path.relpath(dirpath, root)
            if rel != "." and _is_checkpoint_folder(dirpath):
                out.add(rel.replace(os.sep, "/"))
                dirnames[:] = []
                continue
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for f in filenames:
                if _loadable_file(os.path.join(dirpath, f)) and _families.is_family(os.path.join(dirpath, f), "h3_dit"):
                    out.add(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return sorted(out)


def resolve(name: str) -> str:
    """A choice -> the real path of the file or H3 folder it names in one of the diffusion_models folders.

    The name may not leave the folders by its path (absolute, ``..``: refused before anything is looked up); a
    symlink inside a folder is followed, like UNETLoader does, and resolved once: the reader then opens that path
    and checks the opened file."""
    path = _files.find(FOLDER, name, NODE_ID, accept=_resolvable)
    if path is None:
        raise CheckpointError(f"{NODE_ID}: '{name}' is not a checkpoint file or H3 folder in models/{FOLDER} "
                              f"(folders: {folder_roots(FOLDER)})")
    return path


SOURCE_ATTACHMENT = "ditkit_h3_source"  # read by nodes/fasth3.py
METADATA_ATTACHMENT = "ditkit_h3_metadata"  # read by nodes/_fasth3_evidence.py


def model_options(weight_dtype: str) -> dict:
    import torch

    if weight_dtype == "default":
        return {}
    if weight_dtype == "fp8_e4m3fn":
        return {"dtype": torch.float8_e4m3fn}
    if weight_dtype == "fp8_e4m3fn_fast":
        return {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    if weight_dtype == "fp8_e5m2":
        return {"dtype": torch.float8_e5m2}
    raise CheckpointError(f"{NODE_ID}: unknown weight_dtype {weight_dtype!r}; choose one of {WEIGHT_DTYPES}")


def load_h3_model(path: str, weight_dtype: str = "default", node_id: str | None = None,
                  weight_format: str = AS_STORED, quantized_cache: bool = False, quantize_on: str = "cpu"):
    """-> (ModelPatcher, H3LoadReport); ``report.quant`` is the QuantReport (or None for ``as stored``).
    Raises CheckpointError before building anything on bad input."""
    opts = model_options(weight_dtype)
    fmt = check_weight_format(NODE_ID, weight_format)
    device = check_quantize_on(NODE_ID, quantize_on, fmt)
    if fmt is not None and weight_dtype != "default":
        raise CheckpointError(f"{NODE_ID}: weight_dtype {weight_dtype!r} and weight_format {weight_format!r} both "
                              "set the weights' precision; keep weight_dtype 'default' to quantize")
    bar = None

    def cb(done, total):
        nonlocal bar
        if bar is None:
            bar = progress(total, node_id)
        bar(done, total)

    if fmt is None:
        sd, report = core.load_h3_state_dict(path, progress=cb)
        quant = None
    else:
        plan = core.plan_h3(path)
        src = plan.src
        qcore.refuse_quantized_source(src.path, {k: ti.dtype for k, (_, ti) in src.locations.items()}, src.metadata)
        sd, quant = quantized_state_dict("h3", fmt, plan.inventory,
                                         lambda keys: core.iter_h3_tensors(plan, progress=cb, scratch_keys=keys), src.path,
                                         cache=(path, src.files) if quantized_cache else None, device=device)
        report = plan.report(len(sd))
    report.quant = quant
    meta = core.comfy_metadata(path if fmt is None else src)   # the plan's own detection: headers read once
    # ComfyUI 0.33 has no module for FastH3's trained VSA gates and drops them as unexpected keys: keep them as an
    # attachment that DitKitSparseAttention reads (nodes/sparse_attention.py GATE_ATTACHMENT). A host that builds
    # attn.to_gate_compress (0.35+) loads them itself: they stay in the state dict (checked after the load).
    keys = [k for k in sd if k.startswith("blocks.") and k.endswith(".attn.to_gate_compress.weight")]
    host_gates = bool(keys) and stock_keeps_gates()
    gates = {int(k.split(".")[1]): (sd[k] if host_gates else sd.pop(k)) for k in keys}
    try:
        with share_block_scales(sd) as sharing:       # no second copy of the block scales (bridge/quant_scales.py)
            model = load_diffusion_model(sd, model_options=opts, metadata=meta)
        sharing.record(quant)
    finally:
        sd.clear()
        host_memory.release_free_heap()
    if model is None:
        raise CheckpointError(f"{NODE_ID}: ComfyUI did not recognise the converted H3 state dict from '{path}' "
                              "(this ComfyUI may predate MiniMax H3 support; needs 0.33+)")
    image_model = image_model_of(model)
    if image_model != "minimax_h3":
        raise CheckpointError(f"{NODE_ID}: ComfyUI detected {image_model!r} for '{path}', expected 'minimax_h3'")
    if gates and host_gates and model_gates_equal(model, gates):
        report.converted["to_gate_compress -> loaded by ComfyUI into attn.to_gate_compress"] = len(gates)
    elif gates:
        if host_gates:  # the host takes the keyword but did not build / load the gates: the attachment carries them
            drop_model_gates(model)
        model.set_attachments(GATE_ATTACHMENT, gates)
        report.converted["to_gate_compress -> sparse-attention attachment"] = len(gates)
    # where it came from: DitKitFastH3Schedule looks for the export's fastvideo_inference.json there
    model.set_attachments(SOURCE_ATTACHMENT, path)
    # the single file's safetensors metadata: DitKitSparseAttention's recipe 'auto' reads the release id from it
    model.set_attachments(METADATA_ATTACHMENT, dict(meta or {}))
    return model, report


class DitKitH3ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="H3 Model Loader (ditkit)",
            category="ditkit/loaders",
            description=("Loads a MiniMax H3 DiT from the official sharded folder (per-head interleaved qkv), a "
                         "diffusers transformer folder, or a ComfyUI single file, converting to ComfyUI's layout "
                         "one tensor at a time. Reports the layout detected and every conversion applied."),
            search_aliases=["h3 loader", "minimax h3 loader", "h3 official shards", "h3 diffusers loader",
                            "load diffusion model h3"],
            inputs=[
                io.Combo.Input("model_name", options=list_choices(),
                               tooltip=("A single .safetensors file in models/diffusion_models, or a folder there "
                                        "holding model.safetensors.index.json (official) or "
                                        "diffusion_pytorch_model*.safetensors + config.json (diffusers).")),
                io.Combo.Input("weight_dtype", options=WEIGHT_DTYPES, default="default", advanced=True,
                               tooltip="Same as UNETLoader: cast weights to fp8 at load (default keeps the file's dtypes)."),
                io.Combo.Input("weight_format", options=weight_formats(), default=AS_STORED, optional=True,
                               tooltip=WEIGHT_FORMAT_TOOLTIP),
                io.Boolean.Input("quantized_cache", default=False, optional=True, advanced=True,
                                 tooltip=CACHE_TOOLTIP),
                io.Combo.Input("quantize_on", options=QUANTIZE_ON, default="cpu", optional=True, advanced=True,
                               tooltip=QUANTIZE_ON_TOOLTIP),
            ],
            outputs=[io.Model.Output(tooltip="The stock ComfyUI MiniMax H3 model."),
                     io.String.Output(display_name="report", tooltip="Layout detected, conversions applied, config.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, model_name=None):
        if model_name is None or model_name in list_choices():
            return True
        return _families.check_listed(NODE_ID, "model_name", FOLDER, "h3_dit", model_name)

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default", weight_format: str = AS_STORED,
                quantized_cache: bool = False, quantize_on: str = "cpu") -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        check_quantize_on(NODE_ID, quantize_on, check_weight_format(NODE_ID, weight_format))
        path = resolve(model_name)
        model, report = load_h3_model(path, weight_dtype, node_id, weight_format, quantized_cache=quantized_cache,
                                      quantize_on=quantize_on)
        summary = report.summary() + (f"; weights cast to {weight_dtype}" if weight_dtype != "default" else "")
        data = report.as_dict()
        data.update(model_name=model_name, weight_dtype=weight_dtype, weight_format=weight_format,
                    quantized_cache=quantized_cache, quantize_on=quantize_on)
        if report.quant is not None:
            summary += "; quantized " + report.quant.summary()
            data["quantization"] = report.quant.as_dict()
        payload = send_report(node_id, NODE_ID, "load", summary, data)
        return io.NodeOutput(model, summary, ui=ui_report(payload))


NODES = [DitKitH3ModelLoader]
