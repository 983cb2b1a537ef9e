"""Turbo-style LoRA (AdaLN pairs on silu(t_emb)) on the curve-form (pruned) H3 base, in the real host (CPU), issue
#30 item 3: the AdaLN pairs are carried as extra curve columns (``loaders/h3_turbo_curve.py``,
``bridge/turbo_curve.py``).

Oracle (float64, written here): the unpruned base's time embedder (cos before sin, t not x1000) at the host's grid
``t_i = i / (grid - 1)``, ``Δ_i = strength · alpha/rank · B (A silu(t_emb(t_i)))`` per AdaLN layer; the patched
AdaLN projection at grid row ``i`` minus the base's must equal ``Δ_i`` (<= 1e-6 of max |Δ|), and between rows the
host's lerp of the two rows' deltas.
"""
from __future__ import annotations

import math

import pytest
import torch

from ditkit.errors import AdapterError
from ditkit.loaders.safetensors_io import save_file
from ditkit.tiny import ckpt_h3 as c
from tests.support.quant_oracle import host_quantize_layer

STRENGTH = 0.9
ADALN = [f"blocks.{i}.adaln_proj" for i in range(c.CONFIG["num_layers"])] + ["final_layer.adaln_proj"]


def _silu_t_emb64(base, rows):
    cfg = c.CONFIG
    half = cfg["timestep_input_dim"] // 2
    t = torch.arange(rows, dtype=torch.float64) / (rows - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * (-math.log(10000.0) / half))
    emb = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=1)
    h = emb @ base["time_embedder.proj_in.weight"].double().T + base["time_embedder.proj_in.bias"].double()
    h = h * torch.sigmoid(h)
    e = h @ base["time_embedder.proj_out.weight"].double().T + base["time_embedder.proj_out.bias"].double()
    return e * torch.sigmoid(e)


def _oracle_delta(lora, mod, s):
    pre = f"diffusion_model.{mod}.linear."
    a, b = lora[pre + "lora_down.weight"].double(), lora[pre + "lora_up.weight"].double()
    scale = float(lora[pre + "alpha"]) / a.shape[0]
    return STRENGTH * scale * (s @ a.T) @ b.T                     # [rows, out]


def curve_base(fmt="float"):
    import comfy.sd

    sd = c.curve_state_dict(c.base_state_dict())
    if fmt == "int8_convrot":
        sd = c.comfy_quant_state_dict(sd, fmt, host_quantize_layer)
    return comfy.sd.load_diffusion_model_state_dict(sd)


@pytest.fixture
def files(tmp_path):
    base = c.base_state_dict()
    lora = tmp_path / "loras" / "minimax_h3_fl2v_turbo_tiny.safetensors"
    grid = tmp_path / "loras" / "h3_silu_temb_grid.safetensors"
    ckpt = tmp_path / "diffusion_models" / "h3_tiny_comfy.safetensors"
    lora.parent.mkdir()
    ckpt.parent.mkdir()
    save_file(c.turbo_lora_state_dict(), lora)
    save_file(c.silu_t_emb_grid_state_dict(base), grid)
    save_file(base, ckpt)
    return {"lora": str(lora), "grid": str(grid), "ckpt": str(ckpt), "dir": tmp_path, "base": base}


def _adaln_out(m, mod, x, injected):
    import comfy.utils

    p = comfy.utils.get_attr(m.model, "diffusion_model." + mod)
    if injected:
        for inj in m.injections.get("ditkit_turbo_curve", []):
            inj.inject(m)
    try:
        with torch.no_grad():
            return torch.cat(p(x), dim=-1).reshape(x.shape[0], -1).double()
    finally:
        if injected:
            for inj in m.injections.get("ditkit_turbo_curve", []):
                inj.eject(m)


def _patched(m, mode):
    """The model with its object patches applied (fuse: widened weights + table), run, then restored."""
    class _Ctx:
        def __enter__(self):
            import comfy.utils
            self.old = {k: comfy.utils.set_attr(m.model, k, v) for k, v in m.object_patches.items()}
            return m

        def __exit__(self, *exc):
            import comfy.utils
            for k, v in self.old.items():
                comfy.utils.set_attr(m.model, k, v)
    return _Ctx()


