"""Shared pytest fixtures.

* ``comfyui_path``: the real ComfyUI checkout from ``COMFYUI_PATH``; tests that need it skip with a clear
  reason when it is unset.
* ``comfy``: ComfyUI imported in-process on CPU (``args.cpu = True`` before ``comfy.model_management``), for
  node-level tests that call ``Node.execute`` directly. Skips when ComfyUI or its requirements are missing
  from this interpreter (run the suite with the ComfyUI venv's python to enable it).
* ``tiny_ckpts``: the deterministic tiny checkpoints (``python -m ditkit.testing.checkpoints``), generated
  once per session into a temp dir.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels are tested through the Triton interpreter. The flag must be set before
# triton is first imported, so it is set here (pytest imports this file before any test module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def _comfyui_path() -> Path | None:
    p = os.environ.get("COMFYUI_PATH")
    if not p:
        return None
    path = Path(p).expanduser().resolve()
    return path if (path / "main.py").is_file() else None


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    path = _comfyui_path()
    if path is None:
        why = "COMFYUI_PATH is unset" if not os.environ.get("COMFYUI_PATH") else \
            f"COMFYUI_PATH={os.environ['COMFYUI_PATH']!r} has no main.py"
        pytest.skip(f"needs a real ComfyUI host: {why}")
    return path


@pytest.fixture(scope="session")
def comfy(comfyui_path):
    """ComfyUI modules imported in this process, CPU only."""
    if str(comfyui_path) not in sys.path:
        sys.path.insert(0, str(comfyui_path))
    try:
        from comfy.cli_args import args

        args.cpu = True
        import comfy.model_management  # noqa: F401
        import comfy.sd  # noqa: F401
        import comfy.utils  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"ComfyUI at {comfyui_path} is not importable from this interpreter ({type(e).__name__}: {e}); "
                    "run pytest with the ComfyUI venv's python")
    import comfy as comfy_pkg

    return comfy_pkg


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> Path:
    from ditkit.testing.checkpoints import generate_all

    out = tmp_path_factory.mktemp("tiny_ckpts")
    generate_all(out)
    return out
