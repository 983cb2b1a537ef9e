"""Every shipped example workflow in a real browser (classic canvas and Nodes 2.0) against a real ComfyUI.

For each ``example_workflows/<name>.json`` (what the template browser opens): load it with ``app.loadGraphData``,
read the rectangle every node really occupies as the page laid it out (classic: the node's size after the
frontend configured it, plus the title bar and the badge row drawn above it; Nodes 2.0: the node element's
bounding box in canvas coordinates, plus the badge row) and check that no two intersect; take a screenshot.
Then run it from the page (classic canvas; with ``DITKIT_BROWSER_ALL=1`` also in Nodes 2.0), wait for
``execution_success``, and click one ditkit badge: the toast it opens holds the server's own summary for that
node (oracle: the server log line, not the JS). Screenshots: ``$DITKIT_ARTEFACTS`` (default ``_out/browser``).

Slow (every example runs on CPU); needs what tests/integration/test_browser_reports.py needs.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.integration.test_browser_reports import ARTEFACTS, _click_badge, _open, _post_setting

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
TITLE, BADGE = 30, 2 + 20   # LiteGraph.NODE_TITLE_HEIGHT; drawBadges gap + the 20 px badge of web/js/ditkit.js

pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


def _rects(page, vue: bool) -> dict[str, list[float]]:
    """node id -> [x0, y0, x1, y1] in canvas coordinates, as laid out by the page."""
    if not vue:
        return page.evaluate("""([T, B]) => Object.fromEntries(window.app.graph.nodes.map((n) =>
            [String(n.id), [n.pos[0], n.pos[1] - T - B, n.pos[0] + n.size[0], n.pos[1] + n.size[1]]]))""", [TITLE, BADGE])
    return page.evaluate("""(B) => {
        const c = window.app.canvas, r = c.canvas.getBoundingClientRect(), out = {};
        for (const n of window.app.graph.nodes) {
            const el = document.querySelector(`[data-node-id="${n.id}"]`);
            if (!el) { out[String(n.id)] = null; continue; }
            const b = el.getBoundingClientRect();
            const [x0, y0] = c.ds.convertCanvasToOffset([b.left - r.left, b.top - r.top]);
            const [x1, y1] = c.ds.convertCanvasToOffset([b.right - r.left, b.bottom - r.top]);
            out[String(n.id)] = [x0, y0 - B, x1, y1];
        }
        return out;
    }""", BADGE)


def _overlaps(rects: dict) -> list[str]:
    ids = sorted(rects)
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            ra, rb = rects[a], rects[b]
            if ra[0] < rb[2] and rb[0] < ra[2] and ra[1] < rb[3] and rb[1] < ra[3]:
                out.append(f"nodes {a} and {b}: {[round(v) for v in ra]} / {[round(v) for v in rb]}")
    return out


def _load(page, wf: dict) -> None:
    """Load ``wf`` and wait until the page shows exactly its nodes: a fresh page may still be restoring its default
    workflow, which would otherwise replace ours after loadGraphData returned (seen once)."""
    want = sorted(str(n["id"]) for n in wf["nodes"])
    for _ in range(5):
        page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", wf)
        page.wait_for_timeout(1500)   # Nodes 2.0 mounts and measures its node elements
        have = page.evaluate("() => window.app.graph.nodes.map((n) => String(n.id)).sort()")
        if have == want:
            return
    pytest.fail(f"the page shows nodes {have}, not the workflow's {want}")


def _fit(page) -> None:
    page.evaluate("""() => {
        const c = window.app.canvas, ns = window.app.graph.nodes;
        let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
        for (const g of window.app.graph.groups ?? []) { const b = g._bounding ?? g.bounding;
            x0 = Math.min(x0, b[0]); y0 = Math.min(y0, b[1]); x1 = Math.max(x1, b[0] + b[2]); y1 = Math.max(y1, b[1] + b[3]); }
        for (const n of ns) { x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 60);
                              x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]); }
        const L = 70, W = c.canvas.clientWidth - L, H = c.canvas.clientHeight;   // the side bar covers the left edge
        const s = Math.min(1.2, 0.92 * Math.min(W / (x1 - x0), H / (y1 - y0)));
        c.ds.scale = s; c.ds.offset[0] = L / s + (W / s - (x1 - x0)) / 2 - x0;
        c.ds.offset[1] = (H / s - (y1 - y0)) / 2 - y0;
        c.setDirty(true, true);
    }""")
    page.wait_for_timeout(800)


def _thumbnail(page, path: Path) -> None:
    """The template browser's preview (frontend 1.49.6 asks ``/api/workflow_templates/<pack>/<name>.jpg``):
    the classic-canvas view of the loaded example, 720 px wide."""
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(page.screenshot(type="png"))).convert("RGB")
    img.thumbnail((720, 720))
    img.save(path.with_suffix(".jpg"), "JPEG", quality=70, optimize=True)


def _queue_and_wait(page, server) -> None:
    page.evaluate("""async () => {
        window.__ditkitDone = null;
        const { api } = await import('/scripts/api.js');
        if (!window.__ditkitListening) {
            window.__ditkitListening = true;
            api.addEventListener('execution_success', () => { window.__ditkitDone = 'success'; });
            api.addEventListener('execution_error', (e) => { window.__ditkitDone = 'error: ' + JSON.stringify(e.detail); });
        }
        await window.app.queuePrompt(0, 1);
    }""")
    deadline = time.monotonic() + float(os.environ.get("DITKIT_WORKFLOW_TIMEOUT", "900"))
    while time.monotonic() < deadline:
        done = page.evaluate("() => window.__ditkitDone")
        if done:
            assert done == "success", f"{done}\n--- server log ---\n{server.log_tail(40)}"
            return
        assert server.alive(), server.log_tail(40)
        time.sleep(1.0)
    pytest.fail(f"workflow did not finish\n{server.log_tail(40)}")


def _a_reporting_node(page) -> tuple[str, str] | None:
    """(node id, first badge text) of a ditkit node that shows a badge now."""
    return page.evaluate("""() => {
        for (const n of window.app.graph.nodes) {
            const t = window.ditkit.badgeTexts(String(n.id));
            if (t.length) return [String(n.id), t[0]];
        }
        return null;
    }""")


def _check(page, server, path: Path, vue: bool, run: bool) -> None:
    wf = json.loads(path.read_text(encoding="utf-8"))
    _load(page, wf)
    rects = _rects(page, vue)
    assert all(rects.values()), f"{path.stem}: nodes without an element: {[k for k, v in rects.items() if not v]}"
    _fit(page)
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    tag = "nodes2" if vue else "classic"
    page.screenshot(path=str(ARTEFACTS / f"example_{path.stem}_{tag}.png"))
    if not vue and os.environ.get("DITKIT_WRITE_THUMBNAILS"):
        _thumbnail(page, path)
    assert not _overlaps(rects), f"{path.stem} ({tag}): overlapping nodes:\n" + "\n".join(_overlaps(rects))
    if not run:
        return
    _queue_and_wait(page, server)
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTEFACTS / f"example_{path.stem}_{tag}_ran.png"))
    hit = _a_reporting_node(page)
    assert hit, f"{path.stem}: no ditkit node shows a badge after the run"
    node, text = hit
    kind_lines = re.findall(rf"\[ditkit\] \S+ #{node} \S+: (.*)", server.log_text())
    assert kind_lines, f"the server logged no report for node {node}"
    if vue:
        el = page.locator(f'[data-node-id="{node}"]').first
        assert text.split(" · ")[0] in el.inner_text(), (text, el.inner_text())
        el.get_by_text(text.split(" · ")[0], exact=False).first.click()
        toast = page.locator(".p-toast-message").filter(has_text="(ditkit)").last
        toast.wait_for(state="visible", timeout=10_000)
        toast_text = toast.inner_text()
    else:
        toast_text = _click_badge(page, node, text.split(" · ")[0])
    assert any(line.strip() in toast_text for line in kind_lines), (toast_text, kind_lines)
    page.screenshot(path=str(ARTEFACTS / f"example_{path.stem}_{tag}_badge.png"))


@pytest.fixture(scope="module")
def browser():
    from tests.integration.test_browser_reports import ARGS, CHROMIUM, sync_api

    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.mark.parametrize("vue", [False, True], ids=["classic", "nodes2"])
def test_examples_load_without_overlap(comfy_server, browser, vue):
    """Fast: every example loads in this canvas with no two nodes (with title bar and badge row) overlapping."""
    page, errors = _open(browser, comfy_server, vue=vue)
    try:
        problems = []
        for path in EXAMPLES:
            try:
                _check(page, comfy_server, path, vue, run=False)
            except AssertionError as e:
                problems.append(str(e))
        assert not problems, "\n\n".join(problems)
        assert not [e for e in errors if "ditkit" in e], errors
    finally:
        page.close()
        if vue:
            _post_setting(comfy_server.url, "Comfy.VueNodes.Enabled", False)


@pytest.mark.parametrize("vue", [False, True], ids=["classic", "nodes2"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_in_the_page_and_a_badge_opens_its_report(comfy_server, browser, path, vue):
    """Slow: run from the page, then click a ditkit badge. Nodes 2.0 runs only with DITKIT_BROWSER_ALL=1, except
    one example (so each canvas has its badge clicked in every run)."""
    if vue and not os.environ.get("DITKIT_BROWSER_ALL") and path.stem != "h3_image_roundtrip_tiny":
        pytest.skip("Nodes 2.0 runs one example unless DITKIT_BROWSER_ALL=1 (each run takes minutes on CPU)")
    page, errors = _open(browser, comfy_server, vue=vue)
    try:
        _check(page, comfy_server, path, vue, run=True)
        assert not [e for e in errors if "ditkit" in e], errors
    finally:
        page.close()
        if vue:
            _post_setting(comfy_server.url, "Comfy.VueNodes.Enabled", False)
