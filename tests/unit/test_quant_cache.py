"""The write-once quantized cache (loaders/quant_cache.py, issue #34) without ComfyUI: miss -> written, hit ->
the same tensors without quantizing, a changed source -> another key (the old file left, reported stale), a
tampered / foreign / symlinked cache file refused by name, a failed write reported and leaving nothing.

Oracle: the state dict the streaming quantizer produces for the same source (bit for bit), and the bytes of the
written file re-hashed here with hashlib."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time

import pytest
import torch

from ditkit.loaders import quant_cache as C
from ditkit.loaders import quantize as QC
from ditkit.loaders.safetensors_io import read_header, save_file
from ditkit.tiny import ckpt_h3

FMT = "nvfp4"


@pytest.fixture()
def source(tmp_path):
    """A single-file H3 (ComfyUI layout) in its own models folder."""
    folder = tmp_path / "models"
    folder.mkdir()
    save_file(ckpt_h3.base_state_dict(), folder / "h3.safetensors")
    return folder / "h3.safetensors"


def _load(path, fmt=FMT, calls=None):
    src = QC.open_source(str(path))
    plan = QC.make_plan(src.family, fmt, src.inventory, src.prefix)

    def run():
        if calls is not None:
            calls.append(1)
        rep = QC.QuantReport(src.family, fmt, QC.RECIPES[src.family]["source"])
        return dict(QC.quantize_stream(src.reader(), plan, rep, str(path))), rep

    return C.cached_quantize(str(path), src.files, src.family, fmt, QC.RECIPES[src.family], run,
                             plan.output_inventory())


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def _cache_files(folder):
    return sorted(p.name for p in folder.iterdir() if ".ditkit-" in p.name)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"])
def test_miss_writes_then_hit_reads_the_same_bits_without_quantizing(source, fmt):
    calls = []
    sd1, rep1 = _load(source, fmt, calls)
    assert rep1.cache["state"] == "written" and calls == [1]
    files = _cache_files(source.parent)
    assert len(files) == 1 and files[0].startswith(f"h3.ditkit-{fmt}-")
    assert rep1.cache["file"] == str(source.parent / files[0])
    sd2, rep2 = _load(source, fmt, calls)
    assert calls == [1], "a hit must not quantize"
    assert rep2.cache["state"] == "hit" and rep2.cache["file"] == rep1.cache["file"]
    _same(sd1, sd2)
    assert {c: s.as_dict() for c, s in rep2.classes.items()} == {c: s.as_dict() for c, s in rep1.classes.items()}
    assert "cache hit" in rep2.summary()


def _oracle_digest(raw: bytes, header_len: int, digest_begin: int, chunk: int) -> bytes:
    """The version-2 digest from its definition (docs/quantize.md): SHA-256 of the tag, the header's SHA-256 and
    the SHA-256 of every ``chunk``-byte piece of the tensor bytes before the digest, written here with hashlib."""
    header = raw[: 8 + header_len]
    body = raw[8 + header_len: 8 + header_len + digest_begin]
    parts = hashlib.sha256(header).digest() + b"".join(hashlib.sha256(body[i:i + chunk]).digest()
                                                       for i in range(0, len(body), chunk))
    return hashlib.sha256(b"ditkit-quant-cache-digest-2\n" + parts).digest()


@pytest.mark.parametrize("chunk", [None, 4096, 4097, 1 << 16])
def test_written_file_digest_is_the_chunked_sha256_of_everything_before_it(source, monkeypatch, chunk):
    if chunk is not None:            # several chunks, cut inside tensors, odd sizes: writer and reader still agree
        monkeypatch.setattr(C, "DIGEST_CHUNK", chunk)
    _, rep = _load(source)
    path = rep.cache["file"]
    hdr = read_header(path)
    raw = open(path, "rb").read()
    digest = hdr.tensors[C.DIGEST_KEY]
    want = _oracle_digest(raw, hdr.header_len, digest.begin, C.DIGEST_CHUNK)
    assert raw[8 + hdr.header_len + digest.begin:] == want
    assert want != hashlib.sha256(raw[: 8 + hdr.header_len + digest.begin]).digest()
    sd, rep2 = _load(source)                                              # and the reader accepts it
    assert rep2.cache["state"] == "hit"
    assert max(ti.end for ti in hdr.tensors.values()) == digest.end        # the digest is the last tensor
    assert "_quantization_metadata" in hdr.metadata and C.META_KEY in hdr.metadata


def test_changed_source_is_a_miss_and_the_stale_file_is_left(source):
    _, rep1 = _load(source)
    old = rep1.cache["file"]
    before = open(old, "rb").read()
    sd = ckpt_h3.base_state_dict()
    k = next(k for k in sd if k.startswith("final_layer") and k.endswith("weight"))
    sd[k] = sd[k] * 2
    save_file(sd, source)                                             # same size, new bytes and mtime
    calls = []
    _, rep2 = _load(source, calls=calls)
    assert calls == [1] and rep2.cache["state"] == "written" and rep2.cache["file"] != old
    assert rep2.cache["stale"] == [os.path.basename(old)]
    assert "stale caches of this source left in place" in rep2.summary()
    assert open(old, "rb").read() == before
    assert len(_cache_files(source.parent)) == 2


def test_key_sees_mtime_and_sampled_bytes_and_documents_what_it_misses(source):
    key0, _ = C.source_key([str(source)], "h3", FMT, QC.RECIPES["h3"])
    st = os.stat(source)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1))          # only the mtime
    key1, _ = C.source_key([str(source)], "h3", FMT, QC.RECIPES["h3"])
    assert key1 != key0
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert C.source_key([str(source)], "h3", FMT, QC.RECIPES["h3"])[0] == key0
    hdr = read_header(source)
    data = os.path.getsize(source) - 8 - hdr.header_len
    with open(source, "r+b") as f:                                    # a byte inside the first sample, mtime kept
        f.seek(8 + hdr.header_len + 5)
        b = f.read(1)
        f.seek(8 + hdr.header_len + 5)
        f.write(bytes([b[0] ^ 1]))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert C.source_key([str(source)], "h3", FMT, QC.RECIPES["h3"])[0] != key0
    if data > C.SAMPLES * C.SAMPLE_BYTES:                             # a byte between samples: not seen (documented)
        with open(source, "r+b") as f:
            f.seek(8 + hdr.header_len + 5)
            f.write(b)
            f.seek(8 + hdr.header_len + C.SAMPLE_BYTES + 1)
            f.write(b"\x00")
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    for other in ("mxfp8",):
        assert C.source_key([str(source)], "h3", other, QC.RECIPES["h3"])[0] != \
            C.source_key([str(source)], "h3", FMT, QC.RECIPES["h3"])[0]
    assert C.source_key([str(source)], "ltx2", FMT, QC.RECIPES["ltx2"])[0] != \
        C.source_key([str(source)], "h3", FMT, QC.RECIPES["h3"])[0]


def _tamper_at(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["first tensor", "middle tensor", "digest"])
def test_tampered_cache_file_is_refused_by_name(source, where):
    _, rep = _load(source)
    path = rep.cache["file"]
    hdr = read_header(path)
    order = sorted(hdr.tensors.values(), key=lambda ti: ti.begin)
    ti = {"first tensor": order[0], "middle tensor": order[len(order) // 2], "digest": order[-1]}[where]
    _tamper_at(path, 8 + hdr.header_len + ti.begin + (ti.end - ti.begin) // 2)
    calls = []
    with pytest.raises(C.QuantCacheError, match=r"do not match the digest stored in it.*Remove it") as e:
        _load(source, calls=calls)
    assert path in str(e.value) and calls == []


def test_cache_for_another_key_or_format_under_the_name_is_refused(source):
    _, rep = _load(source)
    path = rep.cache["file"]
    hdr = read_header(path)
    raw = open(path, "rb").read()
    head = raw[8: 8 + hdr.header_len].decode()
    key = hdr.metadata[C.META_KEY]
    i = head.index('\\"key\\": \\"') + len('\\"key\\": \\"')
    forged = head[:i] + ("0" if head[i] != "0" else "1") + head[i + 1:]
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(forged.encode())
    assert read_header(path).metadata[C.META_KEY] != key
    with pytest.raises(C.QuantCacheError, match="its key is .* expected"):
        _load(source)


def test_a_symlink_under_the_cache_name_is_refused_not_followed(source, tmp_path):
    _, rep = _load(source)
    path = rep.cache["file"]
    target = tmp_path / "elsewhere.safetensors"
    shutil.move(path, target)
    os.symlink(target, path)
    with pytest.raises(C.QuantCacheError, match="not a regular file"):
        _load(source)


def test_a_file_without_the_cache_record_is_refused(source):
    _, rep = _load(source)
    path = rep.cache["file"]
    os.unlink(path)
    save_file({"a": torch.zeros(3)}, path)
    with pytest.raises(C.QuantCacheError, match="not a ditkit cache file"):
        _load(source)


def test_a_failed_write_is_reported_and_leaves_nothing(source, monkeypatch):
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(C, "write", boom)
    sd, rep = _load(source)
    assert rep.cache["state"] == "not written" and "No space left" in rep.cache["why"]
    assert "cache not written" in rep.summary()
    assert _cache_files(source.parent) == []
    assert sd                                                         # the load itself stands


def test_a_write_that_fails_midway_leaves_no_file(source, monkeypatch):
    real = C.stream_chunks

    def failing(*a, **k):
        for i, c in enumerate(real(*a, **k)):
            if i == 3:
                raise OSError(28, "No space left on device")
            yield c

    monkeypatch.setattr(C, "stream_chunks", failing)
    _, rep = _load(source)
    assert rep.cache["state"] == "not written"
    assert os.listdir(source.parent) == ["h3.safetensors"]


def test_cache_location_is_next_to_the_source(tmp_path):
    d = tmp_path / "H3" / "transformer"
    d.mkdir(parents=True)
    assert C.cache_location(str(d), "mxfp8", "ab" * 32) == (str(d), "transformer.ditkit-mxfp8-abababababababab.safetensors")
    f = tmp_path / "m.v2.safetensors"
    f.write_bytes(b"")
    assert C.cache_location(str(f), "nvfp4", "0f" * 32) == (str(tmp_path), "m.v2.ditkit-nvfp4-0f0f0f0f0f0f0f0f.safetensors")


def test_official_shard_folder_cache_is_written_inside_the_folder(tmp_path):
    ckpt_h3.gen_h3_dit_official(tmp_path)
    folder = tmp_path / ckpt_h3.OFFICIAL_DIR
    calls = []
    sd1, rep1 = _load(folder, "float8_e4m3fn", calls)
    assert os.path.dirname(rep1.cache["file"]) == str(folder.resolve())
    sd2, rep2 = _load(folder, "float8_e4m3fn", calls)
    assert calls == [1] and rep2.cache["state"] == "hit"
    _same(sd1, sd2)


@pytest.mark.parametrize("at", ["first byte", "chunk edge - 1", "chunk edge", "last data byte"])
def test_one_changed_byte_in_any_chunk_is_refused(source, monkeypatch, at):
    """With 4 KiB chunks the tensor bytes span many chunks: a byte changed at a chunk's edge (both sides) or in the
    last, partial chunk changes the digest."""
    monkeypatch.setattr(C, "DIGEST_CHUNK", 4096)
    _, rep = _load(source)
    path = rep.cache["file"]
    hdr = read_header(path)
    dig = hdr.tensors[C.DIGEST_KEY]
    data0 = 8 + hdr.header_len
    assert dig.begin > 3 * 4096 and dig.begin % 4096 != 0
    off = {"first byte": 0, "chunk edge - 1": 4095, "chunk edge": 4096, "last data byte": dig.begin - 1}[at]
    _tamper_at(path, data0 + off)
    with pytest.raises(C.QuantCacheError, match="do not match the digest"):
        _load(source)


def test_hit_tensors_are_copy_on_write_views_of_the_file(source):
    """The hit hands out views of a private map: writing into one never reaches the cache file."""
    _load(source)
    sd, rep = _load(source)
    path = rep.cache["file"]
    before = open(path, "rb").read()
    t = next(v for v in sd.values() if v.numel() > 16)
    t.view(torch.uint8).reshape(-1)[:8] ^= 0xFF
    assert open(path, "rb").read() == before
    _, rep3 = _load(source)
    assert rep3.cache["state"] == "hit"


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_digest_streaming_equals_parallel_and_serial(monkeypatch, n):
    monkeypatch.setattr(C, "DIGEST_CHUNK", 4096)
    data = bytes((i * 7919 + 13) % 256 for i in range(n))
    header = b"\x10" + bytes(15)
    want = hashlib.sha256(b"ditkit-quant-cache-digest-2\n" + hashlib.sha256(header).digest() + b"".join(
        hashlib.sha256(data[i:i + 4096]).digest() for i in range(0, n, 4096))).digest()
    d = C.Digest(header)
    for a, b in ((0, n // 3), (n // 3, n // 3 + 1), (n // 3 + 1, n)):     # uneven updates across chunk edges
        d.update(data[a:b])
    assert d.digest() == want
    seen = []
    assert C.digest_of(header, data, workers=1, progress=seen.append) == want
    assert C.digest_of(header, data, workers=4) == want
    assert seen == [min(n, i + 4096) for i in range(0, n, 4096)]
    if n:
        flipped = bytearray(data)
        flipped[-1] ^= 1
        assert C.digest_of(header, bytes(flipped), workers=2) != want


def test_hash_workers_bounds(monkeypatch):
    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert C.hash_workers() == 8
    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert C.hash_workers() == 1

    def boom(pid):
        raise OSError("no affinity")

    monkeypatch.setattr(C.os, "sched_getaffinity", boom, raising=False)
    monkeypatch.setattr(C.os, "cpu_count", lambda: None)
    assert C.hash_workers() == 1


# ------------------------------------------------------------------------------------------- verification stamp

def _aged(monkeypatch, by=10.0):
    """The clock ``by`` seconds ahead: the cache file counts as changed long ago (the stamp's age rule)."""
    real = C.time.time
    monkeypatch.setattr(C.time, "time", lambda: real() + by)


def _no_hash(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("hashed")
    monkeypatch.setattr(C, "digest_of", boom)


def _stamp_path(rep):
    return rep.cache["file"] + C.STAMP_SUFFIX


def test_stamp_skips_the_hash_of_an_unchanged_file_with_the_same_bits(source, monkeypatch):
    _aged(monkeypatch)
    sd0, rep0 = _load(source)
    assert rep0.cache["state"] == "written" and not os.path.exists(_stamp_path(rep0))
    sd1, rep1 = _load(source)
    assert (rep1.cache["verified"], rep1.cache["stamp"]) == ("digest", "written")
    st = os.stat(rep1.cache["file"])
    rec = json.loads(open(_stamp_path(rep1), "rb").read())
    assert rec == {C.STAMP_KEY: 1, "file": os.path.basename(rep1.cache["file"]), "digest": rec["digest"],
                   "identity": [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]}
    hdr = read_header(rep1.cache["file"])
    with open(rep1.cache["file"], "rb") as f:
        f.seek(8 + hdr.header_len + hdr.tensors[C.DIGEST_KEY].begin)
        assert rec["digest"] == f.read(32).hex()
    _no_hash(monkeypatch)
    calls = []
    sd2, rep2 = _load(source, calls=calls)
    assert (rep2.cache["verified"], rep2.cache["stamp"]) == ("stamp", "kept") and calls == []
    assert "unchanged since its full verification" in rep2.summary()
    _same(sd2, sd0)


@pytest.mark.parametrize("change", ["one byte", "touch", "chmod", "renamed over"])
def test_any_change_after_the_stamp_is_hashed_again(source, monkeypatch, change):
    """Every change sets ctime: the stamp no longer matches, the file is hashed (a changed byte is refused; a
    touch / chmod leaves the bytes, which verify, and a new stamp replaces ditkit's old one)."""
    _aged(monkeypatch)
    _load(source)
    _, rep = _load(source)
    path = rep.cache["file"]
    assert rep.cache["stamp"] == "written"
    time.sleep(0.05)                                   # past the file system's clock tick
    if change == "one byte":
        hdr = read_header(path)
        _tamper_at(path, 8 + hdr.header_len + 5)
    elif change == "touch":
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))     # mtime put back: ctime still moves
    elif change == "chmod":
        os.chmod(path, 0o644 if os.stat(path).st_mode & 0o777 != 0o644 else 0o640)
    else:
        shutil.copyfile(path, path + ".x")
        os.replace(path + ".x", path)
    hashed = []
    real = C.digest_of
    monkeypatch.setattr(C, "digest_of", lambda *a, **k: (hashed.append(1), real(*a, **k))[1])
    if change == "one byte":
        with pytest.raises(C.QuantCacheError, match="do not match the digest"):
            _load(source)
        assert hashed == [1]
        return
    _, rep2 = _load(source)
    assert hashed == [1] and (rep2.cache["verified"], rep2.cache["stamp"]) == ("digest", "written")
    _no_hash(monkeypatch)
    _, rep3 = _load(source)
    assert rep3.cache["verified"] == "stamp"


