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
