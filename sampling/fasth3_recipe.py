"""Which VSA-H3 recipe a loaded FastH3 checkpoint was trained with, decided from what it says about itself.

Plain torch / stdlib, no ComfyUI. The node (``nodes/sparse_attention.py``) gathers the evidence from the loaded
model (gate tensors, the file's safetensors metadata, the ``fastvideo_inference.json`` / ``provenance.json`` next
to the checkpoint, the file name) into an :class:`Evidence`; :func:`decide` says what the checkpoint is and why,
and :func:`choose` turns the node's ``recipe`` input (``auto`` or an explicit choice) into the sparsity to run,
reporting an explicit choice that contradicts the checkpoint (allowed, never silent).

The recipes, as the releases and the reference runtimes state them:

* **FastH3 8-Step V2** (``FastVideo/FastVideo-FastH3-8-Step-V2``): VSA-H3 sparsity **0.8** (keep 20 %), tile 64,
  trained ``to_gate_compress`` gates in every block. vllm-project/vllm-omni
  ``vllm_omni/diffusion/models/minimax_h3/fasth3_checkpoint.py``: ``FastH3CheckpointSpec.vsa_sparsity = 0.8`` and
  ``from_metadata`` requires ``model_id FastVideo/FastVideo-FastH3-8-Step-V2``, ``attention_backend
  VIDEO_SPARSE_ATTN_H3``, ``vsa_sparsity 0.8``, ``vsa_tile_size 64`` in the release's ``fastvideo_inference.json``
  ("the released weights already contain the entire student, including its learned compression gates").
* **FastH3 Preview v1, VSA variants** (``...-4-step-Preview-v1-VSA-DataFree``, the LoRA with ``.set_weight``
  gates): sparsity **0.9** (keep 10 %), tile 64. hao-ai-lab/FastVideo ``examples/inference/basic/basic_fasth3.py``
  ``--vsa-sparsity`` default 0.9 ("the checkpoint's trained policy"), ``--vsa-tile-size`` 64 ("the checkpoint's
  trained and measured geometry"); vllm-omni ``fasth3.py``: "the VSA variants add ``.set_weight`` tensors for
  compression gates", a gated adapter ``requires_vsa`` ("a student distilled for 90% sparsity"); its Preview
  contract carries ``attention_backend VIDEO_SPARSE_ATTN_H3``, ``vsa_sparsity 0.9``, ``vsa_tile_size 64``,
  ``dmd_denoising_steps [999, 749, 500, 250]`` (reference/sparse_attention.md §1, h3.md §3.1).
* **FastH3 Preview v1 Dense-DataFree**: distilled dense (no VSA, no gates).

Gates: a model whose every ``to_gate_compress`` weight is zero is not a VSA-trained student (FastVideo
``fastvideo/pipelines/basic/minimax_h3/vsa_guard.py`` refuses VSA on it: "dense CompactH3 cannot run VSA").
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from ..errors import BackendError, CheckpointError
from ..loaders.safe_fs import read_user_file
from ..report import Report
from . import fasth3 as sched

TILE = 64
VSA_BACKEND = "VIDEO_SPARSE_ATTN_H3"
PROVENANCE_FILE = "provenance.json"
MAX_SIDECAR_BYTES = 64 * 1024
_SAFE_TEXT = re.compile(r"^[A-Za-z0-9_.:/@+ -]{1,200}$")


@dataclass(frozen=True)
class VSARecipe:
    key: str
    label: str
    sparsity: float | None          # FastVideo VSA_sparsity; None = distilled dense (no VSA)
    source: str

    @property
    def keep_percent(self) -> float | None:
        return None if self.sparsity is None else keep_percent_of(self.sparsity)


RECIPES: dict[str, VSARecipe] = {
    "fasth3_8step_v2": VSARecipe(
        "fasth3_8step_v2", "FastH3 8-Step V2", 0.8,
        "vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)"),
    "fasth3_preview_vsa": VSARecipe(
        "fasth3_preview_vsa", "FastH3 Preview v1 (VSA)", 0.9,
        "FastVideo basic_fasth3.py --vsa-sparsity 0.9 (the checkpoint's trained policy), tile 64"),
    "fasth3_preview_dense": VSARecipe(
        "fasth3_preview_dense", "FastH3 Preview v1 (Dense-DataFree)", None,
        "FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree: distilled dense, no gates"),
}

# release ids (lower case, without an hf:// prefix or @revision) -> recipe key; "preview_lora" = decided by its gates
MODEL_IDS: dict[str, str] = {
    "fastvideo/fastvideo-fasth3-8-step-v2": "fasth3_8step_v2",
    "fastvideo/fastvideo-fasth3-8-step-v2-nvfp4": "fasth3_8step_v2",
    "fastvideo/fastvideo-fasth3-4-step-preview-v1-vsa-datafree": "fasth3_preview_vsa",
    "fastvideo/fastvideo-minimax-fasth3-preview-v0.1": "fasth3_preview_vsa",
    "fastvideo/fastvideo-fasth3-4-step-preview-v1-dense-datafree": "fasth3_preview_dense",
    "fastvideo/fastvideo-fasth3-4-step-preview-v1-lora": "preview_lora",
}
# file / folder names (weakest evidence): the Comfy-Org V2 file is fastvideo_fasth3_8step_v2_*.safetensors
NAME_PATTERNS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"fasth3[_-]?8[_-]?step[_-]?v2", re.I), "fasth3_8step_v2"),
    (re.compile(r"fasth3.*preview.*vsa", re.I), "fasth3_preview_vsa"),
    (re.compile(r"fasth3.*preview.*dense", re.I), "fasth3_preview_dense"),
)
METADATA_ID_KEYS = ("model_id", "finetuned_model", "source")
V2_RUNGS = sched.RECIPES["fasth3_8step_v2"].rungs
PREVIEW_RUNGS = sched.RECIPES["fasth3_preview_4step"].rungs

# strength of each kind of evidence: the strongest decides, weaker disagreeing evidence is reported as a conflict
STRENGTH = {"contract": 3, "model_id": 2, "gates": 1, "file_name": 0}


def keep_percent_of(sparsity: float) -> float:
    return round(100.0 * (1.0 - float(sparsity)), 9)


@dataclass
class Evidence:
    """What the loaded checkpoint says about itself (gathered by the node; every field optional)."""

    num_blocks: int = 0
    gate_blocks: int = 0                 # blocks with a to_gate_compress weight
    gates_nonzero: bool | None = None    # any non-zero gate entry (None: no gates)
    gate_source: str = ""                # where the gates came from ("model", "loader attachment", ...)
    contract: sched.Contract | None = None
    provenance: dict | None = None       # safe fields of provenance.json (model_id, base_model)
    provenance_path: str | None = None
    metadata: dict | None = None         # the checkpoint file's safetensors __metadata__
    file_name: str | None = None         # checkpoint file or export folder name

    @property
    def trained_gates(self) -> bool:
        return self.gate_blocks > 0 and bool(self.gates_nonzero)


@dataclass
class Decision(Report):
    recipe: VSARecipe | None             # None: the checkpoint did not identify itself
    sparsity: float | None               # the sparsity the checkpoint states (None: dense or unknown)
    reasons: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    looked_at: list[str] = field(default_factory=list)

    KEYS = ("recipe", "label", "sparsity", "reasons", "conflicts", "notes", "looked_at")
    VALUES = {"recipe": lambda d: d.recipe.key if d.recipe else None,
              "label": lambda d: d.recipe.label if d.recipe else None}

    @property
    def identified(self) -> bool:
        return self.recipe is not None

    @property
    def dense(self) -> bool:
        return self.recipe is not None and self.sparsity is None

    def describe(self) -> str:
        if self.recipe is None:
            return "not identified (" + "; ".join(self.looked_at) + ")"
        what = (f"{self.recipe.label}, sparsity {self.sparsity:g} (keep {keep_percent_of(self.sparsity):g}%)"
                if self.sparsity is not None else f"{self.recipe.label} (distilled dense, no VSA)")
        return what + " by " + "; ".join(self.reasons)


def normalize_id(value) -> str | None:
    """``hf://FastVideo/X@rev`` / ``FastVideo/X`` -> ``fastvideo/x`` (None for non-strings)."""
    if not isinstance(value, str) or not _SAFE_TEXT.match(value):
        return None
    v = value.strip()
    if v.lower().startswith("hf://"):
        v = v[5:]
    return v.split("@", 1)[0].strip().lower() or None