@pytest.mark.parametrize("age, written", [(C.STAMP_MIN_AGE_S, True), (C.STAMP_MIN_AGE_S - 0.001, False)])
def test_stamp_age_rule_boundary(source, monkeypatch, age, written):
    _load(source)
    path = next(p for p in (str(source.parent / n) for n in os.listdir(source.parent)) if ".ditkit-" in p)
    ctime = os.stat(path).st_ctime
    monkeypatch.setattr(C.time, "time", lambda: ctime + age)
    _, rep = _load(source)
    assert rep.cache["verified"] == "digest"
    if written:
        assert rep.cache["stamp"] == "written" and os.path.exists(_stamp_path(rep))
    else:
        assert rep.cache["stamp"].startswith("not written (changed less than 2 s ago)")
        assert not os.path.exists(_stamp_path(rep))


def test_a_just_written_file_is_not_stamped(source):
    _load(source)
    _, rep = _load(source)
    assert rep.cache["verified"] == "digest" and rep.cache["stamp"].startswith("not written (changed less")


@pytest.mark.parametrize("bad", ["garbage", "other name", "wrong digest", "wrong identity", "float identity",
                                 "symlink"])
def test_a_stamp_that_does_not_match_is_not_trusted(source, monkeypatch, tmp_path, bad):
    _aged(monkeypatch)
    _load(source)
    _, rep = _load(source)
    path, sp = rep.cache["file"], _stamp_path(rep)
    rec = json.loads(open(sp, "rb").read())
    os.unlink(sp)
    if bad == "garbage":
        open(sp, "wb").write(b"{not json")
    elif bad == "symlink":
        (tmp_path / "elsewhere.json").write_text(json.dumps(rec))
        os.symlink(tmp_path / "elsewhere.json", sp)
    else:
        if bad == "other name":
            rec["file"] = "x.safetensors"
        elif bad == "wrong digest":
            rec["digest"] = "00" * 32
        elif bad == "wrong identity":
            rec["identity"][2] += 1
        else:
            rec["identity"][0] = float(rec["identity"][0])
        open(sp, "w").write(json.dumps(rec))
    assert C.read_stamp(path) is None or bad == "wrong digest" or bad == "wrong identity"
    hashed = []
    real = C.digest_of
    monkeypatch.setattr(C, "digest_of", lambda *a, **k: (hashed.append(1), real(*a, **k))[1])
    _, rep2 = _load(source)
    assert hashed == [1] and rep2.cache["verified"] == "digest"
    if bad in ("garbage", "other name", "symlink"):          # not ditkit's stamp for this name: never replaced
        assert rep2.cache["stamp"].startswith("not written")
    else:
        assert rep2.cache["stamp"] == "written"


