"""CPU: VSA-H3 sparse path vs dense SDPA at S ~ 16k, head_dim 128, keep 10 % (ratio measured in one run).

    nice -n 10 python benchmarks/bench_vsa_cpu.py [--heads 2] [--reps 2] [--threads 1] [--backends reference,auto,cpu_native]
        [--small] [--rows FILE]
    nice -n 10 python benchmarks/bench_vsa_cpu.py --reuse [--rounds 7] [--backends reference,auto] [--rows FILE]

Three sequences of about 16k tokens, video grid 12x24x52 latent-frame x height x width tokens (12 = 5*2+2 latent
frames = 39 pixel frames, H3's 17k+5 rule):

* ``h3-t2va``: H3's packed t2va sequence for that video: text 300 + audio 65 prefix (H3 derives the audio
  length from the frame count, ``round(F / 24 * 40)`` = 65 for 39 frames, ``h3.md`` sec. 2.4);
* ``video-only``: 12x24x56, whole cubes, no prefix;
* ``prefix-heavy``: text 300 + audio 414 (10 s of audio beside 1.6 s of video: NOT an H3 geometry, kept as a
  stress case; the dense prefix rows and columns push the block density to 0.19, whose ceiling is ~5.3x).

For each: dense SDPA time, VSA-H3 time per fine-stage backend (pack + pooled scores + top-k + fine stage +
unpack; ``auto`` = ``cpu_batched`` on CPU), timed interleaved (dense, sparse, dense, sparse, ...; CPU time, median
of ``--reps`` rounds), their per-round ratio (median, min-max), the block density and the ratio a perfect kernel would
reach (1 / density), and the quality numbers on the same inputs: max |sparse - exact masked attention| on sampled
query tiles (float64 oracle; exactness of the kernel) and max/mean |sparse - dense| (the approximation itself,
random inputs).

``--small`` runs the same three cases on a ~1k-token geometry (video grid 7x8x16, 7 = 5*1+2 latent frames = 22 pixel
frames, audio 37; video-only 8x8x16; prefix-heavy text 300 + audio 414) for a smoke test of the script: its ratios
say nothing about S ~ 16k.
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

# CPU time (process_time) is what the ratio uses: the box is shared, so wall time mostly measures the neighbours;
# with --threads 1 CPU time = work done
CPU_TIMER = Timer(cpu_time=True)


def h3_audio_tokens(latent_frames: int) -> int:
    """H3's audio latent count for a video of ``latent_frames`` (5k+2) latents: F = 17k+5 pixel frames at 24 fps,
    audio at 40 Hz -> round(F / 24 * 40) (FastVideo ``audio_latent_num_frames``)."""
    if (latent_frames - 2) % 5:
        raise ValueError(f"H3 video latents come in 5k+2, got {latent_frames}")
    frames = (latent_frames - 2) // 5 * 17 + 5
    return round(frames / 24 * 40)


def run_case(name, prefix, grid, heads, keep, reps, backends, dtype, table):
    from ditkit.kernels import build_h3_layout, select_h3, vsa_h3_attention
    from ditkit.kernels.vsa import pool_tiles

    lay = build_h3_layout(prefix, grid)
    S, D = lay.seq_len, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, S, D, generator=g, dtype=torch.float32).to(dtype) for _ in range(3))
    o_dense = F.scaled_dot_product_attention(q, k, v)

    # exactness on sampled query tiles: float64 attention over exactly the selected key tiles
    qt = q[..., lay.tile_src.clamp(min=0), :] * (lay.tile_src >= 0)[:, None]
    kt = k[..., lay.tile_src.clamp(min=0), :] * (lay.tile_src >= 0)[:, None]
    sc = pool_tiles(qt, lay.sizes) @ pool_tiles(kt, lay.sizes).transpose(-1, -2) / math.sqrt(D)
    idx, num = select_h3(sc, lay.num_prefix_tiles, lay.num_video_tiles, lay.topk(keep))
    tid = lay.untile_index // 64
    gen = torch.Generator().manual_seed(1)
    tiles = torch.randint(0, lay.n_tiles, (8,), generator=gen).tolist()
    tiles = [0, lay.num_prefix_tiles] + tiles                      # always one prefix and one video tile
    refs = []
    for t in tiles:
        for h in range(heads):
            rows = torch.nonzero(tid == t).view(-1)
            sel = idx[0, h, t, : int(num[0, h, t])].long()
            cols = torch.nonzero(torch.isin(tid, sel)).view(-1)
            ref = F.scaled_dot_product_attention(q[0, h, rows].double()[None], k[0, h, cols].double()[None],
                                                 v[0, h, cols].double()[None])[0]
            refs.append((h, rows, ref))
    ratios = {}
    for backend in backends:
        keep_out, walls = {}, {}
        t = interleave({"dense": lambda: F.scaled_dot_product_attention(q, k, v),
                        "sparse": lambda: vsa_h3_attention(q, k, v, lay, keep, backend=backend)},
                       reps, timer=CPU_TIMER, keep=keep_out, walls=walls)
        o_sparse, st = keep_out["sparse"]
        t_dense, t_sparse = statistics.median(t["dense"]), statistics.median(t["sparse"])
        w_dense, w_sparse = statistics.median(walls["dense"]), statistics.median(walls["sparse"])
        r = ratio_stats(t["dense"], t["sparse"])
        err = max(float((o_sparse[0, h, rows].double() - ref).abs().max()) for h, rows, ref in refs)
        diff = (o_sparse.double() - o_dense.double()).abs()
        if not ratios:
            print(f"[{name}] S={S} H={heads} D={D} {str(dtype).replace('torch.', '')} keep={keep:g} k={st.k_video}/"
                  f"{lay.num_video_tiles} video tiles, {lay.num_prefix_tiles} prefix tiles, "
                  f"block density {st.density:.3f} (perfect-kernel ceiling {1 / st.density:.2f}x)")
            for metric, value in (("seq_len", S), ("heads", heads), ("head_dim", D), ("keep", keep),
                                  ("k_video", st.k_video), ("video_tiles", lay.num_video_tiles),
                                  ("prefix_tiles", lay.num_prefix_tiles), ("block_density", st.density)):
                table.add(name, metric, value)
        print(f"[{name}]   CPU time: dense SDPA {t_dense * 1e3:9.1f} ms | VSA-H3 ({st.backend:>11}) "
              f"{t_sparse * 1e3:9.1f} ms | speedup {r['median']:5.2f}x {spread(r)}  (wall: {w_dense * 1e3:.0f} / "
              f"{w_sparse * 1e3:.0f} ms, {w_dense / w_sparse:.2f}x)")
        print(f"[{name}]     max |sparse - exact masked oracle| ({len(tiles)} sampled query tiles, fp64) = {err:.2e};"
              f" vs dense: max {float(diff.max()):.3e}, mean {float(diff.mean()):.3e} (approximation, random inputs)")
        case = f"{name}/{st.backend}"
        table.add(case, "dense_cpu_time", t_dense * 1e3, "ms", min=min(t["dense"]) * 1e3, max=max(t["dense"]) * 1e3,
                 n=len(t["dense"]))
        table.add(case, "sparse_cpu_time", t_sparse * 1e3, "ms", min=min(t["sparse"]) * 1e3,
                 max=max(t["sparse"]) * 1e3, n=len(t["sparse"]))
        table.add_stats(case, "speedup_dense_over_sparse", r, "x", note="per-round CPU-time ratio")
        table.add(case, "wall_ratio", w_dense / w_sparse, "x", note="medians of the wall clock")
        table.add(case, "max_err_vs_fp64_oracle", err, note=f"{len(tiles)} sampled query tiles")
        table.add(case, "max_diff_vs_dense", float(diff.max()))
        table.add(case, "mean_diff_vs_dense", float(diff.mean()))
        ratios[st.backend] = r["median"]
    return ratios


def run_reuse(name, prefix, grid, heads, keep, rounds, backends, dtype, gate: bool, table=None):
    """Per-call layout buffers (pack gather index + pad slots, fp32 tile sizes, untile tile ids) recomputed in every
    call (A, what ran before) vs built once per geometry and reused (B), interleaved A B A B ... on the same inputs;
    outputs must be bit-identical. Prints the median and min-max of the per-round ratio A/B (CPU time)."""
    import statistics
    import time

    from ditkit.kernels import build_h3_layout, vsa, vsa_h3_attention

    lay = build_h3_layout(prefix, grid)
    S, D = lay.seq_len, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, S, D, generator=g, dtype=torch.float32).to(dtype) for _ in range(3))
    gt = torch.randn(1, heads, S, D, generator=g, dtype=torch.float32).to(dtype) if gate else None
    rows = {}
    for backend in backends:
        def call(reuse):
            vsa.REUSE_LAYOUT_BUFFERS = reuse
            lay.extra.pop("buffers", None) if not reuse else None
            c = time.process_time()
            out, st = vsa_h3_attention(q, k, v, lay, keep, gate=gt, backend=backend)
            return time.process_time() - c, out, st

        try:
            call(False), call(True)                      # warm-up both
            ratios, ta, tb = [], [], []
            same = True
            for _ in range(rounds):
                a, oa, st = call(False)
                b, ob, _ = call(True)
                same &= torch.equal(oa, ob)
                ratios.append(a / b)
                ta.append(a)
                tb.append(b)
        finally:
            vsa.REUSE_LAYOUT_BUFFERS = True
        rows[st.backend] = statistics.median(ratios)
        print(f"[{name}{' +gate' if gate else ''}] S={S} backend {st.backend:>11}: recomputed per call "
              f"{statistics.median(ta) * 1e3:9.2f} ms | reused {statistics.median(tb) * 1e3:9.2f} ms | ratio median "
              f"{statistics.median(ratios):.4f}x (min {min(ratios):.4f}, max {max(ratios):.4f}, {rounds} ABAB rounds) "
              f"| outputs bit-identical: {same}")
        if table is not None:
            case = f"{name}{' +gate' if gate else ''}/{st.backend}"
            table.add(case, "seq_len", S)
            table.add(case, "recomputed_ms", statistics.median(ta) * 1e3, "ms", min=min(ta) * 1e3, max=max(ta) * 1e3,
                      n=rounds)
            table.add(case, "reused_ms", statistics.median(tb) * 1e3, "ms", min=min(tb) * 1e3, max=max(tb) * 1e3,
                      n=rounds)
            table.add(case, "ratio_recomputed_over_reused", statistics.median(ratios), "x", min=min(ratios),
                      max=max(ratios), n=rounds)
            table.add(case, "bit_identical", bool(same))
        if not same:
            raise SystemExit(f"[{name}] reused layout buffers changed the output ({st.backend})")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=float, default=0.10)
    ap.add_argument("--backends", default="reference,auto,cpu_native", help="comma-separated fine-stage backends to time")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--small", action="store_true",
                    help="~1k-token geometry (smoke test of this script, not a benchmark)")
    add_rows_argument(ap)
    ap.add_argument("--reuse", action="store_true",
                    help="instead: per-call layout buffers recomputed vs reused, ABAB, bit-identity checked")
    ap.add_argument("--rounds", type=int, default=7, help="ABAB rounds for --reuse")
    a = ap.parse_args()
    rows = Rows(a.rows, "bench_vsa_cpu")
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    grid, grid_video_only = ((7, 8, 16), (8, 8, 16)) if a.small else ((12, 24, 52), (12, 24, 56))
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    if a.reuse:
        for gate in (False, True):
            run_reuse("h3-t2va", (300, h3_audio_tokens(grid[0])), grid, a.heads, a.keep, a.rounds, backends, dtype,
                      gate, rows)
        run_reuse("h3-tiny-host", (10, 74), (7, 8, 8), 3, 0.25, a.rounds, backends, dtype, True, rows)
        return
    r1 = run_case("h3-t2va", (300, h3_audio_tokens(grid[0])), grid, a.heads, a.keep, a.reps, backends, dtype, rows)
    r2 = run_case("video-only", (), grid_video_only, a.heads, a.keep, a.reps, backends, dtype, rows)
    r3 = run_case("prefix-heavy", (300, 414), grid, a.heads, a.keep, a.reps, backends, dtype, rows)
    for b in r1:
        print(f"RATIO dense/sparse (CPU time) [{b}]: h3-t2va {r1[b]:.2f}x, video-only {r2.get(b, float('nan')):.2f}x "
              f"(target >= 5x); prefix-heavy stress case {r3.get(b, float('nan')):.2f}x")


if __name__ == "__main__":
    main()
