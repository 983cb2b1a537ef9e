"""ComfyUI's side of VSA-H3 attention (host layer; the tensor work is ``kernels/``).

* the ``optimized_attention_override`` protocol: ComfyUI calls ``override(func, q, k, v, heads, *args,
  mask=..., skip_reshape=..., skip_output_reshape=..., transformer_options=...)`` for every attention call of a
  model whose ``transformer_options`` carries it (``comfy/ldm/modules/attention.py: wrap_attn``);
* the ``transformer_options`` keys under which the per-run holder, the per-forward context and the FastH3 gate
  travel, and the module-level wrappers that fill them: the per-forward ``DIFFUSION_MODEL`` wrapper and the
  per-run ``OUTER_SAMPLE`` wrapper that clones the holder for each sampling run and restores it in ``finally``;
* ComfyUI's names for the spans of H3's packed sequence (``comfy.ldm.minimax.model.PackedLayout.segments``) and
  how they map to FastVideo's prefix classes, and the packed layout of one forward rebuilt from its inputs;
* the ``("double_block", i)`` replaces that compute the FastH3 gate from a block's attention input.

Importable without ComfyUI (its modules are imported inside the functions that need them), so the quality lab's
reference engine can drive the same override.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..kernels.vsa_h3_runtime import VSAH3Runtime
from ..kernels.vsa_layout import merge_prefix_segments
from .hostcompat import (LAYOUT_KEY, check_published_layout, dense_attention_for, persistent_alloc,
                         preferred_attention_functions)

CTX_KEY = "ditkit_vsa"         # transformer_options key: the ForwardCtx of the running DiT forward
GATE_KEY = "ditkit_vsa_gate"   # transformer_options key: the FastH3 gate of the running block (if any)
HOLDER_KEY = "ditkit_vsa_holder"  # transformer_options key: the VSAHolder (template on the model, clone per run)
WRAPPER_KEY = "ditkit_vsa_h3"  # key of the DIFFUSION_MODEL / OUTER_SAMPLE wrappers
PLAN_KEY = "ditkit_vsa_plan"  # transformer_options key: this forward's rebuilt layout facts and host checks

# ComfyUI's PackedLayout span kinds -> FastVideo's prefix classes (text | cond video rows | audio rows) + target
SEGMENT_CLASS = {"text": "text", "cond": "visual", "ref_img": "visual", "cond_audio": "audio", "ref_audio": "audio",
                 "audio": "audio", "video": "video"}


def prefix_segments_from_spans(spans) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """FastVideo's prefix segments from a ComfyUI ``PackedLayout.segments`` list ``[(start, stop, kind)]``:
    several keyframes' ``cond`` spans form one segment, ``cond_audio``/``ref_audio`` next to ``audio`` too; the
    last span must be the target video. Returns (lengths, classes) of the prefix segments."""
    return merge_prefix_segments(spans, SEGMENT_CLASS.get)


def packed_layout(dm, args, kwargs):
    """This forward's ``PackedLayout`` (the payload's when it fits the inputs), as MiniMaxH3Model._forward builds
    it, and the padded video latent's (t, h, w)."""
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
    return layout, (lt, lh, lw)


