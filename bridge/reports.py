"""Where ditkit's reports go in ComfyUI: the executing prompt and node, the websocket event, progress bars.

The one report sink of the pack. A node sends the report of its own execute with :func:`send_report`; a feature
that reports later (from a wrapper, while another node executes, maybe in a later prompt) is handed a
:class:`ReportTarget` by its node (``report_target(node_id, NODE_ID)`` at execute time) and calls
``target.send(kind, summary, data)``: every bridge feature gets its sink injected that way (TeaCache, AdaLN,
VSA-H3, text-encoder streaming), so ``bridge/`` never imports ``nodes/``.

Payload of the ``ditkit.report`` websocket event (badge in ``web/js/ditkit.js``): ``{"node": <unique_id>,
"node_type": <node id>, "kind": <feature>, "summary": <short text>, "data": <json-able dict>, "prompt_id": ...}``.

Runtime reports are addressed through a :class:`ReportTarget`, which resolves, when the report is sent, to the
node(s) of the *current* prompt that produced the patched object: ComfyUI serves a node's cached output to any
later prompt whose node has the same input signature (the node's literal inputs and its ordered ancestry, ids
left out), whatever its id. A report whose node is not in the current prompt is logged and sent with
``"node": null`` (drawn on no node) rather than on a guessed one.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Callable

from ..report import Report, jsonable

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
    """Whether a prompt input is a link, as ComfyUI's cache keys decide it (its own ``is_link``, called: the
    signature must split inputs exactly as the host does; host contract entry ``comfy_execution.graph_utils.is_link``)."""
    from comfy_execution.graph_utils import is_link

    return bool(is_link(v))


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

    def send(self, kind: str, summary: "str | Report", data: dict | None = None) -> dict:
        """The sink a bridge feature is handed: :func:`send_report` to this target, as its node type."""
        return send_report(self, self.node_type, kind, summary, data)

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
        inst = _server()
        if inst is not None:
            inst.send_sync(REPORT_EVENT, payload)
            # progress text is shown only on the executing node: for the others it is dropped by the frontend
            if node_id is not None and (executing is None or str(executing) == node_id):
                inst.send_progress_text(summary, node_id)
    except Exception:  # noqa: BLE001 - UI delivery is best effort; the log line above always exists
        log.debug("[ditkit] could not deliver report to UI", exc_info=True)
    return payload


def _server():
    """ComfyUI's running ``PromptServer`` instance, or None (no server: tests, the CLI)."""
    try:
        from server import PromptServer
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def send_progress_text(text: str, node_id: str) -> None:
    """Progress text on node ``node_id`` (best effort; nothing without a server)."""
    inst = _server()
    if inst is not None:
        inst.send_progress_text(text, str(node_id))


def progress(total: int, node_id: str | None = None) -> Callable[[int, int], None]:
    """A ``callback(done, total)`` driving ComfyUI's progress bar for this node."""
    import comfy.utils

    bar = comfy.utils.ProgressBar(max(int(total), 1), node_id=node_id)

    def cb(done: int, tot: int | None = None) -> None:
        bar.update_absolute(int(done), int(tot) if tot is not None else None)

    return cb


def lazy_bar(node_id: str | None) -> Callable[[int, int], None]:
    """A ``cb(done, total)`` that creates this node's ComfyUI progress bar on its first call. A new bar starts
    whenever ``done`` goes back (a new phase or pass), so each phase runs from 0 to its own total. With
    ``node_id=None`` ComfyUI attributes the bar to the node executing at that moment."""
    bar = None
    last = None

    def cb(done: int, total: int) -> None:
        nonlocal bar, last
        if bar is None or last is None or done < last:
            bar = progress(total, node_id)
        last = done
        bar(done, total)

    return cb


def offset_bar(cb: Callable[[int, int], None], offset: int, total: int) -> Callable[[int, int], None]:
    """``cb`` seen from one part of a larger job: part-local ``done`` maps to ``offset + done`` of ``total``."""
    def part(done: int, _part_total: int) -> None:
        cb(offset + done, total)

    return part
