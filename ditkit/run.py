"""Headless runner: queue a workflow on a real ComfyUI over HTTP and report what happened.

    python -m ditkit.run WORKFLOW.json [--comfyui PATH | --server URL] [--out DIR] [--python PY]
                                       [--models DIR] [--timeout S]

* ``--server URL`` uses a running ComfyUI; ``--comfyui PATH`` (else ``$COMFYUI_PATH``, else ditkit's cached host
  made by ``python -m ditkit.host setup``; the runner says which) starts one:
  ``<python> main.py --cpu --listen 127.0.0.1 --port <free port> --disable-auto-launch ...`` with an
  ``--extra-model-paths-config`` YAML whose ``custom_nodes`` entry is a temp dir holding a symlink to this
  repository (ditkit is loaded without touching the ComfyUI tree) and whose model folders point at
  ``--models DIR`` (default: the tiny test checkpoints, generated into a temp dir). The server it started is
  stopped by its pid (SIGTERM, then SIGKILL after a grace period).
* The workflow may be API format or UI (litegraph) format; UI format is converted with the server's
  ``/object_info`` (:mod:`ditkit.workflows`).
* Shows progress (websocket events when available, else queue polling), prints ditkit reports, output files,
  validation errors (HTTP 400 ``node_errors``) and execution errors (``/history`` messages).

Exit status (every failure prints one ``ERROR: ...`` / ``FAILED: ...`` line first, never a traceback):

* 0 the workflow ran;
* 1 the server refused or failed the workflow (HTTP 400 validation errors, an execution error, or the
  ``--timeout`` passed: the prompt is cancelled);
* 2 bad arguments or a bad workflow file, found before any server is started or contacted: an unknown option,
  a malformed ``--server`` URL (scheme, host, port 1..65535, no query/fragment), a timeout that is not a
  finite number > 0, a ``--port`` outside 0..65535, a missing ``--comfyui``/``--models``/``--python``; a
  workflow file that is missing, not a regular file, larger than 64 MiB, not UTF-8, not strict JSON (NaN,
  Infinity and duplicate keys are refused), nested deeper than 64 levels, or whose structure is broken (API:
  nodes that are not objects with a string ``class_type``, ``inputs`` that are not an object, links to missing
  nodes; UI: non-integer or repeated node/link ids, malformed links, links from missing nodes); also a UI
  workflow the server's node schemas cannot convert (unknown node class);
* 3 the server could not be started or reached (the server log tail is printed);
* 130 interrupted (Ctrl-C); 143 stopped by SIGTERM (the started server is stopped either way).

Standard library only (no ComfyUI import, no torch import unless tiny checkpoints are generated), so the same
code drives the integration tests (``tests/integration/conftest.py``).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable

from .errors import DitKitError
from .loaders import safe_fs
from .host import default_dir, find_host

REPO = Path(__file__).resolve().parents[1]  # the checkout: the folder ComfyUI loads as the custom node pack
PACK_LINK_NAME = "ditkit"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SERVER = 0, 1, 2, 3

# ComfyUI model folder names (folder_paths.folder_names_and_paths) pointed at --models DIR/<name>. The legacy
# names "unet" and "clip" are mapped by ComfyUI to diffusion_models / text_encoders, so DIR/unet and DIR/clip
# are searched too.
MODEL_FOLDERS = (
    "checkpoints", "diffusion_models", "unet", "vae", "text_encoders", "clip", "loras", "clip_vision",
    "controlnet", "upscale_models", "latent_upscale_models", "audio_encoders", "model_patches", "embeddings",
    "vae_approx", "style_models", "hypernetworks", "gligen", "photomaker", "diffusers", "configs",
)


class RunnerError(RuntimeError):
    """The runner could not do its job (server did not start, HTTP failure, bad workflow file)."""

    exit_code = EXIT_SERVER


class WorkflowFileError(RunnerError):
    """The workflow file is missing, unreadable, not strict JSON, too large or deep, or structurally broken."""

    exit_code = EXIT_USAGE


class WorkflowFailed(RuntimeError):
    """The server rejected or failed the workflow; ``str()`` is the formatted error report."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, status: int | None = None, body: Any = None, entry: Any = None):
        super().__init__(message)
        self.status, self.body, self.entry = status, body, entry


# --------------------------------------------------------------------------------------------- arguments

