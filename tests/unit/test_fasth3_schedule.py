"""FastH3 schedules (ditkit.sampling.fasth3) without ComfyUI.

Oracles are written here, not taken from the code under test: the published ladders (FastVideo PR 1852 /
the V2 contract, vllm-omni PR 6714), the shift formula sigma = s*b / (1 + (s-1)*b) on b = rung/1000 (+ 0),
evaluated in float64 and in the float32 operation order vllm-omni's ``_time_shift_sigmas`` uses, and the
sigma values listed in the H3 reference notes."""
from __future__ import annotations

import json

import pytest
import torch

from ditkit.errors import DitKitError, ScheduleError
from ditkit.sampling import fasth3 as f

V2_RUNGS = [999, 874, 749, 624, 500, 375, 250, 125]
PREVIEW_RUNGS = [999, 749, 500, 250]
PUBLISHED = {  # recipe -> (rungs, video shift, audio shift)
    "fasth3_8step_v2": (V2_RUNGS, 10.0, 3.0),
    "fasth3_preview_4step": (PREVIEW_RUNGS, 12.0, 3.0),
}
# 5-significant-digit values computed for the reference notes (h3.md section 3.1)
NOTES = {("fasth3_8step_v2", "video"): [0.99990, 0.98579, 0.96758, 0.94317, 0.90909, 0.85714, 0.76923, 0.58824, 0],
         ("fasth3_8step_v2", "audio"): [0.99967, 0.95415, 0.89952, 0.83274, 0.75, 0.64286, 0.5, 0.3, 0],
         ("fasth3_preview_4step", "video"): [0.99992, 0.97283, 0.92308, 0.8, 0]}


def _f64(rungs, s):
    out = []
    for b in [r / 1000.0 for r in rungs] + [0.0]:
        out.append(s * b / (1.0 + (s - 1.0) * b))
    return out


def _f32(rungs, s):
    base = torch.tensor([r / 1000.0 for r in rungs] + [0.0], dtype=torch.float32)
    return s * base / (1 + (s - 1) * base)


def v2_contract(**over):
    c = {"schema_version": "fasth3-inference-contract-v1", "model_id": "FastVideo/FastVideo-FastH3-8-Step-V2",
         "dmd_denoising_steps": list(V2_RUNGS), "num_inference_steps": 9, "transformer_forwards": 8,
         "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0, "guidance_scale": 1.0,
         "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8, "vsa_tile_size": 64, "task": "t2av"}
    c.update(over)
    return {k: v for k, v in c.items() if v is not ...}


def preview_contract(**over):  # Preview v1 exports carry only the ladder
    c = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": list(PREVIEW_RUNGS),
         "num_inference_steps": 5, "transformer_forwards": 4, "guidance_scale": 1.0, "task": "t2av"}
    c.update(over)
    return c


@pytest.mark.parametrize("recipe", list(PUBLISHED))
def test_schedule_is_the_published_ladder_shifted_once(recipe):
    rungs, sv, sa = PUBLISHED[recipe]
    s = f.resolve_schedule(recipe)
    assert list(s.rungs) == rungs and s.video_shift == sv and s.audio_shift == sa
    assert s.forwards == len(rungs) and s.video_sigmas.numel() == len(rungs) + 1  # N forwards, N + 1 points
    for got, shift in ((s.video_sigmas, sv), (s.audio_sigmas, sa)):
        assert got.dtype == torch.float32 and got[-1].item() == 0.0 and bool((got[1:] < got[:-1]).all())
        assert torch.equal(got, _f32(rungs, shift))  # vllm-omni's float32 arithmetic, bit for bit
        # the exact (float64) formula to two float32 ulps (float32 arithmetic rounds at each operation)
        assert (got.double() - torch.tensor(_f64(rungs, shift), dtype=torch.float64)).abs().max() <= 1.2e-7
        # shifted exactly once: shifting the shifted values again is a different ladder
        twice = _f64([round(1000 * v) for v in _f64(rungs, shift)[:-1]], shift)
        assert (got.double() - torch.tensor(twice, dtype=torch.float64)).abs().max() > 1e-3


