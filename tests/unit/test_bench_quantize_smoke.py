"""Smoke run of benchmarks/bench_quantize.py without its ComfyUI part (the peak-RSS rows need a host): the
real-size table and the reconstruction-error table are present and consistent with the formats' sizes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_quantize_quick_without_host():
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_quantize.py"), "--quick", "--no-rss"],
                       cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {m.group(1): [float(x) for x in re.findall(r"([\d.]+) GiB", m.group(2))]
            for m in re.finditer(r"^\| (MiniMax H3 DiT|LTX-2 19B DiT|Z-Image 6B DiT|FLUX.2-dev DiT) \|(.*)$",
                                 p.stdout, re.M)}
    assert len(rows) == 4
    for name, (stored, fp8, int8, mx, nv) in rows.items():
        # 8-bit formats: below stored, mxfp8 a little above fp8 (block scales), nvfp4 below all
        assert nv < fp8 == int8 < mx < stored, name
    h3 = rows["MiniMax H3 DiT"]
    assert 55 < h3[0] < 75          # ~33 B parameters in bf16 plus fp32 islands
    errs = re.findall(r"^\| (block attention|block MLP|block AdaLN) \|(.*)$", p.stdout, re.M)
    assert len(errs) == 3
    for _, cells in errs:
        vals = [float(x) for x in re.findall(r"^ ?([\d.]+e[-+]\d+)", cells.replace("|", "\n"), re.M)]
        assert len(vals) == 4 and all(0 < v < 0.5 for v in vals)
