"""benchmarks/_harness.py: ABAB interleave order, per-round ratio statistics, and rows that round-trip through both
file formats with the fixed schema (what the benchmark smoke tests read). No timing is asserted."""
from __future__ import annotations

import math

import pytest

from benchmarks import _harness as H


def test_interleave_runs_abab_after_warmup_and_keeps_results():
    calls = []
    kept = {}
    t = H.interleave({"A": lambda: calls.append("A") or "a", "B": lambda: calls.append("B") or "b"}, rounds=3,
                     warmup=2, keep=kept, walls=(walls := {}))
    assert calls == ["A", "B"] * 5  # 2 warm-up rounds, then 3 timed rounds, alternating
    assert len(t["A"]) == len(t["B"]) == len(walls["A"]) == 3 and kept == {"A": "a", "B": "b"}
    assert all(x >= 0 for x in t["A"] + t["B"])


def test_interleave_stops_at_the_deadline_after_two_rounds():
    t = H.interleave({"A": lambda: None}, rounds=50, warmup=0, deadline=-math.inf)
    assert len(t["A"]) == 2


def test_ratio_and_stats():
    r = H.ratio_stats([2.0, 9.0, 4.0], [1.0, 3.0, 1.0])
    assert (r["median"], r["min"], r["max"], r["rounds"]) == (3.0, 2.0, 4.0, 3)
    assert H.ratio_stats([1.0], [0.0])["rounds"] == 0
    s = H.stats([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert H.spread(r) == "(min-max 2.00-4.00, 3 rounds)"


def test_cpu_time_clock_ignores_sleep():
    import time

    dt, _ = H.Timer(cpu_time=True).once(lambda: time.sleep(0.05))
    wall, _ = H.Timer().once(lambda: time.sleep(0.05))
    assert wall >= 0.05 and dt < wall  # a sleeping process uses (almost) no CPU time


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_rows_round_trip(tmp_path, suffix):
    path = tmp_path / f"r{suffix}"
    rows = H.Rows(path, "bench_x")
    rows.add("case a", "count", 3)
    rows.add("case a", "time", 1.5, "ms", min=1.0, max=2.0, n=3, note="median")
    rows.add("case, b", "flag", True)
    rows.add("case, b", "psnr", math.inf, "dB")
    rows.add("case, b", "shape", [1, 2, 3])
    rows.add_stats("case, b", "ratio", H.ratio_stats([2.0, 4.0], [1.0, 1.0]), "x")
    got = H.RowSet.read(path)
    assert [tuple(r) for r in got.rows] == [H.FIELDS] * 6
    assert got.value("case a", "count") == 3 and got.value("case, b", "flag") is True
    assert got.value("case, b", "psnr") == math.inf
    r = got.row("case a", "time")
    assert (r["value"], r["unit"], r["min"], r["max"], r["n"], r["note"]) == (1.5, "ms", 1.0, 2.0, 3, "median")
    assert got.row("case, b", "ratio")["n"] == 2 and got.positive("case, b", "ratio") == 3.0
    assert got.cases() == ["case a", "case, b"]
    if suffix == ".jsonl":
        assert got.value("case, b", "shape") == [1, 2, 3]
    with pytest.raises(AssertionError, match="expected one row"):
        got.row("case a", "missing")
    with pytest.raises(AssertionError, match="positive finite"):
        got.positive("case, b", "psnr")


def test_rows_refuse_an_unknown_format(tmp_path):
    with pytest.raises(SystemExit, match="expected a .jsonl, .json or .csv"):
        H.Rows(tmp_path / "r.txt", "bench_x")
    assert H.Rows(None, "bench_x").add("c", "m", 1)["bench"] == "bench_x"  # no file: rows are only collected
