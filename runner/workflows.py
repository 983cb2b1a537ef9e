"""ComfyUI workflow formats: API <-> UI (litegraph) conversion and the example-workflow twins.

ditkit keeps every example workflow in API format (``example_workflows/api/<name>.json``: what the
integration tests queue on /prompt) and ships a UI-format twin (``example_workflows/<name>.json``: what
ComfyUI's template browser opens). Mapping between the two needs each node's input order and which inputs are
widgets, i.e. the server's ``/object_info``. Each twin carries a compact copy of the schemas of the node
classes it uses (``extra.ditkit_schemas``; the frontend keeps and ignores it), so a twin can be checked and
regenerated without a server (CI) and adding a workflow touches no shared file; an integration test checks the
embedded schemas against a live server.

CLI::

    python -m ditkit.workflows sync [--check] [--comfyui PATH | --server URL]
    python -m ditkit.workflows to-ui API.json [-o UI.json] [--comfyui PATH | --server URL]
    python -m ditkit.workflows to-api UI.json [-o API.json] [--comfyui PATH | --server URL]

``sync`` rewrites every twin from its API source (``--check``: only report, exit 1 when a twin is stale,
missing or orphaned). Schemas come from ``--comfyui``/``--server`` (``/object_info``; use this after adding a
workflow or changing a node's inputs) or else from the schemas embedded in the twins.

Plain Python (no ComfyUI, no torch imports).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import uuid
from pathlib import Path
from typing import Any

from ..errors import WorkflowError
from .client import ComfyClient
from .server import ComfyServer

PACK_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = PACK_ROOT / "example_workflows"
EMBED_KEY = "ditkit_schemas"

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
VIRTUAL_NODES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
MODE_ALWAYS, MODE_NEVER, MODE_BYPASS = 0, 2, 4
COLUMN_WIDTH, NODE_WIDTH, ROW_GAP = 400, 340, 40


# ------------------------------------------------------------------------------------------ schemas

def compact_schema(info: dict) -> dict:
    """The parts of one ``/object_info`` entry that the format conversion needs (stable, small)."""
    if "inputs" in info and "outputs" in info:  # already compact
        return info
    inputs = []
    order = info.get("input_order") or {}
    spec = info.get("input") or {}
    for group in ("required", "optional"):
        names = order.get(group) or list((spec.get(group) or {}).keys())
        for name in names:
            s = (spec.get(group) or {}).get(name)
            if s is None:
                continue
            typ, opts = (s[0], s[1] if len(s) > 1 and isinstance(s[1], dict) else {}) if isinstance(s, list) \
                else (s, {})
            if isinstance(typ, list):
                typ = "COMBO"
            widget = isinstance(typ, str) and typ in WIDGET_TYPES and not opts.get("forceInput")
            ent: dict[str, Any] = {"name": name, "type": typ if isinstance(typ, str) else str(typ),
                                   "widget": bool(widget), "required": group == "required"}
            if widget:
                if "default" in opts:  # (no default from a COMBO's options: file lists differ between hosts)
                    ent["default"] = opts["default"]
                if opts.get("control_after_generate"):
                    ent["control_after_generate"] = True
                if opts.get("image_upload"):
                    ent["upload"] = "image"
            inputs.append(ent)
    outs = info.get("output") or []
    names = info.get("output_name") or outs
    return {"display_name": info.get("display_name") or info.get("name"),
            "inputs": inputs,
            "outputs": [{"name": n, "type": t if isinstance(t, str) else "COMBO"} for n, t in zip(names, outs)]}


def schemas_from(object_info: dict) -> dict[str, dict]:
    return {k: compact_schema(v) for k, v in object_info.items() if isinstance(v, dict)}


def embedded_schemas(ui: dict) -> dict[str, dict]:
    """The node schemas a twin carries (``extra.ditkit_schemas``), or {}."""
    emb = ((ui or {}).get("extra") or {}).get(EMBED_KEY)
    return dict(emb) if isinstance(emb, dict) else {}


def known_schemas(examples_dir: Path | None = None) -> dict[str, dict]:
    """Union of the schemas embedded in every twin (the offline schema source). When two twins disagree on a
    class (one is stale), that class is left out so a conversion asks for a server instead of guessing."""
    examples_dir = EXAMPLES_DIR if examples_dir is None else examples_dir
    seen: dict[str, dict] = {}
    conflict: set[str] = set()
    for twin in sorted(Path(examples_dir).glob("*.json")):
        try:
            emb = embedded_schemas(json.loads(twin.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue
        for cls, sch in emb.items():
            if cls in seen and seen[cls] != sch:
                conflict.add(cls)
            seen.setdefault(cls, sch)
    return {k: v for k, v in seen.items() if k not in conflict}


def _schema(schemas: dict, class_type: str, where: str) -> dict:
    s = schemas.get(class_type)
    if s is None:
        raise WorkflowError(f"{where}: node class {class_type!r} is unknown (not installed on the server, or "
                            f"no example twin embeds its schema yet: run `python -m ditkit.workflows sync "
                            f"--comfyui PATH`)")
    return compact_schema(s)


# -------------------------------------------------------------------------------------- API -> UI

def _is_link(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], (str, int)) and isinstance(v[1], int) \
        and not isinstance(v[1], bool)


def _node_ids(graph: dict) -> dict[str, int]:
    keys = list(graph)
    if all(isinstance(k, str) and k.isdigit() and int(k) > 0 for k in keys):
        return {k: int(k) for k in keys}
    return {k: i + 1 for i, k in enumerate(sorted(keys, key=str))}


def _depths(graph: dict) -> dict[str, int]:
    depth: dict[str, int] = {}

    def visit(k, stack=()):
        if k in depth:
            return depth[k]
        if k in stack:
            raise WorkflowError(f"API workflow has a cycle through node {k!r}")
        d = 0
        for v in (graph[k].get("inputs") or {}).values():
            if _is_link(v) and str(v[0]) in graph:
                d = max(d, visit(str(v[0]), stack + (k,)) + 1)
        depth[k] = d
        return d

    for k in graph:
        visit(k)
    return depth


def api_to_ui(graph: dict, object_info: dict, *, name: str | None = None, embed: bool = True,
              layout: dict | None = None) -> dict:
    """A UI-format (litegraph) workflow equivalent to the API-format ``graph``.

    ``widgets_values`` follow the node's input order in ``object_info`` (raw /object_info or compact
    schemas); nodes are laid out in a grid, one column per graph depth, or with ``layout`` (an
    ``example_workflows/layout/<name>.json`` sidecar, see :func:`apply_layout`) in titled groups per stage
    with a Note; with ``embed`` the compact schemas of the classes used are stored in
    ``extra.ditkit_schemas``. Deterministic for a given input."""
    if not isinstance(graph, dict) or not graph:
        raise WorkflowError("API workflow must be a non-empty JSON object of nodes")
    ids = _node_ids(graph)
    depth = _depths(graph)
    order = sorted(graph, key=lambda k: (depth[k], ids[k]))
    nodes_by_key: dict[str, dict] = {}
    links: list[list] = []
    col_y: dict[int, float] = {}
    for pos_index, key in enumerate(order):
        node = graph[key]
        ctype = node.get("class_type")
        where = f"API node {key!r}"
        if not isinstance(ctype, str):
            raise WorkflowError(f"{where}: no class_type")
        sch = _schema(object_info, ctype, where)
        given = dict(node.get("inputs") or {})
        known = {i["name"] for i in sch["inputs"]}
        unknown = sorted(set(given) - known)
        if unknown:
            raise WorkflowError(f"{where} ({ctype}): inputs {unknown} are not inputs of {ctype} "
                                f"(known: {sorted(known)})")
        ui_inputs, widgets = [], []
        for inp in sch["inputs"]:
            v = given.get(inp["name"], None)
            if inp["widget"]:
                if _is_link(v):
                    ui_inputs.append({"name": inp["name"], "type": inp["type"], "widget": {"name": inp["name"]},
                                      "link": None, "_src": v})
                    widgets.append(inp.get("default"))
                else:
                    widgets.append(v if inp["name"] in given else inp.get("default"))
                if inp.get("control_after_generate"):
                    widgets.append("fixed")
                if inp.get("upload"):
                    widgets.append(inp["upload"])
            else:
                if inp["name"] in given and not _is_link(v):
                    raise WorkflowError(f"{where} ({ctype}): input {inp['name']!r} takes a {inp['type']} link, "
                                        f"got the value {v!r}")
                ui_inputs.append({"name": inp["name"], "type": inp["type"], "link": None,
                                  **({"_src": v} if inp["name"] in given else {})})
        n_rows = len(ui_inputs) + len(widgets) + len(sch["outputs"])
        height = 46 + 24 * max(1, n_rows)
        col = depth[key]
        y = col_y.get(col, 100)
        col_y[col] = y + height + ROW_GAP
        ui = {"id": ids[key], "type": ctype, "pos": [100 + col * COLUMN_WIDTH, int(y)], "size": [NODE_WIDTH, height],
              "flags": {}, "order": pos_index, "mode": MODE_ALWAYS, "inputs": ui_inputs,
              "outputs": [{"name": o["name"], "type": o["type"], "links": [], "slot_index": i}
                          for i, o in enumerate(sch["outputs"])],
              "properties": {"Node name for S&R": ctype}, "widgets_values": widgets}
        title = (node.get("_meta") or {}).get("title")
        if title and title != sch.get("display_name"):
            ui["title"] = title
        nodes_by_key[key] = ui
    for key in order:  # wire links in a second pass (sources now exist)
        ui = nodes_by_key[key]
        for slot, inp in enumerate(ui["inputs"]):
            src = inp.pop("_src", None)
            if src is None:
                continue
            skey = str(src[0])
            if skey not in nodes_by_key:
                raise WorkflowError(f"API node {key!r}: input {inp['name']!r} links to missing node {skey!r}")
            souts = nodes_by_key[skey]["outputs"]
            if not 0 <= src[1] < len(souts):
                raise WorkflowError(f"API node {key!r}: input {inp['name']!r} links to output {src[1]} of node "
                                    f"{skey!r}, which has {len(souts)} outputs")
            link_id = len(links) + 1
            links.append([link_id, ids[skey], src[1], ui["id"], slot, souts[src[1]]["type"]])
            inp["link"] = link_id
            souts[src[1]]["links"].append(link_id)
    for ui in nodes_by_key.values():
        for o in ui["outputs"]:
            if not o["links"]:
                o["links"] = None
    seed = name or json.dumps(graph, sort_keys=True)
    extra: dict[str, Any] = {"ds": {"scale": 1.0, "offset": [0, 0]}}
    if embed:
        extra[EMBED_KEY] = {c: compact_schema(object_info[c]) for c in sorted({n["class_type"]
                                                                               for n in graph.values()})}
    groups: list[dict] = []
    if layout is not None:
        groups = apply_layout(nodes_by_key, layout, next_id=max(ids.values()) + 1)
        extra["ditkit_template"] = {k: layout[k] for k in ("title", "description", "look_at") if k in layout}
    return {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"ditkit/example_workflows/{seed}")), "revision": 0,
            "last_node_id": max(n["id"] for n in nodes_by_key.values()), "last_link_id": len(links),
            "nodes": sorted(nodes_by_key.values(), key=lambda n: n["id"]), "links": links, "groups": groups,
            "config": {}, "extra": extra, "version": 0.4}


# ------------------------------------------------------------------------------------------ layout

# Canvas geometry the frontend draws around a node (frontend 1.49.6): the title bar (LiteGraph.NODE_TITLE_HEIGHT)
# sits above ``pos``; the classic canvas draws ``node.badges`` in one row above the title bar
# (LGraphNode.drawBadges: bottom edge at -(NODE_TITLE_HEIGHT + 2), web/js/ditkit.js badges are 20 px high).
# A group's title bar is font_size * 1.4 high.
TITLE_HEIGHT, BADGE_GAP, BADGE_HEIGHT = 30, 2, 20
GROUP_FONT, GROUP_PAD = 24, 20
GROUP_TITLE = int(GROUP_FONT * 1.4)
STAGE_GAP, NODE_GAP, TOP = 110, 40, 100
NOTE_WIDTH = 420
NOTE_COLOR, NOTE_BG = "#432", "#653"
GROUP_COLORS = ["#3f789e", "#8A8", "#b58b2a", "#88A", "#a1309b", "#b06634"]


def node_extent(pos, size) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) a node occupies on the canvas: its body, title bar and the badge row above it."""
    return (pos[0], pos[1] - TITLE_HEIGHT - BADGE_GAP - BADGE_HEIGHT, pos[0] + size[0], pos[1] + size[1])


