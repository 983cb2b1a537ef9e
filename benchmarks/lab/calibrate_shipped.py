"""Writes ditkit's shipped TeaCache coefficients for the quality-lab H3 (``cache/defaults/h3lab_calibrated.json``).

The harness's own procedure (``harness.calibrate_teacache``: the DitKitTeaCacheCalibrate node on the lab DiT, full
compute, the 6 calibration prompts, euler / simple, the harness's default steps and CFG) in ComfyUI in-process,
into a scratch output folder; the fitted file is then copied with its provenance stating where it came from.
Deterministic inputs (lab weights, seeds 100..105), so a rerun reproduces the fit up to float noise.

    COMFYUI_PATH=... python benchmarks/lab/calibrate_shipped.py [--steps 20] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parents[1]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

import harness as Hn  # noqa: E402
import lab_comfy as L  # noqa: E402

OUT = HERE.parents[1] / "cache" / "defaults" / "h3lab_calibrated.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    lab = Hn.make_lab("comfy", a.steps, L.DIT_FILE, L.VAE_FILE, L.TEXT_FILE, Hn.DEFAULT_CFG)
    spec, where = lab.calibrate_teacache(Hn.CALIB_PROMPTS)
    src = Path(lab.scratch) / "ditkit" / "teacache" / spec
    raw = json.loads(src.read_text(encoding="utf-8"))
    raw["calibration"]["pair_files"] = []
    raw["provenance"] = {
        "kind": "calibrated",
        "source": (f"benchmarks/lab/calibrate_shipped.py: DitKitTeaCacheCalibrate on the quality-lab H3 "
                   f"(benchmarks/lab/weights/h3lab_dit.safetensors, benchmarks/lab/MODEL_CARD.md) via "
                   f"harness.calibrate_teacache: {len(Hn.CALIB_PROMPTS)} prompts {list(Hn.CALIB_PROMPTS)}, "
                   f"{a.steps} euler / simple steps, cfg {Hn.DEFAULT_CFG:g}, seeds 100..{99 + len(Hn.CALIB_PROMPTS)}"),
        "created": raw["provenance"].get("created"), "ditkit_version": raw["provenance"].get("ditkit_version"),
        "note": ("Fitted on the trained tiny lab model (1.13 M parameters), not on MiniMax H3: use it with the lab "
                 "DiT. A real H3 checkpoint needs its own calibration; the fingerprint guard warns otherwise. "
                 "Pair files not shipped."),
    }
    Path(a.out).write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    fits = {s: (st.get("fit") or {}).get("r2") for s, st in raw["streams"].items()}
    print(f"wrote {a.out}: R2 {fits}, {raw['calibration']['n_pairs']} pairs, {time.time() - t0:.0f} s {where}")
    lab.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
