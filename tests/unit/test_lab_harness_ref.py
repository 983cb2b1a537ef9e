"""CI smoke of the quality-lab harness WITHOUT ComfyUI: ``benchmarks/lab/harness.py --smoke --engine ref``.

The ref engine samples the committed trained lab weights with the pure-torch references (``benchmarks.lab.lab_ref_*``,
proven equal to ComfyUI by the host tests ``tests/integration/test_lab_ref_equivalence_*.py``) and runs ditkit's
TeaCache / VSA-H3 / T=1 cores on them. This checks that every required row is present and measured, that CFG really
ran (two transformer passes per step), that TeaCache skips, that the sparse row is finite, that native-only rows say
why they are missing, and that no ComfyUI module was imported. Figures are not asserted beyond sanity: they are the
harness's measurements; the one cross-check is ditkit's T=1 core vs the lab's own repeat-decode code (same algorithm,
independent implementations).
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench_output import NUM, one

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "benchmarks" / "lab"
WEIGHTS = [LAB / "weights" / n for n in ("h3lab_video_vae.safetensors", "h3lab_dit.safetensors",
                                         "h3lab_text_embed.safetensors")]
COMFY_TOP = ("comfy", "comfy_extras", "comfy_api", "folder_paths", "server", "nodes", "comfy_execution")
# run the harness as __main__ and report afterwards which top-level ComfyUI modules ended up imported
RUNNER = (
    "import runpy, sys\n"
    "sys.argv = [sys.argv[1]] + sys.argv[2:]\n"
    "rc = 0\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    rc = e.code or 0\n"
    f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {COMFY_TOP!r})\n"
    "print('COMFY_MODULES_IMPORTED', bad)\n"
    "sys.exit(rc)\n"
)


def parse_table(out: str) -> dict[str, list[str]]:
    """Rows of the harness table keyed by their label (first cell), from the header line to the first non-row."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("row ") and "| speed" in ln)
    table = {}
    for ln in lines[start + 2:]:
        if " | " not in ln:
            break
        cells = [c.strip() for c in ln.split("|")]
        table[cells[0]] = cells
    return table


def find(table: dict, prefix: str) -> list[str]:
    hits = [v for k, v in table.items() if k.startswith(prefix)]
    assert len(hits) == 1, f"expected one row starting with {prefix!r}, got {[h[0] for h in hits]}"
    return hits[0]


def db(cell: str) -> float:
    m = re.fullmatch(NUM + " dB", cell)
    assert m, f"expected a dB figure, got {cell!r}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def smoke() -> str:
    missing = [str(p) for p in WEIGHTS if not p.is_file()]
    assert not missing, f"lab weights missing: {missing}"
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(LAB / "harness.py"), "--smoke", "--engine", "ref"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    return out


def test_ref_engine_imports_no_comfyui(smoke):
    assert "engine: ref" in smoke
    m = one(r"^COMFY_MODULES_IMPORTED (.*)$", smoke)
    assert m.group(1) == "[]", f"the ref engine imported ComfyUI modules: {m.group(1)}"


def test_t1_rows(smoke):
    t = parse_table(smoke)
    native = find(t, "T=1 decode: native single token")
    repeat = find(t, "T=1 decode: repeat-decode (lab ref)")
    core = find(t, "T=1 decode: ditkit core repeat_decode_t1")
    in_clip = find(t, "(same frames decoded inside their clip)")
    for r in (native, repeat, core, in_clip):
        assert 10.0 < db(r[3]) < 60.0, r  # a trained decoder: far above noise, below identity
        assert 0.0 < float(r[4]) <= 1.0, r
    assert "gain" in repeat[-1] and "gain" in core[-1]
    # ditkit's core and the lab's own repeat-decode agree (two implementations of one algorithm)
    assert abs(db(core[3]) - db(repeat[3])) < 0.05, (core, repeat)


def test_exact_path_runs_cfg(smoke):
    head = one(r"(\d+) prompt\(s\) x (\d+) seed\(s\), (\d+) euler steps, cfg " + NUM + r" .*engine ref", smoke)
    samples, steps, cfg = int(head.group(1)) * int(head.group(2)), int(head.group(3)), float(head.group(4))
    assert cfg != 1.0  # the smoke must exercise the null-prompt branch
    exact = find(parse_table(smoke), "exact path (reference)")
    assert exact[3] == "inf" and exact[4] == "1.000"
    m = re.search(r"(\d+) samples, (\d+) steps, (\d+) passes", exact[-1])
    assert m and int(m.group(1)) == samples and int(m.group(2)) == steps, exact
    assert int(m.group(3)) == samples * steps * 2, exact


def test_teacache_row(smoke):
    assert "TeaCache calibrated on the lab model" in smoke  # ditkit's calibration core wrote a coefficient file
    row = find(parse_table(smoke), "TeaCache (ditkit")
    speed, skip = row[1], float(row[2])
    assert re.fullmatch(r"[\d.]+x", speed), row
    assert 0.0 < skip < 1.0, row
    assert math.isfinite(db(row[3])) and 0.0 < float(row[4]) <= 1.0, row
    assert math.isfinite(db(row[5])) and math.isfinite(db(row[6])), row  # audio LSD, SNR
    assert re.fullmatch(r"\d+ passes", row[-1]), row


def test_easycache_row_says_why(smoke):
    row = find(parse_table(smoke), "EasyCache")
    assert row[3] == "-"
    assert row[-1] == "not available (native ComfyUI node; run with COMFYUI_PATH)", row


def test_sparse_row(smoke):
    row = find(parse_table(smoke), "Sparse attention (ditkit")
    assert re.fullmatch(r"[\d.]+x", row[1]) and float(row[1][:-1]) > 0, row
    assert float(row[2]) == 0.0, row  # sparse attention never skips a pass
    p = db(row[3])
    assert math.isfinite(p) and p > 5.0, row
    assert math.isfinite(db(row[5])), row
