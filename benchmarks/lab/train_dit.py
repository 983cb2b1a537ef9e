"""Train the lab's tiny H3 DiT (ComfyUI's ``MiniMaxH3Model`` at lab width) with rectified flow.

    COMFYUI_PATH=/path/to/ComfyUI nice -n 10 python benchmarks/lab/train_dit.py [--seed 0] [--minutes 15]

Data: procedural clips (``benchmarks.lab.lab_data``) encoded by the trained lab VAE (whitened video latents
[1, 24, 7, 4, 6]) and the lab audio codec ([1, 32, 2, 37] at 40 Hz). Text: a learned embedding table over the
lab vocabulary ([3, 32] per prompt) fed through ``condition_proj`` + the token refiner, exactly H3's text path.

Objective (H3's, as ComfyUI runs it): draw a base position ``b ~ U(0, 1)``, video sigma ``shift(b, 12)``, audio
sigma ``shift(b, 3)`` (the closed form ``time_shift_sigma`` the model itself uses), noise each stream
``x = (1 - sigma) x0 + sigma eps``, call the model's ComfyUI ``forward`` with ``timestep = 1000 sigma_v`` and
regress its output (ComfyUI's CONST convention, ``denoised = x - sigma out``) onto ``eps - x0``.
Writes ``weights/h3lab_dit.safetensors`` (ComfyUI native keys), ``weights/h3lab_text_embed.safetensors`` and
``weights/h3lab_dit_log.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
import lab_comfy as L  # noqa: E402

from benchmarks.lab import lab_data as D  # noqa: E402

FRAMES, H, W = 22, 64, 96


def shift(b, s):
    return s * b / (1 + (s - 1) * b)


def encode_dataset(vae, n, seed0):
    vids, auds, toks = [], [], []
    with torch.no_grad():
        for i in range(n):
            c = D.make_clip(seed0 + i, FRAMES, H, W)
            vids.append(vae.encode(c.video[None]))
            auds.append(D.audio_encode(c.audio))
            toks.append(c.tokens)
    return torch.cat(vids), torch.cat(auds), torch.stack(toks)


def save_snapshot(model, embed, ema, params, out_dir: Path, step: int) -> None:
    """Write the current EMA weights (DiT + text embedding) to ``out_dir`` without touching the live ones."""
    from ditkit.loaders.safetensors_io import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    live = [p.detach().clone() for p in params]
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
        L.save_state(model, out_dir / f"dit_{step:06d}.safetensors")
        save_file({"embed.weight": embed.weight.detach().clone()}, str(out_dir / f"text_{step:06d}.safetensors"))
        for v, p in zip(live, params):
            p.copy_(v)
    print(f"snapshot {step} -> {out_dir}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clips", type=int, default=240)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--micro", type=int, default=4, help="clips per optimiser step (the model takes batch 1)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=16.0, help="wall-clock budget for the training loop")
    ap.add_argument("--vae", default=str(L.VAE_FILE))
    ap.add_argument("--cache", default="/tmp/h3lab_dit_cache.safetensors",
                    help="latent cache (rebuilt when missing or when --rebuild-cache)")
    ap.add_argument("--rebuild-cache", action="store_true")
    ap.add_argument("--resume", action="store_true", help="continue from the saved DiT + text embedding")
    ap.add_argument("--cond-drop", type=float, default=0.0,
                    help="probability of replacing a clip's text context by zeros (the null prompt), so the model "
                         "also learns the unconditional velocity and classifier-free guidance works")
    ap.add_argument("--lr-by-time", action="store_true",
                    help="advance the cosine schedule by max(step / steps, elapsed / minutes), so it anneals fully "
                         "within the wall-clock budget whatever the machine load")
    ap.add_argument("--warmup", type=int, default=100, help="linear lr warm-up steps")
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="every N steps write the EMA weights to --snapshot-dir (for evaluating a run in progress)")
    ap.add_argument("--snapshot-dir", default="/tmp/h3lab_dit_snapshots")
    ap.add_argument("--probe", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    L.import_comfy()
    from ditkit.loaders.safetensors_io import load_file, save_file

    t_start = time.time()
    cache = Path(a.cache)
    n_clips = 8 if a.probe else a.clips
    if cache.is_file() and not a.rebuild_cache and not a.probe:
        c = load_file(str(cache))
        vids, auds, toks = c["video"], c["audio"], c["tokens"]
        print(f"loaded latent cache {cache} ({vids.shape[0]} clips)", flush=True)
    else:
        vae = L.load_vae(a.vae)
        vids, auds, toks = encode_dataset(vae, n_clips, 900_000 + 1000 * a.seed)
        if not a.probe:
            save_file({"video": vids, "audio": auds, "tokens": toks}, str(cache))
        print(f"encoded {n_clips} clips in {time.time() - t_start:.0f}s; video latent std {vids.std():.3f}, "
              f"audio latent mean {auds.mean():.3f} std {auds.std():.3f}", flush=True)

    model = L.build_dit(a.seed)
    torch.manual_seed(a.seed + 1)
    embed = torch.nn.Embedding(len(D.VOCAB), L.DIT_CONFIG["text_dim"])
    torch.nn.init.normal_(embed.weight, std=1.0)
    prev = None
    if a.resume:
        model.load_state_dict(load_file(str(L.DIT_FILE)), strict=True)
        with torch.no_grad():
            embed.weight.copy_(load_file(str(L.TEXT_FILE))["embed.weight"])
        prev_log = Path(L.DIT_FILE).with_name("h3lab_dit_log.json")
        prev = json.loads(prev_log.read_text()) if prev_log.is_file() else None
    params = list(model.parameters()) + list(embed.parameters())
    print(f"DiT params {L.count_params(model):,}; text embed {embed.weight.numel()}", flush=True)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01, betas=(0.9, 0.99))
    ema = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(a.seed + (17 if a.resume else 7))
    steps = 5 if a.probe else a.steps
    log = {"seed": a.seed, "clips": int(vids.shape[0]), "curve": [], "resumed": bool(a.resume),
           "lr": a.lr, "steps_planned": steps, "micro": a.micro, "cond_drop": a.cond_drop,
           "lr_by_time": a.lr_by_time, "minutes_budget": a.minutes}
    if prev is not None:
        log["previous_runs"] = [prev]
    layout = L.comfy.ldm.minimax.model.PackedLayout(toks.shape[1], *vids.shape[2:], auds.shape[-1])
    payload = {"layout": layout}
    t0 = time.time()
    run_v = run_a = None
    with L.training_mode():
        model.train()
        for step in range(steps):
            pos = step
            if a.lr_by_time:
                pos = max(step, int(steps * (time.time() - t0) / (a.minutes * 60)))
            lr = L.cosine_lr(pos, steps, a.lr, warmup=a.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            lv_sum = la_sum = 0.0
            for _ in range(a.micro):
                i = int(torch.randint(vids.shape[0], (), generator=gen))
                b = float(torch.rand((), generator=gen))
                sv, sa = shift(b, L.SHIFT_VIDEO), shift(b, L.SHIFT_AUDIO)
                x0v, x0a = vids[i:i + 1], auds[i:i + 1]
                ev = torch.randn(x0v.shape, generator=gen)
                ea = torch.randn(x0a.shape, generator=gen)
                xv = (1 - sv) * x0v + sv * ev
                xa = (1 - sa) * x0a + sa * ea
                ctx = embed(toks[i])[None]
                if a.cond_drop > 0 and float(torch.rand((), generator=gen)) < a.cond_drop:
                    ctx = torch.zeros_like(ctx)  # null prompt: the negative the harness uses for CFG
                out = model(x=[xv, xa], timestep=torch.tensor([1000.0 * sv]), context=ctx, minimax_payload=payload)
                lv = torch.nn.functional.mse_loss(out[0], ev - x0v)
                la = torch.nn.functional.mse_loss(out[1], ea - x0a)
                ((lv + la) / a.micro).backward()
                lv_sum += lv.item() / a.micro
                la_sum += la.item() / a.micro
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            with torch.no_grad():
                d = min(0.999, (1 + step) / (10 + step))
                for e, p in zip(ema, params):
                    e.mul_(d).add_(p.detach(), alpha=1 - d)
            run_v = lv_sum if run_v is None else 0.98 * run_v + 0.02 * lv_sum
            run_a = la_sum if run_a is None else 0.98 * run_a + 0.02 * la_sum
            if step % 200 == 0 or step == steps - 1:
                log["curve"].append({"step": step, "loss_video": run_v, "loss_audio": run_a,
                                     "t": time.time() - t_start})
                print(f"{step:6d} loss video {run_v:.4f} audio {run_a:.4f} lr {lr:.2e} {time.time() - t0:.0f}s",
                      flush=True)
            if a.snapshot_every and step > 0 and step % a.snapshot_every == 0 and not a.probe:
                save_snapshot(model, embed, ema, params, Path(a.snapshot_dir), step)
            if time.time() - t0 > a.minutes * 60:
                print(f"stopping at step {step} (budget used)", flush=True)
                break
    log["steps_done"] = step + 1
    if a.probe:
        print(f"probe: {(time.time() - t0) / steps:.3f} s/step", flush=True)
        return 0
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    model.eval()
    log["minutes"] = (time.time() - t_start) / 60
    log["params"] = L.count_params(model)
    meta = {"ditkit_lab": "h3lab_dit", "seed": str(a.seed),
            "lab_config": json.dumps({"dit": {k: list(v) if isinstance(v, tuple) else v
                                              for k, v in L.DIT_CONFIG.items()},
                                      "frames": FRAMES, "height": H, "width": W,
                                      "shift_video": L.SHIFT_VIDEO, "shift_audio": L.SHIFT_AUDIO})}
    L.save_state(model, L.DIT_FILE, meta)
    save_file({"embed.weight": embed.weight.detach().clone()}, str(L.TEXT_FILE),
              metadata={"ditkit_lab": "h3lab_text_embed", "vocab": json.dumps(list(D.VOCAB)),
                        "prompt_len": str(D.PROMPT_LEN)})
    Path(L.DIT_FILE).with_name("h3lab_dit_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved {L.DIT_FILE} after {log['minutes']:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
