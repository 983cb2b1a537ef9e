"""Quantize-while-loading: peak host memory, weight reconstruction error, and real-size resident bytes.

Three parts, one run:

1. **Peak RSS of loading** (needs a ComfyUI host: ``COMFYUI_PATH`` or ditkit's cached host), each load in a fresh
   subprocess, runs interleaved (stock, fmt1, fmt2, ..., converter, stock, fmt1, ...: ABAB) for ``--repeats``
   rounds; printed: median and min-max of the peak RSS growth during the load (the peak of ``/proc/self/statm``
   sampled every 0.5 ms, and ``ru_maxrss`` when it rose above the warm-up's mark, minus the RSS before the load),
   the per-round ratio to the stock path, the load time, and the target ``resident after load + 2 largest
   tensors`` (``quantized size + 2 largest tensors``, issue #20) with whether the median meets it, for

   * ``stock``: the ComfyUI-layout file through ``comfy.sd.load_diffusion_model`` with ``dtype=float8_e4m3fn``
     (what UNETLoader ``weight_dtype fp8_e4m3fn`` does: read bf16, then cast);
   * each format: ``DitKitH3ModelLoader``'s path (``load_h3_model(..., weight_format=fmt)``) from the
     **official shards** (interleaved qkv; the stock loader cannot read those at all);
   * ``convert float8_e4m3fn``: ``python -m ditkit.quantize`` from the official shards to a file (nothing is
     kept: its target is the 2 largest tensors alone);

   for the tiny official H3 and a generated scaled-up H3 (``--scale-gb``, default 1.5 GB of bf16 random weights
   with the real key layout, hidden 1024), each figure also a row (``--rows FILE``, ``benchmarks/_harness.py``).
2. **Weight reconstruction error per layer class** (plain torch): ``||W - deq(Q(W))|| / ||W||`` over each class,
   for every format, on the tiny H3 (``--error-on-scaled``: the scaled-up one); random weights, so this is a
   property of the format, not of training.
3. **Resident bytes of the real-size models** (H3 / LTX-2 / Z-Image / FLUX.2) per format, computed from the key
   inventories the tiny generators reproduce, at real dimensions (H3 from h3.md; the others' dimensions are the
   public configs, listed in ``REAL``); no weights are made.

``--quick`` (the smoke test): the tiny model only, 1 repeat.

``--child "<family>:<format>" FILE COMFYUI WARM`` (family zimage / ltx2 / flux2) measures one load of a single
ComfyUI-layout file through that family's loader node function the same way (used by
``tests/integration/test_quantize_peak_host.py``); its JSON line adds ``host_recast`` (:func:`host_recast`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument  # noqa: E402

FORMATS = ("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")

# real dimensions. H3: /work/shared/reference/h3.md config table (5376 hidden, 56 x 128 heads, 50 + 2 blocks,
# ffn 14336, text 5120). LTX-2 19B / Z-Image 6B / FLUX.2-dev: their public configs (docs/quantize.md "Real-size
# dimensions": diffusers' convert_ltx2_to_diffusers.py "2.0" and convert_flux2_to_diffusers.py "flux2-dev",
# Tongyi-MAI/Z-Image transformer/config.json + ComfyUI's model_detection.py); tests/integration/test_real_dims_host.py
# builds ComfyUI's own model classes from them on the meta device and compares every key and shape with the
# inventory below. Z-Image ``t_hidden`` is the timestep embedder's sinusoid width (ComfyUI TimestepEmbedder
# frequency_embedding_size 256), not its hidden width (min(dim, 1024) = 1024).
REAL = {
    "h3": {"hidden_size": 5376, "num_attention_heads": 56, "attention_head_dim": 128, "num_layers": 50,
           "token_refiner_num_layers": 2, "ffn_hidden_size": 14336, "latents_dim": 24, "audio_latents_dim": 32,
           "patch_size": [1, 2, 2], "text_dim": 5120, "timestep_input_dim": 256, "time_embed_hidden_size": 5376,
           "time_embed_dim": 2688, "rope_inv_freq_len": 16},
    "ltx2": {"num_layers": 48, "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
             "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048,
             "caption_channels": 3840, "connector_num_attention_heads": 30, "connector_attention_head_dim": 128,
             "connector_num_layers": 2, "in_channels": 128, "audio_in_channels": 128},
    "zimage": {"dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "cap_feat_dim": 2560, "in_channels": 16,
               "patch_size": 2, "ffn_multiple_of": 256, "t_hidden": 256},
    "flux2": {"hidden": 6144, "depth": 8, "depth_single": 48, "in_channels": 128, "context_dim": 15360,
              "mlp_ratio": 3},
}


H3_OFFICIAL_BYTES = 66_280_430_144   # metadata.total_size of FL2VA/transformer/model.safetensors.index.json (h3.md)

# --------------------------------------------------------------------------------------------- inventories

def inventory(family: str, cfg: dict | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    from ditkit.tiny import ckpt_h3, ckpt_image, ckpt_ltx

    if family == "h3":
        c = dict(ckpt_h3.CONFIG, **(cfg or {}))
        return {k: (tuple(s), "F32" if k.startswith(ckpt_h3.FP32_PREFIXES) else "BF16")
                for k, s in ckpt_h3.comfy_shapes(c).items()}
    if family == "ltx2":
        c = dict(ckpt_ltx.CONFIG, **(cfg or {}))
        return {k: (tuple(s), "BF16") for k, s in ckpt_ltx.ltxav_shapes(c).items()}
    if family == "zimage":
        c = dict(ckpt_image.ZIMAGE, **(cfg or {}))
        return {k: (tuple(s), "BF16") for k, s in ckpt_image.zimage_shapes(c).items()}
    c = dict(ckpt_image.FLUX2, **(cfg or {}))
    return {k: (tuple(s), "BF16") for k, s in ckpt_image.flux2_shapes(c).items()}


def resident_bytes(family: str, inv, fmt: str | None) -> int:
    import math

    from ditkit.kernels.quant import quantized_nbytes
    from ditkit.loaders import quantize as qc
    from ditkit.loaders.safetensors_io import DTYPES

    total = 0
    for k, (shape, dt) in inv.items():
        if fmt is not None and qc.classify(family, k, shape)[1]:
            total += quantized_nbytes(shape, fmt) + len(qc.marker_tensor(fmt))
        else:
            total += math.prod(shape) * DTYPES[dt][1]
    return total


def real_size_table(rows=None) -> list[str]:
    lines = ["| model (real dims) | as stored (bf16 + fp32 islands) | " + " | ".join(FORMATS) + " |",
             "|---|---|" + "---|" * len(FORMATS)]
    for fam, label in (("h3", "MiniMax H3 DiT"), ("ltx2", "LTX-2 19B DiT"), ("zimage", "Z-Image 6B DiT"),
                       ("flux2", "FLUX.2-dev DiT")):
        inv = inventory(fam, REAL[fam])
        base = resident_bytes(fam, inv, None)
        sizes = {f: resident_bytes(fam, inv, f) for f in FORMATS}
        cells = [f"{sizes[f] / 2**30:.2f} GiB" for f in FORMATS]
        if rows is not None:
            rows.add(f"real/{fam}", "bytes_as_stored", base, "B")
            for f in FORMATS:
                rows.add(f"real/{fam}", f"bytes_{f}", sizes[f], "B")
        lines.append(f"| {label} | {base / 2**30:.2f} GiB | " + " | ".join(cells) + " |")
    h3 = resident_bytes("h3", inventory("h3", REAL["h3"]), None)
    if rows is not None:
        rows.add("real/h3", "official_index_total_bytes", H3_OFFICIAL_BYTES, "B")
    lines.append(f"\nH3 inventory check: {h3:,} bytes as stored; the official index's total_size is "
                 f"{H3_OFFICIAL_BYTES:,} ({'equal' if h3 == H3_OFFICIAL_BYTES else 'DIFFERENT'})")
    return lines


# --------------------------------------------------------------------------------------------- checkpoints

def scaled_cfg(gb: float) -> dict:
    """An H3 config whose bf16 weights are about ``gb`` GB (hidden 1024, 8 x 128 heads, real ratios)."""
    from ditkit.tiny import ckpt_h3

    base = dict(ckpt_h3.CONFIG, hidden_size=1024, num_attention_heads=8, attention_head_dim=128,
                ffn_hidden_size=2816, text_dim=1024, time_embed_hidden_size=1024, time_embed_dim=512,
                timestep_input_dim=256, token_refiner_num_layers=2, rope_inv_freq_len=16)
    per_layer = resident_bytes("h3", inventory("h3", dict(base, num_layers=2)), None) - \
        resident_bytes("h3", inventory("h3", dict(base, num_layers=1)), None)
    base["num_layers"] = max(1, int(gb * 1e9 / per_layer))
    return base


def make_checkpoints(out: Path, cfg: dict | None) -> tuple[Path, Path]:
    """-> (official shard folder, ComfyUI-layout single file) of one H3 config (tiny when ``cfg`` is None)."""
    from ditkit.loaders.safetensors_io import save_file
    from ditkit.tiny import ckpt_h3

    c = dict(ckpt_h3.CONFIG, **(cfg or {}))
    base = ckpt_h3.base_state_dict(c)
    comfy = out / "h3_comfy.safetensors"
    save_file(base, comfy)
    off = ckpt_h3.official_state_dict(base, c)
    del base
    ckpt_h3.write_sharded(off, out / "h3_official", "model", "model.safetensors.index.json", 4,
                          ckpt_h3.official_config(c))
    return out / "h3_official", comfy


# --------------------------------------------------------------------------------------------- child

def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# the DiT loaders other than H3's, by family: ``"<family>:<format>"`` modes of :func:`child` (each loads a
# ComfyUI-layout single file through the node's own load function, read by ``loaders/quantize.py`` ``open_source``)
FAMILY_MODES = ("zimage", "ltx2", "flux2")


def peak_during(load):
    """-> (what ``load()`` returned, peak RSS growth in bytes, RSS before, seconds). The RSS is sampled from
    ``/proc/self/statm`` every 0.5 ms by a thread during the call, and ``ru_maxrss`` counts when it rose above its
    mark at the start (call it after a warm-up load, in a fresh process)."""
    import gc
    import threading
    import time

    gc.collect()
    mark = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = _rss_now()
    peak = [before]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_now())
            stop.wait(0.0005)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        out = load()
    finally:
        seconds = time.perf_counter() - t0
        stop.set()
        th.join()
    top = max(peak[0], _rss_now())
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if maxrss > mark:
        top = max(top, maxrss)
    return out, top - before, before, seconds


def _family_load(family: str, path: str, fmt: str):
    """The loader node's own load function for ``family`` -> the ModelPatcher."""
    if family == "zimage":
        from ditkit.nodes import image_loaders

        return image_loaders.load_zimage(path, weight_format=fmt)[0]
    from ditkit.nodes import dit_loaders

    node_id = dit_loaders.LTX2_NODE_ID if family == "ltx2" else dit_loaders.FLUX2_NODE_ID
    return dit_loaders.load_dit(node_id, family, path, os.path.basename(path), fmt)[0]


