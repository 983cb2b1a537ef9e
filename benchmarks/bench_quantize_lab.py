"""Quality delta of quantize-while-loading on the quality lab's trained tiny H3 DiT (``benchmarks/lab``).

For each format the lab DiT file goes through ditkit's streaming quantizer (the state dict DitKitH3ModelLoader
builds, recipe and all) into ComfyUI's own loader; every prompt x seed is sampled with ComfyUI's KSampler
(same steps, CFG, sampler) and decoded with the lab VAE, then compared with the unquantized model's sample of the
same prompt and seed: video PSNR / SSIM, audio log-spectral distance / SNR (``benchmarks/lab/lab_metrics.py``),
mean over the samples, printed as one table. Needs a ComfyUI host (``COMFYUI_PATH`` or ditkit's cached host).

    python benchmarks/bench_quantize_lab.py [--steps 20] [--prompts 6] [--seeds 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "lab"))
sys.path.append(str(ROOT))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

FORMATS = ("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=1)
    a = ap.parse_args(argv)

    from benchmarks.lab import harness as Hn
    from benchmarks.lab.lab_metrics import log_spectral_distance, psnr, snr, ssim

    lab = Hn.ComfyLab(a.steps)
    import comfy.quant_ops
    import comfy.sd

    from ditkit.loaders import quantize as qc

    prompts = Hn.PROMPTS[: a.prompts]
    seeds = list(range(a.seeds))
    ref = {}
    for p in prompts:
        for s in seeds:
            v, au, _, _ = lab.sample(lab.dit, p, s)
            ref[(p, s)] = lab.decode(v, au)
    print(f"lab DiT {Hn.L.DIT_FILE.name}, {a.steps} steps, cfg {lab.cfg}, {len(ref)} samples per row "
          f"(prompts x seeds), metrics vs the unquantized model's sample of the same prompt and seed", flush=True)
    rows = ["| format | quantized layers | DiT bytes | video PSNR | video SSIM | audio LSD | audio SNR |",
            "|---|---|---|---|---|---|---|"]
    src0 = qc.open_source(str(Hn.L.DIT_FILE))
    base_bytes = sum(t.numel() * t.element_size() for _, t in src0.reader())
    rows.append(f"| as stored | 0 | {base_bytes / 2**20:.2f} MiB | inf | 1.000 | 0.00 dB | inf |")
    for fmt in FORMATS:
        if fmt not in comfy.quant_ops.QUANT_ALGOS:
            rows.append(f"| {fmt} | - | - | - | - | - | not in this host's QUANT_ALGOS |")
            continue
        src = qc.open_source(str(Hn.L.DIT_FILE))
        plan = qc.make_plan(src.family, fmt, src.inventory, src.prefix)
        rep = qc.QuantReport(src.family, fmt, "")
        sd = dict(qc.quantize_stream(src.reader(), plan, rep, src.path, measure_error=False))
        model = comfy.sd.load_diffusion_model_state_dict(sd)
        ps, ss, ls, sn = [], [], [], []
        for (p, s), (rf, rw) in ref.items():
            v, au, _, _ = lab.sample(model, p, s)
            frames, wave = lab.decode(v, au)
            ps.append(psnr(rf, frames))
            ss.append(ssim(rf.movedim(1, 0), frames.movedim(1, 0)))
            ls.append(log_spectral_distance(rw, wave))
            sn.append(snr(rw, wave))
        k = len(ps)
        nq = len(plan.quantized_layers())
        rows.append(f"| {fmt} | {nq} | {rep.totals()[1] / 2**20:.2f} MiB | {sum(ps) / k:.2f} dB | {sum(ss) / k:.4f} | "
                    f"{sum(ls) / k:.2f} dB | {sum(sn) / k:.2f} dB |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
