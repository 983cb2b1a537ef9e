"""HTTP / websocket client of a ComfyUI server: queue ``/prompt``, follow progress, read ``/history``, fetch outputs.

Standard library only. :class:`ComfyClient` raises :class:`~.common.WorkflowFailed` when the server rejects or
fails a workflow and :class:`~.common.RunnerError` when it cannot be reached; the ``format_*`` helpers turn the
server's error payloads into readable text.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from ..loaders import safe_fs
from .common import RunnerError, WorkflowFailed, short


# ----------------------------------------------------------------------------------- history / errors

def format_node_errors(body: Any, graph: dict | None = None) -> str:
    """Readable text for a /prompt HTTP 400 body (``error`` + per-node ``node_errors``)."""
    if not isinstance(body, dict):
        return f"server rejected the prompt: {short(body)}"
    lines = []
    err = body.get("error")
    if isinstance(err, dict):
        head = err.get("message") or err.get("type") or "prompt rejected"
        det = err.get("details")
        lines.append(f"prompt rejected ({err.get('type', '?')}): {head}" + (f": {det}" if det else ""))
    elif err:
        lines.append(f"prompt rejected: {short(err)}")
    for nid, ne in sorted((body.get("node_errors") or {}).items(), key=lambda kv: str(kv[0])):
        ctype = (ne or {}).get("class_type") or ((graph or {}).get(nid) or {}).get("class_type", "?")
        for e in (ne or {}).get("errors") or [{}]:
            inp = (e.get("extra_info") or {}).get("input_name")
            msg = e.get("message") or e.get("type") or "error"
            det = e.get("details")
            lines.append(f"  node {nid} ({ctype})" + (f" input {inp!r}" if inp else "") + f": {msg}"
                         + (f" - {short(det)}" if det else ""))
    return "\n".join(lines) if lines else f"server rejected the prompt: {short(body)}"


def history_messages(entry: dict, kind: str) -> list[dict]:
    out = []
    for m in ((entry or {}).get("status") or {}).get("messages") or []:
        if isinstance(m, (list, tuple)) and len(m) == 2 and m[0] == kind and isinstance(m[1], dict):
            out.append(m[1])
    return out


def format_execution_errors(entry: dict, traceback_lines: int = 6) -> str:
    """Readable text for a failed /history entry (``execution_error`` / ``execution_interrupted``)."""
    lines = []
    for e in history_messages(entry, "execution_error"):
        lines.append(f"node {e.get('node_id')} ({e.get('node_type')}) raised {e.get('exception_type')}: "
                     f"{e.get('exception_message', '').strip()}")
        tb = [ln.rstrip() for ln in (e.get("traceback") or []) if ln.strip()]
        if tb and traceback_lines:
            lines.append("  traceback (last lines):")
            lines += ["    " + ln for chunk in tb[-traceback_lines:] for ln in chunk.splitlines()]
    for e in history_messages(entry, "execution_interrupted"):
        lines.append(f"interrupted at node {e.get('node_id')} ({e.get('node_type')})")
    if not lines:
        st = (entry or {}).get("status") or {}
        lines.append(f"workflow did not succeed (status {st.get('status_str')!r}, completed={st.get('completed')})")
    return "\n".join(lines)


def output_items(entry: dict) -> list[tuple[str, str, dict]]:
    """``(node_id, kind, item)`` for every item of every node's outputs in a /history entry."""
    out = []
    for nid, outs in ((entry or {}).get("outputs") or {}).items():
        for kind, items in (outs or {}).items():
            for it in items if isinstance(items, list) else [items]:
                out.append((str(nid), kind, it))
    return out


def output_files(entry: dict, out_dir=None, temp_dir=None) -> list[Path | str]:
    """Paths of the files a /history entry lists (absolute when the output dir is known)."""
    files = []
    for _nid, _kind, it in output_items(entry):
        if isinstance(it, dict) and isinstance(it.get("filename"), str):
            rel = Path(it.get("subfolder") or "") / it["filename"]
            base = {"output": out_dir, "temp": temp_dir}.get(it.get("type") or "output")
            files.append(Path(base) / rel if base is not None else f"{it.get('type', 'output')}/{rel.as_posix()}")
    return files


