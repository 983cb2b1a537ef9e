"""benchmarks/multigpu_check.py without GPUs: the refusal with fewer than 2 CUDA GPUs, and every section's code path
on gloo with toy shapes (``--device cpu``). No figure from here stands for a GPU; no timing is asserted."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multigpu_check.py"


def test_refuses_without_two_gpus():
    if torch.cuda.device_count() >= 2:
        return
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "needs >= 2 CUDA GPUs" in out.stdout, out.stdout + out.stderr[-2000:]


def test_cpu_gloo_run_is_exact_and_rank_consistent():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--gpus", "2", "--rounds", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    errs = [float(x) for x in re.findall(r"vsa_max_abs_error=(\S+)", out.stdout)]
    assert errs == [0.0, 0.0], out.stdout
    assert out.stdout.count("teacache_ranks_identical=True equal_single=True") == 2, out.stdout
    logs = set(re.findall(r"log=([01]+)", out.stdout))
    assert len(logs) == 1 and "1" in logs.pop(), out.stdout          # the run skipped somewhere, same on both ranks
    assert len(re.findall(r"speedup_median=\S+ min=\S+ max=\S+ \(ceiling 2\)", out.stdout)) == 2
