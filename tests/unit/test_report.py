"""The report base (ditkit/report.py): dataclass -> dict (order, renames, computed keys, merges, nested
dataclasses, copies), the JSON-safe conversion ``send_report`` applies to a payload, and ``send_report`` taking a
report. Expected values are written out here."""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ditkit.report import Report, jsonable, plain
from tests.support.pack_scan import PACK_ROOT, pack_python_files


@dataclass
class Leaf:                     # a plain dataclass (not a Report) nested in a report
    name: str
    shape: tuple[int, ...]


@dataclass
class Inner(Report):
    hits: int = 0
    tags: tuple[str, ...] = ()


@dataclass
class Outer(Report):
    label: str
    inner: Inner
    leaves: list[Leaf]
    by_name: dict[str, Inner]
    counts: Counter = field(default_factory=Counter)
    path: Path | None = None
    sigmas: torch.Tensor | None = None
    missing: float | None = None


@dataclass
class Custom(Report):
    total: float
    nested: Inner
    extra: dict = field(default_factory=dict)
    hidden: str = "not in the dict"

    KEYS = ("rounded", "hits=nested.hits", "total", "**extra")
    VALUES = {"rounded": lambda r: round(r.total, 2)}

    def summary(self) -> str:
        return f"total {self.total:g}"


def test_fields_in_order_nested_dataclasses_and_containers_become_plain():
    o = Outer("run", Inner(3, ("a", "b")), [Leaf("w", (2, 3))], {"x": Inner(1)}, Counter({"sparse": 2}),
              Path("/m/file.safetensors"), torch.tensor([1.0, 0.5, 0.0]))
    d = o.as_dict()
    assert list(d) == ["label", "inner", "leaves", "by_name", "counts", "path", "sigmas", "missing"]
    assert d == {"label": "run", "inner": {"hits": 3, "tags": ["a", "b"]}, "leaves": [{"name": "w", "shape": [2, 3]}],
                 "by_name": {"x": {"hits": 1, "tags": []}}, "counts": {"sparse": 2}, "path": "/m/file.safetensors",
                 "sigmas": [1.0, 0.5, 0.0], "missing": None}
    assert type(d["counts"]) is dict and type(d["inner"]["tags"]) is list
    assert json.loads(json.dumps(d, allow_nan=False)) == d        # already JSON: no str() fallback needed


def test_the_dict_is_a_copy():
    inner = Inner(1, ("a",))
    o = Outer("run", inner, [], {"x": inner}, Counter({"c": 1}))
    d = o.as_dict()
    d["counts"]["c"] = 99
    d["leaves"].append("junk")
    d["by_name"]["x"]["hits"] = 7
    assert o.counts == Counter({"c": 1}) and o.leaves == [] and inner.hits == 1


def test_keys_renames_computed_values_and_merges():
    r = Custom(2.34567, Inner(5), {"frames": 9, "note": (1, 2)})
    assert list(r.as_dict()) == ["rounded", "hits", "total", "frames", "note"]
    assert r.as_dict() == {"rounded": 2.35, "hits": 5, "total": 2.34567, "frames": 9, "note": [1, 2]}
    assert r.summary() == "total 2.34567"


def test_a_report_without_summary_text_says_so():
    with pytest.raises(NotImplementedError, match="Inner"):
        Inner().summary()


def test_non_finite_floats_stay_floats_in_as_dict():
    d = Custom(float("nan"), Inner(), {"inf": float("inf")}).as_dict()
    assert math.isnan(d["total"]) and d["inf"] == math.inf


def test_plain_leaves_scalars_and_unknown_objects_alone():
    obj = object()
    assert plain(obj) is obj
    assert plain(3) == 3 and plain(None) is None and plain("s") == "s"
    assert plain(torch.tensor(2.5)) == 2.5


# ------------------------------------------------------------------------------------ send_report's conversion

def test_jsonable_returns_json_ready_data_as_it_is():
    data = {"a": [1, 2.5, "x", None, True], "b": {"c": (1, 2)}}
    assert jsonable(data) is data


