"""ditkit's own ComfyUI host: one command makes a pinned ComfyUI checkout with its venv, for tests and the runner.

    python -m ditkit.host setup [--source GIT_DIR_OR_URL] [--ref COMMIT_OR_TAG] [--dir DIR] [--python PY]
    python -m ditkit.host path      # the host ditkit would use, and why (COMFYUI_PATH, else the cached host)
    python -m ditkit.host check     # exit 0 when that host is usable, 1 when not (says what is wrong)
    python -m ditkit.host check --contract [--comfyui PATH]   # ditkit's host contract on that ComfyUI, as a table

``setup`` extracts the pinned commit's tree from a git repository (a local git directory or bare mirror, or the
public URL, cloned bare into the cache first), without its work-tree machinery: blobs missing from a size-capped
mirror (ComfyUI has two tokenizer files over 4 MiB that H3/LTX never read) are listed and skipped, never fatal.
It then makes ``DIR/venv`` with the matched torch/torchvision/torchaudio set first, ComfyUI's other requirements
second, and this pack installed editable with its ``dev`` extra. The default ``DIR`` is a per-user cache,
``$XDG_CACHE_HOME/ditkit/comfyui-<commit8>`` (``~/.cache/...``), so every later run, CI included, finds the
same host without environment variables. A second run checks and reuses; a half-made venv is removed.

The host's tree is ditkit's own (a marker file ``.ditkit-host.json`` says so): ``setup`` refuses to write into a
folder without that marker, so a ComfyUI the user pointed at is never modified.

``check --contract`` prints the host contract (``bridge/contract.py``: every ComfyUI symbol and behaviour ditkit
relies on, and the nodes that refuse when one is broken) for any ComfyUI checkout, so a user can check theirs
before upgrading: the probes run inside that host's python (its venv, else this interpreter), importing that
ComfyUI with ``--cpu`` and this checkout as ``ditkit``; exit 0 when no entry is broken, 1 when one is.

This module is plain standard-library Python with no imports from the rest of the pack, so ``.ci/run`` can run
it as a script (``python host.py path``) before anything is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PINNED_COMMIT = "783545f689a0af730065994b46b382ae24844c99"  # ComfyUI 0.33.0, what the suite is tested against
PINNED_VERSION = "0.33.0"
DEFAULT_SOURCE = "https://github.com/comfyanonymous/ComfyUI.git"
# A matched set, installed first: an unpinned requirement would otherwise pull another torch build.
TORCH_SET = ("torch==2.14.1", "torchvision==0.29.1", "torchaudio==2.11.1")
TORCH_NAMES = ("torch", "torchvision", "torchaudio")
MARKER = ".ditkit-host.json"
MARKER_FORMAT = "ditkit-host-v1"
PACKAGE_DIR = Path(__file__).resolve().parent  # the ditkit package: the checkout itself
PACK_ROOT = PACKAGE_DIR  # the checkout (pip install -e target, ComfyUI custom-node folder)
# What the in-process host tests and ComfyUI's startup import; `check` imports each in the host's python.
CHECK_IMPORTS = ("torch", "torchvision", "torchaudio", "safetensors", "aiohttp", "av", "yaml", "PIL", "einops",
                 "sentencepiece", "transformers", "comfy_kitchen")


class HostError(RuntimeError):
    """A setup/check failure with a one-line reason (the CLI prints it and exits 2)."""


class Terminated(BaseException):
    """SIGTERM during the CLI (raised where the main thread was, so setup's cleanup runs, as on Ctrl-C)."""


# What a ComfyUI tree has; setup refuses any other tree before it makes a host of it.
COMFYUI_FILES = ("main.py", "requirements.txt", "comfyui_version.py", "comfy/cli_args.py")


# ---------------------------------------------------------------------------------------------------------------
# where the host is

def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "ditkit"


def default_dir(commit: str | None = None) -> Path:
    return cache_root() / f"comfyui-{(commit or PINNED_COMMIT)[:8]}"


def venv_python(root: Path) -> Path | None:
    for cand in (root / "venv" / "bin" / "python", root / ".venv" / "bin" / "python",
                 root / "venv" / "Scripts" / "python.exe", root / ".venv" / "Scripts" / "python.exe"):
        if cand.is_file():
            return cand
    return None


def read_marker(root: Path) -> dict | None:
    p = root / MARKER
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == MARKER_FORMAT else None


def _write_marker(root: Path, data: dict) -> None:
    data = {"format": MARKER_FORMAT, **data}
    fd, tmp = tempfile.mkstemp(prefix=".ditkit-host.", suffix=".tmp", dir=root)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, root / MARKER)


