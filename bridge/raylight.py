"""ditkit's VSA-H3 inside Raylight's sequence-parallel workers (host layer; active only when Raylight is importable).

Raylight's USP replaces each block's ``attn.forward`` and calls xFuser attention directly, so ComfyUI's
``optimized_attention_override`` (ditkit's VSA everywhere else) is never called there: sampling would run dense with
no error. Raylight's plug-in point is its inner-attention registry (``raylight.distributed_modules.
inner_attention``, commit 55ea37bb; ``../shared/reference/raylight.md``): a processor registered under a
namespaced name is called by the dispatcher **after** yunchang's seq -> head all-to-all as
``processor(dense_attention, q, k, v, *, transformer_options, **ring_kwargs)`` with ``q, k, v`` BSHD
``[B, S_padded, H/N, D]`` and must return the same layout.

:class:`VSAInnerAttention` is that processor: it reads this forward's :class:`~..kernels.vsa_h3_runtime.ForwardCtx`
(made by ditkit's ``DIFFUSION_MODEL`` wrapper, which sees the full, unsplit inputs) and the run's holder from
``transformer_options``, slices off the rows beyond the layout's length (Raylight's zero padding, which dense
attention would attend: 0.107 max difference on a toy), runs VSA-H3 on this rank's heads, and restores the padding.
The FastH3 gate made by a block replace on the rank's *sequence* shard goes through the same seq -> head
all-to-all as q first (``gate_group``). Ring attention (ring degree > 1) is refused by name: VSA's tile selection
needs every key tile on the rank. Calls the processor cannot take (no ditkit context, another layout, a dense
step) run ``dense_attention`` and are counted, as the single-GPU override counts them; a dense step of a packed
forward gets the rows without Raylight's padding too (its dense attention would attend them), so it stays exact.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import BackendError, CoefficientError, UnsupportedModelError
from ..parallel.reduce import DistReducer, LazyGroup as _LazyGroup, RanksReport, gather_objects, resolve_group
from ..report import Report
from ..parallel.ulysses import padded_len, seq_to_head
from .attention import CTX_KEY, GATE_KEY, HOLDER_KEY, packed_layout
from .blocks import HOLDER_KEY as TC_HOLDER_KEY, H3Adapter, block_modulation

PROCESSOR_NAME = "ditkit:vsa_h3"
OPTIONS_KEY = "raylight_inner_attention"  # Raylight's transformer_options key for the processor (set_inner_attention)


class VSAInnerAttention:
    """Raylight inner-attention processor running ditkit's VSA-H3 on the rank's heads (Ulysses only)."""

    supports_ring = False  # Raylight raises at the first call when ring degree > 1; ditkit names itself too

    def __init__(self, gate_group: Optional[object] = None, ring_degree: Callable[[], int] = lambda: 1):
        self.gate_group = gate_group      # the Ulysses group the gate is all-to-all'd over (a LazyGroup on actors)
        self.ring_degree = ring_degree

    def __call__(self, dense_attention, q, k, v, *, transformer_options=None, **kwargs):
        if self.ring_degree() > 1:
            raise BackendError(f"{PROCESSOR_NAME}: Raylight ring attention (ring degree {self.ring_degree()}) cannot "
                               "run VSA-H3 (its tile selection needs every key tile on the rank); use Ulysses only "
                               "(ring degree 1) with DitKitSparseAttention")
        to = transformer_options or {}
        holder, ctx = to.get(HOLDER_KEY), to.get(CTX_KEY)
        reason = None
        if holder is None or ctx is None:
            reason = "not an H3 DiT forward"
        elif q.dim() != 4 or q.shape[1] < ctx.layout.seq_len:
            reason = "token refiner / non-packed"
        elif not ctx.sparse:
            reason = ctx.reason
        if reason is not None:
            packed = reason != "token refiner / non-packed" and ctx is not None
            if holder is not None:
                holder.runtime.dense_call(reason, ctx if packed else None)
            if packed and q.shape[1] > ctx.layout.seq_len:  # a dense step: Raylight's pad rows are not keys either
                return _restore_pad(dense_attention(*(t[:, :ctx.layout.seq_len] for t in (q, k, v)), **kwargs),
                                    q.shape[1])
            return dense_attention(q, k, v, **kwargs)
        n = ctx.layout.seq_len
        gate = to.get(GATE_KEY)
        if gate is not None:  # [1, H, S_shard, D] made on this rank's sequence shard -> [1, H/N, S, D] like q
            gate = seq_to_head(gate.transpose(1, 2), resolve_group(self.gate_group))[:, :n].transpose(1, 2)
        # BSHD -> the kernels' BHSD, padding rows dropped (they are not tokens of the layout)
        qh, kh, vh = (t[:, :n].transpose(1, 2) for t in (q, k, v))
        out = holder.runtime.attention(qh, kh, vh, ctx, gate=gate).transpose(1, 2)
        return _restore_pad(out, q.shape[1])


def _restore_pad(out: torch.Tensor, padded: int) -> torch.Tensor:
    """``out`` [B, n, H/N, D] back to Raylight's padded length with zero rows (they are sliced off after the
    inverse all-to-all)."""
    if out.shape[1] < padded:
        out = torch.cat([out, out.new_zeros(out.shape[0], padded - out.shape[1], *out.shape[2:])], dim=1)
    return out.contiguous()


def raylight_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("raylight") is not None
    except (ImportError, ValueError):
        return False


def register(registry=None) -> str:
    """Register :class:`VSAInnerAttention` under ``ditkit:vsa_h3`` in Raylight's inner-attention registry (once;
    a second call, e.g. a pack reloaded on an actor, is a no-op). ``registry``: the module holding
    ``register_inner_attention`` (Raylight's by default). Returns what happened, for the log."""
    if registry is None:
        from raylight.distributed_modules.inner_attention import registry  # noqa: F811  (Raylight's own)
    known = getattr(registry, "get_inner_attention", None) or getattr(registry, "get", None)
    try:
        if known is not None and known(PROCESSOR_NAME) is not None:
            return f"{PROCESSOR_NAME} already registered"
    except (KeyError, ValueError, LookupError):
        pass
    try:
        registry.register_inner_attention(PROCESSOR_NAME)(VSAInnerAttention)
    except (ValueError, KeyError) as e:  # Raylight raises on a second registration of the same name
        if PROCESSOR_NAME in str(e):
            return f"{PROCESSOR_NAME} already registered"
        raise
    return f"{PROCESSOR_NAME} registered"


def set_processor(model, processor: VSAInnerAttention) -> None:
    """Put the processor in the clone's ``transformer_options`` where Raylight's dispatcher looks for it. ditkit's
    own processor already there is replaced (the node applied again); another inner-attention processor (Raylight's
    own or another pack's, set with ``set_inner_attention``) is refused by name: VSA-H3 would take over its calls,
    and the two cannot both decide which keys each query sees."""
    topts = model.model_options.setdefault("transformer_options", {})
    prev = topts.get(OPTIONS_KEY)
    if prev is not None and not isinstance(prev, VSAInnerAttention):
        kind = f"{type(prev).__module__}.{type(prev).__qualname__}"
        raise UnsupportedModelError(f"DitKitRaySparseAttention: this model already has Raylight inner attention "
                                    f"{kind} ({OPTIONS_KEY}); ditkit's VSA-H3 would replace it. Use one of the two: "
                                    "remove the other node, or leave DitKitRaySparseAttention out")
    topts[OPTIONS_KEY] = processor


# ------------------------------------------------------------------------------------------- Raylight's actors
def ulysses_group():
    """xFuser's Ulysses process group on this actor (the group the gate's seq -> head all-to-all runs over), or a
    named refusal: never a guess."""
    try:
        from xfuser.core.distributed import parallel_state as ps
    except ImportError as e:
        raise BackendError(f"{PROCESSOR_NAME}: xFuser is not importable on this Raylight actor ({e})") from e
    for name in ("get_ulysses_parallel_group", "get_ulysses_group"):
        fn = getattr(ps, name, None)
        if fn is not None:
            return fn()
    sp = getattr(ps, "get_sp_group", None)
    group = getattr(sp(), "ulysses_group", None) if sp is not None else None
    if group is None:
        raise BackendError(f"{PROCESSOR_NAME}: this xFuser has no Ulysses group accessor ditkit knows "
                           "(get_ulysses_parallel_group / get_sp_group().ulysses_group); the FastH3 gate cannot be "
                           "exchanged. Set the sparse attention's gate to 'none' or use xfuser==0.4.5")
    return group


def ring_degree() -> int:
    try:
        from xfuser.core.distributed import parallel_state as ps
    except ImportError:
        return 1
    fn = getattr(ps, "get_ring_parallel_world_size", None)
    return int(fn()) if fn is not None else 1


class LazyGroup(_LazyGroup):
    """The Ulysses group, resolved on the actor at the first use (the groups exist only after Raylight
    initialised xFuser there)."""

    def __init__(self, resolve=ulysses_group):
        super().__init__(resolve)


def make_pickle_by_value(package_module) -> None:
    """ComfyUI imports the pack by file path (``custom_nodes.<folder>``), a name a Ray actor cannot import: the
    patch closures Raylight ships to the actors are made to carry ditkit's code by value instead."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(package_module)


def run_on_actors(ray_actors, patch, *args, **kwargs):
    """Run ``patch(model, *args, **kwargs)`` on every Raylight actor's model (Raylight's own ``@ray_patch``, which
    returns ``(ray_actors,)``)."""
    from raylight.comfy_extra_dist.ray_patch_decorator import ray_patch

    return ray_patch(lambda _self, model, *a, **kw: patch(model, *a, **kw))(None, ray_actors, *args, **kwargs)


# ------------------------------------------------------------------------------------ TeaCache on sequence shards
SHARD_KEY = "ditkit_sp_shard"         # transformer_options key: this forward's ShardPlan
SHARD_WRAPPER_KEY = "ditkit_sp_shard"


class ShardPlan:
    """Where this rank's sequence shard lies in this forward's packed sequence: the real (unpadded) length, the
    target streams' spans in it, this rank and the sequence-parallel degree (Raylight's split: the sequence
    zero-padded to a multiple of ``world``, rank ``r`` holding rows ``[r·shard, (r+1)·shard)``)."""

    def __init__(self, seq_len: int, spans: dict, rank: int, world: int):
        self.seq_len, self.spans, self.rank, self.world = seq_len, spans, rank, world
        self.shard = padded_len(seq_len, world) // world

    def local(self, a: int, b: int) -> tuple[int, int]:
        """The global rows ``[a, b)`` held here, in shard coordinates (an empty span when none)."""
        lo = self.rank * self.shard
        a2, b2 = min(max(a, lo), lo + self.shard), min(max(b, lo), lo + self.shard)
        return a2 - lo, max(a2, b2) - lo


def shard_plan_wrapper(executor, *args, **kwargs):
    """``DIFFUSION_MODEL`` wrapper (it sees the full inputs; Raylight splits inside ``_forward``): this forward's
    :class:`ShardPlan` from the unpadded packed layout, for the block-0 decision on the shard."""
    to = args[3] if len(args) > 3 else kwargs.get("transformer_options", {})
    holder = to.get(TC_HOLDER_KEY)
    if holder is None or not isinstance(holder.adapter, ShardedH3Adapter):
        return executor(*args, **kwargs)
    layout, _ = packed_layout(executor.class_obj, args, kwargs)
    segs = list(layout.segments)
    if len(segs) < 2 or segs[-1][2] != "video" or segs[-2][2] != "audio":
        raise BackendError(f"DitKitRayTeaCache: the packed H3 sequence does not end with the audio and video target "
                           f"spans ({[s[2] for s in segs]}); ditkit cannot place the streams on the shards")
    group = resolve_group(holder.state.reducer.sp_group)
    plan = ShardPlan(layout.seq_len, {"video": segs[-1][:2], "audio": segs[-2][:2]}, dist.get_rank(group),
                     dist.get_world_size(group))
    to = dict(to, **{SHARD_KEY: plan})
    if len(args) > 3:
        args = args[:3] + (to,) + tuple(args[4:])
    else:
        kwargs["transformer_options"] = to
    return executor(*args, **kwargs)


class ShardedH3Adapter(H3Adapter):
    """H3 TeaCache on a rank's sequence shard: the target video / audio streams' rows held by this rank, placed by
    this forward's :class:`ShardPlan` (never Raylight's pad rows, which lie beyond the real length) and modulated
    by the local segments covering them, so the reducer's sums over the ranks are the whole streams' sums."""

    def prepare(self, model, args, ctx):
        plan = (args.get("transformer_options") or {}).get(SHARD_KEY)
        if plan is None:
            raise BackendError("DitKitRayTeaCache: no shard plan in this forward (its DIFFUSION_MODEL wrapper did "
                               "not run); the decision would be made on a shard")
        (va, vb), (aa, ab) = plan.spans["video"], plan.spans["audio"]
        exp = ctx.meta.get("expect_rows")
        if exp is not None and (vb - va, ab - aa) != exp:
            raise RuntimeError(f"H3 TeaCache: target segments have {(vb - va, ab - aa)} rows (video, audio), the "
                               f"latents imply {exp}")
        ctx.meta["video_rows"], ctx.meta["audio_rows"] = plan.local(va, vb), plan.local(aa, ab)
        return None, None

    def modulated_inputs(self, model, args, n, ctx):
        blk, h, segs = model.blocks[0], args["img"], args["mod_segments"]
        shift, scale = block_modulation(args, blk, 0)[:2]
        self.prepare(model, args, ctx)

        def mod(a, b):
            parts = []
            for sa, sb, row in segs:
                x0, x1 = max(sa, a), min(sb, b)
                if x0 < x1:
                    r = row[x0 - sa:x1 - sa] if isinstance(row, torch.Tensor) else row
                    x = blk.norm1(h[x0:x1])
                    parts.append(x * (1.0 + scale[r].to(x.dtype)) + shift[r].to(x.dtype))
            if sum(p.shape[0] for p in parts) != b - a:
                raise BackendError(f"DitKitRayTeaCache: the shard's modulation segments do not cover rows {a}..{b}")
            return torch.cat(parts) if parts else h.new_zeros(0, h.shape[-1])

        return {"video": [mod(*ctx.meta["video_rows"])], "audio": [mod(*ctx.meta["audio_rows"])]}


def shard_teacache(m, who: str, sp_group=None, world_group=None, device=None) -> str:
    """Make the TeaCache installed on the clone ``m`` decide on Raylight's sequence shards: the sharded adapter,
    the rank reducer (sums over ``sp_group``, decision over ``world_group``) and the shard-plan wrapper. Returns
    the reducer's description for the report."""
    import comfy.patcher_extension as pe

    holder = m.model_options["transformer_options"][TC_HOLDER_KEY]
    if holder.family != "h3":
        raise UnsupportedModelError(f"{who}: only MiniMax H3 has a sequence-parallel TeaCache (got {holder.family})")
    if holder.state is None:
        raise CoefficientError(f"{who}: coefficients: a file a TeaCache Calibrate node of this workflow writes later "
                               "cannot be used on Raylight's actors (calibrate on one GPU; pick an existing file)")
    holder.adapter = ShardedH3Adapter()
    holder.state.reducer = DistReducer(sp_group=sp_group, world_group=world_group, device=device)
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, SHARD_WRAPPER_KEY, shard_plan_wrapper)
    return "sequence-parallel (metric sums over the Ulysses group without pad rows, decision MIN over all ranks)"


