"""Every file a user names (the FastH3 contract, FastVideo's provenance.json, an H3 folder's index/config JSON) is
opened ONCE and checked on the opened descriptor (issue 29: the contract was checked, then opened in a second step
with a blocking open; a FIFO swapped in between stalled the queue).

Each reader is given a FIFO no one writes to: it must refuse it at once ("not a regular file"). A blocking open
would wait forever: the call runs in a thread, and the test opens the FIFO's write end afterwards so that a
blocked reader (main's) is released and the test fails instead of hanging.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ditkit.errors import CheckpointError, DitKitError, ScheduleError
from ditkit.loaders import h3 as H3
from ditkit.loaders import safe_fs
from ditkit.sampling import fasth3 as sched
from ditkit.sampling import fasth3_recipe as recipe

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def _call_on_fifo(fn, path: Path):
    os.mkfifo(path)
    out: dict = {}

    def run():
        try:
            out["value"] = fn(path)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5.0)
    blocked = t.is_alive()
    if blocked:  # release a reader stuck in open(): open the write end, close it (EOF)
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5.0)
    assert not blocked, f"{fn.__name__} blocked on a FIFO (opened by name with a blocking open)"
    return out


@pytest.mark.parametrize("fn, err", [
    (sched.load_contract, ScheduleError),
    (recipe.load_provenance, CheckpointError),
    (H3._read_json, CheckpointError),
])
def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path, fn, err):
    out = _call_on_fifo(fn, tmp_path / "fastvideo_inference.json")
    assert isinstance(out.get("error"), err), out
    assert "not a regular file" in str(out["error"])


def test_read_user_file_checks_the_descriptor_exactly_at_the_bound(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(b"x" * 64)
    assert safe_fs.read_user_file(p, 64, "thing") == b"x" * 64            # exactly max_bytes: read
    with pytest.raises(DitKitError, match=r"thing '.*c\.json': 64 bytes, larger than 63 bytes"):
        safe_fs.read_user_file(p, 63, "thing")
    with pytest.raises(ScheduleError, match="not a regular file"):
        safe_fs.read_user_file(tmp_path, 64, "thing", ScheduleError)      # a directory
    with pytest.raises(DitKitError, match="cannot be read"):
        safe_fs.read_user_file(tmp_path / "missing.json", 64, "thing")


def test_the_name_is_opened_once(tmp_path, monkeypatch):
    p = tmp_path / "fastvideo_inference.json"
    p.write_text("{}")
    opened = []
    real = os.open

    def counting(path, *a, **k):
        opened.append(os.fspath(path))
        return real(path, *a, **k)

    monkeypatch.setattr(safe_fs.os, "open", counting)
    with pytest.raises(ScheduleError):
        sched.load_contract(p)                      # {} is not a valid contract; the file was read once
    assert opened == [str(p)]
