"""LoKr on FLUX.2-dev-sized fused weights: load/plan time, per-layer patch time and peak RSS, ditkit vs native.

    python benchmarks/bench_lokr.py [--hidden 6144] [--double 8] [--single 48] [--factor 16] [--comfyui PATH]
                                    [--rows FILE]

Writes an ai-toolkit-style BFL-named LoKr for a FLUX.2 model of the given size (default: FLUX.2-dev,
h 6144, 8 double + 48 single blocks; full-rank factors, ``lokr_factor`` 16 like the community setting) into a
temp dir, then runs each mode in a FRESH subprocess and reads its peak RSS (``VmHWM``):

* ``plan``          -- ditkit: read the file (safetensors_io), parse, map onto the fused FLUX.2 weights, validate
                       (what DitKitLoKrLoader does before registering its lazy patches; no ΔW is built);
* ``native-load``   -- ComfyUI: ``comfy.lora.load_lora`` with FLUX.2's key map (what LoraLoaderModelOnly does
                       before ``add_patches``), built from a meta-device FLUX.2 of the same size;
* ``layer-ditkit``  -- patch ONE fused weight (``single_blocks.0.linear1`` [9h, h], the largest) the way ComfyUI
                       does at load: bf16 -> fp32 copy -> ditkit patch ``calculate_weight`` -> bf16;
* ``layer-native``  -- the same with ComfyUI's own ``LoKrAdapter.calculate_weight``.

The two layer results are compared element-wise (max |diff|, the quality delta). A full dev-sized base model
(32 B parameters) is not built. Ratios are printed from this one run (one run per mode), and with ``--rows FILE``
written as rows (benchmarks/_harness.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402

CHILD = r"""
import json, sys, time
import torch
from benchmarks._harness import peak_rss_kib as hwm_kib

torch.set_num_threads(1)
mode, path, cfg, comfyui, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
h, nd, ns = cfg["hidden"], cfg["double"], cfg["single"]
if comfyui:
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args
    args.cpu = True
from ditkit.tiny import ckpt_image as ci
shapes = {f"diffusion_model.{k.replace('.scale', '.weight')}": v
          for k, v in ci.flux2_shapes({**ci.FLUX2, "hidden": h, "depth": nd, "depth_single": ns}).items()}
res = {}
from ditkit.loaders import lokr_apply as core
from ditkit.loaders.safetensors_io import SafeFile, save_file
wk = "diffusion_model.single_blocks.0.linear1.weight"
pre = "diffusion_model.single_blocks.0.linear1"
if mode == "native-load":
    import comfy.lora, comfy.ops, comfy.utils
    from comfy.ldm.flux.model import Flux
    with torch.device("meta"):  # the key map needs only the model's state-dict keys
        dm = Flux(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360,
                  hidden_size=h, mlp_ratio=3.0, num_heads=h // 128, depth=nd, depth_single_blocks=ns,
                  axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True,
                  global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
                  ref_index_scale=10.0, txt_ids_dims=[3], operations=comfy.ops.disable_weight_init)
    model_keys = [f"diffusion_model.{k}" for k in dm.state_dict()]
elif mode.startswith("layer"):
    from comfy.weight_adapter.lokr import LoKrAdapter
    from ditkit.nodes.lokr import DitKitLoKrPatch
    with SafeFile(path) as f:
        sd = {k: f.get(k) for k in f.keys() if k.startswith(pre + ".")}
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shapes[wk], generator=g).to(torch.bfloat16)
h0 = hwm_kib()
t = time.perf_counter()
if mode == "plan":
    with SafeFile(path) as f:
        sd = {k: f.get(k) for k in f.keys()}
    plan = core.plan(core.parse_lokr(sd), shapes)
    res["modules"] = len(plan.items); res["unused"] = len(plan.unused)
elif mode == "native-load":
    sd = comfy.utils.load_torch_file(path)
    key_map = {}  # comfy.lora.model_lora_keys_unet's generic part (BFL names under diffusion_model. / lora_unet_)
    for k in model_keys:
        if k.endswith(".weight"):
            key_map[k[:-len(".weight")]] = k
            key_map["lora_unet_" + k[len("diffusion_model."):-len(".weight")].replace(".", "_")] = k
    patches = comfy.lora.load_lora(sd, key_map, log_missing=False)
    res["modules"] = len(patches)
else:
    temp = base.to(torch.float32, copy=True)
    if mode == "layer-ditkit":
        plan = core.plan(core.parse_lokr(sd), {wk: shapes[wk], "diffusion_model.double_stream_modulation_img.lin.weight": (6 * h, h),
                                               "diffusion_model.img_in.weight": (h, 128)})
        w = DitKitLoKrPatch.from_item(plan.items[0]).calculate_weight(temp, wk, 1.0, 1.0, None, lambda a: a)
    else:
        alpha = float(sd[pre + ".alpha"]) if pre + ".alpha" in sd else None
        ad = LoKrAdapter.load(pre, sd, alpha, None)
        w = ad.calculate_weight(temp, wk, 1.0, 1.0, None, lambda a: a, torch.float32)
    outw = w.to(torch.bfloat16)
    res["seconds_patch"] = time.perf_counter() - t
    save_file({"w": outw}, out)
