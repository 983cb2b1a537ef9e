"""CPU: per-step cost of H3 sampling with TeaCache + FastH3 gates, block modulation memoised per forward vs not.

    COMFYUI_PATH=/path/to/ComfyUI nice -n 10 python benchmarks/bench_h3_modulation_memo.py [--rounds 9]
        [--steps 4] [--threads 1] [--rows FILE]

In-process ComfyUI (CPU) on the tiny FastH3 checkpoint (``ditkit.tiny.checkpoints``): DitKitSparseAttention
(FastH3 Preview recipe, trained gates, ``reference`` backend) then DitKitTeaCache (threshold 0: every block runs, so
both sides do the same work except the modulation). A: the stack as installed (``bridge/blocks.py``
``ModulationMemo``: every block's ``adaln_proj`` once per forward); B: the same clone with the memo wrapper removed
(block 0's modulation computed 3 times per forward, each gated block's twice: TeaCache, the gate replace, the block).

ABAB rounds (``benchmarks/_harness.py``, process CPU time), one sampling run per side per round; printed: median
seconds per step of each side and the per-round ratio B / A (> 1 = the memo is faster) with its min-max. The outputs
of both sides are compared (must be equal). Rows (``--rows``): case ``tiny_fasth3`` metrics ``memo_s_per_step``,
``no_memo_s_per_step``, ``no_memo_over_memo`` and ``max_abs_diff``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the checkout, last: its folders must never shadow ComfyUI's `nodes`
from benchmarks._harness import Rows, Timer, add_rows_argument, interleave, ratio_stats, spread, stats  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    add_rows_argument(ap)
    a = ap.parse_args(argv)
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI 0.33 checkout")
    sys.path.insert(0, comfy_path)
    from comfy.cli_args import args as cargs

    cargs.cpu = True
    import comfy.patcher_extension as pe
    import comfy.utils
    import folder_paths
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.bridge.blocks import MEMO_WRAPPER_KEY
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader
    from ditkit.nodes.sparse_attention import DitKitSparseAttention
    from ditkit.nodes.teacache import DitKitTeaCache
    from ditkit.tiny.checkpoints import generate_all
    from ditkit.tiny.ckpt_h3 import CONFIG

    comfy.utils.PROGRESS_BAR_ENABLED = False
    torch.set_num_threads(a.threads)
    rows = Rows(a.rows, "bench_h3_modulation_memo")
    with tempfile.TemporaryDirectory() as tmp:
        generate_all(Path(tmp), only=["h3_dit_fasth3"])
        folder_paths.add_model_folder_path("diffusion_models", str(Path(tmp) / "diffusion_models"))
        base = DitKitH3ModelLoader.execute(model_name="h3_tiny_fasth3.safetensors").args[0]
        m = DitKitSparseAttention.execute(base, recipe="FastH3 Preview v1 (keep 10%)", backend="reference").args[0]
        memo = DitKitTeaCache.execute(model=m, coefficients="shipped:h3_tiny_calibrated", threshold=0.0,
                                      audio_threshold=0.0, start_percent=0.0, end_percent=1.0, cache_device="model",
                                      strict=False).result[0]
        plain = memo.clone()
        plain.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, MEMO_WRAPPER_KEY)
        latent = EmptyMiniMaxH3LatentAV.execute(256, 256, 22).result[0]
        g = torch.Generator().manual_seed(0)
        pos = [[torch.randn(1, 10, CONFIG["text_dim"], generator=g), {}]]
        neg = [[torch.randn(1, 10, CONFIG["text_dim"], generator=g) * 0.5, {}]]

        def run(model):
            return lambda: nodes.common_ksampler(model, 7, a.steps, 3.0, "euler", "simple", pos, neg,
                                                 latent)[0]["samples"]

        keep: dict = {}
        t = interleave({"memo": run(memo), "no_memo": run(plain)}, a.rounds, timer=Timer(cpu_time=True), keep=keep)
    diff = max(float((x - y).abs().max()) for x, y in zip(keep["memo"].unbind(), keep["no_memo"].unbind()))
    sm, sn, r = stats(t["memo"]), stats(t["no_memo"]), ratio_stats(t["no_memo"], t["memo"])
    rows.add_stats("tiny_fasth3", "memo_s_per_step", sm, "s", scale=1 / a.steps)
    rows.add_stats("tiny_fasth3", "no_memo_s_per_step", sn, "s", scale=1 / a.steps)
    rows.add_stats("tiny_fasth3", "no_memo_over_memo", r, "x")
    rows.add("tiny_fasth3", "max_abs_diff", diff)
    print(f"tiny FastH3, TeaCache (threshold 0) + gates, {a.steps} steps, cfg 3, {a.threads} thread(s), CPU time")
    print(f"memo    {sm['median'] / a.steps * 1e3:8.2f} ms/step")
    print(f"no memo {sn['median'] / a.steps * 1e3:8.2f} ms/step")
    print(f"no memo / memo {r['median']:.3f}x {spread(r)}; max abs diff {diff:g}")
    return 0 if diff == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
