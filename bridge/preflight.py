"""The preflight on ComfyUI: the model's dimensions, weights and compute dtype, the device in use and its free
memory, the attention backend class, and the OUTER_SAMPLE wrapper that repeats the check when sampling starts
(before ``prepare_sampling`` loads anything). Core: ``memory/model.py`` and ``memory/preflight.py``."""
from __future__ import annotations

import time

import torch

from ..errors import UnsupportedModelError
from ..memory.model import DiTDims, MemoryModelError, Options, Weights, weights_from_inventory
from ..memory.preflight import (FLUX2_TEXT_ROWS, CondBatch, MemoryShortfallError, Plan, check_available, check_cfg,
                                check_limit, cond_batch, flux2_tokens, h3_keyframe_rows, h3_ref_rows, h3_tokens,
                                ltx2_tokens, plan, uncond_runs, zimage_tokens)
from .chunking import installed_chunk
from .contract import Probe, entry
from .models import diffusion_model, model_family

NODE_ID = "DitKitPreflight"
WRAPPER_KEY = "ditkit_preflight"
GIB = 1024 ** 3
_DT = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def attention_class() -> str:
    """How ComfyUI's selected attention function holds scores: ``sub_quad`` (query-chunked full rows), ``math``
    (the whole score matrix: attention_basic / split), ``flash`` (SDPA, flash, sage, xformers, kitchen)."""
    from comfy.ldm.modules import attention as a

    name = getattr(a.optimized_attention, "__name__", "")
    if name == "attention_sub_quad":
        return "sub_quad"
    if name in ("attention_basic", "attention_split"):
        return "math"
    return "flash"


def _compute_dtype(model) -> str:
    bm = model.model
    dt = getattr(bm, "manual_cast_dtype", None) or bm.get_dtype()
    return {torch.float32: "float32", torch.float16: "float16"}.get(dt, "bfloat16")


FAMILIES = ("h3", "ltx2", "zimage", "flux2")
# FLUX.2: fp32 copies of the latent's rows alive at the blocks' peak outside them (the sampler's noise, latent, x,
# the CFG batch and its output buffers, the model input, padded and patchified): measured, benchmarks/bench_memory.py
# (sdpa-flux2 rows: 12.9 and 11.9 latent rows of RSS beyond the blocks' own terms; docs/memory.md)
LATENT_COPIES = 12


def family_of(model) -> str:
    """``"h3"``, ``"ltx2"``, ``"zimage"`` or ``"flux2"``; UnsupportedModelError naming the class for any other MODEL
    (nothing is loaded)."""
    family = model_family(model)
    if family not in FAMILIES:
        raise UnsupportedModelError(f"{NODE_ID}: the memory model is checked for MiniMax H3, LTX-2, Z-Image and "
                                    f"FLUX.2; the MODEL input "
                                    f"is {family or type(diffusion_model(model)).__name__}")
    return family


def model_facts(model):
    """(dims, {format: Weights}, current format, compute dtype name) of an H3, LTX-2, Z-Image or FLUX.2 MODEL."""
    import comfy.model_management as mm

    family = family_of(model)
    dm = diffusion_model(model)
    if family == "h3":
        blocks, prefix = dm.blocks, "blocks."
        b0 = blocks[0]
        dims = DiTDims("h3", int(dm.hidden_size), int(b0.attn.heads), int(b0.attn.head_dim),
                       int(b0.mlp.fc2.in_features), len(blocks))
        w = b0.mlp.fc1.weight
    elif family == "zimage":   # the main layers; the noise / context refiners run before them on fewer rows
        blocks, prefix = dm.layers, "layers."
        b0 = blocks[0]
        hd = int(b0.attention.head_dim)
        # the rope table [S, hd/2, 2, 2] is float32 whatever the compute dtype: 8 * hd bytes a row
        rope_cols = 8 * hd // {"float32": 4}.get(_compute_dtype(model), 2)
        dims = DiTDims("zimage", int(b0.attention.qkv.in_features), int(b0.attention.n_local_heads), hd,
                       int(b0.feed_forward.w2.in_features), len(blocks), extra_cols=rope_cols)
        w = b0.feed_forward.w1.weight
    elif family == "flux2":   # double blocks then single blocks (per-block weights for streaming)
        blocks, prefix = list(dm.double_blocks) + list(dm.single_blocks), ("double_blocks.", "single_blocks.")
        b0 = dm.double_blocks[0] if len(dm.double_blocks) else None
        s0 = dm.single_blocks[0] if len(dm.single_blocks) else None
        heads = int(dm.num_heads)
        hd = int(dm.hidden_size) // heads
        if s0 is not None:   # linear2 takes [attn D | mlp F]
            ffn = int(s0.linear2.in_features) - int(dm.hidden_size)
        else:
            ffn = int(b0.img_mlp[2].in_features)
        rope_cols = 8 * hd // {"float32": 4}.get(_compute_dtype(model), 2)   # the fp32 pe table, 8 * hd bytes a row
        dims = DiTDims("flux2", int(dm.hidden_size), heads, hd, ffn, len(dm.double_blocks), extra_cols=rope_cols,
                       single_layers=len(dm.single_blocks),
                       latent_row_bytes=LATENT_COPIES * int(dm.in_channels) * 4)
        w = s0.linear1.weight if s0 is not None else b0.img_mlp[0].weight
    else:
        blocks, prefix = dm.transformer_blocks, "transformer_blocks."
        b0 = blocks[0]
        dims = DiTDims("ltx2", int(b0.attn1.heads) * int(b0.attn1.dim_head), int(b0.attn1.heads),
                       int(b0.attn1.dim_head), int(b0.ff.net[2].in_features), len(blocks), ffn_kind="gelu",
                       extra_cols=int(getattr(dm, "audio_cross_attention_dim", 0) or 0))
        w = b0.ff.net[0].proj.weight
    sizes = tuple(int(mm.module_size(b)) for b in blocks)
    other = int(mm.module_size(dm)) - sum(sizes)
    largest = int(w.shape[0]) * int(w.shape[1])
    quantized = type(w).__name__ == "QuantizedTensor" or w.dtype not in _DT
    current = "quantized (as loaded)" if quantized else "bf16"
    weights = {current: Weights(sizes, other, largest)}
    if not quantized:
        inv = {k: (tuple(t.shape), _DT.get(t.dtype, "BF16")) for k, t in dm.state_dict().items()}
        for fmt in ("float8_e4m3fn", "nvfp4"):
            weights[fmt] = weights_from_inventory(family, inv, fmt, prefix)
    return dims, weights, current, _compute_dtype(model)