@pytest.mark.parametrize("source", ["grid", "ckpt"])
@pytest.mark.parametrize("mode", ["fuse", "bypass"])
@pytest.mark.parametrize("fmt", ["float", "int8_convrot"])
def test_turbo_on_curve_base_equals_unpruned_delta_at_every_grid_point(comfy, files, mode, source, fmt):
    from ditkit.nodes.adapters import apply_h3_adapter, report_text

    q = curve_base(fmt)
    base_table = q.model.diffusion_model.adaln_t_table.detach().clone()
    rows, k = base_table.shape
    kw = {"silu_grid": files["grid"]} if source == "grid" else {"time_embedder": files["ckpt"]}
    m, plan = apply_h3_adapter(q, files["lora"], STRENGTH, mode=mode, **kw)
    assert len(plan.curve) == len(ADALN)
    lora = c.turbo_lora_state_dict()
    s = _silu_t_emb64(files["base"], rows)
    mid_base = 0.5 * (base_table[:-1] + base_table[1:])
    base = {mod: (_base_out(q, mod, base_table), _base_out(q, mod, mid_base)) for mod in ADALN}   # before patching
    worst = 0.0
    with _patched(m, mode):
        table = m.model.diffusion_model.adaln_t_table
        assert table.shape == (rows, k + c.ADAPTER_RANK * len(ADALN))
        assert torch.equal(table[:, :k], base_table)
        for mod in ADALN:
            ref_delta = _oracle_delta(lora, mod, s)
            got = _adaln_out(m, mod, table, mode == "bypass") - base[mod][0]
            err = (got - ref_delta).abs().max().item() / ref_delta.abs().max().item()
            worst = max(worst, err)
            assert err <= 1e-6, (mod, err)
            mid = 0.5 * (table[:-1] + table[1:])          # between grid points: the host's lerp at frac 0.5
            gm = _adaln_out(m, mod, mid, mode == "bypass") - base[mod][1]
            rm = 0.5 * (ref_delta[:-1] + ref_delta[1:])
            assert (gm - rm).abs().max().item() <= 1e-6 * rm.abs().max().item()
    assert torch.equal(q.model.diffusion_model.adaln_t_table, base_table)   # the base untouched
    text = report_text(plan, "turbo", STRENGTH, None, "auto")
    assert "curve columns" in text and ("widened" in text) == (mode == "fuse")
    print(f"turbo curve {fmt} {mode} {source}: worst relative error {worst:.3g} over {rows} grid points")


def _base_out(q, mod, x):
    import comfy.utils

    with torch.no_grad():
        return torch.cat(comfy.utils.get_attr(q.model, "diffusion_model." + mod)(x), dim=-1).reshape(x.shape[0], -1).double()


def test_turbo_curve_matches_unpruned_base_plus_lora(comfy, files):
    """The whole AdaLN output vs the UNPRUNED base + LoRA evaluated at the grid: the difference is the base's own
    rank-8 curve truncation only (the same with and without the LoRA)."""
    from ditkit.nodes.adapters import apply_h3_adapter

    q = curve_base()
    m, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode="bypass", silu_grid=files["grid"])
    b = files["base"]
    rows = q.model.diffusion_model.adaln_t_table.shape[0]
    s = _silu_t_emb64(b, rows)
    lora = c.turbo_lora_state_dict()
    pruned = {mod: _base_out(q, mod, q.model.diffusion_model.adaln_t_table) for mod in ADALN}
    with _patched(m, "bypass"):
        table = m.model.diffusion_model.adaln_t_table
        for mod in ADALN:
            w, bias = b[f"{mod}.linear.weight"].double(), b[f"{mod}.linear.bias"].double()
            unpruned = s @ w.T + bias
            got = _adaln_out(m, mod, table, True)
            with_lora = got - (unpruned + _oracle_delta(lora, mod, s))
            without = pruned[mod] - unpruned
            assert (with_lora - without).abs().max().item() <= 1e-6 * unpruned.abs().max().item(), mod
            print(f"{mod}: |pruned+turbo - (unpruned+LoRA)| max {with_lora.abs().max().item():.3g} = the base's own "
                  f"curve truncation {without.abs().max().item():.3g}")


