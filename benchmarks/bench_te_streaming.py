"""Layerwise text-encoder streaming: device-resident weight bytes and cost, real configs (shapes) + CPU runs.

    COMFYUI_PATH=/work/ComfyUI /work/ComfyUI/venv/bin/python benchmarks/bench_te_streaming.py [--repeats 3]
        [--rows FILE]

A. Real encoders from shapes (bf16): H3 Qwen3-VL-32B truncated to 50 layers, LTX-2 Gemma 3 12B. Device weight
   bytes resident without streaming vs peak with layerwise streaming (prefetch p -> p + 1 layers, embedding on
   host), bytes copied per prompt, and the copy time that must hide behind compute at a given link speed.
B. Tiny encoders on ComfyUI (CPU, streaming forced as cpu->cpu copies): outputs bit-equal to the non-streamed
   encoder, measured peak streamed bytes vs the 2-layer bound, bytes copied, encode-time ratio.

B interleaves plain and streamed encodes (ABAB; median of ``--repeats`` rounds, per-round ratio with its min-max).
With ``--rows FILE`` every figure is also written as a row (benchmarks/_harness.py).

No GPU was available when this was written: B measures the scheduling/accounting and the CPU copy overhead,
not PCIe overlap.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument, interleave, ratio_stats, spread, stats  # noqa: E402

REAL = {
    "H3 Qwen3-VL-32B (50 of 64 layers)": dict(h=5120, nq=64, nkv=8, hd=128, ff=25600, layers=50, vocab=151936,
                                              gemma=False),
    "LTX-2 Gemma 3 12B": dict(h=3840, nq=16, nkv=8, hd=256, ff=15360, layers=48, vocab=262208, gemma=True),
}


def layer_params(c) -> int:
    h, q, kv, ff = c["h"], c["nq"] * c["hd"], c["nkv"] * c["hd"], c["ff"]
    norms = (4 if c["gemma"] else 2) * h + 2 * c["hd"]
    return h * q + 2 * h * kv + q * h + 3 * h * ff + norms


def part_a(rows):
    print("A. real text encoders, from shapes (bf16)")
    for name, c in REAL.items():
        lb = layer_params(c) * 2
        emb = c["vocab"] * c["h"] * 2
        full = lb * c["layers"] + emb
        print(f"   {name}: layer {lb / 2**20:.1f} MiB x {c['layers']} + embedding {emb / 2**30:.2f} GiB = "
              f"{full / 2**30:.2f} GiB resident without streaming")
        for metric, value in (("layer_bytes", lb), ("layers", c["layers"]), ("embedding_bytes", emb),
                              ("resident_bytes_without_streaming", full)):
            rows.add(name, metric, value, "" if metric == "layers" else "B")
        for p in (1, 2):
            peak = (p + 1) * lb
            print(f"     prefetch {p}: peak device weights {peak / 2**20:.0f} MiB ({full / peak:.0f}x less), "
                  f"copied per prompt {lb * c['layers'] / 2**30:.2f} GiB "
                  f"(~{lb * c['layers'] / 25e9:.2f} s at 25 GB/s, ~{lb * c['layers'] / 50e9:.2f} s at 50 GB/s)")
            rows.add(f"{name}/prefetch {p}", "peak_device_weight_bytes", peak, "B")
            rows.add(f"{name}/prefetch {p}", "less_than_resident", full / peak, "x")
            rows.add(f"{name}/prefetch {p}", "copied_bytes_per_prompt", lb * c["layers"], "B")


def part_b(comfyui: str, repeats: int, rows):
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args

    args.cpu = True
    import ditkit.nodes.text_encoders as te
    from ditkit.tiny.checkpoints import generate_all

    print(f"B. tiny encoders on ComfyUI, CPU, streaming forced (cpu->cpu), median of {repeats}")
    with tempfile.TemporaryDirectory() as d:
        out = generate_all(d, only=["h3_te", "ltx_te"])
        for key, build in (("h3_te", te.build_h3_clip), ("ltx_te", te.build_ltx_clip)):
            path = out[key][0]
            plain, cfg, _ = build(path)
            streamed, _, info = build(path, streaming=True, prefetch=1, force=True)
            st = streamed.ditkit_streaming.streamers[0]

            def enc(clip):
                return clip.encode_from_tokens_scheduled(clip.tokenize("a red fox jumps over the lazy dog"))

            a, b = enc(plain), enc(streamed)
            equal = torch.equal(a[0][0], b[0][0])

            def enc_streamed():
                st.stats.reset()
                return enc(streamed)

            t = interleave({"plain": lambda: enc(plain), "streamed": enc_streamed}, repeats, warmup=0)
            tp, ts = t["plain"], t["streamed"]
            r = ratio_stats(ts, tp)
            s = type('S', (), st.last_pass)
            n_tensors = len(list(st.layers[0].parameters())) + len(list(st.layers[0].buffers()))
            bound = 2 * (st.max_layer_bytes + n_tensors * 256)
            layers_total = st.host_bytes
            print(f"   {key}: bit-equal={equal}; encode plain {statistics.median(tp) * 1e3:.1f} ms, streamed "
                  f"{statistics.median(ts) * 1e3:.1f} ms (ratio {r['median']:.2f} {spread(r)})")
            print(f"   {'':6s}  layers {layers_total / 2**20:.3f} MiB packed on host; peak streamed resident "
                  f"{s.peak_device_bytes} B <= 2-layer bound {bound} B: {s.peak_device_bytes <= bound}; "
                  f"copied per prompt {s.bytes_h2d} B; embedding {info['embedding_bytes_on_host'] / 2**20:.2f} MiB "
                  f"stays on host, rows read {s.host_embedding_bytes_read} B; resident without streaming "
                  f"{(layers_total + info['embedding_bytes_on_host']) / 2**20:.2f} MiB -> "
                  f"{(layers_total + info['embedding_bytes_on_host']) / max(s.peak_device_bytes, 1):.0f}x less")
            rows.add(key, "bit_equal", equal)
            rows.add_stats(key, "encode_plain", stats(tp), "ms", scale=1e3)
            rows.add_stats(key, "encode_streamed", stats(ts), "ms", scale=1e3)
            rows.add_stats(key, "streamed_over_plain", r, "x")
            for metric, value in (("layers_host_bytes", layers_total), ("peak_streamed_resident_bytes",
                                                                         s.peak_device_bytes),
                                  ("two_layer_bound_bytes", bound), ("copied_bytes_per_prompt", s.bytes_h2d),
                                  ("embedding_host_bytes", info["embedding_bytes_on_host"]),
                                  ("embedding_rows_read_bytes", s.host_embedding_bytes_read)):
                rows.add(key, metric, value, "B")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"))
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    rows = Rows(a.rows, "bench_te_streaming")
    torch.set_num_threads(1)
    part_a(rows)
    if a.comfyui:
        part_b(a.comfyui, a.repeats, rows)
    else:
        print("B. skipped: set COMFYUI_PATH or --comfyui")
        rows.add("B", "skipped", True, note="set COMFYUI_PATH or --comfyui")


if __name__ == "__main__":
    main()
