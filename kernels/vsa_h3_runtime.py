"""Per-model VSA-H3 runtime state: dense/sparse decisions, counters and the report (plain torch).

The host layer (``bridge/attention.py``, installed by ``nodes/sparse_attention.py``) owns the ComfyUI hooks and
calling convention; this object decides, per DiT forward and per attention call, whether to run sparse, calls
:func:`~.vsa.vsa_h3_attention` on ``[B, H, S, D]`` tensors, and counts what ran.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..report import Report
from .vsa import H3Kernels, resolve_h3_kernels, vsa_h3_attention
from .vsa_layout import H3TileLayout, build_h3_layout


@dataclass
class VSAH3Config:
    keep: float                      # fraction of video tiles kept (0.1 = FastH3 Preview v1, 0.2 = V2)
    sparsity: Optional[float] = None   # FastVideo VSA_sparsity (sets the count); None -> 1 - keep
    sigma_start: float = float("inf")  # sparse while sigma_end <= sigma <= sigma_start
    sigma_end: float = 0.0
    backend: Optional[str] = None    # None/"auto" -> registry choice
    min_tokens: int = 0              # packed sequences shorter than this stay dense
    exempt: bool = True


@dataclass
class ForwardCtx:
    layout: H3TileLayout
    sparse: bool
    reason: str
    sigma: Optional[float]
    kernels: Optional[H3Kernels] = None   # resolved at this forward's first sparse call, reused by the others


def _step_key(sigma: Optional[float]):
    return round(float(sigma), 6) if sigma is not None else None


@dataclass
class VSAH3Runtime(Report):
    cfg: VSAH3Config
    gate_source: str = "none"
    calls: Counter = field(default_factory=Counter)          # "sparse" / dense reasons
    steps_sparse: set = field(default_factory=set)      # steps (sigma) with at least one sparse attention call
    steps_dense: set = field(default_factory=set)       # steps dense by rule (min_tokens, start/end percent)
    steps_seen: set = field(default_factory=set)        # every step whose forward reached the DiT
    backends: Counter = field(default_factory=Counter)
    block_pairs: int = 0
    block_pairs_dense: int = 0
    k_video: Optional[int] = None
    n_tiles: Optional[int] = None
    layouts: set = field(default_factory=set)
    kernels: Counter = field(default_factory=Counter)        # kernel selection -> forwards that resolved it
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    KEYS = ("keep=cfg.keep", "sparsity=cfg.sparsity", "backend_requested", "backends_used=backends", "calls",
            "steps_sparse", "steps_dense", "steps_without_attention", "measured_density=density", "k_video", "n_tiles",
            "gate=gate_source", "layouts", "kernels_per_forward=kernels")
    VALUES = {"backend_requested": lambda r: r.cfg.backend or "auto", "steps_sparse": lambda r: len(r.steps_sparse),
              "steps_dense": lambda r: len(r.steps_dense), "steps_without_attention": lambda r: len(r.steps_idle),
              "layouts": lambda r: sorted(r.layouts)}

    def fresh(self) -> "VSAH3Runtime":
        """A runtime with the same settings and no counts: the state of one sampling run (the host clones the
        installed runtime per run instead of resetting a shared one)."""
        return VSAH3Runtime(self.cfg, gate_source=self.gate_source)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.steps_sparse.clear()
            self.steps_dense.clear()
            self.steps_seen.clear()
            self.backends.clear()
            self.block_pairs = self.block_pairs_dense = 0
            self.layouts.clear()
            self.kernels.clear()

    # -- per forward -----------------------------------------------------------------------------------------
    def begin_forward(self, prefix_segments: tuple[int, ...], video_shape: tuple[int, int, int],
                      sigma: Optional[float]) -> ForwardCtx:
        layout = build_h3_layout(tuple(prefix_segments), tuple(video_shape))
        self.layouts.add(layout.describe())
        reason = ""
        if layout.seq_len < self.cfg.min_tokens:
            reason = f"below min_tokens ({layout.seq_len} < {self.cfg.min_tokens})"
        elif sigma is not None and not (self.cfg.sigma_end * (1 - 1e-5) <= sigma <= self.cfg.sigma_start * (1 + 1e-5)):
            # relative slack: the sampler's fp32 sigma vs the fp64 percent_to_sigma boundary
            reason = "outside start/end percent"
        sparse = not reason
        key = _step_key(sigma)
        with self._lock:
            self.steps_seen.add(key)
            if not sparse:
                self.steps_dense.add(key)
        return ForwardCtx(layout, sparse, reason, sigma)

    # -- per attention call ----------------------------------------------------------------------------------
    def dense_call(self, reason: str, ctx: Optional[ForwardCtx] = None) -> None:
        """A call that ran dense. With ``ctx`` (a packed-sequence DiT call of that forward), its step counts dense."""
        with self._lock:
            self.calls[reason] += 1
            if ctx is not None:
                self.steps_dense.add(_step_key(ctx.sigma))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardCtx,
                  gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        kn = ctx.kernels
        if kn is None or not kn.matches(q):
            # once per forward (FastVideo resolves its attention backend once and builds the metadata once per
            # forward): the registry is not consulted again by the other attention calls of this forward
            kn = ctx.kernels = resolve_h3_kernels(q.device, q.dtype, q.shape[-1], self.cfg.backend)
            with self._lock:
                self.kernels[kn.describe()] += 1
        out, st = vsa_h3_attention(q, k, v, ctx.layout, self.cfg.keep, gate=gate, exempt=self.cfg.exempt,
                                   sparsity=self.cfg.sparsity, kernels=kn)
        with self._lock:
            self.calls["sparse"] += 1
            self.steps_sparse.add(_step_key(ctx.sigma))
            self.backends[st.backend] += 1
            self.block_pairs += st.block_pairs
            self.block_pairs_dense += st.block_pairs_dense
            self.k_video, self.n_tiles = st.k_video, st.n_tiles
        return out

    # -- report ----------------------------------------------------------------------------------------------
    @property
    def steps_idle(self) -> set:
        """Steps whose forward ran no DiT attention at all (e.g. a TeaCache skip): neither sparse nor dense."""
        return self.steps_seen - self.steps_sparse - self.steps_dense

    @property
    def density(self) -> Optional[float]:
        return self.block_pairs / self.block_pairs_dense if self.block_pairs_dense else None

    def summary(self) -> str:
        used = ", ".join(f"{b}" for b in self.backends) or "none (no sparse call)"
        dense = {k: v for k, v in self.calls.items() if k != "sparse"}
        dens = f"{self.density:.3f}" if self.density is not None else "n/a"
        idle = len(self.steps_idle)
        return (f"VSA-H3 backend {used}; steps sparse {len(self.steps_sparse)} / dense {len(self.steps_dense)}"
                + (f" / {idle} without block attention (skipped by a step cache)" if idle else "") + "; "
                f"attention calls sparse {self.calls.get('sparse', 0)}, dense {sum(dense.values())}"
                + (f" ({self.kv_list(dense, ', ')})" if dense else "")
                + f"; measured block density {dens} (keep {self.cfg.keep:g}, k={self.k_video}); gate {self.gate_source}"
                + (f"; kernels resolved once per forward: {'; '.join(self.kernels)}" if self.kernels else ""))