def _contract_candidate(c: sched.Contract) -> tuple[str, float | None, str] | None:
    """(recipe key or 'contract', sparsity, why) from a contract's VSA fields, or None when it states none."""
    where = c.where
    backend = c.extra.get("attention_backend")
    sp = c.extra.get("vsa_sparsity")
    tile = c.extra.get("vsa_tile_size")
    if backend is None and sp is None:
        return None
    if backend is not None and backend != VSA_BACKEND:
        return ("contract_dense", None, f"{sched.CONTRACT_FILE} attention_backend {backend} (not {VSA_BACKEND}): "
                "the student runs dense attention")
    if sp is None:
        raise CheckpointError(f"{where}: attention_backend {VSA_BACKEND} without vsa_sparsity; the contract does not "
                              "say which sparsity the student was trained at")
    if not 0.0 <= sp < 1.0:
        raise CheckpointError(f"{where}: vsa_sparsity {sp:g} is outside [0, 1) (FastVideo's VSA_sparsity range)")
    if tile is not None and tile != TILE:
        raise CheckpointError(f"{where}: vsa_tile_size {tile:g} is not {TILE}; ditkit's VSA-H3 runs the (4,4,4) = "
                              f"{TILE}-token tiles FastH3 was trained at only")
    key = ("fasth3_8step_v2" if c.rungs == V2_RUNGS and sp == 0.8 else
           "fasth3_preview_vsa" if c.rungs == PREVIEW_RUNGS and sp == 0.9 else "contract")
    return key, float(sp), f"{sched.CONTRACT_FILE} vsa_sparsity {sp:g}" + (f", vsa_tile_size {int(tile)}"
                                                                          if tile is not None else "")


