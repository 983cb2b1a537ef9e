"""The safe safetensors reader: every malformed header is rejected with a message naming the file, valid files
read exactly what the reference ``safetensors`` library reads, and tensors are read lazily.

Files are written byte by byte here (header JSON + data), independent of the code under test; the reference
library (``safetensors.torch``) is the oracle for valid files and for which malformed files must be refused.
"""
from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch

from ditkit.errors import CheckpointError
from ditkit.loaders import safetensors_io as sio

st = pytest.importorskip("safetensors.torch")


def raw_file(path, header, data=b"", *, header_text=None, pad=0, n_override=None):
    """Write ``<u64 n><header json><data>`` exactly as given."""
    text = header_text if header_text is not None else json.dumps(header)
    hb = text.encode("utf-8") if isinstance(text, str) else text
    hb += b" " * pad
    n = len(hb) if n_override is None else n_override
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


def f32(*vals):
    return struct.pack(f"<{len(vals)}f", *vals)


def ent(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


def reference_rejects(path) -> bool:
    try:
        st.load_file(str(path))
    except Exception:  # noqa: BLE001 - any refusal by the reference library
        return True
    return False


def assert_rejected(path, *needles, reference=True):
    with pytest.raises(CheckpointError) as ei:
        sio.read_header(path)
    msg = str(ei.value)
    assert str(path) in msg, f"message does not name the file: {msg}"
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    if reference:
        assert reference_rejects(path), "the reference library accepts this file; the test premise is wrong"
    return msg


# ------------------------------------------------------------------------------------------- valid files

def test_reads_what_the_reference_wrote(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.f32": torch.randn(3, 5, generator=g),
        "w.f16": torch.randn(7, generator=g).half(),
        "w.bf16": torch.randn(2, 2, 2, generator=g).bfloat16(),
        "w.f64": torch.randn(4, generator=g).double(),
        "i.i64": torch.arange(-5, 5),
        "i.i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i.i16": torch.tensor([-3, 7], dtype=torch.int16),
        "i.i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u.u8": torch.tensor([0, 255], dtype=torch.uint8),
        "b.bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["f8"] = torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn)
    p = tmp_path / "ok.safetensors"
    st.save_file(tensors, str(p), metadata={"format": "pt", "x": "y"})
    ref = st.load_file(str(p))
    got, meta = sio.load_with_metadata(p)
    assert meta == {"format": "pt", "x": "y"}
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8) if v.dtype.is_floating_point and v.element_size() == 1
                           else got[k], v.view(torch.uint8) if v.dtype.is_floating_point and v.element_size() == 1
                           else v), k
    h = sio.read_header(p)
    assert h.tensors["w.f32"].shape == (3, 5) and h.tensors["w.f32"].nbytes == 60
    assert h.tensors["scalar"].shape == () and h.tensors["scalar"].numel == 1


def test_hand_written_file_with_padding_and_subset(tmp_path):
    hdr = {"__metadata__": {"a": "b"}, "x": ent("F32", [2], 0, 8), "y": ent("F32", [1], 8, 12)}
    p = raw_file(tmp_path / "pad.safetensors", hdr, f32(1.0, 2.0) + f32(-3.0), pad=5)
    assert sio.load_file(p, keys=["y"]) == {"y": torch.tensor([-3.0])} or \
        torch.equal(sio.load_file(p, keys=["y"])["y"], torch.tensor([-3.0]))
    out = sio.load_file(p)
    assert torch.equal(out["x"], torch.tensor([1.0, 2.0]))
    assert sio.read_header(p).metadata == {"a": "b"}
    assert not reference_rejects(p)


def test_null_metadata_is_empty(tmp_path):
    p = raw_file(tmp_path / "m.safetensors", {"__metadata__": None, "x": ent("F32", [1], 0, 4)}, f32(1.0))
    assert sio.read_header(p).metadata == {}
    assert not reference_rejects(p)


def test_save_file_roundtrip_is_deterministic(tmp_path):
    t = {"b": torch.ones(3), "a": torch.arange(4, dtype=torch.int32)}
    sio.save_file(t, tmp_path / "1.safetensors", metadata={"k": "v"})
    sio.save_file(dict(reversed(list(t.items()))), tmp_path / "2.safetensors", metadata={"k": "v"})
    assert (tmp_path / "1.safetensors").read_bytes() == (tmp_path / "2.safetensors").read_bytes()
    back, meta = sio.load_with_metadata(tmp_path / "1.safetensors")
    assert meta == {"k": "v"} and torch.equal(back["b"], t["b"]) and torch.equal(back["a"], t["a"])