def test_jsonable_replaces_what_json_refuses_by_its_str():
    t = torch.tensor([1.0, 2.0])
    out = jsonable({"t": t, "p": Path("/m/f.safetensors"), "s": {3}, "nested": [{"dtype": torch.float16}],
                    (1, 2): "tuple key", "ok": 1})
    assert out == {"t": "tensor([1., 2.])", "p": "/m/f.safetensors", "s": "{3}", "nested": [{"dtype": "torch.float16"}],
                   "(1, 2)": "tuple key", "ok": 1}
    json.dumps(out)


def test_jsonable_leaves_non_finite_floats_as_floats():
    # json.dumps accepts NaN/Infinity (allow_nan defaults to True), so send_report passes them on unchanged
    data = {"x": float("nan"), "y": [float("-inf")], "t": torch.tensor(0.0)}
    out = jsonable(data)
    assert math.isnan(out["x"]) and out["y"] == [-math.inf] and out["t"] == "tensor(0.)"


# ------------------------------------------------------------------------------------ send_report with a report

def test_send_report_takes_a_report(comfy):
    from ditkit.nodes._common import send_report

    r = Custom(1.0, Inner(2), {"frames": 3})
    payload = send_report("7", "DitKitX", "kind", r, {"frames": 4, "file": "f"})
    assert payload["summary"] == "total 1"
    assert payload["data"] == {"rounded": 1.0, "hits": 2, "total": 1.0, "frames": 4, "file": "f"}
    plain_payload = send_report("7", "DitKitX", "kind", "text", {"frames": 4})
    assert plain_payload["summary"] == "text" and plain_payload["data"] == {"frames": 4}


def test_kv_list_joins_key_value_pairs():
    assert Report.kv_list({"a": 1, "b": "x"}) == "a: 1; b: x"
    assert Report.kv_list([("masked call", 2), ("refiner", 1)], ", ") == "masked call: 2, refiner: 1"
    assert Report.kv_list({}) == ""


def test_summaries_built_on_kv_list_keep_their_text():
    """The full texts of the two summaries whose "k: v" lists come from Report.kv_list (pinned as on main)."""
    from ditkit.kernels.registry import Query, Selection
    from ditkit.kernels.vsa_h3_runtime import VSAH3Config, VSAH3Runtime

    q = Query(op="block_sparse_attn", device_type="cpu", device_index=None, capability=None, dtype=torch.float32,
              head_dim=64)
    sel = Selection("block_sparse_attn", "cpu", len, True, (("triton", "needs CUDA"), ("flex", "torch < 2.5")), q)
    assert sel.summary() == "block_sparse_attn -> cpu (rejected: triton: needs CUDA; flex: torch < 2.5)"
    none = Selection("block_sparse_attn", "cpu", len, True, (), q, unverified="never run")
    assert none.summary() == "block_sparse_attn -> cpu [chosen explicitly, UNVERIFIED: never run] (rejected: none)"
    rt = VSAH3Runtime(VSAH3Config(keep=0.25), gate_source="none")
    ctx = rt.begin_forward((10, 74), (7, 8, 8), 0.5)
    rt.dense_call("masked call", ctx)
    rt.dense_call("token refiner / non-packed")
    rt.dense_call("token refiner / non-packed")
    assert rt.summary() == ("VSA-H3 backend none (no sparse call); steps sparse 0 / dense 1; attention calls sparse 0, "
                            "dense 3 (masked call: 1, token refiner / non-packed: 2); measured block density n/a "
                            "(keep 0.25, k=None); gate none")


def test_no_report_writes_its_own_as_dict():
    """Every report's dict comes from the base (KEYS / VALUES), so the rules of plain() hold for all of them."""
    import ast

    # the memory model's token count and preflight plan (issue #31) still build their dicts by hand: owed a move to
    # the Report base (listed so that no new one appears unnoticed)
    owed = {"memory/model.py", "memory/preflight.py"}
    own = []
    for path in pack_python_files():
        if path == PACK_ROOT / "report.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.FunctionDef) and n.name == "as_dict" and str(path.relative_to(PACK_ROOT)) not in owed:
                own.append(f"{path.relative_to(PACK_ROOT)}:{n.lineno}")
    assert not own, own


