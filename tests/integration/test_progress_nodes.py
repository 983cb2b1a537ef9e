"""Progress bars of ditkit nodes through ComfyUI's real ``comfy.utils.ProgressBar`` (in-process, a recording hook,
throttling off): each long phase is one bar on the right node whose value strictly increases to a total equal to
the work counted independently (tensors in the file header, tiles x batch, images, layers); outputs are unchanged."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from ditkit.loaders.safetensors_io import read_header
from ditkit.tiny import ckpt_h3_vae as ck

torch.set_num_threads(1)


@pytest.fixture
def bars(comfy, monkeypatch):
    """Every hook call as (node_id, value, total)."""
    import comfy.utils

    seen: list[tuple] = []

    def hook(value, total, preview, node_id=None, prompt_id=None):
        seen.append((node_id, value, total))

    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", hook)
    monkeypatch.setattr(comfy.utils, "PROGRESS_THROTTLE_MIN_INTERVAL", 0.0)
    monkeypatch.setattr(comfy.utils, "PROGRESS_THROTTLE_MIN_PERCENT", 0.0)
    return seen


def runs(seen, node):
    """The node's updates split into bars: a new bar starts when the total changes or the value goes back."""
    out: list[list[tuple[int, int]]] = []
    for n, v, t in seen:
        if n != node:
            continue
        if not out or t != out[-1][-1][1] or v <= out[-1][-1][0]:
            out.append([])
        out[-1].append((v, t))
    return out


def assert_bar(run, total, values=None):
    vals = [v for v, _ in run]
    assert all(t == total for _, t in run), run
    assert all(b > a for a, b in zip(vals, vals[1:])) and vals[-1] == total, run
    if values is not None:
        assert vals == values


def with_id(monkeypatch, node, uid):
    from comfy_api.latest import io

    monkeypatch.setattr(node, "hidden", io.HiddenHolder.from_dict({io.Hidden.unique_id: uid}))


def _out(o, i=0):
    return o.args[i] if hasattr(o, "args") else o.result[i]


@pytest.fixture(scope="module")
def h3(comfy):
    return importlib.import_module("ditkit.nodes.h3_vae")


def test_h3_vae_loader_decode_encode_bars(h3, tiny_ckpts, bars, monkeypatch):
    import folder_paths

    d = Path(tiny_ckpts) / "vae"
    folder_paths.add_model_folder_path("vae", str(d))
    with_id(monkeypatch, h3.DitKitH3VAELoader, "11")
    vae = _out(h3.DitKitH3VAELoader.execute(ck.VIDEO_VAE_NAME))
    (load,) = runs(bars, "11")
    assert_bar(load, len(read_header(d / ck.VIDEO_VAE_NAME).tensors))

    z = torch.randn(2, 24, 1, 20, 18, generator=torch.Generator().manual_seed(0))  # 2x2 tiles, batch 2
    ref, data = h3.h3_decode(vae, z)
    assert data["tiles"] == 4
    with_id(monkeypatch, h3.DitKitH3VAEDecode, "12")
    img = _out(h3.DitKitH3VAEDecode.execute({"samples": z}, vae))
    assert torch.equal(img, ref)
    (dec,) = runs(bars, "12")
    assert_bar(dec, 4 * 2, [2, 4, 6, 8])

    with_id(monkeypatch, h3.DitKitH3EncodeImage, "13")
    images = torch.rand(3, 64, 48, 3, generator=torch.Generator().manual_seed(1))
    lat = _out(h3.DitKitH3EncodeImage.execute(images, vae, "video"))["samples"]
    assert lat.shape[0] == 3 and torch.equal(lat[1:2], vae.encode(images[1:2]))
    (enc,) = runs(bars, "13")
    assert_bar(enc, 3, [1, 2, 3])


def test_zimage_loader_bar(comfy, tiny_ckpts, bars, monkeypatch):
    import folder_paths

    import ditkit.nodes.image_loaders as il

    d = Path(tiny_ckpts) / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    with_id(monkeypatch, il.DitKitZImageLoader, "21")
    model = _out(il.DitKitZImageLoader.execute("zimage_tiny.safetensors"))
    (load,) = runs(bars, "21")
    assert_bar(load, len(read_header(d / "zimage_tiny.safetensors").tensors))
    ref = il.load_zimage(str(d / "zimage_tiny.safetensors"))[0].model.state_dict()
    got = model.model.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_te_loader_read_pack_and_per_layer_encode_bars(comfy, tiny_ckpts, bars):
    import ditkit.nodes.text_encoders as te

    path = Path(tiny_ckpts) / "text_encoders" / "qwen3vl_tiny_minimax_h3.safetensors"
    clip, cfg, info = te.build_h3_clip(path, streaming=True, prefetch=1, force=True, node_id="31")
    n = cfg["num_hidden_layers"]
    assert info["layers"] == n == 50
    read, pack = runs(bars, "31")
    assert_bar(read, len(read_header(path).tensors))
    assert_bar(pack, n, list(range(1, n + 1)))
    bars.clear()
    clip.encode_from_tokens_scheduled(clip.tokenize("a red fox"))
    # node None: ComfyUI attributes it to the node running the encode (CLIPTextEncode)
    layer_bars = [r for r in runs(bars, None) if r[-1][1] == n]
    assert len(layer_bars) == 1
    assert_bar(layer_bars[0], n, list(range(1, n + 1)))