@dataclass
class Host:
    """A ComfyUI host: its tree, the python that runs it, and where it was found."""
    root: Path
    origin: str                       # "COMFYUI_PATH", "--comfyui", "cached host"
    python: Path | None = None
    marker: dict | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        who = "ditkit's cached host" if self.marker else "a ComfyUI checkout"
        ver = f" ComfyUI {self.marker.get('version')} @ {str(self.marker.get('commit'))[:8]}" if self.marker else ""
        return f"{who}{ver} at {self.root} (from {self.origin}; python {self.python or '?'})"


def inspect(root: Path, origin: str, *, deep: bool = False) -> Host:
    """What is at ``root``. ``deep`` also runs the host's python and imports ComfyUI's requirements."""
    root = Path(root).expanduser()
    h = Host(root=root, origin=origin)
    if not (root / "main.py").is_file():
        h.problems.append(f"{root} has no main.py (not a ComfyUI checkout)")
        return h
    h.marker = read_marker(root)
    if h.marker is not None and h.marker.get("state") != "complete":
        h.problems.append(f"{root} is a half-made ditkit host (state {h.marker.get('state')!r}): "
                          "run `python -m ditkit.host setup` again")
    h.python = venv_python(root)
    if h.python is None:
        if h.marker is not None:  # ditkit's own host always has its venv; a user's tree may run on another python
            h.problems.append(f"{root} has no venv/bin/python: run `python -m ditkit.host setup` again")
            return h
        if not deep:
            return h
    if deep:
        h.problems.extend(_deep_problems(root, h.python or Path(sys.executable)))
    return h


def _deep_problems(root: Path, python: Path) -> list[str]:
    code = ("import importlib, json, sys\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "bad = {}\n"
            f"for m in {CHECK_IMPORTS!r} + ('comfy.cli_args',):\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as e:\n"
            "        bad[m] = f'{type(e).__name__}: {e}'[:200]\n"
            "print(json.dumps(bad))\n")
    try:
        r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=str(root))
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"{python} does not run: {e}"]
    if r.returncode != 0:
        return [f"{python} failed ({r.returncode}): {r.stderr.strip()[-300:]}"]
    try:
        bad = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [f"{python} printed no import report: {r.stdout[-200:]!r}"]
    return [f"{m} does not import in {python}: {why}" for m, why in sorted(bad.items())]


def find_host(explicit: str | os.PathLike | None = None, *, deep: bool = False) -> Host | None:
    """The host ditkit uses: ``explicit`` (``--comfyui``), else ``$COMFYUI_PATH``, else the cached host for the
    pinned commit if one was set up. None when there is none at all (a found but broken host is returned with
    its problems, so callers can say what is wrong instead of silently running without it)."""
    if explicit:
        return inspect(Path(explicit), "--comfyui", deep=deep)
    env = os.environ.get("COMFYUI_PATH")
    if env:
        return inspect(Path(env), "COMFYUI_PATH", deep=deep)
    cached = default_dir()
    if cached.exists():
        return inspect(cached, "cached host", deep=deep)
    return None


# ---------------------------------------------------------------------------------------------------------------
# setup

