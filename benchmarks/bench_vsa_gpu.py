"""GPU (H200 target): VSA-H3 fine stage vs dense SDPA-flash at H3's 5 s geometry (~38k packed tokens).

    python benchmarks/bench_vsa_gpu.py [--heads 56] [--keep 0.1] [--dtype bfloat16] [--backend triton] [--reps 20]
                                       [--rows FILE]

Geometry: text 300 + audio 414 prefix rows, video grid (37, 24, 42) (1344x768, 124 frames) = 38,010 rows,
672 tiles (12 prefix + 660 video). Dense, fine stage and whole call are timed interleaved (dense, fine, VSA-H3,
dense, ...; CUDA events, median of ``--reps`` rounds after a warm-up). Prints, from one run (and with ``--rows FILE``
writes as rows, benchmarks/_harness.py):

* dense SDPA (FLASH backend) time and TFLOP/s (4*S^2*D*H),
* the fine stage alone (block-sparse kernel on precomputed index lists): time, TFLOP/s of the work it does
  (4*64*64*D per selected tile pair, padded tiles included) and dense-equivalent TFLOP/s,
* the whole VSA-H3 call (pack, pooled scores, top-k, fine, unpack) time,
* ratios dense / fine and dense / VSA-H3 (targets: fine >= 7x, fine work rate >= 400 TFLOP/s),
* quality on the same inputs: max |fine - fp64 masked oracle| on sampled query tiles, and max/mean
  |VSA-H3 - dense| (the sparse approximation, random inputs).

Not run by the author (no GPU was available); the CPU twin is bench_vsa_cpu.py.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import Rows, Timer, add_rows_argument, interleave, ratio_stats, spread  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--keep", type=float, default=0.10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--grid", default="37,24,42")
    ap.add_argument("--prefix", default="300,414")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run of this script (small --grid)")
    add_rows_argument(ap)
    a = ap.parse_args()
    table = Rows(a.rows, "bench_vsa_gpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --device cpu for a smoke run)")
    from ditkit.kernels import REGISTRY, build_h3_layout, select_h3, vsa_h3_attention
    from ditkit.kernels.vsa import block_sparse_attn, pool_tiles, resolve_aux

    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if dev.type == "cuda" else torch.float32
    grid = tuple(int(x) for x in a.grid.split(","))
    prefix = tuple(int(x) for x in a.prefix.split(",") if x)
    lay = build_h3_layout(prefix, grid)
    S, D, H = lay.seq_len, 128, a.heads
    if dev.type == "cuda":
        print(f"device {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()} torch {torch.__version__}")
    print(f"geometry: {lay.describe()}; heads {H}, head_dim {D}, {str(dtype).replace('torch.', '')}, keep {a.keep:g} -> k={lay.topk(a.keep)}")
    explained = REGISTRY.explain("block_sparse_attn", dev, dtype, D)
    print("backends:", explained)
    for metric, value in (("seq_len", S), ("heads", H), ("head_dim", D), ("keep", a.keep), ("k", lay.topk(a.keep)),
                          ("prefix", list(prefix)), ("grid", list(grid)), ("dtype", str(dtype).replace("torch.", "")),
                          ("device", dev.type)):
        table.add("geometry", metric, value)
    for name, state in explained.items():
        table.add("backends", name, str(state))
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device=dev, dtype=dtype, generator=g) for _ in range(3))

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    dense_flops = 4 * S * S * D * H

    lay_d = lay.to(dev)
    pk = resolve_aux("vsa_pack", q, a.backend)
    qt, kt, vt = (pk.fn(x, lay_d.tile_src) for x in (q, k, v))
    sc = pool_tiles(qt, lay_d.sizes) @ pool_tiles(kt, lay_d.sizes).transpose(-1, -2) / math.sqrt(D)
    idx, num = select_h3(sc, lay.num_prefix_tiles, lay.num_video_tiles, lay.topk(a.keep))
    out: dict = {}
    times = interleave({"dense": dense,
                    "fine": lambda: block_sparse_attn(qt, kt, vt, idx, num, lay_d.sizes, backend=a.backend),
                    "vsa": lambda: vsa_h3_attention(q, k, v, lay, a.keep, backend=a.backend)},
                       a.reps, warmup=3 if dev.type == "cuda" else 1, timer=Timer(dev), keep=out)
    o_dense, (o_fine, _), (o_vsa, st) = out["dense"], out["fine"], out["vsa"]
    t_dense, t_fine, t_vsa = (statistics.median(times[k]) for k in ("dense", "fine", "vsa"))
    r_fine, r_vsa = ratio_stats(times["dense"], times["fine"]), ratio_stats(times["dense"], times["vsa"])
    pairs = int(num.long().sum())
    fine_flops = 4 * 64 * 64 * D * pairs

    # exactness on sampled query tiles (fp64 attention over exactly the selected, live key rows)
    live = torch.arange(64, device=dev)[None] < lay_d.sizes[:, None]
    err = 0.0
    for t in torch.randint(0, lay.n_tiles, (6,), generator=torch.Generator().manual_seed(1)).tolist():
        for h in (0, H // 2, H - 1):
            sel = idx[0, h, t, : int(num[0, h, t])].long()
            rows = (sel[:, None] * 64 + torch.arange(64, device=dev)).reshape(-1)[live[sel].reshape(-1)]
            qr = qt[0, h, t * 64: t * 64 + int(lay_d.sizes[t])].double()
            ref = F.scaled_dot_product_attention(qr[None], kt[0, h, rows].double()[None], vt[0, h, rows].double()[None])[0]
            err = max(err, float((o_fine[0, h, t * 64: t * 64 + int(lay_d.sizes[t])].double() - ref).abs().max()))
    diff = (o_vsa.float() - o_dense.float()).abs()

    print(f"dense SDPA-flash : {t_dense * 1e3:8.3f} ms  {dense_flops / t_dense / 1e12:7.1f} TFLOP/s")
    print(f"fine stage ({st.backend:9s}): {t_fine * 1e3:8.3f} ms  work {fine_flops / t_fine / 1e12:7.1f} TFLOP/s, "
          f"dense-equivalent {dense_flops / t_fine / 1e12:7.1f} TFLOP/s, block density {pairs / (H * lay.n_tiles ** 2):.3f}")
    print(f"VSA-H3 whole call: {t_vsa * 1e3:8.3f} ms")
    print(f"RATIO dense/fine {r_fine['median']:.2f}x (target >= 7x), dense/VSA-H3 {r_vsa['median']:.2f}x; "
          f"fine work rate {fine_flops / t_fine / 1e12:.1f} TFLOP/s (target >= 400)")
    print(f"  per-round ratios: dense/fine {spread(r_fine)}, dense/VSA-H3 {spread(r_vsa)}")
    print(f"quality: max |fine - fp64 masked oracle| = {err:.3e} (sampled tiles); VSA-H3 vs dense: max "
          f"{float(diff.max()):.3e}, mean {float(diff.mean()):.3e} (approximation, random inputs)")
    for case, key in (("dense", "dense"), ("fine", "fine"), ("vsa", "vsa")):
        table.add(case, "time", statistics.median(times[key]) * 1e3, "ms", min=min(times[key]) * 1e3,
                 max=max(times[key]) * 1e3, n=len(times[key]))
    table.add("dense", "tflops", dense_flops / t_dense / 1e12, "TFLOP/s")
    table.add("fine", "backend", st.backend)
    table.add("fine", "work_tflops", fine_flops / t_fine / 1e12, "TFLOP/s")
    table.add("fine", "dense_equivalent_tflops", dense_flops / t_fine / 1e12, "TFLOP/s")
    table.add("fine", "block_density", pairs / (H * lay.n_tiles ** 2))
    table.add_stats("dense/fine", "ratio", r_fine, "x", note="target >= 7x")
    table.add_stats("dense/vsa", "ratio", r_vsa, "x")
    table.add("quality", "max_err_fine_vs_fp64_oracle", err, note="sampled tiles")
    table.add("quality", "max_diff_vsa_vs_dense", float(diff.max()))
    table.add("quality", "mean_diff_vsa_vs_dense", float(diff.mean()))


if __name__ == "__main__":
    main()