@pytest.mark.parametrize("mode", ["fuse", "bypass"])
def test_turbo_curve_samples_in_host(comfy, files, mode):
    """A 2-step KSampler run on the curve base with the carried LoRA: the host's own lerp reads the widened table;
    the sample moves, and the base samples as before afterwards."""
    import comfy.model_management

    from ditkit.nodes.adapters import apply_h3_adapter
    from tests.integration.test_h3_adapters_quant_host import _sample

    q = curve_base("int8_convrot")
    base0 = _sample(q)
    m, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode=mode, silu_grid=files["grid"])
    got = _sample(m)
    comfy.model_management.unload_all_models()
    base1 = _sample(q)
    comfy.model_management.unload_all_models()
    assert all(torch.equal(x, y) for x, y in zip(base0.unbind(), base1.unbind()))
    assert max((x - y).abs().max().item() for x, y in zip(got.unbind(), base0.unbind())) > 1e-3
    assert all(torch.isfinite(x).all() for x in got.unbind())


def test_turbo_curve_fuse_equals_bypass_in_sampling(comfy, files):
    import comfy.model_management

    from ditkit.nodes.adapters import apply_h3_adapter
    from tests.integration.test_h3_adapters_quant_host import _sample

    q = curve_base()
    f, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode="fuse", silu_grid=files["grid"])
    a = _sample(f)
    comfy.model_management.unload_all_models()
    b_, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode="bypass", silu_grid=files["grid"])
    b = _sample(b_)
    comfy.model_management.unload_all_models()
    err = max((x - y).abs().max().item() / y.abs().max().item() for x, y in zip(a.unbind(), b.unbind()))
    assert err <= 1e-5, err


def test_turbo_curve_modelsave_writes_a_loadable_curve_file(comfy, files, tmp_path):
    """Fuse mode: the saved file has the widened table and AdaLN weights, and the host loads it as a curve base
    whose AdaLN at every grid row equals the fused model's."""
    import comfy.model_management
    import comfy.sd

    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.adapters import apply_h3_adapter

    q = curve_base()
    m, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode="fuse", silu_grid=files["grid"])
    comfy.model_management.load_models_gpu([m])
    sd = m.model_state_dict(filter_prefix="diffusion_model.")
    sd = {k[len("diffusion_model."):]: v.detach().clone() for k, v in sd.items()}
    comfy.model_management.unload_all_models()
    width = sd["adaln_t_table"].shape[1]
    assert width == c.CURVE_RANK + c.ADAPTER_RANK * len(ADALN)
    assert all(sd[f"{mod}.linear.weight"].shape[1] == width for mod in ADALN)
    p = tmp_path / "saved.safetensors"
    save_file(sd, p)
    r = comfy.sd.load_diffusion_model_state_dict(load_file(p))
    table = r.model.diffusion_model.adaln_t_table
    with _patched(m, "fuse"):
        for mod in ADALN:
            assert torch.equal(_base_out(r, mod, table), _adaln_out(m, mod, table, False))


# ------------------------------------------------------------------ bad input: named errors, base untouched
def _untouched(q):
    assert not q.patches and not q.object_patches and not q.injections and not q.get_attachment("ditkit_turbo_curve")


@pytest.mark.parametrize("mode", ["fuse", "bypass"])
def test_no_grid_refused_naming_the_file_to_supply(comfy, files, mode):
    from ditkit.nodes.adapters import apply_h3_adapter

    q = curve_base("int8_convrot")
    with pytest.raises(AdapterError, match=r"'diffusion_model\.blocks\.0\.adaln_proj\.linear\.lora_down\.weight' is an "
                                           r"AdaLN pair of a Turbo.*32-wide silu\(t_emb\).*65-point grid.*silu_t_emb_grid "
                                           r"\[65, 32\].*h3_silu_temb_grid\.safetensors.*'silu_t_emb_grid'.*unpruned "
                                           r"checkpoint.*'time_embedder_checkpoint'"):
        apply_h3_adapter(q, files["lora"], 1.0, mode=mode)
    _untouched(q)


def _grid(files, name, **sd):
    p = files["dir"] / "loras" / name
    save_file(sd, p)
    return str(p)


