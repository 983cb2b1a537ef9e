"""Identity of a ComfyUI MODEL's weights and weight patches (ModelPatcher ``patches``, ``weight_wrapper_patches``,
``object_patches``)."""
from __future__ import annotations

import hashlib

import torch

from ..offload.adaln import AdalnScheduleCache, CachedAdalnProj

ADALN_KEYS = ("adaln_proj", "time_embedder", "adaln_t_table")


def adaln_patch_fingerprint(patcher) -> str:
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


def adaln_weight_fingerprint(cache: AdalnScheduleCache, dm) -> str:
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
