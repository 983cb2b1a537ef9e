"""Optional Triton import and the int64 offset helpers shared by ditkit's Triton kernels.

Every ``index * stride`` product goes through :func:`offs64`, which promotes the index to int64 *before* the
multiply (Triton specializes small int arguments to i32 and ``program_id`` is i32, so ``pid * stride`` would
wrap at 2**31). ``tests/unit/test_kernels_int64.py`` runs these helpers under ``TRITON_INTERPRET=1`` with
strides that overflow 32 bits and checks the exact value (and that the unpromoted form does wrap).
"""
from __future__ import annotations

try:  # triton is optional: CPU installs and machines without it use the reference backends
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - any import failure means "no triton"
    triton = None
    tl = None
    HAS_TRITON = False


def _interpreted(fn) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(fn, InterpretedFunction)
    except Exception:  # noqa: BLE001
        return False


if HAS_TRITON:

    @triton.jit
    def offs64(index, stride):
        """int64 ``index * stride`` (index promoted before the multiply)."""
        return index.to(tl.int64) * stride

    @triton.jit
    def _offs64_probe_kernel(OUT, stride, N: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * N + tl.arange(0, N)
        tl.store(OUT + pid * N + tl.arange(0, N), offs64(rows, stride))

    @triton.jit
    def _offs32_probe_kernel(OUT, stride, N: tl.constexpr):
        # the WRONG form, kept only so the test can show the interpreter reproduces the wrap
        pid = tl.program_id(0)
        rows = pid * N + tl.arange(0, N)
        tl.store(OUT + pid * N + tl.arange(0, N), (rows * stride).to(tl.int64))


# True when this process created ditkit's kernels under TRITON_INTERPRET=1 (decided at import, like Triton)
INTERPRETED = HAS_TRITON and _interpreted(offs64)


def existing_custom_op(name: str):
    """``torch.ops.ditkit.<name>`` when an earlier import of the pack already defined that custom op (ComfyUI loads
    the pack under its folder name, tests and the CLI as ``ditkit``: the second import reuses the first's op), else
    None."""
    import torch

    try:
        return getattr(torch.ops.ditkit, name) if hasattr(torch.ops, "ditkit") else None
    except (AttributeError, RuntimeError):
        return None
