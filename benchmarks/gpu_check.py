#!/usr/bin/env python3
"""One-shot GPU validation: every ditkit check that needs a CUDA GPU, in one process, one table, one JSON file.

    python benchmarks/gpu_check.py --dry-run              # the plan (checks, shapes, estimates); CPU, no triton
    python benchmarks/gpu_check.py --quick                # smaller shapes, for a first try
    python benchmarks/gpu_check.py [--only S,S] [--skip S,S] [--out FILE] [--json FILE] [--budget SECONDS]

Sections (``--only`` / ``--skip`` take these names; a section that fails prints its error and the run goes on):

* ``kernels``    every Triton kernel (pack, unpack / unpack + coarse / + coarse*gate combine, block-sparse forward
                 with LSE, VSA-H3 end to end) against float64 oracles on the same device, fp16 and bf16, ragged
                 tiles, prefixes that are not multiples of 64; the top-k selection (``vsa_select`` is torch.topk:
                 kernels/ has no Triton top-k) on CUDA against the same op on CPU;
* ``int64``      a shape whose element offsets (index * stride) exceed 2**31 in the pack, block-sparse and unpack
                 kernels (the offsets are printed in the plan), checked on heads below and above 2**31 elements;
                 the offs64 probe kernels (and the unpromoted i32 form, which must wrap);
* ``vsa_perf``   VSA-H3 at keep 10 % / 20 %, S ~ 38k and ~ 109k tokens, head dim 128 vs dense SDPA (flash) on
                 the same q/k/v, interleaved in the same run; dense-equivalent and computed TFLOP/s, the FLOP
                 ceiling, sampled exactness against float64;
* ``te_stream``  text-encoder layerwise streaming on CUDA (pinned host packs, copy stream, prefetch 1) with H3's
                 Qwen3-VL layer shapes: bit-equal output, peak device memory vs 2 layers + activations, time
                 overhead vs resident (and the copy floor: host->device bytes / measured bandwidth);
* ``adaln``      AdaLN schedule tables on CUDA: bit-identical sampling, device bytes freed vs the shape formula;
* ``video_save`` streaming save (decode chunks -> uint8 on the device -> PyAV) vs the whole-float-video path:
                 equal frames, peak device memory, device->host bytes;
* ``t1_decode``  H3 T=1 repeat-decode: equal to the full-clip decode's frame, peak device memory;
* ``quant_load`` (opt-in: ``--only quant_load``, its own 300 s budget; about 4 GB of disk in the temp folder)
                 quantize-on-load through the device (issue #34): a generated H3 (official shards, ``gb`` GB
                 of bf16) streamed through ``loaders/quantize.py`` ``quantize_stream(device=cuda)`` (page-locked
                 staging, quantized on the GPU, results back in host memory) in each format; time vs reading the
                 file, GB/s, and every ``sample``-th quantized layer bit-equal to the CPU path;
* ``lokr``       LoKr fusion on CUDA (FLUX.2-dev ``linear1`` size) vs float64; fp8 / int8 bases through
                 comfy_kitchen's QuantizedTensor (ComfyUI's QUANT_ALGOS layouts when ComfyUI is importable) when
                 installed, else SKIP with the reason.

Timing: A and B (and C) interleaved per round after a warm-up, CUDA events (wall clock + synchronize where host
work is part of the path); median and min-max of the per-round ratio. Memory: ``reset_peak_memory_stats`` /
``max_memory_allocated`` minus what was allocated before. Output: one table on stdout (progress on stderr), JSON
with every row and the environment at ``--json``, else beside ``--out``, else ``$OUT/gpu_check.json``, else
``./gpu_check.json``. Exit 0 = no FAIL, 1 = some FAIL, 2 = refused (no CUDA, bad arguments), 3 = hard time limit.

Written and tested on CPU only (no GPU was available): the hidden ``--device cpu --tiny`` mode runs every section's
code path at toy sizes (Triton under TRITON_INTERPRET=1) in the unit tests; the estimates in the plan are guesses.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

T_START = time.perf_counter()   # budgets count from process start (imports and CUDA initialisation included)
HARD_STOP_AFTER_BUDGET_S = 30
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))   # the checkout: benchmarks (plain Python at import: the dry-run needs no torch)  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import CudaMem as Mem, Timer, interleave, ratio_stats  # noqa: E402
SECTIONS = ("kernels", "int64", "vsa_perf", "te_stream", "adaln", "video_save", "t1_decode", "lokr", "quant_load")
OPT_IN = ("quant_load",)   # not in the default run (whose budget the other sections fill): --only quant_load
TILE = 64
I32_LIMIT = 2 ** 31            # an i32 index * stride product at or above this wraps
LN2 = math.log(2.0)

# dense (no structured sparsity) bf16/fp16 tensor-core peaks from NVIDIA's datasheets, FLOP/s: the ceiling of any
# measured "computed" TFLOP/s (a figure above it is noise or a wrong FLOP count)
PEAK_BF16 = (("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
             ("H100", 989e12))


# ------------------------------------------------------------------------------------------------ shapes per mode
def mode_config(mode: str) -> dict:
    """Shapes and timing settings per mode (plain Python: the dry-run imports neither torch nor triton)."""
    full = {
        "budget_s": 420,
        # H3's case (bf16, head dim 128) first: if Triton compiles eat the budget, the rest is what gets skipped
        "kernels": dict(prefix=(300, 37), video=(7, 10, 13), batch=2, heads=4, head_dims=(128, 64),
                        dtypes=("bfloat16", "float16"), keep=0.3, est_s=45, budget_s=75),
        "int64": dict(prefix=(300, 414), video=(37, 24, 42), heads=448, head_dim=128, dtype="bfloat16",
                      cap=4, est_s=25, budget_s=50),
        "vsa_perf": dict(cases=(("38k", (300, 414), (37, 24, 42)), ("109k", (300, 414), (37, 46, 64))),
                         keeps=(0.1, 0.2), heads=8, head_dim=128, dtype="bfloat16", warmup=2, rounds=10,
                         est_s=40, budget_s=80),
        "te_stream": dict(hidden=5120, heads=64, kv_heads=8, head_dim=128, ff=25600, layers=6, vocab=32768,
                          tokens=(512, 8192), dtype="bfloat16", prefetch=1, warmup=1, rounds=5,
                          est_s=40, budget_s=70),
        "adaln": dict(blocks=8, t_dim=2688, hidden=2688, expand=6, modalities=6, tokens=1024, steps=20, rows=2,
                      dtype="bfloat16", warmup=1, rounds=3, est_s=20, budget_s=40),
        "video_save": dict(latent=(16, 31, 48, 84), ratio=16, chunk=4, dtype="bfloat16", warmup=1, rounds=3,
                           encode=True, est_s=30, budget_s=50),
        "t1_decode": dict(latent=(16, 1, 48, 84), batch=1, ratio=16, tile=512, overlap=64, est_s=10,
                          budget_s=25),
        "lokr": dict(hidden=6144, factor=16, rank=16, scale=0.5, dtype="bfloat16", est_s=15, budget_s=30),
        "quant_load": dict(gb=4.0, sample=5, formats=("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"),
                           est_s=150, budget_s=300),
    }
    if mode == "full":
        return full
    quick = json.loads(json.dumps(full))   # deep copy (tuples become lists; everything below reads either)
    quick["budget_s"] = 300
    quick["kernels"].update(head_dims=(128,), est_s=30, budget_s=50)
    quick["vsa_perf"].update(cases=(("38k", (300, 414), (37, 24, 42)),), keeps=(0.1,), heads=4, rounds=5,
                             est_s=15, budget_s=40)
    quick["te_stream"].update(hidden=2048, heads=16, kv_heads=4, ff=8192, layers=4, tokens=(512,), rounds=3,
                              est_s=15, budget_s=40)
    quick["adaln"].update(blocks=2, steps=8, tokens=256, est_s=8, budget_s=20)
    quick["video_save"].update(latent=(16, 9, 24, 40), est_s=8, budget_s=25)
    quick["t1_decode"].update(latent=(16, 1, 24, 40), est_s=5, budget_s=15)
    quick["lokr"].update(hidden=3072, est_s=8, budget_s=20)
    quick["quant_load"].update(gb=1.0, est_s=45, budget_s=120)
    if mode == "quick":
        return quick
    if mode != "tiny":
        raise ValueError(mode)
    # toy sizes for the CPU smoke of every code path (unit tests; Triton under TRITON_INTERPRET=1, whose bf16
    # tl.dot is wrong, hence fp16 there; fp32 for the rest)
    return {
        "budget_s": 240,
        "kernels": dict(prefix=(70, 3), video=(2, 4, 6), batch=2, heads=1, head_dims=(16,),
                        dtypes=("float16",), keep=0.5, est_s=10, budget_s=120),
        "int64": dict(prefix=(70, 3), video=(2, 4, 6), heads=0, head_dim=16, dtype="float32", cap=2, est_s=1,
                      budget_s=30),
        "vsa_perf": dict(cases=(("tiny", (70, 3), (2, 4, 6)),), keeps=(0.5,), heads=1, head_dim=16,
                         dtype="float32", warmup=0, rounds=2, est_s=5, budget_s=60),
        "te_stream": dict(hidden=32, heads=2, kv_heads=1, head_dim=16, ff=64, layers=3, vocab=50, tokens=(7,),
                          dtype="float32", prefetch=1, warmup=1, rounds=2, est_s=1, budget_s=30),
        "adaln": dict(blocks=2, t_dim=8, hidden=4, expand=6, modalities=3, tokens=5, steps=3, rows=2,
                      dtype="float32", warmup=1, rounds=2, est_s=1, budget_s=30),
        "video_save": dict(latent=(4, 3, 2, 3), ratio=4, chunk=2, dtype="float32", warmup=1, rounds=2, encode=True,
                           est_s=1, budget_s=30),
        "t1_decode": dict(latent=(4, 1, 6, 5), batch=2, ratio=2, tile=8, overlap=2, est_s=1, budget_s=30),
        "lokr": dict(hidden=32, factor=4, rank=2, scale=0.5, dtype="float32", est_s=1, budget_s=30),
        "quant_load": dict(gb=0.0, sample=1, formats=("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"),
                           est_s=10, budget_s=120),
    }


# ------------------------------------------------------------------------------------------------ geometry math
def h3_geometry(prefix, video) -> dict:
    """VSA-H3 tile counts from the definition (64-row prefix tiles per segment, (4,4,4) video cubes): used by the
    plan without importing the kernels, and compared with ``build_h3_layout`` at run time."""
    prefix = [int(s) for s in prefix if int(s) > 0]
    npre = sum(math.ceil(s / TILE) for s in prefix)
    nvid = math.prod(math.ceil(x / 4) for x in video)
    ragged = sum(1 for s in prefix if s % TILE) + nvid - math.prod(x // 4 for x in video)
    S = sum(prefix) + math.prod(video)
    T = npre + nvid
    return dict(S=S, npre=npre, nvid=nvid, T=T, P=T * TILE, ragged=ragged)


def topk_of(keep: float, nvid: int) -> int:
    """FastVideo's compute_topk: clamp(ceil(keep * n_video_tiles), 1, n_video_tiles)."""
    return max(1, min(int(math.ceil(round(keep * nvid, 9))), nvid))


def attention_flops(S: int, D: int, H: int, B: int = 1) -> int:
    """Dense attention forward FLOPs: Q K^T (2 S S D) + P V (2 S S D) per head = 4 * S^2 * D * H * B."""
    return 4 * S * S * D * H * B


def tile_pair_flops(pairs: int, D: int) -> int:
    """Work the block-sparse kernel does: 4 * 64 * 64 * D per selected (query tile, key tile) pair (padded rows
    included: the kernel computes whole 64x64 tiles)."""
    return 4 * TILE * TILE * D * pairs


def h3_pairs(g: dict, k: int) -> int:
    """Selected tile pairs per head under the exempt rule: prefix query tiles see all T key tiles, video query
    tiles see every prefix key tile plus their top k video tiles."""
    return g["npre"] * g["T"] + g["nvid"] * (g["npre"] + k)


