"""loaders/h3_turbo_curve.py, exactly: every refusal's whole text, both sides of the t_grid tolerance, the carry's
texts, dict and column layout, merge's order and modes, fuse / bypass results in every dtype.

Oracles written here: the texts each rule must say, C = S Aᵀ and s·B by hand, the host grid i / (rows - 1)."""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import AdapterError
from ditkit.loaders import h3_turbo_curve as tc
from ditkit.loaders.safetensors_io import save_file

ROWS, D, K = 5, 4, 3
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _te(g=None):
    g = g or torch.Generator().manual_seed(0)
    return {"time_embedder.proj_in.weight": torch.randn(3, 4, generator=g),
            "time_embedder.proj_in.bias": torch.randn(3, generator=g),
            "time_embedder.proj_out.weight": torch.randn(D, 3, generator=g),
            "time_embedder.proj_out.bias": torch.randn(D, generator=g)}


def _pair(i=0, rank=2, width=D, scale=0.5, g=None):
    g = g or torch.Generator().manual_seed(10 + i)
    return tc.CurvePair(f"lora_unet_blocks_{i}", [f"lora_unet_blocks_{i}.lora_down.weight"],
                        f"diffusion_model.blocks.{i}.adaln_proj.linear.weight", torch.randn(6, rank, generator=g),
                        torch.randn(rank, width, generator=g), scale, "alpha/rank")


def test_constants():
    assert (tc.GRID_KEY, tc.T_GRID_KEY, tc.T_GRID_TOL, tc.GRID_INPUT, tc.CKPT_INPUT) == \
        ("silu_t_emb_grid", "t_grid", 1e-6, "silu_t_emb_grid", "time_embedder_checkpoint")
    assert tc.TE_KEYS == ("time_embedder.proj_in.weight", "time_embedder.proj_in.bias",
                          "time_embedder.proj_out.weight", "time_embedder.proj_out.bias")
    assert tc.TE_PREFIXES == ("", "diffusion_model.", "model.diffusion_model.")


def test_host_grid():
    assert tc.host_grid(3).tolist() == [0.0, 0.5, 1.0] and tc.host_grid(3.0).dtype == torch.float64
    assert tc.host_grid(1).tolist() == [0.0]


def test_pair_describe():
    p = _pair(3, rank=2, scale=0.25)
    assert p.describe() == ("lora_unet_blocks_3 (AdaLN pair on silu(t_emb), rank 2) -> blocks.3.adaln_proj.linear.weight "
                            "as 2 curve columns (scale 0.25: alpha/rank)")


# ------------------------------------------------------------------------------------------------ tensors, grids

def test_float_tensor_texts():
    def refused(t, ndim, msg):
        with pytest.raises(AdapterError) as e:
            tc._float_tensor(t, "k", ndim, "W")
        assert str(e.value) == msg

    refused(torch.ones(2, dtype=torch.int64), 1, "W: 'k' must be a floating-point tensor, got torch.int64")
    refused([1.0], 1, "W: 'k' must be a floating-point tensor, got list")
    refused(torch.ones(2, 3), 1, "W: 'k' must be a non-empty 1-D tensor, got shape (2, 3)")
    refused(torch.ones(0, 3), 2, "W: 'k' must be a non-empty 2-D tensor, got shape (0, 3)")
    refused(torch.tensor([1.0, math.inf]), 1, "W: 'k' contains NaN or Inf values")
    refused(torch.tensor([math.nan]), 1, "W: 'k' contains NaN or Inf values")
    t = torch.ones(1, 1)
    assert tc._float_tensor(t, "k", 2, "W") is t


