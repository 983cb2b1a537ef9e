"""ditkit's H3 block paths on the real 0.33 host and under the recorded 0.35-0.38 variants
(tests/support/host_variants.py), in process, CPU, tiny FastH3:

* another pack's attention passed as ``args["attention"]`` runs inside TeaCache + FastH3 gates + the modulation
  memo (a counting attention, on 0.33 semantics and with 0.35+'s ``DiTBlock.forward(attention=)``), and the
  TeaCache report names it;
* core's ``BlockSparseAttention`` (stand-in with its recorded protocol): chained when applied before TeaCache,
  refused naming both nodes when applied after it or stacked with DitKitSparseAttention;
* the published ``minimax_h3_layout`` is checked against ditkit's rebuilt layout (a wrong one is refused);
* the checkpoint's attention choice runs in VSA's dense fallback when 0.38's wrap_attn pops it;
* tensors kept across steps are made under ``pause_malloc_graph()`` when the host has it;
* a 0.35+ stock load keeps the FastH3 gates in the model and ditkit uses exactly the file's gates.
"""
from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.support import host_variants as hv
from tests.support.host_models import load_h3, model_folder

W, H, LENGTH, TEXT = 256, 256, 22, 10
RECIPE = "FastH3 Preview v1 (keep 10%)"


@pytest.fixture(scope="module")
def gated(comfy, tiny_ckpts):
    torch.set_num_threads(1)
    with model_folder("diffusion_models", tiny_ckpts / "diffusion_models"):
        yield load_h3("h3_tiny_fasth3.safetensors")


@pytest.fixture
def reports(monkeypatch):
    import ditkit.bridge.reports as B

    out = []
    monkeypatch.setattr(B.ReportTarget, "send", lambda self, *a, **k: out.append((self.node_id, self.node_type) + a))
    return out


def _vsa(model):
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    return DitKitSparseAttention.execute(model, recipe=RECIPE, backend="reference").args[0]


def _teacache(model, threshold=0.0):
    from ditkit.nodes.teacache import DitKitTeaCache

    return DitKitTeaCache.execute(model=model, coefficients="shipped:h3_tiny_calibrated", threshold=threshold,
                                  audio_threshold=threshold, start_percent=0.0, end_percent=1.0,
                                  cache_device="model", strict=False).result[0]


def _sample(model, steps=3, cfg=3.0):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.tiny.ckpt_h3 import CONFIG

    latent = EmptyMiniMaxH3LatentAV.execute(W, H, LENGTH).result[0]
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=g), {}]]
    neg = [[torch.randn(1, TEXT, CONFIG["text_dim"], generator=g) * 0.5, {}]]
    r = nodes.common_ksampler(model, 7, steps, cfg, "euler", "simple", pos, neg, latent)[0]
    return [t.clone() for t in r["samples"].unbind()]


def _other_pack(model, counter: dict):
    """Another pack's block replaces (installed before ditkit's): each passes its own attention as
    ``args["attention"]`` (0.35+ protocol). Its attention counts its calls and computes the block's own attention,
    so outputs are comparable bit for bit."""
    m = model.clone()
    dm = m.model.diffusion_model
    for i, blk in enumerate(dm.blocks):
        def attention(h, rope_freqs=None, transformer_options={}, blk=blk):  # noqa: B006
            counter["n"] = counter.get("n", 0) + 1
            return blk.attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options)

        def patch(args, extra, attention=attention):
            return extra["original_block"]({**args, "attention": attention})

        m.set_model_patch_replace(patch, "dit", "double_block", i)
    return m


SEMANTICS = {"0.33": contextlib.nullcontext, "0.35+": hv.dit_block_attention_kwarg}


# ------------------------------------------------------------------------------------------------- (a) args["attention"]

@pytest.mark.parametrize("semantics", ["0.33", "0.35+"])
def test_teacache_gates_and_memo_run_the_other_packs_attention(gated, reports, semantics):
    """TeaCache + FastH3 gates (+ the modulation memo) stacked on another pack's attention: that attention runs in
    every block call ditkit computes (threshold 0: every block of every forward), the result equals the same stack
    without the other pack (its attention is the block's own math), and the TeaCache report names it. Without
    ``block_attention`` in ditkit's block path the count is 0 (the attention is silently dropped)."""
    n_blocks = len(gated.model.diffusion_model.blocks)
    counter: dict = {}
    with hv.refreshed(SEMANTICS[semantics]()):
        stacked = _teacache(_vsa(_other_pack(gated, counter)))
        out = _sample(stacked)
        ref = _sample(_teacache(_vsa(gated)))
    forwards = 2 * 3
    assert counter.get("n", 0) == forwards * n_blocks, counter
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    tc = [r[4] for r in reports if r[2] == "teacache"]
    assert len(tc) == 2 and tc[1].get("attention") is None  # the run without the other pack names none
    (name, calls), = tc[0]["attention"].items()
    assert calls == forwards * n_blocks and "test_host_variants_blocks" in name


