"""LoKr core: parsing every writer's naming, mapping onto ComfyUI's fused Z-Image / FLUX.2 weights, exactness
against an independent float64 oracle, and bad input.

The oracle rebuilds ΔW from the raw file tensors in float64 with an explicit outer-product Kronecker
(no torch.kron, no ditkit code) and the scale the test itself chose when it wrote the module.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from ditkit.errors import AdapterError, UnsupportedModelError
from ditkit.loaders import lokr_apply as core
from ditkit.loaders.lokr_math import factorization
from ditkit.tiny import ckpt_image as ci

G = torch.Generator().manual_seed(1234)


def shapes_of(fam: str) -> dict[str, tuple[int, ...]]:
    s = ci.zimage_shapes() if fam == "zimage" else ci.flux2_shapes()
    return {f"diffusion_model.{k.replace('.scale', '.weight')}": v for k, v in s.items()}


def base_weights(shapes, keys) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(shapes[k], generator=g) for k in sorted(set(keys))}


def kron64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def oracle_delta(f: dict) -> torch.Tensor:
    w1 = f["lokr_w1"].double() if "lokr_w1" in f else f["lokr_w1_a"].double() @ f["lokr_w1_b"].double()
    if "lokr_w2" in f:
        w2 = f["lokr_w2"].double()
    elif "lokr_t2" in f:  # 2-D Tucker core: w2[p, r] = sum_ij t2[i, j] a[i, p] b[j, r]
        t2, a, b = f["lokr_t2"].double(), f["lokr_w2_a"].double(), f["lokr_w2_b"].double()
        w2 = a.T @ t2 @ b
    else:
        w2 = f["lokr_w2_a"].double() @ f["lokr_w2_b"].double()
    return kron64(w1, w2)


def make_module(out_f, in_f, kind: str, factor: int, rank=4, alpha=2.0, dtype=torch.float32):
    """Returns (suffix -> tensor, expected LyCORIS scale)."""
    out_l, out_k = factorization(out_f, factor)
    in_m, in_n = factorization(in_f, factor)
    r = lambda *s: (torch.randn(*s, generator=G) * 0.1).to(dtype)  # noqa: E731
    f: dict[str, torch.Tensor] = {}
    if kind == "full":
        f = {"lokr_w1": r(out_l, in_m), "lokr_w2": r(out_k, in_n), "alpha": torch.tensor(1e10)}
        return f, 1.0
    if kind == "w2lr":
        f = {"lokr_w1": r(out_l, in_m), "lokr_w2_a": r(out_k, rank), "lokr_w2_b": r(rank, in_n), "alpha": torch.tensor(alpha)}
    elif kind == "both":
        f = {"lokr_w1_a": r(out_l, rank), "lokr_w1_b": r(rank, in_m), "lokr_w2_a": r(out_k, rank),
             "lokr_w2_b": r(rank, in_n), "alpha": torch.tensor(alpha)}
    elif kind == "tucker":
        f = {"lokr_w1": r(out_l, in_m), "lokr_w2_a": r(rank, out_k), "lokr_w2_b": r(rank, in_n),
             "lokr_t2": r(rank, rank), "alpha": torch.tensor(alpha)}
    return f, alpha / rank


def name_for(fmt: str, fam: str, dotted: str) -> str:
    u = dotted.replace(".", "_")
    return {"lycoris": f"lycoris_{u}", "kohya": f"lora_unet_{u}", "musubi": f"lora_unet_{u}",
            "onetrainer": f"lora_transformer_{u}", "peft": f"base_model.model.{dotted}",
            "aitoolkit": f"diffusion_model.{dotted}", "simpletuner": f"transformer.{dotted}", "bare": dotted}[fmt]


# module names per model: (adapter name, comfy weight, row range or None, naming family)
def zimage_modules():
    d = ci.ZIMAGE["dim"]
    return [
        ("layers.0.attention.to_q", "layers.0.attention.qkv", (0, d)),
        ("layers.0.attention.to_k", "layers.0.attention.qkv", (d, 2 * d)),
        ("layers.0.attention.to_v", "layers.0.attention.qkv", (2 * d, 3 * d)),
        ("layers.1.attention.qkv", "layers.1.attention.qkv", None),  # fused (ComfyUI TrainLora / kohya)
        ("noise_refiner.0.attention.to_out.0", "noise_refiner.0.attention.out", None),
        ("context_refiner.1.feed_forward.w2", "context_refiner.1.feed_forward.w2", None),
        ("layers.1.adaLN_modulation.0", "layers.1.adaLN_modulation.0", None),
        ("all_final_layer.2-1.linear", "final_layer.linear", None),
    ]


def flux2_modules():
    h = ci.FLUX2["hidden"]
    return [
        ("transformer_blocks.0.attn.to_q", "double_blocks.0.img_attn.qkv", (0, h)),
        ("transformer_blocks.0.attn.add_v_proj", "double_blocks.0.txt_attn.qkv", (2 * h, 3 * h)),
        ("double_blocks.1.img_attn.qkv", "double_blocks.1.img_attn.qkv", None),  # BFL fused
        ("single_blocks.0.linear1", "single_blocks.0.linear1", None),            # BFL fused q,k,v,mlp
        ("single_transformer_blocks.1.attn.to_k", "single_blocks.1.linear1", (h, 2 * h)),
        ("single_transformer_blocks.1.proj_mlp", "single_blocks.1.linear1", (3 * h, 9 * h)),  # FLUX.2: 6h
        ("single_transformer_blocks.0.attn.to_out", "single_blocks.0.linear2", None),
        ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin", None),
        ("single_stream_modulation.linear", "single_stream_modulation.lin", None),
        ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer", None),
        ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer", None),
        ("transformer_blocks.1.ff_context.linear_in", "double_blocks.1.txt_mlp.0", None),
    ]


DIFFUSERS_ONLY = ("lycoris", "onetrainer", "simpletuner", "bare", "peft")
FORMATS = ["lycoris", "kohya", "musubi", "onetrainer", "peft", "aitoolkit", "simpletuner", "bare"]
KINDS = ["full", "w2lr", "both", "tucker"]


def build_file(fam, fmt, kinds, factors):
    """An adapter state dict + the test's own expectation list [(weight_key, rows, delta64 * scale)]."""
    shapes = shapes_of(fam)
    mods = zimage_modules() if fam == "zimage" else flux2_modules()
    sd: dict[str, torch.Tensor] = {}
    expect = []
    for i, (name, comfy, rows) in enumerate(mods):
        native = name == comfy or name.endswith("linear1_qkv")
        bfl_only = name.startswith(("double_blocks", "single_blocks")) or name == "layers.1.attention.qkv"
        if fmt == "kohya" and not native:
            continue  # kohya/ComfyUI naming = ComfyUI (BFL) module paths
        if fmt in DIFFUSERS_ONLY and bfl_only:
            continue  # diffusers-naming writers only write diffusers module names
        wk = f"diffusion_model.{comfy}.weight"
        o, n = shapes[wk]
        if rows is not None:
            o = rows[1] - rows[0]
        kind = kinds[i % len(kinds)]
        f, scale = make_module(o, n, kind, factors[i % len(factors)])
        if fmt == "musubi" and kind == "full":
            # musubi-tuner PR #901 (the writer of 'lokr_factor'): a full w2 is scaled alpha / max(w2.shape)
            f["alpha"] = torch.tensor(3.0)
            scale = 3.0 / max(f["lokr_w2"].shape)
        key = name_for(fmt, fam, name)
        for suf, t in f.items():
            if fmt == "peft" and suf == "alpha":
                continue
            sd[f"{key}.{suf}"] = t
        if fmt == "peft":
            scale = 8.0 / 4.0  # config alpha 8, r 4: PEFT scales alpha/r always (also full-rank)
        expect.append((wk, rows, oracle_delta(f) * scale))
    if fmt == "musubi":
        sd["lokr_factor"] = torch.tensor(factors[0], dtype=torch.int64)  # network buffer, no module prefix
    return sd, expect


