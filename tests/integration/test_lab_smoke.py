"""Fast smoke of the quality-lab harness on the committed trained lab weights (needs COMFYUI_PATH).

Runs ``benchmarks/lab/harness.py --smoke --rows FILE`` in a subprocess (it points ComfyUI's output directory at a
scratch folder, so it must not share this process) and checks its data rows (``check_smoke_output``; the rows of
``benchmarks/_harness.py``, read as data, not the printed table):

* every row is there, and every feature row is MEASURED: on a real ComfyUI host every node the smoke uses exists
  (ditkit's and the stock EasyCache), so a row whose status is ``error`` or ``not available``, a failed TeaCache
  calibration or a traceback on stderr fails the test;
* the T=1 rows are measured; ditkit's DitKitH3VAEDecode matches the lab's own repeat-decode figure (same
  algorithm, independent code). The smoke decodes one held-out clip (3 frames), too few to size the T=1 gap; the
  gap itself is asserted on 24 clips by tests/unit/test_lab_ref_vae.py;
* classifier-free guidance really runs (two transformer passes per step), TeaCache skips some passes, sparse
  attention skips none, every quality figure is finite.

``test_checker_refuses_*`` feed the checker edited copies of a real smoke output's rows (no host needed), so the
claim "fails when a feature row reports an error" is itself tested.
"""
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks._harness import Rows, RowSet, read_rows

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "benchmarks" / "lab"
WEIGHTS = [LAB / "weights" / n for n in ("h3lab_video_vae.safetensors", "h3lab_dit.safetensors",
                                         "h3lab_text_embed.safetensors")]
FEATURE_ROWS = ("TeaCache (ditkit", "EasyCache (native", "Sparse attention (ditkit")
T1_ROWS = ("T=1 decode: native single token", "T=1 decode: repeat-decode", "T=1 decode: DitKitH3VAEDecode",
           "(same frames decoded inside their clip)")
EXACT = "exact path (reference)"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _row(rows: RowSet, prefix: str) -> dict:
    """{metric: value} of the one table row (a case with a status) whose label starts with ``prefix``."""
    hits = [c for c in rows.cases("status") if c.startswith(prefix)]
    assert len(hits) == 1, f"expected one row starting with {prefix!r}, got {hits}"
    return {r["metric"]: r["value"] for r in rows.all(hits[0])}


def check_smoke_output(rows: RowSet, err: str) -> None:
    """Everything the smoke must show; raises AssertionError naming the first problem."""
    assert "Traceback" not in err, f"the harness printed a traceback:\n{err[-3000:]}"
    cal = rows.row("TeaCache calibration", "outcome")
    assert cal["value"] == "calibrated", f"TeaCache calibration {cal['value']}: {cal['note']}"
    for case in rows.cases("status"):
        st = rows.row(case, "status")
        assert st["value"] == "measured", f"row {case!r} was not measured: {st['value']} ({st['note']})"
    for prefix in T1_ROWS:
        r = _row(rows, prefix)
        assert _finite(r["video_psnr"]) and 10.0 < r["video_psnr"] < 60.0, r  # trained decoder: above noise
        assert 0.0 < r["ssim"] <= 1.0, r
    dk, repeat = _row(rows, "T=1 decode: DitKitH3VAEDecode"), _row(rows, "T=1 decode: repeat-decode")
    assert abs(dk["video_psnr"] - repeat["video_psnr"]) < 0.05, (dk, repeat)
    exact = _row(rows, EXACT)
    assert exact["video_psnr"] == math.inf and exact["ssim"] == 1.0, exact
    # classifier-free guidance really runs: two transformer passes (prompt, null prompt) per step when cfg != 1
    samples, steps, cfg = rows.value("run", "samples"), rows.value("run", "steps"), rows.value("run", "cfg")
    assert cfg != 1.0, "the smoke must exercise the null-prompt branch"
    assert exact["samples"] == samples and exact["steps"] == steps, exact
    n_exact = exact["passes"]
    assert n_exact == samples * steps * 2, (exact, cfg)
    for prefix in FEATURE_ROWS:
        r = _row(rows, prefix)
        assert _finite(r["speed"]) and r["speed"] > 0, r
        assert isinstance(r["passes"], int), r
        assert r["skip"] == pytest.approx(1 - r["passes"] / n_exact, abs=1e-9), r
        assert _finite(r["video_psnr"]) and 0.0 < r["ssim"] <= 1.0, r
        assert _finite(r["audio_lsd"]) and _finite(r["audio_snr"]), r
    assert _row(rows, "TeaCache (ditkit")["skip"] > 0.0, "calibrated TeaCache skipped nothing"
    assert _row(rows, "Sparse attention (ditkit")["skip"] == 0.0, "sparse attention must not skip passes"
    assert rows.value("adherence", "n") == samples  # prompt adherence read back from the exact samples