def test_time_embedder_texts():
    te = _te()
    for k in tc.TE_KEYS:
        with pytest.raises(AdapterError) as e:
            tc.silu_grid_from_time_embedder({x: v for x, v in te.items() if x != k}, ROWS, "W")
        assert str(e.value) == (f"W: no {k!r}: not an unpruned H3 checkpoint (the time embedder is what gives silu(t_emb) "
                                "on the grid); choose an unpruned file in 'time_embedder_checkpoint' or a grid file in "
                                "'silu_t_emb_grid'")
    with pytest.raises(AdapterError) as e:
        tc.silu_grid_from_time_embedder({}, ROWS, "W")
    assert "no 'time_embedder.proj_in.weight'" in str(e.value)
    bad = {"time_embedder.proj_in.weight": torch.ones(3, 3), "time_embedder.proj_in.bias": torch.ones(3),
           "time_embedder.proj_out.weight": torch.ones(D, 3), "time_embedder.proj_out.bias": torch.ones(D)}
    msg = ("W: time embedder shapes proj_in {} / {}, proj_out {} / {} do not chain (even frequency width needed)")
    for change, shapes in (({}, ((3, 3), (3,), (D, 3), (D,))),
                           ({"time_embedder.proj_in.weight": torch.ones(3, 4),
                             "time_embedder.proj_in.bias": torch.ones(2)}, ((3, 4), (2,), (D, 3), (D,))),
                           ({"time_embedder.proj_in.weight": torch.ones(3, 4),
                             "time_embedder.proj_out.weight": torch.ones(D, 2)}, ((3, 4), (3,), (D, 2), (D,))),
                           ({"time_embedder.proj_in.weight": torch.ones(3, 4),
                             "time_embedder.proj_out.bias": torch.ones(D + 1)}, ((3, 4), (3,), (D, 3), (D + 1,)))):
        with pytest.raises(AdapterError) as e:
            tc.silu_grid_from_time_embedder({**bad, **change}, ROWS, "W")
        assert str(e.value) == msg.format(*shapes)
    for k, n in zip(tc.TE_KEYS, (2, 1, 2, 1)):
        with pytest.raises(AdapterError) as e:
            tc.silu_grid_from_time_embedder({**te, k: torch.ones(*([2] * (n + 1)))}, ROWS, "W")
        assert str(e.value) == f"W: '{k}' must be a non-empty {n}-D tensor, got shape {tuple([2] * (n + 1))}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_time_embedder_grid_by_hand(dtype):
    te = {k: v.to(dtype) for k, v in _te().items()}
    got = tc.silu_grid_from_time_embedder(te, ROWS, "W")
    w1, b1, w2, b2 = (te[k].double() for k in tc.TE_KEYS)
    silu = lambda v: v / (1 + torch.exp(-v))
    for i in range(ROWS):
        t = i / (ROWS - 1)
        f = [math.exp(-math.log(10000.0) * j / 2) for j in range(2)]
        e = torch.tensor([math.cos(t * f[0]), math.cos(t * f[1]), math.sin(t * f[0]), math.sin(t * f[1])],
                         dtype=torch.float64)
        want = silu(w2 @ silu(w1 @ e + b1) + b2)
        assert torch.allclose(got[i], want, rtol=0, atol=1e-12)


def test_check_silu_grid_texts_and_tolerance():
    s = torch.randn(ROWS, D)
    with pytest.raises(AdapterError) as e:
        tc.check_silu_grid(torch.randn(ROWS + 1, D), ROWS, D, "W")
    assert str(e.value) == (f"W: 'silu_t_emb_grid' has shape ({ROWS + 1}, {D}), expected ({ROWS}, {D}): {ROWS} rows = "
                            f"the base's adaln_t_table grid, {D} columns = the LoRA's AdaLN lora_down width "
                            "(silu(t_emb)); a grid made for another base or model size")
    with pytest.raises(AdapterError) as e:
        tc.check_silu_grid(torch.ones(ROWS, D, dtype=torch.int32), ROWS, D, "W")
    assert str(e.value) == "W: 'silu_t_emb_grid' must be a floating-point tensor, got torch.int32"
    with pytest.raises(AdapterError) as e:
        tc.check_silu_grid(s, ROWS, D, "W", torch.linspace(0, 1, ROWS + 1))
    assert str(e.value) == f"W: 't_grid' has {ROWS + 1} points, the base's table {ROWS}"
    with pytest.raises(AdapterError) as e:
        tc.check_silu_grid(s, ROWS, D, "W", torch.ones(ROWS, 1))
    assert str(e.value) == f"W: 't_grid' must be a non-empty 1-D tensor, got shape ({ROWS}, 1)"
    t = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    at = t.clone()
    at[2] += 2 ** -20                                   # 9.5e-7: within
    assert torch.equal(tc.check_silu_grid(s, ROWS, D, "W", at), s.double())
    over = t.clone()
    over[3] += 2 ** -19                                 # 1.9e-6: beyond
    with pytest.raises(AdapterError) as e:
        tc.check_silu_grid(s, ROWS, D, "W", over)
    assert str(e.value) == (f"W: 't_grid' differs from the base's grid linspace(0, 1, {ROWS}) by 1.91e-06 (> 1e-06): "
                            "the rows were sampled at other model times")
    low = t.clone()
    low[0] = -1e-6                                      # |-1e-6 - 0| == 1e-6 exactly: not beyond
    assert torch.equal(tc.check_silu_grid(s, ROWS, D, "W", low), s.double())
    low[0] = -1.0000001e-6
    with pytest.raises(AdapterError, match="differs"):
        tc.check_silu_grid(s, ROWS, D, "W", low)
    # a float32 t_grid (as a file stores it) is compared in float64
    assert tc.check_silu_grid(s, ROWS, D, "W", t.float()).dtype == torch.float64


