"""The one module through which ditkit writes files, and reads files a prompt names (server side).

Whoever can queue a prompt chooses names (``filename_prefix``, a calibration ``name``, a coefficient path), and
whoever can write into the output folder can plant symlinks there. Every write and every read of a user-named file
therefore follows these rules (docs/security.md, "Writes and reads"):

Writes
  1. names are validated (:func:`validate_name`): valid UTF-8, no NUL or other control characters, no separator
     where one bare name is expected, no ``.``/``..`` component, at most 255 bytes per component and 4096 in all;
  2. the allowed folder is resolved once (``realpath`` of the folder the host configured) and opened as a directory
     descriptor; every folder below it is created and opened relative to its parent's descriptor without following
     symlinks (``mkdir(dir_fd=)`` + ``open(O_DIRECTORY | O_NOFOLLOW)``): a symlinked component is refused;
  3. data goes to a temp name created ``O_CREAT | O_EXCL | O_NOFOLLOW`` in the target folder, is fsynced, and is
     published with ``renameat2(RENAME_NOREPLACE)`` (where the kernel or file system lacks it: ``link()`` +
     ``unlink()``, which gives the same guarantee), so an existing entry is never replaced. The only replacement
     is of a file ditkit wrote itself, proven by the caller's ``replace_if`` check on the opened file, swapped in
     with ``renameat2(RENAME_EXCHANGE)`` and verified by inode afterwards (a swap-in during the check is undone);
  4. on any failure the temp file (and a private temp folder) is removed.

  A library that insists on a path (PyAV) gets ``/proc/self/fd/<dir fd>/<name>`` inside a private folder created
  (mode 0700) by :meth:`SafeDir.private_dir`, so the path resolves through the opened descriptor, never through
  the names again; the finished file is published by rule 3.

Reads
  resolve and open once: the root is opened as a directory, each component below it with ``O_NOFOLLOW`` relative to
  its parent's descriptor, the file itself with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block the server), the
  opened descriptor must be a regular file within the size limit, and the bytes come from that descriptor only.

Platforms without ``dir_fd`` support (Windows) use the same steps on paths: each component is ``lstat``-checked
(no symlink / reparse point), files are created ``O_EXCL`` and published with ``os.rename`` (which never replaces
there). The window between a check and the use of a path remains on those platforms and is documented.

Plain Python: no torch, no ComfyUI. Errors are the caller's :class:`~ditkit.errors.DitKitError` subclass.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from typing import Callable, Iterable

from ..errors import DitKitError

MAX_COMPONENT_BYTES = 255
MAX_PATH_BYTES = 4096
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_BINARY = getattr(os, "O_BINARY", 0)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
TEMP_PREFIX = ".ditkit-tmp-"

# descriptor-relative operations (POSIX); elsewhere the documented path-based equivalent is used
HAVE_DIR_FD = (os.open in os.supports_dir_fd and os.mkdir in os.supports_dir_fd and os.stat in os.supports_dir_fd
               and os.unlink in os.supports_dir_fd and bool(O_NOFOLLOW) and bool(O_DIRECTORY))


# ------------------------------------------------------------------------------------------------ names

def _bad_char(ch: str) -> bool:
    o = ord(ch)
    return o < 32 or 0x7F <= o <= 0x9F or o in (0x2028, 0x2029) or 0xD800 <= o <= 0xDFFF


def validate_name(name, what: str, error: type[DitKitError] = DitKitError, *, allow_subdirs: bool = False,
                  max_component_bytes: int = MAX_COMPONENT_BYTES) -> list[str]:
    """Check a user-given file/folder name; returns its components (one unless ``allow_subdirs``).

    Refused: non-strings, empty names, NUL and other control characters (C0, DEL, C1, U+2028/9, lone surrogates),
    absolute paths, ``\\`` anywhere, ``/`` unless ``allow_subdirs``, empty / ``.`` / ``..`` components, a
    component over ``max_component_bytes`` UTF-8 bytes, more than 4096 bytes in all."""
    if not isinstance(name, str):
        raise error(f"{what} must be a string, got {type(name).__name__}")
    if not name:
        raise error(f"{what} is empty")
    bad = next((i for i, ch in enumerate(name) if _bad_char(ch)), None)
    if bad is not None:
        raise error(f"{what} contains the control character U+{ord(name[bad]):04X} at position {bad} "
                    "(NUL, line breaks and other control characters are refused in file names)")
    raw = name.encode("utf-8")
    if len(raw) > MAX_PATH_BYTES:
        raise error(f"{what} is {len(raw)} bytes long; the limit is {MAX_PATH_BYTES}")
    if "\\" in name:
        raise error(f"{what} contains '\\'; use '/' between folders" if allow_subdirs
                    else f"{what} contains '\\'; a plain file name is expected")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise error(f"{what} is an absolute path; a name relative to the output folder is expected")
    parts = name.split("/")
    if len(parts) > 1 and not allow_subdirs:
        raise error(f"{what} contains '/'; a plain file name is expected (no folders)")
    for p in parts:
        if p in ("", ".", ".."):
            raise error(f"{what} has an empty, '.' or '..' path component ({name!r}); folders below the output "
                        "folder only")
        n = len(p.encode("utf-8"))
        if n > max_component_bytes:
            raise error(f"{what}: the name part {p[:40]!r}... is {n} bytes long; file systems allow at most "
                        f"{max_component_bytes} bytes per name")
    return parts


# ------------------------------------------------------------------------------------------------ renameat2

_renameat2 = None
if HAVE_DIR_FD:
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _renameat2 = _libc.renameat2
        _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        _renameat2.restype = ctypes.c_int
    except (OSError, AttributeError):
        _renameat2 = None


def _rename2(src_fd: int, src: str, dst_fd: int, dst: str, flags: int) -> bool:
    """renameat2; True if done, False if unsupported here (ENOSYS / EINVAL from the file system)."""
    if _renameat2 is None:
        return False
    r = _renameat2(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), flags)
    if r == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return False
    raise OSError(e, os.strerror(e), dst)


# ------------------------------------------------------------------------------------------------ directories

class SafeDir:
    """An opened directory below a resolved root (POSIX: a descriptor; elsewhere: a checked path)."""

    def __init__(self, path: str, fd: int | None, error: type[DitKitError], what: str):
        self.path, self.fd, self.error, self.what = path, fd, error, what

    # -- opening
    @classmethod
    def open_root(cls, root: str | os.PathLike, parts: Iterable[str] = (), *, create: bool = False,
                  error: type[DitKitError] = DitKitError, what: str = "folder") -> "SafeDir":
        """``realpath(root)`` (the host-configured folder, resolved once), then ``parts`` below it without
        following symlinks (created with mode 0o777 & ~umask when ``create``)."""
        real = os.path.realpath(os.fspath(root))
        if create:
            try:                              # the configured folder itself (its path is the host's, not a prompt's)
                os.makedirs(real, exist_ok=True)
            except OSError as e:              # a regular file where a folder must be, no permission, no space
                raise error(f"{what} '{real}' cannot be created ({e.strerror}: "
                            f"'{e.filename if e.filename is not None else real}')") from None
        d = cls._open_abs(real, error, what)
        try:
            for p in parts:
                nxt = d.subdir(p, create=create)
                d.close()
                d = nxt
        except BaseException:
            d.close()
            raise
        return d

    @classmethod
    def _open_abs(cls, real: str, error, what) -> "SafeDir":
        if not HAVE_DIR_FD:
            if not os.path.isdir(real):
                raise error(f"{what} '{real}' does not exist or is not a folder")
            return cls(real, None, error, what)
        try:
            fd = os.open(real, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        except OSError as e:
            raise error(f"{what} '{real}' cannot be opened ({e.strerror})") from None
        return cls(real, fd, error, what)

    def _describe_non_dir(self, name: str) -> str:
        st = self.lstat(name)
        if st is None:
            return "does not exist"
        if stat.S_ISLNK(st.st_mode):
            return "is a symlink (ditkit does not follow symlinks inside its folders)"
        return "is not a folder"

    def subdir(self, name: str, create: bool = False) -> "SafeDir":
        """The folder ``name`` inside this one, opened without following a symlink (created if ``create``)."""
        path = os.path.join(self.path, name)
        if create:
            try:
                if self.fd is not None:
                    os.mkdir(name, 0o777, dir_fd=self.fd)
                else:
                    os.mkdir(path, 0o777)
            except FileExistsError:
                pass
            except OSError as e:
                raise self.error(f"{self.what}: cannot create the folder '{path}' ({e.strerror})") from None
        if self.fd is None:
            st = self.lstat(name)
            if st is None or not stat.S_ISDIR(st.st_mode) or _is_reparse(st):
                raise self.error(f"{self.what}: '{path}' {self._describe_non_dir(name)}")
            return SafeDir(path, None, self.error, self.what)
        try:
            fd = os.open(name, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                raise self.error(f"{self.what}: '{path}' {self._describe_non_dir(name)}") from None
            raise self.error(f"{self.what}: '{path}' cannot be opened ({e.strerror})") from None
        return SafeDir(path, fd, self.error, self.what)

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1  # closed: any later use fails (EBADF) instead of falling back to paths

    def __enter__(self) -> "SafeDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- entries
    def lstat(self, name: str) -> os.stat_result | None:
        try:
            if self.fd is not None:
                return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return os.lstat(os.path.join(self.path, name))
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None

    def listdir(self) -> list[str]:
        if self.fd is not None:
            return os.listdir(self.fd)
        return os.listdir(self.path)

    def unlink(self, name: str) -> None:
        try:
            if self.fd is not None:
                os.unlink(name, dir_fd=self.fd)
            else:
                os.unlink(os.path.join(self.path, name))
        except FileNotFoundError:
            pass

    def rmdir(self, name: str) -> None:
        try:
            if self.fd is not None:
                os.rmdir(name, dir_fd=self.fd)
            else:
                os.rmdir(os.path.join(self.path, name))
        except FileNotFoundError:
            pass

    def open_new(self, name: str, mode: int = 0o666) -> int:
        """Create ``name`` exclusively (never an existing file, never through a symlink); returns an fd (rw)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_BINARY
        if self.fd is not None:
            return os.open(name, flags, mode, dir_fd=self.fd)
        return os.open(os.path.join(self.path, name), flags, mode)

    def open_read(self, name: str) -> int:
        flags = os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_BINARY
        if self.fd is not None:
            return os.open(name, flags, dir_fd=self.fd)
        st = self.lstat(name)
        if st is not None and (stat.S_ISLNK(st.st_mode) or _is_reparse(st)):
            raise OSError(errno.ELOOP, "is a symlink", name)
        return os.open(os.path.join(self.path, name), flags)

    def fd_path(self, name: str) -> str:
        """A path that reaches ``name`` through this opened folder (``/proc/self/fd/N/name`` where available)."""
        if self.fd is not None and self.fd >= 0 and os.path.isdir(f"/proc/self/fd/{self.fd}"):
            return f"/proc/self/fd/{self.fd}/{name}"
        return os.path.join(self.path, name)

    # -- publishing
    def publish_noreplace(self, tmp: str, dst_dir: "SafeDir", name: str) -> None:
        """Move ``tmp`` (in this folder) to ``name`` in ``dst_dir``; FileExistsError if ``name`` exists."""
        if self.fd is not None and dst_dir.fd is not None:
            if _rename2(self.fd, tmp, dst_dir.fd, name, RENAME_NOREPLACE):
                return
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=dst_dir.fd, follow_symlinks=False)
            os.unlink(tmp, dir_fd=self.fd)
            return
        src, dst = os.path.join(self.path, tmp), os.path.join(dst_dir.path, name)
        if os.name == "nt":
            os.rename(src, dst)  # never replaces on Windows (FileExistsError)
            return
        os.link(src, dst, follow_symlinks=False)
        os.unlink(src)

    def exchange(self, tmp: str, name: str) -> bool:
        """Atomically swap ``tmp`` and ``name`` (both here). False where the system cannot."""
        if self.fd is None:
            return False
        return _rename2(self.fd, tmp, self.fd, name, RENAME_EXCHANGE)

    def replace(self, tmp: str, name: str) -> None:
        if self.fd is not None:
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        else:
            os.replace(os.path.join(self.path, tmp), os.path.join(self.path, name))

    def private_dir(self) -> "SafeDir":
        """A fresh folder (mode 0700, random name) inside this one, for a library that needs a path."""
        for _ in range(16):
            name = TEMP_PREFIX + secrets.token_hex(8)
            try:
                if self.fd is not None:
                    os.mkdir(name, 0o700, dir_fd=self.fd)
                else:
                    os.mkdir(os.path.join(self.path, name), 0o700)
            except FileExistsError:
                continue
            except OSError as e:
                raise self.error(f"cannot create a temp folder in '{self.path}' ({e.strerror})") from None
            d = self.subdir(name)
            d.parent, d.name = self, name
            return d
        raise self.error(f"cannot create a temp folder in '{self.path}'")

    def remove_private(self) -> None:
        """Remove a folder made by :meth:`private_dir` with what is left in it (plain files only)."""
        parent, name = getattr(self, "parent", None), getattr(self, "name", None)
        try:
            for n in self.listdir():
                self.unlink(n)
        except OSError:
            pass
        self.close()
        if parent is not None:
            try:
                parent.rmdir(name)
            except OSError:
                pass


