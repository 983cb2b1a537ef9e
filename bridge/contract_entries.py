"""The host contract's entries for what ditkit was built on (ComfyUI 0.33.0): every ComfyUI module, name, signature,
attribute and behaviour that ``bridge/`` relies on, each naming the ditkit nodes that depend on it.

Probes are cheap (imports, ``inspect.signature``, attributes of small objects built on the meta device or at toy
size) and compare with what the bridge code reads, not with a version string:

* ``signature``: the parameters ditkit passes exist under those names, in that order; any other parameter has a
  default (so a host that adds an optional parameter still holds, one that renames, reorders or adds a required
  parameter is broken, named);
* ``attributes``: the attributes / methods ditkit reads exist on the host object;
* ``behaviour``: where the bridge mirrors a host algorithm, the mirror equals the host on a toy input (the H3 block
  body of ``bridge/blocks.h3_block_forward``; the link test of ``bridge/reports``), or the host protocol does what
  ditkit relies on (the attention override is called; a QuantizedTensor rebuilt from its parts equals itself).

Entries for the adaptations to newer hosts (0.35-0.38) live next to the code that adapts (``bridge/hostcompat.py``).
"""
from __future__ import annotations

import importlib
import inspect

from .contract import Probe, entry

# ---------------------------------------------------------------------------------------------- node groups
TEACACHE = ("DitKitTeaCache", "DitKitTeaCacheCalibrate")
ADALN = ("DitKitH3AdaLNCache",)
VSA = ("DitKitSparseAttention",)
FASTH3 = ("DitKitFastH3Schedule",)
H3_LOADER = ("DitKitH3ModelLoader",)
DIT_LOADERS = ("DitKitLTX2ModelLoader", "DitKitFlux2ModelLoader")
ZIMAGE = ("DitKitZImageLoader",)
LOKR = ("DitKitLoKrLoader",)
ADAPTER = ("DitKitAdapterLoader",)
VAE_LOADER = ("DitKitH3VAELoader",)
VAE_DECODE = ("DitKitH3VAEDecode",)
EMPTY_LATENT = ("DitKitH3EmptyImageLatent",)
ENCODE = ("DitKitH3EncodeImage",)
SAVE = ("DitKitSaveVideo",)
TEXT_ENCODERS = ("DitKitH3TextEncoderLoader", "DitKitLTXTextEncoderLoader")
STEPCACHE = ("DitKitStepCache",)
MEMORY = ("DitKitActivationChunking", "DitKitPreflight")
MODEL_LOADERS = H3_LOADER + DIT_LOADERS + ZIMAGE
PATCHERS = TEACACHE + ADALN + VSA + FASTH3 + LOKR + ADAPTER      # nodes that clone and patch a MODEL
RUNTIME_REPORTS = TEACACHE + ADALN + VSA + TEXT_ENCODERS          # report later, from wrappers
ALL_NODES = tuple(dict.fromkeys(PATCHERS + MODEL_LOADERS + VAE_LOADER + VAE_DECODE + EMPTY_LATENT + ENCODE + SAVE
                                + TEXT_ENCODERS + STEPCACHE + MEMORY))


# ------------------------------------------------------------------------------------------------- helpers