def apply_core(plan, base, strength):
    out = {k: v.clone() for k, v in base.items()}
    for it in plan.items:
        d = core.module_delta(it) * strength
        t = it.target
        if t.rows is None:
            out[t.weight_key] += d
        else:
            out[t.weight_key][t.rows[0]:t.rows[1]] += d
    return out


def expected(base, expect, strength):
    out = {k: v.double().clone() for k, v in base.items()}
    for wk, rows, d in expect:
        if rows is None:
            out[wk] += strength * d
        else:
            out[wk][rows[0]:rows[1]] += strength * d
    return out


def max_rel(got: dict, ref: dict) -> float:
    worst = 0.0
    for k in ref:
        err = (got[k].double() - ref[k]).abs().max().item()
        worst = max(worst, err / max(ref[k].abs().max().item(), 1e-30))
    return worst


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("factors", [(8, 16), (-1,), (3, 6)], ids=["pow2-misaligned", "factor-1", "aligned"])
def test_exact_every_format(fam, fmt, factors):
    sd, expect = build_file(fam, fmt, KINDS, factors)
    assert expect, "test built no modules"
    peft_cfg = {"r": 4, "alpha": 8} if fmt == "peft" else None
    parsed = core.parse_lokr(sd, peft_config=peft_cfg)
    shapes = shapes_of(fam)
    plan = core.plan(parsed, shapes)
    assert set(plan.unused) == set(), plan.unused
    assert not plan.refused
    assert len(plan.items) == len(expect)
    base = base_weights(shapes, [wk for wk, _, _ in expect])
    got = apply_core(plan, base, 0.75)
    ref = expected(base, expect, 0.75)
    assert max_rel(got, ref) <= 1e-6
    if fmt == "musubi":
        assert any("lokr_factor" in n and "#901" in n for n in plan.notes)


def test_writer_detection():
    assert core.detect_writer(["lycoris_layers_0_attention_to_q.lokr_w1"]) == "lycoris"
    assert core.detect_writer(["lora_unet_x.lokr_w1", "lokr_factor"]) == "musubi-tuner"
    assert core.detect_writer(["lora_unet_x.lokr_w1", "lora_unet_x.alpha"]) == "kohya/musubi-tuner"
    assert core.detect_writer(["base_model.model.x.lokr_w1"]) == "peft"
    assert core.detect_writer(["lora_transformer_x.lokr_w1"]) == "onetrainer"


def test_alignment_of_the_factor_shapes_used():
    """The exactness suite covers both cases: a power-of-two factor on fused qkv splits q/k/v inside a
    Kronecker row block (misaligned: no single-LoKr slice exists), factor -1 / 3 give aligned blocks."""
    d = ci.ZIMAGE["dim"]
    out_l, out_k = factorization(3 * d, 8)
    assert d % out_k != 0  # misaligned
    assert d % factorization(3 * d, -1)[1] == 0 and d % factorization(3 * d, 3)[1] == 0  # aligned
    h = ci.FLUX2["hidden"]
    assert h % factorization(9 * h, 16)[1] != 0


