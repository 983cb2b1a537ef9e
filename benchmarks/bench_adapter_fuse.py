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

On an fp8 (comfy_quant ``float8_e4m3fn``) base of the same shape, whose codes are written chunk by chunk so no float
copy of the layer ever raised the peak before the measurement:

* ``ditkit-fp8``         -- what DitKitAdapterLoader does for a quantized layer (``nodes/lokr.fuse_quantized`` ->
                            ``kernels/delta_fuse.requantize_fuse``): float64 row chunks, two passes, a new fp8
                            QuantizedTensor of the same layout (contiguous qkv layout);
* ``native-fp8``         -- ComfyUI's patch path for the same LoRA on that layer, step by step as
                            ``ModelPatcher.patch_weight_to_device`` runs it: ``cast_to_device(weight, cpu, float32,
                            copy=True)`` + the layer's ``convert_weight`` (whole-layer dequantize), ``LoRAAdapter.
                            calculate_weight``, then the layer's ``set_weight``: ``requantize_from_float(scale=
                            "recalculate", stochastic_rounding=seed, inplace_ops=True)``.

On an int8 ConvRot base (comfy_quant ``int8_tensorwise``, ``convrot``, group 256, one scale per row: the
Comfy-Org H3 repack format), codes written chunk by chunk (``--only convrot``):

* ``ditkit-convrot``     -- DitKitAdapterLoader fuse: ``bridge/quant_requant.requantize_layer`` (float64 row chunks,
                            the host's own ConvRot quantize per chunk);
* ``native-convrot``     -- ComfyUI's patch path as above (whole-layer dequantize, LoRAAdapter, requantize_from_float
                            with stochastic rounding);
