"""DitKitH3TextEncoderLoader / DitKitLTXTextEncoderLoader: stock ComfyUI CLIP objects, optional layerwise streaming.

Both loaders read the file with ditkit's safe reader, check the family from the key inventory (clear error
otherwise), derive the decoder widths from the tensor shapes and build the *stock* ComfyUI text encoder through
``comfy.sd.load_text_encoder_state_dicts`` with ``model_options["<name>_model_config"]`` (ComfyUI's own config
override hook), so the real release files and the tiny test files both load. Streaming (core:
``offload/streamer.py``) is installed with object patches on the CLIP's ModelPatcher only:

* ``<decoder>.layers.<i>`` -> :class:`StreamedLayer` (the real layer is held unregistered, so ComfyUI's loader
  never moves it; each call copies it from its packed pinned host buffer one or more layers ahead);
* ``<decoder>.embed_tokens`` -> :class:`HostEmbedding` (lookup on the host, rows sent to the device);
* an ON_LOAD callback records which patcher is active so a CLIP LoRA on a streamed layer is refused loudly.
"""
from __future__ import annotations

import functools
import logging
import re


import torch
from comfy_api.latest import io

from ..errors import CheckpointError, DitKitError
from ..loaders.read_progress import load_with_progress
from ..loaders.safetensors_io import read_header
from ..offload.streamer import HostEmbedding, LayerwiseStreamer, StreamedLayer, find_layer_stacks
from ._bars import lazy_bar, offset_bar
from ._common import report_target, send_report, ui_report

log = logging.getLogger("ditkit")

H3_NODE = "DitKitH3TextEncoderLoader"
LTX_NODE = "DitKitLTXTextEncoderLoader"
STREAM_KEY = "ditkit_te_streaming"
QWEN_HEAD_DIM = 128     # ComfyUI Qwen3 config class constant
GEMMA3_HEAD_DIM = 256   # ComfyUI Gemma 3 config class constant


class StreamingError(DitKitError):
    """Layerwise streaming cannot be applied to this text encoder as requested."""


# -- family checks and config detection (from the header only) ------------------------------------------------
def _layer_count(keys) -> int:
    idx = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def _describe(keys) -> str:
    ks = set(keys)
    if "video_patch_proj.weight" in ks or "diffusion_model.video_patch_proj.weight" in ks:
        return "a MiniMax H3 diffusion model (load it with UNETLoader / the DitKit H3 model loader)"
    if any(k.startswith("model.diffusion_model.") for k in ks) or "adaln_single.linear.weight" in ks:
        return "a diffusion model / full checkpoint, not a text encoder"
    if "model.layers.0.post_feedforward_layernorm.weight" in ks:
        return f"a Gemma text encoder ({_layer_count(ks)} layers)"
    if "visual.deepstack_merger_list.0.norm.weight" in ks:
        return f"a Qwen3-VL text encoder with {_layer_count(ks)} layers"
    if "model.layers.0.self_attn.q_proj.weight" in ks:
        return f"a llama/Qwen-style text encoder ({_layer_count(ks)} layers)"
    if any(k.startswith("encoder.block.") for k in ks):
        return "a T5 text encoder"
    return f"an unrecognised file ({len(ks)} tensors; first keys {sorted(ks)[:3]})"


