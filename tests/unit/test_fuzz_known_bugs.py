"""Inputs found by fuzzing/probing (test_fuzz.py) on which a parser raises a non-ditkit exception (IndexError,
TypeError, ZeroDivisionError, RecursionError...) or accepts a non-finite value. Each is marked strict xfail: when
the owning module is fixed the test XPASSes, fails, and the marker must be removed (and the matching
``hypothesis.assume`` in test_fuzz.py dropped)."""
from __future__ import annotations

import pytest
import torch

from ditkit.cache import coefficients as coef
from ditkit.errors import DitKitError
from ditkit.loaders import lokr

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


LOKR_BUGS = [
    ("w1_a_without_rank", {f"{T}.lokr_w1_a": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16)}, None, None,
     "loaders/lokr.py _set_scale: decomposed module without lokr_w1_b/lokr_w2_b -> m.rank None -> TypeError float(None)"),
    ("w1_a_1d", {f"{T}.lokr_w1_a": torch.ones(8), f"{T}.lokr_w1_b": torch.ones(8), f"{T}.lokr_w2": torch.ones(16, 16)},
     None, None, "loaders/lokr.py _set_scale/validate_module: 1-D lokr_w1_b/lokr_w1_a -> IndexError on shape[1]"),
    ("w2_0d", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.tensor(1.0)}, None, None,
     "loaders/lokr.py LoKrModule.shape: 0-D lokr_w2 -> IndexError (validate_module checks only lokr_w1 is 2-D)"),
    ("w2_1d", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16)}, None, None,
     "loaders/lokr.py LoKrModule.shape: 1-D lokr_w2 -> IndexError"),
    ("w2_b_0d", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2_a": torch.ones(16, 4), f"{T}.lokr_w2_b": torch.tensor(1.0)},
     None, None, "loaders/lokr.py _set_scale: 0-D lokr_w2_b -> IndexError on shape[0]"),
    ("rank_0", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2_a": torch.ones(16, 0), f"{T}.lokr_w2_b": torch.ones(0, 16)},
     None, None, "loaders/lokr.py _set_scale: rank-0 lokr_w2_a/lokr_w2_b -> ZeroDivisionError alpha / rank"),
    ("empty_scalar", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16), f"{T}.scalar": torch.ones(0)},
     None, None, "loaders/lokr.py parse_lokr: empty '.scalar' tensor -> IndexError reshape(-1)[0]"),
    ("metadata_deep_json", {f"{T}.lokr_w1": torch.ones(8, 8), f"{T}.lokr_w2": torch.ones(16, 16)}, None,
     {"lora_adapter_metadata": "[" * 100000 + "]" * 100000},
     "loaders/lokr.py peft_config_from_metadata: json.loads (not strict_json_loads) -> RecursionError escapes"),
    ("peft_r_zero", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 0, "alpha": 4}, None,
     "loaders/lokr.py _set_scale: PEFT config r=0 -> ZeroDivisionError"),
    ("peft_alpha_string", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 4, "alpha": "x"},
     None, "loaders/lokr.py _set_scale: PEFT config alpha 'x' -> bare ValueError from float()"),
    ("peft_alpha_list", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}, {"r": 4, "alpha": [1]},
     None, "loaders/lokr.py _set_scale: PEFT config alpha [1] -> TypeError from float()"),
    ("peft_rank_pattern_list", {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)},
     {"r": 4, "alpha": 4, "rank_pattern": [1]}, None,
     "loaders/lokr.py _pattern_lookup: rank_pattern a list -> AttributeError .items()"),
]


@pytest.mark.parametrize("sd, cfg, meta", [pytest.param(sd, cfg, meta, id=i, marks=_bug(why))
                                           for i, sd, cfg, meta, why in LOKR_BUGS])
def test_lokr_bad_input_raises_a_ditkit_error(sd, cfg, meta):
    with pytest.raises(DitKitError):
        _lokr(sd, cfg, meta)


@_bug("loaders/lokr.py peft_config_from_metadata: json.loads accepts NaN; r=NaN gives a NaN scale that plan() "
      "accepts (the patch would write NaN weights)")
def test_lokr_peft_nan_rank_is_refused():
    sd = {f"{P}.lokr_w1": torch.ones(8, 8), f"{P}.lokr_w2": torch.ones(16, 16)}
    with pytest.raises(DitKitError):
        _lokr(sd, meta={"lora_adapter_metadata": '{"r": NaN, "alpha": 4}'})


def _doc(**over):
    d = {"format": coef.FORMAT, "version": 1, "family": "h3",
         "streams": {"video": {"coefficients": [1.0, 0.0]}}, "fingerprint": {"family": "h3"},
         "provenance": {"source": "test"}}
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
