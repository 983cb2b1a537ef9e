"""Peak RSS and wall time of the H3 official-shard loader: lazy per-tensor vs reading every shard at once.

    python benchmarks/bench_h3_loader.py [--hidden 1024] [--layers 6] [--shards 4] [--keep DIR] [--rows FILE]

Writes a synthetic official-layout checkpoint (per-head interleaved qkv, bf16 bulk + fp32 islands, the tiny
generator's key layout scaled up) into a temp dir, then runs each mode in a FRESH subprocess and reads its
``VmHWM`` (peak resident set, /proc/self/status) before and after loading:

* ``lazy``  -- ``ditkit.loaders.h3.load_h3_state_dict`` (headers first, then one tensor at a time, converted
  as it is read);
* ``eager`` -- the naive way: ``load_file`` every shard into one dict, then de-interleave qkv into a new dict
  (both dicts alive until the conversion finishes).

Both modes must produce the same state dict (checked with a digest over all tensors). The modes run interleaved
(lazy, eager, lazy, eager, ...); ratios (median and min-max over the rounds) are printed from this one run, and with
``--rows FILE`` written as rows (benchmarks/_harness.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`

from benchmarks._harness import Rows, add_rows_argument, ratio_stats, spread, stats  # noqa: E402

CHILD = r"""
import json, sys, time, hashlib
import torch
from benchmarks._harness import peak_rss_kib as hwm_kib  # per-process peak RSS, fresh after exec

torch.set_num_threads(1)
from ditkit.loaders import h3
from ditkit.loaders.safetensors_io import load_file
mode, folder = sys.argv[1], sys.argv[2]
base = hwm_kib()
t0 = time.perf_counter()
if mode == "lazy":
    sd, rep = h3.load_h3_state_dict(folder)
else:
    idx = json.load(open(folder + "/" + h3.OFFICIAL_INDEX))
    raw = {}
    for shard in sorted(set(idx["weight_map"].values())):
        raw.update(load_file(folder + "/" + shard))
    sd = {}
    for k, v in raw.items():
        if k.endswith("attn.qkv_proj.weight"):
            hd = raw[k[:-len("qkv_proj.weight")] + "q_norm.weight"].shape[0]
            heads = v.shape[0] // (3 * hd)
            v = v.reshape(heads, 3, hd, v.shape[1]).transpose(0, 1).reshape(v.shape).contiguous()
        sd[k] = v
    del raw
dt = time.perf_counter() - t0
peak = hwm_kib()
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode()); h.update(sd[k].contiguous().view(torch.uint8).numpy().tobytes())
nbytes = sum(t.numel() * t.element_size() for t in sd.values())
print(json.dumps({"mode": mode, "seconds": dt, "base_kib": base, "peak_kib": peak, "bytes": nbytes,
                  "digest": h.hexdigest()}))
"""


def make_checkpoint(folder: Path, hidden: int, layers: int, shards: int) -> int:
    import torch

    from ditkit.tiny import ckpt_h3 as C

    torch.set_num_threads(1)
    heads, hd = 8, hidden // 8 + hidden // 32  # inner != hidden, like the real model
    cfg = dict(C.CONFIG, hidden_size=hidden, num_attention_heads=heads, attention_head_dim=hd, num_layers=layers,
               ffn_hidden_size=2 * hidden, text_dim=1024, timestep_input_dim=256, time_embed_hidden_size=hidden,
               time_embed_dim=hidden // 4, rope_inv_freq_len=hd // 6 // 2 * 2 or 2)
    sd = C.official_state_dict(C.base_state_dict(cfg), cfg)
    C.write_sharded(sd, folder, "model", "model.safetensors.index.json", shards, C.official_config(cfg))
    return sum(t.numel() * t.element_size() for t in sd.values())


def run(mode: str, folder: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                      .split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(folder)], capture_output=True, text=True, env=env,
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    rows = Rows(a.rows, "bench_h3_loader")
    tmp = None
    if a.keep:
        folder = a.keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_h3_loader_")
        folder = Path(tmp.name) / "h3_official"
    t0 = time.perf_counter()
    total = make_checkpoint(folder, a.hidden, a.layers, a.shards)
    print(f"checkpoint: {folder} ({a.shards} shards, {total / 2**20:.1f} MiB of tensors, "
          f"written in {time.perf_counter() - t0:.1f} s)")
    rows.add("checkpoint", "shards", a.shards)
    rows.add("checkpoint", "tensor_bytes", total, "B")
    res: dict[str, list[dict]] = {"lazy": [], "eager": []}
    for _ in range(a.repeats):
        for mode in ("lazy", "eager"):  # interleaved so drift hits both
            res[mode].append(run(mode, folder))
    digests = {r["digest"] for rs in res.values() for r in rs}
    if len(digests) != 1:
        raise SystemExit(f"modes disagree on the loaded state dict: {digests}")
    best = {m: min(rs, key=lambda r: r["seconds"]) for m, rs in res.items()}
    peak = {m: max(r["peak_kib"] - r["base_kib"] for r in rs) / 1024 for m, rs in res.items()}
    secs = {m: [r["seconds"] for r in rs] for m, rs in res.items()}
    growth = {m: [(r["peak_kib"] - r["base_kib"]) / 1024 for r in rs] for m, rs in res.items()}
    for m in ("lazy", "eager"):
        print(f"{m:5s}: best {best[m]['seconds']:.3f} s over {a.repeats} runs, peak RSS growth {peak[m]:.1f} MiB "
              f"(state dict {best[m]['bytes'] / 2**20:.1f} MiB)")
        rows.add_stats(m, "time", stats(secs[m]), "s")
        rows.add_stats(m, "peak_rss_growth", stats(growth[m]), "MiB")
        rows.add(m, "state_dict_bytes", best[m]["bytes"], "B")
    rt = ratio_stats(secs["eager"], secs["lazy"])
    rm = ratio_stats(growth["eager"], growth["lazy"])
    digest = digests.pop()
    print(f"ratio eager/lazy: peak RSS growth {peak['eager'] / peak['lazy']:.2f}x, "
          f"time {best['eager']['seconds'] / best['lazy']['seconds']:.2f}x; identical output: yes "
          f"(sha256 {digest[:16]})")
    print(f"per-round ratio eager/lazy: time median {rt['median']:.2f}x {spread(rt)}, peak RSS growth median "
          f"{rm['median']:.2f}x {spread(rm)}")
    rows.add_stats("eager/lazy", "time_ratio", rt, "x")
    rows.add_stats("eager/lazy", "peak_rss_growth_ratio", rm, "x")
    rows.add("eager/lazy", "identical_output", True, note=f"sha256 {digest[:16]}")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
