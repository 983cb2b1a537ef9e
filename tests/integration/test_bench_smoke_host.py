"""Smoke runs of the benchmark scripts that need ComfyUI (COMFYUI_PATH), on the tiny checkpoints.

The benchmarks produce the figures quoted in README.md; ``bench_teacache.py`` once crashed unnoticed (its own
smoke is ``test_bench_teacache_smoke.py``), so every other ComfyUI-side script runs here in a subprocess at its
smallest settings. Each script writes its figures as rows (``--rows FILE``, benchmarks/_harness.py) beside its
printed table; each test checks the exit code and reads the rows: the per-model rows, ratios that are positive
finite numbers, and the quality / exactness figure each script measures against its oracle (native ComfyUI
output). No timing is asserted; no measured figure is hard-coded. The ComfyUI-free parts of
``bench_adaln_cache.py`` / ``bench_te_streaming.py`` and the plain-torch scripts are in
``tests/unit/test_bench_smoke.py``.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from benchmarks._harness import RowSet

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
LAB_VAE = BENCH / "lab" / "weights" / "h3lab_video_vae.safetensors"


def _run(comfyui_path: Path, tmp_path: Path, script: str, *args: str, timeout: float = 600):
    """(stdout, rows) of one script run with ``--rows``."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    rows_path = tmp_path / f"{Path(script).stem}.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--rows", str(rows_path)], cwd=str(REPO),
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc.stdout, RowSet.read(rows_path)


def _ratio_row(rows, case, metric):
    r = rows.row(case, metric)
    v = rows.positive(case, metric)
    assert r["n"] >= 1 and r["min"] <= v <= r["max"], r
    return v


def test_bench_adaln_cache_smoke(comfyui_path, tmp_path):
    out, rows = _run(comfyui_path, tmp_path, "bench_adaln_cache.py", "--steps", "2", "--repeats", "1")
    for key in ("h3_dit", "h3_dit_curve"):
        assert rows.value(key, "steps") == 2
        assert rows.value(key, "bit_identical") is True, f"{key}: cached sampling differs from uncached"
        for metric in ("uncached_per_step", "cached_hot_per_step", "cold_per_step"):
            rows.positive(key, metric)
        _ratio_row(rows, key, "cached_over_uncached")
        for metric in ("table_bytes", "entries", "weight_bytes"):
            assert rows.value(key, metric) > 0, (key, metric)
        assert rows.value(key, "hits") > 0, f"{key}: the cache was never hit"
        assert rows.value(key, "hot_runs") >= 1
    rows.positive("synthetic", "projections")
    rows.positive("synthetic", "lookup")
    _ratio_row(rows, "synthetic", "lookup_over_projections")
    assert "B. tiny H3 on ComfyUI" in out


def test_bench_te_streaming_smoke(comfyui_path, tmp_path):
    out, rows = _run(comfyui_path, tmp_path, "bench_te_streaming.py", "--repeats", "1")
    for key in ("h3_te", "ltx_te"):
        assert rows.value(key, "bit_equal") is True, f"{key}: streamed encoder output differs"
        rows.positive(key, "encode_plain")
        rows.positive(key, "encode_streamed")
        _ratio_row(rows, key, "streamed_over_plain")
        peak, bound = rows.value(key, "peak_streamed_resident_bytes"), rows.value(key, "two_layer_bound_bytes")
        assert 0 < peak <= bound, (key, peak, bound)
        # every layer crosses once per prompt: the copied bytes are the packed layers
        copied, packed = rows.value(key, "copied_bytes_per_prompt"), rows.positive(key, "layers_host_bytes")
        assert abs(copied - packed) <= 0.002 * 2**20, (key, copied, packed)
    assert "B. tiny encoders on ComfyUI" in out


def test_bench_lokr_smoke(comfyui_path, tmp_path):
    out, rows = _run(comfyui_path, tmp_path, "bench_lokr.py", "--hidden", "256", "--double", "1", "--single", "1",
                     "--factor", "4")
    assert [rows.value("adapter", k) for k in ("factor", "hidden", "double_blocks", "single_blocks")] == [4, 256, 1, 1]
    n = rows.value("adapter", "modules")
    assert n > 0
    assert rows.value("ditkit plan", "modules") == n and rows.value("ditkit plan", "unused") == 0
    assert rows.value("native load_lora", "modules") == n, "native ComfyUI maps a different number of modules"
    rows.positive("ditkit/native load", "time_ratio")
    assert rows.value("ditkit patch linear1", "shape") == [9 * 256, 256]
    rows.positive("ditkit/native patch", "time_ratio")
    rows.positive("ditkit/native patch", "peak_ratio")
    diff = rows.value("ditkit/native patch", "max_abs_diff_bf16")
    # base ~ randn (|w| < 8: a bf16 step is <= 1/16 there), delta scale 0.01: anything above one step is a real
    # disagreement with ComfyUI's own LoKr
    assert math.isfinite(diff) and 0 <= diff <= 0.0625, diff
    assert "native  patch linear1" in out


