"""``python -m ditkit.run`` on bad arguments and bad workflow files: exit status 2 and one ``ERROR: ...`` line on
stderr naming the argument or file, no traceback, and no server started or contacted (the ``--server`` given
below has nothing listening: a runner that got past its checks would exit 3, "server unreachable", instead).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ditkit import run
from ditkit.errors import WorkflowError
from ditkit import workflows as wfm

DEAD = f"http://127.0.0.1:{run.free_port()}"  # nothing listens here
OK_API = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
          "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}


def _ui(nodes, links=()):
    return {"nodes": nodes, "links": list(links), "version": 0.4}


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "ditkit.run", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


class _InProcess:
    """``run.main(argv)`` in this process, shaped like a CompletedProcess (an exception escaping main fails the
    test with its traceback, so "no traceback" holds here too; the subprocess tests below check the CLI)."""

    def __init__(self, capsys, argv):
        try:
            self.returncode = run.main([str(a) for a in argv])
        except SystemExit as e:  # argparse / parse_args errors
            self.returncode = e.code
        cap = capsys.readouterr()
        self.stdout, self.stderr = cap.out, cap.err


def _assert_usage_error(r, *needles):
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert r.returncode == run.EXIT_USAGE, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _write(tmp_path, content, name="wf.json"):
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif isinstance(content, str):
        p.write_text(content, encoding="utf-8")
    else:
        p.write_text(json.dumps(content), encoding="utf-8")
    return p


# --------------------------------------------------------------------------------- workflow files

BAD_FILES = {
    "deep_array_200k": ("[" * 200_000 + "]" * 200_000, "nested deeper than 64"),
    "deep_object_200k": ('{"a":' * 200_000 + "1" + "}" * 200_000, "nested deeper than 64"),
    "deep_but_parseable": ("[" * 100 + "]" * 100, "nested deeper than 64"),
    "nan_literal": ('{"1": {"class_type": "X", "inputs": {"a": NaN}}}', "NaN"),
    "infinity_literal": ('{"1": {"class_type": "X", "inputs": {"a": -Infinity}}}', "Infinity"),
    "duplicate_node_id": ('{"1": {"class_type": "X"}, "1": {"class_type": "Y"}}', "duplicate key '1'"),
    "not_utf8": (b"\xff\xfe{}", "not UTF-8"),
    "not_json": ("{not json", "not readable JSON"),
    "top_level_array": ("[1, 2]", "expected a JSON object"),
    "api_node_not_object": ({"1": 5}, "no 'class_type'"),
    "api_class_type_not_string": ({"1": {"class_type": ["X"]}}, "no 'class_type'"),
    "api_inputs_not_object": ({"1": {"class_type": "X", "inputs": [1, 2]}}, "'inputs' is a list"),
    "api_link_to_missing_node": ({"1": {"class_type": "X", "inputs": {"a": ["9", 0]}}}, "missing node '9'"),
    "api_link_int_source": ({"1": {"class_type": "X", "inputs": {"a": [1, 0]}}}, "id string"),
    "api_link_negative_slot": ({"1": {"class_type": "X", "inputs": {"a": ["1", -1]}}}, "slot -1"),
    "ui_id_float_string": (_ui([{"id": "1.5", "type": "X"}]), "nodes[0] 'id'"),
    "ui_id_text": (_ui([{"id": "abc", "type": "X"}]), "nodes[0] 'id'"),
    "ui_id_null": (_ui([{"id": None, "type": "X"}]), "nodes[0] 'id' is null"),
    "ui_id_float": (_ui([{"id": 1.5, "type": "X"}]), "nodes[0] 'id' is float"),
    "ui_id_bool": (_ui([{"id": True, "type": "X"}]), "nodes[0] 'id' is true"),
    "ui_id_missing": (_ui([{"type": "X"}]), "nodes[0] 'id'"),
    "ui_id_repeated": (_ui([{"id": 1, "type": "X"}, {"id": "1", "type": "Y"}]), "repeats node id 1"),
    "ui_node_not_object": (_ui([5]), "nodes[0] is int"),
    "ui_type_not_string": (_ui([{"id": 1, "type": None}]), "'type' is null"),
    "ui_inputs_not_list": (_ui([{"id": 1, "type": "X", "inputs": {"a": 1}}]), "'inputs' is dict"),
    "ui_input_link_float": (_ui([{"id": 1, "type": "X", "inputs": [{"name": "a", "link": 1.5}]}]), "'link'"),
    "ui_input_name_list": (_ui([{"id": 1, "type": "X", "inputs": [{"name": ["a"], "link": None}]}]), "'name'"),
    "ui_link_origin_text": (_ui([{"id": 1, "type": "X"}], [[1, "a", 0, 1, 0, "M"]]), "link 1 origin node"),
    "ui_link_short": (_ui([{"id": 1, "type": "X"}], [[1, 1, 0]]), "links[0]"),
    "ui_link_id_null": (_ui([{"id": 1, "type": "X"}], [[None, 1, 0, 1, 0, "M"]]), "links[0] id is null"),
    "ui_link_negative_slot": (_ui([{"id": 1, "type": "X"}], [[1, 1, -2, 1, 0, "M"]]), "origin slot is -2"),
    "ui_link_object_missing_key": (_ui([{"id": 1, "type": "X"}], [{"id": 1, "origin_id": 1}]), "origin_slot"),
    "ui_links_not_list": ({"nodes": [{"id": 1, "type": "X"}], "links": {"1": 2}}, "'links' is dict"),
    "ui_link_from_missing_node": (_ui([{"id": 1, "type": "X", "inputs": [{"name": "a", "link": 3}]}],
                                      [[3, 7, 0, 1, 0, "M"]]), "starts at missing node 7"),
    "ui_widgets_values_string": (_ui([{"id": 1, "type": "X", "widgets_values": "abc"}]), "'widgets_values'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_workflow_file_is_a_usage_error(tmp_path, capsys, case):
    content, needle = BAD_FILES[case]
    p = _write(tmp_path, content)
    _assert_usage_error(_InProcess(capsys, [p, "--server", DEAD, "--startup-timeout", "1"]), str(p), needle)


@pytest.mark.parametrize("case", ["deep_array_200k", "ui_id_float_string", "ui_id_text", "ui_id_null",
                                  "api_link_to_missing_node", "nan_literal"])
def test_bad_workflow_file_cli(tmp_path, case):
    """The same through ``python -m ditkit.run`` (the process's exit status and stderr)."""
    content, needle = BAD_FILES[case]
    p = _write(tmp_path, content)
    _assert_usage_error(_cli(p, "--server", DEAD, "--startup-timeout", "1"), str(p), needle)


def test_huge_workflow_file_is_refused_before_reading(tmp_path, capsys):
    p = tmp_path / "huge.json"
    with open(p, "wb") as f:
        f.truncate(run.MAX_WORKFLOW_BYTES + 1)  # sparse: no disk used
    _assert_usage_error(_InProcess(capsys, [p, "--server", DEAD]), str(p), f"limit is {run.MAX_WORKFLOW_BYTES} bytes")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_and_directory_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "wf.json"
    os.mkfifo(fifo)  # opening it for reading without O_NONBLOCK would wait for a writer forever
    _assert_usage_error(_cli(fifo, "--server", DEAD, timeout=30), str(fifo), "not a regular file")
    d = tmp_path / "dir.json"
    d.mkdir()
    _assert_usage_error(_cli(d, "--server", DEAD), str(d), "is a directory")
    _assert_usage_error(_cli(tmp_path / "missing.json", "--server", DEAD), "does not exist")
    _assert_usage_error(_cli("bad\x01name.json", "--server", DEAD), "does not exist")


def test_good_files_get_past_the_checks(tmp_path, capsys):
    """The same runner on valid files reaches the (dead) server: exit 3, so the checks above are not blanket."""
    ui = _ui([{"id": "1", "type": "EmptyImage", "inputs": [], "widgets_values": [8, 8, 1, 0], "mode": 0},
              {"id": 2, "type": "SaveImage", "inputs": [{"name": "images", "link": 1}], "widgets_values": ["x"]}],
             [[1, 1, 0, 2, 0, "IMAGE"]])
    for content in (OK_API, {"prompt": OK_API, "client_id": "c"}, ui, "\ufeff" + json.dumps(OK_API)):
        r = _InProcess(capsys, [_write(tmp_path, content), "--server", DEAD, "--startup-timeout", "0.5"])
        assert r.returncode == run.EXIT_SERVER and "Traceback" not in r.stderr, r.stderr
        assert "did not answer /system_stats" in r.stderr


def test_example_workflows_pass_the_file_checks():
    paths = sorted(wfm.EXAMPLES_DIR.glob("*.json")) + wfm.api_workflows()
    assert paths
    for p in paths:
        assert isinstance(run.load_workflow_file(p), dict), p


# ----------------------------------------------------------------------------------------- arguments

BAD_ARGS = {
    "server_unclosed_ipv6": (["--server", "http://[::1"], "--server", "Invalid IPv6"),
    "server_port_too_big": (["--server", "http://h:99999"], "--server", "out of range"),
    "server_port_text": (["--server", "http://h:abc"], "--server", "'abc'"),
    "server_port_zero": (["--server", "http://h:0"], "--server", "port 0"),
    "server_no_host": (["--server", "http://:8188"], "--server", "no host"),
    "server_credentials": (["--server", "http://u:p@h:8188"], "--server", "credentials"),
    "server_query": (["--server", "http://h:8188/?x=1"], "--server", "query"),
    "server_space": (["--server", "http://h :8188"], "--server", "whitespace"),
    "server_scheme": (["--server", "ftp://h:21"], "--server", "scheme"),
    "timeout_nan": (["--server", "http://h:1", "--timeout", "nan"], "--timeout nan", "finite"),
    "timeout_inf": (["--server", "http://h:1", "--timeout", "inf"], "--timeout inf", "finite"),
    "timeout_overflow": (["--server", "http://h:1", "--timeout", "1e400"], "--timeout inf", "finite"),
    "timeout_negative": (["--server", "http://h:1", "--timeout", "-1"], "--timeout -1", "positive"),
    "timeout_text": (["--server", "http://h:1", "--timeout", "soon"], "--timeout", "invalid float"),
    "startup_timeout_nan": (["--server", "http://h:1", "--startup-timeout", "nan"], "--startup-timeout", "finite"),
    "port_too_big": (["--comfyui", "{comfy}", "--port", "99999"], "--port 99999", "65535"),
    "port_negative": (["--comfyui", "{comfy}", "--port", "-5"], "--port -5", "65535"),
    "python_missing": (["--comfyui", "{comfy}", "--python", "/nonexistent/python"], "--python", "executable"),
    "out_is_a_file": (["--comfyui", "{comfy}", "--out", "{wf}"], "--out", "not a directory"),
    "comfyui_not_a_checkout": (["--comfyui", "/nonexistent/comfy"], "--comfyui", "no main.py"),
    "unknown_option": (["--server", "http://h:1", "--bogus"], "--bogus", "unrecognized"),
    "server_and_comfyui": (["--server", "http://h:1", "--comfyui", "/x"], "--comfyui", "not allowed"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_argument_is_a_usage_error(tmp_path, capsys, case):
    argv, *needles = BAD_ARGS[case]
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text("raise SystemExit('must not be started')\n")
    wf = _write(tmp_path, OK_API)
    argv = [a.format(comfy=comfy, wf=wf) for a in argv]
    _assert_usage_error(_InProcess(capsys, [wf, *argv]), *needles)


@pytest.mark.parametrize("case", ["server_unclosed_ipv6", "server_port_text", "timeout_nan", "timeout_inf"])
def test_bad_argument_cli(tmp_path, case):
    argv, *needles = BAD_ARGS[case]
    _assert_usage_error(_cli(_write(tmp_path, OK_API), *argv), *needles)


def test_no_workflow_argument():
    _assert_usage_error(_cli(), "required")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8188", "http://127.0.0.1:8188/", "https://h.example",
                                 "http://[::1]:8188", "http://h:8188/comfy/"])
def test_valid_server_urls(url):
    assert run.check_server_url(url) == url.rstrip("/")


# ------------------------------------------------------------------------------ UI structure, in-process

_ids = st.one_of(st.integers(-3, 5), st.sampled_from(["1", "2", "1.5", "abc", "", "-1"]), st.none(),
                 st.booleans(), st.floats(allow_nan=False, allow_infinity=False, width=16))
_vals = st.one_of(st.none(), st.integers(-2, 3), st.text(max_size=3), st.lists(st.integers(0, 2), max_size=3),
                  st.floats(allow_nan=False, allow_infinity=False, width=16))
_inputs = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["w", "images", "x"])},
                                         optional={"link": st.one_of(st.none(), _ids), "type": _vals}), max_size=3)
