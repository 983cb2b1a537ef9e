"""Parsing helpers for ``tests/unit/test_lab_harness_ref.py`` (the quality lab's printed tables). The
``benchmarks/bench_*.py`` smokes no longer parse prose: those scripts write rows (``--rows``, benchmarks/_harness.py)
that the smokes read as data."""
from __future__ import annotations

import math
import re

# one printed number (int, float, exponent, inf or nan) as a regex group
NUM = r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|inf|nan))"


def positive(x: str) -> float:
    """``x`` as a float, asserting it is finite and > 0."""
    v = float(x)
    assert math.isfinite(v) and v > 0, f"expected a positive finite number, got {x!r}"
    return v


def one(pattern: str, out: str) -> re.Match:
    """The first line of ``out`` matching ``pattern`` (multiline), asserting there is one."""
    m = re.search(pattern, out, flags=re.M)
    assert m, f"line matching {pattern!r} missing from:\n{out[-3000:]}"
    return m
