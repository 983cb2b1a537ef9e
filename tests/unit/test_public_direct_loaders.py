"""Public functions of loaders/ that were only reached through their callers (issue 29: every public function is called
directly by a unit test). Files are written with the ``safetensors`` package itself (the format's own writer), hashes
with hashlib; every other oracle is written here from the function's contract. Boundaries on both sides."""
from __future__ import annotations

import hashlib
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from ditkit.errors import AdapterError, CheckpointError
from ditkit.loaders import h3 as L
from ditkit.loaders import h3_adapters as A
from ditkit.loaders import host_memory, lokr_apply
from ditkit.loaders import quantize as Q

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ORIG = {"video_patch_proj.weight": (4, 2), "audio_patch_proj.weight": (4, 2), "blocks.0.norm1.weight": (4,)}
DIFF = {"proj_in.weight": (4, 2), "audio_proj_in.weight": (4, 2), "transformer_blocks.0.norm1.weight": (4,)}


def _st(path, names, prefix="", metadata=None):
    save_file({prefix + k: torch.zeros(s) for k, s in names.items()}, str(path), metadata=metadata)
    return path


# ---- loaders/h3.detect
@pytest.mark.parametrize("prefix", ["", "diffusion_model.", "model.diffusion_model."])
def test_detect_single_file(tmp_path, prefix):
    p = _st(tmp_path / "m.safetensors", ORIG, prefix, {"k": "v"})
    src = L.detect(p)
    assert src.layout == "comfy" and src.prefix == prefix and src.files == [str(p)]
    assert set(src.locations) == set(ORIG) and src.metadata == {"k": "v"} and src.config is None
    assert all(f == str(p) for f, _ in src.locations.values())
    sft = _st(tmp_path / "m.SFT", ORIG)                        # the other extension, any case
    assert L.detect(sft).layout == "comfy"


def test_detect_diffusers_single_file_and_folder(tmp_path):
    d = tmp_path / "tr"
    d.mkdir()
    p = _st(d / L.DIFFUSERS_SINGLE, DIFF, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"num_layers": 1}), encoding="utf-8")
    for target in (p, d):
        src = L.detect(target)
        assert src.layout == "diffusers" and src.config == {"num_layers": 1} and set(src.locations) == set(DIFF)
    other = _st(tmp_path / "x.safetensors", DIFF)               # diffusers names in a single file: diffusers layout
    assert L.detect(other).layout == "diffusers" and L.detect(other).config is None


def _index(folder, name, wm):
    (folder / name).write_text(json.dumps({"metadata": {}, "weight_map": wm}), encoding="utf-8")


@pytest.mark.parametrize("index_name,names,layout", [(L.OFFICIAL_INDEX, ORIG, "official"),
                                                     (L.DIFFUSERS_INDEX, DIFF, "diffusers")])
def test_detect_sharded_folder(tmp_path, index_name, names, layout):
    keys = sorted(names)
    s1, s2 = "m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"
    _st(tmp_path / s1, {k: names[k] for k in keys[:2]})
    _st(tmp_path / s2, {k: names[k] for k in keys[2:]})
    _index(tmp_path, index_name, {k: (s1 if i < 2 else s2) for i, k in enumerate(keys)})
    src = L.detect(tmp_path)
    assert src.layout == layout and src.files == [str(tmp_path / s1), str(tmp_path / s2)]
    assert {k: os.path.basename(f) for k, (f, _) in src.locations.items()} == \
        {k: (s1 if i < 2 else s2) for i, k in enumerate(keys)}
    with pytest.raises(CheckpointError, match="shard 1 of 2"):  # a shard picked beside its index: pick the folder
        L.detect(tmp_path / s1)


def test_detect_shard_without_index_is_a_single_file(tmp_path):
    p = _st(tmp_path / "m-00001-of-00002.safetensors", ORIG)
    assert L.detect(p).layout == "comfy"


