"""The benchmarks' shared harness: ABAB timing with medians and min-max ratios, memory probes, and rows.

* Timing: :func:`interleave` runs A, B, (C) in turn for ``rounds`` rounds after a warm-up (drift and neighbours
  hit every variant alike); :func:`stats` gives median / min / max of one variant's times and :func:`ratio_stats`
  the per-round ratio A/B (median, min, max), so one run prints a ratio and its spread. :class:`Timer` measures
  one call with CUDA events, the wall clock (with a synchronize on CUDA) or the process CPU time.
* Memory: :func:`peak_rss_kib` (``VmHWM``, the per-process high-water mark: fresh after exec, so measure in a
  child), :func:`rss_bytes` and :class:`PeakRSS` (a sampling thread, for a delta inside one process),
  :class:`CudaMem` (peak device bytes a call adds; None without CUDA).
* Rows: every figure a script prints is also a row of one fixed schema (:data:`FIELDS`), written with
  ``--rows FILE`` as JSON lines (``.jsonl``/``.json``) or CSV (``.csv``) next to the human table on stdout. The
  smoke tests read the rows (:func:`read_rows`, :class:`RowSet`) instead of parsing the prose.

Plain Python at import time (torch is imported only by the CUDA helpers), so ``gpu_check.py --dry-run`` can use it.
"""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

# one row per figure: which script, which case (model, mode, geometry...), which metric, its value and unit; for
# a repeated measurement value is the median and min/max/n say how it spread
FIELDS = ("bench", "case", "metric", "value", "unit", "min", "max", "n", "note")


# ------------------------------------------------------------------------------------------------ timing
class Timer:
    """Seconds of one call. On a CUDA ``device``: CUDA events around the call (after a synchronize), or with
    ``wall=True`` the wall clock between two synchronizes (host work is part of what is timed). Elsewhere the wall
    clock, or with ``cpu_time=True`` this process's CPU time (``time.process_time``: on a shared box the wall clock
    mostly measures the neighbours)."""

    def __init__(self, device=None, cpu_time: bool = False):
        self.cuda = getattr(device, "type", device) == "cuda"
        self.cpu_time = cpu_time and not self.cuda
        self.torch = None
        self.last_wall = math.nan  # wall seconds of the last call (whatever the clock)
        if self.cuda:
            import torch

            self.torch = torch

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any], wall: bool = False) -> tuple[float, Any]:
        if self.cuda and not wall:
            self.sync()
            s, e = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn()
            e.record()
            e.synchronize()
            self.last_wall = s.elapsed_time(e) / 1e3
            return self.last_wall, out
        self.sync()
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        self.sync()
        c, self.last_wall = time.process_time() - c, time.perf_counter() - t
        return (c if self.cpu_time else self.last_wall), out


def interleave(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1, timer: Timer | None = None,
               deadline: float = math.inf, wall: bool = False, keep: dict | None = None,
               walls: dict | None = None) -> dict[str, list[float]]:
    """Warm up every fn ``warmup`` times, then ``rounds`` rounds of A, B, (C) in turn (ABAB...):
    ``{name: [seconds per round]}``. Stops early (after at least 2 rounds) once ``time.perf_counter()`` passes
    ``deadline``. With ``keep`` (a dict), the last result of each fn is stored there under its name; with
    ``walls`` (a dict), the wall seconds of each round too (when the timer's clock is CPU time)."""
    timer = timer or Timer()
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(max(rounds, 1)):
        if r >= 2 and time.perf_counter() > deadline:
            break
        for k, f in fns.items():
            dt, out = timer.once(f, wall)
            if keep is not None:
                keep[k] = out
            if walls is not None:
                walls.setdefault(k, []).append(timer.last_wall)
            del out
            times[k].append(dt)
    return times


def stats(times: Iterable[float]) -> dict:
    """median, min, max and count of one variant's times."""
    t = list(times)
    if not t:
        return dict(median=math.nan, min=math.nan, max=math.nan, n=0)
    return dict(median=statistics.median(t), min=min(t), max=max(t), n=len(t))


def ratio_stats(num: Iterable[float], den: Iterable[float]) -> dict:
    """The per-round ratio num/den (rounds paired as interleaved): median, min, max, rounds."""
    r = [a / b for a, b in zip(num, den) if b > 0]
    if not r:
        return dict(median=math.nan, min=math.nan, max=math.nan, rounds=0)
    return dict(median=statistics.median(r), min=min(r), max=max(r), rounds=len(r))


def spread(r: dict) -> str:
    """``"(min-max a-b, n rounds)"`` for a :func:`ratio_stats` / :func:`stats` result, for the printed table."""
    n = r.get("rounds", r.get("n"))
    return f"(min-max {r['min']:.2f}-{r['max']:.2f}, {n} round{'s' if n != 1 else ''})"


# ------------------------------------------------------------------------------------------------ memory
def peak_rss_kib() -> int:
    """This process's peak resident set (``VmHWM``, KiB; Linux). Per address space and fresh after exec, unlike
    ``ru_maxrss``: measure a mode in a child process and read it before and after."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``; Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest :func:`rss_bytes` seen while the ``with`` block runs (sampled every ``interval`` seconds)."""

    def __init__(self, interval: float = 0.002):
        self.peak = rss_bytes()
        self.interval = interval
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


