"""The pack loads into a real ComfyUI: no import failure, every DitKit node registered with tooltips."""
from __future__ import annotations

import re

import pytest

from tests.support.pack_scan import REPO_ROOT, node_declarations
from ditkit.workflows import api_workflows, twin_path



def expected_ids() -> list[str]:
    """Node ids declared by ``NODES`` in nodes/*.py (AST; read at test time)."""
    return sorted(d.node_id for d in node_declarations() if d.node_id)


def test_pack_imports_cleanly(comfy_server):
    log = comfy_server.log_text()
    failed = [ln for ln in log.splitlines() if "IMPORT FAILED" in ln]
    assert not failed, "custom node import failures:\n" + "\n".join(failed)
    m = re.search(r"\[ditkit\] registered (\d+) nodes(.*)", log)
    assert m, f"ditkit never logged its registration line; log tail:\n{comfy_server.log_tail()}"
    assert "failed" not in m.group(2), f"some ditkit node modules failed to import: {m.group(0)}"
    assert "failed to import" not in log, [ln for ln in log.splitlines() if "failed to import" in ln]
    assert int(m.group(1)) == len(expected_ids()), (m.group(0), expected_ids())
    # the host contract was checked once at load and every entry holds on the tested host (issue #28)
    c = re.findall(r"\[ditkit\] host contract on ComfyUI (\S+): (\d+) entries, (\d+) hold, (\d+) adapted, "
                   r"(\d+) broken", log)
    assert len(c) == 1, c
    version, n, hold, adapted, broken = c[0]
    assert version == "0.33.0" and int(n) >= 50 and n == hold and adapted == broken == "0", c
    # the pack was loaded from the temp custom_nodes link, i.e. the ComfyUI tree was not touched
    assert re.search(r"seconds: \S*custom_nodes/ditkit\s*$", log, re.M), "no import-time line for ditkit"


def test_node_modules_import_in_process(comfy):
    """ditkit.nodes.IMPORT_ERRORS stays empty when every node module is imported in this process."""
    from ditkit import nodes

    found = nodes.discover_nodes()
    assert nodes.IMPORT_ERRORS == {}, nodes.IMPORT_ERRORS
    assert sorted(c.GET_SCHEMA().node_id for c in found) == expected_ids()


def test_object_info_lists_every_node_with_tooltips(comfy_server):
    info = comfy_server.object_info()
    listed = sorted(k for k in info if k.startswith("DitKit"))
    expected = expected_ids()
    assert listed == expected, f"/object_info DitKit nodes {listed} != NODES in nodes/*.py {expected}"
    missing_tips = []
    for nid in listed:
        ent = info[nid]
        assert ent.get("python_module", "").startswith("custom_nodes."), (nid, ent.get("python_module"))
        assert ent.get("category", "").startswith("ditkit"), (nid, ent.get("category"))
        assert ent.get("description"), f"{nid} has no description"
        for group in ("required", "optional"):
            for name, spec in (ent.get("input", {}).get(group) or {}).items():
                opts = spec[1] if isinstance(spec, list) and len(spec) > 1 and isinstance(spec[1], dict) else {}
                if not str(opts.get("tooltip") or "").strip():
                    missing_tips.append(f"{nid}.{name}")
    assert not missing_tips, f"inputs without a tooltip: {missing_tips}"


def test_web_extension_files_are_served(comfy_server):
    js = sorted(p.relative_to(REPO_ROOT / "web").as_posix() for p in (REPO_ROOT / "web").rglob("*.js"))
    if not js:
        pytest.skip("web/ has no .js files yet")
    served = comfy_server.get_json("/extensions")
    for rel in js:
        assert any(s.endswith("/" + rel) and "/extensions/" in s for s in served), (rel, served)


def test_example_workflow_templates_are_listed(comfy_server):
    twins = sorted(twin_path(p).stem for p in api_workflows() if twin_path(p).is_file())
    if not twins:
        pytest.skip("no UI-format example workflows yet")
    templates = comfy_server.get_json("/workflow_templates")
    assert sorted(templates.get("ditkit", [])) == twins, templates.get("ditkit")
