"""loaders/h3.py: layout detection, exact conversion, and a clear CheckpointError for every bad input."""
from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest
import torch

from ditkit.errors import CheckpointError
from ditkit.loaders import h3 as L
from ditkit.loaders import safetensors_io as sio
from ditkit.loaders.safetensors_io import load_file, load_with_metadata, save_file
from ditkit.tiny import ckpt_h3 as C
from ditkit.tiny.checkpoints import generate_all

NAMES = ["h3_dit", "h3_dit_official", "h3_dit_diffusers", "h3_dit_curve", "h3_dit_fasth3", "ltx_dit", "flux2_dit",
         "zimage_dit"]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    out = tmp_path_factory.mktemp("h3load")
    generate_all(out, only=NAMES)
    return out / "diffusion_models"


@pytest.fixture()
def official(ck, tmp_path):
    d = tmp_path / "official"
    shutil.copytree(ck / "h3_tiny_official", d)
    return d


@pytest.fixture()
def diffusers(ck, tmp_path):
    d = tmp_path / "diffusers"
    shutil.copytree(ck / "h3_tiny_diffusers", d)
    return d


def _assert_same(sd, ref):
    assert set(sd) == set(ref), set(sd) ^ set(ref)
    for k in ref:
        assert sd[k].dtype == ref[k].dtype, k
        assert torch.equal(sd[k], ref[k]), k


# ------------------------------------------------------------------ good inputs

@pytest.mark.parametrize("name,layout,conv", [
    ("h3_tiny_comfy.safetensors", "comfy", {}),
    ("h3_tiny_official", "official", {"qkv de-interleaved": 4}),
    ("h3_tiny_diffusers", "diffusers", {"qkv merged": 4, "fc1 halves swapped": 4, "rope.inv_freq rebuilt": 1}),
])
def test_all_layouts_convert_to_the_comfy_tensors_exactly(ck, name, layout, conv):
    ref = load_file(ck / "h3_tiny_comfy.safetensors")
    calls = []
    sd, rep = L.load_h3_state_dict(ck / name, progress=lambda d, t: calls.append((d, t)))
    _assert_same(sd, ref)
    assert rep.layout == layout
    for k, v in conv.items():
        assert rep.converted[k] == v
    assert rep.config["num_attention_heads"] == 3 and rep.config["attention_head_dim"] == 32
    assert rep.config["hidden_size"] == 64 and rep.config["num_layers"] == 2 and rep.config["token_refiner_num_layers"] == 2
    assert rep.tensors_out == len(ref) == calls[-1][0] == calls[-1][1]
    assert [d for d, _ in calls] == list(range(1, len(calls) + 1))
    assert rep.bulk_dtype == "BF16"
    assert rep.summary().startswith(layout)


def test_shards_opened_lazily_in_order(ck):
    files = []
    L.load_h3_state_dict(ck / "h3_tiny_diffusers", on_file=lambda p, i, n: files.append((p.rsplit("/", 1)[-1], i, n)))
    assert files == [(f"diffusion_pytorch_model-0000{i}-of-00003.safetensors", i, 3) for i in (1, 2, 3)]


def test_reads_one_tensor_at_a_time_without_whole_file_loads(ck, monkeypatch):
    called = []
    monkeypatch.setattr(sio, "load_file", lambda *a, **k: called.append(a) or {})
    orig = sio.SafeFile.get
    sizes = []
    monkeypatch.setattr(sio.SafeFile, "get", lambda self, n, device="cpu", **kw: sizes.append(n)
                        or orig(self, n, device, **kw))
    rows = sio.SafeFile.read_rows_into        # the row-permuted qkv is read straight into its converted order
    monkeypatch.setattr(sio.SafeFile, "read_rows_into", lambda self, n, out, blocks: sizes.append(n)
                        or rows(self, n, out, blocks))
    sd, rep = L.load_h3_state_dict(ck / "h3_tiny_official")
    assert not called and len(sizes) == len(sd) == rep.tensors_read


def test_curve_and_fasth3_pass_through(ck):
    sd, rep = L.load_h3_state_dict(ck / "h3_tiny_curve.safetensors")
    _assert_same(sd, load_file(ck / "h3_tiny_curve.safetensors"))
    assert rep.config["adaln_curve"] and rep.config["adaln_curve_grid"] == C.CURVE_GRID and rep.variant == "curve"
    sd, rep = L.load_h3_state_dict(ck / "h3_tiny_fasth3.safetensors")
    _assert_same(sd, load_file(ck / "h3_tiny_fasth3.safetensors"))
    assert rep.config["gate_compress"] and "fasth3" in rep.variant