def _id_candidates(ev: Evidence) -> list[tuple[str, str]]:
    """[(recipe key, why)] from model ids in the contract, provenance.json and the file's metadata."""
    out = []
    ids = []
    if ev.contract is not None and ev.contract.model_id:
        ids.append((ev.contract.model_id, f"{sched.CONTRACT_FILE} model_id"))
    if ev.provenance:
        for k in ("model_id",):
            if ev.provenance.get(k):
                ids.append((ev.provenance[k], f"{PROVENANCE_FILE} {k}"))
    for k in METADATA_ID_KEYS:
        v = (ev.metadata or {}).get(k)
        if v:
            ids.append((v, f"file metadata {k}"))
    for raw, where in ids:
        key = MODEL_IDS.get(normalize_id(raw) or "")
        if key == "preview_lora":
            key = "fasth3_preview_vsa" if ev.trained_gates else "fasth3_preview_dense"
            where += " (the Preview LoRA: VSA when it carries gates)"
        if key is not None:
            out.append((key, f"{where} {raw}"))
    return out


def decide(ev: Evidence) -> Decision:
    """What the checkpoint is, from the strongest evidence; weaker evidence that disagrees is a conflict."""
    cands: list[tuple[int, str, float | None, str]] = []     # (strength, key, sparsity, why)
    looked = []
    if ev.contract is not None:
        cc = _contract_candidate(ev.contract)
        if cc is not None:
            cands.append((STRENGTH["contract"],) + cc)
        elif ev.contract.rungs == PREVIEW_RUNGS:
            # earlier exports (Preview v1) carry only the ladder: the gates say VSA or dense
            key = "fasth3_preview_vsa" if ev.trained_gates else "fasth3_preview_dense"
            cands.append((STRENGTH["contract"], key, RECIPES[key].sparsity,
                          f"{sched.CONTRACT_FILE} Preview ladder {list(PREVIEW_RUNGS)} + "
                          + ("trained to_gate_compress" if ev.trained_gates else "no trained to_gate_compress")))
        else:
            looked.append(f"{sched.CONTRACT_FILE} states no VSA fields")
    else:
        looked.append(f"no {sched.CONTRACT_FILE}")
    for key, why in _id_candidates(ev):
        cands.append((STRENGTH["model_id"], key, RECIPES[key].sparsity, why))
    if ev.provenance is None:
        looked.append(f"no {PROVENANCE_FILE}")
    if not ev.metadata:
        looked.append("no file metadata")
    if ev.file_name:
        for pat, key in NAME_PATTERNS:
            if pat.search(ev.file_name):
                cands.append((STRENGTH["file_name"], key, RECIPES[key].sparsity, f"file name {ev.file_name!r}"))
                break
        else:
            looked.append(f"file name {ev.file_name!r} names no FastH3 release")
    if ev.gate_blocks == 0:
        looked.append("no to_gate_compress")
    elif not ev.gates_nonzero:
        looked.append("every to_gate_compress is zero (not VSA-trained)")
    else:
        looked.append(f"trained to_gate_compress in {ev.gate_blocks}/{ev.num_blocks} blocks (FastH3 VSA, version "
                      "not stated)")

    if not cands:
        return Decision(None, None, looked_at=looked)
    cands.sort(key=lambda c: -c[0])
    strength, key, sp, why = cands[0]
    if key == "contract":
        recipe = VSARecipe("contract", "FastH3 (fastvideo_inference.json)", sp, ev.contract.where)
    elif key == "contract_dense":
        recipe = VSARecipe("contract_dense", "FastH3 (dense, per fastvideo_inference.json)", None, ev.contract.where)
    else:
        recipe = RECIPES[key]
    d = Decision(recipe, sp, reasons=[why], looked_at=looked)
    for s2, k2, sp2, why2 in cands[1:]:
        if sp2 == sp:
            d.reasons.append(why2)
        else:
            said = RECIPES[k2].label if k2 in RECIPES else k2
            d.conflicts.append(f"{why2} says {said} (" + ("weaker evidence, not followed)" if s2 < strength
                                                          else f"as strong; {why} followed)"))
    # the gates against the identity
    if sp is not None:
        if ev.gate_blocks == 0:
            d.notes.append(f"{recipe.label} was trained with to_gate_compress gates, but the model carries none: the "
                           "gate-compress branch is skipped (pure sparse), which is not the trained student")
        elif not ev.gates_nonzero:
            d.notes.append("every to_gate_compress weight is zero: not a VSA-trained student (FastVideo refuses VSA "
                           "on such a model); the gate branch adds nothing")
        elif ev.num_blocks and ev.gate_blocks < ev.num_blocks:
            d.notes.append(f"to_gate_compress on {ev.gate_blocks} of {ev.num_blocks} blocks only")
    elif ev.trained_gates:
        d.notes.append(f"the model carries trained to_gate_compress gates ({ev.gate_blocks} blocks) although "
                       f"{why} says dense")
    return d


