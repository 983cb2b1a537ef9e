"""Bad input around the adapters on the quantized H3 bases users download (issue #30, "Bad input"), in the real host
(CPU): each case is refused with a message naming the key and the input that fixes it, and nothing is modified.

* a scale tensor missing: ComfyUI's own loader stops after reading the whole file (``Missing INT8 weight scale``,
  for fp8 an AttributeError inside comfy_kitchen), so the adapter never sees such a base; DitKitH3ModelLoader refuses
  it from the headers, before a tensor is read;
* a ConvRot group that does not divide the width (or is not a power of 4): ComfyUI loads the file; DitKitH3ModelLoader
  refuses it at its marker, the adapter loader (a base loaded by UNETLoader) names the layer and the model input;
* another partition (fl2va vs ref2va): the two have the same keys and shapes, so the only signal a file carries is a
  pruned adapter's own ``adaln_t_table`` (refused above ComfyUI's 1e-3 tolerance, both sides of it tested here);
  otherwise the report says which partition the adapter names and that it was not verified.
"""
from __future__ import annotations

import json

import pytest
import torch

from ditkit.errors import AdapterError, CheckpointError
from ditkit.loaders.safetensors_io import load_file, save_file
from ditkit.tiny import ckpt_h3 as c
from tests.integration.test_h3_adapters_host import build, write
from tests.integration.test_h3_adapters_quant_host import quant_base
from tests.support.quant_oracle import host_quantize, host_quantize_layer

QKV = "blocks.0.attn.qkv_proj."


def _marker(obj) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


def _fp8_repack() -> dict[str, torch.Tensor]:
    """The tiny H3 with its block linears as comfy_quant float8_e4m3fn (the host's own quantize)."""
    sd = c.base_state_dict()
    for k in c.quantized_layer_keys(sd):
        p = k[: -len("weight")]
        for suffix, t in host_quantize(sd.pop(k).float(), "float8_e4m3fn").items():
            sd[p + "weight" + suffix] = t
        sd[p + "comfy_quant"] = _marker({"format": "float8_e4m3fn"})
    return sd


def _repack(fmt: str) -> dict[str, torch.Tensor]:
    return _fp8_repack() if fmt == "fp8" else c.comfy_quant_state_dict(c.base_state_dict(), fmt, host_quantize_layer)


