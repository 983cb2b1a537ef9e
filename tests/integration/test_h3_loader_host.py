"""DitKitH3ModelLoader and the tiny H3/LTX DiTs in the real ComfyUI host.

Oracle: the stock path. The ComfyUI-layout tiny file loaded by ``comfy.sd.load_diffusion_model`` (what
UNETLoader does) and sampled 2 Euler steps with a fixed seed gives the reference latent; every layout loaded
through DitKitH3ModelLoader must give a bit-identical latent.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ditkit.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
SEED = 1234


@pytest.fixture(scope="module")
def dm(comfy, tiny_ckpts):
    import folder_paths

    d = tiny_ckpts / "diffusion_models"
    folder_paths.add_model_folder_path("diffusion_models", str(d), is_default=True)
    return d


def _cond():
    from ditkit.tiny.ckpt_h3 import CONFIG

    g = torch.Generator().manual_seed(0)
    return [[torch.randn(1, 7, CONFIG["text_dim"], generator=g), {}]]


def _sample(model, seed=SEED):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    lat = EmptyMiniMaxH3LatentAV.execute(64, 64, 5)[0]
    cond = _cond()
    out = nodes.common_ksampler(model, seed, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
    return [t.clone() for t in out.unbind()]


def _stock(path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path))


def _ditkit(name, weight_dtype="default"):
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    out = DitKitH3ModelLoader.execute(model_name=name, weight_dtype=weight_dtype)
    return out.args[0], out.args[1], out.ui


@pytest.fixture(scope="module")
def reference(dm):
    return _sample(_stock(dm / "h3_tiny_comfy.safetensors"))


def test_stock_loader_detects_and_samples_tiny_h3_variants(dm, reference):
    v, a = reference
    assert v.shape == (1, 24, 2, 4, 4) and a.shape == (1, 32, 2, 8)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    for name, extra in (("h3_tiny_curve.safetensors", {"adaln_curve_grid": 65, "time_embed_dim": 8}),
                        ("h3_tiny_fasth3.safetensors", {"time_embed_dim": 32})):
        m = _stock(dm / name)
        cfg = m.model.model_config.unet_config
        assert cfg["image_model"] == "minimax_h3" and cfg["hidden_size"] == 64 and cfg["num_attention_heads"] == 3
        assert cfg["text_dim"] == 48 and cfg["num_layers"] == 2 and cfg["token_refiner_num_layers"] == 2
        for k, val in extra.items():
            assert cfg[k] == val, (name, k)
        sv, sa = _sample(m)
        assert torch.isfinite(sv).all() and torch.isfinite(sa).all()
        if "fasth3" in name:  # same base weights; the VSA gates are unused by the dense forward
            assert torch.equal(sv, v) and torch.equal(sa, a)
        else:  # rank-8 AdaLN curve: another function, another latent (the comparison can tell models apart)
            assert not torch.equal(sv, v)


def test_stock_loader_detects_and_samples_tiny_ltx2(dm):
    import comfy.nested_tensor
    import nodes

    m = _stock(dm / "ltx2_tiny.safetensors")
    assert type(m.model).__name__ == "LTXAV"
    assert m.model.model_config.unet_config["num_attention_heads"] == 2
    lat = {"samples": comfy.nested_tensor.NestedTensor((torch.zeros(1, 128, 2, 2, 2), torch.zeros(1, 8, 5, 16)))}
    cond = [[torch.randn(1, 7, 40, generator=torch.Generator().manual_seed(0)), {}]]
    out = nodes.common_ksampler(m, 3, 2, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"].unbind()
    assert out[0].shape == (1, 128, 2, 2, 2) and out[1].shape == (1, 8, 5, 16)
    assert all(torch.isfinite(t).all() for t in out)


@pytest.mark.parametrize("name,layout", [("h3_tiny_comfy.safetensors", "comfy"),
                                         ("h3_tiny_official", "official"),
                                         ("h3_tiny_diffusers", "diffusers")])
def test_every_layout_samples_bit_identically_to_stock(dm, reference, name, layout):
    model, summary, ui = _ditkit(name)
    assert summary.startswith(f"{layout} layout")
    rep = ui["ditkit_report"][0]
    assert rep["node_type"] == "DitKitH3ModelLoader" and rep["data"]["layout"] == layout
    assert rep["data"]["config"]["num_attention_heads"] == 3
    v, a = _sample(model)
    assert torch.equal(v, reference[0]) and torch.equal(a, reference[1])


@pytest.mark.parametrize("name", ["h3_tiny_curve.safetensors", "h3_tiny_fasth3.safetensors"])
def test_curve_and_fasth3_match_stock(dm, name):
    model, summary, _ = _ditkit(name)
    ref = _sample(_stock(dm / name))
    got = _sample(model)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_model_is_the_stock_patcher_kind(dm):
    model, _, _ = _ditkit("h3_tiny_official")
    stock = _stock(dm / "h3_tiny_comfy.safetensors")
    assert type(model) is type(stock)
    assert model.is_dynamic() == stock.is_dynamic()
    assert model.model.get_dtype() == stock.model.get_dtype()
    # LoRA-style weight patches apply through the standard ModelPatcher path
    key = "diffusion_model.blocks.0.attn.out_proj.weight"
    assert key in model.get_key_patches()
    c = model.clone()
    assert c.add_patches({key: (torch.zeros_like(stock.model.state_dict()[key]),)}, 1.0) == [key]


def test_fp8_weight_dtype_matches_stock_unetloader(dm):
    import nodes

    model, summary, _ = _ditkit("h3_tiny_official", "fp8_e4m3fn")
    stock = nodes.UNETLoader().load_unet("h3_tiny_comfy.safetensors", "fp8_e4m3fn")[0]
    assert "fp8_e4m3fn" in summary
    assert model.model.get_dtype() == stock.model.get_dtype() == torch.float8_e4m3fn
    # (sampling an fp8 H3 fails on CPU in stock ComfyUI too: comfy_kitchen's eager rms_rope_split_half_
    # rejects fp8 q_norm weights) -> compare the built models' weights bit for bit instead
    a, b = model.model.state_dict(), stock.model.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                                                        b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k]), k


def test_choices_list_files_and_index_folders_not_shards(dm):
    from ditkit.nodes.h3_loaders import list_choices

    ch = list_choices()
    for want in ("h3_tiny_official", "h3_tiny_diffusers", "h3_tiny_comfy.safetensors", "h3_tiny_curve.safetensors"):
        assert want in ch
    assert not any(c.startswith(("h3_tiny_official/", "h3_tiny_diffusers/")) for c in ch)


def test_wrong_family_through_the_node(dm):
    with pytest.raises(CheckpointError, match="LTX"):
        _ditkit("ltx2_tiny.safetensors")


def test_path_escape_rejected(dm):
    from ditkit.nodes.h3_loaders import resolve

    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve("../diffusion_models/../../etc")


def test_example_workflow_uses_only_tiny_names(dm):
    wf = json.loads((REPO / "example_workflows/api/h3_t2va_tiny.json").read_text())
    loader = [n for n in wf.values() if n["class_type"] == "DitKitH3ModelLoader"]
    assert loader and all((dm / n["inputs"]["model_name"]).exists() for n in loader)


def test_server_official_folder_matches_stock_unetloader(comfy_server):
    """Same graph twice on the real server: stock UNETLoader(comfy file) vs DitKitH3ModelLoader(official folder)."""
    from safetensors.torch import load_file as st_load  # reading our own test outputs (safetensors, no pickle)

    if "DitKitH3TextEncoderLoader" not in comfy_server.object_info():
        pytest.skip("needs DitKitH3TextEncoderLoader (tiny H3 text encoder) for a 48-wide conditioning")

    def graph(loader):
        return {
            "1": loader,
            "2": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}},
            "8": {"class_type": "DitKitH3TextEncoderLoader",
                  "inputs": {"text_encoder": "qwen3vl_tiny_minimax_h3.safetensors", "streaming": "off", "prefetch": 1}},
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["8", 0], "text": "a red fox in the snow"}},
            "4": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": SEED, "steps": 2, "cfg": 1.0,
                                                        "sampler_name": "euler", "scheduler": "simple",
                                                        "positive": ["3", 0], "negative": ["3", 0],
                                                        "latent_image": ["2", 0], "denoise": 1.0}},
            "5": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["4", 0]}},
            "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "h3load/video"}},
            "7": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 1], "filename_prefix": "h3load/audio"}},
        }

    outs = []
    for loader in ({"class_type": "UNETLoader", "inputs": {"unet_name": "h3_tiny_comfy.safetensors",
                                                           "weight_dtype": "default"}},
                   {"class_type": "DitKitH3ModelLoader", "inputs": {"model_name": "h3_tiny_official",
                                                                    "weight_dtype": "default"}}):
        entry = comfy_server.run(graph(loader))
        files = sorted(comfy_server.output_files(entry))
        assert len(files) == 2
        outs.append({f.name.split("_")[0]: st_load(str(f))["latent_tensor"] for f in files})
        if loader["class_type"] == "DitKitH3ModelLoader":
            assert "official layout" in comfy_server.log_text()
    assert set(outs[0]) == set(outs[1]) == {"video", "audio"}
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k


def test_int8_repack_passes_through_and_samples_like_stock(dm, tmp_path):
    """A ComfyUI int8_tensorwise repack (I8 weights + weight_scale + comfy_quant markers) goes through untouched."""
    from ditkit.loaders.safetensors_io import load_file, save_file
    from ditkit.nodes.h3_loaders import load_h3_model

    sd = load_file(dm / "h3_tiny_comfy.safetensors")
    for k in list(sd):
        if k.startswith("blocks.") and k.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight")):
            w = sd[k].float()
            s = w.abs().amax() / 127.0
            sd[k] = torch.round(w / s).clamp(-127, 127).to(torch.int8)
            sd[k[:-len("weight")] + "weight_scale"] = s.reshape(())
            sd[k[:-len("weight")] + "comfy_quant"] = torch.tensor(list(b'{"format": "int8_tensorwise"}'),
                                                                  dtype=torch.uint8)
    p = tmp_path / "h3_tiny_int8.safetensors"
    save_file(sd, p)
    model, rep = load_h3_model(str(p))
    assert rep.quantized == 8 and rep.layout == "comfy" and "quantized" in rep.variant
    ref = _sample(_stock(p))
    got = _sample(model)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_fasth3_gates_reach_sparse_attention_as_attachment(dm):
    """0.33 drops to_gate_compress at load; the loader keeps the file's exact gate tensors as an attachment."""
    from ditkit.loaders.safetensors_io import load_file
    from ditkit.nodes.sparse_attention import GATE_ATTACHMENT

    model, summary, _ = _ditkit("h3_tiny_fasth3.safetensors")
    raw = load_file(dm / "h3_tiny_fasth3.safetensors")
    want = {int(k.split(".")[1]): v for k, v in raw.items() if k.endswith("attn.to_gate_compress.weight")}
    got = model.get_attachment(GATE_ATTACHMENT)
    assert want and sorted(got) == sorted(want)
    for i, w in want.items():
        assert torch.equal(got[i], w)
    assert "to_gate_compress" in summary
    plain, _, _ = _ditkit("h3_tiny_comfy.safetensors")
    assert plain.get_attachment(GATE_ATTACHMENT) is None


