"""Shared helpers for ditkit nodes: reports to the UI, progress bars, log lines.

Reports: every ditkit node that patches, loads or decodes sends one ``ditkit.report`` websocket event
after it ran (rendered as a badge by ``web/js/ditkit.js``) and writes one log line. The payload is
``{"node": <unique_id>, "node_type": <node id>, "kind": <feature>, "summary": <short text>,
"data": <json-able dict>, "prompt_id": <prompt it was sent in>}``.

Runtime reports (per-sampling cache counters, the sparse-attention run, text-encoder streaming) are sent from
wrappers while *another* node executes, possibly in a later prompt: ComfyUI serves a node's cached output to
any later prompt whose node has the same input signature, whatever its id, so the id captured at execute time
may name a different node there (a VSA report drawn on a CLIP Text Encode node). Such reports are therefore
addressed through a :class:`ReportTarget` (``report_target(node_id, NODE_ID)`` at execute time, passed to
``send_report`` at run time), which resolves, when the report is sent, to the node(s) of the *current* prompt
that produced the patched object: the same class and the same input signature (ComfyUI's cache-key structure:
the node's literal inputs and its ordered ancestry, ids left out). A report whose node is not in the current
prompt is logged and sent with ``"node": null`` (the UI draws it on no node) rather than on a guessed one.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Callable

from ..report import Report, jsonable

# model-family checks live in bridge/models.py; re-exported for the nodes that import it from here
from ..bridge.models import h3_diffusion_model  # noqa: F401

log = logging.getLogger("ditkit")

REPORT_EVENT = "ditkit.report"


# -------------------------------------------------------------------------------------- where reports go

def _executing() -> tuple[str | None, str | None]:
    """(prompt id, node id) of the node ComfyUI is executing now; (None, None) outside a prompt."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None, None
    ctx = get_executing_context()
    return (ctx.prompt_id, ctx.node_id) if ctx is not None else (None, None)


def _progress_registry():
    try:
        import comfy_execution.progress as progress
    except ImportError:
        return None
    return getattr(progress, "global_progress_registry", None)


def current_graph(prompt_id: str | None = None):
    """The graph of the prompt being executed (``prompt_id``, default: the current one) as a
    ``(get(node_id) -> node dict | None, node ids)`` pair, or None when it cannot be read."""
    pid = prompt_id if prompt_id is not None else _executing()[0]
    reg = _progress_registry()
    if pid is None or reg is None or getattr(reg, "prompt_id", None) != pid:
        return None
    return graph_view(getattr(reg, "dynprompt", None))


def graph_view(graph):
    """``(get, ids)`` over a ComfyUI ``DynamicPrompt`` or an API-format prompt dict; None for anything else."""
    if graph is None:
        return None
    if isinstance(graph, dict):
        return (lambda nid: graph.get(str(nid))), [str(k) for k in graph]
    if hasattr(graph, "get_node") and hasattr(graph, "has_node"):
        def get(nid):
            try:
                return graph.get_node(str(nid)) if graph.has_node(str(nid)) else None
            except Exception:  # noqa: BLE001 - NodeNotFoundError and friends: not in this graph
                return None

        return get, [str(k) for k in graph.all_node_ids()]
    return None


def _is_link(v) -> bool:
    # comfy_execution.graph_utils.is_link
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], (int, float)) \
        and not isinstance(v[1], bool)


def _ordered_ancestry(get, node_id: str) -> list[str]:
    """Ancestors in ComfyUI's order (depth first, inputs by sorted name, first visit wins)."""
    order: list[str] = []
    seen: set[str] = set()
    def children(nid):
        node = get(nid)
        inputs = (node or {}).get("inputs") or {}
        return iter([inputs[k][0] for k in sorted(inputs) if _is_link(inputs[k])])

    stack = [children(node_id)]
    while stack:
        nxt = next(stack[-1], None)
        if nxt is None:
            stack.pop()
            continue
        if nxt in seen:
            continue
        seen.add(nxt)
        order.append(nxt)
        stack.append(children(nxt))
    return order


def node_signature(get, node_id: str) -> str | None:
    """Hash of a node's class, literal inputs and ordered ancestry, without node ids: two nodes ComfyUI would
    serve the same cached output to have the same signature (ComfyUI also keys on IS_CHANGED, which only splits
    further). None when the node is not in the graph."""
    node = get(str(node_id))
    if node is None:
        return None
    ancestors = _ordered_ancestry(get, str(node_id))
    index = {a: i for i, a in enumerate(ancestors)}

    def immediate(nid):
        n = get(nid)
        if n is None:
            return ["<missing>"]
        inputs = n.get("inputs") or {}
        sig: list = [n.get("class_type")]
        for k in sorted(inputs):
            v = inputs[k]
            sig.append([k, ["ANCESTOR", index.get(v[0], -1), v[1]]] if _is_link(v) else [k, v])
        return sig

    body = [immediate(str(node_id))] + [immediate(a) for a in ancestors]
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()