def available_memory(model, limit_gib: float) -> tuple[int, str, bool]:
    """(bytes the job may use, wording, whether streaming could help): ``limit_gib`` when > 0; else the free memory
    of the model's load device plus what this model already holds there (ComfyUI reuses it)."""
    import comfy.model_management as mm

    dev = torch.device(model.load_device)
    if limit_gib > 0:
        return int(limit_gib * GIB), f"(limit_gib on {dev})", dev.type != "cpu"
    free = mm.get_free_memory(dev)
    if not isinstance(free, (int, float)) or free != free:
        free = 0
    held = int(mm.module_size(model.model)) if dev.type == "cpu" else int(model.loaded_size())
    where = "of RAM free (CPU host)" if dev.type == "cpu" else f"free on {dev}"
    return check_available(int(free) + held if free > 0 else int(free), where), where, dev.type != "cpu"


def decode_parts(vae, video_shape) -> dict:
    """The VAE decode's bytes after sampling, by part, from the VAE as ComfyUI built it: its weights, ComfyUI's
    own working-set estimate (``memory_used_decode``, what ComfyUI frees memory for) and, on a CPU host, the
    decoded frames it returns (``upscale_ratio``: frames and pixels; ``vae_output_dtype``)."""
    import comfy.model_management as mm

    if not callable(getattr(vae, "memory_used_decode", None)) or getattr(vae, "first_stage_model", None) is None:
        raise MemoryModelError(f"{NODE_ID}: input 'vae' is not a VAE ({type(vae).__name__})")
    shape = tuple(int(x) for x in video_shape)
    try:
        working = float(vae.memory_used_decode(shape, vae.vae_dtype))
    except Exception as e:   # a VAE of another family: its estimate does not take this latent
        raise MemoryModelError(f"{NODE_ID}: input 'vae' cannot decode a latent of shape {shape}: "
                               f"{type(e).__name__}: {e}") from None
    up = getattr(vae, "upscale_ratio", 1)
    if len(shape) == 4:   # an image latent [B, C, H, W]: one frame
        shape, frames = shape[:2] + (1,) + shape[2:], 1
    else:
        frames = int(up[0](shape[2])) if isinstance(up, tuple) and callable(up[0]) else shape[2]
    px = int(vae.spacial_compression_decode())
    parts = {"VAE weights": int(mm.module_size(vae.first_stage_model)),
             "VAE working set (ComfyUI's estimate)": working}
    if torch.device(vae.device).type == "cpu":
        item = torch.empty((), dtype=vae.vae_output_dtype()).element_size()
        parts["decoded frames"] = shape[0] * 3 * frames * shape[3] * px * shape[4] * px * item
    return parts


def batch_of(family: str, video_shape) -> int:
    """The latent's own batch as the forward sees it: H3 runs batch 1 (its forward refuses more), the others the
    latent's first dimension."""
    return 1 if family == "h3" else int(video_shape[0])


def concat_keys(family: str, entries, default_text: int, source: str = "input 'positive'") -> list:
    """One key per conditioning item, equal where ComfyUI 0.33's ``can_concat_cond`` joins two items into one forward
    (contract entry ``comfy.samplers._calc_cond_batch[preflight cfg batch]``): Z-Image the caption rows (its
    ``num_tokens`` is a CONDConstant) and the omni references; FLUX.2 the caption rows as padded to 512 and the
    reference latents' shapes; LTX-2 one key (its captions pad to a common length; an upper bound where they do
    not); H3 None (each item's packed layout is its own object: never joined). No items: one item with
    ``default_text`` caption rows (``entries`` None; an empty list has none)."""
    items = [[None, {}]] if entries is None else list(entries)
    if family == "h3":
        return [None] * len(items)
    if family == "ltx2":
        return [()] * len(items)
    if family == "zimage":
        return [(c["text"], tuple(c["refs"]), tuple(c["ref_texts"]), tuple(c["siglip"]))
                for c in zimage_conds(items, default_text, source)]
    keys = []
    for c in items:
        text, shapes = flux2_rows([c], default_text, source)
        keys.append((max(text, FLUX2_TEXT_ROWS), shapes))
    return keys


