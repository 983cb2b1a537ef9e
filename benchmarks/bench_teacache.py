"""TeaCache benchmark: block evaluations saved vs output quality, ditkit (calibrated / borrowed) vs native EasyCache.

    COMFYUI_PATH=/work/ComfyUI nice -n 10 python benchmarks/bench_teacache.py [--families h3,ltx2] [--steps 25,50]
        [--rows FILE] [--json FILE]

Everything runs in-process in the real ComfyUI host (CPU) on the tiny deterministic checkpoints
(``ditkit.tiny.checkpoints``), through the real nodes: ``DitKitTeaCacheCalibrate`` (calibration on
``--calib-prompts`` synthetic prompts, per step count), ``DitKitTeaCache`` (a threshold grid) with

* the calibrated file,
* a *borrowed* file: the published FLUX.1-dev polynomial (ali-vilab/TeaCache) relabelled for the family (what
  peers do for models without their own fit), and
* native ``EasyCache`` on a reuse-threshold grid, compared at the nearest skip ratio.

Quality is measured on the output LATENTS (the tiny models have no meaningful decoder) against the uncached
output of the same prompt and seed: SSIM (7x7 Gaussian window, data range of the reference) and PSNR, for the
video and audio streams separately (image models: one stream). Block evaluations are counted with forward
pre-hooks on the block modules. Random-weight tiny models do not denoise anything meaningful; treat the
quality numbers as a test of the mechanism, not of the method's quality on real models. With ``--rows FILE`` every
table cell is also written as a row (case ``<family> <steps> steps/<method>/<threshold>``; benchmarks/_harness.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
import teacache_harness as H  # noqa: E402
from benchmarks._harness import Rows, add_rows_argument  # noqa: E402

FLUX1 = [498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861]
TC_GRID = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2)
EZ_GRID = (0.02, 0.05, 0.08, 0.12, 0.16, 0.2, 0.3, 0.4, 0.6, 0.8, 1.2, 2.0, 3.0)


def latent_metrics(ref: torch.Tensor, est: torch.Tensor) -> tuple[float, float]:
    from benchmarks.lab.lab_metrics import psnr, ssim

    r = ref.double()
    e = est.double()
    rng = float(r.max() - r.min()) or 1.0
    r0 = (r - r.min()) / rng
    e0 = (e - r.min()) / rng
    if r.dim() == 5:  # video [B, C, T, H, W] -> frames [T, C, H, W]
        r0, e0 = r0[0].movedim(1, 0), e0[0].movedim(1, 0)
    elif r.dim() == 4 and r.shape[2] == 2:  # H3 audio [B, C, 2, T] -> [2, C, T]
        r0, e0 = r0[0].movedim(1, 0), e0[0].movedim(1, 0)
    else:  # [B, C, H, W] / LTX audio [B, C, T, F]
        r0, e0 = r0[0], e0[0]
    win = min(7, r0.shape[-1], r0.shape[-2])
    if win % 2 == 0:
        win -= 1
    return ssim(r0, e0, data_range=1.0, win_size=win), psnr(r0, e0, data_range=1.0)


def stream_names(family):
    return {"h3": ("video", "audio"), "ltx2": ("video", "audio")}.get(family, ("image",))


class TinyBackend:
    """Tiny random-weight checkpoints; synthetic prompts; metrics on latents."""

    def __init__(self, family, ckpts, cfg):
        self.family = family
        self.cfg = cfg
        self.model = H.load_model(family, ckpts)
        self.label = f"tiny {family} (random weights), metrics on latents"

    def prompts(self, kind, n):
        base = 100 if kind == "calib" else 200
        return [base + i for i in range(n)]

    def sample(self, model, prompt, steps):
        return H.sample(model, *H.make_inputs(self.model, self.family, prompt), steps=steps, cfg=self.cfg, seed=5 + prompt)

    def streams(self):
        return stream_names(self.family)

    def metrics(self, ref, est):
        out = {}
        for si, s in enumerate(self.streams()):
            out[f"{s}_ssim"], out[f"{s}_psnr"] = latent_metrics(ref[si], est[si])
        return out


class LabBackend:
    """The quality lab's trained tiny H3 (benchmarks/lab): real prompts, decoded frames and waveforms."""

    def __init__(self, steps):
        sys.path.insert(0, str(HERE / "lab"))
        import harness as LH  # benchmarks/lab/harness.py

        self.LH = LH
        self.lab = LH.ComfyLab(steps)
        self.model = self.lab.dit
        self.family = "h3"
        self.label = "quality-lab trained H3, metrics on decoded video frames / audio"

    def prompts(self, kind, n):
        src = self.LH.CALIB_PROMPTS if kind == "calib" else self.LH.PROMPTS
        return list(src[:n])

    def sample(self, model, prompt, steps):
        self.lab.steps = steps
        v, a, _, _ = self.lab.sample(model, prompt, 11)
        return [v, a]

    def streams(self):
        return ("video", "audio")

    def metrics(self, ref, est):
        from benchmarks.lab.lab_metrics import log_spectral_distance, psnr, snr, ssim

        fr, wr = self.lab.decode(*ref)
        fe, we = self.lab.decode(*est)
        out = {"video_ssim": ssim(fr.movedim(1, 0), fe.movedim(1, 0)), "video_psnr": psnr(fr, fe)}
        out["audio_ssim"], _ = latent_metrics(ref[1], est[1])
        out["audio_psnr"] = snr(wr, we)  # waveform SNR (dB) in the PSNR column for audio
        out["audio_lsd"] = log_spectral_distance(wr, we)
        return out


