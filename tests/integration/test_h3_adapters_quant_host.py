"""DitKitAdapterLoader onto the quantized H3 bases users download (issue #30), in the real host (CPU):
int8 ConvRot per-channel (the Comfy-Org repack format, pruned and unpruned), mxfp8 and nvfp4, every base written by
``tiny/ckpt_h3.comfy_quant_state_dict`` with the HOST's own layout quantize (``tests/support/quant_oracle``).

fuse:   the requantized layer equals, code for code, the host's layout quantize of the WHOLE
        (float64 dequant(base) + float64 ΔW) rounded to float32, ΔW written here from the factors (interleave,
        row thirds, Kronecker, Hadamard done by hand); ModelSave writes the same scheme.
bypass: the layer's output equals base(x) + s·ΔW x in float64 within float32 rounding; the weight is untouched.
"""
from __future__ import annotations

import json

import pytest
import torch

from ditkit.errors import AdapterError
from ditkit.loaders.safetensors_io import save_file
from ditkit.tiny import ckpt_h3 as c
from tests.integration.test_h3_adapters_host import build, write
from tests.support.quant_oracle import bits, host_quantize_layer, host_requant_whole, saved_weights

FORMATS = ("int8_convrot", "mxfp8", "nvfp4")


def quant_base(fmt: str, curve: bool = False, edit=None):
    import comfy.sd

    sd = c.base_state_dict()
    if curve:
        sd = c.curve_state_dict(sd)
    q = c.comfy_quant_state_dict(sd, fmt, host_quantize_layer)
    if edit:
        edit(q)
    return comfy.sd.load_diffusion_model_state_dict(q)


def _expect_full(expect, key, shape, strength):
    d = torch.zeros(shape, dtype=torch.float64)
    for rows, delta in expect[key]:
        d[slice(*rows) if rows else slice(None)] += strength * delta
    return d


def _qt(m, k):
    import comfy.utils

    w = comfy.utils.get_attr(m.model, k)
    return w.data if isinstance(w, torch.nn.Parameter) else w


def _same_qt(a, b, what):
    assert torch.equal(bits(a._qdata), bits(b._qdata)), f"{what}: codes differ"
    pa, pb = a._params, b._params
    for f in ("scale", "block_scale"):
        x, y = getattr(pa, f, None), getattr(pb, f, None)
        if x is not None or y is not None:
            assert tuple(x.shape) == tuple(y.shape) and torch.equal(bits(x), bits(y)), f"{what}: {f} differs"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("adapter", ["diffsynth", "diffusers", "lokr", "loha"])
def test_fused_onto_host_layouts_code_for_code(comfy, tmp_path, fmt, adapter):
    from ditkit.nodes.adapters import apply_h3_adapter, report_text

    q = quant_base(fmt)
    sd, meta, cfg, expect = build(adapter, seed=5)
    qkv_layout = "interleaved" if adapter in ("lokr", "loha") else "auto"
    keys = [k for k in expect if _qt(q, k).__class__.__name__ == "QuantizedTensor"]
    assert any("qkv_proj" in k for k in keys) and len(keys) >= 3
    before = {k: _qt(q, k)._qdata.clone() for k in keys}
    m, plan = apply_h3_adapter(q, str(write(tmp_path, adapter, sd, meta, cfg)), 0.75, qkv_layout=qkv_layout)
    for k in keys:
        base = _qt(q, k)
        want = host_requant_whole(base, _expect_full(expect, k, tuple(base.shape), 0.75))
        got = m.object_patches[k]
        _same_qt(got.data, want, k)
        assert torch.equal(_qt(q, k)._qdata, before[k])          # input model untouched
    assert not q.patches and not q.object_patches
    text = report_text(plan, "f", 0.75, None, qkv_layout)
    assert "host layout quantize" in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_saved_by_modelsave_same_scheme(comfy, tmp_path, fmt):
    import comfy.model_management

    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base(fmt)
    sd, meta, cfg, expect = build("diffsynth", seed=6)
    m, _ = apply_h3_adapter(q, str(write(tmp_path, "diffsynth", sd, meta, cfg)), -0.5)
    k = "diffusion_model.blocks.1.attn.qkv_proj.weight"
    saved = saved_weights(m, tmp_path, ["blocks.1.attn.qkv_proj"])["blocks.1.attn.qkv_proj"]
    comfy.model_management.unload_all_models()
    want = host_requant_whole(_qt(q, k), _expect_full(expect, k, tuple(_qt(q, k).shape), -0.5))
    assert torch.equal(bits(saved["weight"]), bits(want._qdata))
    conf = json.loads(bytes(saved["comfy_quant"].tolist()).decode())
    if fmt == "int8_convrot":
        assert conf == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}
        assert torch.equal(bits(saved["weight_scale"]), bits(want._params.scale))
    else:
        assert conf["format"] == fmt


