"""DitKitTeaCache / DitKitTeaCacheCalibrate: calibrated TeaCache for MiniMax H3, LTX-2, Z-Image and FLUX.2.

Schema, input checks, clone, install: what is installed on the clone (per-run holders, wrappers, block replaces) and
where coefficient files live is ``bridge/teacache.py``; the decisions, fit and file format are ``cache/``.
"""
from __future__ import annotations

import os

from comfy_api.latest import io

from ..bridge import teacache as tc
from ..bridge.teacache import (available_coefficients, build_state, locate_coefficients,  # noqa: F401
                               model_fingerprint, resolve_coefficients)
from ..bridge.blocks import CALL_KEY
from ..cache import coefficients as coef
from ..errors import CoefficientError
from ._common import report_target, send_report, ui_report
from . import _choices

# node ids as literals here (the layering test reads them from this file); bridge/teacache.py names them in messages
NODE_TEACACHE = "DitKitTeaCache"
NODE_CALIBRATE = "DitKitTeaCacheCalibrate"
assert (NODE_TEACACHE, NODE_CALIBRATE) == (tc.NODE_TEACACHE, tc.NODE_CALIBRATE)


class DitKitTeaCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_TEACACHE,
            display_name="TeaCache Step Cache (ditkit)",
            category="ditkit/cache",
            description=("Skips the transformer block stack on steps where the calibrated, rescaled change of the "
                         "timestep-modulated input stays below a threshold, reusing the cached residual. Per-stream "
                         "metrics for H3 / LTX-2 video and audio (audio can veto a skip). Needs a coefficient file "
                         "from DitKitTeaCacheCalibrate (or a shipped one) and warns when the run does not "
                         "match the file's fingerprint. A real model needs its own calibration: the shipped files are "
                         "for the tiny example H3 / quality-lab H3, or borrowed from another model. Experimental: "
                         "skip quality was measured on the quality-lab H3 and the tiny test models only, never on a "
                         "full-size checkpoint."),
            search_aliases=["teacache", "tea cache", "step cache", "skip steps", "speedup", "cache apply"],
            is_experimental=True,
            inputs=[
                io.Model.Input("model", tooltip="MiniMax H3, LTX-2 (audio-video), Z-Image or FLUX.2 model."),
                io.Combo.Input("coefficients", options=_choices.coefficient_choices(), tooltip=(
                    "Coefficient file: your calibrated files in <output>/ditkit/teacache/ (written by TeaCache "
                    "Calibrate Coefficients; press R to refresh this list after a calibration), then the shipped "
                    "ones: shipped:h3_tiny_calibrated (fitted on ditkit's tiny example H3, for the examples only), "
                    "shipped:h3lab_calibrated (fitted on the quality-lab H3 in benchmarks/lab), "
                    "shipped:flux2_borrowed_flux1_dev and shipped:zimage_borrowed_qwen_image (borrowed from other "
                    "models). A real model needs its own calibration. A name of a file that a TeaCache Calibrate "
                    "node in the same workflow writes is accepted too. Files outside that folder are refused "
                    "(also through '..' or symlinks): copy them into it.")),
                io.Float.Input("threshold", default=0.2, min=0.0, max=5.0, step=0.01, tooltip=(
                    "Accumulated rescaled change below which the block stack is skipped (video / image stream). "
                    "Higher = more skips, lower quality. 0 disables skipping (every call computes).")),
                io.Float.Input("audio_threshold", default=0.2, min=0.0, max=5.0, step=0.01, tooltip=(
                    "Threshold of the audio stream (H3, LTX-2). A skip needs every stream below its threshold, so "
                    "the audio stream vetoes skips that would damage audio. Ignored for image models.")),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01, advanced=True,
                               tooltip="Fraction of the sampling steps before which every step is computed."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01, advanced=True,
                               tooltip="Fraction of the sampling steps after which every step is computed (the first and last step always are)."),
                io.Combo.Input("cache_device", options=["model", "cpu"], default="model", advanced=True, tooltip=(
                    "Where cached residuals live: on the model's device (fast) or in CPU RAM (saves VRAM, one copy per skipped step).")),
                io.Boolean.Input("strict", default=False, advanced=True, tooltip=(
                    "Fail instead of warning when the model weights, steps, schedule, sampler, guidance or shifts "
                    "differ from what the coefficient file was calibrated on.")),
            ],
            outputs=[io.Model.Output(tooltip="The model with TeaCache installed (the input model is not modified).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, coefficients=None):
        """Any name passes prompt validation (not only the listed ones): a workflow saved when this input was a
        text field, or naming a file a calibration in the same prompt writes, must still queue; execute checks the
        name (only files inside ditkit's TeaCache folders) and reports a missing one on this node. An API prompt
        without the input gets the host's "required input missing" naming it (never a TypeError from here)."""
        if coefficients is None:
            return f"{NODE_TEACACHE}: required input 'coefficients' is missing (a TeaCache coefficient file name)"
        return True

    @classmethod
    def fingerprint_inputs(cls, coefficients="", **kwargs):
        """Re-execute when the coefficient file changes on disk (e.g. after a new calibration)."""
        return tc.coefficients_signature(coefficients)

    @classmethod
    def execute(cls, model, coefficients, threshold, audio_threshold, start_percent, end_percent, cache_device,
                strict) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        if end_percent < start_percent:
            raise CoefficientError(f"{NODE_TEACACHE}: end_percent {end_percent} < start_percent {start_percent}")
        family = tc.detect_family(model)
        tc.check_not_stacked(model, NODE_TEACACHE)
        params = {"spec": coefficients, "threshold": threshold, "audio_threshold": audio_threshold,
                  "start_percent": start_percent, "end_percent": end_percent, "cache_device": cache_device,
                  "strict": strict, "family": family, "model_fp": tc.model_fingerprint(model), "node_id": node_id,
                  "report_to": report_target(node_id, NODE_TEACACHE)}  # resolved at sampling (nodes/_common.py)
        holder, summary, data = tc.teacache_holder(model, params)
        m = model.clone()
        tc.install(m, holder, tc.teacache_sample_wrapper)
        payload = send_report(node_id, NODE_TEACACHE, "teacache_install", summary, data)
        return io.NodeOutput(m, ui=ui_report(payload))


class DitKitTeaCacheCalibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_CALIBRATE,
            display_name="TeaCache Calibrate Coefficients (ditkit)",
            category="ditkit/cache",
            description=("Records, during normal full-compute sampling, per step and per stream the relative change of "
                         "the modulated input and of the block-stack output, and fits the TeaCache polynomial once "
                         "enough distinct prompts were run. Writes <output>/ditkit/teacache/<name>.json, which then "
                         "appears in the coefficients list of TeaCache Step Cache. Does not speed anything up. "
                         "Experimental like TeaCache Step Cache (fits checked on the quality-lab H3 and tiny models only)."),
            search_aliases=["teacache calibration", "fit teacache coefficients", "calibrate coefficients"],
            is_experimental=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to calibrate (H3, LTX-2, Z-Image or FLUX.2). Sampling is not changed."),
                io.String.Input("name", default="my_model", tooltip=(
                    "Name of the coefficient file (<output>/ditkit/teacache/<name>.json); pair files go to <name>/. "
                    "Letters, digits, '-', '_' and '.' only.")),
                io.Int.Input("degree", default=4, min=1, max=coef.MAX_DEGREE, tooltip="Polynomial degree of the fit (TeaCache uses 4)."),
                io.Int.Input("min_prompts", default=3, min=1, max=10000, tooltip=(
                    "Distinct prompts (recorded runs with the same model, sampler, steps and schedule) needed before "
                    "the coefficient file is written. More prompts = a more stable fit (>= 50 recommended for production).")),
            ],
            outputs=[io.Model.Output(tooltip="The model with the calibration recorder installed (sampling output unchanged).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, name, degree, min_prompts) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        name = tc.calibration_name(name)
        tc.check_calibration_target(name)   # before sampling: a name problem must not cost the run
        family = tc.detect_family(model)
        tc.check_not_stacked(model, NODE_CALIBRATE)
        mfp = tc.model_fingerprint(model)
        holder = tc.calibration_holder(family, {"node_id": node_id, "report_to": report_target(node_id, NODE_CALIBRATE),
                                                "name": name, "degree": int(degree), "min_prompts": int(min_prompts),
                                                "model_fp": mfp})
        m = model.clone()
        tc.install(m, holder, tc.calibrate_sample_wrapper)
        summary = (f"TeaCache calibration recorder on {coef.FAMILY_NAMES[family]}: '{name}', degree {degree}, "
                   f"fits after {min_prompts} distinct prompts; output {os.path.join(tc.teacache_dir(), name + '.json')}")
        payload = send_report(node_id, NODE_CALIBRATE, "teacache_calibration_install", summary,
                              {"family": family, "name": name, "model": mfp})
        return io.NodeOutput(m, ui=ui_report(payload))


NODES = [DitKitTeaCache, DitKitTeaCacheCalibrate]

__all__ = ["NODES", "DitKitTeaCache", "DitKitTeaCacheCalibrate", "CALL_KEY"]
