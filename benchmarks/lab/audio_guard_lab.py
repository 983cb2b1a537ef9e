"""Audio guard on the lab: false positives on clean clips, and whether every injected fault is flagged.

    nice -n 10 python benchmarks/lab/audio_guard_lab.py [--clips 48] [--rows FILE]
    COMFYUI_PATH=... nice -n 10 python benchmarks/lab/audio_guard_lab.py --dit-samples 2   # + lab DiT samples

Clean set: ``--clips`` held-out lab clips (``lab_data.make_clip``, seeds from 7,100,000) through the lab audio codec
(encode -> decode: what a decoder hands the save node), plus, with ``--dit-samples`` and a ComfyUI, the lab DiT's
exact samples (25 euler steps, CFG 3) decoded the same way. Faults injected into every clean clip: DC (+0.05 full
scale), clipping (scaled to peak 2.0, clamped to +-1), silence (x 1e-4), one NaN sample, a pop (one 5 ms burst at 0.9); with
the DiT: a stale audio residual (DitKitStepCache first_block with the audio threshold at 10, i.e. the audio stream
reuses its residual on every step the video stream allows, with the video threshold at 10 too).
Prints per check the clean maximum, the false-positive count, and per fault the detection count.

``--trajectory P,S`` (with a ComfyUI): the sampling-time check (``bridge/audio_watch.py``, the step-to-step
spectral jump of the audio estimate) on the first P prompts x S seeds at 25 steps, CFG ``--cfg``: clean runs
(DitKitStepCache first_block at threshold 0: every block computed, bit-identical to no cache, so the check runs
through the node's own wrapper), the stale audio residual (thresholds 10) and the first_block default (-1, not a
fault: its figure is printed). Prints the final jump ratio's range per kind, false positives and detections.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402
from benchmarks.lab import lab_data as D  # noqa: E402
from ditkit.cache.audio_guard import check_waveform  # noqa: E402

SEED0 = 7_100_000


def faults(w: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"DC +0.05": w + 0.05, "clipping (peak to 2, clamped)": (w * (2.0 / w.abs().amax())).clamp(-1, 1),
           "silence (x1e-4)": w * 1e-4}
    nan = w.clone()
    nan[0, nan.shape[-1] // 2] = float("nan")
    out["NaN sample"] = nan
    pop = w.clone()
    i = pop.shape[-1] // 3
    pop[:, i:i + D.SAMPLE_RATE // 200] = 0.9
    out["pop (5 ms at 0.9)"] = pop
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=48)
    ap.add_argument("--dit-samples", type=int, default=0)
    ap.add_argument("--trajectory", default="", help="P,S: the sampling-time check on P prompts x S seeds")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--cfg", type=float, default=3.0)
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Rows(a.rows, "audio_guard_lab")
    if a.trajectory:
        p, s = (int(v) for v in a.trajectory.split(","))
        return trajectory(p, s, a.steps, a.cfg, out)
    clean = []
    for i in range(a.clips):
        clip = D.make_clip(SEED0 + i)
        clean.append(("lab clip", D.audio_decode(D.audio_encode(clip.audio)).float()))
    stale = []
    if a.dit_samples:
        import harness as Hn

        lab = Hn.ComfyLab(25, cfg=3.0)   # imports ComfyUI first

        from ditkit.nodes.stepcache import DitKitStepCache
        for i, p in enumerate(Hn.PROMPTS[:a.dit_samples]):
            v, au, _, _ = lab.sample(lab.dit, p, i)
            clean.append(("DiT sample", lab.decode(v, au)[1].float()))
            m = DitKitStepCache.execute(model=lab.dit.clone(), mode="first_block", threshold=10.0,
                                        audio_threshold=10.0, start_percent=0.0, end_percent=1.0,
                                        cache_device="model").args[0]
            v, au, _, _ = lab.sample(m, p, i)
            stale.append(lab.decode(v, au)[1].float())
    reps = [check_waveform(w) for _, w in clean]
    fp = sum(not r.clean for r in reps)
    print(f"clean: {len(reps)} clips ({sum(k == 'lab clip' for k, _ in clean)} lab clips, "
          f"{sum(k == 'DiT sample' for k, _ in clean)} DiT samples); flagged {fp} "
          f"(false-positive rate {fp / len(reps):.3f})")
    for r in reps:
        if not r.clean:
            print("  false positive:", r.flags)
    for k in ("dc_offset", "clipping", "spectral_jump_db"):
        mx = max(r.figures[k] for r in reps)
        print(f"  clean max {k}: {mx:.4g}")
        out.add("clean", f"max_{k}", mx)
    mn = min(r.figures["rms_dbfs"] for r in reps)
    print(f"  clean min loudest-channel RMS: {mn:.2f} dBFS")
    out.add("clean", "min_rms_dbfs", mn, "dBFS")
    out.add("clean", "clips", len(reps))
    out.add("clean", "false_positives", fp)
    names = list(faults(clean[0][1]))
    for name in names:
        hit = sum(not check_waveform(faults(w)[name]).clean for _, w in clean)
        print(f"fault {name:20s}: flagged {hit}/{len(clean)}")
        out.add(f"fault {name}", "flagged", hit)
        out.add(f"fault {name}", "of", len(clean))
    for j, w in enumerate(stale):
        r = check_waveform(w)
        print(f"fault stale audio residual (DiT sample {j}): {'flagged ' + '; '.join(r.flags) if r.flags else 'NOT flagged'}"
              f" (figures {r.figures})")
        out.add("fault stale audio residual", f"flagged_{j}", int(not r.clean))
    return 0


def trajectory(n_prompts: int, n_seeds: int, steps: int, cfg: float, out: Rows) -> int:
    import harness as Hn

    lab = Hn.ComfyLab(steps, cfg=cfg)   # imports ComfyUI first

    import ditkit.bridge.audio_watch as W
    from ditkit.nodes.stepcache import DitKitStepCache

    got = []
    real = W.AudioWatch.finish
    W.AudioWatch.finish = lambda self, lc: got.append(real(self, lc)) or got[-1]
    kinds = {"clean (no skip)": 0.0, "stale audio residual (fault)": 10.0, "first_block default": -1.0}
    res = {k: [] for k in kinds}
    try:
        for i, p in enumerate(Hn.PROMPTS[:n_prompts]):
            for seed in range(n_seeds):
                for k, thr in kinds.items():
                    m = DitKitStepCache.execute(model=lab.dit.clone(), mode="first_block", threshold=thr,
                                                audio_threshold=thr, start_percent=0.0, end_percent=1.0,
                                                cache_device="model").args[0]
                    lab.sample(m, p, seed)
                    res[k].append(got[-1])
    finally:
        W.AudioWatch.finish = real
    print(f"sampling-time audio check, lab H3, {n_prompts} prompts x {n_seeds} seeds, {steps} steps, cfg {cfg:g}")
    for k, rs in res.items():
        ratios = [r["trajectory"]["final_jump_ratio"] for r in rs]
        flagged = sum(not r["clean"] for r in rs)
        print(f"{k:30s}: {len(rs)} runs, final jump ratio {min(ratios):.2f}-{max(ratios):.2f} "
              f"(median {sorted(ratios)[len(ratios) // 2]:.2f}), flagged {flagged}/{len(rs)}")
        out.add(f"trajectory {k}", "runs", len(rs))
        out.add(f"trajectory {k}", "flagged", flagged)
        out.add(f"trajectory {k}", "ratio_min", min(ratios))
        out.add(f"trajectory {k}", "ratio_max", max(ratios))
    lab.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
