"""Block-stack hooks shared by TeaCache and its calibration: ComfyUI's block-replace and wrapper conventions.

Host layer (moved from ``cache/hooks.py``): the argument dicts ComfyUI passes to ``patches_replace["dit"]`` block
replaces, the ``DIFFUSION_MODEL`` wrapper's arguments and the blocks' module structure per family are known here;
the decisions and the residual cache are the plain-torch ``cache/teacache.py`` / ``cache/calibrate.py``.

The nodes install, on a model clone:

* a ``DIFFUSION_MODEL`` wrapper (:func:`diffusion_model_wrapper`): per model call it reads the condition
  keys (``transformer_options["uuids"]``), the current sigma and the sampler's schedule, and publishes a
  :class:`CallCtx` under ``transformer_options[CALL_KEY]`` for the block hooks of that call;
* one block replace per block of the stack (``patches_replace["dit"][("double_block"|"single_block", i)]``,
  built by :func:`make_block_replace`). The first block of the stack measures the modulated input and decides;
  on a skip every block returns its input unchanged and the last one adds the cached residual; on a compute
  the first block snapshots the stack input and the last one stores ``output - input``.

Z-Image's NextDiT (ComfyUI 0.33) has no ``patches_replace["dit"]`` in its main layer loop, so for it the
node object-patches ``diffusion_model.layers`` with :class:`HookedLayers`: a ``ModuleList`` holding the
very same block modules (identical state-dict keys, so weight patches/offload are untouched) whose iteration
yields callables that route each layer call through the same replace protocol.

The "modulated input" per family (block 0 of the stack, before attention):

* H3: ``norm1(h) * (1 + scale_msa[row]) + shift_msa[row]`` with ``(shift, scale)`` = chunks 0/1 of block 0's
  ``adaln_proj(t_emb)``; per stream on the target rows: ``mod_segments[-1]`` = video, ``mod_segments[-2]`` =
  audio (ComfyUI packs the target audio then the target video as the last two segments);
* LTX-2: ``rms_norm(vx) * (1 + vscale_msa) + vshift_msa`` from block 0's ``scale_shift_table`` + video
  timestep (ada params 0:2), and the same on ``ax`` with ``audio_scale_shift_table`` + audio timestep;
* FLUX.2: ``LayerNorm(img) * (1 + mod1.scale) + mod1.shift`` on the image tokens, ``mod1`` = the global
  ``double_stream_modulation_img`` output (FLUX.1-style per-block ``img_mod`` when there is no global one);
* Z-Image: ``attention_norm1(x) * (1 + scale_msa)`` of layer 0 (no shift term), ``scale_msa`` = chunk 0 of
  ``adaLN_modulation(adaln_input)``, over the joint [caption | image] sequence that layer 0 receives.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import torch.nn.functional as F

from ..cache.calibrate import CalibrationRecorder
from ..cache.stepcache import StepCacheState
from ..cache.teacache import TeaCacheState

HOLDER_KEY = "ditkit_teacache"
CALL_KEY = "ditkit_teacache_call"
MEMO_KEY = "ditkit_h3_modulation"          # transformer_options key: this forward's ModulationMemo (H3)
MEMO_WRAPPER_KEY = "ditkit_h3_modulation"  # key of the DIFFUSION_MODEL wrapper that creates it


# ================================================================================================ H3 modulation memo

class ModulationMemo:
    """H3: ``blocks[i].adaln_proj(t_emb)`` of ONE DiT forward, computed once and shared by TeaCache's skip decision
    (block 0), the FastH3 gate replace (each gated block) and the block itself (:func:`h3_block_forward`).

    Created per forward by :func:`memo_wrapper` in the forward's own copy of ``transformer_options`` and cleared in
    its ``finally``, so no state outlives a forward, a sampling run or a clone. An entry is reused only for the very
    same block module and ``t_emb`` tensor (object identity of live objects held here, not ``id()`` numbers); the
    block's own run takes it out (nothing reads it after the block)."""

    __slots__ = ("_mods", "computed")

    def __init__(self):
        self._mods: dict[int, tuple[Any, torch.Tensor, tuple]] = {}
        self.computed = 0

    def get(self, idx: int, blk, t_emb: torch.Tensor) -> tuple:
        hit = self._mods.get(idx)
        if hit is not None and hit[0] is blk and hit[1] is t_emb:
            return hit[2]
        mods = blk.adaln_proj(t_emb)
        self._mods[idx] = (blk, t_emb, mods)
        self.computed += 1
        return mods

    def take(self, idx: int, blk, t_emb: torch.Tensor) -> tuple:
        mods = self.get(idx, blk, t_emb)
        self._mods.pop(idx, None)
        return mods

    def clear(self) -> None:
        self._mods.clear()


