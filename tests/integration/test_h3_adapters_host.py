"""DitKitAdapterLoader on MiniMax H3 in the real host (in-process ComfyUI, CPU).

Every adapter naming x every base layout the H3 loader accepts x qkv layout x strength: the weights ComfyUI
patches equal a float64 oracle written here (ΔW from the factors, interleave / half swap done by hand, scale from
the numbers written into the file) to <= 1e-6 relative to max|ΔW|. The H3 test config has 3 heads, so a wrong
qkv interleave is visible. Also: stacking, FastH3 adapter == fused FastH3 checkpoint bit for bit (weights and
sampling) with the adapter's gates reaching DitKitSparseAttention, files written by PEFT / LyCORIS, bad input.
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

from ditkit.errors import AdapterError, DitKitError
from ditkit.loaders.safetensors_io import save_file
from ditkit.tiny import ckpt_h3 as c
from tests.support.quant_oracle import bits, host_requant_oracle, json_format, saved_weights

CFG = c.CONFIG
H, HD, NH = CFG["hidden_size"], CFG["attention_head_dim"], CFG["num_attention_heads"]
INNER, FFN = NH * HD, CFG["ffn_hidden_size"]
RANK = 4
REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"comfy": c.COMFY_FILE, "official": c.OFFICIAL_DIR, "diffusers": c.DIFFUSERS_DIR, "curve": c.CURVE_FILE}


@pytest.fixture(scope="module")
def bases(comfy, tiny_ckpts):
    from ditkit.nodes.h3_loaders import load_h3_model

    torch.set_num_threads(1)
    out = {}
    for name, rel in LAYOUTS.items():
        m, rep = load_h3_model(str(tiny_ckpts / rel))
        out[name] = m
    return out


def base_sd(m):
    return {k: v.detach().clone() for k, v in m.model_state_dict(filter_prefix="diffusion_model.").items()}


def patched(m, key):
    return m.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)


# ------------------------------------------------------------------ independent float64 oracle
def interleaved_to_comfy(d):
    """Official per-head interleaved rows [h0: q,k,v; h1: ...] -> ComfyUI [q_all; k_all; v_all], row by row."""
    out = torch.empty_like(d)
    for h in range(NH):
        for j in range(3):
            out[j * INNER + h * HD: j * INNER + (h + 1) * HD] = d[h * 3 * HD + j * HD: h * 3 * HD + (j + 1) * HD]
    return out


def kron64(a, b):
    a, b = a.double(), b.double()
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * 0.1


# modules of one test adapter, in original names: (module, out, in)
ORIG = [(f"blocks.{i}.attn.qkv_proj", 3 * INNER, H) for i in range(2)] + \
       [("blocks.0.attn.out_proj", H, INNER), ("blocks.1.mlp.fc1", 2 * FFN, H), ("blocks.0.mlp.fc2", H, FFN),
        ("token_refiner.blocks.1.attn.qkv_proj", 3 * INNER, H)]
DIFF = [("transformer_blocks.0.attn.to_q", INNER, H), ("transformer_blocks.0.attn.to_k", INNER, H),
        ("transformer_blocks.0.attn.to_v", INNER, H), ("transformer_blocks.1.attn.to_k", INNER, H),
        ("transformer_blocks.1.ff.net.0.proj", 2 * FFN, H), ("transformer_blocks.0.attn.to_out.0", H, INNER),
        ("token_refiner.refiner_blocks.1.attn.to_v", INNER, H), ("norm_out.linear", 2 * H, CFG["time_embed_dim"])]
DIFF_TO_NATIVE = {"attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1"}


def _native_of_diffusers(mod):
    """(ComfyUI weight key, row range or None, swap halves) from the h3.md §2.6 B table, written out here."""
    if mod == "norm_out.linear":
        return "diffusion_model.final_layer.adaln_proj.linear.weight", None, False
    head, rest = (("blocks.", mod[len("transformer_blocks."):]) if mod.startswith("transformer_blocks.")
                  else ("token_refiner.blocks.", mod[len("token_refiner.refiner_blocks."):]))
    i, sub = rest.split(".", 1)
    if sub.startswith("attn.to_") and sub[-1] in "qkv" and len(sub) == 9:
        j = "qkv".index(sub[-1])
        return f"diffusion_model.{head}{i}.attn.qkv_proj.weight", (j * INNER, (j + 1) * INNER), False
    return f"diffusion_model.{head}{i}.{DIFF_TO_NATIVE[sub]}.weight", None, sub == "ff.net.0.proj"


def build(fmt: str, seed: int = 0, qkv: str = "interleaved", curve: bool = False):
    """-> (state dict, metadata, adapter_config or None, {comfy key: [(rows, ΔW64 in ComfyUI rows)]})."""
    g = torch.Generator().manual_seed(seed)
    sd, meta, cfg = {}, {}, None
    expect: dict[str, list] = {}
    diffusers = fmt == "diffusers"
    for mod, o, n in (DIFF if diffusers else ORIG):
        if curve and mod == "norm_out.linear":   # curve-form AdaLN has other in-features: covered by the curve test
            continue
        if fmt in ("lokr",):
            w1 = _rand(g, 3, 2) * 10 if o % 3 == 0 else _rand(g, 2, 2) * 10
            a_rows = o // w1.shape[0]
            w2a, w2b = _rand(g, a_rows, 2), _rand(g, 2, n // w1.shape[1])
            alpha = 3.0
            delta = kron64(w1, w2a.double() @ w2b.double()) * (alpha / 2)
            p = "lycoris_" + mod.replace(".", "_")
            sd.update({p + ".lokr_w1": w1, p + ".lokr_w2_a": w2a, p + ".lokr_w2_b": w2b, p + ".alpha": torch.tensor(alpha)})
        elif fmt == "loha":
            t = [4 * _rand(g, o, RANK), 4 * _rand(g, RANK, n), 4 * _rand(g, o, RANK), 4 * _rand(g, RANK, n)]
            alpha = 2.0
            delta = (t[0].double() @ t[1].double()) * (t[2].double() @ t[3].double()) * (alpha / RANK)
            p = "lycoris_" + mod.replace(".", "_")
            for s, v in zip(("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), t):
                sd[f"{p}.{s}"] = v
            sd[p + ".alpha"] = torch.tensor(alpha)
        else:
            a, b = _rand(g, RANK, n), _rand(g, o, RANK)
            delta = b.double() @ a.double()
            if fmt == "diffsynth":
                sd[f"{mod}.lora_A.default.weight"], sd[f"{mod}.lora_B.default.weight"] = a, b
            elif fmt == "peft":
                sd[f"base_model.model.{mod}.lora_A.weight"], sd[f"base_model.model.{mod}.lora_B.weight"] = a, b
                delta = delta * (8 / RANK)
            elif fmt == "comfyui":
                sd[f"diffusion_model.{mod}.lora_down.weight"], sd[f"diffusion_model.{mod}.lora_up.weight"] = a, b
                sd[f"diffusion_model.{mod}.alpha"] = torch.tensor(2.0)
                delta = delta * (2.0 / RANK)
            elif fmt == "kohya":
                p = "lora_unet_" + mod.replace(".", "_")
                sd[p + ".lora_down.weight"], sd[p + ".lora_up.weight"], sd[p + ".alpha"] = a, b, torch.tensor(3.0)
                delta = delta * (3.0 / RANK)
            elif fmt == "diffusers":
                sd[f"transformer.{mod}.lora_A.weight"], sd[f"transformer.{mod}.lora_B.weight"] = a, b
                delta = delta * (2.0 / RANK)
            else:
                raise AssertionError(fmt)
        if diffusers:
            key, rows, swap = _native_of_diffusers(mod)
            if swap:
                delta = torch.cat([delta[FFN:], delta[:FFN]])
        else:
            key, rows = f"diffusion_model.{mod}.weight", None
            if mod.endswith("qkv_proj") and qkv == "interleaved":
                delta = interleaved_to_comfy(delta)
        expect.setdefault(key, []).append((rows, delta))
    if fmt == "peft":
        cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["qkv_proj"]}
    if fmt == "diffusers":
        meta["lora_adapter_metadata"] = json.dumps({"transformer.r": RANK, "transformer.lora_alpha": 2.0,
                                                    "transformer.peft_type": "LORA"})
    return sd, meta, cfg, expect


def oracle(base, expect, strength):
    out = {}
    for key, parts in expect.items():
        w = base[key].double().clone()
        for rows, d in parts:
            if rows is None:
                w += strength * d
            else:
                w[rows[0]:rows[1]] += strength * d
        out[key] = w
    return out


def write(tmp_path, fmt, sd, meta, cfg, name=None):
    d = tmp_path / fmt
    d.mkdir(exist_ok=True)
    p = d / (name or ("adapter_model.safetensors" if fmt == "peft" else f"{fmt}.safetensors"))
    save_file(sd, p, metadata=meta or None)
    if cfg is not None:
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return p


def worst_error(m, ref, base):
    worst = 0.0
    for k, r in ref.items():
        got = patched(m, k).double()
        dmax = (r - base[k].double()).abs().max().item()
        assert dmax > 0
        worst = max(worst, (got - r).abs().max().item() / dmax)
    return worst


CASES = [("diffsynth", "auto", "interleaved"), ("peft", "interleaved", "interleaved"), ("comfyui", "auto", "contiguous"),
         ("kohya", "auto", "contiguous"), ("kohya", "interleaved", "interleaved"), ("peft", "contiguous", "contiguous"),
         ("diffusers", "auto", "n/a"), ("lokr", "contiguous", "contiguous"), ("lokr", "interleaved", "interleaved"),
         ("loha", "interleaved", "interleaved")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt,qkv_input,qkv", CASES)
@pytest.mark.parametrize("strength", [1.0, -0.7])
def test_every_format_every_base_exact(bases, tmp_path, layout, fmt, qkv_input, qkv, strength):
    from ditkit.nodes.adapters import apply_h3_adapter, report_text

    model = bases[layout]
    base = base_sd(model)
    assert all(v.dtype == torch.float32 for k, v in base.items() if v.dim() == 2 and "qkv" in k)
    sd, meta, cfg, expect = build(fmt, qkv=qkv if qkv != "n/a" else "interleaved", curve=layout == "curve")
    p = write(tmp_path, fmt, sd, meta, cfg)
    m, plan = apply_h3_adapter(model, str(p), strength, qkv_layout=qkv_input)
    assert not plan.unused and not plan.refused
    assert plan.layout == qkv
    assert len(plan.items) == sum(len(v) for v in expect.values())
    text = report_text(plan, p.name, strength, None, qkv_input)
    assert "0 keys unused" in text and f"qkv layout: {qkv}" in text
    assert worst_error(m, oracle(base, expect, strength), base) <= 1e-6
    assert not model.patches  # input untouched


def test_wrong_interleave_is_visible(bases, tmp_path):
    """The oracle of the other layout is far off: the 3-head config makes the interleave observable."""
    from ditkit.nodes.adapters import apply_h3_adapter

    model = bases["comfy"]
    base = base_sd(model)
    sd, meta, cfg, expect = build("kohya", qkv="interleaved")
    m, _ = apply_h3_adapter(model, str(write(tmp_path, "kohya", sd, meta, cfg)), 1.0, qkv_layout="contiguous")
    assert worst_error(m, oracle(base, expect, 1.0), base) > 0.1


@pytest.mark.parametrize("fmt,key", [("peft", "base_model.model.blocks.0.attn.qkv_proj"),
                                     ("lokr", "lycoris_blocks_0_attn_qkv_proj")])
def test_ambiguous_qkv_layout_refused_naming_the_input(bases, tmp_path, fmt, key):
    """PEFT save_pretrained / LyCORIS on the original names: which module tree (raw interleaved checkpoint or the
    reordered one) was trained is not in the file."""
    from ditkit.nodes.adapters import apply_h3_adapter

    model = bases["comfy"]
    sd, meta, cfg, _ = build(fmt)
    p = write(tmp_path, fmt, sd, meta, cfg)
    with pytest.raises(AdapterError, match="qkv_layout") as e:
        apply_h3_adapter(model, str(p), 1.0)
    assert "interleaved" in str(e.value) and key in str(e.value)
    assert not model.patches


def test_stacking_two_adapters(bases, tmp_path):
    from ditkit.nodes.adapters import apply_h3_adapter

    model = bases["official"]
    base = base_sd(model)
    sd1, m1, c1, e1 = build("diffsynth", seed=1)
    sd2, m2, c2, e2 = build("diffusers", seed=2)
    a, _ = apply_h3_adapter(model, str(write(tmp_path, "diffsynth", sd1, m1, c1)), 0.5)
    b, _ = apply_h3_adapter(a, str(write(tmp_path, "diffusers", sd2, m2, c2)), -1.25)
    ref = oracle(base, e1, 0.5)
    for k, r in oracle({**base, **{k: v.float() for k, v in ref.items()}}, e2, -1.25).items():
        ref[k] = r
    worst = 0.0
    for k, r in ref.items():
        dmax = (r - base[k].double()).abs().max().item()
        worst = max(worst, (patched(b, k).double() - r).abs().max().item() / dmax)
    assert worst <= 1e-6
    assert not model.patches and all(k in a.patches for k in e1) and not any(
        len(a.patches[k]) > 1 for k in e1 if k not in e2)


def test_curve_form_adaln_set(bases, tmp_path, tiny_ckpts):
    """A pruned-AdaLN adapter (full curve-form AdaLN weights + the same table): W_base + s (W_new - W_base)."""
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.adapters import apply_h3_adapter

    model = bases["curve"]
    base = base_sd(model)
    cur = load_file(tiny_ckpts / c.CURVE_FILE)
    g = torch.Generator().manual_seed(5)
    new_w = cur["blocks.1.adaln_proj.linear.weight"].float() + _rand(g, *cur["blocks.1.adaln_proj.linear.weight"].shape)
    new_b = cur["final_layer.adaln_proj.linear.bias"].float() + _rand(g, *cur["final_layer.adaln_proj.linear.bias"].shape)
    sd = {"diffusion_model.adaln_t_table": cur["adaln_t_table"],
          "diffusion_model.blocks.1.adaln_proj.linear.weight": new_w,
          "diffusion_model.final_layer.adaln_proj.linear.bias.set_weight": new_b}
    p = write(tmp_path, "curve", sd, {}, None)
    m, plan = apply_h3_adapter(model, str(p), 0.6)
    assert "diffusion_model.adaln_t_table" in plan.unused and "kept from the base" in plan.unused["diffusion_model.adaln_t_table"]
    for k, new in (("diffusion_model.blocks.1.adaln_proj.linear.weight", new_w),
                   ("diffusion_model.final_layer.adaln_proj.linear.bias", new_b)):
        r = base[k].double() + 0.6 * (new.double() - base[k].double())
        assert (patched(m, k).double() - r).abs().max().item() <= 1e-6 * (r - base[k].double()).abs().max().item()
    bad = dict(sd, **{"diffusion_model.adaln_t_table": cur["adaln_t_table"] + 0.01})
    with pytest.raises(AdapterError, match="adaln_t_table"):
        apply_h3_adapter(model, str(write(tmp_path, "curve", bad, {}, None, "bad.safetensors")), 1.0)
    with pytest.raises(AdapterError, match="curve-form"):
        apply_h3_adapter(bases["comfy"], str(p), 1.0)


# ------------------------------------------------------------------ FastH3
def test_fasth3_adapter_equals_fused_checkpoint_bit_for_bit(bases, comfy, tiny_ckpts):
    import nodes as cn
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from ditkit.nodes.adapters import apply_h3_adapter
    from ditkit.nodes.h3_loaders import GATE_ATTACHMENT, load_h3_model

    model = bases["comfy"]
    fused, _ = load_h3_model(str(tiny_ckpts / c.FASTH3_FUSED_FILE))
    m, plan = apply_h3_adapter(model, str(tiny_ckpts / c.FASTH3_ADAPTER), 1.0)
    assert plan.writer == "fastvideo" and not plan.unused and sorted(plan.gates) == [0, 1]
    fsd = fused.model_state_dict(filter_prefix="diffusion_model.")
    changed = 0
    for k, v in fsd.items():
        got = patched(m, k) if k in m.patches else m.model_state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
        changed += k in m.patches
    assert changed == 2 * 4 + 2   # qkv (q/k/v thirds), out_proj, fc1, norm1 per block; 2 biases
    ga, gf = m.get_attachment(GATE_ATTACHMENT), fused.get_attachment(GATE_ATTACHMENT)
    assert sorted(ga) == sorted(gf) == [0, 1] and all(torch.equal(ga[i], gf[i]) for i in ga)
    assert model.get_attachment(GATE_ATTACHMENT) is None   # the base keeps no gates
    latent = EmptyMiniMaxH3LatentAV.execute(64, 64, 5).result[0]
    cond = [[torch.randn(1, 6, CFG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    a = cn.common_ksampler(m, 3, 2, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
    b = cn.common_ksampler(fused, 3, 2, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]
    assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))


def test_sparse_attention_reports_adapter_gates(bases, comfy, tiny_ckpts):
    from ditkit.nodes.adapters import apply_h3_adapter
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    m, _ = apply_h3_adapter(bases["comfy"], str(tiny_ckpts / c.FASTH3_ADAPTER), 1.0)
    out = DitKitSparseAttention.execute(m)
    text = json.dumps(out.ui) if out.ui else ""
    assert "to_gate_compress (loader attachment)" in text
    base_out = DitKitSparseAttention.execute(bases["comfy"])
    assert "to_gate_compress (loader attachment)" not in json.dumps(base_out.ui)


# ------------------------------------------------------------------ real writers
@contextlib.contextmanager
def _clean_path():
    """The repo root's top-level ``kernels`` folder shadows HF ``kernels`` for transformers (flat layout)."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != REPO]
    try:
        yield
    finally:
        sys.path[:] = saved


