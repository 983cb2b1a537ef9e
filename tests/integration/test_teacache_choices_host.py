"""The TeaCache ``coefficients`` combo (nodes/_choices.py) inside the real host: it lists the shipped files and the
calibrated files in ``<output>/ditkit/teacache/``, is re-read whenever ComfyUI asks for the schema (what
/object_info and a frontend refresh do), and a value saved before it was a combo still passes validation."""
from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def outdir(comfy, tmp_path):
    import folder_paths

    old = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(tmp_path))
    yield tmp_path
    folder_paths.set_output_directory(old)


def _options():
    from ditkit.nodes.teacache import DitKitTeaCache

    spec = DitKitTeaCache.INPUT_TYPES()["required"]["coefficients"]   # what /object_info serves, computed now
    assert spec[0] == "COMBO", spec
    return spec[1]["options"]


def test_lists_shipped_and_calibrated_files_and_refreshes(outdir):
    from ditkit.cache.coefficients import DEFAULTS_DIR

    shipped = sorted(f"shipped:{p.stem}" for p in DEFAULTS_DIR.glob("*.json"))
    assert "shipped:h3_tiny_calibrated" in shipped
    assert _options() == shipped                              # nothing calibrated yet
    tc = outdir / "ditkit" / "teacache"
    (tc / "mine" / "pairs").mkdir(parents=True)
    (tc / "h3_mine.json").write_text("{}")
    (tc / "mine" / "sub.json").write_text("{}")
    (tc / "mine" / "pairs_20261201-000000_1.json").write_text("{}")   # a calibration's pair file
    (tc / "notes.txt").write_text("x")
    os.symlink(tc / "h3_mine.json", tc / "link.json")                # the reader refuses symlinks
    os.symlink(tc / "mine", tc / "linkdir")
    assert _options() == ["h3_mine.json", "mine/sub.json"] + shipped   # re-read at schema time, no restart


def test_a_value_outside_the_list_still_validates(outdir):
    """A workflow saved while ``coefficients`` was a text field (any name, e.g. one a calibration in the same
    prompt writes) queues: ComfyUI skips its combo check because the node validates that input itself."""
    import inspect

    from comfy_api.internal import first_real_override

    from ditkit.nodes.teacache import DitKitTeaCache

    # what execution.validate_inputs does: the inputs named by the node's own validate_inputs skip the combo check
    fn = first_real_override(DitKitTeaCache, "validate_inputs")
    assert fn is not None
    spec = inspect.getfullargspec(fn)
    assert "coefficients" in spec.args and spec.varkw is None   # only this input: the others keep min/max checks
    assert DitKitTeaCache.validate_inputs(coefficients="written_later_by_calibrate.json") is True
    # the real server queues such a name: test_teacache_host.test_server_calibrate_then_teacache_workflow


def test_the_shipped_tiny_file_states_its_provenance():
    from ditkit.cache.coefficients import DEFAULTS_DIR

    raw = json.loads((DEFAULTS_DIR / "h3_tiny_calibrated.json").read_text())
    assert raw["provenance"]["kind"] == "calibrated" and "tiny" in raw["provenance"]["source"]
    assert "needs its own calibration" in raw["provenance"]["note"]
    assert raw["family"] == "h3" and raw["fingerprint"]["model"]["weights_sha256"]