class CudaMem:
    """Peak device bytes a call adds on top of what was allocated before it (CUDA only; None elsewhere)."""

    def __init__(self, device):
        self.device = device
        self.cuda = getattr(device, "type", device) == "cuda"
        self.torch = None
        if self.cuda:
            import torch

            self.torch = torch

    def allocated(self):
        if not self.cuda:
            return None
        self.torch.cuda.synchronize(self.device)
        return self.torch.cuda.memory_allocated(self.device)

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, int | None]:
        if not self.cuda:
            return fn(), None
        t = self.torch
        t.cuda.synchronize(self.device)
        base = t.cuda.memory_allocated(self.device)
        t.cuda.reset_peak_memory_stats(self.device)
        out = fn()
        t.cuda.synchronize(self.device)
        return out, t.cuda.max_memory_allocated(self.device) - base


# ------------------------------------------------------------------------------------------------ rows
def _plain(v: Any) -> Any:
    """JSON-safe value: numbers stay numbers (nan/inf as the strings "nan"/"inf"/"-inf"), tuples become lists."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if hasattr(v, "item") and callable(v.item):  # a 0-d tensor / numpy scalar
        return _plain(v.item())
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


class Rows:
    """Collects rows (:data:`FIELDS`) and, with a path, writes them there: JSON lines for ``.jsonl`` / ``.json``,
    CSV (header first) for ``.csv``. Each row is written as it is added (a crash keeps what was measured)."""

    def __init__(self, path: str | os.PathLike | None, bench: str):
        self.bench = bench
        self.rows: list[dict] = []
        self.path = Path(path) if path else None
        self.fmt = None
        if self.path is not None:
            suffix = self.path.suffix.lower()
            if suffix not in (".jsonl", ".json", ".csv"):
                raise SystemExit(f"--rows {str(self.path)!r}: expected a .jsonl, .json or .csv file name")
            self.fmt = "csv" if suffix == ".csv" else "jsonl"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", encoding="utf-8", newline="") as f:
                if self.fmt == "csv":
                    csv.writer(f).writerow(FIELDS)

    def add(self, case: str, metric: str, value: Any, unit: str = "", *, min: Any = None, max: Any = None,
            n: int | None = None, note: str = "") -> dict:
        row = dict(bench=self.bench, case=str(case), metric=str(metric), value=_plain(value), unit=unit,
                   min=_plain(min), max=_plain(max), n=n, note=note)
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8", newline="") as f:
                if self.fmt == "csv":
                    csv.writer(f).writerow(["" if row[k] is None else row[k] for k in FIELDS])
                else:
                    f.write(json.dumps(row) + "\n")
        return row

    def add_stats(self, case: str, metric: str, s: dict, unit: str = "", scale: float = 1.0, note: str = "") -> dict:
        """A :func:`stats` / :func:`ratio_stats` result as one row (median as the value), times ``scale``."""
        return self.add(case, metric, s["median"] * scale, unit, min=s["min"] * scale, max=s["max"] * scale,
                        n=s.get("rounds", s.get("n")), note=note)


def add_rows_argument(ap) -> None:
    """``--rows FILE`` on a script's argument parser."""
    ap.add_argument("--rows", metavar="FILE", help="also write every figure as a row (bench, case, metric, value, "
                                                   "unit, min, max, n, note): .jsonl JSON lines or .csv")


def _number(v: Any) -> Any:
    if isinstance(v, str):
        if v in ("nan", "inf", "-inf"):
            return float(v)
        if v in ("True", "False"):
            return v == "True"
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    return v


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows a script wrote (either format), values as numbers where they are numbers."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".csv":
        rows = [{k: (None if v == "" else v) for k, v in r.items()} for r in csv.DictReader(text.splitlines())]
        for r in rows:
            for k in ("value", "min", "max", "n"):
                r[k] = _number(r[k])
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        for r in rows:
            for k in ("value", "min", "max"):
                if r[k] in ("nan", "inf", "-inf"):
                    r[k] = float(r[k])
    for r in rows:
        if tuple(r) != FIELDS:
            raise ValueError(f"{path}: row with fields {tuple(r)}, expected {FIELDS}")
    return rows


class RowSet:
    """Rows looked up by (case, metric); a missing or repeated row is an AssertionError naming what exists."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    @classmethod
    def read(cls, path) -> "RowSet":
        return cls(read_rows(path))

    def cases(self, metric: str | None = None) -> list[str]:
        seen: list[str] = []
        for r in self.rows:
            if (metric is None or r["metric"] == metric) and r["case"] not in seen:
                seen.append(r["case"])
        return seen

    def all(self, case: str | None = None, metric: str | None = None) -> list[dict]:
        return [r for r in self.rows if (case is None or r["case"] == case) and (metric is None or r["metric"] == metric)]

    def row(self, case: str, metric: str) -> dict:
        hit = self.all(case, metric)
        assert len(hit) == 1, (f"expected one row ({case!r}, {metric!r}), found {len(hit)}; rows: "
                               f"{[(r['case'], r['metric']) for r in self.rows][:80]}")
        return hit[0]

    def value(self, case: str, metric: str) -> Any:
        return self.row(case, metric)["value"]

    def positive(self, case: str, metric: str) -> float:
        """The value, asserted to be a finite number > 0."""
        v = self.value(case, metric)
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0, \
            f"({case!r}, {metric!r}) = {v!r}: expected a positive finite number"
        return float(v)
