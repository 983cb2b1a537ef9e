"""``loaders/h3_adapters.partition_note``: which partition (FL2VA / Ref2VA) an adapter names by its file name or
metadata, reported as not verified (the two partitions have the same keys and shapes, h3.md §2.1 / §9)."""
from __future__ import annotations

import pytest

from ditkit.loaders.h3_adapters import partition_note


@pytest.mark.parametrize("source,meta,part", [
    ("minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16.safetensors", None, "fl2va"),
    ("loras/sub dir/MINIMAX_H3_FL2VA_style.safetensors", {}, "fl2va"),         # case, folder, path
    ("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", {}, "ref2va"),
    ("x-ref2va.safetensors", {}, "ref2va"),
    ("lora.safetensors", {"base_model": "minimax_h3_ref2va_int8_convrot"}, "ref2va"),
    ("lora.safetensors", {"finetuned_model": "FL2VA"}, "fl2va"),
    ("fl2va_and_ref2va.safetensors", {}, "both"),
    ("lora_fl2v.safetensors", {"base_model": "ref2va"}, "both"),
    # not tokens: letters or digits glued on either side, or fields other than the listed ones
    ("myfl2va.safetensors", {}, "unknown"),
    ("fl2vax.safetensors", {}, "unknown"),
    ("ref2va2.safetensors", {}, "unknown"),
    ("lora.safetensors", {"ss_training_comment": "fl2va"}, "unknown"),
    ("lora.safetensors", None, "unknown"),
])
def test_partition_named_by_the_adapter(source, meta, part):
    got, line = partition_note(source, meta)
    assert got == part
    assert line.startswith("partition: not verified.")
    assert ("names no partition" in line) == (part == "unknown")


def test_metadata_value_is_bounded():
    """A token past the first 4096 characters of a metadata value is not read (a training log in a field)."""
    assert partition_note("a.safetensors", {"base_model": "x" * 4089 + "_ref2va"})[0] == "ref2va"   # 4096 chars
    assert partition_note("a.safetensors", {"base_model": "x" * 4091 + "_ref2va"})[0] == "unknown"  # "_ref2" read
