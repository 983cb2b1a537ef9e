"""``python -m ditkit.host check --contract`` without running a host (the real host: tests/integration/
test_host_contract.py): the table format, the exit codes, and host.py staying standard-library only."""
from __future__ import annotations

import subprocess
import sys

from ditkit import host
from tests.support.pack_scan import REPO_ROOT

DATA = {"host_version": "0.99.0", "rows": [
    {"symbol": "comfy.a.B", "what": "signature", "state": "holds", "note": "", "nodes": ["DitKitX"], "doc": ""},
    {"symbol": "comfy.c.D", "what": "behaviour", "state": "broken", "note": "differs", "nodes": ["DitKitY", "DitKitZ"],
     "doc": ""},
    {"symbol": "comfy.e", "what": "feature", "state": "adapted", "note": "0.38 layout", "nodes": ["DitKitX"],
     "doc": ""}]}


def test_format_contract_lists_broken_then_adapted_then_holding():
    out = host.format_contract(DATA, "/x").splitlines()
    assert out[0] == ("ditkit host contract on ComfyUI 0.99.0 at /x: 3 entries, 1 hold, 1 adapted, 1 broken")
    states = [ln.split()[0] for ln in out[2:] if ln.split()[0] in ("holds", "adapted", "broken")]
    assert states == ["broken", "adapted", "holds"]
    broken = out.index(next(ln for ln in out if ln.startswith("broken")))
    assert "comfy.c.D" in out[broken] and "DitKitY, DitKitZ" in out[broken] and out[broken + 1].strip() == "differs"


def test_check_contract_exit_codes(monkeypatch, tmp_path, capsys):
    (tmp_path / "main.py").write_text("")
    monkeypatch.setattr(host, "probe_contract", lambda root, python, pack=None: DATA)
    assert host.main(["check", "--contract", "--comfyui", str(tmp_path)]) == 1      # an entry is broken
    assert "1 broken" in capsys.readouterr().out
    ok = {"host_version": "0.33.0", "rows": [r for r in DATA["rows"] if r["state"] != "broken"]}
    monkeypatch.setattr(host, "probe_contract", lambda root, python, pack=None: ok)
    assert host.main(["check", "--contract", "--comfyui", str(tmp_path)]) == 0
    assert host.main(["check", "--contract", "--comfyui", str(tmp_path / "nope")]) == 2   # not a ComfyUI


def test_probe_failure_is_a_host_error(tmp_path, capsys):
    (tmp_path / "main.py").write_text("")
    rc = host.main(["check", "--contract", "--comfyui", str(tmp_path)])   # no comfy package there: the child fails
    assert rc == 2
    assert "the host contract probe failed" in capsys.readouterr().err


def test_host_py_imports_only_the_standard_library():
    code = ("import sys\nbefore = set(sys.modules)\n"
            f"sys.path.insert(0, {str(REPO_ROOT)!r})\nimport host\nassert host.CONTRACT_CHILD\n"
            "bad = sorted(x for x in set(sys.modules) - before if x.split('.')[0] in "
            "('torch', 'comfy', 'ditkit', 'numpy', 'safetensors'))\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
