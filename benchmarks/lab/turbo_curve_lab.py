"""Turbo-style LoRA on the PRUNED (curve-form) lab DiT: ditkit's curve carry vs dropping the AdaLN pairs (what the
community "pruned" Turbo conversions do), each against the UNPRUNED lab DiT + the same LoRA (issue #30 item 3).

    COMFYUI_PATH=/path/to/ComfyUI nice -n 10 python benchmarks/lab/turbo_curve_lab.py [--steps 4] [--rows FILE]

The lab DiT (benchmarks/lab/weights/h3lab_dit.safetensors) is pruned as the Comfy-Org files are (rank-8 SVD basis of
the centred silu(t_emb) curve on a 1025-point grid; ``tiny/ckpt_h3.curve_state_dict``). The LoRA is random (the lab
has no trained Turbo LoRA): rank 4 on every block linear and AdaLN plus the final AdaLN, scaled to a few % of each
weight, so the rows show where the outputs differ, not a Turbo LoRA's quality. Rows, each vs the unpruned base + LoRA
(fused, float), same prompts, seeds, cfg and steps (KSampler euler / simple):

* pruned base alone (the pruning's own cost, no LoRA) and unpruned base alone (the LoRA's size);
* pruned + LoRA without its AdaLN pairs (the community conversions' content);
* pruned + LoRA with the AdaLN pairs carried as curve columns, bypass and fuse (silu(t_emb) from the unpruned
  checkpoint's time embedder, ``time_embedder_checkpoint``).

Video PSNR / SSIM of the decoded frames, audio log-spectral distance (dB).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))
import lab_comfy as L  # noqa: E402

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402
from benchmarks.lab.lab_metrics import log_spectral_distance, psnr, ssim  # noqa: E402

PROMPTS = ("red circle right", "blue square left", "green triangle up")
SEEDS = (11, 12)
RANK, GRID, BASIS = 4, 1025, 8


def lora_for(base: dict, seed: int = 5, rel: float = 0.05) -> dict:
    """ComfyUI-named LoRA (lora_down / lora_up / alpha = rank) on every block linear and AdaLN and the final AdaLN;
    each ΔW scaled to ``rel`` of its weight's RMS."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, w in base.items():
        if not k.endswith(".weight") or w.dim() != 2:
            continue
        if not (k.startswith("blocks.") or k.startswith("final_layer.adaln_proj")):
            continue
        m = k[: -len(".weight")]
        a = torch.randn(RANK, w.shape[1], generator=g)
        b = torch.randn(w.shape[0], RANK, generator=g)
        d = b @ a
        s = rel * w.float().pow(2).mean().sqrt() / d.pow(2).mean().sqrt()
        out[f"diffusion_model.{m}.lora_down.weight"] = a * s.sqrt()
        out[f"diffusion_model.{m}.lora_up.weight"] = b * s.sqrt()
        out[f"diffusion_model.{m}.alpha"] = torch.tensor(float(RANK))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="1 prompt x 1 seed (CI smoke)")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    import tempfile

    from harness import ComfyLab

    lab = ComfyLab(a.steps)           # imports ComfyUI from COMFYUI_PATH
    import comfy.model_management
    import comfy.sd

    from ditkit.bridge.adapters import apply_h3_adapter
    from ditkit.loaders.safetensors_io import load_file, save_file
    from ditkit.tiny import ckpt_h3 as c
    base = load_file(str(L.DIT_FILE))
    cfg = {"timestep_input_dim": base["time_embedder.proj_in.weight"].shape[1]}
    pruned = comfy.sd.load_diffusion_model_state_dict(c.curve_state_dict(base, cfg, GRID, BASIS))
    lora = lora_for(base)
    tmp = Path(tempfile.mkdtemp(prefix="turbo_curve_lab_"))
    full_p, noada_p = tmp / "lora.safetensors", tmp / "lora_no_adaln.safetensors"
    save_file(lora, full_p)
    save_file({k: v for k, v in lora.items() if "adaln_proj" not in k}, noada_p)
    models = {"unpruned + LoRA (reference)": apply_h3_adapter(lab.dit, str(full_p), 1.0)[0],
              "unpruned base alone": lab.dit,
              "pruned base alone": pruned,
              "pruned + LoRA, AdaLN pairs dropped (community conversion)": apply_h3_adapter(pruned, str(noada_p), 1.0)[0]}
    for mode in ("bypass", "fuse"):
        models[f"pruned + LoRA, AdaLN pairs as curve columns ({mode})"] = apply_h3_adapter(
            pruned, str(full_p), 1.0, mode=mode, time_embedder=str(L.DIT_FILE))[0]
    prompts, seeds = (PROMPTS[:1], SEEDS[:1]) if a.smoke else (PROMPTS, SEEDS)
    outs = {}
    for name, m in models.items():
        outs[name] = []
        for p in prompts:
            for s in seeds:
                v, au, _, _ = lab.sample(m, p, s)
                outs[name].append(lab.decode(v, au))
        comfy.model_management.unload_all_models()
    ref = outs["unpruned + LoRA (reference)"]
    rows = Rows(a.rows, "turbo_curve_lab")
    print(f"turbo curve lab: {len(prompts)} prompts x {len(seeds)} seeds, {a.steps} steps, cfg {lab.cfg:g}, "
          f"grid {GRID}, basis {BASIS}, LoRA rank {RANK}")
    print(f"{'vs unpruned + LoRA':64s} {'PSNR dB':>8s} {'SSIM':>7s} {'LSD dB':>7s}")
    for name, got in outs.items():
        if got is ref:
            continue
        ps = [psnr(r[0], g[0]) for r, g in zip(ref, got)]
        ss = [ssim(r[0], g[0]) for r, g in zip(ref, got)]
        ls = [log_spectral_distance(r[1], g[1]) for r, g in zip(ref, got)]
        mp, ms, ml = (sum(x) / len(x) for x in (ps, ss, ls))
        print(f"{name:64s} {mp:8.2f} {ms:7.4f} {ml:7.3f}")
        rows.add(name, "video_psnr", mp, "dB", min=min(ps), max=max(ps), n=len(ps))
        rows.add(name, "ssim", ms, min=min(ss), max=max(ss), n=len(ss))
        rows.add(name, "audio_lsd", ml, "dB", min=min(ls), max=max(ls), n=len(ls))
    lab.close()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
