"""Exact feed-forward chunking on ComfyUI (core: ``memory/chunking.py``).

The node (``nodes/activation_chunking.py``) object-patches, on a clone, every block's feed-forward module with a
:class:`ChunkedFeedForward`: the same child modules registered under the same names (so weight patches keyed
``...mlp.fc1.weight``, LoRA / adapter patches, quantized layers and ComfyUI's per-module casting and offload resolve
to the very modules the original uses) whose forward calls the original module on token chunks and writes the
chunks into one output. Blocks are not replaced and no forward is monkeypatched: TeaCache's block replaces, the H3
modulation memo (``bridge/blocks.py``, which runs ``blk.mlp(h)``), sparse attention and the AdaLN cache compose
unchanged.

Feed-forward sites per family (ComfyUI 0.33 module names):

* H3: ``blocks.{i}.mlp`` (fc1 -> SwiGLU -> fc2 on ``[S, D]``);
* LTX-2: ``transformer_blocks.{i}.ff`` and ``.audio_ff`` (``[B, S, D]``);
* Z-Image: ``layers.{i}.feed_forward`` (``[B, S, D]``);
* FLUX.2: ``double_blocks.{i}.img_mlp`` and ``.txt_mlp``; the single blocks fuse the MLP into ``linear1`` with the
  qkv projection and are not chunked (reported).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedModelError
from ..memory.chunking import apply_rows, auto_chunk, plan_chunks
from .contract import Probe, entry

WRAPPER_KEY = "ditkit_ffn_chunking"
NODE_ID = "DitKitActivationChunking"
AUTO_FRACTION = 0.5     # auto: intermediates of one chunk use at most half of the memory free at that call


def ff_sites(family: str, dm) -> list[tuple[str, int]]:
    """``[(object-patch key, inner width of the intermediate)]`` of the family's feed-forwards."""
    if family == "h3":
        return [(f"diffusion_model.blocks.{i}.mlp", 3 * b.mlp.fc2.in_features) for i, b in enumerate(dm.blocks)]
    if family == "ltx2":
        out = []
        for i, b in enumerate(dm.transformer_blocks):
            for name in ("ff", "audio_ff"):
                mod = getattr(b, name, None)
                if mod is not None:
                    out.append((f"diffusion_model.transformer_blocks.{i}.{name}", 2 * mod.net[2].in_features))
        return out
    if family == "zimage":
        return [(f"diffusion_model.layers.{i}.feed_forward", 3 * b.feed_forward.w2.in_features)
                for i, b in enumerate(dm.layers)]
    if family == "flux2":
        out = []
        for i, b in enumerate(dm.double_blocks):
            for name in ("img_mlp", "txt_mlp"):
                mod = getattr(b, name)
                width = max(m.in_features for m in mod.modules() if isinstance(m, torch.nn.Linear))
                out.append((f"diffusion_model.double_blocks.{i}.{name}", 3 * width))
        return out
    raise UnsupportedModelError(f"{NODE_ID}: no feed-forward chunking for family {family!r}")


@dataclass
class ChunkStats:
    """Counters of one install (shared by its modules; the OUTER_SAMPLE wrapper reports the delta of a run)."""

    calls: int = 0
    chunked_calls: int = 0
    chunks: int = 0
    max_rows: int = 0
    last_chunk: int = 0
    chunk_sizes: set = field(default_factory=set)

    def snapshot(self) -> dict:
        return {"calls": self.calls, "chunked_calls": self.chunked_calls, "chunks": self.chunks}