def _note_height(text: str) -> int:
    lines = sum(max(1, -(-len(par) // 48)) for par in text.split("\n"))
    return 40 + 20 * lines


def load_layout(api_path: Path) -> dict | None:
    """The layout sidecar of an API workflow (``<examples>/layout/<name>.json``), or None."""
    p = Path(api_path).parent.parent / "layout" / Path(api_path).name
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


def apply_layout(nodes_by_key: dict[str, dict], layout: dict, next_id: int) -> list[dict]:
    """Place the nodes stage by stage, left to right: each stage is a titled group (a column; a stage with
    ``"column": i`` stacks under the earlier stage in column i; with ``"row": r`` as well it starts below every
    group of the rows before, so the rows of a comparison line up), its nodes stacked in the listed order with
    room for the title bar and badge row between them. A Note (MarkdownNote) with ``layout["note"]`` goes in
    front. ``layout["sizes"]`` (``{node: [w, h]}``) widens nodes the frontend draws wider than the default (a
    measured size, e.g. a loader with a long combo). Every node must be in exactly one stage. Returns the groups."""
    stages = layout.get("stages") or []
    listed = [k for st in stages for k in st["nodes"]]
    missing = sorted(set(nodes_by_key) - set(listed), key=str)
    unknown = sorted(set(listed) - set(nodes_by_key), key=str)
    dup = sorted({k for k in listed if listed.count(k) > 1}, key=str)
    if missing or unknown or dup:
        raise WorkflowError(f"layout: nodes not in any stage {missing}, unknown nodes {unknown}, "
                            f"nodes in two stages {dup}")
    for k, size in (layout.get("sizes") or {}).items():     # nodes the frontend draws wider than the default
        if k not in nodes_by_key or len(size) != 2:
            raise WorkflowError(f"layout: size for unknown node {k!r} or not [width, height]: {size!r}")
        nodes_by_key[k]["size"] = [max(int(size[0]), nodes_by_key[k]["size"][0]),
                                   max(int(size[1]), nodes_by_key[k]["size"][1])]
    head = TITLE_HEIGHT + BADGE_GAP + BADGE_HEIGHT           # what a node needs above its pos
    x = 100
    note_text = layout.get("note")
    if note_text:
        nodes_by_key[f"note:{next_id}"] = {
            "id": next_id, "type": "MarkdownNote", "pos": [x, TOP + GROUP_TITLE + GROUP_PAD + head],
            "size": [NOTE_WIDTH, _note_height(note_text)], "flags": {}, "order": len(nodes_by_key),
            "mode": MODE_ALWAYS, "inputs": [], "outputs": [], "properties": {}, "widgets_values": [note_text],
            "color": NOTE_COLOR, "bgcolor": NOTE_BG, "title": "About this workflow"}
        x += NOTE_WIDTH + STAGE_GAP
    columns: list[dict] = []        # per column: left x, width, bottom of its lowest group
    row_bottom: dict[int, float] = {}
    groups = []
    for si, st in enumerate(stages):
        col = len(columns) if st.get("column") is None else int(st["column"])
        if col > len(columns):
            raise WorkflowError(f"layout: stage {st.get('title')!r} names column {col}; "
                                f"only {len(columns)} columns so far")
        width = max(nodes_by_key[k]["size"][0] for k in st["nodes"])
        if col == len(columns):
            left = x if not columns else columns[-1]["x"] + columns[-1]["width"] + 2 * GROUP_PAD + STAGE_GAP
            columns.append({"x": left, "width": width, "bottom": TOP - NODE_GAP})
        c = columns[col]
        c["width"] = max(c["width"], width)
        row = int(st.get("row", 0))
        top = max([c["bottom"]] + [b for r, b in row_bottom.items() if r < row]) + NODE_GAP
        y = top + GROUP_TITLE + GROUP_PAD + head
        for k in st["nodes"]:
            n = nodes_by_key[k]
            n["pos"] = [c["x"], y]
            y += n["size"][1] + NODE_GAP + head
        bottom = y - NODE_GAP - head + GROUP_PAD
        groups.append({"id": si + 1, "title": st["title"],
                       "bounding": [c["x"] - GROUP_PAD, top, width + 2 * GROUP_PAD, bottom - top],
                       "color": st.get("color", GROUP_COLORS[si % len(GROUP_COLORS)]), "font_size": GROUP_FONT,
                       "flags": {}})
        c["bottom"] = bottom
        row_bottom[row] = max(row_bottom.get(row, bottom), bottom)
    return groups


# -------------------------------------------------------------------------------------- UI -> API

def _show(v: Any) -> str:
    """A short description of a bad value (type, and the value itself only when it is small)."""
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    r = repr(v)
    return f"{type(v).__name__} {r}" if len(r) <= 40 else f"a {type(v).__name__} ({len(r)} characters)"


_INT_TEXT = re.compile(r"-?[0-9]{1,18}")


def _ui_int(v: Any, what: str, minimum: int | None = None, node_id: bool = False) -> int:
    """A litegraph integer (link id, slot, mode), or a node id: an integer or its decimal string (the frontend's
    schema allows string node ids). Floats, booleans, null, other strings are refused with the place named."""
    if node_id and isinstance(v, str) and _INT_TEXT.fullmatch(v):
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise WorkflowError(f"UI workflow: {what} is {_show(v)}; expected an integer")
    if minimum is not None and v < minimum:
        raise WorkflowError(f"UI workflow: {what} is {v}; expected an integer >= {minimum}")
    return v


def check_ui_workflow(wf: Any) -> tuple[dict[int, dict], dict[int, tuple]]:
    """Check the structure of a UI-format workflow without any node schema (so a runner can refuse a broken
    file before it starts a server): a ``nodes`` list of objects with integer ids (unique) and a string
    ``type``; ``inputs``/``outputs`` lists of objects whose ``link`` is null or an integer; ``links`` as
    ``[id, origin, origin_slot, target, target_slot, type?]`` lists or objects, integer ids (unique) and slots
    >= 0; every link a node input uses starts at a node that exists. Returns ``(nodes by id, links by id)``
    with links as ``(origin, origin_slot, target, target_slot, type)``; raises :class:`WorkflowError` naming
    the node or link."""
    if not isinstance(wf, dict) or not isinstance(wf.get("nodes"), list):
        raise WorkflowError("UI workflow must be a JSON object with a 'nodes' list")
    defs = wf.get("definitions")
    if defs is not None and not isinstance(defs, dict):
        raise WorkflowError(f"UI workflow: 'definitions' is {_show(defs)}; expected an object")
    if (defs or {}).get("subgraphs"):
        raise WorkflowError("UI workflow uses subgraphs, which this converter does not support; export it "
                            "with 'Export (API)' from the ComfyUI menu instead")
    nodes: dict[int, dict] = {}
    for i, n in enumerate(wf["nodes"]):
        if not isinstance(n, dict):
            raise WorkflowError(f"UI workflow: nodes[{i}] is {_show(n)}; expected an object")
        nid = _ui_int(n.get("id"), f"nodes[{i}] 'id'", node_id=True)
        if nid in nodes:
            raise WorkflowError(f"UI workflow: nodes[{i}] repeats node id {nid}")
        where = f"node {nid} (nodes[{i}])"
        if not isinstance(n.get("type"), str):
            raise WorkflowError(f"UI workflow: {where} 'type' is {_show(n.get('type'))}; expected a node class name")
        if "mode" in n:
            _ui_int(n["mode"], f"{where} 'mode'")
        for key in ("inputs", "outputs"):
            items = n.get(key)
            if items is None:
                continue
            if not isinstance(items, list):
                raise WorkflowError(f"UI workflow: {where} '{key}' is {_show(items)}; expected a list")
            for j, it in enumerate(items):
                if not isinstance(it, dict):
                    raise WorkflowError(f"UI workflow: {where} {key}[{j}] is {_show(it)}; expected an object")
                if "name" in it and not isinstance(it["name"], str):
                    raise WorkflowError(f"UI workflow: {where} {key}[{j}] 'name' is {_show(it['name'])}; "
                                        "expected a string")
                if key == "inputs" and it.get("link") is not None:
                    _ui_int(it["link"], f"{where} inputs[{j}] 'link'")
        wv = n.get("widgets_values")
        if wv is not None and not isinstance(wv, (list, dict)):
            raise WorkflowError(f"UI workflow: {where} 'widgets_values' is {_show(wv)}; expected a list or object")
        nodes[nid] = n
    raw_links = wf.get("links")
    if raw_links is None:
        raw_links = []
    if not isinstance(raw_links, list):
        raise WorkflowError(f"UI workflow: 'links' is {_show(raw_links)}; expected a list")
    links: dict[int, tuple] = {}
    for i, ln in enumerate(raw_links):
        what = f"links[{i}]"
        if isinstance(ln, dict):
            missing = [k for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot") if k not in ln]
            if missing:
                raise WorkflowError(f"UI workflow: {what} has no {missing[0]!r}")
            raw = (ln["id"], ln["origin_id"], ln["origin_slot"], ln["target_id"], ln["target_slot"], ln.get("type"))
        elif isinstance(ln, list) and len(ln) >= 5:
            raw = tuple(ln[:6]) if len(ln) >= 6 else tuple(ln[:5]) + (None,)
        else:
            raise WorkflowError(f"UI workflow: {what} is {_show(ln)}; expected [id, origin, origin_slot, target, "
                                "target_slot, type] or an object with those keys")
        lid = _ui_int(raw[0], f"{what} id")
        if lid in links:
            raise WorkflowError(f"UI workflow: {what} repeats link id {lid}")
        links[lid] = (_ui_int(raw[1], f"link {lid} origin node", node_id=True),
                      _ui_int(raw[2], f"link {lid} origin slot", 0),
                      _ui_int(raw[3], f"link {lid} target node", node_id=True),
                      _ui_int(raw[4], f"link {lid} target slot", 0), raw[5])
    for nid, n in nodes.items():
        for inp in n.get("inputs") or []:
            lid = inp.get("link")
            if lid is not None and lid in links and links[lid][0] not in nodes:
                raise WorkflowError(f"UI workflow: node {nid} input {str(inp.get('name'))[:60]!r} uses link {lid}, "
                                    f"which starts at missing node {links[lid][0]}")
    return nodes, links


def ui_to_api(wf: dict, object_info: dict) -> dict:
    """The API-format graph of a UI-format workflow (muted nodes dropped, bypassed nodes routed through,
    Reroute followed, PrimitiveNode values inlined, Notes ignored)."""
    nodes, links = check_ui_workflow(wf)

    def resolve(link_id, seen=()):
        """``[node_key, slot]`` or ``("value", v)`` or None for a link, following virtual/bypassed nodes."""
        if link_id is None or link_id not in links:
            return None
        if link_id in seen:
            raise WorkflowError(f"UI workflow: link cycle through link {link_id}")
        oid, oslot, _tid, _tslot, ltype = links[link_id]
        src = nodes.get(oid)
        if src is None:
            raise WorkflowError(f"UI workflow: link {link_id} starts at missing node {oid}")
        stype, mode = src.get("type"), src.get("mode", MODE_ALWAYS)
        if stype == "Reroute":
            ins = src.get("inputs") or []
            return resolve(ins[0].get("link") if ins else None, seen + (link_id,))
        if stype == "PrimitiveNode":
            vals = src.get("widgets_values") or []
            return ("value", vals[0]) if isinstance(vals, list) and vals else None
        if mode == MODE_NEVER:
            return None
        if mode == MODE_BYPASS:
            outs = src.get("outputs") or []
            otype = (outs[oslot].get("type") if oslot < len(outs) else None) or ltype
            for inp in src.get("inputs") or []:
                if inp.get("link") is not None and inp.get("type") == otype:
                    return resolve(inp["link"], seen + (link_id,))
            return None
        return [str(oid), int(oslot)]

    graph: dict[str, dict] = {}
    for nid, n in sorted(nodes.items()):
        ctype = n.get("type")
        if ctype in VIRTUAL_NODES or n.get("mode", MODE_ALWAYS) in (MODE_NEVER, MODE_BYPASS):
            continue
        where = f"UI node {nid}"
        sch = _schema(object_info, ctype, where)
        linked = {i.get("name"): i.get("link") for i in n.get("inputs") or [] if isinstance(i, dict)}
        wv = n.get("widgets_values")
        inputs: dict[str, Any] = {}
        if isinstance(wv, dict):
            values = None
        else:
            values = list(wv or [])
        pos = 0
        for inp in sch["inputs"]:
            name = inp["name"]
            if inp["widget"]:
                if values is None:
                    val, have = (wv.get(name), name in wv)
                else:
                    have = pos < len(values)
                    val = values[pos] if have else None
                    pos += 1
                    if pos < len(values) and (inp.get("control_after_generate") or inp["type"] == "INT") \
                            and isinstance(values[pos], str) and values[pos] in CONTROL_VALUES:
                        pos += 1
                    if inp.get("upload") and pos < len(values) and values[pos] == inp["upload"]:
                        pos += 1
                src = resolve(linked.get(name))
                if src is not None:
                    inputs[name] = src[1] if isinstance(src, tuple) else src
                elif have:
                    inputs[name] = val
                elif inp["required"]:
                    raise WorkflowError(f"{where} ({ctype}): no value for widget {name!r} "
                                        f"(widgets_values has {len(values if values is not None else wv or [])} entries)")
            else:
                src = resolve(linked.get(name))
                if src is not None:
                    inputs[name] = src[1] if isinstance(src, tuple) else src
        api_node: dict[str, Any] = {"class_type": ctype, "inputs": inputs}
        if n.get("title"):
            api_node["_meta"] = {"title": n["title"]}
        graph[str(nid)] = api_node
    return graph


def strip_meta(graph: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v.get("inputs") or {}} for k, v in graph.items()}


def as_ui_would_send(graph: dict, object_info: dict) -> dict:
    """``graph`` without ``_meta`` and with every omitted widget that has a default filled in: what a UI
    round trip yields (a UI widget always holds a value, so the frontend always sends it)."""
    out = strip_meta(graph)
    for k, node in out.items():
        sch = _schema(object_info, node["class_type"], f"API node {k!r}")
        inputs = dict(node["inputs"])
        for inp in sch["inputs"]:
            if inp["widget"] and inp["name"] not in inputs and "default" in inp:
                inputs[inp["name"]] = inp["default"]
        node["inputs"] = inputs
    return out


# ----------------------------------------------------------------------------------------- twins

def api_workflows(examples_dir: Path = EXAMPLES_DIR) -> list[Path]:
    return sorted(p for p in (examples_dir / "api").glob("*.json") if not p.name.startswith("_"))


def twin_path(api_path: Path) -> Path:
    return api_path.parent.parent / api_path.name


def twin_of(api_path: Path, object_info: dict, graph: dict | None = None) -> dict:
    """The UI twin of an API workflow file: :func:`api_to_ui` with its layout sidecar, if any."""
    api_path = Path(api_path)
    if graph is None:
        graph = json.loads(api_path.read_text(encoding="utf-8"))
    return api_to_ui(graph, object_info, name=api_path.stem, layout=load_layout(api_path))


def used_classes(paths) -> set[str]:
    out = set()
    for p in paths:
        for n in json.loads(Path(p).read_text(encoding="utf-8")).values():
            if isinstance(n, dict) and isinstance(n.get("class_type"), str):
                out.add(n["class_type"])
    return out


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def sync(examples_dir: Path = EXAMPLES_DIR, object_info: dict | None = None, check: bool = False,
         out=None) -> list[str]:
    """Regenerate (or with ``check`` only compare) every UI twin. Returns the list of problems/changes.

    Schemas: ``object_info`` (a live server) when given; else each twin's embedded schemas, completed by the
    union of all twins' (for a new workflow or a newly used class)."""
    problems = []
    sources = api_workflows(examples_dir)
    union = known_schemas(examples_dir) if object_info is None else {}
    for api in sources:
        twin = twin_path(api)
        old = twin.read_text(encoding="utf-8") if twin.is_file() else None
        try:
            graph = json.loads(api.read_text(encoding="utf-8"))
            if object_info is not None:
                schemas = object_info
            else:
                own = {}
                if old is not None:
                    with contextlib.suppress(json.JSONDecodeError):
                        own = embedded_schemas(json.loads(old))
                schemas = {**union, **own}
            text = dumps(twin_of(api, schemas, graph))
        except (WorkflowError, json.JSONDecodeError) as e:
            problems.append(f"{api}: cannot convert: {e}")
            continue
        if old == text:
            continue
        what = "missing" if old is None else "stale"
        if check:
            problems.append(f"{twin}: {what} (regenerate with `python -m ditkit.workflows sync"
                            f"{'' if object_info is None else ' --comfyui PATH'}`)")
        else:
            twin.write_text(text, encoding="utf-8")
            problems.append(f"{twin}: written ({what})")
    names = {p.stem for p in sources}
    for twin in sorted(examples_dir.glob("*.json")):
        if twin.stem not in names:
            problems.append(f"{twin}: orphan UI workflow with no example_workflows/api/{twin.name}")
    for line in problems:
        print(line, file=out if out is not None else sys.stdout)
    return problems


def _server_object_info(a) -> dict | None:
    if a.server:
        return ComfyClient(a.server).object_info()
    if a.comfyui:
        with ComfyServer(a.comfyui, python=a.python, generate_models=False, quiet=True) as srv:
            return srv.client.object_info()
    return None


def schema_drift(object_info: dict, examples_dir: Path = EXAMPLES_DIR) -> list[str]:
    """Twins whose embedded schemas differ from ``object_info`` (a live server): ``["<twin>: <classes>"]``."""
    out = []
    for api in api_workflows(examples_dir):
        twin = twin_path(api)
        if not twin.is_file():
            continue
        emb = embedded_schemas(json.loads(twin.read_text(encoding="utf-8")))
        bad = sorted(c for c, sch in emb.items() if c not in object_info or compact_schema(object_info[c]) != sch)
        if bad:
            out.append(f"{twin.name}: {bad}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ditkit.workflows", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, hlp in (("sync", "regenerate/check every example_workflows/<name>.json twin"),
                      ("to-ui", "convert an API-format workflow to UI format"),
                      ("to-api", "convert a UI-format workflow to API format")):
        p = sub.add_parser(name, help=hlp)
        if name == "sync":
            p.add_argument("--check", action="store_true", help="only check; exit 1 when anything is out of date")
            p.add_argument("--dir", default=str(EXAMPLES_DIR), help="example_workflows dir (default: the pack's)")
        else:
            p.add_argument("input")
            p.add_argument("-o", "--output", help="output file (default: stdout)")
        g = p.add_mutually_exclusive_group()
        g.add_argument("--comfyui", help="start this ComfyUI to read /object_info (default: schemas embedded in "
                                         "the example twins)")
        g.add_argument("--server", help="read /object_info from this running server")
        p.add_argument("--python", help="python for --comfyui (default: its venv)")
    a = ap.parse_args(argv)
    try:
        info = _server_object_info(a)
        if a.cmd == "sync":
            ex = Path(a.dir)
            msgs = sync(ex, object_info=info, check=a.check)
            if a.check:
                if msgs:
                    return 1
                print(f"ok: {len(api_workflows(ex))} example workflows and their UI twins are in sync")
            return 0
        src = json.loads(Path(a.input).read_text(encoding="utf-8"))
        schemas = info if info is not None else known_schemas()
        out = api_to_ui(src, schemas, name=Path(a.input).stem) if a.cmd == "to-ui" else ui_to_api(src, schemas)
        if a.output:
            Path(a.output).write_text(dumps(out), encoding="utf-8")
        else:
            sys.stdout.write(dumps(out))
        return 0
    except WorkflowError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2

