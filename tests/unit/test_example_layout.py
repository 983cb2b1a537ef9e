"""The shipped example workflows are laid out for reading (no server).

Geometry, written here from the frontend's own drawing code (frontend 1.49.6), not taken from the converter:
a node's ``pos`` is the top-left of its body; the title bar (``LiteGraph.NODE_TITLE_HEIGHT`` = 30) is drawn above
it, and the classic canvas draws ``node.badges`` in one row above the title bar (``LGraphNode.drawBadges``: bottom
edge at ``-(NODE_TITLE_HEIGHT + 2)``), each badge as high as web/js/ditkit.js makes it (read from the file below).
Nodes 2.0 shows the same badges inside the node header, so the classic extent is the larger of the two.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "example_workflows"
NODE_TITLE_HEIGHT = 30      # LiteGraph.NODE_TITLE_HEIGHT
BADGE_GAP = 2               # LGraphNode.drawBadges default gap
NOTE_TYPES = {"Note", "MarkdownNote"}
VISIBLE_OUTPUTS = {"DitKitSaveVideo", "SaveImage", "SaveVideo", "SaveAudio", "SaveAnimatedWEBP"}
SAMPLERS = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced"}


def _badge_height() -> int:
    """The badge height web/js/ditkit.js draws (its fallback badge; LGraphBadge's default is also 20)."""
    js = (REPO / "web" / "js" / "ditkit.js").read_text(encoding="utf-8")
    m = re.search(r"text, height: (\d+),", js)
    assert m, "web/js/ditkit.js: badge height not found"
    return int(m[1])


def ui_workflows(folder: Path = EXAMPLES) -> list[Path]:
    return sorted(folder.glob("*.json"))


def extent(node: dict, badge_h: int) -> tuple[float, float, float, float]:
    x, y = node["pos"]
    w, h = node["size"]
    return (x, y - NODE_TITLE_HEIGHT - BADGE_GAP - badge_h, x + w, y + h)


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def layout_problems(wf: dict, badge_h: int) -> list[str]:
    """Overlapping nodes, nodes outside every group or in two, group titles covered, links flowing right to left."""
    nodes = wf["nodes"]
    out = []
    boxes = {n["id"]: extent(n, badge_h) for n in nodes}
    ids = sorted(boxes)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            if _overlap(boxes[a], boxes[b]):
                out.append(f"nodes {a} and {b} overlap: {boxes[a]} / {boxes[b]}")
    groups = wf.get("groups") or []
    if not groups:
        out.append("no groups")
    for n in nodes:
        if n["type"] in NOTE_TYPES:
            continue
        x0, y0, x1, y1 = boxes[n["id"]]
        inside = [g["title"] for g in groups
                  if g["bounding"][0] <= x0 and x1 <= g["bounding"][0] + g["bounding"][2]
                  and g["bounding"][1] + g.get("font_size", 24) * 1.4 <= y0
                  and y1 <= g["bounding"][1] + g["bounding"][3]]
        if len(inside) != 1:
            out.append(f"node {n['id']} ({n['type']}) is inside groups {inside} (expected exactly one)")
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            ra = (a["bounding"][0], a["bounding"][1], a["bounding"][0] + a["bounding"][2],
                  a["bounding"][1] + a["bounding"][3])
            rb = (b["bounding"][0], b["bounding"][1], b["bounding"][0] + b["bounding"][2],
                  b["bounding"][1] + b["bounding"][3])
            if _overlap(ra, rb):
                out.append(f"groups {a['title']!r} and {b['title']!r} overlap")
    by_id = {n["id"]: n for n in nodes}
    for ln in wf.get("links") or []:
        src, dst = by_id[ln[1]], by_id[ln[3]]
        if not (src["pos"][0] < dst["pos"][0] or (src["pos"][0] == dst["pos"][0] and src["pos"][1] < dst["pos"][1])):
            out.append(f"link {ln[0]} runs right-to-left or upwards: node {src['id']} -> {dst['id']}")
    return out


def note_problems(wf: dict) -> list[str]:
    notes = [n for n in wf["nodes"] if n["type"] in NOTE_TYPES]
    if len(notes) != 1:
        return [f"{len(notes)} Note nodes (expected one saying what the workflow shows)"]
    text = " ".join(str(v) for v in notes[0].get("widgets_values") or [])
    ditkit = {n["type"] for n in wf["nodes"] if n["type"].startswith("DitKit")}
    schemas = (wf.get("extra") or {}).get("ditkit_schemas") or {}
    names = {c: (schemas.get(c) or {}).get("display_name") or c for c in ditkit}
    if not any(c in text or names[c] in text for c in ditkit):
        return [f"the Note names none of the workflow's ditkit nodes ({sorted(names.values())})"]
    if "Look at" not in text:
        return ["the Note does not say which node to look at ('Look at: ...')"]
    return []


def chain_problems(api: dict) -> list[str]:
    """Samplers fed another sampler's output at full denoise: an ordering hack, not a workflow."""
    out = []
    for k, n in api.items():
        if n["class_type"] not in SAMPLERS:
            continue
        lat = n["inputs"].get("latent_image")
        if isinstance(lat, list) and api.get(str(lat[0]), {}).get("class_type") in SAMPLERS \
                and float(n["inputs"].get("denoise", 1.0)) >= 1.0:
            out.append(f"sampler {k} starts from sampler {lat[0]}'s output at denoise 1.0")
    return out


def output_problems(api: dict) -> list[str]:
    """Every example ends in something to watch or hear (H3 / LTX: an MP4 or PNG; Z-Image / FLUX.2: a PNG), never
    in a saved latent."""
    classes = {n["class_type"] for n in api.values()}
    out = []
    if not classes & VISIBLE_OUTPUTS:
        out.append(f"an example without an output a person can see or hear (has {sorted(classes)})")
    if "SaveLatent" in classes:
        out.append("an example saves a latent")
    return out


@pytest.mark.parametrize("path", ui_workflows(), ids=lambda p: p.stem)
def test_example_is_laid_out_for_reading(path):
    wf = json.loads(path.read_text(encoding="utf-8"))
    problems = layout_problems(wf, _badge_height()) + note_problems(wf)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", ui_workflows(), ids=lambda p: p.stem)
def test_example_has_no_ordering_hack_and_visible_output(path):
    api = json.loads((path.parent / "api" / path.name).read_text(encoding="utf-8"))
    problems = chain_problems(api) + output_problems(api)
    assert not problems, "\n".join(problems)


def test_no_smoke_or_test_graphs_among_the_examples():
    names = [p.stem for p in ui_workflows()]
    assert names and not [n for n in names if n.startswith(("smoke", "test"))], names
    layouts = {p.stem for p in (EXAMPLES / "layout").glob("*.json")}
    assert layouts == set(names), ("every example has a layout sidecar", sorted(set(names) ^ layouts))


def test_the_geometry_check_sees_overlap_and_backward_links():
    """The checks above can fail: two nodes whose badge rows would cover each other's title bar, a link drawn
    right to left, a Note that names nothing, a chained sampler, a latent-only H3 graph."""
    a = {"id": 1, "type": "A", "pos": [0, 100], "size": [300, 100]}
    b = {"id": 2, "type": "B", "pos": [0, 230], "size": [300, 100]}   # body gap 30 < title + badges
    g = {"title": "g", "bounding": [-10, 0, 400, 400], "font_size": 24}
    assert any("overlap" in p for p in layout_problems({"nodes": [a, b], "groups": [g], "links": []}, 20))
    b["pos"] = [0, 260]
    assert layout_problems({"nodes": [a, b], "groups": [g], "links": []}, 20) == []
    assert any("right-to-left" in p for p in layout_problems(
        {"nodes": [a, b], "groups": [g], "links": [[1, 2, 0, 1, 0, "X"]]}, 20))
    assert note_problems({"nodes": [{"id": 3, "type": "MarkdownNote", "widgets_values": ["hello"]},
                                    {"id": 4, "type": "DitKitFoo"}]})
    api = {"1": {"class_type": "KSampler", "inputs": {"latent_image": ["2", 0], "denoise": 1.0}},
           "2": {"class_type": "KSampler", "inputs": {}}}
    assert chain_problems(api)
    assert output_problems({"1": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {}},
                            "2": {"class_type": "SaveLatent", "inputs": {}}})


@pytest.mark.parametrize("path", ui_workflows(), ids=lambda p: p.stem)
def test_example_has_a_template_preview_image(path):
    """ComfyUI's template browser (frontend 1.49.6) shows ``<name>.jpg`` next to a custom node's example as its
    preview (``/api/workflow_templates/<pack>/<name>.jpg``); written by the browser test with
    DITKIT_WRITE_THUMBNAILS=1."""
    jpg = path.with_suffix(".jpg")
    assert jpg.is_file(), f"{jpg.name} missing"
    raw = jpg.read_bytes()
    assert raw[:3] == b"\xff\xd8\xff" and 5_000 < len(raw) < 300_000, (jpg.name, len(raw))


@pytest.mark.parametrize("path", ui_workflows(), ids=lambda p: p.stem)
def test_example_carries_its_title_and_description(path):
    meta = (json.loads(path.read_text(encoding="utf-8")).get("extra") or {}).get("ditkit_template") or {}
    assert meta.get("title") and meta.get("description") and meta.get("look_at", "").startswith("DitKit"), meta
