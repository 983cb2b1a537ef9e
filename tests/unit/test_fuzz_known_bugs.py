"""Inputs found by fuzzing/probing (test_fuzz.py) on which a parser raised a non-ditkit exception (IndexError,
TypeError, ZeroDivisionError, RecursionError...) or accepted a non-finite value. A bug still open is marked strict
xfail (``_bug``): when the owning module is fixed the test XPASSes, fails, and the marker must be removed (and the
matching ``hypothesis.assume`` in test_fuzz.py dropped). Fixed ones stay here as regression tests."""
from __future__ import annotations

import pytest
import torch

from ditkit.cache import coefficients as coef
from ditkit.loaders import lokr_apply as lokr

T = "diffusion_model.double_blocks.0.img_attn.proj"
P = "base_model.model.double_blocks.0.img_attn.proj"  # PEFT naming of the same module
SHAPES = {f"{T}.weight": (128, 128), "diffusion_model.double_stream_modulation_img.lin.weight": (768, 128),
          "diffusion_model.img_in.weight": (128, 128)}


def _lokr(sd, cfg=None, meta=None):
    if meta is not None:
        cfg = lokr.peft_config_from_metadata(meta)
    parsed = lokr.parse_lokr(sd, peft_config=cfg, source="bad.safetensors")
    return lokr.plan(parsed, SHAPES, source="bad.safetensors")


def _bug(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


# Each was a non-ditkit exception (or a NaN scale) before the fix; the words name the key and the problem.
LOKR_BUGS = [
    ("w1_a_without_rank", {f"{T}.lokr_w1_a": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16)}, None, None,
     "is incomplete"),  # was TypeError float(None) in _set_scale
    ("w1_a_1d", {f"{T}.lokr_w1_a": torch.ones(8), f"{T}.lokr_w1_b": torch.ones(8), f"{T}.lokr_w2": torch.ones(16, 16)},
     None, None, "lokr_w1_a' must be 2-D, got shape (8,)"),  # was IndexError
    ("w2_0d", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.tensor(1.0)}, None, None,
     "lokr_w2' must be at least 2-D, got shape ()"),  # was IndexError in LoKrModule.shape
    ("w2_1d", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16)}, None, None,
     "lokr_w2' must be at least 2-D, got shape (16,)"),
    ("w2_b_0d", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2_a": torch.ones(16, 4), f"{T}.lokr_w2_b": torch.tensor(1.0)},
     None, None, "lokr_w2_b' must be 2-D, got shape ()"),  # was IndexError in _set_scale
    ("rank_0", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2_a": torch.ones(16, 0), f"{T}.lokr_w2_b": torch.ones(0, 16)},
     None, None, "is empty (shape (16, 0); rank 0?)"),  # was ZeroDivisionError
    ("empty_scalar", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16), f"{T}.scalar": torch.ones(0)},
     None, None, "scalar' must be a single value"),  # was IndexError reshape(-1)[0]
    ("nan_scalar", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16),
                    f"{T}.scalar": torch.tensor(float("nan"))}, None, None, "the LyCORIS scalar must be finite"),
    ("metadata_deep_json", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16)}, None,
     {"lora_adapter_metadata": "[" * 100000 + "]" * 100000}, "'lora_adapter_metadata': invalid JSON"),  # RecursionError
    ("metadata_nan", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, None,
     {"lora_adapter_metadata": '{"r": NaN, "alpha": 4}'}, "non-finite JSON constant NaN"),  # was a NaN scale
    ("peft_r_zero", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 0, "alpha": 4}, None,
     "PEFT config r for 'double_blocks.0.img_attn.proj' is 0; it must be a positive integer"),  # ZeroDivisionError
    ("peft_r_fraction", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 1e-320, "alpha": 4},
     None, "PEFT config r for"),  # would give an Inf scale
    # a negative PEFT alpha is valid (PEFT: scaling = alpha / r, sign kept): test_lokr.py::test_peft_config_checks
    ("peft_alpha_string", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 4, "alpha": "x"},
     None, "PEFT config alpha for 'double_blocks.0.img_attn.proj' is a str"),  # bare ValueError from float()
    ("peft_alpha_list", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 4, "alpha": [1]},
     None, "PEFT config alpha for 'double_blocks.0.img_attn.proj' is a list"),  # TypeError from float()
    ("peft_r_bool", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": True, "alpha": 1},
     None, "PEFT config r for 'double_blocks.0.img_attn.proj' is a bool"),
    ("peft_rank_pattern_list", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)},
     {"r": 4, "alpha": 4, "rank_pattern": [1]}, None,
     "PEFT config 'rank_pattern' must be an object"),  # AttributeError .items()
    ("peft_alpha_pattern_zero", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)},
     {"r": 4, "alpha": 4, "alpha_pattern": {"img_attn.proj": 0}}, None, "alpha for 'double_blocks.0.img_attn.proj' is 0"),
]


