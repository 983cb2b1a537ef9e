"""ditkit kernels (plain torch; no ComfyUI imports).

``REGISTRY`` holds every op with its reference and accelerated backends; the public entry points are
:func:`video_sparse_attn`, :func:`block_sparse_attn` (FastVideo argument semantics) and
:func:`vsa_h3_attention` (packed H3 sequences).
"""

if "." not in __name__:  # the checkout's root is on sys.path: never shadow ComfyUI's `nodes` & co.
    raise ImportError(f"{__name__!r} is a subpackage of ditkit, not a top-level module: import ditkit.{__name__} "
                      "(remove the ditkit checkout's own folder from sys.path / PYTHONPATH)")
from .registry import REGISTRY, BackendError, Selection  # noqa: F401
from .vsa import (H3Kernels, block_sparse_attn, pool_tiles, resolve_h3_kernels, select_h3,  # noqa: F401
                  video_sparse_attn, vsa_h3_attention, VSAStats)
from .vsa_layout import H3TileLayout, LayoutError, build_h3_layout, compute_topk  # noqa: F401