# --------------------------------------------------------------------------- symlinks inside the model folders
# The stock loader follows a symlink the user placed in a model folder (folder_paths.get_full_path: isfile on the
# joined name); ditkit does the same for what it lists, while a NAME still cannot leave the folders ('..',
# absolute paths), and what is opened is checked on the opened file (a FIFO/device is refused, not waited on).

@pytest.fixture
def links(dm, tmp_path):
    """Links in diffusion_models/ to copies that live outside every model folder (removed afterwards)."""
    import shutil

    out = tmp_path / "elsewhere"
    out.mkdir()
    shutil.copyfile(dm / "h3_tiny_comfy.safetensors", out / "h3_real.safetensors")
    shutil.copytree(dm / "h3_tiny_official", out / "h3_official_real")
    made = {
        "h3_link.safetensors": out / "h3_real.safetensors",           # a symlinked single file (the issue)
        "h3_official_link": out / "h3_official_real",                 # a symlinked official shard folder
        "h3_linked_dir": out,                                         # a symlinked folder holding a single file
        "h3_dangling.safetensors": out / "gone.safetensors",          # points nowhere
    }
    for name, target in made.items():
        (dm / name).symlink_to(target, target_is_directory=target.is_dir())
    fifo = dm / "h3_fifo.safetensors"
    os.mkfifo(fifo)
    try:
        yield out
    finally:
        for name in [*made, "h3_fifo.safetensors"]:
            (dm / name).unlink()


