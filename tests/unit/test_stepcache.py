"""cache/stepcache.py: the calibration-free step caches' decisions (plain torch, no ComfyUI).

Oracles written here: relative L1 with numpy, the sigma plan rule spelled out per case, FirstBlockCache's
"reference moves only on a computed call" rule traced by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditkit.parallel.reduce import as_reducer

from ditkit.cache.stepcache import (DEFAULT_THRESHOLDS, StepCacheConfig, StepCacheState, l1_sums, rel_from_sums,
                                    resolve_thresholds, sigma_plan)

SIG10 = [1.0, 0.9375, 0.875, 0.8125, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]  # 10 steps, exact in binary


def _np_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).sum() / np.abs(b).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_l1_sums_every_dtype_and_strided(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 8, generator=g).to(dtype)
    b = torch.randn(6, 8, generator=g).to(dtype)
    at, bt = a.t(), b.t()   # non-contiguous
    assert not at.is_contiguous()
    s = l1_sums(at, bt)
    assert s.dtype == torch.float64 and s.shape == (2,)
    ref = _np_rel(at.double().numpy(), bt.double().numpy())
    assert rel_from_sums(*s.tolist()) == pytest.approx(ref, rel=1e-12)
    assert s[1].item() == pytest.approx(np.abs(bt.double().numpy()).sum(), rel=1e-12)
    sl = l1_sums(a[:, ::2], b[:, ::2])  # strided slice
    assert rel_from_sums(*sl.tolist()) == pytest.approx(_np_rel(a[:, ::2].double().numpy(), b[:, ::2].double().numpy()))


def test_l1_sums_shape_mismatch_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        l1_sums(torch.zeros(2, 3), torch.zeros(3, 2))


def test_rel_from_sums_edges():
    assert rel_from_sums(0.0, 0.0) == 0.0
    assert rel_from_sums(1e-30, 0.0) == math.inf
    assert rel_from_sums(1.0, 4.0) == 0.25


def test_sums_are_additive_over_shards():
    """The reducer contract: rel-L1 of the whole = ratio of summed shard sums (what an all-reduce computes)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)
    parts = sum(l1_sums(a[i:i + 4], b[i:i + 4]) for i in range(0, 16, 4))
    assert rel_from_sums(*parts.tolist()) == pytest.approx(_np_rel(a.numpy(), b.numpy()), rel=1e-12)


def test_sigma_plan_boundaries():
    # threshold 0.125: from step 0 (1.0): 0.9375 (0.0625 <) reuse, 0.875 (0.125 == thr, not <) compute at 2;
    # 0.8125 reuse, 0.75 compute 4; 0.625, 0.5, 0.375, 0.25 each 0.125 away: compute; last step 9 forced
    assert sigma_plan(SIG10, 0.125) == [True, False, True, False, True, True, True, True, True, True]
    # a hair above: equal distances now reuse
    assert sigma_plan(SIG10, 0.125 + 1e-9) == [True, False, False, True, False, True, False, True, False, True]
    assert sigma_plan(SIG10, 0.0) == [True] * 10
    assert sigma_plan(SIG10, -1.0) == [True] * 10
    big = sigma_plan(SIG10, 10.0)
    assert big[0] and big[-1] and not any(big[1:-1])
    assert sigma_plan([1.0, 0.0], 10.0) == [True]
    assert sigma_plan([], 1.0) == []


def test_sigma_plan_start_end_percent_boundaries():
    # step i computes when i/n < start or i/n > end; n = 10
    p = sigma_plan(SIG10, 10.0, start_percent=0.3, end_percent=0.7)
    assert p == [True, True, True, False, False, False, False, False, True, True]  # 0.3 and 0.7 themselves may skip
    p = sigma_plan(SIG10, 10.0, start_percent=0.30001, end_percent=0.69999)
    assert p[3] and p[7]


def test_sigma_plan_is_a_function_of_its_arguments_only():
    a = sigma_plan(SIG10, 0.07)
    torch.manual_seed(123)
    assert sigma_plan(list(SIG10), 0.07) == a == sigma_plan(tuple(SIG10), 0.07)
    assert sigma_plan(torch.tensor(SIG10).tolist(), 0.07) == a


def _state(mode="first_block", thr=None, streams=("video", "audio"), **kw):
    thr = thr or {s: 0.1 for s in streams}
    return StepCacheState(StepCacheConfig("h3", mode, streams, thr, **kw))