def _mean(vals):
    fin = [v for v in vals if math.isfinite(v)]
    return sum(fin) / len(fin) if fin else math.inf


def run_case(backend, model, prompts, steps, ref, full=None):
    cnt = H.BlockCounter(backend.model)
    outs = []
    t0 = time.perf_counter()
    for p in prompts:
        outs.append(backend.sample(model, p, steps))
    dt = time.perf_counter() - t0
    cnt.close()
    full = full or cnt.n  # block evaluations of the uncached run of the same prompts
    res = {"evals": cnt.n, "full": full, "ratio": full / max(cnt.n, 1), "saved": 1 - cnt.n / full, "time_s": dt}
    if ref is not None:
        ms = [backend.metrics(r, o) for r, o in zip(ref, outs)]
        for k in ms[0]:
            res[k] = _mean([m[k] for m in ms])
    return res, outs


def borrowed_file(family, out_dir) -> str:
    from ditkit.cache import coefficients as coef

    cf = coef.CoefficientFile(
        family, {s: coef.StreamCoefficients(s, tuple(FLUX1), None, None) for s in coef.FAMILY_STREAMS[family]},
        {"family": family, "model": None},
        {"kind": "borrowed", "source": "ali-vilab/TeaCache TeaCache4FLUX/teacache_flux.py (FLUX.1-dev)",
         "note": "benchmark: borrowed FLUX.1 polynomial relabelled for this family"})
    # DitKitTeaCache only reads coefficient files inside <output>/ditkit/teacache: write it there, pass the name
    name = f"{family}_borrowed_flux1.json"
    folder = os.path.join(out_dir, "ditkit", "teacache")
    os.makedirs(folder, exist_ok=True)
    coef.save(cf, os.path.join(folder, name))
    return name


