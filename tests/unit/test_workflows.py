"""API <-> UI workflow conversion and the example-workflow twins (no server: hand-written schemas + the cache)."""
from __future__ import annotations

import json

import pytest

from ditkit.errors import WorkflowError
from ditkit.runner import workflows as wfm  # the module itself: tests below patch its known_schemas

# /object_info entries written by hand in ComfyUI's shapes (V1 list combos, V3 "COMBO", seed control, upload,
# optional inputs, forceInput), independent of the converter.
INFO = {
    "Src": {"input": {"required": {"w": ["INT", {"default": 8, "min": 1}],
                                   "mode": [["a", "b"], {"default": "b"}]}},
            "input_order": {"required": ["w", "mode"]}, "output": ["IMAGE", "MASK"], "output_name": ["IMAGE", "MASK"],
            "display_name": "Source"},
    "Sampler": {"input": {"required": {"model": ["MODEL", {}], "seed": ["INT", {"default": 0,
                                                                              "control_after_generate": True}],
                                       "name": ["COMBO", {"options": ["x", "y"]}], "img": ["IMAGE", {}]},
                          "optional": {"strength": ["FLOAT", {"default": 1.0}], "mask": ["MASK", {}],
                                       "forced": ["INT", {"forceInput": True}]},
                          "hidden": {"unique_id": "UNIQUE_ID"}},
                "input_order": {"required": ["model", "seed", "name", "img"],
                                "optional": ["strength", "mask", "forced"], "hidden": ["unique_id"]},
                "output": ["LATENT"], "output_name": ["LATENT"], "display_name": "Sampler"},
    "Loader": {"input": {"required": {"file": [["m.safetensors"], {}]}}, "input_order": {"required": ["file"]},
               "output": ["MODEL"], "output_name": ["MODEL"], "display_name": "Loader"},
    "LoadImage": {"input": {"required": {"image": [["example.png"], {"image_upload": True}]}},
                  "input_order": {"required": ["image"]}, "output": ["IMAGE", "MASK"],
                  "output_name": ["IMAGE", "MASK"], "display_name": "Load Image"},
    "Sink": {"input": {"required": {"samples": ["LATENT", {}], "prefix": ["STRING", {"default": "out"}]}},
             "input_order": {"required": ["samples", "prefix"]}, "output": [], "output_name": [],
             "display_name": "Sink"},
}

GRAPH = {
    "1": {"class_type": "Loader", "inputs": {"file": "m.safetensors"}},
    "2": {"class_type": "Src", "inputs": {"w": 16, "mode": "a"}},
    "3": {"class_type": "Sampler", "inputs": {"model": ["1", 0], "seed": 7, "name": "y", "img": ["2", 0],
                                              "mask": ["2", 1], "forced": ["2", 1]}},
    "4": {"class_type": "Sink", "inputs": {"samples": ["3", 0], "prefix": "p"}, "_meta": {"title": "My sink"}},
}


def test_api_to_ui_by_hand():
    ui = wfm.api_to_ui(GRAPH, INFO, name="t")
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert sorted(nodes) == [1, 2, 3, 4]
    assert nodes[2]["widgets_values"] == [16, "a"]
    # seed gets its control widget value, optional widget defaults are filled, in /object_info input order
    assert nodes[3]["widgets_values"] == [7, "fixed", "y", 1.0]
    assert nodes[4]["widgets_values"] == ["p"] and nodes[4]["title"] == "My sink"
    assert "title" not in nodes[1]
    assert [i["name"] for i in nodes[3]["inputs"]] == ["model", "img", "mask", "forced"]
    # links: [id, origin node, origin slot, target node, target slot, type], slots index the inputs list
    by_target = {(ln[3], ln[4]): ln for ln in ui["links"]}
    assert by_target[(3, 0)][1:3] == [1, 0] and by_target[(3, 0)][5] == "MODEL"
    assert by_target[(3, 1)][1:3] == [2, 0] and by_target[(3, 1)][5] == "IMAGE"
    assert by_target[(3, 2)][1:3] == [2, 1] and by_target[(3, 2)][5] == "MASK"
    assert by_target[(4, 0)][1:3] == [3, 0] and by_target[(4, 0)][5] == "LATENT"
    for ln in ui["links"]:
        assert nodes[ln[3]]["inputs"][ln[4]]["link"] == ln[0]
        assert ln[0] in nodes[ln[1]]["outputs"][ln[2]]["links"]
    assert nodes[2]["outputs"][1]["links"] and len(nodes[2]["outputs"][1]["links"]) == 2
    assert nodes[4]["outputs"] == []
    assert ui["last_node_id"] == 4 and ui["last_link_id"] == len(ui["links"]) == 5
    assert ui["version"] == 0.4