# -------------------------------------------------------------------------------------- malformed files

def test_file_too_short(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    assert_rejected(p, "too short")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    assert_rejected(p, "truncated")


@pytest.mark.parametrize("n", [0, sio.MAX_HEADER_BYTES + 1, 2**63])
def test_header_length_out_of_range(tmp_path, n):
    p = raw_file(tmp_path / "n.safetensors", {}, b"", n_override=n)
    assert_rejected(p, "header length")


def test_header_longer_than_file(tmp_path):
    p = raw_file(tmp_path / "t.safetensors", {"x": ent("F32", [1], 0, 4)}, b"", n_override=1000)
    assert_rejected(p, "exceeds the file size", "truncated")


def test_truncated_data(tmp_path):
    p = raw_file(tmp_path / "trunc.safetensors", {"x": ent("F32", [4], 0, 16)}, f32(1.0, 2.0))
    assert_rejected(p, "'x'", "truncated")


def test_truncated_real_file(tmp_path):
    full = tmp_path / "full.safetensors"
    st.save_file({"a": torch.ones(64), "b": torch.zeros(64)}, str(full))
    data = full.read_bytes()
    p = tmp_path / "half.safetensors"
    p.write_bytes(data[: len(data) - 100])
    assert_rejected(p, "truncated")


def test_not_utf8(tmp_path):
    p = raw_file(tmp_path / "u.safetensors", None, b"", header_text=b"\xff\xfe{}  ")
    assert_rejected(p, "UTF-8")


@pytest.mark.parametrize("text", ["{", "{'a': 1}", "[1, 2]", "\"str\"", "{\"a\": }", "42"])
def test_bad_json_or_not_an_object(tmp_path, text):
    p = raw_file(tmp_path / "j.safetensors", None, b"", header_text=text)
    assert_rejected(p)


def test_duplicate_tensor_names(tmp_path):
    text = ('{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    p = raw_file(tmp_path / "dup.safetensors", None, f32(1.0, 2.0), header_text=text)
    # the reference keeps the last duplicate silently; ditkit refuses
    assert_rejected(p, "duplicate JSON key", "'x'", reference=False)


def test_duplicate_keys_inside_an_entry(tmp_path):
    text = '{"x": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}'
    p = raw_file(tmp_path / "dup2.safetensors", None, f32(1.0), header_text=text)
    assert_rejected(p, "duplicate JSON key", "'dtype'", reference=False)


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_constants(tmp_path, const):
    text = '{"__metadata__": {"a": "b"}, "x": {"dtype": "F32", "shape": [%s], "data_offsets": [0, 4]}}' % const
    p = raw_file(tmp_path / "nan.safetensors", None, f32(1.0), header_text=text)
    assert_rejected(p, "non-finite", const.lstrip("-"))


def test_overlapping_offsets(tmp_path):
    hdr = {"a": ent("F32", [2], 0, 8), "b": ent("F32", [2], 4, 12)}
    p = raw_file(tmp_path / "ov.safetensors", hdr, f32(1, 2, 3))
    assert_rejected(p, "overlap", "'a'", "'b'")


def test_aliased_tensors_same_offsets(tmp_path):
    hdr = {"a": ent("F32", [2], 0, 8), "b": ent("F32", [2], 0, 8)}
    p = raw_file(tmp_path / "alias.safetensors", hdr, f32(1, 2))
    assert_rejected(p, "overlap")


@pytest.mark.parametrize("entry, needle", [
    (ent("F33", [1], 0, 4), "unknown dtype"),
    ({"shape": [1], "data_offsets": [0, 4]}, "unknown dtype"),
    (ent("F32", [-1], 0, 4), "invalid shape"),
    (ent("F32", [1.0], 0, 4), "invalid shape"),
    (ent("F32", [True], 0, 4), "invalid shape"),
    (ent("F32", "1", 0, 4), "invalid shape"),
    (ent("F32", [1] * 9, 0, 4), "invalid shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "invalid data_offsets"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, "invalid data_offsets"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}, "invalid data_offsets"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}, "invalid data_offsets"),
    (ent("F32", [1], 4, 0), "not ordered"),
    (ent("F32", [1], -4, 0), "not ordered"),
    (ent("F32", [2], 0, 4), "do not match"),
    (ent("F16", [1], 0, 4), "do not match"),
    ([1, 2], "not an object"),
])
def test_bad_tensor_entries(tmp_path, entry, needle):
    p = raw_file(tmp_path / "e.safetensors", {"x": entry}, f32(1.0))
    rank9 = isinstance(entry, dict) and entry.get("shape") == [1] * 9  # the reference allows any rank
    assert_rejected(p, needle, "'x'", reference=not rank9)


@pytest.mark.parametrize("meta", [{"a": 1}, {"a": None}, {"a": ["b"]}, {"a": {"b": "c"}}, ["a", "b"], "a", 5, [],
                                  "", 0, False])
def test_metadata_must_map_str_to_str(tmp_path, meta):
    p = raw_file(tmp_path / "meta.safetensors", {"__metadata__": meta, "x": ent("F32", [1], 0, 4)}, f32(1.0))
    assert_rejected(p, "__metadata__")


def test_metadata_value_too_long(tmp_path):
    p = raw_file(tmp_path / "long.safetensors",
                 {"__metadata__": {"big": "x" * (sio.MAX_METADATA_VALUE + 1)}, "x": ent("F32", [1], 0, 4)}, f32(1.0))
    assert_rejected(p, "'big'", "limit", reference=False)


def test_trailing_bytes_after_the_last_tensor(tmp_path):
    """The data section must be fully covered (as in the reference): no hidden trailing payload."""
    p = raw_file(tmp_path / "trail.safetensors", {"x": ent("F32", [1], 0, 4)}, f32(1.0) + b"HIDDEN!!")
    assert_rejected(p, "not covered")


def test_hole_between_tensors(tmp_path):
    hdr = {"a": ent("F32", [1], 0, 4), "b": ent("F32", [1], 8, 12)}
    p = raw_file(tmp_path / "hole.safetensors", hdr, f32(1.0) + b"HOLE" + f32(2.0))
    assert_rejected(p, "not covered")


def test_hole_at_the_start(tmp_path):
    p = raw_file(tmp_path / "hole0.safetensors", {"a": ent("F32", [1], 4, 8)}, b"JUNK" + f32(1.0))
    assert_rejected(p, "not covered")


def test_empty_tensor_between_others_is_fine(tmp_path):
    hdr = {"a": ent("F32", [1], 0, 4), "z": ent("F32", [0], 4, 4), "b": ent("F32", [1], 4, 8)}
    p = raw_file(tmp_path / "z.safetensors", hdr, f32(1.0, 2.0))
    out = sio.load_file(p)
    assert out["z"].shape == (0,) and torch.equal(out["b"], torch.tensor([2.0]))
    assert not reference_rejects(p)


def test_header_only_file_without_tensors(tmp_path):
    p = raw_file(tmp_path / "none.safetensors", {"__metadata__": {"a": "b"}})
    assert sio.read_header(p).tensors == {}
    assert sio.load_file(p) == {}


def test_differential_against_reference_on_mutations(tmp_path):
    """Random single-byte corruptions of a valid header: whenever the reference refuses, ditkit refuses too."""
    good = tmp_path / "good.safetensors"
    st.save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int16)},
                 str(good), metadata={"k": "v"})
    data = bytearray(good.read_bytes())
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    g = torch.Generator().manual_seed(1)
    disagreements = []
    for i in range(200):
        mut = bytearray(data)
        pos = 8 + int(torch.randint(0, n, (1,), generator=g))
        mut[pos] = int(torch.randint(32, 127, (1,), generator=g))
        p = tmp_path / f"mut{i}.safetensors"
        p.write_bytes(bytes(mut))
        ref_bad = reference_rejects(p)
        try:
            sio.read_header(p)
            ours_bad = False
        except CheckpointError:
            ours_bad = True
        if ref_bad and not ours_bad:
            disagreements.append((pos, chr(mut[pos]), mut[8:8 + n].decode("utf-8", "replace")))
    assert not disagreements, disagreements[:3]


