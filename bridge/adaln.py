"""H3 AdaLN schedule cache on ComfyUI: the per-run holder and its wrappers (core: ``cache/adaln.py``).

The node (``nodes/adaln_cache.py``) object-patches every ``adaln_proj`` of a clone with a lookup module bound to one
:class:`~ditkit.cache.adaln.AdalnScheduleCache` (the tables, shared by that clone and its clones: a later run whose
signature is the same reuses them) and puts an :class:`AdalnHolder` in ``transformer_options[HOLDER_KEY]``. As
ComfyUI's EasyCache does, the OUTER_SAMPLE wrapper gives each sampling run a clone of the holder (its own schedule,
patch identity, variants, built signature) in a cloned ``model_options`` and restores the original in ``finally``;
the DIFFUSION_MODEL wrapper reads the run's holder from the ``transformer_options`` it is called with. Two clones or
two runs therefore never see each other's run state.
"""
from __future__ import annotations

import torch

from ..cache.adaln import AdalnScheduleCache, check_schedule, fp32_bits
from . import audio_watch
from .fingerprint import adaln_patch_fingerprint, adaln_weight_fingerprint
from .reports import ReportTarget
from .hostcompat import persistent_alloc

WRAPPER_KEY = "ditkit_h3_adaln_cache"
HOLDER_KEY = WRAPPER_KEY          # transformer_options key of the AdalnHolder


class AdalnHolder:
    """What a clone carries in ``transformer_options[HOLDER_KEY]``. The fields set at install are shared by every
    clone; the run fields (``sigmas``, ``patch_fp``, ``variants``, ``built_for``) belong to one sampling run
    (:meth:`clone` gives a fresh holder for a run)."""

    def __init__(self, cache: AdalnScheduleCache, dm, model_sampling, report_to, park_mode: str):
        self.cache = cache
        self.dm = dm
        self.model_sampling = model_sampling
        self.report_to = report_to
        self.park_mode = park_mode
        self.sigmas: torch.Tensor | None = None
        self.patch_fp = ""
        self.variants: set = set()
        self.built_for: tuple | None = None
        self.in_run = False

    def clone(self) -> "AdalnHolder":
        return AdalnHolder(self.cache, self.dm, self.model_sampling, self.report_to, self.park_mode)


def _variant(payload: dict | None) -> tuple:
    """Which segment timesteps the forward uses (t2va / keyframes / refs) and their augmentation levels."""
    import comfy.ldm.minimax.model as h3

    payload = payload or {}
    layout = payload.get("layout")
    kinds = tuple(sorted({k for _, _, k in layout.segments})) if layout is not None else ("audio", "text", "video")
    vis = float(payload.get("visual_cond_noise_aug", h3.VISUAL_COND_TIMESTEP))
    aud = float(payload.get("audio_cond_noise_aug", h3.AUDIO_COND_TIMESTEP))
    return kinds, vis, aud


def predict_t_embs(dm, model_sampling, sigmas, variants, device, dtype, shift_v, shift_a) -> list[torch.Tensor]:
    """The ``t_emb`` tensors H3's forward will build for each schedule sigma (same ops, same device/dtype).

    A prediction that differs in any bit from the live tensor is simply never hit (the forward then reports a
    miss); it can never return a wrong value."""
    import comfy.ldm.minimax.model as h3
    import comfy.model_management

    out = []
    for s in sigmas:
        sig = torch.full((1,), float(s), dtype=torch.float32, device=device)
        timestep = model_sampling.timestep(sig).float()
        sigma_v = (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)
        t_v = float(1.0 - sigma_v)
        t_a = float(1.0 - h3.time_shift_sigma(sigma_v, shift_v, shift_a))
        for kinds, vis, aud in variants:
            seg_t = {"text": t_v, "video": t_v, "audio": t_a, "cond": max(t_v, vis), "ref_img": max(t_v, vis),
                     "cond_audio": max(t_a, aud), "ref_audio": max(t_a, aud)}
            unique_t = sorted({t_v, t_a} | {seg_t[k] for k in kinds if k in seg_t})
            t_vals = torch.tensor(unique_t, dtype=torch.float32, device=device)
            if dm.use_adaln_curves:
                table = comfy.model_management.cast_to(dm.adaln_t_table, device=device)
                pos = t_vals.clamp(0.0, 1.0) * (table.shape[0] - 1)
                i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
                t_emb = torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))
            else:
                t_emb = dm.time_embedder(t_vals).to(dtype)
            out.append(t_emb)
    return out


def wrap_projections(m, cache: AdalnScheduleCache, keys: list[str], originals: list) -> None:
    """Object-patch each AdaLN projection ``keys[i]`` of the clone ``m`` with its cache wrapper."""
    for k, o in zip(keys, originals):
        m.add_object_patch(k, cache.wrap(o, k.removeprefix("diffusion_model.")))


def install(m, cache: AdalnScheduleCache, dm, report_to, park: bool) -> dict:
    """Put the holder and the two wrappers on the clone ``m`` (object patches are the node's)."""
    import comfy.patcher_extension as pe

    park_mode = "device"
    dynamic = bool(getattr(m, "is_dynamic", lambda: False)())
    if not park:
        cache.park_enabled = False
        park_mode = "off (weights left where ComfyUI put them)"
    elif dynamic:
        # dynamic VRAM (aimdo): weights are faulted in per module at cast time; with table hits the AdaLN
        # linears are never called, so they are never faulted in. Moving them behind aimdo's back is not done.
        cache.park_enabled = False
        park_mode = "dynamic VRAM: not moved; never faulted in while tables hit"
    cache.stats.park_mode = park_mode
    holder = AdalnHolder(cache, dm, m.get_model_object("model_sampling"), report_to, park_mode)
    m.model_options.setdefault("transformer_options", {})[HOLDER_KEY] = holder
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper)
    return {"dynamic_vram": dynamic, "park_mode": park_mode}