res["seconds"] = res.get("seconds_patch", time.perf_counter() - t)
res["peak_rss_mib"] = (hwm_kib() - h0) / 1024
print(json.dumps(res))
"""


def make_adapter(path: Path, h: int, nd: int, ns: int, factor: int) -> int:
    import torch

    from ditkit.loaders.safetensors_io import save_file
    from ditkit.tiny import ckpt_image as ci

    shapes = ci.flux2_shapes({**ci.FLUX2, "hidden": h, "depth": nd, "depth_single": ns})
    g = torch.Generator().manual_seed(1)
    sd = {}
    for k, s in shapes.items():
        if not (k.endswith(".weight") and len(s) == 2 and k.startswith(("double_blocks", "single_blocks"))):
            continue
        mod = ci.make_lokr_module(s[0], s[1], factor, g, alpha=1e10, scale=0.01)
        for suf, t in mod.items():
            sd[f"diffusion_model.{k[:-len('.weight')]}.{suf}"] = t.to(torch.bfloat16) if suf != "alpha" else t
    save_file(sd, path)
    return len({k.rsplit(".", 1)[0] for k in sd})


def run(mode, path, cfg, comfyui, out):
    # cwd outside the repo; the checkout (ditkit, benchmarks) first on the child's path
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                      .split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), json.dumps(cfg), comfyui or "", str(out)],
                       capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
    if r.returncode:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=48)
    ap.add_argument("--factor", type=int, default=16)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", ""))
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    rows = Rows(a.rows, "bench_lokr")
    cfg = {"hidden": a.hidden, "double": a.double, "single": a.single}
    with tempfile.TemporaryDirectory(prefix="bench_lokr_") as td:
        td = Path(td)
        f = td / "flux2_lokr.safetensors"
        t = time.perf_counter()
        n = make_adapter(f, a.hidden, a.double, a.single, a.factor)
        print(f"adapter: {n} modules, {f.stat().st_size / 2**20:.1f} MiB, factor {a.factor} "
              f"(h {a.hidden}, {a.double}+{a.single} blocks), written in {time.perf_counter() - t:.1f} s")
        for metric, value in (("modules", n), ("file_bytes", f.stat().st_size), ("factor", a.factor),
                              ("hidden", a.hidden), ("double_blocks", a.double), ("single_blocks", a.single)):
            rows.add("adapter", metric, value, "B" if metric == "file_bytes" else "")
        p = run("plan", f, cfg, a.comfyui, td / "x")
        print(f"ditkit  parse+map+validate: {p['seconds']:.2f} s, peak +{p['peak_rss_mib']:.0f} MiB, "
              f"{p['modules']} modules, {p['unused']} unused")
        rows.add("ditkit plan", "time", p["seconds"], "s", n=1)
        rows.add("ditkit plan", "peak_rss_growth", p["peak_rss_mib"], "MiB")
        rows.add("ditkit plan", "modules", p["modules"])
        rows.add("ditkit plan", "unused", p["unused"])
        if a.comfyui:
            q = run("native-load", f, cfg, a.comfyui, td / "x")
            print(f"native  load_lora:          {q['seconds']:.2f} s, peak +{q['peak_rss_mib']:.0f} MiB, "
                  f"{q['modules']} patches   (time ratio ditkit/native {p['seconds'] / q['seconds']:.2f})")
            rows.add("native load_lora", "time", q["seconds"], "s", n=1)
            rows.add("native load_lora", "peak_rss_growth", q["peak_rss_mib"], "MiB")
            rows.add("native load_lora", "modules", q["modules"])
            rows.add("ditkit/native load", "time_ratio", p["seconds"] / q["seconds"], "x", n=1)
        d = run("layer-ditkit", f, cfg, a.comfyui, td / "d.safetensors")
        print(f"ditkit  patch linear1 [{9 * a.hidden}x{a.hidden}]: {d['seconds']:.2f} s, peak +{d['peak_rss_mib']:.0f} MiB")
        rows.add("ditkit patch linear1", "shape", [9 * a.hidden, a.hidden])
        rows.add("ditkit patch linear1", "time", d["seconds"], "s", n=1)
        rows.add("ditkit patch linear1", "peak_rss_growth", d["peak_rss_mib"], "MiB")
        if a.comfyui:
            nt = run("layer-native", f, cfg, a.comfyui, td / "n.safetensors")
            from ditkit.loaders.safetensors_io import load_file

            wd, wn = load_file(td / "d.safetensors")["w"], load_file(td / "n.safetensors")["w"]
            diff = (wd.float() - wn.float()).abs().max().item()
            print(f"native  patch linear1:       {nt['seconds']:.2f} s, peak +{nt['peak_rss_mib']:.0f} MiB   "
                  f"(time ratio ditkit/native {d['seconds'] / nt['seconds']:.2f}, peak ratio "
                  f"{d['peak_rss_mib'] / max(nt['peak_rss_mib'], 1e-9):.2f}); max |ditkit - native| (bf16) = {diff:.3g}")
            rows.add("native patch linear1", "time", nt["seconds"], "s", n=1)
            rows.add("native patch linear1", "peak_rss_growth", nt["peak_rss_mib"], "MiB")
            rows.add("ditkit/native patch", "time_ratio", d["seconds"] / nt["seconds"], "x", n=1)
            rows.add("ditkit/native patch", "peak_ratio", d["peak_rss_mib"] / max(nt["peak_rss_mib"], 1e-9), "x")
            rows.add("ditkit/native patch", "max_abs_diff_bf16", diff)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
