"""loaders/lokr_apply.validate_module (issue 29 gap classes): a LoKr factor holding NaN or +-Inf is refused in every
float dtype a file may store (fp16, bf16, fp32, fp64), contiguous or not; the largest finite value and the
smallest subnormal of each dtype pass. The fast path tests the exponent field through an integer view, so a wrong
mask constant for one dtype (the audit's planted bug let a float16 +Inf factor through) shows only in that dtype.
Oracle: values made with torch.finfo / float('inf') here, no ditkit code."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import AdapterError
from ditkit.loaders.lokr_apply import LoKrModule, validate_module

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _module(w1, w2):
    return LoKrModule(prefix="m", factors={"lokr_w1": w1, "lokr_w2": w2}, keys=["m.lokr_w1", "m.lokr_w2"])


def _factor(dtype, value, where=(1, 2), layout="contiguous"):
    t = torch.ones(4, 6, dtype=dtype)
    t[where] = value
    if layout == "transposed":
        return t.t().contiguous().t()                       # same values, column-major
    if layout == "strided":
        wide = torch.ones(4, 12, dtype=dtype)
        wide[:, ::2] = t
        return wide[:, ::2]
    return t


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_factor_is_refused(dtype, bad, layout):
    w = _factor(dtype, bad, layout=layout)
    assert (layout == "contiguous") == w.is_contiguous()
    with pytest.raises(AdapterError, match=r"key 'm\.lokr_w2' contains NaN or Inf"):
        validate_module(_module(torch.ones(2, 2, dtype=dtype), w), "f.safetensors")
    with pytest.raises(AdapterError, match=r"key 'm\.lokr_w1' contains NaN or Inf"):
        validate_module(_module(w, torch.ones(2, 2, dtype=dtype)), "f.safetensors")


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("which", ["max", "min", "tiny", "subnormal", "zero", "negzero"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_finite_factors_pass(dtype, which, layout):
    fi = torch.finfo(dtype)
    v = {"max": fi.max, "min": fi.min, "tiny": fi.tiny, "subnormal": fi.smallest_normal / 2, "zero": 0.0,
         "negzero": -0.0}[which]
    validate_module(_module(torch.ones(2, 2, dtype=dtype), _factor(dtype, v, layout=layout)), "f.safetensors")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_bad_element_anywhere(dtype):
    """The last element and the first, not only one in the middle."""
    for where in ((0, 0), (3, 5)):
        with pytest.raises(AdapterError):
            validate_module(_module(torch.ones(2, 2, dtype=dtype), _factor(dtype, math.inf, where)), "f")


def test_integer_factor_is_refused_by_dtype():
    with pytest.raises(AdapterError, match="non-float dtype torch.int32"):
        validate_module(_module(torch.ones(2, 2, dtype=torch.int32), torch.ones(2, 2)), "f")
