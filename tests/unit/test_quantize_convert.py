"""The streaming converter (ditkit.quantize / loaders/quantize.py) without ComfyUI: the file it writes, its
header-first layout, the recipes, and what a failure leaves behind (nothing)."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from ditkit.errors import CheckpointError, DitKitError
from ditkit.kernels import quant as Q
from ditkit.loaders import h3 as H3
from ditkit.loaders import quantize as QC
from ditkit.loaders import safe_fs
from ditkit.loaders.safetensors_io import load_with_metadata, read_header, save_file, stream_chunks
from ditkit.quantize import convert
from ditkit.tiny import ckpt_h3, ckpt_image, ckpt_ltx


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    out = tmp_path_factory.mktemp("q")
    ckpt_h3.gen_h3_dit_official(out)
    return out / ckpt_h3.OFFICIAL_DIR


def _quiet(*_):
    pass


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_written_file_is_the_quantized_converted_state_dict(official, tmp_path, fmt):
    path, report = convert(str(official), str(tmp_path / "o.safetensors"), fmt, log=_quiet)
    got, meta = load_with_metadata(path)
    ref, _ = H3.load_h3_state_dict(official)        # the converted (de-interleaved) bf16/fp32 weights
    quantized = set(json.loads(meta["_quantization_metadata"])["layers"])
    assert quantized == {k[:-7] for k, v in ref.items() if QC.classify("h3", k, tuple(v.shape))[1]}
    assert "blocks.0.adaln_proj.linear" in quantized and "final_layer.adaln_proj.linear" not in quantized
    for k, v in ref.items():
        layer = k[:-7]
        if layer in quantized and k.endswith(".weight"):
            data, scales = Q.quantize(v, fmt)
            assert torch.equal(got[k].view(torch.uint8), data.view(torch.uint8))
            for sk, sv in scales.items():
                assert got[f"{layer}.{sk}"].dtype == sv.dtype
                assert torch.equal(got[f"{layer}.{sk}"].reshape(-1).view(torch.uint8), sv.reshape(-1).view(torch.uint8))
            assert bytes(got[f"{layer}.comfy_quant"].tolist()) == json.dumps({"format": fmt}).encode()
        else:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    rec = json.loads(meta["ditkit_quantize"])
    assert rec["format"] == fmt and rec["activation_scales"].startswith("none")
    names = sorted(os.listdir(official))
    assert [f["name"] for f in rec["source"]["files"]] == [n for n in names if n.endswith(".safetensors")]
    assert report.classes["norms"].quantized == 0 and report.classes["block MLP"].quantized == 8


def test_header_is_laid_out_before_any_tensor_is_read(official, tmp_path, monkeypatch):
    seen = []
    orig = safe_fs._write_chunk

    def spy(fd, data):
        seen.append(bytes(memoryview(data).cast("B")[:8]) if not seen else len(memoryview(data).cast("B")))
        return orig(fd, data)

    monkeypatch.setattr(safe_fs, "_write_chunk", spy)
    path, _ = convert(str(official), str(tmp_path / "h.safetensors"), "nvfp4", log=_quiet)
    hdr = read_header(path)
    assert int.from_bytes(seen[0], "little") == hdr.header_len          # first write: the whole header
    assert seen[1:] == [ti.nbytes for ti in sorted(hdr.tensors.values(), key=lambda t: t.begin)]


def test_out_of_disk_leaves_no_file(official, tmp_path, monkeypatch):
    calls = []
    orig = safe_fs._write_chunk

    def full(fd, data):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig(fd, data)

    monkeypatch.setattr(safe_fs, "_write_chunk", full)
    before = {p: p.stat().st_mtime_ns for p in official.iterdir()}
    with pytest.raises(OSError) as ei:
        convert(str(official), str(tmp_path / "full.safetensors"), "float8_e4m3fn", log=_quiet)
    assert ei.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []                                 # neither the file nor a temp file
    assert {p: p.stat().st_mtime_ns for p in official.iterdir()} == before


def test_cli_reports_out_of_disk_in_one_line(official, tmp_path, monkeypatch, capsys):
    from ditkit import quantize as cli

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safe_fs, "_write_chunk", full)
    rc = cli.main([str(official), str(tmp_path / "x.safetensors"), "--format", "mxfp8", "--no-hash"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("ERROR: ") and "out of disk space" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


def test_refusals_before_anything_is_written(official, tmp_path):
    with pytest.raises(DitKitError, match="not one of"):
        convert(str(official), str(tmp_path / "a.safetensors"), "float4_magic", log=_quiet)
    with pytest.raises(DitKitError, match="must end with .safetensors"):
        convert(str(official), str(tmp_path / "a.bin"), "mxfp8", log=_quiet)
    sd = {"x.weight": torch.ones(4, 4)}
    save_file(sd, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not a MiniMax H3, LTX-2, Z-Image or FLUX.2"):
        convert(str(tmp_path / "other.safetensors"), str(tmp_path / "b.safetensors"), "mxfp8", log=_quiet)
    base = ckpt_h3.base_state_dict()
    base["blocks.0.mlp.fc1.weight"] = base["blocks.0.mlp.fc1.weight"].to(torch.float8_e4m3fn)
    base["blocks.0.mlp.fc1.comfy_quant"] = QC.marker_tensor("float8_e4m3fn")
    base["blocks.0.mlp.fc1.weight_scale"] = torch.tensor(1.0)
    save_file(base, tmp_path / "fp8.safetensors")
    with pytest.raises(CheckpointError, match="already quantized"):
        convert(str(tmp_path / "fp8.safetensors"), str(tmp_path / "c.safetensors"), "int8_tensorwise", log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8.safetensors", "other.safetensors"]


def test_inf_weight_is_refused_by_name_and_nothing_is_left(tmp_path):
    base = ckpt_h3.base_state_dict()
    base["condition_proj.weight"][0, 0] = float("inf")       # a kept (not quantized) tensor is checked too
    save_file(base, tmp_path / "inf.safetensors")
    with pytest.raises(CheckpointError, match=r"'condition_proj\.weight' holds 0 NaN and 1 Inf"):
        convert(str(tmp_path / "inf.safetensors"), str(tmp_path / "o.safetensors"), "mxfp8", log=_quiet)
    assert [p.name for p in tmp_path.iterdir()] == ["inf.safetensors"]


def test_stream_chunks_refuses_a_tensor_out_of_layout():
    inv = {"a": ((2, 2), "F32"), "b": ((3,), "BF16")}
    gen = stream_chunks(inv, iter([("a", torch.zeros(2, 2)), ("b", torch.zeros(3))]))
    next(gen), next(gen)
    with pytest.raises(CheckpointError, match="BF16"):
        next(gen)
    gen = stream_chunks(inv, iter([("b", torch.zeros(3, dtype=torch.bfloat16))]))
    next(gen)
    with pytest.raises(CheckpointError, match="laid out"):
        next(gen)


# ------------------------------------------------------------------------------------------------- recipes

@pytest.mark.parametrize("family,shapes", [("h3", ckpt_h3.comfy_shapes()), ("ltx2", ckpt_ltx.ltxav_shapes()),
                                           ("zimage", ckpt_image.zimage_shapes()),
                                           ("flux2", ckpt_image.flux2_shapes())])
def test_recipes_keep_embeddings_norms_modulation_and_final_layers(family, shapes):
    assert QC.detect_family(shapes) == family
    quantized = {k for k, s in shapes.items() if QC.classify(family, k, s)[1]}
    assert quantized, family
    for k in quantized:
        assert k.endswith(".weight") and len(shapes[k]) == 2 and min(shapes[k]) >= QC.SMALL_SIDE
        for word in ("norm", "modulation", "adaln_single", "embed", "final_layer", "proj_out", "patch", "_in.",
                     "caption", "connector", "time_"):
            assert word not in k.replace("adaln_proj.linear", "") or k.startswith("blocks."), (family, k)
    expect = {"h3": "blocks.0.mlp.fc1.weight", "ltx2": "transformer_blocks.0.attn1.to_q.weight",
              "zimage": "layers.0.feed_forward.w2.weight", "flux2": "single_blocks.0.linear1.weight"}[family]
    assert expect in quantized


def test_ltx2_recipe_is_lightricks_fp8_cast_suffix_list():
    # ltx_core.quantization.fp8_cast: "transformer_blocks." in the name and a suffix of this list
    suffixes = (".to_q", ".to_k", ".to_v", ".to_out.0", "ff.net.0.proj", "ff.net.2")
    shapes = ckpt_ltx.ltxav_shapes()
    for k, s in shapes.items():
        mod = k[: -len(".weight")] if k.endswith(".weight") else None
        theirs = mod is not None and "transformer_blocks." in mod and mod.endswith(suffixes) and len(s) == 2
        ours = QC.classify("ltx2", k, s)
        assert ours[1] == (theirs and min(s) >= QC.SMALL_SIDE), k
        if theirs and not ours[1]:
            assert ours[2].startswith("small layer")


def test_output_inventory_matches_what_the_stream_yields(official):
    src = QC.open_source(str(official))
    plan = QC.make_plan(src.family, "nvfp4", src.inventory)
    rep = QC.QuantReport("h3", "nvfp4", "x")
    got = [(k, tuple(t.shape)) for k, t in QC.quantize_stream(src.reader(), plan, rep, "t", measure_error=False)]
    assert got == [(k, s) for k, (s, _) in plan.output_inventory().items()]
