"""How ditkit's model loaders hand a state dict to ComfyUI (``comfy.sd``, ``comfy.supported_models``,
``comfy.quant_ops``): the host builds every model; ditkit reads, checks and (optionally) quantizes the tensors.

* :func:`quant_algos`: the comfy_quant formats this ComfyUI can load (``comfy.quant_ops.QUANT_ALGOS``);
* :func:`model_load_device`: the device ComfyUI loads models onto (a quantizing load can quantize there);
* :func:`load_diffusion_model`: ComfyUI's own ``load_diffusion_model_state_dict`` (H3, LTX-2, FLUX.2, stock Z-Image);
* :func:`zimage_unet_config` / :func:`build_zimage`: a Z-Image of any width (ComfyUI's detector and model config,
  built the way ``load_diffusion_model_state_dict`` builds it, with the widths the file's shapes give).
"""
from __future__ import annotations

# FastH3's trained VSA gates ride on the MODEL as this attachment (ComfyUI 0.33 drops them at load):
# written by DitKitH3ModelLoader / DitKitAdapterLoader, read by DitKitSparseAttention
GATE_ATTACHMENT = "ditkit_h3_gate_compress"


def quant_algos() -> dict:
    """``comfy.quant_ops.QUANT_ALGOS`` ({} on a ComfyUI without comfy_quant formats)."""
    try:
        from comfy.quant_ops import QUANT_ALGOS
    except Exception:  # noqa: BLE001 - a ComfyUI without quant_ops has no comfy_quant formats
        return {}
    return QUANT_ALGOS


def model_load_device():
    """The torch device ComfyUI loads diffusion models onto (``comfy.model_management.get_torch_device``)."""
    import comfy.model_management as mm

    return mm.get_torch_device()


def load_diffusion_model(sd: dict, model_options: dict | None = None, metadata: dict | None = None):
    """ComfyUI's ``comfy.sd.load_diffusion_model_state_dict`` (None when ComfyUI does not recognise the model)."""
    import comfy.sd

    kw = {} if model_options is None else {"model_options": model_options}
    return comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata, **kw)


def zimage_unet_config(sd: dict) -> dict | None:
    """ComfyUI's UNet config detection on a (real or meta) diffusion-model state dict."""
    import comfy.model_detection

    return comfy.model_detection.detect_unet_config(sd, "")


def build_zimage(sd: dict, cfg: dict, load_weights):
    """A Z-Image ``ModelPatcher`` from ``cfg`` (any width), built as ``comfy.sd.load_diffusion_model_state_dict``
    builds it (comfy_quant layers as mixed-precision ops); ``load_weights(model, patcher)`` assigns the weights."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils

    model_config = comfy.supported_models.ZImage(cfg)
    quant = comfy.utils.detect_layer_quantization(sd, "")
    if quant:
        model_config.quant_config = quant
    params = comfy.utils.calculate_parameters(sd)
    weight_dtype = None if quant else comfy.utils.weight_dtype(sd)
    load_device = mm.get_torch_device()
    supported = list(model_config.supported_inference_dtypes)
    unet_dtype = mm.unet_dtype(model_params=params, supported_dtypes=supported, weight_dtype=weight_dtype)
    manual_cast = mm.unet_manual_cast(None if quant else unet_dtype, load_device, supported)
    model_config.set_inference_dtype(unet_dtype, manual_cast, device=load_device)
    model = model_config.get_model(sd, "")
    patcher = comfy.model_patcher.CoreModelPatcher(model, load_device=load_device,
                                                   offload_device=mm.unet_offload_device())
    load_weights(model, patcher)
    return patcher


def load_zimage_weights(model, sd: dict, patcher) -> None:
    """``BaseModel.load_model_weights`` (assigning the tensors when the patcher is dynamic)."""
    model.load_model_weights(sd, "", assign=patcher.is_dynamic())


def unet_config(model) -> dict:
    """The unet config ComfyUI detected for a loaded MODEL."""
    return model.model.model_config.unet_config


def image_model_of(model) -> str | None:
    """The ``image_model`` ComfyUI detected for a loaded MODEL (its unet config)."""
    return unet_config(model).get("image_model")
