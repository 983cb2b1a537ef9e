"""The quantizing loaders' ``quantize_on`` input (issue #34: quantize on the GPU the model goes to) in the real
host: on every one of the four loaders, with its default, refused by name before any tensor is read where the
host has no CUDA device, ignored (nothing runs anywhere) for 'as stored', and handed through to the streaming
quantizer as ComfyUI's load device; the report says where the quantize ran."""
from __future__ import annotations

import pytest
import torch

from ditkit.errors import CheckpointError

LOADERS = {
    "h3": ("ditkit.nodes.h3_loaders", "DitKitH3ModelLoader", "model_name", "h3_tiny_official"),
    "zimage": ("ditkit.nodes.image_loaders", "DitKitZImageLoader", "unet_name", "zimage_tiny.safetensors"),
    "ltx2": ("ditkit.nodes.dit_loaders", "DitKitLTX2ModelLoader", "unet_name", "ltx2_tiny.safetensors"),
    "flux2": ("ditkit.nodes.dit_loaders", "DitKitFlux2ModelLoader", "unet_name", "flux2_tiny.safetensors"),
}


@pytest.fixture(scope="module")
def dm(comfy, tiny_ckpts):
    import folder_paths

    d = tiny_ckpts / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(d), is_default=True)
    return d


def _node(which):
    import importlib

    mod, cls, arg, name = LOADERS[which]
    return importlib.import_module(mod), getattr(importlib.import_module(mod), cls), arg, name


@pytest.mark.parametrize("which", list(LOADERS))
def test_schema_has_quantize_on_with_cpu_default(dm, which):
    _, node, _, _ = _node(which)
    schema = node.define_schema()
    (inp,) = [i for i in schema.inputs if i.id == "quantize_on"]
    assert inp.options == ["cpu", "gpu"] and inp.default == "cpu" and inp.optional and inp.advanced


@pytest.mark.parametrize("which", list(LOADERS))
def test_gpu_without_cuda_is_refused_by_name_before_any_read(dm, which, monkeypatch):
    from ditkit.loaders import quantize as qcore
    from ditkit.nodes import _quantizing

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: 'gpu' is accepted")
    read = []
    monkeypatch.setattr(qcore, "quantize_stream", lambda *a, **k: read.append(1) or iter(()))
    mod, node, arg, name = _node(which)
    with pytest.raises(CheckpointError, match=rf"{node.__name__}: quantize_on 'gpu': ComfyUI loads models onto "
                                              r"cpu, not a CUDA GPU; choose 'cpu'"):
        node.execute(**{arg: name}, weight_format="float8_e4m3fn", quantize_on="gpu")
    with pytest.raises(CheckpointError, match=rf"{node.__name__}: quantize_on 'tpu': choose one of \['cpu', 'gpu'\]"):
        node.execute(**{arg: name}, weight_format="float8_e4m3fn", quantize_on="tpu")
    with pytest.raises(CheckpointError, match="quantize_on 'tpu'"):      # checked whatever the format
        node.execute(**{arg: name}, quantize_on="tpu")
    assert not read
    assert _quantizing.check_quantize_on(node.__name__, "gpu", None) is None      # as stored: nothing runs


@pytest.mark.parametrize("which", list(LOADERS))
def test_the_load_device_reaches_the_quantizer_and_the_report(dm, which, monkeypatch):
    """ComfyUI's load device (made CUDA here: this host has none) is what the streaming quantizer is given; the
    quantize itself then runs on the CPU (the spy), and the report says where it ran."""
    from ditkit.loaders import quantize as qcore
    from ditkit.nodes import _quantizing

    real = qcore.quantize_stream
    seen = []

    def spy(items, plan, report, where, *a, device=None, **k):
        seen.append(device)
        yield from real(items, plan, report, where, *a, **k)
        report.quantized_on = f"{device} (spy)"

    monkeypatch.setattr(_quantizing, "model_load_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(qcore, "quantize_stream", spy)
    _, node, arg, name = _node(which)
    res = node.execute(**{arg: name}, weight_format="int8_tensorwise", quantize_on="gpu")
    assert seen == [torch.device("cuda", 0)]
    (rep,) = res.ui["ditkit_report"]
    assert rep["data"]["quantize_on"] == "gpu"
    assert rep["data"]["quantization"]["quantized_on"] == "cuda:0 (spy)"
    assert "quantized on cuda:0 (spy)" in rep["summary"]


@pytest.mark.parametrize("which", ["h3", "ltx2"])
def test_default_quantizes_on_the_cpu_and_says_so(dm, which):
    _, node, arg, name = _node(which)
    res = node.execute(**{arg: name}, weight_format="float8_e4m3fn")
    (rep,) = res.ui["ditkit_report"]
    assert rep["data"]["quantize_on"] == "cpu"
    assert rep["data"]["quantization"]["quantized_on"] == "cpu"
    assert "; quantized on cpu;" in rep["summary"]