def test_grid_layout_by_depth_without_overlap():
    ui = wfm.api_to_ui(GRAPH, INFO, name="t")
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert nodes[1]["pos"][0] == nodes[2]["pos"][0] < nodes[3]["pos"][0] < nodes[4]["pos"][0]
    boxes = [(n["pos"][0], n["pos"][1], n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1]) for n in ui["nodes"]]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)


def test_roundtrip_and_determinism():
    ui = wfm.api_to_ui(GRAPH, INFO, name="t")
    assert wfm.api_to_ui(GRAPH, INFO, name="t") == ui
    back = wfm.ui_to_api(ui, INFO)
    expected = wfm.strip_meta(GRAPH)
    expected["3"]["inputs"]["strength"] = 1.0  # an omitted optional widget comes back with its default
    assert wfm.strip_meta(back) == expected == wfm.as_ui_would_send(GRAPH, INFO)
    assert back["4"]["_meta"] == {"title": "My sink"}
    # the compact schema cache gives the same result as raw /object_info
    assert wfm.api_to_ui(GRAPH, wfm.schemas_from(INFO), name="t") == ui


def test_non_numeric_ids_are_renumbered():
    g = {"load": {"class_type": "Loader", "inputs": {"file": "m.safetensors"}},
         "sample": {"class_type": "Sampler", "inputs": {"model": ["load", 0], "seed": 1, "name": "x",
                                                        "img": ["src", 0]}},
         "src": {"class_type": "Src", "inputs": {}}}
    ui = wfm.api_to_ui(g, INFO)
    assert sorted(n["id"] for n in ui["nodes"]) == [1, 2, 3]
    src = next(n for n in ui["nodes"] if n["type"] == "Src")
    assert src["widgets_values"] == [8, "b"]  # defaults
    back = wfm.ui_to_api(ui, INFO)
    assert {v["class_type"] for v in back.values()} == {"Loader", "Sampler", "Src"}


def test_image_upload_extra_widget_value():
    g = {"1": {"class_type": "LoadImage", "inputs": {"image": "cat.png"}},
         "2": {"class_type": "Sampler", "inputs": {"model": ["3", 0], "seed": 1, "name": "x", "img": ["1", 0]}},
         "3": {"class_type": "Loader", "inputs": {"file": "m.safetensors"}}}
    ui = wfm.api_to_ui(g, INFO)
    assert next(n for n in ui["nodes"] if n["id"] == 1)["widgets_values"] == ["cat.png", "image"]
    assert wfm.strip_meta(wfm.ui_to_api(ui, INFO)) == wfm.as_ui_would_send(g, INFO)


def test_linked_widget_input():
    g = {"1": {"class_type": "Src", "inputs": {"w": ["2", 0], "mode": "a"}},
         "2": {"class_type": "PrimitiveInt", "inputs": {"value": 5}}}
    info = dict(INFO, PrimitiveInt={"input": {"required": {"value": ["INT", {"default": 0}]}},
                                    "input_order": {"required": ["value"]}, "output": ["INT"], "output_name": ["INT"]})
    ui = wfm.api_to_ui(g, info)
    src = next(n for n in ui["nodes"] if n["id"] == 1)
    assert src["inputs"] == [{"name": "w", "type": "INT", "widget": {"name": "w"}, "link": 1}]
    assert src["widgets_values"] == [8, "a"]
    assert wfm.strip_meta(wfm.ui_to_api(ui, info)) == g


