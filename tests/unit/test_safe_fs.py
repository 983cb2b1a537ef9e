"""loaders/safe_fs.py: the one write path and the user-named-file reader (issue #17 item 8).

Each test plants what a hostile prompt or a co-tenant of the output folder could plant (NUL in a name, a symlink
where a file or folder goes, an existing file under the target name, a FIFO, a file swapped in during a replace)
and checks the outside world afterwards: the files outside the allowed folder and the files that existed before are
byte-identical, nothing leaked (no temp file left behind)."""
from __future__ import annotations

import os

import pytest

from ditkit.errors import CoefficientError, DitKitError
from ditkit.loaders import safe_fs
from ditkit.loaders.safe_fs import SafeDir, read_inside, validate_name, write_file

posix_only = pytest.mark.skipif(not safe_fs.HAVE_DIR_FD, reason="descriptor-relative file operations (POSIX)")


@pytest.mark.parametrize("name,word", [
    ("a\x00b", "U+0000"), ("a\nb", "U+000A"), ("tab\there", "U+0009"), ("del\x7f", "U+007F"), ("c1\x85", "U+0085"),
    ("ls\u2028x", "U+2028"), ("sur\udc80", "U+DC80"), ("", "empty"), ("..", "'..'"), (".", "'.'"),
    ("a/b", "'/'"), ("a\\b", "'\\'"), ("/etc/x", "absolute"), ("x" * 256, "256 bytes"), ("é" * 128, "256 bytes"),
])
def test_validate_name_refuses(name, word):
    with pytest.raises(DitKitError) as ei:
        validate_name(name, "input 'n'")
    assert word in str(ei.value) and "input 'n'" in str(ei.value)


def test_validate_name_accepts_and_splits():
    assert validate_name("x" * 255, "n") == ["x" * 255]
    assert validate_name("é" * 127, "n") == ["é" * 127]            # 254 bytes
    assert validate_name("video/sub/name", "n", allow_subdirs=True) == ["video", "sub", "name"]
    for bad in ("video//x", "video/../x", "./x", "x/"):
        with pytest.raises(DitKitError):
            validate_name(bad, "n", allow_subdirs=True)
    with pytest.raises(CoefficientError):  # the caller's error class
        validate_name("a\x00", "n", CoefficientError)


def _tree(p):
    return {str(q.relative_to(p)): (q.read_bytes() if q.is_file() and not q.is_symlink() else
                                    ("->" + os.readlink(q) if q.is_symlink() else "dir")) for q in sorted(p.rglob("*"))}


def test_write_file_publishes_and_never_replaces(tmp_path):
    with SafeDir.open_root(tmp_path, ["a", "b"], create=True) as d:
        assert write_file(d, "x.json", b"one") == str(tmp_path / "a" / "b" / "x.json")
        with pytest.raises(DitKitError, match="already exists"):
            write_file(d, "x.json", b"two")
        # replace_if sees the existing bytes; refusing keeps them
        with pytest.raises(DitKitError, match="not written by ditkit"):
            write_file(d, "x.json", b"two", replace_if=lambda old: False)
        assert (tmp_path / "a" / "b" / "x.json").read_bytes() == b"one"
        seen = []
        write_file(d, "x.json", b"three", replace_if=lambda old: seen.append(old) or True)
        assert seen == [b"one"] and (tmp_path / "a" / "b" / "x.json").read_bytes() == b"three"
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["x.json"]   # no temp file left behind


def test_write_file_refuses_bad_names_before_writing(tmp_path):
    with SafeDir.open_root(tmp_path) as d:
        for bad in ("x\x00.json", "../x.json", "a/b.json", "x" * 256):
            with pytest.raises(DitKitError):
                write_file(d, bad, b"data")
    assert os.listdir(tmp_path) == []