# ------------------------------------------------------------------------------------------------- (b) BlockSparseAttention

def test_block_sparse_applied_before_teacache_is_chained_and_reported(gated, reports):
    counter: dict = {}
    n_blocks = len(gated.model.diffusion_model.blocks)
    with hv.refreshed(hv.dit_block_attention_kwarg()), hv.block_sparse_module():
        out = _sample(_teacache(hv.BlockSparseAttention.apply(gated, counter)))
        ref = _sample(_teacache(gated))
    assert counter["attention"] == 2 * 3 * n_blocks  # its attention ran in every block ditkit computed
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    tc = [r[4] for r in reports if r[2] == "teacache"]
    assert tc[0]["attention"] == {"BlockSparseAttention": 2 * 3 * n_blocks}
    summary = [r[3] for r in reports if r[2] == "teacache"][0]
    assert "BlockSparseAttention (" in summary


def test_block_sparse_applied_after_teacache_is_refused_naming_both(gated):
    """core's node overwrites TeaCache's block replaces: without the check the run completes with TeaCache silently
    gone (nothing cached, nothing said)."""
    from ditkit.bridge.hostcompat import CompositionError

    counter: dict = {}
    with hv.refreshed(hv.dit_block_attention_kwarg()), hv.block_sparse_module():
        m = hv.BlockSparseAttention.apply(_teacache(gated), counter)
        with pytest.raises(CompositionError, match=r"DitKitTeaCache's block replaces did not run: they were "
                                                   r"overwritten by BlockSparseAttention .* applied after "
                                                   r"DitKitTeaCache.*Apply BlockSparseAttention BEFORE"):
            _sample(m, steps=1)


@pytest.mark.parametrize("order", ["bsa_first", "bsa_after"])
def test_vsa_and_block_sparse_are_refused_naming_both(gated, order):
    from ditkit.bridge.hostcompat import CompositionError

    counter: dict = {}
    want = r"DitKitSparseAttention and BlockSparseAttention .* both replace H3's self-attention"
    with hv.refreshed(hv.dit_block_attention_kwarg()), hv.block_sparse_module():
        if order == "bsa_first":
            with pytest.raises(CompositionError, match=want):
                _vsa(hv.BlockSparseAttention.apply(gated, counter))
        else:
            m = hv.BlockSparseAttention.apply(_vsa(gated), counter)
            with pytest.raises(CompositionError, match=want):
                _sample(m, steps=1)
            assert counter.get("attention", 0) == 0  # refused before any forward


# ------------------------------------------------------------------------------------------------- (c) published layout

