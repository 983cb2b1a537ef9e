"""The write-once quantized cache through the real loader nodes in the real host (issue #34): the first load with
``quantized_cache`` writes the cache next to the source and gives the same model as without the cache; the second
is a hit (no quantizing) and gives the same weights bit for bit, each quantized layer equal to the host's own layout
quantize; a tampered cache is refused by name; the cache off (default) writes nothing."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.support.quant_oracle import bits as _bits
from tests.support.quant_oracle import host_quantize as _host_quantize


@pytest.fixture()
def dm(comfy, tiny_ckpts, tmp_path):
    import folder_paths

    d = tmp_path / "diffusion_models"
    d.mkdir()
    shutil.copytree(tiny_ckpts / "diffusion_models" / "h3_tiny_official", d / "h3_tiny_official")
    shutil.copy(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors", d / "h3_tiny_comfy.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(d), is_default=True)
    yield d
    folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(d))


def _weights(model):
    return {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}


def _cache_files(folder):
    return sorted(n for n in os.listdir(folder) if ".ditkit-" in n)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "nvfp4"])
def test_h3_second_load_is_a_verified_hit_with_the_same_weights(dm, fmt):
    from ditkit.loaders import quant_cache
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader, weight_formats

    if fmt not in weight_formats():
        pytest.skip(f"this host's QUANT_ALGOS has no {fmt}")
    folder = dm / "h3_tiny_official"
    plain = _weights(DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format=fmt).args[0])
    assert _cache_files(folder) == []                         # off by default: nothing written
    first = DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format=fmt, quantized_cache=True)
    assert "cache written: h3_tiny_official.ditkit-" in first.args[1]
    assert len(_cache_files(folder)) == 1
    calls = []
    real = quant_cache.cached_quantize

    def spy(*a, **k):
        run = a[5]

        def counted():
            calls.append(1)
            return run()
        return real(*a[:5], counted, *a[6:], **k)

    quant_cache.cached_quantize, saved = spy, real
    try:
        second = DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format=fmt, quantized_cache=True)
    finally:
        quant_cache.cached_quantize = saved
    assert calls == [] and "cache hit: h3_tiny_official.ditkit-" in second.args[1]
    w1, w2 = _weights(first.args[0]), _weights(second.args[0])
    assert list(w1) == list(plain) == list(w2)
    for k in plain:
        assert torch.equal(_bits(w1[k]), _bits(plain[k])) and torch.equal(_bits(w2[k]), _bits(plain[k])), k
    src = load_file(dm / "h3_tiny_comfy.safetensors")          # the host's own quantize of the ComfyUI-layout file
    layer = "blocks.0.mlp.fc1"
    for sfx, ref in _host_quantize(src[f"{layer}.weight"], fmt).items():
        assert torch.equal(_bits(w2[f"{layer}.weight{sfx}"]), _bits(ref)), sfx


def test_h3_tampered_cache_is_refused_by_name(dm):
    from ditkit.loaders.quant_cache import QuantCacheError
    from ditkit.loaders.safetensors_io import read_header
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    folder = dm / "h3_tiny_official"
    DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format="float8_e4m3fn", quantized_cache=True)
    (name,) = _cache_files(folder)
    path = folder / name
    hdr = read_header(path)
    ti = max(hdr.tensors.values(), key=lambda t: t.nbytes)
    with open(path, "r+b") as f:
        f.seek(8 + hdr.header_len + ti.begin + 7)
        b = f.read(1)
        f.seek(8 + hdr.header_len + ti.begin + 7)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(QuantCacheError, match=name):
        DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format="float8_e4m3fn", quantized_cache=True)
    out = DitKitH3ModelLoader.execute(model_name="h3_tiny_official", weight_format="float8_e4m3fn")
    assert "cache" not in out.args[1].split("quantized")[1]    # the cache off: the tampered file is not involved
