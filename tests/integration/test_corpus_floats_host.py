"""NaN / Infinity in FLOAT inputs (issue #17 item 9): every FLOAT input of every DitKit node, enumerated from the
live schemas, is sent non-finite values over /prompt to the real server. JSON's ``NaN`` passes ComfyUI's min/max
validation (every comparison with NaN is false), and a linked float is not range-checked at all, so these reach the
node: it must fail with a DitKitError naming the input, before doing anything, and the server must keep serving.
(``Infinity`` as a widget value is refused by ComfyUI's own max check with a node error naming the input.)"""
from __future__ import annotations

import math

import pytest

from ditkit.run import history_messages

# what feeds an input of each link type (any value of the right type will do: the check runs first)
PROVIDERS = {
    "MODEL": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3_tiny_comfy.safetensors", "weight_dtype": "default"}},
    "VAE": {"class_type": "DitKitH3VAELoader", "inputs": {"vae_name": "h3_video_vae_tiny.safetensors"}},
    "LATENT": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "IMAGE": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
}
WIDGETS = ("INT", "FLOAT", "STRING", "BOOLEAN")


def _float_inputs(info: dict) -> list[str]:
    out = []
    for section in ("required", "optional"):
        for name, spec in (info["input"].get(section) or {}).items():
            if spec and spec[0] == "FLOAT":
                out.append(name)
    return out


def _graph(node: str, info: dict, target: str, value, linked: bool) -> dict:
    g = {}
    inputs = {}
    for name, spec in (info["input"].get("required") or {}).items():
        kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
        if isinstance(kind, list):                       # COMBO (old style)
            inputs[name] = opts.get("default", kind[0])
        elif kind == "COMBO":
            inputs[name] = opts.get("default", (opts.get("options") or [None])[0])
        elif kind in WIDGETS:
            inputs[name] = opts.get("default")
        else:
            if kind not in PROVIDERS:
                raise AssertionError(f"{node}.{name}: no provider for link type {kind}; add one to PROVIDERS")
            nid = str(len(g) + 10)
            g[nid] = PROVIDERS[kind]
            inputs[name] = [nid, 0]
    if linked:
        g["90"] = {"class_type": "PrimitiveFloat", "inputs": {"value": value}}
        inputs[target] = ["90", 0]
    else:
        inputs[target] = value
    g["1"] = {"class_type": node, "inputs": inputs}
    if not info.get("output_node") and info.get("output"):
        g["99"] = {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}
    return g


@pytest.fixture(scope="module")
def ditkit_info(comfy_server):
    info = comfy_server.object_info()
    return {k: v for k, v in info.items() if k.startswith("DitKit")}


def test_live_schemas_and_the_guard_enumerate_the_same_float_inputs(comfy, ditkit_info):
    """The in-process registration (the guard's view: ``guards.float_inputs`` on each schema) and the server's
    /object_info list the same FLOAT inputs, and every registered class is guarded."""
    from ditkit.guards import GUARD_ATTR, float_inputs
    from ditkit.nodes import discover_nodes

    classes = discover_nodes()
    local = {c.GET_SCHEMA().node_id: float_inputs(c.GET_SCHEMA()) for c in classes}
    remote = {k: tuple(_float_inputs(v)) for k, v in ditkit_info.items()}
    assert local == remote
    assert sum(len(v) for v in local.values()) >= 9
    for c in classes:
        assert getattr(c, GUARD_ATTR, None) == local[c.GET_SCHEMA().node_id], c


def test_every_float_input_refuses_non_finite_values_over_prompt(comfy_server, ditkit_info):
    cases = [(node, name) for node, info in sorted(ditkit_info.items()) for name in _float_inputs(info)]
    assert len(cases) >= 9, cases
    failures = []
    for node, name in cases:
        info = ditkit_info[node]
        for value, linked in ((math.nan, False), ("nan", False), (math.nan, True)):
            err = comfy_server.run_expect_failure(_graph(node, info, name, value, linked))
            msgs = history_messages(err.entry, "execution_error")
            msg = msgs[0]["exception_message"] if msgs else str(err)
            etype = msgs[0]["exception_type"].rsplit(".", 1)[-1] if msgs else "?"
            if etype != "DitKitError" or f"input '{name}'" not in msg or node not in msg or msgs[0]["node_id"] != "1":
                failures.append(f"{node}.{name} = {value!r} ({'linked' if linked else 'widget'}): {etype}: {msg[:200]}")
            assert comfy_server.alive(), comfy_server.log_tail()
        for value in (math.inf, -math.inf):   # a widget value: ComfyUI's own max/min check names the input
            status, body = comfy_server.post_prompt(_graph(node, info, name, value, False))
            errs = (body.get("node_errors") or {}).get("1", {}).get("errors") or []
            if status != 400 or not any(e.get("extra_info", {}).get("input_name") == name for e in errs):
                failures.append(f"{node}.{name} = {value!r}: HTTP {status} {str(body)[:200]}")
    assert not failures, "\n".join(failures)
    entry = comfy_server.run({"1": {"class_type": "EmptyImage", "inputs": {"width": 16, "height": 16, "batch_size": 1,
                                                                           "color": 0}},
                              "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}})
    assert entry["status"]["status_str"] == "success"


def test_linked_infinity_reaches_the_guard_in_process(comfy):
    """A linked input is not range-checked by the host: +-Inf reaches execute, where the guard refuses it."""
    from ditkit.errors import DitKitError
    from ditkit.nodes import discover_nodes

    classes = {c.GET_SCHEMA().node_id: c for c in discover_nodes()}
    lokr = classes["DitKitLoKrLoader"]
    for v in (math.inf, -math.inf, math.nan):
        with pytest.raises(DitKitError, match="input 'strength'"):
            lokr.execute(model=None, lokr_name="x.safetensors", strength=v)
    tc = classes["DitKitTeaCache"]
    with pytest.raises(DitKitError, match="input 'end_percent'"):
        tc.execute(model=None, coefficients="", threshold=0.2, audio_threshold=0.2, start_percent=0.0,
                   end_percent=math.inf, cache_device="model", strict=False)
