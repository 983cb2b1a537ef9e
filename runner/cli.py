"""``python -m ditkit.run``: arguments, the run itself, what is printed and the exit status (see :mod:`ditkit.run`)."""
from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import threading
import urllib.parse
from pathlib import Path

from .._cli import Terminated
from ..errors import DitKitError
from ..host import default_dir, find_host
from .client import ComfyClient, ProgressPrinter, ditkit_reports, download_outputs, output_files, output_items
from .common import EXIT_FAILED, EXIT_OK, EXIT_SERVER, EXIT_USAGE, RunnerError, WorkflowFailed, short
from .server import ComfyServer
from .workflow_file import load_workflow_file, to_api


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
        print(f"output node {nid} ({ctype}) {kind}: {short(it, 200)}", file=stream)
    if files:
        print("output files:", file=stream)
        for f in files:
            print(f"  {f}", file=stream)
    else:
        print("output files: none", file=stream)


def _sigterm_to_exit(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping the server is not interrupted again
    raise Terminated


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
        print("interrupted (Ctrl-C); the server this run started is stopped", file=sys.stderr)
        return 130
    except Terminated:
        print("stopped by SIGTERM; the server this run started is stopped", file=sys.stderr)
        return 143
    finally:
        if server is not None:
            server.stop()

