"""Coefficient files and calibration output (issue #17 items 8 and 10): a polynomial negative where the runtime
evaluates it is refused (file) or not written (fit); files are written through loaders/safe_fs.py (never replacing
a file ditkit did not write, never through a symlink) and read opened once without following a symlink."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ditkit.cache import calibrate as cal
from ditkit.cache import coefficients as coef
from ditkit.errors import CoefficientError


def _doc(coeffs, x_range, family="zimage", stream="image"):
    return {"format": coef.FORMAT, "version": 1, "family": family,
            "streams": {stream: {"coefficients": coeffs, "x_range": x_range, "fit": None}},
            "fingerprint": {"family": family}, "provenance": {"source": "test", "kind": "calibrated"}}


@pytest.mark.parametrize("coeffs,x_range,where", [
    ([1.0, -1.0, 0.2], [0.0, 1.0], 0.5),          # (x - 0.5)^2 - 0.05: negative in the middle only
    ([2.0, -1.0], [0.0, 1.0], 0.0),               # 2x - 1: negative at the low end
    ([-2.0, 1.0], [0.0, 1.0], 1.0),               # 1 - 2x: negative at the high end
    ([-0.01], [0.1, 0.2], None),                  # a negative constant
    ([-0.01], None, None),
    ([-1.0, 0.0, 1.0], None, None),               # x_range null: 1 - x^2 goes negative for x > 1
    ([1.0, 0.0, -0.02], None, 0.0),               # x_range null: negative near x = 0
    ([-450.0, 280.0, -45.0, 3.2, -0.02], None, None),   # the borrowed Z-Image polynomial as vLLM-Omni ships it
])
def test_negative_polynomial_is_refused(tmp_path, coeffs, x_range, where):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(_doc(coeffs, x_range)), encoding="utf-8")
    with pytest.raises(CoefficientError) as ei:
        coef.load(p)
    msg = str(ei.value)
    assert "streams.image" in msg and "negative" in msg, msg
    x = float(msg.split("at x = ")[1].split(",")[0])
    assert np.polyval(coeffs, x) < 0          # the reported point is really negative
    if where is not None:
        assert abs(x - where) < 0.05, msg


@pytest.mark.parametrize("coeffs,x_range", [
    ([1.0, -1.0, 0.25], [0.0, 1.0]),              # (x - 0.5)^2: touches 0, never negative
    ([2.0, -1.0], [0.5, 1.0]),                    # clamped into the range where it is >= 0
    ([1.0, 0.0], None),
    ([498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861], None),   # TeaCache's FLUX.1 polynomial
    ([-450.0, 280.0, -45.0, 3.2, -0.02], [0.0069, 0.3323]),
])
def test_non_negative_polynomial_is_accepted(tmp_path, coeffs, x_range):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(_doc(coeffs, x_range)), encoding="utf-8")
    assert coef.load(p).streams["image"].coefficients == tuple(coeffs)


def test_polynomial_check_agrees_with_a_dense_grid():
    """Independent oracle: the minimum over 200 001 points of the interval (numpy), for random polynomials."""
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(300):
        deg = int(rng.integers(0, 6))
        c = rng.normal(size=deg + 1) * 10.0 ** rng.uniform(-2, 2)
        lo = float(rng.uniform(0, 0.5))
        hi = lo + float(rng.uniform(0.01, 1.0))
        xs = np.linspace(lo, hi, 200001)
        grid_min = float(np.polyval(c, xs).min())
        got = coef.polynomial_negative(c.tolist(), (lo, hi))
        if grid_min < -1e-3:
            assert got is not None and got[1] <= grid_min + 1e-9 * max(1, abs(grid_min)), (c, lo, hi, grid_min, got)
            hits += 1
        elif grid_min > 1e-3:
            assert got is None, (c, lo, hi, grid_min, got)
    assert hits > 50


def test_shipped_defaults_are_non_negative_where_evaluated():
    for name, path in coef.shipped_defaults().items():
        cf = coef.load(path)
        for s in cf.streams.values():
            lo, hi = s.x_range if s.x_range is not None else (0.0, 10.0)
            xs = np.linspace(lo, hi, 100001)
            assert np.polyval(s.coefficients, xs).min() >= -1e-6, (name, s.name)


def test_a_fit_that_dips_below_zero_is_not_written():
    x = np.linspace(0.0, 1.0, 60)
    y = np.maximum(0.0, x - 0.8) * 10.0        # flat, then a ramp: a quartic fit undershoots below 0
    c = np.polyfit(x, y, 4)
    assert np.polyval(c, x).min() < -1e-3       # the premise: plain polyfit goes negative here
    with pytest.raises(CoefficientError, match="negative inside the recorded x range"):
        cal.fit_pairs(x.tolist(), y.tolist(), degree=4)
    coeffs, fit, xr = cal.fit_pairs(x.tolist(), (0.5 * x + 0.1).tolist(), degree=1)   # a good fit still passes
    assert abs(coeffs[0] - 0.5) < 1e-9 and xr == (0.0, 1.0)


def _cf():
    return coef.CoefficientFile("h3", {"video": coef.StreamCoefficients("video", (1.0, 0.0))}, {"family": "h3"},
                                {"source": "test", "kind": "calibrated"})


def test_save_replaces_only_coefficient_files(tmp_path):
    p = tmp_path / "c.json"
    coef.save(_cf(), p)
    coef.save(_cf(), p)                          # a coefficient file: re-fitting rewrites it
    (tmp_path / "notes.json").write_text("my notes", encoding="utf-8")
    with pytest.raises(CoefficientError, match="not written by ditkit"):
        coef.save(_cf(), tmp_path / "notes.json")
    assert (tmp_path / "notes.json").read_text(encoding="utf-8") == "my notes"
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(CoefficientError, match="not a regular file"):
        coef.save(_cf(), tmp_path / "folder.json")
    assert sorted(os.listdir(tmp_path)) == ["c.json", "folder.json", "notes.json"]


@pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW"), reason="POSIX")
def test_save_and_load_do_not_follow_a_symlink(tmp_path):
    outside = tmp_path / "outside.json"
    coef.save(_cf(), outside)
    before = outside.read_bytes()
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(outside, base / "c.json")
    with pytest.raises(CoefficientError, match="not a regular file"):
        coef.save(_cf(), base / "c.json")
    with pytest.raises(CoefficientError, match="symlink"):
        coef.load(base / "c.json")
    assert outside.read_bytes() == before


def test_pair_files_are_never_replaced(tmp_path):
    obj = {"format": cal.PAIRS_FORMAT, "version": cal.PAIRS_VERSION, "family": "h3", "fingerprint": {},
           "pairs": {"video": [[0.1, 0.2]]}}
    cal.write_pair_file(obj, tmp_path / "pairs_1.json")
    with pytest.raises(CoefficientError, match="already exists"):
        cal.write_pair_file(dict(obj, family="zimage"), tmp_path / "pairs_1.json")
    assert cal.load_pair_file(tmp_path / "pairs_1.json")["family"] == "h3"


def test_fit_files_lowers_the_degree_and_says_so():
    x = np.linspace(0.0, 1.0, 60)
    spike = np.where(x > 0.97, 1.0, 0.05)   # degree 4 and 3 fits dip below 0, the quadratic does not
    assert [np.polyval(np.polyfit(x, spike, d), np.linspace(0, 1, 10001)).min() < -1e-6 for d in (4, 3, 2)] \
        == [True, True, False]
    obj = {"family": "zimage", "fingerprint": {"model": None}, "prompt_ids": ["p"],
           "pairs": {"image": [[float(a), float(b)] for a, b in zip(x, spike)]}}
    cf = cal.fit_files([obj], degree=4)
    fit = cf.streams["image"].fit
    assert fit["degree_requested"] == 4 and fit["degree"] == 2 and "negative" in fit["degree_lowered_because"]
    assert len(cf.streams["image"].coefficients) == 3
    obj["pairs"]["image"] = [[float(a), float(b)] for a, b in zip(x, np.maximum(0.0, x - 0.8) * 10.0)]
    with pytest.raises(CoefficientError, match="every lower degree down to 1 is negative"):
        cal.fit_files([obj], degree=4)
