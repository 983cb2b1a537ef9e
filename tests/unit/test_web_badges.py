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
    # the nodes (send_report) and the host bridge (per-run reports from the wrappers bridge/ installs, sent through
    # the ReportTarget their node hands over: target.send(kind, ...)); bridge/reports.py is the sink itself
    for path in [*(ROOT / "nodes").glob("*.py"), *(ROOT / "bridge").glob("*.py")]:
        if path.parent.name == "bridge" and path.name == "reports.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # a sink that forwards its own ``kind`` (a ``send(self, kind, ...)`` passing ``kind`` on, e.g. the Raylight
        # rank-0 target) sends no kind of its own: its callers' literals are checked where they are
        forwards = {id(c) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "send"
                    for c in ast.walk(f) if isinstance(c, ast.Call) and c.args and isinstance(c.args[0], ast.Name)
                    and c.args[0].id == "kind" and "kind" in [a.arg for a in f.args.args]}
        for call in ast.walk(tree):
            if id(call) in forwards:
                continue
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "send_report":
                arg = call.args[2] if len(call.args) > 2 else next((k.value for k in call.keywords if k.arg == "kind"), None)
            elif isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "send" \
                    and call.args:
                arg = call.args[0]
            else:
                continue
            assert isinstance(arg, ast.Constant), f"{path.name}:{call.lineno}: report kind is not a literal"
            kinds.add(arg.value)
    return kinds


def test_every_report_kind_has_a_rendering():
    src = JS.read_text(encoding="utf-8")
    cases = set(re.findall(r'case "([a-z_0-9]+)":', src))
    summary = set(json.loads(re.search(r"SUMMARY_KINDS = (\[[^\]]*\])", src)[1]))
    sent = _kinds_sent_by_nodes()
    assert {"run", "teacache", "vae_decode", "lokr", "te_streaming", "adaln_cache", "teacache_calibration",
            "teacache_calibration_progress"} <= sent
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
    "schedule": {"node": "4", "kind": "schedule", "summary": "s", "data": {
        "recipe": "fasth3_8step_v2", "label": "FastH3 8-Step V2", "video_shift": 10.0, "audio_shift": 3.0,
        "forwards": 8, "contract": {"path": "p"}}},
    "schedule_none": {"node": "4", "kind": "schedule", "summary": "s", "data": {
        "recipe": "fasth3_preview_4step", "label": "FastH3 Preview v1 (4-step)", "video_shift": 12.0,
        "audio_shift": 3.0, "forwards": 4, "contract": None}},
    "load": {"node": "1", "kind": "load", "summary": "H3 official layout, 2 shards " + "x" * 80, "data": {}},
    "stepcache": {"node": "13", "kind": "stepcache", "summary": "s", "data": {
        "mode": "first_block", "calls": 8, "computed": 3, "skipped": 5, "block_eval_ratio": 2.6667,
        "streams": {"video": {"skipped": 5, "vetoes": 0}, "audio": {"skipped": 5, "vetoes": 2}}}},
    "stepcache_install": {"node": "13", "kind": "stepcache_install", "summary": "s", "data": {
        "mode": "sigma_schedule", "thresholds": {"video": 0.05, "audio": 0.04}}},
    "save_guard_bad": {"node": "20", "kind": "video_save", "summary": "s", "data": {
        "frames": 9, "chunks": 2, "audio_guard": {"clean": False, "flags": ["DC offset 0.0512 > 0.02 (item 0)"]}}},
    "save_guard_ok": {"node": "20", "kind": "video_save", "summary": "s", "data": {
        "frames": 9, "chunks": 2, "audio_guard": {"clean": True, "flags": []}}},
    # a loader that quantized while loading: data["quantization"] is QuantReport.as_dict() (built in the test below)
    "load_quant": {"node": "1", "kind": "load", "summary": "FLUX.2 (flux2): hidden_size 128, " + "x" * 80,
                   "data": {"weight_format": "float8_e4m3fn"}},
    "load_quant_small": {"node": "1", "kind": "load", "summary": "LTX-2 (ltxav): num_layers 2", "data": {}},
}


def _quant_report(fmt: str, classes: dict[str, tuple[int, int]]) -> dict:
    """What the loaders put in data["quantization"]: the core QuantReport's own as_dict()."""
    from ditkit.loaders.quantize import ClassStats, QuantReport

    r = QuantReport("flux2", fmt, "recipe")
    for name, (bi, bo) in classes.items():
        r.classes[name] = ClassStats(tensors=1, bytes_in=bi, bytes_out=bo, quantized=int(bo < bi))
    return r.as_dict()


