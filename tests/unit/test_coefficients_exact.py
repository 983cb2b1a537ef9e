"""cache/coefficients.py, exactly: every refusal's whole text, both sides of each bound, the rescale and the
polynomial check at their edges, the guard's mismatches field by field, the weights fingerprint's hash.

Oracles written here: hand-written documents and the text each refusal must say, Horner's rule by hand, a
quadratic whose minimum lies between the dense grid's points, sha256 over the documented byte stream."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os

import numpy as np
import pytest
import torch

from ditkit.cache import coefficients as coef
from ditkit.errors import CoefficientError

W = "'f.json'"
GOOD = {
    "format": "ditkit.teacache.coefficients", "version": 1, "family": "h3",
    "streams": {"video": {"coefficients": [1.0, 0.5], "x_range": [0.0, 1.0], "fit": None}},
    "calibration": None,
    "fingerprint": {"family": "h3", "model": None, "sampler": "euler", "steps": 4, "sigmas": None, "shifts": None,
                    "cfg": 1.0, "guidance": None},
    "provenance": {"source": "test", "kind": "calibrated"},
}


def _doc(**changes):
    o = copy.deepcopy(GOOD)
    for path, v in changes.items():
        cur = o
        keys = path.split("__")
        for k in keys[:-1]:
            cur = cur[k]
        if v is KeyError:
            del cur[keys[-1]]
        else:
            cur[keys[-1]] = v
    return o


def _refused(obj, key, msg):
    with pytest.raises(CoefficientError) as e:
        coef.parse(obj, W)
    assert str(e.value) == f"TeaCache coefficient file {W}: {key}: {msg}"


def test_constants():
    assert (coef.FORMAT, coef.VERSION, coef.MAX_FILE_BYTES, coef.MAX_DEGREE) == \
        ("ditkit.teacache.coefficients", 1, 4 * 1024 * 1024, 10)
    assert coef.FAMILY_STREAMS == {"h3": ("video", "audio"), "ltx2": ("video", "audio"), "zimage": ("image",),
                                   "flux2": ("image",)}
    assert coef.SIGMA_TOL == 1e-4 and coef.NEGATIVE_TOL == 1e-6
    assert coef.DEFAULTS_DIR == __import__("pathlib").Path(coef.__file__).resolve().parent / "defaults"


def test_shown():
    assert [coef._shown(v) for v in (None, True, False, 3, 2.5, -0.0)] == ["None", "True", "False", "3", "2.5", "-0.0"]
    assert [coef._shown(v) for v in (math.inf, -math.inf, math.nan)] == ["inf", "-inf", "nan"]
    assert [coef._shown(v) for v in ("h3", [1], {"a": 1}, (1,), b"x")] == \
        ["a string", "a list", "an object", "a tuple", "a bytes"]
    assert coef._shown("h3", ("h3", "zimage")) == "'h3'" and coef._shown("sd", ("h3",)) == "a string"
    assert coef._shown("h3", {"h3": 1}) == "'h3'"


def test_finite():
    assert [coef._finite(v) for v in (0, -1, 2.5, 1e308)] == [True] * 4
    assert [coef._finite(v) for v in (True, False, math.inf, -math.inf, math.nan, "1", None, [1])] == [False] * 8


# ------------------------------------------------------------------------------------------------ parse refusals

def test_root_format_version_family_refusals():
    _refused([1, 2], "<root>", "expected a JSON object, got list")
    _refused("x", "<root>", "expected a JSON object, got str")
    _refused(_doc(format="other"), "format",
             "is a string, expected 'ditkit.teacache.coefficients' (not a ditkit TeaCache coefficient file)")
    _refused(_doc(format=KeyError), "format",
             "is None, expected 'ditkit.teacache.coefficients' (not a ditkit TeaCache coefficient file)")
    tail = "; this ditkit reads version 1 only (re-run DitKitTeaCacheCalibrate or `python -m ditkit.cache.calibrate` " \
           "to rewrite it)"
    _refused(_doc(version=2), "version", "is 2" + tail)
    _refused(_doc(version="1"), "version", "is a string" + tail)
    _refused(_doc(version=KeyError), "version", "is None" + tail)
    _refused(_doc(family="sd15"), "family", "is a string, expected one of ['flux2', 'h3', 'ltx2', 'zimage']")
    _refused(_doc(family=7), "family", "is 7, expected one of ['flux2', 'h3', 'ltx2', 'zimage']")
    _refused(_doc(family=["h3"]), "family", "is a list, expected one of ['flux2', 'h3', 'ltx2', 'zimage']")


def test_stream_refusals():
    m = "must be a non-empty object mapping stream name -> coefficients"
    _refused(_doc(streams={}), "streams", m)
    _refused(_doc(streams=[1]), "streams", m)
    _refused(_doc(streams=KeyError), "streams", m)
    _refused(_doc(streams__image={"coefficients": [1.0]}), "streams.image",
             "is not a stream of family 'h3' (expected ['video', 'audio'])")
    _refused(_doc(streams__secret={"coefficients": [1.0]}), "streams",
             "is not a stream of family 'h3' (expected ['video', 'audio'])")
    _refused(_doc(streams__video=[1.0]), "streams.video", "must be an object")
    base = "must be a list of 1..11 numbers, got "
    _refused(_doc(streams__video__coefficients=[]), "streams.video.coefficients", base + "a list of 0")
    _refused(_doc(streams__video__coefficients=[0.5] * 12), "streams.video.coefficients", base + "a list of 12")
    _refused(_doc(streams__video__coefficients="1, 2"), "streams.video.coefficients", base + "a string")
    _refused(_doc(streams__video__coefficients=3.0), "streams.video.coefficients", base + "3.0")
    _refused(_doc(streams__video__coefficients=KeyError), "streams.video.coefficients", base + "None")
    tail = "; coefficients must be finite numbers"
    _refused(_doc(streams__video__coefficients=[1.0, "x"]), "streams.video.coefficients[1]", "is a string" + tail)
    _refused(_doc(streams__video__coefficients=[True, 1.0]), "streams.video.coefficients[0]", "is True" + tail)
    _refused(_doc(streams__video__coefficients=[1.0, 2.0, math.inf]), "streams.video.coefficients[2]", "is inf" + tail)
    _refused(_doc(streams__video__coefficients=[1.0, None]), "streams.video.coefficients[1]", "is None" + tail)
    # 1 and 11 coefficients are accepted
    assert coef.parse(_doc(streams__video__coefficients=[0.5]), W).streams["video"].coefficients == (0.5,)
    eleven = [0.0] * 10 + [0.5]
    assert coef.parse(_doc(streams__video__coefficients=eleven), W).streams["video"].coefficients == tuple(eleven)


def test_x_range_refusals_and_edges():
    m = "must be null or [lo, hi] with 0 <= lo <= hi finite, got "
    key = "streams.video.x_range"
    _refused(_doc(streams__video__x_range=[0.3, 0.1]), key, m + "[0.3, 0.1]")
    _refused(_doc(streams__video__x_range=[-0.1, 0.2]), key, m + "[-0.1, 0.2]")
    _refused(_doc(streams__video__x_range=[0.1]), key, m + "[0.1]")
    _refused(_doc(streams__video__x_range=[0.1, 0.2, 0.3]), key, m + "[0.1, 0.2, 0.3]")
    _refused(_doc(streams__video__x_range=[0.1, "a", 0.3, 0.4]), key, m + "[0.1, a string, 0.3, 0.4]")
    _refused(_doc(streams__video__x_range=[0.1, 0.2, 0.3, 0.4, 0.5]), key, m + "a list")
    _refused(_doc(streams__video__x_range=[0.1, math.inf]), key, m + "[0.1, inf]")
    _refused(_doc(streams__video__x_range=[True, 1.0]), key, m + "[True, 1.0]")
    _refused(_doc(streams__video__x_range="0..1"), key, m + "a string")
    _refused(_doc(streams__video__x_range={"lo": 0}), key, m + "an object")
    # lo == hi and lo == 0 are accepted; ints are taken as floats
    s = coef.parse(_doc(streams__video__x_range=[0.25, 0.25]), W).streams["video"]
    assert s.x_range == (0.25, 0.25)
    s = coef.parse(_doc(streams__video__x_range=[0, 2]), W).streams["video"]
    assert s.x_range == (0.0, 2.0) and all(type(v) is float for v in s.x_range)
    assert coef.parse(_doc(streams__video__x_range=None), W).streams["video"].x_range is None
    assert coef.parse(_doc(streams__video__x_range=KeyError), W).streams["video"].x_range is None


def test_negative_polynomial_refusal_texts():
    tail = ("; a negative rescaled change lowers the accumulated distance and skips steps that changed (re-fit, or "
            "set an x_range where it is >= 0)")
    _refused(_doc(streams__video__coefficients=[-0.01], streams__video__x_range=[0.1, 0.2]), "streams.video",
             "the polynomial is -0.01 at x = 0.1, negative inside its x_range [0.1, 0.2]" + tail)
    _refused(_doc(streams__video__coefficients=[-0.01], streams__video__x_range=None), "streams.video",
             "the polynomial is -0.01 at x = 0, negative inside x >= 0 (x_range is null: no clamping) [0, inf]" + tail)
    _refused(_doc(streams__video__coefficients=[2.0, -1.0], streams__video__x_range=[0.25, 1.0]), "streams.video",
             "the polynomial is -0.5 at x = 0.25, negative inside its x_range [0.25, 1]" + tail)


def test_fit_and_required_stream_refusals():
    _refused(_doc(streams__video__fit=[1]), "streams.video.fit", "must be null or an object")
    _refused(_doc(streams__video__fit="r2"), "streams.video.fit", "must be null or an object")
    assert coef.parse(_doc(streams__video__fit={"r2": 1.0}), W).streams["video"].fit == {"r2": 1.0}
    _refused(_doc(streams={"audio": {"coefficients": [1.0]}}), "streams",
             "family 'h3' needs at least the 'video' stream")
    doc = _doc(family="zimage", fingerprint__family="zimage", streams={"image": {"coefficients": [1.0]}})
    cf = coef.parse(doc, W)
    assert list(cf.streams) == ["image"] and cf.streams["image"].name == "image"
    s = coef.parse(_doc(streams__audio={"coefficients": [2, 1]}), W).streams["audio"]
    assert s.coefficients == (2.0, 1.0) and all(type(c) is float for c in s.coefficients)
    assert s.x_range is None and s.fit is None


def test_fingerprint_refusals():
    _refused(_doc(fingerprint=None), "fingerprint", "must be an object")
    _refused(_doc(fingerprint=[1]), "fingerprint", "must be an object")
    _refused(_doc(fingerprint__family="zimage"), "fingerprint.family", "is 'zimage' but the file's family is 'h3'")
    _refused(_doc(fingerprint__family="mine"), "fingerprint.family", "is a string but the file's family is 'h3'")
    _refused(_doc(fingerprint__family=KeyError), "fingerprint.family", "is None but the file's family is 'h3'")
    _refused(_doc(fingerprint__sigmas=[1.0, "x"]), "fingerprint.sigmas", "must be null or a list of finite numbers")
    _refused(_doc(fingerprint__sigmas=[1.0, math.nan]), "fingerprint.sigmas", "must be null or a list of finite numbers")
    _refused(_doc(fingerprint__sigmas="1,0"), "fingerprint.sigmas", "must be null or a list of finite numbers")
    assert coef.parse(_doc(fingerprint__sigmas=[1, 0.5, 0]), W).fingerprint["sigmas"] == [1, 0.5, 0]
    assert coef.parse(_doc(fingerprint__sigmas=[]), W).fingerprint["sigmas"] == []
    _refused(_doc(fingerprint__model=[1]), "fingerprint.model",
             "must be null or an object (weights_sha256, class...), got a list")
    _refused(_doc(fingerprint__model="m"), "fingerprint.model",
             "must be null or an object (weights_sha256, class...), got a string")
    _refused(_doc(fingerprint__model={"weights_sha256": 5}), "fingerprint.model.weights_sha256",
             "must be null or a hex string, got 5")
    _refused(_doc(fingerprint__model={"weights_sha256": ["ab"]}), "fingerprint.model.weights_sha256",
             "must be null or a hex string, got a list")
    assert coef.parse(_doc(fingerprint__model={"weights_sha256": None}), W).fingerprint["model"] == \
        {"weights_sha256": None}
    assert coef.parse(_doc(fingerprint__model={"class": "X"}), W).fingerprint["model"] == {"class": "X"}
    _refused(_doc(fingerprint__shifts=[1]), "fingerprint.shifts",
             "must be null or an object of name -> number, got a list")
    _refused(_doc(fingerprint__shifts=3.0), "fingerprint.shifts",
             "must be null or an object of name -> number, got 3.0")
    _refused(_doc(fingerprint__shifts={"a": 1.0, "b": "x"}), "fingerprint.shifts",
             "value of one entry is a string; shifts must be finite numbers or null")
    _refused(_doc(fingerprint__shifts={"a": math.inf}), "fingerprint.shifts",
             "value of one entry is inf; shifts must be finite numbers or null")
    assert coef.parse(_doc(fingerprint__shifts={"a": None, "b": 2}), W).fingerprint["shifts"] == {"a": None, "b": 2}
    for key in ("steps", "cfg", "guidance"):
        _refused(_doc(**{f"fingerprint__{key}": "4"}), f"fingerprint.{key}",
                 "must be null or a finite number, got a string")
        _refused(_doc(**{f"fingerprint__{key}": True}), f"fingerprint.{key}",
                 "must be null or a finite number, got True")
        _refused(_doc(**{f"fingerprint__{key}": -math.inf}), f"fingerprint.{key}",
                 "must be null or a finite number, got -inf")
        assert coef.parse(_doc(**{f"fingerprint__{key}": 0}), W).fingerprint[key] == 0


def test_provenance_and_calibration_refusals():
    m = "every coefficient file must state where its coefficients come from"
    _refused(_doc(provenance=None), "provenance.source", m)
    _refused(_doc(provenance=["test"]), "provenance.source", m)
    _refused(_doc(provenance__source=5), "provenance.source", m)
    _refused(_doc(provenance__source=""), "provenance.source", m)
    _refused(_doc(provenance__source=KeyError), "provenance.source", m)
    _refused(_doc(provenance__kind=KeyError), "provenance.kind",
             "is missing; expected 'calibrated' (fitted for this model) or 'borrowed'")
    _refused(_doc(provenance__kind=None), "provenance.kind", "is None, expected 'calibrated' or 'borrowed'")
    _refused(_doc(provenance__kind="guessed"), "provenance.kind", "is a string, expected 'calibrated' or 'borrowed'")
    assert coef.parse(_doc(provenance__kind="borrowed"), W).kind == "borrowed"
    assert coef.parse(_doc(provenance__source="x"), W).provenance == {"source": "x", "kind": "calibrated"}
    _refused(_doc(calibration=[1]), "calibration", "must be null or an object")
    _refused(_doc(calibration="n"), "calibration", "must be null or an object")
    assert coef.parse(_doc(calibration={"n_prompts": 3}), W).calibration == {"n_prompts": 3}
    assert coef.parse(_doc(calibration=KeyError), W).calibration is None


def test_parse_builds_the_file():
    cf = coef.parse(GOOD, W)
    assert (cf.family, cf.fingerprint, cf.provenance, cf.calibration, cf.path) == \
        ("h3", GOOD["fingerprint"], GOOD["provenance"], None, None)
    assert cf.streams == {"video": coef.StreamCoefficients("video", (1.0, 0.5), (0.0, 1.0), None)}


# ------------------------------------------------------------------------------------------------ bytes, files

def test_parse_bytes_refusals(tmp_path):
    data = json.dumps(GOOD).encode()
    pad = data + b" " * (coef.MAX_FILE_BYTES - len(data))
    assert coef.parse_bytes(pad, W).family == "h3"
    with pytest.raises(CoefficientError) as e:
        coef.parse_bytes(pad + b" ", W)
    assert str(e.value) == f"TeaCache coefficient file {W} is larger than 4194304 bytes; not a coefficient file"
    with pytest.raises(CoefficientError) as e:
        coef.parse_bytes(b"\xff{}", W)
    assert str(e.value) == (f"TeaCache coefficient file {W} is not UTF-8 text ('utf-8' codec can't decode byte 0xff "
                            "in position 0: invalid start byte)")
    with pytest.raises(CoefficientError) as e:
        coef.parse_bytes(b'{"a": 1, "a": 2}', W)
    assert str(e.value) == f"TeaCache coefficient file {W}: duplicate JSON key 'a' in the coefficient JSON"
    with pytest.raises(CoefficientError) as e:
        coef.parse_bytes(b"[1, 2]", W)
    assert str(e.value) == f"TeaCache coefficient file {W}: <root>: expected a JSON object, got list"


def test_load_sets_the_path_and_names_the_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(GOOD), encoding="utf-8")
    cf = coef.load(p)
    assert cf.path == str(p) and type(cf.path) is str
    p.write_text(json.dumps(_doc(version=3)), encoding="utf-8")
    with pytest.raises(CoefficientError) as e:
        coef.load(p)
    assert str(e.value).startswith(f"TeaCache coefficient file '{p}': version: is 3;")
    with pytest.raises(CoefficientError) as e:
        coef.load_inside(tmp_path, ["c.json"], display="teacache/c.json")
    assert str(e.value).startswith("TeaCache coefficient file 'teacache/c.json': version: is 3;")
    with pytest.raises(CoefficientError) as e:
        coef.load_inside(tmp_path, ["c.json"])
    assert str(e.value).startswith(f"TeaCache coefficient file '{os.path.realpath(tmp_path)}/c.json': version")
    p.write_bytes(b" " * (coef.MAX_FILE_BYTES + 1))
    for f in (lambda: coef.load(p), lambda: coef.load_inside(tmp_path, ["c.json"])):
        with pytest.raises(CoefficientError) as e:
            f()
        assert "TeaCache coefficient file" in str(e.value) and "is larger than" not in str(e.value)


def test_save_writes_the_documented_bytes(tmp_path):
    cf = coef.parse(_doc(calibration={"n": 1}), W)
    p = tmp_path / "sub" / "c.json"
    assert coef.save(cf, p) == str(p) and cf.path == str(p)
    want = json.dumps({"format": "ditkit.teacache.coefficients", "version": 1, "family": "h3",
                       "streams": {"video": {"coefficients": [1.0, 0.5], "x_range": [0.0, 1.0], "fit": None}},
                       "calibration": {"n": 1}, "fingerprint": GOOD["fingerprint"],
                       "provenance": GOOD["provenance"]}, indent=1) + "\n"
    assert p.read_bytes() == want.encode("utf-8")
    # replace_if decides about an existing file
    seen = []
    coef.save(cf, p, replace_if=lambda b: seen.append(b) or True)
    assert seen == [want.encode("utf-8")]
    with pytest.raises(CoefficientError):
        coef.save(cf, p, replace_if=lambda b: False)
    bad = coef.CoefficientFile("h3", {"video": coef.StreamCoefficients("video", (math.nan,))}, {"family": "h3"},
                               {"source": "t", "kind": "calibrated"})
    with pytest.raises(ValueError):
        coef.save(bad, tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()


def test_save_under_a_regular_file_is_a_coefficient_error(tmp_path):
    cf = coef.parse(_doc(calibration={"n": 1}), W)
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(CoefficientError) as e:
        coef.save(cf, tmp_path / "afile" / "sub" / "c.json")
    assert str(e.value) == (f"TeaCache folder '{tmp_path / 'afile' / 'sub'}' cannot be created (Not a directory: "
                            f"'{tmp_path / 'afile' / 'sub'}')")
    assert (tmp_path / "afile").read_bytes() == b"x"


def test_is_coefficient_file_names_nothing_and_returns_bools():
    assert coef.is_coefficient_file(json.dumps(GOOD).encode()) is True
    assert coef.is_coefficient_file(b"{}") is False


def test_shipped_defaults(monkeypatch, tmp_path):
    got = coef.shipped_defaults()
    assert list(got) == sorted(got) and all(p.suffix == ".json" and p.parent == coef.DEFAULTS_DIR
                                            for p in got.values())
    assert all(got[k].stem == k for k in got)
    (tmp_path / "b.json").write_text("{}")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "c.txt").write_text("{}")
    monkeypatch.setattr(coef, "DEFAULTS_DIR", tmp_path)
    assert coef.shipped_defaults() == {"a": tmp_path / "a.json", "b": tmp_path / "b.json"}
    assert list(coef.shipped_defaults()) == ["a", "b"]
    monkeypatch.setattr(coef, "DEFAULTS_DIR", tmp_path / "missing")
    assert coef.shipped_defaults() == {}


# ------------------------------------------------------------------------------------------------ rescale, report

def test_rescale_horner_and_clamp_edges():
    s = coef.StreamCoefficients("video", (2.0, -3.0, 0.5), (0.25, 1.5))
    p = lambda x: 2.0 * x * x - 3.0 * x + 0.5
    assert s.rescale(0.5) == (p(0.5), False)
    assert s.rescale(0.25) == (p(0.25), False) and s.rescale(1.5) == (p(1.5), False)
    assert s.rescale(0.25 - 1e-12) == (p(0.25), True) and s.rescale(1.5 + 1e-12) == (p(1.5), True)
    assert s.rescale(-4.0) == (p(0.25), True) and s.rescale(9.0) == (p(1.5), True)
    free = coef.StreamCoefficients("video", (2.0, -3.0, 0.5))
    assert free.rescale(9.0) == (p(9.0), False) and free.rescale(-1.0) == (p(-1.0), False)
    assert coef.StreamCoefficients("v", (7.0,)).rescale(3.0) == (7.0, False)
    assert coef.StreamCoefficients("v", ()).rescale(3.0) == (0.0, False)


def test_file_report_dict_kind_and_describe():
    cf = coef.parse(_doc(calibration={"n": 2}, provenance={"source": "lab", "kind": "borrowed"}), W)
    d = cf.as_dict()
    assert list(d) == ["format", "version", "family", "streams", "calibration", "fingerprint", "provenance"]
    assert d["format"] == "ditkit.teacache.coefficients" and d["version"] == 1
    assert d["streams"] == {"video": {"coefficients": [1.0, 0.5], "x_range": [0.0, 1.0], "fit": None}}
    assert cf.kind == "borrowed"
    assert cf.describe() == "<memory> (borrowed, MiniMax H3, source: lab)"
    cf.path = "/a/b/h3.json"
    assert cf.describe() == "h3.json (borrowed, MiniMax H3, source: lab)"
    cf.family = "other"
    del cf.provenance["source"]
    assert cf.describe() == "h3.json (borrowed, other, source: ?)"
    assert coef.FAMILY_NAMES == {"h3": "MiniMax H3", "ltx2": "LTX-2 (audio-video)", "zimage": "Z-Image",
                                 "flux2": "FLUX.2"}
    cf.provenance["kind"] = 3
    assert cf.kind == "3"


# ------------------------------------------------------------------------------------------------ polynomial_negative

def test_polynomial_negative_edges():
    assert coef.polynomial_negative([], (0.0, 1.0)) is None
    assert coef.polynomial_negative([0.0, 0.0], None) is None
    # leading zeros are trimmed: [0, -1, 0.5] is 0.5 - x, not the leading-term branch of a quadratic
    assert coef.polynomial_negative([0.0, -1.0, 0.5], (0.0, 0.5)) is None
    assert coef.polynomial_negative([0.0, -1.0, 0.5], None) == (1.0, -0.5)
    # the leading term wins: the first point 1, 2, 4, ... where p < -tol
    assert coef.polynomial_negative([-1.0, 0.0, 0.5], None) == (1.0, -0.5)
    assert coef.polynomial_negative([-1.0, 0.0, 3.0], None) == (2.0, -1.0)
    assert coef.polynomial_negative([-1.0, 0.0, 20.0], None) == (8.0, -44.0)
    # a trailing zero coefficient is not trimmed: x^2 - x has its minimum -0.25 at 0.5
    assert coef.polynomial_negative([1.0, -1.0, 0.0], (0.0, 1.0)) == (0.5, -0.25)
    # a constant: its value at lo
    assert coef.polynomial_negative([-0.5], (0.2, 0.4)) == (0.2, -0.5)
    assert coef.polynomial_negative([0.5], None) is None


def test_polynomial_negative_tolerance_both_sides():
    tol = coef.NEGATIVE_TOL
    assert coef.polynomial_negative([-tol], (0.0, 1.0)) is None
    assert coef.polynomial_negative([-tol * 1.001], (0.0, 1.0)) == (0.0, -tol * 1.001)
    assert coef.polynomial_negative([-0.5], (0.0, 1.0), tol=0.5) is None
    assert coef.polynomial_negative([-0.5], (0.0, 1.0), tol=0.4999) == (0.0, -0.5)
    # the leading-term branch keeps doubling while p >= -tol
    c = [-1.0, 0.0, 3.5]                  # p(2) = -0.5 = -tol exactly: not yet negative enough, p(4) is
    assert coef.polynomial_negative(c, None, tol=0.5) == (4.0, -12.5)
    assert coef.polynomial_negative(c, None, tol=0.4999) == (2.0, -0.5)


def test_polynomial_negative_finds_a_minimum_between_grid_points():
    """The dense grid (257 points on [0, 1]) misses a narrow dip; the derivative's root finds it."""
    x0 = 0.5 + 1 / 512
    c = [10.0, -20.0 * x0, 10.0 * x0 * x0 - 2e-6]       # 10 (x - x0)^2 - 2e-6
    grid = np.linspace(0.0, 1.0, 257)
    assert np.polyval(c, grid).min() > 1e-6               # the premise: no grid point is negative
    got = coef.polynomial_negative(c, (0.0, 1.0))
    assert got is not None and got[0] == pytest.approx(x0, abs=1e-12) and got[1] == pytest.approx(-2e-6, rel=1e-6)
    # the same dip outside the range is not looked at; a range whose top is the dip's own x finds it
    assert coef.polynomial_negative(c, (0.0, 0.5)) is None
    assert coef.polynomial_negative(c, (0.6, 1.0)) is None
    got = coef.polynomial_negative(c, (x0, 0.75))
    assert got[0] == pytest.approx(x0, abs=1e-12)
    got = coef.polynomial_negative(c, (0.25, x0))
    assert got[0] == pytest.approx(x0, abs=1e-12)


