"""A model quantized while loading (DitKitH3ModelLoader ``weight_format`` fp8 / int8) composed with the other ditkit
nodes in the real host (in process, CPU, tiny H3): DitKitSparseAttention, DitKitTeaCache (shipped coefficients
calibrated on the tiny H3), DitKitAdapterLoader (a DiffSynth-Studio LoRA written here), and all of them at once.

Oracles, per composition ``f`` and stream (video, audio latents), with ``rel(x, y) = ||x - y|| / ||y||``:

* the same pipeline on the unquantized model: ``rel(q∘f, f) <= 2 * rel(q, plain)``. VSA and TeaCache leave the
  weights alone, so the weights' quantization error is all that separates the two runs; the adapter adds one more
  rounding of the layers it patches (dequantize -> add -> requantize), at most a second quantization error.
  Measured on this model: ratios 0.98-1.53 (fp8 and int8, every composition), so the factor 2 has margin and a
  feature that ran differently on the quantized model (another tile selection, other skipped steps, a lost patch)
  exceeds it; and ``rel(q∘f, f) > 0.2 * rel(q, plain)`` (the quantized weights were the ones used);
* the feature did to the quantized model what it does to the unquantized one: ``d_q = q∘f - q`` against
  ``d = f - plain``, ``||d_q - d|| <= 0.35 ||d||`` where the feature's effect ``||d||`` is at least twice the
  quantization error (else the comparison measures quantization noise). Measured 0.05-0.22 (the largest: fp8
  adapter, whose patched layers get a second rounding); a feature missing on the quantized model gives 1.0;
* the per-run reports (sent by the nodes while sampling, captured at ``send_report``) name the node that installed
  the feature and say the same thing ran: VSA tiles kept per query tile and the measured density, TeaCache
  computed / skipped counts;
* the adapter on the quantized base, weight by weight: the host's own layout quantize
  (``QuantizedLayout.quantize(..., scale="recalculate")``) of ``dequant(base) + ΔW`` (ΔW = B·A in float64, the
  DiffSynth convention, written here) for every patched layer.
"""
from __future__ import annotations

import re

import pytest
import torch

from ditkit.loaders.safetensors_io import save_file
from ditkit.tiny import ckpt_h3 as c

CFG = c.CONFIG
H, INNER, FFN, NH, HD = (CFG["hidden_size"], CFG["num_attention_heads"] * CFG["attention_head_dim"],
                         CFG["ffn_hidden_size"], CFG["num_attention_heads"], CFG["attention_head_dim"])
MODEL = "h3_tiny_comfy.safetensors"          # the file shipped:h3_tiny_calibrated was fitted on
FORMATS = ["float8_e4m3fn", "int8_tensorwise"]
W = H_PX = 256                               # video grid (7, 8, 8 latent patches) -> 2 x 2 x 2 cubes, k=2 at 25 %
LENGTH, STEPS, TEXT = 22, 8, 10
# DiffSynth-Studio LoRA on official H3 names: (module, out, in); qkv_proj rows are per-head interleaved
LORA_MODULES = [("blocks.0.attn.qkv_proj", 3 * INNER, H), ("blocks.0.attn.out_proj", H, INNER),
                ("blocks.1.mlp.fc1", 2 * FFN, H), ("blocks.1.mlp.fc2", H, FFN),
                ("token_refiner.blocks.0.mlp.fc2", H, FFN)]


def interleaved_to_comfy(d):
    """Official per-head interleaved rows [h0: q,k,v; h1: ...] -> ComfyUI [q_all; k_all; v_all] (h3.md)."""
    out = torch.empty_like(d)
    for h in range(NH):
        for j in range(3):
            out[j * INNER + h * HD: j * INNER + (h + 1) * HD] = d[h * 3 * HD + j * HD: h * 3 * HD + (j + 1) * HD]
    return out


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.tiny.checkpoints import generate_all

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("quant_compose")
    generate_all(root, only=["h3_dit"])
    loras = root / "loras"
    loras.mkdir()
    g = torch.Generator().manual_seed(20)
    sd, deltas = {}, {}
    for mod, o, n in LORA_MODULES:
        a, b = torch.randn(4, n, generator=g) * 0.1, torch.randn(o, 4, generator=g) * 0.1
        sd[f"{mod}.lora_A.default.weight"], sd[f"{mod}.lora_B.default.weight"] = a, b
        d = b.double() @ a.double()
        deltas[f"diffusion_model.{mod}.weight"] = interleaved_to_comfy(d) if mod.endswith("qkv_proj") else d
    save_file(sd, loras / "compose_lora.safetensors")
    added = [("diffusion_models", str(root / "diffusion_models")), ("loras", str(loras))]
    for kind, p in added:
        folder_paths.add_model_folder_path(kind, p)
    yield {"deltas": deltas}
    for kind, p in added:
        paths = folder_paths.folder_names_and_paths[kind][0]
        if p in paths:
            paths.remove(p)
        folder_paths.filename_list_cache.pop(kind, None)


