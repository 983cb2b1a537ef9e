"""DitKitH3AdaLNCache: precomputed AdaLN modulation tables for MiniMax H3 (core: ``offload/adaln.py``).

Installed on a clone through ComfyUI hooks only: one object patch per ``adaln_proj`` module (a lookup module
with the same ``linear`` child, so weight patches keyed ``...adaln_proj.linear.*`` still resolve), an
OUTER_SAMPLE wrapper (validates the schedule, captures the patch identity, reports per run) and a
DIFFUSION_MODEL wrapper (builds/installs the tables for the run before the first forward).
"""
from __future__ import annotations

import hashlib

import torch
from comfy_api.latest import io

from ..bridge.models import h3_diffusion_model
from ..errors import UnsupportedModelError
from ..offload.adaln import AdalnScheduleCache, CachedAdalnProj, check_schedule, fp32_bits
from ._common import report_target, send_report, ui_report

NODE_ID = "DitKitH3AdaLNCache"
WRAPPER_KEY = "ditkit_h3_adaln_cache"
ADALN_KEYS = ("adaln_proj", "time_embedder", "adaln_t_table")


def _h3_model(model):
    return h3_diffusion_model(model, NODE_ID, "the MODEL input is {got}, not a MiniMax H3 diffusion model. Connect an "
                              "H3 model (UNETLoader / DitKit H3 loader); nothing was changed.")


def _patch_fingerprint(patcher) -> str:
    """Hash of every weight patch / weight wrapper / foreign object patch that can change AdaLN outputs."""
    h = hashlib.sha1()
    for key in sorted(getattr(patcher, "patches", {}) or {}):
        if any(a in key for a in ADALN_KEYS):
            for p in patcher.patches[key]:
                strength, value, strength_model = p[0], p[1], p[2]
                h.update(repr((key, strength, strength_model)).encode())
                for t in (value if isinstance(value, (tuple, list)) else (value,)):
                    _hash_obj(h, t)
    for key in sorted(getattr(patcher, "weight_wrapper_patches", {}) or {}):
        if any(a in key for a in ADALN_KEYS):
            h.update(repr((key, [id(f) for f in patcher.weight_wrapper_patches[key]])).encode())
    for key, obj in sorted((getattr(patcher, "object_patches", {}) or {}).items()):
        if any(a in key for a in ADALN_KEYS) and not isinstance(obj, CachedAdalnProj):
            h.update(repr((key, id(obj))).encode())
    return h.hexdigest()


def _hash_obj(h, t) -> None:
    if isinstance(t, torch.Tensor) and type(t.data) is not torch.Tensor:
        # tensor subclasses (ComfyUI QuantizedTensor: int8/fp8/nvfp4 weights) are identified, not read: reading
        # would dequantize the whole tensor. Their content changes only through patches (fingerprinted apart).
        h.update(repr((type(t.data).__name__, t.dtype, tuple(t.shape), t.data_ptr())).encode())
    elif isinstance(t, torch.Tensor):
        h.update(repr((t.dtype, tuple(t.shape))).encode())
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(flat[::step].to("cpu", torch.float64).numpy().tobytes())
    elif isinstance(t, (tuple, list)):
        for x in t:
            _hash_obj(h, x)
    elif hasattr(t, "weights"):  # comfy.weight_adapter adapters
        _hash_obj(h, getattr(t, "weights"))
        h.update(type(t).__name__.encode())
    else:
        h.update(repr(t).encode())


def _weight_fingerprint(cache: AdalnScheduleCache, dm) -> str:
    h = hashlib.sha1(str(id(dm)).encode())
    for m in cache.modules:
        for name, p in m.linear.named_parameters():
            _hash_obj(h, p)
    table = getattr(dm, "adaln_t_table", None)
    if table is not None:
        _hash_obj(h, table)
    te = getattr(dm, "time_embedder", None)
    if te is not None:
        for p in te.parameters():
            _hash_obj(h, p)
    return h.hexdigest()


