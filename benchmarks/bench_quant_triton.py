"""GPU: the quantizers' Triton kernels vs the same quantize as torch operations on the device, per format.

    python benchmarks/bench_quant_triton.py [--shape 8192,8192] [--dtype bfloat16] [--reps 20] [--rows FILE]
    python benchmarks/bench_quant_triton.py --device cpu --shape 48,96 --reps 1     # smoke run (interpreter)

For each format (float8_e4m3fn, int8_tensorwise, mxfp8, nvfp4) one weight of ``--shape`` is quantized on the
device by ``kernels/quant.py`` ``quantize(backend="reference")`` (torch operations: what a device quantize costs
without ditkit's kernels) and ``backend="triton"`` (the per-tensor kernel; the block kernels of
``kernels/quant_triton.py``), interleaved (reference, triton, reference, ...; CUDA events) for ``--reps`` rounds
after a warm-up. Prints, from one run: each time (median, min-max), the source GB/s of the triton path, the
per-round ratio reference / triton (median, min-max), and whether the bits are equal (every byte of the data and
the scales; the quality delta is therefore zero). A ratio is bounded by the bytes each path moves: the reference
reads and writes several full-size float32 temporaries, the kernels read the source twice (the block amax, then
the encode) and write the result once.

Not run by the author (no GPU was lent to this work); ``--device cpu`` runs the kernels under the Triton
interpreter (set ``TRITON_INTERPRET=1``) to check the script, and its times stand for nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import Rows, Timer, add_rows_argument, interleave, ratio_stats, spread, stats  # noqa: E402

FORMATS = ("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192,8192", help="rows,cols of the weight")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run (Triton interpreter)")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --device cpu for a smoke run)")
    from ditkit.kernels import quant as Q

    if not Q.HAS_TRITON:
        raise SystemExit("triton is not installed")
    try:
        rows, cols = (int(x) for x in a.shape.split(","))
    except ValueError:
        raise SystemExit(f"--shape {a.shape!r}: expected rows,cols") from None
    if rows <= 0 or cols <= 0 or a.reps <= 0:
        raise SystemExit("--shape and --reps must be positive")
    fmts = [f for f in a.formats.split(",") if f]
    for f in fmts:
        if f not in FORMATS:
            raise SystemExit(f"--formats: unknown {f!r}; known: {', '.join(FORMATS)}")
    dev = torch.device(a.device)
    dt = getattr(torch, a.dtype)
    table = Rows(a.rows, "bench_quant_triton")
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.05).to(dt).to(dev)
    src_bytes = w.numel() * w.element_size()
    timer = Timer(dev)
    case = f"{rows}x{cols} {a.dtype} on {dev.type}"
    print(f"# quantize on the device: torch operations vs Triton kernels, {case}, {a.reps} interleaved rounds")
    print("| format | torch ops ms | triton ms | triton source GB/s | torch / triton | bits equal |")
    print("|---|---|---|---|---|---|")
    for fmt in fmts:
        keep: dict = {}
        times = interleave({"reference": lambda: Q.quantize(w, fmt),
                            "triton": lambda: Q.quantize(w, fmt, backend="triton")},
                           rounds=a.reps, warmup=1, timer=timer, keep=keep)
        (rd, rs), (td, ts) = keep["reference"], keep["triton"]
        equal = torch.equal(rd.view(torch.uint8), td.view(torch.uint8)) and all(
            torch.equal(rs[k].reshape(-1).view(torch.uint8), ts[k].reshape(-1).view(torch.uint8)) for k in rs)
        sr, st, rr = stats(times["reference"]), stats(times["triton"]), ratio_stats(times["reference"],
                                                                                   times["triton"])
        table.add_stats(f"{case} {fmt}", "reference_ms", sr, "ms", scale=1e3)
        table.add_stats(f"{case} {fmt}", "triton_ms", st, "ms", scale=1e3)
        table.add(f"{case} {fmt}", "triton_source_gb_per_s", src_bytes / st["median"] / 1e9, "GB/s")
        table.add_stats(f"{case} {fmt}", "reference_over_triton", rr, "x")
        table.add(f"{case} {fmt}", "bits_equal", bool(equal), "")
        print(f"| {fmt} | {sr['median'] * 1e3:.3f} | {st['median'] * 1e3:.3f} | "
              f"{src_bytes / st['median'] / 1e9:.1f} | {rr['median']:.2f} {spread(rr)} | {'yes' if equal else 'NO'} |")
        if not equal:
            print(f"{fmt}: the Triton bits differ from the reference", file=sys.stderr)
            return 1
    if dev.type != "cuda":
        print("CPU smoke run under the Triton interpreter: the times stand for nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