def _save(tmp_path, name, sd) -> str:
    p = tmp_path / name
    save_file(sd, p)
    return str(p)


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Any tensor read fails the test: the refusal must come from the headers."""
    from ditkit.loaders import safetensors_io

    def boom(self, name, *a, **k):
        raise AssertionError(f"tensor {name!r} was read before the refusal")

    monkeypatch.setattr(safetensors_io.SafeFile, "get", boom)
    monkeypatch.setattr(safetensors_io.SafeFile, "read_rows_into", boom)


# ------------------------------------------------------------------ a scale tensor missing
@pytest.mark.parametrize("fmt,drop", [("int8_convrot", "weight_scale"), ("mxfp8", "weight_scale"),
                                      ("nvfp4", "weight_scale"), ("nvfp4", "weight_scale_2"), ("fp8", "weight_scale")])
def test_missing_scale_refused_by_the_h3_loader_from_the_headers(comfy, tmp_path, fmt, drop, request):
    from ditkit.nodes.h3_loaders import load_h3_model

    sd = _repack(fmt)
    del sd[QKV + drop]
    path = _save(tmp_path, f"minimax_h3_fl2va_{fmt}_cut.safetensors", sd)
    request.getfixturevalue("no_tensor_reads")
    with pytest.raises(CheckpointError, match=rf"quantized weight '{QKV}weight' \(\w+\) has no '{QKV}{drop}' \(its "
                                              r"scale tensor\).*DitKitH3ModelLoader 'model_name'"):
        load_h3_model(path)


@pytest.mark.parametrize("fmt", ["int8_convrot", "mxfp8", "nvfp4", "fp8"])
def test_complete_repacks_still_load(comfy, tmp_path, fmt):
    """The other side of the check: every scale present -> the file loads (nvfp4: U8 codes with e4m3 block scales
    and its weight_scale_2; fp8: F8 codes, one scale) and the layer is quantized as stored."""
    import comfy.utils

    from ditkit.nodes.h3_loaders import load_h3_model

    m, _ = load_h3_model(_save(tmp_path, f"h3_{fmt}.safetensors", _repack(fmt)))
    w = comfy.utils.get_attr(m.model, "diffusion_model." + QKV + "weight")
    assert type(w.data).__name__ == "QuantizedTensor"


def test_missing_scale_host_loader_itself_fails_late(comfy):
    """Why the check lives in the model loader: ComfyUI's own load of the same state dict fails inside the host
    (after every tensor was read) and the adapter loader never gets such a model."""
    import comfy.sd

    sd = _repack("int8_convrot")
    del sd[QKV + "weight_scale"]
    with pytest.raises(ValueError, match="Missing INT8 weight scale"):
        comfy.sd.load_diffusion_model_state_dict(sd)


# ------------------------------------------------------------------ ConvRot group not dividing the width
@pytest.mark.parametrize("group,why", [(64, "does not divide the weight's width 96"),
                                       (8, "is not a power of 4")])
def test_convrot_group_refused_by_the_h3_loader(comfy, tmp_path, group, why):
    from ditkit.nodes.h3_loaders import load_h3_model

    sd = _repack("int8_convrot")   # out_proj is 96 wide (group 16 in the tiny repack)
    sd["blocks.0.attn.out_proj.comfy_quant"] = _marker({"format": "int8_tensorwise", "convrot": True,
                                                        "convrot_groupsize": group})
    with pytest.raises(CheckpointError, match=rf"marker 'blocks\.0\.attn\.out_proj\.comfy_quant' says convrot_groupsize "
                                              rf"{group}, which {why}.*DitKitH3ModelLoader 'model_name'"):
        load_h3_model(_save(tmp_path, "minimax_h3_fl2va_int8_convrot.safetensors", sd))


def test_convrot_group_mismatch_on_a_unet_loader_base_names_the_model_input(comfy, tmp_path):
    """The same file loaded by ComfyUI (UNETLoader path): the adapter loader refuses the layer, naming the key and
    what to re-load, in either mode's fuse check; nothing registered, the base untouched."""
    from ditkit.nodes.adapters import apply_h3_adapter

    def edit(sd):
        sd["blocks.0.attn.out_proj.comfy_quant"] = _marker({"format": "int8_tensorwise", "convrot": True,
                                                            "convrot_groupsize": 64})

    q = quant_base("int8_convrot", edit=edit)
    sd, meta, cfg, _ = build("diffsynth", seed=4)
    with pytest.raises(AdapterError, match=r"'diffusion_model\.blocks\.0\.attn\.out_proj\.weight' .*does not divide its "
                                           r"width 96.*re-download or re-export the base.*'model_name'"):
        apply_h3_adapter(q, str(write(tmp_path, "diffsynth", sd, meta, cfg)), 1.0)
    assert not q.patches and not q.object_patches and not q.injections


# ------------------------------------------------------------------ another partition
def _curve_adapter(tiny_ckpts, table_shift: float) -> dict[str, torch.Tensor]:
    cur = load_file(tiny_ckpts / c.CURVE_FILE)
    w = cur["blocks.1.adaln_proj.linear.weight"].float()
    return {"diffusion_model.adaln_t_table": cur["adaln_t_table"] + table_shift,
            "diffusion_model.blocks.1.adaln_proj.linear.weight": w + 0.125}


@pytest.fixture(scope="module")
def curve_base(comfy, tiny_ckpts):
    from ditkit.nodes.h3_loaders import load_h3_model

    return load_h3_model(str(tiny_ckpts / c.CURVE_FILE))[0]


@pytest.mark.parametrize("shift,ok", [(0.9e-3, True), (1.1e-3, False)])
def test_pruned_adapter_from_another_base_refused_by_its_table(curve_base, tiny_ckpts, tmp_path, shift, ok):
    """A pruned (curve-form) adapter carries its base's adaln_t_table: a table that differs by more than ComfyUI's
    1e-3 tolerance was made on another base (the other partition or another pruning): refused naming the key and
    both inputs; within it the adapter applies."""
    from ditkit.nodes.adapters import apply_h3_adapter

    p = write(tmp_path, "curve", _curve_adapter(tiny_ckpts, shift), {}, None,
              "minimax_h3_ref2va_pruned_style_lora.safetensors")
    if ok:
        m, plan = apply_h3_adapter(curve_base, str(p), 1.0)
        assert "kept from the base" in plan.unused["diffusion_model.adaln_t_table"]
        return
    with pytest.raises(AdapterError, match=r"key 'diffusion_model\.adaln_t_table' differs from the base's adaln_t_table "
                                           r"by 0\.0011 .*the other partition, fl2va vs ref2va.*'adapter_name'.*model "
                                           r"loader's file"):
        apply_h3_adapter(curve_base, str(p), 1.0)
    assert not curve_base.patches and not curve_base.object_patches