class ChunkedFeedForward(torch.nn.Module):
    """A feed-forward computed on token chunks. Holds the original's children under their names; the original
    module itself is kept outside the module tree (no duplicate keys) and called per chunk."""

    def __init__(self, orig: torch.nn.Module, chunk: int | None, inter_bytes_per_elem_row: int, stats: ChunkStats):
        super().__init__()
        if orig._parameters or orig._buffers:
            raise UnsupportedModelError(
                f"{NODE_ID}: feed-forward {type(orig).__name__} holds its own parameters/buffers "
                f"({sorted(list(orig._parameters) + list(orig._buffers))}); chunking would not see their patches")
        for name, child in orig._modules.items():
            self.add_module(name, child)
        object.__setattr__(self, "_ditkit_orig", orig)
        self.chunk = chunk
        self.inter_width = int(inter_bytes_per_elem_row)
        object.__setattr__(self, "_ditkit_stats", stats)

    @property
    def original(self) -> torch.nn.Module:
        return self._ditkit_orig

    def _chunk_for(self, x: torch.Tensor) -> int:
        if self.chunk is not None:
            return self.chunk
        import comfy.model_management as mm

        rows = int(x.shape[-2]) * (int(x.shape[0]) if x.dim() == 3 else 1)
        free = int(mm.get_free_memory(x.device))
        per_row = self.inter_width * x.element_size() * (int(x.shape[0]) if x.dim() == 3 else 1)
        return auto_chunk(rows, per_row, int(free * AUTO_FRACTION))

    def forward(self, x, *args, **kwargs):
        if args or kwargs or not torch.is_tensor(x) or x.dim() < 2:
            return self._ditkit_orig(x, *args, **kwargs)
        chunk = self._chunk_for(x)
        st = self._ditkit_stats
        n = len(plan_chunks(int(x.shape[-2]), chunk))
        st.calls += 1
        st.max_rows = max(st.max_rows, int(x.shape[-2]))
        st.last_chunk = chunk
        if n > 1:
            st.chunked_calls += 1
            st.chunks += n
            st.chunk_sizes.add(chunk)
        return apply_rows(self._ditkit_orig, x, chunk)


def install(m, family: str, chunk: int | None, report=None) -> dict:
    """Object-patch every feed-forward of the clone ``m``; returns what was installed (for the node's report)."""
    import comfy.patcher_extension as pe

    from .models import diffusion_model

    dm = diffusion_model(m)
    stats = ChunkStats()
    replaced = 0
    sites = ff_sites(family, dm)
    for key, width in sites:
        orig = m.get_model_object(key)
        if isinstance(orig, ChunkedFeedForward):
            orig = orig.original
            replaced += 1
        m.add_object_patch(key, ChunkedFeedForward(orig, chunk, width, stats))
    topts = m.model_options.setdefault("transformer_options", {})
    heads = topts.get(ATTN_KEY)
    topts[WRAPPER_KEY] = {"family": family, "chunk": chunk, "stats": stats, "report": report,
                          "heads": heads if getattr(heads, "_ditkit_head_groups", False) else None}
    if not m.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY):
        m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)
    notes = []
    if family == "flux2":
        notes.append(f"{len(dm.single_blocks)} single blocks not chunked (MLP fused into linear1 with qkv)")
    return {"sites": len(sites), "replaced": replaced, "notes": notes, "stats": stats}


def installed_chunk(model) -> tuple[bool, int | None]:
    """(installed, chunk tokens or None for auto) of a MODEL: what the preflight's memory model uses."""
    info = (getattr(model, "model_options", {}) or {}).get("transformer_options", {}).get(WRAPPER_KEY)
    if not info:
        return False, None
    return True, info["chunk"]


def outer_sample_wrapper(executor, *args, **kwargs):
    """One sampling run: the run's counters (delta of the install's stats) reported to the node's badge."""
    guider = executor.class_obj
    info = guider.model_options.get("transformer_options", {}).get(WRAPPER_KEY)
    if not info:
        return executor(*args, **kwargs)
    st: ChunkStats = info["stats"]
    hg = info.get("heads")
    before = st.snapshot()
    h0 = (hg.calls, hg.grouped) if hg is not None else None
    try:
        return executor(*args, **kwargs)
    finally:
        target = info.get("report")
        if target is not None:
            after = st.snapshot()
            d = {k: after[k] - before[k] for k in after}
            how = f"{info['chunk']} tokens" if info["chunk"] is not None else f"auto (last {st.last_chunk} tokens)"
            summary = (f"run: {d['chunked_calls']}/{d['calls']} feed-forward calls chunked into {d['chunks']} chunks "
                       f"[{how}; largest call {st.max_rows} tokens]")
            data = {"run": d, "chunk": info["chunk"], "max_rows": st.max_rows}
            if hg is not None:
                summary += "; " + head_groups_summary(hg.calls - h0[0], hg.grouped - h0[1], hg.heads_per_call)
                data["attention"] = {"calls": hg.calls - h0[0], "grouped": hg.grouped - h0[1],
                                     "heads_per_call": hg.heads_per_call}
            target[1](target[0], NODE_ID, "activation_chunking", summary, data)


def head_groups_summary(calls: int, grouped: int, heads_per_call: int) -> str:
    """The run report's line on the attention head groups: how many attention calls ran in groups, and, when none
    did, that the setting had no effect (so a model whose attention calls are not packed ``[B, H, S, D]``
    self-attention, or one with no more heads than a group, is never reported as head-grouped)."""
    line = f"attention: {grouped}/{calls} calls in groups of {heads_per_call} heads"
    if grouped == 0:
        line += (" (no effect: no call was packed [B, H, S, D] self-attention without a mask and with more heads "
                 "than a group)" if calls else " (no effect: no attention call reached the head groups)")
    return line