def test_detect_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        L.detect(tmp_path / "missing.safetensors")
    for name in ("m.ckpt", "m.pt", "m.safetensors.bak"):
        (tmp_path / name).write_bytes(b"x")
        with pytest.raises(CheckpointError, match="not a .safetensors file"):
            L.detect(tmp_path / name)
    d = tmp_path / "unknown"
    d.mkdir()
    for i in range(4):
        _st(d / f"f{i}.safetensors", ORIG)
    with pytest.raises(CheckpointError, match=r"unknown folder layout.*found 4 .safetensors file\(s\): f0.safetensors, "
                                              r"f1.safetensors, f2.safetensors\)"):
        L.detect(d)
    e = tmp_path / "empty"
    e.mkdir()
    with pytest.raises(CheckpointError, match=r"found 0 .safetensors file\(s\)\)"):
        L.detect(e)
    both = tmp_path / "both"
    both.mkdir()
    _st(both / "a.safetensors", ORIG)
    _index(both, L.OFFICIAL_INDEX, {k: "a.safetensors" for k in ORIG})
    _index(both, L.DIFFUSERS_INDEX, {k: "a.safetensors" for k in ORIG})
    with pytest.raises(CheckpointError, match="holds both"):
        L.detect(both)
    with pytest.raises(CheckpointError):                      # neither family's names
        L.detect(_st(tmp_path / "other.safetensors", {"x.weight": (2,)}))


def test_detect_index_and_shards_must_match(tmp_path):
    _st(tmp_path / "a.safetensors", ORIG)
    wm = {k: "a.safetensors" for k in ORIG}
    _index(tmp_path, L.OFFICIAL_INDEX, {**wm, "blocks.0.norm2.weight": "a.safetensors"})
    with pytest.raises(CheckpointError, match=r"names tensor 'blocks.0.norm2.weight'.*\(1 missing\)"):
        L.detect(tmp_path)
    _index(tmp_path, L.OFFICIAL_INDEX, {k: v for k, v in wm.items() if k != "blocks.0.norm1.weight"})
    with pytest.raises(CheckpointError, match=r"holds tensor 'blocks.0.norm1.weight'.*\(1 unlisted\)"):
        L.detect(tmp_path)


# ---- loaders/h3.comfy_metadata
def test_comfy_metadata(tmp_path):
    meta = {"config": json.dumps({"a": 1}), "x": "y"}
    assert L.comfy_metadata(_st(tmp_path / "m.safetensors", ORIG, "diffusion_model.", meta)) == meta
    assert L.comfy_metadata(_st(tmp_path / "n.safetensors", ORIG)) is None             # no metadata
    assert L.comfy_metadata(_st(tmp_path / "d.safetensors", DIFF, metadata=meta)) is None   # not the comfy layout
    # an already detected source (the loader passes its plan's): the same answers, no second detection
    p = _st(tmp_path / "m2.safetensors", ORIG, "diffusion_model.", meta)
    src = L.detect(p)
    p.unlink()                                           # nothing is read again: the file is gone
    got = L.comfy_metadata(src)
    assert got == meta and got is not src.metadata       # a copy: the caller may change it
    assert L.comfy_metadata(L.detect(_st(tmp_path / "n2.safetensors", ORIG))) is None
    assert L.comfy_metadata(L.detect(_st(tmp_path / "d2.safetensors", DIFF, metadata=meta))) is None
    d = tmp_path / "tr"
    d.mkdir()
    _st(d / L.DIFFUSERS_SINGLE, DIFF, metadata=meta)
    assert L.comfy_metadata(d) is None
    got = L.comfy_metadata(tmp_path / "m.safetensors")
    got["x"] = "changed"                                                              # a copy, not the header's dict
    assert L.comfy_metadata(tmp_path / "m.safetensors")["x"] == "y"


# ---- loaders/h3.rope_inv_freq
@pytest.mark.parametrize("n,theta", [(1, 10000.0), (4, 10000.0), (16, 10000.0), (8, 256.0), (3, 1e6)])
def test_rope_inv_freq(n, theta):
    got = L.rope_inv_freq(n, theta) if theta != 10000.0 else L.rope_inv_freq(n)
    want = torch.tensor([1.0 / theta ** (2 * i / (2 * n)) for i in range(n)], dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=0)
    assert float(got[0]) == 1.0


def test_rope_inv_freq_empty():
    assert L.rope_inv_freq(0).shape == (0,)


# ---- loaders/h3_adapters: swap_map, underscored, strip_prefix, assigned_gates
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 8])
def test_swap_map_swaps_the_halves(rows):
    m = A.swap_map(rows)
    n = rows // 2
    assert m.dtype == torch.int64 and m.tolist() == [(i + n) % rows for i in range(rows)]
    x = torch.arange(rows * 3).view(rows, 3)
    assert torch.equal(x[m], torch.cat([x[n:], x[:n]]))
    assert sorted(m.tolist()) == list(range(rows))