def _tiny_tree(names):
    """An nn.Module tree holding a Linear at each dotted name (the writers name keys after the module path)."""
    root = torch.nn.Module()
    for name, o, n in names:
        parent = root
        parts = name.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.add_module(parts[-1], torch.nn.Linear(n, o, bias=False))
    return root


def _forward_delta(tree, name):
    mod = tree.get_submodule(name)
    eye = torch.eye(mod.in_features if hasattr(mod, "in_features") else mod.base_layer.in_features)
    return mod(eye).T.double()


def test_peft_written_file_loads_with_zero_unused(bases, tmp_path):
    with _clean_path():
        peft = pytest.importorskip("peft")
    model = bases["comfy"]
    base = base_sd(model)
    tree = _tiny_tree(ORIG)
    ref_w = {n: tree.get_submodule(n).weight.detach().double().clone() for n, _, _ in ORIG}
    pm = peft.get_peft_model(tree, peft.LoraConfig(r=RANK, lora_alpha=6, target_modules=[n for n, _, _ in ORIG],
                                                   init_lora_weights=False))
    pm.save_pretrained(str(tmp_path / "peft_out"))
    path = tmp_path / "peft_out" / "adapter_model.safetensors"
    from ditkit.nodes.adapters import apply_h3_adapter

    m, plan = apply_h3_adapter(model, str(path), 1.0, qkv_layout="interleaved")
    assert not plan.unused and len(plan.items) == len(ORIG) and plan.layout == "interleaved"
    assert all("PEFT lora_alpha/r = 6/4" in it.scale_rule for it in plan.items)
    worst = 0.0
    for n, _, _ in ORIG:
        d = _forward_delta(pm.base_model.model, n) - ref_w[n]     # what PEFT's own forward adds
        if n.endswith("qkv_proj"):
            d = interleaved_to_comfy(d)
        k = f"diffusion_model.{n}.weight"
        worst = max(worst, (patched(m, k).double() - base[k].double() - d).abs().max().item() / d.abs().max().item())
    assert worst <= 1e-5


