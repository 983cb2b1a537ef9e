"""Shared helpers for ditkit nodes: reports to the UI, progress bars, memory checks.

Reports: every ditkit node that patches, loads or decodes sends one ``ditkit.report`` websocket event after it ran
(rendered as a badge by ``web/js/ditkit.js``) and writes one log line. Where the report goes in ComfyUI (the
executing prompt, the websocket, progress bars) is the host layer's ``bridge/reports.py``, the pack's one report
sink; its names are re-exported here for the node modules. Features that report later, from wrappers, are handed
a :class:`ReportTarget` by their node (``report_target(node_id, NODE_ID)``) and send through it.
"""
from __future__ import annotations

# model-family checks live in bridge/models.py; re-exported for the nodes that import it from here
from ..bridge.models import h3_diffusion_model  # noqa: F401
from ..bridge.memory import check_memory_split, device_budget  # noqa: F401
from ..bridge.reports import (REPORT_EVENT, ReportTarget, current_graph, graph_view, log,  # noqa: F401
                              node_signature, progress, report_target, send_report)


def ui_report(payload: dict) -> dict:
    """The ``ui`` dict of a NodeOutput carrying a report (kept in /history outputs too).

    Without ``node`` / ``prompt_id``: ComfyUI caches this dict with the output and replays it (``executed``
    event, /history) for whichever node is served that cached output later, under that node's id."""
    return {"ditkit_report": [{k: v for k, v in payload.items() if k not in ("node", "prompt_id")}]}


def adapter_report_lines(plan) -> list[str]:
    """The closing lines of an adapter loader's report (DitKitLoKrLoader, DitKitAdapterLoader): every key the
    plan did not use and every module it refused, with why, then its notes."""
    return ([f"unused {k}: {why}" for k, why in plan.unused.items()]
            + [f"refused {k}: {why}" for k, why in plan.refused.items()]
            + [f"note: {n}" for n in plan.notes])
