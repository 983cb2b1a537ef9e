"""An API prompt that omits a required input of a node with ``validate_inputs`` gets HTTP 400 naming the input
(issue 29: DitKitTeaCache without ``coefficients`` got a raw ``TypeError`` from its ``validate_inputs``), on the
real server, and the next prompt still runs."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "example_workflows" / "api" / "h3_teacache_tiny.json"


@pytest.mark.parametrize("drop", ["coefficients", "threshold"])
def test_teacache_prompt_without_a_required_input_names_it(comfy_server, drop):
    graph = json.loads(API.read_text(encoding="utf-8"))
    tea = next(k for k, v in graph.items() if v["class_type"] == "DitKitTeaCache")
    bad = copy.deepcopy(graph)
    del bad[tea]["inputs"][drop]
    status, body = comfy_server.post_prompt(bad)
    assert status == 400, (status, body)
    errs = (body.get("node_errors") or {}).get(tea, {}).get("errors") or []
    text = json.dumps(body)
    assert "TypeError" not in text and "positional argument" not in text, text
    assert any(e.get("type") == "required_input_missing" and e.get("details") == drop for e in errs), body
    assert not any(e.get("type") == "exception_during_validation" for e in errs), body
