"""The host contract: every assumption ditkit makes about the ComfyUI it runs in, as one registry.

Each :class:`Entry` names a host symbol or behaviour (module, name, what is read of it), the ditkit nodes that
depend on it, and a cheap probe run once when the pack loads (:func:`check_all`, on whatever ComfyUI it is in). A
probe returns a :class:`Probe`: ``holds`` (the 0.33 semantics ditkit was built on), ``adapted`` (a newer host's
semantics that ditkit detected and follows; the note says which) or ``broken`` (drift ditkit does not know: the
note says what differs). A broken entry makes exactly its dependent nodes refuse at execute
(:func:`require`), naming the ComfyUI version, the symbol and the difference; every other node keeps working.

Probes import ComfyUI lazily; a probe that raises is itself reported as broken (the exception text is the note),
so the check never takes the pack down. ``python -m ditkit.host check --contract [--comfyui PATH]`` prints the
table for any ComfyUI.

Modules of ``bridge/`` declare their entries next to the code that relies on them::

    @entry("comfy.ldm.minimax.model.DiTBlock.forward", nodes=("DitKitTeaCache", ...), what="signature")
    def _dit_block_forward():
        ...
        return Probe.holds() / Probe.adapted("0.35+: takes attention=") / Probe.broken("...")
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

from ..errors import DitKitError

State = Literal["holds", "adapted", "broken"]


@dataclass(frozen=True)
class Probe:
    state: State
    note: str = ""

    @classmethod
    def holds(cls, note: str = "") -> "Probe":
        return cls("holds", note)

    @classmethod
    def adapted(cls, note: str) -> "Probe":
        return cls("adapted", note)

    @classmethod
    def broken(cls, note: str) -> "Probe":
        return cls("broken", note)


@dataclass(frozen=True)
class Entry:
    symbol: str                      # "comfy.ldm.minimax.model.DiTBlock.forward"
    nodes: tuple[str, ...]           # node ids that refuse when this entry is broken
    what: str                        # "symbol" | "signature" | "attributes" | "behaviour" | "feature"
    probe: Callable[[], Probe]
    doc: str = ""                    # one line: what ditkit relies on


@dataclass
class Result:
    entry: Entry
    probe: Probe

    def row(self) -> dict:
        return {"symbol": self.entry.symbol, "what": self.entry.what, "state": self.probe.state,
                "note": self.probe.note, "nodes": list(self.entry.nodes)}


@dataclass
class ContractTable:
    host_version: str
    results: list[Result] = field(default_factory=list)

    def broken(self) -> list[Result]:
        return [r for r in self.results if r.probe.state == "broken"]

    def for_node(self, node_id: str) -> list[Result]:
        return [r for r in self.results if node_id in r.entry.nodes]

    def rows(self) -> list[dict]:
        return [r.row() for r in self.results]


_ENTRIES: dict[str, Entry] = {}
_LOCK = threading.Lock()
_TABLE: ContractTable | None = None


def entry(symbol: str, *, nodes: Iterable[str], what: str, doc: str = ""):
    """Register the decorated zero-argument probe as the contract entry ``symbol`` (one entry per symbol)."""
    def deco(fn: Callable[[], Probe]) -> Callable[[], Probe]:
        e = Entry(symbol, tuple(nodes), what, fn, doc or (fn.__doc__ or "").strip().split("\n")[0])
        with _LOCK:
            old = _ENTRIES.get(symbol)
            if old is not None and old.probe.__qualname__ != fn.__qualname__:
                raise ValueError(f"host contract entry {symbol!r} registered twice ({old.probe.__qualname__}, "
                                 f"{fn.__qualname__})")
            _ENTRIES[symbol] = e
        return fn
    return deco


def entries() -> list[Entry]:
    with _LOCK:
        return list(_ENTRIES.values())


def run_probe(e: Entry) -> Probe:
    try:
        p = e.probe()
    except Exception as ex:  # a probe that fails is drift, reported, never a crash at load
        return Probe.broken(f"probe raised {type(ex).__name__}: {ex}")
    if not isinstance(p, Probe):
        return Probe.broken(f"probe returned {type(p).__name__}, not a Probe")
    return p


def host_version() -> str:
    try:
        from comfyui_version import __version__  # ComfyUI's own version file
        return str(__version__)
    except Exception:
        return "unknown"


def check_all(*, refresh: bool = False) -> ContractTable:
    """Probe every entry once (cached for the process; ``refresh`` re-probes)."""
    global _TABLE
    with _LOCK:
        if _TABLE is not None and not refresh:
            return _TABLE
    _load_entry_modules()
    table = ContractTable(host_version(), [Result(e, run_probe(e)) for e in entries()])
    with _LOCK:
        _TABLE = table
    return table


def reset() -> None:
    """Forget the cached table (tests; a host variant installed in-process)."""
    global _TABLE
    with _LOCK:
        _TABLE = None


def require(node_id: str) -> list[Result]:
    """Raise a :class:`DitKitError` naming the ComfyUI version, each broken symbol and what differs when an entry
    ``node_id`` depends on is broken; return the node's adapted entries (for its report) otherwise."""
    table = check_all()
    mine = table.for_node(node_id)
    bad = [r for r in mine if r.probe.state == "broken"]
    if bad:
        lines = "; ".join(f"{r.entry.symbol}: {r.probe.note}" for r in bad)
        raise DitKitError(f"{node_id} cannot run on ComfyUI {table.host_version}: the host differs from what ditkit "
                          f"relies on ({lines}). Other ditkit nodes keep working; see `python -m ditkit.host check "
                          f"--contract` and docs/compat.md.")
    return [r for r in mine if r.probe.state == "adapted"]


# Modules that declare entries (imported by check_all so the registry is complete whichever node ran first).
ENTRY_MODULES: tuple[str, ...] = ("contract_entries", "hostcompat", "quant_requant", "adapter_bypass",
                                  "load_progress", "chunking", "preflight", "turbo_curve")


def _load_entry_modules() -> None:
    import importlib

    for mod in ENTRY_MODULES:
        importlib.import_module(f"{__package__}.{mod}")
