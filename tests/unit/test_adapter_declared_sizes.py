"""Adapter files whose DECLARED sizes are absurd for the target are refused from the safetensors header, before a
byte of tensor data is read (issue 29: a 20 KB sparse file grew server memory by gigabytes; a consistent header
declaring 1.6e12 elements ended in an empty MemoryError).

Files here are written byte by byte (header + data) so the header can declare what a writer library never would;
the huge ones are sparse (``truncate``): their size on disk is a few KB.
"""
from __future__ import annotations

import json
import struct

import pytest
import torch

from ditkit.errors import AdapterError, CheckpointError
from ditkit.loaders import h3_adapters as h3
from ditkit.loaders import lokr_apply as lokr
from ditkit.loaders import safetensors_io as st


def _write(path, tensors: dict[str, tuple[str, list[int]]], data_len: int | None = None, sparse: bool = False):
    """A safetensors file declaring ``tensors`` ({key: (dtype, shape)}) laid out back to back; the data section is
    zeros (``sparse``: made by truncate, so a declared terabyte costs nothing on disk)."""
    obj, off = {}, 0
    for k, (dt, shape) in tensors.items():
        n = st.DTYPES[dt][1]
        for s in shape:
            n *= s
        obj[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(obj).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        if sparse:
            f.truncate(8 + len(text) + off)
        else:
            f.write(b"\0" * off)
    return path


def _no_reads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a tensor was read before its declared size was checked")

    monkeypatch.setattr(st.SafeFile, "get", boom)
    monkeypatch.setattr(st.SafeFile, "_read_rows_into", boom)


def test_terabyte_declared_by_a_sparse_file_is_refused_naming_the_key(tmp_path, monkeypatch):
    """1.6e12 bf16 elements, consistent with the (sparse) file size. Main read it: an empty MemoryError."""
    p = tmp_path / "huge.safetensors"
    try:
        _write(p, {"diffusion_model.blocks.0.attn.to_q.lora_A.weight": ("BF16", [1_600_000, 1_000_000])}, sparse=True)
    except OSError as e:  # a filesystem without sparse files this large
        pytest.skip(f"cannot make a 3.2 TB sparse file here: {e}")
    _no_reads(monkeypatch)
    with pytest.raises(AdapterError, match=r"MiB of memory is free.*key .diffusion_model.blocks.0.attn.to_q.lora_A.weight"):
        lokr.read_adapter_file(str(p), what="adapter")           # the call as main makes it: no bounds given
    with pytest.raises(AdapterError, match=r"MiB of memory is free"):
        h3.read_adapter_file(str(p))
    with pytest.raises(AdapterError, match=r"input .adapter_name..*lora_A.weight"):
        h3.read_adapter_file(str(p), None, input_name="adapter_name")


def test_rank_larger_than_any_dimension_of_the_model_is_refused_before_reading(tmp_path, monkeypatch):
    shapes = {"a.weight": (64, 8), "b.weight": (8, 64)}      # largest dimension 64, largest weight 512 elements
    p = _write(tmp_path / "rank.safetensors", {"a.lokr_w1": ("F16", [65, 1]), "a.lokr_w2": ("F16", [1, 8])})
    _no_reads(monkeypatch)
    with pytest.raises(AdapterError, match=r"input 'lokr_name'.*key 'a\.lokr_w1'.*dimension of 65.*\(64\)"):
        lokr.read_adapter_file(str(p), shapes=shapes, input_name="lokr_name")


def test_declared_bounds_are_exact_on_both_sides(tmp_path, monkeypatch):
    shapes = {"a.weight": (8, 64), "b.weight": (64, 8)}      # max dim 64, max numel 512
    ok = _write(tmp_path / "ok.safetensors", {"x": ("F32", [64, 8]), "y": ("BF16", [8, 64]), "z": ("F16", [64])})
    f = lokr.read_adapter_file(str(ok), shapes=shapes)       # exactly at both bounds: read
    assert {k: tuple(t.shape) for k, t in f.tensors.items()} == {"x": (64, 8), "y": (8, 64), "z": (64,)}
    _no_reads(monkeypatch)
    too_many = _write(tmp_path / "n.safetensors", {"x": ("F32", [9, 57])})   # 513 elements, dims within 64
    with pytest.raises(AdapterError, match=r"key 'x'.*513 elements.*\(512\)"):
        lokr.read_adapter_file(str(too_many), shapes=shapes)
    too_wide = _write(tmp_path / "d.safetensors", {"x": ("F64", [1, 65])})   # 65 elements, one dim over
    with pytest.raises(AdapterError, match=r"key 'x'.*dimension of 65"):
        lokr.read_adapter_file(str(too_wide), shapes=shapes)


def test_h3_reader_bounds_by_the_geometry_gates_included(tmp_path, monkeypatch):
    g = h3.Geometry({"diffusion_model.blocks.0.attn.qkv.weight": (96, 32)}, 1, 32, 32, False, {0: (128, 32)}, 1, 0)
    fits = _write(tmp_path / "gate.safetensors", {"k": ("F32", [128, 32])})    # as large as the gate: read
    assert tuple(h3.read_adapter_file(str(fits), g).tensors["k"].shape) == (128, 32)
    _no_reads(monkeypatch)
    over = _write(tmp_path / "over.safetensors", {"k": ("F32", [129, 32])})
    with pytest.raises(AdapterError, match=r"key 'k'.*dimension of 129.*\(128\)"):
        h3.read_adapter_file(str(over), g, input_name="adapter_name")


def test_memory_bound_is_exact(tmp_path):
    p = _write(tmp_path / "m.safetensors", {"x": ("F16", [16, 4])})   # 128 bytes of data
    hdr = st.read_header(p)
    st.check_declared_sizes(hdr, "f", expand=3.0, memory=384)           # 3 x 128 = 384: fits exactly
    with pytest.raises(CheckpointError, match=r"key 'x'.*nothing was read"):
        st.check_declared_sizes(hdr, "f", expand=3.0, memory=383)
    with pytest.raises(AdapterError):
        st.check_declared_sizes(hdr, "f", memory=127, error=AdapterError)
    st.check_declared_sizes(hdr, "f", memory=128)


def test_available_memory_is_a_positive_byte_count():
    m = st.available_memory()
    assert m is None or (isinstance(m, int) and m > 0)
    assert torch.empty(0).numel() == 0  # torch imported by the module under test, as in the loaders


def test_target_bounds_directly():
    """The largest dimension and the largest element count over the target's weights (both from one tensor or
    from two), None without shapes."""
    from ditkit.loaders.lokr_apply import target_bounds

    assert target_bounds(None) == (None, None) and target_bounds({}) == (None, None)
    assert target_bounds({"a": (3, 7), "b": (5, 5)}) == (7, 25)       # dim from a, count from b
    assert target_bounds({"a": (9,), "b": (2, 4, 4)}) == (9, 32)
    assert target_bounds({"s": ()}) == (None, 1)                       # a scalar: no dimension, one element
