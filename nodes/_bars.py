"""Progress-bar callbacks for core functions that know their total only once they start (tile plans, tensor
counts, layer counts): ``bridge/reports.py`` (ComfyUI's progress bar); re-exported for the node modules."""
from __future__ import annotations

from ..bridge.reports import lazy_bar, offset_bar  # noqa: F401
