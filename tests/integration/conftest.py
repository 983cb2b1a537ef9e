"""Real-host fixtures: one headless ComfyUI per session with ditkit and the tiny checkpoints.

``comfy_server`` starts ``main.py --cpu --cache-none`` (``comfy_server_cached``: the host's default caching) on 127.0.0.1 (a free port) through
:class:`ditkit.run.ComfyServer` (the same code as ``python -m ditkit.run``): ditkit is linked into a temp
``custom_nodes`` dir named in an ``--extra-model-paths-config`` YAML, other custom node packs are not loaded
(``--disable-all-custom-nodes --whitelist-custom-nodes ditkit``), the model folders point at a copy of the tiny
checkpoints, and the server is stopped by its pid at the end of the session. Skips when ``COMFYUI_PATH`` is unset.

Environment: ``COMFYUI_PATH`` (required), ``COMFYUI_PYTHON`` (default: the checkout's venv python),
``DITKIT_SERVER_ARGS`` (extra main.py arguments, space-separated), ``DITKIT_WORKFLOW_TIMEOUT`` (seconds, 600).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from ditkit.run import ComfyServer, RunnerError, WorkflowFailed, output_files

WORKFLOW_TIMEOUT = float(os.environ.get("DITKIT_WORKFLOW_TIMEOUT", "600"))
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for it in items:
        if Path(str(it.fspath)).is_relative_to(here):
            it.add_marker(pytest.mark.integration)
            if Path(str(it.fspath)).name.startswith("test_browser_"):  # .ci/run counts these as the browser suite
                it.add_marker(pytest.mark.browser)


class ServerHandle:
    """What tests get: URL, dirs, and helpers around the running server."""

    def __init__(self, server: ComfyServer):
        self.server = server
        self.client = server.client
        self.url = server.url
        self.models_dir: Path = server.models_dir
        self.output_dir: Path = server.out_dir
        self.temp_dir: Path = server.temp_dir
        self.pid: int = server.proc.pid

    def post_prompt(self, graph: dict) -> tuple[int, dict]:
        """POST /prompt; returns ``(http status, json body)`` without waiting."""
        return self.client.post_prompt(graph)

    def run(self, graph: dict, timeout: float = WORKFLOW_TIMEOUT) -> dict:
        """Queue ``graph`` and wait; returns the /history entry. Raises :class:`WorkflowFailed` whose message
        is the formatted validation/execution error (with the last server log lines appended)."""
        try:
            return self.client.run(graph, timeout)
        except WorkflowFailed as e:
            e.args = (f"{e}\n--- server log tail ---\n{self.log_tail(30)}",)
            raise

    def run_expect_failure(self, graph: dict, timeout: float = WORKFLOW_TIMEOUT) -> WorkflowFailed:
        try:
            entry = self.client.run(graph, timeout)
        except WorkflowFailed as e:
            return e
        raise AssertionError(f"expected the workflow to fail, it succeeded: outputs {entry.get('outputs')}")

    def output_files(self, entry: dict) -> list[Path]:
        return [Path(p) for p in output_files(entry, self.output_dir, self.temp_dir)]

    def object_info(self, node_class: str | None = None) -> dict:
        return self.client.object_info(node_class)

    def get_json(self, path: str):
        return self.client.get_json(path)

    def log_text(self) -> str:
        """Server stdout+stderr so far, ANSI colours removed."""
        return ANSI.sub("", self.server.log_text())

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.server.proc.poll() is None


@pytest.fixture(scope="session")
def comfy_server(comfyui_path, tiny_ckpts, tmp_path_factory):
    yield from _server(comfyui_path, tiny_ckpts, tmp_path_factory, "comfy_server", ["--cache-none"])


@pytest.fixture(scope="session")
def comfy_server_cached(comfyui_path, tiny_ckpts, tmp_path_factory):
    """Like ``comfy_server`` but with the host's default caching (no ``--cache-none``): cached outputs are served
    to later prompts, also to nodes with other ids (what users run; ``--cache-none`` hides those paths)."""
    yield from _server(comfyui_path, tiny_ckpts, tmp_path_factory, "comfy_server_cached", [])


def _server(comfyui_path, tiny_ckpts, tmp_path_factory, name: str, args: list[str]):
    root = tmp_path_factory.mktemp(name)
    models = root / "models"
    shutil.copytree(tiny_ckpts, models)  # tests may add (broken) files; the shared tiny_ckpts stay pristine
    extra = list(args) + shlex.split(os.environ.get("DITKIT_SERVER_ARGS", ""))
    server = ComfyServer(comfyui_path, python=os.environ.get("COMFYUI_PYTHON") or None, models_dir=models,
                         out_dir=root / "output", log_path=root / "server.log", extra_args=extra,
                         only_ditkit=True, quiet=True)
    try:
        server.start(timeout=float(os.environ.get("DITKIT_SERVER_STARTUP_TIMEOUT", "240")))
    except RunnerError as e:
        pytest.fail(f"ComfyUI did not start: {e}\n--- log tail ---\n{server.log_tail(60)}", pytrace=False)
    handle = ServerHandle(server)
    try:
        yield handle
    finally:
        server.stop()


@pytest.fixture(scope="module")
def zimage(comfy, tiny_ckpts):
    """The tiny Z-Image through DitKitZImageLoader (the stock loader cannot load dim 256), one torch thread."""
    import folder_paths
    import torch

    from ditkit.nodes.image_loaders import DitKitZImageLoader

    torch.set_num_threads(1)
    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    out = DitKitZImageLoader.execute("zimage_tiny.safetensors")
    return out.args[0] if hasattr(out, "args") else out[0]