def _int8_repack(ck, tmp_path, marker=True):
    sd, meta = load_with_metadata(ck / "h3_tiny_comfy.safetensors")
    w = sd["blocks.0.attn.qkv_proj.weight"].float()
    scale = w.abs().amax(dim=1) / 127.0
    sd["blocks.0.attn.qkv_proj.weight"] = torch.round(w / scale[:, None]).to(torch.int8)
    sd["blocks.0.attn.qkv_proj.weight_scale"] = scale
    if marker:
        sd["blocks.0.attn.qkv_proj.comfy_quant"] = torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)
    p = tmp_path / "h3_int8.safetensors"
    save_file(sd, p)
    return p, sd


def test_int8_repack_markers_pass_through_untouched(ck, tmp_path):
    p, src = _int8_repack(ck, tmp_path)
    sd, rep = L.load_h3_state_dict(p)
    _assert_same(sd, src)
    assert rep.quantized == 1 and "quantized" in rep.variant


def test_prefixed_single_file(ck, tmp_path):
    ref = load_file(ck / "h3_tiny_comfy.safetensors")
    p = tmp_path / "ckpt.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in ref.items()}, p)
    sd, rep = L.load_h3_state_dict(p)
    _assert_same(sd, ref)


# ------------------------------------------------------------------ bad inputs

def _err(path, *needles):
    with pytest.raises(CheckpointError) as ei:
        L.load_h3_state_dict(path)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_missing_shard(official):
    (official / "model-00002-of-00002.safetensors").unlink()
    _err(official, "model-00002-of-00002.safetensors", "missing")


def test_index_names_absent_tensor(official):
    idx = json.loads((official / L.OFFICIAL_INDEX).read_text())
    idx["weight_map"]["blocks.7.attn.qkv_proj.weight"] = "model-00001-of-00002.safetensors"
    (official / L.OFFICIAL_INDEX).write_text(json.dumps(idx))
    _err(official, "blocks.7.attn.qkv_proj.weight", "model-00001-of-00002.safetensors")


def test_index_missing_a_tensor_that_the_shard_has(official):
    idx = json.loads((official / L.OFFICIAL_INDEX).read_text())
    del idx["weight_map"]["blocks.0.norm1.weight"]
    (official / L.OFFICIAL_INDEX).write_text(json.dumps(idx))
    _err(official, "blocks.0.norm1.weight", "does not list")


def test_index_with_path_traversal(official):
    idx = json.loads((official / L.OFFICIAL_INDEX).read_text())
    idx["weight_map"]["blocks.0.norm1.weight"] = "../evil.safetensors"
    (official / L.OFFICIAL_INDEX).write_text(json.dumps(idx))
    _err(official, "../evil.safetensors", "plain")


def test_mixed_dtype_shards(official):
    shard = official / "model-00002-of-00002.safetensors"
    sd = load_file(shard)
    bulk = sorted(k for k, v in sd.items() if v.dtype == torch.bfloat16)
    sd = {k: (v.to(torch.float16) if v.dtype == torch.bfloat16 else v) for k, v in sd.items()}
    save_file(sd, shard)
    _err(official, "F16", "BF16", "model-00002-of-00002.safetensors", "mixed-dtype", bulk[0])


def test_fp32_islands_are_not_mixed_dtype(ck):
    # the real files mix F32 islands with a BF16 bulk: that must load
    sd, rep = L.load_h3_state_dict(ck / "h3_tiny_comfy.safetensors")
    assert sd["video_patch_proj.weight"].dtype == torch.float32 and rep.bulk_dtype == "BF16"


@pytest.mark.parametrize("name,what", [
    ("ltx2_tiny.safetensors", "LTX"),
    ("flux2_tiny.safetensors", "FLUX.2"),
    ("zimage_tiny.safetensors", "Z-Image"),
])
def test_wrong_family(ck, name, what):
    _err(ck / name, what, name, "not a MiniMax H3 DiT", "UNETLoader")


def test_vae_is_wrong_family(tmp_path):
    p = tmp_path / "vae.safetensors"
    save_file({"decoder.transformer_blocks.0.scale1": torch.ones(4), "encoder.conv_in.weight": torch.ones(2)}, p)
    _err(p, "VAE", "VAELoader")


def test_unknown_folder_layout(ck, tmp_path):
    d = tmp_path / "two_files"
    d.mkdir()
    shutil.copy(ck / "h3_tiny_comfy.safetensors", d / "a.safetensors")
    shutil.copy(ck / "h3_tiny_curve.safetensors", d / "b.safetensors")
    _err(d, "unknown folder layout", "a.safetensors")


def test_both_index_files(official):
    shutil.copy(official / L.OFFICIAL_INDEX, official / L.DIFFUSERS_INDEX)
    _err(official, "both")


