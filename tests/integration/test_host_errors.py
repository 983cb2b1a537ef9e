"""Bad prompts and bad files fail loudly and leave the server able to run the next prompt."""
from __future__ import annotations

import json

import pytest

from ditkit import errors
from ditkit.run import format_node_errors, history_messages

DITKIT_ERRORS = {n for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, errors.DitKitError)}


def history_errors(entry):
    return history_messages(entry, "execution_error")

VALID = {"1": {"class_type": "EmptyImage", "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": 0}},
         "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "errors/after"}}}


def _assert_next_prompt_runs(server):
    assert server.alive(), server.log_tail()
    entry = server.run(VALID)
    assert entry["status"]["status_str"] == "success"
    assert [f.name for f in server.output_files(entry)], entry


def _spec(entry, name):
    for group in ("required", "optional"):
        s = (entry.get("input", {}).get(group) or {}).get(name)
        if s is not None:
            return group, s
    return None, None


def _combo_options(spec):
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO":
        return (spec[1] if len(spec) > 1 else {}).get("options") or []
    return None


def _standalone_ditkit_nodes(info):
    """DitKit nodes whose required inputs are all widgets (so one node + PreviewAny is a complete prompt)."""
    out = []
    for nid, ent in sorted(info.items()):
        if not nid.startswith("DitKit") or not ent.get("output"):
            continue
        req = ent.get("input", {}).get("required") or {}
        if all(_combo_options(s) is not None or s[0] in ("INT", "FLOAT", "STRING", "BOOLEAN") for s in req.values()):
            out.append(nid)
    return out


def _defaults(ent):
    vals = {}
    for name, s in (ent.get("input", {}).get("required") or {}).items():
        opts = s[1] if len(s) > 1 and isinstance(s[1], dict) else {}
        combo = _combo_options(s)
        if combo is not None:
            vals[name] = opts.get("default", combo[0] if combo else "")
        elif "default" in opts:
            vals[name] = opts["default"]
        else:
            vals[name] = {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[s[0]]
    return vals


@pytest.mark.parametrize("graph, node, kind", [
    ({"2": {"class_type": "SaveImage", "inputs": {"images": ["99", 0], "filename_prefix": "x"}}}, "2", "missing node"),
    ({"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
      "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}, "2", "wrong type"),
    ({"1": {"class_type": "EmptyImage", "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": "red"}},
      "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}, "1", "bad widget"),
])
def test_malformed_prompt_is_rejected_with_node_errors(comfy_server, graph, node, kind):
    status, body = comfy_server.post_prompt(graph)
    assert status == 400, (kind, status, body)
    assert node in (body.get("node_errors") or {}), (kind, body)
    text = format_node_errors(body, graph)
    assert f"node {node} (" in text, text
    _assert_next_prompt_runs(comfy_server)


def test_unknown_node_class_is_rejected(comfy_server):
    status, body = comfy_server.post_prompt({"1": {"class_type": "DitKitNoSuchNode", "inputs": {}}})
    assert status == 400, body
    assert "DitKitNoSuchNode" in format_node_errors(body), body
    _assert_next_prompt_runs(comfy_server)


def test_bad_widget_values_of_ditkit_nodes_are_rejected(comfy_server):
    info = comfy_server.object_info()
    checked = []
    for nid in _standalone_ditkit_nodes(info):
        ent = info[nid]
        for name, s in (ent["input"].get("required") or {}).items():
            combo = _combo_options(s)
            if combo is None:
                continue
            inputs = _defaults(ent)
            inputs[name] = "no_such_value_ditkit.safetensors"
            graph = {"1": {"class_type": nid, "inputs": inputs},
                     "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
            status, body = comfy_server.post_prompt(graph)
            assert status == 400, (nid, name, body)
            errs = body["node_errors"]["1"]["errors"]
            assert any((e.get("extra_info") or {}).get("input_name") == name for e in errs), (nid, name, errs)
            checked.append(f"{nid}.{name}")
    print("bad COMBO values rejected for", checked)
    if not checked:
        pytest.skip("no standalone DitKit node with a COMBO input")
    _assert_next_prompt_runs(comfy_server)


def _truncated_copy(models_dir, rel_name):
    hits = [p for p in models_dir.glob(f"*/{rel_name}") if p.is_file()]
    assert hits, f"{rel_name} not found under {models_dir}"
    src = hits[0]
    dst = src.with_name("truncated__" + src.name)
    data = src.read_bytes()
    dst.write_bytes(data[: max(9, len(data) // 2)])
    return dst


def test_truncated_checkpoint_fails_naming_the_file(comfy_server):
    """Each standalone DitKit loader (a COMBO listing .safetensors files) given a truncated copy of its first
    file: the execution error names the file; the server then runs the next valid prompt. Without such a node,
    the stock VAELoader is used so the recovery path is still exercised."""
    info = comfy_server.object_info()
    cases = []
    for nid in _standalone_ditkit_nodes(info):
        for name, s in (info[nid]["input"].get("required") or {}).items():
            files = [o for o in _combo_options(s) or [] if isinstance(o, str) and o.endswith(".safetensors")
                     and not o.split("/")[-1].startswith("truncated__")]
            if files:
                cases.append((nid, name, files[0]))
                break
    if not cases:
        cases.append(("VAELoader", "vae_name", None))
    for nid, name, fname in cases:
        if fname is None:
            bad = comfy_server.models_dir / "vae" / "truncated__vae.safetensors"
            bad.parent.mkdir(exist_ok=True)
            bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": {\"dtype\"")
            rel = bad.name
        else:
            bad = _truncated_copy(comfy_server.models_dir, fname)
            rel = "/".join(fname.split("/")[:-1] + [bad.name])
        ent = comfy_server.object_info(nid)[nid]
        group, spec = _spec(ent, name)
        inputs = _defaults(ent) if nid != "VAELoader" else {}
        inputs[name] = rel
        graph = {"1": {"class_type": nid, "inputs": inputs},
                 "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
        if nid.startswith("DitKit") and rel not in (_combo_options(spec) or []):
            # a family-filtered list does not offer a file whose header cannot be read (issue 29): the prompt is
            # refused at validation (HTTP 400) with the loader's reason naming the input and the file
            status, body = comfy_server.post_prompt(graph)
            text = json.dumps(body)
            assert status == 400 and "1" in (body.get("node_errors") or {}), (nid, status, body)
            assert bad.name in text and name in text and "header cannot be read" in text, (nid, text)
            print(f"{nid}.{name} <- {rel}: refused at validation")
            bad.unlink()
            _assert_next_prompt_runs(comfy_server)
            continue
        assert rel in (_combo_options(spec) or []), f"{rel} not offered by {nid}.{name}: {spec}"
        err = comfy_server.run_expect_failure(graph)
        text = str(err)
        assert err.entry is not None, f"{nid}: expected an execution error, got: {text}"
        assert bad.name in text, f"{nid}: error does not name the file {bad.name}: {text}"
        assert f"node 1 ({nid})" in text, text
        if nid.startswith("DitKit"):  # ditkit raises its own error types (a DitKitError subclass) for bad files
            etype = history_errors(err.entry)[0]["exception_type"].rsplit(".", 1)[-1]
            assert etype in DITKIT_ERRORS, f"{nid} raised {etype}, not a DitKitError subclass: {text}"
        print(f"{nid}.{name} <- {rel}: {text.splitlines()[0]}")
        bad.unlink()
        _assert_next_prompt_runs(comfy_server)