@pytest.mark.parametrize("case,match", [
    ("rows", r"'silu_t_emb_grid' has shape \(64, 32\), expected \(65, 32\)"),
    ("rows_plus", r"'silu_t_emb_grid' has shape \(66, 32\), expected \(65, 32\)"),
    ("width", r"'silu_t_emb_grid' has shape \(65, 31\), expected \(65, 32\)"),
    ("nan", r"'silu_t_emb_grid' contains NaN or Inf"),
    ("inf", r"'silu_t_emb_grid' contains NaN or Inf"),
    ("int", r"'silu_t_emb_grid' must be a floating-point tensor"),
    ("t_grid", r"'t_grid' differs from the base's grid linspace\(0, 1, 65\)"),
    ("t_grid_len", r"'t_grid' has 64 points"),
    ("t_grid_nan", r"'t_grid' contains NaN"),
    ("no_key", r"no 'silu_t_emb_grid' tensor"),
    ("extra", r"unexpected tensors \['other'\]"),
])
def test_bad_grid_file_refused_by_name_base_untouched(comfy, files, case, match):
    from ditkit.nodes.adapters import apply_h3_adapter

    g = c.silu_t_emb_grid_state_dict(files["base"])
    s, t = g["silu_t_emb_grid"], g["t_grid"]
    bad = {"rows": {"silu_t_emb_grid": s[:64].contiguous()},
           "rows_plus": {"silu_t_emb_grid": torch.cat([s, s[-1:]]).contiguous()},
           "width": {"silu_t_emb_grid": s[:, :31].contiguous()},
           "nan": {"silu_t_emb_grid": s.clone().index_fill_(0, torch.tensor([3]), float("nan"))},
           "inf": {"silu_t_emb_grid": s.clone().index_fill_(0, torch.tensor([64]), float("inf"))},
           "int": {"silu_t_emb_grid": s.to(torch.int32)},
           "t_grid": {"silu_t_emb_grid": s, "t_grid": t.flip(0).contiguous()},
           "t_grid_len": {"silu_t_emb_grid": s, "t_grid": t[:64].contiguous()},
           "t_grid_nan": {"silu_t_emb_grid": s, "t_grid": t.clone().index_fill_(0, torch.tensor([1]), float("nan"))},
           "no_key": {"grid": s},
           "extra": {"silu_t_emb_grid": s, "other": t}}[case]
    q = curve_base()
    with pytest.raises(AdapterError, match=match):
        apply_h3_adapter(q, files["lora"], 1.0, mode="bypass", silu_grid=_grid(files, f"bad_{case}.safetensors", **bad))
    _untouched(q)


def test_t_grid_boundary_and_dtypes_accepted(comfy, files):
    """t_grid off by 1e-6 is accepted (the tolerance), 3e-6 refused; bf16 / fp16 / fp64 grids are read."""
    from ditkit.nodes.adapters import apply_h3_adapter

    g = c.silu_t_emb_grid_state_dict(files["base"])
    s = g["silu_t_emb_grid"]
    t64 = torch.linspace(0, 1, 65, dtype=torch.float64)
    q = curve_base()
    apply_h3_adapter(q, files["lora"], 1.0, mode="bypass",
                     silu_grid=_grid(files, "ok.safetensors", silu_t_emb_grid=s, t_grid=t64 + 0.9e-6))
    with pytest.raises(AdapterError, match="t_grid"):
        apply_h3_adapter(q, files["lora"], 1.0, mode="bypass",
                         silu_grid=_grid(files, "off.safetensors", silu_t_emb_grid=s, t_grid=t64 + 3e-6))
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        m, plan = apply_h3_adapter(q, files["lora"], 1.0, mode="bypass",
                                   silu_grid=_grid(files, f"g_{dt}.safetensors", silu_t_emb_grid=s.to(dt)))
        assert len(plan.curve) == len(ADALN)
    _untouched(q)


def test_pruned_checkpoint_as_time_embedder_refused(comfy, files, tmp_path):
    from ditkit.nodes.adapters import apply_h3_adapter

    p = tmp_path / "pruned.safetensors"
    save_file(c.curve_state_dict(files["base"]), p)
    q = curve_base()
    with pytest.raises(AdapterError, match=r"itself curve-form.*UNPRUNED checkpoint.*'time_embedder_checkpoint'"):
        apply_h3_adapter(q, files["lora"], 1.0, mode="fuse", time_embedder=str(p))
    other = dict(files["base"])
    other["time_embedder.proj_out.weight"] = other["time_embedder.proj_out.weight"][:16].contiguous()
    other["time_embedder.proj_out.bias"] = other["time_embedder.proj_out.bias"][:16].contiguous()
    p2 = tmp_path / "other.safetensors"
    save_file(other, p2)
    with pytest.raises(AdapterError, match=r"gives silu\(t_emb\) 16 wide, the LoRA's AdaLN pairs act on 32"):
        apply_h3_adapter(q, files["lora"], 1.0, mode="fuse", time_embedder=str(p2))
    with pytest.raises(AdapterError, match=r"both 'silu_t_emb_grid'.*and 'time_embedder_checkpoint'"):
        apply_h3_adapter(q, files["lora"], 1.0, silu_grid=files["grid"], time_embedder=files["ckpt"])
    _untouched(q)