@dataclass
class RecipeChoice(Report):
    mode: str                      # "auto" | "explicit"
    keep_percent: float
    sparsity: float
    label: str
    decision: Decision
    override: str | None = None    # an explicit choice that contradicts the checkpoint

    KEYS = ("mode", "keep_percent", "sparsity", "label", "override", "checkpoint=decision")

    def summary(self) -> str:
        if self.mode == "auto":
            s = f"recipe auto -> {self.decision.describe()}"
        else:
            s = f"recipe {self.label} (explicit); checkpoint: {self.decision.describe()}"
        if self.override:
            s += f"; OVERRIDE: {self.override}"
        for c in self.decision.conflicts:
            s += f"; conflict: {c}"
        for n in self.decision.notes:
            s += f"; note: {n}"
        return s


def choose(choice: str, keep_percent: float | None, ev: Evidence, where: str = "recipe") -> RecipeChoice:
    """``choice`` ``auto`` -> the checkpoint's recipe (refused when the checkpoint does not identify a VSA recipe);
    otherwise the explicit ``keep_percent`` (from the node's preset or its custom value), with an override note when
    it contradicts what the checkpoint states. Raises BackendError before anything is installed."""
    d = decide(ev)
    if choice == "auto":
        if d.recipe is None:
            raise BackendError(f"{where} 'auto': the checkpoint does not say which VSA recipe it was trained with ("
                               + "; ".join(d.looked_at) + "); choose the recipe explicitly (FastH3 Preview v1 keeps "
                               "10% of video tiles, FastH3 8-step V2 20%)")
        if d.sparsity is None:
            raise BackendError(f"{where} 'auto': the checkpoint is {d.describe()}; VSA would run it off its training. "
                               "To run sparse anyway choose a recipe explicitly (the report marks it as an override)")
        return RecipeChoice("auto", keep_percent_of(d.sparsity), d.sparsity, d.recipe.label, d)
    from ..kernels.vsa_select import sparsity_from_keep_percent

    pct = float(keep_percent)
    sp = sparsity_from_keep_percent(pct)
    rc = RecipeChoice("explicit", pct, sp, choice, d)
    if d.recipe is not None:
        if d.sparsity is None:
            rc.override = (f"the checkpoint is {d.recipe.label} (distilled dense, by {'; '.join(d.reasons)}); "
                           f"running VSA at keep {pct:g}% as chosen")
        elif not math.isclose(sp, d.sparsity, rel_tol=0, abs_tol=1e-9):
            rc.override = (f"the checkpoint states sparsity {d.sparsity:g} (keep {keep_percent_of(d.sparsity):g}%, "
                           f"{d.recipe.label}); running keep {pct:g}% (sparsity {sp:g}) as chosen")
    return rc


# ------------------------------------------------------------------------------------------------ provenance.json
def load_provenance(path: str | os.PathLike) -> dict:
    """The identity fields of a FastVideo ``provenance.json`` (``model_id``, ``base_model``): at most 64 KiB, UTF-8,
    strict JSON object. Only short plain strings are kept; nothing else from the file is echoed."""
    from ..loaders.safetensors_io import strict_json_loads

    path = os.fspath(path)
    where = f"'{path}'"
    raw = read_user_file(path, MAX_SIDECAR_BYTES, f"FastVideo {PROVENANCE_FILE}", CheckpointError)  # opened once
    try:
        obj = strict_json_loads(raw.decode("utf-8"), where, what=f"FastVideo {PROVENANCE_FILE}")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: not UTF-8 text") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: must hold a JSON object")
    return {k: obj[k] for k in ("model_id", "base_model") if isinstance(obj.get(k), str) and _SAFE_TEXT.match(obj[k])}


def safe_metadata(meta) -> dict:
    """The identity keys of a safetensors ``__metadata__`` (short plain strings only)."""
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if k in METADATA_ID_KEYS and isinstance(v, str) and _SAFE_TEXT.match(v)}

