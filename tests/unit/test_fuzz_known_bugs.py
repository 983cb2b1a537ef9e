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


@_bug("cache/coefficients.py parse: 'family' a JSON list/object -> TypeError unhashable type in `family not in FAMILY_STREAMS`")
def test_coefficients_unhashable_family():
    with pytest.raises(DitKitError):
        coef.parse(_doc(family=[]), "'bad.json'")


@_bug("cache/coefficients.py: parse accepts fingerprint.model 'abc' (a string); check_model then raises AttributeError "
      "('str' object has no attribute 'get') at DitKitTeaCache execution")
def test_coefficients_fingerprint_model_not_object():
    cf = coef.parse(_doc(fingerprint={"family": "h3", "model": "abc"}), "'bad.json'")
    with pytest.raises(DitKitError):
        coef.check_model(cf, "h3", None)


@_bug("cache/coefficients.py: parse accepts fingerprint.shifts {'a': 'x'}; check_run then raises a bare ValueError "
      "(float('x')) at sampling start")
def test_coefficients_fingerprint_shifts_not_numbers():
    cf = coef.parse(_doc(fingerprint={"family": "h3", "shifts": {"a": "x"}}), "'bad.json'")
    with pytest.raises(DitKitError):
        coef.check_run(cf, {"shifts": {"a": 1.0}})