@pytest.mark.parametrize("key", list(NOTES))
def test_schedule_matches_the_reference_notes(key):
    recipe, stream = key
    s = f.resolve_schedule(recipe)
    got = s.video_sigmas if stream == "video" else s.audio_sigmas
    assert (got.double() - torch.tensor(NOTES[key], dtype=torch.float64)).abs().max() < 6e-6


@pytest.mark.parametrize("recipe", list(PUBLISHED))
def test_audio_the_model_derives_from_video_is_the_audio_ladder(recipe):
    # the DiT maps a video sigma to the audio sigma: back to b with the video shift, forward with the audio shift
    rungs, sv, sa = PUBLISHED[recipe]
    s = f.resolve_schedule(recipe)
    video = _f64(rungs, sv)
    derived = []
    for v in video[:-1]:
        b = v / (sv + v * (1 - sv))
        derived.append(sa * b / (1 + (sa - 1) * b))
    assert max(abs(a - b) for a, b in zip(derived, _f64(rungs, sa)[:-1])) < 1e-12  # the identity itself
    assert s.audio_derivation_error() < 5e-7  # float32 rounding only
    assert s.as_dict()["audio_from_video_max_dev"] == s.audio_derivation_error()


def test_report_names_recipe_shifts_and_sigmas():
    s = f.resolve_schedule("fasth3_8step_v2", contract_note="model source unknown")
    text = s.summary()
    assert "FastH3 8-Step V2" in text and "8 forwards from 9 grid points" in text
    assert "video 10 / audio 3" in text and "0.98579" in text and "0.95415" in text
    assert "no contract (model source unknown)" in text
    d = s.as_dict()
    assert d["dmd_denoising_steps"] == V2_RUNGS and d["positions"][-1] == 0.0 and len(d["video_sigmas"]) == 9
    json.dumps(d)


# ------------------------------------------------------------------------------------------------ contracts
def test_v2_contract_agrees_and_from_contract_follows_it(tmp_path):
    p = tmp_path / "fastvideo_inference.json"
    p.write_text(json.dumps(v2_contract()))
    c = f.load_contract(p)
    assert c.rungs == tuple(V2_RUNGS) and c.video_shift == 10.0 and c.audio_shift == 3.0
    assert c.model_id == "FastVideo/FastVideo-FastH3-8-Step-V2" and c.extra["vsa_sparsity"] == 0.8
    a = f.resolve_schedule("fasth3_8step_v2", c)
    b = f.resolve_schedule("from_contract", c)
    assert torch.equal(a.video_sigmas, b.video_sigmas) and torch.equal(a.audio_sigmas, b.audio_sigmas)
    assert "agrees" in a.summary() and a.as_dict()["contract"]["dmd_denoising_steps"] == V2_RUNGS


def test_preview_contract_without_shifts_needs_the_named_recipe(tmp_path):
    c = f.parse_contract(preview_contract(), "x.json")
    assert c.video_shift is None and c.audio_shift is None
    s = f.resolve_schedule("fasth3_preview_4step", c)
    assert s.video_shift == 12.0 and torch.equal(s.video_sigmas, _f32(PREVIEW_RUNGS, 12.0))
    with pytest.raises(ScheduleError, match="video_scheduler_shift / audio_scheduler_shift"):
        f.resolve_schedule("from_contract", c)


@pytest.mark.parametrize("recipe,contract,words", [
    ("fasth3_preview_4step", v2_contract(), "disagree with recipe fasth3_preview_4step"),
    ("fasth3_8step_v2", preview_contract(), "disagree with recipe fasth3_8step_v2"),
    ("fasth3_8step_v2", v2_contract(video_scheduler_shift=12.0), "video_scheduler_shift 12 disagrees"),
    ("fasth3_8step_v2", v2_contract(audio_scheduler_shift=2.5), "audio_scheduler_shift 2.5 disagrees"),
    ("fasth3_preview_4step", preview_contract(video_scheduler_shift=10.0), "video_scheduler_shift 10 disagrees"),
])
def test_conflicting_recipe_is_refused(recipe, contract, words):
    c = f.parse_contract(contract, "x.json")
    with pytest.raises(ScheduleError, match=words):
        f.resolve_schedule(recipe, c)


