"""CPU: the nvfp4 / mxfp8 quantize of ``kernels/quant.py`` now vs before issue #34's in-place, row-grouped pass
(the old code is kept here, and only here, as the labelled baseline), on one real-size weight, threads 1 and 2.

    python benchmarks/bench_quant_cpu.py [--format nvfp4|mxfp8] [--shape 2048,21504] [--dtype bfloat16]
                                         [--rounds 7] [--threads 1,2] [--mode quantize|rows] [--rows FILE]

The default weight is a 2048-row slice of H3's largest layer (``5376 x 21504`` bf16, the FFN down projection;
``--shape 5376,21504`` for all of it), random normal * 0.02. ``--mode quantize`` times ``quantize(w, fmt,
error=ErrorSample(8), finite=True)``, what the loader calls (``loaders/quantize.py``): the per-tensor amax, the row
slices, the sampled reconstruction error, the blocked scales; ``--mode rows`` only the row-slice step
(``_nvfp4_rows`` / ``_mxfp8_rows`` over every slice). For each torch thread count: OLD, NEW and the stock cast
``w.to(torch.float8_e4m3fn)`` (what the bench_quantize.py targets are relative to) run in turn (ABCABC...) for
``--rounds`` rounds after a warm-up; printed: each one's wall time (median, min-max), the per-round ratio OLD/NEW
of the wall clock and of the process CPU time (median, min-max; the CPU time is the steadier on a shared machine),
NEW / stock, and whether OLD and NEW give the same bytes (data and block scales; checked once per thread count).

The machine this was written on is shared (2 cores, other jobs running): read the min-max, not only the median.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _view() -> str:
    """A folder whose ``ditkit`` entry is this checkout (never the checkout's own folder on sys.path): a ``ditkit``
    importable from elsewhere (another clone, an editable install) would otherwise be measured as NEW, silently."""
    view = Path(tempfile.gettempdir()) / f"ditkit-bench-view-{os.getuid()}-{abs(hash(str(REPO))) % 10**8}"
    view.mkdir(exist_ok=True)
    for name, target in (("ditkit", REPO), ("benchmarks", REPO / "benchmarks")):
        link = view / name
        if not link.is_symlink():
            os.symlink(target, link, target_is_directory=True)
    return str(view)


sys.path.insert(0, _view())
from benchmarks._harness import Rows, Timer, add_rows_argument, interleave, ratio_stats, spread, stats  # noqa: E402


# ------------------------------------------------------------------ OLD: kernels/quant.py before this change
# (verbatim but for the names; the helpers it calls that this change left alone are taken from the module)

def _old_e2m1_codes_finite(Q, v):
    shape = v.shape
    b = v.contiguous().view(Q.torch.int32).reshape(-1)
    n = b.numel()
    idx, low = Q._work_int("old_e2m1_idx", n), Q._work_int("old_e2m1_low", n)
    Q.torch.bitwise_right_shift(b, 20, out=idx)
    Q.torch.bitwise_and(b, 0xFFFFF, out=low)
    idx.bitwise_or_(low.ne_(0)).bitwise_and_(0xFFF)
    return Q.torch.index_select(Q._E2M1_BITS_LUT, 0, idx).reshape(shape)


def _old_pack_nibbles(Q, c, out=None):
    torch = Q.torch
    v = c.view(torch.int16)
    r = torch.bitwise_left_shift(v, 4, out=Q._work_int("old_pack", v.numel(), torch.int16).view(v.shape))
    r.bitwise_or_(torch.bitwise_right_shift(v, 8, out=Q._work_int("old_pack2", v.numel(), torch.int16)
                                            .view(v.shape)))
    if out is None:
        return r.to(torch.uint8)
    out.copy_(r)
    return out


def _old_nvfp4_rows(Q, x, s2, out=None):
    """``_nvfp4_rows(x, s2, finite=True, out)`` before: the finite CPU branch."""
    torch = Q.torch
    rows, cols = x.shape
    f, amax = Q._blocks_f32(x, 16)
    sbs8, total, zero, any_zero = Q._nvfp4_block_scales(amax, s2)
    d = f.div_((torch.where(zero, torch.ones_like(total), total) if any_zero else total).unsqueeze(-1))
    if any_zero:
        d.masked_fill_(zero.unsqueeze(-1), 0.0)
    c = _old_e2m1_codes_finite(Q, d.reshape(rows, cols))
    return _old_pack_nibbles(Q, c, out), sbs8


def _old_mxfp8_rows(Q, x, out=None):
    """``_mxfp8_rows(x, out)`` before: one pass over the whole slice."""
    torch = Q.torch
    rows, cols = x.shape
    f, amax = Q._blocks_f32(x, 32)
    e8, s, zero, any_zero = Q._mxfp8_block_scales(amax)
    d = f.div_(s.unsqueeze(-1))
    if any_zero:
        d.masked_fill_(zero.unsqueeze(-1), 0.0)
    if not bool((amax.float() / s).amax() <= Q.FP8_E4M3_MAX):
        d.clamp_(-Q.FP8_E4M3_MAX, Q.FP8_E4M3_MAX)
    if out is None:
        out = d.reshape(rows, cols).to(torch.float8_e4m3fn)
    else:
        out.copy_(d.reshape(rows, cols))
    return out, e8


def old_quantize_block(Q, w, fmt, error=None):
    """``quantize(w, fmt, error=error, finite=True)`` before (its block-format branch, CPU), fmt nvfp4 / mxfp8."""
    torch = Q.torch
    rows, cols = w.shape
    if error is not None:
        error.total_rows += rows
    step = Q._row_step(cols)
    spans = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    amax = Q._amax_abs(w)
    if not bool(torch.isfinite(amax)):
        raise Q.NonFiniteWeight(f"{fmt}: the weight holds NaN or Inf values")
    pad = Q.get_format(fmt).pad
    pr, pc = Q._roundup(rows, pad), Q._roundup(cols, pad)
    s2 = Q.per_tensor_scale(w, fmt, amax) if fmt == "nvfp4" else None
    data = torch.empty((pr, pc if fmt == "mxfp8" else pc // 2), dtype=Q.get_format(fmt).storage)
    sparts = []
    for i, (r0, r1) in enumerate(spans):
        x = w[r0:r1]
        xp = Q._pad_rows_cols(x, (pr - rows) if r1 == rows else 0, pc - cols)
        into = data[r0:r0 + xp.shape[0]]
        d, sc = _old_mxfp8_rows(Q, xp, into) if fmt == "mxfp8" else _old_nvfp4_rows(Q, xp, s2, into)
        sparts.append(sc)
        if error is not None and i % error.every == 0:
            rec = Q._dequant_slice(fmt, d[: r1 - r0], sc[: r1 - r0], s2)[:, :cols]
            Q._add_error(error, rec, x)
        del x, xp, d
    b = Q.to_blocked(sparts[0] if len(sparts) == 1 else torch.cat(sparts))
    blocked = torch.empty(tuple(b.shape), dtype=b.dtype)
    blocked.copy_(b)
    if fmt == "mxfp8":
        return data, {"weight_scale": blocked.view(torch.float8_e8m0fnu)}
    return data, {"weight_scale": blocked, "weight_scale_2": s2}


# ------------------------------------------------------------------------------------------------ the run

def _rows_all(Q, w, s2, out, fn):
    step = Q._row_step(w.shape[1])
    for r0 in range(0, w.shape[0], step):
        fn(w[r0:r0 + step], s2, out[r0:r0 + step])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8"])
    ap.add_argument("--shape", default="2048,21504", help="rows,cols of the weight (cols a multiple of 16)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma separated")
    ap.add_argument("--mode", default="quantize", choices=["quantize", "rows"])
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    try:
        rows, cols = (int(x) for x in a.shape.split(","))
        threads = [int(t) for t in a.threads.split(",") if t]
    except ValueError:
        raise SystemExit(f"--shape {a.shape!r} / --threads {a.threads!r}: expected rows,cols / n,m") from None
    block = 16 if a.format == "nvfp4" else 32
    if rows <= 0 or cols <= 0 or cols % block or a.rounds <= 0 or not threads or min(threads) <= 0:
        raise SystemExit("--shape must be positive with cols a multiple of the block (16 / 32); --rounds and --threads positive")
    import torch

    from ditkit.kernels import quant as Q

    where = Path(Q.__file__).resolve()
    if where.parents[1] != REPO:
        raise SystemExit(f"`ditkit.kernels.quant` resolves to {where}, not this checkout ({REPO})")
    dtype = getattr(torch, a.dtype)
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    out = Rows(a.rows, "bench_quant_cpu")
    fmt = a.format
    case0 = f"{rows}x{cols} {a.dtype} {fmt} {a.mode}"
    print(f"{fmt} {a.mode}: {rows}x{cols} {a.dtype}, {a.rounds} rounds, OLD (before issue #34's in-place pass) vs "
          f"NEW ({where}) vs stock fp8 cast, interleaved")
    for nt in threads:
        torch.set_num_threads(nt)
        case = f"{case0} threads={nt}"
        if a.mode == "quantize":
            fns = {"old": lambda: old_quantize_block(Q, w, fmt, Q.ErrorSample(8)),
                   "new": lambda: Q.quantize(w, fmt, error=Q.ErrorSample(8), finite=True)}
        elif fmt == "nvfp4":
            s2 = Q.per_tensor_scale(w, "nvfp4")
            o1 = torch.empty(rows, cols // 2, dtype=torch.uint8)
            o2 = torch.empty(rows, cols // 2, dtype=torch.uint8)
            fns = {"old": lambda: _rows_all(Q, w, s2, o1, lambda x, s, o: _old_nvfp4_rows(Q, x, s, o)),
                   "new": lambda: _rows_all(Q, w, s2, o2, lambda x, s, o: Q._nvfp4_rows(x, s, True, o))}
        else:
            o1 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            o2 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            fns = {"old": lambda: _rows_all(Q, w, None, o1, lambda x, s, o: _old_mxfp8_rows(Q, x, o)),
                   "new": lambda: _rows_all(Q, w, None, o2, lambda x, s, o: Q._mxfp8_rows(x, o))}
        if a.mode == "quantize":
            (d0, s0), (d1, s1) = fns["old"](), fns["new"]()
            same = (torch.equal(d0.view(torch.uint8), d1.view(torch.uint8))
                    and all(torch.equal(s0[k].reshape(-1).view(torch.uint8), s1[k].reshape(-1).view(torch.uint8))
                            for k in s0) and s0.keys() == s1.keys())
        else:
            fns["old"](), fns["new"]()
            same = torch.equal(o1.view(torch.uint8), o2.view(torch.uint8))
        fns["stock"] = lambda: w.to(torch.float8_e4m3fn)
        walls: dict = {}
        cpu = interleave(fns, a.rounds, warmup=1, timer=Timer(cpu_time=True), walls=walls)
        rw, rc = ratio_stats(walls["old"], walls["new"]), ratio_stats(cpu["old"], cpu["new"])
        rs = ratio_stats(walls["new"], walls["stock"])
        ro = ratio_stats(walls["old"], walls["stock"])
        print(f"\ntorch threads {nt}: bits equal OLD vs NEW: {same}")
        for k in ("old", "new", "stock"):
            s = stats([t * 1e3 for t in walls[k]])
            print(f"  {k:5s} wall {s['median']:8.1f} ms {spread(s)}")
            out.add(case, f"{k}_wall_ms", s["median"], "ms", min=s["min"], max=s["max"], n=s["n"])
        print(f"  OLD/NEW wall   {rw['median']:.2f}x {spread(rw)}")
        print(f"  OLD/NEW cpu    {rc['median']:.2f}x {spread(rc)}")
        print(f"  NEW/stock wall {rs['median']:.2f}x {spread(rs)}   (OLD/stock {ro['median']:.2f}x {spread(ro)})")
        out.add(case, "old_over_new_wall", rw["median"], "x", min=rw["min"], max=rw["max"], n=rw["rounds"])
        out.add(case, "old_over_new_cpu", rc["median"], "x", min=rc["min"], max=rc["max"], n=rc["rounds"])
        out.add(case, "new_over_stock_wall", rs["median"], "x", min=rs["min"], max=rs["max"], n=rs["rounds"])
        out.add(case, "old_over_stock_wall", ro["median"], "x", min=ro["min"], max=ro["max"], n=ro["rounds"])
        out.add(case, "bits_equal", bool(same))
    print(f"\n(load average at the end: {open('/proc/loadavg').read().split()[:3]}; "
          f"{time.strftime('%H:%M:%S')})" if Path("/proc/loadavg").exists() else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
