"""``python -m ditkit.workflows``: the entry point of the workflow tools (UI <-> API conversion, example twins).

The code and its documentation live in :mod:`ditkit.runner.workflows`; this module re-exports the names callers
import from it.
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
    from ._cli import run_cli

    raise SystemExit(run_cli(main, None, "python -m ditkit.workflows"))