def test_conv_tucker_delta_exact():
    """Tucker (lokr_t2) on a conv-shaped weight (LyCORIS layout) — core math vs float64 einsum oracle."""
    from ditkit.loaders.lokr_math import delta_weight

    r, out_k, in_n, k = 3, 4, 6, 3
    f = {"lokr_w1": torch.randn(2, 2, generator=G), "lokr_w2_a": torch.randn(r, out_k, generator=G),
         "lokr_w2_b": torch.randn(r, in_n, generator=G), "lokr_t2": torch.randn(r, r, k, k, generator=G)}
    # make t2 non-contiguous like a transposed checkpoint tensor (torch.kron fails on those in torch 2.14)
    f["lokr_t2"] = f["lokr_t2"].transpose(2, 3).contiguous().transpose(2, 3)
    got = delta_weight(f, (8, 12, k, k), 0.5)
    t2, a, b = (f[x].double() for x in ("lokr_t2", "lokr_w2_a", "lokr_w2_b"))
    w2 = torch.zeros(out_k, in_n, k, k, dtype=torch.float64)
    for i in range(r):
        for j in range(r):
            w2 += t2[i, j][None, None] * (a[i][:, None] * b[j][None, :])[:, :, None, None]
    w1 = f["lokr_w1"].double()
    ref = (w1[:, None, :, None, None, None] * w2[None, :, None, :, :, :]).reshape(8, 12, k, k) * 0.5
    assert (got.double() - ref).abs().max().item() / ref.abs().max().item() <= 1e-6


def test_norm_out_swap_and_global_modulation():
    shapes = shapes_of("flux2")
    h = ci.FLUX2["hidden"]
    f, _ = make_module(2 * h, h, "full", 8)
    sd = {f"transformer.norm_out.linear.{k}": v for k, v in f.items()}
    plan = core.plan(core.parse_lokr(sd), shapes)
    (it,) = plan.items
    assert it.target.weight_key == "diffusion_model.final_layer.adaLN_modulation.1.weight"
    d = core.module_delta(it).double()
    ref = oracle_delta(f)
    assert torch.allclose(d[:h], ref[h:], rtol=1e-6, atol=1e-9) and torch.allclose(d[h:], ref[:h], rtol=1e-6, atol=1e-9)


def test_proj_mlp_uses_flux2_width():
    tm = core.build_targets(shapes_of("flux2"))
    h = ci.FLUX2["hidden"]
    t = tm.names["single_transformer_blocks.0.proj_mlp"]
    assert t.rows == (3 * h, 9 * h) and t.shape == (6 * h, h)


def test_scale_rules():
    out, inn = 64, 32
    full, _ = make_module(out, inn, "full", 8)
    lr, _ = make_module(out, inn, "w2lr", 8, rank=4, alpha=2.0)
    sd = {f"lycoris_a.{k}": v for k, v in full.items()} | {f"lycoris_b.{k}": v for k, v in lr.items()}
    p = core.parse_lokr(sd)
    assert p.modules["lycoris_a"].scale == 1.0  # ai-toolkit 1e10 placeholder ignored
    assert p.modules["lycoris_b"].scale == 0.5


# ---------------------------------------------------------------------------------------------- bad input
def _one(fam="zimage", **kw):
    d = ci.ZIMAGE["dim"]
    f, _ = make_module(d, d, "w2lr", 8, **kw)
    return {f"diffusion_model.layers.0.attention.to_q.{k}": v for k, v in f.items()}


def test_shape_mismatch_names_key():
    f, _ = make_module(2 * ci.ZIMAGE["dim"], ci.ZIMAGE["dim"], "full", 8)
    sd = {f"diffusion_model.layers.0.attention.to_q.{k}": v for k, v in f.items()}
    with pytest.raises(AdapterError, match=r"diffusion_model\.layers\.0\.attention\.to_q.*shape"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))


def test_other_family_is_error():
    f, _ = make_module(320, 320, "full", 8)
    sd = {f"lora_unet_down_blocks_0_attentions_0_proj_in.{k}": v for k, v in f.items()}
    with pytest.raises(AdapterError, match="no LoKr module applies.*UNet"):
        core.plan(core.parse_lokr(sd), shapes_of("flux2"))
    # a FLUX.2 adapter on Z-Image
    sd, _ = build_file("flux2", "aitoolkit", ["full"], (8,))
    with pytest.raises(AdapterError, match="FLUX"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))


def test_nan_inf_names_key():
    sd = _one()
    sd["diffusion_model.layers.0.attention.to_q.lokr_w2_b"][0, 0] = float("nan")
    with pytest.raises(AdapterError, match=r"to_q\.lokr_w2_b.*NaN"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))
    sd = _one()
    sd["diffusion_model.layers.0.attention.to_q.lokr_w1"][0, 0] = float("inf")
    with pytest.raises(AdapterError, match=r"to_q\.lokr_w1.*Inf"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))


def test_alpha_zero_names_key():
    sd = _one()
    sd["diffusion_model.layers.0.attention.to_q.alpha"] = torch.tensor(0.0)
    with pytest.raises(AdapterError, match=r"to_q\.alpha"):
        core.parse_lokr(sd)


def test_dora_refused_by_name_and_all_refused_is_error():
    sd = _one()
    sd["diffusion_model.layers.0.attention.to_q.dora_scale"] = torch.ones(ci.ZIMAGE["dim"], 1)
    with pytest.raises(AdapterError, match="DoRA"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))
    ok, _ = build_file("zimage", "aitoolkit", ["full"], (8,))
    plan = core.plan(core.parse_lokr(ok | sd), shapes_of("zimage"))
    assert "diffusion_model.layers.0.attention.to_q" in plan.refused
    assert "DoRA" in plan.refused["diffusion_model.layers.0.attention.to_q"]


def test_unknown_keys_reported_with_reason():
    ok, _ = build_file("zimage", "aitoolkit", ["full"], (8,))
    ok["diffusion_model.layers.0.attention.to_q.lora_down.weight"] = torch.zeros(4, 4)
    f, _ = make_module(64, 64, "full", 8)
    ok |= {f"diffusion_model.not_a_layer.{k}": v for k, v in f.items()}
    plan = core.plan(core.parse_lokr(ok), shapes_of("zimage"))
    assert "not a LoKr tensor" in plan.unused["diffusion_model.layers.0.attention.to_q.lora_down.weight"]
    assert "matches no zimage weight" in plan.unused["diffusion_model.not_a_layer.lokr_w1"]


