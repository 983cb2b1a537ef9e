"""ComfyUI workflow formats: API <-> UI (litegraph) conversion and the example-workflow twins.

ditkit keeps every example workflow in API format (``example_workflows/api/<name>.json``: what the
integration tests queue on /prompt) and ships a UI-format twin (``example_workflows/<name>.json``: what
ComfyUI's template browser opens). Mapping between the two needs each node's input order and which inputs are
widgets, i.e. the server's ``/object_info``. Each twin carries a compact copy of the schemas of the node
classes it uses (``extra.ditkit_schemas``; the frontend keeps and ignores it), so a twin can be checked and
regenerated without a server (CI) and adding a workflow touches no shared file; an integration test checks the
embedded schemas against a live server.

CLI::

    python -m ditkit.workflows sync [--check] [--comfyui PATH | --server URL]
    python -m ditkit.workflows to-ui API.json [-o UI.json] [--comfyui PATH | --server URL]
    python -m ditkit.workflows to-api UI.json [-o API.json] [--comfyui PATH | --server URL]

``sync`` rewrites every twin from its API source (``--check``: only report, exit 1 when a twin is stale,
missing or orphaned). Schemas come from ``--comfyui``/``--server`` (``/object_info``; use this after adding a
workflow or changing a node's inputs) or else from the schemas embedded in the twins.

Plain Python (no ComfyUI, no torch imports). The code lives in :mod:`ditkit.runner.workflows`; this module is the
``python -m ditkit.workflows`` entry point and keeps the names callers import from it.
"""
from __future__ import annotations

from .runner.workflows import (EMBED_KEY, EXAMPLES_DIR, PACK_ROOT, api_to_ui, api_workflows, apply_layout,
                               as_ui_would_send, check_ui_workflow, compact_schema, dumps, embedded_schemas,
                               known_schemas, load_layout, main, node_extent, schema_drift, schemas_from,
                               strip_meta, sync, twin_of, twin_path, ui_to_api, used_classes)

__all__ = ["EMBED_KEY", "EXAMPLES_DIR", "PACK_ROOT", "api_to_ui", "api_workflows", "apply_layout",
           "as_ui_would_send", "check_ui_workflow", "compact_schema", "dumps", "embedded_schemas", "known_schemas",
           "load_layout", "main", "node_extent", "schema_drift", "schemas_from", "strip_meta", "sync", "twin_of",
           "twin_path", "ui_to_api", "used_classes"]

if __name__ == "__main__":
    raise SystemExit(main())