NH, HD, H = 2, 4, 8
SHAPES = {"diffusion_model.video_patch_proj.weight": (H, 6), "diffusion_model.a_b.weight": (2, 2),
          "diffusion_model.a.b.weight": (2, 2)}
for _i in range(2):
    SHAPES[f"diffusion_model.blocks.{_i}.attn.qkv_proj.weight"] = (3 * NH * HD, H)
    SHAPES[f"diffusion_model.blocks.{_i}.attn.q_norm.weight"] = (HD,)
    SHAPES[f"diffusion_model.blocks.{_i}.mlp.fc1.weight"] = (16, H)
SHAPES["diffusion_model.token_refiner.blocks.0.attn.qkv_proj.weight"] = (3 * NH * HD, H)
GEO = A.geometry(SHAPES)


def test_underscored_maps_back_and_leaves_clashes_out():
    u = A.underscored(GEO)
    assert u["blocks_0_attn_qkv_proj"] == "blocks.0.attn.qkv_proj"
    assert u["blocks_1_mlp_fc1"] == "blocks.1.mlp.fc1"
    assert u["token_refiner_blocks_0_attn_qkv_proj"] == "token_refiner.blocks.0.attn.qkv_proj"
    assert u["blocks_1_attn_to_gate_compress"] == "blocks.1.attn.to_gate_compress"
    assert "blocks_2_attn_to_gate_compress" not in u                        # two blocks: 0 and 1 only
    assert u["transformer_blocks_1_attn_to_q"] == "transformer_blocks.1.attn.to_q"
    assert "a_b" not in u                                                   # a_b and a.b collide: both left out
    assert all(k == v.replace(".", "_") for k, v in u.items())
    assert "video_patch_proj" in u and "blocks_0_attn_q_norm" in u


@pytest.mark.parametrize("prefix,want", [
    ("lora_unet_blocks_0_attn_qkv_proj", ("lora_unet_", "blocks.0.attn.qkv_proj")),
    ("lycoris_blocks_1_mlp_fc1", ("lycoris_", "blocks.1.mlp.fc1")),
    ("lora_transformer_transformer_blocks_0_attn_to_k", ("lora_transformer_", "transformer_blocks.0.attn.to_k")),
    ("base_model.model.transformer.transformer_blocks.1.attn.to_v",
     ("base_model.model.transformer.", "transformer_blocks.1.attn.to_v")),
    ("base_model.model.blocks.0.mlp.fc1", ("base_model.model.", "blocks.0.mlp.fc1")),
    ("model.diffusion_model.blocks.0.attn.qkv_proj", ("model.diffusion_model.", "blocks.0.attn.qkv_proj")),
    ("diffusion_model.blocks.1.attn.qkv_proj", ("diffusion_model.", "blocks.1.attn.qkv_proj")),
    ("transformer.video_patch_proj", ("transformer.", "video_patch_proj")),
    ("blocks.0.attn.qkv_proj", ("", "blocks.0.attn.qkv_proj")),
    ("lora_unet_blocks_2_attn_qkv_proj", None),              # no block 2
    ("lora_unet_a_b", None),                                 # an underscored name that clashes
    ("lora_te_blocks_0_attn_qkv_proj", None),
    ("diffusion_model.blocks.0.attn.nothing", None),
    ("blocks.0.attn.qkv", None),
])
def test_strip_prefix(prefix, want):
    assert A.strip_prefix(GEO, prefix, A.underscored(GEO)) == want


