"""``comfy_kitchen``: registered so the node and the report can say why it never runs. comfy_kitchen (0.2.31) has
no index-driven block-sparse op (its ``sol_attn`` picks its own tiles from int8-quantized scores), so there is no
launcher and choosing it raises with the reason from the check below.
"""
from __future__ import annotations

from typing import Optional

from .block_sparse import OP
from .registry import REGISTRY, Impl, Query, package_available


def _comfy_kitchen_check(q: Query, explicit: bool) -> Optional[str]:
    if not package_available("comfy_kitchen"):
        return "comfy_kitchen is not installed"
    import comfy_kitchen as ck

    try:
        from importlib.metadata import version

        ver = version("comfy-kitchen")
    except Exception:  # noqa: BLE001
        ver = getattr(ck, "__version__", "?")
    if not hasattr(ck, "sol_attn"):
        return (f"comfy_kitchen {ver} has no block-sparse attention op "
                "(its dense flash/sage/int8 attention cannot take a tile selection)")
    return ("comfy_kitchen.sol_attn selects its own tiles from int8-quantized scores; it has no index-driven "
            "entry point, so it cannot reproduce FastVideo's fp32 top-k selection")


REGISTRY.impl(OP, Impl("comfy_kitchen", None, _comfy_kitchen_check, priority=30, placeholder=True))