def ditkit_reports(entry: dict) -> list[dict]:
    """The ditkit reports of a /history entry, each with ``node`` = the output's node id (the stored ``ui``
    payload does not name it: ComfyUI replays a cached one for whichever node is served that output)."""
    return [{**it, "node": n} for n, kind, it in output_items(entry)
            if kind == "ditkit_report" and isinstance(it, dict)]



class _WebSocket:
    """Minimal RFC 6455 client (stdlib): enough to read ComfyUI's /ws events."""

    GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

    def __init__(self, url: str, timeout: float = 5.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http":
            raise OSError("websocket progress needs a plain http:// server URL")
        self.sock = socket.create_connection((u.hostname, u.port or 80), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        req = (f"GET {path} HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise OSError("websocket handshake: connection closed")
            self.buf += chunk
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status = head.split(b"\r\n", 1)[0]
        want = base64.b64encode(hashlib.sha1((key + self.GUID).encode()).digest())
        if b" 101 " not in status + b" " or want not in head:
            raise OSError(f"websocket handshake refused: {status.decode(errors='replace')}")
        self.sock.settimeout(None)

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("websocket closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        n = len(payload)
        hdr = bytes([0x80 | opcode]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n))
        self.sock.sendall(hdr + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv(self) -> tuple[int, bytes]:
        """Next complete data message as ``(opcode, payload)`` (1 text, 2 binary); raises EOFError on close."""
        parts, first_op = [], None
        while True:
            b0, b1 = self._read(2)
            op, fin, n = b0 & 0x0F, b0 & 0x80, b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack(">H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", self._read(8))
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            if op == 0x8:
                raise EOFError("websocket closed by server")
            if op == 0x9:
                self._send(0xA, data[:125])
                continue
            if op == 0xA:
                continue
            if op != 0:
                first_op = op
            parts.append(data)
            if fin:
                return first_op or 1, b"".join(parts)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class ProgressPrinter:
    """Turns ComfyUI websocket events into short progress lines (and collects ditkit reports)."""

    def __init__(self, graph: dict, prompt_id: str, stream=None, quiet: bool = False):
        self.graph, self.prompt_id, self.quiet = graph, prompt_id, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.reports: list[dict] = []
        self.texts: list[tuple[str, str]] = []
        self._last: tuple | None = None
        self._lock = threading.Lock()

    def _say(self, text: str) -> None:
        if not self.quiet:
            with self._lock:
                print(f"[ditkit.run] {text}", file=self.stream, flush=True)

    def node_label(self, nid) -> str:
        n = self.graph.get(str(nid)) if isinstance(self.graph, dict) else None
        return f"{nid} ({n.get('class_type')})" if isinstance(n, dict) else str(nid)

    def event(self, kind: str, data: Any) -> None:
        if not isinstance(data, dict):
            return
        pid = data.get("prompt_id")
        if pid is not None and pid != self.prompt_id:
            return
        if kind == "executing" and data.get("node") is not None:
            self._say(f"executing node {self.node_label(data['node'])}")
        elif kind == "execution_cached" and data.get("nodes"):
            self._say(f"cached: {', '.join(str(n) for n in data['nodes'])}")
        elif kind == "progress":
            v, m = data.get("value"), data.get("max")
            if isinstance(v, int) and isinstance(m, int) and m > 0:
                step = max(1, m // 10)
                key = (data.get("node"), v)
                if (v == m or v % step == 0 or v == 1) and key != self._last:
                    self._last = key
                    self._say(f"  node {self.node_label(data.get('node'))}: {v}/{m}")
        elif kind == "ditkit.report":
            self.reports.append(data)
            self._say(f"report {data.get('node_type')} #{data.get('node')} {data.get('kind')}: {data.get('summary')}")
        elif kind == "execution_error":
            self._say(f"error in node {self.node_label(data.get('node_id'))}: {data.get('exception_type')}")

    def binary(self, payload: bytes) -> None:
        if len(payload) < 8:
            return
        (etype,) = struct.unpack(">I", payload[:4])
        if etype == 3:  # progress text: node id length, node id, text
            (n,) = struct.unpack(">I", payload[4:8])
            nid, text = payload[8:8 + n].decode(errors="replace"), payload[8 + n:].decode(errors="replace")
            if str(nid) in self.graph:
                self.texts.append((nid, text))


def _ws_listen(ws: _WebSocket, printer: ProgressPrinter, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            op, payload = ws.recv()
        except (EOFError, OSError, ValueError):
            return
        if op == 1:
            try:
                msg = json.loads(payload.decode("utf-8", errors="replace"))
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict):
                printer.event(str(msg.get("type")), msg.get("data"))
        elif op == 2:
            printer.binary(payload)


# ------------------------------------------------------------------------------------------ HTTP client

class ComfyClient:
    """Talks to a ComfyUI server over HTTP (stdlib urllib)."""

    def __init__(self, url: str, *, proc: subprocess.Popen | None = None, log_path=None):
        self.url = url.rstrip("/")
        self.proc = proc
        self.log_path = log_path

    def _req(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback/user-given URL
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, OSError, ValueError) as e:  # ValueError: http.client.InvalidURL
            raise RunnerError(f"{method} {self.url}{path} failed: {getattr(e, 'reason', e)}") from None
        try:
            return status, json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            return status, raw.decode("utf-8", errors="replace")

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        status, body = self._req("GET", path, timeout=timeout)
        if status != 200:
            raise RunnerError(f"GET {self.url}{path} returned HTTP {status}: {short(body)}")
        return body

    def get_bytes(self, path: str, timeout: float = 60.0) -> bytes:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:  # noqa: S310
                return r.read()
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise RunnerError(f"GET {self.url}{path} failed: {getattr(e, 'reason', e)}") from None

    def object_info(self, node_class: str | None = None) -> dict:
        return self.get_json("/object_info" + (f"/{urllib.parse.quote(node_class)}" if node_class else ""),
                             timeout=120.0)

    def history(self, prompt_id: str) -> dict | None:
        return (self.get_json(f"/history/{prompt_id}") or {}).get(prompt_id)

    def queue(self) -> dict:
        return self.get_json("/queue")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RunnerError(f"the ComfyUI server (pid {self.proc.pid}) exited with status {self.proc.returncode}"
                              + (f"; log: {self.log_path}" if self.log_path else ""))

    def wait_ready(self, timeout: float = 180.0) -> dict:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                return self.get_json("/system_stats", timeout=5.0)
            except RunnerError as e:
                last = e
            time.sleep(0.25)
        raise RunnerError(f"ComfyUI at {self.url} did not answer /system_stats within {timeout:.0f} s ({last})")

    def post_prompt(self, graph: dict, *, client_id: str | None = None, prompt_id: str | None = None,
                    extra_data: dict | None = None) -> tuple[int, Any]:
        body: dict[str, Any] = {"prompt": graph, "client_id": client_id or uuid.uuid4().hex}
        if prompt_id is not None:
            body["prompt_id"] = prompt_id
        if extra_data:
            body["extra_data"] = extra_data
        return self._req("POST", "/prompt", body, timeout=120.0)

    def cancel(self, prompt_id: str) -> None:
        """Remove ``prompt_id`` from the queue and interrupt it if it runs (best effort)."""
        with contextlib.suppress(RunnerError):
            self._req("POST", "/queue", {"delete": [prompt_id]})
        with contextlib.suppress(RunnerError):
            running = [q[1] for q in (self.queue().get("queue_running") or []) if len(q) > 1]
            if prompt_id in running:
                self._req("POST", "/interrupt", {"prompt_id": prompt_id})

    def run(self, graph: dict, timeout: float = 900.0, *, printer: ProgressPrinter | None = None,
            quiet: bool = True, poll: float = 0.2) -> dict:
        """Queue ``graph`` and wait for its /history entry. Returns the entry on success.

        Raises :class:`WorkflowFailed` (HTTP 400 validation errors, execution errors, timeout) or
        :class:`RunnerError` (server unreachable / died)."""
        prompt_id, client_id = str(uuid.uuid4()), uuid.uuid4().hex
        printer = printer or ProgressPrinter(graph, prompt_id, quiet=quiet)
        printer.prompt_id = prompt_id
        stop, ws = threading.Event(), None
        with contextlib.suppress(OSError, ValueError):
            ws = _WebSocket(self.url + f"/ws?clientId={client_id}")
            threading.Thread(target=_ws_listen, args=(ws, printer, stop), daemon=True).start()
        try:
            status, body = self.post_prompt(graph, client_id=client_id, prompt_id=prompt_id)
            if status != 200 or not isinstance(body, dict) or "prompt_id" not in body:
                raise WorkflowFailed(format_node_errors(body, graph), status=status, body=body)
            prompt_id = printer.prompt_id = body["prompt_id"]
            t0, deadline, last_state = time.monotonic(), time.monotonic() + timeout, None
            while True:
                entry = self.history(prompt_id)
                if entry is not None and (entry.get("status") or {}).get("completed") is not None:
                    st = entry.get("status") or {}
                    if st.get("status_str") == "success" and st.get("completed"):
                        entry["_elapsed_s"] = round(time.monotonic() - t0, 3)
                        entry["_reports"] = list(printer.reports)
                        entry["_progress_text"] = list(printer.texts)
                        return entry
                    raise WorkflowFailed(format_execution_errors(entry), entry=entry)
                self._check_alive()
                if time.monotonic() > deadline:
                    self.cancel(prompt_id)
                    raise WorkflowFailed(f"workflow did not finish within {timeout:.0f} s (cancelled prompt "
                                         f"{prompt_id})")
                if ws is None:  # no websocket: say where the prompt is from /queue
                    q = self.queue()
                    running = any(len(x) > 1 and x[1] == prompt_id for x in q.get("queue_running") or [])
                    state = "running" if running else f"queued ({len(q.get('queue_pending') or [])} pending)"
                    if state != last_state:
                        printer._say(f"prompt {prompt_id}: {state}")
                        last_state = state
                time.sleep(poll)
        finally:
            stop.set()
            if ws is not None:
                ws.close()



# ---------------------------------------------------------------------------------------- outputs

def download_outputs(client: ComfyClient, entry: dict, out_dir: Path) -> list[Path]:
    """Fetch the entry's output files from ``/view`` into ``out_dir``. The server's ``subfolder`` and ``filename``
    are names from another process: each is validated (no ``..``, absolute path, NUL or control characters), the
    folders below ``out_dir`` are created without following symlinks, and a file is published under a free name
    (``name``, ``name_1``, ...) with a rename that never replaces anything already there."""
    got = []
    with safe_fs.SafeDir.open_root(out_dir, (), create=True, error=RunnerError, what="--out folder") as root:
        for _nid, _kind, it in output_items(entry):
            if not (isinstance(it, dict) and isinstance(it.get("filename"), str)):
                continue
            sub, fname = it.get("subfolder") or "", it["filename"]
            if not isinstance(sub, str):
                raise RunnerError(f"the server returned a non-string output subfolder {sub!r}")
            parts = safe_fs.validate_name(sub, f"server output subfolder {sub!r}", RunnerError,
                                          allow_subdirs=True) if sub else []
            safe_fs.validate_name(fname, f"server output file name {fname!r}", RunnerError)
            q = urllib.parse.urlencode({"filename": fname, "subfolder": sub, "type": it.get("type") or "output"})
            data = client.get_bytes(f"/view?{q}")
            d = root
            opened = []
            try:
                for part in parts:
                    d = d.subdir(part, create=True)
                    opened.append(d)
                stem, dot, ext = fname.rpartition(".") if "." in fname else (fname, "", "")
                for i in range(1000):
                    name = fname if i == 0 else f"{stem}_{i}{dot}{ext}"
                    if d.lstat(name) is None:
                        try:
                            got.append(Path(safe_fs.write_file(d, name, data)))
                            break
                        except RunnerError:
                            if d.lstat(name) is None:
                                raise
                else:
                    raise RunnerError(f"no free name for {fname!r} in {d.path} after 1000 tries")
            finally:
                for o in reversed(opened):
                    o.close()
    return got

