"""loaders/lokr_math.factorization against a divisor search written here (LyCORIS semantics: a factor that divides
gives (factor, dimension / factor) sorted; otherwise the divisor pair closest to sqrt(dimension) whose first value
is at most ``factor``; -1 = no bound). Each call runs in a thread with a time limit: a search that never ends (a
wrong step, a lost divisor check) fails here instead of hanging the suite."""
from __future__ import annotations

import math
import threading

import pytest

from ditkit.loaders import lokr_math as lm

LIMIT_S = 10.0


def call(dimension, factor=None):
    """factorization(dimension[, factor]) or a failure after LIMIT_S seconds."""
    out: dict = {}

    def run():
        try:
            out["v"] = lm.factorization(dimension) if factor is None else lm.factorization(dimension, factor)
        except BaseException as e:   # noqa: BLE001 - handed back to the test
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), f"factorization({dimension}, {factor}) did not end in {LIMIT_S} s"
    if "e" in out:
        raise out["e"]
    return out["v"]


def oracle(dimension: int, factor: int = -1) -> tuple[int, int]:
    if factor > 0 and dimension % factor == 0:
        return tuple(sorted((factor, dimension // factor)))
    bound = dimension if factor < 0 else factor
    best = 1
    for m in range(1, math.isqrt(dimension) + 1):
        if dimension % m == 0 and m <= bound:
            best = m
    return best, dimension // best


DIMS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 25, 35, 36, 49, 60, 64, 97, 121, 128, 143, 320, 1024, 3072, 5376,
        3 * 5376]


@pytest.mark.parametrize("dim", DIMS)
def test_unbounded_is_the_closest_divisor_pair(dim):
    want = oracle(dim)
    assert call(dim) == want == call(dim, -1) == call(dim, -7)
    m, n = want
    assert m * n == dim and m <= n


@pytest.mark.parametrize("dim", [12, 36, 60, 64, 97, 143, 3072, 5376])
@pytest.mark.parametrize("factor", [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 16, 64, 100])
def test_every_factor_against_the_oracle(dim, factor):
    got = call(dim, factor)
    assert got == oracle(dim, factor), (dim, factor, got)
    assert got[0] * got[1] == dim and got[0] <= got[1]


def test_bound_at_a_divisor_both_sides():
    # 36 = 4 x 9 = 6 x 6; factor 5 (does not divide): first value <= 5 -> (4, 9); factor 6 divides -> (6, 6)
    assert call(36, 5) == (4, 9) and call(36, 6) == (6, 6) and call(36, 7) == (6, 6)
    # 60: divisors <= sqrt: 1 2 3 4 5 6 7? no; factor 7 (not dividing) -> 6; factor 8 -> 6
    assert call(60, 7) == (6, 10) and call(60, 8) == (6, 10)
    # a prime: only (1, p), whatever the factor
    assert call(97, 5) == (1, 97) and call(97, 97) == (1, 97) and call(97, -1) == (1, 97)


def test_perfect_squares_stop_at_the_root():
    for r in (2, 3, 7, 11, 32):
        assert call(r * r) == (r, r)
