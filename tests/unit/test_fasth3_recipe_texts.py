"""The exact texts a user reads from the FastH3 recipe decision (sampling/fasth3_recipe.py): the reasons, conflicts,
notes and "looked at" lists of decide(), the summary line choose() reports on the node, and its refusals. Written from
mutation testing's survivors (issue 29): each scenario pins every field, so a changed word, a dropped reason or a
reordered list fails. The texts were read and checked by hand against the module's rules (contract > model id >
file name; weaker disagreeing evidence is a conflict; gates against the identity are notes)."""
from __future__ import annotations

import pytest

from ditkit.errors import BackendError
from ditkit.sampling import fasth3 as sched
from ditkit.sampling import fasth3_recipe as R

V2 = {"schema_version": "fasth3-inference-contract-v1", "model_id": "FastVideo/FastVideo-FastH3-8-Step-V2",
      "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125], "num_inference_steps": 9,
      "transformer_forwards": 8, "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0, "guidance_scale": 1.0,
      "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8, "vsa_tile_size": 64, "task": "t2av"}
PREVIEW_LADDER_ONLY = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 749, 500, 250],
                       "num_inference_steps": 5, "transformer_forwards": 4}


def contract(obj):
    return sched.parse_contract(obj, "test contract", "x/fastvideo_inference.json")


def ev(gates=2, nonzero=True, **kw):
    return R.Evidence(num_blocks=2, gate_blocks=gates, gates_nonzero=(nonzero if gates else None), **kw)


V2_NO_VSA = {k: v for k, v in V2.items() if k not in ("attention_backend", "vsa_sparsity", "vsa_tile_size")}
LORA = "FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA"

