"""The CLIs under hostile input and signals (issue 29), each through a real subprocess:

* ``host setup`` from a git tree that is not ComfyUI: one line, exit 2, nothing left behind;
* ``--source`` / ``--ref`` never reach ``git`` as options: ``--`` (``--end-of-options``) before every user value;
* SIGTERM and Ctrl-C (SIGINT) in the middle of ``quantize``, ``host setup`` and ``tiny.checkpoints``: the partial
  output is removed, one line on stderr (no traceback), exit 143 / 130.

Where the signal lands matters, so the subprocess runs the real CLI through ``runpy`` with one step slowed down
(it writes a marker file, then sleeps): the test signals only once the marker exists.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ditkit import host

REPO = Path(__file__).resolve().parents[2]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


# ------------------------------------------------------------------------------------------- host setup

@pytest.mark.skipif(not __import__("shutil").which("git"), reason="needs git")
def test_setup_from_a_tree_that_is_not_comfyui_is_one_line_and_leaves_nothing(tmp_path):
    repo = tmp_path / "not_comfy"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "master")
    (repo / "README.md").write_text("not ComfyUI\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    sha = _git(repo, "rev-parse", "HEAD")
    dest = tmp_path / "hosts" / "h"
    r = subprocess.run([sys.executable, str(REPO / "host.py"), "setup", "--source", str(repo), "--ref", sha,
                        "--dir", str(dest), "--python", sys.executable], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr
    line = _one_line(r.stderr)
    assert "is not a ComfyUI tree" in line and "main.py" in line and "requirements.txt" in line
    assert not dest.exists() and sorted(os.listdir(dest.parent)) == []   # no host, no partial folder


def _fake_git(tmp_path: Path, monkeypatch) -> Path:
    """A ``git`` on PATH that records its argv (one argument per line, NUL-separated) and fails."""
    log = tmp_path / "git-argv"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "git"
    exe.write_text(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\" >> {log}; done\nprintf '\\n' >> {log}\n"
                   "exit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return log


def _calls(log: Path) -> list[list[str]]:
    return [[a for a in ln.split("\0") if a] for ln in log.read_text().splitlines() if ln]


def test_source_url_reaches_git_clone_and_fetch_only_after_double_dash(tmp_path, monkeypatch):
    log = _fake_git(tmp_path, monkeypatch)
    evil = "--upload-pack=touch /tmp/ditkit-pwned;://x"
    with pytest.raises(host.HostError):
        host._git_dir(evil, lambda *_: None)                       # no bare clone yet: git clone
    mirror = host.cache_root() / "sources" / "comfyui.git"
    mirror.mkdir(parents=True)
    (mirror / "HEAD").write_text("ref: refs/heads/master\n")
    with pytest.raises(host.HostError):
        host._git_dir(evil, lambda *_: None)                       # a bare clone exists: git fetch
    calls = _calls(log)
    assert [c[c.index(evil) - 1] for c in calls] == ["--", "--"], calls
    assert calls[0][:calls[0].index("--")][-3:] == ["clone", "--bare", "--quiet"]
    assert "fetch" in calls[1][:calls[1].index("--")]


def test_ref_is_never_an_option_to_git(tmp_path, monkeypatch):
    log = _fake_git(tmp_path, monkeypatch)
    for ref in ("--output=/tmp/x", "-h", ""):
        with pytest.raises(host.HostError, match="not a commit or tag name"):
            host.resolve_ref(tmp_path, ref)
    assert not log.exists()                                         # refused before git ran
    with pytest.raises(host.HostError, match="no such commit"):
        host.resolve_ref(tmp_path, "v1.0")
    (call,) = _calls(log)
    assert call[call.index("v1.0^{commit}") - 1] == "--end-of-options"


def test_requirement_lines_that_are_pip_options_are_refused(tmp_path):
    (tmp_path / "requirements.txt").write_text("av>=16\n--index-url http://evil.invalid/simple\n")
    with pytest.raises(host.HostError, match=r"'--index-url http://evil.invalid/simple' is a pip option"):
        host.venv_plan(tmp_path)
    (tmp_path / "requirements.txt").write_text("torch\nav>=16\n")
    plan = dict(host.venv_plan(tmp_path, pack=tmp_path))
    assert plan["the torch set"] == ["--", *host.TORCH_SET] and plan["ComfyUI's requirements"] == ["--", "av>=16"]


def test_runner_never_passes_the_checkout_to_python_as_an_option(tmp_path, monkeypatch):
    from ditkit.runner.server import server_command

    monkeypatch.chdir(tmp_path)
    cmd = server_command("/py", "-Xfrozen_modules=off", port=1, yaml_path="y", out_dir="o", temp_base="t",
                         user_dir="u")
    assert cmd[1] == str(tmp_path / "-Xfrozen_modules=off" / "main.py")      # a path, not an interpreter option


# ------------------------------------------------------------------------------------------- signals

def _start(code: str, marker: Path, tmp_path: Path, timeout: float = 120.0) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    t0 = time.monotonic()
    while not marker.exists():
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"the CLI ended before the slowed step (exit {p.returncode}): {err[-2000:]}")
        if time.monotonic() - t0 > timeout:
            p.kill()
            pytest.fail("the slowed step was never reached")
        time.sleep(0.05)
    return p


def _signal(p: subprocess.Popen, sig: int) -> tuple[int, str]:
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the CLI did not stop after the signal")
    return p.returncode, err


@pytest.fixture(scope="module")
def h3_source(tmp_path_factory):
    from ditkit.tiny import ckpt_h3

    out = tmp_path_factory.mktemp("qsrc")
    ckpt_h3.gen_h3_dit_official(out)
    return out / ckpt_h3.OFFICIAL_DIR


@pytest.mark.parametrize("sig, status, word", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_quantize_signal_removes_the_partial_file_and_says_one_line(h3_source, tmp_path, sig, status, word):
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "writing"
    p = _start(f"""
        import runpy, sys, time
        from ditkit.loaders import safe_fs
        real = safe_fs._write_chunk
        def slow(fd, c):
            real(fd, c)
            open({str(marker)!r}, "w").close()
            time.sleep(60)
        safe_fs._write_chunk = slow
        sys.argv = ["quantize", {str(h3_source)!r}, {str(out / "q.safetensors")!r}, "--format", "float8_e4m3fn",
                    "--no-hash"]
        runpy.run_module("ditkit.quantize", run_name="__main__")
        """, marker, tmp_path)
    assert [n for n in os.listdir(out) if n.startswith(".ditkit-tmp-")], "the temp file should exist mid-write"
    rc, err = _signal(p, sig)
    assert rc == status, err
    assert word in _one_line(err)
    assert os.listdir(out) == []                                   # neither the hidden partial nor the output


@pytest.mark.skipif(not __import__("shutil").which("git"), reason="needs git")
def test_host_setup_sigterm_removes_the_half_made_venv(tmp_path):
    repo = tmp_path / "fake_comfyui"
    (repo / "comfy").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "master")
    for f, text in {"main.py": "", "requirements.txt": "av\n", "comfyui_version.py": '__version__ = "9"\n',
                    "comfy/__init__.py": "", "comfy/cli_args.py": ""}.items():
        (repo / f).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    sha = _git(repo, "rev-parse", "HEAD")
    dest = tmp_path / "h"
    marker = tmp_path / "installing"
    p = _start(f"""
        import sys, time
        sys.argv = ["host.py", "setup", "--source", {str(repo)!r}, "--ref", {sha!r}, "--dir", {str(dest)!r},
                    "--python", sys.executable]
        sys.path.insert(0, {str(REPO)!r})
        import host                                   # host.py as the script-level module `python host.py` runs
        real = host._run
        def slow(cmd, **kw):
            if "pip" in cmd:
                open({str(marker)!r}, "w").close()
                time.sleep(60)
            return real(cmd, **kw)
        host._run = slow
        sys.exit(host.main())
        """, marker, tmp_path)
    assert (dest / "venv").is_dir()
    rc, err = _signal(p, signal.SIGTERM)
    assert rc == 143, err
    assert "SIGTERM" in _one_line(err)
    assert not (dest / "venv").exists()
    assert host.read_marker(dest)["state"] == "venv"               # a re-run finishes it; check says half-made
    assert not host.inspect(dest, "test").usable


def test_tiny_checkpoints_sigint_is_one_line(tmp_path):
    marker = tmp_path / "generating"
    p = _start(f"""
        import runpy, sys, time, warnings
        warnings.simplefilter("ignore", RuntimeWarning)   # runpy re-running an imported module (test-only)
        import ditkit.tiny.checkpoints as c
        def slow(outdir, only=None):
            open({str(marker)!r}, "w").close()
            time.sleep(60)
        c.generate_all = slow
        sys.argv = ["checkpoints", {str(tmp_path / "out")!r}]
        runpy.run_module("ditkit.tiny.checkpoints", run_name="__main__")
        """, marker, tmp_path)
    rc, err = _signal(p, signal.SIGINT)
    assert rc == 130, err
    assert "Ctrl-C" in _one_line(err)


def test_workflows_sigterm_is_one_line(tmp_path):
    marker = tmp_path / "syncing"
    p = _start(f"""
        import runpy, sys, time, warnings
        warnings.simplefilter("ignore", RuntimeWarning)   # runpy re-running an imported module (test-only)
        import ditkit.runner.workflows as w
        def slow(*a, **k):
            open({str(marker)!r}, "w").close()
            time.sleep(60)
        w.sync = slow
        sys.argv = ["workflows", "sync", "--check"]
        runpy.run_module("ditkit.workflows", run_name="__main__")
        """, marker, tmp_path)
    rc, err = _signal(p, signal.SIGTERM)
    assert rc == 143, err
    assert "SIGTERM" in _one_line(err)
