"""``python -m ditkit.quantize`` in the real host: the written file loads with the stock loader (what UNETLoader
does), samples, and every quantized layer of the loaded model equals the host's own layout quantize of the
same weight taken from the ComfyUI-layout tiny file (an independent path: no ditkit conversion involved)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ditkit.errors import DitKitError
from tests.support.quant_oracle import bits as _bits
from tests.support.quant_oracle import host_formats as _host_formats
from tests.support.quant_oracle import host_quantize as _host_quantize

SEED = 1234


@pytest.fixture(scope="module")
def dm(comfy, tiny_ckpts):
    return tiny_ckpts / "diffusion_models"


def _cond():
    from ditkit.tiny.ckpt_h3 import CONFIG

    return [[torch.randn(1, 7, CONFIG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]


def _sample(model):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    lat = EmptyMiniMaxH3LatentAV.execute(64, 64, 5)[0]
    out = nodes.common_ksampler(model, SEED, 2, 1.0, "euler", "simple", _cond(), _cond(), lat)[0]["samples"]
    return [t.clone() for t in out.unbind()]


def _check_against_host(model, comfy_file, fmt, expect_layers):
    from ditkit.loaders.safetensors_io import load_file

    src = load_file(comfy_file)
    sd = model.model.diffusion_model.state_dict()
    layers = sorted(k[: -len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant"))
    assert layers == sorted(expect_layers)
    for layer in layers:
        assert json.loads(bytes(sd[f"{layer}.comfy_quant"].tolist())) == {"format": fmt}
        host = _host_quantize(src[f"{layer}.weight"], fmt)
        for sfx, ref in host.items():
            got = sd[f"{layer}.weight{sfx}"]
            assert got.dtype == ref.dtype and got.shape == ref.shape, (layer, sfx)
            assert torch.equal(_bits(got), _bits(ref)), (layer, sfx)
    for k, v in src.items():          # everything else passes through unchanged (cast to the compute dtype)
        layer = k.rsplit(".", 1)[0]
        if (layer in layers and k.endswith(".weight")) or k not in sd:   # ComfyUI renames a few (FLUX.2 norms)
            continue
        assert torch.equal(sd[k].float(), v.float()), k


def _expected_h3_layers():
    from ditkit.tiny.ckpt_h3 import CONFIG

    out = []
    for i in range(CONFIG["num_layers"]):
        out += [f"blocks.{i}.attn.qkv_proj", f"blocks.{i}.attn.out_proj", f"blocks.{i}.mlp.fc1",
                f"blocks.{i}.mlp.fc2", f"blocks.{i}.adaln_proj.linear"]
    for i in range(CONFIG["token_refiner_num_layers"]):
        out += [f"token_refiner.blocks.{i}.attn.qkv_proj", f"token_refiner.blocks.{i}.attn.out_proj",
                f"token_refiner.blocks.{i}.mlp.fc1", f"token_refiner.blocks.{i}.mlp.fc2"]
    return out


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4", "float8_e5m2"])
def test_converter_file_loads_with_the_stock_loader_and_equals_the_host_quantizer(dm, tmp_path, fmt):
    import comfy.sd

    from ditkit.quantize import convert

    if fmt not in _host_formats():
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    out = tmp_path / f"h3_{fmt}.safetensors"
    path, report = convert(str(dm / "h3_tiny_official"), str(out), fmt, log=lambda *_: None)
    model = comfy.sd.load_diffusion_model(path)
    assert model.model.model_config.unet_config["image_model"] == "minimax_h3"
    _check_against_host(model, dm / "h3_tiny_comfy.safetensors", fmt, _expected_h3_layers())
    v, a = _sample(model)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    assert report.classes["block attention"].quantized == 8 and report.classes["final layer"].quantized == 0


@pytest.mark.parametrize("name,family", [("ltx2_tiny.safetensors", "ltx2"), ("zimage_tiny.safetensors", "zimage"),
                                         ("flux2_tiny.safetensors", "flux2")])
def test_other_families_convert_and_load_with_the_stock_loader(dm, tmp_path, name, family):
    import comfy.sd

    from ditkit.loaders import quantize as qcore
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.quantize import convert

    path, report = convert(str(dm / name), str(tmp_path / name), "float8_e4m3fn", log=lambda *_: None)
    assert report.family == family
    src = load_file(dm / name)
    expect = [k[: -len(".weight")] for k, v in src.items() if qcore.classify(family, k, tuple(v.shape))[1]]
    assert expect, "the recipe quantizes something"
    if family == "zimage":
        pytest.skip("the tiny Z-Image (dim 256) is not loadable by the stock loader; see the Z-Image loader test")
    model = comfy.sd.load_diffusion_model(path)
    _check_against_host(model, dm / name, "float8_e4m3fn", expect)


def test_converter_refuses_existing_output_quantized_source_and_nan(dm, tmp_path):
    from ditkit.loaders.safetensors_io import load_file, save_file
    from ditkit.quantize import convert

    out = tmp_path / "a.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(DitKitError, match="already exists"):
        convert(str(dm / "h3_tiny_official"), str(out), "float8_e4m3fn", log=lambda *_: None)
    assert out.read_bytes() == b"keep me"
    first, _ = convert(str(dm / "h3_tiny_comfy.safetensors"), str(tmp_path / "q.safetensors"), "int8_tensorwise",
                       log=lambda *_: None)
    with pytest.raises(DitKitError, match="already quantized"):
        convert(first, str(tmp_path / "q2.safetensors"), "float8_e4m3fn", log=lambda *_: None)
    sd = load_file(dm / "h3_tiny_comfy.safetensors")
    sd["blocks.1.mlp.fc2.weight"][3, 5] = float("nan")
    save_file(sd, tmp_path / "nan.safetensors")
    with pytest.raises(DitKitError, match=r"'blocks\.1\.mlp\.fc2\.weight' holds 1 NaN"):
        convert(str(tmp_path / "nan.safetensors"), str(tmp_path / "nan_q.safetensors"), "float8_e4m3fn",
                log=lambda *_: None)
    assert not (tmp_path / "nan_q.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "nan.safetensors", "q.safetensors"]


def test_cli_writes_and_refuses(dm, tmp_path):
    out = tmp_path / "cli.safetensors"
    cmd = [sys.executable, "-m", "ditkit.quantize", str(dm / "h3_tiny_official"), str(out), "--format", "mxfp8"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "block attention: 8/8 quantized" in r.stdout
    from ditkit.loaders.safetensors_io import read_header

    meta = read_header(out).metadata
    rec = json.loads(meta["ditkit_quantize"])
    assert rec["format"] == "mxfp8" and rec["family"] == "h3" and len(rec["source"]["files"]) == 2
    assert all(len(f["sha256"]) == 64 for f in rec["source"]["files"])
    assert len(json.loads(meta["_quantization_metadata"])["layers"]) == len(_expected_h3_layers())
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("ERROR: ") and "already exists" in r.stderr


# ---------------------------------------------------------------------------------- loaders with weight_format

@pytest.fixture(scope="module")
def dm_registered(dm):
    import folder_paths

    folder_paths.add_model_folder_path("diffusion_models", str(dm), is_default=True)
    return dm


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"])
def test_h3_loader_weight_format_gives_the_comfy_quant_model(dm_registered, tmp_path, fmt):
    import comfy.sd

    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader, weight_formats
    from ditkit.quantize import convert

    if fmt not in weight_formats():
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    out = DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format=fmt)
    model, summary = out.args[0], out.args[1]
    _check_against_host(model, dm_registered / "h3_tiny_comfy.safetensors", fmt, _expected_h3_layers())
    assert f"quantized {fmt} (weight-only)" in summary and "block attention 8/8" in summary
    assert "kept in stored precision: " in summary and "final layer" in summary.split("kept in stored precision: ")[1]
    # the same model as the converter's file: its state dict through ComfyUI's loader gives the same latents bit
    # for bit; through UNETLoader's mmap file read within 1e-5 (the memory-mapped tensors change the float
    # summation order; the state dicts are equal, see the converter test)
    from ditkit.loaders.safetensors_io import load_with_metadata

    path, _ = convert(str(dm_registered / "h3_tiny_official"), str(tmp_path / "c.safetensors"), fmt,
                      log=lambda *_: None)
    v, a = _sample(model)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    sd, meta = load_with_metadata(path)
    fv, fa = _sample(comfy.sd.load_diffusion_model_state_dict(sd, metadata=meta))
    assert torch.equal(v, fv) and torch.equal(a, fa)
    sv, sa = _sample(comfy.sd.load_diffusion_model(path))
    assert torch.allclose(v, sv, rtol=0, atol=1e-5) and torch.allclose(a, sa, rtol=0, atol=1e-5)


def test_h3_loader_weight_format_as_stored_is_unchanged_and_bad_formats_are_refused(dm_registered):
    from ditkit.errors import CheckpointError
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader, weight_formats

    import comfy.quant_ops as q

    assert weight_formats()[0] == "as stored"
    assert set(weight_formats()[1:]) <= set(q.QUANT_ALGOS)
    a = DitKitH3ModelLoader.execute(model_name="h3_tiny_official")
    b = DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format="as stored")
    sa, sb = a.args[0].model.diffusion_model.state_dict(), b.args[0].model.diffusion_model.state_dict()
    assert sa.keys() == sb.keys() and not any(k.endswith("comfy_quant") for k in sa)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(CheckpointError, match="'float4_magic' is not available in this ComfyUI"):
        DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format="float4_magic")
    with pytest.raises(CheckpointError, match="both set the weights' precision"):
        DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_dtype="fp8_e4m3fn",
                                    weight_format=weight_formats()[1])


def test_h3_loader_weight_format_refuses_a_quantized_file(dm_registered, tmp_path):
    import folder_paths

    from ditkit.errors import CheckpointError
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader
    from ditkit.quantize import convert

    d = tmp_path / "dm"
    d.mkdir()
    convert(str(dm_registered / "h3_tiny_comfy.safetensors"), str(d / "q8.safetensors"), "int8_tensorwise",
            log=lambda *_: None)
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    with pytest.raises(CheckpointError, match="already quantized"):
        DitKitH3ModelLoader.execute(model_name="q8.safetensors", weight_format="float8_e4m3fn")
    m = DitKitH3ModelLoader.execute(model_name="q8.safetensors").args[0]     # as stored: loads the int8 file
    assert any(k.endswith("comfy_quant") for k in m.model.diffusion_model.state_dict())


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "nvfp4"])
def test_zimage_loader_weight_format(dm_registered, fmt):
    import comfy.sd  # noqa: F401
    import nodes

    from ditkit.loaders import quantize as qcore
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.image_loaders import DitKitZImageLoader
    from ditkit.nodes.h3_loaders import weight_formats

    if fmt not in weight_formats():
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    out = DitKitZImageLoader.execute(unet_name="zimage_tiny.safetensors", weight_format=fmt)
    model, summary = out.args[0], out.args[1]
    src = load_file(dm_registered / "zimage_tiny.safetensors")
    expect = [k[: -len(".weight")] for k, v in src.items() if qcore.classify("zimage", k, tuple(v.shape))[1]]
    _check_against_host(model, dm_registered / "zimage_tiny.safetensors", fmt, expect)
    assert "quantized " + fmt in summary
    lat = {"samples": torch.zeros(1, 16, 8, 8)}
    cond = [[torch.randn(1, 7, 1024, generator=torch.Generator().manual_seed(0)), {}]]
    x = nodes.common_ksampler(model, 0, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
    assert x.shape == (1, 16, 8, 8) and torch.isfinite(x).all()


def test_converter_file_through_the_unetloader_node(dm_registered, tmp_path):
    import folder_paths
    import nodes

    from ditkit.quantize import convert

    d = tmp_path / "unet"
    d.mkdir()
    convert(str(dm_registered / "h3_tiny_official"), str(d / "h3_q_nvfp4.safetensors"), "nvfp4", log=lambda *_: None)
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    (model,) = nodes.UNETLoader().load_unet("h3_q_nvfp4.safetensors", "default")
    _check_against_host(model, dm_registered / "h3_tiny_comfy.safetensors", "nvfp4", _expected_h3_layers())


def _capture_scales(monkeypatch, module):
    """Wrap ``module.quantized_state_dict``: -> dict layer -> the block-scale tensor the loader handed ComfyUI
    (references kept, so a clone can never reuse the original's address)."""
    got = {}
    orig = module.quantized_state_dict

    def spy(*a, **k):
        sd, rep = orig(*a, **k)
        got.update({key[: -len(".weight_scale")]: t for key, t in sd.items()
                    if key.endswith(".weight_scale") and t.dim() >= 1})
        return sd, rep

    monkeypatch.setattr(module, "quantized_state_dict", spy)
    return got


def _model_block_scales(model):
    out = {}
    for name, mod in model.model.diffusion_model.named_modules():
        params = getattr(getattr(mod, "weight", None), "_params", None)
        if params is None:
            continue
        t = getattr(params, "block_scale", None)
        t = getattr(params, "scale", None) if t is None else t
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            out[name] = t
    return out


@pytest.mark.parametrize("loader", ["h3", "zimage", "ltx2"])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_loaded_model_keeps_the_loaders_block_scales_not_a_copy(dm_registered, monkeypatch, fmt, loader):
    """ComfyUI's nn.Parameter(QuantizedTensor) clones the block scales (comfy_kitchen's detach); the loaders put
    the state dict's own tensor back (bridge/quant_scales.py), so the block scales are not held twice while the
    model is built: every quantized layer's block scale is the very tensor the quantizer made, same bytes."""
    from ditkit.nodes import dit_loaders, h3_loaders, image_loaders
    from ditkit.nodes.h3_loaders import weight_formats

    if fmt not in weight_formats():
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    if loader == "h3":
        got = _capture_scales(monkeypatch, h3_loaders)
        res = h3_loaders.DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format=fmt)
    elif loader == "zimage":
        got = _capture_scales(monkeypatch, image_loaders)
        res = image_loaders.DitKitZImageLoader.execute(unet_name="zimage_tiny.safetensors", weight_format=fmt)
    else:
        got = _capture_scales(monkeypatch, dit_loaders)
        res = dit_loaders.DitKitLTX2ModelLoader.execute(unet_name="ltx2_tiny.safetensors", weight_format=fmt)
    model = res.args[0]
    have = _model_block_scales(model)
    assert got and sorted(have) == sorted(got)
    for layer, t in have.items():
        assert t.data_ptr() == got[layer].data_ptr(), layer
        assert torch.equal(_bits(t), _bits(got[layer])), layer
    # the node says it ran: every layer counted, the bytes the layers' scales hold (computed here from the model)
    (rep,) = res.ui["ditkit_report"]
    n, nbytes = len(have), sum(t.numel() * t.element_size() for t in have.values())
    assert rep["data"]["quantization"]["block_scales"] == {"layers_kept": n, "layers": n, "bytes_not_copied": nbytes}
    assert f"block scales not copied by the host: {n}/{n} layers" in rep["summary"]
