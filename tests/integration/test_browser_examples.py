"""Every shipped example workflow in a real browser (classic canvas and Nodes 2.0) against a real ComfyUI.

For each ``example_workflows/<name>.json`` (what the template browser opens): load it with ``app.loadGraphData``,
read the rectangle every node really occupies as the page laid it out (classic: the node's size after the
frontend configured it, plus the title bar and the badge row drawn above it; Nodes 2.0: the node element's
bounding box in canvas coordinates, plus the badge row) and check that no two intersect; take a screenshot.
Then run it from the page in both canvases (one page per canvas for the module, one server with ComfyUI's default
cache): first in the classic canvas (it executes), then in Nodes 2.0 (the same prompt: ComfyUI serves it from its
cache, near-instant).
After each run, wait for ``execution_success`` and click one ditkit badge: the toast it opens holds the server's own
summary for that node (oracle: the server log line, not the JS). After the cached run the node must be one that
ComfyUI reported cached (``execution_cached``) and its badge must say so (``· cached``): a node served from cache
shows the last report for that output. A ditkit loader that quantized while loading (``weight_format``) must name the
format and the MiB in -> out the server logged in its first badge. Screenshots: ``$DITKIT_ARTEFACTS`` (default ``_out/browser``).

Slow (every example runs once on CPU): the runs are marked ``slow`` (``DITKIT_SLOW=1``); the layout check of every
example in both canvases runs by default. Needs what tests/integration/test_browser_reports.py needs.
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
# a loaded workflow is measured once its layout held still for QUIET_MS (sampled every POLL_MS), at most SETTLE_MS
# (the fixed wait it replaces: a page's first load always waits that long)
SETTLE_MS, QUIET_MS, POLL_MS = 1500, 400, 100

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


def _frames(page, n: int = 2) -> None:
    """Wait until the page has drawn ``n`` more animation frames (the canvas redraws on the next frame); at most
    800 ms, the fixed wait this replaces (a page that draws no frames is no slower than before)."""
    page.evaluate("""(n) => new Promise((done) => { setTimeout(done, 800);
        const step = (k) => k ? requestAnimationFrame(() => step(k - 1)) : done(); step(n); })""", n)


def _settled(page, want: list[str], vue: bool, first: bool) -> bool:
    """True once the page shows exactly the workflow's nodes and their laid-out rectangles (what ``_rects``
    measures: Nodes 2.0 mounts and measures its node elements after loadGraphData returned) stayed the same
    for ``QUIET_MS`` on consecutive samples; False when that did not happen within ``SETTLE_MS``. A page's
    first load waits the whole ``SETTLE_MS``: a fresh page may still be restoring its default workflow, which
    would otherwise replace ours after loadGraphData returned (seen once)."""
    t0, last, since = time.monotonic(), None, None
    while (now := time.monotonic()) - t0 < SETTLE_MS / 1000:
        have = page.evaluate("() => window.app.graph.nodes.map((n) => String(n.id)).sort()")
        cur = (have, _rects(page, vue)) if have == want else None
        if cur is None or not all(cur[1].values()) or cur != last:
            last, since = cur, now
        elif (now - since) * 1000 >= QUIET_MS and not first:
            return True
        page.wait_for_timeout(POLL_MS)
    return last is not None and all(last[1].values())


def _load(page, wf: dict, vue: bool) -> None:
    """Load ``wf`` and wait until the page shows exactly its nodes, laid out (:func:`_settled`)."""
    want = sorted(str(n["id"]) for n in wf["nodes"])
    for _ in range(5):
        first = not page.evaluate("() => !!window.__ditkitLoaded")
        page.evaluate("async (wf) => { await window.app.loadGraphData(wf); window.__ditkitLoaded = true; }", wf)
        if _settled(page, want, vue, first):
            return
    have = page.evaluate("() => window.app.graph.nodes.map((n) => String(n.id)).sort()")
    pytest.fail(f"the page shows nodes {have}, not the workflow's {want} (or their layout did not settle)")


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
    _frames(page)


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
        window.__ditkitCached = [];
        const { api } = await import('/scripts/api.js');
        if (!window.__ditkitListening) {
            window.__ditkitListening = true;
            api.addEventListener('execution_cached', (e) => {
                window.__ditkitCached = (e.detail?.nodes ?? []).map(String); });
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
        time.sleep(0.1)
    pytest.fail(f"workflow did not finish\n{server.log_tail(40)}")


def _a_reporting_node(page, cached: bool) -> tuple[str, str, str] | None:
    """(node id, node type, first badge text) of a ditkit node that shows a badge now: one ComfyUI served from its
    cache in this run (``cached``), else preferably one that executed (another example's identical node may have
    been served from the cache: its report was logged under that example's node id)."""
    return page.evaluate("""(cached) => {
        const fromCache = new Set(window.__ditkitCached ?? []), hits = [];
        for (const n of window.app.graph.nodes) {
            const t = window.ditkit.badgeTexts(String(n.id));
            if (t.length) hits.push([String(n.id), String(n.type), t[0], fromCache.has(String(n.id))]);
        }
        const pick = hits.find((h) => h[3] === cached) ?? (cached ? null : hits[0]);
        return pick ? pick.slice(0, 3) : null;
    }""", cached)


def _check_quantizing_loaders(page, server, path: Path) -> None:
    """A ditkit loader that quantized while loading (``weight_format`` set in the API twin) says so in its first
    badge: the format it was asked for and the MiB in -> out that the server logged for that load (its report
    line rounds to 0.1 MiB)."""
    api = json.loads((path.parent / "api" / path.name).read_text(encoding="utf-8"))
    log = server.log_text()
    for nid, node in api.items():
        fmt = node["inputs"].get("weight_format")
        if not node["class_type"].startswith("DitKit") or fmt in (None, "as stored"):
            continue
        texts = page.evaluate("(id) => window.ditkit.badgeTexts(id)", nid)
        m = re.fullmatch(rf"{re.escape(fmt)} weights ([\d.]+) MiB → ([\d.]+) MiB( · cached)?", texts[0] if texts else "")
        assert m, f"{path.stem}: node {nid} ({node['class_type']}) badges {texts} do not name {fmt} and its bytes"
        logged = re.findall(rf"\[ditkit\] {node['class_type']} #\S+ load: .*quantized {re.escape(fmt)} "
                            r"\(weight-only\).*; ([\d.]+) MiB -> ([\d.]+) MiB", log)
        assert logged, f"the server logged no {fmt} load for {node['class_type']}"
        for shown, said in zip(m.groups()[:2], logged[-1]):
            assert abs(float(shown) - float(said)) <= 0.0505, (texts[0], logged[-1])


def _check(page, server, path: Path, vue: bool, run: bool, cached: bool = False) -> None:
    """Load, measure, screenshot; with ``run`` also queue it and click a badge. ``cached``: the same prompt already
    ran on this server, so ComfyUI serves it from its cache and the clicked badge must be a cached node's."""
    wf = json.loads(path.read_text(encoding="utf-8"))
    _load(page, wf, vue)
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
    _frames(page)       # the reports came over the websocket before execution_success; the canvas draws them next
    page.screenshot(path=str(ARTEFACTS / f"example_{path.stem}_{tag}_ran.png"))
    from_cache = page.evaluate("() => window.__ditkitCached")
    if cached:
        assert from_cache, f"{path.stem} ({tag}): the re-run of the same prompt was not served from the cache"
    hit = _a_reporting_node(page, cached)
    assert hit, (f"{path.stem} ({tag}): no ditkit node {'served from the cache ' if cached else ''}shows a badge "
                 f"after the run (cached: {from_cache})")
    node, node_type, text = hit
    log = server.log_text()
    kind_lines = re.findall(rf"\[ditkit\] \S+ #{node} \S+: (.*)", log)
    if node in from_cache:
        # the report is the one logged when the output was made (this example's classic run: the same node id,
        # or an earlier example's identical node under its own id)
        assert text.endswith(" · cached"), (node, text)
        kind_lines += re.findall(rf"\[ditkit\] {re.escape(node_type)} #\S+ \S+: (.*)", log)
    assert kind_lines, f"the server logged no report for node {node}"
    # the page is shared: no old toast, and no side panel the frontend opened over the canvas (the Media Assets
    # panel was found open after a dozen runs on one page: badge clicks then landed on it)
    page.evaluate("""() => { const m = window.app.extensionManager; m?.toast?.removeAll?.();
        const s = m?.sidebarTab; if (s?.activeSidebarTabId) s.toggleSidebarTab(s.activeSidebarTabId); }""")
    page.wait_for_timeout(300)
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
    if node in from_cache:
        assert "cached output" in toast_text, toast_text
    page.screenshot(path=str(ARTEFACTS / f"example_{path.stem}_{tag}_badge.png"))
    _check_quantizing_loaders(page, server, path)


@pytest.fixture(scope="module")
def browser():
    from tests.integration.test_browser_reports import ARGS, CHROMIUM, sync_api

    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def canvases(comfy_server_cached, browser):
    """One page per canvas for the whole module, on one server with ComfyUI's default cache: {False: classic,
    True: Nodes 2.0} -> (page, page errors). A page reads the canvas setting when it loads, so the classic page
    stays classic after the setting is switched on for the Nodes 2.0 page (checked by ``_mode``)."""
    pages = {}
    try:
        for vue in (False, True):
            pages[vue] = _open(browser, comfy_server_cached, vue=vue)
        for vue, (page, _) in pages.items():
            assert _mode(page) is vue, f"the {'Nodes 2.0' if vue else 'classic'} page runs in the other mode"
        yield pages
    finally:
        for page, _ in pages.values():
            page.close()
        _post_setting(comfy_server_cached.url, "Comfy.VueNodes.Enabled", False)


def _mode(page) -> bool:
    """Whether this page renders Nodes 2.0 (its own settings store)."""
    return bool(page.evaluate("""() => { const m = window.app.extensionManager;
        return m?.setting?.get ? m.setting.get('Comfy.VueNodes.Enabled')
                               : window.app.ui.settings.getSettingValue('Comfy.VueNodes.Enabled'); }"""))


@pytest.mark.parametrize("vue", [False, True], ids=["classic", "nodes2"])
def test_examples_load_without_overlap(comfy_server_cached, canvases, vue):
    """Fast: every example loads in this canvas with no two nodes (with title bar and badge row) overlapping."""
    page, errors = canvases[vue]
    n0 = len(errors)
    problems = []
    for path in EXAMPLES:
        try:
            _check(page, comfy_server_cached, path, vue, run=False)
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n\n".join(problems)
    assert not [e for e in errors[n0:] if "ditkit" in e], errors[n0:]


@pytest.mark.slow  # about 36 s per example on 2 CPU cores (15 examples: ~9 min); DITKIT_SLOW=1 runs them
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_in_both_canvases_and_a_badge_opens_its_report(comfy_server_cached, canvases, path):
    """Slow: run from the classic canvas and click a ditkit badge; then the same example in Nodes 2.0 on the same
    server, where ComfyUI's cache serves the whole prompt (near-instant): the badges show the cached report."""
    for vue in (False, True):
        page, errors = canvases[vue]
        n0 = len(errors)
        _check(page, comfy_server_cached, path, vue, run=True, cached=vue)
        assert not [e for e in errors[n0:] if "ditkit" in e], errors[n0:]