def host_fits(model, video_shape, audio_shape=None):
    """ComfyUI's own test of whether ``k`` conditionings go into one forward (``_calc_cond_batch``):
    ``model.memory_required(input_shape) * 1.5 < free memory`` at the step, the input the latent batched ``k``
    times (a packed audio-video latent: ``[B, 1, video + audio elements]``). The free memory is what the device
    has now less the weights still to load (none on a CPU host: they are in RAM already)."""
    import math

    import comfy.model_management as mm

    dev = torch.device(model.load_device)
    get = getattr(model, "get_free_memory", None)
    free = get(dev) if callable(get) else mm.get_free_memory(dev)
    if dev.type != "cpu":
        free -= max(0, int(mm.module_size(model.model)) - int(model.loaded_size()))
    shape = [int(x) for x in video_shape]
    if audio_shape is not None:
        shape = [shape[0], 1, math.prod(shape[1:]) + math.prod(int(x) for x in audio_shape[1:])]

    def fits(k: int) -> bool:
        return model.model.memory_required([k * shape[0]] + shape[1:]) * 1.5 < free

    return fits


def conditioning_batch(model, video_shape, audio_shape, cfg, positive, negative, default_text: int,
                       source: str = "the sampler's", guider: str = "") -> CondBatch:
    """The conditionings ComfyUI runs in one forward of this job at ``cfg`` (:func:`memory.preflight.cond_batch`):
    the keys of ``positive`` and ``negative`` (:func:`concat_keys`; ``negative`` None: one item shaped like the
    first positive, the node's assumption), the model options' ``disable_cfg1_optimization``, ComfyUI's own
    memory test (:func:`host_fits`). A NaN / infinite cfg is refused naming ``source``'s cfg."""
    family = family_of(model)
    try:
        v = check_cfg(cfg, f"{source} cfg")
    except MemoryModelError as e:
        raise MemoryModelError(f"{NODE_ID}: {e}") from None
    ck = concat_keys(family, positive, default_text, f"{source} positive")
    uk = ck[:1] if negative is None else concat_keys(family, negative, default_text, f"{source} negative")
    return cond_batch(v, ck, uk, batch_of(family, video_shape), concatenates=family != "h3",
                      disable_cfg1_optimization=model.model_options.get("disable_cfg1_optimization", False),
                      fits=None if family == "h3" else host_fits(model, video_shape, audio_shape),
                      uncond_assumed=negative is None, guider=guider)


def other_case_cfg(model, cfg) -> float:
    """A cfg of the other case than ``cfg`` for ``model`` (the figure the node reports beside its own): 1.0 when
    ComfyUI runs the negative at ``cfg`` (:func:`memory.preflight.uncond_runs`, with the model options'
    ``disable_cfg1_optimization``), else 2.0. Where the option keeps the negative at cfg 1 both cases batch the
    same, and the node reports one figure."""
    flag = model.model_options.get("disable_cfg1_optimization", False)
    return 1.0 if uncond_runs(cfg, flag) else 2.0


def run_plan(model, video_shape, audio_shape, text: int, limit_gib: float, refs=0, keyframes: int = 0,
             vae=None, zimage=None, batch: CondBatch | None = None) -> Plan:
    """The plan of one job. ``refs``: H3 reference rows (int); FLUX.2 the reference latents' shapes (a tuple,
    :func:`flux2_rows`). ``zimage``: :func:`zimage_conds` of the conditioning (Z-Image; the item with the most
    rows decides; ``text`` when none). ``batch``: the conditionings in one forward (:func:`conditioning_batch`);
    None: the cond alone, as at cfg 1 (said in the report)."""
    limit = check_limit(limit_gib)
    family = family_of(model)
    if family == "h3":
        tokens = h3_tokens(video_shape, audio_shape, text=text, refs=refs, keyframes=keyframes)
    elif family == "zimage":   # image + caption rows, each padded to the model's pad_tokens_multiple
        dm = diffusion_model(model)
        p, m, sig = int(dm.patch_size), getattr(dm, "pad_tokens_multiple", None), \
            getattr(dm, "siglip_embedder", None) is not None
        tokens = max((zimage_tokens(video_shape, c["text"], p, m, c["refs"], c["ref_texts"], c["siglip"], sig)
                      for c in (zimage or [{"text": text, "refs": [], "ref_texts": [], "siglip": []}])),
                     key=lambda t: t.total)
    elif family == "flux2":    # image rows, reference latents (``refs``: their shapes), caption padded to 512
        dm = diffusion_model(model)
        tokens = flux2_tokens(video_shape, text, refs or (), int(dm.patch_size))
        want = int(dm.params.in_channels)
        for what, shape in (("latent", video_shape),) + tuple((f"reference latent {i}", r)
                                                             for i, r in enumerate(refs or ())):
            if int(shape[1]) != want:
                raise MemoryModelError(f"{NODE_ID}: the FLUX.2 {what} has {int(shape[1])} channels; this model takes "
                                       f"{want} (a FLUX.2 latent: EmptyFlux2LatentImage / the FLUX.2 VAE)")
    else:   # text is cross-attention context; guides (LTXVAddGuide) are frames of the latent itself
        tokens = ltx2_tokens(video_shape, audio_shape)
    latent_batch = batch_of(family, video_shape)
    if batch is None:
        batch = CondBatch(1, latent_batch, "cfg not given: the cond alone, as at cfg 1")
    elif batch.latent != latent_batch:
        raise MemoryModelError(f"{NODE_ID}: the batch was counted for latent batch {batch.latent}; the latent's is "
                               f"{latent_batch}")
    dims, weights, current, compute = model_facts(model)
    installed, chunk = installed_chunk(model)
    ov = (model.model_options.get("transformer_options") or {}).get("optimized_attention_override")
    # head groups split packed [B, H, S, hd] self-attention (skip_reshape calls): H3's and FLUX.2's (host test: every
    # FLUX.2 call grouped, the same samples); LTX-2's attention passes through them
    head_group = ov.heads_per_call if getattr(ov, "_ditkit_head_groups", False) and family in ("h3", "flux2") \
        else None
    available, where, streaming_possible = available_memory(model, limit)
    # auto chunking (chunk None) is counted unchunked: the upper bound, said in the report
    opts = Options(compute=compute, weight_format=current, chunk=chunk if installed else None,
                   attention=attention_class(), free_bytes=available, head_group=head_group, batch=batch.total)

    def scale(frac: float) -> str:
        if family in ("zimage", "flux2"):
            return f"width and height x {frac ** 0.5:.2f}"
        t = int(video_shape[2])
        return (f"latent frames <= {max(1, int(t * frac))} of {t} at this resolution, or width and height x "
                f"{frac ** 0.5:.2f} at this length")

    dec = decode_parts(vae, video_shape) if vae is not None else None
    p = plan(dims, weights, tokens, opts, available, where, streaming_possible, video_scale=scale, decode_parts=dec,
             decode_keeps_weights=torch.device(model.load_device).type == "cpu",
             head_groups=family in ("h3", "flux2"))
    p.batch = batch
    if installed and chunk is None:
        p.where += " (feed-forward chunking is auto: predicted unchunked, an upper bound)"
    return p


