"""The h3_turbo_bypass_tiny example (issue #30 acceptance): the tiny pruned int8 ConvRot H3 + a Turbo-style LoRA in
bypass mode, its AdaLN pairs carried as curve columns from the grid file the tiny generator writes, sampled to an
MP4 on the real headless server; without the grid input the same graph fails naming the file to supply."""
from __future__ import annotations

import copy
import json

import torch

from ditkit.run import REPO
from ditkit.tiny import ckpt_h3 as c
from tests.support.quant_oracle import bits, host_quantize_layer

EXAMPLE = REPO / "example_workflows" / "api" / "h3_turbo_bypass_tiny.json"


def _graph():
    return json.loads(EXAMPLE.read_text(encoding="utf-8"))


def test_example_runs_turbo_on_pruned_int8_convrot_in_bypass_to_an_mp4(comfy_server):
    g = _graph()
    ad = g["5"]["inputs"]
    assert g["5"]["class_type"] == "DitKitAdapterLoader" and ad["mode"] == "bypass"
    assert g["1"]["inputs"]["unet_name"] == "h3_tiny_pruned_int8_convrot.safetensors"
    assert ad["silu_t_emb_grid"] == "h3_tiny_silu_t_emb_grid.safetensors"
    before = comfy_server.log_text().count("Turbo AdaLN pairs as curve columns")
    entry = comfy_server.run(g)
    assert entry["status"]["status_str"] == "success"
    log = comfy_server.log_text()
    assert log.count("Turbo AdaLN pairs as curve columns") > before, comfy_server.log_tail(20)
    files = comfy_server.output_files(entry)
    assert any(str(f).endswith(".mp4") and f.stat().st_size > 0 for f in files)


def test_example_without_the_grid_fails_naming_the_file(comfy_server):
    g = copy.deepcopy(_graph())
    g["5"]["inputs"]["silu_t_emb_grid"] = "none"
    g["23"]["inputs"]["filename_prefix"] = "ditkit/h3_turbo_bypass_tiny_nogrid"
    err = str(comfy_server.run_expect_failure(g))
    assert "AdaLN pair of a Turbo" in err and "silu_t_emb_grid [65, 32]" in err and "time_embedder_checkpoint" in err


def test_generator_repack_is_the_hosts_quantize(comfy):
    """The tiny generator's pruned int8 ConvRot repack (comfy_kitchen's layout) equals, bit for bit, the repack
    made with the host's own layout quantize (tests/support/quant_oracle)."""
    curve = c.curve_state_dict(c.base_state_dict())
    a = c.comfy_quant_state_dict(curve, "int8_convrot", c.kitchen_quantize_layer)
    b = c.comfy_quant_state_dict(curve, "int8_convrot", host_quantize_layer)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k
    assert any(k.endswith(".weight_scale") for k in a)
    import pytest

    with pytest.raises(ValueError, match="int8_convrot only"):
        c.kitchen_quantize_layer(torch.ones(4, 16), "mxfp8")


def test_gen_h3_turbo_writes_the_three_files(comfy, tmp_path):
    from ditkit.loaders.safetensors_io import load_file

    files = c.gen_h3_turbo(tmp_path)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in files)
    assert names == sorted([c.TURBO_LORA, c.SILU_GRID_FILE, c.PRUNED_INT8_CONVROT_FILE])
    grid = load_file(tmp_path / c.SILU_GRID_FILE)
    assert grid["silu_t_emb_grid"].shape == (c.CURVE_GRID, c.CONFIG["time_embed_dim"])
    assert torch.equal(grid["t_grid"], torch.linspace(0, 1, c.CURVE_GRID))


def test_example_with_the_unpruned_checkpoint_instead_of_the_grid(comfy_server):
    """The other source through the real node: the unpruned tiny checkpoint's time embedder in
    'time_embedder_checkpoint'; both inputs set at once fails naming both."""
    g = copy.deepcopy(_graph())
    g["5"]["inputs"]["silu_t_emb_grid"] = "none"
    g["5"]["inputs"]["time_embedder_checkpoint"] = "h3_tiny_comfy.safetensors"
    g["23"]["inputs"]["filename_prefix"] = "ditkit/h3_turbo_bypass_tiny_ckpt"
    before = comfy_server.log_text().count("Turbo AdaLN pairs as curve columns")
    entry = comfy_server.run(g)
    assert entry["status"]["status_str"] == "success"
    assert comfy_server.log_text().count("Turbo AdaLN pairs as curve columns") > before
    assert "the time embedder of h3_tiny_comfy.safetensors" in json.dumps(entry["outputs"])
    g["5"]["inputs"]["silu_t_emb_grid"] = "h3_tiny_silu_t_emb_grid.safetensors"
    err = str(comfy_server.run_expect_failure(g))
    assert "both 'silu_t_emb_grid'" in err and "'time_embedder_checkpoint'" in err
