"""The H3 sigma shifts as ComfyUI's own ``MiniMaxH3SigmaShift`` node sets them (``comfy.model_sampling``): the same
model-sampling classes as an object patch and the same ``transformer_options`` keys, on a clone."""
from __future__ import annotations


def install_shifts(model, shift_video: float, shift_audio: float):
    """A clone with ComfyUI's own ``MiniMaxH3SigmaShift`` patch (same classes, same keys)."""
    import comfy.model_sampling

    m = model.clone()

    class ModelSamplingAdvanced(comfy.model_sampling.ModelSamplingAV, comfy.model_sampling.CONST):
        pass

    original = m.get_model_object("model_sampling")
    ms = ModelSamplingAdvanced(model.model.model_config)
    ms.set_parameters(shift=shift_video, audio_shift=shift_audio)
    if hasattr(original, "noise_scale"):
        ms.set_noise_scale(original.noise_scale)
    m.add_object_patch("model_sampling", ms)
    to = m.model_options["transformer_options"] = m.model_options.get("transformer_options", {}).copy()
    to["minimax_h3_sigma_shift_video"] = shift_video
    to["minimax_h3_sigma_shift_audio"] = shift_audio
    return m