def resolve(path: str):
    """The object ``path`` names ("comfy.sd.VAE.decode"): the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module of {path!r} imports")


def check_params(fn, names: tuple[str, ...]) -> Probe:
    """``names`` are parameters of ``fn`` in that order (``self`` skipped); every other parameter has a default."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        return Probe.broken(f"signature not readable ({e})")
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    have = [p.name for p in params]
    missing = [n for n in names if n not in have]
    if missing:
        return Probe.broken(f"parameters {missing} missing (has {have})")
    order = [n for n in have if n in names]
    if order != list(names):
        return Probe.broken(f"parameters in order {order}, ditkit passes {list(names)}")
    extra = [p.name for p in params if p.name not in names and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if extra:
        return Probe.broken(f"new required parameters {extra} (ditkit passes {list(names)})")
    return Probe.holds()


def check_attrs(obj, names: tuple[str, ...]) -> Probe:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        return Probe.broken(f"attributes {missing} missing on {getattr(obj, '__name__', type(obj).__name__)}")
    return Probe.holds()


def _signature_entry(symbol: str, nodes: tuple[str, ...], names: tuple[str, ...], doc: str) -> None:
    def probe() -> Probe:
        return check_params(resolve(symbol), names)

    probe.__qualname__ = f"signature[{symbol}]"
    entry(symbol, nodes=nodes, what="signature", doc=doc)(probe)


def _attributes_entry(symbol: str, nodes: tuple[str, ...], names: tuple[str, ...], doc: str) -> None:
    def probe() -> Probe:
        return check_attrs(resolve(symbol), names)

    probe.__qualname__ = f"attributes[{symbol}]"
    entry(symbol, nodes=nodes, what="attributes", doc=doc)(probe)


# -------------------------------------------------------------------------------- signatures ditkit calls
SIGNATURES = [
    ("comfy.ldm.minimax.model.DiTBlock.forward", TEACACHE + VSA + ADALN,
     ("x", "t_emb", "mod_segments", "rope_freqs", "transformer_options"),
     "H3 block call: block replaces and the modulation memo pass these (bridge/blocks.py)"),
    ("comfy.ldm.minimax.model._mod_scale_shift", TEACACHE + VSA, ("h", "shift", "scale", "segments"),
     "H3 per-segment modulation (bridge/blocks.h3_block_forward, FastH3 gate replaces)"),
    ("comfy.ldm.minimax.model._mod_gate", TEACACHE + VSA, ("x", "gate", "other", "segments"),
     "H3 gated residual (bridge/blocks.h3_block_forward)"),
    ("comfy.ldm.minimax.model.PackedLayout.__init__", VSA,
     ("text_len", "latent_t", "latent_h", "latent_w", "audio_t", "keyframes", "refs"),
     "packed segment spans rebuilt from the inputs (bridge/attention.segments_from_inputs)"),
    ("comfy.ldm.common_dit.pad_to_patch_size", VSA, ("img", "patch_size"),
     "latent padding as the H3 forward does it (bridge/attention.py)"),
    ("comfy.model_patcher.create_model_options_clone", TEACACHE + ADALN + VSA, ("orig_model_options",),
     "per-run clone of the guider's model_options (EasyCache pattern)"),
    ("comfy.sd.load_diffusion_model_state_dict", MODEL_LOADERS, ("sd", "model_options", "metadata"),
     "every ditkit model loader hands its state dict to ComfyUI's own builder (bridge/loaders.py)"),
    ("comfy.sd.load_text_encoder_state_dicts", TEXT_ENCODERS,
     ("state_dicts", "embedding_directory", "clip_type", "model_options", "disable_dynamic"),
     "stock CLIP built with the <name>_model_config override (bridge/text_encoders.py)"),
    ("comfy.sd.detect_te_model", TEXT_ENCODERS, ("sd",), "ComfyUI's text-encoder detector run on the header"),
    ("comfy.sd.VAE.__init__", VAE_LOADER, ("sd", "metadata"), "stock VAE wrapper (bridge/h3_vae.py, h3_audio_vae.py)"),
    ("comfy.utils.convert_old_quants", TEXT_ENCODERS, ("state_dict", "model_prefix", "metadata"),
     "old fp8 scaled text-encoder files (bridge/text_encoders._read)"),
    ("comfy.utils.ProgressBar.__init__", ALL_NODES, ("total", "node_id"), "progress bars (bridge/reports.progress)"),
    ("comfy.utils.ProgressBar.update_absolute", ALL_NODES, ("value", "total"), "progress bars"),
    ("comfy.utils.get_attr", LOKR + ADAPTER, ("obj", "attr"), "the layer of a weight key (bridge/lokr.py)"),
    ("comfy.utils.unpack_latents", TEACACHE + ADALN + FASTH3 + STEPCACHE, ("combined_latent", "latent_shapes"),
     "the audio part of the flat (video, audio) pack the sampler works on (bridge/audio_watch.py)"),
    ("comfy.utils.detect_layer_quantization", ZIMAGE, ("state_dict", "prefix"), "Z-Image of any width"),
    ("comfy.utils.calculate_parameters", ZIMAGE, ("sd",), "Z-Image of any width"),
    ("comfy.utils.weight_dtype", ZIMAGE, ("sd",), "Z-Image of any width"),
    ("comfy.model_detection.detect_unet_config", ZIMAGE, ("state_dict", "key_prefix"), "Z-Image config detection"),
    ("comfy.model_management.load_models_gpu", VAE_DECODE + SAVE, ("models", "memory_required", "force_full_load"),
     "VAE loaded before the T=1 / streamed decode"),
    ("comfy.model_management.get_free_memory", VAE_DECODE + ENCODE + SAVE + EMPTY_LATENT, ("dev",),
     "pre-flight memory budgets (bridge/memory.py)"),
    ("comfy.model_management.get_total_memory", VAE_DECODE + ENCODE + SAVE + EMPTY_LATENT, ("dev",),
     "pre-flight memory budgets (bridge/memory.py)"),
    ("comfy.model_management.unet_dtype", ZIMAGE, ("model_params", "supported_dtypes", "weight_dtype"),
     "Z-Image of any width"),
    ("comfy.model_management.unet_manual_cast", ZIMAGE, ("weight_dtype", "inference_device", "supported_dtypes"),
     "Z-Image of any width"),
    ("comfy.model_management.module_size", TEXT_ENCODERS, ("module",), "streamed text encoder's VRAM budget"),
    ("comfy.model_patcher.CoreModelPatcher.__init__", ZIMAGE, ("model", "load_device", "offload_device"),
     "Z-Image of any width"),
    ("comfy.weight_adapter.base.WeightAdapterBase.calculate_weight", LOKR + ADAPTER,
     ("weight", "key", "strength", "strength_model", "offset", "function", "intermediate_dtype"),
     "ditkit's lazy weight patches are called by lora.calculate_weight (positionally)"),
    ("comfy.lora.calculate_weight", LOKR + ADAPTER, ("patches", "weight", "key", "intermediate_dtype"),
     "the host's patch loop that calls ditkit's weight patches"),
    ("comfy.model_sampling.ModelSamplingAV.set_parameters", FASTH3, ("shift", "audio_shift"),
     "the H3 sigma shifts as MiniMaxH3SigmaShift sets them (bridge/schedules.py)"),
    ("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE.__init__", VAE_LOADER, ("ch", "ch_mult", "num_res_blocks"),
     "scaled H3 video VAE built at the file's size (bridge/h3_vae._build_scaled_vae)"),
    ("comfy.ldm.minimax.vae.ViT3DDecoder.__init__", VAE_LOADER,
     ("patch_size", "patch_size_t", "in_channels", "num_layers", "heads", "dim_head", "num_register_tokens"),
     "scaled H3 video VAE decoder"),
    ("comfy.ldm.minimax.audio_vae.MiniMaxH3AudioVAE.__init__", VAE_LOADER,
     ("encoder_dim", "encoder_rates", "latent_dim", "decoder_dim", "vae_latent_channels"),
     "scaled H3 audio VAE (bridge/h3_audio_vae.py)"),
    ("comfy_execution.utils.get_executing_context", RUNTIME_REPORTS, (),
     "which prompt / node executes when a runtime report is sent (bridge/reports.py)"),
]

# ------------------------------------------------------------------------------ attributes ditkit reads
ATTRIBUTES = [
    ("comfy.ops", ADAPTER + ("DitKitActivationChunking",), ("linear_input_act", "INPUT_ACT_EAGER"),
     "H3's fused MLP call (bypass adapters hook fc2 around it; chunking runs the same call per token chunk)"),
    ("comfy.ldm.minimax.model.MiniMaxH3Model", TEACACHE + ADALN + VSA + FASTH3 + H3_LOADER + ADAPTER,
     ("forward", "_forward"), "the H3 diffusion model class (bridge/models.h3_diffusion_model)"),
    ("comfy.patcher_extension.WrappersMP", TEACACHE + ADALN + VSA + FASTH3 + ("DitKitStepCache",),
     ("OUTER_SAMPLE", "DIFFUSION_MODEL"), "per-run and per-forward wrappers (FastH3: the audio check's OUTER_SAMPLE)"),
    ("comfy.patcher_extension.CallbacksMP", TEXT_ENCODERS, ("ON_LOAD",), "streamed text encoder's LoRA guard"),
    ("comfy.model_patcher.ModelPatcher", PATCHERS + MODEL_LOADERS + TEXT_ENCODERS,
     ("clone", "add_wrapper_with_key", "add_object_patch", "get_model_object", "add_patches", "set_attachments",
      "get_attachment", "add_callback_with_key", "model_state_dict", "set_model_patch_replace",
      "remove_wrappers_with_key", "is_dynamic"),
     "ModelPatcher methods the nodes patch clones through"),
    ("comfy.sd.VAE", VAE_LOADER + VAE_DECODE + ENCODE + SAVE,
     ("decode", "encode", "throw_exception_if_invalid", "vae_output_dtype", "model_size"),
     "the stock VAE wrapper ditkit returns and calls"),
    ("comfy.sd.CLIPType", TEXT_ENCODERS, ("MINIMAX", "LTXV"), "text-encoder kinds"),
    ("comfy.model_management", VAE_LOADER + VAE_DECODE + EMPTY_LATENT + MODEL_LOADERS + TEXT_ENCODERS,
     ("archive_model_dtypes", "vae_offload_device", "intermediate_device", "get_torch_device",
      "unet_offload_device", "text_encoder_offload_device"), "devices and dtype bookkeeping"),
    ("comfy.supported_models.ZImage", ZIMAGE, ("get_model", "set_inference_dtype", "supported_inference_dtypes"),
     "Z-Image model config (any width)"),
    ("comfy.ldm.minimax.vae", VAE_LOADER, ("MiniMaxH3VideoVAE", "ViT3DDecoder", "IMAGENET_MEAN", "IMAGENET_STD"),
     "scaled H3 video VAE"),
    ("comfy.nested_tensor", EMPTY_LATENT + ENCODE, ("NestedTensor",), "the (video, audio) H3 latent"),
    ("comfy.cli_args.args", SAVE, ("disable_metadata",), "--disable-metadata (bridge/save_video.py)"),
    ("comfy.model_sampling", FASTH3, ("ModelSamplingAV", "CONST"), "the classes MiniMaxH3SigmaShift patches in"),
    ("folder_paths", ALL_NODES, ("get_folder_paths", "get_filename_list", "get_output_directory"),
     "model lists and the output folder (bridge/files.py)"),
    ("server.PromptServer", ALL_NODES, ("send_sync", "send_progress_text"),
     "report delivery to the badge (bridge/reports.py)"),
    ("comfy_execution.progress", RUNTIME_REPORTS, ("global_progress_registry",),
     "the executing prompt's graph (report routing, bridge/reports.current_graph)"),
]

for _sym, _nodes, _names, _doc in SIGNATURES:
    _signature_entry(_sym, _nodes, _names, _doc)
for _sym, _nodes, _names, _doc in ATTRIBUTES:
    _attributes_entry(_sym, _nodes, _names, _doc)


# ------------------------------------------------------------------------------ objects ComfyUI builds

@entry("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE", nodes=VAE_LOADER + VAE_DECODE + ENCODE + SAVE, what="attributes")
def _h3_video_vae_attributes() -> Probe:
    """The private decode steps and settings of the H3 video VAE that the T=1 decode reads (bridge/vae.py)."""
    import torch

    from .vae import REQUIRED

    cls = resolve("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE")
    with torch.device("meta"):
        m = cls()
    names = tuple(dict.fromkeys(REQUIRED + ("_finalize_pixels", "split_tiles", "blend", "latents_std", "vae_ratio",
                                            "vae_ratio_t", "tiling", "tokens_chunk_size", "token_overlap",
                                            "decode_output_shape", "comfy_has_chunked_io", "decoder")))
    p = check_attrs(m, names)
    if p.state != "holds":
        return p
    return check_attrs(m.decoder, ("patch_size_t",))


@entry("comfy.samplers.CFGGuider.outer_sample[audio check callback]", nodes=TEACACHE + ADALN + FASTH3 + STEPCACHE,
       what="signature")
def _outer_sample_callback() -> Probe:
    """OUTER_SAMPLE executor arguments: the step callback is the 6th (bridge/audio_watch.CALLBACK_POS), called by
    KSAMPLER once per step with the denoised flat pack (``callback(i, denoised, x, total_steps)``)."""
    import comfy.samplers

    params = list(inspect.signature(comfy.samplers.CFGGuider.outer_sample).parameters)
    want = ["self", "noise", "latent_image", "sampler", "sigmas", "denoise_mask", "callback"]
    if params[:7] != want:
        return Probe.broken(f"outer_sample{params}, the audio check wraps argument 5 'callback'")
    src = inspect.getsource(comfy.samplers.KSAMPLER.sample)
    if 'callback(x["i"], x["denoised"], x["x"], total_steps)' not in src:
        return Probe.broken("KSAMPLER.sample no longer calls callback(i, denoised, x, total_steps)")
    return Probe.holds()


@entry("comfy.quant_ops.QUANT_ALGOS", nodes=MODEL_LOADERS + LOKR + ADAPTER, what="feature")
def _quant_algos() -> Probe:
    """comfy_quant formats: the per-tensor ones name their tensor layout (weight_format lists, LoKr requantize)."""
    algos = resolve("comfy.quant_ops.QUANT_ALGOS")
    if not isinstance(algos, dict):
        return Probe.broken(f"QUANT_ALGOS is a {type(algos).__name__}, not a dict")
    bad = [f for f in ("float8_e4m3fn", "float8_e5m2") if f in algos and "comfy_tensor_layout" not in algos[f]]
    if bad:
        return Probe.broken(f"formats {bad} have no 'comfy_tensor_layout'")
    return Probe.holds(f"{len(algos)} formats")


@entry("comfy.quant_ops.QuantizedTensor", nodes=LOKR + ADAPTER, what="behaviour")
def _quantized_tensor() -> Probe:
    """A per-tensor QuantizedTensor's private parts (_qdata, _params.scale, _layout_cls) rebuild the same tensor."""
    import dataclasses

    import torch

    from .loaders import quant_algos

    qt_cls = resolve("comfy.quant_ops.QuantizedTensor")
    algos = quant_algos()
    if "float8_e4m3fn" not in algos:
        return Probe.holds("no float8_e4m3fn format on this host: nothing to requantize")
    t = torch.linspace(-1, 1, 16).reshape(4, 4)
    qt = qt_cls.from_float(t, algos["float8_e4m3fn"]["comfy_tensor_layout"])
    for name in ("_qdata", "_params", "_layout_cls"):
        if not hasattr(qt, name):
            return Probe.broken(f"QuantizedTensor has no {name}")
    if not dataclasses.is_dataclass(qt._params) or not hasattr(qt._params, "scale"):
        return Probe.broken(f"QuantizedTensor._params is a {type(qt._params).__name__} without a dataclass 'scale'")
    again = qt_cls(qt._qdata, qt._layout_cls, dataclasses.replace(qt._params, scale=qt._params.scale))
    if not torch.equal(again.dequantize(), qt.dequantize()):
        return Probe.broken("a QuantizedTensor rebuilt from (_qdata, _layout_cls, _params) dequantizes differently")
    return Probe.holds()


# ------------------------------------------------------------------------------ mirrored host algorithms

@entry("comfy.ldm.minimax.model.DiTBlock", nodes=TEACACHE + VSA, what="behaviour")
def _h3_block_body() -> Probe:
    """bridge/blocks.h3_block_forward (the 0.33 DiTBlock.forward body on a memoised modulation) equals the host's
    block on a toy block (bit for bit)."""
    import torch

    import comfy.ops

    from .blocks import h3_block_forward

    cls = resolve("comfy.ldm.minimax.model.DiTBlock")
    g = torch.Generator().manual_seed(0)
    blk = cls(16, 2, 8, 16, 8, 1e-6, 1e-6, operations=comfy.ops.manual_cast).train(False)
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        x = torch.randn(6, 16, generator=g)
        t_emb = torch.randn(1, 8, generator=g)
        segs = [(0, 3, 0), (3, 6, 1)]
        ref = blk(x.clone(), t_emb, segs, None, {})
        mine = h3_block_forward(blk, blk.adaln_proj(t_emb),
                                {"img": x.clone(), "mod_segments": segs, "rope_freqs": None,
                                 "transformer_options": {}})
    if not torch.equal(ref, mine):
        return Probe.broken(f"the host's DiTBlock.forward differs from ditkit's mirror (max abs diff "
                            f"{(ref - mine).abs().max().item():.3g}): the modulation memo would change results")
    return Probe.holds()


@entry("comfy_execution.graph_utils.is_link", nodes=RUNTIME_REPORTS, what="behaviour")
def _is_link() -> Probe:
    """The host's link test (called by bridge/reports for the cache-key signature of a report's node) still tells
    a ``[node_id, output]`` link from a literal."""
    host = resolve("comfy_execution.graph_utils.is_link")
    links, literals = [["3", 0], ["12", 1]], ["3", 5, None, ["3"], ["3", 0, 1], [3, 0], {"a": 1}, ("3", 0)]
    wrong = [repr(c) for c in links if not host(c)] + [repr(c) for c in literals if host(c)]
    if wrong:
        return Probe.broken(f"links decided differently for {wrong}: reports could land on the wrong node")
    return Probe.holds()


@entry("comfy.ldm.modules.attention.optimized_attention", nodes=VSA, what="behaviour")
def _attention_override_protocol() -> Probe:
    """An ``optimized_attention_override`` in transformer_options is called as ``override(func, q, k, v, heads,
    ...)`` and its result returned (the VSA-H3 override, bridge/attention.py)."""
    import torch

    attn = resolve("comfy.ldm.modules.attention.optimized_attention")
    seen = []

    def override(func, q, k, v, heads, *args, **kwargs):
        seen.append((callable(func), heads))
        return torch.full((1, 3, 8), 7.0)

    q = torch.zeros(1, 3, 8)
    out = attn(q, q, q, 2, transformer_options={"optimized_attention_override": override})
    if seen != [(True, 2)]:
        return Probe.broken(f"the override was called {len(seen)} times with {seen} (expected once, func first, "
                            "heads 2)")
    if not torch.equal(out, torch.full((1, 3, 8), 7.0)):
        return Probe.broken("the override's result was not returned")
    return Probe.holds()
