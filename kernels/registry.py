"""One registry for every ditkit kernel op.

Each op has a name, a pure-torch reference and zero or more accelerated implementations. An
implementation declares a capability check ``check(query, explicit) -> reason | None`` (device, compute
capability, dtype, head dim, installed package). :meth:`Registry.resolve` picks the first capable
implementation in priority order (the reference last) once per (op, device, dtype, head_dim, request) and
caches the answer; the chosen backend and the reason each other one was rejected stay queryable
(:class:`Selection`) and are logged once.

Rules (tested with mocked capabilities in ``tests/unit/test_kernels_registry.py``):

* an explicitly requested backend is used or refused with :class:`BackendError` -- never swapped;
* approximate implementations (``exact=False``) are only used on explicit request, never picked by ``auto``;
* ``auto`` only picks code that has run: an implementation that has never been run on any hardware
  (``unverified`` = why, e.g. no device of its kind was available) is used on explicit request only, and its
  :class:`Selection` says so (``verified=False``, also in ``summary()`` / ``as_dict()``);
* no retry: the registry hands out one callable; a device error raised by it propagates to the caller and no
  other kernel is launched (a device fault can poison the context).
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import BackendError
from ..report import Report

log = logging.getLogger("ditkit.kernels")

REFERENCE = "reference"


@dataclass(frozen=True)
class Query:
    op: str
    device_type: str
    device_index: Optional[int]
    capability: Optional[tuple[int, int]]
    dtype: torch.dtype
    head_dim: int


CheckFn = Callable[[Query, bool], Optional[str]]


@dataclass
class Impl:
    name: str
    fn: Optional[Callable]
    check: CheckFn
    exact: bool = True
    priority: int = 100          # lower first
    note: str = ""
    unverified: Optional[str] = None  # never run on any hardware: why (explicit only); None = exercised by tests
    explicit_only: bool = False      # its check never lets auto pick it (e.g. builds an extension on first use)
    placeholder: bool = False        # registered so its refusal is explained; never has a launcher


@dataclass
class Op:
    name: str
    reference: Callable
    impls: dict[str, Impl] = field(default_factory=dict)


@dataclass(frozen=True)
class Selection(Report):
    op: str
    backend: str
    fn: Callable
    exact: bool
    rejected: tuple[tuple[str, str], ...]
    query: Query
    unverified: Optional[str] = None     # set when an explicitly chosen backend has never been run anywhere

    KEYS = ("op", "backend", "exact", "verified", "unverified", "rejected", "device=query.device_type",
            "capability=query.capability", "dtype", "head_dim=query.head_dim")
    VALUES = {"rejected": lambda s: dict(s.rejected), "dtype": lambda s: str(s.query.dtype).replace("torch.", "")}

    @property
    def verified(self) -> bool:
        return self.unverified is None

    def summary(self) -> str:
        rej = self.kv_list(self.rejected) or "none"
        warn = f" [chosen explicitly, UNVERIFIED: {self.unverified}]" if self.unverified else ""
        return f"{self.op} -> {self.backend}{warn} (rejected: {rej})"


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """Compute capability of a CUDA device (None elsewhere). Tests monkeypatch this."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def package_available(name: str) -> bool:
    """Whether ``name`` is importable (tests monkeypatch this)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def triton_interpreter() -> bool:
    """Whether ditkit's Triton kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from . import _triton

    return bool(_triton.INTERPRETED)


