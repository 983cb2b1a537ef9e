"""Write-once cache of a quantize-on-load (opt-in, off by default; issue #34).

The first quantizing load of a source writes its comfy_quant state dict next to the source; every later load of
the same source, format and recipe reads that file instead (a plain read of the quantized bytes: no bf16 read, no
quantize), verified before anything is handed over.

* **where**: in the source's own folder (the official / diffusers shard folder, or the single file's folder),
  through :mod:`.safe_fs` only (validated name, no symlink followed, temp file + no-replace publish; nothing outside
  that folder, nothing replaced, nothing partial left on a failure);
* **name**: ``<source stem>.ditkit-<format>-<key[:16]>.safetensors``; the full key is in the file's metadata;
* **key** (:func:`source_key`): SHA-256 over the cache format version, the family, the format, the recipe's source
  line and rule set, the sampling (:data:`SAMPLES`, :data:`SAMPLE_BYTES`), and per source file: its name, size,
  ``mtime_ns`` and a *sampled* SHA-256 (the safetensors header, which holds every key, dtype, shape and offset, plus
  :data:`SAMPLES` chunks of :data:`SAMPLE_BYTES` spread evenly over the data). Why sampled and not a full hash: the
  point of a hit is not to read the source at all; a full hash would read all of it again (the hour this cache
  saves). A rewrite of the file changes its mtime (and nearly always its size / header); the sampled bytes catch a
  same-size, same-mtime copy of other weights (``cp -p`` / ``rsync -t``) unless it differs from the original in none
  of the 1 MiB read. Not caught: an in-place edit that keeps size and mtime and touches no sampled byte (that needs
  deliberately resetting the mtime). Costs 1 MiB of reads per file, the files sampled on a thread pool (16 pieces:
  another checkpoint of the same shapes differs in every piece; 64 pieces cost 10 ms of every cached load of 4
  shards);
* **verified on read** (:func:`read`): the file must be a regular file (no symlink), its metadata must carry the
  expected key, format and recipe, and the SHA-256 of its header and every tensor's bytes, computed while reading,
  must equal the digest stored as its last tensor (``ditkit.sha256``, 32 bytes, hashed last when written). Any
  mismatch raises :class:`QuantCacheError` naming the file: a tampered or damaged cache is never used, nor silently
  replaced (delete it to re-quantize). The digest detects any change made without recomputing it (damage, a partial
  copy, an edit, another file under the name); it is not a signature: whoever can write the model folder can also
  forge it (as they can replace the source model itself);
* **verified once per file version** (POSIX only): after a full verification of a file whose last change
  (``st_ctime``) is at least :data:`STAMP_MIN_AGE_S` old, ditkit writes a stamp next to it
  (``<cache name>.verified``: the file's device, inode, size, ``mtime_ns``, ``ctime_ns`` and digest). A later
  read whose open file still has exactly those is not hashed again, as git trusts its index: any write to the file,
  a ``touch``, a ``chmod`` or another file renamed over it sets ``st_ctime`` to the time of that change, which
  no unprivileged process can set back, so a changed file never matches its stamp and is hashed in full (and
  refused when its bytes no longer match). The age rule closes the race of a write in the same clock tick as the
  verification; the stat is taken before and after hashing and must not move. Where ``st_ctime`` is not the
  change time (Windows: creation time) every read hashes in full. A stamp is only ever a reason to skip the hash
  of an unchanged file, never to accept bytes: its digest must equal the one stored in the file. Whoever can
  write the folder can forge a stamp as they can forge the digest (not a signature, as above);
* **stale**: a changed source gives another key, so another name: the old file is not read (it is left in place and
  reported; ditkit deletes nothing it did not just write).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from typing import Callable

import torch

from .. import strict_json
from ..errors import DitKitError
from .safe_fs import SafeDir, open_model_file, read_inside, write_file, write_stream
from .safetensors_io import SafeFile, stream_chunks

VERSION = 2
SAMPLES = 16
SAMPLE_BYTES = 64 << 10
DIGEST_KEY = "ditkit.sha256"
META_KEY = "ditkit_quant_cache"
DIGEST_CHUNK = 32 << 20
DIGEST_TAG = b"ditkit-quant-cache-digest-2\n"
STAMP_SUFFIX = ".verified"
STAMP_KEY = "ditkit_quant_cache_verified"
STAMP_MIN_AGE_S = 2.0


class Digest:
    """The cache file's digest (version 2), written as its last tensor: ``SHA-256(TAG || SHA-256(header) ||
    SHA-256(chunk 0) || SHA-256(chunk 1) || ...)`` over the raw header (its 8-byte length included) and the tensor
    bytes before the digest, cut into :data:`DIGEST_CHUNK` pieces. A list of chunk hashes rather than one running
    hash so that a read can hash the chunks on every core at once (:func:`digest_of`: hashlib releases the GIL);
    any changed byte still changes its chunk's hash and so the digest. This streaming form is the writer's."""

    def __init__(self, header: bytes):
        self.parts = [hashlib.sha256(header).digest()]
        self._cur = hashlib.sha256()
        self._fill = 0

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(len(mv), DIGEST_CHUNK - self._fill)
            self._cur.update(mv[:take])
            self._fill += take
            mv = mv[take:]
            if self._fill == DIGEST_CHUNK:
                self.parts.append(self._cur.digest())
                self._cur, self._fill = hashlib.sha256(), 0

    def digest(self) -> bytes:
        parts = self.parts + ([self._cur.digest()] if self._fill else [])
        return hashlib.sha256(DIGEST_TAG + b"".join(parts)).digest()


def hash_workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def digest_of(header: bytes, data, workers: int | None = None,
              progress: Callable[[int], None] | None = None) -> bytes:
    """:class:`Digest` of ``header`` + ``data`` (a buffer), its chunks hashed by ``workers`` threads (default: the
    cores this process may use, at most 8); ``progress(bytes hashed)`` as chunks complete, in order."""
    from concurrent.futures import ThreadPoolExecutor

    mv = memoryview(data).cast("B")
    chunks = [mv[i:i + DIGEST_CHUNK] for i in range(0, len(mv), DIGEST_CHUNK)]
    parts = [hashlib.sha256(header).digest()]
    n = workers or hash_workers()
    done = 0

    def one(c):
        return hashlib.sha256(c).digest()

    if n > 1 and len(chunks) > 1:
        with ThreadPoolExecutor(n) as ex:
            for c, d in zip(chunks, ex.map(one, chunks)):
                parts.append(d)
                done += len(c)
                if progress:
                    progress(done)
    else:
        for c in chunks:
            parts.append(one(c))
            done += len(c)
            if progress:
                progress(done)
    return hashlib.sha256(DIGEST_TAG + b"".join(parts)).digest()


class QuantCacheError(DitKitError):
    """A cache file that cannot be used as it is (modified, damaged, not ditkit's, or for another source)."""


def _sampled_sha256(path: str) -> tuple[int, int, str]:
    """(size, mtime_ns, sampled SHA-256) of one source file, read through one descriptor (fstat of the opened file)."""
    fd = open_model_file(path)
    try:
        st = os.fstat(fd)
        size = st.st_size
        h = hashlib.sha256()
        head = os.pread(fd, 8, 0)
        h.update(head)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        hdr_end = min(size, 8 + n)
        pos = 8
        while pos < hdr_end:                       # the whole header (shapes, dtypes, offsets, metadata)
            b = os.pread(fd, min(1 << 20, hdr_end - pos), pos)
            if not b:
                break
            h.update(b)
            pos += len(b)
        data = size - hdr_end
        if data > 0:
            for i in range(SAMPLES):
                off = hdr_end + (data - min(SAMPLE_BYTES, data)) * i // max(1, SAMPLES - 1)
                h.update(os.pread(fd, min(SAMPLE_BYTES, data), off))
        return size, st.st_mtime_ns, h.hexdigest()
    finally:
        os.close(fd)


def source_key(files: list[str], family: str, fmt: str, recipe: dict) -> tuple[str, list[dict]]:
    """-> (hex key, per-file records) for the cache of ``files`` quantized to ``fmt`` by ``recipe``. The files are
    sampled by up to :func:`hash_workers` threads at once (hashlib and ``os.pread`` release the GIL: a fixed cost of
    every cached load, 2.9 ms for 4 shards of a 1 GB H3); the records keep ``files``' order, and a file that cannot
    be read raises as it would alone (the first such file in order)."""
    n = min(len(files), hash_workers())
    if n > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n) as ex:
            sampled = list(ex.map(_sampled_sha256, files))
    else:
        sampled = [_sampled_sha256(f) for f in files]
    recs = []
    for f, (size, mtime, sample) in zip(files, sampled):
        recs.append({"name": os.path.basename(f), "bytes": size, "mtime_ns": mtime, "sampled_sha256": sample})
    rules = [[r.pattern.pattern, r.layer_class, r.quantize] for r in recipe["rules"]]
    blob = json.dumps({"version": VERSION, "family": family, "format": fmt, "recipe": recipe["source"],
                       "rules": rules, "files": recs, "samples": [SAMPLES, SAMPLE_BYTES]}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest(), recs


def cache_location(source_path: str, fmt: str, key: str) -> tuple[str, str]:
    """-> (folder, file name) of the cache of ``source_path`` (a file or a shard folder)."""
    p = os.path.realpath(source_path)
    if os.path.isdir(p):
        folder, stem = p, os.path.basename(p.rstrip(os.sep)) or "model"
    else:
        folder, base = os.path.split(p)
        stem = base.rsplit(".", 1)[0]
    return folder, f"{stem}.ditkit-{fmt}-{key[:16]}.safetensors"


def write(folder: str, name: str, inventory, sd: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """Write the quantized state dict ``sd`` (every key of ``inventory``, in that order) to ``name`` in ``folder``,
    the digest tensor last, through :func:`.safe_fs.write_stream` (temp file, no-replace publish). The loader keeps
    ``sd`` anyway, so nothing is copied: each chunk is the tensor's own bytes. -> the published path."""
    inv = dict(inventory)
    inv[DIGEST_KEY] = ((32,), "U8")
    h: list[Digest] = []

    def tensors():
        for k in inventory:
            yield k, sd[k]
        yield DIGEST_KEY, torch.frombuffer(bytearray(h[0].digest()), dtype=torch.uint8)

    def chunks():
        for i, c in enumerate(stream_chunks(inv, tensors(), meta, where=os.path.join(folder, name))):
            if i == 0:                         # the header
                h.append(Digest(bytes(memoryview(c).cast("B"))))
            elif i <= len(inventory):          # every tensor but the digest itself
                h[0].update(c)
            yield c

    d = SafeDir.open_root(folder, error=QuantCacheError, what="cache folder")
    try:
        return write_stream(d, name, chunks())
    finally:
        d.close()


def lookup(folder: str, name: str) -> str | None:
    """The cache file's path when ``name`` exists in ``folder``; None when it does not; a symlink or anything but
    a regular file there is refused (never followed)."""
    d = SafeDir.open_root(folder, error=QuantCacheError, what="cache folder")
    try:
        st = d.lstat(name)
    finally:
        d.close()
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise QuantCacheError(f"quantized cache '{os.path.join(folder, name)}' is not a regular file (a symlink or "
                              "other entry); ditkit does not follow it: remove it to re-quantize")
    return os.path.join(folder, name)


def stamps_supported() -> bool:
    """Whether ``st_ctime`` is the time of the file's last change here (POSIX), the premise of a stamp."""
    return os.name == "posix"


def file_identity(st: os.stat_result) -> list[int]:
    """What a stamp records of a file: device, inode, size, ``mtime_ns``, ``ctime_ns``."""
    return [int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns)]


def stamp_bytes(name: str, st: os.stat_result, digest: bytes) -> bytes:
    return json.dumps({STAMP_KEY: 1, "file": name, "identity": file_identity(st), "digest": digest.hex()},
                      sort_keys=True).encode()


def read_stamp(path: str) -> dict | None:
    """The stamp next to cache file ``path`` as a dict, or None when there is none or it is not a well-formed
    ditkit stamp for that name (then the file is simply hashed in full)."""
    folder, name = os.path.split(path)
    try:
        data, _ = read_inside(folder, [name + STAMP_SUFFIX], max_bytes=4096, what="quantized-cache stamp",
                              error=QuantCacheError)
        rec = strict_json.loads_as(data.decode("utf-8"), path + STAMP_SUFFIX, what="quantized-cache stamp")
    except (QuantCacheError, ValueError, UnicodeDecodeError):
        return None
    ok = (isinstance(rec, dict) and rec.get(STAMP_KEY) == 1 and rec.get("file") == name
          and isinstance(rec.get("identity"), list) and len(rec["identity"]) == 5
          and all(type(v) is int for v in rec["identity"]) and isinstance(rec.get("digest"), str))
    return rec if ok else None


def write_stamp(path: str, st: os.stat_result, digest: bytes) -> str:
    """Publish (or replace a ditkit stamp at) ``<path>.verified`` through :func:`.safe_fs.write_file`; a file
    there that is not a ditkit stamp for this name is never replaced. -> "written" or why not."""
    folder, name = os.path.split(path)

    def ours(blob: bytes) -> bool:
        try:
            rec = strict_json.loads(blob.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return False
        return isinstance(rec, dict) and rec.get(STAMP_KEY) == 1 and rec.get("file") == name

    try:
        d = SafeDir.open_root(folder, error=QuantCacheError, what="cache folder")
        try:
            write_file(d, name + STAMP_SUFFIX, stamp_bytes(name, st, digest), replace_if=ours, max_existing_bytes=4096)
        finally:
            d.close()
    except (OSError, DitKitError) as e:
        return f"not written ({e})"
    return "written"


def read(path: str, key: str, fmt: str, recipe_source: str,
         progress: Callable[[int, int, int], None] | None = None,
         verified: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify a cache file and map it -> (state dict without the digest, the ``ditkit_quant_cache`` record).
    Raises :class:`QuantCacheError` naming the file and what differs; nothing is returned unless the whole file
    matched its digest.

    The tensors are views of one private, copy-on-write memory map of the file (what the stock safetensors loader
    gives ComfyUI for a comfy_quant file: no copy), and every byte is hashed before they are returned, its chunks on
    every core (:func:`digest_of`), so the pages are read once, here, and are in memory when the model is used.
    ``progress(done, total, bytes)`` as the hash advances (tensors wholly hashed / total). A file that still
    matches its stamp (module doc) is not hashed again. ``verified``, when given, is filled with how the file was
    verified: ``{"by": "digest" | "stamp", "stamp": "written" | "kept" | why not}``."""
    where = f"quantized cache '{path}'"
    with SafeFile(path) as f:
        hdr = f.header
        try:
            rec = strict_json.loads_as(hdr.metadata.get(META_KEY, ""), where, what="quantized-cache record")
        except ValueError:
            raise QuantCacheError(f"{where}: no '{META_KEY}' record in its metadata; not a ditkit cache file "
                                  "(remove it to re-quantize)") from None
        for field, want in (("key", key), ("format", fmt), ("recipe", recipe_source), ("version", VERSION)):
            if not isinstance(rec, dict) or rec.get(field) != want:
                got = rec.get(field) if isinstance(rec, dict) else None
                raise QuantCacheError(f"{where}: its {field} is {got!r}, expected {want!r}; it was not written for "
                                      "this source (remove it to re-quantize)")
        order = sorted(hdr.tensors.values(), key=lambda ti: ti.begin)
        if not order or order[-1].name != DIGEST_KEY or order[-1].shape != (32,) or order[-1].dtype != "U8":
            raise QuantCacheError(f"{where}: the digest tensor '{DIGEST_KEY}' is not its last tensor; modified or "
                                  "not written by ditkit (remove it to re-quantize)")
        dig = order[-1]
        mm = f.map()
        header = _raw_header_bytes(path, hdr.header_len)
        if bytes(mm[:len(header)]) != header:
            raise QuantCacheError(f"{where}: the file changed while it was read (remove it to re-quantize)")
        total = len(order) - 1
        ends = [ti.begin + ti.nbytes for ti in order[:-1]]
        state = {"done": 0}

        def hashed(nbytes: int) -> None:
            while state["done"] < total and ends[state["done"]] <= nbytes:
                state["done"] += 1
            if progress:
                progress(state["done"], total, nbytes)

        stored = bytes(mm[hdr.data_start + dig.begin:hdr.data_start + dig.begin + 32])
        st0 = f.stat()
        how = {"by": "digest", "stamp": "not supported on this system"}
        stamp = read_stamp(path) if stamps_supported() else None
        if (stamp is not None and stamp["identity"] == file_identity(st0) and stamp["digest"] == stored.hex()
                and len(mm) == st0.st_size):
            how = {"by": "stamp", "stamp": "kept"}
            hashed(dig.begin)
        else:
            data = memoryview(mm)[hdr.data_start:hdr.data_start + dig.begin]
            try:
                got = digest_of(header, data, progress=hashed)
            finally:
                data.release()
            if stored != got:
                raise QuantCacheError(f"{where}: its bytes do not match the digest stored in it (modified or "
                                      "damaged since ditkit wrote it); it is not used. Remove it to re-quantize "
                                      "from the source")
            if stamps_supported():
                st1 = f.stat()
                if file_identity(st1) != file_identity(st0):
                    how["stamp"] = "not written (the file changed while it was hashed)"
                elif time.time() - st0.st_ctime < STAMP_MIN_AGE_S:
                    how["stamp"] = f"not written (changed less than {STAMP_MIN_AGE_S:g} s ago)"
                else:
                    how["stamp"] = write_stamp(path, st0, stored)
        sd = {ti.name: f.view(mm, ti.name) for ti in order[:-1]}
    if verified is not None:
        verified.update(how)
    return sd, rec


def _raw_header_bytes(path: str, header_len: int) -> bytes:
    fd = open_model_file(path)
    try:
        b = os.pread(fd, 8 + header_len, 0)
    finally:
        os.close(fd)
    return b


def cached_quantize(source_path: str, files: list[str], family: str, fmt: str, recipe: dict,
                    quantize: Callable[[], tuple[dict, object]], inventory, progress=None):
    """The cache around one quantizing load -> (state dict, QuantReport with ``cache`` filled in).

    Hit: the verified cache file's tensors (``quantize`` is not called). Miss: ``quantize()`` -> (sd, report), then
    the cache is written from ``sd`` (the digest last) and published; a write that fails (read-only folder, out of
    space) leaves nothing behind and is reported in ``report.cache`` (the load itself stands). Other cache files
    of the same source and format (an older key: the source changed) are listed as stale, never read or deleted."""
    import dataclasses

    from .quantize import ClassStats, QuantReport

    t0 = time.monotonic()
    key, recs = source_key(files, family, fmt, recipe)
    folder, name = cache_location(source_path, fmt, key)
    stale = _stale(folder, name, fmt)
    found = lookup(folder, name)
    if found is not None:
        how: dict = {}
        sd, rec = read(found, key, fmt, recipe["source"], progress, verified=how)
        report = QuantReport(family, fmt, recipe["source"])
        report.classes = {c: ClassStats(**v) for c, v in rec.get("classes", {}).items()}
        report.cache = {"state": "hit", "file": found, "key": key[:16], "seconds": round(time.monotonic() - t0, 3),
                        "verified": how["by"], "stamp": how["stamp"], "stale": stale}
        return sd, report
    sd, report = quantize()
    record = {"version": VERSION, "key": key, "format": fmt, "family": family, "recipe": recipe["source"],
              "files": recs, "classes": {c: dataclasses.asdict(v) for c, v in report.classes.items()}}
    meta = {META_KEY: json.dumps(record, sort_keys=True),
            "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {
                k[: -len(".comfy_quant")]: {"format": fmt} for k in inventory if k.endswith(".comfy_quant")}})}
    t1 = time.monotonic()
    try:
        path = write(folder, name, inventory, sd, meta)
    except (OSError, DitKitError) as e:
        report.cache = {"state": "not written", "file": os.path.join(folder, name), "why": str(e), "stale": stale}
    else:
        report.cache = {"state": "written", "file": path, "key": key[:16],
                        "seconds_write": round(time.monotonic() - t1, 3), "stale": stale}
    return sd, report


def _stale(folder: str, name: str, fmt: str) -> list[str]:
    stem = name[: name.rindex(f".ditkit-{fmt}-")]      # the last: a source may have the pattern in its name
    prefix = f"{stem}.ditkit-{fmt}-"
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix) and n.endswith(".safetensors") and n != name)
