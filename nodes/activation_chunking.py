"""DitKitActivationChunking: exact feed-forward chunking over tokens on a clone (core: ``memory/chunking.py``,
host side: ``bridge/chunking.py``)."""
from __future__ import annotations

from comfy_api.latest import io

from ..bridge import chunking as bridge
from ..bridge.models import model_family
from ..errors import UnsupportedModelError
from ..memory.chunking import ROW_ALIGN, check_chunk
from ._common import report_target, send_report, ui_report

NODE_ID = "DitKitActivationChunking"


class DitKitActivationChunking(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=NODE_ID,
            display_name="Activation Chunking (ditkit)",
            category="ditkit/sampling",
            description=("Runs every DiT block's feed-forward (fc1 -> SwiGLU/GELU -> fc2) on token chunks and writes "
                         "them into one output: the feed-forward intermediates (2-3x the hidden width per token) "
                         "exist for one chunk at a time. Exact: token rows are independent (bit-identical in "
                         "bf16/fp16 on CPU; see docs/memory.md for fp32). MiniMax H3, LTX-2, Z-Image, FLUX.2 "
                         "(double blocks)."),
            search_aliases=["ffn chunking", "feed forward chunk", "activation memory", "oom", "vram", "chunk ffn"],
            inputs=[
                io.Model.Input("model", tooltip="An H3, LTX-2, Z-Image or FLUX.2 diffusion model."),
                io.Int.Input("chunk_tokens", default=0, min=0, max=1 << 22, step=ROW_ALIGN,
                             tooltip=f"Tokens per feed-forward chunk (rounded down to a multiple of {ROW_ALIGN}). "
                                     "0 = auto: the largest chunk whose intermediates fit half of the memory "
                                     "free at that call."),
                io.Int.Input("attention_heads_per_call", default=0, min=0, max=1024,
                             tooltip="0 = attention untouched. N > 0: packed self-attention runs over groups of N "
                                     "heads (exact; lowers the score workspace of backends that hold scores: "
                                     "ComfyUI's CPU sub_quad, basic, split). Put this node before "
                                     "DitKit Sparse Attention."),
            ],
            outputs=[io.Model.Output(tooltip="The model with chunked feed-forwards (a clone).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, chunk_tokens=0, attention_heads_per_call=0) -> io.NodeOutput:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
            raise UnsupportedModelError(f"{NODE_ID}: chunk_tokens must be 0 (auto) or a positive number of tokens, "
                                        f"got {chunk_tokens!r}")
        chunk = None if chunk_tokens == 0 else check_chunk(chunk_tokens, "chunk_tokens")
        family = model_family(model)
        if family is None:
            raise UnsupportedModelError(f"{NODE_ID}: the MODEL input is not an H3, LTX-2, Z-Image or FLUX.2 diffusion "
                                        "model; nothing was changed.")
        hg = attention_heads_per_call
        if isinstance(hg, bool) or not isinstance(hg, int) or hg < 0:
            raise UnsupportedModelError(f"{NODE_ID}: attention_heads_per_call must be 0 (off) or a positive number of "
                                        f"heads, got {hg!r}")
        m = model.clone()
        heads_note = bridge.install_head_groups(m, hg) if hg else ""
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        info = bridge.install(m, family, chunk, (report_target(node_id, NODE_ID), send_report))
        how = f"{chunk - chunk % ROW_ALIGN or ROW_ALIGN} tokens" if chunk else "auto (from free memory per call)"
        summary = (f"{family}: {info['sites']} feed-forwards chunked, {how}"
                   + (f"; replaced an earlier chunking on {info['replaced']}" if info["replaced"] else "")
                   + "".join(f"; {n}" for n in info["notes"])
                   + (f"; attention over groups of {hg} heads ({heads_note})" if hg else ""))
        payload = send_report(node_id, NODE_ID, "activation_chunking", summary,
                              {"family": family, "sites": info["sites"], "chunk": chunk, "replaced": info["replaced"],
                               "notes": info["notes"], "attention_heads_per_call": hg})
        return io.NodeOutput(m, ui=ui_report(payload))


NODES = [DitKitActivationChunking]