def _res(v, a=None):
    out = {"video": [torch.full((4, 3), float(v))]}
    if a is not None:
        out["audio"] = [torch.full((2, 3), float(a))]
    return out


def _run_fb(st, seq, key="c"):
    """seq: per step (video value, audio value); returns skips. Stores a residual after each compute."""
    st.begin(SIG10)
    skips = []
    for i, (v, a) in enumerate(seq):
        skip = st.decide_first_block([key], SIG10[i], _res(v, a), shapes=[(3,)])
        if skip:
            st.apply([key], [torch.zeros(1, 3)])
        else:
            st.store([key], [torch.zeros(1, 3)], [torch.ones(1, 3)])
        skips.append(skip)
    return skips


def test_first_block_threshold_boundary_both_sides():
    # reference 1.0 at step 0; step 1 rel = |x - 1| / 1
    st = _state(thr={"video": 0.25, "audio": 10.0})
    # step 1: 0.25 == thr: compute (reference -> 1.25); step 2: |1 - 1.25| / 1.25 = 0.2 < thr: skip
    assert _run_fb(st, [(1.0, 1.0), (1.25, 1.0), (1.0, 1.0)]) == [False, False, True]
    st = _state(thr={"video": 0.25, "audio": 10.0})
    assert _run_fb(st, [(1.0, 1.0), (1.2499, 1.0), (1.0, 1.0)]) == [False, True, True]
    st = _state(thr={"video": 10.0, "audio": 10.0})
    assert _run_fb(st, [(1.0, 1.0)] * 10) == [False] + [True] * 8 + [False]  # first and last step forced


def test_first_block_reference_moves_only_on_compute():
    # thr 0.25: 1.0 (ref) -> 1.2 (0.2 skip, ref stays 1.0) -> 1.3 (0.3 vs 1.0: compute, ref 1.3) -> 1.4 (0.077 skip)
    st = _state(thr={"video": 0.25, "audio": 10.0})
    seq = [(1.0, 1), (1.2, 1), (1.3, 1), (1.4, 1), (1.0, 1), (1.0, 1), (1.0, 1), (1.0, 1), (1.0, 1), (1.0, 1)]
    skips = _run_fb(st, seq)
    assert skips[:4] == [False, True, False, True]
    rep = st.report()
    assert rep.streams["video"]["distance_max"] == pytest.approx(max(0.3, abs(1.0 - 1.3) / 1.3), abs=1e-9)


def test_first_block_audio_vetoes_and_is_counted():
    st = _state(thr={"video": 0.5, "audio": 0.05})
    skips = _run_fb(st, [(1.0, 1.0), (1.1, 1.1), (1.0, 1.0)])
    assert skips == [False, False, False]
    rep = st.report()
    # steps 1 and 2: video 0.1 and 0.0909 < 0.5, audio the same > 0.05: two audio vetoes
    assert rep.streams["audio"]["vetoes"] == 2 and rep.streams["video"]["vetoes"] == 0
    assert rep.streams["video"]["would_skip"] == 2 and rep.streams["audio"]["would_skip"] == 0


def test_first_block_zero_threshold_never_skips():
    st = _state(thr={"video": 0.0, "audio": 0.0})
    assert not any(_run_fb(st, [(1.0, 1.0)] * 10))


def test_first_block_every_condition_must_agree():
    st = _state(thr={"video": 0.25, "audio": 10.0})
    st.begin(SIG10)
    keys = ["a", "b"]

    def res(va, vb):
        return {"video": [torch.full((2,), va), torch.full((2,), vb)], "audio": [torch.ones(2), torch.ones(2)]}

    assert not st.decide_first_block(keys, SIG10[0], res(1.0, 1.0), shapes=[(3,)])
    st.store(keys, [torch.zeros(2, 3)], [torch.ones(2, 3)])
    assert not st.decide_first_block(keys, SIG10[1], res(1.0, 2.0), shapes=[(3,)])  # b changed by 1.0
    st.store(keys, [torch.zeros(2, 3)], [torch.ones(2, 3)])
    assert st.decide_first_block(keys, SIG10[2], res(1.01, 2.01), shapes=[(3,)])
    out = st.apply(keys, [torch.zeros(2, 3)])[0]
    assert torch.equal(out, torch.ones(2, 3))
    assert [c["skipped"] for c in st.report().per_condition] == [1, 1]


