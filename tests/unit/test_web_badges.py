"""web/js/ditkit.js without a browser: every report kind the nodes send is rendered, and the badge texts carry the
payload's numbers. The pure ``badgeSpecs`` function runs under Node.js (skipped when ``node`` is absent) with the
frontend's ``scripts/app.js`` / ``api.js`` replaced by stubs."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "web" / "js" / "ditkit.js"
NODE = shutil.which("node") or shutil.which("nodejs")


def _kinds_sent_by_nodes() -> set[str]:
    kinds = set()
    for path in (ROOT / "nodes").glob("*.py"):
        for call in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "send_report":
                arg = call.args[2] if len(call.args) > 2 else next((k.value for k in call.keywords if k.arg == "kind"), None)
                assert isinstance(arg, ast.Constant), f"{path.name}:{call.lineno}: report kind is not a literal"
                kinds.add(arg.value)
    return kinds


def test_every_report_kind_has_a_rendering():
    src = JS.read_text(encoding="utf-8")
    cases = set(re.findall(r'case "([a-z_0-9]+)":', src))
    summary = set(json.loads(re.search(r"SUMMARY_KINDS = (\[[^\]]*\])", src)[1]))
    sent = _kinds_sent_by_nodes()
    assert {"run", "teacache", "vae_decode", "lokr", "te_streaming", "adaln_cache"} <= sent
    assert not sent - cases - summary, f"report kinds without a badge rendering in ditkit.js: {sent - cases - summary}"


def test_imports_resolve_from_the_served_path():
    # ComfyUI serves web/js/ditkit.js as /extensions/<pack>/js/ditkit.js; the frontend modules are /scripts/*.js
    src = JS.read_text(encoding="utf-8")
    for mod in re.findall(r'^import .* from "([^"]+)";', src, flags=re.M):
        resolved = (Path("/extensions/ditkit/js") / mod).resolve()
        assert str(resolved).startswith("/scripts/"), f"{mod} resolves to {resolved}, not /scripts/..."


PAYLOADS = {
    "sparse_run": {"node": "11", "node_type": "DitKitSparseAttention", "kind": "run", "summary": "s", "data": {
        "keep": 0.25, "backend_requested": "auto", "backends_used": {"reference": 6}, "calls": {"sparse": 6, "masked call": 2},
        "steps_sparse": 5, "steps_dense": 1, "measured_density": 0.6667, "k_video": 1, "n_tiles": 4}},
    "sparse_none": {"node": "11", "kind": "run", "summary": "s", "data": {
        "backends_used": {}, "calls": {"not an H3 DiT forward": 4}, "steps_sparse": 0, "steps_dense": 4}},
    "teacache": {"node": "12", "kind": "teacache", "summary": "s", "data": {
        "calls": 6, "computed": 3, "skipped": 3, "block_eval_ratio": 2.0, "warnings": ["steps differ"],
        "streams": {"video": {"computed": 3, "skipped": 3}, "audio": {"computed": 4, "skipped": 2}}}},
    "decode": {"node": "15", "kind": "vae_decode", "summary": "s", "data": {"path": "repeat_decode", "batch": 1}},
    "decode_native": {"node": "15", "kind": "vae_decode", "summary": "s", "data": {"path": "native", "frames": 9}},
    "lokr": {"node": "3", "kind": "lokr", "summary": "s", "data": {
        "applied": [{"module": "a"}, {"module": "b"}], "unused": {"x.alpha": "no target"}, "refused": {}}},
    "stream": {"node": "3", "kind": "te_streaming", "summary": "s", "data": {
        "bytes_h2d": 3 * 2 ** 20, "peak_device_bytes": 2 ** 19}},
    "calib_fit": {"node": "7", "kind": "teacache_calibration", "summary": "s", "data": {
        "pairs_this_run": 10, "prompts": 3, "min_prompts": 3, "fit": {"video": {"r2": 0.98765}}}},
    "calib_pairs": {"node": "7", "kind": "teacache_calibration", "summary": "s", "data": {
        "pairs_this_run": 10, "prompts": 1, "min_prompts": 3}},
    "calib_live": {"node": "7", "kind": "teacache_calibration_progress", "summary": "s", "data": {
        "pairs": 12, "step": 3, "steps": 6}},
    "sparse_unverified": {"node": "11", "kind": "run", "summary": "s", "data": {
        "backends_used": {"flashinfer": 4}, "calls": {"sparse": 4}, "steps_sparse": 2, "steps_dense": 0,
        "measured_density": 0.5, "unverified_backends": {"flashinfer": "no sm100/sm120 device"}}},
    "install_unverified": {"node": "11", "kind": "install", "summary": "s", "data": {
        "keep": 0.1, "backend": "flashinfer", "backend_unverified": "no sm100/sm120 device"}},
    "install": {"node": "11", "kind": "install", "summary": "s", "data": {"keep": 0.25, "backend": "auto",
                                                                           "backend_unverified": None}},
    "error": {"node": "2", "kind": "error", "summary": "UnsupportedModelError: " + "y" * 100, "data": {}},
    "load": {"node": "1", "kind": "load", "summary": "H3 official layout, 2 shards " + "x" * 80, "data": {}},
}
EXPECTED = {
    "sparse_run": ["VSA reference ρ=0.67", "steps sparse 5 / dense 1"],
    "sparse_none": ["VSA: no sparse call (dense 4)"],
    "teacache": ["TeaCache skipped 3/6 (2.00x)", "video: 3 computed / 3 skipped", "audio: 4 computed / 2 skipped",
                 "fingerprint: 1 warning(s)"],
    "decode": ["T=1 repeat-decode"],
    "decode_native": ["native decode · 9 frames"],
    "lokr": ["LoKr 2 applied · 1 unused · 0 refused"],
    "stream": ["TE streamed 3.0 MiB · peak 0.500 MiB"],
    "calib_fit": ["fit video R²=0.988"],
    "calib_pairs": ["calib 10 pairs · 1/3 prompts"],
    "calib_live": ["calib recording: 12 pairs (step 3/6)"],
    "error": ["error: UnsupportedModelError: " + "y" * 33 + "…"],
    "sparse_unverified": ["VSA flashinfer (unverified) ρ=0.50", "steps sparse 2 / dense 0"],
    "install_unverified": ["VSA keep 10% · flashinfer (unverified)"],
    "install": ["VSA keep 25% · auto"],
}


@pytest.mark.skipif(NODE is None, reason="Node.js not installed (apt-get install nodejs)")
def test_badge_texts_under_node(tmp_path):
    ext = tmp_path / "extensions" / "ditkit" / "js"
    ext.mkdir(parents=True)
    shutil.copy(JS, ext / "ditkit.js")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text("export const app = { registerExtension(e) { globalThis.__ext = e; } };\n")
    (tmp_path / "scripts" / "api.js").write_text("export const api = { addEventListener() {}, apiURL: (p) => p };\n")
    runner = tmp_path / "run.mjs"
    runner.write_text(
        "import { badgeSpecs } from './extensions/ditkit/js/ditkit.js';\n"
        "const payloads = JSON.parse(process.argv[2]);\n"
        "const out = {};\n"
        "for (const [k, p] of Object.entries(payloads)) out[k] = badgeSpecs(p);\n"
        "out.__ext = globalThis.__ext.name;\n"
        "console.log(JSON.stringify(out));\n")
    r = subprocess.run([NODE, str(runner), json.dumps(PAYLOADS)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.pop("__ext") == "ditkit.reports"
    for key, want in EXPECTED.items():
        assert [b["text"] for b in out[key]] == want, (key, out[key])
    assert out["sparse_none"][0]["color"] != out["sparse_run"][0]["color"]  # no sparse call is flagged
    assert out["sparse_unverified"][0]["color"] != out["sparse_run"][0]["color"]  # nor a never-run backend
    assert out["install_unverified"][0]["color"] != out["install"][0]["color"]
    load = out["load"][0]["text"]
    assert load.startswith("H3 official layout, 2 shards") and len(load) <= 48 and load.endswith("…")