def _ui(nodes, links):
    return {"nodes": nodes, "links": links, "version": 0.4}


def test_ui_to_api_virtual_muted_bypassed_nodes():
    nodes = [
        {"id": 1, "type": "Loader", "mode": 0, "inputs": [], "outputs": [{"name": "MODEL", "type": "MODEL",
                                                                         "links": [1]}], "widgets_values": ["m.safetensors"]},
        {"id": 2, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 1}],
         "outputs": [{"name": "", "type": "MODEL", "links": [2]}]},
        {"id": 3, "type": "PrimitiveNode", "mode": 0, "outputs": [{"name": "INT", "type": "INT", "links": [3],
                                                                  "widget": {"name": "seed"}}], "widgets_values": [99, "fixed"]},
        {"id": 4, "type": "Src", "mode": 0, "inputs": [], "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [4]},
                                                                     {"name": "MASK", "type": "MASK", "links": []}],
         "widgets_values": [4, "b"]},
        # bypassed: its IMAGE output is routed to its IMAGE input's source (node 4)
        {"id": 5, "type": "Passthrough", "mode": 4, "inputs": [{"name": "image", "type": "IMAGE", "link": 4}],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [5]}], "widgets_values": []},
        {"id": 6, "type": "Sampler", "mode": 0,
         "inputs": [{"name": "model", "type": "MODEL", "link": 2}, {"name": "img", "type": "IMAGE", "link": 5},
                    {"name": "seed", "type": "INT", "widget": {"name": "seed"}, "link": 3}],
         "outputs": [{"name": "LATENT", "type": "LATENT", "links": [6]}],
         "widgets_values": [0, "randomize", "x", 0.5]},
        {"id": 7, "type": "Sink", "mode": 0, "inputs": [{"name": "samples", "type": "LATENT", "link": 6}],
         "outputs": [], "widgets_values": ["q"]},
        {"id": 8, "type": "Sink", "mode": 2, "inputs": [{"name": "samples", "type": "LATENT", "link": None}],
         "outputs": [], "widgets_values": ["muted"]},
        {"id": 9, "type": "Note", "mode": 0, "widgets_values": ["hello"]},
    ]
    links = [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 6, 0, "MODEL"], [3, 3, 0, 6, 2, "INT"], [4, 4, 0, 5, 0, "IMAGE"],
             [5, 5, 0, 6, 1, "IMAGE"], [6, 6, 0, 7, 0, "LATENT"]]
    api = wfm.ui_to_api(_ui(nodes, links), INFO)
    assert api == {
        "1": {"class_type": "Loader", "inputs": {"file": "m.safetensors"}},
        "4": {"class_type": "Src", "inputs": {"w": 4, "mode": "b"}},
        "6": {"class_type": "Sampler", "inputs": {"model": ["1", 0], "seed": 99, "name": "x", "img": ["4", 0],
                                                  "strength": 0.5}},
        "7": {"class_type": "Sink", "inputs": {"samples": ["6", 0], "prefix": "q"}},
    }