def block_modulation(args: dict, blk, idx: int) -> tuple:
    """Block ``idx``'s ``adaln_proj(t_emb)`` for a ``("double_block", idx)`` replace: from this forward's memo when
    there is one, else computed (the block will compute it again)."""
    memo = (args.get("transformer_options") or {}).get(MEMO_KEY)
    if memo is None:
        return blk.adaln_proj(args["t_emb"])
    return memo.get(idx, blk, args["t_emb"])


def h3_block_forward(blk, mods: tuple, args: dict) -> torch.Tensor:
    """ComfyUI's ``comfy.ldm.minimax.model.DiTBlock.forward`` on an already computed modulation ``mods`` (the
    same operations in the same order: bit-identical, ``tests/integration/test_h3_modulation_memo_host.py``).

    The attention is ``args["attention"]`` when a replace earlier in the chain passed one (0.35+:
    ``DiTBlock.forward(..., attention=None)``, core's sparse node and other packs), else ``blk.attn``
    (``hostcompat.block_attention``): another pack's attention is never dropped."""
    from comfy.ldm.minimax.model import _mod_gate, _mod_scale_shift

    from .hostcompat import block_attention

    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
    x, segs, to = args["img"], args["mod_segments"], args["transformer_options"]
    attention = block_attention(args, blk)
    h = _mod_scale_shift(blk.norm1(x), shift_msa, scale_msa, segs)
    x = _mod_gate(x, gate_msa, attention(h, rope_freqs=args["rope_freqs"], transformer_options=to), segs)
    h = _mod_scale_shift(blk.norm2(x), shift_mlp, scale_mlp, segs)
    return _mod_gate(x, gate_mlp, blk.mlp(h), segs)


def _plain_block(blk) -> bool:
    """``blk`` is ComfyUI's own ``DiTBlock`` with nothing observing its call (no module hooks on it, no global module
    hooks; a ``torch.compile``-d or otherwise swapped block is another type): running its forward's body directly is
    then indistinguishable from calling it."""
    from comfy.ldm.minimax.model import DiTBlock

    mm = torch.nn.modules.module
    return (type(blk).forward is DiTBlock.forward and not blk._forward_hooks and not blk._forward_pre_hooks
            and not mm._global_forward_hooks and not mm._global_forward_pre_hooks)


def memo_extra(extra: dict, dm, idx: int) -> dict:
    """``extra`` for the rest of a block-replace chain, whose ``original_block`` runs ``dm.blocks[idx]`` (looked up
    when it runs) on this forward's memoised modulation (:func:`h3_block_forward`). Without a memo in the forward,
    or when the block is not a plain ComfyUI ``DiTBlock`` (:func:`_plain_block`), ComfyUI's own call runs."""
    orig = extra["original_block"]
    if getattr(orig, "_ditkit_memo", False):
        return extra

    def original_block(args):
        to = args.get("transformer_options") or {}
        memo = to.get(MEMO_KEY)
        blk = dm.blocks[idx]
        note_attention(to, args.get("attention"))
        if memo is None or not _plain_block(blk):
            return orig(args)
        return {"img": h3_block_forward(blk, memo.take(idx, blk, args["t_emb"]), args)}

    original_block._ditkit_memo = True
    return dict(extra, original_block=original_block)


def note_attention(transformer_options: dict, attention) -> None:
    """Count, for the running TeaCache / calibration run, a block call that ran another patch's attention
    (``args["attention"]``), by who made it (its report says which attention ran)."""
    if attention is None:
        return
    ctx = (transformer_options or {}).get(CALL_KEY)
    if ctx is None:
        return
    from .hostcompat import foreign_attention_name

    seen = ctx.holder.attention_seen
    name = foreign_attention_name(attention)
    seen[name] = seen.get(name, 0) + 1