def _is_reparse(st: os.stat_result) -> bool:
    return bool(getattr(st, "st_file_attributes", 0) & getattr(stat, "FILE_ATTRIBUTE_REPARSE_POINT", 0))


# ------------------------------------------------------------------------------------------------ writing

def _temp_name(name: str) -> str:
    return f"{TEMP_PREFIX}{secrets.token_hex(6)}-{name[:40]}.tmp"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.fsync(fd)


def write_new_temp(d: SafeDir, name: str, data: bytes) -> str:
    """Write ``data`` to a fresh temp file in ``d``; returns its name (the caller publishes or unlinks it)."""
    for _ in range(16):
        tmp = _temp_name(name)
        try:
            fd = d.open_new(tmp)
        except FileExistsError:
            continue
        try:
            _write_all(fd, data)
        except BaseException:
            os.close(fd)
            d.unlink(tmp)
            raise
        os.close(fd)
        return tmp
    raise d.error(f"cannot create a temp file in '{d.path}'")


def write_file(d: SafeDir, name: str, data: bytes, *,
               replace_if: Callable[[bytes], bool] | None = None, max_existing_bytes: int = 64 << 20) -> str:
    """Publish ``data`` as ``name`` in ``d`` (rules 3 and 4). An existing ``name`` is never replaced, unless
    ``replace_if`` accepts the existing regular file's bytes (read through an ``O_NOFOLLOW`` descriptor): then it
    is swapped atomically and the swapped-out file is checked to be that same file. Returns the full path."""
    validate_name(name, f"file name '{name}'", d.error)
    full = os.path.join(d.path, name)
    tmp = write_new_temp(d, name, data)
    try:
        try:
            d.publish_noreplace(tmp, d, name)
            return full
        except FileExistsError:
            if replace_if is None:
                raise d.error(f"'{full}' already exists; ditkit never replaces a file it did not write") from None
        old = _read_existing(d, name, max_existing_bytes)
        if old is None:
            raise d.error(f"'{full}' exists and is not a regular file (a folder, a symlink or a special file is in "
                          "the way); move it or choose another name")
        ino, blob = old
        if not replace_if(blob):
            raise d.error(f"'{full}' already exists and was not written by ditkit for this name; move it or choose "
                          "another name (ditkit never replaces a file it did not write)")
        if d.exchange(tmp, name):
            st = d.lstat(tmp)
            if st is None or (st.st_dev, st.st_ino) != ino:   # someone swapped the file in between: undo
                d.exchange(tmp, name)
                raise d.error(f"'{full}' changed while it was being replaced; nothing was replaced")
            d.unlink(tmp)
            return full
        d.replace(tmp, name)  # documented equivalent where RENAME_EXCHANGE is unavailable (check-then-rename)
        return full
    except BaseException:
        d.unlink(tmp)
        raise