def child(mode: str, path: str, comfyui: str, warm: str) -> None:
    """One load in this fresh process. A warm-up load first (ComfyUI imports model code and allocates its caches
    on the first load; the converter converts the tiny file once): the tiny ComfyUI H3 file for the H3 modes,
    ``warm`` through the same loader and format for a ``"<family>:<format>"`` mode (``warm``: a tiny file of that
    family); then the peak RSS during the measured load (:func:`peak_during`)."""
    import torch

    torch.set_num_threads(int(os.environ.get("DITKIT_BENCH_THREADS", "1")))
    convert = mode.startswith("convert:")
    stock_cq = mode.startswith("cq:")                 # a stock comfy_quant load: UNETLoader's path on a quantized file
    cached = mode.startswith(("cache:", "cachewrite:", "cacheverify:"))
    if mode.startswith("cacheverify:"):             # its stamp gone: this load hashes every byte of the cache file
        drop_stamps(path, mode.split(":", 1)[1])
    family, _, fam_fmt = mode.partition(":")
    if family not in FAMILY_MODES:
        family = None
    if convert:
        from ditkit.quantize import convert as run_convert

        out_dir = tempfile.mkdtemp(prefix="ditkit-bench-conv-")
        run_convert(warm, os.path.join(out_dir, "warm.safetensors"), mode.split(":", 1)[1], hash_sources=False,
                    log=lambda *a: None)
        os.unlink(os.path.join(out_dir, "warm.safetensors"))
    else:
        sys.path.insert(0, comfyui)
        from comfy.cli_args import args

        args.cpu = True
        import comfy.sd  # noqa: F401

        if family:
            w = _family_load(family, warm, fam_fmt)
            del w
        else:
            from ditkit.nodes import h3_loaders

            w = comfy.sd.load_diffusion_model(warm, model_options={"dtype": torch.float8_e4m3fn})
            del w
            w, _ = h3_loaders.load_h3_model(warm, weight_format="float8_e4m3fn")
            del w

    def load():
        if mode == "stock":
            return comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float8_e4m3fn})
        if stock_cq:
            return comfy.sd.load_diffusion_model(path)
        if cached:
            return h3_loaders.load_h3_model(path, weight_format=mode.split(":", 1)[1], quantized_cache=True)[0]
        if convert:
            run_convert(path, os.path.join(out_dir, "out.safetensors"), mode.split(":", 1)[1], hash_sources=False,
                        log=lambda *a: None)
            return None
        if family:
            return _family_load(family, path, fam_fmt)
        return h3_loaders.load_h3_model(path, weight_format=mode)[0]

    m, growth, before, seconds = peak_during(load)
    touch = 0.0
    if convert:
        resident = 0
        os.unlink(os.path.join(out_dir, "out.safetensors"))
        os.rmdir(out_dir)
    else:
        sd = m.model.diffusion_model.state_dict()
        resident = sum(t.numel() * t.element_size() for t in sd.values())
        touch = touch_pages(sd.values())
    out = {"mode": mode, "peak_growth": growth, "before": before, "resident": resident, "seconds": seconds,
           "touch_seconds": touch, "threads": torch.get_num_threads()}
    if family:
        out["host_recast"] = host_recast(sd, path)
    print(json.dumps(out))


