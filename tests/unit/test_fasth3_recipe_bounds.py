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
    assert R.normalize_id("FastVideo/X@rev@more") == "fastvideo/x"      # the first '@' ends the id
    assert R.normalize_id("@rev") is None and R.normalize_id(3) is None and R.normalize_id("a\nb") is None
    assert R.normalize_id("x" * 200) == "x" * 200 and R.normalize_id("x" * 201) is None   # the 200-char bound


def test_contract_candidate_keys_reasons_and_where():
    vsa = {"attention_backend": "VIDEO_SPARSE_ATTN_H3"}
    # the preview ladder names the preview recipe only at its own sparsity 0.9; any other is "contract"
    assert R._contract_candidate(contract(**vsa, vsa_sparsity=0.9))[0] == "fasth3_preview_vsa"
    assert R._contract_candidate(contract(**vsa, vsa_sparsity=0.5))[0] == "contract"
    key, sp, why = R._contract_candidate(contract(**vsa, vsa_sparsity=0.5, vsa_tile_size=64))
    assert why == "fastvideo_inference.json vsa_sparsity 0.5, vsa_tile_size 64"
    assert R._contract_candidate(contract(**vsa, vsa_sparsity=0.5))[2] == "fastvideo_inference.json vsa_sparsity 0.5"
    assert R._contract_candidate(contract()) is None
    key, sp, why = R._contract_candidate(contract(attention_backend="FLASH_ATTN"))
    assert why.endswith("(not VIDEO_SPARSE_ATTN_H3): the student runs dense attention")
    c = contract(**vsa)
    with pytest.raises(CheckpointError) as ei:
        R._contract_candidate(c)
    assert str(ei.value) == (f"{c.where}: attention_backend VIDEO_SPARSE_ATTN_H3 without vsa_sparsity; the contract "
                             "does not say which sparsity the student was trained at")
    c = contract(**vsa, vsa_sparsity=1.0)
    with pytest.raises(CheckpointError, match="^" + c.where.replace("(", r"\(").replace(")", r"\)")):
        R._contract_candidate(c)


def test_keep_percent_of_keeps_nine_decimals_as_a_float():
    assert R.keep_percent_of(0.875) == 12.5 and isinstance(R.keep_percent_of(0.8), float)
    assert R.keep_percent_of(1 - 1.5e-9) == round(100.0 * 1.5e-9, 9) != 0.0          # 9 decimals kept: 1.5e-7
    assert R.keep_percent_of(1 - 1e-12) == 0.0                                        # the 10th is dropped


def test_load_provenance_messages_and_filter(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(CheckpointError) as ei:
        R.load_provenance(d)
    assert str(ei.value) == (f"FastVideo provenance.json '{d}': not a regular file (a directory, FIFO or device "
                             "is refused)")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"^'{bad}'"):
        R.load_provenance(bad)
    mixed = tmp_path / "p.json"
    mixed.write_text(json.dumps({"model_id": 3, "base_model": "FastVideo/X", "other": "y"}))
    assert R.load_provenance(mixed) == {"base_model": "FastVideo/X"}
    mixed.write_text(json.dumps({"model_id": "bad\\nid", "base_model": ["x"]}))
    assert R.load_provenance(mixed) == {}


def test_load_provenance_reads_at_most_the_bound(tmp_path, monkeypatch):
    """The sidecar is opened once and checked on the descriptor: a file over 64 KiB is refused from its size, before
    any byte is read; one at the bound is read with reads that never ask for more than the bound."""
    from ditkit.loaders import safe_fs

    sizes = []
    real = safe_fs.read_fd
    monkeypatch.setattr(safe_fs, "read_fd", lambda fd, limit: sizes.append(limit) or real(fd, limit))
    p = tmp_path / "p.json"
    p.write_bytes(b" " * (R.MAX_SIDECAR_BYTES + 1))
    with pytest.raises(CheckpointError, match=f"{R.MAX_SIDECAR_BYTES + 1} bytes, larger than 65536 bytes"):
        R.load_provenance(p)
    assert sizes == []
    p.write_bytes(b"{}" + b" " * (R.MAX_SIDECAR_BYTES - 2))
    assert R.load_provenance(p) == {}
    assert sizes == [R.MAX_SIDECAR_BYTES]


def test_decision_describe_and_choice_summary_exactly():
    vsa = R.VSARecipe("k", "Label", 0.8, "src")
    dense = R.VSARecipe("d", "Dense", None, "src")
    assert R.Decision(None, None, looked_at=["a", "b"]).describe() == "not identified (a; b)"
    d = R.Decision(vsa, 0.8, reasons=["r1", "r2"], conflicts=["c1", "c2"], notes=["n1", "n2"])
    assert d.describe() == "Label, sparsity 0.8 (keep 20%) by r1; r2"
    assert R.Decision(dense, None, reasons=["r"]).describe() == "Dense (distilled dense, no VSA) by r"
    auto = R.RecipeChoice(mode="auto", keep_percent=20.0, sparsity=0.8, label="Label", decision=d)
    assert auto.summary() == ("recipe auto -> Label, sparsity 0.8 (keep 20%) by r1; r2; conflict: c1; conflict: c2; "
                              "note: n1; note: n2")
    ex = R.RecipeChoice(mode="explicit", keep_percent=10.0, sparsity=0.9, label="Mine", decision=d, override="o")
    assert ex.summary() == ("recipe Mine (explicit); checkpoint: Label, sparsity 0.8 (keep 20%) by r1; r2; "
                            "OVERRIDE: o; conflict: c1; conflict: c2; note: n1; note: n2")
