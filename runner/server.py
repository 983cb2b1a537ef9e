"""Start a headless ComfyUI for the runner and the integration tests, and stop it again.

The server runs ``<python> main.py --cpu --listen 127.0.0.1 --port <free port> --disable-auto-launch ...`` in a
temp work dir: an ``--extra-model-paths-config`` YAML whose ``custom_nodes`` entry is a folder holding a symlink to
this checkout (ditkit is loaded without touching the ComfyUI tree) and whose model folders point at a models root
(default: the tiny test checkpoints, generated into the work dir). It is stopped by its pid (SIGTERM, then SIGKILL
after a grace period), and on Linux it dies with the process that started it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .client import ComfyClient
from .common import REPO, RunnerError

PACK_LINK_NAME = "ditkit"

# ComfyUI model folder names (folder_paths.folder_names_and_paths) pointed at --models DIR/<name>. The legacy
# names "unet" and "clip" are mapped by ComfyUI to diffusion_models / text_encoders, so DIR/unet and DIR/clip
# are searched too.
MODEL_FOLDERS = (
    "checkpoints", "diffusion_models", "unet", "vae", "text_encoders", "clip", "loras", "clip_vision",
    "controlnet", "upscale_models", "latent_upscale_models", "audio_encoders", "model_patches", "embeddings",
    "vae_approx", "style_models", "hypernetworks", "gligen", "photomaker", "diffusers", "configs",
)



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
    # the script as an absolute path: a checkout named like an option ("-X...") never reaches python as one
    cmd = [python, os.path.abspath(os.path.join(os.fspath(comfyui), "main.py")), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--disable-auto-launch", "--extra-model-paths-config", str(yaml_path),
           "--output-directory", str(out_dir), "--temp-directory", str(temp_base), "--user-directory", str(user_dir),
           "--database-url", "sqlite:///:memory:"]
    if only_ditkit:
        cmd += ["--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_LINK_NAME]
    cmd += list(extra_args)
    return cmd



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
                from ..tiny.checkpoints import generate_all  # torch needed only here

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

