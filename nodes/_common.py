"""Shared helpers for ditkit nodes: reports to the UI, progress bars, log lines.

Reports: every ditkit node that patches, loads or decodes sends one ``ditkit.report`` websocket event
after it ran (rendered as a badge by ``web/js/ditkit.js``) and writes one log line. The payload is
``{"node": <unique_id>, "node_type": <node id>, "kind": <feature>, "summary": <short text>,
"data": <json-able dict>}``. Runtime reports (e.g. per-sampling cache counters) are sent the same way
from the wrappers, keyed by the node id captured when the node executed.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

log = logging.getLogger("ditkit")

REPORT_EVENT = "ditkit.report"


def send_report(node_id: str | None, node_type: str, kind: str, summary: str, data: dict | None = None) -> dict:
    """Log a report line and push it to the UI. Returns the payload (also used as the node's ``ui`` dict)."""
    payload = {"node": node_id, "node_type": node_type, "kind": kind, "summary": summary,
               "data": _jsonable(data or {})}
    log.info("[ditkit] %s #%s %s: %s", node_type, node_id, kind, summary)
    try:
        from server import PromptServer

        inst = getattr(PromptServer, "instance", None)
        if inst is not None:
            inst.send_sync(REPORT_EVENT, payload)
            if node_id is not None:
                inst.send_progress_text(summary, node_id)
    except Exception:  # noqa: BLE001 - UI delivery is best effort; the log line above always exists
        log.debug("[ditkit] could not deliver report to UI", exc_info=True)
    return payload


def ui_report(payload: dict) -> dict:
    """The ``ui`` dict of a NodeOutput carrying a report (kept in /history outputs too)."""
    return {"ditkit_report": [payload]}


def progress(total: int, node_id: str | None = None) -> Callable[[int, int], None]:
    """A ``callback(done, total)`` driving ComfyUI's progress bar for this node."""
    import comfy.utils

    bar = comfy.utils.ProgressBar(max(int(total), 1), node_id=node_id)

    def cb(done: int, tot: int | None = None) -> None:
        bar.update_absolute(int(done), int(tot) if tot is not None else None)

    return cb


def device_budget(device) -> tuple[int, str]:
    """(bytes, wording) a decode/encode may plan to use on ``device``, for the pre-flight memory checks
    (``vae/preflight.py``): the total memory of an accelerator (ComfyUI offloads other models to make room), the
    free RAM on the CPU."""
    import comfy.model_management as mm
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return int(mm.get_free_memory(dev)), "of RAM free"
    return int(mm.get_total_memory(dev)), f"of memory on {dev}"


def check_memory_split(node: str, input_name: str, shape, device, device_parts: dict, host_parts: dict) -> None:
    """``vae/preflight.check_memory`` against the right budgets: everything against free RAM when ``device`` is the
    CPU; else what lives on the device against its memory and what lives on the host against free RAM."""
    import torch

    from ..vae import preflight

    if torch.device(device).type == "cpu":
        budget, where = device_budget("cpu")
        preflight.check_memory(node, input_name, shape, {**device_parts, **host_parts}, budget, where)
        return
    budget, where = device_budget(device)
    preflight.check_memory(node, input_name, shape, device_parts, budget, where)
    if host_parts:
        budget, where = device_budget("cpu")
        preflight.check_memory(node, input_name, shape, host_parts, budget, where)


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return str(obj)