# 3.5 MiB -> 2.0 MiB over two classes (one kept); 300 KiB -> 0.25 MiB (below 1 MiB: three decimals)
PAYLOADS["load_quant"]["data"]["quantization"] = _quant_report(
    "float8_e4m3fn", {"block MLP": (3 * 2 ** 20, int(1.5 * 2 ** 20)), "norms": (2 ** 19, 2 ** 19)})
PAYLOADS["load_quant_small"]["data"]["quantization"] = _quant_report("int8_tensorwise", {"a": (300 * 1024, 2 ** 18)})
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
    "schedule": ["FastH3 8-Step V2 · shifts 10/3", "8 forwards · contract ok"],
    "schedule_none": ["FastH3 Preview v1 (4-step) · shifts 12/3", "4 forwards · no contract"],
    "sparse_unverified": ["VSA flashinfer (unverified) ρ=0.50", "steps sparse 2 / dense 0"],
    "install_unverified": ["VSA keep 10% · flashinfer (unverified)"],
    "install": ["VSA keep 25% · auto"],
    "load_quant": ["float8_e4m3fn weights 3.5 MiB → 2.0 MiB", "FLUX.2 (flux2): hidden_size 128, " + "x" * 14 + "…"],
    "load_quant_small": ["int8_tensorwise weights 0.293 MiB → 0.250 MiB", "LTX-2 (ltxav): num_layers 2"],
    "stepcache": ["first_block skipped 5/8 (2.67x)", "video: 5 skipped · 0 vetoes", "audio: 5 skipped · 2 vetoes"],
    "stepcache_install": ["sigma_schedule · thr video 0.05, audio 0.04"],
    "save_guard_bad": ["saved 9 frames, 2 chunks", "audio: DC offset 0.0512 > 0.02 (item 0)"],
    "save_guard_ok": ["saved 9 frames, 2 chunks", "audio guard: clean"],
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
    assert len(out["load"]) == 1   # as stored: the summary only
    assert out["load_quant"][0]["color"] != out["load_quant"][1]["color"]