def test_polynomial_negative_open_range_top_covers_the_roots():
    # x_range null, the minimum (a narrow dip) at x = 3 + 1/1024: only the root finder sees it
    x0 = 3.0 + 1 / 1024
    c = [100.0, -200.0 * x0, 100.0 * x0 * x0 - 2e-6]
    assert coef.polynomial_negative(c, None)[0] == pytest.approx(x0, abs=1e-12)
    # a positive polynomial with no dip: nothing
    assert coef.polynomial_negative([1.0, -2 * x0, x0 * x0 + 1e-3], None) is None


def test_polynomial_negative_complex_derivative_roots_are_not_candidates():
    # p = x^3/3 + x: p' = x^2 + 1 has roots +-i; on [-1e-3, ...] not allowed (lo >= 0 in files), use [0, 1]
    assert coef.polynomial_negative([1 / 3, 0.0, 1.0, 0.0], (0.0, 1.0)) is None


# ------------------------------------------------------------------------------------------------ fingerprint

def _fp_oracle(items, sample=64):
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\n".encode())
        if t.device.type != "meta":
            h.update(np.ascontiguousarray(t.detach().reshape(-1)[:sample].float().numpy()).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_weights_fingerprint_hash_is_the_documented_stream(dtype):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(20, 10, generator=g).to(dtype)
    items = [("w", big.t()), ("b", torch.arange(5, dtype=dtype)), ("a", torch.randn(3, generator=g).to(dtype))]
    fp = coef.weights_fingerprint(items)
    assert fp == {"weights_sha256": _fp_oracle(items), "n_tensors": 3, "n_params": 208, "unread_tensors": 0}
    assert coef.weights_fingerprint(items, sample_elems=3)["weights_sha256"] == _fp_oracle(items, 3)
    assert coef.weights_fingerprint(items, sample_elems=3) != fp


def test_weights_fingerprint_unreadable_tensors():
    meta = torch.empty(4, 4, device="meta")

    class Odd:
        shape = (2,)
        dtype = "odd"

        def numel(self):
            raise RuntimeError("no")

    items = [("m", meta), ("x", torch.ones(2)), ("o", Odd())]
    fp = coef.weights_fingerprint(items)
    h = hashlib.sha256()
    h.update(b"m|(4, 4)|torch.float32\n")
    h.update(b"o|(2,)|odd\n")
    h.update(b"x|(2,)|torch.float32\n")
    h.update(np.ones(2, dtype=np.float32).tobytes())
    assert fp == {"weights_sha256": h.hexdigest(), "n_tensors": 3, "n_params": 18, "unread_tensors": 2}
    assert coef.weights_fingerprint([]) == {"weights_sha256": hashlib.sha256().hexdigest(), "n_tensors": 0,
                                           "n_params": 0, "unread_tensors": 0}


# ------------------------------------------------------------------------------------------------ guard

def _cf(fp=None, kind="calibrated", source="lab", family="h3"):
    return coef.CoefficientFile(family, {"video": coef.StreamCoefficients("video", (1.0,))},
                                fp if fp is not None else {"family": family}, {"source": source, "kind": kind})


def _fields(g):
    return [(m.field, m.expected, m.got, m.severity) for m in g.mismatches]


def test_mismatch_text_and_guard_result():
    m = coef.Mismatch("steps", 4, "8", "warn")
    assert m.text() == "steps: file has 4, this run has '8'"
    g = coef.GuardResult()
    assert g.ok is True and g.warnings() == [] and g.mismatches == []
    g.mismatches.append(m)
    assert g.ok is False and g.warnings() == ["steps: file has 4, this run has '8'"]
    assert coef.GuardResult().mismatches is not coef.GuardResult().mismatches


def test_check_model_every_branch():
    sha = "ab" * 32
    other = "cd" * 32
    cf = _cf({"family": "h3", "model": {"weights_sha256": sha}})
    assert _fields(coef.check_model(cf, "zimage", {"weights_sha256": sha})) == [("family", "h3", "zimage", "error")]
    assert coef.check_model(cf, "h3", {"weights_sha256": sha}).ok
    assert _fields(coef.check_model(cf, "h3", {"weights_sha256": other})) == \
        [("model.weights_sha256", sha[:16], other[:16], "warn")]
    assert coef.check_model(cf, "h3", None).ok and coef.check_model(cf, "h3", {}).ok      # nothing to compare
    # no stored identity: a warning naming what this run has
    for fp in ({"family": "h3"}, {"family": "h3", "model": None}, {"family": "h3", "model": {"weights_sha256": ""}}):
        assert _fields(coef.check_model(_cf(fp), "h3", {"weights_sha256": other})) == \
            [("model.weights_sha256", None, other[:16], "warn")]
    assert _fields(coef.check_model(_cf(), "h3", None)) == [("model.weights_sha256", None, "?", "warn")]
    # borrowed: one warning whatever the identities
    b = _cf({"family": "h3", "model": {"weights_sha256": sha}}, kind="borrowed", source="FLUX.1 TeaCache")
    assert _fields(coef.check_model(b, "h3", {"weights_sha256": sha})) == \
        [("model", "borrowed coefficients (FLUX.1 TeaCache)", "a model they were not fitted on", "warn")]
    # scheme: a file without "scheme" is compared with the run's previous-rule value when the run has a scheme
    old = _cf({"family": "h3", "model": {"weights_sha256": sha}})
    assert coef.check_model(old, "h3", {"scheme": 2, "weights_sha256": other, "weights_sha256_v1": sha}).ok
    assert _fields(coef.check_model(old, "h3", {"scheme": 2, "weights_sha256": sha, "weights_sha256_v1": other})) == \
        [("model.weights_sha256", sha[:16], other[:16], "warn")]
    assert coef.check_model(old, "h3", {"weights_sha256": sha, "weights_sha256_v1": other}).ok
    new = _cf({"family": "h3", "model": {"weights_sha256": sha, "scheme": 2}})
    assert coef.check_model(new, "h3", {"scheme": 2, "weights_sha256": sha, "weights_sha256_v1": other}).ok
    assert _fields(coef.check_model(new, "h3", {"scheme": 2, "weights_sha256": other, "weights_sha256_v1": sha})) == \
        [("model.weights_sha256", sha[:16], other[:16], "warn")]


def test_check_run_steps_and_sigmas():
    cf = _cf({"family": "h3", "steps": 4, "sigmas": [1.0, 0.5, 0.0]})
    assert coef.check_run(cf, {"steps": 4, "sigmas": [1.0, 0.5, 0.0]}).ok
    assert _fields(coef.check_run(cf, {"steps": 5})) == [("steps", 4, 5, "warn")]
    assert _fields(coef.check_run(cf, {})) == [("steps", 4, None, "warn")]
    # sigma tolerance 1e-4 on both sides (the largest difference counts)
    assert coef.check_run(cf, {"steps": 4, "sigmas": [1.0, 0.5, 1e-4]}).ok          # |0 - 1e-4| == 1e-4 exactly
    assert _fields(coef.check_run(cf, {"steps": 4, "sigmas": [1.0, 0.5, 1.5e-4]})) == \
        [("sigmas (schedule)", "[1.0, 0.5, 0.0]...", "[1.0, 0.5, 0.00015]... (max |dsigma| 0.00015)", "warn")]
    assert _fields(coef.check_run(cf, {"steps": 4, "sigmas": [0.5, 0.5, 0.0]}))[0][2] == \
        "[0.5, 0.5, 0.0]... (max |dsigma| 0.5)"
    assert _fields(coef.check_run(cf, {"steps": 4, "sigmas": [1.0, 0.5, 0.3]}))[0][2].endswith("(max |dsigma| 0.3)")
    # a length mismatch counts only when the steps agree (else the steps warning says it)
    assert _fields(coef.check_run(cf, {"steps": 4, "sigmas": [1.0, 0.0]})) == \
        [("sigmas", "3 values", "2 values", "warn")]
    assert _fields(coef.check_run(cf, {"steps": 8, "sigmas": [1.0, 0.0]})) == [("steps", 4, 8, "warn")]
    nosteps = _cf({"family": "h3", "sigmas": [1.0, 0.5, 0.0]})
    assert _fields(coef.check_run(nosteps, {"steps": 8, "sigmas": [1.0, 0.0]})) == \
        [("sigmas", "3 values", "2 values", "warn")]
    assert coef.check_run(nosteps, {"steps": 8}).ok and coef.check_run(nosteps, {"sigmas": None}).ok
    assert coef.check_run(_cf({"family": "h3", "sigmas": []}), {"sigmas": []}).ok
    long = _cf({"family": "h3", "sigmas": [1.0, 0.9, 0.8, 0.7, 0.0]})
    assert _fields(coef.check_run(long, {"sigmas": [1.0, 0.9, 0.8, 0.6, 0.0]}))[0][1:3] == \
        ("[1.0, 0.9, 0.8]...", "[1.0, 0.9, 0.8]... (max |dsigma| 0.1)")


def test_check_run_sampler_cfg_guidance_and_shifts():
    cf = _cf({"family": "h3", "sampler": "euler", "cfg": 3.0, "guidance": 2, "shifts": {"a": 1.0, "b": None, "c": 5.0}})
    assert coef.check_run(cf, {"sampler": "euler", "cfg": 3.0 + 2 ** -20, "guidance": 2.0}).ok
    at = _cf({"family": "h3", "cfg": 0.0, "guidance": 0, "shifts": {"a": 0.0}})   # |0 - 1e-6| == 1e-6 exactly
    assert coef.check_run(at, {"cfg": 1e-6, "guidance": -1e-6, "shifts": {"a": 1e-6}}).ok
    assert _fields(coef.check_run(at, {"cfg": 1.0001e-6, "guidance": -1.0001e-6, "shifts": {"a": 1.0001e-6}})) == \
        [("cfg", 0.0, 1.0001e-6, "warn"), ("guidance", 0, -1.0001e-6, "warn"), ("shifts.a", 0.0, 1.0001e-6, "warn")]
    assert coef.check_run(cf, {"sampler": None, "cfg": None, "guidance": None}).ok
    assert _fields(coef.check_run(cf, {"sampler": "heun", "cfg": 3.0 + 2e-6, "guidance": 2 - 2e-6})) == \
        [("sampler", "euler", "heun", "warn"), ("cfg", 3.0, 3.0 + 2e-6, "warn"), ("guidance", 2, 2 - 2e-6, "warn")]
    assert _fields(coef.check_run(cf, {"cfg": "3.0"})) == [("cfg", 3.0, "3.0", "warn")]
    # shifts: only names both have, None on either side skipped, 1e-6 tolerance, sorted by name
    assert coef.check_run(cf, {"shifts": {"a": 1.0 + 2 ** -20, "b": 9.0, "c": None, "d": 3.0}}).ok
    assert _fields(coef.check_run(cf, {"shifts": {"c": 4.0, "a": 1.0 - 2e-6}})) == \
        [("shifts.a", 1.0, 1.0 - 2e-6, "warn"), ("shifts.c", 5.0, 4.0, "warn")]
    assert coef.check_run(_cf({"family": "h3", "shifts": None}), {"shifts": {"a": 2.0}}).ok
    assert coef.check_run(cf, {"shifts": None}).ok
    none = _cf({"family": "h3", "sampler": None, "cfg": None})
    assert coef.check_run(none, {"sampler": "heun", "cfg": 7.0}).ok


# ------------------------------------------------------------------------------------------------ survivors (round 2)

def test_load_names_a_missing_file_as_a_coefficient_file(tmp_path):
    for f, full in ((lambda: coef.load(tmp_path / "none.json"), tmp_path / "none.json"),
                    (lambda: coef.load_inside(tmp_path, ["none.json"]),
                     os.path.join(os.path.realpath(tmp_path), "none.json"))):
        with pytest.raises(CoefficientError) as e:
            f()
        assert str(e.value) == f"TeaCache coefficient file '{full}' cannot be read (no such file)"


def test_save_never_reads_an_existing_file_larger_than_a_coefficient_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(b" " * (coef.MAX_FILE_BYTES + 1))
    seen = []
    with pytest.raises(CoefficientError):
        coef.save(coef.parse(GOOD, W), p, replace_if=lambda b: seen.append(len(b)) or True)
    assert seen == [] and p.stat().st_size == coef.MAX_FILE_BYTES + 1
    p.write_bytes(b" " * coef.MAX_FILE_BYTES)          # exactly the limit: read and offered to replace_if
    coef.save(coef.parse(GOOD, W), p, replace_if=lambda b: seen.append(len(b)) or True)
    assert seen == [coef.MAX_FILE_BYTES] and coef.load(p).family == "h3"


def test_polynomial_negative_linear_with_open_range_takes_the_leading_term_branch():
    # 3 - x: the doubling search (1, 2, 4) finds x = 4, beyond the [0, 1] a grid would look at
    assert coef.polynomial_negative([-1.0, 3.0], None) == (4.0, -1.0)
    assert coef.polynomial_negative([-1.0, 3.0], (0.0, 5.0)) == (5.0, -2.0)


def _finishes(fn, *a, limit=20.0):
    """fn(*a) run in a thread: a search that never ends fails here instead of hanging the test run."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(fn(*a)), daemon=True)
    t.start()
    t.join(limit)
    assert out, f"{fn.__name__}{a} did not finish in {limit} s"
    return out[0]


def test_polynomial_negative_doubling_search_ends():
    # 1 - 1e-6 x^2: p(1024) = 1 - 1.048576 < 0 after 10 doublings from 1 (512: 0.737856 >= 0)
    assert _finishes(coef.polynomial_negative, [-1e-6, 0.0, 1.0], None) == (1024.0, 1 - 1e-6 * 1024 ** 2)


@pytest.mark.parametrize("lead, n", [(-1e-30, 2), (-1e-30, 1), (-1e-300, 3)])
def test_polynomial_negative_names_a_negative_point_for_a_tiny_leading_coefficient(lead, n):
    """1 + lead x^n with a tiny negative lead is >= 0 up to x = (1e-6 + 1) / |lead| ^ (1/n), far past 1e12: the
    point named is past that root and its value is below -tol (was: x = 2^40 named with p(x) ~ +1, "negative")."""
    c = [lead] + [0.0] * (n - 1) + [1.0]
    x, v = _finishes(coef.polynomial_negative, c, None)
    root = (1.0 / -lead) ** (1.0 / n)
    assert x >= root and v < -coef.NEGATIVE_TOL and v == pytest.approx(1.0 + lead * x ** n, rel=1e-12)
    assert not 1.0 + lead * (x / 2) ** n < -coef.NEGATIVE_TOL           # the first doubling that is negative


def test_polynomial_negative_over_a_range_start_past_the_root():
    # the search starts at max(1, lo): a range opening past the root is negative at lo itself
    assert coef.polynomial_negative([-1.0, 0.0, 4.0], (8.0, math.inf)) == (8.0, -60.0)


def test_weights_fingerprint_keeps_the_order_of_equal_names_and_reads_objects_without_shape():
    x = torch.tensor([[1.0, 2.0]])
    y = torch.tensor([[0.5, -1.0]])
    h = hashlib.sha256()
    for t in (y, x):
        h.update(b"a|(1, 2)|torch.float32\n")
        h.update(np.ascontiguousarray(t.reshape(-1).numpy()).tobytes())
    assert coef.weights_fingerprint([("a", y), ("a", x)])["weights_sha256"] == h.hexdigest()

    class Bare:
        def numel(self):
            return 3

    fp = coef.weights_fingerprint([("b", Bare())])
    assert fp == {"weights_sha256": hashlib.sha256(b"b|()|?\n").hexdigest(), "n_tensors": 1, "n_params": 3,
                  "unread_tensors": 1}