def latent_shapes_of(samples, family: str = "h3"):
    """(video shape, audio shape) of a LATENT's samples: H3 a NestedTensor of video + audio; LTX-2 the same or a
    video-only 5-D tensor (audio shape None)."""
    tensors = getattr(samples, "tensors", None)
    if family in ("zimage", "flux2"):
        if torch.is_tensor(samples) and samples.dim() == 4 and tensors is None:
            return tuple(samples.shape), None
        name = "Z-Image" if family == "zimage" else "FLUX.2"
        raise MemoryModelError(f"{NODE_ID}: the LATENT is not a {name} latent (image [B, C, H, W]); got "
                               f"{type(samples).__name__} {tuple(getattr(samples, 'shape', ()))}")
    if family == "ltx2":
        if tensors and len(tensors) in (1, 2):
            return tuple(tensors[0].shape), (tuple(tensors[1].shape) if len(tensors) == 2 else None)
        if torch.is_tensor(samples) and samples.dim() == 5:
            return tuple(samples.shape), None
        raise MemoryModelError(f"{NODE_ID}: the LATENT is not an LTX-2 latent (video [B, C, T, H, W], optionally with "
                               f"audio); got {type(samples).__name__} {tuple(getattr(samples, 'shape', ()))}")
    if not tensors or len(tensors) != 2:
        raise MemoryModelError(f"{NODE_ID}: the LATENT is not an H3 audio-video latent (video + audio); got "
                               f"{type(samples).__name__} {tuple(getattr(samples, 'shape', ()))}")
    return tuple(tensors[0].shape), tuple(tensors[1].shape)


def refusal(p: Plan) -> MemoryShortfallError:
    return MemoryShortfallError(f"{NODE_ID}: the job does not fit: {p.summary()}. Nothing was loaded or sampled.")


def install(m, text: int, limit_gib: float, report, vae=None) -> None:
    import comfy.patcher_extension as pe

    m.model_options.setdefault("transformer_options", {})[WRAPPER_KEY] = {"text": text, "limit_gib": limit_gib,
                                                                         "report": report, "vae": vae}
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)


def _rows_of(blocks, what: str):
    if blocks is None:
        return ()
    if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, dict) for b in blocks):
        raise MemoryModelError(f"{NODE_ID}: the conditioning's {what} is not a list of dicts: {type(blocks).__name__}")
    return blocks


def _frames(t, axis: int, what: str) -> int:
    if not torch.is_tensor(t) or t.dim() <= abs(axis) - (axis < 0):
        raise MemoryModelError(f"{NODE_ID}: {what} is not a latent tensor: {type(t).__name__}")
    return int(t.shape[axis])


def conditioning_rows(entries, video_shape, default_text: int, source: str = "input 'positive'"
                      ) -> tuple[int, int, int]:
    """:func:`packed_rows`, its errors naming ``source`` (the node input or the sampler's conditioning)."""
    try:
        return packed_rows(entries, video_shape, default_text)
    except MemoryModelError as e:
        msg = str(e)
        msg = msg[len(NODE_ID) + 2:] if msg.startswith(NODE_ID + ": ") else msg
        raise MemoryModelError(f"{NODE_ID}: {source}: {msg}") from None


def _cond_item(c, where: str):
    """``(cross_attn, options dict)`` of one conditioning item: a ComfyUI ``CONDITIONING`` pair ``[cross_attn, {...}]``
    or the sampler's converted dict (``cross_attn`` a key); anything else refused, ``where`` leading the message."""
    if isinstance(c, dict):
        return c.get("cross_attn"), c
    if isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], dict):
        return c[0], c[1]
    raise MemoryModelError(f"{where}: not a CONDITIONING (an item is {type(c).__name__})")


