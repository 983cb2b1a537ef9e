"""VSA-H3 runtime decisions and counters (plain torch, no ComfyUI)."""
from __future__ import annotations

import torch

from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime

PREFIX, GRID = (10, 74), (7, 8, 8)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    S = sum(PREFIX) + 7 * 8 * 8
    return (torch.randn(1, 2, S, 16, generator=g) for _ in range(3))


def test_sigma_window_and_min_tokens():
    rt = VSAH3Runtime(VSAH3Config(keep=0.25, sigma_start=0.9, sigma_end=0.2, min_tokens=0))
    assert not rt.begin_forward(PREFIX, GRID, 0.95).sparse
    assert rt.begin_forward(PREFIX, GRID, 0.9).sparse           # boundary inclusive
    assert rt.begin_forward(PREFIX, GRID, 0.5).sparse
    assert not rt.begin_forward(PREFIX, GRID, 0.1).sparse
    assert rt.begin_forward(PREFIX, GRID, None).sparse
    big = VSAH3Runtime(VSAH3Config(keep=0.25, min_tokens=10_000))
    ctx = big.begin_forward(PREFIX, GRID, 0.5)
    assert not ctx.sparse and "min_tokens" in ctx.reason


def test_counters_density_and_summary():
    rt = VSAH3Runtime(VSAH3Config(keep=0.25), gate_source="none")
    ctx = rt.begin_forward(PREFIX, GRID, 0.5)
    q, k, v = _qkv()
    out = rt.attention(q, k, v, ctx)
    rt.dense_call("token refiner / non-packed")
    assert out.shape == q.shape
    # 11 tiles: 3 prefix (dense rows: 11 each) + 8 video rows (3 prefix + k=2) -> (3*11 + 8*5) / 121 per head
    assert rt.k_video == 2 and rt.n_tiles == 11
    assert abs(rt.density - (3 * 11 + 8 * 5) / 121) < 1e-12
    s = rt.summary()
    assert "backend cpu_batched" in s and "steps sparse 1 / dense 0" in s and "token refiner / non-packed: 1" in s
    d = rt.as_dict()
    assert d["calls"] == {"sparse": 1, "token refiner / non-packed": 1} and d["backends_used"] == {"cpu_batched": 1}
    rt.reset()
    assert rt.as_dict()["calls"] == {} and rt.density is None


def test_steps_count_what_actually_ran():
    """A forward whose blocks a step cache skipped runs no attention: it is neither a sparse nor a dense step.
    A packed-sequence call that went dense makes its step dense; a refiner call does not."""
    rt = VSAH3Runtime(VSAH3Config(keep=0.25, sigma_start=0.9, sigma_end=0.2))
    q, k, v = _qkv()
    c1 = rt.begin_forward(PREFIX, GRID, 0.8)          # sparse step, attention runs
    rt.attention(q, k, v, c1)
    rt.begin_forward(PREFIX, GRID, 0.6)               # sparse-eligible, but a cache skipped every block
    c3 = rt.begin_forward(PREFIX, GRID, 0.4)          # a masked packed call went dense
    rt.dense_call("masked call", c3)
    c4 = rt.begin_forward(PREFIX, GRID, 0.95)         # dense by the sigma window
    rt.dense_call(c4.reason, c4)
    c5 = rt.begin_forward(PREFIX, GRID, 0.3)          # only a refiner-like call: no packed attention
    rt.dense_call("token refiner / non-packed")
    d = rt.as_dict()
    assert (d["steps_sparse"], d["steps_dense"], d["steps_without_attention"]) == (1, 2, 2)
    s = rt.summary()
    assert "steps sparse 1 / dense 2 / 2 without block attention" in s
    assert c5.sparse


def test_kernels_resolve_once_per_forward_and_are_reported(monkeypatch):
    """The registry is consulted by the first sparse call of a forward only (four selections: pack, unpack,
    top-k, fine stage); the other calls of that forward reuse them, and the report names them once."""
    from ditkit.kernels import registry

    seen = []
    real = registry.Registry.resolve

    def counting(self, op, *a, **kw):
        seen.append(op)
        return real(self, op, *a, **kw)

    monkeypatch.setattr(registry.Registry, "resolve", counting)
    rt = VSAH3Runtime(VSAH3Config(keep=0.25))
    q, k, v = _qkv()
    for sigma in (0.8, 0.6):
        ctx = rt.begin_forward(PREFIX, GRID, sigma)
        for _ in range(3):                                   # three attention calls (blocks) per forward
            rt.attention(q, k, v, ctx)
    assert sorted(seen) == sorted(["vsa_pack", "vsa_unpack_combine", "vsa_select", "block_sparse_attn"] * 2), seen
    want = "fine cpu_batched, pack reference, select reference, unpack reference (cpu float32 D=16)"
    assert rt.as_dict()["kernels_per_forward"] == {want: 2}
    assert rt.summary().count("kernels resolved once per forward: " + want) == 1
    assert rt.as_dict()["backends_used"] == {"cpu_batched": 6}


def test_a_call_with_another_dtype_in_the_same_forward_resolves_its_own_kernels():
    import pytest

    from ditkit.errors import DitKitError
    from ditkit.kernels.vsa import resolve_h3_kernels, vsa_h3_attention

    rt = VSAH3Runtime(VSAH3Config(keep=0.25))
    ctx = rt.begin_forward(PREFIX, GRID, 0.5)
    q, k, v = _qkv()
    rt.attention(q, k, v, ctx)
    rt.attention(q.double(), k.double(), v.double(), ctx)
    assert len(rt.kernels) == 2 and any("float64" in d for d in rt.kernels)
    kn = resolve_h3_kernels("cpu", torch.float32, 16)
    with pytest.raises(DitKitError, match="resolved for"):
        vsa_h3_attention(q.double(), k.double(), v.double(), ctx.layout, 0.25, kernels=kn)
