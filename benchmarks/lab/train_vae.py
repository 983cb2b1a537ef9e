"""Train the lab's tiny H3 video VAE (ComfyUI's ``MiniMaxH3VideoVAE`` at lab width) on procedural clips.

    COMFYUI_PATH=/path/to/ComfyUI nice -n 10 python benchmarks/lab/train_vae.py [--seed 0] [--minutes 12]

Recipe (H3's, scaled down): the causal encoder runs exactly like ``encode_temporal`` (17-frame clips, the
last padded by repeating its final frame, 3 tokens dropped: 22 frames -> 7 latents); the ViT decoder only ever
sees that 7-token window, and the loss is on the frames ``decode_temporal`` keeps (raw frames 3..19 and
23..27 of the 28 decoded). Phase A trains encoder + decoder jointly; phase B freezes the encoder (as H3
trained its encoder first), caches latents and trains the decoder alone. Nothing ever trains T_lat = 1.
After phase A the latent whitening buffers ``latents_mean/std`` are set from the training latents.
Writes ``weights/h3lab_video_vae.safetensors`` (ComfyUI key layout) and ``weights/h3lab_vae_log.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_comfy as L  # noqa: E402

from ditkit.testing.lab_data import make_clip  # noqa: E402

FRAMES, H, W = 22, 64, 96


def encode_window(vae, video):
    """[B,3,22,H,W] in [-1,1] -> [B,24,7,h,w] raw latent means (encode_temporal without whitening)."""
    x = vae._normalize_pixels(video)
    clips = [x[:, :, :17], x[:, :, 17:]]
    clips[1] = torch.cat([clips[1], clips[1][:, :, -1:].expand(-1, -1, 17 - clips[1].shape[2], -1, -1)], dim=2)
    z = torch.cat([vae._encode_moments(c) for c in clips], dim=2)[:, :, :-vae.token_drop]
    return z[:, :24]


def decode_window(vae, z):
    """[B,24,7,h,w] raw latents -> [B,3,22,H,W] pixels in [0,1] (unclamped), the frames decode_temporal keeps."""
    raw = vae._decode_pixels(z)  # [B,3,28,H,W] normalised pixel space
    keep = torch.cat([raw[:, :, 3:20], raw[:, :, 23:28]], dim=2)
    return keep * vae.pixel_std + vae.pixel_mean


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps-a", type=int, default=320)
    ap.add_argument("--steps-b", type=int, default=1800)
    ap.add_argument("--clips-b", type=int, default=160, help="clips cached for the decoder-only phase")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr-b", type=float, default=1e-3)
    ap.add_argument("--crop-h", type=int, default=32)
    ap.add_argument("--crop-w", type=int, default=48)
    ap.add_argument("--minutes", type=float, default=22.0, help="wall-clock budget for both phases")
    ap.add_argument("--out", default=str(L.VAE_FILE))
    ap.add_argument("--stage-out", default="", help="also save the model after phase A (encoder final)")
    ap.add_argument("--resume", default="", help="continue phase B (decoder only) from this file; phase A is "
                    "skipped, the encoder and whitening stay as they are")
    ap.add_argument("--new-decoder-layers", type=int, default=0, help="with --resume: fresh decoder of this depth")
    ap.add_argument("--probe", action="store_true", help="time 3 steps of each phase and exit")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    L.import_comfy()
    vae = L.load_vae(a.resume).train() if a.resume else L.build_vae(a.seed)
    if a.new_decoder_layers:
        # keep the trained encoder + whitening, start a fresh decoder of another depth
        fresh = L.build_vae(a.seed + 1, decoder_layers=a.new_decoder_layers)
        vae.decoder = fresh.decoder
        vae.post_quant_conv = fresh.post_quant_conv
    print(f"VAE params {L.count_params(vae):,} (encoder {L.count_params(vae.encoder):,}, "
          f"decoder {L.count_params(vae.decoder):,})", flush=True)
    t_start = time.time()
    budget = a.minutes * 60
    log = {"seed": a.seed, "phase_a": [], "phase_b": [], "resumed_from": a.resume or None}
    prev_log = Path(a.resume).with_name("h3lab_vae_log.json") if a.resume else None
    if prev_log is not None and prev_log.is_file():
        log["previous_runs"] = [json.loads(prev_log.read_text())]
    clip_seed = 10_000 * (a.seed + 1)

    def batch(i, n):
        # phase A trains on random 32x48 crops: the encoder is convolutional, so it transfers to the full
        # frame, and the crop quarters the cost; phase B then fits the decoder at the full 64x96 extent
        g = torch.Generator().manual_seed(clip_seed + i)
        out = []
        for j in range(n):
            v = make_clip(clip_seed + i * n + j, FRAMES, H, W).video
            y = int(torch.randint(0, (H - a.crop_h) // 16 + 1, (), generator=g)) * 16
            x = int(torch.randint(0, (W - a.crop_w) // 16 + 1, (), generator=g)) * 16
            out.append(v[:, :, y:y + a.crop_h, x:x + a.crop_w])
        return torch.stack(out)

    with L.training_mode():
        # ---------------- phase A: joint encoder + decoder
        opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
        steps_a = 0 if a.resume else 3 if a.probe else a.steps_a
        t0 = time.time()
        step = -1
        for step in range(steps_a):
            for g in opt.param_groups:
                g["lr"] = L.cosine_lr(step, steps_a, 2e-3, warmup=30)
            video = batch(step, a.batch)
            z = encode_window(vae, video)
            rec = decode_window(vae, z)
            tgt = (video + 1) / 2
            loss = torch.nn.functional.mse_loss(rec, tgt) + 1e-4 * z.pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            if step % 25 == 0 or step == steps_a - 1:
                psnr = -10 * torch.log10(torch.nn.functional.mse_loss(rec.clamp(0, 1), tgt)).item()
                log["phase_a"].append({"step": step, "loss": loss.item(), "psnr": psnr, "t": time.time() - t_start})
                print(f"A {step:5d} loss {loss.item():.5f} psnr {psnr:.2f} dB  {time.time() - t0:.0f}s", flush=True)
            if time.time() - t_start > budget * 0.42:
                print(f"A: stopping at step {step} (phase A budget used)", flush=True)
                break
        log["steps_a_done"] = step + 1
        if a.probe:
            print(f"probe A: {(time.time() - t0) / 3:.2f} s/step", flush=True)

        # ---------------- whitening stats + latent cache (encoder frozen from here on)
        vae.requires_grad_(False)
        n_cache = 4 if a.probe else a.clips_b
        t1 = time.time()
        with torch.no_grad():
            cache_v, cache_z = [], []
            for i in range(n_cache):
                v = make_clip(clip_seed + 500_000 + (20_000 if a.resume else 0) + i, FRAMES, H, W).video[None]
                cache_v.append(((v + 1) / 2).half())
                cache_z.append(encode_window(vae, v))
            zs = torch.cat(cache_z)
        if a.resume:
            std = vae.latents_std.clone()
        else:
            mean = zs.mean(dim=(0, 2, 3, 4))
            std = zs.std(dim=(0, 2, 3, 4)).clamp(min=1e-3)
            vae.latents_mean.copy_(mean)
            vae.latents_std.copy_(std)
        if a.stage_out and not a.probe and not a.resume:
            # encoder and whitening are final from here: downstream latent caching may start now
            L.save_state(vae, a.stage_out, {"ditkit_lab": "h3lab_video_vae_stage_a"})
        print(f"cached {n_cache} clips in {time.time() - t1:.0f}s; latent std range "
              f"{std.min().item():.3f}..{std.max().item():.3f}", flush=True)

        # ---------------- phase B: decoder only (+ post_quant_conv), 7-token windows only
        params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
        for p in params:
            p.requires_grad_(True)
        lr_b = a.lr_b
        opt = torch.optim.AdamW(params, lr=lr_b, weight_decay=0.0)
        steps_b = 3 if a.probe else a.steps_b
        t0 = time.time()
        gen = torch.Generator().manual_seed(a.seed + (199 if a.resume else 99))
        for step in range(steps_b):
            for g in opt.param_groups:
                g["lr"] = L.cosine_lr(step, steps_b, lr_b, warmup=30)
            idx = torch.randint(n_cache, (4,), generator=gen)
            z = torch.cat([cache_z[i] for i in idx])
            tgt = torch.cat([cache_v[i] for i in idx]).float()
            # small latent noise so the decoder tolerates imperfect (sampled) latents
            z = z + 0.05 * std.view(1, -1, 1, 1, 1) * torch.randn(z.shape, generator=gen)
            rec = decode_window(vae, z)
            loss = torch.nn.functional.mse_loss(rec, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if step % 100 == 0 or step == steps_b - 1:
                psnr = -10 * torch.log10(torch.nn.functional.mse_loss(rec.clamp(0, 1), tgt)).item()
                log["phase_b"].append({"step": step, "loss": loss.item(), "psnr": psnr, "t": time.time() - t_start})
                print(f"B {step:5d} loss {loss.item():.5f} psnr {psnr:.2f} dB  {time.time() - t0:.0f}s", flush=True)
            if time.time() - t_start > budget:
                print(f"B: stopping at step {step} (budget used)", flush=True)
                break
        log["steps_b_done"] = step + 1
        if a.probe:
            print(f"probe B: {(time.time() - t0) / 3:.2f} s/step", flush=True)
            return 0

    vae.eval()
    log["minutes"] = (time.time() - t_start) / 60
    log["params"] = L.count_params(vae)
    meta = {"ditkit_lab": "h3lab_video_vae", "seed": str(a.seed),
            "lab_config": json.dumps({"vae": L.VAE_CONFIG, "decoder": dict(L.VAE_DECODER, num_layers=len(vae.decoder.transformer_blocks)), "frames": FRAMES,
                                      "height": H, "width": W})}
    L.save_state(vae, a.out, meta)
    Path(a.out).with_name("h3lab_vae_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved {a.out} after {log['minutes']:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