def test_from_contract_without_contract_and_unknown_recipe():
    with pytest.raises(ScheduleError, match="needs the checkpoint's fastvideo_inference.json"):
        f.resolve_schedule("from_contract", None, contract_note="single-file checkpoint")
    with pytest.raises(ScheduleError, match="unknown recipe"):
        f.resolve_schedule("fasth3_2step")


@pytest.mark.parametrize("obj,words", [
    ([1, 2], "must hold a JSON object"),
    (v2_contract(schema_version="v0"), "schema_version must be"),
    (v2_contract(schema_version=...), "schema_version must be"),
    (v2_contract(pdd_steps=32), "PDD"),
    (v2_contract(dmd_denoising_steps=[]), "non-empty list"),
    (v2_contract(dmd_denoising_steps="999,500"), "non-empty list"),
    (v2_contract(dmd_denoising_steps=[999, 874.0, 749, 624, 500, 375, 250, 125]), r"integers in \(0, 1000\]"),
    (v2_contract(dmd_denoising_steps=[True, 874, 749, 624, 500, 375, 250, 125]), r"integers in \(0, 1000\]"),
    (v2_contract(dmd_denoising_steps=[1001, 874, 749, 624, 500, 375, 250, 125]), r"integers in \(0, 1000\]"),
    (v2_contract(dmd_denoising_steps=[999, 874, 749, 624, 500, 375, 250, 0]), r"integers in \(0, 1000\]"),
    (v2_contract(dmd_denoising_steps=[999, 749, 874, 624, 500, 375, 250, 125]), "strictly decreasing"),
    (v2_contract(dmd_denoising_steps=[999, 874, 874, 624, 500, 375, 250, 125]), "strictly decreasing"),
    (v2_contract(num_inference_steps=8), "num_inference_steps must be the grid-point count 9"),
    (v2_contract(num_inference_steps=...), "num_inference_steps"),
    (v2_contract(transformer_forwards=9), "transformer_forwards must equal the rung count 8"),
    (v2_contract(transformer_forwards=8.0), "transformer_forwards"),
    (v2_contract(video_scheduler_shift=0), "video_scheduler_shift must be a positive finite"),
    (v2_contract(video_scheduler_shift=-10.0), "video_scheduler_shift must be a positive finite"),
    (v2_contract(audio_scheduler_shift=True), "audio_scheduler_shift must be a positive finite"),
    (v2_contract(audio_scheduler_shift="3"), "audio_scheduler_shift must be a positive finite"),
    (v2_contract(video_scheduler_shift=1e400), "video_scheduler_shift must be a positive finite"),
    # positive finite but degenerate in float32 (all zeros / NaN sigmas before the range check)
    (v2_contract(video_scheduler_shift=1e-300), r"video_scheduler_shift 1e-300 is outside 0.01..100"),
    (v2_contract(audio_scheduler_shift=1e300), r"audio_scheduler_shift 1e\+300 is outside 0.01..100"),
    (v2_contract(video_scheduler_shift=100.5), "is outside 0.01..100"),
])
def test_contract_rules(obj, words):
    with pytest.raises(ScheduleError, match=words):
        f.parse_contract(obj, "c.json")