@posix_only
def test_symlink_at_the_target_name_is_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(outside, base / "x.json")
    os.symlink(tmp_path / "nowhere", base / "dangling.json")
    with SafeDir.open_root(base) as d:
        with pytest.raises(DitKitError, match="already exists"):
            write_file(d, "x.json", b"evil")
        with pytest.raises(DitKitError, match="not a regular file"):   # even when asked to replace
            write_file(d, "x.json", b"evil", replace_if=lambda old: True)
        with pytest.raises(DitKitError):
            write_file(d, "dangling.json", b"evil")
    assert outside.read_bytes() == b"precious" and not (tmp_path / "nowhere").exists()
    assert sorted(os.listdir(base)) == ["dangling.json", "x.json"]


@posix_only
def test_symlinked_folder_is_refused_when_creating_and_reading(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_bytes(b"{}")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "ditkit")
    before = _tree(outside)
    with pytest.raises(DitKitError, match="symlink"):
        SafeDir.open_root(root, ["ditkit", "teacache"], create=True)
    with pytest.raises(DitKitError, match="symlink"):
        read_inside(root, ["ditkit", "secret.json"], max_bytes=100, what="f")
    assert _tree(outside) == before
    # the root itself may be a link (the host's configuration): it is resolved once
    os.symlink(outside, tmp_path / "rootlink")
    data, st = read_inside(tmp_path / "rootlink", ["secret.json"], max_bytes=100, what="f")
    assert data == b"{}" and st.st_size == 2


@posix_only
def test_read_inside_checks_the_opened_file(tmp_path):
    (tmp_path / "big.json").write_bytes(b"x" * 101)
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "fifo.json")   # opening must not block the server
    os.symlink(tmp_path / "big.json", tmp_path / "link.json")
    with pytest.raises(DitKitError, match="101 bytes"):
        read_inside(tmp_path, ["big.json"], max_bytes=100, what="f")
    with pytest.raises(DitKitError, match="not a regular file"):
        read_inside(tmp_path, ["fifo.json"], max_bytes=100, what="f")
    with pytest.raises(DitKitError, match="not a regular file"):
        read_inside(tmp_path, ["d"], max_bytes=100, what="f")
    with pytest.raises(DitKitError, match="symlink"):
        read_inside(tmp_path, ["link.json"], max_bytes=1000, what="f")
    with pytest.raises(DitKitError, match="no such file"):
        read_inside(tmp_path, ["none.json"], max_bytes=1000, what="f")


@posix_only
def test_a_file_swapped_in_during_a_replace_is_not_replaced(tmp_path):
    """The check reads the existing file through its descriptor; if another file is put under the name between the
    check and the swap, the swap is undone and the intruder stays."""
    with SafeDir.open_root(tmp_path) as d:
        write_file(d, "c.json", b"mine")

        def check(old):
            os.rename(tmp_path / "c.json", tmp_path / "moved.json")
            (tmp_path / "c.json").write_bytes(b"someone else's")
            return True

        if safe_fs._renameat2 is None:
            pytest.skip("renameat2 unavailable: the documented check-then-rename equivalent is used")
        with pytest.raises(DitKitError, match="changed while"):
            write_file(d, "c.json", b"new", replace_if=check)
    assert (tmp_path / "c.json").read_bytes() == b"someone else's"
    assert sorted(os.listdir(tmp_path)) == ["c.json", "moved.json"]


def test_temp_file_is_removed_when_writing_fails(tmp_path, monkeypatch):
    def boom(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safe_fs, "_write_all", boom)
    with SafeDir.open_root(tmp_path) as d, pytest.raises(OSError, match="No space"):
        write_file(d, "x.json", b"data")
    assert os.listdir(tmp_path) == []