def test_lab_harness_smoke(comfyui_path, tmp_path):
    missing = [str(p) for p in WEIGHTS if not p.is_file()]
    assert not missing, f"lab weights missing: {missing} (run benchmarks/lab/train_vae.py and train_dit.py)"
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    proc = subprocess.run([sys.executable, str(LAB / "harness.py"), "--smoke", "--rows", str(tmp_path / "rows.jsonl")],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    check_smoke_output(RowSet.read(tmp_path / "rows.jsonl"), proc.stderr)


# ------------------------------------------------------------------- the checker itself (no host needed)

def _sample_rows() -> list[dict]:
    """The rows of a real ``harness.py --smoke`` run (comfy engine, this host: 1 prompt x 1 seed, 6 euler steps,
    cfg 3), written to a file through the harness's own row writer and read back as the smoke reads them."""
    tmp = tempfile.TemporaryDirectory()
    out = Rows(Path(tmp.name) / "rows.jsonl", "lab_harness")

    def table(label, **v):
        out.add(label, "status", "measured")
        for k, x in v.items():
            out.add(label, k, x)

    for k, v in (("engine", "comfy"), ("steps", 6), ("cfg", 3.0), ("prompts", 1), ("seeds", 1), ("samples", 1)):
        out.add("run", k, v)
    table("T=1 decode: native single token", video_psnr=19.06, ssim=0.603, frames=3, offset_free_psnr=20.94)
    table("T=1 decode: repeat-decode (lab ref)", video_psnr=23.23, ssim=0.793, frames=3, gain_db=4.17,
          offset_free_psnr=24.29)
    table("T=1 decode: DitKitH3VAEDecode", video_psnr=23.23, ssim=0.793, frames=3, gain_db=4.17)
    table("(same frames decoded inside their clip)", video_psnr=20.19, ssim=0.764, frames=3, offset_free_psnr=21.61)
    out.add("TeaCache calibration", "outcome", "calibrated", note="h3lab.json (in /tmp/h3lab_out_x)")
    table(EXACT, speed=1.0, skip=0.0, video_psnr=math.inf, ssim=1.0, audio_lsd=0.0, audio_snr=math.inf, samples=1,
          steps=6, passes=12, seconds=1.22)
    table("TeaCache (ditkit, defaults)", speed=1.35, skip=1 - 10 / 12, video_psnr=33.60, ssim=0.982, audio_lsd=0.82,
          audio_snr=20.98, samples=1, passes=10, seconds=0.9)
    table("EasyCache (native, defaults)", speed=1.11, skip=1 - 10 / 12, video_psnr=23.00, ssim=0.912, audio_lsd=0.80,
          audio_snr=21.80, samples=1, passes=10, seconds=1.1)
    table("Sparse attention (ditkit, defaults)", speed=0.42, skip=0.0, video_psnr=24.82, ssim=0.883, audio_lsd=1.26,
          audio_snr=19.24, samples=1, passes=12, seconds=2.9)
    for k, v in (("colour", 1), ("direction", 1), ("n", 1)):
        out.add("adherence", k, v)
    with tmp:
        return read_rows(out.path)


def _edit(rows: list[dict], prefix: str, status: str, note: str, keep_figures: bool = False) -> RowSet:
    """A copy of ``rows`` where the table row starting with ``prefix`` reports ``status`` (its figures dropped
    unless ``keep_figures``)."""
    case = next(r["case"] for r in rows if r["case"].startswith(prefix))
    out = []
    for r in rows:
        if r["case"] == case and r["metric"] == "status":
            out.append(dict(r, value=status, note=note))
        elif r["case"] != case or keep_figures:
            out.append(dict(r))
    return RowSet(out)


def test_checker_accepts_a_real_output():
    check_smoke_output(RowSet(_sample_rows()), "")


@pytest.mark.parametrize("prefix", ["TeaCache (ditkit", "EasyCache (native", "Sparse attention (ditkit",
                                    "T=1 decode: DitKitH3VAEDecode"])
def test_checker_refuses_a_row_that_reports_an_error(prefix):
    with pytest.raises(AssertionError, match="not measured"):
        check_smoke_output(_edit(_sample_rows(), prefix, "error", "error: RuntimeError: boom"), "")


@pytest.mark.parametrize("prefix", ["TeaCache (ditkit", "Sparse attention (ditkit", "T=1 decode: DitKitH3VAEDecode"])
def test_checker_refuses_a_row_that_is_not_available(prefix):
    with pytest.raises(AssertionError, match="not measured"):
        check_smoke_output(_edit(_sample_rows(), prefix, "not available", "not available (ditkit.nodes.x missing: x)"),
                           "")


def test_checker_refuses_an_error_after_figures_and_failed_calibration_and_tracebacks():
    with pytest.raises(AssertionError, match="not measured"):
        check_smoke_output(_edit(_sample_rows(), "TeaCache (ditkit", "error", "error: ValueError: x",
                                 keep_figures=True), "")
    failed = [dict(r, value="failed", note="OSError: x") if r["case"] == "TeaCache calibration" else r
              for r in _sample_rows()]
    with pytest.raises(AssertionError, match="calibration failed"):
        check_smoke_output(RowSet(failed), "")
    with pytest.raises(AssertionError, match="traceback"):
        check_smoke_output(RowSet(_sample_rows()), "Traceback (most recent call last):\n  File ...\nRuntimeError: boom\n")


def test_checker_refuses_a_missing_row_and_a_teacache_that_never_skips():
    dropped = [r for r in _sample_rows() if not r["case"].startswith("Sparse attention")]
    with pytest.raises(AssertionError, match="Sparse attention"):
        check_smoke_output(RowSet(dropped), "")
    no_skip = [dict(r, value={"skip": 0.0, "passes": 12}.get(r["metric"], r["value"]))
               if r["case"].startswith("TeaCache (ditkit") else r for r in _sample_rows()]
    with pytest.raises(AssertionError, match="skipped nothing"):
        check_smoke_output(RowSet(no_skip), "")
    wrong_skip = [dict(r, value=0.5) if r["case"].startswith("EasyCache") and r["metric"] == "skip" else r
                  for r in _sample_rows()]
    with pytest.raises(AssertionError):
        check_smoke_output(RowSet(wrong_skip), "")
