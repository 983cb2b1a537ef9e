"""Fast smoke of the quality-lab harness on the committed trained lab weights (needs COMFYUI_PATH).

Runs ``benchmarks/lab/harness.py --smoke`` in a subprocess (it points ComfyUI's output directory at a scratch
folder, so it must not share this process) and checks its table (``check_smoke_output``):

* every row is there, and every feature row is MEASURED: on a real ComfyUI host every node the smoke uses exists
  (ditkit's and the stock EasyCache), so a row that prints ``error: ...`` or ``not available ...``, a
  ``TeaCache calibration failed`` line or a traceback on stderr fails the test;
* the T=1 rows are measured; ditkit's DitKitH3VAEDecode matches the lab's own repeat-decode figure (same
  algorithm, independent code). The smoke decodes one held-out clip (3 frames), too few to size the T=1 gap; the
  gap itself is asserted on 24 clips by tests/unit/test_lab_ref_vae.py;
* classifier-free guidance really runs (two transformer passes per step), TeaCache skips some passes, sparse
  attention skips none, every quality figure is finite.

``test_checker_refuses_*`` feed the checker edited copies of a real smoke output (no host needed), so the claim
"fails when a feature row prints an error" is itself tested.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "benchmarks" / "lab"
WEIGHTS = [LAB / "weights" / n for n in ("h3lab_video_vae.safetensors", "h3lab_dit.safetensors",
                                         "h3lab_text_embed.safetensors")]
FEATURE_ROWS = ("TeaCache (ditkit", "EasyCache (native", "Sparse attention (ditkit")
T1_ROWS = ("T=1 decode: native single token", "T=1 decode: repeat-decode", "T=1 decode: DitKitH3VAEDecode",
           "(same frames decoded inside their clip)")
DB = re.compile(r"(-?\d+(?:\.\d+)?) dB")


def parse_table(out: str) -> dict[str, list[str]]:
    """Rows of the harness table keyed by label, from the header line to the first line that is not a row."""
    lines = out.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("row ") and "| speed" in ln]
    assert len(heads) == 1, f"expected one harness table header, found {len(heads)}:\n{out[-3000:]}"
    table: dict[str, list[str]] = {}
    for ln in lines[heads[0] + 2:]:
        if " | " not in ln:
            break
        cells = [c.strip() for c in ln.split("|")]
        assert cells[0] not in table, f"row {cells[0]!r} printed twice"
        table[cells[0]] = cells
    return table


def _row(table: dict, prefix: str) -> list[str]:
    hits = [v for k, v in table.items() if k.startswith(prefix)]
    assert len(hits) == 1, f"expected one row starting with {prefix!r}, got {[h[0] for h in hits]}"
    return hits[0]


def _db(cell: str) -> float:
    m = DB.fullmatch(cell)
    assert m, f"expected a dB figure, got {cell!r}"
    return float(m.group(1))


def check_smoke_output(out: str, err: str) -> None:
    """Everything the smoke must show; raises AssertionError naming the first problem."""
    assert "Traceback" not in out + err, f"the harness printed a traceback:\n{err[-3000:]}"
    for ln in out.splitlines():
        assert not ln.startswith("TeaCache calibration failed"), ln
    table = parse_table(out)
    for label, cells in table.items():
        assert len(cells) == 8, f"row {label!r} has {len(cells)} cells: {cells}"
        bad = [c for c in cells[1:] if c.lower().startswith(("error", "not available")) or "error:" in c.lower()]
        assert not bad, f"row {label!r} was not measured: {bad[0]}"
    for prefix in T1_ROWS:
        r = _row(table, prefix)
        assert 10.0 < _db(r[3]) < 60.0, r  # a trained decoder: far above noise, below identity
        assert 0.0 < float(r[4]) <= 1.0, r
    dk, repeat = _row(table, "T=1 decode: DitKitH3VAEDecode"), _row(table, "T=1 decode: repeat-decode")
    assert abs(_db(dk[3]) - _db(repeat[3])) < 0.05, (dk, repeat)
    exact = _row(table, "exact path (reference)")
    assert exact[3] == "inf" and exact[4] == "1.000", exact
    # classifier-free guidance really runs: two transformer passes (prompt, null prompt) per step when cfg != 1
    head = re.search(r"(\d+) prompt\(s\) x (\d+) seed\(s\), (\d+) euler steps, cfg ([\d.]+)", out)
    assert head, f"harness header missing:\n{out}"
    samples, steps, cfg = int(head.group(1)) * int(head.group(2)), int(head.group(3)), float(head.group(4))
    assert cfg != 1.0, "the smoke must exercise the null-prompt branch"
    passes = re.fullmatch(r"(\d+) samples, (\d+) steps, (\d+) passes, [\d.]+s", exact[-1])
    assert passes and int(passes.group(1)) == samples and int(passes.group(2)) == steps, exact
    n_exact = int(passes.group(3))
    assert n_exact == samples * steps * 2, (exact, cfg)
    for prefix in FEATURE_ROWS:
        r = _row(table, prefix)
        assert re.fullmatch(r"\d+(\.\d+)?x", r[1]) and float(r[1][:-1]) > 0, r
        skip = float(r[2])
        n = re.fullmatch(r"(\d+) passes", r[-1])
        assert n, r
        assert skip == pytest.approx(1 - int(n.group(1)) / n_exact, abs=0.006), r  # printed with 2 decimals
        assert math.isfinite(_db(r[3])) and 0.0 < float(r[4]) <= 1.0, r
        assert math.isfinite(_db(r[5])) and math.isfinite(_db(r[6])), r  # audio LSD, SNR
    assert float(_row(table, "TeaCache (ditkit")[2]) > 0.0, "calibrated TeaCache skipped nothing"
    assert float(_row(table, "Sparse attention (ditkit")[2]) == 0.0, "sparse attention must not skip passes"
    assert "TeaCache calibrated on the lab model" in out
    assert "prompt adherence" in out


def test_lab_harness_smoke(comfyui_path):
    missing = [str(p) for p in WEIGHTS if not p.is_file()]
    assert not missing, f"lab weights missing: {missing} (run benchmarks/lab/train_vae.py and train_dit.py)"
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    proc = subprocess.run([sys.executable, str(LAB / "harness.py"), "--smoke"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    check_smoke_output(out, proc.stderr)


# ------------------------------------------------------------------- the checker itself (no host needed)

SAMPLE = """engine: comfy (ComfyUI in-process: KSampler, feature nodes)
TeaCache calibrated on the lab model -> h3lab.json (in /tmp/h3lab_out_x)