class ReportTarget:
    """The node a runtime report belongs to, resolved in the prompt that is executing when it is sent."""

    def __init__(self, node_id: str | None, node_type: str, prompt_id: str | None, signature: str | None):
        self.node_id = None if node_id is None else str(node_id)
        self.node_type = node_type
        self.prompt_id = prompt_id
        self.signature = signature
        self._last: tuple | None = None      # ((prompt, executing node), resolution): per-step reports resolve once

    def __repr__(self) -> str:
        return f"ReportTarget({self.node_type} #{self.node_id}, prompt {self.prompt_id})"

    def resolve(self) -> tuple[list[str | None], str]:
        """(node ids of the current prompt, how they were found)."""
        pid, executing = _executing()
        if pid is None or self.prompt_id is None:
            return [self.node_id], "no prompt context"
        if pid == self.prompt_id:
            return [self.node_id], "executed in this prompt"
        if self._last is None or self._last[0] != (pid, executing):
            self._last = ((pid, executing), self._locate(pid, executing))
        return self._last[1]

    def _locate(self, pid: str, executing: str | None) -> tuple[list[str | None], str]:
        view = current_graph(pid)
        if view is None or self.signature is None:
            return [], f"#{self.node_id} of prompt {self.prompt_id}; this prompt's graph is not readable"
        get, ids = view
        found = [n for n in ids if (get(n) or {}).get("class_type") == self.node_type
                 and node_signature(get, n) == self.signature]
        if len(found) > 1 and executing is not None:
            upstream = set(_ordered_ancestry(get, str(executing)))
            found = [n for n in found if n in upstream] or found
        if not found:
            return [], (f"made by #{self.node_id} of prompt {self.prompt_id}; no {self.node_type} with the same "
                        "inputs in this prompt")
        return sorted(found, key=_id_key), f"cached output of #{self.node_id} (prompt {self.prompt_id})"


def _id_key(nid: str):
    return (0, int(nid), "") if nid.isdigit() else (1, 0, nid)


def report_target(node_id: str | None, node_type: str) -> ReportTarget:
    """Call in ``execute``: the target for reports sent later by this node's wrappers."""
    pid, _ = _executing()
    sig = None
    view = current_graph(pid) if pid is not None else None
    if view is not None and node_id is not None:
        sig = node_signature(view[0], str(node_id))
    return ReportTarget(node_id, node_type, pid, sig)


def send_report(node_id: "str | ReportTarget | None", node_type: str, kind: str, summary: "str | Report",
                data: dict | None = None) -> dict:
    """Log a report line and push it to the UI. Returns the payload (also used as the node's ``ui`` dict).

    ``node_id`` is the executing node's id (reports sent from ``execute``) or a :class:`ReportTarget` (reports
    sent later from wrappers), resolved now to the node(s) of the current prompt. ``summary`` is the text, or a
    core :class:`~ditkit.report.Report`: then its ``summary()`` is the text and its ``as_dict()`` the data, with
    ``data`` (if any) merged over it."""
    if isinstance(summary, Report):
        data = {**summary.as_dict(), **(data or {})}
        summary = summary.summary()
    pid, executing = _executing()
    if isinstance(node_id, ReportTarget):
        ids, how = node_id.resolve()
        if not ids:
            log.warning("[ditkit] %s %s report not attached to a node: %s", node_type, kind, how)
            ids = [None]
        elif ids != [node_id.node_id]:
            log.debug("[ditkit] %s %s report for node(s) %s: %s", node_type, kind, ids, how)
    else:
        ids = [None if node_id is None else str(node_id)]
    payloads = [_deliver(n, node_type, kind, summary, data, pid, executing) for n in ids]
    return payloads[0]


def _deliver(node_id, node_type, kind, summary, data, prompt_id, executing) -> dict:
    payload = {"node": node_id, "node_type": node_type, "kind": kind, "summary": summary,
               "data": jsonable(data or {}), "prompt_id": prompt_id}
    log.info("[ditkit] %s #%s %s: %s", node_type, node_id if node_id is not None else "?", kind, summary)
    try:
        from server import PromptServer

        inst = getattr(PromptServer, "instance", None)
        if inst is not None:
            inst.send_sync(REPORT_EVENT, payload)
            # progress text is shown only on the executing node: for the others it is dropped by the frontend
            if node_id is not None and (executing is None or str(executing) == node_id):
                inst.send_progress_text(summary, node_id)
    except Exception:  # noqa: BLE001 - UI delivery is best effort; the log line above always exists
        log.debug("[ditkit] could not deliver report to UI", exc_info=True)
    return payload


def ui_report(payload: dict) -> dict:
    """The ``ui`` dict of a NodeOutput carrying a report (kept in /history outputs too).

    Without ``node`` / ``prompt_id``: ComfyUI caches this dict with the output and replays it (``executed``
    event, /history) for whichever node is served that cached output later, under that node's id."""
    return {"ditkit_report": [{k: v for k, v in payload.items() if k not in ("node", "prompt_id")}]}


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




def adapter_report_lines(plan) -> list[str]:
    """The closing lines of an adapter loader's report (DitKitLoKrLoader, DitKitAdapterLoader): every key the
    plan did not use and every module it refused, with why, then its notes."""
    return ([f"unused {k}: {why}" for k, why in plan.unused.items()]
            + [f"refused {k}: {why}" for k, why in plan.refused.items()]
            + [f"note: {n}" for n in plan.notes])