@posix_only
def test_private_dir_and_path_publish(tmp_path):
    (tmp_path / "v_00001_.mp4").write_bytes(b"old video")
    with SafeDir.open_root(tmp_path) as d:
        priv = d.private_dir()
        assert os.stat(priv.path).st_mode & 0o777 == 0o700
        fd = priv.open_new("video.mp4")
        st = os.fstat(fd)
        os.close(fd)
        with open(priv.fd_path("video.mp4"), "wb") as f:   # what PyAV does with the path it is given
            f.write(b"new video")
        with pytest.raises(FileExistsError):
            safe_fs.publish_path_file(priv, "video.mp4", (st.st_dev, st.st_ino), d, "v_00001_.mp4")
        # a file put in place of the one ditkit created is not published (the original is kept aside, so its
        # inode number cannot be reused by the intruder)
        os.rename(os.path.join(priv.path, "video.mp4"), os.path.join(priv.path, "kept"))
        (tmp_path / os.path.basename(priv.path) / "video.mp4").write_bytes(b"intruder")
        with pytest.raises(DitKitError, match="not the one ditkit created"):
            safe_fs.publish_path_file(priv, "video.mp4", (st.st_dev, st.st_ino), d, "v_00002_.mp4")
        priv.remove_private()
    assert sorted(os.listdir(tmp_path)) == ["v_00001_.mp4"]
    assert (tmp_path / "v_00001_.mp4").read_bytes() == b"old video"