def test_bench_vae_save_video_smoke(comfyui_path, tmp_path):
    out, rows = _run(comfyui_path, tmp_path, "bench_vae_save_video.py", "--latent-t", "7", "--hw", "2x2")
    assert rows.value("video", "latent_t") == 7 and rows.value("video", "latent_hw") == [2, 2]
    frames, h, w = (rows.value("video", k) for k in ("frames", "height", "width"))
    assert frames > 7 and (h, w) == (32, 32)  # pixels = 16x the latent grid; T expands in time
    assert rows.value("video", "uint8_bytes") == frames * h * w * 3
    for mode in ("native", "ditkit"):
        assert rows.value(mode, "frames") == frames
        # the RSS delta may be ~0 or negative on a tiny clip: only its presence is checked
        assert isinstance(rows.value(mode, "peak_extra_host_rss"), int)
        rows.positive(mode, "wall")
    rows.positive("ditkit/native", "time_ratio")
    assert rows.value("decoded mp4", "native_shape") == rows.value("decoded mp4", "ditkit_shape") == [frames, h, w, 3]
    diff = rows.value("decoded mp4", "max_abs_diff")
    assert diff <= 1, f"ditkit's MP4 differs from native SaveVideo's by more than 1 LSB: {diff}"
    assert "decoded MP4 frames" in out


def test_bench_vae_t1_smoke(comfyui_path, tmp_path):
    # 64x288 -> latent width 18: two tiles, so the tiled T=1 path runs
    out, rows = _run(comfyui_path, tmp_path, "bench_vae_t1.py", "--sizes", "64x288")
    cases = rows.cases("tiles")
    assert cases == ["tiny random 64x288"] + (["lab-trained 64x288"] if LAB_VAE.is_file() else []), cases
    for c in cases:
        assert rows.value(c, "image_hw") == [64, 288] and rows.value(c, "tiles") >= 2
        assert rows.value(c, "latent_shape")[:3] == [1, 24, 1]
        assert rows.value(c, "exact_vs_duplicated_oracle") is True and rows.value(c, "max_abs_diff_vs_duplicated_oracle") == 0
        assert math.isfinite(rows.value(c, "psnr_oracle_native_single"))
        assert rows.value(c, "psnr_oracle_ditkit") == math.inf
        rows.positive(c, "psnr_source_native_single")
        rows.positive(c, "psnr_source_ditkit")
        for metric in ("peak_cpu_tensor_ditkit", "native_over_ditkit_memory", "ditkit_over_floor"):
            rows.positive(c, metric)
    if LAB_VAE.is_file():
        assert rows.value("lab", "present") is True and rows.value("lab", "exact_vs_duplicated_oracle") is True
        for metric in ("psnr_source_native_single", "psnr_source_ditkit", "psnr_source_static_clip_frame0"):
            rows.positive("lab", metric)
        assert 0 <= rows.value("lab", "ditkit_better_count") <= rows.value("lab", "frames")
    else:
        assert rows.value("lab", "present") is False
    assert "PSNR vs source image" in out


def test_bench_h3_modulation_memo_smoke(comfyui_path, tmp_path):
    _, rows = _run(comfyui_path, tmp_path, "bench_h3_modulation_memo.py", "--rounds", "2", "--steps", "2")
    rows.positive("tiny_fasth3", "memo_s_per_step")
    rows.positive("tiny_fasth3", "no_memo_s_per_step")
    _ratio_row(rows, "tiny_fasth3", "no_memo_over_memo")
    assert rows.value("tiny_fasth3", "max_abs_diff") == 0.0, "the memo changed the sampling output"


def test_bench_quantize_rss_smoke(comfyui_path, tmp_path):
    """Peak-RSS rows of the quantize-while-loading paths on the tiny H3 (one round): every path has its peak,
    resident bytes, target and ratio to the stock path as rows; at this size (0.6 MiB) page-level noise decides
    whether a target is met, so only the row types are checked (the figures come from the scaled-up run)."""
    out, rows = _run(comfyui_path, tmp_path, "bench_quantize.py", "--quick", timeout=1200)
    modes = ["stock", "float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4", "convert:float8_e4m3fn"]
    assert rows.cases("peak_rss_growth") == [f"tiny/{m}" for m in modes]
    assert rows.positive("tiny", "source_bytes") > rows.positive("tiny", "two_largest_bytes")
    for m in modes:
        key = f"tiny/{m}"
        rows.positive(key, "peak_rss_growth")
        assert rows.value(key, "target_bytes") == rows.value(key, "resident_bytes") + rows.value("tiny",
                                                                                                   "two_largest_bytes")
        assert isinstance(rows.value(key, "target_met"), bool)
        _ratio_row(rows, key, "peak_over_stock")
        assert rows.row(key, "load_seconds")["n"] == 1
    assert rows.value("tiny/convert:float8_e4m3fn", "resident_bytes") == 0
    assert rows.value("tiny/stock", "resident_bytes") > 0
    assert "## peak RSS of loading" in out