def segments_from_inputs(dm, args, kwargs):
    """(prefix segment lengths, video grid) for this forward, as MiniMaxH3Model._forward builds PackedLayout."""
    layout, (lt, lh, lw) = packed_layout(dm, args, kwargs)
    prefix, _ = prefix_segments_from_spans(layout.segments)
    pt, ph, pw = dm.patch_size
    grid = (lt // pt, lh // ph, lw // pw)
    return prefix, grid


@dataclass
class VSAHolder:
    """The per-run state of one installed VSA-H3, kept under ``HOLDER_KEY`` in ``transformer_options`` (ComfyUI's
    EasyCache holder pattern): the node installs a template on its model clone; every sampling run works on its own
    :meth:`clone` (fresh counters, same settings) and ends with ``on_run_end(runtime)`` (the run report)."""

    runtime: VSAH3Runtime
    on_run_end: Optional[Callable[[VSAH3Runtime], None]] = None

    def clone(self) -> "VSAHolder":
        return VSAHolder(self.runtime.fresh(), self.on_run_end)


class VSAAttentionOverride:
    """The ``optimized_attention_override`` that routes packed H3 self-attention through the running
    :class:`VSAHolder`'s runtime (read from ``transformer_options`` per call; the object itself holds no run state).

    ComfyUI calls it as ``override(func, q, k, v, heads, *args, mask=..., skip_reshape=..., skip_output_reshape=...,
    transformer_options=...)``; the output is ``[B, S, H*D]``, or ``[B, H, S, D]`` with ``skip_output_reshape``
    (as ComfyUI's own attention functions return). Calls it declines (no ForwardCtx in ``transformer_options``,
    another layout, a mask, the token refiner's shorter sequence, or a dense step) are counted with their reason and
    run dense: through ``prev`` (an override installed before this one) when there is one, else ``func``. A full
    packed-sequence call that went dense makes its step dense; refiner and foreign calls do not. A call without a
    holder in ``transformer_options`` (not a model this override was installed on) runs dense uncounted.
    """

    _ditkit_vsa = True

    def __init__(self, prev=None):
        self.prev = prev

    def _dense(self, func, q, k, v, heads, *a, **kw):
        # the checkpoint's attention choice for this block when the host has one (0.38 pops it before calling an
        # override: calling func would lose it), else the host's function; a previous override gets it as func
        plan = (kw.get("transformer_options") or {}).get(PLAN_KEY)
        func = dense_attention_for(func, kw.get("transformer_options"), plan.get("preferred") if plan else None)
        if self.prev is not None:
            return self.prev(func, q, k, v, heads, *a, **kw)
        return func(q, k, v, heads, *a, **kw)

    def __call__(self, func, q, k, v, heads, *a, mask=None, skip_reshape=False, skip_output_reshape=False,
                 transformer_options=None, **kw):
        to = transformer_options or {}
        holder = to.get(HOLDER_KEY)
        ctx = to.get(CTX_KEY)
        plan = to.get(PLAN_KEY)
        if plan is not None and plan["layout"] is None and LAYOUT_KEY in to:  # 0.38: published layout, checked once
            plan["layout"] = check_published_layout(to, ctx.layout.seq_len, plan["prefix"], plan["grid"],
                                                    prefix_segments_from_spans)
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
        if reason is not None or holder is None:
            if holder is not None:
                packed = ctx is not None and reason != "token refiner / non-packed"
                holder.runtime.dense_call(reason, ctx if packed else None)
            if skip_output_reshape:
                kw["skip_output_reshape"] = True
            return self._dense(func, q, k, v, heads, *a, mask=mask, skip_reshape=skip_reshape,
                               transformer_options=transformer_options, **kw)
        out = holder.runtime.attention(q, k, v, ctx, gate=to.get(GATE_KEY))
        if skip_output_reshape:          # the caller wants ComfyUI's [B, H, S, D] (attention_pytorch's contract)
            return out
        B, H, S, D = out.shape
        return out.transpose(1, 2).reshape(B, S, H * D)


def install(m, holder: VSAHolder, prev=None) -> None:
    """Put VSA-H3 on the model clone ``m``: the holder template, the attention override (chaining ``prev``), the
    per-forward ``DIFFUSION_MODEL`` wrapper and the per-run ``OUTER_SAMPLE`` wrapper (module-level functions)."""
    import comfy.patcher_extension as pe

    topts = m.model_options.setdefault("transformer_options", {})
    topts[HOLDER_KEY] = holder
    topts["optimized_attention_override"] = VSAAttentionOverride(prev)
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, forward_wrapper)
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)


