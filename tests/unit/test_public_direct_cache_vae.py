"""Public functions of cache/ and vae/ that were only reached through their callers (issue 29: every public function
is called directly by a unit test). Oracles written here from each contract; boundaries on both sides."""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ditkit.cache import calibrate as cal
from ditkit.cache import coefficients as coef
from ditkit.errors import BackendError, CoefficientError, DitKitError
from ditkit.vae import metadata as vmeta
from ditkit.vae import video_stream as vs

GOOD = {
    "format": coef.FORMAT, "version": 1, "family": "h3",
    "streams": {"video": {"coefficients": [1.0, -2.0, 3.0, 0.5, 0.01], "x_range": [0.01, 0.2], "fit": {"r2": 0.9}}},
    "calibration": {"n_prompts": 3},
    "fingerprint": {"family": "h3", "model": {"weights_sha256": "ab" * 32}, "sampler": "euler", "steps": 4,
                    "sigmas": [1.0, 0.75, 0.5, 0.25, 0.0], "shifts": {"model_sampling": 12.0}, "cfg": 1.0,
                    "guidance": None},
    "provenance": {"source": "test", "kind": "calibrated"},
}


def _good_bytes(size=None):
    raw = json.dumps(GOOD).encode()
    if size is not None:                       # pad with JSON whitespace to exactly `size` bytes
        raw = raw + b" " * (size - len(raw))
        assert len(raw) == size
    return raw


# ---- cache/calibrate.pair_file_bytes
def test_pair_file_bytes_is_strict_utf8_json():
    obj = {"a": 1, "b": [0.5, None], "é": "ü"}
    raw = cal.pair_file_bytes(obj)
    assert isinstance(raw, bytes)
    assert raw == b'{"a": 1, "b": [0.5, null], "\\u00e9": "\\u00fc"}'
    assert json.loads(raw.decode("utf-8")) == obj
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            cal.pair_file_bytes({"x": [1.0, bad]})


# ---- cache/calibrate.fit_non_negative
def _lstsq(x, y, degree):
    """The least-squares polynomial (highest order first) from the Vandermonde normal equations."""
    v = np.vander(np.asarray(x, dtype=np.float64), degree + 1)
    return np.linalg.solve(v.T @ v, v.T @ np.asarray(y, dtype=np.float64))


def test_fit_non_negative_keeps_a_non_negative_degree():
    x = np.linspace(0.0, 1.0, 9)
    y = 0.3 * x ** 2 + 0.1 * x + 0.05
    coeffs, fit, xr = cal.fit_non_negative(x.tolist(), y.tolist(), 2)
    assert np.allclose(coeffs, _lstsq(x, y, 2), atol=1e-9) and xr == (0.0, 1.0)
    assert fit["degree"] == 2 and "degree_requested" not in fit and "degree_lowered_because" not in fit


def test_fit_non_negative_lowers_the_degree_and_says_why():
    x = np.linspace(0.0, 1.0, 11)
    y = (x - 0.5) ** 2 - 0.01                  # the exact degree-2 fit is -0.01 at 0.5: negative inside the range
    coeffs, fit, _ = cal.fit_non_negative(x.tolist(), y.tolist(), 2)
    assert len(coeffs) == 2 and np.allclose(coeffs, _lstsq(x, y, 1), atol=1e-9)
    assert fit["degree"] == 1 and fit["degree_requested"] == 2
    assert "degree-2" in fit["degree_lowered_because"] and "negative" in fit["degree_lowered_because"]
    y3 = (x - 0.5) ** 2 - 0.01 + 0.0 * x ** 3  # from degree 3 the first refusal (degree 3's) is the one stated
    _, fit3, _ = cal.fit_non_negative(x.tolist(), y3.tolist(), 3)
    assert fit3["degree"] == 1 and fit3["degree_requested"] == 3 and "degree-3" in fit3["degree_lowered_because"]


def test_fit_non_negative_tolerance_boundary():
    x = np.linspace(0.0, 1.0, 11)
    ok = (x - 0.5) ** 2 - 0.9e-6               # lowest value -0.9e-6: within the 1e-6 tolerance, kept at degree 2
    _, fit, _ = cal.fit_non_negative(x.tolist(), ok.tolist(), 2)
    assert fit["degree"] == 2 and "degree_requested" not in fit
    bad = (x - 0.5) ** 2 - 1.1e-6
    _, fit, _ = cal.fit_non_negative(x.tolist(), bad.tolist(), 2)
    assert fit["degree"] == 1


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_fit_non_negative_refuses_when_every_degree_is_negative(degree):
    x = np.linspace(0.0, 1.0, 8)
    with pytest.raises(cal.NegativeFitError, match="every lower degree down to 1") as e:
        cal.fit_non_negative(x.tolist(), (-1.0 - x).tolist(), degree)
    assert f"degree-{degree}" in str(e.value)


