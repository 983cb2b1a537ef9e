"""Paths a /prompt submitter controls: file names given to ditkit nodes must not let a remote user read files
outside the model/output folders (directly or through error messages)."""
from __future__ import annotations

import json

import pytest

from ditkit.errors import DitKitError


@pytest.fixture
def teacache_out(comfy, tmp_path, monkeypatch):
    import folder_paths

    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(tmp_path / "output"))
    base = tmp_path / "output" / "ditkit" / "teacache"
    base.mkdir(parents=True)
    yield base
    folder_paths.set_output_directory(old)


def test_teacache_coefficients_path_does_not_disclose_foreign_files(comfy, tmp_path):
    from ditkit.nodes.teacache import build_state

    secret = tmp_path / "not_a_coefficient_file.json"
    secret.write_text(json.dumps({"format": "TOPSECRET-7f3a", "api_key": "x"}), encoding="utf-8")
    params = {"spec": str(secret), "family": "h3", "strict": False, "model_fp": None, "threshold": 0.2,
              "audio_threshold": 0.2, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "model"}
    with pytest.raises(DitKitError) as ei:
        build_state(params)
    assert "TOPSECRET" not in str(ei.value), str(ei.value)
    assert "must live in" in str(ei.value) and "outside ditkit's TeaCache folders" in str(ei.value), str(ei.value)


def test_foreign_json_inside_the_teacache_dir_is_not_echoed(teacache_out):
    """Even a file in the allowed folder that fails validation is described by type, not content."""
    from ditkit.nodes.teacache import build_state

    (teacache_out / "x.json").write_text(json.dumps({"format": "TOPSECRET-7f3a"}), encoding="utf-8")
    params = {"spec": "x.json", "family": "h3", "strict": False, "model_fp": None, "threshold": 0.2,
              "audio_threshold": 0.2, "start_percent": 0.0, "end_percent": 1.0, "cache_device": "model"}
    with pytest.raises(DitKitError, match="format: is a string, expected") as ei:
        build_state(params)
    assert "TOPSECRET" not in str(ei.value), str(ei.value)


def test_teacache_paths_inside_the_allowed_folders_resolve(teacache_out):
    from ditkit.cache import coefficients as coef
    from ditkit.nodes.teacache import resolve_coefficients

    (teacache_out / "sub").mkdir()
    (teacache_out / "sub" / "a.json").write_text("{}", encoding="utf-8")
    assert resolve_coefficients("sub/a.json") == str(teacache_out / "sub" / "a.json")
    assert resolve_coefficients("sub/a") == str(teacache_out / "sub" / "a.json")
    assert resolve_coefficients(str(teacache_out / "sub" / "a.json")) == str(teacache_out / "sub" / "a.json")
    shipped = coef.shipped_defaults()
    name, path = next(iter(shipped.items()))
    assert resolve_coefficients(f"shipped:{name}") == str(path)
    assert resolve_coefficients(str(path)) == str(path)


def test_teacache_absolute_paths_and_symlinks_outside_are_refused(teacache_out, tmp_path):
    import os

    from ditkit.errors import CoefficientError
    from ditkit.nodes.teacache import resolve_coefficients

    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}", encoding="utf-8")
    for spec in (str(outside), str(teacache_out / ".." / "x.json"), "/etc/passwd", str(tmp_path / "missing.json")):
        with pytest.raises(CoefficientError, match="must live in") as ei:
            resolve_coefficients(spec)
        assert "does not exist" not in str(ei.value)  # no existence oracle for foreign paths
    os.symlink(outside, teacache_out / "link.json")
    os.symlink(tmp_path, teacache_out / "dirlink")
    for spec in ("link.json", "link", "dirlink/elsewhere.json", str(teacache_out / "link.json")):
        with pytest.raises(CoefficientError, match="symlink"):
            resolve_coefficients(spec)


def test_teacache_relative_names_cannot_leave_the_teacache_dir(comfy):
    from ditkit.errors import CoefficientError
    from ditkit.nodes.teacache import resolve_coefficients

    for spec in ("../../etc/passwd", "../x.json", "a/../../b.json"):
        with pytest.raises(CoefficientError, match="leaves"):
            resolve_coefficients(spec)
