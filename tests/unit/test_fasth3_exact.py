"""sampling/fasth3.py, exactly: every refusal's whole text, both sides of each bound (rungs in (0, 1000], the shift
range 0.01..100, strictly decreasing), the contract's kept extras, the report's dict and summary texts, the audio
derivation on every dtype.

Oracles written here: the texts each rule must say, the shift formula and its inverse in float64 / float32."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ditkit.errors import ScheduleError
from ditkit.sampling import fasth3 as f

V2 = [999, 874, 749, 624, 500, 375, 250, 125]
W = "FastH3 contract 'c.json'"


def _contract(**kv):
    o = {"schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": list(V2), "num_inference_steps": 9,
         "transformer_forwards": 8, "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0}
    for k, v in kv.items():
        if v is KeyError:
            o.pop(k, None)
        else:
            o[k] = v
    return o


def _refused(obj, msg, where=W):
    with pytest.raises(ScheduleError) as e:
        f.parse_contract(obj, where)
    assert str(e.value) == msg


def test_constants_and_recipes():
    assert (f.CONTRACT_FILE, f.CONTRACT_SCHEMA, f.MAX_CONTRACT_BYTES, f.TIME_SCALE, f.FROM_CONTRACT, f.SHIFT_RANGE) == \
        ("fastvideo_inference.json", "fasth3-inference-contract-v1", 65536, 1000, "from_contract", (0.01, 100.0))
    assert f.RECIPE_CHOICES == ["fasth3_8step_v2", "fasth3_preview_4step", "from_contract"]
    v2, pv = f.RECIPES["fasth3_8step_v2"], f.RECIPES["fasth3_preview_4step"]
    assert (v2.key, v2.label, v2.rungs, v2.video_shift, v2.audio_shift) == \
        ("fasth3_8step_v2", "FastH3 8-Step V2", tuple(V2), 10.0, 3.0)
    assert (pv.key, pv.label, pv.rungs, pv.video_shift, pv.audio_shift) == \
        ("fasth3_preview_4step", "FastH3 Preview v1 (4-step)", (999, 749, 500, 250), 12.0, 3.0)
    assert "PR 1852" in v2.source and "PR 6714" in pv.source


# ------------------------------------------------------------------------------------------------ arithmetic

def test_positions():
    assert f.positions([999, 500, 1]) == (0.999, 0.5, 0.001, 0.0)
    assert f.positions([]) == (0.0,)
    assert f.positions([1000.0]) == (1.0, 0.0)          # int() of each rung


@pytest.mark.parametrize("shift", [0.01, 1.0, 3.0, 12.0, 100.0])
def test_shifted_sigmas_float32_operation_order(shift):
    grid = (0.999, 0.75, 0.5, 0.125, 0.0)
    got = f.shifted_sigmas(grid, shift)
    b = torch.tensor(grid, dtype=torch.float32)
    want = shift * b / (1 + (shift - 1) * b)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert got.tolist() == pytest.approx([shift * x / (1 + (shift - 1) * x) for x in grid], rel=1e-5)
    assert torch.equal(f.shifted_sigmas(list(grid), int(shift) if shift == int(shift) else shift), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_audio_from_video_every_dtype_and_the_clamp(dtype):
    sv = torch.tensor([0.9999, 0.9, 0.5, 0.2, 0.0], dtype=torch.float64).to(dtype)
    got = f.audio_from_video(sv[::1], 10.0, 3.0)
    s = sv.to(torch.float32).clamp(min=1e-6)
    base = s / (10.0 + s * (1.0 - 10.0))
    want = 3.0 * base / (1.0 + (3.0 - 1.0) * base)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # the terminal 0 maps through sigma 1e-6: not 0
    b0 = 1e-6 / (10.0 - 9.0 * 1e-6)
    assert float(got[-1]) == pytest.approx(3.0 * b0 / (1.0 + 2.0 * b0), rel=1e-5) and float(got[-1]) > 0
    strided = torch.stack([sv, sv], dim=1)[:, 0]
    assert torch.equal(f.audio_from_video(strided, 10.0, 3.0), got)
    # round trip: the audio sigma of the video ladder is the audio ladder (float64 formula, 1e-6)
    for x in (0.999, 0.5, 0.125):
        v = 10.0 * x / (1 + 9.0 * x)
        a = 3.0 * x / (1 + 2.0 * x)
        assert float(f.audio_from_video(torch.tensor([v]), 10.0, 3.0)[0]) == pytest.approx(a, abs=1e-6)


# ------------------------------------------------------------------------------------------------ rules

def test_check_rungs_texts_and_bounds():
    def refused(r, msg):
        with pytest.raises(ScheduleError) as e:
            f._check_rungs(r, "X")
        assert str(e.value) == msg

    refused([], "X: dmd_denoising_steps must be a non-empty list of integers")
    refused(None, "X: dmd_denoising_steps must be a non-empty list of integers")
    refused("999", "X: dmd_denoising_steps must be a non-empty list of integers")
    rng = "X: dmd_denoising_steps must hold integers in (0, 1000] (timestep indices out of 1000)"
    for bad in ([1001], [0], [-5], [999, 500.0], [True], [500, "x"]):
        refused(bad, rng)
    assert f._check_rungs([1000], "X") == (1000,) and f._check_rungs([1], "X") == (1,)
    assert f._check_rungs((1000, 999, 1), "X") == (1000, 999, 1)
    refused([999, 999], "X: dmd_denoising_steps must be strictly decreasing, got [999, 999]")
    refused((500, 600), "X: dmd_denoising_steps must be strictly decreasing, got [500, 600]")
    refused([999, 500, 501, 1], "X: dmd_denoising_steps must be strictly decreasing, got [999, 500, 501, 1]")


def test_positive_finite_texts_and_range_edges():
    def refused(v, msg):
        with pytest.raises(ScheduleError) as e:
            f._positive_finite(v, "k", "X")
        assert str(e.value) == msg

    for bad in (True, "3", None, math.inf, math.nan, 0, 0.0, -1.0):
        refused(bad, "X: k must be a positive finite number")
    tail = " (the range of ComfyUI's MiniMaxH3SigmaShift; float32 sigmas degenerate beyond it)"
    refused(0.0099, "X: k 0.0099 is outside 0.01..100" + tail)
    refused(100.5, "X: k 100.5 is outside 0.01..100" + tail)
    assert f._positive_finite(0.01, "k", "X") == 0.01 and f._positive_finite(100, "k", "X") == 100.0
    assert type(f._positive_finite(7, "k", "X")) is float


def test_check_sigmas_every_rule():
    msg = lambda t: f"L: the shifted ladder is not finite and strictly decreasing from <= 1 to 0 ({t.tolist()})"
    ok = torch.tensor([1.0, 0.5, 0.0])
    f._check_sigmas(ok, "L")
    for bad in (torch.tensor([1.0, float("nan"), 0.0]), torch.tensor([1.0, 0.5, 1e-9]),
                torch.tensor([1.0 + 2 ** -20, 0.5, 0.0]), torch.tensor([1.0, 0.5, 0.5, 0.0]),
                torch.tensor([0.5, 1.0, 0.0]), torch.tensor([float("inf"), 0.5, 0.0])):
        with pytest.raises(ScheduleError) as e:
            f._check_sigmas(bad, "L")
        assert str(e.value) == msg(bad)
    f._check_sigmas(torch.tensor([0.0]), "L")


# ------------------------------------------------------------------------------------------------ contracts

def test_parse_contract_refusal_texts():
    _refused([1], f"{W}: must hold a JSON object")
    _refused(_contract(schema_version="v2"),
             f"{W}: schema_version must be 'fasth3-inference-contract-v1' (a FastH3 inference contract)")
    _refused(_contract(schema_version=KeyError),
             f"{W}: schema_version must be 'fasth3-inference-contract-v1' (a FastH3 inference contract)")
    _refused(_contract(pdd_steps=None),
             f"{W}: a PDD (Parallel Decoding Distillation) contract samples fused blocks of a fine grid, not a DMD "
             "ladder; this node supports DMD contracts (dmd_denoising_steps) only")
    _refused(_contract(dmd_denoising_steps=[]), f"{W}: dmd_denoising_steps must be a non-empty list of integers")
    for nis in (8, 10, 9.0, "9", None, True):
        _refused(_contract(num_inference_steps=nis),
                 f"{W}: num_inference_steps must be the grid-point count 9 (8 rungs + the terminal 0)")
    for tf in (7, 9, 8.0, "8", None):
        _refused(_contract(transformer_forwards=tf), f"{W}: transformer_forwards must equal the rung count 8")
    _refused(_contract(video_scheduler_shift=None), f"{W}: video_scheduler_shift must be a positive finite number")
    _refused(_contract(audio_scheduler_shift=200.0),
             f"{W}: audio_scheduler_shift 200 is outside 0.01..100 (the range of ComfyUI's MiniMaxH3SigmaShift; "
             "float32 sigmas degenerate beyond it)")


def test_parse_contract_result_and_extras():
    c = f.parse_contract(_contract(guidance_scale=3, vsa_sparsity=0.9, vsa_tile_size=4, task="t2v",
                                   attention_backend="VIDEO_SPARSE_ATTN", model_id="FastVideo/FastH3-8-Step-V2"), W)
    assert (c.path, c.rungs, c.video_shift, c.audio_shift, c.model_id) == \
        (W, tuple(V2), 10.0, 3.0, "FastVideo/FastH3-8-Step-V2")
    assert c.extra == {"guidance_scale": 3.0, "vsa_sparsity": 0.9, "vsa_tile_size": 4, "task": "t2v",
                       "attention_backend": "VIDEO_SPARSE_ATTN"}
    assert type(c.extra["guidance_scale"]) is float and type(c.extra["vsa_tile_size"]) is int
    assert f.parse_contract(_contract(), W, path="p.json").path == "p.json"
    assert c.where == "FastH3 contract 'FastH3 contract 'c.json''"
    # dropped: non-numbers, bools, non-finite, non-int tile sizes, unsafe or too long strings
    c = f.parse_contract(_contract(guidance_scale=True, vsa_sparsity=math.inf, vsa_tile_size=4.0, task="a b",
                                   attention_backend="x" * 201, model_id="../../etc"), W)
    assert c.extra == {} and c.model_id == "../../etc"
    c = f.parse_contract(_contract(vsa_tile_size=True, task="", model_id="a b", guidance_scale="3",
                                   vsa_sparsity=math.nan, attention_backend=["x"]), W)
    assert c.extra == {}                                    # a bool is not an int tile size
    assert c.model_id is None
    c = f.parse_contract(_contract(task="x" * 200, model_id=5, video_scheduler_shift=KeyError,
                                   audio_scheduler_shift=KeyError), W)
    assert c.extra == {"task": "x" * 200} and c.model_id is None
    assert c.video_shift is None and c.audio_shift is None
    assert f.parse_contract(_contract(audio_scheduler_shift=KeyError), W).video_shift == 10.0
    for s in ("A-z_0.9:/@+", "a\nb", "é"):
        keep = f.parse_contract(_contract(task=s), W).extra.get("task")
        assert keep == (s if s == "A-z_0.9:/@+" else None)


def test_contract_dict():
    c = f.parse_contract(_contract(task="t2v", model_id="m"), W, path="/x/c.json")
    assert c.as_dict() == {"path": "/x/c.json", "dmd_denoising_steps": V2, "video_scheduler_shift": 10.0,
                           "audio_scheduler_shift": 3.0, "model_id": "m", "task": "t2v"}


def test_load_contract_texts(tmp_path):
    p = tmp_path / "c.json"
    where = f"FastH3 contract '{p}'"

    def refused(raw, msg):
        p.write_bytes(raw)
        with pytest.raises(ScheduleError) as e:
            f.load_contract(p)
        assert str(e.value) == msg

    refused(b"\xff{}", f"{where}: not UTF-8 text")
    refused(b'{"a": 1, "a": 2}', f"{where}: duplicate JSON key")
    refused(b'{"a": NaN}', f"{where}: non-finite JSON constant NaN")
    refused(b'{"a": -Infinity}', f"{where}: non-finite JSON constant -Infinity")
    refused(b"{not json", f"{where}: invalid JSON (JSONDecodeError)")
    refused(b"{", f"{where}: invalid JSON (JSONDecodeError)")
    refused(b"[1]", f"{where}: must hold a JSON object")
    p.write_text(json.dumps(_contract()), encoding="utf-8")
    c = f.load_contract(p)
    assert c.path == str(p) and c.where == where and c.rungs == tuple(V2)
    p.write_bytes(b" " * (65536 - 2) + b"{}")
    with pytest.raises(ScheduleError) as e:
        f.load_contract(p)
    assert "schema_version" in str(e.value)                 # 64 KiB exactly is read
    p.write_bytes(b" " * 65535 + b"{}")
    with pytest.raises(ScheduleError) as e:
        f.load_contract(p)
    assert str(e.value) == f"FastH3 contract '{p}': 65537 bytes, larger than 65536 bytes"
    with pytest.raises(ScheduleError) as e:
        f.load_contract(tmp_path / "none.json")
    assert str(e.value).startswith(f"FastH3 contract '{tmp_path / 'none.json'}': cannot be read")


def test_load_contract_deep_nesting_is_invalid_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(b"[" * 30000 + b"]" * 30000)
    with pytest.raises(ScheduleError) as e:
        f.load_contract(p)
    assert str(e.value) == f"FastH3 contract '{p}': invalid JSON (RecursionError)"


# ------------------------------------------------------------------------------------------------ schedules

def _fmt(vals):
    return ", ".join(f"{v:.5g}" for v in vals)


def test_schedule_fields_dict_and_summary():
    s = f.resolve_schedule("fasth3_preview_4step")
    assert (s.recipe, s.label, s.rungs, s.video_shift, s.audio_shift, s.contract, s.contract_note) == \
        ("fasth3_preview_4step", "FastH3 Preview v1 (4-step)", (999, 749, 500, 250), 12.0, 3.0, None, "")
    assert s.positions == (0.999, 0.749, 0.5, 0.25, 0.0) and s.forwards == 4
    b = torch.tensor(s.positions, dtype=torch.float32)
    assert torch.equal(s.video_sigmas, 12.0 * b / (1 + 11.0 * b))
    assert torch.equal(s.audio_sigmas, 3.0 * b / (1 + 2.0 * b))
    assert torch.equal(s.audio_from_video, f.audio_from_video(s.video_sigmas, 12.0, 3.0))
    dev = float((s.audio_from_video[:-1] - s.audio_sigmas[:-1]).abs().max())
    assert s.audio_derivation_error() == dev < 1e-6
    d = s.as_dict()
    assert list(d) == ["recipe", "label", "dmd_denoising_steps", "positions", "forwards", "video_shift", "audio_shift",
                       "video_sigmas", "audio_sigmas", "audio_from_video_max_dev", "contract", "contract_note"]
    assert d["forwards"] == 4 and d["audio_from_video_max_dev"] == dev and d["contract"] is None
    assert d["video_sigmas"] == s.video_sigmas.tolist() and d["positions"] == [0.999, 0.749, 0.5, 0.25, 0.0]
    head = ("FastH3 Preview v1 (4-step): 4 forwards from 5 grid points, shifts video 12 / audio 3 set on the model "
            f"(applied once); video sigmas [{_fmt(s.video_sigmas.tolist())}]; audio sigmas "
            f"[{_fmt(s.audio_sigmas.tolist())}]; ")
    assert s.summary() == head + "no contract"
    assert f.resolve_schedule("fasth3_preview_4step", contract_note="none found").summary() == \
        head + "no contract (none found)"
    c = f.parse_contract(_contract(dmd_denoising_steps=[999, 749, 500, 250], num_inference_steps=5,
                                   transformer_forwards=4, video_scheduler_shift=12.0), W, path="/m/c.json")
    s = f.resolve_schedule("fasth3_preview_4step", c, "ignored")
    assert s.summary() == head + "contract '/m/c.json' agrees" and s.contract is c
    assert s.as_dict()["contract"]["path"] == "/m/c.json"
    assert _fmt([0.99992, 0.5, 0.0]) == "0.99992, 0.5, 0"


def test_the_schedule_refuses_a_degenerate_ladder():
    with pytest.raises(ScheduleError) as e:
        f.FastH3Schedule("r", "L", (1000, 999), 1e6, 1.0)       # float32: both top rungs shift to 1.0
    assert str(e.value) == ("L video (shift 1e+06): the shifted ladder is not finite and strictly decreasing from <= 1 "
                            "to 0 ([1.0, 1.0, 0.0])")
    with pytest.raises(ScheduleError) as e:
        f.FastH3Schedule("r", "L", (1000, 999), 1.0, 1e6)
    assert str(e.value).startswith("L audio (shift 1e+06): the shifted ladder")


def test_resolve_schedule_refusal_texts():
    names = "fasth3_8step_v2, fasth3_preview_4step"
    with pytest.raises(ScheduleError) as e:
        f.resolve_schedule("from_contract")
    assert str(e.value) == ("recipe 'from_contract' needs the checkpoint's fastvideo_inference.json; name it in "
                            f"contract_file, or choose one of {names}")
    with pytest.raises(ScheduleError) as e:
        f.resolve_schedule("from_contract", None, "not found next to the model")
    assert str(e.value) == ("recipe 'from_contract' needs the checkpoint's fastvideo_inference.json (not found next to "
                            f"the model); name it in contract_file, or choose one of {names}")
    with pytest.raises(ScheduleError) as e:
        f.resolve_schedule("fasth3_9step")
    assert str(e.value) == ("unknown recipe 'fasth3_9step'; choose one of ['fasth3_8step_v2', 'fasth3_preview_4step', "
                            "'from_contract']")
    tail = ("(earlier exports such as Preview v1 carry only the ladder and take the shifts from their scheduler "
            f"configs); choose the recipe that names the shifts ({names})")
    for drop, missing in ((("video_scheduler_shift", "audio_scheduler_shift"), "video_scheduler_shift / "
                           "audio_scheduler_shift"), (("video_scheduler_shift",), "video_scheduler_shift"),
                          (("audio_scheduler_shift",), "audio_scheduler_shift")):
        c = f.parse_contract(_contract(**{k: KeyError for k in drop}), W, path="c.json")
        with pytest.raises(ScheduleError) as e:
            f.resolve_schedule("from_contract", c)
        assert str(e.value) == f"{W}: has no {missing} " + tail
    c = f.parse_contract(_contract(dmd_denoising_steps=[999, 749, 500, 250], num_inference_steps=5,
                                   transformer_forwards=4), W, path="c.json")
    with pytest.raises(ScheduleError) as e:
        f.resolve_schedule("fasth3_8step_v2", c)
    assert str(e.value) == (f"{W}: the checkpoint's dmd_denoising_steps [999, 749, 500, 250] disagree with recipe "
                            f"fasth3_8step_v2 {V2}; refusing the conflicting choice (use recipe 'from_contract' to "
                            "follow the checkpoint)")
    for key, val, mine in (("video_scheduler_shift", 12.0, 10), ("audio_scheduler_shift", 2.5, 3)):
        c = f.parse_contract(_contract(**{key: val}), W, path="c.json")
        with pytest.raises(ScheduleError) as e:
            f.resolve_schedule("fasth3_8step_v2", c)
        assert str(e.value) == (f"{W}: {key} {val:g} disagrees with recipe fasth3_8step_v2 ({mine}); refusing the "
                                "conflicting choice (use recipe 'from_contract')")


def test_resolve_schedule_with_agreeing_or_partial_contracts():
    c = f.parse_contract(_contract(video_scheduler_shift=KeyError, audio_scheduler_shift=KeyError), W, path="c.json")
    s = f.resolve_schedule("fasth3_8step_v2", c, "note")
    assert s.contract is c and s.contract_note == "note" and s.video_shift == 10.0
    c = f.parse_contract(_contract(video_scheduler_shift=10, audio_scheduler_shift=3), W, path="c.json")
    assert f.resolve_schedule("fasth3_8step_v2", c).recipe == "fasth3_8step_v2"
    c = f.parse_contract(_contract(dmd_denoising_steps=[1000, 500], num_inference_steps=3, transformer_forwards=2,
                                   video_scheduler_shift=5.0, audio_scheduler_shift=2.0), W, path="c.json")
    s = f.resolve_schedule("from_contract", c, "n")
    assert (s.recipe, s.label, s.rungs, s.video_shift, s.audio_shift, s.contract, s.contract_note) == \
        ("from_contract", "FastH3 (from contract)", (1000, 500), 5.0, 2.0, c, "n")
    assert s.video_sigmas.tolist() == [1.0, pytest.approx(5.0 * 0.5 / (1 + 4.0 * 0.5)), 0.0]


def test_a_bad_recipe_table_entry_is_refused(monkeypatch):
    monkeypatch.setitem(f.RECIPES, "bad", f.Recipe("bad", "Bad", (500, 600), 10.0, 3.0, "test"))
    with pytest.raises(ScheduleError) as e:
        f.resolve_schedule("bad")
    assert str(e.value) == "recipe bad: dmd_denoising_steps must be strictly decreasing, got [500, 600]"


def test_shifted_sigmas_are_float32_whatever_the_default_dtype():
    """The float32 ladder (vllm-omni's arithmetic) does not follow torch's default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = f.shifted_sigmas((0.999, 0.5, 0.0), 10.0)
    finally:
        torch.set_default_dtype(old)
    b = torch.tensor([0.999, 0.5, 0.0], dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, 10.0 * b / (1 + 9.0 * b))
