"""loaders/h3_turbo_curve.py: Turbo LoRA AdaLN pairs carried as extra curve columns (plain torch). Oracles are the
math written here (host grid t_i = i/(grid-1), H3 time embedding cos before sin, C = S Aᵀ, s·B)."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import AdapterError
from ditkit.loaders import h3_turbo_curve as tc
from ditkit.loaders.safetensors_io import save_file

ROWS, D, K = 9, 6, 3


def _te(dtype=torch.float32, g=None):
    g = g or torch.Generator().manual_seed(0)
    return {"time_embedder.proj_in.weight": torch.randn(5, 4, generator=g).to(dtype),
            "time_embedder.proj_in.bias": torch.randn(5, generator=g).to(dtype),
            "time_embedder.proj_out.weight": torch.randn(D, 5, generator=g).to(dtype),
            "time_embedder.proj_out.bias": torch.randn(D, generator=g).to(dtype)}


def _ref_silu(te, rows):
    t = [i / (rows - 1) for i in range(rows)]
    out = []
    w1, b1, w2, b2 = (te[k].double() for k in tc.TE_KEYS)
    for ti in t:
        e = torch.tensor([math.cos(ti * math.exp(-math.log(10000.0) * j / 2)) for j in range(2)]
                         + [math.sin(ti * math.exp(-math.log(10000.0) * j / 2)) for j in range(2)], dtype=torch.float64)
        h = w1 @ e + b1
        h = h / (1 + torch.exp(-h))
        o = w2 @ h + b2
        out.append(o / (1 + torch.exp(-o)))
    return torch.stack(out)


def test_host_grid_rows_at_i_over_grid_minus_one():
    g = tc.host_grid(5)
    assert g.dtype == torch.float64 and g.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_silu_grid_from_time_embedder_matches_written_math(dtype):
    te = _te(dtype)
    got = tc.silu_grid_from_time_embedder(te, ROWS, "w")
    assert got.dtype == torch.float64 and got.shape == (ROWS, D)
    assert torch.allclose(got, _ref_silu(te, ROWS), rtol=0, atol=1e-12)


def test_silu_grid_from_time_embedder_refusals():
    te = _te()
    with pytest.raises(AdapterError, match=r"no 'time_embedder.proj_in.weight'.*'time_embedder_checkpoint'"):
        tc.silu_grid_from_time_embedder({k: v for k, v in te.items() if "proj_in.weight" not in k}, ROWS, "w")
    bad = dict(te, **{"time_embedder.proj_out.bias": torch.full((D,), float("nan"))})
    with pytest.raises(AdapterError, match="proj_out.bias' contains NaN"):
        tc.silu_grid_from_time_embedder(bad, ROWS, "w")
    odd = dict(te, **{"time_embedder.proj_in.weight": torch.randn(5, 3)})
    with pytest.raises(AdapterError, match="do not chain"):
        tc.silu_grid_from_time_embedder(odd, ROWS, "w")
    with pytest.raises(AdapterError, match="floating-point"):
        tc.silu_grid_from_time_embedder(dict(te, **{"time_embedder.proj_in.bias": torch.ones(5, dtype=torch.int32)}),
                                        ROWS, "w")


def test_check_silu_grid_boundaries():
    s = torch.randn(ROWS, D)
    assert tc.check_silu_grid(s, ROWS, D, "w").dtype == torch.float64
    for shape in ((ROWS - 1, D), (ROWS + 1, D), (ROWS, D - 1), (ROWS, D + 1)):
        with pytest.raises(AdapterError, match=rf"shape \({shape[0]}, {shape[1]}\), expected \({ROWS}, {D}\)"):
            tc.check_silu_grid(torch.randn(*shape), ROWS, D, "w")
    t = torch.linspace(0, 1, ROWS, dtype=torch.float64)
    tc.check_silu_grid(s, ROWS, D, "w", t + 0.99e-6)
    with pytest.raises(AdapterError, match="t_grid' differs"):
        tc.check_silu_grid(s, ROWS, D, "w", t + 1.01e-6)
    with pytest.raises(AdapterError, match="t_grid' differs"):
        tc.check_silu_grid(s, ROWS, D, "w", t.flip(0))
    with pytest.raises(AdapterError, match="contains NaN"):
        tc.check_silu_grid(s.clone().fill_(float("inf")), ROWS, D, "w")
    nc = torch.randn(D, ROWS).T        # non-contiguous is fine
    assert torch.equal(tc.check_silu_grid(nc, ROWS, D, "w"), nc.double())


def test_read_time_embedder_prefixes_and_pruned(tmp_path):
    te = _te()
    for pre in tc.TE_PREFIXES:
        p = tmp_path / f"te{len(pre)}.safetensors"
        save_file({pre + k: v for k, v in te.items()} | {"other": torch.ones(1)}, p)
        got = tc.read_time_embedder(str(p), "w")
        assert set(got) == set(tc.TE_KEYS) and all(torch.equal(got[k], te[k]) for k in te)
    p = tmp_path / "pruned.safetensors"
    save_file({"adaln_t_table": torch.ones(ROWS, K)}, p)
    with pytest.raises(AdapterError, match="itself curve-form"):
        tc.read_time_embedder(str(p), "w")
    p = tmp_path / "none.safetensors"
    save_file({"x": torch.ones(1)}, p)
    assert tc.read_time_embedder(str(p), "w") == {}


def test_read_grid_file(tmp_path):
    s = torch.randn(ROWS, D)
    p = tmp_path / "g.safetensors"
    save_file({"silu_t_emb_grid": s, "t_grid": torch.linspace(0, 1, ROWS)}, p)
    assert torch.equal(tc.read_grid_file(str(p), ROWS, D, "w"), s.double())
    with pytest.raises(AdapterError, match=r"shape \(9, 6\), expected \(10, 6\)"):
        tc.read_grid_file(str(p), ROWS + 1, D, "w")


def _pairs(g, widths=(D, D), rank=2):
    return [tc.CurvePair(f"m{i}", [f"m{i}.lora_down.weight"], f"diffusion_model.blocks.{i}.adaln_proj.linear.weight",
                         torch.randn(4 + i, rank, generator=g), torch.randn(rank, w, generator=g), 0.5, "alpha/rank")
            for i, w in enumerate(widths)]


def test_build_carry_columns_and_factors():
    g = torch.Generator().manual_seed(1)
    table = torch.randn(ROWS, K)
    pairs = _pairs(g)
    s = torch.randn(ROWS, D, dtype=torch.float64)
    carry = tc.build_carry(table, pairs, s, -0.7, "src", "f")
    assert carry.table.shape == (ROWS, K + 4) and torch.equal(carry.table[:, :K], table)
    assert carry.columns == {pairs[0].target: (K, K + 2), pairs[1].target: (K + 2, K + 4)}
    for p in pairs:
        c0, c1 = carry.columns[p.target]
        want = s @ p.down.double().T
        assert torch.allclose(carry.table[:, c0:c1].double(), want, rtol=1e-6, atol=1e-6)
        assert torch.allclose(carry.extra[p.target].double(), -0.7 * 0.5 * p.up.double(), rtol=1e-6, atol=0)
        # delta at every grid row == s·B(A s_i)
        d = tc.curve_delta(carry.table, carry, p.target).double()
        ref = -0.35 * (s @ p.down.double().T) @ p.up.double().T
        assert (d - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert "4 extra curve columns" in carry.summary() and carry.as_dict()["width"] == K + 4


def test_build_carry_refusals():
    g = torch.Generator().manual_seed(2)
    table = torch.randn(ROWS, K)
    s = torch.randn(ROWS, D)
    with pytest.raises(AdapterError, match=r"'m0.lora_down.weight' is an AdaLN pair.*9-point grid.*'silu_t_emb_grid'"):
        tc.build_carry(table, _pairs(g), None, 1.0, "", "f")
    with pytest.raises(AdapterError, match="different widths"):
        tc.build_carry(table, _pairs(g, (D, D + 1)), s, 1.0, "", "f")
    with pytest.raises(AdapterError, match="does not fit"):
        tc.build_carry(table, _pairs(g), s[:-1], 1.0, "", "f")
    with pytest.raises(AdapterError, match="not finite"):
        tc.build_carry(table, _pairs(g), s, float("nan"), "", "f")
    two = _pairs(g)
    two[1].target = two[0].target
    with pytest.raises(AdapterError, match="two AdaLN pairs"):
        tc.build_carry(table, two, s, 1.0, "", "f")
    assert "e.g. h3_silu_temb_grid.safetensors" in str(tc.refuse_missing_grid(_pairs(g), ROWS, "f"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_widened_weight_layout_and_curve_delta_noncontiguous(dtype):
    g = torch.Generator().manual_seed(3)
    pairs = _pairs(g)
    carry = tc.build_carry(torch.randn(ROWS, K), pairs, torch.randn(ROWS, D), 1.0, "", "f")
    key = pairs[1].target
    w = torch.randn(5, K).to(dtype)
    wide = tc.widened_weight(w, carry, key)
    assert wide.dtype == dtype and wide.shape == (5, K + 4)
    assert torch.equal(wide[:, :K], w) and not wide[:, K:K + 2].any()
    assert torch.equal(wide[:, K + 2:], carry.extra[key].to(dtype))
    with pytest.raises(AdapterError, match="carry expects"):
        tc.widened_weight(torch.randn(5, K + 1), carry, key)
    x = torch.randn(K + 4, 3).T          # non-contiguous t_emb
    d = tc.curve_delta(x, carry, key)
    assert torch.allclose(d.double(), x[:, K + 2:].double() @ carry.extra[key].double().T, atol=1e-6)
    other = torch.ones_like(carry.extra[key])        # the caller's copy is used when given
    assert torch.allclose(tc.curve_delta(x, carry, key, other).double(), x[:, K + 2:].double().sum(-1, keepdim=True)
                          .expand(-1, other.shape[0]), atol=1e-6)


def test_merge_carries_adds_the_deltas_and_keeps_columns_contiguous():
    g = torch.Generator().manual_seed(4)
    table = torch.randn(ROWS, K)
    s = torch.randn(ROWS, D)
    a = tc.build_carry(table, _pairs(g), s, 1.0, "A", "f")
    pb = _pairs(g, (D,), rank=3)                      # only block 0, rank 3
    b = tc.build_carry(table, pb, s, -2.0, "B", "f")
    a.entries = {"m": ("e1",)}
    b.entries = {"m": ("e2",), "n": ("e3",)}
    m = tc.merge_carries(a, b)
    assert m.table.shape == (ROWS, K + 4 + 3) and torch.equal(m.table[:, :K], table)
    k0, k1 = list(a.columns)
    assert m.columns == {k0: (K, K + 5), k1: (K + 5, K + 7)}
    assert m.entries == {"m": ("e1", "e2"), "n": ("e3",)} and m.grid_source == "A; then B"
    for key, parts in ((k0, [(a, k0), (b, pb[0].target)]), (k1, [(a, k1)])):
        want = sum(tc.curve_delta(c.table, c, kk).double() for c, kk in parts)     # each carry on its own table
        assert torch.allclose(tc.curve_delta(m.table, m, key).double(), want, atol=1e-5)
    other = tc.build_carry(table + 1, _pairs(g), s, 1.0, "C", "f")
    with pytest.raises(AdapterError, match="different bases"):
        tc.merge_carries(a, other)
    with pytest.raises(AdapterError, match="different bases"):
        tc.merge_carries(a, tc.build_carry(table[:, :2], _pairs(g), s, 1.0, "C", "f"))