def test_no_stamps_where_ctime_is_not_the_change_time(source, monkeypatch):
    _aged(monkeypatch)
    monkeypatch.setattr(C, "stamps_supported", lambda: False)
    _load(source)
    _load(source)
    _, rep = _load(source)
    assert (rep.cache["verified"], rep.cache["stamp"]) == ("digest", "not supported on this system")
    assert not os.path.exists(_stamp_path(rep))


def test_stamps_supported_on_posix_only(monkeypatch):
    monkeypatch.setattr(C.os, "name", "posix")
    assert C.stamps_supported() is True
    monkeypatch.setattr(C.os, "name", "nt")
    assert C.stamps_supported() is False


def test_a_file_changed_while_hashed_is_not_stamped(source, monkeypatch):
    _aged(monkeypatch)
    _load(source)
    real = C.digest_of
    holder = {}

    def change(*a, **k):
        time.sleep(0.05)
        p = holder["path"]
        os.chmod(p, os.stat(p).st_mode ^ 0o020)
        return real(*a, **k)

    holder["path"] = next(str(source.parent / n) for n in os.listdir(source.parent) if ".ditkit-" in n)
    monkeypatch.setattr(C, "digest_of", change)
    _, rep = _load(source)
    assert rep.cache["stamp"] == "not written (the file changed while it was hashed)"


