"""Smoke run of benchmarks/bench_quantize.py without its ComfyUI part (the peak-RSS rows need a host): the
real-size and reconstruction-error figures, read as rows (``--rows``, benchmarks/_harness.py), are present and
consistent with the formats' sizes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks._harness import RowSet

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")


def test_bench_quantize_quick_without_host(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    out = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_quantize.py"), "--quick", "--no-rss",
                        "--rows", str(out)], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = RowSet.read(out)
    assert rows.cases("bytes_nvfp4") == ["real/h3", "real/ltx2", "real/zimage", "real/flux2"]
    for case in rows.cases("bytes_nvfp4"):
        stored = rows.positive(case, "bytes_as_stored")
        fp8, int8, mx, nv = (rows.positive(case, f"bytes_{f}") for f in FORMATS)
        # 8-bit formats: below stored, equal up to the marker bytes, mxfp8 a little above (block scales), nvfp4
        # below all
        assert nv < fp8 < mx < stored and nv < int8 < mx and abs(fp8 - int8) < 1e-6 * stored, case
    # the H3 inventory reproduces the official index's total (bf16 + fp32 islands)
    assert rows.value("real/h3", "bytes_as_stored") == rows.value("real/h3", "official_index_total_bytes")
    classes = rows.cases("nvfp4")
    assert sorted(classes) == ["error/block AdaLN", "error/block MLP", "error/block attention"]
    for case in classes:
        for f in FORMATS:
            r = rows.row(case, f)
            assert 0 < r["value"] <= r["max"] < 0.5 and r["n"] >= 1, r
        # int8 (127 levels, per-tensor) < fp8 (3 mantissa bits) < nvfp4 (e2m1) on random weights
        assert rows.value(case, "int8_tensorwise") < rows.value(case, "float8_e4m3fn") < rows.value(case, "nvfp4")
