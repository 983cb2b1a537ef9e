"""Reports name the node the user sees, also when ComfyUI serves a node's output from its cache to another prompt.

Runtime reports (VSA run, TeaCache counters, AdaLN hits, calibration) are sent by wrappers while the sampler
executes. With ComfyUI's default caching a MODEL output is served to any later prompt whose node has the same
inputs, whatever its id; a report keyed by the id captured at execute time then lands on whichever node of the
new graph has that id (a VSA report drawn on a CLIP Text Encode node).

* in process: ComfyUI's own ``DynamicPrompt`` / ``CurrentNodeContext`` / progress registry drive
  ``nodes._common`` (report_target resolved in a second prompt with other ids; two candidates; none);
* real server with the host's default caching (``comfy_server_cached``, no ``--cache-none``): one graph with every
  reporting node, queued twice with all node ids permuted and the seeds changed (the samplers run again, the
  model-producing nodes are served from the cache). Every ``ditkit.report`` event and every ``executed`` report
  of the second prompt must name a node of that prompt with the right class, and every reporting node must have
  its report. The oracle is the posted graph itself.
"""
from __future__ import annotations

import json
import threading
import time
import uuid

from ditkit.run import _WebSocket

H3 = "DitKitSparseAttention"


# ------------------------------------------------------------------------------------------------ in process

def _graph_a():
    return {
        "1": {"class_type": "DitKitH3ModelLoader", "inputs": {"model_name": "h3_tiny_official", "weight_dtype": "default"}},
        "2": {"class_type": "DitKitH3AdaLNCache", "inputs": {"model": ["1", 0], "offload_weights": True}},
        "3": {"class_type": H3, "inputs": {"model": ["2", 0], "recipe": "custom", "keep_percent": 25.0}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["9", 0], "text": "a fox"}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["3", 0], "seed": 1, "positive": ["4", 0]}},
        "9": {"class_type": "DitKitH3TextEncoderLoader", "inputs": {"text_encoder": "te.safetensors"}},
    }


def _renumber(graph: dict, mapping: dict) -> dict:
    out = {}
    for nid, node in graph.items():
        inputs = {k: ([mapping[v[0]], v[1]] if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) else v)
                  for k, v in node["inputs"].items()}
        out[mapping[nid]] = {"class_type": node["class_type"], "inputs": inputs}
    return out


def _in_prompt(prompt_id, graph, node_id, fn):
    from comfy_execution.graph import DynamicPrompt
    from comfy_execution.progress import reset_progress_state
    from comfy_execution.utils import CurrentNodeContext

    reset_progress_state(prompt_id, DynamicPrompt(graph))
    with CurrentNodeContext(prompt_id, node_id):
        return fn()


def test_runtime_report_follows_the_cached_output_to_the_new_node_id(comfy):
    from ditkit.nodes._common import report_target, send_report

    a = _graph_a()
    target = _in_prompt("pa", a, "3", lambda: report_target("3", H3))
    # same prompt: the id it executed under
    got = _in_prompt("pa", a, "5", lambda: send_report(target, H3, "run", "s", {}))
    assert got["node"] == "3" and got["prompt_id"] == "pa"
    # next prompt, every id changed ("3" is now the CLIP Text Encode node): the VSA node's new id
    b = _renumber(a, {"1": "7", "2": "5", "3": "9", "4": "3", "5": "1", "9": "4"})
    got = _in_prompt("pb", b, "1", lambda: send_report(target, H3, "run", "s", {}))
    assert got["node"] == "9" and b["9"]["class_type"] == H3 and got["prompt_id"] == "pb"


def test_two_equal_nodes_resolve_to_the_one_feeding_the_sampler(comfy):
    from ditkit.nodes._common import report_target, send_report

    a = _graph_a()
    target = _in_prompt("pa2", a, "3", lambda: report_target("3", H3))
    b = _renumber(a, {k: str(int(k) + 20) for k in a})
    # a second VSA node with the same inputs and its own sampler: both have the cached output's signature
    b["40"] = {"class_type": H3, "inputs": dict(b["23"]["inputs"])}
    b["41"] = {"class_type": "KSampler", "inputs": {"model": ["40", 0], "seed": 1, "positive": ["24", 0]}}
    assert _in_prompt("pb2", b, "41", lambda: send_report(target, H3, "run", "s", {}))["node"] == "40"
    assert _in_prompt("pb2", b, "25", lambda: send_report(target, H3, "run", "s", {}))["node"] == "23"