# --------------------------------------------------------------------------------------------- reading

class CountingFile:
    def __init__(self, fh):
        self.fh, self.reads = fh, []

    def seek(self, *a):
        return self.fh.seek(*a)

    def read(self, n=-1):
        b = self.fh.read(n)
        self.reads.append(len(b))
        return b

    def readinto(self, view):
        n = self.fh.readinto(view)
        self.reads.append(n)
        return n

    def close(self):
        self.fh.close()


def test_get_reads_only_the_requested_tensor(tmp_path):
    p = tmp_path / "lazy.safetensors"
    st.save_file({"small": torch.ones(3), "big": torch.zeros(100_000)}, str(p))
    with sio.SafeFile(p) as f:
        f._fh = CountingFile(f._fh)
        t = f.get("small")
        assert torch.equal(t, torch.ones(3))
        assert f._fh.reads == [12], f._fh.reads  # 3 x f32, nothing of 'big'
        assert f.info("big").nbytes == 400_000


def test_get_without_context_manager_and_items(tmp_path):
    p = tmp_path / "noctx.safetensors"
    st.save_file({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3], dtype=torch.int64)}, str(p))
    f = sio.SafeFile(p)
    assert torch.equal(f.get("a"), torch.tensor([1.0, 2.0]))
    assert dict(f.items()).keys() == {"a", "b"}
    assert sorted(f.keys()) == ["a", "b"]