def outer_sample_wrapper(executor, *args, **kwargs):
    """One sampling run: its own holder (a clone) in a cloned ``model_options``, restored in ``finally``."""
    import comfy.model_patcher

    guider = executor.class_obj
    orig = guider.model_options
    shared: AdalnHolder | None = orig.get("transformer_options", {}).get(HOLDER_KEY)
    if shared is None:
        return executor(*args, **kwargs)
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    run = shared.clone()
    run.sigmas = check_schedule(sigmas)
    run.patch_fp = adaln_patch_fingerprint(guider.model_patcher)
    run.in_run = True
    cache = run.cache
    before = cache.stats.as_dict()
    guider.model_options = comfy.model_patcher.create_model_options_clone(orig)
    guider.model_options["transformer_options"][HOLDER_KEY] = run
    args, aw = audio_watch.watch(args, kwargs, "h3")
    audio = None
    try:
        out = executor(*args, **kwargs)
        if aw is not None:
            audio = aw.finish(audio_watch.latent_check(out, kwargs.get("latent_shapes")))
        return out
    finally:
        guider.model_options = orig
        _report_run(run, before, audio)


def _report_run(run: AdalnHolder, before: dict, audio: dict | None = None) -> None:
    after = run.cache.stats
    delta = {k: getattr(after, k) - before[k] for k in ("hits", "misses", "rebuilds", "hot_runs")}
    data = {"run": delta, "total": after.as_dict(), "steps": int(run.sigmas.numel()) - 1}
    summary = (f"run: {delta['hits']} hits, {delta['misses']} misses, {delta['rebuilds']} rebuilds "
               f"({'hot' if delta['hot_runs'] else 'cold'}); {after.entries} entries, "
               f"tables {after.table_bytes / 2**20:.3f} MiB, weights off-device "
               f"{after.weight_bytes_parked / 2**20:.3f}/{after.weight_bytes_total / 2**20:.3f} MiB "
               f"[{after.park_mode}]")
    if after.table_bytes > after.weight_bytes_total:
        summary += ("; NOTE tables are larger than the AdaLN weights they replace (curve-form or long "
                    "schedule): the cache saves compute only")
    if delta["misses"]:
        summary += f"; MISSES computed uncached: {after.miss_keys[:4]}"
    if audio is not None:   # the audio guard on the sampled audio stream (bridge/audio_watch.py)
        data["audio_latent"] = audio
        summary += audio_watch.summary_suffix(audio)
        audio_watch.remember("DitKitH3AdaLNCache", (run.report_to or ReportTarget(None, "", None, None)).node_id,
                             audio)
    # the sink the node handed over (a bridge/reports.ReportTarget); a holder made without one reports on no node
    (run.report_to or ReportTarget(None, "DitKitH3AdaLNCache", None, None)).send("adaln_cache", summary, data)


def diffusion_model_wrapper(executor, x, timestep, context, transformer_options, *args, **kwargs):
    """Before the forward: the tables for this run's schedule and variants (built at the run's first forward and
    for a new variant / device; tables evicted or replaced meanwhile are not rebuilt: those calls miss and are
    computed from the weights, reported)."""
    holder: AdalnHolder | None = (transformer_options or {}).get(HOLDER_KEY)
    if holder is None:
        return executor(x, timestep, context, transformer_options, *args, **kwargs)
    if not holder.in_run:
        # sampled outside a guider (no OUTER_SAMPLE): a holder for this call only, keyed on the live sigma
        holder = holder.clone()
        holder.sigmas = check_schedule(timestep.flatten()[:1].float() / 1000.0)
    cache, dm = holder.cache, holder.dm
    variant = _variant(kwargs.get("minimax_payload"))
    device = x[0].device if isinstance(x, (list, tuple)) else x.device
    dtype = context.dtype
    new_variant = variant not in holder.variants
    holder.variants.add(variant)
    if holder.built_for is None or new_variant or holder.built_for[1] != (device, dtype):
        with persistent_alloc():  # the tables live across steps: outside the host's malloc graph (0.38)
            _build(holder, cache, dm, transformer_options, device, dtype)
    return executor(x, timestep, context, transformer_options, *args, **kwargs)


def _build(holder, cache, dm, transformer_options, device, dtype) -> None:
    """The run's tables (kept across steps; the caller allocates them outside the host's malloc graph)."""
    shift_v = float(transformer_options.get("minimax_h3_sigma_shift_video", dm.sigma_shift_video))
    shift_a = float(transformer_options.get("minimax_h3_sigma_shift_audio", dm.sigma_shift_audio))
    variants = sorted(holder.variants)
    sched = holder.sigmas[:-1] if holder.sigmas.numel() > 1 else holder.sigmas
    sig = (fp32_bits(sched), tuple(variants), str(device), str(dtype), shift_v, shift_a,
           holder.patch_fp, adaln_weight_fingerprint(cache, dm))
    if sig != cache.signature:
        model_sampling = transformer_options.get("ditkit_model_sampling") or holder.model_sampling
        with torch.no_grad():
            t_embs = predict_t_embs(dm, model_sampling, sched.tolist(), variants, device, dtype, shift_v, shift_a)
    else:
        t_embs = []
    cache.build(sig, t_embs)
    holder.built_for = (sig, (device, dtype))
