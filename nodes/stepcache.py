"""DitKitStepCache: calibration-free step caches for MiniMax H3, LTX-2, Z-Image and FLUX.2 (first-block residual,
sigma schedule). A node of its own rather than a ``mode`` input on DitKitTeaCache: DitKitTeaCache's required
``coefficients`` input and its threshold scale (rescaled, accumulated distance) mean nothing here, and shipped
workflows of DitKitTeaCache must keep their meaning. Hooks: ``bridge/stepcache.py``; decisions: ``cache/stepcache.py``.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge import stepcache as sc
from ..bridge import teacache as tc
from ..cache.stepcache import DEFAULT_THRESHOLDS, MODES
from ..errors import DitKitError
from ._common import report_target, send_report, ui_report

NODE_STEPCACHE = "DitKitStepCache"   # literal here (the layering test reads node ids from node files)
assert NODE_STEPCACHE == sc.NODE_STEPCACHE

_FB, _SG = DEFAULT_THRESHOLDS["first_block"], DEFAULT_THRESHOLDS["sigma_schedule"]


class DitKitStepCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_STEPCACHE,
            display_name="Step Cache First-Block / Sigma (ditkit)",
            category="ditkit/cache",
            description=("Skips transformer blocks on steps where little changes, without a coefficient file. "
                         "first_block: block 0 always runs; when its output residual changed less than the threshold "
                         "(relative L1, per stream) since the last computed step, the other blocks are skipped and "
                         "their cached residual reused. sigma_schedule: which steps compute is decided from the sigma "
                         "schedule alone (deterministic, the same on every GPU). Video and audio are measured "
                         "separately; the audio stream can veto a skip. Calibrated TeaCache (DitKitTeaCache) is the "
                         "upgrade when you can calibrate. Experimental: defaults chosen on the quality-lab H3."),
            search_aliases=["first block cache", "fbcache", "firstblockcache", "block cache", "sigma cache",
                            "calibration-free cache"],
            is_experimental=True,
            inputs=[
                io.Model.Input("model", tooltip="MiniMax H3, LTX-2 (audio-video), Z-Image or FLUX.2 model."),
                io.Combo.Input("mode", options=list(MODES), default="first_block", tooltip=(
                    "first_block: measure block 0's output change per step (adapts to the prompt; one extra block "
                    "per skipped step). sigma_schedule: decide from the sigma schedule only (no measurement; the "
                    "same plan on every GPU and every prompt).")),
                io.Float.Input("threshold", default=-1.0, min=-1.0, max=5.0, step=0.005, tooltip=(
                    "Video / image stream. first_block: relative L1 change of block 0's residual below which the "
                    "other blocks are skipped. sigma_schedule: sigma distance to the last computed step below which "
                    f"a step reuses. Higher = more skips. -1 = the lab default of the mode (first_block {_FB['video']},"
                    f" sigma_schedule {_SG['video']}), named in the report. 0 = never skip.")),
                io.Float.Input("audio_threshold", default=-1.0, min=-1.0, max=5.0, step=0.005, tooltip=(
                    "Audio stream (H3, LTX-2); a skip needs every stream below its threshold, so a lower audio "
                    f"threshold protects audio. -1 = the lab default (first_block {_FB['audio']}, sigma_schedule "
                    f"{_SG['audio']}). Ignored for image models.")),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01, advanced=True,
                               tooltip="Fraction of the sampling steps before which every step is computed."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01, advanced=True, tooltip=(
                    "Fraction of the sampling steps after which every step is computed (the first and the last "
                    "step always are).")),
                io.Combo.Input("cache_device", options=["model", "cpu"], default="model", advanced=True, tooltip=(
                    "Where cached residuals live: on the model's device (fast) or in CPU RAM (saves VRAM).")),
            ],
            outputs=[io.Model.Output(tooltip="The model with the step cache installed (the input is not modified).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, mode, threshold, audio_threshold, start_percent, end_percent,
                cache_device) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        if mode not in MODES:
            raise DitKitError(f"{NODE_STEPCACHE}: input 'mode' {mode!r} is not one of {list(MODES)}")
        if cache_device not in ("model", "cpu"):
            raise DitKitError(f"{NODE_STEPCACHE}: input 'cache_device' {cache_device!r} is not 'model' or 'cpu'")
        family = tc.detect_family(model)
        params = {"mode": mode, "threshold": float(threshold), "audio_threshold": float(audio_threshold),
                  "start_percent": float(start_percent), "end_percent": float(end_percent),
                  "cache_device": cache_device, "node_id": node_id,
                  "report_to": report_target(node_id, NODE_STEPCACHE)}
        holder, summary, data = sc.stepcache_holder(family, params)
        tc.check_not_stacked(model, NODE_STEPCACHE)
        m = model.clone()
        sc.install(m, holder)
        payload = send_report(node_id, NODE_STEPCACHE, "stepcache_install", summary, data)
        return io.NodeOutput(m, ui=ui_report(payload))


NODES = [DitKitStepCache]

__all__ = ["NODES", "DitKitStepCache"]