H3 quality lab: 1 prompt(s) x 1 seed(s), 6 euler steps, cfg 3 (negative: null prompt), 22x64x96 px, CPU, torch threads 1, engine comfy
row                                     | speed | skip | video PSNR | SSIM  | audio LSD | audio SNR | notes
-------------------------------------------------------------------------------------------------------------
T=1 decode: native single token         | -     | -    | 19.06 dB   | 0.603 | -         | -         | 3 held-out frames; offset-free PSNR 20.94 dB
T=1 decode: repeat-decode (lab ref)     | -     | -    | 23.23 dB   | 0.793 | -         | -         | gain +4.17 dB vs native (95 % CI +4.17..+4.17 dB, clip bootstrap; better on 3/3 frames); offset-free PSNR 24.29 dB
T=1 decode: DitKitH3VAEDecode           | -     | -    | 23.23 dB   | 0.793 | -         | -         | gain +4.17 dB vs native
(same frames decoded inside their clip) | -     | -    | 20.19 dB   | 0.764 | -         | -         | 7-token window upper bound; offset-free PSNR 21.61 dB
exact path (reference)                  | 1.00x | 0.00 | inf        | 1.000 | 0.00 dB   | inf       | 1 samples, 6 steps, 12 passes, 1.22s
TeaCache (ditkit, defaults)             | 1.35x | 0.17 | 33.60 dB   | 0.982 | 0.82 dB   | 20.98 dB  | 10 passes
EasyCache (native, defaults)            | 1.11x | 0.17 | 23.00 dB   | 0.912 | 0.80 dB   | 21.80 dB  | 10 passes
Sparse attention (ditkit, defaults)     | 0.42x | 0.00 | 24.82 dB   | 0.883 | 1.26 dB   | 19.24 dB  | 12 passes
prompt adherence of exact samples (read back from pixels): colour 1/1, direction 1/1
total 84s
"""  # a real `harness.py --smoke` output (comfy engine, this host), trailing padding trimmed


def _edit_row(out: str, prefix: str, cells: list[str]) -> str:
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(prefix))
    lines[i] = " | ".join([lines[i].split(" | ")[0]] + cells)
    return "\n".join(lines) + "\n"


def test_checker_accepts_a_real_output():
    check_smoke_output(SAMPLE, "")


ERROR_CELLS = ["-"] * 6 + ["error: RuntimeError: boom"]


@pytest.mark.parametrize("prefix", ["TeaCache (ditkit", "EasyCache (native", "Sparse attention (ditkit",
                                    "T=1 decode: DitKitH3VAEDecode"])
def test_checker_refuses_a_row_that_prints_an_error(prefix):
    with pytest.raises(AssertionError, match="not measured|dB figure"):
        check_smoke_output(_edit_row(SAMPLE, prefix, ERROR_CELLS), "")


@pytest.mark.parametrize("prefix", ["TeaCache (ditkit", "Sparse attention (ditkit", "T=1 decode: DitKitH3VAEDecode"])
def test_checker_refuses_a_row_that_is_not_available(prefix):
    with pytest.raises(AssertionError, match="not measured"):
        check_smoke_output(_edit_row(SAMPLE, prefix, ["-"] * 6 + ["not available (ditkit.nodes.x missing: x)"]), "")


def test_checker_refuses_an_error_after_figures_and_failed_calibration_and_tracebacks():
    measured_then_error = ["1.35x", "0.17", "33.60 dB", "0.982", "0.82 dB", "20.98 dB", "error: ValueError: x"]
    with pytest.raises(AssertionError, match="not measured"):
        check_smoke_output(_edit_row(SAMPLE, "TeaCache (ditkit", measured_then_error), "")
    failed = SAMPLE.replace("TeaCache calibrated on the lab model", "TeaCache calibration failed: OSError: x\n"
                            "TeaCache calibrated on the lab model")
    with pytest.raises(AssertionError, match="calibration failed"):
        check_smoke_output(failed, "")
    with pytest.raises(AssertionError, match="traceback"):
        check_smoke_output(SAMPLE, "Traceback (most recent call last):\n  File ...\nRuntimeError: boom\n")


def test_checker_refuses_a_missing_row_and_a_teacache_that_never_skips():
    dropped = "\n".join(ln for ln in SAMPLE.splitlines() if not ln.startswith("Sparse attention")) + "\n"
    with pytest.raises(AssertionError, match="Sparse attention"):
        check_smoke_output(dropped, "")
    no_skip = ["1.00x", "0.00", "inf", "1.000", "0.00 dB", "inf", "12 passes"]
    with pytest.raises(AssertionError):
        check_smoke_output(_edit_row(SAMPLE, "TeaCache (ditkit", no_skip), "")
