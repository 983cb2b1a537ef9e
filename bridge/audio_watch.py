"""The audio guard during sampling, for every cache and schedule node of the pack (core:
``cache/audio_guard.AudioTrajectoryMonitor``).

A node's ``OUTER_SAMPLE`` wrapper calls :func:`watch` with its executor arguments: the sampler's step callback
(``CFGGuider.outer_sample``'s ``callback``, position 5, called by ComfyUI's ``KSAMPLER`` once per step with the
denoised estimate of the flat latent pack) is wrapped so that each step's audio part (``comfy.utils.unpack_latents``
with the run's ``latent_shapes``: part 1 of an (video, audio) pack) goes to the monitor before the original
callback runs. After the run :meth:`AudioWatch.finish` returns the figures for the node's report: the sampled audio
latent's NaN / Inf count and the trajectory check (:class:`~ditkit.cache.audio_guard.AudioTrajectoryReport`).
Runs without an audio part (image models, video-only latents) are not watched (``watch`` returns None).

The verdict is also kept for the save node (:func:`remember`, :func:`upstream_verdicts`): under the signature of the
sampler node that ran (the node ComfyUI is executing), so ``DitKitSaveVideo`` finds the verdicts of the samplers
its audio input descends from (in this prompt, or a later one that takes their cached output).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..cache.audio_guard import AudioTrajectoryMonitor
from .reports import _executing, _is_link, _ordered_ancestry, current_graph, node_signature

CALLBACK_POS = 5          # CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, denoise_mask, callback, ...)
_VERDICTS: "OrderedDict[str, dict]" = OrderedDict()
_MAX_VERDICTS = 64


def audio_part(packed, latent_shapes):
    """The audio part of a flat (video, audio) pack, or None when the run has no second latent."""
    if not latent_shapes or len(latent_shapes) < 2 or not torch.is_tensor(packed):
        return None
    import comfy.utils

    return comfy.utils.unpack_latents(packed, latent_shapes)[1]


def latent_check(out, latent_shapes) -> dict | None:
    """The sampled audio latent's figures (``nonfinite`` count, ``shape``) from what the sampler returns inside
    ``OUTER_SAMPLE`` (the flat pack); None when there is no audio part."""
    a = audio_part(out, latent_shapes)
    if a is None:
        return None
    return {"nonfinite": int((~torch.isfinite(a)).sum()), "shape": list(a.shape)}


class AudioWatch:
    """One sampling run's audio check (see the module docstring)."""

    def __init__(self, latent_shapes, family: str = "h3"):
        self.latent_shapes = latent_shapes
        # LTX-2's audio latent is [B, C, T, F] (time on axis 2); H3's keeps time last
        self.monitor = AudioTrajectoryMonitor(time_dim=2 if family == "ltx2" else -1)
        self.error: str | None = None

    def wrap(self, callback):
        def watched(step, x0, x, total_steps):
            a = audio_part(x0, self.latent_shapes)
            if a is not None and self.error is None:
                try:
                    self.monitor.observe(a)
                except ValueError as e:       # a shape the check cannot read: reported, never a failed sampling
                    self.error = str(e)
            if callback is not None:
                return callback(step, x0, x, total_steps)
            return None

        return watched

    def finish(self, latent_check: dict | None) -> dict | None:
        """The run's ``audio_latent`` report entry: ``latent_check`` (the sampled audio latent's figures,
        :func:`~ditkit.bridge.teacache.audio_latent_check`: ``nonfinite``, ``shape``) with the trajectory check
        (``trajectory``), ``clean`` (both) and ``summary`` added; None without an audio part."""
        if latent_check is None:
            return None
        rep = self.monitor.report()
        traj = rep.as_dict()
        if self.error is not None:
            traj["error"] = self.error
        out = dict(latent_check)
        out.update(trajectory=traj, clean=rep.clean and not latent_check["nonfinite"], summary=rep.summary())
        return out


def watch(args: tuple, kwargs: dict, family: str = "h3") -> tuple[tuple, AudioWatch | None]:
    """``(args, watch)``: the executor arguments with the step callback wrapped, and the run's watch; the arguments
    unchanged and None when the run has no audio latent."""
    shapes = kwargs.get("latent_shapes")
    if not shapes or len(shapes) < 2 or len(args) <= CALLBACK_POS:
        return args, None
    w = AudioWatch(shapes, family)
    args = tuple(args[:CALLBACK_POS]) + (w.wrap(args[CALLBACK_POS]),) + tuple(args[CALLBACK_POS + 1:])
    return args, w


def summary_suffix(result: dict | None) -> str:
    """The text a run report appends (empty when clean or not watched)."""
    if result is None:
        return ""
    parts = []
    if result["nonfinite"]:
        parts.append(f"WARNING: sampled audio latent has {result['nonfinite']} NaN/Inf values")
    if not result.get("trajectory", {}).get("clean", True):
        parts.append("WARNING: " + result["summary"])
    return "".join(f" | {p}" for p in parts)


def remember(node_type: str, node_id, result: dict | None) -> None:
    """Keep the run's audio verdict under the signature of the sampler node executing now (for the save node)."""
    if result is None:
        return
    pid, executing = _executing()
    view = current_graph(pid) if pid is not None else None
    if view is None or executing is None:
        return
    sig = node_signature(view[0], str(executing))
    if sig is None:
        return
    _VERDICTS[sig] = {"by": f"{node_type} #{node_id}", "sampler": str(executing), "clean": result["clean"],
                      "summary": result["summary"], "nonfinite": result["nonfinite"]}
    _VERDICTS.move_to_end(sig)
    while len(_VERDICTS) > _MAX_VERDICTS:
        _VERDICTS.popitem(last=False)


def upstream_verdicts(node_id, input_name: str = "audio") -> list[dict]:
    """The sampling-time audio verdicts of the sampler nodes that ``node_id``'s ``input_name`` descends from, in the
    prompt executing now ([] when the graph cannot be read or none was recorded)."""
    view = current_graph()
    if view is None or node_id is None:
        return []
    get = view[0]
    link = ((get(str(node_id)) or {}).get("inputs") or {}).get(input_name)
    if link is None or not _is_link(link):
        return []
    src = str(link[0])
    out = []
    for nid in [src] + _ordered_ancestry(get, src):
        sig = node_signature(get, nid)
        v = _VERDICTS.get(sig) if sig is not None else None
        if v is not None:
            out.append(dict(v, node=nid))
    return out


def install_report_wrapper(model, key: str, node_type: str, target) -> None:
    """For a node that patches a model without a sampling wrapper of its own (DitKitFastH3Schedule): an
    ``OUTER_SAMPLE`` wrapper under ``key`` on the clone ``model`` that runs the audio check and sends it to
    ``target`` (the node's :class:`~ditkit.bridge.reports.ReportTarget`) as kind ``audio_watch``. Runs without an
    audio latent send nothing."""
    import comfy.patcher_extension as pe

    def outer_sample(executor, *args, **kwargs):
        args, aw = watch(args, kwargs, "h3")
        out = executor(*args, **kwargs)
        if aw is not None:
            res = aw.finish(latent_check(out, kwargs.get("latent_shapes")))
            summary = res["summary"] + summary_suffix(dict(res, trajectory={"clean": True}))
            target.send("audio_watch", summary, res)
            remember(node_type, target.node_id, res)
        return out

    model.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, key, outer_sample)
