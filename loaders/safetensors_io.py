"""The one safe safetensors reader every ditkit loader uses.

* bounded header length, checked against the file size before anything is allocated;
* strict JSON: no duplicate keys, no NaN/Infinity constants, objects where objects are required;
* every tensor entry checked: known dtype, integer non-negative shape, offsets in range, byte length equal
  to ``numel * itemsize``, no two tensors overlapping, the data section exactly covered (no hole, no trailing
  bytes, as in the reference implementation);
* ``__metadata__`` must map strings to strings;
* tensors are read lazily, one at a time (never the whole file in RAM).

No pickle anywhere: this module is the only way ditkit reads weights. Errors are
:class:`~ditkit.errors.CheckpointError` and name the file, the key and the problem.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .. import strict_json
from ..errors import CheckpointError
from .safe_fs import open_model_file

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same bound as the reference safetensors implementation
MAX_METADATA_VALUE = 1 << 20

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
}
for _name, _attr, _size in (("F8_E4M3", "float8_e4m3fn", 1), ("F8_E5M2", "float8_e5m2", 1),
                            ("F8_E8M0", "float8_e8m0fnu", 1),
                            ("U16", "uint16", 2), ("U32", "uint32", 4), ("U64", "uint64", 8)):
    if hasattr(torch, _attr):
        DTYPES[_name] = (getattr(torch, _attr), _size)
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Header:
    path: str
    header_len: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    def keys(self) -> list[str]:
        return list(self.tensors)


def strict_json_loads(text: str, where: str, *, what: str):
    """:func:`ditkit.strict_json.loads_as` raising CheckpointError naming ``where`` and ``what`` (the kind of JSON:
    "safetensors header", "index JSON", ...)."""
    return strict_json.loads_as(text, where, what=what, error=CheckpointError)



def _open_regular(path: str, where: str):
    """Open ``path`` once and check the OPENED file (not the name, which may be a symlink the user placed in a
    model folder, or may change): it must be a regular file. Opened non-blocking, so a FIFO or device is refused
    instead of hanging the server. Returns ``(file object, size, (st_dev, st_ino))`` from ``fstat``."""
    try:
        fd = open_model_file(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise CheckpointError(f"{where}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where}: cannot read (not a regular file: a directory, FIFO or device is not a "
                                  "checkpoint)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        # unbuffered: a buffer filled while reading the header would serve stale tensor bytes after the file changed
        return os.fdopen(fd, "rb", buffering=0), st.st_size, (st.st_dev, st.st_ino)
    except BaseException:
        os.close(fd)
        raise


def _read_exact(f, n: int) -> bytearray:
    """Up to ``n`` bytes from the current position (fewer only at end of file: an unbuffered read may return
    less than asked, so read until ``n`` or EOF). Read into one buffer of ``n`` bytes (no second copy)."""
    buf = bytearray(n)
    got = _readinto_exact(f, memoryview(buf))
    return buf if got == n else buf[:got]


def _readinto_exact(f, view: memoryview) -> int:
    """Fill ``view`` from the current position; -> bytes read (fewer than ``len(view)`` only at end of file)."""
    got, n = 0, len(view)
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return got


def read_header(path: str | os.PathLike) -> Header:
    """Parse and fully validate a safetensors header without reading tensor data (the file is opened once and
    the header is checked against the opened file's size)."""
    path = os.fspath(path)
    where = f"safetensors file '{path}'"
    f, size, _ = _open_regular(path, where)
    with f:
        return _parse_header(f, size, path, where)


def _parse_header(f, size: int, path: str, where: str) -> Header:
    try:
        f.seek(0)
        head = bytes(_read_exact(f, 8))
        if len(head) < 8:
            raise CheckpointError(f"{where}: file is {size} bytes, too short to hold a header (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{where}: header length {n} is not in 1..{MAX_HEADER_BYTES} (not a safetensors file?)")
        if 8 + n > size:
            raise CheckpointError(f"{where}: header length {n} exceeds the file size {size} (truncated file)")
        raw = bytes(_read_exact(f, n))
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read ({e.strerror or e})") from None
    if len(raw) != n:
        raise CheckpointError(f"{where}: short read of the {n}-byte header (file changed or truncated)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: header is not UTF-8 (not a safetensors file?)") from None
    obj = strict_json_loads(text.rstrip(" "), where, what="safetensors header")
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: header is not a JSON object")
    meta_raw = obj.pop("__metadata__", None)
    meta_raw = {} if meta_raw is None else meta_raw  # null is allowed (as in the reference); [], "", 0 are not
    if not isinstance(meta_raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta_raw.items()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings")
    for k, v in meta_raw.items():
        if len(v) > MAX_METADATA_VALUE:
            raise CheckpointError(f"{where}: __metadata__ value of {k!r} is {len(v)} characters (limit {MAX_METADATA_VALUE})")
    data_len = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, ent in obj.items():
        tw = f"{where}, tensor {name!r}"
        if not isinstance(ent, dict):
            raise CheckpointError(f"{tw}: entry is not an object")
        dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if dt not in DTYPES:
            raise CheckpointError(f"{tw}: unknown dtype {dt!r}")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40 for s in shape)):
            raise CheckpointError(f"{tw}: invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise CheckpointError(f"{tw}: invalid data_offsets {offs!r}")
        b, e = offs
        if not (0 <= b <= e):
            raise CheckpointError(f"{tw}: data_offsets {offs} are not ordered")
        if e > data_len:
            raise CheckpointError(f"{tw}: data_offsets end {e} is past the data section ({data_len} bytes; truncated file)")
        numel = 1
        for s in shape:
            numel *= s
        if numel * DTYPES[dt][1] != e - b:
            raise CheckpointError(f"{tw}: {e - b} bytes do not match dtype {dt} x shape {shape}")
        tensors[name] = TensorInfo(name, dt, tuple(shape), b, e)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{where}: tensors {n0!r} and {n1!r} overlap (bytes {b1}..{e0})")
    # the data section must be exactly covered, as the reference implementation requires: no hole, no
    # trailing bytes (a file ComfyUI's own loader refuses is refused here too; no hidden payload)
    covered = 0
    for b, e, name in spans:
        if b != covered:
            raise CheckpointError(f"{where}: data section not covered: bytes {covered}..{b} before tensor {name!r} "
                                  "belong to no tensor (corrupt or crafted file)")
        covered = e
    if covered != data_len:
        raise CheckpointError(f"{where}: data section not covered: {data_len - covered} trailing bytes after the "
                              f"last tensor (ends at {covered} of {data_len}; corrupt or crafted file)")
    return Header(path=path, header_len=n, tensors=tensors, metadata=dict(meta_raw))


class SafeFile:
    """Lazy reader over a validated file: ``get(name)`` reads one tensor. The file is opened once: the header is
    validated and every tensor is read through that same handle (until :meth:`close`; a ``get`` after it reopens
    the path and refuses a file that is no longer the one validated)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        fh, size, self._ident = _open_regular(path, f"safetensors file '{path}'")
        try:
            self.header = _parse_header(fh, size, path, f"safetensors file '{path}'")
        except BaseException:
            fh.close()
            raise
        self.path = self.header.path
        self._size = size
        self._fh = fh

    def __enter__(self):
        return self

    def prefetch(self, name: str) -> bool:
        """Ask the system to start reading tensor ``name`` into the page cache in the background
        (``posix_fadvise(WILLNEED)``; -> whether it could ask): a streaming reader calls it for the next tensor
        before it works on the current one, so reading the disk and quantizing overlap."""
        fn = getattr(os, "posix_fadvise", None)
        ti = self.info(name)
        if fn is None or self._fh is None or not ti.nbytes:
            return False
        try:
            fn(self._fh.fileno(), self.header.data_start + ti.begin, ti.nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            return False
        return True

    def map(self) -> mmap.mmap:
        """A private, copy-on-write memory map of the validated file (the handle opened once, never the name
        again): tensors viewed on it read their pages from the page cache when first touched, as the stock
        safetensors loader's do. Refused when the file's size is no longer the validated one."""
        where = f"safetensors file '{self.path}'"
        fh = self._fh or self._reopen()
        if os.fstat(fh.fileno()).st_size != self._size:
            raise CheckpointError(f"{where}: the file changed since its header was validated; load it again")
        return mmap.mmap(fh.fileno(), self._size, access=mmap.ACCESS_COPY)

    def stat(self) -> os.stat_result:
        """``fstat`` of the validated handle (the file these tensors come from, never the name looked up again)."""
        if self._fh is not None:
            return os.fstat(self._fh.fileno())
        fh = self._reopen()
        try:
            return os.fstat(fh.fileno())
        finally:
            fh.close()

    def view(self, mm: mmap.mmap, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of ``mm`` (from :meth:`map`): no copy; it keeps the map alive."""
        ti = self.info(name)
        if not ti.nbytes:
            return torch.empty(ti.shape, dtype=ti.torch_dtype)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=ti.nbytes, offset=self.header.data_start + ti.begin)
        return t.view(ti.torch_dtype).reshape(ti.shape)

    def __del__(self):
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()

    def _reopen(self):
        where = f"safetensors file '{self.path}'"
        fh, size, ident = _open_regular(self.path, where)
        if (ident, size) != (self._ident, self._size):
            fh.close()
            raise CheckpointError(f"{where}: the file changed since its header was validated; load it again")
        return fh

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def keys(self) -> list[str]:
        return self.header.keys()

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    def info(self, name: str) -> TensorInfo:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise CheckpointError(f"safetensors file '{self.path}': no tensor named {name!r}") from None

    def get(self, name: str, device: str | torch.device = "cpu", alloc=None) -> torch.Tensor:
        """Read one tensor. ``alloc(shape, dtype)``: where its bytes go (e.g. ``host_memory.empty``, for a tensor
        that is kept); default a buffer of exactly its size."""
        ti = self.info(name)
        if alloc is not None and ti.nbytes:
            t = alloc(ti.shape, ti.torch_dtype)
            self._read_rows_into(name, t, [(0, ti.shape[0] if ti.shape else 1, 0)])
            return t.to(device) if str(device) != "cpu" else t
        fh = self._fh or self._reopen()
        try:
            fh.seek(self.header.data_start + ti.begin)
            buf = _read_exact(fh, ti.nbytes)
        finally:
            if self._fh is None:
                fh.close()
        if len(buf) != ti.nbytes:
            raise CheckpointError(f"safetensors file '{self.path}', tensor {name!r}: short read (file changed or truncated)")
        if ti.nbytes == 0:
            t = torch.empty(ti.shape, dtype=ti.torch_dtype)
        else:
            t = torch.frombuffer(buf, dtype=ti.torch_dtype).reshape(ti.shape)
        return t.to(device) if str(device) != "cpu" else t

    def read_rows_into(self, name: str, out: torch.Tensor, blocks) -> None:
        """Copy rows of tensor ``name`` (first dimension; a 0-d tensor is one row) straight from the file into the
        contiguous CPU tensor ``out`` (same dtype, same row size): ``blocks`` = ``[(src_row, rows, dst_row), ...]``.
        A row permutation (H3's qkv de-interleave, fc1 halves, qkv merges) costs no copy beyond ``out``."""
        self._read_rows_into(name, out, blocks)

    def _read_rows_into(self, name: str, out: torch.Tensor, blocks) -> None:
        ti = self.info(name)
        where = f"safetensors file '{self.path}', tensor {name!r}"
        row = ti.nbytes // max(1, ti.shape[0] if ti.shape else 1)
        if out.dtype != ti.torch_dtype or not out.is_contiguous() or out.device.type != "cpu" \
                or out.numel() * out.element_size() % max(row, 1):
            raise ValueError(f"{where}: output must be a contiguous CPU {ti.torch_dtype} tensor of whole rows")
        dst_rows = out.numel() * out.element_size() // max(row, 1)
        src_rows = ti.shape[0] if ti.shape else 1
        mv = memoryview(out.view(-1).view(torch.uint8).numpy()) if row else None
        fh = self._fh or self._reopen()
        try:
            for s0, n, d0 in blocks:
                if s0 < 0 or n < 0 or d0 < 0 or s0 + n > src_rows or d0 + n > dst_rows:
                    raise ValueError(f"{where}: row block {(s0, n, d0)} outside {src_rows} source / {dst_rows} "
                                     "output rows")
                if not n or not row:
                    continue
                fh.seek(self.header.data_start + ti.begin + s0 * row)
                if _readinto_exact(fh, mv[d0 * row:(d0 + n) * row]) != n * row:
                    raise CheckpointError(f"{where}: short read (file changed or truncated)")
        finally:
            if self._fh is None:
                fh.close()

    def items(self, device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
        for k in self.keys():
            yield k, self.get(k, device)


def available_memory() -> int | None:
    """Bytes of memory this process can still get (``MemAvailable``, bounded by a cgroup limit); None unknown."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None and hasattr(os, "sysconf"):
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            avail = None
    for cg in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(cg, encoding="ascii") as f:
                lim = f.read().strip()
            used_p = cg.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
            with open(used_p, encoding="ascii") as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if lim.isdigit() and int(lim) < 1 << 60:
            left = max(0, int(lim) - used)
            avail = left if avail is None else min(avail, left)
        break
    return avail


def check_declared_sizes(header: Header, where: str, *, max_dim: int | None = None, max_numel: int | None = None,
                         expand: float = 1.0, memory: int | None = None, error=CheckpointError) -> None:
    """Bound every tensor the header DECLARES before a byte of it is read: each dimension <= ``max_dim`` and each
    element count <= ``max_numel`` (what the target can use: a rank or size beyond the largest layer is absurd),
    and the bytes reading them takes (``expand`` x the data: copies and float32 casts) within free memory
    (``memory``, default :func:`available_memory`). A file may be sparse: its size on disk says nothing. Raises
    ``error`` naming ``where`` and the key."""
    total = 0
    for name, ti in header.tensors.items():
        tw = f"{where}, key {name!r}"
        if max_dim is not None and ti.shape and max(ti.shape) > max_dim:
            raise error(f"{tw}: declared shape {list(ti.shape)} has a dimension of {max(ti.shape)}, larger than any "
                        f"dimension of the target ({max_dim}): an absurd rank or size for its layer; nothing was read")
        if max_numel is not None and ti.numel > max_numel:
            raise error(f"{tw}: declared shape {list(ti.shape)} holds {ti.numel} elements, more than the largest "
                        f"weight of the target ({max_numel}): an absurd size for its layer; nothing was read")
        total += ti.nbytes
    need = int(total * expand)
    free = available_memory() if memory is None else memory
    if free is not None and need > free:
        big = max(header.tensors.values(), key=lambda t: t.nbytes)
        raise error(f"{where}: reading its tensors needs about {need / 2**20:.0f} MiB but only {free / 2**20:.0f} MiB "
                    f"of memory is free (largest: key {big.name!r}, declared shape {list(big.shape)}); nothing was read")


def load_file(path: str | os.PathLike, device="cpu", keys=None) -> dict[str, torch.Tensor]:
    """Read (a subset of) a validated file into a dict."""
    with SafeFile(path) as f:
        names = f.keys() if keys is None else list(keys)
        return {k: f.get(k, device) for k in names}


def load_with_metadata(path, device="cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with SafeFile(path) as f:
        return {k: f.get(k, device) for k in f.keys()}, dict(f.metadata)


def save_file(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file (via the reference library; deterministic key order)."""
    from safetensors.torch import save_file as _save

    _save({k: v.contiguous() for k, v in sorted(tensors.items())}, os.fspath(path), metadata=metadata)


def header_bytes(inventory, metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header (8-byte length + JSON, space-padded to 8 bytes) for tensors laid out in
    ``inventory`` order: ``{key: (shape, safetensors dtype)}``."""
    obj: dict = {}
    if metadata:
        obj["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for k, (shape, dt) in inventory.items():
        if dt not in DTYPES:
            raise CheckpointError(f"cannot write tensor {k!r}: unknown safetensors dtype {dt!r}")
        n = DTYPES[dt][1]
        for s in shape:
            n *= int(s)
        obj[k] = {"dtype": dt, "shape": [int(s) for s in shape], "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def stream_chunks(inventory, items, metadata: dict[str, str] | None = None, where: str = "output"):
    """Bytes of a safetensors file, produced one tensor at a time: the header first (from ``inventory``), then
    each ``(key, tensor)`` of ``items``, which must come in ``inventory`` order with the declared shape and
    dtype (a mismatch raises before its bytes are written)."""
    yield header_bytes(inventory, metadata)
    keys = iter(inventory.items())
    for k, t in items:
        want = next(keys, None)
        if want is None or want[0] != k:
            raise CheckpointError(f"{where}: tensor {k!r} arrived where {want[0] if want else 'the end'!r} was "
                                  "laid out; the file is not written")
        shape, dt = want[1]
        if tuple(t.shape) != tuple(shape) or TORCH_TO_ST.get(t.dtype) != dt:
            raise CheckpointError(f"{where}: tensor {k!r} is {TORCH_TO_ST.get(t.dtype)} {list(t.shape)}, laid out as "
                                  f"{dt} {list(shape)}; the file is not written")
        yield t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    rest = next(keys, None)
    if rest is not None:
        raise CheckpointError(f"{where}: tensor {rest[0]!r} was laid out but never produced; the file is not written")