def test_a_node_that_is_not_in_the_current_prompt_gets_no_report(comfy, caplog):
    from ditkit.nodes._common import report_target, send_report

    a = _graph_a()
    target = _in_prompt("pa3", a, "3", lambda: report_target("3", H3))
    c = json.loads(json.dumps(a))
    c["3"]["inputs"]["keep_percent"] = 50.0      # another VSA node: not the one whose output is sampled
    got = _in_prompt("pc3", c, "5", lambda: send_report(target, H3, "run", "s", {}))
    assert got["node"] is None
    assert any("not attached to a node" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ real server

# symbolic names -> (class_type, inputs); links name other entries. Every ditkit node that reports is here.
def _workflow(seed: int) -> dict:
    lat = {"width": 64, "height": 64, "length": 5}
    g = {
        "h3": ("DitKitH3ModelLoader", {"model_name": "h3_tiny_official", "weight_dtype": "default"}),
        "te": ("DitKitH3TextEncoderLoader", {"text_encoder": "qwen3vl_tiny_minimax_h3.safetensors",
                                             "streaming": "layerwise", "prefetch": 1}),
        "txt": ("CLIPTextEncode", {"clip": ["te", 0], "text": "a red fox runs through fresh snow"}),
        "av": ("EmptyMiniMaxH3LatentAV", lat),
        "adaln": ("DitKitH3AdaLNCache", {"model": ["h3", 0], "offload_weights": True}),
        "vsa": (H3, {"model": ["adaln", 0], "recipe": "custom", "keep_percent": 25.0, "start_percent": 0.0,
                     "end_percent": 1.0, "backend": "auto", "min_tokens": 0, "gate": "auto"}),
        "tc": ("DitKitTeaCache", {"model": ["vsa", 0], "coefficients": "routing_tc.json", "threshold": 0.3,
                                  "audio_threshold": 0.3, "start_percent": 0.0, "end_percent": 1.0,
                                  "cache_device": "model", "strict": False}),
        "ks": ("KSampler", {"model": ["tc", 0], "seed": seed, "steps": 3, "cfg": 1.0, "sampler_name": "euler",
                            "scheduler": "simple", "positive": ["txt", 0], "negative": ["txt", 0],
                            "latent_image": ["av", 0], "denoise": 1.0}),
        "sep": ("LTXVSeparateAVLatent", {"av_latent": ["ks", 0]}),
        "save": ("SaveLatent", {"samples": ["sep", 0], "filename_prefix": "ditkit/routing"}),
        "cal": ("DitKitTeaCacheCalibrate", {"model": ["h3", 0], "name": "routing_cal", "degree": 1, "min_prompts": 1}),
        "kscal": ("KSampler", {"model": ["cal", 0], "seed": seed + 1, "steps": 6, "cfg": 1.0, "sampler_name": "euler",
                               "scheduler": "simple", "positive": ["txt", 0], "negative": ["txt", 0],
                               "latent_image": ["av", 0], "denoise": 1.0}),
        "sepcal": ("LTXVSeparateAVLatent", {"av_latent": ["kscal", 0]}),
        "savecal": ("SaveLatent", {"samples": ["sepcal", 0], "filename_prefix": "ditkit/routing_cal"}),
        # H3 VAE: image latent, T=1 decode, image encode, streaming video save
        "vae": ("DitKitH3VAELoader", {"vae_name": "h3_video_vae_tiny.safetensors"}),
        "imglat": ("DitKitH3EmptyImageLatent", {"width": 64, "height": 64, "batch_size": 1, "layout": "av"}),
        "ksimg": ("KSampler", {"model": ["vsa", 0], "seed": seed + 2, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
                               "scheduler": "simple", "positive": ["txt", 0], "negative": ["txt", 0],
                               "latent_image": ["imglat", 0], "denoise": 1.0}),
        "dec": ("DitKitH3VAEDecode", {"samples": ["ksimg", 0], "vae": ["vae", 0]}),
        "saveimg": ("SaveImage", {"images": ["dec", 0], "filename_prefix": "ditkit/routing_img"}),
        "pix": ("EmptyImage", {"width": 64, "height": 48, "batch_size": 1, "color": 12615680}),
        "encimg": ("DitKitH3EncodeImage", {"image": ["pix", 0], "vae": ["vae", 0], "layout": "av"}),
        "dec2": ("DitKitH3VAEDecode", {"samples": ["encimg", 0], "vae": ["vae", 0]}),
        "saveimg2": ("SaveImage", {"images": ["dec2", 0], "filename_prefix": "ditkit/routing_rt"}),
        "clip": ("EmptyImage", {"width": 64, "height": 48, "batch_size": 5, "color": 3355647 + seed}),
        "venc": ("VAEEncode", {"pixels": ["clip", 0], "vae": ["vae", 0]}),
        "mp4": ("DitKitSaveVideo", {"vae": ["vae", 0], "samples": ["venc", 0], "fps": 24.0,
                                    "filename_prefix": "ditkit/routing_video", "codec": "h264", "crf": -1}),
        # Z-Image: loader, LoKr, TeaCache with a shipped coefficient file
        "zi": ("DitKitZImageLoader", {"unet_name": "zimage_tiny.safetensors"}),
        "lokr": ("DitKitLoKrLoader", {"model": ["zi", 0], "lokr_name": "zimage_lokr_tiny.safetensors", "strength": 1.0}),
        "ztc": ("DitKitTeaCache", {"model": ["lokr", 0], "coefficients": "shipped:zimage_borrowed_qwen_image",
                                   "threshold": 0.3, "audio_threshold": 0.3, "start_percent": 0.0,
                                   "end_percent": 1.0, "cache_device": "model", "strict": False}),
        "lotus": ("LotusConditioning", {}),
        "zlat": ("EmptySD3LatentImage", {"width": 64, "height": 64, "batch_size": 1}),
        "zks": ("KSampler", {"model": ["ztc", 0], "seed": seed + 3, "steps": 3, "cfg": 1.0, "sampler_name": "euler",
                             "scheduler": "simple", "positive": ["lotus", 0], "negative": ["lotus", 0],
                             "latent_image": ["zlat", 0], "denoise": 1.0}),
        "zsave": ("SaveLatent", {"samples": ["zks", 0], "filename_prefix": "ditkit/routing_z"}),
        # LTX text encoder
        "lte": ("DitKitLTXTextEncoderLoader", {"text_encoder": "gemma_tiny_ltx.safetensors", "streaming": "layerwise",
                                               "prefetch": 1}),
        "ltxt": ("CLIPTextEncode", {"clip": ["lte", 0], "text": "a lighthouse in the fog"}),
        "lprev": ("PreviewAny", {"source": ["ltxt", 0]}),
    }
    return g


def _to_api(sym: dict, ids: dict) -> dict:
    out = {}
    for name, (ctype, inputs) in sym.items():
        inp = {k: ([ids[v[0]], v[1]] if isinstance(v, list) and len(v) == 2 and v[0] in sym else v)
               for k, v in inputs.items()}
        out[ids[name]] = {"class_type": ctype, "inputs": inp}
    return out


class _Listener:
    """Every websocket message of one client (``executed`` / ``execution_cached`` go to the queuing client only)."""

    def __init__(self, url: str):
        self.client_id = uuid.uuid4().hex
        self.ws = _WebSocket(url + f"/ws?clientId={self.client_id}")
        self.msgs: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            try:
                op, payload = self.ws.recv()
            except (EOFError, OSError, ValueError):
                return
            if op == 1:
                try:
                    self.msgs.append(json.loads(payload.decode("utf-8", errors="replace")))
                except json.JSONDecodeError:
                    pass

    def close(self):
        self.stop.set()
        self.ws.close()


def _run(server, graph: dict, timeout: float = 600.0) -> tuple[dict, list[dict]]:
    """Queue ``graph`` with a listening websocket; -> (history entry, messages received while it ran)."""
    lis = _Listener(server.url)
    try:
        prompt_id = str(uuid.uuid4())
        status, body = server.client.post_prompt(graph, client_id=lis.client_id, prompt_id=prompt_id)
        assert status == 200, body
        deadline = time.monotonic() + timeout
        while True:
            entry = server.client.history(prompt_id)
            if entry is not None and (entry.get("status") or {}).get("completed") is not None:
                break
            assert time.monotonic() < deadline and server.alive(), server.log_tail(40)
            time.sleep(0.2)
        if entry["status"]["status_str"] != "success":
            errs = [m["data"] for m in lis.msgs if m.get("type") == "execution_error"]
            raise AssertionError(f"prompt failed: {errs}\n{server.log_tail(40)}")
        time.sleep(0.5)  # the last messages of the prompt (sent before /history is written) to arrive
        msgs = [m for m in lis.msgs if (m.get("data") or {}).get("prompt_id") in (None, prompt_id)]
        return entry, msgs
    finally:
        lis.close()


SAMPLING_REPORTS = {("vsa", "run"), ("tc", "teacache"), ("adaln", "adaln_cache"), ("ztc", "teacache"),
                    ("cal", "teacache_calibration")}
MODEL_NODES = ("h3", "adaln", "vsa", "tc", "zi", "lokr", "ztc", "te", "vae")


def _check_prompt(graph: dict, sym_ids: dict, msgs: list[dict], entry: dict, expect_cached: bool) -> None:
    reports = [m["data"] for m in msgs if m.get("type") == "ditkit.report"]
    wrong = [(r["node"], r["node_type"], r["kind"], (graph.get(str(r["node"])) or {}).get("class_type"))
             for r in reports if (graph.get(str(r["node"])) or {}).get("class_type") != r["node_type"]]
    assert not wrong, f"ditkit.report events naming another node of this prompt (id, sent by, kind, id is): {wrong}"
    got = {(str(r["node"]), r["kind"]) for r in reports}
    missing = [(n, k) for n, k in SAMPLING_REPORTS if (sym_ids[n], k) not in got]
    assert not missing, f"sampling-time reports missing on their node: {missing}; got {sorted(got)}"
    # the replayed ui of a node (fresh or cached) names no other node
    executed = {str(m["data"]["node"]): m["data"].get("output") or {} for m in msgs if m.get("type") == "executed"}
    for nid, out in executed.items():
        for p in out.get("ditkit_report") or []:
            assert p.get("node") in (None, nid), f"executed event of node {nid} carries a report of node {p['node']}"
    for nid, out in (entry.get("outputs") or {}).items():
        for p in out.get("ditkit_report") or []:
            assert p.get("node") in (None, nid), f"/history of node {nid} carries a report of node {p['node']}"
    # every reporting ditkit node has its report in this prompt: a live event or its (cached) ui
    reporting = {nid for nid, n in graph.items() if n["class_type"].startswith("DitKit")}
    seen = {str(r["node"]) for r in reports} | {nid for nid, out in executed.items() if out.get("ditkit_report")}
    assert reporting <= seen, f"ditkit nodes without a report in this prompt: {sorted(reporting - seen)}"
    cached = {str(n) for m in msgs if m.get("type") == "execution_cached" for n in m["data"].get("nodes") or []}
    if expect_cached:
        not_cached = [n for n in MODEL_NODES if sym_ids[n] not in cached]
        assert not not_cached, (f"the second prompt did not get these outputs from the cache (evicted?), so it does "
                                f"not test the cached path: {not_cached}")


def test_reports_name_nodes_of_the_current_prompt_under_default_caching(comfy_server_cached):
    server = comfy_server_cached
    names = list(_workflow(0))
    # the TeaCache coefficient file the H3 TeaCache node reads (written once, before both prompts)
    prep_ids = {n: str(i + 1) for i, n in enumerate(names)}
    prep = {k: v for k, v in _workflow(0).items() if k in ("h3", "te", "txt", "av", "cal", "kscal", "sepcal", "savecal")}
    prep["cal"] = ("DitKitTeaCacheCalibrate", {"model": ["h3", 0], "name": "routing_tc", "degree": 1, "min_prompts": 1})
    _, msgs = _run(server, _to_api(prep, prep_ids))
    wrote = [m["data"]["summary"] for m in msgs if m.get("type") == "ditkit.report"
             and m["data"]["kind"] == "teacache_calibration"]
    assert wrote and " wrote " in wrote[-1], wrote

    ids_a = {n: str(i + 1) for i, n in enumerate(names)}
    graph_a = _to_api(_workflow(10), ids_a)
    entry_a, msgs_a = _run(server, graph_a)
    _check_prompt(graph_a, ids_a, msgs_a, entry_a, expect_cached=False)

    # the same graph, every id moved to a node of another class, the seeds changed: samplers run again, the
    # model-producing nodes come from the cache
    ids_b = {n: str(len(names) - i) for i, n in enumerate(names)}
    assert all(graph_a[ids_b[n]]["class_type"] != graph_a[ids_a[n]]["class_type"] for n in ("vsa", "tc", "adaln"))
    graph_b = _to_api(_workflow(20), ids_b)
    entry_b, msgs_b = _run(server, graph_b)
    _check_prompt(graph_b, ids_b, msgs_b, entry_b, expect_cached=True)