def test_stat_inside_kinds(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    (tmp_path / "d").mkdir()
    assert safe_fs.stat_inside(tmp_path, ["f"])[0] == "file"
    assert safe_fs.stat_inside(tmp_path, ["d"])[0] == "dir"
    assert safe_fs.stat_inside(tmp_path, ["none"])[0] == "missing"
    assert safe_fs.stat_inside(tmp_path, ["none", "x"])[0] == "missing"
    assert safe_fs.stat_inside(tmp_path, ["f", "x"])[0] == "other"
    if safe_fs.HAVE_DIR_FD:
        os.symlink(tmp_path / "d", tmp_path / "l")
        assert safe_fs.stat_inside(tmp_path, ["l"])[0] == "symlink"
        assert safe_fs.stat_inside(tmp_path, ["l", "x"])[0] == "symlink"


@posix_only
def test_without_renameat2_link_unlink_gives_the_same_guarantee(tmp_path, monkeypatch):
    """Where the kernel / file system lacks renameat2, the no-replace publish is link() + unlink()."""
    monkeypatch.setattr(safe_fs, "_renameat2", None)
    (tmp_path / "taken.json").write_bytes(b"keep")
    with SafeDir.open_root(tmp_path) as d:
        write_file(d, "new.json", b"n")
        with pytest.raises(DitKitError, match="already exists"):
            write_file(d, "taken.json", b"x")
        write_file(d, "new.json", b"m", replace_if=lambda old: old == b"n")
    assert (tmp_path / "taken.json").read_bytes() == b"keep" and (tmp_path / "new.json").read_bytes() == b"m"
    assert sorted(os.listdir(tmp_path)) == ["new.json", "taken.json"]


# --- issue 29: a file planted at the exact temp name safe_fs is about to use --------------------------------------
# The temp names come from secrets.token_hex; the tests make it predictable so the attacker's file sits at exactly
# the name the writer tries first. The planted file must be neither written into nor published (nor removed), and
# the writer must go on to a fresh name; 16 names are tried (15 planted: still writes; 16: a clear refusal).

def _predictable_tokens(monkeypatch, tokens):
    it = iter(tokens)
    monkeypatch.setattr(safe_fs.secrets, "token_hex", lambda n: next(it))


def _plant(tmp_path, token, name, body=b"ATTACKER"):
    p = tmp_path / f"{safe_fs.TEMP_PREFIX}{token}-{name[:40]}.tmp"
    p.write_bytes(body)
    return p


@pytest.mark.parametrize("how", ["file", "stream"])
@pytest.mark.parametrize("planted", [1, 15])
def test_a_file_planted_at_the_temp_name_is_not_written_into_or_published(tmp_path, monkeypatch, how, planted):
    tokens = [f"{i:012x}" for i in range(planted)] + ["f" * 12]
    plants = [_plant(tmp_path, t, "out.bin") for t in tokens[:-1]]
    _predictable_tokens(monkeypatch, tokens)
    with SafeDir.open_root(tmp_path) as d:
        if how == "file":
            full = safe_fs.write_file(d, "out.bin", b"OURS")
        else:
            full = safe_fs.write_stream(d, "out.bin", [b"OU", b"RS"])
    assert full == str(tmp_path / "out.bin") and (tmp_path / "out.bin").read_bytes() == b"OURS"
    for p in plants:                                             # untouched, still there, not published
        assert p.read_bytes() == b"ATTACKER"
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted([p.name for p in plants] + ["out.bin"])


@pytest.mark.parametrize("how", ["file", "stream", "private_dir"])
def test_sixteen_planted_temp_names_refuse_and_leave_everything(tmp_path, monkeypatch, how):
    tokens = [f"{i:012x}" for i in range(16)] + ["f" * 12]      # a 17th would succeed: only 16 may be tried
    if how == "private_dir":
        tokens = [f"{i:016x}" for i in range(16)] + ["f" * 16]
        plants = [tmp_path / f"{safe_fs.TEMP_PREFIX}{t}" for t in tokens[:-1]]
        for p in plants:
            p.mkdir()
            (p / "keep").write_bytes(b"ATTACKER")
    else:
        plants = [_plant(tmp_path, t, "out.bin") for t in tokens[:-1]]
    _predictable_tokens(monkeypatch, tokens)
    with SafeDir.open_root(tmp_path) as d, pytest.raises(DitKitError, match="cannot create a temp"):
        if how == "file":
            safe_fs.write_file(d, "out.bin", b"OURS")
        elif how == "stream":
            safe_fs.write_stream(d, "out.bin", [b"OURS"])
        else:
            d.private_dir()
    assert not (tmp_path / "out.bin").exists()
    for p in plants:
        assert (p / "keep" if how == "private_dir" else p).read_bytes() == b"ATTACKER"
    assert len(list(tmp_path.iterdir())) == 16


def test_private_dir_skips_a_planted_folder(tmp_path, monkeypatch):
    planted = tmp_path / f"{safe_fs.TEMP_PREFIX}{'0' * 16}"
    planted.mkdir()
    (planted / "keep").write_bytes(b"ATTACKER")
    _predictable_tokens(monkeypatch, ["0" * 16, "1" * 16])
    with SafeDir.open_root(tmp_path) as d:
        p = d.private_dir()
        assert p.path == str(tmp_path / f"{safe_fs.TEMP_PREFIX}{'1' * 16}")
        assert stat_mode(tmp_path / f"{safe_fs.TEMP_PREFIX}{'1' * 16}") == 0o700
        p.remove_private()
    assert (planted / "keep").read_bytes() == b"ATTACKER"
    assert [x.name for x in tmp_path.iterdir()] == [planted.name]


def stat_mode(p):
    return os.stat(p).st_mode & 0o777


def test_temp_name_keeps_at_most_40_characters_of_the_name():
    t = safe_fs._temp_name("n" * 41)
    assert t.startswith(safe_fs.TEMP_PREFIX) and t.endswith("-" + "n" * 40 + ".tmp")
    assert len(t) == len(safe_fs.TEMP_PREFIX) + 12 + 1 + 40 + 4
    assert safe_fs._temp_name("n" * 40).endswith("-" + "n" * 40 + ".tmp")


# --- issue 29: every outcome of read_inside / stat_inside / subdir, with its exact message and stat --------------

def test_read_inside_size_bound_both_sides_and_nested_parts(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x" * 10)
    data, st = read_inside(tmp_path, ["a", "b", "f"], max_bytes=10, what="coefficients")
    assert data == b"x" * 10 and st.st_size == 10 and st.st_ino == os.stat(tmp_path / "a" / "b" / "f").st_ino
    with pytest.raises(DitKitError) as ei:
        read_inside(tmp_path, ["a", "b", "f"], max_bytes=9, what="coefficients")
    assert str(ei.value) == f"coefficients '{tmp_path / 'a' / 'b' / 'f'}' is 10 bytes (> 9)"


def test_read_inside_messages_name_what_and_the_full_path(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    (tmp_path / "d").mkdir()
    cases = [([], "coefficients: no file name"),
             (["none"], f"coefficients '{tmp_path / 'none'}' cannot be read (no such file)"),
             (["d"], f"coefficients '{tmp_path / 'd'}' is not a regular file"),
             (["none", "f"], f"coefficients: '{tmp_path / 'none'}' does not exist"),
             (["f", "x"], f"coefficients: '{tmp_path / 'f'}' is not a folder")]
    if safe_fs.HAVE_DIR_FD:
        os.symlink(tmp_path / "f", tmp_path / "lf")
        os.symlink(tmp_path / "d", tmp_path / "ld")
        cases += [(["lf"], f"coefficients '{tmp_path / 'lf'}' is a symlink; ditkit does not follow symlinks here"),
                  (["ld", "x"], f"coefficients: '{tmp_path / 'ld'}' is a symlink (ditkit does not follow symlinks "
                                "inside its folders)")]
    for parts, msg in cases:
        with pytest.raises(CoefficientError) as ei:
            read_inside(tmp_path, parts, max_bytes=100, what="coefficients", error=CoefficientError)
        assert str(ei.value) == msg, parts
    with pytest.raises(CoefficientError, match="^coefficients"):
        read_inside(tmp_path / "missing-root", ["f"], max_bytes=100, what="coefficients", error=CoefficientError)


@posix_only
def test_read_inside_a_fifo_is_not_read(tmp_path):
    os.mkfifo(tmp_path / "p")
    with pytest.raises(DitKitError, match="is not a regular file"):
        read_inside(tmp_path, ["p"], max_bytes=100, what="x")


def test_stat_inside_every_kind_with_its_stat(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "g").write_bytes(b"")
    kind, st = safe_fs.stat_inside(tmp_path, ["f"])
    assert kind == "file" and st.st_ino == os.lstat(tmp_path / "f").st_ino and st.st_size == 3
    kind, st = safe_fs.stat_inside(tmp_path, ["d", "g"])
    assert kind == "file" and st.st_ino == os.lstat(tmp_path / "d" / "g").st_ino
    kind, st = safe_fs.stat_inside(tmp_path, [])
    assert kind == "dir" and st.st_ino == os.stat(tmp_path).st_ino
    assert safe_fs.stat_inside(tmp_path / "missing-root", ["f"]) == ("missing", None)
    assert safe_fs.stat_inside(tmp_path, ["none"]) == ("missing", None)
    assert safe_fs.stat_inside(tmp_path, ["none", "x"]) == ("missing", None)
    kind, st = safe_fs.stat_inside(tmp_path, ["f", "x"])
    assert kind == "other" and st.st_ino == os.lstat(tmp_path / "f").st_ino
    if safe_fs.HAVE_DIR_FD:
        os.mkfifo(tmp_path / "p")
        kind, st = safe_fs.stat_inside(tmp_path, ["p"])
        assert kind == "other" and st.st_ino == os.lstat(tmp_path / "p").st_ino
        os.symlink(tmp_path / "d", tmp_path / "l")
        for parts in (["l"], ["l", "g"]):
            kind, st = safe_fs.stat_inside(tmp_path, parts)
            assert kind == "symlink" and st.st_ino == os.lstat(tmp_path / "l").st_ino, parts


def test_is_reparse_reads_the_windows_attribute(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(safe_fs.stat, "FILE_ATTRIBUTE_REPARSE_POINT", 0x400, raising=False)
    assert safe_fs._is_reparse(SimpleNamespace(st_file_attributes=0x400)) is True
    assert safe_fs._is_reparse(SimpleNamespace(st_file_attributes=0x420)) is True
    assert safe_fs._is_reparse(SimpleNamespace(st_file_attributes=0x20)) is False
    assert safe_fs._is_reparse(SimpleNamespace()) is False            # POSIX stat results have no attribute
