"""Ray variants of ditkit's model patches, for Raylight's multi-GPU workers (registered only when Raylight is
importable; nothing changes without it).

Raylight holds one ModelPatcher per GPU inside Ray actors and passes ``RAY_ACTORS`` between its nodes; a patch
node runs on every actor through Raylight's ``@ray_patch``. Each node here runs the ordinary ditkit node on each
actor's model (same inputs, same checks) and adds what sequence parallelism needs; the run reports of the sparse
attention and TeaCache come from rank 0 alone and carry every rank's figures (``bridge/raylight.RankTarget``):

* ``DitKitRaySparseAttention``: VSA-H3 as Raylight's inner-attention processor ``ditkit:vsa_h3`` (Raylight's USP
  never calls ComfyUI's attention override, where the single-GPU node sits); Ulysses only, ring refused by name;
* ``DitKitRayAdaLNCache``: the AdaLN schedule tables (rank-invariant by construction: they depend on the sigma
  schedule and the weights only);
* ``DitKitRayTeaCache``: TeaCache deciding on the rank's shard through the rank reducer: the target streams' rows
  placed by each forward's unpadded layout (Raylight's pad rows excluded), the metric's sums all-reduced over the
  Ulysses group and the skip MIN-reduced over all ranks, so every rank makes the single-process decision.
* ``DitKitRayFastH3Schedule``: the recipe's per-stream shifts set on every actor's model (``@ray_patch``) and the
  shifted video ladder computed on actor 0 (``@ray_patch_with_return``, as Raylight's own schedulers), for
  Raylight's ``XFuserSamplerCustom`` / ``XFuserSamplerCustomAdvanced``.
Adapters have no Ray variant: Raylight applies LoRAs in its own loader path (``RayLoraLoader`` -> ``RayUNETLoader``),
which is the only place the weights are whole before FSDP shards them (docs/multigpu.md).
"""
from __future__ import annotations

import sys

from comfy_api.latest import io

from ..bridge import raylight as rl
from .adaln_cache import DitKitH3AdaLNCache
from .fasth3 import DitKitFastH3Schedule
from .sparse_attention import DitKitSparseAttention
from .teacache import DitKitTeaCache

RAY_ACTORS = io.Custom("RAY_ACTORS")


def _base_inputs(base: type[io.ComfyNode]) -> list:
    """The base node's inputs except its MODEL (same names, defaults, checks and tooltips)."""
    return [inp for inp in base.GET_SCHEMA().inputs if inp.id != "model"]


def _sparse_patch(model, **kw):
    m = DitKitSparseAttention.execute(model=model, **kw).result[0]
    rl.set_processor(m, rl.VSAInnerAttention(gate_group=rl.LazyGroup(), ring_degree=rl.ring_degree))
    rl.vsa_reports_from_rank0(m)
    return m


def _adaln_patch(model, **kw):
    return DitKitH3AdaLNCache.execute(model=model, **kw).result[0]


def _teacache_patch(model, **kw):
    m = DitKitTeaCache.execute(model=model, **kw).result[0]
    rl.shard_teacache(m, "DitKitRayTeaCache", sp_group=rl.LazyGroup(), device=getattr(m, "load_device", None))
    rl.teacache_reports_from_rank0(m)
    return m


class DitKitRaySparseAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DitKitRaySparseAttention",
            display_name="VSA-H3 Sparse Attention for Raylight (ditkit)",
            category="ditkit/attention",
            description=("DitKitSparseAttention on every Raylight actor, run as Raylight's inner attention after "
                         "the Ulysses all-to-all (bit-identical to one GPU). Ring attention is refused by name."),
            search_aliases=["raylight sparse attention", "multi gpu vsa", "ray vsa"],
            inputs=[RAY_ACTORS.Input("ray_actors", tooltip="Raylight's actors (from its model loader): one model per GPU."),
                    *_base_inputs(DitKitSparseAttention)],
            outputs=[RAY_ACTORS.Output(tooltip="The actors, each model with VSA-H3 installed.")],
        )

    @classmethod
    def execute(cls, ray_actors, **kw) -> io.NodeOutput:
        return io.NodeOutput(*rl.run_on_actors(ray_actors, _sparse_patch, **kw))


class DitKitRayAdaLNCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DitKitRayAdaLNCache",
            display_name="H3 AdaLN Cache for Raylight (ditkit)",
            category="ditkit/cache",
            description="DitKitH3AdaLNCache on every Raylight actor (the tables are the same on every rank).",
            search_aliases=["raylight adaln cache", "multi gpu adaln"],
            inputs=[RAY_ACTORS.Input("ray_actors", tooltip="Raylight's actors (from its model loader): one model per GPU."),
                    *_base_inputs(DitKitH3AdaLNCache)],
            outputs=[RAY_ACTORS.Output(tooltip="The actors, each model with the AdaLN cache installed.")],
        )

    @classmethod
    def execute(cls, ray_actors, **kw) -> io.NodeOutput:
        return io.NodeOutput(*rl.run_on_actors(ray_actors, _adaln_patch, **kw))


class DitKitRayTeaCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DitKitRayTeaCache",
            display_name="TeaCache Step Cache for Raylight (ditkit)",
            category="ditkit/cache",
            description=("DitKitTeaCache on every Raylight actor (MiniMax H3), deciding identically on every rank: "
                         "the change metric summed over all ranks' shards (Raylight's padding excluded), the skip "
                         "agreed by all ranks, so the ranks never disagree (which would deadlock them) and decide "
                         "as one GPU would. Experimental like DitKitTeaCache."),
            search_aliases=["raylight teacache", "multi gpu teacache", "ray teacache"],
            is_experimental=True,
            inputs=[RAY_ACTORS.Input("ray_actors", tooltip="Raylight's actors (from its model loader): one model per GPU."),
                    *_base_inputs(DitKitTeaCache)],
            outputs=[RAY_ACTORS.Output(tooltip="The actors, each model with the rank-consistent TeaCache installed.")],
        )

    @classmethod
    def validate_inputs(cls, coefficients=None):
        return DitKitTeaCache.validate_inputs(coefficients=coefficients)

    @classmethod
    def execute(cls, ray_actors, **kw) -> io.NodeOutput:
        return io.NodeOutput(*rl.run_on_actors(ray_actors, _teacache_patch, **kw))


def _fasth3_patch(model, **kw):
    return DitKitFastH3Schedule.execute(model=model, **kw).result[0]


def _fasth3_sigmas(model, **kw):
    return DitKitFastH3Schedule.execute(model=model, **kw).result[1]


class DitKitRayFastH3Schedule(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        base = DitKitFastH3Schedule.GET_SCHEMA()
        return io.Schema(
            node_id="DitKitRayFastH3Schedule",
            display_name="FastH3 Schedule for Raylight (ditkit)",
            category="ditkit/sampling",
            description=("DitKitFastH3Schedule on every Raylight actor: the recipe's video/audio shifts set on each "
                         "actor's model, and the shifted video sigmas (computed on actor 0) for Raylight's XFuser "
                         "custom samplers."),
            search_aliases=["raylight fasth3 schedule", "multi gpu fasth3", "ray fasth3 sigmas"],
            inputs=[RAY_ACTORS.Input("ray_actors", tooltip="Raylight's actors (from its model loader): one model per GPU."),
                    *_base_inputs(DitKitFastH3Schedule)],
            outputs=[RAY_ACTORS.Output(tooltip="The actors, each model with the recipe's video/audio shifts set."),
                     io.Sigmas.Output(display_name="sigmas", tooltip=base.outputs[1].tooltip)],
        )

    @classmethod
    def execute(cls, ray_actors, **kw) -> io.NodeOutput:
        (actors,) = rl.run_on_actors(ray_actors, _fasth3_patch, **kw)
        return io.NodeOutput(actors, rl.run_on_actor0(actors, _fasth3_sigmas, **kw))


def _setup() -> list[type[io.ComfyNode]]:
    if not rl.raylight_available():
        return []
    rl.register()
    rl.make_pickle_by_value(sys.modules[__name__.rsplit(".", 2)[0]])
    return [DitKitRaySparseAttention, DitKitRayAdaLNCache, DitKitRayTeaCache, DitKitRayFastH3Schedule]


NODES = _setup()