def bench_family(backend, steps_list, n_calib, n_eval, out_dir, rows, table):
    from comfy_extras.nodes_easycache import EasyCacheNode

    from ditkit.nodes.teacache import DitKitTeaCache, DitKitTeaCacheCalibrate

    family, model = backend.family, backend.model
    borrowed = borrowed_file(family, out_dir)
    streams = backend.streams()
    for steps in steps_list:
        name = f"bench_{family}_{steps}"
        cal = DitKitTeaCacheCalibrate.execute(model=model, name=name, degree=4, min_prompts=n_calib).result[0]
        for p in backend.prompts("calib", n_calib):
            backend.sample(cal, p, steps)
        coef_path = os.path.join(out_dir, "ditkit", "teacache", f"{name}.json")
        fit = json.load(open(coef_path))["streams"]
        prompts = backend.prompts("eval", n_eval)
        base, ref = run_case(backend, model, prompts, steps, None)
        print(f"\n## {backend.label}: {steps} steps, {n_calib} calibration prompts, {n_eval} eval prompts; "
              f"uncached {base['time_s']:.2f}s; fit R2 " + ", ".join(f"{s} {v['fit']['r2']:.3f}" for s, v in fit.items()))
        pre = f"{family} {steps} steps"
        table.add(f"{pre}/uncached", "block_evals", base["evals"])
        table.add(f"{pre}/uncached", "time", base["time_s"], "s", n=1)
        table.add(f"{pre}/uncached", "prompts", n_eval)
        for s, v in fit.items():
            table.add(f"{pre}/calibration", f"{s}_fit_r2", v["fit"]["r2"], note=f"{n_calib} calibration prompts")
        results = {"calibrated": [], "borrowed": [], "easycache": []}
        for thr in TC_GRID:
            for kind, spec in (("calibrated", f"{name}.json"), ("borrowed", borrowed)):
                m = DitKitTeaCache.execute(model=model, coefficients=spec, threshold=thr, audio_threshold=thr,
                                           start_percent=0.0, end_percent=1.0, cache_device="model", strict=False).result[0]
                r, _ = run_case(backend, m, prompts, steps, ref, base["evals"])
                r.update(kind=kind, thr=thr, t_ref=base["time_s"])
                results[kind].append(r)
        for thr in EZ_GRID:
            m = EasyCacheNode.execute(model=model, reuse_threshold=thr, start_percent=0.15, end_percent=0.95, verbose=False).result[0]
            r, _ = run_case(backend, m, prompts, steps, ref, base["evals"])
            r.update(kind="easycache", thr=thr, t_ref=base["time_s"])
            results["easycache"].append(r)
        print("| method | threshold | block evals | fewer evals | wall speedup | "
              + " | ".join(f"{s} SSIM | {s} PSNR" for s in streams) + " |")
        print("|" + "---|" * (5 + 2 * len(streams)))
        for kind in ("calibrated", "borrowed", "easycache"):
            for r in results[kind]:
                print(f"| {kind} | {r['thr']} | {r['evals']}/{r['full']} | {r['ratio']:.2f}x | {base['time_s'] / r['time_s']:.2f}x | "
                      + " | ".join(f"{r[f'{s}_ssim']:.4f} | {r[f'{s}_psnr']:.1f}" for s in streams) + " |")
                case = f"{pre}/{kind}/{r['thr']}"
                table.add(case, "block_evals", r["evals"])
                table.add(case, "block_evals_uncached", r["full"])
                table.add(case, "fewer_evals", r["ratio"], "x")
                table.add(case, "wall_speedup", base["time_s"] / r["time_s"], "x", n=1)
                for s in streams:
                    table.add(case, f"{s}_ssim", r[f"{s}_ssim"])
                    table.add(case, f"{s}_psnr", r[f"{s}_psnr"], "dB")
        print("\nmatched skip ratio (calibrated TeaCache vs the EasyCache point with the nearest saved fraction):")
        for r in results["calibrated"]:
            if r["saved"] <= 0:
                continue
            e = min(results["easycache"], key=lambda x: (abs(x["saved"] - r["saved"]), -x["saved"]))
            print(f"  TeaCache thr {r['thr']}: {r['ratio']:.2f}x | EasyCache reuse {e['thr']}: {e['ratio']:.2f}x | "
                  + " | ".join(f"{s} SSIM {r[f'{s}_ssim']:.4f} vs {e[f'{s}_ssim']:.4f}" for s in streams))
            case = f"{pre}/matched/{r['thr']}"
            table.add(case, "teacache_fewer_evals", r["ratio"], "x")
            table.add(case, "easycache_threshold", e["thr"])
            table.add(case, "easycache_fewer_evals", e["ratio"], "x")
            for s in streams:
                table.add(case, f"{s}_ssim_teacache", r[f"{s}_ssim"])
                table.add(case, f"{s}_ssim_easycache", e[f"{s}_ssim"])
        goal = [r for r in results["calibrated"] if r["ratio"] >= 1.8 and all(r[f"{s}_ssim"] >= 0.95 for s in streams)]
        best = max(goal, key=lambda r: r["ratio"]) if goal else None
        print("goal (>= 1.8x fewer block evaluations at SSIM >= 0.95 on every stream): "
              + (f"met, up to threshold {best['thr']} ({best['ratio']:.2f}x)" if best else "NOT met"))
        table.add(f"{pre}/goal", "met", best is not None, note=">= 1.8x fewer block evaluations at SSIM >= 0.95 on "
                  "every stream" + (f"; up to threshold {best['thr']} ({best['ratio']:.2f}x)" if best else ""))
        rows.append({"backend": backend.label, "steps": steps, "results": results, "fit": {s: v["fit"] for s, v in fit.items()}})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="h3")
    ap.add_argument("--steps", default="25,50")
    ap.add_argument("--calib-prompts", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=3)
    ap.add_argument("--cfg", type=float, default=1.0)
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--lab", action="store_true", help="use the quality lab's trained H3 (benchmarks/lab/weights)")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    table = Rows(a.rows, "bench_teacache")
    torch.set_num_threads(1)
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    H.import_comfy(comfy_path)
    import folder_paths

    from ditkit.tiny.checkpoints import generate_all

    logging_off()
    work = tempfile.mkdtemp(prefix="bench_teacache_")
    folder_paths.set_output_directory(work)
    rows = []
    steps_list = [int(s) for s in a.steps.split(",")]
    print(f"# TeaCache benchmark (CPU, torch {torch.__version__}); work dir {work}")
    if a.lab:
        bench_family(LabBackend(steps_list[0]), steps_list, a.calib_prompts, a.eval_prompts, work, rows, table)
    else:
        fams = [f.strip() for f in a.families.split(",") if f.strip()]
        names = {"h3": "h3_dit", "ltx2": "ltx_dit", "zimage": "zimage_dit", "flux2": "flux2_dit"}
        generate_all(os.path.join(work, "ckpts"), only=[names[f] for f in fams])
        for f in fams:
            bench_family(TinyBackend(f, os.path.join(work, "ckpts"), a.cfg), steps_list, a.calib_prompts,
                         a.eval_prompts, work, rows, table)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)


def logging_off():
    import logging

    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("ditkit").setLevel(logging.ERROR)


if __name__ == "__main__":
    main()
