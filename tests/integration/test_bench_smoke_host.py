"""Smoke runs of the benchmark scripts that need ComfyUI (COMFYUI_PATH), on the tiny checkpoints.

The benchmarks produce the figures quoted in README.md; ``bench_teacache.py`` once crashed unnoticed (its own
smoke is ``test_bench_teacache_smoke.py``), so every other ComfyUI-side script runs here in a subprocess at its
smallest settings. Each test checks the exit code and something structural that a do-nothing run could not
print: the per-model rows, ratios that parse to positive finite numbers, and the quality / exactness figure each
script measures against its oracle (native ComfyUI output). No timing is asserted; no measured figure is
hard-coded. The ComfyUI-free parts of ``bench_adaln_cache.py`` / ``bench_te_streaming.py`` and the plain-torch
scripts are in ``tests/unit/test_bench_smoke.py``.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.bench_output import NUM, one as _one, positive as _pos

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
LAB_VAE = BENCH / "lab" / "weights" / "h3lab_video_vae.safetensors"


def _run(comfyui_path: Path, script: str, *args: str, timeout: float = 600) -> str:
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path))
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc.stdout




def test_bench_adaln_cache_smoke(comfyui_path):
    out = _run(comfyui_path, "bench_adaln_cache.py", "--steps", "2", "--repeats", "1")
    _one(r"^B\. tiny H3 on ComfyUI, CPU, 2 euler steps, median of 1$", out)
    for key in ("h3_dit", "h3_dit_curve"):
        m = _one(rf"^   {key}\s*: bit-identical=(\w+); per step uncached {NUM} ms, cached hot {NUM} ms \(ratio {NUM}\); "
                 rf"cold run {NUM} ms/step", out)
        assert m.group(1) == "True", f"{key}: cached sampling differs from uncached: {m.group(0)}"
        for g in m.groups()[1:]:
            _pos(g)
        # the stats line follows its model's line
        tail = out[m.end():]
        s = _one(rf"^\s+tables (\d+) B for (\d+) entries vs AdaLN weights (\d+) B \(removed/added {NUM}x; parked on "
                 rf"this CPU host: (\d+) B\); hits (\d+), misses (\d+), rebuilds (\d+), hot runs (\d+)", tail)
        table, entries, weights, ratio = int(s.group(1)), int(s.group(2)), int(s.group(3)), float(s.group(4))
        assert table > 0 and entries > 0 and weights > 0, s.group(0)
        assert abs(ratio - weights / table) < 0.06, s.group(0)
        assert int(s.group(6)) > 0, f"{key}: the cache was never hit: {s.group(0)}"
        assert int(s.group(9)) >= 1, s.group(0)
    m = _one(rf"^   projections {NUM} ms vs lookup {NUM} ms per forward \(ratio {NUM}\)", out)
    for g in m.groups():
        _pos(g)


def test_bench_te_streaming_smoke(comfyui_path):
    out = _run(comfyui_path, "bench_te_streaming.py", "--repeats", "1")
    _one(r"^B\. tiny encoders on ComfyUI, CPU, streaming forced \(cpu->cpu\), median of 1$", out)
    for key in ("h3_te", "ltx_te"):
        m = _one(rf"^   {key}: bit-equal=(\w+); encode plain {NUM} ms, streamed {NUM} ms \(ratio {NUM}\)", out)
        assert m.group(1) == "True", f"{key}: streamed encoder output differs: {m.group(0)}"
        for g in m.groups()[1:]:
            _pos(g)
        s = _one(rf"^\s+layers {NUM} MiB packed on host; peak streamed resident (\d+) B <= 2-layer bound (\d+) B: "
                 rf"(\w+); copied per prompt (\d+) B;", out[m.end():])
        peak, bound, copied = int(s.group(2)), int(s.group(3)), int(s.group(5))
        assert 0 < peak <= bound and s.group(4) == "True", s.group(0)
        # every layer crosses once per prompt: the copied bytes are the packed layers (MiB printed to 3 decimals)
        assert abs(copied / 2**20 - _pos(s.group(1))) < 0.002, s.group(0)


def test_bench_lokr_smoke(comfyui_path):
    out = _run(comfyui_path, "bench_lokr.py", "--hidden", "256", "--double", "1", "--single", "1", "--factor", "4")
    n = int(_one(r"^adapter: (\d+) modules, .* factor 4 \(h 256, 1\+1 blocks\)", out).group(1))
    assert n > 0
    m = _one(rf"^ditkit  parse\+map\+validate: {NUM} s, peak \+{NUM} MiB, (\d+) modules, (\d+) unused", out)
    assert int(m.group(3)) == n and int(m.group(4)) == 0, m.group(0)
    m = _one(rf"^native  load_lora:\s+{NUM} s, peak \+{NUM} MiB, (\d+) patches\s+\(time ratio ditkit/native {NUM}\)",
             out)
    assert int(m.group(3)) == n, f"native ComfyUI maps a different number of modules: {m.group(0)}"
    _pos(m.group(4))
    _one(rf"^ditkit  patch linear1 \[2304x256\]: {NUM} s", out)
    m = _one(rf"^native  patch linear1:\s+{NUM} s, .*\(time ratio ditkit/native {NUM}, peak ratio {NUM}\); "
             rf"max \|ditkit - native\| \(bf16\) = {NUM}$", out)
    _pos(m.group(2))
    _pos(m.group(3))
    diff = float(m.group(4))
    # base ~ randn (|w| < 8: a bf16 step is <= 1/16 there), delta scale 0.01: anything above one step is a real
    # disagreement with ComfyUI's own LoKr
    assert math.isfinite(diff) and 0 <= diff <= 0.0625, m.group(0)


def test_bench_vae_save_video_smoke(comfyui_path):
    out = _run(comfyui_path, "bench_vae_save_video.py", "--latent-t", "7", "--hw", "2x2")
    m = _one(rf"^latent T=7 2x2 -> (\d+) frames (\d+)x(\d+); uint8 video {NUM} MiB", out)
    frames, h, w = int(m.group(1)), int(m.group(2)), int(m.group(3))
    assert frames > 7 and (h, w) == (32, 32), m.group(0)  # pixels = 16x the latent grid; T expands in time
    for mode in ("native", "ditkit"):
        r = _one(rf"^\s*{mode}: peak extra host RSS\s+{NUM} MiB = {NUM}x uint8 size, wall {NUM}s", out)
        float(r.group(1))  # the RSS delta may be ~0 or negative on a tiny clip: only its presence is checked
    r = _one(rf"^ditkit/native: memory {NUM}x, time {NUM}x$", out)
    _pos(r.group(2))
    r = _one(r"^decoded MP4 frames: shapes \((\d+), (\d+), (\d+), 3\) / \((\d+), (\d+), (\d+), 3\), "
             r"max abs diff (\d+) LSB$", out)
    g = [int(x) for x in r.groups()]
    assert g[:3] == g[3:6] == [frames, h, w], r.group(0)
    assert g[6] <= 1, f"ditkit's MP4 differs from native SaveVideo's by more than 1 LSB: {r.group(0)}"


def test_bench_vae_t1_smoke(comfyui_path):
    # 64x288 -> latent width 18: two tiles, so the tiled T=1 path runs
    out = _run(comfyui_path, "bench_vae_t1.py", "--sizes", "64x288")
    sections = re.split(r"^(?===)", out, flags=re.M)
    runs = [s for s in sections if s.startswith("== tiny random") or s.startswith("== lab-trained:")]
    assert len(runs) == (2 if LAB_VAE.is_file() else 1), out
    for sec in runs:
        m = _one(r"image 64x288, latent \(1, 24, 1, (\d+), (\d+)\), (\d+) tiles", sec)
        assert int(m.group(3)) >= 2, m.group(0)
        e = _one(rf"^exact: ditkit == native duplicated-latent frame 0: (\w+) \(max abs diff {NUM}\)", sec)
        assert e.group(1) == "True" and float(e.group(2)) == 0, e.group(0)
        p = _one(rf"^PSNR vs duplicated-latent oracle: native single-token {NUM} dB, ditkit {NUM} dB", sec)
        assert math.isfinite(float(p.group(1))) and float(p.group(2)) == math.inf, p.group(0)
        p = _one(rf"^PSNR vs source image: native single-token {NUM} dB, ditkit {NUM} dB", sec)
        _pos(p.group(1))
        _pos(p.group(2))
        mem = _one(rf"^peak CPU tensor memory: ditkit T=1 {NUM} MiB .* native/ditkit {NUM}x; .* ditkit/floor {NUM}x",
                   sec)
        for g in mem.groups():
            _pos(g)
    if LAB_VAE.is_file():
        lab = _one(r"^== lab-trained VAE on (\d+) lab frames", out)
        tail = out[lab.end():]
        assert _one(r"^exact vs duplicated-latent oracle: (\w+)", tail).group(1) == "True"
        m = _one(rf"^round-trip PSNR vs source: native single-token {NUM} dB, ditkit {NUM} dB, 5-frame static clip "
                 rf"\(video path\) frame 0 {NUM} dB", tail)
        for g in m.groups():
            _pos(g)
        m = _one(r"ditkit better on (\d+)/(\d+)$", tail)
        assert int(m.group(2)) == int(lab.group(1)) and 0 <= int(m.group(1)) <= int(m.group(2)), m.group(0)
    else:
        assert "not present; measured on the tiny random VAE only" in out