def test_unsupported_model():
    with pytest.raises(UnsupportedModelError):
        core.build_targets({"diffusion_model.input_blocks.0.0.weight": (320, 4, 3, 3)})


@pytest.mark.parametrize("chunk", [1, 700, 1 << 22])
@pytest.mark.parametrize("kind", ["full", "both", "tucker"])
def test_add_delta_chunked_matches_oracle(chunk, kind):
    from ditkit.loaders.lokr_math import add_delta_

    f, scale = make_module(96, 40, kind, 4)
    f = {k: v for k, v in f.items() if k != "alpha"}
    base = torch.randn(96, 40, generator=G)
    ref = base.double() + 0.3 * scale * oracle_delta(f)
    got = add_delta_(base.clone(), f, 0.3 * scale, max_chunk_elems=chunk)
    assert (got.double() - ref).abs().max().item() / ref.abs().max().item() <= 1e-6
    swapped = add_delta_(base.clone(), f, 0.3 * scale, swap_halves=True)
    d = 0.3 * scale * oracle_delta(f)
    ref_s = base.double() + torch.cat([d[48:], d[:48]])
    assert (swapped.double() - ref_s).abs().max().item() / ref_s.abs().max().item() <= 1e-6
    view = base.clone()
    add_delta_(view[10:86], {k: v for k, v in make_module(76, 40, "full", 4)[0].items() if k != "alpha"}, 1.0)
    assert torch.equal(view[:10], base[:10]) and torch.equal(view[86:], base[86:])  # offset view patched in place only


def test_diffusers_export_with_peft_metadata_uses_peft_scaling():
    import json

    f, _ = make_module(ci.ZIMAGE["dim"], ci.ZIMAGE["dim"], "full", 8)
    sd = {f"transformer.layers.0.attention.to_q.{k}": v for k, v in f.items() if k != "alpha"}
    cfg = core.peft_config_from_metadata({"lora_adapter_metadata": json.dumps({"r": 4, "alpha": 2})})
    p = core.parse_lokr(sd, peft_config=cfg)
    assert p.modules["transformer.layers.0.attention.to_q"].scale == 0.5
    assert any("PEFT alpha / r from" in n for n in p.notes)
    # with per-module alpha keys the LyCORIS rule wins (full-rank -> 1.0) and the note says so
    p = core.parse_lokr({**sd, "transformer.layers.0.attention.to_q.alpha": torch.tensor(3.0)}, peft_config=cfg)
    assert p.modules["transformer.layers.0.attention.to_q"].scale == 1.0
    assert any("LyCORIS scaling used" in n for n in p.notes)


# ---------------------------------------------------------------------------------------------- scale sources
D = ci.ZIMAGE["dim"]


def _w2lr(prefix, rank=4, alpha=None, factor=8):
    """One decomposed-w2 module on a Z-Image q slice (D x D); alpha None: no alpha key."""
    f, _ = make_module(D, D, "w2lr", factor, rank=rank, alpha=alpha if alpha is not None else 1.0)
    if alpha is None:
        del f["alpha"]
    return {f"{prefix}.{k}": v for k, v in f.items()}, {k: v for k, v in f.items() if k != "alpha"}


def _delta_of(plan, prefix) -> torch.Tensor:
    (it,) = [it for it in plan.items if it.module.prefix == prefix]
    return core.module_delta(it).double()


def test_pipeline_level_diffusers_metadata_prefixed_fields():
    """diffusers save_lora_weights writes 'transformer.r', 'transformer.alpha', ... (component-prefixed); the old
    reader found no r/alpha there and merged at 1.0. Oracle: PEFT's alpha / r with rank_pattern / alpha_pattern."""
    import json

    q, fq = _w2lr("transformer.layers.0.attention.to_q", rank=4)
    k, fk = _w2lr("transformer.layers.0.attention.to_k", rank=2)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.alpha": 8, "transformer.peft_type": "LOKR",
                                                 "transformer.rank_pattern": {"to_k": 2},
                                                 "transformer.alpha_pattern": {"to_k": 3}})}
    cfg, where = core.config_from_metadata(meta)
    assert cfg["r"] == 4 and "transformer.*" in where
    plan = core.plan(core.parse_lokr(q | k, peft_config=cfg, config_source=where), shapes_of("zimage"))
    assert (_delta_of(plan, "transformer.layers.0.attention.to_q") - oracle_delta(fq) * 8 / 4).abs().max() < 1e-6
    assert (_delta_of(plan, "transformer.layers.0.attention.to_k") - oracle_delta(fk) * 3 / 2).abs().max() < 1e-6
    assert any("PEFT alpha / r from safetensors metadata" in n for n in plan.notes)
    # model-level save_lora_adapter: the same fields without the prefix
    cfg2, where2 = core.config_from_metadata({"lora_adapter_metadata": json.dumps({"r": 4, "alpha": 2})})
    assert cfg2 == {"r": 4, "alpha": 2} and "save_lora_adapter" in where2
    with pytest.raises(AdapterError, match="ambiguous"):
        core.config_from_metadata({"lora_adapter_metadata": json.dumps({"r": 4, "transformer.r": 4})})


def test_peft_file_without_config_is_refused_and_scale_input_applies():
    """A PEFT-layout file without adapter_config.json was merged at 1.0 with a note; PEFT scales by alpha / r from
    that config, so the scale is unknown: refused naming what is missing; the node's scale input applies it."""
    sd, f = _w2lr("base_model.model.layers.0.attention.to_q")
    with pytest.raises(AdapterError, match=r"adapter_config\.json.*'scale' input"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))
    plan = core.plan(core.parse_lokr(sd, scale_override=-0.25), shapes_of("zimage"))
    (it,) = plan.items
    assert it.module.scale == -0.25 and it.module.scale_kind == "input" and "undetermined" in it.module.scale_rule
    assert (_delta_of(plan, "base_model.model.layers.0.attention.to_q") + 0.25 * oracle_delta(f)).abs().max() < 1e-6
    with pytest.raises(AdapterError, match="finite"):
        core.parse_lokr(sd, scale_override=float("nan"))


