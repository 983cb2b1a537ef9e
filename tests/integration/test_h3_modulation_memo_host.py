"""H3 block modulation computed once per DiT forward (real ComfyUI 0.33 host, in process, CPU, tiny FastH3).

With DitKitTeaCache (its skip decision reads block 0's modulation) and DitKitSparseAttention with trained FastH3
gates (the gate replace reads each gated block's modulation) on one model, every block's ``adaln_proj`` runs at
most once per forward and block 0's exactly once. Counted independently: forward hooks on the ``adaln_proj``
modules, grouped per forward by a ``DIFFUSION_MODEL`` wrapper the test adds itself.

Sampling with the memo is bit-identical to the same stack with the memo wrapper removed, where every block runs
ComfyUI's own ``DiTBlock.forward`` (the oracle), with and without TeaCache skips.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.host_models import load_h3, model_folder

W, H, LENGTH, TEXT = 256, 256, 22, 10
RECIPE = "FastH3 Preview v1 (keep 10%)"


@pytest.fixture(scope="module")
def gated(comfy, tiny_ckpts):
    torch.set_num_threads(1)
    with model_folder("diffusion_models", tiny_ckpts / "diffusion_models"):
        yield load_h3("h3_tiny_fasth3.safetensors")


def _stack(model, threshold):
    from ditkit.nodes.sparse_attention import DitKitSparseAttention
    from ditkit.nodes.teacache import DitKitTeaCache

    m = DitKitSparseAttention.execute(model, recipe=RECIPE, backend="reference").args[0]
    return DitKitTeaCache.execute(model=m, coefficients="shipped:h3_tiny_calibrated", threshold=threshold,
                                  audio_threshold=threshold, start_percent=0.0, end_percent=1.0,
                                  cache_device="model", strict=False).result[0]


def _sample(model, steps=4, cfg=3.0):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.tiny.ckpt_h3 import CONFIG

    latent = EmptyMiniMaxH3LatentAV.execute(W, H, LENGTH).result[0]
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=g), {}]]
    neg = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=g) * 0.5, {}]]
    r = nodes.common_ksampler(model, 7, steps, cfg, "euler", "simple", pos, neg, latent)[0]
    return [t.clone() for t in r["samples"].unbind()]


class PerForwardCounts:
    """adaln_proj calls per block, one dict per DiT forward (forward hooks + the test's own DIFFUSION_MODEL
    wrapper on a clone; nothing of ditkit is used to count)."""

    def __init__(self, model):
        import comfy.patcher_extension as pe

        self.model = model.clone()
        self.forwards: list[dict[int, int]] = []
        self._cur: dict[int, int] | None = None
        dm = self.model.model.diffusion_model
        self.hooks = [blk.adaln_proj.register_forward_hook(self._hook(i)) for i, blk in enumerate(dm.blocks)]

        def wrapper(executor, *a, **kw):
            self._cur = {i: 0 for i in range(len(dm.blocks))}
            try:
                return executor(*a, **kw)
            finally:
                self.forwards.append(self._cur)
                self._cur = None

        self.model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_adaln_count", wrapper)

    def _hook(self, i):
        def hook(*_):
            if self._cur is not None:
                self._cur[i] += 1
        return hook

    def close(self):
        for h in self.hooks:
            h.remove()


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_block_modulation_is_computed_once_per_forward(gated, threshold):
    counter = PerForwardCounts(_stack(gated, threshold))
    try:
        _sample(counter.model)
    finally:
        counter.close()
    assert len(counter.forwards) == 2 * 4  # cfg 3, batch 1: cond and uncond are separate forwards
    for f in counter.forwards:
        assert f[0] == 1, f"block 0's modulation ran {f[0]} times in one forward ({counter.forwards})"
        assert all(n <= 1 for n in f.values()), counter.forwards
    if threshold == 0.0:  # nothing skipped: every block ran, each on one modulation
        assert all(set(f.values()) == {1} for f in counter.forwards), counter.forwards


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_sampling_is_bit_identical_to_comfyuis_own_blocks(gated, threshold, monkeypatch):
    import comfy.patcher_extension as pe

    import ditkit.bridge.reports as B   # the one report sink: per-run reports go through it
    from ditkit.bridge.blocks import MEMO_WRAPPER_KEY

    reports = []
    monkeypatch.setattr(B, "send_report", lambda *a, **k: reports.append(a))
    m = _stack(gated, threshold)
    assert m.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, MEMO_WRAPPER_KEY), "the memo wrapper is installed"
    plain = m.clone()
    plain.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, MEMO_WRAPPER_KEY)
    out = _sample(m)
    ref = _sample(plain)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    tc = [r[4] for r in reports if r[2] == "teacache"]
    assert len(tc) == 2 and tc[0]["skipped"] == tc[1]["skipped"]
    if threshold > 0:
        assert tc[0]["skipped"] >= 1, "the skip path must be exercised"
