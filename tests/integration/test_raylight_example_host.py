"""The Raylight example workflow (``example_workflows/raylight/``, UI twin + API source) against the node schemas.

It cannot run here (Raylight's actors need CUDA + NCCL), so it is validated instead:

* always (default CI, no network, no Raylight): the twin is in sync with its API source; ditkit's Ray nodes'
  embedded schemas equal the live classes'; the embedded schemas of the host's and ditkit's other nodes equal what
  the main examples embed (which ``test_host_workflows`` checks against the live server); every input of every node
  is known, every required one given, every link joins an output of the input's type, and ditkit's widget values
  are valid for the live node (options, ranges);
* with a Raylight checkout (``DITKIT_RAYLIGHT_SRC`` = its root, ``DITKIT_RAYLIGHT_DEPS`` = a folder holding
  ``yunchang``): Raylight's real node classes are loaded in this 0.33 host on CPU (``tests/support/raylight_host.py``:
  only ``ray`` and Raylight's Ray-actor module stood in for) and the twin's embedded Raylight schemas must equal
  theirs, the Raylight nodes' widget values must be valid for their real ``INPUT_TYPES`` (e.g. ``XFuser_attention``
  among yunchang's ``AttnType`` members) and the twin must regenerate identically from the live schemas.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from ditkit import workflows as wfm
from tests.support import raylight_host as rh

RAY_DIR = wfm.EXAMPLES_DIR / "raylight"
API = RAY_DIR / "api" / "h3_raylight_tiny.json"
RAYLIGHT_CLASSES = {"RayInitializer", "RayUNETLoader", "XFuserKSamplerAdvanced"}
DITKIT_RAY = {"DitKitRaySparseAttention", "DitKitRayAdaLNCache", "DitKitRayTeaCache"}


def _graph():
    return json.loads(API.read_text(encoding="utf-8"))


def _embedded():
    return wfm.embedded_schemas(json.loads(wfm.twin_path(API).read_text(encoding="utf-8")))


def graph_problems(graph: dict, schemas: dict) -> list[str]:
    """Inputs known and required ones given, links joining outputs of the input's type (compact schemas)."""
    out = []
    for nid, node in graph.items():
        sch = wfm.compact_schema(schemas[node["class_type"]])
        spec = {i["name"]: i for i in sch["inputs"]}
        out += [f"#{nid} {node['class_type']}: unknown input {k}" for k in node["inputs"] if k not in spec]
        out += [f"#{nid} {node['class_type']}: required input {k} missing" for k, i in spec.items()
                if i["required"] and k not in node["inputs"]]
        for k, v in node["inputs"].items():
            if isinstance(v, list) and k in spec:
                src = graph[v[0]]
                typ = wfm.compact_schema(schemas[src["class_type"]])["outputs"][v[1]]["type"]
                if typ != spec[k]["type"] and "*" not in (typ, spec[k]["type"]):
                    out.append(f"#{nid}.{k} takes {spec[k]['type']}, linked to #{v[0]} output {v[1]} ({typ})")
    return out


def widget_problems(graph: dict, info: dict, classes) -> list[str]:
    """The widget values of the nodes of ``classes`` against their full ``/object_info`` entries."""
    out = []
    for nid, node in graph.items():
        if node["class_type"] not in classes:
            continue
        spec = {**info[node["class_type"]]["input"].get("required", {}),
                **info[node["class_type"]]["input"].get("optional", {})}
        for k, v in node["inputs"].items():
            if isinstance(v, list):
                continue
            typ, opts = spec[k][0], (spec[k][1] if len(spec[k]) > 1 else {})
            options = typ if isinstance(typ, list) else opts.get("options") if typ == "COMBO" else None
            if options is not None and v not in options:
                out.append(f"#{nid}.{k}: {v!r} not among {options}")
            if typ in ("INT", "FLOAT") and not (opts.get("min", -float("inf")) <= v <= opts.get("max", float("inf"))):
                out.append(f"#{nid}.{k}: {v} outside [{opts.get('min')}, {opts.get('max')}]")
            if typ == "BOOLEAN" and not isinstance(v, bool):
                out.append(f"#{nid}.{k}: {v!r} is not a boolean")
    return out


