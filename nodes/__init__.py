"""ComfyUI-facing layer. The only package (with the root ``__init__``) that imports ComfyUI.

Every module in this package whose name does not start with ``_`` is imported and its ``NODES`` list
(``io.ComfyNode`` subclasses) is registered. A feature adds a module here and touches nothing else.
A module that fails to import is logged loudly and listed in :data:`IMPORT_ERRORS`; the other nodes
still load, so one broken optional dependency never takes the whole pack down. Every registered class gets the
execute-time checks of ``guards.py`` (each FLOAT input must be finite) without code of its own.
"""

from __future__ import annotations

if "." not in __name__:  # the checkout's root is on sys.path: never shadow ComfyUI's `nodes` & co.
    raise ImportError(f"{__name__!r} is a subpackage of ditkit, not a top-level module: import ditkit.{__name__} "
                      "(remove the ditkit checkout's own folder from sys.path / PYTHONPATH)")

import importlib
import logging
import pkgutil

from comfy_api.latest import ComfyExtension, io

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
            guard_node(cls, node_id, float_inputs(schema))   # every FLOAT input: finite, checked at execute
            found.append(cls)
    return found


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

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        nodes = discover_nodes()
        log.info("[ditkit] registered %d nodes%s", len(nodes),
                 f" ({len(IMPORT_ERRORS)} node modules failed: {sorted(IMPORT_ERRORS)})" if IMPORT_ERRORS else "")
        return nodes