@pytest.mark.parametrize("algo", ["lokr", "loha"])
def test_lycoris_written_file_loads_with_zero_unused(bases, tmp_path, algo):
    with _clean_path():
        lyc = pytest.importorskip("lycoris")
        from lycoris import create_lycoris

    model = bases["comfy"]
    base = base_sd(model)
    names = [(n, o, i) for n, o, i in ORIG if not n.startswith("token_refiner")]
    tree = _tiny_tree(names)
    ref_w = {n: tree.get_submodule(n).weight.detach().double().clone() for n, _, _ in names}
    torch.manual_seed(0)
    net = create_lycoris(tree, 1.0, linear_dim=RANK, linear_alpha=2.0, algo=algo, factor=4)
    net.apply_to()
    for name, p in net.named_parameters():
        if "w1" in name or "w2" in name or "hada" in name:
            torch.nn.init.normal_(p, std=0.4 if algo == "loha" else 0.1)
    sd = net.state_dict()
    sd = {k: v.detach().contiguous() for k, v in sd.items()}
    path = tmp_path / f"{algo}.safetensors"
    save_file(sd, path)
    from ditkit.nodes.adapters import apply_h3_adapter

    m, plan = apply_h3_adapter(model, str(path), 1.0, qkv_layout="contiguous")
    assert not plan.unused and len(plan.items) == len(names)
    worst = 0.0
    with torch.no_grad():
        for n, _, _ in names:
            d = _forward_delta(tree, n) - ref_w[n]
            k = f"diffusion_model.{n}.weight"
            worst = max(worst, (patched(m, k).double() - base[k].double() - d).abs().max().item() / d.abs().max().item())
    assert worst <= 1e-5, worst
    del lyc


