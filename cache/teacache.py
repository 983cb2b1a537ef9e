"""TeaCache runtime state (plain torch).

Per model call (one forward of the DiT for a batch of conditions), the hook that sits on the first block of
the block stack hands :meth:`TeaCacheState.decide` the timestep-modulated input of block 0, split per
stream (H3/LTX-2: ``video`` and ``audio``; Z-Image/FLUX.2: ``image``) and per condition in the batch.
For every condition and stream the relative L1 change against that condition's previous call is rescaled
by the stream's calibrated polynomial and accumulated. The block stack is skipped (its cached residual is
added to the stack input instead) only when **every** stream of **every** condition in the batch stays
below its threshold: the audio stream can veto a skip the video stream would take.

Always computed: the first and the last sampling step, calls outside ``[start_percent, end_percent]`` (as a
fraction of the sampling steps), and any call whose condition has no cached residual of the right shape.
State is kept per condition key (ComfyUI's cond UUID), so cond and uncond never share a residual.
:meth:`begin` resets everything (new sampling / new sigma schedule); :meth:`report` summarises the run.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from ..errors import CoefficientError
from ..parallel.reduce import LOCAL, Reducer
from ..report import Report
from . import coefficients as coef
from .coefficients import StreamCoefficients


def rel_l1(cur: torch.Tensor, prev: torch.Tensor) -> float:
    """mean|cur - prev| / mean|prev| in float32 (TeaCache paper Eq. 4). One host sync."""
    c = cur.float()
    p = prev.float()
    den = p.abs().mean()
    num = (c - p).abs().mean()
    return float(num / den.clamp_min(1e-12))


@dataclass
class TeaCacheConfig:
    family: str
    streams: dict[str, StreamCoefficients]
    thresholds: dict[str, float]
    start_percent: float = 0.0
    end_percent: float = 1.0
    cache_device: str = "model"  # "model" or "cpu"

    def __post_init__(self):
        missing = [s for s in self.streams if s not in self.thresholds]
        if missing:
            raise ValueError(f"no threshold for streams {missing}")


@dataclass
class TeaCacheStreamStats(Report):
    computed: int = 0
    skipped: int = 0
    would_skip: int = 0     # calls where this stream alone was below its threshold (non-forced calls)
    vetoes: int = 0         # calls where only this stream blocked a skip the other streams would take
    acc_total: float = 0.0  # sum of rescaled distances added to the accumulator
    rel_l1_total: float = 0.0
    clamped: int = 0        # rel-L1 values clamped into the fitted x_range

    KEYS = ("computed", "skipped", "would_skip", "vetoes", "acc_distance_total", "rel_l1_total", "x_clamped=clamped")
    VALUES = {"acc_distance_total": lambda s: round(s.acc_total, 6), "rel_l1_total": lambda s: round(s.rel_l1_total, 6)}


@dataclass
class _CondState:
    prev: dict[str, torch.Tensor] = field(default_factory=dict)
    acc: dict[str, float] = field(default_factory=dict)
    residual: list[torch.Tensor] | None = None
    computed: int = 0
    skipped: int = 0


@dataclass
class CacheRunReport(Report):
    """What every step cache of the family reports about one sampling run (TeaCache, the step cache): counts per
    call and per stream, the forced computes, the thresholds. Subclasses add their own fields and ``KEYS``."""
    family: str
    steps: int
    calls: int
    computed: int
    skipped: int
    forced: dict[str, int]
    streams: dict[str, dict]
    per_condition: list[dict]
    thresholds: dict[str, float]

    VALUES = {"block_eval_ratio": lambda r: round(r.block_eval_ratio, 4)}

    @property
    def block_eval_ratio(self) -> float:
        """Full-stack evaluations without cache / with cache (1.0 = nothing saved)."""
        return self.calls / self.computed if self.computed else 1.0


@dataclass
class TeaCacheReport(CacheRunReport):
    coefficients: str
    warnings: list[str]
    resets: int

    KEYS = ("family", "steps", "calls", "computed", "skipped", "block_eval_ratio", "forced", "streams", "per_condition",
            "thresholds", "coefficients", "warnings", "resets")

    def summary(self) -> str:
        parts = [f"TeaCache {self.family}: computed {self.computed}/{self.calls} calls, skipped {self.skipped} "
                 f"({self.block_eval_ratio:.2f}x fewer block evaluations, {self.steps} steps)"]
        for name, s in self.streams.items():
            parts.append(f"{name}: skipped {s['skipped']} / computed {s['computed']}, acc {s['acc_distance_total']:.3f}, "
                         f"would-skip {s['would_skip']}, vetoes {s['vetoes']}")
        if self.warnings:
            parts.append(f"WARNING: {len(self.warnings)} fingerprint mismatch(es): " + "; ".join(self.warnings))
        return " | ".join(parts)


class TeaCacheState:
    """Mutable per-sampling TeaCache state. Create one per model clone; :meth:`clone` gives a fresh copy."""

    def __init__(self, config: TeaCacheConfig, coefficients_desc: str = "", reducer: Reducer = LOCAL):
        self.config = config
        self.coefficients_desc = coefficients_desc
        self.reducer = reducer  # sequence parallel: metric sums and the decision agreed over the ranks
        self.warnings: list[str] = []
        self.resets = 0
        self._reset_state([])

    def clone(self) -> "TeaCacheState":
        return TeaCacheState(self.config, self.coefficients_desc, self.reducer)

    def _reduced_changes(self, conds, mods) -> dict:
        """Sequence parallel: the relative L1 change of every (condition, stream) that has a previous input of the
        same shape, from the sums over every rank's valid rows (one ``Reducer.sum`` per call, whatever this rank's
        own state, so the ranks' collectives pair up): ``Σ|cur - prev| / Σ|prev|``."""
        where, parts = [], []
        for ci, c in enumerate(conds):
            for s in self.config.streams:
                cur_list = mods.get(s)
                prev = c.prev.get(s)
                if cur_list is None or prev is None or prev.shape != cur_list[ci].shape:
                    continue
                cur, prev = self.reducer.valid(cur_list[ci].float()), self.reducer.valid(prev.float())
                parts += [(cur - prev).abs().sum(dtype=torch.float64), prev.abs().sum(dtype=torch.float64)]
                where.append((ci, s))
        v = self.reducer.sum(torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64))
        return {w: float(v[2 * i] / v[2 * i + 1].clamp_min(1e-12)) for i, w in enumerate(where)}

    # ------------------------------------------------------------------------------------------- schedule
    def _reset_state(self, sigmas: Sequence[float]):
        self.sigmas = [float(s) for s in sigmas]
        self.conds: dict[Hashable, _CondState] = {}
        self.stats = {s: TeaCacheStreamStats() for s in self.config.streams}
        self.forced: dict[str, int] = {}
        self.calls = 0
        self.computed = 0
        self.skipped = 0
        self._desc = [-s for s in self.sigmas]  # ascending for bisect

    def begin(self, sigmas: Sequence[float], warnings: Sequence[str] = ()) -> None:
        """Start a sampling run (drops every cached tensor and counter)."""
        self._reset_state(sigmas)
        self.warnings = list(warnings)

    def ensure_schedule(self, sigmas: Sequence[float] | None) -> bool:
        """Reset when the sampler's sigma schedule differs from the one this state began with."""
        if sigmas is None:
            return False
        s = [float(v) for v in sigmas]
        if len(s) == len(self.sigmas) and all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(s, self.sigmas)):
            return False
        had = bool(self.sigmas)
        warn = self.warnings
        self._reset_state(s)
        self.warnings = warn
        if had:
            self.resets += 1
        return True

    @property
    def n_steps(self) -> int:
        return max(len(self.sigmas) - 1, 0)

    def step_index(self, sigma: float) -> int:
        """Index i of the sampling step whose interval [sigmas[i], sigmas[i+1]) holds ``sigma``."""
        if not self.sigmas:
            return 0
        # sigmas descend; find the last i with sigmas[i] >= sigma (with tolerance)
        i = bisect.bisect_right(self._desc, -float(sigma) + 1e-7 * max(1.0, abs(float(sigma)))) - 1
        return min(max(i, 0), max(self.n_steps - 1, 0))

    def forced_reason(self, step: int) -> str | None:
        n = self.n_steps
        if n <= 0:
            return "no schedule"
        if step <= 0:
            return "first step"
        if step >= n - 1:
            return "last step"
        frac = step / n
        if frac < self.config.start_percent:
            return "before start_percent"
        if frac > self.config.end_percent:
            return "after end_percent"
        return None

    # ------------------------------------------------------------------------------------------- decisions
    def decide(self, keys: Sequence[Hashable], sigma: float, mods: dict[str, list[torch.Tensor]],
               shapes: Sequence[tuple] | None = None, force: str | None = None) -> bool:
        """Return True to skip the block stack for this call. ``mods[stream][k]`` is the modulated input of
        condition ``keys[k]`` (any shape). ``shapes`` are the stack-input part shapes of one condition, used to
        check the cached residual still fits. ``force`` (a reason) makes the call compute."""
        self.calls += 1
        step = self.step_index(sigma)
        reason = force or self.forced_reason(step)
        conds = [self.conds.setdefault(k, _CondState(acc={s: 0.0 for s in self.config.streams})) for k in keys]
        if reason is None:
            for c in conds:
                if c.residual is None:
                    reason = "no cached residual"
                    break
                if shapes is not None and [tuple(r.shape[1:]) for r in c.residual] != [tuple(s) for s in shapes]:
                    reason = "shape changed"
                    break
        below_all = True
        per_stream_below: dict[str, bool] = {s: True for s in self.config.streams}
        reduced = self._reduced_changes(conds, mods) if self.reducer.distributed else None
        for ci, c in enumerate(conds):
            for s, coeff in self.config.streams.items():
                cur_list = mods.get(s)
                if cur_list is None:
                    continue
                cur = cur_list[ci]
                prev = c.prev.get(s)
                if prev is not None and prev.shape == cur.shape and reason is None:
                    x = reduced[(ci, s)] if reduced is not None else rel_l1(cur, prev)
                    y, clamped = coeff.rescale(x)
                    y = max(y, 0.0)  # a predicted change is never negative (polynomials can dip below 0 near x=0)
                    st = self.stats[s]
                    st.rel_l1_total += x
                    st.acc_total += y
                    st.clamped += int(clamped)
                    c.acc[s] = c.acc.get(s, 0.0) + y
                    thr = self.config.thresholds[s]
                    if thr <= 0 or not (c.acc[s] < thr):
                        per_stream_below[s] = False
                        below_all = False
                elif reason is None:
                    reason = "no previous input"
                c.prev[s] = cur.detach().clone()
        if not self.reducer.agree(reason is None and below_all) and reason is None and below_all:
            reason = "another rank computes"  # sequence parallel: every rank takes the same decision
        if reason is not None:
            self.forced[reason] = self.forced.get(reason, 0) + 1
            self._mark(conds, skip=False)
            return False
        for s in self.config.streams:
            if per_stream_below[s]:
                self.stats[s].would_skip += 1
            elif all(per_stream_below[o] for o in self.config.streams if o != s) and len(self.config.streams) > 1:
                self.stats[s].vetoes += 1
        self._mark(conds, skip=below_all)
        return below_all

    def _mark(self, conds: list[_CondState], skip: bool):
        for c in conds:
            if skip:
                c.skipped += 1
            else:
                c.computed += 1
                for s in c.acc:
                    c.acc[s] = 0.0
        if skip:
            self.skipped += 1
        else:
            self.computed += 1
        for st in self.stats.values():
            if skip:
                st.skipped += 1
            else:
                st.computed += 1

    # ------------------------------------------------------------------------------------------- residuals
    def _store_device(self, t: torch.Tensor):
        return torch.device("cpu") if self.config.cache_device == "cpu" else t.device

    def store(self, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Cache ``outputs - inputs`` per condition (dim 0 of every part is split into len(keys) chunks)."""
        n = len(keys)
        res = [(o - i) for i, o in zip(inputs, outputs)]
        for k_i, key in enumerate(keys):
            parts = []
            for r in res:
                b = r.shape[0] // n
                parts.append(r[k_i * b:(k_i + 1) * b].detach().to(self._store_device(r), copy=True))
            self.conds.setdefault(key, _CondState(acc={s: 0.0 for s in self.config.streams})).residual = parts

    def apply(self, keys: Sequence[Hashable], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``x + cached residual`` per condition (new tensors; inputs untouched)."""
        n = len(keys)
        out = []
        for p_i, x in enumerate(xs):
            b = x.shape[0] // n
            chunks = []
            for k_i, key in enumerate(keys):
                r = self.conds[key].residual[p_i]
                chunks.append(x[k_i * b:(k_i + 1) * b] + r.to(device=x.device, dtype=x.dtype))
            out.append(torch.cat(chunks, dim=0) if len(chunks) > 1 else chunks[0])
        return out

    # ------------------------------------------------------------------------------------------- report
    def report(self) -> TeaCacheReport:
        per_cond = [{"condition": str(k)[:12], "computed": c.computed, "skipped": c.skipped}
                    for k, c in self.conds.items()]
        return TeaCacheReport(
            family=self.config.family, steps=self.n_steps, calls=self.calls, computed=self.computed,
            skipped=self.skipped, forced=dict(self.forced),
            streams={s: st.as_dict() for s, st in self.stats.items()}, per_condition=per_cond,
            thresholds=dict(self.config.thresholds), coefficients=self.coefficients_desc,
            warnings=list(self.warnings), resets=self.resets)

    def release(self) -> None:
        """Drop cached tensors (keeps counters for the report)."""
        for c in self.conds.values():
            c.prev.clear()
            c.residual = None


def state_from_coefficients(cf, family: str, model_fp: dict | None, params: dict, who: str = "DitKitTeaCache",
                            calibrate_with: str = "DitKitTeaCacheCalibrate"
                            ) -> tuple[TeaCacheState, list[str], list[str]]:
    """The runtime state for a loaded coefficient file ``cf`` on a model of ``family`` with fingerprint ``model_fp``.

    ``params``: ``threshold``, ``audio_threshold``, ``start_percent``, ``end_percent``, ``cache_device``, ``strict``.
    A file for another family is an error; a fingerprint mismatch is an error in strict mode, else a warning.
    Returns ``(state, fingerprint_warnings, stream_warnings)``; the stream warnings name the family's streams the
    file has no coefficients for (they take no part in skip decisions).
    """
    g = coef.check_model(cf, family, model_fp)
    if any(m.severity == "error" for m in g.mismatches):
        raise CoefficientError(
            f"{who}: coefficient file {cf.describe()} is for {coef.FAMILY_NAMES.get(cf.family, cf.family)} "
            f"but the model is {coef.FAMILY_NAMES[family]}; calibrate this model with {calibrate_with}")
    fp_warnings = g.warnings()
    if fp_warnings and params["strict"]:
        raise CoefficientError(f"{who}: {cf.describe()} does not match this model: {'; '.join(fp_warnings)} "
                               "(strict mode)")
    streams = {s: cf.streams[s] for s in coef.FAMILY_STREAMS[family] if s in cf.streams}
    missing = [s for s in coef.FAMILY_STREAMS[family] if s not in cf.streams]
    stream_warnings = ([f"streams {missing} have no coefficients in the file and do not take part in skip "
                        "decisions"] if missing else [])
    thresholds = {s: (params["audio_threshold"] if s == "audio" else params["threshold"]) for s in streams}
    config = TeaCacheConfig(family, streams, thresholds, params["start_percent"], params["end_percent"],
                            params["cache_device"])
    return TeaCacheState(config, cf.describe()), fp_warnings, stream_warnings
