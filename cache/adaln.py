"""H3 AdaLN schedule tables: precomputed modulation outputs keyed by the exact time-embedding input.

H3's AdaLN projections (``blocks.N.adaln_proj`` and ``final_layer.adaln_proj``) map the time embedding of the
forward's unique timesteps, ``t_emb [M, t_dim]``, to ``linear(silu(t_emb))`` (curve-form checkpoints: no SiLU).
The output depends only on the timestep values, never on the content, so for a known sigma schedule every
block's output can be computed once, before sampling, and looked up afterwards; the 13 B AdaLN parameters then
do not need to stay on the device.

Exactness: a table entry is keyed by the exact bytes (plus dtype, shape and device type) of the ``t_emb``
tensor the model feeds the projection. An entry is only ever built by running the projection's own ``linear``
on a ``t_emb`` tensor equal bit for bit to the key, on the same device, with the same row count ``M`` (GEMM
results may depend on ``M``), so a hit returns exactly what the uncached forward computes. Anything that does
not match (a mask that adds per-row timesteps, a sampler that evaluates between schedule points, a different
device or dtype) is a miss: the projection runs with its weights (brought back to the device if they were
parked), the miss is counted and reported, and the result is kept for the rest of the run.

Identity: an installed set of tables belongs to one ``signature`` (schedule fp32 bit patterns, model identity =
weights fingerprint + applied patches, device, dtype, layout variant). A different signature rebuilds: weights
back on the device, new tables computed from the live (patched) weights, swapped in atomically, weights parked
again. A stale table is never consulted because lookups only happen through the installed dictionary, which is
replaced as a whole.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass, field

import torch

from ..errors import DitKitError
from ..report import Report


class ScheduleError(DitKitError):
    """A sigma schedule the AdaLN cache cannot key (NaN/inf values, empty)."""


def fp32_bits(values) -> tuple[int, ...]:
    """Exact IEEE-754 float32 bit patterns of ``values`` (a tensor or a sequence of floats)."""
    if isinstance(values, torch.Tensor):
        v = values.detach().to("cpu", torch.float32).reshape(-1)
        return tuple(int(x) for x in v.view(torch.int32).tolist())
    return tuple(struct.unpack("<i", struct.pack("<f", float(x)))[0] for x in values)


def check_schedule(sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.detach().to("cpu", torch.float32).reshape(-1)
    if s.numel() == 0:
        raise ScheduleError("AdaLN cache: the sigma schedule is empty")
    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        idx = int(bad.nonzero()[0])
        raise ScheduleError(f"AdaLN cache: sigma schedule value #{idx} is {float(s[idx])!r}; every sigma must be "
                            "finite. Fix the scheduler/sigmas input; no tables were built and the model is unchanged.")
    return s


def tensor_key(t: torch.Tensor) -> tuple:
    """Exact content key of a small tensor: (dtype, shape, device type, sha1 of its bytes)."""
    host = t.detach().contiguous().to("cpu")
    raw = host.view(torch.uint8) if host.dtype != torch.bool else host.to(torch.uint8)
    digest = hashlib.sha1(raw.numpy().tobytes()).hexdigest()
    return (str(t.dtype), tuple(t.shape), t.device.type, digest)


@dataclass
class AdalnStats(Report):
    hits: int = 0
    misses: int = 0
    rebuilds: int = 0
    hot_runs: int = 0
    entries: int = 0
    table_bytes: int = 0
    weight_bytes_parked: int = 0
    weight_bytes_total: int = 0
    park_mode: str = "device"
    build_seconds: float = 0.0
    miss_keys: list = field(default_factory=list)
    last_signature: str = ""

    VALUES = {"miss_keys": lambda s: list(s.miss_keys)[:16]}

    def summary(self) -> str:
        return (f"AdaLN tables: {self.hits} hits, {self.misses} misses, {self.rebuilds} rebuilds, "
                f"{self.hot_runs} hot runs; {self.entries} entries = {self.table_bytes / 2**20:.3f} MiB tables; "
                f"weights parked off-device {self.weight_bytes_parked / 2**20:.3f} of "
                f"{self.weight_bytes_total / 2**20:.3f} MiB ({self.park_mode})")


class CachedAdalnProj(torch.nn.Module):
    """Drop-in for an H3 ``AdalnProj``: same attributes (``linear``, ``expand``, ``modalities``, ``hidden``,
    ``apply_silu``) so weight patches keyed ``...adaln_proj.linear.weight`` still resolve; ``forward`` returns the
    table entry for ``t_emb`` or computes (and reports) on a miss."""

    def __init__(self, orig: torch.nn.Module, cache: "AdalnScheduleCache", slot: int, name: str):
        super().__init__()
        self.linear = orig.linear
        self.expand = orig.expand
        self.modalities = orig.modalities
        self.hidden = orig.hidden
        self.apply_silu = orig.apply_silu
        self.slot = slot
        self.block_name = name
        object.__setattr__(self, "_cache", cache)

    def compute(self, t_emb: torch.Tensor) -> torch.Tensor:
        """The uncached projection output (pre-chunk), exactly as the original module computes it."""
        return self.linear(torch.nn.functional.silu(t_emb) if self.apply_silu else t_emb)

    def split(self, x: torch.Tensor):
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)

    def forward(self, t_emb):
        return self.split(self._cache.project(self, t_emb))


class AdalnScheduleCache:
    """Owns the installed tables of a set of :class:`CachedAdalnProj` modules (one model)."""

    def __init__(self):
        self.modules: list[CachedAdalnProj] = []
        self.entries: dict[tuple, list[torch.Tensor]] = {}
        self.signature: tuple | None = None
        self.stats = AdalnStats()
        self._memo: tuple | None = None       # (tensor object id, _version, key) of the last t_emb seen
        self._parked: dict[int, torch.device] = {}   # id(param) -> device it came from
        self._lock = threading.RLock()
        self.park_enabled = True
        # which tensors live on an accelerator and should be parked (injectable so the bookkeeping can be
        # exercised on a CPU-only machine)
        self.on_accelerator = lambda p: p.device.type not in ("cpu", "meta")
        self.park_events = 0        # tensors moved to host (cumulative)
        self.unpark_events = 0      # tensors moved back (cumulative)

    def wrap(self, orig: torch.nn.Module, name: str) -> CachedAdalnProj:
        m = CachedAdalnProj(orig, self, len(self.modules), name)
        self.modules.append(m)
        return m

    # -- keys ----------------------------------------------------------------------------------------------
    def key_of(self, t_emb: torch.Tensor) -> tuple:
        """Exact key of ``t_emb``, computed once per tensor object (one device->host read per forward, not one
        per block). The memo holds a reference, so the object cannot be freed and its id reused. Normal tensors
        are re-keyed if their version counter moved (an in-place write); inference-mode tensors have no version
        counter, and the memo then relies on H3's forward never writing into ``t_emb`` (it builds it fresh per
        forward and only reads it)."""
        try:
            version = t_emb._version
        except RuntimeError:  # inference tensor (ComfyUI samples under torch.inference_mode)
            version = None
        memo = self._memo
        if memo is not None and memo[0] is t_emb and memo[1] == version and memo[2] == t_emb.data_ptr():
            return memo[3]
        k = tensor_key(t_emb)
        self._memo = (t_emb, version, t_emb.data_ptr(), k)
        return k

    # -- weights -------------------------------------------------------------------------------------------
    def _params(self):
        for m in self.modules:
            for p in m.linear._parameters.values():
                if p is not None:
                    yield p

    def _is_parked(self, p) -> bool:
        rec = self._parked.get(id(p))
        return rec is not None and p.data.data_ptr() == rec[1]

    def park(self) -> int:
        """Move AdaLN weights that live on an accelerator to (pinned) host memory. Returns bytes parked.

        A parameter counts as parked only while it still holds the host copy made here: if the host framework
        moved it back (a model reload), it is parked again."""
        total = parked = 0
        for p in self._params():
            n = p.numel() * p.element_size()
            total += n
            if self._is_parked(p):
                parked += n
                continue
            self._parked.pop(id(p), None)
            if not self.park_enabled or not self.on_accelerator(p) or type(p.data) is not torch.Tensor:
                continue  # (tensor subclasses, e.g. quantized weights, are left where the host put them)
            self._park_one(p, p.device)
            parked += n
        self.stats.weight_bytes_total = total
        self.stats.weight_bytes_parked = parked
        return parked

    def _park_one(self, p, dev) -> None:
        host = torch.empty(p.shape, dtype=p.dtype, pin_memory=torch.device(dev).type == "cuda")
        host.copy_(p.data)
        p.data = host
        self._parked[id(p)] = (dev, host.data_ptr())
        self.park_events += 1

    def unpark(self, params=None) -> None:
        for p in (params if params is not None else list(self._params())):
            if self._is_parked(p):
                dev = self._parked.pop(id(p))[0]
                p.data = p.data.to(dev, non_blocking=False)
                self.unpark_events += 1
            else:
                self._parked.pop(id(p), None)
        if params is None:
            self.stats.weight_bytes_parked = 0

    # -- tables --------------------------------------------------------------------------------------------
    def build(self, signature: tuple, t_embs: list[torch.Tensor], clock=None) -> bool:
        """Install tables for ``signature``. Returns False (hot) when they are already installed."""
        with self._lock:
            if signature == self.signature:
                self.stats.hot_runs += 1
                self.park()
                return False
            import time

            t0 = (clock or time.perf_counter)()
            self.unpark()
            new: dict[tuple, list[torch.Tensor]] = {}
            with torch.no_grad():
                for te in t_embs:
                    k = tensor_key(te)
                    if k in new:
                        continue
                    new[k] = [m.compute(te) for m in self.modules]
            # atomic install: lookups read self.entries once per call
            self.entries = new
            self.signature = signature
            self._memo = None
            self.stats.rebuilds += 1
            self.stats.entries = len(new)
            self.stats.table_bytes = self._table_bytes(new)
            self.stats.last_signature = hashlib.sha1(repr(signature).encode()).hexdigest()[:12]
            self.stats.build_seconds = (clock or time.perf_counter)() - t0
            self.park()
            return True

    def invalidate(self) -> None:
        with self._lock:
            self.unpark()
            self.entries = {}
            self.signature = None
            self._memo = None
            self.stats.entries = 0
            self.stats.table_bytes = 0

    @staticmethod
    def _table_bytes(entries) -> int:
        return sum(t.numel() * t.element_size() for v in entries.values() for t in v)

    def project(self, mod: CachedAdalnProj, t_emb: torch.Tensor) -> torch.Tensor:
        entries = self.entries
        k = self.key_of(t_emb)
        row = entries.get(k)
        if row is not None and row[mod.slot] is not None:
            self.stats.hits += 1
            return row[mod.slot]
        # miss: compute exactly as uncached, weights temporarily back on their device
        with self._lock:
            self.stats.misses += 1
            if len(self.stats.miss_keys) < 64:
                self.stats.miss_keys.append(f"{mod.block_name}:{k[3][:10]}:M={k[1][0] if k[1] else 0}")
            params = [p for p in mod.linear._parameters.values() if p is not None]
            was_parked = [(p, self._parked[id(p)][0]) for p in params if self._is_parked(p)]
            self.unpark([p for p, _ in was_parked])
            try:
                with torch.no_grad():
                    out = mod.compute(t_emb)
            finally:
                for p, dev in was_parked:
                    self._park_one(p, dev)
            if self.entries is entries:
                slot_row = entries.setdefault(k, [None] * len(self.modules))
                if slot_row[mod.slot] is None:
                    slot_row[mod.slot] = out
                    self.stats.table_bytes += out.numel() * out.element_size()
                if all(x is not None for x in slot_row):
                    self.stats.entries = len(entries)
            return out

    def report(self) -> AdalnStats:
        return self.stats


# -- sizes (from shapes; no weights needed) ------------------------------------------------------------------
H3_REAL = {"blocks": 50, "block_out": 96768, "final_out": 10752, "t_dim": 2688, "bytes": 2}


def h3_adaln_sizes(unique_rows_total: int, cfg: dict = H3_REAL) -> dict:
    """Weight bytes of H3's AdaLN projections vs table bytes for ``unique_rows_total`` time-embedding rows.

    ``unique_rows_total`` = sum over the forwards' distinct ``t_emb`` tensors of their row count M (e.g. 49
    Euler forwards of t2va with t_v != t_a -> 98)."""
    b, bo, fo, td, nb = cfg["blocks"], cfg["block_out"], cfg["final_out"], cfg["t_dim"], cfg["bytes"]
    weights = (b * (bo * td + bo) + (fo * td + fo)) * nb
    per_row = (b * bo + fo) * nb
    return {"weight_bytes": weights, "table_bytes_per_row": per_row,
            "table_bytes": per_row * unique_rows_total, "rows": unique_rows_total,
            "ratio_removed_over_added": weights / max(per_row * unique_rows_total, 1)}
