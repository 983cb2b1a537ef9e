"""Smoke runs of the benchmark scripts that need only torch + ditkit (no ComfyUI).

The benchmarks produce the figures quoted in README.md; a script that crashes or silently measures nothing would
go unnoticed, so each one runs here in a subprocess at its smallest settings. Every script writes its figures as
rows (``--rows FILE``, benchmarks/_harness.py) beside the human table it prints; each test checks the exit code
and reads the rows as data: rows present, ratios that are positive finite numbers, figures consistent with the
shapes the script states, the exactness figure against its float64 oracle. No timing is asserted and no figure
the script measures is hard-coded.

``bench_adaln_cache.py`` and ``bench_te_streaming.py`` run here without their ComfyUI part (B); the full runs
are in ``tests/integration/test_bench_smoke_host.py``. ``bench_vsa_gpu.py`` is checked for its refusal without CUDA
and through its documented ``--device cpu`` smoke mode (CPU timings; nothing here stands for a GPU figure).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks._harness import FIELDS, RowSet

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _run(tmp_path, script: str, *args: str, timeout: float = 300, expect_rc: int | None = 0, fmt: str = "jsonl"):
    """(completed process, rows) of one script run with ``--rows``."""
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}  # same behaviour whatever the caller set
    rows_path = tmp_path / f"{Path(script).stem}.{fmt}"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--rows", str(rows_path)], cwd=str(REPO),
                          env=env, capture_output=True, text=True, timeout=timeout)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, (f"{script} {' '.join(args)} exited {proc.returncode}:\n"
                                              f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = RowSet.read(rows_path) if rows_path.is_file() else RowSet([])
    assert all(r["bench"] == Path(script).stem for r in rows.rows), {r["bench"] for r in rows.rows}
    return proc, rows


def _ratio_row(rows, case, metric):
    """A per-round ratio row: positive median inside its min-max, rounds counted."""
    r = rows.row(case, metric)
    v = rows.positive(case, metric)
    assert r["n"] >= 1 and r["min"] <= v <= r["max"], r
    return v


def test_bench_h3_loader_smoke(tmp_path):
    # hidden 128 is the smallest width whose derived head_dim (20) fits the rope table the script derives; the
    # CSV writer is exercised here (the other smokes write JSON lines)
    proc, rows = _run(tmp_path, "bench_h3_loader.py", "--hidden", "128", "--layers", "1", "--shards", "2",
                      "--repeats", "1", fmt="csv")
    assert (tmp_path / "bench_h3_loader.csv").read_text().splitlines()[0] == ",".join(FIELDS)
    assert rows.value("checkpoint", "shards") == 2 and rows.positive("checkpoint", "tensor_bytes")
    for mode in ("lazy", "eager"):
        assert rows.positive(mode, "time") and rows.row(mode, "time")["n"] == 1
        assert rows.row(mode, "peak_rss_growth")["unit"] == "MiB"
    # both modes load the same state dict, the one the script wrote
    assert rows.value("lazy", "state_dict_bytes") == rows.value("eager", "state_dict_bytes") \
        == rows.value("checkpoint", "tensor_bytes")
    _ratio_row(rows, "eager/lazy", "time_ratio")
    _ratio_row(rows, "eager/lazy", "peak_rss_growth_ratio")
    assert rows.value("eager/lazy", "identical_output") is True
    assert "ratio eager/lazy" in proc.stdout  # the human table is still printed


def test_bench_vsa_cpu_small_smoke(tmp_path):
    backends = ("reference", "cpu_batched")  # "auto" resolves to cpu_batched on CPU
    proc, rows = _run(tmp_path, "bench_vsa_cpu.py", "--small", "--heads", "1", "--reps", "1",
                      "--backends", "reference,auto")
    for case in ("h3-t2va", "video-only", "prefix-heavy"):
        assert rows.value(case, "heads") == 1 and rows.value(case, "head_dim") == 128
        assert 0 < rows.value(case, "block_density") <= 1
        assert 0 < rows.value(case, "k_video") <= rows.value(case, "video_tiles")
        assert (rows.value(case, "prefix_tiles") == 0) == (case == "video-only")
        for b in backends:
            c = f"{case}/{b}"
            rows.positive(c, "dense_cpu_time")
            rows.positive(c, "sparse_cpu_time")
            _ratio_row(rows, c, "speedup_dense_over_sparse")
            err = rows.value(c, "max_err_vs_fp64_oracle")
            assert err < 1e-4, f"{c}: sparse output is not the exact masked attention ({err})"
            # keep 10 % is an approximation: it differs from dense, and the mean is at most the max
            assert 0 < rows.value(c, "mean_diff_vs_dense") <= rows.value(c, "max_diff_vs_dense"), c
    assert "RATIO dense/sparse" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present, so the refusal cannot happen")
def test_bench_vsa_gpu_refuses_without_cuda(tmp_path):
    proc, rows = _run(tmp_path, "bench_vsa_gpu.py", expect_rc=None)
    assert proc.returncode != 0, proc.stdout
    assert "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    assert not rows.rows and "RATIO" not in proc.stdout


def test_bench_vsa_gpu_cpu_smoke_mode(tmp_path):
    proc, rows = _run(tmp_path, "bench_vsa_gpu.py", "--device", "cpu", "--grid", "7,8,16", "--prefix", "300,37",
                      "--heads", "2", "--reps", "1", "--backend", "cpu_batched")
    assert rows.value("geometry", "prefix") == [300, 37] and rows.value("geometry", "grid") == [7, 8, 16]
    assert rows.value("geometry", "heads") == 2 and rows.value("geometry", "head_dim") == 128
    assert rows.value("geometry", "seq_len") == 300 + 37 + 7 * 8 * 16
    assert rows.value("backends", "cpu_batched") == "ok"
    for case in ("dense", "fine", "vsa"):
        rows.positive(case, "time")
    assert rows.value("fine", "backend") == "cpu_batched"
    assert 0 < rows.value("fine", "block_density") <= 1
    _ratio_row(rows, "dense/fine", "ratio")
    _ratio_row(rows, "dense/vsa", "ratio")
    err = rows.value("quality", "max_err_fine_vs_fp64_oracle")
    assert err < 1e-4, f"fine stage is not the exact masked attention: {err}"
    assert 0 < rows.value("quality", "mean_diff_vsa_vs_dense") <= rows.value("quality", "max_diff_vsa_vs_dense")
    assert "RATIO dense/fine" in proc.stdout


# H3's AdaLN projections as the script's docstring states them: 50 blocks x [96768, 2688] + final [10752, 2688],
# with biases, bf16 (2 bytes); one table row holds every block's output row.
H3_WEIGHT_BYTES = (50 * (96768 * 2688 + 96768) + 10752 * 2688 + 10752) * 2
H3_ROW_BYTES = (50 * 96768 + 10752) * 2


def test_bench_adaln_cache_without_host(tmp_path):
    proc, rows = _run(tmp_path, "bench_adaln_cache.py", "--repeats", "1", "--comfyui", "")
    assert rows.value("real_h3", "adaln_weight_bytes") == H3_WEIGHT_BYTES
    schedules = rows.cases("table_bytes")
    assert schedules == ["t2va_50", "t2va_8", "fl2va_50", "ref2va_50"], schedules
    for case in schedules:
        steps, fwd, m = (rows.value(case, k) for k in ("steps", "forwards", "modalities"))
        assert fwd == steps - 1, case  # Euler: the last step needs no forward
        assert rows.value(case, "table_bytes_per_row") == H3_ROW_BYTES
        assert rows.value(case, "table_bytes") == fwd * m * H3_ROW_BYTES, case
        assert math.isclose(rows.value(case, "removed_over_added"), H3_WEIGHT_BYTES / (fwd * m * H3_ROW_BYTES),
                            rel_tol=1e-9), case
    assert [rows.value(c, "modalities") for c in schedules] == [2, 2, 3, 4]
    assert rows.value("B", "skipped") is True
    assert not rows.all("h3_dit")
    rows.positive("synthetic", "projections")
    rows.positive("synthetic", "lookup")
    _ratio_row(rows, "synthetic", "lookup_over_projections")
    # 4 blocks of Linear(672 -> 6 * 1344 * 3 = 24192) in bf16, weight + bias
    assert rows.value("synthetic", "weight_bytes") == 4 * (24192 * 672 + 24192) * 2
    assert "B. skipped" in proc.stdout


def test_bench_te_streaming_without_host(tmp_path):
    proc, rows = _run(tmp_path, "bench_te_streaming.py", "--repeats", "1", "--comfyui", "")
    names = rows.cases("layer_bytes")
    assert names == ["H3 Qwen3-VL-32B (50 of 64 layers)", "LTX-2 Gemma 3 12B"], names
    for name in names:
        layer, n, emb = (rows.value(name, k) for k in ("layer_bytes", "layers", "embedding_bytes"))
        assert layer > 0 and n > 0 and emb > 0
        assert rows.value(name, "resident_bytes_without_streaming") == layer * n + emb
        for p in (1, 2):
            c = f"{name}/prefetch {p}"
            assert rows.value(c, "peak_device_weight_bytes") == (p + 1) * layer  # p prefetched + the running one
            assert rows.value(c, "copied_bytes_per_prompt") == layer * n  # every layer crosses once per prompt
    assert rows.value("B", "skipped") is True
    assert "B. skipped" in proc.stdout


def test_bench_vsa_cpu_reuse_smoke(tmp_path):
    """--reuse: recomputed vs reused per-call layout buffers, interleaved, outputs bit-identical (the script exits
    non-zero otherwise)."""
    proc, rows = _run(tmp_path, "bench_vsa_cpu.py", "--reuse", "--small", "--heads", "1", "--rounds", "2",
                      "--backends", "reference,auto")
    cases = rows.cases("ratio_recomputed_over_reused")
    assert len(cases) == 6, cases
    for case in cases:
        name, backend = case.rsplit("/", 1)
        assert name in ("h3-t2va", "h3-t2va +gate", "h3-tiny-host +gate") and backend in ("reference", "cpu_batched")
        assert rows.value(case, "bit_identical") is True
        _ratio_row(rows, case, "ratio_recomputed_over_reused")
        rows.positive(case, "recomputed_ms"), rows.positive(case, "reused_ms")
    assert "outputs bit-identical: True" in proc.stdout


def test_bench_vsa_overhead_smoke(tmp_path):
    # HEAD as the old side: the comparison machinery runs wherever the checkout has git history
    proc, rows = _run(tmp_path, "bench_vsa_overhead.py", "--old-ref", "HEAD", "--reps", "1", "--calls", "2",
                      "--dispatch-calls", "50")
    assert rows.value("setup", "max_abs_diff") == 0.0      # both sides compute the same numbers
    for case in ("override", "dispatch"):
        rows.positive(case, "old_us")
        rows.positive(case, "new_us")
        _ratio_row(rows, case, "old_over_new")


def test_bench_quant_triton_cpu_smoke(tmp_path):
    """The device-quantize benchmark through its --device cpu smoke mode (Triton interpreter): a row per figure,
    the bits equal for every format; its refusal without CUDA."""
    pytest.importorskip("triton")
    proc, rows = _run(tmp_path, "bench_quant_triton.py", "--device", "cpu", "--shape", "40,96", "--reps", "2")
    for fmt in ("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"):
        case = f"40x96 bfloat16 on cpu {fmt}"
        assert rows.value(case, "bits_equal") is True
        r = rows.row(case, "reference_over_triton")
        assert r["n"] == 2 and 0 < r["min"] <= r["value"] <= r["max"] and math.isfinite(r["max"])
    assert "stand for nothing" in proc.stdout
    if not torch.cuda.is_available():
        proc, _ = _run(tmp_path, "bench_quant_triton.py", expect_rc=None)
        assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
    proc, _ = _run(tmp_path, "bench_quant_triton.py", "--device", "cpu", "--shape", "4", expect_rc=None)
    assert proc.returncode != 0 and "--shape" in proc.stderr


@pytest.mark.parametrize("fmt,mode", [("nvfp4", "quantize"), ("mxfp8", "rows")])
def test_bench_quant_cpu_smoke(tmp_path, fmt, mode):
    """The CPU block-quantize benchmark (OLD kept in the script vs NEW kernels/quant.py): a row per figure, the
    bits equal at every thread count, ratios positive inside their min-max; its refusal of a shape off the block."""
    proc, rows = _run(tmp_path, "bench_quant_cpu.py", "--format", fmt, "--mode", mode, "--shape", "130,64",
                      "--rounds", "2", "--threads", "1,2")
    for nt in (1, 2):
        case = f"130x64 bfloat16 {fmt} {mode} threads={nt}"
        assert rows.value(case, "bits_equal") is True
        for metric in ("old_over_new_wall", "old_over_new_cpu", "new_over_stock_wall"):
            r = rows.row(case, metric)
            assert r["n"] == 2 and 0 < r["min"] <= r["value"] <= r["max"] and math.isfinite(r["max"])
    assert str(REPO / "kernels" / "quant.py") in proc.stdout           # what was measured as NEW is named
    proc, _ = _run(tmp_path, "bench_quant_cpu.py", "--format", "mxfp8", "--shape", "4,48", expect_rc=None)
    assert proc.returncode != 0 and "multiple of the block" in proc.stderr