def h3_te_config(path, header) -> dict:
    t = header.tensors
    need = ("visual.deepstack_merger_list.0.norm.weight", "model.layers.49.self_attn.q_proj.weight",
            "model.embed_tokens.weight")
    missing = [k for k in need if k not in t]
    if missing:
        raise CheckpointError(
            f"{H3_NODE}: '{path}' is not a MiniMax H3 (Qwen3-VL-32B, 50-layer) text encoder: missing {missing}. "
            f"It looks like {_describe(t)}. Use qwen3vl_32b_minimax_h3_*.safetensors (or the tiny "
            "qwen3vl_tiny_minimax_h3.safetensors).")
    q, k = t["model.layers.0.self_attn.q_proj.weight"].shape, t["model.layers.0.self_attn.k_proj.weight"].shape
    if q[0] % QWEN_HEAD_DIM or k[0] % QWEN_HEAD_DIM:
        raise CheckpointError(f"{H3_NODE}: '{path}': q_proj rows {q[0]} / k_proj rows {k[0]} are not multiples of "
                              f"ComfyUI's Qwen3 head_dim {QWEN_HEAD_DIM}; this file cannot be built.")
    return {"hidden_size": int(t["model.embed_tokens.weight"].shape[1]),
            "vocab_size": int(t["model.embed_tokens.weight"].shape[0]),
            "num_hidden_layers": _layer_count(t),
            "num_attention_heads": int(q[0] // QWEN_HEAD_DIM), "num_key_value_heads": int(k[0] // QWEN_HEAD_DIM),
            "intermediate_size": int(t["model.layers.0.mlp.gate_proj.weight"].shape[0])}


def ltx_te_config(path, header) -> tuple[dict | None, str]:
    """(config override or None, family) for an LTX text-encoder file."""
    t = header.tensors
    if "model.layers.0.post_feedforward_layernorm.weight" not in t or "model.embed_tokens.weight" not in t:
        raise CheckpointError(
            f"{LTX_NODE}: '{path}' is not a Gemma text encoder for LTX-2: it looks like {_describe(t)}. Use the "
            "Gemma 3 12B (gemma_3_12B_it*) or LTX-2.5 Gemma 4 (+projection) text-encoder file.")
    n = _layer_count(t)
    kind = _detect(t)
    if kind is not None and kind.name.startswith("GEMMA_4"):
        return None, "gemma4"
    if n != 48:
        raise CheckpointError(f"{LTX_NODE}: '{path}' is a Gemma text encoder with {n} layers; LTX-2 uses Gemma 3 "
                              "12B (48 layers) or Gemma 4. Pick the LTX text encoder file.")
    if "spiece_model" not in t:
        raise CheckpointError(f"{LTX_NODE}: '{path}' has no 'spiece_model' tensor (the Gemma tokenizer ComfyUI reads "
                              "from the file); use a ComfyUI-packaged Gemma 3 file.")
    q, k = t["model.layers.0.self_attn.q_proj.weight"].shape, t["model.layers.0.self_attn.k_proj.weight"].shape
    if q[0] % GEMMA3_HEAD_DIM or k[0] % GEMMA3_HEAD_DIM:
        raise CheckpointError(f"{LTX_NODE}: '{path}': q_proj rows {q[0]} / k_proj rows {k[0]} are not multiples of "
                              f"ComfyUI's Gemma 3 head_dim {GEMMA3_HEAD_DIM}.")
    return ({"hidden_size": int(t["model.embed_tokens.weight"].shape[1]),
             "vocab_size": int(t["model.embed_tokens.weight"].shape[0]), "num_hidden_layers": n,
             "num_attention_heads": int(q[0] // GEMMA3_HEAD_DIM), "num_key_value_heads": int(k[0] // GEMMA3_HEAD_DIM),
             "intermediate_size": int(t["model.layers.0.mlp.gate_proj.weight"].shape[0])}, "gemma3")


def _detect(tensors):
    """ComfyUI's own text-encoder detector run on the header (it only tests key presence and a few shapes)."""
    import comfy.sd

    try:
        return comfy.sd.detect_te_model(tensors)
    except Exception:  # noqa: BLE001 - an unknown layout is reported by the caller's own checks
        return None


# -- building the stock CLIP ------------------------------------------------------------------------------------
def _read(path, progress=None):
    import comfy.utils

    sd, meta = load_with_progress(path, progress)
    sd, meta = comfy.utils.convert_old_quants(sd, model_prefix="", metadata=meta)
    return sd


def _h3_plan(path, header):
    """(node id, ComfyUI CLIPType name, model_options, reported config, extra state dicts from the read file)."""
    cfg = h3_te_config(path, header)
    return H3_NODE, "MINIMAX", {"qwen3vl_32b_model_config": cfg}, cfg, None


def _ltx_plan(path, header):
    cfg, family = ltx_te_config(path, header)
    opts = {"model_name": "gemma3_12b", "gemma3_12b_model_config": cfg} if cfg is not None else {}
    return LTX_NODE, "LTXV", opts, (cfg or {"family": family}), (_ltx_projection if family == "gemma3" else None)


def _ltx_projection(path, sd) -> list[dict]:
    proj = {k: v for k, v in sd.items() if k.startswith("text_embedding_projection.")}
    if not proj:
        raise CheckpointError(f"{LTX_NODE}: '{path}' has no text_embedding_projection.* weights; this loader "
                              "needs the LTX projection in the text-encoder file (use ComfyUI's "
                              "LTXAVTextEncoderLoader to pair a bare Gemma file with an LTX checkpoint).")
    # ComfyUI builds the LTX-AV text encoder (Gemma + projection) from >= 2 state dicts; the projection
    # lives in the same file, so the second dict holds only those tensors (no copy)
    return [proj]


_PLANS = {"h3": _h3_plan, "ltx": _ltx_plan}


def build_clip(kind: str, path, streaming: bool = False, prefetch: int = 1, force: bool = False, node_id=None,
               disable_dynamic: bool = False):
    """The stock CLIP of a ``kind`` ("h3" / "ltx") text-encoder file -> (clip, reported config, streaming info)."""
    import comfy.model_management as mm
    import comfy.sd
    import folder_paths

    node_type, clip_type, opts, cfg, extra_dicts = _PLANS[kind](path, read_header(path))
    if streaming:
        opts["initial_device"] = mm.text_encoder_offload_device()
    bar = lazy_bar(node_id)   # phase 1: tensors read; phase 2 (streaming): layers packed
    sd = _read(path, bar)
    dicts = [sd] + (extra_dicts(path, sd) if extra_dicts is not None else [])
    clip = comfy.sd.load_text_encoder_state_dicts(dicts, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                                                  clip_type=getattr(comfy.sd.CLIPType, clip_type), model_options=opts,
                                                  disable_dynamic=disable_dynamic)
    del sd, dicts
    clip.patcher.cached_patcher_init = (_reload_patcher, (kind, str(path), streaming, prefetch, force))
    info = install_streaming(clip, prefetch, force, node_id, node_type, bar) if streaming else {"streaming": "off"}
    return clip, cfg, info


build_h3_clip = functools.partial(build_clip, "h3")
build_ltx_clip = functools.partial(build_clip, "ltx")


def _reload_patcher(kind, path, streaming, prefetch, force, disable_dynamic=False):
    return build_clip(kind, path, streaming, prefetch, force, None, disable_dynamic=disable_dynamic)[0].patcher


# -- streaming install ------------------------------------------------------------------------------------------
class _StreamState:
    def __init__(self, prefixes, node_id, node_type):
        self.prefixes = prefixes
        self.active = None
        self.node_id = node_id
        self.node_type = node_type
        self.streamers: list[LayerwiseStreamer] = []


def install_streaming(clip, prefetch: int, force: bool = False, node_id=None, node_type=H3_NODE,
                      progress=None) -> dict:
    """Object-patch the CLIP's patcher so its decoder layers stream. ``force`` streams even when the load device
    is the CPU (cpu -> cpu copies; used by tests and benchmarks), otherwise that case is a reported no-op.
    ``progress(done, total)``: optional, after each layer packed into host memory (total = layers of all stacks).
    During each encode a per-layer bar is shown on the node running the encode (e.g. CLIPTextEncode)."""
    import comfy.patcher_extension as pe

    patcher = clip.patcher
    device = torch.device(patcher.load_device)
    if device.type == "cpu" and not force:
        msg = "streaming requested but the text encoder runs on the CPU: nothing to stream (no-op)"
        send_report(node_id, node_type, "te_streaming", msg, {"streaming": "noop_cpu"})
        return {"streaming": "noop_cpu", "message": msg}
    stacks = find_layer_stacks(patcher.model)
    if not stacks:
        raise StreamingError(f"{node_type}: no decoder layer stack (layers + embed_tokens) found in "
                             f"{type(patcher.model).__name__}; streaming is not supported for this encoder.")
    # encodes run while another node (CLIPTextEncode) executes, maybe in a later prompt: resolve the node then
    state = _StreamState([p + "." for p, _ in stacks], report_target(node_id, node_type), node_type)
    for path, mod in stacks:
        for i, layer in enumerate(mod.layers):
            for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
                if type(t.data) is not torch.Tensor:
                    raise StreamingError(f"{node_type}: layer {i} tensor {name!r} is a {type(t.data).__name__} "
                                         "(quantized weights); layerwise streaming supports plain-dtype weights "
                                         "only. Load with streaming off.")
    n_layers = sum(len(mod.layers) for _, mod in stacks)
    packed = 0
    for path, mod in stacks:
        part = offset_bar(progress, packed, n_layers) if progress is not None else None
        st = LayerwiseStreamer(list(mod.layers), device, prefetch=prefetch, wrap=False, name=path, progress=part)
        packed += len(mod.layers)
        st.on_pass_end = _pass_reporter(state, st)
        st.on_layer_done = lazy_bar(None)   # None: the bar belongs to the node executing the encode
        state.streamers.append(st)

        def guard(i, _path=path):
            _refuse_patches(state, _path)

        for i in range(len(mod.layers)):
            patcher.add_object_patch(f"{path}.layers.{i}", StreamedLayer(st, i, guard=guard))
        patcher.add_object_patch(f"{path}.embed_tokens", HostEmbedding(mod.embed_tokens, st.stats))

    def on_load(p, *args, **kwargs):
        state.active = p

    patcher.add_callback_with_key(pe.CallbacksMP.ON_LOAD, STREAM_KEY, on_load)
    st0 = state.streamers[0]
    # ComfyUI budgets VRAM with ModelPatcher.model_size() (cached in .size, inherited by clones). The streamed
    # layers and the host embedding never occupy the device; what does is the rest of the model plus the
    # (1 + prefetch) layer buffers. Without this ComfyUI would free VRAM for the whole encoder before each encode.
    import comfy.model_management as mm

    full = mm.module_size(patcher.model)
    hidden = sum(s.host_bytes for s in state.streamers) + sum(_nbytes(m.embed_tokens.weight) for _, m in stacks)
    buffers = sum((prefetch + 1) * s.max_layer_bytes for s in state.streamers)
    patcher.size = max(full - hidden, 0) + buffers
    info = {"streaming": "layerwise", "prefetch": prefetch, "device": str(device), "stacks": [p for p, _ in stacks],
            "layers": sum(len(s.packs) for s in state.streamers), "host_bytes": sum(s.host_bytes for s in state.streamers),
            "max_layer_bytes": st0.max_layer_bytes, "pinned": st0.pin,
            "embedding_bytes_on_host": sum(_nbytes(m.embed_tokens.weight) for _, m in stacks),
            "budgeted_device_bytes": patcher.size, "unstreamed_model_bytes": full}
    clip.ditkit_streaming = state
    return info


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _refuse_patches(state: _StreamState, path: str) -> None:
    p = state.active
    if p is None:
        return
    keys = [k for k in list(getattr(p, "patches", {}) or {}) + list(getattr(p, "weight_wrapper_patches", {}) or {})
            if k.startswith(path + ".layers.") or k.startswith(path + ".embed_tokens.")]
    if keys:
        raise StreamingError(f"{state.node_type}: {len(keys)} weight patches (e.g. a CLIP LoRA: {keys[0]!r}) target "
                             "streamed layers; streaming does not apply patches. Load the text encoder with "
                             "streaming off to use a CLIP LoRA.")


def _pass_reporter(state: _StreamState, st: LayerwiseStreamer):
    def report():
        s = st.stats
        summary = (f"streamed {len(st.packs)} layers: {s.bytes_h2d / 2**20:.2f} MiB copied, peak device-resident "
                   f"{s.peak_device_bytes / 2**20:.3f} MiB (max layer {st.max_layer_bytes / 2**20:.3f} MiB, "
                   f"prefetch {st.prefetch}), {s.prefetch_hits} prefetch hits, embedding on host "
                   f"({s.host_embedding_bytes_read / 2**10:.1f} KiB of rows read)")
        send_report(state.node_id, state.node_type, "te_streaming", summary, {**s.as_dict(), "device": str(st.device)})
        s.reset()
    return report


# -- nodes ------------------------------------------------------------------------------------------------------
def _te_files(family: str):
    """The text-encoder files of ``family`` ("h3_te" / "ltx_te"), decided from the header (``_families``); a file
    whose header cannot be read is not listed (``validate_inputs`` names why when a prompt asks for it)."""
    from . import _families

    return _families.family_files("text_encoders", family, skip_shards=True)


def _inputs(default_hint: str, family: str):
    return [
        io.Combo.Input("text_encoder", options=_te_files(family), tooltip=default_hint),
        io.Combo.Input("streaming", options=["off", "layerwise"], default="off",
                       tooltip="layerwise: keep the decoder layers in pinned host memory and copy each to the GPU "
                               "just before use (embedding table stays on the host). Peak GPU weight memory is "
                               "(1 + prefetch) layers. A reported no-op when the encoder runs on the CPU."),
        io.Int.Input("prefetch", default=1, min=0, max=8,
                     tooltip="Layers copied ahead of the one computing (on a separate CUDA stream). 1-2 hides "
                             "most copy time; 0 copies each layer only when needed."),
    ]


def _schema_common(clip_type: str) -> dict:
    """Schema fields both loaders share (each class names its own node id, title, description and inputs)."""
    return {"outputs": [io.Clip.Output(tooltip=f"A stock ComfyUI CLIP (type {clip_type}).")],
            "hidden": [io.Hidden.unique_id]}


def _run(kind: str, node_type: str, text_encoder: str, streaming: str, prefetch: int, node_id):
    from . import _files

    path = _files.safetensors_path("text_encoders", text_encoder, node_type)
    clip, cfg, info = build_clip(kind, path, streaming == "layerwise", int(prefetch), False, node_id)
    summary = f"loaded {text_encoder} ({cfg.get('num_hidden_layers', '?')} layers, hidden {cfg.get('hidden_size', '?')}); "
    if info["streaming"] == "layerwise":
        summary += (f"layerwise streaming on {info['device']}, prefetch {info['prefetch']}, "
                    f"{info['host_bytes'] / 2**20:.2f} MiB packed on host ({'pinned' if info['pinned'] else 'pageable'}), "
                    f"embedding {info['embedding_bytes_on_host'] / 2**20:.2f} MiB stays on host")
    elif info["streaming"] == "noop_cpu":
        summary += info["message"]
    else:
        summary += "streaming off"
    payload = send_report(node_id, node_type, "te_loader", summary, {"config": cfg, **info})
    return io.NodeOutput(clip, ui=ui_report(payload))


class _TextEncoderLoader(io.ComfyNode):
    """The shared execute of both loaders; a subclass sets ``KIND`` / ``NODE`` and its own schema."""

    KIND = ""
    NODE = ""

    @classmethod
    def validate_inputs(cls, text_encoder=None):
        from . import _families

        return _families.check_listed(cls.NODE, "text_encoder", "text_encoders", f"{cls.KIND}_te", text_encoder,
                                      skip_shards=True)

    @classmethod
    def execute(cls, text_encoder, streaming="off", prefetch=1) -> io.NodeOutput:
        return _run(cls.KIND, cls.NODE, text_encoder, streaming, prefetch, cls.hidden.unique_id if cls.hidden else None)


class DitKitH3TextEncoderLoader(_TextEncoderLoader):
    KIND, NODE = "h3", H3_NODE

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=H3_NODE,
            display_name="H3 Text Encoder Loader (ditkit)",
            category="ditkit/loaders",
            description="Loads the MiniMax H3 Qwen3-VL text encoder as a stock ComfyUI CLIP (widths read from the "
                        "file), optionally streaming its layers to the GPU one at a time.",
            search_aliases=["minimax h3 clip", "qwen3vl", "h3 text encoder", "te streaming", "clip offload"],
            inputs=_inputs("Qwen3-VL-32B MiniMax H3 text encoder (text_encoders folder; only H3 text-encoder "
                           "files are listed).", "h3_te"),
            **_schema_common("minimax"),
        )


class DitKitLTXTextEncoderLoader(_TextEncoderLoader):
    KIND, NODE = "ltx", LTX_NODE

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=LTX_NODE,
            display_name="LTX Text Encoder Loader (ditkit)",
            category="ditkit/loaders",
            description="Loads an LTX-2 Gemma 3 (+ LTX projection) or LTX-2.5 Gemma 4 text encoder as a stock "
                        "ComfyUI CLIP (type ltxv), optionally streaming its layers to the GPU one at a time.",
            search_aliases=["ltx clip", "gemma", "ltx text encoder", "te streaming", "clip offload"],
            inputs=_inputs("Gemma text encoder for LTX-2/2.5 with the LTX text projection in the same file "
                           "(only such files are listed).", "ltx_te"),
            **_schema_common("ltxv"),
        )


NODES = [DitKitH3TextEncoderLoader, DitKitLTXTextEncoderLoader]