# ------------------------------------------------------------------ bad input
def _bad_cases():
    g = torch.Generator().manual_seed(9)
    a, b = _rand(g, RANK, H), _rand(g, 3 * INNER, RANK)
    q = "diffusion_model.blocks.0.attn.qkv_proj"
    return {
        "wrong_shape": ({f"{q}.lora_down.weight": a, f"{q}.lora_up.weight": _rand(g, 3 * INNER - 1, RANK)},
                        "shape", "lora_down"),
        "unknown_prefix": ({"diffusion_model.blocks.0.attn.nope.lora_down.weight": a,
                            "diffusion_model.blocks.0.attn.nope.lora_up.weight": b}, "matches no", "attn.nope"),
        "mixed_layouts": ({f"{q}.lora_down.weight": a, f"{q}.lora_up.weight": b,
                           "diffusion_model.transformer_blocks.1.attn.to_q.lora_down.weight": a.clone(),
                           "diffusion_model.transformer_blocks.1.attn.to_q.lora_up.weight": b[:INNER].clone()},
                          "mixed layouts", "to_q"),
        "alpha_zero": ({f"{q}.lora_down.weight": a, f"{q}.lora_up.weight": b, f"{q}.alpha": torch.tensor(0.0)},
                       "alpha", f"{q}.alpha"),
        "alpha_nan": ({f"{q}.lora_down.weight": a, f"{q}.lora_up.weight": b, f"{q}.alpha": torch.tensor(float("nan"))},
                      "alpha", f"{q}.alpha"),
        "set_weight_shape": ({"transformer_blocks.0.attn.to_gate_compress.set_weight": _rand(g, INNER, H + 1)},
                             "assigned weight", "to_gate_compress.set_weight"),
        "nan_factor": ({f"{q}.lora_down.weight": a * float("nan"), f"{q}.lora_up.weight": b}, "NaN", "lora_down"),
        "unknown_suffix": ({f"{q}.lora_down.weight": a, f"{q}.lora_up.weight": b, f"{q}.weird": a.clone()}, "not an adapter",
                           f"{q}.weird"),
        "dora": ({f"{q}.lora_down.weight": a, f"{q}.lora_up.weight": b, f"{q}.dora_scale": a[:1].clone()}, "DoRA", "dora_scale"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_refused_naming_the_key_base_untouched(bases, tmp_path, case):
    from ditkit.nodes.adapters import apply_h3_adapter

    sd, word, key = _bad_cases()[case]
    model = bases["comfy"]
    before = base_sd(model)
    p = write(tmp_path, "bad", sd, {}, None, f"{case}.safetensors")
    with pytest.raises(DitKitError) as e:
        apply_h3_adapter(model, str(p), 1.0, qkv_layout="contiguous")
    assert word in str(e.value) and key in str(e.value), str(e.value)
    assert not model.patches
    after = base_sd(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_undetermined_scale_refused_then_scale_input(bases, tmp_path):
    from ditkit.nodes.adapters import apply_h3_adapter

    g = torch.Generator().manual_seed(3)
    q = "lycoris_blocks_0_attn_out_proj"
    a, b = _rand(g, RANK, INNER), _rand(g, H, RANK)
    p = write(tmp_path, "noalpha", {q + ".lora_down.weight": a, q + ".lora_up.weight": b}, {}, None)
    with pytest.raises(AdapterError, match="does not determine the scale") as e:
        apply_h3_adapter(bases["comfy"], str(p), 1.0)
    assert "'scale' input" in str(e.value)
    m, plan = apply_h3_adapter(bases["comfy"], str(p), 1.0, scale=0.25)
    k = "diffusion_model.blocks.0.attn.out_proj.weight"
    base = base_sd(bases["comfy"])
    r = base[k].double() + 0.25 * (b.double() @ a.double())
    assert (patched(m, k).double() - r).abs().max().item() <= 1e-6 * (r - base[k].double()).abs().max().item()
    assert "node 'scale' input" in plan.items[0].scale_rule


def test_node_execute_report_and_lokr_passthrough(bases, comfy, tiny_ckpts, tmp_path):
    import folder_paths

    from ditkit.nodes.adapters import DitKitAdapterLoader

    folder_paths.add_model_folder_path("loras", str(tiny_ckpts / "loras"))
    out = DitKitAdapterLoader.execute(bases["official"], "h3_diffsynth_lora_tiny.safetensors", 1.0)
    text = out.result[1]
    assert "qkv layout: interleaved" in text and "0 keys unused" in text and "DiffSynth-Studio" in text
    assert out.ui["ditkit_report"][0]["node_type"] == "DitKitAdapterLoader"
    import comfy.sd

    f2 = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "flux2_tiny.safetensors"))
    o2 = DitKitAdapterLoader.execute(f2, "flux2_lokr_tiny.safetensors", 0.5)
    assert "LoKr" in o2.result[1] and o2.result[0].patches
    with pytest.raises(AdapterError, match="qkv_layout"):
        DitKitAdapterLoader.execute(f2, "flux2_lokr_tiny.safetensors", 0.5, qkv_layout="interleaved")


def test_errors_are_ditkit_errors():
    assert issubclass(AdapterError, DitKitError) and math.isfinite(1.0)


# ------------------------------------------------------------------ FastH3 base with gates, quantized bases
def test_fasth3_base_gates_blend_and_survive_other_adapters(comfy, tiny_ckpts):
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.adapters import apply_h3_adapter
    from ditkit.nodes.h3_loaders import GATE_ATTACHMENT, load_h3_model

    base, _ = load_h3_model(str(tiny_ckpts / c.FASTH3_FILE))
    g0 = base.get_attachment(GATE_ATTACHMENT)
    assert sorted(g0) == [0, 1]
    g0_copy = {i: w.clone() for i, w in g0.items()}
    new = load_file(tiny_ckpts / c.FASTH3_ADAPTER)
    lora, _ = apply_h3_adapter(base, str(tiny_ckpts / c.DIFFSYNTH_LORA), 1.0)
    assert lora.get_attachment(GATE_ATTACHMENT) is g0                 # a plain LoRA keeps the base's gates
    # the tiny FastH3 adapter assigns the same gates the FastH3 base has: blend a perturbed copy instead
    import tempfile

    pert = {k: (v.float() + 0.25).to(v.dtype) if k.endswith("to_gate_compress.set_weight") else v for k, v in new.items()}
    with tempfile.TemporaryDirectory() as td:
        p = Path(td) / "gates.safetensors"
        save_file(pert, p, metadata=c.fasth3_adapter_metadata(pert))
        m, plan = apply_h3_adapter(base, str(p), 0.5)
    g = m.get_attachment(GATE_ATTACHMENT)
    for i in (0, 1):
        k = f"transformer_blocks.{i}.attn.to_gate_compress.set_weight"
        want = (g0[i].double() + 0.5 * (pert[k].double() - g0[i].double())).to(pert[k].dtype)
        assert torch.equal(g[i], want)
    assert base.get_attachment(GATE_ATTACHMENT) is g0 and all(torch.equal(g0[i], g0_copy[i]) for i in g0)


def _h3_comfy_quant(sd, fmt, convrot=False):
    out = {}
    for k, v in sd.items():
        if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2 and "adaln" not in k:
            p, w = k[: -len("weight")], v.float()
            qmax = 448.0 if fmt == "float8_e4m3fn" else 127.0
            s = w.abs().max() / qmax
            out[k] = (w / s).to(torch.float8_e4m3fn) if fmt == "float8_e4m3fn" else \
                torch.round(w / s).clamp(-127, 127).to(torch.int8)
            out[p + "weight_scale"] = s.reshape(())
            js = {"format": fmt, **({"convrot": True, "convrot_groupsize": 64} if convrot else {})}
            out[p + "comfy_quant"] = torch.tensor(list(json.dumps(js).encode()), dtype=torch.uint8)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise"])
def test_quantized_h3_base_requantized_bit_exact_and_saved_same_scheme(comfy, tmp_path, fmt):
    """Per-tensor comfy_quant fp8 / int8 H3 layers: ditkit dequantizes, adds ΔW (DiffSynth interleave mapped) and
    requantizes in row chunks into the same layout; what ModelSave writes equals, bit for bit, the host's own
    layout quantize of (float64 dequant(base) + float64 ΔW, interleave undone here) rounded to float32."""
    import comfy.model_management
    import comfy.quant_ops
    import comfy.sd
    import comfy.utils

    from ditkit.nodes.adapters import apply_h3_adapter, report_text

    if fmt not in comfy.quant_ops.QUANT_ALGOS:
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    q = comfy.sd.load_diffusion_model_state_dict(_h3_comfy_quant(c.base_state_dict(), fmt))
    sd, meta, cfg, expect = build("diffsynth", seed=4)
    keys = [k for k in expect if k.startswith("diffusion_model.blocks.")]
    base = {k: comfy.utils.get_attr(q.model, k) for k in keys}
    before = {k: w._qdata.clone() for k, w in base.items()}
    m, plan = apply_h3_adapter(q, str(write(tmp_path, "diffsynth", sd, meta, cfg)), 0.5)
    names = [k[len("diffusion_model."):-len(".weight")] for k in keys]
    saved = saved_weights(m, tmp_path, names)
    comfy.model_management.unload_all_models()   # the clone shares q's modules while it is loaded
    assert any("qkv_proj" in k for k in keys)
    for name, k in zip(names, keys):
        d = torch.zeros(tuple(base[k].shape), dtype=torch.float64)
        for rows, delta in expect[k]:
            d[slice(*rows) if rows else slice(None)] += 0.5 * delta
        want, want_scale = host_requant_oracle(base[k], d)
        got = saved[name]
        assert json_format(got["comfy_quant"]) == fmt
        assert torch.equal(bits(got["weight"]), bits(want)), name
        assert torch.equal(bits(got["weight_scale"].float().reshape(())), bits(want_scale.float().reshape(()))), name
        assert torch.equal(comfy.utils.get_attr(q.model, k)._qdata, before[k])   # input model untouched
    assert not q.patches and not q.object_patches
    text = report_text(plan, "f", 0.5, None, "auto")
    assert all(f"note: quantized layer {n}.weight: requantized {fmt} in 1 row chunks, reference quantize" in text for n in names)


def test_assigned_weight_onto_quantized_h3_layer_uses_its_values(comfy, tmp_path):
    """``.set_weight`` onto an fp8 layer: W_base + (W_new - W_base) with W_base the layer's VALUES (its state dict
    holds the raw fp8 codes); the saved layer is W_new within one fp8 step (e4m3: 2^-3 relative, or the scale)."""
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    from ditkit.nodes.adapters import apply_h3_adapter

    q = comfy.sd.load_diffusion_model_state_dict(_h3_comfy_quant(c.base_state_dict(), "float8_e4m3fn"))
    k = "diffusion_model.blocks.0.attn.out_proj.weight"
    w0 = comfy.utils.get_attr(q.model, k)
    new = (w0._qdata.double() * w0._params.scale.double() * 0.5 + 0.01).float()
    p = tmp_path / "assign.safetensors"
    save_file({"transformer_blocks.0.attn.to_out.0.set_weight": new}, str(p), metadata={"format": "fastvideo-lora-v2"})
    m, _ = apply_h3_adapter(q, str(p), 1.0)
    got = saved_weights(m, tmp_path, ["blocks.0.attn.out_proj"])["blocks.0.attn.out_proj"]
    comfy.model_management.unload_all_models()
    s = got["weight_scale"].double()
    err = (got["weight"].double() * s - new.double()).abs()
    assert (err / new.double().abs().clamp_min(float(s))).max().item() <= 0.125 + 1e-6
