"""Host checks at load time (plain Python; nothing imported from ComfyUI here)."""
from __future__ import annotations

import importlib.util


def optional_features() -> dict[str, bool]:
    """Which optional pieces are importable. Nodes that need a missing one still register and explain."""
    return {name: importlib.util.find_spec(name) is not None for name in ("triton", "av", "comfy_kitchen")}


def check_host(log) -> dict[str, bool]:
    feats = optional_features()
    missing = [k for k, v in feats.items() if not v]
    if missing:
        log.info("[ditkit] optional packages not installed: %s (nodes needing them explain at run time)",
                 ", ".join(missing))
    return feats
