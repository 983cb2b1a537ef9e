"""Ray variants of ditkit's model patches, for Raylight's multi-GPU workers (registered only when Raylight is
importable; nothing changes without it).

Raylight holds one ModelPatcher per GPU inside Ray actors and passes ``RAY_ACTORS`` between its nodes; a patch
node runs on every actor through Raylight's ``@ray_patch``. Each node here runs the ordinary ditkit node on each
actor's model (same inputs, same checks, same report) and adds what sequence parallelism needs:

* ``DitKitRaySparseAttention``: VSA-H3 as Raylight's inner-attention processor ``ditkit:vsa_h3`` (Raylight's USP
  never calls ComfyUI's attention override, where the single-GPU node sits); Ulysses only, ring refused by name;
* ``DitKitRayAdaLNCache``: the AdaLN schedule tables (rank-invariant by construction: they depend on the sigma
  schedule and the weights only).
TeaCache and the FastH3 schedule have no Ray variant yet (docs/multigpu.md says why).
"""
from __future__ import annotations

import sys

from comfy_api.latest import io

from ..bridge import raylight as rl
from .adaln_cache import DitKitH3AdaLNCache
from .sparse_attention import DitKitSparseAttention

RAY_ACTORS = io.Custom("RAY_ACTORS")


def _base_inputs(base: type[io.ComfyNode]) -> list:
    """The base node's inputs except its MODEL (same names, defaults, checks and tooltips)."""
    return [inp for inp in base.GET_SCHEMA().inputs if inp.id != "model"]


def _sparse_patch(model, **kw):
    m = DitKitSparseAttention.execute(model=model, **kw).result[0]
    rl.set_processor(m, rl.VSAInnerAttention(gate_group=rl.LazyGroup(), ring_degree=rl.ring_degree))
    return m


def _adaln_patch(model, **kw):
    return DitKitH3AdaLNCache.execute(model=model, **kw).result[0]


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


def _setup() -> list[type[io.ComfyNode]]:
    if not rl.raylight_available():
        return []
    rl.register()
    rl.make_pickle_by_value(sys.modules[__name__.rsplit(".", 2)[0]])
    return [DitKitRaySparseAttention, DitKitRayAdaLNCache]


NODES = _setup()
