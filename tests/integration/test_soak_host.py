"""A 20-prompt run of benchmarks/soak.py on a real host: valid example workflows reproduce their first-run outputs,
invalid prompts/files fail with the expected node errors, the server survives, RSS growth after warm-up < 10 %."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about 4 minutes on 2 cores; DITKIT_SLOW=1 runs it

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_20_prompts(comfyui_path, capsys):
    spec = importlib.util.spec_from_file_location("ditkit_soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    rc = soak.main(["--comfyui", str(comfyui_path), "-n", "20", "--seed", "1"])
    out = capsys.readouterr().out
    print(out)
    m = re.search(r"prompts ok / failed-as-expected / unexpected: (\d+) / (\d+) / (\d+)", out)
    assert m, out
    ok, failed_ok, unexpected = map(int, m.groups())
    assert unexpected == 0 and rc == 0, out
    assert ok + failed_ok == 20 and ok > 0 and failed_ok > 0, out
    assert "server alive: True" in out, out
