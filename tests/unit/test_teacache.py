"""TeaCache core: runtime decisions, residual cache, per-condition/per-stream state (no ComfyUI).

Oracles: a float64 re-computation of rel-L1 and numpy's polyval, and an independent straight-line
re-implementation of the reference TeaCache loop (ali-vilab/TeaCache: first/last step computed, accumulate
poly(rel_l1), compute and reset when the accumulator reaches the threshold).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ditkit.cache.coefficients import StreamCoefficients
from ditkit.cache.teacache import TeaCacheConfig, TeaCacheState, rel_l1

POLY = (3.0, -1.0, 0.5, 1.2, 0.01)


def _state(streams=("image",), thr=0.3, start=0.0, end=1.0, coeffs=POLY, x_range=None, cache_device="model"):
    sc = {s: StreamCoefficients(s, coeffs, x_range) for s in streams}
    cfg = TeaCacheConfig("zimage" if streams == ("image",) else "h3", sc, {s: thr for s in streams}, start, end, cache_device)
    return TeaCacheState(cfg)


def _sigmas(n):
    return torch.linspace(1.0, 0.0, n + 1).tolist()


def test_rel_l1_matches_float64():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 17, 5, generator=g)
    b = a + 0.1 * torch.randn(3, 17, 5, generator=g)
    want = (b.double() - a.double()).abs().mean() / a.double().abs().mean()
    assert rel_l1(b, a) == pytest.approx(float(want), rel=1e-6)
    assert rel_l1(b.half(), a.half()) == pytest.approx(float(want), rel=2e-3)


def test_rescale_matches_polyval_and_clamps():
    sc = StreamCoefficients("image", POLY, None)
    for x in (0.0, 0.03, 0.2, 0.7):
        assert sc.rescale(x)[0] == pytest.approx(float(np.polyval(POLY, x)), rel=1e-12)
    sc = StreamCoefficients("image", POLY, (0.05, 0.1))
    y, clamped = sc.rescale(0.5)
    assert clamped and y == pytest.approx(float(np.polyval(POLY, 0.1)))
    y, clamped = sc.rescale(0.07)
    assert not clamped and y == pytest.approx(float(np.polyval(POLY, 0.07)))


def _reference_skips(xs, n_steps, thr, coeffs=POLY):
    """Independent reference loop: xs[i] = rel-L1 of step i vs step i-1 (xs[0] unused)."""
    acc = 0.0
    out = []
    for i in range(n_steps):
        if i == 0 or i == n_steps - 1:
            out.append(False)
            acc = 0.0
            continue
        acc += max(float(np.polyval(coeffs, xs[i])), 0.0)
        if acc < thr:
            out.append(True)
        else:
            out.append(False)
            acc = 0.0
    return out


def _drive(state, n_steps, xs, keys=("c",), stream="image", shape=(1, 4, 8)):
    """Feed modulated inputs whose consecutive rel-L1 are exactly xs (constant positive base, additive step)."""
    sig = _sigmas(n_steps)
    state.begin(sig)
    base = torch.ones(shape)
    cur = base.clone()
    skips = []
    for i in range(n_steps):
        if i > 0:
            cur = cur * (1.0 + xs[i])  # all-positive tensor: rel-L1 == xs[i] exactly
        skip = state.decide(list(keys), sig[i], {stream: [cur] * len(keys)}, shapes=[shape[1:]])
        if not skip:
            state.store(list(keys), [cur.repeat(len(keys), 1, 1)], [cur.repeat(len(keys), 1, 1) * 2])
        skips.append(skip)
    return skips


@pytest.mark.parametrize("thr", [0.02, 0.1, 0.3, 1.0])
def test_decisions_match_reference_loop(thr):
    g = np.random.default_rng(1)
    n = 25
    xs = [0.0] + list(g.uniform(0.0, 0.12, n - 1))
    st = _state(thr=thr)
    got = _drive(st, n, xs)
    want = _reference_skips(xs, n, thr)
    assert got == want
    rep = st.report()
    assert rep.skipped == sum(want) and rep.computed == n - sum(want)
    assert rep.forced["first step"] == 1 and rep.forced["last step"] == 1
    assert rep.streams["image"]["acc_distance_total"] == pytest.approx(
        sum(max(float(np.polyval(POLY, x)), 0.0) for x in xs[1:n - 1]), rel=1e-5)


def test_first_last_and_window_always_compute():
    n = 20
    xs = [0.0] + [1e-4] * (n - 1)  # tiny change: would always skip
    st = _state(thr=10.0, start=0.3, end=0.7)
    got = _drive(st, n, xs)
    for i, s in enumerate(got):
        frac = i / n
        if i == 0 or i == n - 1 or frac < 0.3 or frac > 0.7:
            assert not s, i
    assert any(got)


def test_threshold_zero_never_skips_even_with_negative_polynomial():
    n = 10
    st = _state(thr=0.0, coeffs=(-5.0, -1.0))
    assert not any(_drive(st, n, [0.0] + [0.01] * (n - 1)))


def test_residual_apply_is_input_plus_cached_residual():
    st = _state(thr=100.0)
    sig = _sigmas(6)
    st.begin(sig)
    x0 = torch.randn(2, 3, 4)
    out0 = torch.randn(2, 3, 4)
    keys = ["a", "b"]
    m = torch.rand(1, 5) + 1
    assert not st.decide(keys, sig[0], {"image": [m, m]}, shapes=[(3, 4)])
    st.store(keys, [x0], [out0])
    assert st.decide(keys, sig[1], {"image": [m * 1.001, m * 1.001]}, shapes=[(3, 4)])
    x1 = torch.randn(2, 3, 4)
    (got,) = st.apply(keys, [x1])
    torch.testing.assert_close(got.double(), (x1.double() + (out0.double() - x0.double())), rtol=0, atol=1e-6)


def test_conditions_keep_separate_state_and_batch_decides_jointly():
    st = _state(thr=0.5)
    sig = _sigmas(10)
    st.begin(sig)
    ma = torch.ones(1, 8)
    mb = torch.ones(1, 8)
    shape = [(4,)]
    for i in range(4):
        # cond "a" changes a lot, "b" barely: batched together they must compute every time
        ma = ma * 1.5
        mb = mb * 1.0001
        skip = st.decide(["a", "b"], sig[i], {"image": [ma, mb]}, shapes=shape)
        assert not skip
        st.store(["a", "b"], [torch.zeros(2, 4)], [torch.ones(2, 4)])
    # "b" alone (separate call): small change -> skips, with b's own residual
    mb = mb * 1.0001
    assert st.decide(["b"], sig[4], {"image": [mb]}, shapes=shape)
    (got,) = st.apply(["b"], [torch.zeros(1, 4)])
    assert torch.equal(got, torch.ones(1, 4))
    rep = st.report()
    per = {d["condition"]: d for d in rep.per_condition}
    assert per["a"]["skipped"] == 0 and per["b"]["skipped"] == 1


def test_audio_vetoes_video_skip():
    st = _state(streams=("video", "audio"), thr=0.5)
    sig = _sigmas(10)
    st.begin(sig)
    v = torch.ones(1, 6)
    a = torch.ones(1, 3)
    shapes = [(6,)]
    st.decide(["c"], sig[0], {"video": [v], "audio": [a]}, shapes=shapes)
    st.store(["c"], [torch.zeros(1, 6)], [torch.ones(1, 6)])
    # video nearly static, audio changes a lot -> audio vetoes
    skip = st.decide(["c"], sig[1], {"video": [v * 1.0001], "audio": [a * 3.0]}, shapes=shapes)
    assert not skip
    rep = st.report()
    assert rep.streams["audio"]["vetoes"] == 1 and rep.streams["video"]["would_skip"] == 1
    assert rep.streams["video"]["vetoes"] == 0
    # both static -> skip
    assert st.decide(["c"], sig[2], {"video": [v * 1.0002], "audio": [a * 3.0001]}, shapes=shapes)


def test_schedule_change_and_shape_change_reset():
    st = _state(thr=100.0)
    sig = _sigmas(8)
    st.begin(sig)
    m = torch.rand(1, 4) + 1
    st.decide(["c"], sig[0], {"image": [m]}, shapes=[(4,)])
    st.store(["c"], [torch.zeros(1, 4)], [torch.ones(1, 4)])
    assert st.decide(["c"], sig[1], {"image": [m]}, shapes=[(4,)])
    # different residual shape -> forced compute
    assert not st.decide(["c"], sig[2], {"image": [m]}, shapes=[(5,)])
    assert st.report().forced.get("shape changed") == 1
    # new schedule -> everything dropped, counted as a reset
    assert st.ensure_schedule(_sigmas(12))
    assert st.calls == 0 and not st.conds and st.resets == 1
    assert not st.ensure_schedule(_sigmas(12))


def test_cache_device_cpu_and_release():
    st = _state(thr=100.0, cache_device="cpu")
    sig = _sigmas(4)
    st.begin(sig)
    m = torch.rand(1, 4) + 1
    st.decide(["c"], sig[0], {"image": [m]}, shapes=[(4,)])
    st.store(["c"], [torch.zeros(1, 4)], [torch.ones(1, 4)])
    assert st.conds["c"].residual[0].device.type == "cpu"
    st.release()
    assert st.conds["c"].residual is None and not st.conds["c"].prev


def test_step_index_handles_substeps():
    st = _state()
    sig = [1.0, 0.8, 0.5, 0.2, 0.0]
    st.begin(sig)
    assert [st.step_index(s) for s in (1.0, 0.9, 0.8, 0.6, 0.5, 0.2, 0.1)] == [0, 0, 1, 1, 2, 3, 3]
    assert st.forced_reason(3) == "last step" and st.forced_reason(0) == "first step"


def test_report_summary_names_streams():
    st = _state(streams=("video", "audio"), thr=0.5)
    _drive(st, 6, [0.0] + [0.01] * 5, stream="video")
    rep = st.report()
    text = rep.summary()
    assert "video:" in text and "audio:" in text and "computed" in text
    d = rep.as_dict()
    assert d["calls"] == 6 and set(d["streams"]) == {"video", "audio"}
