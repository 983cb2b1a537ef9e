"""The VSA recipe a FastH3 checkpoint identifies (sampling/fasth3_recipe.py): inputs are contracts, metadata, key
sets and file names written here; the expected sparsities are the releases' own numbers (V2 0.8: vllm-omni
FastH3CheckpointSpec; Preview VSA 0.9: FastVideo basic_fasth3.py), not read from the code under test."""
from __future__ import annotations

import json
import math

import pytest

from ditkit.errors import BackendError, CheckpointError
from ditkit.sampling import fasth3 as sched
from ditkit.sampling import fasth3_recipe as R

V2_SPARSITY, PREVIEW_SPARSITY = 0.8, 0.9          # the releases' numbers (see module docstring)
V2 = {"schema_version": "fasth3-inference-contract-v1", "model_id": "FastVideo/FastVideo-FastH3-8-Step-V2",
      "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125], "num_inference_steps": 9,
      "transformer_forwards": 8, "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0, "guidance_scale": 1.0,
      "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8, "vsa_tile_size": 64, "task": "t2av"}
PREVIEW_VSA = {"schema_version": "fasth3-inference-contract-v1",
               "model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree",
               "dmd_denoising_steps": [999, 749, 500, 250], "num_inference_steps": 5, "transformer_forwards": 4,
               "guidance_scale": 1.0, "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_tile_size": 64,
               "vsa_sparsity": 0.9, "task": "t2av"}
PREVIEW_LADDER_ONLY = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 749, 500, 250],
                       "num_inference_steps": 5, "transformer_forwards": 4}


def contract(obj):
    return sched.parse_contract(obj, "test contract", "x/fastvideo_inference.json")


def ev(gates=2, nonzero=True, **kw):
    return R.Evidence(num_blocks=2, gate_blocks=gates, gates_nonzero=(nonzero if gates else None), **kw)


def compute_topk(sparsity, n):      # FastVideo video_sparse_attn.py compute_topk, written out
    return max(1, min(math.ceil((1 - sparsity) * n), n))


def test_v2_contract_picks_sparsity_08_and_says_why():
    rc = R.choose("auto", None, ev(contract=contract(V2)))
    assert rc.sparsity == V2_SPARSITY and rc.keep_percent == 20.0 and rc.mode == "auto"
    assert rc.decision.recipe.key == "fasth3_8step_v2"
    s = rc.summary()
    assert "fastvideo_inference.json vsa_sparsity 0.8" in s and "FastH3 8-Step V2" in s
    assert "model_id FastVideo/FastVideo-FastH3-8-Step-V2" in s     # the contract's id agrees, listed as a reason
    assert rc.override is None and not rc.decision.conflicts and not rc.decision.notes
    # the tile count that runs is FastVideo's for the contract's sparsity
    for n in (1, 7, 10, 24, 120, 4913):
        assert compute_topk(rc.sparsity, n) == compute_topk(V2_SPARSITY, n)


def test_preview_vsa_contract_picks_09():
    rc = R.choose("auto", None, ev(contract=contract(PREVIEW_VSA)))
    assert rc.sparsity == PREVIEW_SPARSITY and rc.keep_percent == 10.0
    assert rc.decision.recipe.key == "fasth3_preview_vsa"


def test_ladder_only_preview_contract_uses_the_gates():
    assert R.choose("auto", None, ev(contract=contract(PREVIEW_LADDER_ONLY))).sparsity == PREVIEW_SPARSITY
    with pytest.raises(BackendError, match="distilled dense"):
        R.choose("auto", None, ev(gates=0, contract=contract(PREVIEW_LADDER_ONLY)))


