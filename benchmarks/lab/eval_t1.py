"""T=1 decode check for a lab video VAE: native single-token decode vs repeat-decode on held-out frames.

    COMFYUI_PATH=/path/to/ComfyUI python benchmarks/lab/eval_t1.py [--vae FILE] [--clips 12] [--split 6]

Same protocol as ``harness.run_t1``: clip ``seed0 + i`` (default ``HELDOUT_SEED`` = 7,000,000, never used by
the training scripts), frames 0/8/16 each encoded alone (``V.encode(video[:, :, f:f+1])``, H3's T=1 encode);
native = ``V.decode(z)`` (one token), repeat = ``V.decode(cat([z, z], 2))[:, :, 0]`` (pseudo T=2, one 7-token
window, keep frame 0), in-clip = the same frame decoded inside its 22-frame clip. ``--split k`` also reports
clips ``0..k-1`` and ``k..`` separately. ``train_vae.py`` uses :func:`evaluate` with another seed range
(``VAL_SEED``) to pick checkpoints, so the reported held-out clips play no part in selection.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
import lab_comfy as L  # noqa: E402

from benchmarks.lab import lab_data as D  # noqa: E402
from benchmarks.lab.lab_metrics import paired_gain_ci, psnr, ssim  # noqa: E402

HELDOUT_SEED = 7_000_000  # the harness's held-out clips
VAL_SEED = 7_500_000  # checkpoint selection during training (disjoint from HELDOUT_SEED + i, i < 500k)
FRAMES, H, W = 22, 64, 96
FRAME_IDS = (0, 8, 16)
KEYS = ("native", "repeat", "clip")


def evaluate(vae, n_clips: int = 12, seed0: int = HELDOUT_SEED, frame_ids=FRAME_IDS) -> list[dict]:
    """Per-frame PSNR / SSIM of the three decodes; one dict per (clip, frame)."""
    out = []
    was_training = vae.training
    vae.eval()
    with torch.inference_mode():
        for i in range(n_clips):
            clip = D.make_clip(seed0 + i, FRAMES, H, W)
            full = vae.decode(vae.encode(clip.video[None]))[0]
            for f in frame_ids:
                ref = (clip.video[:, f] + 1) / 2
                z = vae.encode(clip.video[None, :, f:f + 1])
                dec = {"native": vae.decode(z)[0, :, 0], "repeat": vae.decode(torch.cat([z, z], dim=2))[0, :, 0],
                       "clip": full[:, f]}
                row = {"clip_index": i, "frame": f}
                for k, img in dec.items():
                    row[k] = psnr(ref, img)
                    row[k + "_ssim"] = ssim(ref, img)
                out.append(row)
    vae.train(was_training)
    return out


def summarise(rows: list[dict]) -> dict:
    n = len(rows)
    s = {"frames": n}
    for k in KEYS:
        s[k] = sum(r[k] for r in rows) / n
        s[k + "_ssim"] = sum(r[k + "_ssim"] for r in rows) / n
    s["gap"] = s["repeat"] - s["native"]
    _, s["gap_lo"], s["gap_hi"] = paired_gain_ci([r["repeat"] for r in rows], [r["native"] for r in rows],
                                                 [r["clip_index"] for r in rows])
    s["frames_repeat_better"] = sum(r["repeat"] > r["native"] for r in rows)
    return s


def table(name: str, s: dict) -> str:
    return (f"{name:<14} n={s['frames']:3d}  native {s['native']:6.2f} dB / {s['native_ssim']:.3f}  "
            f"repeat {s['repeat']:6.2f} dB / {s['repeat_ssim']:.3f}  in-clip {s['clip']:6.2f} dB / "
            f"{s['clip_ssim']:.3f}  gap {s['gap']:+.2f} dB (95 % CI {s['gap_lo']:+.2f}..{s['gap_hi']:+.2f})  (repeat better on {s['frames_repeat_better']}/"
            f"{s['frames']})")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--vae", default=str(L.VAE_FILE))
    ap.add_argument("--clips", type=int, default=12)
    ap.add_argument("--split", type=int, default=6, help="also report clips [0, split) and [split, clips)")
    ap.add_argument("--seed0", type=int, default=HELDOUT_SEED)
    ap.add_argument("--json", default="", help="write the per-frame rows and summaries here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    L.import_comfy()
    vae = L.load_vae(a.vae)
    rows = evaluate(vae, a.clips, a.seed0)
    res = {"vae": a.vae, "seed0": a.seed0, "all": summarise(rows)}
    print(table(f"clips 0-{a.clips - 1}", res["all"]))
    if 0 < a.split < a.clips:
        res["first"] = summarise([r for r in rows if r["clip_index"] < a.split])
        res["second"] = summarise([r for r in rows if r["clip_index"] >= a.split])
        print(table(f"clips 0-{a.split - 1}", res["first"]))
        print(table(f"clips {a.split}-{a.clips - 1}", res["second"]))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(res, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