# ----------------------------------------------------------------------------------------------- rank-0 reports
def vsa_figures(data: dict) -> dict:
    """A rank's VSA-H3 run figures (from the runtime's report data)."""
    calls = data.get("calls") or {}
    return {"steps_sparse": data.get("steps_sparse"), "steps_dense": data.get("steps_dense"),
            "sparse_calls": calls.get("sparse", 0), "dense_calls": sum(v for k, v in calls.items() if k != "sparse"),
            "density": data.get("measured_density")}


VSA_AGREE = ("steps_sparse", "steps_dense", "sparse_calls", "dense_calls")


def teacache_figures(data: dict) -> dict:
    """A rank's TeaCache run figures (from its report data)."""
    return {"calls": data.get("calls"), "computed": data.get("computed"), "skipped": data.get("skipped")}


TEACACHE_AGREE = ("calls", "computed", "skipped")


class RankTarget:
    """A node's report sink on a Raylight actor (in place of its :class:`~.reports.ReportTarget`): every rank sends
    its run report once, the figures are gathered over ``group`` (all ranks by default) and rank 0 alone sends the
    node's report: its own, plus every rank's figures (:class:`~..parallel.reduce.RanksReport`), so one report
    says what each GPU did and whether the ranks agreed, instead of one per actor."""

    def __init__(self, target, figures: Callable[[dict], dict], must_agree: tuple = (), group=None):
        self.target, self.figures, self.must_agree, self.group = target, figures, tuple(must_agree), group

    def send(self, kind: str, summary, data: Optional[dict] = None) -> dict:
        if isinstance(summary, Report):
            data, summary = {**summary.as_dict(), **(data or {})}, summary.summary()
        every = gather_objects(self.figures(data or {}), self.group)
        if dist.get_rank(resolve_group(self.group)) != 0:
            return {}
        ranks = RanksReport(every, self.must_agree)
        return self.target.send(kind, f"{summary} | {ranks.summary()}", {**(data or {}), "ranks": ranks.as_dict()})