@pytest.mark.parametrize("prefix,outcome", [
    ("lycoris_layers_0_attention_to_q", "refused"),                 # LyCORIS' loader needs alpha
    ("lora_transformer_layers_0_attention_to_q", "refused"),        # OneTrainer: strict load
    ("diffusion_model.layers.0.attention.to_q", "refused"),         # ai-toolkit: alpha from its job config
    ("lora_unet_layers_0_attention_to_q", "musubi-tuner"),          # musubi merge_weights_to_tensor: alpha = dim
    ("transformer.layers.0.attention.to_q", "diffusers"),           # diffusers _create_lokr_config: alpha = r
    ("layers.0.attention.to_q", "diffusers"),
])
def test_decomposed_module_without_alpha(prefix, outcome):
    """No alpha key, no config: the writer's own code decides (module docstring table), else refused."""
    sd, f = _w2lr(prefix)
    parsed = core.parse_lokr(sd)
    if outcome == "refused":
        with pytest.raises(AdapterError, match=r"does not determine the scale.*'\.alpha' key.*'scale' input"):
            core.plan(parsed, shapes_of("zimage"))
        plan = core.plan(core.parse_lokr(sd, scale_override=0.5), shapes_of("zimage"))
        assert (_delta_of(plan, prefix) - 0.5 * oracle_delta(f)).abs().max() < 1e-6
        return
    plan = core.plan(parsed, shapes_of("zimage"))
    (it,) = plan.items
    assert it.module.scale == 1.0 and it.module.scale_kind == "convention"
    note = [n for n in plan.notes if n.startswith("scale convention")]
    assert note and outcome in note[0]
    assert ("merge_weights_to_tensor" if outcome == "musubi-tuner" else "_create_lokr_config") in note[0]


def test_full_rank_without_alpha_is_determined():
    """Both factors full: LyCORIS (and ai-toolkit / OneTrainer / musubi #900) use scale 1 whatever the alpha."""
    f, _ = make_module(D, D, "full", 8)
    del f["alpha"]
    plan = core.plan(core.parse_lokr({f"lycoris_layers_0_attention_to_q.{k}": v for k, v in f.items()}), shapes_of("zimage"))
    assert plan.items[0].module.scale == 1.0 and plan.items[0].module.scale_kind == "file"


def test_musubi_pr901_full_w2_scale():
    """musubi-tuner PR #901 (the code that saves 'lokr_factor'): get_weight / merge_weights_to_tensor use
    dim = max(w2.shape) for a full w2, so scale = alpha / max(w2.shape), not LyCORIS' 1.0."""
    f, _ = make_module(D, D, "full", 8)
    f["alpha"] = torch.tensor(4.0)
    sd = {f"lora_unet_layers_0_attention_to_q.{k}": v for k, v in f.items()} | {"lokr_factor": torch.tensor(8)}
    plan = core.plan(core.parse_lokr(sd), shapes_of("zimage"))
    want = 4.0 / max(f["lokr_w2"].shape)
    assert abs(plan.items[0].module.scale - want) < 1e-12
    sd.pop("lokr_factor")  # the merged musubi-tuner (#900) / LyCORIS: full factors -> 1.0
    assert core.plan(core.parse_lokr(sd), shapes_of("zimage")).items[0].module.scale == 1.0
    with pytest.raises(AdapterError, match="lokr_factor"):
        core.parse_lokr({**sd, "lokr_factor": torch.tensor(0.5)})


def test_peft_config_checks():
    sd, f = _w2lr("base_model.model.layers.0.attention.to_q", rank=4)
    shapes = shapes_of("zimage")
    # negative alpha keeps its sign (PEFT: scaling = alpha / r, no sign check)
    plan = core.plan(core.parse_lokr(sd, peft_config={"r": 4, "alpha": -2}), shapes)
    assert plan.items[0].module.scale == -0.5
    for cfg, pat in (({"r": 4}, r"no 'alpha'"), ({"alpha": 4}, r"no 'r'"),
                     ({"r": 4, "alpha": 4, "peft_type": "LORA"}, "not 'LOKR'"),
                     ({"r": 8, "alpha": 4}, r"rank 4 .* r = 8"), ({"r": 4, "alpha": 0}, "non-zero"),
                     ({"r": 4, "alpha": 4, "rank_pattern": {"(to_q)+": 4}}, "not a plain module name")):
        with pytest.raises(AdapterError, match=pat):
            core.plan(core.parse_lokr(sd, peft_config=cfg), shapes)
        # the error says to set the scale input: with it, the config's problem no longer blocks the file
        (it,) = core.plan(core.parse_lokr(sd, peft_config=cfg, scale_override=0.5), shapes).items
        assert it.module.scale == 0.5 and "undetermined" in it.module.scale_rule


def test_peft_pattern_matching_as_get_pattern_key():
    """PEFT get_pattern_key: first key (file order) with re.match(rf"(.*\\.)?({key})$", name); '^' anchors at the
    start of the module name (relative to the model PEFT wrapped)."""
    sd, _ = _w2lr("base_model.model.layers.0.attention.to_q", rank=2)
    shapes = shapes_of("zimage")

    def scale(cfg):
        return core.plan(core.parse_lokr(sd, peft_config=cfg), shapes).items[0].module.scale

    base = {"r": 2, "alpha": 2}
    assert scale({**base, "alpha_pattern": {"to_q": 6}}) == 3.0
    assert scale({**base, "alpha_pattern": {"^layers.0.attention.to_q": 6}}) == 3.0
    assert scale({**base, "alpha_pattern": {"^attention.to_q": 6}}) == 1.0      # anchored elsewhere: no match
    assert scale({**base, "alpha_pattern": {"o_q": 6}}) == 1.0                  # PEFT needs a '.'-boundary
    assert scale({**base, "alpha_pattern": {"attention.to_q": 4, "to_q": 6}}) == 2.0  # first match wins


