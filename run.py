"""Headless runner: queue a workflow on a real ComfyUI over HTTP and report what happened.

    python -m ditkit.run WORKFLOW.json [--comfyui PATH | --server URL] [--out DIR] [--python PY]
                                       [--models DIR] [--timeout S]

* ``--server URL`` uses a running ComfyUI; ``--comfyui PATH`` (else ``$COMFYUI_PATH``, else ditkit's cached host
  made by ``python -m ditkit.host setup``; the runner says which) starts one:
  ``<python> main.py --cpu --listen 127.0.0.1 --port <free port> --disable-auto-launch ...`` with an
  ``--extra-model-paths-config`` YAML whose ``custom_nodes`` entry is a temp dir holding a symlink to this
  repository (ditkit is loaded without touching the ComfyUI tree) and whose model folders point at
  ``--models DIR`` (default: the tiny test checkpoints, generated into a temp dir). The server it started is
  stopped by its pid (SIGTERM, then SIGKILL after a grace period).
* The workflow may be API format or UI (litegraph) format; UI format is converted with the server's
  ``/object_info`` (:mod:`ditkit.workflows`).
* Shows progress (websocket events when available, else queue polling), prints ditkit reports, output files,
  validation errors (HTTP 400 ``node_errors``) and execution errors (``/history`` messages).

Exit status (every failure prints one ``ERROR: ...`` / ``FAILED: ...`` line first, never a traceback):

* 0 the workflow ran;
* 1 the server refused or failed the workflow (HTTP 400 validation errors, an execution error, or the
  ``--timeout`` passed: the prompt is cancelled);
* 2 bad arguments or a bad workflow file, found before any server is started or contacted: an unknown option,
  a malformed ``--server`` URL (scheme, host, port 1..65535, no query/fragment), a timeout that is not a
  finite number > 0, a ``--port`` outside 0..65535, a missing ``--comfyui``/``--models``/``--python``; a
  workflow file that is missing, not a regular file, larger than 64 MiB, not UTF-8, not strict JSON (NaN,
  Infinity and duplicate keys are refused), nested deeper than 64 levels, or whose structure is broken (API:
  nodes that are not objects with a string ``class_type``, ``inputs`` that are not an object, links to missing
  nodes; UI: non-integer or repeated node/link ids, malformed links, links from missing nodes); also a UI
  workflow the server's node schemas cannot convert (unknown node class);
* 3 the server could not be started or reached (the server log tail is printed);
* 130 interrupted (Ctrl-C); 143 stopped by SIGTERM (the started server is stopped either way).

Standard library only (no ComfyUI import, no torch import unless tiny checkpoints are generated), so the same
code drives the integration tests (``tests/integration/conftest.py``).

The code lives in :mod:`ditkit.runner` (``client`` talks to a server, ``server`` starts one, ``workflow_file``
reads and checks the file, ``workflows`` converts UI <-> API format, ``cli`` is this command); this module is the
``python -m ditkit.run`` entry point and keeps the names callers import from it.
"""
from __future__ import annotations

from .runner.cli import build_parser, check_server_url, main, parse_args, report_success
from .runner.client import (ComfyClient, ProgressPrinter, _WebSocket, ditkit_reports, download_outputs,
                            format_execution_errors, format_node_errors, history_messages, output_files,
                            output_items)
from .runner.common import (EXIT_FAILED, EXIT_OK, EXIT_SERVER, EXIT_USAGE, REPO, RunnerError, WorkflowFailed,
                            WorkflowFileError)
from .runner.server import (MODEL_FOLDERS, PACK_LINK_NAME, ComfyServer, extra_paths_yaml, free_port, pick_python,
                            server_command, stop_pid, write_extra_paths_yaml, yaml_quote)
from .runner.workflow_file import (MAX_WORKFLOW_BYTES, MAX_WORKFLOW_DEPTH, check_api_workflow, is_ui_format,
                                   load_workflow_file, parse_workflow_json, to_api)

__all__ = [
    "EXIT_FAILED", "EXIT_OK", "EXIT_SERVER", "EXIT_USAGE", "MAX_WORKFLOW_BYTES", "MAX_WORKFLOW_DEPTH", "MODEL_FOLDERS",
    "PACK_LINK_NAME", "REPO", "ComfyClient", "ComfyServer", "ProgressPrinter", "RunnerError", "WorkflowFailed",
    "WorkflowFileError", "_WebSocket", "build_parser", "check_api_workflow", "check_server_url", "ditkit_reports",
    "download_outputs", "extra_paths_yaml", "format_execution_errors", "format_node_errors", "free_port",
    "history_messages", "is_ui_format", "load_workflow_file", "main", "output_files", "output_items", "parse_args",
    "parse_workflow_json", "pick_python", "report_success", "server_command", "stop_pid", "to_api",
    "write_extra_paths_yaml", "yaml_quote",
]

if __name__ == "__main__":
    raise SystemExit(main())
