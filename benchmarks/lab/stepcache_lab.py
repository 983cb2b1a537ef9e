"""Step-cache lab: no cache, EasyCache (native), calibrated TeaCache, DitKitStepCache first_block and sigma_schedule
on the trained lab H3 (comfy engine: ComfyUI's KSampler in-process, every cache applied through its node).

    COMFYUI_PATH=... nice -n 10 python benchmarks/lab/stepcache_lab.py [--steps 25] [--cfg 3] [--prompts 2]

Per method a threshold sweep; per point: block evaluations (forward pre-hooks on every DiT block, all calls) and
their ratio exact / cached, video SSIM / PSNR of the decoded frames and audio SSIM (log spectrogram) / LSD of the
decoded waveform against the uncached sample of the same prompt and seed. Then, per target ratio (1.5x, 2x, 2.8x),
each method's sweep point whose ratio is nearest (the ratio actually reached is printed), and per DitKitStepCache
mode the largest threshold with video and audio SSIM >= 0.98 (the default rule). Every row goes to ``--rows``.

``--match``: instead of a fixed sweep, per method and target ratio a bisection of the threshold (log scale, between
the method's sweep ends, ``--match-probes`` probes per target, every probe kept and shared by the targets) and the
probe nearest each target is reported. ``first_block@<variant>`` (issue #33 experiment) runs first_block with the
lab-only decision variant ``cache.stepcache.LAB_FIRST_BLOCK_VARIANT`` (``LAB_VARIANTS``); no node input changes.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
import harness as Hn  # noqa: E402

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402
from benchmarks.lab.lab_metrics import audio_ssim, log_spectral_distance, psnr, ssim  # noqa: E402

SWEEPS = {
    "EasyCache": ("comfy_extras.nodes_easycache", "EasyCache", "reuse_threshold", (0.05, 0.1, 0.2, 0.3, 0.5, 0.8)),
    "TeaCache": ("ditkit.nodes.teacache", "DitKitTeaCache", "threshold", (0.1, 0.2, 0.3, 0.45, 0.6, 0.9)),
    "first_block": ("ditkit.nodes.stepcache", "DitKitStepCache", "threshold", (0.03, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3,
                                                                                0.5)),
    "sigma_schedule": ("ditkit.nodes.stepcache", "DitKitStepCache", "threshold", (0.02, 0.04, 0.05, 0.08, 0.12, 0.2)),
}
# --small: fewer points (the 50-step and CFG 1 settings on a shared CPU)
SMALL = {"EasyCache": (0.05, 0.1, 0.2, 0.8), "TeaCache": (0.05, 0.1, 0.2, 0.3),
         "first_block": (0.1, 0.2, 0.3, 0.5), "sigma_schedule": (0.04, 0.08, 0.12, 0.2)}
TARGETS = (1.5, 2.0, 2.8)


def count_blocks(model):
    dm = model.model.diffusion_model
    n = [0]
    hs = [b.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1)) for b in dm.blocks]
    return n, hs


def sample(lab, model, prompt, seed, cfg):
    latent = lab.empty_latent.execute(Hn.W, Hn.H, Hn.FRAMES).args[0]
    n, hs = count_blocks(model)
    try:
        out = lab.nodes.common_ksampler(model, seed, lab.steps, cfg, "euler", "simple", lab.conditioning(prompt),
                                        lab.null_conditioning(), latent, denoise=1.0)[0]
    finally:
        for h in hs:
            h.remove()
    v, a = out["samples"].unbind()
    frames, wave = lab.decode(v, a)
    return frames, wave, n[0]


def overrides(method, thr):
    if method == "EasyCache":
        return {"reuse_threshold": thr}
    if method == "TeaCache":
        return {"threshold": thr, "audio_threshold": thr}
    return {"mode": method.split("@")[0], "threshold": thr, "audio_threshold": thr}


def set_variant(method: str) -> None:
    """The lab-only first_block decision variant of ``first_block@<variant>`` ("" = shipped) on the core module the
    node imports (``ditkit.cache.stepcache``)."""
    sc = importlib.import_module("ditkit.cache.stepcache")
    v = method.split("@", 1)[1] if "@" in method else ""
    if v:
        sc.parse_variant(v)
    sc.LAB_FIRST_BLOCK_VARIANT = v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--prompts", type=int, default=2, help="first N of harness.PROMPTS")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per prompt (prompt i, seed k: seed i + 1000 k)")
    ap.add_argument("--match", action="store_true", help="bisect each method's threshold to each target ratio")
    ap.add_argument("--match-probes", type=int, default=4, help="bisection probes per method and target")
    ap.add_argument("--match-tol", type=float, default=0.04, help="stop a target's bisection within this fraction")
    ap.add_argument("--range", default="", help="bisection ranges, e.g. 'TeaCache=0.05,0.4;first_block@acc=0.1,3'")
    ap.add_argument("--calib-prompts", type=int, default=3, help="TeaCache calibration prompts (CALIB_PROMPTS)")
    ap.add_argument("--methods", default=",".join(SWEEPS))
    ap.add_argument("--small", action="store_true", help="the SMALL sweeps (fewer thresholds per method)")
    ap.add_argument("--points", default="", help="explicit sweeps, e.g. 'TeaCache=0.15;first_block=0.4,0.5'")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Rows(a.rows, "stepcache_lab")
    t0 = time.time()
    lab = Hn.ComfyLab(a.steps, cfg=a.cfg)
    prompts = Hn.PROMPTS[:a.prompts]
    cases = [(p, i + 1000 * k) for k in range(a.seeds) for i, p in enumerate(prompts)]   # seed k = 0: seed i
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    exact, n_exact = {}, 0
    for p, seed in cases:
        f, w, n = sample(lab, lab.dit, p, seed, a.cfg)
        exact[(p, seed)] = (f, w)
        n_exact += n
    tea_spec = None
    if "TeaCache" in methods:
        cal = Hn.CALIB_PROMPTS[:a.calib_prompts]
        tea_spec, where = lab.calibrate_teacache(cal)
        print(f"TeaCache calibrated on {len(cal)} prompts at {a.steps} steps, cfg {a.cfg:g} -> {tea_spec} {where}")
    results = []
    ranges = dict(kv.split("=", 1) for kv in a.range.split(";") if "=" in kv)

    def evaluate(m, cls, thr):
        set_variant(m)
        ov = overrides(m, thr)
        if m == "TeaCache":
            ov["coefficients"] = tea_spec
        vs, vp, as_, al, nb = [], [], [], [], 0
        for p, seed in cases:
            model = Hn.apply_node(cls, lab.dit.clone(), ov)
            f, w, n = sample(lab, model, p, seed, a.cfg)
            rf, rw = exact[(p, seed)]
            vs.append(ssim(rf.movedim(1, 0), f.movedim(1, 0)))
            vp.append(psnr(rf, f))
            as_.append(audio_ssim(rw, w))
            al.append(log_spectral_distance(rw, w))
            nb += n
        set_variant("")
        k = len(cases)
        r = {"method": m, "thr": thr, "ratio": n_exact / nb, "skipped": 1 - nb / n_exact, "v_ssim": sum(vs) / k,
             "v_psnr": sum(vp) / k, "a_ssim": sum(as_) / k, "a_lsd": sum(al) / k, "blocks": nb,
             "v_min": min(vs), "a_min": min(as_)}
        results.append(r)
        case = f"{m} thr {thr:g}"
        for key, unit in (("ratio", "x"), ("skipped", "fraction"), ("v_ssim", ""), ("v_psnr", "dB"),
                          ("a_ssim", ""), ("a_lsd", "dB"), ("blocks", ""), ("v_min", ""), ("a_min", "")):
            out.add(case, key, r[key], unit)
        print(f"{case:28s} ratio {r['ratio']:.2f}x skipped {r['skipped']:.2f} video SSIM {r['v_ssim']:.4f} "
              f"PSNR {r['v_psnr']:.2f} dB audio SSIM {r['a_ssim']:.4f} LSD {r['a_lsd']:.2f} dB "
              f"(min {r['v_min']:.4f} / {r['a_min']:.4f}) [{time.time() - t0:.0f}s]", flush=True)
        return r

    for m in methods:
        base = m.split("@")[0]
        if base not in SWEEPS:
            raise SystemExit(f"unknown method {m!r} (one of {list(SWEEPS)}, first_block@<variant>)")
        module, node_id, _, thrs = SWEEPS[base]
        thrs = SMALL[base] if a.small else thrs
        pts = dict(kv.split("=", 1) for kv in a.points.split(";") if "=" in kv)
        if a.points and not a.match:
            if m not in pts:
                continue
            thrs = tuple(float(x) for x in pts[m].split(","))
        cls, why = Hn.find_node(module, node_id)
        if cls is None:
            print(f"{m}: {why}")
            continue
        if not a.match:
            for thr in thrs:
                evaluate(m, cls, thr)
            continue
        lo, hi = (float(x) for x in ranges[m].split(",")) if m in ranges else (min(thrs), max(thrs))
        probed = {}
        for t in TARGETS:
            a_lo, a_hi = lo, hi
            for _ in range(a.match_probes):
                below = [th for th, r in probed.items() if r["ratio"] < t and a_lo <= th <= a_hi]
                above = [th for th, r in probed.items() if r["ratio"] >= t and a_lo <= th <= a_hi]
                a_lo = max(below, default=a_lo)
                a_hi = min(above, default=a_hi)
                thr = float(f"{math.sqrt(a_lo * a_hi):.4g}")
                if thr in probed:
                    break
                probed[thr] = evaluate(m, cls, thr)
                if abs(probed[thr]["ratio"] - t) <= a.match_tol * t:
                    break
    print(f"\nH3 lab, {len(prompts)} prompts x {a.seeds} seed(s), {a.steps} euler steps, cfg {a.cfg:g}; exact {n_exact} block "
          f"evaluations")
    print("target | method          | thr    | ratio | skipped | video SSIM | video PSNR | audio SSIM | audio LSD")
    for t in TARGETS:
        for m in methods:
            pts = [r for r in results if r["method"] == m]
            if not pts:
                continue
            r = min(pts, key=lambda r: abs(r["ratio"] - t))
            print(f"{t:>5.1f}x | {m:15s} | {r['thr']:<6g} | {r['ratio']:.2f}x | {r['skipped']:.2f}    | "
                  f"{r['v_ssim']:.4f}     | {r['v_psnr']:6.2f} dB  | {r['a_ssim']:.4f}     | {r['a_lsd']:.2f} dB")
            out.add(f"target {t:g}x {m}", "thr", r["thr"])
    for m in ("first_block", "sigma_schedule"):
        ok = [r for r in results if r["method"] == m and r["v_ssim"] >= 0.98 and r["a_ssim"] >= 0.98]
        if ok:
            best = max(ok, key=lambda r: r["thr"])
            print(f"default rule ({m}): largest threshold with video and audio SSIM >= 0.98: {best['thr']:g} "
                  f"({best['ratio']:.2f}x)")
            out.add(f"default {m}", "thr", best["thr"])
    print(f"total {time.time() - t0:.0f}s")
    lab.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