@pytest.mark.parametrize("name,meta,says", [
    ("minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16.safetensors", {}, "names FL2VA by its file name (fl2v)"),
    ("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", {}, "names REF2VA by its file name (ref2v)"),
    ("my_lora.safetensors", {"base_model": "MiniMax-H3 Ref2VA"}, "names REF2VA by its metadata 'base_model' (ref2va)"),
    ("h3_style_lora.safetensors", {}, "names no partition"),
])
def test_partition_reported_not_verified(comfy, tmp_path, name, meta, says):
    """No structural signal tells FL2VA from Ref2VA (same keys, shapes, config): the report says what the adapter
    names and that it was not verified, for fuse and bypass, on a quantized repack."""
    from ditkit.nodes.adapters import apply_h3_adapter, report_text

    q = quant_base("int8_convrot")
    sd, _, cfg, _ = build("diffsynth", seed=4)
    p = write(tmp_path, "diffsynth", sd, meta, cfg, name)
    for mode in ("fuse", "bypass"):
        _, plan = apply_h3_adapter(q, str(p), 1.0, mode=mode)
        text = report_text(plan, name, 1.0, None, "auto")
        line = next(ln for ln in text.splitlines() if ln.startswith("note: partition: not verified"))
        assert says in line and "the loaded model does not carry its file name" in line, line


# ------------------------------------------------------------------ fused + bypassed on one layer: ComfyUI's bypass
def _host_bypass(q, layer: str):
    """ComfyUI's LoraLoaderBypass (``comfy.sd.load_bypass_lora_for_models``) with a rank-2 LoRA on ``layer``."""
    import comfy.sd
    import comfy.utils

    w = comfy.utils.get_attr(q.model, f"diffusion_model.{layer}.weight")
    g = torch.Generator().manual_seed(3)
    lora = {f"diffusion_model.{layer}.lora_up.weight": torch.randn(w.shape[0], 2, generator=g),
            f"diffusion_model.{layer}.lora_down.weight": torch.randn(2, w.shape[1], generator=g)}
    m, _ = comfy.sd.load_bypass_lora_for_models(q, None, lora, 1.0, 0.0)
    assert m.get_injections("bypass_lora")
    return m


def test_fuse_onto_a_layer_comfyui_bypasses_refused(comfy, tmp_path):
    """LoraLoaderBypass on blocks.0.attn.out_proj, then DitKitAdapterLoader fuse of a LoRA that touches it: refused
    naming the layer and what to change; the same file when the host bypasses a layer it does not touch: fused."""
    from ditkit.bridge import adapter_bypass
    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base("int8_convrot")
    sd, meta, cfg, expect = build("diffsynth", seed=4)
    p = str(write(tmp_path, "diffsynth", sd, meta, cfg))
    assert "diffusion_model.blocks.0.attn.out_proj.weight" in expect
    hb = _host_bypass(q, "blocks.0.attn.out_proj")
    assert adapter_bypass.host_bypass_modules(hb) == {"diffusion_model.blocks.0.attn.out_proj"}
    with pytest.raises(AdapterError, match=r"layer 'diffusion_model\.blocks\.0\.attn\.out_proj\.weight' already carries "
                                           r"an adapter of ComfyUI's LoraLoaderBypass.*Set 'mode' to bypass on this "
                                           r"loader and put it before LoraLoaderBypass"):
        apply_h3_adapter(hb, p, 1.0)
    assert not hb.object_patches and not hb.patches
    untouched = [k for k in ("blocks.1.attn.out_proj", "token_refiner.blocks.0.attn.out_proj")
                 if f"diffusion_model.{k}.weight" not in expect]
    assert untouched
    other = _host_bypass(q, untouched[0])
    m, _ = apply_h3_adapter(other, p, 1.0)
    assert set(m.object_patches) >= {k for k in expect if "qkv_proj" in k}


def test_unreadable_host_bypass_refused(comfy, tmp_path):
    """An injection under ComfyUI's key that does not close over a BypassInjectionManager: ditkit cannot tell which
    layers it hooks, so fuse is refused (never guessed)."""
    from comfy.patcher_extension import PatcherInjection

    from ditkit.nodes.adapters import apply_h3_adapter

    q = quant_base("int8_convrot")
    m = q.clone()
    m.set_injections("bypass_lora", [PatcherInjection(inject=lambda mp: None, eject=lambda mp: None)])
    sd, meta, cfg, _ = build("diffsynth", seed=4)
    with pytest.raises(AdapterError, match="cannot read which layers it hooks"):
        apply_h3_adapter(m, str(write(tmp_path, "diffsynth", sd, meta, cfg)), 1.0)
