"""CI smoke of the quality-lab harness WITHOUT ComfyUI: ``benchmarks/lab/harness.py --smoke --engine ref``.

The ref engine samples the committed trained lab weights with the pure-torch references (``benchmarks.lab.lab_ref_*``,
proven equal to ComfyUI by the host tests ``tests/integration/test_lab_ref_equivalence_*.py``) and runs ditkit's
TeaCache / VSA-H3 / T=1 cores on them. The test reads the harness's data rows (``--rows``, ``benchmarks/_harness.py``),
not its printed table. This checks that every required row is present and measured, that CFG really ran (two
transformer passes per step), that TeaCache skips, that the sparse row is finite, that native-only rows say
why they are missing, and that no ComfyUI module was imported. Figures are not asserted beyond sanity: they are the
harness's measurements; the one cross-check is ditkit's T=1 core vs the lab's own repeat-decode code (same algorithm,
independent implementations).
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._harness import RowSet

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "benchmarks" / "lab"
WEIGHTS = [LAB / "weights" / n for n in ("h3lab_video_vae.safetensors", "h3lab_dit.safetensors",
                                         "h3lab_text_embed.safetensors")]
COMFY_TOP = ("comfy", "comfy_extras", "comfy_api", "folder_paths", "server", "nodes", "comfy_execution")
# run the harness as __main__ and write afterwards (JSON, to the file named by DITKIT_MODULES_OUT) which top-level
# ComfyUI modules ended up imported
RUNNER = (
    "import json, os, runpy, sys\n"
    "sys.argv = [sys.argv[1]] + sys.argv[2:]\n"
    "rc = 0\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    rc = e.code or 0\n"
    f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {COMFY_TOP!r})\n"
    "open(os.environ['DITKIT_MODULES_OUT'], 'w').write(json.dumps(bad))\n"
    "sys.exit(rc)\n"
)
T1 = ("T=1 decode: native single token", "T=1 decode: repeat-decode (lab ref)", "T=1 decode: ditkit core repeat_decode_t1",
      "(same frames decoded inside their clip)")


def label(rows: RowSet, prefix: str) -> str:
    hits = [c for c in rows.cases("status") if c.startswith(prefix)]
    assert len(hits) == 1, f"expected one row starting with {prefix!r}, got {hits}"
    return hits[0]


def measured(rows: RowSet, prefix: str) -> tuple[str, dict]:
    """(label, {metric: value}) of a table row whose status is ``measured``."""
    case = label(rows, prefix)
    st = rows.row(case, "status")
    assert st["value"] == "measured", f"row {case!r}: {st['value']} ({st['note']})"
    return case, {r["metric"]: r["value"] for r in rows.all(case)}


def finite(v) -> float:
    assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), v
    return float(v)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    missing = [str(p) for p in WEIGHTS if not p.is_file()]
    assert not missing, f"lab weights missing: {missing}"
    tmp = tmp_path_factory.mktemp("lab_ref_smoke")
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    env["DITKIT_MODULES_OUT"] = str(tmp / "modules.json")
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(LAB / "harness.py"), "--smoke", "--engine", "ref",
                           "--rows", str(tmp / "rows.jsonl")],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return RowSet.read(tmp / "rows.jsonl"), json.loads((tmp / "modules.json").read_text())


def test_ref_engine_imports_no_comfyui(smoke):
    rows, imported = smoke
    assert rows.value("run", "engine") == "ref"
    assert imported == [], f"the ref engine imported ComfyUI modules: {imported}"


def test_t1_rows(smoke):
    rows, _ = smoke
    got = {prefix: measured(rows, prefix)[1] for prefix in T1}
    for prefix, r in got.items():
        assert 10.0 < finite(r["video_psnr"]) < 60.0, (prefix, r)  # a trained decoder: far above noise, below identity
        assert 0.0 < r["ssim"] <= 1.0, (prefix, r)
    repeat, core = got["T=1 decode: repeat-decode (lab ref)"], got["T=1 decode: ditkit core repeat_decode_t1"]
    finite(repeat["gain_db"]), finite(core["gain_db"])
    # ditkit's core and the lab's own repeat-decode agree (two implementations of one algorithm)
    assert abs(core["video_psnr"] - repeat["video_psnr"]) < 0.05, (core, repeat)


def test_exact_path_runs_cfg(smoke):
    rows, _ = smoke
    samples, steps, cfg = rows.value("run", "samples"), rows.value("run", "steps"), rows.value("run", "cfg")
    assert samples == rows.value("run", "prompts") * rows.value("run", "seeds")
    assert cfg != 1.0  # the smoke must exercise the null-prompt branch
    _, exact = measured(rows, "exact path (reference)")
    assert exact["video_psnr"] == math.inf and exact["ssim"] == 1.0
    assert exact["samples"] == samples and exact["steps"] == steps, exact
    assert exact["passes"] == samples * steps * 2, exact


def test_teacache_row(smoke):
    rows, _ = smoke
    assert rows.value("TeaCache calibration", "outcome") == "calibrated"  # ditkit's calibration core wrote a file
    _, r = measured(rows, "TeaCache (ditkit")
    assert finite(r["speed"]) > 0, r
    assert 0.0 < r["skip"] < 1.0, r
    assert finite(r["video_psnr"]) and 0.0 < r["ssim"] <= 1.0, r
    finite(r["audio_lsd"]), finite(r["audio_snr"])
    assert isinstance(r["passes"], int) and r["passes"] > 0, r


def test_easycache_row_says_why(smoke):
    rows, _ = smoke
    case = label(rows, "EasyCache")
    st = rows.row(case, "status")
    assert st["value"] == "not available", st
    assert st["note"] == "not available (native ComfyUI node; run with COMFYUI_PATH)", st
    assert [r["metric"] for r in rows.all(case)] == ["status"], "no figures for a row that did not run"


def test_sparse_row(smoke):
    rows, _ = smoke
    _, r = measured(rows, "Sparse attention (ditkit")
    assert finite(r["speed"]) > 0, r
    assert r["skip"] == 0.0, r  # sparse attention never skips a pass
    assert finite(r["video_psnr"]) > 5.0, r
    finite(r["audio_lsd"])