# ---- cache/coefficients.load_inside
def test_load_inside_reads_below_root(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.json").write_bytes(_good_bytes())
    cf = coef.load_inside(tmp_path, ["sub", "c.json"])
    assert cf.path == os.path.join(os.path.realpath(tmp_path), "sub", "c.json")
    assert cf.family == "h3" and cf.streams["video"].coefficients == (1.0, -2.0, 3.0, 0.5, 0.01)
    cf = coef.load_inside(tmp_path, ("sub", "c.json"), display="teacache/c.json")
    assert cf.path == "teacache/c.json"


def test_load_inside_size_boundary(tmp_path):
    (tmp_path / "max.json").write_bytes(_good_bytes(coef.MAX_FILE_BYTES))
    assert coef.load_inside(tmp_path, ["max.json"]).family == "h3"
    (tmp_path / "over.json").write_bytes(_good_bytes(coef.MAX_FILE_BYTES + 1))
    with pytest.raises(CoefficientError):
        coef.load_inside(tmp_path, ["over.json"])


def test_load_inside_errors_name_the_display(tmp_path):
    (tmp_path / "bad.json").write_text('{"format": NaN}', encoding="utf-8")
    with pytest.raises(CoefficientError, match="shown-name"):
        coef.load_inside(tmp_path, ["bad.json"], display="shown-name")
    with pytest.raises(CoefficientError):
        coef.load_inside(tmp_path, ["missing.json"])


@pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW"), reason="POSIX")
def test_load_inside_does_not_follow_a_symlink_below_root(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_bytes(_good_bytes())
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    os.symlink(outside, root / "d" / "c.json")
    os.symlink(tmp_path, root / "link")
    with pytest.raises(CoefficientError):
        coef.load_inside(root, ["d", "c.json"])
    with pytest.raises(CoefficientError):
        coef.load_inside(root, ["link", "outside.json"])


# ---- cache/coefficients.is_coefficient_file
def test_is_coefficient_file():
    assert coef.is_coefficient_file(_good_bytes()) is True
    assert coef.is_coefficient_file(_good_bytes(coef.MAX_FILE_BYTES)) is True
    assert coef.is_coefficient_file(_good_bytes(coef.MAX_FILE_BYTES + 1)) is False
    bad = copy.deepcopy(GOOD)
    bad["streams"]["video"]["coefficients"] = []
    for raw in (b"my notes", b"", b"{}", b"[1, 2]", json.dumps(bad).encode(), b"\xff\xfe{}",
                json.dumps(GOOD).replace("0.01]", "NaN]").encode(), json.dumps({**GOOD, "format": "x"}).encode()):
        assert coef.is_coefficient_file(raw) is False, raw[:60]


# ---- cache/coefficients.sigmas_list
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sigmas_list_rounds_each_value_to_6_places(dtype):
    base = torch.tensor([[1.0, 0.0], [0.123456789, 0.5], [3.1415926535, 0.0], [1e-7, 0.0]], dtype=dtype)
    s = base[:, 0]                              # a strided (non-contiguous) column
    assert not s.is_contiguous()
    got = coef.sigmas_list(s)
    want = [float(f"{float(v):.6f}") for v in s.tolist()]
    assert got == want and all(type(v) is float for v in got)
    assert coef.sigmas_list([0.1234565, 2, np.float32(0.5), 1.0000004, 1.0000006]) == \
        [float(f"{0.1234565:.6f}"), 2.0, 0.5, 1.0, 1.000001]
    assert coef.sigmas_list([]) == []


# ---- vae/metadata.is_image_vae_metadata
def test_is_image_vae_metadata():
    for k in vmeta.IMAGE_VAE_KEYS:
        assert vmeta.is_image_vae_metadata({k: ""}) is True
        assert vmeta.is_image_vae_metadata({"format": "pt", k: "1"}) is True
    assert set(vmeta.IMAGE_VAE_KEYS) == {"h3_t1_direct", "h3_t1_format", "h3_t1_output_slice", "minimax_h3_video_vae"}
    for meta in ({}, {"format": "pt"}, {"h3_t1_direct_": "1"}, {"H3_T1_DIRECT": "1"}, {"config": "h3_t1_direct"}):
        assert vmeta.is_image_vae_metadata(meta) is False


# ---- vae/video_stream: require_av, expand_prefix, next_counter, probe_audio_encoder
def test_require_av_returns_the_module_or_names_the_package(monkeypatch):
    pytest.importorskip("av")
    import av
    assert vs.require_av() is av
    monkeypatch.setitem(sys.modules, "av", None)          # import av -> ImportError
    with pytest.raises(BackendError, match="pip install av"):
        vs.require_av()


def test_expand_prefix(monkeypatch):
    fixed = time.struct_time((2026, 3, 7, 4, 5, 9, 5, 66, 0))
    monkeypatch.setattr(vs.time, "localtime", lambda *a: fixed)
    assert vs.expand_prefix("ditkit/clip", 640, 360) == "ditkit/clip"
    assert vs.expand_prefix("a_%width%x%height%_%year%-%month%-%day%_%hour%%minute%%second%", 640, 360) == \
        "a_640x360_2026-03-07_040509"
    assert vs.expand_prefix("%width%%width%", 8, 4) == "88"
    assert vs.expand_prefix("100%", 8, 4) == "100%" and vs.expand_prefix("%unknown%", 8, 4) == "%unknown%"
    later = time.struct_time((2026, 12, 31, 23, 59, 58, 3, 365, 0))
    monkeypatch.setattr(vs.time, "localtime", lambda *a: later)
    assert vs.expand_prefix("%month%%day%%hour%%minute%%second%", 1, 1) == "1231235958"
    for bad in (None, 3, b"x", ["x"]):
        with pytest.raises(DitKitError, match="filename_prefix must be a string"):
            vs.expand_prefix(bad, 8, 4)


def test_next_counter():
    assert vs.next_counter([], "vid") == 1
    assert vs.next_counter(["other_00009_.mp4", "video_00007_.mp4", "xvid_00011_.mp4"], "vid") == 1
    assert vs.next_counter(["vid_00001_.mp4", "vid_00005_.mp4", "vid_00003_.png"], "vid") == 6
    assert vs.next_counter(["vid_7", "vid_0"], "vid") == 8
    assert vs.next_counter(["vid_00000_.mp4"], "vid") == 1
    assert vs.next_counter(["vid__00004_.mp4", "vid_x_00004_.mp4"], "vid") == 1
    assert vs.next_counter(["a.b_00002_.mp4", "aXb_00009_.mp4"], "a.b") == 3     # the base is literal, not a regex


class _FakeCtx:
    def __init__(self, fail=None):
        self.fail, self.opened = fail, False

    def open(self):
        if self.fail:
            raise self.fail
        self.opened = True


def test_probe_audio_encoder_sets_and_opens():
    made = []

    def create(codec, mode):
        made.append((codec, mode, _FakeCtx()))
        return made[-1][2]

    vs.probe_audio_encoder(SimpleNamespace(CodecContext=SimpleNamespace(create=create)), "aac", 44100.0, "stereo")
    (codec, mode, cc), = made
    assert (codec, mode) == ("aac", "w") and cc.opened
    assert cc.sample_rate == 44100 and type(cc.sample_rate) is int and cc.layout == "stereo" and cc.format == "fltp"


def test_probe_audio_encoder_names_the_input_on_failure():
    fake = SimpleNamespace(CodecContext=SimpleNamespace(create=lambda c, m: _FakeCtx(ValueError("bad rate"))))
    with pytest.raises(DitKitError, match=r"input 'audio': the aac encoder cannot encode 12345 Hz mono audio "
                                          r"\(ValueError: bad rate\)"):
        vs.probe_audio_encoder(fake, "aac", 12345, "mono")


def test_probe_audio_encoder_with_pyav():
    av = pytest.importorskip("av")
    vs.probe_audio_encoder(av, "aac", 44100, "stereo")
    with pytest.raises(DitKitError, match="input 'audio'"):
        vs.probe_audio_encoder(av, "aac", 44100, "5.1(side)x")
    with pytest.raises(DitKitError, match="no_such_codec"):
        vs.probe_audio_encoder(av, "no_such_codec", 44100, "stereo")
