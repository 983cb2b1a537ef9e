"""The headless runner's non-server parts: arguments, YAML, command line, error formatting, the HTTP/websocket
client against a fake server, stopping a process by pid. (The real host is exercised in tests/integration.)"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ditkit import run

# ----------------------------------------------------------------------------------------------- args


@pytest.fixture
def fake_comfy(tmp_path):
    root = tmp_path / "ComfyUI"
    root.mkdir()
    (root / "main.py").write_text("# not really ComfyUI\n")
    return root


def test_parse_args_defaults(fake_comfy, tmp_path):
    wf = tmp_path / "w.json"
    a = run.parse_args([str(wf), "--comfyui", str(fake_comfy)])
    assert a.workflow == str(wf) and a.comfyui == str(fake_comfy) and a.server is None
    assert a.timeout == 900.0 and a.startup_timeout == 180.0 and a.port == 0 and a.server_arg == []
    assert a.models is None and a.out is None and a.python is None and not a.only_ditkit


def test_parse_args_env_fallback(fake_comfy, monkeypatch):
    monkeypatch.setenv("COMFYUI_PATH", str(fake_comfy))
    assert run.parse_args(["w.json"]).comfyui == str(fake_comfy)


@pytest.mark.parametrize("argv, needle", [
    (["w.json"], "give --comfyui PATH"),
    (["w.json", "--server", "localhost:8188"], "expected a URL"),
    (["w.json", "--server", "ftp://x"], "expected a URL"),
    (["w.json", "--comfyui", "/nonexistent/comfy"], "no main.py"),
    (["w.json", "--server", "http://h:1", "--comfyui", "/x"], "not allowed with"),
    (["w.json", "--server", "http://h:1", "--timeout", "0"], "positive"),
    (["w.json", "--server", "http://h:1", "--models", "/nonexistent/models"], "not a directory"),
    ([], "required"),
])
def test_parse_args_errors(argv, needle, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached host either
    with pytest.raises(SystemExit) as ei:
        run.parse_args(argv)
    assert ei.value.code == 2
    assert needle in capsys.readouterr().err


def test_parse_args_server_and_extras(tmp_path):
    a = run.parse_args(["w.json", "--server", "http://127.0.0.1:8188/", "--server-arg=--cache-none",
                        "--server-arg=--verbose", "--timeout", "5", "--models", str(tmp_path)])
    assert a.server == "http://127.0.0.1:8188" and a.server_arg == ["--cache-none", "--verbose"] and a.timeout == 5


def _exe(p: Path):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("#!/bin/sh\n")
    p.chmod(0o755)
    return p


def test_pick_python(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    assert run.pick_python(root) == sys.executable
    dot = _exe(root / ".venv" / "bin" / "python")
    assert run.pick_python(root) == str(dot)
    venv = _exe(root / "venv" / "bin" / "python")
    assert run.pick_python(root) == str(venv)  # venv/ before .venv/
    assert run.pick_python(root, "/opt/py") == "/opt/py"
    venv.chmod(0o644)  # not executable: skipped
    assert run.pick_python(root) == str(dot)


def test_free_port_is_bindable():
    port = run.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ----------------------------------------------------------------------------------------- yaml + cmd

def test_extra_paths_yaml_parses_to_the_paths(tmp_path):
    yaml = pytest.importorskip("yaml")
    weird = tmp_path / "models dir: #1 'q' \"dq\" é"
    (weird / "diffusion_models").mkdir(parents=True)
    (weird / "my_custom_folder").mkdir()
    (weird / "custom_nodes").mkdir()  # must not override the pack link entry
    (weird / "odd: name #x").mkdir()
    nodes = tmp_path / "nodes: x"
    text = run.extra_paths_yaml(nodes, weird)
    conf = yaml.safe_load(text)
    assert list(conf) == ["ditkit_run"]
    c = conf["ditkit_run"]
    assert c["custom_nodes"] == str(nodes.resolve())
    for name in ("checkpoints", "diffusion_models", "unet", "vae", "text_encoders", "clip", "loras",
                 "my_custom_folder", "odd: name #x"):
        assert c[name] == str(weird.resolve() / name), name
    assert all("\n" not in v for v in c.values())  # ComfyUI splits values on newlines
    assert "base_path" not in c and "is_default" not in c


def test_extra_paths_yaml_without_models(tmp_path):
    yaml = pytest.importorskip("yaml")
    conf = yaml.safe_load(run.extra_paths_yaml(tmp_path, None))
    assert conf == {"ditkit_run": {"custom_nodes": str(tmp_path.resolve())}}


def test_yaml_quote_is_json_string():
    for s in ["plain", "with \"quotes\" and 'single'", "tab\tand\\backslash", "ünïcode", "#: -"]:
        assert json.loads(run.yaml_quote(s)) == s
        assert run.yaml_quote(s).isascii()


def test_server_command():
    cmd = run.server_command("/py", "/c", port=1234, yaml_path="/t/y.yaml", out_dir="/o", temp_base="/t",
                             user_dir="/t/user", only_ditkit=True, extra_args=["--cache-none"])
    assert cmd[:2] == ["/py", str(Path("/c") / "main.py")]
    s = " ".join(cmd)
    for frag in ("--cpu", "--listen 127.0.0.1", "--port 1234", "--disable-auto-launch",
                 "--extra-model-paths-config /t/y.yaml", "--output-directory /o", "--temp-directory /t",
                 "--user-directory /t/user", "--database-url sqlite:///:memory:",
                 "--disable-all-custom-nodes --whitelist-custom-nodes ditkit"):
        assert frag in s, frag
    assert cmd[-1] == "--cache-none"
    assert "--whitelist-custom-nodes" not in run.server_command("/py", "/c", port=1, yaml_path="y", out_dir="o",
                                                                temp_base="t", user_dir="u")


def test_server_prepare_links_the_pack_without_touching_comfyui(fake_comfy, tmp_path):
    models = tmp_path / "models"
    (models / "vae").mkdir(parents=True)
    srv = run.ComfyServer(fake_comfy, python="/py", models_dir=models, out_dir=tmp_path / "out", port=4321,
                          quiet=True)
    before = sorted(p.name for p in fake_comfy.rglob("*"))
    try:
        srv.prepare()
        link = srv.work / "custom_nodes" / "ditkit"
        assert link.is_symlink() and link.resolve() == run.REPO
        assert (link / "__init__.py").is_file()
        assert srv.cmd[0] == "/py" and "4321" in srv.cmd
        assert str(srv.yaml_path) in srv.cmd and str(models.resolve() / "vae") in srv.yaml_path.read_text()
        assert sorted(p.name for p in fake_comfy.rglob("*")) == before
    finally:
        srv.stop()
    assert not srv.work.exists()


# ---------------------------------------------------------------------------------------- formatting

BODY_400 = {
    "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
              "details": "", "extra_info": {}},
    "node_errors": {
        "3": {"errors": [{"type": "value_not_in_list", "message": "Value not in list",
                          "details": "sampler_name: 'nope' not in ['euler']",
                          "extra_info": {"input_name": "sampler_name"}},
                         {"type": "value_smaller_than_min", "message": "Value -1 smaller than min of 1",
                          "details": "steps", "extra_info": {"input_name": "steps"}}],
              "dependent_outputs": ["9"], "class_type": "KSampler"},
        "7": {"errors": [{"type": "required_input_missing", "message": "Required input is missing",
                          "details": "vae", "extra_info": {"input_name": "vae"}}],
              "dependent_outputs": ["9"], "class_type": "VAEDecode"},
    },
}


def test_format_node_errors():
    text = run.format_node_errors(BODY_400)
    lines = text.splitlines()
    assert lines[0] == "prompt rejected (prompt_outputs_failed_validation): Prompt outputs failed validation"
    assert lines[1] == "  node 3 (KSampler) input 'sampler_name': Value not in list - sampler_name: 'nope' not in ['euler']"
    assert lines[2] == "  node 3 (KSampler) input 'steps': Value -1 smaller than min of 1 - steps"
    assert lines[3] == "  node 7 (VAEDecode) input 'vae': Required input is missing - vae"


def test_format_node_errors_other_shapes():
    body = {"error": {"type": "missing_node_type", "message": "Node 'X' not found", "details": "Node ID '#1'"},
            "node_errors": {}}
    assert run.format_node_errors(body) == "prompt rejected (missing_node_type): Node 'X' not found: Node ID '#1'"
    assert "server rejected" in run.format_node_errors("Internal Server Error")
    assert run.format_node_errors({"node_errors": {"5": {"errors": [{"message": "m"}]}}},
                                  {"5": {"class_type": "K"}}) == "  node 5 (K): m"


ENTRY_ERR = {"status": {"status_str": "error", "completed": False, "messages": [
    ["execution_start", {"prompt_id": "p"}],
    ["execution_error", {"prompt_id": "p", "node_id": "4", "node_type": "DitKitH3ModelLoader",
                         "exception_type": "ditkit.errors.CheckpointError",
                         "exception_message": "safetensors file '/m/x.safetensors': truncated\n",
                         "traceback": ["Traceback (most recent call last):\n", "  File \"a.py\", line 1\n",
                                       "ditkit.errors.CheckpointError: truncated\n"]}]]}, "outputs": {}}


def test_format_execution_errors():
    text = run.format_execution_errors(ENTRY_ERR)
    lines = text.splitlines()
    assert lines[0] == ("node 4 (DitKitH3ModelLoader) raised ditkit.errors.CheckpointError: safetensors file "
                        "'/m/x.safetensors': truncated")
    assert lines[1] == "  traceback (last lines):"
    assert lines[-1] == "    ditkit.errors.CheckpointError: truncated"
    assert run.format_execution_errors(ENTRY_ERR, traceback_lines=0).count("\n") == 0
    intr = {"status": {"status_str": "error", "messages": [["execution_interrupted", {"node_id": "2",
                                                                                      "node_type": "KSampler"}]]}}
    assert run.format_execution_errors(intr) == "interrupted at node 2 (KSampler)"
    assert "status 'error'" in run.format_execution_errors({"status": {"status_str": "error", "messages": []}})


ENTRY_OK = {"status": {"status_str": "success", "completed": True, "messages": []}, "outputs": {
    "9": {"images": [{"filename": "a_00001_.png", "subfolder": "sub", "type": "output"},
                     {"filename": "p.png", "subfolder": "", "type": "temp"}]},
    "10": {"text": ["hello"], "ditkit_report": [{"node": "10", "node_type": "DitKitX", "kind": "load",
                                                 "summary": "3 layers"}]}}}


def test_output_files_and_reports(tmp_path, capsys):
    files = run.output_files(ENTRY_OK, tmp_path / "out", tmp_path / "tmp")
    assert files == [tmp_path / "out" / "sub" / "a_00001_.png", tmp_path / "tmp" / "p.png"]
    assert run.output_files(ENTRY_OK) == ["output/sub/a_00001_.png", "temp/p.png"]
    assert run.ditkit_reports(ENTRY_OK) == [ENTRY_OK["outputs"]["10"]["ditkit_report"][0]]
    # a stored (possibly cached, replayed) report is attributed to the output's node, not to an id inside it
    replayed = {"outputs": {"4": {"ditkit_report": [{"node": "11", "node_type": "DitKitX", "kind": "load"}]},
                            "5": {"ditkit_report": [{"node_type": "DitKitY", "kind": "load"}]}}}
    assert [(r["node"], r["node_type"]) for r in run.ditkit_reports(replayed)] == [("4", "DitKitX"), ("5", "DitKitY")]
    run.report_success(dict(ENTRY_OK, _elapsed_s=1.5), {"10": {"class_type": "PreviewAny"}}, files)
    out = capsys.readouterr().out
    assert "OK: workflow finished in 1.5 s" in out
    assert "ditkit report: DitKitX #10 load: 3 layers" in out
    assert "output node 10 (PreviewAny) text: hello" in out
    assert str(files[0]) in out


# -------------------------------------------------------------------------------------- workflow file

def test_load_workflow_file(tmp_path):
    api = {"1": {"class_type": "X", "inputs": {}}}
    p = tmp_path / "a.json"
    p.write_text(json.dumps(api))
    assert run.load_workflow_file(p) == api
    p.write_text(json.dumps({"prompt": api, "client_id": "c"}))
    assert run.load_workflow_file(p) == api
    ui = {"nodes": [], "links": [], "version": 0.4}
    p.write_text(json.dumps(ui))
    assert run.is_ui_format(run.load_workflow_file(p))
    for content, needle in (("{not json", "not readable JSON"), ("[1]", "expected a JSON object"),
                            (json.dumps({"1": {"inputs": {}}}), "no 'class_type'")):
        p.write_text(content)
        with pytest.raises(run.RunnerError, match=needle):
            run.load_workflow_file(p)
    with pytest.raises(run.RunnerError, match="does not exist"):
        run.load_workflow_file(tmp_path / "missing.json")


def test_main_exit_codes_without_a_server(tmp_path, capsys):
    assert run.main([str(tmp_path / "missing.json"), "--server", "http://127.0.0.1:9"]) == run.EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err
    wf = tmp_path / "w.json"
    wf.write_text(json.dumps({"1": {"class_type": "X", "inputs": {}}}))
    port = run.free_port()  # nothing listens there
    assert run.main([str(wf), "--server", f"http://127.0.0.1:{port}", "--startup-timeout", "0.5"]) == run.EXIT_SERVER
    assert "did not answer /system_stats" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ fake server

class FakeComfy:
    """A tiny HTTP server with ComfyUI's /system_stats, /object_info, /prompt, /history, /queue, /interrupt."""

    def __init__(self):
        self.posted, self.deleted, self.interrupted = [], [], []
        self.mode = "ok"
        self.polls = 0
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/system_stats":
                    return self._send(200, {"system": {}})
                if self.path == "/object_info":
                    return self._send(200, {"Src": {"input": {"required": {"w": ["INT", {"default": 1}]}},
                                                    "input_order": {"required": ["w"]}, "output": ["IMAGE"],
                                                    "output_name": ["IMAGE"]}})
                if self.path == "/queue":
                    pid = fake.posted[-1]["prompt_id"] if fake.posted else None
                    return self._send(200, {"queue_running": [[0, pid, {}, {}, []]] if pid else [],
                                            "queue_pending": []})
                if self.path.startswith("/history/"):
                    pid = self.path.split("/")[-1]
                    fake.polls += 1
                    if fake.mode == "hang" or fake.polls < 3:
                        return self._send(200, {})
                    if fake.mode == "error":
                        return self._send(200, {pid: ENTRY_ERR})
                    return self._send(200, {pid: ENTRY_OK})
                if self.path.startswith("/view?"):
                    return self._send(200, {"file": self.path})
                if self.path.startswith("/ws"):
                    self.send_response(404)
                    self.end_headers()
                    return None
                return self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/prompt":
                    fake.posted.append(body)
                    if fake.mode == "invalid":
                        return self._send(400, BODY_400)
                    return self._send(200, {"prompt_id": body.get("prompt_id"), "number": 1, "node_errors": {}})
                if self.path == "/queue":
                    fake.deleted += body.get("delete", [])
                elif self.path == "/interrupt":
                    fake.interrupted.append(body)
                return self._send(200, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    f = FakeComfy()
    yield f
    f.close()


def test_client_run_success(fake):
    c = run.ComfyClient(fake.url)
    assert c.wait_ready(5) == {"system": {}}
    entry = c.run({"1": {"class_type": "Src", "inputs": {}}}, timeout=10, poll=0.01)
    assert entry["status"]["status_str"] == "success" and entry["_elapsed_s"] >= 0
    body = fake.posted[0]
    assert body["prompt"] == {"1": {"class_type": "Src", "inputs": {}}}
    assert len(body["prompt_id"]) == 36 and body["client_id"]


def test_client_run_validation_error(fake):
    fake.mode = "invalid"
    with pytest.raises(run.WorkflowFailed) as ei:
        run.ComfyClient(fake.url).run({"3": {"class_type": "KSampler", "inputs": {}}}, timeout=10, poll=0.01)
    assert ei.value.status == 400 and "node 3 (KSampler) input 'sampler_name'" in str(ei.value)


def test_client_run_execution_error(fake):
    fake.mode = "error"
    with pytest.raises(run.WorkflowFailed) as ei:
        run.ComfyClient(fake.url).run({"4": {"class_type": "X", "inputs": {}}}, timeout=10, poll=0.01)
    assert ei.value.entry is not None and "raised ditkit.errors.CheckpointError" in str(ei.value)


def test_client_run_timeout_cancels(fake):
    fake.mode = "hang"
    with pytest.raises(run.WorkflowFailed, match="did not finish within"):
        run.ComfyClient(fake.url).run({"1": {"class_type": "X", "inputs": {}}}, timeout=0.3, poll=0.01)
    pid = fake.posted[0]["prompt_id"]
    assert fake.deleted == [pid] and fake.interrupted == [{"prompt_id": pid}]


def test_main_against_fake_server_ui_format_and_download(fake, tmp_path, capsys):
    ui = {"nodes": [{"id": 1, "type": "Src", "widgets_values": [5], "outputs": []}], "links": []}
    wf = tmp_path / "ui.json"
    wf.write_text(json.dumps(ui))
    rc = run.main([str(wf), "--server", fake.url, "--out", str(tmp_path / "dl"), "--quiet"])
    assert rc == 0, capsys.readouterr()
    assert fake.posted[0]["prompt"] == {"1": {"class_type": "Src", "inputs": {"w": 5}}}
    assert (tmp_path / "dl" / "sub" / "a_00001_.png").is_file()
    fake.mode, fake.polls = "error", 0
    assert run.main([str(wf), "--server", fake.url, "--quiet"]) == run.EXIT_FAILED
    assert "FAILED: node 4 (DitKitH3ModelLoader)" in capsys.readouterr().err
    bad_ui = {"nodes": [{"id": 1, "type": "Unknown", "widgets_values": []}], "links": []}
    wf.write_text(json.dumps(bad_ui))
    assert run.main([str(wf), "--server", fake.url, "--quiet"]) == run.EXIT_USAGE


# ------------------------------------------------------------------------------------------ websocket

def _frame(op, payload, fin=True, mask=None):
    b0 = (0x80 if fin else 0) | op
    n = len(payload)
    hdr = bytes([b0]) + (bytes([n | (0x80 if mask else 0)]) if n < 126 else
                         bytes([126 | (0x80 if mask else 0)]) + struct.pack(">H", n) if n < 65536 else
                         bytes([127 | (0x80 if mask else 0)]) + struct.pack(">Q", n))
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return hdr + mask + payload
    return hdr + payload


def test_websocket_frames():
    a, b = socket.socketpair()
    ws = object.__new__(run._WebSocket)
    ws.sock, ws.buf = a, b""
    big = b"x" * 70000
    b.sendall(_frame(1, b'{"type": "status"}') + _frame(9, b"pi") + _frame(2, b"\x00\x00\x00\x03ab")
              + _frame(1, b"hel", fin=False) + _frame(0, b"lo") + _frame(2, big) + _frame(1, b"m", mask=b"\x01\x02\x03\x04")
              + _frame(8, b""))
    assert ws.recv() == (1, b'{"type": "status"}')
    assert ws.recv() == (2, b"\x00\x00\x00\x03ab")  # the ping in between was answered
    pong = b.recv(64)
    assert pong[0] == 0x8A and pong[1] == 0x80 | 2  # masked pong, FIN, 2 bytes
    assert bytes(x ^ pong[2 + i % 4] for i, x in enumerate(pong[6:8])) == b"pi"
    assert ws.recv() == (1, b"hello")
    assert ws.recv() == (2, big)
    assert ws.recv() == (1, b"m")
    with pytest.raises(EOFError):
        ws.recv()
    ws.close()
    b.close()


def test_progress_printer():
    lines = []

    class S:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    p = run.ProgressPrinter({"1": {"class_type": "KSampler"}}, "pid", stream=S())
    p.event("executing", {"node": "1", "prompt_id": "other"})
    p.event("executing", {"node": "1", "prompt_id": "pid"})
    for v in range(1, 21):
        p.event("progress", {"value": v, "max": 20, "node": "1", "prompt_id": "pid"})
    p.event("ditkit.report", {"node": "1", "node_type": "DitKitT", "kind": "cache", "summary": "5 hits"})
    text = "".join(lines)
    assert text.count("executing node 1 (KSampler)") == 1
    assert "  node 1 (KSampler): 20/20" in text and "  node 1 (KSampler): 1/20" in text
    assert text.count("/20") == 11  # 1, every 2nd step, capped: 1,2,4,...,20
    assert p.reports == [{"node": "1", "node_type": "DitKitT", "kind": "cache", "summary": "5 hits"}]
    p.binary(struct.pack(">I", 3) + struct.pack(">I", 1) + b"1" + b"text here")
    assert p.texts == [("1", "text here")]


# ------------------------------------------------------------------------------------------ stop_pid

def test_stop_pid_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    assert run.stop_pid(proc, grace=10) == -15
    assert time.monotonic() - t0 < 10


def test_stop_pid_sigkill_after_grace():
    code = "import signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert run.stop_pid(proc, grace=0.5) == -9
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_stop_pid_already_exited():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert run.stop_pid(proc) == 3


def test_python_m_ditkit_run_help():
    r = subprocess.run([sys.executable, "-m", "ditkit.run", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--comfyui" in r.stdout and "--server" in r.stdout


FAKE_MAIN = """
import os, sys, time
open(os.environ["FAKE_PID_FILE"], "w").write(str(os.getpid()))
time.sleep(120)
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals / PR_SET_PDEATHSIG are Linux here")
@pytest.mark.parametrize("sig", ["TERM", "KILL"])
def test_killed_runner_leaves_no_server_behind(tmp_path, sig):
    """SIGTERM: the runner's `finally` stops the server by pid; SIGKILL: the server dies with its parent."""
    import signal as _signal

    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text(FAKE_MAIN)
    wf = tmp_path / "w.json"
    wf.write_text(json.dumps({"1": {"class_type": "X", "inputs": {}}}))
    (tmp_path / "models").mkdir()
    pid_file = tmp_path / "server.pid"
    env = dict(os.environ, FAKE_PID_FILE=str(pid_file))
    runner = subprocess.Popen([sys.executable, "-m", "ditkit.run", str(wf), "--comfyui", str(comfy), "--python",
                               sys.executable, "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"),
                               "--startup-timeout", "100"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        assert _pid_alive(server_pid)
        runner.send_signal(getattr(_signal, f"SIG{sig}"))
        rc = runner.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _pid_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(server_pid), f"server {server_pid} survived the runner's SIG{sig}"
        assert rc == (128 + 15 if sig == "TERM" else -9), rc
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        out = runner.stdout.read().decode(errors="replace")
        runner.stdout.close()
        for tok in out.split():  # a SIGKILLed runner cannot remove its temp dir
            if "/ditkit_run_" in tok and Path(tok).name.startswith("ditkit_run_"):
                shutil.rmtree(tok, ignore_errors=True)


def test_server_prepare_generates_the_tiny_checkpoints(tmp_path, monkeypatch):
    """Without --models the runner generates the tiny checkpoints into its work dir (the README's one command):
    the generator registry it imports is ditkit.tiny.checkpoints (a wrong relative import failed here)."""
    import sys

    import ditkit.tiny.checkpoints as ck
    from ditkit.runner.server import ComfyServer

    calls = []
    monkeypatch.setattr(ck, "generate_all", lambda out: calls.append(out) or {"x": []})
    (tmp_path / "main.py").write_text("")
    srv = ComfyServer(tmp_path, python=sys.executable, out_dir=tmp_path / "out", quiet=True)
    try:
        srv.prepare()
        assert calls == [srv.work / "models"]
    finally:
        import shutil

        shutil.rmtree(srv.work, ignore_errors=True)