def test_symlinked_checkpoints_are_listed_and_load_like_stock(dm, reference, links):
    import nodes

    from ditkit.nodes.h3_loaders import list_choices

    ch = list_choices()
    for want in ("h3_link.safetensors", "h3_official_link", "h3_linked_dir/h3_real.safetensors"):
        assert want in ch, (want, ch)
    assert "h3_linked_dir/h3_official_real" in ch  # an index folder reached through a linked folder
    # the stock loader follows the single-file link: same model, same samples
    stock = nodes.UNETLoader().load_unet("h3_link.safetensors", "default")[0]
    sv, sa = _sample(stock)
    assert torch.equal(sv, reference[0]) and torch.equal(sa, reference[1])
    for name, layout in (("h3_link.safetensors", "comfy"), ("h3_official_link", "official"),
                         ("h3_linked_dir/h3_real.safetensors", "comfy")):
        model, summary, _ = _ditkit(name)
        assert summary.startswith(f"{layout} layout"), (name, summary)
        v, a = _sample(model)
        assert torch.equal(v, reference[0]) and torch.equal(a, reference[1]), name


def test_dangling_links_and_fifos_are_neither_listed_nor_opened(dm, links):
    from ditkit.nodes.h3_loaders import list_choices, resolve

    ch = list_choices()
    assert "h3_dangling.safetensors" not in ch and "h3_fifo.safetensors" not in ch
    for name in ("h3_dangling.safetensors", "h3_fifo.safetensors"):
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            resolve(name)  # returns at once: a FIFO is never opened for reading