def forward_wrapper(executor, *args, **kwargs):
    """``DIFFUSION_MODEL`` wrapper: this forward's :class:`ForwardCtx` (packed layout rebuilt from the inputs, sigma
    gating) under ``CTX_KEY`` in the forward's own copy of ``transformer_options``."""
    to = args[3] if len(args) > 3 else kwargs.get("transformer_options", {})
    holder = to.get(HOLDER_KEY)
    if holder is None:
        return executor(*args, **kwargs)
    prefix, grid = segments_from_inputs(executor.class_obj, args, kwargs)
    sig = to.get("sigmas")
    sigma = float(sig.flatten()[0]) if isinstance(sig, torch.Tensor) and sig.numel() else None
    to = dict(to)
    with persistent_alloc():  # the runtime's layout tables outlive this forward (0.38's malloc graph)
        to[CTX_KEY] = holder.runtime.begin_forward(prefix, grid, sigma)
    to[PLAN_KEY] = {"prefix": tuple(prefix), "grid": tuple(grid), "layout": None,
                    "preferred": preferred_attention_functions(executor.class_obj)}
    if len(args) > 3:
        args = args[:3] + (to,) + tuple(args[4:])
    else:
        kwargs["transformer_options"] = to
    return executor(*args, **kwargs)


def outer_sample_wrapper(executor, *args, **kwargs):
    """``OUTER_SAMPLE`` wrapper: this sampling run gets its own clone of the holder in a clone of the guider's
    model_options (nothing of the run is written into the model's options); both restored in ``finally``, where the
    run report is sent (as ``comfy_extras/nodes_easycache.py`` does)."""
    import comfy.model_patcher

    from .hostcompat import refuse_with_block_sparse

    guider = executor.class_obj
    refuse_with_block_sparse(guider.model_options.get("transformer_options"), "DitKitSparseAttention")
    orig = guider.model_options
    guider.model_options = comfy.model_patcher.create_model_options_clone(orig)
    to = guider.model_options.setdefault("transformer_options", {})
    holder = to[HOLDER_KEY].clone()
    to[HOLDER_KEY] = holder
    try:
        return executor(*args, **kwargs)
    finally:
        guider.model_options = orig
        if holder.on_run_end is not None:
            holder.on_run_end(holder.runtime)


def install_gate_replaces(m, dm, gates: dict) -> None:
    """``("double_block", i)`` replaces on the clone ``m`` that put the FastH3 gate of block ``i`` (its
    ``to_gate_compress`` weight applied to the block's modulated attention input, as H3's block computes it)
    under ``GATE_KEY`` during sparse forwards, chaining any replace already installed."""
    from comfy.ldm.minimax.model import _mod_scale_shift

    from .blocks import block_modulation, install_memo, memo_extra
    from .hostcompat import check_block_index

    install_memo(m, dm)
    dit = m.model_options.setdefault("transformer_options", {}).setdefault("patches_replace", {}).get("dit", {})
    for i, w in gates.items():
        prev = dit.get(("double_block", i))
        heads, hd = dm.blocks[i].attn.heads, dm.blocks[i].attn.head_dim

        def replace(args, extra, i=i, w=w, prev=prev, heads=heads, hd=hd):
            to = args["transformer_options"]
            check_block_index(to, i)
            ctx = to.get(CTX_KEY)
            if ctx is not None and ctx.sparse:
                blk = dm.blocks[i]  # the block that runs now (the one the memo and the block's own run use)
                x = args["img"]
                shift, scale = block_modulation(args, blk, i)[:2]
                h = _mod_scale_shift(blk.norm1(x), shift, scale, args["mod_segments"])
                g = F.linear(h, w.to(device=h.device, dtype=h.dtype))
                g = g.view(h.shape[0], heads, hd).transpose(0, 1).unsqueeze(0)
                to = dict(to)
                to[GATE_KEY] = g
                args = dict(args, transformer_options=to)
            extra = memo_extra(extra, dm, i)
            if prev is not None:
                return prev(args, extra)
            return extra["original_block"](args)

        m.set_model_patch_replace(replace, "dit", "double_block", i)
