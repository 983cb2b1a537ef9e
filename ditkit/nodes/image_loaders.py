"""DitKitZImageLoader: load a Z-Image DiT of any width (the stock UNETLoader knows Z-Image settings only for
dim 3840 and builds a Lumina-2 model with the wrong heads/axes for anything else).

Dim 3840 goes through ComfyUI's own ``comfy.sd.load_diffusion_model_state_dict`` unchanged; other widths get
Z-Image's settings (head size 128, axes [32, 48, 48], rope theta 256, ffn 8/3, Z-Image modulation, time
scale 1000) on ComfyUI's ``supported_models.ZImage`` config and are built with ComfyUI's loader steps.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..errors import UnsupportedModelError
from ..loaders.read_progress import load_with_progress
from . import _families, _files
from ._bars import lazy_bar
from ._common import send_report, ui_report

NODE_ID = "DitKitZImageLoader"


def _zimage_config(sd: dict, path: str) -> dict:
    import comfy.model_detection

    cfg = comfy.model_detection.detect_unet_config(sd, "")
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


def load_zimage(path: str, progress=None):
    """-> (model patcher, config, load path). ``progress(done, total)``: optional, after each tensor read."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import comfy.utils

    sd, _ = load_with_progress(path, progress)
    cfg = _zimage_config(sd, path)
    if cfg["dim"] == 3840:
        return comfy.sd.load_diffusion_model_state_dict(sd), cfg, "stock"
    model_config = comfy.supported_models.ZImage(cfg)
    params = comfy.utils.calculate_parameters(sd)
    weight_dtype = comfy.utils.weight_dtype(sd)
    load_device = mm.get_torch_device()
    supported = list(model_config.supported_inference_dtypes)
    unet_dtype = mm.unet_dtype(model_params=params, supported_dtypes=supported, weight_dtype=weight_dtype)
    manual_cast = mm.unet_manual_cast(unet_dtype, load_device, supported)
    model_config.set_inference_dtype(unet_dtype, manual_cast, device=load_device)
    model = model_config.get_model(sd, "")
    patcher = comfy.model_patcher.CoreModelPatcher(model, load_device=load_device,
                                                   offload_device=mm.unet_offload_device())
    model.load_model_weights(sd, "", assign=patcher.is_dynamic())
    return patcher, cfg, "ditkit-config"


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
            ],
            outputs=[io.Model.Output(tooltip="The Z-Image model."),
                     io.String.Output(display_name="report", tooltip="Detected config and load path.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, unet_name: str) -> io.NodeOutput:
        path = _files.safetensors_path("diffusion_models", unet_name, NODE_ID)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        model, cfg, how = load_zimage(path, progress=lazy_bar(node_id))
        summary = (f"Z-Image dim {cfg['dim']}, {cfg['n_layers']} layers, {cfg.get('n_heads')} heads, "
                   f"loaded via {how}")
        payload = send_report(node_id, NODE_ID, "load", summary,
                              {"file": unet_name, "config": cfg, "path": how})
        return io.NodeOutput(model, summary, ui=ui_report(payload))


NODES = [DitKitZImageLoader]