@pytest.fixture
def reports(monkeypatch):
    """Every report a ditkit node sends (install and per-run), as (node_type, kind, summary, data)."""
    import ditkit.bridge.reports as BT   # per-run reports (the sink every bridge feature is handed)
    import ditkit.nodes.adapters as NA
    import ditkit.nodes.h3_loaders as NL
    import ditkit.nodes.sparse_attention as NS
    import ditkit.nodes.teacache as NT

    got = []
    for mod in (BT, NA, NL, NS, NT):
        real = mod.send_report

        def rec(node_id, node_type, kind, summary, data=None, _real=real):
            got.append((node_type, kind, summary, data))
            return _real(node_id, node_type, kind, summary, data)

        monkeypatch.setattr(mod, "send_report", rec)
    return got


_MODELS: dict = {}


def load(fmt=None):
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    if fmt not in _MODELS:
        out = DitKitH3ModelLoader.execute(model_name=MODEL, **({"weight_format": fmt} if fmt else {}))
        _MODELS[fmt] = out
    return _MODELS[fmt].args[0]


def lora(m):
    from ditkit.nodes.adapters import DitKitAdapterLoader

    return DitKitAdapterLoader.execute(m, "compose_lora.safetensors", 1.0).args[0]


def vsa(m):
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    return DitKitSparseAttention.execute(m, recipe="custom", keep_percent=25.0, backend="reference").args[0]


def teacache(m):
    from ditkit.nodes.teacache import DitKitTeaCache

    return DitKitTeaCache.execute(m, "shipped:h3_tiny_calibrated", 0.3, 0.3, 0.0, 1.0, "model", False).args[0]


def everything(m):
    return teacache(vsa(lora(m)))


COMPOSITIONS = {"sparse_attention": vsa, "teacache": teacache, "adapter": lora, "all": everything}
RUN_NODES = {"sparse_attention": {"DitKitSparseAttention"}, "teacache": {"DitKitTeaCache"}, "adapter": set(),
             "all": {"DitKitSparseAttention", "DitKitTeaCache"}}


