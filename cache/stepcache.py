"""Calibration-free step caches (plain torch): first-block residual change and a sigma-schedule plan.

Same per-run state as :mod:`cache.teacache` (per condition key, per stream, forced first/last step,
``[start_percent, end_percent]``, residual cache, report): :class:`StepCacheState` subclasses
:class:`~cache.teacache.TeaCacheState` and replaces the decision; no coefficient file is involved.

* ``first_block`` (FirstBlockCache semantics, ParaAttention / diffusers ``hooks/first_block_cache.py``): block 0 of
  the stack always runs. Per condition and stream its output residual ``r = block0(x) - x`` is compared with the
  residual of the **last computed** call of that condition: ``rel = sum|r - r_prev| / sum|r_prev|`` (no
  accumulation; the reference only moves on a computed call, so consecutive skips compare against an ever older
  reference). The remaining blocks are skipped (their cached residual ``out - block0(x)`` is added to block 0's
  output) only when every stream of every condition is strictly below its threshold: the audio stream vetoes.
  The two sums per (condition, stream) are gathered in one tensor and passed through :attr:`StepCacheState.reducer`
  before the ratio is taken (identity by default): a sequence-parallel stack installs an all-reduce there so every
  rank sees the global sums and takes the same decision. One host sync per call.
* ``sigma_schedule``: the compute/reuse plan of every step is a function of the sampler's sigma list and the
  thresholds only (:func:`sigma_plan`): starting at a computed step ``j``, step ``i`` reuses while
  ``sigma_j - sigma_i < threshold`` (sigma units of the schedule), else computes and becomes the new ``j``. No
  tensor is read, so it is deterministic and identical on every rank. Per stream the same schedule distance is
  compared with the stream's threshold (the smallest threshold decides: the audio threshold vetoes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from ..report import Report
from ..parallel.reduce import LOCAL, Reducer, as_reducer
from .teacache import CacheRunReport, TeaCacheState, _CondState

MODES = ("first_block", "sigma_schedule")
MODE_NAMES = {"first_block": "first-block residual", "sigma_schedule": "sigma schedule"}

# Defaults chosen on the quality lab (benchmarks/lab/stepcache_lab.py, 6 prompts x 2 seeds; tables in
# docs/stepcache.md, "Defaults"): the largest swept threshold keeping the mean video and audio SSIM >= 0.98 at
# 25 and 50 steps, CFG 1 and CFG 3. first_block 0.1414 (25 steps CFG 3: 0.9855 / 0.9939 at 1.43x; 50 steps CFG 3:
# 0.9834 / 0.9946 at 1.86x; 0.1682 falls to 0.9768 at 50 steps CFG 3); sigma_schedule 0.0075 (25 steps CFG 3:
# 0.9891 / 0.9922 at 1.25x; 50 steps CFG 3: 0.9919 / 0.9928 at 1.61x; 0.01 falls to 0.9797 at 50 steps CFG 3).
# Until 2026-12-05 they were 0.2 / 0.03, chosen on 2 prompts x 1 seed, which the larger sample showed below 0.98
# (0.9743 / 0.9592 video SSIM at 25 steps CFG 3).
DEFAULT_THRESHOLDS = {"first_block": {"video": 0.1414, "audio": 0.1414},
                      "sigma_schedule": {"video": 0.0075, "audio": 0.0075}}

# Lab-only switch (issue #33 experiment; set by benchmarks/lab/stepcache_lab.py ``first_block@<variant>``, never by a
# node): the distance the first_block decision thresholds. A state reads it once, when built. "" = the shipped rule.
#   last   : rel-L1 of block 0's residual against the last computed call's (shipped)
#   prev   : rel-L1 against the previous call's residual (computed or not), no accumulation
#   acc    : TeaCache-style: the per-call rel-L1 against the previous call's residual, summed since the last computed
#            call (reset when a call computes)
#   rate   : ``last`` divided by the sigma distance to the last computed call, times the schedule's mean step
#            (change per unit of sigma removed, on the scale of one mean step)
#   l2     : relative L2 against the last computed call's residual
#   out    : rel-L1 of block 0's OUTPUT (not the residual) against the last computed call's
#   cfg    : ``last``, one decision per step for every condition (ComfyUI may run cond and uncond as separate calls,
#            each deciding alone, so CFG combines a fresh and a stale prediction): the step's first call decides on
#            the larger of its own distance and each other condition's latest measured distance; the step's later
#            calls (same sigma) measure theirs (for the next step) and follow that decision
#   <distance>+cfg : the distance variant with the ``cfg`` one-decision-per-step rule (e.g. ``acc+cfg``)
LAB_VARIANTS = ("last", "prev", "acc", "rate", "l2", "out", "cfg")


def parse_variant(name: str) -> tuple[str, bool]:
    """``(distance, one decision per step)`` of a lab variant name (``cfg`` alone: ``last`` + per step)."""
    parts = name.split("+")
    joint = "cfg" in parts
    rest = [p for p in parts if p != "cfg"]
    if len(rest) > 1 or any(p not in LAB_VARIANTS for p in rest) or parts.count("cfg") > 1:
        raise ValueError(f"unknown first_block lab variant {name!r} (one of {LAB_VARIANTS}, or '<distance>+cfg')")
    return (rest[0] if rest else "last"), joint
LAB_FIRST_BLOCK_VARIANT = ""



def l1_sums(cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``[sum|cur - prev|, sum|prev|]`` in float64 on ``cur``'s device (no host sync). Summable across shards:
    the rel-L1 of a tensor split over ranks is the ratio of the all-reduced sums."""
    c = cur.detach().to(torch.float64)
    p = prev.detach().to(device=c.device, dtype=torch.float64)
    if c.shape != p.shape:
        raise ValueError(f"l1_sums: shapes differ {tuple(c.shape)} vs {tuple(p.shape)}")
    return torch.stack(((c - p).abs().sum(), p.abs().sum()))