def memo_wrapper(executor, *args, **kwargs):
    """``DIFFUSION_MODEL`` wrapper (H3): a fresh :class:`ModulationMemo` under ``MEMO_KEY`` in this forward's own
    copy of ``transformer_options``, cleared when the forward ends. Nested installs reuse the outer one."""
    to = args[3] if len(args) > 3 else kwargs.get("transformer_options")
    if not isinstance(to, dict) or MEMO_KEY in to:
        return executor(*args, **kwargs)
    memo = ModulationMemo()
    to = dict(to)
    to[MEMO_KEY] = memo
    if len(args) > 3:
        args = args[:3] + (to,) + tuple(args[4:])
    else:
        kwargs["transformer_options"] = to
    try:
        return executor(*args, **kwargs)
    finally:
        memo.clear()


def install_memo(m, dm) -> bool:
    """Install :func:`memo_wrapper` on the clone ``m`` (once) when every block of ``dm`` is ComfyUI's own
    ``DiTBlock`` (whose forward :func:`h3_block_forward` repeats); returns whether it is installed. A model with
    other block classes keeps computing the modulation in each place (same outputs, no memo)."""
    import comfy.patcher_extension as pe
    from comfy.ldm.minimax.model import DiTBlock

    if not all(type(b).forward is DiTBlock.forward for b in dm.blocks):
        return False
    if not m.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, MEMO_WRAPPER_KEY):
        m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, MEMO_WRAPPER_KEY, memo_wrapper)
    return True


# ================================================================================================ adapters

def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    b = t.shape[0] // n
    return [t[i * b:(i + 1) * b] for i in range(n)]


class Adapter:
    family = ""

    def stack(self, model) -> list[tuple[str, int]]:
        raise NotImplementedError

    def modulated_inputs(self, model, args: dict, n: int, ctx: "CallCtx") -> dict[str, list[torch.Tensor]]:
        raise NotImplementedError

    def stack_input(self, args: dict, ctx: "CallCtx") -> list[torch.Tensor]:
        raise NotImplementedError

    def output_parts(self, out: dict, ctx: "CallCtx") -> list[torch.Tensor]:
        raise NotImplementedError

    def pack_output(self, parts: list[torch.Tensor], out: dict, ctx: "CallCtx") -> dict:
        raise NotImplementedError

    def identity(self, args: dict, kind: str) -> dict:
        return {"img": args["img"]}

    def block_extra(self, model, pos: int, extra: dict) -> dict:
        """``extra`` for running the block at stack position ``pos`` (H3: on this forward's memoised modulation)."""
        return extra

    def stream_outputs(self, out: dict, n: int, ctx: "CallCtx") -> dict[str, list[torch.Tensor]]:
        raise NotImplementedError

    def prepare(self, model, args: dict, ctx: "CallCtx") -> None:
        """Set what :meth:`stream_outputs` needs in ``ctx.meta`` from block 0's arguments (first-block cache,
        which does not compute the modulated input)."""


class H3Adapter(Adapter):
    family = "h3"

    def stack(self, model):
        return [("double_block", i) for i in range(len(model.blocks))]

    @staticmethod
    def _target_segments(mod_segments):
        if len(mod_segments) < 2:
            raise RuntimeError(f"H3 TeaCache: expected >= 2 modulation segments (target audio, target video), got {len(mod_segments)}")
        return mod_segments[-1], mod_segments[-2]

    def prepare(self, model, args, ctx):
        (va, vb, vrow), (aa, ab, arow) = self._target_segments(args["mod_segments"])
        ctx.meta["video_rows"] = (va, vb)
        ctx.meta["audio_rows"] = (aa, ab)
        exp = ctx.meta.get("expect_rows")
        if exp is not None and (vb - va, ab - aa) != exp:
            raise RuntimeError(f"H3 TeaCache: target segments have {(vb - va, ab - aa)} rows (video, audio), the latents imply {exp}")
        return vrow, arow

    def modulated_inputs(self, model, args, n, ctx):
        blk = model.blocks[0]
        h = args["img"]
        shift, scale = block_modulation(args, blk, 0)[:2]
        vrow, arow = self.prepare(model, args, ctx)
        (va, vb), (aa, ab) = ctx.meta["video_rows"], ctx.meta["audio_rows"]

        def mod(a, b, row):
            x = blk.norm1(h[a:b])
            return x * (1.0 + scale[row].to(x.dtype)) + shift[row].to(x.dtype)

        return {"video": [mod(va, vb, vrow)], "audio": [mod(aa, ab, arow)]}

    def block_extra(self, model, pos, extra):
        return memo_extra(extra, model, pos)

    def stack_input(self, args, ctx):
        return [args["img"].unsqueeze(0).clone()]

    def output_parts(self, out, ctx):
        return [out["img"].unsqueeze(0)]

    def pack_output(self, parts, out, ctx):
        return {"img": parts[0][0]}

    def stream_outputs(self, out, n, ctx):
        h = out["img"]
        va, vb = ctx.meta["video_rows"]
        aa, ab = ctx.meta["audio_rows"]
        return {"video": [h[va:vb]], "audio": [h[aa:ab]]}