def test_different_ranks_in_both_factors_refused():
    f, _ = make_module(D, D, "both", 8, rank=2)
    f["lokr_w1_a"], f["lokr_w1_b"] = torch.randn(8, 3, generator=G), torch.randn(3, 8, generator=G)
    sd = {f"lycoris_layers_0_attention_to_q.{k}": v for k, v in f.items()}
    with pytest.raises(AdapterError, match="different ranks"):
        core.plan(core.parse_lokr(sd), shapes_of("zimage"))


def test_read_adapter_file_config_sources(tmp_path):
    """Where the PEFT config comes from: the file's metadata (both diffusers layouts), else adapter_config.json next
    to a PEFT-layout file only; the sidecar is bounded and strictly parsed."""
    import json

    from ditkit.loaders.safetensors_io import save_file

    sd, _ = _w2lr("base_model.model.layers.0.attention.to_q")
    save_file(sd, tmp_path / "adapter_model.safetensors")
    f = core.read_adapter_file(tmp_path / "adapter_model.safetensors")
    assert f.peft_config is None
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LOKR", "r": 4, "alpha": 6}))
    f = core.read_adapter_file(tmp_path / "adapter_model.safetensors")
    assert f.peft_config["alpha"] == 6 and f.config_source == "adapter_config.json next to the file"
    ly, _ = _w2lr("lycoris_layers_0_attention_to_q", alpha=2.0)
    save_file(ly, tmp_path / "ly.safetensors")
    f = core.read_adapter_file(tmp_path / "ly.safetensors")
    assert f.peft_config is None and any("not used" in n for n in f.notes)
    tr, _ = _w2lr("transformer.layers.0.attention.to_q")
    save_file(tr, tmp_path / "tr.safetensors",
              metadata={"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.alpha": 2})})
    f = core.read_adapter_file(tmp_path / "tr.safetensors")
    assert f.peft_config == {"r": 4, "alpha": 2} and "save_lora_weights" in f.config_source
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "r": 8}')
    with pytest.raises(AdapterError, match="duplicate"):
        core.read_adapter_file(tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_bytes(b" " * (core.MAX_CONFIG_BYTES + 1))
    with pytest.raises(AdapterError, match="not a PEFT adapter config"):
        core.read_adapter_file(tmp_path / "adapter_model.safetensors")


# ---------------------------------------------------------------------------------------------- sign through the node's function
@pytest.mark.parametrize("alpha,strength", [(2.0, -0.7), (-2.0, 0.5), (-2.0, -1.5)])
@pytest.mark.parametrize("chunk", [1, 1 << 22])
def test_patch_sign_of_strength_and_alpha(alpha, strength, chunk, monkeypatch):
    """core.apply_patch_ is what DitKitLoKrPatch.calculate_weight calls (ComfyUI hands it the weight slice and the
    strength): negative strength and negative alpha keep their sign, on the chunked path, the whole-ΔW path
    (norm_out row swap) and a row slice of a fused weight. Oracle: float64 from the raw file tensors."""
    import ditkit.loaders.lokr_math as lm

    monkeypatch.setattr(lm.add_delta_, "__defaults__", (False, None, chunk))
    h = ci.FLUX2["hidden"]
    rank = 4
    fq_h, _ = make_module(h, h, "w2lr", 8, rank=rank, alpha=alpha)
    fn, _ = make_module(2 * h, h, "both", 8, rank=rank, alpha=alpha)
    sd = {f"transformer.transformer_blocks.0.attn.to_q.{k}": v for k, v in fq_h.items()}
    sd |= {f"transformer.norm_out.linear.{k}": v for k, v in fn.items()}
    plan = core.plan(core.parse_lokr(sd), shapes_of("flux2"))
    got = {}
    g = torch.Generator().manual_seed(3)
    for it in plan.items:
        base = torch.randn(it.target.shape, generator=g)
        w = core.apply_patch_(base.clone(), core.patch_payload(it), strength, None, key="k")
        got[it.target.describe()] = (base, w)
    s = alpha / rank * strength
    dq = oracle_delta({k: v for k, v in fq_h.items() if k != "alpha"}) * s
    dn = oracle_delta({k: v for k, v in fn.items() if k != "alpha"}) * s
    dn = torch.cat([dn[h:], dn[:h]])  # diffusers [scale; shift] -> ComfyUI [shift; scale]
    for name, ref in (("double_blocks.0.img_attn.qkv[0:128]", dq), ("final_layer.adaLN_modulation.1", dn)):
        base, w = got[name]
        want = base.double() + ref
        err = (w.double() - want).abs().max().item() / want.abs().max().item()
        assert err <= 1e-6, (name, err)
        assert ((w.double() - base.double()) * ref).sum() > 0  # ΔW points the oracle's way
    with pytest.raises(AdapterError, match="expects shape"):
        core.apply_patch_(torch.zeros(3, 3), core.patch_payload(plan.items[0]), 1.0)


def test_node_inputs_checked_finite():
    assert core.check_scale_input(-2) == -2.0
    for bad in (float("nan"), float("inf"), "1", True, None):
        with pytest.raises(AdapterError, match="finite number"):
            core.check_scale_input(bad, "strength")


# ---------------------------------------------------------------------------------------------- files written by the writers
# The writers' own code makes the files (tiny module trees with the diffusers module names and the tiny models'
# sizes) and is the oracle: PEFT's merge, diffusers' own LoKr loader + fuse_lora, LyCORIS' own loader + merge_to.
# They are optional test dependencies (the `dev` extra installs them); without them these tests skip with the
# reason, except under CI (CI=true), where `pip install -e ".[dev]"` must have installed them.
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _clean_path():
    """The checkout's top-level ``kernels`` folder shadows HF ``kernels`` for transformers (imported by PEFT)."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != REPO]
    try:
        yield
    finally:
        sys.path[:] = saved


def writer(name: str):
    with _clean_path():
        try:
            return importlib.import_module(name)
        except ImportError as e:
            msg = f"{name} not installed ({e}); `pip install -e '.[dev]'` installs it"
            if os.environ.get("CI"):
                pytest.fail(msg + " (CI installs the dev extra: a missing writer is a failure here)")
            pytest.skip(msg)


def zimage_writer_modules():
    return [(f"layers.{i}.attention.to_{p}", (D, D)) for i in range(2) for p in "qkv"] + \
           [("layers.0.attention.to_out.0", (D, D))]


def flux2_writer_modules():
    h = ci.FLUX2["hidden"]
    s = shapes_of("flux2")
    return [("transformer_blocks.0.attn.to_q", (h, h)), ("transformer_blocks.0.attn.add_v_proj", (h, h)),
            ("transformer_blocks.1.ff.linear_in", tuple(s["diffusion_model.double_blocks.1.img_mlp.0.weight"])),
            ("single_transformer_blocks.0.attn.to_qkv_mlp_proj", tuple(s["diffusion_model.single_blocks.0.linear1.weight"])),
            ("single_transformer_blocks.1.attn.to_out", tuple(s["diffusion_model.single_blocks.1.linear2.weight"]))]


def make_tree(mods, cls=torch.nn.Module, seed=0):
    """Bias-free Linear layers at the given dotted names (out, in), deterministic weights."""
    g = torch.Generator().manual_seed(seed)
    root = cls()
    for name, (o, i) in mods:
        parent = root
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        lin = torch.nn.Linear(i, o, bias=False)
        lin.weight.data.copy_(torch.randn(o, i, generator=g) * 0.02)
        parent.add_module(name.split(".")[-1], lin)
    return root


def linear_weights(tree) -> dict[str, torch.Tensor]:
    out = {}
    for n, m in tree.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) and isinstance(w, torch.Tensor):
            out[n.replace(".base_layer", "")] = w.detach().double().clone()
    return out


def ditkit_deltas(path, fam, strength=1.0, scale=None):
    """ΔW per module name as the node computes it: read_adapter_file -> parse -> plan -> apply_patch_."""
    f = core.read_adapter_file(path)
    parsed = core.parse_lokr(f.tensors, peft_config=f.peft_config, source=Path(path).name,
                             config_source=f.config_source, scale_override=scale, metadata=f.metadata)
    parsed.notes[:0] = f.notes
    plan = core.plan(parsed, shapes_of(fam))
    out = {}
    for it in plan.items:
        w = core.apply_patch_(torch.zeros(it.target.shape), core.patch_payload(it), strength, None)
        if it.target.swap_halves:
            w = core.swap_halves(w)
        out[it.name] = w.double()
    return plan, out


def assert_deltas(got: dict, ref: dict, tol=1e-5):
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    worst = max((got[k] - ref[k]).abs().max().item() / ref[k].abs().max().item() for k in ref)
    assert worst <= tol, worst


def peft_lokr_math(tree_state: dict, cfg: dict, names) -> dict:
    """Float64 oracle from PEFT's documented math: ΔW = kron(w1, w2) * alpha / r, r/alpha per module from the
    config the test chose (rank_pattern / alpha_pattern keys here are plain leaf names)."""
    out = {}
    for n in names:
        f = {k.rsplit(".", 1)[1]: v for k, v in tree_state.items() if k.rsplit(".", 1)[0] == n}
        leaf = n.rsplit(".", 1)[-1] if not n.endswith(".0") else n.rsplit(".", 2)[-2] + ".0"
        r = cfg.get("rank_pattern", {}).get(leaf, cfg["r"])
        a = cfg.get("alpha_pattern", {}).get(leaf, cfg["alpha"])
        out[n] = oracle_delta(f) * a / r
    return out


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
@pytest.mark.parametrize("with_metadata", [True, False], ids=["metadata", "no-metadata"])
def test_diffusers_pipeline_written_files(tmp_path, fam, with_metadata):
    """diffusers' pipeline-level save_lora_weights (ZImage / Flux2 loader mixins) of a PEFT LoKr. With metadata
    ('transformer.r', 'transformer.alpha', rank/alpha patterns): ditkit = PEFT's own merge = float64 alpha / r math
    = diffusers' own loader + fuse_lora. Without: ditkit applies diffusers' convention (alpha = r) and equals
    diffusers' own loader of that file."""
    peft = writer("peft")
    with _clean_path():
        from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin, ZImageLoraLoaderMixin
        from diffusers.loaders.peft import PeftAdapterMixin
    mixin = ZImageLoraLoaderMixin if fam == "zimage" else Flux2LoraLoaderMixin
    mods = zimage_writer_modules() if fam == "zimage" else flux2_writer_modules()
    leaves = sorted({n.rsplit(".", 1)[-1] if not n.endswith(".0") else "to_out.0" for n, _ in mods})
    pat_leaf = "to_k" if fam == "zimage" else "add_v_proj"
    cfg = {"r": 4, "alpha": 6, "rank_pattern": {pat_leaf: 2}, "alpha_pattern": {pat_leaf: -3}}
    tree = make_tree(mods)
    base = linear_weights(tree)
    pc = peft.LoKrConfig(target_modules=leaves, decompose_factor=8, init_weights=False, **cfg)
    peft.inject_adapter_in_model(pc, tree)
    state = peft.get_peft_model_state_dict(tree)
    mixin.save_lora_weights(str(tmp_path), transformer_lora_layers=state,
                            transformer_lora_adapter_metadata=pc.to_dict() if with_metadata else None)
    path = tmp_path / "pytorch_lora_weights.safetensors"
    # diffusers' own loader of the file it wrote, onto a fresh copy of the base tree
    loaded = make_tree(mods, cls=type("Tree", (torch.nn.Module, PeftAdapterMixin), {}))
    with _clean_path():
        sd, meta = mixin.lora_state_dict(str(tmp_path), weight_name=path.name, return_lora_metadata=True)
        loaded.load_lora_adapter(sd, prefix="transformer", metadata=meta, adapter_name="t")
        loaded.fuse_lora()
    by_diffusers = {n: w - base[n] for n, w in linear_weights(loaded).items()}
    plan, ours = ditkit_deltas(path, fam)
    assert not plan.unused and not plan.refused and len(plan.items) == len(mods)
    assert_deltas(ours, by_diffusers)
    if with_metadata:
        for m in tree.modules():  # PEFT's own merge of the adapter it trained
            if isinstance(m, peft.tuners.lokr.LoKrLayer):
                m.merge()
        by_peft = {n: w - base[n] for n, w in linear_weights(tree).items()}
        assert_deltas(ours, by_peft)
        assert_deltas(ours, peft_lokr_math(state, cfg, [n for n, _ in mods]))
        assert {it.module.scale_kind for it in plan.items} == {"config"}
        assert any("'transformer.*' fields" in n for n in plan.notes)
        assert any(it.module.scale < 0 for it in plan.items)  # the negative pattern alpha kept its sign
    else:
        assert {it.module.scale for it in plan.items} == {1.0}
        assert any("_create_lokr_config" in n for n in plan.notes)


@pytest.mark.parametrize("r,alpha,factor,both", [(4, 8, 8, False), (2, 3, -1, True), (4, -4, 16, False)])
def test_peft_save_pretrained_files(tmp_path, r, alpha, factor, both):
    """PEFT's save_pretrained (adapter_model.safetensors + adapter_config.json): ditkit = PEFT's merge_and_unload.
    Without the config the file is refused, and the node's scale input then applies."""
    peft = writer("peft")
    mods = zimage_writer_modules()
    tree = make_tree(mods)
    base = linear_weights(tree)
    with _clean_path():
        pc = peft.LoKrConfig(r=r, alpha=alpha, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                             decompose_factor=factor, decompose_both=both, init_weights=False)
        pm = peft.get_peft_model(tree, pc)
        pm.save_pretrained(str(tmp_path))
        merged = pm.merge_and_unload()
    by_peft = {n: w - base[n] for n, w in linear_weights(merged).items()}
    plan, ours = ditkit_deltas(tmp_path / "adapter_model.safetensors", "zimage", strength=1.0)
    assert plan.writer == "peft" and not plan.unused and not plan.refused
    assert all(it.module.scale == alpha / r for it in plan.items)
    assert_deltas(ours, by_peft)
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        ditkit_deltas(tmp_path / "adapter_model.safetensors", "zimage")
    _, scaled = ditkit_deltas(tmp_path / "adapter_model.safetensors", "zimage", scale=alpha / r)
    assert_deltas(scaled, by_peft)


def forward_delta(module, w0: torch.Tensor) -> torch.Tensor:
    """ΔW of an adapted Linear from its own forward: y = I @ (W + ΔW)^T."""
    with torch.no_grad():
        y = module(torch.eye(w0.shape[1]))
    return y.double().T - w0


@pytest.mark.parametrize("fam", ["zimage", "flux2"])
def test_lycoris_written_files(tmp_path, fam):
    """lycoris-lora's create_lycoris + save_weights (decomposed w2, factor -1, full matrix, decompose_both, a
    negative alpha); the oracle is LyCORIS' own loader (create_lycoris_from_weights) and the adapted layers'
    forward (the function it trains), also at a negative multiplier. (Not ``merge_to``: in lycoris-lora 4.1.3
    ``LokrModule.get_diff_weight`` multiplies by ``self.scale`` on top of ``get_weight``'s, i.e. alpha/rank twice,
    unlike its forward and ComfyUI.)"""
    lycoris = writer("lycoris")
    mods = zimage_writer_modules() if fam == "zimage" else flux2_writer_modules()
    seen = set()
    for i, cfg in enumerate(({"factor": 8, "linear_dim": 4, "linear_alpha": 2},
                             {"factor": -1, "linear_dim": 4, "linear_alpha": 1},
                             {"factor": 16, "linear_dim": 100000, "linear_alpha": 1, "full_matrix": True},
                             {"factor": 16, "linear_dim": 2, "linear_alpha": -3, "decompose_both": True})):
        tree = make_tree(mods)
        with _clean_path():
            net = lycoris.create_lycoris(tree, 1.0, algo="lokr", **cfg)
            net.apply_to()
            g = torch.Generator().manual_seed(11 + i)
            for p in net.parameters():
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
            path = tmp_path / f"lyco_{i}.safetensors"
            net.save_weights(str(path), torch.float32, None)
        for strength in (1.0, -0.6):
            fresh = make_tree(mods)
            base = linear_weights(fresh)
            with _clean_path():
                loaded, _ = lycoris.create_lycoris_from_weights(strength, str(path), fresh)
                loaded.apply_to()
            by_lycoris = {n: forward_delta(m, base[n]) for n, m in fresh.named_modules() if n in base}
            plan, ours = ditkit_deltas(path, fam, strength=strength)
            assert plan.writer == "lycoris" and not plan.unused and not plan.refused
            assert_deltas(ours, by_lycoris)
        seen |= {tuple(sorted(it.module.factors)) for it in plan.items}
    assert ("lokr_w1", "lokr_w2") in seen and ("lokr_w1", "lokr_w2_a", "lokr_w2_b") in seen
    assert ("lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b") in seen