def test_ui_to_api_dict_links_and_dict_widgets():
    nodes = [{"id": 1, "type": "Src", "widgets_values": {"w": 3, "mode": "a"},
              "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}]},
             {"id": 2, "type": "Sampler", "inputs": [{"name": "img", "type": "IMAGE", "link": 1}],
              "widgets_values": [5, "x"]}]
    links = [{"id": 1, "origin_id": 1, "origin_slot": 0, "target_id": 2, "target_slot": 0, "type": "IMAGE"}]
    api = wfm.ui_to_api(_ui(nodes, links), INFO)
    assert api["1"]["inputs"] == {"w": 3, "mode": "a"}
    assert api["2"]["inputs"] == {"seed": 5, "name": "x", "img": ["1", 0]}


@pytest.mark.parametrize("graph, needle", [
    ({"1": {"class_type": "Nope", "inputs": {}}}, "Nope"),
    ({"1": {"class_type": "Src", "inputs": {"bogus": 1}}}, "bogus"),
    ({"1": {"class_type": "Sink", "inputs": {"samples": ["9", 0]}}}, "missing node '9'"),
    ({"1": {"class_type": "Src", "inputs": {}}, "2": {"class_type": "Sink", "inputs": {"samples": ["1", 5]}}},
     "output 5"),
    ({"1": {"class_type": "Sink", "inputs": {"samples": "not a link"}}}, "takes a LATENT link"),
    ({"1": {"class_type": "Sampler", "inputs": {"img": ["2", 0]}},
      "2": {"class_type": "Sampler", "inputs": {"img": ["1", 0]}}}, "cycle"),
    ({}, "non-empty"),
])
def test_api_to_ui_errors(graph, needle):
    with pytest.raises(WorkflowError, match=needle):
        wfm.api_to_ui(graph, INFO)


def test_ui_to_api_errors():
    with pytest.raises(WorkflowError, match="Unknown|unknown"):
        wfm.ui_to_api(_ui([{"id": 1, "type": "NotInstalled", "widgets_values": []}], []), INFO)
    with pytest.raises(WorkflowError, match="subgraphs"):
        wfm.ui_to_api({"nodes": [], "links": [], "definitions": {"subgraphs": [{"id": "x"}]}}, INFO)
    with pytest.raises(WorkflowError, match="no value for widget 'file'"):
        wfm.ui_to_api(_ui([{"id": 1, "type": "Loader", "widgets_values": []}], []), INFO)
    with pytest.raises(WorkflowError, match="missing node 7"):
        wfm.ui_to_api(_ui([{"id": 1, "type": "Sink", "inputs": [{"name": "samples", "link": 1}],
                            "widgets_values": ["a"]}], [[1, 7, 0, 1, 0, "LATENT"]]), INFO)


# ------------------------------------------------------------------------------------- example twins

TEST_GRAPHS = wfm.PACK_ROOT / "tests" / "data" / "workflows"
API = wfm.api_workflows() + wfm.api_workflows(TEST_GRAPHS)


def test_example_twins_are_in_sync(capsys):
    """``example_workflows/<name>.json`` == conversion of ``example_workflows/api/<name>.json`` (with its layout
    sidecar) with the schemas the twin embeds (regenerate with ``python -m ditkit.workflows sync --comfyui PATH``);
    the same for the test graphs in tests/data/workflows (``sync --dir tests/data/workflows``)."""
    problems = wfm.sync(check=True) + wfm.sync(TEST_GRAPHS, check=True)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", API, ids=[p.stem for p in API])
def test_example_workflow_roundtrips(path):
    layout = wfm.load_layout(path)
    graph = json.loads(path.read_text(encoding="utf-8"))
    twin = wfm.twin_path(path)
    assert twin.is_file(), f"{twin} missing (python -m ditkit.workflows sync --comfyui PATH)"
    schemas = wfm.embedded_schemas(json.loads(twin.read_text(encoding="utf-8")))
    # the twin embeds exactly the schemas of the classes its API source uses
    assert set(schemas) == wfm.used_classes([path])
    back = wfm.ui_to_api(wfm.api_to_ui(graph, schemas, layout=layout), schemas)
    assert wfm.strip_meta(back) == wfm.as_ui_would_send(graph, schemas)
    titles = {k: (v.get("_meta") or {}).get("title") for k, v in graph.items()}
    assert all(back[k].get("_meta", {}).get("title") in (t, None) for k, t in titles.items())


def test_embedded_schemas_and_known_schemas(tmp_path):
    ui = wfm.api_to_ui(GRAPH, INFO, name="t")
    assert set(wfm.embedded_schemas(ui)) == {"Loader", "Src", "Sampler", "Sink"}
    assert wfm.embedded_schemas(ui)["Src"] == wfm.compact_schema(INFO["Src"])
    assert "ditkit_schemas" not in wfm.api_to_ui(GRAPH, INFO, embed=False)["extra"]
    (tmp_path / "a.json").write_text(json.dumps(ui))
    other = json.loads(json.dumps(ui))
    other["extra"]["ditkit_schemas"]["Src"]["inputs"][0]["default"] = 99  # a stale twin disagrees on Src
    (tmp_path / "b.json").write_text(json.dumps(other))
    known = wfm.known_schemas(tmp_path)
    assert set(known) == {"Loader", "Sampler", "Sink"}  # the conflicting class is left out, not guessed


def test_sync_cli_check_write_and_orphans(tmp_path, capsys, monkeypatch):
    ex = tmp_path / "example_workflows"
    (ex / "api").mkdir(parents=True)
    (ex / "api" / "one.json").write_text(json.dumps(GRAPH))
    assert wfm.main(["sync", "--check", "--dir", str(ex)]) == 1  # no twin, no schemas anywhere
    assert "cannot convert" in capsys.readouterr().out
    monkeypatch.setattr(wfm, "known_schemas", lambda examples_dir=None: wfm.schemas_from(INFO))
    assert wfm.main(["sync", "--check", "--dir", str(ex)]) == 1
    assert "one.json: missing" in capsys.readouterr().out
    assert wfm.main(["sync", "--dir", str(ex)]) == 0
    assert json.loads((ex / "one.json").read_text()) == wfm.api_to_ui(GRAPH, INFO, name="one")
    assert wfm.main(["sync", "--check", "--dir", str(ex)]) == 0
    (ex / "one.json").write_text((ex / "one.json").read_text().replace('"p"', '"changed"'))
    assert wfm.main(["sync", "--check", "--dir", str(ex)]) == 1
    assert "stale" in capsys.readouterr().out
    wfm.main(["sync", "--dir", str(ex)])
    (ex / "orphan.json").write_text("{}")
    assert wfm.main(["sync", "--check", "--dir", str(ex)]) == 1
    assert "orphan" in capsys.readouterr().out


def test_convert_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(wfm, "known_schemas", lambda examples_dir=None: wfm.schemas_from(INFO))
    (tmp_path / "g.json").write_text(json.dumps(GRAPH))
    assert wfm.main(["to-ui", str(tmp_path / "g.json"), "-o", str(tmp_path / "ui.json")]) == 0
    assert wfm.main(["to-api", str(tmp_path / "ui.json"), "-o", str(tmp_path / "api.json")]) == 0
    assert json.loads((tmp_path / "api.json").read_text()) == wfm.ui_to_api(
        json.loads((tmp_path / "ui.json").read_text()), INFO)
    (tmp_path / "bad.json").write_text(json.dumps({"1": {"class_type": "Nope", "inputs": {}}}))
    assert wfm.main(["to-ui", str(tmp_path / "bad.json")]) == 2


def test_sync_uses_live_schemas_and_detects_drift(tmp_path, capsys):
    ex = tmp_path / "example_workflows"
    (ex / "api").mkdir(parents=True)
    (ex / "api" / "one.json").write_text(json.dumps(GRAPH))
    assert wfm.sync(ex, object_info=INFO) == [f"{ex / 'one.json'}: written (missing)"]
    assert wfm.sync(ex, check=True) == []  # offline: the twin's embedded schemas reproduce it
    assert wfm.schema_drift(INFO, ex) == []
    changed = json.loads(json.dumps(INFO))
    changed["Src"]["input"]["required"]["w"][1]["default"] = 9
    assert wfm.schema_drift(changed, ex) == ["one.json: ['Src']"]
    changed["Sink"]["input"]["required"]["prefix"] = ["STRING", {"default": "out", "multiline": True}]
    assert wfm.schema_drift(changed, ex) == ["one.json: ['Src']"]  # options the converter ignores are not drift
    reordered = json.loads(json.dumps(INFO))
    reordered["Src"]["input_order"]["required"] = ["mode", "w"]
    assert wfm.sync(ex, object_info=reordered, check=True)  # widget order changed on the server: stale twin
    capsys.readouterr()


def test_python_m_ditkit_workflows_still_works(tmp_path):
    """``python -m ditkit.workflows`` is the thin entry point over runner/workflows.py."""
    import subprocess
    import sys

    (tmp_path / "g.json").write_text(json.dumps({"1": {"class_type": "Nope", "inputs": {}}}))
    r = subprocess.run([sys.executable, "-m", "ditkit.workflows", "to-ui", str(tmp_path / "g.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("ERROR: API node '1': node class 'Nope' is unknown"), r.stderr
    r = subprocess.run([sys.executable, "-m", "ditkit.workflows", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "sync" in r.stdout and "to-api" in r.stdout


def test_layout_sidecar_groups_stages_and_adds_a_note():
    layout = {"title": "T", "description": "D", "look_at": "Sampler", "note": "## hello\n\nLook at: Sampler",
              "stages": [{"title": "load", "nodes": ["1", "2"]}, {"title": "A", "nodes": ["3"]},
                         {"title": "B", "nodes": ["4"], "column": 1}]}
    ui = wfm.api_to_ui(GRAPH, INFO, name="t", layout=layout)
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert [g["title"] for g in ui["groups"]] == ["load", "A", "B"]
    note = [n for n in ui["nodes"] if n["type"] == "MarkdownNote"]
    assert len(note) == 1 and note[0]["widgets_values"] == [layout["note"]] and note[0]["id"] == 5
    assert ui["last_node_id"] == 5 and ui["extra"]["ditkit_template"] == {"title": "T", "description": "D",
                                                                          "look_at": "Sampler"}
    assert note[0]["pos"][0] < nodes[1]["pos"][0] < nodes[3]["pos"][0] == nodes[4]["pos"][0]   # B stacks under A
    assert nodes[3]["pos"][1] < nodes[4]["pos"][1]
    a, b = ui["groups"][1]["bounding"], ui["groups"][2]["bounding"]
    assert a[1] + a[3] < b[1]
    # the Note is ignored on the way back; the graph is unchanged
    assert wfm.ui_to_api(ui, INFO) == wfm.ui_to_api(wfm.api_to_ui(GRAPH, INFO, name="t"), INFO)
    with pytest.raises(WorkflowError, match=r"not in any stage \['4'\]"):
        wfm.api_to_ui(GRAPH, INFO, layout={"stages": [{"title": "x", "nodes": ["1", "2", "3"]}]})
    with pytest.raises(WorkflowError, match=r"in two stages \['1'\]"):
        wfm.api_to_ui(GRAPH, INFO, layout={"stages": [{"title": "x", "nodes": ["1", "2", "3", "4", "1"]}]})


def test_layout_rows_of_a_comparison_line_up():
    layout = {"stages": [{"title": "A1", "nodes": ["1"]}, {"title": "A2", "nodes": ["2", "3"]},
                         {"title": "B1", "nodes": ["4"], "column": 0, "row": 1}]}
    ui = wfm.api_to_ui(GRAPH, INFO, name="t", layout=layout)
    g = {x["title"]: x["bounding"] for x in ui["groups"]}
    # B1 sits in column 0 but below the taller A2 group of row 0, not just below A1
    assert g["B1"][0] == g["A1"][0] and g["B1"][1] > g["A2"][1] + g["A2"][3] > g["A1"][1] + g["A1"][3]


def test_layout_sizes_widen_nodes_and_refuse_unknown_ones():
    layout = {"stages": [{"title": "all", "nodes": sorted(GRAPH, key=str)}], "sizes": {"1": [520, 10]}}
    ui = wfm.api_to_ui(GRAPH, INFO, name="t", layout=layout)
    node = next(n for n in ui["nodes"] if n["id"] == 1)
    assert node["size"][0] == 520 and node["size"][1] > 10      # never narrower / lower than the default
    group = ui["groups"][0]
    assert group["bounding"][2] >= 520                            # the stage's group is as wide as its widest node
    with pytest.raises(wfm.WorkflowError, match="unknown node 'nope'"):
        wfm.api_to_ui(GRAPH, INFO, name="t", layout={**layout, "sizes": {"nope": [1, 1]}})