def test_every_listed_choice_resolves(dm, links):
    from ditkit.nodes.h3_loaders import list_choices, resolve

    for name in list_choices():
        assert os.path.exists(resolve(name)), name


@pytest.mark.parametrize("name", ["{escape}", "h3_linked_dir/../h3_tiny_comfy.safetensors",
                                  "h3_official_link/../h3_tiny_comfy.safetensors", "./../x.safetensors", "",
                                  "/etc/passwd", "h3_tiny_comfy.safetensors\x00.x"])
def test_names_still_cannot_leave_the_model_folders_by_path(dm, links, name):
    from ditkit.nodes.h3_loaders import resolve

    if name == "{escape}":  # '../../...' to the real file outside: it exists, so it is refused for its name
        name = os.path.relpath(links / "h3_real.safetensors", dm)
        assert name.startswith("..") and (dm / name).resolve().is_file()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve(name)


def test_a_shard_or_ckpt_typed_by_hand_reaches_the_core_message(dm, tmp_path):
    from ditkit.nodes.h3_loaders import list_choices

    assert "h3_tiny_official/model-00001-of-00002.safetensors" not in list_choices()
    with pytest.raises(CheckpointError, match="select the folder 'h3_tiny_official'"):
        _ditkit("h3_tiny_official/model-00001-of-00002.safetensors")
    ckpt = dm / "zz_pickle.ckpt"
    ckpt.write_bytes(b"\x80\x04\x95" + b"\x00" * 32)
    try:
        assert "zz_pickle.ckpt" not in list_choices()
        with pytest.raises(CheckpointError, match="never unpickles"):
            _ditkit("zz_pickle.ckpt")
    finally:
        ckpt.unlink()