def test_fused_onto_pruned_int8_convrot(comfy, tmp_path):
    """The recommended 24 GB base: pruned (curve-form AdaLN kept fp16) + int8 ConvRot block linears."""
    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base("int8_convrot", curve=True)
    assert _qt(q, "diffusion_model.blocks.0.adaln_proj.linear.weight").__class__.__name__ != "QuantizedTensor"
    sd, meta, cfg, expect = build("kohya", seed=7, qkv="contiguous", curve=True)
    m, _ = apply_h3_adapter(q, str(write(tmp_path, "kohya", sd, meta, cfg)), 1.0)
    for k in expect:
        base = _qt(q, k)
        _same_qt(m.object_patches[k].data, host_requant_whole(base, _expect_full(expect, k, tuple(base.shape), 1.0)),
                 k)


def test_convrot_group_not_dividing_width_refused_naming_layer(comfy, tmp_path):
    from ditkit.nodes.adapters import apply_h3_adapter

    def edit(sd):   # out_proj is 96 wide: a group-64 marker on it does not divide (a mislabelled file)
        k = "blocks.0.attn.out_proj.comfy_quant"
        sd[k] = torch.tensor(list(json.dumps({"format": "int8_tensorwise", "convrot": True,
                                              "convrot_groupsize": 64}).encode()), dtype=torch.uint8)

    q = quant_base("int8_convrot", edit=edit)
    sd, meta, cfg, _ = build("diffsynth", seed=4)
    with pytest.raises(AdapterError, match=r"layer 'diffusion_model\.blocks\.0\.attn\.out_proj\.weight' \(int8_tensorwise "
                                           r"ConvRot\): convrot_groupsize 64 does not divide its width 96"):
        apply_h3_adapter(q, str(write(tmp_path, "diffsynth", sd, meta, cfg)), 1.0)
    assert not q.patches and not q.object_patches


def test_unrequantizable_host_layout_refused_by_name(comfy, tmp_path):
    """convrot_w4a4: the host's own quantize needs calibration inputs it does not store: refused by layer name."""
    import comfy.quant_ops as qo

    from ditkit.bridge import quant_requant

    cls = qo.get_layout_class("TensorWiseINT8Layout")
    d, p = cls.quantize(torch.randn(8, 16), scale="recalculate")
    fake = qo.QuantizedTensor(d, "TensorWiseINT8Layout", p)
    object.__setattr__(fake, "_layout_cls", "TensorCoreConvRotW4A4Layout")
    with pytest.raises(quant_requant.LayerRefused, match="'blocks.9.x.weight' is stored in the host layout "
                                                         "TensorCoreConvRotW4A4Layout"):
        quant_requant.classify(fake, "blocks.9.x.weight")


def test_contract_probe_holds_on_this_host(comfy):
    from ditkit.bridge import quant_requant

    assert quant_requant._host_layouts().state == "holds"


# ------------------------------------------------------------------ bypass mode
def _swiglu(a):
    g, v = a.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * v


def _run_injected(m, fn):
    for inj in m.injections["ditkit_bypass"]:
        inj.inject(m)
    try:
        return fn()
    finally:
        for inj in m.injections["ditkit_bypass"]:
            inj.eject(m)