def test_quantization_report_dict():
    from ditkit.loaders.quantize import ClassStats, QuantReport

    attn = ClassStats(tensors=4, params=400, bytes_in=800, bytes_out=432, quantized=4, max_rel_err=0.03,
                      err_sq=0.0009, ref_sq=1.0)
    norms = ClassStats(tensors=2, params=20, bytes_in=40, bytes_out=40, kept_small=2)
    r = QuantReport("h3", "float8_e4m3fn", "h3 recipe", {"block attention": attn, "norms": norms})
    assert r.as_dict() == {
        "format": "float8_e4m3fn", "family": "h3", "recipe": "h3 recipe", "activation_scales": "none",
        "bytes_in": 840, "bytes_out": 472,
        "classes": {"block attention": {"tensors": 4, "params": 400, "bytes_in": 800, "bytes_out": 432,
                                        "quantized": 4, "kept_small": 0, "rel_rms_error": math.sqrt(0.0009),
                                        "max_tensor_rel_error": 0.03, "error_rows": "0/0"},
                    "norms": {"tensors": 2, "params": 20, "bytes_in": 40, "bytes_out": 40, "quantized": 0,
                              "kept_small": 2}},
        "block_scales": {}, "cache": {}, "timing": {}, "quantized_on": ""}
    assert r.summary() == ("float8_e4m3fn (weight-only): quantized block attention 4/4; kept in stored precision: "
                           "norms; 0.0 MiB -> 0.0 MiB")
    # a block format loaded into the host: the layers whose block scales were not copied are said
    b = QuantReport("h3", "nvfp4", "h3 recipe", {"block attention": attn},
                    block_scales={"layers_kept": 3, "layers": 4, "bytes_not_copied": 3 << 20})
    assert b.as_dict()["block_scales"] == {"layers_kept": 3, "layers": 4, "bytes_not_copied": 3145728}
    assert b.summary().endswith("; block scales not copied by the host: 3/4 layers (3.0 MiB)")


def test_step_cache_reports_share_a_base_and_keep_their_dicts():
    from ditkit.cache.stepcache import StepCacheReport
    from ditkit.cache.teacache import CacheRunReport, TeaCacheReport

    common = dict(family="h3", steps=25, calls=48, computed=16, skipped=32, forced={"first step": 2},
                  streams={"video": {"computed": 16}}, per_condition=[{"condition": "c", "computed": 8}],
                  thresholds={"video": 0.2, "audio": 0.1})
    t = TeaCacheReport(**common, coefficients="file.json", warnings=["w"], resets=1)
    s = StepCacheReport(**common, mode="first_block", plan="C.C", reducer="none", resets=0)
    assert isinstance(t, CacheRunReport) and isinstance(s, CacheRunReport)
    assert t.as_dict() == {"family": "h3", "steps": 25, "calls": 48, "computed": 16, "skipped": 32,
                           "block_eval_ratio": 3.0, "forced": {"first step": 2}, "streams": {"video": {"computed": 16}},
                           "per_condition": [{"condition": "c", "computed": 8}],
                           "thresholds": {"video": 0.2, "audio": 0.1}, "coefficients": "file.json", "warnings": ["w"],
                           "resets": 1}
    assert list(s.as_dict()) == ["mode", "family", "steps", "calls", "computed", "skipped", "block_eval_ratio",
                                 "forced", "streams", "per_condition", "thresholds", "plan", "reducer", "resets"]
    assert s.as_dict()["mode"] == "first_block" and s.as_dict()["block_eval_ratio"] == 3.0
    assert round(StepCacheReport(**dict(common, calls=7, computed=3), mode="m", plan="", reducer="", resets=0)
                 .as_dict()["block_eval_ratio"], 4) == 2.3333
    assert TeaCacheReport(**dict(common, computed=0), coefficients="", warnings=[], resets=0).block_eval_ratio == 1.0