@pytest.mark.parametrize("sd, cfg, meta, words", [pytest.param(sd, cfg, meta, w, id=i) for i, sd, cfg, meta, w in LOKR_BUGS])
def test_lokr_bad_input_raises_a_ditkit_error(sd, cfg, meta, words):
    with pytest.raises(lokr.AdapterError) as ei:
        _lokr(sd, cfg, meta)
    assert words in str(ei.value), str(ei.value)


def test_lokr_bad_factor_in_an_unmapped_module_is_only_reported():
    """Shape problems are checked where a module is used: one that maps to no weight stays a reported unused key."""
    sd = {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16),
          "x.y.lokr_w1_a": torch.ones(8), "x.y.lokr_w2": torch.tensor(1.0)}
    p = _lokr(sd)
    assert [it.module.prefix for it in p.items] == [T]
    assert set(p.unused) == {"x.y.lokr_w1_a", "x.y.lokr_w2"}


def test_lokr_valid_peft_scale_from_metadata():
    sd = {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}
    p = _lokr(sd, meta={"lora_adapter_metadata": '{"r": 4, "alpha": 2, "rank_pattern": {"img_attn.proj": 8}}'})
    assert p.items[0].module.scale == 2 / 8  # rank_pattern overrides r, as in PEFT


def _doc(**over):
    d = {"format": coef.FORMAT, "version": 1, "family": "h3",
         "streams": {"video": {"coefficients": [1.0, 0.0]}}, "fingerprint": {"family": "h3"},
         "provenance": {"source": "test", "kind": "calibrated"}}
    d.update(over)
    return d


# fixed: cache/coefficients.py parse checked `family not in FAMILY_STREAMS` on an unhashable list/object (TypeError)
@pytest.mark.parametrize("family", [[], {}, ["h3"], {"h3": 1}])
def test_coefficients_unhashable_family(family):
    with pytest.raises(coef.CoefficientError, match="family: is an? (list|object), expected one of"):
        coef.parse(_doc(family=family), "'bad.json'")


# fixed: parse accepted fingerprint.model 'abc'; check_model then raised AttributeError at DitKitTeaCache execution
@pytest.mark.parametrize("model, key", [("abc", "fingerprint.model"), ([1], "fingerprint.model"),
                                        ({"weights_sha256": 5}, "fingerprint.model.weights_sha256")])
def test_coefficients_fingerprint_model_not_object(model, key):
    with pytest.raises(coef.CoefficientError, match=key.replace(".", r"\.")) as ei:
        coef.parse(_doc(fingerprint={"family": "h3", "model": model}), "'bad.json'")
    assert "abc" not in str(ei.value)


# fixed: parse accepted fingerprint.shifts {'a': 'x'}; check_run then raised a bare ValueError at sampling start
@pytest.mark.parametrize("shifts", [{"a": "x"}, {"a": [1.0]}, "x", [1.0]])
def test_coefficients_fingerprint_shifts_not_numbers(shifts):
    with pytest.raises(coef.CoefficientError, match=r"fingerprint\.shifts"):
        coef.parse(_doc(fingerprint={"family": "h3", "shifts": shifts}), "'bad.json'")


def test_coefficients_valid_fingerprint_still_accepted():
    fp = {"family": "h3", "model": {"weights_sha256": "ab" * 32, "class": "X"}, "shifts": {"a": 1.0, "b": None},
          "steps": 8, "cfg": 1.0, "guidance": None, "sampler": "euler"}
    cf = coef.parse(_doc(fingerprint=fp), "'ok.json'")
    assert coef.check_run(cf, {"steps": 8, "shifts": {"a": 2.0}}).warnings() == ["shifts.a: file has 1.0, this run has 2.0"]


@pytest.mark.parametrize("field, value", [("format", "TOPSECRET-1"), ("version", "TOPSECRET-2"),
                                          ("family", "TOPSECRET-3"), ("provenance", {"source": "s", "kind": "TOPSECRET-4"}),
                                          ("streams", {"video": {"coefficients": "TOPSECRET-5"}}),
                                          ("streams", {"video": {"coefficients": [1.0, "TOPSECRET-6"]}}),
                                          ("streams", {"video": {"coefficients": [1.0], "x_range": ["TOPSECRET-7", 1]}}),
                                          ("streams", {"TOPSECRET-8": {"coefficients": [1.0]}}),
                                          ("fingerprint", {"family": "TOPSECRET-9"}),
                                          ("fingerprint", {"family": "h3", "steps": "TOPSECRET-10"})])
def test_coefficient_errors_do_not_echo_string_values(field, value):
    """A file that fails validation is not echoed (a crafted path could be any JSON the server can read)."""
    with pytest.raises(coef.CoefficientError) as ei:
        coef.parse(_doc(**{field: value}), "'bad.json'")
    assert "TOPSECRET" not in str(ei.value), str(ei.value)
