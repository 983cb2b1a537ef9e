"""Which model family a file holds, from its safetensors header only (no tensor is read), for the loader lists:
a loader lists only files of the family it loads (the stock loaders list every file of the folder).

The header is read with ditkit's safe reader (``loaders/safetensors_io.read_header``: the 8-byte length and the
JSON, checked against the file size) and the verdict is cached per (path, size, mtime), so refreshing the node
definitions re-reads only new or changed files. A file whose header cannot be read is not listed (its loader
would refuse it). Families are told apart by tensor names the loaders themselves rely on:

* ``h3_dit``: MiniMax H3 DiT in ditkit's official or ComfyUI names (``audio_patch_proj.*``) or diffusers names
  (``audio_proj_in.*``); LTX-2's ``audio_patchify_proj`` is a different name.
* ``zimage``: NextDiT (``cap_embedder.*``, ``noise_refiner.*``, ``x_embedder.*``).
* ``ltx2``: LTX-2 / LTX-Video (``adaln_single.emb.timestep_embedder.linear_1.bias``, ComfyUI's own marker).
* ``flux2``: FLUX.2 (``double_stream_modulation_img.lin.weight``, ComfyUI's own marker).
* ``h3_vae``: H3 video / image / audio VAEs (``vae/h3_layout.classify_vae_keys``).
* ``lokr``: LoKr factors (``*.lokr_w1``, ``*.lokr_w1_a``, ``*.lokr_w2``, ...; ``loaders/lokr_apply.FACTOR_KEYS``).

A ``model.diffusion_model.`` prefix (full checkpoints) is ignored. Folders (sharded checkpoints) are listed by the
loader itself, once.
"""
from __future__ import annotations

import os
import threading

from ..loaders.lokr_apply import FACTOR_KEYS
from ..loaders.safetensors_io import read_header
from ..vae.h3_layout import classify_vae_keys

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_cache: dict[tuple[str, int, int], frozenset[str]] = {}
_lock = threading.Lock()


def _strip(k: str) -> str:
    for p in PREFIXES:
        if k.startswith(p):
            return k[len(p):]
    return k


def header_keys(path: str) -> frozenset[str] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _cache:
            return _cache[key]
    try:
        keys = frozenset(read_header(path).keys())
    except Exception:  # noqa: BLE001 - unreadable header: listed, the loader refuses it with the reason
        return None
    with _lock:
        if len(_cache) > 4096:
            _cache.clear()
        _cache[key] = keys
    return keys


def family_of_keys(keys) -> set[str]:
    ks = {_strip(k) for k in keys}
    tops = {k.split(".", 1)[0] for k in ks}
    out = set()
    if "audio_patch_proj" in tops or "audio_proj_in" in tops:
        out.add("h3_dit")
    if {"cap_embedder", "noise_refiner", "x_embedder"} <= tops:
        out.add("zimage")
    if "adaln_single.emb.timestep_embedder.linear_1.bias" in ks:
        out.add("ltx2")
    if "double_stream_modulation_img.lin.weight" in ks:
        out.add("flux2")
    if classify_vae_keys(ks) in ("h3_video", "h3_audio"):
        out.add("h3_vae")
    if any(k.rsplit(".", 1)[-1] in FACTOR_KEYS for k in ks):
        out.add("lokr")
    return out


def is_family(path: str, family: str) -> bool:
    """Whether the header says ``family``. A file whose header cannot be read is listed (its family cannot be
    decided from the header): picking it gets the loader's error naming what is wrong, not a silent absence."""
    keys = header_keys(path)
    return keys is None or family in family_of_keys(keys)


def family_files(folder: str, family: str) -> list[str]:
    """``_files.safetensors_files(folder)`` restricted to the files whose header says ``family``."""
    import folder_paths

    from . import _files

    roots = folder_paths.get_folder_paths(folder)
    out = []
    for name in _files.safetensors_files(folder):
        path = next((os.path.join(r, name) for r in roots if _files.is_regular_file(os.path.join(r, name))), None)
        if path is not None and is_family(path, family):
            out.append(name)
    return out