def test_read_time_embedder_order_and_texts(tmp_path):
    te = _te()
    other = {k: v + 1 for k, v in te.items()}
    p = tmp_path / "both.safetensors"
    save_file({k: v for k, v in te.items()} | {"diffusion_model." + k: v for k, v in other.items()}, p)
    got = tc.read_time_embedder(str(p), "W")
    assert all(torch.equal(got[k], te[k]) for k in tc.TE_KEYS)        # the bare prefix first
    p = tmp_path / "partial.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in te.items()} | {"diffusion_model." + tc.TE_KEYS[0]: te[tc.TE_KEYS[0]].clone()}, p)
    got = tc.read_time_embedder(str(p), "W")
    assert list(got) == list(tc.TE_KEYS) and all(torch.equal(got[k], te[k]) for k in tc.TE_KEYS)
    for name in ("adaln_t_table", "diffusion_model.adaln_t_table"):
        p = tmp_path / "pruned.safetensors"
        save_file({name: torch.ones(2, 2)}, p)
        with pytest.raises(AdapterError) as e:
            tc.read_time_embedder(str(p), "W")
        assert str(e.value) == ("W: this checkpoint is itself curve-form (pruned: adaln_t_table, no time embedder); "
                                "choose the UNPRUNED checkpoint of the same model in 'time_embedder_checkpoint'")
    p = tmp_path / "x.safetensors"
    save_file({"model.adaln_t_table": torch.ones(1)}, p)
    assert tc.read_time_embedder(str(p), "W") == {}


