"""Model / patch fingerprints (bridge/fingerprint.py): one scheme for TeaCache files and the AdaLN tables.

Plain torch: the ModelPatcher is a stand-in with the attributes the scheme reads (``model.diffusion_model``,
``patches``, ``weight_wrapper_patches``, ``object_patches``)."""
from __future__ import annotations

import gc
import types

import torch

from ditkit.bridge import fingerprint as F
from ditkit.cache import coefficients as coef


def _patcher(dm, patches=None, object_patches=None):
    return types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=dm), patches=patches or {},
                                 weight_wrapper_patches={}, object_patches=object_patches or {})


def _linear(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(16, 16)   # 256 weights: more than the previous rule's first 64
    with torch.no_grad():
        m.weight.fill_(value)
        m.bias.zero_()
    return m


def test_fingerprint_cache_never_aliases_a_new_model_that_reuses_an_id():
    """Models created and dropped one after another (CPython hands the next one the same id() again): each gets
    the fingerprint of its own weights, and no entry outlives its model. An id()-keyed, never-emptied cache gave
    the new model the dead one's fingerprint."""
    gc.collect()
    before = len(F._WEIGHTS)
    ids, sha = [], []
    for i in range(40):
        dm = _linear(float(i))
        ids.append(id(dm))
        sha.append(F.model_fingerprint(_patcher(dm))["weights_sha256"])
        del dm
        gc.collect()
    assert len(set(ids)) < len(ids), "no id() was reused: the scenario this test is about did not happen"
    assert len(set(sha)) == len(sha)            # 40 different weights, 40 different fingerprints
    assert len(F._WEIGHTS) == before            # bounded: entries die with their models


def test_fingerprint_is_cached_per_live_model_and_covers_the_whole_tensor():
    dm = _linear(1.0)
    a = F.model_fingerprint(_patcher(dm))
    assert F.model_fingerprint(_patcher(dm)) == a and a["scheme"] == F.SCHEME
    other = _linear(1.0)
    with torch.no_grad():
        other.weight.view(-1)[-1] = 2.0          # only the last value differs: beyond the old first-64 window
    b = F.model_fingerprint(_patcher(other))
    assert b["weights_sha256"] != a["weights_sha256"]
    assert b["weights_sha256_v1"] == a["weights_sha256_v1"]  # the previous rule does not see it


def test_patches_are_fingerprinted_by_value_not_only_by_strength():
    """Two LoRAs on the same keys at the same strength are different models for a coefficient file (the TeaCache
    rule before hashed keys and strengths only and could not tell them apart)."""
    dm = _linear(1.0)
    k = "diffusion_model.weight"

    def lora(v):
        return {k: [(1.0, (torch.full((16, 16), v),), 1.0, None, None)]}

    fa = F.model_fingerprint(_patcher(dm, lora(0.1)))
    fb = F.model_fingerprint(_patcher(dm, lora(0.2)))
    assert fa["patches_sha256"] != fb["patches_sha256"] and fa["n_patched_weights"] == 1
    assert fa["weights_sha256"] == fb["weights_sha256"]
    assert "patches_sha256" not in F.model_fingerprint(_patcher(dm))
    # stored form: an object patch counts by type (stable across processes), the in-memory form by identity
    op1 = F.patches_digest(_patcher(dm, object_patches={"diffusion_model.x": torch.nn.Identity()}))[0]
    op2 = F.patches_digest(_patcher(dm, object_patches={"diffusion_model.x": torch.nn.Identity()}))[0]
    assert op1 == op2 != F.patches_digest(_patcher(dm))[0]
    a, b = torch.nn.Identity(), torch.nn.Identity()      # both alive: two objects
    loc1 = F.patches_digest(_patcher(dm, object_patches={"diffusion_model.x": a}), local=True)[0]
    loc2 = F.patches_digest(_patcher(dm, object_patches={"diffusion_model.x": b}), local=True)[0]
    assert loc1 != loc2


def _file(model_fp):
    return coef.CoefficientFile("h3", {"video": coef.StreamCoefficients("video", (1.0, 0.0)),
                                       "audio": coef.StreamCoefficients("audio", (1.0, 0.0))},
                                {"family": "h3", "model": model_fp}, {"source": "test", "kind": "calibrated"})


def test_files_from_before_scheme_2_keep_matching_their_model():
    """A coefficient file written before (``fingerprint.model`` without ``scheme``) holds the previous rule's
    value; it is compared against that value, so it still matches the model it was calibrated on."""
    dm = _linear(3.0)
    fp = F.model_fingerprint(_patcher(dm))
    legacy_value = coef.weights_fingerprint(dm.state_dict().items())["weights_sha256"]  # the previous rule, as shipped
    assert coef.check_model(_file({"weights_sha256": legacy_value}), "h3", fp).ok
    assert coef.check_model(_file({"scheme": 2, "weights_sha256": fp["weights_sha256"]}), "h3", fp).ok
    g = coef.check_model(_file({"weights_sha256": "ab" * 32}), "h3", fp)
    assert [m.field for m in g.mismatches] == ["model.weights_sha256"]
    g = coef.check_model(_file({"scheme": 2, "weights_sha256": legacy_value}), "h3", fp)  # scheme 2: new value only
    assert [m.field for m in g.mismatches] == ["model.weights_sha256"]
