"""``ditkit.run --server URL --out DIR``: output names come from another process and must not write outside DIR,
follow a symlink, or replace a file that is already there."""
from __future__ import annotations

import os

import pytest

from ditkit import run


class FakeClient:
    def __init__(self):
        self.asked = []

    def get_bytes(self, path):
        self.asked.append(path)
        return b"payload:" + path.encode()


def _entry(*items):
    return {"outputs": {"9": {"images": list(items)}}}


def test_files_land_under_out_and_never_replace(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "a.png").write_bytes(b"mine")
    got = run.download_outputs(FakeClient(), _entry({"filename": "a.png", "subfolder": "sub", "type": "output"},
                                                    {"filename": "b.png", "subfolder": "", "type": "output"}),
                               out)
    assert (out / "sub" / "a.png").read_bytes() == b"mine"          # untouched
    assert got == [out / "sub" / "a_1.png", out / "b.png"]
    assert (out / "sub" / "a_1.png").read_bytes().startswith(b"payload:/view?")


@pytest.mark.parametrize("item", [
    {"filename": "x.png", "subfolder": "../escape"},
    {"filename": "x.png", "subfolder": "/abs"},
    {"filename": "../x.png", "subfolder": ""},
    {"filename": "a/x.png", "subfolder": ""},
    {"filename": "x.png\x00.txt", "subfolder": ""},
    {"filename": "x.png", "subfolder": "ok/\nbad"},
    {"filename": "x.png", "subfolder": ["list"]},
])
def test_hostile_names_are_refused_before_any_write(tmp_path, item):
    out = tmp_path / "out"
    client = FakeClient()
    with pytest.raises(run.RunnerError):
        run.download_outputs(client, _entry(item), out)
    assert client.asked == []
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out"]


def test_symlinked_subfolder_is_not_followed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, out / "link")
    with pytest.raises(run.RunnerError):
        run.download_outputs(FakeClient(), _entry({"filename": "x.png", "subfolder": "link"}), out)
    assert list(outside.iterdir()) == []
