"""Smoke of ``benchmarks/bench_teacache.py`` on the tiny H3 checkpoint (needs COMFYUI_PATH).

The benchmark produces the README's TeaCache figures; it broke unnoticed once (the coefficient-path confinement
refused its borrowed file), so it runs here at the smallest settings: it must exit 0 and write (``--rows``) a
table with calibrated, borrowed and EasyCache rows whose block-evaluation counts add up. ``--lab`` (the quality
lab's trained H3, the README row) runs too: it broke unnoticed once more when the lab harness renamed its class.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._harness import RowSet

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("source", [["--families", "h3"], ["--lab"]], ids=["tiny", "lab"])
def test_bench_teacache_smoke(comfyui_path, source, tmp_path):
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    rows_path = tmp_path / "teacache.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_teacache.py"), *source,
                           "--steps", "8", "--calib-prompts", "2", "--eval-prompts", "1", "--rows", str(rows_path)],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"bench_teacache failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    rows = RowSet.read(rows_path)
    pre = "h3 8 steps"
    methods = [c.split("/") for c in rows.cases("block_evals") if c.count("/") == 2]
    assert {m[1] for m in methods} == {"calibrated", "borrowed", "easycache"}, rows.cases()
    assert all(m[0] == pre for m in methods), methods
    uncached = rows.value(f"{pre}/uncached", "block_evals")
    assert uncached > 0
    for m in methods:
        case = "/".join(m)
        evals, full = rows.value(case, "block_evals"), rows.value(case, "block_evals_uncached")
        assert full == uncached, f"every row counts against the same uncached total: {case} {full} vs {uncached}"
        assert 0 < evals <= full, (case, evals, full)
        assert rows.positive(case, "fewer_evals") >= 1
    assert isinstance(rows.value(f"{pre}/goal", "met"), bool)
    assert "| method | threshold | block evals |" in out  # the human table is still printed