def _ditkit_ray_info():
    from ditkit.nodes import raylight as ray_nodes

    return {c.GET_SCHEMA().node_id: json.loads(json.dumps(c.GET_NODE_INFO_V1(), default=str))
            for c in (ray_nodes.DitKitRaySparseAttention, ray_nodes.DitKitRayAdaLNCache, ray_nodes.DitKitRayTeaCache)}


def test_raylight_example_twin_is_in_sync_with_its_api_source():
    assert wfm.sync(RAY_DIR, check=True) == []
    assert {n["class_type"] for n in _graph().values()} >= RAYLIGHT_CLASSES | DITKIT_RAY


def test_raylight_example_against_the_embedded_and_live_schemas(comfy):
    emb, graph = _embedded(), _graph()
    live = _ditkit_ray_info()
    for c in DITKIT_RAY:
        assert emb[c] == wfm.compact_schema(live[c]), f"{c}: the twin embeds an outdated schema"
    main = wfm.known_schemas()
    for c in set(emb) - RAYLIGHT_CLASSES - DITKIT_RAY:
        assert emb[c] == main[c], c
    assert graph_problems(graph, emb) == []
    assert widget_problems(graph, live, DITKIT_RAY) == []


def test_the_validation_can_fail(comfy):
    emb, graph = _embedded(), _graph()
    bad = json.loads(json.dumps(graph))
    bad["9"]["inputs"]["ray_actors"] = ["1", 0]            # RAY_ACTORS_INIT where RAY_ACTORS is taken
    del bad["2"]["inputs"]["weight_dtype"]
    bad["5"]["inputs"]["cache_device"] = "gpu0"
    bad["3"]["inputs"]["keep_percent"] = 0.1
    probs = graph_problems(bad, emb) + widget_problems(bad, _ditkit_ray_info(), DITKIT_RAY)
    assert any("#9.ray_actors takes RAY_ACTORS, linked to #1 output 0 (RAY_ACTORS_INIT)" in p for p in probs)
    assert any("required input weight_dtype missing" in p for p in probs)
    assert any("#5.cache_device: 'gpu0'" in p for p in probs) and any("#3.keep_percent: 0.1 outside" in p for p in probs)


@pytest.mark.skipif(not os.environ.get("DITKIT_RAYLIGHT_SRC"),
                    reason="set DITKIT_RAYLIGHT_SRC to a Raylight checkout (and DITKIT_RAYLIGHT_DEPS to a folder with "
                           "yunchang) to check against Raylight's real node classes")
def test_raylight_example_against_raylights_real_node_classes(comfy):
    src, deps = os.environ["DITKIT_RAYLIGHT_SRC"], os.environ.get("DITKIT_RAYLIGHT_DEPS")
    before_mods, before_path = set(sys.modules), list(sys.path)
    try:
        _check_real(src, deps)
    finally:   # Raylight (and its stand-ins) leave this process: later tests see this host without Raylight
        for k in set(sys.modules) - before_mods:
            del sys.modules[k]
        sys.path[:] = before_path


def _check_real(src, deps):
    info = rh.object_info(rh.raylight_node_classes(src, deps))
    emb, graph = _embedded(), _graph()
    for c in RAYLIGHT_CLASSES:
        assert emb[c] == wfm.compact_schema(info[c]), f"{c}: the twin's schema differs from Raylight's"
    assert widget_problems(graph, info, RAYLIGHT_CLASSES - {"RayUNETLoader"}) == []   # (its file list is local)
    assert graph_problems(graph, {**emb, **info}) == []
    assert rh.sync_example(src, deps, check=True) == []


def test_raylight_example_is_laid_out_and_titled_like_the_main_examples():
    from tests.unit import test_example_layout as lay

    ui = json.loads(wfm.twin_path(API).read_text(encoding="utf-8"))
    assert lay.layout_problems(ui, lay._badge_height()) + lay.note_problems(ui) == []
    assert lay.chain_problems(_graph()) + lay.output_problems(_graph()) == []
    meta = (ui.get("extra") or {}).get("ditkit_template") or {}
    assert meta.get("title") and meta.get("description") and meta.get("look_at") == "DitKitRayTeaCache"
