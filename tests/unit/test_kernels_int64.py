"""Every Triton ``index * stride`` goes through ``offs64``; prove it survives strides that overflow int32.

The interpreter reproduces the i32 wrap faithfully, so the probe kernels need no 2**31-element tensor: the
same helper the kernels use is evaluated with a huge fake stride and compared with exact Python integers.
"""
from __future__ import annotations

import pytest
import torch

from _kernels_interp import DEVICE, ensure_interpreted, need_triton  # noqa: E402  (tests/unit on sys.path)

ensure_interpreted()

from ditkit.kernels import _triton  # noqa: E402

pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="triton not installed")


@pytest.mark.parametrize("stride", [1_000_000_000, 2**28 + 3, 2**31 - 1])
def test_offs64_does_not_wrap(stride):
    need_triton()
    N = 16
    grid = 4
    out = torch.zeros(grid * N, dtype=torch.int64, device=DEVICE)
    _triton._offs64_probe_kernel[(grid,)](out, stride, N=N)
    want = torch.arange(grid * N, dtype=torch.int64) * stride
    assert torch.equal(out.cpu(), want)
    assert int(out.max()) > 2**31, "the probe must actually cross 2**31"


def test_unpromoted_form_wraps():
    """Negative control: without the promotion the interpreter (like the GPU) wraps at 2**31."""
    need_triton()
    N = 16
    out = torch.zeros(4 * N, dtype=torch.int64, device=DEVICE)
    _triton._offs32_probe_kernel[(4,)](out, 1_000_000_000, N=N)
    want = torch.arange(4 * N, dtype=torch.int64) * 1_000_000_000
    assert not torch.equal(out.cpu(), want)
    assert int(out.min()) < 0


def test_kernels_use_offs64_for_every_stride_product():
    """Source check: no raw ``* s_..``/``* stride_..`` products in the kernels (all go through offs64)."""
    import inspect
    import re

    from ditkit.kernels import block_sparse_triton, tile_pack

    for fn in (block_sparse_triton._bsa_fwd_kernel, tile_pack._pack_kernel, tile_pack._unpack_combine_kernel):
        src = inspect.getsource(fn.fn if hasattr(fn, "fn") else fn)
        body = src.split(":", 1)[1]
        assert not re.search(r"\*\s*(s_|stride_)\w+", body), f"raw stride product in {fn}"
        assert "offs64(" in body