def _ltx_ada(blk, table, batch, timestep, idx):
    return blk.get_ada_values(table, batch, timestep, idx)


class LTXAVAdapter(Adapter):
    family = "ltx2"

    def stack(self, model):
        return [("double_block", i) for i in range(len(model.transformer_blocks))]

    def modulated_inputs(self, model, args, n, ctx):
        blk = model.transformer_blocks[0]
        vx, ax = args["img"]
        vshift, vscale = _ltx_ada(blk, blk.scale_shift_table, vx.shape[0], args["v_timestep"], slice(0, 2))
        mv = F.rms_norm(vx, (vx.shape[-1],), eps=1e-6) * (1 + vscale) + vshift
        out = {"video": _chunks(mv, n)}
        if ax is not None and ax.numel() > 0:
            ashift, ascale = _ltx_ada(blk, blk.audio_scale_shift_table, ax.shape[0], args["a_timestep"], slice(0, 2))
            ma = F.rms_norm(ax, (ax.shape[-1],), eps=1e-6) * (1 + ascale) + ashift
            out["audio"] = _chunks(ma, n)
        return out

    def stack_input(self, args, ctx):
        vx, ax = args["img"]
        return [vx.clone(), ax.clone()]

    def output_parts(self, out, ctx):
        vx, ax = out["img"]
        return [vx, ax]

    def pack_output(self, parts, out, ctx):
        return {"img": (parts[0], parts[1])}

    def stream_outputs(self, out, n, ctx):
        vx, ax = out["img"]
        res = {"video": _chunks(vx, n)}
        if ax is not None and ax.numel() > 0:
            res["audio"] = _chunks(ax, n)
        return res


class Flux2Adapter(Adapter):
    family = "flux2"

    def stack(self, model):
        return ([("double_block", i) for i in range(len(model.double_blocks))]
                + [("single_block", i) for i in range(len(model.single_blocks))])

    def modulated_inputs(self, model, args, n, ctx):
        img = args["img"]
        if "txt" not in args:  # first block is a single block (no double blocks): joint [txt | img]
            raise RuntimeError("FLUX TeaCache needs at least one double block")
        vec = args["vec"]
        if isinstance(vec, (tuple, list)):
            mod1 = vec[0][0]
        else:
            mod1 = model.double_blocks[0].img_mod(vec)[0]
        scale, shift = mod1.scale, mod1.shift
        if scale.dim() == 3 and scale.shape[1] not in (1, img.shape[1]):
            scale, shift = scale[:, :1], shift[:, :1]  # timestep-zero reference layout: the noisy target's row
        m = F.layer_norm(img, (img.shape[-1],), eps=1e-6) * (1 + scale) + shift
        ctx.meta["txt_len"] = args["txt"].shape[1]
        return {"image": _chunks(m, n)}

    def prepare(self, model, args, ctx):
        if "txt" not in args:
            raise RuntimeError("FLUX step cache needs at least one double block")
        ctx.meta["txt_len"] = args["txt"].shape[1]

    def stack_input(self, args, ctx):
        return [torch.cat((args["txt"], args["img"]), dim=1)]

    def output_parts(self, out, ctx):
        if "txt" in out:  # last block is a double block
            return [torch.cat((out["txt"], out["img"]), dim=1)]
        return [out["img"]]

    def pack_output(self, parts, out, ctx):
        if "txt" in out:
            t = ctx.meta["txt_len"]
            return {"img": parts[0][:, t:], "txt": parts[0][:, :t]}
        return {"img": parts[0]}

    def identity(self, args, kind):
        if kind == "double_block":
            return {"img": args["img"], "txt": args["txt"]}
        return {"img": args["img"]}

    def stream_outputs(self, out, n, ctx):
        joint = self.output_parts(out, ctx)[0]
        return {"image": _chunks(joint[:, ctx.meta["txt_len"]:], n)}


