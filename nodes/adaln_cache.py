"""DitKitH3AdaLNCache: precomputed AdaLN modulation tables for MiniMax H3 (core: ``cache/adaln.py``).

Installed on a clone through ComfyUI hooks only: one object patch per ``adaln_proj`` module (a lookup module
with the same ``linear`` child, so weight patches keyed ``...adaln_proj.linear.*`` still resolve), a holder in
``transformer_options`` cloned per sampling run by an OUTER_SAMPLE wrapper (validates the schedule, captures the
patch identity, reports per run, restores in ``finally``) and a DIFFUSION_MODEL wrapper (builds/installs the
tables for the run before the first forward); holder and wrappers are ``bridge/adaln.py``.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge import adaln as bridge
from ..bridge.models import h3_diffusion_model, model_object
from ..errors import UnsupportedModelError
from ..cache.adaln import AdalnScheduleCache, CachedAdalnProj
from ._common import report_target, send_report, ui_report

NODE_ID = "DitKitH3AdaLNCache"
WRAPPER_KEY = bridge.WRAPPER_KEY


def _h3_model(model):
    return h3_diffusion_model(model, NODE_ID, "the MODEL input is {got}, not a MiniMax H3 diffusion model. Connect an "
                              "H3 model (UNETLoader / DitKit H3 loader); nothing was changed.")


class DitKitH3AdaLNCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=NODE_ID,
            display_name="H3 AdaLN Cache (ditkit)",
            category="ditkit/cache",
            description=("Precomputes MiniMax H3's AdaLN modulation for the sampling schedule and looks it up "
                         "instead of running the 13 B-parameter AdaLN projections every step. Bit-identical to "
                         "the uncached model; the AdaLN weights can leave the GPU while tables are installed."),
            search_aliases=["adaln", "modulation cache", "h3 offload", "minimax h3 adaln", "schedule cache"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 diffusion model (full or curve-form AdaLN)."),
                io.Boolean.Input("offload_weights", default=True,
                                 tooltip="Move the AdaLN projection weights to pinned host memory while the "
                                         "tables are installed (they come back for a rebuild or a miss). "
                                         "No effect on CPU or under dynamic VRAM (reported)."),
            ],
            outputs=[io.Model.Output(tooltip="The model with AdaLN schedule tables installed (a clone).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, offload_weights=True) -> io.NodeOutput:
        dm = _h3_model(model)
        keys = [f"diffusion_model.blocks.{i}.adaln_proj" for i in range(len(dm.blocks))]
        keys.append("diffusion_model.final_layer.adaln_proj")
        originals = [model_object(model, k) for k in keys]
        if any(isinstance(o, CachedAdalnProj) for o in originals):
            raise UnsupportedModelError(f"{NODE_ID}: this model already has AdaLN schedule tables installed "
                                        "(the node is applied twice on the same path); remove one of them.")
        m = model.clone()
        cache = AdalnScheduleCache()
        bridge.wrap_projections(m, cache, keys, originals)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        info = bridge.install(m, cache, dm, report_target(node_id, NODE_ID), bool(offload_weights))
        wbytes = sum(p.numel() * p.element_size() for o in originals for p in o.linear.parameters())
        summary = (f"installed on {len(keys)} AdaLN projections ({wbytes / 2**20:.3f} MiB of weights, "
                   f"{'curve' if dm.use_adaln_curves else 'full'} form); tables are built when sampling starts "
                   f"[{info['park_mode']}]")
        payload = send_report(node_id, NODE_ID, "adaln_cache", summary,
                              {"modules": len(keys), "weight_bytes": wbytes, "curve_form": dm.use_adaln_curves,
                               **info})
        return io.NodeOutput(m, ui=ui_report(payload))


NODES = [DitKitH3AdaLNCache]