def vsa_reports_from_rank0(m) -> None:
    """The VSA-H3 run report of the clone ``m`` sent by rank 0 alone, with every rank's figures (its holder's
    ``on_run_end`` is ``functools.partial(send_run_report, target)``: the same, to a :class:`RankTarget`)."""
    import functools

    holder = m.model_options["transformer_options"][HOLDER_KEY]
    send = holder.on_run_end
    holder.on_run_end = functools.partial(send.func, RankTarget(send.args[0], vsa_figures, VSA_AGREE))


def teacache_reports_from_rank0(m) -> None:
    """The TeaCache run report of the clone ``m`` sent by rank 0 alone, with every rank's figures."""
    info = m.model_options["transformer_options"][TC_HOLDER_KEY].info
    info["report_to"] = RankTarget(info["report_to"], teacache_figures, TEACACHE_AGREE)


def run_on_actor0(ray_actors, fn, *args, **kwargs):
    """``fn(model, *args, **kwargs)`` on actor 0's model, its value returned (Raylight's own
    ``@ray_patch_with_return``, as its schedulers use it; the model itself is not replaced there)."""
    from raylight.comfy_extra_dist.ray_patch_decorator import ray_patch_with_return

    return ray_patch_with_return(lambda _self, model, *a, **kw: fn(model, *a, **kw))(None, ray_actors, *args, **kwargs)
