"""web/js/ditkit.js in a real browser against a real ComfyUI (classic canvas and Nodes 2.0).

Loads ``tests/data/workflows/ditkit_showcase_tiny.json`` (a test graph, not an example; UI format: TeaCache calibration on 3 prompts, then VSA-H3
sparse attention + calibrated TeaCache on the tiny FastH3 model, T=1 decode with the H3 video VAE) into the page
with ``app.loadGraphData``, queues it from the page (``app.queuePrompt``), waits for ``execution_success`` and reads
the badges back from the node objects (classic) or the DOM (Nodes 2.0). The oracle for every counter is the
server's own log line for that report (written by Python before the websocket event is sent), never the JS.
Screenshots go to ``$DITKIT_ARTEFACTS`` (default ``<repo>/_out/browser``).

Needs: COMFYUI_PATH (``comfy_server`` fixture), ``pip install playwright`` and a Chromium
(``apt-get install chromium``; path from ``$DITKIT_CHROMIUM``, default ``/usr/bin/chromium``). Skips otherwise.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / "tests" / "data" / "workflows" / "ditkit_showcase_tiny.json"
ARTEFACTS = Path(os.environ.get("DITKIT_ARTEFACTS", REPO / "_out" / "browser"))
CHROMIUM = os.environ.get("DITKIT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
SPARSE, TEACACHE, CALIB, DECODE = "11", "12", "7", "15"
# screenshot layout (the committed twin keeps the generator's layout; badges need room above each title)
LAYOUT = {1: (100, 100), 3: (100, 320), 14: (100, 560), 2: (100, 740), 4: (500, 100), 5: (500, 320), 6: (500, 540),
          7: (900, 100), 11: (900, 640), 12: (900, 1060), 8: (1300, 100), 9: (1300, 560), 10: (1300, 1020),
          13: (1700, 100), 15: (1700, 560), 16: (1700, 800)}

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set DITKIT_CHROMIUM)",
                allow_module_level=True)


def _post_setting(url: str, key: str, value) -> None:
    req = urllib.request.Request(f"{url}/api/settings/{key}", data=json.dumps(value).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback test server
        assert r.status == 200


def _log_report(log: str, node: str, kind: str) -> str:
    """The last summary the server logged for report ``kind`` of node ``node`` ('[ditkit] <type> #<id> <kind>: ...')."""
    hits = re.findall(rf"\[ditkit\] \S+ #{node} {kind}: (.*)", log)
    assert hits, f"the server logged no '{kind}' report for node {node}"
    return hits[-1]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _open(browser, server, vue: bool):
    for k, v in {"Comfy.TutorialCompleted": True, "Comfy.VueNodes.Enabled": vue,
                 "Comfy.NodeBadge.NodeIdBadgeMode": "Show all"}.items():
        _post_setting(server.url, k, v)
    page = browser.new_page(viewport={"width": 1800, "height": 1100})
    # web/js/ditkit.js exposes window.ditkit only in test mode (localStorage key, set before the extension loads)
    page.add_init_script("window.localStorage.setItem('ditkit.testMode', '1')")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "ditkit" in m.text else None)
    page.goto(server.url, wait_until="domcontentloaded")
    page.wait_for_function("() => window.app && window.app.graph && window.ditkit && window.app.extensionManager",
                           timeout=120_000)
    return page, errors


def _run_showcase(page, server) -> None:
    wf = json.loads(WORKFLOW.read_text())
    for n in wf["nodes"]:
        n["pos"] = list(LAYOUT.get(n["id"], n["pos"]))
    page.evaluate("""async (wf) => {
        window.__ditkitDone = null;
        const { api } = await import('/scripts/api.js');
        api.addEventListener('execution_success', () => { window.__ditkitDone = 'success'; });
        api.addEventListener('execution_error', (e) => { window.__ditkitDone = 'error: ' + JSON.stringify(e.detail); });
        await window.app.loadGraphData(wf);
        await window.app.queuePrompt(0, 1);
    }""", wf)
    deadline = time.monotonic() + float(os.environ.get("DITKIT_WORKFLOW_TIMEOUT", "600"))
    while time.monotonic() < deadline:
        done = page.evaluate("() => window.__ditkitDone")
        if done:
            assert done == "success", f"{done}\n--- server log ---\n{server.log_tail(40)}"
            return
        assert server.alive(), server.log_tail(40)
        time.sleep(0.5)
    pytest.fail(f"workflow did not finish\n{server.log_tail(40)}")


def _canvas_badges(page, node: str) -> list[str]:
    return page.evaluate("""(id) => {
        const n = window.app.graph.getNodeById(id) ?? window.app.graph.getNodeById(Number(id));
        return (n?.badges ?? []).map((b) => (typeof b === 'function' ? b() : b)).map((b) => b?.text ?? '')
                                .filter((t) => t);
    }""", node)


def _click_badge(page, node: str, prefix: str) -> str:
    """Click, with the mouse, the centre of the drawn badge of ``node`` whose text starts with ``prefix`` (its
    boundingRect, set by the last draw, is node-relative) and return the text of the toast it opens."""
    # as a user would: bring the node into view at 100 % zoom (a wide workflow fitted to the window is drawn in
    # LiteGraph's low-quality mode, which draws no badges), then let a frame draw the current badges
    page.evaluate("""(id) => {
        const n = window.app.graph.getNodeById(Number(id));
        const c = window.app.canvas;
        c.ds.scale = 1;
        c.ds.offset = [120 - n.pos[0], 160 - n.pos[1]];
        c.setDirty(true, true);
    }""", node)
    page.wait_for_timeout(500)
    # then bring the badge itself to the middle of the canvas: a node with many badges draws them far to the left
    # of its body (the TeaCache node: 600 px of badges), where, near the window's edge, the click landed on the
    # sidebar (its Assets button opened the Media Assets panel instead of the toast)
    page.evaluate("""([id, prefix]) => {
        const n = window.app.graph.getNodeById(Number(id));
        const c = window.app.canvas;
        const b = n.badges.map((f) => (typeof f === 'function' ? f() : f))
                          .find((x) => x && x.onClick && (x.text || '').startsWith(prefix));
        if (!b || !(b.boundingRect[2] > 0)) return;
        const [x, y, w, h] = b.boundingRect;
        const r = c.canvas.getBoundingClientRect();
        const k = c.canvas.width / r.width;
        c.ds.offset = [(r.width / 2) * k - (n.pos[0] + x + w / 2), (r.height / 3) * k - (n.pos[1] + y + h / 2)];
        c.setDirty(true, true);
    }""", [node, prefix])
    page.wait_for_timeout(500)
    pos = page.evaluate("""([id, prefix]) => {
        const n = window.app.graph.getNodeById(Number(id));
        const c = window.app.canvas;
        const b = n.badges.map((f) => (typeof f === 'function' ? f() : f))
                          .find((x) => x && x.onClick && (x.text || '').startsWith(prefix));
        if (!b) return null;
        const [x, y, w, h] = b.boundingRect;
        if (!(w > 0 && h > 0)) return { text: b.text, rect: [x, y, w, h] };
        const [sx, sy] = c.ds.convertOffsetToCanvas([n.pos[0] + x + w / 2, n.pos[1] + y + h / 2]);
        const r = c.canvas.getBoundingClientRect();
        const k = r.width / c.canvas.width;   // canvas pixels -> CSS pixels
        return { text: b.text, x: r.left + sx * k, y: r.top + sy * k };
    }""", [node, prefix])
    assert pos and "x" in pos, f"no drawn badge starting with {prefix!r} on node {node}: {pos}"
    page.mouse.click(pos["x"], pos["y"])
    toast = page.locator(".p-toast-message").filter(has_text="(ditkit)").last
    toast.wait_for(state="visible", timeout=10_000)
    return toast.inner_text()


def _shot(page, name: str, nodes: list[str] | None = None) -> Path:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("""(ids) => {
        const c = window.app.canvas;
        const ns = ids ? ids.map((i) => window.app.graph.getNodeById(Number(i))) : window.app.graph.nodes;
        let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
        for (const n of ns) { x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 80);
                              x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]); }
        const W = c.canvas.clientWidth, H = c.canvas.clientHeight;
        const s = Math.min(1.3, 0.9 * Math.min(W / (x1 - x0), H / (y1 - y0)));
        c.ds.scale = s; c.ds.offset[0] = (W / s - (x1 - x0)) / 2 - x0; c.ds.offset[1] = (H / s - (y1 - y0)) / 2 - y0;
        c.setDirty(true, true);
    }""", nodes)
    page.wait_for_timeout(800)
    path = ARTEFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def _expected(server) -> dict:
    log = server.log_text()
    run = _log_report(log, SPARSE, "run")
    tc = _log_report(log, TEACACHE, "teacache")
    cal = _log_report(log, CALIB, "teacache_calibration")
    dec = _log_report(log, DECODE, "vae_decode")
    m_run = re.search(r"backend (\S+); steps sparse (\d+) / dense (\d+).*measured block density ([0-9.]+)", run)
    m_tc = re.search(r"computed (\d+)/(\d+) calls, skipped (\d+)", tc)
    streams = re.findall(r"(video|audio): skipped (\d+) / computed (\d+)", tc)
    r2 = re.findall(r"(video|audio) R2 ([0-9.]+)", cal)
    assert m_run and m_tc and streams and r2, (run, tc, cal)
    assert "duplicated to a 7-token clip" in dec, dec
    m_idle = re.search(r"/ (\d+) without block attention", run)
    return {"backend": m_run[1], "sparse": int(m_run[2]), "dense": int(m_run[3]), "density": float(m_run[4]),
            "idle": int(m_idle[1]) if m_idle else 0,
            "computed": int(m_tc[1]), "calls": int(m_tc[2]), "skipped": int(m_tc[3]), "streams": streams, "r2": r2}


def _check_texts(texts: dict[str, list[str]], exp: dict) -> None:
    sp, tc, cal, dec = (" | ".join(texts[k]) for k in (SPARSE, TEACACHE, CALIB, DECODE))
    assert f"VSA {exp['backend']} ρ={exp['density']:.2f}" in sp, sp
    assert f"steps sparse {exp['sparse']} / dense {exp['dense']}" in sp, sp
    assert exp["sparse"] > 0
    # two independent counters agree: steps where TeaCache skipped the block stack ran no sparse attention
    assert exp["idle"] == exp["skipped"], (exp["idle"], exp["skipped"])
    if exp["idle"]:
        assert f"/ {exp['idle']} cache-skipped" in sp, sp
    assert f"TeaCache skipped {exp['skipped']}/{exp['calls']}" in tc, tc
    assert exp["skipped"] > 0 and exp["computed"] + exp["skipped"] == exp["calls"]
    for s, skipped, computed in exp["streams"]:
        assert f"{s}: {computed} computed / {skipped} skipped" in tc, tc
    for s, r in exp["r2"]:
        assert f"{s} R²={float(r):.3f}" in cal, cal
    assert "T=1 repeat-decode" in dec, dec


def test_badges_classic_canvas(comfy_server, browser):
    page, errors = _open(browser, comfy_server, vue=False)
    try:
        _run_showcase(page, comfy_server)
        page.wait_for_timeout(500)
        exp = _expected(comfy_server)
        texts = {n: _canvas_badges(page, n) for n in (SPARSE, TEACACHE, CALIB, DECODE)}
        _check_texts(texts, exp)
        # the calibration view fetched the coefficient + pair files and holds one series per stream
        plot = page.evaluate("""() => { const n = window.app.graph.getNodeById(7);
            const p = n.ditkitCal && n.ditkitCal.plot; if (!p) return null;
            return Object.fromEntries(Object.entries(p).map(([k, v]) => [k, v.points.length])); }""")
        assert plot and set(plot) == {s for s, _ in exp["r2"]} and all(v > 0 for v in plot.values()), plot
        full = _shot(page, "classic_full")
        zoom = _shot(page, "classic_sparse_teacache_decode", [CALIB, SPARSE, TEACACHE, "13", DECODE])
        assert full.stat().st_size > 10_000 and zoom.stat().st_size > 10_000
        # a click on the drawn VSA badge opens the node's report: the server's own run summary
        text = _click_badge(page, SPARSE, "VSA ")
        assert _log_report(comfy_server.log_text(), SPARSE, "run") in text, text
        assert "[run] " in text and "(ditkit)" in text, text
        _shot(page, "classic_badge_clicked", [CALIB, SPARSE, TEACACHE, "13", DECODE])
        assert not [e for e in errors if "ditkit" in e], errors
    finally:
        page.close()


def test_badges_nodes_2(comfy_server, browser):
    page, errors = _open(browser, comfy_server, vue=True)
    try:
        assert page.evaluate("() => window.app.extensionManager.setting.get('Comfy.VueNodes.Enabled')") is True
        _run_showcase(page, comfy_server)
        page.wait_for_timeout(1000)
        exp = _expected(comfy_server)
        texts = {}
        for n in (SPARSE, TEACACHE, CALIB, DECODE):
            el = page.locator(f'[data-node-id="{n}"]').first
            el.wait_for(state="attached", timeout=30_000)
            texts[n] = [el.inner_text()]
        _check_texts(texts, exp)
        shot = _shot(page, "nodes2_full")
        assert shot.stat().st_size > 10_000
        assert not [e for e in errors if "ditkit" in e], errors
    finally:
        page.close()
        _post_setting(comfy_server.url, "Comfy.VueNodes.Enabled", False)


def test_ditkit_error_reaches_the_node(comfy_server, browser):
    """A ditkit node that refuses its input (VSA-H3 on a Z-Image model) after a run that succeeded: the
    execution_error event carries the actionable message (ComfyUI outlines the node and opens its error panel),
    the extension keeps the message as the node's only badge, and the previous run's report text is gone."""
    page, errors = _open(browser, comfy_server, vue=False)
    try:
        detail = page.evaluate("""async () => {
            const { api } = await import('/scripts/api.js');
            const run = () => new Promise((res) => {
                const ok = () => { api.removeEventListener('execution_error', bad); res(null); };
                const bad = (e) => { api.removeEventListener('execution_success', ok); res(e.detail); };
                api.addEventListener('execution_error', bad, { once: true });
                api.addEventListener('execution_success', ok, { once: true });
                window.app.queuePrompt(0, 1);
            });
            const g = window.app.graph;
            g.clear();
            const h = LiteGraph.createNode('UNETLoader'); h.pos = [100, 300]; g.add(h);
            h.widgets.find((w) => w.name === 'unet_name').value = 'h3_tiny_fasth3.safetensors';
            const a = LiteGraph.createNode('DitKitZImageLoader'); a.pos = [100, 100]; g.add(a);
            a.widgets.find((w) => w.name === 'unet_name').value = 'zimage_tiny.safetensors';
            const b = LiteGraph.createNode('DitKitSparseAttention'); b.pos = [500, 100]; g.add(b);
            const c = LiteGraph.createNode('PreviewAny'); c.pos = [900, 100]; g.add(c);
            // first a run that succeeds: the node shows its install report (badge and the frontend's report text)
            h.connect(0, b, 0); b.connect(0, c, 0);
            const first = await run();
            const text = () => b.widgets?.find((w) => w.name === '$$node-text-preview')?.value ?? null;
            const before = { error: first, text: text(), badges: window.ditkit.badgeTexts(String(b.id)) };
            // then the same node fails (a Z-Image model)
            a.connect(0, b, 0);
            const d = await run();
            return d && { ...d, node: String(b.id), before, after_text: text() };
        }""")
        assert detail, "the workflow did not fail"
        before = detail["before"]
        assert before["error"] is None and before["text"] and "VSA-H3 installed" in before["text"], before
        assert before["badges"] and before["badges"][0].startswith("VSA keep"), before
        # the failed node does not keep showing the previous run's report text under its error badge
        assert not detail["after_text"], detail["after_text"]
        assert detail["node_type"] == "DitKitSparseAttention", detail
        assert detail["exception_type"].endswith("UnsupportedModelError"), detail
        msg = detail["exception_message"]
        assert "needs a MiniMax H3 / FastH3 model" in msg and "Model Sparse Attention" in msg, msg
        page.wait_for_function("(id) => window.ditkit.badgeTexts(id).length > 0", arg=detail["node"], timeout=15_000)
        texts = _canvas_badges(page, detail["node"])   # also the frontend's own id/source badge
        assert any(t.startswith("error: UnsupportedModelError: DitKitSparseAttention: VSA-H3") for t in texts), texts
        ours = page.evaluate("(id) => window.ditkit.badgeTexts(id)", detail["node"])
        assert len(ours) == 1 and ours[0].startswith("error: UnsupportedModelError"), ours   # the install badge is gone
        _shot(page, "classic_error")
        assert not [e for e in errors if "ditkit" in e], errors
    finally:
        page.close()