# The extension itself under Node.js: the frontend's app/api replaced by stubs that record the registered extension
# and the event listeners; nodes are plain objects with a ``badges`` list, as LGraphNode has.
HARNESS = r"""
const listeners = {};
const nodes = new Map();
const toasts = [];
globalThis.window = globalThis;
globalThis.__exts = [];
globalThis.__app = {
  registerExtension(e) { globalThis.__exts.push(e); },
  graph: { getNodeById: (id) => nodes.get(String(id)) ?? null },
  canvas: { setDirty() {} },
  extensionManager: { toast: { add: (t) => toasts.push(t) } },
};
globalThis.__api = { addEventListener(t, f) { (listeners[t] ||= []).push(f); }, apiURL: (p) => p };
const emit = (type, detail) => (listeners[type] || []).forEach((f) => f({ detail }));
const ctx = { font: "", save() {}, restore() {}, beginPath() {}, roundRect() {}, rect() {}, fill() {},
              fillText() {}, measureText: (t) => ({ width: 7 * t.length }) };
// what LGraphNode.drawBadges does (each slot function called, the badge drawn left to right above the title)
function draw(node) {
  let x = 0;
  const drawn = node.badges.map((b) => (typeof b === "function" ? b() : b));
  for (const b of drawn) { b.draw(ctx, x, -40); x += b.getWidth(ctx) + 2; }
  return drawn;
}
// what LGraphCanvas does on a click: the slot functions called again, the badge under the point clicked
function click(node, px, py) {
  for (const b of node.badges.map((f) => (typeof f === "function" ? f() : f)).filter((b) => b.onClick)) {
    const [x, y, w, h] = b.boundingRect;
    if (px >= x && px < x + w && py >= y && py < y + h) { b.onClick(); return b.text; }
  }
  return null;
}
async function newNode(ext, id, cls) {
  const n = { id, comfyClass: cls, badges: [], widgets: [{ name: "$$node-text-preview", value: "old report text" }],
              setDirtyCanvas() {} };
  nodes.set(String(id), n);
  await ext.nodeCreated(n);
  return n;
}

const mod = await import("./extensions/ditkit/js/ditkit.js");
await import("./extensions/ditkit-main/js/ditkit.js");   // the same pack served from a second web folder
const out = { registered: globalThis.__exts.map((e) => e.name) };
const ext = globalThis.__exts[0];
await ext.setup();

// 1. clicking a badge in the classic canvas opens the report
const tc = await newNode(ext, 5, "DitKitTeaCache");
emit("ditkit.report", { node: "5", node_type: "DitKitTeaCache", kind: "teacache", summary: "TeaCache: skipped 3 of 6",
                        data: { calls: 6, skipped: 3, computed: 3, block_eval_ratio: 2.0,
                                streams: { video: { computed: 3, skipped: 3 } } } });
const drawn = draw(tc);
const again = tc.badges.map((f) => (typeof f === "function" ? f() : f));
out.same_objects = drawn.every((b, i) => b === again[i]);
const first = drawn.find((b) => b.text);
out.rect = first.boundingRect.slice();
out.clicked = click(tc, first.boundingRect[0] + 3, first.boundingRect[1] + 3);
out.toast = toasts.map((t) => t.detail);

// 2. a cached output replayed for a node with another id in the new graph: drawn on that node, marked cached
emit("execution_start", { prompt_id: "p2" });
const vsa = await newNode(ext, 9, "DitKitSparseAttention");
await newNode(ext, 3, "DitKitH3ModelLoader");
emit("execution_cached", { nodes: ["9", "3"], prompt_id: "p2" });
emit("executed", { node: "9", display_node: "9", prompt_id: "p2", output: { ditkit_report: [
  { node: "3", node_type: "DitKitSparseAttention", kind: "install", summary: "VSA-H3 installed",
    data: { keep: 0.25, backend: "auto" } }] } });
out.cached_on_9 = mod.badgeTexts("9");
out.cached_on_3 = mod.badgeTexts("3");
// the run report of the same prompt arrived first: the replayed install report does not come back over it
emit("execution_start", { prompt_id: "p3" });
emit("ditkit.report", { node: "9", node_type: "DitKitSparseAttention", kind: "run", summary: "VSA run",
                        data: { backends_used: { cpu_batched: 4 }, calls: { sparse: 4 }, steps_sparse: 2,
                                steps_dense: 0, measured_density: 0.5 } });
emit("executed", { node: "9", display_node: "9", prompt_id: "p3", output: { ditkit_report: [
  { node_type: "DitKitSparseAttention", kind: "install", summary: "VSA-H3 installed", data: { keep: 0.25, backend: "auto" } }] } });
out.run_then_replay = mod.badgeTexts("9");

// 3. a node that fails shows its error only: no earlier badge, no earlier report text
emit("execution_start", { prompt_id: "p4" });
emit("execution_error", { prompt_id: "p4", node_id: "5", node_type: "DitKitTeaCache",
                          exception_type: "ditkit.errors.CoefficientError", exception_message: "no file" });
out.failed = mod.badgeTexts("5");
out.failed_text = tc.widgets[0].value;
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(NODE is None, reason="Node.js not installed (apt-get install nodejs)")
def test_extension_clicks_cached_reports_and_errors_under_node(tmp_path):
    for folder in ("ditkit", "ditkit-main"):
        ext = tmp_path / "extensions" / folder / "js"
        ext.mkdir(parents=True)
        shutil.copy(JS, ext / "ditkit.js")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text("export const app = globalThis.__app;\n")
    (tmp_path / "scripts" / "api.js").write_text("export const api = globalThis.__api;\n")
    runner = tmp_path / "run.mjs"
    runner.write_text(HARNESS)
    r = subprocess.run([NODE, str(runner)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["registered"] == ["ditkit.reports"], "a second copy of the extension registered again"
    # the hit-test sees the very badges that were drawn (with their bounding boxes), so a click opens the report
    assert out["same_objects"], "the slot functions returned other badge objects after drawing"
    assert out["rect"][2] > 0 and out["rect"][3] > 0, out["rect"]
    assert out["clicked"] == "TeaCache skipped 3/6 (2.00x)"
    assert out["toast"] and "[teacache] TeaCache: skipped 3 of 6" in out["toast"][-1]
    assert out["cached_on_9"] == ["VSA keep 25% · auto · cached"], out["cached_on_9"]
    assert out["cached_on_3"] == [], "the replayed report went to the id inside its payload"
    assert out["run_then_replay"] == ["VSA cpu_batched ρ=0.50", "steps sparse 2 / dense 0"], out["run_then_replay"]
    assert out["failed"] == ["error: CoefficientError: no file"], out["failed"]
    assert out["failed_text"] == "", "the failed node still shows the previous run's report text"


def _tool_comfy() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["comfy"]


def test_the_web_folder_is_registered_once():
    """ComfyUI registers a pack's web folder from ``WEB_DIRECTORY`` (keyed by the folder's name) and from
    pyproject ``[tool.comfy] web`` (keyed by the project name): with both, a clone not named 'ditkit' serves
    the extension twice. The runtime check (ComfyUI's own loader) is tests/integration/test_web_extension_host.py."""
    tree = ast.parse((ROOT / "__init__.py").read_text(encoding="utf-8"))
    has_web_directory = any(isinstance(t, ast.Name) and t.id == "WEB_DIRECTORY"
                            for st in tree.body if isinstance(st, ast.Assign) for t in st.targets)
    assert has_web_directory
    assert "web" not in _tool_comfy(), "[tool.comfy] web and WEB_DIRECTORY both register web/"


def test_the_icon_exists():
    icon = _tool_comfy().get("Icon")
    if not icon or icon.startswith(("http://", "https://")):
        return
    path = ROOT / icon
    assert path.is_file(), f"[tool.comfy] Icon = {icon!r} points at nothing"
    from xml.dom import minidom

    root = minidom.parse(str(path)).documentElement
    assert root.tagName == "svg" and root.getAttribute("viewBox"), "the icon is not an SVG with a viewBox"


# window.ditkit only in test mode (comfy-test's lint refuses a pack global): the extension's setup under Node.js with
# the test-mode switch off, on through localStorage, on through the URL, and set to another value
TEST_MODE_HARNESS = r"""
const mode = process.argv[2];
globalThis.window = globalThis;
globalThis.__exts = [];
globalThis.__app = { registerExtension(e) { globalThis.__exts.push(e); }, graph: { getNodeById: () => null },
                     canvas: { setDirty() {} }, extensionManager: { toast: { add() {} } } };
globalThis.__api = { addEventListener() {}, apiURL: (p) => p };
const stored = { ls: "1", ls0: "0" }[mode] ?? null;
Object.defineProperty(globalThis, "localStorage", { value: { getItem: (k) => (k === "ditkit.testMode" ? stored : null) },
                                                    configurable: true });
Object.defineProperty(globalThis, "location", { value: { search: mode === "url" ? "?x=1&ditkit_test=1" : "?x=1" },
                                                configurable: true });
const mod = await import("./extensions/ditkit/js/ditkit.js");
await globalThis.__exts[0].setup();
console.log(JSON.stringify({ exposed: typeof globalThis.ditkit, key: mod.TEST_MODE_KEY, mode: mod.testMode() }));
"""


@pytest.mark.skipif(NODE is None, reason="Node.js not installed (apt-get install nodejs)")
@pytest.mark.parametrize("mode, exposed", [("off", False), ("ls", True), ("url", True), ("ls0", False)])
def test_window_ditkit_only_in_test_mode(tmp_path, mode, exposed):
    ext = tmp_path / "extensions" / "ditkit" / "js"
    ext.mkdir(parents=True)
    shutil.copy(JS, ext / "ditkit.js")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text("export const app = globalThis.__app;\n")
    (tmp_path / "scripts" / "api.js").write_text("export const api = globalThis.__api;\n")
    runner = tmp_path / "run.mjs"
    runner.write_text(TEST_MODE_HARNESS)
    r = subprocess.run([NODE, str(runner), mode], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"exposed": "object" if exposed else "undefined", "key": "ditkit.testMode", "mode": exposed}


def test_the_browser_tests_switch_test_mode_on():
    """The browser tests read window.ditkit: they must set the key the extension reads, before the page loads."""
    src = (ROOT / "tests" / "integration" / "test_browser_reports.py").read_text(encoding="utf-8")
    assert "add_init_script(\"window.localStorage.setItem('ditkit.testMode', '1')\")" in src
    js = JS.read_text(encoding="utf-8")
    assert js.count("window.ditkit =") == 1 and "if (testMode()) window.ditkit =" in js
