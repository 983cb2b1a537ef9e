"""DitKitFastH3Schedule: the FastH3 schedules as the distilled checkpoints define them (MODEL -> MODEL + SIGMAS).

Thin node over :mod:`ditkit.sampling.fasth3`: validates the recipe (and the checkpoint's
``fastvideo_inference.json`` when there is one), sets the per-stream shifts on a clone of the model exactly as
ComfyUI's ``MiniMaxH3SigmaShift`` does (``ModelSamplingAV`` + the two ``transformer_options`` keys the DiT reads),
and returns the shifted **video** ladder for ``SamplerCustom`` / ``SamplerCustomAdvanced``. The DiT derives the
audio sigma from the video one with those shifts, so each stream is shifted once, never twice.
"""
from __future__ import annotations

import os
import time

from comfy_api.latest import io

from ..bridge.files import folder_roots
from ..bridge.models import h3_diffusion_model, model_sampling
from ..bridge import audio_watch
from ..bridge.schedules import install_shifts
from ..errors import ScheduleError, UnsupportedModelError
from ..sampling import fasth3 as core
from ._common import report_target, send_report, ui_report

NODE_ID = "DitKitFastH3Schedule"
FOLDER = "diffusion_models"
# set by DitKitH3ModelLoader (nodes/h3_loaders.py) to the file or folder the model was loaded from
SOURCE_ATTACHMENT = "ditkit_h3_source"
MAX_NAME_CHARS = 1024


def _h3_model(model):
    dm = h3_diffusion_model(model, NODE_ID, "FastH3 schedules are for MiniMax H3 / FastH3 models; got {got}")
    ms = model_sampling(model)
    if not hasattr(ms, "audio_shift"):
        raise UnsupportedModelError(f"{NODE_ID}: the model's sampling ({type(ms).__name__}) is not ComfyUI's "
                                    "audio-video flow sampling (ModelSamplingAV)")
    return dm, ms


def _roots() -> list[tuple[str, str]]:
    return [(r, os.path.realpath(r)) for r in folder_roots(FOLDER)]


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


def resolve_contract_name(spec: str) -> str:
    """A name relative to models/diffusion_models (a folder holding ``fastvideo_inference.json``, or that file)
    -> the real path of the file. Absolute paths, ``..`` and symlinks leading out of the folder are refused;
    only a file named ``fastvideo_inference.json`` is ever opened."""
    raw = spec
    spec = (spec or "").strip()
    where = f"{NODE_ID}: contract_file {raw!r}" if len(raw) <= 200 else f"{NODE_ID}: contract_file"
    rule = (f"name a folder in models/{FOLDER} holding {core.CONTRACT_FILE}, or that file, relative to "
            f"models/{FOLDER} (e.g. 'FastH3-8-Step-V2' or 'FastH3-8-Step-V2/{core.CONTRACT_FILE}')")
    if len(spec) > MAX_NAME_CHARS or "\x00" in spec:
        raise ScheduleError(f"{where} is not a usable file name; {rule}")
    parts = [p for p in spec.replace("\\", "/").split("/") if p not in ("", ".")]
    if os.path.isabs(spec) or spec.startswith(("/", "\\")) or (len(spec) > 1 and spec[1] == ":"):
        raise ScheduleError(f"{where} is an absolute path; {rule}")
    if any(p == ".." for p in parts):
        raise ScheduleError(f"{where} leaves models/{FOLDER} ('..'); {rule}")
    if not parts:
        raise ScheduleError(f"{where} is empty; {rule}")
    if parts[-1] != core.CONTRACT_FILE:
        parts.append(core.CONTRACT_FILE)
    rel = os.path.join(*parts)
    for root, real_root in _roots():
        cand = os.path.realpath(os.path.join(real_root, rel))
        if not _inside(cand, real_root):
            raise ScheduleError(f"{where} resolves (through a symlink) outside models/{FOLDER}; {rule}")
        if os.path.isfile(cand):
            return cand
    raise ScheduleError(f"{where}: no {core.CONTRACT_FILE} there in models/{FOLDER} "
                        f"(folders: {[r for r, _ in _roots()]}); {rule}")


def find_contract(model, contract_file: str) -> tuple[str | None, str]:
    """-> (contract path or None, how it was found / why there is none)."""
    if (contract_file or "").strip():
        return resolve_contract_name(contract_file), "named in contract_file"
    src = (getattr(model, "attachments", None) or {}).get(SOURCE_ATTACHMENT)
    if not isinstance(src, str):
        return None, ("model source unknown (not loaded by DitKitH3ModelLoader); name the checkpoint's "
                      f"{core.CONTRACT_FILE} in contract_file to check it")
    if not os.path.isdir(src):
        return None, f"single-file checkpoint: no {core.CONTRACT_FILE} looked up (name it in contract_file)"
    src = os.path.realpath(src)
    cands = [os.path.join(src, core.CONTRACT_FILE)]
    if os.path.basename(src) == "transformer":  # a FastVideo export's transformer/ folder: the contract sits above
        cands.append(os.path.join(os.path.dirname(src), core.CONTRACT_FILE))
    roots = [real for _, real in _roots()]
    for c in cands:
        real = os.path.realpath(c)
        if any(_inside(real, r) for r in roots) and os.path.isfile(real):
            return real, "found next to the loaded checkpoint"
    return None, f"none next to the loaded checkpoint folder {os.path.basename(src)!r}"