class Registry:
    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}
        self._cache: dict[tuple, Selection] = {}
        self._logged: set[tuple] = set()

    # -- registration -------------------------------------------------------------------------------------
    def op(self, name: str, reference: Callable) -> Op:
        if name in self.ops:
            self.ops[name].reference = reference
        else:
            self.ops[name] = Op(name, reference)
        self._cache.clear()
        return self.ops[name]

    def impl(self, op: str, impl: Impl) -> Impl:
        if op not in self.ops:
            raise KeyError(f"register op {op!r} (with its reference) before its implementations")
        self.ops[op].impls[impl.name] = impl
        self._cache.clear()
        return impl

    def unverified(self, op: str, backend: str) -> Optional[str]:
        """Why ``backend`` of ``op`` is unverified (never run on any hardware), or None."""
        impl = self.ops[op].impls.get(backend) if op in self.ops else None
        return impl.unverified if impl is not None else None

    def backends(self, op: str) -> list[str]:
        o = self.ops[op]
        return [i.name for i in sorted(o.impls.values(), key=lambda i: i.priority)] + [REFERENCE]

    def menu(self, op: str) -> list[str]:
        """The backends of ``op`` in the order a node offers them (static: the same list on every machine): the
        ones ``auto`` may pick, by priority; explicit-only ones; the reference; unverified ones; placeholders."""
        def group(i: Impl) -> int:
            return 4 if i.placeholder else 3 if i.unverified else 1 if i.explicit_only or not i.exact else 0

        impls = sorted(self.ops[op].impls.values(), key=lambda i: (group(i), i.priority))
        return ([i.name for i in impls if group(i) < 2] + [REFERENCE] + [i.name for i in impls if group(i) >= 2])

    def clear_cache(self) -> None:
        self._cache.clear()
        self._logged.clear()

    # -- resolution ---------------------------------------------------------------------------------------
    def query(self, op: str, device, dtype: torch.dtype, head_dim: int) -> Query:
        device = torch.device(device)
        cap = device_capability(device) if device.type == "cuda" else None
        return Query(op, device.type, device.index, cap, dtype, int(head_dim))

    def resolve(self, op: str, device, dtype: torch.dtype, head_dim: int, backend: Optional[str] = None) -> Selection:
        if op not in self.ops:
            raise KeyError(f"unknown kernel op {op!r}; known: {sorted(self.ops)}")
        req = None if backend in (None, "", "auto") else str(backend)
        dev = torch.device(device)
        key = (op, dev.type, dev.index, dtype, int(head_dim), req)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        o = self.ops[op]
        q = self.query(op, dev, dtype, head_dim)
        rejected: list[tuple[str, str]] = []
        chosen: Optional[Selection] = None
        if req is not None:
            if req == REFERENCE:
                chosen = Selection(op, REFERENCE, o.reference, True, (), q)
            elif req not in o.impls:
                raise BackendError(f"kernel backend {req!r} is not known for {op}; choose one of "
                                   f"{['auto'] + self.backends(op)}")
            else:
                impl = o.impls[req]
                reason = impl.check(q, True)
                if reason is None and impl.fn is None:
                    reason = "no launcher is implemented for this backend"
                if reason is not None:
                    raise BackendError(f"kernel backend {req!r} cannot run {op} here: {reason} "
                                       f"(device={dev}, dtype={str(dtype).replace('torch.', '')}, head_dim={head_dim}). "
                                       "Pick another backend explicitly or use 'auto'.")
                chosen = Selection(op, req, impl.fn, impl.exact, (), q, unverified=impl.unverified)
        else:
            for impl in sorted(o.impls.values(), key=lambda i: i.priority):
                if not impl.exact:
                    rejected.append((impl.name, "approximate; only used when requested explicitly"))
                    continue
                reason = impl.check(q, False)
                if reason is None and impl.fn is None:
                    reason = "no launcher is implemented for this backend"
                if reason is None and impl.unverified:
                    reason = (f"never run on any hardware ({impl.unverified}); auto picks only backends that have "
                              "run, request it explicitly to use it")
                if reason is not None:
                    rejected.append((impl.name, reason))
                    continue
                chosen = Selection(op, impl.name, impl.fn, True, tuple(rejected), q)
                break
            if chosen is None:
                chosen = Selection(op, REFERENCE, o.reference, True, tuple(rejected), q)
        self._cache[key] = chosen
        if key not in self._logged:
            self._logged.add(key)
            (log.warning if chosen.unverified else log.info)("[ditkit] kernel %s", chosen.summary())
        return chosen

    def explain(self, op: str, device, dtype: torch.dtype, head_dim: int) -> dict[str, str]:
        """Every backend of ``op`` with 'ok' or the reason it cannot run (nothing cached)."""
        o = self.ops[op]
        q = self.query(op, device, dtype, head_dim)
        out = {}
        for impl in sorted(o.impls.values(), key=lambda i: i.priority):
            r = impl.check(q, True)
            if r is None and impl.fn is None:
                r = "no launcher is implemented for this backend"
            if r is None and impl.unverified:
                r = f"ok (explicit only, UNVERIFIED: never run on any hardware: {impl.unverified})"
            out[impl.name] = r or ("ok" if impl.exact else "ok (approximate, explicit only)")
        out[REFERENCE] = "ok"
        return out


REGISTRY = Registry()


# -- common capability helpers ---------------------------------------------------------------------------
def triton_check(q: Query, explicit: bool, has_triton: bool, head_dim_error: Optional[str]) -> Optional[str]:
    """Shared capability rule of every Triton impl: installed, head dim/dtype supported, sm80+ CUDA, or CPU only
    under ``TRITON_INTERPRET=1`` on explicit request (tests). ``head_dim_error`` is the op's own head-dim verdict."""
    if not has_triton:
        return "triton is not installed"
    if head_dim_error:
        return head_dim_error
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} not supported"
    if q.device_type == "cpu":
        if triton_interpreter() and explicit:
            return None
        return "CPU runs Triton only under TRITON_INTERPRET=1 and on explicit request (tests)"
    return need_cuda(q, (8, 0))


def need_cuda(q: Query, min_cc: tuple[int, int] = (8, 0)) -> Optional[str]:
    if q.device_type != "cuda":
        return f"needs a CUDA device (got {q.device_type})"
    if q.capability is None or tuple(q.capability) < tuple(min_cc):
        return f"needs compute capability >= sm{min_cc[0]}{min_cc[1]} (got {q.capability})"
    return None