def zimage_text_rows(entries, default_text: int, source: str = "input 'positive'") -> int:
    """Caption rows of the longest Z-Image conditioning among ``entries`` (the cross_attn length; ``default_text``
    when there is none). Omni references are read by :func:`zimage_conds`."""
    return max([c["text"] for c in zimage_conds(entries, default_text, source)] or [default_text])


def _tensor_list(v, what: str, where: str, dims: int) -> list:
    if v is None:
        return []
    if not isinstance(v, (list, tuple)) or not all(torch.is_tensor(t) and t.dim() == dims for t in v):
        raise MemoryModelError(f"{where}: the conditioning's {what} is not a list of {dims}-D tensors "
                               f"({type(v).__name__})")
    return list(v)


def _siglip_rows(d: dict, where: str) -> list[int]:
    """SigLIP rows of each image encoding, as ``Lumina2.extra_conds`` reads them: ``clip_vision_outputs`` or each
    ``unclip_conditioning`` item's ``clip_vision_output`` (absent ones skipped), ``(H // 16) * (W // 16)`` of the
    output's ``image_sizes[0]`` = (C, H, W)."""
    outs = d.get("clip_vision_outputs")
    if outs is None:
        unclip = d.get("unclip_conditioning") or []
        if not isinstance(unclip, (list, tuple)) or not all(isinstance(u, dict) for u in unclip):
            raise MemoryModelError(f"{where}: the conditioning's unclip_conditioning is not a list of dicts")
        outs = [u.get("clip_vision_output") for u in unclip]
    if not isinstance(outs, (list, tuple)):
        raise MemoryModelError(f"{where}: the conditioning's clip_vision_outputs is not a list")
    rows = []
    for o in outs:
        if o is None:
            continue
        size = getattr(o, "image_sizes", None)
        try:
            h, w = int(size[0][1]), int(size[0][2])
        except (TypeError, IndexError, ValueError):
            raise MemoryModelError(f"{where}: a CLIP vision output without image_sizes [(C, H, W)]: "
                                   f"{type(o).__name__}") from None
        rows.append((h // 16) * (w // 16))
    return rows


def zimage_conds(entries, default_text: int, source: str = "input 'positive'") -> list[dict]:
    """What each Z-Image conditioning item adds to the joint sequence: ``text`` (the cross_attn length,
    ``default_text`` when there is none), and for omni editing (``reference_latents``) the (H, W) of each reference
    latent (``refs``), its caption rows (``reference_latents_text_embeds``: ``ref_texts``) and the SigLIP rows of
    the image encodings (``siglip``), read as ComfyUI 0.33's ``Lumina2.extra_conds`` reads them. ``[]`` for none."""
    where = f"{NODE_ID}: {source}"
    out = []
    for c in entries or ():
        ca, d = _cond_item(c, where)
        refs = _tensor_list(d.get("reference_latents"), "reference_latents", where, 4)
        out.append({"text": int(ca.shape[1]) if torch.is_tensor(ca) and ca.dim() >= 2 else default_text,
                    "refs": [(int(r.shape[-2]), int(r.shape[-1])) for r in refs],
                    "ref_texts": [int(t.shape[1]) for t in _tensor_list(d.get("reference_latents_text_embeds"),
                                                                     "reference_latents_text_embeds", where, 3)],
                    "siglip": _siglip_rows(d, where) if refs else []})
    return out


def flux2_rows(entries, default_text: int, source: str = "input 'positive'") -> tuple[int, tuple]:
    """(caption rows, reference latent shapes) of the longest FLUX.2 conditioning among ``entries``: the cross_attn
    length (``default_text`` when there is none; the model pads it to 512) and the ``reference_latents``
    (ReferenceLatent; the sampler's converted dicts carry them as ``ref_latents``) whose rows join the image's.
    Anything that is not a list of latent tensors is refused naming ``source``."""
    best = None
    for c in entries or ():
        ca, d = _cond_item(c, f"{NODE_ID}: {source}")
        text = int(ca.shape[1]) if torch.is_tensor(ca) and ca.dim() >= 2 else default_text
        refs = d.get("reference_latents")
        if refs is None:
            refs = d.get("ref_latents")
        cond = getattr(refs, "cond", None)      # the sampler's CONDList
        refs = cond if cond is not None else refs
        if refs is None:
            refs = ()
        if not isinstance(refs, (list, tuple)) or not all(torch.is_tensor(r) and r.dim() >= 3 for r in refs):
            raise MemoryModelError(f"{NODE_ID}: {source}: FLUX.2 reference latents must be a list of latent tensors "
                                   f"[B, C, h, w]; got {type(refs).__name__}")
        shapes = tuple(tuple(int(x) for x in r.shape) for r in refs)
        rows = max(text, FLUX2_TEXT_ROWS) + sum(s[-2] * s[-1] for s in shapes)   # as the model pads the caption
        if best is None or rows > best[0]:
            best = (rows, text, shapes)
    return (default_text, ()) if best is None else (best[1], best[2])


def packed_rows(entries, video_shape, default_text: int) -> tuple[int, int, int]:
    """(text, reference, keyframe) rows of the longest packed sequence among the conditioning ``entries``: ComfyUI
    ``CONDITIONING`` items ``[cross_attn, {...}]`` or the sampler's converted dicts (``cross_attn`` a key). Text rows
    are the cross_attn length (``default_text`` when there is none); H3 ref2va blocks (``minimax_refs``: kind,
    latent_t/h/w, ref_audio_t) and fl2va keyframes (``minimax_keyframes``: ``latent`` [B, 24, T, h, w] on the
    target's patch grid, ``audio_latent`` [..., T_a]) are counted as ComfyUI's ``PackedLayout`` packs them."""
    frame_rows = -(-int(video_shape[3]) // 2) * -(-int(video_shape[4]) // 2)
    best = None
    for c in entries or ():
        ca, d = _cond_item(c, NODE_ID)
        text = int(ca.shape[1]) if torch.is_tensor(ca) and ca.dim() >= 2 else default_text
        refs = sum(h3_ref_rows(b.get("kind"), b.get("latent_t", 0), b.get("latent_h", 0), b.get("latent_w", 0),
                               b.get("ref_audio_t", 0)) for b in _rows_of(d.get("minimax_refs"), "minimax_refs"))
        kf = 0
        for k in _rows_of(d.get("minimax_keyframes"), "minimax_keyframes"):
            vt = 0 if k.get("latent") is None else _frames(k["latent"], 2, "a keyframe's latent")
            at = 0 if k.get("audio_latent") is None else _frames(k["audio_latent"], -1, "a keyframe's audio latent")
            kf += h3_keyframe_rows(vt, at, frame_rows)
        if best is None or text + refs + kf > sum(best):
            best = (text, refs, kf)
    return best or (default_text, 0, 0)


def sampler_batch(guider, video_shape, audio_shape, default_text: int) -> CondBatch:
    """The conditionings in one forward for this guider: ComfyUI's CFGGuider (its ``predict_noise``) by its cfg and
    its positive / negative; a guider with its own ``predict_noise`` (dual CFG, perp-neg, ...) every conditioning
    it holds, batched where their shapes allow (an upper bound, named)."""
    from comfy.samplers import CFGGuider

    conds = getattr(guider, "conds", None) or {}
    if type(guider).predict_noise is CFGGuider.predict_noise:
        return conditioning_batch(guider.model_patcher, video_shape, audio_shape, guider.cfg,
                                  conds.get("positive") or [], conds.get("negative") or [], default_text)
    rest = [c for k, v in conds.items() if k != "positive" for c in (v or [])]
    return conditioning_batch(guider.model_patcher, video_shape, audio_shape, 1.0, conds.get("positive") or [], rest,
                              default_text, guider=type(guider).__name__)


def outer_sample_wrapper(executor, *args, **kwargs):
    """The same check when sampling starts, on the latent and conditioning the sampler got, before anything loads."""
    guider = executor.class_obj
    info = guider.model_options.get("transformer_options", {}).get(WRAPPER_KEY)
    if not info:
        return executor(*args, **kwargs)
    t0 = time.perf_counter()
    family = family_of(guider.model_patcher)
    shapes = kwargs.get("latent_shapes") or (args[8] if len(args) > 8 else None)
    if shapes and len(shapes) == 2:
        video, audio = tuple(shapes[0]), tuple(shapes[1])
    elif shapes and len(shapes) == 1 and family in ("ltx2", "zimage", "flux2"):
        video, audio = tuple(shapes[0]), None
    else:
        latent = args[1] if len(args) > 1 else kwargs.get("latent_image")
        video, audio = latent_shapes_of(latent, family)
    text, refs, kf = info["text"], 0, 0
    conds = getattr(guider, "conds", None) or {}
    entries = [c for k in ("positive", "negative") for c in (conds.get(k) or [])]
    if family == "h3":
        text, refs, kf = conditioning_rows(entries, video, info["text"], "the sampler's conditioning")
    elif family == "flux2":
        text, refs = flux2_rows(entries, info["text"], "the sampler's conditioning")
    zconds = None
    if family == "zimage":
        zconds = zimage_conds(entries, info["text"], "the sampler's conditioning")
    batch = sampler_batch(guider, video, audio, info["text"])
    p = run_plan(guider.model_patcher, video, audio, text, info["limit_gib"], refs, kf, info.get("vae"), zconds,
                 batch=batch)
    target, send = info["report"]
    data = dict(p.as_dict(), phase="sampler", seconds=time.perf_counter() - t0)
    send(target, NODE_ID, "preflight", ("sampler check: " + p.summary()), data)
    if not p.fits:
        raise refusal(p)
    return executor(*args, **kwargs)


@entry("comfy.ldm.modules.attention.optimized_attention[preflight backend]", nodes=(NODE_ID,), what="attributes",
       doc="the selected attention function's name tells how it holds scores")
def _attention_probe() -> Probe:
    from comfy.ldm.modules import attention as a

    name = getattr(a.optimized_attention, "__name__", "")
    if not name.startswith("attention_"):
        return Probe.broken(f"optimized_attention is {name!r}")
    return Probe.holds(name)


@entry("comfy.samplers.CFGGuider.outer_sample", nodes=(NODE_ID,), what="signature",
       doc="outer_sample(noise, latent_image, sampler, sigmas, ..., latent_shapes): the check runs before it")
def _outer_sample_probe() -> Probe:
    import inspect

    from comfy.samplers import CFGGuider

    params = list(inspect.signature(CFGGuider.outer_sample).parameters)
    if params[:5] != ["self", "noise", "latent_image", "sampler", "sigmas"]:
        return Probe.broken(f"outer_sample{params}")
    return Probe.holds("" if "latent_shapes" in params else "no latent_shapes: the latent is read")



@entry("comfy.ldm.minimax.model.PackedLayout[preflight refs/keyframes]", nodes=(NODE_ID,), what="behaviour",
       doc="PackedLayout(..., keyframes, refs) packs reference blocks (kind / latent_t / latent_h / latent_w / "
           "ref_audio_t) and keyframes (latent / audio_latent): the rows the preflight counts")
def _packed_layout_probe() -> Probe:
    import inspect

    from comfy.ldm.minimax.model import PackedLayout

    params = list(inspect.signature(PackedLayout.__init__).parameters)
    if params[-2:] != ["keyframes", "refs"]:
        return Probe.broken(f"PackedLayout.__init__{params}")
    layout = inspect.getsource(PackedLayout.__init__)
    missing = [w for w in ('"kind"', '"latent_h"', '"latent_w"', '"latent_t"', '"ref_audio_t"', '"audio_latent"',
                           '"video_audio"') if w not in layout]
    return Probe.broken(f"missing {missing}") if missing else Probe.holds("")


@entry("comfy.model_base.MiniMaxH3.extra_conds[preflight refs/keyframes]", nodes=(NODE_ID,), what="behaviour",
       doc="the conditioning keys minimax_refs / minimax_keyframes reach the forward's PackedLayout")
def _extra_conds_probe() -> Probe:
    import inspect

    from comfy.model_base import MiniMaxH3

    conds = inspect.getsource(MiniMaxH3.extra_conds)
    missing = [w for w in ('"minimax_refs"', '"minimax_keyframes"') if w not in conds]
    return Probe.broken(f"missing {missing}") if missing else Probe.holds("")


@entry("comfy.sd.VAE[preflight decode]", nodes=(NODE_ID,), what="attributes",
       doc="memory_used_decode(shape, dtype), first_stage_model, vae_dtype, upscale_ratio, spacial_compression_decode, "
           "vae_output_dtype, device: the decode's predicted peak")
def _vae_probe() -> Probe:
    import inspect

    from comfy.sd import VAE

    missing = [a for a in ("spacial_compression_decode", "vae_output_dtype", "decode") if not hasattr(VAE, a)]
    src = inspect.getsource(VAE.__init__)
    missing += [a for a in ("self.memory_used_decode", "self.first_stage_model", "self.vae_dtype", "self.upscale_ratio",
                            "self.device") if a not in src]
    return Probe.broken(f"missing {missing}") if missing else Probe.holds("")


@entry("comfy.ldm.lumina.model.NextDiT.patchify_and_embed[preflight omni]", nodes=(NODE_ID,), what="behaviour",
       doc="Z-Image omni: each reference's caption (ref_contexts), SigLIP (siglip_feats, siglip_pad_token) and image "
           "rows, the target's, then the leftover captions, each padded by pad_zimage; Lumina2.extra_conds reads "
           "reference_latents / reference_latents_text_embeds / clip_vision_outputs or unclip_conditioning: the "
           "rows zimage_tokens counts")
def _zimage_omni_probe() -> Probe:
    import inspect

    from comfy.ldm.lumina.model import NextDiT
    from comfy.model_base import Lumina2

    missing = [f"patchify_and_embed: {w}" for w in ("ref_latents", "ref_contexts", "siglip_feats", "leftover_cap",
                                                    "embed_cap(cap, offset")
               if w not in inspect.getsource(NextDiT.patchify_and_embed)]
    missing += [f"embed_all: {w}" for w in ("siglip_pad_token", "pad_zimage(siglip_feats", "pad_zimage(x",
                                            "self.siglip_embedder is None")
                if w not in inspect.getsource(NextDiT.embed_all)]
    missing += [f"Lumina2.extra_conds: {w}" for w in ('"reference_latents"', '"reference_latents_text_embeds"',
                                                      '"clip_vision_outputs"', '"unclip_conditioning"', "image_sizes[0]",
                                                      "// 16")
                if w not in inspect.getsource(Lumina2.extra_conds)]
    return Probe.broken(f"missing {missing}") if missing else Probe.holds("")


@entry("comfy.ldm.flux.model.Flux[preflight FLUX.2 layout]", nodes=(NODE_ID,), what="behaviour",
       doc="FLUX.2: image rows of process_img (pad_to_patch_size, rearrange by patch_size), reference latents "
           "(ref_latents) concatenated after them, txt + img joined before the single blocks; Flux2.extra_conds "
           "pads the caption to 512 rows; the single block's fused linear1 (3 x hidden + the gated MLP's 2F) and "
           "the SiLU-gated MLP: the rows flux2_tokens counts and the blocks flux2_activation_parts models")
def _flux2_layout_probe() -> Probe:
    import inspect

    from comfy.ldm.flux import layers
    from comfy.ldm.flux.model import Flux
    from comfy.model_base import Flux2

    from ..memory.preflight import FLUX2_TEXT_ROWS

    checks = {"Flux.process_img": (inspect.getsource(Flux.process_img), ("pad_to_patch_size",
                                                                        "b c (h ph) (w pw) -> b (h w) (c ph pw)")),
              "Flux._forward": (inspect.getsource(Flux._forward), ("for ref in ref_latents",
                                                                   "torch.cat([img, kontext], dim=1)")),
              "Flux.forward_orig": (inspect.getsource(Flux.forward_orig), ("img = torch.cat((txt, img), 1)",)),
              "Flux2.extra_conds": (inspect.getsource(Flux2.extra_conds), (f"target_text_len = {FLUX2_TEXT_ROWS}",)),
              "SingleStreamBlock": (inspect.getsource(layers.SingleStreamBlock),
                                    ("hidden_size * 3 + self.mlp_hidden_dim_first",
                                     "self.mlp_hidden_dim_first = int(hidden_size * mlp_ratio * 2)",
                                     "torch.cat((attn, mlp), 2)")),
              "SiLUActivation": (inspect.getsource(layers.SiLUActivation), ("self.gate_fn(x1) * x2",))}
    missing = [f"{where}: {w}" for where, (src, words) in checks.items() for w in words if w not in src]
    return Probe.broken(f"missing {missing}") if missing else Probe.holds("")


class _Stop(Exception):
    pass


@entry("comfy.samplers.sampling_function[preflight cfg rule]", nodes=(NODE_ID,), what="behaviour",
       doc="the uncond runs unless math.isclose(cfg, 1.0) and disable_cfg1_optimization == False: the host's own "
           "function, called with a recorder, equals memory.preflight.uncond_runs on both sides of the boundary")
def _cfg_rule_probe() -> Probe:
    from comfy.samplers import sampling_function

    def ran(cfg, flag) -> bool:
        seen = []

        def record(args):
            seen.append(args["conds"][1] is not None)
            raise _Stop

        opts = {"sampler_calc_cond_batch_function": record}
        if flag is not None:
            opts["disable_cfg1_optimization"] = flag
        try:
            sampling_function(None, None, None, ["uncond"], ["cond"], cfg, model_options=opts)
        except _Stop:
            pass
        return seen[0]

    cases = [(c, f) for c in (1.0, 1 + 1e-10, 1.0000001, 0.9999999, 0.0, 7.0) for f in (None, True, 0, 1)]
    wrong = [(c, f) for c, f in cases if ran(c, f) != uncond_runs(c, False if f is None else f)]
    return Probe.broken(f"differs at (cfg, disable_cfg1_optimization) {wrong}") if wrong else Probe.holds("")


@entry("comfy.samplers._calc_cond_batch[preflight cfg batch]", nodes=(NODE_ID,), what="behaviour",
       doc="conditionings that can_concat_cond joins run in one forward, tried n, n // 2, ... while "
           "memory_required(input_shape) * 1.5 < free memory, else one; H3's per-item PackedLayout never joins "
           "(CONDConstant.can_concat); Z-Image's caption rows are a CONDConstant: concat_keys' rules")
def _cond_batch_probe() -> Probe:
    import inspect

    import comfy.samplers as s
    from comfy.model_base import BaseModel, Lumina2, MiniMaxH3
    from comfy.model_patcher import ModelPatcher

    checks = {"_calc_cond_batch": (inspect.getsource(s._calc_cond_batch), (
        "can_concat_cond(to_run[x][0], first[0])", "to_batch = to_batch_temp[:1]",
        "batch_amount = to_batch_temp[:len(to_batch_temp)//i]",
        "input_shape = [len(batch_amount) * first_shape[0]] + list(first_shape)[1:]",
        "model.memory_required(input_shape, cond_shapes=cond_shapes) * 1.5 < free_memory",
        "free_memory = model.current_patcher.get_free_memory(x_in.device)")),
              "MiniMaxH3.extra_conds": (inspect.getsource(MiniMaxH3.extra_conds), (
                  'payload["layout"] = comfy.ldm.minimax.model.PackedLayout(',
                  "out['minimax_payload'] = comfy.conds.CONDConstant(payload)")),
              "Lumina2.extra_conds": (inspect.getsource(Lumina2.extra_conds), (
                  "out['num_tokens'] = comfy.conds.CONDConstant(cross_attn.shape[1])",))}
    missing = [f"{where}: {w}" for where, (src, words) in checks.items() for w in words if w not in src]
    params = list(inspect.signature(BaseModel.memory_required).parameters)
    if params[:3] != ["self", "input_shape", "cond_shapes"]:
        missing.append(f"BaseModel.memory_required{params}")
    if not callable(getattr(ModelPatcher, "get_free_memory", None)):
        missing.append("ModelPatcher.get_free_memory")
    return Probe.broken(f"missing {missing}") if missing else Probe.holds("")


@entry("comfy.conds.CONDConstant.can_concat[preflight cfg batch]", nodes=(NODE_ID,), what="behaviour",
       doc="two H3 payloads (a CONDConstant holding a PackedLayout) never join one forward, equal layouts "
           "included, so H3's cond and uncond always run as two forwards of batch 1; an equal plain constant joins")
def _cond_constant_probe() -> Probe:
    import comfy.conds
    from comfy.ldm.minimax.model import PackedLayout

    a, b = (comfy.conds.CONDConstant({"layout": PackedLayout(4, 1, 2, 2, 2)}) for _ in range(2))
    wrong = []
    if a.can_concat(b):
        wrong.append("two H3 payloads with equal layouts concatenate")
    if not comfy.conds.CONDConstant(7).can_concat(comfy.conds.CONDConstant(7)):
        wrong.append("two equal plain constants do not concatenate")
    return Probe.broken("; ".join(wrong)) if wrong else Probe.holds("")
