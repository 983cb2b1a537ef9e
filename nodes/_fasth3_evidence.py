"""What a loaded H3 MODEL says about which FastH3 checkpoint it is (host side of ``sampling/fasth3_recipe.py``).

Reads only what the model already carries (gate weights on the model or in the loader / adapter attachment, the
source path and safetensors metadata DitKitH3ModelLoader records) plus the two FastVideo sidecars next to a folder
checkpoint (``fastvideo_inference.json``, ``provenance.json``), found the way DitKitFastH3Schedule finds the
contract (inside models/diffusion_models only).
"""
from __future__ import annotations

import os

import torch

from ..sampling import fasth3 as sched
from ..sampling import fasth3_recipe as recipe_core
from . import fasth3 as fasth3_node

METADATA_ATTACHMENT = "ditkit_h3_metadata"   # set by DitKitH3ModelLoader (nodes/h3_loaders.py)


def _nonzero(w) -> bool:
    return bool(torch.count_nonzero(w).item()) if isinstance(w, torch.Tensor) else False


def gather(model, gates: dict, gate_source: str, num_blocks: int) -> recipe_core.Evidence:
    att = getattr(model, "attachments", None) or {}
    src = att.get(fasth3_node.SOURCE_ATTACHMENT)
    ev = recipe_core.Evidence(num_blocks=num_blocks, gate_blocks=len(gates), gate_source=gate_source,
                              gates_nonzero=any(_nonzero(w) for w in gates.values()) if gates else None,
                              metadata=recipe_core.safe_metadata(att.get(METADATA_ATTACHMENT)) or None)
    if isinstance(src, str):
        base = os.path.basename(os.path.normpath(src))
        if base == "transformer":
            base = os.path.basename(os.path.dirname(os.path.normpath(src)))
        ev.file_name = base
        path, _ = fasth3_node.find_contract(model, "")
        if path is not None:
            ev.contract = sched.load_contract(path)
        prov = fasth3_node.find_sidecar(model, recipe_core.PROVENANCE_FILE)
        if prov is not None:
            ev.provenance = recipe_core.load_provenance(prov)
            ev.provenance_path = prov
    return ev


def choose_recipe(model, num_blocks: int, found_gates: tuple[dict, str], preset, recipe: str, keep_percent: float,
                  where: str) -> recipe_core.RecipeChoice:
    """The node's recipe input -> :class:`~ditkit.sampling.fasth3_recipe.RecipeChoice` (``preset`` ``"auto"``: the
    checkpoint's recipe; a number: that keep percent; None: ``keep_percent``)."""
    gates, gate_source = found_gates
    ev = gather(model, gates, gate_source, num_blocks)
    if preset == "auto":
        return recipe_core.choose("auto", None, ev, where)
    return recipe_core.choose(recipe, float(preset if preset is not None else keep_percent), ev, where)
