"""benchmarks/gpu_check.py without a GPU: the dry-run plan, the refusal without CUDA, every section's code path in
the hidden ``--device cpu --tiny`` mode, and fault injections showing each section's checks can fail.

Nothing here stands for a GPU figure: the tiny mode runs toy shapes on CPU (Triton under TRITON_INTERPRET=1), and
no timing is asserted. The expected plan numbers (tile counts, offsets, FLOPs) are recomputed here from the
definitions (64-row prefix tiles, (4, 4, 4) video cubes, 4 * S^2 * D * H attention FLOPs), not read from the script.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
SECTIONS = ("kernels", "int64", "vsa_perf", "te_stream", "adaln", "video_save", "t1_decode", "lokr", "quant_load")

# runs the script in-process with `import triton` made impossible, then reports what was imported
NO_TRITON = r"""
import json, runpy, sys
sys.modules["triton"] = None            # any `import triton` now raises ImportError
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "torch", "ditkit") and sys.modules[m] is not None)
print("IMPORTED=" + json.dumps(heavy))
sys.exit(code)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "COMFYUI_PATH")}
    env.update(extra)
    return env


def _run(*args, cwd, env=None, timeout=300, wrapper=None):
    cmd = [sys.executable, "-c", wrapper, str(SCRIPT), *args] if wrapper else [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=str(cwd), env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _tiles(prefix, video):
    """(prefix tiles, video tiles, packed rows) from the definition."""
    return (sum(math.ceil(s / 64) for s in prefix if s), math.prod(math.ceil(x / 4) for x in video),
            sum(prefix) + math.prod(video))


# ------------------------------------------------------------------------------------------------ dry-run
def test_dry_run_prints_the_plan_without_triton_and_writes_json(tmp_path):
    js = tmp_path / "plan.json"
    p = _run("--dry-run", "--json", str(js), cwd=tmp_path, wrapper=NO_TRITON, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    imported = json.loads(re.search(r"^IMPORTED=(.*)$", p.stdout, flags=re.M).group(1))
    assert imported == [], f"the dry-run imported {imported[:5]} (it must need neither triton nor torch)"
    out = p.stdout
    for s in SECTIONS:
        sel = "; NOT SELECTED" if s == "quant_load" else ""            # opt-in: --only quant_load
        assert re.search(rf"^{s}\s+\[est \d+ s, budget \d+ s{sel}\]", out, flags=re.M), f"section {s} missing:\n{out}"
    doc = json.loads(js.read_text())
    plan = doc["plan"]
    assert doc["dry_run"] is True and [s["section"] for s in plan["sections"]] == list(SECTIONS)
    for s in plan["sections"]:
        assert s["selected"] == (s["section"] != "quant_load"), s      # opt-in: --only quant_load
        assert s["est_s"] > 0 and s["budget_s"] >= s["est_s"], s
        checks = [c for c in s["checks"] if c["check"] != "note"]
        assert checks and all(c["shape"] for c in checks), s
        # every check row of the JSON is also a printed row
        for c in checks:
            assert c["check"] in out, c["check"]
    # the whole run (budgets + the hard stop 30 s after the global budget) stays under 8 minutes
    assert plan["est_total_s"] <= plan["budget_s"] and plan["budget_s"] + 30 < 8 * 60
    assert "hard limit stops the process at budget + 30 s" in plan["note"]
    assert sum(s["budget_s"] for s in plan["sections"] if s["selected"]) <= plan["budget_s"]
    q = next(s for s in plan["sections"] if s["section"] == "quant_load")
    assert q["budget_s"] + 30 < 8 * 60 and [c["check"] for c in q["checks"]][1:] == [
        f"{f}: quantize through the device" for f in ("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")]

    # int64: the plan's offsets are H * rows * D - 1 of its own shape and cross 2**31 for input and output
    c = next(c for s in plan["sections"] if s["section"] == "int64" for c in s["checks"] if c["check"] == "pack past 2**31")
    H, S, P, D = map(int, re.match(r"\[1, (\d+), S=(\d+) / P=(\d+), (\d+)\]", c["shape"]).groups())
    npre, nvid, rows = _tiles((300, 414), (37, 24, 42))
    assert (S, P) == (rows, (npre + nvid) * 64) == (38010, 672 * 64)
    o_in, o_out = (int(x.replace(",", "")) for x in re.search(r"input ([\d,]+), output ([\d,]+)", c["note"]).groups())
    assert (o_in, o_out) == (H * S * D - 1, H * P * D - 1)
    assert o_in >= 2**31 and o_out >= 2**31

    # vsa_perf: dense FLOPs = 4 S^2 D H for the printed shape; the FLOP ceiling is below 1/keep (dense prefix)
    perf = [c for s in plan["sections"] if s["section"] == "vsa_perf" for c in s["checks"] if c["check"] != "note"]
    assert {re.search(r"keep ([\d.]+)", c["check"]).group(1) for c in perf} == {"0.1", "0.2"}
    assert {re.match(r"(\w+):", c["shape"]).group(1) for c in perf} == {"38k", "109k"}
    for c in perf:
        S = int(re.search(r"S=([\d,]+)", c["shape"]).group(1).replace(",", ""))
        H, D = map(int, re.search(r"H(\d+) D(\d+)", c["shape"]).groups())
        dense = float(re.search(r"dense ([\d.e+]+) FLOP", c["note"]).group(1))
        assert abs(dense / (4 * S * S * D * H) - 1) < 1e-3, c
        ceiling = float(re.search(r"FLOP ceiling ([\d.]+)x", c["note"]).group(1))
        keep = float(re.search(r"keep ([\d.]+)", c["check"]).group(1))
        assert 1 < ceiling < 1 / keep, c
        assert D == 128 and H <= 8, "the 109k dense run must use few heads"


def test_dry_run_selection_flags_and_bad_arguments(tmp_path):
    p = _run("--dry-run", "--quick", "--only", "kernels,lokr", "--skip", "lokr", cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    heads = dict(re.findall(r"^(\w+)\s+\[est \d+ s, budget \d+ s(; NOT SELECTED)?\]", p.stdout, flags=re.M))
    assert set(heads) == set(SECTIONS)
    assert heads["kernels"] == "" and all(heads[s] for s in SECTIONS if s != "kernels"), heads
    assert "mode quick" in p.stdout and not (tmp_path / "gpu_check.json").exists()  # JSON only when asked
    bad = _run("--dry-run", "--only", "nope", cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and "'nope' is not a section" in bad.stderr and "kernels" in bad.stderr
    cpu = _run("--device", "cpu", cwd=tmp_path, timeout=60)
    assert cpu.returncode == 2 and "needs --tiny" in cpu.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present, so the refusal cannot happen")
def test_refuses_without_cuda(tmp_path):
    p = _run("--quick", cwd=tmp_path, env=_env(OUT=str(tmp_path / "o")), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], p.stderr
    assert p.stdout == "" and not (tmp_path / "o").exists() and not (tmp_path / "gpu_check.json").exists()


# ------------------------------------------------------------------------------------------------ tiny CPU run
def _has(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_check_tiny")
    p = _run("--device", "cpu", "--tiny", "--out", f"{d}{os.sep}", cwd=d, env=_env(TRITON_INTERPRET="1"), timeout=600)
    assert (d / "gpu_check.json").exists(), f"exit {p.returncode}, no JSON:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    doc = json.loads((d / "gpu_check.json").read_text())
    return p, doc, d


def _rows(doc, section, prefix):
    return [r for r in doc["rows"] if r["section"] == section and r["check"].startswith(prefix)]


def test_tiny_cpu_mode_runs_every_section(tiny_run):
    p, doc, d = tiny_run
    fails = [r for r in doc["rows"] if r["result"] == "FAIL"]
    assert p.returncode == 0 and not fails, json.dumps(fails, indent=1)[:4000] + p.stderr[-3000:]
    assert doc["finished"] and doc["mode"] == "tiny" and doc["env"]["device"] == "cpu" and doc["env"]["torch"]
    assert set(doc["sections"]) == set(SECTIONS)
    for s in SECTIONS:
        assert [r for r in doc["rows"] if r["section"] == s], f"section {s} produced no row"
    table = (d / "gpu_check.txt").read_text()
    assert table.splitlines()[0].split() == ["section", "check", "shape", "dtype", "result", "figures"]
    assert re.search(r"^summary: \d+ PASS, 0 FAIL, \d+ SKIP, \d+ INFO;", p.stdout, flags=re.M)

    def expect(section, prefix, result, n=1, note=None):
        rows = _rows(doc, section, prefix)
        assert len(rows) >= n and all(r["result"] == result for r in rows), (section, prefix, rows)
        if note:
            assert all(note in r["note"] for r in rows), rows

    if _has("triton"):
        for check in ("pack", "unpack gather", "unpack +coarse vs", "unpack +coarse*gate", "top-k selection",
                      "block-sparse fwd + LSE", "VSA-H3 end to end + gate"):
            expect("kernels", check, "PASS")          # fp16 (the interpreter's bf16 dot is wrong)
        expect("kernels", "layout geometry", "PASS")
        expect("int64", "offs64 probe", "PASS")
        expect("vsa_perf", "fine stage vs float64", "PASS")
        for r in _rows(doc, "vsa_perf", "speedup dense / "):
            assert r["result"] == "INFO" and r["figures"]["ratio_median"] > 0 and r["figures"]["ceiling"] > 0, r
    else:
        expect("kernels", "(section)", "SKIP", note="triton is not installed")
    expect("int64", "pack / block-sparse / unpack past 2**31", "SKIP", note="2**31-element device tensors")
    expect("te_stream", "streamed == resident", "PASS")
    expect("te_stream", "peak device memory", "SKIP", note="need CUDA")
    expect("adaln", "cached sampling == uncached", "PASS")
    expect("adaln", "device bytes freed", "SKIP", note="not parked")
    expect("video_save", "uint8 on device (streaming) == whole float video path", "PASS")
    expect("video_save", "MP4 via PyAV", "PASS" if _has("av") else "SKIP")
    expect("t1_decode", "repeat-decode == frame 3", "PASS")
    expect("lokr", "fused (chunked fp32) vs float64", "PASS")
    for fmt in ("float8_e4m3fn", "int8_tensorwise"):
        if _has("comfy_kitchen"):
            expect("lokr", f"{fmt} base", "PASS")
        else:
            expect("lokr", f"{fmt} base", "SKIP", note="comfy_kitchen is not installed")
    expect("quant_load", "read the file", "INFO")
    for i, fmt in enumerate(("float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4")):
        (row,) = _rows(doc, "quant_load", f"{fmt}: quantize")
        if i and row["result"] == "SKIP":              # the last section of the tiny run: a loaded machine may
            assert "budget" in row["note"], row          # use up its budget after the first format, never silently
            continue
        assert row["result"] == "PASS" and "CPU path (--tiny smoke)" in row["note"], row
        assert row["figures"]["layers_checked"] == row["figures"]["layers"] > 0, row


# ------------------------------------------------------------------------------------------------ checks can fail
@pytest.fixture(scope="module")
def gc_mod():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_section(gc_mod, name, **override):
    ctx = gc_mod.Ctx(torch.device("cpu"), "tiny", 240)
    c = dict(gc_mod.mode_config("tiny")[name], **override)
    with ctx.guard(name, "(section)"):
        gc_mod.SECTION_FNS[name](ctx, c)
    return ctx.rows


def _perturbed_pack(monkeypatch):
    from ditkit.kernels import REGISTRY

    impl = REGISTRY.ops["vsa_pack"].impls["triton"]
    real = impl.fn

    def bad(x, src):
        out = real(x, src).clone()
        out.view(-1)[5] += 1.0
        return out

    monkeypatch.setattr(impl, "fn", bad)
    REGISTRY.clear_cache()


def _perturbed_bsa(monkeypatch):
    from ditkit.kernels import REGISTRY

    impl = REGISTRY.ops["block_sparse_attn"].impls["triton"]
    real = impl.fn
    monkeypatch.setattr(impl, "fn", lambda *a, **k: (lambda o: (o[0] * 1.01, o[1]))(real(*a, **k)))
    REGISTRY.clear_cache()


def _corrupt_stream_copy(monkeypatch):
    from ditkit.offload import streamer

    real = streamer.pack_layer

    def bad(index, layer, pin):
        pack = real(index, layer, pin)
        if index == 1:
            next(iter(pack.host.values())).view(torch.float32)[3] += 0.25   # a wrong value in the host pack
        return pack

    monkeypatch.setattr(streamer, "pack_layer", bad)


def _stale_adaln_table(monkeypatch):
    from ditkit.cache import adaln

    real = adaln.CachedAdalnProj.compute
    monkeypatch.setattr(adaln.CachedAdalnProj, "compute", lambda self, t: real(self, t) * 1.001)


def _rounding_uint8(monkeypatch):
    from ditkit.vae import video_stream

    def bad(x):
        x = x.movedim(1, -1)
        return (x * 255).round().clamp(0, 255).to(torch.uint8).reshape(-1, *x.shape[-3:])

    monkeypatch.setattr(video_stream, "to_uint8_frames", bad)


def _wrong_kept_frame(monkeypatch):
    from ditkit.vae import t1_decode

    monkeypatch.setattr(t1_decode, "repeat_clip_tokens", lambda m: (7, 2))


def _lokr_scale_off(monkeypatch):
    from ditkit.loaders import lokr_math

    real = lokr_math.add_delta_
    monkeypatch.setattr(lokr_math, "add_delta_", lambda w, f, s, **k: real(w, f, s * 1.01, **k))


SMALL = ((10, 3), (1, 4, 4))   # 2 prefix tiles (both ragged) + 1 video tile: the interpreter runs it quickly
FAULTS = [
    ("kernels", _perturbed_pack, "pack (triton == reference", dict(prefix=SMALL[0], video=SMALL[1])),
    ("vsa_perf", _perturbed_bsa, "fine stage vs float64", dict(cases=(("small",) + SMALL,))),
    ("te_stream", _corrupt_stream_copy, "streamed == resident", {}),
    ("adaln", _stale_adaln_table, "cached sampling == uncached", {}),
    ("video_save", _rounding_uint8, "uint8 on device (streaming) == whole float video path", {}),
    ("t1_decode", _wrong_kept_frame, "repeat-decode == frame 3", {}),
    ("lokr", _lokr_scale_off, "fused (chunked fp32) vs float64", {}),
]


@pytest.mark.parametrize("section,fault,check,override", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_section_reports_a_fault_as_fail_and_goes_on(gc_mod, monkeypatch, section, fault, check, override):
    if section in ("kernels", "vsa_perf"):
        from _kernels_interp import need_triton  # noqa: E402  (tests/unit on sys.path)

        need_triton()
    fault(monkeypatch)
    rows = _run_section(gc_mod, section, **override)
    try:
        hit = [r for r in rows if r["check"].startswith(check)]
        assert hit and all(r["result"] == "FAIL" for r in hit), rows
        assert not [r for r in rows if r["check"] == "(section)"], "the fault must fail the check, not crash the section"
        assert len(rows) > len(hit), "the section went on after the failing check"
    finally:
        from ditkit.kernels import REGISTRY

        monkeypatch.undo()
        REGISTRY.clear_cache()


def test_timing_helpers_interleave_and_ratio(gc_mod):
    calls = []
    timer = gc_mod.Timer(torch.device("cpu"))
    t = gc_mod.interleaved(timer, {"A": lambda: calls.append("A"), "B": lambda: calls.append("B")}, warmup=1,
                           rounds=3, deadline=float("inf"))
    assert calls == ["A", "B"] * 4 and len(t["A"]) == len(t["B"]) == 3
    r = gc_mod.ratio_stats([2.0, 9.0, 4.0], [1.0, 3.0, 1.0])
    assert (r["median"], r["min"], r["max"], r["rounds"]) == (3.0, 2.0, 4.0, 3)


def test_output_paths(gc_mod, tmp_path, monkeypatch):
    ns = type("A", (), {})
    a = ns()
    a.out, a.json = None, None
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert gc_mod.output_paths(a) == (tmp_path / "o" / "gpu_check.txt", tmp_path / "o" / "gpu_check.json")
    a.out = str(tmp_path / "r" / "table.txt")
    assert gc_mod.output_paths(a) == (tmp_path / "r" / "table.txt", tmp_path / "r" / "gpu_check.json")
    a.json = str(tmp_path / "x.json")
    assert gc_mod.output_paths(a)[1] == tmp_path / "x.json"
    monkeypatch.delenv("OUT")
    a.out = a.json = None
    monkeypatch.chdir(tmp_path)
    assert gc_mod.output_paths(a) == (None, tmp_path / "gpu_check.json")
