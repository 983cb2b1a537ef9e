"""What every part of the runner shares: exit statuses, its exceptions, the checkout it links into ComfyUI."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout: the folder ComfyUI loads as the custom node pack

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SERVER = 0, 1, 2, 3


class RunnerError(RuntimeError):
    """The runner could not do its job (server did not start, HTTP failure, bad workflow file)."""

    exit_code = EXIT_SERVER


class WorkflowFileError(RunnerError):
    """The workflow file is missing, unreadable, not strict JSON, too large or deep, or structurally broken."""

    exit_code = EXIT_USAGE


class WorkflowFailed(RuntimeError):
    """The server rejected or failed the workflow; ``str()`` is the formatted error report."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, status: int | None = None, body: Any = None, entry: Any = None):
        super().__init__(message)
        self.status, self.body, self.entry = status, body, entry


def short(v: Any, n: int = 300) -> str:
    """``v`` as one line of at most ``n`` characters (JSON for non-strings)."""
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."
