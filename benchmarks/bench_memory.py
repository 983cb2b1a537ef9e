"""Activation memory: feed-forward chunking (peak and time) and the memory model's predictions vs measured peaks.

    COMFYUI_PATH=/path/to/ComfyUI nice -n 10 python benchmarks/bench_memory.py [--rounds 5] [--threads 1]
        [--quick] [--rows FILE] [--fits]

Parts, one run:

1. **Prediction table**: for each configuration (H3 size, weight format, latent size, chunking on/off) one DiT
   forward of ComfyUI 0.33's own ``MiniMaxH3Model`` (random weights, CPU) in a **fresh subprocess**; measured: the
   RSS growth from before the model is built to the peak during the forward (``/proc/self/statm`` sampled every
   0.5 ms + ``ru_maxrss``; ``bench_quantize.peak_during``) with ``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor
   above 64 KiB is its own mapping and RSS follows the live tensors; predicted: ``memory/model.py`` from the model's
   resident weight bytes (its state dict), the packed token count and the options. Printed: both, the error, and
   the activation part alone (peak growth during the forward vs predicted activations).
2. **Chunking**: the same forward unchunked vs chunked (``DitKitActivationChunking``'s module) on the tiny H3 and a
   hidden-1024 2-block H3: the peak ratio (part 1's children), the output equality (``torch.equal``, and the max
   abs difference) and the time ratio chunked / unchunked (ABAB rounds in one process, process CPU time, median
   and min-max).
3. ``--fits``: the "what fits" table for real-size H3 and LTX-2 (``memory/fits.py``), computed, not measured.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _view() -> str:
    """A folder whose ``ditkit`` entry is this checkout (never the checkout's own folder on sys.path)."""
    view = Path(tempfile.gettempdir()) / f"ditkit-bench-view-{os.getuid()}-{abs(hash(str(REPO))) % 10**8}"
    view.mkdir(exist_ok=True)
    for name, target in (("ditkit", REPO), ("benchmarks", REPO / "benchmarks")):
        link = view / name
        if not link.is_symlink():
            os.symlink(target, link, target_is_directory=True)
    return str(view)


if __name__ == "__main__":
    sys.path.insert(0, _view())

TINY = None   # filled from ditkit.tiny.ckpt_h3.CONFIG
SCALED = {"hidden_size": 1024, "num_attention_heads": 8, "attention_head_dim": 128, "ffn_hidden_size": 2816,
          "text_dim": 1024, "time_embed_hidden_size": 1024, "time_embed_dim": 512, "timestep_input_dim": 256,
          "token_refiner_num_layers": 2, "rope_inv_freq_len": 16, "num_layers": 2}

# (name, model, compute dtype, weight format, width, height, length, chunk)
CONFIGS = [
    ("tiny-fp32-512x512x124", "tiny", "float32", "as-stored", 512, 512, 124, None),
    ("tiny-fp32-512x512x124-chunk512", "tiny", "float32", "as-stored", 512, 512, 124, 512),
    ("h1024-fp32-512x512x56", "scaled", "float32", "as-stored", 512, 512, 56, None),
    ("h1024-fp32-512x512x56-chunk256", "scaled", "float32", "as-stored", 512, 512, 56, 256),
    ("h1024-bf16-512x384x56", "scaled", "bfloat16", "as-stored", 512, 384, 56, None),
    ("h1024-bf16-512x384x56-chunk256", "scaled", "bfloat16", "as-stored", 512, 384, 56, 256),
    ("h1024-fp8w-fp32-512x512x56", "scaled", "float32", "float8_e4m3fn", 512, 512, 56, None),
    ("h1024-fp8w-fp32-512x512x56-chunk256", "scaled", "float32", "float8_e4m3fn", 512, 512, 56, 256),
    # ComfyUI's own --use-pytorch-cross-attention (SDPA: no score matrix, as flash / sage on a GPU)
    ("sdpa-h1024-fp32-512x512x56", "scaled", "float32", "as-stored", 512, 512, 56, None),
    ("sdpa-h1024-fp32-512x512x56-chunk256", "scaled", "float32", "as-stored", 512, 512, 56, 256),
    ("sdpa-h1024-bf16-512x384x56", "scaled", "bfloat16", "as-stored", 512, 384, 56, None),
    ("sdpa-h1024-bf16-512x384x56-chunk256", "scaled", "bfloat16", "as-stored", 512, 384, 56, 256),
    # attention over head groups (DitKitActivationChunking's attention_heads_per_call) on ComfyUI's CPU sub_quad
    ("h1024-fp32-512x512x56-heads2", "scaled", "float32", "as-stored", 512, 512, 56, None, 2),
    ("h1024-fp32-512x512x56-heads1", "scaled", "float32", "as-stored", 512, 512, 56, None, 1),
    ("h1024-bf16-512x384x56-chunk256-heads1", "scaled", "bfloat16", "as-stored", 512, 384, 56, 256, 1),
]
# LTX-2: one sampling step (1 step, cfg 1, ComfyUI's KSampler) of a hidden-1024 2-block LTX-2 AV transformer as
# ComfyUI loads it, video latent only; predicted by DitKitPreflight's own path (bridge/preflight.run_plan)
LTX_SCALED = {"num_layers": 2, "num_attention_heads": 8, "attention_head_dim": 128, "cross_attention_dim": 1024,
              "audio_num_attention_heads": 8, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 512}
LTX_CONFIGS = [("ltx2-h1024-512x512x97", 512, 512, 97, None, 0), ("ltx2-h1024-512x512x97-heads1", 512, 512, 97, None, 1),
               ("ltx2-h1024-768x512x97-chunk1024", 768, 512, 97, 1024, 0)]
# Z-Image: one sampling step of a dim-1024 (8 heads of 128) 2-layer Z-Image (2 + 2 refiners) loaded by
# DitKitZImageLoader (ComfyUI's model), caption [1, 77, 1024]; predicted by run_plan: (name, width, height, chunk)
ZIMAGE_SCALED = {"dim": 1024, "n_layers": 2}
ZIMAGE_CONFIGS = [("zimage-d1024-1024x1024", 1024, 1024, None), ("zimage-d1024-1024x1024-chunk512", 1024, 1024, 512),
                  ("zimage-d1024-768x1280", 768, 1280, None)]
# FLUX.2: one sampling step of a hidden-1024 (8 heads of 128) FLUX.2 (2 double + 2 single blocks) loaded by ComfyUI's
# own loader from a file written here, EmptyFlux2LatentImage, caption [1, 77, 1024] (padded to 512 by the model);
# predicted by run_plan: (name, width, height, chunk)
FLUX2_SCALED = {"hidden": 1024, "depth": 2, "depth_single": 2}
FLUX2_CONFIGS = [("flux2-h1024-1024x1024", 1024, 1024, None), ("flux2-h1024-1024x1024-chunk256", 1024, 1024, 256),
                 ("flux2-h1024-768x1280", 768, 1280, None),
                 # ComfyUI's --use-pytorch-cross-attention (no score matrix): the blocks' activations dominate
                 ("sdpa-flux2-h1024-1024x1024", 1024, 1024, None), ("sdpa-flux2-h1024-1024x1024-chunk256", 1024, 1024, 256),
                 ("sdpa-flux2-h1024-1536x1536", 1536, 1536, None),
                 # attention over head groups (DitKitActivationChunking's attention_heads_per_call) on sub_quad
                 ("flux2-h1024-1024x1024-heads2", 1024, 1024, None, 2), ("flux2-h1024-1024x1024-heads1", 1024, 1024, None, 1)]
# classifier-free guidance: one KSampler step at cfg 1 and cfg 7 (name, family, width, height, length, cfg); FLUX.2
# batches positive + negative into one forward, H3 never does; predicted by the sampler check's own path
CFG_CONFIGS = [("cfg1-h3-tiny-512x512x56", "h3", 512, 512, 56, 1.0), ("cfg7-h3-tiny-512x512x56", "h3", 512, 512, 56, 7.0),
               ("cfg1-flux2-h1024-1024x1024", "flux2", 1024, 1024, 0, 1.0),
               ("cfg7-flux2-h1024-1024x1024", "flux2", 1024, 1024, 0, 7.0),
               ("sdpa-cfg7-flux2-h1024-1024x1024", "flux2", 1024, 1024, 0, 7.0),
               ("sdpa-cfg7-flux2-h1024-1536x1536", "flux2", 1536, 1536, 0, 7.0)]
# VAE decode (tiny H3 video VAE as ComfyUI builds it; DitKitPreflight's decode parts): (name, width, height, length)
DECODE_CONFIGS = [("decode-tiny-vae-256x256x22", 256, 256, 22), ("decode-tiny-vae-512x512x56", 512, 512, 56)]


# --------------------------------------------------------------------------------------------- child

def child(spec: dict) -> dict:
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    cargs.use_pytorch_cross_attention = spec["name"].startswith("sdpa-")
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model
    from comfy_extras.nodes_minimax_h3 import temporal_shape

    from benchmarks.bench_quantize import _rss_now, peak_during
    from ditkit.bridge.chunking import ChunkedFeedForward, ChunkStats
    from ditkit.tiny import ckpt_h3

    torch.set_num_threads(int(spec.get("threads", 1)))
    cfg = dict(ckpt_h3.CONFIG, **(SCALED if spec["model"] == "scaled" else {}))
    cfg.pop("rope_theta", None)
    compute = getattr(torch, spec["compute"])
    fmt = spec["format"]

    def build():
        if fmt == "as-stored":
            dm = MiniMaxH3Model(**cfg, dtype=compute, device="cpu", operations=comfy.ops.disable_weight_init)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in dm.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
            return dm
        # quantized linears (ComfyUI's own layout, the host's quantize), the rest in the compute dtype
        dm = MiniMaxH3Model(**cfg, dtype=compute, device="cpu", operations=comfy.ops.mixed_precision_ops(
            {}, compute_dtype=compute))
        return dm

    # warm-up: a tiny forward with a tiny model (loads kernels, allocator arenas, lazy imports)
    warm_cfg = dict(ckpt_h3.CONFIG)
    warm_cfg.pop("rope_theta", None)
    wm = MiniMaxH3Model(**warm_cfg, dtype=compute, device="cpu", operations=comfy.ops.disable_weight_init)
    wm.requires_grad_(False)
    for p in wm.parameters():
        p.data.normal_(0, 0.02)
    _forward(wm, 64, 64, 22, 8, compute, torch)
    del wm

    import gc

    gc.collect()
    base = _rss_now()
    dm = build() if fmt == "as-stored" else _quantized(cfg, compute, fmt, torch)
    dm.requires_grad_(False)
    weights_rss = _rss_now() - base
    sd = dm.state_dict()
    blocks: dict[int, int] = {}
    other = 0
    largest = 0
    for k, t in sd.items():
        nb = t.numel() * t.element_size()
        if t.dim() == 2:
            largest = max(largest, t.numel())
        if k.startswith("blocks."):
            i = int(k.split(".")[1])
            blocks[i] = blocks.get(i, 0) + nb
        else:
            other += nb
    del sd
    if spec["chunk"]:
        st = ChunkStats()
        for b in dm.blocks:
            b.mlp = ChunkedFeedForward(b.mlp, spec["chunk"], 3 * b.mlp.fc2.in_features, st)
    frames, lt, at = temporal_shape(spec["length"])
    text = spec.get("text", 64)
    x, ts, ctx = _inputs(cfg, spec["width"], spec["height"], lt, at, text, compute, torch)
    import comfy.model_management as mm

    topts = {}
    if spec.get("heads"):
        from ditkit.bridge.chunking import ATTN_KEY, HeadGroupAttention

        topts[ATTN_KEY] = HeadGroupAttention(int(spec["heads"]), None)
    free_bytes = int(mm.get_free_memory(torch.device("cpu")))
    with torch.no_grad():
        out, growth, before, secs = peak_during(lambda: dm(x, ts, ctx, transformer_options=topts))
    tokens = {"video": lt * (spec["height"] // 32) * (spec["width"] // 32), "audio": 2 * at, "text": text}
    return {"name": spec["name"], "weights_rss": weights_rss, "weights_state": sum(blocks.values()) + other,
            "blocks": [blocks[i] for i in sorted(blocks)], "other": other, "largest": largest,
            "forward_growth": growth, "free_bytes": free_bytes, "total_growth": (before - base) + growth, "seconds": secs, "tokens": tokens,
            "cfg": cfg}


def _quantized(cfg, compute, fmt, torch):
    """The H3 with its recipe's linears quantized in ``fmt`` by ditkit's loader path (``loaders/quantize.py``),
    from a file written here (random bf16 weights with the real key layout)."""
    from ditkit.nodes.h3_loaders import load_h3_model
    from ditkit.tiny import ckpt_h3
    from ditkit.loaders.safetensors_io import save_file

    tmp = Path(tempfile.mkdtemp(prefix="ditkit-bench-mem-"))
    c = dict(ckpt_h3.CONFIG, **cfg)
    save_file(ckpt_h3.base_state_dict(c), tmp / "m.safetensors")
    m, _ = load_h3_model(str(tmp / "m.safetensors"), weight_format=fmt)
    (tmp / "m.safetensors").unlink()
    tmp.rmdir()
    return m.model.diffusion_model


def _inputs(cfg, width, height, lt, at, text, compute, torch):
    g = torch.Generator().manual_seed(1)
    video = torch.randn(1, 24, lt, height // 16, width // 16, generator=g)
    audio = torch.randn(1, 32, 2, at, generator=g)
    ctx = torch.randn(1, text, cfg["text_dim"], generator=g).to(compute)
    return [video, audio], torch.tensor([500.0]), ctx


def _forward(dm, w, h, length, text, compute, torch):
    from comfy_extras.nodes_minimax_h3 import temporal_shape

    cfg = {"text_dim": dm.condition_proj.in_features}
    _, lt, at = temporal_shape(length)
    x, ts, ctx = _inputs(cfg, w, h, lt, at, text, compute, torch)
    with torch.no_grad():
        return dm(x, ts, ctx, transformer_options={})


def run_child(spec: dict, python: str = sys.executable, kind: str = "--child") -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=_view())
    r = subprocess.run([python, __file__, kind, json.dumps(spec)], capture_output=True, text=True, env=env,
                       timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"child {spec['name']} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ltx_child(spec: dict) -> dict:
    """One LTX-2 sampling step through ComfyUI (model loaded by comfy.sd from a file written here) in this fresh
    process; RSS growth from before the load to the peak of the step; DitKitPreflight's prediction for the same."""
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    import comfy.sd
    import nodes
    from comfy_extras.nodes_lt import EmptyLTXVLatentVideo

    from benchmarks.bench_quantize import _rss_now, peak_during
    from ditkit.bridge import chunking as bchunk
    from ditkit.bridge.preflight import latent_shapes_of, run_plan
    from ditkit.loaders.safetensors_io import save_file
    from ditkit.tiny import ckpt_ltx

    torch.set_num_threads(int(spec.get("threads", 1)))
    tmp = Path(tempfile.mkdtemp(prefix="ditkit-bench-ltx-"))
    cfg = dict(ckpt_ltx.CONFIG, **LTX_SCALED)
    save_file(ckpt_ltx.ltxav_state_dict(cfg), tmp / "ltx.safetensors",
              metadata={"config": json.dumps({"transformer": cfg}, sort_keys=True)})

    def latent(w, h, n):
        out = EmptyLTXVLatentVideo.execute(w, h, n, 1)
        return out.result[0] if hasattr(out, "result") else out[0]

    cond = [[torch.randn(1, 16, cfg["caption_channels"], generator=torch.Generator().manual_seed(0)), {}]]
    warm = comfy.sd.load_diffusion_model(str(tmp / "ltx.safetensors"))
    nodes.common_ksampler(warm, 0, 1, 1.0, "euler", "simple", cond, cond, latent(64, 64, 9))
    del warm
    import gc

    import comfy.model_management as mm

    mm.unload_all_models()
    gc.collect()
    base = _rss_now()
    m = comfy.sd.load_diffusion_model(str(tmp / "ltx.safetensors"))
    if spec["chunk"] or spec["heads"]:
        m = m.clone()
        if spec["heads"]:
            bchunk.install_head_groups(m, int(spec["heads"]))
        if spec["chunk"]:
            bchunk.install(m, "ltx2", int(spec["chunk"]), None)
    lat = latent(spec["width"], spec["height"], spec["length"])
    free_bytes = int(mm.get_free_memory(torch.device("cpu")))
    v, a = latent_shapes_of(lat["samples"], "ltx2")
    p = run_plan(m, v, a, 0, free_bytes / 2**30)
    out, growth, before, secs = peak_during(
        lambda: nodes.common_ksampler(m, 0, 1, 1.0, "euler", "simple", cond, cond, lat))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"name": spec["name"], "total_growth": (before - base) + growth, "forward_growth": growth,
            "predicted": p.prediction.device, "weights": p.prediction.parts["weights_device"],
            "tokens": p.tokens.total, "parts": p.prediction.parts, "seconds": secs}


def zimage_child(spec: dict) -> dict:
    """One Z-Image sampling step through ComfyUI in this fresh process: RSS growth from before the load to the peak
    of the step, and DitKitPreflight's prediction for the same (``ltx_child``'s method)."""
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    import comfy.model_management as mm
    import folder_paths
    import nodes
    from comfy_extras.nodes_sd3 import EmptySD3LatentImage

    from benchmarks.bench_quantize import _rss_now, peak_during
    from ditkit.bridge import chunking as bchunk
    from ditkit.bridge.preflight import latent_shapes_of, run_plan
    from ditkit.loaders.safetensors_io import save_file
    from ditkit.nodes.image_loaders import DitKitZImageLoader
    from ditkit.tiny import ckpt_image

    torch.set_num_threads(int(spec.get("threads", 1)))
    tmp = Path(tempfile.mkdtemp(prefix="ditkit-bench-zimage-"))
    cfg = {**ckpt_image.ZIMAGE, **ZIMAGE_SCALED, **({"dim": int(spec["dim"])} if spec.get("dim") else {})}
    save_file(ckpt_image.zimage_state_dict(cfg), tmp / "zimage_bench.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(tmp), is_default=True)

    def load():
        out = DitKitZImageLoader.execute("zimage_bench.safetensors")
        return out.args[0] if hasattr(out, "args") else out[0]

    cond = [[torch.randn(1, 77, 1024, generator=torch.Generator().manual_seed(0)), {}]]
    warm = load()
    nodes.common_ksampler(warm, 0, 1, 1.0, "euler", "simple", cond, cond, EmptySD3LatentImage.execute(64, 64, 1).result[0])
    del warm
    import gc

    mm.unload_all_models()
    gc.collect()
    base = _rss_now()
    m = load()
    if spec["chunk"]:
        m = m.clone()
        bchunk.install(m, "zimage", int(spec["chunk"]), None)
    lat = EmptySD3LatentImage.execute(spec["width"], spec["height"], 1).result[0]
    free_bytes = int(mm.get_free_memory(torch.device("cpu")))
    v, _ = latent_shapes_of(lat["samples"], "zimage")
    p = run_plan(m, v, None, 77, free_bytes / 2**30)
    out, growth, before, secs = peak_during(
        lambda: nodes.common_ksampler(m, 0, 1, 1.0, "euler", "simple", cond, cond, lat))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"name": spec["name"], "total_growth": (before - base) + growth, "forward_growth": growth,
            "predicted": p.prediction.device, "weights": p.prediction.parts["weights_device"],
            "tokens": p.tokens.total, "parts": p.prediction.parts, "seconds": secs}


def flux2_child(spec: dict) -> dict:
    """One FLUX.2 sampling step through ComfyUI in this fresh process (``ltx_child``'s method; ComfyUI's own
    loader)."""
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    cargs.use_pytorch_cross_attention = spec["name"].startswith("sdpa-")
    import comfy.model_management as mm
    import comfy.sd
    import nodes
    from comfy_extras.nodes_flux import EmptyFlux2LatentImage

    from benchmarks.bench_quantize import _rss_now, peak_during
    from ditkit.bridge import chunking as bchunk
    from ditkit.bridge.preflight import conditioning_batch, latent_shapes_of, run_plan
    from ditkit.loaders.safetensors_io import save_file
    from ditkit.tiny import ckpt_image

    torch.set_num_threads(int(spec.get("threads", 1)))
    tmp = Path(tempfile.mkdtemp(prefix="ditkit-bench-flux2-"))
    cfg = {**ckpt_image.FLUX2, **FLUX2_SCALED, **({"hidden": int(spec["hidden"])} if spec.get("hidden") else {})}
    save_file(ckpt_image.flux2_state_dict(cfg), tmp / "flux2_bench.safetensors")

    def latent(w, h):
        return EmptyFlux2LatentImage.execute(w, h, 1).result[0]

    cond = [[torch.randn(1, 77, cfg["context_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    warm = comfy.sd.load_diffusion_model(str(tmp / "flux2_bench.safetensors"))
    nodes.common_ksampler(warm, 0, 1, 1.0, "euler", "simple", cond, cond, latent(64, 64))
    del warm
    import gc

    mm.unload_all_models()
    gc.collect()
    base = _rss_now()
    m = comfy.sd.load_diffusion_model(str(tmp / "flux2_bench.safetensors"))
    if spec["chunk"] or spec.get("heads"):
        m = m.clone()
        if spec.get("heads"):
            bchunk.install_head_groups(m, int(spec["heads"]))
        if spec["chunk"]:
            bchunk.install(m, "flux2", int(spec["chunk"]), None)
    lat = latent(spec["width"], spec["height"])
    free_bytes = int(mm.get_free_memory(torch.device("cpu")))
    v, _ = latent_shapes_of(lat["samples"], "flux2")
    cfg_scale = float(spec.get("cfg", 1.0))
    batch = conditioning_batch(m, v, None, cfg_scale, cond, cond, 77)
    p = run_plan(m, v, None, 77, free_bytes / 2**30, batch=batch)
    out, growth, before, secs = peak_during(
        lambda: nodes.common_ksampler(m, 0, 1, cfg_scale, "euler", "simple", cond, cond, lat))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"name": spec["name"], "total_growth": (before - base) + growth, "forward_growth": growth,
            "predicted": p.prediction.device, "weights": p.prediction.parts["weights_device"],
            "tokens": p.tokens.total, "parts": p.prediction.parts, "seconds": secs, "batch": p.options.batch,
            "batch_reason": batch.reason}


def h3_step_child(spec: dict) -> dict:
    """One H3 sampling step through ComfyUI's KSampler at ``spec["cfg"]`` in this fresh process (``ltx_child``'s
    method; the tiny H3 written here, loaded by DitKitH3ModelLoader); predicted by the sampler check's own path
    (``conditioning_batch`` + ``run_plan``)."""
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    import comfy.model_management as mm
    import folder_paths
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from benchmarks.bench_quantize import _rss_now, peak_during
    from ditkit.bridge.preflight import conditioning_batch, latent_shapes_of, run_plan
    from ditkit.loaders.safetensors_io import save_file
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader
    from ditkit.tiny import ckpt_h3

    torch.set_num_threads(int(spec.get("threads", 1)))
    tmp = Path(tempfile.mkdtemp(prefix="ditkit-bench-h3-"))
    save_file(ckpt_h3.base_state_dict(dict(ckpt_h3.CONFIG)), tmp / "h3_bench.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(tmp), is_default=True)

    def load():
        return DitKitH3ModelLoader.execute(model_name="h3_bench.safetensors").args[0]

    text = 64
    cond = [[torch.randn(1, text, ckpt_h3.CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    warm = load()
    nodes.common_ksampler(warm, 0, 1, 1.0, "euler", "simple", cond, cond,
                          EmptyMiniMaxH3LatentAV.execute(64, 64, 5).result[0])
    del warm
    import gc

    mm.unload_all_models()
    gc.collect()
    base = _rss_now()
    m = load()
    lat = EmptyMiniMaxH3LatentAV.execute(spec["width"], spec["height"], spec["length"]).result[0]
    free_bytes = int(mm.get_free_memory(torch.device("cpu")))
    v, a = latent_shapes_of(lat["samples"], "h3")
    cfg_scale = float(spec["cfg"])
    batch = conditioning_batch(m, v, a, cfg_scale, cond, cond, text)
    p = run_plan(m, v, a, text, free_bytes / 2**30, batch=batch)
    out, growth, before, secs = peak_during(
        lambda: nodes.common_ksampler(m, 0, 1, cfg_scale, "euler", "simple", cond, cond, lat))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"name": spec["name"], "total_growth": (before - base) + growth, "forward_growth": growth,
            "predicted": p.prediction.device, "weights": p.prediction.parts["weights_device"],
            "tokens": p.tokens.total, "parts": p.prediction.parts, "seconds": secs, "batch": p.options.batch,
            "batch_reason": batch.reason}


def cfg_table(comfyui: str, threads: int, rows, only=()) -> list[dict]:
    """One KSampler step at cfg 1 and at cfg 7 per model: ComfyUI batches positive + negative into one forward for
    FLUX.2 (batch 2), runs them one after the other for H3 (batch 1 each): measured vs the sampler check's
    prediction."""
    configs = [c for c in CFG_CONFIGS if not only or any(o in c[0] for o in only)]
    if not configs:
        return []
    print("\n| cfg step | cfg | batch predicted | tokens | weights MiB | measured peak MiB | predicted MiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for name, family, w, h, length, cfg_scale in configs:
        spec = {"name": name, "width": w, "height": h, "length": length, "chunk": None, "heads": 0,
                "cfg": cfg_scale, "comfyui": comfyui, "threads": threads}
        res = run_child(spec, kind="--flux2-child" if family == "flux2" else "--h3-step-child")
        err = res["predicted"] / res["total_growth"] - 1
        mib = 2 ** 20
        print(f"| {name} | {cfg_scale:g} | {res['batch']} | {res['tokens']} | {res['weights'] / mib:.1f} | "
              f"{res['total_growth'] / mib:.1f} | {res['predicted'] / mib:.1f} | {err:+.1%} |")
        rows.add(name, "measured_peak", res["total_growth"], "B")
        rows.add(name, "predicted_peak", res["predicted"], "B")
        rows.add(name, "error", err, "ratio")
        out.append({"spec": spec, "res": res, "err": err})
    return out


def flux2_table(comfyui: str, threads: int, rows, only=()) -> list[dict]:
    configs = [c for c in FLUX2_CONFIGS if not only or any(o in c[0] for o in only)]
    if not configs:
        return []
    print("\n| FLUX.2 step | tokens | weights MiB | measured peak MiB | predicted MiB | error |")
    print("|---|---|---|---|---|---|")
    out = []
    for name, w, h, chunk, *heads in configs:
        spec = {"name": name, "width": w, "height": h, "chunk": chunk, "heads": heads[0] if heads else 0,
                "comfyui": comfyui, "threads": threads}
        res = run_child(spec, kind="--flux2-child")
        err = res["predicted"] / res["total_growth"] - 1
        mib = 2 ** 20
        print(f"| {name} | {res['tokens']} | {res['weights'] / mib:.1f} | {res['total_growth'] / mib:.1f} | "
              f"{res['predicted'] / mib:.1f} | {err:+.1%} |")
        rows.add(name, "measured_peak", res["total_growth"], "B")
        rows.add(name, "predicted_peak", res["predicted"], "B")
        rows.add(name, "error", err, "ratio")
        out.append({"spec": spec, "res": res, "err": err})
    return out


def zimage_table(comfyui: str, threads: int, rows, only=()) -> list[dict]:
    configs = [c for c in ZIMAGE_CONFIGS if not only or any(o in c[0] for o in only)]
    if not configs:
        return []
    print("\n| Z-Image step | tokens | weights MiB | measured peak MiB | predicted MiB | error |")
    print("|---|---|---|---|---|---|")
    out = []
    for name, w, h, chunk in configs:
        spec = {"name": name, "width": w, "height": h, "chunk": chunk, "comfyui": comfyui, "threads": threads}
        res = run_child(spec, kind="--zimage-child")
        err = res["predicted"] / res["total_growth"] - 1
        mib = 2 ** 20
        print(f"| {name} | {res['tokens']} | {res['weights'] / mib:.1f} | {res['total_growth'] / mib:.1f} | "
              f"{res['predicted'] / mib:.1f} | {err:+.1%} |")
        rows.add(name, "measured_peak", res["total_growth"], "B")
        rows.add(name, "predicted_peak", res["predicted"], "B")
        rows.add(name, "error", err, "ratio")
        out.append({"spec": spec, "res": res, "err": err})
    return out


def ltx_table(comfyui: str, threads: int, rows, only=()) -> list[dict]:
    configs = [c for c in LTX_CONFIGS if not only or any(o in c[0] for o in only)]
    if not configs:
        return []
    print("\n| LTX-2 step | tokens | weights MiB | measured peak MiB | predicted MiB | error |")
    print("|---|---|---|---|---|---|")
    out = []
    for name, w, h, length, chunk, heads in configs:
        spec = {"name": name, "width": w, "height": h, "length": length, "chunk": chunk, "heads": heads,
                "comfyui": comfyui, "threads": threads}
        res = run_child(spec, kind="--ltx-child")
        err = res["predicted"] / res["total_growth"] - 1
        mib = 2 ** 20
        print(f"| {name} | {res['tokens']} | {res['weights'] / mib:.1f} | {res['total_growth'] / mib:.1f} | "
              f"{res['predicted'] / mib:.1f} | {err:+.1%} |")
        rows.add(name, "measured_peak", res["total_growth"], "B")
        rows.add(name, "predicted_peak", res["predicted"], "B")
        rows.add(name, "error", err, "ratio")
        out.append({"spec": spec, "res": res, "err": err})
    return out


def decode_child(spec: dict) -> dict:
    """One VAE decode of the tiny H3 video VAE (ComfyUI's ``comfy.sd.VAE`` from the tiny checkpoint) in this fresh
    process: RSS growth from before the VAE is built to the peak of the decode, and DitKitPreflight's decode parts
    (``bridge/preflight.decode_parts``) for the same latent."""
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    from comfy_extras.nodes_minimax_h3 import temporal_shape

    from benchmarks.bench_quantize import _rss_now, peak_during
    from ditkit.bridge.h3_vae import load_h3_vae
    from ditkit.bridge.preflight import decode_parts
    from ditkit.tiny import ckpt_h3_vae as ck

    torch.set_num_threads(int(spec.get("threads", 1)))
    tmp = Path(tempfile.mkdtemp(prefix="ditkit-bench-dec-"))
    (path,) = ck.gen_video_vae(tmp)
    warm, _ = load_h3_vae(str(path))
    warm.decode(torch.zeros(1, 24, 2, 2, 2))
    del warm
    import gc

    gc.collect()
    base = _rss_now()
    vae, _ = load_h3_vae(str(path))   # ditkit's loader: the tiny VAE is a scaled MiniMaxH3VideoVAE
    _, lt, _ = temporal_shape(spec["length"])
    z = torch.randn(1, 24, lt, spec["height"] // 16, spec["width"] // 16, generator=torch.Generator().manual_seed(0))
    parts = decode_parts(vae, tuple(z.shape))
    out, growth, before, secs = peak_during(lambda: vae.decode(z))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"name": spec["name"], "total_growth": (before - base) + growth, "forward_growth": growth,
            "parts": parts, "out_shape": list(out.shape), "seconds": secs}


def decode_table(comfyui: str, threads: int, rows, only=()) -> list[dict]:
    configs = [c for c in DECODE_CONFIGS if not only or any(o in c[0] for o in only)]
    if not configs:
        return []
    print("\n| decode | frames out | measured peak MiB | predicted MiB (weights + ComfyUI working set + frames) | "
          "error |")
    print("|---|---|---|---|---|")
    out = []
    for name, w, h, length in configs:
        spec = {"name": name, "width": w, "height": h, "length": length, "comfyui": comfyui, "threads": threads}
        res = run_child(spec, kind="--decode-child")
        pred = sum(res["parts"].values())
        err = pred / res["total_growth"] - 1
        mib = 2 ** 20
        print(f"| {name} | {res['out_shape']} | {res['total_growth'] / mib:.1f} | {pred / mib:.1f} ("
              + " + ".join(f"{v / mib:.1f}" for v in res["parts"].values()) + f") | {err:+.1%} |")
        rows.add(name, "measured_peak", res["total_growth"], "B")
        rows.add(name, "predicted_peak", pred, "B")
        rows.add(name, "error", err, "ratio")
        out.append({"spec": spec, "res": res, "pred": pred, "err": err})
    return out


# --------------------------------------------------------------------------------------------- prediction

def predicted(res: dict, spec: dict):
    from ditkit.memory.model import DiTDims, Options, Tokens, Weights, predict

    c = res["cfg"]
    d = DiTDims("h3", c["hidden_size"], c["num_attention_heads"], c["attention_head_dim"], c["ffn_hidden_size"],
                c["num_layers"])
    w = Weights(tuple(res["blocks"]), res["other"], res["largest"])
    t = Tokens(**res["tokens"])
    fmt = "bf16" if spec["format"] == "as-stored" else spec["format"]
    return predict(d, w, t, Options(compute=spec["compute"], weight_format=fmt, chunk=spec["chunk"],
                                    attention="flash" if spec["name"].startswith("sdpa-") else "sub_quad",
                                    free_bytes=res["free_bytes"], head_group=spec.get("heads")))


def prediction_table(comfyui: str, quick: bool, threads: int, rows, only=()) -> list[dict]:
    out = []
    configs = CONFIGS[:2] if quick else CONFIGS
    if only:
        configs = [c for c in configs if any(o in c[0] for o in only)]
    print("| configuration | tokens | weights MiB | measured peak MiB | predicted MiB | error | activations "
          "measured / predicted MiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model, compute, fmt, w, h, length, chunk, *heads in configs:
        spec = {"name": name, "model": model, "compute": compute, "format": fmt, "width": w, "height": h,
                "length": length, "chunk": chunk, "comfyui": comfyui, "threads": threads,
                "heads": heads[0] if heads else None}
        res = run_child(spec)
        p = predicted(res, spec)
        act_pred = p.device - p.parts["weights_device"]
        err = p.device / res["total_growth"] - 1
        aerr = act_pred / res["forward_growth"] - 1
        mib = 2 ** 20
        print(f"| {name} | {sum(res['tokens'].values())} | {res['weights_state'] / mib:.1f} | "
              f"{res['total_growth'] / mib:.1f} | {p.device / mib:.1f} | {err:+.1%} | "
              f"{res['forward_growth'] / mib:.1f} / {act_pred / mib:.1f} | {aerr:+.1%} |")
        rows.add(name, "measured_peak", res["total_growth"], "B")
        rows.add(name, "predicted_peak", p.device, "B")
        rows.add(name, "error", err, "ratio")
        rows.add(name, "activation_error", aerr, "ratio")
        out.append({"spec": spec, "res": res, "pred": p.device, "err": err, "aerr": aerr})
    return out


def chunk_table(table: list[dict], comfyui: str, rounds: int, threads: int, rows) -> None:
    """Peak ratio from part 1's pairs; equality and time ratio measured here (one process, ABAB)."""
    by = {t["spec"]["name"]: t for t in table}
    print("\n| model | unchunked peak MiB | chunked peak MiB | chunked / unchunked |")
    print("|---|---|---|---|")
    for name, t in by.items():
        if t["spec"]["chunk"]:
            base = by.get(name.rsplit("-chunk", 1)[0])
            if base:
                r = t["res"]["total_growth"] / base["res"]["total_growth"]
                print(f"| {name} | {base['res']['total_growth'] / 2**20:.1f} | {t['res']['total_growth'] / 2**20:.1f} "
                      f"| {r:.3f} |")
                rows.add(name, "peak_ratio_chunked_over_unchunked", r, "x")
    env = dict(os.environ, PYTHONPATH=_view())
    r = subprocess.run([sys.executable, __file__, "--time-child", json.dumps({"comfyui": comfyui, "rounds": rounds,
                                                                              "threads": threads})],
                       capture_output=True, text=True, env=env, timeout=7200)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    for line in r.stdout.strip().splitlines():
        res = json.loads(line)
        print(f"{res['model']} {res['compute']} {res['tokens']} tokens, chunk {res['chunk']}: equal={res['equal']} "
              f"max|diff|={res['max_abs_diff']:g}; time chunked/unchunked {res['ratio']['median']:.3f}x "
              f"(min {res['ratio']['min']:.3f}, max {res['ratio']['max']:.3f}, {rounds} rounds)")
        case = f"{res['model']}-{res['compute']}-chunk{res['chunk']}"
        rows.add(case, "time_ratio_chunked_over_unchunked", res["ratio"]["median"], "x", min=res["ratio"]["min"],
                 max=res["ratio"]["max"], n=rounds)
        rows.add(case, "max_abs_diff", res["max_abs_diff"])


def time_child(spec: dict) -> None:
    import torch

    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model
    from comfy_extras.nodes_minimax_h3 import temporal_shape

    from benchmarks._harness import Timer, interleave, ratio_stats
    from ditkit.bridge.chunking import ChunkedFeedForward, ChunkStats
    from ditkit.tiny import ckpt_h3

    torch.set_num_threads(int(spec["threads"]))
    for model, compute, (w, h, length), chunk in (("tiny", "float32", (512, 512, 124), 512),
                                                   ("scaled", "float32", (256, 256, 124), 256),
                                                   ("scaled", "bfloat16", (256, 256, 124), 256)):
        cfg = dict(ckpt_h3.CONFIG, **(SCALED if model == "scaled" else {}))
        cfg.pop("rope_theta", None)
        dt = getattr(torch, compute)
        dm = MiniMaxH3Model(**cfg, dtype=dt, device="cpu", operations=comfy.ops.disable_weight_init)
        dm.requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in dm.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
        _, lt, at = temporal_shape(length)
        x, ts, ctx = _inputs(cfg, w, h, lt, at, 32, dt, torch)
        origs = [b.mlp for b in dm.blocks]
        chunked = [ChunkedFeedForward(o, chunk, 3 * o.fc2.in_features, ChunkStats()) for o in origs]

        def run(mods):
            def f():
                for b, m in zip(dm.blocks, mods):
                    b.mlp = m
                with torch.no_grad():
                    return dm(x, ts, ctx, transformer_options={})
            return f

        keep: dict = {}
        t = interleave({"chunked": run(chunked), "plain": run(origs)}, int(spec["rounds"]),
                       timer=Timer(cpu_time=True), keep=keep)
        a, b = keep["chunked"], keep["plain"]
        equal = all(torch.equal(u, v) for u, v in zip(a, b))
        diff = max(float((u.double() - v.double()).abs().max()) for u, v in zip(a, b))
        tokens = lt * (h // 32) * (w // 32) + 2 * at + 32
        print(json.dumps({"model": model, "compute": compute, "tokens": tokens, "chunk": chunk, "equal": equal,
                          "max_abs_diff": diff, "ratio": ratio_stats(t["chunked"], t["plain"])}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--time-child")
    ap.add_argument("--decode-child")
    ap.add_argument("--ltx-child")
    ap.add_argument("--zimage-child")
    ap.add_argument("--flux2-child")
    ap.add_argument("--h3-step-child")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fits", action="store_true")
    ap.add_argument("--no-chunk-time", action="store_true")
    ap.add_argument("--only", nargs="*", default=(), help="configurations whose name contains one of these")
    from benchmarks._harness import Rows, add_rows_argument

    add_rows_argument(ap)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    if a.ltx_child:
        print(json.dumps(ltx_child(json.loads(a.ltx_child))))
        return 0
    if a.zimage_child:
        print(json.dumps(zimage_child(json.loads(a.zimage_child))))
        return 0
    if a.flux2_child:
        print(json.dumps(flux2_child(json.loads(a.flux2_child))))
        return 0
    if a.h3_step_child:
        print(json.dumps(h3_step_child(json.loads(a.h3_step_child))))
        return 0
    if a.decode_child:
        print(json.dumps(decode_child(json.loads(a.decode_child))))
        return 0
    if a.time_child:
        time_child(json.loads(a.time_child))
        return 0
    rows = Rows(a.rows, "bench_memory")
    if a.fits:
        from ditkit.memory.fits import fits_table

        print(fits_table())
        return 0
    comfyui = os.environ.get("COMFYUI_PATH") or str(Path.home() / ".cache/ditkit/comfyui-783545f6")
    table = prediction_table(comfyui, a.quick, a.threads, rows, a.only)
    if not a.no_chunk_time:
        chunk_table(table, comfyui, a.rounds, a.threads, rows)
    table += [] if a.quick else ltx_table(comfyui, a.threads, rows, a.only)
    table += [] if a.quick else zimage_table(comfyui, a.threads, rows, a.only)
    table += [] if a.quick else flux2_table(comfyui, a.threads, rows, a.only)
    table += [] if a.quick else cfg_table(comfyui, a.threads, rows, a.only)
    dec = [] if a.quick else decode_table(comfyui, a.threads, rows, a.only)
    if not table and not dec:
        print("no configuration selected")
        return 1
    worst = max(abs(t["err"]) for t in table) if table else 0.0
    print((f"\nworst step prediction error {worst:.1%} (target <= 15%)" if table else "\nno step configuration")
          + ("; VAE decode (ComfyUI's estimate) " + ", ".join(format(t["err"], "+.1%") for t in dec) if dec else ""))
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    raise SystemExit(main())
