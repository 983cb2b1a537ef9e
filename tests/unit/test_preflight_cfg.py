"""The conditioning batch under classifier-free guidance (``memory/preflight.py``): ComfyUI 0.33 runs the negative
only when ``math.isclose(cfg, 1.0)`` is False (relative tolerance 1e-9) or ``disable_cfg1_optimization`` is set,
concatenates conditionings of equal shapes into one forward, and tries ``n, n // 2, n // 3 ...`` of them while its
own memory estimate fits. Oracles are written here: the tolerance as arithmetic, the halving as the sizes asked."""
from __future__ import annotations

import math

import pytest

from ditkit.memory.model import DiTDims, MemoryModelError, Options, Tokens, Weights, activation_parts
from ditkit.memory.preflight import CondBatch, check_cfg, cond_batch, plan, uncond_runs


def isclose_oracle(a: float) -> bool:
    return abs(a - 1.0) <= 1e-9 * max(abs(a), 1.0)


@pytest.mark.parametrize("cfg, runs", [(1.0, False), (1, False), (1 + 1e-10, False), (1 - 1e-10, False),
                                       (1 + 0.9e-9, False), (1 + 1.1e-9, True), (1 - 1.1e-9, True),
                                       (1.0000001, True), (0.9999999, True), (0.0, True), (7.0, True), (-1.0, True)])
def test_uncond_runs_at_the_isclose_boundary_both_sides(cfg, runs):
    assert isclose_oracle(cfg) is not runs          # the oracle agrees with the expectation written here
    assert uncond_runs(cfg) is runs


@pytest.mark.parametrize("flag, runs", [(False, False), (None, True), (0, False), (0.0, False), (True, True),
                                        (1, True), ("", True)])
def test_disable_cfg1_optimization_compared_as_the_host_does(flag, runs):
    # ComfyUI: ``model_options.get("disable_cfg1_optimization", False) == False`` keeps the optimization
    assert uncond_runs(1.0, flag) is runs
    assert uncond_runs(7.0, flag) is True


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_cfg_refused_by_name(bad):
    for f in (check_cfg, uncond_runs):
        with pytest.raises(MemoryModelError, match=r"^cfg must be finite, got"):
            f(bad)
    with pytest.raises(MemoryModelError, match=r"^the sampler's cfg must be finite"):
        check_cfg(bad, "the sampler's cfg")
    with pytest.raises(MemoryModelError, match=r"^cfg must be finite"):
        cond_batch(bad, [()], [()])


@pytest.mark.parametrize("bad", ["7", None, True, [7.0]])
def test_cfg_that_is_not_a_number_refused(bad):
    with pytest.raises(MemoryModelError, match=r"^cfg must be a number"):
        check_cfg(bad)


def test_check_cfg_returns_a_float():
    assert check_cfg(7) == 7.0 and isinstance(check_cfg(7), float)


def test_cfg1_runs_the_cond_alone_and_says_so():
    b = cond_batch(1.0, [("a",)], [("a",)])
    assert (b.groups, b.latent, b.total) == (1, 1, 1)
    assert b.reason == "cfg 1: ComfyUI skips the uncond"
    assert b.describe() == "batch 1 = 1 conditioning (cfg 1: ComfyUI skips the uncond)"


def test_cfg_above_one_batches_equal_shapes():
    b = cond_batch(1.0000001, [("a",)], [("a",)])
    assert b.groups == 2
    assert b.reason == "cfg 1: the uncond runs; ComfyUI batches 2 into one forward"
    b = cond_batch(7.0, [("a",)], [("a",)], latent_batch=3, uncond_assumed=True)
    assert (b.groups, b.total) == (2, 6)
    assert b.describe() == ("batch 6 = 2 conditionings x latent batch 3 (cfg 7: the uncond runs (its shape assumed "
                            "the cond's); ComfyUI batches 2 into one forward)")


def test_different_shapes_and_none_keys_run_one_forward_each():
    b = cond_batch(7.0, [("a",)], [("b",)])
    assert b.groups == 1 and b.reason.endswith("their shapes differ: one forward each")
    assert cond_batch(7.0, [None], [None]).groups == 1
    # the largest set of equal keys is the forward's batch
    assert cond_batch(7.0, [("a",), ("b",)], [("a",), ("a",)]).groups == 3