@pytest.mark.parametrize("raw,words", [
    (b'{"schema_version": "fasth3-inference-contract-v1", "video_scheduler_shift": NaN}', "non-finite JSON constant NaN"),
    (b'{"schema_version": "fasth3-inference-contract-v1", "video_scheduler_shift": Infinity}', "non-finite"),
    (b'{"schema_version": "a", "schema_version": "fasth3-inference-contract-v1"}', "duplicate JSON key"),
    (b'{"schema_version": ', "invalid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100000, "larger than 65536 bytes"),
    (b"[" * 60000 + b"]" * 60000, "larger than"),
    (b"[" * 30000 + b"]" * 30000, "invalid JSON"),
])
def test_contract_file_strictness(tmp_path, raw, words):
    p = tmp_path / "fastvideo_inference.json"
    p.write_bytes(raw)
    with pytest.raises(ScheduleError, match=words):
        f.load_contract(p)


def test_contract_errors_never_echo_file_strings(tmp_path):
    p = tmp_path / "fastvideo_inference.json"
    secret = "SECRET-<script>-" + "z" * 50
    p.write_text(json.dumps(v2_contract(schema_version=secret)))
    with pytest.raises(ScheduleError) as e:
        f.load_contract(p)
    assert "SECRET" not in str(e.value)
    # strict-JSON refusals name the rule, not the key or text the file holds
    for raw in ('{"%s": 1, "%s": 2}' % (secret, secret), '{"schema_version": "%s", "x": ' % secret,
                '{"%s": NaN}' % secret):
        p.write_text(raw)
        with pytest.raises(ScheduleError, match="duplicate JSON key|invalid JSON|non-finite JSON constant NaN") as e:
            f.load_contract(p)
        assert "SECRET" not in str(e.value), str(e.value)
    p.write_text(json.dumps(v2_contract(model_id=secret)))
    assert f.load_contract(p).model_id is None  # odd text is dropped from the report, not echoed


def test_missing_contract_file_is_a_ditkit_error(tmp_path):
    with pytest.raises(DitKitError, match="cannot be read"):
        f.load_contract(tmp_path / "nope.json")


# ------------------------------------------------------------------------------------------------ fuzz
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=200, derandomize=True, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
_scalars = st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=False) | st.text(max_size=8)
_values = st.recursive(_scalars, lambda ch: st.lists(ch, max_size=9) | st.dictionaries(st.text(max_size=8), ch,
                                                                                       max_size=4), max_leaves=12)
_keys = st.sampled_from(["schema_version", "dmd_denoising_steps", "num_inference_steps", "transformer_forwards",
                         "video_scheduler_shift", "audio_scheduler_shift", "pdd_steps", "model_id", "vsa_sparsity"])


@settings(FUZZ, max_examples=100)
@given(st.dictionaries(_keys, _values, max_size=4), st.sampled_from(f.RECIPE_CHOICES))
def test_fuzz_contract_mutations_raise_only_schedule_errors(mutation, recipe):
    obj = v2_contract()
    obj.update(mutation)
    try:
        c = f.parse_contract(obj, "fuzz.json")
        s = f.resolve_schedule(recipe, c)
    except ScheduleError:
        return
    # accepted: a valid ladder, shifted once, finite, strictly decreasing to 0
    assert list(s.rungs) == sorted(set(s.rungs), reverse=True) and all(0 < r <= 1000 for r in s.rungs)
    for t in (s.video_sigmas, s.audio_sigmas):
        assert torch.isfinite(t).all() and t[-1] == 0 and bool((t[1:] < t[:-1]).all())


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_contract_bytes_raise_only_schedule_errors(tmp_path, raw):
    p = tmp_path / "fastvideo_inference.json"
    p.write_bytes(raw)
    try:
        f.load_contract(p)
    except ScheduleError:
        pass


@pytest.mark.parametrize("sv,sa", [(0.01, 100.0), (100.0, 0.01), (1.0, 1.0)])
def test_from_contract_shift_range_edges_give_valid_ladders(sv, sa):
    s = f.resolve_schedule("from_contract", f.parse_contract(v2_contract(video_scheduler_shift=sv,
                                                                         audio_scheduler_shift=sa), "x.json"))
    for t, shift in ((s.video_sigmas, sv), (s.audio_sigmas, sa)):
        assert torch.equal(t, _f32(V2_RUNGS, shift)) and torch.isfinite(t).all() and bool((t[1:] < t[:-1]).all())