def _write_chunk(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_stream(d: SafeDir, name: str, chunks: Iterable) -> str:
    """Publish the concatenated ``chunks`` (bytes-like, produced one at a time) as ``name`` in ``d``: rules 3 and
    4 for a file too large to hold in memory. ``name`` must not exist (checked first, and again by the
    no-replace publish); on any error (a chunk producer raising, ``ENOSPC``, ...) the temp file is removed and
    nothing is left under ``name``. Returns the full path."""
    validate_name(name, f"file name '{name}'", d.error)
    full = os.path.join(d.path, name)
    if d.lstat(name) is not None:
        raise d.error(f"'{full}' already exists; ditkit never replaces a file it did not write")
    for _ in range(16):
        tmp = _temp_name(name)
        try:
            fd = d.open_new(tmp)
        except FileExistsError:
            continue
        break
    else:
        raise d.error(f"cannot create a temp file in '{d.path}'")
    try:
        try:
            for c in chunks:
                _write_chunk(fd, c)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            d.publish_noreplace(tmp, d, name)
        except FileExistsError:
            raise d.error(f"'{full}' already exists; ditkit never replaces a file it did not write") from None
        return full
    except BaseException:
        d.unlink(tmp)
        raise


def _read_existing(d: SafeDir, name: str, limit: int) -> tuple[tuple[int, int], bytes] | None:
    try:
        fd = d.open_read(name)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return (st.st_dev, st.st_ino), read_fd(fd, limit)
    finally:
        os.close(fd)


def publish_path_file(src_dir: SafeDir, src_name: str, expect: tuple[int, int], dst: SafeDir, name: str) -> None:
    """Publish a file a library wrote at ``src_dir/src_name`` (by path) if it is still the regular file ditkit
    created there (``expect`` = its (dev, inode)); never replaces ``name``."""
    st = src_dir.lstat(src_name)
    if st is None or not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != expect:
        raise dst.error(f"the file written in '{src_dir.path}' is not the one ditkit created; not published")
    src_dir.publish_noreplace(src_name, dst, name)


# ------------------------------------------------------------------------------------------------ reading

def open_model_file(path: str) -> int:
    """A read-only descriptor of a model file (``loaders/safetensors_io.py``): opened once, non-blocking (a FIFO
    cannot block the server), never created. Symlinks ARE followed here: a model file is a name ComfyUI listed from
    a model folder, and a link placed there is the user's choice, as with the stock loaders; the caller checks the
    opened descriptor (``fstat``: a regular file) and reads only from it."""
    return os.open(path, os.O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_BINARY)


def read_user_file(path: str | os.PathLike, max_bytes: int, what: str,
                   error: type[DitKitError] = DitKitError) -> bytes:
    """Bytes of a file a user named (a contract, a sidecar, a config): opened ONCE (non-blocking, so a FIFO or
    device swapped in after any earlier look cannot stall the caller), the opened descriptor checked (``fstat``:
    a regular file of at most ``max_bytes``) and read; the name is never opened or stat-ed a second time.
    Errors: ``error`` naming ``what`` and the path."""
    path = os.fspath(path)
    try:
        fd = open_model_file(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise error(f"{what} '{path}': cannot be read ({getattr(e, 'strerror', None) or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} '{path}': not a regular file (a directory, FIFO or device is refused)")
        if st.st_size > max_bytes:
            raise error(f"{what} '{path}': {st.st_size} bytes, larger than {max_bytes} bytes")
        try:
            data = read_fd(fd, max_bytes)
        except OSError as e:
            raise error(f"{what} '{path}': cannot be read ({e.strerror or e})") from None
        if len(data) > max_bytes:
            raise error(f"{what} '{path}': larger than {max_bytes} bytes (it grew while being read)")
        return data
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while True:
        b = os.read(fd, min(1 << 20, limit + 1 - total))
        if not b:
            break
        chunks.append(b)
        total += len(b)
        if total > limit:
            break
    return b"".join(chunks)


def read_inside(root: str | os.PathLike, parts: Iterable[str], *, max_bytes: int, what: str,
                error: type[DitKitError] = DitKitError) -> tuple[bytes, os.stat_result]:
    """Bytes of the regular file ``root/parts...``, opened once without following any symlink below ``root``
    (``root`` itself is resolved once). The opened descriptor is checked (regular file, size <= ``max_bytes``)
    and read; nothing is opened by path afterwards."""
    parts = list(parts)
    if not parts:
        raise error(f"{what}: no file name")
    d = SafeDir.open_root(root, error=error, what=what)
    try:
        for p in parts[:-1]:
            nxt = d.subdir(p)
            d.close()
            d = nxt
        full = os.path.join(d.path, parts[-1])
        try:
            fd = d.open_read(parts[-1])
        except OSError as e:
            st = d.lstat(parts[-1])
            if e.errno == errno.ELOOP or (st is not None and stat.S_ISLNK(st.st_mode)):
                raise error(f"{what} '{full}' is a symlink; ditkit does not follow symlinks here") from None
            if e.errno == errno.ENOENT:
                raise error(f"{what} '{full}' cannot be read (no such file)") from None
            raise error(f"{what} '{full}' cannot be read ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{what} '{full}' is not a regular file")
            if st.st_size > max_bytes:
                raise error(f"{what} '{full}' is {st.st_size} bytes (> {max_bytes})")
            data = read_fd(fd, max_bytes)
            if len(data) > max_bytes:
                raise error(f"{what} '{full}' is larger than {max_bytes} bytes")
            return data, st
        finally:
            os.close(fd)
    finally:
        d.close()


def stat_inside(root: str | os.PathLike, parts: Iterable[str]) -> tuple[str, os.stat_result | None]:
    """``(kind, lstat)`` of ``root/parts...`` walked without following symlinks: kind is ``"file"``, ``"dir"``,
    ``"symlink"`` (the last or an intermediate component is a link), ``"other"`` or ``"missing"``."""
    parts = list(parts)
    try:
        d = SafeDir.open_root(root)
    except DitKitError:
        return "missing", None
    try:
        for p in parts[:-1]:
            st = d.lstat(p)
            if st is None:
                return "missing", None
            if stat.S_ISLNK(st.st_mode) or _is_reparse(st):
                return "symlink", st
            if not stat.S_ISDIR(st.st_mode):
                return "other", st
            try:
                nxt = d.subdir(p)
            except DitKitError:
                return "symlink", st   # replaced by a link in between
            d.close()
            d = nxt
        st = d.lstat(parts[-1]) if parts else os.stat(d.path)
        if st is None:
            return "missing", None
        if stat.S_ISLNK(st.st_mode) or _is_reparse(st):
            return "symlink", st
        if stat.S_ISREG(st.st_mode):
            return "file", st
        if stat.S_ISDIR(st.st_mode):
            return "dir", st
        return "other", st
    finally:
        d.close()
