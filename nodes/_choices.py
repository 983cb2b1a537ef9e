"""Combo option lists computed when ComfyUI asks for a node's schema.

ComfyUI builds a V3 node's inputs by calling ``define_schema`` on every ``/object_info`` request (and on prompt
validation), so a list computed here is re-read whenever the frontend refreshes its node definitions (the
``R`` key / "Refresh node definitions"), like the folder_paths-based lists of the stock loaders.

* :func:`coefficient_choices`: the TeaCache coefficient files a user can pick: the calibrated files in
  ``<output>/ditkit/teacache/`` (what DitKitTeaCacheCalibrate writes; sub-folders allowed, its ``pairs_*.json``
  pair files are not coefficient files) and the shipped files as ``shipped:<name>``. The folder is walked without
  following symlinks (the TeaCache reader refuses them, so listing them would offer a choice that fails), at most
  :data:`MAX_DEPTH` folders deep and :data:`MAX_LISTED` names.
"""
from __future__ import annotations

import os
import stat

from ..bridge.files import output_directory
from ..cache import coefficients as coef

TEACACHE_PARTS = ("ditkit", "teacache")
MAX_DEPTH = 4
MAX_LISTED = 500


def teacache_folder() -> str:
    return os.path.join(output_directory(), *TEACACHE_PARTS)


def calibrated_files(base: str | None = None) -> list[str]:
    """Names (relative to ``base``, '/'-separated, sorted) of the ``*.json`` coefficient files below ``base``."""
    base = teacache_folder() if base is None else base
    out: list[str] = []

    def walk(folder: str, rel: tuple[str, ...]) -> None:
        if len(rel) > MAX_DEPTH or len(out) >= MAX_LISTED:
            return
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            try:
                mode = e.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode):
                walk(e.path, rel + (e.name,))
            elif stat.S_ISREG(mode) and e.name.endswith(".json") and not e.name.startswith("pairs_") \
                    and len(out) < MAX_LISTED:
                out.append("/".join(rel + (e.name,)))

    walk(base, ())
    return out


def coefficient_choices() -> list[str]:
    """Calibrated files first (the user's own), then the shipped ones."""
    return calibrated_files() + [f"shipped:{n}" for n in coef.shipped_defaults()]
