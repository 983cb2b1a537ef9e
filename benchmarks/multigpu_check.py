"""Multi-GPU check of ditkit under Ulysses sequence parallelism (the layout Raylight / xFuser use).

Runs only with >= 2 CUDA GPUs (NCCL), one process per GPU; ``--device cpu`` runs the same code on gloo with toy
shapes (what ``tests/unit/test_multigpu_check.py`` drives: no figure from it stands for a GPU). In one run:

1. **VSA exactness**: ditkit's Raylight processor (``bridge/raylight.VSAInnerAttention``) behind the seq -> head
   all-to-all vs single-GPU VSA-H3 on the same tensors: max |error| (expected 0: the all-to-all moves data only);
2. **TeaCache decisions**: the skip log of every rank through the rank reducer, identical on every rank and equal
   to the single-GPU log;
3. **step time split**: per attention call, all-to-all (q, k, v, gate in; out back) vs the attention itself, and
   the speedup of N GPUs over one on the attention call (interleaved rounds, median and min-max).

    python benchmarks/multigpu_check.py [--gpus 2] [--seq 32768] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp



def _pkg():
    import ditkit  # pip install -e . (the tests put this checkout first on PYTHONPATH)

    return ditkit


def shapes(device: str, seq: int | None):
    if device == "cpu":
        return dict(heads=4, head_dim=16, prefix=(37, 10), grid=(4, 8, 8))
    # real H3 per-rank heads: 40 heads of 128 (DiT 5120); the video grid sized to about `seq` tokens
    t = 8
    hw = max(8, int(((seq or 32768) / t) ** 0.5) // 4 * 4)
    return dict(heads=40, head_dim=128, prefix=(300, 65), grid=(t, hw, hw))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def worker(rank, world, init, device, cfg, rounds, out_dir):
    pkg = _pkg()
    from importlib import import_module

    att = import_module(f"{pkg.__name__}.bridge.attention")
    rl = import_module(f"{pkg.__name__}.bridge.raylight")
    uly = import_module(f"{pkg.__name__}.parallel.ulysses")
    rt_mod = import_module(f"{pkg.__name__}.kernels.vsa_h3_runtime")
    tc = import_module(f"{pkg.__name__}.cache.teacache")
    coef = import_module(f"{pkg.__name__}.cache.coefficients")
    red = import_module(f"{pkg.__name__}.parallel.reduce")

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    H, D, prefix, grid = cfg["heads"], cfg["head_dim"], tuple(cfg["prefix"]), tuple(cfg["grid"])
    S = sum(prefix) + grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, generator=g).to(dev, dtype) for _ in range(3))
    gate = torch.randn(1, H, S, D, generator=g).sigmoid().to(dev, dtype)
    backend_name = None if device == "cuda" else "cpu_batched"
    lines = []

    def shard(x_bhsd):  # this rank's rows of the zero-padded sequence, BSHD
        x = x_bhsd.transpose(1, 2)
        sp = uly.padded_len(S, world)
        x = torch.cat([x, x.new_zeros(1, sp - S, H, D)], 1)
        n = sp // world
        return x[:, rank * n:(rank + 1) * n].contiguous()

    # 1. exactness ------------------------------------------------------------------------------------------
    rt1 = rt_mod.VSAH3Runtime(rt_mod.VSAH3Config(keep=0.2, backend=backend_name))
    ctx1 = rt1.begin_forward(prefix, grid, 0.5)
    single = rt1.attention(q, k, v, ctx1, gate=gate)
    rt = rt_mod.VSAH3Runtime(rt_mod.VSAH3Config(keep=0.2, backend=backend_name))
    holder = att.VSAHolder(rt)
    ctx = rt.begin_forward(prefix, grid, 0.5)
    to = {att.HOLDER_KEY: holder, att.CTX_KEY: ctx, att.GATE_KEY: shard(gate).transpose(1, 2)}
    proc = rl.VSAInnerAttention()
    qs, ks, vs = shard(q), shard(k), shard(v)

    def a2a_in():
        return [uly.seq_to_head(t) for t in (qs, ks, vs)]

    def attend(heads):
        return proc(lambda *a, **kw: None, *heads, transformer_options=to)

    out = uly.head_to_seq(attend(a2a_in()))
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    full = torch.cat(parts, 1)[:, :S].transpose(1, 2)
    err = (full.float() - single.float()).abs().max().item()
    lines.append(f"vsa_max_abs_error={err:.3e} (dtype {str(dtype).replace('torch.', '')}, {world} ranks, S={S})")

    # 2. TeaCache decisions ---------------------------------------------------------------------------------
    sc = coef.StreamCoefficients("video", (1.0, 0.0))
    steps = [1.0 - i / 11 for i in range(12)]

    def log(reducer, pick):
        st = tc.TeaCacheState(tc.TeaCacheConfig("h3", {"video": sc}, {"video": 0.05}), reducer=reducer)
        st.begin(steps)
        x = torch.randn(S, 64, generator=torch.Generator().manual_seed(1)).to(dev)
        dec = []
        for i, s in enumerate(steps):
            x = x + (0.08 if i % 3 == 0 else 0.01) * torch.randn(S, 64, generator=torch.Generator().manual_seed(i)).to(dev)
            cur = pick(x)
            skip = st.decide(["c"], s, {"video": [cur]})
            if not skip:
                st.store(["c"], [cur], [cur])
            dec.append(int(skip))
        return dec

    n = uly.padded_len(S, world) // world
    mine = log(red.DistReducer(seq_len=S), lambda x: torch.cat([x, x.new_zeros(uly.padded_len(S, world) - S, 64)])
               [rank * n:(rank + 1) * n])
    ref = log(red.LOCAL, lambda x: x)
    logs = [torch.zeros(len(mine), dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(logs, torch.tensor(mine, dtype=torch.int64, device=dev))
    same = all(t.tolist() == mine for t in logs)
    lines.append(f"teacache_ranks_identical={same} equal_single={mine == ref} log={''.join(map(str, mine))}")

    # 3. time split -----------------------------------------------------------------------------------------
    t_a2a, t_att, t_one = [], [], []
    for _ in range(rounds):
        _sync(dev)
        t0 = time.perf_counter()
        heads = a2a_in()
        _sync(dev)
        t1 = time.perf_counter()
        o = attend(heads)
        _sync(dev)
        t2 = time.perf_counter()
        uly.head_to_seq(o)
        _sync(dev)
        t3 = time.perf_counter()
        rt1.attention(q, k, v, ctx1, gate=gate)          # one GPU, the whole sequence (interleaved)
        _sync(dev)
        t4 = time.perf_counter()
        t_a2a.append((t1 - t0) + (t3 - t2))
        t_att.append(t2 - t1)
        t_one.append(t4 - t3)
    ratios = [a / (b + c) for a, b, c in zip(t_one, t_a2a, t_att)]
    med = statistics.median
    lines.append(f"all_to_all_ms={med(t_a2a) * 1e3:.2f} attention_ms={med(t_att) * 1e3:.2f} "
                 f"single_ms={med(t_one) * 1e3:.2f} speedup_median={med(ratios):.2f} "
                 f"min={min(ratios):.2f} max={max(ratios):.2f} (ceiling {world})")
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32768, help="about this many packed tokens (GPU mode)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < max(2, a.gpus):
        print(f"multigpu_check: needs >= {max(2, a.gpus)} CUDA GPUs (found {torch.cuda.device_count()}); nothing run")
        return 0
    cfg = shapes(a.device, a.seq)
    with tempfile.TemporaryDirectory() as td:
        mp.start_processes(worker, args=(a.gpus, f"file://{td}/rdv", a.device, cfg, a.rounds, td), nprocs=a.gpus,
                           join=True, start_method="spawn")
        for r in range(a.gpus):
            print(f"rank {r}: " + Path(td, f"rank{r}.txt").read_text(encoding="utf-8").strip().replace("\n", "\n        "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
