"""loaders/lokr_math.rebuild_w1 / rebuild_w2 against products written out here: a full factor cast to the dtype
asked, a decomposed factor ``a @ b``, a conv factor without Tucker (``w2_b [r, in_n, k...]``) and with a Tucker core
(``t2 [r, r, k...]``), for every source dtype and non-contiguous factors."""
from __future__ import annotations

import pytest
import torch

from ditkit.loaders import lokr_math as lm

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def g(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def conv_oracle(a, b):
    """w2[p, q, k...] = sum_r a[p, r] * b[r, q, k...], element by element over r."""
    a, b = a.double(), b.double()
    out = torch.zeros(a.shape[0], *b.shape[1:], dtype=torch.float64)
    for r in range(a.shape[1]):
        out += a[:, r].reshape(-1, *([1] * (b.dim() - 1))) * b[r].unsqueeze(0)
    return out


def tucker_oracle(t2, a, b):
    """w2[p, q, k...] = sum_{i, j} t2[i, j, k...] * a[i, p] * b[j, q] (LyCORIS: w2_a [r, out_k], w2_b [r, in_n])."""
    t2, a, b = t2.double(), a.double(), b.double()
    out = torch.zeros(a.shape[1], b.shape[1], *t2.shape[2:], dtype=torch.float64)
    for i in range(t2.shape[0]):
        for j in range(t2.shape[1]):
            out += t2[i, j].unsqueeze(0).unsqueeze(0) * (a[i][:, None] * b[j][None, :]).reshape(
                a.shape[1], b.shape[1], *([1] * (t2.dim() - 2)))
    return out


def tol(dtype):
    return 1e-12 if dtype == torch.float64 else 1e-5


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_full_factors_are_cast_to_the_dtype_asked(src, dtype):
    w1, w2 = g(3, 4, dtype=src), g(5, 6, dtype=src, seed=1)
    r1, r2 = lm.rebuild_w1({"lokr_w1": w1}, dtype), lm.rebuild_w2({"lokr_w2": w2}, dtype)
    assert r1.dtype == dtype and r2.dtype == dtype
    assert torch.equal(r1, w1.to(dtype)) and torch.equal(r2, w2.to(dtype))


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("kernel", [(3,), (3, 2)])
def test_conv_factor_without_tucker(src, kernel):
    a = g(5, 2, dtype=src)                                        # w2_a [out_k, r]
    b = g(2, 4, *kernel, dtype=src, seed=1)                       # w2_b [r, in_n, k...]
    for dtype in (torch.float32, torch.float64):
        got = lm.rebuild_w2({"lokr_w2_a": a, "lokr_w2_b": b}, dtype)
        assert got.dtype == dtype and got.shape == (5, 4, *kernel)
        assert torch.allclose(got.double(), conv_oracle(a, b), rtol=0, atol=tol(dtype))
    # non-contiguous factors: the same values
    at = g(2, 5, dtype=src).t()
    bt = g(4, 2, *kernel, dtype=src, seed=1).transpose(0, 1)
    assert not at.is_contiguous() and not bt.is_contiguous()
    got = lm.rebuild_w2({"lokr_w2_a": at, "lokr_w2_b": bt})
    assert torch.allclose(got.double(), conv_oracle(at, bt), rtol=0, atol=1e-5)


@pytest.mark.parametrize("src", DTYPES)
def test_tucker_core_in_every_dtype(src):
    t2 = g(2, 3, 3, 2, dtype=src)                                  # [r, r, kh, kw]
    a, b = g(2, 5, dtype=src, seed=1), g(3, 4, dtype=src, seed=2)  # w2_a [r, out_k], w2_b [r, in_n]
    for dtype in (torch.float32, torch.float64):
        got = lm.rebuild_w2({"lokr_t2": t2, "lokr_w2_a": a, "lokr_w2_b": b}, dtype)
        assert got.dtype == dtype and got.shape == (5, 4, 3, 2) and got.is_contiguous()
        assert torch.allclose(got.double(), tucker_oracle(t2, a, b), rtol=0, atol=tol(dtype))
    tt = g(3, 2, 3, 2, dtype=src).transpose(0, 1)                  # a non-contiguous core
    got = lm.rebuild_w2({"lokr_t2": tt, "lokr_w2_a": a[:, :], "lokr_w2_b": g(4, 3, dtype=src, seed=2).t()})
    assert torch.allclose(got.double(), tucker_oracle(tt, a, g(4, 3, dtype=src, seed=2).t()), rtol=0, atol=1e-5)


@pytest.mark.parametrize("src", DTYPES)
def test_decomposed_linear_factors(src):
    a1, b1 = g(3, 2, dtype=src), g(2, 4, dtype=src, seed=1)
    a2, b2 = g(5, 2, dtype=src, seed=2), g(2, 6, dtype=src, seed=3)
    for dtype in (torch.float32, torch.float64):
        r1 = lm.rebuild_w1({"lokr_w1_a": a1, "lokr_w1_b": b1}, dtype)
        r2 = lm.rebuild_w2({"lokr_w2_a": a2, "lokr_w2_b": b2}, dtype)
        assert r1.dtype == r2.dtype == dtype and r1.shape == (3, 4) and r2.shape == (5, 6)
        assert torch.allclose(r1.double(), a1.double() @ b1.double(), rtol=0, atol=tol(dtype))
        assert torch.allclose(r2.double(), a2.double() @ b2.double(), rtol=0, atol=tol(dtype))
