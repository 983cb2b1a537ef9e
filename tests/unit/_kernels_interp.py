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


ensure_interpreted()
DEVICE = "cuda" if ON_GPU else "cpu"
