"""DitKitH3TextEncoderLoader / DitKitLTXTextEncoderLoader: stock ComfyUI CLIP objects, optional layerwise streaming.

What is built and how it streams is ``bridge/text_encoders.py`` (ComfyUI's ``load_text_encoder_state_dicts`` with
its config-override hook; object patches on the CLIP's ModelPatcher); here: the schemas, the file lists and the
report of the load.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge import text_encoders as bte
from ..bridge.text_encoders import (GEMMA3_HEAD_DIM, QWEN_HEAD_DIM, STREAM_KEY,  # noqa: F401
                                    HostEmbedding, LayerwiseStreamer, StreamedLayer, StreamingError, _describe,
                                    _detect, _read, _refuse_patches, _reload_patcher, build_clip, build_h3_clip,
                                    build_ltx_clip, h3_te_config, install_streaming, load_with_progress,
                                    ltx_te_config, read_header)
from ._common import send_report, ui_report

# node ids as literals here (the layering test reads them from this file); bridge/text_encoders.py names them in
# its messages
H3_NODE = "DitKitH3TextEncoderLoader"
LTX_NODE = "DitKitLTXTextEncoderLoader"
assert (H3_NODE, LTX_NODE) == (bte.H3_NODE, bte.LTX_NODE)


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