def _variant(payload: dict | None) -> tuple:
    """Which segment timesteps the forward uses (t2va / keyframes / refs) and their augmentation levels."""
    import comfy.ldm.minimax.model as h3

    payload = payload or {}
    layout = payload.get("layout")
    kinds = tuple(sorted({k for _, _, k in layout.segments})) if layout is not None else ("audio", "text", "video")
    vis = float(payload.get("visual_cond_noise_aug", h3.VISUAL_COND_TIMESTEP))
    aud = float(payload.get("audio_cond_noise_aug", h3.AUDIO_COND_TIMESTEP))
    return kinds, vis, aud


def _predict_t_embs(dm, model_sampling, sigmas, variants, device, dtype, shift_v, shift_a) -> list[torch.Tensor]:
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


class _RunState:
    def __init__(self):
        self.sigmas = None
        self.patch_fp = ""
        self.variants: set = set()
        self.built_for: tuple | None = None
        self.start = None
        self.node_id = None
        self.park_mode = "device"


def _install(m, cache: AdalnScheduleCache, dm, node_id: str, park: bool) -> dict:
    import comfy.patcher_extension as pe

    state = _RunState()
    state.node_id = report_target(node_id, NODE_ID)  # resolved when the run report is sent
    dynamic = bool(getattr(m, "is_dynamic", lambda: False)())
    if not park:
        cache.park_enabled = False
        state.park_mode = "off (weights left where ComfyUI put them)"
    elif dynamic:
        # dynamic VRAM (aimdo): weights are faulted in per module at cast time; with table hits the AdaLN
        # linears are never called, so they are never faulted in. Moving them behind aimdo's back is not done.
        cache.park_enabled = False
        state.park_mode = "dynamic VRAM: not moved; never faulted in while tables hit"
    cache.stats.park_mode = state.park_mode

    def outer_sample(executor, *args, **kwargs):
        guider = executor.class_obj
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        state.sigmas = check_schedule(sigmas)
        state.patch_fp = _patch_fingerprint(guider.model_patcher)
        state.variants = set()
        state.built_for = None
        before = cache.stats.as_dict()
        try:
            return executor(*args, **kwargs)
        finally:
            after = cache.stats
            run = {k: getattr(after, k) - before[k] for k in ("hits", "misses", "rebuilds", "hot_runs")}
            data = {"run": run, "total": after.as_dict(), "steps": int(state.sigmas.numel()) - 1}
            summary = (f"run: {run['hits']} hits, {run['misses']} misses, {run['rebuilds']} rebuilds "
                       f"({'hot' if run['hot_runs'] else 'cold'}); {after.entries} entries, "
                       f"tables {after.table_bytes / 2**20:.3f} MiB, weights off-device "
                       f"{after.weight_bytes_parked / 2**20:.3f}/{after.weight_bytes_total / 2**20:.3f} MiB "
                       f"[{after.park_mode}]")
            if after.table_bytes > after.weight_bytes_total:
                summary += ("; NOTE tables are larger than the AdaLN weights they replace (curve-form or long "
                            "schedule): the cache saves compute only")
            if run["misses"]:
                summary += f"; MISSES computed uncached: {after.miss_keys[:4]}"
            send_report(state.node_id, NODE_ID, "adaln_cache", summary, data)

    def diffusion_model(executor, x, timestep, context, transformer_options, *args, **kwargs):
        payload = kwargs.get("minimax_payload")
        variant = _variant(payload)
        device = x[0].device if isinstance(x, (list, tuple)) else x.device
        dtype = context.dtype
        if state.sigmas is None:  # sampled outside a guider (no OUTER_SAMPLE): key on the live sigma only
            state.sigmas = check_schedule(timestep.flatten()[:1].float() / 1000.0)
        new_variant = variant not in state.variants
        state.variants.add(variant)
        if state.built_for is None or new_variant or state.built_for[1] != (device, dtype):
            shift_v = float(transformer_options.get("minimax_h3_sigma_shift_video", dm.sigma_shift_video))
            shift_a = float(transformer_options.get("minimax_h3_sigma_shift_audio", dm.sigma_shift_audio))
            variants = sorted(state.variants)
            sched = state.sigmas[:-1] if state.sigmas.numel() > 1 else state.sigmas
            sig = (fp32_bits(sched), tuple(variants), str(device), str(dtype), shift_v, shift_a,
                   state.patch_fp, _weight_fingerprint(cache, dm))
            if sig != cache.signature:
                ms = executor.class_obj  # MiniMaxH3Model; model_sampling lives on the BaseModel
                model_sampling = transformer_options.get("ditkit_model_sampling") or _model_sampling(m, ms)
                with torch.no_grad():
                    t_embs = _predict_t_embs(dm, model_sampling, sched.tolist(), variants, device, dtype,
                                             shift_v, shift_a)
            else:
                t_embs = []
            cache.build(sig, t_embs)
            state.built_for = (sig, (device, dtype))
        return executor(x, timestep, context, transformer_options, *args, **kwargs)

    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample)
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model)
    return {"dynamic_vram": dynamic, "park_mode": state.park_mode}


