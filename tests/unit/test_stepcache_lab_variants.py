"""cache/stepcache.py: the lab-only first_block decision variants (issue #33 experiment, LAB_FIRST_BLOCK_VARIANT).

Oracles written here: relative L2 with numpy, the sigma-rate formula spelled out, every decision sequence traced by
hand with values exact in binary (each threshold tested on both sides of the traced distance)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditkit.cache import stepcache as sc
from ditkit.cache.stepcache import (LAB_VARIANTS, StepCacheConfig, StepCacheState, l2_sums, parse_variant,
                                    rate_distance, rel_from_sums)

SIG10 = [1.0, 0.9375, 0.875, 0.8125, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]  # 10 steps, exact in binary
EPS = 1e-9


def _state(variant, thr_video, monkeypatch, thr_audio=10.0):
    monkeypatch.setattr(sc, "LAB_FIRST_BLOCK_VARIANT", variant)
    return StepCacheState(StepCacheConfig("h3", "first_block", ("video", "audio"),
                                          {"video": thr_video, "audio": thr_audio}))


def _v(x):
    return torch.full((4, 3), float(x)) if not isinstance(x, torch.Tensor) else x


def _run(st, seq, key="c", outs=None, sigmas=SIG10):
    """seq: per step the video residual (a value or a tensor); audio constant 1. Returns the skips."""
    st.begin(sigmas)
    skips = []
    for i, v in enumerate(seq):
        res = {"video": [_v(v)], "audio": [torch.ones(2, 3)]}
        out = None if outs is None else {"video": [_v(outs[i])], "audio": [torch.ones(2, 3)]}
        skip = st.decide_first_block([key], sigmas[i], res, shapes=[(3,)], outputs=out)
        if skip:
            st.apply([key], [torch.zeros(1, 3)])
        else:
            st.store([key], [torch.zeros(1, 3)], [torch.ones(1, 3)])
        skips.append(skip)
    return skips


# ------------------------------------------------------------------------------------------------ helpers

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_l2_sums_every_dtype_and_strided(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 8, generator=g).to(dtype)
    b = torch.randn(6, 8, generator=g).to(dtype)
    at, bt = a.t(), b.t()
    assert not at.is_contiguous()
    s = l2_sums(at, bt)
    assert s.dtype == torch.float64 and s.shape == (2,)
    an, bn = at.double().numpy(), bt.double().numpy()
    assert s[0].item() == pytest.approx(((an - bn) ** 2).sum(), rel=1e-12)
    assert s[1].item() == pytest.approx((bn ** 2).sum(), rel=1e-12)
    sl = l2_sums(a[:, ::2], b[:, ::2])
    an, bn = a[:, ::2].double().numpy(), b[:, ::2].double().numpy()
    assert math.sqrt(rel_from_sums(*sl.tolist())) == pytest.approx(
        np.sqrt(((an - bn) ** 2).sum()) / np.sqrt((bn ** 2).sum()), rel=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        l2_sums(torch.zeros(2, 3), torch.zeros(3, 2))


def test_rate_distance_formula_and_edges():
    # mean step of SIG10 = (1 - 0) / 10; 0.125 over a sigma distance 0.0625 = 2 per sigma unit -> 0.2 per mean step
    assert rate_distance(0.125, 1.0, 0.9375, SIG10) == pytest.approx(0.125 / 0.0625 * 0.1, rel=1e-15)
    assert rate_distance(0.3, 0.75, 0.25, [2.0, 1.0, 0.0]) == pytest.approx(0.3 / 0.5 * 1.0, rel=1e-15)
    assert rate_distance(0.0, 1.0, 0.5, SIG10) == 0.0
    assert rate_distance(0.1, None, 0.5, SIG10) == math.inf        # no computed call yet
    assert rate_distance(0.1, 0.5, 0.5, SIG10) == math.inf         # same sigma
    assert rate_distance(0.1, 0.4, 0.5, SIG10) == math.inf         # sigma went up
    assert rate_distance(0.1, 1.0, 0.5, [1.0]) == math.inf         # no schedule step


def test_parse_variant_accepts_and_refuses():
    for v in LAB_VARIANTS:
        assert parse_variant(v) == (("last" if v == "cfg" else v), v == "cfg")
    assert parse_variant("acc+cfg") == ("acc", True) and parse_variant("cfg+l2") == ("l2", True)
    for bad in ("bogus", "acc+l2", "cfg+cfg", "", "acc+"):
        with pytest.raises(ValueError, match="lab variant"):
            parse_variant(bad)


def test_state_reads_the_switch_once_and_clone_keeps_it(monkeypatch):
    st = _state("acc", 0.2, monkeypatch)
    assert st.variant == "acc"
    monkeypatch.setattr(sc, "LAB_FIRST_BLOCK_VARIANT", "")
    assert st.clone().variant == "acc"
    assert StepCacheState(st.config).variant == "last"        # "" = the shipped rule
    monkeypatch.setattr(sc, "LAB_FIRST_BLOCK_VARIANT", "nope")
    with pytest.raises(ValueError, match="lab variant"):
        StepCacheState(st.config)


def test_default_is_the_shipped_rule(monkeypatch):
    # 1, 1.125, 1.265625, 1.423828125: each 1.125x the last (per-step change 0.125); vs the last computed reference
    seq = [1.0, 1.125, 1.265625, 1.423828125]
    assert _run(_state("", 0.2, monkeypatch), seq) == [False, True, False, True]
    assert _run(_state("last", 0.2, monkeypatch), seq) == [False, True, False, True]


# ------------------------------------------------------------------------------------------------ variants

def test_prev_compares_with_the_previous_call(monkeypatch):
    seq = [1.0, 1.125, 1.265625, 1.423828125, 1.423828125]
    # every per-step change is 0.125 (< 0.2): all skip though the drift from step 0 grows past 0.4
    assert _run(_state("prev", 0.2, monkeypatch), seq) == [False, True, True, True, True]
    # boundary: 0.125 == thr computes, a hair above skips
    assert _run(_state("prev", 0.125, monkeypatch), seq[:3]) == [False, False, False]
    assert _run(_state("prev", 0.125 + EPS, monkeypatch), seq[:3]) == [False, True, True]


def test_acc_sums_the_per_step_change_since_the_last_compute(monkeypatch):
    # 1 -> 1.125 (0.125) -> 1.265625 (0.125): sum 0.25 at step 2
    seq = [1.0, 1.125, 1.265625, 1.265625]
    assert _run(_state("acc", 0.25, monkeypatch), seq) == [False, True, False, True]   # 0.25 == thr: compute,
    assert _run(_state("acc", 0.25 + EPS, monkeypatch), seq) == [False, True, True, True]  # reset; then 0 skips
    # back and forth: 1 -> 1.125 (0.125) -> 1 (0.125/1.125 = 0.111): the shipped rule sees 0 at step 2, acc 0.236
    back = [1.0, 1.125, 1.0]
    assert _run(_state("last", 0.2, monkeypatch), back) == [False, True, True]
    assert _run(_state("acc", 0.2, monkeypatch), back) == [False, True, False]
    assert _run(_state("acc", 0.125 + 0.125 / 1.125 + EPS, monkeypatch), back) == [False, True, True]
    st = _state("acc", 0.2, monkeypatch)
    _run(st, back)
    assert st.report().streams["video"]["distance_max"] == pytest.approx(0.125 + 0.125 / 1.125, abs=1e-6)


def test_rate_divides_by_the_sigma_distance(monkeypatch):
    # step 1: change 0.125 over sigma 1 -> 0.9375 (0.0625), mean step 0.1: 0.2
    seq = [1.0, 1.125, 1.125]
    assert _run(_state("rate", 0.2, monkeypatch), seq) == [False, False, True]
    assert _run(_state("rate", 0.2 + EPS, monkeypatch), seq) == [False, True, True]
    # step 2 after a skip: change 0.125 vs step 0 over sigma 0.125: 0.1 (the reference sigma is the computed one)
    seq = [1.0, 1.0, 1.125]
    assert _run(_state("rate", 0.1, monkeypatch), seq) == [False, True, False]
    assert _run(_state("rate", 0.1 + EPS, monkeypatch), seq) == [False, True, True]


def test_l2_is_relative_l2_against_the_last_compute(monkeypatch):
    ref = torch.ones(4, 3)
    cur = torch.ones(4, 3)
    cur[0, 0] = 4.0   # L1: 3 / 12 = 0.25; L2: sqrt(9 / 12) = 0.866
    assert _run(_state("last", 0.3, monkeypatch), [ref, cur]) == [False, True]
    d = math.sqrt(9 / 12)
    assert _run(_state("l2", d, monkeypatch), [ref, cur]) == [False, False]
    assert _run(_state("l2", d + EPS, monkeypatch), [ref, cur]) == [False, True]


def test_out_measures_block0_output_and_needs_it(monkeypatch):
    # residual constant (shipped rule: 0, skip); block-0 output 1 -> 1.25 (0.25)
    res, outs = [1.0, 1.0], [1.0, 1.25]
    assert _run(_state("out", 0.25, monkeypatch), res, outs=outs) == [False, False]
    assert _run(_state("out", 0.25 + EPS, monkeypatch), res, outs=outs) == [False, True]
    st = _state("out", 0.25, monkeypatch)
    st.begin(SIG10)
    with pytest.raises(ValueError, match="needs outputs"):
        st.decide_first_block(["c"], SIG10[0], {"video": [torch.ones(4, 3)]}, shapes=[(3,)])


def _cfg_step(st, i, vc, vu):
    """One step as ComfyUI runs it on the lab: cond call, then uncond call. Returns (cond skip, uncond skip)."""
    got = []
    for key, v in (("c", vc), ("u", vu)):
        skip = st.decide_first_block([key], SIG10[i], {"video": [_v(v)], "audio": [torch.ones(2, 3)]},
                                     shapes=[(3,)])
        if skip:
            st.apply([key], [torch.zeros(1, 3)])
        else:
            st.store([key], [torch.zeros(1, 3)], [torch.ones(1, 3)])
        got.append(skip)
    return tuple(got)


@pytest.mark.parametrize("variant", ["cfg", "last+cfg"])
def test_cfg_one_decision_per_step(monkeypatch, variant):
    st = _state(variant, 0.2, monkeypatch)
    st.begin(SIG10)
    assert _cfg_step(st, 0, 1.0, 1.0) == (False, False)          # first step forced
    # step 1: cond changes 0.125 (< 0.2, no uncond distance yet): both skip, though uncond changed by 1.0
    assert _cfg_step(st, 1, 1.125, 2.0) == (True, True)
    # step 2: cond 0.125 again, but uncond's latest distance (1.0 at step 1) is counted: both compute
    assert _cfg_step(st, 2, 1.125, 2.0) == (False, False)
    # step 3: cond 0, uncond's latest 1.0 (measured at step 2 against step 0) -> compute again; step 4: both 0
    assert _cfg_step(st, 3, 1.125, 2.0) == (False, False)
    assert _cfg_step(st, 4, 1.125, 2.0) == (True, True)
    # the shipped rule decides each call alone: step 1 cond skips, uncond computes
    st = _state("last", 0.2, monkeypatch)
    st.begin(SIG10)
    _cfg_step(st, 0, 1.0, 1.0)
    assert _cfg_step(st, 1, 1.125, 2.0) == (True, False)


def test_cfg_leader_boundary_both_sides(monkeypatch):
    for thr, want in ((0.125, (False, False)), (0.125 + EPS, (True, True))):
        st = _state("cfg", thr, monkeypatch)
        st.begin(SIG10)
        _cfg_step(st, 0, 1.0, 1.0)
        _cfg_step(st, 1, 1.0, 1.125)        # cond 0 -> skip (no uncond distance yet), uncond follows; measures 0.125
        assert _cfg_step(st, 2, 1.0, 1.0) == want   # cond 0, uncond's latest 0.125


def test_acc_cfg_combines(monkeypatch):
    st = _state("acc+cfg", 0.2, monkeypatch)
    st.begin(SIG10)
    _cfg_step(st, 0, 1.0, 1.0)
    assert _cfg_step(st, 1, 1.125, 1.0) == (True, True)      # cond acc 0.125
    assert _cfg_step(st, 2, 1.0, 1.0) == (False, False)      # cond acc 0.125 + 0.111 = 0.236
