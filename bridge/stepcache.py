"""DitKitStepCache on ComfyUI: calibration-free step caches (first-block residual, sigma schedule) installed through
the same hooks as TeaCache (``bridge/teacache.install``: ``OUTER_SAMPLE`` + ``DIFFUSION_MODEL`` wrappers under the key
``ditkit_teacache``, ``patches_replace["dit"]`` block replaces / Z-Image's hooked layer list, chained with replaces
already on the clone). The decisions are the plain-torch ``cache/stepcache.py``.

Rank consistency (multi-GPU packs): a sequence-parallel wrapper may put a callable under
``transformer_options[REDUCER_KEY]`` of the model it samples; each run's state then passes the first-block sums
through it (an all-reduce) before deciding, so every rank takes the same decision. The sigma-schedule mode reads
nothing rank-local.
"""
from __future__ import annotations

import logging


from ..cache import coefficients as coef
from ..cache.stepcache import MODE_NAMES, MODES, StepCacheConfig, StepCacheState, resolve_thresholds
from ..errors import DitKitError
from ..parallel.reduce import as_reducer
from . import audio_watch
from . import teacache as tc
from .teacache import audio_latent_check
from .blocks import TeaCacheHolder

log = logging.getLogger("ditkit")

NODE_STEPCACHE = "DitKitStepCache"
REDUCER_KEY = "ditkit_stepcache_reducer"


def stepcache_holder(family: str, params: dict) -> tuple[TeaCacheHolder, str, dict]:
    """The holder DitKitStepCache installs, with the install report's summary and data. ``params``: ``mode``,
    ``threshold``, ``audio_threshold`` (negative = the mode's lab default), ``start_percent``, ``end_percent``,
    ``cache_device``, ``report_to``."""
    mode = params["mode"]
    if mode not in MODES:
        raise DitKitError(f"{NODE_STEPCACHE}: input 'mode' {mode!r} is not one of {list(MODES)}")
    if params["end_percent"] < params["start_percent"]:
        raise DitKitError(f"{NODE_STEPCACHE}: end_percent {params['end_percent']} < start_percent "
                          f"{params['start_percent']}")
    streams = tuple(coef.FAMILY_STREAMS[family])
    thresholds, notes = resolve_thresholds(mode, streams, params["threshold"], params["audio_threshold"])
    config = StepCacheConfig(family, mode, streams, thresholds, params["start_percent"], params["end_percent"],
                             params["cache_device"])
    holder = TeaCacheHolder(family, mode, state=StepCacheState(config), info=dict(params))
    summary = (f"Step cache ({MODE_NAMES[mode]}) on {coef.FAMILY_NAMES[family]}: thresholds {thresholds}"
               + (f" ({'; '.join(notes)})" if notes else "")
               + f", steps {params['start_percent']:.2f}-{params['end_percent']:.2f}, cache on {params['cache_device']}"
               + ", no calibration (calibrated TeaCache is the upgrade)")
    data = {"family": family, "mode": mode, "thresholds": thresholds, "defaults_used": notes,
            "streams": list(streams)}
    return holder, summary, data


def stepcache_sample_wrapper(executor, *args, **kwargs):
    """``OUTER_SAMPLE``: a fresh state per sampling run (cloned holder), the reducer of this run, the report."""
    guider, orig, holder = tc._sampling_begin(executor, args)
    sigmas = args[3]
    try:
        reducer = guider.model_options["transformer_options"].get(REDUCER_KEY)
        try:
            holder.state.reducer = as_reducer(reducer)
        except TypeError as e:
            raise DitKitError(f"{NODE_STEPCACHE}: transformer_options['{REDUCER_KEY}']: {e}") from None
        holder.begin(sigmas.flatten().tolist())
        args, aw = audio_watch.watch(args, kwargs, holder.family)
        out = executor(*args, **kwargs)
        al = audio_latent_check(out, kwargs.get("latent_shapes"))
        holder.info["audio_latent"] = aw.finish(al) if aw is not None else al
        return out
    finally:
        try:
            if holder.state.calls:
                rep = holder.state.report()
                data = rep.as_dict()
                summary = rep.summary()
                al = holder.info.pop("audio_latent", None)
                if al is not None:
                    data["audio_latent"] = al
                    summary += audio_watch.summary_suffix(al)
                    audio_watch.remember(NODE_STEPCACHE, holder.info.get("node_id"), al)
                tc._sink(holder.info, NODE_STEPCACHE).send("stepcache", summary, data)
            holder.state.release()
        finally:
            guider.model_options = orig


def install(model, holder: TeaCacheHolder) -> None:
    """Install on ``model`` (a clone), refusing a second step cache."""
    tc.check_not_stacked(model, NODE_STEPCACHE)
    tc.install(model, holder, stepcache_sample_wrapper)


__all__ = ["audio_latent_check", "NODE_STEPCACHE", "REDUCER_KEY", "stepcache_holder", "stepcache_sample_wrapper", "install"]
