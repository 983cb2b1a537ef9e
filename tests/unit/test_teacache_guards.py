"""TeaCache coefficient guards, each pinned so that removing or loosening it fails a test.

Oracles: numpy's ``polyval`` for the rescale polynomial, and the documented limits written here as literals
(web/docs/DitKitTeaCache/en.md): a rel-L1 value is clamped into the file's fitted ``x_range`` on both sides;
``x_range`` is ``[lo, hi]`` with ``0 <= lo <= hi`` finite (a rel-L1 distance is never negative); a schedule
differs when any sigma differs by more than 1e-4; cfg, guidance and shifts differ when they differ by more than
1e-6; a calibrated file that records no model hash cannot be matched to the model and is warned about.
Nothing here reads the tolerances from the code under test.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from ditkit.cache import coefficients as coef
from ditkit.cache.coefficients import StreamCoefficients
from ditkit.cache.teacache import TeaCacheConfig, TeaCacheState, state_from_coefficients
from ditkit.errors import CoefficientError

SIGMA_TOL = 1e-4      # documented schedule tolerance
SCALAR_TOL = 1e-6     # documented cfg / guidance / shift tolerance
POLY = (2.0, 1.0, 0.3)  # increasing on x >= 0: polyval(0) = 0.3, polyval(0.05) = 0.355, polyval(0.1) = 0.42
SHA = "ab" * 32

GOOD = {
    "format": "ditkit.teacache.coefficients", "version": 1, "family": "h3",
    "streams": {"video": {"coefficients": list(POLY), "x_range": [0.05, 0.1], "fit": None},
                "audio": {"coefficients": [0.5, 0.1], "x_range": None, "fit": None}},
    "calibration": None,
    "fingerprint": {"family": "h3", "model": {"weights_sha256": SHA}, "sampler": "euler", "steps": 4,
                    "sigmas": [1.0, 0.75, 0.5, 0.25, 0.0], "shifts": {"model_sampling": 12.0}, "cfg": 3.0,
                    "guidance": 3.5},
    "provenance": {"source": "test", "kind": "calibrated"},
}
PARAMS = dict(threshold=0.3, audio_threshold=0.1, start_percent=0.0, end_percent=1.0, cache_device="model",
              strict=False)


def _load(tmp_path, obj, name="c.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return coef.load(p)


def _with(**fp):
    o = copy.deepcopy(GOOD)
    o["fingerprint"].update(fp)
    return o


def _fields(g):
    return sorted(m.field for m in g.mismatches)


# ------------------------------------------------------------------------------ x clamped into x_range

@pytest.mark.parametrize("x, at", [(0.0, 0.05), (0.01, 0.05), (0.0499, 0.05), (0.1001, 0.1), (0.5, 0.1), (7.0, 0.1)])
def test_rescale_clamps_into_x_range_on_both_sides(x, at):
    y, clamped = StreamCoefficients("video", POLY, (0.05, 0.1)).rescale(x)
    assert clamped
    assert y == pytest.approx(float(np.polyval(POLY, at)), rel=1e-12)
    assert abs(y - float(np.polyval(POLY, x))) > 1e-6  # the clamp changed the value (the test can tell)


@pytest.mark.parametrize("x", [0.05, 0.07, 0.1])
def test_rescale_inside_x_range_is_not_clamped(x):
    y, clamped = StreamCoefficients("video", POLY, (0.05, 0.1)).rescale(x)
    assert not clamped and y == pytest.approx(float(np.polyval(POLY, x)), rel=1e-12)


def test_runtime_accumulates_the_clamped_value_below_x_range():
    """TeaCacheState adds polyval(lo), not polyval(x), for an x below x_range, and counts the clamps."""
    sc = StreamCoefficients("image", POLY, (0.05, 0.1))
    state = TeaCacheState(TeaCacheConfig("zimage", {"image": sc}, {"image": 100.0}))
    n = 6
    sig = torch.linspace(1.0, 0.0, n + 1).tolist()
    state.begin(sig)
    cur = torch.ones(1, 4, 8)
    xs = [0.0, 0.01, 0.02, 0.01, 0.02, 0.01]  # all below lo = 0.05
    for i in range(n):
        if i > 0:
            cur = cur * (1.0 + xs[i])  # all-positive tensor: rel-L1 == xs[i]
        skip = state.decide(["c"], sig[i], {"image": [cur]}, shapes=[cur.shape[1:]])
        if not skip:
            state.store(["c"], [cur], [cur * 2])
    st = state.report().streams["image"]
    measured = n - 2  # the first and the last step are always computed, without a distance
    assert st["x_clamped"] == measured
    assert st["acc_distance_total"] == pytest.approx(measured * float(np.polyval(POLY, 0.05)), abs=1e-5)
    assert st["rel_l1_total"] == pytest.approx(sum(xs[1:n - 1]), abs=1e-5)


# ---------------------------------------------------------------------------- x_range validation

@pytest.mark.parametrize("xr", [[-0.1, 0.2], [-1e-9, 0.1], [-0.5, -0.1], [0.3, 0.1], [0.0, float("inf")],
                                [float("nan"), 0.1], [0.0],
                                [0.0, 0.1, 0.2], [0.0, "0.1"], [None, 0.1], [True, 0.1], "0,1", {"lo": 0}])
def test_bad_x_range_is_refused(xr):
    o = copy.deepcopy(GOOD)
    o["streams"]["video"]["x_range"] = xr
    with pytest.raises(CoefficientError, match=r"streams\.video\.x_range"):
        coef.parse(o, "'mem.json'")  # the validator itself (non-finite values cannot pass the strict JSON reader)


@pytest.mark.parametrize("xr", [[0.0, 0.0], [0.0, 0.2], [0.05, 0.05], None])
def test_good_x_range_is_accepted(tmp_path, xr):
    o = copy.deepcopy(GOOD)
    o["streams"]["video"]["x_range"] = xr
    cf = _load(tmp_path, o)
    assert cf.streams["video"].x_range == (None if xr is None else tuple(xr))


# ------------------------------------------------------------------------------ schedule tolerance

@pytest.mark.parametrize("i, delta", [(1, 2 * SIGMA_TOL), (2, -2 * SIGMA_TOL), (3, 1e-3), (1, 0.05)])
def test_schedule_differing_beyond_tolerance_warns(tmp_path, i, delta):
    cf = _load(tmp_path, GOOD)
    sig = list(GOOD["fingerprint"]["sigmas"])
    sig[i] = round(sig[i] + delta, 6)
    g = coef.check_run(cf, dict(GOOD["fingerprint"], sigmas=sig))
    assert _fields(g) == ["sigmas (schedule)"] and g.mismatches[0].severity == "warn"


@pytest.mark.parametrize("delta", [0.0, SIGMA_TOL / 2, -SIGMA_TOL / 2])
def test_schedule_within_tolerance_is_the_same(tmp_path, delta):
    cf = _load(tmp_path, GOOD)
    sig = list(GOOD["fingerprint"]["sigmas"])
    sig[2] = round(sig[2] + delta, 6)
    assert coef.check_run(cf, dict(GOOD["fingerprint"], sigmas=sig)).ok


def test_schedule_of_another_length_warns_when_steps_are_unknown(tmp_path):
    cf = _load(tmp_path, _with(steps=None))
    g = coef.check_run(cf, dict(GOOD["fingerprint"], steps=None, sigmas=[1.0, 0.5, 0.0]))
    assert _fields(g) == ["sigmas"]


# ------------------------------------------------------------------------------ model hash

@pytest.mark.parametrize("model", [None, {}, {"weights_sha256": None}, {"weights_sha256": ""},
                                   {"class": "MiniMaxH3"}])
def test_calibrated_file_without_model_hash_warns(tmp_path, model):
    cf = _load(tmp_path, _with(model=model))
    g = coef.check_model(cf, "h3", {"weights_sha256": SHA})
    assert _fields(g) == ["model.weights_sha256"] and g.mismatches[0].severity == "warn"
    _, fp_warnings, _ = state_from_coefficients(cf, "h3", {"weights_sha256": SHA}, PARAMS)
    assert len(fp_warnings) == 1 and "model.weights_sha256" in fp_warnings[0]
    with pytest.raises(CoefficientError, match="strict mode"):
        state_from_coefficients(cf, "h3", {"weights_sha256": SHA}, dict(PARAMS, strict=True))


def test_file_with_the_models_hash_has_no_model_warning(tmp_path):
    cf = _load(tmp_path, GOOD)
    assert coef.check_model(cf, "h3", {"weights_sha256": SHA}).ok
    assert _fields(coef.check_model(cf, "h3", {"weights_sha256": "cd" * 32})) == ["model.weights_sha256"]


# ------------------------------------------------------------------------------ cfg / guidance / shifts

@pytest.mark.parametrize("key, value", [("guidance", 4.0), ("guidance", 3.5 + 50 * SCALAR_TOL), ("guidance", 0.0),
                                        ("cfg", 1.0), ("cfg", 3.0 - 50 * SCALAR_TOL), ("sampler", "heun"),
                                        ("steps", 8)])
def test_run_setting_mismatch_warns(tmp_path, key, value):
    cf = _load(tmp_path, GOOD)
    run = dict(GOOD["fingerprint"], **{key: value})
    if key == "steps":
        run["sigmas"] = [1.0 - i / 8 for i in range(9)]
    g = coef.check_run(cf, run)
    assert _fields(g) == [key] and g.mismatches[0].severity == "warn"
    assert repr(value) in g.warnings()[0]


@pytest.mark.parametrize("value", [12.0 + 50 * SCALAR_TOL, 5.0])
def test_shift_mismatch_warns(tmp_path, value):
    cf = _load(tmp_path, GOOD)
    g = coef.check_run(cf, dict(GOOD["fingerprint"], shifts={"model_sampling": value}))
    assert _fields(g) == ["shifts.model_sampling"]


@pytest.mark.parametrize("key, value", [("guidance", 3.5), ("guidance", 3.5 + SCALAR_TOL / 2), ("guidance", None),
                                        ("cfg", 3.0 + SCALAR_TOL / 2), ("cfg", None)])
def test_run_setting_within_tolerance_or_unknown_is_the_same(tmp_path, key, value):
    cf = _load(tmp_path, GOOD)
    assert coef.check_run(cf, dict(GOOD["fingerprint"], **{key: value})).ok


def test_guidance_recorded_only_in_the_run_is_not_a_mismatch(tmp_path):
    cf = _load(tmp_path, _with(guidance=None))
    assert coef.check_run(cf, dict(GOOD["fingerprint"], guidance=4.0)).ok


# ------------------------------------------------------------------------------ runtime guards

def _drive(state, xs, sig):
    """Feed block-0 inputs whose consecutive rel-L1 values are exactly ``xs[i]`` (all-positive tensors)."""
    state.begin(sig)
    cur = torch.ones(1, 4, 8)
    out = []
    for i in range(len(sig) - 1):
        if i > 0:
            cur = cur * (1.0 + xs[i])
        skip = state.decide(["c"], sig[i], {"image": [cur]}, shapes=[cur.shape[1:]])
        if not skip:
            state.store(["c"], [cur], [cur * 2])
        out.append(skip)
    return out


def test_negative_polynomial_values_add_nothing_to_the_accumulator():
    """poly(x) = x - 0.05 is negative for x < 0.05; a predicted change is never negative, so those calls add 0
    (reference loop written here). Without that floor the accumulator would drift below zero and skip more."""
    poly = (1.0, -0.05)
    thr = 0.02
    xs = [0.0, 0.06, 0.0, 0.0, 0.0, 0.06, 0.07, 0.0, 0.0, 0.0, 0.06, 0.08, 0.06, 0.0]
    n = len(xs)
    sig = torch.linspace(1.0, 0.0, n + 1).tolist()
    state = TeaCacheState(TeaCacheConfig("zimage", {"image": StreamCoefficients("image", poly)}, {"image": thr}))
    got = _drive(state, xs, sig)
    want, acc = [], 0.0
    for i in range(n):
        if i == 0 or i == n - 1:
            want.append(False)
            acc = 0.0
            continue
        acc += max(xs[i] - 0.05, 0.0)
        if acc < thr:
            want.append(True)
        else:
            want.append(False)
            acc = 0.0
    assert got == want
    assert state.report().streams["image"]["acc_distance_total"] == pytest.approx(
        sum(max(x - 0.05, 0.0) for x in xs[1:n - 1]), abs=1e-6)


def test_threshold_zero_never_skips_with_a_polynomial_that_is_zero():
    """threshold 0 means never skip, also when the predicted change is exactly 0 (acc 0 is not < 0, and the
    node promises 0 = off whatever the coefficients)."""
    state = TeaCacheState(TeaCacheConfig("zimage", {"image": StreamCoefficients("image", (0.0,))}, {"image": 0.0}))
    n = 8
    assert not any(_drive(state, [0.0] + [0.01] * (n - 1), torch.linspace(1.0, 0.0, n + 1).tolist()))


RUNTIME_SCHEDULE_RTOL = 1e-6  # the state keeps its cache only while the sampler's sigmas equal its own


@pytest.mark.parametrize("delta, resets", [(0.0, False), (RUNTIME_SCHEDULE_RTOL / 10, False),
                                           (RUNTIME_SCHEDULE_RTOL * 10, True), (1e-3, True)])
def test_runtime_schedule_change_resets_the_cache(delta, resets):
    sc = StreamCoefficients("image", POLY)
    state = TeaCacheState(TeaCacheConfig("zimage", {"image": sc}, {"image": 100.0}))
    sig = [1.0, 0.75, 0.5, 0.25, 0.0]
    state.begin(sig)
    cur = torch.ones(1, 4, 8)
    state.decide(["c"], sig[0], {"image": [cur]}, shapes=[cur.shape[1:]])
    state.store(["c"], [cur], [cur * 2])
    other = list(sig)
    other[2] += delta
    assert state.ensure_schedule(other) is resets
    assert (state.conds == {}) is resets and state.resets == int(resets)


def test_every_stream_needs_a_threshold():
    sc = {"video": StreamCoefficients("video", POLY), "audio": StreamCoefficients("audio", POLY)}
    with pytest.raises(ValueError, match="audio"):
        TeaCacheConfig("h3", sc, {"video": 0.3})
