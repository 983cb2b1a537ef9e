"""Model-family detection on ComfyUI MODEL objects (ModelPatcher -> BaseModel -> diffusion_model)."""
from __future__ import annotations

from ..errors import UnsupportedModelError

FAMILIES = ("h3", "ltx2", "zimage", "flux2")


def diffusion_model(model):
    """The ``diffusion_model`` inside a ComfyUI MODEL (ModelPatcher), or None."""
    return getattr(getattr(model, "model", None), "diffusion_model", None)


def h3_diffusion_model(model, node_id: str, message: str):
    """The MiniMax H3 diffusion model inside a MODEL. Otherwise an UnsupportedModelError whose text is
    ``f"{node_id}: " + message`` with ``{got}`` replaced by the class it got (each node says why it needs H3)."""
    dm = diffusion_model(model)
    try:
        from comfy.ldm.minimax.model import MiniMaxH3Model
    except ImportError as e:  # pragma: no cover - needs ComfyUI 0.33+
        raise UnsupportedModelError(f"{node_id}: this ComfyUI has no MiniMax H3 support (needs 0.33+)") from e
    if not isinstance(dm, MiniMaxH3Model):
        got = type(dm).__name__ if dm is not None else type(model).__name__
        raise UnsupportedModelError(f"{node_id}: " + message.format(got=got))
    return dm


def is_h3(model) -> bool:
    """Whether the MODEL holds a MiniMax H3 diffusion model (False on a ComfyUI without H3 support)."""
    try:
        from comfy.ldm.minimax.model import MiniMaxH3Model
    except ImportError:  # pragma: no cover - ComfyUI < 0.33
        return False
    return isinstance(diffusion_model(model), MiniMaxH3Model)


def model_family(model) -> str | None:
    """``"h3" | "ltx2" | "zimage" | "flux2"`` for the diffusion model of a MODEL, None for anything else.

    By class name (as ComfyUI 0.33 names them) plus the structure that tells the variants apart: Z-Image is a
    NextDiT whose layers carry a small (<= 256 wide) AdaLN input; FLUX.2 is a Flux with global modulation."""
    dm = diffusion_model(model)
    name = type(dm).__name__
    if name == "MiniMaxH3Model":
        return "h3"
    if name == "LTXAVModel":
        return "ltx2"
    if name == "NextDiT" and getattr(dm, "layers", None) is not None and len(dm.layers) \
            and getattr(dm.layers[0], "modulation", False) \
            and getattr(dm.layers[0].adaLN_modulation[0], "in_features", 0) <= 256:
        return "zimage"
    if name == "Flux" and getattr(getattr(dm, "params", None), "global_modulation", False):
        return "flux2"
    return None


def teacache_family(model) -> str:
    """The family for TeaCache / its calibration; UnsupportedModelError naming the class otherwise."""
    family = model_family(model)
    if family is None:
        name = type(diffusion_model(model)).__name__
        raise UnsupportedModelError(
            f"TeaCache: the model's diffusion model is {name!r}; ditkit TeaCache supports MiniMax H3 (MiniMaxH3Model), "
            "LTX-2 audio-video (LTXAVModel), Z-Image (NextDiT with Z-Image modulation) and FLUX.2 (Flux with global "
            "modulation)")
    return family


def model_sampling(model):
    """The MODEL's model-sampling object as sampling will use it (object patches applied)."""
    return model.get_model_object("model_sampling")


def load_device(model):
    """The device ComfyUI loads the MODEL onto for sampling."""
    return model.load_device


def inference_dtype(model, default):
    """The dtype the MODEL's diffusion model computes in (``default`` when this ComfyUI does not say)."""
    inner = getattr(model, "model", None)
    return inner.get_dtype_inference() if hasattr(inner, "get_dtype_inference") else default


def model_object(model, key: str):
    """The object at ``key`` ("diffusion_model.blocks.0.adaln_proj") as the MODEL's patches leave it."""
    return model.get_model_object(key)


def attention_override(model):
    """The ``optimized_attention_override`` already installed in the MODEL's ``transformer_options`` (None if none)."""
    return model.model_options.get("transformer_options", {}).get("optimized_attention_override")