def test_published_layout_is_checked_and_a_wrong_one_refused(gated, monkeypatch):
    import ditkit.bridge.attention as A
    from ditkit.errors import DitKitError

    seen = []
    real = A.check_published_layout
    monkeypatch.setattr(A, "check_published_layout", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    with hv.refreshed(hv.published_layout()):
        out = _sample(_vsa(gated), steps=2)
    ref = _sample(_vsa(gated), steps=2)
    assert seen and set(seen) == {"published"}  # read and found equal in every forward
    assert all(torch.equal(a, b) for a, b in zip(out, ref))

    def shifted(layout):  # a host whose published layout's prefix differs from the one ditkit rebuilds
        (a0, b0, k0), (a1, b1, k1) = layout.segments[0], layout.segments[1]
        return SimpleNamespace(seq_len=layout.seq_len, signature=layout.signature,
                               segments=[(a0, b0 + 2, k0), (a1 + 2, b1, k1)] + list(layout.segments[2:]))

    with hv.refreshed(hv.published_layout(shifted)):
        with pytest.raises(DitKitError, match=r"published H3 layout .* differs from the layout ditkit rebuilt"):
            _sample(_vsa(gated), steps=1)


# ------------------------------------------------------------------------------------------------- (f) attention choice

def test_dense_fallback_runs_the_checkpoints_attention_choice(gated):
    """0.38's wrap_attn pops the checkpoint's ComfyAttention before calling an override: VSA's dense calls (token
    refiner, dense steps) must run that choice themselves. Counted: with the variant and no VSA, every attention
    call runs it (the variant works); with VSA its dense calls do. Without dense_attention_for: 0."""
    from comfy.ldm.modules.attention import attention_pytorch

    from ditkit.bridge.attention import HOLDER_KEY

    calls = {"n": 0}

    def choice(q, k, v, heads, *a, **kw):
        calls["n"] += 1
        return attention_pytorch(q, k, v, heads, *a, **kw)

    m = gated.clone()
    with hv.refreshed(hv.wrap_attn_preferred(choice)):
        hv.set_comfy_attention(m, choice)
        try:
            plain = _sample(m, steps=1)
            n_plain = calls["n"]
            calls["n"] = 0
            v = _vsa(m)
            rt = v.model_options["transformer_options"][HOLDER_KEY].runtime
            rt.cfg = dataclasses.replace(rt.cfg, min_tokens=10 ** 9)  # every packed call dense (below min_tokens)
            _sample(v, steps=1)
            n_vsa = calls["n"]
        finally:
            for blk in m.model.diffusion_model.blocks:
                del blk.attn.comfy_attention
    assert n_plain > 0 and plain
    assert n_vsa > 0, "VSA's dense fallback ran the host's default attention, not the checkpoint's choice"


# ------------------------------------------------------------------------------------------------- (g) malloc graph

def test_state_kept_across_steps_is_made_outside_the_malloc_graph(gated, monkeypatch):
    from ditkit.bridge.blocks import TeaCacheHolder
    from ditkit.kernels.vsa_h3_runtime import VSAH3Runtime

    mg = hv.MallocGraph()
    where: dict[str, list[int]] = {"teacache_store": [], "vsa_layout": []}
    store = TeaCacheHolder._on_last
    begin = VSAH3Runtime.begin_forward

    def spy_store(self, ctx, out):
        where["teacache_store"].append(mg.paused)
        return store(self, ctx, out)

    def spy_begin(self, *a, **kw):
        where["vsa_layout"].append(mg.paused)
        return begin(self, *a, **kw)

    monkeypatch.setattr(TeaCacheHolder, "_on_last", spy_store)
    monkeypatch.setattr(VSAH3Runtime, "begin_forward", spy_begin)
    with hv.refreshed(hv.malloc_graph(mg)):
        _sample(_teacache(_vsa(gated)), steps=2)
    assert where["teacache_store"] and where["vsa_layout"]
    assert all(p > 0 for v in where.values() for p in v), where


# ------------------------------------------------------------------------------------------------- (d) stock gates

def test_stock_load_keeps_the_gates_and_ditkit_uses_exactly_the_files(comfy, tiny_ckpts):
    """0.35+ builds attn.to_gate_compress for a FastH3 file: ditkit's loader leaves the gates to the host (no
    attachment) and checks the loaded modules hold the file's gates; DitKitSparseAttention then reads them from the
    model. Without the change the loader removed the gates before the host's load: the host's gate modules kept
    their uninitialised values and were preferred over the attachment."""
    import folder_paths

    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.h3_loaders import GATE_ATTACHMENT, DitKitH3ModelLoader
    from ditkit.nodes.sparse_attention import _find_gates

    path = tiny_ckpts / "diffusion_models" / "h3_tiny_fasth3.safetensors"
    raw = load_file(str(path))
    want = {int(k.split(".")[1]): v for k, v in raw.items() if k.endswith("attn.to_gate_compress.weight")}
    assert want
    root = str(tiny_ckpts / "diffusion_models")
    folder_paths.add_model_folder_path("diffusion_models", root)
    try:
        with hv.refreshed(hv.stock_gates(build=True)):
            out = DitKitH3ModelLoader.execute(model_name="h3_tiny_fasth3.safetensors")
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(root)
    m = out.args[0]
    dm = m.model.diffusion_model
    assert not m.get_attachment(GATE_ATTACHMENT)
    gates, src = _find_gates(m, dm, "auto")
    assert src == "to_gate_compress (model)" and set(gates) == set(want)
    for i, w in want.items():
        assert torch.equal(gates[i].detach().to(w.dtype), w), i
