"""Direct tests of two helpers the exact requantization of quantized adapter bases relies on (issue #30):
``kernels/quant.dequant_rows64`` and ``kernels/delta_fuse.check_deltas``."""
from __future__ import annotations

import pytest
import torch

from ditkit.kernels import delta_fuse, quant


@pytest.mark.parametrize("r0,r1", [(0, 40), (0, 1), (39, 40), (8, 24), (17, 33)])
def test_dequant_rows64_mxfp8_is_code_times_power_of_two(r0, r1):
    """Oracle written here: an fp8 e4m3 code times 2^(e - 127) of its 32-column block (e = 0: zero), in float64."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * 3
    data, scales = quant.quantize(w, "mxfp8")
    got = quant.dequant_rows64(data, scales, "mxfp8", r0, r1, 96)
    e = quant.from_blocked(scales["weight_scale"].view(torch.uint8), data.shape[0], data.shape[1] // 32)
    e = e[r0:r1].to(torch.float64)
    s = torch.where(e == 0, torch.zeros_like(e), 2.0 ** (e - 127.0)).repeat_interleave(32, dim=1)
    want = data[r0:r1].to(torch.float64) * s
    assert got.dtype == torch.float64 and got.shape == (r1 - r0, 96)
    assert torch.equal(got, want[:, :96])


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_dequant_rows64_slices_agree_with_the_whole_and_with_dequantize(fmt):
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(1))
    data, scales = quant.quantize(w, fmt)
    whole = quant.dequant_rows64(data, scales, fmt, 0, 48, 80)
    parts = torch.cat([quant.dequant_rows64(data, scales, fmt, a, b, 80) for a, b in ((0, 16), (16, 17), (17, 48))])
    assert torch.equal(parts, whole)
    # the float32 dequantize of the same codes (exact products except float32 subnormals) agrees
    ref = quant.dequantize(data, scales, fmt, (48, 80)).to(torch.float64)
    assert torch.allclose(whole, ref, rtol=0, atol=1e-30) or (whole - ref).abs().max() < 1e-6
    assert whole.shape == (48, 80)


def _lowrank(rows, cols, r=2, at=None):
    return delta_fuse.Delta("lowrank", (torch.ones(rows, r), torch.ones(r, cols)), 1.0, None, at)


def test_check_deltas_accepts_exact_fits_and_slices():
    delta_fuse.check_deltas([_lowrank(8, 5)], 8, 5)
    delta_fuse.check_deltas([_lowrank(3, 5, at=(5, 8))], 8, 5)     # the last rows exactly
    delta_fuse.check_deltas([_lowrank(3, 5, at=(0, 3))], 8, 5)     # the first rows exactly


@pytest.mark.parametrize("rows,cols,slice_,match", [
    (7, 5, None, "does not fit rows 0:7"),       # one row too many (delta 8 rows)
    (9, 5, None, "does not fit rows 0:9"),       # one row too few
    (8, 4, None, "does not fit"),                # one column off
    (8, 6, None, "does not fit"),
    (8, 5, (6, 9), "rows 6:9"),                  # slice one past the end
    (8, 5, (-1, 2), "rows -1:2"),                # slice before the start
    (8, 5, (2, 2), "rows 2:2"),                  # empty slice
])
def test_check_deltas_refuses_one_past_each_bound(rows, cols, slice_, match):
    d = _lowrank(8 if slice_ is None else max(slice_[1] - slice_[0], 1), 5, at=slice_)
    with pytest.raises(ValueError, match=match):
        delta_fuse.check_deltas([d], rows, cols)


def test_check_deltas_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="'outer' is not one of"):
        delta_fuse.check_deltas([delta_fuse.Delta("outer", (torch.ones(2, 2),), 1.0)], 2, 2)