def touch_pages(tensors) -> float:
    """Seconds to read one byte of every 4 KiB page of the loaded weights: 0-ish where the loader materialized them,
    the page faults (and, cold, the disk reads) a lazily mapped load defers to the model's first use."""
    import time

    import torch

    t0 = time.perf_counter()
    for t in tensors:
        if not t.numel():
            continue
        t = t.detach()
        t = getattr(t, "_qdata", t)                  # a host QuantizedTensor: its stored data
        if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor:
            t = t.as_subclass(torch.Tensor)
        b = t.contiguous().reshape(-1).view(torch.uint8)
        int(b[::4096].sum())
    return time.perf_counter() - t0


def drop_stamps(path: str, fmt: str) -> None:
    """Remove the quantized cache's verification stamps of format ``fmt`` next to ``path`` (stamps are ditkit's
    own files; removing one only makes the next read hash the cache file in full)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    for n in os.listdir(folder):
        if f".ditkit-{fmt}-" in n and n.endswith(".verified"):
            os.unlink(os.path.join(folder, n))


def evict(path: Path) -> None:
    """Drop ``path``'s pages (a file, or every file of a folder) from the page cache (``POSIX_FADV_DONTNEED``):
    the next load reads the disk, as the first load after a reboot does."""
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def host_recast(sd, path: str) -> int:
    """Bytes, as stored in the single file ``path``, of the tensors the loaded model ``sd`` holds in another dtype.

    ComfyUI casts each layer it does not quantize to its compute dtype (``comfy/ops.py`` ``_load_quantized_module``:
    ``weight.to(dtype=compute_dtype)``; float32 on a CPU host, where bf16 is not used) while the state dict it was
    given still holds the originals until ``load_state_dict`` returns: the host's own copy, counted at the peak on
    top of the resident size. 0 where every unquantized layer is stored in the compute dtype."""
    from ditkit.loaders.quantize import model_prefix
    from ditkit.loaders.safetensors_io import read_header

    hdr = read_header(path)
    pre = model_prefix(hdr.tensors)
    stored = {k[len(pre):]: ti for k, ti in hdr.tensors.items()}
    quantized = {k[: -len("comfy_quant")] for k in sd if k.endswith(".comfy_quant")}
    return sum(stored[k].nbytes for k, t in sd.items()
               if k in stored and t.dtype != stored[k].torch_dtype and k[: k.rfind(".") + 1] not in quantized)


def run_child(mode: str, path: Path, comfyui: str, python: str, warm: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                      .split(os.pathsep) if p]))
    r = subprocess.run([python, __file__, "--child", mode, str(path), comfyui, str(warm)], capture_output=True, text=True,
                       env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"child {mode} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------- parts

CONVERT = "convert:float8_e4m3fn"


def mode_name(m: str) -> str:
    if m == "stock":
        return "stock UNETLoader fp8 cast (ComfyUI file)"
    if m.startswith("convert:"):
        return f"python -m ditkit.quantize {m.split(':', 1)[1]} (official shards -> file)"
    if m.startswith("cq:"):
        return f"stock UNETLoader of a comfy_quant {m[3:]} file (the converter's)"
    if m.startswith("cache:"):
        return f"ditkit {m[6:]} from its quantized cache (verified before, stamp)"
    if m.startswith("cacheverify:"):
        return f"ditkit {m[12:]} from its quantized cache (every byte hashed)"
    return f"ditkit {m} (official shards)"


CACHE_FORMATS = ("float8_e4m3fn", "nvfp4")


def rss_table(label: str, case: str, official: Path, comfy_file: Path, comfyui: str, python: str, repeats: int,
              warm: Path, rows, jobs: int = 1, cache: bool = False, convert: bool = True,
              cold: bool = False) -> list[str]:
    from benchmarks._harness import ratio_stats, stats
    from ditkit.loaders.safetensors_io import read_header

    hdr = read_header(comfy_file)
    largest = sorted((ti.nbytes for ti in hdr.tensors.values()), reverse=True)[:2]
    src_bytes = sum(ti.nbytes for ti in hdr.tensors.values())
    modes = ["stock"] + list(FORMATS) + ([CONVERT] if convert else [])
    cq_files: dict[str, Path] = {}
    if cache:                                     # the cache written once before the rounds; the stock comfy_quant
        from ditkit.quantize import convert as run_convert   # load reads the converter's file of the same weights

        for f in CACHE_FORMATS:
            cq_files[f] = comfy_file.parent / f"cq_{f}.safetensors"
            if not cq_files[f].exists():
                run_convert(str(official), str(cq_files[f]), f, hash_sources=False, log=lambda *a: None)
            r = run_child(f"cachewrite:{f}", official, comfyui, python, warm)
            print(f"  cache written ({f}): {json.dumps(r)}", file=sys.stderr, flush=True)
        modes += [m for f in CACHE_FORMATS for m in (f"cq:{f}", f"cacheverify:{f}", f"cache:{f}")]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(repeats):                    # interleaved: stock, fmt1, ..., stock, fmt1, ...
        def one(m):
            path = comfy_file if m == "stock" else cq_files[m[3:]] if m.startswith("cq:") else official
            if cold:                              # every file the load may read, evicted before it
                evict(path)
                for f in cq_files.values():
                    evict(f)
            return run_child(m, path, comfyui, python, warm)

        if jobs > 1:                              # a round's children side by side (peak RSS is per process)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(jobs) as ex:
                got = list(ex.map(one, modes))
        else:
            got = [one(m) for m in modes]
        for m, r in zip(modes, got):
            runs[m].append(r)
            print(f"  round {rnd + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
    rows.add(case, "source_bytes", src_bytes, "B")
    rows.add(case, "two_largest_bytes", sum(largest), "B")
    out = [f"### {label}: source {src_bytes / 2**20:.1f} MiB, two largest tensors {sum(largest) / 2**20:.1f} MiB, "
           f"{repeats} interleaved run(s) per row" + (f", {jobs} loads at a time (load times include the contention)"
                                                     if jobs > 1 else ""),
           "| path | resident after load | peak RSS growth median (min-max) | target (resident + 2 largest) | "
           "peak / stock median (min-max) | load s median (min-max) | time / stock fp8 cast median (min-max) | "
           "MB/s of source | load + touch every page s median (min-max) | (load + touch) / base median (min-max) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    stock = [r["peak_growth"] for r in runs["stock"]]
    for m in modes:
        peaks = [r["peak_growth"] for r in runs[m]]
        res = runs[m][0]["resident"]
        st = stats(peaks)
        rs = ratio_stats(peaks, stock)
        ts = stats(r["seconds"] for r in runs[m])
        cache_fmt = m.split(":", 1)[1] if m.startswith(("cache:", "cacheverify:")) else None
        base_runs = runs[f"cq:{cache_fmt}"] if cache_fmt else runs["stock"]
        base_t = [r["seconds"] for r in base_runs]
        lt = [r["seconds"] + r.get("touch_seconds", 0.0) for r in runs[m]]
        lts = stats(lt)
        ltr = ratio_stats(lt, [r["seconds"] + r.get("touch_seconds", 0.0) for r in base_runs])
        tr = ratio_stats([r["seconds"] for r in runs[m]], base_t)
        mbs = src_bytes / ts["median"] / 1e6
        target = res + sum(largest)
        met = st["median"] <= target
        key = f"{case}/{m}"
        rows.add_stats(key, "peak_rss_growth", st, "B")
        rows.add(key, "resident_bytes", res, "B")
        rows.add(key, "target_bytes", target, "B", note="resident after load + 2 largest tensors")
        rows.add(key, "target_met", met, note="median peak growth <= target")
        rows.add_stats(key, "peak_over_stock", rs)
        rows.add_stats(key, "load_seconds", ts, "s")
        rows.add_stats(key, "time_over_base", tr, note="cache: over the stock comfy_quant load of the same format; "
                                                          "else over the stock fp8 cast")
        rows.add(key, "source_mb_per_s", mbs, "MB/s")
        rows.add_stats(key, "load_touch_seconds", lts, "s", note="load + one byte read from every page of the weights")
        rows.add_stats(key, "load_touch_over_base", ltr)
        base = "comfy_quant" if cache_fmt else ""
        out.append(f"| {mode_name(m)} | {res / 2**20:.1f} MiB | {st['median'] / 2**20:.1f} ({st['min'] / 2**20:.1f}-"
                   f"{st['max'] / 2**20:.1f}) MiB | {target / 2**20:.1f} MiB {'met' if met else 'NOT met'} | "
                   f"{rs['median']:.2f} ({rs['min']:.2f}-{rs['max']:.2f}) | {ts['median']:.2f} ({ts['min']:.2f}-"
                   f"{ts['max']:.2f}) | {tr['median']:.2f} ({tr['min']:.2f}-{tr['max']:.2f}){' vs ' + base if base else ''}"
                   f" | {mbs:.0f} | {lts['median']:.2f} ({lts['min']:.2f}-{lts['max']:.2f}) | {ltr['median']:.2f} "
                   f"({ltr['min']:.2f}-{ltr['max']:.2f}) |")
    return out


def error_table(official: Path, rows=None) -> list[str]:
    from ditkit.loaders import quantize as qc

    lines = ["| layer class | " + " | ".join(FORMATS) + " |", "|---|" + "---|" * len(FORMATS)]
    per: dict[str, dict[str, str]] = {}
    for fmt in FORMATS:
        src = qc.open_source(str(official))
        plan = qc.make_plan("h3", fmt, src.inventory)
        rep = qc.QuantReport("h3", fmt, "")
        for _ in qc.quantize_stream(src.reader(), plan, rep, str(official), measure_error="full"):
            pass
        for cls, st in rep.classes.items():
            d = st.as_dict()
            if "rel_rms_error" in d:
                per.setdefault(cls, {})[fmt] = f"{d['rel_rms_error']:.3e} (max {d['max_tensor_rel_error']:.3e})"
                if rows is not None:
                    rows.add(f"error/{cls}", fmt, d["rel_rms_error"], max=d["max_tensor_rel_error"],
                             n=d["quantized"], note="relative RMS over the class; max = worst tensor")
    for cls, vals in per.items():
        lines.append(f"| {cls} | " + " | ".join(vals.get(f, "-") for f in FORMATS) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=4, metavar=("MODE", "PATH", "COMFYUI", "WARM"), help=argparse.SUPPRESS)
    ap.add_argument("--scale-gb", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="children of one round run side by side (peak RSS is per "
                                                        "process; load times then include the contention)")
    ap.add_argument("--no-rss", action="store_true", help="skip part 1 (no host needed)")
    ap.add_argument("--skip-tiny-rss", action="store_true", help="part 1 on the scaled-up model only")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every child (stock and ditkit alike; "
                                                           "default 1: the machine is shared)")
    ap.add_argument("--no-convert", action="store_true", help="leave the converter out of the rounds")
    ap.add_argument("--cache", action="store_true", help="also the quantized cache's 2nd load vs a stock comfy_quant "
                                                        f"load of the same weights ({', '.join(CACHE_FORMATS)})")
    ap.add_argument("--cold", action="store_true", help="drop the source / cache files from the page cache before "
                                                       "every load (POSIX_FADV_DONTNEED): disk-speed loads")
    ap.add_argument("--error-on-scaled", action="store_true",
                    help="part 2 on the scaled-up model (default: the tiny one; same random-weight statistics)")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    if a.quick:
        a.repeats = 1
    os.environ["DITKIT_BENCH_THREADS"] = str(a.threads)
    rows = Rows(a.rows, "bench_quantize")
    print("## resident bytes, real-size models (computed from the key inventories)")
    print("\n".join(real_size_table(rows)))
    with tempfile.TemporaryDirectory(prefix="ditkit-bench-q-") as tmp:
        tiny = Path(tmp) / "tiny"
        big = Path(tmp) / "big"
        tiny.mkdir()
        big.mkdir()
        t_off, t_comfy = make_checkpoints(tiny, None)
        if a.quick:                       # the smoke: the tiny model stands in for the scaled-up one
            cfg, b_off, b_comfy = dict(num_layers=2), t_off, t_comfy
        else:
            cfg = scaled_cfg(a.scale_gb)
            b_off, b_comfy = make_checkpoints(big, cfg)
        err_src = b_off if a.error_on_scaled else t_off
        what = f"scaled-up H3, {cfg['num_layers']} blocks" if a.error_on_scaled else "tiny H3"
        print(f"\n## weight reconstruction error per layer class ({what}, random weights): relative RMS over the "
              "class (max over its tensors)")
        print("\n".join(error_table(err_src, rows)), flush=True)
        if a.no_rss:
            return 0
        comfyui = os.environ.get("COMFYUI_PATH")
        if not comfyui:
            from ditkit.host import find_host

            h = find_host()
            comfyui = str(h.root) if h is not None else None
        if not comfyui:
            print("\npeak RSS: skipped (no ComfyUI host; set COMFYUI_PATH)")
            return 0
        python = os.environ.get("COMFYUI_PYTHON") or str(Path(comfyui) / "venv" / "bin" / "python")
        if not Path(python).exists():
            python = sys.executable
        print("\n## peak RSS of loading (fresh subprocess per load)")
        if not a.skip_tiny_rss:
            print("\n".join(rss_table("tiny H3", "tiny", t_off, t_comfy, comfyui, python, a.repeats, t_comfy, rows)),
                  flush=True)
        if a.quick:
            return 0
        print()
        print("\n".join(rss_table(f"scaled-up H3 ({cfg['num_layers']} blocks, hidden 1024)", "scaled", b_off, b_comfy,
                                  comfyui, python, a.repeats, t_comfy, rows, a.jobs, a.cache,
                                  not a.no_convert, a.cold)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