def test_read_grid_file_texts(tmp_path):
    s = torch.randn(ROWS, D)
    p = tmp_path / "g.safetensors"
    save_file({"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1), "d": torch.ones(1), "e": torch.ones(1)}, p)
    with pytest.raises(AdapterError) as e:
        tc.read_grid_file(str(p), ROWS, D, "W")
    assert str(e.value) == ("W: no 'silu_t_emb_grid' tensor (has ['a', 'b', 'c', 'd']): a silu(t_emb) grid file holds "
                            "'silu_t_emb_grid' [grid, D] and optionally 't_grid' [grid]")
    save_file({"silu_t_emb_grid": s, "z": torch.ones(1), "y": torch.ones(1), "x": torch.ones(1), "w": torch.ones(1),
               "v": torch.ones(1)}, p)
    with pytest.raises(AdapterError) as e:
        tc.read_grid_file(str(p), ROWS, D, "W")
    assert str(e.value) == "W: unexpected tensors ['v', 'w', 'x', 'y'] next to 'silu_t_emb_grid'"
    save_file({"silu_t_emb_grid": s}, p)
    with pytest.raises(AdapterError) as e:
        tc.read_grid_file(str(p), ROWS, D + 1, "W")
    assert str(e.value) == (f"W: 'silu_t_emb_grid' has shape ({ROWS}, {D}), expected ({ROWS}, {D + 1}): {ROWS} rows = "
                            f"the base's adaln_t_table grid, {D + 1} columns = the LoRA's AdaLN lora_down width "
                            "(silu(t_emb)); a grid made for another base or model size")
    assert torch.equal(tc.read_grid_file(str(p), ROWS, D, "W"), s.double())
    save_file({"silu_t_emb_grid": s, "t_grid": torch.linspace(0, 1, ROWS) + 1e-3}, p)
    with pytest.raises(AdapterError, match="'t_grid' differs"):
        tc.read_grid_file(str(p), ROWS, D, "W")


# ------------------------------------------------------------------------------------------------ carries

def test_refuse_missing_grid_text():
    e = tc.refuse_missing_grid([_pair(0, width=7), _pair(1)], 33, "lora.safetensors")
    assert isinstance(e, AdapterError)
    assert str(e) == (
        "lora.safetensors: key 'lora_unet_blocks_0.lora_down.weight' is an AdaLN pair of a Turbo / step-distillation "
        "LoRA: its factors act on the 7-wide silu(t_emb) space, but this base is curve-form (pruned: its AdaLN reads "
        "the adaln_t_table and has no time embedder). ditkit applies it exactly as extra curve columns once it has "
        "silu(t_emb) on the base's 33-point grid: choose a grid file (silu_t_emb_grid [33, 7], e.g. "
        "h3_silu_temb_grid.safetensors) in the DitKitAdapterLoader input 'silu_t_emb_grid', or the unpruned checkpoint "
        "of the same model (e.g. minimax_h3_fl2va_int8_convrot.safetensors) in 'time_embedder_checkpoint'; nothing "
        "was applied")


def test_build_carry_texts():
    table = torch.randn(ROWS, K)
    s = torch.randn(ROWS, D)
    with pytest.raises(AdapterError) as e:
        tc.build_carry(table, [_pair(0), _pair(1, width=D + 2), _pair(2, width=D + 1)], s, 1.0, "", "F")
    assert str(e.value) == f"F: the AdaLN pairs act on different widths {[D, D + 1, D + 2]}; one silu(t_emb) space"
    with pytest.raises(AdapterError) as e:
        tc.build_carry(table, [_pair(0)], s[:, :-1], 1.0, "", "F")
    assert str(e.value) == (f"F: silu(t_emb) grid ({ROWS}, {D - 1}) does not fit the base's table rows {ROWS} and the "
                            f"LoRA's width {D}")
    with pytest.raises(AdapterError) as e:
        tc.build_carry(table, [_pair(0)], s[:-1], 1.0, "", "F")
    assert "does not fit" in str(e.value)
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(AdapterError) as e:
            tc.build_carry(table, [_pair(0)], s, bad, "", "F")
        assert str(e.value) == f"F: strength {bad!r} is not finite"
    a, b = _pair(0), _pair(1)
    b.target = a.target
    with pytest.raises(AdapterError) as e:
        tc.build_carry(table, [a, b], s, 1.0, "", "F")
    assert str(e.value) == ("F: two AdaLN pairs on 'diffusion_model.blocks.0.adaln_proj.linear.weight' "
                            "('lora_unet_blocks_1.lora_down.weight')")


@pytest.mark.parametrize("dtype", DTYPES)
def test_build_carry_layout_texts_and_dict(dtype):
    table = torch.randn(ROWS, K).to(dtype)
    s = torch.randn(ROWS, D, dtype=torch.float64)
    pairs = [_pair(0, rank=2, scale=0.5), _pair(1, rank=3, scale=2.0)]
    pairs[0].up, pairs[0].down = pairs[0].up.to(dtype), pairs[0].down.to(dtype)
    c = tc.build_carry(table, pairs, s.to(dtype) if dtype != torch.float16 else s, 3, "grid file g", "F")
    assert c.table.dtype == torch.float32 and c.table.is_contiguous() and c.table.shape == (ROWS, K + 5)
    assert torch.equal(c.table[:, :K], table.float())
    sd = (s.to(dtype) if dtype != torch.float16 else s).double()
    for p, (c0, c1) in zip(pairs, [(K, K + 2), (K + 2, K + 5)]):
        assert c.columns[p.target] == (c0, c1)
        assert torch.equal(c.table[:, c0:c1], (sd @ p.down.double().T).float())
        assert torch.equal(c.extra[p.target], (3.0 * p.scale * p.up.double()).float())
        assert c.extra[p.target].dtype == torch.float32
    assert c.base_width == K and c.grid_source == "grid file g" and c.mode == "" and c.entries == {}
    assert c.lines == [f"{pairs[0].describe()}: table columns {K}:{K + 2}",
                       f"{pairs[1].describe()}: table columns {K + 2}:{K + 5}"]
    assert c.summary() == (f"Turbo AdaLN pairs on a curve-form base: 2 AdaLN layers carried as 5 extra curve columns "
                           f"(table {K} -> {K + 5} wide), silu(t_emb) from grid file g")
    assert c.as_dict() == {"grid_source": "grid file g", "base_width": K, "width": K + 5,
                           "columns": {p.target: list(v) for p, v in zip(pairs, [(K, K + 2), (K + 2, K + 5)])},
                           "lines": c.lines}


def test_widened_weight_and_curve_delta_exact():
    pairs = [_pair(0), _pair(1)]
    c = tc.build_carry(torch.randn(ROWS, K), pairs, torch.randn(ROWS, D), 1.0, "", "F")
    with pytest.raises(AdapterError) as e:
        tc.widened_weight(torch.randn(6, K + 1), c, pairs[0].target)
    assert str(e.value) == (f"'{pairs[0].target}' has shape (6, {K + 1}); the carry expects (6, {K})")
    with pytest.raises(AdapterError):
        tc.widened_weight(torch.randn(5, K), c, pairs[0].target)
    w = torch.randn(6, K, dtype=torch.float64)
    wide = tc.widened_weight(w, c, pairs[0].target)
    assert wide.dtype == torch.float64 and wide.shape == (6, K + 4)
    assert torch.equal(wide[:, :K], w) and torch.equal(wide[:, K:K + 2], c.extra[pairs[0].target].double())
    assert torch.equal(wide[:, K + 2:], torch.zeros(6, 2, dtype=torch.float64))
    x = torch.randn(2, 3, K + 4, dtype=torch.float64)
    d = tc.curve_delta(x, c, pairs[1].target)
    assert d.dtype == torch.float32 and d.shape == (2, 3, 6)
    assert torch.equal(d, x[..., K + 2:K + 4].float() @ c.extra[pairs[1].target].T)


def _carry(table, pairs, strength, src):
    return tc.build_carry(table, pairs, torch.ones(ROWS, D), strength, src, "F")


def test_merge_carries_order_modes_lines_and_texts():
    table = torch.randn(ROWS, K)
    a = _carry(table, [_pair(0), _pair(1)], 1.0, "A")
    b = _carry(table, [_pair(2, rank=1), _pair(0, rank=3, g=torch.Generator().manual_seed(99))], 2.0, "B")
    a.mode, b.mode = "fuse", ""
    a.entries = {"m1": ("a",), "m2": ("b",)}
    b.entries = {"m3": ("c",), "m1": ("d",)}
    m = tc.merge_carries(a, b)
    t0, t1, t2 = (f"diffusion_model.blocks.{i}.adaln_proj.linear.weight" for i in range(3))
    assert list(m.columns) == [t0, t1, t2]
    assert m.columns == {t0: (K, K + 5), t1: (K + 5, K + 7), t2: (K + 7, K + 8)}
    assert torch.equal(m.table, torch.cat([table, a.table[:, K:K + 2], b.table[:, K + 1:K + 4], a.table[:, K + 2:K + 4],
                                           b.table[:, K:K + 1]], dim=1))
    assert m.table.is_contiguous()
    assert torch.equal(m.extra[t0], torch.cat([a.extra[t0], b.extra[t0]], dim=1))
    assert torch.equal(m.extra[t1], a.extra[t1]) and torch.equal(m.extra[t2], b.extra[t2])
    assert m.lines == a.lines + b.lines and m.grid_source == "A; then B" and m.base_width == K
    assert m.mode == "fuse" and list(m.entries) == ["m1", "m2", "m3"]
    assert m.entries == {"m1": ("a", "d"), "m2": ("b",), "m3": ("c",)}
    b.mode = "bypass"
    assert tc.merge_carries(a, b).mode == "bypass"
    a.mode = ""
    assert tc.merge_carries(a, _carry(table, [_pair(1)], 1.0, "C")).mode == ""
    # refusals
    wide = _carry(torch.randn(ROWS, K + 1), [_pair(0)], 1.0, "W")
    with pytest.raises(AdapterError) as e:
        tc.merge_carries(a, wide)
    assert str(e.value) == (f"curve carries of different bases (table ({ROWS}, {K + 4}) with base width {K} vs "
                            f"({ROWS}, {K + 3}) with {K + 1})")
    rows = tc.build_carry(torch.randn(ROWS + 1, K), [_pair(0)], torch.ones(ROWS + 1, D), 1.0, "R", "F")
    with pytest.raises(AdapterError) as e:
        tc.merge_carries(a, rows)
    assert str(e.value) == (f"curve carries of different bases (table ({ROWS}, {K + 4}) with base width {K} vs "
                            f"({ROWS + 1}, {K + 2}) with {K})")
    with pytest.raises(AdapterError) as e:
        tc.merge_carries(a, _carry(table + 1, [_pair(0)], 1.0, "X"))
    assert str(e.value) == "curve carries of different bases (their adaln_t_table columns differ)"
