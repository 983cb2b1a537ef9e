"""DitKitLoKrLoader: exact LoKr adapters on ComfyUI's fused Z-Image / FLUX.2 weights.

The core (``loaders/lokr_apply.py``) parses, maps and validates; the clone and its patches are ``bridge/lokr.py``: one
lazy patch per adapter module with ``ModelPatcher.add_patches`` (row offsets for slices of fused weights).
The patch is a ``WeightAdapterBase`` that ComfyUI's ``lora.calculate_weight`` calls when it patches the
weight: ΔW is materialised one layer at a time (fp32), so unloading, strength changes and dynamic VRAM
work as for ComfyUI's own adapters, and nothing the size of the model is held in memory.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge.lokr import (DitKitLoKrPatch, apply_lokr, check_weight_formats, check_weight_keys,  # noqa: F401
                           fuse_quantized, model_shapes, quantized_note, requant_formats)
from ..loaders import lokr_apply as core
from . import _families, _files
from ._common import adapter_report_lines, send_report, ui_report

NODE_ID = "DitKitLoKrLoader"


def report_text(plan: core.LoKrPlan, file: str, strength: float, scale: float | None = None) -> str:
    lines = [f"{plan.summary()} | file {file}, strength {strength:g}"
             + (f", scale {scale:g} (node input)" if scale is not None else ", scale from the file")]
    for it in plan.items:
        lines.append(f"applied {it.module.prefix} -> {it.target.describe()} ({it.target.via}; scale "
                     f"{it.module.scale:g}: {it.module.scale_rule})")
    return "\n".join(lines + adapter_report_lines(plan))


class DitKitLoKrLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="LoKr Loader (ditkit)",
            category="ditkit/loaders",
            description="Applies a LoKr adapter (LyCORIS, PEFT, ai-toolkit, musubi-tuner, OneTrainer, SimpleTuner) "
                        "exactly onto ComfyUI's fused Z-Image / FLUX.2 weights and reports every key.",
            search_aliases=["lokr", "lycoris", "kronecker lora", "lokr loader", "flux2 lokr", "z-image lokr"],
            inputs=[
                io.Model.Input("model", tooltip="A ComfyUI Z-Image or FLUX.2 model: bf16/fp16/fp32 weights, or comfy_quant "
                                               "per-tensor fp8 / int8 layers (re-quantized in the same layout)."),
                io.Combo.Input("lokr_name", options=_families.family_files("loras", "lokr"),
                               tooltip="LoKr adapter file (.safetensors) in models/loras."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="Multiplier on ΔW (after the adapter's own alpha/rank scale)."),
                io.Float.Input("scale", default=0.0, min=-1000.0, max=1000.0, step=0.001, round=0.000001,
                               optional=True,
                               tooltip="0 = from the file (alpha/rank, PEFT alpha/r from its config or metadata, "
                                       "or the writer's documented convention; the report names which). Any other "
                                       "value replaces every module's alpha/rank scale: set it when the loader "
                                       "says the file does not determine the scale."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with the LoKr patches registered."),
                     io.String.Output(display_name="report",
                                      tooltip="Modules applied (target, scale), keys unused and layers refused, with why.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, lokr_name=None):
        return _families.check_listed(NODE_ID, "lokr_name", "loras", "lokr", lokr_name)

    @classmethod
    def execute(cls, model, lokr_name: str, strength: float, scale: float = 0.0) -> io.NodeOutput:
        override = None if core.check_scale_input(scale, "scale") == 0.0 else float(scale)
        path = _files.safetensors_path("loras", lokr_name, NODE_ID)
        patched, plan = apply_lokr(model, path, strength, source=lokr_name, scale=override)
        text = report_text(plan, lokr_name, strength, override)
        payload = send_report(cls.hidden.unique_id if cls.hidden is not None else None, NODE_ID, "lokr", plan,
                              {"file": lokr_name, "strength": strength, "scale_input": override})
        return io.NodeOutput(patched, text, ui=ui_report(payload))


NODES = [DitKitLoKrLoader]