_node = st.fixed_dictionaries(
    {"id": _ids},
    optional={"type": st.sampled_from(["Src", "Sink", "Reroute", "PrimitiveNode", "Note", "Nope"]),
              "mode": st.one_of(st.sampled_from([0, 2, 4]), _vals), "inputs": st.one_of(_inputs, _vals),
              "outputs": st.one_of(st.lists(st.fixed_dictionaries({"type": _vals}), max_size=2), _vals),
              "widgets_values": st.one_of(st.lists(_vals, max_size=3), st.dictionaries(st.text(max_size=2), _vals),
                                          _vals)})
_link = st.one_of(st.lists(st.one_of(_ids, _vals), min_size=0, max_size=7),
                  st.fixed_dictionaries({"id": _ids, "origin_id": _ids, "origin_slot": _ids, "target_id": _ids,
                                         "target_slot": _ids}), _vals)
_ui_wf = st.fixed_dictionaries({"nodes": st.lists(st.one_of(_node, _vals), max_size=4)},
                               optional={"links": st.one_of(st.lists(_link, max_size=4), _vals)})
SCHEMAS = {"Src": {"input": {"required": {"w": ["INT", {"default": 1}]}}, "input_order": {"required": ["w"]},
                   "output": ["IMAGE"], "output_name": ["IMAGE"]},
           "Sink": {"input": {"required": {"images": ["IMAGE", {}]}}, "input_order": {"required": ["images"]},
                    "output": [], "output_name": []}}


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(_ui_wf)
def test_ui_conversion_raises_only_workflow_errors(wf):
    """Any UI-shaped JSON: the converter returns an API graph or raises WorkflowError (no TypeError,
    KeyError, IndexError... that would reach the runner as a traceback after a server was started)."""
    try:
        graph = wfm.ui_to_api(wf, SCHEMAS)
    except WorkflowError:
        return
    assert isinstance(graph, dict)
    for k, node in graph.items():
        assert k.lstrip("-").isdigit() and node["class_type"] in SCHEMAS


def test_ui_node_ids_as_decimal_strings_convert():
    ui = _ui([{"id": "3", "type": "Src", "widgets_values": [7]},
              {"id": 4, "type": "Sink", "inputs": [{"name": "images", "link": 9}]}], [[9, "3", 0, 4, 0, "IMAGE"]])
    assert wfm.ui_to_api(ui, SCHEMAS) == {"3": {"class_type": "Src", "inputs": {"w": 7}},
                                          "4": {"class_type": "Sink", "inputs": {"images": ["3", 0]}}}