class _Parser(argparse.ArgumentParser):
    """argparse with a one-line ``ERROR: ...`` message (exit 2) instead of the usage block."""

    def error(self, message: str):
        text = " ".join(str(message).split())
        self.exit(EXIT_USAGE, f"ERROR: {text} (see: {self.prog} --help)\n")


def check_server_url(url: str) -> str:
    """``url`` without trailing slashes if it is an http(s) URL with a host and a port in 1..65535 (or none),
    no credentials, query or fragment; else ValueError with the reason."""
    if not url or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError("empty, or contains whitespace or control characters")
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as e:  # "http://[::1" (unclosed IPv6), "http://h:99999", "http://h:abc"
        raise ValueError(f"not a valid URL ({e})") from None
    if u.scheme not in ("http", "https"):
        raise ValueError("expected a URL like http://127.0.0.1:8188 (scheme http or https)")
    if not u.hostname:
        raise ValueError("expected a URL like http://127.0.0.1:8188 (no host)")
    if port == 0:
        raise ValueError("port 0 is not a server port (1..65535)")
    if u.username is not None or u.password is not None:
        raise ValueError("credentials in the URL are not supported")
    if u.query or u.fragment or url.endswith(("?", "#")):
        raise ValueError("a server URL has no query or fragment (the runner appends /prompt, /history, ...)")
    return url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="python -m ditkit.run",
        description="Queue a ComfyUI workflow (API or UI format) on a real ComfyUI and report the result.",
    )
    ap.add_argument("workflow", help="workflow JSON file (API format, or UI format converted via /object_info)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--comfyui", metavar="PATH",
                       help="ComfyUI checkout to start headless on CPU (default: $COMFYUI_PATH, else the host "
                            "made by `python -m ditkit.host setup`)")
    where.add_argument("--server", metavar="URL", help="use a running server, e.g. http://127.0.0.1:8188")
    ap.add_argument("--out", metavar="DIR",
                    help="output directory (started server: its --output-directory; --server: outputs are "
                         "downloaded here). Default for a started server: ./_out/ditkit_run")
    ap.add_argument("--python", metavar="PY",
                    help="python for ComfyUI (default: PATH/venv/bin/python, PATH/.venv/bin/python, this python)")
    ap.add_argument("--models", metavar="DIR",
                    help="models root with diffusion_models/, vae/, text_encoders/, loras/, checkpoints/ ... "
                         "(default: generate the tiny test checkpoints into a temp dir)")
    ap.add_argument("--timeout", type=float, default=900.0, metavar="S",
                    help="seconds to wait for the workflow to finish (default 900)")
    ap.add_argument("--startup-timeout", type=float, default=180.0, metavar="S",
                    help="seconds to wait for a started server to answer /system_stats (default 180)")
    ap.add_argument("--port", type=int, default=0, help="port for the started server (default: a free one)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for main.py (repeatable), e.g. --server-arg=--cache-none")
    ap.add_argument("--only-ditkit", action="store_true",
                    help="started server: load no other custom node pack (--disable-all-custom-nodes + whitelist)")
    ap.add_argument("--keep-temp", action="store_true", help="keep the temp dir (yaml, link, generated models)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    a.host_origin = "--comfyui" if a.comfyui is not None else None
    if a.server is None and a.comfyui is None:
        host = find_host()
        if host is None:
            ap.error("give --comfyui PATH (or set COMFYUI_PATH) to start a server, or --server URL to use one, "
                     f"or make ditkit's own host once: python -m ditkit.host setup (then {default_dir()} is used)")
        if not host.usable:
            ap.error(f"{host.origin} host {host.root} is not usable: {'; '.join(host.problems)}")
        a.comfyui, a.host_origin = str(host.root), host.origin
    if a.comfyui is not None and not (Path(a.comfyui).expanduser() / "main.py").is_file():
        ap.error(f"--comfyui {a.comfyui!r}: no main.py there (not a ComfyUI checkout)")
    if a.server is not None:
        try:
            a.server = check_server_url(a.server)
        except ValueError as e:
            ap.error(f"--server {a.server[:200]!r}: {e}")
    if a.models is not None and not Path(a.models).is_dir():
        ap.error(f"--models {a.models!r} is not a directory")
    for opt, v in (("--timeout", a.timeout), ("--startup-timeout", a.startup_timeout)):
        if not (math.isfinite(v) and v > 0):  # nan compares False with everything; inf would never time out
            ap.error(f"{opt} {v!r}: timeouts must be positive, finite numbers of seconds")
    if not 0 <= a.port <= 65535:
        ap.error(f"--port {a.port}: expected 1..65535 (or 0 for a free port)")
    if a.server is None and a.python is not None:
        exe = shutil.which(a.python) if os.sep not in a.python else a.python
        if not exe or not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            ap.error(f"--python {a.python!r} is not an executable file")
    if a.out is not None and Path(a.out).exists() and not Path(a.out).is_dir():
        ap.error(f"--out {a.out!r} exists and is not a directory")
    return a


def pick_python(comfyui: str | os.PathLike, explicit: str | None = None) -> str:
    """The interpreter that runs ComfyUI: explicit, else the checkout's venv / .venv, else this one."""
    if explicit:
        return explicit
    root = Path(comfyui)
    for cand in (root / "venv" / "bin" / "python", root / ".venv" / "bin" / "python",
                 root / "venv" / "Scripts" / "python.exe", root / ".venv" / "Scripts" / "python.exe"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return sys.executable


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------- yaml / command

def yaml_quote(s: str) -> str:
    """A YAML double-quoted scalar (JSON string syntax, ASCII only, is valid YAML)."""
    return json.dumps(str(s), ensure_ascii=True)


def extra_paths_yaml(custom_nodes_dir: str | os.PathLike, models_dir: str | os.PathLike | None) -> str:
    """Text of an ``--extra-model-paths-config`` file: ditkit's link dir + every model folder of ``models_dir``."""
    lines = ["# written by python -m ditkit.run", "ditkit_run:",
             f"  custom_nodes: {yaml_quote(os.path.abspath(custom_nodes_dir))}"]
    if models_dir is not None:
        root = Path(models_dir).resolve()
        names = list(MODEL_FOLDERS)
        names += sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in names
                        and p.name != "custom_nodes" and not p.name.startswith(".")) if root.is_dir() else []
        for name in names:
            lines.append(f"  {yaml_quote(name)}: {yaml_quote(str(root / name))}")
    return "\n".join(lines) + "\n"


def write_extra_paths_yaml(path, custom_nodes_dir, models_dir) -> Path:
    path = Path(path)
    path.write_text(extra_paths_yaml(custom_nodes_dir, models_dir), encoding="utf-8")
    return path


def server_command(python: str, comfyui, *, port: int, yaml_path, out_dir, temp_base, user_dir,
                   only_ditkit: bool = False, extra_args=()) -> list[str]:
    cmd = [python, str(Path(comfyui) / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--disable-auto-launch", "--extra-model-paths-config", str(yaml_path),
           "--output-directory", str(out_dir), "--temp-directory", str(temp_base), "--user-directory", str(user_dir),
           "--database-url", "sqlite:///:memory:"]
    if only_ditkit:
        cmd += ["--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_LINK_NAME]
    cmd += list(extra_args)
    return cmd


# ------------------------------------------------------------------------------------------ formatting

def _short(v: Any, n: int = 300) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def format_node_errors(body: Any, graph: dict | None = None) -> str:
    """Readable text for a /prompt HTTP 400 body (``error`` + per-node ``node_errors``)."""
    if not isinstance(body, dict):
        return f"server rejected the prompt: {_short(body)}"
    lines = []
    err = body.get("error")
    if isinstance(err, dict):
        head = err.get("message") or err.get("type") or "prompt rejected"
        det = err.get("details")
        lines.append(f"prompt rejected ({err.get('type', '?')}): {head}" + (f": {det}" if det else ""))
    elif err:
        lines.append(f"prompt rejected: {_short(err)}")
    for nid, ne in sorted((body.get("node_errors") or {}).items(), key=lambda kv: str(kv[0])):
        ctype = (ne or {}).get("class_type") or ((graph or {}).get(nid) or {}).get("class_type", "?")
        for e in (ne or {}).get("errors") or [{}]:
            inp = (e.get("extra_info") or {}).get("input_name")
            msg = e.get("message") or e.get("type") or "error"
            det = e.get("details")
            lines.append(f"  node {nid} ({ctype})" + (f" input {inp!r}" if inp else "") + f": {msg}"
                         + (f" - {_short(det)}" if det else ""))
    return "\n".join(lines) if lines else f"server rejected the prompt: {_short(body)}"


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


def is_ui_format(wf: Any) -> bool:
    return isinstance(wf, dict) and isinstance(wf.get("nodes"), list) and "links" in wf


MAX_WORKFLOW_BYTES = 64 * 2**20
MAX_WORKFLOW_DEPTH = 64


def _name(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _read_workflow_bytes(p: Path) -> bytes:
    """The file's bytes, opened once (non-blocking, so a FIFO cannot hang the runner) and checked on the opened
    descriptor: a regular file of at most MAX_WORKFLOW_BYTES."""
    where = f"workflow file '{p}'"
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise WorkflowFileError(f"{where} does not exist") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise WorkflowFileError(f"{where} cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise WorkflowFileError(f"{where} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise WorkflowFileError(f"{where} is not a regular file")
        if st.st_size > MAX_WORKFLOW_BYTES:
            raise WorkflowFileError(f"{where} is {st.st_size} bytes; the limit is {MAX_WORKFLOW_BYTES} bytes")
        chunks, n = [], 0
        while n <= MAX_WORKFLOW_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_WORKFLOW_BYTES + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > MAX_WORKFLOW_BYTES:
            raise WorkflowFileError(f"{where} grew past the limit of {MAX_WORKFLOW_BYTES} bytes while being read")
        return b"".join(chunks)
    except OSError as e:
        raise WorkflowFileError(f"{where} cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _strict_pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {_name(k)}")
        out[k] = v
    return out


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON value")


def _depth_over(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


def parse_workflow_json(data: bytes, where: str) -> Any:
    """Strict JSON (UTF-8, optional BOM; no NaN/Infinity, no duplicate keys, at most MAX_WORKFLOW_DEPTH levels)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise WorkflowFileError(f"{where} is not UTF-8 text (byte {e.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_strict_pairs, parse_constant=_no_constant)
    except RecursionError:
        raise WorkflowFileError(f"{where} is nested deeper than {MAX_WORKFLOW_DEPTH} levels") from None
    except ValueError as e:
        raise WorkflowFileError(f"{where} is not readable JSON ({' '.join(str(e).split())[:200]})") from None
    if _depth_over(obj, MAX_WORKFLOW_DEPTH):
        raise WorkflowFileError(f"{where} is nested deeper than {MAX_WORKFLOW_DEPTH} levels")
    return obj


def check_api_workflow(wf: dict, where: str) -> None:
    """API format: every node an object with a string ``class_type`` and an object ``inputs``; every link
    ``[node_id, slot]`` names a node of the graph (as a string) and a slot >= 0."""
    bad = [k for k, v in wf.items() if not (isinstance(v, dict) and isinstance(v.get("class_type"), str))]
    if bad:
        raise WorkflowFileError(f"{where}: entries {', '.join(_name(k) for k in bad[:5])} have no 'class_type' "
                                "(neither API format nor UI format)")
    for k, v in wf.items():
        inputs = v.get("inputs", {})
        if not isinstance(inputs, dict):
            raise WorkflowFileError(f"{where}: node {_name(k)} 'inputs' is a {type(inputs).__name__}; "
                                    "expected an object")
        for name, val in inputs.items():
            if not (isinstance(val, list) and len(val) == 2 and isinstance(val[1], int)
                    and not isinstance(val[1], bool)):
                continue
            src, slot = val
            if not isinstance(src, str):
                raise WorkflowFileError(f"{where}: node {_name(k)} input {_name(name)} links to {_name(src)}; a "
                                        "link names its source node by its id string, e.g. [\"4\", 0]")
            if src not in wf:
                raise WorkflowFileError(f"{where}: node {_name(k)} input {_name(name)} links to missing node "
                                        f"{_name(src)}")
            if slot < 0:
                raise WorkflowFileError(f"{where}: node {_name(k)} input {_name(name)} links to output slot {slot}")


def load_workflow_file(path) -> dict:
    """Read and check a workflow file before any server is involved; raises :class:`WorkflowFileError`."""
    p = Path(path)
    where = f"workflow file '{p}'"
    wf = parse_workflow_json(_read_workflow_bytes(p), where)
    if not isinstance(wf, dict):
        raise WorkflowFileError(f"{where}: expected a JSON object, got {type(wf).__name__}")
    if isinstance(wf.get("prompt"), dict) and not is_ui_format(wf):  # a saved /prompt body
        wf = wf["prompt"]
    if is_ui_format(wf):
        from .workflows import check_ui_workflow

        try:
            check_ui_workflow(wf)
        except DitKitError as e:
            raise WorkflowFileError(f"{where}: {e}") from None
    else:
        check_api_workflow(wf, where)
    return wf


# ------------------------------------------------------------------------------------------- websocket

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
            raise RunnerError(f"GET {self.url}{path} returned HTTP {status}: {_short(body)}")
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


# ------------------------------------------------------------------------------------------ the server

def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM if the process that started it dies (even by SIGKILL), so a killed
    runner or test session never leaves an orphan ComfyUI behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; stop() still stops it by pid
        pass


def stop_pid(proc: subprocess.Popen, grace: float = 15.0) -> int | None:
    """SIGTERM the process we started (by pid), SIGKILL it after ``grace`` seconds. Returns its exit status."""
    if proc.poll() is not None:
        return proc.returncode
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)


class ComfyServer:
    """A headless ComfyUI (``main.py --cpu``) with ditkit linked in through a temp ``custom_nodes`` dir.

    Nothing in the ComfyUI checkout is modified: the pack link, YAML, user and temp dirs live in a temp
    work dir (removed by :meth:`stop` unless ``keep_temp``). Use as a context manager or call
    :meth:`start` / :meth:`stop`."""

    def __init__(self, comfyui, *, python: str | None = None, models_dir=None, out_dir=None, log_path=None,
                 port: int = 0, extra_args=(), only_ditkit: bool = False, keep_temp: bool = False,
                 generate_models: bool = True, env: dict | None = None, quiet: bool = False):
        self.comfyui = Path(comfyui).expanduser().resolve()
        self.python = pick_python(self.comfyui, python)
        self.work = Path(tempfile.mkdtemp(prefix="ditkit_run_"))
        self.models_dir = Path(models_dir).resolve() if models_dir is not None else None
        self.generate_models = generate_models and models_dir is None
        self.out_dir = Path(out_dir).resolve() if out_dir is not None else self.work / "output"
        # ComfyUI appends "temp" to --temp-directory (and empties that folder at startup)
        self.temp_dir, self.user_dir = self.work / "temp", self.work / "user"
        self.log_path = Path(log_path) if log_path is not None else self.out_dir / "comfyui_server.log"
        self.port, self.extra_args, self.only_ditkit = port, list(extra_args), only_ditkit
        self.keep_temp, self.env, self.quiet = keep_temp, env, quiet
        self.proc: subprocess.Popen | None = None
        self.client: ComfyClient | None = None
        self.cmd: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"[ditkit.run] {text}", file=sys.stderr, flush=True)

    def prepare(self) -> None:
        """Write the link dir, models (if generated) and YAML; compute the command."""
        nodes_dir = self.work / "custom_nodes"
        nodes_dir.mkdir(parents=True, exist_ok=True)
        link = nodes_dir / PACK_LINK_NAME
        if not link.exists():
            os.symlink(REPO, link, target_is_directory=True)
        if self.models_dir is None:
            self.models_dir = self.work / "models"
            self.models_dir.mkdir(exist_ok=True)
            if self.generate_models:
                t0 = time.monotonic()
                from .tiny.checkpoints import generate_all  # torch needed only here

                written = generate_all(self.models_dir)
                n = sum(len(v) for v in written.values())
                self._say(f"generated {n} tiny checkpoint files ({len(written)} generators) into {self.models_dir} "
                          f"in {time.monotonic() - t0:.1f} s")
        for d in (self.out_dir, self.user_dir, self.log_path.parent):
            d.mkdir(parents=True, exist_ok=True)
        self.yaml_path = write_extra_paths_yaml(self.work / "extra_model_paths.yaml", nodes_dir, self.models_dir)
        if not self.port:
            self.port = free_port()
        self.cmd = server_command(self.python, self.comfyui, port=self.port, yaml_path=self.yaml_path,
                                  out_dir=self.out_dir, temp_base=self.work, user_dir=self.user_dir,
                                  only_ditkit=self.only_ditkit, extra_args=self.extra_args)

    def start(self, timeout: float = 180.0) -> "ComfyServer":
        try:
            self.prepare()
            env = dict(os.environ if self.env is None else self.env)
            env.setdefault("PYTHONUNBUFFERED", "1")
            self._log_fh = open(self.log_path, "ab")
            self._say(f"starting ComfyUI: {' '.join(self.cmd)}")
            self._say(f"server log: {self.log_path}")
            t0 = time.monotonic()
            self.proc = subprocess.Popen(self.cmd, cwd=str(self.comfyui), stdin=subprocess.DEVNULL,
                                         stdout=self._log_fh, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        except OSError as e:  # unwritable --out / temp dir, a --python that cannot be executed
            self.stop()
            raise RunnerError(f"cannot start ComfyUI ({self.python}): {e}") from None
        self.client = ComfyClient(self.url, proc=self.proc, log_path=self.log_path)
        try:
            self.client.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self._say(f"server pid {self.proc.pid} ready at {self.url} in {self.startup_s:.1f} s")
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, grace: float = 15.0) -> int | None:
        """Stop the server by its pid and remove the temp dir (idempotent)."""
        rc = None
        if self.proc is not None:
            already = self.proc.returncode is not None
            rc = stop_pid(self.proc, grace)
            if not already:
                self._say(f"server pid {self.proc.pid} stopped (exit status {rc})")
        if getattr(self, "_log_fh", None) is not None:
            self._log_fh.close()
            self._log_fh = None
        if not self.keep_temp:
            shutil.rmtree(self.work, ignore_errors=True)
        return rc

    def __enter__(self) -> "ComfyServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------------- main

def to_api(wf: dict, object_info: Callable[[], dict]) -> dict:
    """API-format graph of ``wf`` (UI-format workflows are converted with the server's node schemas)."""
    if not is_ui_format(wf):
        return wf
    from .workflows import ui_to_api

    return ui_to_api(wf, object_info())


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


def report_success(entry: dict, graph: dict, files: list, stream=None) -> None:
    stream = stream or sys.stdout
    print(f"OK: workflow finished in {entry.get('_elapsed_s', '?')} s", file=stream)
    reports = ditkit_reports(entry) or entry.get("_reports") or []
    seen = set()
    for r in reports:
        key = (r.get("node"), r.get("kind"), r.get("summary"))
        if key not in seen:
            seen.add(key)
            print(f"ditkit report: {r.get('node_type')} #{r.get('node')} {r.get('kind')}: {r.get('summary')}",
                  file=stream)
    for nid, kind, it in output_items(entry):
        if kind == "ditkit_report" or (isinstance(it, dict) and "filename" in it):
            continue
        ctype = (graph.get(nid) or {}).get("class_type", "?")
        print(f"output node {nid} ({ctype}) {kind}: {_short(it, 200)}", file=stream)
    if files:
        print("output files:", file=stream)
        for f in files:
            print(f"  {f}", file=stream)
    else:
        print("output files: none", file=stream)


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    a = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_to_exit)  # so `finally` stops the server we started
    try:
        wf = load_workflow_file(a.workflow)
    except RunnerError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return EXIT_USAGE
    server: ComfyServer | None = None
    graph: dict = wf
    try:
        if a.server:
            client = ComfyClient(a.server)
            client.wait_ready(min(a.startup_timeout, 30.0))
        else:
            out = Path(a.out) if a.out else Path.cwd() / "_out" / "ditkit_run"
            if not a.quiet:
                print(f"ComfyUI host: {a.comfyui} (from {a.host_origin})", flush=True)
            server = ComfyServer(a.comfyui, python=a.python, models_dir=a.models, out_dir=out, port=a.port,
                                 extra_args=a.server_arg, only_ditkit=a.only_ditkit, keep_temp=a.keep_temp,
                                 quiet=a.quiet)
            server.start(a.startup_timeout)
            client = server.client
        graph = to_api(wf, client.object_info)
        printer = ProgressPrinter(graph, "", quiet=a.quiet)
        entry = client.run(graph, a.timeout, printer=printer)
        if server is not None:
            files = output_files(entry, server.out_dir, server.temp_dir)
        elif a.out:
            files = download_outputs(client, entry, Path(a.out))
        else:
            files = output_files(entry)
        report_success(entry, graph, files)
        return EXIT_OK
    except WorkflowFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        if server is not None:
            print(f"server log: {server.log_path}", file=sys.stderr)
        return EXIT_FAILED
    except DitKitError as e:  # the workflow cannot be converted (unknown node class, bad UI file)
        print(f"ERROR: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RunnerError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        if server is not None:
            print(f"--- last lines of the server log ({server.log_path}) ---\n{server.log_tail()}", file=sys.stderr)
        return EXIT_SERVER
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