class ZImageAdapter(Adapter):
    family = "zimage"

    def stack(self, model):
        return [("double_block", i) for i in range(len(model.layers))]

    def modulated_inputs(self, model, args, n, ctx):
        layer = model.layers[0]
        x = args["img"]
        adaln_input = args["adaln_input"]
        scale_msa = layer.adaLN_modulation(adaln_input).chunk(4, dim=1)[0]
        if scale_msa.shape[0] != x.shape[0]:  # omni/ref: timesteps doubled (ref half first)
            scale_msa = scale_msa[scale_msa.shape[0] - x.shape[0]:]
        m = layer.attention_norm1(x) * (1 + scale_msa.unsqueeze(1))
        return {"image": _chunks(m, n)}

    def stack_input(self, args, ctx):
        return [args["img"].clone()]

    def output_parts(self, out, ctx):
        return [out["img"]]

    def pack_output(self, parts, out, ctx):
        return {"img": parts[0]}

    def stream_outputs(self, out, n, ctx):
        return {"image": _chunks(out["img"], n)}


ADAPTERS: dict[str, Adapter] = {a.family: a for a in (H3Adapter(), LTXAVAdapter(), Flux2Adapter(), ZImageAdapter())}


# ================================================================================================ holder / ctx

@dataclass
class CallCtx:
    holder: "TeaCacheHolder"
    model: Any
    keys: list[Hashable]
    sigma: float
    force: str | None = None
    skip: bool = False
    snapshot: list[torch.Tensor] | None = None
    meta: dict = field(default_factory=dict)


class TeaCacheHolder:
    """What a model clone carries in ``transformer_options[HOLDER_KEY]``: the mode plus the per-sampling
    state (TeaCache) or recorder (calibration). :meth:`clone` returns a fresh holder for one sampling run."""

    MODES = ("teacache", "calibrate", "first_block", "sigma_schedule")

    def __init__(self, family: str, mode: str, state: TeaCacheState | StepCacheState | None = None,
                 recorder: CalibrationRecorder | None = None, info: dict | None = None):
        if mode not in self.MODES:
            raise ValueError(mode)
        self.family = family
        self.adapter = ADAPTERS[family]
        self.mode = mode
        self.state = state
        self.recorder = recorder
        self.info = dict(info or {})
        self.attention_seen: dict[str, int] = {}  # block calls that ran another patch's args["attention"], by maker

    def clone(self) -> "TeaCacheHolder":
        h = TeaCacheHolder(self.family, self.mode, self.state.clone() if self.state is not None else None,
                           CalibrationRecorder(self.family) if self.recorder is not None else None, self.info)
        h.adapter = self.adapter   # a sequence-parallel adapter (bridge/raylight.py) stays with the run
        return h

    def begin(self, sigmas, warnings=()):
        if self.state is not None:
            self.state.begin(sigmas, warnings)
        if self.recorder is not None:
            self.recorder.begin(sigmas)

    def ensure_schedule(self, sigmas):
        if sigmas is None:
            return
        if self.state is not None:
            self.state.ensure_schedule(sigmas)
        if self.recorder is not None and not self.recorder.sigmas:
            self.recorder.begin(sigmas)

    # ---- block protocol (what the state / recorder keeps lives across steps: allocated outside the host's malloc
    # graph, hostcompat.persistent_alloc)
    def on_first(self, ctx: CallCtx, args: dict) -> None:
        from .hostcompat import persistent_alloc

        with persistent_alloc():
            self._on_first(ctx, args)

    def on_last(self, ctx: CallCtx, out: dict) -> dict:
        from .hostcompat import persistent_alloc

        with persistent_alloc():
            return self._on_last(ctx, out)

    def _on_first(self, ctx: CallCtx, args: dict) -> None:
        n = len(ctx.keys)
        if self.mode == "sigma_schedule":
            parts = self.adapter.stack_input(args, ctx)
            ctx.skip = self.state.decide_schedule(ctx.keys, ctx.sigma, shapes=[tuple(p.shape[1:]) for p in parts],
                                                  force=ctx.force)
            ctx.snapshot = None if ctx.skip else parts
            return
        if self.mode == "first_block":   # block 0 runs first: decided in after_first
            self.adapter.prepare(ctx.model, args, ctx)
            ctx.meta["stream_in"] = {s: [t.detach().clone() for t in ts]
                                     for s, ts in self.adapter.stream_outputs(args, n, ctx).items()}
            return
        mods = self.adapter.modulated_inputs(ctx.model, args, n, ctx)
        if self.mode == "calibrate":
            self.recorder.record_inputs(ctx.keys, ctx.sigma, mods)
            return
        parts = self.adapter.stack_input(args, ctx)
        shapes = [tuple(p.shape[1:]) for p in parts]
        ctx.skip = self.state.decide(ctx.keys, ctx.sigma, mods, shapes=shapes, force=ctx.force)
        ctx.snapshot = None if ctx.skip else parts

    def after_first(self, ctx: CallCtx, out: dict, n_blocks: int) -> None:
        """First-block mode, after block 0 ran: its per-stream residual decides whether blocks 1.. run."""
        if self.mode != "first_block":
            return
        ins = ctx.meta.pop("stream_in")
        outs = self.adapter.stream_outputs(out, len(ctx.keys), ctx)
        res = {s: [o - i for o, i in zip(outs[s], ins[s])] for s in ins if s in outs}
        parts = [p.clone() for p in self.adapter.output_parts(out, ctx)]
        force = ctx.force or ("one block in the stack" if n_blocks < 2 else None)
        ctx.skip = self.state.decide_first_block(ctx.keys, ctx.sigma, res, shapes=[tuple(p.shape[1:]) for p in parts],
                                                 force=force, outputs=outs)
        ctx.snapshot = None if ctx.skip else parts

    def _on_last(self, ctx: CallCtx, out: dict) -> dict:
        if self.mode == "calibrate":
            self.recorder.record_outputs(self.adapter.stream_outputs(out, len(ctx.keys), ctx))
            return out
        if ctx.skip:
            parts = self.state.apply(ctx.keys, self.adapter.output_parts(out, ctx))
            return self.adapter.pack_output(parts, out, ctx)
        self.state.store(ctx.keys, ctx.snapshot, self.adapter.output_parts(out, ctx))
        ctx.snapshot = None
        return out


