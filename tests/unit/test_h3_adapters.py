"""loaders/h3_adapters (plain torch): key mapping, qkv layout decision, scale rules, refusals.

The cross-check oracle is diffusers' own H3 LoRA converter (``MiniMaxH3LoraLoaderMixin.lora_state_dict``: renames,
DiffSynth de-interleave, fc1 half swap, alpha fold, metadata network alpha), run on the same files: its diffusers-
named factors, mapped to ComfyUI rows by the h3.md §2.6 B table written in this test, must give the ΔW ditkit adds.
It hard-codes H3's 128-wide heads, so these tests use 2 heads x 128 (hidden 64).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from ditkit.errors import AdapterError
from ditkit.loaders import h3_adapters as A
from ditkit.loaders.safetensors_io import save_file

REPO = Path(__file__).resolve().parents[2]
NH, HD, H, FFN, TD = 2, 128, 64, 96, 32
INNER = NH * HD
SHAPES = {"diffusion_model.video_patch_proj.weight": (H, 96), "diffusion_model.final_layer.adaln_proj.linear.weight": (2 * H, TD)}
for _i in range(2):
    for _k, _v in {"attn.qkv_proj.weight": (3 * INNER, H), "attn.q_norm.weight": (HD,), "attn.out_proj.weight": (H, INNER),
                   "mlp.fc1.weight": (2 * FFN, H), "mlp.fc2.weight": (H, FFN), "norm1.weight": (H,)}.items():
        SHAPES[f"diffusion_model.blocks.{_i}.{_k}"] = _v
SHAPES["diffusion_model.token_refiner.blocks.0.attn.qkv_proj.weight"] = (3 * INNER, H)
SHAPES["diffusion_model.token_refiner.blocks.0.attn.q_norm.weight"] = (HD,)
GEO = A.geometry(SHAPES)
MODS = [("blocks.0.attn.qkv_proj", 3 * INNER, H), ("blocks.1.attn.out_proj", H, INNER), ("blocks.0.mlp.fc1", 2 * FFN, H),
        ("blocks.1.mlp.fc2", H, FFN), ("token_refiner.blocks.0.attn.qkv_proj", 3 * INNER, H),
        ("final_layer.adaln_proj.linear", 2 * H, TD)]


@contextlib.contextmanager
def _clean_path():
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != REPO]
    try:
        yield
    finally:
        sys.path[:] = saved


def _file(fmt, g, rank=4):
    sd, meta = {}, {}
    for mod, o, n in MODS:
        a, b = torch.randn(rank, n, generator=g) * 0.1, torch.randn(o, rank, generator=g) * 0.1
        if fmt == "diffsynth":
            sd[f"{mod}.lora_A.default.weight"], sd[f"{mod}.lora_B.default.weight"] = a, b
        elif fmt == "musubi":
            p = "lora_unet_" + mod.replace(".", "_")
            sd[p + ".lora_down.weight"], sd[p + ".lora_up.weight"], sd[p + ".alpha"] = a, b, torch.tensor(2.0)
        elif fmt == "aitoolkit":
            sd[f"diffusion_model.{mod}.lora_A.weight"], sd[f"diffusion_model.{mod}.lora_B.weight"] = a, b
            sd[f"diffusion_model.{mod}.alpha"] = torch.tensor(8.0)
        elif fmt == "bare_meta_alpha":
            sd[f"{mod}.lora_down.weight"], sd[f"{mod}.lora_up.weight"] = a, b
            meta["alpha"] = "3"
        elif fmt == "bare":
            sd[f"{mod}.lora_A.weight"], sd[f"{mod}.lora_B.weight"] = a, b
    return sd, meta


def _diffusers_to_comfy(name):
    """diffusers module -> (ComfyUI key, rows, swap) by the h3.md §2.6 B table."""
    if name == "norm_out.linear":
        return "diffusion_model.final_layer.adaln_proj.linear.weight", None, False
    for dp, op in (("transformer_blocks.", "blocks."), ("token_refiner.refiner_blocks.", "token_refiner.blocks.")):
        if name.startswith(dp):
            i, sub = name[len(dp):].split(".", 1)
            base = f"diffusion_model.{op}{i}."
            if sub in ("attn.to_q", "attn.to_k", "attn.to_v"):
                j = "qkv".index(sub[-1])
                return base + "attn.qkv_proj.weight", (j * INNER, (j + 1) * INNER), False
            return base + {"attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2"}[sub] \
                + ".weight", None, sub == "ff.net.0.proj"
    raise KeyError(name)


def _ditkit_deltas(plan):
    out = {}
    for it in plan.items:
        k = it.target.key
        w = out.setdefault(k, torch.zeros(SHAPES[k], dtype=torch.float32))
        sl = w if it.target.rows is None else w[it.target.rows[0]:it.target.rows[1]]
        A.apply_item_(sl, it, 1.0)
    return out


@pytest.mark.parametrize("fmt,layout", [("diffsynth", "interleaved"), ("musubi", "contiguous"),
                                        ("aitoolkit", "contiguous"), ("bare_meta_alpha", "contiguous"),
                                        ("bare", "contiguous")])
def test_matches_diffusers_own_h3_converter(tmp_path, fmt, layout):
    try:
        with _clean_path():
            from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
    except ImportError:
        pytest.skip("diffusers with MiniMaxH3LoraLoaderMixin is not installed")
    sd, meta = _file(fmt, torch.Generator().manual_seed(len(fmt)))
    p = tmp_path / "a.safetensors"
    save_file(sd, p, metadata=meta or None)
    with _clean_path():
        conv, cmeta = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(tmp_path), weight_name=p.name,
                                                               return_lora_metadata=True)
    net_alpha = json.loads(json.dumps(cmeta)).get("transformer.lora_alpha") if cmeta else None
    want: dict[str, torch.Tensor] = {}
    for k in conv:
        if not k.endswith(".lora_A.weight"):
            continue
        mod = k[len("transformer."):-len(".lora_A.weight")]
        a, b = conv[k].double(), conv[k.replace("lora_A", "lora_B")].double()
        d = b @ a * ((net_alpha / a.shape[0]) if net_alpha else 1.0)
        key, rows, swap = _diffusers_to_comfy(mod)
        if swap:
            d = torch.cat([d[d.shape[0] // 2:], d[:d.shape[0] // 2]])
        w = want.setdefault(key, torch.zeros(SHAPES[key], dtype=torch.float64))
        if rows is None:
            w += d
        else:
            w[rows[0]:rows[1]] += d
    plan = A.plan(A.read_adapter_file(str(p)), GEO, lambda k: None, source=p.name)
    assert plan.layout == layout and not plan.unused and len(plan.items) == len(MODS)
    got = _ditkit_deltas(plan)
    assert sorted(got) == sorted(want)
    for k in want:
        err = (got[k].double() - want[k]).abs().max().item() / want[k].abs().max().item()
        assert err <= 1e-6, (k, err)


def test_deinterleave_map_by_loops():
    m = A.deinterleave_map(3, 4)
    exp = [h * 12 + j * 4 + d for j in range(3) for h in range(3) for d in range(4)]
    assert m.tolist() == exp


def _plan(sd, meta=None, **kw):
    return A.plan(A.AdapterFile("x", sd, meta or {}), GEO, lambda k: None, source="x.safetensors", **kw)


def _lora(prefix, o, n, rank=4, **extra):
    g = torch.Generator().manual_seed(1)
    sd = {f"{prefix}.lora_down.weight": torch.randn(rank, n, generator=g),
          f"{prefix}.lora_up.weight": torch.randn(o, rank, generator=g)}
    sd.update(extra)
    return sd


def test_scale_rules_are_named():
    p = _plan(_lora("diffusion_model.blocks.0.attn.out_proj", H, INNER, **{
        "diffusion_model.blocks.0.attn.out_proj.alpha": torch.tensor(2.0)}))
    assert p.items[0].scale == 0.5 and "alpha/rank = 2/4" in p.items[0].scale_rule
    p = _plan(_lora("diffusion_model.blocks.0.attn.out_proj", H, INNER))
    assert p.items[0].scale == 1.0 and "ComfyUI's rule" in p.items[0].scale_rule
    p = _plan(_lora("lora_unet_blocks_0_attn_out_proj", H, INNER))
    assert p.items[0].scale == 1.0 and "MiniMaxH3LoraLoaderMixin" in p.items[0].scale_rule
    with pytest.raises(AdapterError, match="does not determine the scale"):
        _plan(_lora("lycoris_blocks_0_attn_out_proj", H, INNER))
    p = _plan(_lora("lycoris_blocks_0_attn_out_proj", H, INNER), scale_override=0.3)
    assert p.items[0].scale == 0.3


def test_peft_config_rules():
    g = torch.Generator().manual_seed(2)
    sd = {"base_model.model.blocks.0.attn.out_proj.lora_A.weight": torch.randn(8, INNER, generator=g),
          "base_model.model.blocks.0.attn.out_proj.lora_B.weight": torch.randn(H, 8, generator=g),
          "base_model.model.blocks.1.attn.out_proj.lora_A.weight": torch.randn(4, INNER, generator=g),
          "base_model.model.blocks.1.attn.out_proj.lora_B.weight": torch.randn(H, 4, generator=g)}
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": {"blocks.0.attn.out_proj": 8},
           "alpha_pattern": {"blocks.0.attn.out_proj": 4}}
    p = A.plan(A.AdapterFile("x", sd, {}, cfg, "adapter_config.json"), GEO, lambda k: None, source="x")
    sc = {it.module.prefix: it.scale for it in p.items}
    assert sc == {"base_model.model.blocks.0.attn.out_proj": 0.5, "base_model.model.blocks.1.attn.out_proj": 2.0}
    p = A.plan(A.AdapterFile("x", sd, {}, {**cfg, "use_rslora": True}, "c"), GEO, lambda k: None, source="x")
    assert {it.module.prefix: it.scale for it in p.items}["base_model.model.blocks.1.attn.out_proj"] == 8 / math.sqrt(4)
    with pytest.raises(AdapterError, match="without its adapter_config.json"):
        A.plan(A.AdapterFile("x", sd, {}), GEO, lambda k: None, source="x")
    with pytest.raises(AdapterError, match="r = 4"):
        A.plan(A.AdapterFile("x", sd, {}, {"peft_type": "LORA", "r": 4, "lora_alpha": 8}, "c"), GEO, lambda k: None,
               source="x")


def test_component_prefixed_metadata_config():
    g = torch.Generator().manual_seed(3)
    sd = {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": torch.randn(4, H, generator=g),
          "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": torch.randn(INNER, 4, generator=g)}
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 1.0})}
    af = A.AdapterFile("x", sd, meta)
    found = A.lokr_core.config_from_metadata(meta)
    af.peft_config, af.config_source = found
    p = A.plan(af, GEO, lambda k: None, source="x")
    assert p.items[0].scale == 0.25 and p.items[0].target.rows == (INNER, 2 * INNER) and p.layout == "n/a"
    assert "save_lora_weights" in p.items[0].scale_rule


def test_layout_decisions_and_refusals():
    q = "blocks.0.attn.qkv_proj"
    assert _plan(_lora(f"diffusion_model.{q}", 3 * INNER, H)).layout == "contiguous"
    assert _plan(_lora(q, 3 * INNER, H), {"qkv_layout": "interleaved"}).layout == "interleaved"
    p = _plan(_lora(f"diffusion_model.{q}", 3 * INNER, H), qkv_layout="interleaved")
    assert p.layout == "interleaved" and "the file suggests contiguous" in p.layout_reason
    with pytest.raises(AdapterError, match="'qkv_layout'"):
        _plan(_lora(f"lycoris_{q.replace('.', '_')}", 3 * INNER, H, **{
            f"lycoris_{q.replace('.', '_')}.alpha": torch.tensor(1.0)}))
    with pytest.raises(AdapterError, match="mixed layouts"):
        _plan({**_lora(f"diffusion_model.{q}", 3 * INNER, H),
               **_lora("diffusion_model.transformer_blocks.1.attn.to_v", INNER, H)})
    with pytest.raises(AdapterError, match="is not one of"):
        _plan(_lora(f"diffusion_model.{q}", 3 * INNER, H), qkv_layout="rows")


def test_other_component_keys_are_unused_with_reason():
    sd = {**_lora("diffusion_model.blocks.0.attn.out_proj", H, INNER),
          "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 2)}
    p = _plan(sd)
    assert list(p.unused) == ["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"]
    assert "text encoder" in next(iter(p.unused.values()))


def test_set_weight_becomes_a_difference_to_the_base():
    base = torch.randn(H, INNER)
    new = torch.randn(H, INNER)
    sd = {"transformer_blocks.0.attn.to_out.0.set_weight": new}
    p = A.plan(A.AdapterFile("x", sd, {"format": "fastvideo-lora-v2"}), GEO,
               lambda k: base if k == "diffusion_model.blocks.0.attn.out_proj.weight" else None, source="x")
    w = base.clone()
    A.apply_item_(w, p.items[0], 1.0)
    assert torch.allclose(w, new, atol=1e-6)
    w = base.clone()
    A.apply_item_(w, p.items[0], -0.5)
    assert torch.allclose(w.double(), base.double() - 0.5 * (new.double() - base.double()), atol=1e-5)


DIFF_MODS = [("transformer_blocks.0.attn.to_q", INNER, H), ("transformer_blocks.0.attn.to_k", INNER, H),
             ("transformer_blocks.1.attn.to_v", INNER, H), ("transformer_blocks.0.attn.to_out.0", H, INNER),
             ("transformer_blocks.1.ff.net.0.proj", 2 * FFN, H), ("transformer_blocks.0.ff.net.2", H, FFN),
             ("token_refiner.refiner_blocks.0.attn.to_k", INNER, H), ("norm_out.linear", 2 * H, TD)]


def _tree(mods):
    root = torch.nn.Module()
    for name, o, n in mods:
        parent = root
        for p in name.split(".")[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.add_module(name.split(".")[-1], torch.nn.Linear(n, o, bias=False))
    return root


@pytest.mark.parametrize("with_metadata", [True, False], ids=["metadata", "no-metadata"])
def test_diffusers_h3_writer_file(tmp_path, with_metadata):
    """MiniMaxH3LoraLoaderMixin.save_lora_weights of a PEFT LoRA on diffusers H3 names: 0 unused keys; with the
    metadata (rank / alpha patterns) ditkit's ΔW equals PEFT's own merge; without it, diffusers' convention
    (alpha = rank) and the file's B @ A."""
    try:
        with _clean_path():
            import peft
            from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
    except ImportError:
        pytest.skip("peft / diffusers with MiniMaxH3LoraLoaderMixin not installed")
    torch.manual_seed(0)
    tree = _tree(DIFF_MODS)
    w0 = {n: tree.get_submodule(n).weight.detach().double().clone() for n, _, _ in DIFF_MODS}
    with _clean_path():
        pc = peft.LoraConfig(r=4, lora_alpha=6, target_modules=[n for n, _, _ in DIFF_MODS], init_lora_weights=False,
                             rank_pattern={"to_out.0": 2}, alpha_pattern={"to_out.0": 5})
        peft.inject_adapter_in_model(pc, tree)
        state = peft.get_peft_model_state_dict(tree)
        MiniMaxH3LoraLoaderMixin.save_lora_weights(str(tmp_path), transformer_lora_layers=state,
                                                   transformer_lora_adapter_metadata=pc.to_dict() if with_metadata
                                                   else None)
        for mod in tree.modules():
            if isinstance(mod, peft.tuners.lora.LoraLayer):
                mod.merge()
    path = tmp_path / "pytorch_lora_weights.safetensors"
    from ditkit.loaders.safetensors_io import load_with_metadata

    raw, _ = load_with_metadata(path)
    plan = A.plan(A.read_adapter_file(str(path)), GEO, lambda k: None, source=path.name)
    assert not plan.unused and len(plan.items) == len(DIFF_MODS) and plan.layout == "n/a"
    got = _ditkit_deltas(plan)
    for n, o, i in DIFF_MODS:
        if with_metadata:
            d = tree.get_submodule(n).base_layer.weight.detach().double() - w0[n]    # PEFT's own merge
        else:
            d = raw[f"transformer.{n}.lora_B.weight"].double() @ raw[f"transformer.{n}.lora_A.weight"].double()
        key, rows, swap = _diffusers_to_comfy(n)
        if swap:
            d = torch.cat([d[d.shape[0] // 2:], d[:d.shape[0] // 2]])
        g = got[key] if rows is None else got[key][rows[0]:rows[1]]
        err = (g.double() - d).abs().max().item() / d.abs().max().item()
        assert err <= 1e-5, (n, err)