def test_strip_prefix_uses_the_given_underscore_map():
    assert A.strip_prefix(GEO, "lora_unet_xyz", {"xyz": "blocks.0.mlp.fc1"}) == ("lora_unet_", "blocks.0.mlp.fc1")
    assert A.strip_prefix(GEO, "lora_unet_blocks_0_mlp_fc1", {}) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_assigned_gates_blend(dtype):
    g = torch.Generator().manual_seed(3)
    base = {"0": torch.randn(3, 2, generator=g, dtype=torch.float64), 2: torch.randn(2, generator=g)}
    new = {0: torch.randn(3, 2, generator=g).to(dtype), 1: torch.randn(4, generator=g).to(dtype)}
    plan = SimpleNamespace(gates=new)
    out = A.assigned_gates(plan, base, 1.0, "a.safetensors")                 # strength 1: assigned
    assert set(out) == {0, 1, 2} and out[0] is new[0] and out[1] is new[1] and out[2] is base[2]
    plan = SimpleNamespace(gates={0: new[0]})
    for s in (0.0, 0.5, -1.0, 2.0, 1.0 - 2 ** -40):
        out = A.assigned_gates(plan, base, s, "a.safetensors")
        want = (base["0"] + s * (new[0].double() - base["0"])).to(dtype)
        assert out[0].dtype == dtype and torch.equal(out[0], want), s
        assert set(out) == {0, 2} and out[2] is base[2]


def test_assigned_gates_without_a_base_gate():
    plan = SimpleNamespace(gates={1: torch.ones(2)})
    assert A.assigned_gates(plan, None, 1.0, "x")[1] is plan.gates[1]
    for base, s in ((None, 0.5), ({0: torch.zeros(2)}, 0.999), ({}, 0.0)):
        with pytest.raises(AdapterError, match=r"my.safetensors: block 1 gate .* at strength"):
            A.assigned_gates(plan, base, s, "my.safetensors")
    assert A.assigned_gates(SimpleNamespace(gates={}), None, 0.5, "x") == {}


