"""Keep the loader's block scales in the model ComfyUI builds from a quantized state dict (no second copy).

Measured (``benchmarks/bench_quantize.py``, docs/quantize.md "Peak RSS"): ComfyUI's mixed-precision ``Linear``
(``comfy/ops.py`` ``_load_quantized_module``) wraps the state dict's weight in a ``QuantizedTensor`` and then in
``torch.nn.Parameter``; for such a tensor subclass ``Parameter`` calls ``detach()``, and comfy_kitchen's detach
(``QuantizedTensor._copy_with``) clones the layout params, i.e. every ``weight_scale`` block-scale tensor of the
mxfp8 / nvfp4 layers. The state dict's originals stay referenced by ``BaseModel.load_model_weights`` until the
whole model is loaded, so the block scales are held twice at the load's peak (9.5 MiB on a 312 MiB generated H3
as nvfp4, growing with the model: the peak RSS margin over the loaded size grew with the model size for mxfp8 /
nvfp4 only), and the freed originals leave holes in the heap afterwards.

:func:`share_block_scales` puts the state dict's own tensor back into each layer's params as soon as the
parameter is registered (a torch global parameter-registration hook, installed only for the duration of the
load): the clone is freed right away, so at most one layer's block scales exist twice. The swap only happens where
the registered weight wraps the state dict's data tensor (same storage) and the clone holds the same bytes as the
original (checked bit for bit), so the loaded model's values are unchanged; anything else is left as ComfyUI made
it. Duck-typed on ``_qdata`` / ``_params`` (comfy_kitchen's ``QuantizedTensor``): no ComfyUI import.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..loaders import host_memory

# the Params fields that hold a block-scale tensor (comfy_kitchen: nvfp4 "block_scale", mxfp8 "scale")
_FIELDS = ("block_scale", "scale")

# the freed clones' heap pages are returned to the system once this many bytes of them have been freed (and once at
# the end): after every layer, the trims were 12 ms of a 0.15 s cached nvfp4 load of a 1 GB H3 for a 13 MiB lower
# peak; every 4 MiB, the peak is within a few MiB of that at no measurable time (benchmarks/bench_quantize.py)
TRIM_BYTES = 4 << 20


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.element_size() != b.element_size() or a.device != b.device:
        return False
    if a.element_size() != 1:
        return bool(torch.equal(a, b)) and a.dtype == b.dtype
    x, y = a.contiguous().view(torch.uint8).reshape(-1), b.contiguous().view(torch.uint8).reshape(-1)
    if x.numel() % 8 == 0 and x.storage_offset() % 8 == 0 and y.storage_offset() % 8 == 0:
        x, y = x.view(torch.int64), y.view(torch.int64)    # the same bytes compared 8 at a time: 6x faster
    return bool(torch.equal(x, y))


class ScaleSharing:
    """What one :func:`share_block_scales` did: layers whose clone was replaced by the state dict's tensor
    (:meth:`record` puts it into the loader's QuantReport, so the node says it ran)."""

    def __init__(self, originals: dict[int, torch.Tensor]):
        self.originals = originals          # data_ptr of a layer's quantized weight -> its block-scale tensor
        self.candidates = len(originals)    # layers with block scales in the state dict
        self.shared = 0
        self.shared_bytes = 0
        self.untrimmed = 0                  # bytes of clones freed since the last trim

    def hook(self, module, name, param):
        qdata = getattr(param, "_qdata", None)
        params = getattr(param, "_params", None)
        if not isinstance(qdata, torch.Tensor) or params is None or not dataclasses.is_dataclass(params):
            return None
        orig = self.originals.get(qdata.data_ptr())
        if orig is None:
            return None
        for field in _FIELDS:
            cur = getattr(params, field, None)
            if not isinstance(cur, torch.Tensor) or cur.dim() == 0 or cur.data_ptr() == orig.data_ptr():
                continue
            if cur.element_size() != orig.element_size() or not _same_bytes(cur, orig.view(cur.dtype)):
                continue
            object.__setattr__(params, field, orig.view(cur.dtype))   # frozen dataclass: the clone is freed now
            self.shared += 1
            self.shared_bytes += orig.numel() * orig.element_size()
            self.originals.pop(qdata.data_ptr(), None)
            self.untrimmed += cur.numel() * cur.element_size()
            del cur
            self.trim(force=False)
            break
        return None


    def trim(self, force: bool) -> None:
        """Return the freed clones' heap pages once :data:`TRIM_BYTES` of them are freed (``force``: any)."""
        if self.untrimmed >= TRIM_BYTES or (force and self.untrimmed > 0):
            host_memory.release_free_heap()
            self.untrimmed = 0

    def record(self, quant) -> None:
        """Into ``quant`` (a QuantReport, or None for a load as stored): layers that kept the loader's block scales."""
        if quant is not None and self.candidates:
            quant.block_scales = {"layers_kept": self.shared, "layers": self.candidates,
                                  "bytes_not_copied": self.shared_bytes}


@contextlib.contextmanager
def share_block_scales(sd: dict):
    """Context for ``comfy.sd.load_diffusion_model_state_dict(sd)`` (or ``load_model_weights``) of a quantized
    state dict: yields a :class:`ScaleSharing` (how many layers kept the state dict's block scales)."""
    originals: dict[int, torch.Tensor] = {}
    for k, t in sd.items():
        if not (k.endswith(".weight_scale") and isinstance(t, torch.Tensor) and t.dim() >= 1):
            continue
        w = sd.get(k[: -len("_scale")])
        if isinstance(w, torch.Tensor) and w.numel():
            originals[w.data_ptr()] = t
    sharing = ScaleSharing(originals)
    if not originals:
        yield sharing
        return
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(sharing.hook)
    try:
        yield sharing
    finally:
        handle.remove()
        sharing.originals.clear()
        sharing.trim(force=True)
