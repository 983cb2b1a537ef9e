"""The host contract under each host variant (tests/support/host_variants.py: the recorded 0.35-0.38 changes
reproduced in process on the real 0.33 host): ``check_all(refresh=True)`` holds everywhere on 0.33 and, under each
variant, names exactly the entries that variant adapts to (the hostcompat entries; nothing else changes state)."""
from __future__ import annotations

import pytest


def _states() -> dict[str, str]:
    from ditkit.bridge import contract

    return {r.entry.symbol: r.probe.state for r in contract.check_all(refresh=True).results}


def _hostcompat_symbols() -> set[str]:
    from ditkit.bridge import contract, hostcompat  # noqa: F401  (registers the entries)

    return {e.symbol for e in contract.entries() if e.probe.__module__.endswith("bridge.hostcompat")}


@pytest.fixture
def base(comfy):
    from ditkit.bridge import contract

    contract.reset()
    states = _states()
    yield states
    contract.reset()


def test_every_hostcompat_entry_holds_on_the_real_033_host(base):
    mine = _hostcompat_symbols()
    assert len(mine) == 10
    assert {s: base[s] for s in mine} == {s: "holds" for s in mine}
    assert not [s for s, st in base.items() if st == "broken"]


def _variants():
    from tests.support import host_variants as hv

    return {
        "dit_block_attention": (hv.dit_block_attention_kwarg, {"comfy.ldm.minimax.model.DiTBlock.forward[attention]"}),
        "published_layout": (hv.published_layout, {"comfy.ldm.minimax.model.MiniMaxH3Model._forward[minimax_h3_layout]"}),
        "stock_gates": (hv.stock_gates, {"comfy.ldm.minimax.model.Attention[to_gate_compress]"}),
        "wrap_attn_preferred": (lambda: hv.wrap_attn_preferred(None),
                                {"comfy.ldm.modules.attention.wrap_attn[preferred_attention]"}),
        "malloc_graph": (lambda: hv.malloc_graph(hv.MallocGraph()), {"comfy.model_prefetch.pause_malloc_graph"}),
        "blended_tiled_decode": (hv.blended_neighbour_tiled_decode,
                                 {"comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.tiled_decode[frame view]"}),
        "host_single_image": (hv.host_single_image_decode, {"comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.decode[T=1]"}),
        "vae_num_layers": (hv.vae_num_layers, {"comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.__init__[num_layers]"}),
        "patcher_fast_disk": (hv.patcher_fast_disk, {"comfy.model_patcher.ModelPatcher.__init__[fast_disk]"}),
        "block_sparse_attention": (hv.block_sparse_module,
                                   {"comfy_extras.nodes_sparse_attention.BlockSparseAttention[composition]"}),
    }


@pytest.mark.parametrize("name", ["dit_block_attention", "published_layout", "stock_gates", "wrap_attn_preferred",
                                  "malloc_graph", "blended_tiled_decode", "host_single_image", "vae_num_layers",
                                  "patcher_fast_disk", "block_sparse_attention"])
def test_each_variant_names_exactly_the_entries_it_adapts_to(base, name):
    make, expect = _variants()[name]
    with make():
        states = _states()
    changed = {s for s in states if states[s] != base.get(s)}
    assert changed == expect, (name, {s: states[s] for s in changed | expect})
    assert all(states[s] == "adapted" for s in expect)
    assert _states() == base  # the variant is gone again: back to 0.33


def test_unknown_drift_is_broken_and_named(base, comfy):
    """A change no variant records (a renamed DiTBlock.forward parameter) is 'broken' with what differs, and only
    the dependent nodes refuse; a node that does not depend on it keeps working."""
    import comfy.ldm.minimax.model as M

    from ditkit.bridge import contract
    from ditkit.errors import DitKitError
    from tests.support.host_variants import _patched

    def forward(self, x, t_emb, mod_segments, rope, transformer_options={}):  # noqa: B006 - "rope_freqs" renamed
        raise AssertionError("not run")

    with _patched(M.DiTBlock, forward=forward):
        states = _states()
        sym = "comfy.ldm.minimax.model.DiTBlock.forward[attention]"
        assert states[sym] == "broken"
        with pytest.raises(DitKitError, match=r"DitKitTeaCache cannot run on ComfyUI .*DiTBlock.forward\[attention\]"
                                              r".*'rope'"):
            contract.require("DitKitTeaCache")
        assert contract.require("DitKitH3VAEDecode") == []  # does not depend on it: keeps working
    contract.reset()
