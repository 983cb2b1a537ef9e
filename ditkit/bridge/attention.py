"""ComfyUI's side of VSA-H3 attention (host layer; the tensor work is ``kernels/``).

* the ``optimized_attention_override`` protocol: ComfyUI calls ``override(func, q, k, v, heads, *args,
  mask=..., skip_reshape=..., skip_output_reshape=..., transformer_options=...)`` for every attention call of a
  model whose ``transformer_options`` carries it (``comfy/ldm/modules/attention.py: wrap_attn``);
* the ``transformer_options`` keys under which the per-forward context and the FastH3 gate travel;
* ComfyUI's names for the spans of H3's packed sequence (``comfy.ldm.minimax.model.PackedLayout.segments``) and
  how they map to FastVideo's prefix classes, and the packed layout of one forward rebuilt from its inputs;
* the ``("double_block", i)`` replaces that compute the FastH3 gate from a block's attention input.

Importable without ComfyUI (its modules are imported inside the functions that need them), so the quality lab's
reference engine can drive the same override.
"""
from __future__ import annotations

import torch.nn.functional as F

from ..kernels.vsa_h3_runtime import VSAH3Runtime
from ..kernels.vsa_layout import merge_prefix_segments

CTX_KEY = "ditkit_vsa"         # transformer_options key: the ForwardCtx of the running DiT forward
GATE_KEY = "ditkit_vsa_gate"   # transformer_options key: the FastH3 gate of the running block (if any)

# ComfyUI's PackedLayout span kinds -> FastVideo's prefix classes (text | cond video rows | audio rows) + target
SEGMENT_CLASS = {"text": "text", "cond": "visual", "ref_img": "visual", "cond_audio": "audio", "ref_audio": "audio",
                 "audio": "audio", "video": "video"}


def prefix_segments_from_spans(spans) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """FastVideo's prefix segments from a ComfyUI ``PackedLayout.segments`` list ``[(start, stop, kind)]``:
    several keyframes' ``cond`` spans form one segment, ``cond_audio``/``ref_audio`` next to ``audio`` too; the
    last span must be the target video. Returns (lengths, classes) of the prefix segments."""
    return merge_prefix_segments(spans, SEGMENT_CLASS.get)


def segments_from_inputs(dm, args, kwargs):
    """(prefix segment lengths, video grid) for this forward, as MiniMaxH3Model._forward builds PackedLayout."""
    import comfy.ldm.common_dit
    from comfy.ldm.minimax.model import PackedLayout

    x, context = args[0], args[2]
    payload = kwargs.get("minimax_payload") or {}
    video = comfy.ldm.common_dit.pad_to_patch_size(x[0], dm.patch_size)
    lt, lh, lw = video.shape[2], video.shape[3], video.shape[4]
    sig = (context.shape[1], lt, lh, lw, x[1].shape[-1])
    layout = payload.get("layout")
    if layout is None or layout.signature != sig:
        layout = PackedLayout(*sig, keyframes=payload.get("keyframes"), refs=payload.get("refs"))
    prefix, _ = prefix_segments_from_spans(layout.segments)
    pt, ph, pw = dm.patch_size
    grid = (lt // pt, lh // ph, lw // pw)
    return prefix, grid


def make_attention_override(rt: VSAH3Runtime, prev=None):
    """The ``optimized_attention_override`` callable that routes packed H3 self-attention through ``rt``.

    ComfyUI calls it as ``override(func, q, k, v, heads, *args, mask=..., skip_reshape=..., skip_output_reshape=...,
    transformer_options=...)``; the output is ``[B, S, H*D]``, or ``[B, H, S, D]`` with ``skip_output_reshape``
    (as ComfyUI's own attention functions return). Calls it declines (no ForwardCtx in ``transformer_options``, another layout, a mask, the token refiner's
    shorter sequence, or a dense step) are counted with their reason and run dense: through ``prev`` (an override
    installed before this one) when there is one, else ``func``. A full packed-sequence call that went dense makes
    its step dense; refiner and foreign calls do not.
    """

    def dense(func, q, k, v, heads, *a, **kw):
        if prev is not None:
            return prev(func, q, k, v, heads, *a, **kw)
        return func(q, k, v, heads, *a, **kw)

    def override(func, q, k, v, heads, *a, mask=None, skip_reshape=False, skip_output_reshape=False,
                 transformer_options=None, **kw):
        to = transformer_options or {}
        ctx = to.get(CTX_KEY)
        reason = None
        if ctx is None:
            reason = "not an H3 DiT forward"
        elif not skip_reshape or q.dim() != 4:
            reason = "unexpected layout"
        elif mask is not None:
            reason = "masked call"
        elif q.shape[2] != ctx.layout.seq_len:
            reason = "token refiner / non-packed"
        elif not ctx.sparse:
            reason = ctx.reason
        if reason is not None:
            packed = ctx is not None and reason != "token refiner / non-packed"
            rt.dense_call(reason, ctx if packed else None)
            if skip_output_reshape:
                kw["skip_output_reshape"] = True
            return dense(func, q, k, v, heads, *a, mask=mask, skip_reshape=skip_reshape,
                         transformer_options=transformer_options, **kw)
        out = rt.attention(q, k, v, ctx, gate=to.get(GATE_KEY))
        if skip_output_reshape:          # the caller wants ComfyUI's [B, H, S, D] (attention_pytorch's contract)
            return out
        B, H, S, D = out.shape
        return out.transpose(1, 2).reshape(B, S, H * D)

    override._ditkit_vsa = True
    return override


def install_gate_replaces(m, dm, gates: dict) -> None:
    """``("double_block", i)`` replaces on the clone ``m`` that put the FastH3 gate of block ``i`` (its
    ``to_gate_compress`` weight applied to the block's modulated attention input, as H3's block computes it)
    under ``GATE_KEY`` during sparse forwards, chaining any replace already installed."""
    from comfy.ldm.minimax.model import _mod_scale_shift

    dit = m.model_options.setdefault("transformer_options", {}).setdefault("patches_replace", {}).get("dit", {})
    for i, w in gates.items():
        blk = dm.blocks[i]
        prev = dit.get(("double_block", i))
        heads, hd = blk.attn.heads, blk.attn.head_dim

        def replace(args, extra, blk=blk, w=w, prev=prev, heads=heads, hd=hd):
            to = args["transformer_options"]
            ctx = to.get(CTX_KEY)
            if ctx is not None and ctx.sparse:
                x = args["img"]
                shift, scale = blk.adaln_proj(args["t_emb"])[:2]
                h = _mod_scale_shift(blk.norm1(x), shift, scale, args["mod_segments"])
                g = F.linear(h, w.to(device=h.device, dtype=h.dtype))
                g = g.view(h.shape[0], heads, hd).transpose(0, 1).unsqueeze(0)
                to = dict(to)
                to[GATE_KEY] = g
                args = dict(args, transformer_options=to)
            if prev is not None:
                return prev(args, extra)
            return extra["original_block"](args)

        m.set_model_patch_replace(replace, "dit", "double_block", i)