@pytest.mark.parametrize("meta,expected", [
    ({"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2"}, V2_SPARSITY),
    ({"source": "hf://FastVideo/FastVideo-FastH3-8-Step-V2@0123abc"}, V2_SPARSITY),
    ({"finetuned_model": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree"}, PREVIEW_SPARSITY),
    ({"model_id": "fastvideo/fastvideo-minimax-fasth3-preview-v0.1"}, PREVIEW_SPARSITY),
])
def test_file_metadata_identifies(meta, expected):
    rc = R.choose("auto", None, ev(metadata=meta))
    assert rc.sparsity == expected
    assert "file metadata" in rc.summary()


def test_provenance_identifies_and_base_model_alone_does_not():
    rc = R.choose("auto", None, ev(provenance={"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2"}))
    assert rc.sparsity == V2_SPARSITY and "provenance.json model_id" in rc.summary()
    with pytest.raises(BackendError, match="does not say which VSA recipe"):
        R.choose("auto", None, ev(provenance={"base_model": "hf://MiniMaxAI/MiniMax-H3@abc"}))


def test_comfy_file_name_identifies_weakly():
    rc = R.choose("auto", None, ev(file_name="fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors"))
    assert rc.sparsity == V2_SPARSITY and "file name" in rc.summary()
    assert R.choose("auto", None, ev(file_name="FastVideo-FastH3-8-Step-V2")).sparsity == V2_SPARSITY


def test_trained_gates_alone_or_nothing_is_refused_with_what_was_looked_at():
    with pytest.raises(BackendError) as e:
        R.choose("auto", None, ev(file_name="h3_tiny_fasth3.safetensors"))
    msg = str(e.value)
    assert "trained to_gate_compress in 2/2 blocks" in msg and "no fastvideo_inference.json" in msg
    assert "choose the recipe explicitly" in msg
    with pytest.raises(BackendError, match="no to_gate_compress"):
        R.choose("auto", None, ev(gates=0))


def test_explicit_choice_contradicting_the_checkpoint_runs_and_is_reported():
    rc = R.choose("FastH3 Preview v1 (keep 10%)", 10.0, ev(contract=contract(V2)))
    assert rc.sparsity == (100 - 10) / 100 and rc.keep_percent == 10.0       # what the user chose runs
    assert rc.override and "states sparsity 0.8" in rc.override and "running keep 10%" in rc.override
    assert "OVERRIDE" in rc.summary()
    agree = R.choose("FastH3 8-step V2 (keep 20%)", 20.0, ev(contract=contract(V2)))
    assert agree.override is None and agree.sparsity == V2_SPARSITY
    unknown = R.choose("custom", 25.0, ev(gates=0))
    assert unknown.override is None and "not identified" in unknown.summary()


def test_dense_checkpoint_auto_refused_explicit_reported():
    dense = dict(PREVIEW_LADDER_ONLY, attention_backend="FLASH_ATTN")
    with pytest.raises(BackendError, match="off its training"):
        R.choose("auto", None, ev(gates=0, contract=contract(dense)))
    rc = R.choose("custom", 25.0, ev(gates=0, contract=contract(dense)))
    assert rc.override and "distilled dense" in rc.override
    d = R.decide(ev(gates=0, metadata={"model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree"}))
    assert d.dense and d.recipe.key == "fasth3_preview_dense"


def test_preview_lora_id_is_vsa_only_with_gates():
    meta = {"model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA"}
    assert R.decide(ev(metadata=meta)).sparsity == PREVIEW_SPARSITY
    assert R.decide(ev(gates=0, metadata=meta)).dense


def test_stronger_evidence_wins_and_the_conflict_is_reported():
    d = R.decide(ev(contract=contract(V2), file_name="fasth3_preview_vsa.safetensors"))
    assert d.sparsity == V2_SPARSITY
    assert len(d.conflicts) == 1 and "file name" in d.conflicts[0] and "not followed" in d.conflicts[0]
    # a contract that states its own sparsity is followed over a release id that says otherwise
    odd = dict(V2, vsa_sparsity=0.85)
    d = R.decide(ev(contract=contract(odd)))
    assert d.sparsity == 0.85 and d.recipe.key == "contract" and any("8-Step V2" in c for c in d.conflicts)


def test_gate_notes():
    n = R.decide(ev(gates=0, contract=contract(V2))).notes
    assert n and "carries none" in n[0]
    n = R.decide(ev(nonzero=False, contract=contract(V2))).notes
    assert n and "zero" in n[0]
    n = R.decide(R.Evidence(num_blocks=4, gate_blocks=2, gates_nonzero=True, contract=contract(V2))).notes
    assert n and "2 of 4" in n[0]


@pytest.mark.parametrize("patch,match", [
    ({"vsa_tile_size": 128}, "vsa_tile_size 128"),
    ({"vsa_sparsity": 1.0}, r"outside \[0, 1\)"),
    ({"vsa_sparsity": None}, "without vsa_sparsity"),
])
def test_bad_contract_vsa_fields_are_refused(patch, match):
    obj = {k: v for k, v in dict(V2, **patch).items() if v is not None}
    with pytest.raises(CheckpointError, match=match):
        R.decide(ev(contract=contract(obj)))


def test_load_provenance(tmp_path):
    p = tmp_path / "provenance.json"
    p.write_text(json.dumps({"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2", "base_model": "hf://x/y@1",
                             "other": "ignored", "long": "a" * 500}))
    assert R.load_provenance(p) == {"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2", "base_model": "hf://x/y@1"}
    p.write_text('{"model_id": "a", "model_id": "b"}')
    with pytest.raises(CheckpointError, match="duplicate"):
        R.load_provenance(p)
    p.write_text("[1]")
    with pytest.raises(CheckpointError, match="JSON object"):
        R.load_provenance(p)
    p.write_bytes(b"{" + b" " * (R.MAX_SIDECAR_BYTES + 1) + b"}")
    with pytest.raises(CheckpointError, match="larger than"):
        R.load_provenance(p)
    p.write_bytes(b'{"model_id": "\xff"}')
    with pytest.raises(CheckpointError, match="UTF-8"):
        R.load_provenance(p)


def test_safe_metadata_keeps_identity_keys_only():
    assert R.safe_metadata({"model_id": "FastVideo/X", "format": "pt", "source": "a\nb"}) == {"model_id": "FastVideo/X"}
    assert R.safe_metadata(None) == {}