def make_block_replace(pos: int, n: int, kind: str, adapter: Adapter, prev: Callable | None = None) -> Callable:
    """Replace function for the block at stack position ``pos`` of ``n``. ``prev`` is a replace that was
    already installed for this block (e.g. a sparse-attention block replace): it is chained, not dropped."""

    def run_block(args, extra):
        if prev is not None:
            return prev(args, extra)
        return extra["original_block"](args)

    def replace(args, extra):
        ctx: CallCtx | None = (args.get("transformer_options") or {}).get(CALL_KEY)
        if ctx is None:
            return run_block(args, extra)
        holder = ctx.holder
        if pos == 0:
            ctx.meta["blocks_ran"] = True
            holder.on_first(ctx, args)
        out = adapter.identity(args, kind) if ctx.skip else run_block(args, adapter.block_extra(ctx.model, pos, extra))
        if pos == 0:
            holder.after_first(ctx, out, n)
        if pos == n - 1:
            out = holder.on_last(ctx, out)
        return out

    replace.ditkit_teacache = True
    return replace


class HookedLayers(torch.nn.ModuleList):
    """Z-Image: the model's own layer modules, iterated as callables that go through the replace protocol.
    Same children under the same names as the original ``ModuleList`` (state-dict keys unchanged)."""

    def __init__(self, layers, replaces: list[Callable]):
        mods = list(layers._modules.values()) if isinstance(layers, torch.nn.ModuleList) else list(layers)
        super().__init__(mods)
        object.__setattr__(self, "_ditkit_replaces", list(replaces))

    def __iter__(self):
        mods = list(self._modules.values())
        reps = self._ditkit_replaces
        for layer, rep in zip(mods, reps):
            yield _HookedLayerCall(layer, rep)


class _HookedLayerCall:
    __slots__ = ("layer", "rep")

    def __init__(self, layer, rep):
        self.layer = layer
        self.rep = rep

    def __call__(self, x, mask, freqs_cis, adaln_input=None, timestep_zero_index=None, transformer_options={}):
        layer = self.layer

        def original(args):
            return {"img": layer(args["img"], args["mask"], args["freqs_cis"], args["adaln_input"],
                                 timestep_zero_index=args["timestep_zero_index"],
                                 transformer_options=args["transformer_options"])}

        args = {"img": x, "mask": mask, "freqs_cis": freqs_cis, "adaln_input": adaln_input,
                "timestep_zero_index": timestep_zero_index, "transformer_options": transformer_options}
        return self.rep(args, {"original_block": original})["img"]

    def __getattr__(self, name):
        return getattr(self.layer, name)