@pytest.mark.parametrize("mode", ["fuse", "bypass"])
def test_two_turbo_loras_stack_their_deltas(comfy, files, tmp_path, mode):
    """A second Turbo LoRA on the carried model (same mode) merges into the carry: at every grid point the AdaLN
    output is the base's plus both unpruned deltas; the other mode is refused naming it; the base untouched."""
    import comfy.model_management

    from ditkit.nodes.adapters import apply_h3_adapter
    from tests.integration.test_h3_adapters_quant_host import _sample

    second = c.turbo_lora_state_dict(seed=c.SEED + 31)
    p2 = tmp_path / "turbo2.safetensors"
    save_file(second, p2)
    q = curve_base()
    base_table = q.model.diffusion_model.adaln_t_table.detach().clone()
    base = {mod: _base_out(q, mod, base_table) for mod in ADALN}
    m1, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode=mode, silu_grid=files["grid"])
    m2, plan = apply_h3_adapter(m1, str(p2), -0.5, mode=mode, time_embedder=files["ckpt"])
    assert "then the time embedder" in plan.notes[-1] or any("then the time embedder" in n for n in plan.notes)
    s = _silu_t_emb64(files["base"], base_table.shape[0])
    with _patched(m2, mode):
        table = m2.model.diffusion_model.adaln_t_table
        assert table.shape[1] == base_table.shape[1] + 2 * c.ADAPTER_RANK * len(ADALN)
        for mod in ADALN:
            got = _adaln_out(m2, mod, table, mode == "bypass") - base[mod]
            ref = _oracle_delta(c.turbo_lora_state_dict(), mod, s) + (-0.5 / STRENGTH) * _oracle_delta(second, mod, s)
            assert (got - ref).abs().max().item() <= 1e-6 * ref.abs().max().item(), mod
    other = "bypass" if mode == "fuse" else "fuse"
    with pytest.raises(AdapterError, match=rf"already carries Turbo AdaLN curve columns in mode {mode}.*Set 'mode' "
                                           rf"to {mode}"):
        apply_h3_adapter(m1, str(p2), 1.0, mode=other, silu_grid=files["grid"])
    out = _sample(m2)
    comfy.model_management.unload_all_models()
    assert all(torch.isfinite(x).all() for x in out.unbind())
    _untouched(q)
    assert "diffusion_model.adaln_t_table" in m1.object_patches


def test_grid_given_without_turbo_pairs_is_reported_unused(comfy, files, tmp_path):
    from ditkit.nodes.adapters import apply_h3_adapter

    p = tmp_path / "noadaln.safetensors"
    save_file(c.turbo_lora_state_dict(adaln=False), p)
    m, plan = apply_h3_adapter(curve_base(), str(p), 1.0, mode="bypass", silu_grid=files["grid"])
    assert not plan.curve and any("unused" in n and "no Turbo AdaLN pair" in n for n in plan.notes)


def test_curve_contract_probe_holds(comfy):
    from ditkit.bridge import turbo_curve

    assert turbo_curve._curve_contract().state == "holds"