def test_unknown_tensor_name(tmp_path):
    p = tmp_path / "k.safetensors"
    st.save_file({"a": torch.ones(1)}, str(p))
    with sio.SafeFile(p) as f, pytest.raises(CheckpointError, match=r"no tensor named 'nope'"):
        f.get("nope")
    with pytest.raises(CheckpointError, match=str(p).replace("\\", "\\\\")):
        sio.load_file(p, keys=["nope"])


def test_file_truncated_after_header_was_validated(tmp_path):
    p = tmp_path / "shrink.safetensors"
    st.save_file({"a": torch.ones(1000)}, str(p))
    f = sio.SafeFile(p)
    with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) - 100)
    with pytest.raises(CheckpointError, match="short read"):
        f.get("a")


def test_returned_tensors_are_writable_and_independent(tmp_path):
    p = tmp_path / "w.safetensors"
    st.save_file({"a": torch.zeros(4)}, str(p))
    a1 = sio.load_file(p)["a"]
    a1 += 1
    assert torch.equal(sio.load_file(p)["a"], torch.zeros(4))


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        sio.read_header(tmp_path / "does_not_exist.safetensors")


# ----------------------------------------------------------------------------------------- strict json

def test_strict_json_loads():
    assert sio.strict_json_loads('{"a": [1, 2.5, "x"]}', "w", what="safetensors header") == {"a": [1, 2.5, "x"]}
    with pytest.raises(CheckpointError, match="w: duplicate JSON key 'a'"):
        sio.strict_json_loads('{"a": 1, "a": 2}', "w", what="safetensors header")
    with pytest.raises(CheckpointError, match="non-finite"):
        sio.strict_json_loads('[NaN]', "w", what="safetensors header")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        sio.strict_json_loads('{"a": 1', "w", what="safetensors header")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        sio.strict_json_loads("[" * 100_000 + "]" * 100_000, "w", what="safetensors header")
    assert math.isfinite(sio.strict_json_loads("1e308", "w", what="safetensors header"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8])
def test_map_views_equal_the_reference_reader_and_are_copy_on_write(tmp_path, dtype):
    """``SafeFile.map`` + ``view``: the tensors the reference library reads, no copy, writes stay private."""
    p = tmp_path / "m.safetensors"
    sd = {"a": (torch.arange(24, dtype=torch.float64) - 7.5).to(dtype).reshape(4, 6), "empty": torch.zeros(0, 3,
          dtype=dtype), "b": torch.full((3,), 5, dtype=dtype)}
    st.save_file(sd, str(p))
    ref = st.load_file(str(p))
    before = p.read_bytes()
    with sio.SafeFile(p) as f:
        mm = f.map()
        got = {k: f.view(mm, k) for k in sd}
    for k in sd:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)), k
    got["a"].view(torch.uint8).reshape(-1)[0] ^= 0xFF          # private: the file is untouched
    assert p.read_bytes() == before


def test_map_refuses_a_file_whose_size_changed(tmp_path):
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(8)}, str(p))
    f = sio.SafeFile(p)
    try:
        with open(p, "ab") as g:
            g.write(b"\0" * 8)
        with pytest.raises(CheckpointError, match="changed since its header was validated"):
            f.map()
    finally:
        f.close()


def test_stat_is_the_validated_handle_not_the_name(tmp_path):
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(8)}, str(p))
    f = sio.SafeFile(p)
    try:
        s0 = os.stat(p)
        got = f.stat()
        assert (got.st_dev, got.st_ino, got.st_size) == (s0.st_dev, s0.st_ino, s0.st_size)
        os.rename(p, tmp_path / "moved.safetensors")          # another file under the name: still the opened one
        st.save_file({"a": torch.ones(4)}, str(p))
        assert f.stat().st_ino == s0.st_ino
    finally:
        f.close()
    g = sio.SafeFile(tmp_path / "moved.safetensors")
    g.close()
    assert g.stat().st_ino == s0.st_ino                        # closed: reopened and checked to be the same file
    os.unlink(tmp_path / "moved.safetensors")
    st.save_file({"a": torch.ones(2)}, str(tmp_path / "moved.safetensors"))
    with pytest.raises(CheckpointError, match="changed since its header was validated"):
        g.stat()