# ================================================================================================ wrapper

def _find_transformer_options(args, kwargs) -> dict | None:
    to = kwargs.get("transformer_options")
    if isinstance(to, dict):
        return to
    for a in reversed(args):
        if isinstance(a, dict) and (HOLDER_KEY in a or "sigmas" in a):
            return a
    return None


def _context_id(ctx_tensor) -> str | None:
    try:
        flat = ctx_tensor.detach().reshape(-1)
        if flat.numel() > 65536:  # strided sample over the whole context (padding may sit at either end)
            flat = flat[::flat.numel() // 65536]
        v = flat.to(device="cpu", dtype=torch.float32).contiguous()
        return hashlib.sha1(v.numpy().tobytes() + str(tuple(ctx_tensor.shape)).encode()).hexdigest()[:16]
    except Exception:  # noqa: BLE001
        return None


def _overwritten(to: dict, ctx: CallCtx) -> None:
    """The forward ran without ditkit's first block replace: a node applied after ditkit replaced it instead of
    chaining it (core's BlockSparseAttention does). Refuse, naming both, rather than run without the cache."""
    from .hostcompat import CompositionError, patch_owner

    holder = ctx.holder
    node = "DitKitTeaCache" if holder.mode == "teacache" else "DitKitTeaCacheCalibrate"
    dit = ((to.get("patches_replace") or {}).get("dit") or {})
    fn = dit.get(holder.adapter.stack(ctx.model)[0])
    who = patch_owner(fn) if fn is not None else "a later patch"
    raise CompositionError(
        f"{node}'s block replaces did not run: they were overwritten by {who}, applied after {node}. Both were "
        f"installed but only one would run. Apply {who.split(' (')[0]} BEFORE {node} (then {node} chains it and its "
        "attention runs inside ditkit's blocks), or remove one of them.")


def diffusion_model_wrapper(executor, *args, **kwargs):
    """``WrappersMP.DIFFUSION_MODEL`` wrapper: publishes the per-call context for the block hooks."""
    to = _find_transformer_options(args, kwargs)
    holder: TeaCacheHolder | None = to.get(HOLDER_KEY) if to is not None else None
    if holder is None:
        return executor(*args, **kwargs)
    sigmas = to.get("sigmas")
    sigma = float(sigmas.flatten()[0]) if torch.is_tensor(sigmas) else float(sigmas or 0.0)
    holder.ensure_schedule(to.get("sample_sigmas"))
    cou = list(to.get("cond_or_uncond") or [0])
    uuids = list(to.get("uuids") or [])
    keys = uuids if len(uuids) == len(cou) and all(u is not None for u in uuids) else [f"cond{c}:{i}" for i, c in enumerate(cou)]
    ctx = CallCtx(holder, executor.class_obj, keys, sigma)
    x = args[0] if args else kwargs.get("x")
    if holder.family == "h3" and isinstance(x, (list, tuple)) and len(x) >= 2:
        v, a = x[0], x[1]
        ctx.meta["expect_rows"] = (v.shape[2] * ((v.shape[3] + 1) // 2) * ((v.shape[4] + 1) // 2), 2 * a.shape[-1])
    control = kwargs.get("control", args[6] if holder.family == "flux2" and len(args) > 6 else None)
    if control is not None:
        ctx.force = "controlnet present"
    if holder.mode == "calibrate" and 0 in cou and len(args) > 2 and torch.is_tensor(args[2]):
        chunk = _chunks(args[2], len(cou))[cou.index(0)]
        pid = _context_id(chunk)
        if pid:
            holder.recorder.add_prompt_id(pid)
    prev = to.get(CALL_KEY)
    to[CALL_KEY] = ctx
    try:
        out = executor(*args, **kwargs)
        if not ctx.meta.get("blocks_ran"):
            _overwritten(to, ctx)
        return out
    finally:
        if prev is None:
            to.pop(CALL_KEY, None)
        else:
            to[CALL_KEY] = prev