def l2_sums(cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``[sum (cur - prev)^2, sum prev^2]`` in float64 (lab variant ``l2``; summable across shards like
    :func:`l1_sums`)."""
    c = cur.detach().to(torch.float64)
    p = prev.detach().to(device=c.device, dtype=torch.float64)
    if c.shape != p.shape:
        raise ValueError(f"l2_sums: shapes differ {tuple(c.shape)} vs {tuple(p.shape)}")
    return torch.stack(((c - p).square().sum(), p.square().sum()))


def rate_distance(rel: float, sigma_last: float | None, sigma: float, sigmas: Sequence[float]) -> float:
    """Lab variant ``rate``: ``rel / (sigma_last - sigma) * mean_step``, ``mean_step = (sigmas[0] - sigmas[-1]) /
    (len(sigmas) - 1)``: the change per unit of sigma removed since the last computed call, on the scale of one
    mean step. No sigma distance (same sigma, no computed call yet, < 2 sigmas): +inf (compute)."""
    if sigma_last is None or len(sigmas) < 2:
        return float("inf")
    ds = float(sigma_last) - float(sigma)
    if not ds > 0.0:
        return float("inf")
    mean = (float(sigmas[0]) - float(sigmas[-1])) / (len(sigmas) - 1)
    return rel / ds * mean


def rel_from_sums(num: float, den: float) -> float:
    """``num / den``; 0 / 0 is 0 (a residual that stays exactly zero did not change), x / 0 is +inf."""
    if den > 0.0:
        return num / den
    return 0.0 if num == 0.0 else float("inf")


def sigma_plan(sigmas: Sequence[float], threshold: float, start_percent: float = 0.0,
               end_percent: float = 1.0) -> list[bool]:
    """Per step ``i`` of the schedule (``len(sigmas) - 1`` steps): True = compute, False = reuse.

    The first and the last step and steps outside ``[start_percent, end_percent]`` compute. Otherwise step ``i``
    reuses while ``sigma[j] - sigma[i] < threshold`` (strict), ``j`` the last computed step; ``threshold <= 0``
    computes every step. Depends on nothing but its arguments (rank-invariant)."""
    s = [float(v) for v in sigmas]
    n = max(len(s) - 1, 0)
    plan = []
    last = None
    for i in range(n):
        frac = i / n
        forced = i == 0 or i >= n - 1 or frac < start_percent or frac > end_percent or last is None
        if forced or threshold <= 0 or not (abs(s[last] - s[i]) < threshold):
            plan.append(True)
            last = i
        else:
            plan.append(False)
    return plan


@dataclass
class StepCacheStreamStats(Report):
    computed: int = 0
    skipped: int = 0
    would_skip: int = 0      # decided calls where this stream alone was below its threshold
    vetoes: int = 0          # decided calls where only this stream blocked a skip the other streams would take
    distance_total: float = 0.0   # sum of the measured distances (rel-L1 or sigma distance) of decided calls
    distance_max: float = 0.0
    decided: int = 0

    KEYS = ("computed", "skipped", "would_skip", "vetoes", "decided", "distance_total", "distance_max")
    VALUES = {"distance_total": lambda s: round(s.distance_total, 6), "distance_max": lambda s: round(s.distance_max, 6)}


@dataclass
class StepCacheReport(CacheRunReport):
    """``block_eval_ratio``: block-stack evaluations without / with the cache (first_block: block 0 of every call
    not counted)."""
    mode: str
    plan: str
    reducer: str
    resets: int

    KEYS = ("mode", "family", "steps", "calls", "computed", "skipped", "block_eval_ratio", "forced", "streams",
            "per_condition", "thresholds", "plan", "reducer", "resets")

    def summary(self) -> str:
        parts = [f"Step cache ({MODE_NAMES.get(self.mode, self.mode)}) {self.family}: computed {self.computed}/"
                 f"{self.calls} calls, skipped {self.skipped} ({self.block_eval_ratio:.2f}x fewer block stacks, "
                 f"{self.steps} steps)"]
        for name, s in self.streams.items():
            parts.append(f"{name}: thr {self.thresholds.get(name)}, would-skip {s['would_skip']}, vetoes "
                         f"{s['vetoes']}, max distance {s['distance_max']:.4f}")
        if self.plan:
            parts.append(f"plan {self.plan}")
        return " | ".join(parts)


@dataclass
class StepCacheConfig:
    family: str
    mode: str
    streams: tuple[str, ...]
    thresholds: dict[str, float]
    start_percent: float = 0.0
    end_percent: float = 1.0
    cache_device: str = "model"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown step-cache mode {self.mode!r} (one of {MODES})")
        missing = [s for s in self.streams if s not in self.thresholds]
        if missing:
            raise ValueError(f"no threshold for streams {missing}")
        self.streams = tuple(self.streams)


class StepCacheState(TeaCacheState):
    """Per-sampling state of a calibration-free step cache. ``reducer`` (a callable on a float64 ``[K, 2]`` tensor of
    ``(sum|r - r_prev|, sum|r_prev|)`` rows, returning the reduced tensor of the same shape) makes the first-block
    sums global across ranks; None = this process's sums."""

    def __init__(self, config: StepCacheConfig, reducer: Reducer | Callable | None = None):
        super().__init__(config, "", as_reducer(reducer))
        variant = LAB_FIRST_BLOCK_VARIANT or "last"
        parse_variant(variant)
        self.variant = variant

    def clone(self) -> "StepCacheState":
        st = StepCacheState(self.config, self.reducer)
        st.variant = self.variant
        return st

    def _reset_state(self, sigmas: Sequence[float]):
        super()._reset_state(sigmas)
        self.stats = {s: StepCacheStreamStats() for s in self.config.streams}
        cfg = self.config
        self.plan: dict[str, list[bool]] = {}
        self.last_sigma: dict[Hashable, float] = {}   # lab variant "rate": sigma of each condition's last computed call
        self.last_distance: dict[tuple, float] = {}   # lab variant "cfg": latest distance per (condition, stream)
        self.step_decision: tuple[float, bool] | None = None   # lab variant "cfg": (sigma, skip) of the step's first call
        if cfg.mode == "sigma_schedule" and self.sigmas:
            self.plan = {s: sigma_plan(self.sigmas, cfg.thresholds[s], cfg.start_percent, cfg.end_percent)
                         for s in cfg.streams}

    def _conds(self, keys):
        return [self.conds.setdefault(k, _CondState(acc={})) for k in keys]

    def _cache_reason(self, conds, shapes) -> str | None:
        for c in conds:
            if c.residual is None:
                return "no cached residual"
            if shapes is not None and [tuple(r.shape[1:]) for r in c.residual] != [tuple(s) for s in shapes]:
                return "shape changed"
        return None

    def _finish(self, conds, below: dict[str, bool], distances: dict[str, float], reason: str | None) -> bool:
        # one agreement per decision on every rank (sequence parallel: the same choice everywhere)
        if not self.reducer.agree(reason is None and all(below.values())) and reason is None and all(below.values()):
            reason = "another rank computes"
        if reason is not None:
            self.forced[reason] = self.forced.get(reason, 0) + 1
            self._mark(conds, skip=False)
            return False
        streams = self.config.streams
        for s in streams:
            st = self.stats[s]
            st.decided += 1
            d = distances.get(s, 0.0)
            st.distance_total += d
            st.distance_max = max(st.distance_max, d)
            if below[s]:
                st.would_skip += 1
            elif len(streams) > 1 and all(below[o] for o in streams if o != s):
                st.vetoes += 1
        skip = all(below.values())
        self._mark(conds, skip=skip)
        return skip

    # ------------------------------------------------------------------------------------------- first block
    def decide_first_block(self, keys: Sequence[Hashable], sigma: float, residuals: dict[str, list[torch.Tensor]],
                           shapes: Sequence[tuple] | None = None, force: str | None = None,
                           outputs: dict[str, list[torch.Tensor]] | None = None) -> bool:
        """True = skip the blocks after block 0. ``residuals[stream][k]``: block 0's output minus its input for
        condition ``keys[k]``. The reference residual of a condition moves only when the call computes.
        ``outputs`` (block 0's outputs, same layout) is read only by the lab variant ``out``."""
        if self.config.mode != "first_block":
            raise ValueError(f"decide_first_block on a {self.config.mode!r} state")
        self.calls += 1
        reason = force or self.forced_reason(self.step_index(sigma))
        conds = self._conds(keys)
        streams = [s for s in self.config.streams if residuals.get(s) is not None]
        if reason is None:
            reason = self._cache_reason(conds, shapes)
        if reason is None:
            if any(c.prev.get(s) is None or c.prev[s].shape != residuals[s][ci].shape
                   for ci, c in enumerate(conds) for s in streams):
                reason = "no previous residual"
        below = {s: True for s in self.config.streams}
        distances: dict[str, float] = {}
        v, joint = parse_variant(self.variant)
        if v == "out" and outputs is None:
            raise ValueError("decide_first_block: lab variant 'out' needs outputs")
        if reason is None and v in ("prev", "acc") and any(
                c.prev.get(("step", s)) is None or c.prev[("step", s)].shape != residuals[s][ci].shape
                for ci, c in enumerate(conds) for s in streams):
            reason = "no previous residual"
        follow = None
        if joint and reason is None and self.step_decision is not None and self.step_decision[0] == float(sigma):
            follow = self.step_decision[1]   # a later call of this step: the step's first call decided
        if reason is None and streams:
            rows, tags = [], []
            for ci, c in enumerate(conds):
                for s in streams:
                    r = residuals[s][ci]
                    if v == "l2":
                        rows.append(l2_sums(r, c.prev[s]))
                    elif v == "out":
                        rows.append(l1_sums(outputs[s][ci], c.prev[("out", s)]))
                    elif v in ("prev", "acc"):
                        rows.append(l1_sums(r, c.prev[("step", s)]))
                    else:
                        rows.append(l1_sums(r, c.prev[s]))
                    tags.append((ci, s))
            sums = torch.stack(rows)
            sums = self.reducer.sum(sums)
            vals = sums.detach().to("cpu", torch.float64).tolist()   # the one host sync of the call
            for (ci, s), (num, den) in zip(tags, vals):
                rel = rel_from_sums(num, den)
                if v == "l2":
                    rel = rel ** 0.5
                elif v == "acc":
                    c = conds[ci]
                    rel = c.acc.get(s, 0.0) + rel
                    c.acc[s] = rel
                elif v == "rate":
                    rel = rate_distance(rel, self.last_sigma.get(keys[ci]), float(sigma), self.sigmas)
                if joint:
                    self.last_distance[(keys[ci], s)] = rel
                    rel = max([rel] + [d for (k, st), d in self.last_distance.items() if st == s and k not in keys])
                distances[s] = max(distances.get(s, 0.0), rel)
                thr = self.config.thresholds[s]
                if thr <= 0 or not (rel < thr):
                    below[s] = False
        if follow is not None:   # measured (for the next step's first call), decided by this step's first call
            below = {s: follow for s in self.config.streams}
        skip = self._finish(conds, below, distances, reason)
        if joint and follow is None:
            self.step_decision = (float(sigma), skip)
        for ci, c in enumerate(conds):
            for s in streams:
                if v in ("prev", "acc"):
                    c.prev[("step", s)] = residuals[s][ci].detach().clone()
                if not skip:
                    c.prev[s] = residuals[s][ci].detach().clone()
                    if v == "out":
                        c.prev[("out", s)] = outputs[s][ci].detach().clone()
            if not skip:
                self.last_sigma[keys[ci]] = float(sigma)
        return skip

    # ------------------------------------------------------------------------------------------- sigma schedule
    def decide_schedule(self, keys: Sequence[Hashable], sigma: float, shapes: Sequence[tuple] | None = None,
                        force: str | None = None) -> bool:
        """True = skip the block stack: the plan of this call's step says reuse for every stream."""
        if self.config.mode != "sigma_schedule":
            raise ValueError(f"decide_schedule on a {self.config.mode!r} state")
        self.calls += 1
        step = self.step_index(sigma)
        reason = force or self.forced_reason(step)
        conds = self._conds(keys)
        if reason is None:
            reason = self._cache_reason(conds, shapes)
        below, distances = {}, {}
        for s in self.config.streams:
            plan = self.plan.get(s) or []
            below[s] = bool(plan) and not plan[step]
            last = max((j for j in range(step + 1) if plan and plan[j]), default=step)
            distances[s] = abs(self.sigmas[last] - self.sigmas[step]) if self.sigmas else 0.0
        if reason is None and not self.plan:
            reason = "no schedule"
        return self._finish(conds, below, distances, reason)

    def plan_text(self) -> str:
        """The compute (C) / reuse (.) plan per step of the first stream's plan (sigma mode), '' otherwise."""
        if not self.plan:
            return ""
        merged = [any(p[i] for p in self.plan.values()) for i in range(self.n_steps)]
        return "".join("C" if c else "." for c in merged)

    def report(self) -> StepCacheReport:
        per_cond = [{"condition": str(k)[:12], "computed": c.computed, "skipped": c.skipped}
                    for k, c in self.conds.items()]
        red = "none (this process's sums)" if self.reducer is LOCAL else self.reducer.describe()
        return StepCacheReport(
            mode=self.config.mode, family=self.config.family, steps=self.n_steps, calls=self.calls,
            computed=self.computed, skipped=self.skipped, forced=dict(self.forced),
            streams={s: st.as_dict() for s, st in self.stats.items()}, per_condition=per_cond,
            thresholds=dict(self.config.thresholds), plan=self.plan_text(),
            reducer=red if self.config.mode == "first_block" else "not used (schedule only)", resets=self.resets)


def resolve_thresholds(mode: str, streams: Sequence[str], threshold: float, audio_threshold: float
                       ) -> tuple[dict[str, float], list[str]]:
    """Per-stream thresholds from the node inputs: a negative value takes the mode's lab default (named in the
    returned notes). ``audio`` takes ``audio_threshold``, every other stream ``threshold``."""
    if mode not in MODES:
        raise ValueError(f"unknown step-cache mode {mode!r} (one of {MODES})")
    out, notes = {}, []
    for s in streams:
        v = audio_threshold if s == "audio" else threshold
        if v < 0:
            d = DEFAULT_THRESHOLDS[mode]["audio" if s == "audio" else "video"]
            notes.append(f"{s}: lab default {d} for {mode}")
            v = d
        out[s] = float(v)
    return out, notes
