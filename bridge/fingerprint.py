"""Identity of a ComfyUI MODEL's weights and weight patches: one scheme for TeaCache and the AdaLN cache.

Tensor rule (:func:`hash_tensor`): dtype, shape and a strided sample of at most :data:`SAMPLE` values spread over the
whole tensor (read as float64); a tensor subclass (ComfyUI's ``QuantizedTensor``: int8 / fp8 / nvfp4 weights) is
identified by its type, dtype and shape, never read (reading would dequantize it whole).

Patch rule (:func:`patches_digest`): every weight patch (key, strength, strength_model and the patch values by the
tensor rule), every weight wrapper and every object patch of the ModelPatcher. Two uses:

* ``local=False`` (stored in coefficient and pair files, compared across processes): wrappers and object patches by
  key and type / function name; quantized tensors without their address;
* ``local=True`` (in-memory signatures such as the AdaLN tables): wrappers, object patches and quantized tensors
  also by identity in this process.

Stored format (``fingerprint.model`` of coefficient / pair files): ``{"scheme": 2, "weights_sha256": <this rule>,
"weights_sha256_v1": <the previous rule>, ...}``. Files written before (no ``scheme``) hold the previous rule's
value (sha256 over sorted name/shape/dtype plus the first 64 values of each tensor, ``coefficients.
weights_fingerprint``); ``coefficients.check_model`` compares such a file against ``weights_sha256_v1``, so those
files keep matching the model they were calibrated on.
"""
from __future__ import annotations

import hashlib
import weakref

import torch

from ..cache import coefficients as coef
from ..cache.adaln import AdalnScheduleCache, CachedAdalnProj

SCHEME = 2
SAMPLE = 4096
ADALN_KEYS = ("adaln_proj", "time_embedder", "adaln_t_table")


def hash_tensor(h, t, local: bool = False) -> bool:
    """Feed tensor ``t`` to hash ``h`` by the tensor rule; False when its values were not read (quantized)."""
    if type(t.data) is not torch.Tensor:
        # tensor subclasses (ComfyUI QuantizedTensor) are identified, not read: reading would dequantize the whole
        # tensor. Their content changes only through patches (fingerprinted apart).
        ident = (type(t.data).__name__, t.dtype, tuple(t.shape)) + ((t.data_ptr(),) if local else ())
        h.update(repr(ident).encode())
        return False
    h.update(repr((t.dtype, tuple(t.shape))).encode())
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    h.update(flat[::step].to("cpu", torch.float64).numpy().tobytes())
    return True


def _hash_obj(h, t, local: bool) -> None:
    if isinstance(t, torch.Tensor):
        hash_tensor(h, t, local)
    elif isinstance(t, (tuple, list)):
        for x in t:
            _hash_obj(h, x, local)
    elif hasattr(t, "weights"):  # comfy.weight_adapter adapters
        _hash_obj(h, getattr(t, "weights"), local)
        h.update(type(t).__name__.encode())
    else:
        h.update(repr(t).encode())


def _name(obj) -> str:
    return f"{type(obj).__module__}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def patches_digest(patcher, match=None, local: bool = False) -> tuple[str, int]:
    """``(hex digest, patched weights)`` over the patcher's weight patches, weight wrappers and object patches whose
    key satisfies ``match`` (all when None). ditkit's own AdaLN lookup modules are left out (they compute the same
    values)."""
    ok = match or (lambda k: True)
    h = hashlib.sha256()
    patches = getattr(patcher, "patches", {}) or {}
    keys = [k for k in sorted(patches) if ok(k)]
    for key in keys:
        for p in patches[key]:
            strength, value, strength_model = p[0], p[1], p[2]
            h.update(repr((key, strength, strength_model)).encode())
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                _hash_obj(h, t, local)
    wrappers = getattr(patcher, "weight_wrapper_patches", {}) or {}
    for key in sorted(k for k in wrappers if ok(k)):
        h.update(repr((key, [id(f) if local else _name(f) for f in wrappers[key]])).encode())
    for key, obj in sorted((getattr(patcher, "object_patches", {}) or {}).items()):
        if ok(key) and not isinstance(obj, CachedAdalnProj):
            h.update(repr((key, id(obj) if local else _name(obj))).encode())
    return h.hexdigest(), len(keys)


# ------------------------------------------------------------------------------------------ TeaCache (stored)

# weights fingerprint per diffusion model object: weak keys, so an entry dies with its model and a new model that
# reuses a dead one's id() can never get its fingerprint
_WEIGHTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def weights_fingerprint(dm) -> dict:
    """Identity of the weights of diffusion model ``dm`` (tensor rule over every state-dict tensor), computed once
    per model object."""
    fp = _WEIGHTS.get(dm)
    if fp is None:
        items = sorted(dm.state_dict().items(), key=lambda kv: kv[0])
        h = hashlib.sha256()
        numel = unread = 0
        for name, t in items:
            h.update(f"{name}|".encode())
            numel += int(t.numel())
            if not hash_tensor(h, t):
                unread += 1
        fp = {"scheme": SCHEME, "weights_sha256": h.hexdigest(), "n_tensors": len(items), "n_params": numel,
              "unread_tensors": unread,
              "weights_sha256_v1": coef.weights_fingerprint(items)["weights_sha256"],  # files without "scheme"
              "class": type(dm).__name__}
        _WEIGHTS[dm] = fp
    return fp


def model_fingerprint(model) -> dict:
    """The ``fingerprint.model`` of TeaCache coefficient / pair files for a ComfyUI MODEL: weights + patches."""
    out = dict(weights_fingerprint(model.model.diffusion_model))
    digest, n = patches_digest(model)
    if n or digest != hashlib.sha256().hexdigest():
        out["patches_sha256"] = digest
        out["n_patched_weights"] = n
    return out


# ------------------------------------------------------------------------------------------ AdaLN (in memory)

def _adaln_key(key: str) -> bool:
    return any(a in key for a in ADALN_KEYS)


def adaln_patch_fingerprint(patcher) -> str:
    """Every weight patch / weight wrapper / foreign object patch that can change AdaLN outputs (this process)."""
    return patches_digest(patcher, _adaln_key, local=True)[0]


def adaln_weight_fingerprint(cache: AdalnScheduleCache, dm) -> str:
    """The AdaLN projection weights, time embedder and curve table of ``dm`` (this process)."""
    h = hashlib.sha256(str(id(dm)).encode())
    for m in cache.modules:
        for _, p in m.linear.named_parameters():
            hash_tensor(h, p, local=True)
    table = getattr(dm, "adaln_t_table", None)
    if table is not None:
        hash_tensor(h, table, local=True)
    te = getattr(dm, "time_embedder", None)
    if te is not None:
        for p in te.parameters():
            hash_tensor(h, p, local=True)
    return h.hexdigest()