def _run(cmd: list[str], *, what: str, cwd: Path | None = None, capture: bool = False, log=print) -> str:
    log(f"  $ {' '.join(cmd)}")
    try:
        r = subprocess.run(cmd, cwd=str(cwd) if cwd else None, text=True,
                           stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    except OSError as e:
        raise HostError(f"{what}: cannot run {cmd[0]}: {e}") from e
    if r.returncode != 0:
        tail = (r.stderr or "").strip()[-800:] if capture else "(see the output above)"
        raise HostError(f"{what} failed (exit {r.returncode}): {tail}")
    return r.stdout or ""


def _git() -> str:
    git = shutil.which("git")
    if git is None:
        raise HostError("git is not installed (setup reads the ComfyUI tree from a git repository)")
    return git


def _is_url(source: str) -> bool:
    return "://" in source or source.startswith("git@")


def _git_dir(source: str, log) -> Path:
    """A git directory holding the commits: a local repo/bare mirror as is, a URL cloned bare into the cache."""
    git = _git()
    if not _is_url(source):
        p = Path(source).expanduser().resolve()
        if not p.exists():
            raise HostError(f"--source {source!r}: no such folder")
        for cand in (p / ".git", p):
            r = subprocess.run([git, "--git-dir", str(cand), "rev-parse", "--git-dir"], capture_output=True,
                               text=True)
            if r.returncode == 0:
                return cand
        raise HostError(f"--source {source!r}: not a git repository or bare mirror")
    mirror = cache_root() / "sources" / "comfyui.git"
    if (mirror / "HEAD").is_file():
        log(f"updating the bare clone {mirror}")
        _run([git, "--git-dir", str(mirror), "fetch", "--tags", "--force", "--", source,
              "+refs/heads/*:refs/heads/*"], what=f"git fetch {source}", log=log)
    else:
        mirror.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="comfyui.git.", dir=mirror.parent))
        try:
            _run([git, "clone", "--bare", "--quiet", "--", source, str(tmp)], what=f"git clone {source}", log=log)
            os.replace(tmp, mirror)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return mirror


