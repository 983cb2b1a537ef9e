"""The quantizing loaders' shared inputs and their one code path (DitKitH3ModelLoader, DitKitLTX2ModelLoader,
DitKitFlux2ModelLoader, DitKitZImageLoader): the ``weight_format`` / ``quantized_cache`` / ``quantize_on`` inputs,
their checks (refused by name before any tensor is read), and :func:`quantized_state_dict`, which streams a source
through ``loaders/quantize.py`` (or its write-once cache) with progress on the node.
"""
from __future__ import annotations

from ..bridge.load_progress import load_progress
from ..bridge.loaders import model_load_device, quant_algos
from ..errors import CheckpointError
from ..loaders import quant_cache
from ..loaders import quantize as qcore

AS_STORED = "as stored"


def weight_formats() -> list[str]:
    """``as stored`` + the formats ditkit writes that this ComfyUI's ``comfy.quant_ops.QUANT_ALGOS`` has."""
    from ..kernels.quant import FORMATS

    QUANT_ALGOS = quant_algos()
    return [AS_STORED] + [f for f in FORMATS if f in QUANT_ALGOS]


def check_weight_format(node_id: str, weight_format: str) -> str | None:
    """None for ``as stored``, else the format; a format this host cannot load is refused by name."""
    if weight_format == AS_STORED:
        return None
    have = weight_formats()
    if weight_format not in have:
        raise CheckpointError(f"{node_id}: weight_format {weight_format!r} is not available in this ComfyUI (its "
                              f"comfy.quant_ops.QUANT_ALGOS offers {have[1:] or 'none'} of the formats ditkit writes)")
    return weight_format


QUANTIZE_ON = ["cpu", "gpu"]
QUANTIZE_ON_TOOLTIP = ("Where a quantizing load (a weight_format other than 'as stored') quantizes. 'cpu' (default): "
                       "in host memory. 'gpu': on the CUDA device ComfyUI loads the model onto; each weight goes "
                       "there through one pinned buffer, is quantized by ditkit's Triton kernels (the same bits as "
                       "the CPU path) and comes back to host memory, then ComfyUI loads the model as usual. Refused "
                       "when ComfyUI's device is not a CUDA GPU. The report says where it ran. Not yet measured on a "
                       "GPU (docs/quantize.md, 'On a GPU').")


def check_quantize_on(node_id: str, quantize_on: str, fmt: str | None):
    """The device a quantizing load runs on: None for the CPU, else ComfyUI's CUDA load device. A value other than
    'cpu' / 'gpu' is refused by name, and 'gpu' when a quantizing load would not find a CUDA device (checked only
    when something is quantized: with 'as stored' nothing runs anywhere)."""
    if quantize_on not in QUANTIZE_ON:
        raise CheckpointError(f"{node_id}: quantize_on {quantize_on!r}: choose one of {QUANTIZE_ON}")
    if quantize_on == "cpu" or fmt is None:
        return None
    dev = model_load_device()
    if getattr(dev, "type", None) != "cuda":
        raise CheckpointError(f"{node_id}: quantize_on 'gpu': ComfyUI loads models onto {dev}, not a CUDA GPU; "
                              "choose 'cpu'")
    return dev


WEIGHT_FORMAT_TOOLTIP = ("Quantize while loading into one of ComfyUI's native comfy_quant formats (weight-only; the "
                         "list is what this ComfyUI's QUANT_ALGOS supports). Each tensor is read, converted and "
                         "quantized one at a time: the transformer blocks' linear layers are quantized; embeddings, "
                         "norms, the final layer and small layers stay as stored (reported per layer class; see "
                         "docs/quantize.md). 'as stored' keeps the file's dtypes.")


def quantized_state_dict(family: str, fmt: str, inventory, read, where: str, cache: tuple | None = None,
                         device=None):
    """Stream the source through the quantizer -> (state dict as a comfy_quant file would give it, report); the
    node shows tensors done / total and MB/s while it works (bridge/load_progress.py). ``read(scratch_keys)``: the
    source's ``(key, tensor)`` iterator, the tensors of ``scratch_keys`` (the ones quantized, never kept) read into
    one reused buffer. ``cache``: ``(source path, source files)`` to use the write-once cache next to the source
    (loaders/quant_cache.py; the source is then not read on a hit). ``device``: a CUDA device to quantize on
    (:func:`check_quantize_on`), None for the CPU."""
    prog = load_progress(f"quantizing to {fmt}")

    def run():
        plan = qcore.make_plan(family, fmt, inventory)
        report = qcore.QuantReport(family, fmt, qcore.RECIPES[family]["source"])
        sd = {}
        try:
            for k, t in qcore.quantize_stream(read(plan.quantized_keys()), plan, report, where, progress=prog,
                                                 device=device):
                sd[k] = t
        except BaseException:
            sd.clear()
            raise
        return sd, report

    if cache is None:
        sd, report = run()
    else:
        out_inv = qcore.make_plan(family, fmt, inventory).output_inventory()
        prog.what = f"{fmt} (cache)"
        sd, report = quant_cache.cached_quantize(cache[0], list(cache[1]), family, fmt, qcore.RECIPES[family], run,
                                                 out_inv, progress=prog)
    report.timing = {"seconds": round(prog.seconds, 3), "source_bytes": prog.bytes_done}
    return sd, report


CACHE_TOOLTIP = ("Write-once cache (off by default): the first quantizing load writes the quantized weights next to "
                 "the source (<name>.ditkit-<format>-<key>.safetensors, keyed by the source files' size, mtime and "
                 "sampled SHA-256, the format and the recipe); later loads read that file, verified against the "
                 "SHA-256 stored in it, at the speed of a stock comfy_quant load. A modified cache file is refused "
                 "by name (delete it to re-quantize). See docs/quantize.md.")