def test_a_model_that_never_concatenates():
    b = cond_batch(7.0, [("a",)], [("a",)], concatenates=False)
    assert b.groups == 1 and b.reason == "cfg 7: the uncond runs; this model never batches conditionings: one forward each"
    assert cond_batch(1.0, [("a",)], [("a",)], concatenates=False).reason == "cfg 1: ComfyUI skips the uncond"


def test_disable_flag_runs_the_uncond_at_cfg1():
    b = cond_batch(1.0, [()], [()], disable_cfg1_optimization=True)
    assert b.groups == 2 and b.reason.startswith("cfg 1: the uncond runs (disable_cfg1_optimization)")


def test_guider_with_its_own_rule_runs_everything():
    b = cond_batch(1.0, [()], [(), ()], guider="Guider_DualCFG")
    assert b.groups == 3
    assert b.reason.startswith("Guider_DualCFG: its own guidance rule, every conditioning taken to run")


@pytest.mark.parametrize("n, fitting, asked, chosen", [
    (2, {2}, [2], 2), (2, {1}, [2, 1], 1), (2, set(), [2, 1], 1),
    (4, {2, 1}, [4, 2], 2), (3, {1}, [3, 1], 1), (4, set(), [4, 2, 1, 1], 1)])
def test_comfyui_halving_on_its_own_memory_estimate(n, fitting, asked, chosen):
    seen = []

    def fits(k):
        seen.append(k)
        return k in fitting

    b = cond_batch(7.0, [()] * (n - 1), [()], fits=fits)
    assert seen == asked                               # n // i for i = 1, 2, ... until one fits
    assert b.groups == chosen
    if chosen < n:
        assert f"ComfyUI's own memory estimate for {n} does not fit the free memory: {chosen} per forward" in b.reason


def test_no_conditioning_counts_one():
    assert cond_batch(7.0, [], []).groups == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_latent_batch_refused(bad):
    with pytest.raises(MemoryModelError, match="latent batch must be an int >= 1"):
        cond_batch(7.0, [()], [()], latent_batch=bad)


DIMS = DiTDims("ltx2", 64, 4, 16, 256, 2, ffn_kind="gelu", extra_cols=0)
W = Weights((1000, 1000), 500, 64 * 256)


def test_the_plan_reports_the_batch_and_doubles_the_activations():
    tok = Tokens(video=1000)
    one = plan(DIMS, {"bf16": W}, tok, Options(attention="flash", batch=1), 1 << 40, "free", False)
    b = CondBatch(2, 1, "cfg 7: the uncond runs; ComfyUI batches 2 into one forward")
    two = plan(DIMS, {"bf16": W}, tok, Options(attention="flash", batch=b.total), 1 << 40, "free", False)
    two.batch = b
    # flash attention, GELU: every activation term is linear in the rows: twice the rows, twice the bytes
    s, D, I, F = 1000, 64, 64, 256
    assert activation_parts(DIMS, tok, Options(attention="flash", batch=2))["block_peak"] == \
        2 * s * (2 * D + max(2 * D + 6 * I, 2 * D + 2 * F)) * 2
    assert two.prediction.parts["block_peak"] == 2 * one.prediction.parts["block_peak"]
    assert "batch 2 = 2 conditionings (cfg 7: the uncond runs; ComfyUI batches 2 into one forward); predicted" \
        in two.summary()
    assert two.as_dict()["batch"] == 2 and two.as_dict()["batch_reason"] == b.reason
    assert "batch" not in one.summary().split(";")[0] and "batch_reason" not in one.as_dict()
    two.note = "at cfg 1: batch 1, predicted 0.00 GiB, fits"
    assert "] (at cfg 1: batch 1, predicted 0.00 GiB, fits): fits" in two.summary()


def test_isclose_oracle_matches_math():
    for v in (1.0, 1 + 1e-10, 1.0000001, 7.0):
        assert isclose_oracle(v) == math.isclose(v, 1.0)