def test_shard_selected_directly(official):
    _err(official / "model-00001-of-00002.safetensors", "shard 1 of 2", "select the folder")


def test_not_safetensors(tmp_path):
    p = tmp_path / "x.ckpt"
    p.write_bytes(b"\x80\x02}q\x00.")
    _err(p, "not a .safetensors")


def test_missing_path(tmp_path):
    _err(tmp_path / "nope", "no such file")


def test_diffusers_without_config(diffusers):
    (diffusers / "config.json").unlink()
    _err(diffusers, "config.json", "rope_freq_dim")


def test_diffusers_qkv_shape_mismatch(diffusers):
    idx = json.loads((diffusers / L.DIFFUSERS_INDEX).read_text())
    shard = diffusers / idx["weight_map"]["transformer_blocks.1.attn.to_k.weight"]
    sd = load_file(shard)
    sd["transformer_blocks.1.attn.to_k.weight"] = sd["transformer_blocks.1.attn.to_k.weight"][:64].contiguous()
    save_file(sd, shard)
    _err(diffusers, "transformer_blocks.1.attn.to_q.weight", "[64, 64]")


def test_diffusers_unknown_tensor(diffusers):
    idx = json.loads((diffusers / L.DIFFUSERS_INDEX).read_text())
    name = idx["weight_map"]["proj_in.weight"]
    sd = load_file(diffusers / name)
    sd["transformer_blocks.0.attn.add_q_proj.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(sd, diffusers / name)
    idx["weight_map"]["transformer_blocks.0.attn.add_q_proj.weight"] = name
    (diffusers / L.DIFFUSERS_INDEX).write_text(json.dumps(idx))
    _err(diffusers, "transformer_blocks.0.attn.add_q_proj.weight", "unknown diffusers tensor")


def test_mixed_naming(ck, tmp_path):
    sd = load_file(ck / "h3_tiny_comfy.safetensors")
    sd["transformer_blocks.0.attn.to_q.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    p = tmp_path / "mixed.safetensors"
    save_file(sd, p)
    _err(p, "inconsistent layout", "transformer_blocks.0.attn.to_q.weight")


def test_missing_required_tensor(ck, tmp_path):
    sd = load_file(ck / "h3_tiny_comfy.safetensors")
    del sd["blocks.1.mlp.fc2.weight"]
    p = tmp_path / "partial.safetensors"
    save_file(sd, p)
    _err(p, "blocks.1.mlp.fc2.weight", "missing")


def test_block_gap(ck, tmp_path):
    sd = load_file(ck / "h3_tiny_comfy.safetensors")
    sd = {(k.replace("blocks.1.", "blocks.2.") if k.startswith("blocks.1.") else k): v for k, v in sd.items()}
    p = tmp_path / "gap.safetensors"
    save_file(sd, p)
    _err(p, "gap", "blocks.1.")


def test_official_config_mismatch(official):
    cfg = json.loads((official / "config.json").read_text())
    cfg["num_attention_heads"] = 6
    cfg["attention_head_dim"] = 16
    (official / "config.json").write_text(json.dumps(cfg))
    _err(official, "config.json", "6 heads x 16", "3 x 32")


def test_int8_without_marker(ck, tmp_path):
    p, _ = _int8_repack(ck, tmp_path, marker=False)
    _err(p, "blocks.0.attn.qkv_proj.weight", "comfy_quant")


def test_bad_quant_marker(ck, tmp_path):
    p, sd = _int8_repack(ck, tmp_path)
    sd["blocks.0.attn.qkv_proj.comfy_quant"] = torch.tensor(list(b"[1, 2]"), dtype=torch.uint8)
    save_file(sd, p)
    _err(p, "comfy_quant", "format")


def test_duplicate_json_key_in_index(official):
    text = (official / L.OFFICIAL_INDEX).read_text()
    text = text.replace('"weight_map": {', '"weight_map": {"rope.inv_freq": "model-00001-of-00002.safetensors", ', 1)
    (official / L.OFFICIAL_INDEX).write_text(text)
    _err(official, "duplicate JSON key")


def test_failure_mid_read_leaves_nothing_referenced(official, monkeypatch):
    refs = []
    orig = sio.SafeFile.get

    def flaky(self, name, device="cpu", **kw):
        if len(refs) == 20:
            raise CheckpointError(f"short read of {name!r}")
        t = orig(self, name, device, **kw)
        refs.append(weakref.ref(t))
        return t

    monkeypatch.setattr(sio.SafeFile, "get", flaky)
    with pytest.raises(CheckpointError) as ei:
        L.load_h3_state_dict(official)
    assert "short read" in str(ei.value)
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert len(refs) == 20 and not alive  # exception (and its traceback) still held here
