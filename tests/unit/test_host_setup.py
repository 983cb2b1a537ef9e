"""``python -m ditkit.host``: setup / path / check against a tiny fake ComfyUI git repository made here.

The fake has what setup relies on (``main.py``, ``requirements.txt``, ``comfyui_version.py``, a ``comfy``
package with ``cli_args``), a symlink and an executable file, and a second commit with a blob deleted from the
object store, as size-capped mirrors lack ComfyUI's two large tokenizer files. The venv step installs a wheel
built here with ``--no-index`` instead of torch and ComfyUI's requirements, so the test needs no network and no
torch download; the real host is exercised by the integration suite.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ditkit import host

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                       env={**os.environ, **GIT_ENV})
    return r.stdout.strip()


def _wheel(dest: Path, name: str = "ditkit_fakedep", version: str = "1.0") -> Path:
    """A minimal pure-python wheel, so pip installs something real without an index."""
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{name}-{version}.dist-info/RECORD", "\n".join(record) + "\n")
    return whl


@pytest.fixture
def fake_comfy_repo(tmp_path) -> dict:
    repo = tmp_path / "fake_comfyui"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "master")
    (repo / "main.py").write_text("print('fake comfyui')\n")
    (repo / "requirements.txt").write_text("# fake\ntorch\ntorchvision>=0.1\nditkit_fakedep\n")
    (repo / "comfyui_version.py").write_text('__version__ = "9.9.9"\n')
    (repo / "comfy").mkdir()
    (repo / "comfy" / "__init__.py").write_text("")
    (repo / "comfy" / "cli_args.py").write_text("args = None\n")
    (repo / "script.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(repo / "script.sh", 0o755)
    os.symlink("main.py", repo / "link_to_main.py")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    first = _git(repo, "rev-parse", "HEAD")
    big = repo / "comfy" / "big_tokenizer.json"
    big.write_text('{"vocab": "pretend this is over 4 MiB"}\n')
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "two")
    _git(repo, "tag", "v9.9.9")
    second = _git(repo, "rev-parse", "HEAD")
    blob = _git(repo, "rev-parse", "HEAD:comfy/big_tokenizer.json")
    obj = repo / ".git" / "objects" / blob[:2] / blob[2:]
    assert obj.is_file(), "the blob should be a loose object in a fresh repo"
    os.chmod(obj, 0o644)
    obj.unlink()  # the mirror lacks this blob, like a size-capped copy of ComfyUI
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels)
    return {"repo": repo, "first": first, "second": second, "blob": blob, "wheels": wheels}


@pytest.fixture
def small_plan(monkeypatch, fake_comfy_repo):
    """Install the local wheel instead of torch + ComfyUI's requirements + ditkit."""
    wheels = str(fake_comfy_repo["wheels"])
    calls = []

    def plan(root, pack=host.PACK_ROOT):
        calls.append(root)
        reqs = host._requirements_without_torch(root)
        return [("the fake requirements", ["--no-index", "--find-links", wheels, *reqs])]

    monkeypatch.setattr(host, "venv_plan", plan)
    monkeypatch.setattr(host, "CHECK_IMPORTS", ("ditkit_fakedep",))
    return calls