@entry("comfy.ldm.minimax.model.MLP", nodes=(NODE_ID,), what="behaviour",
       doc="H3's MLP: children fc1/fc2 only, row-independent (chunked == whole)")
def _h3_mlp_probe() -> Probe:
    import comfy.ops
    from comfy.ldm.minimax.model import MLP

    torch.manual_seed(0)
    mlp = MLP(16, 32, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    if set(mlp._modules) != {"fc1", "fc2"} or mlp._parameters or mlp._buffers:
        return Probe.broken(f"MLP children are {sorted(mlp._modules)} with own params {sorted(mlp._parameters)}")
    x = torch.randn(64, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        if not torch.equal(apply_rows(mlp, x, 16), mlp(x)):
            return Probe.broken("MLP on 16-token chunks differs from the whole call")
    return Probe.holds()


@entry("comfy.model_patcher.ModelPatcher.add_object_patch", nodes=(NODE_ID,), what="signature",
       doc="object patches by dotted module path, resolved through ModuleList indices")
def _object_patch_probe() -> Probe:
    import inspect

    from comfy.model_patcher import ModelPatcher

    params = list(inspect.signature(ModelPatcher.add_object_patch).parameters)
    if params[:3] != ["self", "name", "obj"]:
        return Probe.broken(f"add_object_patch{params}")
    return Probe.holds()


ATTN_KEY = "optimized_attention_override"


class HeadGroupAttention:
    """An ``optimized_attention_override`` running packed self-attention (``skip_reshape`` ``[B, H, S, D]`` calls
    without a mask) over groups of ``heads_per_call`` heads, each group's output copied into one ``[B, H, S, D]``
    tensor: a backend that materialises scores (ComfyUI's ``attention_sub_quad`` / ``basic`` / ``split``) holds them
    for one group at a time. Heads are independent, so the numbers are the same. Other calls, and every call when
    the backend does not materialise scores, go through unchanged (to ``prev``, an override installed before this
    one, else ComfyUI's function)."""

    _ditkit_head_groups = True

    def __init__(self, heads_per_call: int, prev=None):
        self.heads_per_call = int(heads_per_call)
        self.prev = prev
        self.calls = 0
        self.grouped = 0

    def _down(self, func, q, k, v, heads, *a, **kw):
        if self.prev is not None:
            return self.prev(func, q, k, v, heads, *a, **kw)
        return func(q, k, v, heads, *a, **kw)

    def __call__(self, func, q, k, v, heads, *a, mask=None, skip_reshape=False, skip_output_reshape=False, **kw):
        self.calls += 1
        g = self.heads_per_call
        if (not skip_reshape or mask is not None or q.dim() != 4 or heads <= g or q.shape[1] != heads
                or k.shape[1] != heads or v.shape[1] != heads):
            return self._down(func, q, k, v, heads, *a, mask=mask, skip_reshape=skip_reshape,
                              skip_output_reshape=skip_output_reshape, **kw)
        self.grouped += 1
        out = None
        for s in range(0, heads, g):
            e = min(heads, s + g)
            part = self._down(func, q[:, s:e], k[:, s:e], v[:, s:e], e - s, *a, mask=None, skip_reshape=True,
                              skip_output_reshape=True, **kw)
            if out is None:
                out = part.new_empty((q.shape[0], heads) + tuple(part.shape[2:]))
            out[:, s:e].copy_(part)
            del part
        if skip_output_reshape:
            return out
        b, _, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, heads * d)


def install_head_groups(m, heads_per_call: int) -> str:
    """Chain a :class:`HeadGroupAttention` on the clone ``m`` (the override already there becomes its ``prev``).
    A sparse-attention override already installed is refused: it must see every head (install this node first)."""
    topts = m.model_options.setdefault("transformer_options", {})
    prev = topts.get(ATTN_KEY)
    if getattr(prev, "_ditkit_vsa", False):
        raise UnsupportedModelError(f"{NODE_ID}: DitKitSparseAttention is already on this model; put "
                                    "DitKitActivationChunking (with attention_heads_per_call) before it, so the sparse "
                                    "attention sees every head and passes its dense calls to the head groups")
    if getattr(prev, "_ditkit_head_groups", False):
        prev = prev.prev
    topts[ATTN_KEY] = HeadGroupAttention(heads_per_call, prev)
    return "chained after another override" if prev is not None else "installed"
