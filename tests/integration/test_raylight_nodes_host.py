"""The Ray variants of ditkit's patches in the real ComfyUI 0.33 host, driven through Raylight's protocol.

Raylight itself needs CUDA + NCCL actors and is not on PyPI, so this test stands in for exactly the three pieces of
its protocol ditkit touches (``../shared/reference/raylight.md``, read at commit 55ea37bb): the inner-attention
registry (``register_inner_attention(name)`` decorator, raising on a second registration), ``@ray_patch`` (the
decorated ``patch(self, model, ...)`` runs on every actor's model and the node returns ``(ray_actors,)``) and
``ray.cloudpickle.register_pickle_by_value``. The models on the "actors" are real tiny H3 ModelPatchers.
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest


@pytest.fixture()
def fake_raylight(monkeypatch):
    registered, by_value = {}, []

    def register_inner_attention(name):
        def deco(cls):
            if name in registered:
                raise ValueError(f"inner attention {name!r} already registered")
            registered[name] = cls
            return cls
        return deco

    class Actors:
        def __init__(self, models):
            self.models = models

    def ray_patch(fn):
        def wrapper(self, ray_actors, *a, **kw):
            ray_actors.models = [fn(self, m, *a, **kw) for m in ray_actors.models]
            return (ray_actors,)
        return wrapper

    def ray_patch_with_return(fn):      # actor 0 only; its model is not replaced
        def wrapper(self, ray_actors, *a, **kw):
            ray_actors.on_actor0 = getattr(ray_actors, "on_actor0", 0) + 1
            return fn(self, ray_actors.models[0], *a, **kw)
        return wrapper

    mods = {
        "raylight": types.ModuleType("raylight"),
        "raylight.distributed_modules": types.ModuleType("raylight.distributed_modules"),
        "raylight.distributed_modules.inner_attention": types.ModuleType("raylight.distributed_modules.inner_attention"),
        "raylight.distributed_modules.inner_attention.registry": types.SimpleNamespace(
            register_inner_attention=register_inner_attention),
        "raylight.comfy_extra_dist": types.ModuleType("raylight.comfy_extra_dist"),
        "raylight.comfy_extra_dist.ray_patch_decorator": types.SimpleNamespace(
            ray_patch=ray_patch, ray_patch_with_return=ray_patch_with_return),
        "ray": types.ModuleType("ray"),
        "ray.cloudpickle": types.SimpleNamespace(register_pickle_by_value=by_value.append),
    }
    mods["raylight"].__spec__ = importlib.machinery.ModuleSpec("raylight", None)
    mods["raylight.distributed_modules.inner_attention"].registry = mods[
        "raylight.distributed_modules.inner_attention.registry"]
    mods["ray"].cloudpickle = mods["ray.cloudpickle"]
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    yield types.SimpleNamespace(registered=registered, by_value=by_value, Actors=Actors)
    monkeypatch.undo()
    _reload_ray_nodes()   # back to this host's truth (no Raylight: no Ray nodes) for the tests that follow


def _reload_ray_nodes():
    import ditkit.nodes.raylight as mod

    return importlib.reload(mod)


def test_no_ray_nodes_without_raylight(comfy, monkeypatch):
    monkeypatch.setitem(sys.modules, "raylight", None)   # find_spec -> ValueError / not importable
    assert _reload_ray_nodes().NODES == []
    monkeypatch.undo()
    _reload_ray_nodes()


def test_ray_sparse_attention_installs_the_processor_on_every_actor(comfy, fake_raylight, tiny_ckpts):
    import comfy.sd

    from ditkit.bridge import raylight as rl
    from ditkit.bridge.attention import HOLDER_KEY

    mod = _reload_ray_nodes()
    assert [c.GET_SCHEMA().node_id for c in mod.NODES] == ["DitKitRaySparseAttention", "DitKitRayAdaLNCache",
                                                           "DitKitRayTeaCache", "DitKitRayFastH3Schedule"]
    assert fake_raylight.registered == {"ditkit:vsa_h3": rl.VSAInnerAttention}
    assert [m.__name__ for m in fake_raylight.by_value] == [mod.__name__.rsplit(".", 2)[0]]   # the pack, by value
    assert rl.register(sys.modules["raylight.distributed_modules.inner_attention.registry"]).endswith(
        "already registered")                                                  # a reload on an actor: no crash
    path = tiny_ckpts / "diffusion_models" / "h3_tiny_fasth3.safetensors"
    base = comfy.sd.load_diffusion_model(str(path))
    actors = fake_raylight.Actors([base, base.clone()])
    (out,) = mod.DitKitRaySparseAttention.execute(ray_actors=actors, recipe="custom", keep_percent=25.0).result
    assert out is actors and len(out.models) == 2
    for m in out.models:
        to = m.model_options["transformer_options"]
        assert isinstance(to[rl.OPTIONS_KEY], rl.VSAInnerAttention)
        assert to[HOLDER_KEY].runtime.cfg.keep == pytest.approx(0.25)
        assert m is not base
    inputs = {i.id for i in mod.DitKitRaySparseAttention.GET_SCHEMA().inputs}
    assert "ray_actors" in inputs and "model" not in inputs and "recipe" in inputs


def test_ray_sparse_attention_refuses_another_inner_attention_by_name(comfy, fake_raylight, tiny_ckpts):
    """Another inner-attention processor already set on an actor's model (Raylight's own, or another pack's via
    ``set_inner_attention``) is never replaced silently: refused naming its class and the key; the other model is
    left as it was."""
    import comfy.sd

    from ditkit.bridge import raylight as rl
    from ditkit.errors import DitKitError

    class OtherSparse:
        supports_ring = True

        def __call__(self, dense_attention, q, k, v, *, transformer_options=None, **kwargs):
            return dense_attention(q, k, v, **kwargs)

    mod = _reload_ray_nodes()
    base = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_fasth3.safetensors"))
    other = base.clone()
    theirs = OtherSparse()
    other.model_options.setdefault("transformer_options", {})[rl.OPTIONS_KEY] = theirs
    with pytest.raises(DitKitError) as e:
        mod.DitKitRaySparseAttention.execute(ray_actors=fake_raylight.Actors([other]), recipe="custom",
                                             keep_percent=25.0)
    assert f"already has Raylight inner attention {__name__}." in str(e.value)
    assert "OtherSparse (raylight_inner_attention)" in str(e.value)
    assert other.model_options["transformer_options"][rl.OPTIONS_KEY] is theirs
    (out,) = mod.DitKitRaySparseAttention.execute(ray_actors=fake_raylight.Actors([base.clone()]), recipe="custom",
                                                  keep_percent=25.0).result      # no other processor: installed
    assert isinstance(out.models[0].model_options["transformer_options"][rl.OPTIONS_KEY], rl.VSAInnerAttention)


def test_ray_adaln_cache_runs_the_node_on_every_actor(comfy, fake_raylight, tiny_ckpts):
    import comfy.sd

    mod = _reload_ray_nodes()
    base = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    actors = fake_raylight.Actors([base, base.clone()])
    (out,) = mod.DitKitRayAdaLNCache.execute(ray_actors=actors).result
    assert all(m is not base and m.model_options != base.model_options for m in out.models)


def test_ray_teacache_installs_the_rank_consistent_decision_on_every_actor(comfy, fake_raylight, tiny_ckpts):
    import comfy.sd

    from ditkit.bridge import raylight as rl
    from ditkit.bridge.blocks import HOLDER_KEY
    from ditkit.parallel.reduce import DistReducer

    mod = _reload_ray_nodes()
    base = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
    actors = fake_raylight.Actors([base, base.clone()])
    kw = dict(coefficients="shipped:h3_tiny_calibrated", threshold=0.2, audio_threshold=0.2, start_percent=0.0,
              end_percent=1.0, cache_device="model", strict=False)
    (out,) = mod.DitKitRayTeaCache.execute(ray_actors=actors, **kw).result
    holders = [m.model_options["transformer_options"][HOLDER_KEY] for m in out.models]
    assert len({id(h) for h in holders}) == 2                                  # one state per actor
    for m, h in zip(out.models, holders):
        assert isinstance(h.adapter, rl.ShardedH3Adapter) and isinstance(h.state.reducer, DistReducer)
        assert isinstance(h.state.reducer.sp_group, rl.LazyGroup) and h.state.reducer.world_group is None
        assert h.clone().adapter is h.adapter and h.clone().state.reducer is h.state.reducer   # kept per run
        assert m.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, rl.SHARD_WRAPPER_KEY)
    assert HOLDER_KEY not in base.model_options.get("transformer_options", {})
    inputs = [i.id for i in mod.DitKitRayTeaCache.GET_SCHEMA().inputs]
    assert inputs[0] == "ray_actors" and "model" not in inputs and "coefficients" in inputs
    assert all(i.tooltip for i in mod.DitKitRayTeaCache.GET_SCHEMA().inputs)
    assert isinstance(mod.DitKitRayTeaCache.validate_inputs(coefficients=None), str)


def test_ray_teacache_refuses_what_cannot_run_on_shards(comfy, fake_raylight, tiny_ckpts, monkeypatch):
    import comfy.sd

    from ditkit.bridge import raylight as rl
    from ditkit.bridge.blocks import HOLDER_KEY
    from ditkit.errors import CoefficientError, UnsupportedModelError

    _reload_ray_nodes()
    m = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors")).clone()
    holder = types.SimpleNamespace(family="ltxav", state=None)
    m.model_options.setdefault("transformer_options", {})[HOLDER_KEY] = holder
    with pytest.raises(UnsupportedModelError, match="DitKitRayTeaCache: only MiniMax H3.*ltxav"):
        rl.shard_teacache(m, "DitKitRayTeaCache")
    holder.family = "h3"
    with pytest.raises(CoefficientError, match="DitKitRayTeaCache: coefficients: .*Calibrate"):
        rl.shard_teacache(m, "DitKitRayTeaCache")


def test_ray_fasth3_schedule_shifts_every_actor_and_returns_actor_0s_sigmas(comfy, fake_raylight, tiny_ckpts):
    import comfy.sd
    import torch

    from ditkit.nodes.fasth3 import DitKitFastH3Schedule

    mod = _reload_ray_nodes()
    base = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_fasth3.safetensors"))
    actors = fake_raylight.Actors([base, base.clone()])
    out, sigmas = mod.DitKitRayFastH3Schedule.execute(ray_actors=actors, recipe="fasth3_preview_4step",
                                                      contract_file="").result
    ref_model, ref_sigmas = DitKitFastH3Schedule.execute(model=base, recipe="fasth3_preview_4step",
                                                         contract_file="").result
    assert out is actors and actors.on_actor0 == 1                       # the ladder: computed once, on actor 0
    assert torch.equal(sigmas, ref_sigmas) and sigmas.shape == (5,)      # 4 rungs + the final 0
    want = {k: v for k, v in ref_model.model_options["transformer_options"].items() if "sigma_shift" in k}
    assert want and all(m is not base for m in out.models)
    for m in out.models:                                                 # the shifts: on every actor's model
        assert {k: v for k, v in m.model_options["transformer_options"].items() if "sigma_shift" in k} == want
    schema = mod.DitKitRayFastH3Schedule.GET_SCHEMA()
    assert [o.io_type for o in schema.outputs] == ["RAY_ACTORS", "SIGMAS"]
    assert [i.id for i in schema.inputs] == ["ray_actors", "recipe", "contract_file"]
