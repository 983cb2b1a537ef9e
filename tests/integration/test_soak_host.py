"""A 20-prompt run of benchmarks/soak.py on a real host: valid example workflows reproduce their first-run outputs,
invalid prompts/files fail with the expected node errors, the server survives, RSS growth after warm-up < 10 %.
Reads the script's data rows (``--rows``, ``benchmarks/_harness.py``), not its printed text."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks._harness import RowSet

pytestmark = pytest.mark.slow  # about 4 minutes on 2 cores; DITKIT_SLOW=1 runs it

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_20_prompts(comfyui_path, capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("ditkit_soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    rc = soak.main(["--comfyui", str(comfyui_path), "-n", "20", "--seed", "1", "--rows", str(tmp_path / "soak.csv")])
    out = capsys.readouterr().out
    print(out)
    rows = RowSet.read(tmp_path / "soak.csv")
    what = [r["note"] for r in rows.all(metric="what")]
    ok, failed_ok = rows.value("soak", "ok"), rows.value("soak", "failed_as_expected")
    assert rows.value("soak", "unexpected") == 0 and not what and rc == 0, what or out
    assert rows.value("soak", "prompts") == 20 and ok + failed_ok == 20 and ok > 0 and failed_ok > 0, out
    assert rows.value("soak", "server_alive") == 1, out
    assert rows.value("soak", "rss_growth") < 0.10, out
    assert rows.cases("s_per_run"), "warm-up rows missing"
