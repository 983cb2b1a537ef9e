"""DitKitAdapterLoader: any MiniMax H3 adapter (LoRA / LoKr / LoHa in every trainer's naming, FastVideo
``fastvideo-lora-v2`` FastH3 adapters, curve-form AdaLN sets) exactly onto ComfyUI's H3 weights; Z-Image / FLUX.2
LoKr through the shared LoKr core (the same path as DitKitLoKrLoader).

The core (``loaders/h3_adapters.py``) parses, maps, decides the qkv layout and the scales and validates; this node
clones the model and registers one lazy patch per module with ``ModelPatcher.add_patches`` (row offsets for
``to_q/to_k/to_v`` thirds of the fused qkv). The patch is a ``WeightAdapterBase`` that ComfyUI's
``lora.calculate_weight`` calls when it patches a weight: ΔW is added chunk by chunk by ``kernels/delta_fuse.py``,
so strength changes, unpatching and dynamic VRAM work as for ComfyUI's own LoRAs. Assigned FastH3 gates
(``to_gate_compress.set_weight``) replace the clone's gate attachment, which DitKitSparseAttention reads.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge.adapters import MODES, DitKitAdapterPatch, apply_h3_adapter  # noqa: F401
from ..bridge.lokr import apply_lokr
from ..bridge.models import is_h3
from ..errors import AdapterError
from ..loaders import h3_adapters as core
from ..loaders.h3_turbo_curve import CKPT_INPUT, GRID_INPUT
from . import _files
from ._common import adapter_report_lines, send_report, ui_report
from .lokr import report_text as lokr_report_text

NODE_ID = "DitKitAdapterLoader"
NONE = "none"


def report_text(plan: core.Plan, file: str, strength: float, scale: float | None, qkv_layout: str) -> str:
    lines = [f"{plan.summary()} | file {file}, strength {strength:g}, qkv_layout input {qkv_layout}"
             + (f", scale {scale:g} (node input)" if scale is not None else ", scale from the file"),
             f"qkv layout: {plan.layout} ({plan.layout_reason})"]
    for it in plan.items:
        lines.append("applied " + it.describe())
    for i in sorted(plan.gates):
        lines.append(f"assigned sparse-attention gate of block {i} (to_gate_compress.set_weight)")
    for c in plan.curve:
        lines.append("applied " + c.describe())
    return "\n".join(lines + adapter_report_lines(plan))


class DitKitAdapterLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="Adapter Loader (ditkit)",
            category="ditkit/loaders",
            description=("Applies a MiniMax H3 adapter exactly onto ComfyUI's H3 weights, whatever layout the base was "
                         "loaded from: ComfyUI, PEFT / DiffSynth-Studio, diffusers, kohya / musubi-tuner, LyCORIS LoKr / "
                         "LoHa naming, FastVideo fastvideo-lora-v2 (FastH3: .diff, .set_weight, VSA gates) and "
                         "curve-form AdaLN adapters. Decides the qkv row layout the adapter was trained on, reports "
                         "every key. On Z-Image / FLUX.2 it applies LoKr files like DitKitLoKrLoader."),
            search_aliases=["h3 lora", "minimax h3 lora", "fasth3 adapter", "diffsynth lora", "lora loader h3",
                            "h3 lokr", "adapter loader"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 model (any layout DitKitH3ModelLoader or UNETLoader "
                                                "loads), or a Z-Image / FLUX.2 model for LoKr files."),
                io.Combo.Input("adapter_name", options=_files.safetensors_files("loras"),
                               tooltip="Adapter file (.safetensors) in models/loras. A PEFT adapter_model.safetensors "
                                       "takes its adapter_config.json from the same folder."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="Multiplier on ΔW (after the adapter's own alpha/rank scale). Assigned weights "
                                       "(.set_weight) become W_base + strength * (W_new - W_base)."),
                io.Combo.Input("qkv_layout", options=list(core.QKV_LAYOUTS), default="auto", optional=True,
                               tooltip="Row layout of the fused qkv_proj the adapter was trained on. auto: decided from "
                                       "the file as diffusers' H3 converter does (to_q/to_k/to_v: no question; "
                                       "DiffSynth '.default.' naming: interleaved; diffusion_model.* / no prefix / "
                                       "lora_unet_*: contiguous); PEFT base_model.model.* and lycoris_* files are "
                                       "refused until you choose. interleaved = official per-head [h0: q,k,v; ...], "
                                       "contiguous = ComfyUI [q_all; k_all; v_all]."),
                io.Float.Input("scale", default=0.0, min=-1000.0, max=1000.0, step=0.001, round=0.000001,
                               optional=True,
                               tooltip="0 = from the file (alpha/rank, PEFT lora_alpha/r, or the trainer's documented "
                                       "convention; the report names which). Any other value replaces the alpha/rank "
                                       "scale of every low-rank module: set it when the loader says the file does "
                                       "not determine the scale."),
                io.Combo.Input("mode", options=list(MODES), default="fuse", optional=True,
                               tooltip="fuse: the adapter is added into the weights (quantized layers requantized "
                                       "exactly in their own format). bypass: the weights stay untouched and the "
                                       "adapter runs beside each layer at run time, y = base(x) + s·ΔW x (no "
                                       "requantization error, no weight copy: for nvfp4 and stacks of LoRAs). H3 only."),
                io.Combo.Input(GRID_INPUT, options=[NONE] + _files.safetensors_files("loras"), default=NONE,
                               optional=True,
                               tooltip="Turbo LoRAs on a pruned (curve-form) base only: a grid file in models/loras "
                                       "holding silu_t_emb_grid [grid, D] (silu(t_emb) at t = i/(grid-1), optional "
                                       "t_grid) so the LoRA's AdaLN pairs are applied exactly as extra curve columns. "
                                       "none: not used (a Turbo LoRA on a pruned base is then refused)."),
                io.Combo.Input(CKPT_INPUT, options=[NONE] + _files.safetensors_files("diffusion_models"),
                               default=NONE, optional=True,
                               tooltip="Turbo LoRAs on a pruned (curve-form) base only: the UNPRUNED checkpoint of the "
                                       "same model (only its time_embedder is read) to compute silu(t_emb) on the "
                                       "base's grid, instead of a grid file. none: not used."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with the adapter patches registered."),
                     io.String.Output(display_name="report",
                                      tooltip="Modules applied (target, scale, layout), keys unused, with why.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, adapter_name: str, strength: float, qkv_layout: str = "auto",
                scale: float = 0.0, mode: str = "fuse", silu_t_emb_grid: str = "none",
                time_embedder_checkpoint: str = "none") -> io.NodeOutput:
        from ..loaders import lokr_apply as lokr_core

        override = None if lokr_core.check_scale_input(scale, "scale") == 0.0 else float(scale)
        lokr_core.check_scale_input(strength, "strength")
        if qkv_layout not in core.QKV_LAYOUTS:
            raise AdapterError(f"{NODE_ID}: qkv_layout {qkv_layout!r} is not one of {list(core.QKV_LAYOUTS)}")
        path = _files.safetensors_path("loras", adapter_name, NODE_ID)
        uid = cls.hidden.unique_id if cls.hidden is not None else None
        if mode not in MODES:
            raise AdapterError(f"{NODE_ID}: mode {mode!r} is not one of {list(MODES)}")
        grid = None if silu_t_emb_grid in (NONE, "", None) else _files.safetensors_path("loras", silu_t_emb_grid, NODE_ID)
        ckpt = (None if time_embedder_checkpoint in (NONE, "", None)
                else _files.safetensors_path("diffusion_models", time_embedder_checkpoint, NODE_ID))
        if not is_h3(model):
            if grid or ckpt:
                raise AdapterError(f"{NODE_ID}: '{GRID_INPUT}' / '{CKPT_INPUT}' apply to MiniMax H3 Turbo LoRAs on a "
                                   "curve-form base only; this model is not H3 (set them to none)")
            if mode != "fuse":
                raise AdapterError(f"{NODE_ID}: mode {mode!r} applies to MiniMax H3 models only; this model is not H3 "
                                   "(use mode fuse for Z-Image / FLUX.2 LoKr)")
            if qkv_layout != "auto":
                raise AdapterError(f"{NODE_ID}: qkv_layout {qkv_layout!r} applies to MiniMax H3 models only; this model "
                                   "is not H3 (leave it on auto for Z-Image / FLUX.2 LoKr)")
            patched, lplan = apply_lokr(model, path, strength, source=adapter_name, scale=override)
            text = lokr_report_text(lplan, adapter_name, strength, override)
            payload = send_report(uid, NODE_ID, "adapter", lplan.summary(),
                                  {**lplan.as_dict(), "file": adapter_name, "strength": strength, "scale_input": override})
            return io.NodeOutput(patched, text, ui=ui_report(payload))
        patched, plan = apply_h3_adapter(model, path, strength, adapter_name, qkv_layout, override, mode, grid, ckpt,
                                         silu_t_emb_grid, time_embedder_checkpoint)
        text = report_text(plan, adapter_name, strength, override, qkv_layout)
        payload = send_report(uid, NODE_ID, "adapter", plan.summary(),
                              {**plan.as_dict(), "file": adapter_name, "strength": strength, "scale_input": override,
                               "qkv_layout_input": qkv_layout, "mode": mode, GRID_INPUT: silu_t_emb_grid,
                               CKPT_INPUT: time_embedder_checkpoint})
        return io.NodeOutput(patched, text, ui=ui_report(payload))


NODES = [DitKitAdapterLoader]
