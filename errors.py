"""ditkit's error types.

Every error ditkit raises on bad input is a :class:`DitKitError`. Messages say what was wrong, where
(file, key, node input) and what to do. Nodes let these propagate so ComfyUI shows them on the node;
nothing is caught and swallowed.
"""
from __future__ import annotations


class DitKitError(ValueError):
    """Base class: bad input or an unsupported request, with an actionable message."""


class CheckpointError(DitKitError):
    """A weights/metadata file is malformed, truncated, of another model family or inconsistent."""


class MetadataError(CheckpointError):
    """Safetensors ``__metadata__`` failed strict validation (the message names the key and value)."""


class AdapterError(DitKitError):
    """A LoKr/LoRA adapter cannot be applied exactly (shape mismatch, NaN factors, other family...)."""


class BackendError(DitKitError):
    """A requested kernel backend cannot run here (missing package, device, dtype, head dim)."""


class CoefficientError(DitKitError):
    """A TeaCache coefficient file is malformed, of another version, or for another model."""


class UnsupportedModelError(DitKitError):
    """The node was given a model it does not support (e.g. a non-H3 model to an H3-only node)."""


class WorkflowError(DitKitError):
    """A workflow file cannot be converted or checked (unknown node class, missing link, bad widget values)."""


class CacheStackError(DitKitError):
    """A step cache was asked to stack on another one (EasyCache, LazyCache or another ditkit cache)."""


class ScheduleError(DitKitError):
    """A sampling schedule or inference contract is malformed, or disagrees with the recipe asked for."""
