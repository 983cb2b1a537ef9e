"""DitKitSparseAttention: VSA-H3 block-sparse attention for MiniMax H3 / FastH3 (MODEL -> MODEL).

Thin node: validates, clones the model and installs on the clone (``bridge/attention.py``)
* a :class:`~ditkit.bridge.attention.VSAHolder` template (the VSA-H3 runtime: settings + counters) in
  ``transformer_options``; each sampling run works on its own clone of it (``OUTER_SAMPLE`` wrapper, restored in
  ``finally``, where the run report is sent);
* an ``optimized_attention_override`` (chained: calls it declines go to the override that was already there,
  or to ComfyUI's backend) that runs :func:`ditkit.kernels.vsa_h3_attention` on packed DiT calls;
* a ``DIFFUSION_MODEL`` wrapper deriving the packed segment spans (ComfyUI 0.33 does not publish them) from
  the inputs exactly as ``MiniMaxH3Model._forward`` does, plus the sigma gating;
* when FastH3 ``to_gate_compress`` weights are available, ``("double_block", i)`` replaces that compute the
  gate from the block's attention input (chaining any replace already installed).
"""
from __future__ import annotations

import functools
import logging

import torch
from comfy_api.latest import io

from ..bridge.attention import VSAHolder, install, install_gate_replaces
from ..bridge.models import attention_override, inference_dtype, load_device, model_sampling
from ..bridge.hostcompat import refuse_with_block_sparse_on
from ..errors import BackendError
from ..kernels import REGISTRY
from ..kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime
from ._common import h3_diffusion_model, report_target, send_report, ui_report
from ._fasth3_evidence import choose_recipe

NODE_ID = "DitKitSparseAttention"
GATE_ATTACHMENT = "ditkit_h3_gate_compress"
BACKENDS = ["auto"] + REGISTRY.menu("block_sparse_attn")   # every registered backend, the same list everywhere
GATE_CHOICES = ["auto", "none"]
RECIPES = {"FastH3 Preview v1 (keep 10%)": 10.0, "FastH3 8-step V2 (keep 20%)": 20.0, "custom": None,
           "auto (from the checkpoint)": "auto"}   # auto: sampling/fasth3_recipe.py decides from the checkpoint
BACKEND_TOOLTIP = (
    "Fine-stage kernel. auto = the fastest exact backend that has been run and can run here (triton on sm80+ "
    "CUDA, flex for other head dims, cpu_batched on CPU). flex on CPU runs PyTorch's eager FlexAttention, which "
    "materialises the full score matrix (S x S per head: no memory or time saving; use cpu_batched or cpu_native "
    "there). cpu_native (CPU, fp32, explicit only) compiles a small C++ kernel on first use (about a minute, once, "
    "then cached; the node says so while it builds) and is faster than cpu_batched. flashinfer "
    "(sm100/103/120/121, bf16, head dim 128) is explicit only and UNVERIFIED: it has never been run on any "
    "hardware, and the report says so. comfy_kitchen never runs: comfy_kitchen has no index-driven block-sparse "
    "op (its sparse attention picks its own tiles), so choosing it raises with that reason. An explicit choice "
    "that cannot run raises instead of falling back.")
log = logging.getLogger("ditkit")


def _h3_model(model):
    return h3_diffusion_model(model, NODE_ID, "VSA-H3 needs a MiniMax H3 / FastH3 model; got {got}. Other models are "
                              "not trained for this sparse pattern; use ComfyUI's Model Sparse Attention node for them.")


def _find_gates(model, dm, choice: str):
    """-> ({block index: weight [inner, hidden]}, source text)."""
    if choice == "none":
        return {}, "none (pure sparse)"
    gates = {}
    for i, blk in enumerate(dm.blocks):
        mod = getattr(getattr(blk, "attn", None), "to_gate_compress", None)
        if mod is not None and getattr(mod, "weight", None) is not None:
            gates[i] = mod.weight
    if gates:
        return gates, "to_gate_compress (model)"
    att = model.get_attachment(GATE_ATTACHMENT) if hasattr(model, "get_attachment") else None
    if att:
        return {int(i): w for i, w in dict(att).items()}, "to_gate_compress (loader attachment)"
    return {}, "none (model has no to_gate_compress: not a FastH3 checkpoint, or a host that drops it at load) -> pure sparse"


class DitKitSparseAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="VSA-H3 Sparse Attention (ditkit)",
            category="ditkit/attention",
            description=("FastVideo-exact VSA-H3 block-sparse attention for MiniMax H3 / FastH3: 64-token tiles, "
                         "prefix (text/cond/audio) dense, top-k video tiles per query tile, trained gate-compress "
                         "branch when present. Exact backends only; the report names the backend that ran."),
            search_aliases=["vsa", "video sparse attention", "fasth3", "h3 sparse attention", "block sparse attention"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 / FastH3 model (other models are refused)."),
                io.Combo.Input("recipe", options=list(RECIPES), default="FastH3 Preview v1 (keep 10%)",
                               tooltip=("The density the checkpoint was trained at: FastH3 Preview v1 keeps 10% of "
                                        "video tiles, FastH3 8-step V2 keeps 20%. 'custom' uses keep_percent. "
                                        "'auto' takes it from the checkpoint (its fastvideo_inference.json, "
                                        "provenance.json, file metadata or name, trained to_gate_compress) and "
                                        "says why; refused when the checkpoint does not say. An explicit choice "
                                        "that contradicts the checkpoint runs and is reported as an override.")),
                io.Float.Input("keep_percent", default=10.0, min=0.5, max=100.0, step=0.5,
                               tooltip="Percent of video key tiles kept per video query tile (recipe 'custom' only)."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Steps before this fraction of the schedule run dense."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Steps after this fraction of the schedule run dense."),
                io.Combo.Input("backend", options=BACKENDS, default="auto", tooltip=BACKEND_TOOLTIP),
                io.Int.Input("min_tokens", default=0, min=0, max=1 << 20, step=64,
                             tooltip="Packed sequences shorter than this run dense (sparse overhead dominates)."),
                io.Combo.Input("gate", options=GATE_CHOICES, default="auto", advanced=True,
                               tooltip=("auto: use the checkpoint's to_gate_compress when the model carries it, "
                                        "else pure sparse (FastVideo H3 semantics); none: pure sparse.")),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with VSA-H3 attention installed.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, recipe: str = "FastH3 Preview v1 (keep 10%)", keep_percent: float = 10.0,
                start_percent: float = 0.0, end_percent: float = 1.0, backend: str = "auto", min_tokens: int = 0,
                gate: str = "auto") -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        dm = _h3_model(model)
        if recipe not in RECIPES:
            raise BackendError(f"{NODE_ID}: unknown recipe {recipe!r}; choose one of {list(RECIPES)}")
        if backend not in BACKENDS:
            raise BackendError(f"{NODE_ID}: unknown backend {backend!r}; choose one of {BACKENDS}")
        if gate not in GATE_CHOICES:
            raise BackendError(f"{NODE_ID}: unknown gate option {gate!r}; choose one of {GATE_CHOICES}")
        if start_percent > end_percent:
            raise BackendError(f"{NODE_ID}: start_percent {start_percent} is after end_percent {end_percent}")
        rc = choose_recipe(model, len(dm.blocks), _find_gates(model, dm, "auto"), RECIPES[recipe], recipe,
                           keep_percent, f"{NODE_ID}: recipe")
        pct = rc.keep_percent
        keep = pct / 100.0
        ms = model_sampling(model)
        cfg = VSAH3Config(keep=keep, sparsity=rc.sparsity,
                          sigma_start=float(ms.percent_to_sigma(start_percent)),
                          sigma_end=float(ms.percent_to_sigma(end_percent)),
                          backend=None if backend == "auto" else backend, min_tokens=int(min_tokens))
        if cfg.backend is not None:
            # refuse an explicit backend that cannot run on the model's device now, not mid-sampling
            REGISTRY.resolve("block_sparse_attn", load_device(model), inference_dtype(model, torch.float32),
                             dm.blocks[0].attn.head_dim, cfg.backend)
            if cfg.backend == "cpu_native":
                # build (first time) / load the C++ kernel now, so a missing compiler is an error here
                from ..kernels.block_sparse_cpu_native import load_extension

                try:
                    load_extension()
                except RuntimeError as e:
                    raise BackendError(f"{NODE_ID}: backend 'cpu_native' cannot run here: {e}. Pick another "
                                       "backend explicitly or use 'auto'.") from e

        # the run report is sent while the sampler executes, maybe in a later prompt that got this output from
        # ComfyUI's cache under another node id: resolved then (nodes/_common.py)
        target = report_target(node_id, NODE_ID)
        m = model.clone()
        gates, gate_src = _find_gates(m, dm, gate)
        holder = VSAHolder(VSAH3Runtime(cfg, gate_source=gate_src), functools.partial(_send_run_report, target))
        refuse_with_block_sparse_on(m, NODE_ID)
        prev = attention_override(m)
        if getattr(prev, "_ditkit_vsa", False):
            raise BackendError(f"{NODE_ID}: this model already has VSA-H3 installed by another "
                               f"{NODE_ID} node; use one (chain the node once, after other attention nodes)")
        prev_name = getattr(prev, "__qualname__", type(prev).__name__) if prev is not None else None

        install(m, holder, prev)
        if gates:
            install_gate_replaces(m, dm, gates)

        unverified = REGISTRY.unverified("block_sparse_attn", backend) if cfg.backend is not None else None
        shown = backend + (f" (chosen explicitly, UNVERIFIED: never run on any hardware: {unverified})"
                           if unverified else "")
        summary = (f"VSA-H3 installed: keep {keep * 100:g}% of video tiles (recipe {recipe}), backend {shown}, "
                   f"sigma window [{cfg.sigma_end:.4g}, {cfg.sigma_start:.4g}], min_tokens {min_tokens}, "
                   f"gate {gate_src}" + (f"; chains previous attention override {prev_name} for dense calls"
                                         if prev is not None else "") + f"; {rc.summary()}")
        data = {"keep": keep, "vsa_sparsity": cfg.sparsity, "recipe": recipe, "backend": backend,
                "backend_unverified": unverified, "gate": gate_src, "chained_override": prev_name,
                "recipe_choice": rc.as_dict(),
                "backends_here": REGISTRY.explain("block_sparse_attn", load_device(model), torch.float32,
                                                  dm.blocks[0].attn.head_dim)}
        payload = send_report(node_id, NODE_ID, "install", summary, data)
        return io.NodeOutput(m, ui=ui_report(payload))


def _send_run_report(target, rt: VSAH3Runtime) -> None:
    target.send("run", *_run_report(rt))   # the node's sink (bridge/reports.ReportTarget), as for every feature


def _run_report(rt: VSAH3Runtime) -> tuple[str, dict]:
    """The runtime's summary and data, plus which backends that ran are unverified (never run anywhere before)."""
    summary, data = rt.summary(), rt.as_dict()
    unverified = {b: r for b in data.get("backends_used", {}) if (r := REGISTRY.unverified("block_sparse_attn", b))}
    data["unverified_backends"] = unverified
    if unverified:
        summary += (f"; UNVERIFIED backend {', '.join(unverified)} (chosen explicitly; never run on any hardware "
                    "before this run: check its output)")
    return summary, data


NODES = [DitKitSparseAttention]
