"""CPU: per-call overhead of the VSA-H3 attention override, another git revision (default ``main``) vs this checkout,
in one process, interleaved ABAB.

    nice -n 10 python benchmarks/bench_vsa_overhead.py [--old-ref main] [--reps 15] [--calls 40] [--threads 1]
        [--rows FILE]

The old revision's ``kernels/`` (and ``errors.py``) are read with ``git show`` into a temporary package
``ditkit_old`` and imported next to this checkout's ``ditkit``; each keeps its own kernel registry. Both sides run the
same small packed H3 sequence (text 10 + audio 74 prefix, video grid 7x8x8: S=532, 2 heads, head_dim 16, fp32,
keep 25 %, ``cpu_batched`` fine stage) through the override ComfyUI would call, ``--calls`` attention calls per DiT
forward (one forward context each, as the blocks of one forward share it). Rows:

* ``override``: CPU time per attention call through the whole override (sparse attention included);
* ``dispatch``: the registry part alone: the old per-call path's four ``REGISTRY.resolve`` look-ups vs the new
  per-call check that the kernels carried by the forward context match q.

Each rep times A (old) then B (new) on the same inputs (``benchmarks/_harness.py`` ABAB interleave, process CPU
time); printed: median per call of each side, the median of the per-rep ratios old / new (> 1 = new is faster)
and their min-max. The outputs of both sides are compared (max abs difference; the change must not alter numbers).
Rows (``--rows``): per case ``override`` / ``dispatch`` the metrics ``old_us`` / ``new_us`` (per call) and
``old_over_new`` (per-rep ratio), plus ``setup`` / ``max_abs_diff``.
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import Rows, Timer, add_rows_argument, interleave, ratio_stats, spread, stats  # noqa: E402
PREFIX, GRID, HEADS, HEAD_DIM, KEEP = (10, 74), (7, 8, 8), 2, 16, 0.25


def load_old(ref: str, into: Path):
    """Import ``ref``'s kernels (and its host layer ``bridge/`` when it has one) as the package ``ditkit_old`` (a temp
    copy: nothing in the checkout changes). Returns the module holding that revision's attention override."""
    # revisions before the layout move kept the package in an inner ditkit/ folder; later ones at the root
    base = "ditkit/" if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{ref}:ditkit/kernels"],
                                       capture_output=True).returncode == 0 else ""

    def ls(folder):
        r = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{ref}:{base}{folder}"],
                           capture_output=True, text=True)
        return [f"{folder}/{f}" for f in r.stdout.split() if f.endswith(".py")] if r.returncode == 0 else []

    pkg = into / "ditkit_old"
    (pkg / "kernels" / "csrc").mkdir(parents=True)
    (pkg / "bridge").mkdir()
    (pkg / "__init__.py").write_text('"""old revision (benchmark copy)"""\n', encoding="utf-8")
    top = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{ref}:{base}"], capture_output=True,
                         text=True).stdout.split()
    # the kernels' own top-level imports (errors; report / strict_json where that revision has them)
    files = ([f for f in ("errors.py", "report.py", "strict_json.py") if f in top] + ls("kernels") + ls("bridge")
             + ["kernels/csrc/tile_attn.cpp"])
    for rel in files:
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{base}{rel}"], check=True,
                              capture_output=True).stdout
        (pkg / rel).write_bytes(blob)
    sys.path.insert(0, str(into))
    kernels = importlib.import_module("ditkit_old.kernels")
    where = "bridge.attention" if "bridge/attention.py" in files else "kernels.vsa_h3_runtime"
    return (importlib.import_module(f"ditkit_old.{where}"), importlib.import_module("ditkit_old.kernels.vsa_h3_runtime"),
            kernels)


def host_func(q, k, v, heads, mask=None, skip_reshape=False, **kw):
    """Stand-in for ComfyUI's attention function (only reached by calls the override declines: none here)."""
    raise AssertionError("the benchmark's calls are all sparse")


