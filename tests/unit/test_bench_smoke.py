"""Smoke runs of the benchmark scripts that need only torch + ditkit (no ComfyUI).

The benchmarks produce the figures quoted in README.md; a script that crashes or silently measures nothing would
go unnoticed, so each one runs here in a subprocess at its smallest settings. Every test checks the exit code
and something structural in the output that a do-nothing run could not produce (rows present, ratios that parse
to positive finite numbers, figures consistent with the shapes the script states, the exactness figure against
its float64 oracle). No timing is asserted and no figure the script measures is hard-coded.

``bench_adaln_cache.py`` and ``bench_te_streaming.py`` run here without their ComfyUI part (B); the full runs
are in ``tests/integration/test_bench_smoke_host.py``. ``bench_vsa_gpu.py`` is checked for its refusal without CUDA
and through its documented ``--device cpu`` smoke mode (CPU timings; nothing here stands for a GPU figure).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.bench_output import NUM, one as _one, positive as _pos

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _run(script: str, *args: str, timeout: float = 300, expect_rc: int | None = 0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}  # same behaviour whatever the caller set
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, (f"{script} {' '.join(args)} exited {proc.returncode}:\n"
                                              f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc




def test_bench_h3_loader_smoke():
    # hidden 128 is the smallest width whose derived head_dim (20) fits the rope table the script derives
    out = _run("bench_h3_loader.py", "--hidden", "128", "--layers", "1", "--shards", "2", "--repeats", "1").stdout
    _one(r"^checkpoint: .* \(2 shards, " + NUM + r" MiB of tensors", out)
    sizes = {}
    for mode in ("lazy", "eager"):
        m = _one(rf"^{mode}\s*: best {NUM} s over 1 runs, peak RSS growth {NUM} MiB \(state dict {NUM} MiB\)", out)
        _pos(m.group(1))
        sizes[mode] = _pos(m.group(3))
    assert sizes["lazy"] == sizes["eager"], sizes  # both modes load the same state dict
    m = _one(rf"^ratio eager/lazy: peak RSS growth {NUM}x, time {NUM}x; identical output: yes \(sha256 [0-9a-f]{{16}}\)",
             out)
    _pos(m.group(1))
    _pos(m.group(2))


def test_bench_vsa_cpu_small_smoke():
    backends = ("reference", "cpu_batched")  # "auto" resolves to cpu_batched on CPU
    out = _run("bench_vsa_cpu.py", "--small", "--heads", "1", "--reps", "1", "--backends", "reference,auto").stdout
    for case in ("h3-t2va", "video-only", "prefix-heavy"):
        m = _one(rf"^\[{case}\] S=(\d+) H=1 D=128 float32 keep=0.1 k=(\d+)/(\d+) video tiles, (\d+) prefix tiles, "
                 rf"block density {NUM} \(perfect-kernel ceiling {NUM}x\)", out)
        density = float(m.group(5))
        assert 0 < density <= 1, m.group(0)
        assert 0 < int(m.group(2)) <= int(m.group(3)), m.group(0)
        assert (int(m.group(4)) == 0) == (case == "video-only"), m.group(0)
        for b in backends:
            t = _one(rf"^\[{case}\]   CPU time: dense SDPA\s+{NUM} ms \| VSA-H3 \(\s*{b}\)\s+{NUM} ms \| "
                     rf"speedup\s+{NUM}x", out)
            for g in t.groups():
                _pos(g)
        errs = re.findall(rf"^\[{case}\]     max \|sparse - exact masked oracle\| \(10 sampled query tiles, fp64\) = "
                          rf"{NUM}; vs dense: max {NUM}, mean {NUM}", out, flags=re.M)
        assert len(errs) == len(backends), out
        for err, dmax, dmean in errs:
            assert float(err) < 1e-4, f"{case}: sparse output is not the exact masked attention ({err})"
            assert 0 < float(dmean) <= float(dmax), (case, dmean, dmax)  # keep 10 % is an approximation
    for b in backends:
        m = _one(rf"^RATIO dense/sparse \(CPU time\) \[{b}\]: h3-t2va {NUM}x, video-only {NUM}x \(target >= 5x\); "
                 rf"prefix-heavy stress case {NUM}x$", out)
        for g in m.groups():
            _pos(g)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present, so the refusal cannot happen")
def test_bench_vsa_gpu_refuses_without_cuda():
    proc = _run("bench_vsa_gpu.py", expect_rc=None)
    assert proc.returncode != 0, proc.stdout
    assert "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    assert "RATIO" not in proc.stdout


def test_bench_vsa_gpu_cpu_smoke_mode():
    out = _run("bench_vsa_gpu.py", "--device", "cpu", "--grid", "7,8,16", "--prefix", "300,37", "--heads", "2",
               "--reps", "1", "--backend", "cpu_batched").stdout
    _one(r"^geometry: prefix=\(300, 37\) video=\(7, 8, 16\) .*heads 2, head_dim 128", out)
    _one(r"^backends: \{.*'cpu_batched': 'ok'", out)
    _pos(_one(rf"^dense SDPA-flash :\s+{NUM} ms", out).group(1))
    m = _one(rf"^fine stage \(cpu_batched\s*\):\s+{NUM} ms .* block density {NUM}$", out)
    _pos(m.group(1))
    assert 0 < float(m.group(2)) <= 1, m.group(0)
    _pos(_one(rf"^VSA-H3 whole call:\s+{NUM} ms", out).group(1))
    m = _one(rf"^RATIO dense/fine {NUM}x \(target >= 7x\), dense/VSA-H3 {NUM}x", out)
    _pos(m.group(1))
    _pos(m.group(2))
    m = _one(rf"^quality: max \|fine - fp64 masked oracle\| = {NUM} \(sampled tiles\); VSA-H3 vs dense: max {NUM}, "
             rf"mean {NUM}", out)
    assert float(m.group(1)) < 1e-4, f"fine stage is not the exact masked attention: {m.group(0)}"
    assert 0 < float(m.group(3)) <= float(m.group(2)), m.group(0)


# H3's AdaLN projections as the script's docstring states them: 50 blocks x [96768, 2688] + final [10752, 2688],
# with biases, bf16 (2 bytes); one table row holds every block's output row.
H3_WEIGHT_BYTES = (50 * (96768 * 2688 + 96768) + 10752 * 2688 + 10752) * 2
H3_ROW_BYTES = (50 * 96768 + 10752) * 2


def test_bench_adaln_cache_without_host():
    out = _run("bench_adaln_cache.py", "--repeats", "1", "--comfyui", "").stdout
    w = float(_one(rf"^   AdaLN weights \(50 blocks \+ final\): {NUM} GiB", out).group(1))
    assert abs(w - H3_WEIGHT_BYTES / 2**30) < 0.006, w
    rows = re.findall(rf"^   \S+ (\d+) steps \(([^)]*)\)\s*: tables\s+{NUM} MiB; removed/added = {NUM}x; per row {NUM} MiB",
                      out, flags=re.M)
    assert len(rows) == 4, out  # t2va 50, t2va 8, fl2va 50, ref2va 50
    for steps, label, table, ratio, per_row in rows:
        fwd = int(steps) - 1  # Euler: the last step needs no forward
        assert f"{fwd} fwd" in label or "fwd" not in label, label
        m = int(_one(r"M=(\d)", label).group(1))
        assert abs(float(per_row) - H3_ROW_BYTES / 2**20) < 6e-4, per_row
        expect = fwd * m * H3_ROW_BYTES
        assert abs(float(table) - expect / 2**20) < 0.06, (label, table)
        assert abs(float(ratio) - H3_WEIGHT_BYTES / expect) < 0.06, (label, ratio)
    assert "B. skipped: set COMFYUI_PATH or --comfyui" in out
    m = _one(rf"^   projections {NUM} ms vs lookup {NUM} ms per forward \(ratio {NUM}\); weights {NUM} MiB vs table "
             rf"{NUM} MiB per entry", out)
    for g in m.groups():
        _pos(g)
    # 4 blocks of Linear(672 -> 6 * 1344 * 3 = 24192) in bf16, weight + bias
    assert abs(float(m.group(4)) - 4 * (24192 * 672 + 24192) * 2 / 2**20) < 0.06, m.group(0)


def test_bench_te_streaming_without_host():
    out = _run("bench_te_streaming.py", "--repeats", "1", "--comfyui", "").stdout
    heads = re.findall(rf"^   (.+): layer {NUM} MiB x (\d+) \+ embedding {NUM} GiB = {NUM} GiB resident without "
                       rf"streaming$", out, flags=re.M)
    assert [h[0] for h in heads] == ["H3 Qwen3-VL-32B (50 of 64 layers)", "LTX-2 Gemma 3 12B"], out
    peaks = re.findall(rf"^     prefetch (\d): peak device weights {NUM} MiB \({NUM}x less\), copied per prompt "
                       rf"{NUM} GiB", out, flags=re.M)
    assert len(peaks) == 4, out
    for (_, layer, n, emb, full), pair in zip(heads, (peaks[:2], peaks[2:])):
        layer, n, emb, full = _pos(layer), int(n), _pos(emb), _pos(full)
        assert abs(layer * n / 1024 + emb - full) < 0.02, (layer, n, emb, full)
        for p, peak, _less, copied in pair:
            assert abs(float(peak) - (int(p) + 1) * layer) < 1, (p, peak, layer)
            assert abs(float(copied) - layer * n / 1024) < 0.01, (copied, layer, n)
    assert "B. skipped: set COMFYUI_PATH or --comfyui" in out


def test_bench_vsa_cpu_reuse_smoke():
    """--reuse: recomputed vs reused per-call layout buffers, interleaved, outputs bit-identical (the script exits
    non-zero otherwise)."""
    out = _run("bench_vsa_cpu.py", "--reuse", "--small", "--heads", "1", "--rounds", "2",
               "--backends", "reference,auto").stdout
    rows = re.findall(rf"^\[(h3-t2va|h3-t2va \+gate|h3-tiny-host \+gate)\] S=\d+ backend\s+(\w+): recomputed per call\s+"
                      rf"{NUM} ms \| reused\s+{NUM} ms \| ratio median {NUM}x \(min {NUM}, max {NUM}, 2 ABAB rounds\) \| "
                      r"outputs bit-identical: (\w+)$", out, flags=re.M)
    assert len(rows) == 6, out
    for row in rows:
        assert row[1] in ("reference", "cpu_batched") and row[-1] == "True", row
        for g in row[2:-1]:
            _pos(g)
