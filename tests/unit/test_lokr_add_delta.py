"""loaders/lokr_math.add_delta_, written from the survivors of a mutation run (issue 29): the in-place add against
the Kronecker product written element by element here, conv factors, the function hook and the dtype it receives,
swap_halves, and the chunking promise (no kron call larger than the budget, the number of row blocks)."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.loaders import lokr_math as lm

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def kron_oracle(w1, w2):
    """kron(w1, w2) for w1 [ol, im] and w2 [ok, in, k...]: out[i*ok + p, j*in + q, ...] = w1[i, j] * w2[p, q, ...]."""
    ol, im = w1.shape
    ok, inn = w2.shape[:2]
    out = torch.zeros(ol * ok, im * inn, *w2.shape[2:], dtype=torch.float64)
    for i in range(ol):
        for j in range(im):
            out[i * ok:(i + 1) * ok, j * inn:(j + 1) * inn] = w1[i, j].double() * w2.double()
    return out


def _factors(ol, im, ok, inn, k=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"lokr_w1": torch.randn(ol, im, generator=g), "lokr_w2": torch.randn(ok, inn, *k, generator=g)}


class KronSpy:
    def __init__(self, monkeypatch):
        self.sizes, self.real = [], torch.kron
        monkeypatch.setattr(torch, "kron", self)

    def __call__(self, a, b):
        out = self.real(a, b)
        self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize("k", [(), (3, 2)])
@pytest.mark.parametrize("chunk", [1, 5, 6, 7, 12, 13, 1 << 22])
def test_add_delta_matches_the_oracle_and_keeps_to_the_budget(k, chunk, monkeypatch):
    f = _factors(5, 2, 2, 3, k)                                  # w1 not square: rows and columns differ
    want = kron_oracle(f["lokr_w1"], f["lokr_w2"]) * 0.5
    base = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    w = base.clone()
    spy = KronSpy(monkeypatch)
    out = lm.add_delta_(w, f, 0.5, max_chunk_elems=chunk)
    assert out is w and torch.allclose(w, base + want, rtol=0, atol=1e-6)
    per_row = 2 * 6 * math.prod(k)                               # weight elements per row of w1
    rows = max(1, chunk // per_row)
    assert spy.sizes == [min(rows, 5 - i) * per_row for i in range(0, 5, rows)]   # blocks of w1 rows, in order


def test_one_element_rows_use_the_whole_budget(monkeypatch):
    f = _factors(4, 1, 1, 1)
    w = torch.zeros(4, 1, dtype=torch.float64)
    spy = KronSpy(monkeypatch)
    lm.add_delta_(w, f, 1.0, max_chunk_elems=2)
    assert spy.sizes == [2, 2] and torch.allclose(w, kron_oracle(f["lokr_w1"], f["lokr_w2"]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape_kind", ["same", "reshaped", "swap"])
def test_function_gets_the_delta_in_the_weight_dtype(dtype, shape_kind):
    f = _factors(4, 2, 2, 3, seed=3)
    d = kron_oracle(f["lokr_w1"], f["lokr_w2"]) * -2.0           # [8, 6]
    if shape_kind == "reshaped":
        target = d.reshape(4, 12)
    elif shape_kind == "swap":
        target = torch.cat([d[4:], d[:4]], dim=0)
    else:
        target = d
    w = torch.zeros(target.shape, dtype=dtype)
    seen = []

    def fn(a):
        seen.append(a.dtype)
        return a * 3

    lm.add_delta_(w, f, -2.0, swap_halves=shape_kind == "swap", function=fn)
    assert seen and set(seen) == {dtype}
    tol = {torch.float16: 2e-2, torch.bfloat16: 8e-2}.get(dtype, 1e-5)     # fp32 products, one rounding to dtype
    assert torch.allclose(w.double(), target * 3, rtol=tol, atol=tol)


def test_swap_halves_and_a_non_contiguous_weight_view():
    f = _factors(2, 3, 3, 2, seed=4)
    d = kron_oracle(f["lokr_w1"], f["lokr_w2"])                  # [6, 6]
    w = torch.zeros(6, 12, dtype=torch.float64)[:, ::2]          # a strided view: written in place
    lm.add_delta_(w, f, 1.0, swap_halves=True)
    assert torch.allclose(w, torch.cat([d[3:], d[:3]]), rtol=0, atol=1e-6)


def test_conv_fallback_to_a_reshaped_target(monkeypatch):
    f = _factors(2, 2, 3, 1, (2, 2), seed=5)
    d = kron_oracle(f["lokr_w1"], f["lokr_w2"])                  # [6, 2, 2, 2]
    w = torch.zeros(6, 8, dtype=torch.float64)
    spy = KronSpy(monkeypatch)
    lm.add_delta_(w, f, 1.0, max_chunk_elems=1)
    assert spy.sizes == [48] and torch.allclose(w, d.reshape(6, 8), rtol=0, atol=1e-6)


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_delta_weight_rebuilds_decomposed_factors_in_the_dtype_asked(src, dtype):
    g = torch.Generator().manual_seed(6)
    r = {k: torch.randn(*s, generator=g).to(src) for k, s in
         (("lokr_w1_a", (3, 2)), ("lokr_w1_b", (2, 2)), ("lokr_w2_a", (4, 2)), ("lokr_w2_b", (2, 5)))}
    w1 = r["lokr_w1_a"].to(dtype) @ r["lokr_w1_b"].to(dtype)      # the products in the dtype asked, written here
    w2 = r["lokr_w2_a"].to(dtype) @ r["lokr_w2_b"].to(dtype)
    want = (kron_oracle(w1, w2) * 0.25).reshape(12, 10)
    got = lm.delta_weight(r, (12, 10), 0.25, dtype)
    assert got.dtype == dtype and got.shape == (12, 10)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)


def test_factorization_factor_rules_on_both_sides():
    # a factor that divides: exactly (factor, dimension / factor), sorted, even far from sqrt
    assert lm.factorization(12, 6) == (2, 6) and lm.factorization(12, 2) == (2, 6) and lm.factorization(12, 12) == (1, 12)
    assert lm.factorization(12, 1) == (1, 12)
    # factor 0: no divisor pair may have a first value above 0, so the search stops at (1, dimension)
    assert lm.factorization(12, 0) == (1, 12) and lm.factorization(7, 0) == (1, 7)
    # a factor that does not divide: the pair closest to sqrt whose first value is at most factor
    assert lm.factorization(12, 5) == (3, 4) and lm.factorization(12, 2) == (2, 6) and lm.factorization(36, 5) == (4, 9)


@pytest.mark.parametrize("dim", [1, 2, 7, 12, 36, 60, 97, 3072])
def test_factorization_without_bound_is_the_pair_closest_to_sqrt(dim):
    pairs = [(m, dim // m) for m in range(1, dim + 1) if dim % m == 0 and m <= dim // m]
    want = min(pairs, key=lambda p: p[0] + p[1])                 # the smallest sum: closest to sqrt
    assert lm.factorization(dim) == want == lm.factorization(dim, -1)