V2_ID = "FastVideo/FastVideo-FastH3-8-Step-V2"
EVIDENCE = {
    "unidentified": lambda: ev(gates=0, file_name="model.safetensors"),
    "v2_without_gates": lambda: ev(gates=0, contract=contract(V2)),
    "v2_zero_gates": lambda: ev(nonzero=False, contract=contract(V2)),
    "v2_partial_gates_weaker_name": lambda: R.Evidence(num_blocks=4, gate_blocks=2, gates_nonzero=True,
                                                       contract=contract(V2),
                                                       file_name="fasth3_preview_vsa.safetensors"),
    "dense_id_with_gates": lambda: ev(
        metadata={"model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree"}),
    "as_strong_ids": lambda: ev(provenance={"model_id": "hf://" + V2_ID + "@main"},
                                metadata={"source": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree"}),
    "lora_with_gates": lambda: ev(metadata={"finetuned_model": LORA}),
    "lora_without_gates": lambda: ev(gates=0, metadata={"finetuned_model": LORA}),
    "ladder_with_gates": lambda: ev(contract=contract(PREVIEW_LADDER_ONLY)),
    "ladder_without_gates": lambda: ev(gates=0, contract=contract(PREVIEW_LADDER_ONLY)),
    "contract_without_vsa_fields": lambda: ev(contract=contract(V2_NO_VSA),
                                              file_name="fastvideo_fasth3_8step_v2_bf16.safetensors"),
    "contract_dense_backend": lambda: ev(contract=contract(dict(V2, attention_backend="FLASH_ATTN"))),
    "contract_own_sparsity": lambda: ev(contract=contract(dict(V2, vsa_sparsity=0.75)), metadata={"model_id": V2_ID}),
    "contract_without_tile": lambda: ev(contract=contract({k: v for k, v in V2.items() if k != "vsa_tile_size"})),
}

# (name, decide()'s fields, choose("auto") -> ("ok", summary, keep %, sparsity, label) or (error, text),
#  choose("fasth3_custom", 15.0) -> (summary, override))
CASES = (
    ('unidentified',
      {'recipe': None,
       'sparsity': None,
       'reasons': [],
       'conflicts': [],
       'notes': [],
       'looked_at': ['no fastvideo_inference.json',
                     'no provenance.json',
                     'no file metadata',
                     "file name 'model.safetensors' names no FastH3 release",
                     'no to_gate_compress']},
      ('BackendError',
       "recipe 'auto': the checkpoint does not say which VSA recipe it was trained with (no "
       "fastvideo_inference.json; no provenance.json; no file metadata; file name 'model.safetensors' names no "
       'FastH3 release; no to_gate_compress); choose the recipe explicitly (FastH3 Preview v1 keeps 10% of video '
       'tiles, FastH3 8-step V2 20%)'),
      ('recipe fasth3_custom (explicit); checkpoint: not identified (no fastvideo_inference.json; no '
       "provenance.json; no file metadata; file name 'model.safetensors' names no FastH3 release; no "
       'to_gate_compress)',
       None)),
     ('v2_without_gates',
      {'recipe': ('fasth3_8step_v2',
                  'FastH3 8-Step V2',
                  0.8,
                  'vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)'),
       'sparsity': 0.8,
       'reasons': ['fastvideo_inference.json vsa_sparsity 0.8, vsa_tile_size 64',
                   'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2'],
       'conflicts': [],
       'notes': ['FastH3 8-Step V2 was trained with to_gate_compress gates, but the model carries none: the '
                 'gate-compress branch is skipped (pure sparse), which is not the trained student'],
       'looked_at': ['no provenance.json', 'no file metadata', 'no to_gate_compress']},
      ('ok',
       'recipe auto -> FastH3 8-Step V2, sparsity 0.8 (keep 20%) by fastvideo_inference.json vsa_sparsity 0.8, '
       'vsa_tile_size 64; fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2; note: FastH3 '
       '8-Step V2 was trained with to_gate_compress gates, but the model carries none: the gate-compress branch is '
       'skipped (pure sparse), which is not the trained student',
       20.0,
       0.8,
       'FastH3 8-Step V2'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 8-Step V2, sparsity 0.8 (keep 20%) by '
       'fastvideo_inference.json vsa_sparsity 0.8, vsa_tile_size 64; fastvideo_inference.json model_id '
       'FastVideo/FastVideo-FastH3-8-Step-V2; OVERRIDE: the checkpoint states sparsity 0.8 (keep 20%, FastH3 '
       '8-Step V2); running keep 15% (sparsity 0.85) as chosen; note: FastH3 8-Step V2 was trained with '
       'to_gate_compress gates, but the model carries none: the gate-compress branch is skipped (pure sparse), '
       'which is not the trained student',
       'the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as '
       'chosen')),
     ('v2_zero_gates',
      {'recipe': ('fasth3_8step_v2',
                  'FastH3 8-Step V2',
                  0.8,
                  'vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)'),
       'sparsity': 0.8,
       'reasons': ['fastvideo_inference.json vsa_sparsity 0.8, vsa_tile_size 64',
                   'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2'],
       'conflicts': [],
       'notes': ['every to_gate_compress weight is zero: not a VSA-trained student (FastVideo refuses VSA on such '
                 'a model); the gate branch adds nothing'],
       'looked_at': ['no provenance.json', 'no file metadata', 'every to_gate_compress is zero (not VSA-trained)']},
      ('ok',
       'recipe auto -> FastH3 8-Step V2, sparsity 0.8 (keep 20%) by fastvideo_inference.json vsa_sparsity 0.8, '
       'vsa_tile_size 64; fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2; note: every '
       'to_gate_compress weight is zero: not a VSA-trained student (FastVideo refuses VSA on such a model); the '
       'gate branch adds nothing',
       20.0,
       0.8,
       'FastH3 8-Step V2'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 8-Step V2, sparsity 0.8 (keep 20%) by '
       'fastvideo_inference.json vsa_sparsity 0.8, vsa_tile_size 64; fastvideo_inference.json model_id '
       'FastVideo/FastVideo-FastH3-8-Step-V2; OVERRIDE: the checkpoint states sparsity 0.8 (keep 20%, FastH3 '
       '8-Step V2); running keep 15% (sparsity 0.85) as chosen; note: every to_gate_compress weight is zero: not a '
       'VSA-trained student (FastVideo refuses VSA on such a model); the gate branch adds nothing',
       'the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as '
       'chosen')),
     ('v2_partial_gates_weaker_name',
      {'recipe': ('fasth3_8step_v2',
                  'FastH3 8-Step V2',
                  0.8,
                  'vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)'),
       'sparsity': 0.8,
       'reasons': ['fastvideo_inference.json vsa_sparsity 0.8, vsa_tile_size 64',
                   'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2'],
       'conflicts': ["file name 'fasth3_preview_vsa.safetensors' says FastH3 Preview v1 (VSA) (weaker evidence, "
                     'not followed)'],
       'notes': ['to_gate_compress on 2 of 4 blocks only'],
       'looked_at': ['no provenance.json',
                     'no file metadata',
                     'trained to_gate_compress in 2/4 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 8-Step V2, sparsity 0.8 (keep 20%) by fastvideo_inference.json vsa_sparsity 0.8, '
       'vsa_tile_size 64; fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2; conflict: file '
       "name 'fasth3_preview_vsa.safetensors' says FastH3 Preview v1 (VSA) (weaker evidence, not followed); note: "
       'to_gate_compress on 2 of 4 blocks only',
       20.0,
       0.8,
       'FastH3 8-Step V2'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 8-Step V2, sparsity 0.8 (keep 20%) by '
       'fastvideo_inference.json vsa_sparsity 0.8, vsa_tile_size 64; fastvideo_inference.json model_id '
       'FastVideo/FastVideo-FastH3-8-Step-V2; OVERRIDE: the checkpoint states sparsity 0.8 (keep 20%, FastH3 '
       '8-Step V2); running keep 15% (sparsity 0.85) as chosen; conflict: file name '
       "'fasth3_preview_vsa.safetensors' says FastH3 Preview v1 (VSA) (weaker evidence, not followed); note: "
       'to_gate_compress on 2 of 4 blocks only',
       'the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as '
       'chosen')),
     ('dense_id_with_gates',
      {'recipe': ('fasth3_preview_dense',
                  'FastH3 Preview v1 (Dense-DataFree)',
                  None,
                  'FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree: distilled dense, no gates'),
       'sparsity': None,
       'reasons': ['file metadata model_id FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree'],
       'conflicts': [],
       'notes': ['the model carries trained to_gate_compress gates (2 blocks) although file metadata model_id '
                 'FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree says dense'],
       'looked_at': ['no fastvideo_inference.json',
                     'no provenance.json',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('BackendError',
       "recipe 'auto': the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, no VSA) by file "
       'metadata model_id FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree; VSA would run it off its '
       'training. To run sparse anyway choose a recipe explicitly (the report marks it as an override)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 Preview v1 (Dense-DataFree) (distilled dense, no VSA) '
       'by file metadata model_id FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree; OVERRIDE: the '
       'checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, by file metadata model_id '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree); running VSA at keep 15% as chosen; note: the '
       'model carries trained to_gate_compress gates (2 blocks) although file metadata model_id '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree says dense',
       'the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, by file metadata model_id '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree); running VSA at keep 15% as chosen')),
     ('as_strong_ids',
      {'recipe': ('fasth3_8step_v2',
                  'FastH3 8-Step V2',
                  0.8,
                  'vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)'),
       'sparsity': 0.8,
       'reasons': ['provenance.json model_id hf://FastVideo/FastVideo-FastH3-8-Step-V2@main'],
       'conflicts': ['file metadata source FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree says FastH3 '
                     'Preview v1 (VSA) (as strong; provenance.json model_id '
                     'hf://FastVideo/FastVideo-FastH3-8-Step-V2@main followed)'],
       'notes': [],
       'looked_at': ['no fastvideo_inference.json',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 8-Step V2, sparsity 0.8 (keep 20%) by provenance.json model_id '
       'hf://FastVideo/FastVideo-FastH3-8-Step-V2@main; conflict: file metadata source '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree says FastH3 Preview v1 (VSA) (as strong; '
       'provenance.json model_id hf://FastVideo/FastVideo-FastH3-8-Step-V2@main followed)',
       20.0,
       0.8,
       'FastH3 8-Step V2'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 8-Step V2, sparsity 0.8 (keep 20%) by provenance.json '
       'model_id hf://FastVideo/FastVideo-FastH3-8-Step-V2@main; OVERRIDE: the checkpoint states sparsity 0.8 '
       '(keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as chosen; conflict: file metadata source '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree says FastH3 Preview v1 (VSA) (as strong; '
       'provenance.json model_id hf://FastVideo/FastVideo-FastH3-8-Step-V2@main followed)',
       'the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as '
       'chosen')),
     ('lora_with_gates',
      {'recipe': ('fasth3_preview_vsa',
                  'FastH3 Preview v1 (VSA)',
                  0.9,
                  "FastVideo basic_fasth3.py --vsa-sparsity 0.9 (the checkpoint's trained policy), tile 64"),
       'sparsity': 0.9,
       'reasons': ['file metadata finetuned_model (the Preview LoRA: VSA when it carries gates) '
                   'FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA'],
       'conflicts': [],
       'notes': [],
       'looked_at': ['no fastvideo_inference.json',
                     'no provenance.json',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 Preview v1 (VSA), sparsity 0.9 (keep 10%) by file metadata finetuned_model (the '
       'Preview LoRA: VSA when it carries gates) FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA',
       10.0,
       0.9,
       'FastH3 Preview v1 (VSA)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 Preview v1 (VSA), sparsity 0.9 (keep 10%) by file '
       'metadata finetuned_model (the Preview LoRA: VSA when it carries gates) '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA; OVERRIDE: the checkpoint states sparsity 0.9 (keep 10%, '
       'FastH3 Preview v1 (VSA)); running keep 15% (sparsity 0.85) as chosen',
       'the checkpoint states sparsity 0.9 (keep 10%, FastH3 Preview v1 (VSA)); running keep 15% (sparsity 0.85) '
       'as chosen')),
     ('lora_without_gates',
      {'recipe': ('fasth3_preview_dense',
                  'FastH3 Preview v1 (Dense-DataFree)',
                  None,
                  'FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree: distilled dense, no gates'),
       'sparsity': None,
       'reasons': ['file metadata finetuned_model (the Preview LoRA: VSA when it carries gates) '
                   'FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA'],
       'conflicts': [],
       'notes': [],
       'looked_at': ['no fastvideo_inference.json', 'no provenance.json', 'no to_gate_compress']},
      ('BackendError',
       "recipe 'auto': the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, no VSA) by file "
       'metadata finetuned_model (the Preview LoRA: VSA when it carries gates) '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA; VSA would run it off its training. To run sparse anyway '
       'choose a recipe explicitly (the report marks it as an override)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 Preview v1 (Dense-DataFree) (distilled dense, no VSA) '
       'by file metadata finetuned_model (the Preview LoRA: VSA when it carries gates) '
       'FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA; OVERRIDE: the checkpoint is FastH3 Preview v1 '
       '(Dense-DataFree) (distilled dense, by file metadata finetuned_model (the Preview LoRA: VSA when it carries '
       'gates) FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA); running VSA at keep 15% as chosen',
       'the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, by file metadata finetuned_model '
       '(the Preview LoRA: VSA when it carries gates) FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA); running '
       'VSA at keep 15% as chosen')),
     ('ladder_with_gates',
      {'recipe': ('fasth3_preview_vsa',
                  'FastH3 Preview v1 (VSA)',
                  0.9,
                  "FastVideo basic_fasth3.py --vsa-sparsity 0.9 (the checkpoint's trained policy), tile 64"),
       'sparsity': 0.9,
       'reasons': ['fastvideo_inference.json Preview ladder [999, 749, 500, 250] + trained to_gate_compress'],
       'conflicts': [],
       'notes': [],
       'looked_at': ['no provenance.json',
                     'no file metadata',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 Preview v1 (VSA), sparsity 0.9 (keep 10%) by fastvideo_inference.json Preview ladder '
       '[999, 749, 500, 250] + trained to_gate_compress',
       10.0,
       0.9,
       'FastH3 Preview v1 (VSA)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 Preview v1 (VSA), sparsity 0.9 (keep 10%) by '
       'fastvideo_inference.json Preview ladder [999, 749, 500, 250] + trained to_gate_compress; OVERRIDE: the '
       'checkpoint states sparsity 0.9 (keep 10%, FastH3 Preview v1 (VSA)); running keep 15% (sparsity 0.85) as '
       'chosen',
       'the checkpoint states sparsity 0.9 (keep 10%, FastH3 Preview v1 (VSA)); running keep 15% (sparsity 0.85) '
       'as chosen')),
     ('ladder_without_gates',
      {'recipe': ('fasth3_preview_dense',
                  'FastH3 Preview v1 (Dense-DataFree)',
                  None,
                  'FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree: distilled dense, no gates'),
       'sparsity': None,
       'reasons': ['fastvideo_inference.json Preview ladder [999, 749, 500, 250] + no trained to_gate_compress'],
       'conflicts': [],
       'notes': [],
       'looked_at': ['no provenance.json', 'no file metadata', 'no to_gate_compress']},
      ('BackendError',
       "recipe 'auto': the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, no VSA) by "
       'fastvideo_inference.json Preview ladder [999, 749, 500, 250] + no trained to_gate_compress; VSA would run '
       'it off its training. To run sparse anyway choose a recipe explicitly (the report marks it as an override)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 Preview v1 (Dense-DataFree) (distilled dense, no VSA) '
       'by fastvideo_inference.json Preview ladder [999, 749, 500, 250] + no trained to_gate_compress; OVERRIDE: '
       'the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, by fastvideo_inference.json Preview '
       'ladder [999, 749, 500, 250] + no trained to_gate_compress); running VSA at keep 15% as chosen',
       'the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, by fastvideo_inference.json Preview '
       'ladder [999, 749, 500, 250] + no trained to_gate_compress); running VSA at keep 15% as chosen')),
     ('contract_without_vsa_fields',
      {'recipe': ('fasth3_8step_v2',
                  'FastH3 8-Step V2',
                  0.8,
                  'vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)'),
       'sparsity': 0.8,
       'reasons': ['fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2',
                   "file name 'fastvideo_fasth3_8step_v2_bf16.safetensors'"],
       'conflicts': [],
       'notes': [],
       'looked_at': ['fastvideo_inference.json states no VSA fields',
                     'no provenance.json',
                     'no file metadata',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 8-Step V2, sparsity 0.8 (keep 20%) by fastvideo_inference.json model_id '
       "FastVideo/FastVideo-FastH3-8-Step-V2; file name 'fastvideo_fasth3_8step_v2_bf16.safetensors'",
       20.0,
       0.8,
       'FastH3 8-Step V2'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 8-Step V2, sparsity 0.8 (keep 20%) by '
       'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2; file name '
       "'fastvideo_fasth3_8step_v2_bf16.safetensors'; OVERRIDE: the checkpoint states sparsity 0.8 (keep 20%, "
       'FastH3 8-Step V2); running keep 15% (sparsity 0.85) as chosen',
       'the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as '
       'chosen')),
     ('contract_dense_backend',
      {'recipe': ('contract_dense',
                  'FastH3 (dense, per fastvideo_inference.json)',
                  None,
                  "FastH3 contract 'x/fastvideo_inference.json'"),
       'sparsity': None,
       'reasons': ['fastvideo_inference.json attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the student '
                   'runs dense attention'],
       'conflicts': ['fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 '
                     '(weaker evidence, not followed)'],
       'notes': ['the model carries trained to_gate_compress gates (2 blocks) although fastvideo_inference.json '
                 'attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the student runs dense attention says '
                 'dense'],
       'looked_at': ['no provenance.json',
                     'no file metadata',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('BackendError',
       "recipe 'auto': the checkpoint is FastH3 (dense, per fastvideo_inference.json) (distilled dense, no VSA) by "
       'fastvideo_inference.json attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the student runs dense '
       'attention; VSA would run it off its training. To run sparse anyway choose a recipe explicitly (the report '
       'marks it as an override)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 (dense, per fastvideo_inference.json) (distilled '
       'dense, no VSA) by fastvideo_inference.json attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the '
       'student runs dense attention; OVERRIDE: the checkpoint is FastH3 (dense, per fastvideo_inference.json) '
       '(distilled dense, by fastvideo_inference.json attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the '
       'student runs dense attention); running VSA at keep 15% as chosen; conflict: fastvideo_inference.json '
       'model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 (weaker evidence, not followed); note: '
       'the model carries trained to_gate_compress gates (2 blocks) although fastvideo_inference.json '
       'attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the student runs dense attention says dense',
       'the checkpoint is FastH3 (dense, per fastvideo_inference.json) (distilled dense, by '
       'fastvideo_inference.json attention_backend FLASH_ATTN (not VIDEO_SPARSE_ATTN_H3): the student runs dense '
       'attention); running VSA at keep 15% as chosen')),
     ('contract_own_sparsity',
      {'recipe': ('contract',
                  'FastH3 (fastvideo_inference.json)',
                  0.75,
                  "FastH3 contract 'x/fastvideo_inference.json'"),
       'sparsity': 0.75,
       'reasons': ['fastvideo_inference.json vsa_sparsity 0.75, vsa_tile_size 64'],
       'conflicts': ['fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 '
                     '(weaker evidence, not followed)',
                     'file metadata model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 (weaker '
                     'evidence, not followed)'],
       'notes': [],
       'looked_at': ['no provenance.json',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 (fastvideo_inference.json), sparsity 0.75 (keep 25%) by fastvideo_inference.json '
       'vsa_sparsity 0.75, vsa_tile_size 64; conflict: fastvideo_inference.json model_id '
       'FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 (weaker evidence, not followed); conflict: file '
       'metadata model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 (weaker evidence, not '
       'followed)',
       25.0,
       0.75,
       'FastH3 (fastvideo_inference.json)'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 (fastvideo_inference.json), sparsity 0.75 (keep 25%) '
       'by fastvideo_inference.json vsa_sparsity 0.75, vsa_tile_size 64; OVERRIDE: the checkpoint states sparsity '
       '0.75 (keep 25%, FastH3 (fastvideo_inference.json)); running keep 15% (sparsity 0.85) as chosen; conflict: '
       'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 8-Step V2 (weaker '
       'evidence, not followed); conflict: file metadata model_id FastVideo/FastVideo-FastH3-8-Step-V2 says FastH3 '
       '8-Step V2 (weaker evidence, not followed)',
       'the checkpoint states sparsity 0.75 (keep 25%, FastH3 (fastvideo_inference.json)); running keep 15% '
       '(sparsity 0.85) as chosen')),
     ('contract_without_tile',
      {'recipe': ('fasth3_8step_v2',
                  'FastH3 8-Step V2',
                  0.8,
                  'vllm-omni fasth3_checkpoint.py FastH3CheckpointSpec (vsa_sparsity 0.8, vsa_tile_size 64)'),
       'sparsity': 0.8,
       'reasons': ['fastvideo_inference.json vsa_sparsity 0.8',
                   'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2'],
       'conflicts': [],
       'notes': [],
       'looked_at': ['no provenance.json',
                     'no file metadata',
                     'trained to_gate_compress in 2/2 blocks (FastH3 VSA, version not stated)']},
      ('ok',
       'recipe auto -> FastH3 8-Step V2, sparsity 0.8 (keep 20%) by fastvideo_inference.json vsa_sparsity 0.8; '
       'fastvideo_inference.json model_id FastVideo/FastVideo-FastH3-8-Step-V2',
       20.0,
       0.8,
       'FastH3 8-Step V2'),
      ('recipe fasth3_custom (explicit); checkpoint: FastH3 8-Step V2, sparsity 0.8 (keep 20%) by '
       'fastvideo_inference.json vsa_sparsity 0.8; fastvideo_inference.json model_id '
       'FastVideo/FastVideo-FastH3-8-Step-V2; OVERRIDE: the checkpoint states sparsity 0.8 (keep 20%, FastH3 '
       '8-Step V2); running keep 15% (sparsity 0.85) as chosen',
       'the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep 15% (sparsity 0.85) as '
       'chosen')),
)


@pytest.mark.parametrize("name, want, auto, explicit", CASES, ids=[c[0] for c in CASES])
def test_decide_and_choose_texts(name, want, auto, explicit):
    e = EVIDENCE[name]()
    d = R.decide(e)
    got = {"recipe": d.recipe and (d.recipe.key, d.recipe.label, d.recipe.sparsity, d.recipe.source),
           "sparsity": d.sparsity, "reasons": d.reasons, "conflicts": d.conflicts, "notes": d.notes,
           "looked_at": d.looked_at}
    assert got == want
    if auto[0] == "ok":
        rc = R.choose("auto", None, e)
        assert (rc.mode, rc.summary(), rc.keep_percent, rc.sparsity, rc.label, rc.override) == (
            "auto",) + auto[1:] + (None,)
    else:
        with pytest.raises(BackendError) as ei:
            R.choose("auto", None, e)
        assert str(ei.value) == auto[1]
    rc = R.choose("fasth3_custom", 15.0, e)
    assert (rc.mode, rc.keep_percent, rc.sparsity, rc.label) == ("explicit", 15.0, 0.85, "fasth3_custom")
    assert (rc.summary(), rc.override) == explicit


def test_auto_refusal_names_the_node_input():
    with pytest.raises(BackendError) as ei:
        R.choose("auto", None, ev(gates=0), where="DitKitSparseAttention recipe")
    assert str(ei.value).startswith("DitKitSparseAttention recipe 'auto': the checkpoint does not say ")
    with pytest.raises(BackendError) as ei:
        R.choose("auto", None, ev(contract=contract(PREVIEW_LADDER_ONLY), gates=0), where="node recipe")
    assert str(ei.value).startswith("node recipe 'auto': the checkpoint is FastH3 Preview v1 (Dense-DataFree) ")


@pytest.mark.parametrize("keep, override", [(20.0, False), (20.0000001, False), (19.9999999, False),
                                             (20.0000002, True), (19.9999998, True)])
def test_explicit_override_at_the_1e9_sparsity_tolerance_both_sides(keep, override):
    rc = R.choose("fasth3_custom", keep, ev(contract=contract(V2)))
    assert (rc.override is not None) is override
    if override:
        assert rc.override == ("the checkpoint states sparsity 0.8 (keep 20%, FastH3 8-Step V2); running keep "
                               f"{keep:g}% (sparsity {(100 - keep) / 100:g}) as chosen")


def test_load_provenance_refusal_texts_name_the_file(tmp_path):
    from ditkit.errors import CheckpointError

    p = tmp_path / "provenance.json"
    p.write_text('{"model_id": 1,}')
    with pytest.raises(CheckpointError) as ei:
        R.load_provenance(p)
    assert str(ei.value) == (f"'{p}': invalid JSON in the FastVideo provenance.json (Expecting property name "
                             "enclosed in double quotes: line 1 column 16 (char 15))")
    p.write_text("[1]")
    with pytest.raises(CheckpointError) as ei:
        R.load_provenance(p)
    assert str(ei.value) == f"'{p}': must hold a JSON object"
    p.write_bytes(b'{"model_id": "\xff"}')
    with pytest.raises(CheckpointError) as ei:
        R.load_provenance(p)
    assert str(ei.value) == f"'{p}': not UTF-8 text"


def test_dense_override_lists_every_reason():
    dense_id = "FastVideo/FastVideo-FastH3-4-step-Preview-v1-Dense-DataFree"
    rc = R.choose("fasth3_custom", 15.0, ev(gates=0, metadata={"model_id": dense_id},
                                            file_name="fasth3_preview_dense.safetensors"))
    assert rc.override == ("the checkpoint is FastH3 Preview v1 (Dense-DataFree) (distilled dense, by file metadata "
                           f"model_id {dense_id}; file name 'fasth3_preview_dense.safetensors'); running VSA at keep "
                           "15% as chosen")
