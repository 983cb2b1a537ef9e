"""TeaCache calibration: record (input change, output change) pairs during full-compute runs, fit polynomials.

Recording (:class:`CalibrationRecorder`): for every model call and every condition, the hook hands over
the modulated input of block 0 and the block-stack output, per stream. Between consecutive calls of the
same condition this yields one pair ``(x, y)`` = (rel-L1 of the modulated input, rel-L1 of the block-stack
output). One sampling run is saved as one *pair file* (JSON, ``format`` ``ditkit.teacache.pairs``).

Fitting (:func:`fit_pairs`, :func:`fit_files`): all pair files with the same family are pooled; per stream
``numpy.polyfit(x, y, degree)`` (degree 4 default) with R², RMSE and max residual, the fitted ``x_range``
and counts (runs, distinct prompts, pairs, step counts). The fingerprint written is the one shared by the
runs (fields that differ between runs are written as null and listed in ``calibration.mixed``). A fit that is
negative inside its x range (it would rescale a change to a negative distance and skip steps that changed) is
never written: :func:`fit_non_negative` takes the highest lower degree whose fit is not, and says so in the
stream's ``fit`` (``degree_requested``, ``degree_lowered_because``); if none is, the fit fails loudly.

Files are written and read through ``loaders/safe_fs.py`` (no-replace publish, no symlink followed).

CLI::

    python -m ditkit.cache.calibrate OUT.json PAIRS.json [PAIRS.json ...] [--degree 4] [--min-prompts 3]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import errno
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch

from .. import __version__
from ..errors import CoefficientError
from ..loaders.safe_fs import SafeDir, read_fd, read_inside, write_file
from .. import strict_json
from .coefficients import FAMILY_STREAMS, CoefficientFile, StreamCoefficients, polynomial_negative, save
from .teacache import rel_l1

PAIRS_FORMAT = "ditkit.teacache.pairs"
PAIRS_VERSION = 1
MAX_PAIRS_BYTES = 64 * 1024 * 1024


@dataclass
class _Prev:
    inp: dict[str, torch.Tensor] = field(default_factory=dict)
    out: dict[str, torch.Tensor] = field(default_factory=dict)
    x: dict[str, float] = field(default_factory=dict)


class CalibrationRecorder:
    """Collects pairs of one sampling run (all calls compute). Not thread safe; one per sampling."""

    def __init__(self, family: str):
        if family not in FAMILY_STREAMS:
            raise ValueError(f"unknown family {family!r}")
        self.family = family
        self.sigmas: list[float] = []
        self.prev: dict[Hashable, _Prev] = {}
        self.pairs: dict[str, list[list[float]]] = {s: [] for s in FAMILY_STREAMS[family]}
        self.prompt_ids: list[str] = []
        self.calls = 0
        self._pending: tuple | None = None
        self._key_index: dict[Hashable, int] = {}
        # optional ``on_step(pairs_so_far, step, steps)``, called once per sampling step after its outputs are
        # recorded (the node uses it to show live progress; the core never talks to the UI itself)
        self.on_step = None
        self._notified_step = -1

    def begin(self, sigmas: Sequence[float]) -> None:
        self.sigmas = [float(s) for s in sigmas]
        self.prev.clear()
        self.pairs = {s: [] for s in FAMILY_STREAMS[self.family]}
        self.calls = 0
        self._key_index.clear()
        self._notified_step = -1

    def add_prompt_id(self, pid: str) -> None:
        if pid not in self.prompt_ids:
            self.prompt_ids.append(pid)

    def _step(self, sigma: float) -> int:
        best = 0
        for i, s in enumerate(self.sigmas[:-1]):
            if s >= sigma - 1e-7:
                best = i
        return best

    def record_inputs(self, keys: Sequence[Hashable], sigma: float, mods: dict[str, list[torch.Tensor]]) -> None:
        self.calls += 1
        for ci, k in enumerate(keys):
            self._key_index.setdefault(k, len(self._key_index))
            p = self.prev.setdefault(k, _Prev())
            for s, lst in mods.items():
                cur = lst[ci].detach()
                if s in p.inp and p.inp[s].shape == cur.shape:
                    p.x[s] = rel_l1(cur, p.inp[s])
                else:
                    p.x.pop(s, None)
                p.inp[s] = cur.clone()
        self._pending = (list(keys), float(sigma))

    def record_outputs(self, outs: dict[str, list[torch.Tensor]]) -> None:
        if self._pending is None:
            return
        keys, sigma = self._pending
        self._pending = None
        step = self._step(sigma)
        for ci, k in enumerate(keys):
            p = self.prev[k]
            for s, lst in outs.items():
                cur = lst[ci].detach()
                prev = p.out.get(s)
                if prev is not None and prev.shape == cur.shape and s in p.x:
                    y = rel_l1(cur, prev)
                    self.pairs.setdefault(s, []).append([p.x[s], y, step, round(sigma, 6), self._key_index[k]])
                p.out[s] = cur.clone()
        if self.on_step is not None and step != self._notified_step:
            self._notified_step = step
            self.on_step(self.n_pairs(), step + 1, max(len(self.sigmas) - 1, 1))

    def n_pairs(self) -> int:
        return sum(len(v) for v in self.pairs.values())

    def to_pair_file(self, fingerprint: dict) -> dict:
        return {"format": PAIRS_FORMAT, "version": PAIRS_VERSION, "family": self.family,
                "fingerprint": fingerprint, "prompt_ids": list(self.prompt_ids), "calls": self.calls,
                "pair_columns": ["x_rel_l1_modulated_input", "y_rel_l1_block_stack_output", "step", "sigma", "condition"],
                "pairs": {s: v for s, v in self.pairs.items() if v},
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}

    def release(self) -> None:
        self.prev.clear()


def pair_file_bytes(obj: dict) -> bytes:
    return json.dumps(obj, allow_nan=False).encode("utf-8")


def write_pair_file(obj: dict, path: str | os.PathLike) -> str:
    """Write a new pair file at ``path`` through ``loaders/safe_fs.py`` (temp file + no-replace publish, never
    through a symlink); an existing file of that name raises :class:`CoefficientError`."""
    path = os.fspath(path)
    with SafeDir.open_root(os.path.dirname(os.path.abspath(path)), create=True, error=CoefficientError,
                           what="TeaCache pair folder") as d:
        write_file(d, os.path.basename(path), pair_file_bytes(obj))
    return path


def parse_pair_bytes(data: bytes, where: str, path: str) -> dict:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CoefficientError(f"{where} is not UTF-8 text ({e})") from None
    obj = strict_json.loads_as(text, where, what="TeaCache pair file", error=CoefficientError)
    if not isinstance(obj, dict) or obj.get("format") != PAIRS_FORMAT:
        raise CoefficientError(f"{where}: format is {obj.get('format') if isinstance(obj, dict) else obj!r}, expected {PAIRS_FORMAT!r}")
    if obj.get("version") != PAIRS_VERSION:
        raise CoefficientError(f"{where}: version {obj.get('version')!r} is not supported (expected {PAIRS_VERSION})")
    fam = obj.get("family")
    if fam not in FAMILY_STREAMS:
        raise CoefficientError(f"{where}: family {fam!r} is not one of {sorted(FAMILY_STREAMS)}")
    pairs = obj.get("pairs")
    if not isinstance(pairs, dict):
        raise CoefficientError(f"{where}: 'pairs' must be an object stream -> [[x, y, step, sigma, condition], ...]")
    for s, rows in pairs.items():
        if s not in FAMILY_STREAMS[fam]:
            raise CoefficientError(f"{where}: pairs.{s} is not a stream of family {fam!r}")
        if not isinstance(rows, list):
            raise CoefficientError(f"{where}: pairs.{s} must be a list")
        for i, r in enumerate(rows):
            if not (isinstance(r, list) and len(r) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)):
                raise CoefficientError(f"{where}: pairs.{s}[{i}] = {r!r} is not a numeric row [x, y, ...]")
            if not (np.isfinite(r[0]) and np.isfinite(r[1])) or r[0] < 0 or r[1] < 0:
                raise CoefficientError(f"{where}: pairs.{s}[{i}] has x={r[0]!r}, y={r[1]!r}; rel-L1 values must be finite and >= 0")
    if not isinstance(obj.get("fingerprint"), dict):
        raise CoefficientError(f"{where}: 'fingerprint' must be an object")
    obj["_path"] = path
    return obj


def load_pair_file(path: str | os.PathLike, folder: SafeDir | None = None) -> dict:
    """Read a pair file, opened once without following a symlink (``folder``: an already opened pair folder and
    ``path`` a name in it) and checked on the opened descriptor (regular file, <= 64 MiB)."""
    path = os.fspath(path)
    if folder is not None:
        full = os.path.join(folder.path, path)
        where = f"TeaCache pair file '{full}'"
        try:
            fd = folder.open_read(path)
        except OSError as e:
            raise CoefficientError(f"{where} cannot be opened ({'a symlink' if e.errno == errno.ELOOP else e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PAIRS_BYTES:
                raise CoefficientError(f"{where} is not a regular file of at most {MAX_PAIRS_BYTES} bytes")
            data = read_fd(fd, MAX_PAIRS_BYTES)
        finally:
            os.close(fd)
        return parse_pair_bytes(data, where, full)
    where = f"TeaCache pair file '{path}'"
    data, _ = read_inside(os.path.dirname(os.path.abspath(path)), [os.path.basename(path)],
                          max_bytes=MAX_PAIRS_BYTES, what="TeaCache pair file", error=CoefficientError)
    return parse_pair_bytes(data, where, path)


class NegativeFitError(CoefficientError):
    """The least-squares polynomial is negative somewhere inside the recorded x range."""


def fit_pairs(x: Sequence[float], y: Sequence[float], degree: int = 4) -> tuple[list[float], dict, tuple[float, float]]:
    """Least-squares polynomial y ~ p(x) (coefficients highest order first) with fit quality."""
    xa = np.asarray(x, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if xa.size < degree + 1:
        raise CoefficientError(f"need at least {degree + 1} pairs to fit a degree-{degree} polynomial, got {xa.size} "
                               "(record more prompts/steps, or lower the degree)")
    if np.ptp(xa) <= 0:
        raise CoefficientError(f"all {xa.size} input rel-L1 values are equal ({xa[0]:.6g}); cannot fit a polynomial")
    coeffs = np.polyfit(xa, ya, degree)
    pred = np.polyval(coeffs, xa)
    res = ya - pred
    ss_res = float(np.sum(res ** 2))
    ss_tot = float(np.sum((ya - ya.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    if not np.all(np.isfinite(coeffs)):
        raise CoefficientError(f"polynomial fit produced non-finite coefficients {coeffs.tolist()}")
    neg = polynomial_negative(coeffs.tolist(), (float(xa.min()), float(xa.max())))
    if neg is not None:
        raise NegativeFitError(f"the fitted degree-{degree} polynomial is {neg[1]:.6g} at x = {neg[0]:.6g}, negative "
                               f"inside the recorded x range [{float(xa.min()):.6g}, {float(xa.max()):.6g}] (it would "
                               "rescale changes to negative distances and skip steps); record more prompts or lower "
                               "the degree")
    fit = {"r2": round(r2, 6), "rmse": round(float(np.sqrt(ss_res / xa.size)), 8),
           "max_abs_residual": round(float(np.max(np.abs(res))), 8), "n_pairs": int(xa.size), "degree": int(degree),
           "y_range": [round(float(ya.min()), 8), round(float(ya.max()), 8)]}
    return [float(c) for c in coeffs], fit, (float(xa.min()), float(xa.max()))


def fit_non_negative(x: Sequence[float], y: Sequence[float], degree: int = 4) -> tuple[list[float], dict, tuple[float, float]]:
    """:func:`fit_pairs` at ``degree``; where that polynomial is negative inside the recorded x range (it would skip
    steps that changed), the highest lower degree whose fit is not, stated in ``fit`` (``degree_requested``,
    ``degree_lowered_because``). Raises :class:`NegativeFitError` when every degree down to 1 is negative."""
    first = None
    for d in range(int(degree), 0, -1):
        try:
            coeffs, fit, xr = fit_pairs(x, y, d)
        except NegativeFitError as e:
            first = first or e
            continue
        if d != degree:
            fit["degree_requested"] = int(degree)
            fit["degree_lowered_because"] = str(first)
        return coeffs, fit, xr
    raise NegativeFitError(f"{first}; every lower degree down to 1 is negative there too") from None


def _common_fingerprint(fps: list[dict]) -> tuple[dict, list[str]]:
    out: dict = {}
    mixed: list[str] = []
    keys = set()
    for fp in fps:
        keys |= set(fp)
    for k in sorted(keys):
        vals = [json.dumps(fp.get(k), sort_keys=True) for fp in fps]
        if len(set(vals)) == 1:
            out[k] = fps[0].get(k)
        else:
            out[k] = None
            mixed.append(k)
    return out, mixed


def fit_files(pair_objs: list[dict], degree: int = 4, min_prompts: int = 1, source: str = "") -> CoefficientFile:
    """Pool pair files (already loaded) and fit one polynomial per stream."""
    if not pair_objs:
        raise CoefficientError("no pair files to fit")
    fams = {o["family"] for o in pair_objs}
    if len(fams) != 1:
        raise CoefficientError(f"pair files mix model families {sorted(fams)}; fit each family separately")
    family = fams.pop()
    fp, mixed = _common_fingerprint([o["fingerprint"] for o in pair_objs])
    if "model" in mixed:
        raise CoefficientError("pair files come from different models (fingerprint.model differs: "
                               + ", ".join(sorted({str((o['fingerprint'].get('model') or {}).get('weights_sha256', '?'))[:12] for o in pair_objs}))
                               + "); fit each model separately")
    prompts = set()
    for o in pair_objs:
        for p in o.get("prompt_ids") or []:
            prompts.add(str(p))
    n_prompts = len(prompts) if prompts else len(pair_objs)
    if n_prompts < min_prompts:
        raise CoefficientError(f"only {n_prompts} distinct prompt(s) recorded, need >= {min_prompts}")
    streams: dict[str, StreamCoefficients] = {}
    for s in FAMILY_STREAMS[family]:
        rows = [r for o in pair_objs for r in o["pairs"].get(s, [])]
        if not rows:
            continue
        coeffs, fit, xr = fit_non_negative([r[0] for r in rows], [r[1] for r in rows], degree)
        streams[s] = StreamCoefficients(s, tuple(coeffs), (round(xr[0], 8), round(xr[1], 8)), fit)
    if FAMILY_STREAMS[family][0] not in streams:
        raise CoefficientError(f"no pairs recorded for the {FAMILY_STREAMS[family][0]!r} stream")
    fp["family"] = family
    steps = sorted({(len(o["fingerprint"].get("sigmas") or []) - 1) for o in pair_objs})
    cal = {"n_prompts": n_prompts, "n_runs": len(pair_objs), "n_pairs": sum(st.fit["n_pairs"] for st in streams.values()),
           "steps": steps, "mixed": mixed, "pair_files": [os.path.basename(o.get("_path", "?")) for o in pair_objs]}
    prov = {"source": source or "ditkit TeaCache calibration (full-compute runs, numpy.polyfit)", "kind": "calibrated",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "ditkit_version": __version__}
    return CoefficientFile(family, streams, fp, prov, cal)


def _fp_key(fp: dict) -> str:
    return json.dumps(fp, sort_keys=True)


def collect_pair_files(pair_dir: str | os.PathLike | SafeDir, family: str, run_fp: dict) -> tuple[list[dict], list[str], list[str]]:
    """The pair files in ``pair_dir`` (a path, or a folder opened by ``loaders/safe_fs.py``) recorded for ``family``
    with exactly the run fingerprint ``run_fp`` (model, schedule, sampler, ...): ``(pair objects, their paths,
    ignored files with the reason)``. Unreadable files, symlinks and files of other runs are listed in ``ignored``,
    never fitted."""
    key = _fp_key(run_fp)
    objs, used, ignored = [], [], []
    own = not isinstance(pair_dir, SafeDir)
    d = SafeDir.open_root(pair_dir, error=CoefficientError, what="TeaCache pair folder") if own else pair_dir
    try:
        for f in sorted(d.listdir()):
            if not (f.startswith("pairs_") and f.endswith(".json")):
                continue
            try:
                o = load_pair_file(f, folder=d)
            except CoefficientError as e:
                ignored.append(f"{f} ({e})")
                continue
            if o["family"] == family and _fp_key(o["fingerprint"]) == key:
                objs.append(o)
                used.append(os.path.join(d.path, f))
            else:
                ignored.append(f"{f} (other model/schedule/sampler)")
    finally:
        if own:
            d.close()
    return objs, used, ignored


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ditkit.cache.calibrate",
                                 description="Fit TeaCache coefficients from recorded pair files.")
    ap.add_argument("out", help="output coefficient JSON")
    ap.add_argument("pairs", nargs="+", help="pair files written by DitKitTeaCacheCalibrate")
    ap.add_argument("--degree", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=1)
    a = ap.parse_args(argv)
    try:
        objs = [load_pair_file(p) for p in a.pairs]
        cf = fit_files(objs, degree=a.degree, min_prompts=a.min_prompts,
                       source="ditkit.cache.calibrate CLI from " + ", ".join(os.path.basename(p) for p in a.pairs))
        save(cf, a.out)
    except CoefficientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s, st in cf.streams.items():
        print(f"{s}: coefficients {['%.6g' % c for c in st.coefficients]} R2 {st.fit['r2']:.4f} "
              f"RMSE {st.fit['rmse']:.4g} n={st.fit['n_pairs']} x_range {st.x_range}")
    print(f"wrote {a.out} ({cf.calibration['n_prompts']} prompts, {cf.calibration['n_runs']} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