@pytest.mark.parametrize("fmt", FORMATS + ("float",))
@pytest.mark.parametrize("adapter", ["diffsynth", "diffusers", "lokr", "loha"])
def test_bypass_output_equals_float64_reference(comfy, tmp_path, fmt, adapter):
    """y = base(x) + s·ΔW x with the weight untouched: qkv (row maps / thirds), out_proj, fc1 and fc2 (the mlp hook;
    the host's linear_input_act would skip a hook on fc2 of an int8 base) within float32 rounding of float64."""
    import comfy.sd
    import comfy.utils

    from ditkit.nodes.adapters import apply_h3_adapter, report_text

    q = comfy.sd.load_diffusion_model_state_dict(c.base_state_dict()) if fmt == "float" else quant_base(fmt)
    sd, meta, cfg, expect = build(adapter, seed=8)
    lay = "interleaved" if adapter in ("lokr", "loha") else "auto"
    before = {k: comfy.utils.get_attr(q.model, k).detach().clone() for k in expect}
    m, plan = apply_h3_adapter(q, str(write(tmp_path, adapter, sd, meta, cfg)), 0.6, qkv_layout=lay, mode="bypass")
    assert not m.patches and not m.object_patches
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for k in expect:
        mod_key = k.rsplit(".", 1)[0]
        lin = comfy.utils.get_attr(m.model, mod_key)
        d = _expect_full(expect, k, tuple(lin.weight.shape), 0.6)
        if mod_key.endswith("mlp.fc2"):
            mlp = comfy.utils.get_attr(m.model, mod_key[: -len(".fc2")])
            x = torch.randn(5, mlp.fc1.weight.shape[1], generator=g)
            base = mlp(x)
            a = mlp.fc1(x)
            ref = base.double() + _swiglu(a.double()) @ d.T
            got = _run_injected(m, lambda: mlp(x))
        else:
            x = torch.randn(5, lin.weight.shape[1], generator=g)
            base = lin(x)
            ref = base.double() + x.double() @ d.T
            got = _run_injected(m, lambda: lin(x))
        err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
        worst = max(worst, err)
        assert err <= 2e-6, (k, err)
        assert torch.equal(bits(comfy.utils.get_attr(q.model, k).detach()), bits(before[k]))
    text = report_text(plan, "f", 0.6, None, lay)
    assert adapter == "diffusers" or ("bypass layer blocks.0.mlp.fc2" in text and "hooked on the parent mlp" in text)
    print(f"bypass {fmt} {adapter}: worst relative error {worst:.3g}")


def test_fused_then_bypassed_on_one_layer_refused(comfy, tmp_path):
    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base("int8_convrot")
    sd, meta, cfg, _ = build("diffsynth", seed=4)
    p = str(write(tmp_path, "diffsynth", sd, meta, cfg))
    fused, _ = apply_h3_adapter(q, p, 1.0)
    with pytest.raises(AdapterError, match=r"layer 'diffusion_model\.blocks\.\d\.[a-z_.0-9]+\.weight' already carries a "
                                           r"fused adapter.*Set 'mode' to fuse"):
        apply_h3_adapter(fused, p, 1.0, mode="bypass")
    byp, _ = apply_h3_adapter(q, p, 1.0, mode="bypass")
    with pytest.raises(AdapterError, match=r"already carries an adapter in bypass mode.*Set 'mode' to bypass"):
        apply_h3_adapter(byp, p, 1.0)
    two, plan = apply_h3_adapter(byp, p, 0.5, mode="bypass")     # two bypassed: stacked on one hook per layer
    assert any("2 deltas" in n for n in plan.notes)
    assert not byp.patches and not q.injections


def test_bypass_contract_probe_holds(comfy):
    from ditkit.bridge import adapter_bypass

    assert adapter_bypass._bypass_contract().state == "holds"


