"""DitKitZImageLoader: load a Z-Image DiT of any width (the stock UNETLoader knows Z-Image settings only for
dim 3840 and builds a Lumina-2 model with the wrong heads/axes for anything else).

Dim 3840 goes through ComfyUI's own ``comfy.sd.load_diffusion_model_state_dict`` unchanged; other widths get
Z-Image's settings (head size 128, axes [32, 48, 48], rope theta 256, ffn 8/3, Z-Image modulation, time
scale 1000) on ComfyUI's ``supported_models.ZImage`` config and are built with ComfyUI's loader steps.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge.loaders import build_zimage, load_diffusion_model, load_zimage_weights, zimage_unet_config
from ..bridge.quant_scales import share_block_scales
from ..errors import UnsupportedModelError
from ..loaders import host_memory
from ..loaders import quantize as qcore
from ..loaders.read_progress import load_with_progress
from ..loaders.safetensors_io import DTYPES
from . import _families, _files
from ._quantizing import (AS_STORED, CACHE_TOOLTIP, QUANTIZE_ON, QUANTIZE_ON_TOOLTIP, WEIGHT_FORMAT_TOOLTIP,
                           check_quantize_on, check_weight_format, quantized_state_dict, weight_formats)
from ._bars import lazy_bar
from ._common import send_report, ui_report

NODE_ID = "DitKitZImageLoader"


def _zimage_config(sd: dict, path: str) -> dict:
    cfg = zimage_unet_config(sd)
    if cfg is None or cfg.get("image_model") != "lumina2":
        raise UnsupportedModelError(f"{NODE_ID}: '{path}' is not a Z-Image/Lumina-2 DiT (detected "
                                    f"{None if cfg is None else cfg.get('image_model')!r}); use UNETLoader")
    dim = int(cfg["dim"])
    qkv = sd.get("layers.0.attention.qkv.weight")
    mod = sd.get("layers.0.adaLN_modulation.0.weight")
    if qkv is None or mod is None or tuple(qkv.shape) != (3 * dim, dim) or mod.shape[0] != 4 * dim or dim % 128 or dim < 256:
        raise UnsupportedModelError(
            f"{NODE_ID}: '{path}' does not have the Z-Image layout (needs fused 'layers.0.attention.qkv.weight' "
            f"[3*dim, dim], 'layers.0.adaLN_modulation.0.weight' [4*dim, *], dim a multiple of 128 and >= 256 (ComfyUI's Z-Image modulation); got dim {dim}, "
            f"qkv {None if qkv is None else tuple(qkv.shape)})")
    cfg.update(n_heads=dim // 128, n_kv_heads=dim // 128, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
               rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0)
    if "cap_pad_token" in sd:
        cfg["pad_tokens_multiple"] = 32
    return cfg


def _quantized_zimage(path: str, fmt: str, progress, cache: bool = False, device=None):
    """Config from the header (shapes only), then read -> quantize -> keep, one tensor at a time."""
    import torch

    src = qcore.open_source(path)
    if src.family != "zimage":
        raise UnsupportedModelError(f"{NODE_ID}: '{path}' is not a Z-Image/Lumina-2 DiT (detected {src.family!r}); "
                                    "use UNETLoader")
    meta = {k: torch.empty(shape, dtype=DTYPES[dt][0], device="meta") for k, (shape, dt) in src.inventory.items()}
    cfg = _zimage_config(meta, path)
    del meta
    sd, report = quantized_state_dict("zimage", fmt, src.inventory, lambda keys: src.reader(progress, scratch_keys=keys), path,
                                      cache=(path, src.files) if cache else None, device=device)
    return sd, cfg, report


def load_zimage(path: str, progress=None, weight_format: str = AS_STORED, quantized_cache: bool = False,
                quantize_on: str = "cpu"):
    """-> (model patcher, config, load path[, QuantReport when quantized]). ``progress(done, total)``: optional,
    after each tensor read. With a ``weight_format`` the state dict is what a comfy_quant file gives ComfyUI."""
    fmt = check_weight_format(NODE_ID, weight_format)
    device = check_quantize_on(NODE_ID, quantize_on, fmt)
    report = None
    if fmt is None:
        sd, _ = load_with_progress(path, progress)
        cfg = _zimage_config(sd, path)
    else:
        sd, cfg, report = _quantized_zimage(path, fmt, progress, quantized_cache, device)
    if cfg["dim"] == 3840:
        with share_block_scales(sd) as sharing:       # no second copy of the block scales (bridge/quant_scales.py)
            out = load_diffusion_model(sd), cfg, "stock"
        sharing.record(report)
        host_memory.release_free_heap()
        return out if report is None else out + (report,)
    # built as comfy.sd.load_diffusion_model_state_dict builds a comfy_quant state dict (bridge/loaders.py)
    sharing = None

    def load_weights(model, patcher):
        nonlocal sharing
        with share_block_scales(sd) as sharing:
            load_zimage_weights(model, sd, patcher)

    patcher = build_zimage(sd, cfg, load_weights)
    sharing.record(report)
    host_memory.release_free_heap()
    return (patcher, cfg, "ditkit-config") if report is None else (patcher, cfg, "ditkit-config", report)


class DitKitZImageLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="Z-Image Model Loader (ditkit)",
            category="ditkit/loaders",
            description="Loads a ComfyUI-layout Z-Image DiT of any width (multiple of 128) with Z-Image settings.",
            search_aliases=["z-image loader", "zimage unet", "lumina2 loader"],
            inputs=[
                io.Combo.Input("unet_name", options=_families.family_files("diffusion_models", "zimage"),
                               tooltip="Z-Image DiT file in models/diffusion_models (ComfyUI fused-qkv layout)."),
                io.Combo.Input("weight_format", options=weight_formats(), default=AS_STORED, optional=True,
                               tooltip=WEIGHT_FORMAT_TOOLTIP),
                io.Boolean.Input("quantized_cache", default=False, optional=True, advanced=True,
                                 tooltip=CACHE_TOOLTIP),
                io.Combo.Input("quantize_on", options=QUANTIZE_ON, default="cpu", optional=True, advanced=True,
                               tooltip=QUANTIZE_ON_TOOLTIP),
            ],
            outputs=[io.Model.Output(tooltip="The Z-Image model."),
                     io.String.Output(display_name="report", tooltip="Detected config and load path.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, unet_name=None):
        return _families.check_listed(NODE_ID, "unet_name", "diffusion_models", "zimage", unet_name)

    @classmethod
    def execute(cls, unet_name: str, weight_format: str = AS_STORED, quantized_cache: bool = False,
                quantize_on: str = "cpu") -> io.NodeOutput:
        check_quantize_on(NODE_ID, quantize_on, check_weight_format(NODE_ID, weight_format))
        path = _files.safetensors_path("diffusion_models", unet_name, NODE_ID)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        model, cfg, how, *quant = load_zimage(path, progress=lazy_bar(node_id), weight_format=weight_format,
                                              quantized_cache=quantized_cache, quantize_on=quantize_on)
        summary = (f"Z-Image dim {cfg['dim']}, {cfg['n_layers']} layers, {cfg.get('n_heads')} heads, "
                   f"loaded via {how}")
        data = {"file": unet_name, "config": cfg, "path": how, "weight_format": weight_format,
                "quantized_cache": quantized_cache, "quantize_on": quantize_on}
        if quant:
            summary += "; quantized " + quant[0].summary()
            data["quantization"] = quant[0].as_dict()
        payload = send_report(node_id, NODE_ID, "load", summary, data)
        return io.NodeOutput(model, summary, ui=ui_report(payload))


NODES = [DitKitZImageLoader]
