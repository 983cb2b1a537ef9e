"""The safe reader opens a file once and checks the OPENED file: a regular file, header against its size, every
tensor read through the same handle. So a name that is (or later becomes) a symlink, a FIFO or a device cannot
make ditkit validate one file and read another, or wait forever on a FIFO."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from ditkit.errors import CheckpointError
from ditkit.loaders import safetensors_io as sio


def _save(path, value: float, n: int = 8):
    sio.save_file({"a": torch.full((n,), value), "b": torch.arange(n, dtype=torch.int64)}, str(path))


def test_tensors_come_from_the_file_whose_header_was_validated(tmp_path):
    p = tmp_path / "m.safetensors"
    _save(p, 1.0)
    f = sio.SafeFile(p)  # header validated here
    other = tmp_path / "other.safetensors"
    _save(other, 2.0)
    os.replace(other, p)  # the name now means another file with the same layout
    with f:
        assert torch.equal(f.get("a"), torch.full((8,), 1.0))
        assert torch.equal(f.get("b"), torch.arange(8))


def test_get_after_close_refuses_a_replaced_file(tmp_path):
    p = tmp_path / "m.safetensors"
    _save(p, 1.0)
    f = sio.SafeFile(p)
    f.close()
    assert torch.equal(f.get("a"), torch.full((8,), 1.0))  # same file: reopened
    other = tmp_path / "other.safetensors"
    _save(other, 2.0)
    os.replace(other, p)
    with pytest.raises(CheckpointError, match="changed since its header was validated"):
        f.get("a")


def test_symlink_is_followed_and_read_once(tmp_path):
    real = tmp_path / "real.safetensors"
    _save(real, 3.0)
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    assert torch.equal(sio.load_file(link)["a"], torch.full((8,), 3.0))
    assert sorted(sio.read_header(link).keys()) == ["a", "b"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    errors = []

    def probe():
        for fn in (sio.read_header, sio.SafeFile):
            try:
                fn(fifo)
            except CheckpointError as e:
                errors.append(str(e))

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(60)  # a blocking open() would never return: no writer ever comes
    assert not t.is_alive(), "opening a FIFO blocked"
    assert len(errors) == 2 and all("not a regular file" in e for e in errors), errors


@pytest.mark.parametrize("kind", ["dir", "dev"])
def test_directories_and_devices_are_refused(tmp_path, kind):
    path = tmp_path if kind == "dir" else "/dev/zero"
    if kind == "dev" and not os.path.exists(path):
        pytest.skip("no /dev/zero")
    with pytest.raises(CheckpointError, match="cannot read"):
        sio.read_header(path)


def test_nul_byte_in_name(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        sio.read_header(str(tmp_path / "a\x00b.safetensors"))