def te_layer_params(c: dict) -> int:
    h, q, kv, ff = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["ff"]
    return h * q + 2 * h * kv + q * h + 3 * h * ff + 2 * h     # q, k, v, o, gate/up/down, two RMSNorm weights


def mib(n) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def dtype_short(name: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}.get(name, name)


def elsize(name: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[name]


# ------------------------------------------------------------------------------------------------ the plan
def plan_section(name: str, c: dict, mode: str) -> list[dict]:
    """The checks of one section with their shapes (and computed offsets / bytes / FLOPs) as rows."""
    rows = []

    def add(check, shape, dtype="", note=""):
        rows.append(dict(section=name, check=check, shape=shape, dtype=dtype, note=note))

    if name == "kernels":
        g = h3_geometry(c["prefix"], c["video"])
        dts = ",".join(dtype_short(d) for d in c["dtypes"])
        for D in c["head_dims"]:
            shp = (f"B{c['batch']} H{c['heads']} S{g['S']} D{D}; prefix {tuple(c['prefix'])} + video "
                   f"{tuple(c['video'])} -> {g['T']} tiles ({g['ragged']} ragged), padded {g['P']}")
            add("pack (triton == reference, pad rows zero)", shp, dts)
            add("unpack gather / +coarse / +coarse*gate vs float64", shp, dts, "fp32 sum rounded once")
            add("top-k selection on device vs CPU; pooled scores vs float64", shp, dts,
                "vsa_select is torch.topk (no Triton top-k in kernels/)")
            add("block-sparse fwd + LSE (triton) vs float64", shp, dts,
                "random unsorted selection, one empty and one dense query tile")
            add(f"VSA-H3 end to end + gate, keep {c['keep']} vs float64", shp, dts, "token-level masked oracle")
        for kind in ("dense", "kron"):
            add(f"delta_fuse rounding step ({kind}): bit-exact vs round(scale*dW) then add", "W [96, 80]", "fp16,bf16",
                "GPU-only difference: the interpreter's bf16 cast is not round-to-nearest")
        for fmt in ("mxfp8", "nvfp4"):
            add(f"{fmt} block kernels (triton) == CPU reference, every byte", "W [300, 200] + edge blocks",
                "fp16,bf16,fp32", "GPU-only differences: div_rn, denormals, CUDA log2")
        add("ceil(log2) of float32 near powers of two: device == CPU", "254 exponents x 65536 mantissas", "fp32",
            "INFO: whether the host's mxfp8 exponents depend on the device")
    elif name == "int64":
        g = h3_geometry(c["prefix"], c["video"])
        H, D, es = c["heads"], c["head_dim"], elsize(c["dtype"])
        add("offs64 probe kernels (stride 1e9 exact; unpromoted i32 form wraps)", "64 rows x stride 1e9",
            "int64")
        if H == 0:
            add("pack / block-sparse / unpack past 2**31 elements", "n/a", "", "SKIP on CPU (--tiny): needs "
                ">= 2**31-element device tensors (about 20 GB); only the probe kernels run")
        else:
            o_in, o_pad = H * g["S"] * D - 1, H * g["P"] * D - 1
            shp = f"[1, {H}, S={g['S']} / P={g['P']}, {D}]"
            add("pack past 2**31", shp, dtype_short(c["dtype"]),
                f"max element offset: input {o_in:,}, output {o_pad:,} (2**31 = {I32_LIMIT:,}); "
                f"{mib(H * g['S'] * D * es)} + {mib(H * g['P'] * D * es)}")
            add("block-sparse fwd past 2**31", shp, dtype_short(c["dtype"]),
                f"q/k/v/out max offset {o_pad:,}; {c['cap']} key tiles per query tile; heads 0 and {H - 1} vs "
                "float32 reference")
            add("unpack + coarse*gate past 2**31", shp, dtype_short(c["dtype"]),
                f"fine max offset {o_pad:,}, gate/out max offset {o_in:,}; peak about "
                f"{mib(H * D * es * (g['P'] + 2 * g['S']))}")
    elif name == "vsa_perf":
        H, D = c["heads"], c["head_dim"]
        for label, prefix, video in c["cases"]:
            g = h3_geometry(prefix, video)
            dense = attention_flops(g["S"], D, H)
            for keep in c["keeps"]:
                k = topk_of(keep, g["nvid"])
                fine = tile_pair_flops(h3_pairs(g, k) * H, D)
                shp = (f"{label}: S={g['S']:,} (prefix {tuple(prefix)}, video {tuple(video)}), {g['npre']}+"
                       f"{g['nvid']} tiles, B1 H{H} D{D}")
                tgt = "target >= 7x" if abs(keep - 0.1) < 1e-9 else "no target"
                add(f"dense SDPA-flash vs fine stage vs VSA-H3, keep {keep:g} (k={k})", shp,
                    dtype_short(c["dtype"]),
                    f"dense {dense:.3e} FLOP (4*S^2*D*H), fine {fine:.3e} FLOP (4*64*64*D*pairs): FLOP ceiling "
                    f"{dense / fine:.2f}x (1/keep = {1 / keep:.0f}x); {tgt}; {c['warmup']} warm-up + "
                    f"{c['rounds']} interleaved rounds")
        add("note", f"H={H} heads, batch 1 (H3 has more): per-head work is identical, ratios hold; absolute "
            "times scale with H", "")
    elif name == "te_stream":
        lb = te_layer_params(c) * elsize(c["dtype"])
        shp = (f"{c['layers']} layers x {mib(lb)} (h {c['hidden']}, {c['heads']}/{c['kv_heads']} heads x "
               f"{c['head_dim']}, ff {c['ff']})")
        for L in c["tokens"]:
            add(f"streamed == resident, {L} tokens", shp, dtype_short(c["dtype"]), "bit-equal output")
            add(f"peak device memory, {L} tokens", shp, dtype_short(c["dtype"]),
                f"streamed extra <= 2 layers ({mib(2 * lb)}) + resident run's activations")
            add(f"time streamed / resident, {L} tokens", shp, dtype_short(c["dtype"]),
                f"target <= 1.10; copy floor = {mib(lb * c['layers'])} / measured H2D bandwidth; "
                f"{c['rounds']} interleaved rounds")
    elif name == "adaln":
        out = c["expand"] * c["hidden"] * c["modalities"]
        es = elsize(c["dtype"])
        w = c["blocks"] * (out * c["t_dim"] + out) * es
        tb = c["blocks"] * c["steps"] * c["rows"] * out * es
        shp = f"{c['blocks']} blocks x Linear({c['t_dim']} -> {out}), {c['steps']} Euler steps, M={c['rows']}"
        add("cached sampling == uncached", shp, dtype_short(c["dtype"]), "bit-identical latents")
        add("device bytes freed", shp, dtype_short(c["dtype"]),
            f"weights {mib(w)} parked, tables {mib(tb)} added -> expected {mib(w - tb)} freed")
        add("time cached / uncached", shp, dtype_short(c["dtype"]), f"{c['rounds']} interleaved rounds")
    elif name == "video_save":
        C, T, h, w = c["latent"]
        frames, H, W = 1 + 4 * (T - 1), h * c["ratio"], w * c["ratio"]
        shp = f"latent [1, {C}, {T}, {h}, {w}] -> {frames} frames {W}x{H}, chunks of {c['chunk']} latent frames"
        add("uint8 on device (streaming) == whole float video path", shp, dtype_short(c["dtype"]), "0 LSB")
        add("peak device memory", shp, "", f"streaming < whole float32 video ({mib(frames * 3 * H * W * 4)})")
        add("device->host bytes", shp, "", f"uint8 {mib(frames * 3 * H * W)} vs float32")
        add("MP4 via PyAV", shp, "", "SKIP when PyAV is missing")
    elif name == "t1_decode":
        C, _, h, w = c["latent"]
        H, W = h * c["ratio"], w * c["ratio"]
        shp = f"latent [{c['batch']}, {C}, 1, {h}, {w}] -> {W}x{H}, tiles {c['tile']} px (overlap >= {c['overlap']})"
        add("repeat-decode == frame 3 of the full 7-token clip decode", shp, "fp32", "torch.equal")
        add("peak device memory", shp, "", f"< one 28-frame float32 canvas ({mib(c['batch'] * 28 * 3 * H * W * 4)})")
    elif name == "lokr":
        h, f = c["hidden"], c["factor"]
        out, inp = 9 * h, h
        shp = (f"W [{out}, {inp}] (FLUX.2 linear1 at h {h}), w1 [{f}, {f}], w2 = [{out // f}, {c['rank']}] @ "
               f"[{c['rank']}, {inp // f}], scale {c['scale']}")
        add("fused (chunked, fp32) vs float64 and == full-dW add", shp, dtype_short(c["dtype"]),
            f"full dW would be {mib(out * inp * 4)} fp32")
        for fmt in ("float8_e4m3fn", "int8_tensorwise"):
            add(f"{fmt} base: dequantize -> fp32 add -> requantize", shp, fmt,
                "comfy_kitchen QuantizedTensor (ComfyUI QUANT_ALGOS layouts if importable); SKIP if not installed")
    elif name == "quant_load":
        what = f"generated H3 {c['gb']} GB bf16, official shards" if c["gb"] else "tiny H3, official shards"
        add("read the file (no quantize)", what, "bf16", "GB/s of the page-cached file")
        for f in c["formats"]:
            add(f"{f}: quantize through the device", what, f,
                f"time / read; every {c['sample']}-th quantized layer == CPU path (torch.equal of the bits)")
    return rows


def build_plan(cfg: dict, selected: list[str], mode: str) -> dict:
    secs = []
    for name in SECTIONS:
        c = cfg[name]
        secs.append(dict(section=name, selected=name in selected, est_s=c["est_s"], budget_s=c["budget_s"],
                         checks=plan_section(name, c, mode)))
    return dict(mode=mode, budget_s=cfg["budget_s"], sections=secs,
                est_total_s=sum(s["est_s"] for s in secs if s["selected"]),
                note="estimates are guesses from shapes (written without a GPU); budgets are enforced before "
                     f"each check, and a hard limit stops the process at budget + {HARD_STOP_AFTER_BUDGET_S} s "
                     "after its start")


def print_plan(plan: dict) -> None:
    print(f"ditkit gpu_check plan: mode {plan['mode']}, global budget {plan['budget_s']} s, estimated "
          f"{plan['est_total_s']} s for the selected sections ({plan['note']})")
    rows = []
    for s in plan["sections"]:
        head = f"est {s['est_s']} s, budget {s['budget_s']} s" + ("" if s["selected"] else "; NOT SELECTED")
        rows.append([s["section"], f"[{head}]", "", "", ""])
        for ch in s["checks"]:
            rows.append([s["section"], ch["check"], ch["shape"], ch["dtype"], ch["note"]])
    print_table(["section", "check", "shape", "dtype", "notes"], rows)


def print_table(header, rows, file=None) -> None:
    file = file or sys.stdout
    widths = [len(h) for h in header]
    cap = [14, 60, 80, 16, 10**6]
    for r in rows:
        for i, v in enumerate(r):
            widths[i] = min(max(widths[i], len(str(v))), cap[i] if i < len(cap) else 10**6)
    line = "  ".join(h.ljust(widths[i]) for i, h in enumerate(header))
    print(line, file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in rows:
        cells = [str(v) for v in r]
        print("  ".join(c.ljust(widths[i]) if i < len(cells) - 1 else c for i, c in enumerate(cells)), file=file)


# ------------------------------------------------------------------------------------------------ run context
def fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        return f"{v:.4g}"
    return str(v)


class Ctx:
    def __init__(self, device, mode: str, budget_s: float):
        self.device = device
        self.cuda = device.type == "cuda"
        self.mode = mode
        self.rows: list[dict] = []
        self.t0 = T_START
        self.deadline = self.t0 + budget_s
        self.section_deadline = self.deadline
        self.lock = threading.Lock()

    def add(self, section, check, result, shape="", dtype="", target="", note="", flags=(), error="", **figures):
        row = dict(section=section, check=check, shape=shape, dtype=dtype, result=result, target=target,
                   flags=list(flags), note=note, error=error, figures=figures,
                   t_s=round(time.perf_counter() - self.t0, 2))
        with self.lock:
            self.rows.append(row)
        figs = "; ".join(f"{k}={fmt(v)}" for k, v in figures.items())
        extra = " | ".join(x for x in (figs, target, " ".join(f"!{f}" for f in flags), note, error) if x)
        print(f"[{row['t_s']:7.1f}s] {result:4s} {section}: {check} {shape} {dtype} {extra}", file=sys.stderr,
              flush=True)
        return row

    def over(self) -> bool:
        return time.perf_counter() > self.section_deadline

    def skip_if_over(self, section, check, shape="", dtype="") -> bool:
        if self.over():
            which = "global" if self.section_deadline >= self.deadline else "section"
            self.add(section, check, "SKIP", shape, dtype, note=f"{which} time budget used up")
            return True
        return False

    @contextlib.contextmanager
    def guard(self, section, check, shape="", dtype=""):
        """Record an exception as a FAIL row (message + last frame) and go on with the section."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every failure is reported as a row, then the run goes on
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            traceback.print_exc(file=sys.stderr)
            self.add(section, check, "FAIL", shape, dtype, error=f"{type(e).__name__}: {e}{where}"[:600])


def interleaved(timer: Timer, fns: dict, warmup: int, rounds: int, deadline: float, wall: bool = False) -> dict:
    """Warm-up every fn, then ``rounds`` rounds of A, B, (C) in turn (ABAB...): {name: [seconds per round]}.
    Stops early (after at least 2 rounds) when the deadline passes (benchmarks/_harness.py's interleave)."""
    return interleave(fns, rounds, warmup=warmup, timer=timer, deadline=deadline, wall=wall)


TOL = {  # per dtype: elementwise relative bound of one rounding (with margin) and attention atol = rtol
    "float16": dict(elem=2.0 ** -10, attn=2e-3),
    "bfloat16": dict(elem=2.0 ** -7, attn=1.6e-2),
    "float32": dict(elem=1e-6, attn=1e-5),
}


def err_stats(got, want, rtol: float, atol: float) -> tuple[bool, dict]:
    """assert_close semantics (|got - want| <= atol + rtol |want|) on float64 tensors; (ok, figures)."""
    d = (got.double() - want.double()).abs()
    w = want.double().abs()
    ok = bool((d <= atol + rtol * w).all())
    rel = float((d / w.clamp_min(1e-12)).max()) if d.numel() else 0.0
    return ok, dict(max_abs_err=float(d.max()) if d.numel() else 0.0, max_rel_err=rel)


# ------------------------------------------------------------------------------------------------ oracles
def bsa_oracle64(q, k, v, idx, num, vbs):
    """float64 block-sparse attention by the definition: token mask from the tile lists and live key rows;
    (out, lse in log2) with out = 0 and lse = -inf for rows that see no key."""
    import torch

    B, H, S, D = q.shape
    T, Tk = S // TILE, k.shape[2] // TILE
    cap = idx.shape[-1]
    slot = torch.arange(cap, device=q.device) < num.long()[..., None]
    allowed = torch.zeros(B, H, T, Tk + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(-1, torch.where(slot, idx.long(), torch.full_like(idx, Tk, dtype=torch.long)), True)
    allowed = allowed[..., :Tk]
    keylive = (torch.arange(TILE, device=q.device)[None] < vbs.to(q.device).long()[:, None]).reshape(-1)
    mask = allowed.repeat_interleave(TILE, 2).repeat_interleave(TILE, 3) & keylive
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return p @ v.double(), lse / LN2


def pooled64(x, tid, T):
    """float64 mean of each tile's packed rows ([B,H,S,D] -> [B,H,T,D])."""
    import torch

    S = x.shape[2]
    onehot = torch.zeros(T, S, dtype=torch.float64, device=x.device)
    onehot[tid, torch.arange(S, device=x.device)] = 1.0
    onehot = onehot / onehot.sum(1, keepdim=True)
    return onehot @ x.double()


def vsa_oracle64(q, k, v, tid, T, idx, num, gate=None):
    """float64 VSA-H3 over the packed sequence: SDPA with the token mask of the tile selection, plus the
    compression branch gate * softmax(pooled q k^T / sqrt(D)) pooled v."""
    import torch
    import torch.nn.functional as F

    B, H, S, D = q.shape
    cap = idx.shape[-1]
    slot = torch.arange(cap, device=q.device) < num.long()[..., None]
    allowed = torch.zeros(B, H, T, T + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(-1, torch.where(slot, idx.long(), torch.full_like(idx, T, dtype=torch.long)), True)
    mask = allowed[..., :T][:, :, tid][:, :, :, tid]
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    if gate is not None:
        sc = pooled64(q, tid, T) @ pooled64(k, tid, T).transpose(-1, -2) / math.sqrt(D)
        coarse = torch.softmax(sc, -1) @ pooled64(v, tid, T)
        out = out + coarse[:, :, tid] * gate.double()
    return out


# ------------------------------------------------------------------------------------------------ kernels
def delta_fuse_rounding(ctx: Ctx, sec: str) -> None:
    """Bit-level expectation of the rounding step inside ``kernels/delta_fuse._fuse_kernel``: the kernel rounds
    ``scale * ΔW`` into the weight's dtype *before* the add (as the chunked reference does), i.e. for every element
    ``w' = dt(float32(w) + float32(dt(float32(ΔW) * float32(scale))))``. For ``dense`` and ``kron`` deltas of a
    16-bit weight ΔW is exact in float32 (a value, or a product of two 8/11-bit mantissas), so the expectation is
    exact: ``torch.equal``. The data is chosen so that dropping the rounding step changes some elements (counted:
    ``differs_without_rounding`` > 0, else the check could not tell). The interpreter's fp32 -> bf16 cast is not
    round-to-nearest, so on CPU a bf16 mismatch is a SKIP with the figures; on CUDA any mismatch is a FAIL."""
    import torch

    from ditkit.kernels import delta_fuse

    dev = ctx.device
    for dname in ("float16", "bfloat16"):
        dt, dts = getattr(torch, dname), dtype_short(dname)
        for kind in ("dense", "kron"):
            check = f"delta_fuse rounding step ({kind}): bit-exact vs round(scale*dW) then add"
            with ctx.guard(sec, check, "W [96, 80]", dts):
                gen = torch.Generator(device="cpu").manual_seed(7 + len(dname) + len(kind))
                w = (torch.randn(96, 80, generator=gen) * 4).to(dt)
                if kind == "dense":
                    parts = ((torch.randn(96, 80, generator=gen) * 3).to(dt),)
                    d32 = parts[0].float()
                else:
                    parts = ((torch.randn(8, 10, generator=gen) * 2).to(dt), (torch.randn(12, 8, generator=gen)
                                                                               * 2).to(dt))
                    a, b = parts[0].float(), parts[1].float()
                    d32 = (a[:, None, :, None] * b[None, :, None, :]).reshape(96, 80)   # exact in fp32
                scale = 0.3                       # not a power of two: scale * ΔW needs the rounding
                s32 = torch.tensor(scale, dtype=torch.float32)
                want = (w.float() + (d32 * s32).to(dt).float()).to(dt)
                alt = (w.float() + d32 * s32).to(dt)          # the same kernel without its rounding step
                differs = int((want != alt).sum())
                got_w = w.to(dev).clone()
                delta_fuse.fuse_triton_(got_w, kind, tuple(p.to(dev) for p in parts), scale)
                got = got_w.cpu()
                exact = torch.equal(got, want)
                n_bad = int((got != want).sum())
                if exact and differs > 0:
                    res, note = "PASS", ""
                elif not ctx.cuda and dname == "bfloat16":
                    res, note = "SKIP", "Triton interpreter: fp32 -> bf16 is not round-to-nearest; bit-level on CUDA"
                else:
                    res, note = "FAIL", ("" if differs else "the data cannot tell the rounding step")
                ctx.add(sec, check, res, "W [96, 80]", dts, target="torch.equal; differs_without_rounding > 0",
                        note=note, mismatches=n_bad, differs_without_rounding=differs,
                        equals_unrounded=bool(torch.equal(got, alt)))


def quant_block_bits(ctx: Ctx, sec: str) -> None:
    """Bit-level expectation of the block formats' Triton kernels (``kernels/quant_triton.py``) on the device:
    every byte of the data and of the block scales equal to the CPU reference (``kernels/quant.py``, itself equal
    to the host's layout quantize). GPU-only differences this catches: the nvfp4 division (``tl.div_rn``; Triton's
    ``/`` on float32 may be approximate), denormal flushing, and the torch ``log2`` the mxfp8 exponent uses (on the
    device it is CUDA's). The weights hold random rows plus blocks at every e2m1 threshold, all-zero and
    negative-zero blocks, and tiny blocks. A second line counts the float32 values where the device's
    ``ceil(log2(.))`` differs from the CPU's (16.6 M values near powers of two): nonzero means the host's own
    mxfp8 quantize gives different exponents on the GPU and on the CPU for those block maxima (INFO)."""
    import torch

    from ditkit.kernels import quant as Q

    dev = ctx.device
    for fmt in ("mxfp8", "nvfp4"):
        for dname in ("float16", "bfloat16", "float32"):
            dt, dts = getattr(torch, dname), dtype_short(dname)
            check = f"{fmt} block kernels (triton) == CPU reference, every byte"
            with ctx.guard(sec, check, "W [300, 200] + edge blocks", dts):
                gen = torch.Generator(device="cpu").manual_seed(11 + len(dname))
                w = torch.randn(300, 200, generator=gen) * 0.05
                w[0, :32] = 0.0
                w[1, :32] = -0.0
                w[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 1e-2
                w[3, :32] = 1e-6
                w = w.to(dt)
                ref, rs = Q.quantize(w, fmt)
                got, gs = Q.quantize(w.to(dev), fmt, backend="triton")
                bad = int((got.cpu().view(torch.uint8) != ref.view(torch.uint8)).sum())
                bad_s = sum(int((gs[k].cpu().reshape(-1).view(torch.uint8) != rs[k].reshape(-1).view(torch.uint8))
                                .sum()) for k in rs)
                ctx.add(sec, check, "PASS" if bad == bad_s == 0 else "FAIL", "W [300, 200] + edge blocks", dts,
                        target="torch.equal of the bits", data_mismatches=bad, scale_mismatches=bad_s)
    check = "ceil(log2) of float32 near powers of two: device == CPU"
    with ctx.guard(sec, check, "254 exponents x 65536 mantissas", "fp32"):
        e = torch.arange(1, 255, dtype=torch.int64)[:, None] << 23
        b = (e | torch.arange(0, 1 << 16, dtype=torch.int64)[None, :]).reshape(-1).to(torch.int32)
        v = b.view(torch.float32)
        cpu = torch.ceil(torch.log2(v))
        on = torch.ceil(torch.log2(v.to(dev))).cpu()
        n = int((cpu != on).sum())
        ctx.add(sec, check, "INFO" if ctx.cuda else "SKIP", "254 exponents x 65536 mantissas", "fp32",
                note=("the host's mxfp8 exponents differ between devices for these block maxima" if n else
                      "same on both") if ctx.cuda else "CPU run: nothing to compare", differing_values=n)


def sec_kernels(ctx: Ctx, c: dict) -> None:
    import torch

    from ditkit.kernels import (REGISTRY, _triton, block_sparse_attn, build_h3_layout, pool_tiles, select_h3,
                                vsa_h3_attention)

    sec, dev = "kernels", ctx.device
    if not _triton.HAS_TRITON:
        ctx.add(sec, "(section)", "SKIP", note="triton is not installed: the Triton kernels cannot be checked")
        return
    g = h3_geometry(c["prefix"], c["video"])
    lay = build_h3_layout(tuple(c["prefix"]), tuple(c["video"]))
    geo_ok = (lay.seq_len, lay.n_tiles, lay.num_prefix_tiles, int((lay.sizes < TILE).sum())) == \
        (g["S"], g["T"], g["npre"], g["ragged"])
    ctx.add(sec, "layout geometry vs definition", "PASS" if geo_ok else "FAIL",
            f"S{lay.seq_len} tiles {lay.num_prefix_tiles}+{lay.num_video_tiles}", "",
            ragged_tiles=int((lay.sizes < TILE).sum()), expected_tiles=g["T"])
    delta_fuse_rounding(ctx, sec)
    quant_block_bits(ctx, sec)
    lay_d = lay.to(dev)
    tid = (lay_d.untile_index // TILE)
    T, S, B, H = lay.n_tiles, lay.seq_len, c["batch"], c["heads"]
    live = lay_d.tile_src >= 0
    for D in c["head_dims"]:
        for dname in c["dtypes"]:
            if ctx.skip_if_over(sec, f"D{D} {dname}"):
                return
            dt = getattr(torch, dname)
            tol = TOL[dname]
            shp = f"B{B} H{H} S{S} D{D} T{T}"
            dts = dtype_short(dname)
            gen = torch.Generator(device=dev).manual_seed(1000 * D + len(dname))

            def rnd(*shape):
                return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dt)

            x, kx, vx, gate = rnd(B, H, S, D), rnd(B, H, S, D), rnd(B, H, S, D), rnd(B, H, S, D)
            pk = REGISTRY.resolve("vsa_pack", dev, dt, D, "triton").fn
            pk_ref = REGISTRY.resolve("vsa_pack", dev, dt, D, "reference").fn
            un = REGISTRY.resolve("vsa_unpack_combine", dev, dt, D, "triton").fn
            xt = None
            with ctx.guard(sec, "pack", shp, dts):
                xt = pk(x, lay_d.tile_src)
                ref = pk_ref(x, lay_d.tile_src)
                exact = torch.equal(xt, ref)
                pads = bool((xt[:, :, ~live] == 0).all())
                ctx.add(sec, "pack (triton == reference, pad rows zero)", "PASS" if exact and pads else "FAIL",
                        shp, dts, max_abs_err=float((xt.double() - ref.double()).abs().max()), pad_rows_zero=pads)
            if xt is None:
                continue
            with ctx.guard(sec, "unpack", shp, dts):
                coarse = rnd(B, H, T, D)
                back = un(xt, lay_d.untile_index)
                res = [("gather", torch.equal(back, x), {})]
                for name, gt in (("+coarse", None), ("+coarse*gate", gate)):
                    got = un(xt, lay_d.untile_index, coarse, gt)
                    want = x.double() + coarse.double()[:, :, tid] * (gt.double() if gt is not None else 1.0)
                    ok, figs = err_stats(got, want, tol["elem"], 1e-6)
                    res.append((name, ok, figs))
                for name, ok, figs in res:
                    ctx.add(sec, f"unpack {name}" + (" (round trip, exact)" if name == "gather" else " vs float64"),
                            "PASS" if ok else "FAIL", shp, dts, target=f"rtol {tol['elem']:.3g}" if figs else "",
                            **figs)
            with ctx.guard(sec, "top-k selection", shp, dts):
                kt = pk(kx, lay_d.tile_src)
                qp, kp = pool_tiles(xt, lay_d.sizes), pool_tiles(kt, lay_d.sizes)
                # fp32 means of 64 rows (summation order differs by device): 1e-4 still catches any wrong pooling
                ok_p, figs_p = err_stats(qp, pooled64(x, tid, T), 1e-4, 1e-5)
                scores = qp @ kp.transpose(-1, -2) / math.sqrt(D)
                kv = lay.topk(c["keep"])
                sel = REGISTRY.resolve("vsa_select", dev, torch.float32, D)
                idx_d, num_d = sel.fn(scores, lay.num_prefix_tiles, lay.num_video_tiles, kv, True)
                idx_c, num_c = select_h3(scores.cpu(), lay.num_prefix_tiles, lay.num_video_tiles, kv, True)
                same = torch.equal(idx_d.cpu(), idx_c) and torch.equal(num_d.cpu(), num_c)
                ctx.add(sec, f"top-k selection k={kv} ({sel.backend}: torch.topk) on {dev.type} == CPU",
                        "PASS" if same and ok_p else "FAIL", shp, dts,
                        note="no Triton top-k exists in kernels/", pooled_vs_fp64_rel=figs_p["max_rel_err"])
            with ctx.guard(sec, "block-sparse fwd + LSE", shp, dts):
                kt, vt = pk(kx, lay_d.tile_src), pk(vx, lay_d.tile_src)
                idx = torch.rand(B, H, T, T, generator=gen, device=dev).argsort(-1).to(torch.int32)
                num = torch.randint(1, T + 1, (B, H, T), generator=gen, device=dev).to(torch.int32)
                num[0, 0, 1] = 0          # a query tile that sees no key tile
                num[B - 1, H - 1, 0] = T  # a dense query tile
                out, lse = block_sparse_attn(xt, kt, vt, idx, num, lay_d.sizes, backend="triton")
                o64, l64 = bsa_oracle64(xt, kt, vt, idx, num, lay_d.sizes)
                ok_o, f_o = err_stats(out, o64, tol["attn"], tol["attn"])
                fin = torch.isfinite(l64)
                ok_l, f_l = err_stats(lse[fin], l64[fin], tol["attn"], 10 * tol["attn"])
                empty_ok = bool((out[0, 0, TILE:2 * TILE] == 0).all()) and bool(torch.isinf(lse[0, 0, TILE:2 * TILE]).all())
                ref_fn = REGISTRY.resolve("block_sparse_attn", dev, dt, D, "reference").fn
                o_ref, _ = ref_fn(xt, kt, vt, idx, num, lay_d.sizes)
                ctx.add(sec, "block-sparse fwd + LSE (triton) vs float64", "PASS" if ok_o and ok_l and empty_ok
                        else "FAIL", shp, dts, target=f"atol=rtol {tol['attn']:.3g}", out_max_abs=f_o["max_abs_err"],
                        lse_max_abs=f_l["max_abs_err"], empty_row_ok=empty_ok,
                        vs_torch_reference_max_abs=float((out.double() - o_ref.double()).abs().max()),
                        pairs=int(num.long().sum()))
            with ctx.guard(sec, "VSA-H3 end to end + gate", shp, dts):
                out, st = vsa_h3_attention(x, kx, vx, lay, c["keep"], gate=gate, backend="triton")
                kt = pk(kx, lay_d.tile_src)
                sc = pool_tiles(xt, lay_d.sizes) @ pool_tiles(kt, lay_d.sizes).transpose(-1, -2) / math.sqrt(D)
                idx, num = select_h3(sc, lay.num_prefix_tiles, lay.num_video_tiles, lay.topk(c["keep"]))
                want = vsa_oracle64(x, kx, vx, tid, T, idx, num, gate)
                ok, figs = err_stats(out, want, tol["attn"], tol["attn"])
                ctx.add(sec, f"VSA-H3 end to end + gate, keep {c['keep']} vs float64",
                        "PASS" if ok and st.backend == "triton" else "FAIL", shp, dts,
                        target=f"atol=rtol {tol['attn']:.3g}", backend=st.backend, pack=st.pack_backend,
                        density=st.density, **figs)
            del x, kx, vx, gate, xt


# ------------------------------------------------------------------------------------------------ int64
def sec_int64(ctx: Ctx, c: dict) -> None:
    import torch

    from ditkit.kernels import REGISTRY, _triton, block_sparse_attn, build_h3_layout

    sec, dev = "int64", ctx.device
    if not _triton.HAS_TRITON:
        ctx.add(sec, "(section)", "SKIP", note="triton is not installed")
        return
    with ctx.guard(sec, "offs64 probe kernels"):
        N, grid, stride = 16, 4, 1_000_000_000
        got = torch.zeros(grid * N, dtype=torch.int64, device=dev)
        _triton._offs64_probe_kernel[(grid,)](got, stride, N=N)
        want = torch.arange(grid * N, dtype=torch.int64) * stride
        ok64 = torch.equal(got.cpu(), want)
        bad = torch.zeros(grid * N, dtype=torch.int64, device=dev)
        _triton._offs32_probe_kernel[(grid,)](bad, stride, N=N)
        wraps = not torch.equal(bad.cpu(), want)
        ctx.add(sec, "offs64 probe exact; unpromoted i32 form wraps", "PASS" if ok64 and wraps else "FAIL",
                f"{grid * N} rows x stride {stride:.0e}", "int64", max_offset=int(want.max()), i32_form_wraps=wraps)
    H, D = c["heads"], c["head_dim"]
    if H == 0:
        ctx.add(sec, "pack / block-sparse / unpack past 2**31 elements", "SKIP",
                note="CPU --tiny mode: needs >= 2**31-element device tensors (about 20 GB)")
        return
    dt, dts = getattr(torch, c["dtype"]), dtype_short(c["dtype"])
    lay = build_h3_layout(tuple(c["prefix"]), tuple(c["video"]))
    lay_d = lay.to(dev)
    S, P, T = lay.seq_len, lay.padded_len, lay.n_tiles
    o_in, o_pad = H * S * D - 1, H * P * D - 1
    shp = f"[1, {H}, {S}/{P}, {D}]"
    heads = sorted({0, H // 2, H - 1})
    over = [h for h in heads if h * P * D >= I32_LIMIT]
    gen = torch.Generator(device=dev).manual_seed(64)
    pk = REGISTRY.resolve("vsa_pack", dev, dt, D, "triton").fn
    pk_ref = REGISTRY.resolve("vsa_pack", dev, dt, D, "reference").fn
    un = REGISTRY.resolve("vsa_unpack_combine", dev, dt, D, "triton").fn
    x = xt = out = None
    with ctx.guard(sec, "pack past 2**31", shp, dts):
        x = torch.randn(1, H, S, D, generator=gen, device=dev, dtype=dt)
        xt = pk(x, lay_d.tile_src)
        ok = all(torch.equal(xt[:, h], pk_ref(x[:, h:h + 1], lay_d.tile_src)[:, 0]) for h in heads)
        ctx.add(sec, "pack past 2**31", "PASS" if ok else "FAIL", shp, dts, max_offset_in=o_in, max_offset_out=o_pad,
                heads_checked=",".join(map(str, heads)), heads_past_2_31=",".join(map(str, over)),
                tensor_bytes=xt.numel() * xt.element_size())
    x = None
    if xt is None or ctx.skip_if_over(sec, "block-sparse fwd past 2**31", shp, dts):
        return
    with ctx.guard(sec, "block-sparse fwd past 2**31", shp, dts):
        cap = c["cap"]
        start = torch.randint(0, T, (1, H, T, 1), generator=gen, device=dev)
        idx = ((start + torch.arange(cap, device=dev) * (T // cap)) % T).to(torch.int32)   # distinct per row
        num = torch.full((1, H, T), cap, dtype=torch.int32, device=dev)
        out, lse = block_sparse_attn(xt, xt, xt, idx, num, lay_d.sizes, backend="triton")
        ref_fn = REGISTRY.resolve("block_sparse_attn", dev, torch.float32, D, "reference").fn
        worst, ok = 0.0, True
        for h in (heads[0], heads[-1]):
            s = xt[:, h:h + 1].float()
            o_r, l_r = ref_fn(s, s, s, idx[:, h:h + 1], num[:, h:h + 1], lay_d.sizes)
            a, fa = err_stats(out[:, h:h + 1], o_r, TOL[c["dtype"]]["attn"], TOL[c["dtype"]]["attn"])
            b, _ = err_stats(lse[:, h:h + 1], l_r, 1e-4, 1e-3)
            ok = ok and a and b
            worst = max(worst, fa["max_abs_err"])
        ctx.add(sec, "block-sparse fwd past 2**31", "PASS" if ok else "FAIL", shp, dts,
                target=f"vs float32 reference, atol=rtol {TOL[c['dtype']]['attn']:.3g}", max_offset=o_pad,
                out_max_abs_err=worst, key_tiles_per_query=cap)
    xt = None
    if out is None or ctx.skip_if_over(sec, "unpack + coarse*gate past 2**31", shp, dts):
        return
    with ctx.guard(sec, "unpack + coarse*gate past 2**31", shp, dts):
        coarse = torch.randn(1, H, T, D, generator=gen, device=dev, dtype=dt)
        gate = torch.randn(1, H, S, D, generator=gen, device=dev, dtype=dt)
        res = un(out, lay_d.untile_index, coarse, gate)
        tid = lay_d.untile_index // TILE
        ok, worst = True, 0.0
        for h in heads:
            want = out[:, h].double()[:, lay_d.untile_index] + coarse[:, h].double()[:, tid] * gate[:, h].double()
            a, f = err_stats(res[:, h], want, TOL[c["dtype"]]["elem"], 1e-6)
            ok, worst = ok and a, max(worst, f["max_rel_err"])
        ctx.add(sec, "unpack + coarse*gate past 2**31", "PASS" if ok else "FAIL", shp, dts,
                target=f"rtol {TOL[c['dtype']]['elem']:.3g}", max_offset_fine=o_pad, max_offset_out=o_in,
                max_rel_err=worst)
        del coarse, gate, res
    del out


# ------------------------------------------------------------------------------------------------ VSA perf
def device_peak_flops(ctx: Ctx):
    if not ctx.cuda:
        return None
    import torch

    name = torch.cuda.get_device_name(ctx.device)
    for key, peak in PEAK_BF16:
        if all(part in name for part in key.split()):
            return peak
    return None


def sec_vsa_perf(ctx: Ctx, c: dict) -> None:
    import torch
    import torch.nn.functional as F

    from ditkit.kernels import (REGISTRY, _triton, block_sparse_attn, build_h3_layout, pool_tiles, select_h3,
                                vsa_h3_attention)

    sec, dev = "vsa_perf", ctx.device
    if not _triton.HAS_TRITON:
        ctx.add(sec, "(section)", "SKIP", note="triton is not installed: VSA-H3 runs its Triton backend here")
        return
    dt, dts = getattr(torch, c["dtype"]), dtype_short(c["dtype"])
    H, D = c["heads"], c["head_dim"]
    timer = Timer(dev)
    peak = device_peak_flops(ctx)
    is_h200 = ctx.cuda and "H200" in torch.cuda.get_device_name(dev)
    if ctx.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def dense_ctx():
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        dense_name = "SDPA-flash"
    else:
        dense_ctx = contextlib.nullcontext
        dense_name = "SDPA (cpu default)"
    for label, prefix, video in c["cases"]:
        if ctx.skip_if_over(sec, f"{label}"):
            return
        lay = build_h3_layout(tuple(prefix), tuple(video))
        lay_d = lay.to(dev)
        S, T = lay.seq_len, lay.n_tiles
        gen = torch.Generator(device=dev).manual_seed(S)
        q, k, v = (torch.randn(1, H, S, D, generator=gen, device=dev, dtype=dt) for _ in range(3))
        dense_flops = attention_flops(S, D, H)

        def dense():
            with dense_ctx():
                return F.scaled_dot_product_attention(q, k, v)

        pk = REGISTRY.resolve("vsa_pack", dev, dt, D, "triton").fn
        qt, kt, vt = (pk(x, lay_d.tile_src) for x in (q, k, v))
        sc = pool_tiles(qt, lay_d.sizes) @ pool_tiles(kt, lay_d.sizes).transpose(-1, -2) / math.sqrt(D)
        for keep in c["keeps"]:
            shp = f"{label} S{S} T{T} B1 H{H} D{D} keep {keep:g}"
            if ctx.skip_if_over(sec, "dense vs VSA-H3", shp, dts):
                return
            with ctx.guard(sec, "dense vs VSA-H3", shp, dts):
                kk = lay.topk(keep)
                idx, num = select_h3(sc, lay.num_prefix_tiles, lay.num_video_tiles, kk)
                pairs = int(num.long().sum())
                fine_flops = tile_pair_flops(pairs, D)
                ceiling = dense_flops / fine_flops

                def fine():
                    return block_sparse_attn(qt, kt, vt, idx, num, lay_d.sizes, backend="triton")

                def whole():
                    return vsa_h3_attention(q, k, v, lay, keep, backend="triton")

                t = interleaved(timer, {"dense": dense, "fine": fine, "vsa": whole}, c["warmup"], c["rounds"],
                                ctx.section_deadline)
                td, tf, tw = (statistics.median(t[n]) for n in ("dense", "fine", "vsa"))
                ctx.add(sec, f"dense {dense_name}", "INFO", shp, dts, ms=td * 1e3,
                        tflops=dense_flops / td / 1e12, rounds=len(t["dense"]),
                        flags=(["above device peak: noise"] if peak and dense_flops / td > peak else []))
                target7 = abs(keep - 0.1) < 1e-9
                for name, tn, times in (("fine stage (block-sparse kernel)", tf, t["fine"]),
                                        ("VSA-H3 whole call", tw, t["vsa"])):
                    r = ratio_stats(t["dense"], times)
                    flags = [f"ratio above its FLOP ceiling {ceiling:.2f}x: noise"] if r["median"] > ceiling else []
                    res = ("PASS" if r["median"] >= 7 else "FAIL") if target7 else "INFO"
                    ctx.add(sec, f"speedup dense / {name}", res, shp, dts,
                            target="target >= 7x (90 % sparsity)" if target7 else "", flags=flags,
                            ratio_median=r["median"], ratio_min=r["min"], ratio_max=r["max"], rounds=r["rounds"],
                            ceiling=ceiling, one_over_keep=1 / keep, ms=tn * 1e3)
                eff, work = dense_flops / tf / 1e12, fine_flops / tf / 1e12
                flags = ["computed TFLOP/s above device peak: noise"] if peak and work * 1e12 > peak else []
                res = ("PASS" if eff >= 400 else "FAIL") if is_h200 else "INFO"
                ctx.add(sec, "fine stage TFLOP/s", res, shp, dts,
                        target="target >= 400 effective on H200" if is_h200 else "400 target is for H200",
                        flags=flags, effective_tflops=eff, computed_tflops=work,
                        device_peak_tflops=(peak / 1e12 if peak else "unknown"), block_density=pairs / (H * T * T),
                        note="effective = dense-equivalent 4*S^2*D*H / time; computed = 4*64*64*D*pairs / time")
                o_fine, _ = fine()
                livem = torch.arange(TILE, device=dev)[None] < lay_d.sizes[:, None]
                err = 0.0
                tiles = torch.randint(0, T, (6,), generator=torch.Generator().manual_seed(1)).tolist()
                for ti in tiles:
                    n_live = int(lay_d.sizes[ti])
                    for h in sorted({0, H // 2, H - 1}):
                        sel_t = idx[0, h, ti, : int(num[0, h, ti])].long()
                        rows = (sel_t[:, None] * TILE + torch.arange(TILE, device=dev)).reshape(-1)[
                            livem[sel_t].reshape(-1)]
                        qr = qt[0, h, ti * TILE: ti * TILE + n_live].double()
                        ref = F.scaled_dot_product_attention(qr[None], kt[0, h, rows].double()[None],
                                                             vt[0, h, rows].double()[None])[0]
                        err = max(err, float((o_fine[0, h, ti * TILE: ti * TILE + n_live].double() - ref).abs().max()))
                tol = TOL[c["dtype"]]["attn"]
                ctx.add(sec, "fine stage vs float64 (6 sampled query tiles x 3 heads)", "PASS" if err <= tol else "FAIL",
                        shp, dts, target=f"max abs <= {tol:.3g}", max_abs_err=err)
                del o_fine
        q = k = v = qt = kt = vt = sc = None


# ------------------------------------------------------------------------------------------------ TE streaming
def build_te_model(c: dict, device, dtype, seed: int):
    """A llama-style decoder with the shapes of ``c`` (RMSNorm, GQA attention, SwiGLU MLP, tied nothing)."""
    import torch
    import torch.nn.functional as F

    class RMSNorm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()).to(x.dtype)

    nq, nkv, hd, h, ff = c["heads"], c["kv_heads"], c["head_dim"], c["hidden"], c["ff"]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(h)
            self.q_proj = torch.nn.Linear(h, nq * hd, bias=False)
            self.k_proj = torch.nn.Linear(h, nkv * hd, bias=False)
            self.v_proj = torch.nn.Linear(h, nkv * hd, bias=False)
            self.o_proj = torch.nn.Linear(nq * hd, h, bias=False)
            self.post_attention_layernorm = RMSNorm(h)
            self.gate_proj = torch.nn.Linear(h, ff, bias=False)
            self.up_proj = torch.nn.Linear(h, ff, bias=False)
            self.down_proj = torch.nn.Linear(ff, h, bias=False)

        def forward(self, x):
            B, L, _ = x.shape
            y = self.input_layernorm(x)
            q = self.q_proj(y).view(B, L, nq, hd).transpose(1, 2)
            k = self.k_proj(y).view(B, L, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, 1)
            v = self.v_proj(y).view(B, L, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, nq * hd)
            x = x + self.o_proj(a)
            y = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(c["vocab"], h)
            self.layers = torch.nn.ModuleList([Layer() for _ in range(c["layers"])])
            self.norm = RMSNorm(h)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    torch.manual_seed(seed)
    with torch.device(device):
        m = Decoder()
    return m.to(dtype).eval()


def sec_te_stream(ctx: Ctx, c: dict) -> None:
    import copy

    import torch

    from ditkit.offload.streamer import ALIGN, HostEmbedding, LayerwiseStreamer, StreamedLayer

    sec, dev = "te_stream", ctx.device
    dt, dts = getattr(torch, c["dtype"]), dtype_short(c["dtype"])
    timer, mem = Timer(dev), Mem(dev)
    resident = build_te_model(c, dev, dt, seed=3)
    layer_bytes = [sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
                   for m in resident.layers]
    n_tensors = len(list(resident.layers[0].parameters())) + len(list(resident.layers[0].buffers()))
    streamed = copy.deepcopy(resident)
    streamed.embed_tokens.to("cpu")
    t_pack = time.perf_counter()
    st = LayerwiseStreamer(list(streamed.layers), dev, prefetch=c["prefetch"])
    for i in range(len(streamed.layers)):
        streamed.layers[i] = StreamedLayer(st, i)
    streamed.embed_tokens = HostEmbedding(streamed.embed_tokens, st.stats)
    t_pack = time.perf_counter() - t_pack
    gc.collect()
    pinned = all(b.is_pinned() for p in st.packs for b in p.host.values()) if ctx.cuda else False
    shp = f"{c['layers']} x {mib(max(layer_bytes))}"
    bw = None
    if ctx.cuda:
        buf = next(iter(st.packs[0].host.values()))
        dst = torch.empty(buf.numel(), dtype=torch.uint8, device=dev)
        ts = [timer.once(lambda: dst.copy_(buf, non_blocking=True))[0] for _ in range(4)][1:]
        bw = buf.numel() / statistics.median(ts)
        del dst
    ctx.add(sec, "streamer installed", "INFO", shp, dts, pinned_host_packs=pinned, pack_seconds=t_pack,
            host_bytes=st.host_bytes, h2d_GBps=(bw / 1e9 if bw else "n/a (cpu)"), prefetch=c["prefetch"])
    gen = torch.Generator(device=dev).manual_seed(5)
    for L in c["tokens"]:
        shp = f"{c['layers']} x {mib(max(layer_bytes))}, {L} tokens"
        if ctx.skip_if_over(sec, f"{L} tokens", shp, dts):
            return
        ids = torch.randint(0, c["vocab"], (1, L), generator=gen, device=dev)
        with torch.no_grad(), ctx.guard(sec, f"streamed == resident, {L} tokens", shp, dts):
            ref, _ = resident(ids), streamed(ids)          # warm-up both (cuBLAS workspaces, first copies)
            ref, act = mem.measure(lambda: resident(ids))
            st.stats.reset()
            got, extra = mem.measure(lambda: streamed(ids))
            equal = torch.equal(ref, got)
            ctx.add(sec, f"streamed == resident, {L} tokens", "PASS" if equal else "FAIL", shp, dts,
                    max_abs_diff=float((ref.double() - got.double()).abs().max()),
                    prefetch_hits=st.last_pass["prefetch_hits"] if st.last_pass else None,
                    sync_loads=st.last_pass["sync_loads"] if st.last_pass else None)
            # (1 + prefetch) layer packs, each padded to ALIGN per tensor and rounded by the caching allocator
            # (large blocks: 2 MiB) once per dtype buffer
            n_bufs = len(st.packs[0].host)
            bound_layers = (1 + c["prefetch"]) * (max(layer_bytes) + n_tensors * ALIGN + n_bufs * 2**21)
            if extra is None:
                ctx.add(sec, f"peak device memory, {L} tokens", "SKIP", shp, dts,
                        note="device memory statistics need CUDA",
                        streamer_accounted_peak=st.last_pass["peak_device_bytes"] if st.last_pass else None)
            else:
                bound = bound_layers + act
                ctx.add(sec, f"peak device memory, {L} tokens", "PASS" if extra <= bound else "FAIL", shp, dts,
                        target=f"<= {1 + c['prefetch']} layers + activations", streamed_extra=mib(extra),
                        bound=mib(bound), layers_part=mib(bound_layers), resident_activations=mib(act),
                        streamed_extra_layers=extra / max(layer_bytes),
                        streamer_accounted_peak=mib(st.last_pass["peak_device_bytes"]) if st.last_pass else None)
            ref = got = None
        if ctx.skip_if_over(sec, f"time, {L} tokens", shp, dts):
            return
        with torch.no_grad(), ctx.guard(sec, f"time streamed / resident, {L} tokens", shp, dts):
            t = interleaved(timer, {"resident": lambda: resident(ids), "streamed": lambda: streamed(ids)},
                            c["warmup"], c["rounds"], ctx.section_deadline, wall=True)
            r = ratio_stats(t["streamed"], t["resident"])
            tr = statistics.median(t["resident"])
            floor = max(1.0, (st.host_bytes / bw) / tr) if bw else None
            flags = [f"ratio below the copy floor {floor:.2f}: noise"] if floor and r["median"] < floor * 0.97 else []
            res = "PASS" if r["median"] <= 1.10 else "FAIL"
            if not ctx.cuda:
                res = "INFO"
            ctx.add(sec, f"time streamed / resident, {L} tokens", res, shp, dts,
                    target="target <= 1.10" if ctx.cuda else "cpu->cpu copies: no target", flags=flags,
                    ratio_median=r["median"], ratio_min=r["min"], ratio_max=r["max"], rounds=r["rounds"],
                    resident_ms=tr * 1e3, copy_floor_ratio=floor if floor else "n/a",
                    note="copy floor = host bytes / measured H2D bandwidth / resident time (>= 1)")
    st.drop_all()
    resident = streamed = st = None


# ------------------------------------------------------------------------------------------------ AdaLN
def build_adaln_model(c: dict, device, dtype, seed: int):
    """Blocks with an H3-style AdalnProj (``linear`` over silu(t_emb), view to rows, chunk) that modulate x."""
    import torch
    import torch.nn.functional as F

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.expand, self.modalities, self.hidden, self.apply_silu = c["expand"], c["modalities"], c["hidden"], True
            self.linear = torch.nn.Linear(c["t_dim"], c["expand"] * c["hidden"] * c["modalities"])

        def forward(self, t_emb):
            x = self.linear(F.silu(t_emb))
            x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
            return x.chunk(self.expand, dim=-1)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.adaln_proj = Proj()
            self.lin = torch.nn.Linear(c["hidden"], c["hidden"])

        def forward(self, x, t_emb):
            mods = self.adaln_proj(t_emb)
            shift, scale, gate = (m.mean(0) for m in mods[:3])
            y = F.layer_norm(x, (x.shape[-1],)) * (1 + scale) + shift
            return x + 0.1 * gate * self.lin(y)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(c["blocks"])])

        def forward(self, x, t_emb):
            for b in self.blocks:
                x = b(x, t_emb)
            return x

    torch.manual_seed(seed)
    with torch.device(device):
        m = Model()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    return m.to(dtype).eval()


def adaln_t_emb(sigma: float, c: dict, device, dtype):
    """The time embedding of one forward: M rows (video timestep, audio timestep at half), sinusoidal."""
    import torch

    ts = torch.tensor([sigma * 1000.0, sigma * 500.0][: c["rows"]], dtype=torch.float32, device=device)
    half = c["t_dim"] // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=device) / half)
    a = ts[:, None] * freqs[None]
    return torch.cat([torch.cos(a), torch.sin(a)], -1).to(dtype)


def adaln_sample(model, x0, sigmas, c, device, dtype):
    x = x0.clone()
    for i in range(len(sigmas) - 1):
        den = model(x, adaln_t_emb(sigmas[i], c, device, dtype))
        x = x + (sigmas[i + 1] - sigmas[i]) * (x - den) / sigmas[i]
    return x


def sec_adaln(ctx: Ctx, c: dict) -> None:
    import copy

    import torch

    from ditkit.cache.adaln import AdalnScheduleCache, fp32_bits

    sec, dev = "adaln", ctx.device
    dt, dts = getattr(torch, c["dtype"]), dtype_short(c["dtype"])
    timer, mem = Timer(dev), Mem(dev)
    out_f = c["expand"] * c["hidden"] * c["modalities"]
    shp = f"{c['blocks']} x Linear({c['t_dim']} -> {out_f}), {c['steps']} steps, M={c['rows']}, {c['tokens']} tokens"
    uncached = build_adaln_model(c, dev, dt, seed=11)
    cached = copy.deepcopy(uncached)
    sigmas = [1.0 - i / c["steps"] * 0.98 for i in range(c["steps"] + 1)]    # 1.0 -> 0.02, no zero division
    x0 = torch.randn(1, c["tokens"], c["hidden"], generator=torch.Generator(device=dev).manual_seed(12), device=dev,
                     dtype=torch.float32).to(dt)
    with torch.no_grad():
        ref = adaln_sample(uncached, x0, sigmas, c, dev, dt)
        cache = AdalnScheduleCache()
        for i, b in enumerate(cached.blocks):
            b.adaln_proj = cache.wrap(b.adaln_proj, f"blocks.{i}.adaln_proj")
        before = mem.allocated()
        embs = [adaln_t_emb(s, c, dev, dt) for s in sigmas[:-1]]
        cache.build(("gpu_check", tuple(fp32_bits(sigmas)), str(dev), str(dt)), embs)
        del embs
        gc.collect()
        after = mem.allocated()
        got = adaln_sample(cached, x0, sigmas, c, dev, dt)
    s = cache.stats
    equal = torch.equal(ref, got)
    ctx.add(sec, "cached sampling == uncached", "PASS" if equal and s.misses == 0 else "FAIL", shp, dts,
            hits=s.hits, misses=s.misses, expected_hits=c["steps"] * c["blocks"],
            max_abs_diff=float((ref.double() - got.double()).abs().max()))
    es = torch.empty((), dtype=dt).element_size()
    w_exp = c["blocks"] * (out_f * c["t_dim"] + out_f) * es
    t_exp = c["blocks"] * c["steps"] * c["rows"] * out_f * es
    if before is None:
        ctx.add(sec, "device bytes freed", "SKIP", shp, dts, note="CPU: AdaLN weights are not parked off an "
                "accelerator", table_bytes=s.table_bytes, expected_table_bytes=t_exp)
    else:
        freed = before - after
        slack = 2**20 + c["blocks"] * (c["steps"] + 2) * 512
        ok = abs(freed - (w_exp - t_exp)) <= slack and s.weight_bytes_parked == w_exp and s.table_bytes == t_exp
        ctx.add(sec, "device bytes freed", "PASS" if ok else "FAIL", shp, dts,
                target="freed == weights - tables (shape formula) within allocator rounding",
                freed=mib(freed), expected=mib(w_exp - t_exp), weights=mib(w_exp), tables=mib(t_exp),
                parked=mib(s.weight_bytes_parked), park_mode=s.park_mode)
    if ctx.skip_if_over(sec, "time cached / uncached", shp, dts):
        return
    with torch.no_grad(), ctx.guard(sec, "time cached / uncached", shp, dts):
        t = interleaved(timer, {"uncached": lambda: adaln_sample(uncached, x0, sigmas, c, dev, dt),
                                "cached": lambda: adaln_sample(cached, x0, sigmas, c, dev, dt)},
                        c["warmup"], c["rounds"], ctx.section_deadline, wall=True)
        r = ratio_stats(t["cached"], t["uncached"])
        ctx.add(sec, "time cached / uncached (whole sampling)", "INFO", shp, dts, ratio_median=r["median"],
                ratio_min=r["min"], ratio_max=r["max"], rounds=r["rounds"],
                uncached_ms_per_step=statistics.median(t["uncached"]) / c["steps"] * 1e3)
    cache.invalidate()
    uncached = cached = None


# ------------------------------------------------------------------------------------------------ video save
class FakeChunkedVideoVAE:
    """Duck-typed chunked-output video VAE (ComfyUI's ``comfy_has_chunked_io`` contract): ``decode`` writes each
    finished temporal chunk into ``output_buffer[:, :, a:b].copy_(chunk)`` in order. 1 + 4 (T - 1) frames,
    ``ratio`` x spatial upsampling, values in about [-1.2, 1.2] (so the clamp matters)."""

    comfy_has_chunked_io = True

    def __init__(self, c: dict, device, dtype):
        import torch

        g = torch.Generator(device=device).manual_seed(21)
        self.w = torch.randn(3, c["latent"][0], generator=g, device=device) / c["latent"][0] ** 0.5
        self.r, self.chunk, self.dtype, self.device = c["ratio"], c["chunk"], dtype, device

    def decode_output_shape(self, shape):
        b, _, t, h, w = shape
        return (b, 3, 1 + 4 * (t - 1), h * self.r, w * self.r)

    def _pixels(self, z, first_frame: int, drop: int):
        import torch

        base = torch.einsum("bcthw,kc->bkthw", z.float(), self.w)
        x = base.repeat_interleave(4, 2)[:, :, drop:]
        n = x.shape[2]
        ph = torch.arange(first_frame, first_frame + n, device=z.device, dtype=torch.float32).view(1, 1, n, 1, 1)
        x = 1.2 * torch.tanh(x + 0.3 * torch.sin(0.7 * ph))
        x = x.repeat_interleave(self.r, 3).repeat_interleave(self.r, 4)
        return x.to(self.dtype)

    def decode(self, z, output_buffer):
        written = 0
        for a in range(0, z.shape[2], self.chunk):
            pix = self._pixels(z[:, :, a:a + self.chunk], written, 3 if a == 0 else 0)
            output_buffer[:, :, written:written + pix.shape[2]].copy_(pix)
            written += pix.shape[2]
            del pix
        return output_buffer


def comfy_uint8(x):
    """ComfyUI SaveVideo's quantisation written out (the oracle, independent of the code under test):
    [B, 3, t, H, W] float in [0, 1] -> [B*t, H, W, 3] uint8, ``(x * 255).clamp(0, 255)`` truncated."""
    import torch

    x = x.movedim(1, -1)
    return (x * 255).clamp(0, 255).to(torch.uint8).reshape(-1, *x.shape[-3:])


def video_process(x):
    """What the native VAE wrapper's ``process_output`` does for these VAEs: [-1, 1] -> [0, 1]."""
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


def sec_video_save(ctx: Ctx, c: dict) -> None:
    import torch

    from ditkit.vae.video_stream import PyAVVideoWriter, Uint8FrameSink

    sec, dev = "video_save", ctx.device
    dt, dts = getattr(torch, c["dtype"]), dtype_short(c["dtype"])
    timer, mem = Timer(dev), Mem(dev)
    vae = FakeChunkedVideoVAE(c, dev, dt)
    C, T, h, w = c["latent"]
    z = torch.randn(1, C, T, h, w, generator=torch.Generator(device=dev).manual_seed(22), device=dev).to(dt)
    shape = vae.decode_output_shape(tuple(z.shape))
    frames, H, W = shape[2], shape[3], shape[4]
    full_f32 = frames * 3 * H * W * 4
    shp = f"{frames} frames {W}x{H} ({T} latent frames, chunks of {c['chunk']})"

    def native():
        buf = torch.empty(shape, dtype=torch.float32, device=dev)
        vae.decode(z, output_buffer=buf)
        host = video_process(buf).cpu()       # VAEDecode hands a float video to the host; SaveVideo quantises there
        return comfy_uint8(host)

    def streaming(on_frames):
        sink = Uint8FrameSink(shape, on_frames, out_dtype=torch.float32, process=video_process)
        vae.decode(z, output_buffer=sink)
        return sink

    with torch.no_grad():
        ref, peak_native = mem.measure(native)
        got_frames: list = []
        sink, peak_stream = mem.measure(lambda: streaming(got_frames.append))
        got = torch.cat(got_frames)
        equal = got.shape == ref.shape and torch.equal(got, ref)
        lsb = int((got.int() - ref.int()).abs().max()) if got.shape == ref.shape else None
        ctx.add(sec, "uint8 on device (streaming) == whole float video path", "PASS" if equal else "FAIL", shp, dts,
                max_lsb_diff=lsb, chunks=sink.stats.chunks, frames=sink.stats.frames)
        if peak_stream is None:
            ctx.add(sec, "peak device memory", "SKIP", shp, "", note="device memory statistics need CUDA",
                    peak_chunk_float=mib(sink.stats.peak_chunk_float_bytes), whole_float_video=mib(full_f32))
        else:
            ctx.add(sec, "peak device memory", "PASS" if peak_stream < full_f32 else "FAIL", shp, "",
                    target="streaming < the whole float32 video", streaming=mib(peak_stream),
                    whole_float_path=mib(peak_native), ratio=peak_native / max(peak_stream, 1),
                    whole_float_video=mib(full_f32), peak_chunk_float=mib(sink.stats.peak_chunk_float_bytes))
        ctx.add(sec, "device->host bytes", "INFO", shp, "", streaming_uint8=mib(sink.stats.uint8_bytes),
                whole_float_path=mib(full_f32), ratio=full_f32 / max(sink.stats.uint8_bytes, 1))
        ref = got = got_frames = None
        if not ctx.skip_if_over(sec, "time streaming / whole float path", shp, dts):
            with ctx.guard(sec, "time streaming / whole float path", shp, dts):
                t = interleaved(timer, {"native": native, "stream": lambda: streaming(lambda f: None)},
                                c["warmup"], c["rounds"], ctx.section_deadline, wall=True)
                r = ratio_stats(t["stream"], t["native"])
                ctx.add(sec, "time streaming / whole float path (decode + uint8 + D2H, no encode)", "INFO", shp,
                        dts, ratio_median=r["median"], ratio_min=r["min"], ratio_max=r["max"], rounds=r["rounds"],
                        native_ms=statistics.median(t["native"]) * 1e3)
        try:
            import av
        except ImportError as e:
            ctx.add(sec, "MP4 via PyAV (streaming writer)", "SKIP", shp, "", note=f"PyAV not importable ({e})")
            return
        if not c["encode"] or ctx.skip_if_over(sec, "MP4 via PyAV", shp, ""):
            return
        with ctx.guard(sec, "MP4 via PyAV", shp, ""):
            d = tempfile.mkdtemp(prefix="gpu_check_video_")
            try:
                path = os.path.join(d, "stream.mp4")
                writer = PyAVVideoWriter(path, 24.0, W, H)
                try:
                    el, _ = timer.once(lambda: streaming(writer.write), wall=True)
                    writer.finish()
                except BaseException:
                    writer.abort()
                    raise
                with av.open(path) as f:
                    n = sum(1 for _ in f.decode(video=0))
                ctx.add(sec, "MP4 via PyAV (streaming writer)", "PASS" if n == frames else "FAIL", shp, "",
                        frames_in_file=n, seconds=el, fps=frames / el, file_bytes=os.path.getsize(path))
            finally:
                shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ T=1 decode
def sec_t1_decode(ctx: Ctx, c: dict) -> None:
    import torch

    from benchmarks._fakes import FakeH3VideoVAE, full_tiled_decode  # the unit tests' fake, on this device
    from ditkit.bridge.vae import repeat_decode_t1, unwhiten

    sec, dev = "t1_decode", ctx.device
    mem = Mem(dev)
    m = FakeH3VideoVAE(c["latent"][0], 31, device=dev, vae_ratio=c["ratio"], tile_size=c["tile"],
                       tile_overlap_min=c["overlap"])
    C, _, h, w = c["latent"]
    B = c["batch"]
    z = torch.randn(B, C, 1, h, w, generator=torch.Generator(device=dev).manual_seed(32), device=dev)
    H, W = h * m.vae_ratio, w * m.vae_ratio
    shp = f"[{B}, {C}, 1, {h}, {w}] -> {W}x{H}"
    with torch.no_grad():
        (out, rep), peak_t1 = mem.measure(lambda: repeat_decode_t1(m, z))

        def full():
            clip = unwhiten(m, z).repeat(1, 1, 7, 1, 1)
            return m._finalize_pixels(full_tiled_decode(m, clip)[:, :, 3:4])

        ref, peak_full = mem.measure(full)
    equal = torch.equal(out, ref)
    ctx.add(sec, "repeat-decode == frame 3 of the full 7-token clip decode", "PASS" if equal else "FAIL", shp, "fp32",
            tiles=rep.tiles, tokens=rep.tokens_decoded, kept_raw_frame=rep.kept_raw_frame,
            max_abs_diff=float((out.double() - ref.double()).abs().max()))
    canvas28 = B * 28 * 3 * H * W * 4
    if peak_t1 is None:
        ctx.add(sec, "peak device memory", "SKIP", shp, "", note="device memory statistics need CUDA",
                canvas=mib(rep.canvas_bytes), max_tile=mib(rep.max_tile_bytes))
    else:
        ctx.add(sec, "peak device memory", "PASS" if peak_t1 < canvas28 else "FAIL", shp, "",
                target="< one 28-frame float32 canvas", repeat_decode=mib(peak_t1), full_clip_decode=mib(peak_full),
                ratio=peak_full / max(peak_t1, 1), floor_canvas_plus_tile=mib(rep.canvas_bytes + rep.max_tile_bytes),
                canvas_28_frames=mib(canvas28))


# ------------------------------------------------------------------------------------------------ LoKr
def quant_backend() -> tuple[object, dict, str]:
    """(QuantizedTensor class, {format: layout name}, description) from ComfyUI's QUANT_ALGOS when ComfyUI is
    importable, else comfy_kitchen's own layouts; raises ImportError with the reason when comfy_kitchen is missing."""
    try:
        import comfy_kitchen  # noqa: F401
        from comfy_kitchen.tensor import QuantizedTensor
    except ImportError as e:
        raise ImportError(f"comfy_kitchen is not installed ({e}); pip install comfy-kitchen") from None
    try:
        from importlib.metadata import version

        ck_ver = version("comfy-kitchen")
    except Exception:  # noqa: BLE001
        ck_ver = "?"
    why = "COMFYUI_PATH is unset"
    root = os.environ.get("COMFYUI_PATH")
    if root:
        try:
            if root not in sys.path:
                sys.path.insert(0, root)
            from comfy.quant_ops import QUANT_ALGOS
            from comfy.quant_ops import QuantizedTensor as CQT

            layouts = {f: QUANT_ALGOS[f]["comfy_tensor_layout"] for f in ("float8_e4m3fn", "int8_tensorwise")
                       if f in QUANT_ALGOS}
            return CQT, layouts, (f"ComfyUI QUANT_ALGOS ({', '.join(sorted(QUANT_ALGOS))}) on comfy_kitchen "
                                  f"{ck_ver}")
        except Exception as e:  # noqa: BLE001 - reported in the description, comfy_kitchen's layouts are used
            why = f"ComfyUI at COMFYUI_PATH not importable ({type(e).__name__}: {e})"
    return QuantizedTensor, {"float8_e4m3fn": "TensorCoreFP8Layout", "int8_tensorwise": "TensorWiseINT8Layout"}, \
        f"comfy_kitchen {ck_ver} layouts ({why})"


def sec_lokr(ctx: Ctx, c: dict) -> None:
    import torch

    from ditkit.loaders.lokr_math import add_delta_, delta_weight

    sec, dev = "lokr", ctx.device
    dt, dts = getattr(torch, c["dtype"]), dtype_short(c["dtype"])
    timer, mem = Timer(dev), Mem(dev)
    h, f, r = c["hidden"], c["factor"], c["rank"]
    out_f, in_f = 9 * h, h
    gen = torch.Generator(device=dev).manual_seed(41)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * s).to(dt)

    W = rnd(out_f, in_f, s=0.02)
    factors = {"lokr_w1": rnd(f, f), "lokr_w2_a": rnd(out_f // f, r, s=0.05), "lokr_w2_b": rnd(r, in_f // f, s=0.05)}
    scale = float(c["scale"])
    shp = f"W [{out_f}, {in_f}], w1 [{f}, {f}], w2 [{out_f // f}, {r}] @ [{r}, {in_f // f}]"
    w2_64 = factors["lokr_w2_a"].double() @ factors["lokr_w2_b"].double()
    d64 = torch.kron(factors["lokr_w1"].double(), w2_64) * scale
    full_dw = out_f * in_f * 4
    with ctx.guard(sec, "fused vs float64", shp, dts):
        temp = W.to(torch.float32, copy=True)    # what ComfyUI hands the patch: an fp32 copy on the device
        el, (_, peak_fused) = timer.once(lambda: mem.measure(lambda: add_delta_(temp, factors, scale)))
        full = W.to(torch.float32, copy=True) + delta_weight(factors, tuple(W.shape), scale)
        chunk_equal = torch.equal(temp, full)
        w64 = W.double() + d64
        err = float((temp.double() - w64).abs().max())
        rel = err / float(w64.abs().max())
        out_bf = temp.to(dt)
        # one rounding of the output dtype per element, plus the fp32 stage's norm-wise error
        ok_b, figs_b = err_stats(out_bf, w64, TOL[c["dtype"]]["elem"], 1e-6 * float(w64.abs().max()))
        ok = rel <= 1e-6 and chunk_equal and ok_b
        ctx.add(sec, "fused (chunked fp32) vs float64; == full-dW add", "PASS" if ok else "FAIL", shp, dts,
                target="fp32 norm-wise rel <= 1e-6; cast: one rounding per element", rel_err_fp32=rel, chunked_equals_full=chunk_equal,
                cast_max_rel=figs_b["max_rel_err"], ms=el * 1e3,
                peak_extra=(mib(peak_fused) if peak_fused is not None else "n/a (cpu)"), full_dW=mib(full_dw))
        if peak_fused is not None:
            ctx.add(sec, "fusion peak device memory", "PASS" if peak_fused < full_dw else "FAIL", shp, dts,
                    target="< the full fp32 dW (never materialised)", peak_extra=mib(peak_fused), full_dW=mib(full_dw))
        temp = full = w64 = out_bf = None
    try:
        QT, layouts, desc = quant_backend()
    except ImportError as e:
        for fmt in ("float8_e4m3fn", "int8_tensorwise"):
            ctx.add(sec, f"{fmt} base: dequantize -> fp32 add -> requantize", "SKIP", shp, fmt, note=str(e))
        return
    for fmt, qmax in (("float8_e4m3fn", 448.0), ("int8_tensorwise", 127.0)):
        check = f"{fmt} base: dequantize -> fp32 add -> requantize"
        if fmt not in layouts:
            ctx.add(sec, check, "SKIP", shp, fmt, note=f"{fmt} not in the host's QUANT_ALGOS ({desc})")
            continue
        if ctx.skip_if_over(sec, check, shp, fmt):
            return
        with ctx.guard(sec, check, shp, fmt):
            base = QT.from_float(W, layouts[fmt])
            deq = base.dequantize()
            temp = deq.to(torch.float32, copy=True)
            add_delta_(temp, factors, scale)
            outq = base.requantize_from_float(temp, scale="recalculate", stochastic_rounding=41)
            want = deq.double() + d64
            s_got = float(outq._params.scale)
            s_exp = float(want.abs().max()) / qmax
            e = (outq.dequantize().double() - want).abs()
            if fmt.startswith("int8"):
                ok_e, worst = bool(e.max() <= s_got * (1 + 1e-6)), float(e.max()) / s_got
                tgt = "error <= one int8 step (scale)"
            else:
                worst = float((e / want.abs().clamp_min(s_got)).max())
                ok_e, tgt = worst <= 0.125 + 1e-6, "relative error <= 2**-3 (one e4m3 step)"
            same = outq.storage_dtype == base.storage_dtype and type(outq._params) is type(base._params)
            ok = ok_e and same and abs(s_got / s_exp - 1) < 1e-5
            ctx.add(sec, check, "PASS" if ok else "FAIL", shp, fmt, target=tgt, layout=layouts[fmt],
                    storage=str(outq.storage_dtype).replace("torch.", ""), scale_vs_amax_over_qmax=s_got / s_exp,
                    worst_in_steps=worst, same_layout=same, note=desc)
            base = deq = temp = outq = want = e = None


def sec_quant_load(ctx: Ctx, c: dict) -> None:
    import torch

    from benchmarks.bench_quantize import make_checkpoints, scaled_cfg
    from ditkit.kernels import quant as Q
    from ditkit.loaders import h3 as h3core
    from ditkit.loaders import quantize as qc

    sec = "quant_load"
    dev = ctx.device if ctx.cuda else None
    tmp = Path(tempfile.mkdtemp(prefix="ditkit-gpuq-"))
    try:
        what = f"H3 {c['gb']} GB" if c["gb"] else "tiny H3"
        with ctx.guard(sec, "generate", what):
            official, _ = make_checkpoints(tmp, scaled_cfg(c["gb"]) if c["gb"] else None)
        official = str(official)

        def read_all() -> int:
            n = 0
            for _, t in h3core.iter_h3_tensors(h3core.plan_h3(official)):
                n += t.numel() * t.element_size()
            return n

        with ctx.guard(sec, "read the file (no quantize)", what, "bf16"):
            read_all()                                           # page cache warm, as for every load below
            t0 = time.perf_counter()
            nbytes = read_all()
            t_read = time.perf_counter() - t0
            ctx.add(sec, "read the file (no quantize)", "INFO", what, "bf16", seconds=t_read,
                    gb_per_s=nbytes / t_read / 1e9, gib=nbytes / 2**30)
        for fmt in c["formats"]:
            check = f"{fmt}: quantize through the device"
            if ctx.skip_if_over(sec, check, what, fmt):
                continue                                         # a SKIP row per remaining format
            with ctx.guard(sec, check, what, fmt):
                src = qc.open_source(official)
                plan = qc.make_plan(src.family, fmt, src.inventory, src.prefix)
                rep = qc.QuantReport(src.family, fmt, "")
                if ctx.cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                sd = dict(qc.quantize_stream(src.reader(), plan, rep, official, device=dev))
                if ctx.cuda:
                    torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                layers = plan.quantized_layers()[:: max(1, int(c["sample"]))]
                want = {f"{k}.weight" for k in layers}
                same, checked = True, 0
                for k, t in h3core.iter_h3_tensors(h3core.plan_h3(official)):
                    if k not in want:
                        continue
                    data, scales = Q.quantize(t, fmt)
                    layer = k[: -len(".weight")]
                    for sfx, ref in (("weight", data), *scales.items()):
                        got = sd[f"{layer}.{sfx}"]
                        same = same and got.shape == ref.shape and torch.equal(
                            got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))
                    checked += 1
                ctx.add(sec, check, "PASS" if same and checked == len(layers) else "FAIL", what, fmt,
                        target="sampled layers == CPU path bit for bit", seconds=secs, time_over_read=secs / t_read,
                        gb_per_s=nbytes / secs / 1e9, layers_checked=checked, layers=len(plan.quantized_layers()),
                        note=("quantized on " + str(dev)) if dev is not None else "CPU path (--tiny smoke)")
                sd = None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


SECTION_FNS = {"kernels": sec_kernels, "int64": sec_int64, "vsa_perf": sec_vsa_perf, "te_stream": sec_te_stream,
               "adaln": sec_adaln, "video_save": sec_video_save, "t1_decode": sec_t1_decode, "lokr": sec_lokr,
               "quant_load": sec_quant_load}


# ------------------------------------------------------------------------------------------------ driver
def import_ditkit():
    """``import ditkit`` resolving to THIS checkout (the repository root is the package): a temporary folder holding
    one link ``ditkit`` -> the checkout goes first on sys.path (the checkout itself never does: its ``nodes/`` would
    shadow ComfyUI's)."""
    import tempfile

    view = Path(tempfile.mkdtemp(prefix="ditkit-gpu-check-"))
    os.symlink(REPO, view / "ditkit", target_is_directory=True)
    sys.path.insert(0, str(view))
    for name in [m for m in sys.modules if m == "ditkit" or m.startswith("ditkit.")]:
        del sys.modules[name]
    import ditkit

    where = Path(ditkit.__file__).resolve().parent
    if where != REPO:
        raise SystemExit(f"gpu_check: `import ditkit` resolves to {where}, not this checkout {REPO}")
    return ditkit


def environment(device) -> dict:
    import torch

    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = dict(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
               torch_cuda=torch.version.cuda, triton=ver("triton"), comfy_kitchen=ver("comfy-kitchen"), av=ver("av"),
               TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET"), device=str(device), repo=str(REPO))
    try:
        import subprocess

        env["ditkit_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                              text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["ditkit_commit"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device_name=p.name, capability=list(torch.cuda.get_device_capability(device)),
                   total_memory_gib=round(p.total_memory / 2**30, 2), sm_count=p.multi_processor_count,
                   cudnn=torch.backends.cudnn.version())
    return env


def output_paths(args) -> tuple[Path | None, Path]:
    """(table text path or None, JSON path): --json; else beside --out; else $OUT/gpu_check.json; else ./"""
    table = None
    if args.out:
        out = Path(args.out)
        if out.is_dir() or args.out.endswith(os.sep):
            out.mkdir(parents=True, exist_ok=True)
            table, base = out / "gpu_check.txt", out
        else:
            table, base = out, out.parent
    elif os.environ.get("OUT"):
        base = Path(os.environ["OUT"])
        table = base / "gpu_check.txt"
    else:
        base = Path.cwd()
    js = Path(args.json) if args.json else base / "gpu_check.json"
    return table, js


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


def parse_sections(values, flag) -> list[str]:
    out = []
    for v in values or []:
        for s in v.split(","):
            s = s.strip()
            if not s:
                continue
            if s not in SECTIONS:
                raise SystemExit(f"gpu_check: {flag} {s!r} is not a section; choose from {', '.join(SECTIONS)}")
            out.append(s)
    return out


class _Exit2Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"gpu_check: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv=None) -> int:
    ap = _Exit2Parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="sections: " + ", ".join(SECTIONS))
    ap.add_argument("--dry-run", action="store_true", help="print the plan (checks, shapes, estimates) and exit; "
                    "needs neither CUDA nor triton")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, for a first try")
    ap.add_argument("--only", action="append", metavar="SECTION[,SECTION]", help="run only these sections")
    ap.add_argument("--skip", action="append", metavar="SECTION[,SECTION]", help="skip these sections")
    ap.add_argument("--out", help="write the table to this file (or DIR/gpu_check.txt) and the JSON beside it")
    ap.add_argument("--json", help="JSON path (default: beside --out, else $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--budget", type=float, help="global time budget in seconds, counted from the process start "
                    "(default 420; --quick 300); the process is stopped 30 s after it")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
        only = parse_sections(args.only, "--only")
        skip = parse_sections(args.skip, "--skip")
    except SystemExit as e:
        if e.code not in (0, None):
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            return 2
        return 0
    if args.device == "cpu" and not args.tiny:
        print("gpu_check: --device cpu is a smoke mode of the code paths and needs --tiny", file=sys.stderr)
        return 2
    mode = "tiny" if args.tiny else ("quick" if args.quick else "full")
    cfg = mode_config(mode)
    # opt-in sections (their own budget: --only quant_load) run by default only in the --tiny CPU smoke
    selected = [s for s in SECTIONS if (s in only if only else (mode == "tiny" or s not in OPT_IN)) and s not in skip]
    budget = float(args.budget) if args.budget else float(cfg["budget_s"])
    cfg["budget_s"] = budget
    plan = build_plan(cfg, selected, mode)
    if args.dry_run:
        print_plan(plan)
        if args.json or args.out:
            _, js = output_paths(args)
            write_json(js, dict(tool="gpu_check", dry_run=True, argv=sys.argv[1:] if argv is None else argv,
                                plan=plan))
            print(f"plan JSON: {js}")
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run to see the plan",
              file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton
    import_ditkit()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    table_path, json_path = output_paths(args)
    ctx = Ctx(device, mode, budget)
    env = environment(device)
    doc = dict(tool="gpu_check", dry_run=False, mode=mode, argv=sys.argv[1:] if argv is None else argv, env=env,
               plan=plan, rows=ctx.rows, sections={}, finished=False)
    print(f"ditkit gpu_check: mode {mode}, device {env.get('device_name', device)} "
          f"cc {env.get('capability')}, torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}; "
          f"budget {budget:.0f} s; sections {', '.join(selected) or 'none'}", flush=True)

    def hard_stop():  # the process must end, with its JSON, before the device session does
        ctx.add("(run)", "hard time limit", "FAIL",
                error=f"budget {budget:.0f} s + {HARD_STOP_AFTER_BUDGET_S} s passed; process stopped")
        with ctx.lock:
            doc["rows"] = list(ctx.rows)
        doc["aborted"] = "hard time limit"
        write_json(json_path, doc)
        print_rows(ctx.rows, table_path)
        os._exit(3)

    watchdog = threading.Timer(max(1.0, budget + HARD_STOP_AFTER_BUDGET_S - (time.perf_counter() - T_START)),
                               hard_stop)
    watchdog.daemon = True
    watchdog.start()
    broken = None
    for name in SECTIONS:
        if name not in selected:
            ctx.add(name, "(section)", "SKIP", note="not selected (--only/--skip)")
            continue
        if broken:
            ctx.add(name, "(section)", "SKIP", note=f"device unusable after an earlier error: {broken}")
            continue
        if time.perf_counter() > ctx.deadline:
            ctx.add(name, "(section)", "SKIP", note="global time budget used up")
            continue
        t = time.perf_counter()
        ctx.section_deadline = min(ctx.deadline, t + cfg[name]["budget_s"])
        print(f"== {name} (est {cfg[name]['est_s']} s, budget {cfg[name]['budget_s']} s)", file=sys.stderr, flush=True)
        with ctx.guard(name, "(section)"):
            SECTION_FNS[name](ctx, cfg[name])
        gc.collect()
        if ctx.cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.ones(1, device=device).add_(1).item()
            except Exception as e:  # noqa: BLE001 - e.g. an illegal address poisons the context
                broken = f"{type(e).__name__}: {e}"[:300]
        doc["sections"][name] = dict(seconds=round(time.perf_counter() - t, 2), est_s=cfg[name]["est_s"],
                                     budget_s=cfg[name]["budget_s"])
        write_json(json_path, doc)            # partial results survive a kill
    watchdog.cancel()
    doc["finished"] = True
    doc["elapsed_s"] = round(time.perf_counter() - ctx.t0, 2)
    counts = {k: sum(1 for r in ctx.rows if r["result"] == k) for k in ("PASS", "FAIL", "SKIP", "INFO")}
    doc["summary"] = counts
    write_json(json_path, doc)
    print_rows(ctx.rows, table_path)
    print(f"summary: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP, {counts['INFO']} INFO; "
          f"{doc['elapsed_s']:.1f} s; JSON {json_path}" + (f"; table {table_path}" if table_path else ""))
    return 1 if counts["FAIL"] else 0


def print_rows(rows, table_path) -> None:
    header = ["section", "check", "shape", "dtype", "result", "figures"]
    out = []
    for r in rows:
        figs = "; ".join(f"{k}={fmt(v)}" for k, v in r["figures"].items())
        extra = " | ".join(x for x in (figs, r["target"], " ".join(f"!{f}" for f in r["flags"]), r["note"],
                                       r["error"]) if x)
        out.append([r["section"], r["check"], r["shape"], r["dtype"], r["result"], extra])
    print_table(header, out)
    if table_path is not None:
        table_path.parent.mkdir(parents=True, exist_ok=True)
        with open(table_path, "w", encoding="utf-8") as fh:
            print_table(header, out, file=fh)


if __name__ == "__main__":
    sys.exit(main())
