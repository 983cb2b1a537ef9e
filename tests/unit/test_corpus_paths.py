"""Paths a /prompt submitter controls: file names given to ditkit nodes must not let a remote user read files
outside the model/output folders (directly or through error messages)."""
from __future__ import annotations

import json

import pytest

from ditkit.errors import DitKitError


@pytest.mark.xfail(strict=True, reason=(
    "nodes/teacache.py resolve_coefficients accepts any absolute path (documented in the tooltip) and "
    "cache/coefficients.py parse echoes field values in its errors (e.g. \"format: is 'TOPSECRET-...'\"), so "
    "anyone who can queue a prompt can read string fields of any JSON file the server can read"))
def test_teacache_coefficients_path_does_not_disclose_foreign_files(comfy, tmp_path):
    from ditkit.nodes.teacache import build_state

    secret = tmp_path / "not_a_coefficient_file.json"
    secret.write_text(json.dumps({"format": "TOPSECRET-7f3a", "api_key": "x"}), encoding="utf-8")
    params = {"spec": str(secret), "family": "h3", "strict": False, "model_fp": None, "threshold": 0.2,
              "audio_threshold": 0.2, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "model"}
    with pytest.raises(DitKitError) as ei:
        build_state(params)
    assert "TOPSECRET" not in str(ei.value), str(ei.value)


def test_teacache_relative_names_cannot_leave_the_teacache_dir(comfy):
    from ditkit.errors import CoefficientError
    from ditkit.nodes.teacache import resolve_coefficients

    for spec in ("../../etc/passwd", "../x.json", "a/../../b.json"):
        with pytest.raises(CoefficientError, match="leaves"):
            resolve_coefficients(spec)
