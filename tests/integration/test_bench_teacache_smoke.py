"""Smoke of ``benchmarks/bench_teacache.py`` on the tiny H3 checkpoint (needs COMFYUI_PATH).

The benchmark produces the README's TeaCache figures; it broke unnoticed once (the coefficient-path confinement
refused its borrowed file), so it runs here at the smallest settings: it must exit 0 and print a table with
calibrated, borrowed and EasyCache rows whose block-evaluation counts add up. ``--lab`` (the quality lab's
trained H3, the README row) runs too: it broke unnoticed once more when the lab harness renamed its class.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("source", [["--families", "h3"], ["--lab"]], ids=["tiny", "lab"])
def test_bench_teacache_smoke(comfyui_path, source):
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_teacache.py"), *source,
                           "--steps", "8", "--calib-prompts", "2", "--eval-prompts", "1"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"bench_teacache failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    rows = re.findall(r"^\| (calibrated|borrowed|easycache) \| [\d.]+ \| (\d+)/(\d+) \|", out, flags=re.M)
    kinds = {r[0] for r in rows}
    assert kinds == {"calibrated", "borrowed", "easycache"}, out[-3000:]
    totals = {int(r[2]) for r in rows}
    assert len(totals) == 1, f"every row counts against the same uncached total: {totals}"
    assert all(0 < int(r[1]) <= int(r[2]) for r in rows), rows
    assert "matched skip ratio" in out
