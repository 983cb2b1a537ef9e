"""DitKitSaveVideo (streaming chunked decode -> uint8 -> PyAV) vs native VAEDecode -> CreateVideo/SaveVideo.

    COMFYUI_PATH=/work/ComfyUI nice -n 10 /work/ComfyUI/venv/bin/python benchmarks/bench_vae_save_video.py \
        [--latent-t 52] [--hw 16x16] [--rows FILE]

Same tiny H3 video VAE, same latent, each path in a fresh subprocess (so peaks do not mix). Host memory = peak RSS
sampled every 2 ms minus the RSS after loading the VAE and a warm-up decode; wall time of decode + encode. Prints
the ratio to the uint8 size of the video (target <= 1.25x) and checks the two files' decoded frames agree within
1 LSB. With ``--rows FILE`` every figure is also written as a row (benchmarks/_harness.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import PeakRSS, Rows, add_rows_argument, rss_bytes as rss  # noqa: E402


def child(mode: str, t: int, hh: int, ww: int, out: str) -> dict:
    sys.path.insert(0, os.environ.get("COMFYUI_PATH", "/work/ComfyUI"))
    from comfy.cli_args import args

    args.cpu = True
    torch.set_num_threads(1)
    import importlib

    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    sv = importlib.import_module("ditkit.nodes.save_video")
    from comfy_api.latest import InputImpl, Types

    from ditkit.tiny.checkpoints import generate_all

    d = Path(out).parent      # the parent's private scratch folder
    generate_all(d, ["h3_video_vae_tiny"])
    vae, _ = h3.load_h3_vae(str(d / "vae" / "h3_video_vae_tiny.safetensors"))
    z = torch.randn(1, 24, t, hh, ww, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        vae.decode(z[:, :, :2])  # warm-up
    import gc

    gc.collect()
    base = rss()
    t0 = time.perf_counter()
    with PeakRSS() as pk, torch.inference_mode():  # ComfyUI executes nodes under inference mode
        if mode == "ditkit":
            data = sv.stream_save(vae, z, out, 24.0)
            frames, h, w = data["frames"], data["height"], data["width"]
        else:
            images = vae.decode(z).reshape(-1, hh * 16, ww * 16, 3)  # VAEDecode
            frames, h, w = images.shape[0], images.shape[1], images.shape[2]
            video = InputImpl.VideoFromComponents(Types.VideoComponents(images=images, audio=None, frame_rate=24))
            video.save_to(out, format=Types.VideoContainer.MP4, codec=Types.VideoCodec.H264)  # SaveVideo
    dt = time.perf_counter() - t0
    return {"mode": mode, "peak_extra": pk.peak - base, "seconds": dt, "frames": frames, "h": h, "w": w}


def decode_frames(path):
    import av
    import numpy as np

    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latent-t", type=int, default=52)
    ap.add_argument("--hw", default="16x16", help="latent HxW (pixels = 16x)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--out", default=None)
    add_rows_argument(ap)
    a = ap.parse_args()
    hh, ww = map(int, a.hw.split("x"))
    if a.child:
        print(json.dumps(child(a.child, a.latent_t, hh, ww, a.out)))
        return
    rows = Rows(a.rows, "bench_vae_save_video")
    res = {}
    work = tempfile.mkdtemp(prefix="ditkit_bench_vae_")   # private: concurrent runs never share files
    for mode in ("native", "ditkit"):
        out = os.path.join(work, f"{mode}.mp4")
        p = subprocess.run([sys.executable, __file__, "--child", mode, "--latent-t", str(a.latent_t), "--hw", a.hw,
                            "--out", out], capture_output=True, text=True, env=os.environ)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        res[mode]["file"] = out
    n, d = res["native"], res["ditkit"]
    u8 = n["frames"] * n["h"] * n["w"] * 3
    print(f"latent T={a.latent_t} {hh}x{ww} -> {n['frames']} frames {n['h']}x{n['w']}; uint8 video {u8 / 2**20:.1f} MiB, "
          f"float32 video {4 * u8 / 2**20:.1f} MiB")
    for metric, value in (("latent_t", a.latent_t), ("latent_hw", [hh, ww]), ("frames", n["frames"]),
                          ("height", n["h"]), ("width", n["w"]), ("uint8_bytes", u8)):
        rows.add("video", metric, value, "B" if metric == "uint8_bytes" else "")
    for r in (n, d):
        print(f"{r['mode']:>7}: peak extra host RSS {r['peak_extra'] / 2**20:7.1f} MiB = {r['peak_extra'] / u8:.2f}x uint8 "
              f"size, wall {r['seconds']:.1f}s")
        rows.add(r["mode"], "peak_extra_host_rss", r["peak_extra"], "B")
        rows.add(r["mode"], "peak_extra_over_uint8", r["peak_extra"] / u8, "x")
        rows.add(r["mode"], "wall", r["seconds"], "s", n=1)
        rows.add(r["mode"], "frames", r["frames"])
    print(f"ditkit/native: memory {d['peak_extra'] / max(n['peak_extra'], 1):.2f}x, time {d['seconds'] / n['seconds']:.2f}x")
    rows.add("ditkit/native", "memory_ratio", d["peak_extra"] / max(n["peak_extra"], 1), "x")
    rows.add("ditkit/native", "time_ratio", d["seconds"] / n["seconds"], "x", n=1)
    fa, fb = decode_frames(n["file"]), decode_frames(d["file"])
    diff = int(abs(fa.astype(int) - fb.astype(int)).max()) if fa.shape == fb.shape else None
    print(f"decoded MP4 frames: shapes {fa.shape} / {fb.shape}, max abs diff {diff} LSB")
    rows.add("decoded mp4", "native_shape", list(fa.shape))
    rows.add("decoded mp4", "ditkit_shape", list(fb.shape))
    rows.add("decoded mp4", "max_abs_diff", diff, "LSB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