def resolve_ref(git_dir: Path, ref: str) -> str:
    if not ref or ref.startswith("-") or any(c in ref for c in "\0\n"):
        raise HostError(f"--ref {ref!r}: not a commit or tag name")
    r = subprocess.run([_git(), "--git-dir", str(git_dir), "rev-parse", "--verify", "--quiet", "--end-of-options",
                        f"{ref}^{{commit}}"], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise HostError(f"--ref {ref!r}: no such commit or tag in {git_dir}")
    return r.stdout.strip()


def extract_tree(git_dir: Path, commit: str, dest: Path) -> list[str]:
    """Write ``commit``'s tree into ``dest`` (which must not exist) straight from the object store. Returns the
    paths that could not be written (blobs absent from the mirror, submodules), which are not an error."""
    git = _git()
    gd = ["--git-dir", str(git_dir)]
    out = subprocess.run([git, *gd, "ls-tree", "-r", "-z", "--full-tree", "--end-of-options", commit],
                         capture_output=True)
    if out.returncode != 0:
        raise HostError(f"git ls-tree {commit[:8]} failed in {git_dir}: {out.stderr.decode(errors='replace')[-300:]}")
    entries = []
    for rec in out.stdout.split(b"\0"):
        if not rec:
            continue
        meta, path = rec.split(b"\t", 1)
        mode, kind, sha = meta.decode().split()
        entries.append((mode, kind, sha, path.decode("utf-8", "surrogateescape")))
    missing: list[str] = []
    blobs = [e for e in entries if e[1] == "blob"]
    for mode, kind, sha, path in entries:
        if kind != "blob":
            missing.append(f"{path} ({kind} {sha[:8]}, not extracted)")
    dest.mkdir(parents=True)
    proc = subprocess.Popen([git, *gd, "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for mode, _kind, sha, path in blobs:
            rel = Path(path)
            if rel.is_absolute() or ".." in rel.parts:
                raise HostError(f"refusing a tree path outside the checkout: {path!r}")
            proc.stdin.write(sha.encode() + b"\n")
            proc.stdin.flush()
            header = proc.stdout.readline().split()
            if len(header) == 2 and header[1] == b"missing":
                missing.append(f"{path} (blob {sha[:8]} absent from the mirror)")
                continue
            size = int(header[2])
            data = proc.stdout.read(size)
            proc.stdout.read(1)  # the newline after each object
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                os.symlink(data.decode("utf-8", "surrogateescape"), target)
                continue
            with open(target, "xb") as f:
                f.write(data)
            if mode == "100755":
                os.chmod(target, 0o755)
    finally:
        proc.stdin.close()
        proc.wait()
    return missing


def _requirements_without_torch(root: Path) -> list[str]:
    req = []
    for line in (root / "requirements.txt").read_text(encoding="utf-8").splitlines():
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        name = s.replace(">", " ").replace("<", " ").replace("=", " ").replace("~", " ").replace("!", " ").split()[0]
        if name.lower() in TORCH_NAMES:
            continue
        if s.startswith("-"):  # a pip option (-r, --index-url, -e ...) in the tree's file: never passed to pip
            raise HostError(f"{root / 'requirements.txt'}: line {s[:80]!r} is a pip option, not a requirement; "
                            "refusing to pass it to pip")
        req.append(s)
    return req


def _check_python(python: str) -> str:
    try:
        r = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostError(f"--python {python!r} does not run: {e}") from e
    ver = r.stdout.strip()
    if r.returncode != 0 or not ver:
        raise HostError(f"--python {python!r} does not run: {r.stderr.strip()[-200:]}")
    major, minor = (int(x) for x in ver.split("."))
    if (major, minor) < (3, 10):
        raise HostError(f"--python {python!r} is Python {ver}; ComfyUI 0.33 and ditkit need 3.10 or newer")
    return ver


def venv_plan(root: Path, pack: Path = PACK_ROOT) -> list[tuple[str, list[str]]]:
    """The pip installs that make the host's venv, in order: (what, pip install arguments)."""
    req = _requirements_without_torch(root)
    return [("the torch set", ["--", *TORCH_SET]),
            ("ComfyUI's requirements", ["--", *req] if req else []),
            ("ditkit (editable, dev extra)", ["-e", f"{Path(pack).resolve()}[dev]"])]


def make_venv(root: Path, python: str, *, pack: Path = PACK_ROOT, log=print) -> dict:
    """``root/venv`` made by :func:`venv_plan`. Removes the venv again when any step fails, so a half-made one is
    never left to be mistaken for a usable host. Returns the installed versions of the torch set."""
    venv = root / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    try:
        _run([python, "-m", "venv", str(venv)], what="python -m venv", log=log)
        vpy = str(venv_python(root))
        for what, args in venv_plan(root, pack):
            if args:
                log(f"installing {what}")
                _run([vpy, "-m", "pip", "install", "--disable-pip-version-check", *args],
                     what=f"pip install of {what}", log=log)
        out = _run([vpy, "-c", "import importlib.metadata as m, json\n"
                    "def v(n):\n    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n"
                    "        return None\n"
                    f"print(json.dumps({{n: v(n) for n in {TORCH_NAMES!r}}}))"],
                   what="reading the installed torch set", capture=True, log=lambda *_: None)
        return json.loads(out.strip().splitlines()[-1])
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise


def setup(source: str | None = None, ref: str | None = None, directory: str | os.PathLike | None = None,
          python: str | None = None, *, log=print) -> Host:
    t0 = time.monotonic()
    python = python or sys.executable
    pyver = _check_python(python)
    source = source or DEFAULT_SOURCE
    known = PINNED_COMMIT if ref is None else (ref if len(ref) == 40 and all(c in "0123456789abcdef" for c in ref)
                                               else None)
    if known is not None:  # a complete host of a known commit is reused without contacting the source
        root = Path(directory).expanduser().resolve() if directory else default_dir(known)
        marker = read_marker(root) if root.exists() else None
        if marker is not None and marker.get("commit") == known and marker.get("state") == "complete":
            h = inspect(root, "cached host", deep=True)
            if h.usable:
                log(f"reusing: {h.describe()} (checked: {', '.join(CHECK_IMPORTS)} import)")
                _ensure_pack(root, h, log)
                return h
    git_dir = _git_dir(source, log)
    commit = resolve_ref(git_dir, ref or PINNED_COMMIT)
    root = Path(directory).expanduser().resolve() if directory else default_dir(commit)
    log(f"ditkit host: ComfyUI {commit[:8]} from {source} into {root}")

    marker = read_marker(root) if root.exists() else None
    if root.exists() and marker is None:
        if any(root.iterdir()):
            raise HostError(f"{root} exists and is not a ditkit host (no {MARKER}): refusing to write into it; "
                            "give --dir an empty or new folder")
        root.rmdir()
    if marker is not None and marker.get("commit") != commit:
        raise HostError(f"{root} is a ditkit host of ComfyUI {str(marker.get('commit'))[:8]}, not {commit[:8]}: "
                        "remove it or give another --dir")
    if marker is not None and marker.get("state") == "complete":
        h = inspect(root, "cached host", deep=True)
        if h.usable:
            log(f"reusing: {h.describe()} (checked: {', '.join(CHECK_IMPORTS)} import)")
            _ensure_pack(root, h, log)
            return h
        log("the existing host is not usable, rebuilding its venv: " + "; ".join(h.problems))
        marker["state"] = "tree"

    if marker is None:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial.", dir=root.parent))
        tmp.rmdir()
        try:
            missing = extract_tree(git_dir, commit, tmp)
            absent = [f for f in COMFYUI_FILES if not (tmp / f).is_file()]
            if absent:
                raise HostError(f"--source {source!r} at {commit[:8]} is not a ComfyUI tree (no {', '.join(absent)}); "
                                "nothing was made")
            version = _read_version(tmp)
            marker = {"commit": commit, "version": version, "source": source, "missing": missing, "state": "tree"}
            _write_marker(tmp, marker)
            os.replace(tmp, root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log(f"extracted ComfyUI {marker['version']} ({commit[:8]}) into {root}")
        for m in missing:
            log(f"  not extracted: {m}")
    marker["state"] = "venv"
    _write_marker(root, marker)
    log(f"making {root / 'venv'} from {python} (Python {pyver})")
    versions = make_venv(root, python, log=log)   # removes its half-made venv on any failure, Ctrl-C, SIGTERM
    marker.update(state="complete", python=pyver, packages=versions, pack=str(PACK_ROOT),
                  made=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    _write_marker(root, marker)
    h = inspect(root, "cached host", deep=True)
    if not h.usable:
        raise HostError("the host was made but does not check out: " + "; ".join(h.problems))
    log(f"done in {time.monotonic() - t0:.0f} s: {h.describe()}; torch set {versions}")
    return h


def _read_version(root: Path) -> str:
    p = root / "comfyui_version.py"
    try:
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return "unknown"


def _ensure_pack(root: Path, h: Host, log) -> None:
    """On reuse: make the host's editable ditkit point at this checkout (it is ditkit's own venv)."""
    r = subprocess.run([str(h.python), "-c", "import ditkit, os; print(os.path.dirname(os.path.abspath("
                        "ditkit.__file__)))"], capture_output=True, text=True, cwd=str(root))
    where = r.stdout.strip()
    if r.returncode == 0 and Path(where).resolve() == PACKAGE_DIR:
        log(f"  ditkit in the host venv is this checkout ({PACK_ROOT})")
        return
    log(f"  ditkit in the host venv is {where or 'missing'}: installing this checkout ({PACK_ROOT}) editable")
    _run([str(h.python), "-m", "pip", "install", "--disable-pip-version-check", "-e", f"{PACK_ROOT}[dev]"],
         what="pip install -e ditkit[dev]", log=log)


# ---------------------------------------------------------------------------------------------------------------
# the host contract, probed inside the host's python

CONTRACT_MARK = "DITKIT-CONTRACT "
# run as `python -c CONTRACT_CHILD <comfyui root> <pack dir>` with the host's python, in the ComfyUI folder: this
# checkout imported as `ditkit` (whatever ditkit that venv has installed), ComfyUI with --cpu semantics
CONTRACT_CHILD = """
import importlib.util, json, sys
root, pack = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("ditkit", pack + "/__init__.py", submodule_search_locations=[pack])
mod = importlib.util.module_from_spec(spec)
sys.modules["ditkit"] = mod
spec.loader.exec_module(mod)
from comfy.cli_args import args
args.cpu = True
import comfy.model_management
from ditkit.bridge import contract
table = contract.check_all()
rows = table.rows()
for row, res in zip(rows, table.results):
    row["doc"] = res.entry.doc
print(%r + json.dumps({"host_version": table.host_version, "rows": rows}), flush=True)
""" % CONTRACT_MARK


def probe_contract(root: Path, python: Path | str, pack: Path = PACK_ROOT, timeout: float = 900) -> dict:
    """``{"host_version", "rows": [{symbol, what, state, note, nodes, doc}]}`` of the ComfyUI at ``root``, probed
    by ``python`` (HostError when it cannot be run or prints no table)."""
    try:
        r = subprocess.run([str(python), "-c", CONTRACT_CHILD, str(root), str(pack)], capture_output=True, text=True,
                           timeout=timeout, cwd=str(root))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostError(f"the host contract could not be probed with {python}: {e}") from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(CONTRACT_MARK)]
    if r.returncode != 0 or not lines:
        raise HostError(f"the host contract probe failed in {python} ({r.returncode}): "
                        f"{(r.stderr or r.stdout).strip()[-600:]}")
    return json.loads(lines[-1][len(CONTRACT_MARK):])


def format_contract(data: dict, where: str = "") -> str:
    """The contract as a text table: one row per entry (state, what, symbol, dependent nodes, note)."""
    rows = data["rows"]
    states = [r["state"] for r in rows]
    head = (f"ditkit host contract on ComfyUI {data['host_version']}{' at ' + where if where else ''}: "
            f"{len(rows)} entries, {states.count('holds')} hold, {states.count('adapted')} adapted, "
            f"{states.count('broken')} broken")
    w_sym = min(max([len(r["symbol"]) for r in rows] + [6]), 70)
    w_what = max([len(r["what"]) for r in rows] + [4])
    out = [head, f"{'state':8} {'what':{w_what}} {'symbol':{w_sym}} nodes / note"]
    order = {"broken": 0, "adapted": 1, "holds": 2}
    for r in sorted(rows, key=lambda r: (order.get(r["state"], 3), r["symbol"])):
        nodes = ", ".join(r["nodes"])
        out.append(f"{r['state']:8} {r['what']:{w_what}} {r['symbol']:{w_sym}} {nodes}")
        if r["note"]:
            out.append(f"{'':8} {'':{w_what}} {'':{w_sym}}   {r['note']}")
    return "\n".join(out)


def check_contract(explicit: str | None = None, *, pack: Path = PACK_ROOT) -> int:
    """``check --contract``: print the table; 0 when nothing is broken, 1 when an entry is, 2 without a host."""
    h = find_host(explicit)
    if h is None:
        print(f"no host: COMFYUI_PATH is unset and {default_dir()} does not exist (python -m ditkit.host setup, "
              "or --comfyui PATH)")
        return 2
    if not (h.root / "main.py").is_file():
        print(f"not a ComfyUI checkout: {'; '.join(h.problems)}")
        return 2
    data = probe_contract(h.root, h.python or sys.executable, pack)
    print(format_contract(data, str(h.root)))
    return 1 if any(r["state"] == "broken" for r in data["rows"]) else 0


# ---------------------------------------------------------------------------------------------------------------
# CLI

def _on_signal(signum, frame):
    for s_ in (signal.SIGINT, signal.SIGTERM):  # the cleanup that follows is not interrupted again
        signal.signal(s_, signal.SIG_IGN)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def main(argv: list[str] | None = None) -> int:
    """The CLI: one line and exit 2 on a refusal; Ctrl-C / SIGTERM remove what setup began and exit 130 / 143."""
    import threading

    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s_: signal.signal(s_, _on_signal) for s_ in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("ditkit.host: interrupted (Ctrl-C); what this run began was removed", file=sys.stderr, flush=True)
        return 130
    except Terminated:
        print("ditkit.host: stopped by SIGTERM; what this run began was removed", file=sys.stderr, flush=True)
        return 143
    finally:
        for s_, h_ in old.items():
            signal.signal(s_, h_)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ditkit.host", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="make (or check and reuse) the pinned ComfyUI host")
    s.add_argument("--source", help=f"local git dir / bare mirror, or a git URL (default {DEFAULT_SOURCE})")
    s.add_argument("--ref", help=f"commit or tag (default {PINNED_COMMIT[:8]}, ComfyUI {PINNED_VERSION})")
    s.add_argument("--dir", help=f"where (default {default_dir()})")
    s.add_argument("--python", help="interpreter to make the venv from (default: this one)")
    p = sub.add_parser("path", help="print the host ditkit would use (stdout) and why (stderr)")
    p.add_argument("--usable", action="store_true", help="print nothing and exit 1 unless that host is usable")
    c = sub.add_parser("check", help="say whether the host is usable (imports ComfyUI's requirements in its python)")
    c.add_argument("--comfyui", help="check this checkout instead")
    c.add_argument("--contract", action="store_true",
                   help="print ditkit's host contract on that ComfyUI (every host symbol/behaviour ditkit relies on, "
                        "the nodes that depend on it, and whether it holds); exit 1 when an entry is broken")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "setup":
            setup(a.source, a.ref, a.dir, a.python)
            return 0
        if a.cmd == "path":
            h = find_host()
            if h is None:
                print(f"no host: COMFYUI_PATH is unset and {default_dir()} does not exist "
                      "(python -m ditkit.host setup)", file=sys.stderr)
                return 1
            if a.usable and not h.usable:
                print("; ".join(h.problems), file=sys.stderr)
                return 1
            print(h.root)
            print(h.describe() + ("" if h.usable else "; NOT usable: " + "; ".join(h.problems)), file=sys.stderr)
            return 0
        if a.contract:
            return check_contract(a.comfyui)
        h = find_host(a.comfyui, deep=True)
        if h is None:
            print(f"no host: COMFYUI_PATH is unset and {default_dir()} does not exist (python -m ditkit.host setup)")
            return 1
        if h.usable:
            print(f"usable: {h.describe()}")
            if h.marker and h.marker.get("missing"):
                print(f"  not extracted (not needed by ditkit): {len(h.marker['missing'])} file(s): "
                      + ", ".join(m.split(' ')[0] for m in h.marker["missing"]))
            return 0
        print(f"not usable: {h.describe()}")
        for p_ in h.problems:
            print(f"  - {p_}")
        return 1
    except HostError as e:
        print(f"ditkit.host: {e}", file=sys.stderr)
        return 2
    except (OSError, subprocess.SubprocessError) as e:
        print(f"ditkit.host: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