def test_first_block_shape_change_and_missing_residual_force_compute():
    st = _state()
    st.begin(SIG10)
    assert not st.decide_first_block(["c"], SIG10[0], _res(1, 1), shapes=[(3,)])
    assert not st.decide_first_block(["c"], SIG10[1], _res(1, 1), shapes=[(3,)])  # nothing stored yet
    st.store(["c"], [torch.zeros(1, 3)], [torch.ones(1, 3)])
    assert not st.decide_first_block(["c"], SIG10[2], _res(1, 1), shapes=[(5,)])
    assert st.decide_first_block(["c"], SIG10[3], _res(1, 1), shapes=[(3,)])
    f = st.report().forced
    assert f["first step"] == 1 and f["no cached residual"] == 1 and f["shape changed"] == 1


def test_reducer_gets_all_sums_and_its_result_decides():
    seen = []

    def reducer(s):
        seen.append(s.clone())
        return s + torch.tensor([[1e3, 0.0]], dtype=s.dtype)   # inflate every numerator: never below

    st = _state(thr={"video": 0.5, "audio": 0.5})
    st.reducer = as_reducer(reducer)
    assert not any(_run_fb(st, [(1.0, 1.0), (1.01, 1.01), (1.01, 1.01), (1.0, 1.0)]))
    assert seen and all(s.shape == (2, 2) and s.dtype == torch.float64 for s in seen)
    assert st.report().reducer == "reducer"
    assert st.clone().reducer is st.reducer and st.reducer.fn is reducer


def test_schedule_mode_follows_the_plan():
    st = _state("sigma_schedule", thr={"video": 0.1, "audio": 0.1})
    st.begin(SIG10)
    plan = sigma_plan(SIG10, 0.125)
    got = []
    for i in range(10):
        skip = st.decide_schedule(["c"], SIG10[i], shapes=[(3,)])
        if not skip:
            st.store(["c"], [torch.zeros(1, 3)], [torch.ones(1, 3)])
        got.append(not skip)
    assert got == plan
    assert st.report().plan == "".join("C" if c else "." for c in plan)


def test_schedule_mode_audio_threshold_vetoes():
    st = _state("sigma_schedule", thr={"video": 10.0, "audio": 0.0})
    st.begin(SIG10)
    for i in range(10):
        assert not st.decide_schedule(["c"], SIG10[i], shapes=[(3,)])
        st.store(["c"], [torch.zeros(1, 3)], [torch.ones(1, 3)])
    rep = st.report()
    assert rep.skipped == 0 and rep.streams["audio"]["vetoes"] == 8


def test_mode_mismatch_and_bad_config_refused():
    with pytest.raises(ValueError, match="unknown step-cache mode"):
        StepCacheConfig("h3", "teacache", ("video",), {"video": 0.1})
    with pytest.raises(ValueError, match="no threshold"):
        StepCacheConfig("h3", "first_block", ("video", "audio"), {"video": 0.1})
    with pytest.raises(ValueError, match="decide_schedule"):
        _state("first_block").decide_schedule(["c"], 1.0)
    with pytest.raises(ValueError, match="decide_first_block"):
        _state("sigma_schedule").decide_first_block(["c"], 1.0, {})


def test_resolve_thresholds_defaults_only_below_zero():
    thr, notes = resolve_thresholds("first_block", ("video", "audio"), -1.0, 0.0)
    assert thr == {"video": DEFAULT_THRESHOLDS["first_block"]["video"], "audio": 0.0} and len(notes) == 1
    thr, notes = resolve_thresholds("sigma_schedule", ("image",), -1e-9, -1.0)
    assert thr == {"image": DEFAULT_THRESHOLDS["sigma_schedule"]["video"]} and len(notes) == 1
    thr, notes = resolve_thresholds("sigma_schedule", ("image",), 0.0, -1.0)
    assert thr == {"image": 0.0} and not notes
    with pytest.raises(ValueError):
        resolve_thresholds("bogus", ("image",), 0.1, 0.1)


def test_state_is_fresh_per_run():
    st = _state()
    _run_fb(st, [(1.0, 1.0)] * 3)
    c = st.clone()
    assert c.calls == 0 and not c.conds
    st.begin(SIG10)
    assert st.calls == 0 and not st.conds
    assert "first-block residual" in _state().report().summary()