def _sample(m):
    import nodes as cn
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    latent = EmptyMiniMaxH3LatentAV.execute(64, 64, 5).result[0]
    cond = [[torch.randn(1, 6, c.CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    return cn.common_ksampler(m, 3, 2, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]


@pytest.mark.parametrize("fmt", FORMATS + ("float",))
def test_bypass_runs_in_host_sampling_and_ejects(comfy, tmp_path, fmt):
    """A 2-step KSampler run: the host injects ditkit's hooks while the clone is loaded (the sample moves), and
    ejects them after (the base samples as before, every forward restored). On a float base the bypass sample
    equals the fused one within float32 rounding."""
    import comfy.model_management
    import comfy.sd

    from ditkit.nodes.adapters import apply_h3_adapter

    q = comfy.sd.load_diffusion_model_state_dict(c.base_state_dict()) if fmt == "float" else quant_base(fmt)
    sd, meta, cfg, _ = build("diffsynth", seed=9)
    p = str(write(tmp_path, "diffsynth", sd, meta, cfg))
    base0 = _sample(q)
    m, _ = apply_h3_adapter(q, p, 0.8, mode="bypass")
    got = _sample(m)
    comfy.model_management.unload_all_models()
    base1 = _sample(q)
    comfy.model_management.unload_all_models()
    assert all(torch.equal(x, y) for x, y in zip(base0.unbind(), base1.unbind()))
    diff = max((x - y).abs().max().item() for x, y in zip(got.unbind(), base0.unbind()))
    assert diff > 1e-3
    for mod in q.model.modules():   # the host's eject re-assigns the bound original: it must be the class's own
        f = vars(mod).get("forward")
        assert f is None or (getattr(f, "__func__", None) is type(mod).forward and f.__self__ is mod), mod
    if fmt == "float":
        f, _ = apply_h3_adapter(q, p, 0.8)
        ref = _sample(f)
        comfy.model_management.unload_all_models()
        err = max((x - y).abs().max().item() / y.abs().max().item() for x, y in zip(got.unbind(), ref.unbind()))
        assert err <= 1e-4, err


# ------------------------------------------------------------------ Turbo-style LoRA (AdaLN pairs)
def _turbo(tmp_path, adaln=True):
    p = tmp_path / "turbo" / "minimax_h3_fl2v_turbo_tiny.safetensors"
    p.parent.mkdir(exist_ok=True)
    save_file(c.turbo_lora_state_dict(adaln=adaln), p)
    return str(p)


@pytest.mark.parametrize("mode", ["fuse", "bypass"])
def test_turbo_lora_adaln_pairs_on_pruned_base_refused_naming_the_file(comfy, tmp_path, mode):
    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base("int8_convrot", curve=True)
    with pytest.raises(AdapterError, match=r"'diffusion_model\.blocks\.0\.adaln_proj\.linear\.lora_down\.weight' is an "
                                           r"AdaLN pair of a Turbo.*32-wide silu\(t_emb\).*65-point grid.*"
                                           r"unpruned checkpoint.*minimax_h3_fl2va_int8_convrot\.safetensors"):
        apply_h3_adapter(q, _turbo(tmp_path), 1.0, mode=mode)
    assert not q.patches and not q.object_patches and not q.injections


@pytest.mark.parametrize("mode", ["fuse", "bypass"])
def test_turbo_lora_on_unpruned_int8_convrot_base(comfy, tmp_path, mode):
    """The Turbo-style LoRA with AdaLN pairs on the unpruned int8 ConvRot repack (AdaLN quantized, group 16 at the
    tiny width 32): fused code for code / bypassed within float32 rounding on the AdaLN layer."""
    import comfy.utils

    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base("int8_convrot")
    k = "diffusion_model.blocks.1.adaln_proj.linear.weight"
    base = _qt(q, k)
    assert base.__class__.__name__ == "QuantizedTensor" and base._params.convrot_groupsize == 16
    sd = c.turbo_lora_state_dict()
    pre = "diffusion_model.blocks.1.adaln_proj.linear."
    d = sd[pre + "lora_up.weight"].double() @ sd[pre + "lora_down.weight"].double()   # alpha = rank: scale 1
    m, plan = apply_h3_adapter(q, _turbo(tmp_path), 0.9, mode=mode)
    if mode == "fuse":
        _same_qt(m.object_patches[k].data, host_requant_whole(base, 0.9 * d), k)
    else:
        lin = comfy.utils.get_attr(m.model, k[: -len(".weight")])
        x = torch.randn(3, d.shape[1], generator=torch.Generator().manual_seed(2))
        ref = lin(x).double() + 0.9 * (x.double() @ d.T)
        got = _run_injected(m, lambda: lin(x))
        assert (got.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
        assert any("bypass layer blocks.1.adaln_proj.linear" in n for n in plan.notes)
