"""DitKitH3ModelLoader: load a MiniMax H3 DiT from the official shard folder, a diffusers folder or a ComfyUI
single file (full, AdaLN-curve, FastH3, int8/fp8 repacks) into the stock ComfyUI MODEL.

The core (``loaders/h3.py``) detects the layout, validates every header, then reads and converts one tensor at a
time; the model is built by ComfyUI's own ``comfy.sd.load_diffusion_model_state_dict`` so dynamic VRAM, LoRA
and every stock node keep working exactly as with UNETLoader.
"""
from __future__ import annotations

import os
import re

import folder_paths
from comfy_api.latest import io

from ..errors import CheckpointError
from ..loaders import h3 as core
from . import _families, _files
from ._common import progress, send_report, ui_report

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
    for root in folder_paths.get_folder_paths(FOLDER):
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
                              f"(folders: {folder_paths.get_folder_paths(FOLDER)})")
    return path


GATE_ATTACHMENT = "ditkit_h3_gate_compress"
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


def load_h3_model(path: str, weight_dtype: str = "default", node_id: str | None = None):
    """-> (ModelPatcher, H3LoadReport). Raises CheckpointError before building anything on bad input."""
    import comfy.sd

    opts = model_options(weight_dtype)
    bar = None

    def cb(done, total):
        nonlocal bar
        if bar is None:
            bar = progress(total, node_id)
        bar(done, total)

    sd, report = core.load_h3_state_dict(path, progress=cb)
    # ComfyUI 0.33 has no module for FastH3's trained VSA gates and drops them as unexpected keys; keep them
    # as an attachment that DitKitSparseAttention reads (nodes/sparse_attention.py GATE_ATTACHMENT).
    gates = {int(k.split(".")[1]): sd.pop(k) for k in [k for k in sd if k.startswith("blocks.")
                                                       and k.endswith(".attn.to_gate_compress.weight")]}
    meta = core.comfy_metadata(path)
    try:
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options=opts, metadata=meta)
    finally:
        sd.clear()
    if model is None:
        raise CheckpointError(f"{NODE_ID}: ComfyUI did not recognise the converted H3 state dict from '{path}' "
                              "(this ComfyUI may predate MiniMax H3 support; needs 0.33+)")
    image_model = model.model.model_config.unet_config.get("image_model")
    if image_model != "minimax_h3":
        raise CheckpointError(f"{NODE_ID}: ComfyUI detected {image_model!r} for '{path}', expected 'minimax_h3'")
    if gates:
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
            ],
            outputs=[io.Model.Output(tooltip="The stock ComfyUI MiniMax H3 model."),
                     io.String.Output(display_name="report", tooltip="Layout detected, conversions applied, config.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default") -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        path = resolve(model_name)
        model, report = load_h3_model(path, weight_dtype, node_id)
        summary = report.summary() + (f"; weights cast to {weight_dtype}" if weight_dtype != "default" else "")
        data = report.as_dict()
        data.update(model_name=model_name, weight_dtype=weight_dtype)
        payload = send_report(node_id, NODE_ID, "load", summary, data)
        return io.NodeOutput(model, summary, ui=ui_report(payload))


NODES = [DitKitH3ModelLoader]