* ``bypass-convrot``     -- mode bypass: nothing is done to the weight; the peak is that of one ``h`` call on 64
                            tokens, and the per-call time of (int8 ConvRot linear + h) over the linear alone,
                            ``--bypass-pairs`` interleaved pairs per run, on the first ``--bypass-rows`` rows
                            (the host's CPU int8 ConvRot linear takes ~140 s per call on the whole layer).

Runs are interleaved (one of each mode per round, in a fixed order) ``--repeat`` times; the median and min-max of
each and the ditkit/native ratios are printed from this one run (``--only fp8`` / ``--only float`` runs one group).
Quality delta: float: max |ditkit - native| / max |ΔW| (contiguous layout, same arithmetic up to fp32 summation
order); fp8: RMS of (dequantized result - float64 (dequant(base) + ΔW)) over RMS ΔW, first 512 rows, for each path
(both are one fp8 rounding of the exact update: ditkit round-to-nearest, ComfyUI stochastic). Every figure is also a
row (``--rows FILE``, benchmarks/_harness.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import Rows, ratio_stats, spread, stats  # noqa: E402

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
if mode.endswith("-convrot"):
    import statistics, types
    from comfy.quant_ops import QuantizedTensor, get_layout_class
    from ditkit.bridge import adapter_bypass, quant_requant
    key = "diffusion_model.blocks.0.attn.qkv_proj.weight"
    codes = torch.empty(rows, cols, dtype=torch.int8)
    for r0 in range(0, rows, 512):                     # codes written chunk by chunk: no float copy of the layer
        codes[r0:r0 + 512] = torch.randint(-127, 128, (min(512, rows - r0), cols), generator=g, dtype=torch.int8)
    lay_name = "TensorWiseINT8Layout"
    params = get_layout_class(lay_name).Params(scale=torch.rand(rows, 1, generator=g) * 1e-4 + 1e-4,
                                               orig_dtype=torch.float32, orig_shape=(rows, cols), convrot=True,
                                               convrot_groupsize=256)
    qt = QuantizedTensor(codes, lay_name, params)
    lay = quant_requant.classify(qt, key)
    dl_parts = (b.float(), a.float())
    if mode == "ditkit-convrot":
        from ditkit.kernels import delta_fuse
        from ditkit.nodes.lokr import fuse_quantized
        fake = types.SimpleNamespace(get_model_object=lambda k: qt, patches={})
        run = lambda: fuse_quantized(fake, {key: [delta_fuse.Delta("lowrank", dl_parts, 1.0)]}, {key: lay})[0][key].data
    elif mode == "native-convrot":
        import comfy.model_management, comfy.utils
        from comfy.weight_adapter.lora import LoRAAdapter
        def run():
            temp = comfy.model_management.cast_to_device(qt, torch.device("cpu"), torch.float32, copy=True)
            if isinstance(temp, QuantizedTensor):
                temp = temp.dequantize()
            temp = LoRAAdapter(set(), (b, a, None, None, None, None)).calculate_weight(
                temp, key, 1.0, 1.0, None, lambda x: x, torch.float32)
            return qt.requantize_from_float(temp, scale="recalculate", stochastic_rounding=comfy.utils.string_to_seed(key),
                                            inplace_ops=True)
    else:   # bypass-convrot: what bypass holds and adds per call: the entry, one h() on TOKENS tokens
        tokens = 64
        x = torch.randn(tokens, cols, generator=g)
        ent = adapter_bypass.Entry("weight", "lowrank", dl_parts, 1.0, None, None, "bench")
        h0 = hwm_kib()
        t = time.perf_counter()
        y = adapter_bypass.h_sum([ent], x, rows, torch.float32)
        sec = time.perf_counter() - t
        peak = (hwm_kib() - h0) / 1024
        base_t, byp_t = [], []
        # the host's int8 ConvRot linear on CPU costs ~6 s per 1024 rows x 64 tokens (~140 s per call for the whole
        # qkv), so the per-call timing runs on the first brows rows of the same layer (base and h both scale with
        # the rows; h's fixed A x part makes the ratio on a slice an upper bound of the whole layer's)
        brows = min(rows, int(sys.argv[7]))
        qs = QuantizedTensor(codes[:brows], lay_name, get_layout_class(lay_name).Params(
            scale=params.scale[:brows], orig_dtype=torch.float32, orig_shape=(brows, cols), convrot=True,
            convrot_groupsize=256))
        ents = [adapter_bypass.Entry("weight", "lowrank", (dl_parts[0][:brows], dl_parts[1]), 1.0, None, None, "bench")]
        for _ in range(int(sys.argv[8])):             # interleaved: base forward, base forward + h
            t = time.perf_counter(); yb = torch.nn.functional.linear(x, qs); base_t.append(time.perf_counter() - t)
            t = time.perf_counter(); yb = torch.nn.functional.linear(x, qs); yb = yb + adapter_bypass.h_sum(ents, x, brows, yb.dtype); byp_t.append(time.perf_counter() - t)
        exact = x.double() @ (b[:512].double() @ a.double()).T          # h alone vs float64 ΔW x (the base's own
        err = (y[:, :512].double() - exact).abs().max() / exact.abs().max()  # int8 activation rounding is not h's)
        print(json.dumps({"seconds": sec, "peak_extra_mib": peak, "base_step_s": statistics.median(base_t),
                          "bypass_step_s": statistics.median(byp_t),
                          "step_ratios": [bb / aa for aa, bb in zip(base_t, byp_t)], "rel_max_err_vs_float64": err.item(),
                          "timed_rows": brows,
                          "layout": "untouched " + lay.describe()}))
        raise SystemExit(0)
    h0 = hwm_kib()
    t = time.perf_counter()
    new = run()
    sec = time.perf_counter() - t
    peak = (hwm_kib() - h0) / 1024
    exact = quant_requant.base_rows64(qt, lay, 0, 512) + b[:512].double() @ a.double()
    got = quant_requant.base_rows64(new, quant_requant.classify(new, key), 0, 512)
    err = (got - exact).pow(2).mean().sqrt() / (b[:512].double() @ a.double()).pow(2).mean().sqrt()
    print(json.dumps({"seconds": sec, "peak_extra_mib": peak, "rel_rms_err": err.item(),
                      "layout": quant_requant.classify(new, key).describe()}))
    raise SystemExit(0)
if mode.endswith("-fp8"):
    import types
    from comfy.quant_ops import QuantizedTensor, get_layout_class
    key = "diffusion_model.blocks.0.attn.qkv_proj.weight"
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for r0 in range(0, rows, 512):                     # codes written chunk by chunk: no float copy of the layer
        codes[r0:r0 + 512] = (torch.randn(min(512, rows - r0), cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    lay = "TensorCoreFP8E4M3Layout"
    params = get_layout_class(lay).Params(scale=torch.tensor(0.02 / 100), orig_dtype=torch.bfloat16, orig_shape=(rows, cols))
    qt = QuantizedTensor(codes, lay, params)
    if mode == "ditkit-fp8":
        from ditkit.kernels import delta_fuse
        from ditkit.nodes.lokr import fuse_quantized
        fake = types.SimpleNamespace(get_model_object=lambda k: qt, patches={})
        dl = delta_fuse.Delta("lowrank", (b.float(), a.float()), 1.0)
        run = lambda: fuse_quantized(fake, {key: [dl]}, {key: "float8_e4m3fn"})[0][key].data
    else:
        import comfy.model_management, comfy.utils
        from comfy.weight_adapter.lora import LoRAAdapter
        def run():
            temp = comfy.model_management.cast_to_device(qt, torch.device("cpu"), torch.float32, copy=True)
            if isinstance(temp, QuantizedTensor):          # the layer's convert_weight
                temp = temp.dequantize()
            temp = LoRAAdapter(set(), (b, a, None, None, None, None)).calculate_weight(
                temp, key, 1.0, 1.0, None, lambda x: x, torch.float32)
            return qt.requantize_from_float(temp, scale="recalculate", stochastic_rounding=comfy.utils.string_to_seed(key),
                                            inplace_ops=True)
    h0 = hwm_kib()
    t = time.perf_counter()
    new = run()
    sec = time.perf_counter() - t
    peak = (hwm_kib() - h0) / 1024
    exact = codes[:512].double() * params.scale.double() + b[:512].double() @ a.double()
    err = (new.dequantize()[:512].double() - exact).pow(2).mean().sqrt() / (b[:512].double() @ a.double()).pow(2).mean().sqrt()
    print(json.dumps({"seconds": sec, "peak_extra_mib": peak, "rel_rms_err": err.item(),
                      "layout": type(new).__name__ + ":" + new._layout_cls}))
    raise SystemExit(0)
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
    from safetensors.torch import save_file
    save_file({"w": w[:512].float().contiguous(), "d": (b[:512].float() @ a.float()).contiguous()}, out)
print(json.dumps({"seconds": sec, "peak_extra_mib": peak}))
"""


def _view() -> str:
    """A folder whose ``ditkit`` is this checkout (the repository root is the package, under any folder name):
    the child's ``import ditkit`` must not resolve to another installed copy."""
    v = Path(tempfile.gettempdir()) / f"bench-adapter-view-{os.getuid()}-{abs(hash(str(REPO))) % 10**10}"
    v.mkdir(exist_ok=True)
    link = v / "ditkit"
    if not link.is_symlink() or link.resolve() != REPO.resolve():
        if link.is_symlink():
            link.unlink()
        link.symlink_to(REPO, target_is_directory=True)
    return str(v)


def run(mode, a, out=""):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_view(), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.rows), str(a.cols), str(a.rank), a.comfyui or "",
                            str(out), str(a.bypass_rows), str(a.bypass_pairs)], capture_output=True, text=True,
                           cwd=tempfile.gettempdir(), env=env, timeout=a.timeout or None)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{mode} did not finish within --timeout {a.timeout} s (a fresh process per run; on a loaded "
                         "2-core machine lower --repeat or --bypass-rows)") from None
    if r.returncode:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=21504, dest="nrows")
    ap.add_argument("--cols", type=int, default=5376)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("float", "fp8", "convrot"), default=None, help="run one group of modes")
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", ""))
    ap.add_argument("--bypass-rows", dest="bypass_rows", type=int, default=2048,
                    help="rows of the int8 ConvRot layer the bypass per-call timing runs on (the host's CPU int8 "
                         "linear takes ~140 s per call on all 21504)")
    ap.add_argument("--bypass-pairs", dest="bypass_pairs", type=int, default=5,
                    help="interleaved (base, base + h) call pairs per bypass run")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process (0: none)")
    ap.add_argument("--rows-out", dest="rows_out", metavar="FILE",
                    help="also write every figure as a row (benchmarks/_harness.py): .jsonl or .csv")
    a = ap.parse_args(argv)
    a.rows = a.nrows
    if not a.comfyui:
        raise SystemExit("needs the ComfyUI source tree (--comfyui or COMFYUI_PATH) for the native path")
    groups = {"float": ("ditkit", "native", "ditkit-interleaved"), "fp8": ("ditkit-fp8", "native-fp8"),
              "convrot": ("ditkit-convrot", "native-convrot", "bypass-convrot")}
    modes = tuple(m for gname, ms in groups.items() if a.only in (None, gname) for m in ms)
    rows = Rows(a.rows_out, "bench_adapter_fuse")
    res = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench_adapter_") as td:
        for i in range(a.repeat):          # ABAB: one of each per round
            for m in modes:
                out = Path(td) / f"{m}.safetensors" if i == 0 and m in ("ditkit", "native") else ""
                res[m].append(run(m, a, out))
        qual = None
        if "ditkit" in modes:
            from safetensors.torch import load_file

            d, n = load_file(Path(td) / "ditkit.safetensors"), load_file(Path(td) / "native.safetensors")
            qual = (d["w"] - n["w"]).abs().max().item() / d["d"].abs().max().item()
    print(f"H3 qkv LoRA fuse: weight [{a.rows} x {a.cols}] (fp32 {a.rows * a.cols * 4 / 2**20:.0f} MiB, fp8 "
          f"{a.rows * a.cols / 2**20:.0f} MiB), rank {a.rank}, {a.repeat} rounds (interleaved)")
    for m in modes:
        pk, sc = stats(r["peak_extra_mib"] for r in res[m]), stats(r["seconds"] for r in res[m])
        print(f"  {m:<19} peak extra RSS median {pk['median']:8.1f} MiB (min {pk['min']:.1f}, max {pk['max']:.1f}); "
              f"time median {sc['median']:.3f} s (min {sc['min']:.3f}, max {sc['max']:.3f})")
        rows.add_stats(m, "peak_rss_growth", pk, "MiB")
        rows.add_stats(m, "time", sc, "s")
    pairs = [(m, "native") for m in ("ditkit", "ditkit-interleaved") if m in modes]
    pairs += [("ditkit-fp8", "native-fp8")] if "ditkit-fp8" in modes else []
    pairs += [(m, "native-convrot") for m in ("ditkit-convrot", "bypass-convrot") if m in modes]
    for m, base in pairs:
        pr = ratio_stats([r["peak_extra_mib"] for r in res[m]], [q["peak_extra_mib"] for q in res[base]])
        tr = ratio_stats([r["seconds"] for r in res[m]], [q["seconds"] for q in res[base]])
        print(f"  ratio {m}/{base}: peak {pr['median']:.3f} {spread(pr)}; time {tr['median']:.2f} {spread(tr)}")
        rows.add_stats(f"{m}/{base}", "peak_rss_ratio", pr, "x")
        rows.add_stats(f"{m}/{base}", "time_ratio", tr, "x")
    if qual is not None:
        print(f"  quality: max |ditkit - native| / max |ΔW| = {qual:.2e} (contiguous layout, fp32)")
        rows.add("ditkit/native", "max_abs_diff_over_max_delta", qual)
    if "bypass-convrot" in modes:
        st = ratio_stats([r["bypass_step_s"] for r in res["bypass-convrot"]], [r["base_step_s"] for r in res["bypass-convrot"]])
        allr = stats(x for r in res["bypass-convrot"] for x in r["step_ratios"])
        print(f"  bypass time per call on the int8 ConvRot layer ({res['bypass-convrot'][0]['timed_rows']} of its "
              f"{a.rows} rows, 64 tokens, base forward vs base + h, interleaved): "
              f"ratio median {st['median']:.3f} {spread(st)} (all {len(list(x for r in res['bypass-convrot'] for x in r['step_ratios']))} "
              f"pairs: median {allr['median']:.3f}, min {allr['min']:.3f}, max {allr['max']:.3f}); "
              f"h error vs float64 ΔW x (first 512 rows) {res['bypass-convrot'][0]['rel_max_err_vs_float64']:.2e}")
        rows.add_stats("bypass-convrot/base", "step_time_ratio", st, "x")
    for m in ("ditkit-fp8", "native-fp8", "ditkit-convrot", "native-convrot"):
        if m in modes:
            e = stats(r["rel_rms_err"] for r in res[m])
            print(f"  quality {m}: RMS(result - exact update) / RMS(ΔW) = {e['median']:.3e} (first 512 rows; "
                  f"result {res[m][0]['layout']})")
            rows.add_stats(m, "rel_rms_err_vs_exact", e, "", note=res[m][0]["layout"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
