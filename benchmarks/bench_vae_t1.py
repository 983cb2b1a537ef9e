"""H3 single-latent (T=1) decode: ditkit repeat-decode vs native, quality and memory, all in one run (CPU).

    COMFYUI_PATH=/work/ComfyUI nice -n 10 /work/ComfyUI/venv/bin/python benchmarks/bench_vae_t1.py [--sizes 384x320] [--rows FILE]

For each VAE (the tiny random video VAE; the quality lab's trained tiny VAE ``benchmarks/lab/weights/
h3lab_video_vae.safetensors`` when it exists) and a latent from encoding a procedural image:

* exactness: ditkit output == frame 0 of the NATIVE decode of the latent duplicated to T=2 (max abs diff);
* PSNR vs that oracle and vs the source image of (a) the native single-token decode (stock T=1 path) and
  (b) ditkit;
* peak live CPU tensor memory (torch profiler allocation/free events) of the tiled T=1 decode vs the native
  duplicated decode, and the floor "one-frame canvas + one raw tile" computed from the shapes.

With ``--rows FILE`` every figure is also written as a row (benchmarks/_harness.py).
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402


def psnr(a, b):
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def traced(fn):
    """(result, peak bytes of live CPU tensor memory allocated during fn, seconds) from the torch profiler's
    allocation/free events (self memory of every op + ``[memory]`` frees, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    dt = time.perf_counter() - t
    evs = sorted(prof.events(), key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in evs:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return out, peak, dt


def image(h, w):
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    img = torch.stack([0.5 + 0.4 * torch.sin(9 * xx + 3 * yy), 0.5 + 0.4 * torch.cos(7 * yy * xx + 1),
                       (xx + yy) / 2], dim=-1)
    return img.clamp(0, 1)[None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="384x320,768x640", help="HxW in pixels (multiples of 16), comma-separated; "
                                                                 ">256 gives several tiles")
    add_rows_argument(ap)
    a = ap.parse_args()
    rows = Rows(a.rows, "bench_vae_t1")
    comfy_path = os.environ.get("COMFYUI_PATH", "/work/ComfyUI")
    sys.path.insert(0, comfy_path)
    from comfy.cli_args import args

    args.cpu = True
    torch.set_num_threads(1)
    h3 = importlib.import_module("ditkit.nodes.h3_vae")
    from ditkit.tiny.checkpoints import generate_all

    out = Path(tempfile.mkdtemp(prefix="ditkit_bench_vae_t1_"))
    atexit.register(shutil.rmtree, out, True)
    generate_all(out, ["h3_video_vae_tiny"])
    files = [("tiny random", out / "vae" / "h3_video_vae_tiny.safetensors")]
    lab = REPO / "benchmarks" / "lab" / "weights" / "h3lab_video_vae.safetensors"
    if lab.is_file():
        lab_quality(h3, lab, rows)
        files.append(("lab-trained", lab))
    else:
        print(f"(lab VAE {lab} not present; measured on the tiny random VAE only)")
        rows.add("lab", "present", False, note=f"{lab} not present; measured on the tiny random VAE only")
    for label, path, (h, w) in [(lb, p, tuple(map(int, sz.split("x")))) for lb, p in files
                                for sz in a.sizes.split(",")]:
        src = image(h, w)
        vae, info = h3.load_h3_vae(str(path))
        m = vae.first_stage_model
        with torch.inference_mode():
            z = vae.encode(src)
            assert z.shape[2] == 1
            native_single = vae.decode(z)[:, 0]
            (ditkit, rep), peak_d, t_d = traced(lambda: h3.h3_decode(vae, z))
            native_dup, peak_n, t_n = traced(lambda: vae.decode(z.repeat(1, 1, 2, 1, 1)))
            r = m.vae_ratio
            zt = z[..., : m.tile_size // r, : m.tile_size // r].float()
            zt = (zt * m.latents_std.view(1, -1, 1, 1, 1) + m.latents_mean.view(1, -1, 1, 1, 1)).repeat(1, 1, 7, 1, 1)
            _, tile_peak, _ = traced(lambda: m._decode_pixels(zt))
        oracle = native_dup[:, 0]
        floor = tile_peak + rep["canvas_bytes"]  # one 7-token tile through the decoder + the one-frame canvas
        print(f"\n== {label}: {path.name} [{info['config']}], image {h}x{w}, latent {tuple(z.shape)}, "
              f"{rep['tiles']} tiles")
        print(f"exact: ditkit == native duplicated-latent frame 0: {torch.equal(ditkit, oracle)} "
              f"(max abs diff {(ditkit - oracle).abs().max().item():.3g})")
        print(f"PSNR vs duplicated-latent oracle: native single-token {psnr(native_single, oracle):.2f} dB, "
              f"ditkit {psnr(ditkit, oracle):.2f} dB")
        print(f"PSNR vs source image: native single-token {psnr(native_single, src):.2f} dB, "
              f"ditkit {psnr(ditkit, src):.2f} dB")
        print(f"peak CPU tensor memory: ditkit T=1 {peak_d / 2**20:.2f} MiB ({t_d:.2f}s), native duplicated decode "
              f"{peak_n / 2**20:.2f} MiB ({t_n:.2f}s), native/ditkit {peak_n / max(peak_d, 1):.2f}x; floor (one tile "
              f"decoder pass + one-frame canvas) {floor / 2**20:.2f} MiB -> ditkit/floor {peak_d / floor:.2f}x")
        print(f"ditkit canvas {rep['canvas_bytes'] / 2**20:.2f} MiB, largest raw tile {rep['max_tile_bytes'] / 2**20:.2f} MiB")
        case = f"{label} {h}x{w}"
        for metric, value, unit in (
                ("image_hw", [h, w], ""), ("latent_shape", list(z.shape), ""), ("tiles", rep["tiles"], ""),
                ("exact_vs_duplicated_oracle", torch.equal(ditkit, oracle), ""),
                ("max_abs_diff_vs_duplicated_oracle", (ditkit - oracle).abs().max().item(), ""),
                ("psnr_oracle_native_single", psnr(native_single, oracle), "dB"),
                ("psnr_oracle_ditkit", psnr(ditkit, oracle), "dB"),
                ("psnr_source_native_single", psnr(native_single, src), "dB"),
                ("psnr_source_ditkit", psnr(ditkit, src), "dB"),
                ("peak_cpu_tensor_ditkit", peak_d, "B"), ("peak_cpu_tensor_native_duplicated", peak_n, "B"),
                ("native_over_ditkit_memory", peak_n / max(peak_d, 1), "x"), ("floor", floor, "B"),
                ("ditkit_over_floor", peak_d / floor, "x"), ("canvas_bytes", rep["canvas_bytes"], "B"),
                ("max_tile_bytes", rep["max_tile_bytes"], "B"), ("time_ditkit", t_d, "s"),
                ("time_native_duplicated", t_n, "s")):
            rows.add(case, metric, value, unit)


def lab_quality(h3, path, rows, n=16):
    """The lab VAE on lab-distribution frames at its training size (64x96): round-trip PSNR vs the source."""
    from benchmarks.lab.lab_data import random_spec, render_video

    vae, info = h3.load_h3_vae(str(path))
    src = torch.stack([render_video(random_spec(1000 + i), 1, 64, 96)[:, 0] for i in range(n)])  # [n,3,H,W] [-1,1]
    img = ((src + 1) / 2).movedim(1, -1)
    with torch.inference_mode():
        z = torch.cat([vae.encode(img[i:i + 1]) for i in range(n)])
        native = vae.decode(z)[:, 0]
        ditkit, rep = h3.h3_decode(vae, z)
        oracle = vae.decode(z.repeat(1, 1, 2, 1, 1))[:, 0]
        # reference: the same frame encoded as a 5-frame static clip and decoded as video (trained geometry)
        clip = img.unsqueeze(1).expand(-1, 5, -1, -1, -1)
        vid = torch.stack([vae.decode(vae.encode(clip[i]))[0, 0] for i in range(n)])
    print(f"\n== lab-trained VAE on {n} lab frames 64x96 ({info['config']})")
    print(f"exact vs duplicated-latent oracle: {torch.equal(ditkit, oracle)}")
    print(f"round-trip PSNR vs source: native single-token {psnr(native, img):.2f} dB, ditkit {psnr(ditkit, img):.2f} dB, "
          f"5-frame static clip (video path) frame 0 {psnr(vid, img):.2f} dB")
    per = [(psnr(native[i], img[i]), psnr(ditkit[i], img[i])) for i in range(n)]
    print(f"per-image ditkit - native: min {min(b - a for a, b in per):+.2f} dB, "
          f"max {max(b - a for a, b in per):+.2f} dB, ditkit better on {sum(b > a for a, b in per)}/{n}")
    for metric, value, unit in (
            ("present", True, ""), ("frames", n, ""), ("exact_vs_duplicated_oracle", torch.equal(ditkit, oracle), ""),
            ("psnr_source_native_single", psnr(native, img), "dB"), ("psnr_source_ditkit", psnr(ditkit, img), "dB"),
            ("psnr_source_static_clip_frame0", psnr(vid, img), "dB"),
            ("per_image_ditkit_minus_native_min", min(b - a for a, b in per), "dB"),
            ("per_image_ditkit_minus_native_max", max(b - a for a, b in per), "dB"),
            ("ditkit_better_count", sum(b > a for a, b in per), "")):
        rows.add("lab", metric, value, unit)


if __name__ == "__main__":
    main()
