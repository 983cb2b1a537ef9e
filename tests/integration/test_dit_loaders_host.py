"""DitKitLTX2ModelLoader / DitKitFlux2ModelLoader in the real host (in process, CPU, tiny checkpoints).

Oracles: the host's own layout quantize (``comfy.quant_ops`` ``QuantizedLayout.quantize(..., scale="recalculate")``)
of each source weight, read back from the tiny file by the safetensors reader; the quantized layer set written out
here from the recipes' published rules (Lightricks' ``_FP8_CAST_LINEAR_SUFFIXES`` for LTX-2; the block-linear rule
for FLUX.2, docs/quantize.md); ``as stored`` against the stock ``comfy.sd.load_diffusion_model`` of the same file.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from ditkit.errors import CheckpointError, DitKitError, UnsupportedModelError
from tests.support.quant_oracle import bits as _bits
from tests.support.quant_oracle import host_formats as _host_formats
from tests.support.quant_oracle import host_quantize as _host_quantize

FILES = {"ltx2": "ltx2_tiny.safetensors", "flux2": "flux2_tiny.safetensors"}
NODES = {"ltx2": "DitKitLTX2ModelLoader", "flux2": "DitKitFlux2ModelLoader"}
# what each recipe quantizes, from the published rule (not from ditkit's RECIPES)
RULES = {"ltx2": re.compile(r"^transformer_blocks\.\d+\.[a-z_0-9]*attn[a-z_0-9]*\.(to_q|to_k|to_v|to_out\.0)\.weight$"
                            r"|^transformer_blocks\.\d+\.(audio_)?ff\.net\.(0\.proj|2)\.weight$"),
         "flux2": re.compile(r"^double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])\.weight$"
                             r"|^single_blocks\.\d+\.linear[12]\.weight$")}


@pytest.fixture(scope="module")
def dm(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.tiny.checkpoints import generate_all

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dit_loaders")
    generate_all(root, only=["ltx_dit", "flux2_dit", "h3_dit", "zimage_dit"])
    d = root / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    yield d
    paths = folder_paths.folder_names_and_paths["diffusion_models"][0]
    if str(d) in paths:
        paths.remove(str(d))
    folder_paths.filename_list_cache.pop("diffusion_models", None)


def _node(family):
    from ditkit.nodes import dit_loaders

    return getattr(dit_loaders, NODES[family])


def _inputs(model, family):
    g = torch.Generator().manual_seed(11)
    dm = model.model.diffusion_model
    if family == "ltx2":
        from comfy_extras.nodes_lt import EmptyLTXVLatentVideo, LTXVConcatAVLatent

        v = EmptyLTXVLatentVideo.execute(width=64, height=64, length=9, batch_size=1).result[0]
        lat = LTXVConcatAVLatent.execute(video_latent=v, audio_latent={"samples": torch.zeros(1, 8, 10, 16),
                                                                       "type": "audio"}).result[0]
        w = dm.caption_channels
    else:
        lat = {"samples": torch.zeros(1, 128, 8, 8)}
        w = dm.txt_in.weight.shape[1]
    return [[torch.randn(1, 8, w, generator=g), {}]], lat


def _sample(model, family, steps=1):
    import nodes

    cond, lat = _inputs(model, family)
    s = nodes.common_ksampler(model, 5, steps, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
    return [t.clone() for t in s.unbind()] if getattr(s, "is_nested", False) else [s.clone()]


@pytest.mark.parametrize("family", ["ltx2", "flux2"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8", "nvfp4"])
def test_weight_format_equals_the_host_quantizer_and_samples(dm, family, fmt):
    from ditkit.loaders.safetensors_io import load_file

    if fmt not in _host_formats():
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    out = _node(family).execute(unet_name=FILES[family], weight_format=fmt)
    model, summary = out.args[0], out.args[1]
    src = load_file(dm / FILES[family])
    sd = model.model.diffusion_model.state_dict()
    expect = sorted(k[: -len(".weight")] for k, v in src.items() if RULES[family].search(k) and min(v.shape) >= 16)
    layers = sorted(k[: -len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant"))
    assert expect and layers == expect
    for layer in layers:
        assert json.loads(bytes(sd[f"{layer}.comfy_quant"].tolist())) == {"format": fmt}
        for sfx, ref in _host_quantize(src[f"{layer}.weight"], fmt).items():
            got = sd[f"{layer}.weight{sfx}"]
            assert got.dtype == ref.dtype and got.shape == ref.shape, (layer, sfx)
            assert torch.equal(_bits(got), _bits(ref)), (layer, sfx)
    for k, v in src.items():      # everything else as stored (ComfyUI renames a few FLUX.2 norm keys)
        if k[: -len(".weight")] in layers and k.endswith(".weight") or k not in sd:
            continue
        assert torch.equal(sd[k].float(), v.float()), k
    assert f"quantized {fmt} (weight-only)" in summary and "kept in stored precision" in summary
    rep = out.ui["ditkit_report"][0]
    assert rep["node_type"] == NODES[family] and rep["data"]["quantization"]["format"] == fmt
    (x, *_rest) = _sample(model, family)
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("family", ["ltx2", "flux2"])
def test_as_stored_is_the_stock_loader_and_the_listing_is_the_family(dm, family):
    import comfy.sd

    node = _node(family)
    out = node.execute(unet_name=FILES[family])
    stock = comfy.sd.load_diffusion_model(str(dm / FILES[family]))
    a, b = out.args[0].model.diffusion_model.state_dict(), stock.model.diffusion_model.state_dict()
    assert a.keys() == b.keys() and not any(k.endswith("comfy_quant") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "weights as stored" in out.args[1]
    x, y = _sample(out.args[0], family)[0], _sample(stock, family)[0]
    assert torch.allclose(x, y, rtol=0, atol=1e-5)
    opts = next(i.options for i in node.define_schema().inputs if i.id == "unet_name")
    assert FILES[family] in opts
    assert not {"h3_tiny_comfy.safetensors", "zimage_tiny.safetensors", FILES[{"ltx2": "flux2", "flux2": "ltx2"}[family]]} \
        & set(opts), opts


@pytest.mark.parametrize("family", ["ltx2", "flux2"])
def test_bad_input_is_refused_naming_the_input(dm, tmp_path, family):
    import folder_paths

    from ditkit.loaders.safetensors_io import load_file, save_file
    from ditkit.quantize import convert

    node, name = _node(family), FILES[family]
    with pytest.raises(CheckpointError, match=r"weight_format 'float4_magic' is not available"):
        node.execute(unet_name=name, weight_format="float4_magic")
    other = FILES["flux2" if family == "ltx2" else "ltx2"]
    want = {"ltx2": "an LTX-2 DiT", "flux2": "a FLUX.2 DiT"}
    with pytest.raises(UnsupportedModelError, match=rf"unet_name '{re.escape(other)}' is .*not {want[family]}; load it "
                                                    rf"with {NODES['flux2' if family == 'ltx2' else 'ltx2']}"):
        node.execute(unet_name=other, weight_format="float8_e4m3fn")
    with pytest.raises(UnsupportedModelError, match=r"'h3_tiny_comfy.safetensors' is a MiniMax H3 DiT.*DitKitH3ModelLoader"):
        node.execute(unet_name="h3_tiny_comfy.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"'zimage_tiny.safetensors' is a Z-Image DiT.*DitKitZImageLoader"):
        node.execute(unet_name="zimage_tiny.safetensors")
    d = tmp_path / "dm"
    d.mkdir()
    convert(str(dm / name), str(d / "q.safetensors"), "int8_tensorwise", log=lambda *_: None)
    sd = load_file(dm / name)
    bad = next(k for k in sorted(sd) if RULES[family].search(k))
    sd[bad][1, 2] = float("nan")
    meta = {"config": json.dumps({"transformer": __import__("ditkit.tiny.ckpt_ltx", fromlist=["CONFIG"]).CONFIG})} \
        if family == "ltx2" else None
    save_file(sd, d / "nan.safetensors", metadata=meta)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    try:
        with pytest.raises(CheckpointError, match=r"unet_name 'q.safetensors'.*already quantized"):
            node.execute(unet_name="q.safetensors", weight_format="float8_e4m3fn")
        assert node.execute(unet_name="q.safetensors").args[0] is not None        # as stored: the int8 file loads
        with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(bad)}' holds 1 NaN and 0 Inf"):
            node.execute(unet_name="nan.safetensors", weight_format="nvfp4" if "nvfp4" in _host_formats()
                         else "float8_e4m3fn")
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(d))
        folder_paths.filename_list_cache.pop("diffusion_models", None)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before            # inputs untouched
    assert issubclass(UnsupportedModelError, DitKitError)
    shutil.rmtree(d)