def test_requirements_drop_only_the_torch_set(fake_comfy_repo, tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    (root / "requirements.txt").write_text("torch\ntorchvision>=0.1\ntorchaudio==2\ntorchsde\n# c\n\nav>=16 # x\n")
    assert host._requirements_without_torch(root) == ["torchsde", "av>=16"]


def test_torchaudio_is_installed_even_when_comfyui_no_longer_requires_it(tmp_path):
    """ComfyUI 0.38 dropped torchaudio from requirements.txt (zhongzichang/ComfyUI @ 03faf555, requirements.txt);
    ditkit's H3 audio VAE and tests need it: the host's venv plan installs it with the matched torch set, whatever
    the tree's requirements say, and ``check`` imports it."""
    root = tmp_path / "t038"
    root.mkdir()
    (root / "requirements.txt").write_text("torch\ntorchvision\ntorchsde\nav>=16\n")  # no torchaudio line
    plan = dict(host.venv_plan(root, pack=tmp_path))
    torch_set = [a for a in plan["the torch set"] if a != "--"]   # pip gets `--` before the package list (#29)
    assert [a.split("==")[0] for a in torch_set] == ["torch", "torchvision", "torchaudio"]
    assert all("==" in a for a in torch_set)  # pinned: the matched set, not whatever pip picks
    assert not any(r.split("=")[0].split(">")[0] == "torchaudio" for r in plan["ComfyUI's requirements"])
    assert "torchaudio" in host.CHECK_IMPORTS


def test_setup_extracts_installs_reuses_and_checks(fake_comfy_repo, small_plan, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    repo = fake_comfy_repo["repo"]
    monkeypatch.setattr(host, "PINNED_COMMIT", fake_comfy_repo["second"])  # the default --ref and cache dir
    h = host.setup(source=str(repo), python=sys.executable)
    root = tmp_path / "cache" / "ditkit" / f"comfyui-{fake_comfy_repo['second'][:8]}"
    assert h.root == root and h.usable, h.problems
    out = capsys.readouterr().out
    # the tree: files as committed, exec bit, symlink, the absent blob listed and not fatal
    assert (root / "main.py").read_text() == "print('fake comfyui')\n"
    assert os.access(root / "script.sh", os.X_OK) and not os.access(root / "main.py", os.X_OK)
    assert os.readlink(root / "link_to_main.py") == "main.py"
    assert not (root / "comfy" / "big_tokenizer.json").exists()
    assert "comfy/big_tokenizer.json" in out and "absent from the mirror" in out
    marker = json.loads((root / host.MARKER).read_text())
    assert marker["state"] == "complete" and marker["commit"] == fake_comfy_repo["second"]
    assert marker["version"] == "9.9.9" and any("comfy/big_tokenizer.json" in m for m in marker["missing"])
    assert not (root / ".git").exists()
    # the venv: the wheel is importable from the host's python
    r = subprocess.run([str(root / "venv" / "bin" / "python"), "-c", "import ditkit_fakedep as d; print(d.VERSION)"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "1.0", r.stderr
    # path / check find it without any environment variable but the cache home
    assert host.main(["path"]) == 0
    assert capsys.readouterr().out.strip() == str(root)
    # a second run checks and reuses (no new venv)
    stamp = (root / "venv" / "pyvenv.cfg").stat().st_mtime_ns
    monkeypatch.setattr(host, "_ensure_pack", lambda *a, **k: None)  # the fake has no ditkit in it
    h2 = host.setup(source=str(tmp_path / "offline"), python=sys.executable)  # no source needed to reuse
    assert h2.usable and "reusing" in capsys.readouterr().out
    assert (root / "venv" / "pyvenv.cfg").stat().st_mtime_ns == stamp and len(small_plan) == 1
    assert host.main(["check"]) == 0
    assert "usable" in capsys.readouterr().out


def test_failed_install_removes_the_half_made_venv(fake_comfy_repo, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(host, "venv_plan", lambda root, pack=None: [
        ("a package that does not exist", ["--no-index", "--find-links", str(tmp_path), "ditkit-no-such-pkg"])])
    d = tmp_path / "h"
    with pytest.raises(host.HostError, match="pip install of a package that does not exist failed"):
        host.setup(source=str(fake_comfy_repo["repo"]), ref=fake_comfy_repo["first"], directory=d,
                   python=sys.executable)
    assert (d / "main.py").is_file() and not (d / "venv").exists()
    assert json.loads((d / host.MARKER).read_text())["state"] == "venv"
    h = host.inspect(d, "--comfyui")
    assert not h.usable and any("half-made" in p for p in h.problems)
    assert host.main(["check", "--comfyui", str(d)]) == 1
    assert "half-made" in capsys.readouterr().out


def test_setup_refuses_what_it_does_not_own(fake_comfy_repo, tmp_path):
    user_tree = tmp_path / "users_comfyui"
    user_tree.mkdir()
    (user_tree / "main.py").write_text("# the user's own\n")
    with pytest.raises(host.HostError, match="not a ditkit host"):
        host.setup(source=str(fake_comfy_repo["repo"]), ref=fake_comfy_repo["first"], directory=user_tree,
                   python=sys.executable)
    assert sorted(p.name for p in user_tree.iterdir()) == ["main.py"]
    with pytest.raises(host.HostError, match="no such commit or tag"):
        host.setup(source=str(fake_comfy_repo["repo"]), ref="no-such-tag", directory=tmp_path / "x",
                   python=sys.executable)
    with pytest.raises(host.HostError, match="not a git repository"):
        host.setup(source=str(tmp_path), directory=tmp_path / "y", python=sys.executable)


def test_setup_without_git_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(host.shutil, "which", lambda name: None)
    with pytest.raises(host.HostError, match="git is not installed"):
        host.setup(source=str(tmp_path), directory=tmp_path / "h", python=sys.executable)


def test_find_host_order_and_no_host_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    assert host.find_host() is None
    assert host.main(["path"]) == 1 and "no host" in capsys.readouterr().err
    user = tmp_path / "user_comfy"
    user.mkdir()
    (user / "main.py").write_text("")
    monkeypatch.setenv("COMFYUI_PATH", str(user))
    h = host.find_host()
    assert h.origin == "COMFYUI_PATH" and h.root == user and h.usable  # a user's tree may run on another python
    assert host.find_host(tmp_path / "elsewhere").origin == "--comfyui"
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "nothing"))
    assert not host.find_host().usable
    assert host.main(["path", "--usable"]) == 1


def test_runner_uses_the_cached_host_and_says_so(tmp_path, monkeypatch):
    from ditkit import run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    root = host.default_dir()
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "main.py").write_text("")
    py = root / "venv" / "bin" / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    (root / host.MARKER).write_text(json.dumps({"format": host.MARKER_FORMAT, "state": "complete",
                                                "commit": host.PINNED_COMMIT}))
    a = run.parse_args(["w.json"])
    assert a.comfyui == str(root) and a.host_origin == "cached host"
    (root / host.MARKER).write_text(json.dumps({"format": host.MARKER_FORMAT, "state": "venv"}))
    with pytest.raises(SystemExit) as ei:
        run.parse_args(["w.json"])
    assert ei.value.code == 2