class Side:
    """One revision's override as ComfyUI drives it: a runtime, the override, the forward context per forward."""

    def __init__(self, attention, runtime):
        self.rt = runtime.VSAH3Runtime(runtime.VSAH3Config(keep=KEEP))
        self.run_options = {}
        if hasattr(attention, "VSAAttentionOverride"):     # per-run holder in transformer_options
            self.override = attention.VSAAttentionOverride()
            self.run_options[attention.HOLDER_KEY] = attention.VSAHolder(self.rt)
        else:                                              # override closed over one runtime
            self.override = attention.make_attention_override(self.rt)
        self.key = attention.CTX_KEY

    def forward_options(self) -> dict:
        return dict(self.run_options, **{self.key: self.rt.begin_forward(PREFIX, GRID, 0.5)})


def run_forward(side, q, k, v, calls: int) -> torch.Tensor:
    to = side.forward_options()
    for _ in range(calls):
        out = side.override(host_func, q, k, v, HEADS, skip_reshape=True, transformer_options=to)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-ref", default="main")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="attention calls per forward")
    ap.add_argument("--dispatch-calls", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = Rows(a.rows, "bench_vsa_overhead")
    with tempfile.TemporaryDirectory(prefix="ditkit_old_") as tmp:
        old_att, old_rt, old_k = load_old(a.old_ref, Path(tmp))
        from ditkit.bridge import attention as new_att
        from ditkit.kernels import REGISTRY
        from ditkit.kernels import vsa_h3_runtime as new_rt
        from ditkit.kernels.vsa import resolve_h3_kernels

        g = torch.Generator().manual_seed(0)
        S = sum(PREFIX) + GRID[0] * GRID[1] * GRID[2]
        q, k, v = (torch.randn(1, HEADS, S, HEAD_DIM, generator=g) for _ in range(3))
        old, new = Side(old_att, old_rt), Side(new_att, new_rt)
        diff = float((run_forward(old, q, k, v, 2) - run_forward(new, q, k, v, 2)).abs().max())
        print(f"[setup] old={a.old_ref} new=checkout S={S} H={HEADS} D={HEAD_DIM} fp32 keep={KEEP} "
              f"threads={a.threads} calls/forward={a.calls} reps={a.reps} max|old-new|={diff:.3g}")
        print(f"[setup] new side: {new.rt.summary().split('; kernels resolved once per forward: ')[-1]}")
        rows.add("setup", "max_abs_diff", diff, note=f"old={a.old_ref} S={S} H={HEADS} D={HEAD_DIM} fp32")

        old_reg = old_k.REGISTRY
        assert REGISTRY is not old_reg

        def old_dispatch():
            for _ in range(a.dispatch_calls):   # the old per-call path: pack, unpack (aux request), top-k, fine stage
                old_reg.resolve("vsa_pack", q.device, q.dtype, q.shape[-1], None)
                old_reg.resolve("vsa_unpack_combine", q.device, q.dtype, q.shape[-1], None)
                old_reg.resolve("vsa_select", q.device, torch.float32, q.shape[-1])
                old_reg.resolve("block_sparse_attn", q.device, q.dtype, q.shape[-1], None)

        kn = resolve_h3_kernels(q.device, q.dtype, q.shape[-1], None)

        def new_dispatch():
            for _ in range(a.dispatch_calls):   # the new per-call path: the forward's carried kernels checked vs q
                if not kn.matches(q):
                    raise AssertionError

        timer = Timer(cpu_time=True)
        cases = {"override": ({"old": lambda: run_forward(old, q, k, v, a.calls),
                               "new": lambda: run_forward(new, q, k, v, a.calls)}, a.calls),
                 "dispatch": ({"old": old_dispatch, "new": new_dispatch}, a.dispatch_calls)}
        for name, (fns, per) in cases.items():
            t = interleave(fns, a.reps, timer=timer)
            so, sn = stats(t["old"]), stats(t["new"])
            r = ratio_stats(t["old"], t["new"])
            rows.add_stats(name, "old_us", so, "us", scale=1e6 / per)
            rows.add_stats(name, "new_us", sn, "us", scale=1e6 / per)
            rows.add_stats(name, "old_over_new", r, "x")
            print(f"[{name}] per call: old {so['median'] * 1e6 / per:.3f} us | new {sn['median'] * 1e6 / per:.3f} us"
                  f" | old/new {r['median']:.3f}x {spread(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
