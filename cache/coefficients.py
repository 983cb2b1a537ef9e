"""TeaCache coefficient files: schema, strict loading, fingerprints and the mismatch guard.

A coefficient file is a small versioned JSON document (``format`` ``ditkit.teacache.coefficients``,
``version`` 1)::

    {"format": "ditkit.teacache.coefficients", "version": 1,
     "family": "h3",                                 # h3 | ltx2 | zimage | flux2
     "streams": {"video": {"coefficients": [a4, a3, a2, a1, a0],   # numpy poly1d order, highest first
                           "x_range": [lo, hi] | null,             # rel-L1 range seen while fitting
                           "fit": {"r2": .., "rmse": .., "max_abs_residual": .., "n_pairs": ..} | null},
                 "audio": {...}},
     "calibration": {"n_prompts": .., "n_runs": .., "n_pairs": .., "steps": [..]} | null,
     "fingerprint": {"family": "h3", "model": {"weights_sha256": .., "class": ..} | null,
                     "sampler": .., "steps": .., "sigmas": [..] | null, "shifts": {..}, "cfg": .., "guidance": ..},
     "provenance": {"source": "..", "kind": "calibrated" | "borrowed", "created": "..", "note": ".."}}

Everything here is plain Python/torch. Paths are resolved by the nodes; this module takes paths.
Bad files raise :class:`~ditkit.errors.CoefficientError` naming the file, the key and what was expected (numbers
are echoed, strings/lists/objects only by type: a file that fails validation may be any JSON the server can read).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import CoefficientError
from ..loaders.safe_fs import SafeDir, read_inside, write_file
from .. import strict_json
from ..report import Report

FORMAT = "ditkit.teacache.coefficients"
VERSION = 1
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEGREE = 10

# streams each family's runtime measures (the order is the report order)
FAMILY_STREAMS: dict[str, tuple[str, ...]] = {
    "h3": ("video", "audio"),
    "ltx2": ("video", "audio"),
    "zimage": ("image",),
    "flux2": ("image",),
}
FAMILY_NAMES = {"h3": "MiniMax H3", "ltx2": "LTX-2 (audio-video)", "zimage": "Z-Image", "flux2": "FLUX.2"}

DEFAULTS_DIR = Path(__file__).resolve().parent / "defaults"
SIGMA_TOL = 1e-4


@dataclass(frozen=True)
class StreamCoefficients(Report):
    name: str
    coefficients: tuple[float, ...]  # highest order first (numpy poly1d)
    x_range: tuple[float, float] | None = None
    fit: dict | None = None

    KEYS = ("coefficients", "x_range", "fit")

    def rescale(self, x: float) -> tuple[float, bool]:
        """Polynomial rescale of one rel-L1 value; x is clamped into ``x_range`` (no extrapolation).
        Returns (value, clamped)."""
        clamped = False
        if self.x_range is not None:
            lo, hi = self.x_range
            if x < lo or x > hi:
                clamped = True
                x = min(max(x, lo), hi)
        y = 0.0
        for c in self.coefficients:
            y = y * x + c
        return y, clamped


@dataclass
class CoefficientFile(Report):
    family: str
    streams: dict[str, StreamCoefficients]
    fingerprint: dict
    provenance: dict
    calibration: dict | None = None
    path: str | None = None

    KEYS = ("format", "version", "family", "streams", "calibration", "fingerprint", "provenance")
    VALUES = {"format": lambda cf: FORMAT, "version": lambda cf: VERSION}

    @property
    def kind(self) -> str:
        return str(self.provenance["kind"])

    def describe(self) -> str:
        src = self.provenance.get("source", "?")
        return f"{os.path.basename(self.path) if self.path else '<memory>'} ({self.kind}, {FAMILY_NAMES.get(self.family, self.family)}, source: {src})"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


NEGATIVE_TOL = 1e-6  # a rescaled change below -1e-6 counts as negative (fits touching 0 at a range end pass)


def polynomial_negative(coeffs, x_range, tol: float = NEGATIVE_TOL) -> tuple[float, float] | None:
    """``(x, p(x))`` where the polynomial (highest order first) is lowest if that is below ``-tol`` on the interval the
    runtime evaluates it: ``x_range`` (x is clamped into it) or ``[0, inf)`` when ``x_range`` is None; else None.

    Exact up to root finding: the minimum of a polynomial on an interval is at an end or at a real root of its
    derivative; a dense grid over the finite part backs the root finder up."""
    import numpy as np

    c = np.trim_zeros(np.asarray([float(v) for v in coeffs], dtype=np.float64), "f")
    if c.size == 0:
        return None
    lo, hi = (float(x_range[0]), float(x_range[1])) if x_range is not None else (0.0, math.inf)
    if math.isinf(hi) and c.size > 1 and c[0] < 0:
        # the leading term wins for large x: find a point where it is already negative. No cap on x: a tiny
        # leading coefficient (-1e-30 x^2 + 1) is negative only past 1e15, and the point named must be negative
        # (it is before x overflows: |c[0]| x^n reaches any tolerance long before 1e308)
        x = max(1.0, lo)
        with np.errstate(over="ignore", invalid="ignore"):
            while math.isfinite(x) and not np.polyval(c, x) < -tol:
                x *= 2
            v = float(np.polyval(c, x))
        return (float(x), v) if v < -tol else None
    cands = [lo]
    if c.size > 2:
        for r in np.roots(np.polyder(c)):
            if abs(r.imag) <= 1e-9 * max(1.0, abs(r.real)) and lo <= r.real <= hi:
                cands.append(float(r.real))
    top = hi if math.isfinite(hi) else max([lo + 1.0] + cands)
    cands.append(top)
    cands += list(np.linspace(lo, top, 257))
    vals = np.polyval(c, np.asarray(cands))
    i = int(np.argmin(vals))
    return (float(cands[i]), float(vals[i])) if vals[i] < -tol else None


def _err(where: str, key: str, msg: str) -> CoefficientError:
    return CoefficientError(f"TeaCache coefficient file {where}: {key}: {msg}")


def _shown(v: Any, known: Iterable[str] = ()) -> str:
    """What an error may say about a value read from a file that failed validation: numbers and null are echoed,
    ditkit's own names (``known``, e.g. the family names) are echoed too, anything else only by its JSON type (a crafted path could otherwise make ditkit print string fields of any
    JSON the server can read)."""
    if v is None or isinstance(v, bool) or _finite(v) or (isinstance(v, str) and v in known):
        return repr(v)
    if isinstance(v, float):
        return repr(v)
    return {str: "a string", list: "a list", dict: "an object"}.get(type(v), f"a {type(v).__name__}")


def parse(obj: Any, where: str) -> CoefficientFile:
    """Validate a parsed JSON document and build a :class:`CoefficientFile`."""
    if not isinstance(obj, dict):
        raise _err(where, "<root>", f"expected a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    if fmt != FORMAT:
        raise _err(where, "format", f"is {_shown(fmt)}, expected {FORMAT!r} (not a ditkit TeaCache coefficient file)")
    ver = obj.get("version")
    if ver != VERSION:
        raise _err(where, "version", f"is {_shown(ver)}; this ditkit reads version {VERSION} only "
                   "(re-run DitKitTeaCacheCalibrate or `python -m ditkit.cache.calibrate` to rewrite it)")
    family = obj.get("family")
    if not isinstance(family, str) or family not in FAMILY_STREAMS:
        raise _err(where, "family", f"is {_shown(family)}, expected one of {sorted(FAMILY_STREAMS)}")
    streams_obj = obj.get("streams")
    if not isinstance(streams_obj, dict) or not streams_obj:
        raise _err(where, "streams", "must be a non-empty object mapping stream name -> coefficients")
    streams: dict[str, StreamCoefficients] = {}
    for name, s in streams_obj.items():
        if name not in FAMILY_STREAMS[family]:
            shown = f"streams.{name}" if name in {n for v in FAMILY_STREAMS.values() for n in v} else "streams"
            raise _err(where, shown, f"is not a stream of family {family!r} (expected {list(FAMILY_STREAMS[family])})")
        if not isinstance(s, dict):
            raise _err(where, f"streams.{name}", "must be an object")
        coeffs = s.get("coefficients")
        if not isinstance(coeffs, list) or not (1 <= len(coeffs) <= MAX_DEGREE + 1):
            raise _err(where, f"streams.{name}.coefficients", f"must be a list of 1..{MAX_DEGREE + 1} numbers, got "
                       + (f"a list of {len(coeffs)}" if isinstance(coeffs, list) else _shown(coeffs)))
        for i, c in enumerate(coeffs):
            if not _finite(c):
                raise _err(where, f"streams.{name}.coefficients[{i}]", f"is {_shown(c)}; coefficients must be finite numbers")
        xr = s.get("x_range")
        x_range = None
        if xr is not None:
            if not (isinstance(xr, list) and len(xr) == 2 and all(_finite(v) for v in xr) and xr[0] <= xr[1] and xr[0] >= 0):
                raise _err(where, f"streams.{name}.x_range", "must be null or [lo, hi] with 0 <= lo <= hi finite, got "
                           + (f"[{', '.join(_shown(v) for v in xr)}]" if isinstance(xr, list) and len(xr) <= 4 else _shown(xr)))
            x_range = (float(xr[0]), float(xr[1]))
        neg = polynomial_negative(coeffs, x_range)
        if neg is not None:
            lo, hi = x_range if x_range is not None else (0.0, math.inf)
            raise _err(where, f"streams.{name}", f"the polynomial is {neg[1]:.6g} at x = {neg[0]:.6g}, negative "
                       f"inside {'its x_range' if x_range is not None else 'x >= 0 (x_range is null: no clamping)'} "
                       f"[{lo:.6g}, {hi:.6g}]; a negative rescaled change lowers the accumulated distance and skips "
                       "steps that changed (re-fit, or set an x_range where it is >= 0)")
        fit = s.get("fit")
        if fit is not None and not isinstance(fit, dict):
            raise _err(where, f"streams.{name}.fit", "must be null or an object")
        streams[name] = StreamCoefficients(name, tuple(float(c) for c in coeffs), x_range, fit)
    if FAMILY_STREAMS[family][0] not in streams:
        raise _err(where, "streams", f"family {family!r} needs at least the {FAMILY_STREAMS[family][0]!r} stream")
    fp = obj.get("fingerprint")
    if not isinstance(fp, dict):
        raise _err(where, "fingerprint", "must be an object")
    if fp.get("family") != family:
        raise _err(where, "fingerprint.family", f"is {_shown(fp.get('family'), FAMILY_STREAMS)} but the file's family is {family!r}")
    sig = fp.get("sigmas")
    if sig is not None and not (isinstance(sig, list) and all(_finite(v) for v in sig)):
        raise _err(where, "fingerprint.sigmas", "must be null or a list of finite numbers")
    model = fp.get("model")
    if model is not None:
        if not isinstance(model, dict):
            raise _err(where, "fingerprint.model", f"must be null or an object (weights_sha256, class...), got {_shown(model)}")
        sha = model.get("weights_sha256")
        if sha is not None and not isinstance(sha, str):
            raise _err(where, "fingerprint.model.weights_sha256", f"must be null or a hex string, got {_shown(sha)}")
    shifts = fp.get("shifts")
    if shifts is not None:
        if not isinstance(shifts, dict):
            raise _err(where, "fingerprint.shifts", f"must be null or an object of name -> number, got {_shown(shifts)}")
        for k, v in shifts.items():
            if v is not None and not _finite(v):
                raise _err(where, "fingerprint.shifts", f"value of one entry is {_shown(v)}; shifts must be finite numbers or null")
    for key in ("steps", "cfg", "guidance"):
        v = fp.get(key)
        if v is not None and not _finite(v):
            raise _err(where, f"fingerprint.{key}", f"must be null or a finite number, got {_shown(v)}")
    prov = obj.get("provenance")
    if not isinstance(prov, dict) or not isinstance(prov.get("source"), str) or not prov.get("source"):
        raise _err(where, "provenance.source", "every coefficient file must state where its coefficients come from")
    if "kind" not in prov:  # decides whether the "borrowed coefficients" warning is shown: never assumed
        raise _err(where, "provenance.kind", "is missing; expected 'calibrated' (fitted for this model) or 'borrowed'")
    if prov.get("kind") not in ("calibrated", "borrowed"):
        raise _err(where, "provenance.kind", f"is {_shown(prov.get('kind'))}, expected 'calibrated' or 'borrowed'")
    cal = obj.get("calibration")
    if cal is not None and not isinstance(cal, dict):
        raise _err(where, "calibration", "must be null or an object")
    return CoefficientFile(family, streams, fp, prov, cal)


def parse_bytes(data: bytes, where: str) -> CoefficientFile:
    """Decode + strict-parse + validate the bytes of a coefficient file (``where`` names it in errors)."""
    if len(data) > MAX_FILE_BYTES:
        raise CoefficientError(f"TeaCache coefficient file {where} is larger than {MAX_FILE_BYTES} bytes; not a "
                               "coefficient file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CoefficientError(f"TeaCache coefficient file {where} is not UTF-8 text ({e})") from None
    obj = strict_json.loads_as(text, f"TeaCache coefficient file {where}", what="coefficient JSON",
                               error=CoefficientError)
    return parse(obj, where)


def load_inside(root: str | os.PathLike, parts, display: str | None = None) -> CoefficientFile:
    """Load ``root/parts...`` opened once without following symlinks below ``root`` (the node's reader: the
    checked file is the file read, see ``loaders/safe_fs.py``)."""
    parts = list(parts)
    path = os.path.join(os.path.realpath(os.fspath(root)), *parts)
    data, _ = read_inside(root, parts, max_bytes=MAX_FILE_BYTES, what="TeaCache coefficient file",
                          error=CoefficientError)
    cf = parse_bytes(data, f"'{display or path}'")
    cf.path = display or path
    return cf


def load(path: str | os.PathLike) -> CoefficientFile:
    """Load a coefficient file by path: its folder is resolved, the file itself is opened once without following
    a symlink and checked on the opened descriptor (regular file, size)."""
    path = os.fspath(path)
    data, _ = read_inside(os.path.dirname(os.path.abspath(path)), [os.path.basename(path)],
                          max_bytes=MAX_FILE_BYTES, what="TeaCache coefficient file", error=CoefficientError)
    cf = parse_bytes(data, f"'{path}'")
    cf.path = path
    return cf


def is_coefficient_file(data: bytes) -> bool:
    """Whether ``data`` is a valid ditkit coefficient file (what :func:`save` may replace by default)."""
    try:
        parse_bytes(data, "(existing)")
    except CoefficientError:
        return False
    return True


def save(cf: CoefficientFile, path: str | os.PathLike, replace_if=is_coefficient_file) -> str:
    """Write ``cf`` to ``path`` through ``loaders/safe_fs.py``: temp file + atomic publish inside the folder, never
    through a symlink; an existing file is replaced only if ``replace_if(existing bytes)`` (default: it is a valid
    ditkit coefficient file), anything else in the way raises :class:`CoefficientError`."""
    path = os.fspath(path)
    data = (json.dumps(cf.as_dict(), indent=1, allow_nan=False) + "\n").encode("utf-8")
    with SafeDir.open_root(os.path.dirname(os.path.abspath(path)), create=True, error=CoefficientError,
                           what="TeaCache folder") as d:
        write_file(d, os.path.basename(path), data, replace_if=replace_if, max_existing_bytes=MAX_FILE_BYTES)
    cf.path = path
    return path


# ---------------------------------------------------------------------------------------------- shipped defaults

def shipped_defaults() -> dict[str, Path]:
    """Name -> path of the coefficient files shipped in ``cache/defaults`` (each states its provenance)."""
    if not DEFAULTS_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(DEFAULTS_DIR.glob("*.json"))}


# ---------------------------------------------------------------------------------------------- fingerprints

def weights_fingerprint(named_tensors: Iterable[tuple[str, Any]], sample_elems: int = 64) -> dict:
    """Identity of a model from its weights: sha256 over sorted (name, shape, dtype) plus the first
    ``sample_elems`` values of every tensor (as float32). Tensors whose values cannot be read (meta, exotic
    quantized types) contribute name/shape/dtype only and are counted in ``unread``."""
    import torch

    h = hashlib.sha256()
    n = 0
    numel = 0
    unread = 0
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        shape = tuple(getattr(t, "shape", ()))
        h.update(f"{name}|{shape}|{getattr(t, 'dtype', '?')}\n".encode())
        n += 1
        try:
            numel += int(t.numel())
            v = t.detach().reshape(-1)[:sample_elems].to(device="cpu", dtype=torch.float32).contiguous()
            h.update(v.numpy().tobytes())
        except Exception:  # noqa: BLE001 - counted; identity still covers names/shapes
            unread += 1
    return {"weights_sha256": h.hexdigest(), "n_tensors": n, "n_params": numel, "unread_tensors": unread}


def sigmas_list(sigmas) -> list[float]:
    return [round(float(s), 6) for s in sigmas]


@dataclass
class Mismatch:
    field: str
    expected: Any
    got: Any
    severity: str  # "error" | "warn"

    def text(self) -> str:
        return f"{self.field}: file has {self.expected!r}, this run has {self.got!r}"


@dataclass
class GuardResult:
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def warnings(self) -> list[str]:
        return [m.text() for m in self.mismatches]


def check_model(cf: CoefficientFile, family: str, model_fp: dict | None) -> GuardResult:
    """Static part of the guard (at node execution): family must match (error), weights identity (warn)."""
    g = GuardResult()
    if cf.family != family:
        g.mismatches.append(Mismatch("family", cf.family, family, "error"))
        return g
    stored = cf.fingerprint.get("model") or {}
    want = stored.get("weights_sha256")
    got_fp = model_fp or {}
    # a file written before fingerprint scheme 2 (no "scheme") holds the previous rule's value (bridge/fingerprint.py)
    got = got_fp.get("weights_sha256_v1") if "scheme" not in stored and "scheme" in got_fp else got_fp.get("weights_sha256")
    if cf.kind == "borrowed":
        g.mismatches.append(Mismatch("model", f"borrowed coefficients ({cf.provenance.get('source')})",
                                     "a model they were not fitted on", "warn"))
    elif want and got and want != got:
        g.mismatches.append(Mismatch("model.weights_sha256", want[:16], got[:16], "warn"))
    elif not want:
        g.mismatches.append(Mismatch("model.weights_sha256", None, (got or "?")[:16], "warn"))
    return g


def check_run(cf: CoefficientFile, run_fp: dict) -> GuardResult:
    """Dynamic part of the guard (at sampling start): steps, schedule, sampler, guidance, shifts."""
    g = GuardResult()
    fp = cf.fingerprint
    if fp.get("steps") is not None and run_fp.get("steps") != fp.get("steps"):
        g.mismatches.append(Mismatch("steps", fp.get("steps"), run_fp.get("steps"), "warn"))
    s_want, s_got = fp.get("sigmas"), run_fp.get("sigmas")
    if s_want is not None and s_got is not None:
        if len(s_want) != len(s_got):
            if fp.get("steps") is None or run_fp.get("steps") == fp.get("steps"):
                g.mismatches.append(Mismatch("sigmas", f"{len(s_want)} values", f"{len(s_got)} values", "warn"))
        else:
            d = max(abs(a - b) for a, b in zip(s_want, s_got)) if s_want else 0.0
            if d > SIGMA_TOL:
                g.mismatches.append(Mismatch("sigmas (schedule)", f"{s_want[:3]}...", f"{s_got[:3]}... (max |dsigma| {d:.4g})", "warn"))
    for key in ("sampler", "cfg", "guidance"):
        a, b = fp.get(key), run_fp.get(key)
        if a is None or b is None:
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if abs(float(a) - float(b)) > 1e-6:
                g.mismatches.append(Mismatch(key, a, b, "warn"))
        elif a != b:
            g.mismatches.append(Mismatch(key, a, b, "warn"))
    shifts_a, shifts_b = fp.get("shifts") or {}, run_fp.get("shifts") or {}
    for k in sorted(set(shifts_a) & set(shifts_b)):
        if shifts_a[k] is not None and shifts_b[k] is not None and abs(float(shifts_a[k]) - float(shifts_b[k])) > 1e-6:
            g.mismatches.append(Mismatch(f"shifts.{k}", shifts_a[k], shifts_b[k], "warn"))
    return g
