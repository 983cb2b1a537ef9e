"""ComfyUI-facing layer. The only package (with the root ``__init__``) that imports ComfyUI.

Every module in this package whose name does not start with ``_`` is imported and its ``NODES`` list
(``io.ComfyNode`` subclasses) is registered. A feature adds a module here and touches nothing else.
A module that fails to import is logged loudly and listed in :data:`IMPORT_ERRORS`; the other nodes
still load, so one broken optional dependency never takes the whole pack down. Every registered class gets the
execute-time checks of ``guards.py`` without code of its own: first the host contract (``bridge/contract.py``:
``require(node_id)`` refuses the node, naming the ComfyUI version, the host symbol and what differs, when an entry
it depends on is broken; checked once when the pack loads, :meth:`DitKitExtension.on_load`), then each FLOAT input
must be finite.
"""

from __future__ import annotations

if "." not in __name__:  # the checkout's root is on sys.path: never shadow ComfyUI's `nodes` & co.
    raise ImportError(f"{__name__!r} is a subpackage of ditkit, not a top-level module: import ditkit.{__name__} "
                      "(remove the ditkit checkout's own folder from sys.path / PYTHONPATH)")

import importlib
import logging
import pkgutil

from comfy_api.latest import ComfyExtension, io

from ..bridge import contract
from ..guards import float_inputs, guard_node
from . import _native_build  # noqa: F401 - shows the cpu_native kernel build on the waiting node

log = logging.getLogger("ditkit")

IMPORT_ERRORS: dict[str, str] = {}


def discover_nodes() -> list[type[io.ComfyNode]]:
    found: list[type[io.ComfyNode]] = []
    seen: set[str] = set()
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{__name__}.{info.name}")
        except Exception as e:  # noqa: BLE001 - reported, never silent
            IMPORT_ERRORS[info.name] = f"{type(e).__name__}: {e}"
            log.exception("[ditkit] node module %s failed to import; its nodes are not registered", info.name)
            continue
        for cls in getattr(mod, "NODES", []):
            _replay_cached_report(cls)
            schema = cls.GET_SCHEMA()
            node_id = schema.node_id
            if not node_id.startswith("DitKit"):
                raise RuntimeError(f"ditkit node id {node_id!r} must start with 'DitKit'")
            if node_id in seen:
                raise RuntimeError(f"duplicate ditkit node id {node_id!r}")
            seen.add(node_id)
            # at execute: the host contract of this node, then every FLOAT input finite
            guard_node(cls, node_id, float_inputs(schema), before=_contract_check(node_id))
            found.append(cls)
    return found


def _contract_check(node_id: str):
    """The execute-time host-contract check of ``node_id`` (one function per node id, so guarding is idempotent)."""
    fn = _CONTRACT_CHECKS.get(node_id)
    if fn is None:
        def fn():
            contract.require(node_id)

        fn.__qualname__ = f"require[{node_id}]"
        _CONTRACT_CHECKS[node_id] = fn
    return fn


_CONTRACT_CHECKS: dict = {}


def check_host_contract(refresh: bool = False) -> "contract.ContractTable":
    """Probe every host-contract entry on this ComfyUI (once per process) and log the summary: one line, plus one
    warning per broken entry naming the nodes that will refuse."""
    table = contract.check_all(refresh=refresh)
    states = [r.probe.state for r in table.results]
    log.info("[ditkit] host contract on ComfyUI %s: %d entries, %d hold, %d adapted, %d broken", table.host_version,
             len(states), states.count("holds"), states.count("adapted"), states.count("broken"))
    for r in table.results:
        if r.probe.state == "adapted":
            log.info("[ditkit] host contract: %s adapted: %s", r.entry.symbol, r.probe.note)
    for r in table.broken():
        log.warning("[ditkit] host contract: %s BROKEN on ComfyUI %s: %s; these nodes refuse to run: %s",
                    r.entry.symbol, table.host_version, r.probe.note, ", ".join(r.entry.nodes))
    return table


def _replay_cached_report(cls) -> None:
    """Flag the node ``has_intermediate_output`` (output nodes already are): when a later prompt is served this
    node's output from ComfyUI's cache, even under another node id, ComfyUI resends the cached ``ui`` (the node's
    report) as an ``executed`` event for the node of *that* prompt, so the badge shows the report of the output
    it uses; without the flag a cached intermediate node sends nothing and keeps whatever it showed before."""
    base = cls.__dict__.get("define_schema")
    if base is None or getattr(base.__func__, "_ditkit_replay", False):
        return
    fn = base.__func__

    def define_schema(c):
        schema = fn(c)
        if not schema.is_output_node:
            schema.has_intermediate_output = True
        return schema

    define_schema._ditkit_replay = True
    define_schema.__doc__ = fn.__doc__
    cls.define_schema = classmethod(define_schema)


class DitKitExtension(ComfyExtension):
    async def on_load(self) -> None:
        from .._version_check import check_host

        check_host(log)
        check_host_contract()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        nodes = discover_nodes()
        log.info("[ditkit] registered %d nodes%s", len(nodes),
                 f" ({len(IMPORT_ERRORS)} node modules failed: {sorted(IMPORT_ERRORS)})" if IMPORT_ERRORS else "")
        return nodes
