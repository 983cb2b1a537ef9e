"""What requantization costs an adapter on the quality lab's trained tiny H3 DiT (``benchmarks/lab``), per format.

The lab DiT is written as a Comfy-Org style repack in each format (``tiny/ckpt_h3.comfy_quant_state_dict`` with
comfy_kitchen's layout quantize, ``tiny/ckpt_h3_quant.kitchen_layout_quantize``: int8 ConvRot per-channel, mxfp8,
nvfp4; every block linear and AdaLN quantized) and loaded by ComfyUI. One LoRA (ComfyUI naming, rank 8 on every
block's qkv_proj / out_proj / fc1 / fc2, ΔW RMS = ``--delta`` x the layer's weight RMS, bf16 factors, seeded) is
applied by DitKitAdapterLoader in mode fuse (requantized into the layer's format) and in mode bypass (weights
untouched). Every prompt x seed is sampled with ComfyUI's KSampler and decoded with the lab VAE; each row is compared
with the UNQUANTIZED lab DiT + the same LoRA fused (float32 weights), same prompt and seed: video PSNR / SSIM, audio
log-spectral distance / SNR (``benchmarks/lab/lab_metrics.py``), mean over the samples. Rows "base" (the quantized
base without the LoRA vs the unquantized base without it) show what the format costs by itself, and "no LoRA" (the
unquantized base vs the reference) how far the LoRA moves the sample; "fuse vs bypass" compares the two modes on the
same quantized base, i.e. what requantizing W + ΔW costs over running ΔW beside the stored codes. Needs a ComfyUI host (``COMFYUI_PATH`` or
ditkit's cached host).

    python benchmarks/bench_adapter_lab.py [--steps 20] [--prompts 4] [--seeds 1] [--delta 0.2]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "lab"))
sys.path.append(str(ROOT))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

FORMATS = ("int8_convrot", "mxfp8", "nvfp4")
MODULES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
RANK = 8


def lab_lora(sd: dict[str, torch.Tensor], delta: float, seed: int = 30) -> dict[str, torch.Tensor]:
    """A seeded rank-8 LoRA in ComfyUI naming on every block's linears, ΔW RMS = ``delta`` x RMS(W) (alpha = rank:
    scale 1), factors stored bf16 as published LoRAs are."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    blocks = sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")})
    for i in blocks:
        for m in MODULES:
            w = sd[f"blocks.{i}.{m}.weight"].double()
            o, n = w.shape
            a = torch.randn(RANK, n, generator=g, dtype=torch.float64)
            b = torch.randn(o, RANK, generator=g, dtype=torch.float64)
            c = delta * w.pow(2).mean().sqrt() / (b @ a).pow(2).mean().sqrt()
            out[f"diffusion_model.blocks.{i}.{m}.lora_down.weight"] = (a * c.sqrt()).to(torch.bfloat16)
            out[f"diffusion_model.blocks.{i}.{m}.lora_up.weight"] = (b * c.sqrt()).to(torch.bfloat16)
            out[f"diffusion_model.blocks.{i}.{m}.alpha"] = torch.tensor(float(RANK))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--delta", type=float, default=0.2, help="ΔW RMS over W RMS per layer")
    ap.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    a = ap.parse_args(argv)

    from benchmarks.lab import harness as Hn
    from benchmarks.lab.lab_metrics import log_spectral_distance, psnr, snr, ssim

    lab = Hn.ComfyLab(a.steps)
    import comfy.model_management
    import comfy.sd

    from ditkit.bridge.adapters import apply_h3_adapter
    from ditkit.loaders.safetensors_io import load_file, save_file
    from ditkit.tiny.ckpt_h3 import comfy_quant_state_dict
    from ditkit.tiny.ckpt_h3_quant import kitchen_layout_quantize

    torch.set_num_threads(1)
    sd = load_file(str(Hn.L.DIT_FILE))
    td = tempfile.TemporaryDirectory(prefix="bench_adapter_lab_")
    lora = Path(td.name) / "lab_lora_rank8.safetensors"
    save_file(lab_lora(sd, a.delta), lora)
    keys = [(p, s) for p in Hn.PROMPTS[: a.prompts] for s in range(a.seeds)]

    def run(model):
        out = {}
        for p, s in keys:
            v, au, _, _ = lab.sample(model, p, s)
            comfy.model_management.unload_all_models()   # a patched clone must not stay applied to the shared module
            out[(p, s)] = lab.decode(v, au)
        return out

    def row(name, got, ref):
        ps, ss, ls, sn = [], [], [], []
        for k, (rf, rw) in ref.items():
            frames, wave = got[k]
            ps.append(psnr(rf, frames))
            ss.append(ssim(rf.movedim(1, 0), frames.movedim(1, 0)))
            ls.append(log_spectral_distance(rw, wave))
            sn.append(snr(rw, wave))
        n = len(ps)
        line = (f"| {name} | {sum(ps) / n:.2f} dB | {sum(ss) / n:.4f} | {sum(ls) / n:.3f} dB | {sum(sn) / n:.2f} dB |")
        print(line, flush=True)
        return line

    fused_ref, _ = apply_h3_adapter(lab.dit, str(lora), 1.0, mode="fuse")
    ref = run(fused_ref)
    base = run(lab.dit)
    print(f"lab DiT {Hn.L.DIT_FILE.name}, {a.steps} steps, cfg {lab.cfg}, {len(keys)} samples per row (prompts x "
          f"seeds); LoRA rank {RANK} on {len(MODULES)} linears per block, ΔW RMS {a.delta:g} x W RMS; metrics vs the "
          "unquantized DiT + the LoRA fused (float32), same prompt and seed", flush=True)
    rows = ["| base format, adapter mode | video PSNR | video SSIM | audio LSD | audio SNR |", "|---|---|---|---|---|"]
    rows.append(row("float32, no LoRA (how far the LoRA moves the sample)", base, ref))
    byp, _ = apply_h3_adapter(lab.dit, str(lora), 1.0, mode="bypass")
    rows.append(row("float32, bypass", run(byp), ref))
    for fmt in a.formats:
        q = comfy.sd.load_diffusion_model_state_dict(comfy_quant_state_dict(sd, fmt, kitchen_layout_quantize))
        rows.append(row(f"{fmt}, no LoRA vs float32 no LoRA (the format alone)", run(q), base))
        f, _ = apply_h3_adapter(q, str(lora), 1.0, mode="fuse")
        fused = run(f)
        rows.append(row(f"{fmt}, fuse (requantized)", fused, ref))
        b, _ = apply_h3_adapter(q, str(lora), 1.0, mode="bypass")
        bypassed = run(b)
        rows.append(row(f"{fmt}, bypass", bypassed, ref))
        rows.append(row(f"{fmt}, fuse vs bypass (the requantization alone)", fused, bypassed))
        del q, f, b
    print("\n".join(rows))
    lab.close()
    td.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
