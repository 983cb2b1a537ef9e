"""Fusing one real-size H3 qkv LoRA delta (21504 x 5376, rank 64): peak extra RSS and time, ditkit vs native.

    python benchmarks/bench_adapter_fuse.py [--rows 21504] [--cols 5376] [--rank 64] [--repeat 3] [--comfyui PATH]

Each run is a FRESH subprocess that builds the fp32 weight ComfyUI hands a patch (its intermediate copy of the
layer), then reads the peak RSS (``VmHWM``) before and after the patch; the difference is what the patch itself
needed on top of the weight:

* ``ditkit``             -- DitKitAdapterLoader's patch (``nodes/adapters.DitKitAdapterPatch``) for a DiffSynth-named
                            ``blocks.0.attn.qkv_proj`` LoRA planned by ``loaders/h3_adapters.plan`` with
                            ``qkv_layout=contiguous``: ``kernels/delta_fuse`` adds B @ A in row chunks;
* ``ditkit-interleaved`` -- the same with the per-head de-interleave row map (the DiffSynth default);
* ``native``             -- ComfyUI's ``comfy.weight_adapter.lora.LoRAAdapter.calculate_weight`` on the same factors
                            (what LoraLoaderModelOnly registers): it builds ΔW whole.

Runs are interleaved (ditkit, native, ditkit-interleaved, then again) ``--repeat`` times; the median and min-max of
each and the ditkit/native ratios are printed from this one run. Quality delta: max |ditkit - native| / max |ΔW|
(contiguous layout, same arithmetic up to fp32 summation order).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")

torch.set_num_threads(1)
mode, rows, cols, rank, comfyui, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
if comfyui:
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args
    args.cpu = True
g = torch.Generator().manual_seed(0)
a = (torch.randn(rank, cols, generator=g) * 0.02).to(torch.bfloat16)
b = (torch.randn(rows, rank, generator=g) * 0.02).to(torch.bfloat16)
weight = torch.randn(rows, cols, generator=g)          # ComfyUI's fp32 intermediate copy of the layer
if mode.startswith("ditkit"):
    from ditkit.loaders import h3_adapters as core
    from ditkit.nodes.adapters import DitKitAdapterPatch
    hd = 128
    shapes = {"diffusion_model.blocks.0.attn.qkv_proj.weight": (rows, cols),
              "diffusion_model.blocks.0.attn.q_norm.weight": (hd,),
              "diffusion_model.video_patch_proj.weight": (cols, 96)}
    af = core.AdapterFile("bench", {"blocks.0.attn.qkv_proj.lora_A.default.weight": a,
                                    "blocks.0.attn.qkv_proj.lora_B.default.weight": b}, {})
    layout = "interleaved" if mode == "ditkit-interleaved" else "contiguous"
    plan = core.plan(af, core.geometry(shapes), lambda k: None, source="bench", qkv_layout=layout)
    patch = DitKitAdapterPatch(set(), plan.items[0])
else:
    from comfy.weight_adapter.lora import LoRAAdapter
    patch = LoRAAdapter(set(), (b, a, None, None, None, None))
h0 = hwm_kib()
t = time.perf_counter()
w = patch.calculate_weight(weight, "diffusion_model.blocks.0.attn.qkv_proj.weight", 1.0, 1.0, None, lambda x: x,
                           torch.float32)
sec = time.perf_counter() - t
peak = (hwm_kib() - h0) / 1024
if out:
    torch.save({"w": w[:512].clone(), "d": (b[:512].float() @ a.float())}, out)
print(json.dumps({"seconds": sec, "peak_extra_mib": peak}))
"""


def run(mode, a, out=""):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.rows), str(a.cols), str(a.rank), a.comfyui or "",
                        str(out)], capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
    if r.returncode:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=21504)
    ap.add_argument("--cols", type=int, default=5376)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", ""))
    a = ap.parse_args(argv)
    if not a.comfyui:
        raise SystemExit("needs the ComfyUI source tree (--comfyui or COMFYUI_PATH) for the native path")
    modes = ("ditkit", "native", "ditkit-interleaved")
    res = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench_adapter_") as td:
        for i in range(a.repeat):          # ABAB: one of each per round
            for m in modes:
                out = Path(td) / f"{m}.pt" if i == 0 and m != "ditkit-interleaved" else ""
                res[m].append(run(m, a, out))
        import torch

        d, n = torch.load(Path(td) / "ditkit.pt"), torch.load(Path(td) / "native.pt")
        qual = (d["w"] - n["w"]).abs().max().item() / d["d"].abs().max().item()
    print(f"H3 qkv LoRA fuse: weight [{a.rows} x {a.cols}] fp32 ({a.rows * a.cols * 4 / 2**20:.0f} MiB), rank {a.rank}, "
          f"{a.repeat} rounds (interleaved)")
    med = {}
    for m in modes:
        pk = [r["peak_extra_mib"] for r in res[m]]
        sc = [r["seconds"] for r in res[m]]
        med[m] = (statistics.median(pk), statistics.median(sc))
        print(f"  {m:<19} peak extra RSS median {med[m][0]:8.1f} MiB (min {min(pk):.1f}, max {max(pk):.1f}); "
              f"time median {med[m][1]:.3f} s (min {min(sc):.3f}, max {max(sc):.3f})")
    for m in ("ditkit", "ditkit-interleaved"):
        pr = [r["peak_extra_mib"] / max(q["peak_extra_mib"], 1e-9) for r, q in zip(res[m], res["native"])]
        tr = [r["seconds"] / q["seconds"] for r, q in zip(res[m], res["native"])]
        print(f"  ratio {m}/native: peak {statistics.median(pr):.3f} (min {min(pr):.3f}, max {max(pr):.3f}); "
              f"time {statistics.median(tr):.2f} (min {min(tr):.2f}, max {max(tr):.2f})")
    print(f"  quality: max |ditkit - native| / max |ΔW| = {qual:.2e} (contiguous layout, fp32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
