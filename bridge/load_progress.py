"""Progress of a quantizing load on the node the user sees: a text line under the node (tensors done / total,
MB/s of source read, elapsed), next to the progress bar the loaders already drive.

ComfyUI shows a node's progress text with ``PromptServer.send_progress_text(text, node_id)`` (the ``TEXT``
binary event the frontend renders on the node); the node executing now comes from
``comfy_execution.utils.get_executing_context()``. Both are host-contract entries: a host without them gets a
named "adapted" entry (the bar only) rather than a guess. The text is throttled (at most one message per
``every`` seconds, plus the last one) so a model of thousands of tensors does not flood the websocket.

The formatting (:func:`progress_text`) and the throttle (:class:`LoadProgress`) are plain Python, tested without a
host; :func:`load_progress` binds them to the running server.
"""
from __future__ import annotations

import inspect
import sys
import time
from typing import Callable

from .contract import Probe, entry

NODES = ("DitKitH3ModelLoader", "DitKitLTX2ModelLoader", "DitKitFlux2ModelLoader", "DitKitZImageLoader")


def progress_text(what: str, done: int, total: int, bytes_done: int, seconds: float) -> str:
    """``"<what>: 12/86 tensors, 104.9 MB/s, 0.41 GB read in 3.9 s"`` (MB = 10^6 bytes, as disks are rated)."""
    rate = bytes_done / seconds / 1e6 if seconds > 0 else 0.0
    return (f"{what}: {done}/{total} tensors, {rate:.1f} MB/s, {bytes_done / 1e9:.2f} GB read in "
            f"{seconds:.1f} s")


class LoadProgress:
    """``cb(done, total, bytes_done)`` (``loaders/quantize.py`` ``quantize_stream``'s progress) -> ``send(text)``
    at most every ``every`` seconds, and always for the last tensor. ``last`` keeps the last text (the node's
    report quotes the final rate)."""

    def __init__(self, what: str, send: Callable[[str], object] | None, every: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        if not (every >= 0):
            raise ValueError(f"every must be a non-negative number of seconds, got {every!r}")
        self.what = what
        self.emit = send
        self.every = every
        self.clock = clock
        self.t0 = clock()
        self.sent_at: float | None = None
        self.sent = 0
        self.last = ""
        self.seconds = 0.0
        self.bytes_done = 0

    def __call__(self, done: int, total: int, bytes_done: int) -> None:
        now = self.clock()
        self.seconds = now - self.t0
        self.bytes_done = bytes_done
        self.last = progress_text(self.what, done, total, bytes_done, self.seconds)
        if self.emit is None:
            return
        if done >= total or self.sent_at is None or now - self.sent_at >= self.every:
            self.sent_at = now
            self.sent += 1
            self.emit(self.last)


def _server():
    try:
        import server
    except ImportError:
        return None
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def _executing_node() -> str | None:
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    ctx = get_executing_context()
    return getattr(ctx, "node_id", None) if ctx is not None else None


def load_progress(what: str, node_id: str | None = None) -> LoadProgress:
    """A :class:`LoadProgress` whose text goes to ``node_id`` (default: the node ComfyUI is executing) through the
    running server; outside a server (tests, the converter) it only keeps ``last``."""
    srv = _server()
    nid = node_id if node_id is not None else _executing_node()
    send = None
    if srv is not None and nid is not None and callable(getattr(srv, "send_progress_text", None)):
        def send(text: str) -> None:
            srv.send_progress_text(text, nid)
    return LoadProgress(what, send)


@entry("server.PromptServer.send_progress_text", nodes=NODES, what="signature",
       doc="a node's progress text: send_progress_text(text, node_id, sid=None)")
def _send_progress_text_probe() -> Probe:
    server = sys.modules.get("server")
    if server is None:
        try:
            import server
        except Exception as e:  # noqa: BLE001 - outside a running ComfyUI (e.g. a CUDA build on a CPU box)
            return Probe.adapted(f"ComfyUI's server module does not import in this process ({type(e).__name__}): "
                                 "no progress text, the progress bar only")
    fn = getattr(getattr(server, "PromptServer", None), "send_progress_text", None)
    if fn is None:
        return Probe.adapted("no PromptServer.send_progress_text: quantizing loads show the progress bar only")
    params = list(inspect.signature(fn).parameters)
    if params[:3] != ["self", "text", "node_id"]:
        return Probe.broken(f"send_progress_text takes {params}, not (self, text, node_id, ...)")
    return Probe.holds()


@entry("comfy_execution.utils.ExecutionContext[node_id]", nodes=NODES, what="attributes",
       doc="the executing node's id (ExecutionContext.node_id), where the progress text goes")
def _executing_context_probe() -> Probe:
    try:
        from comfy_execution.utils import ExecutionContext, get_executing_context  # noqa: F401
    except ImportError as e:
        return Probe.adapted(f"no executing context ({e}): quantizing loads show the progress bar only")
    fields = getattr(ExecutionContext, "_fields", ())
    if "node_id" not in fields:
        return Probe.broken(f"ExecutionContext has no node_id (fields: {list(fields)})")
    return Probe.holds()
