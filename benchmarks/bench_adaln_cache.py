"""H3 AdaLN schedule cache: sizes for the real model (from shapes) and measured costs on CPU.

    COMFYUI_PATH=/work/ComfyUI /work/ComfyUI/venv/bin/python benchmarks/bench_adaln_cache.py [--steps 8] [--repeats 5]
        [--rows FILE]

A. Real H3 (50 blocks x [96768, 2688] + final [10752, 2688], bf16), computed from shapes: device bytes the AdaLN
   weights occupy (removed while tables are installed) vs table bytes added, per schedule.
B. Tiny H3 in-process on ComfyUI (CPU): sampling time per step uncached vs cached (hot), cold (build) cost,
   bit-equality of the outputs, measured table bytes / weight bytes.
C. Scaled synthetic AdaLN stack in plain torch (1/4 of H3's widths, 4 blocks, bf16): time of the projections a
   forward runs vs the table lookup that replaces them.

Timings interleave uncached and cached runs (ABAB; median of ``--repeats`` rounds, ratio per round with its
min-max). With ``--rows FILE`` every figure is also written as a row (benchmarks/_harness.py).

All numbers are CPU-only measurements from one run (no GPU was available when this was written); GPU effects
(weights leaving VRAM, no 26 GB/step of AdaLN weight reads) are the shape-computed part A.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument, interleave, ratio_stats, spread, stats  # noqa: E402

# part A's schedules: (row case, printed label, steps, forwards, modalities M)
SCHEDULES = (("t2va_50", "t2va 50 steps (49 fwd, M=2)", 50, 49, 2), ("t2va_8", "t2va 8 steps (7 fwd, M=2)", 8, 7, 2),
             ("fl2va_50", "fl2va 50 steps (M=3)", 50, 49, 3), ("ref2va_50", "ref2va 50 steps (M=4)", 50, 49, 4))


def part_a(rows):
    from ditkit.cache.adaln import h3_adaln_sizes

    print("A. real H3 AdaLN, from shapes (bf16)")
    w = h3_adaln_sizes(1)["weight_bytes"]
    print(f"   AdaLN weights (50 blocks + final): {w / 2**30:.2f} GiB -> leave the device while tables are installed")
    print(f"   uncached: every forward reads {w / 2**30:.2f} GiB of AdaLN weights to produce a few rows")
    rows.add("real_h3", "adaln_weight_bytes", w, "B", note="50 blocks + final, bf16")
    for case, name, steps, forwards, m in SCHEDULES:
        s = h3_adaln_sizes(forwards * m)
        print(f"   {name:30s}: tables {s['table_bytes'] / 2**20:8.1f} MiB; removed/added = "
              f"{s['ratio_removed_over_added']:.1f}x; per row {s['table_bytes_per_row'] / 2**20:.3f} MiB")
        for metric, value, unit in (("steps", steps, ""), ("forwards", forwards, ""), ("modalities", m, ""),
                                    ("table_bytes", s["table_bytes"], "B"),
                                    ("removed_over_added", s["ratio_removed_over_added"], "x"),
                                    ("table_bytes_per_row", s["table_bytes_per_row"], "B")):
            rows.add(case, metric, value, unit)


def _sample(comfy_sample, model, steps, latent_fn, seed=1):
    latent, _ = latent_fn(64, 64, 22)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 6, 48, generator=g)
    lat = latent["samples"]
    noise = comfy_sample.prepare_noise(lat, seed)
    return comfy_sample.sample(model, noise, steps, 1.0, "euler", "simple", [[ctx, {}]], [[ctx, {}]], lat,
                               seed=seed, disable_pbar=True)


def part_b(comfyui: str, steps: int, repeats: int, rows):
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.sample
    import comfy.sd
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent

    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache
    from ditkit.tiny.checkpoints import generate_all

    print(f"B. tiny H3 on ComfyUI, CPU, {steps} euler steps, median of {repeats}")
    with tempfile.TemporaryDirectory() as d:
        out = generate_all(d, only=["h3_dit", "h3_dit_curve"])
        for key in ("h3_dit", "h3_dit_curve"):
            model = comfy.sd.load_diffusion_model(str(out[key][0]))
            ref = _sample(comfy.sample, model, steps, _empty_av_latent)
            res = DitKitH3AdaLNCache.execute(model, True)
            cached = res.args[0] if hasattr(res, "args") else res.result[0]
            cache = next(v for v in cached.object_patches.values() if hasattr(v, "_cache"))._cache
            t0 = time.perf_counter()
            got = _sample(comfy.sample, cached, steps, _empty_av_latent)
            cold = time.perf_counter() - t0
            equal = all(torch.equal(a, b) for a, b in zip(ref.unbind(), got.unbind()))
            t = interleave({"uncached": lambda: _sample(comfy.sample, model, steps, _empty_av_latent),
                            "cached": lambda: _sample(comfy.sample, cached, steps, _empty_av_latent)},
                           repeats, warmup=0)
            mu, mc = statistics.median(t["uncached"]), statistics.median(t["cached"])
            r = ratio_stats(t["cached"], t["uncached"])
            s = cache.stats
            print(f"   {key:14s}: bit-identical={equal}; per step uncached {mu / steps * 1e3:.2f} ms, cached hot "
                  f"{mc / steps * 1e3:.2f} ms (ratio {r['median']:.3f} {spread(r)}); cold run "
                  f"{cold / steps * 1e3:.2f} ms/step (build {s.build_seconds * 1e3:.2f} ms, cold/hot {cold / mc:.2f}x)")
            rows.add(key, "steps", steps)
            rows.add(key, "bit_identical", equal)
            rows.add_stats(key, "uncached_per_step", stats(t["uncached"]), "ms", scale=1e3 / steps)
            rows.add_stats(key, "cached_hot_per_step", stats(t["cached"]), "ms", scale=1e3 / steps)
            rows.add_stats(key, "cached_over_uncached", r, "x")
            rows.add(key, "cold_per_step", cold / steps * 1e3, "ms")
            rows.add(key, "build", s.build_seconds * 1e3, "ms")
            for metric, value, unit in (("table_bytes", s.table_bytes, "B"), ("entries", s.entries, ""),
                                        ("weight_bytes", s.weight_bytes_total, "B"),
                                        ("weight_bytes_parked", s.weight_bytes_parked, "B"), ("hits", s.hits, ""),
                                        ("misses", s.misses, ""), ("rebuilds", s.rebuilds, ""),
                                        ("hot_runs", s.hot_runs, "")):
                rows.add(key, metric, value, unit)
            print(f"   {'':14s}  tables {s.table_bytes} B for {s.entries} entries vs AdaLN weights "
                  f"{s.weight_bytes_total} B (removed/added {s.weight_bytes_total / max(s.table_bytes, 1):.1f}x; "
                  f"parked on this CPU host: {s.weight_bytes_parked} B); hits {s.hits}, misses {s.misses}, "
                  f"rebuilds {s.rebuilds}, hot runs {s.hot_runs}")


def part_c(repeats: int, rows):
    from ditkit.cache.adaln import AdalnScheduleCache

    print("C. scaled synthetic AdaLN stack (4 blocks, [24192, 672] bf16 each = H3 widths / 4), CPU")

    class Proj(torch.nn.Module):
        def __init__(self, t_dim, hidden, expand, mods):
            super().__init__()
            self.expand, self.modalities, self.hidden, self.apply_silu = expand, mods, hidden, True
            self.linear = torch.nn.Linear(t_dim, expand * hidden * mods).to(torch.bfloat16)

    torch.manual_seed(0)
    projs = [Proj(672, 1344, 6, 3) for _ in range(4)]
    cache = AdalnScheduleCache()
    wrapped = [cache.wrap(p, f"b{i}") for i, p in enumerate(projs)]
    t_emb = torch.randn(2, 672).to(torch.bfloat16)
    cache.build(("s",), [t_emb])
    with torch.no_grad():
        def uncached():
            for p in projs:
                x = p.linear(torch.nn.functional.silu(t_emb))
                x.view(x.shape[0] * 3, 6 * 1344).chunk(6, dim=-1)

        def cached():
            live = t_emb.clone()
            for w in wrapped:
                w(live)

        t = interleave({"projections": uncached, "lookup": cached}, max(repeats, 5), warmup=1)
    mu, mc = statistics.median(t["projections"]), statistics.median(t["lookup"])
    r = ratio_stats(t["lookup"], t["projections"])
    wb = sum(p.linear.weight.numel() * 2 + p.linear.bias.numel() * 2 for p in projs)
    print(f"   projections {mu * 1e3:.3f} ms vs lookup {mc * 1e3:.3f} ms per forward (ratio {r['median']:.4f}); "
          f"weights {wb / 2**20:.1f} MiB vs table {cache.stats.table_bytes / 2**20:.3f} MiB per entry "
          f"{spread(r)}")
    rows.add_stats("synthetic", "projections", stats(t["projections"]), "ms", scale=1e3)
    rows.add_stats("synthetic", "lookup", stats(t["lookup"]), "ms", scale=1e3)
    rows.add_stats("synthetic", "lookup_over_projections", r, "x")
    rows.add("synthetic", "weight_bytes", wb, "B")
    rows.add("synthetic", "table_bytes_per_entry", cache.stats.table_bytes, "B")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"))
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    rows = Rows(a.rows, "bench_adaln_cache")
    torch.set_num_threads(1)
    part_a(rows)
    if a.comfyui:
        part_b(a.comfyui, a.steps, a.repeats, rows)
    else:
        print("B. skipped: set COMFYUI_PATH or --comfyui")
        rows.add("B", "skipped", True, note="set COMFYUI_PATH or --comfyui")
    part_c(a.repeats, rows)


if __name__ == "__main__":
    main()