def find_sidecar(model, filename: str) -> str | None:
    """``filename`` (e.g. ``provenance.json``) next to a folder checkpoint loaded by DitKitH3ModelLoader (or above
    its ``transformer/`` folder), inside models/diffusion_models; None for single files and unknown sources."""
    src = (getattr(model, "attachments", None) or {}).get(SOURCE_ATTACHMENT)
    if not isinstance(src, str) or not os.path.isdir(src):
        return None
    src = os.path.realpath(src)
    cands = [os.path.join(src, filename)]
    if os.path.basename(src) == "transformer":
        cands.append(os.path.join(os.path.dirname(src), filename))
    roots = [real for _, real in _roots()]
    for c in cands:
        real = os.path.realpath(c)
        if any(_inside(real, r) for r in roots) and os.path.isfile(real):
            return real
    return None


class DitKitFastH3Schedule(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="FastH3 Schedule (ditkit)",
            category="ditkit/sampling",
            description=("The noise ladder a FastH3 checkpoint was distilled on: its DMD rungs / 1000 shifted once "
                         "per stream (8-Step V2: video 10 / audio 3; Preview v1: 12 / 3). Sets the shifts on the "
                         "model and outputs the video sigmas for SamplerCustom; checks the checkpoint's "
                         "fastvideo_inference.json when there is one and refuses a conflicting recipe."),
            search_aliases=["fasth3", "fasth3 schedule", "dmd schedule", "fasth3 sigmas", "fasth3 8 step",
                            "distilled h3 sigmas"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 / FastH3 model (other models are refused)."),
                io.Combo.Input("recipe", options=core.RECIPE_CHOICES, default="fasth3_8step_v2",
                               tooltip=("fasth3_8step_v2: rungs 999..125 (8 forwards), shifts 10/3. "
                                        "fasth3_preview_4step: rungs 999, 749, 500, 250 (4 forwards), shifts 12/3. "
                                        "from_contract: the rungs and shifts of the checkpoint's "
                                        "fastvideo_inference.json (must name both shifts).")),
                io.String.Input("contract_file", default="",
                                tooltip=("Optional: the checkpoint's fastvideo_inference.json, named relative to "
                                         "models/diffusion_models (the export folder, or the file in it). Empty: "
                                         "looked up next to a folder checkpoint loaded by DitKitH3ModelLoader. "
                                         "A contract that disagrees with the recipe is refused.")),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with the recipe's video/audio shifts set."),
                     io.Sigmas.Output(display_name="sigmas",
                                      tooltip="The shifted video ladder (grid points incl. the final 0) for "
                                              "SamplerCustom / SamplerCustomAdvanced.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, model=None, recipe="", contract_file="", **kwargs):
        """Re-execute when the contract file changes on disk."""
        try:
            path, _ = find_contract(model, contract_file)
            if path is None:
                return f"none|{recipe}|{contract_file}"
            st = os.stat(path)
            return f"{path}|{st.st_mtime_ns}|{st.st_size}|{recipe}"
        except Exception:  # noqa: BLE001 - a bad name is reported by execute
            return f"error|{contract_file}|{time.time()}"

    @classmethod
    def execute(cls, model, recipe: str = "fasth3_8step_v2", contract_file: str = "") -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        _, ms = _h3_model(model)
        if recipe not in core.RECIPE_CHOICES:
            raise ScheduleError(f"{NODE_ID}: unknown recipe {recipe!r}; choose one of {core.RECIPE_CHOICES}")
        path, note = find_contract(model, contract_file)
        contract = core.load_contract(path) if path is not None else None
        sched = core.resolve_schedule(recipe, contract, contract_note=note)
        before = (float(ms.shift), None if ms.audio_shift is None else float(ms.audio_shift))
        m = install_shifts(model, sched.video_shift, sched.audio_shift)
        # the audio guard while sampling on this schedule (reported on this node, kind audio_watch)
        audio_watch.install_report_wrapper(m, "ditkit_fasth3_audio", NODE_ID, report_target(node_id, NODE_ID))

        summary = sched.summary() + (f" ({note})" if contract is not None else "")
        if before != (sched.video_shift, sched.audio_shift):
            summary += f"; the model's shifts were {before[0]:g} / " + (f"{before[1]:g}" if before[1] is not None else "none")
        data = sched.as_dict()
        data.update(previous_shifts=list(before), contract_source=note)
        payload = send_report(node_id, NODE_ID, "schedule", summary, data)
        return io.NodeOutput(m, sched.video_sigmas.clone(), ui=ui_report(payload))


NODES = [DitKitFastH3Schedule]