def _model_sampling(m, _dm):
    return m.get_model_object("model_sampling")


class DitKitH3AdaLNCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=NODE_ID,
            display_name="DitKit H3 AdaLN Schedule Cache",
            category="ditkit/offload",
            description=("Precomputes MiniMax H3's AdaLN modulation for the sampling schedule and looks it up "
                         "instead of running the 13 B-parameter AdaLN projections every step. Bit-identical to "
                         "the uncached model; the AdaLN weights can leave the GPU while tables are installed."),
            search_aliases=["adaln", "modulation cache", "h3 offload", "minimax h3 adaln", "schedule cache"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 diffusion model (full or curve-form AdaLN)."),
                io.Boolean.Input("offload_weights", default=True,
                                 tooltip="Move the AdaLN projection weights to pinned host memory while the "
                                         "tables are installed (they come back for a rebuild or a miss). "
                                         "No effect on CPU or under dynamic VRAM (reported)."),
            ],
            outputs=[io.Model.Output(tooltip="The model with AdaLN schedule tables installed (a clone).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, offload_weights=True) -> io.NodeOutput:
        dm = _h3_model(model)
        keys = [f"diffusion_model.blocks.{i}.adaln_proj" for i in range(len(dm.blocks))]
        keys.append("diffusion_model.final_layer.adaln_proj")
        originals = [model.get_model_object(k) for k in keys]
        if any(isinstance(o, CachedAdalnProj) for o in originals):
            raise UnsupportedModelError(f"{NODE_ID}: this model already has AdaLN schedule tables installed "
                                        "(the node is applied twice on the same path); remove one of them.")
        m = model.clone()
        cache = AdalnScheduleCache()
        for k, o in zip(keys, originals):
            m.add_object_patch(k, cache.wrap(o, k.removeprefix("diffusion_model.")))
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        info = _install(m, cache, dm, node_id, bool(offload_weights))
        wbytes = sum(p.numel() * p.element_size() for o in originals for p in o.linear.parameters())
        summary = (f"installed on {len(keys)} AdaLN projections ({wbytes / 2**20:.3f} MiB of weights, "
                   f"{'curve' if dm.use_adaln_curves else 'full'} form); tables are built when sampling starts "
                   f"[{info['park_mode']}]")
        payload = send_report(node_id, NODE_ID, "adaln_cache", summary,
                              {"modules": len(keys), "weight_bytes": wbytes, "curve_form": dm.use_adaln_curves,
                               **info})
        return io.NodeOutput(m, ui=ui_report(payload))


NODES = [DitKitH3AdaLNCache]
