"""Smoke run of benchmarks/lab/turbo_curve_lab.py (needs ComfyUI): 1 prompt x 1 seed x 1 step; the rows exist and
the curve carry is closer to the unpruned base + LoRA than the conversion that drops the AdaLN pairs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_turbo_curve_lab_smoke(comfyui_path, tmp_path):
    rows = tmp_path / "rows.jsonl"
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lab" / "turbo_curve_lab.py"), "--smoke",
                        "--steps", "1", "--rows", str(rows)], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {(r["case"], r["metric"]): r["value"] for r in map(json.loads, rows.read_text().splitlines())}
    carry = got[("pruned + LoRA, AdaLN pairs as curve columns (bypass)", "video_psnr")]
    fused = got[("pruned + LoRA, AdaLN pairs as curve columns (fuse)", "video_psnr")]
    dropped = got[("pruned + LoRA, AdaLN pairs dropped (community conversion)", "video_psnr")]
    assert carry > dropped and abs(carry - fused) < 1.0, got