def sample(model):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    lat = EmptyMiniMaxH3LatentAV.execute(W, H_PX, LENGTH).result[0]
    cond = [[torch.randn(1, TEXT, CFG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    r = nodes.common_ksampler(model, 7, STEPS, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
    return [t.clone().double() for t in r.unbind()]     # video, audio


_SAMPLES: dict = {}


def cached(key, fn):
    """Samples are deterministic (fixed seed, CPU): the unquantized references are computed once per module."""
    if key not in _SAMPLES:
        _SAMPLES[key] = fn()
    return _SAMPLES[key]


def rel(x, y):
    return float((x - y).norm() / y.norm())


VSA_RUN = re.compile(r"steps sparse (\d+) / dense (\d+).*measured block density ([\d.]+) \(keep [\d.]+, k=(\d+)\)")


def _runs(reports):
    """Per-run reports of one sampling: node type -> the facts that must agree between the two models."""
    out = {}
    for node_type, kind, summary, data in reports:
        if node_type == "DitKitSparseAttention" and kind == "run":
            m = VSA_RUN.search(summary)
            assert m, summary
            out[node_type] = m.groups()
        elif node_type == "DitKitTeaCache" and kind == "teacache":
            out[node_type] = (data["computed"], data["skipped"])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("what", list(COMPOSITIONS))
def test_quantized_composition_differs_only_by_the_quantization_error(env, reports, fmt, what):
    compose = COMPOSITIONS[what]
    plain, qplain = cached(("plain", None), lambda: sample(load())), cached(("plain", fmt), lambda: sample(load(fmt)))

    def unquantized():
        reports.clear()
        out = sample(compose(load()))
        return out, _runs(reports)

    ref, runs_ref = cached((what, None), unquantized)
    reports.clear()
    qm = compose(load(fmt))
    installs = list(reports)
    got = sample(qm)
    runs_q = _runs(reports)
    # what ran is reported on the node that installed it, and the same thing ran on both models
    assert set(runs_q) == RUN_NODES[what] and runs_q == runs_ref, (runs_q, runs_ref)
    if "DitKitTeaCache" in runs_q:
        assert runs_q["DitKitTeaCache"][1] >= 1
    if what in ("adapter", "all"):
        summary, data = next((s, d) for t, k, s, d in installs if t == "DitKitAdapterLoader")
        assert f"{len(LORA_MODULES)} modules applied, 0 keys unused, 0 refused" in summary, summary
        assert any("quantized" in n for n in data["notes"]), data["notes"]    # says the base layers were quantized
    for stream, (g, r, p, qp) in zip(("video", "audio"), zip(got, ref, plain, qplain)):
        e_q, e_f = rel(qp, p), rel(g, r)
        assert 0.2 * e_q < e_f <= 2.0 * e_q, (stream, e_f, e_q)
        d, d_q = r - p, g - qp
        if d.norm() >= 2 * e_q * p.norm():
            assert (d_q - d).norm() <= 0.35 * d.norm(), (stream, float((d_q - d).norm() / d.norm()))


# ------------------------------------------------------------------------------------- adapter weight oracle

def _host_quantize(w, fmt):
    import comfy.quant_ops as q

    conf = q.QUANT_ALGOS[fmt]
    qd, params = q.get_layout_class(conf["comfy_tensor_layout"]).quantize(w.clone(), scale="recalculate")
    return qd, float(params.scale)


def _ordinal(codes, fmt):
    """Quantized codes -> integers that are consecutive for neighbouring values (fp8: sign-magnitude bytes)."""
    if fmt == "int8_tensorwise":
        return codes.view(torch.int8).to(torch.int64)
    b = codes.view(torch.uint8).to(torch.int64)
    return torch.where(b >= 128, -(b - 128), b)


def _patched_against_oracle(env, fmt):
    """The patched layers as the sampler and ModelSave see them: the clone patched onto the CPU (weight patches
    and object patches alike, whichever way the loader installs its result), read, then unpatched."""
    import comfy.model_management
    import comfy.utils

    # a clone sampled by an earlier test stays loaded, its patches applied to the shared module (ComfyUI's way):
    # unload first, so that the base is read as stored
    comfy.model_management.unload_all_models()
    base = load(fmt)
    m = lora(base)
    before, want = {}, {}
    for key, delta in env["deltas"].items():
        w0 = comfy.utils.get_attr(base.model, key)
        assert type(w0).__name__ == "QuantizedTensor", key
        before[key] = w0.dequantize().clone()
        want[key] = _host_quantize((w0.dequantize().double() + delta).to(w0.dequantize().dtype), fmt)
    m.patch_model(device_to=torch.device("cpu"))
    try:
        got = {}
        for key in want:
            w = comfy.utils.get_attr(m.model, key)
            assert type(w).__name__ == "QuantizedTensor", key
            assert getattr(comfy.utils.get_attr(m.model, key.rsplit(".", 1)[0]), "quant_format", None) == fmt, key
            got[key] = (w._qdata.clone(), float(w._params.scale))
    finally:
        m.unpatch_model()
    out = {}
    for key, (codes, scale) in got.items():
        assert torch.equal(comfy.utils.get_attr(base.model, key).dequantize(), before[key]), "base changed"
        out[key] = (_ordinal(codes, fmt), _ordinal(want[key][0], fmt), scale, want[key][1])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_adapter_on_the_quantized_base_is_within_one_code_of_the_host_requantize(env, fmt):
    """Holds for any rounding of dequant(base) + ΔW to a neighbouring code (nearest or stochastic)."""
    for key, (got, want, s_got, s_want) in _patched_against_oracle(env, fmt).items():
        assert s_got == pytest.approx(s_want, rel=1e-6, abs=0), key
        assert int((got - want).abs().max()) <= 1, key


@pytest.mark.parametrize("fmt", FORMATS)
def test_adapter_on_the_quantized_base_equals_the_host_requantize(env, fmt):
    """dequant(base) + ΔW requantized with the host's own layout quantize, code for code. ΔW in float64 here;
    an implementation computing it in float32 may land on the other side of a rounding tie: at most 1 code in
    1000 may differ, by one code."""
    for key, (got, want, s_got, s_want) in _patched_against_oracle(env, fmt).items():
        assert s_got == pytest.approx(s_want, rel=1e-6, abs=0), key
        diff = (got != want)
        assert int((got - want).abs().max()) <= 1 and float(diff.double().mean()) <= 1e-3, \
            (key, float(diff.double().mean()))


# ------------------------------------------------------------------------------------------------ real server

def test_one_graph_with_everything_on_a_real_server(comfy_server):
    """Quantized loader -> adapter -> sparse attention -> TeaCache -> KSampler as one prompt on a headless ComfyUI:
    it runs, and each ditkit node's report is the one of that node id (install reports in /history, per-run
    reports in the server log under the id of the node that installed the feature)."""
    graph = {
        "1": {"class_type": "DitKitH3ModelLoader", "inputs": {"model_name": MODEL, "weight_dtype": "default",
                                                              "weight_format": "float8_e4m3fn"}},
        "2": {"class_type": "DitKitAdapterLoader", "inputs": {"model": ["1", 0], "strength": 1.0, "qkv_layout": "auto",
                                                              "adapter_name": "h3_diffsynth_lora_tiny.safetensors",
                                                              "scale": 0.0}},
        "3": {"class_type": "DitKitSparseAttention", "inputs": {"model": ["2", 0], "recipe": "custom",
                                                                "keep_percent": 25.0, "start_percent": 0.0,
                                                                "end_percent": 1.0, "backend": "reference",
                                                                "min_tokens": 0, "gate": "auto"}},
        "4": {"class_type": "DitKitTeaCache", "inputs": {"model": ["3", 0], "coefficients": "shipped:h3_tiny_calibrated",
                                                         "threshold": 0.3, "audio_threshold": 0.3, "start_percent": 0.0,
                                                         "end_percent": 1.0, "cache_device": "model", "strict": False}},
        "5": {"class_type": "DitKitH3TextEncoderLoader", "inputs": {"text_encoder": "qwen3vl_tiny_minimax_h3.safetensors",
                                                                    "streaming": "off", "prefetch": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["5", 0], "text": "a red fox runs through fresh snow"}},
        "7": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": W, "height": H_PX, "length": LENGTH}},
        "8": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "seed": 7, "steps": STEPS, "cfg": 1.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["6", 0],
                                                   "negative": ["6", 0], "latent_image": ["7", 0], "denoise": 1.0}},
        "11": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["8", 0]}},
        "9": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": "ditkit/quant_compose"}},
        "10": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}},
    }
    entry = comfy_server.run(graph)
    assert entry["status"]["status_str"] == "success"
    outs, log = entry["outputs"], comfy_server.log_text()
    for nid in ("1", "2", "3", "4"):
        reps = outs[nid]["ditkit_report"]          # /history outputs are keyed by the node id
        assert reps and all(r["node_type"] == graph[nid]["class_type"] for r in reps), (nid, reps)
        assert f"[ditkit] {graph[nid]['class_type']} #{nid} " in log, nid
    assert "quantized float8_e4m3fn (weight-only)" in outs["1"]["ditkit_report"][0]["summary"]
    assert "quantized layers" in " ".join(outs["2"]["ditkit_report"][0]["data"]["notes"])
    assert re.search(r"\[ditkit\] DitKitSparseAttention #3 run: VSA-H3 backend reference; steps sparse \d+", log), \
        log[-3000:]
    m = re.findall(r"\[ditkit\] DitKitTeaCache #4 teacache: TeaCache h3: computed (\d+)/(\d+) calls, skipped (\d+)", log)
    assert m and int(m[-1][1]) == STEPS and int(m[-1][2]) >= 1, log[-3000:]
