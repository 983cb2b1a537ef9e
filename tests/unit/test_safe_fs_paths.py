"""loaders/safe_fs.py, written from the survivors of its mutation run (issue 29): every operation goes through the
opened descriptor, not the name (the folder is renamed under an open SafeDir and everything still lands in it); the
path-based fallback (platforms without ``dir_fd``: ``HAVE_DIR_FD`` False, a SafeDir with ``fd=None``) exercised on
its own; short reads and writes; the modes of the folders made; the errors' wording and class."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from types import SimpleNamespace

import pytest

from ditkit.errors import CoefficientError, DitKitError
from ditkit.loaders import safe_fs
from ditkit.loaders.safe_fs import SafeDir

posix_only = pytest.mark.skipif(not safe_fs.HAVE_DIR_FD, reason="descriptor-relative file operations (POSIX)")


class MyError(DitKitError):
    pass


@pytest.fixture(params=["fd", "path"])
def mode(request, monkeypatch):
    """Both implementations: descriptors (POSIX) and checked paths (the fallback), on this machine."""
    if request.param == "fd" and not safe_fs.HAVE_DIR_FD:
        pytest.skip("descriptor-relative file operations (POSIX)")
    if request.param == "path":
        monkeypatch.setattr(safe_fs, "HAVE_DIR_FD", False)
    return request.param


@pytest.fixture()
def umask022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


# ---- opening and subdir, both implementations
def test_open_root_creates_and_opens_each_part(tmp_path, mode, umask022, monkeypatch):
    monkeypatch.chdir(tmp_path / ".." if mode == "fd" else "/")      # a relative path would land elsewhere
    with SafeDir.open_root(tmp_path / "root", ["a", "b"], create=True, error=MyError, what="thing") as d:
        assert d.path == os.path.join(os.path.realpath(tmp_path / "root"), "a", "b")
        assert (d.fd is None) is (mode == "path")
        if mode == "fd":
            assert d.fd >= 0 and os.path.samestat(os.fstat(d.fd), os.stat(d.path))
        assert d.error is MyError and d.what == "thing"
        assert _mode(tmp_path / "root" / "a") == 0o755 and _mode(tmp_path / "root" / "a" / "b") == 0o755
        sub = d.subdir("c", create=True)
        assert sub.path == os.path.join(d.path, "c") and sub.error is MyError and sub.what == "thing"
        assert (sub.fd is None) is (mode == "path") and _mode(tmp_path / "root" / "a" / "b" / "c") == 0o755
        again = d.subdir("c", create=True)                          # an existing folder is opened, not an error
        assert again.path == sub.path
        sub.close()
        again.close()


def test_subdir_refusals_name_what_and_path(tmp_path, mode):
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path, tmp_path / "link")
    with SafeDir.open_root(tmp_path, error=MyError, what="the outputs") as d:
        for name, why in (("missing", "does not exist"), ("file", "is not a folder"), ("link", "is a symlink")):
            with pytest.raises(MyError, match=re.escape(f"the outputs: '{tmp_path / name}' {why}")):
                d.subdir(name)
        with pytest.raises(MyError, match=re.escape(f"the outputs: cannot create the folder '{tmp_path / ('n' * 300)}'"
                                                    " (File name too long)")):
            d.subdir("n" * 300, create=True)
    bad = SafeDir(str(tmp_path / "file"), None, MyError, "w")              # a "folder" that is a file: mkdir fails
    with pytest.raises(MyError, match=r"w: cannot create the folder .* \(Not a directory\)"):
        bad.subdir("x", create=True)


@posix_only
def test_subdir_other_open_error_is_named(tmp_path):
    with SafeDir.open_root(tmp_path, error=MyError, what="w") as d:
        with pytest.raises(MyError, match=re.escape(f"w: '{tmp_path / ('n' * 300)}' cannot be opened "
                                                    "(File name too long)")):
            d.subdir("n" * 300)


@posix_only
def test_a_renamed_folder_is_still_the_one_written(tmp_path, umask022):
    """An open SafeDir keeps working on the folder it opened, whatever happens to its name."""
    (tmp_path / "a").mkdir()
    d = SafeDir.open_root(tmp_path / "a")
    os.rename(tmp_path / "a", tmp_path / "b")
    (tmp_path / "a").mkdir()                                          # someone else's folder under the old name
    try:
        sub = d.subdir("x", create=True)
        assert (tmp_path / "b" / "x").is_dir() and not (tmp_path / "a" / "x").exists()
        sub.close()
        (tmp_path / "b" / "f").write_bytes(b"1")
        (tmp_path / "b" / "g").write_bytes(b"2")
        assert sorted(d.listdir()) == ["f", "g", "x"]
        d.unlink("f")
        d.rmdir("x")
        assert sorted(os.listdir(tmp_path / "b")) == ["g"]
        d.replace("g", "h")
        assert sorted(os.listdir(tmp_path / "b")) == ["h"]
        priv = d.private_dir()
        assert os.path.dirname(os.readlink(f"/proc/self/fd/{priv.fd}")) == str(tmp_path / "b")
        priv.remove_private()
        assert os.listdir(tmp_path / "a") == [] and sorted(os.listdir(tmp_path / "b")) == ["h"]
    finally:
        d.close()


def test_entries_through_the_fallback(tmp_path, mode, monkeypatch):
    monkeypatch.chdir("/")
    with SafeDir.open_root(tmp_path) as d:
        (tmp_path / "f").write_bytes(b"1")
        (tmp_path / "e").mkdir()
        assert sorted(d.listdir()) == ["e", "f"]
        d.unlink("f")
        d.unlink("f")                                                 # already gone: no error
        d.rmdir("e")
        d.rmdir("e")
        assert d.listdir() == []
        (tmp_path / "t").write_bytes(b"new")
        (tmp_path / "n").write_bytes(b"old")
        d.replace("t", "n")
        assert os.listdir(tmp_path) == ["n"] and (tmp_path / "n").read_bytes() == b"new"
        os.symlink(tmp_path / "n", tmp_path / "l")
        with pytest.raises(OSError) as e:
            d.open_read("l")
        assert e.value.errno == errno.ELOOP
        fd = d.open_read("n")
        assert os.read(fd, 10) == b"new"
        os.close(fd)


def test_fd_path(tmp_path, mode):
    d = SafeDir.open_root(tmp_path)
    if mode == "fd":
        assert d.fd_path("x") == f"/proc/self/fd/{d.fd}/x"
    else:
        assert d.fd_path("x") == os.path.join(str(tmp_path), "x")
    d.close()
    assert d.fd_path("x") == os.path.join(str(tmp_path), "x")           # closed: never a stale descriptor number


@posix_only
def test_fd_path_with_descriptor_zero(tmp_path):
    """Descriptor 0 is a valid descriptor (a server started with stdin closed reuses it)."""
    saved = os.dup(0)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.dup2(dfd, 0)
        d = SafeDir(str(tmp_path / "elsewhere"), 0, DitKitError, "w")
        assert d.fd_path("x") == "/proc/self/fd/0/x"
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(dfd)


def test_private_dir(tmp_path, mode, umask022):
    with SafeDir.open_root(tmp_path, error=MyError) as d:
        priv = d.private_dir()
        name = os.path.basename(priv.path)
        assert re.fullmatch(re.escape(safe_fs.TEMP_PREFIX) + "[0-9a-f]{16}", name)
        assert priv.name == name and priv.parent is d and priv.error is MyError
        assert _mode(tmp_path / name) == 0o700 and (priv.fd is None) is (mode == "path")
        (tmp_path / name / "a").write_bytes(b"x")
        (tmp_path / name / "b").write_bytes(b"y")
        priv.remove_private()
        assert os.listdir(tmp_path) == []
    gone = SafeDir(str(tmp_path / "gone"), None, MyError, "w")
    with pytest.raises(MyError, match=re.escape(f"cannot create a temp folder in '{tmp_path / 'gone'}' (No such file")):
        gone.private_dir()


def test_remove_private_of_a_plain_folder_keeps_the_folder(tmp_path, mode):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    d = SafeDir.open_root(tmp_path / "d")
    d.remove_private()                                                # no parent: emptied and closed, not removed
    assert (tmp_path / "d").is_dir() and os.listdir(tmp_path / "d") == []


# ---- writing through the fallback
def test_write_file_through_the_fallback(tmp_path, mode, monkeypatch):
    monkeypatch.chdir("/")
    with SafeDir.open_root(tmp_path, ["out"], create=True, error=MyError) as d:
        assert safe_fs.write_file(d, "x.json", b"one") == str(tmp_path / "out" / "x.json")
        with pytest.raises(MyError, match="already exists"):
            safe_fs.write_file(d, "x.json", b"two")
        assert d.exchange("a", "b") is False if mode == "path" else True
        safe_fs.write_file(d, "x.json", b"three", replace_if=lambda old: old == b"one")
        assert (tmp_path / "out" / "x.json").read_bytes() == b"three"
        assert safe_fs.write_stream(d, "s.bin", [b"ab", bytearray(b"cd"), memoryview(b"ef")]) == \
            str(tmp_path / "out" / "s.bin")
        assert (tmp_path / "out" / "s.bin").read_bytes() == b"abcdef"
        assert sorted(os.listdir(tmp_path / "out")) == ["s.bin", "x.json"]
        assert safe_fs.read_inside(tmp_path, ["out", "s.bin"], max_bytes=6, what="w")[0] == b"abcdef"
        assert safe_fs.stat_inside(tmp_path, ["out", "s.bin"])[0] == "file"


def test_short_writes_are_continued(tmp_path, monkeypatch):
    real = os.write
    monkeypatch.setattr(safe_fs.os, "write", lambda fd, b: real(fd, bytes(b[:3])))
    data = bytes(range(50))
    with SafeDir.open_root(tmp_path) as d:
        safe_fs.write_file(d, "a.bin", data)
        safe_fs.write_stream(d, "b.bin", [data[:20], data[20:]])
    assert (tmp_path / "a.bin").read_bytes() == data and (tmp_path / "b.bin").read_bytes() == data


def test_write_stream_name_and_existing_target(tmp_path):
    with SafeDir.open_root(tmp_path, error=MyError) as d:
        with pytest.raises(MyError, match="file name 'a/b'"):
            safe_fs.write_stream(d, "a/b", [b"x"])
        (tmp_path / "x.bin").write_bytes(b"keep")
        with pytest.raises(MyError, match=re.escape(f"'{tmp_path / 'x.bin'}' already exists; ditkit never replaces")):
            safe_fs.write_stream(d, "x.bin", [b"x"])

        def planting():                                               # the name appears while the data streams
            yield b"abc"
            (tmp_path / "late.bin").write_bytes(b"theirs")
            yield b"def"

        with pytest.raises(MyError, match=re.escape(f"'{tmp_path / 'late.bin'}' already exists")):
            safe_fs.write_stream(d, "late.bin", planting())
        assert (tmp_path / "late.bin").read_bytes() == b"theirs"

        def failing():
            yield b"abc"
            raise RuntimeError("producer failed")

        with pytest.raises(RuntimeError, match="producer failed"):
            safe_fs.write_stream(d, "y.bin", failing())
    assert sorted(os.listdir(tmp_path)) == ["late.bin", "x.bin"]         # no temp file left behind


def test_replace_reads_the_existing_file_up_to_its_limit(tmp_path):
    with SafeDir.open_root(tmp_path, error=MyError) as d:
        (tmp_path / "x.json").write_bytes(b"12345")
        safe_fs.write_file(d, "x.json", b"new", replace_if=lambda old: old == b"12345", max_existing_bytes=5)
        assert (tmp_path / "x.json").read_bytes() == b"new"
        (tmp_path / "y.json").write_bytes(b"123456")
        with pytest.raises(MyError, match="is not a regular file"):
            safe_fs.write_file(d, "y.json", b"new", replace_if=lambda old: True, max_existing_bytes=5)
        (tmp_path / "z.json").mkdir()
        with pytest.raises(MyError, match="is not a regular file"):
            safe_fs.write_file(d, "z.json", b"new", replace_if=lambda old: True)
        if hasattr(os, "mkfifo"):
            os.mkfifo(tmp_path / "p.json")
            with pytest.raises(MyError, match="is not a regular file"):
                safe_fs.write_file(d, "p.json", b"new", replace_if=lambda old: True)
    assert (tmp_path / "y.json").read_bytes() == b"123456"
    assert sorted(os.listdir(tmp_path)) == sorted(["x.json", "y.json", "z.json"] +
                                                  (["p.json"] if hasattr(os, "mkfifo") else []))


@posix_only
def test_publish_path_file_refuses_a_folder(tmp_path):
    with SafeDir.open_root(tmp_path, error=MyError) as d:
        (tmp_path / "sub").mkdir()
        st = os.lstat(tmp_path / "sub")
        with pytest.raises(MyError, match="not the one ditkit created"):
            safe_fs.publish_path_file(d, "sub", (st.st_dev, st.st_ino), d, "out")
        with pytest.raises(MyError, match="not the one ditkit created"):
            safe_fs.publish_path_file(d, "missing", (st.st_dev, st.st_ino), d, "out")
    assert os.listdir(tmp_path) == ["sub"]


# ---- reading
@posix_only
def test_open_model_file_flags(tmp_path):
    (tmp_path / "m").write_bytes(b"x")
    fd = safe_fs.open_model_file(str(tmp_path / "m"))
    try:
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert fl & os.O_NONBLOCK and fl & os.O_ACCMODE == os.O_RDONLY
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)


@pytest.mark.parametrize("size,limit,want", [(0, 0, 0), (9, 9, 9), (10, 9, 10), (50, 9, 10), (8, 9, 8),
                                             (50, 0, 1), (7, 100, 7)])
def test_read_fd_with_short_reads(tmp_path, monkeypatch, size, limit, want):
    data = bytes((i * 7) % 256 for i in range(size))
    (tmp_path / "f").write_bytes(data)
    real = os.read
    asked = []

    def short(fd, n):
        asked.append(n)
        return real(fd, min(n, 3))

    monkeypatch.setattr(safe_fs.os, "read", short)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = safe_fs.read_fd(fd, limit)
    finally:
        os.close(fd)
    assert got == data[:want]                                     # at most limit + 1 bytes: "over the limit" is seen
    assert all(0 < n <= limit + 1 for n in asked)


def test_read_inside_errors_for_other_failures(tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(b"x")
    os.symlink(tmp_path / "f", tmp_path / "l")

    def fail(errno_):
        def open_read(self, name):
            raise OSError(errno_, os.strerror(errno_), name)
        return open_read

    monkeypatch.setattr(SafeDir, "open_read", fail(errno.EMLINK))     # FreeBSD's errno for O_NOFOLLOW on a link
    with pytest.raises(MyError, match=re.escape(f"w '{tmp_path / 'l'}' is a symlink")):
        safe_fs.read_inside(tmp_path, ["l"], max_bytes=9, what="w", error=MyError)
    with pytest.raises(MyError, match=re.escape(f"w '{tmp_path / 'f'}' cannot be read (Too many links)")):
        safe_fs.read_inside(tmp_path, ["f"], max_bytes=9, what="w", error=MyError)
    monkeypatch.setattr(SafeDir, "open_read", fail(errno.EIO))
    with pytest.raises(MyError, match=re.escape(f"w '{tmp_path / 'f'}' cannot be read (Input/output error)")):
        safe_fs.read_inside(tmp_path, ["f"], max_bytes=9, what="w", error=MyError)


def test_read_inside_a_file_that_grew_while_read(tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(b"abc")
    monkeypatch.setattr(safe_fs, "read_fd", lambda fd, limit: b"z" * (limit + 1))
    with pytest.raises(CoefficientError, match=re.escape(f"w '{tmp_path / 'f'}' is larger than 5 bytes")):
        safe_fs.read_inside(tmp_path, ["f"], max_bytes=5, what="w", error=CoefficientError)


# ---- stat_inside: a reparse point (Windows junction) and a component replaced between lstat and open
def _fake_lstat(reparse_name):
    real = SafeDir.lstat

    def lstat(self, name):
        st = real(self, name)
        if name == reparse_name and st is not None:
            return SimpleNamespace(st_mode=st.st_mode, st_file_attributes=stat.FILE_ATTRIBUTE_REPARSE_POINT)
        return st
    return lstat


def test_stat_inside_sees_a_reparse_point(tmp_path, monkeypatch):
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "f").write_bytes(b"")
    monkeypatch.setattr(SafeDir, "lstat", _fake_lstat("j"))
    assert safe_fs.stat_inside(tmp_path, ["j", "f"])[0] == "symlink"
    assert safe_fs.stat_inside(tmp_path, ["j"])[0] == "symlink"


def test_stat_inside_a_folder_replaced_before_it_is_opened(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"")

    def subdir(self, name, create=False):
        raise DitKitError("replaced by a link")

    monkeypatch.setattr(SafeDir, "subdir", subdir)
    kind, st = safe_fs.stat_inside(tmp_path, ["d", "f"])
    assert kind == "symlink" and stat.S_ISDIR(st.st_mode)


# ---- read_user_file: every refusal names what and the path, in the caller's class
def test_read_user_file_refusals(tmp_path, monkeypatch):
    p = tmp_path / "c.json"
    p.write_bytes(b"abc")
    assert safe_fs.read_user_file(str(p), 3, "thing", MyError) == b"abc"
    with pytest.raises(MyError, match=re.escape(f"thing '{p}': 3 bytes, larger than 2 bytes")):
        safe_fs.read_user_file(p, 2, "thing", MyError)
    with pytest.raises(MyError, match=re.escape(f"thing '{tmp_path / 'none'}': cannot be read (No such file")):
        safe_fs.read_user_file(tmp_path / "none", 9, "thing", MyError)
    with pytest.raises(MyError, match=re.escape("thing 'a\x00b': cannot be read (")):
        safe_fs.read_user_file("a\x00b", 9, "thing", MyError)           # a NUL in the name: ValueError, named
    with pytest.raises(MyError, match=re.escape(f"thing '{tmp_path}': not a regular file")):
        safe_fs.read_user_file(tmp_path, 9, "thing", MyError)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")                                   # must not block: refused on the descriptor
        with pytest.raises(MyError, match="not a regular file"):
            safe_fs.read_user_file(tmp_path / "fifo", 9, "thing", MyError)
    monkeypatch.setattr(safe_fs, "read_fd", lambda fd, limit: b"z" * (limit + 1))
    with pytest.raises(MyError, match=re.escape(f"thing '{p}': larger than 5 bytes (it grew while being read)")):
        safe_fs.read_user_file(p, 5, "thing", MyError)

    def eio(fd, limit):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(safe_fs, "read_fd", eio)
    with pytest.raises(MyError, match=re.escape(f"thing '{p}': cannot be read (Input/output error)")):
        safe_fs.read_user_file(p, 5, "thing", MyError)
    with pytest.raises(DitKitError, match="cannot be read"):
        safe_fs.read_user_file(p, 5, "thing")                           # the default class


# ---- names: every boundary of the refused character ranges, every message
@pytest.mark.parametrize("o,bad", [(0, True), (31, True), (32, False), (0x7E, False), (0x7F, True), (0x9F, True),
                                   (0xA0, False), (0x2027, False), (0x2028, True), (0x2029, True), (0x202A, False),
                                   (0xD7FF, False), (0xD800, True), (0xDFFF, True), (0xE000, False)])
def test_bad_char_ranges(o, bad):
    assert safe_fs._bad_char(chr(o)) is bad
    name = "ab" + chr(o) + "c"
    if bad:
        with pytest.raises(MyError, match=re.escape(f"input 'n' contains the control character U+{o:04X} at "
                                                    "position 2 (NUL, line breaks and other control characters "
                                                    "are refused in file names)")):
            safe_fs.validate_name(name, "input 'n'", MyError)
    else:
        assert safe_fs.validate_name(name, "input 'n'", MyError) == [name]


def test_validate_name_messages():
    def refused(name, msg, **kw):
        with pytest.raises(MyError) as e:
            safe_fs.validate_name(name, "input 'n'", MyError, **kw)
        assert str(e.value) == msg
    refused(3, "input 'n' must be a string, got int")
    refused(b"x", "input 'n' must be a string, got bytes")
    refused("", "input 'n' is empty")
    refused("a\\b", "input 'n' contains '\\'; a plain file name is expected")
    refused("a\\b", "input 'n' contains '\\'; use '/' between folders", allow_subdirs=True)
    refused("/a", "input 'n' is an absolute path; a name relative to the output folder is expected")
    refused("C:", "input 'n' is an absolute path; a name relative to the output folder is expected")
    refused("C:x", "input 'n' is an absolute path; a name relative to the output folder is expected")
    refused("a/b", "input 'n' contains '/'; a plain file name is expected (no folders)")
    refused("a/../b", "input 'n' has an empty, '.' or '..' path component ('a/../b'); folders below the output "
                      "folder only", allow_subdirs=True)
    long = "x" * 50
    refused(long, f"input 'n': the name part {long[:40]!r}... is 50 bytes long; file systems allow at most 49 bytes "
                  "per name", max_component_bytes=49)
    assert safe_fs.validate_name(long, "n", max_component_bytes=50) == [long]
    assert safe_fs.validate_name("C", "n") == ["C"] and safe_fs.validate_name("ab:", "n") == ["ab:"]


def test_validate_name_total_length_boundary():
    exact = "/".join(["y" * 200] * 20) + "/" + "w" * 76                # 20 * 201 + 76 = 4096 bytes
    assert len(exact.encode()) == 4096
    assert safe_fs.validate_name(exact, "n", allow_subdirs=True)[-1] == "w" * 76
    with pytest.raises(MyError, match=re.escape("input 'n' is 4097 bytes long; the limit is 4096")):
        safe_fs.validate_name(exact + "z", "input 'n'", MyError, allow_subdirs=True)
    with pytest.raises(MyError, match="4097 bytes long"):                  # counted in UTF-8 bytes, not characters
        safe_fs.validate_name(exact[:-1] + "é", "input 'n'", MyError, allow_subdirs=True)


def test_write_file_name_and_existing_messages(tmp_path):
    with SafeDir.open_root(tmp_path, error=MyError) as d:
        with pytest.raises(MyError, match=re.escape("file name 'a/b' contains '/'")):
            safe_fs.write_file(d, "a/b", b"x")
        (tmp_path / "dir").mkdir()
        with pytest.raises(MyError) as e:
            safe_fs.write_file(d, "dir", b"x", replace_if=lambda old: True)
        assert str(e.value) == (f"'{tmp_path / 'dir'}' exists and is not a regular file (a folder, a symlink or a "
                                "special file is in the way); move it or choose another name")
        (tmp_path / "f").write_bytes(b"mine")
        with pytest.raises(MyError) as e:
            safe_fs.write_file(d, "f", b"x", replace_if=lambda old: False)
        assert str(e.value) == (f"'{tmp_path / 'f'}' already exists and was not written by ditkit for this name; "
                                "move it or choose another name (ditkit never replaces a file it did not write)")
    assert sorted(os.listdir(tmp_path)) == ["dir", "f"]


# ---- renameat2: which errors mean "unsupported here"
def _fake_renameat2(rc, err, calls):
    import ctypes

    def fn(sfd, src, dfd, dst, flags):
        calls.append((sfd, src, dfd, dst, flags))
        ctypes.set_errno(err)
        return rc
    return fn


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP])
def test_rename2_unsupported_means_false(monkeypatch, err):
    calls = []
    monkeypatch.setattr(safe_fs, "_renameat2", _fake_renameat2(-1, err, calls))
    assert safe_fs._rename2(3, "a", 4, "bé", 2) is False
    assert calls == [(3, b"a", 4, "bé".encode(), 2)]


@pytest.mark.parametrize("err", [errno.EEXIST, errno.EACCES, errno.EXDEV])
def test_rename2_other_errors_raise(monkeypatch, err):
    monkeypatch.setattr(safe_fs, "_renameat2", _fake_renameat2(-1, err, []))
    with pytest.raises(OSError) as e:
        safe_fs._rename2(3, "a", 4, "dst-name", 1)
    assert e.value.errno == err and e.value.strerror == os.strerror(err) and e.value.filename == "dst-name"
    monkeypatch.setattr(safe_fs, "_renameat2", _fake_renameat2(0, err, []))
    assert safe_fs._rename2(3, "a", 4, "b", 1) is True


@posix_only
def test_rename2_real_noreplace(tmp_path):
    if safe_fs._renameat2 is None:
        pytest.skip("no renameat2 in this C library")
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    with SafeDir.open_root(tmp_path) as d:
        try:
            done = safe_fs._rename2(d.fd, "a", d.fd, "b", safe_fs.RENAME_NOREPLACE)
        except FileExistsError as e:
            assert e.filename == "b"
        else:
            assert done is False                                      # a file system without it
    assert (tmp_path / "b").read_bytes() == b"b"


# ---- opening, closing, lstat, open_new in both implementations
def test_open_root_refusals(tmp_path, mode):
    (tmp_path / "file").write_bytes(b"x")
    for target in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(MyError) as e:
            SafeDir.open_root(target, error=MyError, what="the folder")
        msg = str(e.value)
        if mode == "path":
            assert msg == f"the folder '{target}' does not exist or is not a folder"
        else:
            assert msg.startswith(f"the folder '{target}' cannot be opened (") and msg.endswith(")")
            assert ("No such file" in msg) if target.name == "missing" else ("Not a directory" in msg)


def test_open_root_create_refuses_a_file_in_the_way_by_name(tmp_path, mode):
    """create=True where a regular file stands in the path: the caller's error naming the folder and the file in
    the way (was: a bare NotADirectoryError / FileExistsError), and nothing is created or changed."""
    (tmp_path / "afile").write_bytes(b"x")
    for target, culprit, why in ((tmp_path / "afile", tmp_path / "afile", "File exists"),
                                 (tmp_path / "afile" / "sub", tmp_path / "afile" / "sub", "Not a directory")):
        with pytest.raises(MyError) as e:
            SafeDir.open_root(target, create=True, error=MyError, what="the folder")
        assert str(e.value) == f"the folder '{target}' cannot be created ({why}: '{culprit}')"
        assert type(e.value) is MyError and e.value.__cause__ is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_bytes() == b"x"


def test_open_root_create_names_the_folder_when_the_error_has_no_file_name(tmp_path, mode, monkeypatch):
    def full(path, exist_ok=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safe_fs.os, "makedirs", full)
    with pytest.raises(MyError) as e:
        SafeDir.open_root(tmp_path / "new", create=True, error=MyError, what="the folder")
    assert str(e.value) == f"the folder '{tmp_path / 'new'}' cannot be created (No space left on device: " \
                           f"'{tmp_path / 'new'}')"


def test_close(tmp_path, mode):
    d = SafeDir.open_root(tmp_path)
    fd = d.fd
    d.close()
    d.close()                                                         # twice: nothing
    if mode == "fd":
        assert d.fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)                                              # the descriptor really was closed
    else:
        assert d.fd is None
    with SafeDir.open_root(tmp_path) as e:
        kept = e.fd
    assert e.fd == (-1 if mode == "fd" else None) and (kept is None) is (mode == "path")


def test_lstat(tmp_path, mode, monkeypatch):
    monkeypatch.chdir("/")
    (tmp_path / "f").write_bytes(b"abc")
    os.symlink(tmp_path / "f", tmp_path / "l")
    with SafeDir.open_root(tmp_path) as d:
        assert d.lstat("f").st_size == 3 and stat.S_ISREG(d.lstat("f").st_mode)
        assert stat.S_ISLNK(d.lstat("l").st_mode)                     # the link itself, not followed
        assert d.lstat("missing") is None
        assert d.lstat("f/x") is None                                 # a file used as a folder: NotADirectoryError


def test_open_new_modes(tmp_path, mode, umask022):
    with SafeDir.open_root(tmp_path) as d:
        os.close(d.open_new("a"))
        os.close(d.open_new("b", 0o600))
        assert _mode(tmp_path / "a") == 0o644 and _mode(tmp_path / "b") == 0o600
        with pytest.raises(FileExistsError):
            d.open_new("a")
        os.symlink(tmp_path / "target", tmp_path / "l")
        with pytest.raises(FileExistsError):
            d.open_new("l")                                           # never created through a link
    assert not (tmp_path / "target").exists()


# ---- round 2 of the survivors: links are published as links, mixed implementations, Windows' rename, fd 0
@pytest.mark.parametrize("renameat2", [True, False])
def test_publish_noreplace_moves_a_link_as_a_link(tmp_path, mode, monkeypatch, renameat2):
    if not renameat2:
        monkeypatch.setattr(safe_fs, "_renameat2", None)               # the link() + unlink() publish
    (tmp_path / "target").write_bytes(b"t")
    os.symlink(tmp_path / "target", tmp_path / "tmp-link")
    with SafeDir.open_root(tmp_path) as d:
        d.publish_noreplace("tmp-link", d, "out")
    assert os.path.islink(tmp_path / "out") and not os.path.lexists(tmp_path / "tmp-link")
    assert os.readlink(tmp_path / "out") == str(tmp_path / "target")


@posix_only
@pytest.mark.parametrize("src_fd,dst_fd", [(True, False), (False, True), (True, True)])
def test_publish_noreplace_between_a_descriptor_and_a_path(tmp_path, src_fd, dst_fd):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "t").write_bytes(b"data")
    src = SafeDir.open_root(tmp_path / "a") if src_fd else SafeDir(str(tmp_path / "a"), None, DitKitError, "w")
    dst = SafeDir.open_root(tmp_path / "b") if dst_fd else SafeDir(str(tmp_path / "b"), None, DitKitError, "w")
    try:
        if src_fd and dst_fd:                                          # both descriptors: names are not used
            os.rename(tmp_path / "a", tmp_path / "a2")
            os.rename(tmp_path / "b", tmp_path / "b2")
            src.publish_noreplace("t", dst, "out")
            assert (tmp_path / "b2" / "out").read_bytes() == b"data"
        else:
            src.publish_noreplace("t", dst, "out")
            assert (tmp_path / "b" / "out").read_bytes() == b"data" and not (tmp_path / "a" / "t").exists()
    finally:
        src.close()
        dst.close()


def test_publish_noreplace_on_windows_renames(tmp_path, monkeypatch):
    calls = []

    class NtOs:                       # safe_fs's view of os only: the process's os.name stays (pytest needs it)
        name = "nt"

        @staticmethod
        def rename(a, b):
            calls.append((a, b))

        def __getattr__(self, k):
            return getattr(os, k)

    monkeypatch.setattr(safe_fs, "os", NtOs())
    d = SafeDir(str(tmp_path), None, DitKitError, "w")
    d.publish_noreplace("t", d, "out")
    assert calls == [(os.path.join(str(tmp_path), "t"), os.path.join(str(tmp_path), "out"))]


def test_open_read_fallback_refuses_links_and_reparse_points_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_fs, "HAVE_DIR_FD", False)
    (tmp_path / "f").write_bytes(b"x")
    os.symlink(tmp_path / "f", tmp_path / "l")
    d = SafeDir.open_root(tmp_path)
    with pytest.raises(OSError) as e:
        d.open_read("l")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.ELOOP, "is a symlink", "l")
    monkeypatch.setattr(SafeDir, "lstat", _fake_lstat("f"))          # a Windows junction / reparse point
    with pytest.raises(OSError) as e:
        d.open_read("f")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.ELOOP, "is a symlink", "f")
    (tmp_path / "j").mkdir()
    monkeypatch.setattr(SafeDir, "lstat", _fake_lstat("j"))
    with pytest.raises(DitKitError, match="is not a folder"):
        d.subdir("j")


def test_open_root_default_what(tmp_path):
    with pytest.raises(DitKitError, match=re.escape(f"folder '{tmp_path / 'missing'}'")):
        SafeDir.open_root(tmp_path / "missing")


@posix_only
def test_close_closes_descriptor_zero(tmp_path):
    saved = os.dup(0)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.dup2(dfd, 0)
        os.close(dfd)
        d = SafeDir(str(tmp_path), 0, DitKitError, "w")
        d.close()
        assert d.fd == -1
        with pytest.raises(OSError):
            os.fstat(0)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
