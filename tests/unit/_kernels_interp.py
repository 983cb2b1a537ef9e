"""Make sure ditkit's Triton kernels run under the Triton interpreter on CPU (TRITON_INTERPRET=1).

Triton decides interpreted vs compiled when ``@triton.jit`` runs (module import), so this sets the variable
and, if the kernel modules were already imported compiled by an earlier test, reloads them.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

ON_GPU = torch.cuda.is_available()

_MODS = ("ditkit.kernels._triton", "ditkit.kernels.tile_pack", "ditkit.kernels.block_sparse", "ditkit.kernels.vsa",
         "ditkit.kernels.delta_fuse", "ditkit.kernels.quant", "ditkit.kernels.quant_triton",
         "ditkit.kernels")


def ensure_interpreted():
    """Build ditkit's kernels for the interpreter. TRITON_INTERPRET must stay set for the session: Triton
    also reads it at launch (restoring it makes the first launch fail inside triton.experimental.gluon)."""
    if ON_GPU:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    t = sys.modules.get("ditkit.kernels._triton")
    if t is not None and getattr(t, "HAS_TRITON", False) and not t.INTERPRETED:
        for m in _MODS:
            if m in sys.modules:
                importlib.reload(sys.modules[m])
    import ditkit.kernels  # noqa: F401


def interpreter_ok() -> str | None:
    """None when the Triton kernels can run here; else why not (for pytest.skip)."""
    from ditkit.kernels import _triton

    if not _triton.HAS_TRITON:
        return "triton is not installed"
    if ON_GPU:
        return None
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(std.max, InterpretedFunction):
        return ("triton was imported before TRITON_INTERPRET=1 was set in this process; run the kernel tests "
                "in their own pytest process (e.g. pytest tests/unit/test_kernels_*.py)")
    return None


def need_triton(backend: str = "triton") -> None:
    import pytest

    if backend == "triton":
        why = interpreter_ok()
        if why:
            pytest.skip(why)


ensure_interpreted()
DEVICE = "cuda" if ON_GPU else "cpu"
