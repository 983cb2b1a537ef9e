"""sampling/fasth3_recipe (issue 29 gap classes): every comparison a FastH3 contract or sidecar passes through, on
both sides of its bound, so a valid contract is never refused (the audit's planted ``<=`` -> ``<`` refused
vsa_sparsity 0.0) and an invalid one always is; the public helpers called directly.
Bounds are FastVideo's (VSA_sparsity in [0, 1), tile (4,4,4) = 64 tokens), written here."""
from __future__ import annotations

import json

import pytest

from ditkit.errors import CheckpointError
from ditkit.sampling import fasth3 as sched
from ditkit.sampling import fasth3_recipe as R

LADDER = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 749, 500, 250],
          "num_inference_steps": 5, "transformer_forwards": 4}


def contract(**extra):
    return sched.parse_contract(dict(LADDER, **extra), "test contract", "x/fastvideo_inference.json")


def ev(c):
    return R.Evidence(num_blocks=2, gate_blocks=2, gates_nonzero=True, contract=c)


@pytest.mark.parametrize("sp", [0.0, 0.5, 0.999999, 1.0 - 2 ** -52])
def test_sparsity_inside_the_range_is_accepted(sp):
    rc = R.choose("auto", None, ev(contract(attention_backend="VIDEO_SPARSE_ATTN_H3", vsa_sparsity=sp)))
    assert rc.sparsity == sp
    assert rc.keep_percent == round(100.0 * (1.0 - sp), 9)


@pytest.mark.parametrize("sp", [-1e-12, -0.0 - 2 ** -1074, 1.0, 1.5])
def test_sparsity_outside_the_range_is_refused(sp):
    with pytest.raises(CheckpointError, match=r"is outside \[0, 1\)"):
        R.choose("auto", None, ev(contract(attention_backend="VIDEO_SPARSE_ATTN_H3", vsa_sparsity=sp)))


@pytest.mark.parametrize("tile,ok", [(64, True), (64.0, True), (63, False), (65, False), (None, True)])
def test_tile_size_is_exactly_64(tile, ok):
    extra = {"attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.9}
    if tile is not None:
        extra["vsa_tile_size"] = tile
    if ok:
        assert R.choose("auto", None, ev(contract(**extra))).sparsity == 0.9
    else:
        with pytest.raises(CheckpointError, match=f"vsa_tile_size {tile:g} is not 64"):
            R.choose("auto", None, ev(contract(**extra)))


def test_vsa_backend_without_sparsity_is_refused_and_another_backend_is_dense():
    with pytest.raises(CheckpointError, match="without vsa_sparsity"):
        R.choose("auto", None, ev(contract(attention_backend="VIDEO_SPARSE_ATTN_H3")))
    key, sp, why = R._contract_candidate(contract(attention_backend="FLASH_ATTN"))
    assert key == "contract_dense" and sp is None and "FLASH_ATTN" in why


@pytest.mark.parametrize("extra,size_ok", [(0, True), (1, False)])
def test_provenance_size_bound_both_sides(tmp_path, extra, size_ok):
    body = json.dumps({"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2"})
    raw = (body + " " * (R.MAX_SIDECAR_BYTES - len(body) + extra)).encode()
    assert len(raw) == R.MAX_SIDECAR_BYTES + extra
    p = tmp_path / "provenance.json"
    p.write_bytes(raw)
    if size_ok:
        assert R.load_provenance(p) == {"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2"}
    else:
        with pytest.raises(CheckpointError, match="larger than 65536 bytes"):
            R.load_provenance(p)


def test_keep_percent_of_and_normalize_id_directly():
    assert R.keep_percent_of(0.8) == 20.0 and R.keep_percent_of(0.9) == 10.0 and R.keep_percent_of(0.0) == 100.0
    assert R.keep_percent_of(1 - 1e-12) == round(100.0 * 1e-12, 9)
    assert R.normalize_id("hf://FastVideo/FastH3@rev1") == "fastvideo/fasth3"
    assert R.normalize_id(" FastVideo/X ") == "fastvideo/x"
    assert R.normalize_id("HF://a/b") == "a/b"
    assert R.normalize_id("@rev") is None and R.normalize_id(3) is None and R.normalize_id("a\nb") is None
    assert R.normalize_id("x" * 200) == "x" * 200 and R.normalize_id("x" * 201) is None   # the 200-char bound
