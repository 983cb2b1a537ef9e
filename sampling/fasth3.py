"""FastH3 sampling schedules as the distilled checkpoints define them (plain torch, no ComfyUI).

A FastH3 student (FastVideo's DMD2 distillations of MiniMax H3) was trained on a few fixed noise levels. Its
release states them as ``dmd_denoising_steps``: integer timestep indices out of 1000 that are **pre-shift
positions** on H3's rectified-flow grid, not sigmas. Each modality's own shift is applied to them exactly once:

    b_i = rung_i / 1000 for every rung, then b = 0 closes the grid      (N rungs -> N + 1 grid points, N forwards)
    sigma_i = s * b_i / (1 + (s - 1) * b_i)                              (s = video shift, or audio shift)

What the reference implementations do (read from their code, reproduced here):

* vllm-project/vllm-omni, ``vllm_omni/diffusion/models/minimax_h3/fasth3.py`` ``FASTH3_BASE_SCHEDULE =
  DMD2SigmaSchedule.from_positions((0.999, 0.749, 0.5, 0.25, 0.0))`` -- "These are positions, not final sigmas:
  H3's schedulers apply their own per-modality shift on top (12 for video, 3 for audio) ... Nothing here overrides
  those shifts" (PR 6714, Preview v1); ``fasth3_checkpoint.py`` ``FASTH3_V2_BASE_SCHEDULE`` = (0.999, 0.874, 0.749,
  0.624, 0.5, 0.375, 0.25, 0.125, 0.0) with ``sigma_shift_scales {"video": 10.0, "audio": 3.0}`` and
  ``FastH3CheckpointSpec.from_metadata`` requiring ``dmd_denoising_steps [999, 874, ..., 125]``,
  ``transformer_forwards 8``, ``video_scheduler_shift 10.0``, ``audio_scheduler_shift 3.0`` (8-Step V2).
  The positions become sigmas in ``time_request.py`` ``_time_shift_sigmas(base_schedule=...)``, called once per
  modality by ``pipeline_minimax_h3.py``: ``base = torch.tensor(positions, dtype=torch.float32)``;
  ``shifted = float(s) * base / (1 + (float(s) - 1) * base)`` -- float32 arithmetic, in that operation order.
  :func:`shifted_sigmas` does exactly that, so the sigmas here are those float32 values bit for bit.
* hao-ai-lab/FastVideo PR 1852 (FastH3 8-Step V2): "Shift ``[999, 874, 749, 624, 500, 375, 250, 125] / 1000``
  once per modality, keep H3 clean-time inputs (``1 - sigma``), and run eight forwards from nine grid points";
  ``fastvideo/pipelines/basic/minimax_h3/minimax_h3_pipeline.py`` ``MiniMaxH3BasePipeline._load_checkpoint_schedule``
  reads the export's ``fastvideo_inference.json`` (schema ``fasth3-inference-contract-v1``): ``dmd_denoising_steps``
  must be strictly decreasing integers in (0, 1000]; ``num_inference_steps`` must equal the rung count + 1 and
  ``transformer_forwards`` the rung count; ``video_scheduler_shift`` / ``audio_scheduler_shift``, when present
  (Preview v1 exports carry only the ladder), must be positive finite and agree with the scheduler configs; an
  explicit schedule that disagrees with the checkpoint's rungs is refused. ``fastvideo/models/schedulers/
  scheduling_minimax_h3.py`` ``MiniMaxH3Scheduler.set_timesteps`` stores explicit sigmas as float32 (strictly
  decreasing, ending at 0.0) and feeds the model ``1 - sigma``. :func:`parse_contract` applies those rules.

In ComfyUI 0.33 the sampler walks the **video** sigmas; the DiT derives the audio sigma from the video one in
closed form (``comfy/ldm/minimax/model.py`` ``time_shift_sigma``: back to the base grid with the video shift,
forward with the audio shift), so giving the sampler the shifted video ladder and the model the two shifts
reproduces the audio ladder too -- each modality shifted once. :attr:`FastH3Schedule.audio_from_video` is that
derivation (float32, the model's formula), reported beside the published audio ladder.

Base (non-distilled) H3 schedules are ComfyUI's own (``BasicScheduler`` on the model's shifts); nothing here
touches them.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import torch

from .. import strict_json
from ..errors import ScheduleError
from ..loaders.safe_fs import read_user_file
from ..report import Report

CONTRACT_FILE = "fastvideo_inference.json"
CONTRACT_SCHEMA = "fasth3-inference-contract-v1"
MAX_CONTRACT_BYTES = 64 * 1024
TIME_SCALE = 1000
FROM_CONTRACT = "from_contract"
SHIFT_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class Recipe:
    key: str
    label: str
    rungs: tuple[int, ...]
    video_shift: float
    audio_shift: float
    source: str


RECIPES: dict[str, Recipe] = {
    "fasth3_8step_v2": Recipe(
        "fasth3_8step_v2", "FastH3 8-Step V2", (999, 874, 749, 624, 500, 375, 250, 125), 10.0, 3.0,
        "FastVideo/FastVideo-FastH3-8-Step-V2 fastvideo_inference.json (hao-ai-lab/FastVideo PR 1852; "
        "vllm-omni FASTH3_V2_BASE_SCHEDULE)"),
    "fasth3_preview_4step": Recipe(
        "fasth3_preview_4step", "FastH3 Preview v1 (4-step)", (999, 749, 500, 250), 12.0, 3.0,
        "FastVideo FastH3 4-step Preview v1 dmd_denoising_steps on H3's own shifts (vllm-omni PR 6714 "
        "FASTH3_BASE_SCHEDULE)"),
}
RECIPE_CHOICES = list(RECIPES) + [FROM_CONTRACT]

_SAFE_TEXT = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,200}$")


def positions(rungs) -> tuple[float, ...]:
    """Pre-shift grid positions: every rung / 1000, closed by the terminal 0.0."""
    return tuple(int(r) / TIME_SCALE for r in rungs) + (0.0,)


def shifted_sigmas(grid, shift: float) -> torch.Tensor:
    """``s * b / (1 + (s - 1) * b)`` on the positions, in float32 (vllm-omni ``_time_shift_sigmas``'s arithmetic)."""
    base = torch.tensor([float(b) for b in grid], dtype=torch.float32)
    s = float(shift)
    return s * base / (1 + (s - 1) * base)


def audio_from_video(video_sigmas: torch.Tensor, shift_video: float, shift_audio: float) -> torch.Tensor:
    """The audio sigma H3's DiT derives from a video sigma (base grid with the video shift, then the audio shift),
    float32 as the model computes it; the model clamps sigma at 1e-6, so the terminal 0 maps to ~0."""
    sv = video_sigmas.to(torch.float32).clamp(min=1e-6)
    base = sv / (shift_video + sv * (1.0 - shift_video))
    return shift_audio * base / (1.0 + (shift_audio - 1.0) * base)


def _check_rungs(rungs, where: str) -> tuple[int, ...]:
    if not isinstance(rungs, (list, tuple)) or not rungs:
        raise ScheduleError(f"{where}: dmd_denoising_steps must be a non-empty list of integers")
    if any(type(r) is not int or not 0 < r <= TIME_SCALE for r in rungs):
        raise ScheduleError(f"{where}: dmd_denoising_steps must hold integers in (0, {TIME_SCALE}] "
                            "(timestep indices out of 1000)")
    if any(a <= b for a, b in zip(rungs, rungs[1:])):
        raise ScheduleError(f"{where}: dmd_denoising_steps must be strictly decreasing, got {list(rungs)}")
    return tuple(rungs)


def _positive_finite(value, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ScheduleError(f"{where}: {key} must be a positive finite number")
    if not SHIFT_RANGE[0] <= value <= SHIFT_RANGE[1]:
        raise ScheduleError(f"{where}: {key} {value:g} is outside {SHIFT_RANGE[0]:g}..{SHIFT_RANGE[1]:g} (the range of "
                            "ComfyUI's MiniMaxH3SigmaShift; float32 sigmas degenerate beyond it)")
    return float(value)


def _check_sigmas(t: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()) or t[-1].item() != 0.0 or t[0].item() > 1.0 \
            or not bool((t[1:] < t[:-1]).all()):
        raise ScheduleError(f"{what}: the shifted ladder is not finite and strictly decreasing from <= 1 to 0 "
                            f"({t.tolist()})")


@dataclass(frozen=True)
class Contract(Report):
    """The schedule part of a ``fastvideo_inference.json`` (validated)."""

    path: str
    rungs: tuple[int, ...]
    video_shift: float | None
    audio_shift: float | None
    model_id: str | None = None
    extra: dict = field(default_factory=dict)

    KEYS = ("path", "dmd_denoising_steps=rungs", "video_scheduler_shift=video_shift",
            "audio_scheduler_shift=audio_shift", "model_id", "**extra")

    @property
    def where(self) -> str:
        return f"FastH3 contract '{self.path}'"


def parse_contract(obj, where: str, path: str | None = None) -> Contract:
    """Validate a parsed ``fastvideo_inference.json`` the way FastVideo's ``_load_checkpoint_schedule`` does.

    Error messages name the key and the rule, never echo strings from the file."""
    if not isinstance(obj, dict):
        raise ScheduleError(f"{where}: must hold a JSON object")
    if obj.get("schema_version") != CONTRACT_SCHEMA:
        raise ScheduleError(f"{where}: schema_version must be {CONTRACT_SCHEMA!r} (a FastH3 inference contract)")
    if "pdd_steps" in obj:
        raise ScheduleError(f"{where}: a PDD (Parallel Decoding Distillation) contract samples fused blocks of a fine "
                            "grid, not a DMD ladder; this node supports DMD contracts (dmd_denoising_steps) only")
    rungs = _check_rungs(obj.get("dmd_denoising_steps"), where)
    n = len(rungs)
    nis, tf = obj.get("num_inference_steps"), obj.get("transformer_forwards")
    if type(nis) is not int or nis != n + 1:
        raise ScheduleError(f"{where}: num_inference_steps must be the grid-point count {n + 1} "
                            f"({n} rungs + the terminal 0)")
    if type(tf) is not int or tf != n:
        raise ScheduleError(f"{where}: transformer_forwards must equal the rung count {n}")
    shifts = {}
    for key in ("video_scheduler_shift", "audio_scheduler_shift"):
        shifts[key] = _positive_finite(obj[key], key, where) if key in obj else None
    extra = {}
    for key in ("guidance_scale", "vsa_sparsity"):
        v = obj.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            extra[key] = float(v)
    v = obj.get("vsa_tile_size")
    if type(v) is int:
        extra["vsa_tile_size"] = v
    for key in ("task", "attention_backend"):
        v = obj.get(key)
        if isinstance(v, str) and _SAFE_TEXT.match(v):
            extra[key] = v
    mid = obj.get("model_id")
    return Contract(path=path if path is not None else where, rungs=rungs, video_shift=shifts["video_scheduler_shift"],
                    audio_shift=shifts["audio_scheduler_shift"],
                    model_id=mid if isinstance(mid, str) and _SAFE_TEXT.match(mid) else None, extra=extra)


def load_contract(path: str | os.PathLike) -> Contract:
    """Read and validate a contract file: at most 64 KiB, UTF-8, strict JSON (no NaN/Infinity, no duplicate keys)."""
    path = os.fspath(path)
    where = f"FastH3 contract '{path}'"
    # opened once, checked on the descriptor: a FIFO swapped in after the name was resolved cannot stall the queue
    raw = read_user_file(path, MAX_CONTRACT_BYTES, "FastH3 contract", ScheduleError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ScheduleError(f"{where}: not UTF-8 text") from None
    try:
        obj = strict_json.loads(text)
    except strict_json.DuplicateKey:      # the key is a file string: not echoed
        raise ScheduleError(f"{where}: duplicate JSON key") from None
    except strict_json.NonFiniteConstant as e:
        raise ScheduleError(f"{where}: non-finite JSON constant {e.name}") from None
    except (ValueError, RecursionError) as e:
        raise ScheduleError(f"{where}: invalid JSON ({type(e).__name__})") from None
    return parse_contract(obj, where, path)


def _fmt(t: torch.Tensor) -> str:
    return ", ".join(f"{v:.5g}" for v in t.tolist())


@dataclass
class FastH3Schedule(Report):
    recipe: str
    label: str
    rungs: tuple[int, ...]
    video_shift: float
    audio_shift: float
    contract: Contract | None = None
    contract_note: str = ""
    positions: tuple[float, ...] = ()
    video_sigmas: torch.Tensor | None = None
    audio_sigmas: torch.Tensor | None = None
    audio_from_video: torch.Tensor | None = None

    KEYS = ("recipe", "label", "dmd_denoising_steps=rungs", "positions", "forwards", "video_shift", "audio_shift",
            "video_sigmas", "audio_sigmas", "audio_from_video_max_dev", "contract", "contract_note")
    VALUES = {"audio_from_video_max_dev": lambda s: s.audio_derivation_error()}

    def __post_init__(self) -> None:
        self.positions = positions(self.rungs)
        self.video_sigmas = shifted_sigmas(self.positions, self.video_shift)
        self.audio_sigmas = shifted_sigmas(self.positions, self.audio_shift)
        self.audio_from_video = audio_from_video(self.video_sigmas, self.video_shift, self.audio_shift)
        _check_sigmas(self.video_sigmas, f"{self.label} video (shift {self.video_shift:g})")
        _check_sigmas(self.audio_sigmas, f"{self.label} audio (shift {self.audio_shift:g})")

    @property
    def forwards(self) -> int:
        return len(self.rungs)

    def audio_derivation_error(self) -> float:
        """max |audio sigma the DiT derives from the video sigma - published audio ladder| (terminal point excluded)."""
        return float((self.audio_from_video[:-1] - self.audio_sigmas[:-1]).abs().max())

    def summary(self) -> str:
        c = (f"contract '{self.contract.path}' agrees" if self.contract is not None else
             f"no contract ({self.contract_note})" if self.contract_note else "no contract")
        return (f"{self.label}: {self.forwards} forwards from {self.forwards + 1} grid points, shifts video "
                f"{self.video_shift:g} / audio {self.audio_shift:g} set on the model (applied once); video sigmas "
                f"[{_fmt(self.video_sigmas)}]; audio sigmas [{_fmt(self.audio_sigmas)}]; {c}")


def resolve_schedule(recipe: str, contract: Contract | None = None, contract_note: str = "") -> FastH3Schedule:
    """The schedule for ``recipe`` (a :data:`RECIPES` key, or ``from_contract``), checked against ``contract``.

    A contract that disagrees with the chosen recipe (rungs or shifts) is refused, never silently preferred."""
    if recipe == FROM_CONTRACT:
        if contract is None:
            raise ScheduleError(f"recipe {FROM_CONTRACT!r} needs the checkpoint's {CONTRACT_FILE}"
                                + (f" ({contract_note})" if contract_note else "")
                                + "; name it in contract_file, or choose one of " + ", ".join(RECIPES))
        missing = [k for k, v in (("video_scheduler_shift", contract.video_shift),
                                  ("audio_scheduler_shift", contract.audio_shift)) if v is None]
        if missing:
            raise ScheduleError(f"{contract.where}: has no {' / '.join(missing)} (earlier exports such as Preview v1 "
                                "carry only the ladder and take the shifts from their scheduler configs); choose the "
                                "recipe that names the shifts (" + ", ".join(RECIPES) + ")")
        return FastH3Schedule(FROM_CONTRACT, "FastH3 (from contract)", contract.rungs, contract.video_shift,
                              contract.audio_shift, contract=contract, contract_note=contract_note)
    if recipe not in RECIPES:
        raise ScheduleError(f"unknown recipe {recipe!r}; choose one of {RECIPE_CHOICES}")
    r = RECIPES[recipe]
    _check_rungs(r.rungs, f"recipe {recipe}")
    if contract is not None:
        if contract.rungs != r.rungs:
            raise ScheduleError(f"{contract.where}: the checkpoint's dmd_denoising_steps {list(contract.rungs)} "
                                f"disagree with recipe {recipe} {list(r.rungs)}; refusing the conflicting choice "
                                f"(use recipe {FROM_CONTRACT!r} to follow the checkpoint)")
        for key, mine, theirs in (("video_scheduler_shift", r.video_shift, contract.video_shift),
                                  ("audio_scheduler_shift", r.audio_shift, contract.audio_shift)):
            if theirs is not None and theirs != mine:
                raise ScheduleError(f"{contract.where}: {key} {theirs:g} disagrees with recipe {recipe} ({mine:g}); "
                                    f"refusing the conflicting choice (use recipe {FROM_CONTRACT!r})")
    return FastH3Schedule(recipe, r.label, r.rungs, r.video_shift, r.audio_shift, contract=contract,
                          contract_note=contract_note)