def test_lightx2v_layout_without_alpha_needs_the_scale_input(comfy, tmp_path):
    """Diffusers names + PEFT '.default.' + no alpha (lightx2v Turbo v0.1): refused naming 'scale' (its reference
    uses alpha 8, not rank); with scale 8/128 it applies that scale."""
    import comfy.sd

    from ditkit.nodes.adapters import apply_h3_adapter

    g = torch.Generator().manual_seed(5)
    mod = "transformer_blocks.0.attn.to_out.0"
    o, n = c.CONFIG["hidden_size"], c.inner_dim()
    sd = {f"{mod}.lora_A.default.weight": torch.randn(128, n, generator=g),
          f"{mod}.lora_B.default.weight": torch.randn(o, 128, generator=g)}
    p = tmp_path / "minimax_h3_fl2v_turbo_4step_v0.1.safetensors"
    save_file(sd, p)
    q = comfy.sd.load_diffusion_model_state_dict(c.base_state_dict())
    with pytest.raises(AdapterError, match=r"does not determine the scale.*lightx2v.*lora_alpha 8.*'scale' input"):
        apply_h3_adapter(q, str(p), 1.0)
    _untouched(q)
    _, plan = apply_h3_adapter(q, str(p), 1.0, scale=8 / 128)
    assert plan.items[0].scale == 8 / 128
    meta = tmp_path / "with_meta.safetensors"
    save_file(sd, meta, metadata={"alpha": "8"})
    _, plan = apply_h3_adapter(q, str(meta), 1.0)
    assert plan.items[0].scale == 8 / 128


@pytest.mark.parametrize("mode", ["fuse", "bypass"])
def test_turbo_curve_under_adaln_cache_samples_the_same(comfy, files, mode):
    """DitKitH3AdaLNCache replaces every adaln_proj with its lookup module, which calls the same linear: the carry
    (widened weight / linear hook) reaches it, and the cached run samples exactly as the uncached one."""
    import comfy.model_management

    from ditkit.nodes.adapters import apply_h3_adapter
    from ditkit.nodes.adaln_cache import DitKitH3AdaLNCache
    from tests.integration.test_h3_adapters_quant_host import _sample

    q = curve_base()
    m, _ = apply_h3_adapter(q, files["lora"], STRENGTH, mode=mode, silu_grid=files["grid"])
    ref = _sample(m)
    comfy.model_management.unload_all_models()
    got = _sample(DitKitH3AdaLNCache.execute(m, True).result[0])
    comfy.model_management.unload_all_models()
    assert all(torch.equal(x, y) for x, y in zip(got.unbind(), ref.unbind()))


def test_other_deltas_on_a_carried_linear_share_its_hook(comfy, files, tmp_path):
    """A '.diff' on a carried AdaLN weight in the same file runs inside the curve hook (one forward wrapper per
    linear); a later bypass loader on a carried linear is refused; every forward is the class's own after eject."""
    import comfy.model_management

    from ditkit.nodes.adapters import apply_h3_adapter
    from tests.integration.test_h3_adapters_quant_host import _sample

    q = curve_base()
    k = q.model.diffusion_model.adaln_t_table.shape[1]
    mod = "blocks.1.adaln_proj"
    out = q.model.diffusion_model.blocks[1].adaln_proj.linear.weight.shape[0]
    d = torch.randn(out, k, generator=torch.Generator().manual_seed(3)) / 8
    sd = c.turbo_lora_state_dict()
    sd[f"diffusion_model.{mod}.linear.diff"] = d
    p = tmp_path / "turbo_diff.safetensors"
    save_file(sd, p)
    base_table = q.model.diffusion_model.adaln_t_table.detach().clone()
    base = _base_out(q, mod, base_table)
    m, plan = apply_h3_adapter(q, str(p), STRENGTH, mode="bypass", silu_grid=files["grid"])
    assert any("other delta(s) in the curve hook" in n for n in plan.notes)
    s = _silu_t_emb64(files["base"], base_table.shape[0])
    with _patched(m, "bypass"):
        got = _adaln_out(m, mod, m.model.diffusion_model.adaln_t_table, True) - base
    ref = _oracle_delta(c.turbo_lora_state_dict(), mod, s) + STRENGTH * base_table.double() @ d.double().T
    assert (got - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    only = tmp_path / "diff_only.safetensors"
    save_file({f"diffusion_model.{mod}.linear.diff": d}, only)
    with pytest.raises(AdapterError, match=r"'diffusion_model\.blocks\.1\.adaln_proj\.linear\.weight' carries Turbo "
                                           r"curve columns in bypass mode.*Put 'diff_only\.safetensors' before"):
        apply_h3_adapter(m, str(only), 1.0, mode="bypass")
    _sample(m)
    comfy.model_management.unload_all_models()
    for module in q.model.modules():
        f = vars(module).get("forward")
        assert f is None or (getattr(f, "__func__", None) is type(module).forward and f.__self__ is module), module