# ---- loaders/host_memory: adopt, release_free_heap
@pytest.mark.parametrize("dtype", DTYPES)
def test_adopt_copies_only_large_cpu_tensors(dtype):
    item = torch.empty((), dtype=dtype).element_size()
    at = host_memory.MIN_BYTES // item
    small = torch.randn(at - 1).to(dtype)
    assert host_memory.adopt(small) is small                            # one element under the limit: itself
    big = torch.randn(at).to(dtype)
    out = host_memory.adopt(big)                                        # exactly at the limit: a mapped copy
    assert out is not big and out.data_ptr() != big.data_ptr() and out.dtype == dtype
    assert torch.equal(out, big) and out.is_contiguous() and out.data_ptr() % mmap_page() == 0
    t = torch.randn(64, at // 64 + 2).to(dtype).t()                      # non-contiguous: a contiguous copy
    out = host_memory.adopt(t)
    assert out.is_contiguous() and out.shape == t.shape and torch.equal(out, t)
    meta = torch.empty(at * 4, dtype=dtype, device="meta")
    assert host_memory.adopt(meta) is meta                              # not on the CPU: itself


def mmap_page():
    import mmap
    return mmap.PAGESIZE


def test_release_free_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_TRIM", lambda n: calls.append(n) or 1)
    assert host_memory.release_free_heap() is True and calls == [0]
    monkeypatch.setattr(host_memory, "_TRIM", False)
    assert host_memory.release_free_heap() is False
    monkeypatch.setattr(host_memory, "_TRIM", None)                    # found again on first use
    glibc = bool(os.confstr("CS_GNU_LIBC_VERSION")) if "CS_GNU_LIBC_VERSION" in os.confstr_names else False
    assert host_memory.release_free_heap() is glibc


# ---- loaders/lokr_apply.read_peft_config_file
def test_read_peft_config_file(tmp_path):
    p = tmp_path / "adapter_config.json"
    cfg = {"peft_type": "LOKR", "r": 4, "target_modules": ["a"]}
    p.write_text(json.dumps(cfg), encoding="utf-8")
    assert lokr_apply.read_peft_config_file(str(p)) == cfg
    raw = json.dumps(cfg).encode()
    p.write_bytes(raw + b" " * (lokr_apply.MAX_CONFIG_BYTES - len(raw)))           # exactly the limit
    assert lokr_apply.read_peft_config_file(str(p)) == cfg
    p.write_bytes(raw + b" " * (lokr_apply.MAX_CONFIG_BYTES + 1 - len(raw)))       # one byte over
    with pytest.raises(AdapterError, match=f"{lokr_apply.MAX_CONFIG_BYTES + 1} bytes"):
        lokr_apply.read_peft_config_file(str(p))


@pytest.mark.parametrize("body,match", [
    (b"[1, 2]", "must be a JSON object"), (b'"x"', "must be a JSON object"), (b'{"r": NaN}', "PEFT adapter config"),
    (b'{"r": 1, "r": 2}', "PEFT adapter config"), (b"\xff\xfe", "not UTF-8"), (b"", "PEFT adapter config"),
])
def test_read_peft_config_file_refuses_bad_content(tmp_path, body, match):
    p = tmp_path / "adapter_config.json"
    p.write_bytes(body)
    with pytest.raises(AdapterError, match=match):
        lokr_apply.read_peft_config_file(str(p))


def test_read_peft_config_file_refuses_what_is_not_a_file(tmp_path):
    with pytest.raises(AdapterError, match="cannot be read"):
        lokr_apply.read_peft_config_file(str(tmp_path / "missing.json"))
    with pytest.raises(AdapterError, match="not a regular file"):
        lokr_apply.read_peft_config_file(str(tmp_path))
    if hasattr(os, "mkfifo"):                                   # a FIFO must not block the reader
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        with pytest.raises(AdapterError, match="not a regular file"):
            lokr_apply.read_peft_config_file(str(fifo))


# ---- loaders/quantize: model_prefix, refuse_quantized_source, file_sha256
def test_model_prefix():
    assert Q.model_prefix(["model.diffusion_model.a", "model.diffusion_model.b"]) == "model.diffusion_model."
    assert Q.model_prefix(["diffusion_model.a", "diffusion_model.b"]) == "diffusion_model."
    assert Q.model_prefix(k for k in ["diffusion_model.a"]) == "diffusion_model."        # any iterable, read once
    assert Q.model_prefix(["diffusion_model.a", "model.diffusion_model.b"]) == ""          # mixed
    assert Q.model_prefix(["diffusion_model.a", "b"]) == ""
    assert Q.model_prefix(["blocks.0.x"]) == "" and Q.model_prefix(["diffusion_modelx.a"]) == ""


@pytest.mark.parametrize("dt", ["F64", "F32", "F16", "BF16"])
def test_refuse_quantized_source_passes_float_sources(dt):
    assert Q.refuse_quantized_source("m", {"a.weight": dt, "a.bias": dt}, None) is None
    assert Q.refuse_quantized_source("m", {"a.weight": dt}, {"format": "pt"}) is None


@pytest.mark.parametrize("dt", ["F8_E4M3", "F8_E5M2", "I8", "U8", "I32", "BOOL", "f32", "F4"])
def test_refuse_quantized_source_refuses_non_float_tensors(dt):
    with pytest.raises(CheckpointError, match=f"'m': tensor 'a.weight' is {dt}, not a float weight"):
        Q.refuse_quantized_source("m", {"b.weight": "BF16", "a.weight": dt}, None)


@pytest.mark.parametrize("key", ["a.comfy_quant", "a.scaled_fp8", "scaled_fp8", "a.weight_scale", "a.weight_scale_2",
                                 "a.input_scale", "a.scale_weight", "a.scale_input"])
def test_refuse_quantized_source_refuses_quant_entries(key):
    with pytest.raises(CheckpointError, match=f"already quantized \\(tensor '{key}'"):
        Q.refuse_quantized_source("m", {"x.weight": "BF16", key: "F32"}, {})
    assert Q.refuse_quantized_source("m", {"a.weight_scales": "F32", "a.scale": "F32"}, {}) is None   # look-alikes


def test_refuse_quantized_source_reads_the_metadata():
    with pytest.raises(CheckpointError, match="__metadata__ '_quantization_metadata'"):
        Q.refuse_quantized_source("m", {"a.weight": "BF16"}, {"_quantization_metadata": "{}"})
    assert Q.refuse_quantized_source("m", {"a.weight": "BF16"}, {"quantization_metadata": "{}"}) is None


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 100])
def test_file_sha256(tmp_path, size):
    data = bytes((i * 37 + 11) % 256 for i in range(size))
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    for chunk in (1, 3, 8, 8 << 20):
        assert Q.file_sha256(str(p), chunk) == want
    assert Q.file_sha256(str(p)) == want
    link = tmp_path / "link.bin"
    link.symlink_to(p)                                        # a model file: links are the user's choice, followed
    assert Q.file_sha256(str(link)) == want


def test_file_sha256_refuses_a_missing_file(tmp_path):
    with pytest.raises(OSError):
        Q.file_sha256(str(tmp_path / "missing"))