def test_stamp_helpers_directly(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    st = os.stat(p)
    assert C.file_identity(st) == [st.st_dev, st.st_ino, 3, st.st_mtime_ns, st.st_ctime_ns]
    b = C.stamp_bytes("f.bin", st, b"\x01" * 32)
    assert json.loads(b) == {C.STAMP_KEY: 1, "file": "f.bin", "identity": C.file_identity(st), "digest": "01" * 32}
    assert C.read_stamp(str(p)) is None
    assert C.write_stamp(str(p), st, b"\x01" * 32) == "written"
    assert C.read_stamp(str(p)) == json.loads(b)
    assert C.write_stamp(str(p), st, b"\x02" * 32) == "written"            # ditkit's own stamp is replaced
    assert C.read_stamp(str(p))["digest"] == "02" * 32
    (tmp_path / "g.bin.verified").write_text("not a stamp")
    assert C.write_stamp(str(tmp_path / "g.bin"), st, b"\x01" * 32).startswith("not written")
    assert (tmp_path / "g.bin.verified").read_text() == "not a stamp"
    (tmp_path / "h.bin.verified").write_bytes(b"x" * 5000)                  # over the size bound: not read
    assert C.read_stamp(str(tmp_path / "h.bin")) is None


# ------------------------------------------------------- written from the mutation survivors (tools/mutation.py)

def test_stamp_bytes_are_sorted_json():
    st = os.stat(__file__)
    b = C.stamp_bytes("f.bin", st, b"\x01" * 32)
    assert b == json.dumps({"digest": "01" * 32, "file": "f.bin", "identity": C.file_identity(st), C.STAMP_KEY: 1},
                           sort_keys=True).encode()
    keys = [k for k, _ in json.loads(b, object_pairs_hook=lambda kv: kv)]
    assert keys == sorted(keys) == ["digest", C.STAMP_KEY, "file", "identity"]


@pytest.mark.parametrize("size,read", [(4096, True), (4097, False)])
def test_stamp_size_bound_both_sides(tmp_path, size, read):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    st = os.stat(p)
    body = C.stamp_bytes("f.bin", st, b"\x01" * 32)
    (tmp_path / "f.bin.verified").write_bytes(body + b" " * (size - len(body)))      # valid JSON, padded
    assert (C.read_stamp(str(p)) is not None) is read


@pytest.mark.parametrize("size,replaced", [(4096, True), (4097, False)])
def test_an_existing_stamp_is_replaced_only_within_the_size_bound(tmp_path, size, replaced):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    st = os.stat(p)
    old = C.stamp_bytes("f.bin", st, b"\x01" * 32)
    old = old + b" " * (size - len(old))
    (tmp_path / "f.bin.verified").write_bytes(old)
    got = C.write_stamp(str(p), st, b"\x02" * 32)
    assert (got == "written") is replaced, got
    now = (tmp_path / "f.bin.verified").read_bytes()
    assert (now == C.stamp_bytes("f.bin", st, b"\x02" * 32)) is replaced and (now == old) is not replaced


def test_write_stamp_names_the_cache_folder_when_it_cannot(tmp_path):
    st = os.stat(__file__)
    got = C.write_stamp(str(tmp_path / "gone" / "f.bin"), st, b"\x01" * 32)
    assert got.startswith("not written (cache folder") and str(tmp_path / "gone") in got


@pytest.mark.parametrize("workers,nchunks,pool", [(1, 3, None), (4, 1, None), (2, 2, 2), (4, 3, 4)])
def test_digest_of_uses_a_pool_only_for_several_workers_and_chunks(monkeypatch, workers, nchunks, pool):
    import concurrent.futures as cf

    made = []
    real = cf.ThreadPoolExecutor

    class Spy(real):
        def __init__(self, n=None, *a, **k):
            made.append(n)
            super().__init__(n, *a, **k)

    monkeypatch.setattr(cf, "ThreadPoolExecutor", Spy)
    monkeypatch.setattr(C, "DIGEST_CHUNK", 8)
    data = bytes(range(8 * nchunks - 3))                       # the last chunk partial
    seen = []
    got = C.digest_of(b"head", data, workers=workers, progress=seen.append)
    assert made == ([] if pool is None else [pool])
    want_parts = [hashlib.sha256(b"head").digest()] + [hashlib.sha256(data[i:i + 8]).digest()
                                                      for i in range(0, len(data), 8)]
    assert got == hashlib.sha256(C.DIGEST_TAG + b"".join(want_parts)).digest()
    assert seen == [min(i + 8, len(data)) for i in range(0, len(data), 8)]      # cumulative, in order


def _forged(tmp_path, tensors, rec):
    path = tmp_path / "c.safetensors"
    save_file(tensors, path, metadata={C.META_KEY: json.dumps(rec)})
    return str(path)


REC = {"key": "k", "format": "nvfp4", "recipe": "r", "version": C.VERSION}


@pytest.mark.parametrize("field,value,shown", [("key", "other", "'other'"), ("format", "mxfp8", "'mxfp8'"),
                                               ("recipe", None, "None"), ("version", 1, "1")])
def test_a_record_for_something_else_is_refused_with_what_it_says(tmp_path, field, value, shown):
    rec = dict(REC) | {field: value}
    path = _forged(tmp_path, {"a": torch.zeros(4), C.DIGEST_KEY: torch.zeros(32, dtype=torch.uint8)}, rec)
    want = REC[field]
    with pytest.raises(C.QuantCacheError) as e:
        C.read(path, "k", "nvfp4", "r")
    assert str(e.value) == (f"quantized cache '{path}': its {field} is {shown}, expected {want!r}; it was not "
                            "written for this source (remove it to re-quantize)")


def test_a_record_that_is_not_an_object_is_refused(tmp_path):
    path = str(tmp_path / "c.safetensors")
    save_file({"a": torch.zeros(4)}, path, metadata={C.META_KEY: "[1, 2]"})
    with pytest.raises(C.QuantCacheError, match=r"its key is None, expected 'k'; it was not written for this "
                                                r"source \(remove it to re-quantize\)$"):
        C.read(path, "k", "nvfp4", "r")


def test_a_file_without_the_record_message(tmp_path):
    path = str(tmp_path / "c.safetensors")
    save_file({"a": torch.zeros(4)}, path)
    with pytest.raises(C.QuantCacheError) as e:
        C.read(path, "k", "nvfp4", "r")
    assert str(e.value) == (f"quantized cache '{path}': no '{C.META_KEY}' record in its metadata; not a ditkit "
                            "cache file (remove it to re-quantize)")


@pytest.mark.parametrize("tensors", [
    {},                                                                            # no tensor at all
    {"a": torch.zeros(4), C.DIGEST_KEY: torch.zeros(32, dtype=torch.int8)},         # right name and shape, I8
    {"a": torch.zeros(4), C.DIGEST_KEY: torch.zeros(31, dtype=torch.uint8)},        # right name and dtype, 31 bytes
    {"a": torch.zeros(4), "z.other": torch.zeros(32, dtype=torch.uint8)},           # right shape and dtype, no name
])
def test_a_last_tensor_that_is_not_the_digest_is_refused(tmp_path, tensors):
    path = _forged(tmp_path, tensors, REC)
    with pytest.raises(C.QuantCacheError) as e:
        C.read(path, "k", "nvfp4", "r")
    assert str(e.value) == (f"quantized cache '{path}': the digest tensor '{C.DIGEST_KEY}' is not its last tensor; "
                            "modified or not written by ditkit (remove it to re-quantize)")


def test_a_stamp_left_from_before_is_ignored_where_stamps_are_not_supported(source, monkeypatch):
    _aged(monkeypatch)
    _load(source)
    _, rep = _load(source)                                       # hashed, stamped
    assert os.path.exists(_stamp_path(rep))
    monkeypatch.setattr(C, "stamps_supported", lambda: False)
    _, rep = _load(source)
    assert (rep.cache["verified"], rep.cache["stamp"]) == ("digest", "not supported on this system")


@pytest.mark.parametrize("stamped", [False, True])
def test_read_progress_counts_tensors_wholly_hashed_and_bytes(source, monkeypatch, stamped):
    """``progress(tensors done, total, bytes)``: with 4 KiB digest chunks, one call per chunk with the bytes hashed
    so far, and the tensors whose last byte is within them (oracle: the header's offsets); with a stamp, one call
    with everything."""
    _aged(monkeypatch)
    monkeypatch.setattr(C, "DIGEST_CHUNK", 4096)                 # the digest is over 4 KiB chunks from the start
    _, rep = _load(source)
    path = rep.cache["file"]
    if stamped:
        _load(source)                                            # hashed once: stamped
    hdr = read_header(path)
    order = sorted(hdr.tensors.values(), key=lambda ti: ti.begin)
    body, ends, total = order[-1].begin, [ti.end for ti in order[:-1]], len(order) - 1
    calls = []
    src = QC.open_source(str(source))
    key, _ = C.source_key(src.files, src.family, FMT, QC.RECIPES[src.family])
    how = {}
    C.read(path, key, FMT, QC.RECIPES[src.family]["source"], progress=lambda *a: calls.append(a), verified=how)
    assert how["by"] == ("stamp" if stamped else "digest")
    sizes = [body] if stamped else [min(i + 4096, body) for i in range(0, body, 4096)]
    assert calls == [(sum(e <= n for e in ends), total, n) for n in sizes]
    assert calls[-1] == (total, total, body) and total > 3


def test_read_progress_starts_at_no_tensor_when_the_first_tensor_outlasts_a_chunk(source, monkeypatch):
    """With 64-byte digest chunks the first tensor (more than 64 bytes, from the header) is not wholly hashed after
    the first chunk: the first call says 0 tensors done, and the count rises one tensor at a time as their last
    bytes are hashed (oracle: the header's offsets; small tensors can end within one chunk). Kills a counter that starts at 1 or is set instead of
    counted."""
    _aged(monkeypatch)
    monkeypatch.setattr(C, "DIGEST_CHUNK", 64)                   # the digest is over 64-byte chunks from the start
    _, rep = _load(source)
    path = rep.cache["file"]
    monkeypatch.setattr(C, "read_stamp", lambda p: None)         # hash every byte
    hdr = read_header(path)
    order = sorted(hdr.tensors.values(), key=lambda ti: ti.begin)
    ends, total = [ti.end for ti in order[:-1]], len(order) - 1
    assert ends[0] > 64
    src = QC.open_source(str(source))
    key, _ = C.source_key(src.files, src.family, FMT, QC.RECIPES[src.family])
    calls = []
    C.read(path, key, FMT, QC.RECIPES[src.family]["source"], progress=lambda *a: calls.append(a))
    assert calls[0] == (0, total, 64)
    assert [c[0] for c in calls] == [sum(e <= n for e in ends) for _, _, n in calls]
    assert calls[-1][0] == total and len(calls) > total


def test_a_missing_cache_folder_is_named_by_lookup_and_write(tmp_path):
    gone = str(tmp_path / "gone")
    for call in (lambda: C.lookup(gone, "x.safetensors"), lambda: C.write(gone, "x.safetensors", {}, {}, {})):
        with pytest.raises(C.QuantCacheError) as e:
            call()
        assert str(e.value) == f"cache folder '{gone}' cannot be opened (No such file or directory)"


def test_lookup_refuses_a_non_regular_entry_with_its_path(tmp_path):
    (tmp_path / "c.safetensors").mkdir()
    with pytest.raises(C.QuantCacheError) as e:
        C.lookup(str(tmp_path), "c.safetensors")
    assert str(e.value) == (f"quantized cache '{tmp_path / 'c.safetensors'}' is not a regular file (a symlink or "
                            "other entry); ditkit does not follow it: remove it to re-quantize")
    assert C.lookup(str(tmp_path), "none.safetensors") is None


def test_write_names_the_cache_file_when_a_tensor_does_not_fit_its_layout(tmp_path):
    inv = {"a": ((4,), "F32")}
    with pytest.raises(Exception) as e:
        C.write(str(tmp_path), "c.safetensors", inv, {"a": torch.zeros(5)}, {})
    assert str(e.value).startswith(f"{tmp_path / 'c.safetensors'}: tensor 'a' is F32 [5]")
    assert os.listdir(tmp_path) == []


def test_messages_of_a_digest_mismatch_and_a_header_changed_while_read(source, monkeypatch):
    _, rep = _load(source)
    path = rep.cache["file"]
    hdr = read_header(path)
    _tamper_at(path, 8 + hdr.header_len + 5)
    with pytest.raises(C.QuantCacheError) as e:
        _load(source)
    assert str(e.value) == (f"quantized cache '{path}': its bytes do not match the digest stored in it (modified or "
                            "damaged since ditkit wrote it); it is not used. Remove it to re-quantize from the source")
    _tamper_at(path, 8 + hdr.header_len + 5)                      # back as it was
    monkeypatch.setattr(C, "_raw_header_bytes", lambda p, n: b"x" * (8 + n))
    with pytest.raises(C.QuantCacheError) as e:
        _load(source)
    assert str(e.value) == f"quantized cache '{path}': the file changed while it was read (remove it to re-quantize)"


def test_a_hit_reports_its_family_format_recipe_key_and_progress(source):
    """The key the file is written under is the source key computed here from its parts, and a hit's report and
    progress come from the file (oracle: source_key called on the same inputs, the loader's own report)."""
    src = QC.open_source(str(source))
    recipe = QC.RECIPES[src.family]
    sd1, rep1 = _load(source)
    key, _ = C.source_key(src.files, src.family, FMT, recipe)
    assert json.loads(read_header(rep1.cache["file"]).metadata[C.META_KEY])["key"] == key
    assert key[:16] in os.path.basename(rep1.cache["file"])
    plan = QC.make_plan(src.family, FMT, src.inventory, src.prefix)
    seen = []
    sd2, rep2 = C.cached_quantize(str(source), src.files, src.family, FMT, recipe, lambda: 1 / 0,
                                  plan.output_inventory(), progress=lambda *a: seen.append(a))
    assert (rep2.family, rep2.fmt, rep2.recipe) == ("h3", FMT, recipe["source"]) and rep2.cache["state"] == "hit"
    assert seen and seen[-1][0] == seen[-1][1] == len(sd2)
    assert {c: s.as_dict() for c, s in rep2.classes.items()} == {c: s.as_dict() for c, s in rep1.classes.items()}


def test_a_record_without_classes_gives_an_empty_class_table(source):
    """A cache whose record has no class table (written by hand here through the module's own writer, so its
    digest is right) loads with no classes rather than failing."""
    src = QC.open_source(str(source))
    recipe = QC.RECIPES[src.family]
    sd, rep = _load(source)
    path = rep.cache["file"]
    rec = json.loads(read_header(path).metadata[C.META_KEY])
    del rec["classes"]
    os.unlink(path)
    plan = QC.make_plan(src.family, FMT, src.inventory, src.prefix)
    C.write(os.path.dirname(path), os.path.basename(path), plan.output_inventory(), sd,
            {C.META_KEY: json.dumps(rec)})
    _, rep2 = C.cached_quantize(str(source), src.files, src.family, FMT, recipe, lambda: 1 / 0,
                                plan.output_inventory())
    assert rep2.cache["state"] == "hit" and rep2.classes == {}


def _sampled_oracle(raw: bytes) -> str:
    """The key's per-file sample from its definition (module doc): SHA-256 of the 8-byte length, the header, and
    SAMPLES pieces of SAMPLE_BYTES spread evenly from the header's end to the file's end."""
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else 0
    end = min(len(raw), 8 + n)
    h = hashlib.sha256(raw[:8] + raw[8:end])
    data = len(raw) - end
    if data > 0:
        k = min(C.SAMPLE_BYTES, data)
        for i in range(C.SAMPLES):
            off = end + (data - k) * i // (C.SAMPLES - 1)
            h.update(raw[off:off + k])
    return h.hexdigest()


@pytest.mark.parametrize("kind", ["model", "small data", "one data byte", "big header", "short file",
                                  "header past the end"])
def test_sampled_sha256_is_its_definition(tmp_path, kind):
    p = tmp_path / "f.safetensors"
    if kind == "model":
        save_file(ckpt_h3.base_state_dict(), p)
    elif kind == "small data":
        save_file({"a": torch.arange(10, dtype=torch.float32)}, p)
    elif kind == "one data byte":
        save_file({"a": torch.ones(1, dtype=torch.uint8)}, p)
    elif kind == "big header":                                       # a header over 1 MiB: read in pieces
        save_file({"a": torch.zeros(3)}, p, metadata={"x": "y" * (3 << 19)})
    elif kind == "short file":
        p.write_bytes(b"\x05\x00\x00")
    else:
        p.write_bytes((1000).to_bytes(8, "little") + b"{}")
    raw = p.read_bytes()
    st = os.stat(p)
    assert C._sampled_sha256(str(p)) == (len(raw), st.st_mtime_ns, _sampled_oracle(raw))


def test_cache_location_of_the_root_folder_is_named_model():
    assert C.cache_location("/", "nvfp4", "ab" * 32) == ("/", "model.ditkit-nvfp4-abababababababab.safetensors")


def test_cache_location_keeps_a_shard_folder_name_ending_in_a_space(tmp_path):
    # only the separator is stripped from the folder's name, never whitespace (mutmut: rstrip(None) survived)
    d = tmp_path / "shard "
    d.mkdir()
    assert C.cache_location(str(d), "mxfp8", "cd" * 32) == (
        os.path.realpath(d), "shard .ditkit-mxfp8-cdcdcdcdcdcdcdcd.safetensors")


def test_a_source_whose_name_holds_the_cache_pattern_is_not_its_own_stale_cache(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    src = folder / f"x.ditkit-{FMT}-old.safetensors"
    save_file(ckpt_h3.base_state_dict(), src)
    _, rep = _load(src)
    assert rep.cache["state"] == "written" and rep.cache["stale"] == []
    (folder / f"x.ditkit-{FMT}-old.ditkit-{FMT}-0123456789abcdef.safetensors").write_bytes(b"")
    _, rep = _load(src)
    assert rep.cache["stale"] == [f"x.ditkit-{FMT}-old.ditkit-{FMT}-0123456789abcdef.safetensors"]


def _seconds_ok(v):
    return isinstance(v, float) and 0 <= v < 600 and round(v, 3) == v


def test_the_report_cache_entries_and_the_written_record(source, monkeypatch):
    src = QC.open_source(str(source))
    recipe = QC.RECIPES[src.family]
    key, recs = C.source_key(src.files, src.family, FMT, recipe)
    (source.parent / f"h3.ditkit-{FMT}-ffffffffffffffff.safetensors").write_bytes(b"")     # a stale one
    stale = [f"h3.ditkit-{FMT}-ffffffffffffffff.safetensors"]
    monkeypatch.setattr(C.time, "monotonic", iter([100.0, 100.5, 101.48765]).__next__)     # start, write, end
    sd, rep = _load(source)
    path = str(source.parent / f"h3.ditkit-{FMT}-{key[:16]}.safetensors")
    assert rep.cache == {"state": "written", "file": path, "key": key[:16], "seconds_write": 0.988, "stale": stale}
    meta = read_header(path).metadata
    got = json.loads(meta[C.META_KEY])
    assert meta[C.META_KEY] == json.dumps(got, sort_keys=True)
    classes = got.pop("classes")
    assert got == {"version": C.VERSION, "key": key, "format": FMT, "family": "h3", "recipe": recipe["source"],
                   "files": recs}
    assert classes == {c: dataclasses.asdict(v) for c, v in rep.classes.items()} and classes
    layers = {k[: -len(".comfy_quant")]: {"format": FMT} for k in sd if k.endswith(".comfy_quant")}
    assert layers and json.loads(meta["_quantization_metadata"]) == {"format_version": "1.0", "layers": layers}
    monkeypatch.setattr(C.time, "monotonic", iter([5.0, 5.25]).__next__)
    _, rep = _load(source)
    assert rep.cache == {"state": "hit", "file": path, "key": key[:16], "seconds": 0.25, "verified": "digest",
                         "stamp": rep.cache["stamp"], "stale": stale}


def test_the_report_when_the_cache_cannot_be_written(source, monkeypatch):
    def boom(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(C, "write", boom)
    src = QC.open_source(str(source))
    key, _ = C.source_key(src.files, src.family, FMT, QC.RECIPES[src.family])
    _, rep = _load(source)
    assert rep.cache == {"state": "not written", "why": "[Errno 30] Read-only file system", "stale": [],
                         "file": str(source.parent / f"h3.ditkit-{FMT}-{key[:16]}.safetensors")}


def test_source_key_is_the_sha256_of_its_documented_record(tmp_path):
    """The key from its definition (module doc), written out here: SHA-256 of the sorted JSON of the version,
    family, format, recipe source line, the recipe's rules, the sampling (16 pieces of 64 KiB) and per file its
    name, size, mtime_ns and sample."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": torch.arange(6, dtype=torch.float32)}, a)
    save_file({"y": torch.ones(3)}, b)
    recipe = QC.RECIPES["h3"]
    key, recs = C.source_key([str(a), str(b)], "h3", "mxfp8", recipe)
    files = []
    for p in (a, b):
        raw, st = p.read_bytes(), os.stat(p)
        files.append({"name": p.name, "bytes": len(raw), "mtime_ns": st.st_mtime_ns,
                      "sampled_sha256": _sampled_oracle(raw)})
    rules = [[r.pattern.pattern, r.layer_class, r.quantize] for r in recipe["rules"]]
    blob = json.dumps({"version": C.VERSION, "family": "h3", "format": "mxfp8", "recipe": recipe["source"],
                       "rules": rules, "files": files, "samples": [16, 64 << 10]}, sort_keys=True)
    assert (C.SAMPLES, C.SAMPLE_BYTES) == (16, 64 << 10)
    assert recs == files and rules
    assert key == hashlib.sha256(blob.encode()).hexdigest()


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_source_key_samples_every_file_in_order_on_any_number_of_threads(tmp_path, monkeypatch, workers):
    """Several shards hashed by a thread pool: each record is its own file's (name, size, mtime, sampled hash by the
    formula above), in the files' order, and the key is the same for any number of threads."""
    files = []
    for i, rows in enumerate((3, 40, 7)):                              # different sizes: a mix-up shows
        g = torch.Generator().manual_seed(i)
        p = tmp_path / f"model-0000{i + 1}-of-00003.safetensors"
        save_file({f"w{i}": torch.randn(rows, 300, generator=g)}, p)
        files.append(str(p))
    monkeypatch.setattr(C, "SAMPLES", 5)
    monkeypatch.setattr(C, "SAMPLE_BYTES", 64)
    monkeypatch.setattr(C, "hash_workers", lambda: workers)
    key, recs = C.source_key(files, "h3", FMT, QC.RECIPES["h3"])
    assert [r["name"] for r in recs] == [os.path.basename(f) for f in files]
    for f, r in zip(files, recs):
        assert r["bytes"] == os.path.getsize(f) and r["mtime_ns"] == os.stat(f).st_mtime_ns
        assert r["sampled_sha256"] == _sampled_oracle(open(f, "rb").read())        # 5 x 64 B
    monkeypatch.setattr(C, "hash_workers", lambda: 1)
    assert C.source_key(files, "h3", FMT, QC.RECIPES["h3"]) == (key, recs)
    assert C.source_key(files[::-1], "h3", FMT, QC.RECIPES["h3"])[0] != key          # the order is part of the key


@pytest.mark.parametrize("workers", [1, 4])
def test_source_key_raises_for_the_first_unreadable_file_in_order(tmp_path, monkeypatch, workers):
    ok = tmp_path / "a.safetensors"
    save_file({"w": torch.ones(4, 4)}, ok)
    missing1, missing2 = tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    monkeypatch.setattr(C, "hash_workers", lambda: workers)
    with pytest.raises(FileNotFoundError) as e:
        C.source_key([str(ok), str(missing1), str(missing2)], "h3", FMT, QC.RECIPES["h3"])
    assert e.value.filename == str(missing1)


def test_source_key_samples_at_most_hash_workers_files_at_once(tmp_path, monkeypatch):
    """2 workers, 4 files: the first two are sampled together (a barrier both must reach), never more than two at
    once; the records stay in the files' order."""
    import threading

    files = [str(tmp_path / f"f{i}.safetensors") for i in range(4)]
    gate = threading.Barrier(2, timeout=20)
    lock = threading.Lock()
    state = {"now": 0, "most": 0}

    def fake(path):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            if path in files[:2]:
                gate.wait()                      # a sequential caller never gets past the first file
            time.sleep(0.05)
        finally:
            with lock:
                state["now"] -= 1
        return files.index(path), 0, path

    monkeypatch.setattr(C, "_sampled_sha256", fake)
    monkeypatch.setattr(C, "hash_workers", lambda: 2)
    _, recs = C.source_key(files, "h3", FMT, QC.RECIPES["h3"])
    assert state["most"] == 2
    assert [(r["name"], r["bytes"], r["sampled_sha256"]) for r in recs] == \
        [(os.path.basename(f), i, f) for i, f in enumerate(files)]
